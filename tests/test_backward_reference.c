/* The reference backward (af_sdpa_backward_reference, af_flash_attn_backward_reference) against central finite
 * differences of the loss Σ dout∘out, computed by a small double-precision forward written here from the documented
 * meaning of each feature (not the library's forward: f32 outputs are too coarse to difference). Inputs are f32
 * values held exactly in double, so both sides see the same numbers; every element of dq, dk, dv and dsink is checked
 * against 1e-6 of the gradient's largest magnitude (finite differences at h = 1e-5 err ~1e-9; f32 rounding 6e-8).
 * Covers sdpa (bool, additive and broadcast masks, both causal alignments with L != S, GQA, Ev != E, scale) and flash
 * (windows with a negative side, causal + window, softcap at large scores, sinks with dsink, varlen cu_seqlens_q/k,
 * seqused_k, an empty sequence). */
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
#include "case_gen.h"
#include "test_tensor.h"

#define MAXB 4
#define STEP 1e-5
#define TOLERANCE 1e-6

typedef enum { API_SDPA, API_FLASH } api_kind;

typedef struct {
    api_kind api;
    int64_t B, Hq, Hkv, E, Ev;
    int64_t L, S;                       /* fixed lengths (varlen: the longest sequence's) */
    bool varlen_q, varlen_k;
    int32_t cu_q[MAXB + 1], cu_k[MAXB + 1];
    bool seqused;
    int32_t used[MAXB];
    int causal;                         /* sdpa: 1 top-left, 2 bottom-right; flash: nonzero = causal */
    bool has_window;
    int64_t left, right;
    bool has_scale;
    double scale, softcap;
    bool sink;
    mask_kind mask;
    const char *mask_shape;             /* letters of (B, Hq, L, S), right-aligned; '1' broadcasts */
    double amplitude;
    uint64_t seed;
} grad_case;

/* One tensor in double (the finite differences move these) and its f32 twin the library reads; row-major. */
typedef struct {
    int ndim;
    int64_t shape[4], numel;
    double *x;
    test_tensor t;
} dense;

typedef struct {
    grad_case c;
    dense q, k, v, dout, sink, mask;
    test_tensor out, lse, cu_q, cu_k, used, dq, dk, dv, dsink;
    af_sdpa_args sdpa;
    af_flash_args flash;
} grad_call;

/* ---------------------------------------------------------------- the double forward, from the documented meaning */

typedef struct { int64_t q0, L, k0, S; } sequence;

static sequence sequence_of(const grad_case *c, int64_t b) {
    sequence s = {0, c->L, 0, c->S};
    if (c->varlen_q) s.q0 = c->cu_q[b], s.L = c->cu_q[b + 1] - c->cu_q[b];
    if (c->varlen_k) s.k0 = c->cu_k[b], s.S = c->cu_k[b + 1] - c->cu_k[b];
    if (c->seqused) s.S = c->used[b];
    return s;
}

/* Flat index of element e of row `row` (the packed row for varlen), head h, batch b of a q/k/v/out-like tensor. */
static int64_t flat(const grad_case *c, bool packed, int64_t heads, int64_t rows, int64_t dim, int64_t b, int64_t h,
                    int64_t row, int64_t e) {
    if (c->api == API_SDPA) return ((b * heads + h) * rows + row) * dim + e;
    if (packed) return (row * heads + h) * dim + e;
    return ((b * rows + row) * heads + h) * dim + e;
}

static int64_t total_q(const grad_case *c) { return c->varlen_q ? c->cu_q[c->B] : c->L; }
static int64_t total_k(const grad_case *c) { return c->varlen_k ? c->cu_k[c->B] : c->S; }

/* Row i of a sequence with L rows and S keys sees key j: SDPA's causal alignments, FA4's literal window sides
 * (causal = right side 0; both sides bounded with left + right < 0 = no window). */
static bool visible(const grad_case *c, int64_t L, int64_t S, int64_t i, int64_t j) {
    const int64_t diagonal = i + S - L;
    if (c->api == API_SDPA) return c->causal == 1 ? j <= i : c->causal == 2 ? j <= diagonal : true;
    int64_t left = c->has_window ? c->left : AF_WINDOW_UNBOUNDED, right = c->has_window ? c->right : AF_WINDOW_UNBOUNDED;
    if (c->causal) right = 0;
    if (left != AF_WINDOW_UNBOUNDED && right != AF_WINDOW_UNBOUNDED && left + right < 0)
        left = AF_WINDOW_UNBOUNDED, right = c->causal ? 0 : AF_WINDOW_UNBOUNDED;
    if (left != AF_WINDOW_UNBOUNDED && j < diagonal - left) return false;
    if (right != AF_WINDOW_UNBOUNDED && j > diagonal + right) return false;
    return true;
}

