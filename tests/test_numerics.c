/* Numerics beyond test_sdpa_edge.c (which covers NaN in q/k/v, +-Inf in k, fully masked rows, 1e4 logits at E=16
 * and head dim 256 at ordinary logits): NaN and +-Inf in an additive mask, +-Inf in q, +-Inf in v, each against
 * PyTorch's math path (softmax(q·kᵀ·scale + mask)·v) and the documented difference (a row whose every score is -inf
 * gives 0 and lse -inf, where PyTorch gives NaN); 1e4 logits at head dim 256 and through split-KV; f16 inputs whose
 * q·k products pass f16's 65504 (f32 accumulation). Each on every ISA, 1 and 2 threads, against the reference. */
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

typedef enum { CELL_FINITE, CELL_NAN, CELL_ZERO, CELL_POS_INF } cell_expect;

/* What out[b,h,i,e] must be (e = -1: what lse[b,h,i] must be; CELL_ZERO there means -inf). */
typedef cell_expect (*cell_rule)(int64_t b, int64_t h, int64_t i, int64_t e, const void *ctx);

static bool cell_ok(double x, cell_expect want, bool is_lse) {
    switch (want) {
    case CELL_FINITE: return isfinite(x);
    case CELL_NAN: return isnan(x);
    case CELL_ZERO: return is_lse ? x == -INFINITY : x == 0.0;
    case CELL_POS_INF: return is_lse ? isfinite(x) : x == INFINITY;
    }
    return false;
}

static void assert_cells(const case_tensors *t, const test_tensor *out, const test_tensor *lse, cell_rule rule,
                         const void *ctx, const char *who) {
    for (int64_t b = 0; b < t->c.B; b++)
        for (int64_t h = 0; h < t->c.Hq; h++)
            for (int64_t i = 0; i < t->c.L; i++) {
                for (int64_t e = 0; e < t->c.Ev; e++) {
                    const double x = tt_get(out, (int64_t[]){b, h, i, e});
                    if (!cell_ok(x, rule(b, h, i, e, ctx), false))
                        fail_msg("%s: out[%lld,%lld,%lld,%lld] = %g, expected kind %d", who, (long long)b, (long long)h,
                                 (long long)i, (long long)e, x, (int)rule(b, h, i, e, ctx));
                }
                const double l = tt_get(lse, (int64_t[]){b, h, i});
                if (!cell_ok(l, rule(b, h, i, -1, ctx), true))
                    fail_msg("%s: lse[%lld,%lld,%lld] = %g, expected kind %d", who, (long long)b, (long long)h,
                             (long long)i, l, (int)rule(b, h, i, -1, ctx));
            }
}

/* The reference obeys the rule (PyTorch's semantics), and af_sdpa on every ISA and thread count matches the
 * reference (NaN where it has NaN, infinities exactly, the rest within af_error_bound) and obeys the rule too. */
static void expect_cells(case_tensors *t, cell_rule rule, const void *ctx) {
    if (!case_rerun_reference(t)) fail_msg("reference failed: %s", af_last_error());
    assert_cells(t, &t->ref_out, &t->ref_lse, rule, ctx, "reference");
    char why[640] = "", desc[640];
    if (!case_verify_everywhere(t, why, sizeof why)) {
        case_describe(&t->c, desc, sizeof desc);
        fail_msg("%s\n    %s", desc, why);
    }
    const char *isas[CASE_MAX_ISAS];
    const int n = case_isas(isas, CASE_MAX_ISAS);
    for (int k = 0; k < n; k++)
        for (int threads = case_first_threads(); threads <= 2; threads++) {
            assert_int_equal(case_run_kernel(t, isas[k], threads), AF_OK);
            assert_cells(t, &t->out, &t->lse, rule, ctx, isas[k]);
        }
}

static void build(const sdpa_case *c, case_tensors *t) {
    if (!case_build(c, t)) fail_msg("could not build the case: %s", af_last_error());
}

/* ------------------------------------------------------------------ special values in an additive mask */

typedef struct { int64_t i; cell_expect row; } special_row;   /* query row i (every batch and head) */

static cell_expect listed_row(int64_t b, int64_t h, int64_t i, int64_t e, const void *ctx) {
    (void)b, (void)h, (void)e;
    const special_row *r = ctx;
    return i == r->i ? r->row : CELL_FINITE;
}

/* An additive (L, S) mask with `value` at (i, j) for every j in [j0, j1), then the rule checked. */
static void run_mask_value(af_dtype dtype, int64_t L, int64_t S, double value, int64_t i, int64_t j0, int64_t j1,
                           cell_expect row) {
    sdpa_case c = case_default(1, 4, 2, L, S, 16, 16);
    c.dtype = dtype;
    c.mask = MASK_ADDITIVE;
    c.mask_shape = "LS";
    c.mask_keep = 1.0;   /* every other entry finite */
    case_tensors t;
    build(&c, &t);
    for (int64_t j = j0; j < j1; j++) tt_set(&t.mask, (int64_t[]){i, j}, value);
    const special_row r = {i, row};
    expect_cells(&t, listed_row, &r);
    case_free(&t);
}

