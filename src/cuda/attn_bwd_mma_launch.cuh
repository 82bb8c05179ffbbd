/* Host side of the tensor-core backward (attn_bwd_mma.cuh): the head-dim variant, the shared memory, the grids and
 * the order of the launches (zero pass, D, dsink, dK/dV, dQ), all on one stream. Host code of src/cuda/backend.cu:
 * only the runtime names of device.h. */
#ifndef AF_CUDA_ATTN_BWD_MMA_LAUNCH_CUH
#define AF_CUDA_ATTN_BWD_MMA_LAUNCH_CUH
#include <stddef.h>
#include <stdint.h>

#include "cuda/attn_bwd_mma.cuh"
#include "cuda/attn_mma_launch.cuh"
#include "cuda/kernels.h"
#include "sdpa/backward.h"

/* The kernels' shared memory at head-dim variant hd: dK/dV: K, V tiles of AF_BWD_BK rows, Q, dO of AF_BWD_BQ, two
 * row statistics; dQ: Q, dO of AF_BWD_ROWS, K, V of AF_BWD_BK, two row statistics. */
static size_t af_bwd_dkdv_smem(int hd) {
    return (size_t)(2 * AF_BWD_BK + 2 * AF_BWD_BQ) * (size_t)hd * 2 + 2 * AF_BWD_BQ * sizeof(float);
}
static size_t af_bwd_dq_smem(int hd) {
    return (size_t)(2 * AF_BWD_ROWS + 2 * AF_BWD_BK) * (size_t)hd * 2 + 2 * AF_BWD_ROWS * sizeof(float);
}

static int af_bwd_head_dim(const af_problem *p) { return (p->E > p->Ev ? p->E : p->Ev) <= 64 ? 64 : 128; }

const char *af_cuda_mma_backward_refusal(const af_problem *p, const af_cuda_device *dev) {
    if (p->dtype != AF_F16 && p->dtype != AF_BF16)
        return "query: the CUDA backward takes float16 and bfloat16 (the tensor cores); cast q, k, v, out and dout";
    if (p->kv_dtype != p->dtype || p->out_dtype != p->dtype)
        return "key: the CUDA backward needs q, k, v and out of one dtype";
    if (p->E > AF_BWD_HD_MAX || p->Ev > AF_BWD_HD_MAX)
        return "query: the CUDA backward takes head dims up to 128 (E and Ev)";
    if (p->page_table) return "page_table: paged K/V has no backward pass";
    if (p->Hq > AF_MMA_GRID_YZ_MAX || p->B > AF_MMA_GRID_YZ_MAX)
        return "query: the CUDA backward takes at most 65535 batches and heads";
    const size_t need = af_bwd_dq_smem(af_bwd_head_dim(p));
    if (need > af_mma_smem_optin(dev) || af_bwd_dkdv_smem(af_bwd_head_dim(p)) > af_mma_smem_optin(dev))
        return "query: the device's shared memory per block is too small for the CUDA backward at this head dim";
    return NULL;
}

cudaError_t af_cuda_mma_backward_workspace_bytes(const af_problem *p, size_t *bytes) {
    *bytes = (size_t)(p->B * p->Hq * p->L) * sizeof(float);   /* D */
    return cudaSuccess;
}

/* Rows of 16-byte aligned chunks: cp.async may copy them (attn_mma.cuh's rule for q/k/v). */
static int af_bwd_vec(const char *base, const int64_t *stride) {
    return stride[3] == 1 && stride[0] % 8 == 0 && stride[1] % 8 == 0 && stride[2] % 8 == 0 &&
           (uintptr_t)base % 16 == 0;
}

