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
    case 'i': if (itemsize == 4) { *dtype = AF_I32; return 0; } break;   /* lengths and page tables */
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
        unsupported("%s: buffer format '%s' is not supported; expected float32, float16, bool or int32 "
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
    return "a device attnforge does not know";
}

static bool is_cuda(int32_t type) { return type == kDLCUDA || type == kDLCUDAManaged; }

int afpy_device_from_dlpack(int32_t device_type, int32_t device_id, af_device *device) {
    memset(device, 0, sizeof *device);
    if (device_type == kDLCPU || device_type == kDLCUDAHost) return 0;   /* pinned host memory is host memory */
    if (!is_cuda(device_type) || device_id < 0) return -1;   /* managed memory: the device that runs the call */
    device->type = AF_DEVICE_CUDA;
    device->index = device_id;
    return 0;
}

static int dtype_from_dlpack(DLDataType dt, af_dtype *dtype) {
    if (dt.lanes != 1) return -1;
    if (dt.code == kDLFloat && dt.bits == 32) *dtype = AF_F32;
    else if (dt.code == kDLFloat && dt.bits == 16) *dtype = AF_F16;
    else if (dt.code == kDLBfloat && dt.bits == 16) *dtype = AF_BF16;
    else if (dt.code == kDLBool && dt.bits == 8) *dtype = AF_BOOL;
    else if (dt.code == kDLInt && dt.bits == 32) *dtype = AF_I32;
    else if (dt.code == kDLFloat8_e4m3fn && dt.bits == 8) *dtype = AF_F8E4M3;
    else if (dt.code == kDLFloat8_e5m2 && dt.bits == 8) *dtype = AF_F8E5M2;
    else return -1;
    return 0;
}

static const char *dlpack_type_text(DLDataType dt, char *buf, size_t size) {
    static const char *codes[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool", "float8_e3m4",
                                  "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz",
                                  "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"};
    const bool named = dt.code < sizeof codes / sizeof codes[0];
    snprintf(buf, size, "%s%u%s", named ? codes[dt.code] : "code?", (unsigned)dt.bits, dt.lanes != 1 ? "xN" : "");
    return buf;
}

