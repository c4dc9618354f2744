"""The settings of each `llmctl prepro` command, once: default, flags, help, range.

What it is: the TrainConfig pattern (llmctl/train_config.py: one field per flag, `flag(...)` /
`arg(...)` metadata, the CLI generated from the fields by `cli_options`) for the prepro
commands, one dataclass each. The settings several of them take (-w, -s, --parallelism) are
written once below (`_workers()`, ...: each call is a new field). `validate()` raises
ConfigError (exit 2) naming the flag, before anything is read, downloaded or written. --json
is not a field: the CLI adds it to every command.
What it is not: the work (llmctl/prepro/), or resolving -w 0 to a thread count (the CLI does,
warning when it caps an oversubscribed -w).
"""
from dataclasses import dataclass
from typing import List, Optional

from llmctl.errors import ConfigError
from llmctl.paths import DATA_DIR, TINYSHAKESPEARE_URL
from llmctl.train_config import arg, flag

DEFAULT_SHARD_SIZE = 10**8  # llm.c fineweb.py's -s
FINEWEB_VERSIONS = ("10B", "100B")


def _workers():
    return flag(0, "--workers", "-w",
                help="Tokenizer threads/processes (0 = OMP_NUM_THREADS or all cores).")


def _shard_size():
    return flag(DEFAULT_SHARD_SIZE, "--shard-size", "-s",
                help="Tokens per shard (llm.c fineweb.py: -s).")


def _parallelism():
    return flag("threads", "--parallelism", "--backend",
                help="How the -w workers tokenize: threads (tiktoken, GIL-free) or processes "
                     "(--backend is an alias).")


def _timeout():
    return flag(30.0, "--timeout", help="Download timeout in seconds.")


def check_fineweb_version(version):
    """ConfigError unless --version is a FineWeb sample llm.c's fineweb.py offers."""
    if version not in FINEWEB_VERSIONS:
        raise ConfigError(f"--version {version!r}: use 10B or 100B",
                          hint="the FineWeb samples llm.c's fineweb.py offers: sample-10BT, "
                               "sample-100BT")


def check_workers(workers):
    """ConfigError for a negative -w (0 means the default thread count)."""
    if workers < 0:
        raise ConfigError(f"--workers {workers}: must be >= 0",
                          hint="0 = OMP_NUM_THREADS or all cores")


def check_tokenizing(workers, parallelism):
    """-w and --parallelism (the check of --parallelism: llmctl.prepro.writer)."""
    from llmctl.prepro.writer import check_parallelism

    check_workers(workers)
    check_parallelism(parallelism)


def check_shard_size(shard_size):
    """ConfigError unless -s is in the CLI's range (llmctl.prepro.writer.check_shard_size)."""
    from llmctl.prepro.writer import CLI_MIN_SHARD_SIZE, check_shard_size as check

    check(shard_size, minimum=CLI_MIN_SHARD_SIZE)


@dataclass
class TinyShakespeareConfig:
    """Every `llmctl prepro tinyshakespeare` setting of its own."""

    out_dir: str = flag(DATA_DIR, "--out-dir",
                        help="Output directory; the text is cached there as tiny_shakespeare.txt "
                             "(a copy put there by hand is used).")
    source: Optional[str] = flag(None, "--source",
                                 help="Local input.txt to use instead of cache/datasets/download.")
    url: str = flag(TINYSHAKESPEARE_URL, "--url",
                    help="Download URL (used only if there is no source or cached copy).")
    timeout: float = _timeout()
    workers: int = _workers()

    def validate(self):
        check_workers(self.workers)


@dataclass
class HellaswagPreproConfig:
    """Every `llmctl prepro hellaswag` setting of its own."""

    out_dir: str = flag(DATA_DIR, "--out-dir",
                        help="Output directory; the jsonl is cached there as "
                             "hellaswag_{split}.jsonl.")
    source: Optional[str] = flag(None, "--source",
                                 help="Local hellaswag_{split}.jsonl to use (default: the cached "
                                      "copy in --out-dir, else datasets, else the download).")
    split: str = flag("val", "--split", help="val (what llm.c writes) or train.")
    url: Optional[str] = flag(None, "--url",
                              help="Download URL (default: rowanz/hellaswag on GitHub).")
    timeout: float = _timeout()

    def validate(self):
        from llmctl.prepro.hellaswag import check_split

        check_split(self.split)


