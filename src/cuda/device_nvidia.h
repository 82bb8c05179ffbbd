/* The device-feature contract of src/cuda/device.h for nvcc: CUDA built-ins and inline PTX (sm_80 and later).
 * Included only through device.h when __CUDACC__ is defined. */
#ifndef AF_CUDA_DEVICE_NVIDIA_H
#define AF_CUDA_DEVICE_NVIDIA_H
#include <cuda.h>            /* the driver API's types only (CUcontext, CUresult): its functions come by entry point */
#include <cuda_runtime.h>
#include <stdint.h>

#if CUDART_VERSION < 12050   /* cudaGetDriverEntryPointByVersion came with CUDA 12.5; the unversioned query before */
static inline cudaError_t af_driver_entry_point(const char *symbol, void **fn, unsigned int version,
                                                unsigned long long flags, cudaDriverEntryPointQueryResult *status) {
    (void)version;
    return cudaGetDriverEntryPoint(symbol, fn, flags, status);
}
#define cudaGetDriverEntryPointByVersion af_driver_entry_point
#endif

/* Qualifiers and launches */
#define AF_DEVICE __device__ __forceinline__
#define AF_KERNEL(name, Params, p, max_threads) \
    extern "C" __global__ void __launch_bounds__(max_threads) name(const Params p)
/* A launch's own status: cudaLaunchKernel returns this launch's configuration error and never an earlier call's
 * (`kernel<<<>>>` then cudaGetLastError would report, and clear, a stale error the caller's code left behind). */
template <typename Params>
static inline cudaError_t af_launch_kernel(const void *kernel, dim3 grid, unsigned threads, size_t smem_bytes,
                                           cudaStream_t stream, Params params) {
    void *args[1] = {&params};
    return cudaLaunchKernel(kernel, grid, dim3(threads), args, smem_bytes, stream);
}
#define AF_LAUNCH(name, gx, gy, gz, threads, smem_bytes, stream, params)                                         \
    af_launch_kernel((const void *)(name), dim3((unsigned)(gx), (unsigned)(gy), (unsigned)(gz)),                 \
                     (unsigned)(threads), (size_t)(smem_bytes), (stream), (params))
#define AF_SET_MAX_SMEM(name, bytes) \
    cudaFuncSetAttribute((const void *)(name), cudaFuncAttributeMaxDynamicSharedMemorySize, (int)(bytes))
#define AF_OCCUPANCY(name, threads, smem_bytes, blocks) \
    cudaOccupancyMaxActiveBlocksPerMultiprocessor((blocks), (const void *)(name), (int)(threads), (size_t)(smem_bytes))

/* Indices (1-D blocks) */
#define AF_THREAD_IDX ((int)threadIdx.x)
#define AF_BLOCK_DIM ((int)blockDim.x)
#define AF_BLOCK_IDX_X ((int)blockIdx.x)
#define AF_BLOCK_IDX_Y ((int)blockIdx.y)
#define AF_BLOCK_IDX_Z ((int)blockIdx.z)
#define AF_GRID_DIM_X ((int)gridDim.x)
#define AF_GRID_DIM_Y ((int)gridDim.y)
#define AF_GRID_DIM_Z ((int)gridDim.z)

AF_DEVICE int af_lane(void) { return (int)(threadIdx.x & 31u); }
AF_DEVICE int af_warp(void) { return (int)(threadIdx.x >> 5); }
AF_DEVICE int af_block_idx_x_reread(void) {
    int v;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(v));
    return v;
}
AF_DEVICE int af_thread_idx_reread(void) {
    int v;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(v));
    return v;
}

/* Memory */
AF_DEVICE char *af_shared_memory(void)
{
    extern __shared__ __align__(1024) char af_dynamic_shared_memory[];   /* on the 128-byte swizzle's pattern */
    return af_dynamic_shared_memory;
}

AF_DEVICE void af_syncthreads(void) { __syncthreads(); }

/* ldmatrix and cp.async take shared-window addresses, not generic pointers. */
AF_DEVICE uint32_t af_shared_address(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* Warp */
AF_DEVICE float af_shfl_xor(float v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask); }
AF_DEVICE int af_warp_broadcast(int v) { return __shfl_sync(0xffffffffu, v, 0); }
AF_DEVICE int af_shfl_int(int v, int src_lane) { return __shfl_sync(0xffffffffu, v, src_lane); }

AF_DEVICE void af_mma_16816_f16(float d[4], const uint32_t a[4], const uint32_t b[2])
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

AF_DEVICE void af_mma_16816_bf16(float d[4], const uint32_t a[4], const uint32_t b[2])
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* The "memory" clobbers keep the compiler from moving plain shared-memory stores across these reads. */
AF_DEVICE void af_ldmatrix_x4(uint32_t r[4], const void *smem_row)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(af_shared_address(smem_row))
                 : "memory");
}

AF_DEVICE void af_ldmatrix_x4_trans(uint32_t r[4], const void *smem_row)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(af_shared_address(smem_row))
                 : "memory");
}

AF_DEVICE void af_ldmatrix_x2(uint32_t r[2], const void *smem_row)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(af_shared_address(smem_row))
                 : "memory");
}

AF_DEVICE void af_ldmatrix_x2_trans(uint32_t r[2], const void *smem_row)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(af_shared_address(smem_row))
                 : "memory");
}

/* Asynchronous copies: src-size bytes are read, the rest of the 16 zero-filled. */
AF_DEVICE void af_cp_async_16(void *smem_dst, const void *gmem_src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :
                 : "r"(af_shared_address(smem_dst)), "l"(gmem_src), "r"(src_bytes)
                 : "memory");
}

AF_DEVICE void af_cp_async_commit(void) { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
AF_DEVICE void af_cp_async_wait_0(void) { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
AF_DEVICE void af_cp_async_wait_1(void) { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }
AF_DEVICE void af_cp_async_wait_2(void) { asm volatile("cp.async.wait_group 2;\n" ::: "memory"); }

/* Numbers */
AF_DEVICE float af_ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

AF_DEVICE float af_tanh_approx(float x)
{
    float y;
    asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* cvt.rn.f16x2.f32 d, a, b puts a in the upper half: hi goes first. */
AF_DEVICE uint32_t af_pack_f16x2(float lo, float hi)
{
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

AF_DEVICE uint32_t af_pack_bf16x2(float lo, float hi)
{
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

AF_DEVICE float af_f16_to_float(uint16_t h)
{
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
    return f;
}

AF_DEVICE float af_bf16_to_float(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

AF_DEVICE uint16_t af_float_to_f16(float x)
{
    uint16_t h;
    asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(h) : "f"(x));
    return h;
}

AF_DEVICE uint16_t af_float_to_bf16(float x)
{
    uint16_t h;
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(x));
    return h;
}

/* Device globals and atomics (validate_indices.cuh's status word) */
#define AF_DEVICE_GLOBAL __device__
AF_DEVICE unsigned int af_atomic_cas(unsigned int *address, unsigned int compare, unsigned int value)
{
    return atomicCAS(address, compare, value);
}

#endif
