/* The body of attention_bf16.h, compiled twice: for the build's baseline (ATTB_FN(x) = x_base,
 * the "emulated" path) and with AVX-512 enabled (x_avx512, the native paths, whose CPUs have it),
 * so the packing loops vectorise 16 wide there. The per-block steps between ATTB_V512's guards
 * (softmax, output, P and dS, the pairings and transposes) are the emulated copy's; the native
 * copy takes attention_bf16_avx512.h's forms of them. Not a header to include on its own. */
/* ---- packing: one head's rows of q, k, v and dout -> bf16, zero padded to Tp rows and hsp columns ---- */

/* one row: o[0:hs] = bf16 of fp32 x32 (attb_rnd) or the flushed bf16 x16 (a bf16 that is
   attb_rnd(x) of some fp32 x packs to the same bits as x), o[hs:hsp] = 0 */
static inline void ATTB_FN(pack_row)(uint16_t* o, const float* x32, const uint16_t* x16, ptrdiff_t hs,
                                     ptrdiff_t hsp)
{
    if (x16)
        for (ptrdiff_t d = 0; d < hs; d++) o[d] = attb_flush(x16[d]);
    else
        for (ptrdiff_t d = 0; d < hs; d++) o[d] = attb_rnd(x32[d]);
    for (ptrdiff_t d = hs; d < hsp; d++) o[d] = 0;
}

static inline void ATTB_FN(prefetch)(const void* p, ptrdiff_t bytes)
{
    for (ptrdiff_t c = 0; c < bytes; c += 64) __builtin_prefetch((const char*)p + c);
}

/* Head h of batch b into Tp x hsp row-major bf16 rows, in one pass along its T rows: q, k, v
   of src->qkv32 or src->qkv16 (B,T,3C) into dq, dk, dv, and dout (B,T,C; src->dout, or
   src->dout16 in bf16, flushed as q, k, v are: the bits of the rounded fp32) into ddo with
   Dh[t] = bf16(dout) . out over the head's columns in fp32 (out fp32, or out16: the bf16
   output, widened), summed in ATTB_DLANES lanes then halved pairwise (a fixed order; a sum in
   column order was a chain of hs dependent adds per row). A NULL destination is skipped. Each
   head packs its own rows into its thread's scratch, where the products read them from cache. */
