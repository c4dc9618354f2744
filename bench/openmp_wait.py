"""Benchmark how idle OpenMP threads wait: llmctl's default spin (GOMP_SPINCOUNT=1e6 on oneDNN)
against libgomp's passive wait (OMP_WAIT_POLICY=passive, llmctl's default before), side by side.

What it runs: each round, for each wait policy in turn (alternating, so slow drift of a shared
machine hits both alike), two child benchmarks with that policy in their environment, because
libgomp reads it once when it loads:
- bench/sample.py --precision P: KV-cached decode tokens/s of d12 (many short parallel regions);
- bench/step.py --runs d12:4x64 --precisions P: one training step's time.
Then the median of the rounds per policy and the ratio spin / passive.
What it is not: a sweep of spin counts (docs/performance.md has one) or of thread counts.

    python bench/openmp_wait.py                    # bf16 where the CPU has it, else fp32; 3 rounds
    python bench/openmp_wait.py --precision fp32 --rounds 5 --json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
POLICIES = {"passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin": {"GOMP_SPINCOUNT": "1000000"}}


def _child(script, args, policy):
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LLMCTL_OPENMP_WAIT")}
    env.update(POLICIES[policy])
    r = subprocess.run([sys.executable, os.path.join(HERE, script), *args, "--json"],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"Error: {script} failed under the {policy} wait:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def _round(policy, precision, tokens):
    s = _child("sample.py", ["--precision", precision, "--new-tokens", str(tokens), "--full-tokens", "1"], policy)
    t = _child("step.py", ["--runs", "d12:4x64", "--precisions", precision, "--no-torch", "--no-rss",
                           "--steps", "4"], policy)
    return {"decode_tokens_per_s": s["runs"][0]["cached"]["decode_tokens_per_s"],
            "step_ms": 1e3 * t["runs"][0]["median_s"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default=None, help="fp32 or bf16 (default: bf16 where native)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--new-tokens", type=int, default=128, help="decoded tokens per sample run (default 128)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.rounds < 1 or a.new_tokens < 2:
        sys.exit("Error: --rounds must be >= 1 and --new-tokens >= 2\nHint: e.g. --rounds 3")
    if a.precision is None:
        from llmctl._ext import matmul
        a.precision = "bf16" if matmul.bf16_native() else "fp32"
    got = {p: [] for p in POLICIES}
    for _ in range(a.rounds):
        for p in POLICIES:
            got[p].append(_round(p, a.precision, a.new_tokens))
    med = {p: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for p, rs in got.items()}
    res = {"precision": a.precision, "rounds": got, "median": med,
           "spin_over_passive": {k: med["spin"][k] / med["passive"][k] for k in med["spin"]},
           "loadavg_1min": round(os.getloadavg()[0], 2)}
    if a.json:
        print(json.dumps(res))
        return
    print(f"d12 {a.precision}, 2 threads, median of {a.rounds} alternating rounds "
          f"(load average {res['loadavg_1min']})")
    for p, m in med.items():
        print(f"  {p:8s} decode {m['decode_tokens_per_s']:6.1f} tokens/s   B=4 T=64 step {m['step_ms']:6.1f} ms")
    r = res["spin_over_passive"]
    print(f"  spin / passive: decode {r['decode_tokens_per_s']:.2f}x tokens/s, step {r['step_ms']:.2f}x time")


if __name__ == "__main__":
    main()
