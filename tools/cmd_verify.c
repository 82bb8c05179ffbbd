/* `attnforge verify`: every case through its plan on every ISA this machine has, against the reference. */
#include <stdio.h>
#include <string.h>

#include "cli_device.h"
#include "commands.h"
#include "cli_common.h"
#include "plan_cases.h"

static void verify_usage(FILE *f) {
    fprintf(f, "usage: attnforge verify [--plan PLAN.json] [--samples SAMPLES.json] [--threads N] [--device DEV]\n\n"
               "Runs the cases of `attnforge run` (the same --plan/--samples choices) once on each kernel ISA this\n"
               "CPU and OS support (portable, avx2, avx512, amx), through the plan, and checks every output against the\n"
               "double reference. Prints one table per ISA.\n"
               "  --device cpu|cuda|cuda:N  where the cases run (default cpu). On CUDA: the random inputs are copied\n"
               "                       to the device, the call runs there (through the plan when it is a cuda plan,\n"
               "                       else af_sdpa on the device tensors), the output is copied back and checked\n"
               "                       against the same double reference with the same tolerance; one table.\n"
               "                       Needs libattnforge_cuda.so (ATTNFORGE_CUDA_LIBRARY overrides its path), a\n"
               "                       driver and a GPU; docs/CUDA.md.\n"
               "Exit status: 0 every case within tolerance on every ISA, 1 one failed, 2 bad usage or an\n"
               "unreadable/malformed file, 3 the samples are not supported or the plan (or --device) cannot run\n"
               "here.\n");
}

/* Every case once on the CUDA device. */
static int verify_on_device(const cli_plan_cases *cases, const cli_device *dev) {
    const cli_run_options opt = {.reps = 1, .time_reference = false, .progress = stderr, .device = dev};
    char name[32];
    int failures = 0;
    printf("attnforge %s\n", af_version());
    cli_plan_cases_print_plan(stdout, cases);
    printf("\ndevice %s\n", cli_device_name(dev->device, name, sizeof name));
    cli_print_table_header(stdout);
    for (int c = 0; c < cases->count; c++) {
        cli_run_result r = cli_plan_case_run(stdout, &cases->cases[c], &opt, 1234 + (uint64_t)c);
        fflush(stdout);
        failures += !r.ok;
    }
    printf("\n%d of %d checks within tolerance (device %s)\n", cases->count - failures, cases->count, name);
    return failures ? 1 : 0;
}

int cmd_verify(int argc, char **argv) {
    const char *plan_path = NULL, *samples_path = NULL;
    af_device device = {AF_DEVICE_CPU, 0};
    for (int i = 1; i < argc; i++) {
        const int device_option = cli_device_option(argc, argv, &i, &device, "attnforge verify");
        if (device_option < 0) return 2;
        if (device_option > 0) continue;
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
    cli_device dev;
    int code = cli_device_open(&dev, device, "attnforge verify");
    if (code) return code;
    cli_plan_cases cases;
    code = cli_plan_cases_load(&cases, "attnforge verify", plan_path, samples_path, NULL);
    if (code) {
        cli_plan_cases_free(&cases);
        return code;
    }
    if (cli_device_is_cuda(&dev)) {
        code = verify_on_device(&cases, &dev);
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
