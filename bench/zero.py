"""Benchmark `llmctl train -z 1` (ZeRO-1) and `-r` (recompute): memory saved, time paid.

What it reports, measured in ONE run so the figures sit side by side:
  - 2 ranks on this host (--nproc 2, shm), -z 0 vs -z 1: AdamW ms per rank (metrics.jsonl's
    adamw_ms: the fused AdamW pass, on the whole model or on the rank's shard; the median over
    the steps after the first), the step's gradient collective (allreduce_ms) and ms/step, and
    each rank's peak RSS (VmHWM, read from /proc while the ranks run: shm's shared gradient
    rows count in full in every rank that touched them) and peak PSS (smaps_rollup polled every
    50 ms: shared pages split between the ranks, so the ranks' PSS add up to the host's memory);
  - one process, -r 0 / 1 / 2, --rounds runs each in rotated order: ms/step (each run's median
    after its first step; the best and the median of the runs, the best against -r 0's) and
    peak RSS (VmHWM); then the three levels as models in this one process, their steps taken
    in turn (--alt-steps each), best and median ms/step and the best against -r 0's.
The model is llm.c's random-init descriptor (-e d12 by default) on random tokens: the data does
not change time or memory. Each configuration is one `llmctl train` subprocess.
What it is not: a convergence or correctness test (tests/test_zero.py), or a multi-host
measurement.

    python bench/zero.py                          # d12; -z: B=1 T=256; -r: B=4 T=512
    python bench/zero.py --model d6 --only zero
    python bench/zero.py --only large             # GPT-2 large's shape: minutes, ~16 GiB
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def _hwm(pid):
    """VmHWM (peak RSS) of pid in bytes, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def _pss(pid):
    """Current PSS of pid in bytes (shared pages split among the processes mapping them)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def run(args, nranks):
    """Run `llmctl train args`; -> (metrics records, {pid: peak RSS}) of the train processes
    (the process itself for one rank, the launcher's children for --nproc)."""
    p = subprocess.Popen([sys.executable, "-m", "llmctl.cli", *args], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    peaks, pss = {}, {}
    while p.poll() is None:
        pids = [p.pid] if nranks == 1 else _children(p.pid)
        for pid in pids:
            h, q = _hwm(pid), _pss(pid)
            if h is not None:
                peaks[pid] = max(peaks.get(pid, 0), h)
            if q is not None:
                pss[pid] = max(pss.get(pid, 0), q)
        time.sleep(0.05)
    err = p.stderr.read()
    if p.returncode != 0:
        sys.exit(f"llmctl train {' '.join(args)} failed:\n{err}")
    return peaks, pss


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(ln) for ln in f if "train_loss" in ln]


def med(xs):
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="d12", help="llm.c descriptor (-e)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--zero-bt", default="1x256", help="B x T of the 2-rank -z runs")
    ap.add_argument("--recompute-bt", default="4x512", help="B x T of the -r runs")
    ap.add_argument("--threads", type=int, default=2, help="threads of the one-process -r runs")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each -r level (default 2)")
    ap.add_argument("--alt-steps", type=int, default=3,
                    help="steps of each -r level alternating in this process (default 3)")
    ap.add_argument("--only", choices=("zero", "recompute", "medium", "large"),
                    help="run one part; medium and large (not in the default run: minutes per step) "
                         "are `-e d24` (GPT-2 medium's shape, 355M) at -b 4 -t 1024 and `-e d36` "
                         "(GPT-2 large's, 774M) at -b 1 -t 1024 in fp32 and, where bf16 is native, "
                         "-b 4 in bf16, 2 steps each")
    a = ap.parse_args()
    d = a.dir = tempfile.mkdtemp(prefix="llmctl-bench-zero-")
    from llmctl.formats import write_datafile

    rng = np.random.default_rng(0)
    write_datafile(os.path.join(d, "train.bin"), rng.integers(0, 50257, 200_000).astype(np.uint16))
    write_datafile(os.path.join(d, "val.bin"), rng.integers(0, 50257, 20_000).astype(np.uint16))

    def base(out, bt, *extra):
        B, T = bt.split("x")
        return ["train", "-i", os.path.join(d, "train.bin"), "-j", os.path.join(d, "val.bin"),
                "-e", a.model, "-b", B, "-t", T, "-x", str(a.steps), "-v", "0", "-s", "0",
                "-o", os.path.join(d, out), *extra]

    rows = {}
    if a.only in (None, "zero"):
        zero_part(a, base, rows)
    if a.only in (None, "recompute"):
        recompute_part(a, base, rows)
    if a.only == "medium":
        big_part(a, base, rows, "medium", "d24", "GPT-2 medium, 355M", "4x1024")
    if a.only == "large":
        big_part(a, base, rows, "large fp32", "d36", "GPT-2 large, 774M", "1x1024")
        from llmctl._ext import matmul
        if matmul.bf16_native():
            big_part(a, base, rows, "large bf16", "d36", "GPT-2 large, 774M", "4x1024", "bf16")
        else:
            print("\n# d36 in bf16: not run (this CPU does not multiply bf16 natively)")
    print("\n" + json.dumps(rows))
    shutil.rmtree(d, ignore_errors=True)


