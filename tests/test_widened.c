/* A float32 out under a float16/bfloat16 af_flash_attn, and float32 dq/dk/dv under an af_flash_attn_backward of
 * those dtypes (CPU): partial results that are merged or summed later (attnforge.distributed's ring blocks, its
 * reduce-scattered dK/dV) are not rounded to 16 bits first. Checked against the double references on every ISA this
 * machine runs, in strided layouts (nothing written outside the views), and the rules that refuse the other
 * combinations (a 16-bit out under a 32-bit query, f16 gradients under bf16 inputs, dout not in out's dtype, CUDA). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "attnforge.h"
#include "test_tensor.h"

enum { B = 2, LQ = 13, S = 29, HQ = 4, HKV = 2, E = 24, EV = 16 };

typedef struct {
    test_tensor q, k, v, out32, out16, lse, ref_out, ref_lse;
    test_tensor dout32, dq, dk, dv, ref_dq, ref_dk, ref_dv;
    af_flash_args args;
} widened_case;

static void alloc(test_tensor *t, af_dtype dtype, int64_t a, int64_t b, int64_t c, int64_t d, tensor_layout layout,
                  test_rng *rng) {
    const int64_t shape[4] = {a, b, c, d};
    if (!tt_alloc(t, dtype, d < 0 ? 3 : 4, shape, layout, rng)) fail_msg("could not allocate a test tensor");
}

static void build(widened_case *c, af_dtype dtype, tensor_layout layout, uint64_t seed) {
    test_rng rng = {seed};
    memset(c, 0, sizeof *c);
    alloc(&c->q, dtype, B, LQ, HQ, E, layout, &rng);
    alloc(&c->k, dtype, B, S, HKV, E, layout, &rng);
    alloc(&c->v, dtype, B, S, HKV, EV, layout, &rng);
    tt_fill_uniform(&c->q, &rng, 2.0);
    tt_fill_uniform(&c->k, &rng, 2.0);
    tt_fill_uniform(&c->v, &rng, 1.0);
    alloc(&c->out32, AF_F32, B, LQ, HQ, EV, layout, &rng);
    alloc(&c->out16, dtype, B, LQ, HQ, EV, LAYOUT_CONTIGUOUS, &rng);
    alloc(&c->ref_out, AF_F32, B, LQ, HQ, EV, LAYOUT_CONTIGUOUS, &rng);
    const int64_t lse_shape[3] = {B, HQ, LQ};
    if (!tt_alloc(&c->lse, AF_F32, 3, lse_shape, LAYOUT_CONTIGUOUS, &rng) ||
        !tt_alloc(&c->ref_lse, AF_F32, 3, lse_shape, LAYOUT_CONTIGUOUS, &rng))
        fail_msg("could not allocate lse");
    alloc(&c->dout32, AF_F32, B, LQ, HQ, EV, layout, &rng);
    tt_fill_uniform(&c->dout32, &rng, 1.0);
    alloc(&c->dq, AF_F32, B, LQ, HQ, E, layout, &rng);
    alloc(&c->dk, AF_F32, B, S, HKV, E, layout, &rng);
    alloc(&c->dv, AF_F32, B, S, HKV, EV, layout, &rng);
    alloc(&c->ref_dq, AF_F32, B, LQ, HQ, E, LAYOUT_CONTIGUOUS, &rng);
    alloc(&c->ref_dk, AF_F32, B, S, HKV, E, LAYOUT_CONTIGUOUS, &rng);
    alloc(&c->ref_dv, AF_F32, B, S, HKV, EV, LAYOUT_CONTIGUOUS, &rng);
    c->args = (af_flash_args){.query = &c->q.view, .key = &c->k.view, .value = &c->v.view, .has_window = true,
                              .window_left = 9, .window_right = 2, .softcap = 3.0};
}

static void release(widened_case *c) {
    test_tensor *all[] = {&c->q, &c->k, &c->v, &c->out32, &c->out16, &c->lse, &c->ref_out, &c->ref_lse, &c->dout32,
                          &c->dq, &c->dk, &c->dv, &c->ref_dq, &c->ref_dk, &c->ref_dv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tt_free(all[i]);
}

static double max_diff(const test_tensor *a, const test_tensor *b) {
    int64_t idx[AF_MAX_DIMS] = {0};
    double worst = 0.0;
    do {
        const double d = fabs(tt_get(a, idx) - tt_get(b, idx));
        if (!(d <= worst)) worst = d;   /* NaN wins */
    } while (tt_next_index(a->view.ndim, a->view.shape, idx));
    return worst;
}

