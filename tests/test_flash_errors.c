/* Every rule of af_flash_attn's boundary, once: a valid varlen-query, paged-K/V call (or a fixed one) is broken in one
 * way; af_flash_attn and the reference refuse it with the status and a message that names the argument, and write
 * nothing to out or lse. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "attnforge.h"
#include "flash_case.h"

typedef struct {
    flash_tensors t;
    int32_t bad_i32[8];
    float f32_scalar[8];
    int32_t roomy_table[256];   /* a page table with room for lse inside it: the overlap names no other input */
} call;

typedef void (*breaker)(call *c);

typedef struct {
    const char *name;
    bool paged;           /* start from the varlen/paged call, else the fixed one */
    breaker brk;
    af_status status;
    const char *message;  /* a substring of af_last_error() */
} rule;

static void set_i32(test_tensor *t, int64_t i, int32_t v) { tt_set(t, &i, (double)v); }

static void sink_misaligned(call *c) { c->t.sink.view.data = (char *)c->t.sink.view.data + 2; }
static void query_on_cuda(call *c) { c->t.q.view.device = (af_device){AF_DEVICE_CUDA, 0}; }
static void all_on_cuda(call *c) {   /* every tensor of the call on cuda:0 (nothing is read: the check refuses first) */
    test_tensor *all[] = {&c->t.q, &c->t.k, &c->t.v, &c->t.out, &c->t.lse, &c->t.sink, &c->t.cu_q, &c->t.cu_k,
                          &c->t.seqused_k, &c->t.page_table};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) all[i]->view.device = (af_device){AF_DEVICE_CUDA, 0};
}
static void cuda_value_misaligned(call *c) {   /* refused at the boundary, before the (absent) CUDA backend is needed */
    all_on_cuda(c);
    c->t.v.view.data = (char *)c->t.v.view.data + 1;
}
static void kv_on_cuda_1(call *c) { all_on_cuda(c); c->t.k.view.device.index = c->t.v.view.device.index = 1; }
static void cu_q_float(call *c) { c->t.cu_q.view.dtype = AF_F32; }
static void cu_q_broadcast(call *c) { c->t.cu_q.view.strides[0] = 0; }   /* every entry the first */
static void page_table_broadcast(call *c) { c->t.page_table.view.strides[1] = 0; }
static void cu_q_shape(call *c) { c->t.cu_q.view.shape[0] -= 1; }
static void cu_q_first(call *c) { set_i32(&c->t.cu_q, 0, 1); }
static void cu_q_decreasing(call *c) { set_i32(&c->t.cu_q, 1, 10); }   /* [0, 10, 9] */
static void cu_q_last(call *c) { set_i32(&c->t.cu_q, c->t.c.B, (int32_t)tt_get(&c->t.cu_q, &c->t.c.B) - 1); }
static void max_seqlen_q_short(call *c) { c->t.args.max_seqlen_q = 1; }
static void seqused_too_long(call *c) { set_i32(&c->t.seqused_k, 0, 1000); }
static void seqused_negative(call *c) { set_i32(&c->t.seqused_k, 1, -1); }
static void seqused_missing(call *c) { c->t.args.seqused_k = NULL; }
static void page_out_of_range(call *c) {
    const int64_t idx[2] = {0, 0};
    tt_set(&c->t.page_table, idx, (double)c->t.k.view.shape[0]);
}
static void page_negative(call *c) {
    const int64_t idx[2] = {1, 0};
    tt_set(&c->t.page_table, idx, -1.0);
}
static void page_table_float(call *c) { c->t.page_table.view.dtype = AF_F32; }
static void page_table_rows(call *c) { c->t.page_table.view.shape[0] = 1; }
static void page_table_with_cu_k(call *c) { c->t.args.cu_seqlens_k = &c->t.cu_q.view; }
static void page_size_zero(call *c) { c->t.k.view.shape[1] = c->t.v.view.shape[1] = 0; }
static void softcap_negative(call *c) { c->t.args.softcap = -1.0; }
static void softcap_inf(call *c) { c->t.args.softcap = INFINITY; }
static void scale_nan(call *c) { c->t.args.has_scale = true; c->t.args.scale = NAN; }
static void sink_shape(call *c) { c->t.sink.view.shape[0] += 1; }
static void sink_int(call *c) { c->t.sink.view.dtype = AF_I32; }
static void query_int(call *c) { c->t.q.view.dtype = AF_I32; }
static void key_dtype(call *c) { c->t.k.view.dtype = AF_BF16; }
static void query_4d_varlen(call *c) { c->t.q.view.ndim = 4; c->t.q.view.shape[3] = 1; }
static void heads_not_multiple(call *c) { c->t.k.view.shape[2] = 3; c->t.v.view.shape[2] = 3; }
static void key_head_dim(call *c) { c->t.k.view.shape[3] += 1; }
static void value_pages(call *c) { c->t.v.view.shape[0] -= 1; }
static void out_shape(call *c) { c->t.out.view.shape[1] += 1; }
static void out_dtype(call *c) { c->t.out.view.dtype = AF_F16; }
static void lse_shape(call *c) { c->t.lse.view.shape[0] += 1; }
static void lse_dtype(call *c) { c->t.lse.view.dtype = AF_F16; }
static void out_overlaps_query(call *c) { c->t.out.view.data = c->t.q.view.data; c->t.out.view.dtype = c->t.q.view.dtype; }
static void lse_overlaps_page_table(call *c) {
    const size_t offset = (size_t)((char *)c->t.page_table.view.data - (char *)c->t.page_table.memory);
    assert_true(c->t.page_table.bytes <= sizeof c->roomy_table && c->t.lse.bytes <= sizeof c->roomy_table);
    memcpy(c->roomy_table, c->t.page_table.memory, c->t.page_table.bytes);
    c->t.page_table.view.data = (char *)c->roomy_table + offset;
    c->t.lse.view.data = c->roomy_table;
}
static void key_null(call *c) { c->t.args.key = NULL; }
static void negative_stride(call *c) { c->t.cu_q.view.strides[0] = -1; }
static void max_seqlen_negative(call *c) { c->t.args.max_seqlen_k = -1; }
static void fixed_batch(call *c) { c->t.k.view.shape[0] += 1; c->t.v.view.shape[0] += 1; }
static void fixed_seqused_past_keys(call *c) {
    c->t.args.seqused_k = &c->t.seqused_k.view;
    for (int64_t b = 0; b < c->t.c.B; b++) set_i32(&c->t.seqused_k, b, (int32_t)c->t.k.view.shape[1] + 1);
}
static void packed_rows(af_tensor *t) {   /* a contiguous (B, S, H, D) as the packed (B·S, H, D) */
    const af_tensor full = *t;
    t->ndim = 3;
    t->shape[0] = full.shape[0] * full.shape[1];
    for (int d = 1; d < 3; d++) t->shape[d] = full.shape[d + 1], t->strides[d] = full.strides[d + 1];
    t->strides[0] = full.strides[1];
}
static void cu_k_shape(call *c) {
    packed_rows(&c->t.k.view);
    packed_rows(&c->t.v.view);
    c->t.args.cu_seqlens_k = &c->t.seqused_k.view;   /* (B,): one short */
}
static void cu_unaligned(call *c) { c->t.cu_q.view.data = (char *)c->t.cu_q.view.data + 1; c->t.cu_q.view.shape[0] = 1; }
/* float8: K/V (and q) views reinterpreted as float8 (the f32 buffers hold enough bytes), descales (B = 2, Hkv = 2)
 * over f32_scalar */
