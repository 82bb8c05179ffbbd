/* The whole random suite of test_sdpa_random.c (same generator, seed and count) through af_sdpa with the AMX table
 * forced in on emulated tiles (the vector template at the AVX-512 geometry plus the AMX products, as dispatch.c
 * builds "amx"): every bf16 case against the double reference with af_error_bound, for 1 and 2 threads (bitwise
 * equal), nothing written outside out/lse, inputs untouched, and the tiles really used; every f16/f32 case must
 * take the vector path: no tile product, and bitwise the result of the emulated vector table alone. The bf16
 * cases of the next 2·count indices follow (bf16 is what the products are for; 1/3 of the suite otherwise).
 * ATTNFORGE_TEST_CASES / ATTNFORGE_TEST_SEED change the count and seed, as there. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tile_emulated.h"
#include "attnforge.h"
#include "case_gen.h"
#include "kernel/dispatch_testing.h"
#include "ukernel_amx_emulated.h"
#include "ukernel_vec16_emulated.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define DEFAULT_CASES 200
#else
#define DEFAULT_CASES 300
#endif
#define DEFAULT_SEED 20240601u
#define SPLIT_KV_EVERY 10
#define PRODUCTS_MIN_ROWS 4   /* af_products_amx_emulated.min_rows: fewer rows take the direct vector kernels */

static int case_count(void) { return case_suite_count(DEFAULT_CASES); }
static uint64_t suite_seed(void) { return case_suite_seed(DEFAULT_SEED); }

static af_status run_on(case_tensors *t, const af_ukernel *uk, int threads) {
    tt_fill_bytes(&t->out, TT_SENTINEL_BYTE);
    tt_fill_bytes(&t->lse, TT_SENTINEL_BYTE);
    af_ukernel_force_for_tests(uk);
    af_set_num_threads(threads);
    const af_status st = af_sdpa(&t->args, &t->out.view, t->c.with_lse ? &t->lse.view : NULL);
    af_ukernel_force_for_tests(NULL);
    return st;
}

static bool enough_rows(const sdpa_case *c) {
    return c->B > 0 && c->L > 0 && c->S > 0 && c->L * (c->Hq / c->Hkv) >= PRODUCTS_MIN_ROWS;
}

/* Would the driver hand this case to the products? (bf16, enough rows, K and V contiguous along the head dim) */
static bool takes_products(const case_tensors *t) {
    return t->c.dtype == AF_BF16 && enough_rows(&t->c) && t->k.view.strides[3] == 1 && t->v.view.strides[3] == 1;
}

/* What the bf16 cases met, for suite_met_every_route (run last). */
static int bf16_on_products, bf16_declined_few_rows, bf16_declined_strided;
static double bf16_worst_ratio;   /* max |error| / af_error_bound over the bf16 cases */

static bool verify_bf16(case_tensors *t, char *why, size_t size) {
    const af_ukernel *amx = af_ukernel_amx_emulated();
    unsigned char *first_out = NULL, *first_lse = NULL;
    bool ok = true;
    const uint64_t dp_before = amx_emu_dp_count();
    for (int threads = 1; threads <= 2 && ok; threads++) {
        char detail[512] = "";
        const af_status st = run_on(t, amx, threads);
        if (st != AF_OK) snprintf(detail, sizeof detail, "status %s: %s", af_status_name(st), af_last_error());
        else if (!tt_outside_view_is(&t->out, TT_SENTINEL_BYTE)) snprintf(detail, sizeof detail, "wrote outside out's view");
        else if (t->c.with_lse && !tt_outside_view_is(&t->lse, TT_SENTINEL_BYTE)) snprintf(detail, sizeof detail, "wrote outside lse's view");
        else {
            double worst = 0.0;
            if (case_matches_reference(t, &worst, detail, sizeof detail)) detail[0] = 0;
            if (worst > bf16_worst_ratio) bf16_worst_ratio = worst;
        }
        if (detail[0]) {
            snprintf(why, size, "amx-emulated, %d thread(s): %s", threads, detail);
            ok = false;
        } else if (threads == 1) {
            first_out = tt_snapshot(&t->out);
            first_lse = tt_snapshot(&t->lse);
        } else if (!tt_same_as(&t->out, first_out) || !tt_same_as(&t->lse, first_lse)) {
            snprintf(why, size, "amx-emulated: 2 threads give different bits from 1 thread");
            ok = false;
        }
    }
    free(first_out);
    free(first_lse);
    const bool used = amx_emu_dp_count() > dp_before;
    bf16_on_products += takes_products(t);
    bf16_declined_few_rows += !enough_rows(&t->c) && t->c.B > 0 && t->c.L > 0 && t->c.S > 0;
    bf16_declined_strided += enough_rows(&t->c) && !takes_products(t);
    if (ok && used != takes_products(t)) {
        snprintf(why, size, "the tile products were %s", used ? "used where they should not be" : "not used");
        ok = false;
    }
    return ok;
}

