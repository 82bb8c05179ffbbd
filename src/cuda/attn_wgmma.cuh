/* The Hopper tensor-core kernel for f16/bf16, head dims up to 256 (sm_90a; FlashAttention-3's structure:
 * warp specialisation, TMA and wgmma, the intra-warpgroup overlap and the ping-pong between consumers):
 *   - a CTA of 3 warpgroups owns AF_WG_ROWS = 128 packed query rows of one (batch, kv head) (pack-GQA as in
 *     attn_mma.cuh); warpgroup 0 is the producer: its first warp streams K/V tiles of bc keys (AF_WG_BC = 128;
 *     64 at head dim 256, so that two stages fit beside Q) with TMA issued by lane 0 into a ring of AF_WG_STAGES
 *     stages, K and V apart ("full K" / "full V" mbarriers with the tiles' transaction bytes, "empty K" / "empty V"
 *     ones the consumers arrive on: K once S has read it, V once P·V has), tile 0's right after the barriers' init
 *     when no page needs checking, and clears the V rows past the sequence in its last tile (landed on a separate
 *     mbarrier, then "full V"); the other threads
 *     give their registers back (setmaxnreg.dec) and leave (or, on the gathered path below, all its threads copy
 *     the tiles with cp.async on that register budget); warpgroups 1 and 2 (setmaxnreg.inc) each own 64 rows:
 *     S = Q·Kᵀ by wgmma with Q and K from shared memory, the online softmax in registers, then O += P·V by wgmma
 *     with P from registers (the S accumulators packed in place: the wgmma D layout is the mma C layout repeated
 *     along N, so attn_mma.cuh's mask, softmax and epilogue run on it unchanged, 16 rows a warp) and V from shared
 *     memory read MN-major; the two consumers take turns issuing their GEMMs (named barriers), so one's softmax
 *     runs under the other's products (head dims <= 128);
 *   - each consumer copies its own 64 Q rows with cp.async into the 128-byte swizzle the descriptors name (rows past
 *     the sequence's packed rows and columns past E are zero), fences the async proxy and meets its warpgroup on a
 *     named barrier;
 *   - K and V tiles are boxes of 64 columns x bc keys of the tensors seen as {E, keys, Hkv, B} (TMA's 128-byte
 *     swizzle, keys past the tensor zero-filled; rows past the sequence are masked by the key ranges); head dims
 *     128 and 256 take hd / 64 boxes side by side (column blocks of bc x 128 bytes); at head dim 256 O's columns are
 *     two n128 products a k-step;
 *   - a paged K/V cache whose page size and bc have a common divisor of 16 or more (or pages of 8 keys) is seen as
 *     {E, page rows, Hkv, pages}: a tile is bc / gcd(page, bc) boxes, each inside one page found through the page
 *     table; boxes of keys past the sequence name page `num_pages`, past the pool, and are zero-filled;
 *   - any other page size (1..7, 12, 24, 100, 200 at bc 128, ...) takes the gathered path (`gather`,
 *     attn_wgmma_gather.cuh): all 128 threads of warpgroup 0 copy the tiles with cp.async, eight lanes a key's
 *     128-byte row, each key's page looked up once and shuffled, into the same swizzled stages (keys past the
 *     sequence and columns past E / Ev zero-filled), each thread completing a tile by cp.async.mbarrier.arrive on
 *     the stage's "full K" (128 arrivals, no transaction bytes; the consumers wait on it for V too) without
 *     waiting, refilling a stage once its "empty V" completes, three stages at head dims 64 and 128
 *     (AF_WG_STAGES_OF); the consumers fence the async proxy after their wait (af_wgmma_wait_full); no tensor map;
 *   - causal and window tiles outside the block's keys are never loaded; split-KV, sinks and LSE as attn_mma.cuh;
 *   - the work items (row block, batch·kv head, split) in af_wgmma_sched's order, the heaviest row block first under
 *     causality or a window; at head dims 64 and 128 one wave of persistent CTAs walks them (CTA i items i, i + grid,
 *     ...): consumer 0 computes each next item and posts what the producer needs (a record in shared memory, two
 *     slots with "item full" / "item empty" mbarriers), so the producer loads an item's first tiles under the last
 *     item's epilogue; the stage ring, the tail barrier's phases and the ping-pong turn run on across items; head dim
 *     256 and paged caches (their pages checked by the CTA first) get one item a CTA.
 * Variants: AF_WGMMA_KERNEL stamps one kernel per (head dim 64/128/256, dtype). */
#ifndef AF_CUDA_ATTN_WGMMA_CUH
#define AF_CUDA_ATTN_WGMMA_CUH
#include <stdint.h>

#include "cuda/attn_mma.cuh"
#include "cuda/device_hopper.h"

#define AF_WG_THREADS 384                      /* 3 warpgroups: the producer and two consumers */
#define AF_WG_ROWS 128                         /* packed query rows per CTA: 64 per consumer warpgroup */
#define AF_WG_BC 128                           /* keys per K/V tile, head dims 64 and 128 (the most of any) */
/* head dim 256: 64-key tiles, two stages beside Q. FlashAttention-3's tiles fit the shared memory but ptxas spills
 * them (issue 37, docs/CUDA.md): 128 x 80 at head dim 256 32 bytes, 128 x 176 at 128 496 bytes, and head dim 64's
 * 192 x 128 would give three consumers 160 registers, at which this consumer spills 676 bytes. */
#define AF_WG_BC_OF(hd) ((hd) > 128 ? 64 : AF_WG_BC)
/* Head dims whose CTAs walk several items (af_wgmma_body): at 256 the item loop spills 56 bytes of the consumers'
 * 240 registers beside O's 128 accumulators, so the plan gives each CTA one item there. */
#define AF_WG_PERSISTENT(hd) ((hd) <= 128)
#define AF_WG_HD_MAX 256                       /* largest head-dim variant */
#define AF_WG_STAGES 2                         /* K/V tiles in flight (TMA) */
/* Stages of the ring: the gathered path's copies, issued by threads and completed without a wait, take one more
 * where 227 KiB holds it (head dims 64: 112 KiB, 128: 224 KiB; 256 would need 256 KiB). */