static void kv_f8(call *c, af_dtype dt) { c->t.k.view.dtype = c->t.v.view.dtype = dt; }
static af_tensor *descale(call *c, int which) {
    static af_tensor views[3];
    const int64_t shape[2] = {2, 2};
    views[which] = af_tensor_contiguous(c->f32_scalar, AF_F32, 2, shape);
    const af_tensor **args[3] = {&c->t.args.q_descale, &c->t.args.k_descale, &c->t.args.v_descale};
    *args[which] = &views[which];
    return &views[which];
}
static void descale_without_f8(call *c) { descale(c, 0); }
static void descale_shape(call *c) { kv_f8(c, AF_F8E4M3); descale(c, 1)->shape[1] = 1; }
static void descale_dtype(call *c) { kv_f8(c, AF_F8E5M2); descale(c, 2)->dtype = AF_F16; }
static void descale_on_cuda(call *c) { kv_f8(c, AF_F8E4M3); descale(c, 0)->device = (af_device){AF_DEVICE_CUDA, 0}; }
static void descale_unaligned(call *c) {
    kv_f8(c, AF_F8E4M3);
    af_tensor *d = descale(c, 1);
    d->data = (char *)d->data + 2;
}
static void descale_overlaps_out(call *c) {
    kv_f8(c, AF_F8E4M3);
    descale(c, 2)->data = c->t.out.view.data;
}
static void descale_null_data(call *c) { kv_f8(c, AF_F8E4M3); descale(c, 0)->data = NULL; }
static void kv_f8_mixed(call *c) { c->t.k.view.dtype = AF_F8E4M3; c->t.v.view.dtype = AF_F8E5M2; }
static void value_f8_only(call *c) { c->t.v.view.dtype = AF_F8E4M3; }
static void query_f8_kv_f16(call *c) { c->t.q.view.dtype = AF_F8E4M3; kv_f8(c, AF_F16); }
static void query_f8_kv_other_f8(call *c) { c->t.q.view.dtype = AF_F8E4M3; kv_f8(c, AF_F8E5M2); }
static void out_f8(call *c) { c->t.q.view.dtype = AF_F8E5M2; kv_f8(c, AF_F8E5M2); c->t.out.view.dtype = AF_F8E5M2; }
static void out_not_query_under_f8_kv(call *c) { kv_f8(c, AF_F8E4M3); c->t.out.view.dtype = AF_BF16; }

