/* What the forward and backward drivers (driver.c, backward.c) both need of tiles and threads: sizes, leading dims,
 * the f32 row loader and how many threads a call's FLOPs pay for. Nothing here depends on the ISA. */
#ifndef AF_KERNEL_TILING_H
#define AF_KERNEL_TILING_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "kernel/ukernel.h"

#define AF_MIN_FLOPS_PER_THREAD 4e6   /* ~40 us of one core: a worker's wake-up and hand-off cost far less */

static inline size_t af_round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

/* ceil(n / d) for n >= 0, d > 0, without forming n + d - 1: a broadcast (stride-0) key may have S near 2^63. */
static inline int64_t af_ceil_div(int64_t n, int64_t d) { return n / d + (n % d != 0); }

/* Leading dimension of a tile: `floats` rounded up to whole 64-byte lines, then to an odd number of lines, so
 * that a column strip's consecutive rows fall in different L1 sets (a 256- or 512-byte row stride puts a 64-row
 * strip into 8 or 16 of the 64 sets, where it evicts itself; measured: Q·K^T 79-89 -> 93 GFLOP/s on one core). */
static inline int af_tile_ld(size_t floats) {
    const size_t lines = af_round_up(floats, AF_TILE_PAD) / AF_TILE_PAD;
    return (int)((lines | 1) * AF_TILE_PAD);
}

/* Copy `n` elements of `dtype` with element stride `stride` into f32 `dst`. */
static inline void af_load_f32(const af_ukernel *uk, float *dst, const char *src, af_dtype dtype, int64_t stride,
                               int n, size_t elem) {
    if (stride == 1 && uk->convert) {   /* contiguous: the micro-kernel's converter (F16C, ...) */
        uk->convert(dst, src, dtype, n);
    } else if (dtype == AF_F32 && stride == 1) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    } else if (dtype == AF_F32) {
        for (int i = 0; i < n; i++) dst[i] = *(const float *)(src + (size_t)(i * stride) * elem);
    } else {
        for (int i = 0; i < n; i++) dst[i] = af_load_as_f32(src + (size_t)(i * stride) * elem, dtype);
    }
}

/* Threads a call's `flops` pay for: each must get AF_MIN_FLOPS_PER_THREAD of them, else waking it costs more than it
 * saves (a decode step of a small model called from PyTorch, whose OpenMP threads spin between ops, ran 3x slower on
 * two threads than on one). Results never depend on the thread count. */
static inline int af_threads_worth_waking(double flops) {
    const char *env = getenv("ATTNFORGE_MIN_FLOPS_PER_THREAD");   /* the tests set 0: every call on all threads */
    const double min_flops = env && *env ? atof(env) : AF_MIN_FLOPS_PER_THREAD;
    if (!(min_flops > 0.0)) return 1024;
    const double threads = flops / min_flops;
    return threads < 1.0 ? 1 : threads > 1024.0 ? 1024 : (int)threads;
}

#endif
