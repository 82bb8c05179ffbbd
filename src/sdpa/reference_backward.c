/* The plain reference backward: for every query row, the scores, P and D recomputed in double from q, k, v and dout
 * (out and lse are checked at the boundary but never read), then dq written row by row while dk, dv and dsink
 * accumulate in double scratch that is written whole at the end. */
#include <math.h>
#include <string.h>

#include "core/alloc.h"
#include "core/dtype.h"
#include "core/status.h"
#include "flex/program.h"
#include "sdpa/backward.h"

static double load(const char *base, af_dtype dtype, int64_t offset) {
    return af_load_as_f32(base + offset * (int64_t)af_dtype_size(dtype), dtype);
}

static void store(char *base, af_dtype dtype, int64_t offset, double value) {
    af_store_from_f32(base + offset * (int64_t)af_dtype_size(dtype), dtype, (float)value);
}

/* A tensor's batch slots and rows in the problem's (B, H, seq, dim) order: a packed varlen tensor is one slot of
 * all its rows (its batch stride is 0), a fixed one B slots of its length. */
typedef struct { int64_t slots, rows; } rows_extent;

static rows_extent query_rows(const af_problem *p) {
    return p->cu_seqlens_q ? (rows_extent){1, p->total_q} : (rows_extent){p->B, p->L};
}

static rows_extent key_rows(const af_problem *p) {
    return p->cu_seqlens_k ? (rows_extent){1, p->total_k} : (rows_extent){p->B, p->S};
}

/* What one row needs (sized S or the head dims) and what the whole call accumulates (dk, dv per key row of the key
 * tensor, dsink per query head). */
typedef struct {
    double *score;       /* S: the row's scores, masked ones -inf */
    double *softcap_d;   /* S: d(capped)/d(raw) = 1 - tanh² (1 without softcap) */
    double *prob;        /* S: p_j = exp(s_j - lse) */
    double *dprob;       /* S: dout_i · v_j */
    double *dq_row;      /* E */
    double *dk, *dv;     /* NULL when not wanted; (slots, Hkv, rows, E / Ev) of key_rows */
    double *dsink;       /* NULL when not wanted; Hq */
    float *mod_regs;     /* af_flex_attn's mods: their registers over MOD_RUN keys, then MOD_RUN scores and tangents */
    float *raw;          /* S: the row's scaled scores before the mods (captured tensors' gradients wanted) */
    float *aux_regs;     /* ... the gradients' registers, then MOD_RUN scores and MOD_RUN gradients of the mods' value */
    float **aux_grads;   /* ... per captured tensor: NULL, or its gradient's sums (one float32 buffer each) */
    int32_t n_aux;
} scratch;

#define MOD_RUN 256   /* keys the reference hands the mods at a time */

static size_t count_or_one(int64_t n) { return (size_t)(n > 0 ? n : 1); }

/* n doubles, or false when n·8 bytes cannot be asked for. */
static bool alloc_doubles(double **to, int64_t n) {
    *to = NULL;
    if ((uint64_t)count_or_one(n) > SIZE_MAX / sizeof(double)) return false;
    *to = af_alloc_zeroed(sizeof(double) * count_or_one(n));
    return *to != NULL;
}

/* slots · heads · rows · dim, or -1 past int64. */
static int64_t accumulator_size(rows_extent x, int64_t heads, int64_t dim) {
    int64_t n;
    if (__builtin_mul_overflow(x.slots, heads, &n) || __builtin_mul_overflow(n, x.rows, &n) ||
        __builtin_mul_overflow(n, dim, &n))
        return -1;
    return n;
}

static void scratch_free(scratch *w) {
    double *all[] = {w->score, w->softcap_d, w->prob, w->dprob, w->dq_row, w->dk, w->dv, w->dsink};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) af_free(all[i]);
    af_free(w->mod_regs);
    af_free(w->raw);
    af_free(w->aux_regs);
    for (int32_t a = 0; w->aux_grads && a < w->n_aux; a++) af_free(w->aux_grads[a]);
    af_free(w->aux_grads);
}

