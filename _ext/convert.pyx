"""fp32 <-> bf16 conversions over flat buffers (bf16 held as uint16 bit patterns).

cast_to_bf16 rounds to nearest even exactly as PyTorch's `.to(torch.bfloat16)` (bf16.h);
widen_bf16 is exact. Both are elementwise, parallel over fixed chunks, so the bits never depend
on the thread count. Used where no producing kernel can write the bf16 copy itself (the
attention output, weights after loading a checkpoint); the other producers (layernorm, GELU,
the loss backward, AdamW) write bf16 in their own pass.
"""
from cython.parallel cimport prange
from libc.stdint cimport uint16_t

from kernels cimport check_threads, check_len, eff_threads

cdef extern from "bf16.h" nogil:
    void llmctl_cast_bf16(uint16_t* dst, const float* src, Py_ssize_t n)
    void llmctl_widen_bf16(float* dst, const uint16_t* src, Py_ssize_t n)

cdef enum:
    ECHUNK = 16384

cdef Py_ssize_t _grain = 131072


def set_parallel_grain(Py_ssize_t grain):
    """Set the minimum elements per thread (0: always n_threads). Returns the old value."""
    global _grain
    old = _grain
    _grain = grain
    return old


def cast_to_bf16(uint16_t[::1] out, const float[::1] inp, int n_threads=1):
    """out (N) = bf16(inp (N)), round to nearest even; NaN -> 0x7FC0."""
    cdef Py_ssize_t n = inp.shape[0], ch, s, e
    cdef int nt
    check_threads(n_threads)
    check_len("out", out.shape[0], n)
    if n == 0:
        return
    nt = eff_threads(n_threads, n, _grain)
    with nogil:
        for ch in prange((n + ECHUNK - 1) // ECHUNK, schedule='static', num_threads=nt):
            s = ch * ECHUNK
            e = s + ECHUNK
            if e > n:
                e = n
            llmctl_cast_bf16(&out[0] + s, &inp[0] + s, e - s)


def widen_bf16(float[::1] out, const uint16_t[::1] inp, int n_threads=1):
    """out (N) = float32(inp (N)), exact."""
    cdef Py_ssize_t n = inp.shape[0], ch, s, e
    cdef int nt
    check_threads(n_threads)
    check_len("out", out.shape[0], n)
    if n == 0:
        return
    nt = eff_threads(n_threads, n, _grain)
    with nogil:
        for ch in prange((n + ECHUNK - 1) // ECHUNK, schedule='static', num_threads=nt):
            s = ch * ECHUNK
            e = s + ECHUNK
            if e > n:
                e = n
            llmctl_widen_bf16(&out[0] + s, &inp[0] + s, e - s)
