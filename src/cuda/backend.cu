/* libattnforge_cuda.so: the host side of attnforge's CUDA backend (src/sdpa/cuda_backend.h). It checks what only
 * CUDA can tell (driver, devices, where each pointer lives), arranges the kernels' preconditions (copying a q/k/v
 * the tensor-core path cannot read, with a warning) and enqueues the launchers of src/cuda/kernels.h on the
 * caller's stream. Written in the common subset of C11 and C++17: nvcc builds it for the GPU, and
 * tests/cuda_emu/cuda_backend_emulated.c includes it into a gcc build against the CPU emulation. */
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/kernels.h"
#include "sdpa/cuda_backend.h"

/* Each tensor-core variant's occupancy, once per device, in the debug log (defined below). */
static void note_occupancy(const char *kernel, int device, int ctas, size_t smem, int threads);
#define AF_MMA_NOTE_OCCUPANCY(kernel, device, ctas, smem, threads) \
    note_occupancy((kernel), (device), (ctas), (smem), (threads))
#include "cuda/attn_mma.cuh"
#include "cuda/attn_combine.cuh"
#include "cuda/attn_mma_launch.cuh"
#include "cuda/attn_bwd_mma_launch.cuh"
#include "cuda/attn_wgmma_launch.cuh"
#include "cuda/attn_simt.cuh"
#include "cuda/copy_4d.cuh"
#include "cuda/validate_indices.cuh"

#ifdef __cplusplus
#define AF_EXTERN_C extern "C"
#else
#define AF_EXTERN_C
#endif

#define AF_MAX_CUDA_DEVICES 64    /* devices whose attributes are cached; more are read on each call */
#define AF_SCRATCH_ALIGN 256      /* each scratch tensor starts on this boundary (cudaMalloc's own alignment) */

/* ---------------------------------------------------------------- messages */
static af_cuda_log_fn backend_log;   /* set by libattnforge's loader before the first call */

static void log_message(int level, const char *fmt, ...) {
    af_cuda_log_fn log = backend_log;
    if (!log) return;
    char message[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    log(level, message);
}

static void note_occupancy(const char *kernel, int device, int ctas, size_t smem, int threads) {
    log_message(AF_LOG_DEBUG, "cuda:%d %s: %d CTAs per multiprocessor (%zu bytes of shared memory, %d threads)",
                device, kernel, ctas, smem, threads);
}

static int fail(char *err, size_t size, int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, size, fmt, ap);
    va_end(ap);
    return status;
}

/* A CUDA error as an attnforge status with CUDA's own name and text; clears CUDA's sticky last error. */
static int cuda_fail(char *err, size_t size, cudaError_t e, const char *during) {
    (void)cudaGetLastError();
    const char *name = cudaGetErrorName(e);
    const int status = strcmp(name, "cudaErrorMemoryAllocation") == 0 ? AF_ERR_NO_MEMORY : AF_ERR_INTERNAL;
    return fail(err, size, status, "CUDA error %s: %s (%s)", name, cudaGetErrorString(e), during);
}

static void set_log(af_cuda_log_fn log) { backend_log = log; }

/* ---------------------------------------------------------------- driver and devices */
static int probe(int *device_count, char *err, size_t size) {
    *device_count = 0;
    int driver = 0, runtime = 0, count = 0;
    (void)cudaDriverGetVersion(&driver);   /* 0 when no driver is installed */
    (void)cudaRuntimeGetVersion(&runtime);
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) (void)cudaGetLastError();
    if (driver == 0)
        return fail(err, size, AF_ERR_RUNTIME_UNAVAILABLE,
                    "attnforge's CUDA backend found no NVIDIA driver (CUDA error %s: %s): CUDA tensors need the "
                    "NVIDIA driver (libcuda.so.1) and a GPU; install the driver on a machine with an NVIDIA GPU, or "
                    "run on CPU tensors", cudaGetErrorName(e), cudaGetErrorString(e));
    if (e != cudaSuccess && driver < runtime)
        return fail(err, size, AF_ERR_RUNTIME_UNAVAILABLE,
                    "attnforge's CUDA backend needs a newer NVIDIA driver: the driver supports CUDA %d.%d, the backend "
                    "was built with CUDA %d.%d (CUDA error %s: %s); update the driver, or build attnforge with a CUDA "
                    "toolkit no newer than %d.%d", driver / 1000, driver % 1000 / 10, runtime / 1000,
                    runtime % 1000 / 10, cudaGetErrorName(e), cudaGetErrorString(e), driver / 1000,
                    driver % 1000 / 10);
    if (e != cudaSuccess || count < 1)
        return fail(err, size, AF_ERR_RUNTIME_UNAVAILABLE,
                    "attnforge's CUDA backend found no CUDA GPU (driver CUDA %d.%d; %s%s%s): check that the GPU shows "
                    "in nvidia-smi and that CUDA_VISIBLE_DEVICES does not hide it", driver / 1000, driver % 1000 / 10,
                    e != cudaSuccess ? cudaGetErrorName(e) : "0 devices", e != cudaSuccess ? ": " : "",
                    e != cudaSuccess ? cudaGetErrorString(e) : "");
    *device_count = count;
    return AF_OK;
}

static pthread_mutex_t device_lock = PTHREAD_MUTEX_INITIALIZER;
static af_cuda_device device_cache[AF_MAX_CUDA_DEVICES];
static bool device_cached[AF_MAX_CUDA_DEVICES];

