/* GELU (tanh form, as llm.c's gelu_forward / gelu_backward) over a chunk of n elements.
 *
 * Each loop is compiled three times, for baseline x86-64 (SSE2, 4 floats a vector), AVX2 (8)
 * and AVX-512 (16), and the copy rows.h's run-time switch picks runs (the build itself stays
 * baseline, so a wheel never hits SIGILL). GELU is elementwise and written with plain float
 * arithmetic (mathf.h's tanh/sech^2, no FMA: -std=c11 does not contract), so all copies give
 * the same bits. Elsewhere (not GCC on x86-64) only the plain loop exists.
 */
#ifndef LLMCTL_GELU_H
#define LLMCTL_GELU_H
#include <stddef.h>
#include <stdint.h>

#include "bf16.h"
#include "mathf.h"
#include "rows.h"

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

/* dx += gelu'(x) dy */
#define LLMCTL_GELU_BWD_LOOP                                                          \
    for (ptrdiff_t i = 0; i < n; i++) {                                             \
        float xi = x[i];                                                            \
        float u = k * (xi + LLMCTL_GELU_C3 * xi * xi * xi);                         \
        float th = llmctl_tanhf(u), sech2 = llmctl_sech2f(u);                       \
        float g = 0.5f * (1.0f + th) + xi * 0.5f * sech2 * k * (1.0f + LLMCTL_GELU_3C3 * xi * xi); \
        dx[i] += g * dy[i];                                                         \
    }

/* Columns [0, n) (n <= LLMCTL_GELU_COLS) of BT rows of stride OC (pointers at the first column):
   x fp32 or (b16) bf16; g = 0 + gelu'(x) dy, the fp32 gradient exactly as a zero fill and gelu_bwd's += leave it
   (0 + v turns -0 into +0); out = bf16(g); acc[c] += g in double, rows in order (the dbias sum
   of matmul_backward_bf16's cast pass, which this replaces for the fc layer). */
#define LLMCTL_GELU_COLS 2048
/* one row bt: xr its fp32 inputs (columns 0..n) */
#define LLMCTL_GELU_BWD_COLS_ROW(xr)                                                  \
    {                                                                               \
        const float* dr = dy + bt * OC;                                             \
        uint16_t* orow = out + bt * OC;                                             \
        for (ptrdiff_t i = 0; i < n; i++) {                                         \
            float xi = (xr)[i];                                                     \
            float u = k * (xi + LLMCTL_GELU_C3 * xi * xi * xi);                     \
            float th = llmctl_tanhf(u), sech2 = llmctl_sech2f(u);                   \
            float gg = 0.5f * (1.0f + th) + xi * 0.5f * sech2 * k * (1.0f + LLMCTL_GELU_3C3 * xi * xi); \
            g[i] = 0.0f + gg * dr[i];                                               \
        }                                                                           \
        for (ptrdiff_t i = 0; i < n; i++) {                                         \
            acc[i] += (double)g[i];                                                 \
            orow[i] = llmctl_f32_to_bf16(g[i]);                                     \
        }                                                                           \
    }

