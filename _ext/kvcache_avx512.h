/* AVX-512 form of kvcache.pyx's _attend_one: one query against n cached keys/values (rows of hs
 * floats), as llm.c's attention_forward computes a row (scale 1/sqrt(hs), softmax with
 * exp(x - max), the max starting at -10000, a multiply by 1/sum, out = sum_j att_j v_j).
 *
 * What differs from the plain loops: each dot product is one vector FMA chain over hs and a
 * horizontal sum, four keys at a time; the exp is mathf_avx512.h's (mathf.h's with FMAs)
 * (1-2 ulp, where the plain loops call libm's expf); the sum of the exps keeps 16 lane partials.
 * So results differ from the plain loops' in the last bits (tests/test_sample.py holds both to
 * a float64 reference). Every query is still computed by one thread, whole.
 */
#ifndef LLMCTL_KVCACHE_AVX512_H
#define LLMCTL_KVCACHE_AVX512_H
#include <math.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(LLMCTL_NO_AVX_DISPATCH) && __GNUC__ >= 11
#include <immintrin.h>
#include "mathf_avx512.h"
#include "kvcache_row.h"
#define LLMCTL_KV_AVX512 1
#define LLMCTL_KV_TGT __attribute__((target("avx512f")))

static int llmctl_kv_avx512_runs(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

/* the lanes of hs's last partial chunk of 16 (all 16 when hs is a multiple of 16) */
static inline __mmask16 llmctl_kv_tail(int hs)
{
    int r = hs % 16;
    return r ? (__mmask16)((1u << r) - 1) : (__mmask16)0xFFFF;
}

/* q . k_j for one key, hs in chunks of 16 */
LLMCTL_KV_TGT static inline __m512 llmctl_kv_dot16(const float* q, const float* k, int hs, __mmask16 tail)
{
    __m512 s = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 < hs; i += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), s);
    return _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, q + i), _mm512_maskz_loadu_ps(tail, k + i), s);
}

/* sc[j] = (q . key j) * scale for the cnt keys at rows 0 .. cnt-1 of k; four independent
 * chains, then one reduce each (a key's score does not depend on its neighbours) */
LLMCTL_KV_TGT static inline void llmctl_kv_scores16(float* sc, const float* q, const float* k, int cnt, int hs,
                                                    float scale, __mmask16 tail)
{
    int j = 0;
    for (; j + 4 <= cnt; j += 4) {
        __m512 s0 = llmctl_kv_dot16(q, k + (long)j * hs, hs, tail);
        __m512 s1 = llmctl_kv_dot16(q, k + (long)(j + 1) * hs, hs, tail);
        __m512 s2 = llmctl_kv_dot16(q, k + (long)(j + 2) * hs, hs, tail);
        __m512 s3 = llmctl_kv_dot16(q, k + (long)(j + 3) * hs, hs, tail);
        sc[j] = _mm512_reduce_add_ps(s0) * scale;
        sc[j + 1] = _mm512_reduce_add_ps(s1) * scale;
        sc[j + 2] = _mm512_reduce_add_ps(s2) * scale;
        sc[j + 3] = _mm512_reduce_add_ps(s3) * scale;
    }
    for (; j < cnt; j++) sc[j] = _mm512_reduce_add_ps(llmctl_kv_dot16(q, k + (long)j * hs, hs, tail)) * scale;
}

/* columns i .. i+15 of the weighted sum of a segment's values (kvcache_row.h) */
#define LLMCTL_KV_LOADM16(p, m) _mm512_maskz_loadu_ps(m, p)
LLMCTL_KV_PV_SEGMENT(llmctl_kv_pv16, LLMCTL_KV_TGT, __m512, __mmask16, _mm512_set1_ps, LLMCTL_KV_LOADM16, _mm512_fmadd_ps)

/* out (hs) = softmax(q K^T / sqrt(hs)) V over n keys; scores: scratch of n rounded up to 16.
 * Keys/values 0 .. np-1 are rows of kp/vp (a shared prefix: np = 0 when there is none), the rest
 * rows of k/v from their start (key j at row j - np). Each key's score and its place in the sums
 * depend only on j, so where the keys live changes no bit. */
LLMCTL_KV_TGT static void llmctl_kv_attend_avx512(float* out, const float* q, const float* kp, const float* vp,
                                                  int np, const float* k, const float* v,
                                                  int n, int hs, float scale, float* scores)
{
    const __mmask16 tail = llmctl_kv_tail(hs);
    const int n16 = (n + 15) / 16 * 16;
    float maxval = -10000.0f, expsum, inv;
    __m512 mx, sum = _mm512_setzero_ps();
    int j;
    if (np > n) np = n;
    llmctl_kv_scores16(scores, q, kp, np, hs, scale, tail);
    llmctl_kv_scores16(scores + np, q, k, n - np, hs, scale, tail);
    for (j = n; j < n16; j++) scores[j] = -INFINITY;     /* padding lanes: exp gives 0 */
    mx = _mm512_set1_ps(maxval);
    for (j = 0; j < n16; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(scores + j));
    maxval = _mm512_reduce_max_ps(mx);
    mx = _mm512_set1_ps(maxval);
    for (j = 0; j < n16; j += 16) {
        __m512 e = llmctl_expf16(_mm512_sub_ps(_mm512_loadu_ps(scores + j), mx));
        _mm512_storeu_ps(scores + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    expsum = _mm512_reduce_add_ps(sum);
    inv = expsum != 0.0f ? 1.0f / expsum : 0.0f;
    for (int i = 0; i < hs; i += 16) {   /* 16 output columns at a time, down the keys */
        __mmask16 m = i + 16 <= hs ? (__mmask16)0xFFFF : tail;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        llmctl_kv_pv16(&acc0, &acc1, scores, vp, np, 0, hs, i, m);
        llmctl_kv_pv16(&acc0, &acc1, scores + np, v, n - np, np & 1, hs, i, m);
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(_mm512_add_ps(acc0, acc1), _mm512_set1_ps(inv)));
    }
}
#else   /* no AVX-512 copy in this build: never called, as llmctl_kv_avx512_runs() says 0 */
static int llmctl_kv_avx512_runs(void) { return 0; }
static void llmctl_kv_attend_avx512(float* out, const float* q, const float* kp, const float* vp, int np,
                                    const float* k, const float* v, int n, int hs, float scale, float* scores)
{
    (void)out; (void)q; (void)kp; (void)vp; (void)np; (void)k; (void)v; (void)n; (void)hs; (void)scale; (void)scores;
}
#endif
#endif /* LLMCTL_KVCACHE_AVX512_H */
