/* The numerics behind two AMX decisions (docs/AMX.md), measured on emulated tiles:
 * 1. Rounding P to bf16 needs the u(bf16)·value_max term of af_error_bound: a constructed case (weights one half
 *    step from a bf16 rounding boundary, values that cancel) exceeds the bound without the term on the tile path,
 *    while the f32-P vector path stays within it; with the term both pass.
 * 2. f16 inputs are not routed to bf16 tiles: over the f16 cases of the random suite, converting q/k/v (and an
 *    additive mask) to bf16 breaks f16's error bound (the double reference on the converted inputs, and the emulated
 *    AMX path on them, both with an f32 output), while the library's f16 path (f32 arithmetic) keeps it. The figures
 *    are printed for docs/AMX.md. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"
#include "case_gen.h"
#include "core/dtype.h"
#include "kernel/dispatch_testing.h"
#include "kernel/flash.h"
#include "sdpa/problem.h"
#include "sdpa/tolerance.h"
#include "ukernel_amx_emulated.h"
#include "ukernel_vec16_emulated.h"

#define SUITE_SEED 20240601u
#define SUITE_INDICES 300   /* the f16 cases among test_sdpa_random's first 300 (ATTNFORGE_TEST_CASES: fewer) */

/* ------------------------------------------------------------------------------------------------ 1. bound */

/* 4 query rows q = 1 (E = 1), keys k = (0, -1), values v = (-1/2, 1), scale chosen so that the second weight is
 * P2 = 2^-1·(1 + 0.9·2^-8): bf16 rounds it down to 1/2 (relative error 0.9·2^-8), the first weight rounds to 1,
 * so the tile path computes (1·(-1/2) + 1/2·1)/l = 0 where the exact result is 0.9·2^-9/(1 + P2) = 1.17e-3. */
static void p_rounding_needs_its_term(void **state) {
    (void)state;
    const double log2e = 1.4426950408889634, scale = (1.0 - log2(1.0 + 0.9 / 256.0)) / log2e;
    uint16_t q[4], k[2] = {af_f32_to_bf16(0.0f), af_f32_to_bf16(-1.0f)}, v[2] = {af_f32_to_bf16(-0.5f), af_f32_to_bf16(1.0f)};
    for (int i = 0; i < 4; i++) q[i] = af_f32_to_bf16(1.0f);
    uint16_t out[4];
    float ref[4];
    af_tensor tq = af_tensor_contiguous(q, AF_BF16, 4, (int64_t[]){1, 1, 4, 1});
    af_tensor tk = af_tensor_contiguous(k, AF_BF16, 4, (int64_t[]){1, 1, 2, 1});
    af_tensor tv = af_tensor_contiguous(v, AF_BF16, 4, (int64_t[]){1, 1, 2, 1});
    af_tensor to = af_tensor_contiguous(out, AF_BF16, 4, (int64_t[]){1, 1, 4, 1});
    af_tensor tr = af_tensor_contiguous(ref, AF_F32, 4, (int64_t[]){1, 1, 4, 1});
    af_sdpa_args args = {.query = &tq, .key = &tk, .value = &tv, .has_scale = true, .scale = scale};
    assert_int_equal(af_reference_f32(&args, &tr, NULL), AF_OK);
    const af_error_scale es = {.value_max = 1.0, .logit_max = scale, .E = 1, .S = 2};
    const double bound = af_error_bound(AF_BF16, ref[0], &es), bound_without = bound - ldexp(1.0, -8) * es.value_max;

    const af_ukernel *paths[2] = {af_ukernel_amx_emulated(), &af_ukernel_vec16_emulated};
    double err[2];
    for (int i = 0; i < 2; i++) {
        af_ukernel_force_for_tests(paths[i]);
        assert_int_equal(af_sdpa(&args, &to, NULL), AF_OK);
        af_ukernel_force_for_tests(NULL);
        err[i] = fabs(af_bf16_to_f32(out[0]) - ref[0]);
    }
    print_message("reference %.6g; error: tile path %.3g, f32-P path %.3g; bound %.3g, without the P term %.3g\n",
                  ref[0], err[0], err[1], bound, bound_without);
    assert_true(err[0] > 2.0 * bound_without);   /* the term is needed ... */
    assert_true(err[0] <= bound);                /* ... and enough */
    assert_true(err[1] <= bound_without);        /* f32 weights never needed it */
}

/* ------------------------------------------------------------------------------------------------ 2. f16 */


/* A contiguous copy of `src` in `dtype` (values rounded to it). */
static bool convert(const test_tensor *src, af_dtype dtype, test_tensor *dst) {
    test_rng rng = {1};
    if (!tt_alloc(dst, dtype, src->view.ndim, src->view.shape, LAYOUT_CONTIGUOUS, &rng)) return false;
    if (tt_numel(src) == 0) return true;
    int64_t idx[AF_MAX_DIMS] = {0};
    do tt_set(dst, idx, tt_get(src, idx));
    while (tt_next_index(src->view.ndim, src->view.shape, idx));
    return true;
}

typedef struct { double worst, abs_worst; } route_error;   /* max err/bound; max |err|/value_max */

