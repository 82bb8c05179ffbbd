/* Edge cases of SDPA's meaning, each on every ISA and thread count, each with an assertion that can fail:
 * rows that see no key, NaN/Inf propagation, huge logits, extreme head dims, lse, strided outputs, empty shapes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"
#include "case_gen.h"

static const af_dtype all_dtypes[] = {AF_F32, AF_F16, AF_BF16};

/* ------------------------------------------------------------------ helpers */

static void build(const sdpa_case *c, case_tensors *t) {
    if (!case_build(c, t)) fail_msg("could not build the case: %s", af_last_error());
}

static void rerun_reference(case_tensors *t) {
    if (!case_rerun_reference(t)) fail_msg("reference failed: %s", af_last_error());
}

static void verify(case_tensors *t) {
    char why[640] = "", desc[640];
    if (!case_verify_everywhere(t, why, sizeof why)) {
        case_describe(&t->c, desc, sizeof desc);
        fail_msg("%s\n    %s", desc, why);
    }
}

typedef enum { ROW_FINITE, ROW_EMPTY, ROW_NAN } row_expect;   /* EMPTY: out 0 and lse -inf, as documented */

/* What one output row (b, h, i) must be; ctx is the test's own description of where the special rows are. */
typedef row_expect (*row_rule)(const case_tensors *t, int64_t b, int64_t h, int64_t i, const void *ctx);

static void assert_row(const case_tensors *t, const test_tensor *out, const test_tensor *lse, int64_t b, int64_t h,
                       int64_t i, row_expect want, const char *who) {
    for (int64_t e = 0; e < t->c.Ev; e++) {
        const double x = tt_get(out, (int64_t[]){b, h, i, e});
        const bool ok = want == ROW_EMPTY ? x == 0.0 : want == ROW_NAN ? isnan(x) : isfinite(x);
        if (!ok) fail_msg("%s: out[%lld,%lld,%lld,%lld] = %g, expected %s", who, (long long)b, (long long)h,
                          (long long)i, (long long)e, x, want == ROW_EMPTY ? "0" : want == ROW_NAN ? "NaN" : "finite");
    }
    if (!t->c.with_lse) return;
    const double l = tt_get(lse, (int64_t[]){b, h, i});
    const bool ok = want == ROW_EMPTY ? l == -INFINITY : want == ROW_NAN ? isnan(l) : isfinite(l);
    if (!ok) fail_msg("%s: lse[%lld,%lld,%lld] = %g, expected %s", who, (long long)b, (long long)h, (long long)i, l,
                      want == ROW_EMPTY ? "-inf" : want == ROW_NAN ? "NaN" : "finite");
}

static void assert_rows(const case_tensors *t, const test_tensor *out, const test_tensor *lse, row_rule rule,
                        const void *ctx, const char *who) {
    for (int64_t b = 0; b < t->c.B; b++)
        for (int64_t h = 0; h < t->c.Hq; h++)
            for (int64_t i = 0; i < t->c.L; i++) assert_row(t, out, lse, b, h, i, rule(t, b, h, i, ctx), who);
}

/* The reference and af_sdpa (every ISA, 1 and 2 threads) agree, and both obey `rule` row by row. */
static void expect_rows(case_tensors *t, row_rule rule, const void *ctx) {
    verify(t);
    assert_rows(t, &t->ref_out, &t->ref_lse, rule, ctx, "reference");
    const char *isas[CASE_MAX_ISAS];
    const int n = case_isas(isas, CASE_MAX_ISAS);
    for (int k = 0; k < n; k++)
        for (int threads = case_first_threads(); threads <= 2; threads++) {
            assert_int_equal(case_run_kernel(t, isas[k], threads), AF_OK);
            assert_rows(t, &t->out, &t->lse, rule, ctx, isas[k]);
        }
}

static void set_all(test_tensor *x, double value) {
    if (tt_numel(x) == 0) return;
    int64_t idx[AF_MAX_DIMS] = {0};
    do tt_set(x, idx, value);
    while (tt_next_index(x->view.ndim, x->view.shape, idx));
}

static void make_positive(test_tensor *x) {   /* |x|, so that q·k with an infinite k element has a known sign */
    if (tt_numel(x) == 0) return;
    int64_t idx[AF_MAX_DIMS] = {0};
    do tt_set(x, idx, fabs(tt_get(x, idx)) + 0.125);
    while (tt_next_index(x->view.ndim, x->view.shape, idx));
}

