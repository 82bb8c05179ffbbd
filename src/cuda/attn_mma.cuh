/* The tensor-core attention kernel for f16/bf16 (FlashAttention-2 structure, mma.sync m16n8k16):
 *   - a CTA owns AF_MMA_BLOCK_ROWS(rt) packed query rows of one (batch, kv head): the GQA group's heads are packed
 *     into the row dimension (packed row r: head hk·group + r / L, query r % L), so each K/V tile serves the whole
 *     group; 4 warps, each owning rt row tiles of 16 rows (rt = 2 for head dims 64 and 128, FlashAttention-2's 32
 *     rows a warp: every K or V fragment read from shared memory feeds 2·rt mma instead of 2) and all keys of a
 *     tile, so softmax needs no communication between warps; rt = 1 for head dim 256, float8 and few rows (decode);
 *   - Q: cp.async to shared memory, then ldmatrix into registers once (rt·head dim <= 128; else the fragments are
 *     read from shared memory per tile, to keep the registers for O);
 *   - K/V tiles of AF_MMA_BC keys: cp.async.cg 16-byte copies, double-buffered, an XOR swizzle of the 16-byte
 *     chunks of each row (chunk c of row r at c ^ (r & 7)) so the 8 rows an ldmatrix reads hit 8 different banks;
 *   - S = Q·Kᵀ with K fragments by ldmatrix; online softmax in log2 units with lazy rescaling (threshold
 *     AF_MMA_RESCALE_THRESHOLD); P packed to f16/bf16 straight from the S accumulators into the A fragment of P·V
 *     (C rows/cols (g, 2t..2t+1), (g+8, ..) of two n8 tiles are the a0..a7 of one k16 slice); V by ldmatrix.trans;
 *   - tiles outside every row's key range (causal, af_flash_attn's sliding window) are never loaded, masks are
 *     applied only on tiles that need them; af_flash_attn's softcap on the scaled S, its learned sink joined to the
 *     row's max and sum in the epilogue (or in the combine, under split-KV);
 *   - af_flash_attn's sequences: varlen rows and keys through cu_seqlens (the grid covers the longest sequence;
 *     CTAs past a sequence's rows return), seqused_k (each batch's own key count) and paged K/V (each tile row
 *     found through the page table);
 *   - split-KV (blockIdx.z): each split writes its normalised f32 partial O and LSE; attn_combine.cuh merges them;
 *   - float8 K/V (e4m3fn, e5m2) under an f16/bf16 q: tiles are staged as bytes (half the traffic), then converted
 *     in shared memory into the 16-bit tile the products read (every float8 value is exact in f16 and bf16); the
 *     (batch, kv head)'s q_descale·k_descale multiplies the scores and v_descale the output, as on the CPU. With q
 *     float8 too (FA4's fp8), Q is staged and converted the same way, once, and the products run in out's dtype.
 * Head-dim variants are compile-time constants: AF_MMA_KERNEL stamps out one kernel per (head dim, dtype), and
 * af_mma_body's register arrays are indexed only by constants once it is inlined with that head dim.
 * Matches src/sdpa/reference.c on finite inputs: masked keys add nothing, a row that sees no key gets out = 0 and
 * lse = -inf. */
#ifndef AF_CUDA_ATTN_MMA_CUH
#define AF_CUDA_ATTN_MMA_CUH
#include <math.h>
#include <stdint.h>

#include "cuda/kernels.h"
#include "cuda/scalar.cuh"

#define AF_MMA_WARPS 4
#define AF_MMA_THREADS (32 * AF_MMA_WARPS)
#define AF_MMA_TILE_ROWS 16                    /* rows of one mma row tile (m16) */
#define AF_MMA_RT_MAX 2                        /* row tiles per warp: 1 or 2 */
#define AF_MMA_BLOCK_ROWS(rt) (AF_MMA_TILE_ROWS * AF_MMA_WARPS * (rt))   /* packed query rows per CTA: 64 or 128 */
#define AF_MMA_BC 64                           /* keys per K/V tile */
#define AF_MMA_HD_MAX 256                      /* largest head-dim variant */
#define AF_MMA_Q_REG_COLS 128                  /* Q fragments stay in registers up to rt·head dim = this */
#define AF_MMA_RESCALE_THRESHOLD 8.0f          /* log2 units: weights stay <= 2^8 against a stale max */
#define AF_MMA_LOG2E 1.4426950408889634f
#define AF_MMA_LN2 0.6931471805599453f

#if defined(__CUDACC__)
#define AF_MMA_UNROLL _Pragma("unroll")        /* constant indices: the fragments stay in registers */
#define AF_MMA_ROLLED _Pragma("unroll 1")      /* copies: per-row addresses are not kept in registers across tiles */
#else
#define AF_MMA_UNROLL
#define AF_MMA_ROLLED
#endif

enum { AF_MMA_MASK_NONE = 0, AF_MMA_MASK_BOOL, AF_MMA_MASK_ADDITIVE };