#define AF_WG_STAGES_OF(hd, gather) ((gather) && (hd) <= 128 ? 3 : AF_WG_STAGES)
#define AF_WG_STAGES_MAX 3                     /* the most of either: each kind of mbarrier has this many slots */
/* The mbarriers of a stage: K and V land and are released apart, so S starts once K lands and the next K load once
 * S has read the stage, a softmax before P·V has read V (issue 37 item 5). The gathered path completes K and V
 * together on "full K" and refills a stage once "empty V" completes (V is released after K in every consumer). */
enum { AF_WG_FULL_K = 0, AF_WG_FULL_V, AF_WG_EMPTY_K, AF_WG_EMPTY_V, AF_WG_BAR_KINDS };
#define AF_WG_ATOM 64                          /* 16-bit elements in one 128-byte swizzle row: a column block */
#define AF_WG_BLOCK_BYTES(rows) ((rows) * 128) /* one column block of `rows` rows */
#define AF_WG_TURN_BAR 1                       /* named barriers 1 and 2: consumer 0's and consumer 1's turn */
#define AF_WG_PRODUCER_BAR 3                   /* named barrier 3: the producer's warp, a tail tile's V rows cleared */
#define AF_WG_Q_BAR 4                          /* named barriers 4 and 5: consumer 0's and consumer 1's Q rows */
#define AF_WG_PATTERN 1024                     /* the 128-byte swizzle's pattern: tiles start on a multiple of it */
#define AF_WG_ALIGN_SLACK (AF_WG_PATTERN - 128) /* the most af_wgmma_tiles_base may skip (af_shared_memory() is
                                                  128-byte aligned at least) */

/* The order CTAs take their work items (row block, batch·kv head, split), the same on host and device: CTA i (in
 * launch order: grid x) runs items i, i + grid, ... Full attention: row blocks fastest, as the grid was. Causal or
 * windowed: heaviest first (the largest row block, whose rows see the most keys), so the last items are the lightest
 * (FlashAttention-3's tile schedulers; issue 37 item 4). */
typedef struct {
    int64_t row_blocks, heads, splits;
    int heaviest_first;                        /* causal or windowed */
    int items;                                 /* row_blocks · heads · splits, below 2^30: an item index plus the
                                                  grid stays in 32 bits */
} af_wgmma_sched;

AF_HOST_DEVICE static inline int64_t af_wgmma_sched_items(const af_wgmma_sched *s) {
    return s->row_blocks * s->heads * s->splits;
}

/* Item `item`'s row block, (batch, kv head) pair and split, in 32 bits (the plan keeps items below 2^31; a 64-bit
 * division is a call on the GPU). */
AF_HOST_DEVICE static inline void af_wgmma_sched_item(const af_wgmma_sched *s, int64_t item, int64_t *rb,
                                                      int64_t *bhk, int64_t *split) {
    const uint32_t i = (uint32_t)item, rows = (uint32_t)s->row_blocks, heads = (uint32_t)s->heads;
    if (s->heaviest_first) {   /* row blocks last to first; inside one, pairs fastest, then splits */
        const uint32_t per_block = heads * (uint32_t)s->splits, rest = i % per_block;
        *rb = (int64_t)(rows - 1 - i / per_block), *bhk = (int64_t)(rest % heads), *split = (int64_t)(rest / heads);
    } else {
        *rb = (int64_t)(i % rows), *bhk = (int64_t)(i / rows % heads), *split = (int64_t)(i / rows / heads);
    }
}

typedef struct {
    af_mma_params m;                           /* everything attn_mma.cuh's kernel takes (double_buffer unused) */
    CUtensorMap k_map, v_map;                  /* K / V as {E or Ev, keys, Hkv, B}, boxes {64, box_keys, 1, 1} */
    int k_blocks, v_blocks;                    /* column blocks of K and V: hd / 64 each (Q·Kᵀ and P·V read all;
                                                  TMA and the gather zero-fill the columns past E / Ev) */
    int varlen_k;                              /* K/V packed by cu_seqlens_k: the box's batch coordinate is 0 */
    int box_keys;                              /* keys per box: the tile's, or a paged cache's gcd(page, tile) */
    int gather;                                /* paged K/V that TMA cannot box: warpgroup 0 gathers with cp.async
                                                  (attn_wgmma_gather.cuh); k_map / v_map unset and never read */
    af_wgmma_sched sched;                      /* which item each CTA (grid x) takes */
} af_wgmma_params;

#define AF_WG_HEAD 1024                       /* the mbarriers, item records and a flag (af_wgmma_bars), before Q:
                                                  one swizzle pattern, so the tiles after it stay on the pattern */
/* Shared memory: the head (AF_WG_HEAD), then Q (hd/64 column blocks of 128 rows), the stages' K and V (hd/64 column
 * blocks of a tile's keys each); every tile starts on a window address that is a multiple of 1024 bytes
 * (af_wgmma_tiles_base), which may cost up to AF_WG_ALIGN_SLACK bytes at the front. */
static inline size_t af_wgmma_smem_bytes(int hd, int stages) {
    const size_t blocks = (size_t)hd / AF_WG_ATOM;
    return AF_WG_ALIGN_SLACK + AF_WG_HEAD + blocks * AF_WG_BLOCK_BYTES(AF_WG_ROWS) +
           2 * (size_t)stages * blocks * AF_WG_BLOCK_BYTES(AF_WG_BC_OF(hd));
}

/* The first byte of the dynamic shared memory whose window address is a multiple of AF_WG_PATTERN: TMA and wgmma
 * swizzle by window-address bits, while af_wgmma_offset counts from the tile, so the two agree only when every tile
 * starts on the pattern. The buffer is declared 1024-aligned; this holds even where that declaration is not kept
 * (a static __shared__ variable placed before it), at the cost of AF_WG_ALIGN_SLACK bytes of the budget. */
AF_DEVICE char *af_wgmma_tiles_base(void) {
    char *base = af_shared_memory();
    return base + ((AF_WG_PATTERN - af_shared_address(base) % AF_WG_PATTERN) % AF_WG_PATTERN);
}

/* Barrier `kind` of stage `stage`. */
AF_DEVICE uint64_t *af_wgmma_bar(uint64_t *bars, int kind, int stage) { return bars + kind * AF_WG_STAGES_MAX + stage; }

