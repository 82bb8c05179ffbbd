/* attnforge's own executor: persistent worker threads woken by a condition variable, made once and reused. */
#ifndef AF_CORE_WORKER_POOL_H
#define AF_CORE_WORKER_POOL_H

#include "attnforge.h"

/* The most threads the pool (and any call) runs on: the caller and this many minus one workers. */
#define AF_MAX_THREADS 256

/* af_parallel_executor's `parallel` over the pool: task(ctx, 0) on the caller, task(ctx, t) for t in
 * [1, n_threads) on workers. Runs fewer indices when workers cannot be made (only speed is lost: the caller of
 * af_parallel_for finishes what is left). One run at a time: af_parallel_for's busy lock serialises the callers. */
void af_worker_pool_run(int n_threads, af_thread_task task, void *ctx);

#endif