/* The mask's value at (b, h, i, j) through its broadcast shape. */
static double mask_at(const grad_call *g, int64_t b, int64_t h, int64_t i, int64_t j) {
    const int64_t full[4] = {b, h, i, j};
    int64_t at = 0;
    for (int d = 0; d < g->mask.ndim; d++) {
        const int fd = 4 - g->mask.ndim + d;
        at = at * g->mask.shape[d] + (g->mask.shape[d] == 1 ? 0 : full[fd]);
    }
    return g->mask.x[at];
}

static double score_of(const grad_call *g, int64_t b, int64_t h, const sequence *s, int64_t i, int64_t j) {
    const grad_case *c = &g->c;
    const int64_t hk = h / (c->Hq / c->Hkv);
    double dot = 0.0;
    for (int64_t e = 0; e < c->E; e++)
        dot += g->q.x[flat(c, c->varlen_q, c->Hq, c->L, c->E, b, h, s->q0 + i, e)] *
               g->k.x[flat(c, c->varlen_k, c->Hkv, c->S, c->E, b, hk, s->k0 + j, e)];
    double score = (c->has_scale ? c->scale : 1.0 / sqrt((double)c->E)) * dot;
    if (c->softcap > 0.0) score = c->softcap * tanh(score / c->softcap);
    if (!visible(c, s->L, s->S, i, j)) return -INFINITY;
    if (c->mask == MASK_BOOL) return mask_at(g, b, h, i, j) != 0.0 ? score : -INFINITY;
    if (c->mask == MASK_ADDITIVE) return score + mask_at(g, b, h, i, j);
    return score;
}

/* Σ dout∘out over one row: softmax over the visible keys and the sink (denominator only), out = Σ p_j v_j. */
static double row_loss(const grad_call *g, int64_t b, int64_t h, const sequence *s, int64_t i, double *scores) {
    const grad_case *c = &g->c;
    const int64_t hk = h / (c->Hq / c->Hkv);
    const double sink = c->sink ? g->sink.x[h] : -INFINITY;
    double row_max = sink;
    for (int64_t j = 0; j < s->S; j++) {
        scores[j] = score_of(g, b, h, s, i, j);
        if (scores[j] > row_max) row_max = scores[j];
    }
    if (row_max == -INFINITY) return 0.0;
    double sum = exp(sink - row_max), loss = 0.0;
    for (int64_t j = 0; j < s->S; j++) sum += exp(scores[j] - row_max);
    for (int64_t j = 0; j < s->S; j++) {
        const double p = exp(scores[j] - row_max) / sum;
        if (p == 0.0) continue;
        for (int64_t e = 0; e < c->Ev; e++)
            loss += p * g->v.x[flat(c, c->varlen_k, c->Hkv, c->S, c->Ev, b, hk, s->k0 + j, e)] *
                    g->dout.x[flat(c, c->varlen_q, c->Hq, c->L, c->Ev, b, h, s->q0 + i, e)];
    }
    return loss;
}

static double loss(const grad_call *g) {
    const grad_case *c = &g->c;
    double *scores = malloc(sizeof(double) * (size_t)(c->S + 1)), total = 0.0;
    for (int64_t b = 0; b < c->B; b++) {
        const sequence s = sequence_of(c, b);
        for (int64_t h = 0; h < c->Hq; h++)
            for (int64_t i = 0; i < s.L; i++) total += row_loss(g, b, h, &s, i, scores);
    }
    free(scores);
    return total;
}

/* ---------------------------------------------------------------- the library's call */

static bool dense_alloc(dense *d, int ndim, const int64_t *shape, test_rng *rng) {
    memset(d, 0, sizeof *d);
    d->ndim = ndim;
    d->numel = 1;
    for (int i = 0; i < ndim; i++) d->shape[i] = shape[i], d->numel *= shape[i];
    d->x = calloc((size_t)(d->numel > 0 ? d->numel : 1), sizeof(double));
    return d->x && tt_alloc(&d->t, AF_F32, ndim, shape, LAYOUT_CONTIGUOUS, rng);
}

