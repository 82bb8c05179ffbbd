/* The tensor-core backward for f16/bf16 (FlashAttention-2's algorithm on mma.sync m16n8k16, research/fa4.md §2.4),
 * deterministic: no atomics, every gradient element written once by one thread, sums in a fixed order.
 *   - af_bwd_dot: D = rowsum(dout ∘ out) per query row (one warp a row, a fixed shuffle tree), into the workspace;
 *   - af_bwd_dkdv: K/V-stationary. A CTA owns AF_BWD_BK keys of one (batch, kv head), each of its 4 warps 16 of them;
 *     it walks the group's query heads in order and, per head, the query rows that see any of its keys
 *     (AF_BWD_BQ at a time): Sᵀ = K·Qᵀ, Pᵀ = 2^(Sᵀ - lse) recomputed from the forward's lse, dV += Pᵀ·dO,
 *     dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ - D), dK += dSᵀ·Q; dK and dV written once, complete (GQA summed here);
 *   - af_bwd_dq: Q-stationary. A CTA owns AF_BWD_ROWS query rows of one (batch, head), each warp 16; per key tile:
 *     S = Q·Kᵀ, P, dP = dO·Vᵀ, dS, dQ += dS·K (P recomputed a second time rather than dq summed with atomics);
 *   - af_bwd_dsink: d(sink_h) = -Σ rows exp(sink_h - lse)·D, one thread a head, in row order (double);
 *   - af_bwd_zero: the gradient rows no sequence covers (varlen gaps, keys past seqused_k), before the others.
 * Tiles in shared memory use attn_mma.cuh's swizzled layout and fragment helpers; a tensor whose rows are 16-byte
 * aligned chunks is copied with cp.async, any other view element by element (the backward copies nothing). The
 * meanings are the forward's: scale, both causal alignments and windows (af_key_range_of), bool/additive masks,
 * softcap (through tanh: dS·(1 - tanh²)), the learned sink (in lse), GQA, varlen and seqused_k. A row that sees no
 * key (lse = -inf) gets P = 0. */
#ifndef AF_CUDA_ATTN_BWD_MMA_CUH
#define AF_CUDA_ATTN_BWD_MMA_CUH
#include <math.h>
#include <stdint.h>

#include "cuda/attn_mma.cuh"
#include "cuda/kernels.h"
#include "cuda/scalar.cuh"

#define AF_BWD_BK 64                           /* keys a dK/dV CTA owns; keys a dQ step reads */
#define AF_BWD_BQ 32                           /* query rows a dK/dV step reads (registers: Sᵀ and dPᵀ live at once) */
#define AF_BWD_ROWS 64                         /* query rows a dQ CTA owns */
#define AF_BWD_HD_MAX 128                      /* largest head-dim variant: dK and dV accumulators of 16 keys a warp */

typedef struct {
    const char *q, *k, *v, *out, *dout;
    int64_t q_stride[4], k_stride[4], v_stride[4], out_stride[4], dout_stride[4];   /* elements */
    char *dq, *dk, *dv;            /* NULL: not wanted */
    int64_t dq_stride[4], dk_stride[4], dv_stride[4];
    const float *lse;              /* (B, Hq, L), the forward's (natural log) */
    int64_t lse_stride[3];
    float *D;                      /* workspace: rowsum(dout ∘ out) at (b·Hq + h)·L + i */
    const char *mask;
    int64_t mask_stride[4];
    int mask_kind;                 /* AF_MMA_MASK_* */
    int causal, has_window;
    int64_t window_left, window_right;
    int softcap_on;
    float softcap_log2, scale_over_cap, scale_log2, scale;
    const char *sink;              /* NULL, or (Hq,) logits */
    int sink_dtype;
    int64_t sink_stride;
    char *dsink;                   /* NULL, or (Hq,) in sink_dtype */
    int64_t dsink_stride;
    const int32_t *cu_seqlens_q, *cu_seqlens_k, *seqused_k;
    int64_t cu_seqlens_q_stride, cu_seqlens_k_stride, seqused_stride;
    int64_t total_q, total_k;
    int E, Ev;
    int64_t B, Hq, Hkv, L, S, group;
    int vec_q, vec_k, vec_v, vec_dout;   /* rows of 16-byte aligned chunks: cp.async, else element loads */
    int bf16;                      /* the 16-bit dtype of every tensor but lse and the sink */
} af_bwd_params;

