/* AVX2 form of kvcache.pyx's _attend_one, for CPUs without AVX-512 (kvcache_avx512.h's kernel
 * in 8 lanes): one query against n cached keys/values (rows of hs floats), as llm.c's
 * attention_forward computes a row (scale 1/sqrt(hs), softmax with exp(x - max), the max
 * starting at -10000, a multiply by 1/sum, out = sum_j att_j v_j).
 *
 * What differs from the plain loops: each dot product is one FMA chain over hs and a horizontal
 * sum, four keys at a time; the exp is mathf_avx2.h's (where the plain loops call libm's expf,
 * one element at a time); the sum of the exps keeps 8 lane partials. So results differ from
 * the plain loops' in the last bits (tests/test_sample.py holds every copy to a float64
 * reference). Every query is still computed by one thread, whole.
 */
#ifndef LLMCTL_KVCACHE_AVX2_H
#define LLMCTL_KVCACHE_AVX2_H
#include <math.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(LLMCTL_NO_AVX_DISPATCH) \
    && (__GNUC__ >= 10 || defined(__clang__))
#include <immintrin.h>
#include "mathf_avx2.h"
#include "kvcache_row.h"
#define LLMCTL_KV2_TGT __attribute__((target("avx2,fma")))

static int llmctl_kv_avx2_runs(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* lanes [0, rem) of 8 set (rem in 1..8) */
LLMCTL_KV2_TGT static inline __m256i llmctl_kv2_mask(int rem)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

LLMCTL_KV2_TGT static inline float llmctl_kv2_hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

LLMCTL_KV2_TGT static inline float llmctl_kv2_hmax(__m256 v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* q . k_j for one key, hs in chunks of 8 (the last one masked) */
LLMCTL_KV2_TGT static inline __m256 llmctl_kv2_dot8(const float* q, const float* k, int hs, __m256i tail)
{
    __m256 s = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 < hs; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), s);
    return _mm256_fmadd_ps(_mm256_maskload_ps(q + i, tail), _mm256_maskload_ps(k + i, tail), s);
}

/* sc[j] = (q . key j) * scale for the cnt keys at rows 0 .. cnt-1 of k (v: the same rows' values,
 * prefetched for the pass after); four chains, then one reduce each */
LLMCTL_KV2_TGT static inline void llmctl_kv2_scores(float* sc, const float* q, const float* k, const float* v,
                                                   int cnt, int hs, float scale, __m256i tail)
{
    int j = 0;
    for (; j + 4 <= cnt; j += 4) {
        for (int b = 0; b < 4 * hs; b += 16) {   /* K 8 rows ahead; V's rows for the pass below */
            _mm_prefetch((const char*)(k + (long)(j + 8) * hs + b), _MM_HINT_T0);
            _mm_prefetch((const char*)(v + (long)j * hs + b), _MM_HINT_T0);
        }
        __m256 s0 = llmctl_kv2_dot8(q, k + (long)j * hs, hs, tail);
        __m256 s1 = llmctl_kv2_dot8(q, k + (long)(j + 1) * hs, hs, tail);
        __m256 s2 = llmctl_kv2_dot8(q, k + (long)(j + 2) * hs, hs, tail);
        __m256 s3 = llmctl_kv2_dot8(q, k + (long)(j + 3) * hs, hs, tail);
        sc[j] = llmctl_kv2_hsum(s0) * scale;
        sc[j + 1] = llmctl_kv2_hsum(s1) * scale;
        sc[j + 2] = llmctl_kv2_hsum(s2) * scale;
        sc[j + 3] = llmctl_kv2_hsum(s3) * scale;
    }
    for (; j < cnt; j++) sc[j] = llmctl_kv2_hsum(llmctl_kv2_dot8(q, k + (long)j * hs, hs, tail)) * scale;
}

/* columns i .. i+7 of the weighted sum of a segment's values (kvcache_row.h) */
LLMCTL_KV_PV_SEGMENT(llmctl_kv2_pv, LLMCTL_KV2_TGT, __m256, __m256i, _mm256_set1_ps, _mm256_maskload_ps, _mm256_fmadd_ps)

/* out (hs) = softmax(q K^T / sqrt(hs)) V over n keys; scores: scratch of n rounded up to 8.
 * Keys/values 0 .. np-1 are rows of kp/vp (a shared prefix; np = 0: none), the rest rows of k/v
 * from their start, as in kvcache_avx512.h: the same bits wherever the keys live. */
LLMCTL_KV2_TGT static void llmctl_kv_attend_avx2(float* out, const float* q, const float* kp, const float* vp,
                                                int np, const float* k, const float* v,
                                                int n, int hs, float scale, float* scores)
{
    const __m256i tail = llmctl_kv2_mask(hs % 8 ? hs % 8 : 8);
    const int n8 = (n + 7) / 8 * 8;
    float maxval, expsum, inv;
    __m256 mx, sum = _mm256_setzero_ps();
    int j;
    if (np > n) np = n;
    llmctl_kv2_scores(scores, q, kp, vp, np, hs, scale, tail);
    llmctl_kv2_scores(scores + np, q, k, v, n - np, hs, scale, tail);
    for (j = n; j < n8; j++) scores[j] = -INFINITY;      /* padding lanes: exp gives 0 */
    mx = _mm256_set1_ps(-10000.0f);
    for (j = 0; j < n8; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(scores + j));
    maxval = llmctl_kv2_hmax(mx);
    mx = _mm256_set1_ps(maxval);
    for (j = 0; j < n8; j += 8) {
        __m256 e = llmctl_expf8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), mx));
        _mm256_storeu_ps(scores + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    expsum = llmctl_kv2_hsum(sum);
    inv = expsum != 0.0f ? 1.0f / expsum : 0.0f;
    for (int i = 0; i < hs; i += 8) {   /* 8 output columns at a time, down the keys */
        __m256i m = i + 8 <= hs ? _mm256_set1_epi32(-1) : tail;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        llmctl_kv2_pv(&acc0, &acc1, scores, vp, np, 0, hs, i, m);
        llmctl_kv2_pv(&acc0, &acc1, scores + np, v, n - np, np & 1, hs, i, m);
        _mm256_maskstore_ps(out + i, m, _mm256_mul_ps(_mm256_add_ps(acc0, acc1), _mm256_set1_ps(inv)));
    }
}
#else   /* no AVX2 copy in this build: never called, as llmctl_kv_avx2_runs() says 0 */
static int llmctl_kv_avx2_runs(void) { return 0; }
static void llmctl_kv_attend_avx2(float* out, const float* q, const float* kp, const float* vp, int np,
                                  const float* k, const float* v, int n, int hs, float scale, float* scores)
{
    (void)out; (void)q; (void)kp; (void)vp; (void)np; (void)k; (void)v; (void)n; (void)hs; (void)scale; (void)scores;
}
#endif
#endif /* LLMCTL_KVCACHE_AVX2_H */
