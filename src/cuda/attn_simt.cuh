/* af_cuda_simt_forward: attention on the CUDA cores, for every problem af_sdpa_check accepts (f32 above all, and
 * whatever the tensor-core path does not take). Correct first, reasonably fast:
 *   - a block of AF_SIMT_WARPS warps, one query row each: rows (head of the GQA group, query index) of one
 *     (batch, kv head), so every K/V tile staged in shared memory serves all of them;
 *   - keys in tiles of 32: lane j scores key j (q row broadcast from shared memory, K staged in column chunks);
 *   - online softmax in log2 units (af_ex2), max and sum over the tile by af_shfl_xor butterflies;
 *   - lanes split the value columns (column lane + 32·c), f32 accumulators in registers, V staged in chunks;
 *   - key tiles outside the block's rows' key ranges (causality, a sliding window) are never loaded;
 *   - af_flash_attn's softcap on the scaled score, and its learned sink joined to the row's max and sum at the end;
 *   - af_flash_attn's sequences: varlen rows and keys found through cu_seqlens (blocks past a sequence's rows do
 *     nothing), seqused_k, paged K/V rows through the page table (problem.h's helpers, on the device);
 *   - af_flash_attn's float8: K/V (or q/k/v) converted as staged, the (batch, kv head)'s q/k descales on the dot
 *     product and its v descale on the output, as the CPU path.
 * Matches src/sdpa/reference.c: masked keys contribute nothing (even against Inf/NaN values), a NaN score makes the
 * row NaN, a row that sees no key gets out = 0 and lse = -inf (the sink's logit when there is one). */
#ifndef AF_CUDA_ATTN_SIMT_CUH
#define AF_CUDA_ATTN_SIMT_CUH
#include <math.h>
#include <stdint.h>

#include "cuda/kernels.h"
#include "cuda/scalar.cuh"

#define AF_SIMT_WARPS 4                            /* query rows per block */
#define AF_SIMT_THREADS (AF_SIMT_WARPS * 32)
#define AF_SIMT_KEYS 32                            /* keys per tile: one per lane */
#define AF_SIMT_K_CHUNK 64                         /* head-dim columns of a K tile staged at a time */
#define AF_SIMT_K_PITCH (AF_SIMT_K_CHUNK + 1)      /* lane j reads row j: an odd pitch keeps the banks apart */
#define AF_SIMT_V_CHUNK 128                        /* value columns staged at a time: 4 per lane */
#define AF_SIMT_LOG2E 1.4426950408889634
#define AF_SIMT_LN2 0.6931471805599453f
#ifndef AF_SIMT_MAX_BLOCKS   /* the tests lower it to run the grid-stride loop */
#define AF_SIMT_MAX_BLOCKS 0x7fffffffLL            /* CUDA's grid x limit; blocks stride over what is left */
#endif

#if defined(__CUDACC__)
#define AF_SIMT_UNROLL _Pragma("unroll")           /* keeps the accumulators in registers */
#else
#define AF_SIMT_UNROLL
#endif

typedef struct {
    af_problem p;
    float scale_log2;       /* scale·log2(e): scores in log2 units for ex2 */
    float scale, softcap;   /* softcap > 0: s <- softcap·tanh(scale·q·k / softcap), then ·log2(e) */
    int64_t row_blocks;     /* blocks per (batch, kv head): ceil(group·L / AF_SIMT_WARPS) */
    int64_t blocks;         /* B·Hkv·row_blocks */
} af_simt_params;

/* Shared memory: q rows (f32, one per warp), a K chunk, a V chunk, each warp's 32 weights. */
static inline size_t af_simt_smem_bytes(int64_t E) {
    return sizeof(float) * (size_t)(AF_SIMT_WARPS * E + AF_SIMT_KEYS * AF_SIMT_K_PITCH +
                                    AF_SIMT_KEYS * AF_SIMT_V_CHUNK + AF_SIMT_WARPS * AF_SIMT_KEYS);
}

/* The keys [*lo, *hi) query row i of sequence `s` may see. */
AF_DEVICE void af_simt_key_range(const af_problem *p, const af_sequence *s, int64_t i, int64_t *lo, int64_t *hi) {
    af_key_range(p, s->L, s->S, i, lo, hi);
}

/* Lane j's score of key key0 + j in log2 units: scale·q·k (softcapped), then the key range / mask as -inf or
 * additive terms. */
