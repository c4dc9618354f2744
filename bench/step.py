"""Benchmark one GPT-2 training step (forward + backward + AdamW): llmctl fp32 / bf16 vs PyTorch.

What it reports, all measured in ONE run so the ratios are meaningful on a shared machine:
  - the GEMM roof of each precision on this machine: the best GFLOP/s of llmctl's own matmul
    kernel (oneDNN where built) on d12's layer shapes at B*T=256 (qkv, fc, fcproj, lm head), fp32
    and, where the CPU multiplies bf16 natively, bf16; plus NumPy's 1024^3 sgemm for reference;
  - per run (default d12 B=4 T=64, d12 B=4 T=1024, d6 B=4 T=64) and precision: ms/step (best of
    --steps; median too), tokens/s, GFLOP/s and MFU = achieved / the roof of the SAME precision
    (for emulated bf16, fp32's: its GEMMs multiply in fp32 sgemm),
    with model FLOPs per token = 6*N + 6*L*C*T (llm.c's gpt2_estimate_mfu, as `llmctl train`; PaLM's
    12*L*C*T gives 6.6 % more at d12 T=1024, so these MFUs are the lower); and "MFU adj", each
    step against the roof sampled just before and just after it, at B*T=256 and at the run's own
    B*T (the roof at the start of the run can be minutes and a different machine load away from a
    T=1024 step: MFU adj is the figure for a target); and "MFU ref", the same pairing against
    the reference roof: the best of the six GEMMs of REFERENCE_SHAPES, the set the targets were
    stated with (fp32: NumPy's sgemm or llmctl's, whichever is faster), sampled in the same child;
  - the rate of the step's matmuls (their FLOPs / their time in the breakdown) against the roof;
  - a per-kernel breakdown of one step (matmul / attention / other kernels / AdamW / Python) and
    the non-matmul share of the step;
  - PyTorch on the same model and batch (torch.set_num_threads(n)): fp32 eager and bf16
    `torch.autocast("cpu", dtype=torch.bfloat16)` (only beside llmctl bf16 on a CPU with native
    bf16: elsewhere torch's bf16 GEMMs are a scalar fallback), if torch is importable;
  - peak RSS of a d12 training step at B=4, T=1024 and T=64 per precision (a child process,
    /usr/bin/time -v or getrusage).
On a CPU without native bf16 (no AVX512_BF16/AMX) llmctl's bf16 is skipped unless
--bf16-emulate (the same numerics on fp32 GEMMs: slower than fp32, shown only for completeness).
What it is not: a kernel microbenchmark (bench/kernels.py) or a convergence test.

    python bench/step.py                              # everything above, 2 threads
    python bench/step.py --runs d6:4x64 --steps 3 --no-rss --no-torch
    python bench/step.py --runs d12:4x64 --no-rss --no-torch --precisions bf16 --compare-bf16-engine dnnl_gemm
"""
import argparse
import inspect
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


D12_SHAPES = (("qkv", 768, 2304), ("fc", 768, 3072), ("fcproj", 3072, 768), ("lmhead", 768, 50304))


def _best_seconds(fns, reps):
    """The best wall time of reps calls of any of fns (each called once untimed first)."""
    best = float("inf")
    for fn in fns:
        fn()
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def _forward_fn(precision, x, w, M, K, N, n_threads):
    """llmctl's out (M,N) = x (M,K) @ w (N,K)^T in the given precision, as a call without
    arguments (bf16: both operands rounded to bf16 here, once)."""
    from llmctl._ext import convert, matmul

    y = np.empty(M * N, np.float32)
    if precision == "bf16":
        xb, wb = np.empty(x.size, np.uint16), np.empty(w.size, np.uint16)
        convert.cast_to_bf16(xb, x, n_threads)
        convert.cast_to_bf16(wb, w, n_threads)
        return lambda: matmul.matmul_forward_bf16(y, xb, wb, None, M, K, N, n_threads)
    return lambda: matmul.matmul_forward(y, x, w, None, M, K, N, n_threads)


