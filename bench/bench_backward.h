/* `attnforge bench --backward`: the training step's attention — the forward with its lse (af_sdpa) and the backward
 * (af_sdpa_backward) timed apart on the same tensors, each against the FMA peak sampled just before each call. */
#ifndef AF_BENCH_BACKWARD_H
#define AF_BENCH_BACKWARD_H
#include <stdbool.h>

#include "attnforge.h"
#include "cli_common.h"

typedef struct {
    int reps;
    bool json, quick;
    bool nhd;                 /* q, k, v, out, dout as (B,H,L,E) views of (B,L,H,E) memory */
    const cli_shape *one;     /* NULL: the default shapes; else this one (its dtype and causal) */
    bool dtype_given;         /* the defaults: only `dtype` */
    af_dtype dtype;
    bool causal_only;         /* the defaults: only the causal rows */
} bench_backward_options;

/* Prints the machine row, a spot check against the double reference and one row per shape; returns the number of
 * failed calls or spot-check cases. */
int bench_backward(const bench_backward_options *o, int threads);

#endif