#define INVALID AF_ERR_INVALID_ARGUMENT
#define UNSUPPORTED AF_ERR_UNSUPPORTED
static const rule rules[] = {
    {"sink_misaligned", false, sink_misaligned, INVALID, "learnable_sink: data at 0x"},
    {"cuda_value_misaligned", true, cuda_value_misaligned, INVALID, "value: data at 0x"},
    {"query_on_cuda", true, query_on_cuda, INVALID,
     "key: on cpu:0, but query is on cuda:0; every tensor of a call must be on one device"},
    {"kv_on_another_cuda", false, kv_on_cuda_1, INVALID, "key: on cuda:1, but query is on cuda:0"},
    {"cu_q_float", true, cu_q_float, INVALID, "cu_seqlens_q: must be int32, got float32"},
    {"cu_q_broadcast", true, cu_q_broadcast, INVALID, "cu_seqlens_q: stride[0] is 0 over"},
    {"page_table_broadcast", true, page_table_broadcast, INVALID, "page_table: stride[1] is 0 over"},
    {"cu_q_shape", true, cu_q_shape, INVALID, "page_table: expected shape (batch_size, max_pages) with batch_size 1"},
    {"cu_q_first", true, cu_q_first, INVALID, "cu_seqlens_q: must start at 0, got 1"},
    {"cu_q_decreasing", true, cu_q_decreasing, INVALID, "cu_seqlens_q: must be non-decreasing"},
    {"cu_q_last", true, cu_q_last, INVALID, "cu_seqlens_q: last entry"},
    {"max_seqlen_q_short", true, max_seqlen_q_short, INVALID, "max_seqlen_q: 1, but sequence"},
    {"seqused_too_long", true, seqused_too_long, INVALID, "seqused_k: [0] = 1000 is outside"},
    {"seqused_negative", true, seqused_negative, INVALID, "seqused_k: [1] = -1 is outside"},
    /* without seqused_k a sequence has max_pages · page_size keys (FA4): every entry is read, the spare one is -1 */
    {"seqused_missing", true, seqused_missing, INVALID, "] = -1 is outside [0, num_pages"},
    {"page_out_of_range", true, page_out_of_range, INVALID, "page_table: [0, 0] = "},
    {"page_negative", true, page_negative, INVALID, "page_table: [1, 0] = -1 is outside [0, num_pages"},
    {"page_table_float", true, page_table_float, INVALID, "page_table: must be int32, got float32"},
    {"page_table_rows", true, page_table_rows, INVALID, "page_table: expected shape (batch_size, max_pages)"},
    {"page_table_with_cu_k", true, page_table_with_cu_k, INVALID, "page_table: is not supported with cu_seqlens_k"},
    {"page_size_zero", true, page_size_zero, INVALID, "key: page_size (dim 1) must be >= 1"},
    {"softcap_negative", false, softcap_negative, INVALID, "softcap: must be finite and >= 0"},
    {"softcap_inf", false, softcap_inf, INVALID, "softcap: must be finite and >= 0"},
    {"scale_nan", false, scale_nan, INVALID, "scale: must be finite"},
    {"sink_shape", false, sink_shape, INVALID, "learnable_sink: expected shape"},
    {"sink_int", false, sink_int, UNSUPPORTED, "learnable_sink: dtype int32 is not supported"},
    {"query_int", false, query_int, UNSUPPORTED, "query: dtype int32 is not supported"},
    {"key_dtype", false, key_dtype, UNSUPPORTED, "key: dtype bfloat16 does not match query's float32"},
    {"query_4d_varlen", true, query_4d_varlen, INVALID, "query: expected 3 dimensions (total_q, Hq, E)"},
    {"heads_not_multiple", false, heads_not_multiple, INVALID, "num_head must be divisible by num_head_kv"},
    {"key_head_dim", false, key_head_dim, INVALID, "key: head dimension"},
    {"value_pages", true, value_pages, INVALID, "value: shape[0]"},
    {"out_shape", false, out_shape, INVALID, "out: expected shape"},
    {"out_dtype", false, out_dtype, INVALID, "out: dtype float16 does not match"},
    {"lse_shape", false, lse_shape, INVALID, "lse: expected shape"},
    {"lse_dtype", false, lse_dtype, INVALID, "lse: dtype must be float32"},
    {"out_overlaps_query", false, out_overlaps_query, INVALID, "out: overlaps query's memory"},
    {"lse_overlaps_page_table", true, lse_overlaps_page_table, INVALID, "lse: overlaps page_table's memory"},
    {"key_null", false, key_null, INVALID, "key: must not be NULL"},
    {"negative_stride", true, negative_stride, INVALID, "cu_seqlens_q: stride[0] is -1"},
    {"max_seqlen_negative", false, max_seqlen_negative, INVALID, "max_seqlen_k: must be >= 0"},
    {"fixed_batch", false, fixed_batch, INVALID, "key: batch size 3 does not match query's 2"},
    {"fixed_seqused_past_keys", false, fixed_seqused_past_keys, INVALID, "seqused_k: [0] = 41 is outside [0, 40]"},
    {"cu_k_shape", false, cu_k_shape, INVALID, "cu_seqlens_k: must have shape (batch_size + 1,) = (3,), got (2,)"},
    {"cu_unaligned", true, cu_unaligned, INVALID, "cu_seqlens_q: data at"},
    {"descale_without_f8", false, descale_without_f8, INVALID,
     "q_descale: q_descale/k_descale/v_descale are only supported for FP8 inputs (key is float32)"},
    {"descale_without_f8_paged", true, descale_without_f8, INVALID,
     "q_descale: q_descale/k_descale/v_descale are only"},
    {"descale_shape", false, descale_shape, INVALID, "k_descale: expected shape (2, 2), got (2, 1)"},
    {"descale_shape_paged", true, descale_shape, INVALID, "k_descale: expected shape (2, 2), got (2, 1)"},
    {"descale_dtype", false, descale_dtype, INVALID, "v_descale: dtype must be float32, got float16"},
    {"descale_on_cuda", false, descale_on_cuda, INVALID, "q_descale: on cuda:0, but query is on cpu:0"},
    {"descale_unaligned", false, descale_unaligned, INVALID, "k_descale: data at"},
    {"descale_overlaps_out", false, descale_overlaps_out, INVALID, "out: overlaps v_descale's memory"},
    {"descale_null_data", false, descale_null_data, INVALID, "q_descale: data is NULL but the view has 4 elements"},
    {"kv_f8_mixed", false, kv_f8_mixed, UNSUPPORTED,
     "value: dtype float8_e5m2 does not match key's float8_e4m3fn (k and v must have the same dtype)"},
    {"value_f8_only", false, value_f8_only, UNSUPPORTED, "value: dtype float8_e4m3fn does not match key's float32"},
    {"query_f8_kv_f16", false, query_f8_kv_f16, UNSUPPORTED,
     "key: dtype float16 does not match query's float8_e4m3fn (q, k, v, and qv must have the same dtype)"},
    {"query_f8_kv_other_f8", true, query_f8_kv_other_f8, UNSUPPORTED,
     "key: dtype float8_e5m2 does not match query's float8_e4m3fn"},
    {"out_f8", false, out_f8, INVALID, "out: dtype float8_e5m2 is not supported for float8 inputs; expected float32"},
    {"out_not_query_under_f8_kv", false, out_not_query_under_f8_kv, INVALID,
     "out: dtype bfloat16 does not match query's float32 (float32 is also taken for a float16 or bfloat16 query)"},
};