/* Byte offset of 16-byte chunk `chunk` (8 elements) of row `row` in a tile of column blocks of `rows` rows laid out
 * as TMA's and wgmma's 128-byte swizzle: chunk c of a 128-byte row r at (c ^ (r % 8)) · 16 (the tile on the
 * pattern). */
AF_DEVICE int af_wgmma_offset(int row, int chunk, int rows) {
    return (chunk / 8) * AF_WG_BLOCK_BYTES(rows) + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
}

/* Consumer `consumer`'s 64 packed query rows (from r0 + 64·consumer) into the swizzled Q tile by cp.async, hd/8
 * chunks a row, its warpgroup's 128 threads a share; rows past the sequence's packed rows and columns past E are
 * zero-filled. Published to the warpgroup's own wgmmas (the async proxy) by a named barrier of its 128 threads, not
 * the CTA's: the producer's loads and the other consumer's Q go on meanwhile (issue 37 item 5). */
AF_DEVICE void af_wgmma_load_q(char *dst, const af_mma_params *p, int64_t b, int64_t hk, const af_sequence *sq,
                               int64_t r0, int consumer, const int hd) {
    const int chunks = hd / 8;
    /* the thread index read afresh: this runs once an item, and addresses hoisted out of the item loop would hold
     * registers through the tiles (ptxas spilled one) */
    for (int i = af_thread_idx_reread() % 128; i < 64 * chunks; i += 128) {
        const int row = 64 * consumer + i / chunks, chunk = i % chunks, bytes = af_mma_chunk_bytes(p->E, chunk, 2);
        const int64_t r = r0 + row;
        const char *src = p->q;
        int n = 0;
        if (r < p->group * sq->L && bytes > 0) {
            const int64_t h = hk * p->group + af_mma_div(r, sq->L), q = sq->q0 + af_mma_mod(r, sq->L);
            src = p->q + 2 * (b * p->q_stride[0] + h * p->q_stride[1] + q * p->q_stride[2]) + chunk * 16;
            n = bytes;
        }
        af_cp_async_16(dst + af_wgmma_offset(row, chunk, AF_WG_ROWS), src, n);
    }
    af_cp_async_commit();
    af_cp_async_wait_0();
    af_fence_proxy_async();   /* Q, written through the generic proxy, is read by wgmma (the async proxy) */
    af_named_bar_sync(AF_WG_Q_BAR + consumer, 128);
}

/* Issues S(64 x bc) = Q(this warpgroup's 64 rows) · Kᵀ(bc keys) as one wgmma group (no wait), k-steps of 16 over
 * the whole padded head dim: A and B both K-major, 128-byte swizzle (stride 1024 bytes between groups of 8 rows; a
 * k-step moves the start 32 bytes inside a column block). Q and K are zero past E, so the steps past it add zeros;
 * skipping them on the run-time E made ptxas split the chain, one WARPGROUP.ARRIVE a step (C7519). Follows the
 * caller's wgmma fence. */
AF_DEVICE void af_wgmma_issue_scores(float s[AF_WG_BC / 2], const char *q_tile, const char *k_tile, int consumer,
                                     const int hd, const int bf16) {
    const int bc = AF_WG_BC_OF(hd);
    AF_MMA_UNROLL
    for (int kk = 0; kk < hd / 16; kk++) {
        const int block = kk / 4, step = (kk % 4) * 32;
        const uint64_t a = af_wgmma_desc(q_tile + block * AF_WG_BLOCK_BYTES(AF_WG_ROWS) + consumer * 8 * 1024 + step,
                                         AF_SWIZZLE_128B, 16, 1024);
        const uint64_t k = af_wgmma_desc(k_tile + block * AF_WG_BLOCK_BYTES(bc) + step, AF_SWIZZLE_128B, 16, 1024);
        if (bc == 64) {
            if (bf16) af_wgmma_m64n64k16_bf16_ss(s, a, k, kk > 0);
            else af_wgmma_m64n64k16_f16_ss(s, a, k, kk > 0);
        } else if (bc == 80) {
            if (bf16) af_wgmma_m64n80k16_bf16_ss(s, a, k, kk > 0);
            else af_wgmma_m64n80k16_f16_ss(s, a, k, kk > 0);
        } else {
            if (bf16) af_wgmma_m64n128k16_bf16_ss(s, a, k, kk > 0);
            else af_wgmma_m64n128k16_f16_ss(s, a, k, kk > 0);
        }
    }
    af_wgmma_commit();
}

/* S's accumulators zeroed and pinned before the wgmma stage that writes them (defined inside it, ptxas serialises). */
AF_DEVICE void af_wgmma_zero(float s[AF_WG_BC / 2], const int bc) {
    AF_MMA_UNROLL
    for (int i = 0; i < bc / 2; i++) s[i] = 0.0f;
    af_wgmma_fence_regs(s, bc / 2);
}

/* P's A fragments: the S accumulators of keys 16ks..16ks+15, packed in pairs (the wgmma D layout is its A layout). */
AF_DEVICE void af_wgmma_pack_p(uint32_t pa[AF_WG_BC / 16][4], const float s[AF_WG_BC / 2], const int bc,
                               const int bf16) {
    AF_MMA_UNROLL
    for (int ks = 0; ks < bc / 16; ks++)
        AF_MMA_UNROLL
        for (int j = 0; j < 4; j++) pa[ks][j] = af_mma_pack(s[8 * ks + 2 * j], s[8 * ks + 2 * j + 1], bf16);
}

/* Issues O(64 x hd) += P(64 x bc) · V(bc keys x hd) as one wgmma group (no wait): P from registers (they must stay
 * untouched until the wait), V MN-major (a key's row of 64 columns is one 128-byte swizzle row; LBO steps column
 * blocks, SBO groups of 8 keys). Head dim 256 takes two n128 products a k-step, on O's two column halves (the D
 * layout's index i + 64 is column 128 + that of i). Follows the caller's wgmma fence. */
