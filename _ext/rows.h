/* The row loops of layers.pyx's layernorm and fused softmax + cross-entropy, and convert.pyx's
 * fp32 -> bf16 cast, compiled three times: for baseline x86-64 (SSE2, 4 floats a vector), AVX2
 * (8) and AVX-512 (16), with the copy for the CPU picked at run time (the build stays baseline,
 * so a wheel never hits SIGILL). Every loop is plain float/double arithmetic in a fixed order:
 * row sums keep LLMCTL_ROW_LANES partials whatever the vector width, exp is mathf.h's, bf16
 * rounding is bf16.h's, and -std=c11 does not contract a*b+c into an FMA. So all three copies
 * give the same bits (tests/test_kernels.py checks it); llmctl_rows_set_isa() picks one, for
 * those tests. Elsewhere (not GCC on x86-64) only the plain copy exists.
 *
 * Also the sum of squares of adamw.pyx's global grad norm (a fixed-order double reduction), and
 * two column sums over rows: layernorm's dweight/dbias and matmul.pyx's bias gradient (with the
 * bf16 copy of dout), each column summed in row order in double.
 *
 * The math is llm.c's train_gpt2.c: layernorm_forward / layernorm_backward, softmax_forward +
 * crossentropy_forward fused, crossentropy_softmax_backward (also fused with the forward, row by
 * row, where the training forward knows the loss scale), matmul_backward's dbias. Row
 * statistics and the softmax sum accumulate in double.
 *
 * gcc vectorises a loop only in some shapes: a row max as a float ?: and loads at logits[b0 + i]
 * (int index arithmetic) came out lane by lane, so the row max compares the floats' bits as
 * integers and the loops read through row pointers (objdump shows which; bench/kernels.py times).
 */
#ifndef LLMCTL_ROWS_H
#define LLMCTL_ROWS_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "mathf.h"

#define LLMCTL_ROW_LANES 16      /* independent partial sums of a row reduction (fixed order) */
#if defined(__GNUC__)
#define LLMCTL_ROW_RESTRICT __restrict__   /* dx, written in a loop that also adds to the sums */
#else
#define LLMCTL_ROW_RESTRICT
#endif
#define LLMCTL_SMBLOCK 1024      /* softmax exp block through the stack (a multiple of the lanes) */

/* a float's bits as an int32 that orders as the float does (-0 just below +0; NaNs beyond the
   infinities), and back (it is its own inverse): the row max as an integer max, which gcc
   vectorises (a float max it compiles lane by lane). A row with a NaN gives NaN everywhere either way. */
#define LLMCTL_ORDKEY(b) ((b) ^ (int32_t)((uint32_t)((b) >> 31) >> 1))
#ifdef __GNUC__
typedef int32_t __attribute__((may_alias)) llmctl_i32a;   /* a float's bits read in place */
#else
typedef int32_t llmctl_i32a;
#endif

#define LLMCTL_ST_F32(dst, i, v) (dst)[i] = (v)
#define LLMCTL_ST_BF16(dst, i, v) (dst)[i] = llmctl_f32_to_bf16(v)

/* mean and 1/sqrt(var + 1e-5) of x (C), both accumulated in double */
#define LLMCTL_LN_STATS_BODY                                                                   \
    double s[LLMCTL_ROW_LANES], tot = 0.0, m, var = 0.0, d;                                    \
    int cm = C - C % LLMCTL_ROW_LANES;                                                         \
    for (int j = 0; j < LLMCTL_ROW_LANES; j++) s[j] = 0.0;                                     \
    for (int i = 0; i < cm; i += LLMCTL_ROW_LANES)                                             \
        for (int j = 0; j < LLMCTL_ROW_LANES; j++) s[j] += x[i + j];                           \
    for (int j = 0; j < LLMCTL_ROW_LANES; j++) tot += s[j];                                    \
    for (int i = cm; i < C; i++) tot += x[i];                                                  \
    m = tot / C;                                                                               \
    for (int j = 0; j < LLMCTL_ROW_LANES; j++) s[j] = 0.0;                                     \
    for (int i = 0; i < cm; i += LLMCTL_ROW_LANES)                                             \
        for (int j = 0; j < LLMCTL_ROW_LANES; j++) { d = x[i + j] - m; s[j] += d * d; }        \
    for (int j = 0; j < LLMCTL_ROW_LANES; j++) var += s[j];                                    \
    for (int i = cm; i < C; i++) { d = x[i] - m; var += d * d; }                               \
    var = var / C;                                                                             \
    *mean = (float)m;                                                                          \
    *rstd = (float)(1.0 / sqrt(var + 1e-5));

