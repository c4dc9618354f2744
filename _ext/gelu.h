/* GELU (tanh form, as llm.c's gelu_forward / gelu_backward) over a chunk of n elements.
 *
 * Each loop is compiled three times, for baseline x86-64 (SSE2, 4 floats a vector), AVX2 (8)
 * and AVX-512 (16), and the copy rows.h's run-time switch picks runs (the build itself stays
 * baseline, so a wheel never hits SIGILL). GELU is elementwise and written with plain float
 * arithmetic (mathf.h's tanh/sech^2, no FMA: -std=c11 does not contract), so all copies give
 * the same bits. Elsewhere (not GCC on x86-64) only the plain loop exists. For bf16 input the
 * loops read tables of GELU and gelu' over all 65536 bf16 values, built by these loops.
 */
#ifndef LLMCTL_GELU_H
#define LLMCTL_GELU_H
#include <stddef.h>
#include <stdint.h>

#include "bf16.h"
#include "mathf.h"
#include "rows.h"

#if defined(_MSC_VER)
#define LLMCTL_RESTRICT __restrict
#else
#define LLMCTL_RESTRICT restrict
#endif

#define LLMCTL_GELU_C3 ((float)0.044715)
#define LLMCTL_GELU_3C3 ((float)(3.0 * 0.044715))

/* out = 0.5 x (1 + tanh(k (x + c3 x^3))), k = sqrt(2/pi) as a float (the caller's, as llm.c's) */
#define LLMCTL_GELU_FWD_LOOP(STORE, X, OUT, N)                                        \
    for (ptrdiff_t i = 0; i < (N); i++) {                                           \
        float xi = (X)[i];                                                          \
        float u = k * (xi + LLMCTL_GELU_C3 * xi * xi * xi);                         \
        STORE((OUT)[i], 0.5f * xi * (1.0f + llmctl_tanhf(u)));                      \
    }
#define LLMCTL_STORE_F32(dst, v) (dst) = (v)
#define LLMCTL_STORE_BF16(dst, v) (dst) = llmctl_f32_to_bf16(v)

/* gelu'(x), llm.c's gelu_backward: 0.5 (1 + tanh u) + x 0.5 sech^2(u) k (1 + 3 c3 x^2) */
static inline float llmctl_gelu_grad(float xi, float k) {
    float u = k * (xi + LLMCTL_GELU_C3 * xi * xi * xi);
    float th = llmctl_tanhf(u), sech2 = llmctl_sech2f(u);
    return 0.5f * (1.0f + th) + xi * 0.5f * sech2 * k * (1.0f + LLMCTL_GELU_3C3 * xi * xi);
}

/* dx += gelu'(x) dy */
#define LLMCTL_GELU_BWD_LOOP                                                          \
    for (ptrdiff_t i = 0; i < n; i++) dx[i] += llmctl_gelu_grad(x[i], k) * dy[i];

/* A backward that recomputes the GELU, in one pass: y = GELU(x) (for the fcproj weight
   gradient) and d = 0 + gelu'(x) d in place (what a zero fill and += leave), tanh(u) evaluated
   once for both. The operations of the two loops above, so their bits. */
#define LLMCTL_GELU_FWD_BWD_LOOP                                                      \
    for (ptrdiff_t i = 0; i < n; i++) {                                             \
        float xi = x[i];                                                            \
        float u = k * (xi + LLMCTL_GELU_C3 * xi * xi * xi);                         \
        float th = llmctl_tanhf(u), sech2 = llmctl_sech2f(u);                       \
        y[i] = 0.5f * xi * (1.0f + th);                                             \
        float g = 0.5f * (1.0f + th) + xi * 0.5f * sech2 * k * (1.0f + LLMCTL_GELU_3C3 * xi * xi); \
        d[i] = 0.0f + g * d[i];                                                     \
    }