#define LLMCTL_GELU_KERNELS(SUFFIX, ATTR)                                                        \
    ATTR static void llmctl_gelu_fwd_f32_##SUFFIX(float* out, const float* x, ptrdiff_t n, float k) { \
        LLMCTL_GELU_FWD_LOOP(LLMCTL_STORE_F32, x, out, n)                                      \
    }                                                                                          \
    ATTR static void llmctl_gelu_fwd_bf16_##SUFFIX(uint16_t* out, const float* x, ptrdiff_t n, float k) { \
        LLMCTL_GELU_FWD_LOOP(LLMCTL_STORE_BF16, x, out, n)                                     \
    }                                                                                          \
    /* bf16 in: widened a block at a time into fp32 (the loop above on uint16 input measured   \
       1.4x slower than on fp32: gcc vectorises the mixed widths worse) */                     \
    ATTR static void llmctl_gelu_fwd_b16_bf16_##SUFFIX(uint16_t* out, const uint16_t* x, ptrdiff_t n, \
                                                       float k) {                              \
        float xw[1024];                                                                        \
        for (ptrdiff_t s = 0; s < n; s += 1024) {                                              \
            ptrdiff_t m = n - s < 1024 ? n - s : 1024;                                         \
            for (ptrdiff_t i = 0; i < m; i++) xw[i] = llmctl_bf16_to_f32(x[s + i]);           \
            LLMCTL_GELU_FWD_LOOP(LLMCTL_STORE_BF16, xw, out + s, m)                            \
        }                                                                                      \
    }                                                                                          \
    ATTR static void llmctl_gelu_bwd_##SUFFIX(float* dx, const float* x, const float* dy, ptrdiff_t n, \
                                              float k) {                                       \
        LLMCTL_GELU_BWD_LOOP                                                                   \
    }                                                                                          \
    ATTR static void llmctl_gelu_bwd_bf16_cols_##SUFFIX(uint16_t* out, double* acc, const float* x, \
                                                        const float* dy, ptrdiff_t BT, ptrdiff_t OC, \
                                                        ptrdiff_t n, float k) {                \
        float g[LLMCTL_GELU_COLS];                                                             \
        for (ptrdiff_t bt = 0; bt < BT; bt++) LLMCTL_GELU_BWD_COLS_ROW(x + bt * OC)            \
    }                                                                                          \
    /* bf16 in: each row widened first (as the forward's blocks) */                            \
    ATTR static void llmctl_gelu_bwd_b16_cols_##SUFFIX(uint16_t* out, double* acc, const uint16_t* x, \
                                                       const float* dy, ptrdiff_t BT, ptrdiff_t OC, \
                                                       ptrdiff_t n, float k) {                 \
        float g[LLMCTL_GELU_COLS], xw[LLMCTL_GELU_COLS];                                       \
        for (ptrdiff_t bt = 0; bt < BT; bt++) {                                                \
            for (ptrdiff_t i = 0; i < n; i++) xw[i] = llmctl_bf16_to_f32(x[bt * OC + i]);       \
            LLMCTL_GELU_BWD_COLS_ROW(xw)                                                       \
        }                                                                                      \
    }

LLMCTL_GELU_KERNELS(base, )

#if defined(__GNUC__) && defined(__x86_64__) && !defined(LLMCTL_NO_AVX_DISPATCH)
LLMCTL_GELU_KERNELS(avx2, __attribute__((target("avx2"))))
LLMCTL_GELU_KERNELS(avx512, __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512"))))
#endif

static inline void llmctl_gelu_fwd_f32(float* out, const float* x, ptrdiff_t n, float k) {
    LLMCTL_ROWS_DISPATCH(llmctl_gelu_fwd_f32, out, x, n, k);
}
static inline void llmctl_gelu_fwd_bf16(uint16_t* out, const float* x, ptrdiff_t n, float k) {
    LLMCTL_ROWS_DISPATCH(llmctl_gelu_fwd_bf16, out, x, n, k);
}
static inline void llmctl_gelu_bwd(float* dx, const float* x, const float* dy, ptrdiff_t n, float k) {
    LLMCTL_ROWS_DISPATCH(llmctl_gelu_bwd, dx, x, dy, n, k);
}
static inline void llmctl_gelu_bwd_bf16_cols(uint16_t* out, double* acc, const float* x, const float* dy,
                                             ptrdiff_t BT, ptrdiff_t OC, ptrdiff_t n, float k) {
    LLMCTL_ROWS_DISPATCH(llmctl_gelu_bwd_bf16_cols, out, acc, x, dy, BT, OC, n, k);
}
static inline void llmctl_gelu_fwd_b16_bf16(uint16_t* out, const uint16_t* x, ptrdiff_t n, float k) {
    LLMCTL_ROWS_DISPATCH(llmctl_gelu_fwd_b16_bf16, out, x, n, k);
}
static inline void llmctl_gelu_bwd_b16_cols(uint16_t* out, double* acc, const uint16_t* x, const float* dy,
                                            ptrdiff_t BT, ptrdiff_t OC, ptrdiff_t n, float k) {
    LLMCTL_ROWS_DISPATCH(llmctl_gelu_bwd_b16_cols, out, acc, x, dy, BT, OC, n, k);
}
#endif