/* Values exact in f32, the same in x and in the f32 tensor. */
static void dense_fill(dense *d, test_rng *rng, double amplitude) {
    for (int64_t f = 0; f < d->numel; f++) d->x[f] = (float)(amplitude * (2.0 * rng_uniform(rng) - 1.0));
}

static void dense_sync(dense *d) {
    if (d->numel == 0) return;
    int64_t idx[4] = {0}, f = 0;
    do tt_set(&d->t, idx, d->x[f++]);
    while (tt_next_index(d->ndim, d->shape, idx));
}

static void dense_free(dense *d) {
    free(d->x);
    tt_free(&d->t);
}

static void tensor_shape(const grad_case *c, bool packed, int64_t heads, int64_t rows, int64_t dim, int *ndim,
                         int64_t *shape) {
    const int64_t sdpa[4] = {c->B, heads, rows, dim}, fixed[4] = {c->B, rows, heads, dim}, varlen[3] = {rows, heads, dim};
    *ndim = c->api == API_FLASH && packed ? 3 : 4;
    memcpy(shape, c->api == API_SDPA ? sdpa : packed ? varlen : fixed, sizeof(int64_t) * (size_t)*ndim);
}

static bool alloc_like(const grad_case *c, bool packed, int64_t heads, int64_t rows, int64_t dim, dense *d,
                       test_rng *rng) {
    int ndim;
    int64_t shape[4];
    tensor_shape(c, packed, heads, rows, dim, &ndim, shape);
    return dense_alloc(d, ndim, shape, rng);
}

static bool alloc_grad(const dense *like, test_tensor *t, test_rng *rng) {
    return tt_alloc(t, AF_F32, like->ndim, like->shape, LAYOUT_CONTIGUOUS, rng);
}

static bool alloc_i32(test_tensor *t, int64_t n, const int32_t *values, test_rng *rng) {
    if (!tt_alloc(t, AF_I32, 1, &n, LAYOUT_CONTIGUOUS, rng)) return false;
    for (int64_t i = 0; i < n; i++) tt_set(t, &i, values[i]);
    return true;
}

static bool build_mask(grad_call *g, test_rng *rng) {
    const grad_case *c = &g->c;
    int64_t shape[4];
    const int ndim = (int)strlen(c->mask_shape);
    for (int d = 0; d < ndim; d++) {
        const char l = c->mask_shape[d];
        shape[d] = l == 'B' ? c->B : l == 'H' ? c->Hq : l == 'L' ? c->L : l == 'S' ? c->S : 1;
    }
    if (!dense_alloc(&g->mask, ndim, shape, rng)) return false;
    tt_free(&g->mask.t);
    if (!tt_alloc(&g->mask.t, c->mask == MASK_BOOL ? AF_BOOL : AF_F32, ndim, shape, LAYOUT_CONTIGUOUS, rng)) return false;
    for (int64_t f = 0; f < g->mask.numel; f++) {
        const bool keep = rng_chance(rng, 0.7);
        g->mask.x[f] = c->mask == MASK_BOOL ? keep : keep ? (float)(2.0 * rng_uniform(rng) - 1.0) : -INFINITY;
    }
    if (g->mask.numel >= (int64_t)c->S && ndim >= 2 && shape[ndim - 1] == c->S)   /* one whole row masked */
        for (int64_t j = 0; j < c->S; j++) g->mask.x[j] = c->mask == MASK_BOOL ? 0.0 : -INFINITY;
    dense_sync(&g->mask);
    g->sdpa.attn_mask = &g->mask.t.view;
    return true;
}