static flash_case base_case(bool paged) {
    flash_case c = flash_case_default(2, 4, 2, 5, 40, 8, 8);
    c.sink = true;
    c.seqused = true;
    if (paged) {
        const int64_t L[2] = {3, 6}, S[2] = {20, 33};
        for (int b = 0; b < 2; b++) c.Lq[b] = L[b], c.S_stored[b] = c.Sk[b] = S[b];
        c.varlen_q = true;
        c.kv = KV_PAGED;
        c.page_size = 8;
    }
    return c;
}

/* The index arrays of a CUDA call are never read by the host (the device checks them, docs/CUDA.md): the host's
 * checks pass, af_flash_attn goes on to the backend (none here) and the reference refuses the CUDA tensors. */
static void paged_on_cuda_is_not_read_on_the_host(void **state) {
    (void)state;
    call c;
    memset(&c, 0, sizeof c);
    const flash_case fc = base_case(true);
    assert_true(flash_case_build(&fc, &c.t));
    all_on_cuda(&c);
    assert_int_equal(af_flash_attn(&c.t.args, &c.t.out.view, &c.t.lse.view), AF_ERR_RUNTIME_UNAVAILABLE);
    assert_non_null(strstr(af_last_error(), "CUDA backend is not available"));
    assert_int_equal(af_flash_attn_reference(&c.t.args, &c.t.out.view, &c.t.lse.view), AF_ERR_UNSUPPORTED);
    assert_non_null(strstr(af_last_error(), "query: on cuda:0; the reference reads host memory"));
    flash_case_free(&c.t);
}

