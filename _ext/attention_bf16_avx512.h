/* AVX-512 forms of the per-block steps of attention_bf16_body.h, for the copy the native paths
 * ("avx512_bf16", "amx") run; every CPU with those paths has AVX-512. The body's plain loops
 * (the "emulated" path's copy) stay the definition; these do the same steps 16 lanes at a time:
 *   - the exp is mathf_avx512.h's (the same range reduction and polynomial, with FMAs);
 *   - the row sums add two keys per step;
 *   - the forward does not mask the padding rows of a last, partial block of queries (their
 *     scores are finite, as padded q rows are zeros, and their outputs are never written);
 *   - bf16 rounding is AVX512_BF16's vcvtne2ps2bf16 / vcvtneps2bf16 (nearest even, as attb_rnd,
 *     but a subnormal input reads as zero) for P and dS;
 *   - the forward's softmax only reads the scores: the max of the raw ones, then exp(s * scale
 *     - max) with one rounding (the plain loops scale each score and subtract).
 * So results differ from the emulated path's in the last bits of P and dS, well inside the
 * bounds tests/test_attention_bf16.py derives. The transposes run on 16 x 16 transposes of
 * 32-bit words in registers and the bf16 pair packing on whole words. Included by
 * attention_bf16.h only. */
#ifndef LLMCTL_ATTENTION_BF16_AVX512_H
#define LLMCTL_ATTENTION_BF16_AVX512_H

#include "mathf_avx512.h"

#define ATTB_TGT_V __attribute__((target("avx512f,avx512bw,avx512bf16")))

