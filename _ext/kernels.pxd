# Shared declarations for llmctl's GPT-2 kernels (matmul.pyx, layers.pyx, adamw.pyx, attention.pyx).
#
# What it is: the dimension legend every kernel signature uses, the declarations of mathf.h's
# vectorisable expf and the tanh/sech^2 pair GELU needs, and the argument checks every `def`
# wrapper shares. What it is not: a place for cdef kernels (each .pyx is self-contained)
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
# The vectorisable float math (llmctl_expf, llmctl_tanhf, llmctl_sech2f) is C in mathf.h.
cdef extern from "mathf.h" nogil:
    float llmctl_expf(float x)
    float llmctl_tanhf(float u)
    float llmctl_sech2f(float u)


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


cdef inline int col_chunk(Py_ssize_t n, int n_threads, int cap) noexcept nogil:
    # columns per task of a reduction that runs down every row of n columns: one wide chunk a
    # thread (the rows of a narrow chunk are each a new page: 64 columns measured 2x slower), a
    # multiple of 16, at most cap. Each column sums its rows in order whatever the chunks.
    return <int>imin(cap, (((n + n_threads - 1) // n_threads) + 15) // 16 * 16)


cdef inline int check_disjoint(str a, const float* pa, Py_ssize_t na, str b, const float* pb,
                               Py_ssize_t nb) except -1:
    # for kernels whose output must not share memory with an input (BLAS, accumulations that
    # read the other operand after writing): raise instead of silently computing garbage
    if pa < pb + nb and pb < pa + na:
        raise ValueError(f"{a} and {b} overlap in memory; they must not overlap: pass separate buffers")
    return 0