typedef struct {
    const char *q, *k, *v;
    int64_t q_stride[4], k_stride[4], v_stride[4];   /* elements */
    char *out;
    int64_t out_stride[4];
    float *lse;                    /* NULL or (B, Hq, L) */
    int64_t lse_stride[3];
    const char *mask;
    int64_t mask_stride[4];
    int mask_kind;                 /* AF_MMA_MASK_* */
    int causal;                    /* af_causal */
    int has_window;                /* af_flash_attn's sliding window: keys [i + S - L - left, i + S - L + right] */
    int64_t window_left, window_right;
    int softcap_on;                /* s <- softcap·tanh(scale·q·k / softcap), in log2 units: */
    float softcap_log2, scale_over_cap;   /* softcap·log2(e) and scale / softcap */
    const char *sink;              /* NULL, or (Hq,) logits of sink_dtype, sink_stride elements apart */
    int sink_dtype;
    int64_t sink_stride;
    const int32_t *seqused_k;      /* NULL, or batch b's keys at seqused_k[b·seqused_stride] (<= S) */
    int64_t seqused_stride;
    const int32_t *cu_seqlens_q, *cu_seqlens_k;   /* varlen (NULL otherwise): sequence b's rows and keys start at
                                                     entry b of the packed tensors (batch strides 0); L and S bound
                                                     every sequence's lengths */
    int64_t cu_seqlens_q_stride, cu_seqlens_k_stride;
    const int32_t *page_table;     /* NULL, or key j of batch b in page page_table[b·pt0 + j / page_size·pt1], row
                                      j % page_size: k_stride[0] / v_stride[0] then step pages */
    int64_t page_table_stride[2], page_size;
    int64_t total_q, total_k, num_pages;   /* the bounds every index entry is checked against (af_sequence_checked) */
    int E, Ev;
    int out_pairs;                 /* out's last dim is contiguous and 4-byte aligned at even columns */
    int double_buffer;             /* 2 K/V buffers (else 1, when shared memory is short) */
    int64_t Hkv, L, S, group;
    int64_t rows;                  /* packed rows per (batch, kv head): group·L */
    int64_t row_blocks;            /* CTAs per (batch, kv head) along the rows */
    int64_t heads;                 /* B·Hkv */
    int64_t tiles_per_split;       /* key tiles per blockIdx.z */
    float scale_log2;              /* scale·log2(e) */
    float *part_o, *part_lse;      /* split-KV (NULL otherwise): [split][row id][Ev] and [split][row id] */
    int64_t total_rows;            /* B·Hq·L: row id = (b·Hkv + hk)·rows + r */
    int kv_dtype;                  /* float8 variants: AF_F8E4M3 or AF_F8E5M2 (else q's dtype) */
    int q_float8;                  /* float8 variants: q's float8 dtype when q is float8 too, else 0 */
    const float *q_descale, *k_descale, *v_descale;   /* float8: NULL (= 1) or f32 (B, Hkv) */
    int64_t q_descale_stride[2], k_descale_stride[2], v_descale_stride[2];
} af_mma_params;


/* Shared memory: Q's block rows, then 1 or 2 K tiles and as many V tiles of 64 rows, all of hd 16-bit elements.
 * The float8 variants (rt = 1) need 2: the second K (V) tile's bytes hold two staged float8 tiles of K (V), the
 * first the converted one. */
static inline size_t af_mma_smem_bytes(int hd, int double_buffer, int rt) {
    return ((size_t)AF_MMA_BLOCK_ROWS(rt) + (size_t)2 * (double_buffer ? 2 : 1) * AF_MMA_BC) * (size_t)hd * 2;
}

/* Byte offset of 16-byte chunk `chunk` of row `row` in a tile of hd columns (XOR swizzle, hd >= 64). */
AF_DEVICE int af_mma_swizzle(int row, int chunk, int hd) { return row * hd * 2 + ((chunk ^ (row & 7)) << 4); }

/* Bytes of 16-byte chunk `chunk` of a row of `elem`-byte elements that lie within `cols` columns: the rest is
 * zero-filled. */
AF_DEVICE int af_mma_chunk_bytes(int cols, int chunk, int elem) {
    const int per_chunk = 16 / elem, n = cols - per_chunk * chunk;
    return n >= per_chunk ? 16 : n > 0 ? elem * n : 0;
}

/* Where 16-byte chunk `chunk` of row `row` of a copied tile goes: 16-bit tiles in the products' swizzled layout,
 * float8 ones (elem 1) in plain rows of hd bytes, which only af_mma_convert_tile reads. */
AF_DEVICE int af_mma_copy_offset(int row, int chunk, int hd, int elem) {
    return elem == 2 ? af_mma_swizzle(row, chunk, hd) : row * hd + chunk * 16;
}

/* a / b and a % b for 0 <= a, 0 < b < 2^31, which the plan guarantees for packed rows, keys and the page size
 * (af_cuda_mma_fits_int32): in 32 bits, since a 64-bit division is a subroutine call whose saved registers spill in
 * the main loop, where every accumulator is live. */
AF_DEVICE int64_t af_mma_div(int64_t a, int64_t b) { return (int64_t)((uint32_t)a / (uint32_t)b); }
AF_DEVICE int64_t af_mma_mod(int64_t a, int64_t b) { return (int64_t)((uint32_t)a % (uint32_t)b); }

/* Batch b's sequence: its first query row and key in the packed tensors (varlen, else 0), its query rows and keys
 * (problem.h's af_sequence_at). */
AF_DEVICE af_sequence af_mma_sequence(const af_mma_params *p, int64_t b) {
    return af_sequence_at(p->cu_seqlens_q, p->cu_seqlens_q_stride, p->cu_seqlens_k, p->cu_seqlens_k_stride,
                          p->seqused_k, p->seqused_stride, p->L, p->S, b);
}

/* af_mma_sequence with every index entry checked before use: AF_SEQ_OK, _POISON or _SKIP (problem.h). */
AF_DEVICE int af_mma_sequence_checked(const af_mma_params *p, int64_t b, af_sequence *sq) {
    return af_sequence_checked(p->cu_seqlens_q, p->cu_seqlens_q_stride, p->cu_seqlens_k, p->cu_seqlens_k_stride,
                               p->seqused_k, p->seqused_stride, p->L, p->S, p->total_q, p->total_k, b, sq);
}

/* Whether every page entry of keys [lo, hi) of batch b is a page of the pool: each warp checks them all (its lanes
 * share the entries), so every thread of the CTA gets the same answer without shared memory or a barrier. */
