"""Benchmark `llmctl sample`: tokens/s with the KV cache vs. llm.c-style full recompute, in ONE run.

What it reports (random-init weights: speed does not depend on their values), for each
--precision asked, side by side (the same weights and prompt):
  - cached: prefill of the prompt (ms), then decode of --new-tokens one position per step:
    tokens/s and the implied weight-streaming bandwidth (every decode step reads all matmul
    weights once: ~498 MB for d12 in fp32, half in bf16), as a share of the machine's read floor
    measured in the same run (NumPy's max over 256 MB on the same threads), and the tokens/s the
    weights alone would allow at that floor;
  - full recompute (llm.c's way: the whole sequence through the model for every new token):
    tokens/s over --full-tokens steps from the same prompt (fewer steps: it is slow; its cost
    grows with the sequence length, so at the end of a 288-token sequence it is slower still).
bf16 runs where `llmctl sample --precision bf16` does: natively (AVX512_BF16/AMX), or on any AVX2
CPU, where decoding's products run on the bf16 GEMV's AVX2 copy and the prompt's GEMMs are
emulated on fp32; elsewhere it is skipped unless --bf16-emulate.
What it is not: a quality check (tests/test_sample.py checks cached == full logits).

    python bench/sample.py                        # d12, 32-token prompt, 256 new tokens, 2 threads
    python bench/sample.py --model d6 --new-tokens 64 --full-tokens 8 --json
    python bench/sample.py --precision fp32,bf16  # both, side by side (bf16: target >= 100 tokens/s)
    python bench/sample.py --precision bf16 --other ../llmctl-before --rounds 6   # this tree / that one
    python bench/sample.py --precision bf16 --full-tokens 0 --breakdown   # ms a token, kernel by kernel

With --other DIR (a checkout of another commit, extensions built in place, as bench/versions.py
takes it): this script runs in child processes, one per tree and round, the trees alternating so
that both see the same machine load (--full-tokens 0 in each); it prints the best and median
decode tokens/s of each tree and precision and their ratios (above 1: this tree is faster).
"""
import argparse
import json
import os
import sys
import time

import numpy as np


