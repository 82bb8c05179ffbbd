/* Every rule of the backward pass's boundary (src/sdpa/backward_check.c), once: a valid af_sdpa_backward call (or a
 * varlen af_flash_attn_backward call with a sink) is broken in one way; the fast path and the reference both refuse it
 * with the status and a message naming the argument, and write nothing to dq, dk, dv or dsink. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "attnforge.h"
#include "backward_case.h"

typedef struct {
    backward_tensors t;
    bool no_in, no_grads;
} call;

typedef void (*breaker)(call *c);

typedef struct {
    const char *name;
    bool flash;           /* break the flash call, else the sdpa one */
    breaker brk;
    af_status status;
    const char *message;  /* a substring of af_last_error() */
} rule;

static const grad_layouts CONTIGUOUS = {LAYOUT_CONTIGUOUS, LAYOUT_CONTIGUOUS, LAYOUT_CONTIGUOUS, LAYOUT_CONTIGUOUS};

static af_tensor *q_of(call *c) { return c->t.flash ? &c->t.f.q.view : &c->t.s.q.view; }
static af_tensor *k_of(call *c) { return c->t.flash ? &c->t.f.k.view : &c->t.s.k.view; }
static af_tensor *v_of(call *c) { return c->t.flash ? &c->t.f.v.view : &c->t.s.v.view; }

static void no_in(call *c) { c->no_in = true; }
static void no_grads(call *c) { c->no_grads = true; }
static void no_out(call *c) { c->t.in.out = NULL; }
static void no_dout(call *c) { c->t.in.dout = NULL; }
static void no_lse(call *c) { c->t.in.lse = NULL; }
/* Every tensor of the (float32) sdpa call on cuda:0: the CUDA backward takes float16 and bfloat16 only. */
static void all_on_cuda(call *c) {
    af_tensor *all[] = {q_of(c), k_of(c), v_of(c), &c->t.s.out.view, &c->t.s.lse.view, &c->t.dout.view,
                        &c->t.dq.view, &c->t.dk.view, &c->t.dv.view};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) all[i]->device = (af_device){AF_DEVICE_CUDA, 0};
    if (c->t.s.args.attn_mask) c->t.s.mask.view.device = (af_device){AF_DEVICE_CUDA, 0};
}
static void dropout(call *c) { c->t.s.args.dropout_p = 0.1; }
static void softcap_negative(call *c) { c->t.f.args.softcap = -1.0; }
static void lse_wrong_shape(call *c) { c->t.s.lse.view.shape[2] -= 1; }
static void query_batch_broadcast(call *c) { q_of(c)->shape[0] = 1; }
static void key_heads_broadcast(call *c) { k_of(c)->shape[1] = 1; }
static void value_batch_broadcast(call *c) { v_of(c)->shape[0] = 1; }
static void key_float8(call *c) { k_of(c)->dtype = v_of(c)->dtype = AF_F8E4M3; }
static void dout_shape(call *c) { c->t.dout.view.shape[c->t.dout.view.ndim - 1] += 1; }
static void dout_rows(call *c) { c->t.dout.view.shape[0] -= 1; }
static void dout_dtype(call *c) { c->t.dout.view.dtype = AF_BF16; }
static void dout_misaligned(call *c) { c->t.dout.view.data = (char *)c->t.dout.view.data + 1; }
static void dout_negative_stride(call *c) { c->t.dout.view.strides[0] = -1; }
static void dout_on_cuda(call *c) { c->t.dout.view.device = (af_device){AF_DEVICE_CUDA, 0}; }
static void dq_shape(call *c) { c->t.dq.view.shape[1] += 1; }
static void dq_ndim(call *c) { c->t.dq.view.ndim -= 1; }
static void dq_dtype(call *c) { c->t.dq.view.dtype = AF_F16; }
static void dk_dtype(call *c) { c->t.dk.view.dtype = AF_BF16; }
static void dv_shape(call *c) { c->t.dv.view.shape[c->t.dv.view.ndim - 1] -= 1; }
static void dq_misaligned(call *c) { c->t.dq.view.data = (char *)c->t.dq.view.data + 2; }
static void dk_on_cuda(call *c) { c->t.dk.view.device = (af_device){AF_DEVICE_CUDA, 0}; }
static void dv_self_overlap(call *c) { c->t.dv.view.strides[c->t.dv.view.ndim - 2] = 0; }
/* Overlaps are made inside one tensor's own buffer, so no neighbour on the heap is named instead. */
static void dk_over_dq(call *c) { c->t.dq.view.data = c->t.dk.view.data; }   /* dq fits in dk's buffer */
static void dv_over_dk(call *c) { c->t.dv.view.data = c->t.dk.view.data; }   /* the same size: E = Ev */
static void dq_over_query(call *c) { c->t.dq.view.data = q_of(c)->data; }
static void dk_over_value(call *c) { c->t.dk.view.data = v_of(c)->data; }
static void dv_over_dout(call *c) { c->t.dout.view.data = c->t.dv.view.data; }
static void dq_over_out(call *c) { c->t.f.out.view.data = c->t.dq.view.data; }
static void dq_over_lse(call *c) { c->t.s.lse.view.data = c->t.dq.view.data; }
static void dq_over_mask(call *c) { c->t.s.mask.view.data = c->t.dq.view.data; }
static void dsink_on_sdpa(call *c) { c->t.grads.dsink = &c->t.dq.view; }
static void dsink_without_sink(call *c) { c->t.f.args.learnable_sink = NULL; }
static void dsink_shape(call *c) { c->t.dsink.view.shape[0] += 1; }
static void dsink_dtype(call *c) { c->t.dsink.view.dtype = AF_F16; }
static void dsink_over_sink(call *c) { c->t.dsink.view.data = c->t.f.sink.view.data; }
static void dsink_over_cu_seqlens_k(call *c) { c->t.dsink.view.data = c->t.f.cu_k.view.data; }   /* 16 bytes over 12 */
static void dq_varlen_rows(call *c) { c->t.dq.view.shape[0] -= 1; }

