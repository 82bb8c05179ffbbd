/* infer(call): results against the reference, copy-free plans handing over the caller's views, copy plans
 * using the provider's reusable scratch, the per-call guard (general path, never the plan's wrong arguments),
 * lazy runtime loading, threads and allocation failures. */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "attnforge.h"
#include "cli_common.h"
#include "core/alloc.h"
#include "provider/provider.h"
#include "provider_fixtures.h"
#include "sdpa/cuda_backend.h"
#include "sdpa/problem.h"

/* ---- a kernel spy: what the provider hands its kernel (the seed's tests patch flash_attn_func the same way) */

static struct {
    int calls;
    const void *data[3];
    int64_t strides[3][4];
    bool is_causal, has_scale, enable_gqa;
    double scale;
    bool has_mask;
    void *stream_seen;
} seen;

static af_status spy_kernel(const af_sdpa_args *args, af_tensor *out, af_tensor *lse) {
    seen.calls++;
    const af_tensor *t[3] = {args->query, args->key, args->value};
    for (int i = 0; i < 3; i++) {
        seen.data[i] = t[i] ? t[i]->data : NULL;
        if (t[i]) memcpy(seen.strides[i], t[i]->strides, sizeof seen.strides[i]);
    }
    seen.is_causal = args->is_causal;
    seen.has_scale = args->has_scale;
    seen.scale = args->scale;
    seen.enable_gqa = args->enable_gqa;
    seen.has_mask = args->attn_mask != NULL;
    return af_sdpa(args, out, lse);
}

/* ---- one call's tensors */

typedef struct {
    cli_tensor q, k, v, out, ref;
    af_sdpa_args args;
} call_data;

static void call_make(call_data *c, af_dtype dtype, const int64_t qs[4], const int64_t kvs[4], bool nhd, uint64_t seed) {
    memset(c, 0, sizeof *c);
    const int64_t os[4] = {qs[0], qs[1], qs[2], kvs[3]};
    assert_true(cli_tensor_random(&c->q, dtype, qs, nhd, &seed, 1.0));
    assert_true(cli_tensor_random(&c->k, dtype, kvs, nhd, &seed, 1.0));
    assert_true(cli_tensor_random(&c->v, dtype, kvs, nhd, &seed, 1.0));
    assert_true(cli_tensor_zeros(&c->out, dtype, 4, os));
    assert_true(cli_tensor_zeros(&c->ref, AF_F32, 4, os));
    c->args = (af_sdpa_args){.query = &c->q.view, .key = &c->k.view, .value = &c->v.view, .enable_gqa = qs[1] != kvs[1]};
}

static void call_free(call_data *c) {
    cli_tensor_free(&c->q);
    cli_tensor_free(&c->k);
    cli_tensor_free(&c->v);
    cli_tensor_free(&c->out);
    cli_tensor_free(&c->ref);
}

/* out against the f32 reference of `args` (the call's own arguments): within the stated tolerance */
static double check_against_reference(call_data *c, const af_sdpa_args *args) {
    assert_int_equal(af_reference_f32(args, &c->ref.view, NULL), AF_OK);
    cli_compare cmp = cli_compare_to_reference(args, &c->out.view, &c->ref.view);
    if (cmp.worst_ratio > 1.0) fail_msg("out is off the reference: max_err %g, %g of the tolerance", cmp.max_error, cmp.worst_ratio);
    return cmp.max_error;
}

/* A provider prepared from this one call. */
static af_provider *provider_for(const af_sdpa_args *args, af_qkv_source source) {
    af_samples *samples = af_samples_new();
    assert_int_equal(af_samples_add_call(samples, args, source, NULL, 1), AF_OK);
    af_provider *p = af_provider_new();
    if (!af_provider_prepare(p, samples)) fail_msg("prepare: %s", af_provider_reason(p));
    af_samples_free(samples);
    af_provider_set_kernel(p, spy_kernel);
    return p;
}

static const int64_t Q_SHAPE[4] = {2, 4, 17, 8}, KV_SHAPE[4] = {2, 4, 19, 8};

static int setup(void **state) {
    (void)state;
    memset(&seen, 0, sizeof seen);
    fx_log_start();
    return 0;
}

static int teardown(void **state) {
    (void)state;
    fx_log_stop();
    return 0;
}

/* ---- tests */

