"""Benchmark: the memory-bound kernels of a GPT-2 step against this machine's memory bandwidth.

What it measures, all in ONE run (best wall time of --repeat runs each):
- the floor: the bandwidth of NumPy's `np.add(a, b, out=c)` split over the same number of
  threads (each thread a contiguous part, NumPy releases the GIL), on arrays whose bytes moved
  equal the kernel's, so the floor sits at the same level of the memory hierarchy (a d12 T=64
  activation fits in L2, AdamW's 0.5 GB arrays do not); from 256 MB on, one floor for memory,
  the better of two fresh sets of arrays. Bytes are counted as STREAM counts them:
  each array read or written once, no write-allocate traffic;
- every kernel of the step whose work is a pass over memory, at d12 shapes (B=4 and the --seq
  lengths): AdamW (fp32; with the bf16 copy; with the gradient zeroing of train), the global
  grad norm, layernorm forward (fp32 and bf16 output) and backward, GELU forward and backward,
  the fp32 GELU recompute of backward (three passes, and the one that replaced them),
  the residual add, the softmax + cross-entropy forward and backward (fp32 and bf16 dlogits, and
  the fp32 training forward's pass that makes both),
  the bf16 model's GELU of bf16 input (forward, and backward with fc's bias gradient) and its
  fused softmax + cross-entropy + bf16 dlogits, and the fp32 -> bf16 cast;
- per kernel: bytes moved, GB/s achieved, the floor's GB/s at that size, and `x floor` = the
  kernel's time / the time the floor's bandwidth needs for its bytes (the target: <= 1.5);
- per kernel, its compute alone: the same kernel on one thread over rows (or parameters) that
  move about 384 KB, so they stay in L2 (softmax + cross-entropy: one row, 201 KB of logits),
  called until it has done the same work, divided by the threads (each call also pays the
  wrapper's argument checks, a microsecond or two). `cache x` = that
  time / the floor's time: a kernel whose arithmetic alone is above 1.5x the floor cannot reach
  1.5x by moving its bytes better, only by doing fewer instructions (and the row loops keep
  fixed bits: the same operations in the same order on every copy);
- the row loops (layernorm, GELU, softmax + cross-entropy, the cast) in every copy this CPU
  runs (`--isa`, default all: baseline x86-64, AVX2, AVX-512; the same bits), side by side.
What it is not: a correctness test (tests/test_kernels.py) or the GEMMs (bench/kernels.py,
bench/step.py).

    python bench/membound.py                       # 2 threads, T=64 and T=1024
    python bench/membound.py --threads 1 --seq 1024 --isa avx512 --json
"""
import argparse
import json
import threading
import time

import numpy as np

from llmctl import threads as TH
from llmctl._ext import adamw, convert, layers

B, C, V, Vp = 4, 768, 50257, 50304
NUM_PARAMS = 124_475_904   # d12
CACHE_BYTES = 384 << 10    # the in-cache runs' size: in L2 on every x86 core of the last years
DRAM_BYTES = 256 << 20     # from this size on, one floor: memory's (fresh 1-3 GB arrays gave 33-60 GB/s
                           # from one size to the next in a run, whatever the kernel)


