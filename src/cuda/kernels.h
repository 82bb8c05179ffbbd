/* The kernel launchers src/cuda/backend.cu calls. Each enqueues on `stream` and returns cudaSuccess or the
 * launch error; none synchronises. The problem passed af_sdpa_check; backend.cu arranges the preconditions
 * stated per launcher (copying a tensor that breaks them, with a warning). */
#ifndef AF_CUDA_KERNELS_H
#define AF_CUDA_KERNELS_H
#include <stddef.h>

#include "cuda/device.h"
#include "sdpa/backward.h"
#include "sdpa/problem.h"

typedef struct {
    int ordinal;                    /* the device's number (cuda:N) */
    int sm_count;                   /* multiprocessors */
    int cc_major, cc_minor;         /* compute capability */
    int max_smem_per_block;         /* opt-in dynamic shared memory per block, bytes */
} af_cuda_device;

/* f16/bf16 on the tensor cores (mma.sync m16n8k16), prefill and decode (split-KV + combine when L is small).
 * Preconditions: dtype f16 or bf16 with K/V of the same dtype, or float8 (e4m3fn, e5m2) K/V under an f16/bf16 q,
 * or q/k/v all float8 with an f16/bf16 out, when af_cuda_mma_accepts_float8; q, k, v have stride[3] == 1, every other stride a multiple of 16 bytes (8 16-bit
 * elements, 16 float8 ones) and 16-byte aligned base pointers; E <= 256 and Ev <= 256. out, lse and the mask may
 * have any strides.
 * `workspace` holds at least af_cuda_mma_workspace_bytes(p, dev) bytes of device memory (split-KV partials;
 * `workspace_bytes` says how many), or is NULL when that is 0. Both ask the kernel variant's occupancy (once per
 * device and variant) and opt it in to its shared memory. */
cudaError_t af_cuda_mma_workspace_bytes(const af_problem *p, const af_cuda_device *dev, size_t *bytes);
cudaError_t af_cuda_mma_forward(const af_problem *p, const af_cuda_device *dev, void *workspace,
                                size_t workspace_bytes, cudaStream_t stream);
/* Nonzero when the problem's packed rows (group·L), keys, page size and (batch, kv head) pairs are below 2^30: the
 * tensor-core kernel divides in 32 bits (a precondition of both functions above). */
int af_cuda_mma_fits_int32(const af_problem *p);
/* Nonzero when float8 K/V (under an f16/bf16 q, or with q float8 too and out f16/bf16) fit the tensor-core kernels
 * on `dev` (head dims, shared memory). */
int af_cuda_mma_accepts_float8(const af_problem *p, const af_cuda_device *dev);

/* The Hopper kernel (attn_wgmma.cuh: wgmma, TMA, a producer warpgroup and two consumer warpgroups) for compute
 * capability 9.0: f16/bf16 q/k/v of one dtype, E and Ev <= 256, more than 64 packed rows (group·L), fixed-length
 * or varlen/seqused_k/paged K/V (paged: by TMA boxes, or gathered with cp.async), no float8; every other feature of
 * af_cuda_mma_forward (masks, causal, windows, softcap, sinks, LSE, split-KV).
 * af_cuda_wgmma_accepts says whether a problem is one of those on `dev`, whatever its strides;
 * af_cuda_wgmma_views_fit whether TMA can read its K and V as laid out (the tensor maps are encoded to find out): a
 * caller that gets 0 runs af_cuda_mma_forward, which reads any view af_cuda_mma_forward's preconditions allow. */
int af_cuda_wgmma_accepts(const af_problem *p, const af_cuda_device *dev);
int af_cuda_wgmma_views_fit(const af_problem *p);
cudaError_t af_cuda_wgmma_workspace_bytes(const af_problem *p, const af_cuda_device *dev, size_t *bytes);
cudaError_t af_cuda_wgmma_forward(const af_problem *p, const af_cuda_device *dev, void *workspace,
                                  size_t workspace_bytes, cudaStream_t stream);

/* The backward on the tensor cores (attn_bwd_mma.cuh): NULL when it takes `p` on `dev`, else why not, naming the
 * argument. Any strides (rows of 16-byte aligned chunks are copied with cp.async, others element by element);
 * `workspace` holds af_cuda_mma_backward_workspace_bytes (D, one float a query row). Deterministic: no atomics. */
const char *af_cuda_mma_backward_refusal(const af_problem *p, const af_cuda_device *dev);
cudaError_t af_cuda_mma_backward_workspace_bytes(const af_problem *p, size_t *bytes);
cudaError_t af_cuda_mma_backward(const af_backward_problem *bp, const af_cuda_device *dev, void *workspace,
                                 size_t workspace_bytes, cudaStream_t stream);

/* Every problem the CPU path accepts (f32 mainly; any strides, any head dims up to 1024) on the CUDA cores:
 * correct, slower. */
cudaError_t af_cuda_simt_forward(const af_problem *p, const af_cuda_device *dev, cudaStream_t stream);

/* dst (contiguous, shape[4]) <- src (strides in elements), elem_size 1, 2 or 4 bytes: the copy backend.cu makes of a
 * q/k/v that breaks the tensor-core path's stride rules. */
cudaError_t af_cuda_copy_4d(void *dst, const void *src, const int64_t shape[4], const int64_t src_stride[4],
                            int elem_size, cudaStream_t stream);

#endif