static void infer_needs_a_prepared_provider(void **state) {
    (void)state;
    af_provider *p = af_provider_new();
    call_data c;
    call_make(&c, AF_F32, Q_SHAPE, KV_SHAPE, false, 1);
    assert_int_equal(af_provider_infer(p, &c.args, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_ERR_NOT_PREPARED);
    assert_non_null(strstr(af_last_error(), "Kernel provider attnforge FlashAttention-4"));
    assert_non_null(strstr(af_last_error(), "must be prepared before inference"));
    assert_int_equal(af_provider_infer(NULL, &c.args, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_ERR_INVALID_ARGUMENT);
    af_provider_free(p);
    p = provider_for(&c.args, AF_QKV_POSITIONAL);
    assert_int_equal(af_provider_infer(p, NULL, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_ERR_INVALID_ARGUMENT);
    assert_int_equal(af_provider_infer(p, &c.args, AF_QKV_POSITIONAL, NULL, NULL), AF_ERR_INVALID_ARGUMENT);
    assert_int_equal(seen.calls, 0);   /* the copy plan checks the call before it copies or runs anything */
    af_provider_free(p);
    call_free(&c);
}

/* The seed's case, copy-free: the kernel gets the caller's data pointers and strides; no scratch is used. */
static void copy_free_plan_hands_over_the_callers_views(void **state) {
    (void)state;
    const af_dtype dtypes[3] = {AF_F32, AF_F16, AF_BF16};
    for (int d = 0; d < 3; d++)
        for (int keyword = 0; keyword < 2; keyword++) {
            memset(&seen, 0, sizeof seen);
            call_data c;
            call_make(&c, dtypes[d], Q_SHAPE, KV_SHAPE, true, 10 + (uint64_t)d);
            c.args.is_causal = true;
            c.args.has_scale = true;
            c.args.scale = 0.125;
            const af_qkv_source source = keyword ? AF_QKV_KEYWORD : AF_QKV_POSITIONAL;
            af_provider *p = provider_for(&c.args, source);
            af_plan plan;
            af_provider_get_plan(p, &plan);
            assert_true(plan.copy_free_layout);
            assert_int_equal(af_provider_infer(p, &c.args, source, &c.out.view, NULL), AF_OK);
            assert_int_equal(seen.calls, 1);
            assert_ptr_equal(seen.data[0], c.q.view.data);
            assert_ptr_equal(seen.data[1], c.k.view.data);
            assert_ptr_equal(seen.data[2], c.v.view.data);
            const int64_t q_nhd[4] = {17 * 4 * 8, 8, 4 * 8, 1};
            assert_memory_equal(seen.strides[0], q_nhd, sizeof q_nhd);
            assert_true(seen.is_causal && seen.has_scale && seen.scale == 0.125 && !seen.enable_gqa);
            af_provider_stats s = af_provider_get_stats(p);
            assert_int_equal(s.plan_calls, 1);
            assert_int_equal(s.general_calls, 0);
            assert_int_equal(s.copied_tensors, 0);
            assert_int_equal(s.scratch_allocations + s.temporary_allocations, 0);
            assert_int_equal(c.out.view.shape[2], 17);   /* output shape is q's */
            check_against_reference(&c, &c.args);
            af_provider_free(p);
            call_free(&c);
        }
}

/* The seed's case, copy path: q/k/v are copied to NHD in scratch the provider keeps and reuses. */
static void copy_plan_uses_reusable_scratch(void **state) {
    (void)state;
    call_data c;
    call_make(&c, AF_F16, Q_SHAPE, KV_SHAPE, false, 20);
    c.args.is_causal = true;
    c.args.has_scale = true;
    c.args.scale = 0.125;
    af_provider *p = provider_for(&c.args, AF_QKV_POSITIONAL);
    assert_int_equal(fx_log_count("FlashAttention-4 must copy query, key, and value tensors"), 1);
    assert_int_equal(af_provider_infer(p, &c.args, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_OK);
    assert_ptr_not_equal(seen.data[0], c.q.view.data);
    assert_ptr_not_equal(seen.data[1], c.k.view.data);
    const int64_t q_nhd[4] = {17 * 4 * 8, 8, 4 * 8, 1}, kv_nhd[4] = {19 * 4 * 8, 8, 4 * 8, 1};
    assert_memory_equal(seen.strides[0], q_nhd, sizeof q_nhd);   /* HND views of the NHD copies */
    assert_memory_equal(seen.strides[2], kv_nhd, sizeof kv_nhd);
    check_against_reference(&c, &c.args);
    af_provider_stats s = af_provider_get_stats(p);
    assert_int_equal(s.copied_tensors, 3);
    assert_int_equal(s.scratch_allocations, 1);
    const void *first_copy = seen.data[0];
    for (int i = 0; i < 5; i++) assert_int_equal(af_provider_infer(p, &c.args, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_OK);
    s = af_provider_get_stats(p);
    assert_int_equal(s.copied_tensors, 18);
    assert_int_equal(s.scratch_allocations, 1);   /* reused, not allocated per call */
    assert_ptr_equal(seen.data[0], first_copy);
    /* a longer call (same plan) grows the scratch once; a shorter one reuses it */
    call_data big;
    call_make(&big, AF_F16, (int64_t[]){2, 4, 100, 8}, (int64_t[]){2, 4, 120, 8}, false, 21);
    big.args.is_causal = true;
    big.args.has_scale = true;
    big.args.scale = 0.125;
    assert_int_equal(af_provider_infer(p, &big.args, AF_QKV_POSITIONAL, &big.out.view, NULL), AF_OK);
    check_against_reference(&big, &big.args);
    assert_int_equal(af_provider_infer(p, &c.args, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_OK);
    s = af_provider_get_stats(p);
    assert_int_equal(s.scratch_allocations, 2);
    assert_int_equal(s.temporary_allocations, 0);
    assert_int_equal(s.general_calls, 0);
    af_provider_free(p);
    call_free(&c);
    call_free(&big);
}

/* Like PyTorch's .contiguous(), a copy plan copies only the tensors that are not NHD-contiguous already. */
static void copy_plan_copies_only_what_needs_it(void **state) {
    (void)state;
    call_data c;
    call_make(&c, AF_BF16, Q_SHAPE, KV_SHAPE, false, 30);
    cli_tensor_free(&c.q);
    uint64_t seed = 31;
    assert_true(cli_tensor_random(&c.q, AF_BF16, Q_SHAPE, true, &seed, 1.0));
    c.args.query = &c.q.view;
    af_provider *p = provider_for(&c.args, AF_QKV_POSITIONAL);
    assert_int_equal(af_provider_infer(p, &c.args, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_OK);
    assert_ptr_equal(seen.data[0], c.q.view.data);
    assert_ptr_not_equal(seen.data[1], c.k.view.data);
    assert_ptr_not_equal(seen.data[2], c.v.view.data);
    assert_int_equal(af_provider_get_stats(p).copied_tensors, 2);
    check_against_reference(&c, &c.args);
    af_provider_free(p);
    call_free(&c);
}

/* The per-call guard: any call unlike the plan runs on the general path with its own arguments. */
static void mismatching_calls_run_correctly_on_the_general_path(void **state) {
    (void)state;
    call_data c;
    call_make(&c, AF_F32, Q_SHAPE, KV_SHAPE, true, 40);
    af_sdpa_args planned = c.args;
    planned.is_causal = true;
    planned.has_scale = true;
    planned.scale = 0.125;
    af_provider *p = provider_for(&planned, AF_QKV_POSITIONAL);
    long general = 0;

    /* q/k/v passed by keyword to a positional plan */
    assert_int_equal(af_provider_infer(p, &planned, AF_QKV_KEYWORD, &c.out.view, NULL), AF_OK);
    assert_int_equal(af_provider_get_stats(p).general_calls, ++general);
    assert_true(fx_log_count("FlashAttention-4 plan does not match this call (q/k/v passed as keyword_qkv, the plan has "
                             "positional_qkv); running it on the general path") == 1);
    check_against_reference(&c, &planned);

    /* is_causal differs: the call's own causality, not the plan's */
    af_sdpa_args a = planned;
    a.is_causal = false;
    assert_int_equal(af_provider_infer(p, &a, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_OK);
    assert_int_equal(af_provider_get_stats(p).general_calls, ++general);
    assert_false(seen.is_causal);
    check_against_reference(&c, &a);
    assert_int_equal(af_reference_f32(&planned, &c.ref.view, NULL), AF_OK);   /* ... which differs from the plan's */
    assert_true(cli_compare_to_reference(&planned, &c.out.view, &c.ref.view).max_error > 1e-3);
    assert_int_equal(fx_log_count("is_causal is false, the plan's is true"), 1);

    /* another scale, or none */
    a = planned;
    a.scale = 0.25;
    assert_int_equal(af_provider_infer(p, &a, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_OK);
    assert_true(seen.scale == 0.25);
    check_against_reference(&c, &a);
    assert_int_equal(fx_log_count("scale is 0.25, the plan's is 0.125"), 1);
    a.has_scale = false;
    assert_int_equal(af_provider_infer(p, &a, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_OK);
    assert_false(seen.has_scale);
    check_against_reference(&c, &a);
    general += 2;

    /* a mask (then is_causal must be off, as in SDPA) */
    cli_tensor mask;
    uint64_t seed = 41;
    af_tensor mask_desc = af_tensor_contiguous(NULL, AF_BOOL, 2, (int64_t[]){17, 19});
    assert_true(cli_tensor_random_like(&mask, &mask_desc, &seed, 1.0));
    a = planned;
    a.is_causal = false;
    a.attn_mask = &mask.view;
    assert_int_equal(af_provider_infer(p, &a, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_OK);
    assert_true(seen.has_mask);
    check_against_reference(&c, &a);
    assert_int_equal(fx_log_count("the call has an attn_mask"), 1);
    general++;
    cli_tensor_free(&mask);

    /* bottom-right causality */
    a = planned;
    a.is_causal = false;
    a.causal_bottom_right = true;
    assert_int_equal(af_provider_infer(p, &a, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_OK);
    check_against_reference(&c, &a);
    general++;

    /* a layout that is no longer copy-free: run as it is, no copy */
    call_data hnd;
    call_make(&hnd, AF_F32, Q_SHAPE, KV_SHAPE, false, 42);
    a = planned;
    a.query = &hnd.q.view;
    a.key = &hnd.k.view;
    a.value = &hnd.v.view;
    assert_int_equal(af_provider_infer(p, &a, AF_QKV_POSITIONAL, &hnd.out.view, NULL), AF_OK);
    assert_ptr_equal(seen.data[0], hnd.q.view.data);
    check_against_reference(&hnd, &a);
    assert_int_equal(fx_log_count("query is no longer an HND view of NHD-contiguous memory"), 1);
    general++;
    call_free(&hnd);

    /* grouped-query heads on a plan without them */
    call_data gqa;
    call_make(&gqa, AF_F32, Q_SHAPE, (int64_t[]){2, 2, 19, 8}, true, 43);
    a = planned;
    a.query = &gqa.q.view;
    a.key = &gqa.k.view;
    a.value = &gqa.v.view;
    a.enable_gqa = true;
    assert_int_equal(af_provider_infer(p, &a, AF_QKV_POSITIONAL, &gqa.out.view, NULL), AF_OK);
    check_against_reference(&gqa, &a);
    general++;
    a.enable_gqa = false;   /* and without enable_gqa: SDPA's own error */
    assert_int_equal(af_provider_infer(p, &a, AF_QKV_POSITIONAL, &gqa.out.view, NULL), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "enable_gqa"));
    general++;
    call_free(&gqa);

    /* dropout: the general path refuses it, as af_sdpa does */
    a = planned;
    a.dropout_p = 0.1;
    assert_int_equal(af_provider_infer(p, &a, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_ERR_UNSUPPORTED);
    assert_non_null(strstr(af_last_error(), "dropout_p"));
    general++;

    af_provider_stats s = af_provider_get_stats(p);
    assert_int_equal(s.general_calls, general);
    assert_int_equal(s.plan_calls, 0);
    assert_int_equal(s.copied_tensors, 0);
    /* and the matching call takes the plan */
    assert_int_equal(af_provider_infer(p, &planned, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_OK);
    assert_int_equal(af_provider_get_stats(p).plan_calls, 1);
    check_against_reference(&c, &planned);
    af_provider_free(p);
    call_free(&c);
}

static void a_gqa_plan_guards_mha_calls(void **state) {
    (void)state;
    call_data g, m;
    call_make(&g, AF_BF16, (int64_t[]){1, 4, 16, 64}, (int64_t[]){1, 2, 16, 64}, false, 50);
    call_make(&m, AF_BF16, (int64_t[]){1, 4, 16, 64}, (int64_t[]){1, 4, 16, 64}, false, 51);
    af_provider *p = provider_for(&g.args, AF_QKV_KEYWORD);
    assert_int_equal(af_provider_infer(p, &g.args, AF_QKV_KEYWORD, &g.out.view, NULL), AF_OK);
    assert_true(seen.enable_gqa);
    check_against_reference(&g, &g.args);
    assert_int_equal(af_provider_infer(p, &m.args, AF_QKV_KEYWORD, &m.out.view, NULL), AF_OK);
    check_against_reference(&m, &m.args);
    af_provider_stats s = af_provider_get_stats(p);
    assert_int_equal(s.plan_calls, 1);
    assert_int_equal(s.general_calls, 1);
    af_provider_free(p);
    call_free(&g);
    call_free(&m);
}

/* The seed's GPU functional check, here on the CPU: f16 (1,H,16,64), causal, scale 0.125, 4/4, 4/2, 4/1. */
static void seed_functional_check(void **state) {
    (void)state;
    const int64_t kv_heads[3] = {4, 2, 1};
    for (int h = 0; h < 3; h++)
        for (int nhd = 0; nhd < 2; nhd++) {
            call_data c;
            call_make(&c, AF_F16, (int64_t[]){1, 4, 16, 64}, (int64_t[]){1, kv_heads[h], 16, 64}, nhd, 60 + (uint64_t)h);
            c.args.is_causal = true;
            c.args.has_scale = true;
            c.args.scale = 0.125;
            af_provider *p = provider_for(&c.args, AF_QKV_POSITIONAL);
            char *json = NULL;
            af_provider *restored = NULL;
            assert_int_equal(af_provider_to_json(p, &json), AF_OK);
            assert_int_equal(af_provider_from_json(json, strlen(json), &restored), AF_OK);
            assert_int_equal(af_provider_infer(restored, &c.args, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_OK);
            assert_int_equal(af_provider_get_stats(restored).plan_calls, 1);
            assert_true(check_against_reference(&c, &c.args) < 2e-2);
            af_free(json);
            af_provider_free(p);
            af_provider_free(restored);
            call_free(&c);
        }
}

static void bad_calls_fail_cleanly(void **state) {
    (void)state;
    call_data c;
    call_make(&c, AF_F32, Q_SHAPE, KV_SHAPE, false, 70);
    af_provider *p = provider_for(&c.args, AF_QKV_POSITIONAL);   /* a copy plan */
    af_tensor bad = c.q.view;
    bad.strides[2] = -8;
    af_sdpa_args a = c.args;
    a.query = &bad;
    assert_int_equal(af_provider_infer(p, &a, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "negative strides"));
    bad = c.q.view;
    bad.ndim = 3;
    assert_int_equal(af_provider_infer(p, &a, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_ERR_INVALID_ARGUMENT);
    a.query = NULL;
    assert_int_equal(af_provider_infer(p, &a, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_ERR_INVALID_ARGUMENT);
    af_tensor small_out = c.out.view;
    small_out.shape[2] = 3;
    assert_int_equal(af_provider_infer(p, &c.args, AF_QKV_POSITIONAL, &small_out, NULL), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "out: expected shape"));
    assert_int_equal(af_provider_get_stats(p).copied_tensors, 0);   /* checked before anything is copied */
    /* an output that overlaps an input */
    af_tensor aliasing = c.out.view;
    aliasing.data = c.q.view.data;
    assert_int_equal(af_provider_infer(p, &c.args, AF_QKV_POSITIONAL, &aliasing, NULL), AF_ERR_INVALID_ARGUMENT);
    /* empty tensors are fine */
    call_data empty;
    call_make(&empty, AF_F32, (int64_t[]){0, 4, 17, 8}, (int64_t[]){0, 4, 19, 8}, false, 71);
    assert_int_equal(af_provider_infer(p, &empty.args, AF_QKV_POSITIONAL, &empty.out.view, NULL), AF_OK);
    af_provider_free(p);
    call_free(&c);
    call_free(&empty);
}

/* Zero strides (an expanded K/V) through the copy path: copied element by element, the result right. */
static void broadcast_views_are_copied(void **state) {
    (void)state;
    call_data c;
    call_make(&c, AF_F32, Q_SHAPE, KV_SHAPE, false, 75);
    af_provider *p = provider_for(&c.args, AF_QKV_POSITIONAL);
    af_tensor k = c.k.view, v = c.v.view;
    k.strides[0] = 0;   /* every batch reads batch 0 */
    v.strides[1] = 0;   /* every head reads head 0 */
    af_sdpa_args a = c.args;
    a.key = &k;
    a.value = &v;
    assert_int_equal(af_provider_infer(p, &a, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_OK);
    assert_int_equal(af_provider_get_stats(p).plan_calls, 1);
    check_against_reference(&c, &a);
    af_provider_free(p);
    call_free(&c);
}

static void lse_passes_through(void **state) {
    (void)state;
    call_data c;
    call_make(&c, AF_F32, Q_SHAPE, KV_SHAPE, false, 80);
    af_provider *p = provider_for(&c.args, AF_QKV_POSITIONAL);
    cli_tensor lse, lse_ref;
    assert_true(cli_tensor_zeros(&lse, AF_F32, 3, (int64_t[]){2, 4, 17}));
    assert_true(cli_tensor_zeros(&lse_ref, AF_F32, 3, (int64_t[]){2, 4, 17}));
    assert_int_equal(af_provider_infer(p, &c.args, AF_QKV_POSITIONAL, &c.out.view, &lse.view), AF_OK);
    assert_int_equal(af_reference_f32(&c.args, &c.ref.view, &lse_ref.view), AF_OK);
    for (int i = 0; i < 2 * 4 * 17; i++) assert_true(fabsf(((float *)lse.memory)[i] - ((float *)lse_ref.memory)[i]) < 1e-4f);
    cli_tensor_free(&lse);
    cli_tensor_free(&lse_ref);
    af_provider_free(p);
    call_free(&c);
}

#define CUDA_PLAN "{'type': 'FlashAttention4KernelProvider', 'version': 1, 'qkv_source': 'positional_qkv', " \
                  "'flash_kwargs': {'causal': false}, 'copy_free_layout': true, 'backend': 'cuda'}"

/* The loader's own message for this machine (no library here, or no driver): what a cuda plan must report. */
static void loader_message(char *text, size_t size) {
    const af_cuda_backend_ops *ops;
    assert_int_equal(af_cuda_backend_load(&ops), AF_ERR_RUNTIME_UNAVAILABLE);
    snprintf(text, size, "%s", af_last_error());
    assert_true(text[0] != '\0');
}

static void set_device(call_data *c, af_device device) {
    c->q.view.device = c->k.view.device = c->v.view.device = c->out.view.device = device;
}

static void cuda_plans_load_their_backend_lazily(void **state) {
    (void)state;
    unsetenv("ATTNFORGE_CUDA_LIBRARY");
    char expected[2048];
    loader_message(expected, sizeof expected);
    af_provider *p = NULL;
    assert_int_equal(fx_plan_from(CUDA_PLAN, &p), AF_OK);
    char name[128];
    snprintf(name, sizeof name, "attnforge FlashAttention-4 (cuda) %s", AF_VERSION_STRING);
    assert_string_equal(af_provider_name(p), name);
    assert_int_equal(af_provider_load_runtime_dependencies(p), AF_ERR_RUNTIME_UNAVAILABLE);
    assert_string_equal(af_last_error(), expected);
    /* CUDA tensors that match the plan: the plan's backend is needed, and missing; nothing is read or written
     * (the data pointers are host memory here, which a CUDA kernel must never be handed) */
    call_data c;
    call_make(&c, AF_F16, Q_SHAPE, KV_SHAPE, true, 90);
    set_device(&c, (af_device){AF_DEVICE_CUDA, 1});
    assert_int_equal(af_provider_infer(p, &c.args, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_ERR_RUNTIME_UNAVAILABLE);
    assert_string_equal(af_last_error(), expected);
    assert_int_equal(af_provider_check_call(p, &c.args, AF_QKV_POSITIONAL), AF_OK);   /* the guard accepts it */
    assert_false(af_provider_runtime_loaded(p));
    /* a library that is not an attnforge backend */
    setenv("ATTNFORGE_CUDA_LIBRARY", "libm.so.6", 1);
    assert_int_equal(af_provider_load_runtime_dependencies(p), AF_ERR_RUNTIME_UNAVAILABLE);
    assert_non_null(strstr(af_last_error(), "does not export af_cuda_backend()"));
    unsetenv("ATTNFORGE_CUDA_LIBRARY");
    assert_false(af_provider_runtime_loaded(p));
    call_free(&c);
    af_provider_free(p);
}

/* The guard reads af_tensor.device: CPU tensors under a cuda plan (and CUDA tensors under a cpu plan) run on the
 * general path, af_sdpa where the tensors live, without the plan's backend. */
static void calls_on_the_other_device_take_the_general_path(void **state) {
    (void)state;
    unsetenv("ATTNFORGE_CUDA_LIBRARY");
    af_provider *p = NULL;
    assert_int_equal(fx_plan_from(CUDA_PLAN, &p), AF_OK);
    af_provider_set_kernel(p, spy_kernel);
    call_data c;
    call_make(&c, AF_F32, Q_SHAPE, KV_SHAPE, true, 91);
    assert_int_equal(af_provider_check_call(p, &c.args, AF_QKV_POSITIONAL), AF_ERR_PLAN_MISMATCH);
    assert_non_null(strstr(af_last_error(), "query, key and value are on cpu, the plan runs on cuda"));
    assert_int_equal(af_provider_infer(p, &c.args, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_OK);
    check_against_reference(&c, &c.args);
    assert_int_equal(fx_log_count("(query, key and value are on cpu, the plan runs on cuda); running it on the "
                                  "general path"), 1);
    af_provider_stats stats = af_provider_get_stats(p);
    assert_int_equal(stats.general_calls, 1);
    assert_int_equal(stats.plan_calls, 0);
    assert_false(af_provider_runtime_loaded(p));   /* the CPU call never needed the CUDA backend */
    af_provider_free(p);

    /* a cpu plan and CUDA tensors: the general path is af_sdpa on the CUDA backend, unavailable here */
    p = provider_for(&c.args, AF_QKV_POSITIONAL);
    char expected[2048];
    loader_message(expected, sizeof expected);
    set_device(&c, (af_device){AF_DEVICE_CUDA, 0});
    assert_int_equal(af_provider_check_call(p, &c.args, AF_QKV_POSITIONAL), AF_ERR_PLAN_MISMATCH);
    assert_non_null(strstr(af_last_error(), "query, key and value are on cuda:0, the plan runs on cpu"));
    seen.calls = 0;
    assert_int_equal(af_provider_infer(p, &c.args, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_ERR_RUNTIME_UNAVAILABLE);
    assert_string_equal(af_last_error(), expected);
    assert_int_equal(seen.calls, 1);   /* handed on unchanged: the call's own arguments */
    assert_int_equal(af_provider_get_stats(p).general_calls, 1);

    /* q/k/v on two devices: named by the guard, refused by af_sdpa (nothing runs) */
    c.k.view.device = (af_device){AF_DEVICE_CUDA, 1};
    assert_int_equal(af_provider_check_call(p, &c.args, AF_QKV_POSITIONAL), AF_ERR_PLAN_MISMATCH);
    assert_non_null(strstr(af_last_error(), "q/k/v are on different devices: query cuda:0, key cuda:1, value cuda:0"));
    assert_int_equal(af_provider_infer(p, &c.args, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "key"));
    af_provider_free(p);
    call_free(&c);
}

/* A cuda plan hands the kernel the caller's views and stream, also for a copy plan (no host copy of device
 * memory); the spy stands in for the CUDA kernels and sees descriptors only. */
static af_status descriptor_spy(const af_sdpa_args *args, af_tensor *out, af_tensor *lse) {
    (void)out;
    (void)lse;
    seen.calls++;
    for (int i = 0; i < 3; i++) seen.data[i] = (&args->query)[i]->data;
    seen.is_causal = args->is_causal;
    seen.has_scale = args->has_scale;
    seen.scale = args->scale;
    seen.stream_seen = args->stream;
    return AF_OK;
}

static void cuda_plans_pass_views_and_stream_through(void **state) {
    (void)state;
    af_provider *p = NULL;
    assert_int_equal(fx_plan_from("{'type': 'FlashAttention4KernelProvider', 'version': 1, 'qkv_source': 'keyword_qkv', "
                                  "'flash_kwargs': {'causal': true, 'softmax_scale': 0.25}, 'copy_free_layout': false, "
                                  "'backend': 'cuda'}", &p), AF_OK);
    af_provider_set_kernel(p, descriptor_spy);
    call_data c;
    call_make(&c, AF_F16, Q_SHAPE, KV_SHAPE, false, 92);   /* contiguous HND: the CPU copy plan would copy */
    set_device(&c, (af_device){AF_DEVICE_CUDA, 3});
    c.args.is_causal = true;
    c.args.has_scale = true;
    c.args.scale = 0.25;
    c.args.stream = (void *)0x5eed;
    seen.calls = 0;
    assert_int_equal(af_provider_infer(p, &c.args, AF_QKV_KEYWORD, &c.out.view, NULL), AF_OK);
    assert_int_equal(seen.calls, 1);
    assert_ptr_equal(seen.data[0], c.q.view.data);
    assert_ptr_equal(seen.data[2], c.v.view.data);
    assert_ptr_equal(seen.stream_seen, (void *)0x5eed);
    assert_true(seen.is_causal && seen.has_scale && seen.scale == 0.25);
    af_provider_stats stats = af_provider_get_stats(p);
    assert_int_equal(stats.plan_calls, 1);
    assert_int_equal(stats.copied_tensors, 0);
    assert_int_equal(stats.scratch_allocations + stats.temporary_allocations, 0);
    af_provider_free(p);
    call_free(&c);
}

static void load_runtime_dependencies_is_idempotent(void **state) {
    (void)state;
    af_provider *p = NULL;
    assert_int_equal(fx_plan_from("{'type':'FlashAttention4KernelProvider','qkv_source':'keyword_qkv','flash_kwargs':{'causal':true},"
                                  "'copy_free_layout':true}", &p), AF_OK);
    assert_false(af_provider_runtime_loaded(p));   /* from_json loads nothing either */
    assert_int_equal(af_provider_load_runtime_dependencies(p), AF_OK);
    assert_true(af_provider_runtime_loaded(p));
    assert_int_equal(af_provider_load_runtime_dependencies(p), AF_OK);
    assert_true(af_provider_runtime_loaded(p));
    assert_int_equal(af_provider_load_runtime_dependencies(NULL), AF_ERR_INVALID_ARGUMENT);
    af_provider *fresh = af_provider_new();   /* before prepare: the CPU kernels */
    assert_int_equal(af_provider_load_runtime_dependencies(fresh), AF_OK);
    af_provider_free(fresh);
    af_provider_free(p);
}

typedef struct {
    af_provider *provider;
    uint64_t seed;
    int failures;
} worker;

static void *infer_many(void *arg) {
    worker *w = arg;
    cli_tensor q, k, v, out, ref;
    uint64_t seed = w->seed;
    const int64_t os[4] = {2, 4, 17, 8};
    cli_tensor_random(&q, AF_F32, Q_SHAPE, false, &seed, 1.0);
    cli_tensor_random(&k, AF_F32, KV_SHAPE, false, &seed, 1.0);
    cli_tensor_random(&v, AF_F32, KV_SHAPE, false, &seed, 1.0);
    cli_tensor_zeros(&out, AF_F32, 4, os);
    cli_tensor_zeros(&ref, AF_F32, 4, os);
    af_sdpa_args args = {.query = &q.view, .key = &k.view, .value = &v.view, .is_causal = true};
    af_reference_f32(&args, &ref.view, NULL);
    for (int i = 0; i < 25; i++) {
        memset(out.memory, 0, sizeof(float) * 2 * 4 * 17 * 8);
        if (af_provider_infer(w->provider, &args, AF_QKV_POSITIONAL, &out.view, NULL) != AF_OK ||
            cli_compare_to_reference(&args, &out.view, &ref.view).worst_ratio > 1.0)
            w->failures++;
    }
    cli_tensor_free(&q);
    cli_tensor_free(&k);
    cli_tensor_free(&v);
    cli_tensor_free(&out);
    cli_tensor_free(&ref);
    return NULL;
}

/* One provider, four threads, the copy path: every result right, every call counted, nothing leaked. */
static void concurrent_infer_on_one_provider(void **state) {
    (void)state;
    call_data c;
    call_make(&c, AF_F32, Q_SHAPE, KV_SHAPE, false, 100);
    c.args.is_causal = true;
    af_provider *p = provider_for(&c.args, AF_QKV_POSITIONAL);
    af_provider_set_kernel(p, NULL);   /* the spy is not thread-safe; use the backend's kernel */
    pthread_t threads[4];
    worker workers[4];
    for (int i = 0; i < 4; i++) {
        workers[i] = (worker){p, 200 + (uint64_t)i, 0};
        assert_int_equal(pthread_create(&threads[i], NULL, infer_many, &workers[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(threads[i], NULL);
        assert_int_equal(workers[i].failures, 0);
    }
    af_provider_stats s = af_provider_get_stats(p);
    assert_int_equal(s.plan_calls, 100);
    assert_int_equal(s.copied_tensors, 300);
    assert_true(s.scratch_allocations >= 1);
    af_provider_free(p);
    call_free(&c);
}

static void allocation_failures_are_reported(void **state) {
    (void)state;
    call_data c;
    call_make(&c, AF_F32, Q_SHAPE, KV_SHAPE, false, 110);
    af_provider *p = provider_for(&c.args, AF_QKV_POSITIONAL);
    af_test_fail_allocation(1);   /* the scratch */
    assert_int_equal(af_provider_infer(p, &c.args, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_ERR_NO_MEMORY);
    assert_non_null(strstr(af_last_error(), "NHD copy"));
    af_test_fail_allocation(0);
    assert_int_equal(af_provider_infer(p, &c.args, AF_QKV_POSITIONAL, &c.out.view, NULL), AF_OK);
    check_against_reference(&c, &c.args);
    af_provider_free(p);
    /* every allocation of prepare, to_json and from_json, failed in turn: a status, never a crash or a leak */
    const char *text = "{'samples': [{'args': [{'shape': [2,4,17,8], 'dtype': 'float32'}, {'shape': [2,4,19,8], 'dtype': 'float32'},"
                       " {'shape': [2,4,19,8], 'dtype': 'float32'}], 'kwargs': {'is_causal': true, 'x': [1]}}]}";
    char *json_text = fx_json(text);
    for (long n = 1; n < 40; n++) {
        af_test_fail_allocation(n);
        af_samples *samples = NULL;
        if (af_samples_from_json(json_text, strlen(json_text), &samples) == AF_OK) {
            af_provider *q = af_provider_new();
            if (q) {
                af_provider_prepare(q, samples);
                char *plan_json = NULL;
                af_samples_to_json(samples, &plan_json);
                af_free(plan_json);
                af_provider_free(q);
            }
            af_samples_free(samples);
        }
        af_test_fail_allocation(0);
    }
    free(json_text);
    call_free(&c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(infer_needs_a_prepared_provider, setup, teardown),
        cmocka_unit_test_setup_teardown(copy_free_plan_hands_over_the_callers_views, setup, teardown),
        cmocka_unit_test_setup_teardown(copy_plan_uses_reusable_scratch, setup, teardown),
        cmocka_unit_test_setup_teardown(copy_plan_copies_only_what_needs_it, setup, teardown),
        cmocka_unit_test_setup_teardown(mismatching_calls_run_correctly_on_the_general_path, setup, teardown),
        cmocka_unit_test_setup_teardown(a_gqa_plan_guards_mha_calls, setup, teardown),
        cmocka_unit_test_setup_teardown(seed_functional_check, setup, teardown),
        cmocka_unit_test_setup_teardown(bad_calls_fail_cleanly, setup, teardown),
        cmocka_unit_test_setup_teardown(broadcast_views_are_copied, setup, teardown),
        cmocka_unit_test_setup_teardown(lse_passes_through, setup, teardown),
        cmocka_unit_test_setup_teardown(cuda_plans_load_their_backend_lazily, setup, teardown),
        cmocka_unit_test_setup_teardown(calls_on_the_other_device_take_the_general_path, setup, teardown),
        cmocka_unit_test_setup_teardown(cuda_plans_pass_views_and_stream_through, setup, teardown),
        cmocka_unit_test_setup_teardown(load_runtime_dependencies_is_idempotent, setup, teardown),
        cmocka_unit_test_setup_teardown(concurrent_infer_on_one_provider, setup, teardown),
        cmocka_unit_test_setup_teardown(allocation_failures_are_reported, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
