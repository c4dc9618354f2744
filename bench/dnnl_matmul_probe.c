/* bench/dnnl_matmul_probe.c: oneDNN's two bf16 GEMM APIs on GPT-2 d12 layer shapes, in C.
 *
 * What it measures: for each B*T in {256, 512, 1024, 2048, 4096} (argv[1]: how many of them) and
 * each linear layer (qkv, attproj, fc, fcproj, lm head), the three products of llm.c's matmul
 * (fwd: out = inp @ W^T; dX += dout @ W; dW += dout^T @ inp) as GFLOP/s of
 *   gemm   dnnl_gemm_bf16bf16f32 (the BLAS-like call, packing both operands per call),
 *   prim   the matmul primitive on the plain row-major operands (what llmctl's "dnnl" engine runs),
 *   packed the matmul primitive on a weight reordered once into its preferred layout
 *          (format_tag_any; the product alone), and the reorder's time in ms,
 * best of 5, the variants alternating call by call. WALL=1 times wall clock; otherwise the calling
 * thread's CPU time (meaningful with OMP_NUM_THREADS=1, and less disturbed on a busy machine).
 * What it is not: llmctl's code path (bench/gemm.py times that) or a correctness test.
 *
 *   cc -O2 -fopenmp -I$VENV/include bench/dnnl_matmul_probe.c -o probe -L$VENV/lib -l:libdnnl.so.3 \
 *      -Wl,-rpath,$VENV/lib        # $VENV: where onednn-devel-cpu-gomp put include/ and lib/
 *   OMP_NUM_THREADS=1 ./probe 5     # all five B*T
 *   WALL=1 OMP_NUM_THREADS=2 ./probe 1
 */
#include <oneapi/dnnl/dnnl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* exported by libdnnl but not in its public header (see _ext/dnnl_gemm.h) */
dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M,
        dnnl_dim_t N, dnnl_dim_t K, float alpha, const uint16_t *A, dnnl_dim_t lda,
        const uint16_t *B, dnnl_dim_t ldb, float beta, float *C, dnnl_dim_t ldc);
#define CK(x) do { dnnl_status_t s_ = (x); if (s_) { fprintf(stderr, "%s:%d %s -> %d\n", __FILE__, __LINE__, #x, s_); exit(1);} } while (0)
static dnnl_engine_t eng; static dnnl_stream_t strm;

static dnnl_memory_desc_t md2(int64_t r, int64_t c, dnnl_data_type_t dt, int trans) {
    /* logical (r,c); trans: memory is (c,r) row-major */
    dnnl_memory_desc_t md; dnnl_dims_t d = {r, c};
    CK(dnnl_memory_desc_create_with_tag(&md, 2, d, dt, trans ? dnnl_ba : dnnl_ab));
    return md;
}
typedef struct { dnnl_primitive_t p; dnnl_primitive_desc_t pd; dnnl_memory_desc_t wmd; } mm_t;
/* C (M,N) (+)= A (M,K) @ B (K,N); ta/tb: operand stored transposed; wany: weights format any */
static mm_t make(int64_t M, int64_t N, int64_t K, int ta, int tb, int acc, int wany) {
    mm_t m; dnnl_memory_desc_t a = md2(M, K, dnnl_bf16, ta), b, c = md2(M, N, dnnl_f32, 0);
    if (wany) { dnnl_dims_t d = {K, N}; CK(dnnl_memory_desc_create_with_tag(&b, 2, d, dnnl_bf16, dnnl_format_tag_any)); }
    else b = md2(K, N, dnnl_bf16, tb);
    dnnl_primitive_attr_t attr; CK(dnnl_primitive_attr_create(&attr));
    if (acc) { dnnl_post_ops_t po; CK(dnnl_post_ops_create(&po)); CK(dnnl_post_ops_append_sum(po, 1.0f, 0, dnnl_data_type_undef)); CK(dnnl_primitive_attr_set_post_ops(attr, po)); }
    CK(dnnl_matmul_primitive_desc_create(&m.pd, eng, a, b, NULL, c, attr));
    CK(dnnl_primitive_create(&m.p, m.pd));
    m.wmd = (dnnl_memory_desc_t)dnnl_primitive_desc_query_md(m.pd, dnnl_query_weights_md, 0);
    const char* impl; dnnl_primitive_desc_query(m.pd, dnnl_query_impl_info_str, 0, (void*)&impl);
    fprintf(stderr, "  impl %s M%ld N%ld K%ld ta%d tb%d any%d\n", impl, M, N, K, ta, tb, wany);
    return m;
}
static void run(mm_t* m, int64_t M, int64_t N, int64_t K, int ta, const void* A, const void* B, float* C) {
    dnnl_memory_t ma, mb, mc;
    dnnl_memory_desc_t a = md2(M, K, dnnl_bf16, ta), c = md2(M, N, dnnl_f32, 0);
    CK(dnnl_memory_create(&ma, a, eng, (void*)A)); CK(dnnl_memory_create(&mb, m->wmd, eng, (void*)B)); CK(dnnl_memory_create(&mc, c, eng, C));
    dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}};
    CK(dnnl_primitive_execute(m->p, strm, 3, args)); CK(dnnl_stream_wait(strm));
    dnnl_memory_destroy(ma); dnnl_memory_destroy(mb); dnnl_memory_destroy(mc);
    dnnl_memory_desc_destroy(a); dnnl_memory_desc_destroy(c);
}
/* reorder plain B (K,N) (trans tb) into m->wmd */
static void pack(mm_t* m, int64_t K, int64_t N, int tb, const void* B, void* P, dnnl_primitive_t* rp) {
    dnnl_memory_desc_t b = md2(K, N, dnnl_bf16, tb);
    dnnl_memory_t mi, mo; CK(dnnl_memory_create(&mi, b, eng, (void*)B)); CK(dnnl_memory_create(&mo, m->wmd, eng, P));
    if (!*rp) { dnnl_primitive_desc_t rpd; CK(dnnl_reorder_primitive_desc_create(&rpd, b, eng, m->wmd, eng, NULL)); CK(dnnl_primitive_create(rp, rpd)); }
    dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, mi}, {DNNL_ARG_TO, mo}};
    CK(dnnl_primitive_execute(*rp, strm, 2, args)); CK(dnnl_stream_wait(strm));
    dnnl_memory_destroy(mi); dnnl_memory_destroy(mo); dnnl_memory_desc_destroy(b);
}

