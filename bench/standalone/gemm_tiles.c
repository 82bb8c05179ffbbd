/* What prefill's two products could reach with another AVX2 register tile: the f32 gemm of the driver's block
 * shapes — Q·Kᵀ (192 rows × 64 keys × E 128, C stored) and P·V (192 × 128 × 64 keys, C accumulated) — with the B
 * strip hot in L1 and A in L2, as in attention. It times the library's tile (6 rows × 16 columns, A read in place
 * with its row stride: ukernel_simd.inc's gemm_tile) against 4 × 24 and against both with A packed in panels of
 * the tile's rows (A[k][row], one stream; the driver would have to pack Q once per row block and P once per key
 * tile). Each candidate runs right after the 6 × 16 tile, 41 times; it prints the median (and quartiles) of the
 * per-pair speed ratios, and the 6 × 16 tile's share of an FMA loop's peak sampled before each pair. One thread.
 * Not part of the library or the tests (docs/BENCHMARKS-HISTORY.md, "Prefill, fourth look"). Build and run:
 *   gcc -O3 -mavx2 -mfma -std=gnu11 -o /tmp/gemm_tiles bench/standalone/gemm_tiles.c && /tmp/gemm_tiles */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { ROWS = 192, PAIRS = 41, CALLS = 20 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* C[MR × 8·NV] (+)= A[MR × K] · B[K × 8·NV]; A's row i at A + i·lda, or, packed, element (i, p) at A[p·MR + i]. */
#define TILE(MR, NV, NAME, A_AT)                                                                                   \
    static __attribute__((noinline)) void NAME(int K, const float *A, int lda, const float *B, int ldb, float *C, \
                                               int ldc, int accumulate) {                                         \
        (void)lda;                                                                                                 \
        __m256 acc[MR][NV];                                                                                        \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++) \
            acc[i][v] = accumulate ? _mm256_loadu_ps(C + i * ldc + 8 * v) : _mm256_setzero_ps();               \
        _Pragma("GCC unroll 4") for (int p = 0; p < K; p++) {                                                      \
            __m256 b[NV];                                                                                          \
            _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++) b[v] = _mm256_loadu_ps(B + (size_t)p * ldb + 8 * v); \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                                \
                const __m256 a = _mm256_broadcast_ss(A_AT);                                                        \
                _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++) acc[i][v] = _mm256_fmadd_ps(a, b[v], acc[i][v]); \
            }                                                                                                      \
        }                                                                                                          \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++) \
            _mm256_storeu_ps(C + i * ldc + 8 * v, acc[i][v]);                                                      \
    }
TILE(6, 2, tile_6x16, A + (size_t)i * lda + p)
TILE(4, 3, tile_4x24, A + (size_t)i * lda + p)
TILE(6, 2, packed_6x16, A + (size_t)p * 6 + i)
TILE(4, 3, packed_4x24, A + (size_t)p * 4 + i)

typedef void (*tile_fn)(int, const float *, int, const float *, int, float *, int, int);
typedef struct { const char *name; tile_fn fn; int rows, cols, packed; } tile;

static float *a_rows, *a_packed, *b_tile, *c_tile;

/* GFLOP/s of CALLS block products: qk (K 128, 64 columns, C stored) or pv (K 64, 128 columns, C accumulated); row
 * strides an odd number of 64-byte lines plus one, as the driver pads its tiles. */
static double block_product(const tile *t, int qk) {
    const int K = qk ? 128 : 64, N = qk ? (t->cols == 24 ? 72 : 64) : (t->cols == 24 ? 120 : 128);
    const int lda = qk ? 144 : 80, ldb = qk ? 80 : 144, ldc = ldb;
    const int m = ROWS / t->rows * t->rows, n = N / t->cols * t->cols;
    const double t0 = now();
    for (int call = 0; call < CALLS; call++)
        for (int c = 0; c < n; c += t->cols)
            for (int r = 0; r < m; r += t->rows)
                t->fn(K, t->packed ? a_packed + (size_t)r * K : a_rows + (size_t)r * lda, lda, b_tile + c, ldb,
                      c_tile + (size_t)r * ldc + c, ldc, !qk);
    return 2.0 * m * n * K * CALLS / (now() - t0) * 1e-9;
}

/* One thread's FMA peak: 12 independent chains, every result used. */
static double fma_peak(void) {
    __m256 x[12];
    const __m256 m = _mm256_set1_ps(0.999f);
    for (int i = 0; i < 12; i++) x[i] = _mm256_set1_ps((float)i);
    const long iterations = 400000;
    const double t0 = now();
    for (long it = 0; it < iterations; it++)
        _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) x[i] = _mm256_fmadd_ps(x[i], m, m);
    const double seconds = now() - t0;
    float s = 0.0f;
    for (int i = 0; i < 12; i++) s += x[i][0];
    volatile float keep = s;
    (void)keep;
    return (double)iterations * 12 * 16 / seconds * 1e-9;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(void) {
    a_rows = aligned_alloc(64, 192 * 200 * 4), a_packed = aligned_alloc(64, 192 * 200 * 4);
    b_tile = aligned_alloc(64, 200 * 200 * 4), c_tile = aligned_alloc(64, 192 * 200 * 4);
    if (!a_rows || !a_packed || !b_tile || !c_tile) return 1;
    for (int i = 0; i < 192 * 200; i++) a_rows[i] = a_packed[i] = 0.001f * (float)(i % 17), c_tile[i] = 0.0f;
    for (int i = 0; i < 200 * 200; i++) b_tile[i] = 0.002f * (float)(i % 13);
    const tile base = {"6x16", tile_6x16, 6, 16, 0};
    const tile candidates[3] = {{"4x24", tile_4x24, 4, 24, 0},
                                {"6x16, A packed", packed_6x16, 6, 16, 1},
                                {"4x24, A packed", packed_4x24, 4, 24, 1}};
    for (int qk = 1; qk >= 0; qk--)
        for (int c = 0; c < 3; c++) {
            double ratio[PAIRS], share[PAIRS];
            for (int i = 0; i < PAIRS; i++) {
                const double peak = fma_peak(), g0 = block_product(&base, qk), g1 = block_product(&candidates[c], qk);
                ratio[i] = g1 / g0, share[i] = g0 / peak;
            }
            qsort(ratio, PAIRS, sizeof *ratio, by_value);
            qsort(share, PAIRS, sizeof *share, by_value);
            printf("%s  %-15s vs 6x16: speed %.3f (quartiles %.3f-%.3f); 6x16 at %.0f%% of the FMA peak\n",
                   qk ? "Q.K^T 192x64x128" : "P.V 192x128x64 ", candidates[c].name, ratio[PAIRS / 2],
                   ratio[PAIRS / 4], ratio[3 * PAIRS / 4], 100 * share[PAIRS / 2]);
        }
    return 0;
}
