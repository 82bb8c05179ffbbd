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

/* "B,Hq,Hkv,L,S,E,Ev" of a 4-D call, else each tensor's shape. */
static void shape_text_of(const af_sdpa_args *c, char *text, size_t size) {
    const af_tensor *q = c->query, *k = c->key, *v = c->value;
    if (q->ndim == 4 && k->ndim == 4 && v->ndim == 4) {
        snprintf(text, size, "%lld,%lld,%lld,%lld,%lld,%lld,%lld", (long long)q->shape[0], (long long)q->shape[1],
                 (long long)k->shape[1], (long long)q->shape[2], (long long)k->shape[2], (long long)q->shape[3],
                 (long long)v->shape[3]);
        return;
    }
    size_t used = 0;
    const af_tensor *t[3] = {q, k, v};
    for (int i = 0; i < 3 && used < size; i++) {
        used += (size_t)snprintf(text + used, size - used, i ? "/(" : "(");
        for (int d = 0; d < t[i]->ndim && used < size; d++)
            used += (size_t)snprintf(text + used, size - used, d ? ",%lld" : "%lld", (long long)t[i]->shape[d]);
        if (used < size) used += (size_t)snprintf(text + used, size - used, ")");
    }
}

cli_run_result cli_run_case(FILE *f, const cli_shape *s, bool nhd, cli_exec_fn exec, void *ctx,
                            const cli_run_options *opt, uint64_t seed) {
    const int64_t qs[4] = {s->B, s->Hq, s->L, s->E}, ks[4] = {s->B, s->Hkv, s->S, s->E}, vs[4] = {s->B, s->Hkv, s->S, s->Ev};
    af_tensor q = af_tensor_contiguous(NULL, s->dtype, 4, qs), k = af_tensor_contiguous(NULL, s->dtype, 4, ks),
              v = af_tensor_contiguous(NULL, s->dtype, 4, vs);
    af_tensor *qkv[3] = {&q, &k, &v};
    for (int i = 0; nhd && i < 3; i++) {   /* strides of x_nhd.transpose(1, 2): (L·H·D, D, H·D, 1) */
        af_tensor *t = qkv[i];
        t->strides[3] = 1;
        t->strides[1] = t->shape[3];
        t->strides[2] = t->shape[1] * t->shape[3];
        t->strides[0] = t->shape[2] * t->shape[1] * t->shape[3];
    }
    af_sdpa_args call = {.query = &q, .key = &k, .value = &v, .is_causal = s->causal, .enable_gqa = s->Hq != s->Hkv};
    return cli_run_call(f, s->label, &call, exec, ctx, opt, seed);
}

static int clamp_reps(int reps) {
    return reps < 1 ? 1 : reps > 64 ? 64 : reps;
}

/* The warm-up call (its output is the one checked) and opt->reps timed calls on host tensors. */
static bool run_on_host(FILE *f, const char *label, const char *shape_text, cli_exec_fn exec, void *ctx,
                        const af_sdpa_args *args, af_tensor *out, const cli_run_options *opt, double *seconds) {
    const af_status st = exec(ctx, args, out);
    if (st != AF_OK) {
        fprintf(f, "%-14s %-30s failed: %s: %s\n", label, shape_text, af_status_name(st), af_last_error());
        return false;
    }
    double times[64];
    const int reps = clamp_reps(opt->reps);
    for (int r = 0; r < reps; r++) {
        double t0 = cli_now();
        exec(ctx, args, out);
        times[r] = cli_now() - t0;
    }
    *seconds = cli_median(times, reps);
    return true;
}

/* The same on the device: q/k/v/mask copied there, out allocated there and copied back after the checked call;
 * each timed call is followed by a synchronize so that it measures the kernels, not the enqueueing. */
static bool run_on_device(FILE *f, const char *label, const char *shape_text, cli_exec_fn exec, void *ctx,
                          const af_sdpa_args *args, af_tensor *out, const cli_run_options *opt, double *seconds) {
    const cli_device *d = opt->device;
    cli_device_tensor q, k, v, mask, dout;
    cli_device_tensor *all[5] = {&q, &k, &v, &mask, &dout};
    for (int i = 0; i < 5; i++) memset(all[i], 0, sizeof *all[i]);
    char err[512] = "";
    bool ok = cli_device_tensor_like(d, &q, args->query, true, err, sizeof err);
    ok = ok && cli_device_tensor_like(d, &k, args->key, true, err, sizeof err);
    ok = ok && cli_device_tensor_like(d, &v, args->value, true, err, sizeof err);
    ok = ok && (!args->attn_mask || cli_device_tensor_like(d, &mask, args->attn_mask, true, err, sizeof err));
    ok = ok && cli_device_tensor_like(d, &dout, out, false, err, sizeof err);
    if (!ok) {
        fprintf(f, "%-14s %-30s device memory: %s\n", label, shape_text, err);
    } else {
        af_sdpa_args dargs = *args;
        dargs.query = &q.view;
        dargs.key = &k.view;
        dargs.value = &v.view;
        dargs.attn_mask = args->attn_mask ? &mask.view : NULL;
        const af_status st = exec(ctx, &dargs, &dout.view);
        if (st != AF_OK) {
            fprintf(f, "%-14s %-30s failed: %s: %s\n", label, shape_text, af_status_name(st), af_last_error());
            ok = false;
        }
        ok = ok && cli_device_synchronize(d, dargs.stream, err, sizeof err) &&
             cli_device_tensor_download(d, out, &dout, err, sizeof err);
        if (st == AF_OK && !ok) fprintf(f, "%-14s %-30s after the call: %s\n", label, shape_text, err);
        double times[64];
        const int reps = clamp_reps(opt->reps);
        for (int r = 0; ok && r < reps; r++) {
            const double t0 = cli_now();
            if (exec(ctx, &dargs, &dout.view) != AF_OK) {
                snprintf(err, sizeof err, "%s", af_last_error());
                ok = false;
            } else {
                ok = cli_device_synchronize(d, dargs.stream, err, sizeof err);
            }
            times[r] = cli_now() - t0;
            if (!ok) fprintf(f, "%-14s %-30s timed call: %s\n", label, shape_text, err);
        }
        if (ok) *seconds = cli_median(times, reps);
    }
    for (int i = 0; i < 5; i++) cli_device_tensor_free(d, all[i]);
    return ok;
}

