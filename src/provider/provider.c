/* The provider's life: new, prepare (samples -> one plan), its name and runtime, free. */
#include "provider/provider.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "core/alloc.h"
#include "core/log.h"
#include "core/status.h"
#include "provider/plan.h"
#include "provider/sample.h"

#define SEED_COPY_WARNING                                                                                           \
    "FlashAttention-4 must copy query, key, and value tensors from HND to NHD layout on every call; this may "    \
    "reduce performance. Use HND views of NHD-contiguous tensors to enable the copy-free path."

af_provider *af_provider_new(void) {
    af_provider *p = af_alloc_zeroed(sizeof *p);
    if (!p) return NULL;
    pthread_mutex_init(&p->lock, NULL);
    pthread_mutex_init(&p->scratch_lock, NULL);
    p->plan.qkv_source = AF_QKV_POSITIONAL;   /* the seed's defaults before prepare */
    return p;
}

void af_provider_free(af_provider *p) {
    if (!p) return;
    af_free(p->scratch);
    pthread_mutex_destroy(&p->lock);
    pthread_mutex_destroy(&p->scratch_lock);
    af_free(p);
}

/* Refuse: keep the reason, log it as the seed does, and leave it in af_last_error too. */
static bool not_supported(af_provider *p, const char *seed_log, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool not_supported(af_provider *p, const char *seed_log, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->reason, sizeof p->reason, fmt, ap);
    va_end(ap);
    if (seed_log) af_log(AF_LOG_DEBUG, "%s", seed_log);
    else af_log(AF_LOG_DEBUG, "FlashAttention-4 not supported due to: %s", p->reason);
    af_fail(AF_ERR_UNSUPPORTED, "%s", p->reason);
    return false;
}

bool af_provider_prepare(af_provider *p, const af_samples *samples) {
    af_clear_error();
    if (!p) {
        af_fail(AF_ERR_INVALID_ARGUMENT, "provider: must not be NULL");
        return false;
    }
    p->prepared = false;
    pthread_mutex_lock(&p->lock);
    p->backend = NULL;   /* the next plan may run elsewhere; prepare itself never loads one */
    pthread_mutex_unlock(&p->lock);
    if (!samples) return not_supported(p, NULL, "samples: must not be NULL");
    const size_t n = samples->size;
    af_plan first = {0};
    /* like the seed's set comprehension: every sample's plan first (the first refusal wins), then one plan */
    for (size_t i = 0; i < n; i++) {
        af_plan plan;
        af_refusal why;
        if (!af_sample_plan(&samples->items[i], &plan, &why))
            return not_supported(p, NULL, "%s (samples[%zu]: %s)", why.message, i, why.detail);
        if (i == 0) first = plan;
    }
    for (size_t i = 1; i < n; i++) {
        af_plan plan;
        af_refusal why;
        if (!af_sample_plan(&samples->items[i], &plan, &why))   /* accepted above: only memory can fail now */
            return not_supported(p, NULL, "%s (samples[%zu]: %s)", why.message, i, why.detail);
        if (!af_plan_equal(&first, &plan)) {
            char difference[160];
            af_plan_difference(&first, &plan, difference, sizeof difference);
            return not_supported(p, "FlashAttention-4 requires consistent representative samples",
                                 "FlashAttention-4 provider requires consistent representative samples "
                                 "(samples[%zu] differs from samples[0]: %s)", i, difference);
        }
    }
    if (n == 0)
        return not_supported(p, "FlashAttention-4 requires consistent representative samples",
                             "FlashAttention-4 provider requires consistent representative samples (the list is empty)");
    p->plan = first;
    p->prepared = true;
    p->reason[0] = '\0';
    /* the seed's warning is about host copies: attnforge's CUDA kernels read HND views where they lie */
    if (!first.copy_free_layout && first.backend == AF_BACKEND_CPU) af_log(AF_LOG_WARNING, SEED_COPY_WARNING);
    return true;
}

const char *af_provider_reason(const af_provider *p) { return p ? p->reason : "provider: is NULL"; }

bool af_provider_is_prepared(const af_provider *p) { return p && p->prepared; }

af_status af_provider_get_plan(const af_provider *p, af_plan *out) {
    af_clear_error();
    if (!p || !out) return af_fail(AF_ERR_INVALID_ARGUMENT, "provider and out: must not be NULL");
    if (!p->prepared)
        return af_fail(AF_ERR_NOT_PREPARED, "Kernel provider %s must be prepared before its plan can be read",
                       af_provider_name(p));
    *out = p->plan;
    return AF_OK;
}

af_status af_provider_backend(af_provider *p, const af_backend_ops **ops) {
    pthread_mutex_lock(&p->lock);
    af_status st = AF_OK;
    if (!p->backend) st = af_runtime_load(p->plan.backend, &p->backend);
    *ops = p->backend;
    pthread_mutex_unlock(&p->lock);
    return st;
}

af_status af_provider_load_runtime_dependencies(af_provider *p) {
    af_clear_error();
    if (!p) return af_fail(AF_ERR_INVALID_ARGUMENT, "provider: must not be NULL");
    const af_backend_ops *ops;
    return af_provider_backend(p, &ops);
}

const char *af_provider_name(const af_provider *cp) {
    if (!cp) return "attnforge FlashAttention-4 (no provider) " AF_VERSION_STRING;
    af_provider *p = (af_provider *)cp;   /* the name is a cache, not part of the plan */
    pthread_mutex_lock(&p->lock);
    if (p->plan.backend != AF_BACKEND_CPU) {   /* "(cuda)", "(fa4)" */
        snprintf(p->name, sizeof p->name, "attnforge FlashAttention-4 (%s) %s", af_backend_name(p->plan.backend),
                 AF_VERSION_STRING);
        p->name_isa = NULL;
    } else {
        const char *isa = af_get_isa();
        if (isa != p->name_isa) {
            snprintf(p->name, sizeof p->name, "attnforge FlashAttention-4 (cpu, %s) %s", isa, AF_VERSION_STRING);
            p->name_isa = isa;
        }
    }
    pthread_mutex_unlock(&p->lock);
    return p->name;
}

const char *af_provider_supported_function(void) { return "scaled_dot_product_attention"; }

void af_provider_set_kernel(af_provider *p, af_kernel_fn kernel) { p->kernel_override = kernel; }

af_provider_stats af_provider_get_stats(af_provider *p) {
    af_provider_stats s = {atomic_load(&p->plan_calls), atomic_load(&p->general_calls), atomic_load(&p->copied_tensors),
                           atomic_load(&p->scratch_allocations), atomic_load(&p->temporary_allocations)};
    return s;
}

bool af_provider_runtime_loaded(af_provider *p) {
    pthread_mutex_lock(&p->lock);
    bool loaded = p->backend != NULL;
    pthread_mutex_unlock(&p->lock);
    return loaded;
}