static bool build(const grad_case *c, grad_call *g) {
    memset(g, 0, sizeof *g);
    g->c = *c;
    test_rng rng = {c->seed};
    const int64_t tq = total_q(c), tk = total_k(c);
    if (!alloc_like(c, c->varlen_q, c->Hq, tq, c->E, &g->q, &rng) ||
        !alloc_like(c, c->varlen_k, c->Hkv, tk, c->E, &g->k, &rng) ||
        !alloc_like(c, c->varlen_k, c->Hkv, tk, c->Ev, &g->v, &rng) ||
        !alloc_like(c, c->varlen_q, c->Hq, tq, c->Ev, &g->dout, &rng) ||
        !tt_alloc(&g->out, AF_F32, g->dout.ndim, g->dout.shape, LAYOUT_CONTIGUOUS, &rng) ||
        !alloc_grad(&g->q, &g->dq, &rng) || !alloc_grad(&g->k, &g->dk, &rng) || !alloc_grad(&g->v, &g->dv, &rng))
        return false;
    const int64_t lse_fixed[3] = {c->B, c->Hq, c->L}, lse_varlen[2] = {c->Hq, tq};
    if (!tt_alloc(&g->lse, AF_F32, c->varlen_q ? 2 : 3, c->varlen_q ? lse_varlen : lse_fixed, LAYOUT_CONTIGUOUS, &rng))
        return false;
    dense *inputs[4] = {&g->q, &g->k, &g->v, &g->dout};
    for (int i = 0; i < 4; i++) {
        dense_fill(inputs[i], &rng, i == 3 ? 1.0 : c->amplitude);
        dense_sync(inputs[i]);
    }
    if (c->api == API_SDPA) {
        g->sdpa = (af_sdpa_args){.query = &g->q.t.view, .key = &g->k.t.view, .value = &g->v.t.view,
                                 .is_causal = c->causal == 1, .causal_bottom_right = c->causal == 2,
                                 .has_scale = c->has_scale, .scale = c->scale, .enable_gqa = c->Hq != c->Hkv};
        return c->mask == MASK_NONE || build_mask(g, &rng);
    }
    g->flash = (af_flash_args){.query = &g->q.t.view, .key = &g->k.t.view, .value = &g->v.t.view,
                               .has_scale = c->has_scale, .scale = c->scale, .causal = c->causal != 0,
                               .has_window = c->has_window, .window_left = c->left, .window_right = c->right,
                               .softcap = c->softcap, .max_seqlen_q = c->L, .max_seqlen_k = c->S};
    if (c->sink) {
        const int64_t hs[1] = {c->Hq};
        if (!dense_alloc(&g->sink, 1, hs, &rng) || !tt_alloc(&g->dsink, AF_F32, 1, hs, LAYOUT_CONTIGUOUS, &rng))
            return false;
        dense_fill(&g->sink, &rng, 2.0);
        dense_sync(&g->sink);
        g->flash.learnable_sink = &g->sink.t.view;
    }
    if (c->varlen_q) {
        if (!alloc_i32(&g->cu_q, c->B + 1, c->cu_q, &rng)) return false;
        g->flash.cu_seqlens_q = &g->cu_q.view;
    }
    if (c->varlen_k) {
        if (!alloc_i32(&g->cu_k, c->B + 1, c->cu_k, &rng)) return false;
        g->flash.cu_seqlens_k = &g->cu_k.view;
    }
    if (c->seqused) {
        if (!alloc_i32(&g->used, c->B, c->used, &rng)) return false;
        g->flash.seqused_k = &g->used.view;
    }
    return true;
}

static void release(grad_call *g) {
    dense *d[] = {&g->q, &g->k, &g->v, &g->dout, &g->sink, &g->mask};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++) dense_free(d[i]);
    test_tensor *t[] = {&g->out, &g->lse, &g->cu_q, &g->cu_k, &g->used, &g->dq, &g->dk, &g->dv, &g->dsink};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) tt_free(t[i]);
}

/* The forward reference writes out and lse (checked, not read, by the backward), then the reference backward. */
static void run_reference_backward(grad_call *g) {
    af_backward_inputs in = {.out = &g->out.view, .dout = &g->dout.t.view, .lse = &g->lse.view};
    af_gradients grads = {.dq = &g->dq.view, .dk = &g->dk.view, .dv = &g->dv.view,
                          .dsink = g->c.sink ? &g->dsink.view : NULL};
    af_status st;
    if (g->c.api == API_SDPA) {
        if (af_sdpa_reference(&g->sdpa, &g->out.view, &g->lse.view) != AF_OK) fail_msg("forward: %s", af_last_error());
        st = af_sdpa_backward_reference(&g->sdpa, &in, &grads);
    } else {
        if (af_flash_attn_reference(&g->flash, &g->out.view, &g->lse.view) != AF_OK)
            fail_msg("forward: %s", af_last_error());
        st = af_flash_attn_backward_reference(&g->flash, &in, &grads);
    }
    if (st != AF_OK) fail_msg("reference backward: %s: %s", af_status_name(st), af_last_error());
}

