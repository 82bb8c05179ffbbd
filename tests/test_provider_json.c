/* The plan's JSON (to_json/from_json: attnforge's version 1, the seed's own form, every malformed class) and
 * the samples file (read, written back, every malformed class). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "attnforge.h"
#include "provider_fixtures.h"

static bool plans_equal(const af_plan *a, const af_plan *b) {
    return a->qkv_source == b->qkv_source && a->causal == b->causal && a->has_softmax_scale == b->has_softmax_scale &&
           (!a->has_softmax_scale || a->softmax_scale == b->softmax_scale) && a->gqa == b->gqa &&
           a->copy_free_layout == b->copy_free_layout && a->backend == b->backend;
}

/* ---- the plan */

static void plan_round_trip(void **state) {
    (void)state;
    /* every combination prepare can make, from samples, through JSON and back */
    const char *q_hnd = "{'shape': [1,4,5,8], 'dtype': 'float32'}", *q_nhd = "{'shape': [1,4,5,8], 'dtype': 'float32', 'strides': [160,8,32,1]}";
    const char *kv_gqa = "{'shape': [1,2,5,8], 'dtype': 'float32'}", *kv_gqa_nhd = "{'shape': [1,2,5,8], 'dtype': 'float32', 'strides': [80,8,16,1]}";
    const double scales[3] = {0.0, 0.125, 0.1};   /* 0: no scale; 0.1 has no short binary form */
    int checked = 0;
    for (int keyword = 0; keyword < 2; keyword++)
        for (int causal = 0; causal < 2; causal++)
            for (int s = 0; s < 3; s++)
                for (int gqa = 0; gqa < 2; gqa++)
                    for (int nhd = 0; nhd < 2; nhd++) {
                        const char *q = nhd ? q_nhd : q_hnd;
                        const char *kv = gqa ? (nhd ? kv_gqa_nhd : kv_gqa) : q;
                        char kwargs[256] = "", text[2048];
                        size_t used = (size_t)snprintf(kwargs, sizeof kwargs, "'is_causal': %s", causal ? "true" : "false");
                        if (s) used += (size_t)snprintf(kwargs + used, sizeof kwargs - used, ", 'scale': %.17g", scales[s]);
                        if (gqa) snprintf(kwargs + used, sizeof kwargs - used, ", 'enable_gqa': true");
                        if (keyword)
                            snprintf(text, sizeof text, "{'samples': [{'kwargs': {'query': %s, 'key': %s, 'value': %s, %s}}]}", q, kv, kv, kwargs);
                        else
                            snprintf(text, sizeof text, "{'samples': [{'args': [%s, %s, %s], 'kwargs': {%s}}]}", q, kv, kv, kwargs);
                        af_samples *samples = fx_samples(text);
                        assert_non_null(samples);
                        af_provider *p = af_provider_new(), *restored = NULL;
                        assert_true(af_provider_prepare(p, samples));
                        char *json = NULL, *again = NULL;
                        assert_int_equal(af_provider_to_json(p, &json), AF_OK);
                        assert_int_equal(af_provider_from_json(json, strlen(json), &restored), AF_OK);
                        assert_true(af_provider_is_prepared(restored));
                        af_plan a, b;
                        af_provider_get_plan(p, &a);
                        af_provider_get_plan(restored, &b);
                        assert_true(plans_equal(&a, &b));
                        assert_int_equal(a.qkv_source, keyword ? AF_QKV_KEYWORD : AF_QKV_POSITIONAL);
                        assert_int_equal(a.causal, causal);
                        assert_int_equal(a.has_softmax_scale, s != 0);
                        if (s) assert_true(b.softmax_scale == scales[s]);   /* bit-exact */
                        assert_int_equal(a.gqa, gqa);
                        assert_int_equal(a.copy_free_layout, nhd);
                        assert_int_equal(af_provider_to_json(restored, &again), AF_OK);
                        assert_string_equal(json, again);
                        af_free(json);
                        af_free(again);
                        af_provider_free(p);
                        af_provider_free(restored);
                        af_samples_free(samples);
                        checked++;
                    }
    assert_int_equal(checked, 48);
}

