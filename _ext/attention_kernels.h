/* The C micro-kernels of _ext/attention.pyx: exp, scale-max, exp-sum, the register-blocked gemm
   and the per-tile softmax rows of forward and backward, compiled once per instruction set from
   macro templates, plus the dispatch table the
   Cython wrappers pick a set from. See attention.pyx's module docstring for the bit-level
   contract (two result classes: {default, scalar}, {avx2, avx512}). */
#ifndef LLMCTL_ATTENTION_KERNELS_H
#define LLMCTL_ATTENTION_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

/* Portable C first (any C compiler, and -DATT_NO_VEC to test it): the "default" kernels.
   With GCC/Clang the default kernels use vector types of the build's baseline width instead,
   and on x86 two more sets are compiled for avx2+fma and avx512f+fma with target attributes
   (no -march flag: the build's baseline stays SSE2) and picked at run time by cpuid.
   Bit-level contract: every output element is computed by the same sequence of float
   operations in every set, except that the avx2/avx512 sets fuse a*b+c into one FMA.
   So "default" (vector or scalar) gives one set of bits, "avx2" and "avx512" another. */
#if (defined(__GNUC__) || defined(__clang__)) && !defined(ATT_NO_VEC)
#define ATT_VEC 1
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF   /* clang fuses a*b+c by default where the target has FMA */
#endif
#if (defined(__x86_64__) || defined(__i386__)) && !defined(ATT_NO_DISPATCH)
#define ATT_X86 1
#include <immintrin.h>
#endif
#endif

#define ATT_EXP_LO (-87.33654f)          /* ln(FLT_MIN): below it exp gives 0 */
#define ATT_EXP_HI 88.0f
#define ATT_LOG2E 1.44269504088896341f
#define ATT_SHIFT 12582912.0f            /* 1.5*2^23: t + SHIFT rounds t to nearest integer */
#define ATT_LN2_HI 0.693359375f
#define ATT_LN2_LO (-2.12194440e-4f)
#define ATT_P0 1.9875691500e-4f
#define ATT_P1 1.3981999507e-3f
#define ATT_P2 8.3334519073e-3f
#define ATT_P3 4.1665795894e-2f
#define ATT_P4 1.6666665459e-1f
#define ATT_P5 5.0000001201e-1f
#define ATT_NP 16   /* exp_sum keeps 16 lane partials in every set: its sum order is ISA-independent */

enum { ATT_ISA_DEFAULT = 0, ATT_ISA_AVX2 = 1, ATT_ISA_AVX512 = 2, ATT_N_ISA = 3 };

/* which sets have run since the last reset (bit per ISA): lets tests prove a forced set ran.
   Only read-then-set once, so the hot path costs one load of a shared, unmodified line. */
static unsigned att_ran_bits = 0;
#ifdef ATT_VEC
static inline void att_mark(unsigned bit)
{
    if (!(__atomic_load_n(&att_ran_bits, __ATOMIC_RELAXED) & bit))
        __atomic_fetch_or(&att_ran_bits, bit, __ATOMIC_RELAXED);
}
#else
static void att_mark(unsigned bit) { if (!(att_ran_bits & bit)) att_ran_bits |= bit; }
#endif

/* exp(x) for x <= 88: Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then Cephes'
   degree-6 polynomial for exp(r); <= 1 ulp on [-87.3, 0] (tests/test_attention.py checks).
   x < ln(FLT_MIN) = -87.34 gives 0 (no denormals; exp(-inf) = 0 as for expf); NaN
   propagates. Scores enter as s - max <= 0 (or s*scale - lse ~<= 0): x > 88 never occurs.
   Written as a scalar and a vector twin with the same operations, so both give the same
   bits (a row's tail takes the scalar one); glibc's expf is a scalar call, and gcc will not
   if-convert the clamps of a scalar loop. MADD(a, b, c) is a*b+c, fused in the FMA sets. */
#define ATT_DEFINE_EXPF(SFX, ATTR, MADD)                                                  \
ATTR static inline float att_expf_##SFX(float x)                                         \
{                                                                                        \
    float xc = x < ATT_EXP_LO ? ATT_EXP_LO : (x > ATT_EXP_HI ? ATT_EXP_HI : x);          \
    float t = MADD(xc, ATT_LOG2E, ATT_SHIFT);                                            \
    float n = t - ATT_SHIFT;                                                             \
    uint32_t ti, bits;                                                                   \
    float r, y, pow2n;                                                                   \
    memcpy(&ti, &t, 4);                                                                  \
    r = MADD(n, -ATT_LN2_HI, xc);                                                        \
    r = MADD(n, -ATT_LN2_LO, r);                                                         \
    y = ATT_P0;                                                                          \
    y = MADD(y, r, ATT_P1);                                                              \
    y = MADD(y, r, ATT_P2);                                                              \
    y = MADD(y, r, ATT_P3);                                                              \
    y = MADD(y, r, ATT_P4);                                                              \
    y = MADD(y, r, ATT_P5);                                                              \
    y = MADD(y, r * r, r) + 1.0f;                                                        \
    bits = (ti - 0x4B400000u + 127u) << 23;          /* 2^n, n in [-126, 127] */         \
    memcpy(&pow2n, &bits, 4);                                                            \
    y = y * pow2n;                                                                       \
    return x < ATT_EXP_LO ? 0.0f : y;                                                    \
}