static void each_rule(void **state) {
    (void)state;
    for (size_t r = 0; r < sizeof rules / sizeof rules[0]; r++) {
        call c;
        memset(&c, 0, sizeof c);
        const flash_case fc = base_case(rules[r].paged);
        assert_true(flash_case_build(&fc, &c.t));
        assert_int_equal(af_flash_attn(&c.t.args, &c.t.out.view, &c.t.lse.view), AF_OK);   /* valid before */
        rules[r].brk(&c);
        for (int ref = 0; ref < 2; ref++) {
            tt_fill_bytes(&c.t.out, TT_SENTINEL_BYTE);
            tt_fill_bytes(&c.t.lse, TT_SENTINEL_BYTE);
            const af_status st = ref ? af_flash_attn_reference(&c.t.args, &c.t.out.view, &c.t.lse.view)
                                     : af_flash_attn(&c.t.args, &c.t.out.view, &c.t.lse.view);
            if (st != rules[r].status || !strstr(af_last_error(), rules[r].message))
                fail_msg("rule %s: status %s, message \"%s\"; expected %s with \"%s\"", rules[r].name,
                         af_status_name(st), af_last_error(), af_status_name(rules[r].status), rules[r].message);
            unsigned char *out_bytes = c.t.out.memory, *lse_bytes = c.t.lse.memory;
            for (size_t i = 0; i < c.t.out.bytes; i++)
                if (out_bytes[i] != TT_SENTINEL_BYTE) fail_msg("rule %s: out written on error", rules[r].name);
            for (size_t i = 0; i < c.t.lse.bytes; i++)
                if (lse_bytes[i] != TT_SENTINEL_BYTE) fail_msg("rule %s: lse written on error", rules[r].name);
        }
        flash_case_free(&c.t);
    }
}

