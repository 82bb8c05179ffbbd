/* Every rule of the call (src/sdpa/check.c) and every status class: the status code, a message naming the
 * argument, and nothing written anywhere (out, lse and the inputs keep their bytes). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attnforge.h"
#include "case_gen.h"
#include "kernel/ukernel.h"
#include "sdpa/problem.h"
#include "test_tensor.h"

/* ------------------------------------------------------------------ one call, valid until a rule breaks it */

enum { B = 2, HQ = 8, HKV = 2, L = 5, S = 7, E = 8, EV = 6 };

typedef struct {
    test_tensor q, k, v, mask, out, lse;                          /* the buffers */
    af_tensor query, key, value, attn_mask, out_view, lse_view;   /* the views passed: rules edit these */
    af_sdpa_args args;
    bool pass_args, pass_out, pass_lse;
} call;

static void call_setup(call *c) {
    memset(c, 0, sizeof *c);
    test_rng rng = {42};
    const int64_t qs[4] = {B, HQ, L, E}, ks[4] = {B, HKV, S, E}, vs[4] = {B, HKV, S, EV}, os[4] = {B, HQ, L, EV};
    const int64_t ms[2] = {16 * L, S};   /* roomy: views moved onto it (lse, out) stay inside it */
    static const int order[4] = {0, 1, 2, 3};
    static const int64_t room[4] = {16, 0, 0, 0};   /* spare batches: out or lse moved onto an input stays inside it */
    assert_true(tt_alloc_ordered(&c->q, AF_F32, 4, qs, order, room, 1, 0));
    assert_true(tt_alloc_ordered(&c->k, AF_F32, 4, ks, order, room, 1, 0));
    assert_true(tt_alloc_ordered(&c->v, AF_F32, 4, vs, order, room, 1, 0));
    assert_true(tt_alloc(&c->mask, AF_F32, 2, ms, LAYOUT_CONTIGUOUS, &rng));   /* room for any mask dtype */
    assert_true(tt_alloc(&c->out, AF_F32, 4, os, LAYOUT_CONTIGUOUS, &rng));
    assert_true(tt_alloc(&c->lse, AF_F32, 3, os, LAYOUT_CONTIGUOUS, &rng));
    tt_fill_uniform(&c->q, &rng, 1.0);
    tt_fill_uniform(&c->k, &rng, 1.0);
    tt_fill_uniform(&c->v, &rng, 1.0);
    tt_fill_bytes(&c->mask, 1);
    tt_fill_bytes(&c->out, TT_SENTINEL_BYTE);
    tt_fill_bytes(&c->lse, TT_SENTINEL_BYTE);
    c->query = c->q.view;
    c->key = c->k.view;
    c->value = c->v.view;
    c->attn_mask = af_tensor_contiguous(c->mask.view.data, AF_BOOL, 2, (int64_t[]){L, S});
    c->out_view = c->out.view;
    c->lse_view = c->lse.view;
    c->args = (af_sdpa_args){.query = &c->query, .key = &c->key, .value = &c->value, .enable_gqa = true};
    c->pass_args = c->pass_out = c->pass_lse = true;
}

static void call_teardown(call *c) {
    test_tensor *all[6] = {&c->q, &c->k, &c->v, &c->mask, &c->out, &c->lse};
    for (int i = 0; i < 6; i++) tt_free(all[i]);
}

typedef af_status (*sdpa_entry)(const af_sdpa_args *, af_tensor *, af_tensor *);

static af_status call_run(call *c, sdpa_entry entry) {
    return entry(c->pass_args ? &c->args : NULL, c->pass_out ? &c->out_view : NULL, c->pass_lse ? &c->lse_view : NULL);
}

/* ------------------------------------------------------------------ the rules */

typedef struct {
    const char *name;
    void (*breaks)(call *c);
    af_status status;
    const char *message;   /* must appear in af_last_error() */
} rule;

static void use_mask(call *c) { c->args.attn_mask = &c->attn_mask; }

