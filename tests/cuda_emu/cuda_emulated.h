/* The device-feature contract of src/cuda/device.h emulated on the CPU (built with AF_CUDA_EMULATED, no nvcc).
 * A launch runs the whole grid synchronously on the calling thread: blocks one after another in an order
 * permuted by ATTNFORGE_EMU_SEED, each block's threads as cooperatively scheduled fibers that yield at barriers
 * and warp collectives. Warp collectives (mma, ldmatrix, shuffles) are computed from all 32 lanes' inputs with the
 * PTX ISA fragment layouts; cp.async copies land in shared memory only at this thread's wait_group; breaking the
 * rules (divergent barriers, mismatched collectives, shared-memory races on the async/collective paths) prints a
 * message to stderr and aborts. The host runtime subset of device.h works on host memory. See README.md. */
#ifndef AF_CUDA_EMULATED_H
#define AF_CUDA_EMULATED_H
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define AF_EMU_UNUSED __attribute__((unused))

/* ---- Host runtime types, with CUDA's names and numeric values (CUDA 13) ---- */
typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorInsufficientDriver = 35,
    cudaErrorInvalidDeviceFunction = 98,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidKernelImage = 200,
    cudaErrorNoKernelImageForDevice = 209,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchOutOfResources = 701,
    cudaErrorLaunchFailure = 719,
    cudaErrorNotSupported = 801,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorStreamCaptureImplicit = 906,
    cudaErrorIllegalState = 401,
    cudaErrorUnknown = 999
} cudaError_t;

typedef struct CUstream_st *cudaStream_t;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
};

enum cudaMemoryType {
    cudaMemoryTypeUnregistered = 0,
    cudaMemoryTypeHost = 1,
    cudaMemoryTypeDevice = 2,
    cudaMemoryTypeManaged = 3
};

struct cudaPointerAttributes {
    enum cudaMemoryType type;
    int device;
    void *devicePointer;
    void *hostPointer;
    long reserved[8];
};

enum cudaDeviceAttr {
    cudaDevAttrMaxThreadsPerBlock = 1,
    cudaDevAttrMaxSharedMemoryPerBlock = 8,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
    cudaDevAttrMemoryPoolsSupported = 115
};

/* Stream-ordered memory pools: the fields the backend sets (CUDA's names and values) */
typedef struct af_emu_mem_pool *cudaMemPool_t;
enum cudaMemAllocationType { cudaMemAllocationTypeInvalid = 0, cudaMemAllocationTypePinned = 1 };
enum cudaMemAllocationHandleType { cudaMemHandleTypeNone = 0 };
enum cudaMemLocationType { cudaMemLocationTypeInvalid = 0, cudaMemLocationTypeDevice = 1 };
struct cudaMemLocation {
    enum cudaMemLocationType type;
    int id;
};
struct cudaMemPoolProps {
    enum cudaMemAllocationType allocType;
    enum cudaMemAllocationHandleType handleTypes;
    struct cudaMemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
};
enum cudaMemPoolAttr { cudaMemPoolAttrReleaseThreshold = 4 };
typedef struct cudaMemPoolProps cudaMemPoolProps;
typedef enum cudaMemPoolAttr cudaMemPoolAttr;

enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

/* C++ (nvcc) names these without the struct/enum keyword */
typedef enum cudaMemcpyKind cudaMemcpyKind;
typedef enum cudaMemoryType cudaMemoryType;
typedef struct cudaPointerAttributes cudaPointerAttributes;
typedef enum cudaDeviceAttr cudaDeviceAttr;
typedef enum cudaFuncAttribute cudaFuncAttribute;

/* ---- Host runtime functions (CUDA's signatures; streams run synchronously) ---- */
const char *cudaGetErrorString(cudaError_t error);
const char *cudaGetErrorName(cudaError_t error);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaMalloc(void **dev_ptr, size_t size);
cudaError_t cudaFree(void *dev_ptr);
cudaError_t cudaMallocAsync(void **dev_ptr, size_t size, cudaStream_t stream);
cudaError_t cudaFreeAsync(void *dev_ptr, cudaStream_t stream);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream);
cudaError_t cudaMemset(void *dev_ptr, int value, size_t count);
cudaError_t cudaMemsetAsync(void *dev_ptr, int value, size_t count, cudaStream_t stream);
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr);
cudaError_t cudaMemPoolCreate(cudaMemPool_t *pool, const struct cudaMemPoolProps *props);
cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool);
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr, void *value);
cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr, void *value);
cudaError_t cudaMallocFromPoolAsync(void **ptr, size_t size, cudaMemPool_t pool, cudaStream_t stream);
/* The emulation's own, for tests: pools made so far, allocations served from them, and the release threshold of the
 * last pool set (0 when none). ATTNFORGE_EMU_CUDA=nopools makes cudaDevAttrMemoryPoolsSupported 0. */
