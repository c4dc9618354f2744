"""GPT-2's KV-cached inference forward: new positions attend to the cached keys/values of earlier ones.

What it is: `KVCache` + `forward_cached`: GPT-2's forward over Tq NEW positions per row,
attending to the keys/values of all earlier positions kept in a per-layer cache (decode: one
position per step instead of llm.c's full recompute of every position). Exact up to float32
rounding, because attention is causal: a position never sees later ones. The per-layer pieces
(`embed`, `block_forward`, `final_norm`, `lm_logits`) are public so a caller can share one
context's cache between several continuations (llmctl/evaluate.py runs a HellaSwag context once
for its four completions). It reads the training model's parameters (llmctl/model/gpt2.py)
through `weights(model)`: one set of weights, two forwards.
What it is not: a training forward (no activations kept, no backward; that is
llmctl/model/gpt2.py) or a sampler (llmctl/sample.py).

In bf16 (a model built with precision="bf16") the matmuls multiply bf16 (the model's
`params_bf16` and activations written as bf16 by layernorm/GELU, the attention output cast) and
accumulate fp32, as the training forward does; layernorm, attention and the KV cache stay fp32.

Mirrors train_gpt2.c `gpt2_forward` (per layer: LN, qkv matmul, attention, proj, residual, LN,
fc, GELU, fcproj, residual; final LN; logits = lnf @ wte^T, here over the first V rows only).
"""
import numpy as np

from llmctl.errors import ConfigError
from llmctl.info import default_threads
from llmctl.model.config import param_shapes

_MIN_PARALLEL = 1 << 16   # floats of element-wise work below which kernels run on one thread


# ----------------------------------------------------------------------------------------------
# weights and the cache

class Weights:
    """Shaped float32 views of a model's 16 parameter tensors plus the config dimensions."""

    def __init__(self, model):
        cfg = model.config
        self.maxT, self.V, self.Vp = cfg.max_seq_len, cfg.vocab_size, cfg.padded_vocab_size
        self.L, self.NH, self.C = cfg.num_layers, cfg.num_heads, cfg.channels
        for name, shape in param_shapes(cfg):
            a = np.asarray(model.p[name])
            if a.dtype != np.float32 or a.size != int(np.prod(shape)):
                raise ValueError(f"model.p[{name!r}] is {a.dtype} x {a.size}, expected float32 {shape}")
            setattr(self, name, a.reshape(shape))
        self.wte_V = self.wte[:self.V]  # the lm head: padded rows are zero and never sampled
        self.K, self.Ly, self.KV = _kernels()
        # bf16: the matmul weights as the model's bf16 copy (kept current by the model)
        self.bf16 = getattr(model, "precision", "fp32") == "bf16"
        if self.bf16:
            from llmctl._ext import convert

            self.CV = convert
            for name in ("qkvw", "attprojw", "fcw", "fcprojw", "wte"):
                setattr(self, name + "16", np.asarray(model.pb[name]))
            self.wte_V16 = self.wte16[:self.V]
        self.mm = getattr(model, "matmul_backend", "blas")
        self.n_threads = getattr(model, "n_threads", None) or default_threads()


def weights(model):
    """The model's Weights (cached on the model object; rebuilt if its parameter buffer was replaced).
    In bf16 the model's bf16 copy is brought up to date first (a no-op unless params changed)."""
    sync = getattr(model, "_sync_bf16", None)
    if sync is not None:
        sync()
    ptr = np.asarray(model.p["wte"]).__array_interface__["data"][0]
    w = getattr(model, "_llmctl_cached_weights", None)
    if w is None or w.src_ptr != ptr:
        w = Weights(model)
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


def linear(w, x, W, b, n_threads):
    """out (N, OC) fp32 = x (N, Cin) @ W^T + b. In bf16, x is uint16 and W the bf16 weight."""
    N, Cin = x.shape
    OC = W.shape[0]
    out = np.empty((N, OC), dtype=np.float32)
    if w.bf16:
        w.K.matmul_forward_bf16(out.reshape(-1), x.reshape(-1), W.reshape(-1), b, N, Cin, OC, n_threads)
        return out
    if N == 1:
        # a decode step is matrix-vector: BLAS sgemv (through NumPy, whose BLAS pool
        # configure_threads also sizes) streams the weights ~5x faster than sgemm with M = 1
        np.matmul(W, x[0], out=out[0])
        if b is not None:
            out += b
        return out
    w.K.matmul_forward(out.reshape(-1), x.reshape(-1), W.reshape(-1), b, N, Cin, OC, n_threads, w.mm)
    return out


