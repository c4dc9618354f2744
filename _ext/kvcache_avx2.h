/* AVX2 form of kvcache.pyx's _attend_one, for CPUs without AVX-512 (kvcache_avx512.h's kernel
 * in 8 lanes): a query against n cached keys/values (rows of hs floats), as llm.c's
 * attention_forward computes a row (scale 1/sqrt(hs), softmax with exp(x - max), the max
 * starting at -10000, a multiply by 1/sum, out = sum_j att_j v_j), for up to LLMCTL_KV_QB queries
 * of one head at consecutive positions at once.
 *
 * What differs from the plain loops: each dot product is one FMA chain over hs and a horizontal
 * sum (llmctl_kv2_hsum's tree); the exp is mathf_avx2.h's (where the plain loops call libm's
 * expf, one element at a time); the sum of the exps keeps 8 lane partials; the weighted sum of
 * the values adds even and odd keys apart. So results differ from the plain loops' in the last
 * bits (tests/test_sample.py holds every copy to a float64 reference). Every query is computed by
 * one thread, and its bits do not depend on the other queries of the call.
 *
 * How it is fast, as the AVX-512 copy: the queries of a block read each key and value once
 * between them; eight keys' dot products run side by side and one shuffle network does their
 * eight reductions; the values' sum runs eight independent chains.
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

/* one vector r with r[j] = llmctl_kv2_hsum(a[j]) for 8 vectors a, each lane's sums in its tree
 * (the 128-bit halves, then the pairs (0, 2) and (1, 3), then those two), the same adds with the
 * same operands, so the same bits: three levels of shuffles that pair up two vectors' parts at a
 * time, then one permute into key order */
LLMCTL_KV2_TGT static inline __m256 llmctl_kv2_reduce8x8(const __m256* a)
{
    __m256 b[4], c[2], d;
    for (int m = 0; m < 4; m++)   /* keys 2m, 2m+1 in the halves: lanes i and i + 4 */
        b[m] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * m], a[2 * m + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * m], a[2 * m + 1], 0x31));
    for (int m = 0; m < 2; m++)   /* half h: keys 4m+h, 4m+2+h, two lanes each: (0, 2) and (1, 3) */
        c[m] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * m], b[2 * m + 1], 0x44),
                             _mm256_shuffle_ps(b[2 * m], b[2 * m + 1], 0xEE));
    /* element 4h + e: key 2e + h */
    d = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xDD));
    return _mm256_permutevar8x32_ps(d, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* (q . key jj) * scale for the 8 keys at kr (those from cnt on: -inf), each dot product the FMA
 * chain over hs's chunks of 8 that a one-key loop runs (the last chunk masked), eight keys'
 * chains independent, then one reduction of the eight */
LLMCTL_KV2_TGT static inline __m256 llmctl_kv2_scores8(const float* q, const float* const* kr, int cnt, int hs,
                                                      float scale, __m256i tail)
{
    __m256 a[8];
#pragma GCC unroll 8
    for (int jj = 0; jj < 8; jj++) {
        const float* r = kr[jj];
        __m256 s = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 < hs; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(r + i), s);
        a[jj] = _mm256_fmadd_ps(_mm256_maskload_ps(q + i, tail), _mm256_maskload_ps(r + i, tail), s);
    }
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                            _mm256_mul_ps(llmctl_kv2_reduce8x8(a), _mm256_set1_ps(scale)),
                            _mm256_castsi256_ps(llmctl_kv2_mask(cnt)));
}

/* the masks of the four chunks of 8 columns from i: whole, hs's tail, or past hs */
LLMCTL_KV2_TGT static inline void llmctl_kv2_masks(__m256i* m, int i, int hs, __m256i tail)
{
    for (int c = 0; c < 4; c++) {
        int lo = i + 8 * c;
        m[c] = lo + 8 <= hs ? _mm256_set1_epi32(-1) : lo < hs ? tail : _mm256_setzero_si256();
    }
}

/* LLMCTL_KV_ATTEND's PV: one query's value sums over keys j0 .. jend-1, 32 columns from i (16 ymm
 * registers: eight accumulators), even keys into one accumulator and odd ones into another per 8
 * columns */
