/* `attnforge bench --device cuda`: each shape's af_sdpa on device tensors, timed between synchronizes (median of
 * --reps samples, each sample enough back-to-back calls to last about SAMPLE_SECONDS), in TFLOP/s by FA4's formula
 * and, for decode shapes, GB/s of K+V read; a spot check against the double reference first. */
#include "bench_cuda.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sdpa/problem.h"

#define DECODE_MAX_L 16
#define SAMPLE_SECONDS 0.02
#define MAX_CALLS_PER_SAMPLE 1000
#define MAX_SHAPES 96

/* ---- shapes: B·H·L = 16·16384 query rows (enough blocks to fill a large GPU), H = 16 */

static int default_shapes(const bench_cuda_options *o, cli_shape *out, int max) {
    int n = 0;
#define ADD(label_, B_, Hq_, Hkv_, L_, S_, E_, dt_, causal_)                                                     \
    do {                                                                                                      \
        if (n < max && (!o->dtype_given || (dt_) == o->dtype) && (!o->causal_only || (causal_)))             \
            out[n++] = (cli_shape){label_, B_, Hq_, Hkv_, L_, S_, E_, E_, dt_, causal_};                      \
    } while (0)
    const int64_t lengths[] = {1024, 2048, 4096, 8192, 16384}, quick_lengths[] = {2048};
    const int64_t *ls = o->quick ? quick_lengths : lengths;
    const int num_lengths = o->quick ? 1 : o->long_shapes ? 5 : 4;
    const af_dtype reduced[] = {AF_BF16, AF_F16};
    for (int d = 0; d < 2; d++)
        for (int64_t E = o->quick ? 128 : 64; E <= 128; E += 64)
            for (int li = 0; li < num_lengths; li++)
                for (int causal = 0; causal <= 1; causal++)
                    ADD("prefill", 16384 / ls[li], 16, 16, ls[li], ls[li], E, reduced[d], causal);
    if (!o->quick) ADD("f32-simt", 1, 16, 16, 1024, 1024, 64, AF_F32, false);   /* the CUDA-core path */
    for (int d = 0; d < 2; d++) {
        if (!o->quick) ADD("decode", 4, 32, 8, 1, 8192, 128, reduced[d], false);
        ADD("decode", 4, 32, 8, 1, 32768, 128, reduced[d], false);
    }
#undef ADD
    return n;
}

/* ---- one shape's tensors, on the host (for the reference) and on the device */

typedef struct {
    cli_tensor q, k, v, out;
    cli_device_tensor dq, dk, dv, dout;
    af_sdpa_args host_args, args;     /* args: the device tensors */
} device_case;

static bool device_case_make(device_case *c, const cli_shape *s, bool nhd, uint64_t seed, const cli_device *dev,
                             char *err, size_t err_size) {
    const int64_t qs[4] = {s->B, s->Hq, s->L, s->E}, ks[4] = {s->B, s->Hkv, s->S, s->E};
    const int64_t vs[4] = {s->B, s->Hkv, s->S, s->Ev}, os[4] = {s->B, s->Hq, s->L, s->Ev};
    memset(c, 0, sizeof *c);
    const bool filled = cli_tensor_random(&c->q, s->dtype, qs, nhd, &seed, 1.0) &&
                        cli_tensor_random(&c->k, s->dtype, ks, nhd, &seed, 1.0) &&
                        cli_tensor_random(&c->v, s->dtype, vs, nhd, &seed, 1.0) && cli_tensor_zeros(&c->out, s->dtype, 4, os);
    if (!filled) {
        snprintf(err, err_size, "out of host memory");
        return false;
    }
    c->host_args = (af_sdpa_args){.query = &c->q.view, .key = &c->k.view, .value = &c->v.view, .is_causal = s->causal,
                                  .enable_gqa = s->Hq != s->Hkv};
    if (!cli_device_tensor_like(dev, &c->dq, &c->q.view, true, err, err_size) ||
        !cli_device_tensor_like(dev, &c->dk, &c->k.view, true, err, err_size) ||
        !cli_device_tensor_like(dev, &c->dv, &c->v.view, true, err, err_size) ||
        !cli_device_tensor_like(dev, &c->dout, &c->out.view, false, err, err_size))
        return false;
    c->args = c->host_args;
    c->args.query = &c->dq.view;
    c->args.key = &c->dk.view;
    c->args.value = &c->dv.view;
    return true;
}

static void device_case_free(device_case *c, const cli_device *dev) {
    cli_tensor *host[4] = {&c->q, &c->k, &c->v, &c->out};
    cli_device_tensor *device[4] = {&c->dq, &c->dk, &c->dv, &c->dout};
    for (int i = 0; i < 4; i++) {
        cli_tensor_free(host[i]);
        cli_device_tensor_free(dev, device[i]);
    }
}

