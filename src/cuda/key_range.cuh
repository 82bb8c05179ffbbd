/* af_key_range (src/sdpa/problem.h) for device code: the keys [*lo, *hi) query row i of L rows over S keys may see,
 * by causal alignment (af_causal) and af_flash_attn's sliding window (left/right -1: unbounded). Both ends are
 * non-decreasing in i, so a block of rows sees keys from its first row's lo to its last row's hi. (The CUDA-core
 * kernel, which holds an af_problem, calls problem.h's helpers directly; the tensor-core kernel's params are not
 * one.) */
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

#endif
