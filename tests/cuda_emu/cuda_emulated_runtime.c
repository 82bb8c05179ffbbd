/* The host runtime subset of src/cuda/device.h on host memory: allocations live in a registry so that pointer
 * queries and copies can tell emulated device memory from other memory; streams run synchronously (and obey the
 * capture rules of cuda_emulated_capture.c). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_emulated_internal.h"

static __thread cudaError_t last_error = cudaSuccess;

cudaError_t af_emu_fail(cudaError_t err)
{
    if (err != cudaSuccess)
        last_error = err;
    return err;
}

cudaError_t af_emu_availability(void)
{
    const char *mode = getenv("ATTNFORGE_EMU_CUDA");
    if (mode && strcmp(mode, "nodriver") == 0)
        return cudaErrorInsufficientDriver;
    if (mode && strcmp(mode, "nodevice") == 0)
        return cudaErrorNoDevice;
    return cudaSuccess;
}

#define AF_EMU_REQUIRE_RUNTIME()                          \
    do {                                                  \
        cudaError_t avail_ = af_emu_availability();       \
        if (avail_ != cudaSuccess)                        \
            return af_emu_fail(avail_);                   \
    } while (0)

typedef struct {
    cudaError_t code;
    const char *name;
    const char *text;
} error_entry;

/* The texts are CUDA's. */
static const error_entry error_table[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration", "invalid configuration argument"},
    {cudaErrorInvalidDevicePointer, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"},
    {cudaErrorInsufficientDriver, "cudaErrorInsufficientDriver",
     "CUDA driver version is insufficient for CUDA runtime version"},
    {cudaErrorInvalidDeviceFunction, "cudaErrorInvalidDeviceFunction", "invalid device function"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidKernelImage, "cudaErrorInvalidKernelImage", "device kernel image is invalid"},
    {cudaErrorNoKernelImageForDevice, "cudaErrorNoKernelImageForDevice",
     "no kernel image is available for execution on the device"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress", "an illegal memory access was encountered"},
    {cudaErrorLaunchOutOfResources, "cudaErrorLaunchOutOfResources", "too many resources requested for launch"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
    {cudaErrorStreamCaptureUnsupported, "cudaErrorStreamCaptureUnsupported",
     "operation not permitted when stream is capturing"},
    {cudaErrorStreamCaptureInvalidated, "cudaErrorStreamCaptureInvalidated",
     "operation failed due to a previous error during capture"},
    {cudaErrorStreamCaptureImplicit, "cudaErrorStreamCaptureImplicit",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {cudaErrorIllegalState, "cudaErrorIllegalState", "the operation is not permitted in the current state"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};

static const error_entry *find_error(cudaError_t error)
{
    for (size_t i = 0; i < sizeof error_table / sizeof error_table[0]; i++)
        if (error_table[i].code == error)
            return &error_table[i];
    return NULL;
}

const char *cudaGetErrorString(cudaError_t error)
{
    const error_entry *e = find_error(error);
    return e ? e->text : "unrecognized error code";
}

const char *cudaGetErrorName(cudaError_t error)
{
    const error_entry *e = find_error(error);
    return e ? e->name : "cudaErrorUnknown";
}

cudaError_t cudaGetLastError(void)
{
    cudaError_t err = last_error;
    last_error = cudaSuccess;
    return err;
}

cudaError_t cudaPeekAtLastError(void) { return last_error; }

cudaError_t cudaGetDeviceCount(int *count)
{
    if (!count)
        return af_emu_fail(cudaErrorInvalidValue);
    *count = 0;
    AF_EMU_REQUIRE_RUNTIME();
    *count = af_emu_device_count();
    return cudaSuccess;
}

static int sm_count(void)
{
    const char *s = getenv("ATTNFORGE_EMU_SM_COUNT");
    if (!s || !*s)
        return 8;
    char *end;
    long n = strtol(s, &end, 10);
    return (*end == '\0' && n >= 1 && n <= 100000) ? (int)n : 8;
}

cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device)
{
    if (!value)
        return af_emu_fail(cudaErrorInvalidValue);
    AF_EMU_REQUIRE_RUNTIME();
    if (device < 0 || device >= af_emu_device_count())
        return af_emu_fail(cudaErrorInvalidDevice);
    switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = AF_EMU_MAX_THREADS; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = AF_EMU_DEFAULT_SMEM; return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *value = sm_count(); return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = AF_EMU_OPTIN_SMEM; return cudaSuccess;
    case cudaDevAttrMemoryPoolsSupported: *value = af_emu_pools_supported(); return cudaSuccess;
    }
    return af_emu_fail(cudaErrorInvalidValue);
}

cudaError_t cudaDeviceSynchronize(void)
{
    AF_EMU_REQUIRE_RUNTIME();
    (void)af_emu_runtime_device();
    return af_emu_capture_blocking();
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream)
{
    (void)stream;
    AF_EMU_REQUIRE_RUNTIME();
    (void)af_emu_runtime_device();
    return af_emu_capture_blocking();
}

cudaError_t cudaDriverGetVersion(int *version)
{
    if (!version)
        return af_emu_fail(cudaErrorInvalidValue);
    /* CUDA's: 0 and success when no driver is installed. */
    *version = af_emu_availability() == cudaErrorInsufficientDriver ? 0 : 13000;
    return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int *version)
{
    if (!version)
        return af_emu_fail(cudaErrorInvalidValue);
    *version = 13000;
    return cudaSuccess;
}

/* ---- Device memory: host allocations in a registry ---- */
typedef struct {
    char *base;
    size_t size;
    int device;   /* the device of the context current when it was made */
} allocation;

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static allocation *registry;
static size_t registry_count, registry_capacity;

static int registry_add(char *base, size_t size, int device)
{
    int ok = 1;
    pthread_mutex_lock(&registry_lock);
    if (registry_count == registry_capacity) {
        size_t cap = registry_capacity ? 2 * registry_capacity : 64;
        allocation *grown = (allocation *)realloc(registry, cap * sizeof *grown);
        if (grown) {
            registry = grown;
            registry_capacity = cap;
        } else {
            ok = 0;
        }
    }
    if (ok)
        registry[registry_count++] = (allocation){base, size, device};
    pthread_mutex_unlock(&registry_lock);
    return ok;
}

static int registry_remove(const void *base)
{
    int found = 0;
    pthread_mutex_lock(&registry_lock);
    for (size_t i = 0; i < registry_count; i++) {
        if (registry[i].base == (const char *)base) {
            registry[i] = registry[--registry_count];
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&registry_lock);
    return found;
}

/* Whether [p, p + bytes) lies inside one emulated allocation (bytes 0: p inside or at its start); its device in
 * *device when not NULL. */
static int registry_find(const void *p, size_t bytes, int *device)
{
    const char *c = (const char *)p;
    int found = 0;
    pthread_mutex_lock(&registry_lock);
    for (size_t i = 0; i < registry_count && !found; i++) {
        const allocation *a = &registry[i];
        if (c >= a->base && c < a->base + a->size)
            found = (size_t)(c - a->base) <= a->size && bytes <= a->size - (size_t)(c - a->base);
        if (found && device)
            *device = a->device;
    }
    pthread_mutex_unlock(&registry_lock);
    return found;
}

static int registry_contains(const void *p, size_t bytes) { return registry_find(p, bytes, NULL); }

static cudaError_t alloc_now(void **dev_ptr, size_t size)
{
    if (!dev_ptr)
        return af_emu_fail(cudaErrorInvalidValue);
    AF_EMU_REQUIRE_RUNTIME();
    *dev_ptr = NULL;
    if (size == 0)
        return cudaSuccess;
    void *p = NULL;
    if (size > ((size_t)1 << 48) || posix_memalign(&p, 256, size) != 0)
        return af_emu_fail(cudaErrorMemoryAllocation);
    if (!registry_add((char *)p, size, af_emu_runtime_device())) {
        free(p);
        return af_emu_fail(cudaErrorMemoryAllocation);
    }
    *dev_ptr = p;
    return cudaSuccess;
}

static cudaError_t free_now(void *dev_ptr)
{
    AF_EMU_REQUIRE_RUNTIME();
    if (!dev_ptr)
        return cudaSuccess;
    if (!registry_remove(dev_ptr))
        return af_emu_fail(cudaErrorInvalidValue);
    free(dev_ptr);
    return cudaSuccess;
}

/* cudaMalloc and cudaFree may synchronise: refused during a capture (global mode). */
cudaError_t cudaMalloc(void **dev_ptr, size_t size)
{
    const cudaError_t capture = af_emu_capture_blocking();
    return capture != cudaSuccess ? capture : alloc_now(dev_ptr, size);
}

cudaError_t cudaFree(void *dev_ptr)
{
    const cudaError_t capture = af_emu_capture_blocking();
    return capture != cudaSuccess ? capture : free_now(dev_ptr);
}

cudaError_t cudaMallocAsync(void **dev_ptr, size_t size, cudaStream_t stream)
{
    const cudaError_t capture = af_emu_capture_enqueue(stream);
    return capture != cudaSuccess ? capture : alloc_now(dev_ptr, size);
}

cudaError_t cudaFreeAsync(void *dev_ptr, cudaStream_t stream)
{
    const cudaError_t capture = af_emu_capture_enqueue(stream);
    return capture != cudaSuccess ? capture : free_now(dev_ptr);
}

static cudaError_t copy_now(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
{
    AF_EMU_REQUIRE_RUNTIME();
    (void)af_emu_runtime_device();
    if ((unsigned)kind > (unsigned)cudaMemcpyDefault)
        return af_emu_fail(cudaErrorInvalidMemcpyDirection);
    if (count == 0)
        return cudaSuccess;
    if (!dst || !src)
        return af_emu_fail(cudaErrorInvalidValue);
    /* The device side of a directed copy must be emulated device memory holding all `count` bytes. */
    int dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
    int src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
    if ((dst_device && !registry_contains(dst, count)) || (src_device && !registry_contains(src, count)))
        return af_emu_fail(cudaErrorInvalidValue);
    memmove(dst, src, count);
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
{
    const cudaError_t capture = af_emu_capture_blocking();
    return capture != cudaSuccess ? capture : copy_now(dst, src, count, kind);
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream)
{
    const cudaError_t capture = af_emu_capture_enqueue(stream);
    return capture != cudaSuccess ? capture : copy_now(dst, src, count, kind);
}

static cudaError_t memset_now(void *dev_ptr, int value, size_t count)
{
    AF_EMU_REQUIRE_RUNTIME();
    (void)af_emu_runtime_device();
    if (count == 0)
        return cudaSuccess;
    if (!registry_contains(dev_ptr, count))
        return af_emu_fail(cudaErrorInvalidValue);
    memset(dev_ptr, value, count);
    return cudaSuccess;
}

cudaError_t cudaMemset(void *dev_ptr, int value, size_t count)
{
    const cudaError_t capture = af_emu_capture_blocking();
    return capture != cudaSuccess ? capture : memset_now(dev_ptr, value, count);
}

cudaError_t cudaMemsetAsync(void *dev_ptr, int value, size_t count, cudaStream_t stream)
{
    const cudaError_t capture = af_emu_capture_enqueue(stream);
    return capture != cudaSuccess ? capture : memset_now(dev_ptr, value, count);
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr)
{
    if (!attributes)
        return af_emu_fail(cudaErrorInvalidValue);
    AF_EMU_REQUIRE_RUNTIME();
    memset(attributes, 0, sizeof *attributes);
    int device = 0;
    if (ptr && registry_find(ptr, 0, &device)) {
        attributes->type = cudaMemoryTypeDevice;
        attributes->device = device;
        attributes->devicePointer = (void *)ptr;
    } else {
        /* CUDA 11 and later: other host memory is "unregistered", with success. */
        attributes->type = cudaMemoryTypeUnregistered;
        attributes->device = -2;
    }
    return cudaSuccess;
}
