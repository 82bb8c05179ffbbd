/* af_sdpa_backward and af_flash_attn_backward against the reference backward (on float32 copies of the inputs) on
 * seeded random cases: the forward suites' generators (case_random, flash_case_random: f32/f16/bf16, masks of every
 * broadcast shape, both causal alignments, GQA, Ev != E, scale; windows, softcap, sinks, varlen q/k, seqused_k,
 * empty sequences), shrunk so the double reference stays cheap, with dout and dq/dk/dv in random (strided,
 * transposed, padded) layouts; on every ISA and 1, 2 and 3 threads (bitwise equal), nothing written outside the
 * gradients, inputs unchanged. The bound is backward_case.h's. Paged K/V has no backward: those cases run varlen.
 * ATTNFORGE_TEST_CASES / _SEED as elsewhere (the two suites share the count). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>

#include "attnforge.h"
#include "backward_case.h"
#include "case_gen.h"
#include "flash_case.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define DEFAULT_CASES 24
#else
#define DEFAULT_CASES 36   /* per suite */
#endif
#define DEFAULT_SEED 20261203u

/* rows · keys · heads · (E + Ev) of a case (the reference runs twice per case); a tenth under valgrind's light runs */
static double work_budget(void) { return getenv("ATTNFORGE_TEST_LIGHT") ? 3e4 : 3e5; }

typedef struct {
    bool flash;
    sdpa_case s;
    flash_case f;
    uint64_t seed;
} random_case;

static double sdpa_work(const sdpa_case *c) { return (double)c->B * c->Hq * c->L * c->S * (c->E + c->Ev); }

static sdpa_case shrunk_sdpa(uint64_t seed, int index) {
    sdpa_case c = case_random(seed, index, 0);
    while (sdpa_work(&c) > work_budget()) {
        if (c.B > 1) c.B--;
        else if (c.L > 8) c.L = c.L * 3 / 4;
        else if (c.S > 8) c.S = c.S * 3 / 4;
        else if (c.E > 16 || c.Ev > 16) c.E = (c.E + 1) / 2, c.Ev = (c.Ev + 1) / 2;
        else break;
    }
    return c;
}

static double flash_work(const flash_case *c) {
    double w = 0.0;
    for (int b = 0; b < c->B; b++) w += (double)c->Lq[b] * (double)c->S_stored[b];
    return w * (double)c->Hq * (double)(c->E + c->Ev);
}

static flash_case shrunk_flash(uint64_t seed, int index) {
    flash_case c = flash_case_random(seed, index);
    if (c.kv == KV_PAGED) c.kv = KV_VARLEN, c.shared_page = false;
    while (flash_work(&c) > work_budget()) {
        int64_t S_max = 0;
        for (int b = 0; b < c.B; b++) S_max = c.S_stored[b] > S_max ? c.S_stored[b] : S_max;
        for (int b = 0; b < c.B; b++) {
            if (S_max > 16) c.S_stored[b] = c.S_stored[b] * 3 / 4;
            else c.Lq[b] = c.Lq[b] * 3 / 4;
            if (c.Sk[b] > c.S_stored[b]) c.Sk[b] = c.S_stored[b];
        }
    }
    return c;
}

static void describe(const random_case *rc, char *buf, size_t size) {
    if (rc->flash) flash_case_describe(&rc->f, buf, size);
    else case_describe(&rc->s, buf, size);
}

static void run_case(void **state) {
    const random_case *rc = *state;
    const grad_layouts layouts = backward_random_layouts(rc->seed);
    char desc[1024], why[1024] = "";
    describe(rc, desc, sizeof desc);
    backward_tensors t;
    const bool built = rc->flash ? backward_build_flash(&rc->f, &layouts, rc->seed, &t)
                                 : backward_build_sdpa(&rc->s, &layouts, rc->seed, &t);
    if (!built) {
        backward_free(&t);
        fail_msg("could not build the case (%s): %s", af_last_error(), desc);
    }
    const bool ok = backward_verify_everywhere(&t, why, sizeof why);
    backward_free(&t);
    if (!ok) fail_msg("%s\n    layouts dout/dq/dk/dv %s/%s/%s/%s\n    %s", desc, layout_name(layouts.dout),
                      layout_name(layouts.dq), layout_name(layouts.dk), layout_name(layouts.dv), why);
}

/* The shrunk suites still hold every feature; a change that drops one fails here. */
static void suites_cover_every_feature(void **state) {
    (void)state;
    bool dtype[3] = {0}, flash_dtype[3] = {0}, mask[3] = {0}, top_left = false, bottom_right = false, gqa = false;
    bool ev_differs = false, window = false, softcap = false, sink = false, varlen_q = false, varlen_k = false;
    bool seqused = false, strided = false;
    const uint64_t seed = case_suite_seed(DEFAULT_SEED);
    for (int i = 0; i < DEFAULT_CASES; i++) {
        const sdpa_case s = shrunk_sdpa(seed, i);
        const flash_case f = shrunk_flash(seed, i);
        dtype[s.dtype] = flash_dtype[f.dtype] = mask[s.mask] = true;
        top_left |= s.is_causal;
        bottom_right |= s.causal_bottom_right;
        gqa |= s.Hq > s.Hkv && f.Hq > f.Hkv;
        ev_differs |= s.E != s.Ev;
        window |= f.has_window;
        softcap |= f.softcap > 0.0;
        sink |= f.sink;
        varlen_q |= f.varlen_q;
        varlen_k |= f.kv == KV_VARLEN;
        seqused |= f.seqused;
        const grad_layouts l = backward_random_layouts(seed + (uint64_t)i);
        strided |= l.dq == LAYOUT_SLICED && l.dout == LAYOUT_SLICED;
    }
    for (int d = 0; d < 3; d++) assert_true(dtype[d] && flash_dtype[d] && mask[d]);
    assert_true(top_left && bottom_right && gqa && ev_differs && window && softcap && sink && varlen_q && varlen_k);
    assert_true(seqused && strided);
}

int main(void) {
    const int n_each = (case_suite_count(2 * DEFAULT_CASES) + 1) / 2, n = 2 * n_each;
    const uint64_t seed = case_suite_seed(DEFAULT_SEED);
    random_case *cases = calloc((size_t)n, sizeof *cases);
    struct CMUnitTest *tests = calloc((size_t)n + 1, sizeof *tests);
    char (*names)[40] = calloc((size_t)n, sizeof *names);
    if (!cases || !tests || !names) return 1;
    tests[0] = (struct CMUnitTest)cmocka_unit_test(suites_cover_every_feature);
    for (int i = 0; i < n; i++) {
        const bool flash = i >= n_each;
        const int index = flash ? i - n_each : i;
        cases[i] = (random_case){.flash = flash, .seed = seed + (uint64_t)index};
        if (flash) cases[i].f = shrunk_flash(seed, index);
        else cases[i].s = shrunk_sdpa(seed, index);
        snprintf(names[i], sizeof names[i], flash ? "flash_backward_%03d" : "sdpa_backward_%03d", index);
        tests[i + 1] = (struct CMUnitTest){.name = names[i], .test_func = run_case, .initial_state = &cases[i]};
    }
    const int failures = _cmocka_run_group_tests("backward_random", tests, (size_t)n + 1, NULL, NULL);
    free(cases);
    free(tests);
    free(names);
    return failures;
}