/* out = (x - mean) * rstd * w + b */
#define LLMCTL_LN_FWD_BODY(ST)                                                                 \
    {                                                                                          \
        LLMCTL_LN_STATS_BODY                                                                   \
    }                                                                                          \
    float mf = *mean, rf = *rstd;                                                              \
    for (int i = 0; i < C; i++) ST(out, i, (x[i] - mf) * rf * w[i] + b[i]);

/* dx += r * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), dnorm = w * dy */
#define LLMCTL_LN_DINP_BODY                                                                    \
    LLMCTL_LN_DINP_MEANS                                                                       \
    for (int i = 0; i < C; i++) {                                                              \
        norm = (x[i] - m) * r;                                                                 \
        dnorm = w[i] * dy[i];                                                                  \
        dx[i] += r * (dnorm - dmean - norm * dnmean);                                          \
    }

/* bf16's fused layernorm backward of one row: LLMCTL_LN_DINP_BODY's dx (the same bits), and in
   the same pass this row's terms of the parameter gradients, aw[c] += (double)(norm * dy) and
   ab[c] += (double)dy (LLMCTL_LN_DPARAMS_BODY's), and, with o16, of the next bf16 GEMM's input:
   o16 = bf16(dx) (dx's final value: the residual stream's gradient) and an[c] += (double)dx */
#define LLMCTL_LN_BWD_FUSED_BODY                                                               \
    LLMCTL_LN_DINP_MEANS                                                                \
    for (int i = 0; i < C; i++) {                                                              \
        norm = (x[i] - m) * r;                                                                 \
        dnorm = w[i] * dy[i];                                                                  \
        dx[i] += r * (dnorm - dmean - norm * dnmean);                                          \
        aw[i] += (double)(norm * dy[i]);                                                       \
        ab[i] += (double)dy[i];                                                                \
    }                                                                                          \
    if (o16 != NULL)                                                                           \
        for (int i = 0; i < C; i++) {                                                          \
            o16[i] = llmctl_f32_to_bf16(dx[i]);                                                \
            an[i] += (double)dx[i];                                                            \
        }

/* dmean = mean(dnorm), dnmean = mean(dnorm * norm) of the row, summed in double in
   LLMCTL_ROW_LANES lanes. Each 16 lanes' float terms are staged first: gcc then vectorises the
   float part whole and the double sums as whole vectors (with the sums in the same loop it mixed
   vector widths and scalars, ~1.5x slower); the same operations in the same order either way */
#define LLMCTL_LN_DINP_MEANS                                                            \
    double s1[LLMCTL_ROW_LANES], s2[LLMCTL_ROW_LANES], a = 0.0, b2 = 0.0;                      \
    float norm, dnorm, dmean, dnmean, t1[LLMCTL_ROW_LANES], t2[LLMCTL_ROW_LANES];              \
    int cm = C - C % LLMCTL_ROW_LANES;                                                         \
    for (int j = 0; j < LLMCTL_ROW_LANES; j++) { s1[j] = 0.0; s2[j] = 0.0; }                   \
    for (int i = 0; i < cm; i += LLMCTL_ROW_LANES) {                                           \
        for (int j = 0; j < LLMCTL_ROW_LANES; j++) {                                           \
            float nj = (x[i + j] - m) * r, dj = w[i + j] * dy[i + j];                          \
            t1[j] = dj;                                                                        \
            t2[j] = dj * nj;                                                                   \
        }                                                                                      \
        for (int j = 0; j < LLMCTL_ROW_LANES; j++) { s1[j] += t1[j]; s2[j] += t2[j]; }         \
    }                                                                                          \
    for (int j = 0; j < LLMCTL_ROW_LANES; j++) { a += s1[j]; b2 += s2[j]; }                    \
    for (int i = cm; i < C; i++) {                                                             \
        norm = (x[i] - m) * r;                                                                 \
        dnorm = w[i] * dy[i];                                                                  \
        a += dnorm;                                                                            \
        b2 += dnorm * norm;                                                                    \
    }                                                                                          \
    dmean = (float)(a / C);                                                                    \
    dnmean = (float)(b2 / C);

