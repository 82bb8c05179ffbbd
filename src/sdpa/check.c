/* The boundary: every rule of one SDPA call, checked once, with a message naming the argument and the rule. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/status.h"
#include "sdpa/check.h"
#include "sdpa/problem.h"
#include "sdpa/check_device.h"

#define AF_MAX_HEAD_DIM 1024   /* per-thread tiles grow with the head dim; beyond this they stop fitting L2 */

static const char *shape_text(const af_tensor *t, char *buf, size_t size) {
    size_t used = (size_t)snprintf(buf, size, "(");
    for (int d = 0; d < t->ndim && used < size; d++)
        used += (size_t)snprintf(buf + used, size - used, d ? ", %lld" : "%lld", (long long)t->shape[d]);
    if (used < size) snprintf(buf + used, size - used, t->ndim == 1 ? ",)" : ")");
    return buf;
}

/* Byte span of a view: [0, *bytes) from t->data, and its element count. Beyond the sizes and strides themselves, the
 * offsets the kernels and the reference form must be representable: for a view with elements, the byte offset of its
 * last element (and so every partial sum of index·stride, all terms being >= 0) and every stride in bytes (a row
 * pitch, also along a size-1 dim) fit in int64, data is aligned to the element size, and data + span does not wrap
 * the address space. A view with no elements is never addressed (its strides are replaced in the problem:
 * problem_strides), so its strides are free. */
static af_status view_span(const af_tensor *t, const char *name, int64_t *bytes, int64_t *numel) {
    if (t->ndim < 0 || t->ndim > AF_MAX_DIMS)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: ndim %d is outside 0..%d", name, t->ndim, AF_MAX_DIMS);
    const int64_t elem = (int64_t)af_dtype_size(t->dtype);
    if (elem == 0) return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: unknown dtype code %d", name, (int)t->dtype);
    int64_t last = 0, count = 1;
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] < 0)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: shape[%d] is %lld; sizes must be >= 0", name, d,
                           (long long)t->shape[d]);
        if (t->strides[d] < 0)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: stride[%d] is %lld; negative strides are not supported",
                           name, d, (long long)t->strides[d]);
        if (__builtin_mul_overflow(count, t->shape[d], &count))
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: the number of elements overflows 64 bits", name);
    }
    *bytes = 0;
    *numel = count;
    if (count == 0) return AF_OK;
    for (int d = 0; d < t->ndim; d++) {
        int64_t reach;
        if (__builtin_mul_overflow(t->shape[d] - 1, t->strides[d], &reach) ||
            __builtin_add_overflow(last, reach, &last))
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: shape and strides reach beyond 2^63 elements", name);
    }
    int64_t span, pitch;
    if (__builtin_add_overflow(last, 1, &span) || __builtin_mul_overflow(span, elem, &span))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: the view spans more than 2^63 bytes", name);
    for (int d = 0; d < t->ndim; d++)   /* a longer dim's stride is within the span; a size-1 dim's is not bounded */
        if (t->shape[d] == 1 && __builtin_mul_overflow(t->strides[d], elem, &pitch))
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: stride[%d] is %lld elements of %lld bytes: past 2^63 bytes",
                           name, d, (long long)t->strides[d], (long long)elem);
    if (!t->data)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: data is NULL but the view has %lld elements", name,
                       (long long)count);
    if ((uintptr_t)t->data % (uint64_t)elem != 0)   /* a typed access there traps on a GPU and is UB on the CPU */
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: data at %p is not aligned to its %lld-byte %s elements; a "
                       "tensor's data must start on a multiple of its element size", name, t->data, (long long)elem,
                       af_dtype_name(t->dtype));
    if ((uintptr_t)t->data > UINTPTR_MAX - (uint64_t)span)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: data at %p plus the view's %lld bytes wraps around the address "
                       "space", name, t->data, (long long)span);
    *bytes = span;
    return AF_OK;
}