static row_expect all_finite(const case_tensors *t, int64_t b, int64_t h, int64_t i, const void *ctx) {
    (void)t, (void)b, (void)h, (void)i, (void)ctx;
    return ROW_FINITE;
}

static row_expect all_empty(const case_tensors *t, int64_t b, int64_t h, int64_t i, const void *ctx) {
    (void)t, (void)b, (void)h, (void)i, (void)ctx;
    return ROW_EMPTY;
}

/* ------------------------------------------------------------------ rows that see no key */

typedef struct { int64_t b, i; } masked_row;   /* b < 0: every batch */
typedef struct { const masked_row *rows; int count; } masked_rows;

static row_expect listed_rows_empty(const case_tensors *t, int64_t b, int64_t h, int64_t i, const void *ctx) {
    (void)t, (void)h;
    const masked_rows *m = ctx;
    for (int r = 0; r < m->count; r++)
        if ((m->rows[r].b < 0 || m->rows[r].b == b) && m->rows[r].i == i) return ROW_EMPTY;
    return ROW_FINITE;
}

/* Mask rows: listed rows see nothing; every other row sees at least its key i % S. */
static void mask_rows(case_tensors *t, const masked_rows *m, double attend, double hide) {
    const test_tensor *mask = &t->mask;
    int64_t idx[4] = {0};
    const int nd = mask->view.ndim;
    do {
        const int64_t b = nd == 4 ? idx[0] : 0, i = idx[nd - 2], j = idx[nd - 1];
        const bool hidden_row = listed_rows_empty(t, b, 0, i, m) == ROW_EMPTY;
        if (hidden_row) tt_set(&t->mask, idx, hide);
        else if (j == i % t->c.S) tt_set(&t->mask, idx, attend);
    } while (tt_next_index(nd, mask->view.shape, idx));
    rerun_reference(t);
}

static void fully_masked_bool_rows_give_zero_and_neg_inf(void **state) {
    (void)state;
    static const masked_row rows[] = {{-1, 0}, {-1, 5}, {-1, 23}};
    const masked_rows m = {rows, 3};
    for (int d = 0; d < 3; d++) {
        sdpa_case c = case_default(2, 4, 2, 24, 70, 16, 12);
        c.dtype = all_dtypes[d];
        c.mask = MASK_BOOL;
        c.mask_shape = "LS";
        case_tensors t;
        build(&c, &t);
        mask_rows(&t, &m, 1.0, 0.0);
        expect_rows(&t, listed_rows_empty, &m);
        case_free(&t);
    }
}

static void fully_masked_additive_rows_give_zero_and_neg_inf(void **state) {
    (void)state;
    static const masked_row rows[] = {{1, 7}, {0, 0}};
    const masked_rows m = {rows, 2};
    for (int d = 0; d < 3; d++) {
        sdpa_case c = case_default(2, 2, 2, 9, 33, 8, 8);
        c.dtype = all_dtypes[d];
        c.mask = MASK_ADDITIVE;
        c.mask_shape = "B1LS";
        c.mask_keep = 0.6;   /* other -inf entries too: only whole -inf rows are empty */
        case_tensors t;
        build(&c, &t);
        mask_rows(&t, &m, 0.5, -INFINITY);
        expect_rows(&t, listed_rows_empty, &m);
        case_free(&t);
    }
}

/* Decode shape: the splits of the keys are merged; a batch whose keys are all padding is still empty. */
static void fully_masked_rows_through_split_kv(void **state) {
    (void)state;
    static const masked_row rows[] = {{1, 0}, {1, 1}};
    const masked_rows m = {rows, 2};
    sdpa_case c = case_default(2, 8, 2, 2, 1300, 16, 16);
    c.mask = MASK_BOOL;
    c.mask_shape = "B11S";   /* key padding */
    case_tensors t;
    build(&c, &t);
    assert_true(case_is_split_kv(&c));
    for (int64_t j = 0; j < c.S; j++) {
        tt_set(&t.mask, (int64_t[]){0, 0, 0, j}, j % 3 != 0);
        tt_set(&t.mask, (int64_t[]){1, 0, 0, j}, 0.0);
    }
    rerun_reference(&t);
    expect_rows(&t, listed_rows_empty, &m);
    case_free(&t);
}

static row_expect bottom_right_rows_before_overhang_empty(const case_tensors *t, int64_t b, int64_t h, int64_t i,
                                                           const void *ctx) {
    (void)b, (void)h, (void)ctx;
    return i < t->c.L - t->c.S ? ROW_EMPTY : ROW_FINITE;   /* row i sees keys j <= i + S - L */
}

