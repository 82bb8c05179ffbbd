/* The DLPack ABI (v0.8, "dltensor" capsules), written from the public specification at
 * https://dmlc.github.io/dlpack/latest/c_api.html: only the parts attnforge reads (CPU and CUDA consumers). */
#ifndef AFPY_DLPACK_H
#define AFPY_DLPACK_H
#include <stdint.h>

typedef enum { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLROCM = 10, kDLCUDAManaged = 13 } DLDeviceType;

typedef struct {
    int32_t device_type;   /* DLDeviceType; an int32 in the ABI */
    int32_t device_id;
} DLDevice;

typedef enum {
    kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLOpaqueHandle = 3, kDLBfloat = 4, kDLComplex = 5, kDLBool = 6,
    kDLFloat8_e4m3fn = 10, kDLFloat8_e5m2 = 12   /* DLPack 1.x's float8 codes (bits 8): torch.float8_e4m3fn / e5m2 */
} DLDataTypeCode;

typedef struct {
    uint8_t code;    /* DLDataTypeCode */
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;     /* in elements; NULL means compact row-major */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);   /* the consumer calls it once it is done */
} DLManagedTensor;

#endif
