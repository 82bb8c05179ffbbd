/* The sample model's memory: lists of recorded calls, built from JSON (sample_json.c) or from C calls. */
#include "provider/sample.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/status.h"

static const struct {
    const char *name;
    bool known;
    af_dtype dtype;
} torch_dtypes[] = {
    {"float32", true, AF_F32}, {"float16", true, AF_F16}, {"bfloat16", true, AF_BF16}, {"bool", true, AF_BOOL},
    {"float64", false, AF_F32}, {"complex64", false, AF_F32}, {"complex128", false, AF_F32},
    {"uint8", false, AF_F32}, {"int8", false, AF_F32}, {"int16", false, AF_F32}, {"int32", false, AF_F32},
    {"int64", false, AF_F32}, {"float8_e4m3fn", false, AF_F32}, {"float8_e5m2", false, AF_F32},
};

const char *af_torch_dtype_name(const char *name, bool *known, af_dtype *dtype) {
    for (size_t i = 0; i < sizeof torch_dtypes / sizeof torch_dtypes[0]; i++)
        if (strcmp(name, torch_dtypes[i].name) == 0) {
            *known = torch_dtypes[i].known;
            *dtype = torch_dtypes[i].dtype;
            return torch_dtypes[i].name;
        }
    return NULL;
}

void af_contiguous_strides(const int64_t *shape, int ndim, int64_t *strides) {
    int64_t stride = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        strides[d] = stride;
        const int64_t size = shape[d] > 1 ? shape[d] : 1;
        if (__builtin_mul_overflow(stride, size, &stride)) stride = INT64_MAX;
    }
}

bool af_device_from_name(const char *name, af_device *device) {
    memset(device, 0, sizeof *device);
    if (strcmp(name, "cpu") == 0) return true;
    if (strncmp(name, "cuda", 4) != 0) return false;
    long index = 0;
    if (name[4] == ':') {   /* digits only, as torch.device writes them */
        const char *digits = name + 5;
        if (*digits == '\0' || strspn(digits, "0123456789") != strlen(digits) || strlen(digits) > 9) return false;
        index = strtol(digits, NULL, 10);
    } else if (name[4] != '\0') {
        return false;
    }
    device->type = AF_DEVICE_CUDA;
    device->index = (int)index;
    return true;
}

void af_device_name(af_device device, char *name, size_t size) {
    if (device.type == AF_DEVICE_CUDA) snprintf(name, size, "cuda:%d", device.index);
    else snprintf(name, size, "cpu");
}

af_tensor_desc af_tensor_desc_from_view(const af_tensor *view, const char *device) {
    af_tensor_desc d;
    memset(&d, 0, sizeof d);
    d.view = *view;
    d.view.data = NULL;
    char own[AF_DEVICE_NAME_MAX];
    if (!device) {
        af_device_name(view->device, own, sizeof own);
        device = own;
    } else if (!af_device_from_name(device, &d.view.device)) {
        memset(&d.view.device, 0, sizeof d.view.device);   /* a device attnforge lacks: prepare refuses it by name */
    }
    d.dtype_known = true;
    d.dtype_name = af_dtype_name(view->dtype);
    int64_t contiguous[AF_MAX_DIMS];
    af_contiguous_strides(view->shape, view->ndim, contiguous);   /* ndim was checked by the caller */
    d.strides_given = memcmp(contiguous, view->strides, sizeof(int64_t) * (size_t)view->ndim) != 0;
    d.device_given = strcmp(device, "cpu") != 0;
    snprintf(d.device, sizeof d.device, "%s", device);
    return d;
}

const char *af_value_kind_text(const af_value *value) {
    switch (value->kind) {
    case AF_VALUE_NONE: return "None";
    case AF_VALUE_BOOL: return "a bool";
    case AF_VALUE_NUMBER: return "a number";
    case AF_VALUE_TENSOR: return "a tensor";
    case AF_VALUE_OTHER:
        if (value->other_json && value->other_json[0] == '"') return "a string";
        if (value->other_json && value->other_json[0] == '[') return "a list";
        return "a value";
    }
    return "a value";
}

void af_value_clear(af_value *value) {
    af_free(value->other_json);
    memset(value, 0, sizeof *value);
}

void af_sample_clear(af_sample *sample) {
    for (size_t i = 0; i < sample->nargs; i++) af_value_clear(&sample->args[i]);
    for (size_t i = 0; i < sample->nkwargs; i++) {
        af_free(sample->kwargs[i].name);
        af_value_clear(&sample->kwargs[i].value);
    }
    af_free(sample->args);
    af_free(sample->kwargs);
    memset(sample, 0, sizeof *sample);
}

const af_value *af_sample_kwarg(const af_sample *sample, const char *name) {
    for (size_t i = 0; i < sample->nkwargs; i++)
        if (strcmp(sample->kwargs[i].name, name) == 0) return &sample->kwargs[i].value;
    return NULL;
}

af_samples *af_samples_new(void) { return af_alloc_zeroed(sizeof(af_samples)); }

size_t af_samples_count(const af_samples *samples) { return samples ? samples->size : 0; }

void af_samples_free(af_samples *samples) {
    if (!samples) return;
    for (size_t i = 0; i < samples->size; i++) af_sample_clear(&samples->items[i]);
    af_free(samples->items);
    af_free(samples);
}

