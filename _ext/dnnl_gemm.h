/* oneDNN's two GEMM entry points, as llmctl's matmul calls them.
 *
 * Built with LLMCTL_DNNL_BUILD=1 (setup.py found the onednn wheels and linked libdnnl.so.3):
 * thin wrappers over dnnl_sgemm and dnnl_gemm_bf16bf16f32, both row-major and BLAS-like
 * (C = alpha op(A) op(B) + beta C). dnnl_gemm_bf16bf16f32 is exported by libdnnl but not in
 * its public header, so it is declared here with oneDNN's own signature (src/common/gemm.cpp).
 * Without oneDNN every wrapper returns -1 and matmul uses scipy's BLAS instead.
 *
 * The OpenMP build of oneDNN runs a GEMM on omp_get_max_threads() threads of the same libgomp
 * team as llmctl's prange loops, so the caller sets that count before each call.
 */
#ifndef LLMCTL_DNNL_GEMM_H
#define LLMCTL_DNNL_GEMM_H
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
/* bit 0: AVX512_BF16 (CPUID.(7,1):EAX[5]); bit 1: AMX-BF16 (CPUID.(7,0):EDX[22]). Each counts
   only when the OS saves the registers it needs (XCR0: SSE/AVX/AVX-512 state bits 1,2,5-7;
   AMX tile state bits 17-18 as well). */
static inline int llmctl_cpu_bf16_flags(void) {
    unsigned a, b, c, d, flags = 0;
    if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !(c & (1u << 27))) return 0;  /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 0xE6u) != 0xE6u) return 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) && (lo & 0x60000u) == 0x60000u)
        flags |= 2u;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5))) flags |= 1u;
    return (int)flags;
}
#else
static inline int llmctl_cpu_bf16_flags(void) { return 0; }
#endif

#if LLMCTL_DNNL_BUILD
#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>
#include <signal.h>
#ifdef _OPENMP
#include <omp.h>
#define LLMCTL_DNNL_THREADS(n) do { if (omp_get_max_threads() != (n)) omp_set_num_threads(n); } while (0)
#else
#define LLMCTL_DNNL_THREADS(n) do { (void)(n); } while (0)
#endif

/* Signals and oneDNN's GEMM threads.
 *
 * oneDNN's "nocopy" sgemm kernels (jit_avx_gemm_f32, jit_avx512_common_gemm_f32) point the stack
 * pointer at the start of a heap workspace while they run, whenever K is larger than what fits
 * on their own stack (`mov(rsp, ARG_WS)`, K > 84). A signal handled on that thread then has its
 * frame pushed below the workspace: over malloc's chunk header and the allocation before it.
 * Python's handlers (Ctrl-C, a profiler, SIGUSR1, ...) run their C part on the thread's stack,
 * so a Ctrl-C during training could write NaNs into the weights or abort the process with
 * "corrupted size vs. prev_size".
 *
 * So no asynchronous signal is handled on a thread while it may be inside oneDNN: the caller
 * blocks them for the call (a pending one is handled when the call returns, on the normal
 * stack), and every OpenMP worker blocks them for good the first time it serves a GEMM
 * (threads the pool creates during the call inherit the caller's blocked mask). Python handles
 * signals on the main thread only, so the workers lose nothing. The faults a thread raises
 * itself (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS, SIGABRT) are never blocked. */
static inline void llmctl_async_signals(sigset_t* s) {
    sigfillset(s);
    sigdelset(s, SIGSEGV); sigdelset(s, SIGBUS); sigdelset(s, SIGFPE); sigdelset(s, SIGILL);
    sigdelset(s, SIGTRAP); sigdelset(s, SIGSYS); sigdelset(s, SIGABRT);
}

static __thread int llmctl_worker_signals_blocked = 0;

static inline void llmctl_block_signals(sigset_t* old, int n_threads) {
    sigset_t s;
    llmctl_async_signals(&s);
    pthread_sigmask(SIG_BLOCK, &s, old);
#ifdef _OPENMP
    if (n_threads > 1 && !omp_in_parallel()) {
        /* the same team size as the GEMM's parallel region, so the same pool threads */
        #pragma omp parallel num_threads(n_threads)
        {
            if (omp_get_thread_num() != 0 && !llmctl_worker_signals_blocked) {
                sigset_t w;
                llmctl_async_signals(&w);
                pthread_sigmask(SIG_BLOCK, &w, NULL);
                llmctl_worker_signals_blocked = 1;
            }
        }
    }
#else
    (void)n_threads;
#endif
}

static inline void llmctl_restore_signals(const sigset_t* old) {
    pthread_sigmask(SIG_SETMASK, old, NULL);
}

dnnl_status_t DNNL_API dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M,
        dnnl_dim_t N, dnnl_dim_t K, float alpha, const uint16_t *A, dnnl_dim_t lda,
        const uint16_t *B, dnnl_dim_t ldb, float beta, float *C, dnnl_dim_t ldc);

static inline int llmctl_dnnl_sgemm(char ta, char tb, int64_t M, int64_t N, int64_t K,
        const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
        int64_t ldc, int n_threads) {
    sigset_t old;
    LLMCTL_DNNL_THREADS(n_threads);
    llmctl_block_signals(&old, n_threads);
    int st = (int)dnnl_sgemm(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
    llmctl_restore_signals(&old);
    return st;
}

static inline int llmctl_dnnl_gemm_bf16(char ta, char tb, int64_t M, int64_t N, int64_t K,
        const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C,
        int64_t ldc, int n_threads) {
    sigset_t old;
    LLMCTL_DNNL_THREADS(n_threads);
    llmctl_block_signals(&old, n_threads);
    int st = (int)dnnl_gemm_bf16bf16f32(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
    llmctl_restore_signals(&old);
    return st;
}

static inline void llmctl_dnnl_version(int* v) {
    const dnnl_version_t* d = dnnl_version();
    v[0] = d->major; v[1] = d->minor; v[2] = d->patch;
}
#else
static inline int llmctl_dnnl_sgemm(char ta, char tb, int64_t M, int64_t N, int64_t K,
        const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
        int64_t ldc, int n_threads) { return -1; }
static inline int llmctl_dnnl_gemm_bf16(char ta, char tb, int64_t M, int64_t N, int64_t K,
        const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C,
        int64_t ldc, int n_threads) { return -1; }
static inline void llmctl_dnnl_version(int* v) { v[0] = v[1] = v[2] = 0; }
#endif
#endif
