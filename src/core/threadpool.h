/* The library's parallel-for: items over threads of attnforge's own worker pool (worker_pool.c) or of the executor
 * the embedding program lent (af_set_parallel_executor); no thread creation per call either way. */
#ifndef AF_CORE_THREADPOOL_H
#define AF_CORE_THREADPOOL_H
#include <stddef.h>
#include <stdint.h>

#include "attnforge.h"

typedef void (*af_task_fn)(void *ctx, int64_t item, void *scratch);

/* Run fn(ctx, i, scratch) for every i in [0, n), items handed out in increasing order to up to
 * af_get_num_threads() threads (the caller is one of them). Each thread gets its own 64-byte aligned
 * scratch of scratch_bytes, kept for all the items it runs in this call; its first 64 bytes (or all of it, if
 * smaller) start zeroed — room for state a thread carries from item to item. Returns AF_ERR_NO_MEMORY, having
 * run nothing, when scratch cannot be had.
 * A call made while another call holds the pool runs on the calling thread alone. An executor that runs fewer thread
 * indices than asked (a nested OpenMP region's team of one) loses nothing: the caller runs what is left after it. */
af_status af_parallel_for(int64_t n, af_task_fn fn, void *ctx, size_t scratch_bytes);

/* af_parallel_for on at most max_threads threads (>= 1): work too small to pay for waking a worker stays on the
 * caller, where another library's spinning threads (PyTorch's OpenMP pool) cannot slow it down. */
af_status af_parallel_for_at_most(int64_t n, int max_threads, af_task_fn fn, void *ctx, size_t scratch_bytes);

#endif
