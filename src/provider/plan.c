/* The accepted subset (SPEC §2): the seed's _sample_replacement_plan, in its order and with its messages,
 * then what attnforge's kernel needs, so a prepared plan never fails at run time. */
#include "provider/plan.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "provider/call.h"
#include "provider/layout.h"

#define AF_PROVIDER_MAX_HEAD_DIM 1024   /* what af_sdpa's kernels run (src/sdpa/check.c) */

static const char *const qkv_names[3] = {"query", "key", "value"};

static bool refuse(af_refusal *why, const char *message, const char *detail_fmt, ...)
    __attribute__((format(printf, 3, 4)));
static bool refuse(af_refusal *why, const char *message, const char *detail_fmt, ...) {
    snprintf(why->message, sizeof why->message, "FlashAttention-4 provider %s", message);
    va_list ap;
    va_start(ap, detail_fmt);
    vsnprintf(why->detail, sizeof why->detail, detail_fmt, ap);
    va_end(ap);
    return false;
}

/* ---- Python's repr of a sorted list of names: ['a', "it's"] */

static size_t append(char *buf, size_t size, size_t used, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static size_t append(char *buf, size_t size, size_t used, const char *fmt, ...) {
    if (used >= size) return used;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + used, size - used, fmt, ap);
    va_end(ap);
    return n < 0 ? used : used + (size_t)n;
}

static size_t append_py_str(char *buf, size_t size, size_t used, const char *s) {
    const char quote = strchr(s, '\'') && !strchr(s, '"') ? '"' : '\'';
    used = append(buf, size, used, "%c", quote);
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '\\' || *c == (unsigned char)quote) used = append(buf, size, used, "\\%c", *c);
        else if (*c == '\n') used = append(buf, size, used, "\\n");
        else if (*c == '\r') used = append(buf, size, used, "\\r");
        else if (*c == '\t') used = append(buf, size, used, "\\t");
        else if (*c < 0x20 || *c == 0x7f) used = append(buf, size, used, "\\x%02x", *c);
        else used = append(buf, size, used, "%c", *c);
    }
    return append(buf, size, used, "%c", quote);
}

static int compare_names(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);   /* UTF-8 byte order = code point order */
}

/* ---- the seed's steps */

static const char *dims_text(const af_tensor *t, char *buf, size_t size) {
    size_t used = append(buf, size, 0, "(");
    for (int d = 0; d < t->ndim; d++) used = append(buf, size, used, d ? ", %lld" : "%lld", (long long)t->shape[d]);
    append(buf, size, used, t->ndim == 1 ? ",)" : ")");
    return buf;
}

/* _validate_qkv: returns false with a refusal, else sets *uses_gqa. */
static bool validate_qkv(const af_value *qkv[3], bool enable_gqa, bool *uses_gqa, af_refusal *why) {
    for (int i = 0; i < 3; i++)
        if (qkv[i]->kind != AF_VALUE_TENSOR)
            return refuse(why, "requires tensor query, key and value", "%s is %s", qkv_names[i],
                          af_value_kind_text(qkv[i]));
    const af_tensor *q = &qkv[0]->tensor.view, *k = &qkv[1]->tensor.view, *v = &qkv[2]->tensor.view;
    if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4) {
        char a[160], b[160], c[160];
        return refuse(why, "requires 4D query, key and value", "query %s, key %s, value %s", dims_text(q, a, sizeof a),
                      dims_text(k, b, sizeof b), dims_text(v, c, sizeof c));
    }
    if (q->shape[0] != k->shape[0] || k->shape[0] != v->shape[0])
        return refuse(why, "requires matching batch dimensions", "query %lld, key %lld, value %lld",
                      (long long)q->shape[0], (long long)k->shape[0], (long long)v->shape[0]);
    if (k->shape[2] != v->shape[2])
        return refuse(why, "requires matching key/value sequence lengths", "key %lld, value %lld",
                      (long long)k->shape[2], (long long)v->shape[2]);
    if (q->shape[3] != k->shape[3])
        return refuse(why, "requires matching query/key head dimensions", "query %lld, key %lld",
                      (long long)q->shape[3], (long long)k->shape[3]);
    if (k->shape[1] != v->shape[1])
        return refuse(why, "requires matching key/value head counts", "key %lld, value %lld",
                      (long long)k->shape[1], (long long)v->shape[1]);
    const int64_t hq = q->shape[1], hkv = k->shape[1];
    *uses_gqa = hq != hkv;
    if (!*uses_gqa) return true;   /* plain MHA; enable_gqa is ignored, as in the seed */
    /* Hkv == 0 raises ZeroDivisionError in the seed; here it is the same refusal as any invalid grouping */
    if (hq < hkv || hkv == 0 || hq % hkv != 0 || !enable_gqa)
        return refuse(why, "requires valid grouped-query attention",
                      "query has %lld heads, key/value %lld, enable_gqa is %s", (long long)hq, (long long)hkv,
                      enable_gqa ? "true" : "false");
    return true;
}

