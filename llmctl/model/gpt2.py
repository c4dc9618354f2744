"""GPT-2 over llmctl's Cython kernels: parameters, activations, forward, backward, AdamW.

What it is: the `gpt2_*` half of llm.c's `train_gpt2.c` written in Python. One contiguous float32
parameter buffer with named views in llm.c's checkpoint order (train_gpt2.c
`fill_in_parameter_sizes`), gradients in the same layout (one buffer: checkpoint I/O is one
read/write, the all-reduce one call), AdamW m/v the same way, and activations allocated once and
reused as an ActPlan says. One `_block_forward` / `_block_backward` pair per transformer layer
serves every use: training, evaluation, and the KV-cached forward of sampling and HellaSwag
(`forward_cached`, or `embed` / `block_forward` / `final_norm` / `logits_from_hidden` with a
KVCache, which is data only). The precision's kernels sit behind `self.ops`
(llmctl/model/ops.py); every arithmetic loop is a kernel in `llmctl._ext`, called with flat
views and explicit sizes.
What it is not: a kernel (no per-element math in Python), a trainer (no schedule, data or
logging: see llmctl/train.py), a sampler (llmctl/sample.py), or the shape table
(llmctl/model/config.py).

Differences from train_gpt2.c, on purpose:
- Attention is flash-style: only the per-row log-sum-exp (B,NH,T) is kept, never (B,NH,T,T).
- attproj/fcproj outputs are written straight into the residual-stream buffers; fch_gelu (bf16
  only: fp32 recomputes it in its gradient's pass), ln1 and ln2 are kept per layer only while
  fch_gelu is small (<= 256 MiB), else recomputed in backward from what it keeps (fch, the
  residual stream, LN mean/rstd);
  activation gradients exist for ONE layer at a time; the logits buffer is reused in place as
  probs and then as dlogits.
- AdamW is llm.c's GPU trainer's (llmc/adamw.cuh `adamw_kernel3`): weight decay only on the
  2-D tensors, grad_scale for clipping, t 1-based.
- forward accepts any B, T with T <= maxT; buffers grow only when B*T grows.
- No separate gradient-zeroing pass in training: update(zero_grads=True) has the AdamW kernel
  clear each gradient chunk right after reading it, and the next zero_grad() is then free; in
  bf16 nothing clears them: the next backward writes each gradient's first contribution (beta-0
  GEMMs, a fill of the ~1 % the GEMMs do not write) instead of adding it to zeros.
See docs/model.md for the byte count.

Precision (`precision="bf16"`, mixed precision as PyTorch autocast on CPU does it): every matmul
multiplies bf16 inputs and accumulates/outputs fp32; master weights, gradients, AdamW m/v,
layernorm, softmax, attention and the loss stay fp32. The bf16 copy of the weights
(`params_bf16`) is written by the AdamW kernel in its own pass; the matmul inputs are written as
bf16 by the kernels that produce them (layernorm, GELU, the loss backward) or cast once (the
attention output, each backward's dout in the pass that sums dbias). Checkpoints stay fp32.
"""
import math
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np

from llmctl.errors import ConfigError
from llmctl.info import DEFAULT_PRECISION, check_precision
from llmctl.model.config import PARAM_NAMES, GPT2Config, num_parameters, param_offsets
from llmctl.model.ops import Kernels, ops_for

DECAY_PARAMS = {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}
# the gradients one GEMM writes whole (the lm head's first block of rows, each layer's dW): where
# the ops can (bf16), a spent gradient's next backward writes these with beta-0 GEMMs instead of
# adding into zeros, and fills only the rest (biases, layernorms, wpe: ~1 % of the parameters)
GEMM_GRADS = ("wte", "qkvw", "attprojw", "fcw", "fcprojw")
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


# bf16, large B*T: rows of logits the lm head and the loss compute at a time; a training plan
# makes them LMHEAD_GRAD_ROWS at a time instead, in its dlogits staging (one pass over wte per block)
LMHEAD_ROWS = 256
# bf16: rows of dlogits staged (103 MB of bf16 at d12, not B*T*Vp) before the lm head's backward
# GEMMs run on them: d(wte) += dlogits^T @ lnf rewrites all of d(wte) (154 MB fp32) per call, so
# fewer, taller calls (d12 B=4 T=1024: 4 of 1024 rows, 600 -> 420 ms, instead of 16 of 256)
LMHEAD_GRAD_ROWS = 1024
LOGITS_KEEP_BYTES = 256 << 20   # bf16: above this many bytes of fp32 logits, the lm head runs in blocks
KEEP_GELU_BYTES = 256 << 20     # recompute=None: keep every layer's fch_gelu while it costs at most this
_MIN_PARALLEL = 1 << 16   # bytes of element-wise work below which a kernel runs on one thread
# a layer's fp32 parameters a decode step reads (_ext/decode.pyx's poff columns)
_DECODE_PARAMS = ("ln1w", "ln1b", "qkvb", "attprojb", "ln2w", "ln2b", "fcb", "fcprojb")


def _views(buf, offsets):
    return {name: buf[off:off + n].reshape(shape) for name, (off, n, shape) in offsets.items()}


@dataclass(frozen=True)
class ActPlan:
    """What the activation buffers hold, decided once where they are sized (GPT2._ensure_acts)."""
    rows: int          # B*T the buffers take
    layers: int        # layers of saved activations: L (training) or 1 (a forward that keeps nothing)
    recompute: int     # llm.c's -r level: 0 keep every layer's fch_gelu, ln1, ln2;
                       # 1 hold fch_gelu for one layer and recompute it in backward; 2 also the rest
    logits_rows: int   # rows of logits held: `rows`, or LMHEAD_ROWS when a bf16 training forward
                       # runs the lm head and the loss in blocks (backward recomputes them unless
                       # the forward was given loss_scale)


