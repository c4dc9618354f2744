/* A few rows times a bf16 weight matrix, for decoding: out (R,OC) fp32 = x (R,C) @ W (OC,C)^T
 * (+ bias), x and W bf16 (uint16 bit patterns, bf16.h), products exact and sums in fp32.
 *
 * Why: a decode step multiplies 1 row (sampling) or a few (a batch of prompts) by every weight
 * matrix. oneDNN's dnnl_gemm_bf16bf16f32 packs the weight for each call, so with M = 1 it moved
 * the bf16 weights at under a third of the rate NumPy's sgemv moves fp32 ones, and bf16 decoding
 * was slower than fp32. Here each weight row is read once, straight from memory, and used for
 * all R rows while it is in L1: a pass over the weights at memory speed, half the bytes of fp32.
 *
 * Two copies, chosen at run time (matmul.pyx):
 * - llmctl_gemv_bf16: AVX512_BF16's vdpbf16ps (32 bf16 pairs per instruction, each product
 *   exact, added into 16 fp32 lanes), the instruction oneDNN's own bf16 GEMM uses; like it,
 *   bf16 subnormal inputs count as zero.
 * - llmctl_gemv_bf16_avx2: any CPU with AVX2 and FMA. A decode step is bound by the bytes of
 *   the weights, not by the multiplies, so bf16 weights widened in registers (a shift or a mask:
 *   bf16 is the top half of an fp32) decode faster than fp32 ones without native bf16. It adds
 *   in vdpbf16ps's order as the Intel SDM defines it: lane j of 16 takes the pair (2j+1, 2j) of
 *   each 32-element chunk, odd element first, each an FMA; then the same loops, accumulators and
 *   final tree (GCC's _mm512_reduce_add_ps) as the AVX-512 copy. So the two give the same bits
 *   wherever the hardware follows that definition, except where an input, product or partial
 *   sum is subnormal (vdpbf16ps flushes those to zero; FMA keeps them). tests/test_bf16.py
 *   checks the AVX2 copy bit for bit against a NumPy model of that order, and the AVX-512 copy
 *   against the same model on CPUs that have it.
 * The build stays baseline x86-64: each function alone is compiled for its instruction set
 * (target attribute) and chosen at run time.
 *
 * Rows [o0, o1) of the output channels are computed, so threads can split OC.
 */
#ifndef LLMCTL_GEMV_BF16_H
#define LLMCTL_GEMV_BF16_H
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(LLMCTL_NO_AVX_DISPATCH) \
    && (__GNUC__ >= 10 || defined(__clang__))
#include <immintrin.h>

/* The AVX-512 this kernel needs besides AVX512_BF16 (which the caller has from
   llmctl_cpu_bf16_flags in dnnl_gemm.h, with the OS's XCR0 check). */