static void null_args(call *c) { c->pass_args = false; }
static void null_out(call *c) { c->pass_out = false; }
static void null_query(call *c) { c->args.query = NULL; }
static void null_key(call *c) { c->args.key = NULL; }
static void null_value(call *c) { c->args.value = NULL; }
static void key_ndim_3(call *c) { c->key.ndim = 3; }
static void query_ndim_5(call *c) { c->query.ndim = 5; c->query.shape[4] = 1; c->query.strides[4] = 1; }
static void value_ndim_0(call *c) { c->value.ndim = 0; }
static void query_ndim_9(call *c) { c->query.ndim = 9; }
static void lse_ndim_negative(call *c) { c->lse_view.ndim = -1; }
static void key_unknown_dtype(call *c) { c->key.dtype = (af_dtype)9; }
static void value_negative_size(call *c) { c->value.shape[2] = -1; }
static void key_negative_stride(call *c) { c->key.strides[1] = -3; }
static void out_negative_stride(call *c) { c->out_view.strides[3] = -1; }
static void mask_negative_stride(call *c) { use_mask(c); c->attn_mask.strides[0] = -1; }
static void query_element_count_overflows(call *c) { c->query.shape[0] = c->query.shape[1] = (int64_t)1 << 32; }
static void key_strides_reach_past_2_63(call *c) { c->key.strides[2] = (int64_t)1 << 62; }
static void value_bytes_past_2_63(call *c) { c->value.strides[2] = (int64_t)1 << 59; }
static void mask_data_null(call *c) { use_mask(c); c->attn_mask.data = NULL; }
static void out_data_null(call *c) { c->out_view.data = NULL; }
static void lse_data_null(call *c) { c->lse_view.data = NULL; }
static void query_bool(call *c) { c->query.dtype = AF_BOOL; }
static void key_f16(call *c) { c->key.dtype = AF_F16; }
static void value_bf16(call *c) { c->value.dtype = AF_BF16; }
static void dropout_nonzero(call *c) { c->args.dropout_p = 0.1; }
static void dropout_nan(call *c) { c->args.dropout_p = NAN; }
static void both_causal_alignments(call *c) { c->args.is_causal = c->args.causal_bottom_right = true; }
static void mask_with_causal(call *c) { use_mask(c); c->args.is_causal = true; }
static void mask_with_bottom_right(call *c) { use_mask(c); c->args.causal_bottom_right = true; }
static void key_batch(call *c) { c->key.shape[0] = 3; }
static void value_batch(call *c) { c->value.shape[0] = 3; }   /* 1 would broadcast */
static void value_length(call *c) { c->value.shape[2] = 6; }
static void key_head_dim(call *c) { c->key.shape[3] = 9; }
static void value_heads(call *c) { c->value.shape[1] = 3; }   /* 1 would broadcast */
static void gqa_disabled(call *c) { c->args.enable_gqa = false; }
static void heads_not_multiple(call *c) { c->key.shape[1] = c->value.shape[1] = 3; }
static void kv_heads_zero(call *c) { c->key.shape[1] = c->value.shape[1] = 0; }
static void head_dim_zero(call *c) { c->query.shape[3] = c->key.shape[3] = 0; }
static void head_dim_1025(call *c) { c->query.shape[3] = c->key.shape[3] = 1025; }
static void value_dim_1025(call *c) { c->value.shape[3] = 1025; }
static void scale_nan(call *c) { c->args.has_scale = true; c->args.scale = NAN; }
static void scale_inf(call *c) { c->args.has_scale = true; c->args.scale = INFINITY; }
static void scale_neg_inf(call *c) { c->args.has_scale = true; c->args.scale = -INFINITY; }
static void out_shape(call *c) { c->out_view.shape[3] = EV + 1; }
static void out_ndim(call *c) { c->out_view.ndim = 3; }
static void out_dtype(call *c) { c->out_view.dtype = AF_F16; }
static void out_stride_zero(call *c) { c->out_view.strides[2] = 0; }
static void out_rows_interleave(call *c) { c->out_view.strides[2] = 3; }   /* rows of 6 at a pitch of 3 */
static void out_on_query(call *c) { c->out_view.data = c->query.data; }
static void out_inside_key(call *c) { c->out_view.data = (char *)c->key.data + 4; }
static void out_on_value(call *c) { c->out_view.data = c->value.data; }
static void out_on_mask(call *c) { use_mask(c); c->out_view.data = c->attn_mask.data; }
static void out_on_last_query_element(call *c) { c->out_view.data = (float *)c->query.data + B * HQ * L * E - 1; }
static void query_misaligned(call *c) { c->query.data = (char *)c->query.data + 1; }   /* f32 at an odd byte */
static void out_misaligned(call *c) { c->out_view.data = (char *)c->out_view.data + 2; }
static void lse_misaligned(call *c) { c->lse_view.data = (char *)c->lse_view.data + 3; }
static void additive_mask_misaligned(call *c) {   /* an f32 mask one byte off; a bool mask is never misaligned */
    use_mask(c);
    c->attn_mask.dtype = AF_F32;
    c->attn_mask.data = (char *)c->attn_mask.data + 1;
}
static void f16_key_misaligned(call *c) {   /* every tensor f16, key one byte off its 2-byte elements */
    c->query.dtype = c->key.dtype = c->value.dtype = c->out_view.dtype = AF_F16;
    c->key.data = (char *)c->key.data + 1;
}
static void out_data_wraps_the_address_space(call *c) { c->out_view.data = (void *)(UINTPTR_MAX - 63); }
static void query_data_wraps_the_address_space(call *c) {   /* its last element past the top of the address space */
    c->query.data = (void *)(UINTPTR_MAX - 4 * B * HQ * L * E + 5);
}
static void lse_dtype(call *c) { c->lse_view.dtype = AF_F16; }
static void lse_shape(call *c) { c->lse_view.shape[2] = L - 1; }
static void lse_ndim(call *c) { c->lse_view.ndim = 4; c->lse_view.shape[3] = 1; }
static void lse_stride_zero(call *c) { c->lse_view.strides[1] = 0; }
static void lse_on_out(call *c) { c->lse_view.data = (float *)c->out_view.data + 7; }
static void lse_on_query(call *c) { c->lse_view.data = c->query.data; }
static void lse_on_key(call *c) { c->lse_view.data = c->key.data; }
static void lse_on_value(call *c) { c->lse_view.data = c->value.data; }
static void lse_on_mask(call *c) { use_mask(c); c->lse_view.data = c->attn_mask.data; }
static void mask_wrong_length(call *c) { use_mask(c); c->attn_mask.shape[1] = S - 1; }
static void mask_wrong_batch(call *c) {
    use_mask(c);
    c->attn_mask = af_tensor_contiguous(c->attn_mask.data, AF_BOOL, 4, (int64_t[]){3, 1, 1, S});
}
static void mask_wrong_heads(call *c) {   /* 2 heads do not broadcast to 8 */
    use_mask(c);
    c->attn_mask = af_tensor_contiguous(c->attn_mask.data, AF_BOOL, 3, (int64_t[]){2, 1, S});
}
static void mask_ndim_5(call *c) {
    use_mask(c);
    c->attn_mask = af_tensor_contiguous(c->attn_mask.data, AF_BOOL, 5, (int64_t[]){1, 1, 1, L, S});
}
static void mask_f16_with_f32_query(call *c) { use_mask(c); c->attn_mask.dtype = AF_F16; }

