/* The backward pass's boundary: the forward's rules (af_sdpa_check / af_flash_check over the same arguments, out and
 * lse), then dout and the gradients, and what the backward does not take. Nothing is written here; a failed check
 * leaves every gradient untouched. */
#include <string.h>

#include "core/status.h"
#include "sdpa/backward.h"
#include "sdpa/check.h"

typedef struct { const char *name; const af_tensor *t; int64_t bytes, numel; } view;

enum { MAX_READ = 12 };   /* q, k, v, out, dout, lse, mask, sink, cu_seqlens_q/k, seqused_k, page_table */

static bool same_shape(const af_tensor *a, const af_tensor *b) {
    if (a->ndim != b->ndim) return false;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return false;
    return true;
}

/* `t` must have `like`'s shape and dtype (dout: out's; a gradient: its input's, or float32 under a float16/bfloat16
 * input on the CPU when `widen`: gradients summed later, a ring's blocks, stay unrounded). */
static af_status check_like(const view *t, const af_tensor *like, const char *like_name, bool widen) {
    if (!same_shape(t->t, like)) {
        int64_t want[AF_MAX_DIMS];
        memcpy(want, like->shape, sizeof(int64_t) * (size_t)like->ndim);
        return af_check_shape(t->t, t->name, like->ndim, want);
    }
    const bool widened = widen && t->t->dtype == AF_F32 && (like->dtype == AF_F16 || like->dtype == AF_BF16);
    if (t->t->dtype != like->dtype && !widened)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: dtype %s does not match %s's %s%s", t->name,
                       af_dtype_name(t->t->dtype), like_name, af_dtype_name(like->dtype),
                       widen ? " (float32 is also taken under a float16 or bfloat16 input)" : "");
    if (widened && like->device.type == AF_DEVICE_CUDA)
        return af_fail(AF_ERR_UNSUPPORTED, "%s: float32 under a %s %s runs on the CPU only; on CUDA it takes %s's "
                       "dtype", t->name, af_dtype_name(like->dtype), like_name, like_name);
    if (t->t->device.type != like->device.type || t->t->device.index != like->device.index)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: on a different device than %s", t->name, like_name);
    return AF_OK;
}

/* The backward reads each input's rows as the forward did; a size-1 batch or head dim read for a larger output would
 * need its gradient summed over that dim, which the caller does (PyTorch's expand does it for autograd). */
static af_status check_no_broadcast(const char *name, const af_tensor *t, int batch_dim, int head_dim, int64_t B,
                                    int64_t H, const char *heads_of) {
    if (batch_dim >= 0 && t->shape[batch_dim] != B)
        return af_fail(AF_ERR_UNSUPPORTED, "%s: batch size %lld broadcasts to %lld; the backward pass takes no "
                       "broadcast dim: expand %s to batch %lld (stride 0) and sum its gradient over that dim", name,
                       (long long)t->shape[batch_dim], (long long)B, name, (long long)B);
    if (t->shape[head_dim] != H)
        return af_fail(AF_ERR_UNSUPPORTED, "%s: %lld heads broadcast to %s's %lld; the backward pass takes no "
                       "broadcast dim: expand %s to %lld heads (stride 0) and sum its gradient over that dim", name,
                       (long long)t->shape[head_dim], heads_of, (long long)H, name, (long long)H);
    return AF_OK;
}

/* The gradients: each of its input's shape, dtype and device, no element sharing memory with another, no overlap with
 * anything the call reads (`read`) or another gradient. */
static af_status check_gradients(view *grads, int n_grads, const af_tensor *const *like, const char *const *like_names,
                                 view *read, int n_read) {
    af_status st;
    for (int i = 0; i < n_read; i++)
        if (read[i].t && (st = af_view_span(read[i].t, read[i].name, &read[i].bytes, &read[i].numel)) != AF_OK)
            return st;
    for (int g = 0; g < n_grads; g++) {
        if (!grads[g].t) continue;
        if ((st = af_view_span(grads[g].t, grads[g].name, &grads[g].bytes, &grads[g].numel)) != AF_OK) return st;
        if ((st = check_like(&grads[g], like[g], like_names[g], g < 3)) != AF_OK) return st;
        if (!af_no_self_overlap(grads[g].t))
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: strides make distinct elements share memory", grads[g].name);
        for (int i = 0; i < n_read; i++)
            if (read[i].t && af_spans_overlap(grads[g].t->data, grads[g].bytes, read[i].t->data, read[i].bytes))
                return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: overlaps %s's memory", grads[g].name, read[i].name);
        for (int o = 0; o < g; o++)
            if (grads[o].t && af_spans_overlap(grads[g].t->data, grads[g].bytes, grads[o].t->data, grads[o].bytes))
                return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: overlaps %s's memory", grads[g].name, grads[o].name);
    }
    return AF_OK;
}

