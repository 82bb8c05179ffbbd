/* The FlashAttention forward driver: tiling, packing, masking, scheduling, split-KV and the epilogue.
 * The arithmetic on packed tiles belongs to the micro-kernel (ukernel.h); nothing here depends on the ISA.
 *
 * Rows: the query heads of one GQA group are packed into the rows of one tile (pack-GQA): packed row r of
 * key/value head hk is query position r / G of query head hk·G + r % G, so a K/V tile is packed once for the
 * whole group and causal limits grow monotonically with r. A work item is (batch, kv head, row block, kv split).
 *
 * FlashAttention features (af_flash_attn) live here, not in the micro-kernels: a window or causality limits each row
 * block to the key tiles its rows can see (af_key_range), so the cost grows with the window; softcap transforms the
 * S block before the softmax step; the sink joins the row's max and sum when the row is stored; varlen sequences are
 * items of their own length (row blocks past a sequence's rows do nothing); paged K/V rows are found through
 * af_kv_row_offset, tiles gathered row by row or in page-contiguous runs (direct kernels read pages in place).
 *
 * Invariance (docs/API.md): a row reduces its keys in KEY_CHUNK chunks at fixed key positions, folded in order
 * (fold_row) whether split-KV ran them apart or not, over tiles whose size follows its kernels alone, and each
 * sequence picks its kernels by its own rows: its bits depend on its keys, never on its batch, layout or threads. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/dtype.h"
#include "core/log.h"
#include "core/status.h"
#include "core/threadpool.h"
#include "flex/block_map.h"
#include "flex/program.h"
#include "kernel/flash.h"
#include "kernel/softcap.h"
#include "kernel/tiling.h"
#include "kernel/ukernel.h"

#define KEY_CHUNK 512           /* every row reduces its keys in chunks of this many, at fixed key positions, folded in
                                   order (fold_row): a row's bits never depend on the batch, the split or the threads */
#define SPLIT_KEYS_MAX 2048     /* most keys per split-KV work item: each starts on a tile nothing prefetched
                                   (docs/BENCHMARKS-HISTORY.md, third round) */
#define SPLIT_ITEMS 128         /* splits as long as leaves this many work items: two for each of 64 threads */
#define SPLIT_MAX_ROWS 64       /* split the keys only when one (batch, kv head) has at most this many rows */
#define DIRECT_MAX_ROWS 16      /* sequences with this few rows per kv head read K/V in place (scores_direct /
                                   values_direct): nothing to amortise a K^T pack over */
#define DIRECT_MAX_HEADS 32     /* kv heads per direct item at most: their row states share the thread's scratch */
#define TILE_CACHE_BYTES ((size_t)16 << 20)   /* all threads' caches of packed K/V tiles together (see below) */

/* The packed K^T and V tiles of the (batch, kv head) a thread last worked on, kept in its scratch so that the next
 * row block of the same head reuses them instead of packing again (the Kᵀ transpose and the V copy were 11% of a
 * prefill's time, ~25% on a transformer's (B,L,H,E) memory). Lives in the scratch's first 64 bytes, which
 * af_parallel_for zeroes. Tiles are packed whole and in order: tiles [0, packed) are valid. */
typedef struct {
    int64_t b_plus_1;   /* 0: empty */
    int64_t hk, first, packed;   /* tiles [first, packed) are valid (a window starts past tile 0) */
} tile_cache;

typedef struct {
    const af_problem *p;
    const af_ukernel *uk;
    const af_products *px;      /* the micro-kernel's own products for this call, or NULL: the f32 path */
    int block_rows, block_keys; /* block_keys: the key tiles of product / packed items */
    int direct_keys;            /* ... of direct items: the table's own tile, whatever the layout (a row's bits follow
                                   its tiles' bounds) */
    int direct_rows;            /* a sequence with at most this many rows per kv head runs as direct items (0: none) */
    int E, Ev;
    int keys_pad, ev_pad;       /* padded leading dims of the S/P and V/O tiles */
    int64_t rows_total;         /* L·G packed rows per (batch, kv head) */
    int64_t row_blocks, splits, split_keys;
    int64_t chunks_per_split;   /* split_keys / KEY_CHUNK: split-KV keeps one partial per chunk */
    bool pre_scale;             /* S = S·scale (+ mask) before the softmax: masks and scale <= 0 need it */
    bool v_direct;              /* f32 V already laid out as the P·V gemm wants it: no V tile is packed */
    bool direct;                /* some sequences have few rows: their items read K and V in place (direct_rows) */
    bool all_direct;            /* ... every sequence: items may span several kv heads (heads_per_item) */
    bool tile_cache;            /* keep every packed tile of the current (batch, kv head): tile_cache above */
    size_t cache_kt_floats, cache_tile_floats;   /* per cached tile: Kᵀ (E × keys_pad), then V (keys × ev_pad) */
    int exp2_degree;
    size_t elem;                /* bytes per k/v element */
    size_t q_elem;              /* bytes per q element (float8 K/V: q may be wider) */
    size_t out_elem;            /* bytes per out element */
    float *partials;            /* splits > 1: per (batch, kv head, row block, key chunk), rows × (ev_pad + 2)
                                   floats: O, then m and l */
    bool prefetch;              /* direct items: prefetch the next tile's K/V rows (prefetch_cursor) */
    bool prefetch_v_now;        /* ... one-head items over contiguous rows: this tile's V, then half the next K (run_item) */
    bool prefetch_phased;       /* ... multi-head items, f32 or <= 2 rows a kv head: all scores (this V), then values */
    size_t prefetch_key_bytes;  /* bytes of one key's K rows of an item's heads, gaps included */
    size_t prefetch_value_bytes;/* ... of its V rows */
    int heads_per_item;         /* kv heads per work item: 1, or all of them for direct items over interleaved heads */
    size_t off_qp, off_kt, off_v, off_rows, off_cache;   /* scratch layout, bytes */
    size_t off_stage;           /* products over paged K/V: a tile's rows copied page run by page run (else 0) */
    size_t off_mod;             /* af_flex_attn's mods: their registers, one set per thread (else 0) */
    size_t off_q, off_s, off_o, off_m, off_l, off_a;   /* row_state slot 0; slot h is state_bytes·h on */
    size_t off_ao, off_am, off_al, state_bytes;       /* ... the rows' folded chunks */
} flash_plan;

typedef struct {
    int64_t b, hk, rb, split;
    af_sequence seq;   /* batch b's query rows and keys */
} work_item;

/* Work item t: (batch, chunk of `heads` kv heads, row block, split), split fastest. heads is 1 except for direct
 * items over interleaved heads (heads_per_item); combine_item passes 1 to walk (batch, kv head, row block). */
static work_item decode_item(const flash_plan *fp, int64_t t, int heads) {
    const af_problem *p = fp->p;
    work_item w;
    w.split = t % fp->splits;
    t /= fp->splits;
    /* Neighbours share a (batch, head): its K/V stays in cache and a thread's tile cache serves its next item.
     * Causal: within a head the longest row blocks (the most keys) come first, so the last items are short. */
    const bool longest_first =
        p->causal != AF_CAUSAL_NONE || (p->has_window && p->window_right != AF_WINDOW_UNBOUNDED);
    w.rb = longest_first ? fp->row_blocks - 1 - t % fp->row_blocks : t % fp->row_blocks;
    t /= fp->row_blocks;
    const int64_t chunks = af_ceil_div(p->Hkv, heads);
    w.hk = t % chunks * heads;
    w.b = t / chunks;
    w.seq = af_sequence_of(p, w.b);
    return w;
}

/* The same item on kv head hk (the other heads of a multi-head item). */
static work_item with_head(const work_item *w, int64_t hk) {
    work_item h = *w;
    h.hk = hk;
    return h;
}

/* True when af_flex_attn's block mask leaves out every key of tile [j0, j0 + cols) for packed row r of the item. */
static bool row_blocks_empty(const flash_plan *fp, const work_item *w, int64_t r, int64_t j0, int cols) {
    const af_problem *p = fp->p;
    const int64_t i = r / p->group, h = w->hk * p->group + r % p->group;
    return af_block_map_tile(p->mods->blocks, w->b, h, 1, i, i, j0, j0 + cols) == AF_BLOCK_EMPTY;
}