static void af_bwd_make_params(const af_backward_problem *bp, float *D, af_bwd_params *prm) {
    const af_problem *p = &bp->f;
    memset(prm, 0, sizeof *prm);
    prm->q = p->q;
    prm->k = p->k;
    prm->v = p->v;
    prm->out = p->out;
    prm->dout = bp->dout;
    prm->dq = bp->dq;
    prm->dk = bp->dk;
    prm->dv = bp->dv;
    for (int d = 0; d < 4; d++) {
        prm->q_stride[d] = p->q_stride[d];
        prm->k_stride[d] = p->k_stride[d];
        prm->v_stride[d] = p->v_stride[d];
        prm->out_stride[d] = p->out_stride[d];
        prm->dout_stride[d] = bp->dout_stride[d];
        prm->dq_stride[d] = bp->dq_stride[d];
        prm->dk_stride[d] = bp->dk_stride[d];
        prm->dv_stride[d] = bp->dv_stride[d];
        prm->mask_stride[d] = p->mask_stride[d];
    }
    prm->lse = p->lse;
    for (int d = 0; d < 3; d++) prm->lse_stride[d] = p->lse_stride[d];
    prm->D = D;
    prm->mask = p->mask;
    prm->mask_kind = !p->mask ? AF_MMA_MASK_NONE : p->mask_dtype == AF_BOOL ? AF_MMA_MASK_BOOL : AF_MMA_MASK_ADDITIVE;
    prm->causal = (int)p->causal;
    prm->has_window = p->has_window;
    prm->window_left = p->window_left;
    prm->window_right = p->window_right;
    prm->softcap_on = p->softcap > 0.0;
    prm->softcap_log2 = (float)(p->softcap * 1.4426950408889634);
    prm->scale_over_cap = p->softcap > 0.0 ? (float)(p->scale / p->softcap) : 0.0f;
    prm->scale_log2 = (float)(p->scale * 1.4426950408889634);
    prm->scale = (float)p->scale;
    prm->sink = p->sink;
    prm->sink_dtype = (int)p->sink_dtype;
    prm->sink_stride = p->sink_stride;
    prm->dsink = bp->dsink;
    prm->dsink_stride = bp->dsink_stride;
    prm->cu_seqlens_q = p->cu_seqlens_q;
    prm->cu_seqlens_k = p->cu_seqlens_k;
    prm->seqused_k = p->seqused_k;
    prm->cu_seqlens_q_stride = p->cu_seqlens_q_stride;
    prm->cu_seqlens_k_stride = p->cu_seqlens_k_stride;
    prm->seqused_stride = p->seqused_k_stride;
    prm->total_q = p->total_q;
    prm->total_k = p->total_k;
    prm->E = (int)p->E;
    prm->Ev = (int)p->Ev;
    prm->B = p->B;
    prm->Hq = p->Hq;
    prm->Hkv = p->Hkv;
    prm->L = p->L;
    prm->S = p->S;
    prm->group = p->group;
    prm->vec_q = af_bwd_vec(p->q, p->q_stride);
    prm->vec_k = af_bwd_vec(p->k, p->k_stride);
    prm->vec_v = af_bwd_vec(p->v, p->v_stride);
    prm->vec_dout = af_bwd_vec(bp->dout, bp->dout_stride);
    prm->bf16 = p->dtype == AF_BF16;
}

/* Zeros over (n0, n1, n2, n3) of a gradient view: the rows the other kernels do not write. */
static cudaError_t af_bwd_zero_view(char *data, const int64_t *stride, int64_t n0, int64_t n1, int64_t n2, int64_t n3,
                                    cudaStream_t stream) {
    if (!data || n0 * n1 * n2 * n3 == 0) return cudaSuccess;
    af_bwd_zero_params z;
    z.data = data;
    z.n[0] = n0;
    z.n[1] = n1;
    z.n[2] = n2;
    z.n[3] = n3;
    for (int d = 0; d < 4; d++) z.stride[d] = stride[d];
    int64_t blocks = (n0 * n1 * n2 * n3 + AF_MMA_THREADS - 1) / AF_MMA_THREADS;
    if (blocks > 4096) blocks = 4096;
    return AF_LAUNCH(af_bwd_zero, blocks, 1, 1, AF_MMA_THREADS, 0, stream, z);
}

#define AF_BWD_LAUNCH(name, gx, gy, gz, smem)                                                                 \
    do {                                                                                                      \
        if ((smem) > AF_MMA_DEFAULT_SMEM && (e = AF_SET_MAX_SMEM(name, (smem))) != cudaSuccess) return e;     \
        if ((e = AF_LAUNCH(name, (gx), (gy), (gz), AF_MMA_THREADS, (smem), stream, prm)) != cudaSuccess)      \
            return e;                                                                                         \
    } while (0)

