"""How the kernels were built: whether OpenMP is in, and how many threads it would use."""
from _openmp cimport LLMCTL_HAVE_OPENMP, omp_get_max_threads

cdef extern from *:
    """
    #ifdef LLMCTL_SIMDE_AVX512
    #define LLMCTL_SIMDE_BUILD 1
    #else
    #define LLMCTL_SIMDE_BUILD 0
    #endif
    #ifdef LLMCTL_NO_AVX_DISPATCH
    #define LLMCTL_PORTABLE_BUILD 1
    #else
    #define LLMCTL_PORTABLE_BUILD 0
    #endif
    """
    int LLMCTL_SIMDE_BUILD
    int LLMCTL_PORTABLE_BUILD


def openmp_enabled():
    """True when the extensions were compiled with OpenMP (prange runs in parallel)."""
    return bool(LLMCTL_HAVE_OPENMP)


def openmp_max_threads():
    """omp_get_max_threads(): the default team size (1 in a serial build)."""
    return omp_get_max_threads()


def simde_avx512():
    """True for the test build of the kernels (setup.py with LLMCTL_SIMDE_AVX512=1): their AVX-512
    copies run on SIMDe's portable intrinsics, on CPUs without AVX-512, slowly. Never a release."""
    return bool(LLMCTL_SIMDE_BUILD)


def portable():
    """True for the test build of the kernels in their portable C only (setup.py with
    LLMCTL_PORTABLE=1): no x86 copies, the scalar attention set, as a compiler without GCC's
    vector types and target attributes would build them. Never a release."""
    return bool(LLMCTL_PORTABLE_BUILD)
