"""
Downloads and tokenizes the TinyShakespeare dataset, like llm.c's dev/data/tinyshakespeare.py.
- The download is from GitHub (karpathy/char-rnn), cached as tinyshakespeare/tiny_shakespeare.txt.
- The tokenization is GPT-2 (tiktoken's gpt2 encoding, built offline by llmctl).

The output is written to a newly created tinyshakespeare/ folder next to this script,
byte-identical to llm.c's:
    tiny_shakespeare_val.bin    32,768 tokens
    tiny_shakespeare_train.bin  305,260 tokens

This is a thin wrapper over `llmctl prepro tinyshakespeare` (see docs/data.md).
"""
import argparse
import os
import sys

from llmctl.errors import LlmctlError
from llmctl.prepro import prepro_tinyshakespeare

DATA_CACHE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tinyshakespeare")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Tiny Shakespeare dataset preprocessing")
    parser.add_argument("-m", "--model_desc", type=str, default="gpt-2", choices=["gpt-2"],
                        help="Model type, gpt-2 only here (llm.c also has llama-3)")
    parser.add_argument("--source", type=str, default=None, help="local input.txt instead of downloading")
    args = parser.parse_args()
    try:
        s = prepro_tinyshakespeare(out_dir=DATA_CACHE_DIR, source=args.source)
    except LlmctlError as e:
        sys.exit(f"Error: {e.message}" + (f"\nHint: {e.hint}" if e.hint else ""))
    for f in s["files"]:
        print(f"writing {f['tokens']:,} tokens to {f['path']}")
