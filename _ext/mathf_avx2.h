/* mathf.h's expf, 8 lanes at a time, for the AVX2 copies of kernels whose bits may differ from
 * their plain loops' (the KV-cache attention): the same Cody-Waite reduction and Cephes
 * polynomial as mathf_avx512.h's llmctl_expf16, with FMAs (1-2 ulp). Include only where x86-64
 * intrinsics are available; the function carries its own target.
 */
#ifndef LLMCTL_MATHF_AVX2_H
#define LLMCTL_MATHF_AVX2_H
#include <immintrin.h>

/* exp(x) in 8 lanes: 0 below ln(FLT_MIN) (-inf included), x clamped at 88; NaN stays NaN */
__attribute__((target("avx2,fma"))) static inline __m256 llmctl_expf8(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.3365447504f), shift = _mm256_set1_ps(12582912.0f);
    /* max/min return their second operand when either is NaN: a NaN x passes through */
    __m256 xc = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(lo, x));
    __m256 t = _mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), shift);   /* n + 1.5*2^23 */
    __m256 fn = _mm256_sub_ps(t, shift);
    __m256 r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(0.693359375f), xc);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    __m256i e;
    r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(-2.12194440e-4f), r);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    e = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(0x4B400000 - 127)), 23);
    /* lanes with x < lo give 0; NaN compares unordered and keeps its (NaN) product */
    return _mm256_and_ps(_mm256_cmp_ps(x, lo, _CMP_NLT_UQ), _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif
