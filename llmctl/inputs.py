"""What a `llmctl train -i GLOB` matched: train shards, val shards and other llm.c files.

What it is: `split_inputs(pattern)` globs (sorted, as llm.c globs), tells llm.c files apart by
their magic, leaves out what is not training data (eval files, checkpoints, tokenizer and state
files) and splits the token shards into train and val (`*_val*`), as an `InputSplit`.
What it is not: a reader of tokens (llmctl.loader for llm.c's batches, llmctl.windows for
`--sampler windows`).
"""
import fnmatch
import glob as _glob
import os
from dataclasses import dataclass, field

from llmctl.errors import DataError, FormatError
from llmctl.formats import identify

VAL_NAME = "*_val*"  # llm.c's val shards: tiny_shakespeare_val.bin, fineweb_val_000000.bin, ...
_NOT_TRAINING_DATA = {"eval": "an eval file, for -h 1 and eval hellaswag", "checkpoint": "a model checkpoint",
                      "tokenizer": "a tokenizer file", "state": "a training state file",
                      "debug-state": "a debug state file"}


@dataclass
class InputSplit:
    """train / val: token shard paths; left_out: [(path, what it is)] for other llm.c files."""
    train: list
    val: list = field(default_factory=list)
    left_out: list = field(default_factory=list)


def split_inputs(pattern):
    """Sort the files `pattern` matches (sorted, as llm.c globs) for training.

    Other llm.c files (an eval file such as hellaswag_val.bin, a checkpoint, a tokenizer or
    state file, told apart by their magic) are left out. If the token shards include both
    val shards (names matching `*_val*`) and others, the val shards go to `val` and the rest to
    `train`; otherwise every shard is a train shard (a glob of only val shards trains on them).
    Files that are not llm.c files at all stay in `train`, so the loader names what is wrong.
    """
    files = sorted(_glob.glob(os.fspath(pattern)))
    if not files:
        raise DataError(f"no file matches {pattern!r}",
                        hint="check the pattern (quote it so the shell does not expand it) "
                             "or create shards with `llmctl prepro tinyshakespeare`")
    shards, left_out = [], []
    for path in files:
        try:
            kind = identify(path)
        except FormatError:
            kind = None
        if kind in _NOT_TRAINING_DATA:
            left_out.append((path, _NOT_TRAINING_DATA[kind]))
        else:
            shards.append(path)
    if not shards:
        what = "; ".join(f"{p}: {w}" for p, w in left_out[:4])
        raise DataError(f"{pattern!r} matches no token shard, only other llm.c files ({what})",
                        hint="point -i at token shards, e.g. 'data/*.bin' after `llmctl prepro tinyshakespeare`")
    val = [p for p in shards if fnmatch.fnmatch(os.path.basename(p), VAL_NAME)]
    train = [p for p in shards if p not in val]
    if not train:
        train, val = val, []
    return InputSplit(train, val, left_out)
