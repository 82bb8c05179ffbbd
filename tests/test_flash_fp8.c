/* float8 K/V in af_flash_attn, at the edges: float8 K/V give the very bits f16 K/V holding the same values give (the
 * conversion is exact, the rest is the same computation; at shapes whose tiles do not depend on the bytes per key),
 * on decode, prefill and paged shapes and every ISA; NaN,
 * infinity (e5m2), subnormal, largest-magnitude and -0 elements against the double reference; the descales' meaning
 * (FA4: q_descale·k_descale join the scale, v_descale multiplies out and leaves lse alone, a sink included). */
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
#include "flash_case.h"

static const af_dtype formats[2] = {AF_F8E4M3, AF_F8E5M2};

/* dst = src element by element (same shape; values exact in dst's dtype) */
static void copy_values(const test_tensor *src, test_tensor *dst) {
    int64_t idx[AF_MAX_DIMS] = {0};
    if (tt_numel(src) == 0) return;
    do tt_set(dst, idx, tt_get(src, idx));
    while (tt_next_index(src->view.ndim, src->view.shape, idx));
}

/* Run both calls on `isa` and expect the same bits in out and lse. */
static void expect_same_bits(flash_tensors *a, flash_tensors *b, const char *isa, const char *what) {
    assert_int_equal(flash_case_run(a, isa, 2), AF_OK);
    assert_int_equal(flash_case_run(b, isa, 2), AF_OK);
    if (memcmp(a->out.memory, b->out.memory, a->out.bytes) || memcmp(a->lse.memory, b->lse.memory, a->lse.bytes))
        fail_msg("%s on %s: different bits", what, isa);
}

/* float8 K/V under an f16 / f32 q against f16 K/V holding the same values: identical bits. */
static void f8_equals_f16_holding_the_same_values(void **state) {
    (void)state;
    const char *isas[CASE_MAX_ISAS];
    const int n_isas = case_isas(isas, CASE_MAX_ISAS);
    for (int shape = 0; shape < 3; shape++)   /* decode (direct kernels, split-KV), prefill (packed tiles), paged */
        for (int f = 0; f < 2; f++)
            for (int q32 = 0; q32 < 2; q32++) {
                /* decode: 2 kv heads of 64, so that even f32 rows keep 64-key tiles (driver.c: DIRECT_L2_BYTES) */
                flash_case c = shape == 0 ? flash_case_default(1, 8, 2, 1, 1500, 64, 64)
                               : flash_case_default(2, 4, 2, 40, 150, 64, 64);
                if (shape == 2) {
                    c.kv = KV_PAGED;
                    c.page_size = 16;
                    c.seqused = true;
                }
                c.dtype = q32 ? AF_F32 : AF_F16;
                c.kv_dtype = formats[f];
                c.amplitude = 3.0;
                flash_tensors a, b;
                assert_true(flash_case_build(&c, &a));
                c.kv_dtype = c.dtype;   /* not float8: K/V in q's dtype */
                flash_case_build(&c, &b);
                copy_values(&a.q, &b.q);
                copy_values(&a.k, &b.k);
                copy_values(&a.v, &b.v);
                if (shape == 2) copy_values(&a.page_table, &b.page_table);
                char what[96];
                snprintf(what, sizeof what, "shape %d, %s K/V, %s q", shape, af_dtype_name(formats[f]),
                         af_dtype_name(c.dtype));
                for (int i = 0; i < n_isas; i++) expect_same_bits(&a, &b, isas[i], what);
                flash_case_free(&a);
                flash_case_free(&b);
            }
}

typedef enum { SPECIAL_SUBNORMAL, SPECIAL_MAX, SPECIAL_NAN_K, SPECIAL_NAN_V, SPECIAL_INF_K, SPECIAL_INF_V,
               SPECIAL_NEG_ZERO, SPECIAL_COUNT } special;
static const char *const special_names[] = {"subnormal", "max", "nan_k", "nan_v", "inf_k", "inf_v", "neg_zero"};

/* The value `kind` puts at K/V element (j, e) of batch 0, kv head 0 (NAN-free kinds fill every element). */
static bool special_value(special kind, af_dtype format, int64_t j, int64_t e, bool key, double *x) {
    const double max = format == AF_F8E4M3 ? 448.0 : 57344.0, tiny = format == AF_F8E4M3 ? 0x1p-9 : 0x1p-16;
    const double sign = (j + e) % 3 ? 1.0 : -1.0;
    switch (kind) {
    case SPECIAL_SUBNORMAL: *x = sign * tiny * (double)(1 + (j * 7 + e) % (format == AF_F8E4M3 ? 7 : 3)); return true;
    case SPECIAL_MAX: *x = sign * max; return true;
    case SPECIAL_NAN_K: *x = NAN; return key && j == 5 && e == 2;
    case SPECIAL_NAN_V: *x = NAN; return !key && j == 7 && e == 1;
    case SPECIAL_INF_K: *x = -INFINITY; return key && j == 3 && e == 0;
    case SPECIAL_INF_V: *x = INFINITY; return !key && j == 9 && e == 3;
    case SPECIAL_NEG_ZERO: *x = -0.0; return key;
    default: return false;
    }
}

static void place_specials(flash_tensors *t, special kind, af_dtype format) {
    test_tensor *kv[2] = {&t->k, &t->v};
    for (int which = 0; which < 2; which++) {
        const af_tensor *view = &kv[which]->view;
        for (int64_t j = 0; j < view->shape[1]; j++)
            for (int64_t e = 0; e < view->shape[3]; e++) {
                double x;
                const int64_t idx[4] = {0, j, 0, e};
                if (special_value(kind, format, j, e, which == 0, &x)) tt_set(kv[which], idx, x);
            }
    }
    copy_values(&t->k, &t->k32);   /* the bound's magnitudes */
    copy_values(&t->v, &t->v32);
}

