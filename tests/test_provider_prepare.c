/* prepare(samples): every rule of SPEC §2 in the seed's order with the seed's messages, the seed's unit-test
 * cases (research notes §8), attnforge's own kernel checks, the one-plan rule, the copy-free rule, logging. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "attnforge.h"
#include "provider/layout.h"
#include "provider/provider.h"
#include "provider_fixtures.h"

/* The seed's shapes: q (2,4,17,8), k/v (2,4,19,8), HND-contiguous or HND views of NHD memory. */
#define Q "{'shape': [2,4,17,8], 'dtype': 'float16'}"
#define KV "{'shape': [2,4,19,8], 'dtype': 'float16'}"
#define Q_NHD "{'shape': [2,4,17,8], 'dtype': 'float16', 'strides': [544,8,32,1]}"
#define KV_NHD "{'shape': [2,4,19,8], 'dtype': 'float16', 'strides': [608,8,32,1]}"
#define T(shape) "{'shape': " shape ", 'dtype': 'float32'}"
#define POS(q, k, v, kwargs) "{'args': [" q ", " k ", " v "], 'kwargs': {" kwargs "}}"
#define KW(q, k, v, more) "{'kwargs': {'query': " q ", 'key': " k ", 'value': " v more "}}"
#define SAMPLES(a) "{'samples': [" a "]}"
#define SAMPLES2(a, b) "{'samples': [" a ", " b "]}"
#define SAMPLES3(a, b, c) "{'samples': [" a ", " b ", " c "]}"
#define SAMPLES5(a, b, c, d, e) "{'samples': [" a ", " b ", " c ", " d ", " e "]}"
#define MHA POS(T("[1,2,8,16]"), T("[1,2,8,16]"), T("[1,2,8,16]"), "")

static int setup(void **state) {
    (void)state;
    fx_log_start();
    return 0;
}

static int teardown(void **state) {
    (void)state;
    fx_log_stop();
    return 0;
}

static void expect_refused(const char *samples, const char *rule) {
    char reason[2048];
    af_plan plan;
    bool ok = fx_prepare(samples, &plan, reason, sizeof reason);
    if (ok || !strstr(reason, rule)) fail_msg("expected a refusal containing \"%s\", got %s: \"%s\"", rule, ok ? "a plan" : "false", reason);
    assert_true(strncmp(reason, "FlashAttention-4 provider ", 26) == 0);
}

static af_plan expect_plan(const char *samples) {
    char reason[2048];
    af_plan plan;
    memset(&plan, 0, sizeof plan);
    if (!fx_prepare(samples, &plan, reason, sizeof reason)) fail_msg("expected a plan, got: %s", reason);
    return plan;
}

/* ---- the seed's unit-test cases */

static void empty_list_is_refused(void **state) {
    (void)state;
    expect_refused("{'samples': []}", "requires consistent representative samples");
    assert_int_equal(fx_log_count("FlashAttention-4 requires consistent representative samples"), 1);
}

static void null_samples_are_refused(void **state) {
    (void)state;
    af_provider *p = af_provider_new();
    assert_false(af_provider_prepare(p, NULL));
    assert_non_null(strstr(af_provider_reason(p), "samples"));
    af_provider_free(p);
    assert_false(af_provider_prepare(NULL, NULL));
}

static void attn_mask_is_refused(void **state) {
    (void)state;
    expect_refused(SAMPLES(POS(T("[1,2,8,16]"), T("[1,2,8,16]"), T("[1,2,8,16]"), "'attn_mask': {'shape': [8,8], 'dtype': 'bool'}")),
                   "FlashAttention-4 provider does not support attn_mask");
    assert_int_equal(fx_log_count("FlashAttention-4 not supported due to: FlashAttention-4 provider does not support attn_mask"), 1);
    expect_refused(SAMPLES(POS(T("[1,2,8,16]"), T("[1,2,8,16]"), T("[1,2,8,16]"), "'attn_mask': 'causal'")),
                   "does not support attn_mask");
    expect_plan(SAMPLES(POS(T("[1,2,8,16]"), T("[1,2,8,16]"), T("[1,2,8,16]"), "'attn_mask': null")));   /* None is fine */
}

static void mixed_positional_and_keyword_are_inconsistent(void **state) {
    (void)state;
    expect_refused(SAMPLES2(POS(Q, KV, KV, ""), KW(Q, KV, KV, "")), "requires consistent representative samples");
    expect_refused(SAMPLES2(POS(Q, KV, KV, ""), KW(Q, KV, KV, "")), "qkv_source positional_qkv vs keyword_qkv");
}

static void dropout_is_refused_unless_zero(void **state) {
    (void)state;
    expect_refused(SAMPLES(POS(Q, KV, KV, "'dropout_p': 0.1")), "FlashAttention-4 provider only supports dropout_p=0.0");
    assert_true(fx_log_count("dropout_p=0.0") >= 1);
    expect_refused(SAMPLES(POS(Q, KV, KV, "'dropout_p': null")), "only supports dropout_p=0.0");   /* None != 0.0 */
    expect_refused(SAMPLES(POS(Q, KV, KV, "'dropout_p': true")), "only supports dropout_p=0.0");
    expect_plan(SAMPLES(POS(Q, KV, KV, "'dropout_p': 0")));        /* integer 0 is accepted */
    expect_plan(SAMPLES(POS(Q, KV, KV, "'dropout_p': 0.0")));
    expect_plan(SAMPLES(POS(Q, KV, KV, "'dropout_p': false")));    /* False == 0.0 in Python */
}