/* probs[0:V] = exp(logits - max) (probs may alias logits), inv = 1 / their sum, and loss =
   -log p[target] as log(sum) - (x_target - max). The exp pass goes through a stack block: with
   the stores going straight to a possibly aliased probs, gcc would not vectorise the exp.
   LT, KEY, LD: the logits' type, a logit's order key and its value: fp32, or bf16 (the bf16 lm
   head's logits, widened exactly: the same float operations on the same values, the same bits). */
#define LLMCTL_KEY_F32(p, i) LLMCTL_ORDKEY(((const llmctl_i32a*)(p))[i])
#define LLMCTL_LD_F32(p, i) ((p)[i])
#define LLMCTL_KEY_BF16(p, i) LLMCTL_ORDKEY((int32_t)((uint32_t)(p)[i] << 16))
#define LLMCTL_LD_BF16(p, i) llmctl_bf16_to_f32((p)[i])
#define LLMCTL_XENT_EXPS_BODY_T(LT, KEY, LD)                                                   \
    float buf[LLMCTL_SMBLOCK], maxv, xt, e, inv;                                               \
    int32_t mk = LLMCTL_ORDKEY(-8388609), k;   /* -FLT_MAX */                                  \
    double s[LLMCTL_ROW_LANES], tot = 0.0;                                                     \
    int vm = V - V % LLMCTL_ROW_LANES;                                                         \
    for (int i = 0; i < V; i++) { k = KEY(logits, i); mk = k > mk ? k : mk; }                 \
    mk = LLMCTL_ORDKEY(mk);                                                                    \
    memcpy(&maxv, &mk, 4);                                                                     \
    xt = LD(logits, target);   /* read before probs (which may alias logits) is written */     \
    for (int j = 0; j < LLMCTL_ROW_LANES; j++) s[j] = 0.0;                                     \
    for (int b0 = 0; b0 < vm; b0 += LLMCTL_SMBLOCK) {                                          \
        int nb = vm - b0 < LLMCTL_SMBLOCK ? vm - b0 : LLMCTL_SMBLOCK;                          \
        const LT* lr = logits + b0;   /* (logits[b0 + i]: gcc loads it lane by lane) */        \
        for (int i = 0; i < nb; i++) buf[i] = llmctl_expf(LD(lr, i) - maxv);                   \
        for (int i = 0; i < nb; i += LLMCTL_ROW_LANES)                                         \
            for (int j = 0; j < LLMCTL_ROW_LANES; j++) s[j] += buf[i + j];                     \
        memcpy(probs + b0, buf, (size_t)nb * sizeof(float));                                   \
    }                                                                                          \
    for (int j = 0; j < LLMCTL_ROW_LANES; j++) tot += s[j];                                    \
    for (int i = vm; i < V; i++) { e = llmctl_expf(LD(logits, i) - maxv); probs[i] = e; tot += e; } \
    inv = (float)(1.0 / tot);                                                                  \
    *loss = (float)(log(tot) - ((double)xt - (double)maxv));
#define LLMCTL_XENT_EXPS_BODY LLMCTL_XENT_EXPS_BODY_T(float, LLMCTL_KEY_F32, LLMCTL_LD_F32)

/* probs = softmax(logits[0:V]) (probs[V:Vp] = 0; probs may alias logits), loss = -log p[target] */
#define LLMCTL_XENT_FWD_BODY                                                                   \
    LLMCTL_XENT_EXPS_BODY                                                                      \
    for (int i = 0; i < V; i++) probs[i] = probs[i] * inv;                                     \
    for (int i = V; i < Vp; i++) probs[i] = 0.0f;

