/* The samples file (docs/FORMATS.md): {"samples": [{"args": [...], "kwargs": {...}, "count": N}, ...]},
 * read and written with jansson. Every error names the field by its path, e.g. samples[0].args[2].strides. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/status.h"
#include "provider/file.h"
#include "provider/sample.h"

static af_status bad(const char *path, const char *rule) { return af_fail(AF_ERR_PARSE, "samples file: %s: %s", path, rule); }

static af_status check_keys(json_t *obj, const char *path, const char *const *known, const char *expected) {
    const char *key;
    json_t *value;
    json_object_foreach(obj, key, value) {
        bool found = false;
        for (const char *const *k = known; *k; k++) found |= strcmp(key, *k) == 0;
        if (!found)
            return af_fail(AF_ERR_PARSE, "samples file: %s%s%s: unknown field; expected %s", path, *path ? "." : "", key,
                           expected);
    }
    return AF_OK;
}

static af_status read_int_list(json_t *list, const char *path, int64_t *out, int *n, bool non_negative) {
    if (!json_is_array(list)) return bad(path, "must be a list of whole numbers");
    if (json_array_size(list) > AF_MAX_DIMS)
        return af_fail(AF_ERR_PARSE, "samples file: %s: %zu dimensions; attnforge reads at most %d", path,
                       json_array_size(list), AF_MAX_DIMS);
    *n = (int)json_array_size(list);
    for (int i = 0; i < *n; i++) {
        json_t *item = json_array_get(list, (size_t)i);
        if (!json_is_integer(item))
            return af_fail(AF_ERR_PARSE, "samples file: %s[%d]: must be a whole number", path, i);
        out[i] = json_integer_value(item);
        if (non_negative && out[i] < 0)
            return af_fail(AF_ERR_PARSE, "samples file: %s[%d]: %lld; sizes must be >= 0", path, i, (long long)out[i]);
    }
    return AF_OK;
}

static af_status read_tensor(json_t *obj, const char *path, af_tensor_desc *t) {
    static const char *const known[] = {"shape", "dtype", "strides", "device", NULL};
    af_status st = check_keys(obj, path, known, "shape, dtype, strides or device");
    if (st != AF_OK) return st;
    char field[400];
    json_t *shape = json_object_get(obj, "shape"), *dtype = json_object_get(obj, "dtype");
    json_t *strides = json_object_get(obj, "strides"), *device = json_object_get(obj, "device");
    snprintf(field, sizeof field, "%s.shape", path);
    if (!shape) return bad(field, "missing; a tensor has a shape (a list of sizes)");
    int ndim;
    if ((st = read_int_list(shape, field, t->view.shape, &ndim, true)) != AF_OK) return st;
    snprintf(field, sizeof field, "%s.dtype", path);
    if (!dtype) return bad(field, "missing; expected float32, float16, bfloat16 or bool");
    if (!json_is_string(dtype)) return bad(field, "must be a dtype name such as \"float16\"");
    af_dtype code = AF_F32;
    t->dtype_name = af_torch_dtype_name(json_string_value(dtype), &t->dtype_known, &code);
    if (!t->dtype_name)
        return af_fail(AF_ERR_PARSE, "samples file: %s: \"%s\" is not a PyTorch dtype name; expected float32, float16, "
                       "bfloat16 or bool", field, json_string_value(dtype));
    t->view.dtype = code;
    t->view.ndim = ndim;
    af_contiguous_strides(t->view.shape, ndim, t->view.strides);
    if (strides) {
        snprintf(field, sizeof field, "%s.strides", path);
        int nstrides;
        if ((st = read_int_list(strides, field, t->view.strides, &nstrides, false)) != AF_OK) return st;
        if (nstrides != ndim)
            return af_fail(AF_ERR_PARSE, "samples file: %s: %d strides for a %d-dimensional shape", field, nstrides, ndim);
        t->strides_given = true;
    }
    snprintf(t->device, sizeof t->device, "cpu");
    if (device) {
        snprintf(field, sizeof field, "%s.device", path);
        if (!json_is_string(device) || json_string_length(device) == 0 || json_string_length(device) >= AF_DEVICE_NAME_MAX)
            return af_fail(AF_ERR_PARSE, "samples file: %s: must be a device name of 1..%d characters such as \"cpu\"",
                           field, AF_DEVICE_NAME_MAX - 1);
        snprintf(t->device, sizeof t->device, "%s", json_string_value(device));
        t->device_given = true;
        (void)af_device_from_name(t->device, &t->view.device);   /* another device stays a name: prepare refuses it */
    }
    return AF_OK;
}

