/* af_flash_attn's boundary: every rule of an af_flash_args call, checked once (FlashAttention-4's wording where it
 * has one), and the checked af_problem the driver and the reference share. NHD tensors become the problem's
 * (B, H, seq, dim) strides by permutation; varlen and paged K/V keep their int32 arrays, which are read here to
 * check them on the CPU (on CUDA only their shapes: the kernels check the values), and later by the kernels per
 * sequence. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/alloc.h"
#include "core/status.h"
#include "sdpa/check.h"
#include "sdpa/problem.h"

#define AF_MAX_HEAD_DIM 1024   /* as af_sdpa (check.c) */

enum { V_Q, V_K, V_V, V_SINK, V_CU_Q, V_CU_K, V_SEQUSED, V_PAGES, V_Q_DESCALE, V_K_DESCALE, V_V_DESCALE, V_OUT, V_LSE,
       V_COUNT };
#define V_INPUTS V_OUT   /* views before this one are read, the others written */

typedef struct { const char *name; const af_tensor *t; int64_t bytes, numel; } flash_view;

static bool is_float_dtype(af_dtype d) { return d == AF_F32 || d == AF_F16 || d == AF_BF16; }
static bool is_f8(af_dtype d) { return d == AF_F8E4M3 || d == AF_F8E5M2; }

/* q, k, v dtypes: one float dtype for all three; or K/V in one float8 format under a float q (a quantised KV cache,
 * attnforge's extension); or all three in one float8 format (FA4's fp8). */
static af_status check_dtypes(const af_tensor *q, const af_tensor *k, const af_tensor *v) {
    if (!is_float_dtype(q->dtype) && !is_f8(q->dtype))
        return af_fail(AF_ERR_UNSUPPORTED, "query: dtype %s is not supported; expected float32, float16, bfloat16, "
                       "float8_e4m3fn or float8_e5m2", af_dtype_name(q->dtype));
    if (is_f8(q->dtype) && k->dtype != q->dtype)
        return af_fail(AF_ERR_UNSUPPORTED, "key: dtype %s does not match query's %s (q, k, v, and qv must have the "
                       "same dtype)", af_dtype_name(k->dtype), af_dtype_name(q->dtype));
    if (k->dtype != q->dtype && !is_f8(k->dtype))
        return af_fail(AF_ERR_UNSUPPORTED, "key: dtype %s does not match query's %s (q, k and v must have the same "
                       "dtype; or k and v float8 under a float query)", af_dtype_name(k->dtype),
                       af_dtype_name(q->dtype));
    if (v->dtype != k->dtype)
        return af_fail(AF_ERR_UNSUPPORTED, "value: dtype %s does not match key's %s (k and v must have the same dtype)",
                       af_dtype_name(v->dtype), af_dtype_name(k->dtype));
    return AF_OK;
}

/* q/k/v_descale: only with float8 K/V (FA4's message); f32 (B, Hkv) (aligned: af_view_span's rule for every view). */
static af_status check_descales(const af_flash_args *a, int64_t B, int64_t Hkv) {
    const af_tensor *d[3] = {a->q_descale, a->k_descale, a->v_descale};
    static const char *const names[3] = {"q_descale", "k_descale", "v_descale"};
    for (int i = 0; i < 3; i++) {
        if (!d[i]) continue;
        if (!is_f8(a->key->dtype))
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: q_descale/k_descale/v_descale are only supported for FP8 "
                           "inputs (key is %s)", names[i], af_dtype_name(a->key->dtype));
        if (d[i]->dtype != AF_F32)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: dtype must be float32, got %s", names[i],
                           af_dtype_name(d[i]->dtype));
        const int64_t want[2] = {B, Hkv};
        af_status st = af_check_shape(d[i], names[i], 2, want);
        if (st != AF_OK) return st;
    }
    return AF_OK;
}

static int32_t at32(const af_tensor *t, int64_t i) { return ((const int32_t *)t->data)[i * t->strides[0]]; }

/* An int32 index array: dtype, ndim and entries of its own (4-byte alignment is af_view_span's rule for every view). A
 * broadcast (stride 0) dim is refused: every entry is read once, so a stride-0 view of 2^48 entries in 4 bytes
 * would keep the checks busy for days (found by fuzz_flash_args). */
