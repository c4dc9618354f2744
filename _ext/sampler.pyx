"""llm.c's sampler: one token id from raw logits and a coin, with llmc/sampler.h's arithmetic.

What it is: `sample_softmax(logits, coin)`, llm.c's `sample_softmax(logits, n, coin)`: softmax
over the raw logits without a max subtraction, a double normaliser, the coin scaled by it in
float, and a float running CDF walked in id order (the last id if the coin is never passed).
Being C, it rounds exactly as llm.c does, so a plain sample picks llm.c's tokens.
What it is not: temperature, top-k or top-p (llmctl/sample.py, in NumPy), the RNG (the caller's
coin) or the forward that produces the logits (llmctl/model/gpt2.py).
"""
from libc.math cimport expf


cdef int sample_softmax_c(const float* logits, int n, float coin) noexcept nogil:
    cdef double norm = 0.0
    cdef float cdf = 0.0
    cdef int i
    for i in range(n):
        norm += expf(logits[i])
    coin = <float>(coin * norm)
    for i in range(n):
        cdf += expf(logits[i])
        if coin < cdf:
            return i
    return n - 1


def sample_softmax(const float[::1] logits, float coin):
    """llm.c's sample_softmax(logits, n, coin) over all of `logits` (pass the first V only)."""
    if logits.shape[0] < 1:
        raise ValueError("logits is empty")
    cdef int r
    with nogil:
        r = sample_softmax_c(&logits[0], <int>logits.shape[0], coin)
    return r
