/* Hostile sizes through the provider (test_sdpa_errors.c covers af_sdpa's own checks, test_provider_prepare.c the
 * samples file's): shapes whose products pass 2^63 and negative strides handed to infer on a copy-free and a copy
 * plan, a broadcast view whose NHD copy would pass 2^64 bytes, zero sizes, and absurd descriptors recorded with
 * add_call. Each is refused with a clear error (never undefined behaviour: the ASan+UBSan build runs this) and
 * nothing is written; zero sizes run. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "attnforge.h"
#include "provider/provider.h"
#include "provider_fixtures.h"
#include "test_tensor.h"

static af_provider *plan(bool copy_free) {
    af_provider *p = NULL;
    /* grouped-query, as the calls below are: they match the plan up to the view that makes them hostile */
    assert_int_equal(fx_plan_from(copy_free ? "{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'positional_qkv',"
                                              " 'flash_kwargs': {'causal': false, 'pack_gqa': false}, 'copy_free_layout': true}"
                                            : "{'type': 'FlashAttention4KernelProvider', 'qkv_source': 'positional_qkv',"
                                              " 'flash_kwargs': {'causal': false, 'pack_gqa': false}, 'copy_free_layout': false}",
                                  &p),
                     AF_OK);
    return p;
}

typedef struct {
    float q[64], k[64], v[64], out[64];
    af_tensor tq, tk, tv, tout;
    af_sdpa_args args;
} small_call;

/* q and out (1, 4, 4, 2), k and v (1, 2, 4, 2), f32 over real buffers; tests then make one view hostile */
static void small_call_init(small_call *c) {
    memset(c, 0, sizeof *c);
    const int64_t q_shape[4] = {1, 4, 4, 2}, kv_shape[4] = {1, 2, 4, 2};
    c->tq = af_tensor_contiguous(c->q, AF_F32, 4, q_shape);
    c->tk = af_tensor_contiguous(c->k, AF_F32, 4, kv_shape);
    c->tv = af_tensor_contiguous(c->v, AF_F32, 4, kv_shape);
    c->tout = af_tensor_contiguous(c->out, AF_F32, 4, q_shape);
    for (int i = 0; i < 64; i++) c->q[i] = c->k[i] = c->v[i] = (float)(i % 7) * 0.25f;
    for (int i = 0; i < 64; i++) c->out[i] = 12345.0f;
    c->args = (af_sdpa_args){.query = &c->tq, .key = &c->tk, .value = &c->tv, .enable_gqa = true};
}

static void out_untouched(const small_call *c) {
    for (int i = 0; i < 64; i++)
        if (c->out[i] != 12345.0f) fail_msg("out[%d] was written by a refused call", i);
}

static void expect_refusal(af_provider *p, small_call *c, af_status want, const char *needle) {
    const af_status st = af_provider_infer(p, &c->args, AF_QKV_POSITIONAL, &c->tout, NULL);
    if (st != want) fail_msg("expected %s, got %s: %s", af_status_name(want), af_status_name(st), af_last_error());
    if (!strstr(af_last_error(), needle)) fail_msg("message \"%s\" lacks \"%s\"", af_last_error(), needle);
    out_untouched(c);
    const af_provider_stats s = af_provider_get_stats(p);
    assert_int_equal(s.copied_tensors, 0);        /* refused before anything was copied */
    assert_int_equal(s.scratch_allocations, 0);   /* or allocated */
}

/* The fuzzers' first find: q's NHD strides (1, 2^31 heads, 2^33 rows) walked by the copy-free test overflowed int64
 * while multiplying the sizes (tests/fuzz/regressions/samples_json/layout_stride_product_overflow). */