/* in, grads, out, dout and lse present. */
static af_status check_inputs(const af_backward_inputs *in, const af_gradients *grads) {
    if (!in) return af_fail(AF_ERR_INVALID_ARGUMENT, "in: must not be NULL");
    if (!grads) return af_fail(AF_ERR_INVALID_ARGUMENT, "grads: must not be NULL");
    if (!in->out) return af_fail(AF_ERR_INVALID_ARGUMENT, "out: must not be NULL (the forward's output)");
    if (!in->dout) return af_fail(AF_ERR_INVALID_ARGUMENT, "dout: must not be NULL (the gradient of out)");
    if (!in->lse)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "lse: must not be NULL; the backward pass needs the forward's lse");
    return AF_OK;
}

/* What the CUDA backward (src/cuda/attn_bwd_mma.cuh: the tensor cores) takes, checked here before the backend is
 * loaded or anything is enqueued. */
static af_status check_cuda(const af_problem *p, const af_tensor *query) {
    if (query->device.type != AF_DEVICE_CUDA) return AF_OK;
    if (p->dtype != AF_F16 && p->dtype != AF_BF16)
        return af_fail(AF_ERR_UNSUPPORTED, "query: dtype %s on cuda:%d has no backward pass; the CUDA backward runs "
                       "on the tensor cores and takes float16 and bfloat16 (cast q, k, v, out and dout, or run the "
                       "backward on the CPU)", af_dtype_name(p->dtype), query->device.index);
    if (p->E > 128)
        return af_fail(AF_ERR_UNSUPPORTED, "query: head dim %lld on cuda:%d has no backward pass; the CUDA backward "
                       "takes head dims up to 128", (long long)p->E, query->device.index);
    if (p->Ev > 128)
        return af_fail(AF_ERR_UNSUPPORTED, "value: head dim %lld on cuda:%d has no backward pass; the CUDA backward "
                       "takes head dims up to 128", (long long)p->Ev, query->device.index);
    if (p->B > 65535 || p->Hq > 65535)
        return af_fail(AF_ERR_UNSUPPORTED, "query: %lld batches and %lld heads on cuda:%d; the CUDA backward takes "
                       "at most 65535 of each", (long long)p->B, (long long)p->Hq, query->device.index);
    return AF_OK;
}

/* dout: out's shape, dtype and device; its strides, and out's, in the problem's order. */
static af_status check_dout(const af_backward_inputs *in, view *dout) {
    af_status st = af_view_span(in->dout, "dout", &dout->bytes, &dout->numel);
    if (st != AF_OK) return st;
    return check_like(dout, in->out, "out", false);
}

af_status af_sdpa_backward_check(const af_sdpa_args *args, const af_backward_inputs *in, const af_gradients *grads,
                                 af_backward_problem *bp) {
    memset(bp, 0, sizeof *bp);
    af_status st = check_inputs(in, grads);
    if (st != AF_OK) return st;
    af_problem *p = &bp->f;
    if ((st = af_sdpa_check(args, in->out, in->lse, p)) != AF_OK) return st;
    if ((st = check_cuda(p, args->query)) != AF_OK) return st;
    const af_tensor *q = args->query, *k = args->key, *v = args->value;
    if ((st = check_no_broadcast("query", q, 0, 1, p->B, p->Hq, "the output")) != AF_OK ||
        (st = check_no_broadcast("key", k, 0, 1, p->B, p->Hkv, "value")) != AF_OK ||
        (st = check_no_broadcast("value", v, 0, 1, p->B, p->Hkv, "key")) != AF_OK)
        return st;
    view dout = {"dout", in->dout, 0, 0};
    if ((st = check_dout(in, &dout)) != AF_OK) return st;
    view read[MAX_READ] = {{"query", q, 0, 0}, {"key", k, 0, 0}, {"value", v, 0, 0}, {"out", in->out, 0, 0},
                           {"dout", in->dout, 0, 0}, {"lse", in->lse, 0, 0}, {"attn_mask", args->attn_mask, 0, 0}};
    view g[3] = {{"dq", grads->dq, 0, 0}, {"dk", grads->dk, 0, 0}, {"dv", grads->dv, 0, 0}};
    const af_tensor *like[3] = {q, k, v};
    const char *like_names[3] = {"query", "key", "value"};
    if (grads->dsink)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "dsink: must be NULL; af_sdpa has no learnable sink");
    if ((st = check_gradients(g, 3, like, like_names, read, 7)) != AF_OK) return st;

    bp->dout = in->dout->data;
    af_problem_strides(in->dout, dout.numel, bp->dout_stride);
    char **to[3] = {&bp->dq, &bp->dk, &bp->dv};
    int64_t *strides[3] = {bp->dq_stride, bp->dk_stride, bp->dv_stride};
    af_dtype *dtypes[3] = {&bp->dq_dtype, &bp->dk_dtype, &bp->dv_dtype};
    for (int i = 0; i < 3; i++)
        if (g[i].t) {
            *to[i] = g[i].t->data;
            *dtypes[i] = g[i].t->dtype;
            af_problem_strides(g[i].t, g[i].numel, strides[i]);
        }
    return AF_OK;
}

