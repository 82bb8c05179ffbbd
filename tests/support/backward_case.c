#include "backward_case.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sdpa/tolerance.h"

grad_layouts backward_random_layouts(uint64_t seed) {
    test_rng rng = {seed};
    grad_layouts l;
    l.dout = (tensor_layout)rng_range(&rng, 0, LAYOUT_COUNT - 1);
    l.dq = (tensor_layout)rng_range(&rng, 0, LAYOUT_COUNT - 1);
    l.dk = (tensor_layout)rng_range(&rng, 0, LAYOUT_COUNT - 1);
    l.dv = (tensor_layout)rng_range(&rng, 0, LAYOUT_COUNT - 1);
    return l;
}

/* A float32 contiguous copy of `src` (f16/bf16 values are exact in f32; a broadcast view becomes a full one). */
static bool copy_f32(const test_tensor *src, test_tensor *dst, test_rng *rng) {
    if (!tt_alloc(dst, AF_F32, src->view.ndim, src->view.shape, LAYOUT_CONTIGUOUS, rng)) return false;
    if (tt_numel(src) == 0) return true;
    int64_t idx[AF_MAX_DIMS] = {0};
    do tt_set(dst, idx, tt_get(src, idx));
    while (tt_next_index(src->view.ndim, src->view.shape, idx));
    return true;
}

static bool alloc_like(test_tensor *t, const af_tensor *like, af_dtype dtype, tensor_layout layout, test_rng *rng) {
    return tt_alloc(t, dtype, like->ndim, like->shape, layout, rng);
}

static void fill_value(test_tensor *t, double value) {
    if (tt_numel(t) == 0) return;
    int64_t idx[AF_MAX_DIMS] = {0};
    do tt_set(t, idx, value);
    while (tt_next_index(t->view.ndim, t->view.shape, idx));
}

/* dout (random, the input dtype) and its float32 copy, dout = 1 for the column sums, the fast path's gradients in the
 * chosen layouts, the reference's float32 contiguous ones. */
static bool build_gradients(backward_tensors *t, const af_tensor *q, const af_tensor *k, const af_tensor *v,
                            const af_tensor *out, const af_tensor *sink, const grad_layouts *l, test_rng *rng) {
    if (!alloc_like(&t->dout, out, out->dtype, l->dout, rng)) return false;
    tt_fill_uniform(&t->dout, rng, 1.0);
    if (!copy_f32(&t->dout, &t->dout32, rng) || !alloc_like(&t->ones32, out, AF_F32, LAYOUT_CONTIGUOUS, rng) ||
        !alloc_like(&t->dq, q, q->dtype, l->dq, rng) || !alloc_like(&t->dk, k, k->dtype, l->dk, rng) ||
        !alloc_like(&t->dv, v, v->dtype, l->dv, rng) || !alloc_like(&t->ref_dq, q, AF_F32, LAYOUT_CONTIGUOUS, rng) ||
        !alloc_like(&t->ref_dk, k, AF_F32, LAYOUT_CONTIGUOUS, rng) ||
        !alloc_like(&t->ref_dv, v, AF_F32, LAYOUT_CONTIGUOUS, rng) ||
        !alloc_like(&t->column_sum, v, AF_F32, LAYOUT_CONTIGUOUS, rng))
        return false;
    fill_value(&t->ones32, 1.0);
    if (sink && (!alloc_like(&t->dsink, sink, sink->dtype, LAYOUT_SLICED, rng) ||
                 !alloc_like(&t->ref_dsink, sink, AF_F32, LAYOUT_CONTIGUOUS, rng)))
        return false;
    t->grads = (af_gradients){.dq = &t->dq.view, .dk = &t->dk.view, .dv = &t->dv.view,
                              .dsink = sink ? &t->dsink.view : NULL};
    return true;
}

