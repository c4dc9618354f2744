"""The bf16-at-the-roof targets, all in one run: each benchmark as a child process, then one table
of target, measured value and verdict.

What it runs, one after the other on the same machine (--json of each):
- bench/step.py with its default runs (d12 B=4 T=64, d12 B=4 T=1024, d6 B=4 T=64): training
  steps in llmctl fp32 and bf16, PyTorch fp32 eager and bf16 autocast when torch imports, MFU
  against the GEMM roof of each precision measured in the same run, the non-matmul share of
  each step, and the peak RSS of d12 B=4 T=1024 steps (its full output is in --json's "raw");
- bench/sample.py --precision fp32,bf16: d12 KV-cache decoding tokens/s;
- bench/eval.py --precision fp32,bf16: HellaSwag examples/s, projected to the full 10,042;
- with --before DIR (a built checkout of an earlier tree): bench/versions.py, this tree's fp32
  step against that one's ("nothing slower than today").

Targets, on a CPU with AMX or AVX512_BF16: d12 B=4 T=64 bf16 <= 0.45x PyTorch bf16 autocast;
d12 B=4 T=1024 bf16 <= 0.40x PyTorch bf16 autocast and >= 50 % MFU of the bf16 roof; the
non-matmul share of the bf16 step <= 25 % at both sizes; peak RSS d12 B=4 T=1024 bf16 <= 3 GiB;
sampling >= 100 tokens/s in bf16; full HellaSwag <= 10 min in bf16. On a CPU without native bf16:
fp32 d12 T=1024 >= 90 % MFU of the fp32 roof (and, with --before, no slower than before), and
on an AVX2 CPU bf16 sampling (the bf16 GEMV's AVX2 copy) no slower than fp32's; training and eval
in bf16 are then refused unless --bf16-emulate, whose figures check this harness but say nothing
about the targets, and the table says so.
Each MFU target is shown twice: against llmctl's roof sampled beside each step ("MFU adj") and
against the reference roof beside each step ("MFU ref", step.py's six reference GEMMs, fp32 with
NumPy's sgemm too). Under the table: the MFU ceiling of each d12 run's matmuls, their rate in the
step over the roof, which no work outside the GEMMs can lift a run above.

    python bench/bf16_targets.py                         # a CPU with native bf16
    python bench/bf16_targets.py --before ../llmctl-old --json
    python bench/bf16_targets.py --bf16-emulate --quick  # the harness itself, anywhere
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from eval import TARGET_MIN as HELLASWAG_MIN  # noqa: E402  (bench/eval.py: the target's one value)

GiB = 2 ** 30


def _child(script, args):
    """The benchmark's --json result, or None when it failed (its error is shown, the others still run)."""
    cmd = [sys.executable, os.path.join(HERE, script), *args, "--json"]
    print("+ " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"{script} failed (exit {r.returncode}); its targets are not measured:\n{r.stderr[-3000:]}",
              file=sys.stderr, flush=True)
        return None
    return json.loads(r.stdout)


def _row(target, value, limit, fmt, better="<="):
    """One table row: ok is None when the value could not be measured."""
    ok = None if value is None else (value <= limit if better == "<=" else value >= limit)
    shown = "not measured" if value is None else fmt.format(value)
    return {"target": target, "value": value, "shown": shown, "limit": limit, "better": better, "ok": ok}


