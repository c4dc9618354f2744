# The OpenMP shim (scikit-learn's _openmp_helpers pattern): with OpenMP these are the real
# omp_* calls; in a serial build (no -fopenmp, so _OPENMP undefined) they are stubs and every
# `prange` compiles to a plain loop.
cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define LLMCTL_HAVE_OPENMP 1
    #else
    #define LLMCTL_HAVE_OPENMP 0
    static inline int omp_get_max_threads(void) { return 1; }
    static inline int omp_get_thread_num(void) { return 0; }
    static inline int omp_get_num_threads(void) { return 1; }
    static inline void omp_set_num_threads(int n) { (void)n; }
    #endif
    """
    const int LLMCTL_HAVE_OPENMP
    int omp_get_max_threads() noexcept nogil
    int omp_get_thread_num() noexcept nogil
    int omp_get_num_threads() noexcept nogil
    void omp_set_num_threads(int n) noexcept nogil