/* Every element of `grad` against (loss(x + h) - loss(x - h)) / 2h, moving x's element in double. */
static void check_gradient(grad_call *g, dense *x, const test_tensor *grad, const char *name) {
    if (x->numel == 0) return;
    double *fd = malloc(sizeof(double) * (size_t)x->numel), largest = 0.0;
    for (int64_t f = 0; f < x->numel; f++) {
        const double x0 = x->x[f];
        x->x[f] = x0 + STEP;
        const double up = loss(g);
        x->x[f] = x0 - STEP;
        const double down = loss(g);
        x->x[f] = x0;
        fd[f] = (up - down) / (2.0 * STEP);
        largest = fmax(largest, fabs(fd[f]));
    }
    int64_t idx[4] = {0}, f = 0;
    do {
        const double got = tt_get(grad, idx), want = fd[f++];
        const double bound = TOLERANCE * (largest + fabs(want)) + 1e-12;
        if (!(fabs(got - want) <= bound))
            fail_msg("%s[%lld,%lld,%lld,%lld] = %.9g, finite difference %.9g (|error| %.3g > %.3g)", name,
                     (long long)idx[0], (long long)idx[1], (long long)idx[2], (long long)idx[3], got, want,
                     fabs(got - want), bound);
    } while (tt_next_index(x->ndim, x->shape, idx));
    free(fd);
}

/* The check's own power: a gradient that is all zero would pass a bound relative to itself, so the case must move
 * the loss through every input it checks. */
static void check_case(const grad_case *c) {
    grad_call g;
    assert_true(build(c, &g));
    run_reference_backward(&g);
    check_gradient(&g, &g.q, &g.dq, "dq");
    check_gradient(&g, &g.k, &g.dk, "dk");
    check_gradient(&g, &g.v, &g.dv, "dv");
    if (c->sink) check_gradient(&g, &g.sink, &g.dsink, "dsink");
    double dq_abs, dq_norm;
    tt_magnitudes(&g.dq, &dq_abs, &dq_norm);
    assert_true(dq_abs > 1e-3);
    if (c->sink) {
        double ds_abs, ds_norm;
        tt_magnitudes(&g.dsink, &ds_abs, &ds_norm);
        assert_true(ds_abs > 1e-3);
    }
    release(&g);
}

/* ---------------------------------------------------------------- the cases */

static grad_case sdpa_case_of(int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t E, int64_t Ev) {
    return (grad_case){.api = API_SDPA, .B = B, .Hq = Hq, .Hkv = Hkv, .L = L, .S = S, .E = E, .Ev = Ev,
                       .amplitude = 1.0, .seed = 11};
}

static grad_case flash_case_of(int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t E, int64_t Ev) {
    grad_case c = sdpa_case_of(B, Hq, Hkv, L, S, E, Ev);
    c.api = API_FLASH;
    c.left = c.right = AF_WINDOW_UNBOUNDED;
    return c;
}

static void sdpa_plain_ev_differs(void **state) {
    (void)state;
    check_case(&(grad_case){.api = API_SDPA, .B = 2, .Hq = 2, .Hkv = 2, .L = 3, .S = 5, .E = 4, .Ev = 3,
                            .amplitude = 1.0, .seed = 1});
}

static void sdpa_bool_mask_and_scale(void **state) {
    (void)state;
    grad_case c = sdpa_case_of(2, 2, 2, 4, 5, 3, 3);
    c.mask = MASK_BOOL, c.mask_shape = "BHLS", c.has_scale = true, c.scale = 0.7;
    check_case(&c);
}

static void sdpa_additive_broadcast_mask_gqa(void **state) {
    (void)state;
    grad_case c = sdpa_case_of(2, 4, 2, 4, 6, 3, 2);
    c.mask = MASK_ADDITIVE, c.mask_shape = "LS", c.amplitude = 1.5;   /* -inf entries and a whole row */
    check_case(&c);
}

static void sdpa_head_broadcast_mask(void **state) {
    (void)state;
    grad_case c = sdpa_case_of(2, 3, 3, 3, 4, 2, 3);
    c.mask = MASK_BOOL, c.mask_shape = "B1LS", c.has_scale = true, c.scale = -0.9;
    check_case(&c);
}