AF_DEVICE float af_simt_score(const af_simt_params *prm, float dot, int64_t key, int64_t lo, int64_t hi,
                              int64_t mask_row) {
    const af_problem *p = &prm->p;
    if (key < lo || key >= hi) return -INFINITY;
    float s = prm->softcap > 0.0f ? prm->softcap * tanhf(dot * prm->scale / prm->softcap) * (float)AF_SIMT_LOG2E
                                  : dot * prm->scale_log2;
    if (p->mask) {
        const int64_t m = mask_row + key * p->mask_stride[3];
        if (p->mask_dtype == AF_BOOL) s = ((const unsigned char *)p->mask)[m] ? s : -INFINITY;
        else s += af_load_scalar(p->mask, p->mask_dtype, m) * (float)AF_SIMT_LOG2E;
    }
    return s;
}

/* q·k of key0 + lane, for this warp's row: K staged chunk by chunk (every warp of the block takes part in the
 * staging and its barriers, live or not). */
AF_DEVICE float af_simt_dot(const af_simt_params *prm, float *q_smem, float *k_smem, int64_t b, int64_t hk,
                            const af_sequence *seq, int64_t key0, int64_t keys, int live) {
    const af_problem *p = &prm->p;
    const int lane = af_lane();
    float dot = 0.0f;
    for (int64_t e0 = 0; e0 < p->E; e0 += AF_SIMT_K_CHUNK) {
        af_syncthreads();   /* every warp is done with the previous chunk (and the q rows are stored) */
        for (int t = AF_THREAD_IDX; t < AF_SIMT_KEYS * AF_SIMT_K_CHUNK; t += AF_SIMT_THREADS) {
            const int64_t j = key0 + t / AF_SIMT_K_CHUNK, e = e0 + t % AF_SIMT_K_CHUNK;
            k_smem[t / AF_SIMT_K_CHUNK * AF_SIMT_K_PITCH + t % AF_SIMT_K_CHUNK] =
                j < keys && e < p->E
                    ? af_load_scalar(p->k, p->kv_dtype, af_kv_row_offset(p, p->k_stride, b, hk, seq, j) + e * p->k_stride[3])
                    : 0.0f;
        }
        af_syncthreads();
        if (!live) continue;
        const int n = p->E - e0 < AF_SIMT_K_CHUNK ? (int)(p->E - e0) : AF_SIMT_K_CHUNK;
        const float *k_row = k_smem + lane * AF_SIMT_K_PITCH, *q_row = q_smem + e0;
        float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;   /* four chains: shorter sums, more in flight */
        int e = 0;
        for (; e + 4 <= n; e += 4) {
            d0 += q_row[e] * k_row[e];
            d1 += q_row[e + 1] * k_row[e + 1];
            d2 += q_row[e + 2] * k_row[e + 2];
            d3 += q_row[e + 3] * k_row[e + 3];
        }
        for (; e < n; e++) d0 += q_row[e] * k_row[e];
        dot += (d0 + d1) + (d2 + d3);
    }
    return dot;
}

/* One block's rows: `slots` accumulators per lane cover value columns lane + 32·c, c < slots (slots·32 >= Ev,
 * a multiple of 4, a constant after inlining so acc[] stays in registers). */
