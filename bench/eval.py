"""Benchmark `llmctl eval hellaswag`: examples/s on real HellaSwag examples with a d12 model.

What it reports, for each --precision asked, side by side in ONE run (the same examples, the
same weights): examples/s and the projected time for the full 10,042-example validation set
(from the measured subset: --examples examples spread evenly over the HellaSwag validation
jsonl, prepro'd to a temporary llm.c eval file, timed on a second pass over it; with
--examples 10042, the whole split in one pass: the time is then measured, not projected), with
random-init weights (speed does not depend on their values), plus the positions run per example
(padding included) and those needed, vs. llm.c's 4 rows x T=1024.
bf16 needs a CPU that multiplies bf16 natively (AVX512_BF16/AMX); elsewhere it is skipped
unless --bf16-emulate (the same numerics on fp32 GEMMs: slower than fp32, shown only to check
the path runs).
What it is not: an accuracy figure (random weights score ~25%).

    python bench/eval.py                                  # d12, 50 examples, fp32, 2 threads
    python bench/eval.py --precision fp32,bf16            # both, side by side
    python bench/eval.py --model d6 --examples 20 --threads 1 --json
    python bench/eval.py --precision fp32,bf16 --examples 150 --other ../llmctl-before --rounds 3

With --other DIR (another source tree, extensions built in place, as bench/versions.py takes):
this tree's scoring and that one's, in child processes alternating --rounds times, and the time
ratio this / other per precision (best, median, paired median).
"""
import argparse
import json
import os
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
JSONL = os.path.join(HERE, "..", "..", "shared", "data", "hellaswag", "hellaswag_val.jsonl")
FULL_VAL = 10042   # examples in HellaSwag's validation split (dev/data/hellaswag.py)
TARGET_MIN = 10    # the full d12 HellaSwag target in bf16, minutes (bf16_targets.py reads it)


def _precisions(text):
    from llmctl.info import PRECISIONS

    ps = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in ps if p not in PRECISIONS]
    if bad or not ps:
        raise argparse.ArgumentTypeError(f"unknown precision {', '.join(bad) or text!r}: "
                                         f"use {', '.join(PRECISIONS)} or a comma list of them")
    return list(dict.fromkeys(ps))


def add_precision_args(ap):
    """--precision and --bf16-emulate, as bench/eval.py and bench/sample.py take them."""
    ap.add_argument("--precision", type=_precisions, default=["fp32"],
                    help="fp32, bf16 or fp32,bf16 (side by side; default fp32)")
    ap.add_argument("--bf16-emulate", action="store_true", help="run bf16 even without native bf16")


def runnable_precisions(ap, args, sampling=False):
    """-> (the asked precisions this CPU runs, notes on those left out); none left is a usage error.
    sampling: bf16 also runs where `llmctl sample` runs it without native bf16 (the bf16 GEMV's
    AVX2 copy)."""
    from llmctl._ext import matmul
    from llmctl.info import bf16_sampling

    if args.bf16_emulate:
        os.environ["LLMCTL_BF16_EMULATE"] = "1"
    precisions, skipped = list(args.precision), []
    if "bf16" in precisions and not matmul.bf16_native() and not args.bf16_emulate \
            and not (sampling and bf16_sampling()):
        precisions.remove("bf16")
        skipped.append("bf16: this CPU has no native bf16 (AVX512_BF16/AMX); --bf16-emulate runs it anyway")
    if not precisions:
        ap.error(skipped[0])
    return precisions, skipped


