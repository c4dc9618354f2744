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
#ifdef LLMCTL_SIMDE_AVX512
    return 3;   /* the SIMDe test build (simde_avx512.h): AVX512_BF16 and AMX emulated */
#endif
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
#include <string.h>
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

/* C (M,N) = [bias (N) +] A (M,K) @ B (N,K)^T, the fp32 forward, with the rows cut into one even
 * block a thread and each block one single-threaded dnnl_sgemm: on 2 Zen 4 cores oneDNN's own
 * 2-thread call ran d12's products at 136-201 GFLOP/s from 256 to 1280 rows, the blocks at
 * 172-219 (docs/performance.md). oneDNN's AVX-512 sgemm gives an output row the same bits in any
 * call of 16 rows or more (matmul.pyx gives each block at least 64), so a row has the bits of
 * one single-threaded call over all the rows. Its AVX2 sgemm does not (a row's bits depend on the
 * call's row count), so matmul.pyx splits only where llmctl_dnnl_split_rows_exact() says so.
 * The caller's OpenMP thread count stays n_threads. */
static inline int llmctl_dnnl_split_rows_exact(void) {
    return (dnnl_get_effective_cpu_isa() & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core;
}

static inline int llmctl_dnnl_sgemm_rows(int64_t M, int64_t N, int64_t K, const float* A,
        const float* B, const float* bias, float* C, int n_threads) {
    sigset_t old;
    int bad = 0;
    const float beta = bias ? 1.0f : 0.0f;
    LLMCTL_DNNL_THREADS(n_threads);
    llmctl_block_signals(&old, n_threads);   /* this thread's, and once each pool thread's */
#ifdef _OPENMP
    #pragma omp parallel num_threads(n_threads) reduction(+ : bad)
#endif
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        omp_set_num_threads(1);   /* this block's sgemm: one thread (this region's ICV only) */
#else
        const int64_t t = 0, nt = 1;
#endif
        const int64_t r0 = t * M / nt, nr = (t + 1) * M / nt - r0;
        float* c = C + r0 * N;
        if (bias)
            for (int64_t r = 0; r < nr; r++) memcpy(c + r * N, bias, (size_t)N * sizeof(float));
        bad += dnnl_sgemm('N', 'T', nr, N, K, 1.0f, A + r0 * K, K, B, K, beta, c, N) != dnnl_success;
    }
    llmctl_restore_signals(&old);
    return bad ? -1 : 0;
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

/* bf16 GEMMs through oneDNN's matmul primitive (on AMX/AVX512_BF16 CPUs its "brg" brgemm
 * implementations), C (M,N) = A (M,K) @ B (K,N) [+ bias (N)] [+ C], both operands in their
 * plain row-major layouts (ta/tb: stored transposed; lda/ldb/ldc the row strides), fp32 C.
 *
 * Why: dnnl_gemm_bf16bf16f32, the BLAS-like call, chooses its blocking and packs both operands
 * on every call; the primitive reads them where they are and, on d12's shapes on 2 AMX cores,
 * runs the forward 1.1-2.3x faster, the backward's products up to 512 rows 1.1-1.6x, but the
 * larger backward products slower (matmul.pyx picks per product; docs/performance.md). Packing the
 * weight once into the primitive's preferred layout (format_tag_any + a reorder) did not pay:
 * the reorder costs more than it saves, and GPT-2's weights change every step.
 *
 * A primitive is built for one (M, N, K, ta, tb, lds, bias, accumulate, threads) and kept in a
 * small LRU cache (creating one takes ~0.5 ms; a training step uses ~20 shapes); the operands
 * are passed at execution. The accumulation (C += ...) is oneDNN's "sum" post-op, the bias its
 * bias argument. A cache mutex serialises the calls (oneDNN's library scratchpad is shared
 * between primitives). Signals are blocked as for the GEMM calls above. */
#define LLMCTL_MM_CACHE 64

typedef struct {
    int64_t M, N, K, lda, ldb, ldc;
    int ta, tb, bias, acc, threads, cbf16;
    unsigned long long used;     /* 0: free slot */
    dnnl_primitive_t prim;
    dnnl_memory_t a, b, c, bs;
} llmctl_mm_entry;

static llmctl_mm_entry llmctl_mm_cache[LLMCTL_MM_CACHE];
static unsigned long long llmctl_mm_clock = 0;
static pthread_mutex_t llmctl_mm_lock = PTHREAD_MUTEX_INITIALIZER;
static dnnl_engine_t llmctl_mm_engine = NULL;
static dnnl_stream_t llmctl_mm_stream = NULL;
static long llmctl_mm_builds = 0;   /* primitives built since load (tests read it) */

static void llmctl_mm_free(llmctl_mm_entry* e) {
    if (e->prim) dnnl_primitive_destroy(e->prim);
    if (e->a) dnnl_memory_destroy(e->a);
    if (e->b) dnnl_memory_destroy(e->b);
    if (e->c) dnnl_memory_destroy(e->c);
    if (e->bs) dnnl_memory_destroy(e->bs);
    memset(e, 0, sizeof(*e));
}

/* logical (r,c) matrix, row stride ld; trans: stored as its transpose (c,r) */
static dnnl_status_t llmctl_mm_md(dnnl_memory_desc_t* md, int64_t r, int64_t c, int64_t ld,
                                  int trans, dnnl_data_type_t dt) {
    dnnl_dims_t dims = {r, c};
    dnnl_dims_t strides = {trans ? 1 : ld, trans ? ld : 1};
    return dnnl_memory_desc_create_with_strides(md, 2, dims, dt, strides);
}

static dnnl_status_t llmctl_mm_build(llmctl_mm_entry* e) {
    dnnl_memory_desc_t a = NULL, b = NULL, c = NULL, bs = NULL;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_status_t st = dnnl_success;
    if (!llmctl_mm_engine) {
        st = dnnl_engine_create(&llmctl_mm_engine, dnnl_cpu, 0);
        if (st == dnnl_success) st = dnnl_stream_create(&llmctl_mm_stream, llmctl_mm_engine,
                                                        dnnl_stream_default_flags);
        if (st != dnnl_success) return st;
    }
#define LLMCTL_TRY(x) do { if (st == dnnl_success) st = (x); } while (0)
    LLMCTL_TRY(llmctl_mm_md(&a, e->M, e->K, e->lda, e->ta, dnnl_bf16));
    LLMCTL_TRY(llmctl_mm_md(&b, e->K, e->N, e->ldb, e->tb, dnnl_bf16));
    LLMCTL_TRY(llmctl_mm_md(&c, e->M, e->N, e->ldc, 0, e->cbf16 ? dnnl_bf16 : dnnl_f32));
    if (e->bias) LLMCTL_TRY(llmctl_mm_md(&bs, 1, e->N, e->N, 0, dnnl_f32));
    LLMCTL_TRY(dnnl_primitive_attr_create(&attr));
    if (e->acc) {
        LLMCTL_TRY(dnnl_post_ops_create(&po));
        LLMCTL_TRY(dnnl_post_ops_append_sum(po, 1.0f, 0, dnnl_data_type_undef));
        LLMCTL_TRY(dnnl_primitive_attr_set_post_ops(attr, po));
    }
    LLMCTL_TRY(dnnl_matmul_primitive_desc_create(&pd, llmctl_mm_engine, a, b, bs, c, attr));
    LLMCTL_TRY(dnnl_primitive_create(&e->prim, pd));
    LLMCTL_TRY(dnnl_memory_create(&e->a, a, llmctl_mm_engine, DNNL_MEMORY_NONE));
    LLMCTL_TRY(dnnl_memory_create(&e->b, b, llmctl_mm_engine, DNNL_MEMORY_NONE));
    LLMCTL_TRY(dnnl_memory_create(&e->c, c, llmctl_mm_engine, DNNL_MEMORY_NONE));
    if (e->bias) LLMCTL_TRY(dnnl_memory_create(&e->bs, bs, llmctl_mm_engine, DNNL_MEMORY_NONE));
#undef LLMCTL_TRY
    if (pd) dnnl_primitive_desc_destroy(pd);
    if (po) dnnl_post_ops_destroy(po);
    if (attr) dnnl_primitive_attr_destroy(attr);
    if (a) dnnl_memory_desc_destroy(a);
    if (b) dnnl_memory_desc_destroy(b);
    if (c) dnnl_memory_desc_destroy(c);
    if (bs) dnnl_memory_desc_destroy(bs);
    if (st == dnnl_success) llmctl_mm_builds++;
    return st;
}

/* the cache entry for this call, built if missing (lock held); NULL if oneDNN failed */
static llmctl_mm_entry* llmctl_mm_get(int64_t M, int64_t N, int64_t K, int ta, int tb,
        int64_t lda, int64_t ldb, int64_t ldc, int bias, int acc, int threads, int cbf16, int* status) {
    llmctl_mm_entry* victim = &llmctl_mm_cache[0];
    for (int i = 0; i < LLMCTL_MM_CACHE; i++) {
        llmctl_mm_entry* e = &llmctl_mm_cache[i];
        if (e->used && e->M == M && e->N == N && e->K == K && e->ta == ta && e->tb == tb
                && e->lda == lda && e->ldb == ldb && e->ldc == ldc && e->bias == bias
                && e->acc == acc && e->threads == threads && e->cbf16 == cbf16) {
            e->used = ++llmctl_mm_clock;
            return e;
        }
        if (e->used < victim->used) victim = e;
    }
    llmctl_mm_free(victim);
    victim->M = M; victim->N = N; victim->K = K; victim->ta = ta; victim->tb = tb;
    victim->lda = lda; victim->ldb = ldb; victim->ldc = ldc; victim->bias = bias;
    victim->acc = acc; victim->threads = threads; victim->cbf16 = cbf16;
    *status = (int)llmctl_mm_build(victim);
    if (*status != 0) { llmctl_mm_free(victim); return NULL; }
    victim->used = ++llmctl_mm_clock;
    return victim;
}

/* C (M,N) = op(A) @ op(B) [+ bias] [+ C if beta == 1]; beta is 0 or 1; C fp32, or bf16 with
   cbf16 (the fp32 result rounded to nearest even by the primitive). Returns 0 or oneDNN's status. */
static inline int llmctl_dnnl_matmul_bf16_dst(char ta, char tb, int64_t M, int64_t N, int64_t K,
        const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, const float* bias,
        float beta, void* C, int64_t ldc, int cbf16, int n_threads) {
    sigset_t old;
    int st = 0, acc = beta != 0.0f;
    LLMCTL_DNNL_THREADS(n_threads);
    llmctl_block_signals(&old, n_threads);
    pthread_mutex_lock(&llmctl_mm_lock);
    llmctl_mm_entry* e = llmctl_mm_get(M, N, K, ta == 'T', tb == 'T', lda, ldb, ldc, bias != NULL,
                                       acc, n_threads, cbf16, &st);
    if (e) {
        dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, e->a}, {DNNL_ARG_WEIGHTS, e->b},
                                   {DNNL_ARG_DST, e->c}, {DNNL_ARG_BIAS, e->bs}};
        st = (int)dnnl_memory_set_data_handle(e->a, (void*)A);
        if (!st) st = (int)dnnl_memory_set_data_handle(e->b, (void*)B);
        if (!st) st = (int)dnnl_memory_set_data_handle(e->c, C);
        if (!st && bias) st = (int)dnnl_memory_set_data_handle(e->bs, (void*)bias);
        if (!st) st = (int)dnnl_primitive_execute(e->prim, llmctl_mm_stream, bias ? 4 : 3, args);
        if (!st) st = (int)dnnl_stream_wait(llmctl_mm_stream);
    }
    pthread_mutex_unlock(&llmctl_mm_lock);
    llmctl_restore_signals(&old);
    return st;
}

