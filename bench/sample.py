"""Benchmark `llmctl sample`: tokens/s with the KV cache vs. llm.c-style full recompute, in ONE run.

What it reports (random-init weights: speed does not depend on their values):
  - cached: prefill of the prompt (ms), then decode of --new-tokens one position per step:
    tokens/s and the implied weight-streaming bandwidth (every decode step reads all fp32
    weights once: ~498 MB for d12);
  - full recompute (llm.c's way: the whole sequence through the model for every new token):
    tokens/s over --full-tokens steps from the same prompt (fewer steps: it is slow; its cost
    grows with the sequence length, so at the end of a 288-token sequence it is slower still).
What it is not: a quality check (tests/test_sample.py checks cached == full logits).

    python bench/sample.py                        # d12, 32-token prompt, 256 new tokens, 2 threads
    python bench/sample.py --model d6 --new-tokens 64 --full-tokens 8 --json
    python bench/sample.py --precision bf16       # bf16 weights (half the bytes per decode step);
                                                  # needs native bf16 (or LLMCTL_BF16_EMULATE=1)
"""
import argparse
import json
import os
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="d12", help="descriptor or checkpoint (default d12)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--full-tokens", type=int, default=16, help="steps of the full-recompute run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", default="fp32", help="fp32 or bf16 (default fp32)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from llmctl.model import GPT2
    from llmctl.sample import generate

    t0 = time.perf_counter()
    model = GPT2.from_init(args.model, n_threads=args.threads, precision=args.precision)
    init_s = time.perf_counter() - t0
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt_tokens).tolist()
    weight_bytes = model.params.nbytes if args.precision == "fp32" else model.params_bf16.nbytes

    def timed(n, use_cache):
        stamps = []
        t_start = time.perf_counter()
        generate(model, prompt, n, seed=1337, stop_at_eot=False, use_cache=use_cache,
                 on_token=lambda t: stamps.append(time.perf_counter()))
        return t_start, stamps

    generate(model, prompt, 2, stop_at_eot=False)  # warm-up: kernels, BLAS threads, page-in
    cached_start, st = timed(args.new_tokens, True)
    prefill_ms = (st[0] - cached_start) * 1e3          # prompt forward + the first token's sampling
    decode_s = st[-1] - st[0]
    cached_tps = (len(st) - 1) / decode_s if len(st) > 1 else float("nan")
    t_start, sf = timed(args.full_tokens, False)
    full_tps = len(sf) / (sf[-1] - t_start)

    res = {
        "model": args.model, "threads": args.threads, "precision": args.precision,
        "num_parameters": model.num_parameters,
        "init_s": round(init_s, 2), "prompt_tokens": args.prompt_tokens,
        "cached": {"new_tokens": len(st), "prefill_ms": round(prefill_ms, 1),
                   "decode_tokens_per_s": round(cached_tps, 2),
                   "overall_tokens_per_s": round(len(st) / (st[-1] - cached_start), 2),
                   "weight_GB_per_s": round(weight_bytes * cached_tps / 1e9, 2)},
        "full_recompute": {"new_tokens": len(sf), "tokens_per_s": round(full_tps, 3),
                           "positions": [args.prompt_tokens, args.prompt_tokens + len(sf)]},
        "speedup_decode": round(cached_tps / full_tps, 1),
        "loadavg_1min": round(os.getloadavg()[0], 2),
    }
    if args.json:
        print(json.dumps(res))
        return
    c, f = res["cached"], res["full_recompute"]
    print(f"{args.model} ({model.num_parameters:,} params), {args.precision}, {args.threads} threads, "
          f"{args.prompt_tokens}-token prompt (init {init_s:.1f} s; load average {res['loadavg_1min']}: "
          "other processes on these cores slow multi-threaded runs most)")
    print(f"  KV cache : prefill {c['prefill_ms']:.0f} ms, decode {c['new_tokens']} tokens at "
          f"{c['decode_tokens_per_s']:.2f} tokens/s ({c['weight_GB_per_s']:.1f} GB/s of weights), "
          f"overall {c['overall_tokens_per_s']:.2f} tokens/s")
    print(f"  full     : {f['new_tokens']} tokens at {f['tokens_per_s']:.3f} tokens/s "
          f"(sequence {f['positions'][0]}..{f['positions'][1]} positions)")
    print(f"  speedup  : {res['speedup_decode']}x")


if __name__ == "__main__":
    main()