def paired(args):
    """--other: this tree against that one, child processes alternating, seconds per precision."""
    import sys

    from versions import alternate, compare   # bench/versions.py: both trees built, alternating runs
    argv = [sys.executable, os.path.abspath(__file__), "--json", "--model", args.model,
            "--examples", str(args.examples), "--threads", str(args.threads),
            "--batch-tokens", str(args.batch_tokens), "--precision", ",".join(args.precision),
            "--jsonl", os.path.abspath(args.jsonl)] + (["--bf16-emulate"] if args.bf16_emulate else [])
    runs, load = alternate(args.other, argv, args.rounds)
    res = {"model": args.model, "threads": args.threads, "examples": args.examples, "rounds": args.rounds,
           "other": args.other, "load_avg": load,
           "precisions": compare(runs, lambda out: {r["precision"]: r["seconds"] for r in out["runs"]})}
    if args.json:
        print(json.dumps(res))
        return
    print(f"{args.model} HellaSwag, {args.examples} examples, {args.threads} threads, {args.rounds} alternating "
          f"rounds; load avg {load[0]:.2f} -> {load[1]:.2f}")
    for prec, r in res["precisions"].items():
        print(f"  {prec}: this {' '.join(f'{v:.1f}' for v in r['this'])} s, "
              f"other {' '.join(f'{v:.1f}' for v in r['other'])} s")
        print(f"  {' ' * len(prec)}  this / other time: best {r['best_ratio']:.3f}x, median {r['median_ratio']:.3f}x, "
              f"paired median {r['paired_median_ratio']:.3f}x")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="d12")
    ap.add_argument("--examples", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    add_precision_args(ap)
    ap.add_argument("--jsonl", default=JSONL)
    ap.add_argument("--other", help="source tree of another version (extensions built in place): both "
                    "trees' scoring, alternating child processes")
    ap.add_argument("--rounds", type=int, default=3, help="with --other: alternations of the two trees")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.other:
        return paired(args)

    from llmctl._ext import matmul
    from llmctl import evaluate
    from llmctl.evaluate import eval_hellaswag
    from llmctl.formats import read_evalfile
    from llmctl.model import GPT2, load
    from llmctl.prepro.hellaswag import prepro_hellaswag

    precisions, skipped = runnable_precisions(ap, args)
    runs = []
    with tempfile.TemporaryDirectory() as d:
        part = os.path.join(d, "part.jsonl")
        # a stride through the whole split: its first examples are shorter than its average (the
        # first 50 need 77 positions each, all 10,042 173), so a prefix underestimates the full run
        with open(args.jsonl, encoding="utf-8") as f:
            lines = f.readlines()
        n = min(args.examples, len(lines))
        with open(part, "w", encoding="utf-8") as g:
            g.writelines(lines[i * len(lines) // n] for i in range(n))
        path = prepro_hellaswag(out_dir=d, source=part)["path"]
        exs = read_evalfile(path)
        # positions run: each context once + each completion minus its last token (a target only)
        positions = sum(len(e.context) + sum(len(c) - 1 for c in e.endings) for e in exs)
        ref = load(args.model, n_threads=args.threads)   # one init: the same weights for all
        for prec in precisions:
            model = ref if prec == "fp32" else GPT2(ref.config, n_threads=args.threads, precision=prec)
            if model is not ref:
                model.params[:] = ref.params
                model.params_changed()
            # warm-up: a whole pass, unless the subset is the whole split (then the one pass is the
            # measurement, one-time costs included, as in a real run). A first pass also grows the
            # scoring buffers (page faults: 0.3 s of 3.4 for 60 examples on a 2-vCPU Xeon), which
            # the projection would otherwise multiply by FULL_VAL / n
            eval_hellaswag(model, path, limit=None if n < FULL_VAL else 2, batch_tokens=args.batch_tokens)
            t0 = time.perf_counter()
            res = eval_hellaswag(model, path, batch_tokens=args.batch_tokens)
            dt = time.perf_counter() - t0
            eps = res["num_examples"] / dt
            runs.append({"precision": prec,
                         "gemm": f"fp32 ({matmul.default_engine()})" if prec == "fp32" else
                                 ("bf16 (dnnl)" if matmul.bf16_native() else "bf16 emulated on fp32"),
                         "examples": res["num_examples"], "seconds": round(dt, 2),
                         "examples_per_s": round(eps, 3),
                         "full_val_minutes": round(FULL_VAL / eps / 60, 1), "acc_norm": res["acc_norm"]})
    out = {"model": args.model, "threads": args.threads, "examples": len(exs), "runs": runs,
           "full_val_examples": FULL_VAL, "positions_per_example": round(positions / len(exs), 1),
           # (a tree before the completion groups has no positions_run: --other-style comparisons)
           "positions_run_per_example": (round(evaluate.positions_run(exs, args.batch_tokens) / len(exs), 1)
                                         if hasattr(evaluate, "positions_run") else None),
           "llmc_positions_per_example": 4 * 1024, "skipped": skipped,
           "loadavg_1min": round(os.getloadavg()[0], 2)}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.model}, {args.threads} threads, {len(exs)} HellaSwag examples, projected to the full "
          f"val set ({FULL_VAL:,}) (load average {out['loadavg_1min']}: other processes on these cores "
          "slow multi-threaded runs most)")
    print(f"  {'precision':9s} {'GEMMs':22s} {'seconds':>8s} {'examples/s':>11s} {'full val':>10s}")
    for r in runs:
        print(f"  {r['precision']:9s} {r['gemm']:22s} {r['seconds']:8.1f} {r['examples_per_s']:11.2f} "
              f"{r['full_val_minutes']:7.1f} min")
    by = {r["precision"]: r["seconds"] for r in runs}
    if len(by) == 2:
        print(f"  bf16 / fp32 time: {by['bf16'] / by['fp32']:.2f}x")
    if args.model == "d12":
        for r in runs:
            if r["precision"] == "bf16":
                met = "met" if r["full_val_minutes"] <= TARGET_MIN else "not met"
                print(f"  target full d12 HellaSwag in bf16 <= {TARGET_MIN} min: {met}")
    for line in skipped:
        print("  skipped: " + line)
    print(f"  positions run per example: {out['positions_run_per_example']}, of which "
          f"{out['positions_per_example']} are needed (llm.c pads 4 rows to T=1024: 4096)")


if __name__ == "__main__":
    main()