/* `calls` back-to-back calls between two synchronizes: seconds per call, or < 0 with the reason in err. */
static double time_sample(device_case *c, const cli_device *dev, int calls, char *err, size_t err_size) {
    if (!cli_device_synchronize(dev, c->args.stream, err, err_size)) return -1.0;
    const double t0 = cli_now();
    for (int i = 0; i < calls; i++) {
        const af_status st = af_sdpa(&c->args, &c->dout.view, NULL);
        if (st != AF_OK) {
            snprintf(err, err_size, "%s: %s", af_status_name(st), af_last_error());
            return -1.0;
        }
    }
    if (!cli_device_synchronize(dev, c->args.stream, err, err_size)) return -1.0;
    return (cli_now() - t0) / calls;
}

/* ---- the spot check: small shapes of every path against the double reference */

static int spot_check(const bench_cuda_options *o, const cli_device *dev) {
    const cli_shape shapes[] = {
        {"check", 1, 4, 2, 77, 133, 64, 64, AF_BF16, true},     /* tensor cores, GQA, ragged tiles */
        {"check", 2, 2, 2, 40, 40, 128, 80, AF_F16, false},     /* Ev != E */
        {"check", 1, 2, 2, 33, 70, 96, 96, AF_F32, true},       /* the CUDA-core path */
        {"check", 1, 8, 2, 1, 1500, 128, 128, AF_F16, false},   /* decode */
    };
    const int n = (int)(sizeof shapes / sizeof shapes[0]);
    int failures = 0;
    double worst = 0.0;
    for (int i = 0; i < n; i++) {
        const cli_shape *s = &shapes[i];
        device_case c;
        cli_tensor ref;
        memset(&ref, 0, sizeof ref);
        char err[512] = "";
        const int64_t os[4] = {s->B, s->Hq, s->L, s->Ev};
        bool ok = device_case_make(&c, s, o->nhd, 99 + (uint64_t)i, dev, err, sizeof err);
        if (ok && af_sdpa(&c.args, &c.dout.view, NULL) != AF_OK) {
            snprintf(err, sizeof err, "%s", af_last_error());
            ok = false;
        }
        ok = ok && cli_device_synchronize(dev, c.args.stream, err, sizeof err) &&
             cli_device_tensor_download(dev, &c.out.view, &c.dout, err, sizeof err);
        ok = ok && cli_tensor_zeros(&ref, AF_F32, 4, os) && af_reference_f32(&c.host_args, &ref.view, NULL) == AF_OK;
        double ratio = INFINITY;
        if (ok) {
            ratio = cli_compare_to_reference(&c.host_args, &c.out.view, &ref.view).worst_ratio;
            ok = ratio <= 1.0;
        }
        if (ratio > worst) worst = ratio;
        if (!ok && !o->json)
            fprintf(stderr, "attnforge bench: spot check %lld,%lld,%lld,%lld,%lld,%lld,%lld %s: %s\n", (long long)s->B,
                    (long long)s->Hq, (long long)s->Hkv, (long long)s->L, (long long)s->S, (long long)s->E,
                    (long long)s->Ev, af_dtype_name(s->dtype), err[0] ? err : "outside the tolerance");
        failures += !ok;
        device_case_free(&c, dev);
        cli_tensor_free(&ref);
    }
    char name[32];
    cli_device_name(dev->device, name, sizeof name);
    if (o->json)
        printf("{\"spot_check\":true,\"device\":\"%s\",\"cases\":%d,\"failures\":%d,\"worst_ratio\":%.4f}\n", name, n,
               failures, worst);
    else
        printf("spot check against the double reference (%s): %d of %d within tolerance, worst %.3f of the bound\n",
               name, n - failures, n, worst);
    return failures;
}

/* ---- one row */

typedef struct {
    bool ok, decode;
    int calls;                  /* per timed sample */
    double seconds, tflops, gbps;
    char error[512];
} cuda_row;