static const rule rules[] = {
    {"in NULL", false, no_in, AF_ERR_INVALID_ARGUMENT, "in: must not be NULL"},
    {"grads NULL", true, no_grads, AF_ERR_INVALID_ARGUMENT, "grads: must not be NULL"},
    {"out missing", false, no_out, AF_ERR_INVALID_ARGUMENT, "out: must not be NULL"},
    {"dout missing", true, no_dout, AF_ERR_INVALID_ARGUMENT, "dout: must not be NULL"},
    {"lse missing (sdpa)", false, no_lse, AF_ERR_INVALID_ARGUMENT, "lse: must not be NULL"},
    {"lse missing (flash)", true, no_lse, AF_ERR_INVALID_ARGUMENT, "lse: must not be NULL"},
    {"float32 CUDA tensors", false, all_on_cuda, AF_ERR_UNSUPPORTED, "query: dtype float32 on cuda:0 has no backward pass"},
    {"a forward rule (sdpa)", false, dropout, AF_ERR_UNSUPPORTED, "dropout"},
    {"a forward rule (flash)", true, softcap_negative, AF_ERR_INVALID_ARGUMENT, "softcap"},
    {"lse of the wrong shape", false, lse_wrong_shape, AF_ERR_INVALID_ARGUMENT, "lse: expected shape"},
    {"query batch broadcast", false, query_batch_broadcast, AF_ERR_UNSUPPORTED, "query: batch size 1 broadcasts to 2"},
    {"key heads broadcast", false, key_heads_broadcast, AF_ERR_UNSUPPORTED, "key: 1 heads broadcast to value's 2"},
    {"value batch broadcast", false, value_batch_broadcast, AF_ERR_UNSUPPORTED, "value: batch size 1 broadcasts to 2"},
    {"float8 K/V", true, key_float8, AF_ERR_UNSUPPORTED, "key: dtype float8_e4m3fn has no backward pass"},
    {"dout head dim", false, dout_shape, AF_ERR_INVALID_ARGUMENT, "dout: expected shape"},
    {"dout packed rows", true, dout_rows, AF_ERR_INVALID_ARGUMENT, "dout: expected shape"},
    {"dout dtype", false, dout_dtype, AF_ERR_INVALID_ARGUMENT, "dout: dtype bfloat16 does not match out's float32"},
    {"dout misaligned", true, dout_misaligned, AF_ERR_INVALID_ARGUMENT, "dout: data at"},
    {"dout negative stride", false, dout_negative_stride, AF_ERR_INVALID_ARGUMENT, "dout"},
    {"dout on another device", false, dout_on_cuda, AF_ERR_INVALID_ARGUMENT, "dout: on a different device than out"},
    {"dq shape", false, dq_shape, AF_ERR_INVALID_ARGUMENT, "dq: expected shape"},
    {"dq ndim", true, dq_ndim, AF_ERR_INVALID_ARGUMENT, "dq: expected 3 dimensions, got 2"},
    {"dq packed rows", true, dq_varlen_rows, AF_ERR_INVALID_ARGUMENT, "dq: expected shape"},
    {"dq dtype", false, dq_dtype, AF_ERR_INVALID_ARGUMENT, "dq: dtype float16 does not match query's float32"},
    {"dk dtype", true, dk_dtype, AF_ERR_INVALID_ARGUMENT, "dk: dtype bfloat16 does not match key's float32"},
    {"dv shape", false, dv_shape, AF_ERR_INVALID_ARGUMENT, "dv: expected shape"},
    {"dq misaligned", false, dq_misaligned, AF_ERR_INVALID_ARGUMENT, "dq: data at"},
    {"dk on another device", false, dk_on_cuda, AF_ERR_INVALID_ARGUMENT, "dk: on a different device than key"},
    {"dv elements share memory", true, dv_self_overlap, AF_ERR_INVALID_ARGUMENT, "dv: strides make distinct elements share memory"},
    {"dk overlaps dq", false, dk_over_dq, AF_ERR_INVALID_ARGUMENT, "dk: overlaps dq's memory"},
    {"dv overlaps dk", true, dv_over_dk, AF_ERR_INVALID_ARGUMENT, "dv: overlaps dk's memory"},
    {"dq overlaps query", false, dq_over_query, AF_ERR_INVALID_ARGUMENT, "dq: overlaps query's memory"},
    {"dk overlaps value", true, dk_over_value, AF_ERR_INVALID_ARGUMENT, "dk: overlaps value's memory"},
    {"dv overlaps dout", false, dv_over_dout, AF_ERR_INVALID_ARGUMENT, "dv: overlaps dout's memory"},
    {"dq overlaps out", true, dq_over_out, AF_ERR_INVALID_ARGUMENT, "dq: overlaps out's memory"},
    {"dq overlaps lse", false, dq_over_lse, AF_ERR_INVALID_ARGUMENT, "dq: overlaps lse's memory"},
    {"dq overlaps attn_mask", false, dq_over_mask, AF_ERR_INVALID_ARGUMENT, "dq: overlaps attn_mask's memory"},
    {"dsink overlaps cu_seqlens_k", true, dsink_over_cu_seqlens_k, AF_ERR_INVALID_ARGUMENT, "dsink: overlaps cu_seqlens_k's memory"},
    {"dsink on af_sdpa", false, dsink_on_sdpa, AF_ERR_INVALID_ARGUMENT, "dsink: must be NULL; af_sdpa has no learnable sink"},
    {"dsink without a sink", true, dsink_without_sink, AF_ERR_INVALID_ARGUMENT, "dsink: must be NULL when the call has no learnable_sink"},
    {"dsink shape", true, dsink_shape, AF_ERR_INVALID_ARGUMENT, "dsink: expected shape"},
    {"dsink dtype", true, dsink_dtype, AF_ERR_INVALID_ARGUMENT, "dsink: dtype float16 does not match learnable_sink's float32"},
    {"dsink overlaps the sink", true, dsink_over_sink, AF_ERR_INVALID_ARGUMENT, "dsink: overlaps learnable_sink's memory"},
};

