/* The emulated AMX tile instructions (tests/support/amx_tile_emulated.c) against a scalar matmul accumulated in
 * double, on random tiles of every shape palette 1 allows (rows 1..16, 1..16 pairs, 1..16 columns), with zero
 * padding, canaries around what a store may write, the SDM's accumulation order, DAZ/FTZ, and the faults the CPU
 * raises (#UD/#GP) for misuse: no configuration, a bad configuration, shapes that do not chain, a tile used twice,
 * a thread that did not load its own configuration. */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include <sys/wait.h>
#include <unistd.h>

#include "amx_tile_emulated.h"
#include "core/dtype.h"
#include "test_tensor.h"

static test_rng rng = {0x2545F4914F6CDD1Dull};

static double uniform(void) { return rng_uniform(&rng); }   /* [0, 1) */

static int range(int lo, int hi) { return lo + (int)(uniform() * (hi - lo + 1)); }

static uint16_t random_bf16(void) { return af_f32_to_bf16((float)(4.0 * uniform() - 2.0)); }

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* C (tile 0) m × n f32, A (tile 1) m rows × k pairs, B (tile 2) k rows × n pairs; tile 3 unused. */
static void configure(int m, int n, int k) {
    tile_config cfg = {.palette_id = 1};
    cfg.rows[0] = (uint8_t)m, cfg.colsb[0] = (uint16_t)(4 * n);
    cfg.rows[1] = (uint8_t)m, cfg.colsb[1] = (uint16_t)(4 * k);
    cfg.rows[2] = (uint8_t)k, cfg.colsb[2] = (uint16_t)(4 * n);
    amx_emu_loadconfig(&cfg);
}

#define CANARY 0x5A

/* One tdpbf16ps on random m × k pairs × n operands: every element within the f32 accumulation bound of the double
 * sum, nothing stored outside the m rows × 4n bytes of C. A and B rows sit in wider buffers (strides). */
static void random_product(int m, int n, int k) {
    enum { LDA = 40, LDB = 36, LDC = 20 };   /* in bf16 pairs / f32 */
    uint16_t A[16 * 2 * LDA], B[16 * 2 * LDB];
    float C[16 * LDC], out[17 * LDC];
    for (int i = 0; i < 16 * 2 * LDA; i++) A[i] = random_bf16();
    for (int i = 0; i < 16 * 2 * LDB; i++) B[i] = random_bf16();
    for (int i = 0; i < 16 * LDC; i++) C[i] = (float)(2.0 * uniform() - 1.0);
    memset(out, CANARY, sizeof out);
    configure(m, n, k);
    amx_emu_load(0, C, LDC * sizeof(float));
    amx_emu_load(1, A, 2 * LDA * sizeof(uint16_t));
    amx_emu_load(2, B, 2 * LDB * sizeof(uint16_t));
    amx_emu_dpbf16ps(0, 1, 2);
    amx_emu_store(0, out, LDC * sizeof(float));
    amx_emu_release();
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double sum = C[i * LDC + j], mag = fabs(sum);
            for (int p = 0; p < k; p++)
                for (int h = 0; h < 2; h++) {
                    const double x = (double)af_bf16_to_f32(A[i * 2 * LDA + 2 * p + h]) * af_bf16_to_f32(B[p * 2 * LDB + 2 * j + h]);
                    sum += x;
                    mag += fabs(x);
                }
            /* k FMAs into each of two partial sums, their add, the add to C: k + 2 roundings on the way */
            const double bound = (k + 3) * ldexp(1.0, -24) * mag;
            const double err = fabs(out[i * LDC + j] - sum);
            if (!(err <= bound)) fail_msg("m=%d n=%d k=%d: C[%d][%d] = %.9g, double %.9g, error %.3g > %.3g", m, n, k, i, j, out[i * LDC + j], sum, err, bound);
        }
    const unsigned char *bytes = (const unsigned char *)out;
    for (int i = 0; i < 17; i++)
        for (int b = 0; b < (int)(LDC * sizeof(float)); b++) {
            const bool written = i < m && b < 4 * n;
            if (!written && bytes[i * LDC * sizeof(float) + b] != CANARY) fail_msg("m=%d n=%d k=%d: store wrote row %d byte %d", m, n, k, i, b);
        }
}