class KVCache:
    """Past keys/values of B rows, the data a cached forward (GPT2.forward_cached) reads and
    extends: k[l], v[l] are (B, NH, Tcap, hs) float32; `lengths[b]` is how many positions row b
    holds (its next new position)."""

    def __init__(self, config, B, Tcap):
        L, NH, C = config.num_layers, config.num_heads, config.channels
        self.B, self.Tcap = int(B), int(Tcap)
        # np.empty: attention only ever reads positions that were written first
        self.k = np.empty((L, B, NH, Tcap, C // NH), dtype=np.float32)
        self.v = np.empty((L, B, NH, Tcap, C // NH), dtype=np.float32)
        self.lengths = np.zeros(B, dtype=np.int32)


@dataclass
class KVPart:
    """Rows of a cached forward that share one KV cache (GPT2.block_forward_parts): `rows` rows,
    B = k.shape[0] rows of the cache with rows // B new positions each, row b's from pos[b] on;
    k, v (B, NH, Tcap, hs) one layer's cache. prefix: None, or (kpre, vpre, rows_of, lengths, Tp),
    a cache (P, NH, Tp, hs) shared by several rows, row b's positions below lengths[b] being row
    rows_of[b]'s there (HellaSwag's context under each of its endings, read where it lies); the
    part's own cache then holds row b's positions from lengths[b] on, from index 0."""
    k: np.ndarray
    v: np.ndarray
    pos: np.ndarray
    rows: int
    prefix: tuple = None

    def __post_init__(self):
        """Checked once, where the part is made (HellaSwag makes a batch's parts once for all its
        layers): int32 positions and prefix rows/lengths, and the own cache's append positions."""
        B = self.k.shape[0]
        if self.rows % B:
            raise ValueError(f"{self.rows} rows are not whole rows of a cache of B = {B}")
        pre = self.prefix
        # the caches are written in place (a reshaped copy would take the new K/V and be dropped)
        for name, c in (("k", self.k), ("v", self.v)) + (() if pre is None else (("prefix k", pre[0]),
                                                                                 ("prefix v", pre[1]))):
            if c.dtype != np.float32 or c.ndim != 4 or not c.flags.c_contiguous:
                raise ValueError(f"{name} must be a C-contiguous float32 cache (B, NH, Tcap, hs), got "
                                 f"{c.dtype} of shape {c.shape}")
        self.pos = np.ascontiguousarray(self.pos, dtype=np.int32)
        self.append_pos = self.pos
        if pre is not None:
            kp, vp, rows_of, lengths, Tp = pre
            self.prefix = pre = (kp, vp, np.ascontiguousarray(rows_of, dtype=np.int32),
                                 np.ascontiguousarray(lengths, dtype=np.int32), int(Tp))
            self.append_pos = self.pos - pre[3]


def _engine_arg(engine, matmul):
    """GPT2's engine= (matmul= is its former name): the one given, ConfigError for two that differ."""
    if matmul is None:
        return engine
    if engine is not None and engine != matmul:
        raise ConfigError(f"engine={engine!r} and matmul={matmul!r} name two GEMM engines",
                          hint="pass engine= only (matmul= is its former name)")
    return matmul


# ----------------------------------------------------------------------------------------------
# model


def _out_buffer(out, n, what, dtype=np.float32):
    """The flat output of n elements of dtype: out itself (checked) or, if None, a new array."""
    if out is None:
        return np.empty(n, dtype)
    if out.dtype != dtype or out.size != n or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writable C-contiguous {np.dtype(dtype).name} array of {n} ({what}) "
                         "elements")
    return out.reshape(-1)


class GPT2:
    """GPT-2 with flat float32 parameters/gradients and kernel-driven forward/backward.

    params/grads: 1-D float32 (num_parameters); p/g: dict name -> shaped view into them.
    m/v: AdamW moments, None until the first update (assign 1-D float32 arrays to resume).
    ops: the precision's kernels (llmctl/model/ops.py); kernels: the compiled kernel modules.
    """

    def __init__(self, config, n_threads=None, engine=None, recompute=None, precision=DEFAULT_PRECISION,
                 matmul=None, bf16_emulate=None):
        """recompute: the matmul inputs that one cheap kernel reproduces from what backward keeps
        anyway (fch_gelu = GELU(fch), ln1/ln2 = layernorm(x) with the saved mean/rstd) are kept
        per layer, or recomputed in backward into one layer of scratch, the same bits either way.
        llm.c's -r levels: 0 = keep all, 1 = recompute fch_gelu, 2 = also
        ln1/ln2. None = while fch_gelu costs <= 256 MiB (small B*T), 1 in fp32 (whose backward
        makes the GELU again in its gradient's pass, no extra kernel) and 0 in bf16 (saves that
        kernel in backward), else 2, in bf16 3 once B*T >= 3C; True = 2, False = 0. 3 (llmctl's,
        beyond llm.c's levels): level 2, and res2 = x + attproj(atty) recomputed in backward (one
        GEMM a layer), and in bf16 no bf16 copy of the layers' weights: each layer casts its own
        as it runs (a cached forward between steps borrows the fc activations for all of them).
        engine: the GEMM engine (None: the default, oneDNN where built, else scipy's BLAS);
        `matmul=` is its former name, still accepted.
        precision: "fp32" or "bf16" (mixed precision, see the module docstring).
        bf16_emulate: True runs bf16 where the CPU has no native bf16, its GEMMs emulated on fp32
        (`llmctl sample` does where a copy of the bf16 GEMV decodes without oneDNN's bf16 GEMM); None: LLMCTL_BF16_EMULATE."""
        self.config = config
        self.precision = check_precision(precision, emulate=bf16_emulate)
        if recompute not in (None, True, False, 0, 1, 2, 3):
            raise ConfigError(f"recompute must be None, 0, 1, 2 or 3, got {recompute!r}")
        self.recompute = recompute
        config.validate()
        from llmctl.threads import configure_threads

        # one count for OpenMP kernels and scipy's OpenBLAS pool (they must not oversubscribe)
        self.n_threads = configure_threads(n_threads)
        self.kernels = Kernels()
        engine = _engine_arg(engine, matmul)
        if self.precision == "bf16":
            if engine not in (None,) + tuple(self.kernels.matmul.get_bf16_engines()):
                raise ConfigError(f"matmul engine {engine!r} cannot run bf16",
                                  hint=f"use one of {self.kernels.matmul.get_bf16_engines()}")
        self.engine = engine
        self._offs = param_offsets(config)
        self.num_parameters = num_parameters(config)
        self.params = np.zeros(self.num_parameters, dtype=np.float32)
        self.grads = np.zeros(self.num_parameters, dtype=np.float32)
        self.p = _views(self.params, self._offs)
        self.g = _views(self.grads, self._offs)
        # bf16: the copy of the parameters the matmuls read; stale until params_changed() re-casts.
        # At recompute level 3 it holds the first two tensors only (wte, the lm head's, and wpe):
        # the layers cast their own weights as they run (ops.cast_layer)
        self.params_bf16, self.pb, self._bf16_fresh = None, None, False
        if self.precision == "bf16":
            self._bf16_copy(self._offs)
        self.ops = ops_for(self.precision, self.kernels, self.p, engine, self.pb)
        if recompute == 3:
            self._layer_weights()
        self.m = None
        self.v = None
        # grads known to be all zero because the last thing that touched them was
        # update(zero_grads=True); backward() and zero_grad() clear it (see zero_grad)
        self.grads_known_zero = False
        # grads spent (bf16: update(zero_grads=True), zero_grad(lazy=True)): their values are
        # junk and the next gradient write overwrites them (_begin_grads), or a reader fills them
        # with zeros first (_fill_spent)
        self.grads_spent = False
        self._overwrite = set()    # GEMM_GRADS whose next GEMM writes them (beta 0), this step
        self.plan = None           # ActPlan of the activation buffers (None until the first forward)
        self._acts = None          # dict of activation buffers, as self.plan says
        self._scratch = None       # one layer of activation gradients (allocated at first backward)
        self._step_bufs = None     # one layer's intermediates of a cached forward (block_forward)
        self._param_offs = None    # (L, 8) offsets in params of the tensors decode.pyx reads
        self._bwd16 = None         # bf16 training: the backward's scratch (_bwd16_layout)
        self._B = self._T = 0
        self._kept = False         # did the last forward keep every layer's activations?
        self._ids = None
        self._targets = None
        # what the logits buffer holds: "logits", "probs", "dlogits", or "train": a training forward
        # whose lm head made its gradient (loss_scale) or ran in row blocks, so backward() uses that
        # gradient or remakes it from the logits
        self._buf_state = None
        self._lmhead_grad_scale = None   # loss_scale of an lm-head gradient the forward already made

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
        self.ops.params_changed()

    def _bf16_copy(self, offs):
        """A bf16 copy of the parameters in offs (the first ones of the buffer), as fresh as before."""
        old, self.params_bf16 = self.params_bf16, np.zeros(sum(n for _, n, _ in offs.values()), np.uint16)
        if self._bf16_fresh:
            self.params_bf16[:] = old[:self.params_bf16.size]
        self.pb = _views(self.params_bf16, offs)

    def _layer_weights(self):
        """Recompute level 3 in bf16: the bf16 copy keeps wte (the lm head's) and wpe only; each
        layer casts its own weights as it runs (Bf16Ops.layer_weights)."""
        if self.precision == "bf16" and self.ops.lw is None:
            self._bf16_copy({n: self._offs[n] for n in ("wte", "wpe")})
            self.ops.layer_weights(self.pb)

    def _lend_weights(self):
        """Level 3, between steps: a cached forward (sampling, HellaSwag) reads every layer's bf16
        weights from the fc activations' buffer (Bf16Ops.hold), cast there once, not a layer at
        a time for each token. Only while no backward can still read those activations; any
        forward that writes them first takes the loan back (forward)."""
        if self.plan is None or self.plan.recompute < 3 or self.plan.layers < self.config.num_layers \
                or self.ops.held is not None:
            return
        if self._kept and self._buf_state in ("probs", "train"):
            return
        self.ops.hold(self._acts["fch"].reshape(-1), self.n_threads)

    def _sync_bf16(self):
        if self.params_bf16 is not None and not self._bf16_fresh:
            pb = self.params_bf16
            self.kernels.convert.cast_to_bf16(pb, self.params[:pb.size], self.n_threads)
            self._bf16_fresh = True

    def save_checkpoint(self, path, dtype="float32"):
        """Write an llm.c checkpoint: v3 fp32 (dtype "float32") or v5 bf16 ("bfloat16"); atomic."""
        from llmctl import formats

        formats.write_checkpoint(path, self.config, self.params, dtype)

    # -- buffers --------------------------------------------------------------------------------
    def _make_plan(self, BT, nl):
        """The ActPlan for >= BT rows and nl layers of saved activations (L for training, 1 for a
        forward that keeps nothing for backward); never smaller than the current one."""
        c = self.config
        if self.plan is not None:
            BT, nl = max(BT, self.plan.rows), max(nl, self.plan.layers)
        if self.recompute is None:   # level 1 costs nothing where the backward's GELU pass makes it again
            # (fp32's, which replaces a zero fill and a pass; bf16's fused pass writes GELU(fch)
            # once more than level 0, whose backward reads the kept one)
            free_gelu = self.precision == "fp32"
            level = 2 if c.num_layers * BT * 4 * c.channels * 4 > KEEP_GELU_BYTES else int(free_gelu)
            # bf16, once the fc activations (L*BT*4C in bf16) can hold the layers' bf16 weights
            # (12*L*C^2): drop that copy and residual2 too. The training step pays a weight cast
            # per layer run and one attproj GEMM a layer (~2 %); a cached forward between steps
            # borrows the fc buffer for the whole copy (_lend_weights) and does not slow down
            if level == 2 and self.precision == "bf16" and BT >= 3 * c.channels:
                level = 3
        else:
            level = 2 if self.recompute is True else int(self.recompute)
        if nl < c.num_layers:   # a forward that keeps nothing holds one layer of everything
            level = 2
        # bf16 only (fp32 keeps llm.c's full logits): when B*T x Vp fp32 logits exceed 256 MiB (d12
        # at B*T > 1334), a training forward runs the lm head and the loss LMHEAD_ROWS rows at a
        # time, keeping only the losses: 0.8 GB less memory at d12 B=4 T=1024. The gradient of each
        # block is made while its logits are at hand when forward is given loss_scale, else
        # backward recomputes them (the same GEMM on the same inputs: the same bits, ~9 % more FLOPs)
        blocks = self.precision == "bf16" and BT * c.padded_vocab_size * 4 > LOGITS_KEEP_BYTES
        rows = LMHEAD_ROWS // 2 if level >= 3 else LMHEAD_ROWS   # -r 3: half the block, 25 MB less at d12
        return ActPlan(BT, nl, level, min(BT, rows) if blocks else BT)

    def _ensure_acts(self, BT, nl):
        """Buffers for >= BT rows and nl layers of saved activations."""
        if self.plan is not None and BT <= self.plan.rows and nl <= self.plan.layers:
            return
        plan = self._make_plan(BT, nl)
        if plan.recompute >= 3:
            self._layer_weights()
        c = self.config
        BT, L, C, NH, Vp = plan.rows, plan.layers, c.channels, c.num_heads, c.padded_vocab_size
        Lg = 1 if plan.recompute >= 1 else L   # fch_gelu: all layers, or one
        Lr = 1 if plan.recompute >= 2 else L   # ln1, ln2 likewise
        Lx = 1 if plan.recompute >= 3 else L   # res2 likewise
        z = lambda *shape: np.zeros(shape, dtype=np.float32)
        self._acts = self._scratch = self._bwd16 = None  # free the old buffers before allocating bigger ones
        # matmul inputs (bf16 in bf16); in a bf16 training plan the one-layer ones live in the
        # backward's scratch (_bwd16_layout)
        at, buf = {}, None
        if plan.layers == c.num_layers and self.precision == "bf16":
            lay = self._bwd16_layout(BT, plan.recompute)
            at, buf = lay["at"], np.zeros(lay["size"], np.uint16)

        def zm(k, size, name=None):
            if name in at:
                assert k == 1, name
                return buf[at[name]:at[name] + size].reshape(1, size)
            return np.zeros((k, size), self.ops.act_dtype)

        self._acts = {
            "resid": z(L + 1, BT * C),   # resid[0] = encoded, resid[l+1] = residual3 of layer l
            "res2": z(Lx, BT * C),
            "ln1": zm(Lr, BT * C, "ln1"), "ln1_mean": z(L, BT), "ln1_rstd": z(L, BT),
            "qkv": zm(L, BT * 3 * C),    # bf16: attention reads q, k, v only rounded to bf16
            "atty": zm(L, BT * C), "lse": z(L, BT * NH),   # bf16: the attention writes it rounded
            "ln2": zm(Lr, BT * C, "ln2"), "ln2_mean": z(L, BT), "ln2_rstd": z(L, BT),
            "fch": zm(L, BT * 4 * C),    # bf16: the fc matmul rounds its output (GELU reads only that)
            "gelu": zm(Lg, BT * 4 * C, "gelu"),
            "lnf": zm(1, BT * C)[0], "lnf_mean": z(BT), "lnf_rstd": z(BT),
            # fp32: logits -> probs -> dlogits, in place; bf16: the lm head's bf16 logits
            "logits": np.zeros(plan.logits_rows * Vp, self.ops.logits_dtype),
            "losses": z(BT), "dlosses": z(BT),
        }
        self._bwd16 = buf
        self.plan = plan

    def prepare(self, B, T):
        """Allocate the training buffers for B x T now, as the first training forward would: the
        arrays a caller holds on to are then final (params_bf16, which level 3 shrinks)."""
        self._ensure_acts(B * T, self.config.num_layers)

    def _bwd16_layout(self, BT, level):
        """bf16 training: the backward's scratch in one uint16 buffer, {"size", "at": name ->
        offset, "n16": the staging's elements}. dbig (BT*4C: the fcproj backward's d(gelu), which
        the GEMM writes in bf16), dout16 (BT*4C) and then the one layer of gelu (-r >= 1)
        and ln2, ln1 (-r >= 2) the forward and backward recompute, all overlapping the lm head's
        dlogits staging (n16), which is in use only between the last layer's forward and the
        first layer's backward, when those are dead."""
        c = self.config
        C, nbig = c.channels, BT * 4 * c.channels
        n16 = min(BT, LMHEAD_GRAD_ROWS) * c.padded_vocab_size
        at, end = {"dbig": 0, "dout16": nbig}, 2 * nbig
        for name, size, lv in (("gelu", nbig, 1), ("ln2", BT * C, 2), ("ln1", BT * C, 2)):
            if level >= lv:
                at[name], end = end, end + size
        return {"size": max(n16, end), "at": at, "n16": n16}

    def _layer_acts(self, l, BT, keep):
        """Layer l's buffers for BT rows: its saved activations (keep), or the one layer of
        buffers every layer of a forward that keeps nothing reuses (the residual stream then
        ping-pongs between two rows)."""
        a, C, NH = self._acts, self.config.channels, self.config.num_heads
        n = BT * C
        r = l if keep else 0
        rg = 0 if self.plan.recompute >= 1 else r
        rr = 0 if self.plan.recompute >= 2 else r
        rx = 0 if self.plan.recompute >= 3 else r
        xr, outr = (l, l + 1) if keep else (l % 2, (l + 1) % 2)
        return SimpleNamespace(
            x=a["resid"][xr, :n], x2=a["res2"][rx, :n], out=a["resid"][outr, :n],
            ln1=a["ln1"][rr, :n], ln1_mean=a["ln1_mean"][r, :BT], ln1_rstd=a["ln1_rstd"][r, :BT],
            qkv=a["qkv"][r, :3 * n], atty=a["atty"][r, :n], lse=a["lse"][r, :BT * NH],
            atty16=None,   # the attention writes atty in the matmul precision itself
            ln2=a["ln2"][rr, :n], ln2_mean=a["ln2_mean"][r, :BT], ln2_rstd=a["ln2_rstd"][r, :BT],
            fch=a["fch"][r, :4 * n], gelu=a["gelu"][rg, :4 * n])

    def free_cached_buffers(self):
        """Drop the buffers the cached forward keeps across calls (block_forward), e.g. after a
        HellaSwag pass inside training, whose batches are far bigger than a decode step's."""
        self._step_bufs = None

    def _cached_layer_acts(self, x, out=None):
        """One layer's buffers for the rows of x (N, C) in a cached forward. The intermediates live
        in buffers kept across calls (grown to the most rows seen; each kernel overwrites its
        part whole): newly allocated ones cost page faults on every layer of every call, which
        measured a third of a HellaSwag batch. `out`, which the caller keeps, is the caller's
        (N*C float32, it may be x itself) or new."""
        N, C = x.shape
        n, m = N * C, self._step_bufs
        if m is None or m["ln1_mean"].size < N:
            e, em = (lambda k: np.empty(k, np.float32)), (lambda k: np.empty(k, self.ops.act_dtype))
            self._step_bufs = m = {
                "x2": e(n), "ln1": em(n), "ln1_mean": e(N), "ln1_rstd": e(N), "qkv": e(3 * n),
                "atty": e(n), "atty16": em(n) if self.precision == "bf16" else None,
                "ln2": em(n), "ln2_mean": e(N), "ln2_rstd": e(N), "fch": em(4 * n), "gelu": em(4 * n)}
        cut = {"ln1_mean": N, "ln1_rstd": N, "ln2_mean": N, "ln2_rstd": N, "qkv": 3 * n, "fch": 4 * n, "gelu": 4 * n}
        views = {k: (None if b is None else b[:cut.get(k, n)]) for k, b in m.items()}
        return SimpleNamespace(x=x.reshape(-1), out=_out_buffer(out, n, "rows x C"), lse=None, **views)

    def _lmhead_blocks(self, BT, tg, losses):
        """-> (r0, nr, buf) for row blocks of plan.logits_rows (a bf16 training plan's: of its
        staging rows, in them, as _lmhead_grad makes them), each block's logits computed then into
        buf (_lmhead_block), and with losses their softmax (buf then holds the probs) and losses
        written into losses[r0:r0+nr]."""
        d16 = self._staging()
        R = self.plan.logits_rows if d16 is None else d16.size // self.config.padded_vocab_size
        for r0 in range(0, BT, R):
            nr = min(BT - r0, R)
            yield r0, nr, self._lmhead_block(r0, nr, tg, None if losses is None else losses[r0:r0 + nr], d16)

    def _staging(self):
        """A bf16 training plan's staging rows of the lm head's dlogits (LMHEAD_GRAD_ROWS x Vp),
        where its row blocks' logits are made too; else None."""
        return None if self._bwd16 is None else self._ensure_scratch()["dlogits16"]

    def _lmhead_block(self, r0, nr, tg, losses, buf=None):
        """logits rows r0..r0+nr in buf (default: the logits buffer), then (losses given) their
        softmax (probs) and losses."""
        c = self.config
        C, V, Vp = c.channels, c.vocab_size, c.padded_vocab_size
        buf = (self._acts["logits"] if buf is None else buf)[:nr * Vp]
        self.ops.matmul(buf, self._acts["lnf"][r0 * C:(r0 + nr) * C], "wte", None, None, nr, C, Vp, self.n_threads)
        if losses is not None:
            self.ops.loss_forward(losses, buf, tg[r0:r0 + nr], nr, V, Vp, self.n_threads)
        return buf

    def _ensure_scratch(self):
        if self._scratch is None:
            C, BT = self.config.channels, self.plan.rows
            # dres, the residual stream's gradient, is first written once the lm head's logits are
            # done with: it lives in the logits buffer where that is big enough
            lg = self._acts["logits"]
            lg = lg if lg.dtype == np.float32 else lg[:lg.size // 2 * 2].view(np.float32)   # bf16's
            dres = lg[:BT * C] if lg.size >= BT * C else np.zeros(BT * C, np.float32)
            self._scratch = {"dres": dres, "dsmall": np.zeros(BT * C, np.float32)}
            if self.precision == "fp32":
                self._scratch["dbig"] = np.zeros(BT * 4 * C, np.float32)
            else:
                # dbig (the fcproj backward's bf16 d(gelu)), dout16 (every backward GEMM's bf16
                # dout; d(fch) too: gelu_backward writes it there) and the lm head's dlogits staged
                # LMHEAD_GRAD_ROWS rows at a time, in the buffer a training plan allocated
                # (_bwd16_layout): the staging is done with before the first layer's backward
                lay, buf, nbig = self._bwd16_layout(BT, self.plan.recompute), self._bwd16, BT * 4 * C
                self._scratch.update(dbig=buf[:nbig], dout16=buf[nbig:2 * nbig],
                                     dlogits16=buf[:lay["n16"]])
        return self._scratch

    def activation_bytes(self):
        """Bytes currently held by activation and activation-gradient buffers (views of one
        buffer counted once)."""
        held = {}
        for d in (self._acts, self._step_bufs, self._scratch):
            for a in (d or {}).values():
                if a is not None:
                    b = a if a.base is None else a.base
                    held[id(b)] = b.nbytes
        return sum(held.values())

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
    def _block_forward(self, l, a, B, T, kv=None):
        """Layer l of train_gpt2.c's gpt2_forward over B*T rows: a.out = the block of a.x, every
        intermediate written into a's buffers. kv None: attention over these T positions, keeping
        the per-row log-sum-exp for backward; kv a list of KVPart: the rows are the parts' rows
        one after another (B and T are then unused), each part's attending to its KV cache (its
        new K/V appended first): every row-wise product runs once over all the rows."""
        C, NH = self.config.channels, self.config.num_heads
        o, Ly, nt = self.ops, self.kernels.layers, self.n_threads
        n = a.x.size
        BT = n // C
        p = self.p
        # element-wise work of a few rows (a decode step) is too small to split: a second thread
        # only adds a barrier. The results do not depend on the thread count.
        nte = nt if n * 4 >= _MIN_PARALLEL else 1
        o.cast_layer(l, nt)
        o.layernorm(a.ln1, a.ln1_mean, a.ln1_rstd, a.x, p["ln1w"][l], p["ln1b"][l], BT, C, nte)
        o.matmul(a.qkv, a.ln1, "qkvw", l, p["qkvb"][l], BT, C, 3 * C, nt)
        if kv is None:
            o.attention_forward(a.atty, a.lse, a.qkv, B, T, C, NH, nt)
        else:
            r = 0
            for part in kv:
                self._attention_cached(part, a.qkv[3 * C * r:], a.atty[C * r:])
                r += part.rows
        o.matmul(a.x2, o.mm_input(a.atty16, a.atty, nte), "attprojw", l, p["attprojb"][l], BT, C, C, nt)
        # x2 = x + attproj(...), and ln2 of it in the same pass over the rows
        o.layernorm(a.ln2, a.ln2_mean, a.ln2_rstd, a.x2, p["ln2w"][l], p["ln2b"][l], BT, C, nte, residual=a.x)
        o.matmul(a.fch, a.ln2, "fcw", l, p["fcb"][l], BT, C, 4 * C, nt)
        o.gelu(a.gelu, a.fch, 4 * n, nte)
        o.matmul(a.out, a.gelu, "fcprojw", l, p["fcprojb"][l], BT, 4 * C, C, nt)
        Ly.residual_forward(a.out, a.out, a.x2, n, nte)

    def _attention_cached(self, part, qkv, atty):
        """One KVPart's attention in a cached forward: its rows' K/V appended to its cache, their
        queries attending to it (and to its prefix)."""
        C, NH = self.config.channels, self.config.num_heads
        k, v, pos, pre = part.k, part.v, part.pos, part.prefix
        B, Tcap = k.shape[0], k.shape[2]
        T = part.rows // B
        KV = self.kernels.kvcache
        kf, vf = k.reshape(-1), v.reshape(-1)
        qkv, atty = qkv[:part.rows * 3 * C], atty[:part.rows * C]
        nta = self._attention_threads(part.rows, B, Tcap + (0 if pre is None else pre[4]))
        # the new K/V: a prompt's (a few MB) copied on the attention's threads, a decode step's
        # few rows on one (a second thread's barrier costs more than the copy)
        KV.kvcache_append_forward(kf, vf, qkv, part.append_pos, B, T, C, NH, Tcap,
                                  nta if 8 * part.rows * C >= _MIN_PARALLEL else 1)
        if pre is not None:
            pre = (pre[0].reshape(-1), pre[1].reshape(-1)) + pre[2:]
        KV.attention_cached(atty, qkv, kf, vf, pos, B, T, C, NH, Tcap, nta, prefix=pre)

    def _attention_threads(self, rows, B, span):
        """Threads of a cached attention: `rows` queries of B cache rows, each seeing span positions."""
        # the cache is read from memory (the matmuls in between evict it): two threads read
        # it faster once it holds a few hundred KB (d12: a capacity of 86 positions or more).
        # Not where the one-row matmuls run on NumPy's BLAS (fp32): an OpenMP region between
        # them leaves its threads spinning against BLAS's (decode 7x slower, measured)
        C, nt = self.config.channels, self.n_threads
        small = self.ops.gemv_on_openmp and B * span * C >= _MIN_PARALLEL
        return nt if small or rows * span * C >= _MIN_PARALLEL * 16 else 1

    def forward(self, inputs, targets=None, keep_activations=True, loss_scale=None):
        """Run the model on inputs (B,T). With targets (B,T): per-token losses into self.losses and
        the mean loss returned (the logits buffer then holds probs); else returns None and
        self.logits() is valid. keep_activations=False (eval, sampling) reuses one layer's buffers
        for every layer: much less memory when no training forward ever ran, but no backward().
        loss_scale (with targets): the scale of the backward() that follows. This forward then also
        accumulates the lm head's gradient while its logits are at hand, each row's loss and
        dlogits made in one pass (and, where the lm head runs in row blocks, bf16 at large B*T, no
        block's logits computed twice); the same bits either way. A zero_grad() in between makes
        backward() remake it from the logits."""
        ids = self._check_ids(inputs, "inputs")
        B, T = ids.shape
        tg = None
        if targets is not None:
            tg = self._check_ids(targets, "targets")
            if tg.shape != ids.shape:
                raise ConfigError(f"targets shape {tg.shape} does not match inputs shape {ids.shape}")
        c = self.config
        L, C = c.num_layers, c.channels
        BT, n, nt = B * T, B * T * c.channels, self.n_threads
        keep = bool(keep_activations)
        if loss_scale is not None and (tg is None or not keep):
            raise ValueError("forward(loss_scale=...) is for a training forward: it needs targets "
                             "and keep_activations=True")
        self._lmhead_grad_scale = None
        self.ops.release()   # the fc buffer may hold the weights a cached forward read (_lend_weights)
        if keep and tg is not None and self.grads_spent:
            self.ops.park(self.g)   # level 3: the backward reads the layers' weights where this casts them
        else:
            self.ops.unpark()
        self._sync_bf16()
        self._ensure_acts(BT, L if keep else 1)
        a, p = self._acts, self.p
        self.kernels.layers.encoder_forward(a["resid"][0, :n], ids.reshape(-1), p["wte"].reshape(-1),
                                            p["wpe"].reshape(-1), B, T, C, nt)
        for l in range(L):
            self._block_forward(l, self._layer_acts(l, BT, keep), B, T)
        h = a["resid"][L if keep else L % 2, :n]
        self.ops.layernorm(a["lnf"][:n], a["lnf_mean"][:BT], a["lnf_rstd"][:BT], h, p["lnfw"], p["lnfb"], BT, C, nt)
        self._B, self._T, self._ids, self._targets, self._kept = B, T, ids, tg, keep
        return self._lmhead_forward(tg, BT, loss_scale)

    def _lmhead_forward(self, tg, BT, loss_scale=None):
        """logits = lnf @ wte^T, and with targets their softmax and per-token losses -> mean loss."""
        c = self.config
        C, V, Vp = c.channels, c.vocab_size, c.padded_vocab_size
        a = self._acts
        if tg is not None and self.plan.logits_rows < BT:   # bf16, large B*T: the lm head in blocks
            losses, tgf = a["losses"][:BT], tg.reshape(-1)
            if loss_scale is None:
                for _ in self._lmhead_blocks(BT, tgf, losses):
                    pass
            else:   # each block's softmax and loss made together with its dlogits
                self._lmhead_grad(BT, loss_scale, None, losses)
            self._buf_state = "train"
            self._lmhead_grad_scale = loss_scale
            return float(losses.astype(np.float64).mean())
        if self.plan.logits_rows < BT:   # the logits of every row are asked for: hold them all
            a["logits"] = np.zeros(self.plan.rows * Vp, self.ops.logits_dtype)
            self.plan = replace(self.plan, logits_rows=self.plan.rows)
        logits = a["logits"][:BT * Vp]
        self.ops.matmul(logits, a["lnf"][:BT * C], "wte", None, None, BT, C, Vp, self.n_threads)
        self._buf_state = "logits"
        if tg is None:
            return None
        losses = a["losses"][:BT]
        if loss_scale is None:
            self.ops.loss_forward(losses, logits, tg.reshape(-1), BT, V, Vp, self.n_threads)
            self._buf_state = "probs"   # (bf16: the logits, which loss_backward reads)
        else:   # the losses, and the dlogits and GEMMs of the lm head's gradient, in one pass over the rows
            self._lmhead_grad(BT, loss_scale, self._held_blocks(BT), losses)
            self._buf_state = "train"
            self._lmhead_grad_scale = loss_scale
        return float(losses.astype(np.float64).mean())

    @property
    def losses(self):
        """(B,T) per-token losses of the last forward with targets (a view; overwritten next time)."""
        if self._targets is None:
            raise RuntimeError("no per-token losses: the last forward had no targets")
        return self._acts["losses"][:self._B * self._T].reshape(self._B, self._T)

    def logits(self):
        """(B,T,Vp) float32 logits of the last forward (fp32: a view, overwritten by the next
        forward; bf16: the lm head's bf16 logits widened into a new array). Valid only after
        forward(inputs) without targets (with targets the buffer holds probs)."""
        if self._buf_state != "logits":
            raise RuntimeError("logits are only available after forward(inputs) without targets")
        BT, Vp = self._B * self._T, self.config.padded_vocab_size
        return self.ops.logits_fp32(self._acts["logits"][:BT * Vp].reshape(self._B, self._T, Vp))

    # -- the cached forward (sampling, HellaSwag): new positions attend to a KV cache ------------
    def embed(self, tokens, pos):
        """x (B*Tq, C) = wte[tokens] + wpe[pos[b] + t] for tokens (B,Tq). Positions past maxT
        (padding only) are clamped."""
        B, Tq = tokens.shape
        t = pos[:, None].astype(np.int64) + np.arange(Tq)[None, :]
        np.minimum(t, self.config.max_seq_len - 1, out=t)
        x = self.p["wte"][np.asarray(tokens).reshape(-1)]
        x += self.p["wpe"][t.reshape(-1)]
        return x

    def block_forward(self, l, x, k, v, pos, out=None):
        """Layer l over x (B*Tq, C) whose row b holds positions pos[b] .. pos[b]+Tq-1: their K/V
        are written into k, v (B, NH, Tcap, hs: layer l's cache) and they attend to every cached
        position up to themselves. -> the new residual stream (B*Tq, C), in out if given (a
        float32 array of x's size; x itself is fine: x is last read before out is written)."""
        return self.block_forward_parts(l, x, [KVPart(k, v, pos, x.shape[0])], out)

    def block_forward_parts(self, l, x, parts, out=None):
        """Layer l over x (N, C): the rows of each KVPart in turn (part.rows of them, part.pos
        and part.prefix as KVPart says). The row-wise products (layernorms, matmuls, GELU) run
        once over all N rows, the attention part by part, in order: a part may read as its
        prefix a cache an earlier part wrote in this call. -> the new residual stream (N, C), in
        out if given (as block_forward)."""
        self._sync_bf16()
        self._lend_weights()
        if sum(part.rows for part in parts) != x.shape[0]:
            raise ValueError(f"the parts hold {sum(part.rows for part in parts)} rows, x {x.shape[0]}")
        a = self._cached_layer_acts(np.ascontiguousarray(x, dtype=np.float32), out)
        self._block_forward(l, a, None, None, parts)
        return a.out.reshape(x.shape)

    def final_norm(self, x):
        """The final layernorm of x (N, C), in fp32 (the hidden states callers keep and slice)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        N, C = x.shape
        out = np.empty((N, C), dtype=np.float32)
        mean, rstd = np.empty(N, dtype=np.float32), np.empty(N, dtype=np.float32)
        self.kernels.layers.layernorm_forward(out.reshape(-1), mean, rstd, x.reshape(-1), self.p["lnfw"],
                                              self.p["lnfb"], N, C, self.n_threads)
        return out

    def logits_from_hidden(self, h, out=None, as_trained=False):
        """Logits (..., V) over the real vocab (the padded rows are zero and never sampled) for
        final-normed hidden states h (..., C); written into out if given (an array of h's rows x V
        elements: callers scoring many batches keep one). float32; as_trained=True: in the dtype
        the training forward holds them (ops.logits_dtype: bf16 bits as uint16 in bf16, as llm.c's
        bf16 model and autocast's lm head give them), for scoring as `eval loss` scores."""
        self._sync_bf16()
        h = np.asarray(h, dtype=np.float32)
        C, V = self.config.channels, self.config.vocab_size
        x = np.ascontiguousarray(h).reshape(-1)
        N = x.size // C
        out = _out_buffer(out, N * V, f"{N} x {V}, rows x vocab", self.ops.logits_dtype if as_trained else np.float32)
        xm = self.ops.mm_input(np.empty(x.size, self.ops.act_dtype), x, self.n_threads)
        self.ops.matmul(out, xm, "wte", None, None, N, C, V, self.n_threads)
        return out.reshape(h.shape[:-1] + (V,))

    def forward_cached(self, cache, tokens):
        """Run tokens (B,Tq) as the next Tq positions of each row of cache (a KVCache); -> the
        final-normed hidden states (B,Tq,C) (logits: logits_from_hidden). Advances cache.lengths."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[0] != cache.B or tokens.shape[1] < 1:
            raise ValueError(f"tokens must be (B={cache.B}, Tq >= 1), got shape {tokens.shape}")
        B, Tq = tokens.shape
        end = int(cache.lengths.max()) + Tq
        if end > cache.Tcap:
            raise ValueError(f"cache of {cache.Tcap} positions cannot take {Tq} more after {end - Tq}")
        if end > self.config.max_seq_len:
            raise ConfigError(f"sequence of {end} tokens exceeds the model's maxT = {self.config.max_seq_len}")
        if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise ConfigError(f"token ids must be in [0, {self.config.vocab_size})")
        x = self.embed(tokens, cache.lengths)
        if Tq > 1 or not self._decode_layers(x, cache):
            for l in range(self.config.num_layers):
                x = self.block_forward(l, x, cache.k[l], cache.v[l], cache.lengths)
        cache.lengths += Tq
        return self.final_norm(x).reshape(B, Tq, self.config.channels)

    def _decode_layers(self, x, cache):
        """A bf16 decode step (one new position for each of a few rows) through every layer in
        one call into Cython (_ext/decode.pyx), x (B, C) overwritten: the bits of block_forward
        layer by layer, without its ~10 Python calls per layer. -> False where that does not
        apply (fp32, rows beyond the bf16 GEMV's, layers casting their own weights at level 3
        with no loan); block_forward's loop then runs."""
        B = x.shape[0]
        if self.precision != "bf16" or not self.kernels.matmul.gemv_bf16_available(B):
            return False
        self._sync_bf16()
        self._lend_weights()
        wts = self.ops.layer_weights_in(self.params_bf16)
        if wts is None:
            return False
        c = self.config
        C, L = c.channels, c.num_layers
        if self._param_offs is None:
            self._param_offs = np.array([[self._offs[n][0] + l * self._offs[n][1] // L for n in _DECODE_PARAMS]
                                         for l in range(L)], dtype=np.int64)
        nt = self.n_threads
        self.kernels.decode.decode_layers_bf16(x.reshape(-1), wts[0], wts[1].reshape(-1), self.params,
                                               self._param_offs.reshape(-1), cache.k.reshape(-1),
                                               cache.v.reshape(-1), cache.lengths, B, C, c.num_heads,
                                               cache.Tcap, nt, self._attention_threads(B, B, cache.Tcap))
        return True

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
        self._fill_spent()
        self.ops.unpark()
        if b is not self.grads:
            b[:] = self.grads
        self.grads = b
        self.g = _views(b, self._offs)
        return b

    def zero_grad(self, lazy=False):
        """Set grads to 0 before a step's backward. Free right after fp32's update(zero_grads=True),
        whose AdamW pass already cleared them (grads_known_zero; after bf16's, which writes no
        zeros, lazy=True is free and a plain call fills); otherwise (the first step, a
        skipped or refused update, grads written by backward since) one fill over the buffer. Code
        that writes grads other than through backward() must do it after zero_grad(), not between
        update() and it.

        lazy=True (the trainer's): where the ops write a gradient's first contribution instead of
        adding it (bf16: beta-0 GEMMs for GEMM_GRADS, a fill of the rest), only mark the grads
        spent, with no pass over them: the next forward(loss_scale=)/backward() overwrites them,
        with the bits of adding into zeros, and until then they read as junk (update() and
        grad_norm() fill them first). fp32 fills (llm.c's kernels accumulate)."""
        self.ops.unpark()   # weights a forward parked in spent gradients are cast again by backward()
        if lazy and self.ops.first_write and not self.grads_known_zero:
            self.grads_spent = True
        elif not self.grads_known_zero:
            self.kernels.layers.zero_fill(self.grads, self.n_threads)
            self.grads_spent = False
        self._overwrite = set()
        self.grads_known_zero = False
        self._lmhead_grad_scale = None   # a forward's lm-head gradient is gone: backward remakes it

    def _fill_spent(self):
        """Spent grads read by something other than a backward: the zeros they stand for."""
        if self.grads_spent:
            self.ops.unpark()
            self.kernels.layers.zero_fill(self.grads, self.n_threads)
            self.grads_spent, self._overwrite, self.grads_known_zero = False, set(), True

    def _begin_grads(self):
        """Before a gradient write: spent grads get their small tensors zeroed, and GEMM_GRADS
        are marked for the next GEMM into each to overwrite."""
        if self.grads_spent:
            nt = self.n_threads
            for name in PARAM_NAMES:
                if name not in GEMM_GRADS:
                    self.kernels.layers.zero_fill(self.g[name].reshape(-1), nt)
            self.grads_spent, self._overwrite = False, set(GEMM_GRADS)

    def backward(self, loss_scale=1.0):
        """Accumulate d(loss_scale * mean loss)/d(params) into self.grads (dloss per token =
        loss_scale/(B*T)). Needs the immediately preceding forward to have had targets."""
        if self._buf_state not in ("probs", "train") or not self._kept:
            raise RuntimeError("backward() needs a forward(inputs, targets) right before it "
                               "(with keep_activations=True)")
        self.grads_known_zero = False
        self._begin_grads()
        c = self.config
        L, C = c.num_layers, c.channels
        B, T = self._B, self._T
        BT, nt, n = B * T, self.n_threads, B * T * C
        a, p, g, Ly = self._acts, self.p, self.g, self.kernels.layers
        s = self._ensure_scratch()
        dres, dlnf = s["dres"][:n], self._lmhead_backward(loss_scale)
        Ly.zero_fill(dres, nt)
        cast = self.ops.layernorm_backward(dres, g["lnfw"], g["lnfb"], dlnf, a["resid"][L, :n], p["lnfw"],
                                           a["lnf_mean"][:BT], a["lnf_rstd"][:BT], BT, C, nt, s.get("dout16"),
                                           g["fcprojb"][L - 1])
        for l in reversed(range(L)):
            cast = self._block_backward(l, self._layer_acts(l, BT, True), B, T, cast)
        Ly.encoder_backward(g["wte"].reshape(-1), g["wpe"].reshape(-1), dres, self._ids.reshape(-1), B, T, C, nt)
        self._overwrite = set()
        self.ops.unpark()

    def _lmhead_grad(self, BT, loss_scale, blocks, losses=None):
        """dlnf (the scratch's dsmall, B*T*C) = d(loss_scale * mean loss)/d(lnf), and the lm head's
        d(wte) accumulated, from `blocks`: (r0, nr, probs) in row order, or with `losses` (BT)
        (r0, nr, logits) whose softmax and losses are made here first, row by row with their
        dlogits; blocks None (bf16, with `losses`): the logits made here, in the staging rows.
        bf16: each block's dlogits are written straight in bf16 into the staging rows of the
        scratch, and the GEMMs run each time those are full; fp32: in place over the probs (one
        block of every row)."""
        self.grads_known_zero = False
        self._begin_grads()
        C, V, Vp, nt = self.config.channels, self.config.vocab_size, self.config.padded_vocab_size, self.n_threads
        tg, lnf = self._targets.reshape(-1), self._acts["lnf"]
        dlosses = self._acts["dlosses"][:BT]
        dlosses.fill(np.float32(loss_scale / BT))
        dlnf = self._ensure_scratch()["dsmall"][:BT * C]
        d16 = self._scratch.get("dlogits16")
        G = BT if d16 is None else d16.size // Vp

        def gemms(s0, s1, dout):   # rows s0..s1 of dlnf written, d(wte) accumulated (or written first)
            self.ops.matmul_backward(dlnf[s0 * C:s1 * C], self.g["wte"].reshape(-1), None, dout, d16,
                                     lnf[s0 * C:s1 * C], "wte", None, s1 - s0, C, Vp, nt, accumulate=False,
                                     dweight_accumulate=self._written("wte"))

        if blocks is None:   # bf16, the lm head in blocks: each staging's worth of logits made in
            # the staging rows, their losses and dlogits over them (each row is read whole before
            # it is written) and the GEMMs run: one pass over wte's bf16 copy per G rows
            for r0 in range(0, BT, G):
                nr, rows = min(G, BT - r0), slice(r0, min(BT, r0 + G))
                blk = self._lmhead_block(r0, nr, tg, None, d16)
                self.ops.loss_forward_backward(losses[rows], blk, blk, tg[rows], dlosses[rows], nr, V, Vp, nt)
                gemms(r0, r0 + nr, None)
            return dlnf
        s0, dout = 0, None   # the first staged row; fp32's dlogits
        for r0, nr, probs in blocks:
            if r0 + nr - s0 > G:
                gemms(s0, r0, dout)
                s0 = r0
            dst = None if d16 is None else d16[(r0 - s0) * Vp:]
            rows = slice(r0, r0 + nr)
            if losses is None:
                dout, _ = self.ops.loss_backward(dst, probs, tg[rows], dlosses[rows], nr, V, Vp, nt)
            else:
                dout, _ = self.ops.loss_forward_backward(losses[rows], dst, probs, tg[rows], dlosses[rows],
                                                         nr, V, Vp, nt)
        gemms(s0, BT, dout)
        return dlnf

    def _written(self, name):
        """Whether the next GEMM into gradient `name` adds to it. False for a spent step's first:
        it overwrites. The lm head's later row blocks then add; a layer matrix's name stays
        marked until backward() ends, as each layer's GEMM is the first into its own rows."""
        if name not in self._overwrite:
            return True
        if name == "wte":
            self._overwrite.discard(name)
        return False

    def _held_blocks(self, BT):
        """(r0, nr, rows r0..r0+nr of the logits buffer) over all BT rows, as many rows a block as
        the lm head's gradient stages (fp32: one block)."""
        Vp = self.config.padded_vocab_size
        d16, logits = self._ensure_scratch().get("dlogits16"), self._acts["logits"]
        R = BT if d16 is None else d16.size // Vp
        return ((r0, min(R, BT - r0), logits[r0 * Vp:min(BT, r0 + R) * Vp]) for r0 in range(0, BT, R))

    def _lmhead_backward(self, loss_scale):
        """-> dlnf = d(loss)/d(lnf), with the lm head's d(wte) accumulated (_lmhead_grad): from the
        probs the forward kept, or from logits recomputed (block by block where the forward ran
        in blocks) when it kept none; or nothing to do when that forward made them already (its
        loss_scale)."""
        BT, C, Vp = self._B * self._T, self.config.channels, self.config.padded_vocab_size
        state, self._buf_state = self._buf_state, "dlogits"
        if self._lmhead_grad_scale is not None:
            if self._lmhead_grad_scale != loss_scale:
                raise ValueError(f"backward(loss_scale={loss_scale!r}) after forward(loss_scale="
                                 f"{self._lmhead_grad_scale!r}): the lm head's gradient was made "
                                 "with the forward's; pass the same value to both")
            return self._scratch["dsmall"][:BT * C]
        if state == "probs":   # the probs of every row are held
            return self._lmhead_grad(BT, loss_scale, self._held_blocks(BT))
        # the logits again (the same GEMM on the same inputs: the same bits), and their losses unused
        junk = np.empty(BT, np.float32)
        if self.plan.logits_rows < BT:
            return self._lmhead_grad(BT, loss_scale, None, junk)
        self.ops.matmul(self._acts["logits"][:BT * Vp], self._acts["lnf"][:BT * C], "wte", None, None,
                        BT, C, Vp, self.n_threads)
        return self._lmhead_grad(BT, loss_scale, self._held_blocks(BT), junk)

    def _block_backward(self, l, a, B, T, cast):
        """Layer l of train_gpt2.c's gpt2_backward: the scratch's dres holds d(a.out) on entry
        and d(a.x) on return; layer l's parameter gradients are accumulated. cast: the layernorm
        backward before this already wrote dres in bf16 into dout16 and summed fcproj's bias
        gradient (ops.layernorm_backward). -> the same for the layer below."""
        c = self.config
        C, NH = c.channels, c.num_heads
        BT, n, nt = B * T, B * T * C, self.n_threads
        o, p, g = self.ops, self.p, self.g
        s = self._scratch
        dres, dsmall, dbig, d16 = s["dres"][:n], s["dsmall"][:n], s["dbig"][:4 * n], s.get("dout16")
        gW = lambda name: g[name][l].reshape(-1)
        gb = lambda name: g[name[:-1] + "b"][l]
        o.cast_layer(l, nt)
        if self.plan.recompute >= 3:   # x2 (and ln2) as the forward made them: the same GEMM on the same inputs
            o.matmul(a.x2, o.mm_input(a.atty16, a.atty, nt), "attprojw", l, p["attprojb"][l], BT, C, C, nt)
            o.layernorm(a.ln2, a.ln2_mean, a.ln2_rstd, a.x2, p["ln2w"][l], p["ln2b"][l], BT, C, nt, residual=a.x)
        # the GELU again, on the same inputs: the same bits; fp32 makes it in its backward's pass
        fuse = self.plan.recompute >= 1 and o.gelu_forward_backward is not None
        if self.plan.recompute >= 1 and not fuse:
            o.gelu(a.gelu, a.fch, 4 * n, nt)
        if self.plan.recompute == 2:
            o.layernorm(a.ln2, a.ln2_mean, a.ln2_rstd, a.x2, p["ln2w"][l], p["ln2b"][l], BT, C, nt)
        if self.plan.recompute >= 2:
            o.layernorm(a.ln1, a.ln1_mean, a.ln1_rstd, a.x, p["ln1w"][l], p["ln1b"][l], BT, C, nt)
        # out = x2 + fcproj(gelu(fc(ln2(x2)))); the activation gradients are written (accumulate=False)
        dgelu = o.act_grad(dbig, 4 * n)
        if fuse:   # d(gelu) first, d(fch) over it in place with the GELU, then fcproj's d(weight)
            o.matmul_backward(dgelu, None, None if cast else gb("fcprojw"), None if cast else dres, d16, a.gelu,
                              "fcprojw", l, BT, 4 * C, C, nt, accumulate=False)
            dfch, dbfc, fc_mm = o.gelu_forward_backward(a.gelu, dgelu, gb("fcw"), a.fch, d16, BT, 4 * C, nt)
            o.matmul_backward(None, gW("fcprojw"), None, None if cast else dres, d16, a.gelu, "fcprojw", l, BT,
                              4 * C, C, nt, dweight_accumulate=self._written("fcprojw"))
        else:
            o.matmul_backward(dgelu, gW("fcprojw"), None if cast else gb("fcprojw"), None if cast else dres, d16,
                              a.gelu, "fcprojw", l, BT, 4 * C, C, nt, accumulate=False,
                              dweight_accumulate=self._written("fcprojw"))
            # fp32: d(fch) over the gelu buffer, free now; bf16: straight into d16 with fc's dbias
            dfch, dbfc = o.gelu_backward(a.gelu, d16, gb("fcw"), a.fch, dgelu, BT, 4 * C, nt)
            fc_mm = d16
        o.matmul_backward(dsmall, gW("fcw"), dbfc, dfch, fc_mm, a.ln2, "fcw", l, BT, C, 4 * C, nt, accumulate=False,
                          dweight_accumulate=self._written("fcw"))
        # d(x2) = d(out) + the LN2 branch, accumulated in place
        cast = o.layernorm_backward(dres, g["ln2w"][l], g["ln2b"][l], dsmall, a.x2, p["ln2w"][l],
                                    a.ln2_mean, a.ln2_rstd, BT, C, nt, d16, gb("attprojw"))
        # x2 = x + attproj(attention(qkv(ln1(x))))
        datty = o.act_grad(dsmall, n)
        o.matmul_backward(datty, gW("attprojw"), None if cast else gb("attprojw"), None if cast else dres, d16,
                          a.atty, "attprojw", l, BT, C, C, nt, accumulate=False,
                          dweight_accumulate=self._written("attprojw"))
        # fp32: d(qkv) over dbig; bf16: straight into d16 with qkv's dbias, as fc's above
        dqkv, dbqkv = o.attention_backward(dbig, d16, gb("qkvw"), datty, a.qkv, a.atty, a.lse, B, T, C, NH, nt)
        o.matmul_backward(dsmall, gW("qkvw"), dbqkv, dqkv, d16, a.ln1, "qkvw", l, BT, C, 3 * C, nt,
                          accumulate=False, dweight_accumulate=self._written("qkvw"))
        # below layer 0 the encoder's backward reads dres in fp32: nothing to cast
        return o.layernorm_backward(dres, g["ln1w"][l], g["ln1b"][l], dsmall, a.x, p["ln1w"][l],
                                    a.ln1_mean, a.ln1_rstd, BT, C, nt, d16 if l > 0 else None,
                                    g["fcprojb"][l - 1] if l > 0 else None)

    # -- optimizer ------------------------------------------------------------------------------
    def grad_norm(self):
        """Global L2 norm of all gradients (deterministic for a fixed n_threads)."""
        self._fill_spent()
        return math.sqrt(self.kernels.adamw.global_norm_sq(self.grads, self.n_threads))

    def _decay_runs(self, cut=None):
        """Contiguous (start, stop, decays) runs of the flat buffer, merging neighbours, but not
        across offset `cut` (the end of a bf16 copy that holds only the first tensors)."""
        runs = []
        for name in PARAM_NAMES:
            off, n, _ = self._offs[name]
            dec = name in DECAY_PARAMS
            if runs and runs[-1][2] == dec and runs[-1][1] == off and off != cut:
                runs[-1][1] = off + n
            else:
                runs.append([off, off + n, dec])
        return runs

    def update(self, lr, beta1, beta2, eps, weight_decay, grad_scale, step, zero_grads=False):
        """One AdamW step (train_gpt2.cu `gpt2_update`): t = step is 1-based; weight decay only on DECAY_PARAMS.
        zero_grads: the gradients are spent once read, and the next zero_grad() skips its fill:
        fp32's AdamW pass sets each chunk to 0 right after reading it (the parameters, m, v are
        the same bits); bf16 marks them spent for the next backward to overwrite (no zeros written
        at all: zero_grad(lazy=True) keeps them so, a plain zero_grad() fills them)."""
        self._fill_spent()
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
        spend = bool(zero_grads) and self.ops.first_write
        zero_grads = bool(zero_grads) and not spend
        for lo, hi, dec in self._decay_runs(None if pb is None else pb.size):
            self.kernels.adamw.adamw_update(self.params[lo:hi], self.grads[lo:hi], self.m[lo:hi], self.v[lo:hi],
                                       lr, beta1, beta2, eps, weight_decay if dec else 0.0, grad_scale,
                                       int(step), self.n_threads, None if pb is None or hi > pb.size else pb[lo:hi],
                                       zero_grads=zero_grads)
        self._bf16_fresh = pb is not None   # the runs cover every parameter
        self.ops.params_changed()
        self.grads_known_zero = bool(zero_grads)   # ... and every gradient
        self.grads_spent = spend

    def update_shard(self, pieces, m, v, lr, beta1, beta2, eps, weight_decay, grad_scale, step):
        """AdamW (as update) on some pieces of the parameters only: ZeRO-1's shard
        (llmctl/distributed/zero.py). pieces: [(lo, hi, m_off, name)]; m, v hold the moments of
        the pieces only, piece k at m_off. The bf16 copy of the pieces is written in the same
        pass; the rest of it must be re-cast (params_gathered) once the other ranks' pieces are in."""
        if step < 1:
            raise ValueError(f"AdamW step t is 1-based, got {step}")
        self._fill_spent()
        pb = self.params_bf16
        for lo, hi, mo, name in pieces:
            n = hi - lo
            self.kernels.adamw.adamw_update(self.params[lo:hi], self.grads[lo:hi], m[mo:mo + n], v[mo:mo + n],
                                       lr, beta1, beta2, eps, weight_decay if name in DECAY_PARAMS else 0.0,
                                       grad_scale, int(step), self.n_threads,
                                       None if pb is None or name not in self.pb else pb[lo:hi])
        self.ops.params_changed()

    def params_gathered(self, ranges):
        """params[lo:hi] for each (lo, hi) were written by an all-gather: re-cast their bf16 copy
        (the same bits the rank that updated them wrote), keeping the copy current."""
        if self.params_bf16 is None:
            return
        if not self._bf16_fresh:
            self._sync_bf16()
            return
        self.ops.params_changed()
        for lo, hi in ranges:
            hi = min(hi, self.params_bf16.size)
            if lo < hi:
                self.kernels.convert.cast_to_bf16(self.params_bf16[lo:hi], self.params[lo:hi], self.n_threads)
