/* `attnforge bench`: attention speed against the machine's own FMA peak and read bandwidth, measured in the
 * same run, plus the speed-up over the portable kernel and the 1-thread → N-thread scaling. */
#include <jansson.h>
#include <stdio.h>
#include <sys/resource.h>
#include <stdlib.h>
#include <string.h>

#include "bench_backward.h"
#include "bench_cuda.h"
#include "bench_features.h"
#include "bench_memory.h"
#include "cli_common.h"
#include "commands.h"
#include "machine_peak.h"
#include "sdpa/problem.h"

#define DECODE_MAX_L 16

typedef struct {
    cli_shape shape;
    int threads;            /* 0: the configured count; 1: a scaling row */
    bool f8_kv;             /* K/V in the float8 format of --kv-dtype (q in shape.dtype): af_flash_attn on NHD views */
    bool nhd;               /* (B,H,L,E) views of (B,L,H,E) memory whatever --layout says: a (B,S,H,E) K/V cache */
} bench_case;

static af_dtype f8_format = AF_F8E4M3;   /* --kv-dtype */

typedef struct {
    int reps;
    bool json, quick, long_shapes;
    bool nhd;                    /* q, k, v as (B,H,L,E) views of (B,L,H,E) memory: a transformer's layout */
    double portable_max_gflop;   /* skip the portable comparison above this many GFLOP per call */
} bench_options;

typedef struct {
    bench_case c;
    int threads;
    const char *isa;
    bool ok, decode;
    double seconds, gflops, gbps;
    double peak_gflops, peak_gbps;          /* medians of the ceilings sampled before each timed call */
    double peak_ratio, bandwidth_ratio;     /* medians of each call's share of the ceiling sampled just before it */
    double cpu_share;            /* process CPU time / (wall time × threads) over the timed calls: < 1 = preempted
                                    (the machine is shared) or threads idle */
    double cpu_gflops;           /* FLOPs per CPU-second the calls got: one core's rate, robust to preemption */
    double peak_cpu_gflops, cpu_peak_ratio;   /* the FMA samples' FLOPs per CPU-second (median), and the paired ratio */
    double portable_seconds;     /* 0: not run */
    double extra_rss_mib;        /* peak RSS during the calls beyond what was resident before; < 0 unknown */
} bench_row;

/* ---- the machine's ceilings, measured once per (isa, threads) in this run */

typedef struct { char isa[16]; int threads; double value, per_cpu; } ceiling;
static ceiling peaks[8], bandwidths[8];
static int num_peaks, num_bandwidths;

static double fma_peak(const char *isa, int threads, double *per_cpu) {
    for (int i = 0; i < num_peaks; i++)
        if (!strcmp(peaks[i].isa, isa) && peaks[i].threads == threads) {
            if (per_cpu) *per_cpu = peaks[i].per_cpu;
            return peaks[i].value;
        }
    double c = 0.0, v = bench_fma_peak_gflops(isa, threads, &c);
    if (num_peaks < 8) {
        snprintf(peaks[num_peaks].isa, sizeof peaks[0].isa, "%s", isa);
        peaks[num_peaks].threads = threads;
        peaks[num_peaks].per_cpu = c;
        peaks[num_peaks++].value = v;
    }
    if (per_cpu) *per_cpu = c;
    return v;
}

static double read_bandwidth(int threads) {
    for (int i = 0; i < num_bandwidths; i++)
        if (bandwidths[i].threads == threads) return bandwidths[i].value;
    double v = bench_read_bandwidth_gbps(threads, BENCH_BANDWIDTH_BYTES);
    if (num_bandwidths < 8) bandwidths[num_bandwidths++] = (ceiling){"", threads, v, 0.0};
    return v;
}

/* ---- shapes */

