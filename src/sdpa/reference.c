/* The plain reference: scores, softmax and weighted sum per query row, accumulated in double. */
#include <math.h>

#include "core/alloc.h"
#include "core/dtype.h"
#include "core/status.h"
#include "flex/program.h"
#include "sdpa/check.h"
#include "sdpa/problem.h"

static double load(const char *base, af_dtype dtype, int64_t offset) {
    return af_load_as_f32(base + offset * (int64_t)af_dtype_size(dtype), dtype);
}

#define MOD_RUN 256   /* keys the reference hands the mods at a time */

/* af_flex_attn's mods on row i's scaled scores: rounded to float32 and evaluated as the kernels do, MOD_RUN keys at a
 * time (the reference's own part is the double dot products and softmax around them). regs: the call's scratch,
 * af_mods_scratch_floats(p->mods, 1, MOD_RUN) floats. */
static void apply_mods(const af_problem *p, int64_t b, int64_t h, int64_t i, int64_t S, double *s, float *regs) {
    float run[MOD_RUN];
    for (int64_t j0 = 0; j0 < S; j0 += MOD_RUN) {
        const int n = S - j0 < MOD_RUN ? (int)(S - j0) : MOD_RUN;
        for (int j = 0; j < MOD_RUN; j++) run[j] = j < n ? (float)s[j0 + j] : 0.0f;
        af_mods_apply_row(p->mods, b, h, i, j0, n, run, regs, MOD_RUN);
        for (int j = 0; j < n; j++) s[j0 + j] = run[j];
    }
}

/* Scores of sequence b's row i, head h, into s[0..S_b): scale·q·k, softcap, then mask / causality / window as -inf
 * or additive terms. */
static void row_scores(const af_problem *p, int64_t b, const af_sequence *seq, int64_t h, int64_t i, double *s,
                       float *mod_regs) {
    const int64_t hk = h / p->group;
    int64_t lo, hi;
    af_key_range(p, seq->L, seq->S, i, &lo, &hi);
    const int64_t q_row = b * p->q_stride[0] + h * p->q_stride[1] + (seq->q0 + i) * p->q_stride[2];
    /* float8 descales multiply the scale (FA4: q·k·q_descale·k_descale) */
    const double scale = p->scale * af_descale_at(p->q_descale, p->q_descale_stride, b, hk) *
                         af_descale_at(p->k_descale, p->k_descale_stride, b, hk);
    for (int64_t j = 0; j < seq->S; j++) {
        const int64_t k_row = af_kv_row_offset(p, p->k_stride, b, hk, seq, j);
        double dot = 0.0;
        for (int64_t e = 0; e < p->E; e++)
            dot += load(p->q, p->dtype, q_row + e * p->q_stride[3]) *
                   load(p->k, p->kv_dtype, k_row + e * p->k_stride[3]);
        double score = scale * dot;
        if (p->softcap > 0.0) score = p->softcap * tanh(score / p->softcap);
        if (!p->mods && (j < lo || j >= hi)) score = -INFINITY;   /* with mods: after them, as the kernels */
        if (p->mask) {
            const int64_t m = b * p->mask_stride[0] + h * p->mask_stride[1] + i * p->mask_stride[2] + j * p->mask_stride[3];
            const double mv = load(p->mask, p->mask_dtype, m);
            if (p->mask_dtype == AF_BOOL) score = mv != 0.0 ? score : -INFINITY;
            else score += mv;
        }
        s[j] = score;
    }
    if (!p->mods) return;
    apply_mods(p, b, h, i, seq->S, s, mod_regs);
    for (int64_t j = 0; j < seq->S; j++)
        if (j < lo || j >= hi) s[j] = -INFINITY;
}

