/* Host side of the tensor-core path: the head-dim variant, the shared-memory buffering, the grid, the split-KV
 * count (and its workspace), the launches of attn_mma.cuh's kernel and attn_combine.cuh's merge. Host code of
 * src/cuda/backend.cu: only the runtime names of device.h. */
#ifndef AF_CUDA_ATTN_MMA_LAUNCH_CUH
#define AF_CUDA_ATTN_MMA_LAUNCH_CUH
#include <stddef.h>
#include <stdint.h>

#include "cuda/attn_combine.cuh"
#include "cuda/attn_mma.cuh"
#include "cuda/kernels.h"

#define AF_MMA_DEFAULT_SMEM (48 * 1024)        /* dynamic shared memory every device allows without opting in */
#define AF_MMA_SPLITS_MAX 128                  /* split-KV: at most this many key ranges per row block */
#ifndef AF_MMA_GRID_YZ_MAX                     /* a test lowers it to exercise the fold into x */
#define AF_MMA_GRID_YZ_MAX 65535               /* CUDA's limit on grid y and z */
#endif
#define AF_MMA_GRID_X_MAX 0x7fffffffLL         /* and on grid x */
#define AF_MMA_WORKSPACE_ALIGN 256
#ifndef AF_MMA_NOTE_OCCUPANCY   /* backend.cu logs it: (kernel name, device, CTAs per SM, smem, threads) */
#define AF_MMA_NOTE_OCCUPANCY(kernel, device, ctas, smem, threads) ((void)0)
#endif

typedef struct {
    int hd, double_buffer, rt;                 /* rt: row tiles of 16 rows a warp (attn_mma.cuh) */
    size_t smem;
    int ctas_per_sm;                           /* the variant's occupancy: what one wave holds per multiprocessor */
    int64_t row_blocks, heads, tiles, tiles_per_split, splits;
    int64_t grid_x, grid_y;
    size_t lse_bytes, workspace;               /* split-KV partials: the LSEs, then (aligned) the O rows */
} af_mma_plan;

/* The dynamic shared memory a block of `dev` may opt in to. */
static size_t af_mma_smem_optin(const af_cuda_device *dev) {
    return dev->max_smem_per_block > 0 ? (size_t)dev->max_smem_per_block : AF_MMA_DEFAULT_SMEM;
}

/* The head-dim variant: max(E, Ev) rounded up to 64, 128 or 256. */
static int af_mma_head_dim(const af_problem *p) {
    const int64_t e = p->E > p->Ev ? p->E : p->Ev;
    return e <= 64 ? 64 : e <= 128 ? 128 : 256;
}

/* How many key ranges to split each row block's keys into, in the spirit of FlashAttention-2's heuristic: none
 * when the CTAs already fill 80% of a wave; else, among the counts that change the tiles per split, the smallest
 * whose wave efficiency (waves / whole waves) is within 85% of the best, so every multiprocessor gets work. */
static int64_t af_mma_split_count(int64_t ctas, int64_t tiles, int sm_count, int ctas_per_sm) {
    const int64_t slots = (int64_t)(sm_count > 0 ? sm_count : 1) * (ctas_per_sm > 0 ? ctas_per_sm : 1);
    if (tiles < 2 || ctas * 5 >= slots * 4) return 1;
    const int64_t most = tiles < AF_MMA_SPLITS_MAX ? tiles : AF_MMA_SPLITS_MAX;
    double efficiency[AF_MMA_SPLITS_MAX + 1], best = 0.0;
    for (int64_t s = 1; s <= most; s++) {
        const double waves = (double)(ctas * s) / (double)slots;
        const double whole = (double)((ctas * s + slots - 1) / slots);
        efficiency[s] = waves / whole;
        if (efficiency[s] > best) best = efficiency[s];
    }
    for (int64_t s = 1; s <= most; s++) {
        const int same_tiles = s > 1 && (tiles + s - 1) / s == (tiles + s - 2) / (s - 1);
        if (!same_tiles && efficiency[s] >= 0.85 * best) return s;
    }
    return 1;
}

/* The kernel of a (head dim, row tiles, float8, bf16) variant handed to ACTION (a macro taking the kernel's name,
 * which returns): one switch for the occupancy query and the launch. */
