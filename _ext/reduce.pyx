# cython: language_level=3
"""The shared-memory all-reduce's arithmetic: average one slice of N rank buffers, and copy.

What it is: `reduce_mean_inplace` (gradients already in shared rows: the mean is written back
into every row's slice) and `reduce_mean_slice` (into a separate output) compute
mean[i] = (slots[0,i] + slots[1,i] + ... + slots[N-1,i]) / N for i in [lo, hi), summing in float32 in the fixed rank order 0..N-1, so every rank that reads the
result gets the same bits no matter how many threads did the work (each element is summed by
exactly one thread, the thread split only decides *which* thread). `copy_floats` is a parallel
memcpy used to move a rank's gradients into and out of the shared segment.

What it is not: no communication, no synchronisation -- the caller (llmctl/distributed/shm.py) puts
barriers between the copy-in, the reduce-scatter and the all-gather. It plays the role of NCCL's
ncclAvg reduction in llm.c's multi_gpu_cpu_float_sum / ncclAllReduce path, on CPU memory.
"""
from cython.parallel cimport prange
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from _openmp cimport LLMCTL_HAVE_OPENMP

# Threads split the range in blocks of this many floats (16 KiB): big enough that the loop
# vectorises and the OpenMP overhead is noise, small enough to balance 2 threads on a tiny buffer.
cdef enum:
    BLOCK = 4096


cdef void reduce_mean_rows_c(float* out, float* out2, const float** rows, int nrows,
                             Py_ssize_t lo, Py_ssize_t hi, int n_threads) noexcept nogil:
    # out[lo:hi] = (rows[0] + rows[1] + ... + rows[nrows-1])[lo:hi] / nrows; out2 (may be NULL)
    # gets a copy. Per block: one pass per row over a 16 KiB stretch of out that stays in L1, so
    # the inner loops vectorise and memory sees each input once and each output once.
    cdef Py_ssize_t nblocks = (hi - lo + BLOCK - 1) // BLOCK
    cdef Py_ssize_t blk, i, start, end
    cdef int r
    cdef const float* src
    cdef float fn = <float>nrows
    for blk in prange(nblocks, nogil=True, schedule='static', num_threads=n_threads):
        start = lo + blk * BLOCK
        end = start + BLOCK
        if end > hi:
            end = hi
        if nrows == 2:
            src = rows[1]
            for i in range(start, end):
                out[i] = (rows[0][i] + src[i]) / fn
        else:
            src = rows[0]
            for i in range(start, end):
                out[i] = src[i]
            for r in range(1, nrows):
                src = rows[r]
                for i in range(start, end):
                    out[i] = out[i] + src[i]
            for i in range(start, end):
                out[i] = out[i] / fn  # one rounding, identical on every rank (exact for N = 2^k)
        if out2 != NULL:
            memcpy(out2 + start, out + start, (end - start) * sizeof(float))


cdef void reduce_mean_inplace_c(float** rows, int nrows, Py_ssize_t lo, Py_ssize_t hi,
                                int n_threads) noexcept nogil:
    # rows[r][lo:hi] = mean over r of rows[r][lo:hi], for every r: the block is reduced into
    # row 0 (each element read before it is written) and then copied to rows 1..N-1
    cdef Py_ssize_t nblocks = (hi - lo + BLOCK - 1) // BLOCK
    cdef Py_ssize_t blk, i, start, end
    cdef int r
    cdef float* dst
    cdef const float* src
    cdef float fn = <float>nrows
    for blk in prange(nblocks, nogil=True, schedule='static', num_threads=n_threads):
        start = lo + blk * BLOCK
        end = start + BLOCK
        if end > hi:
            end = hi
        dst = rows[0]
        for r in range(1, nrows):
            src = rows[r]
            for i in range(start, end):
                dst[i] = dst[i] + src[i]
        for i in range(start, end):
            dst[i] = dst[i] / fn
        for r in range(1, nrows):
            memcpy(rows[r] + start, dst + start, (end - start) * sizeof(float))


cdef void copy_floats_c(float* dst, const float* src, Py_ssize_t n, int n_threads) noexcept nogil:
    cdef Py_ssize_t chunk = 1 << 18  # 1 MiB of floats per memcpy call
    cdef Py_ssize_t nchunks = (n + chunk - 1) // chunk
    cdef Py_ssize_t c, start, m
    if n_threads <= 1 or nchunks <= 1:
        if n > 0:
            memcpy(dst, src, n * sizeof(float))
        return
    for c in prange(nchunks, nogil=True, schedule='static', num_threads=n_threads):
        start = c * chunk
        m = chunk
        if start + m > n:
            m = n - start
        memcpy(dst + start, src + start, m * sizeof(float))


