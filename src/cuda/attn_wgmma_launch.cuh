/* Host side of the Hopper path: which problems attn_wgmma.cuh's kernel takes, its plan (head-dim variant, grid,
 * occupancy, split-KV count and workspace), K's and V's tensor maps, the launch and attn_combine.cuh's merge. Host
 * code of src/cuda/backend.cu, beside attn_mma_launch.cuh (whose plan pieces and parameters it reuses). */
#ifndef AF_CUDA_ATTN_WGMMA_LAUNCH_CUH
#define AF_CUDA_ATTN_WGMMA_LAUNCH_CUH
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cuda/attn_mma_launch.cuh"
#include "cuda/attn_wgmma.cuh"
#include "cuda/kernels.h"

typedef struct {
    int hd;                                    /* 64, 128 or 256 */
    int bc;                                    /* keys per tile (AF_WG_BC_OF(hd)) */
    size_t smem;
    int ctas_per_sm;
    int64_t row_blocks, heads, tiles, tiles_per_split, splits;
    af_wgmma_sched sched;                      /* the work items */
    int64_t items, grid_x;                     /* grid_x: min(items, the CTAs resident at once) where the kernel
                                                  walks items (AF_WG_PERSISTENT, unpaged), else the items */
    size_t lse_bytes, workspace;
} af_wgmma_plan;

/* The kernel of a (head dim, dtype) variant handed to ACTION (a macro taking the kernel's name, which returns). */
#define AF_WGMMA_WITH_VARIANT(hd, bf16, ACTION)          \
    switch ((hd) * 2 + (bf16)) {                          \
    case 64 * 2: ACTION(af_wgmma_f16_hd64);               \
    case 128 * 2: ACTION(af_wgmma_f16_hd128);             \
    case 256 * 2: ACTION(af_wgmma_f16_hd256);             \
    case 64 * 2 + 1: ACTION(af_wgmma_bf16_hd64);          \
    case 256 * 2 + 1: ACTION(af_wgmma_bf16_hd256);        \
    default: ACTION(af_wgmma_bf16_hd128);                 \
    }

#define AF_WGMMA_OCCUPANCY_OF(name)                                                                          \
    do {                                                                                                     \
        *kernel = #name;                                                                                     \
        if ((e = AF_SET_MAX_SMEM(name, smem)) != cudaSuccess) return e;                                     \
        return AF_OCCUPANCY(name, AF_WG_THREADS, smem, ctas);                                               \
    } while (0)

static cudaError_t af_wgmma_query_occupancy(int hd, int bf16, size_t smem, int *ctas, const char **kernel) {
    cudaError_t e;
    AF_WGMMA_WITH_VARIANT(hd, bf16, AF_WGMMA_OCCUPANCY_OF);
}

/* Occupancy per (device, variant), asked once (the workspace's size and the launch must agree). */
static int af_wgmma_occupancy_cache[AF_MMA_OCCUPANCY_DEVICES][6];

static cudaError_t af_wgmma_ctas_per_sm(const af_cuda_device *dev, int hd, int bf16, size_t smem, int *ctas) {
    const int cacheable = dev->ordinal >= 0 && dev->ordinal < AF_MMA_OCCUPANCY_DEVICES;
    int *slot = cacheable ? &af_wgmma_occupancy_cache[dev->ordinal][(hd / 128) * 2 + bf16] : NULL;
    if (slot && (*ctas = __atomic_load_n(slot, __ATOMIC_RELAXED)) > 0) return cudaSuccess;
    const char *kernel = "";
    const cudaError_t e = af_wgmma_query_occupancy(hd, bf16, smem, ctas, &kernel);
    if (e != cudaSuccess) return e;
    if (*ctas < 1) return cudaErrorInvalidConfiguration;
    if (slot && __atomic_exchange_n(slot, *ctas, __ATOMIC_RELAXED) == 0)
        AF_MMA_NOTE_OCCUPANCY(kernel, dev->ordinal, *ctas, smem, AF_WG_THREADS);
    return cudaSuccess;
}

static int64_t af_wgmma_gcd(int64_t a, int64_t b) { return b ? af_wgmma_gcd(b, a % b) : a; }

/* Keys a TMA box of a paged cache holds for tiles of bc keys: their greatest common divisor, so that every box of a
 * tile lies inside one page (a tile inside a page when the page is a multiple of bc; a box a page when it divides
 * bc; else bc / gcd boxes, each in its page: 128-key tiles over pages of 48 or 96, 64-key ones over 48 or 80). */