#define AF_MMA_WITH_VARIANT(plan, bf16, f8, ACTION)                                                           \
    switch ((plan)->hd * 16 + ((plan)->rt == 2) * 4 + (f8) * 2 + (bf16)) {                                   \
    case 64 * 16 + 4: ACTION(af_mma_f16_hd64);                                                                \
    case 128 * 16 + 4: ACTION(af_mma_f16_hd128);                                                              \
    case 64 * 16 + 5: ACTION(af_mma_bf16_hd64);                                                               \
    case 128 * 16 + 5: ACTION(af_mma_bf16_hd128);                                                             \
    case 64 * 16: ACTION(af_mma_f16_hd64_w16);                                                                \
    case 128 * 16: ACTION(af_mma_f16_hd128_w16);                                                              \
    case 256 * 16: ACTION(af_mma_f16_hd256);                                                                  \
    case 64 * 16 + 1: ACTION(af_mma_bf16_hd64_w16);                                                           \
    case 128 * 16 + 1: ACTION(af_mma_bf16_hd128_w16);                                                         \
    case 256 * 16 + 1: ACTION(af_mma_bf16_hd256);                                                             \
    case 64 * 16 + 2: ACTION(af_mma_f16_f8_hd64);                                                             \
    case 128 * 16 + 2: ACTION(af_mma_f16_f8_hd128);                                                           \
    case 256 * 16 + 2: ACTION(af_mma_f16_f8_hd256);                                                           \
    case 64 * 16 + 3: ACTION(af_mma_bf16_f8_hd64);                                                            \
    case 128 * 16 + 3: ACTION(af_mma_bf16_f8_hd128);                                                          \
    default: ACTION(af_mma_bf16_f8_hd256);                                                                    \
    }

/* Opts the variant in to its shared memory (above 48 KiB), then asks how many of its CTAs one multiprocessor holds:
 * registers, shared memory and threads as the compiler and the device have them, not a guess per variant. */
#define AF_MMA_OCCUPANCY_OF(name)                                                                             \
    do {                                                                                                      \
        *kernel = #name;                                                                                      \
        if (plan->smem > AF_MMA_DEFAULT_SMEM && (e = AF_SET_MAX_SMEM(name, plan->smem)) != cudaSuccess)      \
            return e;                                                                                         \
        return AF_OCCUPANCY(name, AF_MMA_THREADS, plan->smem, ctas);                                         \
    } while (0)

static cudaError_t af_mma_query_occupancy(const af_mma_plan *plan, int bf16, int f8, int *ctas, const char **kernel) {
    cudaError_t e;
    AF_MMA_WITH_VARIANT(plan, bf16, f8, AF_MMA_OCCUPANCY_OF);
}

/* Occupancy per (device, variant), asked once: the same answer for the workspace's size and the launch. */
#define AF_MMA_OCCUPANCY_DEVICES 64
#define AF_MMA_OCCUPANCY_KEYS (4 * 2 * 2 * 2)  /* head dim (64/128/256) x rt x float8 x bf16 */
static int af_mma_occupancy_cache[AF_MMA_OCCUPANCY_DEVICES][AF_MMA_OCCUPANCY_KEYS];

static cudaError_t af_mma_ctas_per_sm(const af_mma_plan *plan, const af_cuda_device *dev, int bf16, int f8,
                                      int *ctas) {
    const int key = (plan->hd / 64 - (plan->hd == 256)) * 8 + (plan->rt == 2) * 4 + f8 * 2 + bf16;
    const int cacheable = dev->ordinal >= 0 && dev->ordinal < AF_MMA_OCCUPANCY_DEVICES;
    int *slot = cacheable ? &af_mma_occupancy_cache[dev->ordinal][key] : NULL;
    if (slot && (*ctas = __atomic_load_n(slot, __ATOMIC_RELAXED)) > 0) return cudaSuccess;
    const char *kernel = "";
    const cudaError_t e = af_mma_query_occupancy(plan, bf16, f8, ctas, &kernel);
    if (e != cudaSuccess) return e;
    if (*ctas < 1) return cudaErrorInvalidConfiguration;   /* the variant does not fit a multiprocessor at all */
    if (slot && __atomic_exchange_n(slot, *ctas, __ATOMIC_RELAXED) == 0)
        AF_MMA_NOTE_OCCUPANCY(kernel, dev->ordinal, *ctas, plan->smem, AF_MMA_THREADS);
    return cudaSuccess;
}