static void sizes_past_2_63_are_refused_on_both_plans(void **state) {
    (void)state;
    for (int copy_free = 0; copy_free < 2; copy_free++) {
        af_provider *p = plan(copy_free);
        small_call c;
        small_call_init(&c);
        c.tq.shape[1] = (int64_t)1 << 31;   /* HND (1, 2^31, 2^33, 2) as an NHD view: strides (., 2, 2^32, 1) */
        c.tq.shape[2] = (int64_t)1 << 33;
        c.tq.strides[1] = 2;
        c.tq.strides[2] = (int64_t)1 << 32;
        expect_refusal(p, &c, AF_ERR_INVALID_ARGUMENT, "query: the number of elements overflows 64 bits");
        small_call_init(&c);
        c.tk.strides[2] = (int64_t)1 << 62;   /* 4 keys 2^62 elements apart */
        expect_refusal(p, &c, AF_ERR_INVALID_ARGUMENT, "key: shape and strides reach beyond 2^63 elements");
        small_call_init(&c);
        c.tv.strides[0] = INT64_MAX;           /* a size-1 dim: its stride never matters */
        c.tv.strides[3] = (int64_t)1 << 61;    /* (2 - 1)·2^61 elements: past 2^63 bytes */
        expect_refusal(p, &c, AF_ERR_INVALID_ARGUMENT, "value: the view spans more than 2^63 bytes");
        af_provider_free(p);
    }
}

static void negative_strides_are_refused_on_both_plans(void **state) {
    (void)state;
    for (int copy_free = 0; copy_free < 2; copy_free++) {
        af_provider *p = plan(copy_free);
        small_call c;
        small_call_init(&c);
        c.tk.strides[2] = -2;
        c.tk.data = c.k + 6;   /* a view that would stay inside k if negative strides were allowed */
        expect_refusal(p, &c, AF_ERR_INVALID_ARGUMENT, "key: stride[2] is -2; negative strides are not supported");
        small_call_init(&c);
        c.tq.strides[3] = -1;
        expect_refusal(p, &c, AF_ERR_INVALID_ARGUMENT, "query: stride[3] is -1");
        af_provider_free(p);
    }
}

/* K and V expanded (stride 0) to 2^60 keys: a valid view of 4 floats, but its NHD copy would be 2^64 bytes. The
 * copy plan refuses it as out of memory, without trying to allocate. */
static void broadcast_view_whose_copy_passes_2_64_bytes(void **state) {
    (void)state;
    af_provider *p = plan(false);
    small_call c;
    small_call_init(&c);
    c.tk.shape[2] = c.tv.shape[2] = (int64_t)1 << 60;
    c.tk.strides[2] = c.tv.strides[2] = 0;
    c.tk.shape[1] = c.tv.shape[1] = 1;
    expect_refusal(p, &c, AF_ERR_NO_MEMORY, "would exceed the address space");
    af_provider_free(p);
}

/* Zero sizes run on both plans: nothing to compute, or (S = 0) rows that see no key: 0 and lse -inf. */
static void zero_sizes_run_on_both_plans(void **state) {
    (void)state;
    static const int64_t shapes[][2][4] = {
        {{0, 4, 4, 2}, {0, 2, 4, 2}},   /* B = 0 */
        {{1, 4, 0, 2}, {1, 2, 4, 2}},   /* L = 0 */
        {{1, 4, 4, 2}, {1, 2, 0, 2}},   /* S = 0 */
        {{1, 4, 4, 2}, {1, 1, 0, 2}},   /* S = 0, one kv head */
        {{1, 0, 4, 2}, {1, 0, 4, 2}},   /* no heads (not grouped-query: the general path) */
    };
    for (int copy_free = 0; copy_free < 2; copy_free++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            af_provider *p = plan(copy_free);
            float q[64] = {0}, kv[64] = {0}, out[64], lse[32];
            for (int i = 0; i < 64; i++) out[i] = 7.0f;
            const int64_t *qs = shapes[s][0], *ks = shapes[s][1];
            const int64_t os[4] = {qs[0], qs[1], qs[2], ks[3]}, ls[3] = {qs[0], qs[1], qs[2]};
            af_tensor tq = af_tensor_contiguous(q, AF_F32, 4, qs), tk = af_tensor_contiguous(kv, AF_F32, 4, ks);
            af_tensor tout = af_tensor_contiguous(out, AF_F32, 4, os), tlse = af_tensor_contiguous(lse, AF_F32, 3, ls);
            const af_sdpa_args args = {.query = &tq, .key = &tk, .value = &tk, .enable_gqa = qs[1] != ks[1]};
            if (af_provider_infer(p, &args, AF_QKV_POSITIONAL, &tout, &tlse) != AF_OK)
                fail_msg("shape #%zu, %s plan: %s", s, copy_free ? "copy-free" : "copy", af_last_error());
            const int64_t rows = qs[0] * qs[1] * qs[2];
            for (int64_t i = 0; i < rows * os[3]; i++) assert_true(out[i] == 0.0f);   /* S = 0 only has rows */
            for (int64_t i = 0; i < rows; i++) assert_true(lse[i] == -INFINITY);
            for (int64_t i = rows * os[3]; i < 64; i++) assert_true(out[i] == 7.0f);    /* nothing past the view */
            af_provider_free(p);
        }
}

