/* One element of an f32/f16/bf16 tensor, read or written as f32 by device code (the CUDA-core kernel's loads and
 * stores, the learned sink's logits in every kernel). */
#ifndef AF_CUDA_SCALAR_CUH
#define AF_CUDA_SCALAR_CUH
#include <stdint.h>

#include "cuda/kernels.h"

AF_DEVICE float af_load_scalar(const char *base, af_dtype dtype, int64_t index) {
    if (dtype == AF_F32) return ((const float *)base)[index];
    const uint16_t bits = ((const uint16_t *)base)[index];
    return dtype == AF_F16 ? af_f16_to_float(bits) : af_bf16_to_float(bits);
}

AF_DEVICE void af_store_scalar(char *base, af_dtype dtype, int64_t index, float x) {
    if (dtype == AF_F32) ((float *)base)[index] = x;
    else ((uint16_t *)base)[index] = dtype == AF_F16 ? af_float_to_f16(x) : af_float_to_bf16(x);
}

#endif