/* softmax over a row with a NaN score is NaN (PyTorch: every element of the row) */
static void nan_in_mask_poisons_its_row(void **state) {
    (void)state;
    for (int d = 0; d < 3; d++) {
        run_mask_value(all_dtypes[d], 23, 41, NAN, 7, 30, 31, CELL_NAN);
        run_mask_value(all_dtypes[d], 2, 1500, NAN, 1, 1400, 1401, CELL_NAN);   /* split-KV: one split's NaN */
    }
}

/* a +inf score makes exp(inf - inf) = NaN: the row is NaN, as in PyTorch */
static void pos_inf_in_mask_gives_a_nan_row(void **state) {
    (void)state;
    for (int d = 0; d < 3; d++) {
        run_mask_value(all_dtypes[d], 23, 41, INFINITY, 3, 0, 1, CELL_NAN);
        run_mask_value(all_dtypes[d], 2, 1500, INFINITY, 0, 700, 701, CELL_NAN);
    }
}

/* -inf on some keys removes them (finite row); on every key the row sees nothing: 0 and lse -inf (PyTorch: NaN) */
static void neg_inf_in_mask_hides_keys(void **state) {
    (void)state;
    for (int d = 0; d < 3; d++) {
        run_mask_value(all_dtypes[d], 23, 41, -INFINITY, 5, 0, 40, CELL_FINITE);
        run_mask_value(all_dtypes[d], 23, 41, -INFINITY, 5, 0, 41, CELL_ZERO);
        run_mask_value(all_dtypes[d], 2, 1500, -INFINITY, 1, 0, 1500, CELL_ZERO);
    }
}

/* ------------------------------------------------------------------ +-inf in the query */

/* q[.., i, e0] = value and every k[.., e0] > 0: row i's scores are all `value`·(positive) */
static void run_query_inf(af_dtype dtype, int64_t L, int64_t S, double value, cell_expect row) {
    sdpa_case c = case_default(1, 2, 1, L, S, 8, 8);
    c.dtype = dtype;
    case_tensors t;
    build(&c, &t);
    const int64_t i = L / 2, e0 = 3;
    for (int64_t j = 0; j < S; j++) {
        const int64_t idx[4] = {0, 0, j, e0};
        tt_set(&t.k, idx, fabs(tt_get(&t.k, idx)) + 0.25);
    }
    for (int64_t h = 0; h < 2; h++) tt_set(&t.q, (int64_t[]){0, h, i, e0}, value);
    const special_row r = {i, row};
    expect_cells(&t, listed_row, &r);
    case_free(&t);
}

static void pos_inf_in_query_gives_a_nan_row(void **state) {
    (void)state;
    for (int d = 0; d < 3; d++) {
        run_query_inf(all_dtypes[d], 9, 33, INFINITY, CELL_NAN);
        run_query_inf(all_dtypes[d], 1, 2000, INFINITY, CELL_NAN);   /* split-KV */
    }
}

/* every score -inf: the row sees no key (0, lse -inf), as a fully masked row; PyTorch's math path gives NaN */
static void neg_inf_in_query_gives_an_empty_row(void **state) {
    (void)state;
    for (int d = 0; d < 3; d++) {
        run_query_inf(all_dtypes[d], 9, 33, -INFINITY, CELL_ZERO);
        run_query_inf(all_dtypes[d], 1, 2000, -INFINITY, CELL_ZERO);
    }
}

/* ------------------------------------------------------------------ +-inf in the value */

typedef struct { int64_t col; cell_expect column; } special_column;

static cell_expect listed_column(int64_t b, int64_t h, int64_t i, int64_t e, const void *ctx) {
    (void)b, (void)h, (void)i;
    const special_column *c = ctx;
    return e == c->col ? c->column : CELL_FINITE;
}

/* Every row sees every key (no mask, no causality) with a positive weight (small logits): v[j, col] = +inf makes
 * column col +inf in every row; +inf and -inf at two keys make it NaN (inf - inf), as P·V does in PyTorch. */
static void run_value_inf(af_dtype dtype, int64_t L, int64_t S, bool both_signs) {
    sdpa_case c = case_default(2, 4, 2, L, S, 16, 12);
    c.dtype = dtype;
    c.amplitude = 0.5;
    case_tensors t;
    build(&c, &t);
    const int64_t col = 5;
    for (int64_t b = 0; b < 2; b++)
        for (int64_t h = 0; h < 2; h++) {
            tt_set(&t.v, (int64_t[]){b, h, S / 3, col}, INFINITY);
            if (both_signs) tt_set(&t.v, (int64_t[]){b, h, S - 1, col}, -INFINITY);
        }
    const special_column sc = {col, both_signs ? CELL_NAN : CELL_POS_INF};
    expect_cells(&t, listed_column, &sc);
    case_free(&t);
}

