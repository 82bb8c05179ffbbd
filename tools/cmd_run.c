/* `attnforge run`: run attention cases, check each against the double reference, print a table. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "run_table.h"

/* The built-in default: calls shaped like a small transformer's prefill and decode, MHA and GQA,
 * f32/bf16/f16, plus the shape the core's speed check is stated at. */
static const cli_shape default_cases[] = {
    {"prefill-mha", 1, 8, 8, 256, 256, 64, 64, AF_F32, true},
    {"prefill-gqa", 1, 8, 2, 256, 256, 64, 64, AF_BF16, true},
    {"prefill-f16", 2, 4, 4, 128, 384, 128, 128, AF_F16, false},
    {"decode-mha", 1, 8, 8, 1, 2048, 64, 64, AF_F32, false},
    {"decode-gqa", 1, 32, 8, 1, 4096, 128, 128, AF_BF16, false},
    {"mha-1024", 1, 16, 16, 1024, 1024, 64, 64, AF_F32, false},
};

static void run_usage(FILE *f) {
    fprintf(f, "usage: attnforge run [--reps N] [--threads N] [--isa NAME]\n\n"
               "Runs the built-in default cases with random data, checks each against the double reference\n"
               "(max_err, and of_tol = the share of the stated tolerance used; > 1 fails) and prints time,\n"
               "GFLOP/s by FA4's formula 2·B·Hq·L·S'·(E+Ev) and the speed-up over the reference.\n"
               "Exit status: 0 all within tolerance, 1 a case failed, 2 bad usage.\n");
}

int cmd_run(int argc, char **argv) {
    cli_run_options opt = {.reps = 5, .time_reference = true, .progress = stderr};
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
        } else {
            fprintf(stderr, "attnforge run: unknown option '%s'\n", argv[i]);
            run_usage(stderr);
            return 2;
        }
    }
    printf("attnforge %s, kernel isa %s, %d threads\n", af_version(), af_get_isa(), af_get_num_threads());
    cli_print_table_header(stdout);
    int failures = 0;
    const int n = (int)(sizeof default_cases / sizeof default_cases[0]);
    for (int c = 0; c < n; c++) {
        cli_run_result r = cli_run_case(stdout, &default_cases[c], false, cli_exec_sdpa, NULL, &opt, 1234 + (uint64_t)c);
        fflush(stdout);
        failures += !r.ok;
    }
    printf("%d of %d cases within tolerance\n", n - failures, n);
    return failures ? 1 : 0;
}