/* Rows of the item's row block within its sequence (0: the block lies past the sequence's rows). */
static int block_rows_of(const flash_plan *fp, const work_item *w) {
    const int64_t r0 = w->rb * fp->block_rows, total = w->seq.L * fp->p->group;
    return r0 >= total ? 0 : (int)(total - r0 < fp->block_rows ? total - r0 : fp->block_rows);
}

/* The keys [*lo, *hi) packed row r of the item may see. */
static void row_key_range(const flash_plan *fp, const work_item *w, int64_t r, int64_t *lo, int64_t *hi) {
    af_key_range(fp->p, w->seq.L, w->seq.S, r / fp->p->group, lo, hi);
}

/* Keys from j that lie contiguously in memory, at most `left`: all of them unless K/V are paged. */
static int run_length(const flash_plan *fp, int64_t j, int left) {
    if (!fp->p->page_table) return left;
    const int64_t in_page = fp->p->page_size - j % fp->p->page_size;
    return in_page < left ? (int)in_page : left;
}

static const char *qrow_ptr(const flash_plan *fp, const work_item *w, int64_t r, int64_t *h_out, int64_t *i_out) {
    const af_problem *p = fp->p;
    const int64_t i = r / p->group, h = w->hk * p->group + r % p->group;
    *h_out = h;
    *i_out = i;
    return p->q + (size_t)(w->b * p->q_stride[0] + h * p->q_stride[1] + (w->seq.q0 + i) * p->q_stride[2]) * fp->q_elem;
}

/* Where key / value row j of the work item's (batch, kv head) starts (varlen and paged: af_kv_row_offset). */
static const char *key_row(const flash_plan *fp, const work_item *w, int64_t j) {
    const af_problem *p = fp->p;
    return p->k + (size_t)af_kv_row_offset(p, p->k_stride, w->b, w->hk, &w->seq, j) * fp->elem;
}

static const char *value_row(const flash_plan *fp, const work_item *w, int64_t j) {
    const af_problem *p = fp->p;
    return p->v + (size_t)af_kv_row_offset(p, p->v_stride, w->b, w->hk, &w->seq, j) * fp->elem;
}

/* The item's K (or V) rows of keys j0..j0+cols as one base and key stride, for the products' packers, which read a
 * tile from one base: in place when the rows lie one stride apart (not paged, or the tile within one page), else
 * copied page run by page run into `stage`. The packed tile is then the same as from a contiguous cache, so paged
 * K/V give the contiguous path's bits. */
static const char *rows_for_products(const flash_plan *fp, const work_item *w, int64_t j0, int cols, bool values,
                                     char *stage, size_t *stride) {
    const af_problem *p = fp->p;
    const size_t row_stride = (size_t)(values ? p->v_stride[2] : p->k_stride[2]) * fp->elem;
    const size_t row_bytes = (size_t)(values ? fp->Ev : fp->E) * fp->elem;
    *stride = row_stride;
    if (run_length(fp, j0, cols) == cols) return values ? value_row(fp, w, j0) : key_row(fp, w, j0);
    for (int j = 0; j < cols;) {
        const int run = run_length(fp, j0 + j, cols - j);
        const char *src = values ? value_row(fp, w, j0 + j) : key_row(fp, w, j0 + j);
        for (int r = 0; r < run; r++) memcpy(stage + (size_t)(j + r) * row_bytes, src + (size_t)r * row_stride, row_bytes);
        j += run;
    }
    *stride = row_bytes;
    return stage;
}

/* K tile transposed: kt[e][j] for keys j0..j0+cols, zero-padded to a whole vector of columns. */
static void pack_key_tile(const flash_plan *fp, const work_item *w, int64_t j0, int cols, float *kt, float *row) {
    const af_problem *p = fp->p;
    if (fp->uk->pack_kt && p->k_stride[3] == 1 && run_length(fp, j0, cols) == cols) {   /* transposing packer */
        const char *src = key_row(fp, w, j0);
        fp->uk->pack_kt(cols, fp->E, src, (size_t)p->k_stride[2] * fp->elem, p->kv_dtype, kt, fp->keys_pad);
        return;
    }
    const int padded = (int)af_round_up((size_t)cols, AF_TILE_PAD);
    for (int j = 0; j < cols; j++) {
        const char *src = key_row(fp, w, j0 + j);
        af_load_f32(fp->uk, row, src, p->kv_dtype, p->k_stride[3], fp->E, fp->elem);
        for (int e = 0; e < fp->E; e++) kt[(size_t)e * fp->keys_pad + j] = row[e];
    }
    if (padded > cols)
        for (int e = 0; e < fp->E; e++) memset(kt + (size_t)e * fp->keys_pad + cols, 0, sizeof(float) * (size_t)(padded - cols));
}

/* Ask for key row j of the K and V tile at key `next` (< next_end) to be brought into L2 — spread over the current
 * tile's work, so that the next packing finds its rows there: rows far apart (a transformer's (B,L,H,E) memory:
 * one row per 4 KiB page or more) get no help from the hardware prefetchers, which stop at page boundaries. */
static void prefetch_next_row(const flash_plan *fp, const work_item *w, int64_t next, int64_t next_end, int j) {
    const af_problem *p = fp->p;
    if (next + j >= next_end) return;
    const char *k = key_row(fp, w, next + j);
    const char *v = value_row(fp, w, next + j);
    if (p->k_stride[3] == 1)   /* a strided head dim spans too many lines to be worth it */
        for (size_t b = 0; b < (size_t)fp->E * fp->elem; b += 64) __builtin_prefetch(k + b, 0, 2);
    if (p->v_stride[3] == 1)
        for (size_t b = 0; b < (size_t)fp->Ev * fp->elem; b += 64) __builtin_prefetch(v + b, 0, 2);
}

/* V tile: vt[j][e], each row zero-padded to ev_pad; meanwhile the rows of the tile at `next` are prefetched. */
static void pack_value_tile(const flash_plan *fp, const work_item *w, int64_t j0, int cols, float *vt, int64_t next,
                            int64_t next_end) {
    const af_problem *p = fp->p;
    for (int j = 0; j < cols; j++) {
        float *dst = vt + (size_t)j * fp->ev_pad;
        const char *src = value_row(fp, w, j0 + j);
        prefetch_next_row(fp, w, next, next_end, j);
        af_load_f32(fp->uk, dst, src, p->kv_dtype, p->v_stride[3], fp->Ev, fp->elem);
        memset(dst + fp->Ev, 0, sizeof(float) * (size_t)(fp->ev_pad - fp->Ev));
    }
}

/* What a flex block mask makes of a tile for the rows that run it: blocks of every class (or no block mask: rows
 * walk their own blocks), only full blocks (the mods run with no block lookup and no mask_mod), or only full blocks
 * and no score_mod (plain attention). */
typedef enum { TILE_MIXED, TILE_FULL, TILE_PLAIN } tile_blocks;

/* After the mods' registers in a thread's scratch: the rows their last call was for (the registers that follow from
 * the rows alone serve the next tile of the same rows: AF_MODS_SAME_ROWS; rows < 0: none, as at each item's start),
 * then the rows' heads and positions. */
typedef struct {
    int64_t r0, hk;
    int32_t rows, pad_[11];   /* 64 bytes: the heads after it stay aligned */
} mod_rows;

/* Floats of the mods' registers before the record, to a 64-byte boundary. */
static size_t mod_regs_floats(const af_problem *p, int block_rows, int keys_pad) {
    return af_round_up(af_mods_scratch_floats(p->mods, block_rows, keys_pad), 16);
}

static mod_rows *mod_rows_of(const flash_plan *fp, float *mod_regs) {
    return (mod_rows *)(mod_regs + mod_regs_floats(fp->p, fp->block_rows, fp->keys_pad));
}

/* S = S·scale + mask, or the mods (af_flex_attn), which scale the tile in their own vector code (scale 1: a softcap
 * applied it, or the exponent takes it: no score_mod), for the tiles that need the scale applied before the softmax. */