#define INVALID AF_ERR_INVALID_ARGUMENT
#define UNSUPPORTED AF_ERR_UNSUPPORTED
#define RULE(fn, status, message) {#fn, fn, status, message}

static const rule rules[] = {
    RULE(null_args, INVALID, "args: must not be NULL"),
    RULE(null_out, INVALID, "out: must not be NULL"),
    RULE(null_query, INVALID, "query: must not be NULL"),
    RULE(null_key, INVALID, "key: must not be NULL"),
    RULE(null_value, INVALID, "value: must not be NULL"),
    RULE(key_ndim_3, INVALID, "key: expected 4 dimensions, got 3"),
    RULE(query_ndim_5, INVALID, "query: expected 4 dimensions, got 5"),
    RULE(value_ndim_0, INVALID, "value: expected 4 dimensions, got 0"),
    RULE(query_ndim_9, INVALID, "query: ndim 9 is outside 0..8"),
    RULE(lse_ndim_negative, INVALID, "lse: ndim -1 is outside 0..8"),
    RULE(key_unknown_dtype, INVALID, "key: unknown dtype code 9"),
    RULE(value_negative_size, INVALID, "value: shape[2] is -1; sizes must be >= 0"),
    RULE(key_negative_stride, INVALID, "key: stride[1] is -3; negative strides are not supported"),
    RULE(out_negative_stride, INVALID, "out: stride[3] is -1"),
    RULE(mask_negative_stride, INVALID, "attn_mask: stride[0] is -1"),
    RULE(query_element_count_overflows, INVALID, "query: the number of elements overflows 64 bits"),
    RULE(key_strides_reach_past_2_63, INVALID, "key: shape and strides reach beyond 2^63 elements"),
    RULE(value_bytes_past_2_63, INVALID, "value: the view spans more than 2^63 bytes"),
    RULE(mask_data_null, INVALID, "attn_mask: data is NULL but the view has 35 elements"),
    RULE(out_data_null, INVALID, "out: data is NULL"),
    RULE(lse_data_null, INVALID, "lse: data is NULL"),
    RULE(query_bool, UNSUPPORTED, "query: dtype bool is not supported"),
    RULE(key_f16, UNSUPPORTED, "key: dtype float16 does not match query's float32"),
    RULE(value_bf16, UNSUPPORTED, "value: dtype bfloat16 does not match query's float32"),
    RULE(dropout_nonzero, UNSUPPORTED, "dropout_p: must be 0"),
    RULE(dropout_nan, UNSUPPORTED, "dropout_p: must be 0"),
    RULE(both_causal_alignments, INVALID, "is_causal and causal_bottom_right: pick one alignment"),
    RULE(mask_with_causal, INVALID, "attn_mask: must not be set together with a causal flag"),
    RULE(mask_with_bottom_right, INVALID, "attn_mask: must not be set together with a causal flag"),
    RULE(key_batch, INVALID, "key: batch size 3 does not match query's 2"),
    RULE(value_batch, INVALID, "value: batch size 3 does not match 2 (query's 2 broadcast with key's 2)"),
    RULE(value_length, INVALID, "value: sequence length 6 does not match key's 7"),
    RULE(key_head_dim, INVALID, "key: head dimension 9 does not match query's 8"),
    RULE(value_heads, INVALID, "query: 8 heads is not a multiple of value's 3 heads"),
    RULE(gqa_disabled, INVALID, "enable_gqa is false but query has 8 heads and key has 2"),
    RULE(heads_not_multiple, INVALID, "query: 8 heads is not a multiple of key's 3 heads"),
    RULE(kv_heads_zero, INVALID, "query: 8 heads is not a multiple of key's 0 heads"),
    RULE(head_dim_zero, UNSUPPORTED, "query: head dimension must be at least 1, got 0"),
    RULE(head_dim_1025, UNSUPPORTED, "query: head dimension 1025 exceeds the supported maximum 1024"),
    RULE(value_dim_1025, UNSUPPORTED, "value: head dimension 1025 exceeds the supported maximum 1024"),
    RULE(scale_nan, INVALID, "scale: must be finite"),
    RULE(scale_inf, INVALID, "scale: must be finite"),
    RULE(scale_neg_inf, INVALID, "scale: must be finite"),
    RULE(out_shape, INVALID, "out: expected shape (2, 8, 5, 6), got (2, 8, 5, 7)"),
    RULE(out_ndim, INVALID, "out: expected 4 dimensions, got 3"),
    RULE(out_dtype, INVALID, "out: dtype float16 does not match query's float32"),
    RULE(out_stride_zero, INVALID, "out: strides make distinct elements share memory"),
    RULE(out_rows_interleave, INVALID, "out: strides make distinct elements share memory"),
    RULE(out_on_query, INVALID, "out: overlaps query's memory"),
    RULE(out_inside_key, INVALID, "out: overlaps key's memory"),
    RULE(out_on_value, INVALID, "out: overlaps value's memory"),
    RULE(out_on_mask, INVALID, "out: overlaps attn_mask's memory"),
    RULE(out_on_last_query_element, INVALID, "out: overlaps query's memory"),
    RULE(query_misaligned, INVALID, "query: data at 0x"),
    RULE(out_misaligned, INVALID, "is not aligned to its 4-byte float32 elements"),
    RULE(lse_misaligned, INVALID, "lse: data at 0x"),
    RULE(additive_mask_misaligned, INVALID, "attn_mask: data at 0x"),
    RULE(f16_key_misaligned, INVALID, "key: data at 0x"),
    RULE(out_data_wraps_the_address_space, INVALID, "out: data at 0xffffffffffffffc0 plus the view's 1920 bytes wraps"),
    RULE(query_data_wraps_the_address_space, INVALID, "query: data at"),
    RULE(lse_dtype, INVALID, "lse: dtype must be float32, got float16"),
    RULE(lse_shape, INVALID, "lse: expected shape (2, 8, 5), got (2, 8, 4)"),
    RULE(lse_ndim, INVALID, "lse: expected 3 dimensions, got 4"),
    RULE(lse_stride_zero, INVALID, "lse: strides make distinct elements share memory"),
    RULE(lse_on_out, INVALID, "lse: overlaps out's memory"),
    RULE(lse_on_query, INVALID, "lse: overlaps query's memory"),
    RULE(lse_on_key, INVALID, "lse: overlaps key's memory"),
    RULE(lse_on_value, INVALID, "lse: overlaps value's memory"),
    RULE(lse_on_mask, INVALID, "lse: overlaps attn_mask's memory"),
    RULE(mask_wrong_length, INVALID, "attn_mask: shape (5, 6) cannot broadcast to (B, Hq, L, S) = (2, 8, 5, 7)"),
    RULE(mask_wrong_batch, INVALID, "attn_mask: shape (3, 1, 1, 7) cannot broadcast"),
    RULE(mask_wrong_heads, INVALID, "attn_mask: shape (2, 1, 7) cannot broadcast"),
    RULE(mask_ndim_5, INVALID, "attn_mask: expected at most 4 dimensions, got 5"),
    RULE(mask_f16_with_f32_query, UNSUPPORTED, "attn_mask: dtype float16 must be bool or match query's float32"),
};
enum { RULE_COUNT = sizeof rules / sizeof rules[0] };