static af_status check_int32(const af_tensor *t, const char *name, int ndim) {
    if (t->dtype != AF_I32)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: must be int32, got %s", name, af_dtype_name(t->dtype));
    if (t->ndim != ndim)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: expected %d dimension%s, got %d", name, ndim, ndim == 1 ? "" : "s",
                       t->ndim);
    for (int d = 0; d < ndim; d++)
        if (t->shape[d] > 1 && t->strides[d] == 0)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: stride[%d] is 0 over %lld entries; an index array holds each "
                           "of its entries (pass a contiguous copy, not a broadcast view)", name, d,
                           (long long)t->shape[d]);
    return AF_OK;
}

/* cu_seqlens' dtype and shape (B + 1,): what a host can check without reading device memory. */
static af_status check_cu_seqlens_shape(const af_tensor *cu, const char *name, int64_t B) {
    af_status st = check_int32(cu, name, 1);
    if (st != AF_OK) return st;
    if (cu->shape[0] != B + 1)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: must have shape (batch_size + 1,) = (%lld,), got (%lld,)", name,
                       (long long)(B + 1), (long long)cu->shape[0]);
    return AF_OK;
}

/* cu_seqlens: shape (B + 1,), first 0, non-decreasing, last == the packed tensor's rows. */
static af_status check_cu_seqlens(const af_tensor *cu, const char *name, int64_t B, int64_t total, const char *of) {
    af_status st = check_cu_seqlens_shape(cu, name, B);
    if (st != AF_OK) return st;
    if (at32(cu, 0) != 0) return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: must start at 0, got %d", name, at32(cu, 0));
    for (int64_t b = 0; b < B; b++)
        if (at32(cu, b + 1) < at32(cu, b))
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: must be non-decreasing, but [%lld] = %d < [%lld] = %d", name,
                           (long long)(b + 1), at32(cu, b + 1), (long long)b, at32(cu, b));
    if (at32(cu, B) != total)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: last entry %d must equal %s's %lld rows", name, at32(cu, B), of,
                       (long long)total);
    return AF_OK;
}

/* seqused_k's dtype and shape (B,). */
static af_status check_seqused_shape(const af_tensor *used, int64_t B) {
    af_status st = check_int32(used, "seqused_k", 1);
    if (st != AF_OK) return st;
    if (used->shape[0] != B)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "seqused_k: must have shape (batch_size,) = (%lld,), got (%lld,)",
                       (long long)B, (long long)used->shape[0]);
    return AF_OK;
}

/* Devices first: every tensor on the query's device (on CUDA the int32 arrays are device memory, whose values the
 * kernels check: cuda_sequence_bounds). */
static af_status check_devices(const flash_view *views) {
    const af_device d = views[V_Q].t->device;
    for (int i = 0; i < V_COUNT; i++) {
        const af_tensor *t = views[i].t;
        if (!t) continue;
        if (t->device.type != AF_DEVICE_CPU && t->device.type != AF_DEVICE_CUDA)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: unknown device type %d", views[i].name, (int)t->device.type);
        if (t->device.type != d.type || (d.type == AF_DEVICE_CUDA && t->device.index != d.index))
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: on %s:%d, but query is on %s:%d; every tensor of a call "
                           "must be on one device", views[i].name, t->device.type == AF_DEVICE_CUDA ? "cuda" : "cpu",
                           t->device.index, d.type == AF_DEVICE_CUDA ? "cuda" : "cpu", d.index);
    }
    return AF_OK;
}

/* left + right < 0 for any two int64 sides (their sum may not fit). */
static bool window_sum_negative(int64_t left, int64_t right) {
    if (left < 0 && right < 0) return true;
    if (left >= 0 && right >= 0) return false;
    return left + right < 0;   /* opposite signs: no overflow */
}

/* FA4's window normalisation (_resolve_causal_local_window): sides are literal offsets, negative ones too, and
 * AF_WINDOW_UNBOUNDED (FA4's None) alone is unbounded; causal sets right = 0; a window whose sides are both bounded
 * and sum to < 0 is dropped (causal alone then still limits the right). */
