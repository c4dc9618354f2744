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
#endif /* LLMCTL_KVCACHE_ROW_H */
