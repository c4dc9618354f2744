/* Where key/value j of one query's attention lives: kvcache.pyx's caches may be split into a
 * prefix shared by several rows (HellaSwag's context, read by all four endings) and the row's
 * own cache after it. */
#ifndef LLMCTL_KVCACHE_ROW_H
#define LLMCTL_KVCACHE_ROW_H

/* row j of np prefix rows at pre, then the row's own rows at own (key j at own row j - np) */
static inline const float* llmctl_kv_row(const float* pre, int np, const float* own, int j, int hs)
{
    return j < np ? pre + (long)j * hs : own + (long)(j - np) * hs;
}
#endif /* LLMCTL_KVCACHE_ROW_H */
