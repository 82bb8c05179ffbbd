/* Lazy backend loading: the CPU kernels are chosen on first need (af_get_isa); the CUDA backend is a separate
 * shared object that src/sdpa/cuda_backend.c opens on first need (library, driver and GPU), so this library never
 * links CUDA. Both run through af_sdpa, which goes where the call's tensors live. */
#include "provider/runtime.h"

#include <stdatomic.h>

#include "core/status.h"
#include "sdpa/cuda_backend.h"

static const af_backend_ops cpu_ops = {"cpu", af_sdpa};
static const af_backend_ops cuda_ops = {"cuda", af_sdpa};
static atomic_bool cpu_loaded;

af_status af_runtime_load(af_backend backend, const af_backend_ops **ops) {
    *ops = NULL;
    if (backend == AF_BACKEND_FA4) return af_fail(AF_ERR_UNSUPPORTED, AF_FA4_ONLY_IN_PYTHON);
    if (backend == AF_BACKEND_CUDA) {
        const af_cuda_backend_ops *cuda;
        af_status st = af_cuda_backend_load(&cuda);
        *ops = st == AF_OK ? &cuda_ops : NULL;
        return st;
    }
    (void)af_get_isa();   /* picks the micro-kernels now (CPUID, ATTNFORGE_ISA), not inside a timed call */
    atomic_store(&cpu_loaded, true);
    *ops = &cpu_ops;
    return AF_OK;
}

bool af_runtime_is_loaded(af_backend backend) {
    if (backend == AF_BACKEND_CPU) return atomic_load(&cpu_loaded);
    return backend == AF_BACKEND_CUDA && af_cuda_backend_is_loaded();
}
