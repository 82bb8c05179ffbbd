/* The AMX bf16 ceiling for `attnforge bench --isa amx`: tdpbf16ps on resident tiles (4 accumulators fed by 2 A and
 * 2 B tiles, no loads), the matrix unit's own peak to compare the AMX path's bf16 rows with. Compiled with
 * -mamx-tile -mamx-bf16 where the compiler has them (CMakeLists.txt); elsewhere the loop is absent.
 * Never executed on this project's machines (no AMX there); the caller runs it only where af_isa_available("amx")
 * is true, which includes Linux's permission for tile state (core/cpu.c). */
#include "amx_peak.h"

#include <stdint.h>

#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>

typedef struct {   /* ldtilecfg's 64-byte operand, palette 1 */
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

bool bench_amx_tile_loop(long iterations) {
    static const _Alignas(64) tile_config config = {
        .palette_id = 1,
        .colsb = {64, 64, 64, 64, 64, 64, 64, 64},   /* 16 f32, or 32 bf16, per row */
        .rows = {16, 16, 16, 16, 16, 16, 16, 16},
    };
    _tile_loadconfig(&config);   /* tile state is per thread: each bench thread configures its own */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (long n = 0; n < iterations; n++) {   /* 4 independent accumulators: the unit's throughput, not latency */
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_release();
    return true;
}

bool bench_amx_tile_loop_built(void) { return true; }
#else
bool bench_amx_tile_loop_built(void) { return false; }

bool bench_amx_tile_loop(long iterations) {
    (void)iterations;
    return false;
}
#endif
