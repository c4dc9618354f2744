"""Benchmark: every fp32 matmul product of a d12 training step, hot, one shape at a time.

What it measures, in one run (2 threads by default; best of --repeat calls each):
- for each linear layer of d12 (qkv, attproj, fc, fcproj, lm head) at --rows rows (B*T; 4096 is
  d12 B=4 T=1024), the GFLOP/s of llmctl's three products, as the step calls them:
  the forward (out = inp @ W^T + bias), dinp += dout @ W and dW += dout^T @ inp, and the
  bias gradient's time;
- their sum over one step (each layer's products L=12 times, the lm head's once): the time the
  step's matmuls take if every call runs at its hot rate, and that rate overall;
- the fp32 GEMM roof as bench/step.py samples it beside each step (d12's forward shapes at B*T=256
  and at --rows, the lm head at <= 1024 rows, the best of them), before and after the shapes.
With --split, the forward is also timed with its rows left to oneDNN's own threading
(matmul.set_forward_split_rows(0)), alternating call blocks with llmctl's cut into one block a
thread (forced at any --rows, beyond the default limit of 1024 a thread too), and the time ratio
split / oneDNN's is printed per layer (the same bits either way); the "forward" column and the
step's sum stay the default path's.
So it answers where a step's matmul time goes: bench/step.py prints the rate its matmuls ran at
inside the step ("matmuls: ... GFLOP/s"); if that equals the hot rate here, the step loses
nothing around its GEMMs, and the hot rate / roof is the most MFU its matmuls allow.

It is not a correctness test (tests/test_kernels.py is), and not the bf16 engines (bench/gemm.py).

    python bench/matmul_shapes.py                   # 4096 rows, 2 threads
    python bench/matmul_shapes.py --rows 256 --repeat 10 --json
    python bench/matmul_shapes.py --rows 1024 --split   # the forward's row split against oneDNN's threading
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from membound import best_time  # noqa: E402
from step import adjacent_roof_gflops  # noqa: E402  (the roof exactly as step.py samples it)

from llmctl import threads as TH  # noqa: E402
from llmctl._ext import matmul  # noqa: E402

L = 12
SHAPES = (("qkv", 768, 2304), ("attproj", 768, 768), ("fc", 768, 3072), ("fcproj", 3072, 768),
          ("lmhead", 768, 50304))


def split_ratio(fwd, repeat, rounds=3):
    """(seconds with the row split, whatever the default limit, seconds with oneDNN's threading):
    best of rounds alternating."""
    best = [float("inf"), float("inf")]
    old = matmul.set_forward_split_rows(0)
    try:
        for _ in range(rounds):
            for i, rows in enumerate((1 << 20, 0)):   # split at any row count from 64 a thread; never
                matmul.set_forward_split_rows(rows)
                best[i] = min(best[i], best_time(fwd, repeat))
    finally:
        matmul.set_forward_split_rows(old)
    return best


def measure(rows, n, repeat, split=False):
    rng = np.random.default_rng(0)
    out = []
    for name, C, OC in SHAPES:
        inp = rng.standard_normal(rows * C, dtype=np.float32)
        w = rng.standard_normal(OC * C, dtype=np.float32) * np.float32(0.02)
        y = np.empty(rows * OC, np.float32)
        bias = None if name == "lmhead" else np.zeros(OC, np.float32)
        dinp, dw = np.zeros(rows * C, np.float32), np.zeros(OC * C, np.float32)
        db = None if bias is None else np.zeros(OC, np.float32)
        t = {
            "forward": best_time(lambda: matmul.matmul_forward(y, inp, w, bias, rows, C, OC, n), repeat),
            "dinp": best_time(lambda: matmul.matmul_backward(dinp, None, None, y, inp, w, rows, C, OC, n), repeat),
            "dweight": best_time(lambda: matmul.matmul_backward(None, dw, None, y, inp, w, rows, C, OC, n), repeat),
            "dbias": 0.0 if db is None else best_time(
                lambda: matmul.matmul_backward(None, None, db, y, inp, w, rows, C, OC, n), repeat),
        }
        if split:
            t["forward_split"], t["forward_onednn_threads"] = split_ratio(
                lambda: matmul.matmul_forward(y, inp, w, bias, rows, C, OC, n), repeat)
        flops = 2.0 * rows * C * OC
        out.append({"layer": name, "C": C, "OC": OC, "calls_per_step": 1 if name == "lmhead" else L,
                    "seconds": t, "gflops": {k: flops / v / 1e9 for k, v in t.items() if k != "dbias"},
                    "flops": flops})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096, help="B*T rows (default 4096: d12 B=4 T=1024)")
    ap.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    ap.add_argument("--repeat", type=int, default=3, help="timed calls per product, best kept (default 3)")
    ap.add_argument("--split", action="store_true",
                    help="also time the forward with oneDNN threading its rows itself, alternating")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    n = TH.configure_threads(a.threads)
    roof_before = adjacent_roof_gflops(n, "fp32", a.rows)
    shapes = measure(a.rows, n, a.repeat, a.split)
    roof_after = adjacent_roof_gflops(n, "fp32", a.rows)
    roof = max(roof_before, roof_after)
    step_s = {k: sum(s["seconds"][k] * s["calls_per_step"] for s in shapes)
              for k in ("forward", "dinp", "dweight", "dbias")}
    step_flops = sum(3 * s["flops"] * s["calls_per_step"] for s in shapes)
    gemm_s = step_s["forward"] + step_s["dinp"] + step_s["dweight"]
    res = {"rows": a.rows, "threads": n, "engine": matmul.default_engine(), "shapes": shapes,
           "roof_gflops": [roof_before, roof_after], "step_seconds": step_s,
           "step_matmul_flops": step_flops, "step_gflops": step_flops / (gemm_s + step_s["dbias"]) / 1e9,
           "step_gflops_of_roof": step_flops / (gemm_s + step_s["dbias"]) / 1e9 / roof}
    if a.json:
        print(json.dumps(res, indent=1))
        return
    print(f"threads {n}; fp32 engine {res['engine']}; {a.rows} rows; best of {a.repeat} calls each; "
          f"roof (as bench/step.py samples it) {roof_before:.1f} before, {roof_after:.1f} after")
    extra = f"  {'fwd split':>9s} {'fwd oneDNN':>10s} {'split/oneDNN':>12s}" if a.split else ""
    print(f"{'layer':8s} {'C x OC':>12s} {'forward':>8s} {'dinp':>8s} {'dweight':>8s}  GFLOP/s; {'dbias ms':>8s}{extra}")
    for s in shapes:
        g, t = s["gflops"], s["seconds"]
        extra = (f"  {g['forward_split']:9.1f} {g['forward_onednn_threads']:10.1f} "
                 f"{t['forward_split'] / t['forward_onednn_threads']:11.3f}x" if a.split else "")
        print(f"{s['layer']:8s} {s['C']:>5d} x {s['OC']:<5d} {g['forward']:8.1f} {g['dinp']:8.1f} {g['dweight']:8.1f}"
              f"           {t['dbias'] * 1e3:8.2f}{extra}")
    print(f"one step's matmuls at these rates (layers x{L}, lm head x1): forward {step_s['forward'] * 1e3:.0f} ms, "
          f"backward {(step_s['dinp'] + step_s['dweight'] + step_s['dbias']) * 1e3:.0f} ms (dbias "
          f"{step_s['dbias'] * 1e3:.0f}); {step_flops / 1e12:.2f} TFLOP at {res['step_gflops']:.1f} GFLOP/s = "
          f"{100 * res['step_gflops_of_roof']:.1f}% of the higher roof")


if __name__ == "__main__":
    main()
