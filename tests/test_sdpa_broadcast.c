/* PyTorch's broadcasting of SDPA's batch and head dims (docs/API.md, "The broadcasting rule"): a size-1 batch or head
 * dim of q, k or v broadcasts (stride 0) to the output's; enable_gqa groups heads that divide query's. Each accepted
 * shape runs on every ISA against the reference and against the reference on explicitly expanded copies; each
 * refused one fails with its rule's message and writes nothing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"

typedef struct { int64_t b, h; } bh;

typedef struct {
    const char *name;
    bh q, k, v;              /* batch and heads of each; L, S, E, Ev are the suite's */
    bool enable_gqa, is_causal;
    int mask_ndim;           /* 0: no mask */
    int64_t mask_shape[4];
} shape_case;

enum { L = 5, S = 7, E = 8, EV = 6 };

static int64_t bcast(int64_t a, int64_t b) { return a == 1 ? b : a; }

/* PyTorch's output batch and heads for an accepted case. */
static bh out_of(const shape_case *c) {
    bh o;
    o.b = bcast(bcast(c->q.b, c->k.b), c->v.b);
    o.h = c->enable_gqa && !(c->q.h == c->k.h && c->k.h == c->v.h) ? c->q.h : bcast(bcast(c->q.h, c->k.h), c->v.h);
    return o;
}

static float *random_floats(int64_t n, unsigned *seed) {
    float *x = malloc(sizeof(float) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) x[i] = (float)rand_r(seed) / (float)RAND_MAX * 2.0f - 1.0f;
    return x;
}

/* x (b, h, rows, cols) expanded to (B, H, rows, cols): batch by broadcasting, heads by repeating each `H / h` times
 * (PyTorch's repeat_interleave under enable_gqa; for h == 1 the same as broadcasting). */
static float *expand(const float *x, bh from, bh to, int64_t rows, int64_t cols) {
    float *y = malloc(sizeof(float) * (size_t)(to.b * to.h * rows * cols));
    const int64_t repeat = to.h / from.h, block = rows * cols;
    for (int64_t b = 0; b < to.b; b++)
        for (int64_t h = 0; h < to.h; h++)
            memcpy(y + (b * to.h + h) * block, x + ((from.b == 1 ? 0 : b) * from.h + h / repeat) * block,
                   sizeof(float) * (size_t)block);
    return y;
}

static af_tensor view4(float *data, bh d, int64_t rows, int64_t cols) {
    return af_tensor_contiguous(data, AF_F32, 4, (int64_t[]){d.b, d.h, rows, cols});
}

static double max_abs_diff(const float *a, const float *b, int64_t n) {
    double worst = 0;
    for (int64_t i = 0; i < n; i++) {
        const double d = fabs((double)a[i] - (double)b[i]);
        if (d > worst || isnan(d)) worst = isnan(d) ? INFINITY : d;
    }
    return worst;
}

/* A case's q, k, v (and mask) filled from `seed`, and the call over them; filled in place (args points into it). */
typedef struct {
    float *q, *k, *v, *mask;
    af_tensor qt, kt, vt, mt;
    af_sdpa_args args;
} case_call;

static void make_call(const shape_case *c, unsigned seed, case_call *cc) {
    cc->q = random_floats(c->q.b * c->q.h * L * E, &seed);
    cc->k = random_floats(c->k.b * c->k.h * S * E, &seed);
    cc->v = random_floats(c->v.b * c->v.h * S * EV, &seed);
    int64_t mask_numel = 1;
    for (int d = 0; d < c->mask_ndim; d++) mask_numel *= c->mask_shape[d];
    cc->mask = c->mask_ndim ? random_floats(mask_numel, &seed) : NULL;
    cc->qt = view4(cc->q, c->q, L, E);
    cc->kt = view4(cc->k, c->k, S, E);
    cc->vt = view4(cc->v, c->v, S, EV);
    if (cc->mask) cc->mt = af_tensor_contiguous(cc->mask, AF_F32, c->mask_ndim, c->mask_shape);
    cc->args = (af_sdpa_args){.query = &cc->qt, .key = &cc->kt, .value = &cc->vt,
                              .attn_mask = cc->mask ? &cc->mt : NULL, .enable_gqa = c->enable_gqa,
                              .is_causal = c->is_causal};
}

static void free_call(case_call *cc) {
    free(cc->q); free(cc->k); free(cc->v); free(cc->mask);
}

