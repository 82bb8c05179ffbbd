/* Compile check of src/cuda/device_hopper_nvidia.h: one warp-specialised kernel (a producer warpgroup issuing TMA,
 * two consumer warpgroups issuing every wgmma variant) that uses every primitive of the Hopper contract, so nvcc
 * assembles each inline PTX statement for sm_90a (HGMMA, UTMALDG, SYNCS in the SASS) and compiles the trapping stubs
 * for every other target. scripts/cuda-hopper-probe-check.sh builds it and checks the SASS and ptxas's report. */
#include "cuda/device_hopper.h"

typedef struct {
    CUtensorMap map2, map3, map4;   /* 2-d, 3-d and 4-d bf16 tensors, 64-element (128-byte) rows */
    float *out;
    const uint16_t *src;            /* 16 bytes of it for the cp.async completing on an mbarrier */
} af_hopper_probe_params;

#define AF_PROBE_TILE (64 * 64 * 2)   /* one 64x64 16-bit box, 8 KiB */

AF_KERNEL_SM90(af_hopper_probe, af_hopper_probe_params, p, 384)
{
    char *smem = af_shared_memory();
    uint64_t *full = (uint64_t *)(smem + 4 * AF_PROBE_TILE), *empty = full + 1, *gathered = full + 2;
    int wg = AF_THREAD_IDX / 128;
    if (AF_THREAD_IDX == 0) {
        af_mbarrier_init(full, 1);
        af_mbarrier_init(empty, 256);
        af_mbarrier_init(gathered, 1);   /* thread 32's cp.async.mbarrier.arrive.noinc */
        af_fence_mbarrier_init();
    }
    af_syncthreads();
    if (wg == 0) {   /* the producer: one thread issues the copies */
        AF_SETMAXNREG_DEC(24);
        if (AF_THREAD_IDX == 0) {
            af_mbarrier_arrive_expect_tx(full, 3 * AF_PROBE_TILE);
            af_tma_load_2d(smem, &p.map2, full, 0, AF_BLOCK_IDX_X * 64);
            af_tma_load_3d(smem + AF_PROBE_TILE, &p.map3, full, 0, 0, AF_BLOCK_IDX_X);
            af_tma_load_4d(smem + 2 * AF_PROBE_TILE, &p.map4, full, 0, 0, AF_BLOCK_IDX_X, 0);
            af_mbarrier_wait_parity(empty, 0);
        }
        if (AF_THREAD_IDX == 32) {   /* a cp.async completing on an mbarrier (ARRIVES.LDGSTSBAR), not waited for */
            af_cp_async_16(full + 4, p.src, 16);
            af_cp_async_mbarrier_arrive_noinc(gathered);
            af_mbarrier_wait_parity(gathered, 0);
            af_fence_proxy_async();
        }
        return;
    }
    AF_SETMAXNREG_INC(240);
    af_mbarrier_wait_parity(full, 0);
    const char *q = smem, *k = smem + AF_PROBE_TILE, *v = smem + 2 * AF_PROBE_TILE;
    float s[64], o[32];
    af_wgmma_fence();
    for (int kk = 0; kk < 4; kk++) {   /* S = Q·Kᵀ over head dim 64: four k-steps of 32 bytes inside the swizzle */
        uint64_t da = af_wgmma_desc(q + 32 * kk, AF_SWIZZLE_128B, 16, 1024);
        uint64_t db = af_wgmma_desc(k + 32 * kk, AF_SWIZZLE_128B, 16, 1024);
        af_wgmma_m64n128k16_bf16_ss(s, da, db, kk > 0);
        af_wgmma_m64n128k16_f16_ss(s, da, db, 1);
        af_wgmma_m64n64k16_bf16_ss(o, da, db, kk > 0);
        af_wgmma_m64n64k16_f16_ss(o, da, db, 1);
        af_wgmma_m64n64k16_bf16_ss_btrans(o, da, db, 1);
        af_wgmma_m64n64k16_f16_ss_btrans(o, da, db, 1);
        af_wgmma_m64n128k16_bf16_ss_btrans(s, da, db, 1);
        af_wgmma_m64n128k16_f16_ss_btrans(s, da, db, 1);
    }
    af_wgmma_commit();
    af_wgmma_wait_1();
    af_wgmma_wait_0();
    af_wgmma_fence_regs(s, 64);
    af_wgmma_fence_regs(o, 32);
    float m = s[0];
    for (int i = 1; i < 64; i++)
        m = fmaxf(m, s[i]);
    uint32_t a[4][4];   /* P, packed before the wgmmas that accumulate into s and o start */
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < 4; j++)
            a[c][j] = af_pack_bf16x2(af_ex2(s[8 * c + 2 * j] - m), af_ex2(s[8 * c + 2 * j + 1] - m));
    float s2[64];
    for (int i = 0; i < 64; i++)
        s2[i] = s[i];
    af_wgmma_fence_regs_u32(&a[0][0], 16);
    af_wgmma_fence();
    for (int c = 0; c < 4; c++) {   /* O = P·V with P from registers (the accumulator layout is A's) */
        uint64_t dv = af_wgmma_desc(v + 16 * 128 * c, AF_SWIZZLE_128B, 8192, 1024);
        af_wgmma_m64n64k16_bf16_rs_btrans(o, a[c], dv, 1);
        af_wgmma_m64n64k16_f16_rs_btrans(o, a[c], dv, 1);
        af_wgmma_m64n64k16_bf16_rs(o, a[c], dv, 1);
        af_wgmma_m64n64k16_f16_rs(o, a[c], dv, 1);
        af_wgmma_m64n128k16_bf16_rs(s2, a[c], dv, 1);
        af_wgmma_m64n128k16_f16_rs(s2, a[c], dv, 1);
        af_wgmma_m64n128k16_bf16_rs_btrans(s2, a[c], dv, 1);
        af_wgmma_m64n128k16_f16_rs_btrans(s2, a[c], dv, 1);
    }
    af_wgmma_commit();
    af_wgmma_wait_0();
    af_wgmma_fence_regs(s2, 64);
    af_wgmma_fence_regs(o, 32);
    float sum = 0.0f;
    for (int i = 0; i < 32; i++)
        sum += o[i] + s2[i] + s2[i + 32];
    /* ordinary stores into a tile the async proxy reads next need the proxy fence */
    ((float *)smem)[AF_THREAD_IDX] = sum;
    af_fence_proxy_async();
    af_mbarrier_arrive(empty);
    if (af_mbarrier_try_wait_parity(empty, 0))
        sum += 1.0f;
    af_named_bar_arrive(1, 384);   /* the ping-pong's named barriers (BAR.ARV / BAR.SYNC) */
    af_named_bar_sync(1, 384);
    p.out[AF_BLOCK_IDX_X * 384 + AF_THREAD_IDX] = sum;
}