/* float8 K/V (e4m3fn, e5m2): the float8 variants, which need the double-buffered layout. */
static int af_mma_is_float8(af_dtype d) { return d == AF_F8E4M3 || d == AF_F8E5M2; }
static int af_mma_kv_float8(const af_problem *p) { return af_mma_is_float8(p->kv_dtype); }

/* The products' 16-bit type: q's, or out's when q is float8 too. */
static int af_mma_bf16(const af_problem *p) {
    return (af_mma_is_float8(p->dtype) ? p->out_dtype : p->dtype) == AF_BF16;
}

/* 32 rows a warp (128-row blocks) for 16-bit head dims up to 128 with more than 64 packed rows per (batch, kv
 * head), where the device's shared memory holds them double-buffered. Decode's few rows keep 64-row blocks; float8,
 * head dim 256 and a mask tensor (af_sdpa's bool/additive masks: its loads, in flight beside 192 accumulators,
 * would spill) their 16 rows a warp. */
static int af_mma_row_tiles(const af_problem *p, int hd, size_t optin) {
    return !af_mma_kv_float8(p) && !p->mask && hd <= 128 && p->group * p->L > AF_MMA_BLOCK_ROWS(1) &&
                   af_mma_smem_bytes(hd, 1, 2) <= optin ? 2 : 1;
}

static cudaError_t af_mma_make_plan(const af_problem *p, const af_cuda_device *dev, af_mma_plan *plan) {
    const size_t optin = af_mma_smem_optin(dev);
    plan->hd = af_mma_head_dim(p);
    plan->rt = af_mma_row_tiles(p, plan->hd, optin);
    plan->double_buffer = af_mma_smem_bytes(plan->hd, 1, plan->rt) <= optin;
    plan->smem = af_mma_smem_bytes(plan->hd, plan->double_buffer, plan->rt);
    if (plan->smem > optin) return cudaErrorInvalidConfiguration;
    const cudaError_t e = af_mma_ctas_per_sm(plan, dev, af_mma_bf16(p), af_mma_kv_float8(p), &plan->ctas_per_sm);
    if (e != cudaSuccess) return e;
    plan->row_blocks = (p->group * p->L + AF_MMA_BLOCK_ROWS(plan->rt) - 1) / AF_MMA_BLOCK_ROWS(plan->rt);
    plan->heads = p->B * p->Hkv;
    plan->tiles = (p->S + AF_MMA_BC - 1) / AF_MMA_BC;
    const int64_t requested =
        af_mma_split_count(plan->row_blocks * plan->heads, plan->tiles, dev->sm_count, plan->ctas_per_sm);
    plan->tiles_per_split = requested > 1 ? (plan->tiles + requested - 1) / requested : plan->tiles;
    plan->splits = requested > 1 ? (plan->tiles + plan->tiles_per_split - 1) / plan->tiles_per_split : 1;
    if (plan->tiles_per_split < 1) plan->tiles_per_split = 1;   /* S = 0: no tile at all */
    plan->grid_y = plan->heads < AF_MMA_GRID_YZ_MAX ? plan->heads : AF_MMA_GRID_YZ_MAX;
    plan->grid_x = plan->row_blocks * ((plan->heads + plan->grid_y - 1) / plan->grid_y);   /* y folded into x */
    plan->lse_bytes = plan->workspace = 0;
    if (plan->splits > 1) {
        const size_t rows = (size_t)(p->B * p->Hq * p->L) * (size_t)plan->splits;
        plan->lse_bytes = (rows * sizeof(float) + AF_MMA_WORKSPACE_ALIGN - 1) / AF_MMA_WORKSPACE_ALIGN *
                          AF_MMA_WORKSPACE_ALIGN;
        plan->workspace = plan->lse_bytes + rows * (size_t)p->Ev * sizeof(float);
    }
    return plan->grid_x > AF_MMA_GRID_X_MAX ? cudaErrorInvalidConfiguration : cudaSuccess;
}

cudaError_t af_cuda_mma_workspace_bytes(const af_problem *p, const af_cuda_device *dev, size_t *bytes) {
    *bytes = 0;
    if (p->B == 0 || p->Hq == 0 || p->L == 0) return cudaSuccess;
    af_mma_plan plan;
    const cudaError_t e = af_mma_make_plan(p, dev, &plan);
    if (e == cudaSuccess) *bytes = plan.workspace;
    return e;
}

/* The kernel of one variant: opt in to its shared memory (above 48 KiB; again, since the occupancy is asked once),
 * then launch. */