static void apply_scale_and_mask(const flash_plan *fp, const work_item *w, int64_t r0, int rows, int64_t j0, int cols,
                                 float *S, float scale, tile_blocks blocks, float *mod_regs) {
    const af_problem *p = fp->p;
    if (p->mods) {   /* the rows' query heads and positions after the registers, then the whole tile at once */
        mod_rows *last = mod_rows_of(fp, mod_regs);
        int32_t *h_rows = (int32_t *)(last + 1), *q_rows = h_rows + rows;
        const bool same = last->rows == rows && last->r0 == r0 && last->hk == w->hk;   /* the next tile of them */
        last->r0 = r0;
        last->hk = w->hk;
        last->rows = rows;
        for (int r = 0; r < rows && !same; r++) {   /* the same rows: their heads and positions are there */
            q_rows[r] = (int32_t)((r0 + r) / p->group);
            h_rows[r] = (int32_t)(w->hk * p->group + (r0 + r) % p->group);
        }
        const unsigned hints = (blocks == TILE_FULL ? AF_MODS_FULL : 0) | (same ? AF_MODS_SAME_ROWS : 0);
        af_mods_apply_tile(p->mods, w->b, h_rows, q_rows, rows, j0, cols, scale, hints, S, fp->keys_pad, mod_regs,
                           fp->keys_pad);
        return;   /* af_problem_check: no dense mask beside mods */
    }
    for (int r = 0; r < rows && scale != 1.0f; r++) {
        float *s = S + (size_t)r * fp->keys_pad;
        for (int j = 0; j < cols; j++) s[j] *= scale;
    }
    for (int r = 0; r < rows && p->mask; r++) {
        float *s = S + (size_t)r * fp->keys_pad;
        const int64_t i = (r0 + r) / p->group, h = w->hk * p->group + (r0 + r) % p->group;
        const char *m = p->mask + (w->b * p->mask_stride[0] + h * p->mask_stride[1] + i * p->mask_stride[2] +
                                   j0 * p->mask_stride[3]) * (int64_t)af_dtype_size(p->mask_dtype);
        const int64_t ms = p->mask_stride[3] * (int64_t)af_dtype_size(p->mask_dtype);
        if (p->mask_dtype == AF_BOOL) {
            for (int j = 0; j < cols; j++)
                if (!*(const uint8_t *)(m + j * ms)) s[j] = -INFINITY;
        } else {
            for (int j = 0; j < cols; j++) s[j] += af_load_as_f32(m + j * ms, p->mask_dtype);
        }
    }
}

/* Softcap: S = cap·tanh(S·scale / cap) (scale first: the cap applies to the scaled score). */
static void apply_softcap(const flash_plan *fp, int rows, int cols, float *S, double scale) {
    const float cap = (float)fp->p->softcap, k = (float)(scale / fp->p->softcap);
    for (int r = 0; r < rows; r++) af_softcap_row(S + (size_t)r * fp->keys_pad, cols, k, cap);
}

/* Causality and window: -inf for the keys of this tile outside a row's range. */
static void apply_key_range(const flash_plan *fp, const work_item *w, int64_t r0, int rows, int64_t j0, int cols,
                            float *S) {
    for (int r = 0; r < rows; r++) {
        int64_t lo, hi;
        row_key_range(fp, w, r0 + r, &lo, &hi);
        float *s = S + (size_t)r * fp->keys_pad;
        for (int64_t j = 0; j < cols && j < lo - j0; j++) s[j] = -INFINITY;
        for (int64_t j = hi - j0 < 0 ? 0 : hi - j0; j < cols; j++) s[j] = -INFINITY;
    }
}

/* Write one finished row: out = O / l in the output dtype, lse = (m + log2 l)·ln 2. A sink (log2 units: sink·log2 e,
 * the scores' units) joins the max and the sum here, never O: FA4's learnable_sink. */
static void store_row(const flash_plan *fp, const work_item *w, int64_t h, int64_t i, float *o, float m, float l) {
    const af_problem *p = fp->p;
    float o_scale = 1.0f;
    if (p->sink) {
        const float sink = af_load_as_f32(p->sink + h * p->sink_stride * (int64_t)af_dtype_size(p->sink_dtype),
                                          p->sink_dtype) * 1.44269504088896341f;
        if (sink > m) {   /* the sink is the new max: rescale what the keys gave (m = -inf: nothing) */
            o_scale = exp2f(m - sink);
            l = l * o_scale + 1.0f;
            m = sink;
        } else if (sink != -INFINITY) {
            l += exp2f(sink - m);   /* NaN m or sink: NaN l, as the reference */
        }
    }
    const float v_descale = af_descale_at(p->v_descale, p->v_descale_stride, w->b, w->hk);   /* FA4: on the output */
    const float inv = l > 0.0f || l != l ? o_scale * v_descale / l : 0.0f;   /* no visible key: 0, as documented */
    const int64_t b = w->b;
    i += w->seq.q0;
    const size_t row = (size_t)(b * p->out_stride[0] + h * p->out_stride[1] + i * p->out_stride[2]);
    char *dst = fp->Ev == 0 ? NULL : p->out + row * fp->out_elem;   /* Ev = 0: out has no elements, may be NULL */
    const int64_t os = p->out_stride[3];
    if (p->out_dtype == AF_F32 && os == 1) {
        float *d = (float *)dst;
        for (int e = 0; e < fp->Ev; e++) d[e] = o[e] * inv;
    } else if (p->out_dtype == AF_BF16 && os == 1) {   /* one loop the compiler vectorises: 6% of a bf16 prefill */
        uint16_t *d = (uint16_t *)dst;
        for (int e = 0; e < fp->Ev; e++) d[e] = af_f32_to_bf16(o[e] * inv);
    } else {
        for (int e = 0; e < fp->Ev; e++) af_store_from_f32(dst + (size_t)(e * os) * fp->out_elem, p->out_dtype, o[e] * inv);
    }
    if (p->lse)
        p->lse[b * p->lse_stride[0] + h * p->lse_stride[1] + i * p->lse_stride[2]] =
            l > 0.0f || l != l ? (m + log2f(l)) * 0.69314718055994531f : -INFINITY;
}

/* One kv head's rows of a work item: its slot of the thread's scratch (an item spanning several heads has one each).
 * O, m, l: the online softmax over the current key chunk; ao, am, al: the chunks before it, folded (fold_row). */
typedef struct {
    float *qb, *S, *O, *m, *l, *alpha;
    float *ao, *am, *al;
    float *mod;   /* the mods' registers (the thread's, shared by its slots), or NULL */
} row_state;

static row_state state_of(const flash_plan *fp, char *base, int slot) {
    char *s = base + (size_t)slot * fp->state_bytes;
    return (row_state){.qb = (float *)(s + fp->off_q), .S = (float *)(s + fp->off_s), .O = (float *)(s + fp->off_o),
                       .m = (float *)(s + fp->off_m), .l = (float *)(s + fp->off_l), .alpha = (float *)(s + fp->off_a),
                       .ao = (float *)(s + fp->off_ao), .am = (float *)(s + fp->off_am),
                       .al = (float *)(s + fp->off_al),
                       .mod = fp->off_mod ? (float *)(base + fp->off_mod) : NULL};
}

