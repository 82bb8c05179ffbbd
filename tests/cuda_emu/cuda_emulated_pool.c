/* Stream-ordered memory pools on the emulated device: a pool is a release threshold and counters; its allocations
 * are ordinary emulated device memory (cudaMalloc), freed by cudaFreeAsync/cudaFree like any other. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_emulated_internal.h"

struct af_emu_mem_pool {
    unsigned long long release_threshold;   /* a new pool's is 0, as CUDA's */
};

static long pools_made, pooled_allocations;
static unsigned long long last_threshold;

int af_emu_pools_supported(void)
{
    const char *mode = getenv("ATTNFORGE_EMU_CUDA");
    return !(mode && strcmp(mode, "nopools") == 0);
}

cudaError_t cudaMemPoolCreate(cudaMemPool_t *pool, const struct cudaMemPoolProps *props)
{
    if (!pool || !props)
        return af_emu_fail(cudaErrorInvalidValue);
    if (!af_emu_pools_supported())
        return af_emu_fail(cudaErrorNotSupported);
    if (props->allocType != cudaMemAllocationTypePinned || props->location.type != cudaMemLocationTypeDevice ||
        props->location.id < 0 || props->location.id >= af_emu_device_count())
        return af_emu_fail(cudaErrorInvalidValue);
    *pool = (cudaMemPool_t)calloc(1, sizeof **pool);
    if (!*pool)
        return af_emu_fail(cudaErrorMemoryAllocation);
    __atomic_add_fetch(&pools_made, 1, __ATOMIC_RELAXED);
    return cudaSuccess;
}

cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool)
{
    if (!pool)
        return af_emu_fail(cudaErrorInvalidValue);
    free(pool);
    return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr, void *value)
{
    if (!pool || !value || attr != cudaMemPoolAttrReleaseThreshold)
        return af_emu_fail(cudaErrorInvalidValue);
    memcpy(&pool->release_threshold, value, sizeof pool->release_threshold);
    __atomic_store_n(&last_threshold, pool->release_threshold, __ATOMIC_RELAXED);
    return cudaSuccess;
}

cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr, void *value)
{
    if (!pool || !value || attr != cudaMemPoolAttrReleaseThreshold)
        return af_emu_fail(cudaErrorInvalidValue);
    memcpy(value, &pool->release_threshold, sizeof pool->release_threshold);
    return cudaSuccess;
}

cudaError_t cudaMallocFromPoolAsync(void **ptr, size_t size, cudaMemPool_t pool, cudaStream_t stream)
{
    if (!pool)
        return af_emu_fail(cudaErrorInvalidValue);
    const cudaError_t e = cudaMallocAsync(ptr, size, stream);   /* stream-ordered: allowed during a capture */
    if (e == cudaSuccess)
        __atomic_add_fetch(&pooled_allocations, 1, __ATOMIC_RELAXED);
    return e;
}

void af_emu_pool_stats(long *pools, long *allocations, unsigned long long *release_threshold)
{
    *pools = __atomic_load_n(&pools_made, __ATOMIC_RELAXED);
    *allocations = __atomic_load_n(&pooled_allocations, __ATOMIC_RELAXED);
    *release_threshold = __atomic_load_n(&last_threshold, __ATOMIC_RELAXED);
}
