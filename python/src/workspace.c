#include "workspace.h"

#include <stdint.h>
#include <string.h>

#include "errors.h"

/* Runs inside af_sdpa / af_flash_attn, which the bindings call with the GIL released: each callback takes it. */
static void *workspace_alloc(size_t bytes, int device, void *stream, void *user) {
    afpy_workspace *w = (afpy_workspace *)user;
    PyGILState_STATE gil = PyGILState_Ensure();
    void *ptr = NULL;
    PyObject *result = PyObject_CallFunction(w->alloc, "KiK", (unsigned long long)bytes, device,
                                             (unsigned long long)(uintptr_t)stream);
    if (result && !PyLong_Check(result))
        PyErr_Format(PyExc_TypeError, "workspace: alloc(%zu, %d, stream) returned %R; expected the device pointer "
                     "as an int", bytes, device, result);
    else if (result)
        ptr = PyLong_AsVoidPtr(result);
    Py_XDECREF(result);
    if (PyErr_Occurred()) {
        ptr = NULL;
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        if (traceback && value) PyException_SetTraceback(value, traceback);
        if (!w->error) {
            w->error = value;
            value = NULL;
        }
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
    }
    PyGILState_Release(gil);
    return ptr;
}

/* The call's work is enqueued (or it failed): an exception here cannot change its result, so it is reported as
 * unraisable, as Python does for errors in finalisers. */
static void workspace_free(void *ptr, size_t bytes, int device, void *stream, void *user) {
    afpy_workspace *w = (afpy_workspace *)user;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *result = PyObject_CallFunction(w->free, "K", (unsigned long long)(uintptr_t)ptr);
    if (result)
        Py_DECREF(result);
    else
        PyErr_WriteUnraisable(w->free);
    PyGILState_Release(gil);
}

int afpy_workspace_from_object(PyObject *obj, afpy_workspace *w) {
    memset(w, 0, sizeof *w);
    if (!obj || obj == Py_None) return 0;
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 2 || !PyCallable_Check(PyTuple_GET_ITEM(obj, 0)) ||
        !PyCallable_Check(PyTuple_GET_ITEM(obj, 1))) {
        PyErr_Format(PyExc_TypeError, "workspace: expected None or a pair (alloc, free) of callables, "
                     "alloc(nbytes, device, stream) -> int and free(ptr), got %R", obj);
        return -1;
    }
    w->alloc = PyTuple_GET_ITEM(obj, 0);
    w->free = PyTuple_GET_ITEM(obj, 1);
    w->allocator.alloc = workspace_alloc;
    w->allocator.free = workspace_free;
    w->allocator.user = w;
    return 0;
}

const af_cuda_allocator *afpy_workspace_allocator(afpy_workspace *w) { return w->alloc ? &w->allocator : NULL; }

PyObject *afpy_workspace_raise(afpy_workspace *w, af_status status) {
    afpy_raise_status(status);
    PyObject *error = w->error;
    w->error = NULL;
    if (!error) return NULL;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    Py_INCREF(error);
    PyException_SetContext(value, error);   /* each steals one reference */
    PyException_SetCause(value, error);
    PyErr_Restore(type, value, traceback);
    return NULL;
}
