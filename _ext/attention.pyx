"""Causal multi-head self-attention, forward and backward, flash-attention style, in Cython.

What it is: the two attention kernels of GPT-2 training on CPU, with llm.c's semantics
(train_gpt2.c `attention_forward` / `attention_backward`): qkv (B,T,3C) holds Q in [0,C),
K in [C,2C), V in [2C,3C); head h uses channels [h*hs,(h+1)*hs), hs = C/NH; scores are
scaled by 1/sqrt(hs); query t attends to keys t2 <= t; out = softmax(scores) @ V.

What it is not: llm.c's memory layout. llm.c stores preatt and att, two (B,NH,T,T) tensors per
layer (about 20 GB at T=1024 for d12). Here the forward is an online softmax (running max and
sum over key tiles) that keeps only the per-row log-sum-exp `lse` (B,NH,T), and the backward
recomputes the probabilities from qkv and lse (flash-attention-2's recurrence:
D_i = dout_i.out_i, P_ij = exp(s_ij - lse_i), dS_ij = P_ij (dout_i.V_j - D_i)).
Scratch is O(T*hs) floats per thread; nothing of size T*T is ever allocated.

Parallelism and determinism: forward work items are (b, h, block of BR query rows), backward
work items are (b, h) pairs; each item writes only its own outputs and computes them with the
same sequence of float operations whatever thread runs it, so results are bit-identical for any
thread count (a stronger property than "deterministic for a fixed thread count").

Tiles: every product of two tiles (Q K^T, dout V^T, P V, P^T dout, dS^T Q, dS K) goes through one
register-blocked micro-kernel, `att_gemm_acc`, in _ext/attention_kernels.h. It is C with GCC/Clang
vector types (4 rows x 2 vectors of accumulators held in registers) because gcc does not
register-block the same loops written in Cython: it turns the k loop into an in-order scalar
reduction, ~8x slower. Each output element still sums over k in order from its initial value,
in the vector and the scalar paths alike, so the result does not depend on tile boundaries.
Other compilers (and -DATT_NO_VEC) get portable scalar C. Causality is handled per 4-row group:
each group only computes the keys its last row can see; the few masked entries inside a group
are zeroed.

Kernel sets (runtime dispatch): the micro-kernel and the vectorised exp (with the row max/sum
helpers) are compiled up to three times from one C template, and each attention call runs one
set, chosen through a table of function pointers:
  "default"  the build's baseline (SSE2 on x86-64 wheels; 4-wide; wider under LLMCTL_NATIVE=1),
  "avx2"     8-wide, avx2+fma, fused multiply-adds,        } x86 with GCC/Clang only, compiled
  "avx512"   16-wide, avx512f+fma, fused multiply-adds     } with target attributes, no -march
The best set this CPU runs (cpuid via __builtin_cpu_supports, which also checks the OS saves
the registers) is picked at import, or the one named by LLMCTL_ATT_ISA=default|avx2|avx512|auto
(read once; a bad value warns and falls back), or later by set_isa(). -DATT_NO_DISPATCH keeps
only "default". This is explicit per-target functions rather than target_clones because the sets
differ in vector width, not only in instruction selection.
Bits: every set runs the same float operations per output element in the same order (including
exp_sum's 16 lane partials, whatever the width), except that avx2/avx512 fuse a*b+c. So results
fall into two classes, each bit-identical across sets, widths and thread counts: {default, the
portable scalar build, a -march=native build} and {avx2, avx512}; the classes differ by
rounding only (~1e-7 relative). A fixed machine picks the same set every run, so a run is
reproducible; to reproduce bits on another machine, force the same class with LLMCTL_ATT_ISA.
Speed (bench/attention.py, d12 heads B=4 NH=12 hs=64, 1 thread, AMD EPYC (Zen 4), forward /
backward time of "default" over the set's): avx512 2.0x/2.2x at T=64, 2.7x/2.8x at T=256,
2.4x/2.7x at T=1024; avx2 1.9x/2.0x, 2.4x/2.3x, 2.1x/2.5x.

bf16 (attention_forward_bf16 / attention_backward_bf16, _ext/attention_bf16.h): the same
attention with its products on bf16 operands for the bf16 model. q, k, v and dout are rounded to
bf16 by each (batch, head) into its thread's scratch; P is rounded before P V and P^T dout, dS before
dS K and dS^T Q; every product is exact and summed in fp32; softmax, lse and D stay fp32 (the exp
is the "default" set's polynomial as a vectorisable loop, so LLMCTL_ATT_ISA does not change them). Work
items are (batch, head); 32-row blocks. The forward takes each block of query rows against all the
keys it sees in one product (keys x 32 scores in the thread's scratch), so its softmax is exact,
not online; the backward takes each block of keys against all the rows that see it. The products run on one
of three paths, picked at import from cpuid (and, for AMX, Linux's permission to use the tiles,
asked once with arch_prctl; refused -> AVX512_BF16) or by LLMCTL_ATT_BF16=emulated|avx512_bf16|amx
|auto, or set_bf16_path(): "amx" (TDPBF16PS tiles), "avx512_bf16" (VDPBF16PS), "emulated" (plain
C on fp32, the same rounding points, every CPU). They differ only in the order of fp32 additions;
"emulated" adds each pair in VDPBF16PS's documented order. Bit-identical for any thread count on
a given path. Scratch (O(T*hs) per thread: one head's bf16 rows and their layouts) is kept
between calls. Speed and the fp32/bf16 ratios: docs/performance.md.
"""
from cython.parallel cimport parallel, prange
from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc
from libc.math cimport INFINITY, logf, sqrtf
from libc.stdint cimport uint16_t
from libc.string cimport memcpy, memset

from _openmp cimport omp_get_thread_num  # index of the thread's slice of the scratch block
from kernels cimport check_disjoint, check_len, check_threads

