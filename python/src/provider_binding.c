#include "provider_binding.h"

#include <string.h>

#include "log_bridge.h"
#include "call_args.h"
#include "errors.h"
#include "sdpa_binding.h"
#include "workspace.h"

/* ---------------------------------------------------------------- life */

static PyObject *wrap(PyTypeObject *type, af_provider *provider) {
    afpy_provider *self = (afpy_provider *)type->tp_alloc(type, 0);
    if (!self) {
        af_provider_free(provider);
        return NULL;
    }
    self->provider = provider;
    if (pthread_rwlock_init(&self->lock, NULL) != 0) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    self->lock_ready = true;
    return (PyObject *)self;
}

static PyObject *provider_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    afpy_log_sync();   /* C messages at the logger's level only */
    if (!PyArg_ParseTuple(args, ":Provider") || (kwargs && PyDict_Size(kwargs) > 0)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Provider() takes no arguments");
        return NULL;
    }
    af_provider *provider = af_provider_new();
    if (!provider) return PyErr_NoMemory();
    return wrap(type, provider);
}

static void provider_dealloc(afpy_provider *self) {
    af_provider_free(self->provider);   /* no infer can be running: each holds a reference to self */
    if (self->lock_ready) pthread_rwlock_destroy(&self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ---------------------------------------------------------------- prepare / plan JSON */

/* prepare(samples_json: str) -> bool; the samples file's JSON (docs/FORMATS.md). */
static PyObject *provider_prepare(afpy_provider *self, PyObject *arg) {
    afpy_log_sync();   /* C messages at the logger's level only */
    Py_ssize_t len;
    const char *json = PyUnicode_AsUTF8AndSize(arg, &len);
    if (!json) return NULL;
    af_samples *samples = NULL;
    af_status status;
    Py_BEGIN_ALLOW_THREADS   /* parsing and preparing may log: never hold the GIL into libattnforge */
    status = af_samples_from_json(json, (size_t)len, &samples);
    Py_END_ALLOW_THREADS
    if (status != AF_OK) return afpy_raise_status(status);
    bool ok;
    Py_BEGIN_ALLOW_THREADS   /* the write lock waits for running infers, which may take the GIL (workspace.c) */
    pthread_rwlock_wrlock(&self->lock);
    ok = af_provider_prepare(self->provider, samples);
    pthread_rwlock_unlock(&self->lock);
    af_samples_free(samples);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

static PyObject *provider_to_json(afpy_provider *self, PyObject *unused) {
    char *json = NULL;
    af_status status;
    Py_BEGIN_ALLOW_THREADS
    status = af_provider_to_json(self->provider, &json);
    Py_END_ALLOW_THREADS
    if (status != AF_OK) return afpy_raise_status(status);
    PyObject *text = PyUnicode_FromString(json);
    af_free(json);
    return text;
}

/* Provider.from_json(text: str) -> Provider, prepared. */
static PyObject *provider_from_json(PyObject *cls, PyObject *arg) {
    afpy_log_sync();   /* C messages at the logger's level only */
    Py_ssize_t len;
    const char *json = PyUnicode_AsUTF8AndSize(arg, &len);
    if (!json) return NULL;
    af_provider *provider = NULL;
    af_status status;
    Py_BEGIN_ALLOW_THREADS
    status = af_provider_from_json(json, (size_t)len, &provider);
    Py_END_ALLOW_THREADS
    if (status != AF_OK) return afpy_raise_status(status);
    return wrap((PyTypeObject *)cls, provider);
}

/* Provider.load(path: str | os.PathLike) -> Provider, prepared. */
static PyObject *provider_load(PyObject *cls, PyObject *arg) {
    afpy_log_sync();   /* C messages at the logger's level only */
    PyObject *path = NULL;
    if (!PyUnicode_FSConverter(arg, &path)) return NULL;
    af_provider *provider = NULL;
    af_status status;
    const char *text = PyBytes_AS_STRING(path);
    Py_BEGIN_ALLOW_THREADS
    status = af_provider_load(text, &provider);
    Py_END_ALLOW_THREADS
    Py_DECREF(path);
    if (status != AF_OK) return afpy_raise_status(status);
    return wrap((PyTypeObject *)cls, provider);
}

/* ---------------------------------------------------------------- infer */

/* A call that is neither the seed's positional form nor its keyword form (some of q/k/v by keyword)
 * must not pass as the plan's form: give the guard the other one, so it runs on the general path. */
static af_qkv_source call_source(const afpy_provider *self, PyObject *args, af_qkv_source bound) {
    const Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n == 0 || n >= 3) return bound;
    af_plan plan;
    if (af_provider_get_plan(self->provider, &plan) != AF_OK) return bound;   /* infer reports "not prepared" */
    return plan.qkv_source == AF_QKV_POSITIONAL ? AF_QKV_KEYWORD : AF_QKV_POSITIONAL;
}

/* infer(args: tuple, kwargs: dict, out, lse=None, strict=False, stream=None, workspace=None) -> None: runs the plan
 * into out. A call that does not match the plan runs on the general path, or with strict=True raises
 * PlanMismatchError unrun. stream: the cudaStream_t (an int) a CUDA call is enqueued on, None = the legacy default
 * stream; workspace: None or (alloc, free), where a CUDA call's scratch comes from (workspace.h). */
static PyObject *provider_infer(afpy_provider *self, PyObject *args, PyObject *kwargs) {
    afpy_log_sync();   /* C messages at the logger's level only */
    static char *keywords[] = {"args", "kwargs", "out", "lse", "strict", "stream", "workspace", NULL};
    PyObject *call_args, *call_kwargs, *out_obj, *lse_obj = Py_None, *stream_obj = Py_None, *workspace_obj = Py_None;
    int strict = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!O|OpOO:infer", keywords, &PyTuple_Type, &call_args,
                                     &PyDict_Type, &call_kwargs, &out_obj, &lse_obj, &strict, &stream_obj,
                                     &workspace_obj))
        return NULL;
    uintptr_t stream;
    if (afpy_stream_from_object(stream_obj, &stream) < 0) return NULL;
    afpy_workspace workspace;
    if (afpy_workspace_from_object(workspace_obj, &workspace) < 0) return NULL;
    afpy_call call;
    if (afpy_call_parse(call_args, call_kwargs, stream, &call) < 0) return NULL;
    call.args.workspace = afpy_workspace_allocator(&workspace);
    afpy_tensor out = {0}, lse = {0};
    if (afpy_outputs_from_objects(out_obj, lse_obj, stream, &out, &lse) < 0) {
        afpy_call_release(&call);
        return NULL;
    }
    af_tensor *lse_view = lse_obj != Py_None ? &lse.view : NULL;
    af_status status;
    Py_BEGIN_ALLOW_THREADS   /* the views hold their memory; the read lock keeps prepare from swapping the plan */
    pthread_rwlock_rdlock(&self->lock);
    const af_qkv_source source = call_source(self, call_args, call.source);
    status = strict ? af_provider_check_call(self->provider, &call.args, source) : AF_OK;
    if (status == AF_OK) status = af_provider_infer(self->provider, &call.args, source, &out.view, lse_view);
    pthread_rwlock_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    afpy_tensor_release(&out);
    afpy_tensor_release(&lse);
    afpy_call_release(&call);
    if (status != AF_OK) return afpy_workspace_raise(&workspace, status);
    Py_RETURN_NONE;
}

