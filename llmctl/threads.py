"""One thread count for both of llmctl's thread pools: OpenMP kernels and scipy's OpenBLAS.

The Cython kernels take `n_threads` explicitly (prange num_threads=n); matmul's "blas" backend
calls sgemm from scipy.linalg.cython_blas, whose OpenBLAS keeps its own pthread pool. If the two
pools disagree (OpenBLAS defaults to every core) they oversubscribe the cores. So:

    n = configure_threads(n)   # once, at start-up: resolves n, sets every BLAS pool to n,
                               # and lets matmul keep scipy's OpenBLAS at its n_threads per call

`resolve_threads(n)` is the sklearn `_openmp_effective_n_threads` role: None/0 -> the default
(OMP_NUM_THREADS, else the usable cores); negative n counts back from the core count (-1 = all).
`blas_threads(n)` is a context manager for temporary limits (benchmarks, tests).

What it is not: process-level parallelism (llmctl.distributed) or OpenMP runtime configuration.
"""
import contextlib
import ctypes
import os

from llmctl.errors import ConfigError
from llmctl.info import default_threads, usable_cores

_state = {"registered": False}


def resolve_threads(n=None):
    """Thread count to use: n >= 1 as given; None or 0 -> default_threads(); n < 0 -> cores + 1 + n."""
    if n is None or n == 0:
        return default_threads()
    try:
        n = int(n)
    except (TypeError, ValueError):
        raise ConfigError(f"threads must be an integer, got {n!r}", hint="pass e.g. --threads 2") from None
    if n < 0:
        cores = usable_cores()
        if cores + 1 + n < 1:
            raise ConfigError(f"threads {n} leaves no cores to run on",
                              hint=f"this machine has {cores} usable cores; use -1 for all of them")
        n = cores + 1 + n
    return n


OVERSUBSCRIBE_LIMIT = 4  # processes x threads beyond this many per usable core is a typo, not a plan


def oversubscribe_cap():
    """The most threads (over all processes) llmctl runs: OVERSUBSCRIBE_LIMIT x the usable cores."""
    return OVERSUBSCRIBE_LIMIT * usable_cores()


def check_oversubscription(nproc, threads, what="--nproc x --threads"):
    """ConfigError if `nproc` processes of `threads` threads each exceed oversubscribe_cap()
    (e.g. --threads 100000 on 2 cores): such runs crawl or exhaust memory."""
    cores = usable_cores()
    total = int(nproc) * int(threads)
    if total > oversubscribe_cap():
        said = f"{what} {threads}" if int(nproc) == 1 else f"{what} = {nproc} x {threads} = {total} threads"
        raise ConfigError(f"{said}: too many for {cores} usable cores "
                          f"(at most {OVERSUBSCRIBE_LIMIT * cores} in total)",
                          hint=f"use --threads 0 (the default: a good count) or at most {cores} "
                               "threads in total")
    return total


def check_threads(threads, nproc=1):
    """A command's --threads (0 = the default) for nproc processes on this host, checked:
    ConfigError if nproc x threads is over oversubscribe_cap()."""
    per = resolve_threads(threads) if threads else (resolve_threads(None) if nproc == 1
                                                     else max(1, usable_cores() // nproc))
    check_oversubscription(nproc, per, "--nproc x --threads" if nproc > 1 else "--threads")


def _blas_controllers():
    """threadpoolctl controllers of the BLAS libraries loaded after importing scipy's cython_blas."""
    import scipy.linalg.cython_blas  # noqa: F401  (loads the OpenBLAS that matmul's sgemm uses)
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas").lib_controllers


def _scipy_blas_controller(controllers):
    """The controller for scipy's own BLAS (not numpy's ILP64 copy); None if not identifiable."""
    scipy_ones = [c for c in controllers if "scipy" in os.path.basename(os.path.dirname(c.filepath))
                  or os.sep + "scipy" + os.sep in c.filepath]
    if len(scipy_ones) == 1:
        return scipy_ones[0]
    lp64 = [c for c in controllers if "64_" not in os.path.basename(c.filepath)]
    return lp64[0] if len(lp64) == 1 else None


def _register_with_matmul(ctrl):
    """Hand matmul the C addresses of ctrl's get/set_num_threads (OpenBLAS only)."""
    from llmctl._ext import matmul

    get_addr = set_addr = 0
    if ctrl is not None and getattr(ctrl, "internal_api", "") == "openblas":
        lib = ctrl.dynlib
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("", "64_"):
                try:
                    g = getattr(lib, f"{prefix}_get_num_threads{suffix}")
                    s = getattr(lib, f"{prefix}_set_num_threads{suffix}")
                except AttributeError:
                    continue
                get_addr = ctypes.cast(g, ctypes.c_void_p).value or 0
                set_addr = ctypes.cast(s, ctypes.c_void_p).value or 0
                break
            if get_addr:
                break
    matmul.register_blas_thread_functions(get_addr, set_addr)
    return bool(get_addr)


def configure_threads(n=None):
    """Resolve n, set every BLAS pool to n threads, and let matmul pin scipy's OpenBLAS per call.

    Returns the resolved n, which callers pass as `n_threads` to every kernel.
    """
    n = resolve_threads(n)
    try:
        controllers = _blas_controllers()
    except Exception:  # no threadpoolctl/scipy BLAS introspection: kernels still work
        controllers = []
    for c in controllers:
        c.set_num_threads(n)
    if not _state["registered"]:
        _state["registered"] = _register_with_matmul(_scipy_blas_controller(controllers))
    return n


def blas_thread_info():
    """[(filepath, num_threads)] for every loaded BLAS library (diagnostics)."""
    return [(c.filepath, c.num_threads) for c in _blas_controllers()]


@contextlib.contextmanager
def blas_threads(n):
    """Temporarily limit every BLAS pool to n threads (threadpoolctl), restoring on exit."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=resolve_threads(n), user_api="blas"):
        yield