/* The broken call fails with the rule's status and message through both entry points, and writes nothing. */
static void rule_is_enforced(void **state) {
    const rule *r = *state;
    static const sdpa_entry entries[2] = {af_sdpa, af_sdpa_reference};
    static const char *const entry_names[2] = {"af_sdpa", "af_sdpa_reference"};
    for (int e = 0; e < 2; e++) {
        call c;
        call_setup(&c);
        r->breaks(&c);
        test_tensor *all[6] = {&c.q, &c.k, &c.v, &c.mask, &c.out, &c.lse};
        unsigned char *before[6];
        for (int i = 0; i < 6; i++) before[i] = tt_snapshot(all[i]);
        const af_status st = call_run(&c, entries[e]);
        char message[1024];
        snprintf(message, sizeof message, "%s", af_last_error());
        bool untouched = true;
        for (int i = 0; i < 6; i++) {
            untouched &= tt_same_as(all[i], before[i]);
            free(before[i]);
        }
        call_teardown(&c);
        if (st != r->status)
            fail_msg("%s: %s returned %s, expected %s (message: \"%s\")", r->name, entry_names[e], af_status_name(st),
                     af_status_name(r->status), message);
        if (!strstr(message, r->message))
            fail_msg("%s: %s said \"%s\", expected it to contain \"%s\"", r->name, entry_names[e], message, r->message);
        if (!untouched) fail_msg("%s: %s wrote to a buffer although it failed", r->name, entry_names[e]);
    }
}