/* check_call(args: tuple, kwargs: dict, stream=None) -> None: the per-call guard alone (af_provider_check_call);
 * PlanMismatchError naming the difference when infer would not run this call with the plan. Runs nothing (the
 * Python provider guards fa4 plans with it before it calls FlashAttention-4). */
static PyObject *provider_check_call(afpy_provider *self, PyObject *args, PyObject *kwargs) {
    afpy_log_sync();   /* C messages at the logger's level only */
    static char *keywords[] = {"args", "kwargs", "stream", NULL};
    PyObject *call_args, *call_kwargs, *stream_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!|O:check_call", keywords, &PyTuple_Type, &call_args,
                                     &PyDict_Type, &call_kwargs, &stream_obj))
        return NULL;
    uintptr_t stream;
    if (afpy_stream_from_object(stream_obj, &stream) < 0) return NULL;
    afpy_call call;
    if (afpy_call_parse(call_args, call_kwargs, stream, &call) < 0) return NULL;
    af_status status;
    Py_BEGIN_ALLOW_THREADS
    pthread_rwlock_rdlock(&self->lock);
    status = af_provider_check_call(self->provider, &call.args, call_source(self, call_args, call.source));
    pthread_rwlock_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    afpy_call_release(&call);
    if (status != AF_OK) return afpy_raise_status(status);
    Py_RETURN_NONE;
}

