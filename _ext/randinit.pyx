# distutils: extra_compile_args = -ffp-contract=off
"""Box-Muller transform of llm.c's `llmc/rand.h` normal_, in C, calling the C library's math.

What it is: the float arithmetic of rand.h's `normal_fill_16` (the n >= 16 path) and of the
n < 16 branch of `normal_`, statement for statement with the same float/double types, the same
operation order and the same `logf`/`cosf`/`sinf`/`sqrtf` from libm, so the results are the
bits llm.c's own C produces when linked against the same libm (glibc on Linux).
What it is not: a random number generator. The uniforms come from llmctl/rand.py (NumPy's
vectorised MT19937 words converted exactly as randfloat32/randfloat64 do); only the transform,
which needs libm's exact float functions, is here.

Floating-point contraction is switched off (-ffp-contract=off above; -std=c11 also implies it on
gcc <= 13) so `r * cosf(theta) * std + mean` is never fused into an FMA, whatever -march the
build uses: the result does not depend on LLMCTL_NATIVE.
"""
from cython.parallel cimport prange
from libc.math cimport M_PI, cosf, logf, sinf, sqrtf

cdef extern from *:
    """
    /* rand.h: #define EPSILONE 1e-12 (a double constant) */
    #define LLMCTL_EPSILONE 1e-12
    """
    double EPSILONE "LLMCTL_EPSILONE"


cdef void fill16(float* d, float mean, float std) noexcept nogil:
    """rand.h normal_fill_16 on 16 uniforms d[0..15] (randfloat32 values), in place."""
    cdef int t
    cdef float u1, u2, radius, theta
    for t in range(8):
        u1 = <float>1 - d[t]                                  # float
        u2 = d[t + 8]
        radius = sqrtf(<float>-2 * logf(u1 + EPSILONE))       # u1 + 1e-12 in double, logf(float)
        theta = 2.0 * M_PI * u2                               # double product, rounded to float
        d[t] = radius * cosf(theta) * std + mean              # all float, left to right
        d[t + 8] = radius * sinf(theta) * std + mean


cdef void fill16_blocks(float* d, Py_ssize_t nblocks, float mean, float std,
                        int n_threads) noexcept nogil:
    """fill16 over nblocks consecutive 16-blocks; blocks are independent, so any thread count
    gives the same bits."""
    cdef Py_ssize_t b
    if n_threads <= 1 or nblocks < 4096:
        for b in range(nblocks):
            fill16(d + 16 * b, mean, std)
    else:
        for b in prange(nblocks, nogil=True, schedule='static', num_threads=n_threads):
            fill16(d + 16 * b, mean, std)


cdef void fill_small(const double* u, float* out, Py_ssize_t n, float mean,
                     float std) noexcept nogil:
    """The n < 16 branch of rand.h normal_: for each pair of output slots, u[2j] is the first
    randfloat64 (u1 -> angle) and u[2j+1] the second (u2 -> radius); the sin value is kept as a
    double and written to the next slot in double arithmetic."""
    cdef Py_ssize_t t, j = 0
    cdef double next_sample = 0.0
    cdef int has_next = 0
    cdef float u1, u2, radius, theta
    for t in range(n):
        if has_next:
            out[t] = <float>(next_sample * std + mean)      # double arithmetic
            has_next = 0
            continue
        u1 = <float>u[j]
        u2 = <float>u[j + 1]
        j += 2
        radius = sqrtf(<float>-2 * logf(<float>1 - u2 + EPSILONE))  # (1 - u2) float, + 1e-12 double
        theta = 2.0 * M_PI * u1
        next_sample = radius * sinf(theta)                   # float product, widened
        has_next = 1
        out[t] = radius * cosf(theta) * std + mean


def box_muller16(float[:, ::1] d, float mean, float std, int n_threads=1):
    """In place on d (k, 16): each row of 16 randfloat32 uniforms becomes 16 N(mean, std) draws
    exactly as rand.h's normal_fill_16. mean/std are rounded to float first, as in C."""
    if d.shape[1] != 16:
        raise ValueError(f"box_muller16 needs rows of 16 uniforms, got shape ({d.shape[0]}, {d.shape[1]})")
    if n_threads < 1:
        raise ValueError(f"n_threads must be >= 1, got {n_threads}")
    if d.shape[0] == 0:
        return
    with nogil:
        fill16_blocks(&d[0, 0], d.shape[0], mean, std, n_threads)


def normal_small(const double[::1] u, float[::1] out, float mean, float std):
    """rand.h normal_ for numel < 16: out (n,) from u, the 2*ceil(n/2) randfloat64 uniforms in
    draw order (angle, radius, angle, radius, ...)."""
    cdef Py_ssize_t n = out.shape[0]
    if u.shape[0] != 2 * ((n + 1) // 2):
        raise ValueError(f"normal_small: {n} outputs need {2 * ((n + 1) // 2)} uniforms, got {u.shape[0]}")
    if n == 0:
        return
    with nogil:
        fill_small(&u[0], &out[0], n, mean, std)
