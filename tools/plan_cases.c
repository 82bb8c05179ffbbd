/* Cases for `run` and `verify`: samples -> prepare -> plan -> JSON -> from_json -> infer, end to end. */
#include "plan_cases.h"

#include <stdlib.h>
#include <string.h>

#include "provider/provider.h"

/* The built-in default samples: calls shaped like a small transformer's prefill and decode, MHA and GQA,
 * f32/bf16/f16, plus the shape the core's speed check is stated at. Most are HND views of NHD memory (the
 * copy-free plan); prefill-f16 is plain HND (the copy plan); the GQA ones pass q/k/v by keyword. */
typedef struct {
    cli_shape shape;
    bool nhd;
    af_qkv_source source;
} default_case;

static const default_case default_cases[] = {
    {{"prefill-mha", 1, 8, 8, 256, 256, 64, 64, AF_F32, true}, true, AF_QKV_POSITIONAL},
    {{"prefill-gqa", 1, 8, 2, 256, 256, 64, 64, AF_BF16, true}, true, AF_QKV_KEYWORD},
    {{"prefill-f16", 2, 4, 4, 128, 384, 128, 128, AF_F16, false}, false, AF_QKV_POSITIONAL},
    {{"decode-mha", 1, 8, 8, 1, 2048, 64, 64, AF_F32, false}, true, AF_QKV_POSITIONAL},
    {{"decode-gqa", 1, 32, 8, 1, 4096, 128, 128, AF_BF16, false}, true, AF_QKV_KEYWORD},
    {{"mha-1024", 1, 16, 16, 1024, 1024, 64, 64, AF_F32, false}, true, AF_QKV_POSITIONAL},
};
enum { DEFAULT_CASE_COUNT = sizeof default_cases / sizeof default_cases[0] };

static af_tensor descriptor(af_dtype dtype, int64_t b, int64_t h, int64_t l, int64_t d, bool nhd) {
    const int64_t shape[4] = {b, h, l, d};
    af_tensor t = af_tensor_contiguous(NULL, dtype, 4, shape);
    if (nhd) {   /* x_nhd.transpose(1, 2) */
        t.strides[3] = 1;
        t.strides[1] = d;
        t.strides[2] = h * d;
        t.strides[0] = l * h * d;
    }
    return t;
}

static af_sample_call default_call(const default_case *c, bool nhd, af_qkv_source source, bool causal, bool has_scale,
                                   double scale) {
    const cli_shape *s = &c->shape;
    af_sample_call call;
    memset(&call, 0, sizeof call);
    call.source = source;
    call.query = descriptor(s->dtype, s->B, s->Hq, s->L, s->E, nhd);
    call.key = descriptor(s->dtype, s->B, s->Hkv, s->S, s->E, nhd);
    call.value = descriptor(s->dtype, s->B, s->Hkv, s->S, s->Ev, nhd);
    call.is_causal = causal;
    call.has_scale = has_scale;
    call.scale = scale;
    call.enable_gqa = s->Hq != s->Hkv;
    call.count = 1;
    snprintf(call.device, sizeof call.device, "cpu");
    return call;
}

static int add_provider(cli_plan_cases *cases, af_provider *p) {
    cases->providers[cases->provider_count++] = p;
    return 0;
}

/* to_json -> from_json: what a saved plan restores to. */
static int round_trip(af_provider *prepared, af_provider **restored, const char *command, const char *label,
                      FILE *progress) {
    char *json = NULL;
    af_status st = af_provider_to_json(prepared, &json);
    if (st == AF_OK) st = af_provider_from_json(json, strlen(json), restored);
    if (st != AF_OK) {
        fprintf(stderr, "%s: plan round trip failed: %s\n", command, af_last_error());
        af_free(json);
        return 1;
    }
    if (progress) fprintf(progress, "plan%s%s: %s\n", label ? " for " : "", label ? label : "", json);
    af_free(json);
    return 0;
}

static int prepare_round_trip(const af_samples *samples, af_provider **out, const char *command, const char *label,
                              FILE *progress) {
    *out = NULL;
    af_provider *p = af_provider_new();
    if (!p) {
        fprintf(stderr, "%s: out of memory\n", command);
        return 1;
    }
    if (!af_provider_prepare(p, samples)) {
        fprintf(stderr, "%s: not supported: %s\n", command, af_provider_reason(p));
        af_provider_free(p);
        return 3;
    }
    int code = round_trip(p, out, command, label, progress);
    af_provider_free(p);
    return code;
}

static int load_defaults(cli_plan_cases *cases, const char *command, FILE *progress) {
    for (int i = 0; i < DEFAULT_CASE_COUNT; i++) {
        const default_case *d = &default_cases[i];
        cli_plan_case *c = &cases->cases[cases->count++];
        snprintf(c->label, sizeof c->label, "%s", d->shape.label);
        c->call = default_call(d, d->nhd, d->source, d->shape.causal, false, 0.0);
        af_samples *samples = af_samples_new();
        const af_sdpa_args args = af_sample_call_args(&c->call);
        int code = samples && af_samples_add_call(samples, &args, c->call.source, NULL, 1) == AF_OK ? 0 : 1;
        if (code) fprintf(stderr, "%s: %s: cannot record the sample: %s\n", command, c->label, af_last_error());
        if (!code) code = prepare_round_trip(samples, &c->provider, command, c->label, progress);
        af_samples_free(samples);
        if (code) return code;
        add_provider(cases, c->provider);
    }
    return 0;
}