static int default_cases(const bench_options *o, af_dtype only_dtype, bool dtype_given, bool causal_only,
                         int threads, bench_case *out, int max) {
    int n = 0;
#define ADD(label_, B_, Hq_, Hkv_, L_, S_, E_, Ev_, dt_, causal_, thr_)                                          \
    do {                                                                                                      \
        if (n < max && (!dtype_given || (dt_) == only_dtype) && (!causal_only || (causal_)))                  \
            out[n++] = (bench_case){{label_, B_, Hq_, Hkv_, L_, S_, E_, Ev_, dt_, causal_}, thr_, false, false}; \
    } while (0)
#define ADD_F8(label_, S_, thr_)                                                                               \
    do {                                                                                                      \
        ADD(label_, 1, 32, 8, 1, S_, 128, 128, AF_F16, false, thr_);                                          \
        if (n > 0 && !strcmp(out[n - 1].shape.label, label_)) out[n - 1].f8_kv = true;                       \
    } while (0)
#define ADD_BSHE(label_, S_, dt_, thr_)                                                                        \
    do {                                                                                                      \
        ADD(label_, 1, 32, 8, 1, S_, 128, 128, dt_, false, thr_);                                             \
        if (n > 0 && !strcmp(out[n - 1].shape.label, label_)) out[n - 1].nhd = true;                         \
    } while (0)
    const int64_t lengths_full[] = {512, 2048, 4096, 8192}, lengths_quick[] = {512, 2048};
    const int64_t *lengths = o->quick ? lengths_quick : lengths_full;
    const int num_lengths = o->quick ? 2 : o->long_shapes ? 4 : 3;
    for (int li = 0; li < num_lengths; li++)
        for (int64_t E = 64; E <= 128; E += 64)
            for (int causal = 0; causal <= 1; causal++)
                ADD("prefill", 1, 16, 16, lengths[li], lengths[li], E, E, AF_F32, causal, 0);
    const af_dtype reduced[] = {AF_BF16, AF_F16};
    for (int d = 0; d < 2; d++)
        for (int li = 1; li < (o->quick ? 2 : 3); li++)   /* L = 2048 (and 4096) */
            for (int causal = 0; causal <= 1; causal++)
                ADD("prefill", 1, 16, 16, lengths[li], lengths[li], 128, 128, reduced[d], causal, 0);
    ADD("decode", 1, 32, 8, 1, 4096, 128, 128, AF_F16, false, 0);
    ADD("decode", 1, 32, 8, 1, 32768, 128, 128, AF_F16, false, 0);
    const char *f8_label = f8_format == AF_F8E5M2 ? "dec-e5m2" : "dec-e4m3";
    ADD_F8(f8_label, 4096, 0);   /* the same decode rows from a float8 K/V cache (--kv-dtype) */
    ADD_F8(f8_label, 32768, 0);
    ADD_BSHE("dec-bshe", 4096, AF_F16, 0);   /* the same decode rows over a (B,S,H,E) cache: heads interleaved */
    ADD_BSHE("dec-bshe", 32768, AF_F16, 0);
    ADD_BSHE("dec-bshe", 32768, AF_BF16, 0);
    ADD_BSHE("dec-bshe", 32768, AF_F32, 0);
    if (threads > 1) {   /* the same shapes on one thread: the scaling figure */
        ADD("1-thread", 1, 16, 16, 2048, 2048, 128, 128, AF_F32, false, 1);
        ADD("1-thread", 1, 16, 16, 2048, 2048, 128, 128, AF_F32, true, 1);
        if (!o->quick) {
            ADD("1-thread", 1, 16, 16, 4096, 4096, 128, 128, AF_F32, false, 1);
            ADD("1-thread", 1, 16, 16, 4096, 4096, 128, 128, AF_F32, true, 1);
        }
        ADD("1-thread", 1, 32, 8, 1, 32768, 128, 128, AF_F16, false, 1);
        ADD_F8(f8_format == AF_F8E5M2 ? "1thr-e5m2" : "1thr-e4m3", 32768, 1);
        ADD_BSHE("1thr-bshe", 32768, AF_F16, 1);
    }
#undef ADD_BSHE
#undef ADD_F8
#undef ADD
    return n;
}

static int parse_shape(const char *text, cli_shape *s) {
    long long v[7];
    char tail;
    if (sscanf(text, "%lld,%lld,%lld,%lld,%lld,%lld,%lld%c", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &tail) != 7)
        return -1;
    for (int i = 0; i < 7; i++)
        if (v[i] < (i == 3 || i == 4 ? 0 : 1)) return -1;
    if (v[1] % v[2]) return -1;
    s->B = v[0], s->Hq = v[1], s->Hkv = v[2], s->L = v[3], s->S = v[4], s->E = v[5], s->Ev = v[6];
    return 0;
}

/* ---- running one row */

typedef struct {
    cli_tensor q, k, v, out;
    af_sdpa_args args;
    bool flash;                       /* float8 K/V: af_flash_attn on NHD views of the same memory (af_sdpa has none) */
    af_tensor nhd[4];                 /* q, k, v, out as (B, L, H, E) views */
    af_flash_args flash_args;
} bench_tensors;

/* A (B, H, L, E) view as FlashAttention's (B, L, H, E): dims 1 and 2 swapped, the same memory. */
static af_tensor as_nhd(const af_tensor *hnd) {
    af_tensor t = *hnd;
    t.shape[1] = hnd->shape[2], t.shape[2] = hnd->shape[1];
    t.strides[1] = hnd->strides[2], t.strides[2] = hnd->strides[1];
    return t;
}

static bool make_tensors(bench_tensors *t, const cli_shape *s, bool f8_kv, bool nhd, uint64_t seed) {
    const int64_t qs[4] = {s->B, s->Hq, s->L, s->E}, ks[4] = {s->B, s->Hkv, s->S, s->E};
    const int64_t vs[4] = {s->B, s->Hkv, s->S, s->Ev}, os[4] = {s->B, s->Hq, s->L, s->Ev};
    const af_dtype kv_dtype = f8_kv ? f8_format : s->dtype;
    memset(t, 0, sizeof *t);
    bool ok = cli_tensor_random(&t->q, s->dtype, qs, nhd, &seed, 1.0) &&
              cli_tensor_random(&t->k, kv_dtype, ks, nhd, &seed, 1.0) &&
              cli_tensor_random(&t->v, kv_dtype, vs, nhd, &seed, 1.0) && cli_tensor_zeros(&t->out, s->dtype, 4, os);
    t->args = (af_sdpa_args){.query = &t->q.view, .key = &t->k.view, .value = &t->v.view, .is_causal = s->causal,
                             .enable_gqa = s->Hq != s->Hkv};
    t->flash = f8_kv;
    if (ok && f8_kv) {
        const cli_tensor *all[4] = {&t->q, &t->k, &t->v, &t->out};
        for (int i = 0; i < 4; i++) t->nhd[i] = as_nhd(&all[i]->view);
        /* bottom-right causality is FlashAttention's; decode rows (L = 1) see every key either way */
        t->flash_args = (af_flash_args){.query = &t->nhd[0], .key = &t->nhd[1], .value = &t->nhd[2],
                                        .causal = s->causal};
    }
    return ok;
}

