/* Decode's compute floor on this machine, and the share of the read bandwidth it leaves reachable.
 *
 * For GQA groups G = 1, 2, 4, 8 (E = Ev = 128, tiles of 64 keys, one kv head), the library's own direct kernels
 * (scores_direct, softmax_step, values_direct of the ISA af_sdpa uses, with the prefetches af_sdpa hands them on
 * one-head items) run over a K/V tile held in L1: the compute time per key of one kv head, with no memory stalls.
 * The read pass `attnforge bench` divides by (bench/machine_peak.c: 256 MiB, best of 5), on 1 and 2 threads, gives
 * the memory time per key (the 2·E elements of its K and V rows); the FMA peak is the bench's too. From the two, on
 * T threads (compute c per key on one core, memory m per key at the T-thread pass):
 *   - "overlapped": the share of the read bandwidth a decode reaches if memory and compute overlap completely,
 *     min(1, m / (c / T)): no order of the work, prefetching or threading does better with these kernels;
 *   - "serial": the share if they do not overlap at all, m / (m + c / T).
 * A decode at X% of the read pass lies between the two. "80% needs" says what reaching 80% of the read pass takes:
 * "out of reach" (the overlapped bound is under 80%: only faster kernels would do), "none" (even the serial sum is
 * fast enough), or the share of the compute time that must be hidden under the memory time.
 * It also times the instruction mixes the kernels are made of (AVX2 loops: 8 independent FMAs alone; with the two
 * conversions and four loads of a 4-row × 2-key scores step; with the two conversions and four broadcasts of a
 * 4-row × 2-vector values step), to show what bounds the kernels in L1 (docs/BENCHMARKS-HISTORY.md, "Decode, seventh look");
 * and it splits the kernels' time into scores, softmax step and values, each with and without its prefetches
 * ("eighth look").
 *
 * Not part of the library or the tests; it includes the library's internal micro-kernel header, so it links the
 * static library, and the bench's ceilings. The CMake build makes it (build-rel/standalone/decode_compute); by
 * hand (about 10 s to run):
 *   gcc -O3 -std=gnu11 -Iinclude -Isrc -Ibench -Itools -o /tmp/decode_compute bench/standalone/decode_compute.c \
 *       bench/machine_peak.c bench/amx_peak.c tools/cli_common.c build-rel/libattnforge.a -ljansson -lm -lpthread \
 *       && /tmp/decode_compute */
#ifndef _GNU_SOURCE   /* the build defines it for every file */
#define _GNU_SOURCE
#endif
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <attnforge.h>

#include "kernel/ukernel.h"
#include "machine_peak.h"

enum { E = 128, KEYS = 64, LDS = 80, LDO = 144, MAX_G = 8, RUNS = 31 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *x, int n) {
    qsort(x, (size_t)n, sizeof *x, by_value);
    return x[n / 2];
}

/* ------------------------------------------------------------------ the library's kernels on a tile in L1 */

static float q_rows[MAX_G * E] __attribute__((aligned(64)));
static float scores[MAX_G * LDS] __attribute__((aligned(64)));
static float out[MAX_G * LDO] __attribute__((aligned(64)));
static char k_tile[KEYS * E * 4] __attribute__((aligned(64)));
static char v_tile[KEYS * E * 4] __attribute__((aligned(64)));

/* Nanoseconds per key of one batch of passes over a tile (dt's elements, fill_tiles) of `part`:
 *   WHOLE_TILE: scores (prefetching this tile's V, as af_sdpa's one-head items do), the softmax step, and the values
 *   (prefetching half a K tile); or one kernel alone, to split that time: 0 the scores with their prefetches, 1
 *   without, 2 the softmax step on a copy of the scores, 3 the values with their prefetches, 4 without. */