/* two rounded vectors as 16 words: a's bf16 in the low half, b's in the high half */
ATTB_TGT_V static inline __m512i attb_v_pair(__m512i a, __m512i b)
{
    return _mm512_or_si512(_mm512_srli_epi32(a, 16), _mm512_and_si512(b, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* two vectors rounded to bf16 and interleaved: word i = bf16(a[i]) | bf16(b[i]) << 16, by
   vcvtne2ps2bf16 (nearest even, as attb_rnd; it reads a subnormal input as zero, where attb_rnd
   rounds it first, which differs only for inputs within half a bf16 ulp below FLT_MIN) and a
   word permute */
ATTB_TGT_V static inline __m512i attb_v_pair_ne(__m512 a, __m512 b)
{
    static const uint16_t il[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return _mm512_permutexvar_epi16(_mm512_loadu_si512((const void*)il), (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

/* llmctl_f32_to_bf16 in 16 lanes (nearest even, NaN -> 0x7FC0, no flush), in the top halves */
ATTB_TGT_V static inline __m512i attb_v_bf16(__m512 x)
{
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
}

/* rows r >= c of a diagonal block see key c: the lanes of rows 0-15 (half 0) or 16-31 */
static inline __mmask16 attb_v_diag_rows(int c, int half)
{
    int k = c - 16 * half;
    return k <= 0 ? (__mmask16)0xFFFF : (k >= 16 ? (__mmask16)0 : (__mmask16)(0xFFFFu << k));
}

/* keys c <= r of a diagonal block seen by row r: the lanes of keys 0-15 (half 0) or 16-31 */
static inline __mmask16 attb_v_diag_keys(int r, int half)
{
    int k = r - 16 * half;
    return k < 0 ? (__mmask16)0 : (k >= 15 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k + 1)) - 1));
}

/* the forward's softmax over the keys 0..nk of one block of query rows: see
   attention_bf16_body.h's fwd_softmax, but S^T is only read: each row's max is taken over its
   raw scores (m = scale * max s: the max of the scaled scores, as rounding is monotonic), and
   P^T = exp(s * scale - m) with one rounding (an FMA), the masked keys of the diagonal block set
   to 0 after the exp. Padding rows are not masked (their scores are finite). */
ATTB_TGT_V static void attb_fwd_softmax_avx512(float* ST, ptrdiff_t nk, float* m, float* l, uint16_t* Pp,
                                               float scale, ptrdiff_t nr)
{
    const __m512 sc = _mm512_set1_ps(scale);
    const ptrdiff_t d0 = nk - 32;
    __m512 x0 = _mm512_set1_ps(-INFINITY), x1 = x0, l0 = _mm512_setzero_ps(), l1 = l0;
    (void)nr;
    for (ptrdiff_t c = 0; c < d0; c++) {
        x0 = _mm512_max_ps(x0, _mm512_loadu_ps(ST + c * 32));
        x1 = _mm512_max_ps(x1, _mm512_loadu_ps(ST + c * 32 + 16));
    }
    for (int c = 0; c < 32; c++) {          /* the diagonal block: row r sees keys c <= r */
        x0 = _mm512_mask_max_ps(x0, attb_v_diag_rows(c, 0), x0, _mm512_loadu_ps(ST + (d0 + c) * 32));
        x1 = _mm512_mask_max_ps(x1, attb_v_diag_rows(c, 1), x1, _mm512_loadu_ps(ST + (d0 + c) * 32 + 16));
    }
    x0 = _mm512_mul_ps(x0, sc);
    x1 = _mm512_mul_ps(x1, sc);
    _mm512_storeu_ps(m, x0);
    _mm512_storeu_ps(m + 16, x1);
    for (ptrdiff_t c = 0; c < nk; c += 2) {
        const float* s = ST + c * 32;
        __m512 e00 = llmctl_expf16(_mm512_fmsub_ps(_mm512_loadu_ps(s), sc, x0));
        __m512 e01 = llmctl_expf16(_mm512_fmsub_ps(_mm512_loadu_ps(s + 16), sc, x1));
        __m512 e10 = llmctl_expf16(_mm512_fmsub_ps(_mm512_loadu_ps(s + 32), sc, x0));
        __m512 e11 = llmctl_expf16(_mm512_fmsub_ps(_mm512_loadu_ps(s + 48), sc, x1));
        if (c >= d0) {
            e00 = _mm512_maskz_mov_ps(attb_v_diag_rows((int)(c - d0), 0), e00);
            e01 = _mm512_maskz_mov_ps(attb_v_diag_rows((int)(c - d0), 1), e01);
            e10 = _mm512_maskz_mov_ps(attb_v_diag_rows((int)(c + 1 - d0), 0), e10);
            e11 = _mm512_maskz_mov_ps(attb_v_diag_rows((int)(c + 1 - d0), 1), e11);
        }
        l0 = _mm512_add_ps(l0, _mm512_add_ps(e00, e10));
        l1 = _mm512_add_ps(l1, _mm512_add_ps(e01, e11));
        _mm512_storeu_si512((void*)(Pp + c * 32), attb_v_pair_ne(e00, e10));
        _mm512_storeu_si512((void*)(Pp + c * 32 + 32), attb_v_pair_ne(e01, e11));
    }
    _mm512_storeu_ps(l, l0);
    _mm512_storeu_ps(l + 16, l1);
}

/* o[k] = 32-bit word k of the 16 rows src, src + ld, ... (ld in bf16): a 16 x 16 transpose of
   words in registers, by unpacks within 128-bit lanes and then lane shuffles (Zen 4 runs a
   16-lane gather at about one element a cycle; this is 64 shuffles for 256 words) */
ATTB_TGT_V static inline void attb_tr16x16(__m512i* o, const uint16_t* src, ptrdiff_t ld)
{
    __m512i r[16], t[16], u[16], v[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void*)(src + i * ld));
    for (int q = 0; q < 16; q += 4) {       /* u[q + p]: word 4L + p of rows q..q+3, in lane L */
        t[q] = _mm512_unpacklo_epi32(r[q], r[q + 1]);
        t[q + 1] = _mm512_unpackhi_epi32(r[q], r[q + 1]);
        t[q + 2] = _mm512_unpacklo_epi32(r[q + 2], r[q + 3]);
        t[q + 3] = _mm512_unpackhi_epi32(r[q + 2], r[q + 3]);
        u[q] = _mm512_unpacklo_epi64(t[q], t[q + 2]);
        u[q + 1] = _mm512_unpackhi_epi64(t[q], t[q + 2]);
        u[q + 2] = _mm512_unpacklo_epi64(t[q + 1], t[q + 3]);
        u[q + 3] = _mm512_unpackhi_epi64(t[q + 1], t[q + 3]);
    }
    for (int s = 0; s < 16; s += 8)         /* v[s + p]: words p, 8 + p; v[s + 4 + p]: 4 + p, 12 + p */
        for (int p = 0; p < 4; p++) {
            v[s + p] = _mm512_shuffle_i32x4(u[s + p], u[s + 4 + p], 0x88);
            v[s + 4 + p] = _mm512_shuffle_i32x4(u[s + p], u[s + 4 + p], 0xdd);
        }
    for (int p = 0; p < 4; p++) {
        o[p] = _mm512_shuffle_i32x4(v[p], v[8 + p], 0x88);
        o[8 + p] = _mm512_shuffle_i32x4(v[p], v[8 + p], 0xdd);
        o[4 + p] = _mm512_shuffle_i32x4(v[4 + p], v[12 + p], 0x88);
        o[12 + p] = _mm512_shuffle_i32x4(v[4 + p], v[12 + p], 0xdd);
    }
}

/* the forward's output of one block of query rows: see attention_bf16_body.h's fwd_out */
ATTB_TGT_V static void attb_fwd_out_avx512(float* out, uint16_t* out16, float* lse, const float* accT,
                                           const float* m, const float* l, ptrdiff_t C, ptrdiff_t hs,
                                           ptrdiff_t nr)
{
    __m512 one = _mm512_set1_ps(1.0f);
    __m512 inv0 = _mm512_div_ps(one, _mm512_loadu_ps(l)), inv1 = _mm512_div_ps(one, _mm512_loadu_ps(l + 16));
    for (ptrdiff_t r = 0; r < nr; r++) lse[r] = m[r] + logf(l[r]);
    if (out16 && (hs & 1)) {    /* no whole words: one element at a time */
        for (ptrdiff_t r = 0; r < nr; r++)
            for (ptrdiff_t d = 0; d < hs; d++)
                out16[r * C + d] = llmctl_f32_to_bf16(accT[d * 32 + r] * (1.0f / l[r]));
        return;
    }
    /* the output's 32-bit words (two bf16 columns, or one fp32), 16 words x 32 rows at a time:
       staged as words x rows, then turned into rows 16 x 16 at a time in registers (the
       scatters this replaced were a sixth of the forward) */
    uint32_t w[16 * 32];
    char* dst = out16 ? (char*)out16 : (char*)out;
    const ptrdiff_t nw = out16 ? hs / 2 : hs, ldw = out16 ? C / 2 : C;   /* words; C even with out16 */
    for (ptrdiff_t j0 = 0; j0 < nw; j0 += 16) {
        ptrdiff_t n = nw - j0 < 16 ? nw - j0 : 16;
        __mmask16 km = n == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
        for (ptrdiff_t j = 0; j < n; j++) {
            __m512i w0, w1;
            if (out16) {
                const float* a = accT + 2 * (j0 + j) * 32;
                w0 = attb_v_pair(attb_v_bf16(_mm512_mul_ps(_mm512_loadu_ps(a), inv0)),
                                 attb_v_bf16(_mm512_mul_ps(_mm512_loadu_ps(a + 32), inv0)));
                w1 = attb_v_pair(attb_v_bf16(_mm512_mul_ps(_mm512_loadu_ps(a + 16), inv1)),
                                 attb_v_bf16(_mm512_mul_ps(_mm512_loadu_ps(a + 48), inv1)));
            } else {
                const float* a = accT + (j0 + j) * 32;
                w0 = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(a), inv0));
                w1 = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(a + 16), inv1));
            }
            _mm512_storeu_si512((void*)(w + j * 32), w0);
            _mm512_storeu_si512((void*)(w + j * 32 + 16), w1);
        }
        for (ptrdiff_t j = n; j < 16; j++) {    /* rows past the last word: read, never stored */
            _mm512_storeu_si512((void*)(w + j * 32), _mm512_setzero_si512());
            _mm512_storeu_si512((void*)(w + j * 32 + 16), _mm512_setzero_si512());
        }
        for (ptrdiff_t r0 = 0; r0 < nr; r0 += 16) {
            __m512i o[16];
            attb_tr16x16(o, (const uint16_t*)(w + r0), 64);
            for (ptrdiff_t k = 0; k < 16 && r0 + k < nr; k++)
                _mm512_mask_storeu_epi32((void*)(dst + ((r0 + k) * ldw + j0) * 4), km, o[k]);
        }
    }
}

