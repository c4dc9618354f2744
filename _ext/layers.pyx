"""GPT-2's non-matmul, non-attention layers: encoder, layernorm, GELU, residual, softmax + CE.

Mirrors llm.c train_gpt2.c (`encoder_*`, `layernorm_*`, `gelu_*`, `residual_*`, `softmax_forward`
+ `crossentropy_forward`, `crossentropy_softmax_backward`): same math, same argument order
(outputs, then inputs/weights, then sizes), backward kernels ACCUMULATE into gradients unless
stated. Differences from llm.c, all deliberate:

- Every kernel is parallel (prange, static schedule, explicit n_threads) and gives the same
  bits at ANY thread count: row kernels compute each row alone, and reductions across rows
  (dwte/dwpe, LN dweight/dbias) are parallel over channel chunks and sum rows in order. That
  is what lets small calls use fewer threads than asked (set_parallel_grain) for free.
- Row reductions (LN mean/var, softmax sum) accumulate in double with a fixed lane order.
- exp/tanh use mathf.h's vectorisable helpers instead of libm; sech^2 is 4t/(1+t)^2 with
  t = exp(-2|u|), which is exactly 1/cosh^2(u) without overflow. The loops of GELU (gelu.h),
  layernorm and softmax + cross-entropy (rows.h) are C, each with AVX2 and AVX-512 copies
  chosen at run time (the same bits as the baseline loop; set_simd).
- softmax + cross-entropy is one fused kernel; the loss is log(sum) - (x_target - max), i.e.
  -log p[target] without the underflow to -log(0). Padded logits V..Vp never enter the softmax.

What it is not: attention (attention.pyx) or matmul (matmul.pyx).
"""
from cython.parallel cimport parallel, prange
from libc.math cimport sqrt
from libc.stdlib cimport free, malloc
from libc.stdint cimport uint16_t
from libc.string cimport memset

from bf16 cimport out_t
from capi cimport fn_capsule, gelu_bf16_fn, layernorm_bf16_fn, residual_fn
from kernels cimport check_threads, check_len, check_positive, check_disjoint, col_chunk, eff_threads, imin

cdef enum:
    CCHUNK = 64         # channels per task in the column-parallel reductions (stack accumulators)
    LN_CHUNK_MAX = 1024 # layernorm's parameter gradients: channels per task at most (see there)
    LN_FUSED_ROWS = 64  # bf16's fused layernorm backward: rows per task (see there)
    ECHUNK = 16384      # elements per task in elementwise kernels

cdef float GELU_SCALE = <float>sqrt(2.0 / 3.14159265358979323846)  # llm.c: sqrtf(2.0f / M_PI)

cdef extern from "gelu.h" nogil:
    void llmctl_gelu_fwd_f32(float* out, const float* x, Py_ssize_t n, float k)
    void llmctl_gelu_fwd_bf16(uint16_t* out, const float* x, Py_ssize_t n, float k)
    void llmctl_gelu_bwd(float* dx, const float* x, const float* dy, Py_ssize_t n, float k)
    void llmctl_gelu_fwd_bwd(float* y, float* d, const float* x, Py_ssize_t n, float k)
    void llmctl_gelu_bwd_bf16_cols(uint16_t* out, double* acc, const float* x, const float* dy,
                                   Py_ssize_t BT, Py_ssize_t OC, Py_ssize_t n, float k)
    void llmctl_gelu_tables(float k)
    void llmctl_gelu_fwd_tab(uint16_t* out, const uint16_t* x, Py_ssize_t n)
    void llmctl_gelu_bwd_tab_cols(uint16_t* out, uint16_t* y, double* acc, const uint16_t* x, const float* dy,
                                  Py_ssize_t BT, Py_ssize_t OC, Py_ssize_t n)
    void llmctl_gelu_bwd_tab_cols16(uint16_t* out, uint16_t* y, double* acc, const uint16_t* x,
                                    const uint16_t* dy, Py_ssize_t BT, Py_ssize_t OC, Py_ssize_t n)
    enum: LLMCTL_GELU_COLS

cdef extern from "rows.h" nogil:
    void llmctl_ln_fwd_f32(float* out, float* mean, float* rstd, const float* x, const float* w,
                           const float* b, int C)
    void llmctl_ln_fwd_bf16(uint16_t* out, float* mean, float* rstd, const float* x, const float* w,
                            const float* b, int C)
    void llmctl_ln_dinp(float* dx, const float* dy, const float* x, const float* w, float m, float r, int C)
    void llmctl_ln_bwd_fused(float* dx, uint16_t* o16, double* aw, double* ab, double* an, const float* dy,
                             const float* x, const float* w, float m, float r, int C)
    void llmctl_xent_fwd(float* loss, float* probs, const float* logits, int target, int V, int Vp)
    void llmctl_xent_fwd_bwd_f32(float* loss, float* dlogits, const float* logits, int target, float dloss,
                                 int V, int Vp)
    void llmctl_xent_bwd_f32(float* dlogits, const float* probs, int target, float dloss, int V, int Vp)
    void llmctl_xent_bwd_bf16(uint16_t* dlogits, const float* probs, int target, float dloss, int V, int Vp)
    void llmctl_xent_fwd_bwd_bf16(float* loss, uint16_t* dlogits, float* probs, const float* logits, int target,
                                  float dloss, int V, int Vp)
    void llmctl_xent16_fwd_bwd(float* loss, uint16_t* dlogits, float* probs, const uint16_t* logits, int target,
                               float dloss, int V, int Vp)
    void llmctl_ln_dparams(float* dw, float* db, double* aw, double* ab, const float* dy, const float* x,
                           const float* mean, const float* rstd, Py_ssize_t N, Py_ssize_t C, int n)
    int llmctl_rows_set_isa(int level)
    int llmctl_rows_isa()

ISAS = ("baseline", "avx2", "avx512")
llmctl_rows_set_isa(-1)   # the widest copy of the loops this CPU runs, decided once at import
llmctl_gelu_tables(GELU_SCALE)   # GELU of every bf16 input, for the bf16-input loops

# Elements of work per thread below which a kernel uses fewer threads than asked (see
# kernels.pxd eff_threads). Every kernel here gives the same bits at any thread count.
cdef Py_ssize_t _grain = 131072