AF_DEVICE void af_wgmma_issue_values(float *o, uint32_t pa[AF_WG_BC / 16][4], const char *v_tile, const int hd,
                                     const int bf16) {
    const int bc = AF_WG_BC_OF(hd);
    AF_MMA_UNROLL
    for (int ks = 0; ks < bc / 16; ks++) {
        AF_MMA_UNROLL
        for (int half = 0; half < (hd == 256 ? 2 : 1); half++) {
            const uint64_t v = af_wgmma_desc(v_tile + half * 2 * AF_WG_BLOCK_BYTES(bc) + ks * 2 * 1024,
                                             AF_SWIZZLE_128B, AF_WG_BLOCK_BYTES(bc), 1024);
            if (hd == 64) {
                if (bf16) af_wgmma_m64n64k16_bf16_rs_btrans(o, pa[ks], v, 1);
                else af_wgmma_m64n64k16_f16_rs_btrans(o, pa[ks], v, 1);
            } else {
                if (bf16) af_wgmma_m64n128k16_bf16_rs_btrans(o + 64 * half, pa[ks], v, 1);
                else af_wgmma_m64n128k16_f16_rs_btrans(o + 64 * half, pa[ks], v, 1);
            }
        }
    }
    af_wgmma_commit();
}

/* A tile's scores (its wgmma group complete) into weights: the scale or softcap, the masks of its parts of 64 keys
 * or fewer (attn_mma.cuh's, on the same fragment layout; 80 keys are 64 + 16), then the online softmax over all bc
 * keys before any weight is used (O's correction left to the caller, whose P·V of the last tile may still be
 * running). */
AF_DEVICE void af_wgmma_weights(float s[AF_WG_BC / 2], const af_mma_params *p, int64_t b, int64_t hk, int64_t rt0,
                                int64_t tile, int64_t hi_min, int64_t lo_max, float m[2], float l[2],
                                float correction[2], const int bc, const int bf16) {
    AF_MMA_UNROLL
    for (int i = 0; i < bc / 2; i++)
        s[i] = p->softcap_on ? p->softcap_log2 * af_tanh_approx(s[i] * p->scale_over_cap) : s[i] * p->scale_log2;
    AF_MMA_UNROLL
    for (int part = 0; part < (bc + AF_MMA_BC - 1) / AF_MMA_BC; part++) {
        const int keys = bc - part * AF_MMA_BC < AF_MMA_BC ? bc - part * AF_MMA_BC : AF_MMA_BC;
        const int64_t key0 = tile * bc + part * AF_MMA_BC;
        if (p->mask || key0 + keys > hi_min || key0 < lo_max)
            af_mma_apply_mask((float (*)[4])(s + part * (AF_MMA_BC / 2)), p, b, hk, rt0, key0, bf16, 1, keys);
    }
    af_mma_softmax_weights((float (*)[4])s, m, l, correction, bc);
}

/* Hands the GEMM turn to the other consumer warpgroup once this one's are issued. Unconditional, as a branch
 * between a wgmma and its wait makes ptxas serialise every wgmma (C7520); so consumer 1's last hand-over leaves
 * half a phase on consumer 0's barrier when the CTA exits, as FlashAttention-3's does (barriers start empty in
 * every CTA). */
AF_DEVICE void af_wgmma_pass_turn(int consumer) { af_named_bar_arrive(AF_WG_TURN_BAR + 1 - consumer, 256); }

/* The producer's warp zeroes the V rows of keys past the sequence in its last, partial tile (keys `valid`.. of
 * the stage), landed on the tail barrier: TMA reads whole boxes, so they hold the next sequence's keys, a page's
 * unused rows or anything at all, and a weight of 0 times a NaN there would be NaN. The stores are published to the
 * async proxy and the warp meets before its lane 0 completes the stage's "full" phase. */
AF_DEVICE void af_wgmma_clear_tail(char *v_stage, uint64_t *tail_bar, uint32_t parity, int valid, const int hd) {
    const int bc = AF_WG_BC_OF(hd), chunks = (bc - valid) * 8;   /* the rows' 16-byte chunks in one column block */
    af_mbarrier_wait_parity(tail_bar, parity);
    for (int block = 0; block < hd / AF_WG_ATOM; block++)
        for (int i = af_lane(); i < chunks; i += 32) {
            uint32_t *w = (uint32_t *)(v_stage + block * AF_WG_BLOCK_BYTES(bc) + valid * 128 + i * 16);
            w[0] = w[1] = w[2] = w[3] = 0u;
        }
    af_fence_proxy_async();
    af_named_bar_sync(AF_WG_PRODUCER_BAR, 32);
}

/* Lane 0 of the producer's warp: one tile's K or V boxes (hd/64 column blocks; a box of box_keys keys, each page
 * through the table) into `stage`, completing on `bar` with their bytes. Keys past the sequence name page
 * `num_pages`, past the pool: TMA zero-fills them and no page entry past the sequence is read. */
AF_DEVICE void af_wgmma_load_boxes(const af_wgmma_params *p, char *stage, const CUtensorMap *map, uint64_t *bar,
                                   const int32_t *table, int tile, int keys, int first_key, int batch, int hk,
                                   const int hd) {
    const int bc = AF_WG_BC_OF(hd), blocks = hd / AF_WG_ATOM, bytes = AF_WG_BLOCK_BYTES(bc);
    const int table_step = (int)p->m.page_table_stride[1], page = (int)p->m.page_size;
    af_mbarrier_arrive_expect_tx(bar, (uint32_t)(blocks * bytes));
    for (int box = 0; box < bc / p->box_keys; box++) {   /* paged: bc / gcd(page, bc) boxes; else one */
        const int key = tile * bc + box * p->box_keys;
        int row = first_key + key, outer = batch;   /* fixed or varlen: {col, key, hk, batch} */
        if (table) {   /* {col, row in its page, hk, page} */
            row = (int)((unsigned)key % (unsigned)page);
            outer = key < keys ? table[(int)((unsigned)key / (unsigned)page) * table_step] : (int)p->m.num_pages;
        }
        for (int c = 0; c < blocks; c++)
            af_tma_load_4d(stage + box * p->box_keys * 128 + c * bytes, map, bar, c * AF_WG_ATOM, row, hk, outer);
    }
}

/* One work item as the consumers compute it (af_wgmma_item_of). */
typedef struct {
    int64_t b, hk, r0;                         /* batch, kv head, first packed row */
    af_sequence sq;
    int64_t t_begin, t_end, hi_min, lo_max;    /* the tiles it reads; the keys every / some row sees */
    int bad;                                   /* the sequence's bounds are broken: no key read, its rows NaN */
    int rows;                                  /* the row block holds rows of its sequence (else skipped: the combine
                                                  skips them too) */
} af_wgmma_item;