/* dst (hsp x Tp) = R (Tp x hsp)^T: 16 rows by 16 words (32 columns) at a time */
ATTB_TGT_V static void attb_transpose_avx512(uint16_t* dst, const uint16_t* R, ptrdiff_t Tp, ptrdiff_t hsp)
{
    __m512i o[16];
    for (ptrdiff_t t0 = 0; t0 < Tp; t0 += 16)
        for (ptrdiff_t j0 = 0; j0 < hsp / 2; j0 += 16) {
            attb_tr16x16(o, R + t0 * hsp + 2 * j0, hsp);
            for (int k = 0; k < 16; k++) {
                ptrdiff_t d = 2 * (j0 + k);
                _mm256_storeu_si256((__m256i*)(dst + d * Tp + t0), _mm512_cvtepi32_epi16(o[k]));
                _mm256_storeu_si256((__m256i*)(dst + (d + 1) * Tp + t0),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(o[k], 16)));
            }
        }
}

/* columns paired per block of 32 rows: a transpose of 32-bit words, 16 rows by 16 words at a time */
ATTB_TGT_V static void attb_colpairs_avx512(uint16_t* dst, const uint16_t* R, ptrdiff_t Tp, ptrdiff_t hsp)
{
    __m512i o[16];
    for (ptrdiff_t t0 = 0; t0 < Tp; t0 += ATTB_BLK)
        for (ptrdiff_t n0 = 0; n0 < ATTB_BLK; n0 += 16)
            for (ptrdiff_t j0 = 0; j0 < hsp / 2; j0 += 16) {
                attb_tr16x16(o, R + (t0 + n0) * hsp + 2 * j0, hsp);
                for (int k = 0; k < 16; k++)
                    _mm512_storeu_si512((void*)(dst + t0 * hsp + ((j0 + k) * ATTB_BLK + n0) * 2), o[k]);
            }
}

