/* The backward pass on edge cases chosen by hand: each is checked everywhere (backward_case.h: every ISA, 1-3
 * threads bitwise equal, the reference's bound, nothing outside the views) and then for the exact values the case
 * forces: rows that see no key get dq = 0, keys no row sees get dk = dv = 0, a sink with no key gets dsink = 0, a
 * gradient passed as NULL is not written. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "attnforge.h"
#include "backward_case.h"

static const grad_layouts CONTIGUOUS = {LAYOUT_CONTIGUOUS, LAYOUT_CONTIGUOUS, LAYOUT_CONTIGUOUS, LAYOUT_CONTIGUOUS};
static const grad_layouts STRIDED = {LAYOUT_SLICED, LAYOUT_NHD, LAYOUT_SLICED, LAYOUT_SLICED};

static void verify(backward_tensors *t) {
    char why[1024] = "";
    if (!backward_verify_everywhere(t, why, sizeof why)) fail_msg("%s", why);
}

static void build_sdpa(const sdpa_case *c, backward_tensors *t) {
    if (!backward_build_sdpa(c, &STRIDED, c->seed, t)) fail_msg("could not build the case: %s", af_last_error());
    verify(t);
}

static void build_flash(const flash_case *c, backward_tensors *t) {
    if (!backward_build_flash(c, &STRIDED, c->seed, t)) fail_msg("could not build the case: %s", af_last_error());
    verify(t);
}

/* Every element of `t` with index `dim` in [lo, hi) along that dim (all when dim < 0) is exactly `value`. */
static bool all_equal(const test_tensor *t, int dim, int64_t lo, int64_t hi, double value) {
    if (tt_numel(t) == 0) return true;
    int64_t idx[AF_MAX_DIMS] = {0};
    do {
        if (dim >= 0 && (idx[dim] < lo || idx[dim] >= hi)) continue;
        if (tt_get(t, idx) != value) return false;
    } while (tt_next_index(t->view.ndim, t->view.shape, idx));
    return true;
}

static bool all_zero(const test_tensor *t) { return all_equal(t, -1, 0, 0, 0.0); }

/* The fast path's (last run) and the reference's gradient both zero over [lo, hi) of `dim`. */
static void assert_zero_in_both(const test_tensor *fast, const test_tensor *ref, int dim, int64_t lo, int64_t hi) {
    assert_true(all_equal(fast, dim, lo, hi, 0.0));
    assert_true(all_equal(ref, dim, lo, hi, 0.0));
}

static void rows_without_keys_get_zero_dq(void **state) {
    (void)state;
    sdpa_case c = case_default(2, 4, 2, 7, 3, 16, 8);   /* bottom-right, L > S: rows 0..3 see no key */
    c.causal_bottom_right = true;
    c.enable_gqa = true;
    backward_tensors t;
    build_sdpa(&c, &t);
    assert_zero_in_both(&t.dq, &t.ref_dq, 2, 0, 4);
    assert_false(all_zero(&t.ref_dq));
    backward_free(&t);
}

static void keys_no_row_sees_get_zero_dk_dv(void **state) {
    (void)state;
    sdpa_case c = case_default(1, 2, 2, 3, 9, 8, 5);   /* top-left, L < S: keys 3..8 are seen by no row */
    c.is_causal = true;
    c.dtype = AF_BF16;
    backward_tensors t;
    build_sdpa(&c, &t);
    assert_zero_in_both(&t.dk, &t.ref_dk, 2, 3, 9);
    assert_zero_in_both(&t.dv, &t.ref_dv, 2, 3, 9);
    assert_false(all_zero(&t.ref_dv));
    backward_free(&t);
}

static void one_row_one_key_one_dim(void **state) {
    (void)state;
    const int64_t sizes[][3] = {{1, 1, 1}, {1, 5, 1}, {4, 1, 3}, {1, 1, 64}};   /* L, S, E */
    for (int dt = 0; dt < 3; dt++)
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
            sdpa_case c = case_default(1, 2, 1, sizes[i][0], sizes[i][1], sizes[i][2], sizes[i][2]);
            c.dtype = (af_dtype)dt;
            backward_tensors t;
            build_sdpa(&c, &t);
            if (sizes[i][1] == 1) {   /* one key: P = 1, dS = 0, so dq = dk = 0 */
                assert_true(all_zero(&t.ref_dq) && all_zero(&t.ref_dk));
            }
            backward_free(&t);
        }
}