static af_status scratch_alloc(const af_backward_problem *bp, scratch *w) {
    const af_problem *p = &bp->f;
    memset(w, 0, sizeof *w);
    const rows_extent keys = key_rows(p);
    const int64_t dk_size = accumulator_size(keys, p->Hkv, p->E), dv_size = accumulator_size(keys, p->Hkv, p->Ev);
    const int64_t S = p->B > 0 && p->Hq > 0 && p->L > 0 ? p->S : 0;   /* no row: no row scratch (S may be absurd) */
    bool ok = dk_size >= 0 && dv_size >= 0 && alloc_doubles(&w->score, S) && alloc_doubles(&w->softcap_d, S) &&
              alloc_doubles(&w->prob, S) && alloc_doubles(&w->dprob, S) && alloc_doubles(&w->dq_row, p->E);
    ok = ok && (!bp->dk || alloc_doubles(&w->dk, dk_size)) && (!bp->dv || alloc_doubles(&w->dv, dv_size)) &&
         (!bp->dsink || alloc_doubles(&w->dsink, p->Hq));
    ok = ok && (!p->mods || (w->mod_regs = af_alloc(sizeof(float) * (af_mods_scratch_floats(p->mods, 1, MOD_RUN) +
                                                                       2 * MOD_RUN))));
    if (ok && bp->daux && p->mods && p->mods->has_score && p->mods->score.n_aux > 0) {
        w->n_aux = p->mods->score.n_aux;
        ok = (w->raw = af_alloc(sizeof(float) * count_or_one(S))) &&
             (w->aux_regs = af_alloc(sizeof(float) * (af_mods_aux_scratch_floats(p->mods, MOD_RUN) + 2 * MOD_RUN))) &&
             (w->aux_grads = af_alloc_zeroed(sizeof(float *) * (size_t)w->n_aux));
        for (int32_t a = 0; ok && a < w->n_aux; a++)
            ok = !bp->daux[a] ||
                 (w->aux_grads[a] = af_alloc_zeroed(sizeof(float) * count_or_one(af_mods_aux_numel(p->mods, a))));
    }
    if (ok) return AF_OK;
    scratch_free(w);
    return af_fail(AF_ERR_NO_MEMORY, "out of memory: reference backward scratch for S=%lld keys, E=%lld, Ev=%lld",
                   (long long)p->S, (long long)p->E, (long long)p->Ev);
}

/* Index of key j of sequence `seq`, kv head hk, in a dk / dv accumulator of head dim `dim`. */
static int64_t accumulator_row(const af_problem *p, int64_t b, int64_t hk, const af_sequence *seq, int64_t j,
                               int64_t dim) {
    const rows_extent keys = key_rows(p);
    const int64_t slot = p->cu_seqlens_k ? 0 : b;
    return ((slot * p->Hkv + hk) * keys.rows + seq->k0 + j) * dim;
}

/* af_flex_attn's mods on the row's scaled scores, rounded to float32 and evaluated as the kernels do, their
 * derivative d(score_mod)/d(score) into softcap_d (the reference's own part is the double arithmetic around them). */
static void apply_mods(const af_problem *p, int64_t b, int64_t h, int64_t i, int64_t S, scratch *w) {
    float *regs = w->mod_regs, *run = regs + af_mods_scratch_floats(p->mods, 1, MOD_RUN), *tangent = run + MOD_RUN;
    const int32_t h_row = (int32_t)h, q_row = (int32_t)i;
    for (int64_t j0 = 0; j0 < S; j0 += MOD_RUN) {
        const int n = S - j0 < MOD_RUN ? (int)(S - j0) : MOD_RUN;
        for (int j = 0; j < MOD_RUN; j++) run[j] = j < n ? (float)w->score[j0 + j] : 0.0f;
        for (int j = 0; w->raw && j < n; j++) w->raw[j0 + j] = run[j];
        af_mods_apply_tile_grad(p->mods, b, &h_row, &q_row, 1, j0, n, 1.0f, 0, run, MOD_RUN, tangent, MOD_RUN, regs, MOD_RUN);
        for (int j = 0; j < n; j++) {
            w->score[j0 + j] = run[j];
            if (p->mods->has_score) w->softcap_d[j0 + j] = tangent[j];
        }
    }
}