static int read_device(int device, af_cuda_device *dev, char *err, size_t size) {
    if (device < AF_MAX_CUDA_DEVICES) {
        pthread_mutex_lock(&device_lock);
        const bool cached = device_cached[device];
        if (cached) *dev = device_cache[device];
        pthread_mutex_unlock(&device_lock);
        if (cached) return AF_OK;
    }
    cudaError_t e;
    dev->ordinal = device;
    if ((e = cudaDeviceGetAttribute(&dev->sm_count, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess ||
        (e = cudaDeviceGetAttribute(&dev->cc_major, cudaDevAttrComputeCapabilityMajor, device)) != cudaSuccess ||
        (e = cudaDeviceGetAttribute(&dev->cc_minor, cudaDevAttrComputeCapabilityMinor, device)) != cudaSuccess ||
        (e = cudaDeviceGetAttribute(&dev->max_smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device)) !=
            cudaSuccess)
        return cuda_fail(err, size, e, "reading the device's attributes");
    if (device < AF_MAX_CUDA_DEVICES) {
        pthread_mutex_lock(&device_lock);
        device_cache[device] = *dev;
        device_cached[device] = true;
        pthread_mutex_unlock(&device_lock);
    }
    return AF_OK;
}

/* ---------------------------------------------------------------- the caller's context */
/* The driver's current-context calls, through cudart's entry-point query (the backend links no libcuda): restoring
 * the caller's context with them creates nothing, where cudaSetDevice(previous) would create the primary context of
 * a device the caller never used (CUDA 12 creates it at once: hundreds of MB), and a NULL context comes back NULL. */
typedef CUresult (*ctx_get_current_fn)(CUcontext *ctx);
typedef CUresult (*ctx_set_current_fn)(CUcontext ctx);
static pthread_mutex_t context_api_lock = PTHREAD_MUTEX_INITIALIZER;
static ctx_get_current_fn ctx_get_current;
static ctx_set_current_fn ctx_set_current;

/* 12000: both calls are as old as CUDA 4.0 and unchanged since; any driver that runs this cudart has them. */
static cudaError_t driver_entry_point(const char *symbol, void **fn) {
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, fn, 12000, cudaEnableDefault, &found);
    return e != cudaSuccess ? e : found == cudaDriverEntryPointSuccess && *fn ? cudaSuccess : cudaErrorNotSupported;
}

static int find_context_api(char *err, size_t size) {
    pthread_mutex_lock(&context_api_lock);   /* found once; a failure is not kept */
    cudaError_t e = cudaSuccess;
    const char *symbol = "cuCtxGetCurrent";
    if (!ctx_get_current || !ctx_set_current) {
        void *get = NULL, *set = NULL;
        e = driver_entry_point(symbol, &get);
        if (e == cudaSuccess) e = driver_entry_point(symbol = "cuCtxSetCurrent", &set);
        if (e == cudaSuccess) {
            ctx_get_current = (ctx_get_current_fn)get;
            ctx_set_current = (ctx_set_current_fn)set;
        }
    }
    pthread_mutex_unlock(&context_api_lock);
    if (e == cudaSuccess) return AF_OK;
    (void)cudaGetLastError();
    return fail(err, size, AF_ERR_RUNTIME_UNAVAILABLE, "attnforge's CUDA backend could not find the driver's %s "
                "(CUDA error %s: %s from cudaGetDriverEntryPointByVersion); update the NVIDIA driver", symbol,
                cudaGetErrorName(e), cudaGetErrorString(e));
}

/* After a call: the caller's context again. A failure is a warning, never the call's: its work is enqueued. */
static void restore_context(CUcontext previous, int device) {
    const CUresult r = ctx_set_current(previous);
    if (r != CUDA_SUCCESS)
        log_message(AF_LOG_WARNING, "attnforge could not %s after a call on cuda:%d (CUDA driver error %d from "
                    "cuCtxSetCurrent); cuda:%d's primary context stays current", previous ?
                    "make the caller's CUDA context current again" : "leave the thread without a current CUDA "
                    "context, as it found it", device, (int)r, device);
}

/* Runs with `device` current and makes the caller's context current again after (NULL included): a call creates no
 * context but `device`'s primary one, which its work needs. A caller's context already on `device` is used as it is. */
typedef int (*on_device_fn)(int device, void *context, char *err, size_t size);

static int with_device(int device, on_device_fn fn, void *context, char *err, size_t size) {
    int status = find_context_api(err, size);
    if (status != AF_OK) return status;
    CUcontext previous = NULL;
    const CUresult r = ctx_get_current(&previous);
    if (r != CUDA_SUCCESS)
        return fail(err, size, AF_ERR_INTERNAL, "CUDA driver error %d from cuCtxGetCurrent (reading the caller's "
                    "current context)", (int)r);
    int current = -1;   /* cudaGetDevice names the current context's device, and creates nothing */
    cudaError_t e;
    if (previous && (e = cudaGetDevice(&current)) != cudaSuccess)
        return cuda_fail(err, size, e, "reading the current context's device");
    const bool switching = current != device;
    if (switching && (e = cudaSetDevice(device)) != cudaSuccess) {
        status = cuda_fail(err, size, e, "selecting the tensors' device");
        restore_context(previous, device);
        return status;
    }
    status = fn(device, context, err, size);
    if (switching) restore_context(previous, device);
    return status;
}

/* ---------------------------------------------------------------- the tensors */
/* A pointer the kernels will read or write must be memory of `device` (or managed memory). */
static int check_pointer(const char *name, const void *ptr, int64_t numel, int device, char *err, size_t size) {
    if (!ptr || numel == 0) return AF_OK;
    cudaPointerAttributes attributes;
    memset(&attributes, 0, sizeof attributes);
    const cudaError_t e = cudaPointerGetAttributes(&attributes, ptr);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return fail(err, size, AF_ERR_INVALID_ARGUMENT,
                    "%s: %p is not CUDA memory (CUDA error %s: %s); a tensor on cuda:%d must hold device memory of "
                    "that device", name, ptr, cudaGetErrorName(e), cudaGetErrorString(e), device);
    }
    if (attributes.type == cudaMemoryTypeManaged) return AF_OK;
    if (attributes.type != cudaMemoryTypeDevice)
        return fail(err, size, AF_ERR_INVALID_ARGUMENT,
                    "%s: %p is host memory, but the tensor says cuda:%d; pass device memory of that device, or a "
                    "tensor on the CPU", name, ptr, device);
    if (attributes.device != device)
        return fail(err, size, AF_ERR_INVALID_ARGUMENT,
                    "%s: %p is memory of cuda:%d, but the tensor says cuda:%d", name, ptr, attributes.device, device);
    return AF_OK;
}