cli_run_result cli_run_call(FILE *f, const char *label, const af_sdpa_args *call, cli_exec_fn exec, void *ctx,
                            const cli_run_options *opt, uint64_t seed) {
    cli_run_result res = {0};
    cli_tensor q, k, v, mask, out, ref;
    memset(&mask, 0, sizeof mask);
    const af_tensor *cq = call->query, *ck = call->key, *cv = call->value;
    const bool four_d = cq->ndim == 4 && ck->ndim == 4 && cv->ndim == 4;
    const cli_shape s = {label, cq->shape[0], cq->shape[1], ck->shape[1], cq->shape[2], ck->shape[2], cq->shape[3],
                         cv->shape[3], cq->dtype, call->is_causal};
    const int64_t os[4] = {s.B, s.Hq, s.L, s.Ev};
    const int64_t one[4] = {1, 1, 1, 1};
    /* every allocation is attempted (no short-circuit): each tensor is freed below either way */
    int allocated = (int)cli_tensor_random_like(&q, cq, &seed, 1.0);
    allocated &= (int)cli_tensor_random_like(&k, ck, &seed, 1.0);
    allocated &= (int)cli_tensor_random_like(&v, cv, &seed, 1.0);
    allocated &= (int)(!call->attn_mask || cli_tensor_random_like(&mask, call->attn_mask, &seed, 1.0));
    allocated &= (int)cli_tensor_zeros(&out, cq->dtype, 4, four_d ? os : one);
    allocated &= (int)cli_tensor_zeros(&ref, AF_F32, 4, four_d ? os : one);
    char shape_text[96];
    shape_text_of(call, shape_text, sizeof shape_text);
    if (!allocated) {
        fprintf(f, "%-14s %-30s out of memory for the test tensors\n", label, shape_text);
        goto done;
    }
    af_sdpa_args args = *call;
    args.query = &q.view;
    args.key = &k.view;
    args.value = &v.view;
    args.attn_mask = call->attn_mask ? &mask.view : NULL;
    if (opt->progress) fprintf(opt->progress, "running %s (%s, %s)...\n", label, shape_text, af_dtype_name(s.dtype));
    const bool ran = cli_device_is_cuda(opt->device)
                         ? run_on_device(f, label, shape_text, exec, ctx, &args, &out.view, opt, &res.seconds)
                         : run_on_host(f, label, shape_text, exec, ctx, &args, &out.view, opt, &res.seconds);
    if (!ran) goto done;
    double t0 = cli_now();
    const af_status st = af_reference_f32(&args, &ref.view, NULL);
    res.reference_seconds = cli_now() - t0;
    if (st != AF_OK) {
        fprintf(f, "%-14s %-30s reference failed: %s\n", label, shape_text, af_last_error());
        goto done;
    }
    cli_compare cmp = cli_compare_to_reference(&args, &out.view, &ref.view);
    res.max_error = cmp.max_error;
    res.worst_ratio = cmp.worst_ratio;
    res.gflops = cli_fa4_flops(&s) / res.seconds * 1e-9;
    res.ok = cmp.worst_ratio <= 1.0;
    char ref_ms[32] = "-", speedup[32] = "-";
    if (opt->time_reference) {
        snprintf(ref_ms, sizeof ref_ms, "%.2f", res.reference_seconds * 1e3);
        snprintf(speedup, sizeof speedup, "%.1fx", res.reference_seconds / res.seconds);
    }
    fprintf(f, "%-14s %-30s %-9s %-7s %10.2e %7.3f %10.3f %9.2f %10s %8s%s\n", label, shape_text,
            af_dtype_name(s.dtype), s.causal ? "yes" : "no", res.max_error, res.worst_ratio, res.seconds * 1e3,
            res.gflops, ref_ms, speedup, res.ok ? "" : "  FAIL");
done:
    cli_tensor_free(&q);
    cli_tensor_free(&k);
    cli_tensor_free(&v);
    cli_tensor_free(&mask);
    cli_tensor_free(&out);
    cli_tensor_free(&ref);
    return res;
}