/* The row's scores as the forward reference forms them: scale·q·k, softcap (keeping its derivative), then causality
 * and window as -inf and the mask (bool: -inf; additive: added). */
static void row_scores(const af_problem *p, int64_t b, const af_sequence *seq, int64_t h, int64_t i, scratch *w) {
    const int64_t hk = h / p->group;
    int64_t lo, hi;
    af_key_range(p, seq->L, seq->S, i, &lo, &hi);
    const int64_t q_row = b * p->q_stride[0] + h * p->q_stride[1] + (seq->q0 + i) * p->q_stride[2];
    for (int64_t j = 0; j < seq->S; j++) {
        const int64_t k_row = af_kv_row_offset(p, p->k_stride, b, hk, seq, j);
        double dot = 0.0;
        for (int64_t e = 0; e < p->E; e++)
            dot += load(p->q, p->dtype, q_row + e * p->q_stride[3]) * load(p->k, p->kv_dtype, k_row + e * p->k_stride[3]);
        double score = p->scale * dot;
        w->softcap_d[j] = 1.0;
        if (p->softcap > 0.0) {
            const double t = tanh(score / p->softcap);
            score = p->softcap * t;
            w->softcap_d[j] = 1.0 - t * t;
        }
        if (!p->mods && (j < lo || j >= hi)) score = -INFINITY;   /* with mods: after them, as the kernels */
        if (p->mask) {
            const int64_t m = b * p->mask_stride[0] + h * p->mask_stride[1] + i * p->mask_stride[2] + j * p->mask_stride[3];
            const double mv = load(p->mask, p->mask_dtype, m);
            if (p->mask_dtype == AF_BOOL) score = mv != 0.0 ? score : -INFINITY;
            else score += mv;
        }
        w->score[j] = score;
    }
    if (!p->mods) return;
    apply_mods(p, b, h, i, seq->S, w);
    for (int64_t j = 0; j < seq->S; j++)
        if (j < lo || j >= hi) w->score[j] = -INFINITY;
}

/* The sink's logit of head h; -inf without one (it then adds nothing to the denominator). */
static double sink_logit(const af_problem *p, int64_t h) {
    return p->sink ? load(p->sink, p->sink_dtype, h * p->sink_stride) : -INFINITY;
}

/* lse over the scores and the sink, as the forward reference computes it: -inf when the row sees no key and has no
 * sink, NaN when a score or the sink is NaN. */
static double row_lse(const double *score, int64_t S, double sink) {
    double row_max = sink;
    bool has_nan = isnan(sink);
    for (int64_t j = 0; j < S; j++) {
        if (isnan(score[j])) has_nan = true;
        else if (score[j] > row_max) row_max = score[j];
    }
    if (has_nan) return NAN;
    if (row_max == -INFINITY) return -INFINITY;
    double sum = sink == -INFINITY ? 0.0 : exp(sink - row_max);
    for (int64_t j = 0; j < S; j++) sum += exp(score[j] - row_max);
    return row_max + log(sum);
}

/* p_j, dp_j = dout_i · v_j, and D = Σ_j p_j·dp_j (from this P, not from out). Keys with p_j = 0 contribute nothing,
 * even against Inf/NaN values, as in the forward reference. */
static double row_probs_and_d(const af_backward_problem *bp, int64_t b, const af_sequence *seq, int64_t h, int64_t i,
                              double lse, scratch *w) {
    const af_problem *p = &bp->f;
    const int64_t hk = h / p->group;
    const int64_t dout_row = b * bp->dout_stride[0] + h * bp->dout_stride[1] + (seq->q0 + i) * bp->dout_stride[2];
    double D = 0.0;
    for (int64_t j = 0; j < seq->S; j++) {
        w->prob[j] = exp(w->score[j] - lse);
        w->dprob[j] = 0.0;
        if (w->prob[j] == 0.0) continue;
        const int64_t v_row = af_kv_row_offset(p, p->v_stride, b, hk, seq, j);
        double dot = 0.0;
        for (int64_t e = 0; e < p->Ev; e++)
            dot += load(bp->dout, p->out_dtype, dout_row + e * bp->dout_stride[3]) *
                   load(p->v, p->kv_dtype, v_row + e * p->v_stride[3]);
        w->dprob[j] = dot;
        D += w->prob[j] * dot;
    }
    return D;
}

