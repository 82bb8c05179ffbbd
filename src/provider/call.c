/* A sample read as an SDPA call: the seed's q/k/v extraction, typed keyword values, af_samples_get_call. */
#include "provider/call.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/status.h"

static const char *const qkv_names[3] = {"query", "key", "value"};

bool af_sample_qkv_source(const af_sample *sample, af_qkv_source *source) {
    if (sample->nargs == 3) {
        *source = AF_QKV_POSITIONAL;
        return true;
    }
    if (sample->nargs == 0 && af_sample_kwarg(sample, "query") && af_sample_kwarg(sample, "key") &&
        af_sample_kwarg(sample, "value")) {
        *source = AF_QKV_KEYWORD;
        return true;
    }
    return false;
}

void af_sample_qkv(const af_sample *sample, af_qkv_source source, const af_value *qkv[3]) {
    for (int i = 0; i < 3; i++)
        qkv[i] = source == AF_QKV_POSITIONAL ? &sample->args[i] : af_sample_kwarg(sample, qkv_names[i]);
}

bool af_sample_kwarg_is_known(const char *name, af_qkv_source source) {
    static const char *const known[] = {"attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"};
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (strcmp(name, known[i]) == 0) return true;
    if (source == AF_QKV_KEYWORD)
        for (int i = 0; i < 3; i++)
            if (strcmp(name, qkv_names[i]) == 0) return true;
    return false;
}

bool af_value_read_bool(const af_value *value, bool *out) {
    *out = false;
    if (!value) return true;
    if (value->kind != AF_VALUE_BOOL) return false;
    *out = value->boolean;
    return true;
}

bool af_value_read_scale(const af_value *value, bool *has_scale, double *scale) {
    *has_scale = false;
    *scale = 0.0;
    if (!value || value->kind == AF_VALUE_NONE) return true;
    if (value->kind != AF_VALUE_NUMBER || !isfinite(value->number)) return false;
    *has_scale = true;
    *scale = value->number;
    return true;
}

bool af_value_read_number(const af_value *value, double *out) {
    *out = 0.0;
    if (!value) return true;
    if (value->kind == AF_VALUE_BOOL) {   /* Python: False == 0.0 */
        *out = value->boolean ? 1.0 : 0.0;
        return true;
    }
    if (value->kind != AF_VALUE_NUMBER) return false;
    *out = value->number;
    return true;
}

/* ---- af_samples_get_call */

static af_status read_tensor(const af_value *value, const char *name, size_t index, af_tensor *out) {
    if (value->kind != AF_VALUE_TENSOR)
        return af_fail(AF_ERR_UNSUPPORTED, "samples[%zu].%s: is %s, not a tensor", index, name, af_value_kind_text(value));
    if (!value->tensor.dtype_known)
        return af_fail(AF_ERR_UNSUPPORTED, "samples[%zu].%s: dtype %s is not one attnforge computes in", index, name,
                       value->tensor.dtype_name);
    *out = value->tensor.view;
    if (!af_device_from_name(value->tensor.device, &out->device))   /* the view says where the call runs */
        return af_fail(AF_ERR_UNSUPPORTED, "samples[%zu].%s: device '%s' is not one attnforge runs on (cpu, cuda:N)",
                       index, name, value->tensor.device);
    return AF_OK;
}

af_sdpa_args af_sample_call_args(const af_sample_call *call) {
    af_sdpa_args args;
    memset(&args, 0, sizeof args);
    if (!call) return args;
    args.query = &call->query;
    args.key = &call->key;
    args.value = &call->value;
    args.attn_mask = call->has_attn_mask ? &call->attn_mask : NULL;
    args.dropout_p = call->dropout_p;
    args.is_causal = call->is_causal;
    args.has_scale = call->has_scale;
    args.scale = call->scale;
    args.enable_gqa = call->enable_gqa;
    return args;
}

af_status af_samples_get_call(const af_samples *samples, size_t index, af_sample_call *out) {
    af_clear_error();
    if (!samples || !out) return af_fail(AF_ERR_INVALID_ARGUMENT, "samples and out: must not be NULL");
    if (index >= samples->size)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "index: %zu is beyond the %zu samples", index, samples->size);
    const af_sample *s = &samples->items[index];
    af_sample_call call;
    memset(&call, 0, sizeof call);
    call.count = s->count;
    if (!af_sample_qkv_source(s, &call.source))
        return af_fail(AF_ERR_UNSUPPORTED,
                       "samples[%zu]: q/k/v must be three positional arguments or the query/key/value keywords "
                       "(got %zu positional)", index, s->nargs);
    const af_value *qkv[3];
    af_sample_qkv(s, call.source, qkv);
    af_tensor *views[3] = {&call.query, &call.key, &call.value};
    af_status st;
    for (int i = 0; i < 3; i++)
        if ((st = read_tensor(qkv[i], qkv_names[i], index, views[i])) != AF_OK) return st;
    snprintf(call.device, sizeof call.device, "%s", qkv[0]->tensor.device);

    const af_value *mask = af_sample_kwarg(s, "attn_mask");
    if (mask && mask->kind != AF_VALUE_NONE) {
        if ((st = read_tensor(mask, "attn_mask", index, &call.attn_mask)) != AF_OK) return st;
        call.has_attn_mask = true;
    }
    if (!af_value_read_number(af_sample_kwarg(s, "dropout_p"), &call.dropout_p))
        return af_fail(AF_ERR_UNSUPPORTED, "samples[%zu].dropout_p: must be a number", index);
    if (!af_value_read_bool(af_sample_kwarg(s, "is_causal"), &call.is_causal))
        return af_fail(AF_ERR_UNSUPPORTED, "samples[%zu].is_causal: must be a bool", index);
    if (!af_value_read_scale(af_sample_kwarg(s, "scale"), &call.has_scale, &call.scale))
        return af_fail(AF_ERR_UNSUPPORTED, "samples[%zu].scale: must be None or a finite number", index);
    if (!af_value_read_bool(af_sample_kwarg(s, "enable_gqa"), &call.enable_gqa))
        return af_fail(AF_ERR_UNSUPPORTED, "samples[%zu].enable_gqa: must be a bool", index);
    for (size_t i = 0; i < s->nkwargs; i++)
        if (!af_sample_kwarg_is_known(s->kwargs[i].name, call.source))
            return af_fail(AF_ERR_UNSUPPORTED, "samples[%zu].kwargs: '%s' is not an argument scaled_dot_product_attention takes here",
                           index, s->kwargs[i].name);
    *out = call;
    return AF_OK;
}