static void plan_json_is_the_seeds_plus_version_and_backend(void **state) {
    (void)state;
    af_provider *p = NULL;
    assert_int_equal(fx_plan_from("{'type':'FlashAttention4KernelProvider','qkv_source':'keyword_qkv','flash_kwargs':{'causal':true},"
                                  "'copy_free_layout':true}", &p), AF_OK);
    char *json = NULL;
    assert_int_equal(af_provider_to_json(p, &json), AF_OK);
    assert_string_equal(json, "{\"type\": \"FlashAttention4KernelProvider\", \"version\": 1, \"qkv_source\": \"keyword_qkv\", "
                              "\"flash_kwargs\": {\"causal\": true}, \"copy_free_layout\": true, \"backend\": \"cpu\"}");
    af_free(json);
    af_provider_free(p);
}

static void the_seeds_form_is_read(void **state) {
    (void)state;
    af_provider *p = NULL;
    af_plan plan;
    /* the seed's unit-test example, verbatim */
    assert_int_equal(fx_plan_from("{'type':'FlashAttention4KernelProvider','qkv_source':'keyword_qkv','flash_kwargs':{'causal':true},"
                                  "'copy_free_layout':true}", &p), AF_OK);
    assert_int_equal(af_provider_get_plan(p, &plan), AF_OK);
    assert_int_equal(plan.qkv_source, AF_QKV_KEYWORD);
    assert_true(plan.causal && !plan.has_softmax_scale && !plan.gqa && plan.copy_free_layout);
    assert_int_equal(plan.backend, AF_BACKEND_CPU);
    af_provider_free(p);
    /* with a scale and GQA, in the seed's key order */
    assert_int_equal(fx_plan_from("{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'positional_qkv', "
                                  "'flash_kwargs': {'causal': false, 'softmax_scale': 0.125, 'pack_gqa': false}, 'copy_free_layout': false}", &p), AF_OK);
    af_provider_get_plan(p, &plan);
    assert_int_equal(plan.qkv_source, AF_QKV_POSITIONAL);
    assert_true(!plan.causal && plan.has_softmax_scale && plan.softmax_scale == 0.125 && plan.gqa && !plan.copy_free_layout);
    af_provider_free(p);
    /* an integer scale, keys in any order */
    assert_int_equal(fx_plan_from("{'copy_free_layout': true, 'flash_kwargs': {'softmax_scale': 1, 'causal': false}, "
                                  "'qkv_source': 'positional_qkv', 'type': 'FlashAttention4KernelProvider', 'version': 1, 'backend': 'cpu'}", &p), AF_OK);
    af_provider_get_plan(p, &plan);
    assert_true(plan.softmax_scale == 1.0);
    af_provider_free(p);
}

/* An fa4 plan (FlashAttention-4 itself, run by the Python provider): read and written like the others, its calls
 * guarded by the same C guard (CUDA devices), never run or loaded by libattnforge; uncovered calls take the general
 * path as under any plan. */
