"""Benchmark: llmctl's GPT-2 kernels at d12 (124M) shapes, B=4, T=64.

What it measures (best wall time of --repeat runs, threads pinned with llmctl.threads):
- NumPy's fp32 GEMM peak on this machine in this run (a square-ish 1024^3 float32 matmul, BLAS
  limited to the same thread count): the yardstick for MFU,
- matmul forward and backward for each d12 linear layer (qkv, attproj, fc, fcproj, lm head),
  engine "blas" vs "tiled" vs the same products done with NumPy float32 `@`,
- every other kernel (encoder, layernorm, GELU, residual, softmax+CE, attention if built); on
  an AVX2 / AVX-512 CPU GELU also with its baseline x86-64 loop (layers.set_simd(False)), side by side,
- AdamW over 124,475,904 floats (the d12 parameter count) and the global grad norm,
- an estimated whole step (the kernel sequence of one forward+backward+update, from the timings
  above) with its MFU = 6*N*B*T / step time / NumPy peak, and the share of non-matmul kernels.

It is not a correctness test (tests/test_kernels.py is).

    python bench/kernels.py                     # 2 threads, human-readable
    python bench/kernels.py --threads 1 --repeat 5 --json
    python bench/kernels.py --skip-tiled        # the tiled GEMM is slow at lm-head size
    python bench/kernels.py --threads 1 --cpu-time   # per-core figures on a busy machine
"""
import argparse
import json
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

from llmctl import threads as TH
from llmctl._ext import adamw, layers, matmul
from llmctl.constants import GPT2_PADDED_VOCAB_SIZE, GPT2_VOCAB_SIZE

B, T, C, NH, L, V, Vp, maxT = 4, 64, 768, 12, 12, GPT2_VOCAB_SIZE, GPT2_PADDED_VOCAB_SIZE, 1024
BT = B * T
NUM_PARAMS = 124_475_904
LINEARS = [  # (name, C_in, OC, count per step)
    ("qkv", C, 3 * C, L),
    ("attproj", C, C, L),
    ("fc", C, 4 * C, L),
    ("fcproj", 4 * C, C, L),
    ("lmhead", C, Vp, 1),
]


CLOCK = [time.perf_counter]  # --cpu-time swaps in time.thread_time (only meaningful with 1 thread)


def timeit(fn, repeat, warmup=1):
    clock = CLOCK[0]
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        ts.append(clock() - t0)
    return min(ts)  # best of N: the machine is shared, and noise only ever adds time


