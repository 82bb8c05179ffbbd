/* Backends, loaded lazily: the CPU kernels in this library, the CUDA one from its own shared object
 * (src/sdpa/cuda_backend.c opens it). */
#ifndef AF_PROVIDER_RUNTIME_H
#define AF_PROVIDER_RUNTIME_H
#include "attnforge.h"

/* An fa4 plan names FlashAttention-4 itself (flash_attn.cute, a Python package): only the Python provider can
 * call it, so libattnforge refuses to run or load it with this message (AF_ERR_UNSUPPORTED). */
#define AF_FA4_ONLY_IN_PYTHON                                                                                          \
    "the plan's backend is fa4: FlashAttention-4 itself (flash_attn.cute), which only the Python provider "            \
    "(attnforge.FlashAttention4KernelProvider) can call; libattnforge runs plans for its own backends, cpu and cuda"

typedef af_status (*af_kernel_fn)(const af_sdpa_args *args, af_tensor *out, af_tensor *lse);

/* What a loaded backend gives the provider. */
typedef struct {
    const char *name;              /* "cpu", "cuda" */
    af_kernel_fn sdpa;             /* af_sdpa's contract */
} af_backend_ops;

/* Load `backend` on first need and cache it process-wide (a failure is not cached: installing the
 * library later is noticed). AF_ERR_RUNTIME_UNAVAILABLE says what is missing and how to get it. */
af_status af_runtime_load(af_backend backend, const af_backend_ops **ops);

/* True once `backend` has loaded in this process (tests: prepare must not load anything). */
bool af_runtime_is_loaded(af_backend backend);

#endif