static void unknown_kwargs_are_refused_by_name(void **state) {
    (void)state;
    expect_refused(SAMPLES(POS(Q, KV, KV, "'unsupported': 1")), "FlashAttention-4 provider does not support kwargs: ['unsupported']");
    assert_true(fx_log_count("does not support kwargs") >= 1);
    /* sorted, as Python's sorted(kwargs), with Python's repr quoting */
    expect_refused(SAMPLES(POS(Q, KV, KV, "'zeta': 1, 'alpha': [1], 'is_causal': true")),
                   "does not support kwargs: ['alpha', 'zeta']");
    expect_refused(SAMPLES(POS(Q, KV, KV, "'it\\u0027s': 1, 'a\\\\b': 2")),   /* the names it's and a\b */
                   "does not support kwargs: ['a\\\\b', \"it's\"]");
    /* q given positionally and again by keyword: the keyword is left over */
    expect_refused(SAMPLES(POS(Q, KV, KV, "'query': " Q)), "does not support kwargs: ['query']");
    /* attnforge's own bottom-right flag is not an SDPA keyword */
    expect_refused(SAMPLES(POS(Q, KV, KV, "'causal_bottom_right': true")), "does not support kwargs: ['causal_bottom_right']");
}

static void q_that_is_not_a_tensor_is_refused(void **state) {
    (void)state;
    expect_refused(SAMPLES("{'args': [null, " KV ", " KV "]}"), "FlashAttention-4 provider requires tensor query, key and value");
    expect_refused(SAMPLES("{'args': [" Q ", 3, " KV "]}"), "requires tensor query, key and value (samples[0]: key is a number");
    expect_refused(SAMPLES("{'kwargs': {'query': " Q ", 'key': " KV ", 'value': 'v'}}"), "value is a string");
}

static void shape_mismatches_are_refused(void **state) {
    (void)state;
    expect_refused(SAMPLES(POS(T("[4,17,8]"), T("[2,4,19,8]"), T("[2,4,19,8]"), "")),
                   "FlashAttention-4 provider requires 4D query, key and value");
    expect_refused(SAMPLES(POS(T("[3,4,17,8]"), T("[2,4,19,8]"), T("[2,4,19,8]"), "")),
                   "FlashAttention-4 provider requires matching batch dimensions");
    expect_refused(SAMPLES(POS(T("[2,4,17,8]"), T("[2,4,19,8]"), T("[2,4,20,8]"), "")),
                   "FlashAttention-4 provider requires matching key/value sequence lengths");
    expect_refused(SAMPLES(POS(T("[2,4,17,8]"), T("[2,4,19,7]"), T("[2,4,19,8]"), "")),
                   "FlashAttention-4 provider requires matching query/key head dimensions");
    expect_refused(SAMPLES(POS(T("[2,4,17,8]"), T("[2,4,19,8]"), T("[2,2,19,8]"), "")),
                   "FlashAttention-4 provider requires matching key/value head counts");
    expect_refused(SAMPLES(POS(T("[2,4,17,8]"), T("[2,2,19,8]"), T("[2,2,19,8]"), "")),
                   "FlashAttention-4 provider requires valid grouped-query attention");
}

static void grouped_query_rules(void **state) {
    (void)state;
    const char *fewer_query_heads = SAMPLES(POS(T("[1,2,8,16]"), T("[1,4,8,16]"), T("[1,4,8,16]"), "'enable_gqa': true"));
    expect_refused(fewer_query_heads, "requires valid grouped-query attention");
    expect_refused(SAMPLES(POS(T("[1,6,8,16]"), T("[1,4,8,16]"), T("[1,4,8,16]"), "'enable_gqa': true")),
                   "requires valid grouped-query attention");
    /* Hkv = 0: the seed divides by zero; here it is the same refusal */
    expect_refused(SAMPLES(POS(T("[1,4,8,16]"), T("[1,0,8,16]"), T("[1,0,8,16]"), "'enable_gqa': true")),
                   "requires valid grouped-query attention");
    af_plan plan = expect_plan(SAMPLES(POS(T("[1,4,8,16]"), T("[1,1,8,16]"), T("[1,1,8,16]"), "'enable_gqa': true")));
    assert_true(plan.gqa);   /* MQA */
    plan = expect_plan(SAMPLES(POS(T("[1,4,8,16]"), T("[1,4,8,16]"), T("[1,4,8,16]"), "'enable_gqa': true")));
    assert_false(plan.gqa);  /* Hq == Hkv: plain MHA, enable_gqa ignored */
}

static void gqa_gives_pack_gqa_false(void **state) {
    (void)state;
    const char *text = SAMPLES(KW("{'shape': [2,4,17,8], 'dtype': 'bfloat16'}", "{'shape': [2,2,19,8], 'dtype': 'bfloat16'}",
                                  "{'shape': [2,2,19,8], 'dtype': 'bfloat16'}", ", 'enable_gqa': true"));
    af_samples *samples = fx_samples(text);
    af_provider *p = af_provider_new();
    assert_true(af_provider_prepare(p, samples));
    char *json = NULL;
    assert_int_equal(af_provider_to_json(p, &json), AF_OK);
    assert_non_null(strstr(json, "\"flash_kwargs\": {\"causal\": false, \"pack_gqa\": false}"));
    af_free(json);
    af_provider_free(p);
    af_samples_free(samples);
}