/* the forward's loss and the backward's bf16 dlogits of one row in one go, probs a row of
   scratch: the exps are scaled to probs as they are read for dlogits, in the same float
   operations as the forward's pass over probs and the backward's pass over them (the same bits).
   The bf16-logits form (EXPS: LLMCTL_XENT_EXPS_BODY_T on bf16) skips dlogits when it is NULL:
   the loss alone. */
#define LLMCTL_XENT_FWD_BWD_BF16_BODY_T(EXPS)                                                  \
    EXPS                                                                                       \
    if (dlogits == NULL) return;                                                               \
    float pt = probs[target] * inv;                                                            \
    for (int i = 0; i < V; i++) dlogits[i] = llmctl_f32_to_bf16((probs[i] * inv) * dloss);     \
    dlogits[target] = llmctl_f32_to_bf16((pt - 1.0f) * dloss);                                 \
    for (int i = V; i < Vp; i++) dlogits[i] = 0;
#define LLMCTL_XENT_FWD_BWD_BF16_BODY LLMCTL_XENT_FWD_BWD_BF16_BODY_T(LLMCTL_XENT_EXPS_BODY)

/* the same in fp32: the exps go into dlogits' row (it may alias logits: in place) and are then
   scaled to probs and to dlogits in one pass, the forward's and the backward's float operations */
#define LLMCTL_XENT_FWD_BWD_F32_BODY                                                           \
    float* probs = dlogits;                                                                    \
    LLMCTL_XENT_EXPS_BODY                                                                      \
    float pt = probs[target] * inv;                                                            \
    for (int i = 0; i < V; i++) dlogits[i] = (probs[i] * inv) * dloss;                         \
    dlogits[target] = (pt - 1.0f) * dloss;                                                     \
    for (int i = V; i < Vp; i++) dlogits[i] = 0.0f;

/* dlogits = (probs - onehot(target)) * dloss over V, 0 over the padding (dlogits may alias an
   fp32 probs: p[target] is read first) */
#define LLMCTL_XENT_BWD_BODY(ST)                                                               \
    float pt = probs[target];                                                                  \
    for (int i = 0; i < V; i++) ST(dlogits, i, probs[i] * dloss);                              \
    ST(dlogits, target, (pt - 1.0f) * dloss);                                                  \
    for (int i = V; i < Vp; i++) dlogits[i] = 0;

/* sum of g[i]^2 in double: LLMCTL_SUMSQ_LANES lane partials added in lane order, then the tail
   (adamw.pyx's global grad norm, per fixed chunk) */
#define LLMCTL_SUMSQ_LANES 8
#define LLMCTL_SUMSQ_BODY                                                                      \
    double acc[LLMCTL_SUMSQ_LANES], tot = 0.0, x;                                              \
    ptrdiff_t nm = n - n % LLMCTL_SUMSQ_LANES;                                                 \
    for (int j = 0; j < LLMCTL_SUMSQ_LANES; j++) acc[j] = 0.0;                                 \
    for (ptrdiff_t i = 0; i < nm; i += LLMCTL_SUMSQ_LANES)                                     \
        for (int j = 0; j < LLMCTL_SUMSQ_LANES; j++) { x = g[i + j]; acc[j] += x * x; }        \
    for (int j = 0; j < LLMCTL_SUMSQ_LANES; j++) tot += acc[j];                                \
    for (ptrdiff_t i = nm; i < n; i++) { x = g[i]; tot += x * x; }                             \
    return tot;

/* Column sums over rows in row order, double accumulators (acc, n of them, set here) added to
   the float outputs at the end. layernorm's parameter gradients over columns c0..c0+n:
   dw += sum_r (float)(norm * dy), db += sum_r dy, norm = (x - mean[r]) * rstd[r] */
#define LLMCTL_LN_DPARAMS_BODY                                                                 \
    for (int c = 0; c < n; c++) { aw[c] = 0.0; ab[c] = 0.0; }                                  \
    for (ptrdiff_t r = 0; r < N; r++) {                                                        \
        const float* xr = x + r * C;                                                           \
        const float* dr = dy + r * C;                                                          \
        float m = mean[r], rs = rstd[r];                                                       \
        for (int c = 0; c < n; c++) {                                                          \
            float norm = (xr[c] - m) * rs;                                                     \
            aw[c] += (double)(norm * dr[c]);                                                   \
            ab[c] += (double)dr[c];                                                            \
        }                                                                                      \
    }                                                                                          \
    for (int c = 0; c < n; c++) { dw[c] += (float)aw[c]; db[c] += (float)ab[c]; }

