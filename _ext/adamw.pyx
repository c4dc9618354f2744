"""AdamW over flat float32 buffers, and the deterministic global gradient norm.

Mirrors llm.c train_gpt2.cu's AdamW (llmc/adamw.cuh, without master weights/stochastic
rounding): g = grad_scale*g; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
p -= lr * (m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + weight_decay * p). The model calls it per
tensor (weight_decay 0 for biases and LayerNorm params, as CU does) or once over the whole
buffer (as train_gpt2.c does). It is one fused, memory-bound pass: 4 streams read, 3 written
(3.5 GB for 124M parameters). The inner loop is plain Cython (the portable path) with an AVX
twin chosen at run time; both do the same float operations in the same order, so they agree
bit for bit, and every chunk's result is independent of the thread count.

With `params_bf16` given, the same pass also writes bf16(p) (round to nearest even) for the
mixed-precision matmuls: each chunk is cast while it is still in cache, instead of a second pass
over 124M parameters. With `zero_grads=True` the pass also clears each gradient chunk right after
its update has read it (a memset of the chunk, still in cache), so the training loop needs no
separate zeroing pass before the next step's backward (GPT2.zero_grad skips it); the update
itself is the same float operations on the same chunks, so params/m/v and the bf16 copy come out
bit-identical either way.

global_norm_sq sums squares in float64 over fixed-size chunks and adds the chunk sums in order,
so it returns the same bits at ANY thread count (llm.c CU sums in fp32 per block, racily).

What it is not: the schedule, clipping policy or weight-decay split (those live in Python).
"""
from cython.parallel cimport prange
from libc.math cimport pow
from libc.stdlib cimport malloc, free
from libc.string cimport memset
from libc.stdint cimport uint16_t

from kernels cimport check_threads, check_len, eff_threads

cdef extern from "adamw_avx.h":
    void llmctl_sqrt_inplace(float* a, int n) noexcept nogil
    Py_ssize_t llmctl_adamw_avx(float* p, const float* g, float* m, float* v, Py_ssize_t n,
                                float lr, float b1, float b2, float eps, float wd, float gs,
                                float inv_bc1, float inv_bc2) noexcept nogil
    int llmctl_cpu_has_avx() noexcept nogil
    void llmctl_adamw_init() noexcept nogil

cdef extern from "rows.h" nogil:
    # the bf16 copy's cast in the widest copy this CPU runs (the same bits in every copy)
    void llmctl_cast_bf16_isa(uint16_t* dst, const float* src, Py_ssize_t n)
    double llmctl_sumsq(const float* g, Py_ssize_t n)
    int llmctl_rows_set_isa(int level)

llmctl_rows_set_isa(-1)

cdef bint _use_avx = True
llmctl_adamw_init()   # the CPU's AVX, asked once here rather than racily in the first update
# minimum elements per thread (chunk results never depend on the thread count): small tensors
# such as biases and LayerNorm params are updated serially
cdef Py_ssize_t _grain = 65536


def set_parallel_grain(Py_ssize_t grain):
    """Set the minimum elements per thread (0: always use n_threads; tests do). Returns the old value."""
    global _grain
    old = _grain
    _grain = grain
    return old


def simd():
    """Which AdamW loop runs: "avx" or "baseline" (x86-64's SSE2, or plain C elsewhere)."""
    return "avx" if _use_avx and llmctl_cpu_has_avx() else "baseline"


def set_isa(int level):
    """The copy of the bf16 cast and the grad norm's sum of squares (rows.h): -1 the widest this
    CPU runs (the default), 0 baseline, 1 AVX2, 2 AVX-512 (at most what the CPU has; the same
    bits in each, which tests compare). -> the level in force."""
    return llmctl_rows_set_isa(level)


def set_simd(bint enabled):
    """Use (True, the default) or bypass the AVX path and the wide copies of the bf16 cast; for
    tests of the portable path."""
    global _use_avx
    _use_avx = enabled
    llmctl_rows_set_isa(-1 if enabled else 0)


cdef enum:
    CHUNK = 32768    # elements per task: big enough to amortise scheduling, small for balance
    BLOCK = 512      # elements per inner AdamW block (2 KB of sqrt scratch on the stack)


cdef void _adamw_block(float* p, const float* g, float* m, float* v, int n,
                       float lr, float b1, float b2, float eps, float wd, float gs,
                       float inv_bc1, float inv_bc2) noexcept nogil:
    # n <= BLOCK elements; two vectorised passes around one vector sqrt, all in L1
    cdef float den[BLOCK]
    cdef int i
    cdef float gi, mi, vi, one = 1.0
    cdef float omb1 = one - b1, omb2 = one - b2
    for i in range(n):
        gi = gs * g[i]
        mi = b1 * m[i] + omb1 * gi
        vi = b2 * v[i] + omb2 * gi * gi
        m[i] = mi
        v[i] = vi
        den[i] = vi * inv_bc2
    llmctl_sqrt_inplace(den, n)
    for i in range(n):
        p[i] = p[i] - lr * ((m[i] * inv_bc1) / (den[i] + eps) + wd * p[i])


