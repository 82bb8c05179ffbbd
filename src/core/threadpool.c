#include "core/threadpool.h"

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "core/alloc.h"
#include "core/cpu.h"
#include "core/status.h"

#define MAX_WORKERS 255

typedef struct {
    af_task_fn fn;
    void *ctx;
    int64_t n;
    atomic_llong next;        /* next item to hand out */
    char *scratch;
    size_t scratch_stride;
    int participants;         /* threads taking part, the caller included */
} pool_job;

static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER;    /* held by the caller that owns the pool */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;    /* guards the fields below */
static pthread_cond_t work_ready = PTHREAD_COND_INITIALIZER;
static pthread_cond_t work_done = PTHREAD_COND_INITIALIZER;
static int num_workers;
static unsigned long generation;
static unsigned long born_in[MAX_WORKERS + 1];   /* generation when each worker was made: its first job comes after */
static int workers_pending;
static pool_job *current_job;
static atomic_int requested_threads;   /* 0 = all cores */

void af_set_num_threads(int n) { atomic_store(&requested_threads, n < 0 ? 0 : n); }

int af_get_num_threads(void) {
    int n = atomic_load(&requested_threads);
    if (n <= 0) n = af_cpu()->num_cores;
    return n > MAX_WORKERS + 1 ? MAX_WORKERS + 1 : n;
}

static void run_items(pool_job *job, int slot) {
    void *scratch = job->scratch + (size_t)slot * job->scratch_stride;
    for (;;) {
        int64_t i = atomic_fetch_add(&job->next, 1);
        if (i >= job->n) break;
        job->fn(job->ctx, i, scratch);
    }
}

static void *worker_main(void *arg) {
    int slot = (int)(intptr_t)arg;   /* 1..num_workers; the caller is slot 0 */
    pthread_mutex_lock(&pool_lock);
    unsigned long seen = born_in[slot];   /* not 0: a worker made after earlier jobs must not take a finished one */
    for (;;) {
        while (generation == seen) pthread_cond_wait(&work_ready, &pool_lock);
        seen = generation;
        pool_job *job = current_job;
        pthread_mutex_unlock(&pool_lock);
        if (slot < job->participants) run_items(job, slot);
        pthread_mutex_lock(&pool_lock);
        if (--workers_pending == 0) pthread_cond_signal(&work_done);
    }
    return NULL;
}

/* Grow the pool to `want` workers; returns how many exist (creation can fail, which only costs speed). */
static int ensure_workers(int want) {
    pthread_mutex_lock(&pool_lock);
    while (num_workers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        born_in[num_workers + 1] = generation;
        int rc = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)(num_workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        num_workers++;
    }
    int have = num_workers;
    pthread_mutex_unlock(&pool_lock);
    return have;
}

af_status af_parallel_for(int64_t n, af_task_fn fn, void *ctx, size_t scratch_bytes) {
    return af_parallel_for_at_most(n, INT_MAX, fn, ctx, scratch_bytes);
}

af_status af_parallel_for_at_most(int64_t n, int max_threads, af_task_fn fn, void *ctx, size_t scratch_bytes) {
    if (n <= 0) return AF_OK;
    bool own_pool = pthread_mutex_trylock(&pool_busy) == 0;
    int threads = own_pool ? af_get_num_threads() : 1;
    if (threads > max_threads) threads = max_threads > 1 ? max_threads : 1;
    if ((int64_t)threads > n) threads = (int)n;
    if (threads > 1) {
        int have = ensure_workers(threads - 1);
        if (have + 1 < threads) threads = have + 1;
    }

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
    pool_job job = {.fn = fn, .ctx = ctx, .n = n, .scratch = scratch, .scratch_stride = stride,
                    .participants = threads};
    atomic_init(&job.next, 0);
    if (threads > 1) {
        pthread_mutex_lock(&pool_lock);
        current_job = &job;
        workers_pending = num_workers;
        generation++;
        pthread_cond_broadcast(&work_ready);
        pthread_mutex_unlock(&pool_lock);
        run_items(&job, 0);
        pthread_mutex_lock(&pool_lock);
        while (workers_pending > 0) pthread_cond_wait(&work_done, &pool_lock);
        current_job = NULL;
        pthread_mutex_unlock(&pool_lock);
    } else {
        run_items(&job, 0);
    }
    af_free(scratch);
    if (own_pool) pthread_mutex_unlock(&pool_busy);
    return AF_OK;
}