#define ATT_MUL_ADD(a, b, c) ((a) * (b) + (c))

/* The per-row work on one score tile, instantiated once per set after its kernels, so that a
   tile costs one call instead of three indirect calls a row (attention.pyx's loops did them).
   Each row runs exactly the operations the loops ran, in their order, so the bits are the same.
   softmax_tile (forward, online softmax): rows r < nr of S (row stride ld) see the first
   ncr = min(nc, first + r) keys (ncr <= 0: none, the row becomes P = 0); the row is scaled and
   its max taken with m[r], corr = exp(m[r] - max), the exps summed, the columns past ncr zeroed,
   l[r] = l[r] * corr + sum, m[r] = max, and the row's hs accumulators scaled by corr unless 1;
   GROUP rows at a time (att_softmax_rows, the vector sets) where they all see the whole tile.
   dsoftmax_tile (backward): the forward's probabilities P = exp(S * scale - lse[r]) over the
   ncr = min(nc, first + r) >= 1 keys each row sees, then dS = (P * (dP - D[r])) * scale over
   them (dS holds dP on entry), both zeroed past ncr. */
#define ATT_DEFINE_TILES(SFX, ATTR, GROUP)                                                \
ATTR static void att_softmax_tile_##SFX(float* S, ptrdiff_t ld, ptrdiff_t nr, ptrdiff_t nc,   \
                                        ptrdiff_t first, float scale, float* m, float* l,    \
                                        float* acc, ptrdiff_t hs)                             \
{                                                                                        \
    ptrdiff_t r, c, k, ncr;                                                              \
    for (r = 0; r < nr; r++) {                                                           \
        float* srow = S + r * ld;                                                        \
        float mx, corr, tot;                                                             \
        if (GROUP && r + GROUP <= nr && first + r >= nc && nc % ATT_NP == 0) {          \
            att_softmax_rows_##SFX(srow, ld, nc, scale, m + r, l + r, acc + r * hs, hs); \
            r += GROUP - 1;                                                              \
            continue;                                                                    \
        }                                                                                \
        ncr = first + r;                                                                 \
        if (ncr <= 0) {                                                                  \
            memset(srow, 0, (size_t)nc * sizeof(float));                                 \
            continue;                                                                    \
        }                                                                                \
        if (ncr > nc) ncr = nc;                                                          \
        mx = att_scale_max_##SFX(srow, ncr, scale, m[r]);                                \
        corr = att_expf_##SFX(m[r] - mx);            /* 0 on the first tile (m = -inf) */ \
        tot = att_exp_sum_##SFX(srow, ncr, mx);                                          \
        for (c = ncr; c < nc; c++) srow[c] = 0.0f;                                       \
        l[r] = l[r] * corr + tot;                                                        \
        m[r] = mx;                                                                       \
        if (corr != 1.0f) {                                                              \
            float* a = acc + r * hs;                                                     \
            for (k = 0; k < hs; k++) a[k] = a[k] * corr;                                 \
        }                                                                                \
    }                                                                                    \
}                                                                                        \
ATTR static void att_dsoftmax_tile_##SFX(float* P, float* dS, ptrdiff_t ld, ptrdiff_t nr,     \
                                         ptrdiff_t nc, ptrdiff_t first, float scale,          \
                                         const float* lse, const float* D)                    \
{                                                                                        \
    ptrdiff_t r, c, ncr;                                                                 \
    for (r = 0; r < nr; r++) {                                                           \
        float* prow = P + r * ld;                                                        \
        float* srow = dS + r * ld;                                                       \
        float Di = D[r];                                                                 \
        ncr = first + r < nc ? first + r : nc;                                           \
        att_exp_affine_##SFX(prow, ncr, scale, lse[r]);                                  \
        for (c = 0; c < ncr; c++) srow[c] = (prow[c] * (srow[c] - Di)) * scale;          \
        for (c = ncr; c < nc; c++) {                                                     \
            prow[c] = 0.0f;                                                              \
            srow[c] = 0.0f;                                                              \
        }                                                                                \
    }                                                                                    \
}

/* ---- the portable scalar set (no vector types): only when ATT_VEC is off ---- */
#ifndef ATT_VEC
ATT_DEFINE_EXPF(default, , ATT_MUL_ADD)
/* C[m*ldc + n] += sum_{k<K} A[m*sam + k*sak] * B[k*ldb + n]   for m < M, n < N.
   A has arbitrary strides (so A^T costs nothing); rows of B and C are contiguous.
   Each element sums over k in order from its initial value, in every set and path. */
static void att_gemm_acc_default(float* C, ptrdiff_t ldc, const float* A, ptrdiff_t sam, ptrdiff_t sak,
                                 const float* B, ptrdiff_t ldb, ptrdiff_t M, ptrdiff_t N, ptrdiff_t K)
{
    ptrdiff_t m, n, k;
    att_mark(1u << ATT_ISA_DEFAULT);
    for (m = 0; m < M; m++)
        for (n = 0; n < N; n++) {
            float s = C[m * ldc + n];
            for (k = 0; k < K; k++) s = s + A[m * sam + k * sak] * B[k * ldb + n];
            C[m * ldc + n] = s;
        }
}
static float att_scale_max_default(float* x, ptrdiff_t n, float a, float m0)
{
    ptrdiff_t i;
    float m = m0;
    for (i = 0; i < n; i++) {
        float v = x[i] * a;
        x[i] = v;
        if (v > m) m = v;
    }
    return m;
}
static float att_exp_sum_default(float* x, ptrdiff_t n, float b)
{
    float p[ATT_NP] = {0}, s = 0.0f;
    ptrdiff_t i;
    int j;
    for (i = 0; i < n; i++) {
        x[i] = att_expf_default(x[i] - b);
        p[i % ATT_NP] += x[i];
    }
    for (j = 0; j < ATT_NP; j++) s += p[j];
    return s;
}
static void att_exp_affine_default(float* x, ptrdiff_t n, float a, float b)
{
    ptrdiff_t i;
    att_mark(1u << ATT_ISA_DEFAULT);
    for (i = 0; i < n; i++) x[i] = att_expf_default(x[i] * a - b);
}
#define att_softmax_rows_default(...) ((void)0)   /* GROUP 0: rows one by one */
ATT_DEFINE_TILES(default, , 0)
#endif

