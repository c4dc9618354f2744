/* Test builds only: setup.py with LLMCTL_SIMDE_AVX512=1 puts this header before every
 * extension's code (tests/test_avx512_emulated.py). The kernels' AVX-512 copies then compile
 * against SIMDe's portable forms of the AVX-512 intrinsics (the simde-py package's headers) and
 * run on any x86-64 CPU with AVX2 and FMA: slowly, but with the instructions' results, so the
 * copies can be tested where the CPU has no AVX-512. Two rewrites make that so:
 *   - every function that asks for an AVX-512 target (or any other) is compiled for AVX2 + FMA,
 *     so no AVX-512 instruction is ever emitted;
 *   - __builtin_cpu_supports says yes to AVX-512's parts, so the run-time dispatch picks them.
 * AVX512_BF16 and AMX are emulated too (vdpbf16ps and the tile instructions below, in the Intel
 * SDM's definitions): dnnl_gemm.h's llmctl_cpu_bf16_flags reports both in this build, and
 * attention_bf16.h skips the kernel's permission request for the tiles.
 * Never part of a release build. */
#ifndef LLMCTL_SIMDE_AVX512_H
#define LLMCTL_SIMDE_AVX512_H
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1   /* as pyconfig.h does: this header comes before Python.h */
#endif
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#define LLMCTL_SIMDE_AVX512 1

/* what SIMDe 0.8.2 leaves out, as GCC's immintrin.h defines it: _mm512_reduce_add_ps is GCC's
   tree (the halves, then the quarters, then pairs), not one instruction, so its bits are GCC's */
static inline float llmctl_simde_reduce_add_ps(simde__m512 a)
{
    simde__m512_private p = simde__m512_to_private(a);
    float t3[8], t6[4], t8[2];
    for (int i = 0; i < 8; i++) t3[i] = p.f32[8 + i] + p.f32[i];
    for (int i = 0; i < 4; i++) t6[i] = t3[4 + i] + t3[i];
    for (int i = 0; i < 2; i++) t8[i] = t6[i] + t6[i + 2];
    return t8[0] + t8[1];
}
#define _mm512_reduce_add_ps(a) llmctl_simde_reduce_add_ps(a)
static inline simde__m256i llmctl_simde_cvtepi32_epi16(simde__m512i a)   /* vpmovdw: truncates */
{
    simde__m512i_private p = simde__m512i_to_private(a);
    simde__m256i_private r;
    for (int i = 0; i < 16; i++) r.i16[i] = (int16_t)p.i32[i];
    return simde__m256i_from_private(r);
}
#define _mm512_cvtepi32_epi16(a) llmctl_simde_cvtepi32_epi16(a)
static inline simde__m512i llmctl_simde_i32gather_epi32(simde__m512i idx, const void* base, int scale)
{
    simde__m512i_private p = simde__m512i_to_private(idx), r;
    for (int i = 0; i < 16; i++) memcpy(&r.i32[i], (const char*)base + (ptrdiff_t)p.i32[i] * scale, 4);
    return simde__m512i_from_private(r);
}
#define _mm512_i32gather_epi32(idx, base, scale) llmctl_simde_i32gather_epi32((idx), (base), (scale))
/* vdpbf16ps as the Intel SDM defines it, which the kernels' other copies follow (gemv_bf16.h,
   attention_bf16.h's emulated path): lane j adds x[2j+1] y[2j+1], then x[2j] y[2j], each product
   exact and each add rounded once (an FMA), subnormal inputs and results flushed to zero.
   SIMDe's form adds the even product first. */
static inline float llmctl_simde_ftz(float x) { return fabsf(x) < 1.17549435e-38f ? 0.0f * x : x; }
static inline float llmctl_simde_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return llmctl_simde_ftz(f);
}
static inline simde__m512 llmctl_simde_dpbf16_ps(simde__m512 src, simde__m512bh a, simde__m512bh b)
{
    simde__m512_private s = simde__m512_to_private(src);
    uint16_t x[32], y[32];
    memcpy(x, &a, 64);
    memcpy(y, &b, 64);
    for (int j = 0; j < 16; j++) {
        float acc = llmctl_simde_ftz(s.f32[j]);
        acc = llmctl_simde_ftz(fmaf(llmctl_simde_bf16(x[2 * j + 1]), llmctl_simde_bf16(y[2 * j + 1]), acc));
        s.f32[j] = llmctl_simde_ftz(fmaf(llmctl_simde_bf16(x[2 * j]), llmctl_simde_bf16(y[2 * j]), acc));
    }
    return simde__m512_from_private(s);
}
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps(src, a, b) llmctl_simde_dpbf16_ps((src), (a), (b))
/* vcvtne2ps2bf16 / vcvtneps2bf16 as the Intel SDM defines them (SIMDe 0.8.2 has neither): a zero
   or subnormal input gives a signed zero, a NaN its top half made quiet, anything else rounds to
   nearest even */
