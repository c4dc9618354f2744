"""Benchmark: llmctl's shared-memory all-reduce, and data-parallel training throughput.

What it measures:
- `allreduce` (default): all_reduce_mean of a d12-sized (124,475,904-float, ~498 MB) fp32 buffer
  across --nproc ranks on this host, median of --repeat runs, as algorithm bandwidth (buffer
  bytes / time), next to a plain single-thread memcpy of the same buffer timed in the same run by
  rank 0 (target: all-reduce within 3x of it). Both ShmComm paths: zero-copy (the buffer lives in
  shared memory, as the training worker arranges for the gradients) and copy-in/copy-out (any
  private buffer).
- `--train`: tokens/s of `llmctl train --nproc 2 --threads 1` vs `--nproc 1 --threads 2` on d12
  (random init), B=4, T=64, a few steps on the tinyshakespeare shard (written to a temp dir if
  absent), and the all-reduce's share of a step (from metrics.jsonl's allreduce_ms; target < 10%).

It is not a correctness test (tests/test_dist.py is).

    python bench/allreduce.py                          # 2 ranks, d12-sized buffer
    python bench/allreduce.py --n 10000000 --nproc 3 --json
    python bench/allreduce.py --train --steps 6
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

D12_PARAMS = 124_475_904


def bench_allreduce(n, nproc, repeat, threads, shared):
    from llmctl.jobs.launcher import launch

    with tempfile.TemporaryDirectory() as d:
        launch("llmctl.distributed.selftest:bench_allreduce",
               {"dir": d, "n": n, "iters": repeat, "shared": shared}, nproc, threads=threads, timeout=60)
        res = [json.load(open(os.path.join(d, f"bench_{r}.json"))) for r in range(nproc)]
    # a collective is as slow as its slowest rank
    per_iter = [max(r["allreduce_s"][i] for r in res) for i in range(repeat)]
    t = statistics.median(per_iter)
    m = statistics.median(res[0]["memcpy_s"])
    nbytes = 4 * n
    return {"n": n, "bytes": nbytes, "nproc": nproc, "threads_per_rank": threads,
            "path": "zero-copy (buffer in shared memory)" if shared else "copy-in/copy-out",
            "allreduce_s": t, "allreduce_GBps": nbytes / t / 1e9,
            "memcpy_s": m, "memcpy_GBps": nbytes / m / 1e9, "ratio_to_memcpy": t / m}


def _shard(d):
    path = os.path.join(d, "train.bin")
    src = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "tinyshakespeare",
                       "input.txt")
    import numpy as np

    from llmctl.constants import GPT2_VOCAB_SIZE
    from llmctl.formats import write_datafile
    if os.path.isfile(src):
        from llmctl.tokenizer import get_tokenizer  # offline GPT-2 BPE

        toks = get_tokenizer().encode_ordinary(open(src).read()[:200_000])
    else:
        toks = np.random.default_rng(0).integers(0, GPT2_VOCAB_SIZE, 60_000)
    write_datafile(path, np.asarray(toks, dtype=np.uint16))
    return path


def bench_train(steps, B, T, init):
    out = {}
    with tempfile.TemporaryDirectory() as d:
        shard = _shard(d)
        for name, nproc, threads in (("nproc2_threads1", 2, 1), ("nproc1_threads2", 1, 2)):
            o = os.path.join(d, name)
            cmd = [sys.executable, "-m", "llmctl.cli", "train", "-i", shard, "-j", shard, "-e", init,
                   "-b", str(B), "-t", str(T), "-x", str(steps), "-v", "0", "-s", "0",
                   "--threads", str(threads), "--nproc", str(nproc), "-o", o, "-l", "1e-4"]
            if nproc == 1:
                cmd += ["-d", str(2 * B * T)]  # same tokens per step as 2 ranks x B x T
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
            recs = [json.loads(ln) for ln in open(os.path.join(o, "metrics.jsonl"))]
            recs = [x for x in recs if "ms" in x][1:]  # drop the first (warm-up) step
            ms = statistics.median(x["ms"] for x in recs)
            entry = {"nproc": nproc, "threads": threads, "tokens_per_step": 2 * B * T,
                     "ms_per_step": ms, "tokens_per_s": 2 * B * T / (ms / 1000)}
            if nproc > 1:
                ar = statistics.median(x["allreduce_ms"] for x in recs)
                entry.update(allreduce_ms=ar, allreduce_share=ar / ms)
            out[name] = entry
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=D12_PARAMS, help="floats in the buffer (d12: 124475904)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="threads per rank for the copies/reduction")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--train", action="store_true", help="also measure training throughput on d12")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--init", default="d12", help="-e for --train (descriptor or checkpoint)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res = {"allreduce": bench_allreduce(a.n, a.nproc, a.repeat, a.threads, shared=True),
           "allreduce_copy": bench_allreduce(a.n, a.nproc, a.repeat, a.threads, shared=False)}
    if a.train:
        res["train"] = bench_train(a.steps, 4, 64, a.init)
    if a.json:
        print(json.dumps(res, indent=1))
        return
    for key in ("allreduce", "allreduce_copy"):
        r = res[key]
        print(f"all-reduce of {r['n']:,} floats ({r['bytes'] / 1e6:.0f} MB), {r['nproc']} ranks x "
              f"{r['threads_per_rank']} thread(s), {r['path']}:")
        print(f"  all_reduce_mean  {r['allreduce_s'] * 1000:8.1f} ms   {r['allreduce_GBps']:6.2f} GB/s algorithm bandwidth")
        print(f"  memcpy           {r['memcpy_s'] * 1000:8.1f} ms   {r['memcpy_GBps']:6.2f} GB/s")
        print(f"  all-reduce / memcpy time: {r['ratio_to_memcpy']:.2f}x (target <= 3x)")
    for name, e in res.get("train", {}).items():
        extra = (f", all-reduce {e['allreduce_ms']:.0f} ms = {100 * e['allreduce_share']:.1f}% of a step"
                 if "allreduce_ms" in e else "")
        print(f"train {name}: {e['ms_per_step']:.0f} ms/step, {e['tokens_per_s']:.0f} tok/s{extra}")


if __name__ == "__main__":
    main()
