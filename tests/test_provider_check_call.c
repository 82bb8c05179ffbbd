/* af_provider_check_call: the per-call guard on its own (used by the Python binding to send calls the plan
 * does not cover back to PyTorch). Descriptors only: the guard reads shapes and strides, never data. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "attnforge.h"

static const int64_t q_shape[4] = {2, 4, 17, 8}, kv_shape[4] = {2, 4, 19, 8};

static af_tensor nhd_view(const int64_t shape[4]) {   /* x_nhd.transpose(1, 2): the copy-free layout */
    af_tensor t = af_tensor_contiguous(NULL, AF_F32, 4, shape);
    t.strides[0] = shape[1] * shape[2] * shape[3];
    t.strides[1] = shape[3];
    t.strides[2] = shape[1] * shape[3];
    t.strides[3] = 1;
    return t;
}

static af_provider *prepared(const af_sdpa_args *args, af_qkv_source source) {
    af_samples *samples = af_samples_new();
    assert_non_null(samples);
    assert_int_equal(af_samples_add_call(samples, args, source, NULL, 1), AF_OK);
    af_provider *p = af_provider_new();
    assert_non_null(p);
    assert_true(af_provider_prepare(p, samples));
    af_samples_free(samples);
    return p;
}

static void matching_calls_pass_and_others_are_named(void **state) {
    af_tensor q = nhd_view(q_shape), k = nhd_view(kv_shape), v = nhd_view(kv_shape);
    af_sdpa_args args = {.query = &q, .key = &k, .value = &v, .is_causal = true, .has_scale = true, .scale = 0.125};
    af_provider *p = prepared(&args, AF_QKV_POSITIONAL);
    assert_int_equal(af_provider_check_call(p, &args, AF_QKV_POSITIONAL), AF_OK);

    assert_int_equal(af_provider_check_call(p, &args, AF_QKV_KEYWORD), AF_ERR_PLAN_MISMATCH);
    assert_non_null(strstr(af_last_error(), "q/k/v passed as keyword_qkv, the plan has positional_qkv"));

    af_sdpa_args other = args;
    other.is_causal = false;
    assert_int_equal(af_provider_check_call(p, &other, AF_QKV_POSITIONAL), AF_ERR_PLAN_MISMATCH);
    assert_non_null(strstr(af_last_error(), "is_causal is false, the plan's is true"));

    other = args;
    other.scale = 0.5;
    assert_int_equal(af_provider_check_call(p, &other, AF_QKV_POSITIONAL), AF_ERR_PLAN_MISMATCH);
    assert_non_null(strstr(af_last_error(), "scale is 0.5"));

    af_tensor hnd = af_tensor_contiguous(NULL, AF_F32, 4, q_shape);   /* no longer copy-free */
    other = args;
    other.query = &hnd;
    assert_int_equal(af_provider_check_call(p, &other, AF_QKV_POSITIONAL), AF_ERR_PLAN_MISMATCH);
    assert_non_null(strstr(af_last_error(), "query is no longer an HND view of NHD-contiguous memory"));

    af_tensor mask = af_tensor_contiguous(NULL, AF_BOOL, 2, (int64_t[]){17, 19});
    other = args;
    other.is_causal = false;
    other.attn_mask = &mask;
    assert_int_equal(af_provider_check_call(p, &other, AF_QKV_POSITIONAL), AF_ERR_PLAN_MISMATCH);
    assert_non_null(strstr(af_last_error(), "attn_mask"));
    af_provider_free(p);
}

/* The device rule: a plan made from cuda:0 samples covers calls on any one CUDA device, never CPU calls. */
static void cuda_plans_cover_any_one_cuda_device(void **state) {
    af_tensor q = nhd_view(q_shape), k = nhd_view(kv_shape), v = nhd_view(kv_shape);
    q.device = k.device = v.device = (af_device){AF_DEVICE_CUDA, 0};
    af_sdpa_args args = {.query = &q, .key = &k, .value = &v};
    af_provider *p = prepared(&args, AF_QKV_POSITIONAL);
    af_plan plan;
    assert_int_equal(af_provider_get_plan(p, &plan), AF_OK);
    assert_int_equal(plan.backend, AF_BACKEND_CUDA);
    assert_int_equal(af_provider_check_call(p, &args, AF_QKV_POSITIONAL), AF_OK);
    q.device = k.device = v.device = (af_device){AF_DEVICE_CUDA, 7};
    assert_int_equal(af_provider_check_call(p, &args, AF_QKV_POSITIONAL), AF_OK);
    v.device = (af_device){AF_DEVICE_CUDA, 0};
    assert_int_equal(af_provider_check_call(p, &args, AF_QKV_POSITIONAL), AF_ERR_PLAN_MISMATCH);
    assert_non_null(strstr(af_last_error(), "q/k/v are on different devices: query cuda:7, key cuda:7, value cuda:0"));
    q.device = k.device = v.device = (af_device){AF_DEVICE_CPU, 0};
    assert_int_equal(af_provider_check_call(p, &args, AF_QKV_POSITIONAL), AF_ERR_PLAN_MISMATCH);
    assert_non_null(strstr(af_last_error(), "query, key and value are on cpu, the plan runs on cuda"));
    q.device.type = k.device.type = v.device.type = (af_device_type)5;   /* not a device attnforge knows */
    assert_int_equal(af_provider_check_call(p, &args, AF_QKV_POSITIONAL), AF_ERR_PLAN_MISMATCH);
    assert_non_null(strstr(af_last_error(), "query is on device type 5, the plan runs on cuda"));
    af_provider_free(p);
}

static void unprepared_and_null(void **state) {
    af_tensor q = nhd_view(q_shape), k = nhd_view(kv_shape), v = nhd_view(kv_shape);
    af_sdpa_args args = {.query = &q, .key = &k, .value = &v};
    af_provider *p = af_provider_new();
    assert_non_null(p);
    assert_int_equal(af_provider_check_call(p, &args, AF_QKV_POSITIONAL), AF_ERR_NOT_PREPARED);
    assert_non_null(strstr(af_last_error(), "must be prepared before inference"));
    assert_int_equal(af_provider_check_call(NULL, &args, AF_QKV_POSITIONAL), AF_ERR_INVALID_ARGUMENT);
    af_provider_free(p);
    p = prepared(&args, AF_QKV_POSITIONAL);
    assert_int_equal(af_provider_check_call(p, NULL, AF_QKV_POSITIONAL), AF_ERR_INVALID_ARGUMENT);
    af_provider_free(p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(matching_calls_pass_and_others_are_named),
        cmocka_unit_test(cuda_plans_cover_any_one_cuda_device),
        cmocka_unit_test(unprepared_and_null),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
