#include "attnforge.h"

const char *af_dtype_name(af_dtype dtype) {
    switch (dtype) {
    case AF_F32: return "float32";
    case AF_F16: return "float16";
    case AF_BF16: return "bfloat16";
    case AF_BOOL: return "bool";
    case AF_I32: return "int32";
    case AF_F8E4M3: return "float8_e4m3fn";
    case AF_F8E5M2: return "float8_e5m2";
    }
    return "unknown";
}

size_t af_dtype_size(af_dtype dtype) {
    switch (dtype) {
    case AF_F32: return 4;
    case AF_F16: case AF_BF16: return 2;
    case AF_BOOL: return 1;
    case AF_I32: return 4;
    case AF_F8E4M3: case AF_F8E5M2: return 1;
    }
    return 0;
}

af_tensor af_tensor_contiguous(void *data, af_dtype dtype, int ndim, const int64_t *shape) {
    af_tensor t = {0};
    t.data = data;
    t.dtype = dtype;
    t.ndim = ndim;
    if (ndim < 0 || ndim > AF_MAX_DIMS) return t;   /* af_sdpa rejects the bad ndim with a message */
    int64_t stride = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        t.shape[d] = shape[d];
        t.strides[d] = stride;
        if (__builtin_mul_overflow(stride, shape[d] > 1 ? shape[d] : 1, &stride))
            stride = INT64_MAX;   /* past 2^63: af_sdpa refuses such a view (its size overflows) */
    }
    return t;
}