AF_DEVICE void af_simt_block(const af_simt_params prm, int64_t block, const int slots) {
    const af_problem *p = &prm.p;
    float *q_smem = (float *)af_shared_memory();
    float *k_smem = q_smem + AF_SIMT_WARPS * p->E;
    float *v_smem = k_smem + AF_SIMT_KEYS * AF_SIMT_K_PITCH;
    float *p_smem = v_smem + AF_SIMT_KEYS * AF_SIMT_V_CHUNK;
    const int lane = af_lane(), warp = af_warp();
    const int64_t first_row = block % prm.row_blocks * AF_SIMT_WARPS, bh = block / prm.row_blocks;
    const int64_t hk = bh % p->Hkv, b = bh / p->Hkv, row = first_row + warp;
    af_sequence seq;   /* varlen: blocks past its rows have nothing to do; entries checked before use */
    int bad = af_sequence_checked(p->cu_seqlens_q, p->cu_seqlens_q_stride, p->cu_seqlens_k, p->cu_seqlens_k_stride,
                                  p->seqused_k, p->seqused_k_stride, p->L, p->S, p->total_q, p->total_k, b,
                                  &seq) != AF_SEQ_OK;
    const int64_t rows = p->group * seq.L;   /* per (batch, kv head): row r is head hk·group + r / L, query r % L */
    const int active = row < rows;
    const int64_t h = hk * p->group + (active ? row / seq.L : 0), i = active ? row % seq.L : 0;
    int64_t lo = 0, hi = 0;   /* this row's keys */
    if (active) af_simt_key_range(p, &seq, i, &lo, &hi);
    int64_t first = seq.S, keys = 0;   /* keys [first, keys) hold every key a row of the block sees: the tiles */
    for (int w = 0; w < AF_SIMT_WARPS && first_row + w < rows; w++) {
        int64_t w_lo, w_hi;
        af_simt_key_range(p, &seq, (first_row + w) % seq.L, &w_lo, &w_hi);
        if (w_hi == w_lo) continue;
        if (w_lo < first) first = w_lo;
        if (w_hi > keys) keys = w_hi;
    }
    if (!bad && p->page_table) {   /* the pages of the block's keys, before any is read: every warp gets one answer */
        float page_bad = af_pages_valid(p->page_table, p->page_table_stride, p->page_size, p->num_pages, b, first,
                                        keys, lane, 32) ? 0.0f : 1.0f;
        for (int o = 16; o > 0; o >>= 1) page_bad = fmaxf(page_bad, af_shfl_xor(page_bad, o));
        bad = page_bad != 0.0f;
    }
    if (bad) keys = 0;   /* no key read; l = NaN below makes its rows NaN */

    /* No barrier before these stores: a warp's q row is read by that warp alone, whose lanes all passed the
     * previous block's shuffles after their last read (the scores depend on it); p_smem is next written after
     * the K barriers. */
    float *q_own = q_smem + warp * p->E;
    const int64_t q_row = b * p->q_stride[0] + h * p->q_stride[1] + (seq.q0 + i) * p->q_stride[2];
    for (int64_t e = lane; e < p->E; e += 32)
        q_own[e] = active ? af_load_scalar(p->q, p->dtype, q_row + e * p->q_stride[3]) : 0.0f;

    const int64_t mask_row = b * p->mask_stride[0] + h * p->mask_stride[1] + i * p->mask_stride[2];
    /* float8: the dot product in the scale's units (q_descale·k_descale), the output times v_descale */
    const float qk_descale = af_descale_at(p->q_descale, p->q_descale_stride, b, hk) *
                             af_descale_at(p->k_descale, p->k_descale_stride, b, hk);
    float acc[32];
    AF_SIMT_UNROLL
    for (int c = 0; c < slots; c++) acc[c] = 0.0f;
    float m = -INFINITY, l = bad ? NAN : 0.0f;   /* running max (log2 units) and sum of weights; equal on every lane */

    for (int64_t key0 = first / AF_SIMT_KEYS * AF_SIMT_KEYS; key0 < keys; key0 += AF_SIMT_KEYS) {
        const int live = key0 < hi && key0 + AF_SIMT_KEYS > lo && hi > lo;   /* this row sees a key of the tile */
        const float dot = af_simt_dot(&prm, q_own, k_smem, b, hk, &seq, key0, keys, live);
        if (live) {
            const float s = af_simt_score(&prm, dot * qk_descale, key0 + lane, lo, hi, mask_row);
            float tile_max = s, tile_sum;
            for (int o = 16; o > 0; o >>= 1) tile_max = fmaxf(tile_max, af_shfl_xor(tile_max, o));   /* NaN-free */
            const float m_new = fmaxf(m, tile_max);
            const float alpha = m_new == m ? 1.0f : af_ex2(m - m_new);
            const float weight = s == -INFINITY ? 0.0f : af_ex2(s - m_new);   /* NaN stays NaN */
            p_smem[warp * AF_SIMT_KEYS + lane] = weight;
            tile_sum = weight;
            for (int o = 16; o > 0; o >>= 1) tile_sum += af_shfl_xor(tile_sum, o);
            l = l * alpha + tile_sum;
            m = m_new;
            if (alpha != 1.0f) {
                AF_SIMT_UNROLL
                for (int c = 0; c < slots; c++) acc[c] *= alpha;
            }
        }
        for (int64_t c0 = 0; c0 < p->Ev; c0 += AF_SIMT_V_CHUNK) {
            af_syncthreads();   /* the previous V chunk is consumed; this tile's weights are stored */
            for (int t = AF_THREAD_IDX; t < AF_SIMT_KEYS * AF_SIMT_V_CHUNK; t += AF_SIMT_THREADS) {
                const int64_t j = key0 + t / AF_SIMT_V_CHUNK, col = c0 + t % AF_SIMT_V_CHUNK;
                v_smem[t] = j < keys && col < p->Ev
                                ? af_load_scalar(p->v, p->kv_dtype, af_kv_row_offset(p, p->v_stride, b, hk, &seq, j) +
                                                                     col * p->v_stride[3])
                                : 0.0f;
            }
            af_syncthreads();
            if (!live) continue;
            const int chunk = (int)(c0 / AF_SIMT_V_CHUNK);
            AF_SIMT_UNROLL
            for (int cc = 0; cc < slots / 4; cc++) {   /* constant indices into acc[]: chunk cc holds acc[4cc..4cc+3] */
                if (cc != chunk) continue;
                for (int j = 0; j < AF_SIMT_KEYS; j++) {
                    const float w = p_smem[warp * AF_SIMT_KEYS + j];
                    if (w == 0.0f) continue;   /* a masked key adds nothing, even an Inf/NaN value */
                    const float *v_row = v_smem + j * AF_SIMT_V_CHUNK + lane;
                    AF_SIMT_UNROLL
                    for (int c = 0; c < 4; c++) acc[cc * 4 + c] += w * v_row[c * 32];
                }
            }
        }
    }
    if (!active) return;
    if (p->sink) {   /* FA4's learned sink: one more logit in the max and the sum, none in the values */
        const float sink = af_load_scalar(p->sink, p->sink_dtype, h * p->sink_stride) * (float)AF_SIMT_LOG2E;
        const float m_new = fmaxf(m, sink);   /* fmaxf ignores a NaN sink: the sum below carries it */
        const float alpha = m_new == m ? 1.0f : af_ex2(m - m_new);
        if (m_new != -INFINITY) {
            l = l * alpha + (sink == -INFINITY ? 0.0f : af_ex2(sink - m_new));
            AF_SIMT_UNROLL
            for (int c = 0; c < slots; c++) acc[c] *= alpha;
            m = m_new;
        }
        if (sink != sink) l = sink;
    }
    const int seen = l > 0.0f || l != l;   /* a row that saw no key (nor a sink): out = 0, lse = -inf */
    const float inv = seen ? af_descale_at(p->v_descale, p->v_descale_stride, b, hk) / l : 0.0f;
    const int64_t out_row = b * p->out_stride[0] + h * p->out_stride[1] + (seq.q0 + i) * p->out_stride[2];
    AF_SIMT_UNROLL
    for (int c = 0; c < slots; c++) {
        const int64_t col = lane + 32 * c;
        if (col < p->Ev) af_store_scalar(p->out, p->out_dtype, out_row + col * p->out_stride[3], acc[c] * inv);
    }
    if (p->lse && lane == 0)
        p->lse[b * p->lse_stride[0] + h * p->lse_stride[1] + (seq.q0 + i) * p->lse_stride[2]] =
            seen ? m * AF_SIMT_LN2 + logf(l) : -INFINITY;
}

