/* A C emulation of the AMX tile instructions the AMX products use (palette 1), following the pseudo-code of the
 * Intel SDM (Vol. 2, LDTILECFG, TILELOADD, TILESTORED, TILEZERO, TDPBF16PS, TILERELEASE): per-thread tile state,
 * rows and bytes per row from the loaded configuration, and a fault (message + abort, where the CPU raises #UD or
 * #GP) for every use the instructions forbid: tiles not configured, a bad configuration, shapes that do not chain,
 * the same tile twice in one tdpbf16ps. */
#ifndef AF_TESTS_AMX_TILE_EMULATED_H
#define AF_TESTS_AMX_TILE_EMULATED_H
#include <stddef.h>
#include <stdint.h>

void amx_emu_loadconfig(const void *config);   /* 64 bytes: palette, start_row, 14 reserved, colsb[16], rows[16] */
void amx_emu_release(void);
void amx_emu_zero(int tile);
void amx_emu_load(int tile, const void *base, size_t stride);
void amx_emu_store(int tile, void *base, size_t stride);
void amx_emu_dpbf16ps(int c, int a, int b);

/* tdpbf16ps instructions executed by all threads since start (to see whether a call took the tile path). */
uint64_t amx_emu_dp_count(void);

#endif
