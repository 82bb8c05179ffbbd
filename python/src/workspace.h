/* The `workspace` argument of _C.sdpa, _C.flash_attn and Provider.infer: None (attnforge's own pool) or a pair
 * (alloc, free) of Python callables that the CUDA backend asks for its scratch through af_cuda_allocator:
 * alloc(nbytes, device, stream) -> int device pointer, free(ptr) -> None; torch.cuda.caching_allocator_alloc and
 * torch.cuda.caching_allocator_delete have exactly these signatures (attnforge._tensors.call_workspace). */
#ifndef AFPY_WORKSPACE_H
#define AFPY_WORKSPACE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "attnforge.h"

typedef struct {
    PyObject *alloc, *free;         /* borrowed: the caller's argument outlives the call */
    af_cuda_allocator allocator;    /* the callbacks below, user = this struct */
    PyObject *error;                /* the first exception alloc raised (or its bad result's), owned; NULL if none */
} afpy_workspace;

/* Reads `obj` (None or NULL: no allocator). 0, or -1 with TypeError set. */
int afpy_workspace_from_object(PyObject *obj, afpy_workspace *w);
/* What the call's args.workspace points at: NULL when the call has no allocator. */
const af_cuda_allocator *afpy_workspace_allocator(afpy_workspace *w);
/* For a failed call (GIL held): raises the exception of `status` with af_last_error(), and when alloc raised, that
 * exception as its __cause__ (a failed alloc always fails the call: nothing else holds it). Returns NULL. */
PyObject *afpy_workspace_raise(afpy_workspace *w, af_status status);

#endif
