"""Benchmark one GPT-2 training step (forward + backward + AdamW) with llmctl's kernels.

What it reports, all measured in ONE run so the ratios are meaningful on a shared machine:
  - this machine's fp32 GEMM peak (NumPy/BLAS, a 1024^3 product, best of 20): the larger of the
    n-thread figure and n x the 1-thread figure (contention on a shared machine lowers the former);
  - per model (default d12 and d6 at B=4, T=64): ms/step (best of --steps; median too), tokens/s, achieved GFLOP/s and
    MFU = achieved / peak, with model FLOPs per token = 6*N + 12*L*C*T (llm.c's / PaLM's count);
  - a per-kernel breakdown of one step (matmul / attention / other kernels / AdamW / Python);
  - PyTorch eager on the same model and batch (torch.set_num_threads(n)), if torch is importable;
  - peak RSS of a training step at B=4, T=1024 for d12 (a child process, /usr/bin/time -v or
    getrusage), and at B=4, T=64.
What it is not: a kernel microbenchmark (bench/kernels.py) or a convergence test.

    python bench/step.py                        # d12 + d6, B=4, T=64, 2 threads, + RSS at T=1024
    python bench/step.py --models d6 --steps 3 --no-rss
"""
import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np


def gemm_peak_gflops(n_threads, size=1024, reps=20):
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    best = float("inf")
    with threadpool_limits(limits=n_threads, user_api="blas"):
        a @ b
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    return 2 * size ** 3 / best / 1e9


def flops_per_step(cfg, B, T, num_params):
    return (6 * num_params + 12 * cfg.num_layers * cfg.channels * T) * B * T


class _Timed:
    """Proxy over a kernel module that adds each call's wall time to `acc[name]`."""

    def __init__(self, mod, acc, prefix):
        self._mod, self._acc, self._prefix = mod, acc, prefix

    def __getattr__(self, name):
        fn = getattr(self._mod, name)
        if not callable(fn):
            return fn
        key = f"{self._prefix}.{name}"

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self._acc[key] += time.perf_counter() - t0
        return timed


def _batch(cfg, B, T, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, cfg.vocab_size, (B, T + 1))
    return x[:, :T], x[:, 1:]


def _step(m, x, y, t):
    m.zero_grad()
    loss = m.forward(x, y)
    m.backward()
    norm = m.grad_norm()
    m.update(3e-4, 0.9, 0.95, 1e-8, 0.0, 1.0 / norm if norm > 1 else 1.0, t)
    return loss


def bench_llmctl(desc, B, T, n_threads, steps, matmul):
    from llmctl.model import GPT2

    m = GPT2.from_descriptor(desc, n_threads=n_threads, matmul=matmul)
    x, y = _batch(m.config, B, T)
    _step(m, x, y, 1)  # warm-up: allocates activations, grads' scratch and AdamW state
    times, cpu = [], []
    for s in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        _step(m, x, y, s + 2)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    # two more steps with every kernel call timed; keep the less disturbed one
    originals = (m._k_matmul, m._k_layers, m._k_attention, m._k_adamw)
    best = None
    for s in range(2):
        acc = defaultdict(float)
        m._k_matmul, m._k_layers = _Timed(originals[0], acc, "matmul"), _Timed(originals[1], acc, "layers")
        m._k_attention, m._k_adamw = _Timed(originals[2], acc, "attention"), _Timed(originals[3], acc, "adamw")
        t0 = time.perf_counter()
        _step(m, x, y, steps + 2 + s)
        total = time.perf_counter() - t0
        if best is None or total < best[0]:
            best = (total, acc)
    total, acc = best
    m._k_matmul, m._k_layers, m._k_attention, m._k_adamw = originals
    groups = defaultdict(float)
    for k, v in acc.items():
        g = k.split(".")[0]
        if k == "adamw.global_norm_sq":
            g = "grad_norm"
        groups[g] += v
    groups["python+numpy"] = total - sum(acc.values())
    return {"model": desc, "B": B, "T": T, "threads": n_threads, "num_params": m.num_parameters,
            "step_s": min(times), "median_s": statistics.median(times), "all_steps_s": times,
            "cpu_s": cpu[times.index(min(times))],
            "flops_per_step": flops_per_step(m.config, B, T, m.num_parameters),
            "breakdown_s": dict(groups), "breakdown_total_s": total,
            "kernel_calls_s": dict(sorted(acc.items(), key=lambda kv: -kv[1]))}