static void set_window(const af_flash_args *a, af_problem *p) {
    int64_t left = AF_WINDOW_UNBOUNDED, right = AF_WINDOW_UNBOUNDED;
    if (a->has_window) {
        left = a->window_left;
        right = a->window_right;
    }
    if (a->causal) right = 0;
    if (left != AF_WINDOW_UNBOUNDED && right != AF_WINDOW_UNBOUNDED && window_sum_negative(left, right)) {
        left = AF_WINDOW_UNBOUNDED;
        right = a->causal ? 0 : AF_WINDOW_UNBOUNDED;
    }
    p->causal = AF_CAUSAL_NONE;   /* causality is the window's right edge */
    p->has_window = left != AF_WINDOW_UNBOUNDED || right != AF_WINDOW_UNBOUNDED;
    p->window_left = left;
    p->window_right = right;
}

static af_status check_scalars(const af_flash_args *a) {
    if (a->has_scale && !isfinite(a->scale))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "scale: must be finite, got %g", a->scale);
    if (!(isfinite(a->softcap) && a->softcap >= 0.0))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "softcap: must be finite and >= 0 (0 = off), got %g", a->softcap);
    if (a->max_seqlen_q < 0)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "max_seqlen_q: must be >= 0, got %lld", (long long)a->max_seqlen_q);
    if (a->max_seqlen_k < 0)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "max_seqlen_k: must be >= 0, got %lld", (long long)a->max_seqlen_k);
    return AF_OK;
}

typedef struct {
    bool varlen_q, varlen_k, paged;
    int64_t B, Hq, Hkv, E, Ev, total_q, Lq, page_size, num_pages, max_pages;
} flash_shape;

/* Dims, dtypes and shapes of q, k, v and the index arrays' shapes; B from whichever tensor is batched. */
static af_status check_layout(const af_flash_args *a, flash_shape *s) {
    const af_tensor *q = a->query, *k = a->key, *v = a->value;
    s->varlen_q = a->cu_seqlens_q != NULL;
    s->varlen_k = a->cu_seqlens_k != NULL;
    s->paged = a->page_table != NULL;
    if (s->paged && s->varlen_k)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "page_table: is not supported with cu_seqlens_k");
    const int q_ndim = s->varlen_q ? 3 : 4, k_ndim = s->varlen_k ? 3 : 4;
    const char *q_form = s->varlen_q ? "(total_q, Hq, E) with cu_seqlens_q" : "(B, Lq, Hq, E)";
    const char *k_form = s->paged ? "(num_pages, page_size, Hkv, E) with page_table"
                         : s->varlen_k ? "(total_k, Hkv, E) with cu_seqlens_k" : "(B, S, Hkv, E)";
    if (q->ndim != q_ndim)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "query: expected %d dimensions %s, got %d", q_ndim, q_form, q->ndim);
    if (k->ndim != k_ndim)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "key: expected %d dimensions %s, got %d", k_ndim, k_form, k->ndim);
    if (v->ndim != k_ndim)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "value: expected %d dimensions as key, got %d", k_ndim, v->ndim);
    af_status dt = check_dtypes(q, k, v);
    if (dt != AF_OK) return dt;
    s->Hq = q->shape[q_ndim - 2];
    s->E = q->shape[q_ndim - 1];
    s->Hkv = k->shape[k_ndim - 2];
    s->Ev = v->shape[k_ndim - 1];
    s->total_q = s->varlen_q ? q->shape[0] : 0;
    s->Lq = s->varlen_q ? 0 : q->shape[1];
    for (int d = 0; d < k_ndim - 1; d++)
        if (v->shape[d] != k->shape[d])
            return af_fail(AF_ERR_INVALID_ARGUMENT, "value: shape[%d] is %lld but key's is %lld", d,
                           (long long)v->shape[d], (long long)k->shape[d]);
    if (k->shape[k_ndim - 1] != s->E)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "key: head dimension %lld does not match query's %lld",
                       (long long)k->shape[k_ndim - 1], (long long)s->E);
    if (s->Hkv == 0 ? s->Hq != 0 : s->Hq % s->Hkv != 0)
        return af_fail(AF_ERR_INVALID_ARGUMENT,
                       "query: %lld heads is not a multiple of key's %lld heads (num_head must be divisible by "
                       "num_head_kv)", (long long)s->Hq, (long long)s->Hkv);
    if (s->E < 1)
        return af_fail(AF_ERR_UNSUPPORTED, "query: head dimension must be at least 1, got %lld", (long long)s->E);
    if (s->E > AF_MAX_HEAD_DIM || s->Ev > AF_MAX_HEAD_DIM)
        return af_fail(AF_ERR_UNSUPPORTED, "%s: head dimension %lld exceeds the supported maximum %d",
                       s->E > AF_MAX_HEAD_DIM ? "query" : "value", (long long)(s->E > AF_MAX_HEAD_DIM ? s->E : s->Ev),
                       AF_MAX_HEAD_DIM);
    /* the batch: q's, else cu_seqlens_q's, and every other batched argument must agree */
    if (s->varlen_q) {
        af_status st = check_int32(a->cu_seqlens_q, "cu_seqlens_q", 1);
        if (st != AF_OK) return st;
        if (a->cu_seqlens_q->shape[0] < 1)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "cu_seqlens_q: must have shape (batch_size + 1,), got (0,)");
    }
    s->B = s->varlen_q ? a->cu_seqlens_q->shape[0] - 1 : q->shape[0];
    if (!s->varlen_k && !s->paged && k->shape[0] != s->B)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "key: batch size %lld does not match query's %lld",
                       (long long)k->shape[0], (long long)s->B);
    if (s->paged) {
        s->num_pages = k->shape[0];
        s->page_size = k->shape[1];
        af_status st = check_int32(a->page_table, "page_table", 2);
        if (st != AF_OK) return st;
        if (a->page_table->shape[0] != s->B)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "page_table: expected shape (batch_size, max_pages) with "
                           "batch_size %lld, got %lld rows", (long long)s->B, (long long)a->page_table->shape[0]);
        s->max_pages = a->page_table->shape[1];
        if (s->page_size < 1)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "key: page_size (dim 1) must be >= 1 with page_table, got %lld",
                           (long long)s->page_size);
    }
    if (a->learnable_sink) {
        const int64_t want[1] = {s->Hq};
        af_status st = af_check_shape(a->learnable_sink, "learnable_sink", 1, want);
        if (st != AF_OK) return st;
        if (!is_float_dtype(a->learnable_sink->dtype))
            return af_fail(AF_ERR_UNSUPPORTED, "learnable_sink: dtype %s is not supported; expected float32, float16 "
                           "or bfloat16", af_dtype_name(a->learnable_sink->dtype));
    }
    return AF_OK;
}

