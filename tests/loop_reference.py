"""Float64 NumPy reference of llm.c's whole training loop (train_gpt2.cu `main`), apart from llmctl.

What it is: everything between the files on disk and the numbers a run logs, re-derived from
llm.c's sources and written without llmctl's code, so a wrong schedule, a skipped clip, weight
decay on the wrong tensors, a wrong batch order or a wrong val average in llmctl cannot hide here:
- the file formats: token shards (`dev/data/data_common.py` `write_datafile`) and float32 v3
  checkpoints (`train_gpt2.py` `write_model`), written and read with plain NumPy;
- `MT19937`: llmc/rand.h's generator (PyTorch's CPU mt19937) in pure Python,
  `random_permutation` and the first block of `normal_` (`normal16`);
- `Loader`: llmc/dataloader.h's state machine (sorted glob, shard order permuted in place every
  epoch, samples permuted from identity on entering a shard, rank r's B*T+1 slice of each
  P*B*T sample, RNG seeded 42 + r);
- `learning_rate`: llmc/schedulers.h (cosine, linear, constant, wsd) in float64;
- `training_sample`: the sample train_gpt2.cu prints (xorshift64* seeded 1337, sample_softmax);
- `run`: the loop order of train_gpt2.cu for step = 0..N (val loss averaged over val_num_batches
  and over ranks, then the micro-steps with dloss = 1/(B*T*accum), the gradients averaged over
  ranks, the global L2 norm, the clip at 1.0 as grad_scale = 1/norm, AdamW with weight decay on the
  matrices only (the 2-D tensors per layer: wte, wpe, qkvw, attprojw, fcw, fcprojw)), with the
  GPT-2 forward/backward of tests/reference.py in float64.
What it is not: fast (a few ms per step for the tiny models the tests use), or a model of -a 1,
checkpoints or -sl/-sg. Ranks are simulated in one process: each rank's gradients are
computed in turn and averaged, which is what an exact all-reduce gives.
"""
import glob
import math

import numpy as np

import reference as R

SHARD_MAGIC, SHARD_VERSION = 20240520, 1
CKPT_MAGIC, CKPT_VERSION = 20240326, 3
HEADER_INTS = 256
CKPT_FIELDS = ("max_seq_len", "vocab_size", "num_layers", "num_heads", "channels",
               "padded_vocab_size")


# ----------------------------------------------------------------------------------------------
# files

def write_shard(path, tokens):
    """An llm.c GPT-2 token shard: 256 int32 header (magic, version 1, N), then N uint16."""
    tokens = np.asarray(tokens)
    assert tokens.min() >= 0 and tokens.max() < 2 ** 16
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, tokens.size)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def read_shard(path):
    raw = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    assert raw[0] == SHARD_MAGIC and raw[1] == SHARD_VERSION, path
    toks = np.fromfile(path, dtype="<u2", offset=4 * HEADER_INTS)
    assert toks.size == raw[2], path
    return toks