/* The zero pass's view: (n0, n1, n2, n3) 16-bit elements with these strides. */
typedef struct {
    char *data;
    int64_t n[4], stride[4];
} af_bwd_zero_params;

/* Batch b's sequence with every index entry checked before use (problem.h's af_sequence_checked). */
AF_DEVICE int af_bwd_sequence(const af_bwd_params *p, int64_t b, af_sequence *sq) {
    return af_sequence_checked(p->cu_seqlens_q, p->cu_seqlens_q_stride, p->cu_seqlens_k, p->cu_seqlens_k_stride,
                               p->seqused_k, p->seqused_stride, p->L, p->S, p->total_q, p->total_k, b, sq);
}

AF_DEVICE void af_bwd_key_range(const af_bwd_params *p, const af_sequence *sq, int64_t i, int64_t *lo, int64_t *hi) {
    af_key_range_of(p->causal, p->has_window, p->window_left, p->window_right, sq->L, sq->S, i, lo, hi);
}

/* `rows` rows of a 16-bit tensor (base, strides) of (b, h) from row `row0` of its dim 2 into a swizzled tile of hd
 * columns: rows at or past `valid` and columns past `cols` are zero. */
AF_DEVICE void af_bwd_load_rows(char *dst, const char *base, const int64_t *stride, int64_t b, int64_t h,
                                int64_t row0, int64_t valid, const int rows, int cols, const int hd, int vec) {
    const int chunks = hd / 8, chunk = AF_THREAD_IDX % chunks, bytes = af_mma_chunk_bytes(cols, chunk, 2);
    AF_MMA_ROLLED
    for (int row = AF_THREAD_IDX / chunks; row < rows; row += AF_MMA_THREADS / chunks) {
        const int ok = row < valid && bytes > 0;
        const char *src = ok ? base + 2 * (b * stride[0] + h * stride[1] + (row0 + row) * stride[2]) : base;
        char *d = dst + af_mma_swizzle(row, chunk, hd);
        if (vec) {
            af_cp_async_16(d, ok ? src + chunk * 16 : base, ok ? bytes : 0);
            continue;
        }
        uint16_t *e = (uint16_t *)d;
        for (int x = 0; x < 8; x++) {
            const int col = 8 * chunk + x;
            e[x] = ok && col < cols ? ((const uint16_t *)src)[col * stride[3]] : (uint16_t)0;
        }
    }
}

/* acc[n] += A(this warp's 16 rows, k-slice kk)·Bᵀ for `n_cols` rows of `tile` as B's columns (attn_mma.cuh's
 * af_mma_qk_slice: two n8 tiles per ldmatrix.x4). */
AF_DEVICE void af_bwd_nt(float acc[][4], const uint32_t a[4], const char *tile, int kk, const int hd,
                         const int n_cols, const int bf16) {
    const int lane = af_lane();
    AF_MMA_UNROLL
    for (int np = 0; np < n_cols / 16; np++) {
        uint32_t fb[4];
        af_ldmatrix_x4(fb, tile + af_mma_swizzle(16 * np + (lane & 7) + 8 * (lane >> 4), 2 * kk + ((lane >> 3) & 1),
                                                 hd));
        af_mma_op(acc[2 * np], a, fb, bf16);
        af_mma_op(acc[2 * np + 1], a, fb + 2, bf16);
    }
}

/* o += M·T: M (16 rows × k_rows) in this warp's accumulators, packed in place into A fragments (af_mma_pv's P), T
 * the first k_rows rows of `tile` (its first `cols` columns) by ldmatrix.trans. */