void af_emu_pool_stats(long *pools, long *pooled_allocations, unsigned long long *release_threshold);
cudaError_t cudaDriverGetVersion(int *version);
cudaError_t cudaRuntimeGetVersion(int *version);

/* ---- Devices and contexts (cuda_emulated_context.c): ATTNFORGE_EMU_DEVICE_COUNT devices (default 1, at most 8);
 * per host thread a current context (none at start). cudaSetDevice creates the device's primary context and makes it
 * current; a runtime call that needs a context when none is current creates the runtime device's (0 unless
 * cudaSetDevice chose another). The driver's cuCtxGetCurrent/cuCtxSetCurrent come only through the entry-point query,
 * as in a library that links cudart alone. ---- */
typedef enum cudaError_enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_CONTEXT = 201
} CUresult;
typedef struct CUctx_st *CUcontext;
enum cudaGetDriverEntryPointFlags { cudaEnableDefault = 0 };
enum cudaDriverEntryPointQueryResult {
    cudaDriverEntryPointSuccess = 0,
    cudaDriverEntryPointSymbolNotFound = 1,
    cudaDriverEntryPointVersionNotSufficent = 2
};
typedef enum cudaDriverEntryPointQueryResult cudaDriverEntryPointQueryResult;   /* C++'s name, as nvcc has it */
cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **funcPtr, unsigned int cudaVersion,
                                             unsigned long long flags, enum cudaDriverEntryPointQueryResult *status);
/* The emulation's own, for tests: how often device `device`'s primary context was created (0 or 1), and a failure
 * (CUDA_ERROR_INVALID_CONTEXT) of the next `count` cuCtxSetCurrent calls from any thread. */
int af_emu_primary_contexts_created(int device);
void af_emu_fail_ctx_set_current(int count);

/* ---- Streams and stream capture (cuda_emulated_capture.c: the global mode's rules) ---- */
typedef struct CUgraph_st *cudaGraph_t;
enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2
};
enum cudaStreamCaptureStatus {
    cudaStreamCaptureStatusNone = 0,
    cudaStreamCaptureStatusActive = 1,
    cudaStreamCaptureStatusInvalidated = 2
};
cudaError_t cudaStreamCreate(cudaStream_t *stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus *status);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);

/* ---- Device globals: a `static` variable of the backend (one emulated device); the symbol copies are synchronous,
 * as CUDA's (refused during a capture) ---- */
#define AF_DEVICE_GLOBAL static
cudaError_t af_emu_copy_symbol(void *dst, const void *src, size_t count);
#define cudaMemcpyFromSymbol(dst, symbol, count) af_emu_copy_symbol((dst), &(symbol), (count))
#define cudaMemcpyToSymbol(symbol, src, count) af_emu_copy_symbol(&(symbol), (src), (count))

/* ---- Kernels and launches ---- */
typedef struct af_emu_kernel {
    const char *name;
    void (*entry)(const void *params); /* calls the kernel with *(const Params *)params */
    int max_threads;                   /* the kernel's launch bound */
    int max_dynamic_smem;              /* bytes allowed by AF_SET_MAX_SMEM; 0: the 48 KiB default */
} af_emu_kernel;

cudaError_t af_emu_launch(af_emu_kernel *kernel, long long gx, long long gy, long long gz, long long threads,
                          long long smem_bytes, cudaStream_t stream, const void *params);
cudaError_t af_emu_set_max_smem(af_emu_kernel *kernel, long long bytes);
cudaError_t af_emu_occupancy(const af_emu_kernel *kernel, long long threads, long long smem_bytes, int *blocks);

#define AF_DEVICE static inline

/* Defines `static void name(const Params p)`, its record (launch bound, smem attribute), the trampoline the
 * emulator calls per thread and a typed launcher that takes the parameters by value. Like the nvcc build's
 * cudaLaunchKernel, a launch returns its own status (also recorded as the thread's last error when it fails) and
 * neither reports nor clears an earlier call's error. */
#define AF_KERNEL(name, Params, p, max_threads)                                                                 \
    static void name(const Params p) AF_EMU_UNUSED;                                                             \
    AF_EMU_UNUSED static void name##_af_entry(const void *af_params) { name(*(const Params *)af_params); }      \
    AF_EMU_UNUSED static af_emu_kernel name##_af_kernel = {#name, name##_af_entry, (max_threads), 0};          \
    AF_EMU_UNUSED static cudaError_t name##_af_launch(long long af_gx, long long af_gy, long long af_gz,       \
                                                      long long af_threads, long long af_smem,                 \
                                                      cudaStream_t af_stream, const Params af_params)          \
    {                                                                                                           \
        return af_emu_launch(&name##_af_kernel, af_gx, af_gy, af_gz, af_threads, af_smem, af_stream, &af_params); \
    }                                                                                                           \
    static void name(const Params p)

#define AF_LAUNCH(name, gx, gy, gz, threads, smem_bytes, stream, params)                                       \
    name##_af_launch((long long)(gx), (long long)(gy), (long long)(gz), (long long)(threads),                \
                     (long long)(smem_bytes), (stream), (params))