def best_time(fn, repeat, warmup=1):
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def floor_gbs(nbytes, n_threads, repeat):
    """GB/s of c = a + b (12 bytes an element) over n_threads threads, arrays sized to move nbytes
    (the better of that and one thread: for small arrays starting threads costs more than it gains)."""
    n = max(nbytes // 12, 1024)
    a, b = np.ones(n, np.float32), np.ones(n, np.float32)
    c = np.empty(n, np.float32)
    parts = np.array_split(np.arange(n), n_threads)
    bounds = [(p[0], p[-1] + 1) for p in parts]

    def run():
        ts = [threading.Thread(target=np.add, args=(a[lo:hi], b[lo:hi]), kwargs={"out": c[lo:hi]})
              for lo, hi in bounds]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    one = lambda: np.add(a, b, out=c)
    t = best_time(one, repeat)
    if n_threads > 1:
        t = min(t, best_time(run, repeat))
    return 12 * n / t / 1e9


def kernels(BT, nt, repeated=False):
    """[(name, bytes moved, fn)] for B*T = BT rows at d12, on nt threads; repeated: data for
    thousands of calls in a row (the in-cache runs)."""
    rng = np.random.default_rng(0)
    f = lambda n: rng.standard_normal(n, dtype=np.float32)
    n, n4, nv = BT * C, 4 * BT * C, BT * Vp
    x, dout, dres, out = f(n), f(n), f(n), np.empty(n, np.float32)
    out16 = np.empty(n, np.uint16)
    w, bias = f(C), f(C)
    dw, db, dbn = np.zeros(C, np.float32), np.zeros(C, np.float32), np.zeros(C, np.float32)
    mean, rstd = np.empty(BT, np.float32), np.empty(BT, np.float32)
    layers.layernorm_forward(out, mean, rstd, x, w, bias, BT, C, nt)
    h, dh, dh_in, dfb = f(n4), f(n4), np.zeros(n4, np.float32), f(n4)
    # d = gelu'(x) d in place: called thousands of times over the same d (repeated), d would sink
    # into subnormals, slow on every x86; there x >= 4, where gelu' is 1 to 4 digits (the loop has
    # no branches: its time does not depend on the values)
    hfb = np.float32(4) + np.abs(h) if repeated else h
    h_out, h16 = np.empty(n4, np.float32), np.empty(n4, np.uint16)
    hb, gb = np.empty(n4, np.uint16), np.zeros(4 * C, np.float32)   # bf16 fch, fc's dbias
    convert.cast_to_bf16(hb, h, nt)
    # the bf16 backward's fused recompute: d(gelu) in bf16, overwritten in place (over hfb's
    # inputs, as the fp32 one above, when repeated), and the GELU's output
    db16, y16, hfb16 = np.empty(n4, np.uint16), np.empty(n4, np.uint16), np.empty(n4, np.uint16)
    convert.cast_to_bf16(db16, dh, nt)
    convert.cast_to_bf16(hfb16, hfb, nt)
    logits = f(nv)
    probs = np.empty(nv, np.float32)
    d16 = np.empty(nv, np.uint16)
    tg = rng.integers(0, V, BT).astype(np.int32)
    losses, dlosses = np.empty(BT, np.float32), np.full(BT, 1.0 / BT, np.float32)
    layers.softmax_crossentropy_forward(losses, probs, logits, tg, BT, V, Vp, nt)
    return [
        ("layernorm_forward", 8 * n, lambda: layers.layernorm_forward(out, mean, rstd, x, w, bias, BT, C, nt)),
        ("layernorm_forward_bf16", 6 * n,
         lambda: layers.layernorm_forward_bf16(out16, mean, rstd, x, w, bias, BT, C, nt)),
        ("layernorm_backward", 16 * n,
         lambda: layers.layernorm_backward(dres, dw, db, dout, x, w, mean, rstd, BT, C, nt)),
        # the bf16 backward's one pass: dinp += (read and written), its bf16 copy for the next
        # GEMM and that GEMM's bias gradient, dweight and dbias
        ("layernorm_backward_bf16 (+ bf16 dinp)", 18 * n,
         lambda: layers.layernorm_backward_bf16(dres, dw, db, dout, x, w, mean, rstd, BT, C, nt,
                                                dinp16=out16, dbias_next=dbn)),
        ("gelu_forward", 8 * n4, lambda: layers.gelu_forward(h_out, h, n4, nt)),
        ("gelu_forward_bf16", 6 * n4, lambda: layers.gelu_forward_bf16(h16, h, n4, nt)),
        ("gelu_backward", 16 * n4, lambda: layers.gelu_backward(dh_in, h, dh, n4, nt)),
        # the fp32 backward's GELU recompute: forward, zero fill and backward, against the one pass
        ("gelu recompute: 3 passes", 28 * n4, lambda: (layers.gelu_forward(h_out, h, n4, nt),
                                                      layers.zero_fill(dh_in, nt),
                                                      layers.gelu_backward(dh_in, h, dh, n4, nt))),
        ("gelu_forward_backward (1 pass)", 16 * n4, lambda: layers.gelu_forward_backward(h_out, dfb, hfb, n4, nt)),
        ("gelu_forward_bf16 (bf16 in)", 4 * n4, lambda: layers.gelu_forward_bf16(h16, hb, n4, nt)),
        ("gelu_backward_bf16 (bf16 in, dbias)", 8 * n4,
         lambda: layers.gelu_backward_bf16(h16, gb, hb, dh, BT, 4 * C, nt)),
        ("gelu_forward_backward_bf16 (1 pass)", 8 * n4,
         lambda: layers.gelu_forward_backward_bf16(y16, db16, gb, hfb16, BT, 4 * C, nt)),
        ("residual_forward", 12 * n, lambda: layers.residual_forward(out, x, dout, n, nt)),
        ("softmax_crossentropy_forward", 8 * nv,
         lambda: layers.softmax_crossentropy_forward(losses, probs, logits, tg, BT, V, Vp, nt)),
        ("softmax_crossentropy_backward", 8 * nv,
         lambda: layers.softmax_crossentropy_backward(logits, probs, tg, dlosses, BT, V, Vp, nt)),
        # the fp32 training forward's one pass (in place there; here into probs, the same traffic)
        ("softmax_crossentropy_fwd_bwd", 8 * nv,
         lambda: layers.softmax_crossentropy_forward_backward(losses, probs, logits, tg, dlosses, BT, V, Vp, nt)),
        ("softmax_crossentropy_backward_bf16", 6 * nv,
         lambda: layers.softmax_crossentropy_backward_bf16(d16, probs, tg, dlosses, BT, V, Vp, nt)),
        ("softmax_crossentropy_fwd_bwd_bf16", 6 * nv,
         lambda: layers.softmax_crossentropy_forward_backward_bf16(losses, d16, logits, tg, dlosses, BT, V, Vp,
                                                                   nt)),
        ("cast_to_bf16", 6 * n4, lambda: convert.cast_to_bf16(h16, h, nt)),
    ]


def optimizer_kernels(nt, N=NUM_PARAMS, repeated=False):
    """AdamW and the grad norm over N parameters (d12's: the train loop's passes); repeated:
    the gradients the zeroing variant clears are put back every 64 calls (else v decays into
    subnormals over thousands of calls)."""
    p = np.random.default_rng(1).standard_normal(N, dtype=np.float32) * np.float32(0.02)
    g = np.full(N, 1e-3, np.float32)
    m, v = np.zeros(N, np.float32), np.zeros(N, np.float32)
    pb = np.empty(N, np.uint16)
    step = [0]

    def upd(bf16, zero):
        step[0] += 1
        if repeated and zero and step[0] % 64 == 0:
            g.fill(1e-3)
        adamw.adamw_update(p, g, m, v, 1e-4, 0.9, 0.95, 1e-8, 0.0, 1.0, step[0], nt,
                           pb if bf16 else None, zero_grads=zero)

    return [
        ("global_norm_sq", 4 * N, lambda: adamw.global_norm_sq(g, nt)),
        ("adamw_update", 28 * N, lambda: upd(False, False)),
        ("adamw_update +bf16 copy", 30 * N, lambda: upd(True, False)),
        ("adamw_update +bf16 +zero grads", 34 * N, lambda: upd(True, True)),
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    ap.add_argument("--seq", default="64,1024", help="comma-separated T for the activation kernels (default 64,1024)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per measurement, best kept (default 5)")
    ap.add_argument("--isa", default=None,
                    help="comma-separated copies of the row loops to time (default: every one this CPU runs)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    nt = TH.configure_threads(args.threads)
    best = layers.set_simd(True)
    isas = args.isa.split(",") if args.isa else list(layers.ISAS[:layers.ISAS.index(best) + 1])
    rows, floors = [], {}
    groups = [(f"d12 B={B} T={T}", B * T, lambda bt, n, rep=False: kernels(bt, n, rep))
              for T in map(int, args.seq.split(","))]
    groups.append(("d12 optimizer", NUM_PARAMS, lambda n_, n, rep=False: optimizer_kernels(n, n_, rep)))
    try:
        for group, size, make in groups:
            opt = group == "d12 optimizer"
            built = {}   # size -> that size's kernels on one thread: the compute alone, in L2

            def small(i, nbytes):
                n = max(1, int(CACHE_BYTES * size / nbytes))
                if n not in built:
                    built[n] = make(n, 1, True)
                return built[n][i][2], n

            for i, (name, nbytes, fn) in enumerate(make(size, nt)):
                fn_small, n_small = small(i, nbytes)
                calls = max(1, round(size / n_small))
                key = nbytes if nbytes < DRAM_BYTES else DRAM_BYTES
                if key not in floors:   # one floor per size, and one for every size past the caches
                    floors[key] = max(floor_gbs(key, nt, args.repeat) for _ in range(2 if key == DRAM_BYTES else 1))
                fl = floors[key]
                for isa in (isas if not opt else [adamw.simd()]):
                    if not opt:
                        got = layers.set_simd(isa)
                        convert.set_isa(layers.ISAS.index(got))
                        if got != isa:
                            raise SystemExit(f"this CPU does not run the {isa} loops (it runs up to {best})")
                    t = best_time(fn, args.repeat)
                    tc = best_time(lambda: [fn_small() for _ in range(calls)], args.repeat) / nt
                    floor_s = nbytes / fl / 1e9
                    rows.append({"group": group, "kernel": name, "isa": isa, "bytes": nbytes, "ms": t * 1e3,
                                 "GB_per_s": nbytes / t / 1e9, "floor_GB_per_s": fl,
                                 "x_floor": t / floor_s, "cache_ms": tc * 1e3, "cache_x_floor": tc / floor_s})
    finally:
        layers.set_simd(True)
        convert.set_isa(-1)
    if args.json:
        print(json.dumps({"threads": nt, "rows": rows}, indent=1))
        return
    print(f"threads {nt}; floor = np.add split over {nt} threads at the same bytes; x floor = time / (bytes / floor);")
    print("cache = the compute alone (one thread in L2, scaled to the work and the threads); cache x = cache / floor time")
    print(f"{'group':<15} {'kernel':<42} {'isa':<8} {'MB':>7} {'ms':>8} {'GB/s':>6} {'floor':>6} {'x floor':>7} "
          f"{'cache':>7} {'cache x':>7}")
    for r in rows:
        print(f"{r['group']:<15} {r['kernel']:<42} {r['isa']:<8} {r['bytes'] / 1e6:7.1f} {r['ms']:8.2f} "
              f"{r['GB_per_s']:6.1f} {r['floor_GB_per_s']:6.1f} {r['x_floor']:7.2f} {r['cache_ms']:7.2f} "
              f"{r['cache_x_floor']:7.2f}")


if __name__ == "__main__":
    main()