AF_DEVICE void af_bwd_tn(float o[][4], float m[][4], const char *tile, const int hd, int cols, const int k_rows,
                         const int bf16) {
    const int lane = af_lane();
    AF_MMA_UNROLL
    for (int ks = 0; ks < k_rows / 16; ks++) {
        uint32_t pa[4];
        pa[0] = af_mma_pack(m[2 * ks][0], m[2 * ks][1], bf16);
        pa[1] = af_mma_pack(m[2 * ks][2], m[2 * ks][3], bf16);
        pa[2] = af_mma_pack(m[2 * ks + 1][0], m[2 * ks + 1][1], bf16);
        pa[3] = af_mma_pack(m[2 * ks + 1][2], m[2 * ks + 1][3], bf16);
        AF_MMA_UNROLL
        for (int dp = 0; dp < hd / 16; dp++) {
            if (16 * dp >= cols) continue;   /* zero columns of the padded head dim */
            uint32_t tb[4];
            af_ldmatrix_x4_trans(tb, tile + af_mma_swizzle(16 * ks + (lane & 7) + 8 * ((lane >> 3) & 1),
                                                           2 * dp + (lane >> 4), hd));
            af_mma_op(o[2 * dp], pa, tb, bf16);
            af_mma_op(o[2 * dp + 1], pa, tb + 2, bf16);
        }
    }
}

/* A's fragment of this warp's 16 rows (from `row0` of the tile), k-slice kk. */
AF_DEVICE void af_bwd_a_fragment(uint32_t a[4], const char *tile, int row0, int kk, const int hd) {
    const int lane = af_lane();
    af_ldmatrix_x4(a, tile + af_mma_swizzle(row0 + (lane & 15), 2 * kk + (lane >> 4), hd));
}

/* One score's P and dS (log2 units): x = q·k, dp = dO·v of query row i (sequence index, lse2 = lse·log2(e) or +inf
 * for a row that sees nothing) and key j. `checked`: the row's key range [lo, hi) (empty for a row past the
 * sequence) and the mask apply (else every row of the step sees every key of it). *ds = P·(dp - D)·(1 - tanh²)
 * without the scale, which the stores apply. */
AF_DEVICE float af_bwd_score(const af_bwd_params *p, int64_t b, int64_t h, int64_t i, int64_t j, int64_t lo,
                             int64_t hi, float x, float dp, float lse2, float d, int checked, const int bf16,
                             float *ds) {
    float th = 0.0f, sl;
    if (p->softcap_on) {
        th = tanhf(x * p->scale_over_cap);
        sl = p->softcap_log2 * th;
    } else {
        sl = x * p->scale_log2;
    }
    if (checked) {
        if (j < lo || j >= hi) {
            *ds = 0.0f;
            return 0.0f;
        }
        if (p->mask) {
            const int64_t at = b * p->mask_stride[0] + h * p->mask_stride[1] + i * p->mask_stride[2] +
                               j * p->mask_stride[3];
            if (p->mask_kind == AF_MMA_MASK_BOOL) {
                if (!((const unsigned char *)p->mask)[at]) {
                    *ds = 0.0f;
                    return 0.0f;
                }
            } else {
                const uint16_t bits = ((const uint16_t *)p->mask)[at];
                sl += (bf16 ? af_bf16_to_float(bits) : af_f16_to_float(bits)) * AF_MMA_LOG2E;
            }
        }
    }
    const float prob = af_ex2(sl - lse2);
    float g = prob * (dp - d);
    if (p->softcap_on) g *= 1.0f - th * th;
    *ds = g;
    return prob;
}

/* Row i's key range, empty past the sequence's rows. */
AF_DEVICE void af_bwd_row_range(const af_bwd_params *p, const af_sequence *sq, int64_t i, int64_t *lo, int64_t *hi) {
    *lo = *hi = 0;
    if (i < sq->L) af_bwd_key_range(p, sq, i, lo, hi);
}