/* Item `item`'s batch, head, rows, sequence and tile range [t_begin, t_end) (empty when it has no rows or a broken
 * sequence). */
AF_DEVICE void af_wgmma_item_of(const af_wgmma_params *wp, int item, af_wgmma_item *it, const int bc) {
    const af_mma_params *p = &wp->m;
    int64_t rb, bhk, split, lo_min, hi_max;
    af_wgmma_sched_item(&wp->sched, item, &rb, &bhk, &split);
    it->b = af_mma_div(bhk, p->Hkv), it->hk = af_mma_mod(bhk, p->Hkv), it->r0 = rb * AF_WG_ROWS;
    it->bad = af_mma_sequence_checked(p, it->b, &it->sq) != AF_SEQ_OK;
    it->rows = it->r0 < p->group * it->sq.L;
    it->t_begin = it->t_end = 0;
    if (!it->rows) return;
    af_mma_block_keys(p, &it->sq, it->r0, AF_WG_ROWS, &lo_min, &it->hi_min, &it->lo_max, &hi_max);
    const int64_t tiles = (hi_max + bc - 1) / bc, t_first = lo_min / bc;
    it->t_begin = split * p->tiles_per_split;
    it->t_end = it->t_begin + p->tiles_per_split < tiles ? it->t_begin + p->tiles_per_split : tiles;
    if (it->t_begin < t_first) it->t_begin = t_first;
    /* a broken sequence reads no key (l = NaN makes its rows or partials NaN); a split past the block's keys reads
     * none either, and its count stays 0 (a record's count -1 ends the items) */
    if (it->bad || it->t_end < it->t_begin) it->t_end = it->t_begin;
}

/* What the producer needs of an item, in shared memory: its 24 registers hold no sequence or key-range arithmetic
 * (the consumers compute the items; count -1: no more items). */
typedef struct {
    int t_begin, count, keys, first_key, batch, hk;
    int issued;                                /* the item's first tile was issued already (af_wgmma_body) */
    int b;                                     /* the batch's row of the page table */
} af_wgmma_record;

/* The shared memory's layout from the tiles' base (af_wgmma_tiles_base): the AF_WG_BAR_KINDS·AF_WG_STAGES_MAX stage
 * mbarriers, the tail's, the items' four ("full" and "empty" of two slots), two item records and a flag in the first
 * AF_WG_HEAD bytes (constant offsets: the producer keeps one pointer), then Q, the stages' K, the stages' V. */
AF_DEVICE uint64_t *af_wgmma_bars(char *base) { return (uint64_t *)base; }
AF_DEVICE uint64_t *af_wgmma_tail_bar(char *base) { return af_wgmma_bars(base) + AF_WG_BAR_KINDS * AF_WG_STAGES_MAX; }
AF_DEVICE uint64_t *af_wgmma_item_bars(char *base) { return af_wgmma_tail_bar(base) + 1; }
AF_DEVICE af_wgmma_record *af_wgmma_records(char *base) { return (af_wgmma_record *)(af_wgmma_item_bars(base) + 4); }
AF_DEVICE int *af_wgmma_bad_page(char *base) { return (int *)(af_wgmma_records(base) + 2); }
/* the head's contents (204 bytes) fit AF_WG_HEAD: an array of negative size otherwise */
typedef char af_wgmma_head_fits[(AF_WG_BAR_KINDS * AF_WG_STAGES_MAX + 5) * 8 + 2 * sizeof(af_wgmma_record) + 4 <=
                                        AF_WG_HEAD
                                    ? 1
                                    : -1];
AF_DEVICE char *af_wgmma_k_stages(char *base, const int hd) {
    return base + AF_WG_HEAD + (hd / AF_WG_ATOM) * AF_WG_BLOCK_BYTES(AF_WG_ROWS);
}
AF_DEVICE char *af_wgmma_v_stages(char *base, int stages, const int hd) {
    return af_wgmma_k_stages(base, hd) + stages * (hd / AF_WG_ATOM) * AF_WG_BLOCK_BYTES(AF_WG_BC_OF(hd));
}

#include "cuda/attn_wgmma_gather.cuh"

/* Item `it`'s record. Posted (af_wgmma_post_record) into slot j % 2 for this CTA's j-th item ("item full" j % 2)
 * once the producer is done with the slot's last one ("item empty"): thread 0 fills item 0's before the CTA barrier,
 * consumer 0's first thread posts item j + 1's when it starts item j, so the producer loads an item's first tiles
 * under the last item's epilogue. */
AF_DEVICE void af_wgmma_fill_record(const af_wgmma_params *wp, const af_wgmma_item *it, af_wgmma_record *r,
                                    int issued) {
    r->t_begin = (int)it->t_begin, r->count = (int)(it->t_end - it->t_begin), r->keys = (int)it->sq.S;
    r->first_key = (int)it->sq.k0, r->batch = wp->varlen_k ? 0 : (int)it->b, r->hk = (int)it->hk;
    r->issued = issued, r->b = (int)it->b;
}

AF_DEVICE void af_wgmma_post_record(const af_wgmma_params *wp, af_wgmma_record *records, uint64_t *item_bars,
                                    int item, const int bc) {
    const int j = (int)((unsigned)item / (unsigned)AF_GRID_DIM_X), slot = j & 1;   /* item AF_BLOCK_IDX_X + j·grid */
    if (j >= 2) af_mbarrier_wait_parity(item_bars + 2 + slot, (uint32_t)((j / 2 - 1) & 1));
    af_wgmma_record *r = records + slot;
    r->count = -1;
    if (item < wp->sched.items) {
        af_wgmma_item it;
        af_wgmma_item_of(wp, item, &it, bc);
        af_wgmma_fill_record(wp, &it, r, 0);
    }
    af_mbarrier_arrive(item_bars + slot);   /* release: the stores above are seen by the producer's wait */
}

/* Lane 0 of the producer's warp: K (or V, `values`) of record r's tile n into `stage`, completing "full K" (or
 * "full V"; the tail barrier for a sequence's partial last tile, whose V rows past the keys are cleared after it
 * lands). */