/* Columns [0, n) (n <= LLMCTL_GELU_COLS) of BT rows of stride OC (pointers at the first column):
   x fp32 (bf16 x: the table loops below); g = 0 + gelu'(x) dy, the fp32 gradient exactly as a zero fill and gelu_bwd's += leave it
   (0 + v turns -0 into +0); out = bf16(g); acc[c] += g in double, rows in order (the dbias sum
   of matmul_backward_bf16's cast pass, which this replaces for the fc layer). */
#define LLMCTL_GELU_COLS 2048
/* one row bt: xr its fp32 inputs (columns 0..n) */
#define LLMCTL_GELU_BWD_COLS_ROW(xr)                                                  \
    {                                                                               \
        const float* dr = dy + bt * OC;                                             \
        uint16_t* orow = out + bt * OC;                                             \
        for (ptrdiff_t i = 0; i < n; i++) g[i] = 0.0f + llmctl_gelu_grad((xr)[i], k) * dr[i]; \
        for (ptrdiff_t i = 0; i < n; i++) {                                         \
            acc[i] += (double)g[i];                                                 \
            orow[i] = llmctl_f32_to_bf16(g[i]);                                     \
        }                                                                           \
    }

/* For bf16 input (the bf16 model's fch) every input is one of 65536 values: GELU and gelu'
   of each are computed once (llmctl_gelu_tables, by the loops here, so the same bits) and the
   loops below read them instead of evaluating tanh per element. fwd: bf16(gelu(x)) widened to
   32 bits (what a 32-bit gather loads); grad: gelu'(x) in fp32. */
static uint32_t llmctl_gelu_tab_fwd[65536];
static float llmctl_gelu_tab_grad[65536];
static float llmctl_gelu_tab_k = 0.0f;   /* the k they were built for; 0: not built */

/* The table loops; VEC(SUFFIX) functions do a vector prefix of a row and return how many
   elements they did (none in the baseline copy), the plain loops do the rest */
#define LLMCTL_GELU_TAB_FWD(SUFFIX, ATTR)                                                       \
    ATTR static void llmctl_gelu_fwd_tab_##SUFFIX(uint16_t* out, const uint16_t* x, ptrdiff_t n) { \
        for (ptrdiff_t i = llmctl_gelu_fwd_tab_vec_##SUFFIX(out, x, n); i < n; i++)            \
            out[i] = (uint16_t)llmctl_gelu_tab_fwd[x[i]];                                      \
    }
