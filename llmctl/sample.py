"""Text generation from a GPT-2 checkpoint with a KV cache, and the cached forward it runs on.

What it is:
- `KVCache` + `forward_cached`: GPT-2's forward over Tq NEW positions per row, attending to the
  keys/values of all earlier positions kept in a per-layer cache (decode: one position per step
  instead of llm.c's full recompute of every position). Exact up to float32 rounding, because
  attention is causal: a position never sees later ones. `evaluate.py` reuses the per-layer
  pieces to run a HellaSwag context once for its four completions.
- `generate`: the sampling loop, `llmctl sample` and training's `-s/-g` samples call it.
  Plain sampling (temperature 1, no top-k/top-p) is llm.c's `sample_softmax` (llmc/sampler.h)
  with llm.c's xorshift64* `random_f32` coins; temperature 0 is greedy (argmax, ties to the
  lowest id); top-k / top-p filter the distribution, then the coin walks the CDF in id order.
- `StreamDecoder`: token ids -> printable text as they arrive (incremental UTF-8, control bytes
  escaped for terminals).
What it is not: a training forward (no activations kept, no backward; that is llmctl/model.py)
and not batched sampling (samples run one after another from one RNG stream).

Mirrors: train_gpt2.c `gpt2_forward` (per layer: LN, qkv matmul, attention, proj, residual, LN,
fc, GELU, fcproj, residual; final LN; logits = lnf @ wte^T over the first V rows), llmc/sampler.h,
llmc/rand.h-style xorshift (`random_u32`/`random_f32` in train_gpt2.c).
"""
import codecs
import math
import unicodedata

import numpy as np

from llmctl.errors import ConfigError
from llmctl.formats import GPT2_EOT as EOT
from llmctl.info import default_threads

# Temperatures below this are greedy (argmax, no coin drawn). Any logit gap above ~1e-4 already
# gives the runner-up < exp(-100) at T = 1e-6, and a subnormal T (1e-320) made z / T overflow
# to inf - inf = NaN, which used to sample the last id (EOT) instead of the best one.
GREEDY_BELOW = 1e-6
_MIN_PARALLEL = 1 << 16   # floats of element-wise work below which kernels run on one thread


# ----------------------------------------------------------------------------------------------
# weights and the cache

class _Weights:
    """Shaped float32 views of a model's 16 parameter tensors plus the config dimensions."""

    def __init__(self, model):
        cfg = model.config
        self.maxT, self.V, self.Vp = cfg.max_seq_len, cfg.vocab_size, cfg.padded_vocab_size
        self.L, self.NH, self.C = cfg.num_layers, cfg.num_heads, cfg.channels
        L, C, Vp, maxT = self.L, self.C, self.Vp, self.maxT
        shapes = {"wte": (Vp, C), "wpe": (maxT, C), "ln1w": (L, C), "ln1b": (L, C),
                  "qkvw": (L, 3 * C, C), "qkvb": (L, 3 * C), "attprojw": (L, C, C),
                  "attprojb": (L, C), "ln2w": (L, C), "ln2b": (L, C), "fcw": (L, 4 * C, C),
                  "fcb": (L, 4 * C), "fcprojw": (L, C, 4 * C), "fcprojb": (L, C),
                  "lnfw": (C,), "lnfb": (C,)}
        for name, shape in shapes.items():
            a = np.asarray(model.p[name])
            if a.dtype != np.float32 or a.size != int(np.prod(shape)):
                raise ValueError(f"model.p[{name!r}] is {a.dtype} x {a.size}, expected float32 {shape}")
            setattr(self, name, a.reshape(shape))
        self.wte_V = self.wte[:self.V]  # the lm head: padded rows are zero and never sampled
        self.K, self.Ly, self.KV = _kernels()
        self.mm = getattr(model, "matmul_backend", "blas")
        self.n_threads = getattr(model, "n_threads", None) or default_threads()


def _weights(model):
    # cache the views on the model object (rebuilt if its parameter buffer was replaced)
    ptr = np.asarray(model.p["wte"]).__array_interface__["data"][0]
    w = getattr(model, "_llmctl_cached_weights", None)
    if w is None or w.src_ptr != ptr:
        w = _Weights(model)
        w.src_ptr = ptr
        try:
            model._llmctl_cached_weights = w
        except AttributeError:
            pass
    return w


