"""fp32 <-> bf16 conversions over flat buffers (bf16 held as uint16 bit patterns).

cast_to_bf16 rounds to nearest even exactly as PyTorch's `.to(torch.bfloat16)` (bf16.h);
widen_bf16 is exact. Both are elementwise, parallel over fixed chunks, so the bits never depend
on the thread count. Used where no producing kernel can write the bf16 copy itself (the
attention output, weights after loading a checkpoint); the other producers (layernorm, GELU,
the loss backward, AdamW) write bf16 in their own pass.
"""
from cython.parallel cimport prange
from libc.stdint cimport uint16_t

from bf16 cimport llmctl_widen_bf16

cdef extern from "rows.h" nogil:
    void llmctl_cast_bf16_isa(uint16_t* dst, const float* src, Py_ssize_t n)
    int llmctl_rows_set_isa(int level)

llmctl_rows_set_isa(-1)   # the cast loop's widest copy this CPU runs (rows.h; the same bits)
from kernels cimport check_threads, check_len, eff_threads, imin

cdef enum:
    ECHUNK = 16384

cdef Py_ssize_t _grain = 131072


def set_isa(int level):
    """The cast loop's copy: -1 the widest this CPU runs (the default), 0 baseline, 1 AVX2,
    2 AVX-512 (at most what the CPU has; tests compare them bit for bit). -> the level in force."""
    return llmctl_rows_set_isa(level)


def set_parallel_grain(Py_ssize_t grain):
    """Set the minimum elements per thread (0: always n_threads). Returns the old value."""
    global _grain
    old = _grain
    _grain = grain
    return old


ctypedef fused dst_t:
    float
    uint16_t

ctypedef fused src_t:
    float
    uint16_t


cdef int _convert(dst_t[::1] out, const src_t[::1] inp, int n_threads) except -1:
    # out = inp converted elementwise in ECHUNK tasks; only (bf16 <- fp32) and (fp32 <- bf16)
    # are called, the other two specialisations are empty
    cdef Py_ssize_t n = inp.shape[0], ch, s
    cdef int nt
    check_threads(n_threads)
    check_len("out", out.shape[0], n)
    if n == 0:
        return 0
    nt = eff_threads(n_threads, n, _grain)
    with nogil:
        for ch in prange((n + ECHUNK - 1) // ECHUNK, schedule='static', num_threads=nt):
            s = ch * ECHUNK
            if dst_t is uint16_t and src_t is float:
                llmctl_cast_bf16_isa(&out[0] + s, &inp[0] + s, imin(ECHUNK, n - s))
            elif dst_t is float and src_t is uint16_t:
                llmctl_widen_bf16(&out[0] + s, &inp[0] + s, imin(ECHUNK, n - s))
    return 0


def cast_to_bf16(uint16_t[::1] out, const float[::1] inp, int n_threads=1):
    """out (N) = bf16(inp (N)), round to nearest even; NaN -> 0x7FC0."""
    _convert(out, inp, n_threads)


def widen_bf16(float[::1] out, const uint16_t[::1] inp, int n_threads=1):
    """out (N) = float32(inp (N)), exact."""
    _convert(out, inp, n_threads)
