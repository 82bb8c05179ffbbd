/* The cases `attnforge run` and `attnforge verify` push through a provider: the built-in default samples,
 * a samples file, a plan file, or a plan file applied to a samples file. */
#ifndef AF_TOOLS_PLAN_CASES_H
#define AF_TOOLS_PLAN_CASES_H
#include <stdio.h>

#include "run_table.h"

typedef struct {
    char label[32];
    af_sample_call call;       /* tensor descriptors and the call's other arguments */
    af_provider *provider;     /* the plan it runs through (owned by the list) */
    char skipped[512];         /* non-empty: the sample cannot be made into a call, and why */
} cli_plan_case;

typedef struct {
    cli_plan_case *cases;
    int count;
    af_provider **providers;   /* owned */
    int provider_count;
    bool one_plan;             /* all cases share providers[0] (a samples or plan file) */
} cli_plan_cases;

/* Build the cases. NULL paths: the built-in default, each case its own one-sample plan that goes
 * samples -> prepare -> to_json -> from_json. Plans print to `progress` (NULL: quiet). Returns 0, or the
 * exit code after printing why with `command` first: 2 unreadable or malformed input, 3 not supported. */
int cli_plan_cases_load(cli_plan_cases *cases, const char *command, const char *plan_path, const char *samples_path,
                        FILE *progress);
void cli_plan_cases_free(cli_plan_cases *cases);

/* One table row: the case through its provider (af_provider_infer), checked against the reference. On a CUDA
 * device (opt->device) a case whose plan is a CPU plan runs af_sdpa on the device tensors directly. */
cli_run_result cli_plan_case_run(FILE *f, const cli_plan_case *c, const cli_run_options *opt, uint64_t seed);

/* "provider: NAME" and "plan: JSON" when every case runs one plan (a samples or plan file). */
void cli_plan_cases_print_plan(FILE *f, const cli_plan_cases *cases);

/* "N calls ran the plan, M the general path" over every provider of the list. */
void cli_plan_cases_print_paths(FILE *f, const cli_plan_cases *cases);

#endif