cudaError_t af_cuda_mma_backward(const af_backward_problem *bp, const af_cuda_device *dev, void *workspace,
                                 size_t workspace_bytes, cudaStream_t stream) {
    const af_problem *p = &bp->f;
    if (af_cuda_mma_backward_refusal(p, dev)) return cudaErrorInvalidValue;
    size_t need = 0;
    af_cuda_mma_backward_workspace_bytes(p, &need);
    if (need > 0 && (!workspace || workspace_bytes < need)) return cudaErrorInvalidValue;
    af_bwd_params prm;
    af_bwd_make_params(bp, (float *)workspace, &prm);
    const int hd = af_bwd_head_dim(p), bf16 = prm.bf16;
    cudaError_t e;
    /* the rows no sequence covers: packed tensors' gaps and keys past seqused_k */
    if (p->cu_seqlens_q && (e = af_bwd_zero_view(bp->dq, bp->dq_stride, 1, p->Hq, p->total_q, p->E, stream)) !=
                               cudaSuccess)
        return e;
    if (p->cu_seqlens_k || p->seqused_k) {
        const int64_t n0 = p->cu_seqlens_k ? 1 : p->B, rows = p->cu_seqlens_k ? p->total_k : p->S;
        if ((e = af_bwd_zero_view(bp->dk, bp->dk_stride, n0, p->Hkv, rows, p->E, stream)) != cudaSuccess ||
            (e = af_bwd_zero_view(bp->dv, bp->dv_stride, n0, p->Hkv, rows, p->Ev, stream)) != cudaSuccess)
            return e;
    }
    const int64_t rows = p->B * p->Hq * p->L;
    if (rows > 0 && (e = AF_LAUNCH(af_bwd_dot, (rows + AF_MMA_WARPS - 1) / AF_MMA_WARPS, 1, 1, AF_MMA_THREADS, 0,
                                   stream, prm)) != cudaSuccess)
        return e;
    if (bp->dsink && p->Hq > 0 && (e = AF_LAUNCH(af_bwd_dsink, p->Hq, 1, 1, 32, 0, stream, prm)) != cudaSuccess)
        return e;   /* after D; with no row at all it writes -0 */
    if (p->B == 0 || p->Hkv == 0) return cudaSuccess;
    const size_t kv_smem = af_bwd_dkdv_smem(hd), q_smem = af_bwd_dq_smem(hd);
    const int64_t key_tiles = (p->S + AF_BWD_BK - 1) / AF_BWD_BK, row_blocks = (p->L + AF_BWD_ROWS - 1) / AF_BWD_ROWS;
    if ((bp->dk || bp->dv) && key_tiles > 0) {
        if (hd == 64 && bf16) AF_BWD_LAUNCH(af_bwd_dkdv_bf16_hd64, key_tiles, p->Hkv, p->B, kv_smem);
        else if (hd == 64) AF_BWD_LAUNCH(af_bwd_dkdv_f16_hd64, key_tiles, p->Hkv, p->B, kv_smem);
        else if (bf16) AF_BWD_LAUNCH(af_bwd_dkdv_bf16_hd128, key_tiles, p->Hkv, p->B, kv_smem);
        else AF_BWD_LAUNCH(af_bwd_dkdv_f16_hd128, key_tiles, p->Hkv, p->B, kv_smem);
    }
    if (bp->dq && row_blocks > 0) {
        if (hd == 64 && bf16) AF_BWD_LAUNCH(af_bwd_dq_bf16_hd64, row_blocks, p->Hq, p->B, q_smem);
        else if (hd == 64) AF_BWD_LAUNCH(af_bwd_dq_f16_hd64, row_blocks, p->Hq, p->B, q_smem);
        else if (bf16) AF_BWD_LAUNCH(af_bwd_dq_bf16_hd128, row_blocks, p->Hq, p->B, q_smem);
        else AF_BWD_LAUNCH(af_bwd_dq_f16_hd128, row_blocks, p->Hq, p->B, q_smem);
    }
    return cudaSuccess;
}

#endif