static int64_t af_wgmma_page_box(int64_t page_size, int64_t bc) { return af_wgmma_gcd(page_size, bc); }

/* Pages TMA can box: boxes of 16 keys or more (at most 8 a tile), or pages of 8 that divide bc; 8-row multiples
 * keep each box on the swizzle's 1024-byte pattern. Others (1..7, 12, 24 or 200 keys at bc 128) are gathered. */
static int af_wgmma_tma_pages(int64_t page_size, int64_t bc) {
    const int64_t box = af_wgmma_page_box(page_size, bc);
    return box % 8 == 0 && (box >= 16 || page_size == 8);
}

/* A paged cache the kernel can read: any page size (TMA boxes or the gathered path), its table indexed in 32 bits. */
static int af_wgmma_pages_fit(const af_problem *p) {
    const int64_t slots = p->page_size > 0 ? (p->S + p->page_size - 1) / p->page_size : 0;
    return !p->page_table || (p->page_size >= 1 && p->page_table_stride[1] >= 0 &&
                              p->page_table_stride[1] * slots < ((int64_t)1 << 30));
}

/* The gathered path (attn_wgmma_gather.cuh): a paged cache whose pages TMA cannot box, copied by warpgroup 0 with
 * cp.async; no tensor map. It zero-fills keys past the sequence and reads no row past one. */
static int af_wgmma_gathered(const af_problem *p) {
    return p->page_table && !af_wgmma_tma_pages(p->page_size, AF_WG_BC_OF(af_mma_head_dim(p)));
}

int af_cuda_wgmma_accepts(const af_problem *p, const af_cuda_device *dev) {
    const int hd = af_mma_head_dim(p);
    return dev->cc_major == 9 && dev->cc_minor == 0 && (p->dtype == AF_F16 || p->dtype == AF_BF16) &&
           p->kv_dtype == p->dtype && af_wgmma_pages_fit(p) && p->E >= 1 && p->E <= AF_WG_HD_MAX && p->Ev >= 1 &&
           p->Ev <= AF_WG_HD_MAX &&
           (p->page_table ? p->num_pages >= 1 : (p->cu_seqlens_k ? p->total_k : p->S) >= 1) &&   /* maps: not empty */
           p->group * p->L > AF_MMA_BLOCK_ROWS(1) && af_cuda_mma_fits_int32(p) &&
           af_wgmma_smem_bytes(hd, AF_WG_STAGES_OF(hd, af_wgmma_gathered(p))) <= af_mma_smem_optin(dev);
}

static cudaError_t af_wgmma_make_plan(const af_problem *p, const af_cuda_device *dev, af_wgmma_plan *plan) {
    plan->hd = af_mma_head_dim(p);
    plan->bc = AF_WG_BC_OF(plan->hd);
    plan->smem = af_wgmma_smem_bytes(plan->hd, AF_WG_STAGES_OF(plan->hd, af_wgmma_gathered(p)));
    const cudaError_t e = af_wgmma_ctas_per_sm(dev, plan->hd, p->dtype == AF_BF16, plan->smem, &plan->ctas_per_sm);
    if (e != cudaSuccess) return e;
    plan->row_blocks = (p->group * p->L + AF_WG_ROWS - 1) / AF_WG_ROWS;
    plan->heads = p->B * p->Hkv;
    plan->tiles = (p->S + plan->bc - 1) / plan->bc;
    const int64_t requested =
        af_mma_split_count(plan->row_blocks * plan->heads, plan->tiles, dev->sm_count, plan->ctas_per_sm);
    plan->tiles_per_split = requested > 1 ? (plan->tiles + requested - 1) / requested : plan->tiles;
    plan->splits = requested > 1 ? (plan->tiles + plan->tiles_per_split - 1) / plan->tiles_per_split : 1;
    if (plan->tiles_per_split < 1) plan->tiles_per_split = 1;   /* S = 0: no tile at all */
    plan->sched.row_blocks = plan->row_blocks, plan->sched.heads = plan->heads, plan->sched.splits = plan->splits;
    plan->sched.heaviest_first = p->causal != AF_CAUSAL_NONE || p->has_window;
    plan->items = af_wgmma_sched_items(&plan->sched);
    const int64_t most = AF_MMA_GRID_X_MAX / 2;   /* an item index plus the grid stays in 32 bits */
    plan->sched.items = plan->items <= most ? (int)plan->items : 0;   /* refused below when past */
    /* one wave of persistent CTAs (each item's prologue and epilogue under another's loads); head dim 256 and a paged
     * cache (whose pages each CTA checks before reading any) one item a CTA */
    const int64_t resident = (int64_t)(dev->sm_count > 0 ? dev->sm_count : 1) * plan->ctas_per_sm;
    plan->grid_x = p->page_table || !AF_WG_PERSISTENT(plan->hd) || plan->items < resident ? plan->items : resident;
    plan->lse_bytes = plan->workspace = 0;
    if (plan->splits > 1) {
        const size_t rows = (size_t)(p->B * p->Hq * p->L) * (size_t)plan->splits;
        plan->lse_bytes = (rows * sizeof(float) + AF_MMA_WORKSPACE_ALIGN - 1) / AF_MMA_WORKSPACE_ALIGN *
                          AF_MMA_WORKSPACE_ALIGN;
        plan->workspace = plan->lse_bytes + rows * (size_t)p->Ev * sizeof(float);
    }
    return plan->items > most ? cudaErrorInvalidConfiguration : cudaSuccess;
}

