"""
Downloads HellaSwag and writes hellaswag/hellaswag_val.bin in llm.c's eval format, like the
.bin writing in llm.c's dev/data/hellaswag.py (ctx verbatim, endings with one leading space,
tiktoken gpt2 `encode`, jsonl order). 10,042 examples, ~3.6 MB.

The jsonl is cached as hellaswag/hellaswag_val.jsonl next to this script. Evaluating a model
on it is `llmctl eval hellaswag`, not this script.
This is a thin wrapper over `llmctl prepro hellaswag` (see docs/data.md).
"""
import argparse
import os
import sys

from llmctl.errors import LlmctlError
from llmctl.prepro import prepro_hellaswag

DATA_CACHE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hellaswag")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="HellaSwag preprocessing")
    parser.add_argument("-s", "--split", type=str, default="val", choices=["val", "train"], help="split to write")
    parser.add_argument("--source", type=str, default=None, help="local hellaswag_<split>.jsonl instead of downloading")
    args = parser.parse_args()
    try:
        s = prepro_hellaswag(out_dir=DATA_CACHE_DIR, source=args.source, split=args.split)
    except LlmctlError as e:
        sys.exit(f"Error: {e.message}" + (f"\nHint: {e.hint}" if e.hint else ""))
    print(f"wrote {s['examples']:,} examples to {s['path']}")
