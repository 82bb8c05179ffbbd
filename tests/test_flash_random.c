/* af_flash_attn against its double reference (on float32 copies of the inputs) on seeded random cases covering every
 * FlashAttention feature together: fixed / varlen / paged K/V, varlen queries, windows (causal, both sides, one
 * side, saturating sizes), softcap, sinks (some dominating), seqused_k, GQA, decode shapes (direct kernels, split-KV),
 * strided layouts; on every ISA and 1 and 2 threads (bitwise equal). A second suite runs the same features on float8
 * K/V (e4m3fn, e5m2) under f32/f16/bf16 queries and on all-float8 q/k/v, with and without descales (some 0 or huge).
 * ATTNFORGE_TEST_CASES / _SEED as elsewhere (the float8 suite takes two thirds of the count). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>

#include "attnforge.h"
#include "case_gen.h"
#include "flash_case.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define DEFAULT_CASES 72
#else
#define DEFAULT_CASES 162   /* 3 dtypes × 3 K/V forms × 6 window kinds, three times */
#endif
#define FP8_CASES(n) ((n) * 2 / 3)   /* 108 by default: 4 q kinds × 2 formats × 3 K/V forms, 4.5 times */
#define DEFAULT_SEED 20261201u

static void random_case(void **state) {
    char why[2048];
    if (!flash_case_build_and_verify(*state, why, sizeof why)) fail_msg("%s", why);
}

/* What the generator must produce over the default suite; a change that drops a feature fails here. */
static void generator_covers_every_feature(void **state) {
    (void)state;
    bool dtype[3] = {0}, form[3] = {0}, varlen_q = false, empty_q = false, empty_k = false, seqused_cut = false;
    bool causal = false, both = false, left_only = false, right_only = false, causal_left = false, window_0 = false;
    bool softcap = false, sink = false, sink_dominates = false, page_1 = false, page_odd = false, shared = false;
    bool gqa = false, decode = false, huge_window = false;
    for (int i = 0; i < 162; i++) {
        const flash_case c = flash_case_random(case_suite_seed(DEFAULT_SEED), i);
        dtype[c.dtype] = form[c.kv] = true;
        varlen_q |= c.varlen_q;
        for (int b = 0; b < c.B; b++) {
            empty_q |= c.varlen_q && c.Lq[b] == 0;
            empty_k |= c.kv != KV_FIXED && c.S_stored[b] == 0;
            seqused_cut |= c.Sk[b] < c.S_stored[b];
            decode |= c.S_stored[b] > 512;
        }
        causal |= c.causal && !c.has_window;
        both |= c.has_window && !c.causal && c.left >= 0 && c.right >= 0;
        left_only |= c.has_window && !c.causal && c.right == -1 && c.left >= 0;
        right_only |= c.has_window && c.left == -1 && c.right >= 0;
        causal_left |= c.causal && c.has_window && c.left >= 0;
        window_0 |= c.has_window && (c.left == 0 || c.right == 0);
        huge_window |= c.has_window && (c.left > (1ll << 62) || c.right > (1ll << 62));
        softcap |= c.softcap > 0.0;
        sink |= c.sink;
        sink_dominates |= c.sink && c.sink_offset > 0.0;
        page_1 |= c.kv == KV_PAGED && c.page_size == 1;
        page_odd |= c.kv == KV_PAGED && c.page_size % 16 != 0 && c.page_size > 1;
        shared |= c.shared_page;
        gqa |= c.Hq > c.Hkv;
    }
    for (int d = 0; d < 3; d++) assert_true(dtype[d] && form[d]);
    assert_true(varlen_q && empty_q && empty_k && seqused_cut && decode && gqa);
    assert_true(causal && both && left_only && right_only && causal_left && window_0 && huge_window);
    assert_true(softcap && sink && sink_dominates && page_1 && page_odd && shared);
}

/* The float8 suite: every q kind, both formats, every K/V form, decode and prefill, GQA, every descale kind. */
static void fp8_generator_covers_every_feature(void **state) {
    (void)state;
    bool mixed[3][2] = {{0}}, all_f8[2] = {0}, out_of_f8[3] = {0}, form[3] = {0}, descale[4] = {0};
    bool decode = false, prefill = false, gqa = false, varlen_q = false;
    for (int i = 0; i < FP8_CASES(DEFAULT_CASES); i++) {
        const flash_case c = flash_case_random_fp8(case_suite_seed(DEFAULT_SEED), i);
        const af_dtype kv = flash_case_kv_dtype(&c);
        assert_true(kv == AF_F8E4M3 || kv == AF_F8E5M2);
        const int f = kv == AF_F8E5M2;
        if (c.dtype == kv) all_f8[f] = out_of_f8[flash_case_out_dtype(&c)] = true;
        else mixed[c.dtype][f] = true;
        form[c.kv] = descale[c.descale] = true;
        for (int b = 0; b < c.B; b++) {
            decode |= c.Lq[b] <= 4 && c.S_stored[b] > 512;
            prefill |= c.Lq[b] > 16 && c.S_stored[b] > 16;
        }
        gqa |= c.Hq > c.Hkv;
        varlen_q |= c.varlen_q;
    }
    for (int f = 0; f < 2; f++) assert_true(mixed[0][f] && mixed[1][f] && mixed[2][f] && all_f8[f]);
    for (int d = 0; d < 3; d++) assert_true(out_of_f8[d] && form[d]);
    for (int d = 0; d < 4; d++) assert_true(descale[d]);
    assert_true(decode && prefill && gqa && varlen_q);
}

int main(void) {
    const int n_plain = case_suite_count(DEFAULT_CASES), n_fp8 = FP8_CASES(n_plain), n = n_plain + n_fp8;
    const uint64_t seed = case_suite_seed(DEFAULT_SEED);
    flash_case *cases = calloc((size_t)n, sizeof *cases);
    struct CMUnitTest *tests = calloc((size_t)n + 2, sizeof *tests);
    char (*names)[40] = calloc((size_t)n, sizeof *names);
    if (!cases || !tests || !names) return 1;
    tests[0] = (struct CMUnitTest)cmocka_unit_test(generator_covers_every_feature);
    tests[1] = (struct CMUnitTest)cmocka_unit_test(fp8_generator_covers_every_feature);
    for (int i = 0; i < n; i++) {
        const bool fp8 = i >= n_plain;
        cases[i] = fp8 ? flash_case_random_fp8(seed, i - n_plain) : flash_case_random(seed, i);
        snprintf(names[i], sizeof names[i], fp8 ? "flash_fp8_case_%03d" : "flash_case_%03d", fp8 ? i - n_plain : i);
        tests[i + 2] = (struct CMUnitTest){.name = names[i], .test_func = random_case, .initial_state = &cases[i]};
    }
    const int failures = _cmocka_run_group_tests("flash_random", tests, (size_t)n + 2, NULL, NULL);
    free(cases);
    free(tests);
    free(names);
    return failures;
}