static int check_pointers(const af_problem *p, int device, char *err, size_t size) {
    const int64_t rows = p->B * p->Hq * p->L, kv = p->B * p->Hkv * p->S;
    int status;
    if ((status = check_pointer("query", p->q, rows * p->E, device, err, size)) != AF_OK) return status;
    if ((status = check_pointer("key", p->k, kv * p->E, device, err, size)) != AF_OK) return status;
    if ((status = check_pointer("value", p->v, kv * p->Ev, device, err, size)) != AF_OK) return status;
    if ((status = check_pointer("out", p->out, rows * p->Ev, device, err, size)) != AF_OK) return status;
    if ((status = check_pointer("lse", p->lse, rows, device, err, size)) != AF_OK) return status;
    if ((status = check_pointer("learnable_sink", p->sink, p->Hq, device, err, size)) != AF_OK) return status;
    if ((status = check_pointer("cu_seqlens_q", p->cu_seqlens_q, p->B + 1, device, err, size)) != AF_OK) return status;
    if ((status = check_pointer("cu_seqlens_k", p->cu_seqlens_k, p->B + 1, device, err, size)) != AF_OK) return status;
    if ((status = check_pointer("seqused_k", p->seqused_k, p->B, device, err, size)) != AF_OK) return status;
    if ((status = check_pointer("page_table", p->page_table, p->B, device, err, size)) != AF_OK) return status;
    if ((status = check_pointer("q_descale", p->q_descale, p->B * p->Hkv, device, err, size)) != AF_OK) return status;
    if ((status = check_pointer("k_descale", p->k_descale, p->B * p->Hkv, device, err, size)) != AF_OK) return status;
    if ((status = check_pointer("v_descale", p->v_descale, p->B * p->Hkv, device, err, size)) != AF_OK) return status;
    return check_pointer("attn_mask", p->mask, rows * p->S, device, err, size);
}

/* ---------------------------------------------------------------- the tensor-core path */
typedef struct {
    const char *name;
    const char **base;         /* the problem's pointer, redirected to the copy */
    int64_t *stride;           /* the problem's strides, made those of the copy */
    int64_t shape[4];
    char rule[96];             /* which precondition the caller's view breaks; "" when none */
    int elem;                  /* bytes per element: 2, or 1 for float8 */
    int64_t row;               /* the copy's row length: the head dim rounded up to 16 bytes */
    size_t tight_bytes;        /* 0, or the unpadded staging copy when row > head dim */
    size_t padded_bytes;       /* the copy the kernels read */
} mma_operand;

/* Which of the tensor-core path's preconditions a view breaks ("" if none). Size-1 dims are never indexed. */
static void describe_broken_rule(mma_operand *o) {
    o->rule[0] = '\0';
    if (o->stride[3] != 1 && o->shape[3] > 1) {
        snprintf(o->rule, sizeof o->rule, "stride[3] is %lld, not 1", (long long)o->stride[3]);
        return;
    }
    const int per_16_bytes = 16 / o->elem;
    for (int d = 0; d < 3; d++)
        if (o->shape[d] > 1 && o->stride[d] % per_16_bytes != 0) {
            snprintf(o->rule, sizeof o->rule, "stride[%d] is %lld, not a multiple of %d", d, (long long)o->stride[d],
                     per_16_bytes);
            return;
        }
    if ((uintptr_t)*o->base % 16 != 0)
        snprintf(o->rule, sizeof o->rule, "its base address is not 16-byte aligned");
}

static size_t round_up(size_t bytes) { return (bytes + AF_SCRATCH_ALIGN - 1) / AF_SCRATCH_ALIGN * AF_SCRATCH_ALIGN; }

/* The copy's sizes: rows padded to 16 bytes (8 16-bit elements, 16 float8 ones). A head dim that is not a multiple of
 * that is first gathered tight, with 16 bytes of slack, and then spread into padded rows by reading each tight row
 * as long as a padded one: the padding's values are those of the next row (never used: the kernels zero-fill past
 * the head dim). */