def zero_part(a, base, rows):
    print(f"# {a.model}, 2 ranks (--nproc 2, shm, 1 thread each), B x T = {a.zero_bt}, "
          f"{a.steps} steps")
    print(f"{'':6} {'AdamW ms':>9} {'collective ms':>14} {'ms/step':>9} {'peak RSS per rank (GiB)':>26} "
          f"{'peak PSS per rank (GiB)':>26}")
    for z in ("0", "1"):
        peaks, pss = run(base(f"z{z}", a.zero_bt, "--nproc", "2", "-z", z), 2)
        rec = records(os.path.join(a.dir, f"z{z}"))
        row = {"adamw_ms": med([r["adamw_ms"] for r in rec]),
               "collective_ms": med([r["allreduce_ms"] for r in rec]),
               "ms": med([r["ms"] for r in rec]),
               "peak_rss_gib": sorted(round(v / 2**30, 3) for v in peaks.values()),
               "peak_pss_gib": sorted(round(v / 2**30, 3) for v in pss.values())}
        rows[f"-z {z}"] = row
        print(f"-z {z}  {row['adamw_ms']:9.1f} {row['collective_ms']:14.1f} {row['ms']:9.1f} "
              f"{', '.join(f'{x:.2f}' for x in row['peak_rss_gib']):>26} "
              f"{', '.join(f'{x:.2f}' for x in row['peak_pss_gib']):>26}")


def recompute_part(a, base, rows):
    """-r 0 / 1 / 2, --rounds times each, the order rotated every round so that load on a shared
    machine does not fall on one level; per level the best and median of its runs' ms/step, the
    best against -r 0's, and the largest peak RSS."""
    levels = ("0", "1", "2")
    print(f"\n# {a.model}, one process, --threads {a.threads}, B x T = {a.recompute_bt}, {a.steps} steps, "
          f"{a.rounds} rounds (order rotated)")
    ms, rss = {r: [] for r in levels}, {r: 0 for r in levels}
    for k in range(a.rounds):
        for r in levels[k % 3:] + levels[:k % 3]:
            out = f"r{r}-{k}"
            peaks, _ = run(base(out, a.recompute_bt, "-r", r, "--threads", str(a.threads)), 1)
            ms[r].append(med([x["ms"] for x in records(os.path.join(a.dir, out))]))
            rss[r] = max(rss[r], max(peaks.values()))
    alt = alternating_steps(a, levels)
    print(f"{'':6} {'best ms/step':>13} {'median':>9} {'best / -r 0':>12} {'peak RSS (GiB)':>15} "
          f"{'one process: best':>18} {'median':>9} {'best / -r 0':>12}")
    for r in levels:
        row = {"ms": min(ms[r]), "ms_median": statistics.median(ms[r]), "vs_r0": min(ms[r]) / min(ms["0"]),
               "peak_rss_gib": round(rss[r] / 2**30, 3), "ms_runs": [round(x, 1) for x in ms[r]],
               "alt_ms": min(alt[r]), "alt_ms_median": statistics.median(alt[r]),
               "alt_vs_r0": min(alt[r]) / min(alt["0"])}
        rows[f"-r {r}"] = row
        print(f"-r {r}  {row['ms']:13.1f} {row['ms_median']:9.1f} {row['vs_r0']:11.3f}x {row['peak_rss_gib']:15.2f} "
              f"{row['alt_ms']:18.1f} {row['alt_ms_median']:9.1f} {row['alt_vs_r0']:11.3f}x")


def alternating_steps(a, levels):
    """{level: [ms of each step]}: one model per level in this process, the same weights and
    batch, their training steps (zero_grad, forward, backward, AdamW as the trainer calls them)
    taken in turn, --alt-steps each after one warm-up step: what the levels cost with the
    machine's load shared alike (the separate processes above see it one at a time)."""
    from llmctl.model import GPT2

    B, T = map(int, a.recompute_bt.split("x"))
    models = {r: GPT2.from_descriptor(a.model, n_threads=a.threads, recompute=int(r)) for r in levels}
    x = np.random.default_rng(0).integers(0, models["0"].config.vocab_size, (B, T + 1))
    ms = {r: [] for r in levels}
    for k in range(a.alt_steps + 1):
        for r in (levels if k % 2 == 0 else levels[::-1]):
            m = models[r]
            t0 = time.perf_counter()
            m.zero_grad(lazy=True)
            m.forward(x[:, :T], x[:, 1:], loss_scale=1.0)
            m.backward()
            norm = m.grad_norm()
            m.update(3e-4, 0.9, 0.95, 1e-8, 0.0, 1.0 / max(norm, 1.0), k + 1, zero_grads=True)
            if k:
                ms[r].append((time.perf_counter() - t0) * 1e3)
    return ms


def big_part(a, base, rows, key, desc, what, bt, precision="fp32"):
    """One of GPT-2's larger shapes (llm.c's random init of it: the memory and time of fine-tuning
    the pretrained model, whose download this bench avoids), 2 steps at the default -r."""
    a.model = desc
    print(f"\n# {desc} ({what}), one process, --threads {a.threads}, {precision}, B x T = {bt}, 2 steps")
    out = key.replace(" ", "-")
    args = base(out, bt, "--threads", str(a.threads), "--precision", precision)
    args[args.index("-x") + 1] = "2"
    peaks, _ = run(args, 1)
    rec = records(os.path.join(a.dir, out))
    row = {"ms": [x["ms"] for x in rec], "peak_rss_gib": round(max(peaks.values()) / 2**30, 3)}
    rows[key] = row
    print(f"ms/step {', '.join(f'{x:.0f}' for x in row['ms'])}; peak RSS {row['peak_rss_gib']:.2f} GiB")


if __name__ == "__main__":
    main()