def layernorm(w, x, weight, bias, n_threads):
    """The layernorm of x (N, C), in the matmul input precision (bf16: uint16, written by the kernel)."""
    N, C = x.shape
    out = np.empty(x.shape, dtype=np.uint16 if w.bf16 else np.float32)
    mean = np.empty(N, dtype=np.float32)
    rstd = np.empty(N, dtype=np.float32)
    f = w.Ly.layernorm_forward_bf16 if w.bf16 else w.Ly.layernorm_forward
    f(out.reshape(-1), mean, rstd, np.ascontiguousarray(x).reshape(-1), weight, bias, N, C, n_threads)
    return out


def _mm_input(w, x, n_threads):
    """x (fp32) as the matmuls read it: itself, or its bf16 cast."""
    if not w.bf16:
        return x
    out = np.empty(x.shape, dtype=np.uint16)
    w.CV.cast_to_bf16(out.reshape(-1), x.reshape(-1), n_threads)
    return out


def _W(w, name, l=None):
    """Weight `name` (layer l) in the matmul precision."""
    a = getattr(w, name + "16" if w.bf16 else name)
    return a if l is None else a[l]


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
    ln1 = layernorm(w, x, w.ln1w[l], w.ln1b[l], nt_ew)
    qkv = linear(w, ln1, _W(w, "qkvw", l), w.qkvb[l], n_threads)
    kf, vf, qf = k.reshape(-1), v.reshape(-1), qkv.reshape(-1)
    w.KV.kvcache_append_forward(kf, vf, qf, pos, B, Tq, C, NH, Tcap)
    atty = np.empty_like(x)
    w.KV.attention_cached(atty.reshape(-1), qf, kf, vf, pos, B, Tq, C, NH, Tcap, nt_att)
    x2 = linear(w, _mm_input(w, atty, nt_ew), _W(w, "attprojw", l), w.attprojb[l], n_threads)
    n = x2.size
    w.Ly.residual_forward(x2.reshape(-1), x2.reshape(-1), x.reshape(-1), n, nt_ew)
    ln2 = layernorm(w, x2, w.ln2w[l], w.ln2b[l], nt_ew)
    fch = linear(w, ln2, _W(w, "fcw", l), w.fcb[l], n_threads)
    if w.bf16:
        gelu = np.empty(fch.shape, dtype=np.uint16)
        w.Ly.gelu_forward_bf16(gelu.reshape(-1), fch.reshape(-1), fch.size, nt_ew)
    else:
        gelu = fch
        w.Ly.gelu_forward(fch.reshape(-1), fch.reshape(-1), fch.size, nt_ew)
    x3 = linear(w, gelu, _W(w, "fcprojw", l), w.fcprojb[l], n_threads)
    w.Ly.residual_forward(x3.reshape(-1), x3.reshape(-1), x2.reshape(-1), n, nt_ew)
    return x3


def final_norm(w, x, n_threads):
    """The final layernorm (fp32: the hidden states callers keep and slice)."""
    N, C = x.shape
    out = np.empty((N, C), dtype=np.float32)
    mean, rstd = np.empty(N, dtype=np.float32), np.empty(N, dtype=np.float32)
    w.Ly.layernorm_forward(out.reshape(-1), mean, rstd, np.ascontiguousarray(x).reshape(-1), w.lnfw, w.lnfb,
                           N, C, n_threads)
    return out


def lm_logits(w, h, n_threads):
    """Logits over the real vocab V only (padded rows are zero and never sampled): (N, V)."""
    h = np.ascontiguousarray(h, dtype=np.float32).reshape(-1, w.C)
    return linear(w, _mm_input(w, h, n_threads), _W(w, "wte_V"), None, n_threads)


def forward_cached(model, cache, tokens, n_threads=None):
    """Run tokens (B,Tq) int as the next Tq positions of each cached row; return the final
    layernormed hidden states (B,Tq,C) (logits: `lm_logits`). Advances cache.lengths by Tq."""
    w = weights(model)
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
    w = weights(model)
    h = np.asarray(h)
    return lm_logits(w, h, int(n_threads or w.n_threads)).reshape(h.shape[:-1] + (w.V,))