#define LLMCTL_GELU_TAB_KERNELS(SUFFIX, ATTR)                                                   \
    LLMCTL_GELU_TAB_FWD(SUFFIX, ATTR)                                                          \
    LLMCTL_GELU_BWD_TAB_COLS(llmctl_gelu_bwd_tab_cols_##SUFFIX, ATTR, float,                     \
                             llmctl_gelu_grad_tab_vec_##SUFFIX, LLMCTL_DY_F32,                     \
                             llmctl_gelu_fwd_tab_##SUFFIX)                                         \
    LLMCTL_GELU_BWD_TAB_COLS(llmctl_gelu_bwd_tab_cols16_##SUFFIX, ATTR, uint16_t,                \
                             llmctl_gelu_grad_tab16_vec_##SUFFIX, llmctl_bf16_to_f32,              \
                             llmctl_gelu_fwd_tab_##SUFFIX)

/* The gradient pass from the tables over columns 0..n of BT rows (LLMCTL_GELU_BWD_COLS_ROW's
   operations); dy fp32, or bf16 (DT uint16_t: the fcproj backward GEMM's rounded output, widened
   exactly, then the same operations). out may be dy itself (each element is read before it is
   written). y not NULL: also GELU(x) into y's rows (FWD, the forward's bits), for a backward
   that recomputes the GELU: one pass over x where two made it twice. */
#define LLMCTL_DY_F32(v) (v)
#define LLMCTL_GELU_BWD_TAB_COLS(NAME, ATTR, DT, VEC, WIDEN, FWD)                                \
    ATTR static void NAME(uint16_t* out, uint16_t* y, double* acc, const uint16_t* x, const DT* dy, \
                          ptrdiff_t BT, ptrdiff_t OC, ptrdiff_t n) {                           \
        float g[LLMCTL_GELU_COLS];                                                             \
        for (ptrdiff_t bt = 0; bt < BT; bt++) {                                                \
            const uint16_t* xr = x + bt * OC;                                                  \
            const DT* dr = dy + bt * OC;                                                       \
            uint16_t* orow = out + bt * OC;                                                    \
            for (ptrdiff_t i = VEC(g, xr, dr, n); i < n; i++)                                  \
                g[i] = 0.0f + llmctl_gelu_tab_grad[xr[i]] * WIDEN(dr[i]);                      \
            for (ptrdiff_t i = 0; i < n; i++) {                                                \
                acc[i] += (double)g[i];                                                        \
                orow[i] = llmctl_f32_to_bf16(g[i]);                                            \
            }                                                                                  \
            if (y) FWD(y + bt * OC, xr, n);                                                    \
        }                                                                                      \
    }

static inline ptrdiff_t llmctl_gelu_fwd_tab_vec_base(uint16_t* out, const uint16_t* x, ptrdiff_t n) {
    (void)out; (void)x; (void)n;
    return 0;
}
static inline ptrdiff_t llmctl_gelu_grad_tab_vec_base(float* g, const uint16_t* x, const float* dy, ptrdiff_t n) {
    (void)g; (void)x; (void)dy; (void)n;
    return 0;
}
static inline ptrdiff_t llmctl_gelu_grad_tab16_vec_base(float* g, const uint16_t* x, const uint16_t* dy,
                                                        ptrdiff_t n) {
    (void)g; (void)x; (void)dy; (void)n;
    return 0;
}

#define LLMCTL_GELU_KERNELS(SUFFIX, ATTR)                                                        \
    ATTR static void llmctl_gelu_fwd_f32_##SUFFIX(float* out, const float* x, ptrdiff_t n, float k) { \
        LLMCTL_GELU_FWD_LOOP(LLMCTL_STORE_F32, x, out, n)                                      \
    }                                                                                          \
    ATTR static void llmctl_gelu_fwd_bf16_##SUFFIX(uint16_t* out, const float* x, ptrdiff_t n, float k) { \
        LLMCTL_GELU_FWD_LOOP(LLMCTL_STORE_BF16, x, out, n)                                     \
    }                                                                                          \
    ATTR static void llmctl_gelu_bwd_##SUFFIX(float* dx, const float* x, const float* dy, ptrdiff_t n, \
                                              float k) {                                       \
        LLMCTL_GELU_BWD_LOOP                                                                   \
    }                                                                                          \
    ATTR static void llmctl_gelu_fwd_bwd_##SUFFIX(float* LLMCTL_RESTRICT y, float* LLMCTL_RESTRICT d, \
                                                  const float* LLMCTL_RESTRICT x, ptrdiff_t n,  \
                                                  float k) {                                     \
        LLMCTL_GELU_FWD_BWD_LOOP                                                               \
    }                                                                                          \
    ATTR static void llmctl_gelu_bwd_bf16_cols_##SUFFIX(uint16_t* out, double* acc, const float* x, \
                                                        const float* dy, ptrdiff_t BT, ptrdiff_t OC, \
                                                        ptrdiff_t n, float k) {                \
        float g[LLMCTL_GELU_COLS];                                                             \
        for (ptrdiff_t bt = 0; bt < BT; bt++) LLMCTL_GELU_BWD_COLS_ROW(x + bt * OC)            \
    }

LLMCTL_GELU_KERNELS(base, )
LLMCTL_GELU_TAB_KERNELS(base, )