static void ATTB_FN(pack_head)(uint16_t* dq, uint16_t* dk, uint16_t* dv, uint16_t* ddo, float* Dh,
                               const attb_src* src, ptrdiff_t b, ptrdiff_t h, ptrdiff_t T, ptrdiff_t C,
                               ptrdiff_t NH)
{
    const ptrdiff_t hs = C / NH, Tp = attb_pad(T, ATTB_BLK), hsp = attb_pad(hs, 32), C3 = 3 * C;
    /* src's pointers in locals: with -fno-strict-aliasing (Python's flags) a store to a row
       could change a pointer read through src, and gcc would neither hoist nor vectorise */
    const uint16_t* q16 = src->qkv16 ? src->qkv16 + b * T * C3 + h * hs : NULL;
    const float* q32 = src->qkv32 ? src->qkv32 + b * T * C3 + h * hs : NULL;
    const float* dout = ddo && src->dout ? src->dout + b * T * C + h * hs : NULL;
    const uint16_t* dout16 = ddo && src->dout16 ? src->dout16 + b * T * C + h * hs : NULL;
    const uint16_t* out16 = ddo && src->out16 ? src->out16 + b * T * C + h * hs : NULL;
    const float* out = ddo && !src->out16 ? src->out + b * T * C + h * hs : NULL;
    const ptrdiff_t qb = q16 ? 2 : 4, ob = out16 ? 2 : 4;   /* bytes per value */
    uint16_t* dst[3] = {dq, dk, dv};
    for (ptrdiff_t t = 0; t < T; t++) {
        if (t + ATTB_AHEAD < T) {   /* the rows are pages apart: no hardware prefetcher follows them */
            const ptrdiff_t a = (t + ATTB_AHEAD) * C3;
            for (int w = 0; w < 3; w++)
                if (dst[w]) ATTB_FN(prefetch)(q16 ? (const void*)(q16 + a + w * C) : (const void*)(q32 + a + w * C), hs * qb);
            if (ddo) {
                ATTB_FN(prefetch)(dout16 ? (const void*)(dout16 + (t + ATTB_AHEAD) * C)
                                         : (const void*)(dout + (t + ATTB_AHEAD) * C), hs * (dout16 ? 2 : 4));
                if (Dh) ATTB_FN(prefetch)(out16 ? (const void*)(out16 + (t + ATTB_AHEAD) * C)
                                                : (const void*)(out + (t + ATTB_AHEAD) * C), hs * ob);
            }
        }
        for (int w = 0; w < 3; w++)
            if (dst[w])
                ATTB_FN(pack_row)(dst[w] + t * hsp, q32 ? q32 + t * C3 + w * C : NULL,
                                  q16 ? q16 + t * C3 + w * C : NULL, hs, hsp);
        if (!ddo) continue;
        uint16_t* o = ddo + t * hsp;
        ATTB_FN(pack_row)(o, dout16 ? NULL : dout + t * C, dout16 ? dout16 + t * C : NULL, hs, hsp);
        if (Dh) {
            const uint16_t* y16 = out16 ? out16 + t * C : NULL;
            const float* y = out16 ? NULL : out + t * C;
            float s[ATTB_DLANES] = {0.0f};
            ptrdiff_t dm = hs - hs % ATTB_DLANES, d = 0;
            if (y16)
                for (; d < dm; d += ATTB_DLANES)
                    for (int j = 0; j < ATTB_DLANES; j++)
                        s[j] += llmctl_bf16_to_f32(o[d + j]) * llmctl_bf16_to_f32(y16[d + j]);
            else
                for (; d < dm; d += ATTB_DLANES)
                    for (int j = 0; j < ATTB_DLANES; j++) s[j] += llmctl_bf16_to_f32(o[d + j]) * y[d + j];
            for (int k = ATTB_DLANES / 2; k > 0; k /= 2)
                for (int j = 0; j < k; j++) s[j] += s[j + k];
            for (; d < hs; d++) s[0] += llmctl_bf16_to_f32(o[d]) * (y16 ? llmctl_bf16_to_f32(y16[d]) : y[d]);
            Dh[t] = s[0];
        }
    }
    for (int w = 0; w < 4; w++) {
        uint16_t* p = w < 3 ? dst[w] : ddo;
        if (p) memset(p + T * hsp, 0, (size_t)(Tp - T) * hsp * 2);
    }
}

/* exp(v): attention_kernels.h's exp (Cody-Waite, Cephes degree 6, unfused as in its "default"
   set); -inf (a masked key) -> 0. Inlined into the loops over a block, which gcc vectorises. */
static inline float ATTB_FN(exp1)(float v)
{
    float xc = v < ATT_EXP_LO ? ATT_EXP_LO : (v > ATT_EXP_HI ? ATT_EXP_HI : v);
    float t = xc * ATT_LOG2E + ATT_SHIFT;
    float n = t - ATT_SHIFT;
    uint32_t ti, bits;
    float r, y, pow2n;
    memcpy(&ti, &t, 4);
    r = n * -ATT_LN2_HI + xc;
    r = n * -ATT_LN2_LO + r;
    y = ATT_P0;
    y = y * r + ATT_P1;
    y = y * r + ATT_P2;
    y = y * r + ATT_P3;
    y = y * r + ATT_P4;
    y = y * r + ATT_P5;
    y = y * (r * r) + r + 1.0f;
    bits = (ti - 0x4B400000u + 127u) << 23;
    memcpy(&pow2n, &bits, 4);
    return v < ATT_EXP_LO ? 0.0f : y * pow2n;
}

/* x[c] = exp(x[c]) for a block row */
static inline void ATTB_FN(exp_row)(float* x)
{
    for (int c = 0; c < ATTB_BLK; c++) x[c] = ATTB_FN(exp1)(x[c]);
}

