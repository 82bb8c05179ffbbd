/* attnforge's parallel work on the host's OpenMP threads: PyTorch runs its CPU operators on the libgomp it loaded,
 * whose workers spin between operators; attnforge's own pool would then wait for a core. Lending those same threads
 * to libattnforge (af_set_parallel_executor) leaves one set of busy threads in the process. */
#ifndef AFPY_HOST_OPENMP_H
#define AFPY_HOST_OPENMP_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdbool.h>

/* _C.use_host_threads(library) -> (runtime, None) | (None, why): lend libattnforge the GNU OpenMP runtime that
 * `library` (a path, e.g. torch's libtorch_cpu.so) already loaded and resolves GOMP_parallel to, with at::
 * get_num_threads (else the runtime's omp_get_max_threads) as the thread count. Never loads anything: a library not
 * loaded yet, or an OpenMP runtime other than libgomp, gives (None, why) and leaves attnforge's own pool on. */
PyObject *afpy_use_host_threads(PyObject *module, PyObject *arg);
/* _C.stop_host_threads(): attnforge's own pool again. */
PyObject *afpy_stop_host_threads(PyObject *module, PyObject *unused);
/* _C.host_threads() -> path of the runtime lent to libattnforge, or None. */
PyObject *afpy_host_threads(PyObject *module, PyObject *unused);

/* For testing.c: what the lent executor did since the last reset (regions entered, member threads run), and the
 * kernel thread ids of those members while recording (at most capacity; returns how many were stored). */
typedef struct { long regions, members; } afpy_host_counts;
afpy_host_counts afpy_host_openmp_counts(void);
void afpy_host_openmp_record(bool on);   /* on: clear counts and thread ids, then record */
int afpy_host_openmp_thread_ids(long *ids, int capacity);
/* Run fn(ctx, index) on a team of the lent runtime (a region of the host's, not attnforge's own); false when no
 * runtime is lent. For tests that call attnforge from inside the host's parallel region. */
bool afpy_host_openmp_region(int n_threads, void (*fn)(void *ctx, int index), void *ctx);

#endif