/* ds_j = p_j·(dp_j - D) through the softcap; dq_i = scale·Σ ds_j k_j; dk_j += scale·ds_j·q_i; dv_j += p_j·dout_i. */
static void row_gradients(const af_backward_problem *bp, int64_t b, const af_sequence *seq, int64_t h, int64_t i,
                          double D, scratch *w) {
    const af_problem *p = &bp->f;
    const int64_t hk = h / p->group;
    const int64_t q_row = b * p->q_stride[0] + h * p->q_stride[1] + (seq->q0 + i) * p->q_stride[2];
    const int64_t dout_row = b * bp->dout_stride[0] + h * bp->dout_stride[1] + (seq->q0 + i) * bp->dout_stride[2];
    for (int64_t e = 0; e < p->E; e++) w->dq_row[e] = 0.0;
    for (int64_t j = 0; j < seq->S; j++) {
        if (w->prob[j] == 0.0) continue;
        const double ds = w->prob[j] * (w->dprob[j] - D) * w->softcap_d[j];
        const int64_t k_row = af_kv_row_offset(p, p->k_stride, b, hk, seq, j);
        for (int64_t e = 0; e < p->E; e++)
            w->dq_row[e] += p->scale * ds * load(p->k, p->kv_dtype, k_row + e * p->k_stride[3]);
        if (w->dk) {
            double *dk = w->dk + accumulator_row(p, b, hk, seq, j, p->E);
            for (int64_t e = 0; e < p->E; e++)
                dk[e] += p->scale * ds * load(p->q, p->dtype, q_row + e * p->q_stride[3]);
        }
        if (w->dv) {
            double *dv = w->dv + accumulator_row(p, b, hk, seq, j, p->Ev);
            for (int64_t e = 0; e < p->Ev; e++)
                dv[e] += w->prob[j] * load(bp->dout, p->out_dtype, dout_row + e * bp->dout_stride[3]);
        }
    }
}

static void store_dq_row(const af_backward_problem *bp, int64_t b, const af_sequence *seq, int64_t h, int64_t i,
                         const double *dq_row) {
    const af_problem *p = &bp->f;
    const int64_t row = b * bp->dq_stride[0] + h * bp->dq_stride[1] + (seq->q0 + i) * bp->dq_stride[2];
    for (int64_t e = 0; e < p->E; e++) store(bp->dq, bp->dq_dtype, row + e * bp->dq_stride[3], dq_row[e]);
}

/* The row's share of the captured tensors' gradients: p_j·(dp_j - D), the gradient of the mods' value, through each
 * load (the kernels' interpreter, MOD_RUN keys at a time). */
static void aux_gradients(const af_problem *p, int64_t b, int64_t S, int64_t h, int64_t i, double D, scratch *w) {
    float *run = w->aux_regs + af_mods_aux_scratch_floats(p->mods, MOD_RUN), *g = run + MOD_RUN;
    const int32_t h_row = (int32_t)h, q_row = (int32_t)i;
    for (int64_t j0 = 0; j0 < S; j0 += MOD_RUN) {
        const int n = S - j0 < MOD_RUN ? (int)(S - j0) : MOD_RUN;
        for (int j = 0; j < n; j++) {
            run[j] = w->raw[j0 + j];
            g[j] = (float)(w->prob[j0 + j] * (w->dprob[j0 + j] - D));
        }
        af_mods_aux_grads_tile(p->mods, b, &h_row, &q_row, 1, j0, n, run, MOD_RUN, g, MOD_RUN, w->aux_grads,
                               w->aux_regs, MOD_RUN);
    }
}