/* a bias gradient over columns 0..n of rows of width ld (db may be NULL), and, unless dst is
   NULL, dst = bf16(dy) in the same pass (matmul.pyx's backward) */
#define LLMCTL_BIAS_GRAD_BODY                                                                  \
    for (int c = 0; c < n; c++) acc[c] = 0.0;                                                  \
    if (dst == NULL) {                                                                         \
        for (ptrdiff_t r = 0; r < N; r++) {                                                    \
            const float* dr = dy + r * ld;                                                     \
            for (int c = 0; c < n; c++) acc[c] += (double)dr[c];                               \
        }                                                                                      \
    } else {                                                                                   \
        for (ptrdiff_t r = 0; r < N; r++) {                                                    \
            const float* dr = dy + r * ld;                                                     \
            uint16_t* o = dst + r * ld;                                                        \
            for (int c = 0; c < n; c++) {                                                      \
                acc[c] += (double)dr[c];                                                       \
                o[c] = llmctl_f32_to_bf16(dr[c]);                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    if (db != NULL)                                                                            \
        for (int c = 0; c < n; c++) db[c] += (float)acc[c];

#define LLMCTL_ROW_KERNELS(SFX, ATTR)                                                                      \
    ATTR static void llmctl_ln_fwd_f32_##SFX(float* out, float* mean, float* rstd, const float* x,         \
                                             const float* w, const float* b, int C) {                      \
        LLMCTL_LN_FWD_BODY(LLMCTL_ST_F32)                                                                  \
    }                                                                                                      \
    ATTR static void llmctl_ln_fwd_bf16_##SFX(uint16_t* out, float* mean, float* rstd, const float* x,     \
                                              const float* w, const float* b, int C) {                     \
        LLMCTL_LN_FWD_BODY(LLMCTL_ST_BF16)                                                                 \
    }                                                                                                      \
    ATTR static void llmctl_ln_dinp_##SFX(float* dx, const float* dy, const float* x, const float* w,      \
                                          float m, float r, int C) {                                       \
        LLMCTL_LN_DINP_BODY                                                                                \
    }                                                                                                      \
    ATTR static void llmctl_ln_bwd_fused_##SFX(float* LLMCTL_ROW_RESTRICT dx, uint16_t* LLMCTL_ROW_RESTRICT o16, \
                                               double* LLMCTL_ROW_RESTRICT aw, double* LLMCTL_ROW_RESTRICT ab, \
                                               double* LLMCTL_ROW_RESTRICT an, const float* LLMCTL_ROW_RESTRICT dy, \
                                               const float* LLMCTL_ROW_RESTRICT x,                         \
                                               const float* LLMCTL_ROW_RESTRICT w, float m, float r, int C) { \
        LLMCTL_LN_BWD_FUSED_BODY                                                                           \
    }                                                                                                      \
    ATTR static void llmctl_xent_fwd_##SFX(float* loss, float* probs, const float* logits, int target,     \
                                           int V, int Vp) {                                                \
        LLMCTL_XENT_FWD_BODY                                                                               \
    }                                                                                                      \
    ATTR static void llmctl_xent_fwd_bwd_bf16_##SFX(float* loss, uint16_t* dlogits, float* probs,          \
                                                    const float* logits, int target, float dloss, int V,   \
                                                    int Vp) {                                              \
        LLMCTL_XENT_FWD_BWD_BF16_BODY                                                                      \
    }                                                                                                      \
    ATTR static void llmctl_xent16_fwd_bwd_##SFX(float* loss, uint16_t* dlogits, float* probs,             \
                                                 const uint16_t* logits, int target, float dloss, int V,   \
                                                 int Vp) {                                                 \
        LLMCTL_XENT_FWD_BWD_BF16_BODY_T(LLMCTL_XENT_EXPS_BODY_T(uint16_t, LLMCTL_KEY_BF16, LLMCTL_LD_BF16)) \
    }                                                                                                      \
    ATTR static void llmctl_xent_fwd_bwd_f32_##SFX(float* loss, float* dlogits, const float* logits,       \
                                                   int target, float dloss, int V, int Vp) {               \
        LLMCTL_XENT_FWD_BWD_F32_BODY                                                                       \
    }                                                                                                      \
    ATTR static void llmctl_xent_bwd_f32_##SFX(float* dlogits, const float* probs, int target, float dloss, \
                                               int V, int Vp) {                                            \
        LLMCTL_XENT_BWD_BODY(LLMCTL_ST_F32)                                                                \
    }                                                                                                      \
    ATTR static void llmctl_xent_bwd_bf16_##SFX(uint16_t* dlogits, const float* probs, int target,         \
                                                float dloss, int V, int Vp) {                              \
        LLMCTL_XENT_BWD_BODY(LLMCTL_ST_BF16)                                                               \
    }                                                                                                      \
    ATTR static void llmctl_cast_bf16_##SFX(uint16_t* dst, const float* src, ptrdiff_t n) {                \
        for (ptrdiff_t i = 0; i < n; i++) dst[i] = llmctl_f32_to_bf16(src[i]);                             \
    }                                                                                                      \
    ATTR static double llmctl_sumsq_##SFX(const float* g, ptrdiff_t n) {                                   \
        LLMCTL_SUMSQ_BODY                                                                                  \
    }                                                                                                      \
    ATTR static void llmctl_ln_dparams_##SFX(float* dw, float* db, double* aw, double* ab, const float* dy, \
                                             const float* x, const float* mean, const float* rstd,         \
                                             ptrdiff_t N, ptrdiff_t C, int n) {                            \
        LLMCTL_LN_DPARAMS_BODY                                                                             \
    }                                                                                                      \
    ATTR static void llmctl_bias_grad_##SFX(float* db, uint16_t* dst, double* acc, const float* dy,        \
                                            ptrdiff_t N, ptrdiff_t ld, int n) {                            \
        LLMCTL_BIAS_GRAD_BODY                                                                              \
    }