/* Whether every row of [i0, i0 + rows) sees every key of [key0, key0 + keys) and exists: no per-score check. */
AF_DEVICE int af_bwd_block_free(const af_bwd_params *p, const af_sequence *sq, int64_t i0, int rows, int64_t key0,
                                int keys) {
    if (p->mask || i0 + rows > sq->L || key0 + keys > sq->S) return 0;
    int64_t lo_first, hi_first, lo_last, hi_last;
    af_bwd_key_range(p, sq, i0, &lo_first, &hi_first);
    af_bwd_key_range(p, sq, i0 + rows - 1, &lo_last, &hi_last);
    return lo_last <= key0 && hi_first >= key0 + keys;   /* both ends grow with the row */
}

/* Row i's lse in log2 units and D into shared memory: +inf and 0 for rows that do not exist or see no key. */
AF_DEVICE void af_bwd_load_row_stats(float *lse2_s, float *d_s, const af_bwd_params *p, const af_sequence *sq,
                                     int64_t b, int64_t h, int64_t i0, const int rows) {
    for (int r = AF_THREAD_IDX; r < rows; r += AF_MMA_THREADS) {
        const int64_t i = i0 + r;
        float lse2 = INFINITY, d = 0.0f;
        if (i < sq->L) {
            const float lse = p->lse[b * p->lse_stride[0] + h * p->lse_stride[1] + (sq->q0 + i) * p->lse_stride[2]];
            lse2 = lse == -INFINITY ? INFINITY : lse * AF_MMA_LOG2E;
            d = p->D[(b * p->Hq + h) * p->L + i];
        }
        lse2_s[r] = lse2;
        d_s[r] = d;
    }
}

/* The first row i in [0, L) with pred(i) true, pred monotone (false then true): rows that see key `key`. */
AF_DEVICE int64_t af_bwd_first_row(const af_bwd_params *p, const af_sequence *sq, int64_t key, int lower) {
    int64_t a = 0, z = sq->L;
    while (a < z) {
        const int64_t mid = a + (z - a) / 2;
        int64_t lo, hi;
        af_bwd_key_range(p, sq, mid, &lo, &hi);
        if (lower ? hi > key : lo >= key) z = mid;
        else a = mid + 1;
    }
    return a;
}

/* One 16-bit gradient pair (columns col, col + 1 < cols) of a row, times `factor`. */
AF_DEVICE void af_bwd_store_pair(char *row, const int64_t *stride, int col, int cols, float v0, float v1,
                                 float factor, const int bf16) {
    uint16_t *e0 = (uint16_t *)(row + 2 * col * stride[3]);
    *e0 = bf16 ? af_float_to_bf16(v0 * factor) : af_float_to_f16(v0 * factor);
    if (col + 1 < cols) {
        uint16_t *e1 = (uint16_t *)(row + 2 * (col + 1) * stride[3]);
        *e1 = bf16 ? af_float_to_bf16(v1 * factor) : af_float_to_f16(v1 * factor);
    }
}

/* This warp's 16 accumulated rows (C layout) to a gradient: rows row0 + g + 8·half below `valid`, of tensor row
 * `tensor_row0` + that, columns below `cols`. */
AF_DEVICE void af_bwd_store_rows(char *data, const int64_t *stride, int64_t b, int64_t h, int64_t tensor_row0,
                                 int row0, int64_t valid, float acc[][4], int cols, float factor, const int hd,
                                 const int bf16) {
    const int lane = af_lane(), g = lane >> 2, t = lane & 3;
    AF_MMA_UNROLL
    for (int half = 0; half < 2; half++) {
        const int r = row0 + g + 8 * half;
        if (r >= valid) continue;
        char *row = data + 2 * (b * stride[0] + h * stride[1] + (tensor_row0 + r) * stride[2]);
        AF_MMA_UNROLL
        for (int d = 0; d < hd / 8; d++) {
            const int col = 8 * d + 2 * t;
            if (col < cols) af_bwd_store_pair(row, stride, col, cols, acc[d][2 * half], acc[d][2 * half + 1], factor,
                                              bf16);
        }
    }
}