AF_DEVICE void af_wgmma_issue(const af_wgmma_params *p, char *base, const volatile af_wgmma_record *r, int n,
                              int stage, int values, const int hd) {
    const int bc = AF_WG_BC_OF(hd), stage_bytes = (hd / AF_WG_ATOM) * AF_WG_BLOCK_BYTES(bc);
    const int tile = r->t_begin + n, keys = r->keys, tail = keys % bc ? keys / bc : -1;
    /* a paged cache's one item: each box's page through the table */
    const int32_t *table = p->m.page_table ? p->m.page_table + (int64_t)r->b * p->m.page_table_stride[0] : NULL;
    uint64_t *bar = af_wgmma_bar(af_wgmma_bars(base), values ? AF_WG_FULL_V : AF_WG_FULL_K, stage);
    if (values && tile == tail) bar = af_wgmma_tail_bar(base);
    char *stages = values ? af_wgmma_v_stages(base, AF_WG_STAGES, hd) : af_wgmma_k_stages(base, hd);
    af_wgmma_load_boxes(p, stages + stage * stage_bytes, values ? &p->v_map : &p->k_map, bar, table, tile, keys,
                        r->first_key, r->batch, r->hk, hd);
}

/* The producer, warp 0 of warpgroup 0 (lane 0 issues), item after item (af_wgmma_post_record's records; a paged
 * cache's one item a CTA, each box's page through the table): tiles [t_begin, t_begin + count) of bc keys, the
 * ring's g-th tile (counted over the CTA's items) into stage g % AF_WG_STAGES: its K once the consumers' S read
 * the stage's last K ("empty K" phase g / AF_WG_STAGES - 1), completing "full K", then its V once their P·V read
 * the last V ("empty V"), completing "full V"; a sequence's partial last tile's V lands on the tail barrier instead
 * (its phases counted by `tails`), is cleared past its keys, then completes "full V" with lane 0's arrive
 * (af_wgmma_issue issues each). */
AF_DEVICE void af_wgmma_produce(const af_wgmma_params *p, char *base, const int hd) {
    const int bc = AF_WG_BC_OF(hd), stage_bytes = (hd / AF_WG_ATOM) * AF_WG_BLOCK_BYTES(bc), lane = af_lane();
    char *v_stages = af_wgmma_v_stages(base, AF_WG_STAGES, hd);
    uint64_t *bars = af_wgmma_bars(base), *tail_bar = af_wgmma_tail_bar(base), *item_bars = af_wgmma_item_bars(base);
    const af_wgmma_record *records = af_wgmma_records(base);
    uint32_t g = 0, tails = 0;
    for (int j = 0; AF_WG_PERSISTENT(hd) || j == 0; j++) {   /* head dim 256: one item a CTA, one record */
        const int slot = j & 1;
        af_mbarrier_wait_parity(item_bars + slot, (uint32_t)((j / 2) & 1));
        /* read in place, where used (volatile: no register holds a field, ptxas spilled them) */
        const volatile af_wgmma_record *r = records + slot;
        const int end = r->count < 0;
        /* the slot released at once (no register holds its address through the item): consumer 0 rewrites it when
         * it starts the next item (posting the one after), so after the consumers took this item's last tile, which
         * this lane's "full V" arrive released after its last read of the record */
        af_mbarrier_arrive(item_bars + 2 + slot);
        if (end) break;
        for (int n = 0; n < r->count; n++, g++) {
            const int stage = (int)(g % AF_WG_STAGES), tile = r->t_begin + n, keys = r->keys;
            const int tail = keys % bc ? keys / bc : -1, issue = lane == 0 && (n > 0 || !r->issued);
            const uint32_t released = (g / AF_WG_STAGES - 1) & 1;
            if (g >= AF_WG_STAGES) af_mbarrier_wait_parity(af_wgmma_bar(bars, AF_WG_EMPTY_K, stage), released);
            if (issue) af_wgmma_issue(p, base, r, n, stage, 0, hd);
            if (g >= AF_WG_STAGES) af_mbarrier_wait_parity(af_wgmma_bar(bars, AF_WG_EMPTY_V, stage), released);
            uint64_t *full_v = af_wgmma_bar(bars, AF_WG_FULL_V, stage);
            if (issue) af_wgmma_issue(p, base, r, n, stage, 1, hd);
            if (tile == tail) {
                af_wgmma_clear_tail(v_stages + stage * stage_bytes, tail_bar, tails++ & 1, keys - tail * bc, hd);
                if (lane == 0) af_mbarrier_arrive(full_v);
            }
        }
    }
}

/* One item of a consumer warpgroup (`g0` tiles consumed before it; returns the count after it): its Q rows, the
 * tiles, the epilogue. */