#if defined(__GNUC__) && defined(__x86_64__) && !defined(LLMCTL_NO_AVX_DISPATCH)
LLMCTL_GELU_KERNELS(avx2, __attribute__((target("avx2"))))
LLMCTL_GELU_KERNELS(avx512, __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512"))))
#include <immintrin.h>
/* The table reads as gathers: gcc's generic tuning will not emit them and loads lane by lane
   instead (4.6x slower here). The same table entries and the same float operations: the same bits. */
#define LLMCTL_GELU_TAB_GATHERS(SUFFIX, ATTR, W, VI, LOADX, GATHER_I, NARROW, STOREO)                 \
    ATTR static ptrdiff_t llmctl_gelu_fwd_tab_vec_##SUFFIX(uint16_t* out, const uint16_t* x, ptrdiff_t n) { \
        ptrdiff_t i = 0;                                                                       \
        for (; i + W <= n; i += W) {                                                           \
            VI v = GATHER_I(LOADX(x + i), (const void*)llmctl_gelu_tab_fwd);                   \
            STOREO(out + i, NARROW(v));                                                        \
        }                                                                                      \
        return i;                                                                              \
    }
/* the gradient's gathers, for the two-loop form of the gradient pass (the AVX-512 copy has its
   one-loop form below) */
#define LLMCTL_GELU_TAB_GRAD_GATHERS(SUFFIX, ATTR, W, VF, LOADX, GATHER_F, LOADF, LOADF16, MULF, ADDF, \
                                     ZEROF, STOREF)                                            \
    ATTR static ptrdiff_t llmctl_gelu_grad_tab_vec_##SUFFIX(float* g, const uint16_t* x, const float* dy, \
                                                            ptrdiff_t n) {                     \
        ptrdiff_t i = 0;                                                                       \
        for (; i + W <= n; i += W) {                                                           \
            VF t = GATHER_F(LOADX(x + i), llmctl_gelu_tab_grad);                               \
            STOREF(g + i, ADDF(ZEROF(), MULF(t, LOADF(dy + i))));                              \
        }                                                                                      \
        return i;                                                                              \
    }                                                                                          \
    ATTR static ptrdiff_t llmctl_gelu_grad_tab16_vec_##SUFFIX(float* g, const uint16_t* x,     \
                                                              const uint16_t* dy, ptrdiff_t n) { \
        ptrdiff_t i = 0;                                                                       \
        for (; i + W <= n; i += W) {                                                           \
            VF t = GATHER_F(LOADX(x + i), llmctl_gelu_tab_grad);                               \
            STOREF(g + i, ADDF(ZEROF(), MULF(t, LOADF16(dy + i))));                            \
        }                                                                                      \
        return i;                                                                              \
    }

#define LLMCTL_AVX2_ATTR __attribute__((target("avx2")))
#define LLMCTL_AVX512_ATTR __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")))
#define LLMCTL_LDX8(p) _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p)))
#define LLMCTL_GI8(ix, t) _mm256_i32gather_epi32((const int*)(t), ix, 4)
#define LLMCTL_GF8(ix, t) _mm256_i32gather_ps(t, ix, 4)
/* 8 lanes of uint32 < 65536 to 8 uint16: pack pairs within each 128-bit half, then join the halves */
#define LLMCTL_NARROW8(v) _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1))
#define LLMCTL_ST8(p, v) _mm_storeu_si128((__m128i*)(p), v)
#define LLMCTL_LDX16(p) _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p)))
#define LLMCTL_GI16(ix, t) _mm512_i32gather_epi32(ix, t, 4)
#define LLMCTL_ST16(p, v) _mm256_storeu_si256((__m256i*)(p), v)
/* bf16 (uint16) to fp32 exactly: the bits in the top half of each lane */
#define LLMCTL_LDB8(p) _mm256_castsi256_ps(_mm256_slli_epi32(LLMCTL_LDX8(p), 16))
#define LLMCTL_LDB16(p) _mm512_castsi512_ps(_mm512_slli_epi32(LLMCTL_LDX16(p), 16))
LLMCTL_GELU_TAB_GATHERS(avx2, LLMCTL_AVX2_ATTR, 8, __m256i, LLMCTL_LDX8, LLMCTL_GI8, LLMCTL_NARROW8, LLMCTL_ST8)
LLMCTL_GELU_TAB_GRAD_GATHERS(avx2, LLMCTL_AVX2_ATTR, 8, __m256, LLMCTL_LDX8, LLMCTL_GF8, _mm256_loadu_ps, LLMCTL_LDB8,
                             _mm256_mul_ps, _mm256_add_ps, _mm256_setzero_ps, _mm256_storeu_ps)