/* Byte span of a descriptor, refusing negative strides and sizes beyond 2^63 bytes. */
static bool check_strides_and_size(const af_tensor_desc *t, const char *name, af_refusal *why) {
    const af_tensor *v = &t->view;
    int64_t numel = 1, reach = 0;
    for (int d = 0; d < v->ndim; d++) {
        if (v->strides[d] < 0)
            return refuse(why, "requires non-negative strides", "%s stride[%d] is %lld", name, d,
                          (long long)v->strides[d]);
        if (__builtin_mul_overflow(numel, v->shape[d], &numel))
            return refuse(why, "requires tensors that fit in memory", "%s has more than 2^63 elements", name);
    }
    if (numel == 0) return true;
    for (int d = 0; d < v->ndim; d++) {
        int64_t step;
        if (__builtin_mul_overflow(v->shape[d] - 1, v->strides[d], &step) || __builtin_add_overflow(reach, step, &reach))
            return refuse(why, "requires tensors that fit in memory", "%s's shape and strides reach beyond 2^63 elements",
                          name);
    }
    int64_t bytes;
    if (__builtin_add_overflow(reach, 1, &bytes) || __builtin_mul_overflow(bytes, (int64_t)af_dtype_size(v->dtype), &bytes))
        return refuse(why, "requires tensors that fit in memory", "%s spans more than 2^63 bytes", name);
    return true;
}

static bool is_float(const af_tensor_desc *t) {
    return t->dtype_known && (t->view.dtype == AF_F32 || t->view.dtype == AF_F16 || t->view.dtype == AF_BF16);
}

/* Where the sample runs: q, k and v all on the CPU, or all on one CUDA device (the plan keeps the backend, not
 * the device index: a plan made on cuda:0 runs on whichever CUDA device a call's tensors are on). */
static bool check_device(const af_tensor_desc *t[3], af_backend *backend, af_refusal *why) {
    af_device device[3];
    for (int i = 0; i < 3; i++)
        if (!af_device_from_name(t[i]->device, &device[i]))
            return refuse(why, "supports devices 'cpu' and 'cuda' only", "%s is on '%s'", qkv_names[i], t[i]->device);
    for (int i = 1; i < 3; i++)
        if (device[i].type != device[0].type || device[i].index != device[0].index)
            return refuse(why, "requires query, key and value on one device",
                          "query is on '%s', key on '%s', value on '%s'", t[0]->device, t[1]->device, t[2]->device);
    *backend = device[0].type == AF_DEVICE_CUDA ? AF_BACKEND_CUDA : AF_BACKEND_CPU;
    return true;
}

/* attnforge's own checks: what the kernels run (the seed leaves these to FA4 at call time). The CUDA backend
 * runs everything the CPU path does (f32 and head dims above 256 on its slower CUDA-core path). */