def measure(before=None, emulate=False, quick=False):
    """Run the benchmarks; return {"rows": [...], "emulated": bool, "raw": {...}}."""
    em = ["--bf16-emulate"] if emulate else []
    step_args = ["--precisions", "fp32,bf16", *em]   # step.py's runs: d12 T=64 and T=1024, d6
    if quick:
        step_args += ["--runs", "d12:4x64", "--steps", "1", "--rss-seq", "128", "--no-torch"]
    step = _child("step.py", step_args)
    sample = _child("sample.py", ["--precision", "fp32,bf16", *em]
                    + (["--model", "d6", "--new-tokens", "16", "--full-tokens", "2"] if quick else []))
    ev = _child("eval.py", ["--precision", "fp32,bf16", *em] + (["--model", "d6", "--examples", "4"] if quick else []))
    vers = _child("versions.py", ["--other", before] + (["--rounds", "1", "--steps", "1"] if quick else [])) \
        if before else None

    step_runs = step["runs"] if step else []
    run = {(r["precision"], r["T"]): r for r in step_runs if (r["model"], r["B"]) == ("d12", 4)}
    torch_bf16 = {t["T"]: t["step_s"] for t in (step or {}).get("torch", [])
                  if t["precision"] == "bf16" and (t["model"], t["B"]) == ("d12", 4)}
    rss = {(r["precision"], r["T"], r.get("recompute", "auto")): r["peak_rss_bytes"] for r in (step or {}).get("rss", [])}
    big_t = max(t for _, t, _ in rss) if rss else 1024
    sam = {r["precision"]: r["cached"]["decode_tokens_per_s"] for r in sample["runs"]} if sample else {}
    evm = {r["precision"]: r["full_val_minutes"] for r in ev["runs"]} if ev else {}
    native = bool(step and step.get("bf16_native"))
    get = lambda prec, T, key: run[(prec, T)].get(key) if (prec, T) in run else None
    # MFU against the roof sampled beside each step (step.py's "MFU adj"), where the step.py has it
    mfu = lambda prec, T: get(prec, T, "mfu_adjacent") or get(prec, T, "mfu")

    def vs_torch(T):
        ours = get("bf16", T, "step_s")
        return ours / torch_bf16[T] if ours and torch_bf16.get(T) else None

    rows = [_row("d12 B=4 T=64 step: llmctl bf16 / PyTorch bf16 autocast", vs_torch(64), 0.45, "{:.2f}x"),
            _row("d12 B=4 T=1024 step: llmctl bf16 / PyTorch bf16 autocast", vs_torch(1024), 0.40, "{:.2f}x"),
            _row("d12 B=4 T=1024 bf16 MFU (bf16 roof beside each step)", mfu("bf16", 1024), 0.50,
                 "{:.1%}", ">="),
            _row("d12 B=4 T=1024 bf16 MFU (reference roof beside each step)", get("bf16", 1024, "mfu_reference"),
                 0.50, "{:.1%}", ">="),
            _row("d12 B=4 T=64 bf16 step: non-matmul share", get("bf16", 64, "non_matmul_share"), 0.25, "{:.1%}"),
            _row("d12 B=4 T=1024 bf16 step: non-matmul share", get("bf16", 1024, "non_matmul_share"), 0.25,
                 "{:.1%}"),
            _row(f"peak RSS d12 B=4 T={big_t} bf16 steps (GiB)",
                 rss[("bf16", big_t, "auto")] / GiB if ("bf16", big_t, "auto") in rss else None, 3.0, "{:.2f}"),
            _row(f"peak RSS d12 B=4 T={big_t} bf16 steps at -r 3 (GiB)",
                 rss[("bf16", big_t, "3")] / GiB if ("bf16", big_t, "3") in rss else None, 3.0, "{:.2f}"),
            _row(f"sampling {sample['model'] if sample else 'd12'} bf16 (tokens/s)",
                 sam.get("bf16") if native or emulate else None, 100.0, "{:.1f}", ">="),
            _row(f"full HellaSwag {ev['model'] if ev else 'd12'} bf16 (minutes)", evm.get("bf16"), HELLASWAG_MIN, "{:.1f}")]
    if step and not native:
        rows.append(_row("d12 B=4 T=1024 fp32 MFU (no native bf16; roof beside each step)", mfu("fp32", 1024),
                         0.90, "{:.1%}", ">="))
        rows.append(_row("d12 B=4 T=1024 fp32 MFU (no native bf16; reference roof beside each step)",
                         get("fp32", 1024, "mfu_reference"), 0.90, "{:.1%}", ">="))
    if sample and not native and not emulate and sam.get("bf16") and sam.get("fp32"):
        rows.append(_row("sampling bf16 / fp32 tokens/s (no native bf16: the bf16 GEMV's AVX2 copy)",
                         sam["bf16"] / sam["fp32"], 1.0, "{:.2f}x", ">="))
    if before:
        rows.append(_row("d12 B=4 T=64 fp32 step: this tree / before (no slower)",
                         vers["best_ratio"] if vers is not None else None, 1.0, "{:.3f}x"))
    failed = [name for name, r in (("step.py", step), ("sample.py", sample), ("eval.py", ev),
                                   ("versions.py", vers if before else True)) if r is None]
    # the rate of each run's matmuls against the highest roof beside its steps: the MFU that run
    # would have if every FLOP ran at that rate and nothing else took time (step.py's breakdown)
    ceilings = {f"{prec} T={T}": r["matmul_gflops"] / max(r["roof_adjacent_gflops"])
                for (prec, T), r in sorted(run.items()) if r.get("matmul_gflops") and r.get("roof_adjacent_gflops")}
    return {"rows": rows, "emulated": bool(emulate), "quick": bool(quick), "failed": failed, "ceilings": ceilings,
            "fp32": {"step_s": get("fp32", 64, "step_s"), "sample_tokens_per_s": sam.get("fp32"),
                     "hellaswag_minutes": evm.get("fp32")},
            "raw": {"step": step, "sample": sample, "eval": ev, "versions": vers}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", help="a built checkout of an earlier tree (bench/versions.py --other)")
    ap.add_argument("--bf16-emulate", action="store_true", help="run bf16 on fp32 GEMMs where the CPU has no native bf16")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (d6, 1 step, T=128 RSS): checks the harness only")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = ap.parse_args(argv)
    res = measure(a.before, a.bf16_emulate, a.quick)
    if a.json:
        print(json.dumps(res, indent=1, default=float))
        return 1 if res["failed"] else 0
    if res["emulated"] or res["quick"]:
        print("NOT the targets: " + ", ".join(w for w, on in (("bf16 emulated on fp32 GEMMs", res["emulated"]),
                                                               ("--quick sizes", res["quick"])) if on))
    print(f"{'target':62s} {'measured':>13s} {'limit':>8s}  verdict")
    for r in res["rows"]:
        verdict = "not measured" if r["ok"] is None else ("met" if r["ok"] else "NOT met")
        print(f"{r['target']:62s} {r['shown']:>13s} {r['better'] + ' ' + format(r['limit'], 'g'):>8s}  {verdict}")
    if res["ceilings"]:
        print("MFU ceiling of each d12 B=4 run's matmuls (their rate in the step / the roof beside it): "
              + ", ".join(f"{k} {v:.1%}" for k, v in res["ceilings"].items()))
    f = res["fp32"]
    shown = lambda v, fmt: "not measured" if v is None else fmt.format(v)
    print(f"fp32 for comparison: step {shown(f['step_s'] and f['step_s'] * 1e3, '{:.0f} ms')}, sampling "
          f"{shown(f['sample_tokens_per_s'], '{:.1f} tokens/s')}, full HellaSwag "
          f"{shown(f['hellaswag_minutes'], '{:.1f} min')}")
    return 1 if res["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