/* NaN, infinity (e5m2; e4m3fn has none), subnormals, the largest magnitude and -0 in batch 0, kv head 0 of float8
 * K/V, prefill and decode, f32 and bf16 q: every ISA against the reference (rows that see a NaN are NaN, others
 * not). */
static void special_elements_against_the_reference(void **state) {
    (void)state;
    for (int kind = 0; kind < SPECIAL_COUNT; kind++)
        for (int f = 0; f < 2; f++)
            for (int shape = 0; shape < 2; shape++) {
                if ((kind == SPECIAL_INF_K || kind == SPECIAL_INF_V) && formats[f] == AF_F8E4M3) continue;
                flash_case c = shape ? flash_case_default(2, 4, 2, 1, 1100, 16, 16)
                                     : flash_case_default(2, 4, 2, 9, 70, 16, 16);
                c.dtype = shape ? AF_BF16 : AF_F32;
                c.kv_dtype = formats[f];
                flash_tensors t;
                assert_true(flash_case_build(&c, &t));
                place_specials(&t, (special)kind, formats[f]);
                assert_true(flash_case_rerun_reference(&t));
                char why[1024];
                if (!flash_case_verify_everywhere(&t, why, sizeof why))
                    fail_msg("%s, %s K/V, shape %d: %s", special_names[kind], af_dtype_name(formats[f]), shape, why);
                if (kind == SPECIAL_NAN_K) {   /* batch 0's heads 0..1 (kv head 0) are NaN, kv head 1's rows are not */
                    const int64_t nan_at[4] = {0, 0, 1, 0}, fine_at[4] = {0, 0, 2, 0};
                    assert_true(isnan(tt_get(&t.out, nan_at)));
                    assert_false(isnan(tt_get(&t.out, fine_at)));
                }
                flash_case_free(&t);
            }
}

static af_tensor descale_view(float *data, int64_t B, int64_t Hkv) {
    const int64_t shape[2] = {B, Hkv};
    return af_tensor_contiguous(data, AF_F32, 2, shape);
}

/* FA4's v_descale: out times it, lse unchanged, the sink's share scaled like the keys' (out = sum p_j v_j vd / (sum
 * p_j + e^sink)): with v_descale 2 (a power of two: exact) out doubles bit for bit, with 0 it is 0; q_descale·k_descale
 * give what a scale multiplied by them gives. Decode and prefill, every ISA. */
static void descales_mean_what_fa4_says(void **state) {
    (void)state;
    const char *isas[CASE_MAX_ISAS];
    const int n_isas = case_isas(isas, CASE_MAX_ISAS);
    for (int shape = 0; shape < 2; shape++)
        for (int f = 0; f < 2; f++) {
            flash_case c = shape ? flash_case_default(1, 4, 1, 1, 1300, 32, 32)
                                 : flash_case_default(1, 4, 1, 20, 90, 32, 32);
            c.kv_dtype = formats[f];
            c.sink = true;
            flash_tensors t;
            assert_true(flash_case_build(&c, &t));
            float two[1] = {2.0f}, zero[1] = {0.0f}, q_d[1] = {3.0f}, k_d[1] = {0.375f};
            af_tensor vd_two = descale_view(two, 1, 1), vd_zero = descale_view(zero, 1, 1);
            af_tensor qd = descale_view(q_d, 1, 1), kd = descale_view(k_d, 1, 1);
            for (int i = 0; i < n_isas; i++) {
                assert_int_equal(flash_case_run(&t, isas[i], 1), AF_OK);
                unsigned char *out1 = tt_snapshot(&t.out), *lse1 = tt_snapshot(&t.lse);
                t.args.v_descale = &vd_two;
                assert_int_equal(flash_case_run(&t, isas[i], 1), AF_OK);
                assert_true(tt_same_as(&t.lse, lse1));
                test_tensor plain = t.out;
                plain.memory = out1;
                plain.view.data = out1 + ((unsigned char *)t.out.view.data - t.out.memory);
                int64_t idx[4] = {0};
                do assert_true(tt_get(&t.out, idx) == 2.0 * tt_get(&plain, idx));
                while (tt_next_index(4, t.out.view.shape, idx));
                t.args.v_descale = &vd_zero;
                assert_int_equal(flash_case_run(&t, isas[i], 1), AF_OK);
                assert_true(tt_same_as(&t.lse, lse1));
                memset(idx, 0, sizeof idx);
                do assert_true(tt_get(&t.out, idx) == 0.0);
                while (tt_next_index(4, t.out.view.shape, idx));
                /* q_descale 3, k_descale 0.375 against the scale times 1.125 */
                t.args.v_descale = NULL;
                t.args.q_descale = &qd;
                t.args.k_descale = &kd;
                assert_int_equal(flash_case_run(&t, isas[i], 1), AF_OK);
                unsigned char *descaled = tt_snapshot(&t.out);
                t.args.q_descale = t.args.k_descale = NULL;
                t.args.has_scale = true;
                t.args.scale = 1.0 / sqrt(32.0) * 3.0 * 0.375;
                assert_int_equal(flash_case_run(&t, isas[i], 1), AF_OK);
                assert_true(tt_same_as(&t.out, descaled));
                t.args.has_scale = false;
                free(out1), free(lse1), free(descaled);
            }
            flash_case_free(&t);
        }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(f8_equals_f16_holding_the_same_values),
        cmocka_unit_test(special_elements_against_the_reference),
        cmocka_unit_test(descales_mean_what_fa4_says),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