/* The index arrays' values: prefix sums, keys used, pages; and the bounds max_seqlen_q/k. Fills L and S. */
static af_status check_sequences(const af_flash_args *a, const flash_shape *s, af_problem *p) {
    const af_tensor *k = a->key;
    af_status st;
    p->L = s->Lq;
    p->S = s->varlen_k || s->paged ? 0 : k->shape[1];
    if (s->varlen_q) {
        if ((st = check_cu_seqlens(a->cu_seqlens_q, "cu_seqlens_q", s->B, s->total_q, "query")) != AF_OK) return st;
        for (int64_t b = 0; b < s->B; b++) {
            const int64_t Lb = at32(a->cu_seqlens_q, b + 1) - at32(a->cu_seqlens_q, b);
            if (Lb > a->max_seqlen_q)
                return af_fail(AF_ERR_INVALID_ARGUMENT, "max_seqlen_q: %lld, but sequence %lld has %lld query rows",
                               (long long)a->max_seqlen_q, (long long)b, (long long)Lb);
            if (Lb > p->L) p->L = Lb;
        }
    }
    if (s->varlen_k && (st = check_cu_seqlens(a->cu_seqlens_k, "cu_seqlens_k", s->B, k->shape[0], "key")) != AF_OK)
        return st;
    if (a->seqused_k && (st = check_seqused_shape(a->seqused_k, s->B)) != AF_OK) return st;
    int64_t capacity = 0;
    if (s->paged && __builtin_mul_overflow(s->max_pages, s->page_size, &capacity))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "page_table: %lld pages of %lld keys pass 2^63 keys",
                       (long long)s->max_pages, (long long)s->page_size);
    for (int64_t b = 0; b < s->B; b++) {
        int64_t keys = s->paged ? capacity : s->varlen_k ? at32(a->cu_seqlens_k, b + 1) - at32(a->cu_seqlens_k, b)
                                                         : k->shape[1];
        if (a->seqused_k) {
            const int32_t used = at32(a->seqused_k, b);
            if (used < 0 || used > keys)
                return af_fail(AF_ERR_INVALID_ARGUMENT, "seqused_k: [%lld] = %d is outside [0, %lld], the keys of "
                               "sequence %lld", (long long)b, used, (long long)keys, (long long)b);
            keys = used;
        }
        if (s->varlen_k && keys > a->max_seqlen_k)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "max_seqlen_k: %lld, but sequence %lld has %lld keys",
                           (long long)a->max_seqlen_k, (long long)b, (long long)keys);
        if (s->paged)   /* the pages a sequence uses must exist; entries past them are never read */
            for (int64_t page = 0; page < keys / s->page_size + (keys % s->page_size != 0); page++) {
                const af_tensor *pt = a->page_table;
                const int32_t index = ((const int32_t *)pt->data)[b * pt->strides[0] + page * pt->strides[1]];
                if (index < 0 || index >= s->num_pages)
                    return af_fail(AF_ERR_INVALID_ARGUMENT, "page_table: [%lld, %lld] = %d is outside [0, num_pages = "
                                   "%lld)", (long long)b, (long long)page, index, (long long)s->num_pages);
            }
        if ((a->seqused_k || s->varlen_k || s->paged) && keys > p->S) p->S = keys;
    }
    return AF_OK;
}