def numpy_peak(n_threads, repeat):
    """GFLOP/s of a float32 1024x1024 @ 1024x1024 NumPy matmul with n_threads BLAS threads."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((1024, 1024), dtype=np.float32)
    b = rng.standard_normal((1024, 1024), dtype=np.float32)
    out = np.empty((1024, 1024), np.float32)
    with threadpool_limits(n_threads, user_api="blas"):
        t = timeit(lambda: np.matmul(a, b, out=out), max(repeat, 5), warmup=2)
    return 2 * 1024 ** 3 / t / 1e9


def bench_matmuls(n, repeat, engines):
    rng = np.random.default_rng(1)
    rows = []
    for name, Cin, OC, count in LINEARS:
        inp = rng.standard_normal(BT * Cin, dtype=np.float32)
        w = rng.standard_normal(OC * Cin, dtype=np.float32) * 0.02
        bias = None if name == "lmhead" else np.zeros(OC, np.float32)
        out = np.empty(BT * OC, np.float32)
        dout = rng.standard_normal(BT * OC, dtype=np.float32)
        dinp = np.zeros(BT * Cin, np.float32)
        dw = np.zeros(OC * Cin, np.float32)
        db = None if bias is None else np.zeros(OC, np.float32)
        flops_f = 2.0 * BT * Cin * OC
        row = {"layer": name, "C": Cin, "OC": OC, "count": count, "fwd_gflop": flops_f / 1e9}
        for be in engines:
            r = repeat if (be == "blas" or name != "lmhead") else 1
            row[f"{be}_fwd_ms"] = 1e3 * timeit(
                lambda: matmul.matmul_forward(out, inp, w, bias, BT, Cin, OC, n, be), r)
            row[f"{be}_bwd_ms"] = 1e3 * timeit(
                lambda: matmul.matmul_backward(dinp, dw, db, dout, inp, w, BT, Cin, OC, n, be), r)
        # NumPy float32 doing the same products (what a NumPy-only trainer would run)
        x2, w2, d2 = inp.reshape(BT, Cin), w.reshape(OC, Cin), dout.reshape(BT, OC)
        o2, dx2, dw2 = out.reshape(BT, OC), dinp.reshape(BT, Cin), dw.reshape(OC, Cin)
        with threadpool_limits(n, user_api="blas"):
            row["numpy_fwd_ms"] = 1e3 * timeit(lambda: np.matmul(x2, w2.T, out=o2), repeat)
            row["numpy_bwd_ms"] = 1e3 * timeit(
                lambda: (np.matmul(d2, w2, out=dx2), np.matmul(d2.T, x2, out=dw2)), repeat)
        TH.configure_threads(n)  # threadpool_limits restores numpy's pool; keep ours pinned
        rows.append(row)
    return rows


def bench_layers(n, repeat):
    rng = np.random.default_rng(2)
    f = lambda *s: rng.standard_normal(s, dtype=np.float32).ravel()  # noqa: E731
    ids = rng.integers(0, V, BT).astype(np.int32)
    wte, wpe = f(Vp, C) * 0.02, f(maxT, C) * 0.02
    x, y, dx = f(BT, C), np.empty(BT * C, np.float32), f(BT, C)
    w, b = f(C), f(C)
    mean, rstd = np.empty(BT, np.float32), np.empty(BT, np.float32)
    h, hg, dh = f(BT, 4 * C), np.empty(BT * 4 * C, np.float32), f(BT, 4 * C)
    logits = f(BT, Vp)
    probs = np.empty(BT * Vp, np.float32)
    losses, dl = np.empty(BT, np.float32), np.full(BT, 1.0 / BT, np.float32)
    dwte, dwpe = np.zeros(Vp * C, np.float32), np.zeros(maxT * C, np.float32)
    dw, dbb = np.zeros(C, np.float32), np.zeros(C, np.float32)
    layers.layernorm_forward(y, mean, rstd, x, w, b, BT, C, n)
    t = {}
    t["encoder_fwd"] = timeit(lambda: layers.encoder_forward(y, ids, wte, wpe, B, T, C, n), repeat)
    t["encoder_bwd"] = timeit(lambda: layers.encoder_backward(dwte, dwpe, dx, ids, B, T, C, n), repeat)
    t["layernorm_fwd"] = timeit(lambda: layers.layernorm_forward(y, mean, rstd, x, w, b, BT, C, n), repeat)
    t["layernorm_bwd"] = timeit(
        lambda: layers.layernorm_backward(y, dw, dbb, dx, x, w, mean, rstd, BT, C, n), repeat)
    t["gelu_fwd"] = timeit(lambda: layers.gelu_forward(hg, h, BT * 4 * C, n), repeat)
    t["gelu_bwd"] = timeit(lambda: layers.gelu_backward(hg, h, dh, BT * 4 * C, n), repeat)
    if layers.set_simd(True) != "baseline":  # a CPU with AVX2 or AVX-512: the baseline loop too
        try:
            layers.set_simd(False)
            t["gelu_fwd_baseline"] = timeit(lambda: layers.gelu_forward(hg, h, BT * 4 * C, n), repeat)
            t["gelu_bwd_baseline"] = timeit(lambda: layers.gelu_backward(hg, h, dh, BT * 4 * C, n), repeat)
        finally:
            layers.set_simd(True)
    t["residual_fwd"] = timeit(lambda: layers.residual_forward(y, x, dx, BT * C, n), repeat)
    y2 = np.zeros(BT * C, np.float32)
    t["residual_bwd"] = timeit(lambda: layers.residual_backward(y, y2, dx, BT * C, n), repeat)
    t["softmax_xent_fwd"] = timeit(
        lambda: layers.softmax_crossentropy_forward(losses, probs, logits, ids, BT, V, Vp, n), repeat)
    t["softmax_xent_bwd"] = timeit(
        lambda: layers.softmax_crossentropy_backward(probs, probs, ids, dl, BT, V, Vp, n), repeat)
    try:
        from llmctl._ext import attention as A
        qkv = f(BT, 3 * C) * 0.5
        out, lse = np.empty(BT * C, np.float32), np.empty(B * NH * T, np.float32)
        dqkv = np.zeros(BT * 3 * C, np.float32)
        A.attention_forward(out, lse, qkv, B, T, C, NH, n)
        t["attention_fwd"] = timeit(lambda: A.attention_forward(out, lse, qkv, B, T, C, NH, n), repeat)
        t["attention_bwd"] = timeit(
            lambda: A.attention_backward(dqkv, dx, qkv, out, lse, B, T, C, NH, n), repeat)
    except Exception as e:  # attention is another module; report without it
        print(f"(attention not timed: {e})", file=sys.stderr)
    return {k: 1e3 * v for k, v in t.items()}


def bench_adamw(n, repeat):
    rng = np.random.default_rng(3)
    p = rng.standard_normal(NUM_PARAMS, dtype=np.float32)
    g = rng.standard_normal(NUM_PARAMS, dtype=np.float32)
    m, v = np.zeros_like(p), np.zeros_like(p)
    t = timeit(lambda: adamw.adamw_update(p, g, m, v, 1e-4, 0.9, 0.95, 1e-8, 0.0, 1.0, 1, n), repeat)
    tn = timeit(lambda: adamw.global_norm_sq(g, n), repeat)
    return {"adamw_ms": 1e3 * t, "global_norm_ms": 1e3 * tn,
            "adamw_GBps": 7 * 4 * NUM_PARAMS / t / 1e9}


def step_estimate(mm, lay, opt, peak, engine="blas"):
    """One forward+backward+update of d12 at B=4,T=64 assembled from the kernel timings."""
    matmul_ms = sum(r["count"] * (r[f"{engine}_fwd_ms"] + r[f"{engine}_bwd_ms"]) for r in mm)
    per_layer = (2 * (lay["layernorm_fwd"] + lay["layernorm_bwd"] + lay["residual_fwd"] + lay["residual_bwd"])
                 + lay["gelu_fwd"] + lay["gelu_bwd"]
                 + lay.get("attention_fwd", 0.0) + lay.get("attention_bwd", 0.0))
    other_ms = (L * per_layer + lay["encoder_fwd"] + lay["encoder_bwd"] + lay["layernorm_fwd"]
                + lay["layernorm_bwd"] + lay["softmax_xent_fwd"] + lay["softmax_xent_bwd"])
    step_ms = matmul_ms + other_ms + opt["adamw_ms"] + opt["global_norm_ms"]
    flops = 6.0 * NUM_PARAMS * BT
    return {"matmul_ms": matmul_ms, "other_kernels_ms": other_ms, "step_ms": step_ms,
            "other_share": other_ms / step_ms, "mfu": flops / (step_ms / 1e3) / (peak * 1e9),
            "attention_included": "attention_fwd" in lay}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="threads for kernels and BLAS (default 2)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per measurement (best is kept; default 5)")
    ap.add_argument("--skip-tiled", action="store_true", help="do not time the tiled GEMM engine")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time with this thread's CPU time instead of wall time (needs --threads 1): "
                         "robust on a shared, overloaded machine")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    a = ap.parse_args(argv)
    if a.cpu_time:
        if a.threads != 1:
            ap.error("--cpu-time only measures the calling thread; use it with --threads 1")
        CLOCK[0] = time.thread_time
    n = TH.configure_threads(a.threads)
    engines = ["blas"] if a.skip_tiled else ["blas", "tiled"]
    peak = numpy_peak(n, a.repeat)
    TH.configure_threads(n)
    mm = bench_matmuls(n, a.repeat, engines)
    lay = bench_layers(n, a.repeat)
    opt = bench_adamw(n, max(2, a.repeat // 2))
    est = step_estimate(mm, lay, opt, peak)
    res = {"threads": n, "clock": "cpu" if a.cpu_time else "wall", "numpy_peak_gflops": peak, "matmul": mm, "layers_ms": lay, "adamw": opt,
           "step_estimate": est}
    if a.json:
        print(json.dumps(res, indent=1))
        return
    p = lambda s: print(s, file=sys.stderr)  # noqa: E731
    p(f"threads {n}, {'CPU' if a.cpu_time else 'wall'} time, best of {a.repeat}; "
      f"NumPy fp32 GEMM peak {peak:.1f} GFLOP/s")
    p(f"{'layer':8s} {'shape':>11s} | {'blas f/b ms':>14s} {'GF/s':>6s} | {'numpy f/b ms':>14s} | "
      + ("tiled f/b ms    blas/tiled" if "tiled" in engines else ""))
    for r in mm:
        gf = 3 * r["fwd_gflop"] / ((r["blas_fwd_ms"] + r["blas_bwd_ms"]) / 1e3)
        line = (f"{r['layer']:8s} {r['C']:>5d}x{r['OC']:<5d} | {r['blas_fwd_ms']:6.2f}/{r['blas_bwd_ms']:6.2f} "
                f"{gf:6.1f} | {r['numpy_fwd_ms']:6.2f}/{r['numpy_bwd_ms']:6.2f} |")
        if "tiled" in engines:
            ratio = (r["tiled_fwd_ms"] + r["tiled_bwd_ms"]) / (r["blas_fwd_ms"] + r["blas_bwd_ms"])
            line += f" {r['tiled_fwd_ms']:6.1f}/{r['tiled_bwd_ms']:6.1f}  {ratio:5.1f}x"
        p(line)
    for k, v in lay.items():
        p(f"  {k:18s} {v:8.3f} ms" + (f"   (the AVX2 loop: {lay[k[:-9]] / v:.2f}x this)" if k.endswith("_baseline") else ""))
    p(f"AdamW over {NUM_PARAMS:,} floats: {opt['adamw_ms']:.1f} ms ({opt['adamw_GBps']:.1f} GB/s); "
      f"global norm {opt['global_norm_ms']:.1f} ms")
    p(f"step estimate: {est['step_ms']:.0f} ms (matmul {est['matmul_ms']:.0f}, other kernels "
      f"{est['other_kernels_ms']:.0f} = {100 * est['other_share']:.1f}%), MFU {100 * est['mfu']:.1f}% "
      f"of NumPy peak{'' if est['attention_included'] else ' (attention NOT included)'}")


if __name__ == "__main__":
    main()
