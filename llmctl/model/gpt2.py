"""The training GPT-2 over llmctl's Cython kernels: parameters, activations, forward, backward, AdamW.

What it is: the `gpt2_*` half of llm.c's `train_gpt2.c` written in Python. One contiguous float32
parameter buffer with named views in llm.c's checkpoint order (train_gpt2.c
`fill_in_parameter_sizes`), gradients in the same layout (one buffer: checkpoint I/O is one
read/write, the all-reduce one call), AdamW m/v the same way, and activations allocated once and
reused. The layer loop, shapes, validation and
memory plan live here; every arithmetic loop is a kernel in `llmctl._ext` (matmul, layers,
attention, adamw), called with flat views and explicit sizes.
What it is not: a kernel (no per-element math in Python), a trainer (no schedule, data or
logging: see llmctl/train.py), the KV-cached inference forward (llmctl/model/cached.py),
a sampler (llmctl/sample.py), or the shape table (llmctl/model/config.py).

Differences from train_gpt2.c, on purpose:
- Attention is flash-style: only the per-row log-sum-exp (B,NH,T) is kept, never (B,NH,T,T).
- attproj/fcproj outputs are written straight into the residual-stream buffers; fch_gelu is
  kept per layer only while that is small (<= 256 MiB), else recomputed in backward from fch;
  activation gradients exist for ONE layer at a time; the logits buffer is reused in place as
  probs and then as dlogits.
- AdamW is llm.c's GPU trainer's (llmc/adamw.cuh `adamw_kernel3`): weight decay only on the
  2-D tensors, grad_scale for clipping, t 1-based.
- forward accepts any B, T with T <= maxT; buffers grow only when B*T grows.
See docs/model.md for the byte count.
"""
import math

import numpy as np

from llmctl.errors import ConfigError
from llmctl.model.config import PARAM_NAMES, GPT2Config, num_parameters, param_offsets

DECAY_PARAMS = {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}
INIT_SEED = 42


def init_llmc_(p, cfg, seed=INIT_SEED, libm=None, n_threads=1):
    """llm.c's random init (train_gpt2.cu gpt2_build_from_descriptor) into the views p, which
    must be zero: LN weights 1; one mt19937(seed) drawing normal_ in PyTorch module order: wte
    (first V rows only), wpe, then per layer qkvw, attprojw, fcw, fcprojw; std 0.02, and
    0.02/sqrt(2L) for the two projections into the residual stream (computed in float).
    libm as in Mt19937.normal_: None (default) is bit-exact through llmctl._ext.randinit."""
    from llmctl.rand import Mt19937, release_libm_memo

    L, V = cfg.num_layers, cfg.vocab_size
    for name in ("ln1w", "ln2w", "lnfw"):
        p[name][...] = 1.0
    rng = Mt19937(seed)
    std = np.float32(0.02)
    proj_std = std * (np.float32(1.0) / np.sqrt(np.float32(2.0) * np.float32(L)))
    kw = dict(libm=libm, n_threads=n_threads)
    rng.normal_(p["wte"][:V], 0.0, std, **kw)  # padded rows stay zero
    rng.normal_(p["wpe"], 0.0, std, **kw)
    for l in range(L):
        rng.normal_(p["qkvw"][l], 0.0, std, **kw)
        rng.normal_(p["attprojw"][l], 0.0, proj_std, **kw)
        rng.normal_(p["fcw"][l], 0.0, std, **kw)
        rng.normal_(p["fcprojw"][l], 0.0, proj_std, **kw)
    if libm:
        release_libm_memo()


def _views(buf, offsets):
    return {name: buf[off:off + n].reshape(shape) for name, (off, n, shape) in offsets.items()}


def _kernels():
    """The compiled kernels, or a ConfigError saying how to build them."""
    try:
        from llmctl._ext import adamw, attention, layers, matmul
    except ImportError as e:
        raise ConfigError(f"llmctl's Cython kernels are not built ({e})",
                          "run: python setup.py build_ext --inplace (or pip install -e .)") from e
    return matmul, layers, attention, adamw


