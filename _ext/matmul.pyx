"""Matrix multiply for GPT-2's linear layers: out = inp @ weight^T + bias, and its backward.

Mirrors llm.c train_gpt2.c `matmul_forward` / `matmul_backward` (same shapes, same argument
order, backward accumulates). Three interchangeable fp32 engines:

- "dnnl" (the default where it was built): oneDNN's `dnnl_sgemm`, row-major, called without the
  GIL. The OpenMP build of oneDNN shares libgomp's thread team with llmctl's prange loops, so
  there is one thread pool; each call sets omp_get_max_threads() to `n_threads` first.
- "blas" (the default without oneDNN, e.g. another platform or LLMCTL_NO_DNNL=1): one BLAS sgemm
  per product through scipy.linalg.cython_blas (the scikit-learn pattern). OpenBLAS has its own
  thread pool; every call sets it to `n_threads` (cheap when unchanged) so BLAS and our OpenMP
  loops use the same count and never oversubscribe the cores. sgemm is never called in a prange.
- "tiled": a hand-written, cache-blocked Cython GEMM (4x8 register tile, K blocked by 256,
  operands packed GotoBLAS-style so the inner loop runs over contiguous memory). It is the portable
  fallback and the in-tree reference for the library paths. Every output element is summed over
  K in order by exactly one thread, so its result does not depend on the thread count.
For dnnl and blas the bias is written into `out` first and the GEMM runs with beta=1, so the
bias costs no extra pass.

Mixed precision (`*_bf16`): bf16 inputs (uint16 bit patterns, see bf16.h), fp32 accumulation
and fp32 outputs. "dnnl" runs oneDNN's matmul primitive (brgemm on AMX/AVX512_BF16; one cached
primitive per shape, the operands passed at each call, see dnnl_gemm.h) for the forward and for
the backward products where it was measured faster, the BLAS-like `dnnl_gemm_bf16bf16f32` call
for the others (set_bf16_primitive_rows); "dnnl_gemm" runs that call for every product (the
engine before, kept for bench/gemm.py). Both only on CPUs that multiply bf16 natively
(AVX512_BF16 or AMX, checked at run time: bf16_native()); "blas" widens the bf16 operands to
fp32 (exactly; the weight in blocks of rows) and runs sgemm: the same products of the same
rounded inputs, for CPUs without native bf16 and for tests. The backward casts fp32 dout to bf16 in the pass that sums dbias.

What it is not: a general GEMM. Shapes are llm.c's row-major (BT,C) x (OC,C)^T.
"""

from cython.parallel cimport prange
from libc.stdlib cimport free, getenv, malloc
from libc.stdint cimport uintptr_t, uint16_t, int64_t
from scipy.linalg.cython_blas cimport sgemm

from _openmp cimport omp_get_thread_num
from bf16 cimport llmctl_cast_bf16, llmctl_f32_to_bf16, llmctl_widen_bf16, out_t
from capi cimport fn_capsule, gemv_bf16_fn
from kernels cimport check_threads, check_len, check_positive, check_disjoint, col_chunk, eff_threads, imin

cdef extern from "rows.h" nogil:
    # the bias gradient's column sums (and the bf16 copy of dout) in the widest copy this CPU
    # runs; the same bits in every copy
    void llmctl_bias_grad(float* db, uint16_t* dst, double* acc, const float* dy, Py_ssize_t N,
                          Py_ssize_t ld, int n)
    int llmctl_rows_set_isa(int level)

llmctl_rows_set_isa(-1)


def set_isa(int level):
    """The copy of the bias-gradient loop that runs: 0 baseline, 1 AVX2, 2 AVX-512, -1 the widest
    this CPU runs (the default); capped at what the CPU has. -> the level now in use."""
    return llmctl_rows_set_isa(level)


cdef extern from "dnnl_gemm.h" nogil:
    int llmctl_cpu_bf16_flags()
    int llmctl_dnnl_sgemm(char ta, char tb, int64_t M, int64_t N, int64_t K, const float* A,
                          int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                          int64_t ldc, int n_threads)
    int llmctl_dnnl_sgemm_rows(int64_t M, int64_t N, int64_t K, const float* A, const float* B,
                               const float* bias, float* C, int n_threads)
    int llmctl_dnnl_split_rows_exact()
    int llmctl_dnnl_gemm_bf16(char ta, char tb, int64_t M, int64_t N, int64_t K, const uint16_t* A,
                              int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C,
                              int64_t ldc, int n_threads)
    int llmctl_dnnl_matmul_bf16(char ta, char tb, int64_t M, int64_t N, int64_t K, const uint16_t* A,
                                int64_t lda, const uint16_t* B, int64_t ldb, const float* bias,
                                float beta, float* C, int64_t ldc, int n_threads)
    int llmctl_dnnl_matmul_bf16_dst(char ta, char tb, int64_t M, int64_t N, int64_t K,
                                    const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                                    const float* bias, float beta, void* C, int64_t ldc, int cbf16,
                                    int n_threads)
    long llmctl_dnnl_matmul_builds()
    void llmctl_dnnl_version(int* v)

cdef extern from "gemv_bf16.h" nogil:
    int llmctl_gemv_bf16_supported()
    int llmctl_gemv_bf16_avx2_supported()
    void llmctl_gemv_bf16(float* out, const uint16_t* x, const uint16_t* W, const float* bias,
                          int R, int64_t C, int64_t OC, int64_t o0, int64_t o1)
    void llmctl_gemv_bf16_avx2(float* out, const uint16_t* x, const uint16_t* W, const float* bias,
                               int R, int64_t C, int64_t OC, int64_t o0, int64_t o1)

cdef extern from *:
    """
    #ifndef LLMCTL_DNNL_BUILD
    #define LLMCTL_DNNL_BUILD 0
    #endif
    """
    const int LLMCTL_DNNL_BUILD

# ---------------------------------------------------------------------------------------------
# BLAS thread control. llmctl.threads finds scipy's OpenBLAS and registers its get/set
# functions here (plain C pointers, so matmul calls can adjust the pool without the GIL or
# threadpoolctl's per-call overhead).

ctypedef int (*get_threads_fn)() noexcept nogil
ctypedef void (*set_threads_fn)(int) noexcept nogil

cdef get_threads_fn _blas_get_threads = NULL
cdef set_threads_fn _blas_set_threads = NULL


def register_blas_thread_functions(uintptr_t get_addr, uintptr_t set_addr):
    """Install the addresses of scipy's OpenBLAS `*_get_num_threads`/`*_set_num_threads` (0: none)."""
    global _blas_get_threads, _blas_set_threads
    if get_addr == 0 or set_addr == 0:
        _blas_get_threads = NULL
        _blas_set_threads = NULL
    else:
        _blas_get_threads = <get_threads_fn>get_addr
        _blas_set_threads = <set_threads_fn>set_addr


def blas_threads_controlled():
    """True when matmul can set the BLAS thread count itself (see llmctl.threads)."""
    return _blas_set_threads != NULL


cdef inline void _ensure_blas_threads(int n) noexcept nogil:
    if _blas_set_threads != NULL and _blas_get_threads() != n:
        _blas_set_threads(n)


def set_blas_threads(int n):
    """Set scipy's OpenBLAS pool to n threads now (no-op if it was not registered)."""
    check_threads(n)
    _ensure_blas_threads(n)


# Minimum elements per thread in the bias epilogues (their bits never depend on the thread
# count). They are memory-bound copies/sums (~0.2 ms for d12's largest at B*T=256), cheaper
# serial than the OpenMP fork/join between two BLAS calls, which can cost a scheduler tick on
# a busy machine; at B*T=4096 they are big enough to split.
cdef Py_ssize_t _grain = 1048576
cdef enum:
    SPLIT_MIN_ROWS = 64  # the fewest rows a thread's block of the split fp32 forward may have
