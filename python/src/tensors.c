#include "tensors.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "errors.h"

/* Valid tensors that attnforge cannot read (dtype, device, rank): attnforge.UnsupportedError. */
static int unsupported(const char *fmt, ...) {
    char message[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    afpy_raise_message(AF_ERR_UNSUPPORTED, message);
    return -1;
}

/* ---------------------------------------------------------------- buffer protocol (NumPy) */

/* struct-module format → dtype; native or little-endian byte order only. */
static int dtype_from_format(const char *format, Py_ssize_t itemsize, af_dtype *dtype) {
    if (!format) format = "B";
    if (*format == '@' || *format == '=' || *format == '<') format++;
    if (format[0] == '\0' || format[1] != '\0') return -1;
    switch (format[0]) {
    case 'f': if (itemsize == 4) { *dtype = AF_F32; return 0; } break;
    case 'e': if (itemsize == 2) { *dtype = AF_F16; return 0; } break;
    case '?': if (itemsize == 1) { *dtype = AF_BOOL; return 0; } break;
    }
    return -1;
}

static int from_buffer(PyObject *obj, const char *name, bool writable, afpy_tensor *t) {
    const int flags = writable ? PyBUF_RECORDS : PyBUF_RECORDS_RO;   /* strides + format (+ writable) */
    if (PyObject_GetBuffer(obj, &t->buffer, flags) < 0) {
        if (!writable) return -1;
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        if (PyObject_GetBuffer(obj, &t->buffer, PyBUF_RECORDS_RO) == 0) {   /* readable, not writable: say so */
            PyBuffer_Release(&t->buffer);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(traceback);
            PyErr_Format(PyExc_ValueError, "%s: the array is read-only; the output must be writable", name);
        } else {
            PyErr_Clear();
            PyErr_Restore(type, value, traceback);
        }
        return -1;
    }
    t->has_buffer = true;
    Py_buffer *b = &t->buffer;
    af_dtype dtype;
    if (dtype_from_format(b->format, b->itemsize, &dtype) < 0) {
        unsupported("%s: buffer format '%s' is not supported; expected float32, float16 or bool "
                    "(bfloat16 through torch tensors)", name, b->format ? b->format : "B");
        goto fail;
    }
    if (b->ndim > AF_MAX_DIMS) {
        unsupported("%s: %d dimensions; at most %d are supported", name, b->ndim, AF_MAX_DIMS);
        goto fail;
    }
    t->view.data = b->buf;
    t->view.dtype = dtype;
    t->view.ndim = b->ndim;
    for (int d = 0; d < b->ndim; d++) {
        t->view.shape[d] = b->shape[d];
        Py_ssize_t stride = b->strides ? b->strides[d] : 0;
        if (stride % b->itemsize != 0) {
            unsupported("%s: stride[%d] of %zd bytes is not a multiple of the item size %zd", name, d, stride,
                        b->itemsize);
            goto fail;
        }
        t->view.strides[d] = stride / b->itemsize;   /* bytes → elements; negative ones are rejected by the library */
    }
    if (!b->strides) {   /* only for 0-d or contiguous exporters that ignore PyBUF_STRIDES */
        t->view = af_tensor_contiguous(b->buf, dtype, b->ndim, t->view.shape);
    }
    return 0;
fail:
    PyBuffer_Release(b);
    t->has_buffer = false;
    return -1;
}

/* ---------------------------------------------------------------- DLPack (torch) */

static const char *device_name(int32_t type) {
    switch (type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda";
    case kDLCUDAHost: return "cuda_host";
    case kDLROCM: return "rocm";
    case kDLCUDAManaged: return "cuda_managed";
    }
    return "a non-CPU device";
}

static int dtype_from_dlpack(DLDataType dt, af_dtype *dtype) {
    if (dt.lanes != 1) return -1;
    if (dt.code == kDLFloat && dt.bits == 32) *dtype = AF_F32;
    else if (dt.code == kDLFloat && dt.bits == 16) *dtype = AF_F16;
    else if (dt.code == kDLBfloat && dt.bits == 16) *dtype = AF_BF16;
    else if (dt.code == kDLBool && dt.bits == 8) *dtype = AF_BOOL;
    else return -1;
    return 0;
}

static const char *dlpack_type_text(DLDataType dt, char *buf, size_t size) {
    static const char *codes[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
    snprintf(buf, size, "%s%u%s", dt.code < 7 ? codes[dt.code] : "code?", (unsigned)dt.bits, dt.lanes != 1 ? "xN" : "");
    return buf;
}

static int view_from_dltensor(const DLTensor *dl, const char *name, af_tensor *view) {
    if (dl->device.device_type != kDLCPU) {
        return unsupported("%s: tensor is on %s:%d; attnforge runs on the CPU", name,
                           device_name(dl->device.device_type), (int)dl->device.device_id);
    }
    af_dtype dtype;
    if (dtype_from_dlpack(dl->dtype, &dtype) < 0) {
        char text[32];
        return unsupported("%s: dtype %s is not supported; expected float32, float16, bfloat16 or bool", name,
                           dlpack_type_text(dl->dtype, text, sizeof text));
    }
    if (dl->ndim < 0 || dl->ndim > AF_MAX_DIMS) {
        return unsupported("%s: %d dimensions; at most %d are supported", name, (int)dl->ndim, AF_MAX_DIMS);
    }
    void *data = (char *)dl->data + dl->byte_offset;
    int64_t shape[AF_MAX_DIMS] = {0};
    for (int d = 0; d < dl->ndim; d++) shape[d] = dl->shape[d];
    *view = af_tensor_contiguous(data, dtype, dl->ndim, shape);   /* NULL strides mean row-major */
    if (dl->strides)
        for (int d = 0; d < dl->ndim; d++) view->strides[d] = dl->strides[d];
    return 0;
}

static int from_dlpack(PyObject *obj, PyObject *dlpack_method, const char *name, afpy_tensor *t) {
    PyObject *capsule = PyObject_CallNoArgs(dlpack_method);   /* no max_version: a v0.8 "dltensor" capsule */
    if (!capsule) {
        if (!PyErr_ExceptionMatches(PyExc_BufferError)) return -1;
        PyObject *type, *value, *traceback;   /* e.g. a meta tensor: a tensor attnforge cannot read */
        PyErr_Fetch(&type, &value, &traceback);
        PyObject *text = value ? PyObject_Str(value) : NULL;
        const char *message = text ? PyUnicode_AsUTF8(text) : NULL;
        if (!message) PyErr_Clear();
        unsupported("%s: cannot be read through DLPack: %s", name, message ? message : "BufferError");
        Py_XDECREF(text);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        return -1;
    }
    DLManagedTensor *managed = PyCapsule_IsValid(capsule, "dltensor") ? PyCapsule_GetPointer(capsule, "dltensor") : NULL;
    if (!managed) {
        Py_DECREF(capsule);
        PyErr_Format(PyExc_TypeError, "%s: __dlpack__() did not return a \"dltensor\" capsule", name);
        return -1;
    }
    /* take ownership: after the rename the capsule's destructor leaves the tensor to us */
    if (PyCapsule_SetName(capsule, "used_dltensor") < 0) {
        Py_DECREF(capsule);
        return -1;
    }
    Py_DECREF(capsule);
    t->managed = managed;
    if (view_from_dltensor(&managed->dl_tensor, name, &t->view) < 0) {
        afpy_tensor_release(t);
        return -1;
    }
    (void)obj;
    return 0;
}

/* ---------------------------------------------------------------- either */

int afpy_tensor_from_object(PyObject *obj, const char *name, bool writable, afpy_tensor *t) {
    memset(t, 0, sizeof *t);
    if (PyObject_CheckBuffer(obj)) return from_buffer(obj, name, writable, t);
    PyObject *method = PyObject_GetAttrString(obj, "__dlpack__");
    if (!method) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s: expected a tensor (torch.Tensor, NumPy array, or an object with __dlpack__ or the buffer "
                     "protocol), got %s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    int rc = from_dlpack(obj, method, name, t);
    Py_DECREF(method);
    return rc;
}

void afpy_tensor_release(afpy_tensor *t) {
    if (t->managed) {
        if (t->managed->deleter) t->managed->deleter(t->managed);
        t->managed = NULL;
    }
    if (t->has_buffer) {
        PyBuffer_Release(&t->buffer);
        t->has_buffer = false;
    }
}