static void fa4_plans_are_read_guarded_and_never_run_here(void **state) {
    (void)state;
    const char *text = "{\"type\": \"FlashAttention4KernelProvider\", \"version\": 1, \"qkv_source\": \"positional_qkv\", "
                       "\"flash_kwargs\": {\"causal\": true}, \"copy_free_layout\": false, \"backend\": \"fa4\"}";
    af_provider *p = NULL;
    assert_int_equal(af_provider_from_json(text, strlen(text), &p), AF_OK);
    af_plan plan;
    assert_int_equal(af_provider_get_plan(p, &plan), AF_OK);
    assert_int_equal(plan.backend, AF_BACKEND_FA4);
    char *json = NULL;
    assert_int_equal(af_provider_to_json(p, &json), AF_OK);
    assert_string_equal(json, text);
    af_free(json);
    assert_non_null(strstr(af_provider_name(p), "attnforge FlashAttention-4 (fa4) "));
    assert_int_equal(af_provider_load_runtime_dependencies(p), AF_ERR_UNSUPPORTED);
    assert_non_null(strstr(af_last_error(), "the plan's backend is fa4"));
    assert_non_null(strstr(af_last_error(), "only the Python provider"));

    float q_data[2 * 3 * 8], k_data[2 * 3 * 8], v_data[2 * 3 * 8], out_data[2 * 3 * 8];
    for (int i = 0; i < 2 * 3 * 8; i++) q_data[i] = k_data[i] = v_data[i] = (float)(i % 7) * 0.25f;
    const int64_t shape[4] = {1, 2, 3, 8};
    af_tensor q = af_tensor_contiguous(q_data, AF_F32, 4, shape), k = af_tensor_contiguous(k_data, AF_F32, 4, shape);
    af_tensor v = af_tensor_contiguous(v_data, AF_F32, 4, shape), out = af_tensor_contiguous(out_data, AF_F32, 4, shape);
    af_sdpa_args call = {.query = &q, .key = &k, .value = &v, .is_causal = true};
    /* CUDA descriptors (never read): covered, yet infer refuses to run FlashAttention-4 and writes nothing */
    q.device = k.device = v.device = out.device = (af_device){AF_DEVICE_CUDA, 3};
    assert_int_equal(af_provider_check_call(p, &call, AF_QKV_POSITIONAL), AF_OK);
    for (int i = 0; i < 2 * 3 * 8; i++) out_data[i] = -7.0f;
    assert_int_equal(af_provider_infer(p, &call, AF_QKV_POSITIONAL, &out, NULL), AF_ERR_UNSUPPORTED);
    assert_non_null(strstr(af_last_error(), "attnforge.FlashAttention4KernelProvider"));
    for (int i = 0; i < 2 * 3 * 8; i++) assert_true(out_data[i] == -7.0f);
    /* the guard's other rules hold for fa4 plans as for any */
    call.is_causal = false;
    assert_int_equal(af_provider_check_call(p, &call, AF_QKV_POSITIONAL), AF_ERR_PLAN_MISMATCH);
    assert_non_null(strstr(af_last_error(), "is_causal is false, the plan's is true"));
    call.is_causal = true;
    assert_int_equal(af_provider_check_call(p, &call, AF_QKV_KEYWORD), AF_ERR_PLAN_MISMATCH);
    /* CPU tensors are not covered: infer runs them on the general path (af_sdpa, the CPU kernels) */
    q.device = k.device = v.device = out.device = (af_device){AF_DEVICE_CPU, 0};
    assert_int_equal(af_provider_check_call(p, &call, AF_QKV_POSITIONAL), AF_ERR_PLAN_MISMATCH);
    assert_non_null(strstr(af_last_error(), "query, key and value are on cpu, the plan runs on fa4"));
    assert_int_equal(af_provider_infer(p, &call, AF_QKV_POSITIONAL, &out, NULL), AF_OK);
    float expected[2 * 3 * 8];
    af_tensor reference = af_tensor_contiguous(expected, AF_F32, 4, shape);
    assert_int_equal(af_sdpa_reference(&call, &reference, NULL), AF_OK);
    for (int i = 0; i < 2 * 3 * 8; i++) assert_float_equal(out_data[i], expected[i], 1e-5);
    af_provider_free(p);
}

static void expect_parse_error(const char *text, const char *needle) {
    af_provider *p = (af_provider *)(uintptr_t)1;   /* must come back NULL */
    af_status st = fx_plan_from(text, &p);
    if (st != AF_ERR_PARSE || !strstr(af_last_error(), needle))
        fail_msg("%s: expected AF_ERR_PARSE mentioning \"%s\", got %s: \"%s\"", text, needle, af_status_name(st), af_last_error());
    assert_null(p);
}