/* dK and dV of AF_BWD_BK keys of one (batch, kv head): hd (64, 128) and bf16 are constants here. */
AF_DEVICE void af_bwd_dkdv_body(const af_bwd_params p, const int hd, const int bf16) {
    const int lane = af_lane(), warp = af_warp(), g = lane >> 2, t = lane & 3;
    const int64_t b = AF_BLOCK_IDX_Z, hk = AF_BLOCK_IDX_Y, key0 = (int64_t)AF_BLOCK_IDX_X * AF_BWD_BK;
    af_sequence sq;
    if (af_bwd_sequence(&p, b, &sq) != AF_SEQ_OK || key0 >= sq.S) return;   /* the zero pass wrote those rows */
    char *k_tile = af_shared_memory();
    char *v_tile = k_tile + AF_BWD_BK * hd * 2, *q_tile = v_tile + AF_BWD_BK * hd * 2;
    char *do_tile = q_tile + AF_BWD_BQ * hd * 2;
    float *lse2_s = (float *)(do_tile + AF_BWD_BQ * hd * 2), *d_s = lse2_s + AF_BWD_BQ;
    af_bwd_load_rows(k_tile, p.k, p.k_stride, b, hk, sq.k0 + key0, sq.S - key0, AF_BWD_BK, p.E, hd, p.vec_k);
    af_bwd_load_rows(v_tile, p.v, p.v_stride, b, hk, sq.k0 + key0, sq.S - key0, AF_BWD_BK, p.Ev, hd, p.vec_v);
    af_cp_async_commit();

    float dk[AF_BWD_HD_MAX / 8][4], dv[AF_BWD_HD_MAX / 8][4];
    AF_MMA_UNROLL
    for (int d = 0; d < hd / 8; d++)
        AF_MMA_UNROLL
        for (int c = 0; c < 4; c++) dk[d][c] = dv[d][c] = 0.0f;
    const int64_t key_end = key0 + AF_BWD_BK < sq.S ? key0 + AF_BWD_BK : sq.S;
    /* the rows that see any of these keys: those whose range ends past key0 and starts before key_end */
    const int64_t i_begin = af_bwd_first_row(&p, &sq, key0, 1), i_end = af_bwd_first_row(&p, &sq, key_end, 0);
    const int wk = 16 * warp;   /* this warp's keys in the tile */
    for (int64_t hh = 0; hh < p.group; hh++) {   /* a group's heads in order: the same sum every run */
        const int64_t h = hk * p.group + hh;
        for (int64_t i0 = i_begin; i0 < i_end; i0 += AF_BWD_BQ) {
            af_syncthreads();   /* the last step's reads of Q, dO and the row stats are done */
            af_bwd_load_rows(q_tile, p.q, p.q_stride, b, h, sq.q0 + i0, sq.L - i0, AF_BWD_BQ, p.E, hd, p.vec_q);
            af_bwd_load_rows(do_tile, p.dout, p.dout_stride, b, h, sq.q0 + i0, sq.L - i0, AF_BWD_BQ, p.Ev, hd,
                             p.vec_dout);
            af_cp_async_commit();
            af_bwd_load_row_stats(lse2_s, d_s, &p, &sq, b, h, i0, AF_BWD_BQ);
            af_cp_async_wait_0();
            af_syncthreads();   /* every thread's copies (K and V the first time) are visible */
            float s[AF_BWD_BQ / 8][4], dp[AF_BWD_BQ / 8][4];
            AF_MMA_UNROLL
            for (int n = 0; n < AF_BWD_BQ / 8; n++)
                AF_MMA_UNROLL
                for (int c = 0; c < 4; c++) s[n][c] = dp[n][c] = 0.0f;
            AF_MMA_UNROLL
            for (int kk = 0; kk < hd / 16; kk++) {
                uint32_t a[4];
                if (16 * kk < p.E) {
                    af_bwd_a_fragment(a, k_tile, wk, kk, hd);
                    af_bwd_nt(s, a, q_tile, kk, hd, AF_BWD_BQ, bf16);
                }
                if (16 * kk < p.Ev) {
                    af_bwd_a_fragment(a, v_tile, wk, kk, hd);
                    af_bwd_nt(dp, a, do_tile, kk, hd, AF_BWD_BQ, bf16);
                }
            }
            const int checked = !af_bwd_block_free(&p, &sq, i0, AF_BWD_BQ, key0, AF_BWD_BK);
            AF_MMA_UNROLL
            for (int n = 0; n < AF_BWD_BQ / 8; n++)
                AF_MMA_UNROLL
                for (int c = 0; c < 2; c++) {
                    const int col = 8 * n + 2 * t + c;   /* Sᵀ: columns are query rows, rows keys */
                    int64_t lo = 0, hi = 0;
                    if (checked) af_bwd_row_range(&p, &sq, i0 + col, &lo, &hi);
                    AF_MMA_UNROLL
                    for (int half = 0; half < 2; half++) {
                        const int e = 2 * half + c, key = wk + g + 8 * half;
                        float ds;
                        s[n][e] = af_bwd_score(&p, b, h, i0 + col, key0 + key, lo, hi, s[n][e], dp[n][e],
                                               lse2_s[col], d_s[col], checked, bf16, &ds);
                        dp[n][e] = ds;
                    }
                }
            af_bwd_tn(dv, s, do_tile, hd, p.Ev, AF_BWD_BQ, bf16);
            af_bwd_tn(dk, dp, q_tile, hd, p.E, AF_BWD_BQ, bf16);
        }
    }
    if (i_begin >= i_end || p.group == 0) af_cp_async_wait_0();   /* K/V copies never waited for: land them */
    if (p.dk)
        af_bwd_store_rows(p.dk, p.dk_stride, b, hk, sq.k0 + key0, wk, sq.S - key0, dk, p.E, p.scale, hd, bf16);
    if (p.dv)
        af_bwd_store_rows(p.dv, p.dv_stride, b, hk, sq.k0 + key0, wk, sq.S - key0, dv, p.Ev, 1.0f, hd, bf16);
}