cdef extern from "attention_kernels.h":
    ctypedef struct att_kern_t:
        pass
    enum:
        ATT_ISA_DEFAULT
        ATT_ISA_AVX2
        ATT_ISA_AVX512
        ATT_N_ISA
    int att_isa_compiled(int isa) noexcept nogil
    int att_isa_runs(int isa) noexcept nogil
    const att_kern_t* att_kern(int isa) noexcept nogil
    const char* att_kern_name(const att_kern_t* k) noexcept nogil
    int att_kern_width(const att_kern_t* k) noexcept nogil
    int att_kern_fma(const att_kern_t* k) noexcept nogil
    unsigned att_ran_take(int reset) noexcept nogil
    float att_expf(const att_kern_t* k, float x) noexcept nogil
    void att_exp_affine(const att_kern_t* k, float* x, Py_ssize_t n, float a, float b) noexcept nogil
    float att_scale_max(const att_kern_t* k, float* x, Py_ssize_t n, float a, float m0) noexcept nogil
    float att_exp_sum(const att_kern_t* k, float* x, Py_ssize_t n, float b) noexcept nogil
    void att_softmax_tile(const att_kern_t* k, float* S, Py_ssize_t ld, Py_ssize_t nr, Py_ssize_t nc,
                          Py_ssize_t first, float scale, float* m, float* l, float* acc,
                          Py_ssize_t hs) noexcept nogil
    void att_dsoftmax_tile(const att_kern_t* k, float* P, float* dS, Py_ssize_t ld, Py_ssize_t nr,
                           Py_ssize_t nc, Py_ssize_t first, float scale, const float* lse,
                           const float* D) noexcept nogil
    void att_transpose(const att_kern_t* k, float* dst, Py_ssize_t ldd, const float* src, Py_ssize_t lds,
                       Py_ssize_t rows, Py_ssize_t cols) noexcept nogil
    void att_gemm_acc(const att_kern_t* k, float* C, Py_ssize_t ldc, const float* A, Py_ssize_t sam,
                      Py_ssize_t sak, const float* B, Py_ssize_t ldb, Py_ssize_t M, Py_ssize_t N,
                      Py_ssize_t K) noexcept nogil

cdef extern from "dnnl_gemm.h" nogil:
    int llmctl_cpu_bf16_flags()

cdef extern from "attention_bf16.h" nogil:
    enum:
        ATTB_EMULATED
        ATTB_AVX512_BF16
        ATTB_AMX
        ATTB_N_PATH
    int attb_path_runs(int path, int bf16_flags)
    unsigned attb_ran_take(int reset)
    Py_ssize_t attb_forward_scratch_bytes(Py_ssize_t T, Py_ssize_t hs)
    Py_ssize_t attb_backward_scratch_bytes(Py_ssize_t T, Py_ssize_t hs)
    ctypedef struct attb_src:
        const float* qkv32
        const uint16_t* qkv16
        const float* dout
        const uint16_t* dout16
        const float* out
        const uint16_t* out16
    void attb_forward_head(float* out, uint16_t* out16, float* lse, const attb_src* src, Py_ssize_t b,
                           Py_ssize_t h, Py_ssize_t T, Py_ssize_t C, Py_ssize_t NH, void* scratch, int path)
    void attb_backward_head(float* dqkv, uint16_t* dqkv16, double* part, const attb_src* src,
                            const float* lse, Py_ssize_t b, Py_ssize_t h, Py_ssize_t T, Py_ssize_t C,
                            Py_ssize_t NH, void* scratch, int path, int acc)

# tile sizes: BR query rows per forward work item, BC keys per key tile, BQ query rows per
# backward block; the transposed (hs, BC) key/value tiles are 16 KB each at hs=64
cdef enum:
    BR = 32
    BC = 64
    BQ = 64
    MR = 4      # rows per micro-kernel call (matches att_gemm_acc's register block)

TILE_ROWS = BR
TILE_KEYS = BC


