"""Kernels for the KV-cached GPT-2 forward: append new K/V rows to a cache, attend new queries to it.

What it is: the attention of Tq new query positions per row against a per-layer cache of all
past keys/values of that row (decode: Tq = 1; prefill or HellaSwag completions: Tq > 1).
What it is not: the training attention (no backward, no stored (B,NH,T,T) matrices; that is
attention.pyx), the sampler (sampler.pyx) and no matmul/layernorm/GELU (the cached forward in llmctl/sample.py uses the
shared kernels / BLAS for those).

Mirrors llm.c's `attention_forward` (train_gpt2.c) per query: scale 1/sqrt(hs), causal,
softmax via exp(x - max) and a multiply by 1/sum, output = sum_t2 att * V.

Layouts (flat float32, C order):
  qkv     (B, Tq, 3C)         the new positions' q|k|v, as the qkv matmul writes them
  kcache  (B, NH, Tcap, hs)   one layer's cache; vcache likewise
  pos     (B,) int32          row b's new position t sits at cache index pos[b] + t
  out     (B, Tq, C)          attention output (heads concatenated), like llm.c's atty
  prefix  (kpre, vpre, rows, lengths, Tp), optional: a cache (P, NH, Tp, hs) shared by several
          rows (HellaSwag's context, read by its four endings without a copy each): row b's
          positions below lengths[b] are row rows[b]'s there, and its own cache holds positions
          lengths[b] on, from index 0
Every query is computed by one thread start to finish, so results do not depend on the
thread count. The kernel is the vector form of the loops below the CPU runs best, picked at
import: kvcache_avx512.h's on CPUs with AVX-512, kvcache_avx2.h's on those with AVX2 and FMA
(set_isa picks any, for tests); results agree to float32 rounding, not bits. The vector copies
take up to LLMCTL_KV_QB consecutive queries of a row and head at once and read each key once
for them all (a prompt's queries: HellaSwag's contexts and endings); each query still gets the
bits it gets alone, as a decode step computes it.
"""
from cython.parallel cimport prange
from libc.math cimport expf, sqrtf
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from _openmp cimport omp_get_thread_num
from capi cimport fn_capsule, kv_append_fn, kv_attend_fn


# ----------------------------------------------------------------------------------------------
# C-level kernels

cdef extern from "kvcache_row.h" nogil:
    int LLMCTL_KV_QB
    long llmctl_kv_scratch_floats(long nkeys)

cdef extern from "kvcache_avx512.h" nogil:
    int llmctl_kv_avx512_runs()
    void llmctl_kv_attend_avx512(float* out, long out_stride, const float* q, long q_stride, int nq,
                                 const float* kp, const float* vp, int np, const float* k, const float* v,
                                 int n, int hs, float scale, float* scratch)

cdef extern from "kvcache_avx2.h" nogil:
    int llmctl_kv_avx2_runs()
    void llmctl_kv_attend_avx2(float* out, long out_stride, const float* q, long q_stride, int nq,
                               const float* kp, const float* vp, int np, const float* k, const float* v,
                               int n, int hs, float scale, float* scratch)

# a block of queries' attention (out, its row stride, q, its row stride, the number of queries, the
# prefix's kp, vp and np keys, the own k, v, the keys of the first query, hs, scale, scratch):
# the vector copies
ctypedef void (*attend_block_fn)(float* out, long out_stride, const float* q, long q_stride, int nq,
                                 const float* kp, const float* vp, int np, const float* k, const float* v,
                                 int n, int hs, float scale, float* scratch) noexcept nogil

ISAS = ("baseline", "avx2", "avx512")
cdef bint _avx2_runs = llmctl_kv_avx2_runs() != 0
cdef bint _avx512_runs = llmctl_kv_avx512_runs() != 0
cdef int _best = 2 if _avx512_runs else (1 if _avx2_runs else 0)
cdef int _isa = _best    # the copy attention_cached runs (an index into ISAS); decided at import

cdef enum:
    MAX_HS = 512   # largest head size the attention kernel accepts (GPT-2/3 use 64..128)

