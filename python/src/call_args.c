#include "call_args.h"

#include <string.h>

enum { ARG_QUERY, ARG_KEY, ARG_VALUE, ARG_MASK, ARG_DROPOUT, ARG_CAUSAL, ARG_SCALE, ARG_GQA, N_ARGS };
static const char *const arg_names[N_ARGS] = {"query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                                              "enable_gqa"};

/* Positional and keyword arguments → one slot per parameter (borrowed references, NULL = not given). */
static int bind(PyObject *args, PyObject *kwargs, PyObject *slots[N_ARGS]) {
    const Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n > N_ARGS) {
        PyErr_Format(PyExc_TypeError, "scaled_dot_product_attention() takes at most %d positional arguments (%zd given)",
                     N_ARGS, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) slots[i] = PyTuple_GET_ITEM(args, i);
    if (kwargs) {
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(kwargs, &pos, &key, &value)) {
            int found = -1;
            for (int i = 0; i < N_ARGS && found < 0; i++)
                if (PyUnicode_Check(key) && PyUnicode_CompareWithASCIIString(key, arg_names[i]) == 0) found = i;
            if (found < 0) {
                PyErr_Format(PyExc_TypeError, "scaled_dot_product_attention() got an unexpected keyword argument %R", key);
                return -1;
            }
            if (slots[found]) {
                PyErr_Format(PyExc_TypeError, "scaled_dot_product_attention() got multiple values for argument '%s'",
                             arg_names[found]);
                return -1;
            }
            slots[found] = value;
        }
    }
    for (int i = ARG_QUERY; i <= ARG_VALUE; i++)
        if (!slots[i]) {
            PyErr_Format(PyExc_TypeError, "scaled_dot_product_attention() missing required argument '%s'", arg_names[i]);
            return -1;
        }
    return 0;
}

static int read_double(PyObject *obj, const char *name, double *out) {
    *out = PyFloat_AsDouble(obj);
    if (*out == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: expected a number, got %s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

static int read_bool(PyObject *obj, const char *name, bool *out) {
    int truth = PyObject_IsTrue(obj);
    if (truth < 0) return -1;
    *out = truth != 0;
    return 0;
}

int afpy_stream_from_object(PyObject *obj, uintptr_t *stream) {
    *stream = 0;
    if (!obj || obj == Py_None) return 0;
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "stream: expected None or a cudaStream_t as an int, got %s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    const unsigned long long value = PyLong_AsUnsignedLongLong(obj);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "stream: a cudaStream_t is a non-negative pointer-sized int");
        return -1;
    }
    if (value > UINTPTR_MAX) {
        PyErr_SetString(PyExc_ValueError, "stream: does not fit in a pointer");
        return -1;
    }
    *stream = (uintptr_t)value;
    return 0;
}

int afpy_call_parse(PyObject *args, PyObject *kwargs, uintptr_t stream, afpy_call *call) {
    memset(call, 0, sizeof *call);
    PyObject *slots[N_ARGS] = {0};
    if (bind(args, kwargs, slots) < 0) return -1;
    af_sdpa_args *a = &call->args;
    /* the seed's two forms; anything else (some q/k/v positional, some by keyword) is neither */
    const Py_ssize_t n = PyTuple_GET_SIZE(args);
    call->source = n >= 3 ? AF_QKV_POSITIONAL : AF_QKV_KEYWORD;
    if (slots[ARG_DROPOUT] && read_double(slots[ARG_DROPOUT], "dropout_p", &a->dropout_p) < 0) return -1;
    if (slots[ARG_CAUSAL] && read_bool(slots[ARG_CAUSAL], "is_causal", &a->is_causal) < 0) return -1;
    if (slots[ARG_SCALE] && slots[ARG_SCALE] != Py_None) {
        if (read_double(slots[ARG_SCALE], "scale", &a->scale) < 0) return -1;
        a->has_scale = true;
    }
    if (slots[ARG_GQA] && read_bool(slots[ARG_GQA], "enable_gqa", &a->enable_gqa) < 0) return -1;

    afpy_tensor *tensors[4] = {&call->query, &call->key, &call->value, &call->attn_mask};
    for (int i = 0; i < 4; i++) {
        if (i == ARG_MASK && (!slots[ARG_MASK] || slots[ARG_MASK] == Py_None)) continue;
        if (afpy_tensor_from_object(slots[i], arg_names[i], false, stream, tensors[i]) < 0) {
            afpy_call_release(call);
            return -1;
        }
    }
    a->query = &call->query.view;
    a->key = &call->key.view;
    a->value = &call->value.view;
    a->attn_mask = slots[ARG_MASK] && slots[ARG_MASK] != Py_None ? &call->attn_mask.view : NULL;
    a->stream = (void *)stream;   /* read by af_sdpa for CUDA tensors only */
    return 0;
}

void afpy_call_release(afpy_call *call) {
    afpy_tensor_release(&call->query);
    afpy_tensor_release(&call->key);
    afpy_tensor_release(&call->value);
    afpy_tensor_release(&call->attn_mask);
}