/* One query row of head h: its P and D, its dq, its share of dk, dv and dsink. */
static void backward_row(const af_backward_problem *bp, int64_t b, const af_sequence *seq, int64_t h, int64_t i,
                         scratch *w) {
    const af_problem *p = &bp->f;
    row_scores(p, b, seq, h, i, w);
    const double sink = sink_logit(p, h);
    const double lse = row_lse(w->score, seq->S, sink);
    if (lse == -INFINITY) {   /* sees no key and has no sink: zero dq, no contribution */
        for (int64_t e = 0; e < p->E; e++) w->dq_row[e] = 0.0;
    } else {
        const double D = row_probs_and_d(bp, b, seq, h, i, lse, w);
        if (w->aux_grads) aux_gradients(p, b, seq->S, h, i, D, w);
        row_gradients(bp, b, seq, h, i, D, w);
        const double p_sink = exp(sink - lse);
        if (w->dsink && p_sink != 0.0) w->dsink[h] += -p_sink * D;   /* the sink is in the denominator only */
    }
    if (bp->dq) store_dq_row(bp, b, seq, h, i, w->dq_row);
}

/* Every element of dq to 0 first: packed rows outside every sequence are part of the tensor too. */
static void zero_dq(const af_backward_problem *bp) {
    const af_problem *p = &bp->f;
    const rows_extent x = query_rows(p);
    for (int64_t slot = 0; slot < x.slots; slot++)
        for (int64_t h = 0; h < p->Hq; h++)
            for (int64_t r = 0; r < x.rows; r++)
                for (int64_t e = 0; e < p->E; e++)
                    store(bp->dq, bp->dq_dtype,
                          slot * bp->dq_stride[0] + h * bp->dq_stride[1] + r * bp->dq_stride[2] + e * bp->dq_stride[3],
                          0.0);
}

/* A dk or dv accumulator to its tensor, every element (keys no row sees stay 0). */
static void store_key_gradient(const af_problem *p, const double *acc, int64_t dim, char *to, af_dtype dtype,
                               const int64_t *stride) {
    const rows_extent x = key_rows(p);
    for (int64_t slot = 0; slot < x.slots; slot++)
        for (int64_t hk = 0; hk < p->Hkv; hk++)
            for (int64_t r = 0; r < x.rows; r++) {
                const double *from = acc + ((slot * p->Hkv + hk) * x.rows + r) * dim;
                for (int64_t e = 0; e < dim; e++)
                    store(to, dtype, slot * stride[0] + hk * stride[1] + r * stride[2] + e * stride[3], from[e]);
            }
}

static void store_dsink(const af_backward_problem *bp, const double *dsink) {
    for (int64_t h = 0; h < bp->f.Hq; h++) store(bp->dsink, bp->f.sink_dtype, h * bp->dsink_stride, dsink[h]);
}

af_status af_reference_backward(const af_backward_problem *bp) {
    const af_problem *p = &bp->f;
    if (p->mods) af_mods_unfuse(p->mods);   /* every program in the interpreter: a fused kernel is checked against it */
    scratch w;
    af_status st = scratch_alloc(bp, &w);
    if (st != AF_OK) return st;
    if (bp->dq) zero_dq(bp);
    for (int64_t b = 0; b < p->B; b++) {
        const af_sequence seq = af_sequence_of(p, b);
        for (int64_t h = 0; h < p->Hq; h++)
            for (int64_t i = 0; i < seq.L; i++) backward_row(bp, b, &seq, h, i, &w);
    }
    if (bp->dk) store_key_gradient(p, w.dk, p->E, bp->dk, bp->dk_dtype, bp->dk_stride);
    if (bp->dv) store_key_gradient(p, w.dv, p->Ev, bp->dv, bp->dv_dtype, bp->dv_stride);
    if (bp->dsink) store_dsink(bp, w.dsink);
    for (int32_t a = 0; w.aux_grads && a < w.n_aux; a++) {   /* the captured tensors' gradients, row-major order */
        af_tensor *t = bp->daux[a];
        if (!t) continue;
        const int64_t n = af_mods_aux_numel(p->mods, a);
        for (int64_t e = 0; e < n; e++) af_mods_store_aux_grad(t, e, w.aux_grads[a][e]);
    }
    scratch_free(&w);
    return AF_OK;
}
