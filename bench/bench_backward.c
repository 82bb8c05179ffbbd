/* `attnforge bench --backward`: per shape the forward with its lse (af_sdpa) and the backward (af_sdpa_backward)
 * timed apart, alternating (forward, backward, forward, ...) on the same tensors, each call preceded by a short FMA
 * sample of the row's ceiling (as the main rows), so that each call's share of the peak pairs two measurements taken
 * within a second. FLOPs: FA4's forward count (causal: the keys each row sees), the backward 2.5x that (FA4's
 * convention: five products of the forward's two shapes over the forward's two). */
#include "bench_backward.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>

#include "bench_memory.h"
#include "core/dtype.h"
#include "machine_peak.h"

#define BACKWARD_FLOP_FACTOR 2.5   /* FA4's convention */

typedef struct {
    cli_shape shape;
    cli_tensor q, k, v, out, lse, dout, dq, dk, dv;
    af_sdpa_args args;
    af_backward_inputs in;
    af_gradients grads;
} backward_call;

typedef struct {
    double times[64], cpu[64], peak[64], peak_cpu[64];   /* per timed call */
} phase;

/* ---- tensors */

static bool make_call(backward_call *c, const cli_shape *s, bool nhd, uint64_t seed) {
    const int64_t qs[4] = {s->B, s->Hq, s->L, s->E}, ks[4] = {s->B, s->Hkv, s->S, s->E};
    const int64_t vs[4] = {s->B, s->Hkv, s->S, s->Ev}, os[4] = {s->B, s->Hq, s->L, s->Ev};
    const int64_t ls[3] = {s->B, s->Hq, s->L};
    memset(c, 0, sizeof *c);
    c->shape = *s;
    /* outputs are random too: their layout follows nhd, their values are overwritten */
    if (!cli_tensor_random(&c->q, s->dtype, qs, nhd, &seed, 1.0) ||
        !cli_tensor_random(&c->k, s->dtype, ks, nhd, &seed, 1.0) ||
        !cli_tensor_random(&c->v, s->dtype, vs, nhd, &seed, 1.0) ||
        !cli_tensor_random(&c->dout, s->dtype, os, nhd, &seed, 1.0) ||
        !cli_tensor_random(&c->out, s->dtype, os, nhd, &seed, 0.0) || !cli_tensor_zeros(&c->lse, AF_F32, 3, ls) ||
        !cli_tensor_random(&c->dq, s->dtype, qs, nhd, &seed, 0.0) ||
        !cli_tensor_random(&c->dk, s->dtype, ks, nhd, &seed, 0.0) ||
        !cli_tensor_random(&c->dv, s->dtype, vs, nhd, &seed, 0.0))
        return false;
    c->args = (af_sdpa_args){.query = &c->q.view, .key = &c->k.view, .value = &c->v.view, .is_causal = s->causal,
                             .enable_gqa = s->Hq != s->Hkv};
    c->in = (af_backward_inputs){.out = &c->out.view, .dout = &c->dout.view, .lse = &c->lse.view};
    c->grads = (af_gradients){.dq = &c->dq.view, .dk = &c->dk.view, .dv = &c->dv.view};
    return true;
}

static void free_call(backward_call *c) {
    cli_tensor *all[] = {&c->q, &c->k, &c->v, &c->out, &c->lse, &c->dout, &c->dq, &c->dk, &c->dv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) cli_tensor_free(all[i]);
}

static af_status forward(backward_call *c) { return af_sdpa(&c->args, &c->out.view, &c->lse.view); }
static af_status backward(backward_call *c) { return af_sdpa_backward(&c->args, &c->in, &c->grads); }

/* ---- a cheap spot check of the backward being measured against the double reference */

