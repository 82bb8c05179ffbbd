#include "host_openmp.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "attnforge.h"

typedef void (*gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);

typedef struct {
    gomp_parallel_fn parallel;   /* GOMP_parallel: what `#pragma omp parallel num_threads(n)` compiles to */
    int (*max_threads)(void);    /* at::get_num_threads (torch.get_num_threads()), else omp_get_max_threads */
    char runtime[PATH_MAX];
} host_runtime;

/* Set under the GIL, read by test regions without it; never freed once lent: a call that began with it may still be
 * running when it is replaced. */
static _Atomic(host_runtime *) lent;

static atomic_long regions, members;
static atomic_bool recording;
#define MAX_RECORDED 64
static atomic_long recorded_ids[MAX_RECORDED];
static atomic_int recorded_count;

typedef struct {
    void (*fn)(void *ctx, int index);
    void *ctx;
    int n;
    atomic_int next_index;   /* a ticket per member: distinct indices in [0, team size) */
} team_job;

static void team_member(void *arg) {
    team_job *job = arg;
    const int index = atomic_fetch_add(&job->next_index, 1);
    if (index >= job->n) return;
    atomic_fetch_add_explicit(&members, 1, memory_order_relaxed);
    if (atomic_load_explicit(&recording, memory_order_relaxed)) {
        const int slot = atomic_fetch_add(&recorded_count, 1);
        if (slot < MAX_RECORDED) atomic_store(&recorded_ids[slot], (long)syscall(SYS_gettid));
    }
    job->fn(job->ctx, index);
}

static void run_team(const host_runtime *h, int n_threads, void (*fn)(void *, int), void *ctx) {
    team_job job = {.fn = fn, .ctx = ctx, .n = n_threads};
    atomic_init(&job.next_index, 0);
    atomic_fetch_add_explicit(&regions, 1, memory_order_relaxed);
    h->parallel(team_member, &job, (unsigned)n_threads, 0);   /* a nested region gets a team of one: still right */
}

static void host_parallel(int n_threads, af_thread_task task, void *task_ctx, void *user) {
    run_team(user, n_threads, task, task_ctx);
}

static int host_max_threads(void *user) { return ((const host_runtime *)user)->max_threads(); }

static PyObject *refuse(const char *why) { return Py_BuildValue("(Os)", Py_None, why); }

PyObject *afpy_use_host_threads(PyObject *module, PyObject *arg) {
    PyObject *path_bytes = NULL;
    if (!PyUnicode_FSConverter(arg, &path_bytes)) return NULL;
    const char *path = PyBytes_AS_STRING(path_bytes);
    char why[PATH_MAX + 200];
    void *library = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);   /* NOLOAD: only a library the host loaded already */
    if (!library) {
        snprintf(why, sizeof why, "library: %s is not loaded in this process", path);
        Py_DECREF(path_bytes);
        return refuse(why);
    }
    /* Looked up through the host library's handle: the OpenMP runtime it binds to, whatever else is loaded. */
    gomp_parallel_fn parallel = (gomp_parallel_fn)dlsym(library, "GOMP_parallel");
    int (*threads)(void) = (int (*)(void))dlsym(library, "_ZN2at15get_num_threadsEv");
    if (!threads) threads = (int (*)(void))dlsym(library, "omp_get_max_threads");
    Dl_info where;
    const bool found = parallel && threads && dladdr((void *)parallel, &where) && where.dli_fname;
    const char *base = found ? strrchr(where.dli_fname, '/') : NULL;
    base = base ? base + 1 : found ? where.dli_fname : "";
    if (!found || strncmp(base, "libgomp", 7) != 0) {
        /* Intel's and LLVM's runtimes also export GOMP_parallel, as a shim whose threads are not the ones that spin */
        snprintf(why, sizeof why, "library: %s runs no GNU OpenMP runtime (%s)", path,
                 !found ? "no GOMP_parallel and thread count in its dependencies" : where.dli_fname);
        dlclose(library);
        Py_DECREF(path_bytes);
        return refuse(why);
    }
    host_runtime *h = PyMem_RawCalloc(1, sizeof *h);
    if (!h) {
        dlclose(library);
        Py_DECREF(path_bytes);
        return PyErr_NoMemory();
    }
    h->parallel = parallel;
    h->max_threads = threads;
    snprintf(h->runtime, sizeof h->runtime, "%s", where.dli_fname);
    /* the handle stays open: the runtime must outlive every call that uses it */
    Py_DECREF(path_bytes);
    const af_parallel_executor executor = {.parallel = host_parallel, .max_threads = host_max_threads, .user = h};
    Py_BEGIN_ALLOW_THREADS
    af_set_parallel_executor(&executor);
    Py_END_ALLOW_THREADS
    atomic_store(&lent, h);
    return Py_BuildValue("(sO)", h->runtime, Py_None);
}

PyObject *afpy_stop_host_threads(PyObject *module, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    af_set_parallel_executor(NULL);
    Py_END_ALLOW_THREADS
    atomic_store(&lent, NULL);
    Py_RETURN_NONE;
}

PyObject *afpy_host_threads(PyObject *module, PyObject *unused) {
    const host_runtime *h = atomic_load(&lent);
    if (!h) Py_RETURN_NONE;
    return PyUnicode_DecodeFSDefault(h->runtime);
}

afpy_host_counts afpy_host_openmp_counts(void) {
    return (afpy_host_counts){atomic_load(&regions), atomic_load(&members)};
}

void afpy_host_openmp_record(bool on) {
    atomic_store(&recording, false);
    atomic_store(&regions, 0);
    atomic_store(&members, 0);
    atomic_store(&recorded_count, 0);
    atomic_store(&recording, on);
}

int afpy_host_openmp_thread_ids(long *ids, int capacity) {
    int n = atomic_load(&recorded_count);
    if (n > MAX_RECORDED) n = MAX_RECORDED;
    if (n > capacity) n = capacity;
    for (int i = 0; i < n; i++) ids[i] = atomic_load(&recorded_ids[i]);
    return n;
}

bool afpy_host_openmp_region(int n_threads, void (*fn)(void *ctx, int index), void *ctx) {
    const host_runtime *h = atomic_load(&lent);
    if (!h) return false;
    run_team(h, n_threads, fn, ctx);
    return true;
}
