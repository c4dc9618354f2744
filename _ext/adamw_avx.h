/* adamw.pyx's helpers in C.
 *
 * llmctl_sqrt_inplace: gcc will not vectorise a loop calling sqrtf unless -fno-math-errno is on
 * the command line (no pragma or attribute does it), so the square roots of each block are taken
 * here: SSE sqrtps where available (correctly rounded, the same bits as sqrtf), plain sqrtf
 * elsewhere.
 *
 * llmctl_adamw_avx: the update 8 floats at a time with AVX when the CPU has it (run-time
 * dispatch, so the build stays baseline x86-64). The same operations in the same order as
 * adamw.pyx's _adamw_block and no FMA, so both paths give identical bits.
 */
#ifndef LLMCTL_ADAMW_AVX_H
#define LLMCTL_ADAMW_AVX_H
#include <stddef.h>
#include <math.h>
#if defined(__SSE2__) || defined(_M_X64)
#include <xmmintrin.h>
static inline void llmctl_sqrt_inplace(float* a, int n) {
    int i = 0;
    for (; i + 4 <= n; i += 4) _mm_storeu_ps(a + i, _mm_sqrt_ps(_mm_loadu_ps(a + i)));
    for (; i < n; i++) a[i] = sqrtf(a[i]);
}
#else
static inline void llmctl_sqrt_inplace(float* a, int n) {
    for (int i = 0; i < n; i++) a[i] = sqrtf(a[i]);
}
#endif

/* The same update, 8 floats at a time with AVX when the CPU has it (runtime dispatch, so
   the build stays baseline x86-64). Same operations in the same order as _adamw_block and
   no FMA, so both paths give identical bits. Returns how many elements it did (n rounded
   down to 8), or 0 when AVX is unavailable. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(LLMCTL_NO_AVX_DISPATCH)
#include <immintrin.h>
/* set once at import (llmctl_adamw_init), never inside the parallel update */
static int llmctl_have_avx = 0;
static void llmctl_adamw_init(void) { llmctl_have_avx = __builtin_cpu_supports("avx") ? 1 : 0; }
__attribute__((target("avx")))
static ptrdiff_t llmctl_adamw_avx_(float* p, const float* g, float* m, float* v, ptrdiff_t n,
                                    float lr, float b1, float b2, float eps, float wd, float gs,
                                    float inv_bc1, float inv_bc2) {
    const __m256 vb1 = _mm256_set1_ps(b1), vb2 = _mm256_set1_ps(b2);
    const __m256 vomb1 = _mm256_set1_ps(1.0f - b1), vomb2 = _mm256_set1_ps(1.0f - b2);
    const __m256 vlr = _mm256_set1_ps(lr), veps = _mm256_set1_ps(eps), vwd = _mm256_set1_ps(wd);
    const __m256 vgs = _mm256_set1_ps(gs), vbc1 = _mm256_set1_ps(inv_bc1), vbc2 = _mm256_set1_ps(inv_bc2);
    ptrdiff_t i, n8 = n - n % 8;
    for (i = 0; i < n8; i += 8) {
        __m256 gi = _mm256_mul_ps(vgs, _mm256_loadu_ps(g + i));
        __m256 mi = _mm256_add_ps(_mm256_mul_ps(vb1, _mm256_loadu_ps(m + i)), _mm256_mul_ps(vomb1, gi));
        __m256 vi = _mm256_add_ps(_mm256_mul_ps(vb2, _mm256_loadu_ps(v + i)),
                                  _mm256_mul_ps(_mm256_mul_ps(vomb2, gi), gi));
        _mm256_storeu_ps(m + i, mi);
        _mm256_storeu_ps(v + i, vi);
        __m256 den = _mm256_add_ps(_mm256_sqrt_ps(_mm256_mul_ps(vi, vbc2)), veps);
        __m256 pi = _mm256_loadu_ps(p + i);
        __m256 upd = _mm256_add_ps(_mm256_div_ps(_mm256_mul_ps(mi, vbc1), den), _mm256_mul_ps(vwd, pi));
        _mm256_storeu_ps(p + i, _mm256_sub_ps(pi, _mm256_mul_ps(vlr, upd)));
    }
    return n8;
}
static ptrdiff_t llmctl_adamw_avx(float* p, const float* g, float* m, float* v, ptrdiff_t n,
                                   float lr, float b1, float b2, float eps, float wd, float gs,
                                   float inv_bc1, float inv_bc2) {
    if (!llmctl_have_avx) return 0;
    return llmctl_adamw_avx_(p, g, m, v, n, lr, b1, b2, eps, wd, gs, inv_bc1, inv_bc2);
}
static int llmctl_cpu_has_avx(void) { return llmctl_have_avx; }
#else
static ptrdiff_t llmctl_adamw_avx(float* p, const float* g, float* m, float* v, ptrdiff_t n,
                                   float lr, float b1, float b2, float eps, float wd, float gs,
                                   float inv_bc1, float inv_bc2) { return 0; }
static int llmctl_cpu_has_avx(void) { return 0; }
static void llmctl_adamw_init(void) {}
#endif
#endif
