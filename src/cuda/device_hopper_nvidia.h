/* The Hopper contract of src/cuda/device_hopper.h for nvcc: inline PTX, real in the sm_90a device pass only.
 * nvcc compiles a .cu once per target: wgmma and setmaxnreg exist only in sm_90a (compute_90a defines
 * __CUDA_ARCH_FEAT_SM90_ALL), so backend.cu, built for sm_80/sm_90a/sm_100/sm_110/sm_120, would fail in the other
 * passes if these statements reached them. Instead every primitive's body goes through AF_HOPPER_ASM, which is the
 * asm statement in the sm_90a pass and in the host pass (where bodies are parsed, never assembled) and __trap() in
 * every other device pass: a Hopper kernel compiles for all targets, runs only where it was meant to (the host picks
 * it on compute capability 9.0 alone) and traps loudly if ever launched elsewhere. No #error: a file that mixes
 * sm_90a kernels with the portable ones must build for every target. Host-side TMA encoding: tma_encode_nvidia.h. */
#ifndef AF_CUDA_DEVICE_HOPPER_NVIDIA_H
#define AF_CUDA_DEVICE_HOPPER_NVIDIA_H
#include "cuda/device_nvidia.h"
#include "cuda/tma_encode_nvidia.h"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define AF_HOPPER_ASM(...) __trap()   /* a device pass for a target without sm_90a's features */
#else
#define AF_HOPPER_ASM(...) asm volatile(__VA_ARGS__)
#endif

/* __grid_constant__: &p.map is the parameter itself (TMA reads the map from param space); the 1 in the launch
 * bounds fixes the register cap at entry, without which ptxas ignores setmaxnreg (C7508). */
#define AF_KERNEL_SM90(name, Params, p, max_threads) \
    extern "C" __global__ void __launch_bounds__(max_threads, 1) name(const __grid_constant__ Params p)

/* ---- Warpgroup MMA ---- */
AF_DEVICE uint64_t af_wgmma_desc(const void *smem, int swizzle, uint32_t lbo_bytes, uint32_t sbo_bytes)
{
    uint64_t start = (af_shared_address(smem) & 0x3ffffu) >> 4;
    return start | ((uint64_t)((lbo_bytes & 0x3ffffu) >> 4) << 16) | ((uint64_t)((sbo_bytes & 0x3ffffu) >> 4) << 32) |
           ((uint64_t)(swizzle & 3) << 62);
}

