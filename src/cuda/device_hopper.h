/* The Hopper (sm_90a) features a FlashAttention-3-style kernel uses, named once (issue 30, phase 1). A kernel
 * source includes this after src/cuda/device.h and speaks only through these names and device.h's:
 *   - built by nvcc: inline PTX (src/cuda/device_hopper_nvidia.h), real only in the sm_90a device pass; every
 *     other device pass (sm_80, sm_100, sm_110, sm_120) compiles the same names to a trap, so a file holding an
 *     sm_90a kernel still builds for every target and the host launches that kernel only on compute capability 9.0;
 *   - built by the host compiler with AF_CUDA_EMULATED: tests/cuda_emu/cuda_emulated_hopper.h, which models exactly
 *     these features on the CPU (fragment layouts, descriptors and swizzles, async groups, TMA boxes, mbarrier
 *     phases, the async-proxy rule) and reports a broken rule like the rest of the emulation.
 *
 * The contract (both implementations provide every name):
 *
 * Kernels
 *   AF_KERNEL_SM90(name, Params, p, max_threads)
 *                 like AF_KERNEL, but `p` is a __grid_constant__ parameter (a CUtensorMap member of Params may be
 *                 named by address, as TMA needs: param space, never a local copy) and the register cap at entry is
 *                 fixed by __launch_bounds__(max_threads, 1) (setmaxnreg is ignored without one, warning C7508).
 *                 Launched with AF_LAUNCH / AF_SET_MAX_SMEM of device.h. Threads form warpgroups of 128
 *                 (AF_THREAD_IDX / 128); the block size is a multiple of 128.
 * Warpgroup MMA (all 128 threads of a warpgroup, converged; A 64x16, B 16xN, D 64xN, f32 accumulators)
 *   af_wgmma_m64n{64,128}k16_{f16,bf16}_{ss,rs}[_btrans](float d[N/2], A, uint64_t desc_b, int scale_d),
 *   af_wgmma_m64n{80,176}k16_{f16,bf16}_ss(...)   (K-major B only: S = Q·Kᵀ over 80- or 176-key tiles)
 *                 wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16}: D = A·B + (scale_d ? D : 0).
 *                 _ss: A is `uint64_t desc_a`, a shared-memory descriptor (K-major); _rs: A is `const uint32_t
 *                 a[4]`, registers in the fragment layout below. B is K-major (imm-trans-b 0: element (k, n) of B
 *                 is row n, column k of an NxK tile, as K of S = Q·Kᵀ), or with _btrans MN-major (imm-trans-b 1:
 *                 a KxN tile stored row by row, as V of O = P·V). scale-a/b are +1, imm-trans-a 0.
 *                 Fragments (warp w = (AF_THREAD_IDX % 128) / 32, g = lane / 4, t = lane % 4, PTX ISA figures
 *                 "WGMMA .m64nNk16 register fragment layout" for A and D):
 *                   d[i]: row 16w + g + 8·((i / 2) % 2), column 8·(i / 4) + 2t + i % 2      (i < N/2)
 *                   a[j] (two halves, low first): row 16w + g + 8·(j % 2), columns 2t + 8·(j / 2) + {0, 1}
 *                 so the accumulator of S = Q·Kᵀ, columns 16c..16c+15, packed in pairs, is the A of P·V:
 *                   a[0] = pack(d[8c], d[8c+1]), a[1] = pack(d[8c+2], d[8c+3]), a[2] = pack(d[8c+4], d[8c+5]),
 *                   a[3] = pack(d[8c+6], d[8c+7]).
 *   uint64_t af_wgmma_desc(const void *smem, int swizzle, uint32_t lbo_bytes, uint32_t sbo_bytes)
 *                 the 64-bit shared-memory matrix descriptor: bits 0-13 start address >> 4, 16-29 leading-dimension
 *                 byte offset >> 4, 32-45 stride-dimension byte offset >> 4, 49-51 base offset 0, 62-63 swizzle
 *                 (AF_SWIZZLE_NONE 0, _128B 1, _64B 2, _32B 3). Swizzled tiles start on their pattern (window
 *                 addresses a multiple of 1024 for 128B); a k-step inside one moves `smem` by 32 bytes.
 *                 Canonical layouts, 16-bit elements, S the swizzle width in bytes (16 for NONE), byte address of
 *                 element (mn, k) before the swizzle (bits 4.. of an address XORed with bits 7..):
 *                   K-major,  NONE:    start + (mn/8)·SBO + (k/8)·LBO + (mn%8)·16 + (k%8)·2
 *                   K-major,  swizzled: start + (mn/8)·SBO + (mn%8)·S + k·2                 (LBO unused)
 *                   MN-major, NONE:    start + (mn/8)·SBO + (k/8)·LBO + (k%8)·16 + (mn%8)·2
 *                   MN-major, swizzled: start + (mn/(S/2))·LBO + (k/8)·SBO + (k%8)·S + (mn%(S/2))·2
 *   void af_wgmma_fence(void)            wgmma.fence.sync.aligned: before the first wgmma and before any wgmma
 *                                        after registers it uses were accessed (after every wait)
 *   void af_wgmma_commit(void)           wgmma.commit_group.sync.aligned
 *   void af_wgmma_wait_0(void), af_wgmma_wait_1(void)
 *                                        wgmma.wait_group.sync.aligned N: all but the N newest groups complete
 *   void af_wgmma_fence_regs(float *d, int count), af_wgmma_fence_regs_u32(uint32_t *r, int count)
 *                                        no instruction: keeps nvcc from moving accesses of these registers across
 *                                        the asynchronous wgmma (call after a wait, before reading the accumulators)
 * mbarrier (a uint64_t in shared memory, 8-byte aligned)
 *   void af_mbarrier_init(uint64_t *bar, int count)        mbarrier.init.shared::cta.b64 (expected arrivals)
 *   void af_fence_mbarrier_init(void)                      fence.mbarrier_init.release.cluster
 *   void af_mbarrier_arrive(uint64_t *bar)                 mbarrier.arrive.shared::cta.b64
 *   void af_mbarrier_arrive_expect_tx(uint64_t *bar, uint32_t bytes)
 *                                                          mbarrier.arrive.expect_tx.shared::cta.b64: the phase
 *                                                          also waits for `bytes` transaction bytes
 *   void af_cp_async_mbarrier_arrive_noinc(uint64_t *bar)  cp.async.mbarrier.arrive.noinc.shared::cta.b64: no wait;
 *                                                          an arrival on `bar` once every cp.async this thread
 *                                                          issued before it has completed (.noinc: it is one of the
 *                                                          `count` arrivals init announced). Those writes are the
 *                                                          generic proxy's: a thread that waited on the phase runs
 *                                                          af_fence_proxy_async before its wgmma reads them
 *   int af_mbarrier_try_wait_parity(uint64_t *bar, uint32_t parity)
 *                                                          mbarrier.try_wait.parity.shared::cta.b64: 1 once the
 *                                                          phase of that parity has completed (may give 0 first)
 *   void af_mbarrier_wait_parity(uint64_t *bar, uint32_t parity)   the loop around it
 *                 A phase completes when its pending arrivals reach 0 and its transaction count is 0; then the
 *                 next phase starts with `count` arrivals. Waiting on parity 0 waits for the first phase.
 * Tensor memory access (TMA)
 *   CUtensorMap   the driver's 128-byte, 64-byte aligned tensor map; a member of the kernel's Params
 *   cudaError_t af_tma_encode_tiled(CUtensorMap *map, int dtype, int rank, const void *global,
 *                                   const uint64_t *dims, const uint64_t *strides_bytes, const uint32_t *box,
 *                                   int swizzle)
 *                 host: cuTensorMapEncodeTiled (reached through cudaGetDriverEntryPointByVersion: the library
 *                 links cudart alone) for a tensor of `rank` 2..4 dims (dims[0] contiguous), strides_bytes[i] the
 *                 stride of dims[i+1] (a multiple of 16), box[] the tile (each 1..256; box[0]·element size a
 *                 multiple of 16, equal to the swizzle width when swizzled), dtype AF_TMA_F16 or AF_TMA_BF16;
 *                 out-of-bounds elements read as zero. cudaErrorInvalidValue for what the driver refuses,
 *                 cudaErrorNotSupported without the entry point.
 *   void af_tma_load_2d(void *smem, const CUtensorMap *map, uint64_t *bar, int c0, int c1), _3d(.., c2),
 *        _4d(.., c3)
 *                 cp.async.bulk.tensor.Nd.shared::cluster.global.mbarrier::complete_tx::bytes: one thread copies
 *                 the box at coordinates (c0 innermost, in elements, may be negative or past the end) to `smem`
 *                 (128-byte aligned; the swizzle pattern's alignment when swizzled), rows of box[0] elements,
 *                 and completes box bytes of transactions on `bar`.
 * Named barriers (FlashAttention-3's ping-pong between consumer warpgroups; barrier 0 is af_syncthreads')
 *   void af_named_bar_sync(int id, int threads)     bar.sync id, threads: waits until `threads` (a multiple of 32)
 *                                        threads have arrived at barrier `id` (1..15) in this phase, itself included
 *   void af_named_bar_arrive(int id, int threads)   bar.arrive id, threads: counts this thread's arrival, no wait
 *                 Whole warps arrive together; every arrival of one phase names the same thread count.
 * Shared-window addresses
 *   uint32_t af_shared_address(const void *p)
 *                 the shared-window address of p (cvta.to.shared), which descriptors, TMA and the swizzles see: the
 *                 128-byte swizzle XORs bits 4-6 of the window address with bits 7-9, so a swizzled tile's pattern
 *                 follows window addresses, not offsets from af_shared_memory()
 * Proxies and registers
 *   void af_fence_proxy_async(void)      fence.proxy.async.shared::cta: shared memory written by ordinary stores
 *                                        (or cp.async) is seen by wgmma and TMA only after this fence on the path
 *                                        from the write to the read: in the writing thread (then a barrier), or,
 *                                        for cp.async completed by an mbarrier arrive, in the reading thread after
 *                                        its wait on that barrier
 *   AF_SETMAXNREG_INC(n), AF_SETMAXNREG_DEC(n)
 *                                        setmaxnreg.{inc,dec}.sync.aligned.u32 n (a literal 24..256, multiple
 *                                        of 8): the warpgroup's per-thread register budget
 */
#ifndef AF_CUDA_DEVICE_HOPPER_H
#define AF_CUDA_DEVICE_HOPPER_H
#include "cuda/device.h"

#define AF_SWIZZLE_NONE 0
#define AF_SWIZZLE_128B 1
#define AF_SWIZZLE_64B 2
#define AF_SWIZZLE_32B 3

#define AF_TMA_F16 0
#define AF_TMA_BF16 1

#if defined(__CUDACC__)
#include "cuda/device_hopper_nvidia.h"
#elif defined(AF_CUDA_EMULATED)
#include "cuda_emulated_hopper.h"
#else
#error "src/cuda/device_hopper.h: build with nvcc, or with AF_CUDA_EMULATED and tests/cuda_emu on the include path"
#endif

#endif
