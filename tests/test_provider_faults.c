/* Out of memory in the provider: each allocation of one call fails in turn (n = 1, 2, ... until the call
 * succeeds), first the library's own (af_alloc, counted by af_alloc_count) and then jansson's (through
 * json_set_alloc_funcs). Every failure must be AF_ERR_NO_MEMORY (prepare: false, with a reason saying so) with
 * nothing returned and nothing written; leaks are LeakSanitizer's and valgrind's to find (the ASan build and
 * `make valgrind` run this test). test_core.c does the same for af_sdpa's own sites. */
#include <jansson.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "attnforge.h"
#include "core/alloc.h"
#include "provider/provider.h"
#include "provider_fixtures.h"
#include "test_tensor.h"

/* ---- jansson's allocations, counted and failed on demand like af_alloc's */

static long json_calls, json_fail_countdown;

static void *counting_malloc(size_t size) {
    json_calls++;
    if (json_fail_countdown > 0 && --json_fail_countdown == 0) return NULL;
    return malloc(size);
}

typedef enum { FAIL_AF_ALLOC, FAIL_JANSSON } fault_source;

static long allocations_now(fault_source source) { return source == FAIL_AF_ALLOC ? af_alloc_count() : json_calls; }

static void arm(fault_source source, long n) {
    if (source == FAIL_AF_ALLOC) af_test_fail_allocation(n);
    else json_fail_countdown = n;
}

/* ---- one operation under test */

typedef struct {
    const char *name;
    void (*before)(void *ctx);             /* outside the armed window: fresh inputs and sentinels */
    af_status (*run)(void *ctx);           /* the call; AF_ERR_NO_MEMORY when an allocation failed */
    void (*check_untouched)(void *ctx);    /* after a failure: nothing returned, nothing written */
    void (*after)(void *ctx);              /* releases what before and a successful run made */
    bool reads_json;                       /* jansson's lexer reports some of its failed allocations as a syntax
                                              error: AF_ERR_PARSE is then all a reader can say (docs/RELIABILITY.md) */
} operation;

static long sites_total[2];   /* allocations failed in turn, per source, over every operation */
static long parse_for_memory; /* of jansson's: reported as AF_ERR_PARSE (its lexer's failures) */

/* Fail allocation n of one run, for n = 1 .. until the run succeeds; returns how many allocations one run makes. */
static long fail_each_allocation(const operation *op, void *ctx, fault_source source) {
    if (op->before) op->before(ctx);
    const long start = allocations_now(source);
    if (op->run(ctx) != AF_OK) fail_msg("%s: fails without an injected fault: %s", op->name, af_last_error());
    const long sites = allocations_now(source) - start;
    if (op->after) op->after(ctx);
    long failures = 0;
    for (long n = 1;; n++) {
        if (op->before) op->before(ctx);
        arm(source, n);
        const af_status st = op->run(ctx);
        arm(source, 0);
        if (st == AF_OK) {
            if (op->after) op->after(ctx);
            break;
        }
        failures++;
        if (st == AF_ERR_PARSE && source == FAIL_JANSSON && op->reads_json) {
            parse_for_memory++;
        } else if (st != AF_ERR_NO_MEMORY)
            fail_msg("%s, %s allocation %ld failed: %s (%s), not AF_ERR_NO_MEMORY", op->name,
                     source == FAIL_AF_ALLOC ? "af_alloc" : "jansson", n, af_status_name(st), af_last_error());
        else if (!strstr(af_last_error(), "out of memory"))
            fail_msg("%s, allocation %ld: the message does not say out of memory: \"%s\"", op->name, n, af_last_error());
        if (op->check_untouched) op->check_untouched(ctx);
        if (op->after) op->after(ctx);
        if (n > sites + 1) fail_msg("%s: still failing after %ld of %ld allocations", op->name, n, sites);
    }
    if (failures != sites) fail_msg("%s: %ld failures for %ld allocations", op->name, failures, sites);
    sites_total[source] += sites;
    print_message("    %-46s %3ld %s allocations, each failed in turn\n", op->name, sites,
                  source == FAIL_AF_ALLOC ? "af_alloc" : "jansson ");
    return sites;
}