AF_DEVICE uint32_t af_wgmma_consume(const af_wgmma_params *wp, const af_wgmma_item *it, int item, char *q_tile,
                                    char *k_stages, char *v_stages, uint64_t *bars, uint32_t g0, int consumer,
                                    const int hd, const int bf16) {
    const af_mma_params *p = &wp->m;
    const int bc = AF_WG_BC_OF(hd), blocks = hd / AF_WG_ATOM, stages = AF_WG_STAGES_OF(hd, wp->gather);
    /* 32 bits across the loop (the plan bounds rows, keys and heads): widened where used */
    const int b = (int)it->b, hk = (int)it->hk, t_begin = (int)it->t_begin, hi_min = (int)it->hi_min;
    const int lo_max = (int)it->lo_max, warp = af_warp() % 4;
    const int rt0 = (int)it->r0 + 64 * consumer + 16 * warp;   /* this warp's 16 rows, as attn_mma.cuh's row tiles */
    const int count = (int)(it->t_end - t_begin);   /* the loop counts in 32 bits: a register pair less at hd 256 */
    if (count > 0) af_wgmma_load_q(q_tile, p, b, hk, &it->sq, it->r0, consumer, hd);   /* before any accumulator */
    float o[AF_WG_HD_MAX / 2];
    AF_MMA_UNROLL
    for (int d = 0; d < hd / 2; d++) o[d] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {it->bad ? NAN : 0.0f, it->bad ? NAN : 0.0f};
    const int stage_bytes = blocks * AF_WG_BLOCK_BYTES(bc), ping_pong = hd <= 128;
    /* Two tiles in flight (FlashAttention-3's intra-warpgroup overlap): tile n's S = Q·Kᵀ is issued together with
     * tile n-1's P·V; once S lands its softmax runs while P·V still does, then O takes the correction and the new P
     * replaces the old one's registers; stage n-1 is released when its P·V has read it. The first tile (S alone) and
     * the last P·V are peeled off the loop, so that no branch inside it hides from ptxas which wgmma group is done
     * (a conditional one serialises them all).
     * Ping-pong between the two consumers (FlashAttention-3's scheduler barriers): a warpgroup issues its GEMMs only
     * on its turn (its named barrier) and hands the turn over once they are issued, so one warpgroup's softmax runs
     * while the other's GEMMs hold the tensor cores (head dims up to 128, as FlashAttention-3: at 256 one P·V is
     * long enough to keep the other warpgroup waiting). The ring's g-th tile is in stage g % stages. */
    uint32_t pa[AF_WG_BC / 16][4];
    float correction[2], s[AF_WG_BC / 2];
    /* the gathered producer completes one barrier a stage, K and V together (af_wgmma_wait_full fenced after it) */
    const int full_v_kind = wp->gather ? AF_WG_FULL_K : AF_WG_FULL_V;
    if (count > 0) {
        const int stage = (int)(g0 % stages);
        af_wgmma_wait_full(af_wgmma_bar(bars, AF_WG_FULL_K, stage), (g0 / stages) & 1, wp->gather);
        af_wgmma_zero(s, bc);
        af_wgmma_fence();
        if (ping_pong) af_named_bar_sync(AF_WG_TURN_BAR + consumer, 256);
        af_wgmma_issue_scores(s, q_tile, k_stages + stage * stage_bytes, consumer, hd, bf16);
        if (ping_pong) af_wgmma_pass_turn(consumer);
        af_wgmma_wait_0();
        af_mbarrier_arrive(af_wgmma_bar(bars, AF_WG_EMPTY_K, stage));   /* S has read K */
        af_wgmma_fence_regs(s, bc / 2);
        af_wgmma_weights(s, p, b, hk, rt0, t_begin, hi_min, lo_max, m, l, correction, bc, bf16);
        af_mma_rescale((float (*)[4])o, correction, hd, p->Ev);
        af_wgmma_pack_p(pa, s, bc, bf16);
    }
    const uint32_t g_end = g0 + (uint32_t)count;
    for (uint32_t g = g0 + 1; g < g_end; g++) {
        const int tile = t_begin + (int)(g - g0);
        const int stage = (int)(g % stages), last = (int)((g - 1) % stages);
        af_wgmma_wait_full(af_wgmma_bar(bars, AF_WG_FULL_K, stage), (g / stages) & 1, wp->gather);
        af_mbarrier_wait_parity(af_wgmma_bar(bars, full_v_kind, last), ((g - 1) / stages) & 1);
        af_wgmma_zero(s, bc);
        af_wgmma_fence_regs_u32(&pa[0][0], bc / 4);
        af_wgmma_fence_regs(o, hd / 2);
        af_wgmma_fence();
        if (ping_pong) af_named_bar_sync(AF_WG_TURN_BAR + consumer, 256);
        af_wgmma_issue_scores(s, q_tile, k_stages + stage * stage_bytes, consumer, hd, bf16);
        af_wgmma_issue_values(o, pa, v_stages + last * stage_bytes, hd, bf16);
        if (ping_pong) af_wgmma_pass_turn(consumer);
        af_wgmma_wait_1();   /* S (the older group) has landed; P·V runs on */
        af_mbarrier_arrive(af_wgmma_bar(bars, AF_WG_EMPTY_K, stage));   /* the next K load may start */
        af_wgmma_fence_regs(s, bc / 2);
        af_wgmma_weights(s, p, b, hk, rt0, tile, hi_min, lo_max, m, l, correction, bc, bf16);
        af_wgmma_wait_0();
        af_wgmma_fence_regs(o, hd / 2);
        af_mbarrier_arrive(af_wgmma_bar(bars, AF_WG_EMPTY_V, last));   /* P·V has read tile n-1's V */
        af_mma_rescale((float (*)[4])o, correction, hd, p->Ev);
        af_wgmma_pack_p(pa, s, bc, bf16);
    }
    if (count > 0) {   /* the last tile's P·V */
        const int last = (int)((g_end - 1) % stages);
        af_mbarrier_wait_parity(af_wgmma_bar(bars, full_v_kind, last), ((g_end - 1) / stages) & 1);
        af_wgmma_fence_regs_u32(&pa[0][0], bc / 4);
        af_wgmma_fence_regs(o, hd / 2);
        af_wgmma_fence();
        af_wgmma_issue_values(o, pa, v_stages + last * stage_bytes, hd, bf16);
        af_wgmma_wait_0();
        af_wgmma_fence_regs(o, hd / 2);
        af_mbarrier_arrive(af_wgmma_bar(bars, AF_WG_EMPTY_V, last));
    }
    int64_t rb, bhk, split;   /* decoded again from the item: no register held across the loop */
    af_wgmma_sched_item(&wp->sched, item, &rb, &bhk, &split);
    af_mma_epilogue(p, (float (*)[4])o, m, l, b, hk, rt0, 1.0f, split, hd, bf16);
    return g_end;
}

/* The whole CTA, a persistent loop over its items (item AF_BLOCK_IDX_X, then every AF_GRID_DIM_X-th: one wave of
 * CTAs, so each item's prologue and epilogue run under another's loads; a paged cache, whose pages are checked
 * before any is read, gets one item a CTA from the plan): hd (64, 128, 256) and bf16 are constants here (see
 * AF_WGMMA_KERNEL). */
