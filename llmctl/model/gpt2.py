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
- attproj/fcproj outputs are written straight into the residual-stream buffers; fch_gelu, ln1,
  ln2 (and bf16's atty copy) are kept per layer only while fch_gelu is small (<= 256 MiB), else
  recomputed in backward from what it keeps (fch, the residual stream, LN mean/rstd, atty);
  activation gradients exist for ONE layer at a time; the logits buffer is reused in place as
  probs and then as dlogits.
- AdamW is llm.c's GPU trainer's (llmc/adamw.cuh `adamw_kernel3`): weight decay only on the
  2-D tensors, grad_scale for clipping, t 1-based.
- forward accepts any B, T with T <= maxT; buffers grow only when B*T grows.
- No separate gradient-zeroing pass in training: update(zero_grads=True) has the AdamW kernel
  clear each gradient chunk right after reading it, and the next zero_grad() is then free.
See docs/model.md for the byte count.

Precision (`precision="bf16"`, mixed precision as PyTorch autocast on CPU does it): every matmul
multiplies bf16 inputs and accumulates/outputs fp32; master weights, gradients, AdamW m/v,
layernorm, softmax, attention and the loss stay fp32. The bf16 copy of the weights
(`params_bf16`) is written by the AdamW kernel in its own pass; the matmul inputs are written as
bf16 by the kernels that produce them (layernorm, GELU, the loss backward) or cast once (the
attention output, each backward's dout in the pass that sums dbias). Checkpoints stay fp32.
"""
import math
import os

import numpy as np

from llmctl.errors import ConfigError
from llmctl.info import DEFAULT_PRECISION, PRECISIONS
from llmctl.model.config import PARAM_NAMES, GPT2Config, num_parameters, param_offsets

DECAY_PARAMS = {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}
INIT_SEED = 42
BF16_EMULATE_ENV = "LLMCTL_BF16_EMULATE"


def check_precision(precision):
    """precision if this machine can run it, else ConfigError. bf16 needs a CPU that multiplies
    bf16 natively (AVX512_BF16 or AMX, through oneDNN); LLMCTL_BF16_EMULATE=1 runs the same bf16
    numerics on fp32 GEMMs instead (slower than fp32: for tests and checks on any CPU)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}", hint=f"choose one of {', '.join(PRECISIONS)}")
    if precision == "bf16":
        from llmctl._ext import matmul

        if not matmul.bf16_native() and os.environ.get(BF16_EMULATE_ENV, "") in ("", "0"):
            feats = matmul.cpu_bf16_features()
            why = ("llmctl was built without oneDNN" if not matmul.dnnl_built() else
                   "LLMCTL_NO_DNNL is set" if "dnnl" not in matmul.get_backends() else
                   "this CPU has no native bf16 (AVX512_BF16 or AMX)" if not feats else
                   "oneDNN's bf16 GEMM does not run on this CPU")
            raise ConfigError(f"--precision bf16 is not available: {why}",
                              hint=f"use --precision fp32 (`llmctl info` lists the precisions); "
                                   f"{BF16_EMULATE_ENV}=1 emulates bf16 on fp32 GEMMs (slower)")
    return precision


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


LMHEAD_ROWS = 256   # bf16 lm-head backward: rows of dlogits cast at a time (25 MB of bf16, not B*T*Vp)
LOGITS_KEEP_BYTES = 256 << 20   # bf16: above this many bytes of fp32 logits, the lm head runs in blocks


def _views(buf, offsets):
    return {name: buf[off:off + n].reshape(shape) for name, (off, n, shape) in offsets.items()}


def _kernels():
    """The compiled kernels, or a ConfigError saying how to build them."""
    try:
        from llmctl._ext import adamw, attention, convert, layers, matmul  # noqa: F401 (convert: checked here)
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

    def __init__(self, config, n_threads=None, matmul=None, recompute=None, precision=DEFAULT_PRECISION):
        """recompute: the matmul inputs that one cheap kernel reproduces from what backward keeps
        anyway (fch_gelu = GELU(fch), ln1/ln2 = layernorm(x) with the saved mean/rstd, and bf16's
        copy of atty) are kept per layer, or recomputed in backward into one layer of scratch, the
        same bits either way. None = keep them while fch_gelu costs <= 256 MiB (small B*T: saves
        those kernels in backward), True = always recompute, False = always keep.
        matmul: the GEMM engine (None: the default, oneDNN where built, else scipy's BLAS).
        precision: "fp32" or "bf16" (mixed precision, see the module docstring)."""
        self.config = config
        self.precision = check_precision(precision)
        self.recompute = recompute
        config.validate()
        from llmctl.threads import configure_threads

        # one count for OpenMP kernels and scipy's OpenBLAS pool (they must not oversubscribe)
        self.n_threads = configure_threads(n_threads)
        self._k_matmul, self._k_layers, self._k_attention, self._k_adamw = _kernels()
        from llmctl._ext import convert

        self._k_convert = convert
        if self.precision == "bf16":
            if matmul not in (None,) + tuple(self._k_matmul.get_bf16_backends()):
                raise ConfigError(f"matmul engine {matmul!r} cannot run bf16",
                                  hint=f"use one of {self._k_matmul.get_bf16_backends()}")
        self.matmul_backend = matmul
        self._offs = param_offsets(config)
        self.num_parameters = num_parameters(config)
        self.params = np.zeros(self.num_parameters, dtype=np.float32)
        self.grads = np.zeros(self.num_parameters, dtype=np.float32)
        self.p = _views(self.params, self._offs)
        self.g = _views(self.grads, self._offs)
        # bf16: the copy of the parameters the matmuls read; stale until params_changed() re-casts
        self.params_bf16 = np.zeros(self.num_parameters, np.uint16) if self.precision == "bf16" else None
        self.pb = _views(self.params_bf16, self._offs) if self.params_bf16 is not None else None
        self._bf16_fresh = False
        self.m = None
        self.v = None
        # grads known to be all zero because the last thing that touched them was
        # update(zero_grads=True); backward() and zero_grad() clear it (see zero_grad)
        self._grads_zero = False
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
        model.params_changed()
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
        self.params_changed()

    def params_changed(self):
        """Call after writing `params` directly (load, init, a broadcast): in bf16 the matmuls'
        copy is re-cast before the next forward. AdamW (update) keeps it current itself."""
        self._bf16_fresh = False

    def _sync_bf16(self):
        if self.params_bf16 is not None and not self._bf16_fresh:
            from llmctl._ext import convert

            convert.cast_to_bf16(self.params_bf16, self.params, self.n_threads)
            self._bf16_fresh = True

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
        # the matmul inputs (ln1, ln2, gelu, lnf, the attention output's copy) in the matmul precision
        zm = z if self.precision == "fp32" else (lambda *shape: np.zeros(shape, dtype=np.uint16))
        self._acts = None  # free the old buffers before allocating bigger ones
        self._scratch = None
        # ln1, ln2, fch_gelu (and atty16): all layers, or the current layer only (recomputed in backward)
        Lr = 1 if L < c.num_layers or self._recompute(BT) else L
        self._acts = {
            "resid": z(L + 1, BT * C),   # resid[0] = encoded, resid[l+1] = residual3 of layer l
            "res2": z(L, BT * C),
            "ln1": zm(Lr, BT * C), "ln1_mean": z(L, BT), "ln1_rstd": z(L, BT),
            "qkv": z(L, BT * 3 * C),
            "atty": z(L, BT * C), "lse": z(L, BT * NH),
            "ln2": zm(Lr, BT * C), "ln2_mean": z(L, BT), "ln2_rstd": z(L, BT),
            "fch": z(L, BT * 4 * C),
            "gelu": zm(Lr, BT * 4 * C),
            "lnf": zm(BT * C), "lnf_mean": z(BT), "lnf_rstd": z(BT),
            # logits -> probs -> dlogits, in place (fp32); a bf16 training forward at large B*T keeps
            # LMHEAD_ROWS rows only and recomputes them in backward (see _lmhead_in_blocks)
            "logits": z((min(BT, LMHEAD_ROWS) if self._lmhead_in_blocks(BT) else BT) * Vp),
            "losses": z(BT), "dlosses": z(BT),
        }
        if self.precision == "bf16":
            self._acts["atty16"] = zm(Lr, BT * C)   # attention backward needs the fp32 atty too
        self._cap, self._cap_layers = BT, L

    def _lmhead_in_blocks(self, BT):
        """bf16 only (fp32 keeps llm.c's full logits): when B*T x Vp fp32 logits exceed 256 MiB
        (d12 at B*T > 1334), a training forward runs the lm head and the loss LMHEAD_ROWS rows at
        a time, keeping only the losses, and backward recomputes each block's logits (the same
        GEMM on the same inputs: the same bits) before its gradient: ~9 % more FLOPs at d12
        B=4 T=1024, 0.8 GB less memory."""
        return self.precision == "bf16" and BT * self.config.padded_vocab_size * 4 > LOGITS_KEEP_BYTES

    def _lmhead_block(self, r0, nr, tg, losses):
        """logits rows r0..r0+nr in the logits buffer, then their softmax (probs) and losses."""
        c = self.config
        C, V, Vp = c.channels, c.vocab_size, c.padded_vocab_size
        buf = self._acts["logits"][:nr * Vp]
        self._mm(buf, self._acts["lnf"][r0 * C:(r0 + nr) * C], "wte", None, nr, C, Vp)
        self._k_layers.softmax_crossentropy_forward(losses, buf, buf, tg[r0:r0 + nr], nr, V, Vp, self.n_threads)
        return buf

    def _recompute(self, BT):
        if self.recompute is None:
            c = self.config
            return c.num_layers * BT * 4 * c.channels * 4 > (256 << 20)
        return bool(self.recompute)

    def _ensure_scratch(self):
        if self._scratch is None:
            C, BT = self.config.channels, self._cap
            self._scratch = {"dres": np.zeros(BT * C, np.float32), "dsmall": np.zeros(BT * C, np.float32),
                             "dbig": np.zeros(BT * 4 * C, np.float32)}
            if self.precision == "bf16":
                # d(fch) in fp32 (the fp32 path reuses the gelu buffer), every backward GEMM's
                # bf16 dout, and the lm head's dlogits in row blocks of LMHEAD_ROWS
                Vp = self.config.padded_vocab_size
                self._scratch.update(dfch=np.zeros(BT * 4 * C, np.float32),
                                     dout16=np.zeros(BT * 4 * C, np.uint16),
                                     dlogits16=np.zeros(min(BT, LMHEAD_ROWS) * Vp, np.uint16))
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

    # -- the precision-dependent ops: matmuls and the kernels that produce their inputs ---------
    def _ln(self, out, mean, rstd, x, w, b, BT, C):
        Ly = self._k_layers
        f = Ly.layernorm_forward if self.params_bf16 is None else Ly.layernorm_forward_bf16
        f(out, mean, rstd, x, w, b, BT, C, self.n_threads)

    def _gelu(self, out, fch, N):
        Ly = self._k_layers
        (Ly.gelu_forward if self.params_bf16 is None else Ly.gelu_forward_bf16)(out, fch, N, self.n_threads)

    def _mm(self, out, inp, name, l, BT, C, OC):
        """out (BT,OC) = inp (BT,C) @ W^T + b for weight `name` of layer l (l None: the lm head, wte)."""
        K, nt, mm = self._k_matmul, self.n_threads, self.matmul_backend
        bias = self.p[name[:-1] + "b"][l] if l is not None else None
        if self.params_bf16 is None:
            W = self.p[name] if l is None else self.p[name][l]
            K.matmul_forward(out, inp, W.reshape(-1), bias, BT, C, OC, nt, mm)
        else:
            W = self.pb[name] if l is None else self.pb[name][l]
            K.matmul_forward_bf16(out, inp, W.reshape(-1), bias, BT, C, OC, nt, mm)

    def _mm_back(self, dinp, dout, inp, name, l, BT, C, OC):
        """matmul_backward of _mm(.., name, l, ..): dinp, dW, db += their gradients given dout (fp32)."""
        K, nt, mm = self._k_matmul, self.n_threads, self.matmul_backend
        gW, gb = self.g[name][l].reshape(-1), self.g[name[:-1] + "b"][l]
        if self.params_bf16 is None:
            K.matmul_backward(dinp, gW, gb, dout, inp, self.p[name][l].reshape(-1), BT, C, OC, nt, mm)
        else:
            K.matmul_backward_bf16(dinp, gW, gb, dout, self._scratch["dout16"][:BT * OC], inp,
                                   self.pb[name][l].reshape(-1), BT, C, OC, nt, mm)

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
        BT, nt = B * T, self.n_threads
        keep = bool(keep_activations)
        self._sync_bf16()
        self._ensure_acts(BT, L if keep else 1)
        a, p = self._acts, self.p
        row = (lambda l: l) if keep else (lambda l: 0)
        rrow = (lambda l: l) if keep else (lambda l: l % 2)  # residual stream: ping-pong
        Ly, At = self._k_layers, self._k_attention
        fl = lambda x: x.reshape(-1)
        n = BT * C

        ids_f = ids.reshape(-1)
        Ly.encoder_forward(a["resid"][0, :n], ids_f, fl(p["wte"]), fl(p["wpe"]), B, T, C, nt)
        for l in range(L):
            r = row(l)
            rr = min(r, a["gelu"].shape[0] - 1)   # ln1, ln2, gelu, atty16: maybe one layer only
            gelu = a["gelu"][rr, :4 * n]
            x, x2, x3 = a["resid"][rrow(l), :n], a["res2"][r, :n], a["resid"][rrow(l + 1), :n]
            ln1, qkv, atty = a["ln1"][rr, :n], a["qkv"][r, :3 * n], a["atty"][r, :n]
            ln2, fch = a["ln2"][rr, :n], a["fch"][r, :4 * n]
            self._ln(ln1, a["ln1_mean"][r, :BT], a["ln1_rstd"][r, :BT], x, p["ln1w"][l], p["ln1b"][l], BT, C)
            self._mm(qkv, ln1, "qkvw", l, BT, C, 3 * C)
            At.attention_forward(atty, a["lse"][r, :BT * NH], qkv, B, T, C, NH, nt)
            if self.params_bf16 is not None:
                self._k_convert.cast_to_bf16(a["atty16"][rr, :n], atty, nt)
            self._mm(x2, atty if self.params_bf16 is None else a["atty16"][rr, :n], "attprojw", l, BT, C, C)
            Ly.residual_forward(x2, x2, x, n, nt)
            self._ln(ln2, a["ln2_mean"][r, :BT], a["ln2_rstd"][r, :BT], x2, p["ln2w"][l], p["ln2b"][l], BT, C)
            self._mm(fch, ln2, "fcw", l, BT, C, 4 * C)
            self._gelu(gelu, fch, 4 * n)
            self._mm(x3, gelu, "fcprojw", l, BT, 4 * C, C)
            Ly.residual_forward(x3, x3, x2, n, nt)
        lnf = a["lnf"][:n]
        self._ln(lnf, a["lnf_mean"][:BT], a["lnf_rstd"][:BT], a["resid"][rrow(L), :n], p["lnfw"], p["lnfb"], BT, C)
        self._B, self._T, self._ids, self._targets, self._kept = B, T, ids, tg, keep
        if tg is not None and a["logits"].size < BT * Vp:   # bf16, large B*T: the lm head in blocks
            losses = a["losses"][:BT]
            for r0 in range(0, BT, LMHEAD_ROWS):
                nr = min(BT - r0, LMHEAD_ROWS)
                self._lmhead_block(r0, nr, tg.reshape(-1), losses[r0:r0 + nr])
            self._buf_state = "probs"
            return float(losses.astype(np.float64).mean())
        if a["logits"].size < BT * Vp:
            a["logits"] = np.zeros(BT * Vp, np.float32)   # logits of every row asked for
        logits = a["logits"][:BT * Vp]
        self._mm(logits, lnf, "wte", None, BT, C, Vp)
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
        The current gradients are copied in (so all-zero ones stay known zero for zero_grad);
        `grads` and the named views `g` then point into buf. -> buf."""
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
        """Set grads to 0 before a step's backward. Free right after update(zero_grads=True),
        whose AdamW pass already cleared them; otherwise (the first step, a skipped or refused
        update, grads written by backward since) one fill over the buffer. Code that writes grads
        other than through backward() must do it after zero_grad(), not between update() and it."""
        if not self._grads_zero:
            self.grads.fill(0.0)
        self._grads_zero = False

    def backward(self, loss_scale=1.0):
        """Accumulate d(loss_scale * mean loss)/d(params) into self.grads (dloss per token =
        loss_scale/(B*T)). Needs the immediately preceding forward to have had targets."""
        if self._buf_state != "probs" or not self._kept:
            raise RuntimeError("backward() needs a forward(inputs, targets) right before it "
                               "(with keep_activations=True)")
        self._grads_zero = False
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
        keep = a["gelu"].shape[0] == L   # else ln1, ln2, gelu (atty16) are recomputed per layer

        dlosses = a["dlosses"][:BT]
        dlosses.fill(np.float32(loss_scale / BT))
        logits = a["logits"][:BT * Vp]
        tg = self._targets.reshape(-1)
        blocks = logits.size < BT * Vp   # the forward kept no logits: recompute them per block
        dsmall.fill(0.0)
        if self.params_bf16 is None:
            Ly.softmax_crossentropy_backward(logits, logits, tg, dlosses, BT, V, Vp, nt)
            self._buf_state = "dlogits"
            K.matmul_backward(dsmall, fl(g["wte"]), None, logits, a["lnf"][:n], fl(p["wte"]), BT, C, Vp, nt, mm)
        else:
            # dlogits straight to bf16, LMHEAD_ROWS rows at a time (the probs stay fp32)
            d16 = s["dlogits16"]
            R = d16.size // Vp
            junk = np.empty(R, np.float32)
            for r0 in range(0, BT, R):
                nr = min(BT, r0 + R) - r0
                probs = self._lmhead_block(r0, nr, tg, junk[:nr]) if blocks else logits[r0 * Vp:(r0 + nr) * Vp]
                Ly.softmax_crossentropy_backward_bf16(d16[:nr * Vp], probs, tg[r0:r0 + nr],
                                                      dlosses[r0:r0 + nr], nr, V, Vp, nt)
                K.matmul_backward_bf16(dsmall[r0 * C:(r0 + nr) * C], fl(g["wte"]), None, None, d16[:nr * Vp],
                                       a["lnf"][r0 * C:(r0 + nr) * C], fl(self.pb["wte"]), nr, C, Vp, nt, mm)
            self._buf_state = "dlogits"
        dres.fill(0.0)
        Ly.layernorm_backward(dres, g["lnfw"], g["lnfb"], dsmall, a["resid"][L, :n], p["lnfw"],
                              a["lnf_mean"][:BT], a["lnf_rstd"][:BT], BT, C, nt)
        for l in reversed(range(L)):
            # dres holds d(residual3[l]); residual3 = res2 + fcproj(gelu(fc(ln2(res2))))
            x, x2 = a["resid"][l, :n], a["res2"][l, :n]
            fch = a["fch"][l, :4 * n]
            r = l if keep else 0
            gelu, ln1, ln2 = a["gelu"][r, :4 * n], a["ln1"][r, :n], a["ln2"][r, :n]
            atty16 = None if self.params_bf16 is None else a["atty16"][r, :n]
            if not keep:  # the forward's kernels on the same inputs: the same bits
                self._gelu(gelu, fch, 4 * n)
                self._ln(ln2, a["ln2_mean"][l, :BT], a["ln2_rstd"][l, :BT], x2, p["ln2w"][l], p["ln2b"][l], BT, C)
                self._ln(ln1, a["ln1_mean"][l, :BT], a["ln1_rstd"][l, :BT], x, p["ln1w"][l], p["ln1b"][l], BT, C)
                if atty16 is not None:
                    self._k_convert.cast_to_bf16(atty16, a["atty"][l, :n], nt)
            dbig.fill(0.0)
            self._mm_back(dbig, dres, gelu, "fcprojw", l, BT, 4 * C, C)
            dfch = gelu if self.params_bf16 is None else s["dfch"][:4 * n]  # fp32: gelu's buffer is free now
            dfch.fill(0.0)
            Ly.gelu_backward(dfch, fch, dbig, 4 * n, nt)
            dsmall.fill(0.0)
            self._mm_back(dsmall, dfch, ln2, "fcw", l, BT, C, 4 * C)
            # residual: d(res2) = dres + LN2 backward, accumulated in place
            Ly.layernorm_backward(dres, g["ln2w"][l], g["ln2b"][l], dsmall, x2, p["ln2w"][l],
                                  a["ln2_mean"][l, :BT], a["ln2_rstd"][l, :BT], BT, C, nt)
            # res2 = x + attproj(attention(qkv(ln1(x))))
            dsmall.fill(0.0)
            self._mm_back(dsmall, dres, a["atty"][l, :n] if atty16 is None else atty16, "attprojw", l, BT, C, C)
            dqkv = dbig[:3 * n]
            dqkv.fill(0.0)
            At.attention_backward(dqkv, dsmall, a["qkv"][l, :3 * n], a["atty"][l, :n], a["lse"][l, :BT * NH],
                                  B, T, C, NH, nt)
            dsmall.fill(0.0)
            self._mm_back(dsmall, dqkv, ln1, "qkvw", l, BT, C, 3 * C)
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

    def update(self, lr, beta1, beta2, eps, weight_decay, grad_scale, step, zero_grads=False):
        """One AdamW step (train_gpt2.cu `gpt2_update`): t = step is 1-based; weight decay only on DECAY_PARAMS.
        zero_grads: the same pass also sets grads to 0, each chunk right after AdamW read it (the
        parameters, m, v and bf16 copy are the same bits), and the next zero_grad() skips its fill."""
        if step < 1:
            raise ValueError(f"AdamW step t is 1-based, got {step}")
        if self.m is None:
            self.m = np.zeros(self.num_parameters, dtype=np.float32)
        if self.v is None:
            self.v = np.zeros(self.num_parameters, dtype=np.float32)
        for arr, name in ((self.m, "m"), (self.v, "v")):
            if arr.shape != (self.num_parameters,) or arr.dtype != np.float32 or not arr.flags.c_contiguous:
                raise ValueError(f"AdamW state {name} must be a contiguous float32 array of {self.num_parameters}")
        pb = self.params_bf16
        for lo, hi, dec in self._decay_runs():
            self._k_adamw.adamw_update(self.params[lo:hi], self.grads[lo:hi], self.m[lo:hi], self.v[lo:hi],
                                       lr, beta1, beta2, eps, weight_decay if dec else 0.0, grad_scale,
                                       int(step), self.n_threads, None if pb is None else pb[lo:hi],
                                       zero_grads=zero_grads)
        self._bf16_fresh = pb is not None   # the runs cover every parameter
        self._grads_zero = bool(zero_grads)   # ... and every gradient