enum { PARTS = 5, WHOLE_TILE = PARTS };
static double ns_per_key(const af_ukernel *uk, af_dtype dt, int g, int part) {
    static float copy[MAX_G * LDS] __attribute__((aligned(64)));
    const size_t elem = dt == AF_F32 ? 4 : 2;
    const char *k_rows[KEYS], *v_rows[KEYS];
    for (int j = 0; j < KEYS; j++) k_rows[j] = k_tile + (size_t)j * E * elem, v_rows[j] = v_tile + (size_t)j * E * elem;
    const size_t tile_lines = KEYS * E * elem / 64;
    const af_prefetch none = {NULL, 0}, this_v = {v_tile, tile_lines}, half_k = {k_tile, tile_lines / 2};
    const int degree = dt == AF_BF16 ? 3 : dt == AF_F16 ? 4 : 5;   /* the output's precision, as af_sdpa picks */
    float row_max[MAX_G], row_sum[MAX_G], alpha[MAX_G];
    for (int r = 0; r < g; r++) row_max[r] = -INFINITY, row_sum[r] = 0.0f;
    if (part == WHOLE_TILE) memset(out, 0, sizeof out);
    else uk->scores_direct(g, KEYS, E, q_rows, E, k_rows, 0, dt, scores, LDS, none);   /* the parts' input S */
    enum { PASSES = 300 };
    const double t0 = now();
    for (int i = 0; i < PASSES; i++) {
        if (part == WHOLE_TILE) {
            uk->scores_direct(g, KEYS, E, q_rows, E, k_rows, 0, dt, scores, LDS, this_v);
            uk->softmax_step(g, KEYS, scores, LDS, 0.088f, row_max, row_sum, alpha, degree);
            uk->values_direct(g, E, KEYS, scores, LDS, v_rows, 0, dt, out, LDO, half_k);
        } else if (part == 0) uk->scores_direct(g, KEYS, E, q_rows, E, k_rows, 0, dt, scores, LDS, this_v);
        else if (part == 1) uk->scores_direct(g, KEYS, E, q_rows, E, k_rows, 0, dt, scores, LDS, none);
        else if (part == 2) {
            memcpy(copy, scores, sizeof(float) * (size_t)g * LDS);
            uk->softmax_step(g, KEYS, copy, LDS, 0.088f, row_max, row_sum, alpha, degree);
        } else uk->values_direct(g, E, KEYS, scores, LDS, v_rows, 0, dt, out, LDO, part == 3 ? half_k : none);
    }
    return (now() - t0) / PASSES / KEYS * 1e9;
}

/* x rounded to f16 bits (F16C: no _Float16, which clang 14 lacks on x86) */
__attribute__((target("f16c"))) static uint16_t f16_bits(float x) { return (uint16_t)_cvtss_sh(x, 0); }

static void fill_tiles(af_dtype dt) {
    for (int i = 0; i < MAX_G * E; i++) q_rows[i] = 0.01f * (float)(i % 13) - 0.06f;
    for (int i = 0; i < KEYS * E; i++) {
        const float k = 0.02f * (float)(i % 11) - 0.1f, v = 0.03f * (float)(i % 7) - 0.09f;
        if (dt == AF_F32) {
            ((float *)k_tile)[i] = k, ((float *)v_tile)[i] = v;
        } else if (dt == AF_F16) {
            ((uint16_t *)k_tile)[i] = f16_bits(k), ((uint16_t *)v_tile)[i] = f16_bits(v);
        } else {   /* bf16: the f32's top half (truncated: only the timing matters) */
            uint32_t kb, vb;
            memcpy(&kb, &k, 4), memcpy(&vb, &v, 4);
            ((uint16_t *)k_tile)[i] = (uint16_t)(kb >> 16), ((uint16_t *)v_tile)[i] = (uint16_t)(vb >> 16);
        }
    }
}

/* ------------------------------------------------------------------ instruction mixes (AVX2) */

static uint16_t mix_halves[4096] __attribute__((aligned(64)));
static float mix_floats[2048] __attribute__((aligned(64)));

