/* bf16 attention for _ext/attention.pyx: the QK^T and PV products (forward) and the five
 * products of the backward as blocked bf16 x bf16 -> fp32 GEMMs. The backward is the fp32 kernels'
 * flash-attention-2 recurrence (attention_kernels.h); the forward takes each block of 32 query
 * rows against all the keys it sees at once (their scores, keys x 32 fp32, sit in the thread's
 * scratch: O(T), never T x T), so its softmax is exact rather than online.
 *
 * Numerics, the same on every path: q, k, v and dout are rounded to bf16 (round to nearest
 * even, bf16.h; a bf16 subnormal becomes a signed zero, as the hardware's DAZ does), and so are
 * the probabilities P before P V, P^T dout, and dS before dS K, dS^T Q. Every product of two bf16
 * is exact in fp32 and is added into an fp32 accumulator. Everything else (scores, the row
 * max and sum, lse, D = dout.out, dS = P (dP - D) / sqrt(hs), the accumulation of dQ, dK, dV) is
 * fp32, as in the fp32 kernels (the exp is attention_kernels.h's range reduction and polynomial,
 * written here, so the bf16 results do not depend on the fp32 kernel set). The native paths run
 * the per-block steps in AVX-512 (attention_bf16_avx512.h: the exp with FMAs, row sums two keys
 * at a time); the paths' GEMMs differ in the order of their fp32 additions:
 *   "amx"          AMX tiles (TDPBF16PS), 32 x 32 output blocks of four 16 x 16 tiles;
 *   "avx512_bf16"  VDPBF16PS, 8 rows x 32 columns of accumulators in registers;
 *   "emulated"     plain C on fp32: each pair adds a[2r+1] b[2r+1], then a[2r] b[2r] (VDPBF16PS's
 *                  documented order), so tests and CPUs without native bf16 run the same math.
 *
 * Layout: each (batch, head) rounds its own rows of q, k, v (and dout) into bf16 rows in its
 * thread's scratch, padded to 32 rows and hsp = hs rounded up to 32 columns (zeros), and
 * rearranges them into the two forms a GEMM C += A B needs here: A row-major (M x K), and B
 * "pair-packed" (K/2 x N x 2: row r holds, for each column n, B[2r][n] and B[2r+1][n] next to
 * each other), which is AMX's VNNI tile layout and what one VDPBF16PS lane reads. M, N and K are
 * multiples of 32. The forward works on transposed blocks (S^T = K Q^T, out^T = V^T P^T) so the
 * softmax has the query rows in the vector lanes; the backward computes dK^T and dV^T, each key
 * block's products over all the query rows that see it as one GEMM.
 */
#ifndef LLMCTL_ATTENTION_BF16_H
#define LLMCTL_ATTENTION_BF16_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "bf16.h"
#include "attention_kernels.h"

enum { ATTB_EMULATED = 0, ATTB_AVX512_BF16 = 1, ATTB_AMX = 2, ATTB_N_PATH = 3 };
#define ATTB_BLK 32
/* the backward's dQ += dS K runs once per this many keys (a multiple of ATTB_BLK), not per key block */
#define ATTB_DQ_KEYS 128
#define ATTB_AHEAD 8     /* rows a head's packing prefetches ahead */
#define ATTB_DLANES 16   /* the backward's D = dout . out: partial sums, whatever the vector width */

typedef void (*attb_gemm_t)(float* C, ptrdiff_t ldc, const uint16_t* A, ptrdiff_t lda,
                            const uint16_t* B, ptrdiff_t ldb, int M, int N, int K, int acc);

static unsigned attb_ran_bits = 0;   /* which paths ran since the last reset: a test hook */
static inline void attb_mark(int path)
{
    unsigned bit = 1u << path;
    if (!(__atomic_load_n(&attb_ran_bits, __ATOMIC_RELAXED) & bit))
        __atomic_fetch_or(&attb_ran_bits, bit, __ATOMIC_RELAXED);
}
static unsigned attb_ran_take(int reset)
{
    unsigned r = attb_ran_bits;
    if (reset) attb_ran_bits = 0;
    return r;
}

/* a bf16 subnormal flushed to a signed zero */
static inline uint16_t attb_flush(uint16_t h)
{
    uint16_t keep = (uint16_t)-(uint16_t)((h & 0x7F80u) != 0);   /* branch-free: vectorises */
    return (uint16_t)((h & keep) | (h & 0x8000u & ~keep));
}