cudaError_t af_cuda_wgmma_workspace_bytes(const af_problem *p, const af_cuda_device *dev, size_t *bytes) {
    *bytes = 0;
    if (p->B == 0 || p->Hq == 0 || p->L == 0) return cudaSuccess;
    af_wgmma_plan plan;
    const cudaError_t e = af_wgmma_make_plan(p, dev, &plan);
    if (e == cudaSuccess) *bytes = plan.workspace;
    return e;
}

/* A stride for a dimension of TMA's view: the tensor's own, or for a dimension of size 1 (whose stride nothing
 * reads, and may be 0 in a packed varlen tensor) the extent of the dimensions inside it. */
static uint64_t af_wgmma_stride(int64_t elements, uint64_t size, uint64_t inner_bytes) {
    return size > 1 ? (uint64_t)elements * 2 : (inner_bytes + 15) / 16 * 16;
}

/* TMA's view of K or V (cols E or Ev): {cols, keys, Hkv, B or 1}, or paged {cols, page rows, Hkv, pages}. */
static void af_wgmma_map_dims(const af_problem *p, int64_t cols, uint64_t dims[4]) {
    dims[0] = (uint64_t)cols;
    dims[1] = (uint64_t)(p->page_table ? p->page_size : p->cu_seqlens_k ? p->total_k : p->S);
    dims[2] = (uint64_t)p->Hkv;
    dims[3] = (uint64_t)(p->page_table ? p->num_pages : p->cu_seqlens_k ? 1 : p->B);
}

/* What a tensor map can name: rows contiguous (or one column wide: its stride is never used), every dimension the
 * map walks (size above 1) at a positive stride of whole 16 bytes, a 16-byte aligned base. Size-1 dimensions take
 * any stride (af_wgmma_stride replaces it); a broadcast dimension (stride 0) is not one TMA can box, and mma.sync
 * reads it in place. */
static int af_wgmma_view_fits(const af_problem *p, const char *data, const int64_t *stride, int64_t cols) {
    uint64_t dims[4];
    af_wgmma_map_dims(p, cols, dims);
    if ((dims[0] > 1 && stride[3] != 1) || (uintptr_t)data % 16 != 0) return 0;
    for (int d = 1; d < 4; d++) {
        const int64_t s = stride[3 - d];   /* dims {cols, keys, Hkv, outer} are the strides' 3, 2, 1, 0 */
        if (dims[d] > 1 && (s <= 0 || s % 8 != 0)) return 0;
    }
    return 1;
}

/* K or V as TMA's view (af_wgmma_map_dims); boxes of 64 columns x box_keys keys, 128-byte swizzle. */
static cudaError_t af_wgmma_encode(CUtensorMap *map, const af_problem *p, const char *data, const int64_t *stride,
                                   int64_t cols, int box_keys, int bf16) {
    if (!af_wgmma_view_fits(p, data, stride, cols)) return cudaErrorInvalidValue;
    uint64_t dims[4];
    af_wgmma_map_dims(p, cols, dims);
    uint64_t strides[3];
    strides[0] = af_wgmma_stride(stride[2], dims[1], dims[0] * 2);
    strides[1] = af_wgmma_stride(stride[1], dims[2], strides[0] * dims[1]);
    strides[2] = af_wgmma_stride(stride[0], dims[3], strides[1] * dims[2]);
    const uint32_t box[4] = {AF_WG_ATOM, (uint32_t)box_keys, 1, 1};
    return af_tma_encode_tiled(map, bf16 ? AF_TMA_BF16 : AF_TMA_F16, 4, data, dims, strides, box, AF_SWIZZLE_128B);
}