static af_status call(bench_tensors *t) {
    return t->flash ? af_flash_attn(&t->flash_args, &t->nhd[3], NULL) : af_sdpa(&t->args, &t->out.view, NULL);
}

static void free_tensors(bench_tensors *t) {
    cli_tensor_free(&t->q);
    cli_tensor_free(&t->k);
    cli_tensor_free(&t->v);
    cli_tensor_free(&t->out);
}

static double cpu_seconds(void) {   /* user + system time of the whole process */
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (double)(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * (double)(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

/* The ceilings sampled right before each timed call, so that each call's share of the peak compares two
 * measurements taken within a second of each other (NULL: no sampling). */
typedef struct {
    const char *isa;
    int threads;
    bool bandwidth;            /* decode rows: also one read pass per call */
    double peak[64], peak_cpu[64], gbps[64];   /* per call: GFLOP/s, GFLOP per CPU-second, GB/s */
    double call_cpu[64];                        /* per call: the process CPU seconds it took */
} pairing;

/* Median seconds of `reps` calls after `warmup` untimed ones, each call's time in times[]; < 0 when a call
 * fails. *cpu_per_wall: process CPU time over the summed wall time of the timed calls; *cpu_per_call: their mean
 * CPU time (the sampling in between is not counted). */
static double time_calls(bench_tensors *t, int warmup, int reps, pairing *pair, double *times, double *cpu_per_wall,
                         double *cpu_per_call) {
    double wall = 0.0, cpu = 0.0;
    for (int w = 0; w < warmup; w++)
        if (call(t) != AF_OK) return -1.0;
    for (int r = 0; r < reps; r++) {
        if (pair) {
            pair->peak[r] = bench_fma_peak_sample_gflops(pair->isa, pair->threads, &pair->peak_cpu[r]);
            if (pair->bandwidth) pair->gbps[r] = bench_read_bandwidth_sample_gbps(pair->threads, BENCH_BANDWIDTH_BYTES);
        }
        const double cpu0 = cpu_seconds(), t0 = cli_now();
        if (call(t) != AF_OK) return -1.0;
        times[r] = cli_now() - t0;
        const double call_cpu = cpu_seconds() - cpu0;
        if (pair) pair->call_cpu[r] = call_cpu;
        cpu += call_cpu;
        wall += times[r];
    }
    if (cpu_per_wall) *cpu_per_wall = cpu / wall;
    if (cpu_per_call) *cpu_per_call = cpu / reps;
    double sorted[64];
    memcpy(sorted, times, sizeof(double) * (size_t)reps);
    return cli_median(sorted, reps);
}

/* Median over the calls of (what call r achieved) / (the ceiling sampled just before it). */
static double paired_ratio(double amount_per_call, const double *seconds, const double *ceiling, int reps) {
    double ratios[64];
    for (int r = 0; r < reps; r++)
        ratios[r] = ceiling[r] > 0.0 && seconds[r] > 0.0 ? amount_per_call / seconds[r] / ceiling[r] : 0.0;
    return cli_median(ratios, reps);
}

static bench_row run_case(const bench_case *c, const bench_options *o, int configured_threads, uint64_t seed) {
    bench_row row = {.c = *c, .threads = c->threads ? c->threads : configured_threads, .isa = af_get_isa(),
                     .extra_rss_mib = -1.0};
    const cli_shape *s = &c->shape;
    row.decode = s->L <= DECODE_MAX_L;
    bench_tensors t;
    if (!make_tensors(&t, s, c->f8_kv, o->nhd || c->nhd, seed)) {
        free_tensors(&t);
        return row;
    }
    af_set_num_threads(row.threads);
    if (row.decode) bench_read_bandwidth_sample_gbps(row.threads, BENCH_BANDWIDTH_BYTES);   /* its buffer: resident */
    const double resident = bench_reset_peak_rss_mib();
    double cpu_per_wall = 0.0, cpu_per_call = 0.0, times[64];
    const int reps = o->reps < 64 ? o->reps : 64;
    pairing pair = {.isa = bench_peak_kind(row.isa, s->dtype), .threads = row.threads, .bandwidth = row.decode};
    row.seconds = time_calls(&t, 1, reps, &pair, times, &cpu_per_wall, &cpu_per_call);
    row.cpu_share = cpu_per_wall / row.threads;
    const double peak = bench_peak_rss_mib();
    if (resident >= 0.0 && peak >= 0.0) row.extra_rss_mib = peak - resident;
    row.ok = row.seconds > 0.0;
    const double flops = cli_fa4_flops(s);
    if (row.ok) {
        row.gflops = flops / row.seconds * 1e-9;
        row.peak_ratio = paired_ratio(flops * 1e-9, times, pair.peak, reps);
        double sorted[64];
        memcpy(sorted, pair.peak, sizeof(double) * (size_t)reps);
        row.peak_gflops = cli_median(sorted, reps);
        if (cpu_per_call > 0.0) row.cpu_gflops = flops / cpu_per_call * 1e-9;
        row.cpu_peak_ratio = paired_ratio(flops * 1e-9, pair.call_cpu, pair.peak_cpu, reps);
        memcpy(sorted, pair.peak_cpu, sizeof(double) * (size_t)reps);
        row.peak_cpu_gflops = cli_median(sorted, reps);
        const double kv_bytes = (double)(s->B * s->Hkv * s->S * (s->E + s->Ev)) *
                                (double)af_dtype_size(c->f8_kv ? f8_format : s->dtype);
        if (row.decode) {
            row.gbps = kv_bytes / row.seconds * 1e-9;
            row.bandwidth_ratio = paired_ratio(kv_bytes * 1e-9, times, pair.gbps, reps);
            memcpy(sorted, pair.gbps, sizeof(double) * (size_t)reps);
            row.peak_gbps = cli_median(sorted, reps);
        }
    }
    if (row.ok && strcmp(row.isa, "portable") && flops * 1e-9 <= o->portable_max_gflop) {
        const char *isa = row.isa;
        af_set_isa("portable");
        row.portable_seconds = time_calls(&t, flops < 1e9 ? 1 : 0, flops < 1e9 ? reps : 3, NULL, times, NULL, NULL);
        af_set_isa(isa);
    }
    af_set_num_threads(configured_threads);
    free_tensors(&t);
    return row;
}

/* ---- printing */

static void print_header(void) {
    printf("%-9s %-26s %-8s %-3s %3s %10s %8s %6s %7s %5s %4s %7s %11s %8s %7s\n", "case", "B,Hq,Hkv,L,S,E,Ev",
           "dtype", "cau", "thr", "ms", "GFLOP/s", "%peak", "GB/s", "%bw", "cpu%", "%pk_cpu", "portable_ms", "speedup",
           "+RSS_MiB");
}

/* The dtype column: q's, or "f16/e4m3" for a float8 cache under an f16 q. */
static const char *dtype_text(const bench_case *c, char *buf, size_t size) {
    if (!c->f8_kv) return af_dtype_name(c->shape.dtype);
    const af_dtype q = c->shape.dtype;
    snprintf(buf, size, "%s/%s", q == AF_F32 ? "f32" : q == AF_F16 ? "f16" : "bf16",
             f8_format == AF_F8E5M2 ? "e5m2" : "e4m3");
    return buf;
}

static void print_row(const bench_row *r, const bench_options *o) {
    const cli_shape *s = &r->c.shape;
    char dtype[16];
    if (o->json) {
        json_t *j = json_pack("{s:s, s:s, s:b, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:i, s:s, s:b}", "case", s->label,
                              "dtype", af_dtype_name(s->dtype), "causal", s->causal, "B", (json_int_t)s->B, "Hq",
                              (json_int_t)s->Hq, "Hkv", (json_int_t)s->Hkv, "L", (json_int_t)s->L, "S",
                              (json_int_t)s->S, "E", (json_int_t)s->E, "Ev", (json_int_t)s->Ev, "threads", r->threads,
                              "isa", r->isa, "ok", r->ok);
        json_object_set_new(j, "layout", json_string(o->nhd || r->c.nhd ? "nhd" : "hnd"));
        json_object_set_new(j, "kv_dtype", json_string(af_dtype_name(r->c.f8_kv ? f8_format : s->dtype)));
        json_object_set_new(j, "seconds", json_real(r->seconds));
        json_object_set_new(j, "gflops", json_real(r->gflops));
        json_object_set_new(j, "peak_gflops", json_real(r->peak_gflops));
        json_object_set_new(j, "peak_ratio", json_real(r->peak_ratio));
        json_object_set_new(j, "cpu_share", json_real(r->cpu_share));
        json_object_set_new(j, "cpu_gflops", json_real(r->cpu_gflops));
        json_object_set_new(j, "peak_cpu_gflops", json_real(r->peak_cpu_gflops));
        json_object_set_new(j, "cpu_peak_ratio", json_real(r->cpu_peak_ratio));
        if (r->decode) {
            json_object_set_new(j, "gbps", json_real(r->gbps));
            json_object_set_new(j, "peak_gbps", json_real(r->peak_gbps));
            json_object_set_new(j, "bandwidth_ratio", json_real(r->bandwidth_ratio));
        }
        if (r->portable_seconds > 0) {
            json_object_set_new(j, "portable_seconds", json_real(r->portable_seconds));
            json_object_set_new(j, "speedup_vs_portable", json_real(r->portable_seconds / r->seconds));
        }
        if (r->extra_rss_mib >= 0) json_object_set_new(j, "extra_rss_mib", json_real(r->extra_rss_mib));
        char *text = json_dumps(j, JSON_COMPACT);
        printf("%s\n", text);
        free(text);
        json_decref(j);
        return;
    }
    char shape[64], gbps[16] = "-", bw[16] = "-", port[16] = "-", speedup[16] = "-", rss[16] = "-";
    snprintf(shape, sizeof shape, "%lld,%lld,%lld,%lld,%lld,%lld,%lld", (long long)s->B, (long long)s->Hq,
             (long long)s->Hkv, (long long)s->L, (long long)s->S, (long long)s->E, (long long)s->Ev);
    if (!r->ok) {
        printf("%-9s %-26s %-8s %-3s %3d failed: %s\n", s->label, shape, dtype_text(&r->c, dtype, sizeof dtype),
               s->causal ? "yes" : "no",
               r->threads, af_last_error());
        return;
    }
    if (r->decode) {
        snprintf(gbps, sizeof gbps, "%.1f", r->gbps);
        snprintf(bw, sizeof bw, "%.0f%%", 100.0 * r->bandwidth_ratio);
    }
    if (r->portable_seconds > 0) {
        snprintf(port, sizeof port, "%.1f", r->portable_seconds * 1e3);
        snprintf(speedup, sizeof speedup, "%.1fx", r->portable_seconds / r->seconds);
    } else if (strcmp(r->isa, "portable")) {
        snprintf(port, sizeof port, "skipped");
    }
    if (r->extra_rss_mib >= 0) snprintf(rss, sizeof rss, "%.1f", r->extra_rss_mib);
    printf("%-9s %-26s %-8s %-3s %3d %10.2f %8.1f %5.0f%% %7s %5s %3.0f%% %6.0f%% %11s %8s %7s\n", s->label, shape,
           dtype_text(&r->c, dtype, sizeof dtype), s->causal ? "yes" : "no", r->threads, r->seconds * 1e3, r->gflops,
           100.0 * r->peak_ratio, gbps, bw, 100.0 * r->cpu_share, 100.0 * r->cpu_peak_ratio, port, speedup, rss);
}

/* One row per N-thread/1-thread pair of the same shape: the scaling figure. */
static void print_scaling(const bench_row *rows, int n, const bench_options *o) {
    for (int i = 0; i < n; i++) {
        if (rows[i].c.threads != 1 || !rows[i].ok) continue;
        for (int j = 0; j < n; j++) {
            const cli_shape *a = &rows[i].c.shape, *b = &rows[j].c.shape;
            if (j == i || rows[j].threads <= 1 || !rows[j].ok || rows[i].c.f8_kv != rows[j].c.f8_kv ||
                rows[i].c.nhd != rows[j].c.nhd || a->L != b->L || a->S != b->S || a->E != b->E || a->Hq != b->Hq ||
                a->Hkv != b->Hkv || a->causal != b->causal || a->dtype != b->dtype)
                continue;
            const double speedup = rows[i].seconds / rows[j].seconds;
            /* On idle cores N threads would give N × (their FLOPs per CPU-second / one thread's): what the run can
             * show when other processes hold cores (it hides threads left idle at the end of a call). */
            const double per_cpu = rows[i].cpu_gflops > 0 ? rows[j].threads * rows[j].cpu_gflops / rows[i].cpu_gflops : 0;
            if (o->json) {
                printf("{\"scaling\":true,\"case\":\"%s\",\"L\":%lld,\"S\":%lld,\"E\":%lld,\"causal\":%s,"
                       "\"dtype\":\"%s\",\"threads\":%d,\"speedup_vs_1_thread\":%.3f,\"speedup_per_cpu_second\":%.3f}\n",
                       rows[j].c.shape.label, (long long)a->L, (long long)a->S, (long long)a->E, a->causal ? "true" : "false",
                       af_dtype_name(a->dtype), rows[j].threads, speedup, per_cpu);
            } else {
                char dtype[16];
                printf("  %-9s L=S=%lld/%lld E=%lld %s %s: %d threads %.2fx one thread (%.1f → %.1f GFLOP/s; cpu %.0f%% → "
                       "%.0f%%); from FLOPs per CPU-second %.2fx\n", rows[j].c.shape.label,
                       (long long)a->L, (long long)a->S, (long long)a->E, dtype_text(&rows[j].c, dtype, sizeof dtype),
                       a->causal ? "causal" : "full", rows[j].threads, speedup, rows[i].gflops, rows[j].gflops,
                       100.0 * rows[i].cpu_share, 100.0 * rows[j].cpu_share, per_cpu);
            }
        }
    }
}

/* ---- a cheap correctness spot check of the kernel being measured */

static int spot_check(const bench_options *o) {
    const cli_shape shapes[] = {
        {"check", 1, 4, 2, 77, 133, 64, 64, AF_F32, true},
        {"check", 2, 2, 2, 40, 40, 128, 80, AF_BF16, false},
        {"check", 1, 4, 4, 33, 70, 96, 96, AF_F16, true},
        {"check", 1, 8, 2, 1, 1500, 128, 128, AF_F16, false},
    };
    const int n = (int)(sizeof shapes / sizeof shapes[0]);
    int failures = 0;
    double worst = 0.0;
    for (int i = 0; i < n; i++) {
        const cli_shape *s = &shapes[i];
        bench_tensors t;
        cli_tensor ref;
        const int64_t os[4] = {s->B, s->Hq, s->L, s->Ev};
        bool ok = make_tensors(&t, s, false, o->nhd, 99 + (uint64_t)i) && cli_tensor_zeros(&ref, AF_F32, 4, os) &&
                  af_sdpa(&t.args, &t.out.view, NULL) == AF_OK && af_reference_f32(&t.args, &ref.view, NULL) == AF_OK;
        if (ok) {
            cli_compare c = cli_compare_to_reference(&t.args, &t.out.view, &ref.view);
            ok = c.worst_ratio <= 1.0;
            if (c.worst_ratio > worst) worst = c.worst_ratio;
        }
        failures += !ok;
        free_tensors(&t);
        cli_tensor_free(&ref);
    }
    if (o->json)
        printf("{\"spot_check\":true,\"isa\":\"%s\",\"cases\":%d,\"failures\":%d,\"worst_ratio\":%.4f}\n", af_get_isa(),
               n, failures, worst);
    else
        printf("spot check against the double reference (%s): %d of %d within tolerance, worst %.3f of the bound\n",
               af_get_isa(), n - failures, n, worst);
    return failures;
}

/* ---- the command */

static void bench_usage(FILE *f) {
    fprintf(f,
            "usage: attnforge bench [--shape B,Hq,Hkv,L,S,E,Ev] [--dtype float32|float16|bfloat16] [--causal]\n"
            "                       [--threads N] [--isa NAME] [--reps N] [--quick] [--long] [--json]\n"
            "                       [--portable-max-gflop X] [--layout hnd|nhd] [--device cpu|cuda|cuda:N]\n"
            "                       [--kv-dtype float8_e4m3fn|float8_e5m2]\n"
            "       attnforge bench --features [--features-len N] [--window W] [--dtype D] [--reps N] [--quick]\n"
            "                       [--kv-dtype float8_e4m3fn|float8_e5m2] [--page-size P] [--pair NAME] [--json]\n"
            "       attnforge bench --backward [--shape S] [--dtype D] [--causal] [--quick] [--layout L] [--reps N]\n"
            "                       [--threads N] [--isa NAME] [--json]\n\n"
            "Measures the FMA peak (same ISA and thread count) and the read bandwidth, then times each shape\n"
            "(median of --reps calls, default 5, after one warm-up) and prints GFLOP/s by FA4's formula\n"
            "2·B·Hq·L·S'·(E+Ev) (causal: S' = keys actually seen), the share of the peak, for decode (L <= 16)\n"
            "GB/s of K+V against the bandwidth (both shares: the median over the calls of each call against\n"
            "a short FMA trial / read pass run just before it), the speed-up over the portable kernel (skipped above\n"
            "--portable-max-gflop, default 6, GFLOP per call), and +RSS_MiB (peak RSS during the calls beyond\n"
            "the resident inputs and outputs). Default shapes: prefill H=16, L=S in {512, 2048, 4096} (8192 with\n"
            "--long), E=Ev in {64, 128}, f32 full and causal, bf16/f16 rows; decode L=1, S in {4096, 32768},\n"
            "Hq/Hkv 32/8, E=128, f16, and the same from a float8 K/V cache (dec-e4m3 / dec-e5m2: af_flash_attn, K/V\n"
            "in --kv-dtype, default float8_e4m3fn) and over a (B,S,H,E) cache (dec-bshe: heads interleaved, as a\n"
            "transformer's cache or a paged pool; f16, bf16, f32); and 1-thread rows for the scaling figure.\n"
            "--shape runs one shape (with float8 K/V when --kv-dtype is given);\n"
            "--dtype and --causal select among the defaults otherwise. --json: one JSON object per row.\n"
            "--layout nhd: q, k and v are (B,H,L,E) views of (B,L,H,E) memory, as a transformer's\n"
            "x.view(B, L, H, E).transpose(1, 2) gives (default hnd: contiguous (B,H,L,E)).\n\n"
            "--features times af_flash_attn's features against the plain call each replaces, instead of the shapes\n"
            "above (about 20 s): window (W, 0) against full attention at L=S=N, H=4, E=128; a causal varlen batch of\n"
            "8 sequences (N/4 down to N/64 rows) against the same batch padded to the longest; decode over S=N keys\n"
            "in pages of P keys (--page-size, default 16) in shuffled order against contiguous K/V (B=4, Hq/Hkv 32/8,\n"
            "E=128); decode over S=4N\n"
            "keys from a float8 K/V cache (--kv-dtype) against an f16 (bf16) cache holding the same values (B=1,\n"
            "Hq/Hkv 32/8, E=128, q f16 for float32). N = --features-len (default 8192; 2048 with --quick), W =\n"
            "--window (default 512); float32 and bfloat16 unless --dtype; --pair NAME runs one pair.\n"
            "The two calls of a pair alternate; per pair the median of the per-iteration time ratios (and CPU-time\n"
            "ratios), the work ratio (FLOPs of the keys each row sees; 1 for paged), the issue's target (window\n"
            "<= 0.10, paged <= 1.10, fp8 <= 1/1.8), and how far apart the outputs are where both compute the same\n"
            "rows (share of twice the error bound; over 1 fails). GFLOP/s count only the keys each row sees.\n\n"
            "--backward times the training step's attention instead: per shape the forward with its lse (af_sdpa)\n"
            "and the backward (af_sdpa_backward) alternating, each the median of --reps after one warm-up, GFLOP/s by\n"
            "FA4's count (the backward's 2.5x the forward's) and each call's share of an FMA sample taken just before it,\n"
            "after a spot check of the backward against the double reference. Default shapes: B=1 H=16 L=S in {2048,\n"
            "4096}, E=Ev in {64, 128}, full and causal, float32 and bfloat16 (--quick: L=S=1024, E=64).\n\n"
            "--device cuda[:N] (default cpu) times af_sdpa on tensors in that GPU's memory instead: a spot check of\n"
            "small shapes against the double reference, then per shape the median of --reps samples, each sample\n"
            "back-to-back calls between two synchronizes (about 20 ms), as ms per call, TFLOP/s by the same formula,\n"
            "and GB/s of K+V for decode. Default GPU shapes: prefill bf16/f16, E in {64, 128}, L=S in {1k, 2k, 4k,\n"
            "8k} (16k with --long), full and causal, H=16 and B*L = 16k; one f32 row (the CUDA-core path); decode\n"
            "L=1, S in {8k, 32k}, Hq/Hkv 32/8, B=4. --quick: L=S=2k with E=128 and S=32k decode. --isa and\n"
            "--portable-max-gflop do not apply. Needs libattnforge_cuda.so (ATTNFORGE_CUDA_LIBRARY overrides the\n"
            "path), a driver and a GPU, else exit status 3 with the reason (docs/CUDA.md).\n"
            "Exit status: 0, 1 the spot check or a shape failed, 2 bad usage, 3 the device is not available.\n");
}

int cmd_bench(int argc, char **argv) {
    bench_options o = {.reps = 5, .portable_max_gflop = 6.0};
    cli_shape one = {.label = "shape", .dtype = AF_F32};
    bool have_shape = false, dtype_given = false, causal = false, isa_given = false, features = false;
    bool backward = false;
    af_dtype kv_dtype = AF_F8E4M3;   /* the float8 decode rows' (and the --features fp8 pair's) K/V format */
    bool kv_given = false;
    const char *only_pair = NULL;
    int64_t features_len = 0, window = 512, page_size = 0;
    af_device device = {AF_DEVICE_CPU, 0};
    for (int i = 1; i < argc; i++) {
        const int device_option = cli_device_option(argc, argv, &i, &device, "attnforge bench");
        if (device_option < 0) return 2;
        if (device_option > 0) continue;
        const int common = cli_common_option(argc, argv, &i);
        if (common < 0) return 2;
        if (common > 0) {
            isa_given = isa_given || !strcmp(argv[i - 1], "--isa");
            continue;
        }
        const char *a = argv[i], *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            bench_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            o.json = true;
        } else if (!strcmp(a, "--quick")) {
            o.quick = true;
        } else if (!strcmp(a, "--features")) {
            features = true;
        } else if (!strcmp(a, "--backward")) {
            backward = true;
        } else if ((!strcmp(a, "--features-len") || !strcmp(a, "--window") || !strcmp(a, "--page-size")) && value) {
            char *end;
            const long long n = strtoll(value, &end, 10);
            if (*end || n < 1 || n > (1 << 20)) {
                fprintf(stderr, "attnforge bench: %s takes 1..1048576, got '%s'\n", a, value);
                return 2;
            }
            *(!strcmp(a, "--window") ? &window : !strcmp(a, "--page-size") ? &page_size : &features_len) = n;
            i++;
        } else if (!strcmp(a, "--long")) {
            o.long_shapes = true;
        } else if (!strcmp(a, "--layout") && value) {
            if (strcmp(value, "hnd") && strcmp(value, "nhd")) {
                fprintf(stderr, "attnforge bench: --layout takes hnd or nhd, got '%s'\n", value);
                return 2;
            }
            o.nhd = !strcmp(value, "nhd");
            i++;
        } else if (!strcmp(a, "--causal")) {
            causal = true;
        } else if (!strcmp(a, "--shape") && value) {
            if (parse_shape(value, &one)) {
                fprintf(stderr, "attnforge bench: --shape wants B,Hq,Hkv,L,S,E,Ev (Hq a multiple of Hkv), got '%s'\n", value);
                return 2;
            }
            have_shape = true;
            i++;
        } else if (!strcmp(a, "--dtype") && value) {
            if (cli_parse_dtype(value, &one.dtype)) {
                fprintf(stderr, "attnforge bench: --dtype takes float32, float16 or bfloat16, got '%s'\n", value);
                return 2;
            }
            dtype_given = true;
            i++;
        } else if (!strcmp(a, "--kv-dtype") && value) {
            if (!strcmp(value, "float8_e4m3fn") || !strcmp(value, "e4m3")) kv_dtype = AF_F8E4M3;
            else if (!strcmp(value, "float8_e5m2") || !strcmp(value, "e5m2")) kv_dtype = AF_F8E5M2;
            else {
                fprintf(stderr, "attnforge bench: --kv-dtype takes float8_e4m3fn or float8_e5m2, got '%s'\n", value);
                return 2;
            }
            kv_given = true;
            i++;
        } else if (!strcmp(a, "--pair") && value) {
            if (strcmp(value, "window_vs_full") && strcmp(value, "varlen_vs_padded") &&
                strcmp(value, "paged_vs_contiguous") && strcmp(value, "fp8_vs_f16")) {
                fprintf(stderr, "attnforge bench: --pair takes window_vs_full, varlen_vs_padded, paged_vs_contiguous "
                                "or fp8_vs_f16, got '%s'\n", value);
                return 2;
            }
            only_pair = value;
            i++;
        } else if (!strcmp(a, "--reps") && value) {
            o.reps = atoi(value);
            if (o.reps < 1 || o.reps > 64) {
                fprintf(stderr, "attnforge bench: --reps takes 1..64\n");
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--portable-max-gflop") && value) {
            o.portable_max_gflop = atof(value);
            i++;
        } else {
            fprintf(stderr, "attnforge bench: unknown option or missing value '%s'\n", a);
            bench_usage(stderr);
            return 2;
        }
    }
    if (!features && only_pair) {
        fprintf(stderr, "attnforge bench: --pair chooses among the --features pairs\n");
        return 2;
    }
    if (!features && (features_len || window != 512 || page_size)) {
        fprintf(stderr, "attnforge bench: --features-len, --window and --page-size size the --features pairs only\n");
        return 2;
    }
    if (features && (have_shape || causal || device.type != AF_DEVICE_CPU)) {
        fprintf(stderr, "attnforge bench: --features runs its own shapes on the CPU (af_flash_attn); --shape, "
                        "--causal and --device do not apply\n");
        return 2;
    }
    if (backward) {   /* its own machine row: the FMA peak only (no bandwidth pass) */
        if (features || kv_given || o.long_shapes || device.type != AF_DEVICE_CPU) {
            fprintf(stderr, "attnforge bench: --backward runs af_sdpa and af_sdpa_backward on the CPU; --features, "
                            "--kv-dtype, --long and --device do not apply\n");
            return 2;
        }
        one.causal = causal;
        const bench_backward_options bo = {.reps = o.reps, .json = o.json, .quick = o.quick, .nhd = o.nhd,
                                           .one = have_shape ? &one : NULL, .dtype_given = dtype_given,
                                           .dtype = one.dtype, .causal_only = causal};
        return bench_backward(&bo, af_get_num_threads()) ? 1 : 0;
    }
    if (device.type == AF_DEVICE_CUDA) {
        if (isa_given) {
            fprintf(stderr, "attnforge bench: --isa chooses a CPU kernel; it does not apply with --device cuda\n");
            return 2;
        }
        cli_device dev;
        const int code = cli_device_open(&dev, device, "attnforge bench");
        if (code) return code;
        one.causal = causal;
        const bench_cuda_options co = {.reps = o.reps, .json = o.json, .quick = o.quick, .long_shapes = o.long_shapes,
                                       .nhd = o.nhd, .one = have_shape ? &one : NULL, .dtype_given = dtype_given,
                                       .dtype = one.dtype, .causal_only = causal};
        return bench_cuda(&co, &dev);
    }
    f8_format = kv_dtype;
    const int threads = af_get_num_threads();
    enum { MAX_CASES = 64 };
    bench_case cases[MAX_CASES];
    int n;
    if (have_shape) {
        one.causal = causal;
        cases[0] = (bench_case){one, 0, kv_given, false};   /* --layout decides the layout */
        n = 1;
    } else {
        n = default_cases(&o, one.dtype, dtype_given, causal, threads, cases, MAX_CASES);
    }

    double peak_per_cpu = 0.0;
    const char *vector_isa = bench_peak_kind(af_get_isa(), AF_F32);
    const double peak = fma_peak(vector_isa, threads, &peak_per_cpu), bandwidth = read_bandwidth(threads);
    if (!o.json) {
        char cpu[128];
        bench_cpu_name(cpu, sizeof cpu);
        printf("attnforge %s bench: isa %s, %d threads, %s\n", af_version(), af_get_isa(), threads, cpu);
        printf("measured now: f32 FMA peak %.1f GFLOP/s (%s loop, %d threads; %.1f per CPU-second); read bandwidth "
               "%.1f GB/s (%d threads, %zu MiB)\n", peak, vector_isa, threads, peak_per_cpu, bandwidth, threads,
               BENCH_BANDWIDTH_BYTES >> 20);
        if (!strcmp(af_get_isa(), "amx"))
            printf("measured now: AMX bf16 tile-loop peak %.1f GFLOP/s (tdpbf16ps on resident tiles, %d threads): the "
                   "ceiling of the bf16 rows\n", fma_peak("amx", threads, NULL), threads);
        if (!strcmp(bench_peak_kind(af_get_isa(), AF_BF16), "avx512-bf16"))
            printf("measured now: bf16 dot-product peak %.1f GFLOP/s (vdpbf16ps loop, %d threads): the ceiling of the "
                   "bf16 rows\n", fma_peak("avx512-bf16", threads, NULL), threads);
    } else {
        printf("{\"machine\":true,\"isa\":\"%s\",\"threads\":%d,\"peak_gflops\":%.3f,\"peak_cpu_gflops\":%.3f,"
               "\"peak_gbps\":%.3f}\n", af_get_isa(), threads, peak, peak_per_cpu, bandwidth);
    }
    const int failures = spot_check(&o);
    if (features) {
        const bench_features_options fo = {.reps = o.reps, .json = o.json, .length = features_len ? features_len :
                                           o.quick ? 2048 : 8192, .window = window, .heads = 4, .head_dim = 128,
                                           .dtype_given = dtype_given, .dtype = one.dtype, .kv_dtype = kv_dtype,
                                           .page_size = page_size ? page_size : 16, .only = only_pair};
        const int errors = failures + bench_features(&fo, threads);
        bench_machine_release();
        return errors ? 1 : 0;
    }
    if (!o.json) print_header();
    bench_row rows[MAX_CASES];
    for (int c = 0; c < n; c++) {
        rows[c] = run_case(&cases[c], &o, threads, 4242 + (uint64_t)c);
        print_row(&rows[c], &o);
        fflush(stdout);
    }
    if (!o.json && threads > 1 && !have_shape) printf("scaling:\n");
    print_scaling(rows, n, &o);
    if (!o.json) {
        for (int i = 0; i < num_peaks; i++)
            if (peaks[i].threads != threads)   /* this thread count's ceilings are in the header */
                printf("peak for %d thread(s): %.1f GFLOP/s (%s loop; %.1f per CPU-second)\n", peaks[i].threads,
                       peaks[i].value, peaks[i].isa, peaks[i].per_cpu);
        for (int i = 0; i < num_bandwidths; i++)
            if (bandwidths[i].threads != threads)
                printf("read bandwidth for %d thread(s): %.1f GB/s\n", bandwidths[i].threads, bandwidths[i].value);
    }
    bench_machine_release();
    int errors = failures;
    for (int c = 0; c < n; c++) errors += !rows[c].ok;
    return errors ? 1 : 0;
}
