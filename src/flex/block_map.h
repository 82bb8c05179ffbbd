/* FlexAttention's block mask (attnforge.h, af_block_mask) read once per call into a dense map of block classes: which
 * key blocks each query block of each (batch, head) skips, computes with mask_mod, or computes without it. O(blocks)
 * memory. The driver asks it for a row block's key range and a tile's class; af_mods_apply_row for a row's runs. */
#ifndef AF_FLEX_BLOCK_MAP_H
#define AF_FLEX_BLOCK_MAP_H
#include <stdint.h>

#include "attnforge.h"

enum { AF_BLOCK_EMPTY = 0, AF_BLOCK_PARTIAL = 1, AF_BLOCK_FULL = 2 };

typedef struct af_block_map {
    int64_t q_block, kv_block;
    int64_t nq, nk;        /* query blocks of the call's rows, key blocks of its keys */
    int64_t Bm, Hm;        /* 1 (broadcast) or B, Hq */
    uint8_t *cls;          /* [Bm][Hm][nq][nk]: AF_BLOCK_* */
    int32_t *first, *end;  /* [Bm][Hm][nq]: the non-empty key blocks lie in [first, end) (first = end: none) */
} af_block_map;

/* Check `bm` against a call of B batches, Hq query heads, L rows and S keys (a message naming the tensor and the rule
 * on error) and fill `map`. */
af_status af_block_map_build(const af_block_mask *bm, int64_t B, int64_t Hq, int64_t L, int64_t S, af_block_map *map);
void af_block_map_release(af_block_map *map);

/* The classes of the key blocks of query row i of (batch b, query head h): nk entries. */
static inline const uint8_t *af_block_row(const af_block_map *m, int64_t b, int64_t h, int64_t i) {
    const int64_t bi = m->Bm == 1 ? 0 : b, hi = m->Hm == 1 ? 0 : h;
    return m->cls + (size_t)(((bi * m->Hm + hi) * m->nq + i / m->q_block) * m->nk);
}

/* Over rows [i0, i1] of query heads [h0, h0 + nh) of batch b: the keys [*lo, *hi) any of them may see (block
 * bounds, clamped to S). */
void af_block_map_keys(const af_block_map *m, int64_t b, int64_t h0, int64_t nh, int64_t i0, int64_t i1, int64_t S,
                       int64_t *lo, int64_t *hi);

/* ... the class of keys [j0, j1) for all of those rows together: EMPTY when every one of their blocks is, FULL when
 * every one is full, else PARTIAL (rows then walk their own blocks). */
int af_block_map_tile(const af_block_map *m, int64_t b, int64_t h0, int64_t nh, int64_t i0, int64_t i1, int64_t j0,
                      int64_t j1);

#endif
