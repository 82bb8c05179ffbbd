/* FMA peak and streaming bandwidth: tight loops of the benchmark's own ISA, run on the benchmark's threads. */
#include "machine_peak.h"

#include "amx_peak.h"

#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attnforge.h"
#include "cli_common.h"

#define PEAK_ACCUMULATORS 12     /* > FMA latency × FMA ports (4 × 2 on Zen 3, 4 × 2 on Sapphire Rapids) */
#define PEAK_ITERATIONS 40000000L
#define PEAK_TRIALS 3

typedef struct {
    void (*fn)(void *arg, int t);
    void *arg;
    int t;
} thread_start;

static void *thread_main(void *p) {
    thread_start *s = p;
    s->fn(s->arg, s->t);
    return NULL;
}

void bench_on_threads(int threads, void (*fn)(void *arg, int t), void *arg) {
    pthread_t ids[256];
    thread_start starts[256];
    if (threads > 256) threads = 256;
    int started = 0;
    for (int t = 1; t < threads; t++) {
        starts[t] = (thread_start){fn, arg, t};
        if (pthread_create(&ids[t], NULL, thread_main, &starts[t]) != 0) break;
        started = t;
    }
    fn(arg, 0);
    for (int t = 1; t <= started; t++) pthread_join(ids[t], NULL);
}

/* ---- FMA loops: 12 independent chains x = x·a + b (a < 1 keeps them finite); the sums go to a sink. */

static volatile float sink;

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static void fma_loop_avx2(long iterations) {
    __m256 acc[PEAK_ACCUMULATORS];
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-6f);
    for (int i = 0; i < PEAK_ACCUMULATORS; i++) acc[i] = _mm256_set1_ps((float)i);
    for (long n = 0; n < iterations; n++)
        for (int i = 0; i < PEAK_ACCUMULATORS; i++) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
    __m256 s = acc[0];
    for (int i = 1; i < PEAK_ACCUMULATORS; i++) s = _mm256_add_ps(s, acc[i]);
    sink = _mm256_cvtss_f32(s);
}

__attribute__((target("avx512f"))) static void fma_loop_avx512(long iterations) {
    __m512 acc[PEAK_ACCUMULATORS];
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-6f);
    for (int i = 0; i < PEAK_ACCUMULATORS; i++) acc[i] = _mm512_set1_ps((float)i);
    for (long n = 0; n < iterations; n++)
        for (int i = 0; i < PEAK_ACCUMULATORS; i++) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
    __m512 s = acc[0];
    for (int i = 1; i < PEAK_ACCUMULATORS; i++) s = _mm512_add_ps(s, acc[i]);
    sink = _mm512_reduce_add_ps(s);
}

/* vdpbf16ps: each of 16 lanes takes two bf16 pairs into its f32 sum, 64 FLOP an instruction (twice an FMA's); the
 * ceiling of the bf16 rows on the AVX512-BF16 products. a·b tiny keeps the chains finite. */
