/* The device-side check of af_flash_attn's index arrays (cu_seqlens_q/k, seqused_k, page_table) on CUDA, where no
 * host reads them: a call stays asynchronous and capture-safe (no synchronisation, no blocking copy). Two parts:
 *   - safety, in the attention kernels themselves: every entry is checked before it is used
 *     (problem.h's af_sequence_checked and af_pages_valid), so a bad index never makes them read or write out of
 *     bounds; a sequence whose keys are bad gets out = NaN and lse = NaN, one whose query rows are bad is skipped;
 *   - the report, here: af_validate_indices_kernel, enqueued on the call's stream before the attention kernels,
 *     checks every rule the CPU path checks on the host and records the first violation in a sticky status word of
 *     the device (af_index_status), which af_cuda_check_errors() reads and clears (docs/API.md, docs/CUDA.md). */
#ifndef AF_CUDA_VALIDATE_INDICES_CUH
#define AF_CUDA_VALIDATE_INDICES_CUH
#include <stdint.h>
#include <stdio.h>

#include "cuda/kernels.h"

#define AF_VALIDATE_THREADS 128
#define AF_VALIDATE_MAX_BLOCKS 65535   /* batches beyond: a block takes every gridDim-th batch */

/* The rules, as the CPU path words them (flash_args.c); 0 = none recorded. */
enum {
    AF_INDEX_OK = 0,
    AF_INDEX_CU_Q_START, AF_INDEX_CU_Q_DECREASING, AF_INDEX_CU_Q_LAST, AF_INDEX_MAX_SEQLEN_Q,
    AF_INDEX_CU_K_START, AF_INDEX_CU_K_DECREASING, AF_INDEX_CU_K_LAST, AF_INDEX_MAX_SEQLEN_K,
    AF_INDEX_SEQUSED, AF_INDEX_PAGE
};

/* The first violation found since the last af_cuda_check_errors: `rule` is claimed by compare-and-swap, then its
 * details are written by the one thread that claimed it. */
typedef struct {
    unsigned int rule;
    long long batch, index, value, bound;
} af_index_status;

AF_DEVICE_GLOBAL af_index_status af_index_status_word;

typedef struct {
    const int32_t *cu_q, *cu_k, *used, *page_table;
    int64_t cu_q_stride, cu_k_stride, used_stride, page_table_stride[2];
    int64_t B, L, S, total_q, total_k, num_pages, page_size;
} af_validate_params;

AF_DEVICE void af_index_report(unsigned int rule, int64_t b, int64_t index, int64_t value, int64_t bound) {
    if (af_atomic_cas(&af_index_status_word.rule, 0u, rule) != 0u) return;   /* an earlier violation stays */
    af_index_status_word.batch = b;
    af_index_status_word.index = index;
    af_index_status_word.value = value;
    af_index_status_word.bound = bound;
}

/* One cu_seqlens array's rules at batch b (first 0, non-decreasing, last == total, lengths <= bound); its length. */
AF_DEVICE int64_t af_validate_cu(const int32_t *cu, int64_t stride, int64_t b, int64_t B, int64_t total,
                                 int64_t bound, unsigned int first_rule, int report) {
    const int64_t lo = cu[b * stride], hi = cu[(b + 1) * stride];
    if (!report) return hi - lo;
    if (b == 0 && lo != 0) af_index_report(first_rule, 0, 0, lo, 0);
    if (hi < lo) af_index_report(first_rule + 1, b, b + 1, hi, lo);
    if (b == B - 1 && hi != total) af_index_report(first_rule + 2, b, B, hi, total);
    if (hi - lo > bound) af_index_report(first_rule + 3, b, b, hi - lo, bound);
    return hi - lo;
}

/* Batch b: thread 0 checks the scalar rules, every thread a share of the pages its used keys span. */
AF_DEVICE void af_validate_batch(const af_validate_params *p, int64_t b) {
    const int report = AF_THREAD_IDX == 0;
    if (p->cu_q) (void)af_validate_cu(p->cu_q, p->cu_q_stride, b, p->B, p->total_q, p->L, AF_INDEX_CU_Q_START, report);
    int64_t keys = p->S;   /* fixed or paged K/V: the key tensor's length or the table's capacity */
    if (p->cu_k) keys = af_validate_cu(p->cu_k, p->cu_k_stride, b, p->B, p->total_k, p->S, AF_INDEX_CU_K_START, report);
    if (p->used) {
        const int64_t used = p->used[b * p->used_stride];
        if (used < 0 || used > keys) {
            if (report) af_index_report(AF_INDEX_SEQUSED, b, b, used, keys < 0 ? 0 : keys);
            keys = used < 0 ? 0 : keys;
        } else {
            keys = used;
        }
        if (p->cu_k && keys > p->S && report) af_index_report(AF_INDEX_MAX_SEQLEN_K, b, b, keys, p->S);
    }
    if (!p->page_table) return;
    const int64_t end = ((keys < p->S ? keys : p->S) + p->page_size - 1) / p->page_size;
    for (int64_t page = AF_THREAD_IDX; page < end; page += AF_BLOCK_DIM) {
        const int32_t index = p->page_table[b * p->page_table_stride[0] + page * p->page_table_stride[1]];
        if (index < 0 || index >= p->num_pages) af_index_report(AF_INDEX_PAGE, b, page, index, p->num_pages);
    }
}

