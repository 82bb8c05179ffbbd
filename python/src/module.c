/* attnforge._C: the CPython extension module. The pure-Python package attnforge wraps it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <stdio.h>

#include "attnforge.h"
#include "backward_binding.h"
#include "errors.h"
#include "flash_binding.h"
#include "flex_binding.h"
#include "host_openmp.h"
#include "log_bridge.h"
#include "provider_binding.h"
#include "sdpa_binding.h"
#include "testing.h"

static PyObject *module_version(PyObject *m, PyObject *unused) { return PyUnicode_FromString(af_version()); }

static PyObject *module_set_num_threads(PyObject *m, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0 || n > 4096) {
        PyErr_Format(PyExc_ValueError, "threads: expected 0 (all cores) .. 4096, got %ld", n);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    af_set_num_threads((int)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *module_get_num_threads(PyObject *m, PyObject *unused) {
    int n;
    Py_BEGIN_ALLOW_THREADS
    n = af_get_num_threads();
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(n);
}

static PyObject *module_set_isa(PyObject *m, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    af_status status;
    Py_BEGIN_ALLOW_THREADS   /* choosing an ISA may log */
    status = af_set_isa(name);
    Py_END_ALLOW_THREADS
    if (status != AF_OK) return afpy_raise_status(status);
    Py_RETURN_NONE;
}

static PyObject *module_set_phase_invariant(PyObject *m, PyObject *arg) {
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    af_set_phase_invariant(on != 0);
    Py_RETURN_NONE;
}

static PyObject *module_get_phase_invariant(PyObject *m, PyObject *unused) {
    return PyBool_FromLong(af_get_phase_invariant());
}

static PyObject *module_get_isa(PyObject *m, PyObject *unused) {
    const char *isa;
    Py_BEGIN_ALLOW_THREADS
    isa = af_get_isa();
    Py_END_ALLOW_THREADS
    return PyUnicode_FromString(isa);
}

static PyObject *module_isa_available(PyObject *m, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    bool ok;
    Py_BEGIN_ALLOW_THREADS
    ok = af_isa_available(name);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

static PyObject *module_isas(PyObject *m, PyObject *unused) {
    PyObject *list = PyList_New(0);
    for (int i = 0; list && af_isa_name(i); i++) {
        PyObject *name = PyUnicode_FromString(af_isa_name(i));
        if (!name || PyList_Append(list, name) < 0) Py_CLEAR(list);
        Py_XDECREF(name);
    }
    return list;
}

/* load_cuda_backend() -> (devices, library, error): af_load_cuda_backend's answer whole, for diagnostics: the path
 * of the libattnforge_cuda.so loaded ("" if none) matters most when the driver or GPU then fails, so no raise. */
static PyObject *module_load_cuda_backend(PyObject *m, PyObject *unused) {
    char library[PATH_MAX + 64], error[1024];   /* error: af_last_error holds at most 1023 characters */
    int devices = 0;
    af_status status;
    Py_BEGIN_ALLOW_THREADS   /* loading logs, and the log callback runs Python code */
    status = af_load_cuda_backend(&devices, library, sizeof library);
    snprintf(error, sizeof error, "%s", af_last_error());
    Py_END_ALLOW_THREADS
    if (status == AF_OK) return Py_BuildValue("(isO)", devices, library, Py_None);
    return Py_BuildValue("(iss)", devices, library, error);
}

/* cuda_check_errors(device) -> None: af_cuda_check_errors; raises the error for the first bad index array entry
 * recorded on the device since the last check (InvalidArgumentError), or why the check could not run. */
static PyObject *module_cuda_check_errors(PyObject *m, PyObject *arg) {
    const long device = PyLong_AsLong(arg);
    if (device == -1 && PyErr_Occurred()) return NULL;
    if (device < 0 || device > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "device: a CUDA device index is >= 0, got %ld", device);
        return NULL;
    }
    af_status status;
    Py_BEGIN_ALLOW_THREADS   /* it waits for the device's work */
    status = af_cuda_check_errors((int)device);
    Py_END_ALLOW_THREADS
    if (status != AF_OK) return afpy_raise_status(status);
    Py_RETURN_NONE;
}

/* The samples file as the C library writes it, from JSON text or (is_path) a file; validates on the way. */
static PyObject *samples_round_trip(const char *text, Py_ssize_t len, bool is_path) {
    af_samples *samples = NULL;
    char *json = NULL;
    af_status status;
    Py_BEGIN_ALLOW_THREADS
    status = is_path ? af_samples_load(text, &samples) : af_samples_from_json(text, (size_t)len, &samples);
    if (status == AF_OK) status = af_samples_to_json(samples, &json);
    af_samples_free(samples);
    Py_END_ALLOW_THREADS
    if (status != AF_OK) return afpy_raise_status(status);
    PyObject *result = PyUnicode_FromString(json);
    af_free(json);
    return result;
}

static PyObject *module_samples_json(PyObject *m, PyObject *arg) {
    Py_ssize_t len;
    const char *json = PyUnicode_AsUTF8AndSize(arg, &len);
    if (!json) return NULL;
    return samples_round_trip(json, len, false);
}