#define AF_SET_MAX_SMEM(name, bytes) af_emu_set_max_smem(&name##_af_kernel, (long long)(bytes))
#define AF_OCCUPANCY(name, threads, smem_bytes, blocks) \
    af_emu_occupancy(&name##_af_kernel, (long long)(threads), (long long)(smem_bytes), (blocks))

/* ---- Indices: the running fiber's view (thread-local: host threads may launch at the same time) ---- */
typedef struct af_emu_thread_view {
    int thread_idx;
    int block_dim;
    int block_idx[3];
    int grid_dim[3];
    char *shared_memory;
} af_emu_thread_view;

extern __thread const af_emu_thread_view *af_emu_self;

#define AF_THREAD_IDX (af_emu_self->thread_idx)
#define AF_BLOCK_DIM (af_emu_self->block_dim)
#define AF_BLOCK_IDX_X (af_emu_self->block_idx[0])
#define AF_BLOCK_IDX_Y (af_emu_self->block_idx[1])
#define AF_BLOCK_IDX_Z (af_emu_self->block_idx[2])
#define AF_GRID_DIM_X (af_emu_self->grid_dim[0])
#define AF_GRID_DIM_Y (af_emu_self->grid_dim[1])
#define AF_GRID_DIM_Z (af_emu_self->grid_dim[2])

static inline int af_lane(void) { return af_emu_self->thread_idx % 32; }
static inline int af_warp(void) { return af_emu_self->thread_idx / 32; }
/* read afresh on a GPU (no register carried from an earlier read); the same values here */
static inline int af_block_idx_x_reread(void) { return af_emu_self->block_idx[0]; }
static inline int af_thread_idx_reread(void) { return af_emu_self->thread_idx; }

/* ---- Memory ---- */
static inline char *af_shared_memory(void) { return af_emu_self->shared_memory; }
void af_syncthreads(void);

/* ---- Warp collectives (all 32 lanes, same collective) ---- */
float af_shfl_xor(float v, int lane_mask);
int af_warp_broadcast(int v);
int af_shfl_int(int v, int src_lane);
void af_mma_16816_f16(float d[4], const uint32_t a[4], const uint32_t b[2]);
void af_mma_16816_bf16(float d[4], const uint32_t a[4], const uint32_t b[2]);
void af_ldmatrix_x4(uint32_t r[4], const void *smem_row);
void af_ldmatrix_x4_trans(uint32_t r[4], const void *smem_row);
void af_ldmatrix_x2(uint32_t r[2], const void *smem_row);
void af_ldmatrix_x2_trans(uint32_t r[2], const void *smem_row);

/* ---- Asynchronous copies (per thread) ---- */
void af_cp_async_16(void *smem_dst, const void *gmem_src, int src_bytes);
void af_cp_async_commit(void);
void af_cp_async_wait_0(void);
void af_cp_async_wait_1(void);
void af_cp_async_wait_2(void);

/* ---- Numbers ---- */
float af_ex2(float x);
float af_tanh_approx(float x);
uint32_t af_pack_f16x2(float lo, float hi);
uint32_t af_pack_bf16x2(float lo, float hi);
float af_f16_to_float(uint16_t h);
float af_bf16_to_float(uint16_t h);
uint16_t af_float_to_f16(float x);
uint16_t af_float_to_bf16(float x);

/* ---- Atomics (global memory) ---- */
static inline unsigned int af_atomic_cas(unsigned int *address, unsigned int compare, unsigned int value)
{
    __atomic_compare_exchange_n(address, &compare, value, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;   /* the old value, as atomicCAS returns */
}

/* ---- Hooks for the Hopper emulation (cuda_emulated_hopper.c), defined at the end of cuda_emulated.c: the running
 * thread waits until af_emu_wake(thread) (a deadlock, described by `describe`, when no thread could run); the
 * running thread goes on only once no other thread is ready (af_emu_yield); the size of the block's dynamic shared memory;
 * the thread whose cp.async into the 16-byte chunk at shared offset `offset` is issued and not yet complete (-1:
 * none) ---- */
void af_emu_park(void (*describe)(char *text, size_t size));
void af_emu_wake(int thread);
void af_emu_yield(void);
size_t af_emu_shared_memory_bytes(void);
int af_emu_cp_async_in_flight(size_t offset);
/* cp.async.mbarrier.arrive's copies: the running thread's in-flight copies taken out of its queue (count of them;
 * its later wait_group no longer covers them), then completed as thread `thread`'s, 16-byte destinations with the
 * race checks of a wait_group */
void *af_emu_cp_async_detach(int *count);
size_t af_emu_cp_async_batch_offset(const void *batch, int i);   /* copy i's destination, a shared offset */
void af_emu_cp_async_land(int thread, void *batch, int count);

#ifdef __cplusplus
}
#endif

#endif