AF_DEVICE void af_wgmma_fence(void) { AF_HOPPER_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }
AF_DEVICE void af_wgmma_commit(void) { AF_HOPPER_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
AF_DEVICE void af_wgmma_wait_0(void) { AF_HOPPER_ASM("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
AF_DEVICE void af_wgmma_wait_1(void) { AF_HOPPER_ASM("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }

/* An empty asm that reads and writes each register: accesses of it stay on their side of the wgmma statements. */
AF_DEVICE void af_wgmma_fence_regs(float *d, int count)
{
#pragma unroll
    for (int i = 0; i < count; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}

AF_DEVICE void af_wgmma_fence_regs_u32(uint32_t *r, int count)
{
#pragma unroll
    for (int i = 0; i < count; i++)
        asm volatile("" : "+r"(r[i])::"memory");
}

/* Operand lists: the accumulators "+f" in order, then A (registers or descriptor), B's descriptor, scale-d. */
#define AF_WG_D8(d, o) "+f"(d[o]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), \
                       "+f"(d[o + 6]), "+f"(d[o + 7])
#define AF_WG_D32(d) AF_WG_D8(d, 0), AF_WG_D8(d, 8), AF_WG_D8(d, 16), AF_WG_D8(d, 24)
#define AF_WG_D64(d) AF_WG_D32(d), AF_WG_D8(d, 32), AF_WG_D8(d, 40), AF_WG_D8(d, 48), AF_WG_D8(d, 56)
#define AF_WG_D40(d) AF_WG_D32(d), AF_WG_D8(d, 32)
#define AF_WG_D88(d) AF_WG_D64(d), AF_WG_D8(d, 64), AF_WG_D8(d, 72), AF_WG_D8(d, 80)
#define AF_WG_REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
                     "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define AF_WG_REGS64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
                     "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
                     "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
                     "%56, %57, %58, %59, %60, %61, %62, %63}"

#define AF_WG_REGS40 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
                     "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}"
#define AF_WG_REGS88 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
                     "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
                     "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
                     "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, " \
                     "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87}"

/* One SS variant: A and B by descriptor; TB the imm-trans-b immediate (0 K-major, 1 MN-major B). */
#define AF_WGMMA_SS(N, T, TB, SUFFIX, REGS, OPS, IA, IB, IS)                                                        \
    AF_DEVICE void af_wgmma_m64n##N##k16_##T##_ss##SUFFIX(float d[N / 2], uint64_t desc_a, uint64_t desc_b,        \
                                                          int scale_d)                                              \
    {                                                                                                               \
        AF_HOPPER_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %" IS ", 0;\n"                                              \
                      "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #T "." #T " " REGS ", %" IA ", %" IB        \
                      ", p, 1, 1, 0, " #TB ";\n}\n"                                                                 \
                      : OPS(d)                                                                                      \
                      : "l"(desc_a), "l"(desc_b), "r"(scale_d)                                                      \
                      : "memory");                                                                                  \
    }

/* One RS variant: A from four registers of f16x2/bf16x2. */
#define AF_WGMMA_RS(N, T, TB, SUFFIX, REGS, OPS, AREGS, IB, IS)                                                     \
    AF_DEVICE void af_wgmma_m64n##N##k16_##T##_rs##SUFFIX(float d[N / 2], const uint32_t a[4], uint64_t desc_b,    \
                                                          int scale_d)                                              \
    {                                                                                                               \
        AF_HOPPER_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %" IS ", 0;\n"                                              \
                      "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #T "." #T " " REGS ", " AREGS ", %" IB     \
                      ", p, 1, 1, " #TB ";\n}\n"                                                                    \
                      : OPS(d)                                                                                      \
                      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d)                       \
                      : "memory");                                                                                  \
    }

/* Every variant of one type: N = 64 and 128, SS and RS, B K-major and MN-major (_btrans); N = 80 and 176 SS with
 * B K-major (S = Q·Kᵀ over the key tiles of head dims 256 and 128). */
#define AF_WGMMA_TYPE(T)                                                                                            \
    AF_WGMMA_SS(64, T, 0, , AF_WG_REGS32, AF_WG_D32, "32", "33", "34")                                              \
    AF_WGMMA_SS(64, T, 1, _btrans, AF_WG_REGS32, AF_WG_D32, "32", "33", "34")                                       \
    AF_WGMMA_SS(128, T, 0, , AF_WG_REGS64, AF_WG_D64, "64", "65", "66")                                             \
    AF_WGMMA_SS(128, T, 1, _btrans, AF_WG_REGS64, AF_WG_D64, "64", "65", "66")                                      \
    AF_WGMMA_RS(64, T, 0, , AF_WG_REGS32, AF_WG_D32, "{%32, %33, %34, %35}", "36", "37")                            \
    AF_WGMMA_RS(64, T, 1, _btrans, AF_WG_REGS32, AF_WG_D32, "{%32, %33, %34, %35}", "36", "37")                     \
    AF_WGMMA_RS(128, T, 0, , AF_WG_REGS64, AF_WG_D64, "{%64, %65, %66, %67}", "68", "69")                           \
    AF_WGMMA_RS(128, T, 1, _btrans, AF_WG_REGS64, AF_WG_D64, "{%64, %65, %66, %67}", "68", "69")                  \
    AF_WGMMA_SS(80, T, 0, , AF_WG_REGS40, AF_WG_D40, "40", "41", "42")                                              \
    AF_WGMMA_SS(176, T, 0, , AF_WG_REGS88, AF_WG_D88, "88", "89", "90")

AF_WGMMA_TYPE(f16)
AF_WGMMA_TYPE(bf16)

/* ---- mbarrier ---- */
AF_DEVICE void af_mbarrier_init(uint64_t *bar, int count)
{
    AF_HOPPER_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(af_shared_address(bar)), "r"(count) : "memory");
}