/* rows paired: word d of pair p = R[2p][d] | R[2p+1][d] << 16 */
ATTB_TGT_V static void attb_rowpairs_avx512(uint16_t* dst, const uint16_t* R, ptrdiff_t Tp, ptrdiff_t hsp)
{
    for (ptrdiff_t p = 0; p < Tp / 2; p++) {
        const uint16_t* a = R + 2 * p * hsp;
        for (ptrdiff_t d = 0; d < hsp; d += 16) {
            __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(a + d)));
            __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(a + hsp + d)));
            _mm512_storeu_si512((void*)(dst + 2 * p * hsp + 2 * d), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* the backward's dK^T, dV^T of a key block as rows: see attention_bf16_body.h's rows_of */
ATTB_TGT_V static void attb_rows_of_avx512(float* dst, const float* src, ptrdiff_t hsp)
{
    __m512i o[16];
    for (ptrdiff_t d0 = 0; d0 < hsp; d0 += 16)
        for (int c0 = 0; c0 < 32; c0 += 16) {
            attb_tr16x16(o, (const uint16_t*)(src + d0 * 32 + c0), 64);
            for (int k = 0; k < 16; k++) _mm512_storeu_si512((void*)(dst + (c0 + k) * hsp + d0), o[k]);
        }
}

/* part[d] += x[i][d] as doubles, rows in order: see attention_bf16_body.h's colsums; eight
   columns at a time, their sums in a register across the rows */
ATTB_TGT_V static void attb_colsums_avx512(double* part, const float* x, ptrdiff_t ldx, ptrdiff_t n, ptrdiff_t hs)
{
    ptrdiff_t d = 0;
    for (; d + 32 <= hs; d += 32) {
        __m512d a0 = _mm512_loadu_pd(part + d), a1 = _mm512_loadu_pd(part + d + 8);
        __m512d a2 = _mm512_loadu_pd(part + d + 16), a3 = _mm512_loadu_pd(part + d + 24);
        for (ptrdiff_t i = 0; i < n; i++) {
            const float* r = x + i * ldx + d;
            a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm256_loadu_ps(r)));
            a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm256_loadu_ps(r + 8)));
            a2 = _mm512_add_pd(a2, _mm512_cvtps_pd(_mm256_loadu_ps(r + 16)));
            a3 = _mm512_add_pd(a3, _mm512_cvtps_pd(_mm256_loadu_ps(r + 24)));
        }
        _mm512_storeu_pd(part + d, a0);
        _mm512_storeu_pd(part + d + 8, a1);
        _mm512_storeu_pd(part + d + 16, a2);
        _mm512_storeu_pd(part + d + 24, a3);
    }
    for (; d < hs; d++)
        for (ptrdiff_t i = 0; i < n; i++) part[d] += (double)x[i * ldx + d];
}

