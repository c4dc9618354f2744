"""A bf16 decode step's layers in one call: every layer of the KV-cached forward for a few rows of
one new position each, without a Python call per kernel.

What it is: train_gpt2.c's layer loop (gpt2_forward) for B rows at cache positions pos[b], on the
kernels the model's Python layer loop calls for such a step, borrowed from their modules (capi.pxd:
layers.pyx's layernorm, GELU and residual, matmul.pyx's bf16 GEMV, kvcache.pyx's append and
attention), in the same order on the same buffers' values: the same bits as GPT2.block_forward
layer by layer. A decode step of d12 makes ~120 kernel calls; from Python each cost a few
microseconds of argument handling, a tenth of a step that reads 250 MB of weights.
What it is not: the prompt's forward (more rows than the GEMV takes), fp32 decoding (its one-row
products run on the BLAS, not on OpenMP), or a model: the weights come as offsets into the
buffers the model holds (GPT2._decode_plan).

Layouts (flat, C order; legend in kernels.pxd):
  x       (B, C) float32        the residual stream, read and overwritten layer by layer
  wbuf    bf16 (uint16)         holds the layers' matmul weights, woff (L, 4) their offsets:
                                qkvw (3C,C), attprojw (C,C), fcw (4C,C), fcprojw (C,4C)
  params  float32               holds the rest, poff (L, 8) their offsets: ln1w, ln1b (C),
                                qkvb (3C), attprojb (C), ln2w, ln2b (C), fcb (4C), fcprojb (C)
  kcache  (L, B, NH, Tcap, hs)  the KV cache (KVCache.k, .v), position pos[b] written for row b
"""
from libc.stdint cimport uint16_t
from libc.stdlib cimport free, malloc

from bf16 cimport llmctl_cast_bf16
from capi cimport (fn_pointer, gelu_bf16_fn, gemv_bf16_fn, kv_append_fn, kv_attend_fn, layernorm_bf16_fn,
                   residual_fn)
from kernels cimport check_len, check_positive, check_threads

from llmctl._ext import kvcache as _kvcache
from llmctl._ext import layers as _layers
from llmctl._ext import matmul as _matmul

_api = {**_kvcache.c_api(), **_layers.c_api(), **_matmul.c_api()}
cdef gemv_bf16_fn _gemv = <gemv_bf16_fn>fn_pointer(_api, "gemv_bf16")
cdef layernorm_bf16_fn _layernorm = <layernorm_bf16_fn>fn_pointer(_api, "layernorm_bf16")
cdef gelu_bf16_fn _gelu = <gelu_bf16_fn>fn_pointer(_api, "gelu_bf16")
cdef residual_fn _residual = <residual_fn>fn_pointer(_api, "residual")
cdef kv_append_fn _append = <kv_append_fn>fn_pointer(_api, "append")
cdef kv_attend_fn _attend = <kv_attend_fn>fn_pointer(_api, "attend")

cdef enum:
    NW = 4   # matmul weights per layer (woff's columns)
    NP = 8   # fp32 parameters per layer (poff's columns)


cdef int _check_offsets(str what, const Py_ssize_t[::1] off, int ncol, Py_ssize_t* sizes,
                        Py_ssize_t buflen) except -1:
    cdef Py_ssize_t i
    for i in range(off.shape[0]):
        if off[i] < 0 or off[i] + sizes[i % ncol] > buflen:
            raise ValueError(f"{what} offset {off[i]} (layer {i // ncol}, tensor {i % ncol}) with "
                             f"{sizes[i % ncol]} elements does not fit a buffer of {buflen}")
    return 0