/* max |x - y| over max |y|, over every element of two tensors of one shape (any strides) */
static double relative_difference(const af_tensor *x, const af_tensor *y) {
    double worst = 0.0, largest = 0.0;
    const size_t elem = af_dtype_size(x->dtype);
    int64_t idx[4];
    for (idx[0] = 0; idx[0] < x->shape[0]; idx[0]++)
        for (idx[1] = 0; idx[1] < x->shape[1]; idx[1]++)
            for (idx[2] = 0; idx[2] < x->shape[2]; idx[2]++)
                for (idx[3] = 0; idx[3] < x->shape[3]; idx[3]++) {
                    int64_t ox = 0, oy = 0;
                    for (int d = 0; d < 4; d++) ox += idx[d] * x->strides[d], oy += idx[d] * y->strides[d];
                    const double a = af_load_as_f32((const char *)x->data + (size_t)ox * elem, x->dtype);
                    const double b = af_load_as_f32((const char *)y->data + (size_t)oy * elem, y->dtype);
                    if (!(fabs(a - b) <= worst)) worst = fabs(a - b);   /* NaN counts as the worst */
                    largest = fmax(largest, fabs(b));
                }
    return largest > 0.0 ? worst / largest : worst;
}

static int spot_check(const bench_backward_options *o) {
    const cli_shape shapes[] = {
        {"check", 1, 4, 2, 77, 133, 64, 64, AF_F32, true},
        {"check", 2, 2, 2, 40, 40, 128, 80, AF_BF16, false},
        {"check", 1, 4, 4, 33, 70, 96, 96, AF_F16, true},
    };
    const int n = (int)(sizeof shapes / sizeof shapes[0]);
    int failures = 0;
    double worst = 0.0;   /* the largest difference as a share of its dtype's limit */
    for (int i = 0; i < n; i++) {
        backward_call c, ref;
        const bool ok = make_call(&c, &shapes[i], o->nhd, 31 + (uint64_t)i) &&
                        make_call(&ref, &shapes[i], o->nhd, 31 + (uint64_t)i) && forward(&c) == AF_OK &&
                        backward(&c) == AF_OK &&
                        af_sdpa_backward_reference(&c.args, &c.in, &ref.grads) == AF_OK;
        /* a wrong kernel misses by O(1); the limits leave room for f32 / half rounding of the gradients */
        const double limit = shapes[i].dtype == AF_F32 ? 1e-4 : 3e-2;
        double diff = ok ? 0.0 : INFINITY;
        if (ok) {
            diff = fmax(diff, relative_difference(&c.dq.view, &ref.dq.view));
            diff = fmax(diff, relative_difference(&c.dk.view, &ref.dk.view));
            diff = fmax(diff, relative_difference(&c.dv.view, &ref.dv.view));
        }
        const double share = diff / limit;
        if (!(share <= worst)) worst = share;
        failures += !(share <= 1.0);
        free_call(&c);
        free_call(&ref);
    }
    if (o->json)
        printf("{\"spot_check\":true,\"backward\":true,\"isa\":\"%s\",\"cases\":%d,\"failures\":%d,"
               "\"worst_ratio\":%.4f}\n", af_get_isa(), n, failures, worst);
    else
        printf("spot check of the backward against the double reference (%s): %d of %d within tolerance, worst %.3f "
               "of the bound\n", af_get_isa(), n - failures, n, worst);
    return failures;
}

/* ---- timing */

