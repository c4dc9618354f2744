/* mathf.h's expf, 16 lanes at a time, for the AVX-512 copies of kernels whose bits may differ
 * from their plain loops' (the bf16 attention's native paths, the KV-cache attention): the same
 * Cody-Waite reduction and Cephes polynomial, with FMAs (1-2 ulp). Include only where x86-64
 * intrinsics are available (GCC >= 11 or clang); the function carries its own target.
 */
#ifndef LLMCTL_MATHF_AVX512_H
#define LLMCTL_MATHF_AVX512_H
#include <immintrin.h>

/* exp(x) in 16 lanes: 0 below ln(FLT_MIN) (a masked -inf included), x clamped at 88; NaN stays NaN */
__attribute__((target("avx512f"))) static inline __m512 llmctl_expf16(__m512 x)
{
    const __m512 lo = _mm512_set1_ps(-87.3365447504f), shift = _mm512_set1_ps(12582912.0f);
    /* max/min return their second operand when either is NaN: a NaN x passes through */
    __m512 xc = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(lo, x));
    __m512 t = _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), shift);   /* n + 1.5*2^23 */
    __m512 fn = _mm512_sub_ps(t, shift);
    __m512 r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(0.693359375f), xc);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(-2.12194440e-4f), r);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    /* p * 2^fn by vscalefps: fn is a whole number in [-126, 127], so this is the one rounded
       product of p and that power of two, as a multiply by it built in the exponent bits was */
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ), p, fn);
}
#endif
