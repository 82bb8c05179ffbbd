/* What a decode kernel could reach on this machine: a loop that does only the unavoidable work of f16 decode —
 * every K and V element read once from DRAM, converted once (vcvtph2ps), and G FMAs per element (the GQA group's
 * query rows) — with no softmax, no reductions and no bookkeeping. It reports the time as a % of a streaming read
 * pass over the same buffers taken just before each run (median of 21), for these orders of the work:
 *   - "key by key": key j's K row, then its V row, both as dot products with the query rows (acc += x·q): both
 *     streams advance together. An upper bound, not an attention kernel: P·V accumulates G·Ev outputs, not 8;
 *   - "tiles of T": T keys' K rows, then the same T keys' V rows, as dot products (the read order of a
 *     scores-then-values kernel);
 *   - "P·V, O in L1": key by key, the V row as P·V does it (O[g][:] += p[g]·v), the G·Ev outputs in L1 since they
 *     do not fit in 16 ymm registers (G = 4, Ev = 128: 64 vectors);
 *   - "strips": the library's order in tiles of 64 — K rows as dot products, then the values as P·V in 16-column
 *     strips of O held in registers, V read strip by strip — with its prefetches ("strips + prefetch": this tile's
 *     V rows during the scores, half of the next tile's K during the values) and without;
 *   - "wide strips": the same with strips of 8/G vectors (8 accumulators whatever G: 2-4x fewer passes over V's
 *     tile at G 1-2; the library's order since the "sixth look");
 *   - "scored": wide strips with real scores, the least an attention kernel adds to them: one score per (row,
 *     key), a horizontal sum each, its exp2, and P read from them (the orders above accumulate the K rows' products
 *     across keys and read the query rows as P);
 *   - "pipelined": wide strips of tile t - 1, each followed by a share of tile t's scores, which prefetch their keys'
 *     V rows and the K rows a tile ahead: K and V stream together, as key by key;
 *   - "kernels": the library's own direct kernels (scores_direct, softmax_step, values_direct of the ISA af_sdpa
 *     picks) on tiles of 64 keys with the prefetches af_sdpa hands them, from a bare loop, one item a head: af_sdpa
 *     less its driver (row lists, prefetch cursors, items of 2048 keys, the split-KV combine);
 *   - "attnforge": af_sdpa itself on the same cache (q f16, Hq = G·8), so that the library and the orders above are
 *     timed against the same read pass over the same buffers; also with the bytes read as bf16, and with the cache
 *     viewed as (B,S,H,E) (the same bytes, heads interleaved key by key) in f16 and bf16.
 * and, with the buffers hot in L2 (S = 256), the compute time per key and kv head alone.
 * Not part of the library or the tests (docs/BENCHMARKS-HISTORY.md, "Decode, fourth look" to "eighth look"). It includes
 * the library's internal micro-kernel header, so it links the static library. The CMake build makes it
 * (build-rel/standalone/decode_ceiling); by hand, after the library (build-rel):
 *   gcc -O3 -std=gnu11 -Iinclude -Isrc -o /tmp/decode_ceiling bench/standalone/decode_ceiling.c \
 *       build-rel/libattnforge.a -ljansson -lm -lpthread && /tmp/decode_ceiling */
#ifndef _GNU_SOURCE   /* the build defines it for every file */
#define _GNU_SOURCE
#endif
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <attnforge.h>

#include "kernel/ukernel.h"   /* the library's micro-kernels, for the "kernels" order */

