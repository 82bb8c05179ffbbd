/* Compile check of src/cuda/device_nvidia.h: one kernel that uses every primitive of the contract, so nvcc
 * assembles each inline PTX statement for sm_80 and sm_90a (see README.md for the command and the SASS check). */
#include "cuda/device.h"

typedef struct {
    const uint16_t *src;   /* 16-bit elements, 64 x 64 */
    float *out;
    int valid_bytes;
} af_probe_params;

AF_KERNEL(af_device_probe, af_probe_params, p, 128)
{
    char *smem = af_shared_memory();
    int row = AF_THREAD_IDX;
    for (int c = 0; c < 8; c++)
        af_cp_async_16(smem + (row * 8 + c) * 16, p.src + (row * 8 + c) * 8, c == 7 ? p.valid_bytes : 16);
    af_cp_async_commit();
    af_cp_async_wait_2();
    af_cp_async_wait_1();
    af_cp_async_wait_0();
    af_syncthreads();

    int lane = af_lane();
    const char *tile = smem + af_warp() * 16 * 128;
    uint32_t a[4], b[2], bt[2], bx[4];
    af_ldmatrix_x4(a, tile + (lane & 15) * 128 + (lane >> 4) * 16);
    af_ldmatrix_x2(b, tile + (lane & 7) * 128 + ((lane >> 3) & 1) * 16);
    af_ldmatrix_x2_trans(bt, tile + (lane & 15) * 128);
    af_ldmatrix_x4_trans(bx, tile + (lane & 15) * 128 + (lane >> 4) * 16);
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    af_mma_16816_f16(d, a, b);
    af_mma_16816_bf16(d, bx, bt);
    float m = fmaxf(d[0], d[1]);
    m = fmaxf(m, af_shfl_xor(m, 1));
    m = fmaxf(m, af_shfl_xor(m, 2));
    m += (float)af_shfl_int((int)d[2], (lane + 3) & 31);
    float e = af_ex2(d[2] - m) + af_ex2(d[3] - m);
    uint32_t h = af_pack_f16x2(e, m) ^ af_pack_bf16x2(m, e);
    e += af_f16_to_float((uint16_t)h) + af_bf16_to_float((uint16_t)(h >> 16));
    e += af_f16_to_float(af_float_to_f16(e)) + af_bf16_to_float(af_float_to_bf16(e));
    int block = AF_BLOCK_IDX_X + AF_GRID_DIM_X * (AF_BLOCK_IDX_Y + AF_GRID_DIM_Y * AF_BLOCK_IDX_Z);
    p.out[(block * AF_BLOCK_DIM + AF_THREAD_IDX) % (AF_GRID_DIM_Z * 128)] = e;
}

/* The host side of the contract: launch, attribute, runtime calls. */
extern "C" cudaError_t af_device_probe_launch(const uint16_t *src, float *out, cudaStream_t stream)
{
    af_probe_params p;
    p.src = src;
    p.out = out;
    p.valid_bytes = 10;
    cudaError_t err = AF_SET_MAX_SMEM(af_device_probe, 64 * 1024);
    if (err != cudaSuccess)
        return err;
    return AF_LAUNCH(af_device_probe, 2, 1, 1, 128, 64 * 1024, stream, p);
}