cdef void _adamw_chunk(float* p, const float* g, float* m, float* v, Py_ssize_t n,
                       float lr, float b1, float b2, float eps, float wd, float gs,
                       float inv_bc1, float inv_bc2) noexcept nogil:
    cdef Py_ssize_t s = 0
    cdef int nb
    if _use_avx:
        s = llmctl_adamw_avx(p, g, m, v, n, lr, b1, b2, eps, wd, gs, inv_bc1, inv_bc2)
    while s < n:
        nb = BLOCK if n - s > BLOCK else <int>(n - s)
        _adamw_block(p + s, g + s, m + s, v + s, nb, lr, b1, b2, eps, wd, gs, inv_bc1, inv_bc2)
        s += nb


cdef void _adamw_update(float* params, const float* grads, float* m, float* v, uint16_t* pbf,
                        float* gzero, Py_ssize_t N, float lr, float b1, float b2, float eps,
                        float wd, float gs, float inv_bc1, float inv_bc2,
                        int n_threads) noexcept nogil:
    # gzero: NULL, or grads itself (writable) to be cleared chunk by chunk after use
    cdef Py_ssize_t nch = (N + CHUNK - 1) // CHUNK
    cdef Py_ssize_t ch, s, e
    for ch in prange(nch, schedule='static', num_threads=n_threads):
        s = ch * CHUNK
        e = s + CHUNK
        if e > N:
            e = N
        _adamw_chunk(params + s, grads + s, m + s, v + s, e - s, lr, b1, b2, eps, wd, gs,
                     inv_bc1, inv_bc2)
        if pbf != NULL:
            llmctl_cast_bf16_isa(pbf + s, params + s, e - s)  # the chunk (128 KB) is still in L2
        if gzero != NULL:
            memset(gzero + s, 0, (e - s) * sizeof(float))  # read above, still in cache too


def adamw_update(float[::1] params, grads, float[::1] m, float[::1] v,
                 float lr, float beta1, float beta2, float eps, float weight_decay,
                 float grad_scale, int t, int n_threads=1, params_bf16=None, bint zero_grads=False):
    """One AdamW step in place on params, m, v (all the same length as grads). t is 1-based.
    params_bf16 (uint16, same length) given: also set to bf16(updated params) in the same pass.
    zero_grads: also set grads (then writable) to 0 in the same pass, each chunk after its update
    has read it; params/m/v/params_bf16 are the same bits as without it."""
    cdef Py_ssize_t N = params.shape[0]
    cdef uint16_t[::1] pbf_mv
    cdef uint16_t* pbf = NULL
    cdef const float[::1] g_ro
    cdef float[::1] g_rw
    cdef float* gzero = NULL
    check_threads(n_threads)
    if zero_grads:
        g_rw = grads   # a read-only grads array is refused here
        g_ro = g_rw
    else:
        g_ro = grads
    if params_bf16 is not None:
        pbf_mv = params_bf16
        check_len("params_bf16", pbf_mv.shape[0], N)
        if N:
            pbf = &pbf_mv[0]
    if t < 1:
        raise ValueError(f"t (the 1-based step) must be >= 1, got {t}")
    check_len("grads", g_ro.shape[0], N)
    check_len("m", m.shape[0], N)
    check_len("v", v.shape[0], N)
    if N == 0:
        return
    # bias corrections in double, applied as float multipliers
    cdef float inv_bc1 = <float>(1.0 / (1.0 - pow(beta1, t)))
    cdef float inv_bc2 = <float>(1.0 / (1.0 - pow(beta2, t)))
    if zero_grads:
        gzero = &g_rw[0]
    n_threads = eff_threads(n_threads, N, _grain)  # small tensors (biases, LN) run serially
    with nogil:
        _adamw_update(&params[0], &g_ro[0], &m[0], &v[0], pbf, gzero, N, lr, beta1, beta2, eps,
                      weight_decay, grad_scale, inv_bc1, inv_bc2, n_threads)


def global_norm_sq(const float[::1] grads, int n_threads=1):
    """Sum of squares of grads as a Python float; float64 chunk partials added in a fixed order."""
    cdef Py_ssize_t N = grads.shape[0]
    cdef Py_ssize_t nch = (N + CHUNK - 1) // CHUNK
    cdef Py_ssize_t ch, s, e
    cdef double tot = 0.0
    cdef double* part
    check_threads(n_threads)
    if N == 0:
        return 0.0
    n_threads = eff_threads(n_threads, N, _grain)
    part = <double*>malloc(nch * sizeof(double))
    if part == NULL:
        raise MemoryError("global_norm_sq: cannot allocate chunk partials")
    try:
        with nogil:
            for ch in prange(nch, schedule='static', num_threads=n_threads):
                s = ch * CHUNK
                e = s + CHUNK
                if e > N:
                    e = N
                part[ch] = llmctl_sumsq(&grads[0] + s, e - s)   # rows.h: 8 double lanes, fixed order
            for ch in range(nch):
                tot += part[ch]
    finally:
        free(part)
    return tot
