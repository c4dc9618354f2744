"""The training DataLoader: llm.c's `llmc/dataloader.h`, batch for batch.

What it is: a sorted glob of llm.c token shards (`data_common.py` `write_datafile`), every shard validated up front, each rank
reading its own B*T+1 slice of every P*B*T-token sample (targets = inputs shifted by one), and the
two-level shuffle: shard order permuted in place at every epoch (permutations compose), samples
inside a shard permuted from identity each time a shard is entered, with an mt19937 seeded 42+rank
(PyTorch's generator, llmctl.rand). Given the same files, B, T, rank and world size, the sequence
of batches is identical to llm.c's. Reads go through a memory map; the gather is nogil Cython
(llmctl._ext.shards). `state()`/`load_state()` carry exactly what llm.c's state file holds (`train_gpt2.cu` `save_state`).
What it is not: the EvalLoader (HellaSwag) or train_gpt2.py's simpler Python loader.
Reference: llm.c's `llmc/dataloader.h` (`dataloader_init`, `dataloader_next_batch`, `dataloader_resume`).
"""
import glob as _glob

import numpy as np

from llmctl._ext import shards as _shards
from llmctl._ext import tokens as _tokens
from llmctl.errors import ConfigError, DataError, FormatError
from llmctl.formats import open_shard, read_shard_header
from llmctl.rand import Mt19937


def _check_gpt2_shard(path):
    """Validated token count of a GPT-2 (uint16) llm.c shard; llama-3 shards are refused."""
    hdr = read_shard_header(path)
    if np.dtype(hdr.dtype) != np.uint16:
        raise FormatError(f"{path}: is a llama-3 (uint32) token shard; llmctl trains GPT-2 only",
                          hint="tokenize with the GPT-2 tokenizer: `llmctl prepro ...`")
    return hdr.num_tokens


def _new_rng(seed):
    return Mt19937(seed)


def _permute(arr, rng):
    """llm.c random_permutation(arr) in place: n-1 randint32 draws, Fisher-Yates from the top."""
    n = arr.shape[0]
    if n <= 1:
        return
    rands = np.ascontiguousarray(rng.randint32_array(n - 1), dtype=np.uint32)
    _shards.permute(arr, rands)