static void only_two_positionals_are_refused(void **state) {
    (void)state;
    const char *rule = "FlashAttention-4 provider only supports positional or query/key/value qkv arguments";
    expect_refused(SAMPLES("{'args': [" Q ", " KV "]}"), rule);
    expect_refused(SAMPLES("{'args': [" Q ", " KV "], 'kwargs': {'value': " KV "}}"), rule);           /* sdpa(q, k, value=v) */
    expect_refused(SAMPLES("{'args': [" Q "], 'kwargs': {'key': " KV ", 'value': " KV "}}"), rule);    /* sdpa(q, key=k, value=v) */
    expect_refused(SAMPLES("{'args': [" Q ", " KV ", " KV ", null]}"), rule);                           /* a 4th positional */
    expect_refused(SAMPLES("{'kwargs': {'query': " Q ", 'key': " KV "}}"), rule);                        /* no value */
    expect_refused(SAMPLES("{}"), rule);
}

/* q (2,4,17,8), k/v (2,4,19,8), is_causal, scale 0.125: positional or keyword, each layout */
static void the_seed_case_in_both_layouts(void **state) {
    (void)state;
    const char *cases[4] = {
        SAMPLES(POS(Q_NHD, KV_NHD, KV_NHD, "'is_causal': true, 'scale': 0.125")),
        SAMPLES(KW(Q_NHD, KV_NHD, KV_NHD, ", 'is_causal': true, 'scale': 0.125")),
        SAMPLES(POS(Q, KV, KV, "'is_causal': true, 'scale': 0.125")),
        SAMPLES(KW(Q, KV, KV, ", 'is_causal': true, 'scale': 0.125")),
    };
    for (int i = 0; i < 4; i++) {
        fx_log_start();
        af_samples *samples = fx_samples(cases[i]);
        assert_non_null(samples);
        af_provider *p = af_provider_new();
        assert_true(af_provider_prepare(p, samples));
        assert_string_equal(af_provider_reason(p), "");
        af_plan plan;
        assert_int_equal(af_provider_get_plan(p, &plan), AF_OK);
        assert_int_equal(plan.qkv_source, i % 2 ? AF_QKV_KEYWORD : AF_QKV_POSITIONAL);
        assert_true(plan.causal);
        assert_true(plan.has_softmax_scale);
        assert_true(plan.softmax_scale == 0.125);
        assert_false(plan.gqa);
        assert_int_equal(plan.copy_free_layout, i < 2);
        char *json = NULL;
        assert_int_equal(af_provider_to_json(p, &json), AF_OK);
        assert_non_null(strstr(json, "\"flash_kwargs\": {\"causal\": true, \"softmax_scale\": 0.125}"));
        assert_non_null(strstr(json, i < 2 ? "\"copy_free_layout\": true" : "\"copy_free_layout\": false"));
        /* the copy path warns once, at prepare time, in the seed's words */
        assert_int_equal(fx_log_count("FlashAttention-4 must copy query, key, and value tensors from HND to NHD layout on "
                                      "every call; this may reduce performance. Use HND views of NHD-contiguous tensors "
                                      "to enable the copy-free path."), i < 2 ? 0 : 1);
        af_free(json);
        af_provider_free(p);
        af_samples_free(samples);
    }
}

static void samples_must_agree_on_one_plan(void **state) {
    (void)state;
#define CAUSAL POS(Q, KV, KV, "'is_causal': true")
#define PLAIN POS(Q, KV, KV, "")
    expect_refused(SAMPLES2(CAUSAL, PLAIN), "requires consistent representative samples (samples[1] differs from samples[0]: is_causal true vs false)");
    expect_refused(SAMPLES2(POS(Q, KV, KV, "'scale': 0.125"), PLAIN), "scale 0.125 vs None");
    expect_refused(SAMPLES2(POS(Q, KV, KV, "'scale': 0.125"), POS(Q, KV, KV, "'scale': 0.25")), "scale 0.125 vs 0.25");
    expect_refused(SAMPLES2(POS(Q_NHD, KV_NHD, KV_NHD, ""), PLAIN), "copy_free_layout true vs false");
    expect_refused(SAMPLES2(POS(T("[1,4,8,16]"), T("[1,4,8,16]"), T("[1,4,8,16]"), "'enable_gqa': true"),
                           POS(T("[1,4,8,16]"), T("[1,2,8,16]"), T("[1,2,8,16]"), "'enable_gqa': true")),
                   "grouped-query attention false vs true");
    /* different shapes and dtypes, one plan: fine */
    af_plan plan = expect_plan(SAMPLES2(POS(Q, KV, KV, "'scale': 0.125"), POS(T("[1,4,3,8]"), T("[1,4,5,8]"), T("[1,4,5,8]"), "'scale': 0.125, 'is_causal': false")));
    assert_true(plan.softmax_scale == 0.125);
    /* an integer scale equals the same float, as in Python */
    expect_plan(SAMPLES2(POS(Q, KV, KV, "'scale': 1"), POS(Q, KV, KV, "'scale': 1.0")));
}