/* The element strides the problem gets: the view's, or for a view with no elements zeros (nothing is ever read or
 * written through it, though the kernels form row offsets for its non-empty dims: Ev = 0 leaves S value rows) and 1
 * along the last dim, so that the paths that want a contiguous head dim take it as before. */
static void problem_strides(const af_tensor *t, int64_t numel, int64_t *strides) {
    memcpy(strides, t->strides, sizeof(int64_t) * (size_t)t->ndim);
    if (numel > 0) return;
    for (int d = 0; d < t->ndim; d++) strides[d] = d == t->ndim - 1 ? 1 : 0;
}

/* True when no two distinct indices of `t` address the same element (sufficient test: sorted strides nest). */
static bool no_self_overlap(const af_tensor *t) {
    int order[AF_MAX_DIMS], n = 0;
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] == 0) return true;   /* no elements, no overlap; view_span did not bound its strides */
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] > 1) order[n++] = d;
    for (int i = 1; i < n; i++)   /* insertion sort by stride */
        for (int j = i; j > 0 && t->strides[order[j]] < t->strides[order[j - 1]]; j--) {
            int tmp = order[j]; order[j] = order[j - 1]; order[j - 1] = tmp;
        }
    int64_t reach = 0;   /* largest offset reachable with the smaller-stride dims */
    for (int i = 0; i < n; i++) {
        const int d = order[i];
        if (t->strides[d] <= reach) return false;
        reach += (t->shape[d] - 1) * t->strides[d];
    }
    return true;
}

static bool spans_overlap(const void *a, int64_t a_bytes, const void *b, int64_t b_bytes) {
    if (a_bytes == 0 || b_bytes == 0) return false;
    uintptr_t a0 = (uintptr_t)a, b0 = (uintptr_t)b;
    return a0 < b0 + (uintptr_t)b_bytes && b0 < a0 + (uintptr_t)a_bytes;
}

static bool is_float_dtype(af_dtype d) { return d == AF_F32 || d == AF_F16 || d == AF_BF16; }

typedef struct { const char *name; const af_tensor *t; int64_t bytes, numel; } named_view;

static af_status check_shape(const af_tensor *t, const char *name, int ndim, const int64_t *want) {
    char got_text[160];
    if (t->ndim != ndim)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: expected %d dimensions, got %d", name, ndim, t->ndim);
    for (int d = 0; d < ndim; d++)
        if (t->shape[d] != want[d]) {
            af_tensor w = {.ndim = ndim};
            char want_text[160];
            memcpy(w.shape, want, sizeof(int64_t) * (size_t)ndim);
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: expected shape %s, got %s", name,
                           shape_text(&w, want_text, sizeof want_text), shape_text(t, got_text, sizeof got_text));
        }
    return AF_OK;
}

/* PyTorch's broadcasting of SDPA's batch and head dims (docs/API.md, "The broadcasting rule"): the output's sizes,
 * those of the scores q·kᵀ (an attn_mask broadcasts to them and never beyond: PyTorch adds it in place), and how the
 * kernels, which read one key/value head per group of query heads, address each head. */
typedef struct {
    int64_t B, H;                  /* the output's batch and heads */
    int64_t scores_B, scores_H;    /* q·kᵀ's */
    int64_t Hkv, group;            /* the kernels' key/value heads; query head h reads kv head h / group */
    bool k_one_head, v_one_head;   /* key's (value's) single head serves all Hkv kv heads: stride 0 */
} broadcast_shape;

/* Broadcasting two sizes: equal, or one of them 1. */
static bool broadcast_size(int64_t a, int64_t b, int64_t *out) {
    if (a != b && a != 1 && b != 1) return false;
    *out = a == 1 ? b : a;
    return true;
}