LLMCTL_KV2_TGT static inline void llmctl_kv2_pv8(float* ac, const float* sc, const float* const* vr, int j0,
                                                int jend, int i, int hs, __m256i tail)
{
    __m256i m[4];
    __m256 a0[4], a1[4];
    int j;
    llmctl_kv2_masks(m, i, hs, tail);
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        a0[c] = j0 ? _mm256_loadu_ps(ac + 8 * c) : _mm256_setzero_ps();
        a1[c] = j0 ? _mm256_loadu_ps(ac + 32 + 8 * c) : _mm256_setzero_ps();
    }
    for (j = j0; j + 2 <= jend; j += 2) {
        const float* r0 = vr[j - j0] + i;
        const float* r1 = vr[j - j0 + 1] + i;
        __m256 p0 = _mm256_set1_ps(sc[j]), p1 = _mm256_set1_ps(sc[j + 1]);
        if (i + 32 <= hs) {
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                a0[c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(r0 + 8 * c), a0[c]);
                a1[c] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(r1 + 8 * c), a1[c]);
            }
        } else {
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                a0[c] = _mm256_fmadd_ps(p0, _mm256_maskload_ps(r0 + 8 * c, m[c]), a0[c]);
                a1[c] = _mm256_fmadd_ps(p1, _mm256_maskload_ps(r1 + 8 * c, m[c]), a1[c]);
            }
        }
    }
    if (j < jend) {
        const float* r0 = vr[j - j0] + i;
        __m256 p0 = _mm256_set1_ps(sc[j]);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) a0[c] = _mm256_fmadd_ps(p0, _mm256_maskload_ps(r0 + 8 * c, m[c]), a0[c]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        _mm256_storeu_ps(ac + 8 * c, a0[c]);
        _mm256_storeu_ps(ac + 32 + 8 * c, a1[c]);
    }
}

/* LLMCTL_KV_ATTEND's PV_OUT: (even + odd) / sum into the 32 columns from i */
LLMCTL_KV2_TGT static inline void llmctl_kv2_pv_out8(float* o, const float* ac, float inv, int i, int hs,
                                                    __m256i tail)
{
    __m256i m[4];
    llmctl_kv2_masks(m, i, hs, tail);
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++)
        _mm256_maskstore_ps(o + i + 8 * c, m[c], _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(ac + 8 * c),
                                                                           _mm256_loadu_ps(ac + 32 + 8 * c)),
                                                             _mm256_set1_ps(inv)));
}

/* the lanes of hs's last chunk of 8 */
LLMCTL_KV2_TGT static inline __m256i llmctl_kv2_tail(int hs)
{
    return llmctl_kv2_mask(hs % 8 ? hs % 8 : 8);
}

LLMCTL_KV_ATTEND(llmctl_kv_attend_avx2, LLMCTL_KV2_TGT, 8, 32, __m256, __m256i, llmctl_kv2_tail,
                 llmctl_kv2_scores8, llmctl_kv2_pv8, llmctl_kv2_pv_out8, _mm256_set1_ps, _mm256_setzero_ps,
                 _mm256_loadu_ps, _mm256_storeu_ps, _mm256_max_ps, _mm256_sub_ps, _mm256_add_ps, llmctl_expf8,
                 llmctl_kv2_hmax, llmctl_kv2_hsum)
#else   /* no AVX2 copy in this build: never called, as llmctl_kv_avx2_runs() says 0 */
static int llmctl_kv_avx2_runs(void) { return 0; }
static void llmctl_kv_attend_avx2(float* out, long out_stride, const float* q, long q_stride, int nq,
                                  const float* kp, const float* vp, int np, const float* k, const float* v,
                                  int n, int hs, float scale, float* scratch)
{
    (void)out; (void)out_stride; (void)q; (void)q_stride; (void)nq; (void)kp; (void)vp; (void)np; (void)k;
    (void)v; (void)n; (void)hs; (void)scale; (void)scratch;
}
#endif
#endif /* LLMCTL_KVCACHE_AVX2_H */