/* the transposes at the end of this file, which the vector sets' grouped softmax rows use */
static void att_transpose_default(float* dst, ptrdiff_t ldd, const float* src, ptrdiff_t lds,
                                  ptrdiff_t rows, ptrdiff_t cols);
#ifdef ATT_X86
__attribute__((target("avx2,fma"))) static void att_transpose_avx2(float* dst, ptrdiff_t ldd, const float* src,
                                                                   ptrdiff_t lds, ptrdiff_t rows, ptrdiff_t cols);
#define att_transpose_avx512 att_transpose_avx2   /* every AVX-512 CPU has AVX2 */
#endif

/* ---- vector sets: one template, instantiated per ISA with its width VW and helpers ----
   SFX##_ld/_st (unaligned load/store), _ldm/_stm (of the first rem < VW lanes only; the other
   lanes load as 0 and are not stored), _bc (broadcast), _madd (vector a*b+c), _smadd (scalar).
   MASKED sets finish a gemm row's last N % VW columns with masked vectors (the wide sets, where
   up to 15 scalar columns of a ragged causal tile would cost more than the vector body), the
   others with scalar code; both run the same operations per element.
   The gemm micro-kernel keeps 4 rows x 2 vectors of C in registers; att_exp_sum's 16 lane
   partials are ATT_NP/VW vectors, and its tail goes through the vector exp with -inf padding
   (exp = 0), so partial j always holds the elements i = j mod 16, whatever VW is. */