static af_status reference_call(const backward_tensors *t, const af_backward_inputs *in, const af_gradients *grads) {
    return t->flash ? af_flash_attn_backward_reference(&t->f.ref_args, in, grads)
                    : af_sdpa_backward_reference(&t->ref_sdpa, in, grads);
}

/* The reference gradients on the float32 copies, and R_j = Σ_i P_ij as dv for dout = 1. */
static bool run_reference(backward_tensors *t) {
    const af_tensor *out = t->flash ? &t->f.ref_out.view : &t->s.ref_out.view;
    const af_tensor *lse = t->flash ? &t->f.ref_lse.view : &t->s.ref_lse.view;
    const af_backward_inputs in = {.out = out, .dout = &t->dout32.view, .lse = lse};
    const af_backward_inputs ones = {.out = out, .dout = &t->ones32.view, .lse = lse};
    const af_gradients grads = {.dq = &t->ref_dq.view, .dk = &t->ref_dk.view, .dv = &t->ref_dv.view,
                                .dsink = t->grads.dsink ? &t->ref_dsink.view : NULL};
    const af_gradients column = {.dv = &t->column_sum.view};
    return reference_call(t, &in, &grads) == AF_OK && reference_call(t, &ones, &column) == AF_OK;
}

bool backward_build_sdpa(const sdpa_case *c0, const grad_layouts *layouts, uint64_t seed, backward_tensors *t) {
    memset(t, 0, sizeof *t);
    sdpa_case c = *c0;
    c.with_lse = true;   /* the backward needs the forward's lse */
    if (!case_build(&c, &t->s)) return false;
    test_rng rng = {seed};
    if (af_sdpa(&t->s.args, &t->s.out.view, &t->s.lse.view) != AF_OK) return false;
    if (!copy_f32(&t->s.q, &t->q32, &rng) || !copy_f32(&t->s.k, &t->k32, &rng) || !copy_f32(&t->s.v, &t->v32, &rng))
        return false;
    t->ref_sdpa = t->s.args;
    t->ref_sdpa.query = &t->q32.view;
    t->ref_sdpa.key = &t->k32.view;
    t->ref_sdpa.value = &t->v32.view;
    if (c.mask == MASK_ADDITIVE) {   /* additive masks are in the query's dtype */
        if (!copy_f32(&t->s.mask, &t->mask32, &rng)) return false;
        t->ref_sdpa.attn_mask = &t->mask32.view;
    }
    if (!build_gradients(t, &t->s.q.view, &t->s.k.view, &t->s.v.view, &t->s.out.view, NULL, layouts, &rng))
        return false;
    t->in = (af_backward_inputs){.out = &t->s.out.view, .dout = &t->dout.view, .lse = &t->s.lse.view};
    return run_reference(t);
}

bool backward_build_flash(const flash_case *c0, const grad_layouts *layouts, uint64_t seed, backward_tensors *t) {
    memset(t, 0, sizeof *t);
    t->flash = true;
    flash_case c = *c0;
    c.with_lse = true;
    if (!flash_case_build(&c, &t->f)) return false;
    test_rng rng = {seed};
    if (af_flash_attn(&t->f.args, &t->f.out.view, &t->f.lse.view) != AF_OK) return false;
    if (!build_gradients(t, &t->f.q.view, &t->f.k.view, &t->f.v.view, &t->f.out.view,
                         c.sink ? &t->f.sink.view : NULL, layouts, &rng))
        return false;
    t->in = (af_backward_inputs){.out = &t->f.out.view, .dout = &t->dout.view, .lse = &t->f.lse.view};
    return run_reference(t);
}

void backward_free(backward_tensors *t) {
    if (t->flash) flash_case_free(&t->f);
    else case_free(&t->s);
    test_tensor *all[] = {&t->dout, &t->dq, &t->dk, &t->dv, &t->dsink, &t->q32, &t->k32, &t->v32, &t->mask32,
                          &t->dout32, &t->ones32, &t->ref_dq, &t->ref_dk, &t->ref_dv, &t->ref_dsink, &t->column_sum};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tt_free(all[i]);
}