/* P and dS of 16 keys (half h) of row r of a block (0 past T), as bwd_block makes them */
ATTB_TGT_V static inline void attb_v_pds(__m512* P, __m512* dS, const float* S, const float* dP, const float* lb,
                                         const float* D, ptrdiff_t i0, ptrdiff_t j0, ptrdiff_t T, __m512 sc,
                                         int r, int h)
{
    ptrdiff_t i = i0 + r;
    if (i >= T) {
        *P = *dS = _mm512_setzero_ps();
        return;
    }
    __mmask16 k = i0 == j0 ? attb_v_diag_keys(r, h) : (__mmask16)0xFFFF;
    __m512 s = _mm512_fmsub_ps(_mm512_loadu_ps(S + r * 32 + 16 * h), sc, _mm512_set1_ps(lb[i]));
    *P = _mm512_maskz_mov_ps(k, llmctl_expf16(s));
    *dS = _mm512_mul_ps(_mm512_mul_ps(*P, _mm512_sub_ps(_mm512_loadu_ps(dP + r * 32 + 16 * h), _mm512_set1_ps(D[i]))), sc);
}

/* the backward's P and dS of one block: see attention_bf16_body.h's bwd_block; two rows at a
   time, rounded to bf16 by vcvtne2ps2bf16 for the paired rows and vcvtneps2bf16 for dS's
   row-major copy (the same bits) */
ATTB_TGT_V static void attb_bwd_block_avx512(const float* S, const float* dP, uint16_t* Pb, uint16_t* Pp,
                                             uint16_t* dSb, ptrdiff_t lds, uint16_t* dSp, const float* lb,
                                             const float* D, ptrdiff_t i0, ptrdiff_t j0, ptrdiff_t T, float scale)
{
    const __m512 sc = _mm512_set1_ps(scale);
    (void)Pb;
    for (int r = 0; r < 32; r += 2)
        for (int h = 0; h < 2; h++) {
            __m512 P0, dS0, P1, dS1;
            attb_v_pds(&P0, &dS0, S, dP, lb, D, i0, j0, T, sc, r, h);
            attb_v_pds(&P1, &dS1, S, dP, lb, D, i0, j0, T, sc, r + 1, h);
            _mm256_storeu_si256((__m256i*)(dSb + r * lds + 16 * h), (__m256i)_mm512_cvtneps_pbh(dS0));
            _mm256_storeu_si256((__m256i*)(dSb + (r + 1) * lds + 16 * h), (__m256i)_mm512_cvtneps_pbh(dS1));
            _mm512_storeu_si512((void*)(Pp + r * 32 + 32 * h), attb_v_pair_ne(P0, P1));
            _mm512_storeu_si512((void*)(dSp + r * 32 + 32 * h), attb_v_pair_ne(dS0, dS1));
        }
}
#endif /* LLMCTL_ATTENTION_BF16_AVX512_H */
