/* Shared by the `attnforge` subcommands: random test tensors, timing, FLOP counts, comparison with the reference. */
#ifndef AF_TOOLS_CLI_COMMON_H
#define AF_TOOLS_CLI_COMMON_H
#include <stdbool.h>
#include <stdint.h>

#include "attnforge.h"

/* One attention shape as the tools describe it. */
typedef struct {
    const char *label;
    int64_t B, Hq, Hkv, L, S, E, Ev;
    af_dtype dtype;
    bool causal;
} cli_shape;

/* A tensor that owns its memory (64-byte aligned), filled with uniform values in [-amplitude, amplitude). */
typedef struct {
    af_tensor view;
    void *memory;
} cli_tensor;

/* shape[4] in HND order; nhd = true lays it out as x_nhd.transpose(1, 2) (copy-free for the provider). */
bool cli_tensor_random(cli_tensor *t, af_dtype dtype, const int64_t shape[4], bool nhd, uint64_t *seed, double amplitude);
bool cli_tensor_zeros(cli_tensor *t, af_dtype dtype, int ndim, const int64_t *shape);
/* A tensor laid out as `desc` describes (shape, dtype, non-negative strides; desc->data and desc->device are ignored:
 * the memory is the host's): memory for
 * every element the strides reach, uniform in [-amplitude, amplitude) (bool: true with probability 0.8).
 * false when the strides are negative or the span is absurd (over 2^34 bytes) or memory runs out. */
bool cli_tensor_random_like(cli_tensor *t, const af_tensor *desc, uint64_t *seed, double amplitude);
void cli_tensor_free(cli_tensor *t);

double cli_now(void);   /* monotonic seconds */
/* FA4's FLOP count: 2·B·Hq·L·S'·(E+Ev), S' = mean keys seen per row (top-left causal when `causal`). */
double cli_fa4_flops(const cli_shape *s);
/* Max |out - ref| and the share of it in the accepted bound (<= 1 passes); ref is the f32 reference. */
typedef struct { double max_error, worst_ratio; } cli_compare;
cli_compare cli_compare_to_reference(const af_sdpa_args *args, const af_tensor *out, const af_tensor *ref_f32);
int cli_parse_dtype(const char *text, af_dtype *out);
double cli_median(double *values, int n);
/* Common options: returns 1 and consumes argv[*i] (and its value) when it is --threads N or --isa NAME;
 * -1 on a bad value (message printed); 0 when not a common option. */
int cli_common_option(int argc, char **argv, int *i);

#endif