/* One kernel per accumulator count: Ev <= 128, 256, 512, 1024. */
#define AF_SIMT_KERNEL(name, slots)                                                          \
    AF_KERNEL(name, af_simt_params, p, AF_SIMT_THREADS) {                                    \
        for (int64_t block = AF_BLOCK_IDX_X; block < p.blocks; block += AF_GRID_DIM_X)       \
            af_simt_block(p, block, slots);                                                  \
    }
AF_SIMT_KERNEL(af_simt_kernel_4, 4)
AF_SIMT_KERNEL(af_simt_kernel_8, 8)
AF_SIMT_KERNEL(af_simt_kernel_16, 16)
AF_SIMT_KERNEL(af_simt_kernel_32, 32)

cudaError_t af_cuda_simt_forward(const af_problem *p, const af_cuda_device *dev, cudaStream_t stream) {
    (void)dev;   /* the shared memory stays under the 48 KiB every device allows */
    if (p->B == 0 || p->Hq == 0 || p->L == 0) return cudaSuccess;   /* no query row */
    af_simt_params prm;
    prm.p = *p;
    prm.scale_log2 = (float)(p->scale * AF_SIMT_LOG2E);
    prm.scale = (float)p->scale;
    prm.softcap = (float)p->softcap;
    prm.row_blocks = (p->group * p->L + AF_SIMT_WARPS - 1) / AF_SIMT_WARPS;
    prm.blocks = p->B * p->Hkv * prm.row_blocks;
    const int grid = (int)(prm.blocks < AF_SIMT_MAX_BLOCKS ? prm.blocks : AF_SIMT_MAX_BLOCKS);
    const size_t smem = af_simt_smem_bytes(p->E);
    if (p->Ev <= 128) return AF_LAUNCH(af_simt_kernel_4, grid, 1, 1, AF_SIMT_THREADS, smem, stream, prm);
    if (p->Ev <= 256) return AF_LAUNCH(af_simt_kernel_8, grid, 1, 1, AF_SIMT_THREADS, smem, stream, prm);
    if (p->Ev <= 512) return AF_LAUNCH(af_simt_kernel_16, grid, 1, 1, AF_SIMT_THREADS, smem, stream, prm);
    return AF_LAUNCH(af_simt_kernel_32, grid, 1, 1, AF_SIMT_THREADS, smem, stream, prm);
}

#endif