#define GOOD_FLASH "'flash_kwargs': {'causal': true}"
static void malformed_plans_are_refused_naming_the_field(void **state) {
    (void)state;
    expect_parse_error("", "malformed JSON");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider',", "malformed JSON at line 1");
    expect_parse_error("not json", "malformed JSON");
    expect_parse_error("[1, 2]", "expected a JSON object at the top level");
    expect_parse_error("'FlashAttention4KernelProvider'", "malformed JSON");   /* a bare string is not a document */
    expect_parse_error("{'qkv_source': 'keyword_qkv', " GOOD_FLASH ", 'copy_free_layout': true}", "type: missing");
    expect_parse_error("{'type': 4, 'qkv_source': 'keyword_qkv', " GOOD_FLASH ", 'copy_free_layout': true}", "type: must be the string");
    expect_parse_error("{'type': 'SageAttentionKernelProvider', 'qkv_source': 'keyword_qkv', " GOOD_FLASH ", 'copy_free_layout': true}",
                       "type: invalid kernel provider type for FlashAttention4KernelProvider: \"SageAttentionKernelProvider\"");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', " GOOD_FLASH ", 'copy_free_layout': true}", "qkv_source: missing");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'qkv_source': true, " GOOD_FLASH ", 'copy_free_layout': true}",
                       "qkv_source: must be");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'kw', " GOOD_FLASH ", 'copy_free_layout': true}",
                       "qkv_source: \"kw\" is neither");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'keyword_qkv', 'copy_free_layout': true}", "flash_kwargs: missing");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'keyword_qkv', 'flash_kwargs': [], 'copy_free_layout': true}",
                       "flash_kwargs: must be an object");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'keyword_qkv', 'flash_kwargs': {}, 'copy_free_layout': true}",
                       "flash_kwargs.causal: missing");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'keyword_qkv', 'flash_kwargs': {'causal': 1}, 'copy_free_layout': true}",
                       "flash_kwargs.causal: must be true or false");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'keyword_qkv', 'flash_kwargs': {'causal': true, 'softmax_scale': '0.1'}, "
                       "'copy_free_layout': true}", "flash_kwargs.softmax_scale: must be a number");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'keyword_qkv', 'flash_kwargs': {'causal': true, 'softmax_scale': null}, "
                       "'copy_free_layout': true}", "flash_kwargs.softmax_scale: must be a number");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'keyword_qkv', 'flash_kwargs': {'causal': true, 'pack_gqa': true}, "
                       "'copy_free_layout': true}", "flash_kwargs.pack_gqa: must be false");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'keyword_qkv', 'flash_kwargs': {'causal': true, 'window_size': [1, 1]}, "
                       "'copy_free_layout': true}", "flash_kwargs.window_size: unknown field");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'keyword_qkv', " GOOD_FLASH "}", "copy_free_layout: missing");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'keyword_qkv', " GOOD_FLASH ", 'copy_free_layout': 'yes'}",
                       "copy_free_layout: must be true or false");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'version': 2, 'qkv_source': 'keyword_qkv', " GOOD_FLASH ", 'copy_free_layout': true}",
                       "version: format 2 is newer than this attnforge");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'version': '1', 'qkv_source': 'keyword_qkv', " GOOD_FLASH ", 'copy_free_layout': true}",
                       "version: must be an integer");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'version': 0, 'qkv_source': 'keyword_qkv', " GOOD_FLASH ", 'copy_free_layout': true}",
                       "version: 0 is not a format version");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'keyword_qkv', " GOOD_FLASH ", 'copy_free_layout': true, 'backend': 'tpu'}",
                       "backend: \"tpu\" is none of \"cpu\", \"cuda\" and \"fa4\"");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'keyword_qkv', " GOOD_FLASH ", 'copy_free_layout': true, 'backend': 1}",
                       "backend: must be");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'keyword_qkv', " GOOD_FLASH ", 'copy_free_layout': true, 'extra': 1}",
                       "extra: unknown field");
    expect_parse_error("{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'keyword_qkv', 'qkv_source': 'positional_qkv', " GOOD_FLASH
                       ", 'copy_free_layout': true}", "duplicate object key");
    /* a NULL document or destination */
    af_provider *p = NULL;
    assert_int_equal(af_provider_from_json(NULL, 0, &p), AF_ERR_INVALID_ARGUMENT);
    assert_null(p);
    assert_int_equal(af_provider_from_json("{}", 2, NULL), AF_ERR_INVALID_ARGUMENT);
    /* a document cut short by its length */
    const char *full = "{\"type\": \"FlashAttention4KernelProvider\", \"qkv_source\": \"keyword_qkv\", \"flash_kwargs\": {\"causal\": true}, \"copy_free_layout\": true}";
    assert_int_equal(af_provider_from_json(full, strlen(full), &p), AF_OK);
    af_provider_free(p);
    p = NULL;
    assert_int_equal(af_provider_from_json(full, strlen(full) - 1, &p), AF_ERR_PARSE);
    assert_null(p);
}