static af_status broadcast_batches(const af_tensor *q, const af_tensor *k, const af_tensor *v, broadcast_shape *s) {
    if (!broadcast_size(q->shape[0], k->shape[0], &s->scores_B))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "key: batch size %lld does not match query's %lld; batch sizes "
                       "broadcast only when equal or 1", (long long)k->shape[0], (long long)q->shape[0]);
    if (!broadcast_size(s->scores_B, v->shape[0], &s->B))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "value: batch size %lld does not match %lld (query's %lld broadcast "
                       "with key's %lld); batch sizes broadcast only when equal or 1", (long long)v->shape[0],
                       (long long)s->scores_B, (long long)q->shape[0], (long long)k->shape[0]);
    return AF_OK;
}

/* enable_gqa with unequal head counts: key's and value's heads each divide query's (PyTorch repeats each of them up
 * to Hq). The kernels take one group size for both, so unequal groups run only where one of them is a single head. */
static af_status grouped_heads(int64_t Hq, int64_t Hk, int64_t Hv, broadcast_shape *s) {
    if (Hk == 0 || Hq % Hk != 0)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "query: %lld heads is not a multiple of key's %lld heads "
                       "(grouped-query attention: enable_gqa)", (long long)Hq, (long long)Hk);
    if (Hv == 0 || Hq % Hv != 0)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "query: %lld heads is not a multiple of value's %lld heads "
                       "(grouped-query attention: enable_gqa)", (long long)Hq, (long long)Hv);
    s->H = s->scores_H = Hq;
    s->k_one_head = Hk == 1 && Hv != 1;
    s->v_one_head = Hv == 1 && Hk != 1;
    if (Hk != Hv && !s->k_one_head && !s->v_one_head)
        return af_fail(AF_ERR_UNSUPPORTED, "key and value: %lld and %lld heads under query's %lld; attnforge's kernels "
                       "read key and value with one group size, so their head counts must be equal or one of them 1 "
                       "(attnforge.scaled_dot_product_attention repeats the heads of one of them in this case)",
                       (long long)Hk, (long long)Hv, (long long)Hq);
    s->Hkv = Hk == 1 ? Hv : Hk;
    s->group = Hq / s->Hkv;
    return AF_OK;
}

/* Without enable_gqa (or with equal head counts) heads broadcast like batches: equal, or 1. */
static af_status broadcast_heads(int64_t Hq, int64_t Hk, int64_t Hv, broadcast_shape *s) {
    if (!broadcast_size(Hq, Hk, &s->scores_H))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "enable_gqa is false but query has %lld heads and key has %lld; "
                       "without it head counts broadcast only when equal or 1", (long long)Hq, (long long)Hk);
    if (!broadcast_size(s->scores_H, Hv, &s->H))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "enable_gqa is false but value has %lld heads and query/key %lld "
                       "(query's %lld broadcast with key's %lld); without it head counts broadcast only when equal "
                       "or 1", (long long)Hv, (long long)s->scores_H, (long long)Hq, (long long)Hk);
    if (Hk == Hv) {   /* shared K/V heads: one (multi-query: every query head's group) or one per output head */
        s->Hkv = Hk;
        s->group = Hk == 1 ? s->H : 1;
        return AF_OK;
    }
    s->Hkv = s->H;   /* one of key/value has a single head, the other one per output head */
    s->group = 1;
    s->k_one_head = Hk == 1;
    s->v_one_head = Hv == 1;
    return AF_OK;
}

static af_status broadcast_batch_and_heads(const af_tensor *q, const af_tensor *k, const af_tensor *v,
                                           bool enable_gqa, broadcast_shape *s) {
    memset(s, 0, sizeof *s);
    af_status st = broadcast_batches(q, k, v, s);
    if (st != AF_OK) return st;
    const int64_t Hq = q->shape[1], Hk = k->shape[1], Hv = v->shape[1];
    if (enable_gqa && !(Hq == Hk && Hk == Hv)) return grouped_heads(Hq, Hk, Hv, s);
    return broadcast_heads(Hq, Hk, Hv, s);
}