static void fail_each_allocation_of_both(const operation *op, void *ctx, long min_af_alloc_sites) {
    if (fail_each_allocation(op, ctx, FAIL_AF_ALLOC) < min_af_alloc_sites)
        fail_msg("%s: fewer than the %ld af_alloc sites it should reach", op->name, min_af_alloc_sites);
    fail_each_allocation(op, ctx, FAIL_JANSSON);
}

/* ---- samples: from_json, to_json, load, add_call */

/* Every kind of value a samples file holds: keyword q/k/v, GQA, a mask, strides, a device, None, numbers,
 * strings, lists and unknown keywords; 9 samples, so the list grows past its first capacity of 8. */
static const char *const SAMPLES_TEXT =
    "{'samples': ["
    " {'args': [{'shape': [2,4,17,8], 'dtype': 'float32', 'strides': [544,8,32,1]}, {'shape': [2,4,19,8], 'dtype': 'float32'},"
    "  {'shape': [2,4,19,8], 'dtype': 'float32', 'device': 'cpu'}], 'kwargs': {'is_causal': true, 'scale': 0.125}, 'count': 3},"
    " {'kwargs': {'query': {'shape': [1,4,16,64], 'dtype': 'bfloat16'}, 'key': {'shape': [1,2,16,64], 'dtype': 'bfloat16'},"
    "  'value': {'shape': [1,2,16,64], 'dtype': 'bfloat16'}, 'enable_gqa': true, 'dropout_p': 0, 'attn_mask': null}},"
    " {'args': [{'shape': [1,2,8,16], 'dtype': 'float16'}, {'shape': [1,2,8,16], 'dtype': 'float16'},"
    "  {'shape': [1,2,8,16], 'dtype': 'float16'}], 'kwargs': {'attn_mask': {'shape': [8,8], 'dtype': 'bool'}, 'window': [4, 4],"
    "  'softcap': 30.5, 'name': 'x'}},"
    " {'args': [null, 1, 'q']}, {'args': []}, {'kwargs': {}}, {'count': 2}, {'args': [true]}, {'args': [1.5]}"
    "]}";

typedef struct {
    char *text;
    size_t len;
    char path[64];
    af_samples *samples;
    char *json;
    af_tensor q, k, v, mask;
} samples_ctx;

static af_status samples_from_json(void *c) {
    samples_ctx *s = c;
    s->samples = (af_samples *)1;   /* must come back NULL on failure */
    return af_samples_from_json(s->text, s->len, &s->samples);
}

static af_status samples_load(void *c) {
    samples_ctx *s = c;
    s->samples = (af_samples *)1;
    return af_samples_load(s->path, &s->samples);
}

static void samples_none(void *c) { assert_null(((samples_ctx *)c)->samples); }

static void samples_release(void *c) {
    samples_ctx *s = c;
    af_samples_free(s->samples);
    s->samples = NULL;
    af_free(s->json);
    s->json = NULL;
}

static void samples_parse(void *c) {
    samples_ctx *s = c;
    assert_int_equal(af_samples_from_json(s->text, s->len, &s->samples), AF_OK);
}

static af_status samples_to_json(void *c) {
    samples_ctx *s = c;
    s->json = (char *)1;
    return af_samples_to_json(s->samples, &s->json);
}

static void json_none(void *c) { assert_null(((samples_ctx *)c)->json); }

/* add_call onto a list of 8 (so the list grows), every keyword add_call writes */
static void eight_samples(void *c) {
    samples_ctx *s = c;
    s->samples = af_samples_new();
    assert_non_null(s->samples);
    const af_sdpa_args args = {.query = &s->q, .key = &s->k, .value = &s->v};
    for (int i = 0; i < 8; i++) assert_int_equal(af_samples_add_call(s->samples, &args, AF_QKV_POSITIONAL, NULL, 1), AF_OK);
}

static af_status samples_add_call(void *c) {
    samples_ctx *s = c;
    const af_sdpa_args args = {.query = &s->q, .key = &s->k, .value = &s->v, .attn_mask = &s->mask, .dropout_p = 0.5,
                               .is_causal = true, .has_scale = true, .scale = 0.5, .enable_gqa = true,
                               .causal_bottom_right = true};
    return af_samples_add_call(s->samples, &args, AF_QKV_KEYWORD, "cuda:1", 2);
}

static void still_eight(void *c) { assert_int_equal(af_samples_count(((samples_ctx *)c)->samples), 8); }