static void inf_in_value_reaches_its_column(void **state) {
    (void)state;
    for (int d = 0; d < 3; d++)
        for (int both = 0; both < 2; both++) {
            run_value_inf(all_dtypes[d], 17, 29, both);
            run_value_inf(all_dtypes[d], 1, 1100, both);   /* split-KV: the infinities in different splits */
        }
}

/* ------------------------------------------------------------------ huge logits, wide heads */

static double max_abs_dot(const case_tensors *t) {
    const int64_t group = t->c.Hq / t->c.Hkv;
    double biggest = 0.0;
    for (int64_t b = 0; b < t->c.B; b++)
        for (int64_t h = 0; h < t->c.Hq; h++)
            for (int64_t i = 0; i < t->c.L; i++)
                for (int64_t j = 0; j < t->c.S; j++) {
                    double dot = 0.0;
                    for (int64_t e = 0; e < t->c.E; e++)
                        dot += tt_get(&t->q, (int64_t[]){b, h, i, e}) * tt_get(&t->k, (int64_t[]){b, h / group, j, e});
                    biggest = fmax(biggest, fabs(dot));
                }
    return biggest;
}

static cell_expect everything_finite(int64_t b, int64_t h, int64_t i, int64_t e, const void *ctx) {
    (void)b, (void)h, (void)i, (void)e, (void)ctx;
    return CELL_FINITE;
}

/* scale set so that the largest |logit| is exactly `logit_max` */
static void run_scaled(sdpa_case c, double logit_max, double min_dot) {
    case_tensors t;
    build(&c, &t);
    const double biggest = max_abs_dot(&t);
    if (biggest < min_dot) fail_msg("the largest |q·k| is %g, the test needs more than %g", biggest, min_dot);
    t.args.has_scale = t.c.has_scale = true;
    t.args.scale = t.c.scale = logit_max / biggest;
    expect_cells(&t, everything_finite, NULL);
    case_free(&t);
}

static void logits_of_1e4_at_head_dim_256(void **state) {
    (void)state;
    for (int d = 0; d < 3; d++)
        for (int sign = -1; sign <= 1; sign += 2) {
            sdpa_case c = case_default(1, 2, 1, 13, 37, 256, 256);
            c.dtype = all_dtypes[d];
            c.is_causal = true;
            run_scaled(c, sign * 1e4, 0.0);
            sdpa_case decode = case_default(1, 4, 1, 2, 1500, 256, 64);   /* split-KV */
            decode.dtype = all_dtypes[d];
            assert_true(case_is_split_kv(&decode));
            run_scaled(decode, sign * 1e4, 0.0);
        }
}

/* f16 values ~200: q·k reaches ~1e5 or more, past f16's largest finite 65504. Accumulated in f32 it is right; an f16
 * accumulator would give inf and NaN rows. With a scale that brings the logits to 8 (a real softmax), and with the
 * default 1/sqrt(E) (logits ~1e4, one key dominating each row). bf16 the same (its 8-bit mantissa would lose it). */
static void f16_products_past_65504_are_right(void **state) {
    (void)state;
    for (int d = 1; d < 3; d++) {
        sdpa_case c = case_default(1, 4, 2, 24, 50, 64, 64);
        c.dtype = all_dtypes[d];
        c.amplitude = 200.0;
        run_scaled(c, 8.0, 65504.0);
        c.is_causal = true;
        run_scaled(c, 8.0, 65504.0);
        sdpa_case decode = case_default(1, 8, 2, 1, 1200, 64, 64);
        decode.dtype = all_dtypes[d];
        decode.amplitude = 200.0;
        run_scaled(decode, 8.0, 65504.0);
        case_tensors t;   /* the default scale */
        build(&c, &t);
        if (max_abs_dot(&t) <= 65504.0) fail_msg("q·k stays within f16's range; the test needs it past 65504");
        expect_cells(&t, everything_finite, NULL);
        case_free(&t);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(nan_in_mask_poisons_its_row),
        cmocka_unit_test(pos_inf_in_mask_gives_a_nan_row),
        cmocka_unit_test(neg_inf_in_mask_hides_keys),
        cmocka_unit_test(pos_inf_in_query_gives_a_nan_row),
        cmocka_unit_test(neg_inf_in_query_gives_an_empty_row),
        cmocka_unit_test(inf_in_value_reaches_its_column),
        cmocka_unit_test(logits_of_1e4_at_head_dim_256),
        cmocka_unit_test(f16_products_past_65504_are_right),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
