/* The CUDA backend loader: libattnforge_cuda.so is opened with dlopen on the first call on CUDA tensors, so this
 * library never links CUDA and runs wherever there is no GPU. Where to look: ATTNFORGE_CUDA_LIBRARY if set; else
 * beside the object that holds this code (libattnforge.so, the executable it is linked into, or the Python module
 * attnforge._C), where the build, `make install` and `pip install .` put it; else the library search path. */
#include "sdpa/cuda_backend.h"

#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/log.h"
#include "core/status.h"

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;
static const af_cuda_backend_ops *loaded_ops;   /* under load_lock: the opened library (kept for the process) */
static atomic_bool usable;                       /* the library is loaded and its probe found a GPU */
static atomic_int device_count;                 /* what that probe found (the driver's count is fixed per process) */
static char library_path[PATH_MAX + 64];         /* under load_lock: the library last loaded ("" if the last open failed) */

static void log_from_backend(int level, const char *message) { af_log((af_log_level)level, "cuda: %s", message); }

/* The directory of the object holding this function: libattnforge.so's, or the executable's for a static link. */
static bool own_directory(char *dir, size_t size) {
    Dl_info info;
    if (!dladdr((const void *)&own_directory, &info) || !info.dli_fname || !info.dli_fname[0]) return false;
    char resolved[PATH_MAX];
    const char *path = realpath(info.dli_fname, resolved) ? resolved : info.dli_fname;
    const char *slash = strrchr(path, '/');
    if (!slash) return false;
    size_t length = (size_t)(slash - path);
    if (length + 1 > size) return false;
    memcpy(dir, path, length);
    dir[length] = '\0';
    return true;
}

/* dlopen the library: the explicit path, else beside us, else by its plain name. NULL with `why` on failure. */
static void *open_library(char *opened, size_t opened_size, char *why, size_t why_size) {
    const char *explicit_path = getenv("ATTNFORGE_CUDA_LIBRARY");
    if (explicit_path && *explicit_path) {
        snprintf(opened, opened_size, "%s", explicit_path);
        void *handle = dlopen(explicit_path, RTLD_NOW | RTLD_LOCAL);
        if (!handle) {
            const char *error = dlerror();
            snprintf(why, why_size, "ATTNFORGE_CUDA_LIBRARY=%s could not be opened (%s)", explicit_path,
                     error ? error : "unknown dlopen error");
        }
        return handle;
    }
    char dir[PATH_MAX], beside[PATH_MAX + sizeof AF_CUDA_LIBRARY + 1];
    if (own_directory(dir, sizeof dir)) {
        snprintf(beside, sizeof beside, "%s/%s", dir, AF_CUDA_LIBRARY);
        if (access(beside, F_OK) == 0) {   /* present but unloadable is that file's problem: say so, look no further */
            snprintf(opened, opened_size, "%s", beside);
            void *handle = dlopen(beside, RTLD_NOW | RTLD_LOCAL);
            if (!handle) {
                const char *error = dlerror();
                snprintf(why, why_size, "%s could not be opened (%s)", beside, error ? error : "unknown dlopen error");
            }
            return handle;
        }
    } else {
        snprintf(beside, sizeof beside, "(attnforge's own directory is unknown)");
    }
    snprintf(opened, opened_size, "%s", AF_CUDA_LIBRARY);
    void *handle = dlopen(AF_CUDA_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        const char *error = dlerror();
        snprintf(why, why_size, "%s was found neither at %s nor on the library search path (%s)", AF_CUDA_LIBRARY,
                 beside, error ? error : "unknown dlopen error");
    }
    return handle;
}