/* fp32 -> bf16, round to nearest even; subnormal results flushed to a signed zero */
static inline uint16_t attb_rnd(float x)
{
    return attb_flush(llmctl_f32_to_bf16(x));
}

/* ---- the three GEMMs: C (M x N, fp32, ldc) += A (M x K, bf16, lda) B (pair-packed, ldb);
   with acc = 0, C = A B (C starts from zeros instead of its contents) ---- */

static void attb_gemm_emulated(float* C, ptrdiff_t ldc, const uint16_t* A, ptrdiff_t lda,
                               const uint16_t* B, ptrdiff_t ldb, int M, int N, int K, int acc)
{
    /* B widened once per call into two planes (even and odd k), so the inner loop is a plain
       contiguous multiply-add that compilers vectorise; blocks of up to 64 columns */
    float b0[16 * 64], b1[16 * 64];
    for (int n0 = 0; n0 < N; n0 += 64) {
        int nn = N - n0 < 64 ? N - n0 : 64;
        for (int r0 = 0; r0 < K / 2; r0 += 16) {
            int nr = K / 2 - r0 < 16 ? K / 2 - r0 : 16;
            for (int r = 0; r < nr; r++)
                for (int n = 0; n < nn; n++) {
                    b0[r * 64 + n] = llmctl_bf16_to_f32(B[(r0 + r) * ldb + 2 * (n0 + n)]);
                    b1[r * 64 + n] = llmctl_bf16_to_f32(B[(r0 + r) * ldb + 2 * (n0 + n) + 1]);
                }
            for (int i = 0; i < M; i++) {
                float* c = C + i * ldc + n0;
                const uint16_t* a = A + i * lda;
                if (!acc && r0 == 0) memset(c, 0, (size_t)nn * 4);
                for (int r = 0; r < nr; r++) {
                    float a0 = llmctl_bf16_to_f32(a[2 * (r0 + r)]), a1 = llmctl_bf16_to_f32(a[2 * (r0 + r) + 1]);
                    const float* p0 = b0 + r * 64;
                    const float* p1 = b1 + r * 64;
                    for (int n = 0; n < nn; n++) c[n] = (c[n] + a1 * p1[n]) + a0 * p0[n];
                }
            }
        }
    }
}

#if defined(__GNUC__) && defined(__x86_64__) && !defined(LLMCTL_NO_AVX_DISPATCH) \
    && (__GNUC__ >= 11 || (defined(__clang__) && __clang_major__ >= 12))
#define ATTB_X86 1
#include <immintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ATTB_TGT_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define ATTB_TGT_AMX __attribute__((target("amx-tile,amx-bf16,avx512f")))

/* one row of the 8 x 32 register block: C row i's two accumulators += A[i][2r, 2r+1] (broadcast) B's pair row r */
#define ATTB_DP_ROW(i)                                                                          \
    memcpy(&w, a + (i) * lda + 2 * r, 4);                                                       \
    x = (__m512bh)_mm512_set1_epi32((int)w);                                                    \
    c[i][0] = _mm512_dpbf16_ps(c[i][0], x, b0);                                                 \
    c[i][1] = _mm512_dpbf16_ps(c[i][1], x, b1);

/* 8 rows x 32 columns of accumulators (16 of the 32 registers): each pair row of B, two loads,
   serves 16 VDPBF16PS (4 rows did 8, and the loads were the limit). M is a multiple of 8 (of 32
   here); every C element still adds its pairs in K order, so the tile shape changes no bit. */
ATTB_TGT_BF16 static void attb_gemm_avx512_bf16(float* C, ptrdiff_t ldc, const uint16_t* A,
                                                ptrdiff_t lda, const uint16_t* B, ptrdiff_t ldb,
                                                int M, int N, int K, int acc)
{
    for (int m = 0; m < M; m += 8)
        for (int n = 0; n < N; n += 32) {
            float* cp = C + m * ldc + n;
            __m512 c[8][2];
            for (int i = 0; i < 8; i++) {
                c[i][0] = acc ? _mm512_loadu_ps(cp + i * ldc) : _mm512_setzero_ps();
                c[i][1] = acc ? _mm512_loadu_ps(cp + i * ldc + 16) : _mm512_setzero_ps();
            }
            const uint16_t* a = A + m * lda;
            for (int r = 0; r < K / 2; r++) {
                const uint16_t* b = B + r * ldb + 2 * n;
                __m512bh b0 = (__m512bh)_mm512_loadu_si512((const void*)b);
                __m512bh b1 = (__m512bh)_mm512_loadu_si512((const void*)(b + 32));
                uint32_t w;
                __m512bh x;
                ATTB_DP_ROW(0) ATTB_DP_ROW(1) ATTB_DP_ROW(2) ATTB_DP_ROW(3)
                ATTB_DP_ROW(4) ATTB_DP_ROW(5) ATTB_DP_ROW(6) ATTB_DP_ROW(7)
            }
            for (int i = 0; i < 8; i++) {
                _mm512_storeu_ps(cp + i * ldc, c[i][0]);
                _mm512_storeu_ps(cp + i * ldc + 16, c[i][1]);
            }
        }
}
#undef ATTB_DP_ROW

