"""Benchmark `llmctl eval hellaswag`: examples/s on real HellaSwag examples with a d12 model.

What it reports: examples/s (and the implied time for the full 10,042-example validation set)
for the first --examples examples of the HellaSwag validation jsonl (prepro'd to a
temporary llm.c eval file), with random-init weights (speed does not depend on their values),
plus the positions actually computed vs. llm.c's 4 rows x T=1024 per example.
What it is not: an accuracy figure (random weights score ~25%).

    python bench/eval.py                       # d12, 50 examples, 2 threads
    python bench/eval.py --model d6 --examples 20 --threads 1 --json
"""
import argparse
import json
import os
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
JSONL = os.path.join(HERE, "..", "..", "shared", "data", "hellaswag", "hellaswag_val.jsonl")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="d12")
    ap.add_argument("--examples", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--jsonl", default=JSONL)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from llmctl.evaluate import eval_hellaswag
    from llmctl.formats import read_evalfile
    from llmctl.model import GPT2
    from llmctl.prepro.hellaswag import prepro_hellaswag

    with tempfile.TemporaryDirectory() as d:
        part = os.path.join(d, "part.jsonl")
        with open(args.jsonl, encoding="utf-8") as f, open(part, "w", encoding="utf-8") as g:
            for _ in range(args.examples):
                g.write(next(f))
        path = prepro_hellaswag(out_dir=d, source=part)["path"]
        exs = read_evalfile(path)
        # positions run: each context once + each completion minus its last token (a target only)
        positions = sum(len(e.context) + sum(len(c) - 1 for c in e.endings) for e in exs)
        model = GPT2.from_init(args.model, n_threads=args.threads)
        eval_hellaswag(model, path, limit=2, batch_tokens=args.batch_tokens)  # warm-up
        t0 = time.perf_counter()
        res = eval_hellaswag(model, path, batch_tokens=args.batch_tokens)
        dt = time.perf_counter() - t0
    eps = res["num_examples"] / dt
    out = {"model": args.model, "threads": args.threads, "examples": res["num_examples"],
           "seconds": round(dt, 2), "examples_per_s": round(eps, 3),
           "full_val_minutes": round(10042 / eps / 60, 1),
           "positions_per_example": round(positions / len(exs), 1),
           "llmc_positions_per_example": 4 * 1024, "acc_norm": res["acc_norm"],
           "loadavg_1min": round(os.getloadavg()[0], 2)}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.model}, {args.threads} threads: {out['examples']} HellaSwag examples in {dt:.1f} s = "
          f"{eps:.2f} examples/s -> full val (10,042) in ~{out['full_val_minutes']} min "
          f"(load average {out['loadavg_1min']})")
    print(f"  positions computed per example: {out['positions_per_example']} "
          f"(llm.c pads 4 rows to T=1024: 4096)")


if __name__ == "__main__":
    main()