# the oneDNN fp32 forward cuts its rows over the threads itself up to this many rows a thread
# (measured on 2 threads: a gain up to 1280 rows, level from 1536; 0: never)
cdef int _split_rows_per_thread = 1024
# only where oneDNN's sgemm gives a row the same bits in any call of 16 rows or more: its AVX-512
# kernels (oneDNN's effective ISA, after ONEDNN_MAX_CPU_ISA; dnnl_gemm.h; 0 without oneDNN)
cdef bint _split_exact = llmctl_dnnl_split_rows_exact()


def forward_split_available():
    """Whether the oneDNN fp32 forward may cut its rows over the threads (set_forward_split_rows):
    where oneDNN runs its AVX-512 sgemm, whose row bits do not depend on the rows around them."""
    return _split_exact


def set_forward_split_rows(int rows):
    """The oneDNN fp32 forward runs one single-threaded sgemm a thread on an even block of its
    rows when there are at least 64 and at most this many rows a thread (default 1024; 0: never,
    oneDNN threads every call itself), where forward_split_available(). Returns the old value."""
    global _split_rows_per_thread
    if rows < 0:
        raise ValueError(f"set_forward_split_rows: rows must be >= 0, got {rows}")
    old = _split_rows_per_thread
    _split_rows_per_thread = rows
    return old


def set_parallel_grain(Py_ssize_t grain):
    """Set the epilogues' minimum elements per thread (0: always n_threads). Returns the old value."""
    global _grain
    old = _grain
    _grain = grain
    return old


def set_widen_block(int rows):
    """Rows of a bf16 weight the "blas" bf16 engine widens at a time (tests use small blocks).
    Returns the old value."""
    global WBLOCK
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    old = WBLOCK
    WBLOCK = rows
    return old


# ---------------------------------------------------------------------------------------------
# Engines and precisions available in this build, on this CPU

def _env_flag(str name):
    # libc's getenv, not os.environ (which setting os.environ keeps in step through putenv):
    # every bf16 matmul call asks, and a decode step makes 49 of them
    cdef bytes key = name.encode()
    cdef const char* v = getenv(key)
    return v != NULL and v.decode("utf-8", "replace").strip().lower() not in ("", "0", "false", "no")


def dnnl_built():
    """True when this extension was linked against oneDNN (setup.py found the onednn wheels)."""
    return bool(LLMCTL_DNNL_BUILD)


def dnnl_version():
    """oneDNN's (major, minor, patch), or None when not built with it."""
    cdef int v[3]
    if not LLMCTL_DNNL_BUILD:
        return None
    llmctl_dnnl_version(v)
    return (v[0], v[1], v[2])


# asked once: cpuid traps to the hypervisor in a VM (tens of microseconds), and every bf16
# matmul call checks its engine
cdef int _cpu_bf16_flags = llmctl_cpu_bf16_flags()


def cpu_bf16_features():
    """The native bf16 instruction sets this CPU and OS offer: a subset of ("avx512_bf16", "amx_bf16")."""
    cdef int f = _cpu_bf16_flags
    return tuple(name for bit, name in ((1, "avx512_bf16"), (2, "amx_bf16")) if f & bit)


cdef int _bf16_native = -1   # -1 unknown; 0/1 after the first bf16_native()


def bf16_native():
    """True when the "dnnl" engine can multiply bf16 here: oneDNN is built and enabled, the CPU
    has AVX512_BF16 or AMX, and a small dnnl_gemm_bf16bf16f32 gives the exact product."""
    global _bf16_native
    cdef uint16_t a[4]
    cdef float c[4]
    cdef int st, i
    if "dnnl" not in get_engines() or not cpu_bf16_features():
        return False
    if _bf16_native < 0:
        for i in range(4):          # A = B = [[1, 2], [3, 4]] (exact in bf16)
            a[i] = llmctl_f32_to_bf16(<float>(i + 1))
            c[i] = 0.0
        st = llmctl_dnnl_gemm_bf16(b'N', b'N', 2, 2, 2, a, 2, a, 2, 0.0, c, 2, 1)
        _bf16_native = 1 if st == 0 and (c[0], c[1], c[2], c[3]) == (7.0, 10.0, 15.0, 22.0) else 0
    return _bf16_native == 1


def get_engines():
    """The fp32 engines matmul_forward/matmul_backward accept here; the first is the default.
    "dnnl" is listed only when built with oneDNN and LLMCTL_NO_DNNL is not set."""
    if LLMCTL_DNNL_BUILD and not _env_flag("LLMCTL_NO_DNNL"):
        return ("dnnl", "blas", "tiled")
    return ("blas", "tiled")


def get_bf16_engines():
    """The engines the *_bf16 kernels accept here; the first is the default ("dnnl" and
    "dnnl_gemm" only where bf16_native(); "blas" emulates on fp32 sgemm everywhere)."""
    return ("dnnl", "dnnl_gemm", "blas") if bf16_native() else ("blas",)


def dnnl_matmul_builds():
    """How many oneDNN matmul primitives the "dnnl" bf16 engine has built since load (each is
    cached per shape, transposes, bias, accumulation and thread count; see dnnl_gemm.h)."""
    return llmctl_dnnl_matmul_builds()


def default_engine():
    return get_engines()[0]


# ---------------------------------------------------------------------------------------------
# Bias epilogues (shared by both engines)

cdef enum:
    BIAS_CHUNK = 2048    # output channels per dbias task at most (double accumulators on the stack)


cdef void _fill_bias_rows(float* out, const float* bias, int BT, int OC, int n_threads) noexcept nogil:
    # out (BT,OC) = bias (OC) broadcast over rows
    cdef Py_ssize_t bt
    cdef int o
    cdef float* row
    n_threads = eff_threads(n_threads, <Py_ssize_t>BT * OC, _grain)
    for bt in prange(BT, schedule='static', num_threads=n_threads):
        row = out + bt * OC
        for o in range(OC):
            row[o] = bias[o]


cdef void _bias_grad_chunk(float* dbias, uint16_t* dst, const float* dout, int BT, int OC,
                           int o0, int o1) noexcept nogil:
    # dbias[o0:o1] += sum over bt (in order) of dout[bt, o0:o1], double accumulators; and, if dst
    # is not NULL, dst[:, o0:o1] = bf16(dout[:, o0:o1]) in the same pass (rows.h, the widest copy)
    cdef double acc[BIAS_CHUNK]
    llmctl_bias_grad(NULL if dbias == NULL else dbias + o0, NULL if dst == NULL else dst + o0, acc,
                     dout + o0, BT, OC, o1 - o0)


