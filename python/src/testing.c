/* Test-only hooks (names start with _testing_): what the provider's kernel is handed, and how infer ran
 * calls. They use libattnforge's private test hooks (src/provider/provider.h), as the C tests do. */
#include "testing.h"

#include <stdatomic.h>

#include "call_args.h"
#include "host_openmp.h"
#include "core/status.h"
#include "provider/provider.h"
#include "provider_binding.h"
#include "tensors.h"
#include "workspace.h"

/* The data pointers of q/k/v the last spied kernel call received (process-wide: tests run one at a time). */
static _Atomic(uintptr_t) seen[3];

static af_status spy_kernel(const af_sdpa_args *args, af_tensor *out, af_tensor *lse) {
    atomic_store(&seen[0], (uintptr_t)args->query->data);
    atomic_store(&seen[1], (uintptr_t)args->key->data);
    atomic_store(&seen[2], (uintptr_t)args->value->data);
    return af_sdpa(args, out, lse);
}

static afpy_provider *provider_arg(PyObject *obj) {
    if (!PyObject_TypeCheck(obj, &afpy_provider_type)) {
        PyErr_SetString(PyExc_TypeError, "expected an attnforge._C.Provider");
        return NULL;
    }
    return (afpy_provider *)obj;
}

/* _testing_spy(provider): route the provider's kernel through spy_kernel. */
static PyObject *testing_spy(PyObject *module, PyObject *arg) {
    afpy_provider *p = provider_arg(arg);
    if (!p) return NULL;
    af_provider_set_kernel(p->provider, spy_kernel);
    Py_RETURN_NONE;
}

/* _testing_seen() -> (q_ptr, k_ptr, v_ptr) of the last spied call. */
static PyObject *testing_seen(PyObject *module, PyObject *unused) {
    return Py_BuildValue("(KKK)", (unsigned long long)atomic_load(&seen[0]), (unsigned long long)atomic_load(&seen[1]),
                         (unsigned long long)atomic_load(&seen[2]));
}

/* _testing_stats(provider) -> dict of infer's counters. */
static PyObject *testing_stats(PyObject *module, PyObject *arg) {
    afpy_provider *p = provider_arg(arg);
    if (!p) return NULL;
    af_provider_stats s = af_provider_get_stats(p->provider);
    return Py_BuildValue("{sl,sl,sl,sl,sl}", "plan_calls", s.plan_calls, "general_calls", s.general_calls,
                         "copied_tensors", s.copied_tensors, "scratch_allocations", s.scratch_allocations,
                         "temporary_allocations", s.temporary_allocations);
}

/* _testing_runtime_loaded(provider) -> bool: prepare must never load a backend. */
static PyObject *testing_runtime_loaded(PyObject *module, PyObject *arg) {
    afpy_provider *p = provider_arg(arg);
    if (!p) return NULL;
    return PyBool_FromLong(af_provider_runtime_loaded(p->provider));
}

/* _testing_tensor_view(obj, stream=None) -> dict: the af_tensor the binding reads from obj (device, data pointer,
 * shape, strides), released at once; never touches the data, so a fake CUDA producer can be checked here. */
static PyObject *testing_tensor_view(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"obj", "stream", NULL};
    PyObject *obj, *stream_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:_testing_tensor_view", keywords, &obj, &stream_obj))
        return NULL;
    uintptr_t stream;
    if (afpy_stream_from_object(stream_obj, &stream) < 0) return NULL;
    afpy_tensor t;
    if (afpy_tensor_from_object(obj, "tensor", false, stream, &t) < 0) return NULL;
    PyObject *shape = PyTuple_New(t.view.ndim), *strides = PyTuple_New(t.view.ndim);
    for (int d = 0; shape && strides && d < t.view.ndim; d++) {
        PyTuple_SET_ITEM(shape, d, PyLong_FromLongLong(t.view.shape[d]));
        PyTuple_SET_ITEM(strides, d, PyLong_FromLongLong(t.view.strides[d]));
    }
    PyObject *result = shape && strides ? Py_BuildValue("{s:s,s:i,s:K,s:O,s:O,s:s}", "device",
        t.view.device.type == AF_DEVICE_CUDA ? "cuda" : "cpu", "index", t.view.device.index,
        "data", (unsigned long long)(uintptr_t)t.view.data, "shape", shape, "strides", strides,
        "dtype", af_dtype_name(t.view.dtype)) : NULL;
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    afpy_tensor_release(&t);
    return result;
}

/* _testing_workspace(workspace, nbytes, device, stream) -> int: what a CUDA call's backend does with the bindings'
 * allocator (workspace.c), without a GPU: alloc through af_cuda_allocator with the GIL released, then free of what it
 * gave; the pointer alloc returned. When alloc fails, raises as a call would (MemoryError naming the workspace, the
 * allocator's exception as its __cause__). */
