/* `attnforge`: prepare, run, verify and benchmark attention plans from the command line. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"
#include "commands.h"

static void log_to_stderr(af_log_level level, const char *message, void *user) {
    (void)user;
    const char *name = level >= AF_LOG_ERROR ? "error" : level >= AF_LOG_WARNING ? "warning" : level >= AF_LOG_INFO ? "info" : "debug";
    fprintf(stderr, "attnforge: %s: %s\n", name, message);
}

static void usage(FILE *f) {
    fprintf(f, "usage: attnforge <command> [options]\n\ncommands:\n");
    for (const cli_command *c = cli_commands; c->name; c++) fprintf(f, "  %-8s %s\n", c->name, c->summary);
    fprintf(f, "\n`attnforge <command> --help` describes a command. With no command, `attnforge run` runs the built-in\n"
               "default. `verify` and `bench` take --device cpu|cuda|cuda:N (docs/CUDA.md). Environment:\n"
               "ATTNFORGE_LOG=debug|info|warning, ATTNFORGE_ISA=portable|avx2|avx512|amx, ATTNFORGE_CUDA_LIBRARY=PATH\n"
               "(the CUDA backend, libattnforge_cuda.so).\n");
}

int main(int argc, char **argv) {
    const char *level = getenv("ATTNFORGE_LOG");
    if (level && *level) {
        af_log_level min = !strcmp(level, "debug") ? AF_LOG_DEBUG : !strcmp(level, "info") ? AF_LOG_INFO
                         : !strcmp(level, "error") ? AF_LOG_ERROR : AF_LOG_WARNING;
        af_set_log_callback(log_to_stderr, NULL, min);
    } else {
        af_set_log_callback(log_to_stderr, NULL, AF_LOG_WARNING);   /* the copy-path warning and friends */
    }
    if (argc < 2) return cmd_run(1, (char *[]){"run", NULL});
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version")) {
        printf("attnforge %s\n", af_version());
        return 0;
    }
    for (const cli_command *c = cli_commands; c->name; c++)
        if (!strcmp(argv[1], c->name)) return c->main(argc - 1, argv + 1);
    fprintf(stderr, "attnforge: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}

const cli_command cli_commands[] = {
    {"run", cmd_run, "run attention cases (built-in default, or a plan/samples file) and check them against the reference"},
    {"plan", cmd_plan, "choose one plan for the recorded calls of a samples file and write it as JSON"},
    {"verify", cmd_verify, "check a plan's cases against the reference on every ISA this machine has"},
    {"bench", cmd_bench, "time attention shapes against this machine's measured FMA peak and bandwidth"},
    {NULL, NULL, NULL},
};