#ifdef ATT_VEC
#define ATT_DEFINE_SET(SFX, VW, VF, VU, ATTR, BIT, MASKED)                                \
ATT_DEFINE_EXPF(SFX, ATTR, SFX##_smadd)                                                  \
ATTR static inline VF att_expv_##SFX(VF x)                                               \
{                                                                                        \
    const VF lo = SFX##_bc(ATT_EXP_LO), hi = SFX##_bc(ATT_EXP_HI);                       \
    VU below = (VU)(x < lo);                          /* all-ones lanes */               \
    VF xc = SFX##_clamp(x, lo, hi);                                                      \
    VF t, n, r, y;                                                                       \
    VU bits;                                                                             \
    t = SFX##_madd(xc, SFX##_bc(ATT_LOG2E), SFX##_bc(ATT_SHIFT));                        \
    n = t - SFX##_bc(ATT_SHIFT);                                                         \
    r = SFX##_madd(n, SFX##_bc(-ATT_LN2_HI), xc);                                        \
    r = SFX##_madd(n, SFX##_bc(-ATT_LN2_LO), r);                                         \
    y = SFX##_bc(ATT_P0);                                                                \
    y = SFX##_madd(y, r, SFX##_bc(ATT_P1));                                              \
    y = SFX##_madd(y, r, SFX##_bc(ATT_P2));                                              \
    y = SFX##_madd(y, r, SFX##_bc(ATT_P3));                                              \
    y = SFX##_madd(y, r, SFX##_bc(ATT_P4));                                              \
    y = SFX##_madd(y, r, SFX##_bc(ATT_P5));                                              \
    y = SFX##_madd(y, r * r, r) + SFX##_bc(1.0f);                                        \
    bits = ((VU)t - 0x4B400000u + 127u) << 23;                                           \
    y = y * (VF)bits;                                                                    \
    return (VF)(~below & (VU)y);                                                         \
}                                                                                        \
ATTR static void att_gemm_acc_##SFX(float* C, ptrdiff_t ldc, const float* A, ptrdiff_t sam, \
                                    ptrdiff_t sak, const float* B, ptrdiff_t ldb,        \
                                    ptrdiff_t M, ptrdiff_t N, ptrdiff_t K)               \
{                                                                                        \
    ptrdiff_t m = 0, n, k, r;                                                            \
    att_mark(BIT);                                                                       \
    for (; m + 4 <= M; m += 4) {                                                         \
        const float* a = A + m * sam;                                                    \
        float* c = C + m * ldc;                                                          \
        for (n = 0; n + 2 * VW <= N; n += 2 * VW) {                                      \
            float* c0 = c + n; float* c1 = c0 + ldc; float* c2 = c1 + ldc; float* c3 = c2 + ldc; \
            VF x00 = SFX##_ld(c0), x01 = SFX##_ld(c0 + VW);                              \
            VF x10 = SFX##_ld(c1), x11 = SFX##_ld(c1 + VW);                              \
            VF x20 = SFX##_ld(c2), x21 = SFX##_ld(c2 + VW);                              \
            VF x30 = SFX##_ld(c3), x31 = SFX##_ld(c3 + VW);                              \
            for (k = 0; k < K; k++) {                                                    \
                const float* bk = B + k * ldb + n;                                       \
                const float* ak = a + k * sak;                                           \
                VF b0 = SFX##_ld(bk), b1 = SFX##_ld(bk + VW);                            \
                VF a0 = SFX##_bc(ak[0]), a1 = SFX##_bc(ak[sam]);                         \
                VF a2 = SFX##_bc(ak[2 * sam]), a3 = SFX##_bc(ak[3 * sam]);               \
                x00 = SFX##_madd(a0, b0, x00); x01 = SFX##_madd(a0, b1, x01);            \
                x10 = SFX##_madd(a1, b0, x10); x11 = SFX##_madd(a1, b1, x11);            \
                x20 = SFX##_madd(a2, b0, x20); x21 = SFX##_madd(a2, b1, x21);            \
                x30 = SFX##_madd(a3, b0, x30); x31 = SFX##_madd(a3, b1, x31);            \
            }                                                                            \
            SFX##_st(c0, x00); SFX##_st(c0 + VW, x01);                                   \
            SFX##_st(c1, x10); SFX##_st(c1 + VW, x11);                                   \
            SFX##_st(c2, x20); SFX##_st(c2 + VW, x21);                                   \
            SFX##_st(c3, x30); SFX##_st(c3 + VW, x31);                                   \
        }                                                                                \
        for (; n + VW <= N; n += VW) {                                                   \
            float* c0 = c + n; float* c1 = c0 + ldc; float* c2 = c1 + ldc; float* c3 = c2 + ldc; \
            VF x0 = SFX##_ld(c0), x1 = SFX##_ld(c1), x2 = SFX##_ld(c2), x3 = SFX##_ld(c3); \
            for (k = 0; k < K; k++) {                                                    \
                const float* ak = a + k * sak;                                           \
                VF b0 = SFX##_ld(B + k * ldb + n);                                       \
                x0 = SFX##_madd(SFX##_bc(ak[0]), b0, x0);                                \
                x1 = SFX##_madd(SFX##_bc(ak[sam]), b0, x1);                              \
                x2 = SFX##_madd(SFX##_bc(ak[2 * sam]), b0, x2);                          \
                x3 = SFX##_madd(SFX##_bc(ak[3 * sam]), b0, x3);                          \
            }                                                                            \
            SFX##_st(c0, x0); SFX##_st(c1, x1); SFX##_st(c2, x2); SFX##_st(c3, x3);      \
        }                                                                                \
        if (MASKED && n < N) {   /* the last N-n < VW columns: masked loads and stores */\
            int rem = (int)(N - n);                                                  \
            float* c0 = c + n; float* c1 = c0 + ldc; float* c2 = c1 + ldc; float* c3 = c2 + ldc;\
            VF x0 = SFX##_ldm(c0, rem), x1 = SFX##_ldm(c1, rem);                     \
            VF x2 = SFX##_ldm(c2, rem), x3 = SFX##_ldm(c3, rem);                     \
            for (k = 0; k < K; k++) {                                                \
                const float* ak = a + k * sak;                                       \
                VF b0 = SFX##_ldm(B + k * ldb + n, rem);                             \
                x0 = SFX##_madd(SFX##_bc(ak[0]), b0, x0);                            \
                x1 = SFX##_madd(SFX##_bc(ak[sam]), b0, x1);                          \
                x2 = SFX##_madd(SFX##_bc(ak[2 * sam]), b0, x2);                      \
                x3 = SFX##_madd(SFX##_bc(ak[3 * sam]), b0, x3);                      \
            }                                                                        \
            SFX##_stm(c0, x0, rem); SFX##_stm(c1, x1, rem);                          \
            SFX##_stm(c2, x2, rem); SFX##_stm(c3, x3, rem);                          \
            n = N;                                                                   \
        }                                                                            \
        for (; n < N; n++) {                                                             \
            for (r = 0; r < 4; r++) {                                                    \
                float s = c[r * ldc + n];                                                \
                for (k = 0; k < K; k++) s = SFX##_smadd(a[r * sam + k * sak], B[k * ldb + n], s); \
                c[r * ldc + n] = s;                                                      \
            }                                                                            \
        }                                                                                \
    }                                                                                    \
    for (; m < M; m++) {                                                                 \
        const float* a = A + m * sam;                                                    \
        float* c = C + m * ldc;                                                          \
        for (n = 0; n + VW <= N; n += VW) {                                              \
            VF x0 = SFX##_ld(c + n);                                                     \
            for (k = 0; k < K; k++)                                                      \
                x0 = SFX##_madd(SFX##_bc(a[k * sak]), SFX##_ld(B + k * ldb + n), x0);    \
            SFX##_st(c + n, x0);                                                         \
        }                                                                                \
        if (MASKED && n < N) {                                                       \
            int rem = (int)(N - n);                                                  \
            VF x0 = SFX##_ldm(c + n, rem);                                           \
            for (k = 0; k < K; k++)                                                  \
                x0 = SFX##_madd(SFX##_bc(a[k * sak]), SFX##_ldm(B + k * ldb + n, rem), x0);\
            SFX##_stm(c + n, x0, rem);                                               \
            n = N;                                                                   \
        }                                                                            \
        for (; n < N; n++) {                                                             \
            float s = c[n];                                                              \
            for (k = 0; k < K; k++) s = SFX##_smadd(a[k * sak], B[k * ldb + n], s);      \
            c[n] = s;                                                                    \
        }                                                                                \
    }                                                                                    \
}                                                                                        \
/* x[i] *= a; returns max(m0, max_i x[i]) (NaNs are skipped, as by `if (v > m) m = v`) */ \
ATTR static float att_scale_max_##SFX(float* x, ptrdiff_t n, float a, float m0)         \
{                                                                                        \
    ptrdiff_t i = 0;                                                                     \
    float m = m0;                                                                        \
    int j;                                                                               \
    if (n >= VW) {                                                                       \
        VF vm = SFX##_bc(m0), va = SFX##_bc(a);                                          \
        for (; i + VW <= n; i += VW) {                                                   \
            VF v = SFX##_ld(x + i) * va;                                                 \
            VU gt = (VU)(v > vm);                                                        \
            vm = (VF)((gt & (VU)v) | (~gt & (VU)vm));                                    \
            SFX##_st(x + i, v);                                                          \
        }                                                                                \
        for (j = 0; j < VW; j++) if (vm[j] > m) m = vm[j];                               \
    }                                                                                    \
    for (; i < n; i++) {                                                                 \
        float v = x[i] * a;                                                              \
        x[i] = v;                                                                        \
        if (v > m) m = v;                                                                \
    }                                                                                    \
    return m;                                                                            \
}                                                                                        \
/* x[i] = exp(x[i] - b); returns their sum: 16 lane partials, combined in lane order */ \
ATTR static float att_exp_sum_##SFX(float* x, ptrdiff_t n, float b)                     \
{                                                                                        \
    VF acc[ATT_NP / VW], vb = SFX##_bc(b);                                               \
    float pad[ATT_NP], s = 0.0f;                                                         \
    ptrdiff_t i = 0;                                                                     \
    int q, j, rem;                                                                       \
    att_mark(BIT);                                                                       \
    for (q = 0; q < ATT_NP / VW; q++) acc[q] = SFX##_bc(0.0f);                           \
    for (; i + ATT_NP <= n; i += ATT_NP)                                                 \
        for (q = 0; q < ATT_NP / VW; q++) {                                              \
            VF e = att_expv_##SFX(SFX##_ld(x + i + q * VW) - vb);                        \
            SFX##_st(x + i + q * VW, e);                                                 \
            acc[q] += e;                                                                 \
        }                                                                                \
    rem = (int)(n - i);                                                                  \
    if (rem > 0) {                                                                       \
        for (j = 0; j < ATT_NP; j++) pad[j] = j < rem ? x[i + j] : -INFINITY;           \
        for (q = 0; q < ATT_NP / VW; q++) {                                              \
            VF e = att_expv_##SFX(SFX##_ld(pad + q * VW) - vb);                          \
            SFX##_st(pad + q * VW, e);                                                   \
            acc[q] += e;                                                                 \
        }                                                                                \
        memcpy(x + i, pad, rem * sizeof(float));                                         \
    }                                                                                    \
    for (q = 0; q < ATT_NP / VW; q++)                                                    \
        for (j = 0; j < VW; j++) s += acc[q][j];                                         \
    return s;                                                                            \
}                                                                                        \
/* x[i] = exp(a * x[i] - b) */                                                           \
ATTR static void att_exp_affine_##SFX(float* x, ptrdiff_t n, float a, float b)          \
{                                                                                        \
    ptrdiff_t i = 0;                                                                     \
    VF va = SFX##_bc(a), vb = SFX##_bc(b);                                               \
    att_mark(BIT);                                                                       \
    for (; i + VW <= n; i += VW) SFX##_st(x + i, att_expv_##SFX(SFX##_ld(x + i) * va - vb)); \
    if (i < n) {             /* the tail through the vector exp too (same bits as scalar) */\
        float pad[VW];                                                               \
        int j, rem = (int)(n - i);                                                   \
        for (j = 0; j < VW; j++) pad[j] = j < rem ? x[i + j] : 0.0f;                 \
        SFX##_st(pad, att_expv_##SFX(SFX##_ld(pad) * va - vb));                      \
        memcpy(x + i, pad, rem * sizeof(float));                                     \
    }                                                                                \
}                                                                                        \
/* softmax_tile's work on VW rows that see all nc keys (nc % ATT_NP == 0): att_scale_max,   \
   the exp of the old max's correction, att_exp_sum and the l, m updates of each row, with the \
   reductions over lanes that end each row's max and sum done for the VW rows at once (lane r \
   of a vector holds row r, the lanes transposed through memory): a row's chains of dependent \
   compares and adds then overlap VW-1 other rows' instead of ending every row alone. Each row \
   gets the same operations in the same order as the row-by-row code: the same bits. */    \