def gemm_roof_gflops(n_threads, precision, BT=256, reps=6, lmhead_rows=None):
    """{shape: best GFLOP/s} of llmctl's matmul_forward(_bf16) on d12's layer shapes, default
    engine; the lm head at min(BT, lmhead_rows) rows when lmhead_rows is given."""
    rng = np.random.default_rng(0)
    out = {}
    rows = BT
    for name, C, OC in D12_SHAPES:
        BT = min(rows, lmhead_rows) if name == "lmhead" and lmhead_rows else rows
        x = rng.standard_normal(BT * C, dtype=np.float32)
        w = rng.standard_normal(OC * C, dtype=np.float32) * np.float32(0.02)
        out[name] = 2.0 * BT * C * OC / _best_seconds([_forward_fn(precision, x, w, BT, C, OC, n_threads)], reps) / 1e9
    return out


# The GEMMs the bf16-at-the-roof targets were first stated against (M x K x N; M rows of
# activations times a K x N weight): d12's four layer products and its lm head at 256 rows, and
# fc at 4096 rows
REFERENCE_SHAPES = ((256, 768, 2304), (256, 768, 768), (256, 768, 3072), (256, 3072, 768),
                    (256, 768, 50304), (4096, 768, 3072))


def reference_roof_gflops(n_threads, precision, reps=2):
    """{"MxKxN": best GFLOP/s} on REFERENCE_SHAPES: for fp32 the better of NumPy's sgemm (BLAS
    limited to n_threads) and llmctl's matmul_forward, for bf16 llmctl's matmul_forward_bf16."""
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    out = {}
    for M, K, N in REFERENCE_SHAPES:
        x = rng.standard_normal(M * K, dtype=np.float32)
        w = rng.standard_normal(N * K, dtype=np.float32) * np.float32(0.02)
        fns = [_forward_fn(precision, x, w, M, K, N, n_threads)]
        if precision != "bf16":
            xn, wt, yn = x.reshape(M, K), np.ascontiguousarray(w.reshape(N, K).T), np.empty((M, N), np.float32)
            fns.append(lambda: np.matmul(xn, wt, out=yn))
        with threadpool_limits(limits=n_threads, user_api="blas"):
            out[f"{M}x{K}x{N}"] = 2.0 * M * K * N / _best_seconds(fns, reps) / 1e9
    return out


def adjacent_roofs(n_threads, precision, BT, reps=2, lmhead_rows=1024):
    """(llmctl's roof as adjacent_roof_gflops takes it, the best of reference_roof_gflops), both
    sampled in one child process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_roof-child", precision, str(BT), str(n_threads),
           str(reps), str(lmhead_rows)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"roof child failed: {r.stderr[-2000:]}")
    strict, ref = r.stdout.split()[-2:]
    return float(strict), float(ref)


def adjacent_roof_gflops(n_threads, precision, BT, reps=2, lmhead_rows=1024):
    """The GEMM roof taken between a run's timed steps: the best GFLOP/s of d12's layer shapes
    at B*T=256 and at the run's own B*T (the lm head at no more than lmhead_rows rows, so a
    sample stays near a second at T=1024), whichever is higher. A roof sampled right beside each
    step sees the machine as that step did; the one at the start of the run may not.
    Measured in a child process: in the benchmark's own, the sample's large GEMMs and arrays
    leave the allocator so that the next step faults its memory in again (+6-20 % on that step)."""
    return adjacent_roofs(n_threads, precision, BT, reps, lmhead_rows)[0]


def _roof_child_main(precision, BT, n_threads, reps, lmhead_rows):
    from llmctl.threads import configure_threads

    n, BT = configure_threads(int(n_threads)), int(BT)
    best = max(gemm_roof_gflops(n, precision, 256, int(reps)).values())
    if BT != 256:
        best = max(best, max(gemm_roof_gflops(n, precision, BT, int(reps), int(lmhead_rows)).values()))
    print(best, max(reference_roof_gflops(n, precision, int(reps)).values()))


def gemm_peak_gflops(n_threads, size=1024, reps=20):
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    with threadpool_limits(limits=n_threads, user_api="blas"):
        best = _best_seconds([lambda: a @ b], reps)
    return 2 * size ** 3 / best / 1e9


def flops_per_step(cfg, B, T, num_params):
    """llm.c's gpt2_estimate_mfu count, the one `llmctl train` reports MFU with."""
    from llmctl.mfu import flops_per_token

    return flops_per_token(num_params, cfg.num_layers, cfg.channels, T) * B * T


