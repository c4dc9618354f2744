"""Benchmark: llmctl's two oneDNN bf16 GEMM paths side by side, on GPT-2 d12 layer shapes.

What it measures: for each linear layer (qkv, attproj, fc, fcproj, lm head) at B*T rows, the
GFLOP/s of matmul_forward_bf16 (out = inp @ W^T + bias), of matmul_backward_bf16 with dinp=None
(dW += dout^T @ inp alone) and of the full matmul_backward_bf16 (dX = dout @ W as well, twice
the FLOPs), on
- "dnnl_gemm": oneDNN's BLAS-like dnnl_gemm_bf16bf16f32 (llmctl's bf16 engine until now), and
- "dnnl": the default bf16 engine: oneDNN's matmul primitive, cached per shape, for the forward
  and for the backward products where it is faster (set_bf16_primitive_rows for dX,
  set_bf16_primitive_dw_rows for dW: 512 rows with AMX, none without), the gemm call
  for the others,
each the best of --repeat timed calls, the two engines alternating call by call so that a busy
machine disturbs both alike. Prints the ratio new/old of GFLOP/s per product, and the sum of
the per-step matmul time of both (each layer counted L times, the lm head once).

With --fresh-shapes: the cost of shapes seen once (sampling without the KV cache grows B*T by
one per token): the forward of a qkv layer at 95 distinct row counts (5..99), each engine in
turn, twice: "dnnl" builds a primitive for each new shape (the first round also JITs kernels).

With --spread: 1000 back-to-back attproj forwards (256 x 768 x 768) per engine, and the spread
of their GFLOP/s (max, median, 10th percentile, share below 200, best of the first 8): how much a
best-of-few figure of a ~0.2 ms GEMM says on a shared machine.

What it is not: a correctness test (tests/test_bf16.py is), nor a whole step (bench/step.py).
Needs a CPU with native bf16 (AVX512_BF16 or AMX) and llmctl built with oneDNN.

    python bench/gemm.py                   # B*T = 256 (d12 B=4 T=64), 2 threads
    python bench/gemm.py --rows 4096 --repeat 5
    python bench/gemm.py --threads 1 --cpu-time     # per-core figures on a busy machine
    python bench/gemm.py --fresh-shapes
    python bench/gemm.py --rows 4096 --primitive-rows 100000 --primitive-dw-rows 100000   # the backward on the primitive too
"""
import argparse
import sys
import time

import numpy as np

from llmctl import threads as TH
from llmctl._ext import matmul

C, L, Vp = 768, 12, 50304
LINEARS = [("qkv", C, 3 * C, L), ("attproj", C, C, L), ("fc", C, 4 * C, L),
           ("fcproj", 4 * C, C, L), ("lmhead", C, Vp, 1)]   # (name, C_in, OC, count per step)
ENGINES = ("dnnl_gemm", "dnnl")
CLOCK = [time.perf_counter]  # --cpu-time swaps in time.thread_time (only meaningful with 1 thread)