/* Open the library and check its entry and interface version; called under load_lock. */
static af_status load_library(void) {
    char path[PATH_MAX + 64], why[PATH_MAX + 512];
    library_path[0] = '\0';
    void *handle = open_library(path, sizeof path, why, sizeof why);
    if (!handle)
        return af_fail(AF_ERR_RUNTIME_UNAVAILABLE,
                       "attnforge's CUDA backend is not available: %s. It is built with attnforge when CMake finds "
                       "nvcc (the CUDA toolkit) and installed beside libattnforge (by `pip install .`: inside the "
                       "attnforge package); build it that way, install it, or set ATTNFORGE_CUDA_LIBRARY to the path "
                       "of %s", why, AF_CUDA_LIBRARY);
    const af_cuda_backend_ops *(*entry)(void) = NULL;
    void *symbol = dlsym(handle, AF_CUDA_ENTRY);
    memcpy(&entry, &symbol, sizeof entry);   /* object to function pointer, as POSIX dlsym intends */
    const af_cuda_backend_ops *ops = entry ? entry() : NULL;
    if (!ops) {
        dlclose(handle);
        return af_fail(AF_ERR_RUNTIME_UNAVAILABLE,
                       "attnforge's CUDA backend is not available: %s does not export %s() (or it returned NULL); it "
                       "is not an attnforge CUDA backend. Point ATTNFORGE_CUDA_LIBRARY at attnforge's %s, or unset "
                       "it", path, AF_CUDA_ENTRY, AF_CUDA_LIBRARY);
    }
    if (ops->abi_version != AF_CUDA_BACKEND_ABI_VERSION) {
        const int found = ops->abi_version;
        dlclose(handle);
        return af_fail(AF_ERR_RUNTIME_UNAVAILABLE,
                       "attnforge's CUDA backend is not available: %s implements backend interface version %d, but "
                       "this attnforge %s needs version %d; install the %s built with this attnforge", path, found,
                       AF_VERSION_STRING, AF_CUDA_BACKEND_ABI_VERSION, AF_CUDA_LIBRARY);
    }
    if (!ops->probe || !ops->forward || !ops->set_log || !ops->device_alloc || !ops->device_free || !ops->copy ||
        !ops->synchronize || !ops->index_errors || !ops->backward) {
        dlclose(handle);
        return af_fail(AF_ERR_RUNTIME_UNAVAILABLE,
                       "attnforge's CUDA backend is not available: %s leaves functions of its interface NULL; "
                       "install the %s built with this attnforge", path, AF_CUDA_LIBRARY);
    }
    ops->set_log(log_from_backend);
    loaded_ops = ops;
    memcpy(library_path, path, sizeof library_path);
    af_log(AF_LOG_DEBUG, "loaded the CUDA backend from %s", path);
    return AF_OK;
}

af_status af_cuda_backend_load(const af_cuda_backend_ops **ops) {
    *ops = NULL;
    if (atomic_load(&usable)) {
        *ops = loaded_ops;
        return AF_OK;
    }
    pthread_mutex_lock(&load_lock);
    af_status st = loaded_ops ? AF_OK : load_library();
    if (st == AF_OK && !atomic_load(&usable)) {   /* driver and GPU: asked again on each attempt until found */
        char err[512] = "";
        int count = 0;
        const int probed = loaded_ops->probe(&count, err, sizeof err);
        if (probed == AF_OK && count >= 1) {
            atomic_store(&device_count, count);
            atomic_store(&usable, true);
            af_log(AF_LOG_DEBUG, "CUDA backend: %d device(s)", count);
        } else {
            st = af_fail(probed == AF_OK ? AF_ERR_RUNTIME_UNAVAILABLE : (af_status)probed, "%s",
                         err[0] ? err : "attnforge's CUDA backend found no CUDA device");
            /* the next attempt opens the library again (the same handle, or another if ATTNFORGE_CUDA_LIBRARY
             * changed); this one stays open: a CUDA runtime that has run must not be unloaded */
            loaded_ops = NULL;
        }
    }
    if (st == AF_OK) *ops = loaded_ops;
    pthread_mutex_unlock(&load_lock);
    return st;
}

bool af_cuda_backend_is_loaded(void) { return atomic_load(&usable); }

int af_cuda_backend_device_count(void) { return atomic_load(&usable) ? atomic_load(&device_count) : 0; }

af_status af_load_cuda_backend(int *count, char *library, size_t library_size) {
    af_clear_error();
    if (count) *count = 0;
    if (library && library_size == 0)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "library_size: must be at least 1 when library is given");
    const af_cuda_backend_ops *ops;
    const af_status st = af_cuda_backend_load(&ops);
    if (count && st == AF_OK) *count = af_cuda_backend_device_count();
    if (library) {
        pthread_mutex_lock(&load_lock);
        snprintf(library, library_size, "%s", library_path);
        pthread_mutex_unlock(&load_lock);
    }
    return st;
}

