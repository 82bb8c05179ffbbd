"""A DLPack producer for tests: any device, any data pointer, built with ctypes from the DLPack C ABI (v0.8,
"dltensor" capsules). It lets the tests hand the binding a kDLCUDA tensor on a machine without a GPU: the binding
must read its descriptors and device, make the stream handshake, and never touch the data (the pointer given by
the tests is unmapped, so a read would crash the run)."""
import ctypes

KDL_CPU, KDL_CUDA, KDL_ROCM, KDL_CUDA_MANAGED = 1, 2, 10, 13
_DTYPES = {"float32": (2, 32), "float16": (2, 16), "bfloat16": (4, 16), "bool": (6, 8)}

# Never mapped on Linux (below vm.mmap_min_addr) and 1024-byte aligned: a read or write through it is a crash.
UNMAPPED = 0x400


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_CAPSULE_NAME = b"dltensor"   # a module constant: the capsule keeps a pointer to it


def _contiguous_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class FakeTensor:
    """Describes a tensor on (device_type, device_id) at `data`; records the streams __dlpack__ was asked for and
    how often the consumer released the export (the DLManagedTensor's deleter)."""

    def __init__(self, shape, dtype="float16", device=(KDL_CUDA, 0), data=UNMAPPED, strides=None,
                 report_device=True, capsule_device=None):
        self.shape = tuple(shape)
        self.dtype = dtype
        self._strides = tuple(strides) if strides is not None else _contiguous_strides(self.shape)
        self._device = device
        self._capsule_device = capsule_device or device
        self._data = data
        self.streams = []      # the stream argument of each __dlpack__ call
        self.released = 0      # deleter calls
        self._exports = []     # ctypes memory of live exports
        if report_device:
            self.__dlpack_device__ = lambda: self._device

    @property
    def device(self):   # what attnforge's recorder writes into a samples file (str(tensor.device) in torch)
        kind = {KDL_CPU: "cpu", KDL_CUDA: "cuda", KDL_CUDA_MANAGED: "cuda"}.get(self._device[0], "rocm")
        return kind if kind == "cpu" else f"{kind}:{self._device[1]}"

    def stride(self):
        return self._strides

    def __dlpack__(self, stream=None, max_version=None):
        self.streams.append(stream)
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * max(ndim, 1))(*self.shape)
        strides = (ctypes.c_int64 * max(ndim, 1))(*self._strides)
        managed = _DLManagedTensor()
        code, bits = _DTYPES[self.dtype]
        managed.dl_tensor = _DLTensor(self._data, _DLDevice(*self._capsule_device), ndim, _DLDataType(code, bits, 1),
                                      ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)),
                                      ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)), 0)

        def release(pointer):
            self.released += 1

        deleter = _DELETER(release)
        managed.deleter = deleter
        self._exports.append((managed, shape, strides, deleter))   # alive until the test drops this object
        return _capsule_new(ctypes.addressof(managed), _CAPSULE_NAME, None)
