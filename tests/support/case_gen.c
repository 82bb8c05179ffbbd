#include "case_gen.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sdpa/problem.h"
#include "sdpa/tolerance.h"

const char *const mask_shapes[] = {"LS", "S", "1S", "11", "1", "", "L1", "HLS", "H1S", "1LS",
                                   "B1LS", "BHLS", "1111", "B11S", "1HL1", "BH1S", "B1L1"};
const int mask_shape_count = (int)(sizeof mask_shapes / sizeof mask_shapes[0]);

#define SPLIT_KV_MAX_ROWS 64      /* driver.c: split the keys when L·Hq/Hkv <= 64 ... */
#define SPLIT_KV_MIN_KEYS 1025    /* ... and S > 2·512 */

sdpa_case case_default(int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t E, int64_t Ev) {
    sdpa_case c = {.seed = 1, .dtype = AF_F32, .B = B, .Hq = Hq, .Hkv = Hkv, .L = L, .S = S, .E = E, .Ev = Ev,
                   .enable_gqa = Hq != Hkv, .mask_shape = "LS", .mask_keep = 0.75, .with_lse = true, .amplitude = 1.0};
    return c;
}

bool case_is_split_kv(const sdpa_case *c) {
    return c->Hkv > 0 && c->L * (c->Hq / c->Hkv) <= SPLIT_KV_MAX_ROWS && c->S >= SPLIT_KV_MIN_KEYS;
}

static const int64_t interesting_dims[] = {1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 96, 127, 128, 129, 200, 255, 256};

static int64_t random_head_dim(test_rng *rng, int64_t max) {
    int64_t d = rng_chance(rng, 0.5)
                    ? interesting_dims[rng_range(rng, 0, (int64_t)(sizeof interesting_dims / sizeof interesting_dims[0]) - 1)]
                    : rng_range(rng, 1, 256);
    return d > max ? rng_range(rng, 1, max) : d;
}

static double work(const sdpa_case *c) { return (double)c->B * c->Hq * c->L * c->S * (c->E + c->Ev); }

/* Shrink the case until the double reference stays cheap: batch first, then the longer sequence. */
static void fit_budget(sdpa_case *c, double budget) {
    while (work(c) > budget) {
        if (c->B > 1) c->B--;
        else if (c->L > c->S && c->L > 1) c->L = c->L * 3 / 4;
        else if (c->S > 1) c->S = c->S * 3 / 4;
        else break;
    }
}

static void random_sizes(sdpa_case *c, test_rng *rng) {
    c->B = rng_chance(rng, 0.04) ? 0 : rng_range(rng, 1, 3);
    c->L = rng_chance(rng, 0.04) ? 0 : rng_range(rng, 1, 80);
    c->S = rng_chance(rng, 0.04) ? 0 : rng_range(rng, 1, 160);
    c->E = random_head_dim(rng, 256);
    c->Ev = random_head_dim(rng, 256);
    fit_budget(c, 1.5e6);
}

/* Decode: few query rows per kv head, many keys, so driver.c splits the keys and merges the splits. */
static void split_kv_sizes(sdpa_case *c, test_rng *rng) {
    const int64_t group = c->Hq / c->Hkv;
    c->B = rng_range(rng, 1, 2);
    c->L = rng_range(rng, 1, SPLIT_KV_MAX_ROWS / group < 6 ? SPLIT_KV_MAX_ROWS / group : 6);
    c->S = rng_range(rng, SPLIT_KV_MIN_KEYS, 2600);
    c->E = random_head_dim(rng, 64);
    c->Ev = random_head_dim(rng, 64);
    while (work(c) > 4e6 && c->B * c->Hq > 1) {   /* keep S long: fewer heads instead */
        if (c->B > 1) c->B--;
        else if (c->L > 1) c->L--;
        else break;
    }
}