static void bottom_right_causal_with_more_queries_than_keys(void **state) {
    (void)state;
    for (int d = 0; d < 3; d++) {
        sdpa_case c = case_default(2, 4, 2, 40, 10, 8, 12);
        c.dtype = all_dtypes[d];
        c.causal_bottom_right = true;
        case_tensors t;
        build(&c, &t);
        expect_rows(&t, bottom_right_rows_before_overhang_empty, NULL);
        case_free(&t);
    }
}

static void causal_decode_shapes_through_split_kv(void **state) {
    (void)state;
    for (int bottom_right = 0; bottom_right <= 1; bottom_right++) {
        sdpa_case c = case_default(1, 8, 2, 4, 1500, 32, 24);
        c.is_causal = !bottom_right;   /* top-left: row i sees i + 1 keys, so most splits see nothing */
        c.causal_bottom_right = bottom_right;
        case_tensors t;
        build(&c, &t);
        assert_true(case_is_split_kv(&c));
        expect_rows(&t, all_finite, NULL);
        case_free(&t);
    }
}

/* Top-left and bottom-right differ when L != S (so the comparison can tell them apart) and agree when L == S. */
static void causal_alignments_differ_unless_square(void **state) {
    (void)state;
    sdpa_case c = case_default(1, 2, 2, 20, 50, 8, 8);
    c.is_causal = true;
    case_tensors t;
    build(&c, &t);
    verify(&t);
    t.args.is_causal = false;
    t.args.causal_bottom_right = true;
    assert_int_equal(case_run_kernel(&t, "portable", 1), AF_OK);
    char why[512];
    assert_false(case_matches_reference(&t, NULL, why, sizeof why));   /* reference is still top-left's */
    case_free(&t);

    c = case_default(2, 2, 1, 37, 37, 8, 8);
    c.is_causal = true;
    build(&c, &t);
    verify(&t);
    unsigned char *top_left = tt_snapshot(&t.out);
    t.args.is_causal = false;
    t.args.causal_bottom_right = true;
    verify(&t);   /* same reference: L == S */
    const bool same = tt_same_as(&t.out, top_left);
    free(top_left);
    case_free(&t);
    assert_true(same);
}

/* ------------------------------------------------------------------ NaN and Inf in the inputs */

typedef struct { int64_t b, hk, i, j; } poisoned;   /* where the NaN/Inf sits: batch, kv head, query row, key */

static bool same_group(const case_tensors *t, int64_t h, int64_t hk) { return h / (t->c.Hq / t->c.Hkv) == hk; }

static row_expect nan_query_row_only(const case_tensors *t, int64_t b, int64_t h, int64_t i, const void *ctx) {
    const poisoned *p = ctx;
    (void)t;
    return b == p->b && h == p->hk && i == p->i ? ROW_NAN : ROW_FINITE;   /* here hk is the query head */
}

static void nan_in_query_poisons_its_row_only(void **state) {
    (void)state;
    for (int d = 0; d < 4; d++) {   /* the fourth: a decode shape, where every split of the row is NaN */
        sdpa_case c = d < 3 ? case_default(2, 4, 2, 30, 45, 16, 8) : case_default(2, 4, 2, 18, 1300, 16, 8);
        c.dtype = all_dtypes[d % 3];
        c.is_causal = d < 3;
        case_tensors t;
        build(&c, &t);
        assert_true(case_is_split_kv(&c) == (d == 3));
        const poisoned p = {1, 3, 17, 0};
        tt_set(&t.q, (int64_t[]){p.b, p.hk, p.i, 5}, NAN);
        rerun_reference(&t);
        expect_rows(&t, nan_query_row_only, &p);
        case_free(&t);
    }
}

/* Rows that see key p->j under the case's causality: NaN; every other row: finite. */
static row_expect rows_seeing_key_nan(const case_tensors *t, int64_t b, int64_t h, int64_t i, const void *ctx) {
    const poisoned *p = ctx;
    int64_t limit = t->c.S;
    if (t->c.is_causal) limit = i + 1;
    if (t->c.causal_bottom_right) limit = i + 1 + t->c.S - t->c.L;
    return b == p->b && same_group(t, h, p->hk) && p->j < limit ? ROW_NAN : ROW_FINITE;
}