/* Keys a box: the tile's, or a paged cache's af_wgmma_page_box. */
static int af_wgmma_box_keys(const af_problem *p, int bc) {
    return p->page_table ? (int)af_wgmma_page_box(p->page_size, bc) : bc;
}

/* The maps are encoded here, as for the launch (the driver's word on the strides, dims and alignment), and thrown
 * away; the gathered path reads in place with cp.async and encodes none. */
int af_cuda_wgmma_views_fit(const af_problem *p) {
    if (af_wgmma_gathered(p)) return 1;
    const int hd = af_mma_head_dim(p), bf16 = p->dtype == AF_BF16;
    CUtensorMap k_map, v_map;
    return af_wgmma_encode(&k_map, p, p->k, p->k_stride, p->E, af_wgmma_box_keys(p, AF_WG_BC_OF(hd)), bf16) ==
               cudaSuccess &&
           af_wgmma_encode(&v_map, p, p->v, p->v_stride, p->Ev, af_wgmma_box_keys(p, AF_WG_BC_OF(hd)), bf16) ==
               cudaSuccess;
}

#define AF_WGMMA_LAUNCH_VARIANT(name)                                                                        \
    do {                                                                                                     \
        if ((e = AF_SET_MAX_SMEM(name, plan->smem)) != cudaSuccess) return e;                               \
        return AF_LAUNCH(name, plan->grid_x, 1, 1, AF_WG_THREADS, plan->smem, stream, *prm);               \
    } while (0)

static cudaError_t af_wgmma_launch(const af_wgmma_plan *plan, int bf16, const af_wgmma_params *prm,
                                   cudaStream_t stream) {
    cudaError_t e;
    AF_WGMMA_WITH_VARIANT(plan->hd, bf16, AF_WGMMA_LAUNCH_VARIANT);
}

cudaError_t af_cuda_wgmma_forward(const af_problem *p, const af_cuda_device *dev, void *workspace,
                                  size_t workspace_bytes, cudaStream_t stream) {
    if (p->B == 0 || p->Hq == 0 || p->L == 0) return cudaSuccess;   /* no query row */
    if (!af_cuda_wgmma_accepts(p, dev) || !af_cuda_wgmma_views_fit(p)) return cudaErrorInvalidValue;
    af_wgmma_plan plan;
    cudaError_t e = af_wgmma_make_plan(p, dev, &plan);
    if (e != cudaSuccess) return e;
    if (plan.workspace > 0 && (!workspace || workspace_bytes < plan.workspace)) return cudaErrorInvalidValue;
    const int bf16 = p->dtype == AF_BF16;

    af_wgmma_params prm;
    memset(&prm, 0, sizeof prm);
    af_mma_problem_params(p, &prm.m);
    prm.m.double_buffer = 1;
    prm.m.row_blocks = plan.row_blocks;
    prm.m.heads = plan.heads;
    prm.m.tiles_per_split = plan.tiles_per_split;
    prm.m.part_lse = plan.splits > 1 ? (float *)workspace : NULL;
    prm.m.part_o = plan.splits > 1 ? (float *)((char *)workspace + plan.lse_bytes) : NULL;
    prm.k_blocks = plan.hd / AF_WG_ATOM;   /* all of them: a block past E lands as zeros, never stale */
    prm.v_blocks = plan.hd / AF_WG_ATOM;
    prm.varlen_k = p->cu_seqlens_k != NULL;
    prm.box_keys = af_wgmma_box_keys(p, plan.bc);
    prm.gather = af_wgmma_gathered(p);
    prm.sched = plan.sched;
    if (!prm.gather &&   /* the gathered path reads no tensor map: none is encoded */
        ((e = af_wgmma_encode(&prm.k_map, p, p->k, p->k_stride, p->E, prm.box_keys, bf16)) != cudaSuccess ||
         (e = af_wgmma_encode(&prm.v_map, p, p->v, p->v_stride, p->Ev, prm.box_keys, bf16)) != cudaSuccess))
        return e;

    if ((e = af_wgmma_launch(&plan, bf16, &prm, stream)) != cudaSuccess || plan.splits == 1) return e;
    return af_mma_combine(p, &prm.m, plan.splits, bf16, stream);
}

#endif