static double max_abs(const test_tensor *t) {
    double m, row;
    tt_magnitudes(t, &m, &row);
    return m;
}

/* Forward then backward on the current ISA, against the references; outputs filled with the sentinel first. */
static void check_isa(widened_case *c, af_dtype dtype, const char *isa) {
    tt_fill_bytes(&c->out32, TT_SENTINEL_BYTE);
    assert_int_equal(af_flash_attn(&c->args, &c->out32.view, &c->lse.view), AF_OK);
    assert_int_equal(af_flash_attn(&c->args, &c->out16.view, NULL), AF_OK);
    assert_true(tt_outside_view_is(&c->out32, TT_SENTINEL_BYTE));
    const double err32 = max_diff(&c->out32, &c->ref_out), err16 = max_diff(&c->out16, &c->ref_out);
    const double bound = dtype == AF_BF16 ? 1e-2 : 2e-3;   /* P·V on 16-bit P in the kernel; out not rounded */
    if (!(err32 < bound && err32 <= err16))
        fail_msg("%s: float32 out off the reference by %g (16-bit out: %g)", isa, err32, err16);
    if (!(max_diff(&c->lse, &c->ref_lse) < 1e-4)) fail_msg("%s: lse off the reference", isa);

    const af_backward_inputs in = {.out = &c->out32.view, .dout = &c->dout32.view, .lse = &c->lse.view};
    const af_gradients grads = {.dq = &c->dq.view, .dk = &c->dk.view, .dv = &c->dv.view};
    test_tensor *g[3] = {&c->dq, &c->dk, &c->dv}, *r[3] = {&c->ref_dq, &c->ref_dk, &c->ref_dv};
    for (int i = 0; i < 3; i++) tt_fill_bytes(g[i], TT_SENTINEL_BYTE);
    assert_int_equal(af_flash_attn_backward(&c->args, &in, &grads), AF_OK);
    for (int i = 0; i < 3; i++) {
        assert_true(tt_outside_view_is(g[i], TT_SENTINEL_BYTE));
        const double err = max_diff(g[i], r[i]), scale = max_abs(r[i]);
        if (!(err <= 0.03 * scale + 1e-4)) fail_msg("%s: float32 gradient %d off the reference by %g (max %g)", isa,
                                                    i, err, scale);
    }
}

static void widened_matches_reference(af_dtype dtype) {
    for (int layout = 0; layout < LAYOUT_COUNT; layout++) {
        widened_case c;
        build(&c, dtype, (tensor_layout)layout, 11 + (uint64_t)layout);
        assert_int_equal(af_flash_attn_reference(&c.args, &c.ref_out.view, &c.ref_lse.view), AF_OK);
        const af_backward_inputs in = {.out = &c.ref_out.view, .dout = &c.dout32.view, .lse = &c.ref_lse.view};
        const af_gradients ref = {.dq = &c.ref_dq.view, .dk = &c.ref_dk.view, .dv = &c.ref_dv.view};
        assert_int_equal(af_flash_attn_backward_reference(&c.args, &in, &ref), AF_OK);
        const char *before = af_get_isa();
        const char *isas[] = {"portable", "avx2", "avx512", "amx"};
        for (size_t i = 0; i < sizeof isas / sizeof isas[0]; i++) {
            if (!af_isa_available(isas[i])) continue;
            assert_int_equal(af_set_isa(isas[i]), AF_OK);
            check_isa(&c, dtype, isas[i]);
        }
        assert_int_equal(af_set_isa(before), AF_OK);
        release(&c);
    }
}