/* dQ of AF_BWD_ROWS query rows of one (batch, head). */
AF_DEVICE void af_bwd_dq_body(const af_bwd_params p, const int hd, const int bf16) {
    const int lane = af_lane(), warp = af_warp(), g = lane >> 2, t = lane & 3;
    const int64_t b = AF_BLOCK_IDX_Z, h = AF_BLOCK_IDX_Y, i0 = (int64_t)AF_BLOCK_IDX_X * AF_BWD_ROWS;
    af_sequence sq;
    if (af_bwd_sequence(&p, b, &sq) == AF_SEQ_SKIP || i0 >= sq.L) return;   /* the zero pass wrote those rows */
    const int64_t hk = af_mma_div(h, p.group);
    char *q_tile = af_shared_memory();
    char *do_tile = q_tile + AF_BWD_ROWS * hd * 2, *k_tile = do_tile + AF_BWD_ROWS * hd * 2;
    char *v_tile = k_tile + AF_BWD_BK * hd * 2;
    float *lse2_s = (float *)(v_tile + AF_BWD_BK * hd * 2), *d_s = lse2_s + AF_BWD_ROWS;
    af_bwd_load_rows(q_tile, p.q, p.q_stride, b, h, sq.q0 + i0, sq.L - i0, AF_BWD_ROWS, p.E, hd, p.vec_q);
    af_bwd_load_rows(do_tile, p.dout, p.dout_stride, b, h, sq.q0 + i0, sq.L - i0, AF_BWD_ROWS, p.Ev, hd, p.vec_dout);
    af_cp_async_commit();
    af_bwd_load_row_stats(lse2_s, d_s, &p, &sq, b, h, i0, AF_BWD_ROWS);

    float dq[AF_BWD_HD_MAX / 8][4];
    AF_MMA_UNROLL
    for (int d = 0; d < hd / 8; d++) dq[d][0] = dq[d][1] = dq[d][2] = dq[d][3] = 0.0f;
    const int64_t i_last = i0 + AF_BWD_ROWS - 1 < sq.L - 1 ? i0 + AF_BWD_ROWS - 1 : sq.L - 1;
    int64_t lo, hi_first, lo_last, hi;
    af_bwd_key_range(&p, &sq, i0, &lo, &hi_first);
    af_bwd_key_range(&p, &sq, i_last, &lo_last, &hi);
    const int wr = 16 * warp;   /* this warp's rows in the block */
    for (int64_t key0 = lo / AF_BWD_BK * AF_BWD_BK; key0 < hi; key0 += AF_BWD_BK) {
        af_syncthreads();   /* the last tile's reads are done */
        af_bwd_load_rows(k_tile, p.k, p.k_stride, b, hk, sq.k0 + key0, sq.S - key0, AF_BWD_BK, p.E, hd, p.vec_k);
        af_bwd_load_rows(v_tile, p.v, p.v_stride, b, hk, sq.k0 + key0, sq.S - key0, AF_BWD_BK, p.Ev, hd, p.vec_v);
        af_cp_async_commit();
        af_cp_async_wait_0();
        af_syncthreads();   /* K, V (and Q, dO the first time) visible to every warp */
        float s[AF_BWD_BK / 8][4], dp[AF_BWD_BK / 8][4];
        AF_MMA_UNROLL
        for (int n = 0; n < AF_BWD_BK / 8; n++)
            AF_MMA_UNROLL
            for (int c = 0; c < 4; c++) s[n][c] = dp[n][c] = 0.0f;
        AF_MMA_UNROLL
        for (int kk = 0; kk < hd / 16; kk++) {
            uint32_t a[4];
            if (16 * kk < p.E) {
                af_bwd_a_fragment(a, q_tile, wr, kk, hd);
                af_bwd_nt(s, a, k_tile, kk, hd, AF_BWD_BK, bf16);
            }
            if (16 * kk < p.Ev) {
                af_bwd_a_fragment(a, do_tile, wr, kk, hd);
                af_bwd_nt(dp, a, v_tile, kk, hd, AF_BWD_BK, bf16);
            }
        }
        const int checked = !af_bwd_block_free(&p, &sq, i0, AF_BWD_ROWS, key0, AF_BWD_BK);
        int64_t lo_row[2] = {0, 0}, hi_row[2] = {0, 0};   /* this lane's two rows' key ranges */
        if (checked)
            for (int half = 0; half < 2; half++) af_bwd_row_range(&p, &sq, i0 + wr + g + 8 * half, &lo_row[half],
                                                                 &hi_row[half]);
        AF_MMA_UNROLL
        for (int n = 0; n < AF_BWD_BK / 8; n++)
            AF_MMA_UNROLL
            for (int e = 0; e < 4; e++) {
                const int half = e >> 1, row = wr + g + 8 * half, key = 8 * n + 2 * t + (e & 1);
                float ds;
                s[n][e] = af_bwd_score(&p, b, h, i0 + row, key0 + key, lo_row[half], hi_row[half], s[n][e], dp[n][e],
                                       lse2_s[row], d_s[row], checked, bf16, &ds);
                dp[n][e] = ds;
            }
        af_bwd_tn(dq, dp, k_tile, hd, p.E, AF_BWD_BK, bf16);
    }
    if (lo >= hi) af_cp_async_wait_0();   /* no tile: Q and dO copies still land before the block ends */
    if (p.dq) af_bwd_store_rows(p.dq, p.dq_stride, b, h, sq.q0 + i0, wr, sq.L - i0, dq, p.E, p.scale, hd, bf16);
}