AF_DEVICE void af_wgmma_body(const af_wgmma_params *wp, const int hd, const int bf16) {
    const af_mma_params *p = &wp->m;
    const int bc = AF_WG_BC_OF(hd);
    if (AF_BLOCK_IDX_X >= wp->sched.items) return;
    af_wgmma_item first;
    af_wgmma_item_of(wp, AF_BLOCK_IDX_X, &first, bc);

    char *base = af_wgmma_tiles_base();   /* the swizzle patterns count from here */
    const int stages = AF_WG_STAGES_OF(hd, wp->gather);
    char *q_tile = base + AF_WG_HEAD, *k_stages = af_wgmma_k_stages(base, hd);
    char *v_stages = af_wgmma_v_stages(base, stages, hd);
    uint64_t *bars = af_wgmma_bars(base), *tail_bar = af_wgmma_tail_bar(base), *item_bars = af_wgmma_item_bars(base);
    af_wgmma_record *records = af_wgmma_records(base);
    int *bad_page = af_wgmma_bad_page(base);   /* a page entry of the first item's keys outside the pool */

    /* no page to check: the first item's tile 0 goes out first */
    const int first_issued = !p->page_table && first.t_begin < first.t_end;
    if (AF_THREAD_IDX == 0) {
        *bad_page = 0;
        for (int s = 0; s < stages; s++) {   /* the stages' slots of each kind */
            /* TMA: the producer's arrive, with the tile's bytes; gathered: each producer thread's, its copies done */
            af_mbarrier_init(af_wgmma_bar(bars, AF_WG_FULL_K, s), wp->gather ? AF_WG_GATHER_THREADS : 1);
            af_mbarrier_init(af_wgmma_bar(bars, AF_WG_FULL_V, s), 1);   /* unused when gathered */
            af_mbarrier_init(af_wgmma_bar(bars, AF_WG_EMPTY_K, s), AF_WG_THREADS - 128);   /* every consumer thread */
            af_mbarrier_init(af_wgmma_bar(bars, AF_WG_EMPTY_V, s), AF_WG_THREADS - 128);
        }
        af_mbarrier_init(tail_bar, 1);   /* the producer's arrive with the partial last tile's bytes */
        for (int slot = 0; slot < 2; slot++) {
            af_mbarrier_init(item_bars + slot, 1);       /* the poster's arrive */
            af_mbarrier_init(item_bars + 2 + slot, 32);   /* the producer warp's lanes, done with the record */
        }
        af_fence_mbarrier_init();
        af_wgmma_fill_record(wp, &first, records, first_issued);   /* slot 0, item 0: nothing to wait for */
        af_mbarrier_arrive(item_bars);
        /* tile 0's K and V at once, under Q's copy and the barrier below (issue 37 item 5): this thread is the
         * producer's lane 0 and initialised the barriers; paged caches wait for their pages' check */
        if (first_issued) {
            af_wgmma_issue(wp, base, records, 0, 0, 0, hd);
            af_wgmma_issue(wp, base, records, 0, 0, 1, hd);
        }
    }
    if (p->page_table && first.t_begin < first.t_end) {   /* its pages, checked before any is: warpgroup 0's share */
        af_syncthreads();   /* *bad_page is 0 */
        const af_sequence *sq = &first.sq;
        const int64_t hi = first.t_end * bc < sq->S ? first.t_end * bc : sq->S, lo = first.t_begin * bc;
        if (AF_THREAD_IDX < 128 && hi > lo &&
            !af_page_entries_valid(p->page_table, p->page_table_stride, p->num_pages, first.b,
                                   af_mma_div(lo, p->page_size), af_mma_div(hi + p->page_size - 1, p->page_size),
                                   AF_THREAD_IDX, 128))
            *bad_page = 1, records[0].count = 0;   /* the consumers' flag; the producer reads no tile */
    }
    af_syncthreads();   /* the barriers, the first record and the page check are ready; the last CTA-wide barrier */

    const int warpgroup = AF_THREAD_IDX / 128;
    if (warpgroup == 0) {
        AF_SETMAXNREG_DEC(24);
        if (wp->gather)   /* one item a CTA (record 0, its count 0 past a bad page) */
            af_wgmma_gather(wp, base, records, hd);
        else if (AF_THREAD_IDX < 32)
            af_wgmma_produce(wp, base, hd);   /* its pointers from the base: offsets, not registers */
        return;
    }
    AF_SETMAXNREG_INC(240);
    /* the consumer index as a warp-uniform value: its Q descriptors then live in uniform registers (head dim 256
     * spilled 16 of them) */
    const int consumer = af_warp_broadcast(warpgroup - 1);
    /* consumer 0's turn first; from then on consumer 1's last hand-over of an item is consumer 0's first turn of the
     * next */
    if (hd <= 128 && consumer == 0) af_named_bar_arrive(AF_WG_TURN_BAR, 256);   /* ping-pong (af_wgmma_consume) */
    uint32_t g = 0;   /* tiles consumed so far: the ring's position */
    /* the item read afresh: the prologue's block index would live through it into this region (ptxas spilled it) */
    for (int item = af_block_idx_x_reread(); item < wp->sched.items; item += AF_GRID_DIM_X) {
        if (AF_WG_PERSISTENT(hd) && AF_THREAD_IDX == 128)   /* the producer's next */
            af_wgmma_post_record(wp, records, item_bars, item + AF_GRID_DIM_X, bc);
        af_wgmma_item it;
        af_wgmma_item_of(wp, item, &it, bc);
        if (!it.rows) continue;
        if (*bad_page) it.bad = 1, it.t_end = it.t_begin;
        g = af_wgmma_consume(wp, &it, item, q_tile, k_stages, v_stages, bars, g, consumer, hd, bf16);
        if (!AF_WG_PERSISTENT(hd)) break;   /* the plan gives head dim 256 one item a CTA */
    }
}

/* One kernel per (head dim, dtype). */
#define AF_WGMMA_KERNEL(name, hd, bf16) \
    AF_KERNEL_SM90(name, af_wgmma_params, p, AF_WG_THREADS) { af_wgmma_body(&p, hd, bf16); }
AF_WGMMA_KERNEL(af_wgmma_f16_hd64, 64, 0)
AF_WGMMA_KERNEL(af_wgmma_f16_hd128, 128, 0)
AF_WGMMA_KERNEL(af_wgmma_bf16_hd64, 64, 1)
AF_WGMMA_KERNEL(af_wgmma_bf16_hd128, 128, 1)
AF_WGMMA_KERNEL(af_wgmma_f16_hd256, 256, 0)
AF_WGMMA_KERNEL(af_wgmma_bf16_hd256, 256, 1)

#endif