class DataLoader:
    """llm.c's DataLoader. `next_batch()` returns (inputs, targets), fresh int32 (B, T) arrays.

    pattern: a glob (sorted, as llm.c's glob) or a list of shard paths, used in that order.
    seed: the shuffle RNG of rank r is seeded with seed + r (llm.c hard-codes 42).
    """
    sampler = "llmc"  # `train --sampler` of this loader (checkpoints.load compares it on resume)

    def __init__(self, pattern, B, T, process_rank=0, num_processes=1, shuffle=True, seed=42,
                 vocab_size=None, n_threads=1):
        if B <= 0 or T <= 0:
            raise ConfigError(f"batch size and sequence length must be positive (B={B}, T={T})")
        if num_processes <= 0 or not 0 <= process_rank < num_processes:
            raise ConfigError(f"process rank {process_rank} is not in a world of {num_processes}")
        self.pattern = pattern
        self.B, self.T = B, T
        self.process_rank, self.num_processes = process_rank, num_processes
        self.should_shuffle = bool(shuffle)
        # sizes in tokens (llm.c counts bytes; /2 everywhere)
        self.total_batch_tokens = num_processes * B * T
        self.local_offset_tokens = process_rank * B * T

        if isinstance(pattern, (list, tuple)):  # files already chosen (llmctl.inputs.split_inputs)
            self.files = [str(p) for p in pattern]
            self.pattern = " ".join(self.files)
        else:
            self.files = sorted(_glob.glob(pattern))
        if not self.files:
            raise DataError(f"no file matches {pattern!r}",
                            hint="check the pattern (quote it so the shell does not expand it) "
                                 "or create shards with `llmctl prepro tinyshakespeare`")
        self.num_shards = len(self.files)

        self.rng = None
        self.shard_indices = None
        self.intra_shard_indices = None
        if self.should_shuffle:
            self.rng = _new_rng(seed + process_rank)  # llm.c: 42 + rank
            self.shard_indices = np.arange(self.num_shards, dtype=np.int32)

        # validate every shard up front, in glob order (shard_indices is still the identity)
        need = self.total_batch_tokens + 1
        self.shard_tokens = []
        for path in self.files:
            n = _check_gpt2_shard(path)
            if n < need:
                raise DataError(
                    f"shard {path} has {n} tokens but needs at least P*B*T+1 = {need} "
                    f"(P={num_processes}, B={B}, T={T})",
                    hint="use a smaller -b/-t or more data")
            self.shard_tokens.append(n)
        self.num_tokens = sum(self.shard_tokens)
        if vocab_size is not None:
            self.check_vocab(vocab_size, n_threads)

        self._tokens = None
        self._loaded_file = -1
        self.current_shard_idx = 0
        self.current_sample_idx = 0
        self.shard_num_samples = 0
        self.reset()

    def check_vocab(self, vocab_size, n_threads=1):
        """Every token id of every shard must be < vocab_size (the model's V): one pass over
        the files (~0.13 s per 100M tokens), so a bad id is named before training, not mid-run
        (llm.c does not check)."""
        V = int(vocab_size)
        for path in self.files:
            st = _tokens.token_stats(open_shard(path), -1, V, max(1, int(n_threads)))
            if st["out_of_vocab"]:
                raise DataError(f"shard {path} holds token id {st['max']} (and "
                                f"{st['out_of_vocab']} id(s) >= {V} in all), but the model's "
                                f"vocab size V is {V}",
                                hint="tokenize with the model's tokenizer, or train a model "
                                     "with a larger V")

    def batches_per_epoch(self):
        """Batches this rank reads before the loader starts over: every shard's samples."""
        return sum(self._samples_in(i) for i in range(self.num_shards))

    @property
    def current_file(self):
        """The shard the last batch came from."""
        return self.files[self._loaded_file]

    # -- llm.c's functions ---------------------------------------------------------------------

    def _file_index(self, shard_idx):
        return int(self.shard_indices[shard_idx]) if self.should_shuffle else shard_idx

    def _samples_in(self, file_idx):
        # (2N - 2) / total_batch_bytes in llm.c: the -1 token reserves the last target
        return (self.shard_tokens[file_idx] - 1) // self.total_batch_tokens

    def _load_shard(self, shard_idx):
        file_idx = self._file_index(shard_idx)
        if file_idx != self._loaded_file:
            self._tokens = open_shard(self.files[file_idx])
            self._loaded_file = file_idx
        self.shard_num_samples = self._samples_in(file_idx)

    def _prepare_intra_shard_indices(self):
        self.intra_shard_indices = np.arange(self.shard_num_samples, dtype=np.int32)
        _permute(self.intra_shard_indices, self.rng)

    def reset(self):
        """Start a new epoch: shard 0, sample 0; re-shuffle shard order (composing) and samples."""
        self.current_shard_idx = 0
        self.current_sample_idx = 0
        if self.should_shuffle:
            _permute(self.shard_indices, self.rng)
        self._load_shard(0)
        if self.should_shuffle:
            self._prepare_intra_shard_indices()

    def advance(self):
        """Move to the next shard, or start a new epoch after the last one."""
        if self.current_shard_idx == self.num_shards - 1:
            self.reset()
            return
        self.current_shard_idx += 1
        self.current_sample_idx = 0
        self._load_shard(self.current_shard_idx)
        if self.should_shuffle:
            self._prepare_intra_shard_indices()

    def resume(self, shard_idx, sample_idx):
        """Continue at (shard_idx, sample_idx); shard_indices/intra indices/RNG are not touched."""
        if not 0 <= shard_idx < self.num_shards:
            raise DataError(f"cannot resume at shard {shard_idx}: {self.pattern!r} has "
                            f"{self.num_shards} shard(s)")
        self.current_shard_idx = int(shard_idx)
        self.current_sample_idx = int(sample_idx)
        self._load_shard(self.current_shard_idx)
        if self.current_sample_idx > self.shard_num_samples:
            raise DataError(f"cannot resume at sample {sample_idx}: shard "
                            f"{self.files[self._loaded_file]} has {self.shard_num_samples} samples")

    def _load_batch(self):
        s = self.current_sample_idx
        if s >= self.shard_num_samples:  # llm.c asserts
            raise RuntimeError(f"sample {s} out of range ({self.shard_num_samples})")
        if self.should_shuffle:
            s = int(self.intra_shard_indices[s])
        start = s * self.total_batch_tokens + self.local_offset_tokens
        inputs = np.empty((self.B, self.T), dtype=np.int32)
        targets = np.empty((self.B, self.T), dtype=np.int32)
        _shards.gather_batch(inputs.reshape(-1), targets.reshape(-1), self._tokens, start)
        return inputs, targets

    def next_batch(self):
        """The next (inputs, targets) pair, int32 (B, T), advancing shards/epochs as needed."""
        if self.current_sample_idx >= self.shard_num_samples:
            self.advance()
        batch = self._load_batch()
        self.current_sample_idx += 1
        return batch

    # -- checkpointed state (llm.c state file) -------------------------------------------

    def state(self):
        """What llm.c's save_state writes for the loader (arrays are copies)."""
        st = {
            "should_shuffle": self.should_shuffle,
            "current_shard_idx": self.current_shard_idx,
            "current_sample_idx": self.current_sample_idx,
            "shard_indices": None, "intra_shard_indices": None, "rng_state": None,
        }
        if self.should_shuffle:
            st["shard_indices"] = self.shard_indices.copy()
            st["intra_shard_indices"] = self.intra_shard_indices.copy()
            st["rng_state"] = bytes(self.rng.get_state_bytes())
        return st

    def load_state(self, shard_indices=None, intra_shard_indices=None, rng_state=None,
                   current_shard_idx=None, current_sample_idx=None, source="state"):
        """Restore shuffle arrays and RNG (llm.c load_state), then resume() at the given indices.

        `source` names the file the state came from, for error messages.
        """
        if self.should_shuffle:
            if shard_indices is None or intra_shard_indices is None or rng_state is None:
                raise FormatError(f"{source}: has no shuffle state but the train loader shuffles")
            si = np.asarray(shard_indices, dtype=np.int32).copy()
            if si.shape != (self.num_shards,) or not np.array_equal(np.sort(si), np.arange(self.num_shards)):
                raise DataError(f"{source}: saved shard order has {si.size} shard(s) but "
                                f"{self.pattern!r} matches {self.num_shards}",
                                hint="resume with the same -i pattern and files")
            self.shard_indices = si
            rng = _new_rng(0)
            rng.set_state_bytes(bytes(rng_state))
            self.rng = rng
        if current_shard_idx is not None:
            self.resume(current_shard_idx, current_sample_idx or 0)
        if self.should_shuffle:
            ii = np.asarray(intra_shard_indices, dtype=np.int32).copy()
            if ii.shape != (self.shard_num_samples,):
                raise DataError(f"{source}: saved sample order has {ii.size} samples but the "
                                f"shard has {self.shard_num_samples} at B={self.B}, T={self.T}, "
                                f"P={self.num_processes}",
                                hint="resume with the same -i, -b, -t and number of processes")
            self.intra_shard_indices = ii