cdef void kvcache_append(float* kcache, float* vcache, const float* qkv, const int* pos,
                         int B, int Tq, int C, int NH, int Tcap, int n_threads) noexcept nogil:
    # copy the k and v parts of qkv (B,Tq,3C) into the caches (B,NH,Tcap,hs) at pos[b] + t, the
    # rows split over the threads
    cdef int hs = C // NH
    cdef int b, t, h
    cdef long r, p
    cdef const float* src
    for r in prange(<long>B * Tq, schedule='static', num_threads=n_threads):
        b = <int>(r // Tq)
        t = <int>(r % Tq)
        p = pos[b] + t
        src = qkv + r * 3 * C
        for h in range(NH):
            memcpy(kcache + ((<long>b * NH + h) * Tcap + p) * hs, src + C + h * hs,
                   hs * sizeof(float))
            memcpy(vcache + ((<long>b * NH + h) * Tcap + p) * hs, src + 2 * C + h * hs,
                   hs * sizeof(float))


cdef inline float _dot(const float* a, const float* b, int n) noexcept nogil:
    # 8 independent partial sums (vectorisable without -ffast-math), combined in a fixed order
    cdef float s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0, s4 = 0.0, s5 = 0.0, s6 = 0.0, s7 = 0.0
    cdef int i = 0
    while i + 8 <= n:
        s0 = s0 + a[i] * b[i]
        s1 = s1 + a[i + 1] * b[i + 1]
        s2 = s2 + a[i + 2] * b[i + 2]
        s3 = s3 + a[i + 3] * b[i + 3]
        s4 = s4 + a[i + 4] * b[i + 4]
        s5 = s5 + a[i + 5] * b[i + 5]
        s6 = s6 + a[i + 6] * b[i + 6]
        s7 = s7 + a[i + 7] * b[i + 7]
        i = i + 8
    while i < n:
        s0 = s0 + a[i] * b[i]
        i = i + 1
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


cdef void _attend_one(float* out, const float* q, const float* kp, const float* vp, int np,
                      const float* k, const float* v, int n, int hs, float scale,
                      float* scores) noexcept nogil:
    # one query against n cached keys/values (rows of hs floats): keys 0 .. np-1 are rows of the
    # shared prefix kp/vp, the rest rows of k/v from their start; scores: scratch of >= n floats
    cdef int j, i
    cdef float s, maxval = -10000.0, expsum = 0.0, inv, a
    cdef float acc[MAX_HS]   # local accumulator: cannot alias v, so the AV loop vectorises
    if np > n:
        np = n
    for j in range(np):          # the prefix's keys, then the own cache's: the same order as one cache
        s = _dot(q, kp + <long>j * hs, hs) * scale
        if s > maxval:
            maxval = s
        scores[j] = s
    for j in range(np, n):
        s = _dot(q, k + <long>(j - np) * hs, hs) * scale
        if s > maxval:
            maxval = s
        scores[j] = s
    for j in range(n):
        a = expf(scores[j] - maxval)
        expsum = expsum + a
        scores[j] = a
    inv = 1.0 / expsum if expsum != 0.0 else 0.0
    for i in range(hs):
        acc[i] = 0.0
    for j in range(np):
        a = scores[j] * inv
        for i in range(hs):
            acc[i] = acc[i] + a * vp[<long>j * hs + i]
    for j in range(np, n):
        a = scores[j] * inv
        for i in range(hs):
            acc[i] = acc[i] + a * v[<long>(j - np) * hs + i]
    for i in range(hs):
        out[i] = acc[i]


cdef int attention_cached_forward(float* out, const float* qkv, const float* kcache,
                                  const float* vcache, const int* pos, int B, int Tq, int C,
                                  int NH, int Tcap, const float* kpre, const float* vpre,
                                  const int* pre_row, const int* pre_len, int Tp,
                                  int n_threads) noexcept nogil:
    # out (B,Tq,C): query (b,t,h) attends to positions 0 .. pos[b] + t inclusive. Without a
    # prefix (kpre NULL) position p is cache index p; with one, positions below pre_len[b] are
    # the prefix's (kpre/vpre (*,NH,Tp,hs), its row pre_row[b]) and position p >= pre_len[b] is
    # the row's own cache index p - pre_len[b]. The new K/V must already be in the cache
    # (kvcache_append). Returns -1 if out of memory.
    cdef int hs = C // NH
    cdef float scale = 1.0 / sqrtf(<float>hs)
    # queries go in blocks of LLMCTL_KV_QB consecutive positions of one row and head: the vector
    # copies read each key once for the block; the plain loops take its queries one by one
    cdef int QB = LLMCTL_KV_QB
    cdef int nblk = (Tq + QB - 1) // QB
    cdef long total = <long>B * NH * nblk
    cdef long idx, row = (Tcap + Tp + 15) // 16 * 16
    cdef int b, h, t, t0, nq, npre
    cdef const float* kp
    cdef const float* vp
    cdef const float* kc
    cdef const float* vc
    cdef attend_block_fn attend = NULL
    if _isa == 2:
        attend = llmctl_kv_attend_avx512
    elif _isa == 1:
        attend = llmctl_kv_attend_avx2
    if attend != NULL:
        row = llmctl_kv_scratch_floats(Tcap + Tp)
    # per thread: one score row (every key a query can see, Tp + Tcap, rounded up to whole
    # vectors), or a vector copy's scratch for a block
    cdef float* scratch = <float*>malloc(<size_t>n_threads * row * sizeof(float))
    if scratch == NULL:
        return -1
    for idx in prange(total, schedule='static', num_threads=n_threads):
        b = <int>(idx // (NH * nblk))
        h = <int>((idx // nblk) % NH)
        t0 = <int>(idx % nblk) * QB
        nq = Tq - t0
        if nq > QB:
            nq = QB
        npre = 0
        kp = kcache
        vp = vcache
        if kpre != NULL:
            npre = pre_len[b]
            kp = kpre + (<long>pre_row[b] * NH + h) * Tp * hs
            vp = vpre + (<long>pre_row[b] * NH + h) * Tp * hs
        kc = kcache + (<long>b * NH + h) * Tcap * hs
        vc = vcache + (<long>b * NH + h) * Tcap * hs
        if attend != NULL:
            attend(out + (<long>b * Tq + t0) * C + h * hs, C, qkv + (<long>b * Tq + t0) * 3 * C + h * hs,
                   3 * C, nq, kp, vp, npre, kc, vc, pos[b] + t0 + 1, hs, scale,
                   scratch + <long>omp_get_thread_num() * row)
        else:
            for t in range(t0, t0 + nq):
                _attend_one(out + (<long>b * Tq + t) * C + h * hs, qkv + (<long>b * Tq + t) * 3 * C + h * hs,
                            kp, vp, npre, kc, vc, pos[b] + t + 1, hs, scale,
                            scratch + <long>omp_get_thread_num() * row)
    free(scratch)
    return 0


# ----------------------------------------------------------------------------------------------
# Python wrappers: validate sizes (ValueError), then call the C kernel without the GIL

def isa():
    """The copy of the kernel attention_cached runs: "baseline", "avx2" or "avx512"."""
    return ISAS[_isa]


def set_isa(name=None):
    """Run the named copy ("baseline", or "avx2" / "avx512" where the CPU has it); None: the best
    this CPU runs (the default at import). -> the name now in force."""
    global _isa
    if name is None:
        _isa = _best
    elif name not in ISAS:
        raise ValueError(f"unknown kernel copy {name!r}: use one of {', '.join(ISAS)}")
    elif name == "avx512" and not _avx512_runs:
        raise ValueError("the avx512 copy needs a CPU with AVX-512 (and a build for x86-64 with GCC >= 11)")
    elif name == "avx2" and not _avx2_runs:
        raise ValueError("the avx2 copy needs a CPU with AVX2 and FMA (and a build for x86-64 with GCC >= 10)")
    else:
        _isa = ISAS.index(name)
    return ISAS[_isa]


def _check(name, Py_ssize_t got, Py_ssize_t want):
    if got != want:
        raise ValueError(f"{name} has {got} elements, expected {want}")


def _check_pos(const int[::1] pos, int B, int Tq, int Tcap):
    cdef int b
    _check("pos", pos.shape[0], B)
    for b in range(B):
        if pos[b] < 0 or pos[b] + Tq > Tcap:
            raise ValueError(f"pos[{b}] = {pos[b]} with Tq = {Tq} does not fit a cache of Tcap = {Tcap}")


def _check_dims(int B, int Tq, int C, int NH, int Tcap):
    if B < 1 or Tq < 1 or C < 1 or NH < 1 or Tcap < 1:
        raise ValueError("B, Tq, C, NH and Tcap must be positive")
    if C % NH != 0:
        raise ValueError(f"C = {C} is not a multiple of NH = {NH}")
    if C // NH > MAX_HS:
        raise ValueError(f"head size {C // NH} exceeds the kernel's maximum {MAX_HS}")


def kvcache_append_forward(float[::1] kcache, float[::1] vcache, const float[::1] qkv,
                           const int[::1] pos, int B, int Tq, int C, int NH, int Tcap, int n_threads=1):
    """Write the K and V of qkv (B,Tq,3C) into kcache/vcache (B,NH,Tcap,hs) at pos[b] + t."""
    _check_dims(B, Tq, C, NH, Tcap)
    _check("kcache", kcache.shape[0], <Py_ssize_t>B * Tcap * C)
    _check("vcache", vcache.shape[0], <Py_ssize_t>B * Tcap * C)
    _check("qkv", qkv.shape[0], <Py_ssize_t>B * Tq * 3 * C)
    _check_pos(pos, B, Tq, Tcap)
    if n_threads < 1:
        raise ValueError("n_threads must be >= 1")
    with nogil:
        kvcache_append(&kcache[0], &vcache[0], &qkv[0], &pos[0], B, Tq, C, NH, Tcap, n_threads)


def attention_cached(float[::1] out, const float[::1] qkv, const float[::1] kcache,
                     const float[::1] vcache, const int[::1] pos, int B, int Tq, int C, int NH,
                     int Tcap, int n_threads, prefix=None):
    """out (B,Tq,C) = causal attention of the queries in qkv against the cache (see module doc).
    prefix (kpre, vpre, rows, lengths, Tp): positions below lengths[b] are read from row rows[b]
    of kpre/vpre (flat (P, NH, Tp, hs)), and the cache holds row b's positions from lengths[b]
    on (append them at pos - lengths). The bits are those of one cache holding both."""
    _check_dims(B, Tq, C, NH, Tcap)
    _check("out", out.shape[0], <Py_ssize_t>B * Tq * C)
    _check("qkv", qkv.shape[0], <Py_ssize_t>B * Tq * 3 * C)
    _check("kcache", kcache.shape[0], <Py_ssize_t>B * Tcap * C)
    _check("vcache", vcache.shape[0], <Py_ssize_t>B * Tcap * C)
    _check("pos", pos.shape[0], B)
    if n_threads < 1:
        raise ValueError("n_threads must be >= 1")
    cdef const float[::1] kpre
    cdef const float[::1] vpre
    cdef const int[::1] rows
    cdef const int[::1] plen
    cdef const float* kp = NULL
    cdef const float* vp = NULL
    cdef const int* rp = NULL
    cdef const int* lp = NULL
    cdef int Tp = 0, b
    cdef Py_ssize_t P
    if prefix is None:
        _check_pos(pos, B, Tq, Tcap)
    else:
        kpre, vpre, rows, plen, Tp = prefix
        _check("prefix rows", rows.shape[0], B)
        _check("prefix lengths", plen.shape[0], B)
        _check("prefix values", vpre.shape[0], kpre.shape[0])
        if Tp < 1 or kpre.shape[0] == 0 or kpre.shape[0] % (<Py_ssize_t>Tp * C) != 0:
            raise ValueError(f"prefix keys of {kpre.shape[0]} elements are not whole rows of "
                             f"Tp x C = {Tp} x {C}")
        P = kpre.shape[0] // (<Py_ssize_t>Tp * C)
        for b in range(B):
            if rows[b] < 0 or rows[b] >= P or plen[b] < 0 or plen[b] > Tp or plen[b] > pos[b] \
                    or pos[b] - plen[b] + Tq > Tcap:
                raise ValueError(f"row {b}: prefix row {rows[b]} of {P}, prefix length {plen[b]} of "
                                 f"Tp = {Tp}, pos {pos[b]} and Tq = {Tq} do not fit a cache of "
                                 f"Tcap = {Tcap} after the prefix")
        kp, vp, rp, lp = &kpre[0], &vpre[0], &rows[0], &plen[0]
    cdef int rc
    with nogil:
        rc = attention_cached_forward(&out[0], &qkv[0], &kcache[0], &vcache[0], &pos[0],
                                      B, Tq, C, NH, Tcap, kp, vp, rp, lp, Tp, n_threads)
    if rc != 0:
        raise MemoryError("attention_cached: no memory for the score scratch")


def c_api():
    """The C kernels this module lends others (capi.pxd), on the copy set_isa() put in force:
    "append" (kvcache_append_forward) and "attend" (attention_cached)."""
    return {"append": fn_capsule(<void*><kv_append_fn>kvcache_append),
            "attend": fn_capsule(<void*><kv_attend_fn>attention_cached_forward)}