static void samples_setup(samples_ctx *s) {
    memset(s, 0, sizeof *s);
    s->text = fx_json(SAMPLES_TEXT);
    s->len = strlen(s->text);
    const int64_t qs[4] = {1, 4, 16, 8}, kvs[4] = {1, 2, 16, 8}, ms[2] = {16, 16};
    s->q = af_tensor_contiguous(NULL, AF_F32, 4, qs);
    s->k = af_tensor_contiguous(NULL, AF_F32, 4, kvs);
    s->v = af_tensor_contiguous(NULL, AF_F32, 4, kvs);
    s->mask = af_tensor_contiguous(NULL, AF_BOOL, 2, ms);
}

static void samples_json_survives_every_allocation_failure(void **state) {
    (void)state;
    samples_ctx s;
    samples_setup(&s);
    const operation from_json = {"af_samples_from_json", NULL, samples_from_json, samples_none, samples_release, true};
    fail_each_allocation_of_both(&from_json, &s, 20);   /* list, args/kwargs per sample, names, other values */
    const operation to_json = {"af_samples_to_json", samples_parse, samples_to_json, json_none, samples_release, false};
    fail_each_allocation_of_both(&to_json, &s, 1);
    const operation add_call = {"af_samples_add_call", eight_samples, samples_add_call, still_eight, samples_release, false};
    fail_each_allocation(&add_call, &s, FAIL_AF_ALLOC);   /* add_call makes no JSON */
    free(s.text);
}

static void samples_file_survives_every_allocation_failure(void **state) {
    (void)state;
    samples_ctx s;
    samples_setup(&s);
    /* pad the file past the reader's first 4 KiB buffer so that it has to grow */
    snprintf(s.path, sizeof s.path, "/tmp/attnforge_faults_%ld.json", (long)getpid());
    FILE *f = fopen(s.path, "w");
    assert_non_null(f);
    fputs(s.text, f);
    for (int i = 0; i < 5000; i++) fputc(' ', f);
    fclose(f);
    const operation load = {"af_samples_load (a 5 KiB file)", NULL, samples_load, samples_none, samples_release, true};
    fail_each_allocation_of_both(&load, &s, 22);   /* from_json's, plus the file buffer and its growth */
    remove(s.path);
    free(s.text);
}

static void new_lists_and_providers_report_no_memory(void **state) {
    (void)state;
    af_test_fail_allocation(1);
    assert_null(af_samples_new());
    af_test_fail_allocation(1);
    assert_null(af_provider_new());
    af_test_fail_allocation(0);
    sites_total[FAIL_AF_ALLOC] += 2;
}

/* ---- the provider: prepare, to_json, from_json */

typedef struct {
    af_samples *samples;
    af_provider *provider;
    char *plan_text;
    char *json;
} plan_ctx;

static void fresh_provider(void *c) {
    plan_ctx *p = c;
    p->provider = af_provider_new();
    assert_non_null(p->provider);
}

/* prepare is a bool: a failure must be a refusal whose reason says why, with no plan left behind */
static af_status prepare(void *c) {
    plan_ctx *p = c;
    if (af_provider_prepare(p->provider, p->samples)) return AF_OK;
    if (strstr(af_provider_reason(p->provider), "out of memory")) return AF_ERR_NO_MEMORY;
    return AF_ERR_INTERNAL;
}

static void not_prepared(void *c) {
    plan_ctx *p = c;
    assert_false(af_provider_is_prepared(p->provider));
    af_plan plan;
    assert_int_equal(af_provider_get_plan(p->provider, &plan), AF_ERR_NOT_PREPARED);
}

static void provider_release(void *c) {
    plan_ctx *p = c;
    af_provider_free(p->provider);
    p->provider = NULL;
    af_free(p->json);
    p->json = NULL;
}

static void prepared_provider(void *c) {
    plan_ctx *p = c;
    fresh_provider(c);
    assert_true(af_provider_prepare(p->provider, p->samples));
}

static af_status plan_to_json(void *c) {
    plan_ctx *p = c;
    p->json = (char *)1;
    return af_provider_to_json(p->provider, &p->json);
}

static void no_plan_json(void *c) { assert_null(((plan_ctx *)c)->json); }

static af_status plan_from_json(void *c) {
    plan_ctx *p = c;
    p->provider = (af_provider *)1;
    const af_status st = af_provider_from_json(p->plan_text, strlen(p->plan_text), &p->provider);
    return st;
}

