/* Test tensors copied to and from device memory through a loaded CUDA backend's own allocator and copies (its
 * af_cuda_backend_ops), as the end-to-end tests (test_cuda_sdpa, test_cuda_indices) pass them to libattnforge. A
 * failure fails the running cmocka test. */
#ifndef AF_TESTS_EMU_BACKEND_TENSOR_H
#define AF_TESTS_EMU_BACKEND_TENSOR_H
#include "sdpa/cuda_backend.h"
#include "test_tensor.h"

typedef struct {
    void *memory;     /* device allocation holding the whole backing buffer of the host tensor */
    af_tensor view;   /* the host tensor's view, moved onto the device allocation (cuda:N) */
    int device;       /* N, where the memory is (tests may relabel view.device) */
} device_tensor;

void backend_to_device(const af_cuda_backend_ops *ops, device_tensor *d, const test_tensor *t);   /* cuda:0 */
void backend_to_device_on(const af_cuda_backend_ops *ops, int device, device_tensor *d, const test_tensor *t);
void backend_to_host(const af_cuda_backend_ops *ops, test_tensor *t, const device_tensor *d);
void backend_device_free(const af_cuda_backend_ops *ops, device_tensor *d);

#endif