static void random_shapes_match_double(void **state) {
    (void)state;
    for (int m = 1; m <= 16; m++)
        for (int n = 1; n <= 16; n += (m % 3) + 1) random_product(m, n, range(1, 16));
    for (int t = 0; t < 200; t++) random_product(range(1, 16), range(1, 16), range(1, 16));
    random_product(16, 16, 16);   /* the products' only shape */
}

/* Zero pairs appended to A's rows and B's columns (how the products pad head dims and keys) change nothing: the
 * padded product equals the unpadded one bit for bit. */
static void zero_padding_changes_nothing(void **state) {
    (void)state;
    for (int t = 0; t < 50; t++) {
        const int m = range(1, 16), n = range(1, 16), k = range(1, 15), kpad = range(k + 1, 16);
        uint16_t A[16][32] = {{0}}, B[16][32] = {{0}};
        float C[16][16], small[16][16], padded[16][16];
        for (int i = 0; i < m; i++)
            for (int p = 0; p < 2 * k; p++) A[i][p] = random_bf16();
        for (int p = 0; p < k; p++)
            for (int j = 0; j < 2 * n; j++) B[p][j] = random_bf16();
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 16; j++) C[i][j] = (float)(uniform() - 0.5);
        for (int pass = 0; pass < 2; pass++) {
            configure(m, n, pass ? kpad : k);
            amx_emu_load(0, C, sizeof C[0]);
            amx_emu_load(1, A, sizeof A[0]);
            amx_emu_load(2, B, sizeof B[0]);
            amx_emu_dpbf16ps(0, 1, 2);
            amx_emu_store(0, pass ? padded : small, sizeof C[0]);
            amx_emu_release();
        }
        for (int i = 0; i < m; i++) assert_memory_equal(small[i], padded[i], sizeof(float) * (size_t)n);
    }
}

/* One row, one column, two pairs, built so that the SDM's order gives a different answer from accumulating
 * straight into C: even products 2^24 then -2^24 in one partial sum, odd products 1 then 0 in the other, C = 1.
 * SDM: C + ((2^24 - 2^24) + (1 + 0)) = 2. Straight into C: 1 + 2^24 + 1 - 2^24 + 0 = 0 (each 1 is lost). */
static void accumulation_follows_the_sdm(void **state) {
    (void)state;
    const float c = 1.0f;
    uint16_t A[2][2] = {{af_f32_to_bf16(4096.0f), af_f32_to_bf16(1.0f)}, {af_f32_to_bf16(-4096.0f), af_f32_to_bf16(0.0f)}};
    uint16_t B[2][2] = {{af_f32_to_bf16(4096.0f), af_f32_to_bf16(1.0f)}, {af_f32_to_bf16(4096.0f), af_f32_to_bf16(1.0f)}};
    float out = -1.0f;
    configure(1, 1, 2);
    amx_emu_load(0, &c, 4);
    amx_emu_load(1, A, 8);   /* row 0: pairs (4096, 1), (-4096, 0) */
    amx_emu_load(2, B, 4);   /* rows k = 0, 1: pair (4096, 1) each */
    amx_emu_dpbf16ps(0, 1, 2);
    amx_emu_store(0, &out, 4);
    amx_emu_release();
    assert_true(out == 2.0f);
}

/* Input denormals count as zero; results below 2^-126 are flushed to zero. */
static void denormals_are_flushed(void **state) {
    (void)state;
    const float zero = 0.0f;
    float out;
    uint16_t a[2] = {0x0001, 0}, b[2] = {af_f32_to_bf16(0x1p100f), 0};   /* a[0] = 2^-133 (bf16 denormal) */
    configure(1, 1, 1);
    amx_emu_load(0, &zero, 4);
    amx_emu_load(1, a, 4);
    amx_emu_load(2, b, 4);
    amx_emu_dpbf16ps(0, 1, 2);
    amx_emu_store(0, &out, 4);
    assert_true(out == 0.0f);   /* not 2^-33 */
    a[0] = af_f32_to_bf16(0x1p-100f);
    b[0] = af_f32_to_bf16(0x1p-30f);   /* 2^-130: a denormal f32 result */
    amx_emu_load(0, &zero, 4);
    amx_emu_load(1, a, 4);
    amx_emu_load(2, b, 4);
    amx_emu_dpbf16ps(0, 1, 2);
    amx_emu_store(0, &out, 4);
    assert_true(out == 0.0f);
    a[0] = af_f32_to_bf16(0x1p-100f);
    b[0] = af_f32_to_bf16(0x1p-20f);   /* 2^-120: normal, kept */
    amx_emu_load(0, &zero, 4);
    amx_emu_load(1, a, 4);
    amx_emu_load(2, b, 4);
    amx_emu_dpbf16ps(0, 1, 2);
    amx_emu_store(0, &out, 4);
    assert_true(out == 0x1p-120f);
    amx_emu_release();
}