/* ------------------------------------------------------------------ the valid call, messages, names */

/* No element of the view still holds the sentinel bytes. */
static bool every_element_written(const test_tensor *t) {
    const size_t elem = af_dtype_size(t->view.dtype);
    int64_t idx[4] = {0};
    do {
        int64_t off = 0;
        for (int d = 0; d < 4; d++) off += idx[d] * t->view.strides[d];
        const unsigned char *x = (const unsigned char *)t->view.data + (size_t)off * elem;
        bool sentinel = true;
        for (size_t b = 0; b < elem; b++) sentinel &= x[b] == TT_SENTINEL_BYTE;
        if (sentinel) return false;
    } while (tt_next_index(4, t->view.shape, idx));
    return true;
}

static void the_unbroken_call_succeeds_and_clears_the_message(void **state) {
    (void)state;
    call c;
    call_setup(&c);
    key_ndim_3(&c);
    assert_int_equal(call_run(&c, af_sdpa), AF_ERR_INVALID_ARGUMENT);
    assert_true(strlen(af_last_error()) > 0);
    c.key = c.k.view;
    assert_int_equal(call_run(&c, af_sdpa), AF_OK);
    assert_string_equal(af_last_error(), "");
    assert_true(every_element_written(&c.out));
    c.args.dropout_p = -0.0;   /* -0 == 0: allowed */
    assert_int_equal(call_run(&c, af_sdpa), AF_OK);
    c.args.has_scale = false;  /* an unused scale may be anything */
    c.args.scale = NAN;
    assert_int_equal(call_run(&c, af_sdpa), AF_OK);
    call_teardown(&c);
}

static void *fail_in_another_thread(void *arg) {
    (void)arg;
    af_sdpa(NULL, NULL, NULL);
    return strstr(af_last_error(), "args: must not be NULL") ? (void *)1 : NULL;
}

static void the_message_is_per_thread(void **state) {
    (void)state;
    call c;
    call_setup(&c);
    key_ndim_3(&c);
    assert_int_equal(call_run(&c, af_sdpa), AF_ERR_INVALID_ARGUMENT);
    pthread_t thread;
    void *seen = NULL;
    assert_int_equal(pthread_create(&thread, NULL, fail_in_another_thread, NULL), 0);
    assert_int_equal(pthread_join(thread, &seen), 0);
    assert_non_null(seen);
    assert_string_equal(af_last_error(), "key: expected 4 dimensions, got 3");
    call_teardown(&c);
}

static void every_status_has_a_distinct_name(void **state) {
    (void)state;
    static const struct { af_status code; const char *name; } names[] = {
        {AF_OK, "AF_OK"},
        {AF_ERR_INVALID_ARGUMENT, "AF_ERR_INVALID_ARGUMENT"},
        {AF_ERR_UNSUPPORTED, "AF_ERR_UNSUPPORTED"},
        {AF_ERR_NO_MEMORY, "AF_ERR_NO_MEMORY"},
        {AF_ERR_RUNTIME_UNAVAILABLE, "AF_ERR_RUNTIME_UNAVAILABLE"},
        {AF_ERR_PARSE, "AF_ERR_PARSE"},
        {AF_ERR_IO, "AF_ERR_IO"},
        {AF_ERR_PLAN_MISMATCH, "AF_ERR_PLAN_MISMATCH"},
        {AF_ERR_NOT_PREPARED, "AF_ERR_NOT_PREPARED"},
        {AF_ERR_INTERNAL, "AF_ERR_INTERNAL"},
    };
    const int n = (int)(sizeof names / sizeof names[0]);
    for (int i = 0; i < n; i++) {
        assert_string_equal(af_status_name(names[i].code), names[i].name);
        assert_true(names[i].code == AF_OK ? names[i].code == 0 : names[i].code < 0);
        for (int j = 0; j < i; j++) assert_int_not_equal(names[i].code, names[j].code);
    }
    assert_string_equal(af_status_name((af_status)-1000), "AF_ERR_UNKNOWN");
    assert_string_equal(af_status_name((af_status)1), "AF_ERR_UNKNOWN");
}

