/* AVX-512 form of kvcache.pyx's _attend_one: a query against n cached keys/values (rows of hs
 * floats), as llm.c's attention_forward computes a row (scale 1/sqrt(hs), softmax with
 * exp(x - max), the max starting at -10000, a multiply by 1/sum, out = sum_j att_j v_j), for up
 * to LLMCTL_KV_QB queries of one head at consecutive positions at once.
 *
 * What differs from the plain loops: each dot product is one vector FMA chain over hs and a
 * horizontal sum (GCC's _mm512_reduce_add_ps tree); the exp is mathf_avx512.h's (mathf.h's with
 * FMAs) (1-2 ulp, where the plain loops call libm's expf); the sum of the exps keeps 16 lane
 * partials; the weighted sum of the values adds even and odd keys apart. So results differ from
 * the plain loops' in the last bits (tests/test_sample.py holds both to a float64 reference).
 * Every query is still computed by one thread, whole, and alone: its bits do not depend on the
 * other queries of the call (a prompt's rows, a decode step's one).
 *
 * How it is fast: the queries of a block read each key and value once between them (from L2
 * for the first, then L1: a query at a time streamed every key from L2); sixteen keys' dot
 * products run side by side and one shuffle network reduces all sixteen (the adds of sixteen
 * reductions, in fewer instructions); the values' sum runs eight independent chains. Against
 * the query-at-a-time loops: 1.5-2x on a prompt's attention (docs/performance.md).
 */
#ifndef LLMCTL_KVCACHE_AVX512_H
#define LLMCTL_KVCACHE_AVX512_H

#include "kvcache_row.h"
#include <math.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(LLMCTL_NO_AVX_DISPATCH) && __GNUC__ >= 11
#include <immintrin.h>
#include "mathf_avx512.h"
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

/* one vector r with r[j] = _mm512_reduce_add_ps(a[j]) for 16 vectors a, each lane's sums in GCC's
 * tree for one vector (its 256-bit halves, then 128-bit quarters, then the pairs (0, 2) and
 * (1, 3), then those two), the same adds with the same operands, so the same bits: four levels
 * of shuffles that pair up two vectors' parts at a time, then one permute into key order. */
LLMCTL_KV_TGT static inline __m512 llmctl_kv_reduce16x16(const __m512* a)
{
    __m512 b[8], c[4], d[2], e;
    for (int m = 0; m < 8; m++)   /* keys 2m, 2m+1: lanes i and i + 8 */
        b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE),
                             _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44));
    for (int m = 0; m < 4; m++)   /* keys 4m .. 4m+3 in the 128-bit quarters: lanes i and i + 4 */
        c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0xDD),
                             _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0x88));
    for (int m = 0; m < 2; m++)   /* quarter k: keys 8m+k, 8m+4+k, two lanes each: (0, 2) and (1, 3) */
        d[m] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * m], c[2 * m + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * m], c[2 * m + 1], 0xEE));
    /* element 4k + m: key k + 4m */
    e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), e);
}

/* (q . key jj) * scale for the 16 keys at kr (those from cnt on: -inf), each dot product the FMA
 * chain over hs's chunks of 16 that a one-key loop runs (the last chunk masked), sixteen keys'
 * chains independent, then one reduction of the sixteen */
LLMCTL_KV_TGT static inline __m512 llmctl_kv_scores16(const float* q, const float* const* kr, int cnt, int hs,
                                                      float scale, __mmask16 tail)
{
    __m512 a[16];
    if (hs == 64) {   /* GPT-2's heads: the chains unrolled, the query in registers (the same adds) */
        __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16), q2 = _mm512_loadu_ps(q + 32),
               q3 = _mm512_loadu_ps(q + 48);
#pragma GCC unroll 16
        for (int jj = 0; jj < 16; jj++) {
            const float* r = kr[jj];
            __m512 s = _mm512_fmadd_ps(q0, _mm512_loadu_ps(r), _mm512_setzero_ps());
            s = _mm512_fmadd_ps(q1, _mm512_loadu_ps(r + 16), s);
            s = _mm512_fmadd_ps(q2, _mm512_loadu_ps(r + 32), s);
            a[jj] = _mm512_fmadd_ps(q3, _mm512_loadu_ps(r + 48), s);
        }
    } else {
#pragma GCC unroll 16
        for (int jj = 0; jj < 16; jj++) {
            const float* r = kr[jj];
            __m512 s = _mm512_setzero_ps();
            int i = 0;
            for (; i + 16 < hs; i += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(r + i), s);
            a[jj] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, q + i), _mm512_maskz_loadu_ps(tail, r + i), s);
        }
    }
    return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), (__mmask16)((1u << cnt) - 1u),
                              _mm512_mul_ps(llmctl_kv_reduce16x16(a), _mm512_set1_ps(scale)));
}

/* the masks of the four chunks of 16 columns from i: whole, hs's tail, or past hs */
LLMCTL_KV_TGT static inline void llmctl_kv_masks(__mmask16* m, int i, int hs, __mmask16 tail)
{
    for (int c = 0; c < 4; c++) {
        int lo = i + 16 * c;
        m[c] = lo + 16 <= hs ? (__mmask16)0xFFFF : lo < hs ? tail : (__mmask16)0;
    }
}