static void no_provider(void *c) {
    plan_ctx *p = c;
    assert_null(p->provider);
}

static void provider_survives_every_allocation_failure(void **state) {
    (void)state;
    plan_ctx p;
    memset(&p, 0, sizeof p);
    /* two samples with keywords to check (prepare's only allocation is that list, once per sample) */
    p.samples = fx_samples("{'samples': ["
                           " {'args': [{'shape': [2,4,17,8], 'dtype': 'float32'}, {'shape': [2,2,19,8], 'dtype': 'float32'},"
                           "  {'shape': [2,2,19,8], 'dtype': 'float32'}], 'kwargs': {'is_causal': true, 'scale': 0.125, 'enable_gqa': true}},"
                           " {'args': [{'shape': [1,4,5,8], 'dtype': 'float32'}, {'shape': [1,2,9,8], 'dtype': 'float32'},"
                           "  {'shape': [1,2,9,8], 'dtype': 'float32'}], 'kwargs': {'is_causal': true, 'scale': 0.125, 'enable_gqa': true}}"
                           "]}");
    assert_non_null(p.samples);
    const operation prep = {"af_provider_prepare (2 samples)", fresh_provider, prepare, not_prepared, provider_release, false};
    fail_each_allocation(&prep, &p, FAIL_AF_ALLOC);   /* prepare makes no JSON */
    const operation to_json = {"af_provider_to_json", prepared_provider, plan_to_json, no_plan_json, provider_release, false};
    fail_each_allocation_of_both(&to_json, &p, 1);
    p.plan_text = fx_json("{'type': 'FlashAttention4KernelProvider', 'version': 1, 'qkv_source': 'keyword_qkv',"
                          " 'flash_kwargs': {'causal': true, 'softmax_scale': 0.125, 'pack_gqa': false},"
                          " 'copy_free_layout': false, 'backend': 'cpu'}");
    const operation from_json = {"af_provider_from_json", NULL, plan_from_json, no_provider, provider_release, true};
    fail_each_allocation_of_both(&from_json, &p, 1);
    free(p.plan_text);
    af_samples_free(p.samples);
}

/* ---- infer: the copy plan's NHD scratch, the one-call buffer when the scratch is busy, the kernel's memory */

typedef struct {
    const char *plan;
    af_provider *provider;
    test_tensor q, k, v, out, lse;
    af_sdpa_args args;
    bool scratch_busy;   /* hold the provider's scratch, as another thread's call would */
} infer_ctx;

static void infer_before(void *c) {
    infer_ctx *x = c;
    char *text = fx_json(x->plan);
    assert_int_equal(af_provider_from_json(text, strlen(text), &x->provider), AF_OK);
    free(text);
    if (x->scratch_busy) assert_int_equal(pthread_mutex_lock(&x->provider->scratch_lock), 0);
    tt_fill_bytes(&x->out, TT_SENTINEL_BYTE);
    tt_fill_bytes(&x->lse, TT_SENTINEL_BYTE);
}

static af_status infer_run(void *c) {
    infer_ctx *x = c;
    return af_provider_infer(x->provider, &x->args, AF_QKV_POSITIONAL, &x->out.view, &x->lse.view);
}

static void infer_untouched(void *c) {
    infer_ctx *x = c;
    for (size_t i = 0; i < x->out.bytes; i++)
        if (x->out.memory[i] != TT_SENTINEL_BYTE) fail_msg("infer failed, but out was written");
    for (size_t i = 0; i < x->lse.bytes; i++)
        if (x->lse.memory[i] != TT_SENTINEL_BYTE) fail_msg("infer failed, but lse was written");
}

static void infer_after(void *c) {
    infer_ctx *x = c;
    if (x->scratch_busy) pthread_mutex_unlock(&x->provider->scratch_lock);
    af_provider_free(x->provider);
    x->provider = NULL;
}

