/* The interface between libattnforge and its CUDA backend, libattnforge_cuda.so (src/cuda/), which is opened
 * with dlopen on the first call on CUDA tensors, so libattnforge never links CUDA. Both sides are built from
 * this one header; the version refuses a backend built from another attnforge. */
#ifndef AF_SDPA_CUDA_BACKEND_H
#define AF_SDPA_CUDA_BACKEND_H
#include <stdbool.h>
#include <stddef.h>

#include "sdpa/backward.h"
#include "sdpa/problem.h"

#ifdef __cplusplus
extern "C" {
#endif

#define AF_CUDA_BACKEND_ABI_VERSION 7   /* 7: backward; 6: window sides literal, AF_WINDOW_UNBOUNDED unbounded; 5: the caller's workspace allocator */
#define AF_CUDA_LIBRARY "libattnforge_cuda.so"        /* ATTNFORGE_CUDA_LIBRARY overrides the path */
#define AF_CUDA_ENTRY "af_cuda_backend"               /* const af_cuda_backend_ops *af_cuda_backend(void) */

typedef void (*af_cuda_log_fn)(int level, const char *message);   /* level: af_log_level */

typedef struct {
    int abi_version;                /* AF_CUDA_BACKEND_ABI_VERSION */
    const char *name;               /* "cuda" */
    /* Driver and devices: AF_OK and the number of CUDA devices (>= 1), else AF_ERR_RUNTIME_UNAVAILABLE with
     * the reason in err (no driver, driver too old, no device) and how to fix it. */
    int (*probe)(int *device_count, char *err, size_t err_size);
    /* Enqueue one checked problem (af_sdpa_check passed; every pointer is memory of CUDA device `device`) on
     * `stream` (a cudaStream_t; NULL = the legacy default stream), its scratch from `workspace` (NULL: the
     * backend's own pool). AF_OK once enqueued, else a status and CUDA's own text in err; nothing is written to
     * out/lse unless AF_OK. The caller's current CUDA context is current again on return. */
    int (*forward)(const af_problem *p, int device, void *stream, const af_cuda_allocator *workspace, char *err,
                   size_t err_size);
    /* Where the backend's warnings go (e.g. a tensor copied because its rows are not 16-byte aligned). */
    void (*set_log)(af_cuda_log_fn log);
    /* Device memory for the command line's verify/bench and the tests (the library itself never allocates
     * the caller's tensors): cudaMalloc / cudaFree / cudaMemcpy (to_device: host -> device, else device -> host,
     * synchronous) / cudaStreamSynchronize, on `device`. Each returns AF_OK or a status with CUDA's text. */
    int (*device_alloc)(int device, size_t bytes, void **ptr, char *err, size_t err_size);
    int (*device_free)(int device, void *ptr, char *err, size_t err_size);
    int (*copy)(int device, void *dst, const void *src, size_t bytes, bool to_device, char *err, size_t err_size);
    int (*synchronize)(int device, void *stream, char *err, size_t err_size);
    /* The first index-array violation the device-side check found on `device` since the last call (AF_OK: none;
     * else AF_ERR_INVALID_ARGUMENT and the rule in err), then cleared. Synchronises the device: not during capture. */
    int (*index_errors)(int device, char *err, size_t err_size);
    /* Enqueue one checked backward problem (af_*_backward_check passed; every pointer is memory of `device`) on
     * `stream`, its scratch from `workspace` as forward's. AF_OK once enqueued; AF_ERR_UNSUPPORTED naming the argument
     * for what the CUDA backward does not take, before any launch; nothing is written unless AF_OK. */
    int (*backward)(const af_backward_problem *bp, int device, void *stream, const af_cuda_allocator *workspace,
                    char *err, size_t err_size);
} af_cuda_backend_ops;

/* libattnforge side: open the backend on first need and keep it for the process; a failure is not cached.
 * AF_ERR_RUNTIME_UNAVAILABLE says which of library / driver / GPU is missing and how to get it. */
af_status af_cuda_backend_load(const af_cuda_backend_ops **ops);
bool af_cuda_backend_is_loaded(void);
/* The CUDA devices the loader's probe found (>= 1 once af_cuda_backend_load succeeded; 0 before). */
int af_cuda_backend_device_count(void);
/* ops->forward on p; a fixed-length problem whose key or value is broadcast (stride 0) along a batch or kv-head dim
 * longer than 1 is enqueued as one launch per batch / kv head, each with that dim of size 1: TMA descriptors (the
 * Hopper kernel's K/V loads) cannot express a zero stride. A failing slice stops the rest (earlier ones are written). */
int af_cuda_forward_sliced(const af_cuda_backend_ops *ops, const af_problem *p, int device, void *stream,
                           const af_cuda_allocator *workspace, char *err, size_t err_size);

#ifdef __cplusplus
}
#endif
#endif