/* A plan without samples runs the default shapes that fit it, with its arguments and layout. */
static void load_defaults_for_plan(cli_plan_cases *cases, af_provider *provider) {
    af_plan plan;
    af_provider_get_plan(provider, &plan);
    for (int i = 0; i < DEFAULT_CASE_COUNT; i++) {
        const default_case *d = &default_cases[i];
        if ((d->shape.Hq != d->shape.Hkv) != plan.gqa) continue;
        cli_plan_case *c = &cases->cases[cases->count++];
        snprintf(c->label, sizeof c->label, "%s", d->shape.label);
        c->call = default_call(d, plan.copy_free_layout, plan.qkv_source, plan.causal, plan.has_softmax_scale,
                               plan.softmax_scale);
        c->provider = provider;
    }
}

static void load_sample_calls(cli_plan_cases *cases, const af_samples *samples, af_provider *provider) {
    for (size_t i = 0; i < af_samples_count(samples); i++) {
        cli_plan_case *c = &cases->cases[cases->count++];
        snprintf(c->label, sizeof c->label, "samples[%zu]", i);
        c->provider = provider;
        if (af_samples_get_call(samples, i, &c->call) != AF_OK)
            snprintf(c->skipped, sizeof c->skipped, "%s", af_last_error());
    }
}

int cli_plan_cases_load(cli_plan_cases *cases, const char *command, const char *plan_path, const char *samples_path,
                        FILE *progress) {
    memset(cases, 0, sizeof *cases);
    af_samples *samples = NULL;
    af_provider *provider = NULL;
    int code = 0;
    if (samples_path && af_samples_load(samples_path, &samples) != AF_OK) {
        fprintf(stderr, "%s: %s\n", command, af_last_error());
        return 2;
    }
    if (plan_path && af_provider_load(plan_path, &provider) != AF_OK) {
        fprintf(stderr, "%s: %s\n", command, af_last_error());
        af_samples_free(samples);
        return 2;
    }
    const size_t capacity = DEFAULT_CASE_COUNT + af_samples_count(samples);
    cases->cases = calloc(capacity, sizeof *cases->cases);
    cases->providers = calloc(capacity + 1, sizeof *cases->providers);
    if (!cases->cases || !cases->providers) {
        fprintf(stderr, "%s: out of memory\n", command);
        af_provider_free(provider);
        af_samples_free(samples);
        return 1;
    }
    if (!plan_path && !samples_path) {
        code = load_defaults(cases, command, progress);
    } else {
        if (!provider) code = prepare_round_trip(samples, &provider, command, NULL, NULL);
        if (!code) {
            add_provider(cases, provider);
            cases->one_plan = true;
            if (af_provider_load_runtime_dependencies(provider) != AF_OK) {
                fprintf(stderr, "%s: not supported here: %s\n", command, af_last_error());
                code = 3;
            } else if (samples) {
                load_sample_calls(cases, samples, provider);
            } else {
                load_defaults_for_plan(cases, provider);
            }
        }
    }
    af_samples_free(samples);
    return code;
}

void cli_plan_cases_free(cli_plan_cases *cases) {
    for (int i = 0; i < cases->provider_count; i++) af_provider_free(cases->providers[i]);
    free(cases->providers);
    free(cases->cases);
    memset(cases, 0, sizeof *cases);
}

static af_status exec_through_plan(void *ctx, const af_sdpa_args *args, af_tensor *out) {
    const cli_plan_case *c = ctx;
    return af_provider_infer(c->provider, args, c->call.source, out, NULL);
}

cli_run_result cli_plan_case_run(FILE *f, const cli_plan_case *c, const cli_run_options *opt, uint64_t seed) {
    if (c->skipped[0]) {
        fprintf(f, "%-14s skipped: %s\n", c->label, c->skipped);
        return (cli_run_result){0};
    }
    const af_sdpa_args call = af_sample_call_args(&c->call);
    af_plan plan;
    const bool cuda_plan = af_provider_get_plan(c->provider, &plan) == AF_OK && plan.backend == AF_BACKEND_CUDA;
    if (cli_device_is_cuda(opt->device) && !cuda_plan)   /* a CPU plan cannot take device tensors: af_sdpa itself */
        return cli_run_call(f, c->label, &call, cli_exec_sdpa, NULL, opt, seed);
    return cli_run_call(f, c->label, &call, exec_through_plan, (void *)c, opt, seed);
}

void cli_plan_cases_print_plan(FILE *f, const cli_plan_cases *cases) {
    if (!cases->one_plan) return;
    char *json = NULL;
    if (af_provider_to_json(cases->providers[0], &json) == AF_OK)
        fprintf(f, "provider: %s\nplan: %s\n", af_provider_name(cases->providers[0]), json);
    af_free(json);
}

void cli_plan_cases_print_paths(FILE *f, const cli_plan_cases *cases) {
    long plan_calls = 0, general_calls = 0, copies = 0;
    for (int i = 0; i < cases->provider_count; i++) {
        af_provider_stats s = af_provider_get_stats(cases->providers[i]);
        plan_calls += s.plan_calls;
        general_calls += s.general_calls;
        copies += s.copied_tensors;
    }
    fprintf(f, "calls: %ld ran the plan, %ld the general path (not matching the plan); %ld HND->NHD tensor copies\n",
            plan_calls, general_calls, copies);
}