static af_status read_value(json_t *json, const char *path, af_value *v) {
    memset(v, 0, sizeof *v);
    if (json_is_null(json)) {
        v->kind = AF_VALUE_NONE;
    } else if (json_is_boolean(json)) {
        v->kind = AF_VALUE_BOOL;
        v->boolean = json_is_true(json);
    } else if (json_is_integer(json)) {
        v->kind = AF_VALUE_NUMBER;
        v->number_is_integer = true;
        v->integer = json_integer_value(json);
        v->number = (double)v->integer;
    } else if (json_is_real(json)) {
        v->kind = AF_VALUE_NUMBER;
        v->number = json_real_value(json);
    } else if (json_is_object(json)) {
        v->kind = AF_VALUE_TENSOR;
        return read_tensor(json, path, &v->tensor);
    } else {   /* a string or list: not SDPA's, but kept so prepare can refuse it by name */
        v->kind = AF_VALUE_OTHER;
        char *text = json_dumps(json, JSON_ENCODE_ANY | JSON_COMPACT);
        v->other_json = text ? af_strdup(text) : NULL;
        free(text);
        if (!v->other_json) return af_fail(AF_ERR_NO_MEMORY, "samples file: %s: out of memory", path);
    }
    return AF_OK;
}

static af_status read_sample(json_t *obj, size_t index, af_sample *s) {
    char path[48];
    snprintf(path, sizeof path, "samples[%zu]", index);
    if (!json_is_object(obj)) return bad(path, "must be an object with args, kwargs and count");
    static const char *const known[] = {"args", "kwargs", "count", NULL};
    af_status st = check_keys(obj, path, known, "args, kwargs or count");
    if (st != AF_OK) return st;
    json_t *args = json_object_get(obj, "args"), *kwargs = json_object_get(obj, "kwargs"), *count = json_object_get(obj, "count");
    s->count = 1;
    if (count) {
        if (!json_is_integer(count) || json_integer_value(count) < 1 || json_integer_value(count) > 1000000000000LL)
            return af_fail(AF_ERR_PARSE, "samples file: %s.count: must be a whole number from 1 (how often the call was seen)",
                           path);
        s->count = (long)json_integer_value(count);
    }
    if (args && !json_is_array(args)) return af_fail(AF_ERR_PARSE, "samples file: %s.args: must be a list", path);
    if (kwargs && !json_is_object(kwargs)) return af_fail(AF_ERR_PARSE, "samples file: %s.kwargs: must be an object", path);
    const size_t nargs = args ? json_array_size(args) : 0, nkwargs = kwargs ? json_object_size(kwargs) : 0;
    s->args = af_alloc_zeroed((nargs ? nargs : 1) * sizeof *s->args);
    s->kwargs = af_alloc_zeroed((nkwargs ? nkwargs : 1) * sizeof *s->kwargs);
    if (!s->args || !s->kwargs) return af_fail(AF_ERR_NO_MEMORY, "samples file: %s: out of memory", path);
    for (size_t i = 0; i < nargs; i++) {
        char item[320];
        snprintf(item, sizeof item, "%s.args[%zu]", path, i);
        s->nargs = i + 1;   /* counted before reading so a failure frees what was read */
        if ((st = read_value(json_array_get(args, i), item, &s->args[i])) != AF_OK) return st;
    }
    const char *key;
    json_t *value;
    if (kwargs) json_object_foreach(kwargs, key, value) {
        char item[320];
        snprintf(item, sizeof item, "%s.kwargs.%s", path, key);
        af_kwarg *kw = &s->kwargs[s->nkwargs++];
        kw->name = af_strdup(key);
        if (!kw->name) return af_fail(AF_ERR_NO_MEMORY, "samples file: %s: out of memory", item);
        if ((st = read_value(value, item, &kw->value)) != AF_OK) return st;
    }
    return AF_OK;
}

af_status af_samples_from_json(const char *json, size_t len, af_samples **out) {
    af_clear_error();
    if (!out) return af_fail(AF_ERR_INVALID_ARGUMENT, "out: must not be NULL");
    *out = NULL;
    if (!json) return af_fail(AF_ERR_INVALID_ARGUMENT, "json: must not be NULL");
    json_error_t error;
    memset(&error, 0, sizeof error);   /* jansson leaves the code unset when its first allocation fails */
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &error);
    if (!root && (json_error_code(&error) == json_error_out_of_memory || error.text[0] == '\0'))
        return af_fail(AF_ERR_NO_MEMORY, "samples file: out of memory while reading the JSON");
    if (!root)
        return af_fail(AF_ERR_PARSE, "samples file: malformed JSON at line %d, column %d: %s", error.line, error.column,
                       error.text);
    af_status st = AF_OK;
    json_t *list = json_object_get(root, "samples");
    static const char *const known[] = {"samples", NULL};
    if (!json_is_object(root)) st = af_fail(AF_ERR_PARSE, "samples file: expected a JSON object {\"samples\": [...]}");
    else if ((st = check_keys(root, "", known, "samples")) != AF_OK) {
    } else if (!list) st = bad("samples", "missing; expected a list of recorded calls");
    else if (!json_is_array(list)) st = bad("samples", "must be a list of recorded calls");
    af_samples *samples = st == AF_OK ? af_samples_new() : NULL;
    if (st == AF_OK && !samples) st = af_fail(AF_ERR_NO_MEMORY, "samples file: out of memory");
    for (size_t i = 0; st == AF_OK && i < json_array_size(list); i++) {
        af_sample s = {0};
        st = read_sample(json_array_get(list, i), i, &s);
        if (st == AF_OK) st = af_samples_append(samples, &s);
        else af_sample_clear(&s);
    }
    json_decref(root);
    if (st != AF_OK) {
        af_samples_free(samples);
        return st;
    }
    *out = samples;
    return AF_OK;
}

