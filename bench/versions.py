"""One training step of this tree against another version of llmctl, side by side in one run.

What it does: times zero_grad + forward + backward + grad_norm + AdamW (bench/step.py's step, fp32
or, with --precision bf16, bf16 in both trees, which must both have it) in two source trees, this one and `--other DIR` (a checkout of an earlier commit with its
extensions built in place: `git worktree add DIR COMMIT && cd DIR && python setup.py build_ext
--inplace`), each in its own child process, alternating between the two `--rounds` times so
that both see the same machine load. Prints the best and median step of each and the ratio;
with --kernels also each kernel function's total time in each tree's best step (the kernel
modules' calls wrapped and timed, matmuls by their shape), the smallest over the rounds.
What it is not: a breakdown by category (bench/step.py).

    python bench/versions.py --other ../llmctl-before              # d12 B=4 T=64, 3 rounds x 3 steps
    python bench/versions.py --other ../llmctl-before --model d6 --rounds 4 --json
    python bench/versions.py --other ../llmctl-before --precision bf16 --rounds 6
    python bench/versions.py --other ../llmctl-before --precision bf16 --seq-len 1024 --kernels
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import inspect, json, sys, time
import numpy as np
import llmctl
from llmctl.model import GPT2
desc, B, T, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
precision, kernels = sys.argv[6], sys.argv[7] == "1"
m = GPT2.from_descriptor(desc, n_threads=threads, **({"precision": precision} if precision != "fp32" else {}))
calls = {}
if kernels:   # each kernel function's time in the step, matmuls keyed by their (rows, C, OC)
    class Timed:
        def __init__(self, mod, shaped):
            self.mod, self.shaped = mod, shaped
        def __getattr__(self, name):
            f = getattr(self.mod, name)
            if not callable(f) or name.startswith(("_", "get", "set")):
                return f
            def timed(*a, **k):
                t0 = time.perf_counter()
                r = f(*a, **k)
                key = name + (str(tuple(v for v in a if type(v) is int)[:3]) if self.shaped else "")
                calls[key] = calls.get(key, 0.0) + time.perf_counter() - t0
                return r
            return timed
    k = m.kernels
    k.matmul, k.layers, k.attention = Timed(k.matmul, True), Timed(k.layers, False), Timed(k.attention, False)
    k.adamw, k.convert = Timed(k.adamw, False), Timed(k.convert, False)
x = np.random.default_rng(0).integers(0, m.config.vocab_size, (B, T + 1))
# the trainer's AdamW call: versions that can clear the gradients in AdamW's pass are asked to
kw = {"zero_grads": True} if "zero_grads" in inspect.signature(m.update).parameters else {}
# ... and the forward is told the backward's loss_scale where it takes it, as the trainer does
fkw = {"loss_scale": 1.0} if "loss_scale" in inspect.signature(m.forward).parameters else {}
# ... and zero_grad as the trainer calls it (bf16: spent gradients are overwritten, not filled)
zkw = {"lazy": True} if "lazy" in inspect.signature(m.zero_grad).parameters else {}
times, best = [], None
for t in range(1, steps + 2):
    calls.clear()
    t0 = time.perf_counter()
    m.zero_grad(**zkw)
    m.forward(x[:, :T], x[:, 1:], **fkw)
    m.backward()
    norm = m.grad_norm()
    m.update(3e-4, 0.9, 0.95, 1e-8, 0.0, 1.0 / norm if norm > 1 else 1.0, t, **kw)
    times.append(time.perf_counter() - t0)
    if t > 1 and (best is None or times[-1] < best[0]):
        best = (times[-1], dict(calls))
print(json.dumps({"times": times[1:], "file": llmctl.__file__, "kernels": best[1]}))
"""


def run(tree, args):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    out = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.batch_size), str(args.seq_len),
                          str(args.steps), str(args.threads), args.precision, "1" if args.kernels else "0"],
                         env=env, cwd=os.path.abspath(tree), capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the step in {tree} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_built(tree):
    """Both trees are run from source: their extensions must be built in place."""
    probe = "import llmctl._ext.matmul, llmctl._ext.layers; print(llmctl._ext.matmul.__file__)"
    r = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, PYTHONPATH=os.path.abspath(tree)),
                       cwd=os.path.abspath(tree), capture_output=True, text=True)
    where = r.stdout.strip()
    if r.returncode != 0 or not os.path.realpath(where).startswith(os.path.realpath(tree) + os.sep):
        why = (r.stderr.strip().splitlines() or ["?"])[-1] if r.returncode else f"it imports {where}"
        raise SystemExit(f"{tree}: llmctl's extensions do not import from this source tree ({why}); "
                         f"build them in place: cd {tree} && python setup.py build_ext --inplace")


