"""Statistics over a token buffer (a shard's uint16/uint32 payload), in one parallel pass.

What it is: `token_stats` = min, max, EOT count, count of ids >= vocab size and a checksum, for
`llmctl inspect-bin` and tests. What it is not: a tokenizer or a dataloader.

Checksum: sum over i of (i + 1) * tokens[i], modulo 2^64 (i is the 0-based position). It is
position-sensitive (a swap of two different tokens changes it) and, being an integer sum, the
per-chunk partials combine to the same value for any thread count. NumPy reference:
  (np.arange(1, N + 1, dtype=np.uint64) * tokens.astype(np.uint64)).sum()  # wraps mod 2^64

Parallelism: the buffer is cut into n_threads equal chunks (static prange), each chunk writes its
own partial record, and the partials are combined serially in chunk order.
"""
from cython.parallel cimport prange
from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc

import numpy as np

from _openmp cimport omp_get_max_threads  # noqa: F401  (ties the build to the OpenMP shim)

ctypedef fused token_t:
    uint16_t
    uint32_t

cdef struct TokenPartial:
    int64_t count
    uint64_t min
    uint64_t max
    uint64_t eot_count
    uint64_t out_of_vocab
    uint64_t checksum


cdef void _stats_chunk(const token_t* tok, int64_t start, int64_t end, int64_t eot, int64_t vocab,
                       TokenPartial* out) noexcept nogil:
    # tok: (N,) token ids; fills out with the statistics of tok[start:end]
    cdef int64_t i
    cdef uint64_t t
    cdef uint64_t lo = 0xFFFFFFFFFFFFFFFF
    cdef uint64_t hi = 0
    cdef uint64_t n_eot = 0
    cdef uint64_t n_oov = 0
    cdef uint64_t s = 0
    cdef uint64_t ueot = <uint64_t>eot if eot >= 0 else 0xFFFFFFFFFFFFFFFF
    cdef uint64_t uvocab = <uint64_t>vocab
    for i in range(start, end):
        t = tok[i]
        if t < lo:
            lo = t
        if t > hi:
            hi = t
        n_eot += (t == ueot)
        n_oov += (t >= uvocab)
        s += <uint64_t>(i + 1) * t  # unsigned: wraps mod 2^64 by definition
    out.count = end - start
    out.min = lo
    out.max = hi
    out.eot_count = n_eot
    out.out_of_vocab = n_oov
    out.checksum = s


cdef void token_stats_run(const token_t* tok, int64_t N, int64_t eot, int64_t vocab, int n_threads,
                          TokenPartial* parts) noexcept nogil:
    # parts: (n_threads,) one record per chunk; chunk c covers [N*c/n, N*(c+1)/n)
    cdef Py_ssize_t c
    cdef int64_t start, end
    for c in prange(n_threads, schedule='static', num_threads=n_threads):
        start = N * c // n_threads
        end = N * (c + 1) // n_threads
        _stats_chunk(tok, start, end, eot, vocab, &parts[c])


def token_stats(tokens, long long eot, long long vocab_size, int n_threads=1):
    """Statistics of a 1-D uint16/uint32 token array (or memmap), in one pass.

    Returns dict(count, min, max, eot_count, out_of_vocab, checksum); min/max are None when the
    array is empty; out_of_vocab counts ids >= vocab_size; eot < 0 counts nothing.
    """
    if n_threads < 1:
        raise ValueError(f"n_threads must be >= 1, got {n_threads}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    a = np.asarray(tokens)
    if a.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {a.shape}")
    if a.dtype.kind != "u" or a.dtype.itemsize not in (2, 4):
        raise ValueError(f"tokens must be uint16 or uint32, got {a.dtype}")
    if not a.dtype.isnative or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("="))
    cdef int64_t N = a.shape[0]
    cdef const uint16_t[::1] v16
    cdef const uint32_t[::1] v32
    cdef TokenPartial* parts = <TokenPartial*>malloc(n_threads * sizeof(TokenPartial))
    if parts == NULL:
        raise MemoryError()
    cdef int64_t c_eot = eot
    cdef int64_t c_vocab = vocab_size
    try:
        if N > 0:
            if a.dtype.itemsize == 2:
                v16 = a
                with nogil:
                    token_stats_run(&v16[0], N, c_eot, c_vocab, n_threads, parts)
            else:
                v32 = a
                with nogil:
                    token_stats_run(&v32[0], N, c_eot, c_vocab, n_threads, parts)
        lo, hi, n_eot, n_oov, s = None, None, 0, 0, 0
        if N > 0:
            for c in range(n_threads):  # fixed order; every field is an exact integer
                if parts[c].count == 0:
                    continue
                lo = parts[c].min if lo is None else min(lo, parts[c].min)
                hi = parts[c].max if hi is None else max(hi, parts[c].max)
                n_eot += parts[c].eot_count
                n_oov += parts[c].out_of_vocab
                s = (s + parts[c].checksum) & 0xFFFFFFFFFFFFFFFF
        return dict(count=int(N), min=lo, max=hi, eot_count=n_eot, out_of_vocab=n_oov, checksum=s)
    finally:
        free(parts)