static void infer_setup(infer_ctx *x, const char *plan, int64_t L, int64_t S, bool is_causal, bool nhd) {
    memset(x, 0, sizeof *x);
    x->plan = plan;
    test_rng rng = {7};
    const int64_t qs[4] = {1, 4, L, 16}, kvs[4] = {1, 2, S, 16}, os[4] = {1, 4, L, 16}, ls[3] = {1, 4, L};
    const tensor_layout layout = nhd ? LAYOUT_NHD : LAYOUT_CONTIGUOUS;
    assert_true(tt_alloc(&x->q, AF_F32, 4, qs, layout, &rng));
    assert_true(tt_alloc(&x->k, AF_F32, 4, kvs, layout, &rng));
    assert_true(tt_alloc(&x->v, AF_F32, 4, kvs, layout, &rng));
    assert_true(tt_alloc(&x->out, AF_F32, 4, os, LAYOUT_CONTIGUOUS, &rng));
    assert_true(tt_alloc(&x->lse, AF_F32, 3, ls, LAYOUT_CONTIGUOUS, &rng));
    tt_fill_uniform(&x->q, &rng, 1.0);
    tt_fill_uniform(&x->k, &rng, 1.0);
    tt_fill_uniform(&x->v, &rng, 1.0);
    x->args = (af_sdpa_args){.query = &x->q.view, .key = &x->k.view, .value = &x->v.view, .is_causal = is_causal,
                             .enable_gqa = true};
}

static void infer_teardown(infer_ctx *x) {
    tt_free(&x->q);
    tt_free(&x->k);
    tt_free(&x->v);
    tt_free(&x->out);
    tt_free(&x->lse);
}

static const char *const COPY_PLAN = "{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'positional_qkv',"
                                     " 'flash_kwargs': {'causal': true, 'pack_gqa': false}, 'copy_free_layout': false}";
static const char *const COPY_FREE_PLAN = "{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'positional_qkv',"
                                          " 'flash_kwargs': {'causal': false, 'pack_gqa': false}, 'copy_free_layout': true}";

static void infer_survives_every_allocation_failure(void **state) {
    (void)state;
    af_set_num_threads(2);
    infer_ctx x;
    const operation infer = {"af_provider_infer, copy plan", infer_before, infer_run, infer_untouched, infer_after, false};
    infer_setup(&x, COPY_PLAN, 37, 53, true, false);
    fail_each_allocation(&infer, &x, FAIL_AF_ALLOC);          /* the NHD scratch, then the kernel's tiles */
    const operation busy = {"af_provider_infer, copy plan, scratch busy", infer_before, infer_run, infer_untouched,
                            infer_after, false};
    x.scratch_busy = true;
    fail_each_allocation(&busy, &x, FAIL_AF_ALLOC);           /* the one-call buffer instead of the scratch */
    infer_teardown(&x);

    infer_setup(&x, COPY_PLAN, 2, 1500, true, false);         /* decode: split-KV partials and their merge too */
    const operation split = {"af_provider_infer, copy plan, split-KV", infer_before, infer_run, infer_untouched,
                             infer_after, false};
    if (fail_each_allocation(&split, &x, FAIL_AF_ALLOC) < 4) fail_msg("split-KV infer: expected 4 allocations");
    infer_teardown(&x);

    infer_setup(&x, COPY_FREE_PLAN, 2, 1500, false, true);    /* copy-free: only the kernel's */
    const operation copy_free = {"af_provider_infer, copy-free plan, split-KV", infer_before, infer_run,
                                 infer_untouched, infer_after, false};
    fail_each_allocation(&copy_free, &x, FAIL_AF_ALLOC);
    x.args.is_causal = true;                                  /* not the plan's: the general path */
    const operation general = {"af_provider_infer, general path", infer_before, infer_run, infer_untouched, infer_after, false};
    fail_each_allocation(&general, &x, FAIL_AF_ALLOC);
    infer_teardown(&x);
    af_set_num_threads(0);
}

static void totals(void **state) {
    (void)state;
    print_message("    total: %ld af_alloc and %ld jansson allocations failed in turn (%ld of jansson's reported as "
                  "AF_ERR_PARSE)\n", sites_total[FAIL_AF_ALLOC], sites_total[FAIL_JANSSON], parse_for_memory);
    assert_true(sites_total[FAIL_AF_ALLOC] > 0 && sites_total[FAIL_JANSSON] > 0);
}

int main(void) {
    json_set_alloc_funcs(counting_malloc, free);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(samples_json_survives_every_allocation_failure),
        cmocka_unit_test(samples_file_survives_every_allocation_failure),
        cmocka_unit_test(new_lists_and_providers_report_no_memory),
        cmocka_unit_test(provider_survives_every_allocation_failure),
        cmocka_unit_test(infer_survives_every_allocation_failure),
        cmocka_unit_test(totals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