static void run_accepted(const shape_case *c) {
    const bh o = out_of(c);
    case_call cc;
    make_call(c, 1234, &cc);
    const af_sdpa_args args = cc.args;

    const int64_t out_numel = o.b * o.h * L * EV, lse_numel = o.b * o.h * L;
    float *ref = calloc((size_t)out_numel + 1, sizeof(float)), *ref_lse = calloc((size_t)lse_numel + 1, sizeof(float));
    af_tensor ref_t = view4(ref, o, L, EV);
    af_tensor ref_lse_t = af_tensor_contiguous(ref_lse, AF_F32, 3, (int64_t[]){o.b, o.h, L});
    if (af_sdpa_reference(&args, &ref_t, &ref_lse_t) != AF_OK) fail_msg("%s: reference: %s", c->name, af_last_error());

    /* the same call on explicitly expanded copies: every tensor (B, H, ...), no broadcasting, no grouping */
    float *qe = expand(cc.q, c->q, o, L, E), *ke = expand(cc.k, c->k, o, S, E), *ve = expand(cc.v, c->v, o, S, EV);
    af_tensor qet = view4(qe, o, L, E), ket = view4(ke, o, S, E), vet = view4(ve, o, S, EV);
    af_sdpa_args expanded = args;
    expanded.query = &qet;
    expanded.key = &ket;
    expanded.value = &vet;
    expanded.enable_gqa = false;
    float *want = calloc((size_t)out_numel + 1, sizeof(float)), *want_lse = calloc((size_t)lse_numel + 1, sizeof(float));
    af_tensor want_t = view4(want, o, L, EV);
    af_tensor want_lse_t = af_tensor_contiguous(want_lse, AF_F32, 3, (int64_t[]){o.b, o.h, L});
    if (af_sdpa_reference(&expanded, &want_t, &want_lse_t) != AF_OK)
        fail_msg("%s: expanded reference: %s", c->name, af_last_error());
    if (max_abs_diff(ref, want, out_numel) > 1e-6 || max_abs_diff(ref_lse, want_lse, lse_numel) > 1e-6)
        fail_msg("%s: the reference on broadcast views differs from the one on expanded copies", c->name);

    float *out = calloc((size_t)out_numel + 1, sizeof(float)), *lse = calloc((size_t)lse_numel + 1, sizeof(float));
    af_tensor out_t = view4(out, o, L, EV);
    af_tensor lse_t = af_tensor_contiguous(lse, AF_F32, 3, (int64_t[]){o.b, o.h, L});
    const char *isa_before = af_get_isa();
    for (int i = 0; af_isa_name(i); i++) {
        const char *isa = af_isa_name(i);
        if (!af_isa_available(isa)) continue;
        for (int threads = 1; threads <= 2; threads++) {
            assert_int_equal(af_set_isa(isa), AF_OK);
            af_set_num_threads(threads);
            memset(out, 0xff, sizeof(float) * (size_t)out_numel);
            if (af_sdpa(&args, &out_t, &lse_t) != AF_OK) fail_msg("%s on %s: %s", c->name, isa, af_last_error());
            const double d = max_abs_diff(out, want, out_numel), dl = max_abs_diff(lse, want_lse, lse_numel);
            if (d > 2e-5 || dl > 2e-5)
                fail_msg("%s on %s, %d threads: max |out - expanded| = %g, |lse - expanded| = %g", c->name, isa,
                         threads, d, dl);
        }
    }
    assert_int_equal(af_set_isa(isa_before), AF_OK);
    af_set_num_threads(0);
    free_call(&cc);
    free(qe); free(ke); free(ve);
    free(ref); free(ref_lse); free(want); free(want_lse); free(out); free(lse);
}

