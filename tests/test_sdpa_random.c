/* af_sdpa against the double reference on a few hundred seeded random cases, on every ISA this machine has and
 * for 1 and 2 threads (bitwise equal). ATTNFORGE_TEST_CASES / ATTNFORGE_TEST_SEED change the count and seed. */
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

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define DEFAULT_CASES 200   /* sanitizers run ~10x slower; the first 128 cases already meet every mask shape */
#else
#define DEFAULT_CASES 300
#endif
#define DEFAULT_SEED 20240601u
#define SPLIT_KV_EVERY 10   /* one case in ten is a split-KV decode shape */
#define COVERAGE_CASES 300  /* the generator's coverage is checked over the full-size suite */

static int case_count(void) { return case_suite_count(DEFAULT_CASES); }
static uint64_t suite_seed(void) { return case_suite_seed(DEFAULT_SEED); }

static void random_case(void **state) {
    const sdpa_case *c = *state;
    char desc[640], why[640] = "";
    case_describe(c, desc, sizeof desc);
    case_tensors t;
    const bool built = case_build(c, &t);
    const bool ok = built && case_verify_everywhere(&t, why, sizeof why);
    case_free(&t);
    if (!built) fail_msg("could not build the case (%s): %s", af_last_error(), desc);
    if (!ok) fail_msg("%s\n    %s", desc, why);
}

/* What the generator must produce over the full-size suite; a change that drops a feature fails here. */
typedef struct {
    bool dtype[3], heads_gqa, heads_mqa, heads_8, l_ne_s, zero_b, zero_l, zero_s, split_kv, split_kv_causal;
    bool e_one, e_256, e_odd, ev_ne_e, s_not_tile_multiple, top_left, bottom_right, bottom_right_l_gt_s;
    bool bool_shape[32], additive_shape[32], expanded, layout_q[LAYOUT_COUNT], layout_k[LAYOUT_COUNT];
    bool layout_v[LAYOUT_COUNT], layout_out[LAYOUT_COUNT], layout_lse[LAYOUT_COUNT], scale_given, scale_zero_or_negative;
    bool aligned_f32_value;   /* 64-byte aligned f32 V with whole vectors of columns: the driver may read it in place */
    bool few_rows_in_place[3];/* <= 16 query rows per kv head, K and V rows contiguous: read where they lie, per dtype */
} coverage;

static void note_case(coverage *cv, const sdpa_case *c) {
    cv->dtype[c->dtype] = true;
    cv->heads_gqa |= c->Hq > c->Hkv && c->Hkv > 1;
    cv->heads_mqa |= c->Hq > 1 && c->Hkv == 1;
    cv->heads_8 |= c->Hq == 8 && c->Hkv == 8;
    cv->l_ne_s |= c->L != c->S;
    cv->zero_b |= c->B == 0;
    cv->zero_l |= c->L == 0;
    cv->zero_s |= c->S == 0;
    cv->split_kv |= case_is_split_kv(c);
    cv->split_kv_causal |= case_is_split_kv(c) && (c->is_causal || c->causal_bottom_right);
    cv->e_one |= c->E == 1 || c->Ev == 1;
    cv->e_256 |= c->E == 256 || c->Ev == 256;
    cv->e_odd |= c->E % 2 == 1 && c->E > 1;
    cv->ev_ne_e |= c->E != c->Ev;
    cv->s_not_tile_multiple |= c->S % 16 != 0;
    cv->top_left |= c->is_causal;
    cv->bottom_right |= c->causal_bottom_right;
    cv->bottom_right_l_gt_s |= c->causal_bottom_right && c->L > c->S && c->B > 0;
    for (int s = 0; s < mask_shape_count; s++)
        if (strcmp(c->mask_shape, mask_shapes[s]) == 0) {
            cv->bool_shape[s] |= c->mask == MASK_BOOL;
            cv->additive_shape[s] |= c->mask == MASK_ADDITIVE;
        }
    cv->expanded |= c->mask_expanded;
    cv->layout_q[c->q_layout] = cv->layout_k[c->k_layout] = cv->layout_v[c->v_layout] = true;
    cv->layout_out[c->out_layout] = true;
    cv->layout_lse[c->lse_layout] |= c->with_lse;
    cv->scale_given |= c->has_scale;
    cv->scale_zero_or_negative |= c->has_scale && c->scale <= 0.0;
    cv->aligned_f32_value |= c->dtype == AF_F32 && c->v_layout != LAYOUT_SLICED && c->Ev % 16 == 0 && c->S > 0;
    const int64_t rows = c->L * (c->Hq / c->Hkv);
    cv->few_rows_in_place[c->dtype] |= rows > 0 && rows <= 16 && c->B > 0 && c->S > 0 && c->k_layout != LAYOUT_SLICED &&
                                       c->v_layout != LAYOUT_SLICED;
}