/* On CUDA the index arrays are device memory that the call must not wait for (it may be enqueued during stream
 * capture): only their dtypes and shapes are checked here, and L and S become bounds every sequence must respect,
 * which the kernels check entry by entry (problem.h's af_sequence_checked; docs/CUDA.md). */
static af_status cuda_sequence_bounds(const af_flash_args *a, const flash_shape *s, af_problem *p) {
    const af_tensor *k = a->key;
    af_status st;
    p->L = s->Lq;
    p->S = s->varlen_k || s->paged ? 0 : k->shape[1];
    if (s->varlen_q) {   /* shape checked by check_layout */
        if (a->max_seqlen_q == 0 && s->total_q > 0)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "max_seqlen_q: 0, but query has %lld rows (some sequence has "
                           "rows)", (long long)s->total_q);
        p->L = a->max_seqlen_q < s->total_q ? a->max_seqlen_q : s->total_q;
    }
    if (s->varlen_k) {
        if ((st = check_cu_seqlens_shape(a->cu_seqlens_k, "cu_seqlens_k", s->B)) != AF_OK) return st;
        p->S = a->max_seqlen_k < k->shape[0] ? a->max_seqlen_k : k->shape[0];
    }
    if (a->seqused_k && (st = check_seqused_shape(a->seqused_k, s->B)) != AF_OK) return st;
    if (s->paged && __builtin_mul_overflow(s->max_pages, s->page_size, &p->S))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "page_table: %lld pages of %lld keys pass 2^63 keys",
                       (long long)s->max_pages, (long long)s->page_size);
    return AF_OK;
}

