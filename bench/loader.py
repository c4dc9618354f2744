"""Benchmark the training DataLoader: microseconds per `next_batch()` (shuffled, llm.c's order).

What it reports: the median over --repeat runs of the time per batch of --batches next_batch()
calls on a token shard of --tokens random GPT-2 ids (written to a temp dir), for each (B, T) asked.
Target: under 0.2 ms per batch at B=4, T=64 (a 257-token gather plus two small allocations:
well under 1% of any training step). It is not a correctness test (tests/test_loader.py is).

    python bench/loader.py                           # B=4 T=64 and B=8 T=1024
    python bench/loader.py --shape 4x64 --batches 5000 --json
"""
import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", help="BxT (repeatable; default 4x64 and 8x1024)")
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from llmctl.constants import GPT2_VOCAB_SIZE
    from llmctl.formats import write_datafile
    from llmctl.loader import DataLoader

    shapes = [tuple(int(x) for x in s.split("x")) for s in (args.shape or ["4x64", "8x1024"])]
    res = {"tokens": args.tokens, "batches": args.batches, "loadavg_1min": round(os.getloadavg()[0], 2),
           "us_per_batch": {}}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "shard.bin")
        ids = np.random.default_rng(0).integers(0, GPT2_VOCAB_SIZE, args.tokens).astype(np.uint16)
        write_datafile(path, ids)
        for B, T in shapes:
            dl = DataLoader(path, B, T)
            runs = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                for _ in range(args.batches):
                    dl.next_batch()
                runs.append((time.perf_counter() - t0) / args.batches * 1e6)
            res["us_per_batch"][f"{B}x{T}"] = round(statistics.median(runs), 2)
    if args.json:
        print(json.dumps(res))
        return
    for shape, us in res["us_per_batch"].items():
        target = "  (target < 200 us)" if shape == "4x64" else ""
        print(f"B x T = {shape:>8}: {us:8.2f} us per batch{target}")
    print(f"load average {res['loadavg_1min']}: other processes on these cores slow it down")


if __name__ == "__main__":
    main()
