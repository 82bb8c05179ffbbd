/* Run attention cases, check each against the reference and print one table row per case. */
#ifndef AF_TOOLS_RUN_TABLE_H
#define AF_TOOLS_RUN_TABLE_H
#include <stdio.h>

#include "cli_common.h"
#include "cli_device.h"

/* How a case is computed: af_sdpa directly, or through a provider's plan. */
typedef af_status (*cli_exec_fn)(void *ctx, const af_sdpa_args *args, af_tensor *out);

typedef struct {
    int reps;               /* timed repetitions; the median is reported */
    bool time_reference;    /* also time the double reference (slow) */
    FILE *progress;         /* NULL, or where to say which case is running */
    const cli_device *device;   /* NULL or the CPU: host tensors; CUDA: copies on the device, af_sdpa there, the
                                   output copied back (each timed call ends with a synchronize) */
} cli_run_options;

typedef struct {
    bool ok;                /* computed and within the tolerance */
    double seconds, gflops, reference_seconds, max_error, worst_ratio;
} cli_run_result;

void cli_print_table_header(FILE *f);
/* Random q/k/v of `shape` (NHD-backed views when `nhd`), `exec` them, compare, print a row. */
cli_run_result cli_run_case(FILE *f, const cli_shape *shape, bool nhd, cli_exec_fn exec, void *ctx,
                            const cli_run_options *opt, uint64_t seed);
/* The general form: a call given by descriptors (shape, dtype, strides of query/key/value and attn_mask;
 * data ignored) and its other arguments; random data laid out as described. `label` names the row. */
cli_run_result cli_run_call(FILE *f, const char *label, const af_sdpa_args *call, cli_exec_fn exec, void *ctx,
                            const cli_run_options *opt, uint64_t seed);
af_status cli_exec_sdpa(void *ctx, const af_sdpa_args *args, af_tensor *out);   /* ctx unused */

#endif