static void dtype_names_and_sizes(void **state) {
    (void)state;
    assert_string_equal(af_dtype_name(AF_F32), "float32");
    assert_string_equal(af_dtype_name(AF_F16), "float16");
    assert_string_equal(af_dtype_name(AF_BF16), "bfloat16");
    assert_string_equal(af_dtype_name(AF_BOOL), "bool");
    assert_string_equal(af_dtype_name((af_dtype)42), "unknown");
    assert_int_equal(af_dtype_size(AF_F32), 4);
    assert_int_equal(af_dtype_size(AF_F16), 2);
    assert_int_equal(af_dtype_size(AF_BF16), 2);
    assert_int_equal(af_dtype_size(AF_BOOL), 1);
    assert_int_equal(af_dtype_size((af_dtype)42), 0);
    assert_int_equal(af_dtype_size((af_dtype)-1), 0);
}

static void set_isa_refuses_unknown_and_unavailable_names(void **state) {
    (void)state;
    assert_int_equal(af_set_isa("portable"), AF_OK);
    assert_int_equal(af_set_isa(NULL), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "isa: must not be NULL"));
    assert_int_equal(af_set_isa("sse9"), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "isa: unknown name 'sse9'"));
    assert_int_equal(af_set_isa(""), AF_ERR_INVALID_ARGUMENT);
    assert_false(af_isa_available(NULL));
    assert_false(af_isa_available("sse9"));
    assert_true(af_isa_available("portable"));
    static const char *const known[] = {"avx2", "avx512"};
    for (int i = 0; i < 2; i++) {
        const af_status st = af_set_isa(known[i]);
        if (af_isa_available(known[i])) {
            assert_int_equal(st, AF_OK);
            assert_string_equal(af_get_isa(), known[i]);
        } else {   /* not compiled in: unknown here; compiled but the CPU lacks it: unsupported */
            assert_true(st == AF_ERR_INVALID_ARGUMENT || st == AF_ERR_UNSUPPORTED);
            assert_non_null(strstr(af_last_error(), known[i]));
        }
        assert_int_equal(af_set_isa("portable"), AF_OK);
    }
    assert_string_equal(af_get_isa(), "portable");
}

/* ------------------------------------------------------------------ absurd sizes that pass the checks */

enum { DECODE_ROWS = 64 };   /* driver.c splits the keys of calls with at most 64 rows per kv head */

/* `queries` rows against a key broadcast along S (stride 0), which spans one element whatever S is: a valid call
 * of absurd length. Out is pre-filled with -7. */
typedef struct { float q[DECODE_ROWS], kv, out[DECODE_ROWS]; af_tensor query, key, out_view; af_sdpa_args args; } long_call;

static void long_call_init(long_call *c, int64_t queries, int64_t keys) {
    for (int i = 0; i < DECODE_ROWS; i++) c->q[i] = 1.0f, c->out[i] = -7.0f;
    c->kv = 1.0f;
    c->query = af_tensor_contiguous(c->q, AF_F32, 4, (int64_t[]){1, 1, queries, 1});
    c->key = (af_tensor){.data = &c->kv, .dtype = AF_F32, .ndim = 4, .shape = {1, 1, keys, 1}, .strides = {0, 0, 0, 1}};
    c->out_view = af_tensor_contiguous(c->out, AF_F32, 4, (int64_t[]){1, 1, queries, 1});
    c->args = (af_sdpa_args){.query = &c->query, .key = &c->key, .value = &c->key};
}

static bool long_call_out_untouched(const long_call *c) {
    for (int i = 0; i < DECODE_ROWS; i++)
        if (c->out[i] != -7.0f) return false;
    return true;
}

static void reference_refuses_scratch_past_size_max(void **state) {
    (void)state;
    long_call c;
    long_call_init(&c, 1, (int64_t)1 << 61);   /* S doubles: 2^64 bytes */
    assert_int_equal(af_sdpa_reference(&c.args, &c.out_view, NULL), AF_ERR_NO_MEMORY);
    assert_non_null(strstr(af_last_error(), "out of memory"));
    assert_true(long_call_out_untouched(&c));
}

/* Split-KV partial results for an S whose byte count wraps past 2^64 to a small number: refused, not allocated.
 * 64 query rows are cut into row blocks of the micro-kernel's height (or less): each candidate height is tried. */