enum { HEAD_DIM = 128, KV_HEADS = 8, CHUNKS = HEAD_DIM / 8, RUNS = 21, MAX_THREADS = 2 };
#define PV_IN_L1 ((size_t)-1)   /* head_pass's orders besides key by key and tiles of T */
#define STRIPS ((size_t)-2)
#define STRIPS_PREFETCH ((size_t)-3)
#define STRIPS_WIDE ((size_t)-8)        /* strips of 8/G vectors: 8 accumulators, 2-4x fewer passes over V's tile */
#define PIPELINED ((size_t)-9)          /* wide strips of tile t - 1 interleaved with the scores of tile t */
#define SCORED ((size_t)-10)            /* wide strips with a score per (row, key) and its exp2, P read from them */
#define KERNELS ((size_t)-11)           /* the library's own direct kernels, from a bare loop: af_sdpa less its driver */
#define ATTNFORGE ((size_t)-4)          /* f16, (B,H,S,E) */
#define ATTNFORGE_BF16 ((size_t)-5)     /* the same bytes as bf16 */
#define ATTNFORGE_BSHE ((size_t)-6)     /* f16, the cache read as (B,S,H,E): heads interleaved, a transformer's cache */
#define ATTNFORGE_BSHE_BF16 ((size_t)-7)
enum { STRIP_TILE = 64 };   /* the library's keys per tile for one kv head of E = 128 */

static size_t keys;                       /* S */
static uint16_t *k_cache, *v_cache;       /* (KV_HEADS, S, HEAD_DIM) f16 */
static float q[8][HEAD_DIM] __attribute__((aligned(64)));   /* the group's query rows (only their values matter) */
static volatile float sink[MAX_THREADS * 16];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* acc[] += G rows' products with one f16 row; 8 accumulators whatever G, so the FMA latency is always covered. */
#define ROW_FMAS(row, G, shift)                                                                      \
    _Pragma("GCC unroll 16") for (int c = 0; c < CHUNKS; c++) {                                       \
        const __m256 x = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)((row) + 8 * c)));           \
        _Pragma("GCC unroll 8") for (int g = 0; g < (G); g++) {                                       \
            const int a = (2 * g + c + (shift)) & 7;                                                  \
            acc[a] = _mm256_fmadd_ps(x, _mm256_load_ps(&q[g][8 * c]), acc[a]);                        \
        }                                                                                             \
    }

/* Prefetch one key's f16 row (4 lines). */
static inline void prefetch_row(const uint16_t *row) {
    for (int l = 0; l < HEAD_DIM * 2 / 64; l++) __builtin_prefetch((const char *)row + 64 * l, 0, 2);
}

/* P·V of keys [s0, s0 + STRIP_TILE) for O's vectors [c0, c1) of the G rows: strips of nv vectors a row held in
 * registers (G·nv <= 16 accumulators), V read strip by strip; one line of *k_lines from *next_k prefetched a key.
 * Row g's P of key s0 + i is P[g·ldp + i] (the query rows stand for P, except in the scored order). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void values_strips(
    const uint16_t *v, size_t s0, const int G, const int nv, int c0, int c1, const char **next_k, size_t *k_lines,
    const float *P, size_t ldp, float out[8][HEAD_DIM]) {
    for (int c = c0; c < c1; c += nv) {
        __m256 o[8][8];
        _Pragma("GCC unroll 8") for (int g = 0; g < G; g++)
            _Pragma("GCC unroll 8") for (int n = 0; n < nv; n++) o[g][n] = _mm256_load_ps(&out[g][8 * (c + n)]);
        for (size_t s = s0; s < s0 + STRIP_TILE; s++) {
            if (*k_lines) __builtin_prefetch(*next_k, 0, 2), *next_k += 64, --*k_lines;   /* a line per key */
            const uint16_t *row = v + s * HEAD_DIM + 8 * c;
            _Pragma("GCC unroll 8") for (int n = 0; n < nv; n++) {
                const __m256 x = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(row + 8 * n)));
                _Pragma("GCC unroll 8") for (int g = 0; g < G; g++)
                    o[g][n] = _mm256_fmadd_ps(_mm256_broadcast_ss(&P[(size_t)g * ldp + (s - s0)]), x, o[g][n]);
            }
        }
        _Pragma("GCC unroll 8") for (int g = 0; g < G; g++)
            _Pragma("GCC unroll 8") for (int n = 0; n < nv; n++) _mm256_store_ps(&out[g][8 * (c + n)], o[g][n]);
    }
}

