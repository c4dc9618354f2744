"""Benchmark: `llmctl prepro text` end-to-end tokens/s vs tiktoken's single-threaded encode_ordinary.

What it measures, in one run on the same documents:
  baseline  tiktoken `encode_ordinary` called once per document on one thread, documents already
            split in memory (nothing read, nothing written: the most favourable baseline);
  prepro    `prepro_text` end to end (read + split the file, tokenize in parallel, write shards),
            once per backend (threads, processes).
The corpus (>= 50 MB by default) repeats Tiny Shakespeare and TinyStories with variation: each
repetition shuffles the order of passages and groups them into documents of varying size,
separated by <|endoftext|>. Target (issue): >= 1.7x baseline on 2 cores.

    python bench/prepro.py [--mb 50] [--workers 2] [--backends threads,processes] [--repeat 1] [--json]

With --repeat N every measurement is taken N times, interleaved, and the best time is kept: on
a shared machine that is the run least disturbed by other processes. Each result also reports
the CPU seconds used (this process + its children) and `cpu_bound_speedup` =
workers x baseline CPU / prepro CPU (capped at workers): the speedup the run would reach on
`workers` otherwise idle cores, which stays meaningful when other jobs load the machine.
"""
import argparse
import json
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data"


def make_corpus(path, mb, seed=1337):
    """Write a >= `mb` MB UTF-8 corpus of <|endoftext|>-separated documents; return its doc list."""
    shakespeare = (DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    passages = [p.strip() for p in shakespeare.split("\n\n") if p.strip()]
    stories_file = DATA / "tinystories" / "tinystories_sample.txt"
    if stories_file.is_file():
        passages += [s.strip() for s in stories_file.read_text(encoding="utf-8").split("<|endoftext|>") if s.strip()]
    rng = random.Random(seed)
    docs, size, rep = [], 0, 0
    target = mb * 1_000_000
    while size < target:
        order = passages[:]
        rng.shuffle(order)
        i = 0
        while i < len(order) and size < target:
            k = rng.randint(1, 40)  # 1..40 passages per document: ~50 to ~4,000 tokens
            doc = "\n\n".join(order[i:i + k])
            if rep % 2:
                doc = doc.replace("the ", "thee ")  # variation across repetitions
            docs.append(doc)
            size += len(doc.encode("utf-8")) + 15
            i += k
        rep += 1
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n<|endoftext|>\n".join(docs))
    return docs


def _cpu():
    """CPU seconds of this process and its reaped children (the spawn pool's workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=50, help="corpus size in MB (default 50)")
    ap.add_argument("--workers", type=int, default=2, help="prepro workers (default 2)")
    ap.add_argument("--backends", default="threads,processes", help="comma list (default threads,processes)")
    ap.add_argument("--repeat", type=int, default=1, help="best of N interleaved runs (default 1)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = ap.parse_args()

    from llmctl.prepro import prepro_text
    from llmctl.tokenizer import get_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="llmctl-bench-prepro-"))
    try:
        corpus = tmp / "corpus.txt"
        docs = make_corpus(corpus, args.mb)
        mbytes = corpus.stat().st_size / 1e6
        enc = get_tokenizer().encoding  # built before timing, as prepro's threads reuse it

        backends = [b for b in args.backends.split(",") if b]
        base_s, best = float("inf"), {b: float("inf") for b in backends}
        base_cpu, cpu = float("inf"), {b: float("inf") for b in backends}
        for _ in range(max(1, args.repeat)):
            t0, c0 = time.perf_counter(), _cpu()
            n_base = sum(len(enc.encode_ordinary(d)) + 1 for d in docs)  # +1: the EOT prepro adds
            base_s = min(base_s, time.perf_counter() - t0)
            base_cpu = min(base_cpu, _cpu() - c0)
            for backend in backends:
                out = tmp / f"out-{backend}"
                c0 = _cpu()
                r = prepro_text([corpus], out_dir=out, name="bench", workers=args.workers, parallelism=backend)
                assert r["tokens"] == n_base, (r["tokens"], n_base)
                best[backend] = min(best[backend], r["seconds"])
                cpu[backend] = min(cpu[backend], _cpu() - c0)
                shutil.rmtree(out)
        base_rate = n_base / base_s
        results = {"corpus_mb": round(mbytes, 1), "cores": os.cpu_count(), "workers": args.workers,
                   "repeat": args.repeat, "load_avg_1min": round(os.getloadavg()[0], 2),
                   "baseline": {"tokens": n_base, "seconds": round(base_s, 2), "cpu_seconds": round(base_cpu, 2),
                                "tokens_per_s": round(base_rate)}}
        log = sys.stderr.write
        log(f"corpus {mbytes:.1f} MB, {n_base:,} tokens (load average {os.getloadavg()[0]:.2f})\n")
        log(f"baseline  tiktoken encode_ordinary, 1 thread: {base_rate:,.0f} tok/s ({base_s:.2f} s, "
            f"{base_cpu:.2f} CPU s)\n")
        for backend in backends:
            rate = n_base / best[backend]
            bound = min(args.workers, args.workers * base_cpu / cpu[backend])
            results[backend] = {"seconds": round(best[backend], 2), "cpu_seconds": round(cpu[backend], 2),
                                "tokens_per_s": round(rate), "speedup_vs_baseline": round(rate / base_rate, 2),
                                "cpu_bound_speedup": round(bound, 2)}
            log(f"prepro    {backend:9s} x{args.workers}: {rate:,.0f} tok/s ({best[backend]:.2f} s, "
                f"{cpu[backend]:.2f} CPU s) = {rate / base_rate:.2f}x baseline; "
                f"{bound:.2f}x on {args.workers} idle cores by CPU time\n")
        if args.json:
            print(json.dumps(results))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
