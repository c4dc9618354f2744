"""llmctl: prepare data for, train, evaluate and sample GPT-2 on CPUs, byte-compatible with llm.c."""
import os as _os


def _onednn_installed():
    """True when the onednn-cpu-gomp wheel (matmul's default engine, on libgomp) is installed and
    not switched off (LLMCTL_NO_DNNL, as matmul reads it)."""
    from importlib import metadata

    if _os.environ.get("LLMCTL_NO_DNNL", "").strip().lower() not in ("", "0", "false", "no"):
        return False

    try:
        metadata.distribution("onednn-cpu-gomp")
    except metadata.PackageNotFoundError:
        return False
    return True


def _openmp_wait_default():
    """How long an idle OpenMP thread busy-waits before it sleeps, unless the user said.

    On oneDNN every kernel and GEMM runs on libgomp's one pool; a thread that sleeps between two
    parallel regions costs a futex wake-up per region, which a decode step (about 50 short regions)
    pays on every token: 1e6 spins, a few ms, took d12 bf16 sampling from 56 to 86 tokens/s and a
    d12 T=64 bf16 step from 533 to 425 ms (docs/performance.md). On the scipy BLAS engine a second
    pool, OpenBLAS's, takes turns with libgomp on the same cores, and a spinning OpenMP thread steals
    its core: there libgomp sleeps at once. Read once, when libgomp loads: so it is set here, before
    any kernel, and a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
    -> "spin", "passive" or None (the user's settings stand). A process started by llmctl (a
    rank) inherits its parent's choice, marked in OPENMP_WAIT_MARK."""
    inherited = _os.environ.get(OPENMP_WAIT_MARK)
    if inherited in ("spin", "passive"):
        return inherited
    if "OMP_WAIT_POLICY" in _os.environ or "GOMP_SPINCOUNT" in _os.environ:
        return None
    if _onednn_installed():
        _os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT_DEFAULT
        kind = "spin"
    else:
        _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        kind = "passive"
    _os.environ[OPENMP_WAIT_MARK] = kind
    return kind


GOMP_SPINCOUNT_DEFAULT = "1000000"
OPENMP_WAIT_MARK = "LLMCTL_OPENMP_WAIT"
OPENMP_WAIT = _openmp_wait_default()
# OpenBLAS's threads spin for 2^28 cycles after an sgemm by default (docs/performance.md)
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

__version__ = "0.1.0"
