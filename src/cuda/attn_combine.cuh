/* The split-KV combine: each split of the keys left a normalised f32 partial O_s and its LSE_s (natural log) per
 * query row; the row's result is O = sum_s w_s·O_s with w_s = exp(LSE_s - LSE), LSE = log sum_s exp(LSE_s).
 * A warp per row: lanes share the splits for the max and the sum of weights (butterflies), then the value
 * columns (lane + 32·c). A row whose every split is -inf (it saw no key) gets out = 0 and lse = -inf. af_flash_attn's
 * learned sink is one more LSE term with no value (FA4): it joins the max and the sum here, once per row. Rows are
 * the tensor-core kernel's packed rows; under varlen a sequence's rows past its own length are skipped. */
#ifndef AF_CUDA_ATTN_COMBINE_CUH
#define AF_CUDA_ATTN_COMBINE_CUH
#include <math.h>
#include <stdint.h>

#include "cuda/kernels.h"
#include "cuda/scalar.cuh"

#define AF_COMBINE_WARPS 4                       /* rows per block */
#define AF_COMBINE_THREADS (32 * AF_COMBINE_WARPS)
#define AF_COMBINE_MAX_COLS 256                  /* Ev: 8 columns per lane */
#define AF_COMBINE_LOG2E 1.4426950408889634f
#define AF_COMBINE_LN2 0.6931471805599453f

#if defined(__CUDACC__)
#define AF_COMBINE_UNROLL _Pragma("unroll")
#else
#define AF_COMBINE_UNROLL
#endif

typedef struct {
    const float *part_o, *part_lse;   /* [split][row][Ev], [split][row]; row = (b·Hkv + hk)·rows + packed row r */
    int splits, Ev, bf16;
    int64_t total_rows, Hkv, group, rows, L;   /* rows = group·L packed rows per (batch, kv head), L the longest */
    const int32_t *cu_seqlens_q;      /* varlen (NULL otherwise): sequence b's L_b rows start at entry b */
    int64_t cu_seqlens_q_stride, total_q;   /* total_q: the packed rows its entries are checked against */
    char *out;                        /* f16/bf16 */
    int64_t out_stride[4];
    float *lse;                       /* NULL or f32 (B, Hq, L) */
    int64_t lse_stride[3];
    const char *sink;                 /* NULL, or (Hq,) logits of sink_dtype, sink_stride elements apart */
    int sink_dtype;
    int64_t sink_stride;
} af_combine_params;

AF_KERNEL(af_combine_kernel, af_combine_params, p, AF_COMBINE_THREADS) {
    const int lane = af_lane();
    const int64_t row = (int64_t)AF_BLOCK_IDX_X * AF_COMBINE_WARPS + af_warp();
    if (row >= p.total_rows) return;   /* the whole warp: no collective follows for it */
    /* packed row r of (batch b, kv head hk): head hk·group + r / L_b, query r % L_b of the batch's sequence */
    const int64_t bhk = row / p.rows, r = row % p.rows, b = bhk / p.Hkv, hk = bhk % p.Hkv;
    af_sequence sq;   /* entries checked as the attention kernel does: a SKIP sequence has no rows */
    (void)af_sequence_checked(p.cu_seqlens_q, p.cu_seqlens_q_stride, NULL, 0, NULL, 0, p.L, 0, p.total_q, 0, b, &sq);
    if (r >= p.group * sq.L) return;   /* past a short sequence's rows (varlen): no partial, no output */
    const int64_t h = hk * p.group + r / sq.L, i = sq.q0 + r % sq.L;
    float lse_max = -INFINITY, nan = 0.0f;   /* nan: a split found a bad index (its LSE is NaN), fmaxf would drop it */
    for (int s = lane; s < p.splits; s += 32) {
        const float lse = p.part_lse[s * p.total_rows + row];
        lse_max = fmaxf(lse_max, lse);
        if (lse != lse) nan = 1.0f;
    }
    for (int x = 16; x > 0; x >>= 1) {
        lse_max = fmaxf(lse_max, af_shfl_xor(lse_max, x));
        nan = fmaxf(nan, af_shfl_xor(nan, x));
    }
    const float sink = p.sink ? af_load_scalar(p.sink, (af_dtype)p.sink_dtype, h * p.sink_stride) : -INFINITY;
    lse_max = sink != sink || nan != 0.0f ? NAN : fmaxf(lse_max, sink);   /* a NaN sink or partial: the row is NaN */
    float sum = 0.0f;
    if (lse_max != -INFINITY)
        for (int s = lane; s < p.splits; s += 32)
            sum += af_ex2((p.part_lse[s * p.total_rows + row] - lse_max) * AF_COMBINE_LOG2E);
    for (int x = 16; x > 0; x >>= 1) sum += af_shfl_xor(sum, x);
    if (sink != -INFINITY) sum += af_ex2((sink - lse_max) * AF_COMBINE_LOG2E);   /* after the butterfly: once */

    float acc[AF_COMBINE_MAX_COLS / 32];
    AF_COMBINE_UNROLL
    for (int c = 0; c < AF_COMBINE_MAX_COLS / 32; c++) acc[c] = 0.0f;
    if (lse_max != -INFINITY) {
        for (int s = 0; s < p.splits; s++) {
            const float w = af_ex2((p.part_lse[s * p.total_rows + row] - lse_max) * AF_COMBINE_LOG2E) / sum;
            if (w == 0.0f) continue;   /* an empty split adds nothing */
            const float *o = p.part_o + (s * p.total_rows + row) * p.Ev;
            AF_COMBINE_UNROLL
            for (int c = 0; c < AF_COMBINE_MAX_COLS / 32; c++)
                if (lane + 32 * c < p.Ev) acc[c] += w * o[lane + 32 * c];
        }
    }
    char *out_row = p.out + 2 * (b * p.out_stride[0] + h * p.out_stride[1] + i * p.out_stride[2]);
    AF_COMBINE_UNROLL
    for (int c = 0; c < AF_COMBINE_MAX_COLS / 32; c++) {
        const int col = lane + 32 * c;
        if (col < p.Ev)
            *(uint16_t *)(out_row + 2 * col * p.out_stride[3]) = p.bf16 ? af_float_to_bf16(acc[c])
                                                                         : af_float_to_f16(acc[c]);
    }
    if (p.lse && lane == 0)
        p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] =
            lse_max == -INFINITY ? -INFINITY : lse_max + logf(sum);
}

#endif