AF_DEVICE int af_mma_pages_valid(const af_mma_params *p, int64_t b, int64_t lo, int64_t hi) {
    const int none = !p->page_table || hi <= lo;   /* af_pages_valid, dividing in 32 bits */
    float bad = none || af_page_entries_valid(p->page_table, p->page_table_stride, p->num_pages, b,
                                              af_mma_div(lo, p->page_size), af_mma_div(hi + p->page_size - 1,
                                                                                       p->page_size), af_lane(), 32)
                    ? 0.0f : 1.0f;
    for (int x = 16; x > 0; x >>= 1) bad = fmaxf(bad, af_shfl_xor(bad, x));
    return bad == 0.0f;
}

/* The keys [*lo, *hi) query row i of sequence `sq` may see (problem.h's af_key_range_of). */
AF_DEVICE void af_mma_key_range(const af_mma_params *p, const af_sequence *sq, int64_t i, int64_t *lo, int64_t *hi) {
    af_key_range_of(p->causal, p->has_window, p->window_left, p->window_right, sq->L, sq->S, i, lo, hi);
}

/* The keys the packed rows [r0, r0 + block_rows) of sequence `sq` see: both ends of a row's range grow with the
 * query index, and a block that wraps from one head of the group to the next holds both query 0 and query L-1.
 * Keys between lo_max and hi_min need no mask (every row of the block sees them); [lo_min, hi_max) holds all. */
AF_DEVICE void af_mma_block_keys(const af_mma_params *p, const af_sequence *sq, int64_t r0, int block_rows,
                                 int64_t *lo_min, int64_t *hi_min, int64_t *lo_max, int64_t *hi_max) {
    const int64_t rows = p->group * sq->L, r_end = r0 + block_rows < rows ? r0 + block_rows : rows;
    const int wraps = af_mma_div(r_end - 1, sq->L) != af_mma_div(r0, sq->L);
    af_mma_key_range(p, sq, wraps ? 0 : af_mma_mod(r0, sq->L), lo_min, hi_min);
    af_mma_key_range(p, sq, wraps ? sq->L - 1 : af_mma_mod(r_end - 1, sq->L), lo_max, hi_max);
}

/* Where K or V (data, strides; `elem` bytes an element) row `key` of (batch b, kv head hk) starts: through the page
 * table when paged (problem.h's af_kv_row_offset_at). */
AF_DEVICE const char *af_mma_kv_row(const af_mma_params *p, const char *data, const int64_t *stride, int64_t b,
                                    int64_t hk, const af_sequence *sq, int64_t key, int elem) {
    if (p->page_table)
        return data + elem * af_kv_page_row_offset(p->page_table, p->page_table_stride, stride, b, hk,
                                                   af_mma_div(key, p->page_size), af_mma_mod(key, p->page_size));
    return data + elem * af_kv_row_offset_at(NULL, NULL, 0, stride, b, hk, sq->k0, key);
}

AF_DEVICE void af_mma_op(float d[4], const uint32_t a[4], const uint32_t b[2], const int bf16) {
    if (bf16) af_mma_16816_bf16(d, a, b);
    else af_mma_16816_f16(d, a, b);
}

AF_DEVICE uint32_t af_mma_pack(float lo, float hi, const int bf16) {
    return bf16 ? af_pack_bf16x2(lo, hi) : af_pack_f16x2(lo, hi);
}

/* One tile of AF_MMA_BC K or V rows (data, strides; `elem` bytes an element: 2, or 1 for a float8 stage) of
 * (batch b, kv head hk) starting at key0 into shared memory (af_mma_copy_offset's layout): rows at or past the
 * sequence's keys and columns past `cols` are zero-filled. */
AF_DEVICE void af_mma_load_tile(char *dst, const af_mma_params *p, const char *data, const int64_t *stride,
                                int64_t b, int64_t hk, const af_sequence *sq, int64_t key0, int cols, const int hd,
                                const int elem) {
    const int chunks = hd * elem / 16, chunk = AF_THREAD_IDX % chunks, bytes = af_mma_chunk_bytes(cols, chunk, elem);
    AF_MMA_ROLLED
    for (int row = AF_THREAD_IDX / chunks; row < AF_MMA_BC; row += AF_MMA_THREADS / chunks) {
        const int64_t key = key0 + row;
        const int ok = key < sq->S && bytes > 0;
        af_cp_async_16(dst + af_mma_copy_offset(row, chunk, hd, elem),
                       ok ? af_mma_kv_row(p, data, stride, b, hk, sq, key, elem) + chunk * 16 : data, ok ? bytes : 0);
    }
}

/* float8: a staged tile (or Q block) converted into the 16-bit tile the products read (af_mma_swizzle's layout), one
 * 16-byte chunk (8 elements) a step. Exact: every e4m3fn and e5m2 value is an f16 and a bf16 (NaN stays NaN). */
AF_DEVICE void af_mma_convert_tile(char *dst, const char *stage, int kv_dtype, const int hd, const int bf16) {
    const int chunks = hd / 8;   /* a tile of AF_MMA_BC rows: a K/V tile, or the float8 variants' (rt = 1) Q block */
    for (int i = AF_THREAD_IDX; i < AF_MMA_BC * chunks; i += AF_MMA_THREADS) {
        const int row = i / chunks, chunk = i % chunks;
        const uint8_t *src = (const uint8_t *)stage + row * hd + chunk * 8;
        uint32_t *out = (uint32_t *)(dst + af_mma_swizzle(row, chunk, hd));
        AF_MMA_UNROLL
        for (int e = 0; e < 4; e++)
            out[e] = af_mma_pack(af_f8_to_float(src[2 * e], (af_dtype)kv_dtype),
                                 af_f8_to_float(src[2 * e + 1], (af_dtype)kv_dtype), bf16);
    }
}

