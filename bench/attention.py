"""Benchmark: flash-style Cython attention vs a NumPy attention that materialises T x T matrices.

What it measures, at GPT-2 d12 head shapes (B=4, NH=12, hs=64, C=768) for each T:
- forward and backward wall time of llmctl._ext.attention (best of --repeat runs: on a shared
  machine interference only ever adds time),
- the same for a float32 NumPy implementation (batched matmuls on (B,NH,T,T) scores and
  probabilities, BLAS limited to the same thread count via threadpoolctl),
- peak extra memory of each during forward+backward, from tracemalloc (NumPy arrays and the
  kernels' PyMem_RawMalloc scratch are both traced; the inputs/outputs allocated beforehand are
  not counted), next to llm.c's preatt+att storage (2 * B*NH*T*T floats per layer).

It is not a correctness test (tests/test_attention.py is), though it reports the max abs
difference between the two implementations as a sanity check.

    python bench/attention.py                 # T = 64, 256, 1024 on 2 threads
    python bench/attention.py --T 64 --threads 1 --repeat 10 --json
"""
import argparse
import json
import math
import sys
import time
import tracemalloc

import numpy as np
from threadpoolctl import threadpool_limits

from llmctl._ext import attention as A


def numpy_forward(qkv, NH):
    """float32, materialised: returns (out (B,T,C), cache for backward)."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // NH
    x = qkv.reshape(B, T, 3, NH, hs).transpose(2, 0, 3, 1, 4)   # (3,B,NH,T,hs)
    q, k, v = x[0], x[1], x[2]
    s = (q @ k.transpose(0, 1, 3, 2)) * np.float32(1.0 / math.sqrt(hs))   # (B,NH,T,T)
    s[..., np.triu(np.ones((T, T), dtype=bool), k=1)] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    y = s @ v
    return y.transpose(0, 2, 1, 3).reshape(B, T, C), (q, k, v, s)


def numpy_backward(dout, cache, NH):
    q, k, v, p = cache
    B, NH_, T, hs = q.shape
    dy = dout.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)
    dp = dy @ v.transpose(0, 1, 3, 2)
    dv = p.transpose(0, 1, 3, 2) @ dy
    dp -= (dp * p).sum(axis=-1, keepdims=True)
    dp *= p
    dp *= np.float32(1.0 / math.sqrt(hs))
    dq = dp @ k
    dk = dp.transpose(0, 1, 3, 2) @ q
    m = lambda a: a.transpose(0, 2, 1, 3).reshape(B, T, NH * hs)  # noqa: E731
    return np.concatenate([m(dq), m(dk), m(dv)], axis=-1)


def _best_time(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _peak_bytes(fn):
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def bench_one(T, B, NH, hs, n_threads, repeat, with_numpy):
    C = NH * hs
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    dout = rng.standard_normal((B, T, C)).astype(np.float32)
    flat, dflat = qkv.ravel(), dout.ravel()
    out = np.zeros(B * T * C, np.float32)
    lse = np.zeros(B * NH * T, np.float32)
    dqkv = np.zeros(qkv.size, np.float32)

    fwd = lambda: A.attention_forward(out, lse, flat, B, T, C, NH, n_threads)  # noqa: E731
    bwd = lambda: A.attention_backward(dqkv, dflat, flat, out, lse, B, T, C, NH, n_threads)  # noqa: E731
    fwd(), bwd()  # warm up
    r = {"T": T, "B": B, "NH": NH, "hs": hs, "threads": n_threads,
         "llmctl_fwd_ms": 1e3 * _best_time(fwd, repeat),
         "llmctl_bwd_ms": 1e3 * _best_time(bwd, repeat),
         "llmctl_peak_extra_bytes": _peak_bytes(lambda: (fwd(), bwd())),
         "llmc_att_storage_bytes": 2 * B * NH * T * T * 4}
    flops_fwd = B * NH * (T * (T + 1) // 2) * hs * 4          # QK^T and PV, causal half
    r["llmctl_fwd_gflops"] = flops_fwd / r["llmctl_fwd_ms"] / 1e6
    r["llmctl_bwd_gflops"] = 2.5 * flops_fwd / r["llmctl_bwd_ms"] / 1e6   # 5 T x T x hs products
    if with_numpy:
        with threadpool_limits(limits=n_threads):
            holder = {}

            def nfwd():
                holder["y"], holder["cache"] = numpy_forward(qkv, NH)

            def nbwd():
                holder["d"] = numpy_backward(dout, holder["cache"], NH)

            nfwd(), nbwd()
            r["numpy_fwd_ms"] = 1e3 * _best_time(nfwd, repeat)
            r["numpy_bwd_ms"] = 1e3 * _best_time(nbwd, repeat)
            holder.clear()
            r["numpy_peak_extra_bytes"] = _peak_bytes(lambda: numpy_backward(dout, numpy_forward(qkv, NH)[1], NH))
            y, cache = numpy_forward(qkv, NH)
            d = numpy_backward(dout, cache, NH)
            del cache
        dqkv[:] = 0
        bwd()
        r["max_abs_diff_out"] = float(np.abs(y.ravel() - out).max())
        r["max_abs_diff_dqkv"] = float(np.abs(d.ravel() - dqkv).max())
    return r


def _mb(n):
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[64, 256, 1024], help="sequence lengths (default 64 256 1024)")
    ap.add_argument("--B", type=int, default=4, help="batch size (default 4)")
    ap.add_argument("--NH", type=int, default=12, help="heads (default 12)")
    ap.add_argument("--hs", type=int, default=64, help="head size (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="OpenMP / BLAS threads (default 2)")
    ap.add_argument("--repeat", type=int, default=0, help="timed runs per measurement (default: 10 for T<=256, else 2)")
    ap.add_argument("--no-numpy", action="store_true", help="skip the materialised NumPy baseline")
    ap.add_argument("--json", action="store_true", help="print one JSON object per T on stdout")
    args = ap.parse_args(argv)
    for T in args.T:
        repeat = args.repeat or (10 if T <= 256 else 2)
        r = bench_one(T, args.B, args.NH, args.hs, args.threads, repeat, not args.no_numpy)
        if args.json:
            print(json.dumps(r), flush=True)
            continue
        line = (f"T={T:5d} B={args.B} NH={args.NH} hs={args.hs} threads={args.threads} | llmctl fwd "
                f"{r['llmctl_fwd_ms']:8.2f} ms ({r['llmctl_fwd_gflops']:.1f} GFLOP/s) bwd {r['llmctl_bwd_ms']:8.2f} ms "
                f"({r['llmctl_bwd_gflops']:.1f} GFLOP/s) peak extra {_mb(r['llmctl_peak_extra_bytes'])}")
        if "numpy_fwd_ms" in r:
            line += (f" | numpy fwd {r['numpy_fwd_ms']:8.2f} ms bwd {r['numpy_bwd_ms']:8.2f} ms "
                     f"peak extra {_mb(r['numpy_peak_extra_bytes'])} | max|diff| out {r['max_abs_diff_out']:.1e} "
                     f"dqkv {r['max_abs_diff_dqkv']:.1e}")
        line += f" | llm.c preatt+att per layer {_mb(r['llmc_att_storage_bytes'])}"
        print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