static void nan_in_key_poisons_rows_that_see_it(void **state) {
    (void)state;
    for (int d = 0; d < 3; d++) {
        sdpa_case c = case_default(2, 8, 2, 70, 70, 12, 8);
        c.dtype = all_dtypes[d];
        c.is_causal = true;   /* rows i < j cannot see key j and stay finite */
        case_tensors t;
        build(&c, &t);
        const poisoned p = {0, 1, 0, 40};
        tt_set(&t.k, (int64_t[]){p.b, p.hk, p.j, 3}, NAN);
        rerun_reference(&t);
        expect_rows(&t, rows_seeing_key_nan, &p);
        case_free(&t);
    }
}

/* Split-KV: a NaN in the last split reaches only the row that sees it (bottom-right: the last row). */
static void nan_in_key_through_split_kv(void **state) {
    (void)state;
    sdpa_case c = case_default(1, 4, 1, 3, 1400, 16, 16);
    c.causal_bottom_right = true;
    case_tensors t;
    build(&c, &t);
    assert_true(case_is_split_kv(&c));
    const poisoned p = {0, 0, 0, c.S - 1};
    tt_set(&t.k, (int64_t[]){0, 0, p.j, 0}, NAN);
    rerun_reference(&t);
    expect_rows(&t, rows_seeing_key_nan, &p);
    case_free(&t);
}

/* +Inf in a key makes q·k = +inf (q > 0): softmax of +inf is inf - inf = NaN for every row that sees the key. */
static void inf_in_key_gives_nan_rows(void **state) {
    (void)state;
    for (int d = 0; d < 3; d++) {
        sdpa_case c = case_default(1, 2, 1, 50, 50, 8, 8);
        c.dtype = all_dtypes[d];
        c.is_causal = true;
        case_tensors t;
        build(&c, &t);
        make_positive(&t.q);
        const poisoned p = {0, 0, 0, 33};
        tt_set(&t.k, (int64_t[]){0, 0, p.j, 2}, INFINITY);
        rerun_reference(&t);
        expect_rows(&t, rows_seeing_key_nan, &p);
        case_free(&t);
    }
}

/* -Inf in a key makes q·k = -inf (q > 0): the key simply gets weight 0, as in PyTorch. */
static void neg_inf_in_key_acts_as_masked(void **state) {
    (void)state;
    sdpa_case c = case_default(1, 2, 1, 20, 64, 8, 8);
    case_tensors t;
    build(&c, &t);
    make_positive(&t.q);
    tt_set(&t.k, (int64_t[]){0, 0, 10, 2}, -INFINITY);
    rerun_reference(&t);
    expect_rows(&t, all_finite, NULL);
    case_free(&t);
}

/* NaN in v[j][e] reaches column e of the rows that see key j (here all), and no other column. */
static void nan_in_value_poisons_its_column(void **state) {
    (void)state;
    for (int d = 0; d < 3; d++) {
        sdpa_case c = case_default(2, 4, 2, 21, 90, 8, 6);
        c.dtype = all_dtypes[d];
        case_tensors t;
        build(&c, &t);
        const int64_t b = 1, hk = 0, j = 77, col = 4;
        tt_set(&t.v, (int64_t[]){b, hk, j, col}, NAN);
        rerun_reference(&t);
        verify(&t);
        const char *isas[CASE_MAX_ISAS];
        const int n = case_isas(isas, CASE_MAX_ISAS);
        for (int k = -1; k < n; k++) {   /* -1: the reference */
            const test_tensor *out = &t.ref_out;
            if (k >= 0) {
                assert_int_equal(case_run_kernel(&t, isas[k], 2), AF_OK);
                out = &t.out;
            }
            int64_t idx[4] = {0};
            do {
                const bool poisoned_cell = idx[0] == b && same_group(&t, idx[1], hk) && idx[3] == col;
                const double x = tt_get(out, idx);
                if (poisoned_cell ? !isnan(x) : !isfinite(x))
                    fail_msg("%s: out[%lld,%lld,%lld,%lld] = %g", k < 0 ? "reference" : isas[k], (long long)idx[0],
                             (long long)idx[1], (long long)idx[2], (long long)idx[3], x);
            } while (tt_next_index(4, out->view.shape, idx));
        }
        case_free(&t);
    }
}

/* ------------------------------------------------------------------ huge logits */

static double max_abs_dot(const case_tensors *t, double *min_dot, double *max_dot) {
    *min_dot = INFINITY;
    *max_dot = -INFINITY;
    const int64_t group = t->c.Hq / t->c.Hkv;
    for (int64_t b = 0; b < t->c.B; b++)
        for (int64_t h = 0; h < t->c.Hq; h++)
            for (int64_t i = 0; i < t->c.L; i++)
                for (int64_t j = 0; j < t->c.S; j++) {
                    double dot = 0.0;
                    for (int64_t e = 0; e < t->c.E; e++)
                        dot += tt_get(&t->q, (int64_t[]){b, h, i, e}) * tt_get(&t->k, (int64_t[]){b, h / group, j, e});
                    if (dot < *min_dot) *min_dot = dot;
                    if (dot > *max_dot) *max_dot = dot;
                }
    return fmax(fabs(*min_dot), fabs(*max_dot));
}