af_status af_samples_append(af_samples *samples, af_sample *sample) {
    if (samples->size == samples->capacity) {
        size_t capacity = samples->capacity ? samples->capacity * 2 : 8;
        af_sample *grown = af_alloc(capacity * sizeof *grown);
        if (!grown) {
            af_sample_clear(sample);
            return af_fail(AF_ERR_NO_MEMORY, "samples: out of memory for %zu samples", capacity);
        }
        if (samples->size) memcpy(grown, samples->items, samples->size * sizeof *grown);
        af_free(samples->items);
        samples->items = grown;
        samples->capacity = capacity;
    }
    samples->items[samples->size++] = *sample;
    memset(sample, 0, sizeof *sample);
    return AF_OK;
}

/* ---- building a sample from a C call */

static af_value tensor_value(const af_tensor *t, const char *device) {
    af_value v;
    memset(&v, 0, sizeof v);
    v.kind = AF_VALUE_TENSOR;
    v.tensor = af_tensor_desc_from_view(t, device);
    return v;
}

static af_value bool_value(bool b) {
    af_value v;
    memset(&v, 0, sizeof v);
    v.kind = AF_VALUE_BOOL;
    v.boolean = b;
    return v;
}

static af_value number_value(double x) {
    af_value v;
    memset(&v, 0, sizeof v);
    v.kind = AF_VALUE_NUMBER;
    v.number = x;
    return v;
}

static af_status add_kwarg(af_sample *s, const char *name, af_value value) {
    s->kwargs[s->nkwargs].name = af_strdup(name);
    if (!s->kwargs[s->nkwargs].name) return af_fail(AF_ERR_NO_MEMORY, "samples: out of memory");
    s->kwargs[s->nkwargs++].value = value;
    return AF_OK;
}

static af_status check_descriptor(const af_tensor *t, const char *name) {
    if (!t) return af_fail(AF_ERR_INVALID_ARGUMENT, "args.%s: must not be NULL", name);
    if (t->ndim < 0 || t->ndim > AF_MAX_DIMS)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "args.%s: ndim %d is outside 0..%d", name, t->ndim, AF_MAX_DIMS);
    if (af_dtype_size(t->dtype) == 0)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "args.%s: unknown dtype code %d", name, (int)t->dtype);
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] < 0)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "args.%s: shape[%d] is %lld; sizes must be >= 0", name, d,
                           (long long)t->shape[d]);
    return AF_OK;
}

af_status af_samples_add_call(af_samples *samples, const af_sdpa_args *args, af_qkv_source source,
                              const char *device, long count) {
    af_clear_error();
    if (!samples) return af_fail(AF_ERR_INVALID_ARGUMENT, "samples: must not be NULL");
    if (!args) return af_fail(AF_ERR_INVALID_ARGUMENT, "args: must not be NULL");
    if (source != AF_QKV_POSITIONAL && source != AF_QKV_KEYWORD)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "source: must be AF_QKV_POSITIONAL or AF_QKV_KEYWORD, got %d", (int)source);
    if (count < 1) return af_fail(AF_ERR_INVALID_ARGUMENT, "count: must be at least 1, got %ld", count);
    if (device && (!*device || strlen(device) >= AF_DEVICE_NAME_MAX))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "device: must be 1..%d characters", AF_DEVICE_NAME_MAX - 1);
    af_status st;
    if ((st = check_descriptor(args->query, "query")) != AF_OK || (st = check_descriptor(args->key, "key")) != AF_OK ||
        (st = check_descriptor(args->value, "value")) != AF_OK)
        return st;
    if (args->attn_mask && (st = check_descriptor(args->attn_mask, "attn_mask")) != AF_OK) return st;
    if (!isfinite(args->dropout_p)) return af_fail(AF_ERR_INVALID_ARGUMENT, "args.dropout_p: must be finite, got %g", args->dropout_p);
    if (args->has_scale && !isfinite(args->scale))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "args.scale: must be finite, got %g", args->scale);

    enum { MAX_KWARGS = 9 };   /* query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_bottom_right */
    af_sample s = {0};
    s.count = count;
    s.kwargs = af_alloc_zeroed(MAX_KWARGS * sizeof *s.kwargs);
    s.args = af_alloc_zeroed(3 * sizeof *s.args);
    if (!s.kwargs || !s.args) {
        af_sample_clear(&s);
        return af_fail(AF_ERR_NO_MEMORY, "samples: out of memory");
    }
    const af_tensor *qkv[3] = {args->query, args->key, args->value};
    static const char *const qkv_names[3] = {"query", "key", "value"};
    for (int i = 0; i < 3 && st == AF_OK; i++) {
        if (source == AF_QKV_POSITIONAL) s.args[s.nargs++] = tensor_value(qkv[i], device);
        else st = add_kwarg(&s, qkv_names[i], tensor_value(qkv[i], device));
    }
    /* only what differs from SDPA's defaults, as a Python caller would write it */
    if (st == AF_OK && args->attn_mask) st = add_kwarg(&s, "attn_mask", tensor_value(args->attn_mask, device));
    if (st == AF_OK && args->dropout_p != 0.0) st = add_kwarg(&s, "dropout_p", number_value(args->dropout_p));
    if (st == AF_OK && args->is_causal) st = add_kwarg(&s, "is_causal", bool_value(true));
    if (st == AF_OK && args->has_scale) st = add_kwarg(&s, "scale", number_value(args->scale));
    if (st == AF_OK && args->enable_gqa) st = add_kwarg(&s, "enable_gqa", bool_value(true));
    if (st == AF_OK && args->causal_bottom_right) st = add_kwarg(&s, "causal_bottom_right", bool_value(true));
    if (st != AF_OK) {
        af_sample_clear(&s);
        return st;
    }
    return af_samples_append(samples, &s);
}
