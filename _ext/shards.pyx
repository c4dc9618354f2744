"""The shard reader's two tight loops: gather one (B,T) batch from a token shard, and permute.

What it is: `shards_gather` copies B*T+1 consecutive uint16 tokens (usually from a read-only
memory map of an llm.c `.bin` shard, `dev/data/data_common.py` `write_datafile`) into int32 inputs and targets shifted by one, as
llm.c's `dataloader_load_batch` does after its fread; `shards_permute` is llm.c's
`random_permutation` (rand.h) driven by a block of precomputed mt19937 outputs, so a 400k-sample
shard is shuffled in C instead of a Python loop.
What it is not: file handling, validation of headers, the shuffle bookkeeping or the RNG itself
(all in llmctl/loader.py and llmctl/rand.py). Mirrors llm.c `llmc/dataloader.h` and `llmc/rand.h`.
"""
from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t


# ---------------------------------------------------------------------------------------------
# gather

cdef void shards_gather(int32_t* inputs, int32_t* targets, const uint16_t* tokens,
                        int64_t BT) noexcept nogil:
    # inputs, targets: (B*T,); tokens: B*T+1 consecutive tokens of the shard
    cdef int64_t i
    for i in range(BT):
        inputs[i] = tokens[i]
        targets[i] = tokens[i + 1]


def gather_batch(int32_t[::1] inputs, int32_t[::1] targets, const uint16_t[::1] tokens,
                 Py_ssize_t start):
    """inputs[i] = tokens[start+i], targets[i] = tokens[start+i+1] for i < len(inputs).

    inputs/targets: flat int32 (B*T,) C-contiguous; tokens: a shard's uint16 payload (may be a
    read-only memory map). Raises ValueError when the slice does not fit.
    """
    cdef int64_t BT = inputs.shape[0]
    if targets.shape[0] != BT:
        raise ValueError(f"inputs has {BT} elements but targets has {targets.shape[0]}")
    if BT <= 0:
        raise ValueError("cannot gather an empty batch")
    if start < 0 or start + BT + 1 > tokens.shape[0]:
        raise ValueError(f"batch [{start}, {start + BT + 1}) lies outside the shard's "
                         f"{tokens.shape[0]} tokens")
    with nogil:
        shards_gather(&inputs[0], &targets[0], &tokens[start], BT)


# ---------------------------------------------------------------------------------------------
# permutation

cdef void shards_permute(int32_t* a, int64_t n, const uint32_t* rands) noexcept nogil:
    # llm.c random_permutation: for i = n-1 down to 1, j = randint32() % (i+1), swap a[i], a[j];
    # rands[k] is the k-th randint32 drawn, so exactly n-1 values are consumed.
    cdef int64_t i, j, k = 0
    cdef int32_t tmp
    i = n - 1
    while i >= 1:
        j = rands[k] % <uint32_t>(i + 1)
        k += 1
        tmp = a[i]
        a[i] = a[j]
        a[j] = tmp
        i -= 1


def permute(int32_t[::1] a, const uint32_t[::1] rands):
    """Shuffle `a` in place exactly as llm.c's random_permutation, given its n-1 randint32 draws."""
    cdef int64_t n = a.shape[0]
    cdef int64_t need = n - 1 if n > 1 else 0
    if rands.shape[0] != need:
        raise ValueError(f"a permutation of {n} items consumes {need} random numbers, "
                         f"got {rands.shape[0]}")
    if n <= 1:
        return
    with nogil:
        shards_permute(&a[0], n, &rands[0])
