"""bf16 vs fp32 training accuracy: the same run twice, every val loss side by side (issue 12 item 5).

What it does: prepares Tiny Shakespeare if `--data-dir` lacks it (`llmctl prepro tinyshakespeare`,
`--source` for a local input.txt), then runs `llmctl train` twice from the same random init
(`-e d6`, seed 42) on the same batches, once with `--precision fp32` and once with
`--precision bf16`, and compares the val loss at every evaluation (`-v`) and the train loss of
every step. It fails (exit 1) when a val loss differs by more than `--tolerance` (2 %) relatively.
What it is not: a speed benchmark (bench/step.py); on a CPU without AVX512_BF16/AMX it needs
`--bf16-emulate` (LLMCTL_BF16_EMULATE=1: the same bf16 rounding of the matmul inputs, fp32 GEMMs
on the rounded values, so the numerics are bf16's up to the GEMM's summation order).

    python bench/bf16_accuracy.py                               # d6, 200 steps, B=4 T=64, -v 20
    python bench/bf16_accuracy.py --bf16-emulate --source input.txt --json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def train(out_dir, precision, args, env):
    cmd = [sys.executable, "-m", "llmctl", "train",
           "-i", os.path.join(args.data_dir, "tiny_shakespeare_train.bin"),
           "-j", os.path.join(args.data_dir, "tiny_shakespeare_val.bin"),
           "-e", args.model, "-b", str(args.batch_size), "-t", str(args.seq_len),
           "-x", str(args.steps), "-v", str(args.val_every), "-m", str(args.val_max_steps),
           "-l", str(args.learning_rate), "-s", "0", "-o", out_dir,
           "--threads", str(args.threads), "--precision", precision]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="d6", help="-e of both runs (default d6)")
    ap.add_argument("--steps", type=int, default=200, help="-x (default 200)")
    ap.add_argument("--batch-size", type=int, default=4, help="-b (default 4)")
    ap.add_argument("--seq-len", type=int, default=64, help="-t (default 64)")
    ap.add_argument("--val-every", type=int, default=20, help="-v (default 20)")
    ap.add_argument("--val-max-steps", type=int, default=20, help="-m (default 20)")
    ap.add_argument("--learning-rate", type=float, default=3e-4, help="-l (default 3e-4, llm.c's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=0.02, help="max relative val-loss gap (0.02)")
    ap.add_argument("--data-dir", default="data", help="where the tiny_shakespeare_*.bin are (data)")
    ap.add_argument("--source", help="local Tiny Shakespeare input.txt for prepro (else downloaded)")
    ap.add_argument("--bf16-emulate", action="store_true",
                    help="run bf16 without native bf16 (LLMCTL_BF16_EMULATE=1)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from llmctl.runlog import read_run

    env = dict(os.environ)
    if args.bf16_emulate:
        env["LLMCTL_BF16_EMULATE"] = "1"
    if not os.path.exists(os.path.join(args.data_dir, "tiny_shakespeare_val.bin")):
        cmd = [sys.executable, "-m", "llmctl", "prepro", "tinyshakespeare", "--out-dir", args.data_dir]
        if args.source:
            cmd += ["--source", args.source]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)

    runs, seconds = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("fp32", "bf16"):
            out = os.path.join(tmp, precision)
            seconds[precision] = train(out, precision, args, env)
            runs[precision] = read_run(out).series

    v32, v16 = runs["fp32"]["val"], runs["bf16"]["val"]
    if list(v32.step) != list(v16.step) or not len(v32):
        raise SystemExit(f"the two runs evaluated at different steps: {list(v32.step)} vs {list(v16.step)}")
    rows = [{"step": int(s), "val_fp32": float(a), "val_bf16": float(b), "rel": float(abs(b - a) / a)}
            for s, a, b in zip(v32.step, v32.value, v16.value)]
    t32, t16 = runs["fp32"]["train"].value, runs["bf16"]["train"].value
    worst_train = float(max(abs(b - a) / a for a, b in zip(t32, t16)))
    worst = max(r["rel"] for r in rows)
    ok = worst <= args.tolerance
    result = {"model": args.model, "steps": args.steps, "B": args.batch_size, "T": args.seq_len,
              "bf16_emulated": args.bf16_emulate, "tolerance": args.tolerance, "evals": rows,
              "max_rel_val": worst, "max_rel_train": worst_train, "ok": ok,
              "seconds": seconds}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.model} B={args.batch_size} T={args.seq_len} {args.steps} steps, val every "
              f"{args.val_every} ({args.val_max_steps} batches); bf16 "
              f"{'emulated (LLMCTL_BF16_EMULATE=1)' if args.bf16_emulate else 'native'}")
        print(f"{'step':>5} {'val fp32':>9} {'val bf16':>9} {'rel diff':>9}")
        for r in rows:
            print(f"{r['step']:>5} {r['val_fp32']:>9.4f} {r['val_bf16']:>9.4f} {100 * r['rel']:>8.3f}%")
        print(f"max relative val-loss gap {100 * worst:.3f}% (tolerance {100 * args.tolerance:g}%): "
              f"{'ok' if ok else 'FAILED'}; max train-loss gap over all steps {100 * worst_train:.3f}%")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