static void sdpa_top_left_more_rows_than_keys(void **state) {
    (void)state;
    grad_case c = sdpa_case_of(2, 2, 2, 5, 3, 3, 2);
    c.causal = 1;
    check_case(&c);
}

static void sdpa_top_left_more_keys_than_rows_mqa(void **state) {
    (void)state;
    grad_case c = sdpa_case_of(1, 3, 1, 3, 6, 2, 2);
    c.causal = 1;
    check_case(&c);
}

static void sdpa_bottom_right_both_ways_gqa(void **state) {
    (void)state;
    grad_case c = sdpa_case_of(1, 4, 2, 5, 3, 3, 4);   /* L > S: the first two rows see no key */
    c.causal = 2;
    check_case(&c);
    c = sdpa_case_of(2, 2, 1, 3, 5, 3, 2);
    c.causal = 2, c.amplitude = 2.0;
    check_case(&c);
}

static void flash_window_softcap_sink(void **state) {
    (void)state;
    grad_case c = flash_case_of(2, 2, 1, 4, 6, 4, 3);
    c.has_window = true, c.left = 2, c.right = 1, c.softcap = 2.0, c.amplitude = 2.5, c.sink = true;
    check_case(&c);
}

static void flash_negative_window_side(void **state) {
    (void)state;
    grad_case c = flash_case_of(1, 2, 2, 5, 5, 3, 3);
    c.has_window = true, c.left = 3, c.right = -1, c.sink = true;   /* keys strictly before the diagonal */
    check_case(&c);
}

static void flash_causal_window_left(void **state) {
    (void)state;
    grad_case c = flash_case_of(1, 2, 2, 3, 6, 3, 2);
    c.causal = 1, c.has_window = true, c.left = 1, c.right = AF_WINDOW_UNBOUNDED, c.softcap = 1.0, c.amplitude = 2.0;
    check_case(&c);
}

static void flash_varlen_gqa_softcap_sink(void **state) {
    (void)state;
    grad_case c = flash_case_of(3, 4, 2, 3, 4, 3, 2);
    c.varlen_q = c.varlen_k = true;
    const int32_t cu_q[4] = {0, 2, 2, 5}, cu_k[4] = {0, 4, 5, 8};   /* sequence 1 has no query rows */
    memcpy(c.cu_q, cu_q, sizeof cu_q);
    memcpy(c.cu_k, cu_k, sizeof cu_k);
    c.causal = 1, c.softcap = 3.0, c.amplitude = 2.0, c.sink = true;
    check_case(&c);
}

static void flash_seqused_bottom_right(void **state) {
    (void)state;
    grad_case c = flash_case_of(2, 2, 2, 3, 5, 3, 3);
    c.seqused = true, c.used[0] = 4, c.used[1] = 1, c.causal = 1, c.sink = true;
    check_case(&c);
}

static void flash_varlen_k_seqused_empty_keys(void **state) {
    (void)state;
    grad_case c = flash_case_of(2, 2, 2, 3, 4, 2, 3);
    c.varlen_k = true;
    const int32_t cu_k[3] = {0, 4, 7};
    memcpy(c.cu_k, cu_k, sizeof cu_k);
    c.seqused = true, c.used[0] = 0, c.used[1] = 3, c.sink = true, c.has_window = true, c.left = 0, c.right = 2;
    check_case(&c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(sdpa_plain_ev_differs),
        cmocka_unit_test(sdpa_bool_mask_and_scale),
        cmocka_unit_test(sdpa_additive_broadcast_mask_gqa),
        cmocka_unit_test(sdpa_head_broadcast_mask),
        cmocka_unit_test(sdpa_top_left_more_rows_than_keys),
        cmocka_unit_test(sdpa_top_left_more_keys_than_rows_mqa),
        cmocka_unit_test(sdpa_bottom_right_both_ways_gqa),
        cmocka_unit_test(flash_window_softcap_sink),
        cmocka_unit_test(flash_negative_window_side),
        cmocka_unit_test(flash_causal_window_left),
        cmocka_unit_test(flash_varlen_gqa_softcap_sink),
        cmocka_unit_test(flash_seqused_bottom_right),
        cmocka_unit_test(flash_varlen_k_seqused_empty_keys),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