def write_checkpoint(path, cfg, params):
    """A float32 v3 checkpoint: header [magic, 3, maxT, V, L, NH, C, Vp], then the 16 tensors."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:8] = (CKPT_MAGIC, CKPT_VERSION, *(cfg[k] for k in CKPT_FIELDS))
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(R.params_to_flat(params, cfg, dtype="<f4").tobytes())


def read_checkpoint(path):
    """-> (cfg dict, params dict of float64 arrays) of a float32 v3 checkpoint."""
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    assert header[0] == CKPT_MAGIC and header[1] == CKPT_VERSION, path
    cfg = dict(zip(CKPT_FIELDS, (int(x) for x in header[2:8])))
    flat = np.fromfile(path, dtype="<f4", offset=4 * HEADER_INTS)
    return cfg, R.params_from_flat(flat, cfg)


# ----------------------------------------------------------------------------------------------
# llmc/rand.h

class MT19937:
    """The 32-bit Mersenne Twister as llmc/rand.h (and PyTorch's CPU generator) seeds and runs it."""

    N, M = 624, 397

    def __init__(self, seed):
        mt = [seed & 0xFFFFFFFF]
        for i in range(1, self.N):
            mt.append((1812433253 * (mt[-1] ^ (mt[-1] >> 30)) + i) & 0xFFFFFFFF)
        self.mt, self.index = mt, self.N

    def _twist(self):
        mt, N, M = self.mt, self.N, self.M
        for i in range(N):
            y = (mt[i] & 0x80000000) | (mt[(i + 1) % N] & 0x7FFFFFFF)
            mt[i] = mt[(i + M) % N] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
        self.index = 0

    def randint32(self):
        if self.index >= self.N:
            self._twist()
        y = self.mt[self.index]
        self.index += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        y ^= y >> 18
        return y & 0xFFFFFFFF


def normal16(rng, mean=0.0, std=1.0):
    """The first 16 values of rand.h normal_(n >= 16): 16 uniforms (24 bits of a randint32 each),
    then Box-Muller on the pairs (t, t+8) with u1 = 1 - u[t] (in float64 here)."""
    u = [(rng.randint32() & 0xFFFFFF) / 16777216.0 for _ in range(16)]
    out = [0.0] * 16
    for t in range(8):
        radius = math.sqrt(-2.0 * math.log(1.0 - u[t] + 1e-12))
        theta = 2.0 * math.pi * u[t + 8]
        out[t] = radius * math.cos(theta) * std + mean
        out[t + 8] = radius * math.sin(theta) * std + mean
    return out


def random_permutation(a, rng):
    """rand.h random_permutation on a Python list, in place: i = n-1..1, j = randint32() % (i+1)."""
    for i in range(len(a) - 1, 0, -1):
        j = rng.randint32() % (i + 1)
        a[i], a[j] = a[j], a[i]
    return a


# ----------------------------------------------------------------------------------------------
# llmc/dataloader.h

class Loader:
    """dataloader_init / reset / advance / next_batch of llmc/dataloader.h, in tokens not bytes."""

    def __init__(self, pattern, B, T, rank=0, P=1, shuffle=True, seed=42):
        self.B, self.T, self.rank, self.P, self.shuffle = B, T, rank, P, shuffle
        self.files = sorted(glob.glob(pattern))
        assert self.files, pattern
        self.shards = [read_shard(f) for f in self.files]
        self.sample_tokens = P * B * T
        for s in self.shards:
            assert s.size >= self.sample_tokens + 1
        self.num_tokens = sum(s.size for s in self.shards)
        if shuffle:
            self.rng = MT19937(seed + rank)
            self.shard_order = list(range(len(self.files)))
        self.reset()

    def _enter_shard(self, i):
        self.shard_idx, self.sample_idx = i, 0
        self.tokens = self.shards[self.shard_order[i] if self.shuffle else i]
        self.num_samples = (self.tokens.size - 1) // self.sample_tokens
        if self.shuffle:  # a fresh identity each time a shard is entered
            self.sample_order = random_permutation(list(range(self.num_samples)), self.rng)

    def reset(self):
        if self.shuffle:  # permutes the current order: permutations compose across epochs
            random_permutation(self.shard_order, self.rng)
        self._enter_shard(0)

    def next_batch(self):
        if self.sample_idx >= self.num_samples:
            if self.shard_idx == len(self.files) - 1:
                self.reset()
            else:
                self._enter_shard(self.shard_idx + 1)
        s = self.sample_order[self.sample_idx] if self.shuffle else self.sample_idx
        self.sample_idx += 1
        start = s * self.sample_tokens + self.rank * self.B * self.T
        buf = self.tokens[start:start + self.B * self.T + 1].astype(np.int64)
        return buf[:-1].reshape(self.B, self.T), buf[1:].reshape(self.B, self.T)


# ----------------------------------------------------------------------------------------------
# llmc/schedulers.h (float64)

def learning_rate(kind, step, lr, warmup, num_steps, final_frac):
    """The lr at 0-based `step` of `num_steps`."""
    min_lr = lr * final_frac
    if kind == "constant":  # no warmup in llm.c's constant schedule
        return lr
    if step < warmup:
        return lr * (step + 1) / warmup
    if kind == "wsd":
        decay_point = int(0.8 * num_steps)
        if step < decay_point:
            return lr
        r = (step - decay_point) / (num_steps - decay_point)
        return min_lr + (1.0 - math.sqrt(r)) * (lr - min_lr)
    r = (step - warmup) / (num_steps - warmup)
    assert 0.0 <= r <= 1.0
    if kind == "cosine":
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * r)) * (lr - min_lr)
    if kind == "linear":
        return lr - r * (lr - min_lr)
    raise ValueError(kind)


# ----------------------------------------------------------------------------------------------
# train_gpt2.c random_u32 / random_f32 and llmc/sampler.h

class XorShift:
    """xorshift64* of train_gpt2.c: the coins of the samples printed during training."""

    def __init__(self, seed=1337):
        self.state = seed

    def random_f32(self):
        s = self.state
        s ^= s >> 12
        s = (s ^ (s << 25)) & 0xFFFFFFFFFFFFFFFF
        s ^= s >> 27
        self.state = s
        u32 = ((s * 0x2545F4914F6CDD1D) & 0xFFFFFFFFFFFFFFFF) >> 32
        return (u32 >> 8) / 16777216.0


