/* Lazy backend loading: the CPU kernels are chosen on first need (af_get_isa); the CUDA backend is a
 * separate shared object opened with dlopen on first need, so this library never links CUDA. */
#include "provider/runtime.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "core/log.h"
#include "core/status.h"

static const af_backend_ops cpu_ops = {AF_BACKEND_ABI_VERSION, "cpu", af_sdpa};

static pthread_mutex_t cuda_lock = PTHREAD_MUTEX_INITIALIZER;
static const af_backend_ops *cuda_ops;   /* set once, under cuda_lock; the handle is kept for the process */
static atomic_bool cpu_loaded;

static af_status load_cuda(const af_backend_ops **ops) {
    pthread_mutex_lock(&cuda_lock);
    af_status st = AF_OK;
    if (!cuda_ops) {
        const char *path = getenv("ATTNFORGE_CUDA_LIBRARY");
        if (!path || !*path) path = AF_CUDA_LIBRARY;
        void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!handle) {
            const char *why = dlerror();
            st = af_fail(AF_ERR_RUNTIME_UNAVAILABLE,
                         "attnforge's CUDA backend is not available: %s. It is a separately built shared object "
                         "(%s) and is not part of this release yet; once built, put it on the library search path "
                         "or set ATTNFORGE_CUDA_LIBRARY to its path", why ? why : path, AF_CUDA_LIBRARY);
        } else {
            const af_backend_ops *(*entry)(void) = (const af_backend_ops *(*)(void))dlsym(handle, AF_CUDA_ENTRY);
            const af_backend_ops *found = entry ? entry() : NULL;
            if (!found || !found->sdpa) {
                st = af_fail(AF_ERR_RUNTIME_UNAVAILABLE,
                             "attnforge's CUDA backend is not available: %s does not export %s(); it is not an "
                             "attnforge CUDA backend", path, AF_CUDA_ENTRY);
                dlclose(handle);
            } else if (found->abi_version != AF_BACKEND_ABI_VERSION) {
                st = af_fail(AF_ERR_RUNTIME_UNAVAILABLE,
                             "attnforge's CUDA backend is not available: %s implements backend interface %d, this "
                             "attnforge %s needs %d; rebuild the backend with this attnforge", path,
                             found->abi_version, AF_VERSION_STRING, AF_BACKEND_ABI_VERSION);
                dlclose(handle);
            } else {
                cuda_ops = found;
                af_log(AF_LOG_DEBUG, "loaded the CUDA backend from %s", path);
            }
        }
    }
    *ops = cuda_ops;
    pthread_mutex_unlock(&cuda_lock);
    return st;
}

af_status af_runtime_load(af_backend backend, const af_backend_ops **ops) {
    if (backend == AF_BACKEND_CUDA) return load_cuda(ops);
    (void)af_get_isa();   /* picks the micro-kernels now (CPUID, ATTNFORGE_ISA), not inside a timed call */
    atomic_store(&cpu_loaded, true);
    *ops = &cpu_ops;
    return AF_OK;
}

bool af_runtime_is_loaded(af_backend backend) {
    if (backend == AF_BACKEND_CPU) return atomic_load(&cpu_loaded);
    pthread_mutex_lock(&cuda_lock);
    bool loaded = cuda_ops != NULL;
    pthread_mutex_unlock(&cuda_lock);
    return loaded;
}