static double tnow(void) {
    struct timespec t;
    clock_gettime(getenv("WALL") ? CLOCK_MONOTONIC : CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char** argv) {
    CK(dnnl_engine_create(&eng, dnnl_cpu, 0));
    CK(dnnl_stream_create(&strm, eng, dnnl_stream_default_flags));
    int reps = 5;
    int64_t BTs[] = {256, 512, 1024, 2048, 4096};
    int64_t L[][2] = {{768, 2304}, {768, 768}, {768, 3072}, {3072, 768}, {768, 50304}};
    int nbt = argc > 1 ? atoi(argv[1]) : 5;
    if (nbt < 1 || nbt > 5) nbt = 5;
    printf("%-19s %-4s %6s %6s %6s %8s\n", "BT x C x OC", "prod", "gemm", "prim", "packed", "reorder");
    for (int bi = 0; bi < nbt; bi++) for (int li = 0; li < 5; li++) {
        int64_t BT = BTs[bi], C = L[li][0], OC = L[li][1];
        uint16_t* inp = malloc(BT * C * 2); uint16_t* W = malloc(OC * C * 2); uint16_t* dout = malloc(BT * OC * 2);
        float* out = calloc(BT * OC, 4); float* dinp = calloc(BT * C, 4); float* dW = calloc(OC * C, 4);
        void* P = malloc((OC * C > BT * C ? OC * C : BT * C) * 2 + (1 << 20));
        for (int64_t i = 0; i < BT * C; i++) inp[i] = 0x3f80 + (i % 7);
        for (int64_t i = 0; i < OC * C; i++) W[i] = 0x3c00 + (i % 13);
        for (int64_t i = 0; i < BT * OC; i++) dout[i] = 0x3a00 + (i % 5);
        double fl = 2.0 * BT * C * OC;
        for (int op = 0; op < 3; op++) {
            /* fwd: M=BT, N=OC, K=C, B = W^T (W stored (OC,C)); dX: M=BT, N=C, K=OC, B = W;
               dW: M=OC, N=C, K=BT, A = dout^T (dout stored (BT,OC)), B = inp */
            int64_t M = op == 2 ? OC : BT, N = op == 0 ? OC : C, K = op == 0 ? C : op == 1 ? OC : BT;
            int ta = op == 2, tb = op == 0, acc = op > 0;
            const void* A = op == 0 ? inp : dout;
            const void* B = op == 2 ? inp : W;
            float* Cc = op == 0 ? out : op == 1 ? dinp : dW;
            mm_t plain = make(M, N, K, ta, tb, acc, 0), any = make(M, N, K, ta, tb, acc, 1);
            dnnl_primitive_t rp = NULL;
            double tg = 1e9, tm = 1e9, tp = 1e9, tr = 1e9;
            for (int r = 0; r <= reps; r++) {   /* round 0 warms up */
                double t0 = tnow();
                CK(dnnl_gemm_bf16bf16f32(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, 1.0f, A, ta ? M : K,
                                         B, tb ? K : N, acc ? 1.0f : 0.0f, Cc, N));
                double t1 = tnow();
                run(&plain, M, N, K, ta, A, B, Cc);
                double t2 = tnow();
                pack(&any, K, N, tb, B, P, &rp);
                double t3 = tnow();
                run(&any, M, N, K, ta, A, P, Cc);
                double t4 = tnow();
                if (r) {
                    if (t1 - t0 < tg) tg = t1 - t0;
                    if (t2 - t1 < tm) tm = t2 - t1;
                    if (t3 - t2 < tr) tr = t3 - t2;
                    if (t4 - t3 < tp) tp = t4 - t3;
                }
            }
            printf("%4ld x %4ld x %5ld %-4s %6.0f %6.0f %6.0f %7.3fms\n", (long)BT, (long)C, (long)OC,
                   op == 0 ? "fwd" : op == 1 ? "dX" : "dW", fl / tg / 1e9, fl / tm / 1e9, fl / tp / 1e9, tr * 1e3);
            fflush(stdout);
        }
        free(inp); free(W); free(dout); free(out); free(dinp); free(dW); free(P);
    }
    return 0;
}