/* The valid calls: sdpa (B 2, bool mask), flash (varlen q and k, GQA, a sink); f32, contiguous gradients. */
static bool build(call *c, bool flash) {
    memset(c, 0, sizeof *c);
    if (flash) {
        flash_case fc = flash_case_default(2, 4, 2, 3, 5, 8, 8);
        fc.varlen_q = true;
        fc.kv = KV_VARLEN;
        fc.sink = true;
        fc.sink_dtype = AF_F32;
        return backward_build_flash(&fc, &CONTIGUOUS, 5, &c->t);
    }
    sdpa_case sc = case_default(2, 2, 2, 3, 5, 8, 8);
    sc.mask = MASK_BOOL;
    sc.mask_shape = "B1LS";
    return backward_build_sdpa(&sc, &CONTIGUOUS, 5, &c->t);
}

static af_status run(call *c, bool reference) {
    const af_backward_inputs *in = c->no_in ? NULL : &c->t.in;
    const af_gradients *grads = c->no_grads ? NULL : &c->t.grads;
    if (c->t.flash)
        return reference ? af_flash_attn_backward_reference(&c->t.f.args, in, grads)
                         : af_flash_attn_backward(&c->t.f.args, in, grads);
    return reference ? af_sdpa_backward_reference(&c->t.s.args, in, grads) : af_sdpa_backward(&c->t.s.args, in, grads);
}

/* Every byte of every gradient buffer still the sentinel (their views may have been moved by the breaker). */
static bool nothing_written(const call *c) {
    const test_tensor *grads[4] = {&c->t.dq, &c->t.dk, &c->t.dv, &c->t.dsink};
    for (int i = 0; i < 4; i++)
        for (size_t b = 0; b < grads[i]->bytes; b++)
            if (grads[i]->memory[b] != TT_SENTINEL_BYTE) return false;
    return true;
}

