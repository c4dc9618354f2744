"""`InspectBinConfig`: the settings of `llmctl inspect-bin`, once: default, flags, help, range.

What it is: the TrainConfig pattern (llmctl/train_config.py: one field per flag, `flag(...)` /
`arg(...)` metadata, the CLI generated from the fields by `cli_options`) for `llmctl
inspect-bin`. It has no validate(): --decode's range (>= 0) is the option's `min`, and each
file is validated by the command itself (a bad file is a result, not a usage error). --json is
not a field: the CLI adds it (between FILES and --decode in --help).
What it is not: the checks of the files (llmctl/inspect_bin.py).
"""
from dataclasses import dataclass
from typing import List, Optional

from llmctl.paths import DATA_DIR
from llmctl.train_config import arg, flag


@dataclass
class InspectBinConfig:
    """Every `llmctl inspect-bin` setting of its own (see the module docstring)."""

    files: Optional[List[str]] = arg(None, show_default=False, metavar="FILES",
                                     help="llm.c .bin files: token shards, eval files, checkpoints, "
                                          "tokenizer and state files (default: every .bin under "
                                          f"{DATA_DIR}/).")
    decode: int = flag(0, "--decode", min=0, metavar="N",
                       help="Also print the first N tokens of each shard (or of the first eval "
                            "example) as text.")
