"""
FineWeb / FineWeb-Edu dataset (for srs pretraining), like llm.c's dev/data/fineweb.py:
- streams HuggingFaceFW/fineweb (-t classic) or HuggingFaceFW/fineweb-edu (-t edu), config
  sample-10BT or sample-100BT (-v), with the `datasets` library (pip install datasets);
- every document -> [EOT] + GPT-2 encode_ordinary(text), tokenized in parallel;
- shards of exactly -s tokens (default 1e8); shard 0 is val, the rest train:
    fineweb10B/fineweb_val_000000.bin, fineweb10B/fineweb_train_000001.bin, ...
    edu_fineweb10B/edu_fineweb_val_000000.bin, ...
This is a thin wrapper over `llmctl prepro fineweb` / `fineweb-edu` (see docs/data.md).
"""
import argparse
import os
import sys

from llmctl.errors import LlmctlError
from llmctl.info import default_threads
from llmctl.prepro import prepro_fineweb

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="FineWeb and Edu-FineWeb dataset preprocessing")
    parser.add_argument("-t", "--type", type=str, default="classic", choices=["classic", "edu"], help="Fineweb type, edu|classic")
    parser.add_argument("-v", "--version", type=str, default="10B", choices=["10B", "100B"], help="Fineweb data sample size, 10B|100B")
    parser.add_argument("-m", "--model_desc", type=str, default="gpt-2", choices=["gpt-2"], help="Model descriptor, gpt-2 only here")
    parser.add_argument("-s", "--shard_size", type=int, default=10**8, help="Size of each data shard in the output .bin files, in tokens")
    parser.add_argument("--source", type=str, nargs="*", default=None, help="local jsonl/parquet/text files instead of streaming")
    args = parser.parse_args()
    edu = args.type == "edu"
    local_dir = ("edu_fineweb" if edu else "fineweb") + args.version
    try:
        s = prepro_fineweb(edu=edu, version=args.version, out_dir=os.path.join(HERE, local_dir), source=args.source,
                           shard_size=args.shard_size, workers=max(1, default_threads()), progress=True)
    except LlmctlError as e:
        sys.exit(f"Error: {e.message}" + (f"\nHint: {e.hint}" if e.hint else ""))
    for f in s["shards"]:
        print(f"wrote {f['tokens']:,} tokens to {f['path']}")