static void plan_copy(mma_operand *o) {
    const size_t rows = (size_t)(o->shape[0] * o->shape[1] * o->shape[2]);
    const int64_t per_16_bytes = 16 / o->elem;
    o->row = (o->shape[3] + per_16_bytes - 1) / per_16_bytes * per_16_bytes;
    o->padded_bytes = round_up(rows * (size_t)o->row * (size_t)o->elem);
    o->tight_bytes = o->row == o->shape[3] ? 0 : round_up((rows * (size_t)o->shape[3]) * (size_t)o->elem + 16);
}

/* The Hopper kernel (attn_wgmma.cuh) runs what it accepts and TMA can read on compute capability 9.0 unless ATTNFORGE_CUDA_WGMMA=0
 * (read at each call): the way back to the mma.sync kernels, which run everything else. */
static bool hopper_kernel_enabled(void) {
    const char *on = getenv("ATTNFORGE_CUDA_WGMMA");
    return !(on && strcmp(on, "0") == 0);
}

/* The strides of the copy the kernels read: contiguous rows of o->row elements. */
static void copy_strides(const mma_operand *o, int64_t stride[4]) {
    stride[3] = 1;
    stride[2] = o->row;
    stride[1] = o->shape[2] * o->row;
    stride[0] = o->shape[1] * o->shape[2] * o->row;
}

/* Whether the Hopper kernel takes the problem as the kernels will see it, K and V copied where planned: the copies
 * are not made yet, so a copied operand is shown to the tensor-map encoder at a stand-in address with the scratch's
 * alignment (the encoder checks an address's alignment and never reads it; the map is thrown away). */
static bool hopper_kernel_takes(const af_problem *run, const mma_operand operands[3], const af_cuda_device *dev) {
    if (!hopper_kernel_enabled() || !af_cuda_wgmma_accepts(run, dev)) return false;
    af_problem seen = *run;
    const char **bases[2] = {&seen.k, &seen.v};
    int64_t *strides[2] = {seen.k_stride, seen.v_stride};
    for (int i = 0; i < 2; i++)
        if (operands[i + 1].rule[0]) {
            *bases[i] = (const char *)(uintptr_t)AF_SCRATCH_ALIGN;
            copy_strides(&operands[i + 1], strides[i]);
        }
    return af_cuda_wgmma_views_fit(&seen);
}

static cudaError_t make_copy(mma_operand *o, char *tight, char *padded, cudaStream_t stream) {
    const int elem_size = o->elem;
    cudaError_t e;
    if (!o->tight_bytes) {
        e = af_cuda_copy_4d(padded, *o->base, o->shape, o->stride, elem_size, stream);
    } else {
        const int64_t tight_stride[4] = {o->shape[1] * o->shape[2] * o->shape[3], o->shape[2] * o->shape[3],
                                         o->shape[3], 1};
        const int64_t padded_shape[4] = {o->shape[0], o->shape[1], o->shape[2], o->row};
        e = af_cuda_copy_4d(tight, *o->base, o->shape, o->stride, elem_size, stream);
        if (e == cudaSuccess) e = af_cuda_copy_4d(padded, tight, padded_shape, tight_stride, elem_size, stream);
    }
    *o->base = padded;
    copy_strides(o, o->stride);
    return e;
}

/* ---------------------------------------------------------------- scratch memory */
/* The backend's own stream-ordered pool per device, made on first use: its release threshold keeps freed memory for
 * the next call instead of handing it back at every synchronisation (a new pool's threshold is 0), and the device's
 * default pool, which other libraries may tune, is left as it is. A device without memory pools (some virtualised
 * setups: cudaDevAttrMemoryPoolsSupported is 0) gets cudaMalloc/cudaFree, which synchronise. */
typedef enum { POOL_UNKNOWN = 0, POOL_READY, POOL_NONE } pool_state;
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pool_state pool_states[AF_MAX_CUDA_DEVICES];
static cudaMemPool_t pools[AF_MAX_CUDA_DEVICES];

static cudaError_t make_pool(int device, cudaMemPool_t *pool) {
    int supported = 0;
    cudaError_t e = cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device);
    if (e != cudaSuccess || !supported) return e;
    cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    if ((e = cudaMemPoolCreate(pool, &props)) != cudaSuccess) return e;
    uint64_t keep_all = UINT64_MAX;
    if ((e = cudaMemPoolSetAttribute(*pool, cudaMemPoolAttrReleaseThreshold, &keep_all)) != cudaSuccess) {
        (void)cudaMemPoolDestroy(*pool);
        *pool = NULL;
    }
    return e;
}

/* The device's pool, NULL where pools are not supported (or for devices past the cache: the default pool). */
static cudaError_t pool_for(int device, cudaMemPool_t *pool) {
    *pool = NULL;
    if (device < 0 || device >= AF_MAX_CUDA_DEVICES) return cudaSuccess;
    pthread_mutex_lock(&pool_lock);
    cudaError_t e = cudaSuccess;
    if (pool_states[device] == POOL_UNKNOWN) {
        cudaMemPool_t made = NULL;
        e = make_pool(device, &made);
        if (e == cudaSuccess) {
            pools[device] = made;
            pool_states[device] = made ? POOL_READY : POOL_NONE;
            if (!made) log_message(AF_LOG_INFO, "cuda:%d has no stream-ordered memory pools: attnforge's scratch "
                                   "comes from cudaMalloc/cudaFree there, which synchronise", device);
        }
    }
    *pool = pool_states[device] == POOL_READY ? pools[device] : NULL;
    const bool none = pool_states[device] == POOL_NONE;
    pthread_mutex_unlock(&pool_lock);
    return e != cudaSuccess ? e : none ? cudaErrorNotSupported : cudaSuccess;
}