/* A size-1 batch or head dim of q/k/v that broadcasts to a longer one is read with stride 0. */
static void broadcast_strides(const af_tensor *q, const af_tensor *k, const af_tensor *v, const broadcast_shape *s,
                              af_problem *p) {
    const af_tensor *views[3] = {q, k, v};
    int64_t *strides[3] = {p->q_stride, p->k_stride, p->v_stride};
    for (int i = 0; i < 3; i++)
        if (views[i]->shape[0] == 1 && s->B != 1) strides[i][0] = 0;
    if (q->shape[1] == 1 && s->H != 1) p->q_stride[1] = 0;
    if (s->k_one_head) p->k_stride[1] = 0;
    if (s->v_one_head) p->v_stride[1] = 0;
}

/* The mask broadcasts to the scores q·kᵀ, (scores_B, scores_H, L, S), which may be smaller than the output when value
 * broadcasts them further (PyTorch adds the mask to the scores in place). */
static af_status check_mask(const af_tensor *m, const af_problem *p, af_dtype qdtype, int64_t scores_B,
                            int64_t scores_H) {
    if (m->dtype != AF_BOOL && m->dtype != qdtype)
        return af_fail(AF_ERR_UNSUPPORTED, "attn_mask: dtype %s must be bool or match query's %s", af_dtype_name(m->dtype),
                       af_dtype_name(qdtype));
    if (m->ndim > 4)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "attn_mask: expected at most 4 dimensions, got %d", m->ndim);
    const int64_t target[4] = {scores_B, scores_H, p->L, p->S};
    for (int d = 0; d < m->ndim; d++) {
        int td = 4 - m->ndim + d;   /* right-aligned, as in broadcasting */
        if (m->shape[d] != target[td] && m->shape[d] != 1) {
            char buf[160];
            return af_fail(AF_ERR_INVALID_ARGUMENT,
                           "attn_mask: shape %s cannot broadcast to (B, Hq, L, S) = (%lld, %lld, %lld, %lld)",
                           shape_text(m, buf, sizeof buf), (long long)scores_B, (long long)scores_H, (long long)p->L,
                           (long long)p->S);
        }
    }
    return AF_OK;
}