static inline int llmctl_dnnl_matmul_bf16(char ta, char tb, int64_t M, int64_t N, int64_t K,
        const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, const float* bias,
        float beta, float* C, int64_t ldc, int n_threads) {
    return llmctl_dnnl_matmul_bf16_dst(ta, tb, M, N, K, A, lda, B, ldb, bias, beta, C, ldc, 0, n_threads);
}

/* primitives built since load */
static inline long llmctl_dnnl_matmul_builds(void) { return llmctl_mm_builds; }

static inline void llmctl_dnnl_version(int* v) {
    const dnnl_version_t* d = dnnl_version();
    v[0] = d->major; v[1] = d->minor; v[2] = d->patch;
}
#else
static inline int llmctl_dnnl_sgemm(char ta, char tb, int64_t M, int64_t N, int64_t K,
        const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
        int64_t ldc, int n_threads) { return -1; }
static inline int llmctl_dnnl_sgemm_rows(int64_t M, int64_t N, int64_t K, const float* A,
        const float* B, const float* bias, float* C, int n_threads) { return -1; }
static inline int llmctl_dnnl_split_rows_exact(void) { return 0; }
static inline int llmctl_dnnl_gemm_bf16(char ta, char tb, int64_t M, int64_t N, int64_t K,
        const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C,
        int64_t ldc, int n_threads) { return -1; }
static inline int llmctl_dnnl_matmul_bf16(char ta, char tb, int64_t M, int64_t N, int64_t K,
        const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, const float* bias,
        float beta, float* C, int64_t ldc, int n_threads) { return -1; }
static inline int llmctl_dnnl_matmul_bf16_dst(char ta, char tb, int64_t M, int64_t N, int64_t K,
        const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, const float* bias,
        float beta, void* C, int64_t ldc, int cbf16, int n_threads) { return -1; }
static inline long llmctl_dnnl_matmul_builds(void) { return 0; }
static inline void llmctl_dnnl_version(int* v) { v[0] = v[1] = v[2] = 0; }
#endif
#endif