/* The CTA's `block_rows` packed query rows (from r0) of sequence `sq` into shared memory (`elem` bytes an element:
 * 2, or 1 for a float8 q's stage; af_mma_copy_offset's layout); rows past its group·L are zero. */
AF_DEVICE void af_mma_load_q(char *dst, const af_mma_params *p, int64_t b, int64_t hk, const af_sequence *sq,
                             int64_t r0, const int block_rows, const int hd, const int elem) {
    const int chunks = hd * elem / 16, chunk = AF_THREAD_IDX % chunks, bytes = af_mma_chunk_bytes(p->E, chunk, elem);
    for (int row = AF_THREAD_IDX / chunks; row < block_rows; row += AF_MMA_THREADS / chunks) {
        const int64_t r = r0 + row;
        const char *src = p->q;
        int n = 0;
        if (r < p->group * sq->L && bytes > 0) {
            const int64_t h = hk * p->group + af_mma_div(r, sq->L), i = sq->q0 + af_mma_mod(r, sq->L);
            src = p->q + elem * (b * p->q_stride[0] + h * p->q_stride[1] + i * p->q_stride[2]) + chunk * 16;
            n = bytes;
        }
        af_cp_async_16(dst + af_mma_copy_offset(row, chunk, hd, elem), src, n);
    }
}

/* s[i] += Q(row tile i of this warp, k-slice kk)·Kᵀ(64 keys) for its rt row tiles: two n8 tiles of keys per
 * ldmatrix.x4 (matrices: keys +0..7 dims lo, keys +0..7 dims hi, keys +8..15 dims lo, keys +8..15 dims hi), each
 * fragment used by every row tile. */
AF_DEVICE void af_mma_qk_slice(float s[][AF_MMA_BC / 8][4], const uint32_t qa[][4], const char *k_tile, int kk,
                               const int hd, const int rt, const int bf16) {
    const int lane = af_lane();
    AF_MMA_UNROLL
    for (int np = 0; np < AF_MMA_BC / 16; np++) {
        uint32_t kb[4];
        const int key = 16 * np + (lane & 7) + 8 * (lane >> 4), chunk = 2 * kk + ((lane >> 3) & 1);
        af_ldmatrix_x4(kb, k_tile + af_mma_swizzle(key, chunk, hd));
        AF_MMA_UNROLL
        for (int i = 0; i < rt; i++) {
            af_mma_op(s[i][2 * np], qa[i], kb, bf16);
            af_mma_op(s[i][2 * np + 1], qa[i], kb + 2, bf16);
        }
    }
}

/* The key range (causality, the window, keys past S) and the attention mask on `keys` scores (a multiple of 8, at
 * most AF_MMA_BC: a tile, or a part of the Hopper kernel's) in log2 units of this lane's rows g and g+8 of a row tile
 * (packed rows rt0 + g + 8·half): -inf, or additive terms (the mask in the inputs' dtype). The rows' key limits and
 * mask rows are found here, on the tiles that need them, to keep registers free in the main loop. */
AF_DEVICE void af_mma_apply_mask(float s[][4], const af_mma_params *p, int64_t b, int64_t hk, int64_t rt0,
                                 int64_t key0, const int bf16, const int tensor_mask, const int keys) {
    const int lane = af_lane(), g = lane >> 2, t = lane & 3;
    const af_sequence seq = af_mma_sequence(p, b), *sq = &seq;   /* read again: fewer registers live in the loop */
    AF_MMA_UNROLL
    for (int half = 0; half < 2; half++) {
        const int64_t r = rt0 + g + 8 * half;
        const int64_t h = hk * p->group + af_mma_div(r, sq->L), i = af_mma_mod(r, sq->L);   /* never varlen */
        int64_t lo = 0, hi = sq->S;
        const int live = r < p->group * sq->L;
        if (live) af_mma_key_range(p, sq, i, &lo, &hi);
        /* the row's key range within the tile, as small ints: 64-bit compares per score cost registers here, where
         * every accumulator is live */
        const int lo_t = (int)(lo <= key0 ? 0 : lo - key0 < keys ? lo - key0 : keys);
        const int hi_t = (int)(hi <= key0 ? 0 : hi - key0 < keys ? hi - key0 : keys);
        const char *mask_row = NULL;   /* at the tile's first key */
        if (tensor_mask && p->mask && live)
            mask_row = p->mask + (p->mask_kind == AF_MMA_MASK_BOOL ? 1 : 2) *
                                     (b * p->mask_stride[0] + h * p->mask_stride[1] + i * p->mask_stride[2] +
                                      key0 * p->mask_stride[3]);
        AF_MMA_UNROLL
        for (int n = 0; n < AF_MMA_BC / 8; n++) {   /* a constant trip count: s[n] stays in registers */
            if (8 * n >= keys) break;
            AF_MMA_UNROLL
            for (int c = 0; c < 2; c++) {
                const int key = 8 * n + 2 * t + c;
                float v = s[n][2 * half + c];
                if (key < lo_t || key >= hi_t) {
                    v = -INFINITY;
                } else if (mask_row) {
                    const int64_t at = key * p->mask_stride[3];
                    if (p->mask_kind == AF_MMA_MASK_BOOL) {
                        if (!((const unsigned char *)mask_row)[at]) v = -INFINITY;
                    } else {
                        const uint16_t bits = ((const uint16_t *)mask_row)[at];
                        v += (bf16 ? af_bf16_to_float(bits) : af_f16_to_float(bits)) * AF_MMA_LOG2E;
                    }
                }
                s[n][2 * half + c] = v;
            }
        }
    }
}