LLMCTL_GELU_TAB_GATHERS(avx512, LLMCTL_AVX512_ATTR, 16, __m512i, LLMCTL_LDX16, LLMCTL_GI16, _mm512_cvtepi32_epi16,
                        LLMCTL_ST16)
LLMCTL_GELU_TAB_KERNELS(avx2, LLMCTL_AVX2_ATTR)
LLMCTL_GELU_TAB_FWD(avx512, LLMCTL_AVX512_ATTR)

/* The AVX-512 gradient pass (LLMCTL_GELU_BWD_TAB_COLS) in one loop per row: 16 columns at a time
   gathered, scaled, added to the dbias sums and stored in bf16. The plain form makes two loops a
   row, the first reading memory and the second only computing, so its reads stopped for half of
   each row (1.7x the memory floor at d12 T=1024). Each thread reads its own columns of every
   row, pieces OC apart that the hardware prefetcher does not chain: the rows two ahead are
   prefetched. The same operations per element, in the same order per column: the same bits.
   The bf16 rounding is llmctl_f32_to_bf16's, in 16 lanes; the NaN test compares |u| as signed
   (it is below 2^31), which SIMDe also defines. y: as LLMCTL_GELU_BWD_TAB_COLS. */
#define LLMCTL_GELU_BWD_TAB_COLS_V16(NAME, DT, LOADDY, WIDEN)                                     \
    LLMCTL_AVX512_ATTR static void NAME(uint16_t* out, uint16_t* y, double* acc, const uint16_t* x, \
                                        const DT* dy, ptrdiff_t BT, ptrdiff_t OC, ptrdiff_t n) { \
        const ptrdiff_t nv = n - n % 16;                                                       \
        const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);            \
        const __m512i absm = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000); \
        const __m512i qnan = _mm512_set1_epi32(0x7FC0);                                        \
        for (ptrdiff_t bt = 0; bt < BT; bt++) {                                                \
            const uint16_t* xr = x + bt * OC;                                                  \
            const DT* dr = dy + bt * OC;                                                       \
            uint16_t* orow = out + bt * OC;                                                    \
            ptrdiff_t i = 0;                                                                   \
            for (; i < nv; i += 16) {                                                          \
                if (bt + 2 < BT) {                                                             \
                    _mm_prefetch((const char*)(xr + 2 * OC + i), _MM_HINT_T0);                 \
                    _mm_prefetch((const char*)(dr + 2 * OC + i), _MM_HINT_T0);                 \
                }                                                                              \
                __m512 t = _mm512_i32gather_ps(LLMCTL_LDX16(xr + i), llmctl_gelu_tab_grad, 4);  \
                __m512 g = _mm512_add_ps(_mm512_setzero_ps(), _mm512_mul_ps(t, LOADDY(dr + i))); \
                __m256 glo = _mm512_castps512_ps256(g);                                        \
                __m256 ghi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1)); \
                _mm512_storeu_pd(acc + i, _mm512_add_pd(_mm512_loadu_pd(acc + i), _mm512_cvtps_pd(glo))); \
                _mm512_storeu_pd(acc + i + 8, _mm512_add_pd(_mm512_loadu_pd(acc + i + 8), _mm512_cvtps_pd(ghi))); \
                __m512i u = _mm512_castps_si512(g);                                            \
                __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one))); \
                __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, absm), inf);       \
                r = _mm512_mask_mov_epi32(_mm512_srli_epi32(r, 16), nan, qnan);                \
                _mm256_storeu_si256((__m256i*)(orow + i), _mm512_cvtepi32_epi16(r));           \
            }                                                                                  \
            for (; i < n; i++) {                                                               \
                float gi = 0.0f + llmctl_gelu_tab_grad[xr[i]] * WIDEN(dr[i]);                  \
                acc[i] += (double)gi;                                                          \
                orow[i] = llmctl_f32_to_bf16(gi);                                              \
            }                                                                                  \
            if (y) llmctl_gelu_fwd_tab_avx512(y + bt * OC, xr, n);                             \
        }                                                                                      \
    }