static void plan_files(void **state) {
    (void)state;
    af_provider *p = (af_provider *)(uintptr_t)1;
    assert_int_equal(af_provider_load("data/provider/no-such-plan.json", &p), AF_ERR_IO);
    assert_null(p);
    assert_non_null(strstr(af_last_error(), "no-such-plan.json: cannot open"));
    assert_int_equal(af_provider_load("data/provider", &p), AF_ERR_IO);   /* a directory */
    assert_int_equal(af_provider_load("data/provider/newer.plan.json", &p), AF_ERR_PARSE);
    assert_non_null(strstr(af_last_error(), "newer.plan.json: plan: version"));
    assert_int_equal(af_provider_load("data/provider/seed_form.plan.json", &p), AF_OK);
    af_plan plan;
    af_provider_get_plan(p, &plan);
    assert_int_equal(plan.qkv_source, AF_QKV_KEYWORD);
    af_provider_free(p);
}

/* ---- the samples file */

static void the_issues_example_reads(void **state) {
    (void)state;
    af_samples *samples = NULL;
    assert_int_equal(af_samples_load("data/provider/issue_example.samples.json", &samples), AF_OK);
    assert_int_equal(af_samples_count(samples), 1);
    af_sample_call call;
    assert_int_equal(af_samples_get_call(samples, 0, &call), AF_OK);
    assert_int_equal(call.source, AF_QKV_POSITIONAL);
    assert_int_equal(call.count, 3);
    assert_int_equal(call.query.dtype, AF_F16);
    assert_int_equal(call.query.ndim, 4);
    const int64_t q_strides[4] = {544, 136, 8, 1}, v_strides[4] = {608, 8, 32, 1};
    assert_memory_equal(call.query.strides, q_strides, sizeof q_strides);   /* default: contiguous */
    assert_memory_equal(call.value.strides, v_strides, sizeof v_strides);
    assert_true(call.is_causal && call.has_scale && call.scale == 0.125);
    assert_null(call.query.data);
    af_samples_free(samples);
}