def bench_torch(desc, B, T, n_threads, steps):
    try:
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
    except ImportError:
        return None
    from llmctl.model import GPT2Config

    cfg = GPT2Config.from_descriptor(desc)
    torch.set_num_threads(n_threads)
    torch.manual_seed(0)
    C, NH, L = cfg.channels, cfg.num_heads, cfg.num_layers

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, x):
            Bx, Tx, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
            q, k, v = (t.view(Bx, Tx, NH, C // NH).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.c_proj(y.transpose(1, 2).contiguous().view(Bx, Tx, C))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(cfg.padded_vocab_size, C), nn.Embedding(cfg.max_seq_len, C)
            self.h = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(C)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for blk in self.h:
                x = blk(x)
            logits = self.ln_f(x) @ self.wte.weight.T
            return F.cross_entropy(logits[..., :cfg.vocab_size].reshape(-1, cfg.vocab_size), targets.reshape(-1))

    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    x, y = (torch.from_numpy(a.astype(np.int64)) for a in _batch(cfg, B, T))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"torch": torch.__version__, "step_s": min(times), "median_s": statistics.median(times),
            "all_steps_s": times}


def rss_child(desc, B, T, n_threads, matmul):
    """Run one training step in a fresh process; return its peak RSS in bytes."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_rss-child", desc, str(B), str(T), str(n_threads), matmul]
    timev = shutil.which("time") or ("/usr/bin/time" if os.path.exists("/usr/bin/time") else None)
    if timev:
        r = subprocess.run([timev, "-v"] + cmd, capture_output=True, text=True)
        if r.returncode == 0:
            mm = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
            if mm:
                return int(mm.group(1)) * 1024, "/usr/bin/time -v"
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"RSS child failed: {r.stderr[-2000:]}")
    return max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) * 1024, "getrusage"


def _rss_child_main(desc, B, T, n_threads, matmul):
    from llmctl.model import GPT2

    m = GPT2.from_descriptor(desc, n_threads=int(n_threads), matmul=matmul)
    x, y = _batch(m.config, int(B), int(T))
    _step(m, x, y, 1)


def _fmt_row(name, r, peak):
    tok = r["B"] * r["T"] / r["step_s"]
    gf = r["flops_per_step"] / r["step_s"] / 1e9
    return f"{name:6s} {r['num_params']:>12,d} {r['B']:>2d}x{r['T']:<5d} {r['step_s'] * 1e3:9.1f} {tok:9.1f} {gf:8.1f} {100 * gf / peak:6.1f}%"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="d12,d6", help="comma-separated descriptors (default d12,d6)")
    ap.add_argument("-b", "--batch", type=int, default=4, help="B (default 4)")
    ap.add_argument("-t", "--seq", type=int, default=64, help="T (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per model (default 5)")
    ap.add_argument("--matmul", default="blas", help="matmul backend: blas or tiled (default blas)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS child processes")
    ap.add_argument("--rss-seq", type=int, default=1024, help="T for the big RSS run (default 1024)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--_rss-child", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._rss_child:
        return _rss_child_main(*a._rss_child)

    from llmctl.threads import configure_threads

    n = configure_threads(a.threads)
    # On a shared machine an n-thread GEMM rarely gets n idle cores for its whole run; n times the
    # 1-thread figure is the better (and the conservative, higher) estimate of the real peak.
    peak_n, peak_1 = gemm_peak_gflops(n), gemm_peak_gflops(1)
    peak = max(peak_n, n * peak_1)
    out = {"threads": n, "gemm_peak_gflops": peak, "gemm_n_threads_gflops": peak_n, "gemm_1_thread_gflops": peak_1, "load_avg": os.getloadavg(), "models": [], "torch": [], "rss": []}
    for desc in a.models.split(","):
        r = bench_llmctl(desc, a.batch, a.seq, n, a.steps, a.matmul)
        r["mfu"] = r["flops_per_step"] / r["step_s"] / 1e9 / peak
        out["models"].append(r)
        if not a.no_torch:
            tr = bench_torch(desc, a.batch, a.seq, n, a.steps)
            if tr:
                tr["model"] = desc
                tr["ratio_torch_over_llmctl"] = tr["step_s"] / r["step_s"]
                out["torch"].append(tr)
    if not a.no_rss:
        for desc, T in (("d12", a.seq), ("d12", a.rss_seq)):
            b, how = rss_child(desc, a.batch, T, n, a.matmul)
            out["rss"].append({"model": desc, "B": a.batch, "T": T, "peak_rss_bytes": b, "how": how})
    if a.json:
        print(json.dumps(out, indent=1, default=float))
        return
    print(f"threads {n}, fp32 GEMM peak (NumPy/BLAS 1024^3) {peak:.1f} GFLOP/s = max({n} threads {peak_n:.1f}, "
          f"{n} x 1 thread {peak_1:.1f}); load avg {out['load_avg'][0]:.2f}")
    print("ms/step is the best of the timed steps (the least disturbed by other processes); median in brackets")
    print(f"{'model':6s} {'params':>12s} {'BxT':>8s} {'ms/step':>9s} {'tok/s':>9s} {'GFLOP/s':>8s} {'MFU':>7s} {'cpu/wall':>8s} {'(median)':>9s}")
    for r in out["models"]:
        print(_fmt_row(r["model"], r, peak) + f" {r['cpu_s'] / r['step_s']:8.2f} {r['median_s'] * 1e3:9.1f}")
    for r in out["models"]:
        tot = r["breakdown_total_s"]
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms ({100 * v / tot:.0f}%)" for k, v in
                          sorted(r["breakdown_s"].items(), key=lambda kv: -kv[1]))
        print(f"{r['model']} breakdown of one step ({tot * 1e3:.0f} ms): {parts}")
        top = list(r["kernel_calls_s"].items())[:8]
        print("   top kernels: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in top))
    for tr in out["torch"]:
        print(f"torch {tr['torch']} eager {tr['model']}: {tr['step_s'] * 1e3:.1f} ms/step (median {tr['median_s'] * 1e3:.1f}); "
              f"torch/llmctl = {tr['ratio_torch_over_llmctl']:.2f}x")
    if not out["torch"] and not a.no_torch:
        print("torch not importable: no PyTorch comparison")
    for r in out["rss"]:
        print(f"peak RSS {r['model']} B={r['B']} T={r['T']} training step: {r['peak_rss_bytes'] / 2**30:.2f} GiB ({r['how']})")


if __name__ == "__main__":
    main()