/* tiles 0-3: the 2 x 2 fp32 blocks of C; 4-5: two 16-row slices of A; 6-7: two 16-column
   slices of B. Every tile is 16 rows of 64 bytes (palette 1). */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} attb_tilecfg;

/* a static constant: gcc drops stores to a stack copy, as it does not see ldtilecfg read them */
static const attb_tilecfg attb_cfg = {
    1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0},
    {16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0}};

ATTB_TGT_AMX static void attb_amx_begin(void) { _tile_loadconfig(&attb_cfg); }

ATTB_TGT_AMX static void attb_amx_end(void) { _tile_release(); }

ATTB_TGT_AMX static void attb_gemm_amx(float* C, ptrdiff_t ldc, const uint16_t* A, ptrdiff_t lda,
                                       const uint16_t* B, ptrdiff_t ldb, int M, int N, int K, int acc)
{
    const size_t sc = (size_t)ldc * 4, sa = (size_t)lda * 2, sb = (size_t)ldb * 2;
    for (int m = 0; m < M; m += 32)
        for (int n = 0; n < N; n += 32) {
            float* c = C + m * ldc + n;
            if (acc) {
                _tile_loadd(0, c, sc);
                _tile_loadd(1, c + 16, sc);
                _tile_loadd(2, c + 16 * ldc, sc);
                _tile_loadd(3, c + 16 * ldc + 16, sc);
            } else {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int k = 0; k < K; k += 32) {
                const uint16_t* a = A + m * lda + k;
                const uint16_t* b = B + (k / 2) * ldb + 2 * n;
                _tile_loadd(4, a, sa);
                _tile_loadd(5, a + 16 * lda, sa);
                _tile_loadd(6, b, sb);
                _tile_loadd(7, b + 32, sb);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, c, sc);
            _tile_stored(1, c + 16, sc);
            _tile_stored(2, c + 16 * ldc, sc);
            _tile_stored(3, c + 16 * ldc + 16, sc);
        }
}

/* Linux hands out AMX tile state only to a process that asks (ARCH_REQ_XCOMP_PERM for
   XFEATURE_XTILEDATA); without it the first tile instruction faults. Asked once per process. */
static int attb_amx_permitted(void)
{
    static int state = -1;
    if (state < 0)
        state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

/* bf16_flags: llmctl_cpu_bf16_flags() (bit 0 AVX512_BF16, bit 1 AMX-BF16, with the OS checks) */
static int attb_path_runs(int path, int bf16_flags)
{
    __builtin_cpu_init();
    if (path == ATTB_EMULATED) return 1;
    if (path == ATTB_AVX512_BF16)
        return (bf16_flags & 1) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    if (path == ATTB_AMX) {
        unsigned a, b, c, d;
        /* the native copy's roundings are AVX512_BF16's (every AMX-BF16 CPU has it) */
#ifdef LLMCTL_SIMDE_AVX512
        return (bf16_flags & 3) == 3;               /* the SIMDe test build's tiles (simde_avx512.h) */
#endif
        if ((bf16_flags & 3) != 3 || !__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)))
            return 0;                               /* AMX-TILE */
        return __builtin_cpu_supports("avx512f") && attb_amx_permitted();
    }
    return 0;
}
static const attb_gemm_t attb_gemms[ATTB_N_PATH] = {attb_gemm_emulated, attb_gemm_avx512_bf16, attb_gemm_amx};
#else
static int attb_path_runs(int path, int bf16_flags) { (void)bf16_flags; return path == ATTB_EMULATED; }
static const attb_gemm_t attb_gemms[ATTB_N_PATH] = {attb_gemm_emulated, 0, 0};
static void attb_amx_begin(void) {}
static void attb_amx_end(void) {}
#endif