/* Online softmax over one tile of `keys` keys (a multiple of 8) for this lane's two rows (g and g+8), O left to the
 * caller: the row max over the quad, the lazy rescale of l (only when the max grows by more than the threshold: O/l
 * is the same for any reference point m, and weights stay <= 2^threshold) with the factor O must take in
 * correction[half] (1: none), then s <- 2^(s - m) and the lane's part of l. The max is the whole tile's before any
 * weight: every P·V of the tile's keys comes after. A row that has seen only -inf keeps m = -inf and gets weights
 * 2^(-inf - 0) = 0. */
AF_DEVICE void af_mma_softmax_weights(float s[][4], float m[2], float l[2], float correction[2], const int keys) {
    AF_MMA_UNROLL
    for (int half = 0; half < 2; half++) {
        float mx = -INFINITY;
        AF_MMA_UNROLL
        for (int n = 0; n < keys / 8; n++) mx = fmaxf(mx, fmaxf(s[n][2 * half], s[n][2 * half + 1]));
        mx = fmaxf(mx, af_shfl_xor(mx, 1));
        mx = fmaxf(mx, af_shfl_xor(mx, 2));
        correction[half] = 1.0f;
        if (mx > m[half] + AF_MMA_RESCALE_THRESHOLD) {   /* also the first finite max: 2^(-inf) = 0 clears nothing */
            correction[half] = af_ex2(m[half] - mx);
            m[half] = mx;
            l[half] *= correction[half];
        }
        const float base = m[half] == -INFINITY ? 0.0f : m[half];
        float sum = 0.0f;
        AF_MMA_UNROLL
        for (int n = 0; n < keys / 8; n++) {
            s[n][2 * half] = af_ex2(s[n][2 * half] - base);
            s[n][2 * half + 1] = af_ex2(s[n][2 * half + 1] - base);
            sum += s[n][2 * half] + s[n][2 * half + 1];
        }
        l[half] += sum;
    }
}

/* O's rows g and g+8 times af_mma_softmax_weights' correction (its columns below Ev: the rest stay 0). */
AF_DEVICE void af_mma_rescale(float o[][4], const float correction[2], const int hd, const int Ev) {
    AF_MMA_UNROLL
    for (int half = 0; half < 2; half++) {
        if (correction[half] == 1.0f) continue;
        AF_MMA_UNROLL
        for (int d = 0; d < hd / 8; d++) {
            if (8 * d >= Ev) continue;
            o[d][2 * half] *= correction[half];
            o[d][2 * half + 1] *= correction[half];
        }
    }
}

/* Both, for a tile whose P·V comes after: the mma.sync kernel's softmax over its 64 keys. */
AF_DEVICE void af_mma_softmax(float s[][4], float o[][4], float m[2], float l[2], const int hd, const int Ev) {
    float correction[2];
    af_mma_softmax_weights(s, m, l, correction, AF_MMA_BC);
    af_mma_rescale(o, correction, hd, Ev);
}

/* o[i] += P·V for the rt row tiles: P's A fragment for keys 16ks..16ks+15 is the S accumulators of n8 tiles 2ks
 * and 2ks+1, packed in place; V's B fragments by ldmatrix.trans, two n8 tiles of value columns each (matrices:
 * keys +0..7 cols lo, keys +8..15 cols lo, keys +0..7 cols hi, keys +8..15 cols hi), each used by every row tile. */
AF_DEVICE void af_mma_pv(float o[][AF_MMA_HD_MAX / 8][4], float s[][AF_MMA_BC / 8][4], const char *v_tile,
                         const int hd, const int Ev, const int rt, const int bf16) {
    const int lane = af_lane();
    AF_MMA_UNROLL
    for (int ks = 0; ks < AF_MMA_BC / 16; ks++) {
        uint32_t pa[AF_MMA_RT_MAX][4];
        AF_MMA_UNROLL
        for (int i = 0; i < rt; i++) {
            pa[i][0] = af_mma_pack(s[i][2 * ks][0], s[i][2 * ks][1], bf16);
            pa[i][1] = af_mma_pack(s[i][2 * ks][2], s[i][2 * ks][3], bf16);
            pa[i][2] = af_mma_pack(s[i][2 * ks + 1][0], s[i][2 * ks + 1][1], bf16);
            pa[i][3] = af_mma_pack(s[i][2 * ks + 1][2], s[i][2 * ks + 1][3], bf16);
        }
        AF_MMA_UNROLL
        for (int dp = 0; dp < hd / 16; dp++) {
            if (16 * dp >= Ev) continue;   /* zero columns of the padded head dim */
            uint32_t vb[4];
            af_ldmatrix_x4_trans(vb, v_tile + af_mma_swizzle(16 * ks + (lane & 7) + 8 * ((lane >> 3) & 1),
                                                            2 * dp + (lane >> 4), hd));
            AF_MMA_UNROLL
            for (int i = 0; i < rt; i++) {
                af_mma_op(o[i][2 * dp], pa[i], vb, bf16);
                af_mma_op(o[i][2 * dp + 1], pa[i], vb + 2, bf16);
            }
        }
    }
}

/* One 16-bit output pair (columns col, col+1 of a row) with out's strides: a 32-bit store when allowed. */
AF_DEVICE void af_mma_store_pair(const af_mma_params *p, char *row, int col, float v0, float v1, const int bf16) {
    if (p->out_pairs && col + 1 < p->Ev) {
        *(uint32_t *)(row + 2 * col) = af_mma_pack(v0, v1, bf16);
        return;
    }
    const int64_t step = 2 * p->out_stride[3];
    uint16_t *e0 = (uint16_t *)(row + col * step);
    *e0 = bf16 ? af_float_to_bf16(v0) : af_float_to_f16(v0);
    if (col + 1 < p->Ev) {
        uint16_t *e1 = (uint16_t *)(row + (col + 1) * step);
        *e1 = bf16 ? af_float_to_bf16(v1) : af_float_to_f16(v1);
    }
}

