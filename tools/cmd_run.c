/* `attnforge run`: run attention cases through a provider's plan, check each against the double reference,
 * print a table. With no arguments the built-in default samples go end to end:
 * samples -> prepare -> plan -> JSON -> from_json -> infer. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "cli_common.h"
#include "plan_cases.h"

static void run_usage(FILE *f) {
    fprintf(f, "usage: attnforge run [--plan PLAN.json] [--samples SAMPLES.json] [--reps N] [--threads N] [--isa NAME]\n\n"
               "Runs attention cases with random data through a FlashAttention-4 provider plan (af_provider_infer),\n"
               "checks each against the double reference (max_err, and of_tol = the share of the stated tolerance\n"
               "used; > 1 fails) and prints time, GFLOP/s by FA4's formula 2*B*Hq*L*S'*(E+Ev) and the speed-up\n"
               "over the reference.\n\n"
               "  (no file)            the built-in default samples, each prepared into its own plan, written to\n"
               "                       JSON and read back before it runs (the plans are shown on stderr)\n"
               "  --samples S.json     prepare one plan from the samples file, round-trip it through JSON, and run\n"
               "                       every sample through it (random data of the sample's shape and strides)\n"
               "  --plan P.json        run the default shapes that fit the plan, with its arguments and layout\n"
               "  --plan P --samples S run every sample through the saved plan; samples that do not match it take\n"
               "                       the general path (ATTNFORGE_LOG=debug says why)\n"
               "  --reps N             timed repetitions per case (median; default 5)\n\n"
               "Exit status: 0 all within tolerance, 1 a case failed, 2 bad usage or an unreadable/malformed file,\n"
               "3 the samples are not supported or the plan's backend is not available here.\n");
}

int cmd_run(int argc, char **argv) {
    cli_run_options opt = {.reps = 5, .time_reference = true, .progress = stderr};
    const char *plan_path = NULL, *samples_path = NULL;
    for (int i = 1; i < argc; i++) {
        int common = cli_common_option(argc, argv, &i);
        if (common < 0) return 2;
        if (common > 0) continue;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            run_usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
            opt.reps = atoi(argv[++i]);
            if (opt.reps < 1 || opt.reps > 64) {
                fprintf(stderr, "attnforge run: --reps takes 1..64\n");
                return 2;
            }
        } else if (!strcmp(argv[i], "--plan") && i + 1 < argc) {
            plan_path = argv[++i];
        } else if (!strcmp(argv[i], "--samples") && i + 1 < argc) {
            samples_path = argv[++i];
        } else {
            fprintf(stderr, "attnforge run: unknown option or missing value '%s'\n", argv[i]);
            run_usage(stderr);
            return 2;
        }
    }
    cli_plan_cases cases;
    int code = cli_plan_cases_load(&cases, "attnforge run", plan_path, samples_path, opt.progress);
    if (code) {
        cli_plan_cases_free(&cases);
        return code;
    }
    printf("attnforge %s, kernel isa %s, %d threads\n", af_version(), af_get_isa(), af_get_num_threads());
    cli_plan_cases_print_plan(stdout, &cases);
    cli_print_table_header(stdout);
    int failures = 0;
    for (int c = 0; c < cases.count; c++) {
        cli_run_result r = cli_plan_case_run(stdout, &cases.cases[c], &opt, 1234 + (uint64_t)c);
        fflush(stdout);
        failures += !r.ok;
    }
    printf("%d of %d cases within tolerance\n", cases.count - failures, cases.count);
    if (plan_path || samples_path) cli_plan_cases_print_paths(stdout, &cases);
    cli_plan_cases_free(&cases);
    return failures ? 1 : 0;
}