/* The scored order's scores of keys [s0, s0 + STRIP_TILE): key by key (this tile's V prefetched as the library's
 * scores do), 8/G accumulators a row, one horizontal sum per (row, key), then 2^(s - 1) of each (the softmax step's
 * exp2: a degree-4 polynomial on the fraction) into S, which the values then read as P. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void scored_tile(const uint16_t *k,
                                                                                      const uint16_t *v, size_t s0,
                                                                                      const int G,
                                                                                      float S[8][STRIP_TILE]) {
    const int per_row = 8 / G;
    for (size_t s = s0; s < s0 + STRIP_TILE; s++) {
        prefetch_row(v + s * HEAD_DIM);
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        _Pragma("GCC unroll 16") for (int c = 0; c < CHUNKS; c++) {
            const __m256 x = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(k + s * HEAD_DIM + 8 * c)));
            _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {
                const int a = g * per_row + c % per_row;
                acc[a] = _mm256_fmadd_ps(x, _mm256_load_ps(&q[g][8 * c]), acc[a]);
            }
        }
        _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {
            __m256 t = acc[g * per_row];
            for (int i = 1; i < per_row; i++) t = _mm256_add_ps(t, acc[g * per_row + i]);
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            S[g][s - s0] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < STRIP_TILE; i += 8) {
            const __m256 x = _mm256_sub_ps(_mm256_load_ps(&S[g][i]), _mm256_set1_ps(1.0f));
            const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm256_sub_ps(x, n);
            __m256 p = _mm256_set1_ps(0.0136f);
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.0555f));
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.2402f));
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.6931f));
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
            const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
            _mm256_store_ps(&S[g][i], _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e)));
        }
}

/* One kv head's keys in tiles of `tile` keys (tile 0: key by key), G FMAs per element. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline float head_pass(const uint16_t *k,
                                                                                     const uint16_t *v, size_t tile,
                                                                                     const int G) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    if (tile == PV_IN_L1) {
        static __thread __m256 out[8][CHUNKS];   /* O of the group's rows */
        for (size_t s = 0; s < keys; s++) {
            ROW_FMAS(k + s * HEAD_DIM, G, 0)
            __m256 p[8];
            _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) p[g] = _mm256_broadcast_ss(&q[g][s % HEAD_DIM]);
            _Pragma("GCC unroll 16") for (int c = 0; c < CHUNKS; c++) {
                const __m256 x = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(v + s * HEAD_DIM + 8 * c)));
                _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) out[g][c] = _mm256_fmadd_ps(p[g], x, out[g][c]);
            }
        }
        acc[0] = _mm256_add_ps(acc[0], out[0][0]);
    } else if (tile == STRIPS || tile == STRIPS_PREFETCH || tile == STRIPS_WIDE) {
        static __thread float out[8][HEAD_DIM] __attribute__((aligned(32)));   /* O of the group's rows */
        const bool prefetch = tile != STRIPS;
        const int nv = tile == STRIPS_WIDE ? 8 / G : 2;
        for (size_t s0 = 0; s0 < keys; s0 += STRIP_TILE) {
            for (size_t s = s0; s < s0 + STRIP_TILE; s++) {
                if (prefetch) prefetch_row(v + s * HEAD_DIM);   /* this tile's V, as the library's scores do */
                ROW_FMAS(k + s * HEAD_DIM, G, 0)
            }
            const char *next_k = (const char *)(k + (s0 + STRIP_TILE) * HEAD_DIM);
            size_t k_lines = prefetch && s0 + STRIP_TILE < keys ? STRIP_TILE * HEAD_DIM * 2 / 64 / 2 : 0;
            values_strips(v, s0, G, nv, 0, CHUNKS, &next_k, &k_lines, &q[0][s0 % HEAD_DIM], HEAD_DIM, out);
        }
        acc[0] = _mm256_add_ps(acc[0], _mm256_load_ps(out[0]));
    } else if (tile == KERNELS) {   /* af_sdpa's calls for a one-head item, with its prefetches, one item a head */
        static __thread float out[8][HEAD_DIM] __attribute__((aligned(32)));
        static __thread float S[8][STRIP_TILE] __attribute__((aligned(32)));
        const af_ukernel *uk = af_ukernel_current();
        const char *k_rows[STRIP_TILE], *v_rows[STRIP_TILE];
        const size_t tile_lines = STRIP_TILE * HEAD_DIM * 2 / 64;
        float row_max[8], row_sum[8], alpha[8];
        for (int g = 0; g < G; g++) row_max[g] = -INFINITY, row_sum[g] = 0.0f;
        for (size_t s0 = 0; s0 < keys; s0 += STRIP_TILE) {
            for (size_t j = 0; j < STRIP_TILE; j++)
                k_rows[j] = (const char *)(k + (s0 + j) * HEAD_DIM), v_rows[j] = (const char *)(v + (s0 + j) * HEAD_DIM);
            const af_prefetch this_v = {v_rows[0], tile_lines},
                              next_k = {(const char *)(k + (s0 + STRIP_TILE) * HEAD_DIM),
                                        s0 + STRIP_TILE < keys ? tile_lines / 2 : 0};
            uk->scores_direct(G, STRIP_TILE, HEAD_DIM, &q[0][0], HEAD_DIM, k_rows, 0, AF_F16, &S[0][0], STRIP_TILE,
                              this_v);
            uk->softmax_step(G, STRIP_TILE, &S[0][0], STRIP_TILE, 0.088f, row_max, row_sum, alpha, 4);
            for (int g = 0; g < G; g++)
                if (alpha[g] != 1.0f) uk->scale_row(out[g], HEAD_DIM, alpha[g]);
            uk->values_direct(G, HEAD_DIM, STRIP_TILE, &S[0][0], STRIP_TILE, v_rows, 0, AF_F16, &out[0][0], HEAD_DIM,
                              next_k);
        }
        acc[0] = _mm256_add_ps(acc[0], _mm256_load_ps(out[0]));
    } else if (tile == SCORED) {
        static __thread float out[8][HEAD_DIM] __attribute__((aligned(32)));
        static __thread float S[8][STRIP_TILE] __attribute__((aligned(32)));
        for (size_t s0 = 0; s0 < keys; s0 += STRIP_TILE) {
            scored_tile(k, v, s0, G, S);
            const char *next_k = (const char *)(k + (s0 + STRIP_TILE) * HEAD_DIM);
            size_t k_lines = s0 + STRIP_TILE < keys ? STRIP_TILE * HEAD_DIM * 2 / 64 / 2 : 0;
            values_strips(v, s0, G, 8 / G, 0, CHUNKS, &next_k, &k_lines, &S[0][0], STRIP_TILE, out);
        }
        acc[0] = _mm256_add_ps(acc[0], _mm256_load_ps(out[0]));
    } else if (tile == PIPELINED) {
        static __thread float out[8][HEAD_DIM] __attribute__((aligned(32)));
        static __thread __m256 scores[8];   /* the scores' accumulators between steps */
        const int nv = 8 / G, steps = CHUNKS / nv;
        const size_t per_step = STRIP_TILE / (size_t)steps, tiles = keys / STRIP_TILE;
        for (size_t t = 0; t <= tiles; t++)   /* step c of round t: tile t's keys c·per_step.., tile t - 1's strip c */
            for (int c = 0; c < steps; c++) {
                if (t < tiles) {
                    for (int i = 0; i < 8; i++) acc[i] = scores[i];
                    for (size_t s = t * STRIP_TILE + (size_t)c * per_step, e = s + per_step; s < e; s++) {
                        if (s + STRIP_TILE < keys) prefetch_row(k + (s + STRIP_TILE) * HEAD_DIM);
                        prefetch_row(v + s * HEAD_DIM);
                        ROW_FMAS(k + s * HEAD_DIM, G, 0)
                    }
                    for (int i = 0; i < 8; i++) scores[i] = acc[i];
                }
                size_t no_lines = 0;
                if (t > 0)
                    values_strips(v, (t - 1) * STRIP_TILE, G, nv, c * nv, (c + 1) * nv, NULL, &no_lines,
                                  &q[0][(t - 1) * STRIP_TILE % HEAD_DIM], HEAD_DIM, out);
            }
        for (int i = 0; i < 8; i++) acc[i] = _mm256_add_ps(scores[i], _mm256_load_ps(out[0]));
    } else if (tile == 0) {
        for (size_t s = 0; s < keys; s++) {
            ROW_FMAS(k + s * HEAD_DIM, G, 0)
            ROW_FMAS(v + s * HEAD_DIM, G, 1)
        }
    } else {
        for (size_t s0 = 0; s0 < keys; s0 += tile) {
            for (size_t s = s0; s < s0 + tile; s++) ROW_FMAS(k + s * HEAD_DIM, G, 0)
            for (size_t s = s0; s < s0 + tile; s++) ROW_FMAS(v + s * HEAD_DIM, G, 1)
        }
    }
    for (int i = 1; i < 8; i++) acc[0] = _mm256_add_ps(acc[0], acc[i]);
    return _mm256_cvtss_f32(acc[0]);
}