/* The learned sink of head h joined to a row's running max m and sum l (log2 units, O scaled along): one more
 * logit in the softmax's denominator (FA4). A row that saw no key gets l = 1 at m = the sink (out 0, lse = sink). */
AF_DEVICE void af_mma_join_sink(const af_mma_params *p, int64_t h, float o[][4], float *m, float *l, int half,
                                const int hd) {
    const float sink = af_load_scalar(p->sink, (af_dtype)p->sink_dtype, h * p->sink_stride) * AF_MMA_LOG2E;
    const float m_new = fmaxf(*m, sink);   /* a NaN sink leaves m: l carries the NaN */
    if (m_new != -INFINITY) {
        const float alpha = m_new == *m ? 1.0f : af_ex2(*m - m_new);
        *l = *l * alpha + (sink == -INFINITY ? 0.0f : af_ex2(sink - m_new));
        AF_MMA_UNROLL
        for (int d = 0; d < hd / 8; d++) {
            o[d][2 * half] *= alpha;
            o[d][2 * half + 1] *= alpha;
        }
        *m = m_new;
    }
    if (sink != sink) *l = sink;
}

/* O / l and the LSE of this lane's two rows of a row tile (packed rows rt0 + g + 8·half): to out/lse, or to split
 * `split`'s partials. */
AF_DEVICE void af_mma_epilogue(const af_mma_params *p, float o[][4], float m[2], float l[2], int64_t b,
                               int64_t hk, int64_t rt0, float v_scale, int64_t split, const int hd, const int bf16) {
    const int lane = af_lane(), g = lane >> 2, t = lane & 3;
    const af_sequence seq = af_mma_sequence(p, b), *sq = &seq;
    AF_MMA_UNROLL
    for (int half = 0; half < 2; half++) {
        l[half] += af_shfl_xor(l[half], 1);
        l[half] += af_shfl_xor(l[half], 2);
    }
    AF_MMA_UNROLL
    for (int half = 0; half < 2; half++) {
        const int64_t r = rt0 + g + 8 * half;
        if (r >= p->group * sq->L) continue;
        const int64_t h = hk * p->group + af_mma_div(r, sq->L), i = sq->q0 + af_mma_mod(r, sq->L);
        if (p->sink && !p->part_o) af_mma_join_sink(p, h, o, &m[half], &l[half], half, hd);   /* split: the combine's */
        const int seen = l[half] > 0.0f || l[half] != l[half];   /* a row that saw no key: out = 0, lse = -inf */
        const float inv = seen ? v_scale / l[half] : 0.0f;   /* v_scale: float8's v_descale, else 1 */
        const float base = m[half] == -INFINITY ? 0.0f : m[half];
        const float lse = seen ? base * AF_MMA_LN2 + logf(l[half]) : -INFINITY;
        if (p->part_o) {
            const int64_t at = split * p->total_rows + (b * p->Hkv + hk) * p->rows + r;
            float *dst = p->part_o + at * p->Ev;
            AF_MMA_UNROLL
            for (int d = 0; d < hd / 8; d++) {
                const int col = 8 * d + 2 * t;
                if (col < p->Ev) dst[col] = o[d][2 * half] * inv;
                if (col + 1 < p->Ev) dst[col + 1] = o[d][2 * half + 1] * inv;
            }
            if (t == 0) p->part_lse[at] = lse;
            continue;
        }
        char *row = p->out + 2 * (b * p->out_stride[0] + h * p->out_stride[1] + i * p->out_stride[2]);
        AF_MMA_UNROLL
        for (int d = 0; d < hd / 8; d++) {
            const int col = 8 * d + 2 * t;
            if (col < p->Ev) af_mma_store_pair(p, row, col, o[d][2 * half] * inv, o[d][2 * half + 1] * inv, bf16);
        }
        if (p->lse && t == 0) p->lse[b * p->lse_stride[0] + h * p->lse_stride[1] + i * p->lse_stride[2]] = lse;
    }
}

/* The whole CTA: hd (64, 128, 256), bf16, f8 (float8 K/V) and rt (row tiles a warp) are constants here (see
 * AF_MMA_KERNEL). */