static double cpu_seconds(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (double)(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * (double)(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

static bool timed(backward_call *c, af_status (*fn)(backward_call *), phase *p, int r, const char *isa, int threads) {
    p->peak[r] = bench_fma_peak_sample_gflops(isa, threads, &p->peak_cpu[r]);
    const double cpu0 = cpu_seconds(), t0 = cli_now();
    if (fn(c) != AF_OK) return false;
    p->times[r] = cli_now() - t0;
    p->cpu[r] = cpu_seconds() - cpu0;
    return true;
}

static double median_of(const double *values, int n) {
    double sorted[64];
    memcpy(sorted, values, sizeof(double) * (size_t)n);
    return cli_median(sorted, n);
}

/* median over the calls of gflop / (seconds[r] · ceiling[r]) */
static double paired_share(double gflop, const double *seconds, const double *ceiling, int n) {
    double shares[64];
    for (int r = 0; r < n; r++) shares[r] = seconds[r] > 0 && ceiling[r] > 0 ? gflop / seconds[r] / ceiling[r] : 0.0;
    return cli_median(shares, n);
}

/* ---- printing */

typedef struct {
    double seconds, gflops, peak_ratio, peak_gflops, cpu_share;
    double cpu_peak_ratio;   /* FLOPs per CPU-second against the FMA sample's: robust to other processes' load */
} phase_summary;

static phase_summary summarize(const phase *p, double flops, int reps, int threads) {
    phase_summary s = {.seconds = median_of(p->times, reps)};
    s.gflops = flops / s.seconds * 1e-9;
    s.peak_ratio = paired_share(flops * 1e-9, p->times, p->peak, reps);
    s.peak_gflops = median_of(p->peak, reps);
    s.cpu_share = median_of(p->cpu, reps) / s.seconds / threads;
    s.cpu_peak_ratio = paired_share(flops * 1e-9, p->cpu, p->peak_cpu, reps);
    return s;
}

static void print_header(void) {
    printf("%-26s %-8s %-3s %3s %9s %8s %6s %9s %8s %6s %8s %4s %7s\n", "B,Hq,Hkv,L,S,E,Ev", "dtype", "cau", "thr",
           "fwd_ms", "GFLOP/s", "%peak", "bwd_ms", "GFLOP/s", "%peak", "peak", "cpu%", "%pk_cpu");
}

static void print_row(const backward_call *c, bool ok, const phase *fwd, const phase *bwd,
                      const bench_backward_options *o, int reps, int threads) {
    const cli_shape *s = &c->shape;
    const double flops = cli_fa4_flops(s);
    if (o->json && !ok) {
        printf("{\"case\":\"backward\",\"dtype\":\"%s\",\"causal\":%s,\"L\":%lld,\"S\":%lld,\"E\":%lld,\"ok\":false,"
               "\"error\":\"%s\"}\n", af_dtype_name(s->dtype), s->causal ? "true" : "false", (long long)s->L,
               (long long)s->S, (long long)s->E, af_last_error());
        return;
    }
    char shape[64];
    snprintf(shape, sizeof shape, "%lld,%lld,%lld,%lld,%lld,%lld,%lld", (long long)s->B, (long long)s->Hq,
             (long long)s->Hkv, (long long)s->L, (long long)s->S, (long long)s->E, (long long)s->Ev);
    if (!ok) {
        printf("%-26s %-8s %-3s %3d failed: %s\n", shape, af_dtype_name(s->dtype), s->causal ? "yes" : "no", threads,
               af_last_error());
        return;
    }
    const phase_summary f = summarize(fwd, flops, reps, threads);
    const phase_summary b = summarize(bwd, BACKWARD_FLOP_FACTOR * flops, reps, threads);
    if (o->json) {
        printf("{\"case\":\"backward\",\"dtype\":\"%s\",\"causal\":%s,\"B\":%lld,\"Hq\":%lld,\"Hkv\":%lld,\"L\":%lld,"
               "\"S\":%lld,\"E\":%lld,\"Ev\":%lld,\"threads\":%d,\"isa\":\"%s\",\"layout\":\"%s\",\"ok\":true,"
               "\"forward_flops\":%.17g,\"backward_flops\":%.17g,"
               "\"forward_seconds\":%.17g,\"forward_gflops\":%.17g,\"forward_peak_ratio\":%.4f,"
               "\"backward_seconds\":%.17g,\"backward_gflops\":%.17g,\"backward_peak_ratio\":%.4f,"
               "\"forward_cpu_peak_ratio\":%.4f,\"backward_cpu_peak_ratio\":%.4f,"
               "\"seconds\":%.17g,\"gflops\":%.17g,\"peak_gflops\":%.6g,\"cpu_share\":%.4f}\n",
               af_dtype_name(s->dtype), s->causal ? "true" : "false", (long long)s->B, (long long)s->Hq,
               (long long)s->Hkv, (long long)s->L, (long long)s->S, (long long)s->E, (long long)s->Ev, threads,
               af_get_isa(), o->nhd ? "nhd" : "hnd", flops, BACKWARD_FLOP_FACTOR * flops, f.seconds, f.gflops,
               f.peak_ratio, b.seconds, b.gflops, b.peak_ratio, f.cpu_peak_ratio, b.cpu_peak_ratio, f.seconds + b.seconds,
               (1.0 + BACKWARD_FLOP_FACTOR) * flops / (f.seconds + b.seconds) * 1e-9, b.peak_gflops, b.cpu_share);
        return;
    }
    printf("%-26s %-8s %-3s %3d %9.2f %8.1f %5.0f%% %9.2f %8.1f %5.0f%% %8.1f %3.0f%% %6.0f%%\n", shape,
           af_dtype_name(s->dtype), s->causal ? "yes" : "no", threads, f.seconds * 1e3, f.gflops,
           100.0 * f.peak_ratio, b.seconds * 1e3, b.gflops, 100.0 * b.peak_ratio, b.peak_gflops, 100.0 * b.cpu_share,
           100.0 * b.cpu_peak_ratio);
}

/* ---- the command */

static int default_shapes(const bench_backward_options *o, cli_shape *out, int max) {
    static const int64_t lengths_full[] = {2048, 4096}, lengths_quick[] = {1024};
    const int64_t *lengths = o->quick ? lengths_quick : lengths_full;
    const int num_lengths = o->quick ? 1 : 2, max_e = o->quick ? 64 : 128;
    const af_dtype dtypes[] = {AF_F32, AF_BF16};
    int n = 0;
    for (int d = 0; d < 2; d++)
        for (int li = 0; li < num_lengths; li++)
            for (int64_t E = 64; E <= max_e; E += 64)
                for (int causal = 0; causal <= 1; causal++)
                    if (n < max && (!o->dtype_given || dtypes[d] == o->dtype) && (!o->causal_only || causal))
                        out[n++] = (cli_shape){"backward", 1, 16, 16, lengths[li], lengths[li], E, E, dtypes[d],
                                               causal};
    return n;
}

int bench_backward(const bench_backward_options *o, int threads) {
    const int reps = o->reps < 64 ? o->reps : 64;
    cli_shape shapes[16];
    const int n = o->one ? 1 : default_shapes(o, shapes, 16);
    if (o->one) shapes[0] = *o->one;
    double per_cpu = 0.0;
    const char *vector_isa = bench_peak_kind(af_get_isa(), AF_F32);
    const double peak = bench_fma_peak_gflops(vector_isa, threads, &per_cpu);
    if (o->json) {
        printf("{\"machine\":true,\"backward\":true,\"isa\":\"%s\",\"threads\":%d,\"peak_gflops\":%.3f,"
               "\"peak_cpu_gflops\":%.3f}\n", af_get_isa(), threads, peak, per_cpu);
    } else {
        char cpu[128];
        bench_cpu_name(cpu, sizeof cpu);
        printf("attnforge %s bench --backward: isa %s, %d threads, %s\n", af_version(), af_get_isa(), threads, cpu);
        printf("measured now: f32 FMA peak %.1f GFLOP/s (%s loop, %d threads; %.1f per CPU-second)\n", peak,
               vector_isa, threads, per_cpu);
    }
    int failures = spot_check(o);
    if (!o->json) {
        printf("forward (af_sdpa with lse) and backward (af_sdpa_backward) alternate, %d timed each after one "
               "warm-up (medians); GFLOP/s by FA4's count, the backward's 2.5x the forward's; %%peak: the median of "
               "each call against an FMA sample just before it; peak: those samples' median; cpu%%, %%pk_cpu: the backward's "
               "CPU time over wall x threads, its FLOPs per CPU-second against the samples' (robust to load)\n", reps);
        print_header();
    }
    for (int i = 0; i < n; i++) {
        backward_call c;
        phase fwd, bwd;
        const char *isa = bench_peak_kind(af_get_isa(), shapes[i].dtype);
        bool ok = make_call(&c, &shapes[i], o->nhd, 4242 + (uint64_t)i) && forward(&c) == AF_OK &&
                  backward(&c) == AF_OK;   /* the warm-up */
        for (int r = 0; r < reps && ok; r++)
            ok = timed(&c, forward, &fwd, r, isa, threads) && timed(&c, backward, &bwd, r, isa, threads);
        print_row(&c, ok, &fwd, &bwd, o, reps, threads);
        fflush(stdout);
        failures += !ok;
        free_call(&c);
    }
    bench_machine_release();
    return failures;
}
