/* attnforge._C.sdpa: one af_sdpa call on Python tensors. */
#ifndef AFPY_SDPA_BINDING_H
#define AFPY_SDPA_BINDING_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "tensors.h"

/* sdpa(args: tuple, kwargs: dict, out, lse=None, causal_bottom_right=False, reference=False, stream=None) -> None;
 * stream: the cudaStream_t (an int) a CUDA call is enqueued on, None = the legacy default stream. */
PyObject *afpy_sdpa(PyObject *self, PyObject *args, PyObject *kwargs);

/* Borrow `out` (and `lse` unless None) as writable views (CUDA ones with the handshake for `stream`); 0, or -1
 * with an exception set and nothing held. */
int afpy_outputs_from_objects(PyObject *out_obj, PyObject *lse_obj, uintptr_t stream, afpy_tensor *out,
                              afpy_tensor *lse);

#endif