/* NaN and Inf propagate as f32 arithmetic does. */
static void nan_and_inf_propagate(void **state) {
    (void)state;
    const float zero[2] = {0.0f, 0.0f};
    float out[2];
    uint16_t a[2] = {0x7fc0, af_f32_to_bf16(1.0f)};                              /* NaN, 1 */
    uint16_t b[4] = {af_f32_to_bf16(1.0f), 0x7f80, af_f32_to_bf16(0.0f), 0x7f80};   /* col 0: (1, inf); col 1: (0, inf) */
    configure(1, 2, 1);
    amx_emu_load(0, zero, 8);
    amx_emu_load(1, a, 4);
    amx_emu_load(2, b, 8);
    amx_emu_dpbf16ps(0, 1, 2);
    amx_emu_store(0, out, 8);
    amx_emu_release();
    assert_true(isnan(out[0]) && isnan(out[1]));   /* NaN·1 + 1·inf; NaN·0 + 1·inf */
}

/* ---------------------------------------------------------------------------------------------- faults */

static bool faults(void (*fn)(void)) {
    fflush(NULL);
    const pid_t pid = fork();
    if (pid == 0) {
        if (!freopen("/dev/null", "w", stderr)) _exit(2);
        fn();
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
}

static void use_without_config(void) { amx_emu_zero(0); }
static void use_after_release(void) {
    configure(16, 16, 16);
    amx_emu_release();
    amx_emu_zero(0);
}
static void unconfigured_tile(void) {
    configure(16, 16, 16);
    amx_emu_zero(3);
}
static void shapes_do_not_chain(void) {
    configure(16, 16, 16);
    tile_config cfg = {.palette_id = 1};
    cfg.rows[0] = 16, cfg.colsb[0] = 64, cfg.rows[1] = 16, cfg.colsb[1] = 64, cfg.rows[2] = 15, cfg.colsb[2] = 64;
    amx_emu_loadconfig(&cfg);   /* A has 16 pairs per row, B 15 rows */
    amx_emu_dpbf16ps(0, 1, 2);
}
static void same_tile_twice(void) {
    configure(16, 16, 16);
    amx_emu_dpbf16ps(0, 1, 1);
}
static void bad_palette(void) {
    tile_config cfg = {.palette_id = 2};
    amx_emu_loadconfig(&cfg);
}
static void too_many_rows(void) {
    tile_config cfg = {.palette_id = 1};
    cfg.rows[0] = 17, cfg.colsb[0] = 64;
    amx_emu_loadconfig(&cfg);
}
static void *zero_tile(void *arg) {
    (void)arg;
    amx_emu_zero(0);
    return NULL;
}
static void other_thread_without_config(void) {   /* the configuration is per thread */
    configure(16, 16, 16);
    pthread_t t;
    pthread_create(&t, NULL, zero_tile, NULL);
    pthread_join(t, NULL);
}
static void valid_sequence(void) {
    configure(16, 16, 16);
    amx_emu_zero(0);
    amx_emu_dpbf16ps(0, 1, 2);
    amx_emu_release();
}

static void misuse_faults(void **state) {
    (void)state;
    assert_false(faults(valid_sequence));
    assert_true(faults(use_without_config));
    assert_true(faults(use_after_release));
    assert_true(faults(unconfigured_tile));
    assert_true(faults(shapes_do_not_chain));
    assert_true(faults(same_tile_twice));
    assert_true(faults(bad_palette));
    assert_true(faults(too_many_rows));
    assert_true(faults(other_thread_without_config));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(random_shapes_match_double),
        cmocka_unit_test(zero_padding_changes_nothing),
        cmocka_unit_test(accumulation_follows_the_sdm),
        cmocka_unit_test(denormals_are_flushed),
        cmocka_unit_test(nan_and_inf_propagate),
        cmocka_unit_test(misuse_faults),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
