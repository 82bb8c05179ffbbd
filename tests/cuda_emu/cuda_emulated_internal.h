/* What the parts of the emulation share: the runtime's availability (ATTNFORGE_EMU_CUDA), the per-thread last
 * error and the emulated device's limits. */
#ifndef AF_CUDA_EMULATED_INTERNAL_H
#define AF_CUDA_EMULATED_INTERNAL_H
#include "cuda_emulated.h"

#define AF_EMU_DEFAULT_SMEM (48 * 1024)       /* dynamic shared memory a launch may use without the attribute */
#define AF_EMU_OPTIN_SMEM (227 * 1024)        /* cudaDevAttrMaxSharedMemoryPerBlockOptin of cc 9.0 */
#define AF_EMU_MAX_THREADS 1024

/* cudaSuccess, or the error every runtime call returns under ATTNFORGE_EMU_CUDA=nodriver / =nodevice. */
cudaError_t af_emu_availability(void);
/* Records `err` as the calling thread's last error unless it is cudaSuccess; returns it. */
cudaError_t af_emu_fail(cudaError_t err);
/* During a stream capture: a call that waits for the device fails (cudaErrorStreamCaptureUnsupported) and invalidates
 * the capture; work enqueued on the legacy stream fails (cudaErrorStreamCaptureImplicit). cudaSuccess otherwise. */
cudaError_t af_emu_capture_blocking(void);
cudaError_t af_emu_capture_enqueue(cudaStream_t stream);
/* cudaDevAttrMemoryPoolsSupported: 1, or 0 under ATTNFORGE_EMU_CUDA=nopools (cuda_emulated_pool.c) */
int af_emu_pools_supported(void);
/* ATTNFORGE_EMU_DEVICE_COUNT (cuda_emulated_context.c) */
int af_emu_device_count(void);
/* The device of this thread's current context; when none is current, the runtime device's primary context is created
 * if need be and made current first, as CUDA's runtime does on a call that needs a context. */
int af_emu_runtime_device(void);

#endif