static int llmctl_gemv_bf16_supported(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

/* Both copies' PREFETCH: while the four rows at w are read at chunk c (32 bf16, 64 bytes of each),
   the next four rows, contiguous in memory, are fetched four cache lines a chunk in address
   order, so the weights ahead are one stream. Measured against fetching rows 8-11 at the same
   chunk (four streams, the pattern the AVX-512 copy had, tuned on an AMX Xeon), `python
   bench/sample.py --precision bf16 --other <that tree>`, alternating builds: bf16 decoding 1.30x
   and 1.59x (paired medians of two runs, 4 and 6 rounds; fp32 beside it 1.02x) on a Zen 4 with
   AVX512_BF16, 1.08x on a Zen 3 running the AVX2 copy
   (docs/performance.md); not measured again on the Xeon. */
static inline void llmctl_gemv_prefetch_next4(const uint16_t* w, int64_t C, int64_t c) {
    const char* p = (const char*)(w + 4 * C) + 8 * c;
    _mm_prefetch(p, _MM_HINT_T0);
    _mm_prefetch(p + 64, _MM_HINT_T0);
    _mm_prefetch(p + 128, _MM_HINT_T0);
    _mm_prefetch(p + 192, _MM_HINT_T0);
}

/* The loops of both copies, written once so that they add in the same order: rows [o0, o1) of
   the output channels; ACC holds 16 fp32 lanes, XT one chunk of 32 bf16 as loaded; ZERO(),
   LOAD(p, n) (the 32 bf16 at p, zeros past n: the C tail), DP(acc, x, w) (acc += x . w over
   one chunk, in vdpbf16ps's order), ADD(a, b) (lane by lane), SUM(acc) (the 16 lanes, as GCC's
   _mm512_reduce_add_ps adds them), PREFETCH(w, C, c) (one row sampled: the weights ahead of the
   four rows at w, while their chunk at c is read; prefetching changes no result). */
#define LLMCTL_GEMV_LOOPS(NAME, ATTR, ACC, XT, ZERO, LOAD, DP, ADD, SUM, PREFETCH)                \
ATTR static void NAME(float* out, const uint16_t* x, const uint16_t* W, const float* bias, int R,     \
                      int64_t C, int64_t OC, int64_t o0, int64_t o1) {                              \
    int64_t o = o0;                                                                                 \
    if (R == 1) {   /* sampling: one sequential pass over the rows, four rows (chains) at a time,  \
                       the weights ahead prefetched (PREFETCH) */                                   \
        for (; o + 4 <= o1; o += 4) {                                                               \
            const uint16_t* w = W + o * C;                                                          \
            ACC a0 = ZERO(), a1 = a0, a2 = a0, a3 = a0;                                             \
            for (int64_t c = 0; c < C; c += 32) {                                                   \
                XT xv = LOAD(x + c, C - c);                                                         \
                PREFETCH(w, C, c);                                                                  \
                a0 = DP(a0, xv, LOAD(w + c, C - c));                                                \
                a1 = DP(a1, xv, LOAD(w + C + c, C - c));                                            \
                a2 = DP(a2, xv, LOAD(w + 2 * C + c, C - c));                                        \
                a3 = DP(a3, xv, LOAD(w + 3 * C + c, C - c));                                        \
            }                                                                                       \
            out[o] = SUM(a0) + (bias ? bias[o] : 0.0f);                                             \
            out[o + 1] = SUM(a1) + (bias ? bias[o + 1] : 0.0f);                                     \
            out[o + 2] = SUM(a2) + (bias ? bias[o + 2] : 0.0f);                                     \
            out[o + 3] = SUM(a3) + (bias ? bias[o + 3] : 0.0f);                                     \
        }                                                                                           \
        for (; o < o1; o++) {                                                                       \
            const uint16_t* w = W + o * C;                                                          \
            ACC a0 = ZERO(), a1 = a0, a2 = a0, a3 = a0;                                             \
            int64_t c = 0;                                                                          \
            for (; c + 128 <= C; c += 128) {                                                        \
                a0 = DP(a0, LOAD(x + c, 32), LOAD(w + c, 32));                                      \
                a1 = DP(a1, LOAD(x + c + 32, 32), LOAD(w + c + 32, 32));                            \
                a2 = DP(a2, LOAD(x + c + 64, 32), LOAD(w + c + 64, 32));                            \
                a3 = DP(a3, LOAD(x + c + 96, 32), LOAD(w + c + 96, 32));                            \
            }                                                                                       \
            for (; c < C; c += 32)                                                                  \
                a0 = DP(a0, LOAD(x + c, C - c), LOAD(w + c, C - c));                                \
            a0 = ADD(ADD(a0, a1), ADD(a2, a3));                                                     \
            out[o] = SUM(a0) + (bias ? bias[o] : 0.0f);                                             \
        }                                                                                           \
        return;                                                                                     \
    }                                                                                               \
    for (; o + 4 <= o1; o += 4) {   /* four weight rows (4 x 1.5 KB at C = 768) stay in L1 */       \
        const uint16_t* w0 = W + o * C;                                                             \
        for (int r = 0; r < R; r++) {                                                               \
            const uint16_t* xr = x + (int64_t)r * C;                                                \
            ACC a0 = ZERO(), a1 = a0, a2 = a0, a3 = a0;                                             \
            for (int64_t c = 0; c < C; c += 32) {                                                   \
                XT xv = LOAD(xr + c, C - c);                                                        \
                a0 = DP(a0, xv, LOAD(w0 + c, C - c));                                               \
                a1 = DP(a1, xv, LOAD(w0 + C + c, C - c));                                           \
                a2 = DP(a2, xv, LOAD(w0 + 2 * C + c, C - c));                                       \
                a3 = DP(a3, xv, LOAD(w0 + 3 * C + c, C - c));                                       \
            }                                                                                       \
            float* y = out + (int64_t)r * OC + o;                                                   \
            y[0] = SUM(a0) + (bias ? bias[o] : 0.0f);                                               \
            y[1] = SUM(a1) + (bias ? bias[o + 1] : 0.0f);                                           \
            y[2] = SUM(a2) + (bias ? bias[o + 2] : 0.0f);                                           \
            y[3] = SUM(a3) + (bias ? bias[o + 3] : 0.0f);                                           \
        }                                                                                           \
    }                                                                                               \
    for (; o < o1; o++) {                                                                           \
        const uint16_t* w0 = W + o * C;                                                             \
        for (int r = 0; r < R; r++) {                                                               \
            const uint16_t* xr = x + (int64_t)r * C;                                                \
            ACC a0 = ZERO();                                                                        \
            for (int64_t c = 0; c < C; c += 32)                                                     \
                a0 = DP(a0, LOAD(xr + c, C - c), LOAD(w0 + c, C - c));                              \
            out[(int64_t)r * OC + o] = SUM(a0) + (bias ? bias[o] : 0.0f);                           \
        }                                                                                           \
    }                                                                                               \
}

/* ---- AVX512_BF16: vdpbf16ps ---- */
#define LLMCTL_GEMV_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

LLMCTL_GEMV_TARGET static inline __m512i llmctl_gemv_load(const uint16_t* p, int64_t n) {
    if (n >= 32) return _mm512_loadu_si512((const void*)p);
    return _mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), (const void*)p);
}