typedef enum { LOGITS_BOTH_SIGNS, LOGITS_ALL_NEGATIVE, LOGITS_ALL_POSITIVE } logit_sign;

/* Logits reaching 1e4 in magnitude (scale chosen for it): still within af_error_bound of the reference. */
static void run_huge_logits(af_dtype dtype, logit_sign sign) {
    sdpa_case c = case_default(1, 4, 2, 40, 90, 16, 16);
    c.dtype = dtype;
    c.is_causal = true;
    case_tensors t;
    build(&c, &t);
    if (sign != LOGITS_BOTH_SIGNS) {
        make_positive(&t.q);
        make_positive(&t.k);
    }
    double lo, hi;
    const double biggest = max_abs_dot(&t, &lo, &hi);
    t.args.has_scale = t.c.has_scale = true;
    t.args.scale = t.c.scale = (sign == LOGITS_ALL_NEGATIVE ? -1e4 : 1e4) / biggest;
    rerun_reference(&t);
    const double logit_lo = fmin(lo * t.c.scale, hi * t.c.scale), logit_hi = fmax(lo * t.c.scale, hi * t.c.scale);
    if (sign == LOGITS_BOTH_SIGNS) assert_true(logit_lo < -2e3 && logit_hi > 2e3);
    if (sign == LOGITS_ALL_NEGATIVE) assert_true(logit_hi < 0.0 && logit_lo <= -0.999e4);
    if (sign == LOGITS_ALL_POSITIVE) assert_true(logit_lo > 0.0 && logit_hi >= 0.999e4);
    expect_rows(&t, all_finite, NULL);
    case_free(&t);
}

static void logits_of_1e4_stay_within_bound(void **state) {
    (void)state;
    for (int d = 0; d < 3; d++)
        for (int s = LOGITS_BOTH_SIGNS; s <= LOGITS_ALL_POSITIVE; s++) run_huge_logits(all_dtypes[d], (logit_sign)s);
}

/* ------------------------------------------------------------------ head dims, lse, layouts */

static void run_dims(int64_t E, int64_t Ev, bool causal) {
    for (int d = 0; d < 3; d++) {
        sdpa_case c = case_default(1, 2, 1, 19, 41, E, Ev);
        c.dtype = all_dtypes[d];
        c.is_causal = causal;
        case_tensors t;
        build(&c, &t);
        expect_rows(&t, all_finite, NULL);
        case_free(&t);
    }
}

static void head_dim_256(void **state) {
    (void)state;
    run_dims(256, 256, true);
}

static void head_dim_1(void **state) {
    (void)state;
    run_dims(1, 1, false);
}

static void value_dim_differs_from_key_dim(void **state) {
    (void)state;
    run_dims(3, 200, true);
    run_dims(200, 5, false);
    run_dims(65, 17, true);
}

/* Ev = 0: out has no elements, lse is still every row's. A decode over split keys and interleaved heads whose V holds
 * no data at all (NULL, as a fuzzer passed it): nothing may address V, not even its prefetch (UBSan: no offset on a
 * null pointer). */
static void value_dim_zero_still_gives_lse(void **state) {
    (void)state;
    sdpa_case c = case_default(2, 2, 1, 5, 7, 4, 0);
    c.is_causal = true;
    case_tensors t;
    build(&c, &t);
    expect_rows(&t, all_finite, NULL);
    case_free(&t);
    c = case_default(1, 4, 2, 1, 1500, 8, 0);
    build(&c, &t);
    t.v.view.data = NULL;
    rerun_reference(&t);
    expect_rows(&t, all_finite, NULL);
    case_free(&t);
}

/* Decode over interleaved heads ((B,S,H,E) K/V views: items over all kv heads) in each of the driver's tile orders:
 * per head, and all heads' scores then all heads' values (f32, and 16-bit K/V at one or two rows per kv head);
 * several tiles and key splits, every dtype. */
