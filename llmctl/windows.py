"""`llmctl.windows.TokenWindows`: a map-style dataset of (x, y) windows over llm.c token shards.

What it is: the next-token-prediction samples of a sliding window, read from memory-mapped
llm.c shards (`llmctl prepro` output, or llm.c's own). Window i of a shard with N tokens starts
at token i*stride; x is the window's block_size tokens and y the same window shifted by one.
The window starts are `range(0, N - block_size - 1, stride)`, so with stride 1 a shard has
N - block_size - 1 windows (as a `TextDataset` over a plain token list:
`len = len(tokens) - block_size - 1`), and with stride=block_size the x's do not overlap. No
window crosses from one shard into the next. It has only `__len__` and `__getitem__`, so it
works unchanged as a `torch.utils.data.Dataset` (no torch import here):

    from torch.utils.data import DataLoader
    ds = TokenWindows("data/tiny_shakespeare_train.bin", block_size=64)
    for x, y in DataLoader(ds, batch_size=4, shuffle=True, drop_last=True):  # int64 (4, 64) tensors
        ...

`WindowBatches` draws shuffled batches of it for `llmctl train --sampler windows`.
What it is not: llm.c's DataLoader (llmctl.loader: llm.c's batch order, bit for bit, the default
`--sampler llmc`) or the sorting of what `-i` matched (llmctl.inputs).
"""
import bisect
import glob as _glob
import operator
import os

import numpy as np

from llmctl.errors import ConfigError, DataError
from llmctl.formats import open_shard, read_shard_header


def _positive_int(name, v):
    try:
        v = operator.index(v)
    except TypeError:
        raise ConfigError(f"{name} {v!r}: must be an integer") from None
    if v < 1:
        raise ConfigError(f"{name} {v}: must be at least 1")
    return v


class TokenWindows:
    """Windows of `block_size` (+1) tokens every `stride` tokens over the shards `pattern`
    matches (a glob, sorted as llm.c sorts it, or a list of paths). `ds[i]` is (x, y): int64
    arrays of length block_size, y[t] = x[t+1]."""

    def __init__(self, pattern, block_size, stride=1):
        self.block_size = _positive_int("block_size", block_size)
        self.stride = _positive_int("stride", stride)
        if isinstance(pattern, (str, os.PathLike)):
            pattern = os.fspath(pattern)
            self.files = sorted(_glob.glob(pattern))
            if not self.files:
                raise DataError(f"no file matches {pattern!r}",
                                hint="check the pattern (quote it so the shell does not expand it) "
                                     "or create shards with `llmctl prepro tinyshakespeare`")
        else:
            self.files = [os.fspath(p) for p in pattern]
            if not self.files:
                raise DataError("no token shards given")
        self.shard_tokens = [read_shard_header(p).num_tokens for p in self.files]
        # window j of shard k is global index starts[k] + j
        counts = [len(range(0, n - self.block_size - 1, self.stride)) for n in self.shard_tokens]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64).tolist()
        if self.starts[-1] == 0:
            raise DataError(f"no window of block_size+2 = {self.block_size + 2} tokens fits in "
                            f"{self._what()} (largest shard: {max(self.shard_tokens)} tokens)",
                            hint="use a smaller block size or more data")
        self._maps = None

    def _what(self):
        return self.files[0] if len(self.files) == 1 else f"any of the {len(self.files)} shards"

    def __len__(self):
        return self.starts[-1]

    def locate(self, i):
        """(shard path, first token) of window i."""
        n = len(self)
        try:
            i = operator.index(i)
        except TypeError:
            raise TypeError(f"TokenWindows indices must be integers, not {type(i).__name__}") from None
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"window index out of range (len {n})")
        k = bisect.bisect_right(self.starts, i) - 1
        return k, (i - self.starts[k]) * self.stride

    def __getitem__(self, i):
        k, start = self.locate(i)
        if self._maps is None:
            self._maps = [None] * len(self.files)
        m = self._maps[k]
        if m is None:
            m = self._maps[k] = open_shard(self.files[k])
        T = self.block_size
        x = np.array(m[start:start + T], dtype=np.int64)
        y = np.array(m[start + 1:start + T + 1], dtype=np.int64)
        return x, y

    def __getstate__(self):
        # DataLoader workers get the dataset pickled: send paths, not memory maps
        state = self.__dict__.copy()
        state["_maps"] = None
        return state

    def __repr__(self):
        return (f"TokenWindows({len(self.files)} shard(s), {sum(self.shard_tokens):,} tokens, "
                f"block_size={self.block_size}, stride={self.stride}: {len(self):,} windows)")