static PyObject *module_load_samples(PyObject *m, PyObject *arg) {
    PyObject *path = NULL;
    if (!PyUnicode_FSConverter(arg, &path)) return NULL;
    PyObject *result = samples_round_trip(PyBytes_AS_STRING(path), 0, true);
    Py_DECREF(path);
    return result;
}

static PyObject *module_shutdown(PyObject *m, PyObject *unused) {
    afpy_log_uninstall();
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"sdpa", (PyCFunction)(void (*)(void))afpy_sdpa, METH_VARARGS | METH_KEYWORDS,
     "sdpa(args, kwargs, out, lse=None, causal_bottom_right=False, reference=False, stream=None, workspace=None): "
     "af_sdpa into out."},
    {"flex_attn", (PyCFunction)(void (*)(void))afpy_flex_attn, METH_VARARGS | METH_KEYWORDS,
     "flex_attn(query, key, value, out, lse=None, *, scale, score_mod, mask_mod, block_mask, reference): af_flex_attn "
     "into out."},
    {"flex_attn_backward", (PyCFunction)(void (*)(void))afpy_flex_attn_backward, METH_VARARGS | METH_KEYWORDS,
     "flex_attn_backward(query, key, value, out, dout, lse, dq, dk, dv, *, scale, score_mod, mask_mod, block_mask, daux, "
     "reference): af_flex_attn_backward into dq, dk, dv (None: not wanted)."},
    {"create_block_mask", afpy_create_block_mask, METH_VARARGS,
     "create_block_mask(mask_mod, B, H, L, S, q_block, kv_block, kv_num_blocks, kv_indices, full_kv_num_blocks, "
     "full_kv_indices): af_create_block_mask into the tensors."},
    {"flash_attn", (PyCFunction)(void (*)(void))afpy_flash_attn, METH_VARARGS | METH_KEYWORDS,
     "flash_attn(query, key, value, out, lse=None, *, ...): af_flash_attn (or its reference) into out."},
    {"sdpa_backward", (PyCFunction)(void (*)(void))afpy_sdpa_backward, METH_VARARGS | METH_KEYWORDS,
     "sdpa_backward(args, kwargs, out, dout, lse, dq, dk, dv, causal_bottom_right=False, reference=False): "
     "af_sdpa_backward into dq, dk, dv (None: not wanted)."},
    {"flash_attn_backward", (PyCFunction)(void (*)(void))afpy_flash_attn_backward, METH_VARARGS | METH_KEYWORDS,
     "flash_attn_backward(query, key, value, out, dout, lse, dq, dk, dv, dsink=None, *, ...): "
     "af_flash_attn_backward (or its reference) into the gradients."},
    {"version", module_version, METH_NOARGS, "The linked library's version."},
    {"set_num_threads", module_set_num_threads, METH_O, "Threads per call; 0 = all cores."},
    {"get_num_threads", module_get_num_threads, METH_NOARGS, "Threads a call will use."},
    {"use_host_threads", afpy_use_host_threads, METH_O,
     "use_host_threads(library): lend the GNU OpenMP runtime `library` loaded -> (runtime, None) or (None, why)."},
    {"stop_host_threads", afpy_stop_host_threads, METH_NOARGS, "attnforge's own thread pool again."},
    {"host_threads", afpy_host_threads, METH_NOARGS, "Path of the OpenMP runtime lent to attnforge, or None."},
    {"set_isa", module_set_isa, METH_O, "Choose the kernels' ISA: 'portable', 'avx2', 'avx512', 'amx'."},
    {"isas", module_isas, METH_NOARGS, "The ISAs compiled into this build, from 'portable' up."},
    {"set_phase_invariant", module_set_phase_invariant, METH_O, "Decode rows on the prefill's tile products."},
    {"get_phase_invariant", module_get_phase_invariant, METH_NOARGS, "Whether decode rows run on the tile products."},
    {"get_isa", module_get_isa, METH_NOARGS, "The ISA in use."},
    {"isa_available", module_isa_available, METH_O, "Whether this machine can run the ISA."},
    {"cuda_check_errors", module_cuda_check_errors, METH_O,
     "cuda_check_errors(device): raise the first bad index array entry the device recorded since the last check."},
    {"load_cuda_backend", module_load_cuda_backend, METH_NOARGS,
     "Open the CUDA backend now: (devices, path of libattnforge_cuda.so or '', None or why it cannot run)."},
    {"samples_json", module_samples_json, METH_O, "Samples-file JSON as the C library reads and rewrites it."},
    {"load_samples", module_load_samples, METH_O, "A samples file, read by the C library, as its JSON."},
    {"_shutdown", module_shutdown, METH_NOARGS, "Detach the log callback (at interpreter exit)."},
    {NULL, NULL, 0, NULL},
};

static void module_free(void *m) { afpy_log_uninstall(); }

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "attnforge._C", "attnforge's C library, bound with the CPython C API.", -1,
    module_methods, NULL, NULL, NULL, module_free,
};

PyMODINIT_FUNC PyInit__C(void) {
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    if (afpy_errors_init(m) < 0 || afpy_provider_init(m) < 0 || PyModule_AddFunctions(m, afpy_testing_methods) < 0 ||
        PyModule_AddStringConstant(m, "SUPPORTED_FUNCTION", af_provider_supported_function()) < 0 ||
        PyModule_AddStringConstant(m, "__version__", af_version()) < 0 || afpy_log_install() < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