__attribute__((target("avx2,fma,f16c"))) static float head_g(const uint16_t *k, const uint16_t *v, size_t tile, int G) {
    switch (G) {
    case 1: return head_pass(k, v, tile, 1);
    case 2: return head_pass(k, v, tile, 2);
    case 4: return head_pass(k, v, tile, 4);
    default: return head_pass(k, v, tile, 8);
    }
}

typedef struct { int threads, group, mode; size_t tile; } job;   /* mode 0: the kernel, 1: the read pass */
typedef struct { const job *j; int t; } start;

__attribute__((target("avx2"))) static float read_share(const uint16_t *x, size_t elems) {
    const float *f = (const float *)x;
    __m256 s[8];   /* 8 chains: the adds' latency never limits the pass */
    for (int i = 0; i < 8; i++) s[i] = _mm256_setzero_ps();
    for (size_t i = 0; i + 64 <= elems / 2; i += 64)
        for (int c = 0; c < 8; c++) s[c] = _mm256_add_ps(s[c], _mm256_load_ps(f + i + 8 * c));
    for (int i = 1; i < 8; i++) s[0] = _mm256_add_ps(s[0], s[i]);
    return _mm256_cvtss_f32(s[0]);
}

static void *worker(void *arg) {
    const start *st = arg;
    const job *j = st->j;
    float s = 0.0f;
    if (j->mode == 1) {   /* thread t reads its share of K, then of V */
        const size_t n = (size_t)KV_HEADS * keys * HEAD_DIM, share = n / (size_t)j->threads;
        s = read_share(k_cache + (size_t)st->t * share, share) + read_share(v_cache + (size_t)st->t * share, share);
    } else {
        for (int h = st->t; h < KV_HEADS; h += j->threads)
            s += head_g(k_cache + (size_t)h * keys * HEAD_DIM, v_cache + (size_t)h * keys * HEAD_DIM, j->tile, j->group);
    }
    sink[st->t * 16] += s;
    return NULL;
}

