"""
TinyStories, like llm.c's dev/data/tinystories.py: every story is stripped and becomes
[EOT] + GPT-2 encode_ordinary(story); the validation stories go to tinystories/TinyStories_val.bin,
the rest to tinystories/TinyStories_train.bin (the files llm.c's CPU trainer falls back to).
Source: the `datasets` library (roneneldan/TinyStories, streaming), or local files with --source
(the data*.json shards of TinyStories_all_data.tar.gz: the first file is val, as in llm.c).
This is a thin wrapper over `llmctl prepro tinystories` (see docs/data.md).
"""
import argparse
import os
import sys

from llmctl.errors import LlmctlError
from llmctl.info import default_threads
from llmctl.prepro import prepro_tinystories

DATA_CACHE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tinystories")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="TinyStories dataset preprocessing")
    parser.add_argument("-m", "--model_desc", type=str, default="gpt-2", choices=["gpt-2"], help="Model type, gpt-2 only here")
    parser.add_argument("--source", type=str, nargs="*", default=None, help="local data*.json / jsonl / text files")
    parser.add_argument("--val_tokens", type=int, default=32768, help="with one --source file: its first N tokens are val")
    args = parser.parse_args()
    try:
        s = prepro_tinystories(out_dir=DATA_CACHE_DIR, source=sorted(args.source) if args.source else None,
                               val_tokens=args.val_tokens, workers=max(1, default_threads()), progress=True)
    except LlmctlError as e:
        sys.exit(f"Error: {e.message}" + (f"\nHint: {e.hint}" if e.hint else ""))
    for f in s["files"]:
        print(f"writing {f['tokens']:,} tokens to {f['path']}")