AF_DEVICE void af_fence_mbarrier_init(void) { AF_HOPPER_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

AF_DEVICE void af_mbarrier_arrive(uint64_t *bar)
{
    AF_HOPPER_ASM("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(af_shared_address(bar))
                  : "memory");
}

AF_DEVICE void af_mbarrier_arrive_expect_tx(uint64_t *bar, uint32_t bytes)
{
    AF_HOPPER_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(af_shared_address(bar)), "r"(bytes)
                  : "memory");
}

/* .noinc: the barrier's count already holds this arrival (the copying threads of the gathered producer). */
AF_DEVICE void af_cp_async_mbarrier_arrive_noinc(uint64_t *bar)
{
    AF_HOPPER_ASM("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(af_shared_address(bar)) : "memory");
}

AF_DEVICE int af_mbarrier_try_wait_parity(uint64_t *bar, uint32_t parity)
{
    uint32_t done = 1;
    AF_HOPPER_ASM("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                  : "=r"(done)
                  : "r"(af_shared_address(bar)), "r"(parity)
                  : "memory");
    return (int)done;
}

AF_DEVICE void af_mbarrier_wait_parity(uint64_t *bar, uint32_t parity)
{
    while (!af_mbarrier_try_wait_parity(bar, parity)) {
    }
}

/* ---- TMA: the tensor map by its generic address (param space under __grid_constant__) ---- */
AF_DEVICE void af_tma_load_2d(void *smem, const CUtensorMap *map, uint64_t *bar, int c0, int c1)
{
    AF_HOPPER_ASM("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], "
                  "[%2];\n" ::"r"(af_shared_address(smem)),
                  "l"((uint64_t)map), "r"(af_shared_address(bar)), "r"(c0), "r"(c1)
                  : "memory");
}

AF_DEVICE void af_tma_load_3d(void *smem, const CUtensorMap *map, uint64_t *bar, int c0, int c1, int c2)
{
    AF_HOPPER_ASM("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, "
                  "%5}], [%2];\n" ::"r"(af_shared_address(smem)),
                  "l"((uint64_t)map), "r"(af_shared_address(bar)), "r"(c0), "r"(c1), "r"(c2)
                  : "memory");
}

AF_DEVICE void af_tma_load_4d(void *smem, const CUtensorMap *map, uint64_t *bar, int c0, int c1, int c2, int c3)
{
    AF_HOPPER_ASM("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, "
                  "%5, %6}], [%2];\n" ::"r"(af_shared_address(smem)),
                  "l"((uint64_t)map), "r"(af_shared_address(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                  : "memory");
}

/* ---- Proxies and registers ---- */
AF_DEVICE void af_named_bar_sync(int id, int threads)
{
    AF_HOPPER_ASM("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
AF_DEVICE void af_named_bar_arrive(int id, int threads)
{
    AF_HOPPER_ASM("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
AF_DEVICE void af_fence_proxy_async(void) { AF_HOPPER_ASM("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* n is an immediate: a literal stamped into the instruction. */
#define AF_SETMAXNREG_INC(n)                                                      \
    do {                                                                          \
        AF_HOPPER_ASM("setmaxnreg.inc.sync.aligned.u32 " #n ";\n" ::: "memory"); \
    } while (0)
#define AF_SETMAXNREG_DEC(n)                                                      \
    do {                                                                          \
        AF_HOPPER_ASM("setmaxnreg.dec.sync.aligned.u32 " #n ";\n" ::: "memory"); \
    } while (0)

#endif