#define MIX_FN __attribute__((target("avx2,fma,f16c"), noinline)) static float
#define MIX_INIT                                                                  \
    __m256 a0 = _mm256_set1_ps(0.1f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
    const __m256 c = _mm256_set1_ps(0.5f);                                                         \
    (void)c;
/* The 8 accumulators stay in registers and every step's work stays live (the empty asm takes them as operands). */
#define MIX_LOOP(...)                                                                                         \
    for (long i = 0; i < n; i++) {                                                                            \
        const uint16_t *h = mix_halves + ((i * 64) & 4095);                                                   \
        const float *f = mix_floats + ((i * 32) & 2047);                                                      \
        (void)h, (void)f;                                                                                     \
        __VA_ARGS__;                                                                                          \
        __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7)); \
    }
#define MIX_RETURN                                                                                            \
    return _mm256_cvtss_f32(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),       \
                                          _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7))));
/* a0..a7 += x·{r0, r0, r1, r1, r2, r2, r3, r3} paired with {b0, b1}: a 4-row × 2-column step */
#define MIX_FMAS(r0, r1, r2, r3, b0, b1)                                                                      \
    a0 = _mm256_fmadd_ps(r0, b0, a0), a1 = _mm256_fmadd_ps(r0, b1, a1), a2 = _mm256_fmadd_ps(r1, b0, a2),     \
    a3 = _mm256_fmadd_ps(r1, b1, a3), a4 = _mm256_fmadd_ps(r2, b0, a4), a5 = _mm256_fmadd_ps(r2, b1, a5),     \
    a6 = _mm256_fmadd_ps(r3, b0, a6), a7 = _mm256_fmadd_ps(r3, b1, a7)
#define CVT(p) _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(p)))

MIX_FN fmas_alone(long n) {
    MIX_INIT
    MIX_LOOP(MIX_FMAS(c, c, c, c, c, c))
    MIX_RETURN
}
MIX_FN scores_step(long n) {   /* 2 keys' f16 vectors converted, 4 query rows' vectors loaded */
    MIX_INIT
    MIX_LOOP(const __m256 k0 = CVT(h); const __m256 k1 = CVT(h + 8);
             MIX_FMAS(_mm256_load_ps(f), _mm256_load_ps(f + 8), _mm256_load_ps(f + 16), _mm256_load_ps(f + 24), k0, k1))
    MIX_RETURN
}
MIX_FN values_step(long n) {   /* one V row's 2 f16 vectors converted, 4 rows' probabilities broadcast */
    MIX_INIT
    MIX_LOOP(const __m256 v0 = CVT(h); const __m256 v1 = CVT(h + 8);
             MIX_FMAS(_mm256_broadcast_ss(f), _mm256_broadcast_ss(f + 8), _mm256_broadcast_ss(f + 16),
                      _mm256_broadcast_ss(f + 24), v0, v1))
    MIX_RETURN
}

static volatile float sink;

/* Nanoseconds per loop step (8 FMAs and its mix), median of RUNS. */
static double mix_ns(float (*fn)(long)) {
    const long n = 4000000;
    double t[RUNS];
    for (int r = 0; r < RUNS; r++) {
        const double t0 = now();
        sink += fn(n);
        t[r] = (now() - t0) / (double)n * 1e9;
    }
    return median(t, RUNS);
}