static void generator_covers_every_feature(void **state) {
    (void)state;
    coverage cv = {0};
    for (int i = 0; i < COVERAGE_CASES; i++) {
        const sdpa_case c = case_random(suite_seed(), i, SPLIT_KV_EVERY);
        note_case(&cv, &c);
    }
    for (int d = 0; d < 3; d++) assert_true(cv.dtype[d]);
    assert_true(cv.heads_gqa && cv.heads_mqa && cv.heads_8);
    assert_true(cv.l_ne_s && cv.zero_b && cv.zero_l && cv.zero_s);
    assert_true(cv.split_kv && cv.split_kv_causal);
    assert_true(cv.e_one && cv.e_256 && cv.e_odd && cv.ev_ne_e && cv.s_not_tile_multiple);
    assert_true(cv.top_left && cv.bottom_right && cv.bottom_right_l_gt_s);
    for (int s = 0; s < mask_shape_count; s++) {
        if (!cv.bool_shape[s] || !cv.additive_shape[s]) fail_msg("mask shape \"%s\" not covered", mask_shapes[s]);
    }
    assert_true(cv.expanded);
    for (int l = 0; l < LAYOUT_COUNT; l++)
        assert_true(cv.layout_q[l] && cv.layout_k[l] && cv.layout_v[l] && cv.layout_out[l] && cv.layout_lse[l]);
    assert_true(cv.scale_given && cv.scale_zero_or_negative);
    assert_true(cv.aligned_f32_value);
    for (int d = 0; d < 3; d++) assert_true(cv.few_rows_in_place[d]);
}

/* The suite must run on at least the portable ISA and must not silently skip any ISA the machine offers. */
static void every_available_isa_is_exercised(void **state) {
    (void)state;
    const char *isas[CASE_MAX_ISAS];
    const int n = case_isas(isas, CASE_MAX_ISAS);
    assert_true(n >= 1);
    assert_string_equal(isas[0], "portable");
    for (int i = 0; i < n; i++) {
        assert_int_equal(af_set_isa(isas[i]), AF_OK);
        assert_string_equal(af_get_isa(), isas[i]);
    }
}

int main(void) {
    const int n = case_count();
    const uint64_t seed = suite_seed();
    sdpa_case *cases = calloc((size_t)n, sizeof *cases);
    struct CMUnitTest *tests = calloc((size_t)n + 2, sizeof *tests);
    char (*names)[48] = calloc((size_t)n, sizeof *names);
    if (!cases || !tests || !names) return 1;
    tests[0] = (struct CMUnitTest)cmocka_unit_test(generator_covers_every_feature);
    tests[1] = (struct CMUnitTest)cmocka_unit_test(every_available_isa_is_exercised);
    for (int i = 0; i < n; i++) {
        cases[i] = case_random(seed, i, SPLIT_KV_EVERY);
        snprintf(names[i], sizeof names[i], "random_case_%03d", i);
        tests[i + 2] = (struct CMUnitTest){.name = names[i], .test_func = random_case, .initial_state = &cases[i]};
    }
    const int failures = _cmocka_run_group_tests("sdpa_random", tests, (size_t)n + 2, NULL, NULL);
    free(cases);
    free(tests);
    free(names);
    return failures;
}
