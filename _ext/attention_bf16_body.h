/* The body of attention_bf16.h, compiled twice: for the build's baseline (ATTB_FN(x) = x_base,
 * the "emulated" path) and with AVX-512 enabled (x_avx512, the native paths, whose CPUs have it),
 * so the packing, rounding and softmax loops vectorise 16 wide there. Both copies run the same
 * C operations (no -ffast-math, no FP contraction under -std=c11), so they give the same bits;
 * only the GEMM behind `gemm` differs between paths. Not a header to include on its own. */
/* ---- packing (fp32 strided source -> bf16), zero padded to Tp rows and hsp columns ---- */

/* Rows [t0, t1) of batch b of src (B,T,n*C) fp32 -> bf16, row-major per head:
   dst[(((w * B + b) * NH + h) * Tp + t) * hsp + d] for the n tensors w (q, k, v; or dout).
   One pass along src's rows (a per-head pass would stride through memory a page per row);
   columns hs..hsp and, with the last rows, rows T..Tp are zeroed. With D (n = 1, dout):
   D[(b * NH + h) * T + t] = bf16(dout) . out over the head's columns, in fp32. */
static void ATTB_FN(pack_heads)(uint16_t* dst, const float* src, ptrdiff_t n, ptrdiff_t B,
                                ptrdiff_t b, ptrdiff_t T, ptrdiff_t t0, ptrdiff_t t1,
                                ptrdiff_t C, ptrdiff_t NH, float* D, const float* out)
{
    const ptrdiff_t hs = C / NH, Tp = attb_pad(T, ATTB_BLK), hsp = attb_pad(hs, 32);
    for (ptrdiff_t t = t0; t < t1; t++)
        for (ptrdiff_t w = 0; w < n; w++)
            for (ptrdiff_t h = 0; h < NH; h++) {
                uint16_t* o = dst + (((w * B + b) * NH + h) * Tp + t) * hsp;
                const float* x = src + (b * T + t) * n * C + w * C + h * hs;
                for (ptrdiff_t d = 0; d < hs; d++) o[d] = attb_rnd(x[d]);
                for (ptrdiff_t d = hs; d < hsp; d++) o[d] = 0;
                if (D) {
                    const float* y = out + (b * T + t) * C + h * hs;
                    float s = 0.0f;
                    for (ptrdiff_t d = 0; d < hs; d++) s += llmctl_bf16_to_f32(o[d]) * y[d];
                    D[(b * NH + h) * T + t] = s;
                }
            }
    if (t1 == T)
        for (ptrdiff_t w = 0; w < n; w++)
            for (ptrdiff_t h = 0; h < NH; h++)
                memset(dst + (((w * B + b) * NH + h) * Tp + T) * hsp, 0, (size_t)(Tp - T) * hsp * 2);
}

/* exp(v): attention_kernels.h's exp (Cody-Waite, Cephes degree 6, unfused as in its "default"
   set); -inf (a masked key) -> 0. Inlined into exp_row's loop, which gcc vectorises. */
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

/* max(m0, x[0..ATTB_BLK)) by halving (max is exact in any order), vectorisable */
static inline float ATTB_FN(row_max)(const float* x, float m0)
{
    float h[ATTB_BLK / 2];
    for (int c = 0; c < ATTB_BLK / 2; c++) h[c] = x[c] > x[c + ATTB_BLK / 2] ? x[c] : x[c + ATTB_BLK / 2];
    for (int w = ATTB_BLK / 4; w >= 1; w /= 2)
        for (int c = 0; c < w; c++) h[c] = h[c] > h[c + w] ? h[c] : h[c + w];
    return h[0] > m0 ? h[0] : m0;
}

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

/* ---- forward: one (batch, head) ---- */