static inline uint16_t llmctl_simde_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7F800000u) == 0) return (uint16_t)((u >> 16) & 0x8000u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline simde__m512bh llmctl_simde_cvtne2ps_pbh(simde__m512 a, simde__m512 b)
{
    float x[16], y[16];
    uint16_t w[32];
    simde__m512bh r;
    memcpy(x, &a, 64);
    memcpy(y, &b, 64);
    for (int j = 0; j < 16; j++) {
        w[j] = llmctl_simde_to_bf16(y[j]);        /* b in the low half */
        w[16 + j] = llmctl_simde_to_bf16(x[j]);
    }
    memcpy(&r, w, 64);
    return r;
}
static inline simde__m256bh llmctl_simde_cvtneps_pbh(simde__m512 a)
{
    float x[16];
    uint16_t w[16];
    simde__m256bh r;
    memcpy(x, &a, 64);
    for (int j = 0; j < 16; j++) w[j] = llmctl_simde_to_bf16(x[j]);
    memcpy(&r, w, 32);
    return r;
}
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh(a, b) llmctl_simde_cvtne2ps_pbh((a), (b))
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh(a) llmctl_simde_cvtneps_pbh(a)
/* masked loads and stores touch only their lanes' memory (SIMDe 0.8.2's mask_storeu_ps writes
   zeros to the other lanes, and its masked loads read all 16): lane i of `size` bytes is copied
   where bit i of k is set; a load's other lanes are zero */
static inline void llmctl_simde_lanes(void* dst, const void* src, uint32_t k, int lanes, int size, int load)
{
    for (int i = 0; i < lanes; i++) {
        if (k & (1u << i)) memcpy((char*)dst + size * i, (const char*)src + size * i, (size_t)size);
        else if (load) memset((char*)dst + size * i, 0, (size_t)size);
    }
}
static inline void llmctl_simde_mask_storeu_ps(void* p, simde__mmask16 k, simde__m512 a)
{
    llmctl_simde_lanes(p, &a, k, 16, 4, 0);
}
static inline simde__m512 llmctl_simde_maskz_loadu_ps(simde__mmask16 k, const void* p)
{
    simde__m512 v;
    llmctl_simde_lanes(&v, p, k, 16, 4, 1);
    return v;
}
static inline simde__m512i llmctl_simde_maskz_loadu_epi16(simde__mmask32 k, const void* p)
{
    simde__m512i v;
    llmctl_simde_lanes(&v, p, k, 32, 2, 1);
    return v;
}
static inline void llmctl_simde_mask_storeu_epi32(void* p, simde__mmask16 k, simde__m512i a)
{
    llmctl_simde_lanes(p, &a, k, 16, 4, 0);
}
/* vcvtps2pd (SIMDe 0.8.2 has no _mm512_cvtps_pd): each float widened exactly */
static inline simde__m512d llmctl_simde_cvtps_pd(simde__m256 a)
{
    simde__m256_private p = simde__m256_to_private(a);
    simde__m512d_private r;
    for (int i = 0; i < 8; i++) r.f64[i] = (double)p.f32[i];
    return simde__m512d_from_private(r);
}
#define _mm512_cvtps_pd(a) llmctl_simde_cvtps_pd(a)
#undef _mm512_mask_storeu_epi32
#define _mm512_mask_storeu_epi32(p, k, a) llmctl_simde_mask_storeu_epi32((p), (k), (a))
#undef _mm512_mask_storeu_ps
#undef _mm512_maskz_loadu_ps
#undef _mm512_maskz_loadu_epi16
#define _mm512_mask_storeu_ps(p, k, a) llmctl_simde_mask_storeu_ps((p), (k), (a))
#define _mm512_maskz_loadu_ps(k, p) llmctl_simde_maskz_loadu_ps((k), (p))
#define _mm512_maskz_loadu_epi16(k, p) llmctl_simde_maskz_loadu_epi16((k), (p))
/* scatters write their lanes in order, lowest first (as the instructions do where indices repeat) */
static inline void llmctl_simde_mask_i32scatter_epi32(void* base, simde__mmask16 k, simde__m512i idx,
                                                      simde__m512i v, int scale)
{
    simde__m512i_private pi = simde__m512i_to_private(idx), pv = simde__m512i_to_private(v);
    for (int i = 0; i < 16; i++)
        if (k & (1u << i)) memcpy((char*)base + (ptrdiff_t)pi.i32[i] * scale, &pv.i32[i], 4);
}
#define _mm512_mask_i32scatter_epi32(base, k, idx, v, scale) \
    llmctl_simde_mask_i32scatter_epi32((base), (k), (idx), (v), (scale))
#define _mm512_mask_i32scatter_ps(base, k, idx, v, scale) \
    llmctl_simde_mask_i32scatter_epi32((base), (k), (idx), simde_mm512_castps_si512(v), (scale))
/* AMX-TILE and AMX-BF16, in plain C: each thread's eight tiles (as in hardware, where the tile
   registers are per-thread state), shaped by ldtilecfg's rows and bytes per row; a load or a dot
   product zeroes a tile's bytes past its shape. TDPBF16PS follows the Intel SDM's definition: per
   row, the even and the odd products of each column summed apart from zero, each add one FMA
   rounding, then added together and into the destination, subnormals flushed to zero. Its order
   differs from VDPBF16PS's. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} llmctl_simde_tilecfg;
static _Thread_local struct { llmctl_simde_tilecfg cfg; uint8_t t[8][16][64]; } llmctl_simde_amx;
static inline void llmctl_simde_tile_loadconfig(const void* p)
{
    memcpy(&llmctl_simde_amx.cfg, p, sizeof(llmctl_simde_tilecfg));
    memset(llmctl_simde_amx.t, 0, sizeof llmctl_simde_amx.t);
}
static inline void llmctl_simde_tile_release(void) { memset(&llmctl_simde_amx, 0, sizeof llmctl_simde_amx); }
static inline void llmctl_simde_tile_loadd(int t, const void* base, size_t stride)
{
    memset(llmctl_simde_amx.t[t], 0, sizeof llmctl_simde_amx.t[t]);
    for (int r = 0; r < llmctl_simde_amx.cfg.rows[t]; r++)
        memcpy(llmctl_simde_amx.t[t][r], (const char*)base + r * stride, llmctl_simde_amx.cfg.colsb[t]);
}
static inline void llmctl_simde_tile_stored(int t, void* base, size_t stride)
{
    for (int r = 0; r < llmctl_simde_amx.cfg.rows[t]; r++)
        memcpy((char*)base + r * stride, llmctl_simde_amx.t[t][r], llmctl_simde_amx.cfg.colsb[t]);
}
static inline void llmctl_simde_tile_zero(int t) { memset(llmctl_simde_amx.t[t], 0, sizeof llmctl_simde_amx.t[t]); }
static inline void llmctl_simde_tile_dpbf16ps(int d, int a, int b)
{
    const llmctl_simde_tilecfg* c = &llmctl_simde_amx.cfg;
    int K = c->colsb[a] / 4, N = c->colsb[d] / 4;
    for (int m = 0; m < c->rows[d]; m++) {
        float tmp[32] = {0}, row[16] = {0};
        uint16_t x[32];
        memcpy(x, llmctl_simde_amx.t[a][m], 64);
        for (int k = 0; k < K; k++) {
            uint16_t y[32];
            memcpy(y, llmctl_simde_amx.t[b][k], 64);
            for (int n = 0; n < N; n++)
                for (int e = 0; e < 2; e++)
                    tmp[2 * n + e] = llmctl_simde_ftz(fmaf(llmctl_simde_bf16(x[2 * k + e]),
                                                           llmctl_simde_bf16(y[2 * n + e]), tmp[2 * n + e]));
        }
        memcpy(row, llmctl_simde_amx.t[d][m], 4 * N);
        for (int n = 0; n < N; n++)
            row[n] = llmctl_simde_ftz(llmctl_simde_ftz(row[n]) + llmctl_simde_ftz(tmp[2 * n] + tmp[2 * n + 1]));
        memset(llmctl_simde_amx.t[d][m], 0, 64);
        memcpy(llmctl_simde_amx.t[d][m], row, 4 * N);
    }
    for (int m = c->rows[d]; m < 16; m++) memset(llmctl_simde_amx.t[d][m], 0, 64);
}
#undef _tile_loadconfig
#undef _tile_release
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(p) llmctl_simde_tile_loadconfig(p)
#define _tile_release() llmctl_simde_tile_release()
#define _tile_loadd(t, base, stride) llmctl_simde_tile_loadd((t), (base), (stride))
#define _tile_stored(t, base, stride) llmctl_simde_tile_stored((t), (base), (stride))
#define _tile_zero(t) llmctl_simde_tile_zero(t)
#define _tile_dpbf16ps(d, a, b) llmctl_simde_tile_dpbf16ps((d), (a), (b))

#define target(...) target("avx2,fma")
#define __builtin_cpu_supports(f) (__builtin_strncmp((f), "avx512", 6) == 0 || __builtin_cpu_supports(f))
#endif