AF_DEVICE void af_mma_body(const af_mma_params p, const int hd, const int bf16, const int f8, const int rt) {
    const int q_in_regs = rt * hd <= AF_MMA_Q_REG_COLS, block_rows = AF_MMA_BLOCK_ROWS(rt);
    const int lane = af_lane(), warp = af_warp();
    const int64_t bhk = af_mma_div(AF_BLOCK_IDX_X, p.row_blocks) * AF_GRID_DIM_Y + AF_BLOCK_IDX_Y;
    if (bhk >= p.heads) return;   /* the fold of B·Hkv into grid x has a ragged end */
    const int64_t b = af_mma_div(bhk, p.Hkv), hk = af_mma_mod(bhk, p.Hkv);
    const int64_t r0 = af_mma_mod(AF_BLOCK_IDX_X, p.row_blocks) * block_rows;
    af_sequence sq;   /* varlen: the grid covers the longest sequence's rows; a SKIP sequence has none */
    int bad = af_mma_sequence_checked(&p, b, &sq) != AF_SEQ_OK;
    const int64_t rows = p.group * sq.L;
    if (r0 >= rows) return;   /* past this sequence's rows: nothing to compute or store (the combine skips them) */
    const int64_t warp_r0 = r0 + AF_MMA_TILE_ROWS * rt * warp;   /* this warp's first packed row */
    const int warp_live = warp_r0 < rows;

    int64_t lo_min, hi_min, lo_max, hi_max;
    af_mma_block_keys(&p, &sq, r0, block_rows, &lo_min, &hi_min, &lo_max, &hi_max);
    const int64_t tiles = (hi_max + AF_MMA_BC - 1) / AF_MMA_BC, t_first = lo_min / AF_MMA_BC;
    int64_t t_begin = (int64_t)AF_BLOCK_IDX_Z * p.tiles_per_split;
    int64_t t_end = t_begin + p.tiles_per_split < tiles ? t_begin + p.tiles_per_split : tiles;
    if (t_begin < t_first) t_begin = t_first;   /* tiles before the window: never loaded (a split may be empty) */
    if (!bad && p.page_table)   /* the pages this CTA reads, checked before any is */
        bad = !af_mma_pages_valid(&p, b, t_begin * AF_MMA_BC, t_end * AF_MMA_BC < sq.S ? t_end * AF_MMA_BC : sq.S);
    if (bad) t_end = t_begin;   /* no key read; l = NaN below makes its rows (or its partials) NaN */

    char *smem_q = af_shared_memory();
    const int tile_bytes = AF_MMA_BC * hd * 2;
    char *smem_k = smem_q + block_rows * hd * 2;
    char *smem_v = smem_k + (p.double_buffer ? 2 : 1) * tile_bytes;
    /* float8 (always double-buffered): stage s of K / V at the second tile's bytes + s·stage_bytes */
    const int stage_bytes = AF_MMA_BC * hd, kv_elem = f8 ? 1 : 2;
    char *stage_k = smem_k + tile_bytes, *stage_v = smem_v + tile_bytes;
    /* float8: the (batch, kv head)'s q_descale·k_descale joins the score scales once, v_descale the output */
    float scale_log2 = p.scale_log2, scale_over_cap = p.scale_over_cap, v_descale = 1.0f;
    if (f8) {
        const float qk_descale = af_descale_at(p.q_descale, p.q_descale_stride, b, hk) *
                                 af_descale_at(p.k_descale, p.k_descale_stride, b, hk);
        scale_log2 *= qk_descale;
        scale_over_cap *= qk_descale;
        v_descale = af_descale_at(p.v_descale, p.v_descale_stride, b, hk);
    }

    float o[AF_MMA_RT_MAX][AF_MMA_HD_MAX / 8][4];
    float m[AF_MMA_RT_MAX][2], l[AF_MMA_RT_MAX][2];
    AF_MMA_UNROLL
    for (int i = 0; i < rt; i++) {
        AF_MMA_UNROLL
        for (int d = 0; d < hd / 8; d++) o[i][d][0] = o[i][d][1] = o[i][d][2] = o[i][d][3] = 0.0f;
        m[i][0] = m[i][1] = -INFINITY;
        l[i][0] = l[i][1] = bad ? NAN : 0.0f;
    }
    /* Q's fragments when they stay in registers: [row tile][k slice], up to rt·hd = AF_MMA_Q_REG_COLS */
    uint32_t qf[AF_MMA_RT_MAX][AF_MMA_Q_REG_COLS / 16][4];

    const int q_f8 = f8 && p.q_float8;   /* Q staged in K's second stage, free until the loop's first copy */
    if (t_begin < t_end) {   /* Q, then the first tile: two groups */
        if (q_f8) af_mma_load_q(stage_k + stage_bytes, &p, b, hk, &sq, r0, block_rows, hd, 1);
        else af_mma_load_q(smem_q, &p, b, hk, &sq, r0, block_rows, hd, 2);
        af_cp_async_commit();
        af_mma_load_tile(f8 ? stage_k : smem_k, &p, p.k, p.k_stride, b, hk, &sq, t_begin * AF_MMA_BC, p.E, hd, kv_elem);
        af_mma_load_tile(f8 ? stage_v : smem_v, &p, p.v, p.v_stride, b, hk, &sq, t_begin * AF_MMA_BC, p.Ev, hd,
                         kv_elem);
        af_cp_async_commit();
        if (q_in_regs || q_f8) {   /* Q's fragments (or its conversion), while the first tile is in flight */
            af_cp_async_wait_1();
            af_syncthreads();
            if (q_f8) {
                af_mma_convert_tile(smem_q, stage_k + stage_bytes, p.q_float8, hd, bf16);
                af_syncthreads();   /* before the fragments are read, and before the loop refills that stage */
            }
            AF_MMA_UNROLL
            for (int i = 0; i < rt; i++)
                AF_MMA_UNROLL
                for (int kk = 0; kk < AF_MMA_Q_REG_COLS / 16; kk++)
                    if (q_in_regs && warp_live && kk < hd / 16 && 16 * kk < p.E)
                        af_ldmatrix_x4(qf[i][kk], smem_q + af_mma_swizzle(warp_r0 - r0 + 16 * i + (lane & 15),
                                                                          2 * kk + (lane >> 4), hd));
        }
    }
    for (int64_t tile = t_begin; tile < t_end; tile++) {
        const int64_t key0 = tile * AF_MMA_BC;
        const int next = p.double_buffer ? (int)((tile - t_begin) & 1) : 0;   /* t_begin: the first tile loaded */
        const int buf = f8 ? 0 : next;   /* float8: `next` alternates the stages, the products read tile 0 */
        if (p.double_buffer) {   /* the next tile streams in while this one is computed */
            if (tile + 1 < t_end) {   /* float8: into the other stage; else the other 16-bit tile */
                const int step = f8 ? stage_bytes : tile_bytes;
                af_mma_load_tile((f8 ? stage_k : smem_k) + (next ^ 1) * step, &p, p.k, p.k_stride, b, hk, &sq,
                                 key0 + AF_MMA_BC, p.E, hd, kv_elem);
                af_mma_load_tile((f8 ? stage_v : smem_v) + (next ^ 1) * step, &p, p.v, p.v_stride, b, hk, &sq,
                                 key0 + AF_MMA_BC, p.Ev, hd, kv_elem);
            }
            af_cp_async_commit();
            af_cp_async_wait_1();
        } else {
            af_cp_async_wait_0();
        }
        af_syncthreads();   /* every thread's copies of this tile (and Q) are visible */
        if (f8) {   /* this tile's stage into the 16-bit tiles: the last tile's products are done (loop's end) */
            af_mma_convert_tile(smem_k, stage_k + next * stage_bytes, p.kv_dtype, hd, bf16);
            af_mma_convert_tile(smem_v, stage_v + next * stage_bytes, p.kv_dtype, hd, bf16);
            af_syncthreads();
        }
        if (warp_live) {   /* a warp whose rows are all past the packed rows (decode) only helps load */
            const char *k_tile = smem_k + buf * tile_bytes, *v_tile = smem_v + buf * tile_bytes;
            float s[AF_MMA_RT_MAX][AF_MMA_BC / 8][4];
            AF_MMA_UNROLL
            for (int i = 0; i < rt; i++)
                AF_MMA_UNROLL
                for (int n = 0; n < AF_MMA_BC / 8; n++) s[i][n][0] = s[i][n][1] = s[i][n][2] = s[i][n][3] = 0.0f;
            AF_MMA_UNROLL
            for (int kk = 0; kk < hd / 16; kk++) {
                if (16 * kk >= p.E) continue;   /* zero columns of the padded head dim */
                uint32_t qa[AF_MMA_RT_MAX][4];
                AF_MMA_UNROLL
                for (int i = 0; i < rt; i++) {
                    if (q_in_regs) {
                        AF_MMA_UNROLL
                        for (int c = 0; c < 4; c++) qa[i][c] = qf[i][kk < AF_MMA_Q_REG_COLS / 16 ? kk : 0][c];
                    } else {
                        af_ldmatrix_x4(qa[i], smem_q + af_mma_swizzle(warp_r0 - r0 + 16 * i + (lane & 15),
                                                                      2 * kk + (lane >> 4), hd));
                    }
                }
                af_mma_qk_slice(s, qa, k_tile, kk, hd, rt, bf16);
            }
            AF_MMA_UNROLL
            for (int i = 0; i < rt; i++) {
                AF_MMA_UNROLL
                for (int n = 0; n < AF_MMA_BC / 8; n++)
                    AF_MMA_UNROLL
                    for (int c = 0; c < 4; c++)
                        s[i][n][c] = p.softcap_on ? p.softcap_log2 * tanhf(s[i][n][c] * scale_over_cap)
                                                  : s[i][n][c] * scale_log2;
                if (p.mask || key0 + AF_MMA_BC > hi_min || key0 < lo_max)
                    af_mma_apply_mask(s[i], &p, b, hk, warp_r0 + 16 * i, key0, bf16, rt == 1, AF_MMA_BC);
                af_mma_softmax(s[i], o[i], m[i], l[i], hd, p.Ev);
            }
            af_mma_pv(o, s, v_tile, hd, p.Ev, rt, bf16);
        }
        af_syncthreads();   /* every warp is done with this buffer before it is refilled */
        if (!p.double_buffer && tile + 1 < t_end) {
            af_mma_load_tile(smem_k, &p, p.k, p.k_stride, b, hk, &sq, key0 + AF_MMA_BC, p.E, hd, 2);
            af_mma_load_tile(smem_v, &p, p.v, p.v_stride, b, hk, &sq, key0 + AF_MMA_BC, p.Ev, hd, 2);
            af_cp_async_commit();
        }
    }
    AF_MMA_UNROLL
    for (int i = 0; i < rt; i++)
        af_mma_epilogue(&p, o[i], m[i], l[i], b, hk, warp_r0 + 16 * i, v_descale, AF_BLOCK_IDX_Z, hd, bf16);
}

