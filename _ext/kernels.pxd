# Shared declarations for llmctl's GPT-2 kernels (matmul.pyx, layers.pyx, adamw.pyx, attention.pyx).
#
# What it is: the dimension legend every kernel signature uses, plus small `static inline` C
# helpers (a vectorisable expf, the tanh/sech^2 pair GELU needs) and the argument checks every
# `def` wrapper shares. What it is not: a place for cdef kernels (each .pyx is self-contained)
# or for anything touching Python objects in a hot loop.
#
# Legend (as in llm.c train_gpt2.c):
#   B   batch size                    T   sequence length (time)
#   BT  = B*T rows of activations     N   rows for row-wise kernels (usually B*T), or #elements
#   C   channels (n_embd)             OC  output channels of a matmul
#   V   real vocab size (50257)       Vp  padded vocab size (multiple of 128, 50304)
#   L   number of layers              NH  number of heads          hs = C / NH, head size
# Every tensor is a flat, C-contiguous float32 buffer in row-major order, e.g. "out (BT,OC)"
# means out[bt*OC + oc]. Token ids are int32.
#
# Why hand-written helpers instead of libm: without -ffast-math gcc will not vectorise calls to
# expf/tanhf/coshf, and softmax (B*T*V exps) and GELU (B*T*4C per layer) would then dominate
# the non-matmul time. llmctl_expf is Cephes' expf (Cody-Waite reduction + degree-6 polynomial,
# ~1-2 ulp), written with plain float arithmetic so that gcc -O3 vectorises loops that call it
# and gives the same bits at every vector width (no fp contraction under -std=c11).

cdef extern from *:
    """
    #include <math.h>
    #include <stdint.h>
    #include <string.h>

    /* exp(x) for float x <= 88.37 (callers pass x <= 0): 0 below ln(FLT_MIN), NaN stays NaN.
       Every select is done with integer masks: gcc will not if-convert float compares under
       the default -ftrapping-math, and a branch would stop the vectoriser. */
    static inline float llmctl_expf(float x) {
        const float lo = -87.3365447504f;
        int32_t keep = -(int32_t)!(x < lo);          /* all ones unless x < lo */
        float lof = lo, xc, scale;
        int32_t xb, lb, bits;
        memcpy(&xb, &x, 4);
        memcpy(&lb, &lof, 4);
        xb = (xb & keep) | (lb & ~keep);             /* xc = max(x, lo), NaN kept */
        memcpy(&xc, &xb, 4);
        /* n = round(x / ln2) with the 1.5*2^23 trick (exact for |n| < 2^22; vectorises) */
        float fn = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
        float r = xc - fn * 0.693359375f;
        r = r - fn * -2.12194440e-4f;
        float p = 1.9875691500e-4f;
        p = p * r + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        p = p * (r * r) + r + 1.0f;
        bits = (int32_t)(((uint32_t)((int32_t)fn + 127) << 23)) & keep;  /* 2^n, or 0 */
        memcpy(&scale, &bits, 4);
        return p * scale;
    }

    /* tanh(u) and sech^2(u) = 1/cosh^2(u) from one exp: t = exp(-2|u|) in (0, 1],
       tanh|u| = (1-t)/(1+t), sech^2 u = 4t/(1+t)^2 (no overflow for any u). */
    static inline float llmctl_tanhf(float u) {
        float t = llmctl_expf(-2.0f * fabsf(u));
        return copysignf((1.0f - t) / (1.0f + t), u);
    }
    static inline float llmctl_sech2f(float u) {
        float t = llmctl_expf(-2.0f * fabsf(u));
        float d = 1.0f + t;
        return (4.0f * t) / (d * d);
    }
    """
    float llmctl_expf(float x) noexcept nogil
    float llmctl_tanhf(float u) noexcept nogil
    float llmctl_sech2f(float u) noexcept nogil


cdef inline int check_threads(int n_threads) except -1:
    if n_threads < 1:
        raise ValueError(f"n_threads must be >= 1, got {n_threads}")
    return 0


cdef inline int check_len(str name, Py_ssize_t got, Py_ssize_t want, str shape=None) except -1:
    # shape, if given, says where `want` comes from, e.g. "B*T*C = 2*5*8"
    if got != want:
        raise ValueError(f"{name} has {got} elements, expected {want}" + (f" = {shape}" if shape else ""))
    return 0


cdef inline int check_positive(str name, long value) except -1:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return 0


cdef inline int eff_threads(int n_threads, Py_ssize_t work, Py_ssize_t grain) noexcept nogil:
    # Threads worth waking for `work` elements: at most n_threads, one per `grain` elements, at
    # least 1. A fork/join costs ~10 us on an idle machine but a scheduler tick (ms) on a loaded
    # one, so small kernels run serially. Only used by kernels whose bits do not depend on the
    # thread count, so this never changes results.
    cdef Py_ssize_t t = n_threads
    if grain > 0:
        t = work // grain
    if t > n_threads:
        t = n_threads
    if t < 1:
        t = 1
    return <int>t


cdef inline Py_ssize_t imin(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return a if a < b else b


cdef inline int check_disjoint(str a, const float* pa, Py_ssize_t na, str b, const float* pb,
                               Py_ssize_t nb) except -1:
    # for kernels whose output must not share memory with an input (BLAS, accumulations that
    # read the other operand after writing): raise instead of silently computing garbage
    if pa < pb + nb and pb < pa + na:
        raise ValueError(f"{a} and {b} overlap in memory; they must not overlap: pass separate buffers")
    return 0