static void bf16_float32_out_and_gradients(void **state) {
    (void)state;
    widened_matches_reference(AF_BF16);
}

static void f16_float32_out_and_gradients(void **state) {
    (void)state;
    widened_matches_reference(AF_F16);
}

static void expect(af_status got, af_status want, const char *message) {
    assert_int_equal(got, want);
    if (!strstr(af_last_error(), message)) fail_msg("expected \"%s\" in \"%s\"", message, af_last_error());
}

static void the_other_combinations_are_refused(void **state) {
    (void)state;
    widened_case c;
    build(&c, AF_BF16, LAYOUT_CONTIGUOUS, 5);
    test_tensor out_f16, dq_f16, dout16;
    test_rng rng = {1};
    alloc(&out_f16, AF_F16, B, LQ, HQ, EV, LAYOUT_CONTIGUOUS, &rng);
    alloc(&dq_f16, AF_F16, B, LQ, HQ, E, LAYOUT_CONTIGUOUS, &rng);
    alloc(&dout16, AF_BF16, B, LQ, HQ, EV, LAYOUT_CONTIGUOUS, &rng);
    expect(af_flash_attn(&c.args, &out_f16.view, NULL), AF_ERR_INVALID_ARGUMENT,
           "out: dtype float16 does not match query's bfloat16 (float32 is also taken");
    assert_int_equal(af_flash_attn(&c.args, &c.out32.view, &c.lse.view), AF_OK);
    const af_backward_inputs in = {.out = &c.out32.view, .dout = &c.dout32.view, .lse = &c.lse.view};
    expect(af_flash_attn_backward(&c.args, &in, &(af_gradients){.dq = &dq_f16.view}), AF_ERR_INVALID_ARGUMENT,
           "dq: dtype float16 does not match query's bfloat16 (float32 is also taken");
    const af_backward_inputs mixed = {.out = &c.out32.view, .dout = &dout16.view, .lse = &c.lse.view};
    expect(af_flash_attn_backward(&c.args, &mixed, &(af_gradients){.dq = &c.dq.view}), AF_ERR_INVALID_ARGUMENT,
           "dout: dtype bfloat16 does not match out's float32");
    /* an f32 query: a 16-bit out stays refused */
    c.q.view.dtype = c.k.view.dtype = c.v.view.dtype = AF_F32;
    expect(af_flash_attn(&c.args, &out_f16.view, NULL), AF_ERR_INVALID_ARGUMENT,
           "out: dtype float16 does not match query's float32");
    /* CUDA tensors: the widened out is the CPU's alone (checked before anything is enqueued) */
    c.q.view.dtype = c.k.view.dtype = c.v.view.dtype = AF_BF16;
    af_tensor *on_gpu[] = {&c.q.view, &c.k.view, &c.v.view, &c.out32.view};
    for (size_t i = 0; i < sizeof on_gpu / sizeof on_gpu[0]; i++) on_gpu[i]->device = (af_device){AF_DEVICE_CUDA, 0};
    expect(af_flash_attn(&c.args, &c.out32.view, NULL), AF_ERR_UNSUPPORTED, "out: float32 under a bfloat16 query "
           "runs on the CPU only");
    for (size_t i = 0; i < sizeof on_gpu / sizeof on_gpu[0]; i++) on_gpu[i]->device = (af_device){AF_DEVICE_CPU, 0};
    tt_free(&out_f16);
    tt_free(&dq_f16);
    tt_free(&dout16);
    release(&c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(bf16_float32_out_and_gradients),
        cmocka_unit_test(f16_float32_out_and_gradients),
        cmocka_unit_test(the_other_combinations_are_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
