"""`HellaswagConfig` and `EvalLossConfig`: the settings of `llmctl eval hellaswag` and `eval loss`.

What it is: the TrainConfig pattern (llmctl/train_config.py: one field per flag, `flag(...)`
metadata, the CLI generated from the fields by `cli_options`) for the two eval commands.
`validate()` raises ConfigError (exit 2) naming the flag, before any data is fetched. The
options every model command shares (-e, --threads, --precision, --json) are not fields here:
the CLI adds them (llmctl/options.py).
What it is not: the evaluation (llmctl/evaluate.py, which checks -b/-t/-m against the model).
"""
from dataclasses import dataclass
from typing import Optional

from llmctl.errors import ConfigError
from llmctl.paths import HELLASWAG_VAL, TINYSHAKESPEARE_VAL
from llmctl.train_config import flag

NORMS = ("tokens", "chars")


@dataclass
class HellaswagConfig:
    """Every `llmctl eval hellaswag` setting of its own (see the module docstring)."""

    input_file: Optional[str] = flag(None, "--input", "-i", show_default=False,
                                     help="llm.c eval file (written by `llmctl prepro hellaswag`) "
                                          f"(default: {HELLASWAG_VAL}, written first if it is "
                                          "missing).")
    limit: Optional[int] = flag(None, "--limit", min=1,
                                help="Score only the first N examples (default: all).")
    norm: str = flag("tokens", "--norm",
                     help="acc_norm normalisation: tokens (llm.c: mean loss per token) or chars "
                          "(lm-evaluation-harness: per character).")
    per_example: bool = flag(False, "--per-example",
                             help="With --json: include every example's losses and choices.")
    batch_tokens: int = flag(2048, "--batch-tokens", min=64,
                             help="Padded positions per forward batch (memory vs. speed; fp32 "
                                  "ran ~7 % faster at 4096 on a Zen 4, bf16 no faster; the "
                                  "losses can change in the last bits with it).")
    nproc: int = flag(1, "--nproc", min=1,
                      help="Processes on this host, each scoring a contiguous slice as llm.c's "
                           "ranks do (llm.c -pn); threads per process = cores / N unless "
                           "--threads. No --per-example or progress bar with N > 1.")

    def validate(self):
        if self.norm not in NORMS:
            raise ConfigError(f"--norm must be 'tokens' or 'chars', got {self.norm!r}",
                              hint="tokens is llm.c's acc_norm, chars lm-evaluation-harness's")
        if self.per_example and self.nproc > 1:
            raise ConfigError("--per-example needs --nproc 1",
                              hint="drop --nproc (each process keeps only its own examples' "
                                   "results)")


@dataclass
class EvalLossConfig:
    """Every `llmctl eval loss` setting of its own (see the module docstring)."""

    pattern: str = flag(TINYSHAKESPEARE_VAL, "--val", "-j",
                        help="Token shard glob, quoted (llm.c: -j).")
    batch_size: int = flag(4, "--batch-size", "-b", help="Sequences per forward (llm.c: -b).")
    seq_len: Optional[int] = flag(None, "--seq-len", "-t",
                                  help="Sequence length T (default: min(1024, maxT)) (llm.c: -t).")
    max_batches: int = flag(-1, "--max-batches", "-m",
                            help="Stop after N batches; -1 = every full batch of every shard "
                                 "(llm.c: -m).")