sdpa_case case_random(uint64_t seed, int index, int split_every) {
    static const int64_t heads[][2] = {{1, 1}, {2, 2}, {8, 8}, {2, 1}, {8, 2}, {8, 1}};
    test_rng rng = {seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(index + 1))};
    sdpa_case c = case_default(1, 1, 1, 1, 1, 1, 1);
    c.seed = rng_next(&rng);
    c.dtype = (af_dtype)(index % 3);
    const int kind = (index / 3) % 5;   /* none, top-left causal, bottom-right causal, bool mask, additive mask */
    c.is_causal = kind == 1;
    c.causal_bottom_right = kind == 2;
    c.mask = kind == 3 ? MASK_BOOL : kind == 4 ? MASK_ADDITIVE : MASK_NONE;
    const int group = index / 3, masked_ordinal = group / 5 * 2 + (kind == 4);   /* counts masked groups */
    c.mask_shape = mask_shapes[masked_ordinal % mask_shape_count];   /* every shape once in the first 17 masked groups */
    c.mask_expanded = c.mask != MASK_NONE && rng_chance(&rng, 0.25);
    c.mask_keep = c.mask == MASK_BOOL ? 0.3 + 0.65 * rng_uniform(&rng) : 0.9;
    c.masked_row_rate = 0.1;
    const int h = (int)rng_range(&rng, 0, 5);
    c.Hq = heads[h][0];
    c.Hkv = heads[h][1];
    c.enable_gqa = c.Hq != c.Hkv || rng_chance(&rng, 0.2);
    if (split_every > 0 && index % split_every == split_every - 1) split_kv_sizes(&c, &rng);
    else random_sizes(&c, &rng);
    c.has_scale = rng_chance(&rng, 0.3);
    c.scale = rng_chance(&rng, 0.1) ? 0.0 : (4.0 * rng_uniform(&rng) - 2.0) / sqrt((double)c.E);
    c.with_lse = rng_chance(&rng, 0.7);
    c.amplitude = rng_chance(&rng, 0.2) ? 3.0 : 1.0;
    c.q_layout = (tensor_layout)rng_range(&rng, 0, LAYOUT_COUNT - 1);
    c.k_layout = (tensor_layout)rng_range(&rng, 0, LAYOUT_COUNT - 1);
    c.v_layout = (tensor_layout)rng_range(&rng, 0, LAYOUT_COUNT - 1);
    c.out_layout = (tensor_layout)rng_range(&rng, 0, LAYOUT_COUNT - 1);
    c.mask_layout = (tensor_layout)rng_range(&rng, 0, LAYOUT_COUNT - 1);
    c.lse_layout = (tensor_layout)rng_range(&rng, 0, LAYOUT_COUNT - 1);
    return c;
}

void case_describe(const sdpa_case *c, char *buf, size_t size) {
    const char *causal = c->is_causal ? "top-left" : c->causal_bottom_right ? "bottom-right" : "none";
    char mask[64] = "none", scale[32] = "default";
    if (c->mask != MASK_NONE)
        snprintf(mask, sizeof mask, "%s(%s%s)", c->mask == MASK_BOOL ? "bool" : "additive", c->mask_shape,
                 c->mask_expanded ? ",expanded" : "");
    if (c->has_scale) snprintf(scale, sizeof scale, "%.4g", c->scale);
    snprintf(buf, size,
             "seed=%llu %s B=%lld Hq=%lld Hkv=%lld L=%lld S=%lld E=%lld Ev=%lld gqa=%d causal=%s mask=%s scale=%s "
             "lse=%s amp=%g layouts q=%s k=%s v=%s out=%s mask=%s lse=%s%s",
             (unsigned long long)c->seed, af_dtype_name(c->dtype), (long long)c->B, (long long)c->Hq,
             (long long)c->Hkv, (long long)c->L, (long long)c->S, (long long)c->E, (long long)c->Ev, c->enable_gqa,
             causal, mask, scale, c->with_lse ? "yes" : "no", c->amplitude, layout_name(c->q_layout),
             layout_name(c->k_layout), layout_name(c->v_layout), layout_name(c->out_layout),
             layout_name(c->mask_layout), layout_name(c->lse_layout), case_is_split_kv(c) ? " split-kv" : "");
}

/* The mask's own (un-broadcast) shape from its letters. */
static int mask_own_shape(const sdpa_case *c, int64_t *shape) {
    const int ndim = (int)strlen(c->mask_shape);
    for (int d = 0; d < ndim; d++) {
        switch (c->mask_shape[d]) {
        case 'B': shape[d] = c->B; break;
        case 'H': shape[d] = c->Hq; break;
        case 'L': shape[d] = c->L; break;
        case 'S': shape[d] = c->S; break;
        default: shape[d] = 1; break;
        }
    }
    return ndim;
}