/* out and lse: shapes, dtypes, no self-overlap, and no overlap with each other or any input. */
static af_status check_outputs(const af_flash_args *a, const flash_shape *s, const flash_view *views) {
    const af_tensor *out = views[V_OUT].t, *lse = views[V_LSE].t;
    af_status st;
    const int64_t out_fixed[4] = {s->B, s->Lq, s->Hq, s->Ev}, out_varlen[3] = {s->total_q, s->Hq, s->Ev};
    if ((st = af_check_shape(out, "out", s->varlen_q ? 3 : 4, s->varlen_q ? out_varlen : out_fixed)) != AF_OK)
        return st;
    if (is_f8(a->query->dtype) && !is_float_dtype(out->dtype))   /* FA4: bf16; here any float dtype, never fp8 */
        return af_fail(AF_ERR_INVALID_ARGUMENT, "out: dtype %s is not supported for float8 inputs; expected float32, "
                       "float16 or bfloat16", af_dtype_name(out->dtype));
    /* a float32 out under a float16/bfloat16 query (CPU): partial results that are merged later (context
     * parallelism's ring) keep f32 precision instead of being rounded once per block */
    const bool widened = out->dtype == AF_F32 && (a->query->dtype == AF_F16 || a->query->dtype == AF_BF16);
    if (!is_f8(a->query->dtype) && out->dtype != a->query->dtype && !widened)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "out: dtype %s does not match query's %s (float32 is also taken "
                       "for a float16 or bfloat16 query)", af_dtype_name(out->dtype), af_dtype_name(a->query->dtype));
    if (widened && out->device.type == AF_DEVICE_CUDA)
        return af_fail(AF_ERR_UNSUPPORTED, "out: float32 under a %s query runs on the CPU only; on CUDA out takes "
                       "the query's dtype", af_dtype_name(a->query->dtype));
    if (!af_no_self_overlap(out))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "out: strides make distinct elements share memory");
    if (lse) {
        const int64_t lse_fixed[3] = {s->B, s->Hq, s->Lq}, lse_varlen[2] = {s->Hq, s->total_q};
        if ((st = af_check_shape(lse, "lse", s->varlen_q ? 2 : 3, s->varlen_q ? lse_varlen : lse_fixed)) != AF_OK)
            return st;
        if (lse->dtype != AF_F32)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "lse: dtype must be float32, got %s", af_dtype_name(lse->dtype));
        if (!af_no_self_overlap(lse))
            return af_fail(AF_ERR_INVALID_ARGUMENT, "lse: strides make distinct elements share memory");
        if (af_spans_overlap(out->data, views[V_OUT].bytes, lse->data, views[V_LSE].bytes))
            return af_fail(AF_ERR_INVALID_ARGUMENT, "lse: overlaps out's memory");
    }
    for (int o = V_OUT; o < V_COUNT; o++) {
        if (!views[o].t) continue;
        for (int i = 0; i < V_INPUTS; i++)
            if (views[i].t && af_spans_overlap(views[o].t->data, views[o].bytes, views[i].t->data, views[i].bytes))
                return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: overlaps %s's memory", views[o].name, views[i].name);
    }
    return AF_OK;
}

/* NHD (and packed / paged) strides as the problem's (B, H, seq, dim): `seq_dim` and `head_dim` index the view's
 * dims; a packed view has no batch dim (stride 0: its sequences are found through cu_seqlens). */
void af_flash_permute_strides(const af_tensor *t, int64_t numel, bool packed, int64_t *to) {
    int64_t st[AF_MAX_DIMS];
    af_problem_strides(t, numel, st);
    if (packed) {   /* (rows, H, D) */
        to[0] = 0; to[1] = st[1]; to[2] = st[0]; to[3] = st[2];
    } else {        /* (B or pages, seq, H, D) */
        to[0] = st[0]; to[1] = st[2]; to[2] = st[1]; to[3] = st[3];
    }
}

