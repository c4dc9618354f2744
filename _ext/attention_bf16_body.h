/* The body of attention_bf16.h, compiled twice: for the build's baseline (ATTB_FN(x) = x_base,
 * the "emulated" path) and with AVX-512 enabled (x_avx512, the native paths, whose CPUs have it),
 * so the packing, rounding and softmax loops vectorise 16 wide there. Both copies run the same
 * C operations (no -ffast-math, no FP contraction under -std=c11), so they give the same bits;
 * only the GEMM behind `gemm` differs between paths. Not a header to include on its own. */
/* ---- packing (fp32 strided source -> bf16), zero padded to Tp rows and hsp columns ---- */

/* dst (Tp x hsp) row-major: the A form of Q and dout, and the source of the two B forms */
static void ATTB_FN(pack_rows)(uint16_t* dst, const float* src, ptrdiff_t ld, ptrdiff_t T,
                               ptrdiff_t Tp, ptrdiff_t hs, ptrdiff_t hsp)
{
    for (ptrdiff_t t = 0; t < T; t++) {
        uint16_t* o = dst + t * hsp;
        const float* x = src + t * ld;
        for (ptrdiff_t d = 0; d < hs; d++) o[d] = attb_rnd(x[d]);
        for (ptrdiff_t d = hs; d < hsp; d++) o[d] = 0;
    }
    memset(dst + T * hsp, 0, (size_t)(Tp - T) * hsp * 2);
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
static void ATTB_FN(forward_head)(float* out, float* lse, const float* qkv, ptrdiff_t b, ptrdiff_t h,
                              ptrdiff_t T, ptrdiff_t C, ptrdiff_t NH, void* scratch,
                              const att_kern_t* K, int path)
{
    const ptrdiff_t hs = C / NH, C3 = 3 * C, Tp = attb_pad(T, ATTB_BLK), hsp = attb_pad(hs, 32);
    const float scale = 1.0f / sqrtf((float)hs);
    const float* qb = qkv + b * T * C3 + h * hs;
    attb_gemm_t gemm = attb_gemms[path];
    uint16_t* Qa = (uint16_t*)scratch;
    uint16_t* Kb = Qa + Tp * hsp;
    uint16_t* Vb = Kb + Tp * hsp;
    uint16_t* Rw = Vb + Tp * hsp;
    uint16_t* Pb = Rw + Tp * hsp;
    float* S = (float*)(Pb + ATTB_BLK * ATTB_BLK);
    float* acc = S + ATTB_BLK * ATTB_BLK;
    float* m = acc + ATTB_BLK * hsp;
    float* l = m + ATTB_BLK;

    attb_mark(path);
    ATTB_FN(pack_rows)(Qa, qb, C3, T, Tp, hs, hsp);
    ATTB_FN(pack_rows)(Rw, qb + C, C3, T, Tp, hs, hsp);
    ATTB_FN(colpairs)(Kb, Rw, Tp, hsp);
    ATTB_FN(pack_rows)(Rw, qb + 2 * C, C3, T, Tp, hs, hsp);
    ATTB_FN(rowpairs)(Vb, Rw, Tp, hsp);
    if (path == ATTB_AMX) attb_amx_begin();
    for (ptrdiff_t i0 = 0; i0 < T; i0 += ATTB_BLK) {
        ptrdiff_t nr = T - i0 < ATTB_BLK ? T - i0 : ATTB_BLK;
        memset(acc, 0, ATTB_BLK * hsp * 4);
        for (int r = 0; r < ATTB_BLK; r++) {
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
        for (ptrdiff_t j0 = 0; j0 <= i0; j0 += ATTB_BLK) {
            memset(S, 0, ATTB_BLK * ATTB_BLK * 4);
            gemm(S, ATTB_BLK, Qa + i0 * hsp, hsp, Kb + j0 * hsp, 2 * ATTB_BLK, ATTB_BLK, ATTB_BLK, (int)hsp);
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
                float mx = att_scale_max(K, srow, ncr, scale, m[r]);
                float corr = att_expf(K, m[r] - mx);  /* 0 on the first block (m = -inf) */
                float tot = att_exp_sum(K, srow, ncr, mx);
                l[r] = l[r] * corr + tot;
                m[r] = mx;
                if (corr != 1.0f) {
                    float* a = acc + r * hsp;
                    for (ptrdiff_t d = 0; d < hsp; d++) a[d] *= corr;
                }
                for (ptrdiff_t c = 0; c < ncr; c++) prow[c] = attb_rnd(srow[c]);
                for (ptrdiff_t c = ncr; c < ATTB_BLK; c++) prow[c] = 0;
            }
            gemm(acc, hsp, Pb, ATTB_BLK, Vb + j0 * hsp, 2 * hsp, ATTB_BLK, (int)hsp, ATTB_BLK);
        }
        for (ptrdiff_t r = 0; r < nr; r++) {
            float inv = 1.0f / l[r];
            float* o = out + (b * T + i0 + r) * C + h * hs;
            for (ptrdiff_t d = 0; d < hs; d++) o[d] = acc[r * hsp + d] * inv;
            lse[(b * NH + h) * T + i0 + r] = m[r] + logf(l[r]);
        }
    }
    if (path == ATTB_AMX) attb_amx_end();
}

/* ---- backward: one (batch, head); dqkv += ---- */

static void ATTB_FN(transpose_blk)(uint16_t* dst, const uint16_t* src)
{
    for (int i = 0; i < ATTB_BLK; i++)
        for (int j = 0; j < ATTB_BLK; j++) dst[j * ATTB_BLK + i] = src[i * ATTB_BLK + j];
}

static void ATTB_FN(backward_head)(float* dqkv, const float* dout, const float* qkv, const float* out,
                               const float* lse, ptrdiff_t b, ptrdiff_t h, ptrdiff_t T,
                               ptrdiff_t C, ptrdiff_t NH, void* scratch, const att_kern_t* K,
                               int path)
{
    const ptrdiff_t hs = C / NH, C3 = 3 * C, Tp = attb_pad(T, ATTB_BLK), hsp = attb_pad(hs, 32);
    const ptrdiff_t BB = ATTB_BLK * ATTB_BLK, TH = Tp * hsp;
    const float scale = 1.0f / sqrtf((float)hs);
    const float* qb = qkv + b * T * C3 + h * hs;
    const float* ob = out + b * T * C + h * hs;
    const float* dob = dout + b * T * C + h * hs;
    const float* lb = lse + (b * NH + h) * T;
    float* dqb = dqkv + b * T * C3 + h * hs;
    attb_gemm_t gemm = attb_gemms[path];
    uint16_t* Qa = (uint16_t*)scratch;   /* Q as A (S = Q K^T) */
    uint16_t* Qr = Qa + TH;              /* Q as B over rows (dK += dS^T Q) */
    uint16_t* Kc = Qr + TH;              /* K^T as B (S = Q K^T) */
    uint16_t* Kr = Kc + TH;              /* K as B over rows (dQ += dS K) */
    uint16_t* Vc = Kr + TH;              /* V^T as B (dP = dout V^T) */
    uint16_t* Oa = Vc + TH;              /* dout as A (dP = dout V^T) */
    uint16_t* Or = Oa + TH;              /* dout as B over rows (dV += P^T dout) */
    uint16_t* Rw = Or + TH;              /* a row-major staging buffer (K, then V) */
    uint16_t* Pb = Rw + TH;
    uint16_t* PbT = Pb + BB;
    uint16_t* dSb = PbT + BB;
    uint16_t* dSbT = dSb + BB;
    float* D = (float*)(dSbT + BB);
    float* dq = D + Tp;
    float* S = dq + TH;
    float* dP = S + BB;
    float* dk = dP + BB;
    float* dv = dk + ATTB_BLK * hsp;

    attb_mark(path);
    ATTB_FN(pack_rows)(Qa, qb, C3, T, Tp, hs, hsp);
    ATTB_FN(rowpairs)(Qr, Qa, Tp, hsp);
    ATTB_FN(pack_rows)(Rw, qb + C, C3, T, Tp, hs, hsp);
    ATTB_FN(colpairs)(Kc, Rw, Tp, hsp);
    ATTB_FN(rowpairs)(Kr, Rw, Tp, hsp);
    ATTB_FN(pack_rows)(Rw, qb + 2 * C, C3, T, Tp, hs, hsp);
    ATTB_FN(colpairs)(Vc, Rw, Tp, hsp);
    ATTB_FN(pack_rows)(Oa, dob, C, T, Tp, hs, hsp);
    ATTB_FN(rowpairs)(Or, Oa, Tp, hsp);
    for (ptrdiff_t i = 0; i < T; i++) {      /* D_i = bf16(dout_i) . out_i, the rounded dout */
        float s = 0.0f;
        for (ptrdiff_t d = 0; d < hs; d++) s += llmctl_bf16_to_f32(Oa[i * hsp + d]) * ob[i * C + d];
        D[i] = s;
    }
    memset(dq, 0, TH * 4);
    if (path == ATTB_AMX) attb_amx_begin();
    for (ptrdiff_t j0 = 0; j0 < T; j0 += ATTB_BLK) {
        memset(dk, 0, ATTB_BLK * hsp * 4);
        memset(dv, 0, ATTB_BLK * hsp * 4);
        for (ptrdiff_t i0 = j0; i0 < T; i0 += ATTB_BLK) {
            memset(S, 0, BB * 4);
            memset(dP, 0, BB * 4);
            gemm(S, ATTB_BLK, Qa + i0 * hsp, hsp, Kc + j0 * hsp, 2 * ATTB_BLK, ATTB_BLK, ATTB_BLK, (int)hsp);
            gemm(dP, ATTB_BLK, Oa + i0 * hsp, hsp, Vc + j0 * hsp, 2 * ATTB_BLK, ATTB_BLK, ATTB_BLK, (int)hsp);
            for (ptrdiff_t r = 0; r < ATTB_BLK; r++) {
                float* srow = S + r * ATTB_BLK;
                float* dprow = dP + r * ATTB_BLK;
                ptrdiff_t i = i0 + r, ncr = i + 1 - j0, c;
                if (i >= T) ncr = 0;
                if (ncr > ATTB_BLK) ncr = ATTB_BLK;
                if (ncr > 0) att_exp_affine(K, srow, ncr, scale, lb[i]);   /* P = exp(s/sqrt(hs) - lse) */
                for (c = 0; c < ncr; c++) {
                    Pb[r * ATTB_BLK + c] = attb_rnd(srow[c]);
                    dSb[r * ATTB_BLK + c] = attb_rnd(srow[c] * (dprow[c] - D[i]) * scale);
                }
                for (; c < ATTB_BLK; c++) {
                    Pb[r * ATTB_BLK + c] = 0;
                    dSb[r * ATTB_BLK + c] = 0;
                }
            }
            ATTB_FN(transpose_blk)(PbT, Pb);
            ATTB_FN(transpose_blk)(dSbT, dSb);
            gemm(dv, hsp, PbT, ATTB_BLK, Or + i0 * hsp, 2 * hsp, ATTB_BLK, (int)hsp, ATTB_BLK);
            gemm(dk, hsp, dSbT, ATTB_BLK, Qr + i0 * hsp, 2 * hsp, ATTB_BLK, (int)hsp, ATTB_BLK);
            gemm(dq + i0 * hsp, hsp, dSb, ATTB_BLK, Kr + j0 * hsp, 2 * hsp, ATTB_BLK, (int)hsp, ATTB_BLK);
        }
        for (ptrdiff_t c = 0; c < ATTB_BLK && j0 + c < T; c++) {
            float* dkr = dqb + C + (j0 + c) * C3;
            float* dvr = dqb + 2 * C + (j0 + c) * C3;
            for (ptrdiff_t d = 0; d < hs; d++) {
                dkr[d] += dk[c * hsp + d];
                dvr[d] += dv[c * hsp + d];
            }
        }
    }
    if (path == ATTB_AMX) attb_amx_end();
    for (ptrdiff_t i = 0; i < T; i++)
        for (ptrdiff_t d = 0; d < hs; d++) dqb[i * C3 + d] += dq[i * hsp + d];
}