#ifndef ATTB_V512   /* the native copy takes these from attention_bf16_avx512.h */
/* rows paired (Tp/2 x hsp x 2), from row-major R: the B form of X when X's rows are the K
   dimension (V in P V, dout in P^T dout, Q in dS^T Q, K in dS K) */
static void ATTB_FN(rowpairs)(uint16_t* dst, const uint16_t* R, ptrdiff_t Tp, ptrdiff_t hsp)
{
    for (ptrdiff_t p = 0; p < Tp / 2; p++) {
        const uint16_t* a = R + 2 * p * hsp;
        const uint16_t* b = a + hsp;
        uint16_t* o = dst + 2 * p * hsp;
        for (ptrdiff_t d = 0; d < hsp; d++) {
            o[2 * d] = a[d];
            o[2 * d + 1] = b[d];
        }
    }
}

/* columns paired, per block of 32 rows (hsp/2 x 32 x 2), from row-major R: the B form of X^T
   (K in Q K^T, V in dout V^T); a transpose of 32-bit column pairs */
static void ATTB_FN(colpairs)(uint16_t* dst, const uint16_t* R, ptrdiff_t Tp, ptrdiff_t hsp)
{
    for (ptrdiff_t t0 = 0; t0 < Tp; t0 += ATTB_BLK) {
        uint16_t* blk = dst + t0 * hsp;
        for (ptrdiff_t n = 0; n < ATTB_BLK; n++) {
            const uint16_t* row = R + (t0 + n) * hsp;
            for (ptrdiff_t r = 0; r < hsp / 2; r++) memcpy(blk + (r * ATTB_BLK + n) * 2, row + 2 * r, 4);
        }
    }
}

/* dst (hsp x Tp) = R (Tp x hsp)^T: V, Q, dout as the A of out^T += V^T P^T, dK^T += Q^T dS, dV^T += dout^T P */
static void ATTB_FN(transpose)(uint16_t* dst, const uint16_t* R, ptrdiff_t Tp, ptrdiff_t hsp)
{
    for (ptrdiff_t t0 = 0; t0 < Tp; t0 += ATTB_BLK)     /* by 32-row blocks: stays in L1 */
        for (ptrdiff_t d = 0; d < hsp; d++)
            for (ptrdiff_t t = t0; t < t0 + ATTB_BLK; t++) dst[d * Tp + t] = R[t * hsp + d];
}

/* The forward's softmax over the keys 0..nk of one block of 32 query rows, on S^T (keys x
   rows), in place: scale it, mask it (the last 32 keys are the diagonal block, where key c is
   seen by rows r >= c; rows r >= nr are padding), take each row's max m over all its keys, then
   l = the row sums of P^T = exp(S^T - m) in key order, and P^T in bf16 with keys paired into
   Pp. The max is known before any exp, so no partial sum or output needs rescaling. */