/* out (B,T,C) rows of head h, lse (B,NH,T); qkv (B,T,3C) fp32; path picks the GEMM */
static void ATTB_FN(forward_head)(float* out, float* lse, const uint16_t* rows, ptrdiff_t B,
                                  ptrdiff_t b, ptrdiff_t h, ptrdiff_t T, ptrdiff_t C, ptrdiff_t NH,
                                  void* scratch, int path)
{
    const ptrdiff_t hs = C / NH, Tp = attb_pad(T, ATTB_BLK), hsp = attb_pad(hs, 32);
    const ptrdiff_t TH = Tp * hsp, BNH = B * NH;
    const float scale = 1.0f / sqrtf((float)hs);
    attb_gemm_t gemm = attb_gemms[path];
    const uint16_t* Qa = rows + (b * NH + h) * TH;   /* pack_heads' q, k, v of this head */
    const uint16_t* Kw = Qa + BNH * TH;
    const uint16_t* Vw = Kw + BNH * TH;
    uint16_t* Kb = (uint16_t*)scratch;
    uint16_t* Vb = Kb + TH;
    uint16_t* Pb = Vb + TH;
    float* S = (float*)(Pb + ATTB_BLK * ATTB_BLK);
    float* acc = S + ATTB_BLK * ATTB_BLK;
    float* m = acc + ATTB_BLK * hsp;
    float* l = m + ATTB_BLK;             /* ATTB_BLK/2 lane partials of the row sums per row */

    attb_mark(path);
    ATTB_FN(colpairs)(Kb, Kw, Tp, hsp);
    ATTB_FN(rowpairs)(Vb, Vw, Tp, hsp);
    if (path == ATTB_AMX) attb_amx_begin();
    for (ptrdiff_t i0 = 0; i0 < T; i0 += ATTB_BLK) {
        ptrdiff_t nr = T - i0 < ATTB_BLK ? T - i0 : ATTB_BLK;
        memset(acc, 0, ATTB_BLK * hsp * 4);
        for (int r = 0; r < ATTB_BLK; r++) {
            m[r] = -INFINITY;
            for (int q = 0; q < ATTB_BLK / 2; q++) l[r * (ATTB_BLK / 2) + q] = 0.0f;
        }
        for (ptrdiff_t j0 = 0; j0 <= i0; j0 += ATTB_BLK) {
            gemm(S, ATTB_BLK, Qa + i0 * hsp, hsp, Kb + j0 * hsp, 2 * ATTB_BLK, ATTB_BLK, ATTB_BLK, (int)hsp, 0);
            for (int r = 0; r < ATTB_BLK; r++) {     /* online softmax; P row -> bf16 */
                float* srow = S + r * ATTB_BLK;
                uint16_t* prow = Pb + r * ATTB_BLK;
                ptrdiff_t ncr = i0 + r + 1 - j0;      /* keys this row sees in the block */
                if (r >= nr) ncr = 0;                 /* padding row */
                if (ncr > ATTB_BLK) ncr = ATTB_BLK;
                if (ncr <= 0) {
                    memset(prow, 0, ATTB_BLK * 2);
                    continue;
                }
                for (int c = 0; c < ATTB_BLK; c++) srow[c] = c < ncr ? srow[c] * scale : -INFINITY;
                float mx = ATTB_FN(row_max)(srow, m[r]);
                float corr = ATTB_FN(exp1)(m[r] - mx);   /* 0 on the first block (m = -inf) */
                float* lr = l + r * (ATTB_BLK / 2);
                for (int c = 0; c < ATTB_BLK; c++) srow[c] -= mx;
                ATTB_FN(exp_row)(srow);
                for (int q = 0; q < ATTB_BLK / 2; q++) lr[q] = lr[q] * corr + (srow[q] + srow[q + ATTB_BLK / 2]);
                m[r] = mx;
                if (corr != 1.0f) {
                    float* a = acc + r * hsp;
                    for (ptrdiff_t d = 0; d < hsp; d++) a[d] *= corr;
                }
                for (int c = 0; c < ATTB_BLK; c++) prow[c] = attb_rnd(srow[c]);
            }
            gemm(acc, hsp, Pb, ATTB_BLK, Vb + j0 * hsp, 2 * hsp, ATTB_BLK, (int)hsp, ATTB_BLK, 1);
        }
        for (ptrdiff_t r = 0; r < nr; r++) {
            float lsum = 0.0f;
            for (int q = 0; q < ATTB_BLK / 2; q++) lsum += l[r * (ATTB_BLK / 2) + q];
            float inv = 1.0f / lsum;
            float* o = out + (b * T + i0 + r) * C + h * hs;
            for (ptrdiff_t d = 0; d < hs; d++) o[d] = acc[r * hsp + d] * inv;
            lse[(b * NH + h) * T + i0 + r] = m[r] + logf(lsum);
        }
    }
    if (path == ATTB_AMX) attb_amx_end();
}