static inline ptrdiff_t attb_pad(ptrdiff_t n, ptrdiff_t to) { return (n + to - 1) / to * to; }

/* what the heads read: q, k, v (B,T,3C) in fp32 or bf16 (one of qkv32, qkv16); for the
   backward also dout (B,T,C) fp32 and the forward's output, fp32 or bf16 (out, out16) */
typedef struct {
    const float* qkv32;
    const uint16_t* qkv16;
    const float* dout;
    const uint16_t* dout16;   /* or dout in bf16 (the attproj backward GEMM's rounded output) */
    const float* out;
    const uint16_t* out16;
} attb_src;

/* per thread: one head's rows and their paired layouts, the block buffers */
static ptrdiff_t attb_forward_scratch_bytes(ptrdiff_t T, ptrdiff_t hs)
{
    ptrdiff_t Tp = attb_pad(T, ATTB_BLK), hsp = attb_pad(hs, 32);
    return 5 * Tp * hsp * 2 + Tp * ATTB_BLK * 2                        /* K, q v rows, Q^T, V^T, P^T */
           + (Tp * ATTB_BLK + ATTB_BLK * hsp + 2 * ATTB_BLK) * 4;      /* S^T, out^T, m l */
}

static ptrdiff_t attb_backward_scratch_bytes(ptrdiff_t T, ptrdiff_t hs)
{
    ptrdiff_t Tp = attb_pad(T, ATTB_BLK), hsp = attb_pad(hs, 32), BB = ATTB_BLK * ATTB_BLK;
    return 9 * Tp * hsp * 2 + (BB + 2 * Tp * ATTB_BLK + Tp * ATTB_DQ_KEYS) * 2   /* Q dout k v Qr Kc Kr Vc Or, P, P dS, dS */
           + (Tp * hsp + 2 * Tp * ATTB_BLK + 4 * ATTB_BLK * hsp + Tp) * 4;  /* dq, S, dP, dk^T, dv^T, dk, dv, D */
}

#define ATTB_FN(name) attb_##name##_base
#include "attention_bf16_body.h"
#undef ATTB_FN
#ifdef ATTB_X86
#include "attention_bf16_avx512.h"
#pragma GCC push_options
#ifndef LLMCTL_SIMDE_AVX512   /* the SIMDe test build (simde_avx512.h) emits no AVX-512 instruction */
#pragma GCC target("avx512f,avx512bw,avx512bf16")
#endif
#define ATTB_FN(name) attb_##name##_avx512
#define ATTB_V512 1
#include "attention_bf16_body.h"
#undef ATTB_V512
#undef ATTB_FN
#pragma GCC pop_options
#define ATTB_NATIVE(name) attb_##name##_avx512
#else
#define ATTB_NATIVE(name) attb_##name##_base
#endif

/* path picks the copy: the emulated path runs the baseline one, the native paths AVX-512's */

/* out (B,T,C) rows of head h (fp32, or with out16 non-NULL bf16 there), lse (B,NH,T), from src's qkv */
static void attb_forward_head(float* out, uint16_t* out16, float* lse, const attb_src* src, ptrdiff_t b,
                              ptrdiff_t h, ptrdiff_t T, ptrdiff_t C, ptrdiff_t NH, void* scratch, int path)
{
    (path == ATTB_EMULATED ? attb_forward_head_base : ATTB_NATIVE(forward_head))
        (out, out16, lse, src, b, h, T, C, NH, scratch, path);
}

/* dqkv (B,T,3C) += (acc) or = the gradient of head h, or (dqkv NULL) dqkv16 = its bf16
   rounding; part: 3 x hs column sums of that gradient (+=), or NULL. From src's qkv, dout, out */
static void attb_backward_head(float* dqkv, uint16_t* dqkv16, double* part, const attb_src* src,
                               const float* lse, ptrdiff_t b, ptrdiff_t h, ptrdiff_t T, ptrdiff_t C,
                               ptrdiff_t NH, void* scratch, int path, int acc)
{
    (path == ATTB_EMULATED ? attb_backward_head_base : ATTB_NATIVE(backward_head))
        (dqkv, dqkv16, part, src, lse, b, h, T, C, NH, scratch, path, acc);
}
#endif /* LLMCTL_ATTENTION_BF16_H */