static bool check_kernel_limits(const af_value *qkv[3], af_backend *backend, af_refusal *why) {
    const af_tensor_desc *t[3] = {&qkv[0]->tensor, &qkv[1]->tensor, &qkv[2]->tensor};
    if (!check_device(t, backend, why)) return false;
    if (!is_float(t[0]))
        return refuse(why, "requires float32, float16 or bfloat16 query, key and value", "query is %s",
                      t[0]->dtype_name);
    for (int i = 1; i < 3; i++)
        if (!t[i]->dtype_known || t[i]->view.dtype != t[0]->view.dtype)
            return refuse(why, "requires query, key and value of one dtype", "query %s, key %s, value %s",
                          t[0]->dtype_name, t[1]->dtype_name, t[2]->dtype_name);
    const int64_t E = t[0]->view.shape[3], Ev = t[2]->view.shape[3];
    if (E < 1 || E > AF_PROVIDER_MAX_HEAD_DIM)
        return refuse(why, "requires head dimensions from 1 to 1024", "query/key head dimension is %lld", (long long)E);
    if (Ev < 1 || Ev > AF_PROVIDER_MAX_HEAD_DIM)
        return refuse(why, "requires head dimensions from 1 to 1024", "value head dimension is %lld", (long long)Ev);
    for (int i = 0; i < 3; i++)
        if (!check_strides_and_size(t[i], qkv_names[i], why)) return false;
    return true;
}

/* Leftover keywords after the seed pops the ones it reads: refused by name, sorted, as a Python list. */
static bool check_unknown_kwargs(const af_sample *s, af_qkv_source source, af_refusal *why) {
    const char **unknown = af_alloc((s->nkwargs + 1) * sizeof *unknown);
    if (!unknown) return refuse(why, "could not check its keywords", "out of memory");
    size_t n = 0;
    for (size_t i = 0; i < s->nkwargs; i++)
        if (!af_sample_kwarg_is_known(s->kwargs[i].name, source)) unknown[n++] = s->kwargs[i].name;
    if (n == 0) {
        af_free(unknown);
        return true;
    }
    qsort(unknown, n, sizeof *unknown, compare_names);
    char list[900];
    size_t used = append(list, sizeof list, 0, "[");
    for (size_t i = 0; i < n; i++) {
        if (i) used = append(list, sizeof list, used, ", ");
        used = append_py_str(list, sizeof list, used, unknown[i]);
    }
    append(list, sizeof list, used, "]");
    af_free(unknown);
    snprintf(why->message, sizeof why->message, "FlashAttention-4 provider does not support kwargs: %s", list);
    snprintf(why->detail, sizeof why->detail, "attnforge reads attn_mask, dropout_p, is_causal, scale and enable_gqa%s",
             source == AF_QKV_KEYWORD ? " besides query, key and value" : "");
    return false;
}