/* ---- backward: one (batch, head); dqkv += ---- */

/* dst (hsp x Tp) = R (Tp x hsp)^T: Q and dout as the A of dK^T += Q^T dS and dV^T += dout^T P */
static void ATTB_FN(transpose)(uint16_t* dst, const uint16_t* R, ptrdiff_t Tp, ptrdiff_t hsp)
{
    for (ptrdiff_t t = 0; t < Tp; t++)
        for (ptrdiff_t d = 0; d < hsp; d++) dst[d * Tp + t] = R[t * hsp + d];
}

static void ATTB_FN(backward_head)(float* dqkv, const uint16_t* rows, const uint16_t* drows,
                                   const float* Dall, const float* lse, ptrdiff_t B, ptrdiff_t b,
                                   ptrdiff_t h, ptrdiff_t T, ptrdiff_t C, ptrdiff_t NH,
                                   void* scratch, int path)
{
    const ptrdiff_t hs = C / NH, C3 = 3 * C, Tp = attb_pad(T, ATTB_BLK), hsp = attb_pad(hs, 32);
    const ptrdiff_t BB = ATTB_BLK * ATTB_BLK, TH = Tp * hsp, BNH = B * NH;
    const float scale = 1.0f / sqrtf((float)hs);
    const float* lb = lse + (b * NH + h) * T;
    const float* D = Dall + (b * NH + h) * T;
    float* dqb = dqkv + b * T * C3 + h * hs;
    attb_gemm_t gemm = attb_gemms[path];
    const uint16_t* Qa = rows + (b * NH + h) * TH;   /* Q as A (S = Q K^T) */
    const uint16_t* Kw = Qa + BNH * TH;
    const uint16_t* Vw = Kw + BNH * TH;
    const uint16_t* Oa = drows + (b * NH + h) * TH;  /* dout as A (dP = dout V^T) */
    uint16_t* QT = (uint16_t*)scratch;   /* Q^T as A (dK^T += Q^T dS) */
    uint16_t* Kc = QT + TH;              /* K^T as B (S = Q K^T) */
    uint16_t* Kr = Kc + TH;              /* K as B over rows (dQ += dS K) */
    uint16_t* Vc = Kr + TH;              /* V^T as B (dP = dout V^T) */
    uint16_t* OT = Vc + TH;              /* dout^T as A (dV^T += dout^T P) */
    uint16_t* Pb = OT + TH;              /* P, dS (bf16) and the same with rows paired */
    uint16_t* Pp = Pb + BB;
    uint16_t* dSb = Pp + BB;
    uint16_t* dSp = dSb + BB;
    float* dq = (float*)(dSp + BB);
    float* S = dq + TH;
    float* dP = S + BB;
    float* dkT = dP + BB;                /* dK^T, dV^T of the key block (hsp x 32) */
    float* dvT = dkT + ATTB_BLK * hsp;

    attb_mark(path);
    ATTB_FN(transpose)(QT, Qa, Tp, hsp);
    ATTB_FN(colpairs)(Kc, Kw, Tp, hsp);
    ATTB_FN(rowpairs)(Kr, Kw, Tp, hsp);
    ATTB_FN(colpairs)(Vc, Vw, Tp, hsp);
    ATTB_FN(transpose)(OT, Oa, Tp, hsp);
    memset(dq, 0, TH * 4);
    if (path == ATTB_AMX) attb_amx_begin();
    for (ptrdiff_t j0 = 0; j0 < T; j0 += ATTB_BLK) {
        memset(dkT, 0, ATTB_BLK * hsp * 4);
        memset(dvT, 0, ATTB_BLK * hsp * 4);
        for (ptrdiff_t i0 = j0; i0 < T; i0 += ATTB_BLK) {
            gemm(S, ATTB_BLK, Qa + i0 * hsp, hsp, Kc + j0 * hsp, 2 * ATTB_BLK, ATTB_BLK, ATTB_BLK, (int)hsp, 0);
            gemm(dP, ATTB_BLK, Oa + i0 * hsp, hsp, Vc + j0 * hsp, 2 * ATTB_BLK, ATTB_BLK, ATTB_BLK, (int)hsp, 0);
            for (ptrdiff_t r = 0; r < ATTB_BLK; r++) {
                float* srow = S + r * ATTB_BLK;
                float* dprow = dP + r * ATTB_BLK;
                ptrdiff_t i = i0 + r, ncr = i + 1 - j0;
                float li = i < T ? lb[i] : 0.0f, Di = i < T ? D[i] : 0.0f;
                if (i >= T) ncr = 0;
                for (int c = 0; c < ATTB_BLK; c++)       /* P = exp(s/sqrt(hs) - lse), 0 if masked */
                    srow[c] = c < ncr ? srow[c] * scale - li : -INFINITY;
                ATTB_FN(exp_row)(srow);
                for (int c = 0; c < ATTB_BLK; c++) {
                    Pb[r * ATTB_BLK + c] = attb_rnd(srow[c]);
                    dSb[r * ATTB_BLK + c] = attb_rnd(srow[c] * (dprow[c] - Di) * scale);
                }
            }
            /* dV^T += dout^T P and dK^T += Q^T dS: the same products and sums over the rows as
               dV += P^T dout, dK += dS^T Q, without transposing P and dS (only pairing rows) */
            ATTB_FN(rowpairs)(Pp, Pb, ATTB_BLK, ATTB_BLK);
            ATTB_FN(rowpairs)(dSp, dSb, ATTB_BLK, ATTB_BLK);
            gemm(dvT, ATTB_BLK, OT + i0, Tp, Pp, 2 * ATTB_BLK, (int)hsp, ATTB_BLK, ATTB_BLK, 1);
            gemm(dkT, ATTB_BLK, QT + i0, Tp, dSp, 2 * ATTB_BLK, (int)hsp, ATTB_BLK, ATTB_BLK, 1);
            gemm(dq + i0 * hsp, hsp, dSb, ATTB_BLK, Kr + j0 * hsp, 2 * hsp, ATTB_BLK, (int)hsp, ATTB_BLK, 1);
        }
        for (ptrdiff_t c = 0; c < ATTB_BLK && j0 + c < T; c++) {
            float* dkr = dqb + C + (j0 + c) * C3;
            float* dvr = dqb + 2 * C + (j0 + c) * C3;
            for (ptrdiff_t d = 0; d < hs; d++) {
                dkr[d] += dkT[d * ATTB_BLK + c];
                dvr[d] += dvT[d * ATTB_BLK + c];
            }
        }
    }
    if (path == ATTB_AMX) attb_amx_end();
    for (ptrdiff_t i = 0; i < T; i++)
        for (ptrdiff_t d = 0; d < hs; d++) dqb[i * C3 + d] += dq[i * hsp + d];
}