static void ATTB_FN(fwd_softmax)(float* ST, ptrdiff_t nk, float* m, float* l, uint16_t* Pp,
                                 float scale, ptrdiff_t nr)
{
    enum { N = ATTB_BLK };
    const ptrdiff_t d0 = nk - N;
    for (int r = 0; r < N; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    for (ptrdiff_t c = 0; c < nk; c++) {
        float* s = ST + c * N;
        for (int r = 0; r < N; r++) {
            float v = ((c < d0 || c - d0 <= r) && r < nr) ? s[r] * scale : -INFINITY;
            s[r] = v;
            m[r] = v > m[r] ? v : m[r];
        }
    }
    for (int r = 0; r < N; r++)               /* -inf only on padding rows: keep them 0 */
        if (m[r] == -INFINITY) m[r] = 0.0f;
    for (ptrdiff_t c = 0; c < nk; c++) {      /* P^T = exp(S^T - max), row sums */
        float* s = ST + c * N;
        for (int r = 0; r < N; r++) {
            s[r] = ATTB_FN(exp1)(s[r] - m[r]);
            l[r] += s[r];
        }
    }
    for (ptrdiff_t c = 0; c < nk; c += 2) {   /* bf16, keys paired */
        uint16_t* o = Pp + c * N;
        for (int r = 0; r < N; r++) {
            o[2 * r] = attb_rnd(ST[c * N + r]);
            o[2 * r + 1] = attb_rnd(ST[(c + 1) * N + r]);
        }
    }
}

/* The forward's output for nr query rows: out's rows (fp32, or with out16 non-NULL bf16, each
   C apart) = accT's columns / l, and lse = m + log(l) */
static void ATTB_FN(fwd_out)(float* out, uint16_t* out16, float* lse, const float* accT,
                             const float* m, const float* l, ptrdiff_t C, ptrdiff_t hs, ptrdiff_t nr)
{
    for (ptrdiff_t r = 0; r < nr; r++) {
        float inv = 1.0f / l[r];
        if (out16)      /* bf16: rounded to nearest even, as convert.cast_to_bf16 would */
            for (ptrdiff_t d = 0; d < hs; d++) out16[r * C + d] = llmctl_f32_to_bf16(accT[d * ATTB_BLK + r] * inv);
        else
            for (ptrdiff_t d = 0; d < hs; d++) out[r * C + d] = accT[d * ATTB_BLK + r] * inv;
        lse[r] = m[r] + logf(l[r]);
    }
}

/* dst (32 x hsp, rows hsp apart) = src (hsp x 32)^T: the backward's dK^T, dV^T of a key block as rows */
static void ATTB_FN(rows_of)(float* dst, const float* src, ptrdiff_t hsp)
{
    for (ptrdiff_t d = 0; d < hsp; d++)
        for (int c = 0; c < ATTB_BLK; c++) dst[c * hsp + d] = src[d * ATTB_BLK + c];
}

/* part[d] += x[i][d] (as doubles) for the rows i = 0..n in order, rows ldx apart, d < hs */
static void ATTB_FN(colsums)(double* part, const float* x, ptrdiff_t ldx, ptrdiff_t n, ptrdiff_t hs)
{
    for (ptrdiff_t i = 0; i < n; i++)
        for (ptrdiff_t d = 0; d < hs; d++) part[d] += (double)x[i * ldx + d];
}

/* The backward's P = exp(S/sqrt(hs) - lse) and dS = P (dP - D) / sqrt(hs) of the block of query
   rows i0.. and keys j0.. (0 where masked or past T), rounded to bf16: P with rows paired (Pp),
   dS row-major (dSb, rows lds apart) and with rows paired (dSp) */
static void ATTB_FN(bwd_block)(float* S, const float* dP, uint16_t* Pb, uint16_t* Pp, uint16_t* dSb,
                               ptrdiff_t lds, uint16_t* dSp, const float* lb, const float* D, ptrdiff_t i0,
                               ptrdiff_t j0, ptrdiff_t T, float scale)
{
    uint16_t ds[ATTB_BLK * ATTB_BLK];
    for (ptrdiff_t r = 0; r < ATTB_BLK; r++) {
        float* srow = S + r * ATTB_BLK;
        const float* dprow = dP + r * ATTB_BLK;
        ptrdiff_t i = i0 + r, ncr = i + 1 - j0;
        float li = i < T ? lb[i] : 0.0f, Di = i < T ? D[i] : 0.0f;
        if (i >= T) ncr = 0;
        for (int c = 0; c < ATTB_BLK; c++)       /* P = exp(s/sqrt(hs) - lse), 0 if masked */
            srow[c] = c < ncr ? srow[c] * scale - li : -INFINITY;
        ATTB_FN(exp_row)(srow);
        for (int c = 0; c < ATTB_BLK; c++) {
            Pb[r * ATTB_BLK + c] = attb_rnd(srow[c]);
            ds[r * ATTB_BLK + c] = attb_rnd(srow[c] * (dprow[c] - Di) * scale);
        }
        memcpy(dSb + r * lds, ds + r * ATTB_BLK, ATTB_BLK * 2);
    }
    ATTB_FN(rowpairs)(Pp, Pb, ATTB_BLK, ATTB_BLK);
    ATTB_FN(rowpairs)(dSp, ds, ATTB_BLK, ATTB_BLK);
}
#endif

/* ---- forward: one (batch, head) ---- */

/* Works on transposed blocks, S^T = K Q^T (keys x query rows) and out^T = V^T P^T, so that the
   softmax runs down the keys with the 32 query rows in the vector lanes: the max and the row sums
   are elementwise vector operations, with no horizontal reduction per row. Each block of 32
   query rows takes its scores against all the keys it sees in one product (keys x 32 fp32 in the
   thread's scratch, O(T), never T x T), so the softmax is exact rather than online and P V runs
   as one product over all those keys. Row i's sum adds its keys in order. */
static void ATTB_FN(forward_head)(float* out, uint16_t* out16, float* lse, const attb_src* src, ptrdiff_t b,
                                  ptrdiff_t h, ptrdiff_t T, ptrdiff_t C, ptrdiff_t NH,
                                  void* scratch, int path)
{
    enum { N = ATTB_BLK };
    const ptrdiff_t hs = C / NH, Tp = attb_pad(T, N), hsp = attb_pad(hs, 32);
    const ptrdiff_t TH = Tp * hsp;
    const float scale = 1.0f / sqrtf((float)hs);
    attb_gemm_t gemm = attb_gemms[path];
    uint16_t* Kw = (uint16_t*)scratch;               /* K as A (S^T = K Q^T) */
    uint16_t* Rq = Kw + TH;                          /* q, v as rows */
    uint16_t* Rv = Rq + TH;
    uint16_t* Qc = Rv + TH;                          /* Q^T as B (S^T = K Q^T) */
    uint16_t* VT = Qc + TH;                          /* V^T as A (out^T = V^T P^T) */
    uint16_t* Pp = VT + TH;                          /* bf16 P^T (Tp keys x rows), keys paired: B of V^T P^T */
    float* ST = (float*)(Pp + Tp * N);               /* S^T, then P^T (Tp keys x rows) */
    float* accT = ST + Tp * N;                       /* out^T (hsp x rows), unnormalised */
    float* m = accT + N * hsp;                       /* per row: max, sum */
    float* l = m + N;

    attb_mark(path);
    ATTB_FN(pack_head)(Rq, Kw, Rv, NULL, NULL, src, b, h, T, C, NH);
    ATTB_FN(colpairs)(Qc, Rq, Tp, hsp);
    ATTB_FN(transpose)(VT, Rv, Tp, hsp);
    if (path == ATTB_AMX) attb_amx_begin();
    for (ptrdiff_t i0 = 0; i0 < T; i0 += N) {
        ptrdiff_t nr = T - i0 < N ? T - i0 : N, nk = i0 + N;   /* keys 0..nk: blocks up to the diagonal one */
        gemm(ST, N, Kw, hsp, Qc + i0 * hsp, 2 * N, (int)nk, N, (int)hsp, 0);
        ATTB_FN(fwd_softmax)(ST, nk, m, l, Pp, scale, nr);
        gemm(accT, N, VT, Tp, Pp, 2 * N, (int)hsp, N, (int)nk, 0);
        ATTB_FN(fwd_out)(out16 ? NULL : out + (b * T + i0) * C + h * hs,
                         out16 ? out16 + (b * T + i0) * C + h * hs : NULL,
                         lse + (b * NH + h) * T + i0, accT, m, l, C, hs, nr);
    }
    if (path == ATTB_AMX) attb_amx_end();
}

/* one row of a gradient (hs values x) into dqkv's row: fp32 o32 (+= with acc, else 0 + x: the
   bits of a zeroed +=) or, with o16, bf16(0 + x) */
static inline void ATTB_FN(put_row)(float* o32, uint16_t* o16, const float* x, ptrdiff_t hs, int acc)
{
    if (o16)
        for (ptrdiff_t d = 0; d < hs; d++) o16[d] = llmctl_f32_to_bf16(0.0f + x[d]);
    else if (acc)
        for (ptrdiff_t d = 0; d < hs; d++) o32[d] += x[d];
    else
        for (ptrdiff_t d = 0; d < hs; d++) o32[d] = 0.0f + x[d];
}

/* ---- backward: one (batch, head); dqkv += (acc) or = 0 + (the same bits as zeroing first),
   or with dqkv16 (dqkv NULL) its bf16 rounding written; part (3 x hs doubles: q, k, v, or NULL)
   += the column sums of this head's gradient over its T rows, in row order ---- */

static void ATTB_FN(backward_head)(float* dqkv, uint16_t* dqkv16, double* part, const attb_src* src,
                                   const float* lse, ptrdiff_t b, ptrdiff_t h, ptrdiff_t T, ptrdiff_t C,
                                   ptrdiff_t NH, void* scratch, int path, int acc)
{
    const ptrdiff_t hs = C / NH, C3 = 3 * C, Tp = attb_pad(T, ATTB_BLK), hsp = attb_pad(hs, 32);
    const ptrdiff_t BB = ATTB_BLK * ATTB_BLK, TH = Tp * hsp, G = ATTB_DQ_KEYS;
    const float scale = 1.0f / sqrtf((float)hs);
    const float* lb = lse + (b * NH + h) * T;
    float* dqb = dqkv ? dqkv + b * T * C3 + h * hs : NULL;
    uint16_t* dqb16 = dqkv16 ? dqkv16 + b * T * C3 + h * hs : NULL;
    attb_gemm_t gemm = attb_gemms[path];
    uint16_t* Qa = (uint16_t*)scratch;   /* Q as A (S = Q K^T) */
    uint16_t* Oa = Qa + TH;              /* dout as A (dP = dout V^T) */
    uint16_t* Rk = Oa + TH;              /* k, v as rows */
    uint16_t* Rv = Rk + TH;
    uint16_t* QT = Rv + TH;              /* Q^T as A (dK^T += Q^T dS) */
    uint16_t* Kc = QT + TH;              /* K^T as B (S = Q K^T) */
    uint16_t* Kr = Kc + TH;              /* K as B over rows (dQ += dS K) */
    uint16_t* Vc = Kr + TH;              /* V^T as B (dP = dout V^T) */
    uint16_t* OT = Vc + TH;              /* dout^T as A (dV^T += dout^T P) */
    uint16_t* Pb = OT + TH;              /* one block of P (bf16), the emulated copy's staging */
    uint16_t* Pp = Pb + BB;              /* P, dS (bf16) of the rows j0..Tp: rows paired */
    uint16_t* dSp = Pp + Tp * ATTB_BLK;
    uint16_t* dSg = dSp + Tp * ATTB_BLK; /* dS row-major of the rows g0..Tp x the group's keys, G apart */
    float* dq = (float*)(dSg + Tp * G);
    float* S = dq + TH;                  /* S, dP of the rows j0..Tp (x 32 keys) */
    float* dP = S + Tp * ATTB_BLK;
    float* dkT = dP + Tp * ATTB_BLK;                /* dK^T, dV^T of the key block (hsp x 32) */
    float* dvT = dkT + ATTB_BLK * hsp;
    float* dkr = dvT + ATTB_BLK * hsp;   /* the same as rows (32 x hsp), added to dqkv row by row */
    float* dvr = dkr + ATTB_BLK * hsp;
    float* D = dvr + ATTB_BLK * hsp;     /* D = dout . out of the head's rows */

    attb_mark(path);
    ATTB_FN(pack_head)(Qa, Rk, Rv, Oa, D, src, b, h, T, C, NH);
    ATTB_FN(colpairs)(Kc, Rk, Tp, hsp);
    ATTB_FN(rowpairs)(Kr, Rk, Tp, hsp);
    ATTB_FN(colpairs)(Vc, Rv, Tp, hsp);
    ATTB_FN(transpose)(QT, Qa, Tp, hsp);
    ATTB_FN(transpose)(OT, Oa, Tp, hsp);
    if (path == ATTB_AMX) attb_amx_begin();
    for (ptrdiff_t j0 = 0; j0 < T; j0 += ATTB_BLK) {
        const ptrdiff_t nr = Tp - j0;    /* the rows that see key block j0, as one product each */
        const ptrdiff_t g0 = j0 / G * G, q = j0 - g0;   /* the group's first key, this block's column */
        gemm(S, ATTB_BLK, Qa + j0 * hsp, hsp, Kc + j0 * hsp, 2 * ATTB_BLK, (int)nr, ATTB_BLK, (int)hsp, 0);
        gemm(dP, ATTB_BLK, Oa + j0 * hsp, hsp, Vc + j0 * hsp, 2 * ATTB_BLK, (int)nr, ATTB_BLK, (int)hsp, 0);
        for (ptrdiff_t i = g0; i < j0; i++)     /* rows above the diagonal block see none of these keys */
            memset(dSg + (i - g0) * G + q, 0, ATTB_BLK * 2);
        for (ptrdiff_t i0 = j0; i0 < T; i0 += ATTB_BLK) {
            ptrdiff_t o = (i0 - j0) * ATTB_BLK;
            ATTB_FN(bwd_block)(S + o, dP + o, Pb, Pp + o, dSg + (i0 - g0) * G + q, G, dSp + o, lb, D, i0, j0, T,
                               scale);
        }
        /* dV^T = dout^T P and dK^T = Q^T dS over all the rows: the same products and sums over the
           rows as dV += P^T dout, dK += dS^T Q, without transposing P and dS (only pairing rows);
           the same additions in the same order as one product per block of rows */
        gemm(dvT, ATTB_BLK, OT + j0, Tp, Pp, 2 * ATTB_BLK, (int)hsp, ATTB_BLK, (int)nr, 0);
        gemm(dkT, ATTB_BLK, QT + j0, Tp, dSp, 2 * ATTB_BLK, (int)hsp, ATTB_BLK, (int)nr, 0);
        /* dQ += dS K once a group of key blocks is done: the same sums in the same key order as a
           product per key block, with dQ's accumulators loaded and stored once a group, not once
           a block (the first group starts them from zero) */
        if (q + ATTB_BLK == G || j0 + ATTB_BLK >= T)
            gemm(dq + g0 * hsp, hsp, dSg, G, Kr + g0 * hsp, 2 * hsp, (int)(Tp - g0), (int)hsp,
                 (int)(q + ATTB_BLK), g0 > 0);
        /* transposed in L1 first, so that the adds into dqkv's rows (a page apart) run along
           contiguous rows, vectorised (the strided scalar adds were a fifth of this function) */
        ATTB_FN(rows_of)(dkr, dkT, hsp);
        ATTB_FN(rows_of)(dvr, dvT, hsp);
        ptrdiff_t nc = T - j0 < ATTB_BLK ? T - j0 : ATTB_BLK;
        for (ptrdiff_t c = 0; c < nc; c++) {
            ptrdiff_t o = (j0 + c) * C3;
            ATTB_FN(put_row)(dqb ? dqb + C + o : NULL, dqb16 ? dqb16 + C + o : NULL, dkr + c * hsp, hs, acc);
            ATTB_FN(put_row)(dqb ? dqb + 2 * C + o : NULL, dqb16 ? dqb16 + 2 * C + o : NULL, dvr + c * hsp, hs, acc);
        }
        if (part) {     /* the bias sums in row order, each column's partial sum kept in registers */
            ATTB_FN(colsums)(part + hs, dkr, hsp, nc, hs);
            ATTB_FN(colsums)(part + 2 * hs, dvr, hsp, nc, hs);
        }
    }
    if (path == ATTB_AMX) attb_amx_end();
    for (ptrdiff_t i = 0; i < T; i++)
        ATTB_FN(put_row)(dqb ? dqb + i * C3 : NULL, dqb16 ? dqb16 + i * C3 : NULL, dq + i * hsp, hs, acc);
    if (part) ATTB_FN(colsums)(part, dq, hsp, T, hs);
}