def alternate(other, argv, rounds):
    """Run the bench command argv (python and its args; it prints one JSON object last) with this
    tree and then `other` on PYTHONPATH, alternating the order each round so both see the same
    machine load -> ({"this": [result per round], "other": [...]}, [load average before, after])."""
    trees = {"this": os.path.join(HERE, ".."), "other": other}
    for tree in trees.values():
        check_built(tree)
    out, load0 = {"this": [], "other": []}, os.getloadavg()[0]
    for r in range(rounds):
        for k in (("this", "other") if r % 2 == 0 else ("other", "this")):
            env = dict(os.environ, PYTHONPATH=os.path.abspath(trees[k]))
            res = subprocess.run(argv, env=env, cwd=os.path.abspath(trees[k]), capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(f"{os.path.basename(argv[1])} with {trees[k]} failed (exit {res.returncode}):\n"
                                 f"{res.stderr[-2000:]}")
            out[k].append(json.loads(res.stdout.strip().splitlines()[-1]))
    return out, [round(load0, 2), round(os.getloadavg()[0], 2)]


def compare(runs, figures, rate=False):
    """runs as alternate() returns them; figures(result) -> {case: figure} of one child's result
    -> {case: ratios(...)} for every case both trees measured in every round."""
    per = {k: [figures(res) for res in runs[k]] for k in ("this", "other")}
    cases = [c for c in per["this"][0] if all(f.get(c) is not None for k in per for f in per[k])]
    return {c: ratios([f[c] for f in per["this"]], [f[c] for f in per["other"]], rate) for c in cases}


def ratios(this, other, rate=False):
    """this / other over the rounds' figures of each tree (times, or rates with rate=True: the best
    is then the highest): best, median, and the median of each round's pair (run back to back)."""
    best = max if rate else min
    return {"this": this, "other": other,
            "best_ratio": round(best(this) / best(other), 3),
            "median_ratio": round(statistics.median(this) / statistics.median(other), 3),
            "paired_median_ratio": round(statistics.median(a / b for a, b in zip(this, other)), 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", required=True, help="source tree of the other version (extensions built in place)")
    ap.add_argument("--model", default="d12", help="descriptor (default d12)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per child (after one warm-up)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two trees")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                    help="the step's precision in both trees (default fp32)")
    ap.add_argument("--kernels", action="store_true",
                    help="also each kernel function's total in each tree's best step (min over the rounds)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    trees = {"this": os.path.join(HERE, ".."), "other": args.other}
    for tree in trees.values():
        check_built(tree)
    times = {k: [] for k in trees}
    kern = {k: [] for k in trees}
    files = {}
    load0 = os.getloadavg()[0]
    for r in range(args.rounds):
        for k in (("this", "other") if r % 2 == 0 else ("other", "this")):
            res = run(trees[k], args)
            times[k] += res["times"]
            kern[k].append(res["kernels"])
            files[k] = res["file"]
    if os.path.realpath(files["this"]) == os.path.realpath(files["other"]):
        raise SystemExit(f"both trees imported the same llmctl ({files['this']}): is --other a source tree?")
    out = {"model": args.model, "B": args.batch_size, "T": args.seq_len, "threads": args.threads,
           "precision": args.precision,
           "load_avg": [load0, os.getloadavg()[0]], "llmctl": files,
           **{k: {"best_ms": 1e3 * min(v), "median_ms": 1e3 * statistics.median(v), "steps": len(v)}
              for k, v in times.items()}}
    out["best_ratio"] = out["this"]["best_ms"] / out["other"]["best_ms"]
    out["median_ratio"] = out["this"]["median_ms"] / out["other"]["median_ms"]
    if args.kernels:
        names = sorted(set().union(*(set(r) for k in trees for r in kern[k])),
                       key=lambda n: -max(min(r.get(n, 0.0) for r in kern[k]) for k in trees))
        out["kernels_ms"] = {n: {k: round(1e3 * min(r.get(n, 0.0) for r in kern[k]), 1) for k in trees}
                             for n in names}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.model} B={args.batch_size} T={args.seq_len} {args.precision}, {args.threads} threads, "
          f"{args.rounds} alternating rounds x {args.steps} steps; load avg {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    for k in trees:
        print(f"  {k:>5}: best {out[k]['best_ms']:8.1f} ms  median {out[k]['median_ms']:8.1f} ms   ({files[k]})")
    print(f"  this / other: best {out['best_ratio']:.3f}x, median {out['median_ratio']:.3f}x")
    if args.kernels:
        print(f"  {'kernel (total in the best step, min over rounds, ms)':<56} {'this':>8} {'other':>8}")
        for n, v in out["kernels_ms"].items():
            print(f"  {n:<56} {v['this']:8.1f} {v['other']:8.1f}")


if __name__ == "__main__":
    main()