static void null_arguments(void **state) {
    (void)state;
    af_tensor out = {0};
    assert_int_equal(af_flash_attn(NULL, &out, NULL), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "args: must not be NULL"));
    af_flash_args args = {0};
    assert_int_equal(af_flash_attn(&args, NULL, NULL), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "out: must not be NULL"));
    assert_int_equal(af_flash_attn(&args, &out, NULL), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "query: must not be NULL"));
}

/* af_sdpa keeps SDPA's meaning: float8 anywhere in q/k/v is refused by name, pointing at af_flash_attn. */
static void sdpa_refuses_float8(void **state) {
    (void)state;
    for (int which = 0; which < 3; which++) {
        call c;
        memset(&c, 0, sizeof c);
        const flash_case fc = base_case(false);
        assert_true(flash_case_build(&fc, &c.t));
        af_tensor q = c.t.q.view, k = c.t.k.view, v = c.t.v.view, out = c.t.out.view;
        af_tensor *t[3] = {&q, &k, &v};
        t[which]->dtype = which == 1 ? AF_F8E5M2 : AF_F8E4M3;
        const af_sdpa_args args = {.query = &q, .key = &k, .value = &v, .enable_gqa = true};
        tt_fill_bytes(&c.t.out, TT_SENTINEL_BYTE);
        assert_int_equal(af_sdpa(&args, &out, NULL), AF_ERR_UNSUPPORTED);
        assert_non_null(strstr(af_last_error(), "is not supported by af_sdpa; float8 K/V (or q/k/v) run through "
                                                "af_flash_attn"));
        assert_non_null(strstr(af_last_error(), which == 0 ? "query: dtype float8_e4m3fn" : which == 1 ?
                               "key: dtype float8_e5m2" : "value: dtype float8_e4m3fn"));
        for (size_t i = 0; i < c.t.out.bytes; i++) assert_int_equal(c.t.out.memory[i], TT_SENTINEL_BYTE);
        flash_case_free(&c.t);
    }
}

static void float8_dtypes(void **state) {
    (void)state;
    assert_string_equal(af_dtype_name(AF_F8E4M3), "float8_e4m3fn");
    assert_string_equal(af_dtype_name(AF_F8E5M2), "float8_e5m2");
    assert_int_equal(af_dtype_size(AF_F8E4M3), 1);
    assert_int_equal(af_dtype_size(AF_F8E5M2), 1);
}

static void int32_dtype(void **state) {
    (void)state;
    assert_string_equal(af_dtype_name(AF_I32), "int32");
    assert_int_equal(af_dtype_size(AF_I32), 4);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(each_rule),
        cmocka_unit_test(paged_on_cuda_is_not_read_on_the_host),
        cmocka_unit_test(null_arguments),
        cmocka_unit_test(int32_dtype),
        cmocka_unit_test(sdpa_refuses_float8),
        cmocka_unit_test(float8_dtypes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
