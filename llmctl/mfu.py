"""MFU's two measured numbers: the FLOPs of a step (llm.c's estimate) and this CPU's GEMM FLOP/s.

What it is: `flops_per_token` (llm.c's gpt2_estimate_mfu count), `mfu_roof_precision` (which
precision's GEMMs a run really multiplies in) and `measure_peak_flops` (a timed 1024^3 GEMM in that
precision, cached per process). The best measurement ever seen on this CPU is kept across runs by
llmctl/roof.py.
What it is not: the cache of roofs (llmctl/roof.py) or when a run measures again (the train loop:
a step faster than the roof was timed against a busier machine).
"""
import contextlib
import math
import time

import numpy as np

_PEAK_CACHE = {}


def mfu_roof_precision(precision):
    """The precision whose GEMM roof a run in `precision` is measured against: "bf16" only where
    the CPU multiplies bf16 natively (oneDNN's matmul primitive); emulated bf16
    (LLMCTL_BF16_EMULATE=1 without native bf16) widens the operands and multiplies in fp32
    sgemm, so its honest roof is fp32's."""
    from llmctl._ext import matmul

    return "bf16" if precision == "bf16" and matmul.bf16_native() else "fp32"


def measure_peak_flops(n_threads, precision="fp32", again=False):
    """GEMM FLOP/s of this machine, the denominator of MFU: best of 3 1024^3 GEMMs at n_threads
    (~0.1 s), in the precision the run's matmuls really multiply in (mfu_roof_precision):
    fp32 -> NumPy sgemm; native bf16 -> llmctl's own bf16 matmul (matmul_forward_bf16 on the
    "dnnl" engine: bf16 inputs, fp32 accumulation); emulated bf16 -> the fp32 roof, since its
    GEMMs run in fp32. Cached per (threads, roof precision); again=True measures anew and keeps
    the best of all measurements (one taken while other processes held the cores reads low)."""
    roof = mfu_roof_precision(precision)
    key = (n_threads, roof)
    if key in _PEAK_CACHE and not again:
        return _PEAK_CACHE[key]
    rs = np.random.default_rng(0)
    a = rs.standard_normal((1024, 1024), dtype=np.float32)
    b = rs.standard_normal((1024, 1024), dtype=np.float32)
    if roof == "bf16":
        from llmctl._ext import convert, matmul

        a16, b16 = np.empty(a.size, np.uint16), np.empty(b.size, np.uint16)
        convert.cast_to_bf16(a16, a.reshape(-1), n_threads)
        convert.cast_to_bf16(b16, b.reshape(-1), n_threads)
        out = np.empty(a.size, np.float32)

        def gemm():
            matmul.matmul_forward_bf16(out, a16, b16, None, 1024, 1024, 1024, n_threads, "dnnl")
        limits = contextlib.nullcontext()
    else:
        from threadpoolctl import threadpool_limits

        def gemm():
            a @ b
        limits = threadpool_limits(limits=n_threads, user_api="blas")
    with limits:
        gemm()
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            gemm()
            best = min(best, time.perf_counter() - t0)
    _PEAK_CACHE[key] = max(2.0 * 1024 ** 3 / best, _PEAK_CACHE.get(key, 0.0))
    return _PEAK_CACHE[key]


def flops_per_token(num_parameters, L, C, T):
    """llm.c gpt2_estimate_mfu: 6N for the matmuls + 6*L*C*T for attention (fwd + bwd)."""
    return 6 * num_parameters + 6 * L * C * T