af_status af_flash_backward_check(const af_flash_args *args, const af_backward_inputs *in, const af_gradients *grads,
                                  af_backward_problem *bp) {
    memset(bp, 0, sizeof *bp);
    af_status st = check_inputs(in, grads);
    if (st != AF_OK) return st;
    af_problem *p = &bp->f;
    if ((st = af_flash_check(args, in->out, in->lse, p)) != AF_OK) return st;
    if (args->page_table)
        return af_fail(AF_ERR_UNSUPPORTED, "page_table: paged K/V has no backward pass (FlashAttention-4 has none "
                       "either); train on contiguous or varlen K/V");
    if (p->kv_dtype != AF_F32 && p->kv_dtype != AF_F16 && p->kv_dtype != AF_BF16)
        return af_fail(AF_ERR_UNSUPPORTED, "key: dtype %s has no backward pass (FlashAttention-4 has none for float8 "
                       "either); expected float32, float16 or bfloat16", af_dtype_name(p->kv_dtype));
    if ((st = check_cuda(p, args->query)) != AF_OK) return st;
    const af_tensor *q = args->query, *k = args->key, *v = args->value;
    const bool varlen_q = q->ndim == 3, varlen_k = k->ndim == 3;
    /* (B, L, H, D) or packed (rows, H, D): heads are the second-to-last dim; packed views have no batch dim */
    if ((st = check_no_broadcast("query", q, varlen_q ? -1 : 0, q->ndim - 2, p->B, p->Hq, "the output")) != AF_OK ||
        (st = check_no_broadcast("key", k, varlen_k ? -1 : 0, k->ndim - 2, p->B, p->Hkv, "value")) != AF_OK ||
        (st = check_no_broadcast("value", v, varlen_k ? -1 : 0, v->ndim - 2, p->B, p->Hkv, "key")) != AF_OK)
        return st;
    view dout = {"dout", in->dout, 0, 0};
    if ((st = check_dout(in, &dout)) != AF_OK) return st;
    view read[MAX_READ] = {{"query", q, 0, 0},          {"key", k, 0, 0},
                           {"value", v, 0, 0},          {"out", in->out, 0, 0},
                           {"dout", in->dout, 0, 0},    {"lse", in->lse, 0, 0},
                           {"learnable_sink", args->learnable_sink, 0, 0},
                           {"cu_seqlens_q", args->cu_seqlens_q, 0, 0},
                           {"cu_seqlens_k", args->cu_seqlens_k, 0, 0},
                           {"seqused_k", args->seqused_k, 0, 0}};
    view g[4] = {{"dq", grads->dq, 0, 0}, {"dk", grads->dk, 0, 0}, {"dv", grads->dv, 0, 0},
                 {"dsink", grads->dsink, 0, 0}};
    if (grads->dsink && !args->learnable_sink)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "dsink: must be NULL when the call has no learnable_sink");
    const af_tensor *like[4] = {q, k, v, args->learnable_sink};
    const char *like_names[4] = {"query", "key", "value", "learnable_sink"};
    if ((st = check_gradients(g, 4, like, like_names, read, 10)) != AF_OK) return st;

    bp->dout = in->dout->data;
    af_flash_permute_strides(in->dout, dout.numel, varlen_q, bp->dout_stride);
    char **to[3] = {&bp->dq, &bp->dk, &bp->dv};
    int64_t *strides[3] = {bp->dq_stride, bp->dk_stride, bp->dv_stride};
    const bool packed[3] = {varlen_q, varlen_k, varlen_k};
    af_dtype *dtypes[3] = {&bp->dq_dtype, &bp->dk_dtype, &bp->dv_dtype};
    for (int i = 0; i < 3; i++)
        if (g[i].t) {
            *to[i] = g[i].t->data;
            *dtypes[i] = g[i].t->dtype;
            af_flash_permute_strides(g[i].t, g[i].numel, packed[i], strides[i]);
        }
    if (g[3].t && g[3].numel > 0) {
        bp->dsink = g[3].t->data;
        bp->dsink_stride = g[3].t->strides[0];
    }
    return AF_OK;
}