static void checks_run_in_the_seeds_order(void **state) {
    (void)state;
    /* qkv form before mask, mask before dropout, dropout before unknown kwargs, kwargs before shapes */
    expect_refused(SAMPLES("{'args': [" Q "], 'kwargs': {'attn_mask': " Q "}}"), "only supports positional");
    expect_refused(SAMPLES(POS(Q, KV, KV, "'dropout_p': 0.5, 'attn_mask': " Q)), "does not support attn_mask");
    expect_refused(SAMPLES(POS(Q, KV, KV, "'dropout_p': 0.5, 'x': 1")), "only supports dropout_p=0.0");
    expect_refused(SAMPLES(POS(T("[4,17,8]"), KV, KV, "'x': 1")), "does not support kwargs: ['x']");
    expect_refused(SAMPLES(POS("null", T("[4,17,8]"), KV, "")), "requires tensor query, key and value");
    expect_refused(SAMPLES(POS(T("[3,4,17,8]"), T("[2,4,19,8]"), T("[2,4,20,8]"), "")), "matching batch dimensions");
    expect_refused(SAMPLES(POS(T("[2,4,17,8]"), T("[2,4,19,7]"), T("[2,4,20,8]"), "")), "matching key/value sequence lengths");
    /* the seed's checks come before attnforge's kernel checks */
    expect_refused(SAMPLES(POS("{'shape': [2,4,17,8], 'dtype': 'float64'}", T("[3,4,19,8]"), T("[3,4,19,8]"), "")),
                   "matching batch dimensions");
    /* a refused sample anywhere wins over a disagreement earlier (the seed builds every plan first) */
    expect_refused(SAMPLES3(POS(Q, KV, KV, "'is_causal': true"), POS(Q, KV, KV, ""), POS(Q, KV, KV, "'dropout_p': 0.2")),
                   "only supports dropout_p=0.0 (samples[2]");
}

/* ---- attnforge's own checks: what the kernel runs, so a prepared plan never fails at run time */

static void argument_types_are_checked(void **state) {
    (void)state;
    expect_refused(SAMPLES(POS(Q, KV, KV, "'is_causal': 1")), "requires a bool is_causal");
    expect_refused(SAMPLES(POS(Q, KV, KV, "'scale': 'big'")), "requires scale to be None or a finite number");
    expect_refused(SAMPLES(POS(Q, KV, KV, "'enable_gqa': 'yes'")), "requires a bool enable_gqa");
    af_plan plan = expect_plan(SAMPLES(POS(Q, KV, KV, "'scale': null, 'is_causal': false, 'enable_gqa': false")));
    assert_false(plan.has_softmax_scale);
}

#define ON(device) "{'shape': [1,2,8,64], 'dtype': 'float16', 'device': '" device "'}"
#define ALL_ON(device, kwargs) POS(ON(device), ON(device), ON(device), kwargs)

/* cuda samples give cuda plans (no GPU needed, nothing loaded); one device per sample; other devices by name */
static void cuda_samples_give_cuda_plans(void **state) {
    (void)state;
    af_plan plan = expect_plan(SAMPLES(ALL_ON("cuda:0", "'is_causal': true")));
    assert_int_equal(plan.backend, AF_BACKEND_CUDA);
    assert_true(plan.causal);
    assert_false(plan.copy_free_layout);   /* the seed's flag, recorded as for the CPU */
    assert_int_equal(fx_log_count("must copy query, key, and value"), 0);   /* no host copies on CUDA: no warning */
    assert_int_equal(expect_plan(SAMPLES(ALL_ON("cuda", ""))).backend, AF_BACKEND_CUDA);   /* "cuda" = "cuda:0" */
    assert_int_equal(expect_plan(SAMPLES(ALL_ON("cpu", ""))).backend, AF_BACKEND_CPU);
    assert_int_equal(expect_plan(SAMPLES(MHA)).backend, AF_BACKEND_CPU);   /* no device: the CPU */
    /* the plan keeps the backend, not the index: samples from two GPUs (a model split across them) agree */
    assert_int_equal(expect_plan(SAMPLES2(ALL_ON("cuda:0", ""), ALL_ON("cuda:1", ""))).backend, AF_BACKEND_CUDA);
    /* prepare loads no backend for a cuda plan either */
    af_samples *samples = fx_samples(SAMPLES(ALL_ON("cuda:3", "")));
    af_provider *p = af_provider_new();
    assert_true(af_provider_prepare(p, samples));
    assert_false(af_provider_runtime_loaded(p));
    af_provider_free(p);
    af_samples_free(samples);
}

