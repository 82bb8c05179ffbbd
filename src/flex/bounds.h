/* Interval analysis of a mask_mod program over a block of scores: the range each register can take when q_idx and
 * kv_idx run over the block's rows and keys (b and h fixed), so that a block the program keeps or removes whole is
 * known without evaluating its scores (af_create_block_mask). Conservative: "unknown" whenever an operation's range
 * is not worked out exactly enough, never a wrong answer. */
#ifndef AF_FLEX_BOUNDS_H
#define AF_FLEX_BOUNDS_H
#include <stdbool.h>
#include <stdint.h>

#include "flex/program.h"

typedef struct {
    double lo, hi;   /* every value lies in [lo, hi] (int32 registers: integers) */
    bool nan;        /* a float32 register may also be NaN */
} af_bound;

enum { AF_BOUND_NEVER = 0, AF_BOUND_ALWAYS = 1, AF_BOUND_UNKNOWN = -1 };

/* Whether mask program m keeps every score (ALWAYS), none (NEVER) or some (UNKNOWN) of rows [q0, q1] and keys
 * [k0, k1] of (batch b, head h). scratch: m->n_regs bounds. */
int af_mod_block_bounds(const af_mod_checked *m, int64_t b, int64_t h, int64_t q0, int64_t q1, int64_t k0, int64_t k1,
                        af_bound *scratch);

/* Whether every LOAD of the call's programs reads inside its tensor for all b < B, h < H, q_idx < L, kv_idx < S
 * (and any score): proven by the same analysis, so false may only mean "not proven". A call it does not prove runs
 * into staged outputs (src/sdpa/staged.h), so that a LOAD found outside while running leaves the caller's untouched. */
bool af_mods_loads_inside(const af_mods *mods, int64_t B, int64_t H, int64_t L, int64_t S);

#endif