def read_floor_gbs(n_threads, nbytes=256 << 20, reps=6):
    """This machine's read bandwidth, the floor of a decode step's weight stream: NumPy's max over a
    fresh nbytes array split into n_threads contiguous parts, one Python thread each (the reduction
    releases the GIL), best of reps, bytes read / wall time."""
    import threading

    a = np.ones(nbytes // 4, np.float32)
    parts = np.array_split(a, n_threads)
    best = float("inf")
    for _ in range(reps):
        ths = [threading.Thread(target=np.max, args=(p,)) for p in parts]
        t = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def _measure(model, prompt, args):
    from llmctl.sample import generate

    weight_bytes = model.params.nbytes if model.precision == "fp32" else model.params_bf16.nbytes

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
    t_start, sf = timed(args.full_tokens, False) if args.full_tokens > 0 else (0.0, [])
    full_tps = len(sf) / (sf[-1] - t_start) if sf else None
    return {
        "precision": model.precision,
        "cached": {"new_tokens": len(st), "prefill_ms": round(prefill_ms, 1),
                   "decode_tokens_per_s": round(cached_tps, 2),
                   "overall_tokens_per_s": round(len(st) / (st[-1] - cached_start), 2),
                   "weight_GB_per_s": round(weight_bytes * cached_tps / 1e9, 2)},
        "full_recompute": {"new_tokens": len(sf), "tokens_per_s": round(full_tps, 3) if sf else None,
                           "positions": [args.prompt_tokens, args.prompt_tokens + len(sf)]},
        "speedup_decode": round(cached_tps / full_tps, 1) if sf else None,
    }


def decode_breakdown(model, prompt, n):
    """Where a decode token's time goes: `n` cached decode steps with every call into a compiled
    kernel module (model.kernels, and the sampler) timed -> (ms a token by function, ms a token in
    total, ms a token outside those calls: Python and the rest). The timers add a little to each call."""
    import types

    from llmctl import sample as S
    from llmctl._ext import sampler

    spent = {}

    def timed(name, f):
        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
        return call

    saved = dict(vars(model.kernels))
    old_softmax = sampler.sample_softmax
    try:
        for attr, mod in saved.items():
            if isinstance(mod, types.ModuleType):
                proxy = types.SimpleNamespace(**{k: getattr(mod, k) for k in dir(mod) if not k.startswith("__")})
                for k, v in vars(proxy).items():
                    if callable(v) and not isinstance(v, type):
                        setattr(proxy, k, timed(f"{attr}.{k}", v))
                setattr(model.kernels, attr, proxy)
        sampler.sample_softmax = timed("sampler.sample_softmax", old_softmax)
        stamps = []

        def stamp(tok):
            if not stamps:        # the prompt's forward and the first token: not decode steps
                spent.clear()
            stamps.append(time.perf_counter())

        S.generate(model, prompt, n + 1, seed=1337, stop_at_eot=False, on_token=stamp)
    finally:
        vars(model.kernels).update(saved)
        sampler.sample_softmax = old_softmax
    steps = len(stamps) - 1
    per = {k: v / steps * 1e3 for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
    total = (stamps[-1] - stamps[0]) / steps * 1e3
    return per, total, total - sum(per.values())


def paired(args):
    """--other: this tree against that one, child processes alternating, decode tokens/s each."""
    from versions import alternate, compare   # bench/versions.py: both trees built, alternating runs
    argv = [sys.executable, os.path.abspath(__file__), "--json", "--full-tokens", "0", "--model", args.model,
            "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
            "--threads", str(args.threads), "--precision", ",".join(args.precision)] + \
        (["--bf16-emulate"] if args.bf16_emulate else [])
    runs, load = alternate(args.other, argv, args.rounds)
    res = {"model": args.model, "threads": args.threads, "rounds": args.rounds, "other": args.other,
           "load_avg": load,
           "precisions": compare(runs, lambda out: {r["precision"]: r["cached"]["decode_tokens_per_s"]
                                                    for r in out["runs"]}, rate=True)}
    if args.json:
        print(json.dumps(res))
        return
    print(f"{args.model} decode, {args.threads} threads, {args.rounds} alternating rounds; "
          f"load avg {res['load_avg'][0]:.2f} -> {res['load_avg'][1]:.2f}")
    for prec, r in res["precisions"].items():
        print(f"  {prec}: this {' '.join(f'{v:.1f}' for v in r['this'])} tokens/s")
        print(f"  {' ' * len(prec)}  other {' '.join(f'{v:.1f}' for v in r['other'])} tokens/s")
        print(f"  {' ' * len(prec)}  this / other: best {r['best_ratio']:.3f}x, median {r['median_ratio']:.3f}x, "
              f"paired median {r['paired_median_ratio']:.3f}x")


def main(argv=None):
    from eval import add_precision_args, runnable_precisions   # bench/eval.py: the same flags

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="d12", help="descriptor or checkpoint (default d12)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--full-tokens", type=int, default=16, help="steps of the full-recompute run (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    add_precision_args(ap)
    ap.add_argument("--other", help="source tree of another version (extensions built in place): both "
                    "trees' decode, alternating child processes")
    ap.add_argument("--rounds", type=int, default=4, help="with --other: alternations of the two trees")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time every kernel call of --new-tokens more decode steps: ms a token each")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.other:
        return paired(args)

    from llmctl._ext import matmul
    from llmctl.model import GPT2, load

    precisions, skipped = runnable_precisions(ap, args, sampling=True)
    t0 = time.perf_counter()
    ref = load(args.model, n_threads=args.threads)   # one init: the same weights for all
    init_s = time.perf_counter() - t0
    prompt = np.random.default_rng(0).integers(0, ref.config.vocab_size, args.prompt_tokens).tolist()
    runs = []
    for prec in precisions:
        model = ref if prec == "fp32" else GPT2(ref.config, n_threads=args.threads, precision=prec,
                                                bf16_emulate=True if prec == "bf16" else None)
        if model is not ref:
            model.params[:] = ref.params
            model.params_changed()
        runs.append(_measure(model, prompt, args))
        if args.breakdown:
            per, total, rest = decode_breakdown(model, prompt, args.new_tokens)
            runs[-1]["breakdown_ms_per_token"] = {"total": round(total, 3), "outside_kernels": round(rest, 3),
                                                  "calls": {k: round(v, 3) for k, v in per.items()}}
        if prec == "bf16":
            runs[-1]["gemm"] = ("native" if matmul.bf16_native() else "emulated on fp32") + \
                f"; decode GEMV {matmul.gemv_bf16_isa()}"
    # the ceiling a decode step's weight stream sets: every token reads all matmul weights once
    floor = read_floor_gbs(args.threads)
    for r in runs:
        c = r["cached"]
        c["weights_tokens_per_s_at_read_floor"] = round(floor / c["weight_GB_per_s"] * c["decode_tokens_per_s"], 1)
        c["share_of_read_floor"] = round(c["weight_GB_per_s"] / floor, 3)

    res = {"model": args.model, "threads": args.threads, "num_parameters": ref.num_parameters,
           "init_s": round(init_s, 2), "prompt_tokens": args.prompt_tokens, "runs": runs,
           "read_floor_GB_per_s": round(floor, 1),
           "skipped": skipped, "loadavg_1min": round(os.getloadavg()[0], 2)}
    if args.json:
        print(json.dumps(res))
        return
    print(f"{args.model} ({ref.num_parameters:,} params), {args.threads} threads, "
          f"{args.prompt_tokens}-token prompt (init {init_s:.1f} s; load average {res['loadavg_1min']}: "
          "other processes on these cores slow multi-threaded runs most)")
    for r in runs:
        c, f = r["cached"], r["full_recompute"]
        print(f"  {r['precision']}" + (f" ({r['gemm']})" if "gemm" in r else ""))
        print(f"    KV cache : prefill {c['prefill_ms']:.0f} ms, decode {c['new_tokens']} tokens at "
              f"{c['decode_tokens_per_s']:.2f} tokens/s ({c['weight_GB_per_s']:.1f} GB/s of weights), "
              f"overall {c['overall_tokens_per_s']:.2f} tokens/s")
        print(f"    weights  : {c['share_of_read_floor']:.0%} of the read floor; reading them at the floor "
              f"alone would allow {c['weights_tokens_per_s_at_read_floor']:.0f} tokens/s")
        if f["new_tokens"]:
            print(f"    full     : {f['new_tokens']} tokens at {f['tokens_per_s']:.3f} tokens/s "
                  f"(sequence {f['positions'][0]}..{f['positions'][1]} positions)")
            print(f"    speedup  : {r['speedup_decode']}x")
        if "breakdown_ms_per_token" in r:
            b = r["breakdown_ms_per_token"]
            print(f"    a token  : {b['total']:.2f} ms with its kernel calls timed: " +
                  ", ".join(f"{k} {v:.3f}" for k, v in b["calls"].items()) +
                  f"; outside them (Python and the rest) {b['outside_kernels']:.3f}")
    print(f"  read floor: {floor:.1f} GB/s (NumPy's max over 256 MB on {args.threads} threads)")
    for line in skipped:
        print("  skipped: " + line)


if __name__ == "__main__":
    main()