/* columns i .. i+63 of one query's weighted sum of the values over keys j .. jend-1 (j even), even
 * keys into a0 and odd ones into a1 per 16 columns; vr: the rows of keys j0 ..; LOAD(p, c) loads
 * chunk c of the 64 columns at p */
#define LLMCTL_KV_PV64(LOAD)                                                                        \
    for (; j + 2 <= jend; j += 2) {                                                                 \
        const float* r0 = vr[j - j0] + i;                                                           \
        const float* r1 = vr[j - j0 + 1] + i;                                                       \
        __m512 p0 = _mm512_set1_ps(sc[j]), p1 = _mm512_set1_ps(sc[j + 1]);                          \
        _Pragma("GCC unroll 4")                                                                     \
        for (int c = 0; c < 4; c++) {                                                               \
            a0[c] = _mm512_fmadd_ps(p0, LOAD(r0, c), a0[c]);                                        \
            a1[c] = _mm512_fmadd_ps(p1, LOAD(r1, c), a1[c]);                                        \
        }                                                                                           \
    }                                                                                               \
    if (j < jend) {                                                                                 \
        const float* r0 = vr[j - j0] + i;                                                           \
        __m512 p0 = _mm512_set1_ps(sc[j]);                                                          \
        _Pragma("GCC unroll 4")                                                                     \
        for (int c = 0; c < 4; c++) a0[c] = _mm512_fmadd_ps(p0, LOAD(r0, c), a0[c]);                \
    }
#define LLMCTL_KV_LOAD_FULL(r, c) _mm512_loadu_ps((r) + 16 * (c))
#define LLMCTL_KV_LOAD_MASKED(r, c) _mm512_maskz_loadu_ps(m[c], (r) + 16 * (c))

/* LLMCTL_KV_ATTEND's PV: one query's value sums over keys j0 .. jend-1, 64 columns from i, even
 * keys into one accumulator and odd ones into another per 16 columns (eight chains) */
LLMCTL_KV_TGT static inline void llmctl_kv_pv16(float* ac, const float* sc, const float* const* vr, int j0,
                                               int jend, int i, int hs, __mmask16 tail)
{
    __mmask16 m[4];
    __m512 a0[4], a1[4];
    int j = j0;
    llmctl_kv_masks(m, i, hs, tail);
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        a0[c] = j0 ? _mm512_loadu_ps(ac + 16 * c) : _mm512_setzero_ps();
        a1[c] = j0 ? _mm512_loadu_ps(ac + 64 + 16 * c) : _mm512_setzero_ps();
    }
    if (i + 64 <= hs) {   /* whole chunks (GPT-2's heads: hs = 64) */
        LLMCTL_KV_PV64(LLMCTL_KV_LOAD_FULL)
    } else {              /* zeros past hs */
        LLMCTL_KV_PV64(LLMCTL_KV_LOAD_MASKED)
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        _mm512_storeu_ps(ac + 16 * c, a0[c]);
        _mm512_storeu_ps(ac + 64 + 16 * c, a1[c]);
    }
}

/* LLMCTL_KV_ATTEND's PV_OUT: (even + odd) / sum into the 64 columns from i */
LLMCTL_KV_TGT static inline void llmctl_kv_pv_out16(float* o, const float* ac, float inv, int i, int hs,
                                                   __mmask16 tail)
{
    __mmask16 m[4];
    llmctl_kv_masks(m, i, hs, tail);
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++)
        _mm512_mask_storeu_ps(o + i + 16 * c, m[c], _mm512_mul_ps(_mm512_add_ps(_mm512_loadu_ps(ac + 16 * c),
                                                                              _mm512_loadu_ps(ac + 64 + 16 * c)),
                                                                _mm512_set1_ps(inv)));
}

LLMCTL_KV_ATTEND(llmctl_kv_attend_avx512, LLMCTL_KV_TGT, 16, 64, __m512, __mmask16, llmctl_kv_tail,
                 llmctl_kv_scores16, llmctl_kv_pv16, llmctl_kv_pv_out16, _mm512_set1_ps, _mm512_setzero_ps,
                 _mm512_loadu_ps, _mm512_storeu_ps, _mm512_max_ps, _mm512_sub_ps, _mm512_add_ps, llmctl_expf16,
                 _mm512_reduce_max_ps, _mm512_reduce_add_ps)
#else   /* no AVX-512 copy in this build: never called, as llmctl_kv_avx512_runs() says 0 */
static int llmctl_kv_avx512_runs(void) { return 0; }
static void llmctl_kv_attend_avx512(float* out, long out_stride, const float* q, long q_stride, int nq,
                                    const float* kp, const float* vp, int np, const float* k, const float* v,
                                    int n, int hs, float scale, float* scratch)
{
    (void)out; (void)out_stride; (void)q; (void)q_stride; (void)nq; (void)kp; (void)vp; (void)np; (void)k;
    (void)v; (void)n; (void)hs; (void)scale; (void)scratch;
}
#endif
#endif /* LLMCTL_KVCACHE_AVX512_H */
