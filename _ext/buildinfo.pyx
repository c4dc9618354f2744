"""How the kernels were built: whether OpenMP is in, and how many threads it would use."""
from _openmp cimport LLMCTL_HAVE_OPENMP, omp_get_max_threads


def openmp_enabled():
    """True when the extensions were compiled with OpenMP (prange runs in parallel)."""
    return bool(LLMCTL_HAVE_OPENMP)


def openmp_max_threads():
    """omp_get_max_threads(): the default team size (1 in a serial build)."""
    return omp_get_max_threads()