static PyObject *testing_workspace(PyObject *module, PyObject *args) {
    PyObject *workspace_obj;
    unsigned long long bytes, stream;
    int device;
    if (!PyArg_ParseTuple(args, "OKiK:_testing_workspace", &workspace_obj, &bytes, &device, &stream)) return NULL;
    afpy_workspace workspace;
    if (afpy_workspace_from_object(workspace_obj, &workspace) < 0) return NULL;
    const af_cuda_allocator *a = afpy_workspace_allocator(&workspace);
    if (!a) Py_RETURN_NONE;
    void *ptr;
    Py_BEGIN_ALLOW_THREADS
    ptr = a->alloc((size_t)bytes, device, (void *)(uintptr_t)stream, a->user);
    if (ptr) a->free(ptr, (size_t)bytes, device, (void *)(uintptr_t)stream, a->user);
    Py_END_ALLOW_THREADS
    if (!ptr)
        return afpy_workspace_raise(&workspace, af_fail(AF_ERR_NO_MEMORY, "workspace: the caller's allocator "
                                    "(af_cuda_allocator.alloc) returned NULL for %llu bytes on cuda:%d", bytes, device));
    return PyLong_FromVoidPtr(ptr);
}

/* _testing_host_record(on): clear the lent executor's counters and thread ids; on: record from now. */
static PyObject *testing_host_record(PyObject *module, PyObject *arg) {
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    afpy_host_openmp_record(on);
    Py_RETURN_NONE;
}

/* _testing_host_counts() -> {"regions", "members", "thread_ids"}: host regions entered, member threads run, and the
 * kernel thread ids (gettid) of those members, since _testing_host_record(True). */
static PyObject *testing_host_counts(PyObject *module, PyObject *unused) {
    const afpy_host_counts c = afpy_host_openmp_counts();
    long ids[64];
    const int n = afpy_host_openmp_thread_ids(ids, 64);
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        PyObject *id = PyLong_FromLong(ids[i]);
        if (!id) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, id);
    }
    if (!list) return NULL;
    return Py_BuildValue("{sl,sl,sN}", "regions", c.regions, "members", c.members, "thread_ids", list);
}

typedef struct { PyObject *fn, *results; } region_call;

/* One member of the host's region: takes the GIL, calls fn(index), keeps its result or its exception. */
static void region_member(void *ctx, int index) {
    region_call *r = ctx;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *result = PyObject_CallFunction(r->fn, "i", index);
    if (!result) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        if (!value) {
            Py_INCREF(Py_None);
            value = Py_None;
        }
        result = value;
        Py_XDECREF(type);
        Py_XDECREF(traceback);
    }
    PyList_SetItem(r->results, index, result);   /* steals result */
    PyGILState_Release(gil);
}

/* _testing_host_region(n, fn) -> [fn(0), ..., fn(n-1)] (an exception object where fn raised; None for an index the
 * team never ran): fn called on each thread of one parallel region of the lent OpenMP runtime, i.e. attnforge
 * called from inside the host's region. RuntimeError when no runtime is lent. */
static PyObject *testing_host_region(PyObject *module, PyObject *args) {
    int n;
    PyObject *fn;
    if (!PyArg_ParseTuple(args, "iO:_testing_host_region", &n, &fn)) return NULL;
    if (n < 1 || n > 64) return PyErr_Format(PyExc_ValueError, "n: expected 1..64 threads, got %d", n);
    region_call r = {fn, PyList_New(n)};
    if (!r.results) return NULL;
    for (int i = 0; i < n; i++) {
        Py_INCREF(Py_None);
        PyList_SET_ITEM(r.results, i, Py_None);
    }
    bool ran;
    Py_BEGIN_ALLOW_THREADS   /* the members take the GIL in turn */
    ran = afpy_host_openmp_region(n, region_member, &r);
    Py_END_ALLOW_THREADS
    if (!ran) {
        Py_DECREF(r.results);
        return PyErr_Format(PyExc_RuntimeError, "no host OpenMP runtime is lent to attnforge (host_threads() is None)");
    }
    return r.results;
}

PyMethodDef afpy_testing_methods[] = {
    {"_testing_workspace", testing_workspace, METH_VARARGS,
     "Test hook: alloc and free through the allocator a CUDA call's backend gets from `workspace`."},
    {"_testing_tensor_view", (PyCFunction)(void (*)(void))testing_tensor_view, METH_VARARGS | METH_KEYWORDS,
     "Test hook: the af_tensor view the binding reads from a tensor object (descriptors only)."},
    {"_testing_spy", testing_spy, METH_O, "Test hook: record the q/k/v pointers the provider's kernel receives."},
    {"_testing_seen", testing_seen, METH_NOARGS, "Test hook: (q, k, v) data pointers of the last spied call."},
    {"_testing_stats", testing_stats, METH_O, "Test hook: how the provider's infer ran its calls."},
    {"_testing_runtime_loaded", testing_runtime_loaded, METH_O, "Test hook: whether the backend is loaded."},
    {"_testing_host_record", testing_host_record, METH_O, "Test hook: clear (and on: record) the host executor's counts."},
    {"_testing_host_counts", testing_host_counts, METH_NOARGS, "Test hook: the host executor's regions, members, tids."},
    {"_testing_host_region", testing_host_region, METH_VARARGS,
     "Test hook: fn(index) on each thread of one parallel region of the lent OpenMP runtime."},
    {NULL, NULL, 0, NULL},
};