ATTR static void att_softmax_rows_##SFX(float* S, ptrdiff_t ld, ptrdiff_t nc, float scale,  \
                                        float* m, float* l, float* acc, ptrdiff_t hs)    \
{                                                                                        \
    float lanes[VW * VW], cols[VW * VW], part[VW * ATT_NP], pcols[ATT_NP * VW];          \
    VF va = SFX##_bc(scale), m0 = SFX##_ld(m), mx = m0, corr, tot = SFX##_bc(0.0f);      \
    ptrdiff_t r, i, k;                                                                   \
    int j, q;                                                                            \
    for (r = 0; r < VW; r++) {             /* x *= scale; the row's lane maxima from m */ \
        float* x = S + r * ld;                                                           \
        VF vm = SFX##_bc(m[r]);                                                          \
        for (i = 0; i < nc; i += VW) {                                                   \
            VF v = SFX##_ld(x + i) * va;                                                 \
            VU gt = (VU)(v > vm);                                                        \
            vm = (VF)((gt & (VU)v) | (~gt & (VU)vm));                                    \
            SFX##_st(x + i, v);                                                          \
        }                                                                                \
        SFX##_st(lanes + r * VW, vm);                                                    \
    }                                                                                    \
    att_transpose_##SFX(cols, VW, lanes, VW, VW, VW);                                    \
    for (j = 0; j < VW; j++) {             /* if (vm[j] > m) m = vm[j], lane by lane */  \
        VF c = SFX##_ld(cols + j * VW);                                                  \
        VU gt = (VU)(c > mx);                                                            \
        mx = (VF)((gt & (VU)c) | (~gt & (VU)mx));                                        \
    }                                                                                    \
    corr = att_expv_##SFX(m0 - mx);        /* 0 on the first tile (m = -inf) */          \
    for (r = 0; r < VW; r++) {             /* x = exp(x - max), 16 lane partials */      \
        float* x = S + r * ld;                                                           \
        VF a[ATT_NP / VW], vb = SFX##_bc(mx[r]);                                         \
        for (q = 0; q < ATT_NP / VW; q++) a[q] = SFX##_bc(0.0f);                         \
        for (i = 0; i < nc; i += ATT_NP)                                                 \
            for (q = 0; q < ATT_NP / VW; q++) {                                          \
                VF e = att_expv_##SFX(SFX##_ld(x + i + q * VW) - vb);                    \
                SFX##_st(x + i + q * VW, e);                                             \
                a[q] += e;                                                               \
            }                                                                            \
        for (q = 0; q < ATT_NP / VW; q++) SFX##_st(part + r * ATT_NP + q * VW, a[q]);    \
    }                                                                                    \
    att_transpose_##SFX(pcols, VW, part, ATT_NP, VW, ATT_NP);                            \
    for (j = 0; j < ATT_NP; j++) tot = tot + SFX##_ld(pcols + j * VW);   /* in lane order */ \
    SFX##_st(l, SFX##_ld(l) * corr + tot);                                               \
    SFX##_st(m, mx);                                                                     \
    for (r = 0; r < VW; r++) {                                                           \
        float cr = corr[r], *ar = acc + r * hs;                                          \
        if (cr != 1.0f)                                                                  \
            for (k = 0; k < hs; k++) ar[k] = ar[k] * cr;                                 \
    }                                                                                    \
}

