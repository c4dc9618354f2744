"""`ExportConfig`: the settings of `llmctl export`, once: arguments, flags, help.

What it is: the TrainConfig pattern (llmctl/train_config.py: one field per flag, `flag(...)` /
`arg(...)` metadata, the CLI generated from the fields by `cli_options`) for `llmctl export`.
It has no validate(): what CHECKPOINT and OUT_DIR must be is found by reading and looking at
them (llmctl/hf/export.py, before anything is written). --json is not a field: the CLI adds it.
What it is not: the export (llmctl/hf/export.py).
"""
from dataclasses import dataclass

from llmctl.train_config import arg, flag


@dataclass
class ExportConfig:
    """Every `llmctl export` setting of its own (see the module docstring)."""

    checkpoint: str = arg(help="llm.c checkpoint .bin (v3 fp32 or v5 bf16).")
    out_dir: str = arg(help="New Hugging Face model directory to write.")
    force: bool = flag(False, "--force",
                       help="Replace OUT_DIR if it holds an earlier export (and nothing else).")
