/* af_tma_encode_tiled of src/cuda/device_hopper.h for nvcc (host code): the driver's cuTensorMapEncodeTiled, found
 * with cudaGetDriverEntryPointByVersion so that the library links cudart alone, as backend.cu does for contexts. */
#ifndef AF_CUDA_TMA_ENCODE_NVIDIA_H
#define AF_CUDA_TMA_ENCODE_NVIDIA_H
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

typedef CUresult (*af_encode_tiled_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                        const cuuint64_t *, const cuuint32_t *, const cuuint32_t *,
                                        CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                        CUtensorMapFloatOOBfill);

/* The entry point, looked up once (a benign race: every thread stores the same pointer). */
static inline af_encode_tiled_fn af_tma_encode_entry(void)
{
    static af_encode_tiled_fn cached;
    af_encode_tiled_fn fn = __atomic_load_n(&cached, __ATOMIC_ACQUIRE);
    if (fn)
        return fn;
    void *symbol = NULL;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &symbol, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess || !symbol) {
        (void)cudaGetLastError();   /* the failed query is this call's answer, not a stale error for later */
        return NULL;
    }
    fn = (af_encode_tiled_fn)symbol;
    __atomic_store_n(&cached, fn, __ATOMIC_RELEASE);
    return fn;
}

static inline cudaError_t af_tma_encode_tiled(CUtensorMap *map, int dtype, int rank, const void *global,
                                              const uint64_t *dims, const uint64_t *strides_bytes,
                                              const uint32_t *box, int swizzle)
{
    static const CUtensorMapSwizzle swizzles[4] = {CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                                   CU_TENSOR_MAP_SWIZZLE_64B, CU_TENSOR_MAP_SWIZZLE_32B};
    if (!map || rank < 2 || rank > 4 || (dtype != 0 && dtype != 1) || swizzle < 0 || swizzle > 3)
        return cudaErrorInvalidValue;
    af_encode_tiled_fn encode = af_tma_encode_entry();
    if (!encode)
        return cudaErrorNotSupported;
    cuuint64_t d[4], s[3];
    cuuint32_t b[4], unit[4] = {1, 1, 1, 1};
    for (int i = 0; i < rank; i++) {
        d[i] = dims[i];
        b[i] = box[i];
        if (i + 1 < rank)
            s[i] = strides_bytes[i];
    }
    CUresult r = encode(map, dtype == 0 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                        (cuuint32_t)rank, (void *)global, d, s, b, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        swizzles[swizzle], CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

#endif