/* The view of a DLTensor: descriptors only, the data is never read here (it may be device memory). */
static int view_from_dltensor(const DLTensor *dl, const char *name, bool handshake_done, af_tensor *view) {
    af_device device;
    if (afpy_device_from_dlpack(dl->device.device_type, dl->device.device_id, &device) < 0)
        return unsupported("%s: tensor is on %s:%d; attnforge runs on the CPU and on CUDA devices", name,
                           device_name(dl->device.device_type), (int)dl->device.device_id);
    if (device.type == AF_DEVICE_CUDA && !handshake_done)   /* its producer could not be told our stream */
        return unsupported("%s: a CUDA tensor from an object without __dlpack_device__(); attnforge needs it to pass "
                           "its stream to __dlpack__(stream=...)", name);
    af_dtype dtype;
    if (dtype_from_dlpack(dl->dtype, &dtype) < 0) {
        char text[32];
        return unsupported("%s: dtype %s is not supported; expected float32, float16, bfloat16, float8_e4m3fn, "
                           "float8_e5m2, bool or int32",
                           name,
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
    view->device = device;
    return 0;
}

/* The pending BufferError or ValueError of a producer that cannot export this tensor (e.g. a meta tensor) as
 * UnsupportedError naming the argument; other exceptions stay as they are. Returns -1. */
static int unreadable(const char *name) {
    if (!PyErr_ExceptionMatches(PyExc_BufferError) && !PyErr_ExceptionMatches(PyExc_ValueError)) return -1;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *text = value ? PyObject_Str(value) : NULL;
    const char *message = text ? PyUnicode_AsUTF8(text) : NULL;
    if (!message) PyErr_Clear();
    unsupported("%s: cannot be read through DLPack: %s", name, message ? message : "the producer refused");
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    return -1;
}

/* __dlpack_device__() -> (device_type, device_id); 1 when the object has it, 0 when not, -1 on error. */
static int dlpack_device(PyObject *obj, const char *name, int32_t *type, int32_t *id) {
    PyObject *method = PyObject_GetAttrString(obj, "__dlpack_device__");
    if (!method) {
        PyErr_Clear();
        return 0;
    }
    PyObject *result = PyObject_CallNoArgs(method);
    Py_DECREF(method);
    if (!result) return unreadable(name);
    long t = -1, i = -1;
    const bool ok = PyTuple_Check(result) && PyTuple_GET_SIZE(result) == 2 &&
                    (t = PyLong_AsLong(PyTuple_GET_ITEM(result, 0))) != -1 &&
                    (i = PyLong_AsLong(PyTuple_GET_ITEM(result, 1))) != -1 && t <= INT32_MAX && i <= INT32_MAX;
    Py_DECREF(result);
    if (!ok) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: __dlpack_device__() must return (device_type, device_id)", name);
        return -1;
    }
    *type = (int32_t)t;
    *id = (int32_t)i;
    return 1;
}

/* __dlpack__(), or for a CUDA producer __dlpack__(stream=S): the stream handshake of the DLPack protocol, S the
 * stream the call runs on (1 = the legacy default stream, else the cudaStream_t), so the producer makes S wait for
 * the tensor's pending work. */
static PyObject *export_capsule(PyObject *dlpack_method, bool cuda, uintptr_t stream) {
    if (!cuda) return PyObject_CallNoArgs(dlpack_method);   /* no max_version: a v0.8 "dltensor" capsule */
    PyObject *kwargs = Py_BuildValue("{sK}", "stream", (unsigned long long)(stream ? stream : 1));
    if (!kwargs) return NULL;
    PyObject *empty = PyTuple_New(0);
    PyObject *capsule = empty ? PyObject_Call(dlpack_method, empty, kwargs) : NULL;
    Py_XDECREF(empty);
    Py_DECREF(kwargs);
    return capsule;
}

/* Take the tensor out of a "dltensor" capsule (consumed: renamed "used_dltensor", as the protocol asks) into t. */
static int take_capsule(PyObject *capsule, const char *name, afpy_tensor *t) {
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
    return 0;
}

static int from_dlpack(PyObject *obj, PyObject *dlpack_method, const char *name, uintptr_t stream, afpy_tensor *t) {
    int32_t reported_type = kDLCPU, reported_id = 0;
    const int has_device = dlpack_device(obj, name, &reported_type, &reported_id);
    if (has_device < 0) return -1;
    const bool cuda = has_device && is_cuda(reported_type);
    PyObject *capsule = export_capsule(dlpack_method, cuda, stream);
    if (!capsule) return unreadable(name);
    if (take_capsule(capsule, name, t) < 0) return -1;
    const DLDevice got = t->managed->dl_tensor.device;
    af_device said, found;   /* compared as attnforge reads them: pinned host memory and the CPU are one */
    const bool said_ok = afpy_device_from_dlpack(reported_type, reported_id, &said) == 0;
    const bool found_ok = afpy_device_from_dlpack(got.device_type, got.device_id, &found) == 0;
    if (has_device && (said_ok != found_ok || (said_ok && (said.type != found.type || said.index != found.index)))) {
        PyErr_Format(PyExc_ValueError, "%s: __dlpack_device__() says %s:%d, the capsule %s:%d", name,
                     device_name(reported_type), (int)reported_id, device_name(got.device_type), (int)got.device_id);
        afpy_tensor_release(t);
        return -1;
    }
    if (view_from_dltensor(&t->managed->dl_tensor, name, cuda, &t->view) < 0) {
        afpy_tensor_release(t);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- torch CPU tensors, directly */

/* torch.Tensor's __dlpack__ and __dlpack_device__ are Python methods (about 6 us a tensor, a quarter of a tiny
 * decode call's cost); for a CPU tensor torch would export as it is, torch._C._to_dlpack makes the same capsule in
 * under 1 us. Found once torch has been imported by someone else (never imported here). */
static PyObject *torch_tensor_type, *torch_to_dlpack, *torch_strided;

static bool torch_found(void) {
    if (torch_to_dlpack) return true;
    PyObject *name = PyUnicode_FromString("torch");
    PyObject *torch = name ? PyImport_GetModule(name) : NULL;   /* NULL, no error, while torch is not imported */
    Py_XDECREF(name);
    PyObject *c = torch ? PyObject_GetAttrString(torch, "_C") : NULL;
    PyObject *type = torch ? PyObject_GetAttrString(torch, "Tensor") : NULL;
    PyObject *strided = torch ? PyObject_GetAttrString(torch, "strided") : NULL;
    PyObject *to_dlpack = c ? PyObject_GetAttrString(c, "_to_dlpack") : NULL;
    Py_XDECREF(c);
    Py_XDECREF(torch);
    PyErr_Clear();   /* a torch without these keeps the general path */
    if (!type || !strided || !to_dlpack || !PyType_Check(type)) {
        Py_XDECREF(type);
        Py_XDECREF(strided);
        Py_XDECREF(to_dlpack);
        return false;
    }
    torch_tensor_type = type;   /* kept for the life of the process, like torch itself */
    torch_strided = strided;
    torch_to_dlpack = to_dlpack;
    return true;
}

/* 1 when attr of obj is the object `want` (Py_True, ...), 0 when not, -1 on error. */
static int attr_is(PyObject *obj, const char *attr, PyObject *want) {
    PyObject *value = PyObject_GetAttrString(obj, attr);
    if (!value) return -1;
    const int same = value == want;
    Py_DECREF(value);
    return same;
}

/* The capsule of a plain CPU torch.Tensor (exactly that type: a subclass may override __dlpack__) that torch's
 * __dlpack__ would export: strided and not requiring a gradient (anything else takes the general path, whose errors
 * are torch's own). NULL with no error set when this path does not apply. */
static PyObject *torch_cpu_capsule(PyObject *obj) {
    if (!torch_found() || Py_TYPE(obj) != (PyTypeObject *)torch_tensor_type) return NULL;
    if (attr_is(obj, "is_cpu", Py_True) != 1 || attr_is(obj, "requires_grad", Py_False) != 1 ||
        attr_is(obj, "layout", torch_strided) != 1) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *capsule = PyObject_CallOneArg(torch_to_dlpack, obj);
    if (!capsule) PyErr_Clear();   /* the general path says why */
    return capsule;
}

static int from_torch_cpu(PyObject *capsule, const char *name, afpy_tensor *t) {
    if (take_capsule(capsule, name, t) < 0) return -1;
    if (view_from_dltensor(&t->managed->dl_tensor, name, false, &t->view) < 0) {
        afpy_tensor_release(t);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- either */

int afpy_tensor_from_object(PyObject *obj, const char *name, bool writable, uintptr_t stream, afpy_tensor *t) {
    memset(t, 0, sizeof *t);
    if (PyObject_CheckBuffer(obj)) return from_buffer(obj, name, writable, t);
    PyObject *capsule = torch_cpu_capsule(obj);
    if (capsule) return from_torch_cpu(capsule, name, t);
    PyObject *method = PyObject_GetAttrString(obj, "__dlpack__");
    if (!method) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s: expected a tensor (torch.Tensor, NumPy array, or an object with __dlpack__ or the buffer "
                     "protocol), got %s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    int rc = from_dlpack(obj, method, name, stream, t);
    Py_DECREF(method);
    return rc;
}

void afpy_tensor_release(afpy_tensor *t) {
    if (t->managed) {
        /* a producer's deleter may run Python code: an exception already raised waits until it is done */
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        if (t->managed->deleter) t->managed->deleter(t->managed);
        PyErr_Restore(type, value, traceback);
        t->managed = NULL;
    }
    if (t->has_buffer) {
        PyBuffer_Release(&t->buffer);
        t->has_buffer = false;
    }
}
