/* What kvcache.pyx's vector copies share: a block of a prompt's queries, and where key j lies.
 * Its caches may be split into a prefix shared by several rows (HellaSwag's context, read by all
 * four endings) and the row's own cache after it. */
#ifndef LLMCTL_KVCACHE_ROW_H
#define LLMCTL_KVCACHE_ROW_H

/* the most queries a vector copy takes in a call (consecutive positions of one row and head),
   and the floats of scratch it needs where no query sees more than nkeys keys: each query's
   scores (rounded up to 16) and its value sums' accumulators (128 floats) */
#define LLMCTL_KV_QB 8
static inline long llmctl_kv_scratch_floats(long nkeys)
{
    return LLMCTL_KV_QB * ((nkeys + 15) / 16 * 16 + 128);
}

/* the row of key (or value) j: the prefix's (kp) below np, the row's own cache's (k) from np on */
static inline const float* llmctl_kv_row(const float* kp, int np, const float* k, int j, int hs)
{
    return j < np ? kp + (long)j * hs : k + (long)(j - np) * hs;
}

/* the rows of keys j0 .. j0+w-1: those at or past n are row j0 (read, then masked) */
static inline void llmctl_kv_rows(const float** r, int w, const float* kp, int np, const float* k, int j0, int n,
                                  int hs)
{
    for (int jj = 0; jj < w; jj++) r[jj] = llmctl_kv_row(kp, np, k, j0 + jj < n ? j0 + jj : j0, hs);
}

/* the first query of a block (query i sees n + i keys) that sees key j0 */
static inline int llmctl_kv_first_seeing(int j0, int n)
{
    return j0 < n ? 0 : j0 - n + 1;
}
/* A vector copy's kernel, written once so that the copies run the same passes (kvcache_avx512.h,
 * kvcache_avx2.h): out = softmax(q K^T / sqrt(hs)) V for nq <= LLMCTL_KV_QB queries of one head
 * at consecutive positions; query i (row i of q, q_stride floats apart; of out, out_stride apart)
 * sees n + i keys. Keys/values 0 .. np-1 are rows of kp/vp (a shared prefix: np = 0 when there
 * is none), the rest rows of k/v from their start (key j at row j - np). Each key's score and its
 * place in the sums depend only on j, so where the keys live changes no bit, and each query's
 * bits are those it gets alone. scratch: llmctl_kv_scratch_floats.
 *
 * Each block of W keys is read once for all the queries (from L1 after the first), in three
 * passes: the scores and their maxima, the exps and their sums per query, the weighted sums of
 * the values COLS columns at a time. The copy's parts: VEC (W lanes), TAIL_T TAIL(hs) (the
 * lanes of hs's last chunk), SCORES(q, kr, cnt, hs, scale, tail) (a block's scaled scores,
 * -inf from key cnt on), PV(ac, sc, vr, j0, jend, i, hs, tail) (a query's value sums over keys
 * j0 .. jend-1 into its accumulators ac, 2 x COLS floats, zero at j0 = 0), PV_OUT(o, ac, inv,
 * i, hs, tail) (the COLS columns from i of its output), and the vector operations SET1, ZERO,
 * LOADU, STOREU, MAX, SUB, ADD, EXP, HMAX, HSUM. */
#define LLMCTL_KV_ATTEND(NAME, ATTR, W, COLS, VEC, TAIL_T, TAIL, SCORES, PV, PV_OUT, SET1, ZERO, LOADU,    \
                         STOREU, MAX, SUB, ADD, EXP, HMAX, HSUM)                                        \
ATTR static void NAME(float* out, long out_stride, const float* q, long q_stride, int nq,              \
                      const float* kp, const float* vp, int np, const float* k, const float* v,        \
                      int n, int hs, float scale, float* scratch)                                      \
{                                                                                                      \
    const TAIL_T tail = TAIL(hs);                                                                      \
    const int nmax = n + nq - 1, row = (nmax + 15) / 16 * 16;                                          \
    float* acc = scratch + (long)LLMCTL_KV_QB * row;                                                   \
    float inv[LLMCTL_KV_QB];                                                                           \
    VEC mx[LLMCTL_KV_QB];                                                                              \
    const float* kr[W];                                                                                \
    int j0, j, qi;                                                                                     \
    if (np > nmax) np = nmax;                                                                          \
    for (qi = 0; qi < nq; qi++) mx[qi] = SET1(-10000.0f);                                              \
    for (j0 = 0; j0 < nmax; j0 += W) {                                                                 \
        llmctl_kv_rows(kr, W, kp, np, k, j0, nmax, hs);                                                \
        for (qi = llmctl_kv_first_seeing(j0, n); qi < nq; qi++) {                                      \
            VEC s = SCORES(q + qi * q_stride, kr, n + qi - j0 < W ? n + qi - j0 : W, hs, scale, tail); \
            STOREU(scratch + (long)qi * row + j0, s);                                                  \
            mx[qi] = MAX(mx[qi], s);                                                                   \
        }                                                                                              \
    }                                                                                                  \
    for (qi = 0; qi < nq; qi++) {                                                                      \
        float* sc = scratch + (long)qi * row;                                                          \
        VEC m = SET1(HMAX(mx[qi])), sum = ZERO();                                                      \
        float expsum;                                                                                  \
        for (j = 0; j < n + qi; j += W) {                                                              \
            VEC e = EXP(SUB(LOADU(sc + j), m));                                                        \
            STOREU(sc + j, e);                                                                         \
            sum = ADD(sum, e);                                                                         \
        }                                                                                              \
        expsum = HSUM(sum);                                                                            \
        inv[qi] = expsum != 0.0f ? 1.0f / expsum : 0.0f;                                               \
    }                                                                                                  \
    for (int i = 0; i < hs; i += COLS) {                                                               \
        for (j0 = 0; j0 < nmax; j0 += W) {                                                             \
            llmctl_kv_rows(kr, W, vp, np, v, j0, nmax, hs);                                            \
            for (qi = llmctl_kv_first_seeing(j0, n); qi < nq; qi++)                                    \
                PV(acc + qi * 2 * COLS, scratch + (long)qi * row, kr, j0,                              \
                   j0 + W < n + qi ? j0 + W : n + qi, i, hs, tail);                                    \
        }                                                                                              \
        for (qi = 0; qi < nq; qi++) PV_OUT(out + qi * out_stride, acc + qi * 2 * COLS, inv[qi], i, hs, tail); \
    }                                                                                                  \
}
#endif /* LLMCTL_KVCACHE_ROW_H */