#define AF_MMA_LAUNCH_VARIANT(name)                                                                           \
    do {                                                                                                      \
        if (plan->smem > AF_MMA_DEFAULT_SMEM && (e = AF_SET_MAX_SMEM(name, plan->smem)) != cudaSuccess)      \
            return e;                                                                                         \
        return AF_LAUNCH(name, plan->grid_x, plan->grid_y, plan->splits, AF_MMA_THREADS, plan->smem, stream, \
                         *prm);                                                                               \
    } while (0)

static cudaError_t af_mma_launch(const af_mma_plan *plan, int bf16, int f8, const af_mma_params *prm,
                                 cudaStream_t stream) {
    cudaError_t e;
    AF_MMA_WITH_VARIANT(plan, bf16, f8, AF_MMA_LAUNCH_VARIANT);
}

int af_cuda_mma_fits_int32(const af_problem *p) {
    const int64_t limit = (int64_t)1 << 30;
    return p->group * p->L < limit && p->S < limit && (!p->page_table || p->page_size < limit) &&
           p->B * p->Hkv < limit;
}

int af_cuda_mma_accepts_float8(const af_problem *p, const af_cuda_device *dev) {
    const size_t optin = af_mma_smem_optin(dev);
    const int half_q = p->dtype == AF_F16 || p->dtype == AF_BF16;
    const int float8_q = af_mma_is_float8(p->dtype) && (p->out_dtype == AF_F16 || p->out_dtype == AF_BF16);
    return (half_q || float8_q) && af_mma_kv_float8(p) && p->E <= AF_MMA_HD_MAX && p->Ev <= AF_MMA_HD_MAX &&
           af_mma_smem_bytes(af_mma_head_dim(p), 1, 1) <= optin;
}

/* The split-KV merge of the `splits` partials the attention kernel wrote (prm's part_o / part_lse) into out/lse. */
static cudaError_t af_mma_combine(const af_problem *p, const af_mma_params *prm, int64_t splits, int bf16,
                                  cudaStream_t stream) {
    af_combine_params cp;
    cp.part_o = prm->part_o;
    cp.part_lse = prm->part_lse;
    cp.splits = (int)splits;
    cp.Ev = (int)p->Ev;
    cp.bf16 = bf16;
    cp.total_rows = prm->total_rows;
    cp.Hkv = p->Hkv;
    cp.group = p->group;
    cp.rows = p->group * p->L;
    cp.L = p->L;
    cp.total_q = p->total_q;
    cp.cu_seqlens_q = p->cu_seqlens_q;
    cp.cu_seqlens_q_stride = p->cu_seqlens_q_stride;
    cp.out = p->out;
    cp.lse = p->lse;
    for (int d = 0; d < 4; d++) cp.out_stride[d] = p->out_stride[d];
    for (int d = 0; d < 3; d++) cp.lse_stride[d] = p->lse_stride[d];
    cp.sink = p->sink;
    cp.sink_dtype = (int)p->sink_dtype;
    cp.sink_stride = p->sink_stride;
    const int64_t blocks = (prm->total_rows + AF_COMBINE_WARPS - 1) / AF_COMBINE_WARPS;
    if (blocks > AF_MMA_GRID_X_MAX) return cudaErrorInvalidConfiguration;
    return AF_LAUNCH(af_combine_kernel, blocks, 1, 1, AF_COMBINE_THREADS, 0, stream, cp);
}

