"""Benchmark: the KV-cached attention kernel (`_ext/kvcache.pyx`) at d12's head shapes, per kernel copy.

What it measures (best of --repeat calls, microseconds): `attention_cached` for decoding (one
query per row at 100, 500 and 1000 cached positions, 1 and 2 threads), for a batch of HellaSwag
endings (40 rows of 20 new positions after 100 cached ones) and for a batch of contexts (12 rows
of 150 positions from 0); the endings once more reading their 100 positions from a shared prefix
cache (`prefix=`, where the tree has it). Every copy of the kernel this CPU runs.
With --other DIR (another source tree, extensions built in place, as bench/versions.py takes):
both trees in child processes alternating --rounds times, and the time ratio this / other per
case (best, median, paired median).
What it is not: a correctness test (tests/test_sample.py) or the model's cached forward (bench/eval.py,
bench/sample.py).

    python bench/kvcache.py
    python bench/kvcache.py --other ../llmctl-before --rounds 4 --json
"""
import argparse
import json
import os
import sys
import time

import numpy as np

NH, HS = 12, 64            # d12
C = NH * HS
# (name, B, Tq, cached positions before the new ones, threads, shared prefix)
CASES = [("decode pos 100, 1 thread", 1, 1, 100, 1, False), ("decode pos 500, 1 thread", 1, 1, 500, 1, False),
         ("decode pos 1000, 1 thread", 1, 1, 1000, 1, False), ("decode pos 500, 2 threads", 1, 1, 500, 2, False),
         ("endings B=40 Tq=20 after 100", 40, 20, 100, 2, False), ("contexts B=12 Tq=150", 12, 150, 0, 2, False),
         ("endings B=40 Tq=20 after a 100-position prefix", 40, 20, 100, 2, True)]


def measure(repeat):
    """-> {kernel copy: {case: best microseconds, or None where this tree has no prefix}}."""
    from llmctl._ext import kvcache as K

    rng = np.random.default_rng(0)
    out = {}
    prev = K.isa()
    try:
        for isa in K.ISAS:
            try:
                K.set_isa(isa)
            except ValueError:
                continue   # not on this CPU
            res = out[isa] = {}
            for name, B, Tq, past, threads, shared in CASES:
                Tcap = Tq if shared else past + Tq
                kc = rng.standard_normal(B * Tcap * C).astype(np.float32)
                vc = rng.standard_normal(kc.size).astype(np.float32)
                qkv = rng.standard_normal(B * Tq * 3 * C).astype(np.float32)
                y = np.empty(B * Tq * C, np.float32)
                pos = np.full(B, past, np.int32)
                kw = {}
                if shared:   # 10 contexts of `past` positions, four endings each
                    kp = rng.standard_normal(10 * past * C).astype(np.float32)
                    kw = {"prefix": (kp, kp.copy(), (np.arange(B) // 4).astype(np.int32), pos, past)}
                best = float("inf")
                try:
                    for _ in range(repeat):
                        t0 = time.perf_counter()
                        K.attention_cached(y, qkv, kc, vc, pos, B, Tq, C, NH, Tcap, threads, **kw)
                        best = min(best, time.perf_counter() - t0)
                except TypeError:   # a tree before the prefix
                    best = None
                res[name] = None if best is None else round(best * 1e6, 2)
    finally:
        K.set_isa(prev)
    return out


def paired(args):
    from versions import alternate, compare   # bench/versions.py: both trees built, alternating runs

    argv = [sys.executable, os.path.abspath(__file__), "--json", "--repeat", str(args.repeat)]
    runs, load = alternate(args.other, argv, args.rounds)
    res = {"rounds": args.rounds, "other": args.other, "load_avg": load,
           "cases": compare(runs, lambda out: {f"{isa}: {name}": us for isa, r in out["us"].items()
                                                for name, us in r.items()})}
    if args.json:
        print(json.dumps(res))
        return
    print(f"attention_cached, this tree / {args.other}, {args.rounds} alternating rounds; load avg "
          f"{load[0]:.2f} -> {load[1]:.2f}")
    for case, r in res["cases"].items():
        print(f"  {case:58s} best {min(r['this']):9.1f} / {min(r['other']):9.1f} us   best {r['best_ratio']:.3f}x, "
              f"paired median {r['paired_median_ratio']:.3f}x")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=200, help="calls per case, best kept (default 200)")
    ap.add_argument("--other", help="source tree of another version (extensions built in place)")
    ap.add_argument("--rounds", type=int, default=4, help="with --other: alternations of the two trees")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.other:
        return paired(args)
    us = measure(args.repeat)
    if args.json:
        print(json.dumps({"us": us}))
        return
    print(f"attention_cached, d12 heads (NH={NH}, hs={HS}), best of {args.repeat} calls, microseconds")
    for isa, res in us.items():
        for name, v in res.items():
            print(f"  {isa:8s} {name:48s} {'no prefix in this tree' if v is None else f'{v:10.1f}'}")


if __name__ == "__main__":
    main()
