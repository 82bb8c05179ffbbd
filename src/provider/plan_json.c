/* The plan as JSON: the seed's to_dict/from_dict, plus a format version and the backend, validated field by
 * field (the seed validates nothing). */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/status.h"
#include "provider/file.h"
#include "provider/plan.h"
#include "provider/provider.h"

#define PLAN_FORMAT_VERSION 1

af_status af_provider_to_json(const af_provider *p, char **json_out) {
    af_clear_error();
    if (!p || !json_out) return af_fail(AF_ERR_INVALID_ARGUMENT, "provider and json_out: must not be NULL");
    *json_out = NULL;
    if (!p->prepared)
        return af_fail(AF_ERR_NOT_PREPARED, "Kernel provider %s must be prepared before serialization", af_provider_name(p));
    json_t *flash = json_object(), *root = json_object();
    bool ok = flash && root;
    ok = ok && json_object_set_new(flash, "causal", json_boolean(p->plan.causal)) == 0;
    if (ok && p->plan.has_softmax_scale) ok = json_object_set_new(flash, "softmax_scale", json_real(p->plan.softmax_scale)) == 0;
    if (ok && p->plan.gqa) ok = json_object_set_new(flash, "pack_gqa", json_false()) == 0;
    ok = ok && json_object_set_new(root, "type", json_string(AF_PROVIDER_TYPE)) == 0;
    ok = ok && json_object_set_new(root, "version", json_integer(PLAN_FORMAT_VERSION)) == 0;
    ok = ok && json_object_set_new(root, "qkv_source", json_string(af_qkv_source_name(p->plan.qkv_source))) == 0;
    ok = ok && json_object_set(root, "flash_kwargs", flash) == 0;
    ok = ok && json_object_set_new(root, "copy_free_layout", json_boolean(p->plan.copy_free_layout)) == 0;
    ok = ok && json_object_set_new(root, "backend", json_string(af_backend_name(p->plan.backend))) == 0;
    char *text = ok ? json_dumps(root, JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(17)) : NULL;
    json_decref(flash);
    json_decref(root);
    if (!text) return af_fail(AF_ERR_NO_MEMORY, "to_json: out of memory");
    *json_out = af_strdup(text);   /* callers free with af_free */
    free(text);
    return *json_out ? AF_OK : af_fail(AF_ERR_NO_MEMORY, "to_json: out of memory");
}

/* ---- reading */

static af_status field_error(const char *field, const char *fmt, const char *detail) {
    return af_fail(AF_ERR_PARSE, "plan: %s: %s%s", field, fmt, detail ? detail : "");
}

static af_status read_bool(json_t *obj, const char *key, const char *field, bool *out) {
    json_t *v = json_object_get(obj, key);
    if (!v) return field_error(field, "missing; expected true or false", NULL);
    if (!json_is_boolean(v)) return field_error(field, "must be true or false", NULL);
    *out = json_is_true(v);
    return AF_OK;
}

static af_status check_known_keys(json_t *obj, const char *where, const char *const *known, const char *expected) {
    const char *key;
    json_t *value;
    json_object_foreach(obj, key, value) {
        bool found = false;
        for (const char *const *k = known; *k; k++) found |= strcmp(key, *k) == 0;
        if (!found) return af_fail(AF_ERR_PARSE, "plan: %s%s: unknown field; expected %s", where, key, expected);
    }
    return AF_OK;
}

static af_status read_flash_kwargs(json_t *flash, af_plan *plan) {
    if (!flash) return field_error("flash_kwargs", "missing; expected an object with causal", NULL);
    if (!json_is_object(flash)) return field_error("flash_kwargs", "must be an object", NULL);
    static const char *const known[] = {"causal", "softmax_scale", "pack_gqa", NULL};
    af_status st = check_known_keys(flash, "flash_kwargs.", known, "causal, softmax_scale or pack_gqa");
    if (st != AF_OK) return st;
    if ((st = read_bool(flash, "causal", "flash_kwargs.causal", &plan->causal)) != AF_OK) return st;
    json_t *scale = json_object_get(flash, "softmax_scale");
    if (scale) {
        if (!json_is_number(scale)) return field_error("flash_kwargs.softmax_scale", "must be a number", NULL);
        plan->has_softmax_scale = true;
        plan->softmax_scale = json_number_value(scale);
        if (!isfinite(plan->softmax_scale)) return field_error("flash_kwargs.softmax_scale", "must be finite", NULL);
    }
    json_t *pack = json_object_get(flash, "pack_gqa");
    if (pack) {
        if (!json_is_false(pack))
            return field_error("flash_kwargs.pack_gqa", "must be false (it marks a grouped-query plan)", NULL);
        plan->gqa = true;
    }
    return AF_OK;
}