static void devices_are_checked(void **state) {
    (void)state;
    expect_refused(SAMPLES(POS(ON("cuda:0"), ON("cpu"), ON("cuda:0"), "")),
                   "requires query, key and value on one device (samples[0]: query is on 'cuda:0', key on 'cpu', "
                   "value on 'cuda:0')");
    expect_refused(SAMPLES(POS(ON("cuda:0"), ON("cuda:1"), ON("cuda:1"), "")),
                   "requires query, key and value on one device (samples[0]: query is on 'cuda:0', key on 'cuda:1'");
    expect_refused(SAMPLES(POS(ON("cuda:0"), ON("cuda:0"), ON("mps"), "")),
                   "supports devices 'cpu' and 'cuda' only (samples[0]: value is on 'mps')");
    expect_refused(SAMPLES(ALL_ON("xpu:0", "")), "supports devices 'cpu' and 'cuda' only (samples[0]: query is on 'xpu:0')");
    expect_refused(SAMPLES(ALL_ON("cuda:x", "")), "query is on 'cuda:x'");
    expect_refused(SAMPLES(ALL_ON("cuda:", "")), "query is on 'cuda:'");
    expect_refused(SAMPLES(ALL_ON("cudax", "")), "query is on 'cudax'");
    expect_refused(SAMPLES(ALL_ON("cuda:-1", "")), "query is on 'cuda:-1'");
    /* cpu and cuda samples are two backends: not one plan */
    expect_refused(SAMPLES2(ALL_ON("cpu", ""), ALL_ON("cuda:0", "")),
                   "requires consistent representative samples (samples[1] differs from samples[0]: backend cpu vs cuda)");
    expect_refused(SAMPLES2(ALL_ON("cuda:1", ""), MHA), "(samples[1] differs from samples[0]: ");
    /* the kernel checks apply on CUDA too */
    expect_refused(SAMPLES(POS("{'shape': [1,2,8,16], 'dtype': 'float64', 'device': 'cuda:0'}",
                               "{'shape': [1,2,8,16], 'dtype': 'float64', 'device': 'cuda:0'}",
                               "{'shape': [1,2,8,16], 'dtype': 'float64', 'device': 'cuda:0'}", "")),
                   "requires float32, float16 or bfloat16 query, key and value");
    /* the seed's own rules still come first */
    expect_refused(SAMPLES(ALL_ON("mps", "'dropout_p': 0.1")), "only supports dropout_p=0.0");
}

static void dtypes_the_kernel_lacks_are_refused(void **state) {
    (void)state;
    expect_refused(SAMPLES(POS("{'shape': [1,2,8,16], 'dtype': 'float64'}", "{'shape': [1,2,8,16], 'dtype': 'float64'}",
                               "{'shape': [1,2,8,16], 'dtype': 'float64'}", "")),
                   "requires float32, float16 or bfloat16 query, key and value (samples[0]: query is float64)");
    expect_refused(SAMPLES(POS("{'shape': [1,2,8,16], 'dtype': 'bool'}", T("[1,2,8,16]"), T("[1,2,8,16]"), "")),
                   "query is bool");
    expect_refused(SAMPLES(POS("{'shape': [1,2,8,16], 'dtype': 'float16'}", "{'shape': [1,2,8,16], 'dtype': 'bfloat16'}",
                               "{'shape': [1,2,8,16], 'dtype': 'float16'}", "")),
                   "requires query, key and value of one dtype (samples[0]: query float16, key bfloat16, value float16)");
    expect_plan(SAMPLES(POS("{'shape': [1,2,8,16], 'dtype': 'bfloat16'}", "{'shape': [1,2,8,16], 'dtype': 'bfloat16'}",
                            "{'shape': [1,2,8,16], 'dtype': 'bfloat16'}", "")));
}

static void head_dims_strides_and_sizes_are_checked(void **state) {
    (void)state;
    expect_refused(SAMPLES(POS(T("[1,2,8,0]"), T("[1,2,8,0]"), T("[1,2,8,4]"), "")), "requires head dimensions from 1 to 1024");
    expect_refused(SAMPLES(POS(T("[1,2,8,1025]"), T("[1,2,8,1025]"), T("[1,2,8,4]"), "")), "query/key head dimension is 1025");
    expect_refused(SAMPLES(POS(T("[1,2,8,16]"), T("[1,2,8,16]"), T("[1,2,8,2048]"), "")), "value head dimension is 2048");
    af_plan plan = expect_plan(SAMPLES(POS(T("[1,2,8,1024]"), T("[1,2,8,1024]"), T("[1,2,8,1]"), "")));   /* Ev != E is fine */
    assert_false(plan.gqa);
    expect_refused(SAMPLES(POS(T("[1,2,8,16]"), "{'shape': [1,2,8,16], 'dtype': 'float32', 'strides': [256,128,-16,1]}", T("[1,2,8,16]"), "")),
                   "requires non-negative strides (samples[0]: key stride[2] is -16)");
    expect_refused(SAMPLES(POS(T("[4611686018427387904,4,8,16]"), T("[4611686018427387904,4,8,16]"), T("[4611686018427387904,4,8,16]"), "")),
                   "requires tensors that fit in memory");
    expect_refused(SAMPLES(POS(T("[1,2,8,16]"), "{'shape': [1,2,8,16], 'dtype': 'float32', 'strides': [1,4611686018427387904,1,1]}", T("[1,2,8,16]"), "")),
                   "requires tensors that fit in memory");
    /* empty tensors are fine (and contiguous) */
    plan = expect_plan(SAMPLES(POS(T("[0,2,8,16]"), T("[0,2,8,16]"), T("[0,2,8,16]"), "")));
    assert_true(plan.copy_free_layout);
}

/* ---- the copy-free rule: PyTorch's contiguity on the NHD view, size-1 dims exempt, numel 0 contiguous */

