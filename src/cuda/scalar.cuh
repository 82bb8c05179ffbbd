/* One element of an f32/f16/bf16 tensor (or, read, float8), as f32 in device code (the CUDA-core kernel's loads and
 * stores, the learned sink's logits in every kernel). */
#ifndef AF_CUDA_SCALAR_CUH
#define AF_CUDA_SCALAR_CUH
#include <math.h>
#include <stdint.h>

#include "cuda/kernels.h"

/* A float8 byte as f32, exactly: e5m2 is the high byte of an f16; e4m3fn's S.EEEE.MMM is the f16 S.0EEEE.MMM0000000
 * of its value times 2^-8 (subnormals included), and S.1111.111 its NaN. */
AF_DEVICE float af_f8_to_float(uint8_t b, af_dtype dtype) {
    if (dtype == AF_F8E5M2) return af_f16_to_float((uint16_t)(b << 8));
    if ((b & 0x7f) == 0x7f) return NAN;
    return af_f16_to_float((uint16_t)((b & 0x80) << 8 | (b & 0x7f) << 7)) * 256.0f;
}

AF_DEVICE float af_load_scalar(const char *base, af_dtype dtype, int64_t index) {
    if (dtype == AF_F32) return ((const float *)base)[index];
    if (dtype == AF_F8E4M3 || dtype == AF_F8E5M2) return af_f8_to_float(((const uint8_t *)base)[index], dtype);
    const uint16_t bits = ((const uint16_t *)base)[index];
    return dtype == AF_F16 ? af_f16_to_float(bits) : af_bf16_to_float(bits);
}

AF_DEVICE void af_store_scalar(char *base, af_dtype dtype, int64_t index, float x) {
    if (dtype == AF_F32) ((float *)base)[index] = x;
    else ((uint16_t *)base)[index] = dtype == AF_F16 ? af_float_to_f16(x) : af_float_to_bf16(x);
}

#endif
