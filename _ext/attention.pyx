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
register-blocked micro-kernel, `att_gemm_acc`, in the C block below. It is C with GCC/Clang
vector types (4 rows x 2 vectors of accumulators held in registers) because gcc does not
register-block the same loops written in Cython: it turns the k loop into an in-order scalar
reduction, ~8x slower. Each output element still sums over k in order from its initial value,
in the vector and the scalar paths alike, so the result does not depend on tile boundaries.
Other compilers get the scalar loops. Causality is handled per 4-row group: each group only
computes the keys its last row can see; the few masked entries inside a group are zeroed.
"""
from cython.parallel cimport parallel, prange
from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc
from libc.math cimport INFINITY, logf, sqrtf
from libc.stdint cimport uintptr_t
from libc.string cimport memset

from _openmp cimport omp_get_thread_num  # index of the thread's slice of the scratch block

cdef extern from *:
    """
    #include <stddef.h>
    #include <stdint.h>
    #include <string.h>
    #if (defined(__GNUC__) || defined(__clang__)) && !defined(ATT_NO_VEC)  /* -DATT_NO_VEC: test the scalar path */
    #define ATT_VEC 1
    #ifdef __AVX__
    #define ATT_VW 8   /* floats per vector register */
    #else
    #define ATT_VW 4
    #endif
    typedef float att_vf __attribute__((vector_size(ATT_VW * 4)));
    static inline att_vf att_load(const float* p) { att_vf v; memcpy(&v, p, sizeof v); return v; }
    static inline void att_store(float* p, att_vf v) { memcpy(p, &v, sizeof v); }
    #endif

    /* C[m*ldc + n] += sum_{k<K} A[m*sam + k*sak] * B[k*ldb + n]   for m < M, n < N.
       A has arbitrary strides (so A^T costs nothing); rows of B and C are contiguous. */
    static void att_gemm_acc(float* C, ptrdiff_t ldc, const float* A, ptrdiff_t sam, ptrdiff_t sak,
                             const float* B, ptrdiff_t ldb, ptrdiff_t M, ptrdiff_t N, ptrdiff_t K)
    {
        ptrdiff_t m = 0, n, k, r;
    #ifdef ATT_VEC
        for (; m + 4 <= M; m += 4) {
            const float* a = A + m * sam;
            float* c = C + m * ldc;
            for (n = 0; n + 2 * ATT_VW <= N; n += 2 * ATT_VW) {
                float* c0 = c + n; float* c1 = c0 + ldc; float* c2 = c1 + ldc; float* c3 = c2 + ldc;
                att_vf x00 = att_load(c0), x01 = att_load(c0 + ATT_VW);
                att_vf x10 = att_load(c1), x11 = att_load(c1 + ATT_VW);
                att_vf x20 = att_load(c2), x21 = att_load(c2 + ATT_VW);
                att_vf x30 = att_load(c3), x31 = att_load(c3 + ATT_VW);
                for (k = 0; k < K; k++) {
                    const float* bk = B + k * ldb + n;
                    const float* ak = a + k * sak;
                    att_vf b0 = att_load(bk), b1 = att_load(bk + ATT_VW);
                    float a0 = ak[0], a1 = ak[sam], a2 = ak[2 * sam], a3 = ak[3 * sam];
                    x00 += a0 * b0; x01 += a0 * b1;
                    x10 += a1 * b0; x11 += a1 * b1;
                    x20 += a2 * b0; x21 += a2 * b1;
                    x30 += a3 * b0; x31 += a3 * b1;
                }
                att_store(c0, x00); att_store(c0 + ATT_VW, x01);
                att_store(c1, x10); att_store(c1 + ATT_VW, x11);
                att_store(c2, x20); att_store(c2 + ATT_VW, x21);
                att_store(c3, x30); att_store(c3 + ATT_VW, x31);
            }
            for (; n + ATT_VW <= N; n += ATT_VW) {
                float* c0 = c + n; float* c1 = c0 + ldc; float* c2 = c1 + ldc; float* c3 = c2 + ldc;
                att_vf x0 = att_load(c0), x1 = att_load(c1), x2 = att_load(c2), x3 = att_load(c3);
                for (k = 0; k < K; k++) {
                    const float* ak = a + k * sak;
                    att_vf b0 = att_load(B + k * ldb + n);
                    x0 += ak[0] * b0; x1 += ak[sam] * b0; x2 += ak[2 * sam] * b0; x3 += ak[3 * sam] * b0;
                }
                att_store(c0, x0); att_store(c1, x1); att_store(c2, x2); att_store(c3, x3);
            }
            for (; n < N; n++) {
                for (r = 0; r < 4; r++) {
                    float s = c[r * ldc + n];
                    for (k = 0; k < K; k++) s = s + a[r * sam + k * sak] * B[k * ldb + n];
                    c[r * ldc + n] = s;
                }
            }
        }
    #endif
        for (; m < M; m++) {
            const float* a = A + m * sam;
            float* c = C + m * ldc;
            n = 0;
    #ifdef ATT_VEC
            for (; n + ATT_VW <= N; n += ATT_VW) {
                att_vf x0 = att_load(c + n);
                for (k = 0; k < K; k++) x0 += a[k * sak] * att_load(B + k * ldb + n);
                att_store(c + n, x0);
            }
    #endif
            for (; n < N; n++) {
                float s = c[n];
                for (k = 0; k < K; k++) s = s + a[k * sak] * B[k * ldb + n];
                c[n] = s;
            }
        }
    }

    /* exp(x) for x <= 88: Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then Cephes'
       degree-6 polynomial for exp(r); <= 1 ulp on [-87.3, 0] (tests/test_attention.py checks).
       x < ln(FLT_MIN) = -87.34 gives 0 (no denormals; exp(-inf) = 0 as for expf); NaN
       propagates. Scores enter as s - max <= 0 (or s*scale - lse ~<= 0): x > 88 never occurs.
       Written twice, scalar and vector, with the same operations so both give the same bits;
       glibc's expf is a scalar call, and gcc will not if-convert the clamps of a scalar loop. */
    static inline float att_expf(float x)
    {
        float xc = x < -87.33654f ? -87.33654f : (x > 88.0f ? 88.0f : x);
        float t = xc * 1.44269504088896341f + 12582912.0f;  /* + 1.5*2^23 rounds to nearest */
        float n = t - 12582912.0f;
        uint32_t ti, bits;
        float r, y, pow2n;
        memcpy(&ti, &t, 4);
        r = xc - n * 0.693359375f;
        r = r - n * -2.12194440e-4f;
        y = 1.9875691500e-4f;
        y = y * r + 1.3981999507e-3f;
        y = y * r + 8.3334519073e-3f;
        y = y * r + 4.1665795894e-2f;
        y = y * r + 1.6666665459e-1f;
        y = y * r + 5.0000001201e-1f;
        y = y * (r * r) + r + 1.0f;
        bits = (ti - 0x4B400000u + 127u) << 23;          /* 2^n, n in [-126, 127] */
        memcpy(&pow2n, &bits, 4);
        y = y * pow2n;
        return x < -87.33654f ? 0.0f : y;
    }
    #ifdef ATT_VEC
    typedef uint32_t att_vu __attribute__((vector_size(ATT_VW * 4)));
    static inline att_vf att_set1(float a) { att_vf v = {0}; return v + a; }
    static inline att_vf att_expv(att_vf x)
    {
        const att_vf lo = att_set1(-87.33654f), hi = att_set1(88.0f);
        att_vu below = (att_vu)(x < lo), above = (att_vu)(x > hi);    /* all-ones lanes */
        att_vf xc = (att_vf)((below & (att_vu)lo) | (~below & (att_vu)x));
        xc = (att_vf)((above & (att_vu)hi) | (~above & (att_vu)xc));
        att_vf t = xc * 1.44269504088896341f + 12582912.0f;
        att_vf n = t - 12582912.0f;
        att_vf r = xc - n * 0.693359375f;
        att_vf y;
        att_vu bits;
        r = r - n * -2.12194440e-4f;
        y = att_set1(1.9875691500e-4f);
        y = y * r + 1.3981999507e-3f;
        y = y * r + 8.3334519073e-3f;
        y = y * r + 4.1665795894e-2f;
        y = y * r + 1.6666665459e-1f;
        y = y * r + 5.0000001201e-1f;
        y = y * (r * r) + r + 1.0f;
        bits = ((att_vu)t - 0x4B400000u + 127u) << 23;
        y = y * (att_vf)bits;
        return (att_vf)(~below & (att_vu)y);
    }
    #endif
    /* x[i] *= a; returns max(m0, max_i x[i]) (NaNs are skipped, as by `if (v > m) m = v`) */
    static float att_scale_max(float* x, ptrdiff_t n, float a, float m0)
    {
        ptrdiff_t i = 0;
        float m = m0;
    #ifdef ATT_VEC
        if (n >= ATT_VW) {
            att_vf vm = att_set1(m0);
            for (; i + ATT_VW <= n; i += ATT_VW) {
                att_vf v = att_load(x + i) * a;
                att_vu gt = (att_vu)(v > vm);
                vm = (att_vf)((gt & (att_vu)v) | (~gt & (att_vu)vm));
                att_store(x + i, v);
            }
            for (int j = 0; j < ATT_VW; j++) if (vm[j] > m) m = vm[j];
        }
    #endif
        for (; i < n; i++) {
            float v = x[i] * a;
            x[i] = v;
            if (v > m) m = v;
        }
        return m;
    }
    /* x[i] = exp(x[i] - b); returns the sum of the new x (lane partials, then a fixed-order
       combine: the order depends only on n) */
    static float att_exp_sum(float* x, ptrdiff_t n, float b)
    {
        ptrdiff_t i = 0;
        float s = 0.0f;
    #ifdef ATT_VEC
        if (n >= ATT_VW) {
            att_vf vs = att_set1(0.0f);
            for (; i + ATT_VW <= n; i += ATT_VW) {
                att_vf e = att_expv(att_load(x + i) - b);
                att_store(x + i, e);
                vs += e;
            }
            for (int j = 0; j < ATT_VW; j++) s += vs[j];
        }
    #endif
        for (; i < n; i++) {
            x[i] = att_expf(x[i] - b);
            s += x[i];
        }
        return s;
    }
    /* x[i] = exp(a * x[i] - b) */
    static void att_exp_affine(float* x, ptrdiff_t n, float a, float b)
    {
        ptrdiff_t i = 0;
    #ifdef ATT_VEC
        for (; i + ATT_VW <= n; i += ATT_VW) att_store(x + i, att_expv(att_load(x + i) * a - b));
    #endif
        for (; i < n; i++) x[i] = att_expf(x[i] * a - b);
    }
    """
    float att_expf(float x) noexcept nogil
    void att_exp_affine(float* x, Py_ssize_t n, float a, float b) noexcept nogil
    float att_scale_max(float* x, Py_ssize_t n, float a, float m0) noexcept nogil
    float att_exp_sum(float* x, Py_ssize_t n, float b) noexcept nogil
    void att_gemm_acc(float* C, Py_ssize_t ldc, const float* A, Py_ssize_t sam, Py_ssize_t sak,
                      const float* B, Py_ssize_t ldb, Py_ssize_t M, Py_ssize_t N, Py_ssize_t K) noexcept nogil

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
                                 Py_ssize_t nc, Py_ssize_t hs) noexcept nogil:
    # dst[k*BC + c] = src[c*ld + k]: rows of K (or V) become columns, so a score tile is
    # (rows of Q) x (hs, BC) with contiguous BC-long rows on the B side of the micro-kernel
    cdef Py_ssize_t c, k
    cdef const float* row
    for c in range(nc):
        row = src + c * ld
        for k in range(hs):
            dst[k * BC + c] = row[k]


# ----------------------------------------------------------------------------------------------
# forward

cdef inline Py_ssize_t _forward_scratch_floats(Py_ssize_t hs) noexcept nogil:
    # kt (hs*BC) + S (BR*BC) + acc (BR*hs) + m (BR) + l (BR)
    return hs * BC + BR * BC + BR * hs + 2 * BR


cdef void _forward_block(float* out, float* lse, const float* qkv,
                         Py_ssize_t b, Py_ssize_t h, Py_ssize_t i0, Py_ssize_t nr,
                         Py_ssize_t T, Py_ssize_t C, Py_ssize_t NH, float* scratch) noexcept nogil:
    # out rows i0..i0+nr-1 of head h in batch b, and their lse; online softmax over key tiles
    cdef Py_ssize_t hs = C // NH
    cdef Py_ssize_t C3 = 3 * C
    cdef float scale = 1.0 / sqrtf(<float>hs)
    cdef const float* qb = qkv + b * T * C3 + h * hs
    cdef const float* kb = qb + C
    cdef const float* vb = qb + 2 * C
    cdef float* kt = scratch
    cdef float* S = kt + hs * BC
    cdef float* acc = S + BR * BC
    cdef float* m = acc + BR * hs
    cdef float* l = m + BR
    cdef Py_ssize_t r, g, gb, gr, i, jt, j0, nc, ncg, ncr, c, k, kend = i0 + nr
    cdef float* srow
    cdef float* a
    cdef float* orow
    cdef float mx, corr, tot, inv

    memset(acc, 0, nr * hs * sizeof(float))
    for r in range(nr):
        m[r] = -INFINITY
        l[r] = 0.0
    for jt in range((kend + BC - 1) // BC):
        j0 = jt * BC
        nc = _imin(BC, kend - j0)
        _transpose_tile(kt, kb + j0 * C3, C3, nc, hs)
        memset(S, 0, nr * BC * sizeof(float))
        for gb in range((nr + MR - 1) // MR):    # scores, only up to the keys row g+gr-1 sees
            g = gb * MR
            gr = _imin(MR, nr - g)
            ncg = _imin(nc, i0 + g + gr - j0)
            if ncg > 0:
                att_gemm_acc(S + g * BC, BC, qb + (i0 + g) * C3, C3, 1, kt, BC, gr, ncg, hs)
        for r in range(nr):                      # online softmax; S row becomes P (0 past i)
            i = i0 + r
            srow = S + r * BC
            ncr = i + 1 - j0
            if ncr <= 0:                         # row sees none of this tile (only possible if a
                memset(srow, 0, nc * sizeof(float))  # 4-row group straddled j0): P = 0
                continue
            if ncr > nc:
                ncr = nc
            mx = att_scale_max(srow, ncr, scale, m[r])
            corr = att_expf(m[r] - mx)           # 0 on the first tile (m = -inf)
            tot = att_exp_sum(srow, ncr, mx)
            for c in range(ncr, nc):
                srow[c] = 0.0
            l[r] = l[r] * corr + tot
            m[r] = mx
            if corr != 1.0:
                a = acc + r * hs
                for k in range(hs):
                    a[k] *= corr
        for gb in range((nr + MR - 1) // MR):    # acc += P V_tile
            g = gb * MR
            gr = _imin(MR, nr - g)
            ncg = _imin(nc, i0 + g + gr - j0)
            if ncg > 0:
                att_gemm_acc(acc + g * hs, hs, S + g * BC, BC, 1, vb + j0 * C3, C3, gr, hs, ncg)
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
                              int n_threads, float* scratch) noexcept nogil:
    # out (B,T,C), lse (B,NH,T), qkv (B,T,3C); scratch: n_threads * _forward_scratch_floats(hs)
    cdef Py_ssize_t per_thread = _forward_scratch_floats(C // NH)
    cdef Py_ssize_t nqb = (T + BR - 1) // BR
    cdef Py_ssize_t nwork = B * NH * nqb
    cdef Py_ssize_t w, bh, qb, i0, nr
    cdef float* scr = NULL
    with parallel(num_threads=n_threads):
        scr = scratch + omp_get_thread_num() * per_thread
        # chunksize 1: causal blocks grow in cost with qb; round-robin keeps threads balanced
        for w in prange(nwork, schedule='static', chunksize=1):
            bh = w // nqb
            qb = w - bh * nqb
            i0 = qb * BR
            nr = BR if T - i0 > BR else T - i0
            _forward_block(out, lse, qkv, bh // NH, bh % NH, i0, nr, T, C, NH, scr)


# ----------------------------------------------------------------------------------------------
# backward

cdef inline Py_ssize_t _backward_scratch_floats(Py_ssize_t T, Py_ssize_t hs) noexcept nogil:
    # D (T) + dq (T*hs) + kt, vt (hs*BC each) + dk, dv (BC*hs each) + P, dS (BQ*BC each)
    return T + T * hs + 4 * hs * BC + 2 * BQ * BC


cdef void _backward_head(float* dqkv, const float* dout, const float* qkv, const float* out,
                         const float* lse, Py_ssize_t b, Py_ssize_t h,
                         Py_ssize_t T, Py_ssize_t C, Py_ssize_t NH, float* scratch) noexcept nogil:
    # dqkv += gradient for head h of batch b. Outer loop over key tiles (their dK, dV stay in
    # local accumulators), inner loop over blocks of the queries that see the tile; dQ
    # accumulates in scratch. Every accumulation runs in a fixed order (key tile, then row).
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
    cdef Py_ssize_t i, i0, i0b, nr, r, g, gb, gr, jt, j0, nc, ncg, ncr, c, k, ks
    cdef float* prow
    cdef float* srow
    cdef float* drow
    cdef float* src
    cdef float acc, li, Di

    for i in range(T):                           # D_i = dout_i . out_i  (= sum_j P_ij dP_ij)
        acc = 0.0
        for k in range(hs):
            acc = acc + dob[i * C + k] * ob[i * C + k]
        D[i] = acc
    memset(dq, 0, T * hs * sizeof(float))
    for jt in range((T + BC - 1) // BC):
        j0 = jt * BC
        nc = _imin(BC, T - j0)
        _transpose_tile(kt, kb + j0 * C3, C3, nc, hs)
        _transpose_tile(vt, vb + j0 * C3, C3, nc, hs)
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
                att_gemm_acc(P + g * BC, BC, qb + (i0 + g) * C3, C3, 1, kt, BC, gr, ncg, hs)
                att_gemm_acc(dS + g * BC, BC, dob + (i0 + g) * C, C, 1, vt, BC, gr, ncg, hs)
            for r in range(nr):                  # the forward's score bits, exp(s - lse)
                i = i0 + r
                prow = P + r * BC
                srow = dS + r * BC
                ncr = _imin(nc, i + 1 - j0)
                li = lb[i]
                Di = D[i]
                att_exp_affine(prow, ncr, scale, li)
                for c in range(ncr):
                    srow[c] = prow[c] * (srow[c] - Di) * scale
                for c in range(ncr, nc):
                    prow[c] = 0.0
                    srow[c] = 0.0
            for gb in range((nc + MR - 1) // MR):  # dV += P^T dout, dK += dS^T Q, over the rows
                g = gb * MR                           # that see keys j0+g.. (earlier rows: P = 0)
                gr = _imin(MR, nc - g)
                ks = j0 + g - i0
                if ks < 0:
                    ks = 0
                if ks >= nr:
                    continue
                att_gemm_acc(dv + g * hs, hs, P + ks * BC + g, 1, BC, dob + (i0 + ks) * C, C, gr, hs, nr - ks)
                att_gemm_acc(dk + g * hs, hs, dS + ks * BC + g, 1, BC, qb + (i0 + ks) * C3, C3, gr, hs, nr - ks)
            for gb in range((nr + MR - 1) // MR):  # dQ += dS K_tile
                g = gb * MR
                gr = _imin(MR, nr - g)
                ncg = _imin(nc, i0 + g + gr - j0)
                att_gemm_acc(dq + (i0 + g) * hs, hs, dS + g * BC, BC, 1, kb + j0 * C3, C3, gr, hs, ncg)
        for c in range(nc):
            drow = dkb + (j0 + c) * C3
            src = dk + c * hs
            for k in range(hs):
                drow[k] += src[k]
            drow = dvb + (j0 + c) * C3
            src = dv + c * hs
            for k in range(hs):
                drow[k] += src[k]
    for i in range(T):
        drow = dqb + i * C3
        src = dq + i * hs
        for k in range(hs):
            drow[k] += src[k]


cdef void attention_backward_c(float* dqkv, const float* dout, const float* qkv, const float* out,
                               const float* lse, Py_ssize_t B, Py_ssize_t T, Py_ssize_t C,
                               Py_ssize_t NH, int n_threads, float* scratch) noexcept nogil:
    # dqkv (B,T,3C) +=; dout, out (B,T,C); lse (B,NH,T); scratch: n_threads * _backward_scratch_floats
    cdef Py_ssize_t per_thread = _backward_scratch_floats(T, C // NH)
    cdef Py_ssize_t w, nwork = B * NH
    cdef float* scr = NULL
    with parallel(num_threads=n_threads):
        scr = scratch + omp_get_thread_num() * per_thread
        for w in prange(nwork, schedule='static'):
            _backward_head(dqkv, dout, qkv, out, lse, w // NH, w % NH, T, C, NH, scr)


# ----------------------------------------------------------------------------------------------
# Python wrappers: validate sizes, allocate per-thread scratch, release the GIL

def _check_dims(int B, int T, int C, int NH, int n_threads):
    if B < 0 or T < 0:
        raise ValueError(f"attention: B and T must be >= 0, got B={B}, T={T}")
    if C < 1 or NH < 1:
        raise ValueError(f"attention: C and NH must be >= 1, got C={C}, NH={NH}")
    if C % NH != 0:
        raise ValueError(f"attention: C={C} is not divisible by NH={NH}")
    if n_threads < 1:
        raise ValueError(f"attention: n_threads must be >= 1, got {n_threads}")


def _check_len(str name, Py_ssize_t got, Py_ssize_t want, str shape):
    if got != want:
        raise ValueError(f"attention: {name} has {got} floats, expected {want} = {shape}")


cdef _check_disjoint(str out_name, const float[::1] o, str in_name, const float[::1] x):
    # outputs are written while inputs are still being read: an overlap would corrupt silently
    if o.shape[0] == 0 or x.shape[0] == 0:
        return
    cdef uintptr_t po = <uintptr_t>&o[0]
    cdef uintptr_t px = <uintptr_t>&x[0]
    if po < px + <uintptr_t>x.shape[0] * sizeof(float) and px < po + <uintptr_t>o.shape[0] * sizeof(float):
        raise ValueError(f"attention: {out_name} must not overlap {in_name}")


def forward_scratch_bytes(int T, int C, int NH, int n_threads=1):
    """Bytes of scratch attention_forward allocates (independent of T: O(BR*hs + hs*BC))."""
    _check_dims(1, T, C, NH, n_threads)
    return n_threads * _forward_scratch_floats(C // NH) * sizeof(float)


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
    _check_len("out", out.shape[0], BT * C, f"B*T*C = {B}*{T}*{C}")
    _check_len("lse", lse.shape[0], BT * NH, f"B*NH*T = {B}*{NH}*{T}")
    _check_len("qkv", qkv.shape[0], BT * 3 * C, f"B*T*3C = {B}*{T}*3*{C}")
    _check_disjoint("out", out, "qkv", qkv)
    _check_disjoint("out", out, "lse", lse)
    _check_disjoint("lse", lse, "qkv", qkv)
    if BT == 0:
        return
    cdef Py_ssize_t nwork = <Py_ssize_t>B * NH * ((T + BR - 1) // BR)
    cdef int nt = n_threads if n_threads < nwork else <int>nwork
    cdef float* scratch = <float*>PyMem_RawMalloc(nt * _forward_scratch_floats(C // NH) * sizeof(float))
    if scratch == NULL:
        raise MemoryError("attention_forward: could not allocate scratch")
    try:
        with nogil:
            attention_forward_c(&out[0], &lse[0], &qkv[0], B, T, C, NH, nt, scratch)
    finally:
        PyMem_RawFree(scratch)


def attention_backward(float[::1] dqkv, const float[::1] dout, const float[::1] qkv,
                       const float[::1] out, const float[::1] lse,
                       int B, int T, int C, int NH, int n_threads=1):
    """dqkv (B,T,3C) += d(loss)/d(qkv) given dout (B,T,C) and the forward's out (B,T,C), lse (B,NH,T).

    Probabilities are recomputed from qkv and lse (nothing T*T is stored or allocated).
    Accumulates into dqkv (call sites zero it first if they want the plain gradient).
    Results are bit-identical for any n_threads.
    """
    _check_dims(B, T, C, NH, n_threads)
    cdef Py_ssize_t BT = <Py_ssize_t>B * T
    _check_len("dqkv", dqkv.shape[0], BT * 3 * C, f"B*T*3C = {B}*{T}*3*{C}")
    _check_len("dout", dout.shape[0], BT * C, f"B*T*C = {B}*{T}*{C}")
    _check_len("qkv", qkv.shape[0], BT * 3 * C, f"B*T*3C = {B}*{T}*3*{C}")
    _check_len("out", out.shape[0], BT * C, f"B*T*C = {B}*{T}*{C}")
    _check_len("lse", lse.shape[0], BT * NH, f"B*NH*T = {B}*{NH}*{T}")
    _check_disjoint("dqkv", dqkv, "dout", dout)
    _check_disjoint("dqkv", dqkv, "qkv", qkv)
    _check_disjoint("dqkv", dqkv, "out", out)
    _check_disjoint("dqkv", dqkv, "lse", lse)
    if BT == 0:
        return
    cdef Py_ssize_t nwork = <Py_ssize_t>B * NH
    cdef int nt = n_threads if n_threads < nwork else <int>nwork
    cdef float* scratch = <float*>PyMem_RawMalloc(nt * _backward_scratch_floats(T, C // NH) * sizeof(float))
    if scratch == NULL:
        raise MemoryError("attention_backward: could not allocate scratch")
    try:
        with nogil:
            attention_backward_c(&dqkv[0], &dout[0], &qkv[0], &out[0], &lse[0],
                                 B, T, C, NH, nt, scratch)
    finally:
        PyMem_RawFree(scratch)


def _expf(float[::1] x, bint vector=True):
    """x[i] = the kernels' exp(x[i]) in place, by the vector path (with a scalar tail) or by the
    scalar att_expf only; exposed for tests of its accuracy and of the two paths agreeing."""
    cdef Py_ssize_t i
    if x.shape[0] == 0:
        return
    with nogil:
        if vector:
            att_exp_affine(&x[0], x.shape[0], 1.0, 0.0)
        else:
            for i in range(x.shape[0]):
                x[i] = att_expf(x[i])