LLMCTL_GEMV_TARGET static inline __m512 llmctl_gemv_dp(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

LLMCTL_GEMV_LOOPS(llmctl_gemv_bf16, LLMCTL_GEMV_TARGET, __m512, __m512i, _mm512_setzero_ps, llmctl_gemv_load,
                  llmctl_gemv_dp, _mm512_add_ps, _mm512_reduce_add_ps, llmctl_gemv_prefetch_next4)
#undef LLMCTL_GEMV_TARGET

/* ---- AVX2 + FMA: bf16 widened in registers, added in vdpbf16ps's order ---- */
static int llmctl_gemv_bf16_avx2_supported(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

#define LLMCTL_GEMV2_TARGET __attribute__((target("avx2,fma")))

/* 32 bf16 as vdpbf16ps sees them: the odd and even elements of the first 16 (lanes 0-7) and of
   the last 16 (lanes 8-15), widened to fp32 */
typedef struct { __m256 o0, e0, o1, e1; } llmctl_bf16x32;

LLMCTL_GEMV2_TARGET static inline llmctl_bf16x32 llmctl_gemv2_load(const uint16_t* p, int64_t n) {
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256i v0, v1;
    llmctl_bf16x32 r;
    if (n >= 32) {
        v0 = _mm256_loadu_si256((const __m256i*)p);
        v1 = _mm256_loadu_si256((const __m256i*)(p + 16));
    } else {
        uint16_t t[32] = {0};
        memcpy(t, p, (size_t)n * sizeof(uint16_t));
        v0 = _mm256_loadu_si256((const __m256i*)t);
        v1 = _mm256_loadu_si256((const __m256i*)(t + 16));
    }
    r.o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, hi));
    r.e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
    r.o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, hi));
    r.e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
    return r;
}

/* 16 fp32 lanes (a: 0-7, b: 8-15) as one vdpbf16ps accumulator */
typedef struct { __m256 a, b; } llmctl_acc16;

LLMCTL_GEMV2_TARGET static inline llmctl_acc16 llmctl_gemv2_zero(void) {
    llmctl_acc16 z;
    z.a = _mm256_setzero_ps();
    z.b = z.a;
    return z;
}

/* lane j += x[2j+1] w[2j+1], then += x[2j] w[2j], each one FMA */
LLMCTL_GEMV2_TARGET static inline llmctl_acc16 llmctl_gemv2_dp(llmctl_acc16 acc, llmctl_bf16x32 x,
                                                               llmctl_bf16x32 w) {
    acc.a = _mm256_fmadd_ps(x.o0, w.o0, acc.a);
    acc.b = _mm256_fmadd_ps(x.o1, w.o1, acc.b);
    acc.a = _mm256_fmadd_ps(x.e0, w.e0, acc.a);
    acc.b = _mm256_fmadd_ps(x.e1, w.e1, acc.b);
    return acc;
}

LLMCTL_GEMV2_TARGET static inline llmctl_acc16 llmctl_gemv2_add(llmctl_acc16 x, llmctl_acc16 y) {
    x.a = _mm256_add_ps(x.a, y.a);
    x.b = _mm256_add_ps(x.b, y.b);
    return x;
}

/* GCC's _mm512_reduce_add_ps: t[k] = v[k] + v[k+8]; u[k] = t[k] + t[k+4]; (u0 + u2) + (u1 + u3) */
LLMCTL_GEMV2_TARGET static inline float llmctl_gemv2_sum(llmctl_acc16 acc) {
    __m256 t = _mm256_add_ps(acc.b, acc.a);
    __m128 u = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    __m128 v = _mm_add_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(v) + _mm_cvtss_f32(_mm_shuffle_ps(v, v, _MM_SHUFFLE(1, 1, 1, 1)));
}

LLMCTL_GEMV_LOOPS(llmctl_gemv_bf16_avx2, LLMCTL_GEMV2_TARGET, llmctl_acc16, llmctl_bf16x32, llmctl_gemv2_zero,
                  llmctl_gemv2_load, llmctl_gemv2_dp, llmctl_gemv2_add, llmctl_gemv2_sum, llmctl_gemv_prefetch_next4)
#undef LLMCTL_GEMV2_TARGET
#undef LLMCTL_GEMV_LOOPS
#else
static int llmctl_gemv_bf16_supported(void) { return 0; }
static int llmctl_gemv_bf16_avx2_supported(void) { return 0; }
static void llmctl_gemv_bf16(float* out, const uint16_t* x, const uint16_t* W, const float* bias,
                             int R, int64_t C, int64_t OC, int64_t o0, int64_t o1) {
    (void)out; (void)x; (void)W; (void)bias; (void)R; (void)C; (void)OC; (void)o0; (void)o1;
}
static void llmctl_gemv_bf16_avx2(float* out, const uint16_t* x, const uint16_t* W, const float* bias,
                                  int R, int64_t C, int64_t OC, int64_t o0, int64_t o1) {
    (void)out; (void)x; (void)W; (void)bias; (void)R; (void)C; (void)OC; (void)o0; (void)o1;
}
#endif
#endif