static void decode_over_interleaved_heads_in_both_orders(void **state) {
    (void)state;
    const int64_t groups[3] = {1, 2, 4};
    for (int d = 0; d < 3; d++)
        for (int g = 0; g < 3; g++)
            for (int64_t L = 1; L <= 2; L++) {
                sdpa_case c = case_default(1, 4 * groups[g], 4, L, 1300, 64, 48);
                c.dtype = all_dtypes[d];
                c.enable_gqa = groups[g] > 1;
                c.q_layout = c.k_layout = c.v_layout = c.out_layout = LAYOUT_NHD;
                case_tensors t;
                build(&c, &t);
                verify(&t);
                case_free(&t);
            }
}

/* q = 0 makes every logit 0, so lse = ln(S) exactly in meaning: the natural log, not log2. */
static void lse_is_the_natural_log(void **state) {
    (void)state;
    for (int d = 0; d < 3; d++) {
        sdpa_case c = case_default(2, 4, 4, 6, 77, 8, 8);
        c.dtype = all_dtypes[d];
        c.lse_layout = LAYOUT_SLICED;
        case_tensors t;
        build(&c, &t);
        set_all(&t.q, 0.0);
        rerun_reference(&t);
        expect_rows(&t, all_finite, NULL);
        int64_t idx[3] = {0};
        do {
            const double got = tt_get(&t.lse, idx), want = log((double)c.S);
            if (fabs(got - want) > case_lse_bound(&t, want)) fail_msg("lse %g, want ln(S) = %g", got, want);
        } while (tt_next_index(3, t.lse.view.shape, idx));
        case_free(&t);
    }
}

static void lse_matches_reference_with_masks_and_causality(void **state) {
    (void)state;
    for (int d = 0; d < 3; d++)
        for (int kind = 0; kind < 4; kind++) {
            sdpa_case c = case_default(2, 8, 2, 33, 71, 24, 16);
            c.dtype = all_dtypes[d];
            c.is_causal = kind == 0;
            c.causal_bottom_right = kind == 1;
            c.mask = kind == 2 ? MASK_BOOL : kind == 3 ? MASK_ADDITIVE : MASK_NONE;
            c.mask_shape = "BHLS";
            c.lse_layout = LAYOUT_SLICED;
            case_tensors t;
            build(&c, &t);
            verify(&t);   /* compares lse too */
            case_free(&t);
        }
}

/* Replace out and lse by views with unusual strides: column-major, padded, inner stride 2 and 3. */
static void outputs_with_unusual_strides(void **state) {
    (void)state;
    static const int column_major[4] = {3, 2, 1, 0}, lse_order[3] = {2, 0, 1};
    static const int64_t out_pad[4] = {1, 0, 2, 1}, lse_pad[3] = {0, 3, 1};
    for (int d = 0; d < 3; d++) {
        sdpa_case c = case_default(2, 4, 2, 13, 29, 8, 7);
        c.dtype = all_dtypes[d];
        c.is_causal = true;
        case_tensors t;
        build(&c, &t);
        const int64_t os[4] = {c.B, c.Hq, c.L, c.Ev};
        tt_free(&t.out);
        tt_free(&t.lse);
        assert_true(tt_alloc_ordered(&t.out, c.dtype, 4, os, column_major, out_pad, 2, 3));
        assert_true(tt_alloc_ordered(&t.lse, AF_F32, 3, os, lse_order, lse_pad, 3, 1));
        expect_rows(&t, all_finite, NULL);
        case_free(&t);
    }
}

/* A size-1 dim's stride is irrelevant (PyTorch's rule): zero is fine for out's head dim when Hq = 1. */
static void out_with_zero_stride_on_a_unit_dim(void **state) {
    (void)state;
    sdpa_case c = case_default(2, 1, 1, 5, 9, 4, 4);
    case_tensors t;
    build(&c, &t);
    t.out.view.strides[1] = 0;
    expect_rows(&t, all_finite, NULL);
    case_free(&t);
}

/* q, k and v may be one and the same tensor (self-attention over one buffer). */
static void inputs_may_share_memory(void **state) {
    (void)state;
    sdpa_case c = case_default(1, 2, 2, 31, 31, 16, 16);
    c.is_causal = true;
    case_tensors t;
    build(&c, &t);
    t.args.key = t.args.value = &t.q.view;
    rerun_reference(&t);
    const test_tensor own_k = t.k, own_v = t.v;
    t.k = t.v = t.q;   /* the error scale and the input snapshots read the tensors actually passed */
    verify(&t);
    t.k = own_k;
    t.v = own_v;
    case_free(&t);
}

/* ------------------------------------------------------------------ the reference itself */

