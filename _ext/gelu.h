/* GELU (tanh form, as llm.c's gelu_forward / gelu_backward) over a chunk of n elements.
 *
 * Each loop is compiled twice: for baseline x86-64 (SSE2, 4 floats a vector) and for AVX2
 * (8 floats), and the AVX2 copy runs where the CPU has it (runtime dispatch: the build itself
 * stays baseline, so a wheel never hits SIGILL). GELU is elementwise and written with plain
 * float arithmetic (mathf.h's tanh/sech^2, no FMA: -std=c11 does not contract), so both copies
 * give the same bits; llmctl_gelu_set_simd(0) keeps to the baseline copy, for the tests that
 * check that. Elsewhere (not GCC on x86-64) only the plain loop exists.
 */
#ifndef LLMCTL_GELU_H
#define LLMCTL_GELU_H
#include <stddef.h>
#include <stdint.h>

#include "bf16.h"
#include "mathf.h"

#define LLMCTL_GELU_C3 ((float)0.044715)
#define LLMCTL_GELU_3C3 ((float)(3.0 * 0.044715))

/* out = 0.5 x (1 + tanh(k (x + c3 x^3))), k = sqrt(2/pi) as a float (the caller's, as llm.c's) */
#define LLMCTL_GELU_FWD_LOOP(STORE)                                                   \
    for (ptrdiff_t i = 0; i < n; i++) {                                             \
        float xi = x[i];                                                            \
        float u = k * (xi + LLMCTL_GELU_C3 * xi * xi * xi);                         \
        STORE(out[i], 0.5f * xi * (1.0f + llmctl_tanhf(u)));                        \
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

#define LLMCTL_GELU_KERNELS(SUFFIX, ATTR)                                                        \
    ATTR static void llmctl_gelu_fwd_f32_##SUFFIX(float* out, const float* x, ptrdiff_t n, float k) { \
        LLMCTL_GELU_FWD_LOOP(LLMCTL_STORE_F32)                                                 \
    }                                                                                          \
    ATTR static void llmctl_gelu_fwd_bf16_##SUFFIX(uint16_t* out, const float* x, ptrdiff_t n, float k) { \
        LLMCTL_GELU_FWD_LOOP(LLMCTL_STORE_BF16)                                                \
    }                                                                                          \
    ATTR static void llmctl_gelu_bwd_##SUFFIX(float* dx, const float* x, const float* dy, ptrdiff_t n, \
                                              float k) {                                       \
        LLMCTL_GELU_BWD_LOOP                                                                   \
    }

LLMCTL_GELU_KERNELS(base, )

#if defined(__GNUC__) && defined(__x86_64__) && !defined(LLMCTL_NO_AVX_DISPATCH)
LLMCTL_GELU_KERNELS(avx2, __attribute__((target("avx2"))))
/* whether the AVX2 copies run: set by llmctl_gelu_set_simd, which layers.pyx calls at import,
   so the parallel loops only ever read it */
static int llmctl_gelu_avx2 = 0;
static inline int llmctl_gelu_use_avx2(void) { return llmctl_gelu_avx2; }
static inline int llmctl_gelu_set_simd(int enabled) {   /* returns whether AVX2 now runs */
    llmctl_gelu_avx2 = enabled ? (__builtin_cpu_supports("avx2") ? 1 : 0) : 0;
    return llmctl_gelu_avx2;
}
#define LLMCTL_GELU_DISPATCH(name, ...) \
    (llmctl_gelu_use_avx2() ? name##_avx2(__VA_ARGS__) : name##_base(__VA_ARGS__))
#else
static inline int llmctl_gelu_use_avx2(void) { return 0; }
static inline int llmctl_gelu_set_simd(int enabled) { (void)enabled; return 0; }
#define LLMCTL_GELU_DISPATCH(name, ...) name##_base(__VA_ARGS__)
#endif

static inline void llmctl_gelu_fwd_f32(float* out, const float* x, ptrdiff_t n, float k) {
    LLMCTL_GELU_DISPATCH(llmctl_gelu_fwd_f32, out, x, n, k);
}
static inline void llmctl_gelu_fwd_bf16(uint16_t* out, const float* x, ptrdiff_t n, float k) {
    LLMCTL_GELU_DISPATCH(llmctl_gelu_fwd_bf16, out, x, n, k);
}
static inline void llmctl_gelu_bwd(float* dx, const float* x, const float* dy, ptrdiff_t n, float k) {
    LLMCTL_GELU_DISPATCH(llmctl_gelu_bwd, dx, x, dy, n, k);
}
#endif