LLMCTL_ROW_KERNELS(base, )

/* the instruction set the row loops run: 0 baseline, 1 AVX2, 2 AVX-512 (F, BW, DQ, VL) */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(LLMCTL_NO_AVX_DISPATCH)
LLMCTL_ROW_KERNELS(avx2, __attribute__((target("avx2"))))
LLMCTL_ROW_KERNELS(avx512, __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512"))))
static int llmctl_rows_level = 0;   /* set at import (llmctl_rows_set_isa), only read in the loops */
static inline int llmctl_rows_best(void) {
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) return 2;
    return __builtin_cpu_supports("avx2") ? 1 : 0;
}
/* level -1: the best this CPU has; else at most that level. Returns the level now in force. */
static inline int llmctl_rows_set_isa(int level) {
    int best = llmctl_rows_best();
    llmctl_rows_level = (level < 0 || level > best) ? best : level;
    return llmctl_rows_level;
}
static inline int llmctl_rows_isa(void) { return llmctl_rows_level; }
#define LLMCTL_ROWS_DISPATCH(name, ...)                                          \
    (llmctl_rows_level == 2 ? name##_avx512(__VA_ARGS__)                        \
     : llmctl_rows_level == 1 ? name##_avx2(__VA_ARGS__) : name##_base(__VA_ARGS__))
#else
static inline int llmctl_rows_set_isa(int level) { (void)level; return 0; }
static inline int llmctl_rows_isa(void) { return 0; }
#define LLMCTL_ROWS_DISPATCH(name, ...) name##_base(__VA_ARGS__)
#endif

static inline void llmctl_ln_fwd_f32(float* out, float* mean, float* rstd, const float* x, const float* w,
                                     const float* b, int C) {
    LLMCTL_ROWS_DISPATCH(llmctl_ln_fwd_f32, out, mean, rstd, x, w, b, C);
}
static inline void llmctl_ln_fwd_bf16(uint16_t* out, float* mean, float* rstd, const float* x, const float* w,
                                      const float* b, int C) {
    LLMCTL_ROWS_DISPATCH(llmctl_ln_fwd_bf16, out, mean, rstd, x, w, b, C);
}
static inline void llmctl_ln_bwd_fused(float* dx, uint16_t* o16, double* aw, double* ab, double* an,
                                       const float* dy, const float* x, const float* w, float m, float r, int C) {
    LLMCTL_ROWS_DISPATCH(llmctl_ln_bwd_fused, dx, o16, aw, ab, an, dy, x, w, m, r, C);
}
static inline void llmctl_ln_dinp(float* dx, const float* dy, const float* x, const float* w, float m, float r,
                                  int C) {
    LLMCTL_ROWS_DISPATCH(llmctl_ln_dinp, dx, dy, x, w, m, r, C);
}
static inline void llmctl_xent_fwd(float* loss, float* probs, const float* logits, int target, int V, int Vp) {
    LLMCTL_ROWS_DISPATCH(llmctl_xent_fwd, loss, probs, logits, target, V, Vp);
}
static inline void llmctl_xent_fwd_bwd_bf16(float* loss, uint16_t* dlogits, float* probs, const float* logits,
                                            int target, float dloss, int V, int Vp) {
    LLMCTL_ROWS_DISPATCH(llmctl_xent_fwd_bwd_bf16, loss, dlogits, probs, logits, target, dloss, V, Vp);
}
/* bf16 logits (widened exactly): loss, and dlogits unless NULL, as llmctl_xent_fwd_bwd_bf16 on the widening */
static inline void llmctl_xent16_fwd_bwd(float* loss, uint16_t* dlogits, float* probs, const uint16_t* logits,
                                         int target, float dloss, int V, int Vp) {
    LLMCTL_ROWS_DISPATCH(llmctl_xent16_fwd_bwd, loss, dlogits, probs, logits, target, dloss, V, Vp);
}
static inline void llmctl_xent_fwd_bwd_f32(float* loss, float* dlogits, const float* logits, int target,
                                           float dloss, int V, int Vp) {
    LLMCTL_ROWS_DISPATCH(llmctl_xent_fwd_bwd_f32, loss, dlogits, logits, target, dloss, V, Vp);
}
static inline void llmctl_xent_bwd_f32(float* dlogits, const float* probs, int target, float dloss, int V, int Vp) {
    LLMCTL_ROWS_DISPATCH(llmctl_xent_bwd_f32, dlogits, probs, target, dloss, V, Vp);
}
static inline void llmctl_xent_bwd_bf16(uint16_t* dlogits, const float* probs, int target, float dloss, int V,
                                        int Vp) {
    LLMCTL_ROWS_DISPATCH(llmctl_xent_bwd_bf16, dlogits, probs, target, dloss, V, Vp);
}
static inline void llmctl_cast_bf16_isa(uint16_t* dst, const float* src, ptrdiff_t n) {
    LLMCTL_ROWS_DISPATCH(llmctl_cast_bf16, dst, src, n);
}
static inline double llmctl_sumsq(const float* g, ptrdiff_t n) {
    return LLMCTL_ROWS_DISPATCH(llmctl_sumsq, g, n);
}
/* layernorm's dw, db over columns c0..c0+n (pointers offset by the caller), aw/ab n doubles of scratch */
static inline void llmctl_ln_dparams(float* dw, float* db, double* aw, double* ab, const float* dy, const float* x,
                                     const float* mean, const float* rstd, ptrdiff_t N, ptrdiff_t C, int n) {
    LLMCTL_ROWS_DISPATCH(llmctl_ln_dparams, dw, db, aw, ab, dy, x, mean, rstd, N, C, n);
}
/* db (may be NULL) += column sums of dy (N rows of stride ld, n columns); dst (or NULL) = bf16(dy) */
static inline void llmctl_bias_grad(float* db, uint16_t* dst, double* acc, const float* dy, ptrdiff_t N,
                                    ptrdiff_t ld, int n) {
    LLMCTL_ROWS_DISPATCH(llmctl_bias_grad, db, dst, acc, dy, N, ld, n);
}
#endif