/* Accepted by PyTorch's math SDPA (measured with torch 2.15, docs/PYTORCH.md), so by af_sdpa. */
static const shape_case accepted[] = {
    {"falcon_mqa_heads", {2, 4}, {2, 1}, {2, 1}, false, true, 0, {0}},
    {"kv_batch_1", {2, 4}, {1, 4}, {1, 4}, false, false, 0, {0}},
    {"kv_batch_and_heads_1", {2, 4}, {1, 1}, {1, 1}, false, true, 0, {0}},
    {"query_batch_1", {1, 4}, {2, 4}, {2, 4}, false, false, 0, {0}},
    {"query_heads_1", {2, 1}, {2, 4}, {2, 4}, false, true, 0, {0}},
    {"key_heads_1_value_all", {2, 4}, {2, 1}, {2, 4}, false, false, 0, {0}},
    {"value_heads_1_key_all", {2, 4}, {2, 4}, {2, 1}, false, false, 0, {0}},
    {"key_batch_1_only", {2, 4}, {1, 4}, {2, 4}, false, false, 0, {0}},
    {"value_batch_1_only", {2, 4}, {2, 4}, {1, 4}, false, true, 0, {0}},
    {"everything_from_one", {1, 1}, {3, 1}, {1, 2}, false, false, 0, {0}},
    {"gqa_mqa", {2, 4}, {2, 1}, {2, 1}, true, true, 0, {0}},
    {"gqa_batch_broadcast", {1, 4}, {2, 2}, {2, 2}, true, false, 0, {0}},
    {"gqa_value_one_head", {2, 8}, {2, 2}, {2, 1}, true, false, 0, {0}},
    {"gqa_key_one_head", {2, 8}, {2, 1}, {2, 2}, true, true, 0, {0}},
    {"gqa_key_equal_value_grouped", {2, 4}, {2, 4}, {2, 1}, true, false, 0, {0}},
    {"gqa_three_heads_one", {2, 3}, {2, 1}, {2, 1}, true, false, 0, {0}},
    {"mask_full_over_mqa", {2, 4}, {2, 1}, {2, 1}, false, false, 4, {2, 4, L, S}},
    {"mask_2d_over_batch_broadcast", {2, 4}, {1, 1}, {1, 1}, false, false, 2, {L, S}},
    {"mask_scores_smaller_than_out", {1, 4}, {1, 4}, {2, 4}, false, false, 4, {1, 4, L, S}},
    {"mask_over_broadcast_query", {1, 1}, {2, 4}, {2, 4}, false, false, 4, {2, 4, L, 1}},
};

static void accepted_shapes_match_expanded_copies(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof accepted / sizeof accepted[0]; i++) run_accepted(&accepted[i]);
}

typedef struct {
    shape_case c;
    bh out;                  /* the out (and lse) the caller passes */
    af_status status;
    const char *message;
} refused_case;

/* Refused by PyTorch's math SDPA, so by af_sdpa, with the rule's words; the last two are attnforge's own limits. */
static const refused_case refused[] = {
    {{"heads_2_of_4_without_gqa", {2, 4}, {2, 2}, {2, 2}, false, false, 0, {0}}, {2, 4}, AF_ERR_INVALID_ARGUMENT,
     "enable_gqa is false but query has 4 heads and key has 2; without it head counts broadcast only when equal or 1"},
    {{"value_heads_2_of_4", {2, 4}, {2, 4}, {2, 2}, false, false, 0, {0}}, {2, 4}, AF_ERR_INVALID_ARGUMENT,
     "enable_gqa is false but value has 2 heads and query/key 4"},
    {{"batches_2_and_3", {2, 4}, {3, 4}, {3, 4}, false, false, 0, {0}}, {2, 4}, AF_ERR_INVALID_ARGUMENT,
     "key: batch size 3 does not match query's 2; batch sizes broadcast only when equal or 1"},
    {{"value_batch_3", {1, 4}, {2, 4}, {3, 4}, false, false, 0, {0}}, {2, 4}, AF_ERR_INVALID_ARGUMENT,
     "value: batch size 3 does not match 2 (query's 1 broadcast with key's 2)"},
    {{"gqa_query_1_key_4", {2, 1}, {2, 4}, {2, 4}, true, false, 0, {0}}, {2, 4}, AF_ERR_INVALID_ARGUMENT,
     "query: 1 heads is not a multiple of key's 4 heads (grouped-query attention: enable_gqa)"},
    {{"gqa_6_of_4", {2, 6}, {2, 4}, {2, 4}, true, false, 0, {0}}, {2, 6}, AF_ERR_INVALID_ARGUMENT,
     "query: 6 heads is not a multiple of key's 4 heads"},
    {{"gqa_value_3_of_6", {2, 6}, {2, 2}, {2, 4}, true, false, 0, {0}}, {2, 6}, AF_ERR_INVALID_ARGUMENT,
     "query: 6 heads is not a multiple of value's 4 heads"},
    {{"mask_grows_scores", {1, 4}, {1, 4}, {1, 4}, false, false, 4, {2, 4, L, S}}, {1, 4}, AF_ERR_INVALID_ARGUMENT,
     "attn_mask: shape (2, 4, 5, 7) cannot broadcast to (B, Hq, L, S) = (1, 4, 5, 7)"},
    {{"mask_batch_beyond_scores", {1, 4}, {1, 4}, {2, 4}, false, false, 4, {2, 4, L, S}}, {2, 4},
     AF_ERR_INVALID_ARGUMENT, "attn_mask: shape (2, 4, 5, 7) cannot broadcast to (B, Hq, L, S) = (1, 4, 5, 7)"},
    {{"out_not_broadcast", {2, 4}, {2, 1}, {2, 1}, false, false, 0, {0}}, {2, 1}, AF_ERR_INVALID_ARGUMENT,
     "out: expected shape (2, 4, 5, 6), got (2, 1, 5, 6)"},
    {{"out_batch_not_broadcast", {1, 4}, {2, 4}, {2, 4}, false, false, 0, {0}}, {1, 4}, AF_ERR_INVALID_ARGUMENT,
     "out: expected shape (2, 4, 5, 6), got (1, 4, 5, 6)"},
    {{"gqa_groups_2_and_4", {2, 8}, {2, 4}, {2, 2}, true, false, 0, {0}}, {2, 8}, AF_ERR_UNSUPPORTED,
     "key and value: 4 and 2 heads under query's 8"},
};

