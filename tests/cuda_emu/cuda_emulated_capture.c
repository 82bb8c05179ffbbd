/* Streams and stream capture in the emulation, with CUDA's rules for the global capture mode (the mode
 * torch.cuda.graph uses): while a stream is capturing, a call that would wait for the device (a synchronisation, a
 * blocking copy or memset, cudaMalloc/cudaFree) fails with cudaErrorStreamCaptureUnsupported and invalidates the
 * capture, and work enqueued on the legacy stream fails with cudaErrorStreamCaptureImplicit. Work enqueued on a
 * capturing stream runs at once (streams run synchronously here), as the graph's replay would run it; the graph
 * cudaStreamEndCapture returns holds nothing to launch. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_emulated_internal.h"

struct CUstream_st {
    int capturing;     /* between cudaStreamBeginCapture and cudaStreamEndCapture */
    int invalidated;   /* an unsafe call happened during the capture */
};

struct CUgraph_st {
    int unused;
};

static pthread_mutex_t capture_lock = PTHREAD_MUTEX_INITIALIZER;
static int captures;   /* streams capturing now */

cudaError_t cudaStreamCreate(cudaStream_t *stream)
{
    if (!stream)
        return af_emu_fail(cudaErrorInvalidValue);
    cudaError_t avail = af_emu_availability();
    if (avail != cudaSuccess)
        return af_emu_fail(avail);
    *stream = (cudaStream_t)calloc(1, sizeof **stream);
    return *stream ? cudaSuccess : af_emu_fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags)
{
    (void)flags;
    return cudaStreamCreate(stream);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream)
{
    if (!stream)
        return af_emu_fail(cudaErrorInvalidResourceHandle);
    free(stream);
    return cudaSuccess;
}

/* The capturing streams: an unsafe call from any thread invalidates them all (global mode). */
#define AF_EMU_MAX_CAPTURING 64
static cudaStream_t capturing[AF_EMU_MAX_CAPTURING];

static int remember(cudaStream_t stream, cudaStream_t replaced_by)
{
    for (int i = 0; i < AF_EMU_MAX_CAPTURING; i++)
        if (capturing[i] == stream) {
            capturing[i] = replaced_by;
            return 1;
        }
    return 0;
}

static void invalidate_all(void)
{
    for (int i = 0; i < AF_EMU_MAX_CAPTURING; i++)
        if (capturing[i] && capturing[i]->capturing)
            capturing[i]->invalidated = 1;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode)
{
    (void)mode;
    if (!stream)   /* the legacy stream cannot be captured */
        return af_emu_fail(cudaErrorStreamCaptureUnsupported);
    pthread_mutex_lock(&capture_lock);
    const int already = stream->capturing || !remember(NULL, stream);   /* busy, or too many captures */
    if (!already) {
        stream->capturing = 1;
        stream->invalidated = 0;
        captures++;
    }
    pthread_mutex_unlock(&capture_lock);
    return already ? af_emu_fail(cudaErrorIllegalState) : cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *graph)
{
    if (!stream || !graph)
        return af_emu_fail(cudaErrorInvalidValue);
    *graph = NULL;
    pthread_mutex_lock(&capture_lock);
    const int was = stream->capturing, invalidated = stream->invalidated;
    if (was) {
        stream->capturing = 0;
        captures--;
        (void)remember(stream, NULL);
    }
    pthread_mutex_unlock(&capture_lock);
    if (!was)
        return af_emu_fail(cudaErrorIllegalState);
    if (invalidated)
        return af_emu_fail(cudaErrorStreamCaptureInvalidated);
    *graph = (cudaGraph_t)calloc(1, sizeof **graph);
    return *graph ? cudaSuccess : af_emu_fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus *status)
{
    if (!status)
        return af_emu_fail(cudaErrorInvalidValue);
    pthread_mutex_lock(&capture_lock);
    if (!stream) {   /* asking about the legacy stream during a global capture is itself an implicit sync */
        const int any = captures > 0;
        pthread_mutex_unlock(&capture_lock);
        *status = cudaStreamCaptureStatusNone;
        return any ? af_emu_fail(cudaErrorStreamCaptureImplicit) : cudaSuccess;
    }
    *status = !stream->capturing ? cudaStreamCaptureStatusNone
              : stream->invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
    pthread_mutex_unlock(&capture_lock);
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph)
{
    free(graph);
    return cudaSuccess;
}

cudaError_t af_emu_capture_blocking(void)
{
    pthread_mutex_lock(&capture_lock);
    const int any = captures > 0;
    if (any)
        invalidate_all();
    pthread_mutex_unlock(&capture_lock);
    return any ? af_emu_fail(cudaErrorStreamCaptureUnsupported) : cudaSuccess;
}

cudaError_t af_emu_capture_enqueue(cudaStream_t stream)
{
    pthread_mutex_lock(&capture_lock);
    const int any = captures > 0;
    if (!stream && any)
        invalidate_all();
    pthread_mutex_unlock(&capture_lock);
    return !stream && any ? af_emu_fail(cudaErrorStreamCaptureImplicit) : cudaSuccess;
}

cudaError_t af_emu_copy_symbol(void *dst, const void *src, size_t count)
{
    cudaError_t avail = af_emu_availability();
    if (avail != cudaSuccess)
        return af_emu_fail(avail);
    cudaError_t capture = af_emu_capture_blocking();   /* a synchronous copy */
    if (capture != cudaSuccess)
        return capture;
    memmove(dst, src, count);
    return cudaSuccess;
}