af_status af_sdpa_check(const af_sdpa_args *args, const af_tensor *out, const af_tensor *lse, af_problem *p) {
    if (!args) return af_fail(AF_ERR_INVALID_ARGUMENT, "args: must not be NULL");
    if (!out) return af_fail(AF_ERR_INVALID_ARGUMENT, "out: must not be NULL");
    memset(p, 0, sizeof *p);
    const af_tensor *q = args->query, *k = args->key, *v = args->value, *mask = args->attn_mask;
    if (!q) return af_fail(AF_ERR_INVALID_ARGUMENT, "query: must not be NULL");
    if (!k) return af_fail(AF_ERR_INVALID_ARGUMENT, "key: must not be NULL");
    if (!v) return af_fail(AF_ERR_INVALID_ARGUMENT, "value: must not be NULL");

    named_view views[6] = {{"query", q, 0, 0}, {"key", k, 0, 0}, {"value", v, 0, 0}, {"out", out, 0, 0}, {"attn_mask", mask, 0, 0}, {"lse", lse, 0, 0}};
    for (int i = 0; i < 6; i++) {
        if (!views[i].t) continue;
        af_status st = view_span(views[i].t, views[i].name, &views[i].bytes, &views[i].numel);
        if (st != AF_OK) return st;
    }
    for (int i = 0; i < 3; i++)
        if (views[i].t->ndim != 4)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: expected 4 dimensions, got %d", views[i].name, views[i].t->ndim);
    for (int i = 0; i < 3; i++)   /* float8 is af_flash_attn's (FA4's) alone: SDPA has no descales */
        if (views[i].t->dtype == AF_F8E4M3 || views[i].t->dtype == AF_F8E5M2)
            return af_fail(AF_ERR_UNSUPPORTED, "%s: dtype %s is not supported by af_sdpa; float8 K/V (or q/k/v) run "
                           "through af_flash_attn", views[i].name, af_dtype_name(views[i].t->dtype));
    if (!is_float_dtype(q->dtype))
        return af_fail(AF_ERR_UNSUPPORTED, "query: dtype %s is not supported; expected float32, float16 or bfloat16",
                       af_dtype_name(q->dtype));
    if (k->dtype != q->dtype)
        return af_fail(AF_ERR_UNSUPPORTED, "key: dtype %s does not match query's %s", af_dtype_name(k->dtype),
                       af_dtype_name(q->dtype));
    if (v->dtype != q->dtype)
        return af_fail(AF_ERR_UNSUPPORTED, "value: dtype %s does not match query's %s", af_dtype_name(v->dtype),
                       af_dtype_name(q->dtype));
    if (!(args->dropout_p == 0.0))
        return af_fail(AF_ERR_UNSUPPORTED, "dropout_p: must be 0 (attnforge is an inference library), got %g",
                       args->dropout_p);
    if (args->is_causal && args->causal_bottom_right)
        return af_fail(AF_ERR_INVALID_ARGUMENT,
                       "is_causal and causal_bottom_right: pick one alignment (top-left is SDPA's, bottom-right FlashAttention's)");
    if (mask && (args->is_causal || args->causal_bottom_right))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "attn_mask: must not be set together with a causal flag");

    const int64_t L = q->shape[2], E = q->shape[3], S = k->shape[2], Ev = v->shape[3];
    if (v->shape[2] != S)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "value: sequence length %lld does not match key's %lld",
                       (long long)v->shape[2], (long long)S);
    if (k->shape[3] != E)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "key: head dimension %lld does not match query's %lld",
                       (long long)k->shape[3], (long long)E);
    broadcast_shape shape;
    af_status st = broadcast_batch_and_heads(q, k, v, args->enable_gqa, &shape);
    if (st != AF_OK) return st;
    const int64_t B = shape.B, Hq = shape.H;
    if (E < 1) return af_fail(AF_ERR_UNSUPPORTED, "query: head dimension must be at least 1, got %lld", (long long)E);
    if (E > AF_MAX_HEAD_DIM)
        return af_fail(AF_ERR_UNSUPPORTED, "query: head dimension %lld exceeds the supported maximum %d",
                       (long long)E, AF_MAX_HEAD_DIM);
    if (Ev > AF_MAX_HEAD_DIM)
        return af_fail(AF_ERR_UNSUPPORTED, "value: head dimension %lld exceeds the supported maximum %d",
                       (long long)Ev, AF_MAX_HEAD_DIM);
    if (args->has_scale && !isfinite(args->scale))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "scale: must be finite, got %g", args->scale);
    int64_t diagonal_end;   /* af_visible_keys forms i + 1 + S - L: S of a broadcast (stride-0) key may be near 2^63 */
    if (args->causal_bottom_right && __builtin_add_overflow(L, S, &diagonal_end))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "causal_bottom_right: L = %lld query rows plus S = %lld keys pass 2^63",
                       (long long)L, (long long)S);

    const int64_t out_shape[4] = {B, Hq, L, Ev};
    st = check_shape(out, "out", 4, out_shape);
    if (st != AF_OK) return st;
    if (out->dtype != q->dtype)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "out: dtype %s does not match query's %s", af_dtype_name(out->dtype),
                       af_dtype_name(q->dtype));
    if (!no_self_overlap(out))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "out: strides make distinct elements share memory");
    if (lse) {
        const int64_t lse_shape[3] = {B, Hq, L};
        if ((st = check_shape(lse, "lse", 3, lse_shape)) != AF_OK) return st;
        if (lse->dtype != AF_F32)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "lse: dtype must be float32, got %s", af_dtype_name(lse->dtype));
        if (!no_self_overlap(lse))
            return af_fail(AF_ERR_INVALID_ARGUMENT, "lse: strides make distinct elements share memory");
        if (spans_overlap(out->data, views[3].bytes, lse->data, views[5].bytes))
            return af_fail(AF_ERR_INVALID_ARGUMENT, "lse: overlaps out's memory");
    }
    for (int o = 3; o < 6; o += 2) {   /* out and lse must not overlap any input */
        if (!views[o].t) continue;
        for (int i = 0; i < 5; i++) {
            if (i == 3 || !views[i].t) continue;
            if (spans_overlap(views[o].t->data, views[o].bytes, views[i].t->data, views[i].bytes))
                return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: overlaps %s's memory", views[o].name, views[i].name);
        }
    }

    p->dtype = p->kv_dtype = q->dtype;
    p->out_dtype = q->dtype;
    p->B = B; p->Hq = Hq; p->Hkv = shape.Hkv; p->L = L; p->S = S; p->E = E; p->Ev = Ev;
    p->group = shape.group;
    p->q = q->data; p->k = k->data; p->v = v->data; p->out = out->data;
    problem_strides(q, views[0].numel, p->q_stride);
    problem_strides(k, views[1].numel, p->k_stride);
    problem_strides(v, views[2].numel, p->v_stride);
    broadcast_strides(q, k, v, &shape, p);
    problem_strides(out, views[3].numel, p->out_stride);
    if (lse) {
        p->lse = lse->data;
        problem_strides(lse, views[5].numel, p->lse_stride);
    }
    if (mask) {
        if ((st = check_mask(mask, p, q->dtype, shape.scores_B, shape.scores_H)) != AF_OK) return st;
        p->mask = mask->data;
        p->mask_dtype = mask->dtype;
        for (int d = 0; d < mask->ndim; d++) {   /* broadcast dims, and every dim of an empty mask, never move */
            const bool still = mask->shape[d] == 1 || views[4].numel == 0;
            p->mask_stride[4 - mask->ndim + d] = still ? 0 : mask->strides[d];
        }
    }
    p->causal = args->is_causal ? AF_CAUSAL_TOP_LEFT : args->causal_bottom_right ? AF_CAUSAL_BOTTOM_RIGHT : AF_CAUSAL_NONE;
    p->scale = args->has_scale ? args->scale : 1.0 / sqrt((double)E);
    return af_sdpa_check_device(args, out, lse);
}

