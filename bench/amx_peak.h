/* The AMX bf16 tile loop behind the bench's "amx" ceiling. */
#ifndef AF_BENCH_AMX_PEAK_H
#define AF_BENCH_AMX_PEAK_H
#include <stdbool.h>

/* FLOPs of one loop iteration: 4 tdpbf16ps of 16 × 16 × 32 multiply-adds each. */
#define BENCH_AMX_FLOPS_PER_ITERATION (4.0 * 16 * 16 * 32 * 2)

/* Runs `iterations` iterations on the calling thread; false (nothing run) when this build has no AMX loop. Call
 * only where af_isa_available("amx") is true. */
bool bench_amx_tile_loop(long iterations);
bool bench_amx_tile_loop_built(void);   /* whether this build has the loop (the compiler had -mamx-tile) */

#endif