static cudaError_t scratch_alloc(int device, void **ptr, size_t bytes, cudaStream_t stream) {
    cudaMemPool_t pool;
    const cudaError_t e = pool_for(device, &pool);
    if (e == cudaErrorNotSupported) return cudaMalloc(ptr, bytes);
    if (e != cudaSuccess) return e;
    return pool ? cudaMallocFromPoolAsync(ptr, bytes, pool, stream) : cudaMallocAsync(ptr, bytes, stream);
}

static cudaError_t scratch_free(int device, void *ptr, cudaStream_t stream) {
    cudaMemPool_t pool;
    return pool_for(device, &pool) == cudaErrorNotSupported ? cudaFree(ptr) : cudaFreeAsync(ptr, stream);
}

/* ---------------------------------------------------------------- where a call's scratch comes from */
/* The caller's allocator when the call names one (its memory and its accounting: PyTorch's caching allocator keeps
 * what it holds for attnforge too), else the backend's pool. */
typedef struct {
    const af_cuda_allocator *caller;   /* NULL: the backend's pool */
    int device;
    cudaStream_t stream;
} scratch_source;

/* What the caller's allocator gave must be memory of the call's device, aligned as cudaMalloc's: the scratch's parts
 * start at multiples of AF_SCRATCH_ALIGN from it. */
static int check_workspace(const void *memory, size_t bytes, int device, char *err, size_t size) {
    if ((uintptr_t)memory % AF_SCRATCH_ALIGN != 0)
        return fail(err, size, AF_ERR_INVALID_ARGUMENT, "workspace: the caller's allocator returned %p for %zu bytes, "
                    "which is not %d-byte aligned (af_cuda_allocator.alloc must align as cudaMalloc does)", memory,
                    bytes, AF_SCRATCH_ALIGN);
    cudaPointerAttributes attributes;
    memset(&attributes, 0, sizeof attributes);
    const cudaError_t e = cudaPointerGetAttributes(&attributes, memory);
    if (e != cudaSuccess) (void)cudaGetLastError();
    const bool on_device = e == cudaSuccess && (attributes.type == cudaMemoryTypeManaged ||
                                                (attributes.type == cudaMemoryTypeDevice && attributes.device == device));
    if (!on_device)
        return fail(err, size, AF_ERR_INVALID_ARGUMENT, "workspace: the caller's allocator returned %p for %zu bytes, "
                    "which is not memory of cuda:%d (%s); af_cuda_allocator.alloc must give memory of the device it is "
                    "asked for", memory, bytes, device, e != cudaSuccess ? cudaGetErrorName(e)
                    : attributes.type == cudaMemoryTypeDevice ? "it is another device's" : "it is host memory");
    return AF_OK;
}

static int scratch_acquire(const scratch_source *from, size_t bytes, char **ptr, char *err, size_t size) {
    *ptr = NULL;
    if (!from->caller) {
        const cudaError_t e = scratch_alloc(from->device, (void **)ptr, bytes, from->stream);
        return e == cudaSuccess ? AF_OK
                                : cuda_fail(err, size, e, "allocating the tensor-core path's scratch on the stream");
    }
    const af_cuda_allocator *a = from->caller;
    void *memory = a->alloc(bytes, from->device, (void *)from->stream, a->user);
    if (!memory)
        return fail(err, size, AF_ERR_NO_MEMORY, "workspace: the caller's allocator (af_cuda_allocator.alloc) returned "
                    "NULL for %zu bytes on cuda:%d, the tensor-core path's scratch (copies of q/k/v it cannot read in "
                    "place, split-KV partials); nothing was written", bytes, from->device);
    const int status = check_workspace(memory, bytes, from->device, err, size);
    if (status != AF_OK) {
        a->free(memory, bytes, from->device, (void *)from->stream, a->user);
        return status;
    }
    *ptr = (char *)memory;
    return AF_OK;
}

/* After the work that reads it is enqueued (stream order keeps it alive): a failure is a warning, not the call's. */
static void scratch_release(const scratch_source *from, char *ptr, size_t bytes) {
    if (from->caller) {
        from->caller->free(ptr, bytes, from->device, (void *)from->stream, from->caller->user);
        return;
    }
    const cudaError_t e = scratch_free(from->device, ptr, from->stream);
    if (e == cudaSuccess) return;
    (void)cudaGetLastError();
    log_message(AF_LOG_WARNING, "attnforge could not free its scratch on cuda:%d after enqueueing a call (CUDA error "
                "%s: %s)", from->device, cudaGetErrorName(e), cudaGetErrorString(e));
}

