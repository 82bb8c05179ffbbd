/* `attnforge plan SAMPLES.json [-o PLAN.json]`: samples -> prepare -> the plan as JSON. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "attnforge.h"
#include "commands.h"

static void plan_usage(FILE *f) {
    fprintf(f, "usage: attnforge plan SAMPLES.json [-o PLAN.json]\n\n"
               "Reads recorded scaled_dot_product_attention calls (docs/FORMATS.md), chooses the one plan that\n"
               "serves them all (docs/PROVIDER.md) and writes it as JSON to stdout, or to PLAN.json with -o.\n"
               "Exit status: 0 a plan was written; 3 the samples are not supported (the reason is on stderr);\n"
               "2 bad usage, or a samples file that cannot be read or is malformed.\n"
               "ATTNFORGE_LOG=debug shows each rejection as the provider logs it.\n");
}

static int write_plan(const char *path, const char *json) {
    FILE *f = path ? fopen(path, "w") : stdout;
    if (!f) {
        fprintf(stderr, "attnforge plan: %s: cannot write: %s\n", path, strerror(errno));
        return 2;
    }
    bool ok = fprintf(f, "%s\n", json) >= 0;
    ok &= path ? fclose(f) == 0 : fflush(f) == 0;
    if (!ok) {
        fprintf(stderr, "attnforge plan: %s: cannot write: %s\n", path ? path : "stdout", strerror(errno));
        return 2;
    }
    return 0;
}

int cmd_plan(int argc, char **argv) {
    const char *samples_path = NULL, *out_path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            plan_usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "-o") || !strcmp(argv[i], "--output")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "attnforge plan: %s needs a file name\n", argv[i]);
                return 2;
            }
            out_path = argv[++i];
        } else if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, "attnforge plan: unknown option '%s'\n", argv[i]);
            plan_usage(stderr);
            return 2;
        } else if (samples_path) {
            fprintf(stderr, "attnforge plan: one samples file, please (got '%s' and '%s')\n", samples_path, argv[i]);
            return 2;
        } else {
            samples_path = argv[i];
        }
    }
    if (!samples_path) {
        fprintf(stderr, "attnforge plan: missing SAMPLES.json\n");
        plan_usage(stderr);
        return 2;
    }
    af_samples *samples;
    if (af_samples_load(samples_path, &samples) != AF_OK) {
        fprintf(stderr, "attnforge plan: %s\n", af_last_error());
        return 2;
    }
    af_provider *provider = af_provider_new();
    int code = 0;
    char *json = NULL;
    if (!provider) {
        fprintf(stderr, "attnforge plan: out of memory\n");
        code = 2;
    } else if (!af_provider_prepare(provider, samples)) {
        fprintf(stderr, "attnforge plan: not supported: %s\n", af_provider_reason(provider));
        code = 3;
    } else if (af_provider_to_json(provider, &json) != AF_OK) {
        fprintf(stderr, "attnforge plan: %s\n", af_last_error());
        code = 2;
    } else {
        code = write_plan(out_path, json);
    }
    af_free(json);
    af_provider_free(provider);
    af_samples_free(samples);
    return code;
}