static void copy_free_rule(void **state) {
    (void)state;
    const int64_t shape[4] = {2, 4, 17, 8};
    assert_true(af_hnd_is_nhd_contiguous(shape, (int64_t[]){544, 8, 32, 1}));      /* x_nhd.transpose(1, 2) */
    assert_false(af_hnd_is_nhd_contiguous(shape, (int64_t[]){544, 136, 8, 1}));    /* contiguous HND */
    assert_false(af_hnd_is_nhd_contiguous(shape, (int64_t[]){600, 8, 32, 1}));     /* padded batch */
    assert_false(af_hnd_is_nhd_contiguous(shape, (int64_t[]){1088, 16, 64, 2}));   /* inner stride 2 */
    assert_true(af_hnd_is_nhd_contiguous((int64_t[]){1, 4, 17, 8}, (int64_t[]){12345, 8, 32, 1}));   /* B = 1: any sB */
    assert_true(af_hnd_is_nhd_contiguous((int64_t[]){2, 1, 17, 8}, (int64_t[]){136, 7, 8, 1}));      /* H = 1 */
    assert_true(af_hnd_is_nhd_contiguous((int64_t[]){2, 4, 1, 8}, (int64_t[]){32, 8, 999, 1}));      /* L = 1 (decode) */
    assert_true(af_hnd_is_nhd_contiguous((int64_t[]){2, 4, 17, 1}, (int64_t[]){68, 1, 4, 77}));      /* D = 1 */
    assert_true(af_hnd_is_nhd_contiguous((int64_t[]){2, 4, 0, 8}, (int64_t[]){5, 5, 5, 5}));         /* numel 0 */
    assert_false(af_hnd_is_nhd_contiguous((int64_t[]){2, 4, 17, 8}, (int64_t[]){0, 8, 32, 1}));      /* broadcast batch */
    /* the seed's test: a (1, H, 16, 64) HND tensor made contiguous is NOT copy-free, its NHD view is */
    expect_plan(SAMPLES(POS("{'shape': [1,4,16,64], 'dtype': 'float16', 'strides': [4096,64,256,1]}",
                            "{'shape': [1,4,16,64], 'dtype': 'float16', 'strides': [4096,64,256,1]}",
                            "{'shape': [1,4,16,64], 'dtype': 'float16', 'strides': [4096,64,256,1]}", "")));
    af_plan plan = expect_plan(SAMPLES(POS("{'shape': [1,4,16,64], 'dtype': 'float16'}", "{'shape': [1,4,16,64], 'dtype': 'float16'}",
                                           "{'shape': [1,4,16,64], 'dtype': 'float16'}", "")));
    assert_false(plan.copy_free_layout);
    plan = expect_plan(SAMPLES(POS("{'shape': [1,1,16,64], 'dtype': 'float16'}", "{'shape': [1,1,16,64], 'dtype': 'float16'}",
                                   "{'shape': [1,1,16,64], 'dtype': 'float16'}", "")));
    assert_true(plan.copy_free_layout);   /* one head: HND and NHD are the same memory */
}

/* ---- the provider's state */

static void prepare_loads_and_runs_nothing(void **state) {
    (void)state;
    af_samples *samples = fx_samples(SAMPLES(POS(Q, KV, KV, "'is_causal': true")));
    af_provider *p = af_provider_new();
    assert_false(af_provider_runtime_loaded(p));
    assert_true(af_provider_prepare(p, samples));
    assert_false(af_provider_runtime_loaded(p));
    af_provider_stats stats = af_provider_get_stats(p);
    assert_int_equal(stats.plan_calls + stats.general_calls, 0);
    af_provider_free(p);
    af_samples_free(samples);
}

static void a_failed_prepare_leaves_no_plan(void **state) {
    (void)state;
    af_samples *good = fx_samples(SAMPLES(POS(Q, KV, KV, "'is_causal': true"))), *bad = fx_samples(SAMPLES(POS(Q, KV, KV, "'x': 1")));
    af_samples *other = fx_samples(SAMPLES(POS(Q_NHD, KV_NHD, KV_NHD, "")));
    af_provider *p = af_provider_new();
    af_plan plan;
    assert_false(af_provider_is_prepared(p));
    assert_int_equal(af_provider_get_plan(p, &plan), AF_ERR_NOT_PREPARED);
    char *json = NULL;
    assert_int_equal(af_provider_to_json(p, &json), AF_ERR_NOT_PREPARED);
    assert_non_null(strstr(af_last_error(), "must be prepared before serialization"));
    assert_null(json);
    assert_true(af_provider_prepare(p, good));
    assert_false(af_provider_prepare(p, bad));
    assert_false(af_provider_is_prepared(p));
    assert_non_null(strstr(af_last_error(), "does not support kwargs: ['x']"));
    assert_int_equal(af_provider_get_plan(p, &plan), AF_ERR_NOT_PREPARED);
    /* prepare always re-derives (the seed's READY shortcut would keep the old plan) */
    assert_true(af_provider_prepare(p, good));
    assert_true(af_provider_prepare(p, other));
    assert_int_equal(af_provider_get_plan(p, &plan), AF_OK);
    assert_false(plan.causal);
    assert_true(plan.copy_free_layout);
    af_provider_free(p);
    af_samples_free(good);
    af_samples_free(bad);
    af_samples_free(other);
}

