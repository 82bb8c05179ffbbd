/* `attnforge verify`: every case through its plan on every ISA this machine has, against the reference. */
#include <stdio.h>
#include <string.h>

#include "commands.h"
#include "plan_cases.h"

static void verify_usage(FILE *f) {
    fprintf(f, "usage: attnforge verify [--plan PLAN.json] [--samples SAMPLES.json] [--threads N]\n\n"
               "Runs the cases of `attnforge run` (the same --plan/--samples choices) once on each kernel ISA this\n"
               "CPU and OS support (portable, avx2, avx512, amx), through the plan, and checks every output against the\n"
               "double reference. Prints one table per ISA.\n"
               "Exit status: 0 every case within tolerance on every ISA, 1 one failed, 2 bad usage or an\n"
               "unreadable/malformed file, 3 the samples are not supported or the plan cannot run here.\n");
}

int cmd_verify(int argc, char **argv) {
    const char *plan_path = NULL, *samples_path = NULL;
    for (int i = 1; i < argc; i++) {
        int common = cli_common_option(argc, argv, &i);
        if (common < 0) return 2;
        if (common > 0) {
            if (!strcmp(argv[i - 1], "--isa")) {
                fprintf(stderr, "attnforge verify: runs every ISA; --isa does not apply\n");
                return 2;
            }
            continue;
        }
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            verify_usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--plan") && i + 1 < argc) {
            plan_path = argv[++i];
        } else if (!strcmp(argv[i], "--samples") && i + 1 < argc) {
            samples_path = argv[++i];
        } else {
            fprintf(stderr, "attnforge verify: unknown option or missing value '%s'\n", argv[i]);
            verify_usage(stderr);
            return 2;
        }
    }
    cli_plan_cases cases;
    int code = cli_plan_cases_load(&cases, "attnforge verify", plan_path, samples_path, NULL);
    if (code) {
        cli_plan_cases_free(&cases);
        return code;
    }
    const char *initial_isa = af_get_isa();
    const cli_run_options opt = {.reps = 1, .time_reference = false, .progress = stderr};
    int checks = 0, failures = 0;
    char ran[64] = "";
    printf("attnforge %s, %d threads\n", af_version(), af_get_num_threads());
    cli_plan_cases_print_plan(stdout, &cases);
    for (int i = 0; af_isa_name(i); i++) {
        const char *isa = af_isa_name(i);
        if (!af_isa_available(isa) || af_set_isa(isa) != AF_OK) continue;
        printf("\nisa %s\n", isa);
        cli_print_table_header(stdout);
        for (int c = 0; c < cases.count; c++) {
            cli_run_result r = cli_plan_case_run(stdout, &cases.cases[c], &opt, 1234 + (uint64_t)c);
            fflush(stdout);
            checks++;
            failures += !r.ok;
        }
        snprintf(ran + strlen(ran), sizeof ran - strlen(ran), "%s%s", ran[0] ? ", " : "", isa);
    }
    af_set_isa(initial_isa);
    printf("\n%d of %d checks within tolerance (isa %s)\n", checks - failures, checks, ran);
    cli_plan_cases_free(&cases);
    return failures ? 1 : 0;
}