/* One kernel per (head dim, dtype, float8 K/V or not, row tiles a warp): 32 rows a warp where the registers allow
 * (16-bit head dims 64 and 128), and a 16-row twin of those for few rows (decode: 64-row blocks). */
#define AF_MMA_KERNEL(name, hd, bf16, f8, rt) \
    AF_KERNEL(name, af_mma_params, p, AF_MMA_THREADS) { af_mma_body(p, hd, bf16, f8, rt); }
AF_MMA_KERNEL(af_mma_f16_hd64, 64, 0, 0, 2)
AF_MMA_KERNEL(af_mma_f16_hd128, 128, 0, 0, 2)
AF_MMA_KERNEL(af_mma_f16_hd256, 256, 0, 0, 1)
AF_MMA_KERNEL(af_mma_bf16_hd64, 64, 1, 0, 2)
AF_MMA_KERNEL(af_mma_bf16_hd128, 128, 1, 0, 2)
AF_MMA_KERNEL(af_mma_bf16_hd256, 256, 1, 0, 1)
AF_MMA_KERNEL(af_mma_f16_hd64_w16, 64, 0, 0, 1)
AF_MMA_KERNEL(af_mma_f16_hd128_w16, 128, 0, 0, 1)
AF_MMA_KERNEL(af_mma_bf16_hd64_w16, 64, 1, 0, 1)
AF_MMA_KERNEL(af_mma_bf16_hd128_w16, 128, 1, 0, 1)
AF_MMA_KERNEL(af_mma_f16_f8_hd64, 64, 0, 1, 1)
AF_MMA_KERNEL(af_mma_f16_f8_hd128, 128, 0, 1, 1)
AF_MMA_KERNEL(af_mma_f16_f8_hd256, 256, 0, 1, 1)
AF_MMA_KERNEL(af_mma_bf16_f8_hd64, 64, 1, 1, 1)
AF_MMA_KERNEL(af_mma_bf16_f8_hd128, 128, 1, 1, 1)
AF_MMA_KERNEL(af_mma_bf16_f8_hd256, 256, 1, 1, 1)

#endif