bool af_sample_plan(const af_sample *s, af_plan *plan, af_refusal *why) {
    memset(why, 0, sizeof *why);
    memset(plan, 0, sizeof *plan);
    af_qkv_source source;
    if (!af_sample_qkv_source(s, &source))   /* _qkv_source */
        return refuse(why, "only supports positional or query/key/value qkv arguments",
                      "%zu positional argument%s; q/k/v must be exactly three positionals, or none and the query, key "
                      "and value keywords", s->nargs, s->nargs == 1 ? "" : "s");
    /* _normalize_sdpa_inputs, in its order */
    const af_value *mask = af_sample_kwarg(s, "attn_mask");
    if (mask && mask->kind != AF_VALUE_NONE)
        return refuse(why, "does not support attn_mask", "attn_mask is %s", af_value_kind_text(mask));
    double dropout;
    const af_value *dropout_value = af_sample_kwarg(s, "dropout_p");
    if (!af_value_read_number(dropout_value, &dropout) || dropout != 0.0) {
        if (dropout_value->kind == AF_VALUE_NUMBER)
            return refuse(why, "only supports dropout_p=0.0", "dropout_p is %g", dropout_value->number);
        return refuse(why, "only supports dropout_p=0.0", "dropout_p is %s", af_value_kind_text(dropout_value));
    }
    /* the seed pops is_causal, scale and enable_gqa unchecked; attnforge needs their types right */
    bool causal, has_scale, enable_gqa;
    double scale;
    if (!af_value_read_bool(af_sample_kwarg(s, "is_causal"), &causal))
        return refuse(why, "requires a bool is_causal", "is_causal is %s",
                      af_value_kind_text(af_sample_kwarg(s, "is_causal")));
    if (!af_value_read_scale(af_sample_kwarg(s, "scale"), &has_scale, &scale))
        return refuse(why, "requires scale to be None or a finite number", "scale is %s",
                      af_value_kind_text(af_sample_kwarg(s, "scale")));
    if (!af_value_read_bool(af_sample_kwarg(s, "enable_gqa"), &enable_gqa))
        return refuse(why, "requires a bool enable_gqa", "enable_gqa is %s",
                      af_value_kind_text(af_sample_kwarg(s, "enable_gqa")));
    if (!check_unknown_kwargs(s, source, why)) return false;

    const af_value *qkv[3];
    af_sample_qkv(s, source, qkv);
    bool uses_gqa = false;
    if (!validate_qkv(qkv, enable_gqa, &uses_gqa, why)) return false;
    af_backend backend = AF_BACKEND_CPU;
    if (!check_kernel_limits(qkv, &backend, why)) return false;

    plan->qkv_source = source;
    plan->causal = causal;
    plan->has_softmax_scale = has_scale;
    plan->softmax_scale = has_scale ? scale : 0.0;
    plan->gqa = uses_gqa;
    plan->copy_free_layout = true;
    for (int i = 0; i < 3; i++)
        plan->copy_free_layout &= af_hnd_is_nhd_contiguous(qkv[i]->tensor.view.shape, qkv[i]->tensor.view.strides);
    plan->backend = backend;
    return true;
}

bool af_plan_equal(const af_plan *a, const af_plan *b) {
    return a->qkv_source == b->qkv_source && a->causal == b->causal && a->has_softmax_scale == b->has_softmax_scale &&
           (!a->has_softmax_scale || a->softmax_scale == b->softmax_scale) && a->gqa == b->gqa &&
           a->copy_free_layout == b->copy_free_layout && a->backend == b->backend;
}

static const char *yes_no(bool b) { return b ? "true" : "false"; }

void af_plan_difference(const af_plan *a, const af_plan *b, char *text, size_t size) {
    if (a->qkv_source != b->qkv_source)
        snprintf(text, size, "qkv_source %s vs %s", af_qkv_source_name(a->qkv_source), af_qkv_source_name(b->qkv_source));
    else if (a->causal != b->causal)
        snprintf(text, size, "is_causal %s vs %s", yes_no(a->causal), yes_no(b->causal));
    else if (a->has_softmax_scale != b->has_softmax_scale || a->softmax_scale != b->softmax_scale) {
        char sa[32] = "None", sb[32] = "None";
        if (a->has_softmax_scale) snprintf(sa, sizeof sa, "%.17g", a->softmax_scale);
        if (b->has_softmax_scale) snprintf(sb, sizeof sb, "%.17g", b->softmax_scale);
        snprintf(text, size, "scale %s vs %s", sa, sb);
    } else if (a->gqa != b->gqa)
        snprintf(text, size, "grouped-query attention %s vs %s", yes_no(a->gqa), yes_no(b->gqa));
    else if (a->copy_free_layout != b->copy_free_layout)
        snprintf(text, size, "copy_free_layout %s vs %s", yes_no(a->copy_free_layout), yes_no(b->copy_free_layout));
    else if (a->backend != b->backend)
        snprintf(text, size, "backend %s vs %s", af_backend_name(a->backend), af_backend_name(b->backend));
    else
        snprintf(text, size, "nothing");
}

const char *af_qkv_source_name(af_qkv_source source) {
    return source == AF_QKV_KEYWORD ? "keyword_qkv" : "positional_qkv";
}

const char *af_backend_name(af_backend backend) {
    return backend == AF_BACKEND_FA4 ? "fa4" : backend == AF_BACKEND_CUDA ? "cuda" : "cpu";
}