@dataclass
class TextConfig:
    """Every `llmctl prepro text` setting of its own."""

    files: List[str] = arg(help="UTF-8 text (docs separated by blank lines or <|endoftext|>), "
                                ".jsonl/.parquet with a 'text' field.")
    out_dir: Optional[str] = flag(None, "--out-dir", help="Output directory (default: data/NAME).")
    name: Optional[str] = flag(None, "--name",
                               help="Shard name prefix (default: the first file's stem).")
    val_tokens: Optional[int] = flag(None, "--val-tokens",
                                     help="Tokens in the val shard 0 (default: a full shard, like "
                                          "fineweb.py).")
    shard_size: int = _shard_size()
    workers: int = _workers()
    parallelism: str = _parallelism()

    def validate(self):
        check_shard_size(self.shard_size)
        check_tokenizing(self.workers, self.parallelism)


@dataclass
class TinyStoriesConfig:
    """Every `llmctl prepro tinystories` setting of its own."""

    out_dir: str = flag(DATA_DIR, "--out-dir", help="Output directory.")
    source: Optional[List[str]] = flag(None, "--source",
                                       help="Local file(s): TinyStories data*.json, jsonl, or text "
                                            "with <|endoftext|> (repeatable; default: datasets "
                                            "streaming).")
    val_tokens: int = flag(32768, "--val-tokens",
                           help="With a single --source file: its first N tokens are val.")
    workers: int = _workers()
    parallelism: str = _parallelism()

    def validate(self):
        check_tokenizing(self.workers, self.parallelism)


@dataclass
class FinewebConfig:
    """Every `llmctl prepro fineweb` setting of its own."""

    version: str = flag("10B", "--version", "-v",
                        help="Sample size: 10B or 100B (llm.c fineweb.py: -v).")
    out_dir: Optional[str] = flag(None, "--out-dir",
                                  help="Output directory (default: data/fineweb10B).")
    source: Optional[List[str]] = flag(None, "--source",
                                       help="Local jsonl/parquet/text file(s) instead of datasets "
                                            "streaming (repeatable).")
    shard_size: int = _shard_size()
    max_shards: Optional[int] = flag(None, "--max-shards",
                                     help="Stop after this many full shards (default: all data).")
    workers: int = _workers()
    parallelism: str = _parallelism()

    def validate(self):
        check_fineweb_version(self.version)
        check_shard_size(self.shard_size)
        check_tokenizing(self.workers, self.parallelism)


@dataclass
class FinewebEduConfig(FinewebConfig):
    """Every `llmctl prepro fineweb-edu` setting: fineweb's, its own default --out-dir (a field
    a subclass redefines keeps its place in the order)."""

    out_dir: Optional[str] = flag(None, "--out-dir",
                                  help="Output directory (default: data/edu_fineweb10B).")


@dataclass
class TokenizerConfig:
    """Every `llmctl prepro tokenizer` setting of its own."""

    out: str = flag("gpt2_tokenizer.bin", "--out", help="Where to write llm.c's tokenizer file.")


@dataclass
class Gpt2Config:
    """Every `llmctl prepro gpt2` setting of its own."""

    model: str = flag("gpt2", "--model",
                      help="gpt2, gpt2-medium, gpt2-large, gpt2-xl (Hugging Face Hub, cached), or a "
                           "directory with config.json + model.safetensors (llm.c train_gpt2.py: "
                           "--model).")
    out_dir: str = flag(".", "--out-dir",
                        help="Output directory (llm.c writes into the working directory, where "
                             "train_gpt2.c looks).")
    debug_state: bool = flag(False, "--debug-state",
                             help="Also write gpt2_<size>_debug_state.bin for llm.c's test_gpt2.c.")
    input_bin: str = flag("data/tiny_shakespeare_val.bin", "--input-bin", "-i",
                          help="With --debug-state: token shard whose first B*T+1 tokens are the "
                               "batch (llm.c: --input_bin).")
    batch_size: int = flag(4, "--batch-size", "-b",
                           help="With --debug-state: B (llm.c: --batch_size).")
    seq_len: int = flag(64, "--seq-len", "-t",
                        help="With --debug-state: T (llm.c: --sequence_length).")
    offline: bool = flag(False, "--offline",
                         help="Use only the Hugging Face cache (as HF_HUB_OFFLINE=1).")
    threads: int = flag(0, "--threads",
                        help="Kernel threads for --debug-state (0 = OMP_NUM_THREADS or all cores).")

    def validate(self):
        """-b and -t (with --debug-state) before the model is fetched; their upper bound, the
        model's maxT, is checked once it is read (llmctl.prepro.gpt2.debug_state_batch)."""
        for name, value in (("--batch-size", self.batch_size), ("--seq-len", self.seq_len)):
            if self.debug_state and value < 1:
                raise ConfigError(f"{name} {value}: must be >= 1",
                                  hint=f"pass {name} N with N >= 1 (llm.c writes the debug state "
                                       "with B=4, T=64)")
