/* Vectorisable float math for llmctl's kernels: expf, and the tanh / sech^2 pair GELU needs.
 *
 * Why hand-written helpers instead of libm: without -ffast-math gcc will not vectorise calls to
 * expf/tanhf/coshf, and softmax (B*T*V exps) and GELU (B*T*4C per layer) would then dominate
 * the non-matmul time. llmctl_expf is Cephes' expf (Cody-Waite reduction + degree-6 polynomial,
 * ~1-2 ulp), written with plain float arithmetic so that gcc -O3 vectorises loops that call it
 * and gives the same bits at every vector width (no fp contraction under -std=c11).
 */
#ifndef LLMCTL_MATHF_H
#define LLMCTL_MATHF_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for float x <= 88.37 (callers pass x <= 0): 0 below ln(FLT_MIN), NaN stays NaN.
   Every select is done with integer masks: gcc will not if-convert float compares under
   the default -ftrapping-math, and a branch would stop the vectoriser. */
static inline float llmctl_expf(float x) {
    const float lo = -87.3365447504f;
    int32_t keep = -(int32_t)!(x < lo);          /* all ones unless x < lo */
    float lof = lo, xc, scale;
    int32_t xb, lb, bits;
    memcpy(&xb, &x, 4);
    memcpy(&lb, &lof, 4);
    xb = (xb & keep) | (lb & ~keep);             /* xc = max(x, lo), NaN kept */
    memcpy(&xc, &xb, 4);
    /* n = round(x / ln2) with the 1.5*2^23 trick (exact for |n| < 2^22; vectorises) */
    float fn = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = xc - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    bits = (int32_t)(((uint32_t)((int32_t)fn + 127) << 23)) & keep;  /* 2^n, or 0 */
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* tanh(u) and sech^2(u) = 1/cosh^2(u) from one exp: t = exp(-2|u|) in (0, 1],
   tanh|u| = (1-t)/(1+t), sech^2 u = 4t/(1+t)^2 (no overflow for any u). */
static inline float llmctl_tanhf(float u) {
    float t = llmctl_expf(-2.0f * fabsf(u));
    return copysignf((1.0f - t) / (1.0f + t), u);
}
static inline float llmctl_sech2f(float u) {
    float t = llmctl_expf(-2.0f * fabsf(u));
    float d = 1.0f + t;
    return (4.0f * t) / (d * d);
}
#endif
