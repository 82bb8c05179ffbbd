/* infer(call): the per-call guard, then the plan — caller's views as they are (copy-free) or NHD copies in
 * the provider's reusable scratch. A call that does not match the plan runs on the general path (af_sdpa
 * with the call's own arguments) and says so in a debug log; it never runs with the plan's arguments. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "core/alloc.h"
#include "core/log.h"
#include "core/status.h"
#include "provider/layout.h"
#include "provider/plan.h"
#include "provider/provider.h"
#include "sdpa/problem.h"

static const char *const qkv_names[3] = {"query", "key", "value"};

/* q/k/v on one device of the plan's backend (any CUDA device for a cuda or fa4 plan); else true and why not. */
static bool device_mismatch(const af_plan *plan, const af_tensor *const qkv[3], char *why, size_t size) {
    char names[3][AF_DEVICE_NAME_MAX];
    for (int i = 0; i < 3; i++) af_device_name(qkv[i]->device, names[i], sizeof names[i]);
    for (int i = 1; i < 3; i++)
        if (qkv[i]->device.type != qkv[0]->device.type || qkv[i]->device.index != qkv[0]->device.index) {
            snprintf(why, size, "q/k/v are on different devices: query %s, key %s, value %s", names[0], names[1],
                     names[2]);
            return true;
        }
    if (qkv[0]->device.type != AF_DEVICE_CPU && qkv[0]->device.type != AF_DEVICE_CUDA) {
        snprintf(why, size, "query is on device type %d, the plan runs on %s", (int)qkv[0]->device.type,
                 af_backend_name(plan->backend));
        return true;
    }
    const bool call_on_cuda = qkv[0]->device.type == AF_DEVICE_CUDA, plan_on_cuda = plan->backend != AF_BACKEND_CPU;
    if (call_on_cuda != plan_on_cuda) {
        snprintf(why, size, "query, key and value are on %s, the plan runs on %s", names[0],
                 af_backend_name(plan->backend));
        return true;
    }
    return false;
}

/* Why the call cannot run as the plan (into `why`), or NULL when it matches. */
static const char *plan_mismatch(const af_plan *plan, const af_sdpa_args *a, af_qkv_source source, char *why,
                                 size_t size) {
    const af_tensor *qkv[3] = {a->query, a->key, a->value};
    for (int i = 0; i < 3; i++)
        if (!qkv[i] || qkv[i]->ndim != 4) return "q/k/v are not three 4-D tensors";   /* af_sdpa says which */
    if (device_mismatch(plan, qkv, why, size)) return why;
    if (source != plan->qkv_source) {
        snprintf(why, size, "q/k/v passed as %s, the plan has %s", af_qkv_source_name(source),
                 af_qkv_source_name(plan->qkv_source));
        return why;
    }
    if (a->attn_mask) return "the call has an attn_mask";
    if (a->dropout_p != 0.0) return "the call has dropout_p != 0";
    if (a->causal_bottom_right) return "the call asks for bottom-right causal alignment";
    if (a->is_causal != plan->causal) {
        snprintf(why, size, "is_causal is %s, the plan's is %s", a->is_causal ? "true" : "false",
                 plan->causal ? "true" : "false");
        return why;
    }
    if (a->has_scale != plan->has_softmax_scale || (a->has_scale && a->scale != plan->softmax_scale)) {
        char call_scale[32] = "None", plan_scale[32] = "None";
        if (a->has_scale) snprintf(call_scale, sizeof call_scale, "%.17g", a->scale);
        if (plan->has_softmax_scale) snprintf(plan_scale, sizeof plan_scale, "%.17g", plan->softmax_scale);
        snprintf(why, size, "scale is %s, the plan's is %s", call_scale, plan_scale);
        return why;
    }
    const bool gqa = a->query->shape[1] != a->key->shape[1];
    if (gqa != plan->gqa) {
        snprintf(why, size, "query has %lld heads and key %lld: %s, the plan is %s", (long long)a->query->shape[1],
                 (long long)a->key->shape[1], gqa ? "grouped-query" : "not grouped-query",
                 plan->gqa ? "grouped-query" : "not");
        return why;
    }
    if (gqa && !a->enable_gqa) return "grouped-query heads without enable_gqa";
    if (plan->copy_free_layout)
        for (int i = 0; i < 3; i++)
            if (!af_hnd_is_nhd_contiguous(qkv[i]->shape, qkv[i]->strides)) {
                snprintf(why, size, "%s is no longer an HND view of NHD-contiguous memory (the plan is copy-free)",
                         qkv_names[i]);
                return why;
            }
    return NULL;
}

static size_t round_up_64(size_t n) { return (n + 63) & ~(size_t)63; }

/* Copy plan: q/k/v that are not NHD-contiguous already are copied into scratch (PyTorch's .contiguous()
 * copies only when needed too). The scratch is the provider's, grown when too small and reused; when another
 * thread holds it, this call uses a buffer of its own. */