static PyObject *provider_load_runtime(afpy_provider *self, PyObject *unused) {
    afpy_log_sync();   /* C messages at the logger's level only */
    af_status status;
    Py_BEGIN_ALLOW_THREADS
    status = af_provider_load_runtime_dependencies(self->provider);
    Py_END_ALLOW_THREADS
    if (status != AF_OK) return afpy_raise_status(status);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- properties */

static PyObject *provider_get_name(afpy_provider *self, void *closure) {
    const char *name;
    Py_BEGIN_ALLOW_THREADS   /* the name reads the ISA, which may log on first use */
    name = af_provider_name(self->provider);
    Py_END_ALLOW_THREADS
    return PyUnicode_FromString(name);
}

static PyObject *provider_get_reason(afpy_provider *self, void *closure) {
    return PyUnicode_FromString(af_provider_reason(self->provider));
}

static PyObject *provider_get_prepared(afpy_provider *self, void *closure) {
    return PyBool_FromLong(af_provider_is_prepared(self->provider));
}

static PyMethodDef provider_methods[] = {
    {"prepare", (PyCFunction)provider_prepare, METH_O, "prepare(samples_json) -> bool"},
    {"to_json", (PyCFunction)provider_to_json, METH_NOARGS, "The plan as attnforge's plan JSON."},
    {"from_json", (PyCFunction)provider_from_json, METH_O | METH_CLASS, "A prepared provider from plan JSON."},
    {"load", (PyCFunction)provider_load, METH_O | METH_CLASS, "A prepared provider from a plan file."},
    {"infer", (PyCFunction)(void (*)(void))provider_infer, METH_VARARGS | METH_KEYWORDS,
     "infer(args, kwargs, out, lse=None, strict=False, stream=None, workspace=None): run one SDPA call into out."},
    {"check_call", (PyCFunction)(void (*)(void))provider_check_call, METH_VARARGS | METH_KEYWORDS,
     "check_call(args, kwargs, stream=None): PlanMismatchError unless infer would run this call with the plan."},
    {"load_runtime_dependencies", (PyCFunction)provider_load_runtime, METH_NOARGS, "Load the plan's backend now."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef provider_getset[] = {
    {"name", (getter)provider_get_name, NULL, "Human-readable name with the version.", NULL},
    {"reason", (getter)provider_get_reason, NULL, "Why the last prepare() returned False ('' after success).", NULL},
    {"is_prepared", (getter)provider_get_prepared, NULL, "Whether a plan is ready.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject afpy_provider_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "attnforge._C.Provider",
    .tp_basicsize = sizeof(afpy_provider),
    .tp_dealloc = (destructor)provider_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One attnforge provider (af_provider): samples -> plan -> JSON -> guarded infer.",
    .tp_methods = provider_methods,
    .tp_getset = provider_getset,
    .tp_new = provider_new,
};

int afpy_provider_init(PyObject *module) {
    if (PyType_Ready(&afpy_provider_type) < 0) return -1;
    Py_INCREF(&afpy_provider_type);
    if (PyModule_AddObject(module, "Provider", (PyObject *)&afpy_provider_type) < 0) {
        Py_DECREF(&afpy_provider_type);
        return -1;
    }
    return 0;
}