af_status af_cuda_check_errors(int device) {
    af_clear_error();
    if (device < 0) return af_fail(AF_ERR_INVALID_ARGUMENT, "device: must be >= 0, got %d", device);
    const af_cuda_backend_ops *ops;
    af_status st = af_cuda_backend_load(&ops);
    if (st != AF_OK) return st;
    if (device >= af_cuda_backend_device_count())
        return af_fail(AF_ERR_INVALID_ARGUMENT, "device: cuda:%d, but this machine has %d CUDA device(s)", device,
                       af_cuda_backend_device_count());
    char err[1024] = "";
    const int status = ops->index_errors(device, err, sizeof err);
    return status == AF_OK ? AF_OK : af_fail((af_status)status, "%s", err);
}

/* ---- broadcast K/V on the CUDA backend */

/* One slice of p: batch b (when per_batch) and kv head hk (when per_head) alone, every pointer moved to it. */
static af_problem broadcast_slice(const af_problem *p, bool per_batch, int64_t b, bool per_head, int64_t hk) {
    af_problem s = *p;
    const int64_t q_elem = (int64_t)af_dtype_size(p->dtype), kv_elem = (int64_t)af_dtype_size(p->kv_dtype);
    const int64_t out_elem = (int64_t)af_dtype_size(p->out_dtype);
    const int64_t mask_elem = p->mask ? (int64_t)af_dtype_size(p->mask_dtype) : 0;
    const int64_t h0 = per_head ? hk * p->group : 0;   /* the slice's first query head */
    if (!per_batch) b = 0;
    if (!per_head) hk = 0;
    s.q += (b * p->q_stride[0] + h0 * p->q_stride[1]) * q_elem;
    s.k += (b * p->k_stride[0] + hk * p->k_stride[1]) * kv_elem;
    s.v += (b * p->v_stride[0] + hk * p->v_stride[1]) * kv_elem;
    s.out += (b * p->out_stride[0] + h0 * p->out_stride[1]) * out_elem;
    if (p->lse) s.lse += b * p->lse_stride[0] + h0 * p->lse_stride[1];
    if (p->mask) s.mask += (b * p->mask_stride[0] + h0 * p->mask_stride[1]) * mask_elem;
    if (p->sink) s.sink += h0 * p->sink_stride * (int64_t)af_dtype_size(p->sink_dtype);
    const float **descales[3] = {&s.q_descale, &s.k_descale, &s.v_descale};
    const int64_t *descale_strides[3] = {p->q_descale_stride, p->k_descale_stride, p->v_descale_stride};
    for (int i = 0; i < 3; i++)
        if (*descales[i]) *descales[i] += b * descale_strides[i][0] + hk * descale_strides[i][1];
    if (per_batch) s.B = 1;
    if (per_head) {
        s.Hkv = 1;
        s.Hq = p->group;
    }
    return s;
}

int af_cuda_forward_sliced(const af_cuda_backend_ops *ops, const af_problem *p, int device, void *stream,
                           const af_cuda_allocator *workspace, char *err, size_t err_size) {
    const bool fixed = !p->cu_seqlens_q && !p->cu_seqlens_k && !p->seqused_k && !p->page_table;
    const bool per_batch = fixed && p->B > 1 && (p->k_stride[0] == 0 || p->v_stride[0] == 0);
    const bool per_head = fixed && p->Hkv > 1 && (p->k_stride[1] == 0 || p->v_stride[1] == 0);
    if (!per_batch && !per_head) return ops->forward(p, device, stream, workspace, err, err_size);
    for (int64_t b = 0; b < (per_batch ? p->B : 1); b++)
        for (int64_t hk = 0; hk < (per_head ? p->Hkv : 1); hk++) {
            const af_problem slice = broadcast_slice(p, per_batch, b, per_head, hk);
            const int status = ops->forward(&slice, device, stream, workspace, err, err_size);
            if (status != AF_OK) return status;
        }
    return AF_OK;
}
