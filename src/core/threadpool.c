#include "core/threadpool.h"

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "core/alloc.h"
#include "core/cpu.h"
#include "core/status.h"
#include "core/worker_pool.h"

typedef struct {
    af_task_fn fn;
    void *ctx;
    int64_t n;
    atomic_llong next;        /* next item to hand out */
    char *scratch;
    size_t scratch_stride;
    int threads;              /* scratch slots: thread indices the executor may run */
} parallel_job;

static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER;       /* held by the call whose work is in flight */
static pthread_mutex_t executor_lock = PTHREAD_MUTEX_INITIALIZER;   /* guards `executor` (copied whole) */
static af_parallel_executor executor;   /* parallel == NULL: attnforge's own worker pool */
static atomic_int requested_threads;   /* 0 = the executor's count, or all cores */

AF_API void af_set_num_threads(int n) { atomic_store(&requested_threads, n < 0 ? 0 : n); }

/* executor_lock is held across fork() so that the child's copy is never left locked by a thread it does not have. (A
 * pool_busy held by another thread at the fork only makes the child's calls run on one thread.) */
static void before_fork(void) { pthread_mutex_lock(&executor_lock); }
static void after_fork(void) { pthread_mutex_unlock(&executor_lock); }
static pthread_once_t fork_handlers_once = PTHREAD_ONCE_INIT;
static void install_fork_handlers(void) { pthread_atfork(before_fork, after_fork, after_fork); }

AF_API void af_set_parallel_executor(const af_parallel_executor *lent) {
    pthread_once(&fork_handlers_once, install_fork_handlers);
    pthread_mutex_lock(&executor_lock);
    if (lent && lent->parallel) executor = *lent;
    else memset(&executor, 0, sizeof executor);
    pthread_mutex_unlock(&executor_lock);
}

static af_parallel_executor current_executor(void) {
    pthread_once(&fork_handlers_once, install_fork_handlers);
    pthread_mutex_lock(&executor_lock);
    const af_parallel_executor e = executor;
    pthread_mutex_unlock(&executor_lock);
    return e;
}

/* af_get_num_threads under a given executor: asked once per call, so one call sees one count. */
static int threads_under(const af_parallel_executor *e) {
    int n = atomic_load(&requested_threads);
    if (n <= 0) n = e->parallel && e->max_threads ? e->max_threads(e->user) : af_cpu()->num_cores;
    return n < 1 ? 1 : n > AF_MAX_THREADS ? AF_MAX_THREADS : n;
}

AF_API int af_get_num_threads(void) {
    const af_parallel_executor e = current_executor();
    return threads_under(&e);
}

static void run_items(parallel_job *job, int slot) {
    void *scratch = job->scratch + (size_t)slot * job->scratch_stride;
    for (;;) {
        int64_t i = atomic_fetch_add(&job->next, 1);
        if (i >= job->n) break;
        job->fn(job->ctx, i, scratch);
    }
}

/* af_thread_task: one thread's share, its scratch slot named by its index. */
static void run_thread(void *ctx, int thread_index) {
    parallel_job *job = ctx;
    if (thread_index >= 0 && thread_index < job->threads) run_items(job, thread_index);
}

af_status af_parallel_for(int64_t n, af_task_fn fn, void *ctx, size_t scratch_bytes) {
    return af_parallel_for_at_most(n, INT_MAX, fn, ctx, scratch_bytes);
}

af_status af_parallel_for_at_most(int64_t n, int max_threads, af_task_fn fn, void *ctx, size_t scratch_bytes) {
    if (n <= 0) return AF_OK;
    bool own_pool = pthread_mutex_trylock(&pool_busy) == 0;
    const af_parallel_executor e = current_executor();
    int threads = own_pool ? threads_under(&e) : 1;
    if (threads > max_threads) threads = max_threads > 1 ? max_threads : 1;
    if ((int64_t)threads > n) threads = (int)n;

    size_t stride = (scratch_bytes + 63) & ~(size_t)63;
    char *scratch = NULL;
    if (stride > 0) {
        if (stride > SIZE_MAX / (size_t)threads || !(scratch = af_alloc(stride * (size_t)threads))) {
            if (own_pool) pthread_mutex_unlock(&pool_busy);
            return af_fail(AF_ERR_NO_MEMORY, "out of memory: %zu bytes of per-thread working memory for %d threads",
                           stride, threads);
        }
    }
    for (int t = 0; t < threads && scratch; t++) memset(scratch + (size_t)t * stride, 0, stride < 64 ? stride : 64);
    parallel_job job = {.fn = fn, .ctx = ctx, .n = n, .scratch = scratch, .scratch_stride = stride, .threads = threads};
    atomic_init(&job.next, 0);
    if (threads > 1) {
        if (e.parallel) e.parallel(threads, run_thread, &job, e.user);
        else af_worker_pool_run(threads, run_thread, &job);
    }
    run_items(&job, 0);   /* all of it on one thread; after an executor, whatever a short team left (slot 0 is free) */
    af_free(scratch);
    if (own_pool) pthread_mutex_unlock(&pool_busy);
    return AF_OK;
}
