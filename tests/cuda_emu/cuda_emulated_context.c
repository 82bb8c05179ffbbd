/* Devices and contexts in the emulation, as CUDA 12+ has them: ATTNFORGE_EMU_DEVICE_COUNT devices (default 1), each
 * with a primary context that is created by cudaSetDevice (or by the first runtime call needing one when none is
 * current) and then kept; per host thread one current context, NULL at start, and the runtime's own device choice
 * (0 at start) that names the context a runtime call makes current when none is. The driver's cuCtxGetCurrent and
 * cuCtxSetCurrent are reachable only through cudaGetDriverEntryPointByVersion, as from a library that links cudart
 * alone. Tests read how often each primary context was created (af_emu_primary_contexts_created). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_emulated_internal.h"

#define AF_EMU_MAX_DEVICES 8

struct CUctx_st {
    int device;
};

static struct CUctx_st primary[AF_EMU_MAX_DEVICES];
static int created[AF_EMU_MAX_DEVICES];   /* creations of each primary context (0 or 1: it is never destroyed) */
static int failing_sets;                  /* af_emu_fail_ctx_set_current */

/* Per host thread, behind a pthread key rather than __thread: more static TLS in the dlopen'd backend moves it to
 * dynamic TLS, whose scan crashes LeakSanitizer here (glibc 2.36, gcc 12: "Tracer caught signal 11"). */
typedef struct {
    CUcontext current;    /* NULL: no context current on this thread */
    int runtime_device;   /* cudaSetDevice's choice, read when no context is current */
} thread_state;

static pthread_key_t state_key;
static pthread_once_t state_once = PTHREAD_ONCE_INIT;

static void make_state_key(void)
{
    if (pthread_key_create(&state_key, free) != 0) {
        fprintf(stderr, "cuda emulation: pthread_key_create failed\n");
        abort();
    }
}

static thread_state *state(void)
{
    pthread_once(&state_once, make_state_key);
    thread_state *s = (thread_state *)pthread_getspecific(state_key);
    if (!s) {
        s = (thread_state *)calloc(1, sizeof *s);
        if (!s || pthread_setspecific(state_key, s) != 0) {
            fprintf(stderr, "cuda emulation: out of memory for a thread's context state\n");
            abort();
        }
    }
    return s;
}

int af_emu_device_count(void)
{
    const char *s = getenv("ATTNFORGE_EMU_DEVICE_COUNT");
    if (!s || !*s)
        return 1;
    char *end;
    const long n = strtol(s, &end, 10);
    return (*end == '\0' && n >= 1 && n <= AF_EMU_MAX_DEVICES) ? (int)n : 1;
}

/* The device's primary context, created on first use (CUDA 12: cudaSetDevice creates it at once). */
static CUcontext primary_context(int device)
{
    int expected = 0;
    if (__atomic_compare_exchange_n(&created[device], &expected, 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        primary[device].device = device;
    return &primary[device];
}

int af_emu_runtime_device(void)
{
    thread_state *s = state();
    if (!s->current)
        s->current = primary_context(s->runtime_device);
    return s->current->device;
}

cudaError_t cudaGetDevice(int *device)
{
    if (!device)
        return af_emu_fail(cudaErrorInvalidValue);
    const cudaError_t avail = af_emu_availability();
    if (avail != cudaSuccess)
        return af_emu_fail(avail);
    const thread_state *s = state();
    *device = s->current ? s->current->device : s->runtime_device;   /* creates nothing */
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device)
{
    const cudaError_t avail = af_emu_availability();
    if (avail != cudaSuccess)
        return af_emu_fail(avail);
    if (device < 0 || device >= af_emu_device_count())
        return af_emu_fail(cudaErrorInvalidDevice);
    thread_state *s = state();
    s->runtime_device = device;
    s->current = primary_context(device);
    return cudaSuccess;
}

static CUresult cu_ctx_get_current(CUcontext *pctx)
{
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (af_emu_availability() != cudaSuccess)
        return CUDA_ERROR_NOT_INITIALIZED;
    *pctx = state()->current;
    return CUDA_SUCCESS;
}

/* NULL unbinds; anything else must be a context that exists (a primary context once created). */
static CUresult cu_ctx_set_current(CUcontext ctx)
{
    if (af_emu_availability() != cudaSuccess)
        return CUDA_ERROR_NOT_INITIALIZED;
    int failing = __atomic_load_n(&failing_sets, __ATOMIC_SEQ_CST);
    while (failing > 0 &&
           !__atomic_compare_exchange_n(&failing_sets, &failing, failing - 1, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST)) {
    }
    if (failing > 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx && !(ctx >= primary && ctx < primary + AF_EMU_MAX_DEVICES &&
                 __atomic_load_n(&created[ctx - primary], __ATOMIC_SEQ_CST)))
        return CUDA_ERROR_INVALID_CONTEXT;
    state()->current = ctx;
    return CUDA_SUCCESS;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **funcPtr, unsigned int cudaVersion,
                                             unsigned long long flags, enum cudaDriverEntryPointQueryResult *status)
{
    (void)flags;
    if (!symbol || !funcPtr)
        return af_emu_fail(cudaErrorInvalidValue);
    const cudaError_t avail = af_emu_availability();
    if (avail != cudaSuccess)
        return af_emu_fail(avail);
    if (cudaVersion > 13000)   /* newer than the emulated driver */
        return af_emu_fail(cudaErrorInvalidValue);
    *funcPtr = strcmp(symbol, "cuCtxGetCurrent") == 0   ? (void *)cu_ctx_get_current
               : strcmp(symbol, "cuCtxSetCurrent") == 0 ? (void *)cu_ctx_set_current
                                                        : NULL;
    if (status)
        *status = *funcPtr ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
    return cudaSuccess;
}

int af_emu_primary_contexts_created(int device)
{
    return device >= 0 && device < AF_EMU_MAX_DEVICES ? __atomic_load_n(&created[device], __ATOMIC_SEQ_CST) : 0;
}

void af_emu_fail_ctx_set_current(int count) { __atomic_store_n(&failing_sets, count, __ATOMIC_SEQ_CST); }