static route_error compare(const case_tensors *t, const af_error_scale *es, const test_tensor *got) {
    route_error r = {0, 0};
    if (tt_numel(&t->ref_out) == 0) return r;
    int64_t idx[4] = {0};
    do {
        const double want = tt_get(&t->ref_out, idx), have = tt_get(got, idx), err = fabs(have - want);
        if (isnan(want) || isinf(want)) {
            if (!(isnan(want) && isnan(have)) && have != want) r.worst = INFINITY;
            continue;
        }
        const double ratio = err == 0.0 ? 0.0 : err / af_error_bound(AF_F16, want, es);
        if (!(ratio <= r.worst)) r.worst = ratio;   /* NaN where the reference has none: worst */
        if (es->value_max > 0 && err / es->value_max > r.abs_worst) r.abs_worst = err / es->value_max;
    } while (tt_next_index(4, t->ref_out.view.shape, idx));
    return r;
}

enum { ROUTE_F32, ROUTE_BF16_INPUTS, ROUTE_BF16_TILES, ROUTES };
static const char *const route_names[ROUTES] = {
    "f16 -> f32 arithmetic (the library's f16 path)",
    "f16 -> bf16 inputs, double arithmetic",
    "f16 -> bf16 inputs, emulated AMX tiles",
};

/* The three routes on one f16 case; false when the case has nothing to compare. */
static bool measure_case(case_tensors *t, const char *vector_isa, route_error *r) {
    const af_error_scale es = case_error_scale(t);
    /* the library's f16 path */
    assert_int_equal(case_run_kernel(t, vector_isa, 1), AF_OK);
    r[ROUTE_F32] = compare(t, &es, &t->out);
    /* bf16 copies of the inputs; an additive mask in q's dtype too */
    test_tensor q, k, v, mask = {0}, out_bf16, out_f32;
    assert_true(convert(&t->q, AF_BF16, &q) && convert(&t->k, AF_BF16, &k) && convert(&t->v, AF_BF16, &v));
    assert_true(convert(&t->ref_out, AF_BF16, &out_bf16) && convert(&t->ref_out, AF_F32, &out_f32));
    af_sdpa_args args = t->args;
    args.query = &q.view, args.key = &k.view, args.value = &v.view;
    if (t->args.attn_mask && t->args.attn_mask->dtype != AF_BOOL) {
        assert_true(convert(&t->mask, AF_BF16, &mask));
        args.attn_mask = &mask.view;
    }
    assert_int_equal(af_reference_f32(&args, &out_f32.view, NULL), AF_OK);
    r[ROUTE_BF16_INPUTS] = compare(t, &es, &out_f32);
    /* the tile path on them, written as f32 (no bf16 output rounding: f16 output would not have it) */
    af_problem p;
    assert_int_equal(af_sdpa_check(&args, &out_bf16.view, NULL, &p), AF_OK);
    p.out = out_f32.view.data;
    p.out_dtype = AF_F32;
    memcpy(p.out_stride, out_f32.view.strides, sizeof p.out_stride);
    af_ukernel_force_for_tests(af_ukernel_amx_emulated());
    af_set_num_threads(1);
    assert_int_equal(af_flash_forward(&p), AF_OK);
    af_ukernel_force_for_tests(NULL);
    r[ROUTE_BF16_TILES] = compare(t, &es, &out_f32);
    tt_free(&q), tt_free(&k), tt_free(&v), tt_free(&mask), tt_free(&out_bf16), tt_free(&out_f32);
    return tt_numel(&t->ref_out) > 0;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void f16_stays_off_bf16_tiles(void **state) {
    (void)state;
    const char *vector_isa = af_isa_available("avx512") ? "avx512" : af_isa_available("avx2") ? "avx2" : "portable";
    const char *env = getenv("ATTNFORGE_TEST_CASES");
    const int indices = env && atoi(env) > 0 && atoi(env) < SUITE_INDICES ? atoi(env) : SUITE_INDICES;
    double ratios[ROUTES][SUITE_INDICES], abs_worst[ROUTES] = {0};
    int over[ROUTES] = {0}, cases = 0;
    for (int i = 0; i < indices; i++) {
        const sdpa_case c = case_random(SUITE_SEED, i, 10);
        if (c.dtype != AF_F16) continue;
        case_tensors t;
        assert_true(case_build(&c, &t));
        route_error r[ROUTES];
        if (measure_case(&t, vector_isa, r)) {
            for (int k = 0; k < ROUTES; k++) {
                ratios[k][cases] = r[k].worst;
                over[k] += r[k].worst > 1.0;
                if (r[k].abs_worst > abs_worst[k]) abs_worst[k] = r[k].abs_worst;
            }
            cases++;
        }
        case_free(&t);
    }
    print_message("f16 cases of the random suite: %d (error in units of af_error_bound(f16); u(f16) = 2^-11 = %.2g)\n",
                  cases, ldexp(1.0, -11));
    for (int k = 0; k < ROUTES; k++) {
        qsort(ratios[k], (size_t)cases, sizeof(double), by_value);
        print_message("  %-48s median %.3f  p90 %.3f  max %.3f  cases over the bound %d  max |err|/max|v| %.2e\n",
                      route_names[k], ratios[k][cases / 2], ratios[k][cases * 9 / 10], ratios[k][cases - 1], over[k],
                      abs_worst[k]);
    }
    assert_true(cases >= (indices == SUITE_INDICES ? 50 : 1));
    assert_int_equal(over[ROUTE_F32], 0);
    assert_true(over[ROUTE_BF16_INPUTS] > cases / 4);   /* bf16 inputs alone already break f16's bound */
    assert_true(over[ROUTE_BF16_TILES] > cases / 4);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(p_rounding_needs_its_term),
        cmocka_unit_test(f16_stays_off_bf16_tiles),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
