/* The CUDA features attnforge's kernels use, named once. Kernel sources (the .cuh files beside this header) are
 * written in the common subset of C11 and C++17 and speak only through these names:
 *   - built by nvcc (__CUDACC__): the real thing, inline PTX (src/cuda/device_nvidia.h);
 *   - built by the host compiler with AF_CUDA_EMULATED: the emulation in tests/cuda_emu/cuda_emulated.h, which
 *     runs every CUDA thread of a block as a fiber on the CPU and implements exactly these features (fragment
 *     layouts of the PTX ISA, ldmatrix, cp.async groups, barriers, shuffles, ex2), so one kernel source is tested
 *     here against the double reference and runs unchanged on a GPU.
 *
 * The contract (both implementations provide every name; nothing else from CUDA may appear in a kernel):
 *
 * Qualifiers and launches
 *   AF_DEVICE                      a device function (`__device__ __forceinline__` / `static inline`)
 *   AF_KERNEL(name, Params, p, max_threads)
 *                                  starts the definition of kernel `name` taking `const Params p` by value:
 *                                  AF_KERNEL(af_k, af_k_params, p, 128) { ... body ... }
 *   AF_LAUNCH(name, gx, gy, gz, threads, smem_bytes, stream, params)
 *                                  enqueues the kernel on grid (gx, gy, gz) of 1-D blocks; an expression of type
 *                                  cudaError_t: this launch's own error, cudaSuccess if none (never an earlier
 *                                  call's stale error: cudaLaunchKernel, not <<<>>> and cudaGetLastError)
 *   AF_SET_MAX_SMEM(name, bytes)   allows `bytes` (> 48 KiB) of dynamic shared memory; cudaError_t
 *   AF_OCCUPANCY(name, threads, smem_bytes, int *blocks)
 *                                  cudaOccupancyMaxActiveBlocksPerMultiprocessor: how many blocks of that size one
 *                                  multiprocessor of the current device holds at once; cudaError_t
 * Indices (1-D blocks)
 *   AF_THREAD_IDX, AF_BLOCK_DIM, AF_BLOCK_IDX_X/_Y/_Z, AF_GRID_DIM_X/_Y/_Z    (int)
 *   af_lane() = AF_THREAD_IDX % 32, af_warp() = AF_THREAD_IDX / 32
 *   int af_block_idx_x_reread(), int af_thread_idx_reread()
 *                                  AF_BLOCK_IDX_X, AF_THREAD_IDX read afresh (asm volatile mov from %ctaid.x, %tid.x):
 *                                  values the compiler can neither carry over from an earlier read nor hoist out of a
 *                                  loop, so a setmaxnreg region's loop holds no register for them from before it
 * Memory
 *   af_shared_memory()             char * to the block's dynamic shared memory (128-byte aligned at least; declared
 *                                  1024-aligned, which a static __shared__ array could undo); kernels declare no
 *                                  static __shared__ arrays
 *   af_syncthreads()               __syncthreads()
 * Warp (all 32 lanes converged, full mask)
 *   float af_shfl_xor(float v, int lane_mask)                         __shfl_xor_sync(0xffffffff, v, lane_mask)
 *   int af_warp_broadcast(int v)                                      __shfl_sync(0xffffffff, v, 0): lane 0's v, which
 *                                  the compiler then knows is warp-uniform (kept in a uniform register)
 *   int af_shfl_int(int v, int src_lane)                              __shfl_sync(0xffffffff, v, src_lane): lane
 *                                  src_lane's v (0..31; each lane may name another)
 *   void af_mma_16816_f16(float d[4], const uint32_t a[4], const uint32_t b[2])    d += a·b,
 *   void af_mma_16816_bf16(float d[4], const uint32_t a[4], const uint32_t b[2])   mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32
 *   void af_ldmatrix_x4(uint32_t r[4], const void *smem_row)          ldmatrix.sync.aligned.m8n8.x4.shared.b16
 *   void af_ldmatrix_x4_trans(uint32_t r[4], const void *smem_row)    ... .x4.trans ...
 *   void af_ldmatrix_x2(uint32_t r[2], const void *smem_row)          ... .x2 ... (lanes 0-15 give addresses)
 *   void af_ldmatrix_x2_trans(uint32_t r[2], const void *smem_row)
 * Asynchronous copies (per thread)
 *   void af_cp_async_16(void *smem_dst, const void *gmem_src, int src_bytes)
 *                                  cp.async.cg.shared.global 16 bytes; src_bytes in 0..16 are read, the rest of
 *                                  the 16 zero-filled (0: nothing is read, gmem_src may be anything)
 *   void af_cp_async_commit(void)  cp.async.commit_group
 *   void af_cp_async_wait_0(void), af_cp_async_wait_1(void), af_cp_async_wait_2(void)
 *                                  cp.async.wait_group N
 * Global memory
 *   AF_DEVICE_GLOBAL               a variable in global memory, one per device (`__device__`); the host reads and
 *                                  writes it with cudaMemcpyFromSymbol / cudaMemcpyToSymbol (synchronous)
 *   unsigned af_atomic_cas(unsigned *address, unsigned compare, unsigned value)    atomicCAS: the old value
 * Numbers
 *   float af_ex2(float x)          ex2.approx.ftz.f32
 *   float af_tanh_approx(float x)  tanh.approx.f32 (sm_75 on): one MUFU.TANH, maximum relative error 2^-10.987
 *                                  (PTX ISA); tanhf costs an EX2 and an RCP and more
 *   uint32_t af_pack_f16x2(float lo, float hi), af_pack_bf16x2(float lo, float hi)
 *                                  cvt.rn.{f16x2,bf16x2}.f32: lo in bits 0-15
 *   float af_f16_to_float(uint16_t), af_bf16_to_float(uint16_t)
 *   uint16_t af_float_to_f16(float), af_float_to_bf16(float)          round to nearest even
 * Host runtime (the host code of src/cuda/backend.cu uses only these CUDA runtime names, with their CUDA
 * meaning): cudaError_t, cudaSuccess, cudaStream_t, cudaGetErrorString, cudaGetErrorName, cudaGetLastError,
 * cudaGetDeviceCount, cudaGetDevice, cudaSetDevice, cudaDeviceGetAttribute with cudaDevAttrMultiProcessorCount,
 * cudaDevAttrComputeCapabilityMajor/Minor, cudaDevAttrMaxSharedMemoryPerBlockOptin, cudaMallocAsync,
 * cudaFreeAsync, cudaMemsetAsync, cudaPointerGetAttributes (cudaPointerAttributes .type/.device,
 * cudaMemoryTypeDevice/Managed), cudaDriverGetVersion, cudaRuntimeGetVersion, cudaDeviceSynchronize,
 * cudaMemcpyFromSymbol, cudaMemcpyToSymbol; of the driver API only CUresult, CUDA_SUCCESS, CUcontext and the entry
 * points cuCtxGetCurrent/cuCtxSetCurrent, found with cudaGetDriverEntryPointByVersion (cudaEnableDefault,
 * cudaDriverEntryPointQueryResult) so that the backend links cudart alone. Nothing a call on CUDA tensors enqueues
 * may synchronise or copy synchronously (it may run during stream capture): the emulation refuses those during a
 * capture, as CUDA does. */
#ifndef AF_CUDA_DEVICE_H
#define AF_CUDA_DEVICE_H
#include <stdint.h>

#if defined(__CUDACC__)
#include "cuda/device_nvidia.h"
#elif defined(AF_CUDA_EMULATED)
#include "cuda_emulated.h"
#else
#error "src/cuda/device.h: build with nvcc, or with AF_CUDA_EMULATED and tests/cuda_emu on the include path"
#endif

#endif
