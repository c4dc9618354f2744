"""Benchmark: flash-style Cython attention vs a NumPy attention that materialises T x T matrices.

What it measures, at GPT-2 d12 head shapes (B=4, NH=12, hs=64, C=768) for each T:
- forward and backward wall time of llmctl._ext.attention (best of --repeat runs: on a shared
  machine interference only ever adds time),
- the same for a float32 NumPy implementation (batched matmuls on (B,NH,T,T) scores and
  probabilities, BLAS limited to the same thread count via threadpoolctl),
- peak extra memory of each during forward+backward, from tracemalloc (NumPy arrays and the
  kernels' PyMem_RawMalloc scratch are both traced; the inputs/outputs allocated beforehand are
  not counted), next to llm.c's preatt+att storage (2 * B*NH*T*T floats per layer).

- the kernel sets against each other (--isa; default: "default" and the best set this CPU runs,
  see _ext/attention.pyx): their runs are interleaved, so load on a shared machine hits them
  alike and the speed-up ratios stay meaningful even when absolute times do not.

- fp32 against the bf16 kernels (attention_forward_bf16 / attention_backward_bf16: q, k, v, P,
  dout, dS rounded to bf16, fp32 accumulation) on each bf16 path named by --bf16 (default: the
  best this CPU runs; "emulated", "avx512_bf16", "amx"), interleaved run by run like the sets, with
  GFLOP/s and the fp32/bf16 time ratio (> 1: bf16 is faster). The bf16 kernels read fp32 q, k,
  v and write fp32 outputs, unless --bf16-io: then they are called as the bf16 model calls them
  (q, k, v and the output in bf16, d(qkv) written in bf16 with the qkv bias gradient summed).

fp32 vs bf16, measured on an Intel Xeon with AMX: docs/performance.md ("bf16 attention").

It is not a correctness test (tests/test_attention.py is), though it reports the max abs
difference between the two implementations as a sanity check.

    python bench/attention.py                 # T = 64, 256, 1024 on 2 threads
    python bench/attention.py --T 64 --threads 1 --repeat 10 --json
    python bench/attention.py --threads 1 --no-numpy --isa default avx2 avx512
    python bench/attention.py --threads 1 2 --no-numpy --isa --bf16 avx512_bf16 amx   # fp32 vs bf16
    python bench/attention.py --T 1024 --no-numpy --bf16 amx --bf16-io --repeat 5      # as the model calls it

Measured (1 thread, AMD EPYC Zen 4 shared with other jobs, GCC 12, default SSE2 build; ms, best
of 10 runs at T <= 256 and of 2 at T = 1024; speed-up = default's time / the set's):

    T      set      fwd ms   bwd ms   speed-up fwd / bwd
    64     default    1.23     2.75
           avx2       0.66     1.37   1.86x / 2.01x
           avx512     0.61     1.26   2.02x / 2.18x
    256    default   21.70    53.32
           avx2       9.00    22.96   2.41x / 2.32x
           avx512     7.99    19.20   2.72x / 2.78x
    1024   default  391.90   833.90
           avx2     188.93   332.75   2.07x / 2.51x
           avx512   162.54   314.03   2.41x / 2.66x

Zen 4 runs 512-bit FMAs as two 256-bit halves, so avx512 gains over avx2 only from fewer
instructions; CPUs with two full 512-bit FMA units should see more.
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
from llmctl._ext import convert


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


def _isa_times(sets, fwd, bwd, repeat):
    """{set: (best fwd s, best bwd s)}, the sets interleaved run by run so that load on a shared
    machine hits them alike and their ratio stays meaningful."""
    prev = A.isa()
    best = {name: [math.inf, math.inf] for name in sets}
    try:
        for name in sets:                      # warm up each set once
            A.set_isa(name)
            fwd(), bwd()
        for _ in range(repeat):
            for name in sets:
                A.set_isa(name)
                for j, fn in enumerate((fwd, bwd)):
                    t0 = time.perf_counter()
                    fn()
                    best[name][j] = min(best[name][j], time.perf_counter() - t0)
    finally:
        A.set_isa(prev)
    return best


def _bf16_times(paths, fwd32, bwd32, fwd16, bwd16, repeat):
    """{"fp32" or bf16 path: (best fwd s, best bwd s)}, interleaved run by run."""
    prev = A.bf16_path()
    runs = [("fp32", None, fwd32, bwd32)] + [(p, p, fwd16, bwd16) for p in paths]
    best = {name: [math.inf, math.inf] for name, *_ in runs}
    try:
        for _, path, f, b in runs:            # warm up (and size the cached scratch) once each
            if path:
                A.set_bf16_path(path)
            f(), b()
        for _ in range(repeat):
            for name, path, f, b in runs:
                if path:
                    A.set_bf16_path(path)
                for j, fn in enumerate((f, b)):
                    t0 = time.perf_counter()
                    fn()
                    best[name][j] = min(best[name][j], time.perf_counter() - t0)
    finally:
        A.set_bf16_path(prev)
    return best


def bench_one(T, B, NH, hs, n_threads, repeat, with_numpy, isas=(), bf16_paths=(), bf16_io=False):
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
    sets = list(dict.fromkeys([A.isa(), *isas]))    # the active set first, no duplicates
    times = _isa_times(sets, fwd, bwd, repeat)
    r = {"T": T, "B": B, "NH": NH, "hs": hs, "threads": n_threads, "isa": A.isa(),
         "llmctl_fwd_ms": 1e3 * times[A.isa()][0],
         "llmctl_bwd_ms": 1e3 * times[A.isa()][1],
         "llmctl_peak_extra_bytes": _peak_bytes(lambda: (fwd(), bwd())),
         "llmc_att_storage_bytes": 2 * B * NH * T * T * 4}
    if len(sets) > 1:
        r["isa_ms"] = {name: {"fwd": 1e3 * f, "bwd": 1e3 * b} for name, (f, b) in times.items()}
        if "default" in times:                 # speed-up of each set over the portable default
            r["isa_speedup"] = {name: {"fwd": times["default"][0] / f, "bwd": times["default"][1] / b}
                                for name, (f, b) in times.items() if name != "default"}
    flops_fwd = B * NH * (T * (T + 1) // 2) * hs * 4          # QK^T and PV, causal half
    r["llmctl_fwd_gflops"] = flops_fwd / r["llmctl_fwd_ms"] / 1e6
    r["llmctl_bwd_gflops"] = 2.5 * flops_fwd / r["llmctl_bwd_ms"] / 1e6   # 5 T x T x hs products
    if bf16_paths:
        io = np.uint16 if bf16_io else np.float32
        out16, lse16, dqkv16 = np.zeros(out.size, io), np.zeros_like(lse), np.zeros(dqkv.size, io)
        q16, kw = flat, {}
        if bf16_io:   # the bf16 model's calls: bf16 qkv in, bf16 out and d(qkv) written, its dbias summed
            q16 = np.zeros(flat.size, np.uint16)
            convert.cast_to_bf16(q16, flat, n_threads)
            kw = {"accumulate": False, "dbias": np.zeros(3 * C, np.float32)}
        fwd16 = lambda: A.attention_forward_bf16(out16, lse16, q16, B, T, C, NH, n_threads)  # noqa: E731
        bwd16 = lambda: A.attention_backward_bf16(dqkv16, dflat, q16, out16, lse16, B, T, C, NH, n_threads,  # noqa: E731
                                                  **kw)
        bt = _bf16_times(bf16_paths, fwd, bwd, fwd16, bwd16, repeat)
        r["bf16"] = {name: {"fwd_ms": 1e3 * f, "bwd_ms": 1e3 * b,
                            "fwd_gflops": flops_fwd / f / 1e9, "bwd_gflops": 2.5 * flops_fwd / b / 1e9,
                            "fwd_ratio": bt["fp32"][0] / f, "bwd_ratio": bt["fp32"][1] / b}
                     for name, (f, b) in bt.items()}
        r["bf16_io"] = bool(bf16_io)
        r["bf16_scratch_bytes"] = A.bf16_backward_scratch_bytes(B, T, C, NH, n_threads)
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
    ap.add_argument("--threads", type=int, nargs="+", default=[2], help="OpenMP / BLAS threads, one run each (default 2)")
    ap.add_argument("--repeat", type=int, default=0, help="timed runs per measurement (default: 10 for T<=256, else 2)")
    ap.add_argument("--no-numpy", action="store_true", help="skip the materialised NumPy baseline")
    ap.add_argument("--isa", nargs="*", default=None,
                    help="kernel sets to time against each other, interleaved (default: default and "
                         "the best this CPU runs; --isa with no names: only the active set)")
    ap.add_argument("--bf16", nargs="*", default=None,
                    help="bf16 paths to time against fp32, interleaved (default: the best this CPU runs; "
                         "--bf16 with no names: none)")
    ap.add_argument("--bf16-io", action="store_true",
                    help="call the bf16 kernels as the bf16 model does: bf16 q, k, v and output, bf16 d(qkv) "
                         "written with the qkv bias gradient (default: fp32 in and out)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per T on stdout")
    args = ap.parse_args(argv)
    isas = ["default", A.best_isa()] if args.isa is None else args.isa
    bad = [n for n in isas if n not in A.available_isas()]
    if bad:
        ap.error(f"--isa {' '.join(bad)}: not available here (available: {' '.join(A.available_isas())})")
    paths = [A.bf16_best_path()] if args.bf16 is None else args.bf16
    bad = [n for n in paths if n not in A.bf16_available_paths()]
    if bad:
        ap.error(f"--bf16 {' '.join(bad)}: not available here (available: {' '.join(A.bf16_available_paths())})")
    for T, threads in [(T, n) for n in args.threads for T in args.T]:
        repeat = args.repeat or (10 if T <= 256 else 2)
        r = bench_one(T, args.B, args.NH, args.hs, threads, repeat, not args.no_numpy, isas, paths, args.bf16_io)
        if args.json:
            print(json.dumps(r), flush=True)
            continue
        line = (f"T={T:5d} B={args.B} NH={args.NH} hs={args.hs} threads={threads} | llmctl[{r['isa']}] fwd "
                f"{r['llmctl_fwd_ms']:8.2f} ms ({r['llmctl_fwd_gflops']:.1f} GFLOP/s) bwd {r['llmctl_bwd_ms']:8.2f} ms "
                f"({r['llmctl_bwd_gflops']:.1f} GFLOP/s) peak extra {_mb(r['llmctl_peak_extra_bytes'])}")
        if "numpy_fwd_ms" in r:
            line += (f" | numpy fwd {r['numpy_fwd_ms']:8.2f} ms bwd {r['numpy_bwd_ms']:8.2f} ms "
                     f"peak extra {_mb(r['numpy_peak_extra_bytes'])} | max|diff| out {r['max_abs_diff_out']:.1e} "
                     f"dqkv {r['max_abs_diff_dqkv']:.1e}")
        line += f" | llm.c preatt+att per layer {_mb(r['llmc_att_storage_bytes'])}"
        for name, t in r.get("isa_ms", {}).items():
            line += f"\n        {name:8s} fwd {t['fwd']:8.2f} ms bwd {t['bwd']:8.2f} ms"
            if name in r.get("isa_speedup", {}):
                sp = r["isa_speedup"][name]
                line += f"  = {sp['fwd']:.2f}x / {sp['bwd']:.2f}x the default set"
        for name, t in r.get("bf16", {}).items():
            line += (f"\n        {'fp32' if name == 'fp32' else 'bf16 ' + name:16s} fwd {t['fwd_ms']:8.2f} ms "
                     f"({t['fwd_gflops']:6.1f} GFLOP/s) bwd {t['bwd_ms']:8.2f} ms ({t['bwd_gflops']:6.1f} GFLOP/s)")
            if name != "fp32":
                line += f"  fp32/bf16 time {t['fwd_ratio']:.2f}x / {t['bwd_ratio']:.2f}x"
        if "bf16_scratch_bytes" in r:
            line += f"\n        bf16 scratch (kept between calls) {_mb(r['bf16_scratch_bytes'])}"
        print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