/* mask[b, h, i, j] with PyTorch's right-aligned broadcasting, read through the mask's own shape. */
static double mask_at(const test_tensor *m, int64_t b, int64_t h, int64_t i, int64_t j) {
    const int64_t full[4] = {b, h, i, j};
    int64_t idx[4] = {0};
    const int nd = m->view.ndim;
    for (int d = 0; d < nd; d++) idx[d] = m->view.shape[d] == 1 ? 0 : full[4 - nd + d];
    return tt_get(m, idx);
}

/* softmax(scale·q·kᵀ + mask)·v for one row, straight from SPEC §1, in double: out[e] and lse. */
static void textbook_row(const case_tensors *t, int64_t b, int64_t h, int64_t i, double *out, double *lse) {
    const sdpa_case *c = &t->c;
    const int64_t hk = h / (c->Hq / c->Hkv);
    const double scale = c->has_scale ? c->scale : 1.0 / sqrt((double)c->E);
    double score[256], top = -INFINITY, sum = 0.0;
    for (int64_t j = 0; j < c->S; j++) {
        double dot = 0.0;
        for (int64_t e = 0; e < c->E; e++) dot += tt_get(&t->q, (int64_t[]){b, h, i, e}) * tt_get(&t->k, (int64_t[]){b, hk, j, e});
        score[j] = scale * dot;
        if ((c->is_causal && j > i) || (c->causal_bottom_right && j > i + c->S - c->L)) score[j] = -INFINITY;
        if (c->mask == MASK_BOOL && mask_at(&t->mask, b, h, i, j) == 0.0) score[j] = -INFINITY;
        if (c->mask == MASK_ADDITIVE) score[j] += mask_at(&t->mask, b, h, i, j);
        top = fmax(top, score[j]);
    }
    for (int64_t e = 0; e < c->Ev; e++) out[e] = 0.0;
    *lse = -INFINITY;
    if (top == -INFINITY) return;   /* sees no key: 0 and -inf, as documented */
    for (int64_t j = 0; j < c->S; j++) sum += exp(score[j] - top);
    for (int64_t j = 0; j < c->S; j++)
        for (int64_t e = 0; e < c->Ev; e++) out[e] += exp(score[j] - top) / sum * tt_get(&t->v, (int64_t[]){b, hk, j, e});
    *lse = top + log(sum);
}

/* The reference every kernel is compared with is itself SDPA: checked against the formula, written out plainly. */
static void reference_is_sdpa_by_the_textbook(void **state) {
    (void)state;
    for (int kind = 0; kind < 6; kind++) {
        sdpa_case c = case_default(2, 4, 2, 7, 11, 5, 3);   /* GQA, L != S */
        c.is_causal = kind == 1;
        c.causal_bottom_right = kind == 2;
        c.mask = kind == 3 || kind == 5 ? MASK_BOOL : kind == 4 ? MASK_ADDITIVE : MASK_NONE;
        c.mask_shape = kind == 5 ? "H1S" : "B1LS";
        c.has_scale = kind == 4;
        c.scale = 0.7;
        case_tensors t;
        build(&c, &t);
        int64_t idx[3] = {0};
        do {
            double out[8], lse;
            textbook_row(&t, idx[0], idx[1], idx[2], out, &lse);
            for (int64_t e = 0; e < c.Ev; e++) {
                const double got = tt_get(&t.ref_out, (int64_t[]){idx[0], idx[1], idx[2], e});
                if (!(fabs(got - out[e]) <= case_out_bound(&t, out[e]) || got == out[e]))
                    fail_msg("kind %d: reference out %g, textbook %g", kind, got, out[e]);
            }
            const double got = tt_get(&t.ref_lse, idx);
            if (!(got == lse || fabs(got - lse) <= case_lse_bound(&t, lse)))
                fail_msg("kind %d: reference lse %g, textbook %g", kind, got, lse);
        } while (tt_next_index(3, t.ref_lse.view.shape, idx));
        case_free(&t);
    }
}

/* ------------------------------------------------------------------ empty shapes */

static void run_empty(int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, row_rule rule) {
    for (int d = 0; d < 3; d++) {
        sdpa_case c = case_default(B, Hq, Hkv, L, S, 8, 8);
        c.dtype = all_dtypes[d];
        c.is_causal = d == 1;
        c.enable_gqa = true;
        case_tensors t;
        build(&c, &t);
        expect_rows(&t, rule, NULL);
        assert_true(tt_outside_view_is(&t.out, TT_SENTINEL_BYTE));
        case_free(&t);
    }
}