static int mma_forward(const af_problem *p, const af_cuda_device *dev, int device, cudaStream_t stream,
                       const af_cuda_allocator *allocator, char *err, size_t size) {
    af_problem run = *p;
    mma_operand operands[3];
    memset(operands, 0, sizeof operands);
    const char *names[3] = {"query", "key", "value"};
    const char **bases[3] = {&run.q, &run.k, &run.v};
    int64_t *strides[3] = {run.q_stride, run.k_stride, run.v_stride};
    const int64_t shapes[3][4] = {{p->B, p->Hq, p->L, p->E}, {p->B, p->Hkv, p->S, p->E}, {p->B, p->Hkv, p->S, p->Ev}};
    const bool kv_float8 = af_mma_is_float8(p->kv_dtype), q_float8 = af_mma_is_float8(p->dtype);
    size_t scratch_bytes = 0;
    char warning[512] = "";
    for (int i = 0; i < 3; i++) {
        mma_operand *o = &operands[i];
        o->name = names[i];
        o->base = bases[i];
        o->stride = strides[i];
        memcpy(o->shape, shapes[i], sizeof o->shape);
        o->elem = (i == 0 ? q_float8 : kv_float8) ? 1 : 2;
        describe_broken_rule(o);
        if (!o->rule[0]) continue;
        plan_copy(o);
        scratch_bytes += o->tight_bytes + o->padded_bytes;
        const size_t used = strlen(warning);
        snprintf(warning + used, sizeof warning - used, "%s%s (%s)", used ? "; " : "", o->name, o->rule);
    }
    const size_t workspace_offset = scratch_bytes;
    size_t workspace_bytes = 0;
    const bool wgmma = hopper_kernel_takes(&run, operands, dev);   /* TMA's maps decided before the sizes */
    cudaError_t e = wgmma ? af_cuda_wgmma_workspace_bytes(&run, dev, &workspace_bytes)
                          : af_cuda_mma_workspace_bytes(&run, dev, &workspace_bytes);
    if (e != cudaSuccess) return cuda_fail(err, size, e, "planning the tensor-core kernels (occupancy)");
    scratch_bytes += round_up(workspace_bytes);

    char *scratch = NULL;
    const scratch_source from = {allocator, device, stream};
    int status;
    if (scratch_bytes > 0 && (status = scratch_acquire(&from, scratch_bytes, &scratch, err, size)) != AF_OK)
        return status;
    if (warning[0])
        log_message(AF_LOG_WARNING, "copying %s to contiguous memory before the tensor-core kernels: they need the "
                    "last dimension contiguous, the other strides multiples of 16 bytes and 16-byte aligned base "
                    "addresses", warning);
    size_t offset = 0;
    e = cudaSuccess;
    for (int i = 0; i < 3 && e == cudaSuccess; i++) {
        mma_operand *o = &operands[i];
        if (!o->rule[0]) continue;
        char *tight = scratch + offset, *padded = tight + o->tight_bytes;
        offset += o->tight_bytes + o->padded_bytes;
        e = make_copy(o, tight, padded, stream);
    }
    void *workspace = workspace_bytes ? scratch + workspace_offset : NULL;
    if (e == cudaSuccess)
        e = wgmma ? af_cuda_wgmma_forward(&run, dev, workspace, workspace_bytes, stream)
                  : af_cuda_mma_forward(&run, dev, workspace, workspace_bytes, stream);
    const cudaError_t launch = e;
    if (scratch) scratch_release(&from, scratch, scratch_bytes);
    if (launch != cudaSuccess) return cuda_fail(err, size, launch, "launching the tensor-core kernels");
    return AF_OK;
}

/* Once per process: the CUDA-core path is correct but far from the tensor cores' speed. */
static void note_simt_once(const af_problem *p) {
    static int noted_f32, noted_large, noted_sequences, noted_f8;
    const bool f8 = af_mma_is_float8(p->kv_dtype);
    const bool half = (p->dtype == AF_F16 || p->dtype == AF_BF16) && !f8;
    const bool sequences = half && (p->cu_seqlens_q || p->cu_seqlens_k || p->page_table);
    int *noted = f8 ? &noted_f8 : sequences ? &noted_sequences : p->dtype == AF_F32 ? &noted_f32 : &noted_large;
    if (__atomic_exchange_n(noted, 1, __ATOMIC_RELAXED)) return;
    if (f8)
        log_message(AF_LOG_INFO, "float8 K/V under a float32 query, float8 q/k/v with a float32 output, head dims "
                    "above %d, or varlen/paged float8 strides that are not multiples of 16 run on the CUDA cores, "
                    "slower than the tensor cores", AF_MMA_HD_MAX);
    else if (sequences)
        log_message(AF_LOG_INFO, "variable-length or paged tensors whose strides are not multiples of 8 elements (or "
                    "not 16-byte aligned) run on the CUDA cores, slower than the tensor-core path");
    else if (p->dtype == AF_F32)
        log_message(AF_LOG_INFO, "float32 attention runs on the CUDA cores, several times slower than float16/"
                    "bfloat16 on the tensor cores; cast q/k/v to bfloat16 or float16 for speed");
    else
        log_message(AF_LOG_INFO, "head dimensions above %d run on the CUDA cores (E=%lld, Ev=%lld), slower than the "
                    "tensor-core path", AF_MMA_HD_MAX, (long long)p->E, (long long)p->Ev);
}

typedef enum { PATH_TENSOR_CORES_SM80, PATH_CUDA_CORES } kernel_path;

/* Which kernels run a problem. The seam for generation-specific kernels: a Hopper kernel (wgmma, TMA, warp
 * specialisation) will be chosen here for dev->cc_major == 9; today every GPU from 8.0 on runs the mma.sync kernels. */