/* D of one query row a warp: Σ dout·out over Ev in f32, lanes' partial sums joined by a fixed shuffle tree. */
AF_KERNEL(af_bwd_dot, af_bwd_params, p, AF_MMA_THREADS) {
    const int64_t id = (int64_t)AF_BLOCK_IDX_X * AF_MMA_WARPS + af_warp();
    if (id >= p.B * p.Hq * p.L) return;   /* the whole warp: no lane is left in a shuffle */
    const int64_t i = id % p.L, h = id / p.L % p.Hq, b = id / p.L / p.Hq;
    af_sequence sq;
    if (af_bwd_sequence(&p, b, &sq) == AF_SEQ_SKIP || i >= sq.L) return;
    const int64_t row = sq.q0 + i;
    const uint16_t *o = (const uint16_t *)(p.out + 2 * (b * p.out_stride[0] + h * p.out_stride[1] +
                                                        row * p.out_stride[2]));
    const uint16_t *d = (const uint16_t *)(p.dout + 2 * (b * p.dout_stride[0] + h * p.dout_stride[1] +
                                                         row * p.dout_stride[2]));
    float sum = 0.0f;
    for (int e = af_lane(); e < p.Ev; e += 32) {
        const uint16_t ob = o[e * p.out_stride[3]], db = d[e * p.dout_stride[3]];
        sum += p.bf16 ? af_bf16_to_float(ob) * af_bf16_to_float(db) : af_f16_to_float(ob) * af_f16_to_float(db);
    }
    for (int x = 16; x > 0; x >>= 1) sum += af_shfl_xor(sum, x);
    if (af_lane() == 0) p.D[(b * p.Hq + h) * p.L + i] = sum;
}