static void silent_without_a_callback(void **state) {
    (void)state;
    fx_log_stop();
    assert_false(fx_prepare(SAMPLES(POS(Q, KV, KV, "'x': 1")), NULL, NULL, 0));
    assert_string_equal(fx_log_text(), "");
    fx_log_start();
}

static void name_and_supported_function(void **state) {
    (void)state;
    af_provider *p = af_provider_new();
    char expected[128];
    snprintf(expected, sizeof expected, "attnforge FlashAttention-4 (cpu, %s) %s", af_get_isa(), AF_VERSION_STRING);
    assert_string_equal(af_provider_name(p), expected);
    assert_string_equal(af_provider_supported_function(), "scaled_dot_product_attention");
    af_provider_free(p);
}

/* ---- samples built in C */

static void samples_from_c_calls(void **state) {
    (void)state;
    af_tensor q = af_tensor_contiguous(NULL, AF_F16, 4, (int64_t[]){2, 4, 17, 8});
    af_tensor kv = af_tensor_contiguous(NULL, AF_F16, 4, (int64_t[]){2, 4, 19, 8});
    af_sdpa_args args = {.query = &q, .key = &kv, .value = &kv, .is_causal = true, .has_scale = true, .scale = 0.125};
    af_samples *samples = af_samples_new();
    assert_int_equal(af_samples_add_call(samples, &args, AF_QKV_KEYWORD, NULL, 3), AF_OK);
    assert_int_equal(af_samples_count(samples), 1);
    af_provider *p = af_provider_new();
    assert_true(af_provider_prepare(p, samples));
    af_plan plan;
    af_provider_get_plan(p, &plan);
    assert_int_equal(plan.qkv_source, AF_QKV_KEYWORD);
    assert_true(plan.causal && plan.has_softmax_scale && plan.softmax_scale == 0.125 && !plan.copy_free_layout);
    /* read back as a call */
    af_sample_call call;
    assert_int_equal(af_samples_get_call(samples, 0, &call), AF_OK);
    assert_int_equal(call.source, AF_QKV_KEYWORD);
    assert_int_equal(call.count, 3);
    assert_int_equal(call.query.shape[2], 17);
    assert_int_equal(call.key.strides[1], 19 * 8);
    assert_true(call.is_causal && call.has_scale && call.scale == 0.125 && !call.has_attn_mask);
    assert_string_equal(call.device, "cpu");
    /* the samples-file JSON of it */
    char *json = NULL;
    assert_int_equal(af_samples_to_json(samples, &json), AF_OK);
    assert_non_null(strstr(json, "\"query\""));
    assert_non_null(strstr(json, "\"is_causal\": true"));
    assert_null(strstr(json, "strides"));   /* contiguous: not written */
    af_free(json);
    /* bottom-right causality is not SDPA's: recorded by name, refused by name */
    args.is_causal = false;
    args.causal_bottom_right = true;
    assert_int_equal(af_samples_add_call(samples, &args, AF_QKV_KEYWORD, "cpu", 1), AF_OK);
    assert_false(af_provider_prepare(p, samples));
    assert_non_null(strstr(af_provider_reason(p), "does not support kwargs: ['causal_bottom_right']"));
    /* bad arguments */
    assert_int_equal(af_samples_add_call(samples, &args, AF_QKV_KEYWORD, NULL, 0), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "count"));
    assert_int_equal(af_samples_add_call(samples, NULL, AF_QKV_KEYWORD, NULL, 1), AF_ERR_INVALID_ARGUMENT);
    af_sdpa_args infinite = args;
    infinite.has_scale = true;
    infinite.scale = 1.0 / 0.0;
    assert_int_equal(af_samples_add_call(samples, &infinite, AF_QKV_KEYWORD, NULL, 1), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "args.scale: must be finite"));
    assert_int_equal(af_samples_add_call(samples, &args, (af_qkv_source)7, NULL, 1), AF_ERR_INVALID_ARGUMENT);
    af_sdpa_args no_key = args;
    no_key.key = NULL;
    assert_int_equal(af_samples_add_call(samples, &no_key, AF_QKV_KEYWORD, NULL, 1), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "args.key"));
    assert_int_equal(af_samples_count(samples), 2);
    assert_int_equal(af_samples_get_call(samples, 5, &call), AF_ERR_INVALID_ARGUMENT);
    af_provider_free(p);
    af_samples_free(samples);
}

