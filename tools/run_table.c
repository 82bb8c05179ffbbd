#include "run_table.h"

#include <string.h>

#include "sdpa/problem.h"

void cli_print_table_header(FILE *f) {
    fprintf(f, "%-14s %-30s %-9s %-7s %10s %7s %10s %9s %10s %8s\n", "case", "B,Hq,Hkv,L,S,E,Ev", "dtype", "causal",
            "max_err", "of_tol", "ms", "GFLOP/s", "ref_ms", "speedup");
}

af_status cli_exec_sdpa(void *ctx, const af_sdpa_args *args, af_tensor *out) {
    (void)ctx;
    return af_sdpa(args, out, NULL);
}

cli_run_result cli_run_case(FILE *f, const cli_shape *s, bool nhd, cli_exec_fn exec, void *ctx,
                            const cli_run_options *opt, uint64_t seed) {
    cli_run_result res = {0};
    cli_tensor q, k, v, out, ref;
    const int64_t qs[4] = {s->B, s->Hq, s->L, s->E}, ks[4] = {s->B, s->Hkv, s->S, s->E}, vs[4] = {s->B, s->Hkv, s->S, s->Ev};
    const int64_t os[4] = {s->B, s->Hq, s->L, s->Ev};
    bool allocated = cli_tensor_random(&q, s->dtype, qs, nhd, &seed, 1.0) & cli_tensor_random(&k, s->dtype, ks, nhd, &seed, 1.0) &
                     cli_tensor_random(&v, s->dtype, vs, nhd, &seed, 1.0) & cli_tensor_zeros(&out, s->dtype, 4, os) &
                     cli_tensor_zeros(&ref, AF_F32, 4, os);
    char shape_text[64];
    snprintf(shape_text, sizeof shape_text, "%lld,%lld,%lld,%lld,%lld,%lld,%lld", (long long)s->B, (long long)s->Hq,
             (long long)s->Hkv, (long long)s->L, (long long)s->S, (long long)s->E, (long long)s->Ev);
    if (!allocated) {
        fprintf(f, "%-14s %-30s out of memory for the test tensors\n", s->label, shape_text);
        goto done;
    }
    af_sdpa_args args = {.query = &q.view, .key = &k.view, .value = &v.view, .is_causal = s->causal,
                         .enable_gqa = s->Hq != s->Hkv};
    if (opt->progress) fprintf(opt->progress, "running %s (%s, %s)...\n", s->label, shape_text, af_dtype_name(s->dtype));
    af_status st = exec(ctx, &args, &out.view);   /* warm-up, and the result we check */
    if (st != AF_OK) {
        fprintf(f, "%-14s %-30s failed: %s: %s\n", s->label, shape_text, af_status_name(st), af_last_error());
        goto done;
    }
    double times[64];
    const int reps = opt->reps < 1 ? 1 : opt->reps > 64 ? 64 : opt->reps;
    for (int r = 0; r < reps; r++) {
        double t0 = cli_now();
        exec(ctx, &args, &out.view);
        times[r] = cli_now() - t0;
    }
    res.seconds = cli_median(times, reps);
    double t0 = cli_now();
    st = af_reference_f32(&args, &ref.view, NULL);
    res.reference_seconds = cli_now() - t0;
    if (st != AF_OK) {
        fprintf(f, "%-14s %-30s reference failed: %s\n", s->label, shape_text, af_last_error());
        goto done;
    }
    cli_compare cmp = cli_compare_to_reference(&args, &out.view, &ref.view);
    res.max_error = cmp.max_error;
    res.worst_ratio = cmp.worst_ratio;
    res.gflops = cli_fa4_flops(s) / res.seconds * 1e-9;
    res.ok = cmp.worst_ratio <= 1.0;
    char ref_ms[32] = "-", speedup[32] = "-";
    if (opt->time_reference) {
        snprintf(ref_ms, sizeof ref_ms, "%.2f", res.reference_seconds * 1e3);
        snprintf(speedup, sizeof speedup, "%.1fx", res.reference_seconds / res.seconds);
    }
    fprintf(f, "%-14s %-30s %-9s %-7s %10.2e %7.3f %10.3f %9.2f %10s %8s%s\n", s->label, shape_text,
            af_dtype_name(s->dtype), s->causal ? "yes" : "no", res.max_error, res.worst_ratio, res.seconds * 1e3,
            res.gflops, ref_ms, speedup, res.ok ? "" : "  FAIL");
done:
    cli_tensor_free(&q);
    cli_tensor_free(&k);
    cli_tensor_free(&v);
    cli_tensor_free(&out);
    cli_tensor_free(&ref);
    return res;
}
