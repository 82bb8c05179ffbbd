/* af_key_range (src/sdpa/problem.h) for device code: the keys [*lo, *hi) query row i of L rows over S keys may see,
 * by causal alignment (af_causal) and af_flash_attn's sliding window (left/right -1: unbounded). Both ends are
 * non-decreasing in i, so a block of rows sees keys from its first row's lo to its last row's hi. Also the
 * sequences of varlen and paged problems, as problem.h finds them. */
#ifndef AF_CUDA_KEY_RANGE_CUH
#define AF_CUDA_KEY_RANGE_CUH
#include <stdint.h>

#include "cuda/kernels.h"

AF_DEVICE void af_cuda_key_range(int causal, int has_window, int64_t left, int64_t right, int64_t L, int64_t S,
                                 int64_t i, int64_t *lo, int64_t *hi) {
    *lo = 0;
    *hi = S;
    if (causal == AF_CAUSAL_TOP_LEFT) *hi = i + 1 < S ? i + 1 : S;
    if (causal == AF_CAUSAL_BOTTOM_RIGHT) *hi = L - i <= S ? i + 1 + (S - L) : 0;
    if (has_window) {
        const int64_t diagonal = i + (S - L);
        if (left >= 0 && diagonal > left) *lo = diagonal - left;
        if (right >= 0) {
            const int64_t end = right < S - diagonal ? diagonal + right + 1 : S;
            if (end < *hi) *hi = end < 0 ? 0 : end;
        }
    }
    if (*hi < *lo) *hi = *lo;
}

/* af_sequence_of (problem.h) for device code: sequence b's first query row and first key in packed (varlen)
 * tensors, its query rows and its keys (seqused_k when given). */
AF_DEVICE af_sequence af_cuda_sequence(const af_problem *p, int64_t b) {
    af_sequence s = {0, p->L, 0, p->S};
    if (p->cu_seqlens_q) {
        s.q0 = p->cu_seqlens_q[b * p->cu_seqlens_q_stride];
        s.L = p->cu_seqlens_q[(b + 1) * p->cu_seqlens_q_stride] - s.q0;
    }
    if (p->cu_seqlens_k) {
        s.k0 = p->cu_seqlens_k[b * p->cu_seqlens_k_stride];
        s.S = p->cu_seqlens_k[(b + 1) * p->cu_seqlens_k_stride] - s.k0;
    }
    if (p->seqused_k) s.S = p->seqused_k[b * p->seqused_k_stride];
    return s;
}

/* af_kv_row_offset (problem.h) for device code: the element offset of key (or value, by its strides) row j of
 * sequence b, kv head hk, through the page table when K/V are paged. */
AF_DEVICE int64_t af_cuda_kv_row(const af_problem *p, const int64_t *stride, int64_t b, int64_t hk,
                                 const af_sequence *s, int64_t j) {
    if (p->page_table) {
        const int64_t page = p->page_table[b * p->page_table_stride[0] + j / p->page_size * p->page_table_stride[1]];
        return page * stride[0] + hk * stride[1] + j % p->page_size * stride[2];
    }
    return b * stride[0] + hk * stride[1] + (s->k0 + j) * stride[2];
}

#endif