static void samples_round_trip(void **state) {
    (void)state;
    const char *text =
        "{'samples': ["
        "{'args': [{'shape': [2,4,17,8], 'dtype': 'float16', 'strides': [544,8,32,1], 'device': 'cuda:1'}, null, 3, 2.5, true, 'text', [1, [2]]],"
        " 'kwargs': {'is_causal': true, 'scale': 0.1, 'attn_mask': {'shape': [], 'dtype': 'bool'}, 'weird': {'shape': [1], 'dtype': 'float64'}},"
        " 'count': 7},"
        "{'kwargs': {'query': {'shape': [1], 'dtype': 'int64'}}},"
        "{}]}";
    af_samples *samples = fx_samples(text);
    assert_non_null(samples);
    assert_int_equal(af_samples_count(samples), 3);
    char *json = NULL, *again = NULL;
    assert_int_equal(af_samples_to_json(samples, &json), AF_OK);
    af_samples *back = NULL;
    assert_int_equal(af_samples_from_json(json, strlen(json), &back), AF_OK);
    assert_int_equal(af_samples_to_json(back, &again), AF_OK);
    assert_string_equal(json, again);
    assert_non_null(strstr(json, "\"device\": \"cuda:1\""));
    assert_non_null(strstr(json, "\"count\": 7"));
    assert_non_null(strstr(json, "\"text\""));
    assert_non_null(strstr(json, "2.5"));
    assert_non_null(strstr(json, "0.10000000000000001"));   /* exact */
    af_free(json);
    af_free(again);
    af_samples_free(samples);
    af_samples_free(back);
}

static void expect_samples_error(const char *text, const char *needle) {
    af_samples *samples = (af_samples *)(uintptr_t)1;
    char *json = fx_json(text);
    af_status st = af_samples_from_json(json, strlen(json), &samples);
    free(json);
    if (st != AF_ERR_PARSE || !strstr(af_last_error(), needle))
        fail_msg("%s: expected AF_ERR_PARSE mentioning \"%s\", got %s: \"%s\"", text, needle, af_status_name(st), af_last_error());
    assert_null(samples);
}

#define TQ "{'shape': [1,2,8,16], 'dtype': 'float32'}"
static void malformed_samples_are_refused_naming_the_field(void **state) {
    (void)state;
    expect_samples_error("", "malformed JSON");
    expect_samples_error("{'samples': [", "malformed JSON at line 1");
    expect_samples_error("[]", "expected a JSON object");
    expect_samples_error("{}", "samples: missing");
    expect_samples_error("{'samples': {}}", "samples: must be a list");
    expect_samples_error("{'samples': [], 'version': 1}", "version: unknown field");
    expect_samples_error("{'samples': [3]}", "samples[0]: must be an object");
    expect_samples_error("{'samples': [{'argz': []}]}", "samples[0].argz: unknown field");
    expect_samples_error("{'samples': [{'args': {}}]}", "samples[0].args: must be a list");
    expect_samples_error("{'samples': [{'kwargs': []}]}", "samples[0].kwargs: must be an object");
    expect_samples_error("{'samples': [{}, {'count': 0}]}", "samples[1].count: must be a whole number from 1");
    expect_samples_error("{'samples': [{'count': '3'}]}", "samples[0].count");
    expect_samples_error("{'samples': [{'count': 1.5}]}", "samples[0].count");
    expect_samples_error("{'samples': [{'args': [{'dtype': 'float32'}]}]}", "samples[0].args[0].shape: missing");
    expect_samples_error("{'samples': [{'args': [{'shape': 4, 'dtype': 'float32'}]}]}", "samples[0].args[0].shape: must be a list");
    expect_samples_error("{'samples': [{'args': [{'shape': [1, -2], 'dtype': 'float32'}]}]}", "samples[0].args[0].shape[1]: -2; sizes must be >= 0");
    expect_samples_error("{'samples': [{'args': [{'shape': [1, 2.0], 'dtype': 'float32'}]}]}", "samples[0].args[0].shape[1]: must be a whole number");
    expect_samples_error("{'samples': [{'args': [{'shape': [1,1,1,1,1,1,1,1,1], 'dtype': 'float32'}]}]}", "9 dimensions; attnforge reads at most 8");
    expect_samples_error("{'samples': [{'args': [{'shape': [1]}]}]}", "samples[0].args[0].dtype: missing");
    expect_samples_error("{'samples': [{'args': [{'shape': [1], 'dtype': 32}]}]}", "samples[0].args[0].dtype: must be a dtype name");
    expect_samples_error("{'samples': [{'args': [{'shape': [1], 'dtype': 'torch.float16'}]}]}", "\"torch.float16\" is not a PyTorch dtype name");
    expect_samples_error("{'samples': [{'args': [{'shape': [1, 2], 'dtype': 'float32', 'strides': [1]}]}]}",
                         "samples[0].args[0].strides: 1 strides for a 2-dimensional shape");
    expect_samples_error("{'samples': [{'args': [{'shape': [1], 'dtype': 'float32', 'strides': ['1']}]}]}", "samples[0].args[0].strides[0]: must be a whole number");
    expect_samples_error("{'samples': [{'args': [{'shape': [1], 'dtype': 'float32', 'device': ''}]}]}", "samples[0].args[0].device: must be a device name");
    expect_samples_error("{'samples': [{'args': [{'shape': [1], 'dtype': 'float32', 'device': 0}]}]}", "samples[0].args[0].device");
    expect_samples_error("{'samples': [{'args': [{'shape': [1], 'dtype': 'float32', 'requires_grad': true}]}]}",
                         "samples[0].args[0].requires_grad: unknown field");
    expect_samples_error("{'samples': [{'kwargs': {'query': {'shape': [1]}}}]}", "samples[0].kwargs.query.dtype: missing");
    expect_samples_error("{'samples': [{'kwargs': {'scale': 1, 'scale': 2}}]}", "duplicate object key");
    expect_samples_error("{'samples': [{'args': [{'shape': [99999999999999999999], 'dtype': 'float32'}]}]}", "malformed JSON");
    af_samples *s = NULL;
    assert_int_equal(af_samples_from_json(NULL, 0, &s), AF_ERR_INVALID_ARGUMENT);
    assert_int_equal(af_samples_from_json("{}", 2, NULL), AF_ERR_INVALID_ARGUMENT);
    char *json = NULL;
    assert_int_equal(af_samples_to_json(NULL, &json), AF_ERR_INVALID_ARGUMENT);
}