#if defined(__AVX512F__)
#define ATT_BASE_VW 16
#elif defined(__AVX__)
#define ATT_BASE_VW 8
#else
#define ATT_BASE_VW 4
#endif
typedef float att_vf_default __attribute__((vector_size(ATT_BASE_VW * 4)));
typedef uint32_t att_vu_default __attribute__((vector_size(ATT_BASE_VW * 4)));
static inline att_vf_default default_ld(const float* p) { att_vf_default v; memcpy(&v, p, sizeof v); return v; }
static inline void default_st(float* p, att_vf_default v) { memcpy(p, &v, sizeof v); }
static inline att_vf_default default_bc(float a) { return a - (att_vf_default){0}; }  /* x - +0 == x, -0 included */
static inline att_vf_default default_madd(att_vf_default a, att_vf_default b, att_vf_default c) { return a * b + c; }
static inline float default_smadd(float a, float b, float c) { return a * b + c; }
static inline att_vf_default default_ldm(const float* p, int rem)   /* unused: MASKED is 0 */
{ att_vf_default v = {0}; memcpy(&v, p, rem * sizeof(float)); return v; }
static inline void default_stm(float* p, att_vf_default v, int rem) { memcpy(p, &v, rem * sizeof(float)); }
static inline att_vf_default default_clamp(att_vf_default x, att_vf_default lo, att_vf_default hi)
{   /* lo below lo, hi above hi, else x (NaN included) */
    att_vu_default below = (att_vu_default)(x < lo), above = (att_vu_default)(x > hi);
    x = (att_vf_default)((below & (att_vu_default)lo) | (~below & (att_vu_default)x));
    return (att_vf_default)((above & (att_vu_default)hi) | (~above & (att_vu_default)x));
}
ATT_DEFINE_SET(default, ATT_BASE_VW, att_vf_default, att_vu_default, , 1u << ATT_ISA_DEFAULT, 0)
ATT_DEFINE_TILES(default, , ATT_BASE_VW)