/* f16/f32: the products decline, so the result is the emulated vector table's, bit for bit, with no tile op. */
static bool verify_vector_path(case_tensors *t, char *why, size_t size) {
    const uint64_t dp_before = amx_emu_dp_count();
    af_status st = run_on(t, af_ukernel_amx_emulated(), 1);
    if (st != AF_OK) {
        snprintf(why, size, "amx-emulated: status %s: %s", af_status_name(st), af_last_error());
        return false;
    }
    unsigned char *out = tt_snapshot(&t->out), *lse = tt_snapshot(&t->lse);
    st = run_on(t, &af_ukernel_vec16_emulated, 1);
    bool ok = st == AF_OK && tt_same_as(&t->out, out) && tt_same_as(&t->lse, lse);
    if (!ok) snprintf(why, size, "%s input: amx-emulated differs from the vector table alone", af_dtype_name(t->c.dtype));
    if (ok && amx_emu_dp_count() != dp_before) {
        snprintf(why, size, "%s input reached the tile products", af_dtype_name(t->c.dtype));
        ok = false;
    }
    if (ok && !case_matches_reference(t, NULL, why, size)) ok = false;
    free(out);
    free(lse);
    return ok;
}

static void random_case(void **state) {
    const sdpa_case *c = *state;
    char desc[640], why[640] = "";
    case_describe(c, desc, sizeof desc);
    case_tensors t;
    const bool built = case_build(c, &t);
    unsigned char *inputs[4] = {NULL};
    bool ok = built;
    if (built) {
        const test_tensor *in[4] = {&t.q, &t.k, &t.v, &t.mask};
        for (int i = 0; i < 4; i++) inputs[i] = tt_snapshot(in[i]);
        ok = c->dtype == AF_BF16 ? verify_bf16(&t, why, sizeof why) : verify_vector_path(&t, why, sizeof why);
        for (int i = 0; i < 4; i++) {
            if (ok && !tt_same_as(in[i], inputs[i])) {
                snprintf(why, sizeof why, "an input (#%d of q, k, v, mask) changed", i);
                ok = false;
            }
            free(inputs[i]);
        }
    }
    case_free(&t);
    if (!built) fail_msg("could not build the case (%s): %s", af_last_error(), desc);
    if (!ok) fail_msg("%s\n    %s", desc, why);
}

/* The suite must reach the products through every driver feature: causal both ways, masks, GQA, split-KV, strides
 * (transposed and sliced Q/out), tails of every tile dimension; and must see bf16 cases that decline them. */
static void suite_reaches_the_products_everywhere(void **state) {
    (void)state;
    bool top_left = false, bottom_right = false, bool_mask = false, additive_mask = false, gqa = false, split = false;
    bool nhd_q = false, sliced_q = false, ragged_e = false, ragged_ev = false, ragged_s = false;
    const int n = case_count() < 300 ? 300 : case_count();
    for (int i = 0; i < n; i++) {
        const sdpa_case c = case_random(suite_seed(), i, SPLIT_KV_EVERY);
        if (c.dtype != AF_BF16 || !enough_rows(&c) || c.k_layout == LAYOUT_SLICED || c.v_layout == LAYOUT_SLICED) continue;
        top_left |= c.is_causal;
        bottom_right |= c.causal_bottom_right;
        bool_mask |= c.mask == MASK_BOOL;
        additive_mask |= c.mask == MASK_ADDITIVE;
        gqa |= c.Hq > c.Hkv;
        split |= case_is_split_kv(&c);
        nhd_q |= c.q_layout == LAYOUT_NHD;
        sliced_q |= c.q_layout == LAYOUT_SLICED;
        ragged_e |= c.E % 32 != 0;
        ragged_ev |= c.Ev % 16 != 0;
        ragged_s |= c.S % 32 != 0;
    }
    assert_true(top_left && bottom_right && bool_mask && additive_mask && gqa && split);
    assert_true(nhd_q && sliced_q && ragged_e && ragged_ev && ragged_s);
}

/* After the cases: bf16 met the products, and both ways of declining them (few rows, strided K/V head dim). */
static void suite_met_every_route(void **state) {
    (void)state;
    print_message("bf16 cases: %d on the tile products, %d with too few rows, %d with a strided head dim; "
                  "worst error %.3f of af_error_bound\n",
                  bf16_on_products, bf16_declined_few_rows, bf16_declined_strided, bf16_worst_ratio);
    if (case_count() < 150) skip();   /* a shortened run need not meet them all */
    assert_true(bf16_on_products > 0 && bf16_declined_few_rows > 0 && bf16_declined_strided > 0);
}

int main(void) {
    const int n = case_count(), span = 3 * n;
    const uint64_t seed = suite_seed();
    sdpa_case *cases = calloc((size_t)span, sizeof *cases);
    struct CMUnitTest *tests = calloc((size_t)span + 2, sizeof *tests);
    char (*names)[48] = calloc((size_t)span, sizeof *names);
    if (!cases || !tests || !names) return 1;
    int count = 0;
    tests[count++] = (struct CMUnitTest)cmocka_unit_test(suite_reaches_the_products_everywhere);
    for (int i = 0; i < span; i++) {
        cases[i] = case_random(seed, i, SPLIT_KV_EVERY);
        if (i >= n && cases[i].dtype != AF_BF16) continue;
        snprintf(names[i], sizeof names[i], "amx_case_%03d_%s", i, af_dtype_name(cases[i].dtype));
        tests[count++] = (struct CMUnitTest){.name = names[i], .test_func = random_case, .initial_state = &cases[i]};
    }
    tests[count++] = (struct CMUnitTest)cmocka_unit_test(suite_met_every_route);
    const int failures = _cmocka_run_group_tests("amx_sdpa", tests, (size_t)count, NULL, NULL);
    free(cases);
    free(tests);
    free(names);
    return failures;
}