static void samples_files(void **state) {
    (void)state;
    af_samples *s = (af_samples *)(uintptr_t)1;
    assert_int_equal(af_samples_load("data/provider/no-such.samples.json", &s), AF_ERR_IO);
    assert_null(s);
    assert_int_equal(af_samples_load("data/provider", &s), AF_ERR_IO);
    assert_int_equal(af_samples_load("data/provider/malformed.samples.json", &s), AF_ERR_PARSE);
    assert_non_null(strstr(af_last_error(), "malformed.samples.json: samples file: malformed JSON"));
    assert_int_equal(af_samples_load("data/provider/bad_dtype.samples.json", &s), AF_ERR_PARSE);
    assert_int_equal(af_samples_load("data/provider/empty.samples.json", &s), AF_OK);
    assert_int_equal(af_samples_count(s), 0);
    af_samples_free(s);
    /* a PyTorch dtype attnforge lacks parses (so prepare can call it unsupported, not malformed) */
    char reason[1024];
    assert_false(fx_prepare("{'samples': [{'args': [{'shape': [1,2,8,16], 'dtype': 'float64'}, " TQ ", " TQ "]}]}", NULL, reason, sizeof reason));
    assert_non_null(strstr(reason, "query is float64"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(plan_round_trip),
        cmocka_unit_test(plan_json_is_the_seeds_plus_version_and_backend),
        cmocka_unit_test(the_seeds_form_is_read),
        cmocka_unit_test(malformed_plans_are_refused_naming_the_field),
        cmocka_unit_test(plan_files),
        cmocka_unit_test(fa4_plans_are_read_guarded_and_never_run_here),
        cmocka_unit_test(the_issues_example_reads),
        cmocka_unit_test(samples_round_trip),
        cmocka_unit_test(malformed_samples_are_refused_naming_the_field),
        cmocka_unit_test(samples_files),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