/* A paged pool or a varlen tensor the tensor-core kernel reads in place: every stride a multiple of 16 bytes (`elem`
 * bytes an element), rows contiguous, 16-byte aligned (they are never copied: the copy of mma_forward knows neither
 * pages nor sequences). */
static bool fits_tensor_cores_in_place(const char *base, const int64_t *stride, int elem) {
    const int64_t n = 16 / elem;
    return stride[3] == 1 && stride[0] % n == 0 && stride[1] % n == 0 && stride[2] % n == 0 &&
           (uintptr_t)base % 16 == 0;
}

static kernel_path choose_path(const af_problem *p, const af_cuda_device *dev) {
    const int kv_elem = af_mma_is_float8(p->kv_dtype) ? 1 : 2, q_elem = af_mma_is_float8(p->dtype) ? 1 : 2;
    if (!af_cuda_mma_fits_int32(p)) return PATH_CUDA_CORES;   /* 2^30 rows or keys and more: 64-bit indexing */
    if ((p->cu_seqlens_q && !fits_tensor_cores_in_place(p->q, p->q_stride, q_elem)) ||
        ((p->cu_seqlens_k || p->page_table) && !(fits_tensor_cores_in_place(p->k, p->k_stride, kv_elem) &&
                                                 fits_tensor_cores_in_place(p->v, p->v_stride, kv_elem))))
        return PATH_CUDA_CORES;
    if (af_cuda_mma_accepts_float8(p, dev)) return PATH_TENSOR_CORES_SM80;
    const bool half = (p->dtype == AF_F16 || p->dtype == AF_BF16) && p->kv_dtype == p->dtype;
    return half && p->E <= AF_MMA_HD_MAX && p->Ev <= AF_MMA_HD_MAX ? PATH_TENSOR_CORES_SM80 : PATH_CUDA_CORES;
}

typedef struct {
    const af_problem *p;
    cudaStream_t stream;
    const af_cuda_allocator *allocator;   /* the call's workspace allocator; NULL: the backend's pool */
} forward_call;

static int forward_on_device(int device, void *context, char *err, size_t size) {
    const forward_call *call = (const forward_call *)context;
    const af_problem *p = call->p;
    af_cuda_device dev;
    int status = read_device(device, &dev, err, size);
    if (status != AF_OK) return status;
    if ((status = check_pointers(p, device, err, size)) != AF_OK) return status;
    if (dev.cc_major < 8)   /* the library holds code for sm_80 and newer only (mma.sync bf16, cp.async) */
        return fail(err, size, AF_ERR_UNSUPPORTED, "cuda:%d has compute capability %d.%d; attnforge's CUDA kernels "
                    "need 8.0 (Ampere) or newer", device, dev.cc_major, dev.cc_minor);
    const cudaError_t checked = af_cuda_validate_indices(p, call->stream);   /* reports; the kernels stay safe alone */
    if (checked != cudaSuccess) return cuda_fail(err, size, checked, "launching the index arrays' check");
    if (choose_path(p, &dev) == PATH_TENSOR_CORES_SM80)
        return mma_forward(p, &dev, device, call->stream, call->allocator, err, size);
    note_simt_once(p);
    const cudaError_t e = af_cuda_simt_forward(p, &dev, call->stream);
    return e == cudaSuccess ? AF_OK : cuda_fail(err, size, e, "launching the CUDA-core kernel");
}

static int forward(const af_problem *p, int device, void *stream, const af_cuda_allocator *workspace, char *err,
                   size_t size) {
    if (p->B == 0 || p->Hq == 0 || p->L == 0) return AF_OK;   /* no output row: nothing to enqueue */
    forward_call call;
    call.p = p;
    call.stream = (cudaStream_t)stream;
    call.allocator = workspace;
    return with_device(device, forward_on_device, &call, err, size);
}

/* ---------------------------------------------------------------- the backward */
typedef struct {
    const af_backward_problem *bp;
    cudaStream_t stream;
    const af_cuda_allocator *allocator;
} backward_call;

static int backward_on_device(int device, void *context, char *err, size_t size) {
    const backward_call *call = (const backward_call *)context;
    const af_backward_problem *bp = call->bp;
    const af_problem *p = &bp->f;
    af_cuda_device dev;
    int status = read_device(device, &dev, err, size);
    if (status != AF_OK) return status;
    if ((status = check_pointers(p, device, err, size)) != AF_OK) return status;
    const int64_t rows = p->B * p->Hq * p->L, kv = p->B * p->Hkv * p->S;
    if ((status = check_pointer("dout", bp->dout, rows * p->Ev, device, err, size)) != AF_OK ||
        (status = check_pointer("dq", bp->dq, rows * p->E, device, err, size)) != AF_OK ||
        (status = check_pointer("dk", bp->dk, kv * p->E, device, err, size)) != AF_OK ||
        (status = check_pointer("dv", bp->dv, kv * p->Ev, device, err, size)) != AF_OK ||
        (status = check_pointer("dsink", bp->dsink, p->Hq, device, err, size)) != AF_OK)
        return status;
    if (dev.cc_major < 8)
        return fail(err, size, AF_ERR_UNSUPPORTED, "cuda:%d has compute capability %d.%d; attnforge's CUDA kernels "
                    "need 8.0 (Ampere) or newer", device, dev.cc_major, dev.cc_minor);
    const char *refused = af_cuda_mma_backward_refusal(p, &dev);
    if (refused) return fail(err, size, AF_ERR_UNSUPPORTED, "%s", refused);
    const cudaError_t checked = af_cuda_validate_indices(p, call->stream);
    if (checked != cudaSuccess) return cuda_fail(err, size, checked, "launching the index arrays' check");
    size_t bytes = 0;
    af_cuda_mma_backward_workspace_bytes(p, &bytes);
    char *scratch = NULL;
    const scratch_source from = {call->allocator, device, call->stream};
    if (bytes > 0 && (status = scratch_acquire(&from, round_up(bytes), &scratch, err, size)) != AF_OK) return status;
    const cudaError_t e = af_cuda_mma_backward(bp, &dev, scratch, bytes, call->stream);
    if (scratch) scratch_release(&from, scratch, round_up(bytes));
    return e == cudaSuccess ? AF_OK : cuda_fail(err, size, e, "launching the backward's kernels");
}