/* af_sdpa on the whole cache: q (1, 8·G, 1, 128), K and V (1, 8, S, 128) in f16 or bf16 (the cache's bytes either
 * way: 0x3c00 is 2^-7 as bf16), contiguous or as (B,S,H,E) strides, on j->threads threads. */
static double run_attnforge(const job *j) {
    static uint16_t qbuf[8 * KV_HEADS * HEAD_DIM], obuf[8 * KV_HEADS * HEAD_DIM];
    const bool bf16 = j->tile == ATTNFORGE_BF16 || j->tile == ATTNFORGE_BSHE_BF16;
    const af_dtype dt = bf16 ? AF_BF16 : AF_F16;
    const int64_t hq = (int64_t)KV_HEADS * j->group;
    for (int64_t i = 0; i < hq * HEAD_DIM; i++) qbuf[i] = bf16 ? 0x3b80 : 0x1c00;   /* 2^-8 */
    const int64_t q_shape[4] = {1, hq, 1, HEAD_DIM}, kv_shape[4] = {1, KV_HEADS, (int64_t)keys, HEAD_DIM};
    af_tensor tq = af_tensor_contiguous(qbuf, dt, 4, q_shape), to = af_tensor_contiguous(obuf, dt, 4, q_shape);
    af_tensor tk = af_tensor_contiguous(k_cache, dt, 4, kv_shape), tv = af_tensor_contiguous(v_cache, dt, 4, kv_shape);
    if (j->tile == ATTNFORGE_BSHE || j->tile == ATTNFORGE_BSHE_BF16) {   /* element (h, s, e) at (s·H + h)·E + e */
        const int64_t strides[4] = {(int64_t)keys * KV_HEADS * HEAD_DIM, HEAD_DIM, KV_HEADS * HEAD_DIM, 1};
        memcpy(tk.strides, strides, sizeof strides);
        memcpy(tv.strides, strides, sizeof strides);
    }
    af_sdpa_args args = {0};
    args.query = &tq, args.key = &tk, args.value = &tv, args.enable_gqa = true;
    af_set_num_threads(j->threads);
    const double t0 = now();
    if (af_sdpa(&args, &to, NULL) != AF_OK) exit(2);
    return now() - t0;
}

