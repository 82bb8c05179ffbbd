#include "core/worker_pool.h"

#include <pthread.h>
#include <stdint.h>

#define MAX_WORKERS (AF_MAX_THREADS - 1)

typedef struct {
    af_thread_task task;
    void *ctx;
    int participants;         /* indices to run, the caller's 0 included */
} pool_job;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;    /* guards the fields below */
static pthread_cond_t work_ready = PTHREAD_COND_INITIALIZER;
static pthread_cond_t work_done = PTHREAD_COND_INITIALIZER;
static int num_workers;
static unsigned long generation;
static unsigned long born_in[MAX_WORKERS + 1];   /* generation when each worker was made: its first job comes after */
static int workers_pending;
static const pool_job *current_job;

static void *worker_main(void *arg) {
    int slot = (int)(intptr_t)arg;   /* 1..num_workers; the caller is slot 0 */
    pthread_mutex_lock(&pool_lock);
    unsigned long seen = born_in[slot];   /* not 0: a worker made after earlier jobs must not take a finished one */
    for (;;) {
        while (generation == seen) pthread_cond_wait(&work_ready, &pool_lock);
        seen = generation;
        const pool_job *job = current_job;
        pthread_mutex_unlock(&pool_lock);
        if (slot < job->participants) job->task(job->ctx, slot);
        pthread_mutex_lock(&pool_lock);
        if (--workers_pending == 0) pthread_cond_signal(&work_done);
    }
    return NULL;
}

/* fork() copies no worker into the child: it starts with an empty pool (else its first call waits for workers that do
 * not exist, as in a torch.utils.data worker process). pool_lock is held across the fork so that no worker holds it
 * there. */
static void before_fork(void) { pthread_mutex_lock(&pool_lock); }
static void after_fork_in_parent(void) { pthread_mutex_unlock(&pool_lock); }
static void after_fork_in_child(void) {
    pthread_mutex_init(&pool_lock, NULL);
    pthread_cond_init(&work_ready, NULL);
    pthread_cond_init(&work_done, NULL);
    num_workers = 0;
    workers_pending = 0;
    current_job = NULL;
}
static pthread_once_t fork_handlers_once = PTHREAD_ONCE_INIT;
static void install_fork_handlers(void) { pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child); }

/* Grow the pool to `want` workers; returns how many exist (creation can fail, which only costs speed). */
static int ensure_workers(int want) {
    pthread_once(&fork_handlers_once, install_fork_handlers);
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

void af_worker_pool_run(int n_threads, af_thread_task task, void *ctx) {
    if (n_threads > AF_MAX_THREADS) n_threads = AF_MAX_THREADS;
    const int have = n_threads > 1 ? ensure_workers(n_threads - 1) : 0;
    if (have + 1 < n_threads) n_threads = have + 1;
    if (n_threads <= 1) {
        task(ctx, 0);
        return;
    }
    const pool_job job = {.task = task, .ctx = ctx, .participants = n_threads};
    pthread_mutex_lock(&pool_lock);
    current_job = &job;
    workers_pending = num_workers;   /* every worker wakes; those past `participants` only report back */
    generation++;
    pthread_cond_broadcast(&work_ready);
    pthread_mutex_unlock(&pool_lock);
    task(ctx, 0);
    pthread_mutex_lock(&pool_lock);
    while (workers_pending > 0) pthread_cond_wait(&work_done, &pool_lock);
    current_job = NULL;
    pthread_mutex_unlock(&pool_lock);
}