/* The host side: tensor maps through the driver entry point, the attribute and the launch. */
extern "C" cudaError_t af_hopper_probe_launch(const uint16_t *src, float *out, int blocks, cudaStream_t stream)
{
    af_hopper_probe_params p;
    uint64_t dims[4] = {64, (uint64_t)blocks * 64, 1, 1}, strides[3] = {128, 128 * 64, 128 * 64 * (uint64_t)blocks};
    uint32_t box2[2] = {64, 64}, box3[3] = {64, 64, 1}, box4[4] = {64, 64, 1, 1};
    uint64_t dims3[3] = {64, 64, (uint64_t)blocks}, dims4[4] = {64, 64, (uint64_t)blocks, 1};
    cudaError_t err = af_tma_encode_tiled(&p.map2, AF_TMA_BF16, 2, src, dims, strides, box2, AF_SWIZZLE_128B);
    if (err == cudaSuccess)
        err = af_tma_encode_tiled(&p.map3, AF_TMA_BF16, 3, src, dims3, strides, box3, AF_SWIZZLE_128B);
    if (err == cudaSuccess)
        err = af_tma_encode_tiled(&p.map4, AF_TMA_BF16, 4, src, dims4, strides, box4, AF_SWIZZLE_128B);
    if (err != cudaSuccess)
        return err;
    p.out = out;
    p.src = src;
    err = AF_SET_MAX_SMEM(af_hopper_probe, 4 * AF_PROBE_TILE + 1024);
    if (err != cudaSuccess)
        return err;
    return AF_LAUNCH(af_hopper_probe, blocks, 1, 1, 384, 4 * AF_PROBE_TILE + 1024, stream, p);
}