/* Whole mask rows (every key of one query) masked, so tests meet rows that see no key. */
static void mask_whole_rows(test_tensor *m, test_rng *rng, double rate, double masked_value) {
    const int nd = m->view.ndim;
    if (tt_numel(m) == 0 || nd == 0) return;
    int64_t idx[AF_MAX_DIMS] = {0};
    bool masking = false;
    do {
        if (idx[nd - 1] == 0) masking = rng_chance(rng, rate);
        if (masking) tt_set(m, idx, masked_value);
    } while (tt_next_index(nd, m->view.shape, idx));
}

static void fill_mask(const sdpa_case *c, test_tensor *m, test_rng *rng) {
    if (c->mask == MASK_BOOL) {
        tt_fill_uniform(m, rng, c->mask_keep);
        mask_whole_rows(m, rng, c->masked_row_rate, 0.0);
        return;
    }
    if (tt_numel(m) == 0) return;
    int64_t idx[AF_MAX_DIMS] = {0};
    do tt_set(m, idx, rng_chance(rng, c->mask_keep) ? 6.0 * rng_uniform(rng) - 3.0 : -INFINITY);
    while (tt_next_index(m->view.ndim, m->view.shape, idx));
    mask_whole_rows(m, rng, c->masked_row_rate, -INFINITY);
}

/* The mask as a 4-D (B, Hq, L, S) view whose broadcast dims have stride 0 (like torch's expand). */
static void expand_mask(const sdpa_case *c, test_tensor *m) {
    const int64_t target[4] = {c->B, c->Hq, c->L, c->S};
    af_tensor own = m->view;
    for (int d = 0; d < 4; d++) {
        const int od = d - (4 - own.ndim);
        const bool broadcast = od < 0 || c->mask_shape[od] == '1';
        m->view.shape[d] = target[d];
        m->view.strides[d] = broadcast ? 0 : own.strides[od];
    }
    m->view.ndim = 4;
}

static bool build_mask(const sdpa_case *c, case_tensors *t, test_rng *rng) {
    int64_t shape[4];
    const int ndim = mask_own_shape(c, shape);
    if (!tt_alloc(&t->mask, c->mask == MASK_BOOL ? AF_BOOL : c->dtype, ndim, shape, c->mask_layout, rng)) return false;
    fill_mask(c, &t->mask, rng);
    if (c->mask_expanded) expand_mask(c, &t->mask);
    t->args.attn_mask = &t->mask.view;
    return true;
}

bool case_rerun_reference(case_tensors *t) {
    tt_fill_bytes(&t->ref_out, TT_SENTINEL_BYTE);
    tt_fill_bytes(&t->ref_lse, TT_SENTINEL_BYTE);
    return af_reference_f32(&t->args, &t->ref_out.view, t->c.with_lse ? &t->ref_lse.view : NULL) == AF_OK;
}

bool case_build(const sdpa_case *c, case_tensors *t) {
    memset(t, 0, sizeof *t);
    t->c = *c;
    test_rng rng = {c->seed};
    const int64_t qs[4] = {c->B, c->Hq, c->L, c->E}, ks[4] = {c->B, c->Hkv, c->S, c->E};
    const int64_t vs[4] = {c->B, c->Hkv, c->S, c->Ev}, os[4] = {c->B, c->Hq, c->L, c->Ev};
    if (!tt_alloc(&t->q, c->dtype, 4, qs, c->q_layout, &rng) || !tt_alloc(&t->k, c->dtype, 4, ks, c->k_layout, &rng) ||
        !tt_alloc(&t->v, c->dtype, 4, vs, c->v_layout, &rng) || !tt_alloc(&t->out, c->dtype, 4, os, c->out_layout, &rng) ||
        !tt_alloc(&t->lse, AF_F32, 3, os, c->lse_layout, &rng) ||
        !tt_alloc(&t->ref_out, AF_F32, 4, os, LAYOUT_CONTIGUOUS, &rng) ||
        !tt_alloc(&t->ref_lse, AF_F32, 3, os, LAYOUT_CONTIGUOUS, &rng))
        return false;
    tt_fill_uniform(&t->q, &rng, c->amplitude);
    tt_fill_uniform(&t->k, &rng, c->amplitude);
    tt_fill_uniform(&t->v, &rng, c->amplitude);
    t->args = (af_sdpa_args){.query = &t->q.view, .key = &t->k.view, .value = &t->v.view,
                             .is_causal = c->is_causal, .causal_bottom_right = c->causal_bottom_right,
                             .has_scale = c->has_scale, .scale = c->scale, .enable_gqa = c->enable_gqa};
    if (c->mask != MASK_NONE && !build_mask(c, t, &rng)) return false;
    return case_rerun_reference(t);
}

