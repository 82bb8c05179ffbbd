/* `attnforge bench --device cuda`: af_sdpa on device tensors, TFLOP/s by FA4's formula and, for decode shapes,
 * GB/s of K+V read. */
#ifndef AF_BENCH_BENCH_CUDA_H
#define AF_BENCH_BENCH_CUDA_H
#include <stdbool.h>

#include "cli_common.h"
#include "cli_device.h"

typedef struct {
    int reps;                   /* timed samples per shape (median) */
    bool json, quick, long_shapes;
    bool nhd;                   /* q, k, v as (B,H,L,E) views of (B,L,H,E) memory */
    const cli_shape *one;       /* --shape, or NULL for the default GPU shapes */
    bool dtype_given;           /* the defaults filtered to `dtype` */
    af_dtype dtype;
    bool causal_only;
} bench_cuda_options;

/* Prints the rows; the exit code: 0, or 1 when the spot check or a shape failed. */
int bench_cuda(const bench_cuda_options *o, const cli_device *dev);

#endif