__attribute__((target("avx512f,avx512bf16"))) static void dpbf16_loop_avx512(long iterations) {
    __m512 acc[PEAK_ACCUMULATORS];
    const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
    for (int i = 0; i < PEAK_ACCUMULATORS; i++) acc[i] = _mm512_set1_ps((float)i);
    for (long n = 0; n < iterations; n++)
        for (int i = 0; i < PEAK_ACCUMULATORS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    __m512 s = acc[0];
    for (int i = 1; i < PEAK_ACCUMULATORS; i++) s = _mm512_add_ps(s, acc[i]);
    sink = _mm512_reduce_add_ps(s);
}
#endif

/* Whether the bf16 rows on the avx512 table run on the vdpbf16ps products (src/kernel/dispatch.c's rule: the CPU has
 * AVX512-BF16, ATTNFORGE_AVX512_BF16 is not 0) and this build can time them. */
static bool avx512_bf16_products(void) {
#if defined(__x86_64__)
    const char *env = getenv("ATTNFORGE_AVX512_BF16");
    return af_isa_available("avx512") && __builtin_cpu_supports("avx512bf16") && !(env && strcmp(env, "0") == 0);
#else
    return false;
#endif
}

static void fma_loop_scalar(long iterations) {
    float acc[PEAK_ACCUMULATORS];
    for (int i = 0; i < PEAK_ACCUMULATORS; i++) acc[i] = (float)i;
    for (long n = 0; n < iterations; n++)
        for (int i = 0; i < PEAK_ACCUMULATORS; i++) acc[i] = acc[i] * 0.999999f + 1e-6f;
    float s = 0.0f;
    for (int i = 0; i < PEAK_ACCUMULATORS; i++) s += acc[i];
    sink = s;
}

typedef struct {
    int lanes;    /* f32 multiply-adds per instruction: 16 / 8 / 1 FMA lanes, 32 for vdpbf16ps; 0: the AMX bf16 tile
                     loop */
    long iterations;
    double cpu_seconds[256];   /* per thread */
} fma_job;

static double thread_cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void fma_worker(void *arg, int t) {
    fma_job *job = arg;
    const double cpu0 = thread_cpu_seconds();
#if defined(__x86_64__)
    if (job->lanes == 0) bench_amx_tile_loop(job->iterations);
    else if (job->lanes == 32) dpbf16_loop_avx512(job->iterations);
    else if (job->lanes == 16) fma_loop_avx512(job->iterations);
    else if (job->lanes == 8) fma_loop_avx2(job->iterations);
    else
#endif
        fma_loop_scalar(job->iterations);
    job->cpu_seconds[t] = thread_cpu_seconds() - cpu0;
}

static fma_job fma_job_for(const char *isa, long iterations) {
    fma_job job = {.lanes = 1, .iterations = iterations};
    if (!strcmp(isa, "amx") && af_isa_available("amx") && bench_amx_tile_loop_built())   /* ~64× an FMA iteration */
        job = (fma_job){.lanes = 0, .iterations = iterations / 64};
    else if (!strcmp(isa, "avx512-bf16") && avx512_bf16_products()) job.lanes = 32;
    else if ((!strcmp(isa, "avx512") || !strcmp(isa, "amx") || !strcmp(isa, "avx512-bf16")) &&
             af_isa_available("avx512"))
        job.lanes = 16;
    else if (af_isa_available("avx2")) job.lanes = 8;
    else job.iterations /= 8;
    return job;
}

/* One trial: GFLOP/s over wall time, and (*per_cpu) over the CPU time the threads got. */
static double fma_trial(fma_job *job, int threads, double *per_cpu) {
    const double t0 = cli_now();
    bench_on_threads(threads, fma_worker, job);
    const double seconds = cli_now() - t0;
    const double per_iteration = job->lanes ? 2.0 * PEAK_ACCUMULATORS * job->lanes : BENCH_AMX_FLOPS_PER_ITERATION;
    const double flops = per_iteration * (double)job->iterations * threads;
    double cpu = 0.0;
    for (int t = 0; t < threads; t++) cpu += job->cpu_seconds[t];
    *per_cpu = cpu > 0.0 ? flops / cpu * 1e-9 : 0.0;
    return flops / seconds * 1e-9;
}

double bench_fma_peak_gflops(const char *isa, int threads, double *per_cpu_second) {
    if (threads > 256) threads = 256;
    fma_job job = fma_job_for(isa, PEAK_ITERATIONS);
    double best = 0.0, best_per_cpu = 0.0;
    for (int trial = 0; trial < PEAK_TRIALS; trial++) {
        double per_cpu;
        const double v = fma_trial(&job, threads, &per_cpu);
        if (v > best) best = v;
        if (per_cpu > best_per_cpu) best_per_cpu = per_cpu;
    }
    if (per_cpu_second) *per_cpu_second = best_per_cpu;
    return best;
}

double bench_fma_peak_sample_gflops(const char *isa, int threads, double *per_cpu_second) {
    if (threads > 256) threads = 256;
    fma_job job = fma_job_for(isa, PEAK_ITERATIONS / 4);
    double per_cpu;
    const double v = fma_trial(&job, threads, &per_cpu);
    if (per_cpu_second) *per_cpu_second = per_cpu;
    return v;
}

/* ---- streaming read: each thread sums its own contiguous share of the buffer. */

typedef struct {
    const float *data;
    size_t floats;
    int threads;
    float sums[256];
} read_job;

#if defined(__x86_64__)
__attribute__((target("avx2"))) static float sum_avx2(const float *x, size_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (size_t i = 0; i + 32 <= n; i += 32) {
        s0 = _mm256_add_ps(s0, _mm256_load_ps(x + i));
        s1 = _mm256_add_ps(s1, _mm256_load_ps(x + i + 8));
        s2 = _mm256_add_ps(s2, _mm256_load_ps(x + i + 16));
        s3 = _mm256_add_ps(s3, _mm256_load_ps(x + i + 24));
    }
    return _mm256_cvtss_f32(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
}
#endif

static float sum_scalar(const float *x, size_t n) {
    float s[8] = {0};
    for (size_t i = 0; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += x[i + j];
    return s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}

static void read_worker(void *arg, int t) {
    read_job *job = arg;
    const size_t share = job->floats / (size_t)job->threads / 64 * 64;
    const float *x = job->data + (size_t)t * share;
#if defined(__x86_64__)
    if (af_isa_available("avx2")) { job->sums[t] = sum_avx2(x, share); return; }
#endif
    job->sums[t] = sum_scalar(x, share);
}

typedef struct {
    const char *const *chunks;
    size_t count, chunk_bytes;
    int threads;
    float sums[256];
} chunk_job;

static void chunk_worker(void *arg, int t) {
    chunk_job *job = arg;
    const size_t share = job->count / (size_t)job->threads, first = (size_t)t * share;
    const size_t end = t == job->threads - 1 ? job->count : first + share, floats = job->chunk_bytes / sizeof(float);
    float s = 0.0f;
    for (size_t c = first; c < end; c++) {
        const float *x = (const float *)job->chunks[c];
#if defined(__x86_64__)
        if (af_isa_available("avx2")) {
            s += sum_avx2(x, floats);
            continue;
        }
#endif
        s += sum_scalar(x, floats);
    }
    job->sums[t] = s;
}

double bench_read_chunks_seconds(int threads, const char *const *chunks, size_t count, size_t chunk_bytes) {
    if (threads > 256) threads = 256;
    chunk_job job = {.chunks = chunks, .count = count, .chunk_bytes = chunk_bytes, .threads = threads};
    const double t0 = cli_now();
    bench_on_threads(threads, chunk_worker, &job);
    const double seconds = cli_now() - t0;
    sink = job.sums[0];
    return seconds;
}

static void touch_worker(void *arg, int t) {   /* first touch by the thread that reads it */
    read_job *job = arg;
    const size_t share = job->floats / (size_t)job->threads / 64 * 64;
    float *x = (float *)job->data + (size_t)t * share;
    for (size_t i = 0; i < share; i++) x[i] = 1.0f;
}

/* One timed pass of read_worker over job->data on `threads` threads, GB/s. */
static double read_pass(read_job *job, int threads) {
    const double read_bytes = (double)(job->floats / (size_t)threads / 64 * 64) * sizeof(float) * threads;
    const double t0 = cli_now();
    bench_on_threads(threads, read_worker, job);
    const double seconds = cli_now() - t0;
    sink = job->sums[0];
    return read_bytes / seconds * 1e-9;
}

double bench_read_bandwidth_gbps(int threads, size_t bytes) {
    if (threads > 256) threads = 256;
    read_job job = {.floats = bytes / sizeof(float), .threads = threads};
    void *memory = NULL;
    if (posix_memalign(&memory, 64, bytes) != 0) return 0.0;
    job.data = memory;
    bench_on_threads(threads, touch_worker, &job);
    double best = 0.0;
    for (int pass = 0; pass < 5; pass++) {
        const double v = read_pass(&job, threads);
        if (v > best) best = v;
    }
    free(memory);
    return best;
}

/* The sampling buffer: allocated and first touched on the first sample, kept until bench_machine_release. */
static read_job sample_job;

double bench_read_bandwidth_sample_gbps(int threads, size_t bytes) {
    if (threads > 256) threads = 256;
    if (sample_job.data && (sample_job.floats != bytes / sizeof(float) || sample_job.threads != threads))
        bench_machine_release();
    if (!sample_job.data) {
        void *memory = NULL;
        if (posix_memalign(&memory, 64, bytes) != 0) return 0.0;
        sample_job = (read_job){.data = memory, .floats = bytes / sizeof(float), .threads = threads};
        bench_on_threads(threads, touch_worker, &sample_job);
    }
    return read_pass(&sample_job, threads);
}

void bench_machine_release(void) {
    free((void *)sample_job.data);
    sample_job = (read_job){0};
}

const char *bench_peak_kind(const char *isa, af_dtype dtype) {
    if (!strcmp(isa, "avx512") && dtype == AF_BF16 && avx512_bf16_products()) return "avx512-bf16";
    if (strcmp(isa, "amx")) return isa;
    return dtype == AF_BF16 ? "amx" : "avx512";
}