/* Ev = 0: out has no elements, so its data may be NULL (a fuzzer's find: the kernel and the reference computed
 * row addresses from that NULL, undefined behaviour); lse still gets every row. */
static void value_head_dim_zero_with_null_out(void **state) {
    (void)state;
    small_call c;
    small_call_init(&c);
    c.tv.shape[3] = c.tout.shape[3] = 0;
    c.tout.data = NULL;
    float lse[16];
    const int64_t ls[3] = {1, 4, 4};
    af_tensor tlse = af_tensor_contiguous(lse, AF_F32, 3, ls);
    for (int entry = 0; entry < 4; entry++) {
        for (int i = 0; i < 16; i++) lse[i] = NAN;
        af_provider *p = entry >= 2 ? plan(entry == 2) : NULL;
        const af_status st = entry == 0 ? af_sdpa(&c.args, &c.tout, &tlse)
                           : entry == 1 ? af_sdpa_reference(&c.args, &c.tout, &tlse)
                                        : af_provider_infer(p, &c.args, AF_QKV_POSITIONAL, &c.tout, &tlse);
        if (st != AF_OK) fail_msg("entry %d: %s", entry, af_last_error());
        for (int i = 0; i < 16; i++) assert_true(isfinite(lse[i]));
        af_provider_free(p);
    }
}

/* add_call records what it is given; prepare (after a JSON round trip) refuses what no tensor can be. */
static void absurd_recorded_descriptors_are_refused_by_prepare(void **state) {
    (void)state;
    static const struct { int64_t shape0, stride2; const char *reason; } cases[] = {
        {(int64_t)1 << 62, 0, "requires tensors that fit in memory (samples[0]: query has more than 2^63 elements)"},
        {1, -8, "requires non-negative strides (samples[0]: query stride[2] is -8)"},
        {1, (int64_t)1 << 62, "requires tensors that fit in memory (samples[0]: query's shape and strides reach beyond"},
        {1, (int64_t)1 << 59, "requires tensors that fit in memory (samples[0]: query spans more than 2^63 bytes)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const int64_t qs[4] = {cases[i].shape0, 64, 8, 16}, kvs[4] = {1, 2, 8, 16};
        af_tensor q = af_tensor_contiguous(NULL, AF_F32, 4, qs), kv = af_tensor_contiguous(NULL, AF_F32, 4, kvs);
        if (cases[i].stride2) q.strides[2] = cases[i].stride2;
        kv.shape[0] = q.shape[0];
        af_sdpa_args args = {.query = &q, .key = &kv, .value = &kv, .enable_gqa = true};
        af_samples *samples = af_samples_new(), *again = NULL;
        assert_int_equal(af_samples_add_call(samples, &args, AF_QKV_POSITIONAL, NULL, 1), AF_OK);
        char *json = NULL;
        assert_int_equal(af_samples_to_json(samples, &json), AF_OK);
        assert_int_equal(af_samples_from_json(json, strlen(json), &again), AF_OK);
        af_provider *p = af_provider_new();
        assert_false(af_provider_prepare(p, again));
        if (!strstr(af_provider_reason(p), cases[i].reason))
            fail_msg("case %zu: reason \"%s\", expected \"%s\"", i, af_provider_reason(p), cases[i].reason);
        af_provider_free(p);
        af_samples_free(again);
        af_samples_free(samples);
        af_free(json);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(sizes_past_2_63_are_refused_on_both_plans),
        cmocka_unit_test(negative_strides_are_refused_on_both_plans),
        cmocka_unit_test(broadcast_view_whose_copy_passes_2_64_bytes),
        cmocka_unit_test(zero_sizes_run_on_both_plans),
        cmocka_unit_test(value_head_dim_zero_with_null_out),
        cmocka_unit_test(absurd_recorded_descriptors_are_refused_by_prepare),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