static af_status run_with_nhd_copies(af_provider *p, af_kernel_fn kernel, const af_sdpa_args *planned, af_tensor *out,
                                     af_tensor *lse) {
    af_problem checked;   /* validate the caller's views before reading through them */
    af_status st = af_sdpa_check(planned, out, lse, &checked);
    if (st != AF_OK) return st;
    const af_tensor *qkv[3] = {planned->query, planned->key, planned->value};
    bool copy[3];
    size_t offset[3], total = 0;
    for (int i = 0; i < 3; i++) {
        copy[i] = !af_hnd_is_nhd_contiguous(qkv[i]->shape, qkv[i]->strides);
        offset[i] = total;
        size_t bytes = 0;
        if (copy[i] && (!af_nhd_bytes(qkv[i], &bytes) || bytes > SIZE_MAX / 2 || __builtin_add_overflow(total, round_up_64(bytes), &total)))
            return af_fail(AF_ERR_NO_MEMORY, "infer: the NHD copy of query/key/value would exceed the address space");
    }
    if (total == 0) return kernel(planned, out, lse);

    const bool shared = pthread_mutex_trylock(&p->scratch_lock) == 0;
    char *buffer;
    if (shared) {
        if (p->scratch_bytes < total) {
            af_free(p->scratch);
            p->scratch = af_alloc(total);
            p->scratch_bytes = p->scratch ? total : 0;
            atomic_fetch_add(&p->scratch_allocations, 1);
        }
        buffer = p->scratch;
    } else {
        buffer = af_alloc(total);
        atomic_fetch_add(&p->temporary_allocations, 1);
    }
    if (!buffer) {
        if (shared) pthread_mutex_unlock(&p->scratch_lock);
        return af_fail(AF_ERR_NO_MEMORY, "infer: out of memory for the %zu-byte NHD copy of query/key/value", total);
    }
    af_tensor copies[3];
    for (int i = 0; i < 3; i++) {
        copies[i] = copy[i] ? af_copy_hnd_to_nhd(qkv[i], buffer + offset[i]) : *qkv[i];
        if (copy[i]) atomic_fetch_add(&p->copied_tensors, 1);
    }
    af_sdpa_args on_copies = *planned;
    on_copies.query = &copies[0];
    on_copies.key = &copies[1];
    on_copies.value = &copies[2];
    st = kernel(&on_copies, out, lse);
    if (shared) pthread_mutex_unlock(&p->scratch_lock);
    else af_free(buffer);
    return st;
}

af_status af_provider_infer(af_provider *p, const af_sdpa_args *args, af_qkv_source source, af_tensor *out,
                            af_tensor *lse) {
    af_clear_error();
    if (!p) return af_fail(AF_ERR_INVALID_ARGUMENT, "provider: must not be NULL");
    if (!p->prepared)
        return af_fail(AF_ERR_NOT_PREPARED, "Kernel provider %s must be prepared before inference", af_provider_name(p));
    if (!args) return af_fail(AF_ERR_INVALID_ARGUMENT, "args: must not be NULL");

    char why[256];
    const char *mismatch = plan_mismatch(&p->plan, args, source, why, sizeof why);
    if (mismatch) {   /* af_sdpa runs it where its tensors live: a cpu call never needs a cuda plan's backend */
        af_log(AF_LOG_DEBUG, "FlashAttention-4 plan does not match this call (%s); running it on the general path",
               mismatch);
        atomic_fetch_add(&p->general_calls, 1);
        return (p->kernel_override ? p->kernel_override : af_sdpa)(args, out, lse);
    }
    if (p->plan.backend == AF_BACKEND_FA4) return af_fail(AF_ERR_UNSUPPORTED, AF_FA4_ONLY_IN_PYTHON);
    af_kernel_fn kernel = p->kernel_override;   /* a test's stand-in replaces the backend, which is then not loaded */
    if (!kernel) {
        const af_backend_ops *backend;
        af_status st = af_provider_backend(p, &backend);
        if (st != AF_OK) return st;
        kernel = backend->sdpa;
    }
    atomic_fetch_add(&p->plan_calls, 1);
    const af_sdpa_args planned = {.query = args->query, .key = args->key, .value = args->value,
                                  .is_causal = p->plan.causal, .has_scale = p->plan.has_softmax_scale,
                                  .scale = p->plan.softmax_scale, .enable_gqa = p->plan.gqa, .stream = args->stream,
                                  .workspace = args->workspace};
    /* copy-free, or CUDA: the kernels read the caller's views as they are (the CUDA backend copies on the device
     * what its tensor-core path cannot read); only the CPU copy plan makes host NHD copies */
    if (p->plan.copy_free_layout || p->plan.backend == AF_BACKEND_CUDA) return kernel(&planned, out, lse);
    return run_with_nhd_copies(p, kernel, &planned, out, lse);
}

af_status af_provider_check_call(const af_provider *p, const af_sdpa_args *args, af_qkv_source source) {
    af_clear_error();
    if (!p) return af_fail(AF_ERR_INVALID_ARGUMENT, "provider: must not be NULL");
    if (!p->prepared)
        return af_fail(AF_ERR_NOT_PREPARED, "Kernel provider %s must be prepared before inference",
                       af_provider_name((af_provider *)p));
    if (!args) return af_fail(AF_ERR_INVALID_ARGUMENT, "args: must not be NULL");
    char why[256];
    const char *mismatch = plan_mismatch(&p->plan, args, source, why, sizeof why);
    if (mismatch) return af_fail(AF_ERR_PLAN_MISMATCH, "FlashAttention-4 plan does not match this call (%s)", mismatch);
    return AF_OK;
}