void case_free(case_tensors *t) {
    tt_free(&t->q);
    tt_free(&t->k);
    tt_free(&t->v);
    tt_free(&t->mask);
    tt_free(&t->out);
    tt_free(&t->lse);
    tt_free(&t->ref_out);
    tt_free(&t->ref_lse);
}

int case_suite_count(int default_count) {
    const char *env = getenv("ATTNFORGE_TEST_CASES");
    const int n = env ? atoi(env) : default_count;
    return n > 0 ? n : default_count;
}

uint64_t case_suite_seed(uint64_t default_seed) {
    const char *env = getenv("ATTNFORGE_TEST_SEED");
    return env ? strtoull(env, NULL, 10) : default_seed;
}

int case_first_threads(void) { return getenv("ATTNFORGE_TEST_LIGHT") ? 2 : 1; }

int case_isas(const char **names, int capacity) {
    const char *only = getenv("ATTNFORGE_TEST_ISAS");   /* a comma-separated subset (valgrind's runs), else all */
    int n = 0;
    for (int i = 0; af_isa_name(i) && n < capacity; i++) {
        const char *isa = af_isa_name(i);
        const size_t len = strlen(isa);
        bool listed = !only;
        for (const char *at = only; at && !listed && (at = strstr(at, isa)); at += len)
            listed = (at == only || at[-1] == ',') && (at[len] == ',' || at[len] == '\0');
        if (listed && af_isa_available(isa)) names[n++] = isa;
    }
    return n;
}

af_status case_run_kernel(case_tensors *t, const char *isa, int threads) {
    tt_fill_bytes(&t->out, TT_SENTINEL_BYTE);
    tt_fill_bytes(&t->lse, TT_SENTINEL_BYTE);
    af_status st = af_set_isa(isa);
    if (st != AF_OK) return st;
    af_set_num_threads(threads);
    return af_sdpa(&t->args, &t->out.view, t->c.with_lse ? &t->lse.view : NULL);
}

/* What af_error_bound needs: the largest |v|, and a bound on |logit| (scale·‖q‖·‖k‖ plus the largest |mask|). */
af_error_scale case_error_scale(const case_tensors *t) {
    double q_abs, q_norm, k_abs, k_norm, v_abs, v_norm, m_abs = 0.0, m_norm;
    tt_magnitudes(&t->q, &q_abs, &q_norm);
    tt_magnitudes(&t->k, &k_abs, &k_norm);
    tt_magnitudes(&t->v, &v_abs, &v_norm);
    if (t->args.attn_mask && t->args.attn_mask->dtype != AF_BOOL) tt_magnitudes(&t->mask, &m_abs, &m_norm);
    const double scale = t->c.has_scale ? t->c.scale : 1.0 / sqrt((double)t->c.E);
    return (af_error_scale){.value_max = v_abs, .logit_max = fabs(scale) * q_norm * k_norm + m_abs,
                            .E = t->c.E, .S = t->c.S};
}

static double lse_bound(const case_tensors *t, const af_error_scale *es, double ref) {
    af_error_scale unit = *es, none = *es;
    unit.value_max = 1.0;
    none.value_max = 0.0;
    return af_error_bound(t->c.dtype, 0.0, &unit) + af_error_bound(AF_F32, ref, &none);
}

double case_lse_bound(const case_tensors *t, double ref) {
    const af_error_scale es = case_error_scale(t);
    return lse_bound(t, &es, ref);
}

double case_out_bound(const case_tensors *t, double ref) {
    const af_error_scale es = case_error_scale(t);
    return af_error_bound(t->c.dtype, ref, &es);
}

/* Error of `got` against `want` in units of `bound`; infinite when NaN/Inf do not match exactly. */
static double error_ratio(double got, double want, double bound) {
    if (isnan(want) || isinf(want)) return (isnan(want) && isnan(got)) || got == want ? 0.0 : INFINITY;
    const double err = fabs(got - want);
    if (isnan(err)) return INFINITY;
    return err == 0.0 ? 0.0 : err / bound;
}