static void split_kv_partials_past_size_max_are_refused(void **state) {
    (void)state;
    const char *isas[CASE_MAX_ISAS];
    const int n = case_isas(isas, CASE_MAX_ISAS);
    alarm(60);   /* were the size to wrap, the call would run ~1e15 work items */
    int tried = 0;
    for (int i = 0; i < n; i++) {
        assert_int_equal(af_set_isa(isas[i]), AF_OK);
        int kernel_rows, keys;
        af_ukernel_current()->blocking(1, 1, &kernel_rows, &keys);
        const uint64_t split_keys = (512 + (uint64_t)keys - 1) / (uint64_t)keys * (uint64_t)keys;
        int heights[16], count = 0;
        for (int r = 1; r <= DECODE_ROWS; r *= 2) heights[count++] = r;
        heights[count++] = kernel_rows < DECODE_ROWS ? kernel_rows : DECODE_ROWS;
        for (int h = 0; h < count; h++) {
            const uint64_t rows = (uint64_t)((DECODE_ROWS + heights[h] - 1) / heights[h] * heights[h]);
            const uint64_t split_bytes = sizeof(float) * rows * (AF_TILE_PAD + 2);   /* Ev = 1: one padded row */
            const uint64_t splits = UINT64_MAX / split_bytes + 1;   /* splits · split_bytes = 2^64 + a little */
            if (splits > (uint64_t)INT64_MAX / split_keys) continue;   /* no such S below 2^63 */
            long_call c;
            long_call_init(&c, DECODE_ROWS, (int64_t)(splits * split_keys));
            const af_status st = af_sdpa(&c.args, &c.out_view, NULL);
            if (st != AF_ERR_NO_MEMORY) fail_msg("%s, %d rows: %s: %s", isas[i], heights[h], af_status_name(st), af_last_error());
            assert_non_null(strstr(af_last_error(), "out of memory"));
            assert_true(long_call_out_untouched(&c));
            tried++;
        }
    }
    alarm(0);
    assert_true(tried > 0);
}

/* af_tensor_contiguous of a shape whose strides pass 2^63 must not overflow, and af_sdpa must refuse it. */
static void contiguous_view_of_an_absurd_shape_is_refused(void **state) {
    (void)state;
    call c;
    call_setup(&c);
    c.query = af_tensor_contiguous(c.q.view.data, AF_F32, 4, (int64_t[]){2, (int64_t)1 << 31, (int64_t)1 << 31, 8});
    unsigned char *before = tt_snapshot(&c.out);
    assert_int_equal(call_run(&c, af_sdpa), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "query: "));
    assert_true(tt_same_as(&c.out, before));
    free(before);
    /* an empty view of the same kind is an empty call: its strides do not matter */
    c.query = af_tensor_contiguous(c.q.view.data, AF_F32, 4, (int64_t[]){0, (int64_t)1 << 40, (int64_t)1 << 40, 8});
    assert_int_equal(call_run(&c, af_sdpa), AF_ERR_INVALID_ARGUMENT);   /* key's batch 2 != 0 */
    assert_non_null(strstr(af_last_error(), "key: batch size 2 does not match query's 0"));
    call_teardown(&c);
}

/* Issue 15 (fuzz): a value with Ev = 0 has no elements, so its strides were never bounded, yet the reference formed
 * j·stride for each of its S rows: signed overflow. Such a call is valid (nothing to write but lse) whatever the empty
 * views' strides, through af_sdpa and the reference alike, and lse is right. */
static void empty_value_and_out_with_absurd_strides_write_only_lse(void **state) {
    (void)state;
    float lse[2][B * HQ * L];
    for (int e = 0; e < 2; e++) {
        call c;
        call_setup(&c);
        c.value.shape[3] = c.out_view.shape[3] = 0;
        c.value.strides[2] = INT64_MAX - 8;   /* the fuzz input's: 2 · stride overflowed at key 2 */
        c.value.strides[1] = c.out_view.strides[0] = INT64_MAX;
        c.value.data = c.out_view.data = NULL;   /* no elements: may be NULL */
        unsigned char *before_q = tt_snapshot(&c.q);
        assert_int_equal(call_run(&c, e ? af_sdpa_reference : af_sdpa), AF_OK);
        assert_true(tt_same_as(&c.q, before_q));
        free(before_q);
        memcpy(lse[e], c.lse_view.data, sizeof lse[e]);
        call_teardown(&c);
    }
    for (int i = 0; i < B * HQ * L; i++) {   /* a finite logsumexp of 7 scores, the same on both paths */
        assert_true(isfinite(lse[1][i]));
        if (fabsf(lse[0][i] - lse[1][i]) > 1e-5f * (1.0f + fabsf(lse[1][i])))
            fail_msg("lse[%d]: af_sdpa %.9g, reference %.9g", i, lse[0][i], lse[1][i]);
    }
}

/* A size-1 dim's stride never meets an index other than 0, but the kernels form it in bytes (a row pitch): it must
 * fit in int64 bytes even though the span does. */
static void size_1_stride_past_2_63_bytes_is_refused(void **state) {
    (void)state;
    long_call c;
    long_call_init(&c, 2, 3);
    c.key.strides[0] = INT64_MAX / 4 + 1;   /* fits in elements, not in bytes */
    assert_int_equal(af_sdpa(&c.args, &c.out_view, NULL), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "key: stride[0] is 2305843009213693952 elements of 4 bytes: past 2^63"));
    assert_true(long_call_out_untouched(&c));
    c.key.strides[0] = INT64_MAX / 4;   /* the largest that fits */
    assert_int_equal(af_sdpa(&c.args, &c.out_view, NULL), AF_OK);
}

