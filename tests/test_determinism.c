/* Determinism (docs/RELIABILITY.md): the same inputs give bitwise the same out and lse whatever the thread count
 * (1, 2, 3, 8) and on repeated calls, on every ISA this machine has, for prefill, causal, masked, GQA and split-KV
 * decode shapes. (Different ISAs may differ in the last bits; each is within tolerance of the reference.) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <cmocka.h>

#include "attnforge.h"
#include "case_gen.h"

static const int THREAD_COUNTS[] = {1, 3, 2, 8};   /* valgrind's light runs take the first two */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define DEFAULT_REPEATS 1   /* calls per thread count: sanitizer builds run ~20x slower */
#else
#define DEFAULT_REPEATS 3   /* calls per thread count */
#endif

/* ATTNFORGE_TEST_CALLS: calls per thread count (valgrind, ~50x slower, uses 1) */
static int repeats(void) {
    const char *env = getenv("ATTNFORGE_TEST_CALLS");
    const int n = env ? atoi(env) : DEFAULT_REPEATS;
    return n > 0 ? n : DEFAULT_REPEATS;
}

typedef struct {
    const char *name;
    sdpa_case c;
    bool split_kv;   /* the shape must take driver.c's split-KV path */
} named_case;

static named_case make(const char *name, af_dtype dtype, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S,
                       int64_t E, int64_t Ev) {
    named_case n = {name, case_default(B, Hq, Hkv, L, S, E, Ev), false};
    n.c.dtype = dtype;
    n.c.seed = (uint64_t)L * 1000003u + (uint64_t)S;
    n.split_kv = case_is_split_kv(&n.c);
    return n;
}

/* One case, every ISA: the first call (1 thread) against the reference, then every other thread count and repeat
 * against the first call's bytes, out's and lse's whole buffers (padding included: nothing else written either). */
static void check_deterministic(named_case *n) {
    case_tensors t;
    if (!case_build(&n->c, &t)) fail_msg("%s: could not build: %s", n->name, af_last_error());
    const char *isas[4];
    const int isa_count = case_isas(isas, 4);
    for (int i = 0; i < isa_count; i++) {
        assert_int_equal(case_run_kernel(&t, isas[i], 1), AF_OK);
        char why[512];
        if (!case_matches_reference(&t, NULL, why, sizeof why)) fail_msg("%s on %s: %s", n->name, isas[i], why);
        unsigned char *first_out = tt_snapshot(&t.out), *first_lse = tt_snapshot(&t.lse);
        const size_t counts = case_first_threads() > 1 ? 2 : sizeof THREAD_COUNTS / sizeof THREAD_COUNTS[0];
        for (size_t k = 0; k < counts; k++)
            for (int r = 0; r < repeats(); r++) {
                assert_int_equal(case_run_kernel(&t, isas[i], THREAD_COUNTS[k]), AF_OK);
                if (!tt_same_as(&t.out, first_out) || !tt_same_as(&t.lse, first_lse))
                    fail_msg("%s on %s: %d threads, call %d: not bitwise the 1-thread result", n->name, isas[i],
                             THREAD_COUNTS[k], r + 1);
            }
        free(first_out);
        free(first_lse);
    }
    print_message("    %-44s %d ISA(s) x threads %s x %d calls: identical\n", n->name, isa_count,
                  case_first_threads() > 1 ? "{1,3}" : "{1,3,2,8}", repeats());
    case_free(&t);
    af_set_num_threads(0);
}

static void prefill_shapes_are_deterministic(void **state) {
    (void)state;
    named_case cases[] = {
        make("f32 causal prefill L=S=200", AF_F32, 1, 4, 4, 200, 200, 64, 64),
        make("bf16 GQA 8/2, L=77 S=300, E=80 Ev=48", AF_BF16, 2, 8, 2, 77, 300, 80, 48),
        make("f16 additive mask (1,L,S), L=65 S=129", AF_F16, 1, 4, 4, 65, 129, 32, 32),
        make("f32 bool mask (B,1,L,S), sliced layouts", AF_F32, 2, 3, 3, 40, 90, 17, 33),
        make("f32 bottom-right causal L=100 S=60", AF_F32, 1, 2, 1, 100, 60, 256, 256),
    };
    cases[0].c.is_causal = true;
    cases[2].c.mask = MASK_ADDITIVE;
    cases[2].c.mask_shape = "1LS";
    cases[3].c.mask = MASK_BOOL;
    cases[3].c.mask_shape = "B1LS";
    cases[3].c.masked_row_rate = 0.2;
    cases[3].c.q_layout = cases[3].c.k_layout = cases[3].c.v_layout = cases[3].c.out_layout = LAYOUT_SLICED;
    cases[4].c.causal_bottom_right = true;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        assert_false(cases[i].split_kv);
        check_deterministic(&cases[i]);
    }
}

static void split_kv_decode_is_deterministic(void **state) {
    (void)state;
    named_case cases[] = {
        make("split-KV f16 decode, 8/2 heads, L=1 S=3000", AF_F16, 2, 8, 2, 1, 3000, 128, 128),
        make("split-KV f32, 64 rows (L=32, group 2), S=1025", AF_F32, 1, 4, 2, 32, 1025, 64, 64),
        make("split-KV bf16 bottom-right causal L=4 S=2100", AF_BF16, 1, 16, 4, 4, 2100, 64, 64),
        make("split-KV f32 top-left causal L=3 S=2600", AF_F32, 1, 8, 8, 3, 2600, 32, 16),
        make("split-KV f32 bool mask (S), NHD, S=4097", AF_F32, 1, 4, 1, 2, 4097, 64, 64),
    };
    cases[2].c.causal_bottom_right = true;
    cases[3].c.is_causal = true;
    cases[4].c.mask = MASK_BOOL;
    cases[4].c.mask_shape = "S";
    cases[4].c.q_layout = cases[4].c.k_layout = cases[4].c.v_layout = LAYOUT_NHD;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (!cases[i].split_kv) fail_msg("%s: not a split-KV shape", cases[i].name);
        check_deterministic(&cases[i]);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(prefill_shapes_are_deterministic),
        cmocka_unit_test(split_kv_decode_is_deterministic),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