/* A fresh online softmax for rows [0, rows): m = -inf, l = 0, O = 0. */
static void reset_softmax(const flash_plan *fp, float *O, float *m, float *l, int rows) {
    for (int r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(O, 0, sizeof(float) * (size_t)rows * (size_t)fp->ev_pad);
}

/* Load the block's query rows as f32 and start their online softmax and their folded result. */
static void begin_rows(const flash_plan *fp, const work_item *w, const row_state *rs, int64_t r0, int rows) {
    const af_problem *p = fp->p;
    for (int r = 0; r < rows; r++) {
        int64_t h, i;
        const char *src = qrow_ptr(fp, w, r0 + r, &h, &i);
        af_load_f32(fp->uk, rs->qb + (size_t)r * fp->E, src, p->dtype, p->q_stride[3], fp->E, fp->q_elem);
    }
    reset_softmax(fp, rs->O, rs->m, rs->l, rows);
    reset_softmax(fp, rs->ao, rs->am, rs->al, rows);
}

/* One key chunk's unnormalised row (o, m, l) folded into the row's result so far (acc, *am, *al). Every row goes
 * through this one reduction, chunk after chunk in key order, whether its chunks ran in one work item or in split-KV
 * items (combine_item): a row's bits then depend on its keys alone. One instance (noinline), so that no call site
 * gets its own contraction of the multiply-adds. A chunk that saw no key of the row changes nothing but a NaN sum. */
__attribute__((noinline)) static void fold_row(int Ev, const float *o, float m, float l, float *acc, float *am,
                                               float *al) {
    if (m == -INFINITY) {
        if (l != l) *al = l;
        return;
    }
    if (*am == -INFINITY) {   /* the first chunk that saw a key: acc·0 + o·1 is o (acc holds no NaN yet) */
        memcpy(acc, o, sizeof(float) * (size_t)Ev);
        *al = *al * 0.0f + l;
        *am = m;
        return;
    }
    const float m_new = m > *am ? m : *am;
    /* exp2f(0) is 1: skipping it changes no bit */
    const float wa = *am == m_new ? 1.0f : exp2f(*am - m_new), wc = m == m_new ? 1.0f : exp2f(m - m_new);
    for (int e = 0; e < Ev; e++) acc[e] = acc[e] * wa + o[e] * wc;
    *al = *al * wa + l * wc;
    *am = m_new;
}

/* From the raw S block of rows [skip, end) to P: softcap or scale and mask, the causal/window limits on the tiles
 * that cross them (`edge`), the softmax step, and O rescaled where a row's max moved. `blocks`: what a flex block
 * mask makes of the tile (TILE_PLAIN: plain attention, the scale folded into the exponent, no mods). */
static void softmax_tile(const flash_plan *fp, const work_item *w, const row_state *rs, int64_t r0, int skip, int end,
                         int64_t j0, int cols, bool edge, tile_blocks blocks) {
    const af_problem *p = fp->p;
    const int n = end - skip;
    float *Sn = rs->S + (size_t)skip * fp->keys_pad;
    /* float8 descales of the (batch, kv head) join the scale; c folds it into the exponent when it is > 0 */
    const double scale = p->scale * af_descale_at(p->q_descale, p->q_descale_stride, w->b, w->hk) *
                         af_descale_at(p->k_descale, p->k_descale_stride, w->b, w->hk);
    const bool plain = blocks == TILE_PLAIN;
    const bool pre_scale = (fp->pre_scale && !plain) || !(scale > 0.0);
    const double log2e = 1.4426950408889634;
    const float c = (float)(pre_scale ? log2e : scale * log2e);   /* the multiplier folded into the exponent */
    if (p->softcap > 0.0) {   /* af_flash_attn: no mask; a mask_mod (never a score_mod) after the cap */
        apply_softcap(fp, n, cols, Sn, scale);
        if (p->mods && !plain) apply_scale_and_mask(fp, w, r0 + skip, n, j0, cols, Sn, 1.0f, blocks, rs->mod);
    } else if (pre_scale) {
        apply_scale_and_mask(fp, w, r0 + skip, n, j0, cols, Sn, (float)scale, blocks, rs->mod);
    } else if (p->mods && !plain) {   /* a mask_mod alone: the scale stays in the exponent */
        apply_scale_and_mask(fp, w, r0 + skip, n, j0, cols, Sn, 1.0f, blocks, rs->mod);
    }
    if (edge) apply_key_range(fp, w, r0 + skip, n, j0, cols, Sn);
    fp->uk->softmax_step(n, cols, Sn, fp->keys_pad, c, rs->m + skip, rs->l + skip, rs->alpha + skip, fp->exp2_degree);
    if (fp->Ev == 0) return;
    for (int r = skip; r < end; r++)
        if (rs->alpha[r] != 1.0f) fp->uk->scale_row(rs->O + (size_t)r * fp->ev_pad, fp->Ev, rs->alpha[r]);
}

/* The next tile's K or V rows of an item's kv heads, walked in memory order a page run at a time, handed out to the
 * direct kernels as lines to prefetch while they compute on this tile (af_prefetch). */
typedef struct {
    const work_item *item;   /* on its first kv head */
    bool values;             /* V rows, else K rows */
    int64_t j, j_end;        /* keys of the tile not yet handed out */
    size_t done;             /* lines of key j's run already handed out */
} prefetch_cursor;

/* Up to `want` lines of the cursor's current run: the rows of keys [j, j + run) of the item's heads, one span from
 * the first row of its first head to the end of the last row of its last head. */
static af_prefetch next_prefetch(const flash_plan *fp, prefetch_cursor *c, size_t want) {
    /* Ev = 0: V has no rows to address (its data may be NULL) */
    if (!fp->prefetch || c->j >= c->j_end || want == 0 || (c->values && fp->Ev == 0)) return (af_prefetch){NULL, 0};
    const af_problem *p = fp->p;
    const bool values = c->values;
    const int64_t *st = values ? p->v_stride : p->k_stride;
    const int run = run_length(fp, c->j, (int)(c->j_end - c->j));   /* at most a tile's keys */
    const char *first = values ? value_row(fp, c->item, c->j) : key_row(fp, c->item, c->j);
    const size_t skew = (uintptr_t)first % 64;
    const size_t span = (size_t)((run - 1) * st[2] + (fp->heads_per_item - 1) * st[1] + (values ? fp->Ev : fp->E)) *
                        fp->elem;
    const size_t lines = (skew + span + 63) / 64;
    const size_t n = lines - c->done < want ? lines - c->done : want;
    const af_prefetch pf = {first - skew + c->done * 64, n};
    c->done += n;
    if (c->done == lines) {
        c->j += run;
        c->done = 0;
    }
    return pf;
}

/* The tile's K and V rows of the item's first kv head (rows of a later head are a fixed offset away), so the direct
 * kernels take a tile in one call whatever the pages. One address computation per page run, the rest a stride
 * apart: one per key cost 6% of a one-head f16 decode with K/V in cache. */
static void tile_rows(const flash_plan *fp, const work_item *item, int64_t j0, int cols, const char **k_rows,
                      const char **v_rows) {
    const af_problem *p = fp->p;
    const size_t k_step = (size_t)p->k_stride[2] * fp->elem, v_step = (size_t)p->v_stride[2] * fp->elem;
    for (int c = 0; c < cols;) {   /* a page run at a time (the whole tile without pages): rows a stride apart */
        const int run = run_length(fp, j0 + c, cols - c);
        const char *k = key_row(fp, item, j0 + c);
        const char *v = fp->Ev ? value_row(fp, item, j0 + c) : NULL;   /* Ev = 0: V's data may be NULL */
        for (int i = 0; i < run; i++, c++) {
            k_rows[c] = k + (size_t)i * k_step;
            v_rows[c] = v ? v + (size_t)i * v_step : NULL;
        }
    }
}

/* The direct kernels on one tile of kv head `h` of the item (its rows at k_rows/v_rows plus h head strides), K and V
 * read where they lie, in two halves: the scores (prefetching pf meanwhile), then the softmax step and the values
 * (prefetching pf). */
static void direct_scores(const flash_plan *fp, int h, const row_state *rs, int skip, int end, int cols,
                          const char *const *k_rows, af_prefetch pf) {
    const af_problem *p = fp->p;
    fp->uk->scores_direct(end - skip, cols, fp->E, rs->qb + (size_t)skip * fp->E, fp->E, k_rows,
                          (size_t)(h * p->k_stride[1]) * fp->elem, p->kv_dtype, rs->S + (size_t)skip * fp->keys_pad,
                          fp->keys_pad, pf);
}

static void direct_values(const flash_plan *fp, const work_item *w, int h, const row_state *rs, int64_t r0, int skip,
                          int end, int64_t j0, int cols, bool edge, tile_blocks blocks, const char *const *v_rows,
                          af_prefetch pf) {
    const af_problem *p = fp->p;
    softmax_tile(fp, w, rs, r0, skip, end, j0, cols, edge, blocks);
    if (fp->Ev == 0) return;
    fp->uk->values_direct(end - skip, fp->Ev, cols, rs->S + (size_t)skip * fp->keys_pad, fp->keys_pad, v_rows,
                          (size_t)(h * p->v_stride[1]) * fp->elem, p->kv_dtype, rs->O + (size_t)skip * fp->ev_pad,
                          fp->ev_pad, pf);
}

/* Where split-KV keeps key chunk `chunk` of the item's (batch, kv head, row block): rows × (ev_pad + 2) floats. */
static float *partial_of(const flash_plan *fp, const work_item *w, int64_t chunk) {
    const int64_t chunks = fp->splits * fp->chunks_per_split;
    const int64_t index = ((w->b * fp->p->Hkv + w->hk) * fp->row_blocks + w->rb) * chunks + chunk;
    return fp->partials + (size_t)index * (size_t)fp->block_rows * ((size_t)fp->ev_pad + 2);
}

/* The end of key chunk `chunk` (counted from the sequence's first key) for the rows of one kv head: split-KV keeps it
 * for combine_item, else it is folded into the rows' result here; the next chunk, if `more` follow, starts a fresh
 * online softmax. */
static void close_chunk(const flash_plan *fp, const work_item *w, const row_state *rs, int rows, int64_t chunk,
                        bool more) {
    if (fp->splits > 1) {
        const size_t row_floats = (size_t)fp->ev_pad + 2;
        float *part = partial_of(fp, w, chunk);
        for (int r = 0; r < rows; r++) {
            float *dst = part + (size_t)r * row_floats;
            memcpy(dst, rs->O + (size_t)r * fp->ev_pad, sizeof(float) * (size_t)fp->Ev);
            dst[fp->ev_pad] = rs->m[r];
            dst[fp->ev_pad + 1] = rs->l[r];
        }
    } else {
        for (int r = 0; r < rows; r++)
            fold_row(fp->Ev, rs->O + (size_t)r * fp->ev_pad, rs->m[r], rs->l[r], rs->ao + (size_t)r * fp->ev_pad,
                     rs->am + r, rs->al + r);
    }
    if (more) reset_softmax(fp, rs->O, rs->m, rs->l, rows);
}

/* close_chunk for each of the item's kv heads (their row_state slots in the thread's scratch). */
static void close_chunk_heads(const flash_plan *fp, const work_item *w, char *base, int heads, int rows, int64_t chunk,
                              bool more) {
    for (int h = 0; h < heads; h++) {
        const work_item wh = with_head(w, w->hk + h);
        const row_state rh = state_of(fp, base, h);
        close_chunk(fp, &wh, &rh, rows, chunk, more);
    }
}

/* Split-KV: every chunk of the item's split starts as seen-nothing (m = -inf, l = 0), for the chunks its rows never
 * reach. */
static void clear_split_chunks(const flash_plan *fp, const work_item *w, int rows) {
    const size_t row_floats = (size_t)fp->ev_pad + 2;
    for (int64_t c = 0; c < fp->chunks_per_split; c++) {
        float *part = partial_of(fp, w, w->split * fp->chunks_per_split + c);
        for (int r = 0; r < rows; r++) {
            part[(size_t)r * row_floats + fp->ev_pad] = -INFINITY;
            part[(size_t)r * row_floats + fp->ev_pad + 1] = 0.0f;
        }
    }
}

/* The block's finished rows, stored normalised (split-KV: combine_item does it). */
static void finish_rows(const flash_plan *fp, const work_item *w, const row_state *rs, int64_t r0, int rows) {
    if (fp->splits > 1) return;
    for (int r = 0; r < rows; r++) {
        int64_t h, i;
        qrow_ptr(fp, w, r0 + r, &h, &i);
        store_row(fp, w, h, i, rs->ao + (size_t)r * fp->ev_pad, rs->am[r], rs->al[r]);
    }
}

/* True when the item's sequence runs on the direct kernels: few rows per kv head, so that a row's arithmetic follows
 * its own sequence, never the longest one of the batch. */
static bool item_direct(const flash_plan *fp, const work_item *w) {
    return fp->direct && w->seq.L * fp->p->group <= fp->direct_rows;
}

static void run_item(void *ctx, int64_t t, void *scratch) {
    const flash_plan *fp = ctx;
    const af_problem *p = fp->p;
    const af_ukernel *uk = fp->uk;
    const work_item w = decode_item(fp, t, fp->heads_per_item);
    char *base = scratch;
    float *kt = (float *)(base + fp->off_kt), *vt = (float *)(base + fp->off_v);
    void *qpack = base + fp->off_qp;   /* products only: kt and vt then hold the products' packed K and V */

    const int64_t r0 = w.rb * fp->block_rows;
    const int rows = block_rows_of(fp, &w);
    if (rows == 0) return;   /* past this sequence's rows (varlen): no work, and combine_item reads nothing */
    /* The item's kv heads, one row_state each (more than one only for direct items over interleaved heads). */
    const int heads = (int)(p->Hkv - w.hk < fp->heads_per_item ? p->Hkv - w.hk : fp->heads_per_item);
    for (int h = 0; h < heads; h++) {
        const work_item wh = with_head(&w, w.hk + h);
        const row_state rs = state_of(fp, base, h);
        begin_rows(fp, &wh, &rs, r0, rows);
    }
    const row_state rs = state_of(fp, base, 0);
    if (rs.mod) mod_rows_of(fp, rs.mod)->rows = -1;   /* the mods hold no rows of this item yet */
    const bool direct = item_direct(fp, &w);
    const int tile = direct ? fp->direct_keys : fp->block_keys;   /* divides KEY_CHUNK: no tile spans two chunks */
    if (fp->px && !direct) fp->px->pack_q(rows, fp->E, rs.qb, fp->E, qpack);
    if (fp->splits > 1)
        for (int h = 0; h < heads; h++) {
            const work_item wh = with_head(&w, w.hk + h);
            clear_split_chunks(fp, &wh, rows);
        }

    /* The block's keys: from the first row's lower limit to the last row's upper one (both grow with the row), within
     * this split; the first tile stays aligned to its size (the tile cache indexes tiles by j0 / block_keys). */
    int64_t first_lo, first_hi, last_lo, last_hi;
    row_key_range(fp, &w, r0, &first_lo, &first_hi);
    row_key_range(fp, &w, r0 + rows - 1, &last_lo, &last_hi);
    int64_t k_lo = w.split * fp->split_keys;   /* < S; a multiple of KEY_CHUNK */
    int64_t k_hi = w.seq.S - k_lo < fp->split_keys ? w.seq.S : k_lo + fp->split_keys;
    if (k_hi > last_hi) k_hi = last_hi;   /* tiles wholly past the rows' keys are never touched ... */
    if (first_lo / tile * tile > k_lo) k_lo = first_lo / tile * tile;
                                          /* ... nor those wholly before them (a window) */
    /* A flex block mask: the item's rows (all heads of its groups, a superset) see only its non-empty blocks' keys */
    const af_block_map *blocks = p->mods ? p->mods->blocks : NULL;
    const int64_t block_h0 = w.hk * p->group, block_nh = (int64_t)heads * p->group;
    if (blocks) {
        int64_t lo, hi;
        af_block_map_keys(blocks, w.b, block_h0, block_nh, r0 / p->group, (r0 + rows - 1) / p->group, w.seq.S, &lo,
                          &hi);
        if (k_hi > hi) k_hi = hi;
        if (lo / tile * tile > k_lo) k_lo = lo / tile * tile;
    }

    tile_cache *cache = (tile_cache *)base;
    if (fp->tile_cache && (cache->b_plus_1 != w.b + 1 || cache->hk != w.hk))
        *cache = (tile_cache){.b_plus_1 = w.b + 1, .hk = w.hk, .first = 0, .packed = 0};

    int causal_skip = 0;   /* leading rows of the block that see no key of this tile or any later (causal) */
    int cols;
    int64_t chunk = -1;   /* the key chunk the rows' online softmax is in */
    for (int64_t j0 = k_lo; j0 < k_hi; j0 += cols) {   /* += cols: j0 + tile may pass 2^63 */
        cols = (int)(k_hi - j0 < tile ? k_hi - j0 : tile);
        if (j0 / KEY_CHUNK != chunk) {   /* a new chunk: the last one is done */
            if (chunk >= 0) close_chunk_heads(fp, &w, base, heads, rows, chunk, true);
            chunk = j0 / KEY_CHUNK;
        }
        /* Rows whose scores in this tile would all be -inf: P = 0, alpha = 1, m and l unchanged, so skipping them is
         * exact. Leading rows end before the tile (causal, right edge), trailing rows start after it (left edge). */
        int64_t lo, hi;
        while (causal_skip < rows && (row_key_range(fp, &w, r0 + causal_skip, &lo, &hi), hi <= j0)) causal_skip++;
        int skip = causal_skip, end = rows;
        while (end > skip && (row_key_range(fp, &w, r0 + end - 1, &lo, &hi), lo >= j0 + cols)) end--;
        if (end == skip) continue;
        const bool edge = j0 < last_lo || j0 + cols > first_hi;
        tile_blocks tb = TILE_MIXED;
        if (blocks) {   /* a tile the block mask empties for all these rows is skipped, one it fills runs plain */
            /* one kv head's rows: those at either end whose blocks of the tile are all empty sit it out too */
            while (heads == 1 && skip < end && row_blocks_empty(fp, &w, r0 + skip, j0, cols)) skip++;
            while (heads == 1 && end > skip && row_blocks_empty(fp, &w, r0 + end - 1, j0, cols)) end--;
            if (end == skip) continue;
            const int cls = af_block_map_tile(blocks, w.b, block_h0, block_nh, (r0 + skip) / p->group,
                                              (r0 + end - 1) / p->group, j0, j0 + cols);
            if (cls == AF_BLOCK_EMPTY) continue;
            if (cls == AF_BLOCK_FULL) tb = p->mods->has_score ? TILE_FULL : TILE_PLAIN;
        }
        if (direct) {
            const int64_t next = j0 + cols, next_n = k_hi - next < tile ? k_hi - next : tile;
            prefetch_cursor next_k = {&w, false, next, next + next_n, 0}, next_v = {&w, true, next, next + next_n, 0};
            prefetch_cursor this_v = {&w, true, j0, j0 + cols, 0};
            /* each head's share of the next tile's K and V lines */
            const size_t pf_lines = (size_t)next_n * fp->prefetch_key_bytes / 64 / (size_t)heads + 2;
            const size_t pf_v_lines = (size_t)next_n * fp->prefetch_value_bytes / 64 / (size_t)heads + 2;
            const char **k_rows = (const char **)(base + fp->off_rows), **v_rows = k_rows + tile;
            tile_rows(fp, &w, j0, cols, k_rows, v_rows);
            if (fp->prefetch_phased) {
                /* Interleaved heads, f32 or <= 2 rows a kv head: every head's scores first, prefetching this tile's
                 * V (all heads, in memory order) in shares; then every head's values, prefetching the next K. */
                const size_t v_lines = (size_t)cols * fp->prefetch_value_bytes / 64 / (size_t)heads + 2;
                for (int h = 0; h < heads; h++) {
                    const row_state rh = state_of(fp, base, h);
                    direct_scores(fp, h, &rh, skip, end, cols, k_rows, next_prefetch(fp, &this_v, v_lines));
                }
                for (int h = 0; h < heads; h++) {
                    const work_item wh = with_head(&w, w.hk + h);
                    const row_state rh = state_of(fp, base, h);
                    direct_values(fp, &wh, h, &rh, r0, skip, end, j0, cols, edge, tb, v_rows,
                                  next_prefetch(fp, &next_k, pf_lines));
                }
                continue;
            }
            for (int h = 0; h < heads; h++) {
                const work_item wh = with_head(&w, w.hk + h);
                const row_state rh = state_of(fp, base, h);
                af_prefetch pf_scores, pf_values;
                if (fp->prefetch_v_now) {
                    /* One head over contiguous rows: the hardware streams K's rows but not V's column strips, so this
                     * tile's V during the scores, and the first half of the next tile's K during the values
                     * (docs/BENCHMARKS-HISTORY.md, "Decode, third round"). */
                    pf_scores = next_prefetch(fp, &this_v, SIZE_MAX);
                    pf_values = next_prefetch(fp, &next_k, pf_lines / 2);
                } else {   /* the next tile's K/V, all heads of the item, in shares over this tile's heads */
                    pf_scores = next_prefetch(fp, &next_k, pf_lines);
                    pf_values = next_prefetch(fp, &next_v, pf_v_lines);
                }
                direct_scores(fp, h, &rh, skip, end, cols, k_rows, pf_scores);
                direct_values(fp, &wh, h, &rh, r0, skip, end, j0, cols, edge, tb, v_rows, pf_values);
            }
            continue;
        }
        /* The tiles this block's products read: cached ones, or the scratch tiles packed for this block alone.
         * Cached tiles are packed whole, whatever this block's causal limit, so that a later block of the head may
         * use every key of them. The cache holds one run of consecutive tiles; a block starting elsewhere (a window)
         * starts a new run. */
        float *ktile = kt, *vtile = vt;
        bool pack = true;
        int pack_cols = cols;
        if (fp->tile_cache) {
            const int64_t ti = j0 / fp->block_keys;
            ktile = (float *)(base + fp->off_cache) + (size_t)ti * fp->cache_tile_floats;
            vtile = ktile + fp->cache_kt_floats;
            pack = ti < cache->first || ti >= cache->packed;
            pack_cols = (int)(w.seq.S - j0 < fp->block_keys ? w.seq.S - j0 : fp->block_keys);
            if (pack && ti != cache->packed) cache->first = ti;   /* not the next tile of the run: a new run */
            if (pack) cache->packed = ti + 1;
        }
        const int n = end - skip;
        float *Sn = rs.S + (size_t)skip * fp->keys_pad, *On = rs.O + (size_t)skip * fp->ev_pad;
        const float *qn = rs.qb + (size_t)skip * fp->E;
        if (fp->px) {
            size_t stride;
            const char *k = rows_for_products(fp, &w, j0, cols, false, base + fp->off_stage, &stride);
            fp->px->pack_k(cols, fp->E, k, stride, p->dtype, kt);
            fp->px->scores(n, cols, fp->E, qpack, skip, kt, Sn, fp->keys_pad);
        } else {
            /* vt is free until the V tile: a row buffer for the transpose */
            if (pack) pack_key_tile(fp, &w, j0, pack_cols, ktile, vt);
            uk->gemm(n, cols, fp->E, qn, fp->E, ktile, fp->keys_pad, Sn, fp->keys_pad, false);
        }
        softmax_tile(fp, &w, &rs, r0, skip, end, j0, cols, edge, tb);
        if (fp->Ev == 0) continue;
        if (fp->px) {
            size_t stride;
            const char *v = rows_for_products(fp, &w, j0, cols, true, base + fp->off_stage, &stride);
            fp->px->pack_v(cols, fp->Ev, v, stride, p->dtype, vt);
            fp->px->values(n, fp->Ev, cols, Sn, fp->keys_pad, vt, On, fp->ev_pad);
        } else if (fp->v_direct) {
            const float *v = (const float *)value_row(fp, &w, j0);
            uk->gemm(n, fp->Ev, cols, Sn, fp->keys_pad, v, (int)p->v_stride[2], On, fp->ev_pad, true);
        } else {
            if (pack) pack_value_tile(fp, &w, j0, pack_cols, vtile, j0 + fp->block_keys, k_hi);
            uk->gemm(n, fp->Ev, cols, Sn, fp->keys_pad, vtile, fp->ev_pad, On, fp->ev_pad, true);
        }
    }
    if (chunk >= 0) close_chunk_heads(fp, &w, base, heads, rows, chunk, false);
    for (int h = 0; h < heads; h++) {
        const work_item wh = with_head(&w, w.hk + h);
        const row_state rh = state_of(fp, base, h);
        finish_rows(fp, &wh, &rh, r0, rows);
    }
}

/* Fold the key chunks of one (batch, kv head, row block) in key order, as an unsplit item does (fold_row). */
static void combine_item(void *ctx, int64_t t, void *scratch) {
    const flash_plan *fp = ctx;
    float *acc = scratch;
    const work_item w = decode_item(fp, t * fp->splits, 1);
    const int64_t r0 = w.rb * fp->block_rows;
    const int rows = block_rows_of(fp, &w);
    const size_t row_floats = (size_t)fp->ev_pad + 2;
    const int64_t chunks = fp->splits * fp->chunks_per_split;
    for (int r = 0; r < rows; r++) {
        float m = -INFINITY, l = 0.0f;
        memset(acc, 0, sizeof(float) * (size_t)fp->Ev);
        for (int64_t c = 0; c < chunks; c++) {
            const float *part = partial_of(fp, &w, c) + (size_t)r * row_floats;
            fold_row(fp->Ev, part, part[fp->ev_pad], part[fp->ev_pad + 1], acc, &m, &l);
        }
        int64_t h, i;
        qrow_ptr(fp, &w, r0 + r, &h, &i);
        store_row(fp, &w, h, i, acc, m, l);
    }
}

/* True when the K and V rows of all kv heads of one key lie within that key's row (head stride < key stride): a
 * (B,S,H,E) or paged cache, where a head's rows are a whole row of heads apart. */
static bool kv_heads_interleave(const af_problem *p) {
    if (p->Hkv < 2) return false;
    return p->k_stride[1] > 0 && p->k_stride[1] < p->k_stride[2] && p->v_stride[1] > 0 &&
           p->v_stride[1] < p->v_stride[2];
}

/* The micro-kernel's own products when it has them, accepts the call, and K and V are contiguous along the head
 * dim. */
static const af_products *products_for(const af_problem *p, const af_ukernel *uk) {
    const af_products *px = uk->products;
    if (!px || p->k_stride[3] != 1 || p->v_stride[3] != 1 || !px->accepts(p->dtype, (int)p->E, (int)p->Ev)) return NULL;
    if (p->kv_dtype != p->dtype) return NULL;   /* float8 K/V under a wider q: the f32 path converts them */
    return px;
}

/* Rows per (batch, kv head) up to which a sequence runs on the table's direct kernels (0: never): where they can read
 * K/V in place, below what the products need (a tile product costs the same for 1 row as for 16). */
static int direct_rows_for(const af_problem *p, const af_ukernel *uk, const af_products *px) {
    if (!uk->scores_direct || !uk->values_direct || p->k_stride[3] != 1 || p->v_stride[3] != 1) return 0;
    return px && px->min_rows - 1 < DIRECT_MAX_ROWS ? px->min_rows - 1 : DIRECT_MAX_ROWS;
}

af_status af_flash_forward(const af_problem *p) {
    if (p->B == 0 || p->Hkv == 0 || p->L == 0 || p->group == 0) return AF_OK;   /* nothing to write */
    if (p->Ev == 0 && !p->lse) return AF_OK;   /* no element to write either (heads broadcast to 2^63: no work) */
    const int64_t rows_total = p->L * p->group;   /* <= q's element count once B >= 1: cannot overflow */
    flash_plan fp = {.p = p, .uk = af_ukernel_current(), .E = (int)p->E, .Ev = (int)p->Ev};
    fp.elem = af_dtype_size(p->kv_dtype);
    fp.q_elem = af_dtype_size(p->dtype);
    fp.out_elem = af_dtype_size(p->out_dtype);
    fp.px = products_for(p, fp.uk);
    /* Each sequence picks its kernels by its own rows (item_direct): a mixed batch of decodes and a prefill chunk
     * gives every row the bits it gets alone. rows_total is the longest sequence's. */
    fp.direct_rows = af_get_phase_invariant() ? 0 : direct_rows_for(p, fp.uk, fp.px);
    fp.direct = fp.direct_rows > 0;
    fp.all_direct = fp.direct && rows_total <= fp.direct_rows;
    if (fp.all_direct) fp.px = NULL;   /* nothing runs on them: no scratch for them */
    int direct_block_rows;
    fp.uk->blocking(fp.E, fp.Ev, &direct_block_rows, &fp.direct_keys);
    (fp.px ? fp.px->blocking : fp.uk->blocking)(fp.E, fp.Ev, &fp.block_rows, &fp.block_keys);
    if (fp.all_direct) fp.block_rows = direct_block_rows;
    if (p->mods && p->mods->blocks && !fp.all_direct) {
        /* a flex block mask: row blocks of whole query blocks, each then walking its own blocks' keys alone (rows
         * of two query blocks see the union of their keys: a window's band twice as wide) */
        const int64_t q_rows = p->mods->blocks->q_block * p->group;
        if (q_rows <= fp.block_rows) fp.block_rows = (int)(fp.block_rows / q_rows * q_rows);
    }
    if (fp.block_rows < fp.direct_rows) fp.block_rows = fp.direct_rows;   /* a direct sequence fits one block */
    if (fp.block_rows > rows_total) fp.block_rows = (int)rows_total;   /* scratch and split partials sized to use */
    if (KEY_CHUNK % fp.block_keys != 0 || KEY_CHUNK % fp.direct_keys != 0)
        return af_fail(AF_ERR_INTERNAL, "internal error: key tiles of %d / %d keys do not divide the %d-key chunks",
                       fp.block_keys, fp.direct_keys, KEY_CHUNK);

    /* Direct items over K/V whose heads interleave (a transformer's (B,S,H,E) cache, paged pages of (page_size, H,
     * E)) take all kv heads of their key range: every cache line fetched is used at once, and memory is read in
     * order instead of one head's rows a page apart. */
    fp.heads_per_item = !fp.all_direct || !kv_heads_interleave(p) ? 1
                        : p->Hkv < DIRECT_MAX_HEADS           ? (int)p->Hkv
                                                              : DIRECT_MAX_HEADS;
    /* Direct items prefetch the next tile's rows as spans over their heads: only when the spans are mostly rows the
     * item reads (not a strided view whose rows are far apart, where whole spans would waste the bandwidth). */
    const int64_t span_k = (fp.heads_per_item - 1) * p->k_stride[1] + p->E;
    const int64_t span_v = (fp.heads_per_item - 1) * p->v_stride[1] + p->Ev;
    fp.prefetch = fp.direct && p->k_stride[2] <= 2 * span_k && p->v_stride[2] <= 2 * span_v;
    fp.prefetch_key_bytes = (size_t)(p->k_stride[2] > span_k ? p->k_stride[2] : span_k) * fp.elem;
    fp.prefetch_value_bytes = (size_t)(p->v_stride[2] > span_v ? p->v_stride[2] : span_v) * fp.elem;
    fp.prefetch_v_now = fp.prefetch && fp.elem <= 2 && fp.heads_per_item == 1 && !p->page_table && p->k_stride[2] == p->E &&
                        p->v_stride[2] == p->Ev;
    /* Interleaved heads: all heads' scores, then all heads' values (the phased order) for f32, and for 16- and 8-bit
     * K/V at one or two query rows per kv head, where the kernels are memory-bound: 0.87-0.97 of the time there, 1.00
     * at G 4 (docs/BENCHMARKS-HISTORY.md, "Decode, the whole matrix"). */
    fp.prefetch_phased = fp.prefetch && fp.heads_per_item > 1 && (fp.elem >= 4 || rows_total <= 2);
    /* Multi-head direct items keep the table's tile: one of fewer keys when all heads' rows are wide (to keep it and
     * the next in L2) gave no measurable gain on Zen 4 (docs/BENCHMARKS-HISTORY.md) and changed the rows' bits with
     * the layout. */
    const int max_keys = fp.block_keys > fp.direct_keys ? fp.block_keys : fp.direct_keys;
    fp.keys_pad = af_tile_ld((size_t)max_keys);
    fp.ev_pad = af_tile_ld((size_t)(fp.Ev > 0 ? fp.Ev : 1));
    fp.rows_total = rows_total;
    fp.row_blocks = (rows_total + fp.block_rows - 1) / fp.block_rows;
    fp.splits = 1;
    fp.split_keys = p->S > 0 ? p->S : 1;
    fp.chunks_per_split = 1;
    /* Decode: spread the keys over the threads, in whole chunks. How many does not change a bit of the result. */
    if (rows_total <= SPLIT_MAX_ROWS && p->S > 2 * KEY_CHUNK) {
        const int64_t per_split = p->B * af_ceil_div(p->Hkv, fp.heads_per_item) * fp.row_blocks;   /* items per split */
        int64_t keys = af_ceil_div(p->S, af_ceil_div(SPLIT_ITEMS, per_split > 0 ? per_split : 1));
        keys = keys < KEY_CHUNK ? KEY_CHUNK : keys > SPLIT_KEYS_MAX ? SPLIT_KEYS_MAX : keys;
        fp.split_keys = af_round_up((size_t)keys, KEY_CHUNK);
        fp.splits = af_ceil_div(p->S, fp.split_keys);
        fp.chunks_per_split = fp.split_keys / KEY_CHUNK;
    }
    fp.pre_scale = p->mask != NULL || !(p->scale > 0.0) || p->softcap > 0.0 || (p->mods && p->mods->has_score);
    fp.exp2_degree = p->out_dtype == AF_BF16 ? 3 : p->out_dtype == AF_F16 ? 4 : 5;   /* what out's precision needs */
    /* V tiles straight from the caller's f32 tensor when they meet the gemm's B contract (whole vectors of
     * columns, no padding to zero; leading dim a multiple of AF_TILE_PAD; every tile 64-byte aligned) and its rows
     * are an odd number of cache lines apart like a packed tile's (tile_ld). Else the tile is copied: a transformer's
     * (B,L,H,E) memory puts rows H·E floats apart, 8 KiB at H·E = 2048, and a strip then lands in one L1 set
     * (measured: 85 -> 140 GFLOP/s at L=S=2048, E=128, 2 threads). */
    fp.v_direct = !fp.px && !p->page_table && p->kv_dtype == AF_F32 && p->v_stride[3] == 1 &&
                  fp.Ev % AF_TILE_PAD == 0 &&
                  p->v_stride[2] % AF_TILE_PAD == 0 && p->v_stride[1] % AF_TILE_PAD == 0 &&
                  p->v_stride[0] % AF_TILE_PAD == 0 && (uintptr_t)p->v % 64 == 0 && p->v_stride[2] <= INT32_MAX &&
                  af_tile_ld((size_t)p->v_stride[2]) == p->v_stride[2];

    const size_t br = (size_t)fp.block_rows, keys_pad = (size_t)fp.keys_pad, ev_pad = (size_t)fp.ev_pad;
    const size_t e_pad = af_round_up((size_t)fp.E, AF_TILE_PAD);
    size_t at = 64;   /* the tile_cache header */
    fp.off_qp = at;
    if (fp.px) {   /* the products' own packed Q block, K tile and V tile */
        at += af_round_up(fp.px->q_bytes(fp.block_rows, fp.E), 64);
        fp.off_kt = at; at += af_round_up(fp.px->k_bytes(fp.block_keys, fp.E), 64);
        fp.off_v = at;  at += af_round_up(fp.px->v_bytes(fp.block_keys, fp.Ev), 64);
    } else {
        fp.off_kt = at; at += af_round_up(sizeof(float) * e_pad * keys_pad, 64);
        fp.off_v = at;  at += af_round_up(sizeof(float) * keys_pad * (ev_pad > e_pad ? ev_pad : e_pad), 64);
    }
    fp.off_rows = at; at += af_round_up(2 * sizeof(char *) * (size_t)max_keys, 64);   /* direct: tile_rows */
    if (fp.px && p->page_table) {   /* rows_for_products' staging: one tile of K or V rows */
        fp.off_stage = at;
        at += af_round_up((size_t)fp.block_keys * (size_t)(fp.E > fp.Ev ? fp.E : fp.Ev) * fp.elem, 64);
    }
    if (p->mods) {   /* the mods' registers over a tile's keys, then the rows' heads and positions */
        fp.off_mod = at;
        at += af_round_up(sizeof(float) * mod_regs_floats(p, fp.block_rows, fp.keys_pad) + sizeof(mod_rows) + 8 * br,
                          64);
    }
    const size_t state0 = at;   /* row_state slots, one per kv head of an item */
    fp.off_q = at;  at += af_round_up(sizeof(float) * br * (size_t)fp.E, 64);
    fp.off_s = at;  at += af_round_up(sizeof(float) * br * keys_pad, 64);
    fp.off_o = at;  at += af_round_up(sizeof(float) * br * ev_pad, 64);
    fp.off_m = at;  at += af_round_up(sizeof(float) * br, 64);
    fp.off_l = at;  at += af_round_up(sizeof(float) * br, 64);
    fp.off_a = at;  at += af_round_up(sizeof(float) * br, 64);
    fp.off_ao = at; at += af_round_up(sizeof(float) * br * ev_pad, 64);
    fp.off_am = at; at += af_round_up(sizeof(float) * br, 64);
    fp.off_al = at; at += af_round_up(sizeof(float) * br, 64);
    fp.state_bytes = at - state0;
    at += fp.state_bytes * (size_t)(fp.heads_per_item - 1);

    /* The tile cache, when a head has more than one row block to share it and every thread's cache fits in
     * TILE_CACHE_BYTES together (L=S=4096, E=Ev=128: 4.8 MiB per thread; at 8192 two threads no longer fit). */
    fp.cache_kt_floats = (size_t)fp.E * keys_pad;
    fp.cache_tile_floats = fp.cache_kt_floats + (size_t)fp.block_keys * ev_pad;
    const int64_t tiles = af_ceil_div(p->S, fp.block_keys);
    const size_t threads = (size_t)af_get_num_threads();
    const double cache_bytes = (double)tiles * (double)fp.cache_tile_floats * sizeof(float) * (double)threads;
    fp.tile_cache = !fp.px && !fp.all_direct && fp.splits == 1 && fp.row_blocks > 1 && fp.Ev > 0 &&
                    cache_bytes <= (double)TILE_CACHE_BYTES;
    if (fp.tile_cache) {
        fp.v_direct = false;   /* V tiles come from the cache */
        fp.off_cache = at;
        at += (size_t)tiles * fp.cache_tile_floats * sizeof(float);
    }

    const int64_t groups = p->B * p->Hkv * fp.row_blocks;   /* (batch, kv head, row block): combine_item's items */
    af_log(AF_LOG_DEBUG,
           "flash: isa %s, %lld row blocks (of %d rows) over all heads, key tiles of %d, %lld key splits, %s%s, %d kv "
           "heads per item%s",
           fp.uk->isa, (long long)groups, fp.block_rows, fp.block_keys, (long long)fp.splits,
           fp.all_direct ? "direct K/V reads" : fp.px ? "own-format products" : "packed f32 tiles",
           fp.tile_cache ? ", tile cache on" : "", fp.heads_per_item, fp.prefetch ? ", next tiles prefetched" : "");
    /* run_item's items: (batch, head chunk, row block, split). A broadcast (stride-0) key can make S, hence the
     * splits, the items and partials, huge. */
    int64_t items = p->B * af_ceil_div(p->Hkv, fp.heads_per_item) * fp.row_blocks;
    if (fp.splits > 1) {
        size_t count, parts;
        if (__builtin_mul_overflow(items, fp.splits, &items) ||
            __builtin_mul_overflow(groups, fp.splits * fp.chunks_per_split, &parts) ||
            __builtin_mul_overflow(parts, br * (ev_pad + 2), &count) || count > SIZE_MAX / sizeof(float))
            return af_fail(AF_ERR_NO_MEMORY, "out of memory: split-KV partial results for %lld splits exceed 2^64 bytes",
                           (long long)fp.splits);
        if (count > ((size_t)1 << 45))   /* 2^47 bytes: more than an x86-64/arm64 process can address */
            return af_fail(AF_ERR_NO_MEMORY, "out of memory: %zu bytes of split-KV partial results exceed the address space",
                           sizeof(float) * count);
        if (!(fp.partials = af_alloc(sizeof(float) * count)))
            return af_fail(AF_ERR_NO_MEMORY, "out of memory: %zu bytes of split-KV partial results", sizeof(float) * count);
    }
    const int max_threads = af_threads_worth_waking(2.0 * (double)p->B * (double)p->Hq * (double)p->L * (double)p->S *
                                                    (double)(p->E + p->Ev));
    af_status st = af_parallel_for_at_most(items, max_threads, run_item, &fp, at);
    if (st == AF_OK && fp.splits > 1)
        st = af_parallel_for_at_most(groups, max_threads, combine_item, &fp, sizeof(float) * ev_pad);
    af_free(fp.partials);
    return st;
}