/* Bottom-right causal forms i + 1 + S - L: L + S must fit in int64 (S of a broadcast key may be near 2^63). One key
 * fewer is valid and is refused only for its split-KV partials, computed without overflow. */
static void bottom_right_diagonal_past_2_63_is_refused(void **state) {
    (void)state;
    long_call c;
    long_call_init(&c, 2, INT64_MAX - 1);
    c.args.causal_bottom_right = true;
    assert_int_equal(af_sdpa(&c.args, &c.out_view, NULL), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "causal_bottom_right: L = 2 query rows plus S = 9223372036854775806 keys"));
    assert_true(long_call_out_untouched(&c));
    long_call_init(&c, 2, INT64_MAX - 2);
    c.args.causal_bottom_right = true;
    assert_int_equal(af_sdpa(&c.args, &c.out_view, NULL), AF_ERR_NO_MEMORY);
    assert_true(long_call_out_untouched(&c));
}

/* af_reference_f32 checks `out` in the query's dtype and writes it as float32: for f16 inputs twice the bytes. Its
 * float32 span must fit in int64 and must not overlap an input, though the f16 span does and does not. */
static void f32_reference_checks_out_as_the_float32_it_writes(void **state) {
    (void)state;
    uint16_t mem[64] = {0};   /* inputs below out, so that out's huge span does not reach them */
    mem[4] = mem[5] = 0x3C00;   /* value: f16 1.0, so out = 1 where written */
    af_tensor q = af_tensor_contiguous(mem, AF_F16, 4, (int64_t[]){1, 1, 2, 1});
    af_tensor k = af_tensor_contiguous(mem + 2, AF_F16, 4, (int64_t[]){1, 1, 2, 1});
    af_tensor v = af_tensor_contiguous(mem + 4, AF_F16, 4, (int64_t[]){1, 1, 2, 1});
    af_sdpa_args args = {.query = &q, .key = &k, .value = &v};
    af_tensor out = af_tensor_contiguous(mem + 32, AF_F32, 4, (int64_t[]){1, 1, 2, 1});
    out.strides[2] = (int64_t)1 << 61;   /* (2^61 + 1)·2 bytes fit in int64, (2^61 + 1)·4 do not */
    uint16_t before[64];
    memcpy(before, mem, sizeof mem);
    assert_int_equal(af_reference_f32(&args, &out, NULL), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "out: the view spans more than 2^63 bytes"));
    assert_memory_equal(mem, before, sizeof mem);
    /* out's 2 f16 elements end where query starts; its 2 float32 elements cover query's first */
    out = af_tensor_contiguous(mem + 8, AF_F32, 4, (int64_t[]){1, 1, 2, 1});
    q.data = mem + 10;
    assert_int_equal(af_reference_f32(&args, &out, NULL), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "out: as the float32 the reference writes, overlaps query's memory"));
    assert_memory_equal(mem, before, sizeof mem);
    q.data = mem + 12;   /* clear of out's 8 bytes: valid, and written */
    assert_int_equal(af_reference_f32(&args, &out, NULL), AF_OK);
    float written[2];
    memcpy(written, mem + 8, sizeof written);
    assert_true(written[0] == 1.0f && written[1] == 1.0f);
}

int main(void) {
    static const struct CMUnitTest fixed[] = {
        cmocka_unit_test(the_unbroken_call_succeeds_and_clears_the_message),
        cmocka_unit_test(the_message_is_per_thread),
        cmocka_unit_test(every_status_has_a_distinct_name),
        cmocka_unit_test(dtype_names_and_sizes),
        cmocka_unit_test(set_isa_refuses_unknown_and_unavailable_names),
        cmocka_unit_test(reference_refuses_scratch_past_size_max),
        cmocka_unit_test(split_kv_partials_past_size_max_are_refused),
        cmocka_unit_test(contiguous_view_of_an_absurd_shape_is_refused),
        cmocka_unit_test(empty_value_and_out_with_absurd_strides_write_only_lse),
        cmocka_unit_test(size_1_stride_past_2_63_bytes_is_refused),
        cmocka_unit_test(bottom_right_diagonal_past_2_63_is_refused),
        cmocka_unit_test(f32_reference_checks_out_as_the_float32_it_writes),
    };
    enum { FIXED = sizeof fixed / sizeof fixed[0] };
    struct CMUnitTest tests[FIXED + RULE_COUNT];
    memcpy(tests, fixed, sizeof fixed);
    for (int i = 0; i < RULE_COUNT; i++)
        tests[FIXED + i] = (struct CMUnitTest){.name = rules[i].name, .test_func = rule_is_enforced,
                                               .initial_state = (void *)&rules[i]};
    return _cmocka_run_group_tests("sdpa_errors", tests, FIXED + RULE_COUNT, NULL, NULL);
}