/* add_call with no device name records each tensor's own af_device; get_call gives it back in the views */
static void samples_record_where_tensors_live(void **state) {
    (void)state;
    af_tensor q = af_tensor_contiguous(NULL, AF_BF16, 4, (int64_t[]){1, 2, 8, 64});
    af_tensor kv = q;
    q.device = (af_device){AF_DEVICE_CUDA, 2};
    kv.device = q.device;
    af_sdpa_args args = {.query = &q, .key = &kv, .value = &kv};
    af_samples *samples = af_samples_new();
    assert_int_equal(af_samples_add_call(samples, &args, AF_QKV_POSITIONAL, NULL, 1), AF_OK);
    char *json = NULL;
    assert_int_equal(af_samples_to_json(samples, &json), AF_OK);
    assert_non_null(strstr(json, "\"device\": \"cuda:2\""));
    af_free(json);
    af_sample_call call;
    assert_int_equal(af_samples_get_call(samples, 0, &call), AF_OK);
    assert_string_equal(call.device, "cuda:2");
    assert_int_equal(call.query.device.type, AF_DEVICE_CUDA);
    assert_int_equal(call.value.device.index, 2);
    af_provider *p = af_provider_new();
    assert_true(af_provider_prepare(p, samples));
    af_plan plan;
    assert_int_equal(af_provider_get_plan(p, &plan), AF_OK);
    assert_int_equal(plan.backend, AF_BACKEND_CUDA);
    /* key on the CPU: recorded as such, refused as two devices */
    af_tensor cpu_key = af_tensor_contiguous(NULL, AF_BF16, 4, (int64_t[]){1, 2, 8, 64});
    args.key = &cpu_key;
    assert_int_equal(af_samples_add_call(samples, &args, AF_QKV_POSITIONAL, NULL, 1), AF_OK);
    assert_false(af_provider_prepare(p, samples));
    assert_non_null(strstr(af_provider_reason(p), "query is on 'cuda:2', key on 'cpu', value on 'cuda:2'"));
    /* an explicit name wins (the Python recorder passes str(tensor.device)); a device attnforge lacks is kept by
     * name and refused by get_call */
    args.key = &kv;
    assert_int_equal(af_samples_add_call(samples, &args, AF_QKV_POSITIONAL, "mps", 1), AF_OK);
    assert_int_equal(af_samples_get_call(samples, 2, &call), AF_ERR_UNSUPPORTED);
    assert_non_null(strstr(af_last_error(), "samples[2].query: device 'mps' is not one attnforge runs on"));
    af_provider_free(p);
    af_samples_free(samples);
}

static void get_call_refuses_what_args_cannot_express(void **state) {
    (void)state;
    af_samples *s = fx_samples(SAMPLES5("{'args': [" Q ", " KV "]}", POS("null", KV, KV, ""), POS(Q, KV, KV, "'x': 1"),
                                       POS("{'shape': [2,4,17,8], 'dtype': 'float64'}", KV, KV, ""),
                                       POS(Q, KV, KV, "'attn_mask': {'shape': [17,19], 'dtype': 'bool'}, 'dropout_p': 0.5")));
    assert_non_null(s);
    af_sample_call call;
    assert_int_equal(af_samples_get_call(s, 0, &call), AF_ERR_UNSUPPORTED);
    assert_int_equal(af_samples_get_call(s, 1, &call), AF_ERR_UNSUPPORTED);
    assert_non_null(strstr(af_last_error(), "samples[1].query: is None"));
    assert_int_equal(af_samples_get_call(s, 2, &call), AF_ERR_UNSUPPORTED);
    assert_non_null(strstr(af_last_error(), "'x'"));
    assert_int_equal(af_samples_get_call(s, 3, &call), AF_ERR_UNSUPPORTED);
    assert_non_null(strstr(af_last_error(), "float64"));
    assert_int_equal(af_samples_get_call(s, 4, &call), AF_OK);   /* a mask and dropout are expressible (af_sdpa decides) */
    assert_true(call.has_attn_mask);
    assert_true(call.dropout_p == 0.5);
    af_sdpa_args args = af_sample_call_args(&call);
    assert_ptr_equal(args.attn_mask, &call.attn_mask);
    af_samples_free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(empty_list_is_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(null_samples_are_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(attn_mask_is_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(mixed_positional_and_keyword_are_inconsistent, setup, teardown),
        cmocka_unit_test_setup_teardown(dropout_is_refused_unless_zero, setup, teardown),
        cmocka_unit_test_setup_teardown(unknown_kwargs_are_refused_by_name, setup, teardown),
        cmocka_unit_test_setup_teardown(q_that_is_not_a_tensor_is_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(shape_mismatches_are_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(grouped_query_rules, setup, teardown),
        cmocka_unit_test_setup_teardown(gqa_gives_pack_gqa_false, setup, teardown),
        cmocka_unit_test_setup_teardown(only_two_positionals_are_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(the_seed_case_in_both_layouts, setup, teardown),
        cmocka_unit_test_setup_teardown(samples_must_agree_on_one_plan, setup, teardown),
        cmocka_unit_test_setup_teardown(checks_run_in_the_seeds_order, setup, teardown),
        cmocka_unit_test_setup_teardown(argument_types_are_checked, setup, teardown),
        cmocka_unit_test_setup_teardown(cuda_samples_give_cuda_plans, setup, teardown),
        cmocka_unit_test_setup_teardown(devices_are_checked, setup, teardown),
        cmocka_unit_test_setup_teardown(dtypes_the_kernel_lacks_are_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(head_dims_strides_and_sizes_are_checked, setup, teardown),
        cmocka_unit_test_setup_teardown(copy_free_rule, setup, teardown),
        cmocka_unit_test_setup_teardown(prepare_loads_and_runs_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(a_failed_prepare_leaves_no_plan, setup, teardown),
        cmocka_unit_test_setup_teardown(silent_without_a_callback, setup, teardown),
        cmocka_unit_test_setup_teardown(name_and_supported_function, setup, teardown),
        cmocka_unit_test_setup_teardown(samples_from_c_calls, setup, teardown),
        cmocka_unit_test_setup_teardown(get_call_refuses_what_args_cannot_express, setup, teardown),
        cmocka_unit_test_setup_teardown(samples_record_where_tensors_live, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