af_status backward_run(backward_tensors *t, const char *isa, int threads) {
    test_tensor *grads[4] = {&t->dq, &t->dk, &t->dv, &t->dsink};
    for (int i = 0; i < 4; i++)
        if (grads[i]->memory) tt_fill_bytes(grads[i], TT_SENTINEL_BYTE);
    const af_status st = af_set_isa(isa);
    if (st != AF_OK) return st;
    af_set_num_threads(threads);
    return t->flash ? af_flash_attn_backward(&t->f.args, &t->in, &t->grads)
                    : af_sdpa_backward(&t->s.args, &t->in, &t->grads);
}

/* ---------------------------------------------------------------- the bound (backward_case.h) */

typedef struct {
    double epsilon;                /* relative error of one term */
    double dq, dk, dv, dsink;      /* A of each gradient (dk, dv: times R_j) */
    af_dtype dtype, sink_dtype;
} grad_bound;

static double unit_roundoff(af_dtype dtype) {
    return ldexp(1.0, dtype == AF_F16 ? -11 : dtype == AF_BF16 ? -8 : -24);
}

/* The spacing of the dtype's subnormals: f16 rounds |x| < 2^-14 to multiples of 2^-24, not relative to |x|. */
static double subnormal_spacing(af_dtype dtype) {
    return ldexp(1.0, dtype == AF_F16 ? -24 : dtype == AF_BF16 ? -133 : -149);
}

static double max_abs(const test_tensor *t) {
    double a, n;
    tt_magnitudes(t, &a, &n);
    return a;
}

static double max_row_norm(const test_tensor *t) {
    double a, n;
    tt_magnitudes(t, &a, &n);
    return n;
}

/* The sizes and logit bound of the case: keys and query rows of the longest sequence, rows per head in all. */
typedef struct { double scale, logit_max; int64_t E, Ev, S, rows, total_rows, group; af_dtype dtype; } case_sizes;

static case_sizes sizes_of(const backward_tensors *t) {
    case_sizes z;
    if (!t->flash) {
        const sdpa_case *c = &t->s.c;
        z = (case_sizes){.scale = c->has_scale ? c->scale : 1.0 / sqrt((double)c->E), .E = c->E, .Ev = c->Ev,
                         .S = c->S, .rows = c->L, .total_rows = c->B * c->L, .group = c->Hkv ? c->Hq / c->Hkv : 1,
                         .dtype = c->dtype};
        z.logit_max = case_error_scale(&t->s).logit_max;
        return z;
    }
    const flash_case *c = &t->f.c;
    z = (case_sizes){.scale = c->has_scale ? c->scale : 1.0 / sqrt((double)c->E), .E = c->E, .Ev = c->Ev,
                     .group = c->Hkv ? c->Hq / c->Hkv : 1, .dtype = c->dtype};
    for (int b = 0; b < c->B; b++) {
        z.S = c->Sk[b] > z.S ? c->Sk[b] : z.S;
        z.rows = c->Lq[b] > z.rows ? c->Lq[b] : z.rows;
        z.total_rows += c->Lq[b];
    }
    double logit = fabs(z.scale) * max_row_norm(&t->f.q32) * max_row_norm(&t->f.k32);
    if (c->softcap > 0.0 && logit > 2.0 * c->softcap) logit = 2.0 * c->softcap;   /* as flash_case.c's bound */
    z.logit_max = logit + (c->sink ? max_abs(&t->f.sink32) : 0.0);
    return z;
}