cdef void _bias_grad(float* dbias, uint16_t* dst, const float* dout, int BT, int OC,
                     int n_threads) noexcept nogil:
    # dbias (OC) += sum_bt dout (BT,OC) (dbias may be NULL), and dst = bf16(dout) unless dst is
    # NULL: the bf16 copy the backward GEMMs read costs no extra pass, and dbias is the same sum
    # whatever the precision of the GEMMs. Parallel over wide chunks of columns (col_chunk): the
    # same bits at any thread count
    n_threads = eff_threads(n_threads, <Py_ssize_t>BT * OC, _grain)
    cdef int w = col_chunk(OC, n_threads, BIAS_CHUNK)
    cdef int ch, o0
    for ch in prange((OC + w - 1) // w, schedule='static', num_threads=n_threads):
        o0 = ch * w
        _bias_grad_chunk(dbias, dst, dout, BT, OC, o0, imin(o0 + w, OC))


# ---------------------------------------------------------------------------------------------
# BLAS engine. Row-major X (r,c) is column-major X^T (c,r); every product below is written
# for column-major sgemm on the transposes.

cdef void _matmul_forward_blas(float* out, const float* inp, const float* weight, const float* bias,
                               int BT, int C, int OC, int n_threads) noexcept nogil:
    # out (BT,OC) = inp (BT,C) @ weight (OC,C)^T [+ bias (OC)]
    # column-major: out^T (OC,BT) = weight^T' (OC,C) @ inp^T (C,BT) -> sgemm('T','N', OC, BT, C)
    cdef float one = 1.0, zero = 0.0
    cdef float beta = zero
    cdef char ta = b'T', tb = b'N'
    if bias != NULL:
        _fill_bias_rows(out, bias, BT, OC, n_threads)
        beta = one
    _ensure_blas_threads(n_threads)
    sgemm(&ta, &tb, &OC, &BT, &C, &one, <float*>weight, &C, <float*>inp, &C, &beta, out, &OC)


cdef void _matmul_backward_blas(float* dinp, float* dweight, float* dbias, const float* dout,
                                const float* inp, const float* weight,
                                int BT, int C, int OC, int n_threads) noexcept nogil:
    cdef float one = 1.0
    cdef char tn = b'N', tt = b'T'
    _ensure_blas_threads(n_threads)
    if dinp != NULL:
        # dinp (BT,C) += dout (BT,OC) @ weight (OC,C); column-major: dinp^T (C,BT) += W^T (C,OC) @ dout^T (OC,BT)
        sgemm(&tn, &tn, &C, &BT, &OC, &one, <float*>weight, &C, <float*>dout, &OC, &one, dinp, &C)
    if dweight != NULL:
        # dweight (OC,C) += dout^T (OC,BT) @ inp (BT,C); column-major: dW^T (C,OC) += inp^T (C,BT) @ dout (BT,OC)
        sgemm(&tn, &tt, &C, &OC, &BT, &one, <float*>inp, &C, <float*>dout, &OC, &one, dweight, &C)
    if dbias != NULL:
        _bias_grad(dbias, NULL, dout, BT, OC, n_threads)


# ---------------------------------------------------------------------------------------------
# oneDNN engine: row-major GEMMs, so the products are written as they read.

cdef int _matmul_forward_dnnl(float* out, const float* inp, const float* weight, const float* bias,
                              int BT, int C, int OC, int n_threads) noexcept nogil:
    # out (BT,OC) = inp (BT,C) @ weight (OC,C)^T [+ bias (OC)]
    cdef float beta = 0.0
    if (n_threads > 1 and SPLIT_MIN_ROWS * n_threads <= BT <= <Py_ssize_t>_split_rows_per_thread * n_threads
            and _split_exact):
        # one single-threaded sgemm a thread on an even block of the rows (dnnl_gemm.h: why)
        return llmctl_dnnl_sgemm_rows(BT, OC, C, inp, weight, bias, out, n_threads)
    if bias != NULL:
        _fill_bias_rows(out, bias, BT, OC, n_threads)
        beta = 1.0
    return llmctl_dnnl_sgemm(b'N', b'T', BT, OC, C, inp, C, weight, C, beta, out, OC, n_threads)


cdef int _matmul_backward_dnnl(float* dinp, float* dweight, float* dbias, const float* dout,
                               const float* inp, const float* weight,
                               int BT, int C, int OC, int n_threads) noexcept nogil:
    cdef int st = 0
    if dinp != NULL:
        # dinp (BT,C) += dout (BT,OC) @ weight (OC,C)
        st = llmctl_dnnl_sgemm(b'N', b'N', BT, C, OC, dout, OC, weight, C, 1.0, dinp, C, n_threads)
    if st == 0 and dweight != NULL:
        # dweight (OC,C) += dout^T (OC,BT) @ inp (BT,C)
        st = llmctl_dnnl_sgemm(b'T', b'N', OC, C, BT, dout, OC, inp, C, 1.0, dweight, C, n_threads)
    if dbias != NULL:
        _bias_grad(dbias, NULL, dout, BT, OC, n_threads)
    return st


cdef int _check_dnnl(int status, str what) except -1:
    if status != 0:
        raise RuntimeError(f"{what}: oneDNN returned status {status}")
    return 0


# ---------------------------------------------------------------------------------------------
# Tiled engine (GotoBLAS layout, in Cython). One micro-kernel computes a tile of up to MR x NR
# outputs,  Ct[r, j] (+)= sum_k Ap[k*a_ks + r] * Bp[k*b_ks + j],  where both operands are laid
# out so that each k step reads MR contiguous A values and NR contiguous B values: row-major
# A operands are first packed into (K, MR) panels, the forward weight into (KC, NR) panels.
# Keeping j innermost (an outer-product update) lets gcc vectorise without reassociating the
# sum over k, so every element is the in-order sum and results are bit-reproducible.

cdef enum:
    MR = 4     # rows of the register tile (4 x 8 floats = 8 SSE accumulators)
    NR = 8     # columns of the register tile (contiguous in the B panel)
    KC = 256   # K block: a KC x NR weight panel is 8 KB and stays in L1


cdef void _tile(float* Ct, Py_ssize_t ldc, const float* Ap, Py_ssize_t a_ks,
                const float* Bp, Py_ssize_t b_ks, int K, int nr, int nc, bint load_c) noexcept nogil:
    cdef float acc[MR * NR]
    cdef int r, j, k
    cdef const float* arow
    cdef const float* brow
    for r in range(MR * NR):
        acc[r] = 0.0
    if load_c:
        for r in range(nr):
            for j in range(nc):
                acc[r * NR + j] = Ct[r * ldc + j]
    if nc == NR:
        for k in range(K):
            arow = Ap + k * a_ks
            brow = Bp + k * b_ks
            for r in range(MR):
                for j in range(NR):
                    acc[r * NR + j] += arow[r] * brow[j]
    else:
        for k in range(K):
            arow = Ap + k * a_ks
            brow = Bp + k * b_ks
            for r in range(MR):
                for j in range(nc):
                    acc[r * NR + j] += arow[r] * brow[j]
    for r in range(nr):
        for j in range(nc):
            Ct[r * ldc + j] = acc[r * NR + j]


cdef void _pack_rows(float* Ap, const float* A, int lda, int rows, int k0, int kc,
                     int n_threads) noexcept nogil:
    # columns k0..k0+kc of A (rows, lda) row-major -> per block of MR rows a (kc, MR) panel:
    # Ap[rb*MR*kc + k*MR + r]; rows past the end are zero so the micro-kernel can always read MR
    cdef int nrb = (rows + MR - 1) // MR
    cdef int rb, r, k, row
    cdef float* dst
    for rb in prange(nrb, schedule='static', num_threads=n_threads):
        dst = Ap + <Py_ssize_t>rb * MR * kc
        for r in range(MR):
            row = rb * MR + r
            if row < rows:
                for k in range(kc):
                    dst[k * MR + r] = A[<Py_ssize_t>row * lda + k0 + k]
            else:
                for k in range(kc):
                    dst[k * MR + r] = 0.0


cdef void _pack_wT(float* panel, const float* weight, int C, int o0, int nc, int k0, int kc) noexcept nogil:
    # panel (kc, NR)[k, j] = weight[o0 + j, k0 + k]  (columns j >= nc zero-filled)
    cdef int k, j
    for j in range(NR):
        if j < nc:
            for k in range(kc):
                panel[k * NR + j] = weight[<Py_ssize_t>(o0 + j) * C + k0 + k]
        else:
            for k in range(kc):
                panel[k * NR + j] = 0.0


cdef void _matmul_forward_tiled(float* out, const float* inp, const float* weight, const float* bias,
                                int BT, int C, int OC, float* apack, float* panels,
                                int n_threads) noexcept nogil:
    # out (BT,OC) = inp (BT,C) @ weight (OC,C)^T [+ bias]; parallel over NR-column blocks of out.
    # apack: ceil(BT/MR)*MR*C floats; panels: n_threads * KC * NR floats (one per thread)
    cdef int ncb = (OC + NR - 1) // NR
    cdef int cb, o0, nc, k0, kc, r0, nr, r, j
    cdef float* panel
    _pack_rows(apack, inp, C, BT, 0, C, n_threads)
    for cb in prange(ncb, schedule='static', num_threads=n_threads):
        panel = panels + <Py_ssize_t>omp_get_thread_num() * KC * NR
        o0 = cb * NR
        nc = imin(NR, OC - o0)
        k0 = 0
        while k0 < C:
            kc = imin(KC, C - k0)
            _pack_wT(panel, weight, C, o0, nc, k0, kc)
            r0 = 0
            while r0 < BT:
                nr = imin(MR, BT - r0)
                _tile(out + <Py_ssize_t>r0 * OC + o0, OC, apack + <Py_ssize_t>r0 * C + <Py_ssize_t>k0 * MR, MR,
                      panel, NR, kc, nr, nc, k0 > 0)
                r0 = r0 + MR
            k0 = k0 + KC
        if bias != NULL:
            for r in range(BT):
                for j in range(nc):
                    out[<Py_ssize_t>r * OC + o0 + j] += bias[o0 + j]


cdef void _matmul_dinp_tiled(float* dinp, const float* dout, const float* weight,
                             int BT, int C, int OC, float* apack, int n_threads) noexcept nogil:
    # dinp (BT,C) += dout (BT,OC) @ weight (OC,C); tiles over (row block, NR-column block of C);
    # K = OC in blocks of KC, the OUTER loop (K = Vp = 50304 for the lm head): per block, dout's
    # columns are packed into (KC, MR) panels (apack: ceil(BT/MR)*MR*KC floats) and the B panel
    # is the weight itself (row o, columns c0..c0+NR contiguous), so each block's weight rows stay
    # in cache while every tile uses them. The static schedule gives each tile to the same thread
    # in every K block, so each element is still summed in order by one thread.
    cdef int nrb = (BT + MR - 1) // MR
    cdef int ncb = (C + NR - 1) // NR
    cdef int tile, rb, cb, r0, c0, nr, nc, k0, kc
    k0 = 0
    while k0 < OC:
        kc = imin(KC, OC - k0)
        _pack_rows(apack, dout, OC, BT, k0, kc, n_threads)
        for tile in prange(nrb * ncb, schedule='static', num_threads=n_threads):
            cb = tile // nrb
            rb = tile - cb * nrb
            r0 = rb * MR
            c0 = cb * NR
            nr = imin(MR, BT - r0)
            nc = imin(NR, C - c0)
            _tile(dinp + <Py_ssize_t>r0 * C + c0, C, apack + <Py_ssize_t>r0 * kc, MR,
                  weight + <Py_ssize_t>k0 * C + c0, C, kc, nr, nc, True)
        k0 = k0 + KC


cdef void _matmul_dweight_tiled(float* dweight, const float* dout, const float* inp,
                                int BT, int C, int OC, int n_threads) noexcept nogil:
    # dweight (OC,C) += dout^T (OC,BT) @ inp (BT,C). dout^T needs no packing: for each k = bt,
    # its MR rows o0..o0+MR are contiguous in dout (a_ks = OC); B = inp rows, K = BT.
    # The last row block is handled by a shifted tile (MR reads must stay inside dout).
    cdef int nrb = (OC + MR - 1) // MR
    cdef int ncb = (C + NR - 1) // NR
    cdef int tile, rb, cb, r0, c0, nr, nc, k0, kc
    for tile in prange(nrb * ncb, schedule='static', num_threads=n_threads):
        rb = tile // ncb
        cb = tile - rb * ncb
        r0 = rb * MR
        c0 = cb * NR
        nr = imin(MR, OC - r0)
        nc = imin(NR, C - c0)
        k0 = 0
        while k0 < BT:
            kc = imin(KC, BT - k0)
            _tile_rows(dweight + <Py_ssize_t>r0 * C + c0, C, dout + <Py_ssize_t>k0 * OC + r0, OC,
                       inp + <Py_ssize_t>k0 * C + c0, C, kc, nr, nc)
            k0 = k0 + KC


cdef void _tile_rows(float* Ct, Py_ssize_t ldc, const float* A, Py_ssize_t a_ks,
                     const float* Bp, Py_ssize_t b_ks, int K, int nr, int nc) noexcept nogil:
    # Ct (+)= as _tile with load_c, for an unpacked A whose rows r < nr only may be read
    if nr == MR:
        _tile(Ct, ldc, A, a_ks, Bp, b_ks, K, nr, nc, True)
        return
    cdef float acc[MR * NR]
    cdef int r, j, k
    for r in range(nr):
        for j in range(nc):
            acc[r * NR + j] = Ct[r * ldc + j]
    for k in range(K):
        for r in range(nr):
            for j in range(nc):
                acc[r * NR + j] += A[k * a_ks + r] * Bp[k * b_ks + j]
    for r in range(nr):
        for j in range(nc):
            Ct[r * ldc + j] = acc[r * NR + j]


# ---------------------------------------------------------------------------------------------
# Python wrappers: validate, then run without the GIL

cdef inline Py_ssize_t _round_up(Py_ssize_t n, Py_ssize_t m) noexcept nogil:
    return (n + m - 1) // m * m


cdef enum:
    BLAS = 0
    TILED = 1
    DNNL = 2
    DNNL_GEMM = 3      # bf16 only: the BLAS-like dnnl_gemm_bf16bf16f32 call


cdef int _check_sizes(str out, Py_ssize_t out_len, Py_ssize_t inp_len, Py_ssize_t weight_len,
                      int BT, int C, int OC, int n_threads) except -1:
    # the checks every wrapper shares: `out` (BT,OC) is out or dout, inp (BT,C), weight (OC,C)
    check_threads(n_threads)
    check_positive("BT", BT); check_positive("C", C); check_positive("OC", OC)
    check_len(out, out_len, <Py_ssize_t>BT * OC)
    check_len("inp", inp_len, <Py_ssize_t>BT * C)
    check_len("weight", weight_len, <Py_ssize_t>OC * C)
    return 0


cdef int _engine_id(engine) except -1:
    names = get_engines()
    if engine is None:
        engine = names[0]
    if engine in names:
        return {"blas": BLAS, "tiled": TILED, "dnnl": DNNL}[engine]
    if engine == "dnnl":
        why = "LLMCTL_NO_DNNL is set" if LLMCTL_DNNL_BUILD else "llmctl was built without oneDNN"
        raise ValueError(f"matmul engine 'dnnl' is not available ({why}); choose one of {names}")
    raise ValueError(f"unknown matmul engine {engine!r}; choose one of {names}")


def matmul_forward(float[::1] out, const float[::1] inp, const float[::1] weight, bias,
                   int BT, int C, int OC, int n_threads=1, engine=None):
    """out (BT,OC) = inp (BT,C) @ weight (OC,C)^T + bias (OC). Overwrites out. bias may be None."""
    cdef int which = _engine_id(engine)
    cdef const float[::1] bias_mv
    cdef const float* bias_ptr = NULL
    _check_sizes("out", out.shape[0], inp.shape[0], weight.shape[0], BT, C, OC, n_threads)
    if bias is not None:
        bias_mv = bias
        check_len("bias", bias_mv.shape[0], OC)
        bias_ptr = &bias_mv[0]
        check_disjoint("out", &out[0], out.shape[0], "bias", bias_ptr, OC)
    check_disjoint("out", &out[0], out.shape[0], "inp", &inp[0], inp.shape[0])
    check_disjoint("out", &out[0], out.shape[0], "weight", &weight[0], weight.shape[0])
    cdef float* panels = NULL
    cdef int st
    if which == DNNL:
        with nogil:
            st = _matmul_forward_dnnl(&out[0], &inp[0], &weight[0], bias_ptr, BT, C, OC, n_threads)
        _check_dnnl(st, "matmul_forward")
        return
    if which == BLAS:
        with nogil:
            _matmul_forward_blas(&out[0], &inp[0], &weight[0], bias_ptr, BT, C, OC, n_threads)
        return
    cdef float* apack = <float*>malloc(<size_t>_round_up(BT, MR) * C * sizeof(float))
    panels = <float*>malloc(<size_t>n_threads * KC * NR * sizeof(float))
    try:
        if panels == NULL or apack == NULL:
            raise MemoryError("matmul_forward: cannot allocate the tiled kernel's packing buffers")
        with nogil:
            _matmul_forward_tiled(&out[0], &inp[0], &weight[0], bias_ptr, BT, C, OC, apack, panels, n_threads)
    finally:
        free(panels)
        free(apack)


cdef int _check_backward_disjoint(float* dinp, float* dweight, float* dbias, const float* dout,
                                  const float* inp, const float* weight, int BT, int C, int OC) except -1:
    # every gradient buffer must be disjoint from every input and from the other gradients
    cdef Py_ssize_t ninp = <Py_ssize_t>BT * C, nw = <Py_ssize_t>OC * C, nout = <Py_ssize_t>BT * OC
    outs = []
    if dweight != NULL:
        outs.append(("dweight", <uintptr_t>dweight, nw))
    if dinp != NULL:
        outs.append(("dinp", <uintptr_t>dinp, ninp))
    if dbias != NULL:
        outs.append(("dbias", <uintptr_t>dbias, OC))
    ins = [("dout", <uintptr_t>dout, nout), ("inp", <uintptr_t>inp, ninp), ("weight", <uintptr_t>weight, nw)]
    for i, (a, pa, na) in enumerate(outs):
        for b, pb, nb in ins + outs[i + 1:]:
            check_disjoint(a, <const float*><uintptr_t>pa, na, b, <const float*><uintptr_t>pb, nb)
    return 0


def matmul_backward(dinp, dweight, dbias, const float[::1] dout,
                    const float[::1] inp, const float[::1] weight,
                    int BT, int C, int OC, int n_threads=1, engine=None):
    """Accumulate: dinp (BT,C) += dout @ weight; dweight (OC,C) += dout^T @ inp;
    dbias (OC) += sum over BT of dout. dinp, dweight and dbias may be None (skipped): the
    products are independent, so calls that share them out give the bits of one call."""
    cdef int which = _engine_id(engine)
    cdef float[::1] dinp_mv, dbias_mv, dw_mv
    cdef float* dinp_ptr = NULL
    cdef float* dbias_ptr = NULL
    cdef float* dw_ptr = NULL
    _check_sizes("dout", dout.shape[0], inp.shape[0], weight.shape[0], BT, C, OC, n_threads)
    if dweight is not None:
        dw_mv = dweight
        check_len("dweight", dw_mv.shape[0], <Py_ssize_t>OC * C)
        dw_ptr = &dw_mv[0]
    if dinp is not None:
        dinp_mv = dinp
        check_len("dinp", dinp_mv.shape[0], <Py_ssize_t>BT * C)
        dinp_ptr = &dinp_mv[0]
    if dbias is not None:
        dbias_mv = dbias
        check_len("dbias", dbias_mv.shape[0], OC)
        dbias_ptr = &dbias_mv[0]
    _check_backward_disjoint(dinp_ptr, dw_ptr, dbias_ptr, &dout[0], &inp[0], &weight[0], BT, C, OC)
    cdef float* apack = NULL
    cdef int st
    if which == DNNL:
        with nogil:
            st = _matmul_backward_dnnl(dinp_ptr, dw_ptr, dbias_ptr, &dout[0], &inp[0], &weight[0],
                                       BT, C, OC, n_threads)
        _check_dnnl(st, "matmul_backward")
        return
    if which == BLAS:
        with nogil:
            _matmul_backward_blas(dinp_ptr, dw_ptr, dbias_ptr, &dout[0], &inp[0], &weight[0],
                                  BT, C, OC, n_threads)
        return
    try:
        if dinp_ptr != NULL:
            apack = <float*>malloc(<size_t>_round_up(BT, MR) * KC * sizeof(float))
            if apack == NULL:
                raise MemoryError("matmul_backward: cannot allocate the tiled kernel's packing buffer")
        with nogil:
            if dinp_ptr != NULL:
                _matmul_dinp_tiled(dinp_ptr, &dout[0], &weight[0], BT, C, OC, apack, n_threads)
            if dw_ptr != NULL:
                _matmul_dweight_tiled(dw_ptr, &dout[0], &inp[0], BT, C, OC, n_threads)
            if dbias_ptr != NULL:
                _bias_grad(dbias_ptr, NULL, &dout[0], BT, OC, n_threads)
    finally:
        free(apack)


# ---------------------------------------------------------------------------------------------
# Mixed precision: bf16 operands (uint16 bit patterns), fp32 accumulation and fp32 outputs

cdef enum:
    ECHUNK = 16384      # elements per task in the widening/casting loops


cdef void _convert(out_t* dst, const void* src, Py_ssize_t n, int n_threads) noexcept nogil:
    # dst = src converted, in chunks over the threads: fp32 dst widens bf16 src (exact), bf16 dst
    # rounds fp32 src to nearest even
    cdef Py_ssize_t ch, s
    n_threads = eff_threads(n_threads, n, _grain)
    for ch in prange((n + ECHUNK - 1) // ECHUNK, schedule='static', num_threads=n_threads):
        s = ch * ECHUNK
        if out_t is float:
            llmctl_widen_bf16(dst + s, <const uint16_t*>src + s, imin(ECHUNK, n - s))
        else:
            llmctl_cast_bf16(dst + s, <const float*>src + s, imin(ECHUNK, n - s))


cdef inline void _widen(float* dst, const uint16_t* src, Py_ssize_t n, int n_threads) noexcept nogil:
    _convert(dst, src, n, n_threads)


cdef void _widen_cols(float* dst, const uint16_t* src, int rows, int ld, int ncols,
                     int n_threads) noexcept nogil:
    # dst (rows, ncols), contiguous = src's columns 0..ncols of rows of ld elements, widened
    cdef Py_ssize_t r
    n_threads = eff_threads(n_threads, <Py_ssize_t>rows * ncols, _grain)
    for r in prange(rows, schedule='static', num_threads=n_threads):
        llmctl_widen_bf16(dst + r * ncols, src + r * ld, ncols)


cdef float* _widened(const uint16_t* src, Py_ssize_t n, int n_threads) except NULL:
    cdef float* dst = <float*>malloc(<size_t>n * sizeof(float))
    if dst == NULL:
        raise MemoryError(f"matmul: cannot allocate {n * 4} bytes to widen a bf16 operand")
    with nogil:
        _widen(dst, src, n, n_threads)
    return dst


# The "blas" bf16 engine widens the bf16 weight WBLOCK rows at a time (<= 25 MB for d12), so it
# never holds an fp32 copy of a whole weight (the lm head's would be 154 MB)
cdef int WBLOCK = 2048


cdef void _forward_widened(float* out, const float* winp, const uint16_t* weight, float* wbuf,
                           const float* bias, int BT, int C, int OC, int n_threads) noexcept nogil:
    # out (BT,OC) = winp (BT,C) @ weight^T [+ bias], weight widened per block of rows into wbuf
    cdef float one = 1.0, zero = 0.0
    cdef float beta = zero
    cdef char ta = b'T', tb = b'N'
    cdef int o0, ob
    if bias != NULL:
        _fill_bias_rows(out, bias, BT, OC, n_threads)
        beta = one
    _ensure_blas_threads(n_threads)
    o0 = 0
    while o0 < OC:
        ob = OC - o0 if OC - o0 < WBLOCK else WBLOCK
        _widen(wbuf, weight + <Py_ssize_t>o0 * C, <Py_ssize_t>ob * C, n_threads)
        # column-major: out^T[o0:o0+ob, :] (ob,BT) = wblock (ob,C) @ winp^T (C,BT), ldc = OC
        sgemm(&ta, &tb, &ob, &BT, &C, &one, wbuf, &C, <float*>winp, &C, &beta, out + o0, &OC)
        o0 = o0 + ob


cdef void _backward_widened(float* dinp, float* dweight, const uint16_t* dout, float* wdout,
                            const float* winp, const uint16_t* weight, float* wbuf, int BT, int C,
                            int OC, float dinp_beta, float dw_beta, int n_threads) noexcept nogil:
    # per block of weight rows o0..o0+ob (= columns of dout, widened into wdout (BT,ob) so the
    # lm head's dout is never held whole in fp32): dinp = dinp_beta dinp + dout[:, blk] @ W[blk]
    # for the first block, += for the rest; dW[blk] = dw_beta dW[blk] + dout[:, blk]^T @ inp
    cdef float one = 1.0
    cdef float beta = dinp_beta
    cdef float wbeta = dw_beta
    cdef char tn = b'N', tt = b'T'
    cdef int o0, ob
    _ensure_blas_threads(n_threads)
    o0 = 0
    while o0 < OC:
        ob = OC - o0 if OC - o0 < WBLOCK else WBLOCK
        _widen_cols(wdout, dout + o0, BT, OC, ob, n_threads)
        if dinp != NULL:
            _widen(wbuf, weight + <Py_ssize_t>o0 * C, <Py_ssize_t>ob * C, n_threads)
            # column-major: dinp^T (C,BT) += wblock^T (C,ob) @ dout[:, blk]^T (ob,BT)
            sgemm(&tn, &tn, &C, &BT, &ob, &one, wbuf, &C, wdout, &ob, &beta, dinp, &C)
            beta = one
        # column-major: dW^T[:, blk] (C,ob) += inp^T (C,BT) @ dout[:, blk] (BT,ob)
        if dweight != NULL:
            sgemm(&tn, &tt, &C, &ob, &BT, &one, <float*>winp, &C, wdout, &ob, &wbeta,
                  dweight + <Py_ssize_t>o0 * C, &C)
        o0 = o0 + ob


cdef int _bf16_engine_id(engine) except -1:
    names = get_bf16_engines()
    if engine is None:
        engine = names[0]
    if engine in names:
        return {"dnnl": DNNL, "dnnl_gemm": DNNL_GEMM, "blas": BLAS}[engine]
    if engine in ("dnnl", "dnnl_gemm"):
        feats = cpu_bf16_features()
        why = ("oneDNN is not available: " + ", ".join(get_engines()) + " only") if "dnnl" not in get_engines() \
            else ("this CPU has no native bf16 (AVX512_BF16 or AMX)" if not feats else
                  "oneDNN's bf16 GEMM did not run on this CPU")
        raise ValueError(f"bf16 matmul engine {engine!r} is not available: {why}; choose one of {names}")
    raise ValueError(f"unknown bf16 matmul engine {engine!r}; choose one of {names}")


# decoding: at most this many rows go through gemv_bf16.h instead of oneDNN's bf16 GEMM (which
# packs the weight on every call). Measured on d12's layer shapes, weights streamed from memory:
# 1 row took 0.58-0.82x oneDNN's time on each; 2-4 rows 0.57-0.92x, but 1.04-1.09x on the lm
# head; 8 rows were mixed (0.80-1.34x). See docs/performance.md. Without native bf16 the GEMV's
# AVX2 copy takes those rows from the emulation (bf16 widened to fp32 for NumPy's sgemm), which
# copies and widens the whole weight on every call.
cdef int _gemv_rows = 4
GEMV_ISAS = ("off", "avx2", "avx512_bf16")   # index: _gemv_isa
cdef int _gemv_best = (2 if (_cpu_bf16_flags & 1) != 0 and llmctl_gemv_bf16_supported() != 0   # AVX512_BF16
                       else 1 if llmctl_gemv_bf16_avx2_supported() != 0 else 0)
cdef int _gemv_isa = _gemv_best
cdef enum:
    GEMV_BLOCK = 64      # output channels per task
# weight elements per thread (128 KB of bf16): below that one core is faster than two. With idle
# threads that sleep at once (OMP_WAIT_POLICY=passive) waking the second costs more than a d12
# layer's whole GEMV (1 thread 0.08-0.25 ms, 2 threads 0.16-0.44 ms per call); with llmctl's default
# spin before sleeping (llmctl/__init__.py) two threads took d12 bf16 decoding from 56 to 86 tokens/s
cdef Py_ssize_t _gemv_grain = 65536


# The "dnnl" bf16 engine runs every forward on oneDNN's matmul primitive, but the backward's
# products only where that was faster than the gemm call. Measured per product on d12's shapes
# (bench/gemm.py and docs/performance.md; 1 thread, CPU time, and 2 threads): the forward
# 1.0-2.2x; dW (K = B*T) 1.1-1.8x up to 512 rows, 0.6-0.95x from 1024 rows, where the gemm
# call's packing of the transposed dout pays off; dX 0.9-1.25x up to 512 rows, 0.83-0.98x above,
# and 0.4-0.7x at any size for the lm head (K = 50304). Those dX figures accumulate (the
# primitive's sum post-op); a dX written (accumulate=False, beta 0) with a short K is faster on
# the primitive at any rows: at 4096 rows, cold operands, K = 768 (attproj, fcproj) 3.1 / 14.6 ms
# against the gemm call's 5.3 / 18.6, K = 2304 even, K = 3072 (fc) 15.4 against 13.5.
# Those figures are an AMX Xeon's. On a Zen 4 (AVX512_BF16, no AMX) the primitive's dW is
# slower at 256 rows too (0.78-0.91x the gemm call's, bench/gemm.py), and a d12 B=4 T=64 bf16
# step ran 0.94x the time with dW (and the accumulated dX) on the gemm call; the written dX
# with a short K still gains on the primitive there at 4096 rows (the T=1024 step 1.03-1.07x
# slower without it). So dW has its own limit, picked by the CPU at import.
cdef int _prim_rows = 512
cdef int _prim_dw_rows = 512 if _cpu_bf16_flags & 2 else 0
cdef enum:
    PRIM_DX_K_MAX = 8192
    PRIM_DX_SHORT_K = 1024


def set_bf16_primitive_rows(int rows):
    """Run the "dnnl" engine's backward dX on the matmul primitive for at most `rows` rows
    (B*T), the gemm call above that, except a written dX (accumulate=False) with K <= 1024,
    which runs on the primitive at any rows (0: never). Returns the old value."""
    global _prim_rows
    old = _prim_rows
    _prim_rows = rows
    return old


def set_bf16_primitive_dw_rows(int rows):
    """Run the "dnnl" engine's dW on the matmul primitive for at most `rows` rows (B*T), the
    gemm call above that (0: never). The default: 512 on a CPU with AMX, 0 otherwise (see
    above). Returns the old value."""
    global _prim_dw_rows
    old = _prim_dw_rows
    _prim_dw_rows = rows
    return old


def set_gemv_grain(Py_ssize_t grain):
    """Weight elements the bf16 GEMV gives each thread at least (0: always n_threads). Returns
    the old value. Each output channel is computed by one thread: the bits do not depend on it."""
    global _gemv_grain
    old = _gemv_grain
    _gemv_grain = grain
    return old


def set_gemv_rows(int rows):
    """Use the bf16 GEMV for at most `rows` rows (0: never; oneDNN for every shape). Returns the old value."""
    global _gemv_rows
    old = _gemv_rows
    _gemv_rows = rows
    return old


def gemv_bf16_available(int rows=1):
    """True when matmul_forward_bf16 runs products of `rows` rows on gemv_bf16.h here."""
    return _gemv_isa != 0 and 1 <= rows <= _gemv_rows


def gemv_bf16_isa():
    """The gemv_bf16.h copy few-row bf16 products run on: "avx512_bf16" (vdpbf16ps), "avx2"
    (bf16 widened in registers, added in vdpbf16ps's order), or "off" (no AVX2 and FMA, or set
    off: the engine does those rows too)."""
    return GEMV_ISAS[_gemv_isa]


def gemv_bf16_isas():
    """The gemv_bf16.h copies this CPU runs, worst to best (for tests and benchmarks)."""
    return GEMV_ISAS[1:_gemv_best + 1]


def set_gemv_isa(name=None):
    """Run few-row bf16 products on this gemv_bf16.h copy (one of gemv_bf16_isas(), or "off";
    None: the best this CPU runs). Returns the old name."""
    global _gemv_isa
    old = GEMV_ISAS[_gemv_isa]
    if name is None:
        _gemv_isa = _gemv_best
    elif name == "off" or name in gemv_bf16_isas():
        _gemv_isa = GEMV_ISAS.index(name)
    else:
        raise ValueError(f"bf16 GEMV {name!r} does not run here; choose one of "
                         f"{('off',) + gemv_bf16_isas()}")
    return old


cdef void _gemv_bf16(float* out, const uint16_t* inp, const uint16_t* weight, const float* bias,
                     int R, int C, int OC, int n_threads) noexcept nogil:
    cdef Py_ssize_t nblk = (OC + GEMV_BLOCK - 1) // GEMV_BLOCK
    cdef Py_ssize_t blk, o0, o1
    n_threads = eff_threads(n_threads, <Py_ssize_t>OC * C, _gemv_grain)
    cdef int isa = _gemv_isa
    for blk in prange(nblk, schedule='static', num_threads=n_threads):
        o0 = blk * GEMV_BLOCK
        o1 = o0 + GEMV_BLOCK
        if o1 > OC:
            o1 = OC
        if isa == 2:
            llmctl_gemv_bf16(out, inp, weight, bias, R, C, OC, o0, o1)
        else:
            llmctl_gemv_bf16_avx2(out, inp, weight, bias, R, C, OC, o0, o1)


def matmul_forward_bf16(out, const uint16_t[::1] inp, const uint16_t[::1] weight, bias,
                        int BT, int C, int OC, int n_threads=1, engine=None):
    """out (BT,OC) = inp (BT,C) bf16 @ weight (OC,C)^T bf16 + bias (OC) fp32, accumulated in
    fp32. Overwrites out: float32, or uint16 for bf16 (the fp32 result rounded to nearest even;
    for an output that only feeds bf16 kernels, at half the bytes: oneDNN's primitive writes it
    so itself, the other paths round an fp32 result). bias may be None. On every engine,
    BT <= set_gemv_rows() rows (a decode step) run on gemv_bf16.h (gemv_bf16_isa()) instead."""
    cdef uint16_t[::1] out16
    cdef float[::1] tmp
    cdef const float* bias_ptr
    cdef int st = 0
    cdef int which
    if getattr(out, "dtype", None) != "uint16":
        _matmul_forward_bf16_f32(out, inp, weight, bias, BT, C, OC, n_threads, engine)
        return
    out16 = out
    which = _bf16_engine_id(engine)
    if which == DNNL and not (_gemv_isa and BT <= _gemv_rows):
        _check_sizes("out", out16.shape[0], inp.shape[0], weight.shape[0], BT, C, OC, n_threads)
        bias_ptr = _bias_ptr(bias, OC)
        with nogil:
            st = llmctl_dnnl_matmul_bf16_dst(b'N', b'T', BT, OC, C, &inp[0], C, &weight[0], C, bias_ptr,
                                             0.0, &out16[0], OC, 1, n_threads)
        _check_dnnl(st, "matmul_forward_bf16")
        return
    check_len("out", out16.shape[0], <Py_ssize_t>BT * OC)
    tmp = memoryview(bytearray(<Py_ssize_t>BT * OC * 4)).cast("f")
    _matmul_forward_bf16_f32(tmp, inp, weight, bias, BT, C, OC, n_threads, engine)
    with nogil:
        _convert(&out16[0], &tmp[0], <Py_ssize_t>BT * OC, n_threads)


cdef const float* _bias_ptr(bias, int OC) except? NULL:
    cdef const float[::1] bias_mv
    if bias is None:
        return NULL
    bias_mv = bias
    check_len("bias", bias_mv.shape[0], OC)
    return &bias_mv[0]


def _matmul_forward_bf16_f32(float[::1] out, const uint16_t[::1] inp, const uint16_t[::1] weight, bias,
                             int BT, int C, int OC, int n_threads=1, engine=None):
    cdef int which = _bf16_engine_id(engine)
    cdef const float[::1] bias_mv
    cdef const float* bias_ptr = NULL
    cdef float* winp = NULL
    cdef float* wweight = NULL
    cdef int st = 0
    _check_sizes("out", out.shape[0], inp.shape[0], weight.shape[0], BT, C, OC, n_threads)
    if bias is not None:
        bias_mv = bias
        check_len("bias", bias_mv.shape[0], OC)
        bias_ptr = &bias_mv[0]
        check_disjoint("out", &out[0], out.shape[0], "bias", bias_ptr, OC)
    if _gemv_isa and BT <= _gemv_rows:
        with nogil:
            _gemv_bf16(&out[0], &inp[0], &weight[0], bias_ptr, BT, C, OC, n_threads)
        return
    if which == DNNL:
        with nogil:
            st = llmctl_dnnl_matmul_bf16(b'N', b'T', BT, OC, C, &inp[0], C, &weight[0], C, bias_ptr,
                                         0.0, &out[0], OC, n_threads)
        _check_dnnl(st, "matmul_forward_bf16")
        return
    if which == DNNL_GEMM:
        with nogil:
            if bias_ptr != NULL:
                _fill_bias_rows(&out[0], bias_ptr, BT, OC, n_threads)
            st = llmctl_dnnl_gemm_bf16(b'N', b'T', BT, OC, C, &inp[0], C, &weight[0], C,
                                       1.0 if bias_ptr != NULL else 0.0, &out[0], OC, n_threads)
        _check_dnnl(st, "matmul_forward_bf16")
        return
    try:
        winp = _widened(&inp[0], <Py_ssize_t>BT * C, n_threads)
        wweight = <float*>malloc(<size_t>(OC if OC < WBLOCK else WBLOCK) * C * sizeof(float))
        if wweight == NULL:
            raise MemoryError("matmul_forward_bf16: cannot allocate the widening buffer")
        with nogil:
            _forward_widened(&out[0], winp, &weight[0], wweight, bias_ptr, BT, C, OC, n_threads)
    finally:
        free(winp)
        free(wweight)


def matmul_backward_bf16(dinp, dweight, dbias, dout, uint16_t[::1] dout_bf16,
                         const uint16_t[::1] inp, const uint16_t[::1] weight,
                         int BT, int C, int OC, int n_threads=1, engine=None, bint accumulate=True,
                         bint dweight_accumulate=True):
    """Accumulate in fp32: dinp (BT,C) += dout @ weight; dweight (OC,C) += dout^T @ inp;
    dbias (OC) += sum over BT of dout. inp, weight and the GEMMs' dout are bf16.
    accumulate=False: dinp = dout @ weight instead (the GEMM's beta 0: no zero fill before, and
    its old contents are not read); dweight and dbias still accumulate. dweight_accumulate=False:
    dweight = dout^T @ inp likewise (a beta-0 GEMM: the bits of += into zeros, up to the sign of a
    zero), the first write of a step's gradient with no zero fill before it.

    dout (BT,OC) fp32 given: this call first writes dout_bf16 = bf16(dout), in the same pass that
    sums dbias (from the fp32 values). dout None: dout_bf16 already holds the gradient (written
    by the kernel that produced it) and dbias must be None. dinp and dbias may be None (skipped).

    dinp may be uint16 (with accumulate=False): dout @ weight rounded to bf16 (nearest even, the
    bits cast_to_bf16 gives the fp32 result of the same engine; oneDNN's primitive writes it so
    itself, the other engines round an fp32 result), for a gradient that only feeds kernels
    reading it in bf16 (the GELU's backward, the attention's), at half the bytes.

    dweight may be None: dinp (and dbias) only, for a backward that needs dinp before the weight
    gradient's input exists (bf16's fused GELU recompute); a later call makes dweight."""
    cdef int which = _bf16_engine_id(engine)
    cdef float[::1] dinp_mv, dbias_mv, dw_mv
    cdef float* dw_ptr = NULL
    cdef const float[::1] dout_mv
    cdef float* dinp_ptr = NULL
    cdef float* dbias_ptr = NULL
    cdef float* wd = NULL
    cdef float* wi = NULL
    cdef float* ww = NULL
    cdef int st = 0
    cdef float dbeta = 1.0 if accumulate else 0.0
    cdef float wbeta = 1.0 if dweight_accumulate else 0.0
    cdef uint16_t[::1] dinp16
    cdef float[::1] tmp
    if dweight is not None:
        dw_mv = dweight
        check_len("dweight", dw_mv.shape[0], <Py_ssize_t>OC * C)
        dw_ptr = &dw_mv[0]
    if getattr(dinp, "dtype", None) == "uint16":
        if accumulate:
            raise ValueError("a bf16 (uint16) dinp is written, not accumulated: pass accumulate=False")
        dinp16 = dinp
        check_len("dinp", dinp16.shape[0], <Py_ssize_t>BT * C)
        if dw_ptr != NULL:
            check_disjoint("dinp", <float*>&dinp16[0], (<Py_ssize_t>BT * C + 1) // 2, "dweight", dw_ptr,
                           <Py_ssize_t>OC * C)
        if which == DNNL:
            matmul_backward_bf16(None, dweight, dbias, dout, dout_bf16, inp, weight, BT, C, OC, n_threads, engine,
                                 dweight_accumulate=dweight_accumulate)
            with nogil:
                st = llmctl_dnnl_matmul_bf16_dst(b'N', b'N', BT, C, OC, &dout_bf16[0], OC, &weight[0], C,
                                                 NULL, 0.0, &dinp16[0], C, 1, n_threads)
            _check_dnnl(st, "matmul_backward_bf16")
            return
        tmp = memoryview(bytearray(<Py_ssize_t>BT * C * 4)).cast("f")
        matmul_backward_bf16(tmp, dweight, dbias, dout, dout_bf16, inp, weight, BT, C, OC, n_threads, engine,
                             accumulate=False, dweight_accumulate=dweight_accumulate)
        with nogil:
            _convert(&dinp16[0], &tmp[0], <Py_ssize_t>BT * C, n_threads)
        return
    _check_sizes("dout_bf16", dout_bf16.shape[0], inp.shape[0], weight.shape[0], BT, C, OC, n_threads)
    if dinp is not None:
        dinp_mv = dinp
        check_len("dinp", dinp_mv.shape[0], <Py_ssize_t>BT * C)
        dinp_ptr = &dinp_mv[0]
        if dw_ptr != NULL:
            check_disjoint("dinp", dinp_ptr, <Py_ssize_t>BT * C, "dweight", dw_ptr, <Py_ssize_t>OC * C)
    if dbias is not None:
        if dout is None:
            raise ValueError("dbias needs the fp32 dout (pass dout, or dbias=None)")
        dbias_mv = dbias
        check_len("dbias", dbias_mv.shape[0], OC)
        dbias_ptr = &dbias_mv[0]
    if dout is not None:
        dout_mv = dout
        check_len("dout", dout_mv.shape[0], <Py_ssize_t>BT * OC)
        with nogil:
            _bias_grad(dbias_ptr, &dout_bf16[0], &dout_mv[0], BT, OC, n_threads)
    if which == DNNL:
        with nogil:
            # dinp (BT,C) += dout (BT,OC) @ weight (OC,C); dweight (OC,C) += dout^T @ inp (BT,C);
            # each on the matmul primitive or the gemm call, whichever is faster (see above)
            if dinp_ptr != NULL and _prim_rows > 0 and OC <= PRIM_DX_K_MAX and (
                    BT <= _prim_rows or (not accumulate and OC <= PRIM_DX_SHORT_K)):
                st = llmctl_dnnl_matmul_bf16(b'N', b'N', BT, C, OC, &dout_bf16[0], OC, &weight[0], C,
                                             NULL, dbeta, dinp_ptr, C, n_threads)
            elif dinp_ptr != NULL:
                st = llmctl_dnnl_gemm_bf16(b'N', b'N', BT, C, OC, &dout_bf16[0], OC, &weight[0], C,
                                           dbeta, dinp_ptr, C, n_threads)
            if st == 0 and dw_ptr != NULL and BT <= _prim_dw_rows:
                st = llmctl_dnnl_matmul_bf16(b'T', b'N', OC, C, BT, &dout_bf16[0], OC, &inp[0], C,
                                             NULL, wbeta, dw_ptr, C, n_threads)
            elif st == 0 and dw_ptr != NULL:
                st = llmctl_dnnl_gemm_bf16(b'T', b'N', OC, C, BT, &dout_bf16[0], OC, &inp[0], C,
                                           wbeta, dw_ptr, C, n_threads)
        _check_dnnl(st, "matmul_backward_bf16")
        return
    if which == DNNL_GEMM:
        with nogil:
            if dinp_ptr != NULL:
                st = llmctl_dnnl_gemm_bf16(b'N', b'N', BT, C, OC, &dout_bf16[0], OC, &weight[0], C,
                                           dbeta, dinp_ptr, C, n_threads)
            if st == 0 and dw_ptr != NULL:
                st = llmctl_dnnl_gemm_bf16(b'T', b'N', OC, C, BT, &dout_bf16[0], OC, &inp[0], C,
                                           wbeta, dw_ptr, C, n_threads)
        _check_dnnl(st, "matmul_backward_bf16")
        return
    try:
        wi = _widened(&inp[0], <Py_ssize_t>BT * C, n_threads)
        wd = <float*>malloc(<size_t>BT * (OC if OC < WBLOCK else WBLOCK) * sizeof(float))
        ww = <float*>malloc(<size_t>(OC if OC < WBLOCK else WBLOCK) * C * sizeof(float))
        if ww == NULL or wd == NULL:
            raise MemoryError("matmul_backward_bf16: cannot allocate the widening buffers")
        with nogil:
            _backward_widened(dinp_ptr, dw_ptr, &dout_bf16[0], wd, wi, &weight[0], ww, BT, C, OC,
                              dbeta, wbeta, n_threads)
    finally:
        free(wd)
        free(wi)
        free(ww)


def c_api():
    """The C kernels this module lends others (capi.pxd): "gemv_bf16", a few-row bf16 product on
    the GEMV copy set_gemv_isa() put in force (callers check gemv_bf16_available() first)."""
    return {"gemv_bf16": fn_capsule(<void*><gemv_bf16_fn>_gemv_bf16)}