int main(void) {
    const af_ukernel *uk = af_ukernel_current();
    for (int i = 0; i < 4096; i++) mix_halves[i] = 0x3c00;
    for (int i = 0; i < 2048; i++) mix_floats[i] = 1e-3f;

    const double alone = mix_ns(fmas_alone), sc = mix_ns(scores_step), va = mix_ns(values_step);
    printf("instruction mixes (AVX2, one core), ns per step of 8 FMAs: FMAs alone %.2f; "
           "+ 2 conversions + 4 loads (scores 4x2) %.2f (%.2fx); + 2 conversions + 4 broadcasts (values 4x2) %.2f "
           "(%.2fx)\n", alone, sc, sc / alone, va, va / alone);

    /* the ceilings `attnforge bench` divides by (bench/machine_peak.c), for the isa the kernels run */
    const double peak = bench_fma_peak_gflops(uk->isa, 1, NULL);
    const double bw[2] = {bench_read_bandwidth_gbps(1, BENCH_BANDWIDTH_BYTES),
                          bench_read_bandwidth_gbps(2, BENCH_BANDWIDTH_BYTES)};
    printf("isa %s: FMA peak %.1f GFLOP/s on 1 thread; read pass (256 MiB) %.1f GB/s on 1 thread, %.1f GB/s on 2\n\n",
           uk->isa, peak, bw[0], bw[1]);

    /* Every (dtype, G) once per round, RUNS rounds, medians: the machine's drift reaches all rows alike. */
    const af_dtype dts[] = {AF_F16, AF_BF16, AF_F32};
    const char *names[] = {"f16", "bf16", "f32"};
    enum { DTYPES = 3, GROUPS = 4 };
    static double ns[DTYPES][GROUPS][RUNS], part_ns[DTYPES][GROUPS][PARTS][RUNS];
    for (int run = 0; run < RUNS; run++)
        for (int d = 0; d < DTYPES; d++) {
            fill_tiles(dts[d]);
            for (int gi = 0; gi < GROUPS; gi++) {
                ns[d][gi][run] = ns_per_key(uk, dts[d], 1 << gi, WHOLE_TILE);
                for (int part = 0; part < PARTS; part++) part_ns[d][gi][part][run] = ns_per_key(uk, dts[d], 1 << gi, part);
            }
        }

    printf("| K/V | G | kernels, ns a key (1 core, L1) | the FMAs alone | "
           "1 thread: memory ns, overlapped, serial, 80%% needs | 2 threads: the same |\n");
    printf("|---|---|---|---|---|---|\n");
    for (int d = 0; d < DTYPES; d++) {
        const size_t elem = dts[d] == AF_F32 ? 4 : 2;
        for (int gi = 0; gi < GROUPS; gi++) {
            const int g = 1 << gi;
            const double c = median(ns[d][gi], RUNS);
            const double fmas = 4.0 * g * E / peak;   /* scores and values: G·E FMAs (2 FLOP) each, ns */
            printf("| %s | %d | %.1f | %.1f | ", names[d], g, c, fmas);
            for (int t = 1; t <= 2; t++) {
                const double m = 2.0 * E * (double)elem / bw[t - 1], per = c / t;
                const double overlapped = m / per < 1.0 ? m / per : 1.0, serial = m / (m + per);
                const double hidden = (m + per - m / 0.8) / per;   /* of the compute, for 80% */
                printf("%.1f, %.0f%%, %.0f%%, ", m, 100 * overlapped, 100 * serial);
                if (overlapped < 0.8) printf("out of reach |");
                else if (hidden <= 0.0) printf("none |");
                else printf("%.0f%% hidden |", 100 * hidden);
                printf("%s", t == 1 ? " " : "\n");
            }
        }
    }
    printf("\nwhere the kernels' time goes, ns a key (1 core, L1): the scores' prefetches (this tile's V) and the "
           "values' (half the next K) are the time with them less the time without\n");
    printf("| K/V | G | scores | their prefetches | softmax step | values | their prefetches | sum |\n");
    printf("|---|---|---|---|---|---|---|---|\n");
    for (int d = 0; d < DTYPES; d++)
        for (int gi = 0; gi < GROUPS; gi++) {
            double m[PARTS];
            for (int part = 0; part < PARTS; part++) m[part] = median(part_ns[d][gi][part], RUNS);
            printf("| %s | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n", names[d], 1 << gi, m[1], m[0] - m[1],
                   m[2], m[4], m[3] - m[4], m[0] + m[2] + m[3]);
        }
    return 0;
}