static grad_bound bound_of(const backward_tensors *t) {
    const case_sizes z = sizes_of(t);
    const test_tensor *q = t->flash ? &t->f.q32 : &t->q32, *k = t->flash ? &t->f.k32 : &t->k32;
    const test_tensor *v = t->flash ? &t->f.v32 : &t->v32;
    const double u32 = ldexp(1.0, -24);
    const af_error_scale unit = {.value_max = 1.0, .logit_max = z.logit_max, .E = z.E, .S = z.S > 0 ? z.S : 1};
    grad_bound g = {.dtype = z.dtype, .sink_dtype = t->flash ? t->f.c.sink_dtype : AF_F32};
    g.epsilon = af_error_bound(z.dtype, 0.0, &unit) + 2.0 * unit_roundoff(z.dtype) +
                4.0 * u32 * (sqrt((double)z.Ev) + sqrt((double)(z.rows * z.group + z.S)));
    const double dout_v = max_row_norm(&t->dout32) * max_row_norm(v);
    g.dq = 2.0 * fabs(z.scale) * max_abs(k) * dout_v;
    g.dk = 2.0 * fabs(z.scale) * max_abs(q) * dout_v;
    g.dv = max_abs(&t->dout32);
    g.dsink = dout_v * (double)z.total_rows;
    return g;
}

/* |got - want| <= 2·u·|want| + epsilon·A (+ two subnormal spacings of the dtype); NaN and infinities must match exactly. */
static bool within(double got, double want, double bound) {
    if (isnan(want) || isinf(want)) return (isnan(want) && isnan(got)) || got == want;
    return fabs(got - want) <= bound;
}

/* One gradient against its reference; `column_sum` (dk, dv) scales A by R_j of the element's key. */
static bool compare_gradient(const test_tensor *got, const test_tensor *want, const test_tensor *column_sum, double A,
                             double epsilon, const char *name, char *why, size_t size) {
    if (!got->memory || tt_numel(got) == 0) return true;
    const int nd = got->view.ndim;
    const double u = unit_roundoff(got->view.dtype);
    int64_t idx[AF_MAX_DIMS] = {0};
    do {
        double scale = A;
        if (column_sum) {
            int64_t key[AF_MAX_DIMS];
            memcpy(key, idx, sizeof key);
            key[nd - 1] = 0;
            scale *= tt_numel(column_sum) > 0 ? tt_get(column_sum, key) : 0.0;
        }
        const double g = tt_get(got, idx), w = tt_get(want, idx), bound = 2.0 * u * fabs(w) + epsilon * scale +
                            2.0 * subnormal_spacing(got->view.dtype);
        if (!within(g, w, bound)) {
            snprintf(why, size, "%s[%lld,%lld,%lld,%lld] = %.9g, reference %.9g, |error| %.3g > bound %.3g", name,
                     (long long)idx[0], (long long)(nd > 1 ? idx[1] : 0), (long long)(nd > 2 ? idx[2] : 0),
                     (long long)(nd > 3 ? idx[3] : 0), g, w, fabs(g - w), bound);
            return false;
        }
    } while (tt_next_index(nd, got->view.shape, idx));
    return true;
}

bool backward_matches(const backward_tensors *t, char *why, size_t size) {
    const grad_bound g = bound_of(t);
    return compare_gradient(&t->dq, &t->ref_dq, NULL, g.dq, g.epsilon, "dq", why, size) &&
           compare_gradient(&t->dk, &t->ref_dk, &t->column_sum, g.dk, g.epsilon, "dk", why, size) &&
           compare_gradient(&t->dv, &t->ref_dv, &t->column_sum, g.dv, g.epsilon, "dv", why, size) &&
           (!t->grads.dsink || compare_gradient(&t->dsink, &t->ref_dsink, NULL, g.dsink, g.epsilon, "dsink", why, size));
}

/* ---------------------------------------------------------------- every ISA and thread count */

enum { N_GRADS = 4, N_INPUTS = 12 };

