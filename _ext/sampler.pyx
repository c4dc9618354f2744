"""llm.c's sampler: one token id from raw logits and a coin, with llmc/sampler.h's arithmetic.

What it is: `sample_softmax(logits, coin)`, llm.c's `sample_softmax(logits, n, coin)`: softmax
over the raw logits without a max subtraction, a double normaliser, the coin scaled by it in
float, and a float running CDF walked in id order (the last id if the coin is never passed).
Being C, it rounds exactly as llm.c does, so a plain sample picks llm.c's tokens.
What it is not: temperature, top-k or top-p (llmctl/sample.py, in NumPy), the RNG (the caller's
coin) or the forward that produces the logits (llmctl/model/gpt2.py).
"""
from cython.parallel cimport prange
from libc.math cimport expf
from libc.stdlib cimport free, malloc

cdef enum:
    CHUNK = 4096    # ids per task of the exp pass


cdef int sample_softmax_c(const float* logits, int n, float coin, int n_threads) noexcept nogil:
    # llm.c's two passes each take expf of every logit they reach; here each expf is taken once,
    # on the threads, and both passes read the stored values: the same floats, added in the same
    # order (-1: out of memory)
    cdef float* e = <float*>malloc(<size_t>n * sizeof(float))
    cdef double norm = 0.0
    cdef float cdf = 0.0
    cdef int i, ch
    if e == NULL:
        return -1
    for ch in prange((n + CHUNK - 1) // CHUNK, schedule='static', num_threads=n_threads):
        for i in range(ch * CHUNK, min(n, ch * CHUNK + CHUNK)):
            e[i] = expf(logits[i])
    for i in range(n):
        norm += e[i]
    coin = <float>(coin * norm)
    for i in range(n):
        cdf += e[i]
        if coin < cdf:
            free(e)
            return i
    free(e)
    return n - 1


def sample_softmax(const float[::1] logits, float coin, int n_threads=1):
    """llm.c's sample_softmax(logits, n, coin) over all of `logits` (pass the first V only); the
    exps on n_threads (the same token for any count)."""
    if logits.shape[0] < 1:
        raise ValueError("logits is empty")
    if n_threads < 1:
        raise ValueError(f"n_threads must be >= 1, got {n_threads}")
    cdef int r
    with nogil:
        r = sample_softmax_c(&logits[0], <int>logits.shape[0], coin, n_threads)
    if r < 0:
        raise MemoryError(f"sample_softmax: no memory for {logits.shape[0]} probabilities")
    return r