AF_KERNEL(af_validate_indices_kernel, af_validate_params, p, AF_VALIDATE_THREADS) {
    for (int64_t b = AF_BLOCK_IDX_X; b < p.B; b += AF_GRID_DIM_X) af_validate_batch(&p, b);
}

/* Enqueues the check of p's index arrays on `stream` (nothing when the call has none). */
static cudaError_t af_cuda_validate_indices(const af_problem *p, cudaStream_t stream) {
    if (p->B == 0 || !(p->cu_seqlens_q || p->cu_seqlens_k || p->seqused_k || p->page_table)) return cudaSuccess;
    af_validate_params prm;
    prm.cu_q = p->cu_seqlens_q;
    prm.cu_k = p->cu_seqlens_k;
    prm.used = p->seqused_k;
    prm.page_table = p->page_table;
    prm.cu_q_stride = p->cu_seqlens_q_stride;
    prm.cu_k_stride = p->cu_seqlens_k_stride;
    prm.used_stride = p->seqused_k_stride;
    prm.page_table_stride[0] = p->page_table_stride[0];
    prm.page_table_stride[1] = p->page_table_stride[1];
    prm.B = p->B;
    prm.L = p->L;
    prm.S = p->S;
    prm.total_q = p->total_q;
    prm.total_k = p->total_k;
    prm.num_pages = p->num_pages;
    prm.page_size = p->page_size;
    const int grid = (int)(p->B < AF_VALIDATE_MAX_BLOCKS ? p->B : AF_VALIDATE_MAX_BLOCKS);
    return AF_LAUNCH(af_validate_indices_kernel, grid, 1, 1, AF_VALIDATE_THREADS, 0, stream, prm);
}

/* The recorded violation as the CPU path's message (flash_args.c's wording); empty when rule is AF_INDEX_OK. */
static void af_index_status_message(const af_index_status *s, int device, char *err, size_t size) {
    const long long b = s->batch, i = s->index, v = s->value, n = s->bound;
    char rule[512];
    switch (s->rule) {
    case AF_INDEX_CU_Q_START: snprintf(rule, sizeof rule, "cu_seqlens_q: must start at 0, got %lld", v); break;
    case AF_INDEX_CU_Q_DECREASING:
        snprintf(rule, sizeof rule, "cu_seqlens_q: must be non-decreasing, but [%lld] = %lld < [%lld] = %lld", i, v,
                 i - 1, n);
        break;
    case AF_INDEX_CU_Q_LAST:
        snprintf(rule, sizeof rule, "cu_seqlens_q: last entry %lld must equal query's %lld rows", v, n);
        break;
    case AF_INDEX_MAX_SEQLEN_Q:
        snprintf(rule, sizeof rule, "max_seqlen_q: %lld (or query's rows, if fewer), but sequence %lld has %lld query "
                 "rows", n, b, v);
        break;
    case AF_INDEX_CU_K_START: snprintf(rule, sizeof rule, "cu_seqlens_k: must start at 0, got %lld", v); break;
    case AF_INDEX_CU_K_DECREASING:
        snprintf(rule, sizeof rule, "cu_seqlens_k: must be non-decreasing, but [%lld] = %lld < [%lld] = %lld", i, v,
                 i - 1, n);
        break;
    case AF_INDEX_CU_K_LAST:
        snprintf(rule, sizeof rule, "cu_seqlens_k: last entry %lld must equal key's %lld rows", v, n);
        break;
    case AF_INDEX_MAX_SEQLEN_K:
        snprintf(rule, sizeof rule, "max_seqlen_k: %lld (or key's rows, if fewer), but sequence %lld has %lld keys", n,
                 b, v);
        break;
    case AF_INDEX_SEQUSED:
        snprintf(rule, sizeof rule, "seqused_k: [%lld] = %lld is outside [0, %lld], the keys of sequence %lld", b, v, n,
                 b);
        break;
    case AF_INDEX_PAGE:
        snprintf(rule, sizeof rule, "page_table: [%lld, %lld] = %lld is outside [0, num_pages = %lld)", b, i, v, n);
        break;
    default: snprintf(rule, sizeof rule, "unknown rule %u", s->rule); break;
    }
    snprintf(err, size, "%s (found on cuda:%d by the device-side check of an af_flash_attn call enqueued earlier; "
             "the rows of that sequence hold NaN in out and lse, or were not written when its cu_seqlens_q entries "
             "are at fault)", rule, device);
}

#endif