static cuda_row run_shape(const cli_shape *s, const bench_cuda_options *o, const cli_device *dev, uint64_t seed) {
    cuda_row row = {.decode = s->L <= DECODE_MAX_L, .calls = 1};
    device_case c;
    if (device_case_make(&c, s, o->nhd, seed, dev, row.error, sizeof row.error)) {
        const double first = time_sample(&c, dev, 1, row.error, sizeof row.error);   /* warm-up, and the estimate */
        if (first > 0.0) {
            const double wanted = ceil(SAMPLE_SECONDS / first);
            row.calls = wanted > MAX_CALLS_PER_SAMPLE ? MAX_CALLS_PER_SAMPLE : (int)wanted;
            double times[64];
            const int reps = o->reps < 64 ? o->reps : 64;
            row.ok = true;
            for (int r = 0; row.ok && r < reps; r++) {
                times[r] = time_sample(&c, dev, row.calls, row.error, sizeof row.error);
                row.ok = times[r] > 0.0;
            }
            if (row.ok) row.seconds = cli_median(times, reps);
        } else if (first == 0.0) {
            snprintf(row.error, sizeof row.error, "the clock did not advance over a call");
        }
    }
    device_case_free(&c, dev);
    if (row.ok) {
        row.tflops = cli_fa4_flops(s) / row.seconds * 1e-12;
        const double kv_bytes = (double)(s->B * s->Hkv * s->S * (s->E + s->Ev)) * (double)af_dtype_size(s->dtype);
        if (row.decode) row.gbps = kv_bytes / row.seconds * 1e-9;
    }
    return row;
}

static void print_row(const cli_shape *s, const cuda_row *r, const bench_cuda_options *o, const char *device) {
    if (o->json) {
        printf("{\"case\":\"%s\",\"device\":\"%s\",\"layout\":\"%s\",\"dtype\":\"%s\",\"causal\":%s,\"B\":%lld,"
               "\"Hq\":%lld,\"Hkv\":%lld,\"L\":%lld,\"S\":%lld,\"E\":%lld,\"Ev\":%lld,\"ok\":%s", s->label, device,
               o->nhd ? "nhd" : "hnd", af_dtype_name(s->dtype), s->causal ? "true" : "false", (long long)s->B,
               (long long)s->Hq, (long long)s->Hkv, (long long)s->L, (long long)s->S, (long long)s->E,
               (long long)s->Ev, r->ok ? "true" : "false");
        if (r->ok) {
            printf(",\"seconds\":%.9g,\"tflops\":%.6g,\"gflops\":%.6g,\"calls_per_sample\":%d", r->seconds, r->tflops,
                   r->tflops * 1e3, r->calls);
            if (r->decode) printf(",\"gbps\":%.6g", r->gbps);
        } else {
            json_t *why = json_string(r->error);
            char *text = json_dumps(why, JSON_ENCODE_ANY);
            printf(",\"error\":%s", text ? text : "\"\"");
            free(text);
            json_decref(why);
        }
        printf("}\n");
        return;
    }
    char shape[64], gbps[16] = "-";
    snprintf(shape, sizeof shape, "%lld,%lld,%lld,%lld,%lld,%lld,%lld", (long long)s->B, (long long)s->Hq,
             (long long)s->Hkv, (long long)s->L, (long long)s->S, (long long)s->E, (long long)s->Ev);
    if (!r->ok) {
        printf("%-9s %-30s %-8s %-3s failed: %s\n", s->label, shape, af_dtype_name(s->dtype), s->causal ? "yes" : "no",
               r->error);
        return;
    }
    if (r->decode) snprintf(gbps, sizeof gbps, "%.1f", r->gbps);
    printf("%-9s %-30s %-8s %-3s %10.3f %9.2f %8s %6d\n", s->label, shape, af_dtype_name(s->dtype),
           s->causal ? "yes" : "no", r->seconds * 1e3, r->tflops, gbps, r->calls);
}

int bench_cuda(const bench_cuda_options *o, const cli_device *dev) {
    cli_shape shapes[MAX_SHAPES];
    int n = 1;
    if (o->one) shapes[0] = *o->one;
    else n = default_shapes(o, shapes, MAX_SHAPES);
    char device[32];
    cli_device_name(dev->device, device, sizeof device);
    if (o->json) {
        printf("{\"machine\":true,\"device\":\"%s\",\"device_count\":%d,\"copy_gbps\":null}\n", device,
               dev->device_count);
    } else {
        printf("attnforge %s bench: device %s (%d CUDA device%s), %d samples per shape (median), each about %.0f ms "
               "of back-to-back calls between synchronizes\n", af_version(), device, dev->device_count,
               dev->device_count == 1 ? "" : "s", o->reps, SAMPLE_SECONDS * 1e3);
        printf("device-to-device copy bandwidth: not measured (the backend interface copies host<->device only); "
               "bench/cuda_compare.py measures it with torch\n");
    }
    const int failures = spot_check(o, dev);
    if (!o->json)
        printf("%-9s %-30s %-8s %-3s %10s %9s %8s %6s\n", "case", "B,Hq,Hkv,L,S,E,Ev", "dtype", "cau", "ms", "TFLOP/s",
               "GB/s", "calls");
    int errors = failures;
    for (int i = 0; i < n; i++) {
        const cuda_row r = run_shape(&shapes[i], o, dev, 4242 + (uint64_t)i);
        print_row(&shapes[i], &r, o, device);
        fflush(stdout);
        errors += !r.ok;
    }
    return errors ? 1 : 0;
}