static void refused_shapes_name_the_rule_and_write_nothing(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        const shape_case *c = &refused[i].c;
        const bh o = refused[i].out;
        case_call cc;
        make_call(c, 99, &cc);
        const int64_t n = o.b * o.h * L * EV;
        float *out = malloc(sizeof(float) * (size_t)n);
        af_tensor out_t = view4(out, o, L, EV);
        af_status (*const entries[2])(const af_sdpa_args *, af_tensor *, af_tensor *) = {af_sdpa, af_sdpa_reference};
        for (int e = 0; e < 2; e++) {
            for (int64_t j = 0; j < n; j++) out[j] = 42.0f;
            const af_status st = entries[e](&cc.args, &out_t, NULL);
            if (st != refused[i].status || !strstr(af_last_error(), refused[i].message))
                fail_msg("%s: got %s \"%s\", expected %s containing \"%s\"", c->name, af_status_name(st),
                         af_last_error(), af_status_name(refused[i].status), refused[i].message);
            for (int64_t j = 0; j < n; j++)
                if (out[j] != 42.0f) fail_msg("%s: out[%lld] was written", c->name, (long long)j);
        }
        free_call(&cc);
        free(out);
    }
}

/* A view the caller broadcast itself (expand(): stride 0 along a dim longer than 1) means the same as a size-1 dim. */
static void explicit_zero_strides_match_size_one_dims(void **state) {
    (void)state;
    unsigned seed = 7;
    float *q = random_floats(2 * 4 * L * E, &seed), *k = random_floats(S * E, &seed), *v = random_floats(S * EV, &seed);
    af_tensor qt = view4(q, (bh){2, 4}, L, E);
    af_tensor k1 = view4(k, (bh){1, 1}, S, E), v1 = view4(v, (bh){1, 1}, S, EV);
    af_tensor k0 = k1, v0 = v1;
    k0.shape[0] = v0.shape[0] = 2;
    k0.shape[1] = v0.shape[1] = 4;
    k0.strides[0] = k0.strides[1] = v0.strides[0] = v0.strides[1] = 0;
    float a[2 * 4 * L * EV], b[2 * 4 * L * EV];
    af_tensor at = view4(a, (bh){2, 4}, L, EV), bt = view4(b, (bh){2, 4}, L, EV);
    af_sdpa_args one = {.query = &qt, .key = &k1, .value = &v1, .is_causal = true};
    af_sdpa_args zero = {.query = &qt, .key = &k0, .value = &v0, .is_causal = true};
    assert_int_equal(af_sdpa(&one, &at, NULL), AF_OK);
    assert_int_equal(af_sdpa(&zero, &bt, NULL), AF_OK);
    assert_true(max_abs_diff(a, b, 2 * 4 * L * EV) <= 2e-6);
    free(q); free(k); free(v);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(accepted_shapes_match_expanded_copies),
        cmocka_unit_test(refused_shapes_name_the_rule_and_write_nothing),
        cmocka_unit_test(explicit_zero_strides_match_size_one_dims),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