static af_status read_plan(json_t *root, af_plan *plan) {
    if (!json_is_object(root)) return af_fail(AF_ERR_PARSE, "plan: expected a JSON object at the top level");
    json_t *type = json_object_get(root, "type");
    if (!type) return field_error("type", "missing; expected \"" AF_PROVIDER_TYPE "\"", NULL);
    if (!json_is_string(type)) return field_error("type", "must be the string \"" AF_PROVIDER_TYPE "\"", NULL);
    if (strcmp(json_string_value(type), AF_PROVIDER_TYPE) != 0)
        return af_fail(AF_ERR_PARSE, "plan: type: invalid kernel provider type for " AF_PROVIDER_TYPE ": \"%s\"",
                       json_string_value(type));
    json_t *version = json_object_get(root, "version");   /* absent: the seed's own form */
    if (version) {
        if (!json_is_integer(version)) return field_error("version", "must be an integer", NULL);
        json_int_t v = json_integer_value(version);
        if (v > PLAN_FORMAT_VERSION)
            return af_fail(AF_ERR_PARSE,
                           "plan: version: format %lld is newer than this attnforge %s reads (up to %d); upgrade attnforge",
                           (long long)v, AF_VERSION_STRING, PLAN_FORMAT_VERSION);
        if (v < 1) return af_fail(AF_ERR_PARSE, "plan: version: %lld is not a format version (1 or absent)", (long long)v);
    }
    static const char *const known[] = {"type", "version", "qkv_source", "flash_kwargs", "copy_free_layout", "backend", NULL};
    af_status st = check_known_keys(root, "", known, "type, version, qkv_source, flash_kwargs, copy_free_layout or backend");
    if (st != AF_OK) return st;
    json_t *source = json_object_get(root, "qkv_source");
    if (!source) return field_error("qkv_source", "missing; expected \"positional_qkv\" or \"keyword_qkv\"", NULL);
    if (!json_is_string(source)) return field_error("qkv_source", "must be \"positional_qkv\" or \"keyword_qkv\"", NULL);
    if (strcmp(json_string_value(source), "positional_qkv") == 0) plan->qkv_source = AF_QKV_POSITIONAL;
    else if (strcmp(json_string_value(source), "keyword_qkv") == 0) plan->qkv_source = AF_QKV_KEYWORD;
    else
        return af_fail(AF_ERR_PARSE, "plan: qkv_source: \"%s\" is neither \"positional_qkv\" nor \"keyword_qkv\"",
                       json_string_value(source));
    if ((st = read_flash_kwargs(json_object_get(root, "flash_kwargs"), plan)) != AF_OK) return st;
    if ((st = read_bool(root, "copy_free_layout", "copy_free_layout", &plan->copy_free_layout)) != AF_OK) return st;
    json_t *backend = json_object_get(root, "backend");   /* absent: cpu (the seed's form has none) */
    if (backend) {   /* fa4: FlashAttention-4 itself, which the Python provider runs (docs/PROVIDER.md) */
        if (!json_is_string(backend)) return field_error("backend", "must be \"cpu\", \"cuda\" or \"fa4\"", NULL);
        if (strcmp(json_string_value(backend), "cpu") == 0) plan->backend = AF_BACKEND_CPU;
        else if (strcmp(json_string_value(backend), "cuda") == 0) plan->backend = AF_BACKEND_CUDA;
        else if (strcmp(json_string_value(backend), "fa4") == 0) plan->backend = AF_BACKEND_FA4;
        else
            return af_fail(AF_ERR_PARSE, "plan: backend: \"%s\" is none of \"cpu\", \"cuda\" and \"fa4\"",
                           json_string_value(backend));
    }
    return AF_OK;
}

af_status af_provider_from_json(const char *json, size_t len, af_provider **out) {
    af_clear_error();
    if (!out) return af_fail(AF_ERR_INVALID_ARGUMENT, "out: must not be NULL");
    *out = NULL;
    if (!json) return af_fail(AF_ERR_INVALID_ARGUMENT, "json: must not be NULL");
    json_error_t error;
    memset(&error, 0, sizeof error);   /* jansson leaves the code unset when its first allocation fails */
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &error);
    if (!root && (json_error_code(&error) == json_error_out_of_memory || error.text[0] == '\0'))
        return af_fail(AF_ERR_NO_MEMORY, "plan: out of memory while reading the JSON");
    if (!root)
        return af_fail(AF_ERR_PARSE, "plan: malformed JSON at line %d, column %d: %s", error.line, error.column, error.text);
    af_plan plan;
    memset(&plan, 0, sizeof plan);
    af_status st = read_plan(root, &plan);
    json_decref(root);
    if (st != AF_OK) return st;
    af_provider *p = af_provider_new();
    if (!p) return af_fail(AF_ERR_NO_MEMORY, "from_json: out of memory");
    p->plan = plan;
    p->prepared = true;
    *out = p;
    return AF_OK;
}

af_status af_provider_load(const char *path, af_provider **out) {
    af_clear_error();
    if (!out) return af_fail(AF_ERR_INVALID_ARGUMENT, "out: must not be NULL");
    *out = NULL;
    if (!path) return af_fail(AF_ERR_INVALID_ARGUMENT, "path: must not be NULL");
    char *text;
    size_t len;
    af_status st = af_read_text_file(path, &text, &len);
    if (st != AF_OK) return st;
    st = af_provider_from_json(text, len, out);
    af_free(text);
    return af_error_with_path(st, path);
}