static void empty_value_dim(void **state) {
    (void)state;
    sdpa_case c = case_default(2, 2, 2, 4, 6, 8, 0);   /* Ev = 0: out is empty, so is every gradient of the loss */
    backward_tensors t;
    build_sdpa(&c, &t);
    assert_true(all_zero(&t.dq) && all_zero(&t.dk) && all_zero(&t.ref_dq) && all_zero(&t.ref_dk));
    backward_free(&t);
}

static void empty_batch_rows_and_keys(void **state) {
    (void)state;
    const int64_t sizes[][3] = {{0, 3, 4}, {2, 0, 4}, {2, 3, 0}};   /* B, L, S */
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        sdpa_case c = case_default(sizes[i][0], 2, 2, sizes[i][1], sizes[i][2], 8, 8);
        backward_tensors t;
        build_sdpa(&c, &t);
        assert_true(all_zero(&t.dq) && all_zero(&t.dk) && all_zero(&t.dv));
        backward_free(&t);
    }
}

static void bool_mask_masking_everything(void **state) {
    (void)state;
    sdpa_case c = case_default(2, 2, 2, 5, 7, 8, 8);
    c.mask = MASK_BOOL;
    c.mask_shape = "B1LS";
    c.mask_keep = 0.0;
    backward_tensors t;
    build_sdpa(&c, &t);
    assert_true(all_zero(&t.dq) && all_zero(&t.dk) && all_zero(&t.dv));
    backward_free(&t);
}

static void masked_rows_and_minus_infinity_entries(void **state) {
    (void)state;
    for (int dt = 0; dt < 3; dt++) {
        sdpa_case c = case_default(2, 2, 2, 9, 11, 16, 16);
        c.dtype = (af_dtype)dt;
        c.mask = dt == 1 ? MASK_BOOL : MASK_ADDITIVE;   /* additive: -inf entries and whole -inf rows */
        c.mask_shape = "BHLS";
        c.mask_keep = 0.5;
        c.masked_row_rate = 0.3;
        backward_tensors t;
        build_sdpa(&c, &t);
        backward_free(&t);
    }
}

static void window_excluding_everything_with_sink(void **state) {
    (void)state;
    flash_case c = flash_case_default(2, 2, 1, 4, 6, 8, 8);
    c.has_window = true;
    c.left = -20, c.right = AF_WINDOW_UNBOUNDED;   /* keys j >= i + S - L + 20: none */
    c.sink = true;
    backward_tensors t;
    build_flash(&c, &t);
    assert_true(all_zero(&t.dq) && all_zero(&t.dk) && all_zero(&t.dv) && all_zero(&t.dsink));
    assert_true(all_zero(&t.ref_dsink));
    backward_free(&t);
}

static void softcap_with_large_scores(void **state) {
    (void)state;
    for (int dt = 0; dt < 3; dt++) {
        flash_case c = flash_case_default(1, 4, 2, 17, 33, 64, 64);
        c.dtype = (af_dtype)dt;
        c.softcap = 5.0;
        c.amplitude = 8.0;   /* raw scores far past the cap: tanh' ~ 0 */
        c.causal = true;
        backward_tensors t;
        build_flash(&c, &t);
        backward_free(&t);
    }
}

static void dominating_sink(void **state) {
    (void)state;
    flash_case c = flash_case_default(2, 2, 2, 6, 9, 16, 16);
    c.sink = true;
    c.sink_offset = 12.0;   /* p_sink ~ 1: out ~ 0, dsink ~ 0 but not exactly */
    c.sink_dtype = AF_BF16;
    backward_tensors t;
    build_flash(&c, &t);
    backward_free(&t);
}