/* d(sink_h) = -Σ over batches and rows, in order, of exp(sink_h - lse)·D (the sink's probability times D): one
 * thread a head, in double. */
AF_KERNEL(af_bwd_dsink, af_bwd_params, p, 32) {
    const int64_t h = AF_BLOCK_IDX_X;
    if (af_lane() != 0 || h >= p.Hq) return;
    const float sink = af_load_scalar(p.sink, (af_dtype)p.sink_dtype, h * p.sink_stride);
    double sum = 0.0;
    for (int64_t b = 0; b < p.B && sink != -INFINITY; b++) {
        af_sequence sq;
        if (af_bwd_sequence(&p, b, &sq) == AF_SEQ_SKIP) continue;
        for (int64_t i = 0; i < sq.L; i++) {
            const float lse = p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + (sq.q0 + i) * p.lse_stride[2]];
            sum += exp((double)sink - (double)lse) * (double)p.D[(b * p.Hq + h) * p.L + i];
        }
    }
    af_store_scalar(p.dsink, (af_dtype)p.sink_dtype, h * p.dsink_stride, (float)-sum);
}

/* Zeros over a strided view of 16-bit elements, a grid-stride loop. */
AF_KERNEL(af_bwd_zero, af_bwd_zero_params, z, AF_MMA_THREADS) {
    const int64_t total = z.n[0] * z.n[1] * z.n[2] * z.n[3];
    for (int64_t x = (int64_t)AF_BLOCK_IDX_X * AF_MMA_THREADS + AF_THREAD_IDX; x < total;
         x += (int64_t)AF_GRID_DIM_X * AF_MMA_THREADS) {
        const int64_t e = x % z.n[3], r = x / z.n[3] % z.n[2], h = x / z.n[3] / z.n[2] % z.n[1];
        const int64_t a = x / z.n[3] / z.n[2] / z.n[1];
        ((uint16_t *)z.data)[a * z.stride[0] + h * z.stride[1] + r * z.stride[2] + e * z.stride[3]] = 0;
    }
}

/* One kernel per (head dim, dtype) for each half of the backward. */
#define AF_BWD_KERNELS(hd, bf16, suffix)                                                                       \
    AF_KERNEL(af_bwd_dkdv_##suffix, af_bwd_params, p, AF_MMA_THREADS) { af_bwd_dkdv_body(p, hd, bf16); }     \
    AF_KERNEL(af_bwd_dq_##suffix, af_bwd_params, p, AF_MMA_THREADS) { af_bwd_dq_body(p, hd, bf16); }
AF_BWD_KERNELS(64, 0, f16_hd64)
AF_BWD_KERNELS(128, 0, f16_hd128)
AF_BWD_KERNELS(64, 1, bf16_hd64)
AF_BWD_KERNELS(128, 1, bf16_hd128)

#endif
