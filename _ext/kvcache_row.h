/* kvcache.pyx's caches may be split into a prefix shared by several rows (HellaSwag's context,
 * read by all four endings) and the row's own cache after it: the vector copies' loop over one
 * such segment. */
#ifndef LLMCTL_KVCACHE_ROW_H
#define LLMCTL_KVCACHE_ROW_H

/* NAME(acc0, acc1, sc, v, cnt, odd, hs, i, m): columns i .. i+W-1 of sum_j sc[j] v_j over the
 * cnt values at rows 0 .. cnt-1 of v, the first of them key number `odd` mod 2: even keys into
 * acc0, odd ones into acc1, each in key order, so a segment starting anywhere adds what the
 * one-cache loop adds. Expanded per vector copy (VF its vector, MASK_T its column mask,
 * LOADM(p, m) its masked load). */
#define LLMCTL_KV_PV_SEGMENT(NAME, ATTR, VF, MASK_T, SET1, LOADM, FMADD)                            \
    ATTR static inline void NAME(VF* acc0, VF* acc1, const float* sc, const float* v, int cnt, int odd, \
                                 int hs, int i, MASK_T m)                                            \
    {                                                                                                \
        VF a0 = *acc0, a1 = *acc1;                                                                   \
        int j = 0;                                                                                   \
        if (odd && cnt > 0) { a1 = FMADD(SET1(sc[0]), LOADM(v + i, m), a1); j = 1; }                 \
        for (; j + 2 <= cnt; j += 2) {                                                               \
            a0 = FMADD(SET1(sc[j]), LOADM(v + (long)j * hs + i, m), a0);                             \
            a1 = FMADD(SET1(sc[j + 1]), LOADM(v + (long)(j + 1) * hs + i, m), a1);                   \
        }                                                                                            \
        if (j < cnt) a0 = FMADD(SET1(sc[j]), LOADM(v + (long)j * hs + i, m), a0);                    \
        *acc0 = a0;                                                                                  \
        *acc1 = a1;                                                                                  \
    }
#endif /* LLMCTL_KVCACHE_ROW_H */