/* Only dk wanted: dq and dv (given memory the call is not told about) stay untouched; dk as with all three. */
static void null_gradients_are_not_written(void **state) {
    (void)state;
    sdpa_case c = case_default(1, 2, 2, 5, 6, 8, 8);
    backward_tensors t;
    if (!backward_build_sdpa(&c, &CONTIGUOUS, 3, &t)) fail_msg("could not build: %s", af_last_error());
    test_tensor dq = t.dq, dv = t.dv;
    memset(&t.dq, 0, sizeof t.dq);
    memset(&t.dv, 0, sizeof t.dv);
    t.grads.dq = t.grads.dv = NULL;
    tt_fill_bytes(&dq, TT_SENTINEL_BYTE);
    tt_fill_bytes(&dv, TT_SENTINEL_BYTE);
    verify(&t);
    const unsigned char *bytes[2] = {dq.memory, dv.memory};
    const size_t sizes[2] = {dq.bytes, dv.bytes};
    for (int i = 0; i < 2; i++)
        for (size_t b = 0; b < sizes[i]; b++) assert_int_equal(bytes[i][b], TT_SENTINEL_BYTE);
    const af_gradients only_dk = {.dk = &t.ref_dk.view};   /* the reference too */
    tt_fill_bytes(&t.ref_dk, 0);
    assert_int_equal(af_sdpa_backward_reference(&t.ref_sdpa, &(af_backward_inputs){.out = &t.s.ref_out.view,
                                                .dout = &t.dout32.view, .lse = &t.s.ref_lse.view}, &only_dk), AF_OK);
    char why[512];
    if (!backward_matches(&t, why, sizeof why)) fail_msg("%s", why);
    t.dq = dq;
    t.dv = dv;
    backward_free(&t);
}

static void varlen_with_empty_sequences(void **state) {
    (void)state;
    flash_case c = flash_case_default(3, 4, 2, 0, 0, 16, 8);
    c.varlen_q = true;
    c.kv = KV_VARLEN;
    const int64_t Lq[3] = {3, 0, 5}, Sk[3] = {0, 4, 6};   /* sequence 0 has rows but no key, 1 keys but no row */
    for (int b = 0; b < 3; b++) c.Lq[b] = Lq[b], c.Sk[b] = c.S_stored[b] = Sk[b];
    c.sink = true;
    c.causal = true;
    backward_tensors t;
    build_flash(&c, &t);
    assert_zero_in_both(&t.dq, &t.ref_dq, 0, 0, 3);   /* packed rows of sequence 0 */
    assert_zero_in_both(&t.dk, &t.ref_dk, 0, 0, 4);   /* packed keys of sequence 1 */
    assert_zero_in_both(&t.dv, &t.ref_dv, 0, 0, 4);
    assert_false(all_zero(&t.ref_dq));
    backward_free(&t);
}

static void seqused_cuts_keys(void **state) {
    (void)state;
    flash_case c = flash_case_default(2, 2, 2, 4, 10, 8, 8);
    c.seqused = true;
    c.Sk[0] = 3, c.Sk[1] = 0;   /* keys past seqused_k: seen by no row */
    backward_tensors t;
    build_flash(&c, &t);
    assert_true(all_equal(&t.dk, 1, 3, 10, 0.0) && all_equal(&t.dv, 1, 3, 10, 0.0));
    assert_true(all_equal(&t.dq, -1, 0, 0, 0.0) == false);
    backward_free(&t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(rows_without_keys_get_zero_dq),
        cmocka_unit_test(keys_no_row_sees_get_zero_dk_dv),
        cmocka_unit_test(one_row_one_key_one_dim),
        cmocka_unit_test(empty_value_dim),
        cmocka_unit_test(empty_batch_rows_and_keys),
        cmocka_unit_test(bool_mask_masking_everything),
        cmocka_unit_test(masked_rows_and_minus_infinity_entries),
        cmocka_unit_test(window_excluding_everything_with_sink),
        cmocka_unit_test(softcap_with_large_scores),
        cmocka_unit_test(dominating_sink),
        cmocka_unit_test(null_gradients_are_not_written),
        cmocka_unit_test(varlen_with_empty_sequences),
        cmocka_unit_test(seqused_cuts_keys),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