static int inputs_of(backward_tensors *t, const test_tensor **in) {
    int n = 0;
    in[n++] = &t->dout;
    if (t->flash) {
        const test_tensor *f[] = {&t->f.q, &t->f.k, &t->f.v, &t->f.out, &t->f.lse, &t->f.sink, &t->f.cu_q, &t->f.cu_k,
                                  &t->f.seqused_k};
        for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) in[n++] = f[i];
    } else {
        const test_tensor *s[] = {&t->s.q, &t->s.k, &t->s.v, &t->s.mask, &t->s.out, &t->s.lse};
        for (size_t i = 0; i < sizeof s / sizeof s[0]; i++) in[n++] = s[i];
    }
    return n;
}

/* One ISA and thread count: status, nothing outside the views, the reference. */
static bool verify_run(backward_tensors *t, const char *isa, int threads, char *detail, size_t size) {
    const af_status st = backward_run(t, isa, threads);
    if (st != AF_OK) {
        snprintf(detail, size, "status %s: %s", af_status_name(st), af_last_error());
        return false;
    }
    const test_tensor *grads[N_GRADS] = {&t->dq, &t->dk, &t->dv, &t->dsink};
    static const char *const names[N_GRADS] = {"dq", "dk", "dv", "dsink"};
    for (int i = 0; i < N_GRADS; i++)
        if (grads[i]->memory && !tt_outside_view_is(grads[i], TT_SENTINEL_BYTE)) {
            snprintf(detail, size, "wrote outside %s's view", names[i]);
            return false;
        }
    return backward_matches(t, detail, size);
}

/* Every gradient bitwise equal to the first thread count's. */
static bool same_bits(backward_tensors *t, unsigned char **first) {
    const test_tensor *grads[N_GRADS] = {&t->dq, &t->dk, &t->dv, &t->dsink};
    for (int i = 0; i < N_GRADS; i++)
        if (grads[i]->memory && !tt_same_as(grads[i], first[i])) return false;
    return true;
}

static bool verify_isa(backward_tensors *t, const char *isa, char *why, size_t size) {
    unsigned char *first[N_GRADS] = {NULL};
    const test_tensor *grads[N_GRADS] = {&t->dq, &t->dk, &t->dv, &t->dsink};
    bool ok = true;
    const int first_threads = case_first_threads();
    for (int threads = first_threads; threads <= 3 && ok; threads++) {
        char detail[512] = "";
        ok = verify_run(t, isa, threads, detail, sizeof detail);
        if (ok && threads == first_threads) {
            for (int i = 0; i < N_GRADS; i++) first[i] = grads[i]->memory ? tt_snapshot(grads[i]) : NULL;
        } else if (ok && !same_bits(t, first)) {
            snprintf(detail, sizeof detail, "%d threads give different bits from %d", threads, first_threads);
            ok = false;
        }
        if (!ok) snprintf(why, size, "isa %s, %d thread(s): %s", isa, threads, detail);
    }
    for (int i = 0; i < N_GRADS; i++) free(first[i]);
    return ok;
}

bool backward_verify_everywhere(backward_tensors *t, char *why, size_t size) {
    const char *isas[CASE_MAX_ISAS];
    const int n = case_isas(isas, CASE_MAX_ISAS);
    char before[32];
    snprintf(before, sizeof before, "%s", af_get_isa());
    const test_tensor *in[N_INPUTS];
    const int n_in = inputs_of(t, in);
    unsigned char *snap[N_INPUTS];
    for (int i = 0; i < n_in; i++) snap[i] = tt_snapshot(in[i]);
    bool ok = n > 0;
    if (!ok) snprintf(why, size, "no ISA available");
    for (int i = 0; i < n && ok; i++) ok = verify_isa(t, isas[i], why, size);
    for (int i = 0; i < n_in; i++) {
        if (ok && !tt_same_as(in[i], snap[i])) {
            snprintf(why, size, "input #%d (dout, then q, k, v, ...) changed", i);
            ok = false;
        }
        free(snap[i]);
    }
    af_set_isa(before);
    af_set_num_threads(0);
    return ok;
}