/* The kernel's parameters that follow from the problem alone (the plan's: row blocks, splits, buffers, partials). */
static void af_mma_problem_params(const af_problem *p, af_mma_params *prm) {
    prm->q = p->q;
    prm->k = p->k;
    prm->v = p->v;
    prm->out = p->out;
    prm->lse = p->lse;
    prm->mask = p->mask;
    for (int d = 0; d < 4; d++) {
        prm->q_stride[d] = p->q_stride[d];
        prm->k_stride[d] = p->k_stride[d];
        prm->v_stride[d] = p->v_stride[d];
        prm->out_stride[d] = p->out_stride[d];
        prm->mask_stride[d] = p->mask_stride[d];
    }
    for (int d = 0; d < 3; d++) prm->lse_stride[d] = p->lse_stride[d];
    prm->mask_kind = !p->mask ? AF_MMA_MASK_NONE : p->mask_dtype == AF_BOOL ? AF_MMA_MASK_BOOL : AF_MMA_MASK_ADDITIVE;
    prm->causal = (int)p->causal;
    prm->has_window = p->has_window;
    prm->window_left = p->window_left;
    prm->window_right = p->window_right;
    prm->softcap_on = p->softcap > 0.0;
    prm->softcap_log2 = (float)(p->softcap * 1.4426950408889634);
    prm->scale_over_cap = p->softcap > 0.0 ? (float)(p->scale / p->softcap) : 0.0f;
    prm->sink = p->sink;
    prm->sink_dtype = (int)p->sink_dtype;
    prm->sink_stride = p->sink_stride;
    prm->seqused_k = p->seqused_k;
    prm->seqused_stride = p->seqused_k_stride;
    prm->cu_seqlens_q = p->cu_seqlens_q;
    prm->cu_seqlens_k = p->cu_seqlens_k;
    prm->cu_seqlens_q_stride = p->cu_seqlens_q_stride;
    prm->cu_seqlens_k_stride = p->cu_seqlens_k_stride;
    prm->total_q = p->total_q;
    prm->total_k = p->total_k;
    prm->num_pages = p->num_pages;
    prm->page_table = p->page_table;
    prm->page_table_stride[0] = p->page_table_stride[0];
    prm->page_table_stride[1] = p->page_table_stride[1];
    prm->page_size = p->page_size;
    prm->E = (int)p->E;
    prm->Ev = (int)p->Ev;
    prm->out_pairs = p->out_stride[3] == 1 && (uintptr_t)p->out % 4 == 0 && p->out_stride[0] % 2 == 0 &&
                    p->out_stride[1] % 2 == 0 && p->out_stride[2] % 2 == 0;
    prm->Hkv = p->Hkv;
    prm->L = p->L;
    prm->S = p->S;
    prm->group = p->group;
    prm->rows = p->group * p->L;
    prm->scale_log2 = (float)(p->scale * 1.4426950408889634);
    prm->total_rows = p->B * p->Hq * p->L;
    prm->kv_dtype = (int)p->kv_dtype;
    prm->q_float8 = af_mma_is_float8(p->dtype) ? (int)p->dtype : 0;
    prm->q_descale = p->q_descale;
    prm->k_descale = p->k_descale;
    prm->v_descale = p->v_descale;
    for (int d = 0; d < 2; d++) {
        prm->q_descale_stride[d] = p->q_descale_stride[d];
        prm->k_descale_stride[d] = p->k_descale_stride[d];
        prm->v_descale_stride[d] = p->v_descale_stride[d];
    }

}

cudaError_t af_cuda_mma_forward(const af_problem *p, const af_cuda_device *dev, void *workspace,
                                size_t workspace_bytes, cudaStream_t stream) {
    if (p->B == 0 || p->Hq == 0 || p->L == 0) return cudaSuccess;   /* no query row */
    if (!af_cuda_mma_fits_int32(p)) return cudaErrorInvalidValue;
    const int f8 = af_mma_kv_float8(p);
    if (f8 ? !af_cuda_mma_accepts_float8(p, dev)
           : (p->dtype != AF_F16 && p->dtype != AF_BF16) || p->kv_dtype != p->dtype || p->E > AF_MMA_HD_MAX ||
                 p->Ev > AF_MMA_HD_MAX)
        return cudaErrorInvalidValue;
    af_mma_plan plan;
    const cudaError_t planned = af_mma_make_plan(p, dev, &plan);
    if (planned != cudaSuccess) return planned;
    if (plan.workspace > 0 && (!workspace || workspace_bytes < plan.workspace)) return cudaErrorInvalidValue;
    const int bf16 = af_mma_bf16(p);

    af_mma_params prm;
    af_mma_problem_params(p, &prm);
    prm.double_buffer = plan.double_buffer;
    prm.row_blocks = plan.row_blocks;
    prm.heads = plan.heads;
    prm.tiles_per_split = plan.tiles_per_split;
    prm.part_lse = plan.splits > 1 ? (float *)workspace : NULL;
    prm.part_o = plan.splits > 1 ? (float *)((char *)workspace + plan.lse_bytes) : NULL;

    cudaError_t e = af_mma_launch(&plan, bf16, f8, &prm, stream);
    if (e != cudaSuccess || plan.splits == 1) return e;

    return af_mma_combine(p, &prm, plan.splits, bf16, stream);
}

#endif