class WindowBatches:
    """Shuffled batches of TokenWindows, what `llmctl train --sampler windows` trains on.

    Every epoch is a fresh permutation of all windows (NumPy's PCG64 seeded with (seed, epoch)),
    cut into batches of B*num_processes windows with the incomplete last batch dropped
    (DataLoader(shuffle=True, drop_last=True)); process r takes windows r*B..(r+1)*B-1 of each.
    `state()` / `load_state()` resume at the same batch. For the trainer it also speaks
    llmctl.loader.DataLoader's checkpoint interface: `state()` in the shape of llm.c's loader
    state (unshuffled; the position fields hold epoch and batch) and `resume(epoch, batch)`.
    """
    sampler = "windows"

    def __init__(self, dataset, B, process_rank=0, num_processes=1, seed=42):
        self.ds = dataset
        self.B = _positive_int("batch size", B)
        if num_processes <= 0 or not 0 <= process_rank < num_processes:
            raise ConfigError(f"process rank {process_rank} is not in a world of {num_processes}")
        self.process_rank, self.num_processes = process_rank, num_processes
        self.seed = int(seed)
        self.global_batch = self.B * num_processes
        self.batches_per_epoch = len(dataset) // self.global_batch
        if self.batches_per_epoch == 0:
            raise DataError(f"{len(dataset):,} windows are fewer than one batch of {self.global_batch} "
                            f"(B={self.B} x {num_processes} processes)",
                            hint="use a smaller -b, a smaller -t or more data")
        self.epoch = 0
        self.batch = 0
        self._perm = None
        # what the trainer reads of a loader
        self.files = dataset.files
        self.pattern = " ".join(self.files)
        self.num_tokens = self.batches_per_epoch * self.global_batch * dataset.block_size
        self.should_shuffle = False  # in llm.c's state file: no permutation arrays to save

    def _permutation(self):
        if self._perm is None:
            rng = np.random.Generator(np.random.PCG64([self.seed, self.epoch]))
            self._perm = rng.permutation(len(self.ds))
        return self._perm

    def reset(self):
        self.epoch, self.batch, self._perm = 0, 0, None

    def next_batch(self):
        """(inputs, targets): int32 (B, T) arrays of this process's windows of the next batch."""
        if self.batch >= self.batches_per_epoch:
            self.epoch, self.batch, self._perm = self.epoch + 1, 0, None
        lo = self.batch * self.global_batch + self.process_rank * self.B
        idx = self._permutation()[lo:lo + self.B]
        self.batch += 1
        T = self.ds.block_size
        x = np.empty((self.B, T), dtype=np.int32)
        y = np.empty((self.B, T), dtype=np.int32)
        for row, i in enumerate(idx):
            x[row], y[row] = self.ds[int(i)]
        return x, y

    def state(self):
        """{"epoch", "batch"}, plus llm.c's loader state fields carrying the same position."""
        return {"epoch": self.epoch, "batch": self.batch, "should_shuffle": False,
                "current_shard_idx": self.epoch, "current_sample_idx": self.batch,
                "shard_indices": None, "intra_shard_indices": None, "rng_state": None}

    def load_state(self, state):
        self.resume(state["epoch"], state["batch"])

    def resume(self, epoch, batch):
        epoch, batch = int(epoch), int(batch)
        if epoch < 0 or not 0 <= batch <= self.batches_per_epoch:
            raise DataError(f"cannot resume the window sampler at epoch {epoch}, batch {batch}: an "
                            f"epoch has {self.batches_per_epoch} batches",
                            hint="resume with the same -i, -b, -t, --sampler and number of processes")
        self.epoch, self.batch, self._perm = epoch, batch, None

    def check_vocab(self, vocab_size, n_threads=1):
        """Every token id of every shard is < vocab_size (as llmctl.loader.DataLoader checks)."""
        from llmctl._ext import tokens as _tokens

        V = int(vocab_size)
        for path in self.files:
            st = _tokens.token_stats(open_shard(path), -1, V, max(1, int(n_threads)))
            if st["out_of_vocab"]:
                raise DataError(f"shard {path} holds token id {st['max']} (and {st['out_of_vocab']} "
                                f"id(s) >= {V} in all), but the model's vocab size V is {V}",
                                hint="tokenize with the model's tokenizer, or train a model with a larger V")