cdef inline Py_ssize_t _imin(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return a if a < b else b


cdef inline void _transpose_tile(float* dst, const float* src, Py_ssize_t ld,
                                 Py_ssize_t nc, Py_ssize_t hs, const att_kern_t* K) noexcept nogil:
    # dst[k*BC + c] = src[c*ld + k]: rows of K (or V) become columns, so a score tile is
    # (rows of Q) x (hs, BC) with contiguous BC-long rows on the B side of the micro-kernel
    att_transpose(K, dst, BC, src, ld, nc, hs)


# ----------------------------------------------------------------------------------------------
# forward

cdef inline Py_ssize_t _forward_scratch_floats(Py_ssize_t T, Py_ssize_t hs) noexcept nogil:
    # header (16) + the head's K^T tiles (hs * T rounded up to BC) and V rows (T*hs) + S (BR*BC)
    # + acc (BR*hs) + m (BR) + l (BR)
    return 16 + hs * ((T + BC - 1) // BC) * BC + T * hs + BR * BC + BR * hs + 2 * BR


cdef void _transpose_keys(float* kt, const float* kb, Py_ssize_t ld, Py_ssize_t j0, Py_ssize_t j1,
                          Py_ssize_t hs, const att_kern_t* K) noexcept nogil:
    # keys j0..j1-1 into kt, one (hs, BC) tile per BC keys: key j is column j % BC of tile j // BC
    cdef Py_ssize_t j = j0, n
    while j < j1:
        n = _imin(j1 - j, BC - j % BC)          # the keys of j's tile
        att_transpose(K, kt + (j // BC) * hs * BC + j % BC, BC, kb + j * ld, ld, n, hs)
        j = j + n


cdef inline void _pack_rows(float* dst, const float* src, Py_ssize_t ld, Py_ssize_t j0, Py_ssize_t j1,
                            Py_ssize_t hs) noexcept nogil:
    # rows j0..j1-1 of one head, hs floats each ld apart in qkv, to dst's contiguous (T, hs):
    # a micro-kernel's B operand read from qkv directly strides 3C floats per k, and those rows
    # fall into a few L1 sets and evict each other
    cdef Py_ssize_t j
    for j in range(j0, j1):
        memcpy(dst + j * hs, src + j * ld, hs * sizeof(float))


cdef void _forward_block(float* out, float* lse, const float* qkv,
                         Py_ssize_t b, Py_ssize_t h, Py_ssize_t i0, Py_ssize_t nr,
                         Py_ssize_t T, Py_ssize_t C, Py_ssize_t NH, float* scratch,
                         const att_kern_t* K) noexcept nogil:
    # out rows i0..i0+nr-1 of head h in batch b, and their lse; online softmax over key tiles.
    # The thread's K^T tiles stay in its scratch between blocks: its blocks of one head come in
    # order of i0, so each key is transposed once per head and thread, not once per block.
    cdef Py_ssize_t hs = C // NH
    cdef Py_ssize_t C3 = 3 * C
    cdef float scale = 1.0 / sqrtf(<float>hs)
    cdef const float* qb = qkv + b * T * C3 + h * hs
    cdef const float* kb = qb + C
    cdef const float* vb = qb + 2 * C
    cdef Py_ssize_t* held = <Py_ssize_t*>scratch    # [0]: b*NH+h whose keys kt holds, [1]: how many
    cdef float* ktall = scratch + 16
    cdef float* kt
    cdef float* vall = ktall + hs * ((T + BC - 1) // BC) * BC
    cdef float* S = vall + T * hs
    cdef float* acc = S + BR * BC
    cdef float* m = acc + BR * hs
    cdef float* l = m + BR
    cdef Py_ssize_t r, g, gb, gr, i, jt, j0, nc, ncg, k, kend = i0 + nr
    cdef float* a
    cdef float* orow
    cdef float inv

    if held[0] != b * NH + h or held[1] > kend:
        held[0] = b * NH + h
        held[1] = 0
    if held[1] < kend:
        _transpose_keys(ktall, kb, C3, held[1], kend, hs, K)
        _pack_rows(vall, vb, C3, held[1], kend, hs)
        held[1] = kend
    memset(acc, 0, nr * hs * sizeof(float))
    for r in range(nr):
        m[r] = -INFINITY
        l[r] = 0.0
    for jt in range((kend + BC - 1) // BC):
        j0 = jt * BC
        nc = _imin(BC, kend - j0)
        kt = ktall + jt * hs * BC
        memset(S, 0, nr * BC * sizeof(float))
        for gb in range((nr + MR - 1) // MR):    # scores, only up to the keys row g+gr-1 sees
            g = gb * MR
            gr = _imin(MR, nr - g)
            ncg = _imin(nc, i0 + g + gr - j0)
            if ncg > 0:
                att_gemm_acc(K, S + g * BC, BC, qb + (i0 + g) * C3, C3, 1, kt, BC, gr, ncg, hs)
        # online softmax: each S row becomes P (0 past the keys row i sees; a row that sees none
        # of the tile, possible where a 4-row group straddled j0, all 0), m, l and acc rescaled
        att_softmax_tile(K, S, BC, nr, nc, i0 + 1 - j0, scale, m, l, acc, hs)
        for gb in range((nr + MR - 1) // MR):    # acc += P V_tile
            g = gb * MR
            gr = _imin(MR, nr - g)
            ncg = _imin(nc, i0 + g + gr - j0)
            if ncg > 0:
                att_gemm_acc(K, acc + g * hs, hs, S + g * BC, BC, 1, vall + j0 * hs, hs, gr, hs, ncg)
    for r in range(nr):
        i = i0 + r
        inv = 1.0 / l[r]                         # l >= 1: the row max contributes exp(0)
        a = acc + r * hs
        orow = out + (b * T + i) * C + h * hs
        for k in range(hs):
            orow[k] = a[k] * inv
        lse[(b * NH + h) * T + i] = m[r] + logf(l[r])


cdef void attention_forward_c(float* out, float* lse, const float* qkv,
                              Py_ssize_t B, Py_ssize_t T, Py_ssize_t C, Py_ssize_t NH,
                              int n_threads, float* scratch, const att_kern_t* K) noexcept nogil:
    # out (B,T,C), lse (B,NH,T), qkv (B,T,3C); scratch: n_threads * _forward_scratch_floats(T, hs)
    cdef Py_ssize_t per_thread = _forward_scratch_floats(T, C // NH)
    cdef Py_ssize_t nqb = (T + BR - 1) // BR
    cdef Py_ssize_t nwork = B * NH * nqb
    cdef Py_ssize_t w, bh, qb, i0, nr
    cdef float* scr = NULL
    with parallel(num_threads=n_threads):
        scr = scratch + omp_get_thread_num() * per_thread
        (<Py_ssize_t*>scr)[0] = -1               # no head's keys held yet
        # chunksize 1: causal blocks grow in cost with qb; round-robin keeps threads balanced
        for w in prange(nwork, schedule='static', chunksize=1):
            bh = w // nqb
            qb = w - bh * nqb
            i0 = qb * BR
            nr = BR if T - i0 > BR else T - i0
            _forward_block(out, lse, qkv, bh // NH, bh % NH, i0, nr, T, C, NH, scr, K)


# ----------------------------------------------------------------------------------------------
# backward

cdef inline void _add_row(float* dst, const float* src, Py_ssize_t n, bint acc) noexcept nogil:
    # dst += src, or dst = src + 0 (= what adding into +0 gives, -0 included) without reading dst
    cdef Py_ssize_t k
    if acc:
        for k in range(n):
            dst[k] += src[k]
    else:
        for k in range(n):
            dst[k] = src[k] + <float>0.0

cdef inline Py_ssize_t _backward_scratch_floats(Py_ssize_t T, Py_ssize_t hs) noexcept nogil:
    # D (T) + dq (T*hs) + kt, vt (hs*BC each) + dk, dv (BC*hs each) + P, dS (BQ*BC each)
    # + the head's Q, K and dout rows packed (T*hs each)
    return T + T * hs + 4 * hs * BC + 2 * BQ * BC + 3 * T * hs


cdef void _backward_head(float* dqkv, const float* dout, const float* qkv, const float* out,
                         const float* lse, Py_ssize_t b, Py_ssize_t h,
                         Py_ssize_t T, Py_ssize_t C, Py_ssize_t NH, float* scratch,
                         const att_kern_t* K, bint acc_out) noexcept nogil:
    # dqkv += gradient for head h of batch b (acc_out 0: dqkv = 0 + gradient, the bits of adding
    # into zeros, without reading dqkv; every entry of the head's columns is written). Outer loop
    # over key tiles (their dK, dV stay in local accumulators), inner loop over blocks of the
    # queries that see the tile; dQ accumulates in scratch. Every accumulation runs in a fixed
    # order (key tile, then row).
    cdef Py_ssize_t hs = C // NH
    cdef Py_ssize_t C3 = 3 * C
    cdef float scale = 1.0 / sqrtf(<float>hs)
    cdef const float* qb = qkv + b * T * C3 + h * hs
    cdef const float* kb = qb + C
    cdef const float* vb = qb + 2 * C
    cdef float* dqb = dqkv + b * T * C3 + h * hs
    cdef float* dkb = dqb + C
    cdef float* dvb = dqb + 2 * C
    cdef const float* ob = out + b * T * C + h * hs
    cdef const float* dob = dout + b * T * C + h * hs
    cdef const float* lb = lse + (b * NH + h) * T
    cdef float* D = scratch
    cdef float* dq = D + T
    cdef float* kt = dq + T * hs
    cdef float* vt = kt + hs * BC
    cdef float* dk = vt + hs * BC
    cdef float* dv = dk + BC * hs
    cdef float* P = dv + BC * hs
    cdef float* dS = P + BQ * BC
    cdef float* qp = dS + BQ * BC                # Q, K, dout rows of this head, contiguous
    cdef float* kp = qp + T * hs
    cdef float* dop = kp + T * hs
    cdef Py_ssize_t i, i0, i0b, nr, g, gb, gr, jt, j0, nc, ncg, c, k, ks
    cdef float acc, a0, a1, a2, a3
    cdef const float* d0
    cdef const float* o0

    # D_i = dout_i . out_i (= sum_j P_ij dP_ij), each a sequential sum over k; four rows at a time
    # so that four chains of adds are in flight instead of one (the same operations per row)
    i = 0
    while i + 4 <= T:
        d0 = dob + i * C
        o0 = ob + i * C
        a0 = 0.0
        a1 = 0.0
        a2 = 0.0
        a3 = 0.0
        for k in range(hs):
            a0 = a0 + d0[k] * o0[k]
            a1 = a1 + d0[C + k] * o0[C + k]
            a2 = a2 + d0[2 * C + k] * o0[2 * C + k]
            a3 = a3 + d0[3 * C + k] * o0[3 * C + k]
        D[i] = a0
        D[i + 1] = a1
        D[i + 2] = a2
        D[i + 3] = a3
        i = i + 4
    while i < T:
        acc = 0.0
        for k in range(hs):
            acc = acc + dob[i * C + k] * ob[i * C + k]
        D[i] = acc
        i = i + 1
    memset(dq, 0, T * hs * sizeof(float))
    _pack_rows(qp, qb, C3, 0, T, hs)
    _pack_rows(kp, kb, C3, 0, T, hs)
    _pack_rows(dop, dob, C, 0, T, hs)
    for jt in range((T + BC - 1) // BC):
        j0 = jt * BC
        nc = _imin(BC, T - j0)
        _transpose_tile(kt, kp + j0 * hs, hs, nc, hs, K)
        _transpose_tile(vt, vb + j0 * C3, C3, nc, hs, K)
        memset(dk, 0, nc * hs * sizeof(float))
        memset(dv, 0, nc * hs * sizeof(float))
        for i0b in range((T - j0 + BQ - 1) // BQ):
            i0 = j0 + i0b * BQ
            nr = _imin(BQ, T - i0)
            memset(P, 0, nr * BC * sizeof(float))
            memset(dS, 0, nr * BC * sizeof(float))
            for gb in range((nr + MR - 1) // MR):  # S = Q K^T and dP = dout V^T, causal per group
                g = gb * MR
                gr = _imin(MR, nr - g)
                ncg = _imin(nc, i0 + g + gr - j0)
                att_gemm_acc(K, P + g * BC, BC, qp + (i0 + g) * hs, hs, 1, kt, BC, gr, ncg, hs)
                att_gemm_acc(K, dS + g * BC, BC, dop + (i0 + g) * hs, hs, 1, vt, BC, gr, ncg, hs)
            # the forward's score bits, P = exp(s - lse), then dS = P (dP - D) scale
            att_dsoftmax_tile(K, P, dS, BC, nr, nc, i0 + 1 - j0, scale, lb + i0, D + i0)
            for gb in range((nc + MR - 1) // MR):  # dV += P^T dout, dK += dS^T Q, over the rows
                g = gb * MR                           # that see keys j0+g.. (earlier rows: P = 0)
                gr = _imin(MR, nc - g)
                ks = j0 + g - i0
                if ks < 0:
                    ks = 0
                if ks >= nr:
                    continue
                att_gemm_acc(K, dv + g * hs, hs, P + ks * BC + g, 1, BC, dop + (i0 + ks) * hs, hs, gr, hs, nr - ks)
                att_gemm_acc(K, dk + g * hs, hs, dS + ks * BC + g, 1, BC, qp + (i0 + ks) * hs, hs, gr, hs, nr - ks)
            for gb in range((nr + MR - 1) // MR):  # dQ += dS K_tile
                g = gb * MR
                gr = _imin(MR, nr - g)
                ncg = _imin(nc, i0 + g + gr - j0)
                att_gemm_acc(K, dq + (i0 + g) * hs, hs, dS + g * BC, BC, 1, kp + j0 * hs, hs, gr, hs, ncg)
        for c in range(nc):
            _add_row(dkb + (j0 + c) * C3, dk + c * hs, hs, acc_out)
            _add_row(dvb + (j0 + c) * C3, dv + c * hs, hs, acc_out)
    for i in range(T):
        _add_row(dqb + i * C3, dq + i * hs, hs, acc_out)


cdef void attention_backward_c(float* dqkv, const float* dout, const float* qkv, const float* out,
                               const float* lse, Py_ssize_t B, Py_ssize_t T, Py_ssize_t C,
                               Py_ssize_t NH, int n_threads, float* scratch,
                               const att_kern_t* K, bint acc_out) noexcept nogil:
    # dqkv (B,T,3C) += (acc_out) or =; dout, out (B,T,C); lse (B,NH,T); scratch: n_threads *
    # _backward_scratch_floats
    cdef Py_ssize_t per_thread = _backward_scratch_floats(T, C // NH)
    cdef Py_ssize_t w, nwork = B * NH
    cdef float* scr = NULL
    with parallel(num_threads=n_threads):
        scr = scratch + omp_get_thread_num() * per_thread
        for w in prange(nwork, schedule='static'):
            _backward_head(dqkv, dout, qkv, out, lse, w // NH, w % NH, T, C, NH, scr, K, acc_out)


# ----------------------------------------------------------------------------------------------
# kernel set selection (runtime dispatch)

ISA_NAMES = ("default", "avx2", "avx512")    # index = ATT_ISA_* in attention_kernels.h
ISA_ENV = "LLMCTL_ATT_ISA"
cdef const att_kern_t* _kern = att_kern(ATT_ISA_DEFAULT)


def available_isas():
    """Kernel sets this build has compiled *and* this CPU can run, worst to best."""
    return [n for i, n in enumerate(ISA_NAMES) if att_isa_runs(i)]


def compiled_isas():
    """Kernel sets this build has compiled (x86 with GCC/Clang: all three; else only "default")."""
    return [n for i, n in enumerate(ISA_NAMES) if att_isa_compiled(i)]


def best_isa():
    """The set used unless told otherwise: the last of available_isas()."""
    names = available_isas()
    return names[len(names) - 1]     # (no negative index: wraparound is off)


def isa():
    """Name of the kernel set the next attention call will use."""
    return att_kern_name(_kern).decode()


def isa_info():
    """{"isa", "vector_width" (floats; 1 = scalar C), "fma"} of the active set."""
    return {"isa": isa(), "vector_width": att_kern_width(_kern), "fma": bool(att_kern_fma(_kern))}


def set_isa(name=None):
    """Use kernel set `name` ("default", "avx2", "avx512"; None or "auto": best_isa()) for
    subsequent calls; returns the previous name. Raises ValueError if the name is unknown or this
    build/CPU cannot run it. Not for use while another thread is inside an attention call (a call
    in flight keeps the set it started with). Results are bit-identical within {"default"} and
    within {"avx2", "avx512"} (the latter fuse multiply-adds), and differ by rounding between them."""
    global _kern
    prev = isa()
    i = _choose("kernel set", name, ISA_NAMES, [att_isa_runs(i) for i in range(len(ISA_NAMES))],
                best_isa(), lambda i: "this CPU lacks it" if att_isa_compiled(i) else "this build did not compile it")
    _kern = att_kern(i)
    return prev


# the selection of a kernel set (fp32) or of a path (bf16), shared by the two

def _choose(str kind, name, names, runs, best, why):
    """The index of `name` in `names` (None or "auto": `best`), or ValueError: unknown, or not
    available (runs[i] false) for why(i)."""
    if name is None or name == "auto":
        name = best
    if name not in names:
        raise ValueError(f"attention: unknown {kind} {name!r}; expected one of {', '.join(names)} or auto")
    i = names.index(name)
    if not runs[i]:
        raise ValueError(f"attention: {kind} {name!r} is not available ({why(i)}); "
                         f"available: {', '.join(n for n, r in zip(names, runs) if r)}")
    return i


def _ran_names(names, unsigned bits):
    return [n for i, n in enumerate(names) if bits & (1u << i)]


def _from_env(str env, setter, best):
    # read once at import; a bad value warns and falls back rather than breaking `import llmctl`
    import os
    import warnings
    want = os.environ.get(env, "").strip().lower() or None
    try:
        setter(want)
    except ValueError as e:
        warnings.warn(f"{e} (from {env}); using {best()!r}", RuntimeWarning, stacklevel=3)
        setter(None)


def _isa_ran(bint reset=False):
    """Names of the kernel sets whose micro-kernels ran since the last reset (test hook)."""
    return _ran_names(ISA_NAMES, att_ran_take(reset))


_from_env(ISA_ENV, set_isa, best_isa)


# ----------------------------------------------------------------------------------------------
# Python wrappers: validate sizes, allocate per-thread scratch, release the GIL

def _check_dims(int B, int T, int C, int NH, int n_threads):
    if B < 0 or T < 0:
        raise ValueError(f"attention: B and T must be >= 0, got B={B}, T={T}")
    if C < 1 or NH < 1:
        raise ValueError(f"attention: C and NH must be >= 1, got C={C}, NH={NH}")
    if C % NH != 0:
        raise ValueError(f"attention: C={C} is not divisible by NH={NH}")
    check_threads(n_threads)


cdef _check_disjoint(str out_name, const float[::1] o, str in_name, const float[::1] x):
    # outputs are written while inputs are still being read: an overlap would corrupt silently
    if o.shape[0] != 0 and x.shape[0] != 0:
        check_disjoint(out_name, &o[0], o.shape[0], in_name, &x[0], x.shape[0])


ctypedef fused qkv_t:     # the bf16 kernels' q, k, v: fp32, or already bf16 (uint16)
    float
    uint16_t


ctypedef fused aout_t:    # the bf16 attention's output: fp32, or bf16 (what attproj reads)
    float
    uint16_t


cdef int _check_apart(str a, const char* pa, Py_ssize_t na, str b, const char* pb, Py_ssize_t nb) except -1:
    # check_disjoint on byte ranges, for buffers of different element types
    if na != 0 and nb != 0 and pa < pb + nb and pb < pa + na:
        raise ValueError(f"{a} and {b} overlap in memory; they must not overlap: pass separate buffers")
    return 0


cdef void _src_qkv(attb_src* src, const qkv_t* qkv) noexcept nogil:
    src.qkv32, src.qkv16, src.dout, src.dout16, src.out, src.out16 = NULL, NULL, NULL, NULL, NULL, NULL
    if qkv_t is float:
        src.qkv32 = qkv
    else:
        src.qkv16 = qkv


def forward_scratch_bytes(int T, int C, int NH, int n_threads=1):
    """Bytes of scratch attention_forward allocates: O(T*hs) per thread (one head's K^T), never O(T*T)."""
    _check_dims(1, T, C, NH, n_threads)
    return n_threads * _forward_scratch_floats(T, C // NH) * sizeof(float)


def backward_scratch_bytes(int T, int C, int NH, int n_threads=1):
    """Bytes of scratch attention_backward allocates: O(T*hs) per thread, never O(T*T)."""
    _check_dims(1, T, C, NH, n_threads)
    return n_threads * _backward_scratch_floats(T, C // NH) * sizeof(float)


def attention_forward(float[::1] out, float[::1] lse, const float[::1] qkv,
                      int B, int T, int C, int NH, int n_threads=1):
    """out (B,T,C) = causal softmax(Q K^T / sqrt(hs)) V per head; lse (B,NH,T) = per-row log-sum-exp.

    qkv (B,T,3C) float32. out and lse are overwritten. Nothing of size T*T is allocated.
    Results are bit-identical for any n_threads.
    """
    _check_dims(B, T, C, NH, n_threads)
    cdef Py_ssize_t BT = <Py_ssize_t>B * T
    check_len("out", out.shape[0], BT * C, f"B*T*C = {B}*{T}*{C}")
    check_len("lse", lse.shape[0], BT * NH, f"B*NH*T = {B}*{NH}*{T}")
    check_len("qkv", qkv.shape[0], BT * 3 * C, f"B*T*3C = {B}*{T}*3*{C}")
    _check_disjoint("out", out, "qkv", qkv)
    _check_disjoint("out", out, "lse", lse)
    _check_disjoint("lse", lse, "qkv", qkv)
    if BT == 0:
        return
    cdef Py_ssize_t nwork = <Py_ssize_t>B * NH * ((T + BR - 1) // BR)
    cdef int nt = n_threads if n_threads < nwork else <int>nwork
    cdef const att_kern_t* K = _kern        # read once: a whole call runs on one kernel set
    cdef float* scratch = <float*>PyMem_RawMalloc(nt * _forward_scratch_floats(T, C // NH) * sizeof(float))
    if scratch == NULL:
        raise MemoryError("attention_forward: could not allocate scratch")
    try:
        with nogil:
            attention_forward_c(&out[0], &lse[0], &qkv[0], B, T, C, NH, nt, scratch, K)
    finally:
        PyMem_RawFree(scratch)


def attention_backward(float[::1] dqkv, const float[::1] dout, const float[::1] qkv,
                       const float[::1] out, const float[::1] lse,
                       int B, int T, int C, int NH, int n_threads=1, bint accumulate=True):
    """dqkv (B,T,3C) += d(loss)/d(qkv) given dout (B,T,C) and the forward's out (B,T,C), lse (B,NH,T).

    Probabilities are recomputed from qkv and lse (nothing T*T is stored or allocated).
    Accumulates into dqkv (llm.c's +=); accumulate=False writes the gradient over dqkv instead,
    with the bits of accumulating into zeros, and neither reads dqkv nor needs it zeroed first.
    Results are bit-identical for any n_threads.
    """
    _check_dims(B, T, C, NH, n_threads)
    cdef Py_ssize_t BT = <Py_ssize_t>B * T
    check_len("dqkv", dqkv.shape[0], BT * 3 * C, f"B*T*3C = {B}*{T}*3*{C}")
    check_len("dout", dout.shape[0], BT * C, f"B*T*C = {B}*{T}*{C}")
    check_len("qkv", qkv.shape[0], BT * 3 * C, f"B*T*3C = {B}*{T}*3*{C}")
    check_len("out", out.shape[0], BT * C, f"B*T*C = {B}*{T}*{C}")
    check_len("lse", lse.shape[0], BT * NH, f"B*NH*T = {B}*{NH}*{T}")
    _check_disjoint("dqkv", dqkv, "dout", dout)
    _check_disjoint("dqkv", dqkv, "qkv", qkv)
    _check_disjoint("dqkv", dqkv, "out", out)
    _check_disjoint("dqkv", dqkv, "lse", lse)
    if BT == 0:
        return
    cdef Py_ssize_t nwork = <Py_ssize_t>B * NH
    cdef int nt = n_threads if n_threads < nwork else <int>nwork
    cdef const att_kern_t* K = _kern
    cdef float* scratch = <float*>PyMem_RawMalloc(nt * _backward_scratch_floats(T, C // NH) * sizeof(float))
    if scratch == NULL:
        raise MemoryError("attention_backward: could not allocate scratch")
    try:
        with nogil:
            attention_backward_c(&dqkv[0], &dout[0], &qkv[0], &out[0], &lse[0],
                                 B, T, C, NH, nt, scratch, K, accumulate)
    finally:
        PyMem_RawFree(scratch)


def _expf(float[::1] x, bint vector=True):
    """x[i] = the active kernel set's exp(x[i]) in place, by its vector path (with a scalar tail)
    or by its scalar att_expf only; exposed for tests of its accuracy and of the two paths agreeing."""
    cdef Py_ssize_t i
    cdef const att_kern_t* K = _kern
    if x.shape[0] == 0:
        return
    with nogil:
        if vector:
            att_exp_affine(K, &x[0], x.shape[0], 1.0, 0.0)
        else:
            for i in range(x.shape[0]):
                x[i] = att_expf(K, x[i])


# ----------------------------------------------------------------------------------------------
# bf16: the same attention with its products on bf16 operands (_ext/attention_bf16.h)

BF16_PATHS = ("emulated", "avx512_bf16", "amx")   # index = ATTB_* in attention_bf16.h
BF16_ENV = "LLMCTL_ATT_BF16"
# asked once: cpuid, and for AMX Linux's permission to use the tile registers (arch_prctl)
cdef int _bf16_flags = llmctl_cpu_bf16_flags()
_bf16_runs = tuple(bool(attb_path_runs(i, _bf16_flags)) for i in range(ATTB_N_PATH))
cdef int _bf16 = ATTB_EMULATED


def bf16_available_paths():
    """bf16 paths this build and CPU run, worst to best ("emulated" runs everywhere)."""
    return [n for i, n in enumerate(BF16_PATHS) if _bf16_runs[i]]


def bf16_best_path():
    """The bf16 path used unless told otherwise: the last of bf16_available_paths()."""
    names = bf16_available_paths()
    return names[len(names) - 1]


def bf16_path():
    """Name of the path the next attention_*_bf16 call uses."""
    return BF16_PATHS[_bf16]


def set_bf16_path(name=None):
    """Use bf16 path `name` ("emulated", "avx512_bf16", "amx"; None or "auto": bf16_best_path())
    for subsequent attention_*_bf16 calls; returns the previous name. Raises ValueError if the
    name is unknown or this build/CPU cannot run it. The paths compute the same values up to the
    order of fp32 additions (attention_bf16.h)."""
    global _bf16
    prev = bf16_path()
    _bf16 = _choose("bf16 path", name, BF16_PATHS, _bf16_runs, bf16_best_path(),
                    lambda i: "this CPU or build cannot run it")
    return prev


def _bf16_ran(bint reset=False):
    """Names of the bf16 paths that ran since the last reset (test hook)."""
    return _ran_names(BF16_PATHS, attb_ran_take(reset))


_from_env(BF16_ENV, set_bf16_path, bf16_best_path)


cdef inline Py_ssize_t _align64(Py_ssize_t n) noexcept nogil:
    return (n + 63) // 64 * 64


# The bf16 kernels' scratch (a few hundred KB per thread) is kept between calls: a fresh
# allocation of that size is a fresh mmap, and faulting its pages in cost as much as the GEMMs
# at T <= 256. A call made while another holds it (two Python threads) allocates its own.
cdef char* _scratch = NULL
cdef Py_ssize_t _scratch_size = 0
cdef bint _scratch_busy = False


cdef char* _take_scratch(Py_ssize_t n, bint* own) except NULL:
    # 64-byte aligned; *own: the caller frees it (not the cached block)
    global _scratch, _scratch_size, _scratch_busy
    cdef char* p
    if _scratch_busy:
        p = <char*>PyMem_RawMalloc(n + 64)
        if p == NULL:
            raise MemoryError(f"attention bf16: could not allocate {n} bytes of scratch")
        own[0] = True
        return p
    if _scratch_size < n:
        PyMem_RawFree(_scratch)
        _scratch, _scratch_size = NULL, 0
        _scratch = <char*>PyMem_RawMalloc(n + 64)
        if _scratch == NULL:
            raise MemoryError(f"attention bf16: could not allocate {n} bytes of scratch")
        _scratch_size = n
    _scratch_busy = True
    own[0] = False
    return _scratch


cdef void _give_scratch(char* p, bint own) noexcept:
    global _scratch_busy
    if own:
        PyMem_RawFree(p)
    else:
        _scratch_busy = False


def bf16_forward_scratch_bytes(int B, int T, int C, int NH, int n_threads=1):
    """Bytes of scratch attention_forward_bf16 uses: O(T*hs) per thread (one head's bf16 rows and
    their layouts, the block buffers); never O(T*T), nothing per batch row. Kept between calls."""
    _check_dims(B, T, C, NH, n_threads)
    return n_threads * _align64(attb_forward_scratch_bytes(T, C // NH))


def bf16_backward_scratch_bytes(int B, int T, int C, int NH, int n_threads=1):
    """Bytes of scratch attention_backward_bf16 uses: O(T*hs) per thread (one head's bf16 rows of
    q, k, v and dout, their layouts, D, dQ, the block buffers); never O(T*T). Kept between calls
    (with dbias the call also takes B*NH*3*hs doubles of column sums)."""
    _check_dims(B, T, C, NH, n_threads)
    return n_threads * _align64(attb_backward_scratch_bytes(T, C // NH))


def attention_forward_bf16(aout_t[::1] out, float[::1] lse, const qkv_t[::1] qkv,
                           int B, int T, int C, int NH, int n_threads=1):
    """attention_forward with bf16 products: q, k, v and the probabilities rounded to bf16,
    fp32 accumulation and softmax (attention_bf16.h). Same arguments, outputs and semantics;
    qkv may also be given in bf16 (uint16: what matmul_forward_bf16 writes for the qkv layer),
    the same bits as its fp32 values; out may be uint16: the output rounded to bf16 (nearest
    even, as convert.cast_to_bf16), what the attproj matmul and attention_backward_bf16 read.

    Work items are (batch, head) pairs, each computed the same way whatever thread runs it, so
    results are bit-identical for any n_threads (on a given path).
    """
    _check_dims(B, T, C, NH, n_threads)
    cdef Py_ssize_t BT = <Py_ssize_t>B * T
    check_len("out", out.shape[0], BT * C, f"B*T*C = {B}*{T}*{C}")
    check_len("lse", lse.shape[0], BT * NH, f"B*NH*T = {B}*{NH}*{T}")
    check_len("qkv", qkv.shape[0], BT * 3 * C, f"B*T*3C = {B}*{T}*3*{C}")
    if BT == 0:
        return
    _check_apart("out", <const char*>&out[0], out.nbytes, "qkv", <const char*>&qkv[0], qkv.nbytes)
    _check_apart("out", <const char*>&out[0], out.nbytes, "lse", <const char*>&lse[0], lse.nbytes)
    _check_apart("lse", <const char*>&lse[0], lse.nbytes, "qkv", <const char*>&qkv[0], qkv.nbytes)
    cdef float* o32 = NULL
    cdef uint16_t* o16 = NULL
    if aout_t is float:
        o32 = &out[0]
    else:
        o16 = &out[0]
    cdef Py_ssize_t nwork = <Py_ssize_t>B * NH
    cdef int nt = n_threads if n_threads < nwork else <int>nwork
    cdef int path = _bf16
    cdef Py_ssize_t per = _align64(attb_forward_scratch_bytes(T, C // NH))
    cdef bint own = False
    cdef char* scratch = _take_scratch(nt * per, &own)
    cdef char* base
    cdef attb_src src
    cdef Py_ssize_t w
    _src_qkv(&src, &qkv[0])
    base = scratch + (64 - (<size_t>scratch) % 64) % 64
    try:
        with nogil, parallel(num_threads=nt):
            for w in prange(nwork, schedule='static', chunksize=1):
                attb_forward_head(o32, o16, &lse[0], &src, w // NH, w % NH, T, C, NH,
                                  base + omp_get_thread_num() * per, path)
    finally:
        _give_scratch(scratch, own)


def attention_backward_bf16(dqkv, dout, const qkv_t[::1] qkv,
                            const aout_t[::1] out, const float[::1] lse,
                            int B, int T, int C, int NH, int n_threads=1, bint accumulate=True,
                            dbias=None):
    """attention_backward with bf16 products: q, k, v, dout, P and dS rounded to bf16, fp32
    accumulation (attention_bf16.h). Same arguments and semantics (dqkv +=); out and lse are
    those of attention_forward_bf16. Bit-identical for any n_threads (on a given path).
    accumulate=False: dqkv is written instead (the same bits as zeroing it first; its old
    contents are not read). qkv and out fp32 or bf16, as attention_forward_bf16 takes and
    writes them (D = dout . out then reads out rounded).
    dqkv may be uint16 (with accumulate=False): the gradient rounded to bf16 (nearest even, the
    bits convert.cast_to_bf16 gives the fp32 one), what the qkv layer's backward GEMMs read.
    dbias (3C float32, or None): += the column sums of the fp32 gradient (the qkv layer's bias
    gradient), in double: each batch row's T rows in order, then the batch rows in order.
    dout may be uint16: bf16 already (matmul_backward_bf16's bf16 dinp), the same bits as the
    fp32 dout it rounds.
    """
    _check_dims(B, T, C, NH, n_threads)
    cdef Py_ssize_t BT = <Py_ssize_t>B * T
    cdef float[::1] d32
    cdef uint16_t[::1] d16
    cdef float[::1] db
    cdef float* dq32 = NULL
    cdef uint16_t* dq16 = NULL
    cdef const char* dptr
    cdef const float[::1] dout32
    cdef const uint16_t[::1] dout16
    cdef const float* do32 = NULL
    cdef const uint16_t* do16 = NULL
    cdef Py_ssize_t dout_n, dout_bytes
    if getattr(dout, "dtype", None) == "uint16":
        dout16 = dout
        dout_n, dout_bytes = dout16.shape[0], dout16.shape[0] * 2
        if dout_n:
            do16 = &dout16[0]
    else:
        dout32 = dout
        dout_n, dout_bytes = dout32.shape[0], dout32.shape[0] * 4
        if dout_n:
            do32 = &dout32[0]
    if getattr(dqkv, "dtype", None) == "uint16":
        if accumulate:
            raise ValueError("a bf16 (uint16) dqkv is written, not accumulated: pass accumulate=False")
        d16 = dqkv
        check_len("dqkv", d16.shape[0], BT * 3 * C, f"B*T*3C = {B}*{T}*3*{C}")
        dq16 = &d16[0] if BT else NULL
        dptr = <const char*>dq16
    else:
        d32 = dqkv
        check_len("dqkv", d32.shape[0], BT * 3 * C, f"B*T*3C = {B}*{T}*3*{C}")
        dq32 = &d32[0] if BT else NULL
        dptr = <const char*>dq32
    cdef Py_ssize_t dbytes = BT * 3 * C * (2 if dq16 != NULL else 4)
    if dbias is not None:
        db = dbias
        check_len("dbias", db.shape[0], 3 * C, f"3C = 3*{C}")
    check_len("dout", dout_n, BT * C, f"B*T*C = {B}*{T}*{C}")
    check_len("qkv", qkv.shape[0], BT * 3 * C, f"B*T*3C = {B}*{T}*3*{C}")
    check_len("out", out.shape[0], BT * C, f"B*T*C = {B}*{T}*{C}")
    check_len("lse", lse.shape[0], BT * NH, f"B*NH*T = {B}*{NH}*{T}")
    if BT == 0:
        return
    _check_apart("dqkv", dptr, dbytes, "dout", <const char*>do32 if do32 != NULL else <const char*>do16,
                 dout_bytes)
    _check_apart("dqkv", dptr, dbytes, "lse", <const char*>&lse[0], lse.nbytes)
    _check_apart("dqkv", dptr, dbytes, "qkv", <const char*>&qkv[0], qkv.nbytes)
    _check_apart("dqkv", dptr, dbytes, "out", <const char*>&out[0], out.nbytes)
    if dbias is not None:
        _check_apart("dbias", <const char*>&db[0], db.nbytes, "dqkv", dptr, dbytes)
    cdef const float* o32 = NULL
    cdef const uint16_t* o16 = NULL
    if aout_t is float:
        o32 = &out[0]
    else:
        o16 = &out[0]
    cdef Py_ssize_t nwork = <Py_ssize_t>B * NH
    cdef int nt = n_threads if n_threads < nwork else <int>nwork
    cdef int path = _bf16
    cdef Py_ssize_t hs = C // NH
    cdef Py_ssize_t per = _align64(attb_backward_scratch_bytes(T, hs))
    cdef Py_ssize_t nparts = nwork * 3 * hs if dbias is not None else 0   # doubles: (b, h, q/k/v, d)
    cdef bint own = False
    cdef char* scratch = _take_scratch(nt * per + nparts * 8, &own)
    cdef char* base
    cdef attb_src src
    cdef double* parts = NULL
    cdef double acc
    cdef Py_ssize_t w, bb, hh, k, d
    _src_qkv(&src, &qkv[0])
    src.dout, src.dout16, src.out, src.out16 = do32, do16, o32, o16
    base = scratch + (64 - (<size_t>scratch) % 64) % 64
    if nparts:
        parts = <double*>(base + nt * per)
        memset(parts, 0, nparts * 8)
    try:
        with nogil:
            with parallel(num_threads=nt):
                for w in prange(nwork, schedule='static', chunksize=1):
                    attb_backward_head(dq32, dq16, parts + w * 3 * hs if parts != NULL else NULL,
                                       &src, &lse[0], w // NH, w % NH, T, C, NH,
                                       base + omp_get_thread_num() * per, path, accumulate)
            if parts != NULL:    # the batch rows' sums, in order: the bits do not depend on threads
                for hh in range(NH):
                    for k in range(3):
                        for d in range(hs):
                            acc = 0.0
                            for bb in range(B):
                                acc = acc + parts[((bb * NH + hh) * 3 + k) * hs + d]
                            db[k * C + hh * hs + d] += <float>acc
    finally:
        _give_scratch(scratch, own)