def best_alternating(fns, repeat):
    """Best wall time of each of fns, called in turn (one warm-up round first)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    clock = CLOCK[0]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = clock()
            fn()
            best[i] = min(best[i], clock() - t0)
    return best


def layer_times(BT, Cin, OC, n_threads, repeat):
    """{product: ([seconds per engine], FLOP multiple)} for fwd, dW and dX+dW of one layer."""
    rng = np.random.default_rng(0)
    bits = lambda n: (rng.standard_normal(n, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    inp, w, dout16 = bits(BT * Cin), bits(OC * Cin), bits(BT * OC)
    bias = rng.standard_normal(OC, dtype=np.float32)
    out = np.empty(BT * OC, np.float32)
    dinp, dw = np.zeros(BT * Cin, np.float32), np.zeros(OC * Cin, np.float32)

    def fwd(e):
        return lambda: matmul.matmul_forward_bf16(out, inp, w, bias, BT, Cin, OC, n_threads, e)

    def bwd(e, with_dinp):
        return lambda: matmul.matmul_backward_bf16(dinp if with_dinp else None, dw, None, None, dout16,
                                                   inp, w, BT, Cin, OC, n_threads, e)
    t_fwd = best_alternating([fwd(e) for e in ENGINES], repeat)
    t_dw = best_alternating([bwd(e, False) for e in ENGINES], repeat)
    t_bwd = best_alternating([bwd(e, True) for e in ENGINES], repeat)
    return {"fwd": (t_fwd, 1), "dW": (t_dw, 1), "bwd": (t_bwd, 2)}


def fresh_shapes(n_threads, rounds=2):
    """Seconds per engine for qkv forwards at 95 row counts never seen before, per round."""
    Cin, OC = C, 3 * C
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(OC * Cin, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    x = (rng.standard_normal(100 * Cin, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    out = np.empty(100 * OC, np.float32)
    res = []
    for r in range(rounds):
        rows = range(5, 100)
        for e in ENGINES:
            b0, t0 = matmul.dnnl_matmul_builds(), time.perf_counter()
            for BT in rows:
                matmul.matmul_forward_bf16(out[:BT * OC], x[:BT * Cin], w, None, BT, Cin, OC, n_threads, e)
            res.append((r, e, time.perf_counter() - t0, matmul.dnnl_matmul_builds() - b0))
    return res


def spread(n_threads, calls=1000):
    """{engine: per-call GFLOP/s} of `calls` back-to-back attproj forwards at 256 rows."""
    BT, Cin, OC = 256, C, C
    rng = np.random.default_rng(0)
    bits = lambda n: (rng.standard_normal(n, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    x, w, out = bits(BT * Cin), bits(OC * Cin), np.empty(BT * OC, np.float32)
    res = {}
    for e in ENGINES:
        matmul.matmul_forward_bf16(out, x, w, None, BT, Cin, OC, n_threads, e)
        g = np.empty(calls)
        for i in range(calls):
            t0 = time.perf_counter()
            matmul.matmul_forward_bf16(out, x, w, None, BT, Cin, OC, n_threads, e)
            g[i] = 2.0 * BT * Cin * OC / (time.perf_counter() - t0) / 1e9
        res[e] = g
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=256, help="B*T (default 256: d12 B=4 T=64)")
    ap.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    ap.add_argument("--repeat", type=int, default=10, help="timed calls per engine (default 10)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time the calling thread's CPU time, not wall time (needs --threads 1; for a busy machine)")
    ap.add_argument("--primitive-rows", type=int, default=None,
                    help="run dnnl's backward dX on the primitive up to this many rows "
                         "(default: llmctl's choice, 512; e.g. 100000 to compare the primitive everywhere)")
    ap.add_argument("--primitive-dw-rows", type=int, default=None,
                    help="run dnnl's backward dW on the primitive up to this many rows "
                         "(default: llmctl's choice, 512 with AMX, 0 without)")
    ap.add_argument("--spread", action="store_true",
                    help="also show the spread of 1000 back-to-back attproj forwards per engine")
    ap.add_argument("--fresh-shapes", action="store_true",
                    help="also time forwards at 95 shapes seen once (the primitive's build cost)")
    args = ap.parse_args(argv)
    if args.cpu_time:
        if args.threads != 1:
            sys.exit("Error: --cpu-time measures only the calling thread\nHint: add --threads 1")
        CLOCK[0] = time.thread_time
    if "dnnl_gemm" not in matmul.get_bf16_engines():
        sys.exit("Error: no native bf16 oneDNN engine here (needs AVX512_BF16 or AMX and oneDNN)\n"
                 "Hint: llmctl info shows the CPU's bf16 features and the GEMM engine")
    TH.configure_threads(args.threads)
    if args.primitive_rows is not None:
        matmul.set_bf16_primitive_rows(args.primitive_rows)
    if args.primitive_dw_rows is not None:
        matmul.set_bf16_primitive_dw_rows(args.primitive_dw_rows)
    BT = args.rows
    print(f"bf16 GEMM GFLOP/s, B*T={BT}, {args.threads} threads, best of {args.repeat} alternating"
          f"{' (thread CPU time)' if args.cpu_time else ''}; "
          f"CPU bf16: {', '.join(matmul.cpu_bf16_features())}")
    print(f"{'layer':8} {'BT x C x OC':>18} {'prod':4} {'dnnl_gemm':>10} {'dnnl':>10} {'ratio':>6}")
    step = [0.0, 0.0]
    step_flops = sum(count * 3 * 2.0 * BT * Cin * OC for _, Cin, OC, count in LINEARS)
    for name, Cin, OC, count in LINEARS:
        flops = 2.0 * BT * Cin * OC
        for prod, ((t_old, t_new), mult) in layer_times(BT, Cin, OC, args.threads, args.repeat).items():
            g_old, g_new = mult * flops / t_old / 1e9, mult * flops / t_new / 1e9
            if prod != "dW":    # a step runs fwd and the full backward
                step[0] += count * t_old
                step[1] += count * t_new
            print(f"{name:8} {BT:>5} x {Cin:>4} x {OC:>5} {prod:4} {g_old:10.0f} {g_new:10.0f} "
                  f"{g_new / g_old:5.2f}x")
    print(f"matmul time of one d12 step (12 layers + lm head): dnnl_gemm {step[0] * 1e3:.1f} ms, "
          f"dnnl {step[1] * 1e3:.1f} ms ({step[0] / step[1]:.2f}x faster); "
          f"{step_flops / 1e9:.0f} GFLOP: {step_flops / step[0] / 1e9:.0f} vs {step_flops / step[1] / 1e9:.0f} GFLOP/s")
    if args.spread:
        for e, g in spread(args.threads).items():
            print(f"spread {e:9} attproj fwd x{g.size}: max {g.max():.0f}, median {np.median(g):.0f}, "
                  f"p10 {np.percentile(g, 10):.0f} GFLOP/s; below 200: {100 * (g < 200).mean():.0f}%; "
                  f"best of the first 8: {g[:8].max():.0f}")
    if args.fresh_shapes:
        for r, e, t, built in fresh_shapes(args.threads):
            print(f"round {r + 1}: {e:9} 95 qkv forwards at new row counts 5..99: {t * 1e3:7.1f} ms "
                  f"({built} primitives built)")


if __name__ == "__main__":
    main()