def decode_layers_bf16(float[::1] x, const uint16_t[::1] wbuf, const Py_ssize_t[::1] woff,
                       const float[::1] params, const Py_ssize_t[::1] poff, float[::1] kcache,
                       float[::1] vcache, const int[::1] pos, int B, int C, int NH, int Tcap,
                       int n_threads=1, int attn_threads=1):
    """x (B,C) = every layer (L = len(woff) // 4) of the bf16 KV-cached forward applied to x, rows
    at cache positions pos (B,) int32, their K/V written into the caches there. The bits of
    GPT2.block_forward layer by layer with one new position per row. The GEMVs run on n_threads,
    the attention on attn_threads, the row kernels (a few rows) on one. Needs matmul's bf16 GEMV
    for B rows (matmul.gemv_bf16_available(B)); ValueError otherwise or on inconsistent sizes."""
    check_positive("B", B); check_positive("C", C); check_positive("NH", NH); check_positive("Tcap", Tcap)
    check_threads(n_threads); check_threads(attn_threads)
    if C % NH:
        raise ValueError(f"C = {C} is not a multiple of NH = {NH}")
    if not _matmul.gemv_bf16_available(B):
        raise ValueError(f"decode_layers_bf16: no bf16 GEMV for {B} rows here (matmul.gemv_bf16_available)")
    if woff.shape[0] == 0 or woff.shape[0] % NW:
        raise ValueError(f"woff has {woff.shape[0]} offsets, not 4 per layer")
    cdef int L = <int>(woff.shape[0] // NW), l, b
    cdef Py_ssize_t n = <Py_ssize_t>B * C, CC = <Py_ssize_t>C * C
    check_len("poff", poff.shape[0], <Py_ssize_t>L * NP, f"8 per layer x {L}")
    check_len("x", x.shape[0], n, f"B*C = {B}*{C}")
    check_len("kcache", kcache.shape[0], <Py_ssize_t>L * n * Tcap, f"L*B*Tcap*C = {L}*{B}*{Tcap}*{C}")
    check_len("vcache", vcache.shape[0], <Py_ssize_t>L * n * Tcap, f"L*B*Tcap*C = {L}*{B}*{Tcap}*{C}")
    check_len("pos", pos.shape[0], B)
    for b in range(B):
        if pos[b] < 0 or pos[b] >= Tcap:
            raise ValueError(f"pos[{b}] = {pos[b]} is outside a cache of Tcap = {Tcap}")
    cdef Py_ssize_t wsz[NW]
    cdef Py_ssize_t psz[NP]
    wsz[:] = [3 * CC, CC, 4 * CC, 4 * CC]
    psz[:] = [C, C, 3 * C, C, C, C, 4 * C, C]
    _check_offsets("woff", woff, NW, wsz, wbuf.shape[0])
    _check_offsets("poff", poff, NP, psz, params.shape[0])

    # the step's intermediates, each a layer's: fp32 qkv, atty, x2, out, fc (before its rounding),
    # mean and rstd twice; bf16 ln1, atty, ln2, fch, gelu
    cdef Py_ssize_t nf = 11 * n + 4 * B, nh = 11 * n
    cdef float* f32 = <float*>malloc(<size_t>(nf * 4 + nh * 2))
    if f32 == NULL:
        raise MemoryError("decode_layers_bf16: no memory for a step's intermediates")
    cdef float* qkv = f32
    cdef float* atty = qkv + 3 * n
    cdef float* x2 = atty + n
    cdef float* out = x2 + n
    cdef float* fc = out + n
    cdef float* stats = fc + 4 * n        # ln1 mean, rstd, ln2 mean, rstd
    cdef uint16_t* ln1 = <uint16_t*>(stats + 4 * B)
    cdef uint16_t* atty16 = ln1 + n
    cdef uint16_t* ln2 = atty16 + n
    cdef uint16_t* fch = ln2 + n
    cdef uint16_t* gelu = fch + 4 * n
    cdef float* xp = &x[0]
    cdef const uint16_t* W = &wbuf[0]
    cdef const float* P = &params[0]
    cdef Py_ssize_t lc = n * Tcap      # one layer's cache
    cdef const Py_ssize_t* wo
    cdef const Py_ssize_t* po
    cdef int rc = 0
    try:
        with nogil:
            for l in range(L):
                wo = &woff[l * NW]
                po = &poff[l * NP]
                _layernorm(ln1, stats, stats + B, xp, P + po[0], P + po[1], B, C, NULL, 1)
                _gemv(qkv, ln1, W + wo[0], P + po[2], B, C, 3 * C, n_threads)
                _append(&kcache[l * lc], &vcache[l * lc], qkv, &pos[0], B, 1, C, NH, Tcap, 1)
                rc = _attend(atty, qkv, &kcache[l * lc], &vcache[l * lc], &pos[0], B, 1, C, NH, Tcap,
                             NULL, NULL, NULL, NULL, 0, attn_threads)
                if rc != 0:
                    break
                llmctl_cast_bf16(atty16, atty, n)
                _gemv(x2, atty16, W + wo[1], P + po[3], B, C, C, n_threads)
                _layernorm(ln2, stats + 2 * B, stats + 3 * B, x2, P + po[4], P + po[5], B, C, xp, 1)
                _gemv(fc, ln2, W + wo[2], P + po[6], B, C, 4 * C, n_threads)
                llmctl_cast_bf16(fch, fc, 4 * n)
                _gelu(gelu, fch, 4 * n, 1)
                _gemv(out, gelu, W + wo[3], P + po[7], B, 4 * C, C, n_threads)
                _residual(xp, out, x2, n, 1)
    finally:
        free(f32)
    if rc != 0:
        raise MemoryError("decode_layers_bf16: no memory for the attention's scratch")