af_status af_flash_check(const af_flash_args *a, const af_tensor *out, const af_tensor *lse, af_problem *p) {
    if (!a) return af_fail(AF_ERR_INVALID_ARGUMENT, "args: must not be NULL");
    if (!out) return af_fail(AF_ERR_INVALID_ARGUMENT, "out: must not be NULL");
    memset(p, 0, sizeof *p);
    if (!a->query) return af_fail(AF_ERR_INVALID_ARGUMENT, "query: must not be NULL");
    if (!a->key) return af_fail(AF_ERR_INVALID_ARGUMENT, "key: must not be NULL");
    if (!a->value) return af_fail(AF_ERR_INVALID_ARGUMENT, "value: must not be NULL");
    flash_view views[V_COUNT] = {
        {"query", a->query, 0, 0}, {"key", a->key, 0, 0}, {"value", a->value, 0, 0},
        {"learnable_sink", a->learnable_sink, 0, 0}, {"cu_seqlens_q", a->cu_seqlens_q, 0, 0},
        {"cu_seqlens_k", a->cu_seqlens_k, 0, 0}, {"seqused_k", a->seqused_k, 0, 0},
        {"page_table", a->page_table, 0, 0}, {"q_descale", a->q_descale, 0, 0}, {"k_descale", a->k_descale, 0, 0},
        {"v_descale", a->v_descale, 0, 0}, {"out", out, 0, 0}, {"lse", lse, 0, 0}};
    af_status st = check_devices(views);
    if (st != AF_OK) return st;
    for (int i = 0; i < V_COUNT; i++)
        if (views[i].t && (st = af_view_span(views[i].t, views[i].name, &views[i].bytes, &views[i].numel)) != AF_OK)
            return st;
    flash_shape s = {0};
    if ((st = check_scalars(a)) != AF_OK || (st = check_layout(a, &s)) != AF_OK ||
        (st = check_descales(a, s.B, s.Hkv)) != AF_OK)
        return st;
    st = a->query->device.type == AF_DEVICE_CUDA ? cuda_sequence_bounds(a, &s, p) : check_sequences(a, &s, p);
    if (st != AF_OK) return st;
    if ((st = check_outputs(a, &s, views)) != AF_OK) return st;
    set_window(a, p);

    p->dtype = a->query->dtype;
    p->kv_dtype = a->key->dtype;
    p->out_dtype = out->dtype;
    p->B = s.B; p->Hq = s.Hq; p->Hkv = s.Hkv; p->E = s.E; p->Ev = s.Ev;
    p->group = s.Hkv > 0 ? s.Hq / s.Hkv : 1;
    p->q = a->query->data; p->k = a->key->data; p->v = a->value->data; p->out = out->data;
    af_flash_permute_strides(a->query, views[V_Q].numel, s.varlen_q, p->q_stride);
    af_flash_permute_strides(a->key, views[V_K].numel, s.varlen_k, p->k_stride);
    af_flash_permute_strides(a->value, views[V_V].numel, s.varlen_k, p->v_stride);
    af_flash_permute_strides(out, views[V_OUT].numel, s.varlen_q, p->out_stride);
    if (lse) {
        int64_t ls[AF_MAX_DIMS];
        af_problem_strides(lse, views[V_LSE].numel, ls);
        p->lse = lse->data;
        if (s.varlen_q) { p->lse_stride[0] = 0; p->lse_stride[1] = ls[0]; p->lse_stride[2] = ls[1]; }
        else memcpy(p->lse_stride, ls, sizeof p->lse_stride);
    }
    p->scale = a->has_scale ? a->scale : 1.0 / sqrt((double)s.E);
    p->softcap = a->softcap;
    if (a->learnable_sink && views[V_SINK].numel > 0) {
        p->sink = a->learnable_sink->data;
        p->sink_dtype = a->learnable_sink->dtype;
        p->sink_stride = a->learnable_sink->strides[0];
    }
    if (s.varlen_q) {
        p->cu_seqlens_q = a->cu_seqlens_q->data;
        p->cu_seqlens_q_stride = a->cu_seqlens_q->strides[0];
    }
    if (s.varlen_k) {
        p->cu_seqlens_k = a->cu_seqlens_k->data;
        p->cu_seqlens_k_stride = a->cu_seqlens_k->strides[0];
    }
    if (a->seqused_k && s.B > 0) {
        p->seqused_k = a->seqused_k->data;
        p->seqused_k_stride = a->seqused_k->strides[0];
    }
    const af_tensor *descales[3] = {a->q_descale, a->k_descale, a->v_descale};
    const float **to[3] = {&p->q_descale, &p->k_descale, &p->v_descale};
    int64_t *strides[3] = {p->q_descale_stride, p->k_descale_stride, p->v_descale_stride};
    for (int i = 0; i < 3; i++)
        if (descales[i] && views[V_Q_DESCALE + i].numel > 0) {
            *to[i] = descales[i]->data;
            strides[i][0] = descales[i]->strides[0];
            strides[i][1] = descales[i]->strides[1];
        }
    if (s.paged && s.B > 0) {
        p->page_table = a->page_table->data;
        p->page_table_stride[0] = a->page_table->strides[0];
        p->page_table_stride[1] = a->page_table->strides[1];
        p->page_size = s.page_size;
    }
    p->total_q = s.total_q;
    p->total_k = s.varlen_k ? a->key->shape[0] : 0;
    p->num_pages = s.num_pages;
    return AF_OK;
}