def sample_softmax(logits, coin):
    """llmc/sampler.h: walk the CDF of exp(logits) (no max subtraction) until it passes coin*norm."""
    e = np.exp(np.asarray(logits, dtype=np.float64))
    i = int(np.searchsorted(np.cumsum(e), coin * e.sum(), side="right"))
    return min(i, e.size - 1)


def training_sample(params, cfg, gen_tokens, eot):
    """train_gpt2.cu's sample: from [eot], gen_tokens-1 ids, coins from a fresh xorshift(1337),
    each from the logits of the last position over the first V entries (full forward each time)."""
    rng, ids = XorShift(1337), [eot]
    for _ in range(1, gen_tokens):
        _, logits, _ = R.gpt2_forward(params, np.array([ids]), None, cfg)
        ids.append(sample_softmax(logits[0, -1, :cfg["vocab_size"]], rng.random_f32()))
    return ids[1:]


# ----------------------------------------------------------------------------------------------
# train_gpt2.cu main loop

def decays(name, shape):
    """Weight decay applies to the matrices: 2-D tensors, per layer for the layered ones."""
    per_layer = name not in ("wte", "wpe", "lnfw", "lnfb")  # these have a leading L axis
    return len(shape) - per_layer == 2


def run(init, train_pattern, val_pattern, B, T, num_steps, P=1, total_batch=None, lr=3e-4,
        schedule="cosine", warmup=0, final_frac=1.0, weight_decay=0.0, grad_clip=1.0,
        val_every=0, val_max_steps=20, sample_every=0, gen_tokens=64, seed=42, beta1=0.9,
        beta2=0.95, eps=1e-8):
    """Train like `llmctl train -e init -i train -j val -b B -t T -x num_steps --nproc P -d ...`.

    -> {"steps": [{"step", "train_loss", "lr", "grad_norm"}...], "val": {step: loss},
        "samples": {step: ids}, "params": final float64 params, "grad_accum_steps": n}
    """
    cfg, params = read_checkpoint(init)
    total_batch = B * T * P if total_batch in (None, -1) else total_batch
    assert total_batch % (B * T * P) == 0
    accum = total_batch // (B * T * P)
    train = [Loader(train_pattern, B, T, r, P, shuffle=True, seed=seed) for r in range(P)]
    val = [Loader(val_pattern, B, T, r, P, shuffle=False) for r in range(P)] if val_every else []
    val_batches = (val_max_steps if val_max_steps != -1 else val[0].num_tokens // (B * T * P)
                   if val else 0)
    wd = {n: weight_decay if decays(n, s) else 0.0 for n, s in R.param_shapes(cfg)}
    m = {n: np.zeros(s) for n, s in R.param_shapes(cfg)}
    v = {n: np.zeros(s) for n, s in R.param_shapes(cfg)}
    out = {"steps": [], "val": {}, "samples": {}, "grad_accum_steps": accum}
    eot = 50256 if cfg["vocab_size"] > 50256 else 0  # a tiny vocabulary has no GPT-2 EOT
    for step in range(num_steps + 1):
        last = step == num_steps
        if val_every > 0 and (step % val_every == 0 or last):
            rank_means = []
            for ld in val:
                ld.reset()
                losses = [R.gpt2_loss(params, *ld.next_batch(), cfg) for _ in range(val_batches)]
                rank_means.append(sum(losses) / val_batches)
            out["val"][step] = sum(rank_means) / P
        if sample_every > 0 and ((step > 0 and step % sample_every == 0) or last):
            n = min(gen_tokens, cfg["max_seq_len"])
            out["samples"][step] = training_sample(params, cfg, n, eot)
        if last:
            break
        grads = {n: np.zeros(s) for n, s in R.param_shapes(cfg)}
        loss = 0.0
        for ld in train:  # rank by rank; the mean over ranks is the all-reduce
            for _ in range(accum):
                x, y = ld.next_batch()
                l, _, cache = R.gpt2_forward(params, x, y, cfg)
                g = R.gpt2_backward(params, cache, cfg, loss_scale=1.0 / accum)
                loss += l / (accum * P)
                for n in grads:
                    grads[n] += g[n] / P
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
        rate = learning_rate(schedule, step, lr, warmup, num_steps, final_frac)
        scale = grad_clip / norm if grad_clip > 0 and norm > grad_clip else 1.0
        for n in params:
            params[n], m[n], v[n] = R.adamw_step(params[n], grads[n], m[n], v[n], rate, beta1,
                                                 beta2, eps, wd[n], step + 1, grad_scale=scale)
        out["steps"].append({"step": step, "train_loss": loss, "lr": rate, "grad_norm": norm})
    out["params"] = params
    return out