# ----------------------------------------------------------------------------------------------
# model

class GPT2:
    """GPT-2 with flat float32 parameters/gradients and kernel-driven forward/backward.

    params/grads: 1-D float32 (num_parameters); p/g: dict name -> shaped view into them.
    m/v: AdamW moments, None until the first update (assign 1-D float32 arrays to resume).
    """

    def __init__(self, config, n_threads=None, matmul="blas", recompute_gelu=None):
        """recompute_gelu: None = keep fch_gelu per layer only while that costs <= 256 MiB
        (small B*T: saves one GELU per layer in backward), True = always recompute it in
        backward from fch (one layer of scratch), False = always keep it."""
        self.config = config
        self.recompute_gelu = recompute_gelu
        config.validate()
        from llmctl.threads import configure_threads

        # one count for OpenMP kernels and scipy's OpenBLAS pool (they must not oversubscribe)
        self.n_threads = configure_threads(n_threads)
        self.matmul_backend = matmul
        self._k_matmul, self._k_layers, self._k_attention, self._k_adamw = _kernels()
        self._offs = param_offsets(config)
        self.num_parameters = num_parameters(config)
        self.params = np.zeros(self.num_parameters, dtype=np.float32)
        self.grads = np.zeros(self.num_parameters, dtype=np.float32)
        self.p = _views(self.params, self._offs)
        self.g = _views(self.grads, self._offs)
        self.m = None
        self.v = None
        self._acts = None          # dict of activation buffers, sized for _cap rows (B*T)
        self._cap = 0
        self._cap_layers = 0
        self._kept = False         # did the last forward keep every layer's activations?
        self._scratch = None       # one layer of activation gradients (allocated at first backward)
        self._B = self._T = 0
        self._ids = None
        self._targets = None
        self._buf_state = None     # what the logits buffer holds: "logits", "probs" or "dlogits"

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_descriptor(cls, desc, seed=INIT_SEED, exact_libm=None, **kw):
        """Random init exactly as llm.c's gpt2_build_from_descriptor (train_gpt2.cu): mt19937 seed 42,
        normal_ in PyTorch module order; std 0.02, projections 0.02/sqrt(2L); LN weights 1.
        Bit-identical to llm.c on the same libm by default (llmctl._ext.randinit; d12 ~2 s).
        exact_libm (kept for compatibility): None = exact, falling back to NumPy math with a
        warning if the extension is not built; True = exact always (slow ctypes libm if the
        extension is missing); False = correctly rounded NumPy math (a few ulps off on ~1%)."""
        cfg = GPT2Config.from_descriptor(desc)
        model = cls(cfg, **kw)
        init_llmc_(model.p, cfg, seed, exact_libm, model.n_threads)  # bits independent of threads
        return model

    @classmethod
    def from_checkpoint(cls, path, **kw):
        """Load an llm.c checkpoint (v3 fp32, or v5 bf16 widened exactly to fp32)."""
        from llmctl import formats

        model = cls(formats.read_checkpoint_header(path).config(), **kw)
        model.load_checkpoint(path)
        return model

    @classmethod
    def from_init(cls, spec, seed=INIT_SEED, exact_libm=None, **kw):
        """What llm.c's -e takes: see llmctl.model.load (the one resolver of that spec)."""
        from llmctl.model.spec import load

        return load(spec, seed=seed, exact_libm=exact_libm, **kw)

    def load_checkpoint(self, path):
        """Read a checkpoint's parameters into this model; its config must match exactly."""
        from llmctl import formats

        hdr, data = formats.read_checkpoint(path)
        got, want = hdr.config().as_tuple(), self.config.as_tuple()
        if got != want:
            names = ("maxT", "V", "Vp", "L", "NH", "C")
            diff = ", ".join(f"{n} {g} vs {w}" for n, g, w in zip(names, got, want) if g != w)
            raise ConfigError(f"{path}: checkpoint config does not match the model ({diff})")
        step = 1 << 22
        for i in range(0, self.num_parameters, step):
            chunk = data[i:i + step]
            self.params[i:i + step] = chunk if hdr.version == 3 else formats.bf16_bits_to_fp32(chunk)

    def save_checkpoint(self, path, dtype="float32"):
        """Write an llm.c checkpoint: v3 fp32 (dtype "float32") or v5 bf16 ("bfloat16"); atomic."""
        from llmctl import formats

        formats.write_checkpoint(path, self.config, self.params, dtype)

    # -- buffers --------------------------------------------------------------------------------
    def _ensure_acts(self, BT, nl):
        """Buffers for >= BT rows and nl layers of saved activations (L for training, 1 for a
        forward that keeps nothing for backward)."""
        if BT <= self._cap and nl <= self._cap_layers:
            return
        BT, L = max(BT, self._cap), max(nl, self._cap_layers)
        c = self.config
        C, NH, Vp = c.channels, c.num_heads, c.padded_vocab_size
        z = lambda *shape: np.zeros(shape, dtype=np.float32)
        self._acts = None  # free the old buffers before allocating bigger ones
        self._scratch = None
        self._acts = {
            "resid": z(L + 1, BT * C),   # resid[0] = encoded, resid[l+1] = residual3 of layer l
            "res2": z(L, BT * C),
            "ln1": z(L, BT * C), "ln1_mean": z(L, BT), "ln1_rstd": z(L, BT),
            "qkv": z(L, BT * 3 * C),
            "atty": z(L, BT * C), "lse": z(L, BT * NH),
            "ln2": z(L, BT * C), "ln2_mean": z(L, BT), "ln2_rstd": z(L, BT),
            "fch": z(L, BT * 4 * C),
            # fch_gelu: all layers, or the current layer only (then recomputed in backward)
            "gelu": z(1 if L < c.num_layers or self._recompute(BT) else L, BT * 4 * C),
            "lnf": z(BT * C), "lnf_mean": z(BT), "lnf_rstd": z(BT),
            "logits": z(BT * Vp),        # logits -> probs -> dlogits, in place
            "losses": z(BT), "dlosses": z(BT),
        }
        self._cap, self._cap_layers = BT, L

    def _recompute(self, BT):
        if self.recompute_gelu is None:
            c = self.config
            return c.num_layers * BT * 4 * c.channels * 4 > (256 << 20)
        return bool(self.recompute_gelu)

    def _ensure_scratch(self):
        if self._scratch is None:
            C, BT = self.config.channels, self._cap
            self._scratch = {"dres": np.zeros(BT * C, np.float32), "dsmall": np.zeros(BT * C, np.float32),
                             "dbig": np.zeros(BT * 4 * C, np.float32)}
        return self._scratch

    def activation_bytes(self):
        """Bytes currently held by activation and activation-gradient buffers."""
        n = sum(a.nbytes for a in (self._acts or {}).values())
        return n + sum(a.nbytes for a in (self._scratch or {}).values())

    # -- validation -----------------------------------------------------------------------------
    def _check_ids(self, x, what):
        a = np.asarray(x)
        if a.ndim == 1:
            a = a[None, :]
        if a.ndim != 2:
            raise ConfigError(f"{what} must be a (B, T) array of token ids, got shape {a.shape}")
        if a.size and not np.issubdtype(a.dtype, np.integer):
            raise ConfigError(f"{what} must hold integer token ids, got dtype {a.dtype}")
        B, T = a.shape
        if B < 1 or T < 1:
            raise ConfigError(f"{what} is empty (B={B}, T={T})")
        if T > self.config.max_seq_len:
            raise ConfigError(f"sequence length T={T} exceeds the model's max_seq_len {self.config.max_seq_len}",
                              "use a smaller -t / sequence length")
        V = self.config.vocab_size
        bad = (a < 0) | (a >= V)
        if bad.any():
            b, t = map(int, np.argwhere(bad)[0])
            raise ConfigError(f"{what}[{b}, {t}] = {int(a[b, t])} is not a valid token id (must be in [0, {V}))")
        return np.ascontiguousarray(a, dtype=np.int32)

    # -- forward --------------------------------------------------------------------------------
    def forward(self, inputs, targets=None, keep_activations=True):
        """Run the model on inputs (B,T). With targets (B,T): per-token losses into self.losses and
        the mean loss returned (the logits buffer then holds probs); else returns None and
        self.logits() is valid. keep_activations=False (eval, sampling) reuses one layer's buffers
        for every layer: much less memory when no training forward ever ran, but no backward()."""
        ids = self._check_ids(inputs, "inputs")
        B, T = ids.shape
        tg = None
        if targets is not None:
            tg = self._check_ids(targets, "targets")
            if tg.shape != ids.shape:
                raise ConfigError(f"targets shape {tg.shape} does not match inputs shape {ids.shape}")
        c = self.config
        L, C, NH, V, Vp = c.num_layers, c.channels, c.num_heads, c.vocab_size, c.padded_vocab_size
        BT, nt, mm = B * T, self.n_threads, self.matmul_backend
        keep = bool(keep_activations)
        self._ensure_acts(BT, L if keep else 1)
        a, p = self._acts, self.p
        row = (lambda l: l) if keep else (lambda l: 0)
        rrow = (lambda l: l) if keep else (lambda l: l % 2)  # residual stream: ping-pong
        K, Ly, At = self._k_matmul, self._k_layers, self._k_attention
        fl = lambda x: x.reshape(-1)
        n = BT * C

        ids_f = ids.reshape(-1)
        Ly.encoder_forward(a["resid"][0, :n], ids_f, fl(p["wte"]), fl(p["wpe"]), B, T, C, nt)
        for l in range(L):
            r = row(l)
            gelu = a["gelu"][min(r, a["gelu"].shape[0] - 1), :4 * n]
            x, x2, x3 = a["resid"][rrow(l), :n], a["res2"][r, :n], a["resid"][rrow(l + 1), :n]
            ln1, qkv, atty = a["ln1"][r, :n], a["qkv"][r, :3 * n], a["atty"][r, :n]
            ln2, fch = a["ln2"][r, :n], a["fch"][r, :4 * n]
            Ly.layernorm_forward(ln1, a["ln1_mean"][r, :BT], a["ln1_rstd"][r, :BT], x,
                                 p["ln1w"][l], p["ln1b"][l], BT, C, nt)
            K.matmul_forward(qkv, ln1, fl(p["qkvw"][l]), p["qkvb"][l], BT, C, 3 * C, nt, mm)
            At.attention_forward(atty, a["lse"][r, :BT * NH], qkv, B, T, C, NH, nt)
            K.matmul_forward(x2, atty, fl(p["attprojw"][l]), p["attprojb"][l], BT, C, C, nt, mm)
            Ly.residual_forward(x2, x2, x, n, nt)
            Ly.layernorm_forward(ln2, a["ln2_mean"][r, :BT], a["ln2_rstd"][r, :BT], x2,
                                 p["ln2w"][l], p["ln2b"][l], BT, C, nt)
            K.matmul_forward(fch, ln2, fl(p["fcw"][l]), p["fcb"][l], BT, C, 4 * C, nt, mm)
            Ly.gelu_forward(gelu, fch, 4 * n, nt)
            K.matmul_forward(x3, gelu, fl(p["fcprojw"][l]), p["fcprojb"][l], BT, 4 * C, C, nt, mm)
            Ly.residual_forward(x3, x3, x2, n, nt)
        lnf = a["lnf"][:n]
        Ly.layernorm_forward(lnf, a["lnf_mean"][:BT], a["lnf_rstd"][:BT], a["resid"][rrow(L), :n],
                             p["lnfw"], p["lnfb"], BT, C, nt)
        logits = a["logits"][:BT * Vp]
        K.matmul_forward(logits, lnf, fl(p["wte"]), None, BT, C, Vp, nt, mm)
        self._B, self._T, self._ids, self._targets, self._kept = B, T, ids, tg, keep
        self._buf_state = "logits"
        if tg is None:
            return None
        losses = a["losses"][:BT]
        Ly.softmax_crossentropy_forward(losses, logits, logits, tg.reshape(-1), BT, V, Vp, nt)
        self._buf_state = "probs"
        return float(losses.astype(np.float64).mean())

    @property
    def losses(self):
        """(B,T) per-token losses of the last forward with targets (a view; overwritten next time)."""
        if self._targets is None:
            raise RuntimeError("no per-token losses: the last forward had no targets")
        return self._acts["losses"][:self._B * self._T].reshape(self._B, self._T)

    def logits(self):
        """(B,T,Vp) logits of the last forward (a view; overwritten by the next forward).
        Valid only after forward(inputs) without targets (with targets the buffer holds probs)."""
        if self._buf_state != "logits":
            raise RuntimeError("logits are only available after forward(inputs) without targets")
        BT, Vp = self._B * self._T, self.config.padded_vocab_size
        return self._acts["logits"][:BT * Vp].reshape(self._B, self._T, Vp)

    # -- backward -------------------------------------------------------------------------------
    def bind_grads(self, buf):
        """Keep the gradients in `buf` from now on (e.g. a rank's row of shared memory, so the
        all-reduce needs no copy): buf is a 1-D C-contiguous float32 array of num_parameters.
        The current gradients are copied in; `grads` and the named views `g` then point into buf.
        -> buf."""
        b = buf
        if (not isinstance(b, np.ndarray) or b.dtype != np.float32 or b.ndim != 1
                or b.shape[0] != self.num_parameters or not b.flags.c_contiguous or not b.flags.writeable):
            got = f"{b.dtype} {b.shape}" if isinstance(b, np.ndarray) else type(b).__name__
            raise ValueError(f"bind_grads needs a writable 1-D C-contiguous float32 array of "
                             f"{self.num_parameters} (num_parameters), got {got}")
        if b is not self.grads:
            b[:] = self.grads
        self.grads = b
        self.g = _views(b, self._offs)
        return b

    def zero_grad(self):
        self.grads.fill(0.0)

    def backward(self, loss_scale=1.0):
        """Accumulate d(loss_scale * mean loss)/d(params) into self.grads (dloss per token =
        loss_scale/(B*T)). Needs the immediately preceding forward to have had targets."""
        if self._buf_state != "probs" or not self._kept:
            raise RuntimeError("backward() needs a forward(inputs, targets) right before it "
                               "(with keep_activations=True)")
        c = self.config
        L, C, NH, V, Vp = c.num_layers, c.channels, c.num_heads, c.vocab_size, c.padded_vocab_size
        B, T = self._B, self._T
        BT, nt, mm = B * T, self.n_threads, self.matmul_backend
        n = BT * C
        a, p, g = self._acts, self.p, self.g
        K, Ly, At = self._k_matmul, self._k_layers, self._k_attention
        fl = lambda x: x.reshape(-1)
        s = self._ensure_scratch()
        dres, dsmall = s["dres"][:n], s["dsmall"][:n]
        dbig = s["dbig"][:4 * n]
        keep_gelu = a["gelu"].shape[0] == L

        dlosses = a["dlosses"][:BT]
        dlosses.fill(np.float32(loss_scale / BT))
        logits = a["logits"][:BT * Vp]
        Ly.softmax_crossentropy_backward(logits, logits, self._targets.reshape(-1), dlosses, BT, V, Vp, nt)
        self._buf_state = "dlogits"
        dsmall.fill(0.0)
        K.matmul_backward(dsmall, fl(g["wte"]), None, logits, a["lnf"][:n], fl(p["wte"]), BT, C, Vp, nt, mm)
        dres.fill(0.0)
        Ly.layernorm_backward(dres, g["lnfw"], g["lnfb"], dsmall, a["resid"][L, :n], p["lnfw"],
                              a["lnf_mean"][:BT], a["lnf_rstd"][:BT], BT, C, nt)
        for l in reversed(range(L)):
            # dres holds d(residual3[l]); residual3 = res2 + fcproj(gelu(fc(ln2(res2))))
            x, x2 = a["resid"][l, :n], a["res2"][l, :n]
            fch = a["fch"][l, :4 * n]
            gelu = a["gelu"][l if keep_gelu else 0, :4 * n]
            if not keep_gelu:
                Ly.gelu_forward(gelu, fch, 4 * n, nt)  # recompute fch_gelu
            dbig.fill(0.0)
            K.matmul_backward(dbig, fl(g["fcprojw"][l]), g["fcprojb"][l], dres, gelu, fl(p["fcprojw"][l]),
                              BT, 4 * C, C, nt, mm)
            gelu.fill(0.0)  # now d(fch)
            Ly.gelu_backward(gelu, fch, dbig, 4 * n, nt)
            dsmall.fill(0.0)
            K.matmul_backward(dsmall, fl(g["fcw"][l]), g["fcb"][l], gelu, a["ln2"][l, :n], fl(p["fcw"][l]),
                              BT, C, 4 * C, nt, mm)
            # residual: d(res2) = dres + LN2 backward, accumulated in place
            Ly.layernorm_backward(dres, g["ln2w"][l], g["ln2b"][l], dsmall, x2, p["ln2w"][l],
                                  a["ln2_mean"][l, :BT], a["ln2_rstd"][l, :BT], BT, C, nt)
            # res2 = x + attproj(attention(qkv(ln1(x))))
            dsmall.fill(0.0)
            K.matmul_backward(dsmall, fl(g["attprojw"][l]), g["attprojb"][l], dres, a["atty"][l, :n],
                              fl(p["attprojw"][l]), BT, C, C, nt, mm)
            dqkv = dbig[:3 * n]
            dqkv.fill(0.0)
            At.attention_backward(dqkv, dsmall, a["qkv"][l, :3 * n], a["atty"][l, :n], a["lse"][l, :BT * NH],
                                  B, T, C, NH, nt)
            dsmall.fill(0.0)
            K.matmul_backward(dsmall, fl(g["qkvw"][l]), g["qkvb"][l], dqkv, a["ln1"][l, :n], fl(p["qkvw"][l]),
                              BT, C, 3 * C, nt, mm)
            Ly.layernorm_backward(dres, g["ln1w"][l], g["ln1b"][l], dsmall, x, p["ln1w"][l],
                                  a["ln1_mean"][l, :BT], a["ln1_rstd"][l, :BT], BT, C, nt)
        Ly.encoder_backward(fl(g["wte"]), fl(g["wpe"]), dres, self._ids.reshape(-1), B, T, C, nt)

    # -- optimizer ------------------------------------------------------------------------------
    def grad_norm(self):
        """Global L2 norm of all gradients (deterministic for a fixed n_threads)."""
        return math.sqrt(self._k_adamw.global_norm_sq(self.grads, self.n_threads))

    def _decay_runs(self):
        """Contiguous (start, stop, decays) runs of the flat buffer, merging neighbours."""
        runs = []
        for name in PARAM_NAMES:
            off, n, _ = self._offs[name]
            dec = name in DECAY_PARAMS
            if runs and runs[-1][2] == dec and runs[-1][1] == off:
                runs[-1][1] = off + n
            else:
                runs.append([off, off + n, dec])
        return runs

    def update(self, lr, beta1, beta2, eps, weight_decay, grad_scale, step):
        """One AdamW step (train_gpt2.cu `gpt2_update`): t = step is 1-based; weight decay only on DECAY_PARAMS."""
        if step < 1:
            raise ValueError(f"AdamW step t is 1-based, got {step}")
        if self.m is None:
            self.m = np.zeros(self.num_parameters, dtype=np.float32)
        if self.v is None:
            self.v = np.zeros(self.num_parameters, dtype=np.float32)
        for arr, name in ((self.m, "m"), (self.v, "v")):
            if arr.shape != (self.num_parameters,) or arr.dtype != np.float32 or not arr.flags.c_contiguous:
                raise ValueError(f"AdamW state {name} must be a contiguous float32 array of {self.num_parameters}")
        for lo, hi, dec in self._decay_runs():
            self._k_adamw.adamw_update(self.params[lo:hi], self.grads[lo:hi], self.m[lo:hi], self.v[lo:hi],
                                       lr, beta1, beta2, eps, weight_decay if dec else 0.0, grad_scale,
                                       int(step), self.n_threads)