def matmul_flops_per_step(cfg, B, T):
    """FLOPs of the linear layers' products in one step (forward + both backward products): per
    token 2 * (L * 12 C^2 + C * Vp) forward, three times that in all. Recomputed products (-r 3's
    attproj) are not counted: the rate derived from it is of the model's matmul work."""
    C = cfg.channels
    return 6 * B * T * (cfg.num_layers * 12 * C * C + C * cfg.padded_vocab_size)


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
    # as `llmctl train`: bf16's backward overwrites spent gradients, no fill (older trees fill)
    m.zero_grad(**({"lazy": True} if "lazy" in inspect.signature(m.zero_grad).parameters else {}))
    # loss_scale as `llmctl train` passes it (the bf16 blocked lm head then makes its gradient in
    # the forward); versions before that take the forward without it
    kw = {"loss_scale": 1.0} if "loss_scale" in inspect.signature(m.forward).parameters else {}
    loss = m.forward(x, y, **kw)
    m.backward()
    norm = m.grad_norm()
    # zero_grads as `llmctl train` does: AdamW spends the gradients, the next zero_grad is free
    m.update(3e-4, 0.9, 0.95, 1e-8, 0.0, 1.0 / norm if norm > 1 else 1.0, t, zero_grads=True)
    return loss


def bench_llmctl(desc, B, T, n_threads, steps, matmul, precision, roof=None, recompute=None):
    """roof: the precision whose GEMM roof is sampled before the first timed step and after each
    one (adjacent_roof_gflops), for an MFU per step against the roof measured beside it.
    recompute: the -r level (None: the model's default)."""
    from llmctl.model import GPT2

    m = GPT2.from_descriptor(desc, n_threads=n_threads, engine=matmul, precision=precision, recompute=recompute)
    x, y = _batch(m.config, B, T)
    _step(m, x, y, 1)  # warm-up: allocates activations, grads' scratch and AdamW state
    times, cpu, roofs, ref_roofs = [], [], [], []

    def sample_roof():
        if roof:
            strict, ref = adjacent_roofs(n_threads, roof, B * T)
            roofs.append(strict)
            ref_roofs.append(ref)

    sample_roof()
    for s in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        _step(m, x, y, s + 2)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        sample_roof()
    # two more steps with every kernel call timed; keep the less disturbed one
    kern = m.kernels
    names = ("matmul", "layers", "attention", "adamw", "convert")
    originals = {name: getattr(kern, name) for name in names}
    best = None
    for s in range(2):
        acc = defaultdict(float)
        for name in names:   # the bf16 casts count with the other kernels
            setattr(kern, name, _Timed(originals[name], acc, "layers" if name == "convert" else name))
        t0 = time.perf_counter()
        _step(m, x, y, steps + 2 + s)
        total = time.perf_counter() - t0
        if best is None or total < best[0]:
            best = (total, acc)
    total, acc = best
    for name in names:
        setattr(kern, name, originals[name])
    groups = defaultdict(float)
    for k, v in acc.items():
        g = k.split(".")[0]
        if k == "adamw.global_norm_sq":
            g = "grad_norm"
        groups[g] += v
    groups["python+numpy"] = total - sum(acc.values())
    flops = flops_per_step(m.config, B, T, m.num_parameters)
    mm_flops = matmul_flops_per_step(m.config, B, T)
    # each step against the higher of the roofs sampled just before and just after it
    paired = [flops / t / 1e9 / max(roofs[i], roofs[i + 1]) for i, t in enumerate(times)] if roof else []
    paired_ref = [flops / t / 1e9 / max(ref_roofs[i], ref_roofs[i + 1]) for i, t in enumerate(times)] if roof else []
    return {"model": desc, "B": B, "T": T, "precision": precision, "engine": kern.matmul.default_engine(),
            "roof_adjacent_gflops": roofs, "mfu_adjacent": statistics.median(paired) if paired else None,
            "mfu_adjacent_all": paired, "roof_reference_gflops": ref_roofs,
            "mfu_reference": statistics.median(paired_ref) if paired_ref else None, "mfu_reference_all": paired_ref,
            "threads": n_threads, "num_params": m.num_parameters,
            "non_matmul_share": 1.0 - groups.get("matmul", 0.0) / total,
            "step_s": min(times), "median_s": statistics.median(times), "all_steps_s": times,
            "cpu_s": cpu[times.index(min(times))],
            "flops_per_step": flops, "matmul_flops_per_step": mm_flops,
            "matmul_gflops": mm_flops / groups["matmul"] / 1e9 if groups.get("matmul") else None,
            "breakdown_s": dict(groups), "breakdown_total_s": total,
            "kernel_calls_s": dict(sorted(acc.items(), key=lambda kv: -kv[1]))}