def simd():
    """Which copy of the GELU, layernorm and softmax loops runs: "avx512", "avx2" or "baseline"
    (x86-64's SSE2, or plain C elsewhere); all give the same bits."""
    return ISAS[llmctl_rows_isa()]


def set_simd(enabled):
    """enabled True: the widest copy this CPU runs (the default); False: the baseline loops; or
    one of ISAS: at most that one (tests compare the copies bit for bit). -> simd()."""
    if enabled is True or enabled is False:
        llmctl_rows_set_isa(-1 if enabled else 0)
    elif enabled in ISAS:
        llmctl_rows_set_isa(ISAS.index(enabled))
    else:
        raise ValueError(f"set_simd takes True, False or one of {ISAS}, not {enabled!r}")
    return simd()


def set_parallel_grain(Py_ssize_t grain):
    """Set the minimum elements per thread (0 or 1: always use n_threads; tests do). Returns the old value."""
    global _grain
    old = _grain
    _grain = grain
    return old


cdef inline Py_ssize_t _nchunks(Py_ssize_t n, Py_ssize_t chunk) noexcept nogil:
    return (n + chunk - 1) // chunk


# ---------------------------------------------------------------------------------------------
# encoder

cdef void _encoder_forward(float* out, const int* inp, const float* wte, const float* wpe,
                           int B, int T, int C, int n_threads) noexcept nogil:
    # out (B,T,C) = wte[inp[b,t]] (Vp,C) + wpe[t] (maxT,C)
    cdef Py_ssize_t bt
    cdef int c, t
    cdef float* o
    cdef const float* we
    cdef const float* pe
    for bt in prange(<Py_ssize_t>B * T, schedule='static', num_threads=n_threads):
        t = bt % T
        o = out + bt * C
        we = wte + <Py_ssize_t>inp[bt] * C
        pe = wpe + <Py_ssize_t>t * C
        for c in range(C):
            o[c] = we[c] + pe[c]


cdef void _encoder_backward(float* dwte, float* dwpe, const float* dout, const int* inp,
                            int B, int T, int C, int n_threads) noexcept nogil:
    # dwte[inp[b,t]] += dout[b,t]; dwpe[t] += dout[b,t]. Parallel over channel chunks: each task
    # owns channels [c0,c1) of every row, so repeated tokens never race; rows added in order.
    cdef Py_ssize_t nch = _nchunks(C, CCHUNK)
    cdef Py_ssize_t ch, bt
    cdef int c, c0, c1, t
    cdef const float* d
    cdef float* w
    cdef float* p
    for ch in prange(nch, schedule='static', num_threads=n_threads):
        c0 = ch * CCHUNK
        c1 = c0 + CCHUNK
        if c1 > C:
            c1 = C
        for bt in range(<Py_ssize_t>B * T):
            t = bt % T
            d = dout + bt * C
            w = dwte + <Py_ssize_t>inp[bt] * C
            p = dwpe + <Py_ssize_t>t * C
            for c in range(c0, c1):
                w[c] += d[c]
                p[c] += d[c]


# ---------------------------------------------------------------------------------------------
# layernorm

cdef void _layernorm_row(out_t* out, float* mean, float* rstd, const float* x, const float* w,
                         const float* b, int C) noexcept nogil:
    # rows.h: the row loop, in the copy for this CPU
    if out_t is float:
        llmctl_ln_fwd_f32(out, mean, rstd, x, w, b, C)
    else:
        llmctl_ln_fwd_bf16(out, mean, rstd, x, w, b, C)


cdef void _layernorm_forward(out_t* out, float* mean, float* rstd, float* inp,
                             const float* weight, const float* bias, int N, int C,
                             const float* residual, int n_threads) noexcept nogil:
    # out (N,C) = (inp - mean) * rstd * weight (C) + bias (C); mean, rstd (N) cached; eps 1e-5.
    # residual not NULL: first inp += residual, row by row (residual_forward's adds: the same
    # bits), the layernorm then reading the row from L1 instead of memory
    cdef Py_ssize_t n
    for n in prange(N, schedule='static', num_threads=n_threads):
        if residual != NULL:
            _residual_fwd_chunk(inp + n * C, inp + n * C, residual + n * C, C)
        _layernorm_row(out + n * C, mean + n, rstd + n, inp + n * C, weight, bias, C)


cdef void _layernorm_dparams_chunk(float* dw, float* db, const float* dout, const float* inp,
                                   const float* mean, const float* rstd, int N, int C,
                                   int c0, int c1) noexcept nogil:
    # dw[c0:c1] += sum_n dout*norm ; db[c0:c1] += sum_n dout  (rows in order, double accumulators)
    cdef double aw[LN_CHUNK_MAX]
    cdef double ab[LN_CHUNK_MAX]
    llmctl_ln_dparams(dw + c0, db + c0, aw, ab, dout + c0, inp + c0, mean, rstd, N, C, c1 - c0)


cdef void _layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                              const float* inp, const float* weight, const float* mean,
                              const float* rstd, int N, int C, int n_threads) noexcept nogil:
    # the parameter gradients over wide chunks of channels (col_chunk): the same bits
    cdef Py_ssize_t n, ch
    cdef int w = col_chunk(C, n_threads, LN_CHUNK_MAX)
    cdef Py_ssize_t nch = _nchunks(C, w)
    cdef int c0, c1
    for n in prange(N, schedule='static', num_threads=n_threads):
        llmctl_ln_dinp(dinp + n * C, dout + n * C, inp + n * C, weight, mean[n], rstd[n], C)
    for ch in prange(nch, schedule='static', num_threads=n_threads):
        c0 = ch * w
        c1 = c0 + w
        if c1 > C:
            c1 = C
        _layernorm_dparams_chunk(dweight, dbias, dout, inp, mean, rstd, N, C, c0, c1)


cdef int _check_layernorm_backward(float[::1] dinp, float[::1] dweight, float[::1] dbias, const float[::1] dout,
                                   const float[::1] inp, const float[::1] weight, const float[::1] mean,
                                   const float[::1] rstd, int N, int C, int n_threads) except -1:
    check_threads(n_threads)
    check_positive("N", N); check_positive("C", C)
    check_len("dinp", dinp.shape[0], <Py_ssize_t>N * C)
    check_len("dweight", dweight.shape[0], C)
    check_len("dbias", dbias.shape[0], C)
    check_len("dout", dout.shape[0], <Py_ssize_t>N * C)
    check_len("inp", inp.shape[0], <Py_ssize_t>N * C)
    check_len("weight", weight.shape[0], C)
    check_len("mean", mean.shape[0], N)
    check_len("rstd", rstd.shape[0], N)
    check_disjoint("dinp", &dinp[0], <Py_ssize_t>N * C, "dout", &dout[0], <Py_ssize_t>N * C)
    return 0


