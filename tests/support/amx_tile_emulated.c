/* The AMX tile instructions in C (amx_tile_emulated.h). Tile state is per thread, as on the CPU: a worker that
 * forgets its own ldtilecfg faults here as it would there.
 *
 * TDPBF16PS follows the Intel SDM's operation (Vol. 2B, "TDPBF16PS—Dot Product of BF16 Tiles Accumulated into
 * Packed Single Precision Tile"): for each row m of the destination, two f32 partial sums per output column n,
 * temp[2n] over the even and temp[2n+1] over the odd elements of the pairs, each updated over k by an FP32 FMA
 * with DAZ = FTZ = 1 and round-to-nearest-even (MXCSR neither consulted nor updated), starting from 0; then
 * dst[m][n] := dst[m][n] + (temp[2n] + temp[2n+1]), each add rounded to nearest even with DAZ/FTZ. bf16 inputs
 * are made f32 by placing them in the upper 16 bits (make_fp32), and input denormals are treated as zero. (The
 * Intrinsics Guide's shorter form accumulates both products straight into dst in turn; the SDM's is emulated.)
 * Rows past the configured rows and bytes past colsb are zeroed on every write (write_row_and_zero,
 * zero_upper_rows). The hardware's internal order within one instruction is not promised bitwise by either
 * text; the tests compare the products against references within error bounds, never bit for bit. */
#include "amx_tile_emulated.h"

#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TILES 8
#define MAX_ROWS 16
#define MAX_COLSB 64

typedef struct {
    bool configured;
    uint8_t rows[TILES];
    uint16_t colsb[TILES];
    unsigned char data[TILES][MAX_ROWS][MAX_COLSB];
} tile_state;

static _Thread_local tile_state state;
static atomic_uint_least64_t dp_count;

static void fault(const char *what, int tile) {
    fprintf(stderr, "emulated AMX fault: %s (tile %d)\n", what, tile);
    abort();
}

static void check_tile(int t) {
    if (!state.configured) fault("tile instruction without a loaded configuration (#UD)", t);
    if (t < 0 || t >= TILES) fault("no such tile in palette 1", t);
    if (state.rows[t] == 0) fault("tile not configured (#UD)", t);
}

void amx_emu_loadconfig(const void *config) {
    const unsigned char *c = config;
    uint16_t colsb[16];
    memcpy(colsb, c + 16, sizeof colsb);
    const unsigned char *rows = c + 48;
    memset(&state, 0, sizeof state);   /* ldtilecfg zeroes every tile */
    if (c[0] == 0) return;             /* palette 0: tiles back in their init state */
    if (c[0] != 1) fault("palette other than 0 or 1 (#GP)", -1);
    if (c[1] != 0) fault("start_row must be 0 outside a restarted instruction", -1);
    for (int i = 2; i < 16; i++)
        if (c[i]) fault("reserved configuration bytes must be 0 (#GP)", -1);
    for (int t = 0; t < 16; t++) {
        if (t >= TILES && (colsb[t] || rows[t])) fault("tiles 8..15 do not exist in palette 1 (#GP)", t);
        if (t >= TILES) continue;
        if (rows[t] > MAX_ROWS || colsb[t] > MAX_COLSB) fault("tile larger than palette 1 allows (#GP)", t);
        if ((rows[t] == 0) != (colsb[t] == 0)) fault("rows and colsb must be both zero or both non-zero (#GP)", t);
        state.rows[t] = rows[t];
        state.colsb[t] = colsb[t];
    }
    state.configured = true;
}

void amx_emu_release(void) { memset(&state, 0, sizeof state); }

void amx_emu_zero(int t) {
    check_tile(t);
    memset(state.data[t], 0, sizeof state.data[t]);
}

void amx_emu_load(int t, const void *base, size_t stride) {
    check_tile(t);
    memset(state.data[t], 0, sizeof state.data[t]);
    for (int r = 0; r < state.rows[t]; r++) memcpy(state.data[t][r], (const char *)base + (size_t)r * stride, state.colsb[t]);
}

void amx_emu_store(int t, void *base, size_t stride) {
    check_tile(t);
    for (int r = 0; r < state.rows[t]; r++) memcpy((char *)base + (size_t)r * stride, state.data[t][r], state.colsb[t]);
}

/* DAZ on inputs and FTZ on results: a denormal becomes a zero of its sign. */
static float flush(float x) { return fpclassify(x) == FP_SUBNORMAL ? copysignf(0.0f, x) : x; }

static float bf16_at(int t, int row, int i) {   /* make_fp32 of element i (bf16) of a tile row, DAZ */
    uint16_t h;
    memcpy(&h, &state.data[t][row][2 * i], 2);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return flush(f);
}

void amx_emu_dpbf16ps(int c, int a, int b) {
    check_tile(c);
    check_tile(a);
    check_tile(b);
    if (c == a || c == b || a == b) fault("tdpbf16ps needs three different tiles (#UD)", c);
    if (state.colsb[a] % 4 || state.colsb[b] % 4 || state.colsb[c] % 4) fault("colsb not a whole number of pairs (#UD)", c);
    if (state.colsb[a] / 4 != state.rows[b]) fault("A's pairs per row must equal B's rows (#UD)", a);
    if (state.colsb[c] != state.colsb[b]) fault("C and B must have the same colsb (#UD)", b);
    if (state.rows[c] != state.rows[a]) fault("C and A must have the same rows (#UD)", c);
    const int K = state.colsb[a] / 4, N = state.colsb[c] / 4;
    for (int m = 0; m < state.rows[c]; m++) {
        float temp[2 * MAX_COLSB / 4] = {0};
        for (int k = 0; k < K; k++)
            for (int n = 0; n < N; n++) {
                temp[2 * n] = flush(fmaf(bf16_at(a, m, 2 * k), bf16_at(b, k, 2 * n), temp[2 * n]));
                temp[2 * n + 1] = flush(fmaf(bf16_at(a, m, 2 * k + 1), bf16_at(b, k, 2 * n + 1), temp[2 * n + 1]));
            }
        for (int n = 0; n < N; n++) {
            float dst;
            memcpy(&dst, &state.data[c][m][4 * n], 4);
            const float sum = flush(flush(dst) + flush(temp[2 * n] + temp[2 * n + 1]));
            memcpy(&state.data[c][m][4 * n], &sum, 4);
        }
        memset(&state.data[c][m][state.colsb[c]], 0, MAX_COLSB - state.colsb[c]);   /* write_row_and_zero */
    }
    for (int m = state.rows[c]; m < MAX_ROWS; m++) memset(state.data[c][m], 0, MAX_COLSB);   /* zero_upper_rows */
    atomic_fetch_add_explicit(&dp_count, 1, memory_order_relaxed);
}

uint64_t amx_emu_dp_count(void) { return atomic_load(&dp_count); }