static double run(const job *j) {
    if (j->mode == 0 && j->tile >= ATTNFORGE_BSHE_BF16 && j->tile <= ATTNFORGE) return run_attnforge(j);
    pthread_t ids[MAX_THREADS];
    start starts[MAX_THREADS];
    const double t0 = now();
    for (int t = 1; t < j->threads; t++) {
        starts[t] = (start){j, t};
        pthread_create(&ids[t], NULL, worker, &starts[t]);
    }
    starts[0] = (start){j, 0};
    worker(&starts[0]);
    for (int t = 1; t < j->threads; t++) pthread_join(ids[t], NULL);
    return now() - t0;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void allocate(size_t s) {
    free(k_cache);
    free(v_cache);
    keys = s;
    const size_t n = (size_t)KV_HEADS * keys * HEAD_DIM;
    k_cache = aligned_alloc(64, n * 2);
    v_cache = aligned_alloc(64, n * 2);
    if (!k_cache || !v_cache) exit(1);
    for (size_t i = 0; i < n; i++) k_cache[i] = v_cache[i] = 0x3c00;   /* 1.0 */
}

int main(void) {
    for (int g = 0; g < 8; g++)
        for (int e = 0; e < HEAD_DIM; e++) q[g][e] = 1e-3f;
    const size_t tiles[] = {0, 64, 256, PV_IN_L1, STRIPS, STRIPS_PREFETCH, STRIPS_WIDE, SCORED, PIPELINED, KERNELS,
                             ATTNFORGE, ATTNFORGE_BF16, ATTNFORGE_BSHE, ATTNFORGE_BSHE_BF16};
    enum { ORDERS = sizeof tiles / sizeof tiles[0] };
    const int groups[] = {1, 2, 4, 8};
    printf("f16 K/V (%d kv heads, S, E = %d); %% of the read pass taken before each run, median of %d runs\n",
           KV_HEADS, HEAD_DIM, RUNS);
    allocate(32768);   /* 128 MiB of K+V: far past any L3 */
    for (int threads = 1; threads <= MAX_THREADS; threads++)
        for (int gi = 0; gi < 4; gi++) {
            printf("threads %d, GQA group %d:", threads, groups[gi]);
            double pct[ORDERS][RUNS];
            for (int r = 0; r < RUNS; r++)   /* the orders alternate run by run: the machine's drift hits all */
                for (int ti = 0; ti < ORDERS; ti++) {
                    const job read = {threads, 0, 1, 0}, kernel = {threads, groups[gi], 0, tiles[ti]};
                    const double read_s = run(&read);
                    pct[ti][r] = 100.0 * read_s / run(&kernel);
                }
            for (int ti = 0; ti < ORDERS; ti++) {
                qsort(pct[ti], RUNS, sizeof(double), by_value);
                if (tiles[ti] == PV_IN_L1) printf("  P·V, O in L1 %3.0f%%", pct[ti][RUNS / 2]);
                else if (tiles[ti] == STRIPS) printf("  strips %3.0f%%", pct[ti][RUNS / 2]);
                else if (tiles[ti] == STRIPS_PREFETCH) printf("  strips + prefetch %3.0f%%", pct[ti][RUNS / 2]);
                else if (tiles[ti] == STRIPS_WIDE) printf("  wide strips %3.0f%%", pct[ti][RUNS / 2]);
                else if (tiles[ti] == SCORED) printf("  scored %3.0f%%", pct[ti][RUNS / 2]);
                else if (tiles[ti] == PIPELINED) printf("  pipelined %3.0f%%", pct[ti][RUNS / 2]);
                else if (tiles[ti] == KERNELS) printf("  kernels %3.0f%%", pct[ti][RUNS / 2]);
                else if (tiles[ti] == ATTNFORGE) printf("  attnforge %3.0f%%", pct[ti][RUNS / 2]);
                else if (tiles[ti] == ATTNFORGE_BF16) printf(", bf16 %.0f%%", pct[ti][RUNS / 2]);
                else if (tiles[ti] == ATTNFORGE_BSHE) printf(", (B,S,H,E) f16 %.0f%%", pct[ti][RUNS / 2]);
                else if (tiles[ti] == ATTNFORGE_BSHE_BF16) printf(", bf16 %.0f%%", pct[ti][RUNS / 2]);
                else if (tiles[ti]) printf("  tiles of %zu %3.0f%%", tiles[ti], pct[ti][RUNS / 2]);
                else printf("  key by key %3.0f%%", pct[ti][RUNS / 2]);
            }
            printf("\n");
        }
    allocate(256);   /* 512 KiB of K+V over 8 heads: each head's 64 KiB stays in L2 */
    const size_t compute_orders[] = {0, 64, STRIPS, STRIPS_WIDE, SCORED, PIPELINED, KERNELS, ATTNFORGE};
    const char *compute_names[] = {"key by key", "tiles of 64", "strips", "wide strips", "scored", "pipelined",
                                   "kernels", "attnforge"};
    for (int order = 0; order < 8; order++) {
    const size_t tile = compute_orders[order];
    printf("compute alone (K/V hot in L2), ns per key and kv head, one thread, %s:", compute_names[order]);
    for (int gi = 0; gi < 4; gi++) {
        const job kernel = {1, groups[gi], 0, tile};
        double ns[RUNS];
        run(&kernel);
        for (int r = 0; r < RUNS; r++) {
            double t = 0.0;
            for (int rep = 0; rep < 100; rep++) t += run(&kernel);
            ns[r] = t / 100.0 * 1e9 / (double)(keys * KV_HEADS);
        }
        qsort(ns, RUNS, sizeof(double), by_value);
        printf("  G %d: %.1f", groups[gi], ns[RUNS / 2]);
    }
    printf("\n");
    }
    return 0;
}