class KVCache:
    """Past keys/values of B rows: k[l], v[l] are (B, NH, Tcap, hs) float32; `lengths[b]` is how
    many positions row b holds (its next new position)."""

    def __init__(self, config, B, Tcap):
        L, NH, C = config.num_layers, config.num_heads, config.channels
        self.B, self.Tcap = int(B), int(Tcap)
        # np.empty: attention only ever reads positions that were written first
        self.k = np.empty((L, B, NH, Tcap, C // NH), dtype=np.float32)
        self.v = np.empty((L, B, NH, Tcap, C // NH), dtype=np.float32)
        self.lengths = np.zeros(B, dtype=np.int32)


# ----------------------------------------------------------------------------------------------
# layers: the shared kernels (matmul, layers) plus the cached attention of _ext/kvcache.pyx.
# Activations are 2-D (N = B*Tq rows, C) float32 C-contiguous arrays.

def _kernels():
    try:
        from llmctl._ext import kvcache, layers, matmul
    except ImportError as e:
        raise ConfigError(f"llmctl's Cython kernels are not built ({e})",
                          "run: python setup.py build_ext --inplace (or pip install -e .)") from e
    return matmul, layers, kvcache


def _linear(w, x, W, b, n_threads):
    N, Cin = x.shape
    OC = W.shape[0]
    out = np.empty((N, OC), dtype=np.float32)
    if N == 1:
        # a decode step is matrix-vector: BLAS sgemv (through NumPy, whose BLAS pool
        # configure_threads also sizes) streams the weights ~5x faster than sgemm with M = 1
        np.matmul(W, x[0], out=out[0])
        if b is not None:
            out += b
        return out
    w.K.matmul_forward(out.reshape(-1), x.reshape(-1), W.reshape(-1), b, N, Cin, OC, n_threads, w.mm)
    return out


def _layernorm(w, x, weight, bias, n_threads):
    N, C = x.shape
    out = np.empty_like(x)
    mean = np.empty(N, dtype=np.float32)
    rstd = np.empty(N, dtype=np.float32)
    w.Ly.layernorm_forward(out.reshape(-1), mean, rstd, x.reshape(-1), weight, bias, N, C, n_threads)
    return out


def embed(w, tokens, pos):
    """x (B*Tq, C) = wte[tokens] + wpe[pos[b] + t]. Positions past maxT (padding only) are clamped."""
    B, Tq = tokens.shape
    p = pos[:, None].astype(np.int64) + np.arange(Tq)[None, :]
    np.minimum(p, w.maxT - 1, out=p)
    x = w.wte[tokens.reshape(-1)]
    x += w.wpe[p.reshape(-1)]
    return x


def block_forward(w, l, x, k, v, pos, n_threads):
    """One transformer block over x (B*Tq, C) whose row b holds positions pos[b] .. pos[b]+Tq-1;
    writes their K/V into k, v (B,NH,Tcap,hs) (layer l's cache) and attends to every cached
    position up to each query. Returns the new residual stream (B*Tq, C)."""
    B, NH, Tcap, hs = k.shape
    C = w.C
    Tq = x.shape[0] // B
    pos = np.ascontiguousarray(pos, dtype=np.int32)
    # A decode step's element-wise work (a few thousand floats) and attention are far too small
    # to split: a second thread only adds a barrier, which costs milliseconds when the core is
    # busy. Only the weight-streaming matmuls get all threads there.
    nt_ew = n_threads if x.size * 4 >= _MIN_PARALLEL else 1
    nt_att = n_threads if B * Tq * Tcap * C >= _MIN_PARALLEL * 16 else 1
    ln1 = _layernorm(w, x, w.ln1w[l], w.ln1b[l], nt_ew)
    qkv = _linear(w, ln1, w.qkvw[l], w.qkvb[l], n_threads)
    kf, vf, qf = k.reshape(-1), v.reshape(-1), qkv.reshape(-1)
    w.KV.kvcache_append_forward(kf, vf, qf, pos, B, Tq, C, NH, Tcap)
    atty = np.empty_like(x)
    w.KV.attention_cached(atty.reshape(-1), qf, kf, vf, pos, B, Tq, C, NH, Tcap, nt_att)
    x2 = _linear(w, atty, w.attprojw[l], w.attprojb[l], n_threads)
    n = x2.size
    w.Ly.residual_forward(x2.reshape(-1), x2.reshape(-1), x.reshape(-1), n, nt_ew)
    ln2 = _layernorm(w, x2, w.ln2w[l], w.ln2b[l], nt_ew)
    fch = _linear(w, ln2, w.fcw[l], w.fcb[l], n_threads)
    w.Ly.gelu_forward(fch.reshape(-1), fch.reshape(-1), fch.size, nt_ew)
    x3 = _linear(w, fch, w.fcprojw[l], w.fcprojb[l], n_threads)
    w.Ly.residual_forward(x3.reshape(-1), x3.reshape(-1), x2.reshape(-1), n, nt_ew)
    return x3


def final_norm(w, x, n_threads):
    return _layernorm(w, np.ascontiguousarray(x), w.lnfw, w.lnfb, n_threads)


def lm_logits(w, h, n_threads):
    """Logits over the real vocab V only (padded rows are zero and never sampled): (N, V)."""
    h = np.ascontiguousarray(h, dtype=np.float32).reshape(-1, w.C)
    return _linear(w, h, w.wte_V, None, n_threads)


def forward_cached(model, cache, tokens, n_threads=None):
    """Run tokens (B,Tq) int as the next Tq positions of each cached row; return the final
    layernormed hidden states (B,Tq,C) (logits: `lm_logits`). Advances cache.lengths by Tq."""
    w = _weights(model)
    n_threads = int(n_threads or w.n_threads)
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[0] != cache.B or tokens.shape[1] < 1:
        raise ValueError(f"tokens must be (B={cache.B}, Tq >= 1), got shape {tokens.shape}")
    B, Tq = tokens.shape
    end = int(cache.lengths.max()) + Tq
    if end > cache.Tcap:
        raise ValueError(f"cache of {cache.Tcap} positions cannot take {Tq} more after {end - Tq}")
    if end > w.maxT:
        raise ConfigError(f"sequence of {end} tokens exceeds the model's maxT = {w.maxT}")
    if tokens.min() < 0 or tokens.max() >= w.V:
        raise ConfigError(f"token ids must be in [0, {w.V})")
    x = embed(w, tokens, cache.lengths)
    for l in range(w.L):
        x = block_forward(w, l, x, cache.k[l], cache.v[l], cache.lengths, n_threads)
    cache.lengths += Tq
    return final_norm(w, x, n_threads).reshape(B, Tq, w.C)


def logits_from_hidden(model, h, n_threads=None):
    """Logits (..., V) over the real vocab for hidden states h (..., C) from forward_cached."""
    w = _weights(model)
    h = np.asarray(h)
    return lm_logits(w, h, int(n_threads or w.n_threads)).reshape(h.shape[:-1] + (w.V,))


# ----------------------------------------------------------------------------------------------
# sampling

class Xorshift:
    """llm.c's sampler RNG (train_gpt2.c random_u32 / random_f32): xorshift64*."""

    _MASK = (1 << 64) - 1

    def __init__(self, seed=1337):
        self.state = int(seed) & self._MASK

    def random_u32(self):
        s = self.state
        s ^= s >> 12
        s ^= (s << 25) & self._MASK
        s ^= s >> 27
        self.state = s
        return ((s * 0x2545F4914F6CDD1D) & self._MASK) >> 32

    def random_f32(self):
        return (self.random_u32() >> 8) / 16777216.0


def sample_token(logits, coin, temperature=1.0, top_k=None, top_p=None):
    """One token id from logits (V,) float32 with a coin in [0,1).

    temperature 1, no top-k/top-p: exactly llm.c's sample_softmax(logits, V, coin).
    Otherwise probabilities = softmax(logits / temperature) restricted to the top_k largest
    and/or the smallest set of most likely ids whose mass reaches top_p (always >= 1 id),
    renormalised; the coin walks their CDF in id order. temperature 0 = argmax (callers skip
    the coin)."""
    from llmctl._ext.kvcache import sample_softmax

    logits = np.ascontiguousarray(logits, dtype=np.float32)
    V = logits.shape[0]
    if temperature < GREEDY_BELOW:
        return int(np.argmax(logits))
    k = int(top_k) if top_k else 0
    if k >= V:
        k = 0
    p_top = float(top_p) if top_p is not None else 1.0
    if temperature == 1.0 and k == 0 and p_top >= 1.0:
        return int(sample_softmax(logits, float(coin)))
    z = logits.astype(np.float64)
    z = (z - z.max()) / float(temperature)  # <= 0 everywhere: exp never overflows
    keep = np.arange(V)
    if k > 0:
        keep = np.argpartition(-z, k - 1)[:k]
    if p_top < 1.0:
        cand = keep
        zc = z[cand]
        pc = np.exp(zc - zc.max())
        pc /= pc.sum()
        order = np.argsort(-pc, kind="stable")
        csum = np.cumsum(pc[order])
        n_keep = int(np.searchsorted(csum, p_top, side="left")) + 1  # first prefix reaching p
        keep = cand[order[:min(n_keep, order.size)]]
    probs = np.zeros(V, dtype=np.float64)
    zk = z[keep]
    probs[keep] = np.exp(zk - zk.max())
    cdf = np.cumsum(probs)
    i = int(np.searchsorted(cdf, coin * cdf[-1], side="right"))
    if i >= V or probs[i] == 0.0:  # rounding at the top end: take the last kept id
        i = int(np.max(keep))
    return i


def check_sampling(temperature=1.0, top_k=None, top_p=None):
    """ConfigError (exit 2) unless temperature is finite and >= 0, top_p in (0, 1], top_k >= 0."""
    if not (math.isfinite(float(temperature)) and temperature >= 0):
        raise ConfigError(f"--temperature {temperature}: must be a finite number >= 0",
                          hint="0 = greedy, 1 = the model's distribution")
    if top_p is not None and not (math.isfinite(float(top_p)) and 0.0 < top_p <= 1.0):
        raise ConfigError(f"--top-p {top_p}: must be in (0, 1]", hint="1 = off")
    if top_k is not None and top_k < 0:
        raise ConfigError(f"--top-k {top_k}: must be >= 0", hint="0 = off")


def default_start(vocab_size, eot=EOT):
    """The token a prompt-less sample starts from, as train's sampler does: EOT if the vocabulary
    has it, else token 0. -> (token, note or None); the note says why token 0 was used."""
    if eot < vocab_size:
        return eot, None
    return 0, (f"the model's vocabulary has {vocab_size} tokens, so it has no <|endoftext|> "
               f"({eot}); starting from token 0 instead")


def check_sample_length(config, n_prompt, max_new_tokens):
    """How many new tokens fit after a prompt of n_prompt tokens (prompt + new <= maxT).
    -> (n, message or None); raises ConfigError if the prompt alone does not fit."""
    maxT = config.max_seq_len
    if n_prompt < 1:
        raise ConfigError("the prompt is empty", hint="pass --prompt TEXT or omit it to start from <|endoftext|>")
    if n_prompt >= maxT:
        raise ConfigError(f"the prompt is {n_prompt} tokens; the model's context is maxT = {maxT}, "
                          "leaving no room to generate", hint="use a shorter prompt")
    room = maxT - n_prompt
    if max_new_tokens > room:
        return room, (f"-n {max_new_tokens} does not fit: prompt {n_prompt} + new tokens must be "
                      f"<= maxT {maxT}; generating {room} tokens")
    return max_new_tokens, None


def generate(model, prompt_tokens, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
             seed=1337, use_cache=True, stop_at_eot=True, on_token=None, n_threads=None,
             rng=None, eot=EOT):
    """Generate up to max_new_tokens ids after prompt_tokens; returns the generated ids (the EOT
    that stopped generation included). An empty prompt starts from [eot], like llm.c.

    on_token(id) is called as each id is chosen. `rng` (an Xorshift) continues an existing coin
    stream; otherwise a fresh one is seeded with `seed`. use_cache=False recomputes the full
    forward over all positions at every step (llm.c's way; for benchmarks and tests).
    Raises ConfigError if prompt + max_new_tokens exceeds the model's maxT."""
    cfg = model.config
    prompt = [int(t) for t in prompt_tokens] or [default_start(cfg.vocab_size, eot)[0]]
    if any(t < 0 or t >= cfg.vocab_size for t in prompt):
        raise ConfigError(f"prompt token ids must be in [0, {cfg.vocab_size})",
                          hint="this model's vocabulary is smaller than GPT-2's; use a shorter/plainer prompt")
    n, msg = check_sample_length(cfg, len(prompt), int(max_new_tokens))
    if msg is not None:
        raise ConfigError(msg, hint="lower -n or shorten the prompt")
    check_sampling(temperature, top_k, top_p)
    rng = rng if rng is not None else Xorshift(seed)
    out = []
    if use_cache:
        n_threads = int(n_threads or _weights(model).n_threads)
        cache = KVCache(cfg, 1, len(prompt) + n)
        h = forward_cached(model, cache, np.array([prompt], dtype=np.int32), n_threads)
        logits = logits_from_hidden(model, h[0, -1], n_threads)
    else:
        seq = list(prompt)
        logits = _full_forward_last_logits(model, seq, cfg.vocab_size)
    for i in range(n):
        if temperature < GREEDY_BELOW:  # greedy; no coin drawn, as for temperature 0
            tok = int(np.argmax(logits))
        else:
            tok = sample_token(logits, rng.random_f32(), temperature, top_k, top_p)
        out.append(tok)
        if on_token is not None:
            on_token(tok)
        if (stop_at_eot and tok == eot) or i == n - 1:
            break
        if use_cache:
            h = forward_cached(model, cache, np.array([[tok]], dtype=np.int32), n_threads)
            logits = logits_from_hidden(model, h[0, -1], n_threads)
        else:
            seq.append(tok)
            logits = _full_forward_last_logits(model, seq, cfg.vocab_size)
    return out


def _full_forward_last_logits(model, seq, V):
    model.forward(np.array([seq], dtype=np.int32))
    return np.array(model.logits()[0, len(seq) - 1, :V], dtype=np.float32)


# ----------------------------------------------------------------------------------------------
# streaming text

def _escape_controls(s):
    # keep \n and \t; show any other control character (ESC, CR, DEL, C1 ...) as an escape
    if all(c in "\n\t" or unicodedata.category(c) != "Cc" for c in s):
        return s
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else
                   (f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}") for c in s)


class StreamDecoder:
    """Token ids -> text pieces as they arrive. Bytes of a character split across tokens are held
    back until complete; invalid UTF-8 becomes U+FFFD. With escape=True control characters other
    than newline and tab are printed as \\xNN (safe for terminals)."""

    def __init__(self, tokenizer, escape=True):
        self.tokenizer = tokenizer
        self.escape = escape
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id):
        s = self._dec.decode(self.tokenizer.decode_bytes([int(token_id)]))
        return _escape_controls(s) if self.escape else s

    def flush(self):
        s = self._dec.decode(b"", final=True)
        return _escape_controls(s) if self.escape else s


def sample(model, prompt_tokens, num_samples=1, max_new_tokens=64, temperature=1.0, top_k=None,
           top_p=None, seed=1337, use_cache=True, tokenizer=None, on_text=None, n_threads=None,
           escape=True, on_sample_start=None, on_sample_end=None):
    """`llmctl sample`: num_samples generations from one seeded coin stream.
    on_text(sample_index, text_piece) streams printable text; on_sample_start(i) and
    on_sample_end(i, result) bracket each sample. -> list of dicts {prompt_tokens, tokens, text}
    (tokens = generated ids incl. a final EOT; text = their decoding without it)."""
    from llmctl.tokenizer import get_tokenizer

    tok = tokenizer or get_tokenizer()
    rng = Xorshift(seed)
    results = []
    for s in range(num_samples):
        if on_sample_start is not None:
            on_sample_start(s)
        dec = StreamDecoder(tok, escape=escape)

        def on_token(t, s=s, dec=dec):
            if t == tok.eot:
                return
            piece = dec.feed(t)
            if on_text is not None and piece:
                on_text(s, piece)

        ids = generate(model, prompt_tokens, max_new_tokens, temperature, top_k, top_p,
                       use_cache=use_cache, on_token=on_token, n_threads=n_threads, rng=rng,
                       eot=tok.eot)
        tail = dec.flush()
        if tail and on_text is not None:
            on_text(s, tail)
        text_ids = ids[:-1] if ids and ids[-1] == tok.eot else ids
        start = [default_start(model.config.vocab_size, tok.eot)[0]]
        results.append({"prompt_tokens": [int(t) for t in prompt_tokens] or start,
                        "tokens": ids, "text": tok.decode(text_ids)})
        if on_sample_end is not None:
            on_sample_end(s, results[-1])
    return results