def reduce_mean_slice(float[::1] out, float[:, ::1] slots, Py_ssize_t lo, Py_ssize_t hi,
                      int n_threads=1, float[::1] own=None, int own_row=-1):
    """out[lo:hi] = mean over rows of slots[:, lo:hi] (float32, rows summed in order 0..N-1).

    own/own_row: read row `own_row` from `own` instead of slots (a rank's private gradients, so
    its own slice never has to be copied into shared memory) and also write the result into
    own[lo:hi]. out must not overlap any row other than row 0, nor `own`.
    """
    cdef Py_ssize_t n = slots.shape[1]
    cdef int nslots = <int>slots.shape[0]
    cdef int r
    cdef const float** rows
    cdef float* out2 = NULL
    if nslots < 1:
        raise ValueError("reduce_mean_slice: need at least one slot")
    if out.shape[0] < hi:
        raise ValueError(f"reduce_mean_slice: out has {out.shape[0]} floats, slice ends at {hi}")
    if not (0 <= lo <= hi <= n):
        raise ValueError(f"reduce_mean_slice: bad slice [{lo}, {hi}) of {n}")
    if n_threads < 1:
        raise ValueError("reduce_mean_slice: n_threads must be >= 1")
    if own is not None:
        if not 0 <= own_row < nslots:
            raise ValueError(f"reduce_mean_slice: own_row {own_row} is not a row of {nslots}")
        if own.shape[0] < hi:
            raise ValueError(f"reduce_mean_slice: own has {own.shape[0]} floats, slice ends at {hi}")
    if hi == lo:
        return
    cdef char* o_lo = <char*>&out[0]
    cdef char* o_hi = <char*>&out[0] + out.shape[0] * sizeof(float)
    cdef char* s_lo
    for r in range(1, nslots):
        s_lo = <char*>&slots[r, 0]
        if s_lo < o_hi and o_lo < s_lo + n * sizeof(float):
            raise ValueError(f"reduce_mean_slice: out overlaps row {r}")
    if own is not None:
        s_lo = <char*>&own[0]
        if s_lo < o_hi and o_lo < s_lo + own.shape[0] * sizeof(float):
            raise ValueError("reduce_mean_slice: out overlaps own")
        out2 = &own[0]
    rows = <const float**>malloc(nslots * sizeof(float*))
    if rows == NULL:
        raise MemoryError()
    try:
        for r in range(nslots):
            rows[r] = &slots[r, 0]
        if own is not None:
            rows[own_row] = &own[0]
        with nogil:
            reduce_mean_rows_c(&out[0], out2, rows, nslots, lo, hi, n_threads)
    finally:
        free(rows)


def reduce_mean_inplace(float[:, ::1] slots, Py_ssize_t lo, Py_ssize_t hi, int n_threads=1):
    """slots[r, lo:hi] = mean over rows of slots[:, lo:hi] for every row r (rows summed in
    order 0..N-1, float32): the zero-copy all-reduce when every rank's gradients live in a row."""
    cdef Py_ssize_t n = slots.shape[1]
    cdef int nslots = <int>slots.shape[0]
    cdef int r
    cdef float** rows
    if nslots < 1:
        raise ValueError("reduce_mean_inplace: need at least one row")
    if not (0 <= lo <= hi <= n):
        raise ValueError(f"reduce_mean_inplace: bad slice [{lo}, {hi}) of {n}")
    if n_threads < 1:
        raise ValueError("reduce_mean_inplace: n_threads must be >= 1")
    if hi == lo or nslots == 1:
        return
    rows = <float**>malloc(nslots * sizeof(float*))
    if rows == NULL:
        raise MemoryError()
    try:
        for r in range(nslots):
            rows[r] = &slots[r, 0]
        with nogil:
            reduce_mean_inplace_c(rows, nslots, lo, hi, n_threads)
    finally:
        free(rows)


def copy_floats(float[::1] dst, const float[::1] src, int n_threads=1):
    """dst[:] = src (parallel memcpy); sizes must match."""
    if dst.shape[0] != src.shape[0]:
        raise ValueError(f"copy_floats: dst has {dst.shape[0]} floats, src has {src.shape[0]}")
    if n_threads < 1:
        raise ValueError("copy_floats: n_threads must be >= 1")
    if dst.shape[0] == 0:
        return
    with nogil:
        copy_floats_c(&dst[0], &src[0], dst.shape[0], n_threads)


def openmp_enabled():
    return bool(LLMCTL_HAVE_OPENMP)