static void fill_sentinel(call *c) {
    test_tensor *grads[4] = {&c->t.dq, &c->t.dk, &c->t.dv, &c->t.dsink};
    for (int i = 0; i < 4; i++)
        if (grads[i]->memory) tt_fill_bytes(grads[i], TT_SENTINEL_BYTE);
}

static void every_rule_is_refused_without_writing(void **state) {
    (void)state;
    for (size_t r = 0; r < sizeof rules / sizeof rules[0]; r++) {
        call c;
        assert_true(build(&c, rules[r].flash));
        assert_int_equal(run(&c, true), AF_OK);   /* valid before */
        rules[r].brk(&c);
        for (int reference = 0; reference < 2; reference++) {
            fill_sentinel(&c);
            const af_status st = run(&c, reference);
            if (st != rules[r].status || !strstr(af_last_error(), rules[r].message))
                fail_msg("rule '%s' (%s): got %s '%s', expected %s containing '%s'", rules[r].name,
                         reference ? "reference" : "fast path", af_status_name(st), af_last_error(),
                         af_status_name(rules[r].status), rules[r].message);
            if (!nothing_written(&c)) fail_msg("rule '%s' (%s): a gradient was written", rules[r].name,
                                               reference ? "reference" : "fast path");
        }
        backward_free(&c.t);
    }
}

/* Paged K/V runs forward but has no backward: refused by name, nothing written. */
static void paged_kv_is_refused(void **state) {
    (void)state;
    flash_case fc = flash_case_default(2, 2, 2, 3, 20, 8, 8);
    fc.kv = KV_PAGED;
    fc.seqused = true;
    fc.page_size = 8;
    flash_tensors f;
    test_rng rng = {9};
    assert_true(flash_case_build(&fc, &f));
    assert_int_equal(af_flash_attn(&f.args, &f.out.view, &f.lse.view), AF_OK);
    test_tensor dout, dq, dk, dv;
    assert_true(tt_alloc(&dout, AF_F32, f.out.view.ndim, f.out.view.shape, LAYOUT_CONTIGUOUS, &rng) &&
                tt_alloc(&dq, AF_F32, f.q.view.ndim, f.q.view.shape, LAYOUT_CONTIGUOUS, &rng) &&
                tt_alloc(&dk, AF_F32, f.k.view.ndim, f.k.view.shape, LAYOUT_CONTIGUOUS, &rng) &&
                tt_alloc(&dv, AF_F32, f.v.view.ndim, f.v.view.shape, LAYOUT_CONTIGUOUS, &rng));
    tt_fill_uniform(&dout, &rng, 1.0);
    const af_backward_inputs in = {.out = &f.out.view, .dout = &dout.view, .lse = &f.lse.view};
    const af_gradients grads = {.dq = &dq.view, .dk = &dk.view, .dv = &dv.view};
    for (int reference = 0; reference < 2; reference++) {
        test_tensor *g[3] = {&dq, &dk, &dv};
        for (int i = 0; i < 3; i++) tt_fill_bytes(g[i], TT_SENTINEL_BYTE);
        const af_status st = reference ? af_flash_attn_backward_reference(&f.args, &in, &grads)
                                       : af_flash_attn_backward(&f.args, &in, &grads);
        assert_int_equal(st, AF_ERR_UNSUPPORTED);
        assert_non_null(strstr(af_last_error(), "page_table: paged K/V has no backward pass"));
        for (int i = 0; i < 3; i++)
            for (size_t b = 0; b < g[i]->bytes; b++) assert_int_equal(g[i]->memory[b], TT_SENTINEL_BYTE);
    }
    tt_free(&dout);
    tt_free(&dq);
    tt_free(&dk);
    tt_free(&dv);
    flash_case_free(&f);
}

/* NULL args: the forward's message, from both entry points. */
static void null_args(void **state) {
    (void)state;
    call c;
    assert_true(build(&c, false));
    assert_int_equal(af_sdpa_backward(NULL, &c.t.in, &c.t.grads), AF_ERR_INVALID_ARGUMENT);
    assert_true(af_last_error()[0] != '\0');
    assert_int_equal(af_flash_attn_backward(NULL, &c.t.in, &c.t.grads), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "args: must not be NULL"));
    backward_free(&c.t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(every_rule_is_refused_without_writing),
        cmocka_unit_test(paged_kv_is_refused),
        cmocka_unit_test(null_args),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
