"""Benchmark: the bf16 lm head's GEMM with an fp32 against a bf16 output, side by side in ONE run.

What it measures: `matmul_forward_bf16` of --rows final hidden rows (bf16) by d12's tied wte
(50257 x 768, bf16), the logits written as float32 or rounded to bf16 (what HellaSwag scoring in
bf16 and the training forward hold), calls of the two alternating, best of --repeat each,
GFLOP/s and the time ratio bf16 / fp32 output. Random bits: speed does not depend on the values.
bf16 needs a CPU that multiplies bf16 natively (AVX512_BF16/AMX); elsewhere it exits with a reason.
What it is not: a correctness test (tests/test_bf16.py) or the whole scoring pass (bench/eval.py).

    python bench/lmhead.py                     # 256 rows (HellaSwag's scoring chunk), 2 threads
    python bench/lmhead.py --rows 128 512 1024 --json
"""
import argparse
import json
import sys
import time

import numpy as np

C, V = 768, 50257   # d12's channels, GPT-2's vocabulary


def measure(rows, n_threads, repeat):
    from llmctl._ext import matmul

    rng = np.random.default_rng(0)
    w = rng.integers(0x3c00, 0x3f00, size=V * C, dtype=np.uint16)   # bf16 values in [1, 2)
    x = rng.integers(0x3c00, 0x3f00, size=rows * C, dtype=np.uint16)
    outs = {"fp32": np.zeros(rows * V, np.float32), "bf16": np.zeros(rows * V, np.uint16)}
    best = {k: float("inf") for k in outs}
    for o in outs.values():   # warm-up: the primitives, page-in
        matmul.matmul_forward_bf16(o, x, w, None, rows, C, V, n_threads)
    for _ in range(repeat):
        for k, o in outs.items():
            t = time.perf_counter()
            matmul.matmul_forward_bf16(o, x, w, None, rows, C, V, n_threads)
            best[k] = min(best[k], time.perf_counter() - t)
    flops = 2.0 * rows * C * V
    return {"rows": rows, "ms": {k: round(v * 1e3, 3) for k, v in best.items()},
            "gflops": {k: round(flops / v / 1e9, 1) for k, v in best.items()},
            "bf16_over_fp32_time": round(best["bf16"] / best["fp32"], 3)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[256], help="rows per call (default 256)")
    ap.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    ap.add_argument("--repeat", type=int, default=10, help="calls per output type, best kept (default 10)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from llmctl._ext import matmul

    if not matmul.bf16_native():
        sys.exit("bench/lmhead.py: this CPU has no native bf16 (AVX512_BF16 or AMX)")
    res = {"threads": args.threads, "runs": [measure(r, args.threads, args.repeat) for r in args.rows]}
    if args.json:
        print(json.dumps(res))
        return
    print(f"bf16 lm head (768 x 50257), {args.threads} threads, best of {args.repeat} alternating calls")
    for r in res["runs"]:
        print(f"  {r['rows']:5d} rows: fp32 output {r['gflops']['fp32']:7.1f} GFLOP/s, bf16 output "
              f"{r['gflops']['bf16']:7.1f} GFLOP/s, time bf16 / fp32 {r['bf16_over_fp32_time']:.3f}x")


if __name__ == "__main__":
    main()
