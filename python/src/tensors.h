/* Python objects → af_tensor views, without copying: torch.Tensor (and anything with __dlpack__) through
 * DLPack, NumPy arrays (and anything with the buffer protocol) through Py_buffer. */
#ifndef AFPY_TENSORS_H
#define AFPY_TENSORS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>
#include <stdint.h>

#include "attnforge.h"
#include "dlpack.h"

typedef struct {
    af_tensor view;              /* what the C library reads or writes */
    bool has_buffer;             /* view came from the buffer protocol: release `buffer` */
    Py_buffer buffer;
    DLManagedTensor *managed;    /* view came from DLPack: call its deleter */
} afpy_tensor;

/* Fill `t` from `obj`; `name` prefixes messages ("query: ..."). `writable` asks for a writable buffer. A CUDA
 * tensor (DLPack kDLCUDA or kDLCUDAManaged) crosses without a copy as af_tensor on {AF_DEVICE_CUDA, device_id};
 * `stream` is the cudaStream_t the call will run on (0 = the legacy default stream), handed to its producer's
 * __dlpack__(stream=...). Returns 0, or -1 with an exception set (and nothing to release). */
int afpy_tensor_from_object(PyObject *obj, const char *name, bool writable, uintptr_t stream, afpy_tensor *t);
/* DLPack's (device_type, device_id) -> af_device: kDLCPU, kDLCUDA and kDLCUDAManaged; -1 for any other. */
int afpy_device_from_dlpack(int32_t device_type, int32_t device_id, af_device *device);
/* Give the view back (DLPack deleter / PyBuffer_Release); needs the GIL; safe on a zeroed struct; keeps a pending
 * exception. */
void afpy_tensor_release(afpy_tensor *t);

#endif