static int backward(const af_backward_problem *bp, int device, void *stream, const af_cuda_allocator *workspace,
                    char *err, size_t size) {
    backward_call call;
    call.bp = bp;
    call.stream = (cudaStream_t)stream;
    call.allocator = workspace;
    return with_device(device, backward_on_device, &call, err, size);
}

/* ---------------------------------------------------------------- device memory for the command line and tests */
typedef struct {
    void *dst;
    const void *src;
    size_t bytes;
    bool to_device;
    void **allocated;
    void *stream;
} memory_call;

static int alloc_on_device(int device, void *context, char *err, size_t size) {
    memory_call *call = (memory_call *)context;
    const cudaError_t e = cudaMalloc(call->allocated, call->bytes);
    return e == cudaSuccess ? AF_OK : cuda_fail(err, size, e, "cudaMalloc");
}

static int free_on_device(int device, void *context, char *err, size_t size) {
    memory_call *call = (memory_call *)context;
    const cudaError_t e = cudaFree(call->dst);
    return e == cudaSuccess ? AF_OK : cuda_fail(err, size, e, "cudaFree");
}

static int copy_on_device(int device, void *context, char *err, size_t size) {
    memory_call *call = (memory_call *)context;
    const cudaError_t e = cudaMemcpy(call->dst, call->src, call->bytes,
                                     call->to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost);
    return e == cudaSuccess ? AF_OK : cuda_fail(err, size, e, "cudaMemcpy");
}

static int synchronize_on_device(int device, void *context, char *err, size_t size) {
    memory_call *call = (memory_call *)context;
    const cudaError_t e = cudaStreamSynchronize((cudaStream_t)call->stream);
    return e == cudaSuccess ? AF_OK : cuda_fail(err, size, e, "cudaStreamSynchronize");
}

static int device_alloc(int device, size_t bytes, void **ptr, char *err, size_t size) {
    memory_call call;
    memset(&call, 0, sizeof call);
    *ptr = NULL;
    call.bytes = bytes;
    call.allocated = ptr;
    return with_device(device, alloc_on_device, &call, err, size);
}

static int device_free(int device, void *ptr, char *err, size_t size) {
    memory_call call;
    memset(&call, 0, sizeof call);
    call.dst = ptr;
    return with_device(device, free_on_device, &call, err, size);
}

static int copy(int device, void *dst, const void *src, size_t bytes, bool to_device, char *err, size_t size) {
    memory_call call;
    memset(&call, 0, sizeof call);
    call.dst = dst;
    call.src = src;
    call.bytes = bytes;
    call.to_device = to_device;
    return with_device(device, copy_on_device, &call, err, size);
}

static int synchronize(int device, void *stream, char *err, size_t size) {
    memory_call call;
    memset(&call, 0, sizeof call);
    call.stream = stream;
    return with_device(device, synchronize_on_device, &call, err, size);
}

/* The device's sticky index status (validate_indices.cuh): waits for the device's work, reads it and clears it. */
static int index_errors_on_device(int device, void *context, char *err, size_t size) {
    af_index_status status, clear;
    memset(&clear, 0, sizeof clear);
    cudaError_t e = cudaDeviceSynchronize();
    if (e == cudaSuccess) e = cudaMemcpyFromSymbol(&status, af_index_status_word, sizeof status);
    if (e == cudaSuccess && status.rule != AF_INDEX_OK)
        e = cudaMemcpyToSymbol(af_index_status_word, &clear, sizeof clear);
    if (e != cudaSuccess) return cuda_fail(err, size, e, "reading the index arrays' device-side status");
    if (status.rule == AF_INDEX_OK) return AF_OK;
    af_index_status_message(&status, device, err, size);
    return AF_ERR_INVALID_ARGUMENT;
}

static int index_errors(int device, char *err, size_t size) {
    return with_device(device, index_errors_on_device, NULL, err, size);
}

/* ---------------------------------------------------------------- the entry libattnforge looks up */
static const af_cuda_backend_ops backend_ops = {AF_CUDA_BACKEND_ABI_VERSION, "cuda", probe, forward, set_log,
                                                device_alloc, device_free, copy, synchronize, index_errors,
                                                backward};

AF_EXTERN_C __attribute__((visibility("default"))) const af_cuda_backend_ops *af_cuda_backend(void) {
    return &backend_ops;
}