static void zero_batch(void **state) {
    (void)state;
    run_empty(0, 4, 2, 8, 8, all_finite);
}

static void zero_queries(void **state) {
    (void)state;
    run_empty(2, 4, 2, 0, 8, all_finite);
}

static void zero_keys_give_empty_rows(void **state) {
    (void)state;
    run_empty(2, 4, 2, 8, 0, all_empty);
}

static void zero_heads(void **state) {
    (void)state;
    run_empty(2, 0, 0, 8, 8, all_finite);
}

/* An empty batch with an absurd length is still an empty call: it succeeds, writes nothing, and no arithmetic
 * on L·heads or on its strides may overflow. Its out strides cannot all be "contiguous" (they would pass 2^63). */
static void zero_batch_with_huge_length(void **state) {
    (void)state;
    const int64_t L = (int64_t)1 << 61;
    static const int64_t out_strides[][4] = {{0, 4, 32, 1}, {0, 0, 4, 1}, {(int64_t)1 << 62, 4, 32, 1}};
    float q_data[1], k_data[12], v_data[12], out_data[4];
    af_tensor q = {.data = q_data, .dtype = AF_F32, .ndim = 4, .shape = {0, 8, L, 4}, .strides = {0, 4, 32, 1}};
    af_tensor k = af_tensor_contiguous(k_data, AF_F32, 4, (int64_t[]){0, 1, 3, 4});
    af_tensor v = af_tensor_contiguous(v_data, AF_F32, 4, (int64_t[]){0, 1, 3, 4});
    af_sdpa_args args = {.query = &q, .key = &k, .value = &v, .enable_gqa = true};
    const char *isas[CASE_MAX_ISAS];
    const int n = case_isas(isas, CASE_MAX_ISAS);
    for (size_t s = 0; s < sizeof out_strides / sizeof out_strides[0]; s++) {
        af_tensor out = q;
        out.data = out_data;
        memcpy(out.strides, out_strides[s], sizeof out_strides[s]);
        memset(out_data, TT_SENTINEL_BYTE, sizeof out_data);
        for (int i = 0; i < n; i++) {
            assert_int_equal(af_set_isa(isas[i]), AF_OK);
            if (af_sdpa(&args, &out, NULL) != AF_OK) fail_msg("out strides #%zu, %s: %s", s, isas[i], af_last_error());
        }
        if (af_sdpa_reference(&args, &out, NULL) != AF_OK) fail_msg("reference: %s", af_last_error());
        for (size_t i = 0; i < sizeof out_data; i++) assert_int_equal(((unsigned char *)out_data)[i], TT_SENTINEL_BYTE);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(fully_masked_bool_rows_give_zero_and_neg_inf),
        cmocka_unit_test(fully_masked_additive_rows_give_zero_and_neg_inf),
        cmocka_unit_test(fully_masked_rows_through_split_kv),
        cmocka_unit_test(bottom_right_causal_with_more_queries_than_keys),
        cmocka_unit_test(causal_decode_shapes_through_split_kv),
        cmocka_unit_test(causal_alignments_differ_unless_square),
        cmocka_unit_test(nan_in_query_poisons_its_row_only),
        cmocka_unit_test(nan_in_key_poisons_rows_that_see_it),
        cmocka_unit_test(nan_in_key_through_split_kv),
        cmocka_unit_test(inf_in_key_gives_nan_rows),
        cmocka_unit_test(neg_inf_in_key_acts_as_masked),
        cmocka_unit_test(nan_in_value_poisons_its_column),
        cmocka_unit_test(logits_of_1e4_stay_within_bound),
        cmocka_unit_test(head_dim_256),
        cmocka_unit_test(head_dim_1),
        cmocka_unit_test(value_dim_differs_from_key_dim),
        cmocka_unit_test(value_dim_zero_still_gives_lse),
        cmocka_unit_test(decode_over_interleaved_heads_in_both_orders),
        cmocka_unit_test(lse_is_the_natural_log),
        cmocka_unit_test(lse_matches_reference_with_masks_and_causality),
        cmocka_unit_test(outputs_with_unusual_strides),
        cmocka_unit_test(out_with_zero_stride_on_a_unit_dim),
        cmocka_unit_test(inputs_may_share_memory),
        cmocka_unit_test(reference_is_sdpa_by_the_textbook),
        cmocka_unit_test(zero_batch),
        cmocka_unit_test(zero_queries),
        cmocka_unit_test(zero_keys_give_empty_rows),
        cmocka_unit_test(zero_heads),
        cmocka_unit_test(zero_batch_with_huge_length),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
