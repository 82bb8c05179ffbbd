/* af_cuda_copy_4d: a strided 4-D tensor gathered into contiguous memory, one thread per element. The copy
 * backend.cu makes of a q/k/v that breaks the tensor-core path's stride rules, so it runs once per call at most. */
#ifndef AF_CUDA_COPY_4D_CUH
#define AF_CUDA_COPY_4D_CUH
#include <stdint.h>

#include "cuda/kernels.h"

#define AF_COPY_4D_THREADS 256
#ifndef AF_COPY_4D_MAX_BLOCKS   /* the tests lower it to run the grid-stride loop */
#define AF_COPY_4D_MAX_BLOCKS 0x7fffffffLL   /* CUDA's grid x limit; threads stride over what is left */
#endif

typedef struct {
    char *dst;
    const char *src;
    int64_t shape[4];
    int64_t stride[4];      /* src strides in elements */
    int64_t count;          /* elements: the product of shape */
    int elem_size;          /* 1 (float8), 2 or 4 bytes */
} af_copy_4d_params;

AF_KERNEL(af_copy_4d_kernel, af_copy_4d_params, p, AF_COPY_4D_THREADS) {
    const int64_t step = (int64_t)AF_GRID_DIM_X * AF_BLOCK_DIM;
    for (int64_t n = (int64_t)AF_BLOCK_IDX_X * AF_BLOCK_DIM + AF_THREAD_IDX; n < p.count; n += step) {
        int64_t rest = n, offset = 0;
        for (int d = 3; d >= 0; d--) {   /* n in row-major order -> the source element's offset */
            offset += rest % p.shape[d] * p.stride[d];
            rest /= p.shape[d];
        }
        if (p.elem_size == 4) ((uint32_t *)p.dst)[n] = ((const uint32_t *)p.src)[offset];
        else if (p.elem_size == 2) ((uint16_t *)p.dst)[n] = ((const uint16_t *)p.src)[offset];
        else ((uint8_t *)p.dst)[n] = ((const uint8_t *)p.src)[offset];
    }
}

cudaError_t af_cuda_copy_4d(void *dst, const void *src, const int64_t shape[4], const int64_t src_stride[4],
                            int elem_size, cudaStream_t stream) {
    af_copy_4d_params p;
    p.dst = (char *)dst;
    p.src = (const char *)src;
    p.count = 1;
    for (int d = 0; d < 4; d++) {
        p.shape[d] = shape[d];
        p.stride[d] = src_stride[d];
        p.count *= shape[d];
    }
    p.elem_size = elem_size;
    if (p.count == 0) return cudaSuccess;
    int64_t blocks = (p.count + AF_COPY_4D_THREADS - 1) / AF_COPY_4D_THREADS;
    if (blocks > AF_COPY_4D_MAX_BLOCKS) blocks = AF_COPY_4D_MAX_BLOCKS;
    return AF_LAUNCH(af_copy_4d_kernel, (int)blocks, 1, 1, AF_COPY_4D_THREADS, 0, stream, p);
}

#endif
