"""What this llmctl build and process will use: version, OpenMP, threads, BLAS."""
import os

from llmctl import __version__


def usable_cores():
    """Cores this process may run on (its CPU affinity mask; else all the machine's cores)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_threads():
    """Threads a kernel uses unless told otherwise: OMP_NUM_THREADS, else the usable cores."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return usable_cores()


def runtime_info():
    from llmctl._ext import buildinfo

    info = {
        "version": __version__,
        "openmp": buildinfo.openmp_enabled(),
        "threads": default_threads(),
        "blas": None,
    }
    try:
        from threadpoolctl import threadpool_info
        import scipy.linalg  # noqa: F401  (loads the BLAS the kernels call)

        for lib in threadpool_info():
            if lib.get("user_api") == "blas" and "scipy" in lib.get("filepath", "") and "openblas64" not in lib.get("filepath", ""):
                info["blas"] = f"{lib['internal_api']} {lib['version']} ({lib.get('architecture')})"
                break
    except Exception:  # BLAS introspection is informational only
        pass
    return info


def format_info(info):
    return (f"llmctl {info['version']}\n"
            f"OpenMP: {'yes' if info['openmp'] else 'NO (serial build)'}, threads: {info['threads']}\n"
            f"BLAS: {info['blas'] or 'unknown'}")