# bf16's fused layernorm backward: each task of LN_FUSED_ROWS rows sums its rows' terms of the
# parameter gradients (and of the next GEMM's bias gradient) in row order into its own partials,
# which are then added task by task in order: the same bits at any thread count. The partials
# (a few MB at most) are kept between calls: a fresh block that size is a fresh mmap, faulted in
# on every call. A call made while another holds it (two Python threads) allocates its own.
cdef double* _lnparts = NULL
cdef Py_ssize_t _lnparts_size = 0
cdef bint _lnparts_busy = False


cdef void _layernorm_backward_fused(float* dinp, float* dweight, float* dbias, const float* dout,
                                    const float* inp, const float* weight, const float* mean, const float* rstd,
                                    int N, int C, uint16_t* d16, float* dnext, double* part,
                                    int n_threads) noexcept nogil:
    cdef Py_ssize_t nt = (N + LN_FUSED_ROWS - 1) // LN_FUSED_ROWS
    cdef Py_ssize_t k = 3 if d16 != NULL else 2
    cdef Py_ssize_t t, n, c
    cdef double* p
    cdef double sw, sb, sn
    memset(part, 0, <size_t>(nt * k * C) * sizeof(double))
    for t in prange(nt, schedule='static', num_threads=n_threads):
        p = part + t * k * C
        for n in range(t * LN_FUSED_ROWS, imin(N, (t + 1) * LN_FUSED_ROWS)):
            llmctl_ln_bwd_fused(dinp + n * C, d16 + n * C if d16 != NULL else NULL, p, p + C,
                                p + 2 * C if d16 != NULL else NULL, dout + n * C, inp + n * C, weight,
                                mean[n], rstd[n], C)
    for c in prange(C, schedule='static', num_threads=n_threads):
        sw = 0.0
        sb = 0.0
        sn = 0.0
        for t in range(nt):
            sw = sw + part[t * k * C + c]
            sb = sb + part[t * k * C + C + c]
            if d16 != NULL:
                sn = sn + part[t * k * C + 2 * C + c]
        dweight[c] += <float>sw
        dbias[c] += <float>sb
        if dnext != NULL:
            dnext[c] += <float>sn


cdef float* _optional_floats(buf, str name, Py_ssize_t n) except? NULL:
    """buf's first float (a float32 vector of n, checked), or NULL for None. The pointer is into
    the caller's array, which outlives the kernel call."""
    cdef float[::1] mv
    if buf is None:
        return NULL
    mv = buf
    check_len(name, mv.shape[0], n)
    return &mv[0]