af_status af_samples_load(const char *path, af_samples **out) {
    af_clear_error();
    if (!out) return af_fail(AF_ERR_INVALID_ARGUMENT, "out: must not be NULL");
    *out = NULL;
    if (!path) return af_fail(AF_ERR_INVALID_ARGUMENT, "path: must not be NULL");
    char *text;
    size_t len;
    af_status st = af_read_text_file(path, &text, &len);
    if (st != AF_OK) return st;
    st = af_samples_from_json(text, len, out);
    af_free(text);
    return af_error_with_path(st, path);
}

/* ---- writing */

static json_t *int_list(const int64_t *values, int n) {
    json_t *list = json_array();
    for (int i = 0; list && i < n; i++)
        if (json_array_append_new(list, json_integer(values[i])) != 0) {
            json_decref(list);
            return NULL;
        }
    return list;
}

static json_t *write_value(const af_value *v) {
    switch (v->kind) {
    case AF_VALUE_NONE: return json_null();
    case AF_VALUE_BOOL: return json_boolean(v->boolean);
    case AF_VALUE_NUMBER: return v->number_is_integer ? json_integer(v->integer) : json_real(v->number);
    case AF_VALUE_OTHER: return json_loads(v->other_json, JSON_DECODE_ANY, NULL);
    case AF_VALUE_TENSOR: break;
    }
    const af_tensor_desc *t = &v->tensor;
    json_t *obj = json_object();
    bool ok = obj && json_object_set_new(obj, "shape", int_list(t->view.shape, t->view.ndim)) == 0 &&
              json_object_set_new(obj, "dtype", json_string(t->dtype_name)) == 0;
    if (ok && t->strides_given) ok = json_object_set_new(obj, "strides", int_list(t->view.strides, t->view.ndim)) == 0;
    if (ok && t->device_given) ok = json_object_set_new(obj, "device", json_string(t->device)) == 0;
    if (!ok) {
        json_decref(obj);
        return NULL;
    }
    return obj;
}

static json_t *write_sample(const af_sample *s) {
    json_t *obj = json_object(), *args = json_array(), *kwargs = json_object();
    bool ok = obj && args && kwargs;
    for (size_t i = 0; ok && i < s->nargs; i++) ok = json_array_append_new(args, write_value(&s->args[i])) == 0;
    for (size_t i = 0; ok && i < s->nkwargs; i++)
        ok = json_object_set_new(kwargs, s->kwargs[i].name, write_value(&s->kwargs[i].value)) == 0;
    ok = ok && json_object_set(obj, "args", args) == 0 && json_object_set(obj, "kwargs", kwargs) == 0 &&
         json_object_set_new(obj, "count", json_integer(s->count)) == 0;
    json_decref(args);
    json_decref(kwargs);
    if (!ok) {
        json_decref(obj);
        return NULL;
    }
    return obj;
}

af_status af_samples_to_json(const af_samples *samples, char **json_out) {
    af_clear_error();
    if (!samples || !json_out) return af_fail(AF_ERR_INVALID_ARGUMENT, "samples and json_out: must not be NULL");
    *json_out = NULL;
    json_t *root = json_object(), *list = json_array();
    bool ok = root && list;
    for (size_t i = 0; ok && i < samples->size; i++) ok = json_array_append_new(list, write_sample(&samples->items[i])) == 0;
    ok = ok && json_object_set(root, "samples", list) == 0;
    char *text = ok ? json_dumps(root, JSON_PRESERVE_ORDER | JSON_INDENT(1) | JSON_REAL_PRECISION(17)) : NULL;
    json_decref(list);
    json_decref(root);
    if (!text) return af_fail(AF_ERR_NO_MEMORY, "samples to_json: out of memory");
    *json_out = af_strdup(text);
    free(text);
    return *json_out ? AF_OK : af_fail(AF_ERR_NO_MEMORY, "samples to_json: out of memory");
}