LLMCTL_GELU_BWD_TAB_COLS_V16(llmctl_gelu_bwd_tab_cols_avx512, float, _mm512_loadu_ps, LLMCTL_DY_F32)
LLMCTL_GELU_BWD_TAB_COLS_V16(llmctl_gelu_bwd_tab_cols16_avx512, uint16_t, LLMCTL_LDB16, llmctl_bf16_to_f32)
#endif

/* Fill the tables for k (once; the callers' k is a constant), with the baseline loops */
static void llmctl_gelu_tables(float k) {
    float in[1024];
    uint16_t out[1024];
    if (llmctl_gelu_tab_k == k) return;
    for (int s = 0; s < 65536; s += 1024) {
        for (int i = 0; i < 1024; i++) in[i] = llmctl_bf16_to_f32((uint16_t)(s + i));
        llmctl_gelu_fwd_bf16_base(out, in, 1024, k);
        for (int i = 0; i < 1024; i++) {
            llmctl_gelu_tab_fwd[s + i] = out[i];
            llmctl_gelu_tab_grad[s + i] = llmctl_gelu_grad(in[i], k);
        }
    }
    llmctl_gelu_tab_k = k;
}

static inline void llmctl_gelu_fwd_f32(float* out, const float* x, ptrdiff_t n, float k) {
    LLMCTL_ROWS_DISPATCH(llmctl_gelu_fwd_f32, out, x, n, k);
}
static inline void llmctl_gelu_fwd_bf16(uint16_t* out, const float* x, ptrdiff_t n, float k) {
    LLMCTL_ROWS_DISPATCH(llmctl_gelu_fwd_bf16, out, x, n, k);
}
static inline void llmctl_gelu_bwd(float* dx, const float* x, const float* dy, ptrdiff_t n, float k) {
    LLMCTL_ROWS_DISPATCH(llmctl_gelu_bwd, dx, x, dy, n, k);
}
static inline void llmctl_gelu_fwd_bwd(float* y, float* d, const float* x, ptrdiff_t n, float k) {
    LLMCTL_ROWS_DISPATCH(llmctl_gelu_fwd_bwd, y, d, x, n, k);
}
static inline void llmctl_gelu_bwd_bf16_cols(uint16_t* out, double* acc, const float* x, const float* dy,
                                             ptrdiff_t BT, ptrdiff_t OC, ptrdiff_t n, float k) {
    LLMCTL_ROWS_DISPATCH(llmctl_gelu_bwd_bf16_cols, out, acc, x, dy, BT, OC, n, k);
}
/* GELU and its gradient pass for bf16 input, from the tables (llmctl_gelu_tables(k) first):
   the bits of the fp32-input loops on the widened input */
static inline void llmctl_gelu_fwd_tab(uint16_t* out, const uint16_t* x, ptrdiff_t n) {
    LLMCTL_ROWS_DISPATCH(llmctl_gelu_fwd_tab, out, x, n);
}
static inline void llmctl_gelu_bwd_tab_cols(uint16_t* out, uint16_t* y, double* acc, const uint16_t* x,
                                            const float* dy, ptrdiff_t BT, ptrdiff_t OC, ptrdiff_t n) {
    LLMCTL_ROWS_DISPATCH(llmctl_gelu_bwd_tab_cols, out, y, acc, x, dy, BT, OC, n);
}
static inline void llmctl_gelu_bwd_tab_cols16(uint16_t* out, uint16_t* y, double* acc, const uint16_t* x,
                                              const uint16_t* dy, ptrdiff_t BT, ptrdiff_t OC, ptrdiff_t n) {
    LLMCTL_ROWS_DISPATCH(llmctl_gelu_bwd_tab_cols16, out, y, acc, x, dy, BT, OC, n);
}
#endif