/* One row: softmax over the scores and the sink (in the denominator only: FA4), out and lse. */
static void reference_row(const af_problem *p, int64_t b, const af_sequence *seq, int64_t h, int64_t i, double *s,
                          double *acc, float *mod_regs) {
    row_scores(p, b, seq, h, i, s, mod_regs);
    double row_max = -INFINITY;
    bool has_nan = false;
    for (int64_t j = 0; j < seq->S; j++) {
        if (isnan(s[j])) has_nan = true;
        else if (s[j] > row_max) row_max = s[j];
    }
    const double sink = p->sink ? load(p->sink, p->sink_dtype, h * p->sink_stride) : -INFINITY;
    if (sink > row_max) row_max = sink;
    if (has_nan || isnan(sink)) row_max = NAN;
    double sum = 0.0;
    for (int64_t e = 0; e < p->Ev; e++) acc[e] = 0.0;
    if (row_max != -INFINITY) {   /* a row that sees no key and no sink keeps out = 0 and sum = 0 */
        const int64_t hk = h / p->group;
        for (int64_t j = 0; j < seq->S; j++) {
            const double w = exp(s[j] - row_max);
            if (w == 0.0) continue;   /* masked keys contribute nothing, even against Inf/NaN values */
            sum += w;
            const int64_t v_row = af_kv_row_offset(p, p->v_stride, b, hk, seq, j);
            for (int64_t e = 0; e < p->Ev; e++) acc[e] += w * load(p->v, p->kv_dtype, v_row + e * p->v_stride[3]);
        }
        if (sink != -INFINITY) sum += exp(sink - row_max);
    }
    const double v_descale = af_descale_at(p->v_descale, p->v_descale_stride, b, h / p->group);   /* FA4: on out */
    const double inv = sum > 0.0 || isnan(sum) ? v_descale / sum : 0.0;
    const size_t out_size = af_dtype_size(p->out_dtype);
    const int64_t row = b * p->out_stride[0] + h * p->out_stride[1] + (seq->q0 + i) * p->out_stride[2];
    char *o = p->Ev == 0 ? NULL : p->out + row * (int64_t)out_size;   /* Ev = 0: out may be NULL */
    for (int64_t e = 0; e < p->Ev; e++)
        af_store_from_f32(o + e * p->out_stride[3] * (int64_t)out_size, p->out_dtype, (float)(acc[e] * inv));
    if (p->lse)
        p->lse[b * p->lse_stride[0] + h * p->lse_stride[1] + (seq->q0 + i) * p->lse_stride[2]] =
            sum > 0.0 || isnan(sum) ? (float)(row_max + log(sum)) : -INFINITY;
}

af_status af_reference_forward(const af_problem *p) {
    if (p->mods) af_mods_unfuse(p->mods);   /* every program in the interpreter: a fused kernel is checked against it */
    if (p->B == 0 || p->Hq == 0 || p->L == 0) return AF_OK;   /* no row: no scratch (S may be absurd) */
    if (p->Ev == 0 && !p->lse) return AF_OK;                   /* no element to write (B·H·L may be absurd) */
    if ((uint64_t)p->S > SIZE_MAX / sizeof(double))   /* a broadcast (stride-0) key can be this long */
        return af_fail(AF_ERR_NO_MEMORY, "out of memory: reference scratch for S=%lld", (long long)p->S);
    double *s = af_alloc(sizeof(double) * (size_t)(p->S > 0 ? p->S : 1));
    double *acc = af_alloc(sizeof(double) * (size_t)(p->Ev > 0 ? p->Ev : 1));
    float *mod_regs = p->mods ? af_alloc(sizeof(float) * af_mods_scratch_floats(p->mods, 1, MOD_RUN)) : NULL;
    if (!s || !acc || (p->mods && !mod_regs)) {
        af_free(s);
        af_free(acc);
        af_free(mod_regs);
        return af_fail(AF_ERR_NO_MEMORY, "out of memory: reference scratch for S=%lld", (long long)p->S);
    }
    for (int64_t b = 0; b < p->B; b++) {
        const af_sequence seq = af_sequence_of(p, b);
        for (int64_t h = 0; h < p->Hq; h++)
            for (int64_t i = 0; i < seq.L; i++) reference_row(p, b, &seq, h, i, s, acc, mod_regs);
    }
    af_free(s);
    af_free(acc);
    af_free(mod_regs);
    return AF_OK;
}

af_status af_reference_f32(const af_sdpa_args *args, af_tensor *out_f32, af_tensor *lse) {
    af_clear_error();
    if (!args || !args->query || !out_f32) return af_fail(AF_ERR_INVALID_ARGUMENT, "args, query and out: must not be NULL");
    if (out_f32->dtype != AF_F32) return af_fail(AF_ERR_INVALID_ARGUMENT, "out: the f32 reference writes float32");
    af_tensor as_query_dtype = *out_f32;   /* checked as SDPA's out; written as f32 */
    as_query_dtype.dtype = args->query->dtype;
    af_problem p;
    af_status st = af_sdpa_check(args, &as_query_dtype, lse, &p);
    if (st == AF_OK) st = af_check_out_as_f32(args, out_f32, lse);   /* f16/bf16: it writes twice the bytes checked */
    if (st != AF_OK) return st;
    p.out_dtype = AF_F32;
    return af_reference_forward(&p);
}
