/* The provider object shared by provider.c (prepare, name), plan_json.c, infer.c and the tests. */
#ifndef AF_PROVIDER_PROVIDER_H
#define AF_PROVIDER_PROVIDER_H
#include <pthread.h>
#include <stdatomic.h>

#include "attnforge.h"
#include "provider/runtime.h"

/* How infer ran the calls it was given (tests and docs check the per-call guard and the scratch). */
typedef struct {
    long plan_calls;               /* matched the plan and ran it */
    long general_calls;            /* did not match: ran af_sdpa with the call's own arguments */
    long copied_tensors;           /* q/k/v copied HND -> NHD (copy plans, non-NHD inputs) */
    long scratch_allocations;      /* the reusable scratch was (re)allocated to grow */
    long temporary_allocations;    /* the scratch was busy in another thread: a one-call buffer */
} af_provider_stats;

struct af_provider {
    bool prepared;
    af_plan plan;
    char reason[2048];

    pthread_mutex_t lock;          /* guards the backend pointer and the name */
    const af_backend_ops *backend; /* NULL until loaded (lazily, or by load_runtime_dependencies) */
    char name[128];
    const char *name_isa;          /* the ISA `name` was written for */

    pthread_mutex_t scratch_lock;  /* the copy path's reusable NHD buffer */
    void *scratch;
    size_t scratch_bytes;

    af_kernel_fn kernel_override;  /* tests: see what the kernel is handed; NULL = the backend's */
    atomic_long plan_calls, general_calls, copied_tensors, scratch_allocations, temporary_allocations;
};

/* The backend for the plan, loaded on first need. */
af_status af_provider_backend(af_provider *provider, const af_backend_ops **ops);

/* Testing hooks (not in the public header). */
void af_provider_set_kernel(af_provider *provider, af_kernel_fn kernel);
af_provider_stats af_provider_get_stats(af_provider *provider);
bool af_provider_runtime_loaded(af_provider *provider);

#endif