af_status af_check_out_as_f32(const af_sdpa_args *args, const af_tensor *out_f32, const af_tensor *lse) {
    af_tensor as_f32 = *out_f32;
    as_f32.dtype = AF_F32;
    int64_t out_bytes, numel;
    af_status st = view_span(&as_f32, "out", &out_bytes, &numel);
    if (st != AF_OK) return st;
    const named_view others[5] = {{"query", args->query, 0, 0}, {"key", args->key, 0, 0},
                                  {"value", args->value, 0, 0}, {"attn_mask", args->attn_mask, 0, 0},
                                  {"lse", lse, 0, 0}};
    for (int i = 0; i < 5; i++) {
        int64_t bytes;
        if (!others[i].t) continue;
        if ((st = view_span(others[i].t, others[i].name, &bytes, &numel)) != AF_OK) return st;
        if (spans_overlap(out_f32->data, out_bytes, others[i].t->data, bytes))
            return af_fail(AF_ERR_INVALID_ARGUMENT, "out: as the float32 the reference writes, overlaps %s's memory",
                           others[i].name);
    }
    return AF_OK;
}

/* The same rules for af_flash_attn's boundary (flash_args.c): one implementation of each. */
af_status af_view_span(const af_tensor *t, const char *name, int64_t *bytes, int64_t *numel) {
    return view_span(t, name, bytes, numel);
}
void af_problem_strides(const af_tensor *t, int64_t numel, int64_t *strides) { problem_strides(t, numel, strides); }
bool af_no_self_overlap(const af_tensor *t) { return no_self_overlap(t); }
bool af_spans_overlap(const void *a, int64_t a_bytes, const void *b, int64_t b_bytes) {
    return spans_overlap(a, a_bytes, b, b_bytes);
}
af_status af_check_shape(const af_tensor *t, const char *name, int ndim, const int64_t *want) {
    return check_shape(t, name, ndim, want);
}