static bool compare_out(const case_tensors *t, const af_error_scale *es, double *worst, char *why, size_t size) {
    if (tt_numel(&t->out) == 0) return true;
    int64_t idx[4] = {0};
    do {
        const double got = tt_get(&t->out, idx), want = tt_get(&t->ref_out, idx);
        const double bound = af_error_bound(t->c.dtype, want, es), ratio = error_ratio(got, want, bound);
        if (ratio > *worst) *worst = ratio;
        if (ratio > 1.0) {
            snprintf(why, size, "out[%lld,%lld,%lld,%lld] = %.9g, reference %.9g, |error| %.3g > bound %.3g",
                     (long long)idx[0], (long long)idx[1], (long long)idx[2], (long long)idx[3], got, want,
                     fabs(got - want), bound);
            return false;
        }
    } while (tt_next_index(4, t->out.view.shape, idx));
    return true;
}

static bool compare_lse(const case_tensors *t, const af_error_scale *es, double *worst, char *why, size_t size) {
    if (!t->c.with_lse || tt_numel(&t->lse) == 0) return true;
    int64_t idx[3] = {0};
    do {
        const double got = tt_get(&t->lse, idx), want = tt_get(&t->ref_lse, idx);
        const double bound = lse_bound(t, es, want), ratio = error_ratio(got, want, bound);
        if (ratio > *worst) *worst = ratio;
        if (ratio > 1.0) {
            snprintf(why, size, "lse[%lld,%lld,%lld] = %.9g, reference %.9g, |error| %.3g > bound %.3g",
                     (long long)idx[0], (long long)idx[1], (long long)idx[2], got, want, fabs(got - want), bound);
            return false;
        }
    } while (tt_next_index(3, t->lse.view.shape, idx));
    return true;
}

bool case_matches_reference(const case_tensors *t, double *worst_ratio, char *why, size_t size) {
    const af_error_scale es = case_error_scale(t);
    double worst = 0.0;
    const bool ok = compare_out(t, &es, &worst, why, size) && compare_lse(t, &es, &worst, why, size);
    if (worst_ratio) *worst_ratio = worst;
    return ok;
}

typedef struct { unsigned char *out, *lse; } run_copy;

/* One ISA and thread count: status, no stray writes, the reference. */
static bool verify_run(case_tensors *t, const char *isa, int threads, char *why, size_t size) {
    char detail[512] = "";
    const af_status st = case_run_kernel(t, isa, threads);
    if (st != AF_OK) snprintf(detail, sizeof detail, "status %s: %s", af_status_name(st), af_last_error());
    else if (!tt_outside_view_is(&t->out, TT_SENTINEL_BYTE)) snprintf(detail, sizeof detail, "wrote outside out's view");
    else if (t->c.with_lse && !tt_outside_view_is(&t->lse, TT_SENTINEL_BYTE))
        snprintf(detail, sizeof detail, "wrote outside lse's view");
    else if (case_matches_reference(t, NULL, detail, sizeof detail)) return true;
    snprintf(why, size, "isa %s, %d thread(s): %s", isa, threads, detail);
    return false;
}

bool case_verify_everywhere(case_tensors *t, char *why, size_t size) {
    const char *isas[CASE_MAX_ISAS];
    const int n = case_isas(isas, CASE_MAX_ISAS);
    unsigned char *inputs[4] = {tt_snapshot(&t->q), tt_snapshot(&t->k), tt_snapshot(&t->v), tt_snapshot(&t->mask)};
    bool ok = n > 0;
    if (!ok) snprintf(why, size, "no ISA available");
    for (int i = 0; i < n && ok; i++) {
        run_copy first = {NULL, NULL};
        for (int threads = case_first_threads(); threads <= 2 && ok; threads++) {
            ok = verify_run(t, isas[i], threads, why, size);
            if (ok && !first.out) {
                first.out = tt_snapshot(&t->out);
                first.lse = tt_snapshot(&t->lse);
            } else if (ok && (!tt_same_as(&t->out, first.out) || !tt_same_as(&t->lse, first.lse))) {
                snprintf(why, size, "isa %s: 2 threads give different bits from 1 thread", isas[i]);
                ok = false;
            }
        }
        free(first.out);
        free(first.lse);
    }
    const test_tensor *in[4] = {&t->q, &t->k, &t->v, &t->mask};
    for (int i = 0; i < 4; i++) {
        if (ok && !tt_same_as(in[i], inputs[i])) {
            snprintf(why, size, "an input (#%d of q, k, v, mask) changed", i);
            ok = false;
        }
        free(inputs[i]);
    }
    return ok;
}