def bench_torch(desc, B, T, n_threads, steps, precision="fp32"):
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
        if precision == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, y)
        else:
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
    return {"torch": torch.__version__, "precision": precision, "model": desc, "B": B, "T": T,
            "step_s": min(times), "median_s": statistics.median(times), "all_steps_s": times}


def rss_child(desc, B, T, n_threads, matmul, precision, recompute="auto"):
    """Run three training steps in a fresh process; return its peak RSS in bytes.
    recompute: "auto" (the model's default) or a -r level."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_rss-child", desc, str(B), str(T), str(n_threads),
           matmul or "default", precision, str(recompute)]
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


def _rss_child_main(desc, B, T, n_threads, matmul, precision, recompute):
    from llmctl.model import GPT2

    m = GPT2.from_descriptor(desc, n_threads=int(n_threads), engine=None if matmul == "default" else matmul,
                             precision=precision, recompute=None if recompute == "auto" else int(recompute))
    x, y = _batch(m.config, int(B), int(T))
    # three steps: a training run's peak is a later step's, where AdamW's m and v are held while
    # the forward and backward run (the first step allocates them only after its backward)
    for t in (1, 2, 3):
        _step(m, x, y, t)


def _parse_runs(spec):
    """"d12:4x64,d6:4x64" -> [("d12", 4, 64), ("d6", 4, 64)]."""
    out = []
    for item in spec.split(","):
        desc, _, bt = item.strip().partition(":")
        B, _, T = (bt or "4x64").partition("x")
        out.append((desc, int(B), int(T)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="d12:4x64,d12:4x1024,d6:4x64",
                    help="comma-separated model:BxT (default d12:4x64,d12:4x1024,d6:4x64)")
    ap.add_argument("--precisions", default="fp32,bf16", help="llmctl precisions (default fp32,bf16)")
    ap.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    ap.add_argument("--big-steps", type=int, default=2, help="timed steps for runs with T >= 512 (default 2)")
    ap.add_argument("--matmul", default=None, help="fp32 matmul engine: dnnl, blas or tiled (default: llmctl's)")
    ap.add_argument("--bf16-emulate", action="store_true", help="run llmctl bf16 even without native bf16")
    ap.add_argument("--compare-engine", default=None,
                    help="also run llmctl fp32 on this matmul engine (e.g. blas: the engine before oneDNN)")
    ap.add_argument("--compare-bf16-engine", default=None,
                    help="also run llmctl bf16 on this bf16 matmul engine (e.g. dnnl_gemm: oneDNN's gemm call, "
                         "the engine before the matmul primitive)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS child processes")
    ap.add_argument("--rss-seq", type=int, default=1024, help="T for the big RSS run (default 1024)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--recompute", type=int, default=None,
                    help="-r level of llmctl's timed runs (default: the model's own choice)")
    ap.add_argument("--rss-recompute", default="3",
                    help="also measure the big bf16 RSS run at these -r levels, comma-separated "
                         "(default 3: llmctl's level that trades step time for memory, bf16's own "
                         "choice at d12 B=4 T=1024 and larger; '' for none)")
    ap.add_argument("--_rss-child", nargs=7, help=argparse.SUPPRESS)
    ap.add_argument("--_roof-child", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._rss_child:
        return _rss_child_main(*a._rss_child)
    if a._roof_child:
        return _roof_child_main(*a._roof_child)

    from llmctl._ext import matmul as K
    from llmctl.threads import configure_threads
    from llmctl.mfu import mfu_roof_precision

    if a.bf16_emulate:
        os.environ["LLMCTL_BF16_EMULATE"] = "1"
    n = configure_threads(a.threads)
    precisions = [p for p in a.precisions.split(",") if p]
    skipped = []
    if "bf16" in precisions and not K.bf16_native() and not a.bf16_emulate:
        precisions.remove("bf16")
        skipped.append("llmctl bf16: this CPU has no native bf16 (AVX512_BF16/AMX); --bf16-emulate runs it anyway")
    # PyTorch's bf16 autocast is the yardstick of llmctl's bf16 only: without native bf16 its GEMMs
    # fall back to a scalar loop that takes hours at T=1024 and say nothing about a target
    torch_precisions = ["fp32"] + (["bf16"] if "bf16" in precisions and K.bf16_native() else [])
    if "bf16" not in torch_precisions and not a.no_torch:
        skipped.append("torch bf16 autocast: run only beside llmctl bf16 on a CPU with native bf16")
    # MFU is over the roof of the precision the GEMMs multiply in: emulated bf16's are fp32 sgemm
    roof_of = {p: mfu_roof_precision(p) for p in {"fp32", *precisions}}
    roofs = {p: gemm_roof_gflops(n, p) for p in sorted(set(roof_of.values()), reverse=True)}
    peak_np = gemm_peak_gflops(n)
    out = {"threads": n, "engine": K.default_engine(), "bf16_native": K.bf16_native(),
           "cpu_bf16": list(K.cpu_bf16_features()), "gemm_roof_gflops": roofs, "mfu_roof": roof_of,
           "roof": {p: max(roofs[q].values()) for p, q in roof_of.items()}, "numpy_1024_gflops": peak_np,
           "load_avg_start": os.getloadavg(), "runs": [], "torch": [], "rss": [], "skipped": skipped}
    def progress(what, r):   # on stderr as each run ends: a long run can be followed, or cut short
        print(f"[{time.strftime('%H:%M:%S')}] {what}: {r['step_s'] * 1e3:.1f} ms/step", file=sys.stderr, flush=True)

    for desc, B, T in _parse_runs(a.runs):
        steps = a.big_steps if T >= 512 else a.steps
        for prec in precisions:
            r = bench_llmctl(desc, B, T, n, steps, a.matmul, prec, roof=roof_of[prec], recompute=a.recompute)
            r["mfu"] = r["flops_per_step"] / r["step_s"] / 1e9 / out["roof"][prec]
            out["runs"].append(r)
            progress(f"{desc} {B}x{T} llmctl {prec}", r)
        if a.compare_engine:
            r = bench_llmctl(desc, B, T, n, steps, a.compare_engine, "fp32")
            r["mfu"] = r["flops_per_step"] / r["step_s"] / 1e9 / out["roof"]["fp32"]
            r["engine"], r["precision"] = a.compare_engine, "fp32 " + a.compare_engine
            out["runs"].append(r)
            progress(f"{desc} {B}x{T} llmctl fp32 {a.compare_engine}", r)
        if a.compare_bf16_engine and "bf16" in precisions:
            r = bench_llmctl(desc, B, T, n, steps, a.compare_bf16_engine, "bf16")
            r["mfu"] = r["flops_per_step"] / r["step_s"] / 1e9 / out["roof"]["bf16"]
            r["engine"], r["precision"] = a.compare_bf16_engine, "bf16 " + a.compare_bf16_engine
            out["runs"].append(r)
            progress(f"{desc} {B}x{T} llmctl bf16 {a.compare_bf16_engine}", r)
        if not a.no_torch:
            for prec in torch_precisions:
                tr = bench_torch(desc, B, T, n, steps, prec)
                if tr:
                    tr["flops_per_step"] = out["runs"][-1]["flops_per_step"]
                    out["torch"].append(tr)
                    progress(f"{desc} {B}x{T} torch {prec}", tr)
    if not a.no_rss:
        for prec in precisions:
            extra = [lv for lv in a.rss_recompute.split(",") if lv.strip()] if prec == "bf16" else []
            for T, lv in [(64, "auto"), (a.rss_seq, "auto")] + [(a.rss_seq, lv.strip()) for lv in extra]:
                b, how = rss_child("d12", 4, T, n, a.matmul, prec, lv)
                out["rss"].append({"model": "d12", "B": 4, "T": T, "precision": prec, "recompute": lv,
                                   "peak_rss_bytes": b, "how": how})
    out["load_avg_end"] = os.getloadavg()
    if a.json:
        print(json.dumps(out, indent=1, default=float))
        return
    print(f"threads {n}; fp32 GEMM engine {out['engine']}; native bf16: {out['bf16_native']} "
          f"({', '.join(out['cpu_bf16']) or 'no AVX512_BF16/AMX'}); load avg {out['load_avg_start'][0]:.2f} "
          f"at start, {out['load_avg_end'][0]:.2f} at end")
    for p, r in roofs.items():
        print(f"GEMM roof {p} (llmctl matmul, d12 shapes at B*T=256): {max(r.values()):.1f} GFLOP/s = max of "
              + ", ".join(f"{k} {v:.0f}" for k, v in r.items()))
    if roof_of.get("bf16") == "fp32":
        print("MFU of llmctl bf16 is over the fp32 roof: emulated bf16 multiplies in fp32 sgemm")
    print(f"NumPy 1024^3 sgemm: {peak_np:.1f} GFLOP/s")
    for line in skipped:
        print("skipped: " + line)
    print("ms/step is the best of the timed steps (the least disturbed by other processes); median in brackets")
    print("MFU: the best step against the roof above; MFU adj: the median over the steps of each against the "
          "higher roof sampled just before and after it, at B*T=256 and at the run's B*T (lm head <= 1024 rows); "
          "MFU ref: the same pairing against the reference roof, the best of six GEMMs M x K x N ("
          + ", ".join("x".join(map(str, sh)) for sh in REFERENCE_SHAPES) + "; fp32: NumPy or llmctl)")
    print(f"{'run':16s} {'impl':18s} {'ms/step':>9s} {'(median)':>9s} {'tok/s':>8s} {'GFLOP/s':>8s} {'MFU':>6s} "
          f"{'MFU adj':>7s} {'MFU ref':>7s} {'non-mm':>6s}")
    for desc, B, T in _parse_runs(a.runs):
        tag = f"{desc} {B}x{T}"
        rows = [r for r in out["runs"] if (r["model"], r["B"], r["T"]) == (desc, B, T)]
        trs = [t for t in out["torch"] if (t["model"], t["B"], t["T"]) == (desc, B, T)]
        for r in rows:
            gf = r["flops_per_step"] / r["step_s"] / 1e9
            print(f"{tag:16s} {'llmctl ' + r['precision']:18s} {r['step_s'] * 1e3:9.1f} {r['median_s'] * 1e3:9.1f} "
                  f"{B * T / r['step_s']:8.1f} {gf:8.1f} {100 * r['mfu']:5.1f}% "
                  + (f"{100 * r['mfu_adjacent']:6.1f}%" if r.get("mfu_adjacent") else f"{'':7s}")
                  + (f" {100 * r['mfu_reference']:6.1f}%" if r.get("mfu_reference") else f" {'':7s}")
                  + f" {100 * r['non_matmul_share']:5.1f}%")
        for t in trs:
            gf = t["flops_per_step"] / t["step_s"] / 1e9
            name = "torch eager fp32" if t["precision"] == "fp32" else "torch autocast bf16"
            print(f"{tag:16s} {name:18s} {t['step_s'] * 1e3:9.1f} {t['median_s'] * 1e3:9.1f} {B * T / t['step_s']:8.1f} {gf:8.1f}")
        by = {r["precision"]: r["step_s"] for r in rows}
        by.update({"torch " + t["precision"]: t["step_s"] for t in trs})
        if "bf16" in by and "fp32" in by:
            print(f"{tag:16s} ratios: llmctl bf16 / llmctl fp32 = {by['bf16'] / by['fp32']:.2f}x"
                  + (f", llmctl bf16 / torch bf16 = {by['bf16'] / by['torch bf16']:.2f}x" if "torch bf16" in by else ""))
        if a.compare_engine and "fp32" in by:
            print(f"{tag:16s} ratios: llmctl fp32 {out['engine']} / llmctl fp32 {a.compare_engine} = "
                  f"{by['fp32'] / by['fp32 ' + a.compare_engine]:.2f}x")
        if a.compare_bf16_engine and "bf16" in by:
            print(f"{tag:16s} ratios: llmctl bf16 default / llmctl bf16 {a.compare_bf16_engine} = "
                  f"{by['bf16'] / by['bf16 ' + a.compare_bf16_engine]:.2f}x")
        if "fp32" in by and "torch fp32" in by:
            print(f"{tag:16s} ratios: torch fp32 / llmctl fp32 = {by['torch fp32'] / by['fp32']:.2f}x"
                  + (f", torch bf16 / llmctl fp32 = {by['torch bf16'] / by['fp32']:.2f}x" if "torch bf16" in by else ""))
    for r in out["runs"]:
        tot = r["breakdown_total_s"]
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms ({100 * v / tot:.0f}%)" for k, v in
                          sorted(r["breakdown_s"].items(), key=lambda kv: -kv[1]))
        print(f"{r['model']} {r['B']}x{r['T']} {r['precision']} breakdown of one step ({tot * 1e3:.0f} ms; "
              f"non-matmul {100 * r['non_matmul_share']:.0f}%): {parts}")
        if r.get("roof_adjacent_gflops"):
            print("   roof beside the steps (GFLOP/s, in order): "
                  + ", ".join(f"{g:.1f}" for g in r["roof_adjacent_gflops"])
                  + "; MFU per step: " + ", ".join(f"{100 * v:.1f}%" for v in r["mfu_adjacent_all"]))
            print("   reference roof beside the steps: " + ", ".join(f"{g:.1f}" for g in r["roof_reference_gflops"])
                  + "; MFU ref per step: " + ", ".join(f"{100 * v:.1f}%" for v in r["mfu_reference_all"]))
        if r.get("matmul_gflops"):
            # against the roof the MFU column uses: the highest sampled beside the steps, else the start roof
            adj = r.get("roof_adjacent_gflops")
            ref, which = (max(adj), "the highest roof beside the steps") if adj else (out["roof"].get(r["precision"]), "the roof")
            line = f"   matmuls: {r['matmul_flops_per_step'] / 1e12:.2f} TFLOP at {r['matmul_gflops']:.1f} GFLOP/s"
            if ref:
                line += (f" = {100 * r['matmul_gflops'] / ref:.1f}% of {which} ({ref:.1f}): the MFU of a step whose"
                         " every FLOP ran at the matmuls' rate and nothing else took time")
            print(line)
        top = list(r["kernel_calls_s"].items())[:8]
        print("   top kernels: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in top))
    if not out["torch"] and not a.no_torch:
        print("torch not importable: no PyTorch comparison")
    for r in out["rss"]:
        lv = r.get("recompute", "auto")
        print(f"peak RSS d12 B={r['B']} T={r['T']} {r['precision']}{'' if lv == 'auto' else ' -r ' + lv} "
              f"training steps: {r['peak_rss_bytes'] / 2**30:.2f} GiB ({r['how']})")


if __name__ == "__main__":
    main()