def layernorm_backward_bf16(float[::1] dinp, float[::1] dweight, float[::1] dbias, const float[::1] dout,
                            const float[::1] inp, const float[::1] weight, const float[::1] mean,
                            const float[::1] rstd, int N, int C, int n_threads=1, dinp16=None, dbias_next=None):
    """layernorm_backward for the bf16 model, in one pass over the rows: dinp += its gradient (the
    bits of layernorm_backward's), and dweight, dbias += theirs, each row's terms summed in double
    in row order within blocks of 64 rows, the blocks then in order (another order than
    layernorm_backward's column sums: the bits differ in the last place, and do not depend on
    the thread count). With dinp16 (uint16, N*C): also dinp16 = bf16(dinp) of the final dinp
    (the residual stream's gradient, as the next backward GEMM reads it) and, with dbias_next (C),
    dbias_next += the column sums of dinp in the same order: the bias gradient and the cast that
    matmul_backward_bf16 would otherwise make in a pass of its own."""
    global _lnparts, _lnparts_size, _lnparts_busy
    cdef uint16_t[::1] d16
    cdef uint16_t* d16p = NULL
    cdef float* dnp = NULL
    cdef double* part
    cdef bint own = False
    _check_layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, n_threads)
    if dbias_next is not None and dinp16 is None:
        raise ValueError("dbias_next is summed in the pass that writes dinp16: pass dinp16 too")
    if dinp16 is not None:
        d16 = dinp16
        check_len("dinp16", d16.shape[0], <Py_ssize_t>N * C)
        d16p = &d16[0]
        dnp = _optional_floats(dbias_next, "dbias_next", C)
    cdef Py_ssize_t need = ((N + LN_FUSED_ROWS - 1) // LN_FUSED_ROWS) * (3 if d16p != NULL else 2) * C
    if _lnparts_busy:
        part, own = <double*>malloc(<size_t>need * sizeof(double)), True
    else:
        if _lnparts_size < need:
            free(_lnparts)
            _lnparts, _lnparts_size = <double*>malloc(<size_t>need * sizeof(double)), need
            if _lnparts == NULL:
                _lnparts_size = 0
        part, _lnparts_busy = _lnparts, True
    if part == NULL:
        if not own:
            _lnparts_busy = False
        raise MemoryError(f"layernorm_backward_bf16: cannot allocate {need * 8} bytes of partial sums")
    n_threads = eff_threads(n_threads, <Py_ssize_t>N * C, _grain)
    try:
        with nogil:
            _layernorm_backward_fused(&dinp[0], &dweight[0], &dbias[0], &dout[0], &inp[0], &weight[0],
                                      &mean[0], &rstd[0], N, C, d16p, dnp, part, n_threads)
    finally:
        if own:
            free(part)
        else:
            _lnparts_busy = False


# ---------------------------------------------------------------------------------------------
# GELU (tanh form) and residual: elementwise, chunked so the inner loops vectorise

cdef void _gelu_fwd_chunk(out_t* out, const float* x, Py_ssize_t n) noexcept nogil:
    # gelu.h: the AVX2 copy of the loop where the CPU has it (same bits as the baseline copy)
    if out_t is float:
        llmctl_gelu_fwd_f32(out, x, n, GELU_SCALE)
    else:
        llmctl_gelu_fwd_bf16(out, x, n, GELU_SCALE)


cdef void _gelu_bwd_chunk(float* dx, const float* x, const float* dy, Py_ssize_t n) noexcept nogil:
    llmctl_gelu_bwd(dx, x, dy, n, GELU_SCALE)


cdef void _residual_fwd_chunk(float* out, const float* a, const float* b, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        out[i] = a[i] + b[i]


cdef void _residual_bwd_chunk(float* da, float* db, const float* dy, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        da[i] += dy[i]
        db[i] += dy[i]


# each task: elements [s, s + ECHUNK) clipped to N
cdef void _gelu_forward(out_t* out, const float* inp, Py_ssize_t N, int n_threads) noexcept nogil:
    cdef Py_ssize_t ch, s
    for ch in prange(_nchunks(N, ECHUNK), schedule='static', num_threads=n_threads):
        s = ch * ECHUNK
        _gelu_fwd_chunk(out + s, inp + s, imin(ECHUNK, N - s))


cdef void _gelu_backward(float* dinp, const float* inp, const float* dout, Py_ssize_t N,
                         int n_threads) noexcept nogil:
    cdef Py_ssize_t ch, s
    for ch in prange(_nchunks(N, ECHUNK), schedule='static', num_threads=n_threads):
        s = ch * ECHUNK
        _gelu_bwd_chunk(dinp + s, inp + s, dout + s, imin(ECHUNK, N - s))


cdef void _gelu_forward_backward(float* out, float* d, const float* inp, Py_ssize_t N,
                                 int n_threads) noexcept nogil:
    cdef Py_ssize_t ch, s
    for ch in prange(_nchunks(N, ECHUNK), schedule='static', num_threads=n_threads):
        s = ch * ECHUNK
        llmctl_gelu_fwd_bwd(out + s, d + s, inp + s, imin(ECHUNK, N - s), GELU_SCALE)


cdef void _residual_forward(float* out, const float* inp1, const float* inp2, Py_ssize_t N,
                            int n_threads) noexcept nogil:
    cdef Py_ssize_t ch, s
    for ch in prange(_nchunks(N, ECHUNK), schedule='static', num_threads=n_threads):
        s = ch * ECHUNK
        _residual_fwd_chunk(out + s, inp1 + s, inp2 + s, imin(ECHUNK, N - s))


cdef void _residual_backward(float* dinp1, float* dinp2, const float* dout, Py_ssize_t N,
                             int n_threads) noexcept nogil:
    cdef Py_ssize_t ch, s
    for ch in prange(_nchunks(N, ECHUNK), schedule='static', num_threads=n_threads):
        s = ch * ECHUNK
        _residual_bwd_chunk(dinp1 + s, dinp2 + s, dout + s, imin(ECHUNK, N - s))


# ---------------------------------------------------------------------------------------------
# fused softmax + cross-entropy over the real V of each padded Vp row

cdef void _softmax_crossentropy_forward(float* losses, float* probs, const float* logits,
                                        const int* targets, int BT, int V, int Vp,
                                        int n_threads) noexcept nogil:
    cdef Py_ssize_t bt
    for bt in prange(BT, schedule='static', num_threads=n_threads):
        llmctl_xent_fwd(losses + bt, probs + bt * Vp, logits + bt * Vp, targets[bt], V, Vp)


cdef void _xent_bwd_row(out_t* dlogits, const float* probs, int target, float dloss,
                        int V, int Vp) noexcept nogil:
    if out_t is float:
        llmctl_xent_bwd_f32(dlogits, probs, target, dloss, V, Vp)
    else:
        llmctl_xent_bwd_bf16(dlogits, probs, target, dloss, V, Vp)


cdef void _softmax_crossentropy_backward(out_t* dlogits, const float* probs, const int* targets,
                                         const float* dlosses, int BT, int V, int Vp,
                                         int n_threads) noexcept nogil:
    cdef Py_ssize_t bt
    for bt in prange(BT, schedule='static', num_threads=n_threads):
        _xent_bwd_row(dlogits + bt * Vp, probs + bt * Vp, targets[bt], dlosses[bt], V, Vp)


cdef void _softmax_crossentropy_forward_backward(float* losses, float* dlogits, const float* logits,
                                                 const int* targets, const float* dlosses, int BT, int V,
                                                 int Vp, int n_threads) noexcept nogil:
    cdef Py_ssize_t bt
    for bt in prange(BT, schedule='static', num_threads=n_threads):
        llmctl_xent_fwd_bwd_f32(losses + bt, dlogits + bt * Vp, logits + bt * Vp, targets[bt], dlosses[bt],
                                V, Vp)


ctypedef fused lg_t:     # logits: fp32, or the bf16 lm head's bf16
    float
    uint16_t


cdef int _xent_forward_backward_bf16(float* losses, uint16_t* dlogits, const lg_t* logits, const int* targets,
                                     const float* dlosses, int BT, int V, int Vp, int n_threads) noexcept nogil:
    # row by row, each row's probs in a row of the thread's own (201 KB at GPT-2's Vp: it stays in
    # L2 for the backward); the logits are only read, so the block is never written back to memory.
    # dlogits NULL: the losses only (dlosses unread)
    cdef Py_ssize_t bt
    cdef float* probs = NULL
    cdef int failed = 0
    cdef int* failed_p = &failed   # (a plain assignment in the parallel block would make it thread-private)
    with parallel(num_threads=n_threads):
        probs = <float*>malloc(<size_t>Vp * sizeof(float))
        if probs == NULL:
            failed_p[0] = 1
        else:
            for bt in prange(BT, schedule='static'):
                if lg_t is float:
                    llmctl_xent_fwd_bwd_bf16(losses + bt, NULL if dlogits == NULL else dlogits + bt * Vp, probs,
                                             logits + bt * Vp, targets[bt], 0.0 if dlosses == NULL else dlosses[bt],
                                             V, Vp)
                else:
                    llmctl_xent16_fwd_bwd(losses + bt, NULL if dlogits == NULL else dlogits + bt * Vp, probs,
                                          logits + bt * Vp, targets[bt], 0.0 if dlosses == NULL else dlosses[bt],
                                          V, Vp)
            free(probs)
    return failed


# ---------------------------------------------------------------------------------------------
# Python wrappers: validate sizes (ValueError, never a segfault), then run without the GIL

cdef int _check_ids(str name, const int[::1] ids, long upper) except -1:
    cdef Py_ssize_t i, bad = -1
    with nogil:
        for i in range(ids.shape[0]):
            if ids[i] < 0 or ids[i] >= upper:
                bad = i
                break
    if bad >= 0:
        raise ValueError(f"{name}[{bad}] = {ids[bad]} is outside [0, {upper})")
    return 0


def _check_encoder(str act, Py_ssize_t act_len, str te, Py_ssize_t te_len, str pe, Py_ssize_t pe_len,
                   const int[::1] inp, int B, int T, int C, int n_threads):
    """Shared argument checks of encoder_forward/backward (names as the caller calls them)."""
    check_threads(n_threads)
    check_positive("B", B); check_positive("T", T); check_positive("C", C)
    check_len(act, act_len, <Py_ssize_t>B * T * C)
    check_len("inp", inp.shape[0], <Py_ssize_t>B * T)
    if te_len == 0 or te_len % C:
        raise ValueError(f"{te} has {te_len} elements, not a positive multiple of C={C}")
    if pe_len < <Py_ssize_t>T * C or pe_len % C:
        raise ValueError(f"{pe} has {pe_len} elements, need a multiple of C={C} and >= T*C={T * C}")
    _check_ids("inp", inp, te_len // C)


def encoder_forward(float[::1] out, const int[::1] inp, const float[::1] wte, const float[::1] wpe,
                    int B, int T, int C, int n_threads=1):
    """out (B,T,C) = wte (Vp,C)[inp (B,T)] + wpe (>=T,C)[t]. Overwrites out."""
    _check_encoder("out", out.shape[0], "wte", wte.shape[0], "wpe", wpe.shape[0], inp, B, T, C, n_threads)
    n_threads = eff_threads(n_threads, <Py_ssize_t>B * T * C, _grain)
    with nogil:
        _encoder_forward(&out[0], &inp[0], &wte[0], &wpe[0], B, T, C, n_threads)


def encoder_backward(float[::1] dwte, float[::1] dwpe, const float[::1] dout, const int[::1] inp,
                     int B, int T, int C, int n_threads=1):
    """Accumulate: dwte[inp[b,t]] += dout[b,t]; dwpe[t] += dout[b,t]. Deterministic at any n_threads."""
    _check_encoder("dout", dout.shape[0], "dwte", dwte.shape[0], "dwpe", dwpe.shape[0], inp, B, T, C, n_threads)
    n_threads = eff_threads(n_threads, <Py_ssize_t>B * T * C, _grain)
    with nogil:
        _encoder_backward(&dwte[0], &dwpe[0], &dout[0], &inp[0], B, T, C, n_threads)


# The fp32 and bf16 forms of a kernel share one checked body (`_checked_*`, over out_t).

cdef int _checked_layernorm_forward(out_t[::1] out, float[::1] mean, float[::1] rstd, inp,
                                    const float[::1] weight, const float[::1] bias, int N, int C,
                                    int n_threads, residual) except -1:
    # inp: read-only float32 (N,C), or with residual (N,C) written first: inp += residual
    cdef const float[::1] x
    cdef float[::1] xw
    cdef const float[::1] res
    cdef const float* res_ptr = NULL
    cdef float* x_ptr
    check_threads(n_threads)
    check_positive("N", N); check_positive("C", C)
    check_len("out", out.shape[0], <Py_ssize_t>N * C)
    check_len("mean", mean.shape[0], N)
    check_len("rstd", rstd.shape[0], N)
    if residual is None:
        x = inp
        check_len("inp", x.shape[0], <Py_ssize_t>N * C)
        x_ptr = <float*>&x[0]     # only read
    else:
        xw = inp
        res = residual
        check_len("inp", xw.shape[0], <Py_ssize_t>N * C)
        check_len("residual", res.shape[0], <Py_ssize_t>N * C)
        x_ptr, res_ptr = &xw[0], &res[0]
        check_disjoint("inp", x_ptr, <Py_ssize_t>N * C, "residual", res_ptr, <Py_ssize_t>N * C)
        if out_t is float:
            check_disjoint("out", &out[0], <Py_ssize_t>N * C, "inp", x_ptr, <Py_ssize_t>N * C)
    check_len("weight", weight.shape[0], C)
    check_len("bias", bias.shape[0], C)
    n_threads = eff_threads(n_threads, <Py_ssize_t>N * C, _grain)
    with nogil:
        _layernorm_forward(&out[0], &mean[0], &rstd[0], x_ptr, &weight[0], &bias[0], N, C, res_ptr, n_threads)
    return 0


def layernorm_forward(float[::1] out, float[::1] mean, float[::1] rstd, inp,
                      const float[::1] weight, const float[::1] bias, int N, int C, int n_threads=1,
                      residual=None):
    """out (N,C) = layernorm(inp (N,C)) * weight (C) + bias (C); caches mean, rstd (N). eps 1e-5.
    residual (N,C) given: first inp += residual (written: residual_forward's sum, the same bits),
    row by row in the same pass, so the layernorm reads each row from cache."""
    _checked_layernorm_forward(out, mean, rstd, inp, weight, bias, N, C, n_threads, residual)


def layernorm_forward_bf16(uint16_t[::1] out, float[::1] mean, float[::1] rstd, inp,
                           const float[::1] weight, const float[::1] bias, int N, int C, int n_threads=1,
                           residual=None):
    """layernorm_forward with out (N,C) written as bf16 (round to nearest even) instead of fp32:
    the matmul that follows reads bf16, and layernorm_backward needs only inp, mean and rstd.
    residual as layernorm_forward's."""
    _checked_layernorm_forward(out, mean, rstd, inp, weight, bias, N, C, n_threads, residual)


def layernorm_backward(float[::1] dinp, float[::1] dweight, float[::1] dbias, const float[::1] dout,
                       const float[::1] inp, const float[::1] weight, const float[::1] mean,
                       const float[::1] rstd, int N, int C, int n_threads=1):
    """Accumulate: dinp (N,C), dweight (C), dbias (C) += gradients. dinp must not alias dout."""
    _check_layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, n_threads)
    n_threads = eff_threads(n_threads, <Py_ssize_t>N * C, _grain)
    with nogil:
        _layernorm_backward(&dinp[0], &dweight[0], &dbias[0], &dout[0], &inp[0], &weight[0],
                            &mean[0], &rstd[0], N, C, n_threads)


cdef int _gelu_threads(Py_ssize_t out_len, Py_ssize_t inp_len, long N, int n_threads) except -1:
    # the checks of GELU's forward kernels -> the threads to run on
    check_threads(n_threads)
    check_positive("N", N)
    check_len("out", out_len, N)
    check_len("inp", inp_len, N)
    return eff_threads(n_threads, N, _grain)


cdef int _checked_gelu_forward(out_t[::1] out, const float[::1] inp, long N, int n_threads) except -1:
    n_threads = _gelu_threads(out.shape[0], inp.shape[0], N, n_threads)
    with nogil:
        _gelu_forward(&out[0], &inp[0], N, n_threads)
    return 0


def gelu_forward(float[::1] out, const float[::1] inp, long N, int n_threads=1):
    """out (N) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). out may alias inp."""
    _checked_gelu_forward(out, inp, N, n_threads)


cdef void _gelu_forward_b16(uint16_t* out, const uint16_t* inp, Py_ssize_t N, int n_threads) noexcept nogil:
    cdef Py_ssize_t ch, s
    for ch in prange(_nchunks(N, ECHUNK), schedule='static', num_threads=n_threads):
        s = ch * ECHUNK
        llmctl_gelu_fwd_tab(out + s, inp + s, imin(ECHUNK, N - s))


def gelu_forward_bf16(uint16_t[::1] out, inp, long N, int n_threads=1):
    """gelu_forward with out (N) written as bf16 (the fcproj matmul reads it; gelu_backward uses
    inp). inp float32, or uint16: bf16 (the fc matmul's bf16 output), widened exactly first."""
    cdef const uint16_t[::1] in16
    cdef const float[::1] in32
    if getattr(inp, "dtype", None) != "uint16":
        in32 = inp
        _checked_gelu_forward(out, in32, N, n_threads)
        return
    in16 = inp
    n_threads = _gelu_threads(out.shape[0], in16.shape[0], N, n_threads)
    with nogil:
        _gelu_forward_b16(&out[0], &in16[0], N, n_threads)


cdef _check_three_of_n(long N, int n_threads, str a, Py_ssize_t na, str b, Py_ssize_t nb, str c, Py_ssize_t nc):
    """The checks of an elementwise kernel over three buffers of N elements each."""
    check_threads(n_threads)
    check_positive("N", N)
    check_len(a, na, N)
    check_len(b, nb, N)
    check_len(c, nc, N)


def gelu_backward(float[::1] dinp, const float[::1] inp, const float[::1] dout, long N, int n_threads=1):
    """Accumulate: dinp (N) += gelu'(inp) * dout. dinp must not alias dout."""
    _check_three_of_n(N, n_threads, "dinp", dinp.shape[0], "inp", inp.shape[0], "dout", dout.shape[0])
    check_disjoint("dinp", &dinp[0], N, "dout", &dout[0], N)
    n_threads = eff_threads(n_threads, N, _grain)
    with nogil:
        _gelu_backward(&dinp[0], &inp[0], &dout[0], N, n_threads)


def gelu_forward_backward(float[::1] out, float[::1] dinout, const float[::1] inp, long N, int n_threads=1):
    """A backward that recomputes the GELU, in one pass over inp: out (N) = gelu_forward's
    GELU(inp) (the fcproj weight gradient's input), and dinout (N), d(out) on entry, =
    gelu'(inp) * d(out) on return (the bits of a zero fill and gelu_backward). out, dinout and
    inp must not overlap."""
    _check_three_of_n(N, n_threads, "out", out.shape[0], "dinout", dinout.shape[0], "inp", inp.shape[0])
    check_disjoint("out", &out[0], N, "dinout", &dinout[0], N)
    check_disjoint("out", &out[0], N, "inp", &inp[0], N)
    check_disjoint("dinout", &dinout[0], N, "inp", &inp[0], N)
    n_threads = eff_threads(n_threads, N, _grain)
    with nogil:
        _gelu_forward_backward(&out[0], &dinout[0], &inp[0], N, n_threads)


ctypedef fused gin_t:
    float
    uint16_t

ctypedef fused gdy_t:
    float
    uint16_t


cdef void _gelu_bwd_bf16_cols(uint16_t* dinp, uint16_t* gelu, float* dbias, const gin_t* inp,
                              const gdy_t* dout, Py_ssize_t BT, int OC, int o0, int w) noexcept nogil:
    # columns o0..o0+w (w <= LLMCTL_GELU_COLS) of every row; acc on this task's own stack;
    # gelu not NULL (bf16 inp only): GELU(inp) written too
    cdef double acc[LLMCTL_GELU_COLS]
    cdef int o, n = imin(w, OC - o0)
    memset(acc, 0, sizeof(acc))
    if gin_t is float and gdy_t is float:
        llmctl_gelu_bwd_bf16_cols(dinp + o0, acc, inp + o0, dout + o0, BT, OC, n, GELU_SCALE)
    elif gin_t is uint16_t and gdy_t is float:
        llmctl_gelu_bwd_tab_cols(dinp + o0, NULL if gelu == NULL else gelu + o0, acc, inp + o0, dout + o0,
                                 BT, OC, n)
    elif gin_t is uint16_t and gdy_t is uint16_t:
        llmctl_gelu_bwd_tab_cols16(dinp + o0, NULL if gelu == NULL else gelu + o0, acc, inp + o0, dout + o0,
                                   BT, OC, n)
    if dbias != NULL:
        for o in range(n):
            dbias[o0 + o] += <float>acc[o]


cdef void _gelu_backward_bf16(uint16_t* dinp, uint16_t* gelu, float* dbias, const gin_t* inp,
                              const gdy_t* dout, Py_ssize_t BT, int OC, int n_threads) noexcept nogil:
    # wide chunks of columns (col_chunk): the bits do not depend on the thread count
    cdef int w = col_chunk(OC, n_threads, LLMCTL_GELU_COLS)
    cdef int ch
    for ch in prange((OC + w - 1) // w, schedule='static', num_threads=n_threads):
        _gelu_bwd_bf16_cols(dinp, gelu, dbias, inp, dout, BT, OC, ch * w, w)


cdef Py_ssize_t _gelu_bf16_size(long BT, int OC, int n_threads) except -1:
    """BT * OC, once the bf16 GELU kernels' shape and thread count are checked."""
    check_threads(n_threads)
    check_positive("BT", BT)
    check_positive("OC", OC)
    return BT * OC


def gelu_backward_bf16(uint16_t[::1] dinp, dbias, const gin_t[::1] inp, const gdy_t[::1] dout,
                       long BT, int OC, int n_threads=1):
    """The fc layer's gradient for its bf16 backward GEMMs in one pass: dinp (BT,OC) =
    bf16(gelu'(inp) * dout), written, not accumulated (the same bits as a zero fill, gelu_backward's
    += and a cast); dbias (OC) += the column sums of that fp32 gradient (double accumulators, rows
    in order: the sum matmul_backward_bf16 makes from an fp32 dout), unless dbias is None. inp:
    float32, or uint16 (bf16, widened exactly). dout: float32, or with a bf16 inp also uint16 (the
    bf16 gradient matmul_backward_bf16 writes into a uint16 dinp, widened exactly). Feed dinp to
    matmul_backward_bf16 as dout_bf16 with dout=None, dbias=None."""
    cdef Py_ssize_t N = _gelu_bf16_size(BT, OC, n_threads)
    check_len("dinp", dinp.shape[0], N)
    check_len("inp", inp.shape[0], N)
    check_len("dout", dout.shape[0], N)
    cdef float* db_ptr = _optional_floats(dbias, "dbias", OC)
    if gin_t is float and gdy_t is uint16_t:
        raise TypeError("gelu_backward_bf16: a bf16 (uint16) dout needs a bf16 inp")
    n_threads = eff_threads(n_threads, N, _grain)
    with nogil:
        _gelu_backward_bf16(&dinp[0], NULL, db_ptr, &inp[0], &dout[0], BT, OC, n_threads)


def gelu_forward_backward_bf16(uint16_t[::1] out, uint16_t[::1] dinout, dbias, const uint16_t[::1] inp,
                               long BT, int OC, int n_threads=1):
    """A bf16 backward that recomputes the GELU, in one pass over inp (bf16, BT x OC): out =
    gelu_forward_bf16(inp) (the fcproj weight gradient's input), and dinout, the bf16 d(out) on
    entry, = gelu_backward_bf16's d(inp) on return, in place, with dbias (OC, or None) += its
    column sums: the bits of those two kernels. out, dinout and inp must not overlap."""
    cdef Py_ssize_t N = _gelu_bf16_size(BT, OC, n_threads)
    _check_three_of_n(N, n_threads, "out", out.shape[0], "dinout", dinout.shape[0], "inp", inp.shape[0])
    check_disjoint("out", <float*>&out[0], (N + 1) // 2, "dinout", <float*>&dinout[0], (N + 1) // 2)
    check_disjoint("out", <float*>&out[0], (N + 1) // 2, "inp", <const float*>&inp[0], (N + 1) // 2)
    check_disjoint("dinout", <float*>&dinout[0], (N + 1) // 2, "inp", <const float*>&inp[0], (N + 1) // 2)
    cdef float* db_ptr = _optional_floats(dbias, "dbias", OC)
    n_threads = eff_threads(n_threads, N, _grain)
    with nogil:
        _gelu_backward_bf16(&dinout[0], &out[0], db_ptr, &inp[0], &dinout[0], BT, OC, n_threads)


def residual_forward(float[::1] out, const float[::1] inp1, const float[::1] inp2, long N, int n_threads=1):
    """out (N) = inp1 + inp2. out may alias either input."""
    check_threads(n_threads)
    check_positive("N", N)
    check_len("out", out.shape[0], N)
    check_len("inp1", inp1.shape[0], N)
    check_len("inp2", inp2.shape[0], N)
    n_threads = eff_threads(n_threads, N, _grain)
    with nogil:
        _residual_forward(&out[0], &inp1[0], &inp2[0], N, n_threads)


def zero_fill(float[::1] buf, int n_threads=1):
    """buf = 0, the chunks split over the threads: one thread writes ~9 GB/s to memory, two ~17
    (the backward clears 15 activation-sized buffers a layer before accumulating into them)."""
    check_threads(n_threads)
    cdef Py_ssize_t N = buf.shape[0], ch, s
    if N == 0:
        return
    n_threads = eff_threads(n_threads, N, _grain)
    with nogil:
        for ch in prange(_nchunks(N, ECHUNK), schedule='static', num_threads=n_threads):
            s = ch * ECHUNK
            memset(&buf[s], 0, imin(ECHUNK, N - s) * sizeof(float))


def residual_backward(float[::1] dinp1, float[::1] dinp2, const float[::1] dout, long N, int n_threads=1):
    """Accumulate: dinp1 (N) += dout; dinp2 (N) += dout."""
    check_threads(n_threads)
    check_positive("N", N)
    check_len("dinp1", dinp1.shape[0], N)
    check_len("dinp2", dinp2.shape[0], N)
    check_len("dout", dout.shape[0], N)
    n_threads = eff_threads(n_threads, N, _grain)
    with nogil:
        _residual_backward(&dinp1[0], &dinp2[0], &dout[0], N, n_threads)


cdef int _check_xent(str rows, Py_ssize_t rows_len, str vec, Py_ssize_t vec_len, const float[::1] probs,
                     const int[::1] targets, int BT, int V, int Vp, int n_threads) except -1:
    # shared checks of the loss kernels: `rows` is the other (BT,Vp) buffer, `vec` the other (BT)
    check_threads(n_threads)
    check_positive("BT", BT); check_positive("V", V)
    if Vp < V:
        raise ValueError(f"Vp={Vp} is smaller than V={V}")
    check_len(rows, rows_len, <Py_ssize_t>BT * Vp)
    check_len("probs", probs.shape[0], <Py_ssize_t>BT * Vp)
    check_len(vec, vec_len, BT)
    check_len("targets", targets.shape[0], BT)
    _check_ids("targets", targets, V)
    return 0


def softmax_crossentropy_forward(float[::1] losses, float[::1] probs, const float[::1] logits,
                                 const int[::1] targets, int BT, int V, int Vp, int n_threads=1):
    """Per row of logits (BT,Vp): probs = softmax over the first V (probs[V:Vp] = 0) and
    losses (BT) = -log probs[target]. probs may be the same buffer as logits (in place)."""
    _check_xent("logits", logits.shape[0], "losses", losses.shape[0], probs, targets, BT, V, Vp, n_threads)
    n_threads = eff_threads(n_threads, <Py_ssize_t>BT * V, _grain)
    with nogil:
        _softmax_crossentropy_forward(&losses[0], &probs[0], &logits[0], &targets[0], BT, V, Vp, n_threads)


cdef int _checked_softmax_crossentropy_backward(out_t[::1] dlogits, const float[::1] probs,
                                                const int[::1] targets, const float[::1] dlosses,
                                                int BT, int V, int Vp, int n_threads) except -1:
    _check_xent("dlogits", dlogits.shape[0], "dlosses", dlosses.shape[0], probs, targets, BT, V, Vp, n_threads)
    n_threads = eff_threads(n_threads, <Py_ssize_t>BT * V, _grain)
    with nogil:
        _softmax_crossentropy_backward(&dlogits[0], &probs[0], &targets[0], &dlosses[0], BT, V, Vp, n_threads)
    return 0


def softmax_crossentropy_backward(float[::1] dlogits, const float[::1] probs, const int[::1] targets,
                                  const float[::1] dlosses, int BT, int V, int Vp, int n_threads=1):
    """OVERWRITE dlogits (BT,Vp): (probs - onehot(target)) * dlosses[bt] for i < V, 0 for padded.
    dlogits may be the same buffer as probs."""
    _checked_softmax_crossentropy_backward(dlogits, probs, targets, dlosses, BT, V, Vp, n_threads)


def softmax_crossentropy_forward_backward(float[::1] losses, float[::1] dlogits, const float[::1] logits,
                                          const int[::1] targets, const float[::1] dlosses,
                                          int BT, int V, int Vp, int n_threads=1):
    """softmax_crossentropy_forward (losses) and then softmax_crossentropy_backward (dlogits) one
    row after the other, the same bits as the two calls: each row's exps are scaled to probs and
    to dlogits in one pass while the row is in cache, so the block is read and written once, not
    twice. dlogits may be the same buffer as logits (in place)."""
    _check_xent("logits", logits.shape[0], "losses", losses.shape[0], logits, targets, BT, V, Vp, n_threads)
    _check_xent("dlogits", dlogits.shape[0], "dlosses", dlosses.shape[0], logits, targets, BT, V, Vp, n_threads)
    n_threads = eff_threads(n_threads, <Py_ssize_t>BT * V, _grain)
    with nogil:
        _softmax_crossentropy_forward_backward(&losses[0], &dlogits[0], &logits[0], &targets[0], &dlosses[0],
                                               BT, V, Vp, n_threads)


def softmax_crossentropy_forward_backward_bf16(float[::1] losses, dlogits, const lg_t[::1] logits,
                                               const int[::1] targets, dlosses,
                                               int BT, int V, int Vp, int n_threads=1):
    """softmax_crossentropy_forward (losses) and then softmax_crossentropy_backward_bf16 (dlogits)
    one row after the other, the same bits as the two calls. Each row's probs live only in a row
    buffer of the thread, read back from cache; logits is left as it was (the bf16 lm head's
    blocks: only read, it is never written back to memory). logits: float32, or uint16 (the bf16
    lm head's bf16 logits: the bits of the float32 call on their exact widening). dlogits and
    dlosses None: the losses only."""
    cdef uint16_t[::1] d16
    cdef const float[::1] dl
    cdef uint16_t* d16p = NULL
    cdef const float* dlp = NULL
    check_threads(n_threads)
    check_positive("BT", BT); check_positive("V", V)
    if Vp < V:
        raise ValueError(f"Vp={Vp} is smaller than V={V}")
    check_len("logits", logits.shape[0], <Py_ssize_t>BT * Vp)
    check_len("losses", losses.shape[0], BT)
    check_len("targets", targets.shape[0], BT)
    _check_ids("targets", targets, V)
    if (dlogits is None) != (dlosses is None):
        raise ValueError("dlogits and dlosses go together: pass both, or neither for the losses only")
    if dlogits is not None:
        d16, dl = dlogits, dlosses
        check_len("dlogits", d16.shape[0], <Py_ssize_t>BT * Vp)
        check_len("dlosses", dl.shape[0], BT)
        d16p, dlp = &d16[0], &dl[0]
    n_threads = eff_threads(n_threads, <Py_ssize_t>BT * V, _grain)
    cdef int failed
    with nogil:
        failed = _xent_forward_backward_bf16(&losses[0], d16p, &logits[0], &targets[0], dlp,
                                             BT, V, Vp, n_threads)
    if failed:
        raise MemoryError("softmax_crossentropy_forward_backward_bf16: cannot allocate a row of probs")


def softmax_crossentropy_backward_bf16(uint16_t[::1] dlogits, const float[::1] probs, const int[::1] targets,
                                       const float[::1] dlosses, int BT, int V, int Vp, int n_threads=1):
    """softmax_crossentropy_backward with dlogits (BT,Vp) written as bf16: the lm-head backward
    GEMMs read it, and no fp32 copy is ever needed (the lm head has no bias)."""
    _checked_softmax_crossentropy_backward(dlogits, probs, targets, dlosses, BT, V, Vp, n_threads)


cdef void _layernorm_forward_b16(uint16_t* out, float* mean, float* rstd, float* inp, const float* weight,
                                 const float* bias, int N, int C, const float* residual,
                                 int n_threads) noexcept nogil:
    _layernorm_forward(out, mean, rstd, inp, weight, bias, N, C, residual, n_threads)


def c_api():
    """The C kernels this module lends others (capi.pxd), on the copies set_simd() put in force:
    "layernorm_bf16" (layernorm_forward_bf16), "gelu_bf16" (gelu_forward_bf16 of bf16 input),
    "residual" (residual_forward)."""
    return {"layernorm_bf16": fn_capsule(<void*><layernorm_bf16_fn>_layernorm_forward_b16),
            "gelu_bf16": fn_capsule(<void*><gelu_bf16_fn>_gelu_forward_b16),
            "residual": fn_capsule(<void*><residual_fn>_residual_forward)}