#ifdef ATT_X86
#define ATT_TGT_AVX2 __attribute__((target("avx2,fma")))
#define ATT_TGT_AVX512 __attribute__((target("avx512f,avx2,fma")))
typedef float att_vf_avx2 __attribute__((vector_size(32)));
typedef uint32_t att_vu_avx2 __attribute__((vector_size(32)));
ATT_TGT_AVX2 static inline att_vf_avx2 avx2_ld(const float* p) { return (att_vf_avx2)_mm256_loadu_ps(p); }
ATT_TGT_AVX2 static inline void avx2_st(float* p, att_vf_avx2 v) { _mm256_storeu_ps(p, (__m256)v); }
ATT_TGT_AVX2 static inline att_vf_avx2 avx2_bc(float a) { return (att_vf_avx2)_mm256_set1_ps(a); }
ATT_TGT_AVX2 static inline att_vf_avx2 avx2_madd(att_vf_avx2 a, att_vf_avx2 b, att_vf_avx2 c)
{ return (att_vf_avx2)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
ATT_TGT_AVX2 static inline float avx2_smadd(float a, float b, float c)
{ return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c))); }
ATT_TGT_AVX2 static inline __m256i avx2_mask(int rem)
{ return _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
ATT_TGT_AVX2 static inline att_vf_avx2 avx2_ldm(const float* p, int rem)
{ return (att_vf_avx2)_mm256_maskload_ps(p, avx2_mask(rem)); }
ATT_TGT_AVX2 static inline void avx2_stm(float* p, att_vf_avx2 v, int rem)
{ _mm256_maskstore_ps(p, avx2_mask(rem), (__m256)v); }
ATT_TGT_AVX2 static inline att_vf_avx2 avx2_clamp(att_vf_avx2 x, att_vf_avx2 lo, att_vf_avx2 hi)
{   /* maxps/minps return their second operand when either is NaN: NaN x stays NaN, as in the
       compare-and-select form (default_clamp), and every other x gets the same value */
    return (att_vf_avx2)_mm256_min_ps((__m256)hi, _mm256_max_ps((__m256)lo, (__m256)x));
}
ATT_DEFINE_SET(avx2, 8, att_vf_avx2, att_vu_avx2, ATT_TGT_AVX2, 1u << ATT_ISA_AVX2, 1)
ATT_DEFINE_TILES(avx2, ATT_TGT_AVX2, 8)

typedef float att_vf_avx512 __attribute__((vector_size(64)));
typedef uint32_t att_vu_avx512 __attribute__((vector_size(64)));
ATT_TGT_AVX512 static inline att_vf_avx512 avx512_ld(const float* p) { return (att_vf_avx512)_mm512_loadu_ps(p); }
ATT_TGT_AVX512 static inline void avx512_st(float* p, att_vf_avx512 v) { _mm512_storeu_ps(p, (__m512)v); }
ATT_TGT_AVX512 static inline att_vf_avx512 avx512_bc(float a) { return (att_vf_avx512)_mm512_set1_ps(a); }
ATT_TGT_AVX512 static inline att_vf_avx512 avx512_madd(att_vf_avx512 a, att_vf_avx512 b, att_vf_avx512 c)
{ return (att_vf_avx512)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
ATT_TGT_AVX512 static inline float avx512_smadd(float a, float b, float c)
{ return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c))); }
ATT_TGT_AVX512 static inline att_vf_avx512 avx512_ldm(const float* p, int rem)
{ return (att_vf_avx512)_mm512_maskz_loadu_ps((__mmask16)((1u << rem) - 1u), p); }
ATT_TGT_AVX512 static inline void avx512_stm(float* p, att_vf_avx512 v, int rem)
{ _mm512_mask_storeu_ps(p, (__mmask16)((1u << rem) - 1u), (__m512)v); }
ATT_TGT_AVX512 static inline att_vf_avx512 avx512_clamp(att_vf_avx512 x, att_vf_avx512 lo, att_vf_avx512 hi)
{ return (att_vf_avx512)_mm512_min_ps((__m512)hi, _mm512_max_ps((__m512)lo, (__m512)x)); }
ATT_DEFINE_SET(avx512, 16, att_vf_avx512, att_vu_avx512, ATT_TGT_AVX512, 1u << ATT_ISA_AVX512, 1)
ATT_DEFINE_TILES(avx512, ATT_TGT_AVX512, 16)
#endif
#endif /* ATT_VEC */

/* ---- transposes: dst[k*ldd + c] = src[c*lds + k] for c < rows, k < cols (keys or values of one
   head become the columns of a tile); only moves, so every set gives the same result ---- */
static void att_transpose_default(float* dst, ptrdiff_t ldd, const float* src, ptrdiff_t lds,
                                  ptrdiff_t rows, ptrdiff_t cols)
{
    ptrdiff_t c, k;
    for (c = 0; c < rows; c++)
        for (k = 0; k < cols; k++) dst[k * ldd + c] = src[c * lds + k];
}
#ifdef ATT_X86
/* 8 x 8 blocks in registers (the unpack / shuffle / lane-swap sequence), the edges as above */
ATT_TGT_AVX2 static void att_transpose_avx2(float* dst, ptrdiff_t ldd, const float* src, ptrdiff_t lds,
                                            ptrdiff_t rows, ptrdiff_t cols)
{
    ptrdiff_t c = 0, k;
    for (; c + 8 <= rows; c += 8) {
        const float* s = src + c * lds;
        for (k = 0; k + 8 <= cols; k += 8) {
            __m256 r0 = _mm256_loadu_ps(s + k), r1 = _mm256_loadu_ps(s + lds + k);
            __m256 r2 = _mm256_loadu_ps(s + 2 * lds + k), r3 = _mm256_loadu_ps(s + 3 * lds + k);
            __m256 r4 = _mm256_loadu_ps(s + 4 * lds + k), r5 = _mm256_loadu_ps(s + 5 * lds + k);
            __m256 r6 = _mm256_loadu_ps(s + 6 * lds + k), r7 = _mm256_loadu_ps(s + 7 * lds + k);
            __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
            __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
            __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
            __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
            __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
            __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
            __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
            __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            float* d = dst + k * ldd + c;
            _mm256_storeu_ps(d, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_storeu_ps(d + ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_storeu_ps(d + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_storeu_ps(d + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_storeu_ps(d + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_storeu_ps(d + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_storeu_ps(d + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_storeu_ps(d + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
        if (k < cols)
            att_transpose_default(dst + k * ldd + c, ldd, s + k, lds, 8, cols - k);
    }
    if (c < rows)
        att_transpose_default(dst + c, ldd, src + c * lds, lds, rows - c, cols);
}
#endif

/* ---- dispatch: a table per set; the Python wrappers pick one per call ---- */
typedef struct {
    const char* name;
    int vector_width;   /* floats per vector register (1: scalar C) */
    int fma;
    void (*gemm)(float*, ptrdiff_t, const float*, ptrdiff_t, ptrdiff_t, const float*, ptrdiff_t,
                 ptrdiff_t, ptrdiff_t, ptrdiff_t);
    float (*expf1)(float);
    float (*scale_max)(float*, ptrdiff_t, float, float);
    float (*exp_sum)(float*, ptrdiff_t, float);
    void (*exp_affine)(float*, ptrdiff_t, float, float);
    void (*softmax_tile)(float*, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t, float, float*, float*, float*,
                         ptrdiff_t);
    void (*dsoftmax_tile)(float*, float*, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t, float, const float*,
                          const float*);
    void (*transpose)(float*, ptrdiff_t, const float*, ptrdiff_t, ptrdiff_t, ptrdiff_t);
} att_kern_t;
#define ATT_KERN(SFX, VW, FMA) {#SFX, VW, FMA, att_gemm_acc_##SFX, att_expf_##SFX, \
    att_scale_max_##SFX, att_exp_sum_##SFX, att_exp_affine_##SFX, att_softmax_tile_##SFX, att_dsoftmax_tile_##SFX, \
    att_transpose_##SFX}
static const att_kern_t att_kerns[ATT_N_ISA] = {
#ifdef ATT_VEC
    ATT_KERN(default, ATT_BASE_VW, 0),
#else
    ATT_KERN(default, 1, 0),
#endif
#ifdef ATT_X86
    ATT_KERN(avx2, 8, 1),
    ATT_KERN(avx512, 16, 1),
#else
    {"avx2", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"avx512", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
#endif
};
static int att_isa_compiled(int isa) { return isa >= 0 && isa < ATT_N_ISA && att_kerns[isa].gemm != 0; }
static int att_isa_runs(int isa)   /* compiled, and this CPU (and OS: libgcc checks XCR0) has it */
{
    if (!att_isa_compiled(isa)) return 0;
#ifdef ATT_X86
    __builtin_cpu_init();
    if (isa == ATT_ISA_AVX2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (isa == ATT_ISA_AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2")
               && __builtin_cpu_supports("fma");
#endif
    return isa == ATT_ISA_DEFAULT;
}
static const att_kern_t* att_kern(int isa) { return &att_kerns[isa]; }
static const char* att_kern_name(const att_kern_t* k) { return k->name; }
static int att_kern_width(const att_kern_t* k) { return k->vector_width; }
static int att_kern_fma(const att_kern_t* k) { return k->fma; }
static inline void att_gemm_acc(const att_kern_t* k, float* C, ptrdiff_t ldc, const float* A,
                                ptrdiff_t sam, ptrdiff_t sak, const float* B, ptrdiff_t ldb,
                                ptrdiff_t M, ptrdiff_t N, ptrdiff_t K)
{ k->gemm(C, ldc, A, sam, sak, B, ldb, M, N, K); }
static inline float att_expf(const att_kern_t* k, float x) { return k->expf1(x); }
static inline float att_scale_max(const att_kern_t* k, float* x, ptrdiff_t n, float a, float m0)
{ return k->scale_max(x, n, a, m0); }
static inline float att_exp_sum(const att_kern_t* k, float* x, ptrdiff_t n, float b)
{ return k->exp_sum(x, n, b); }
static inline void att_exp_affine(const att_kern_t* k, float* x, ptrdiff_t n, float a, float b)
{ k->exp_affine(x, n, a, b); }
static inline void att_softmax_tile(const att_kern_t* k, float* S, ptrdiff_t ld, ptrdiff_t nr, ptrdiff_t nc,
                                    ptrdiff_t first, float scale, float* m, float* l, float* acc, ptrdiff_t hs)
{ k->softmax_tile(S, ld, nr, nc, first, scale, m, l, acc, hs); }
static inline void att_dsoftmax_tile(const att_kern_t* k, float* P, float* dS, ptrdiff_t ld, ptrdiff_t nr,
                                     ptrdiff_t nc, ptrdiff_t first, float scale, const float* lse, const float* D)
{ k->dsoftmax_tile(P, dS, ld, nr, nc, first, scale, lse, D); }
static inline void att_transpose(const att_kern_t* k, float* dst, ptrdiff_t ldd, const float* src,
                                 ptrdiff_t lds, ptrdiff_t rows, ptrdiff_t cols)
{ k->transpose(dst, ldd, src, lds, rows, cols); }

static unsigned att_ran_take(int reset)
{
    unsigned r = att_ran_bits;
    if (reset) att_ran_bits = 0;
    return r;
}

#endif /* LLMCTL_ATTENTION_KERNELS_H */
