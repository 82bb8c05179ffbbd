/* The Hopper contract of src/cuda/device_hopper.h emulated on the CPU (cuda_emulated_hopper.c): warpgroup wgmma
 * computed from all 128 threads' operands with the PTX ISA's fragment layouts and shared-memory descriptors (swizzles
 * included), asynchronous until wait_group; TMA boxes with out-of-bounds zero fill that land when a thread waits on
 * their mbarrier; mbarrier phases and transaction counts; the async-proxy fence rule; setmaxnreg's operand rules.
 * Broken rules print a report to stderr and abort, like the rest of the emulation. See README.md. */
#ifndef AF_CUDA_EMULATED_HOPPER_H
#define AF_CUDA_EMULATED_HOPPER_H
#include "cuda_emulated.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The driver's tensor map: 128 bytes, 64-byte aligned; the emulation keeps its own fields in it. */
typedef struct CUtensorMap_st {
    uint64_t opaque[16];
} __attribute__((aligned(64))) CUtensorMap;

cudaError_t af_tma_encode_tiled(CUtensorMap *map, int dtype, int rank, const void *global, const uint64_t *dims,
                                const uint64_t *strides_bytes, const uint32_t *box, int swizzle);

/* Every thread of an AF_KERNEL_SM90 kernel enters and leaves through these: the per-block Hopper state lives from
 * the first thread's entry to the last one's exit, which checks what was left in flight. */
void af_emu_hopper_begin(void);
void af_emu_hopper_end(void);

#define AF_KERNEL_SM90(name, Params, p, max_threads)                                                            \
    static void name(const Params p) AF_EMU_UNUSED;                                                             \
    AF_EMU_UNUSED static void name##_af_entry(const void *af_params)                                            \
    {                                                                                                           \
        af_emu_hopper_begin();                                                                                  \
        name(*(const Params *)af_params);                                                                       \
        af_emu_hopper_end();                                                                                    \
    }                                                                                                           \
    AF_EMU_UNUSED static af_emu_kernel name##_af_kernel = {#name, name##_af_entry, (max_threads), 0};          \
    AF_EMU_UNUSED static cudaError_t name##_af_launch(long long af_gx, long long af_gy, long long af_gz,       \
                                                      long long af_threads, long long af_smem,                 \
                                                      cudaStream_t af_stream, const Params af_params)          \
    {                                                                                                           \
        return af_emu_launch(&name##_af_kernel, af_gx, af_gy, af_gz, af_threads, af_smem, af_stream, &af_params); \
    }                                                                                                           \
    static void name(const Params p)

/* The window address of p, inside the block's dynamic shared memory (the emulated block's starts at the address
 * af_emu_set_shared_window_base names: 0x400 unless a test moves it). */
uint32_t af_shared_address(const void *p);
/* Test hook: where the dynamic shared memory of blocks launched from now starts in the shared window (16-byte
 * aligned), e.g. 0x480 to check that a kernel's swizzles follow window addresses, not its base. */
void af_emu_set_shared_window_base(size_t address);

/* ---- Warpgroup MMA ---- */
uint64_t af_wgmma_desc(const void *smem, int swizzle, uint32_t lbo_bytes, uint32_t sbo_bytes);
/* One wgmma of the warpgroup: a == NULL for SS (A by desc_a), else RS (A from the 4 registers). */
void af_emu_wgmma(float *d, int n, int bf16, int trans_b, uint64_t desc_a, const uint32_t *a, uint64_t desc_b,
                  int scale_d, const char *name);
void af_wgmma_fence(void);
void af_wgmma_commit(void);
void af_wgmma_wait_0(void);
void af_wgmma_wait_1(void);
static inline void af_wgmma_fence_regs(float *d, int count) { (void)d, (void)count; }
static inline void af_wgmma_fence_regs_u32(uint32_t *r, int count) { (void)r, (void)count; }

#define AF_EMU_WGMMA_SS(N, T, BF16, TB, SUFFIX)                                                                   \
    static inline void af_wgmma_m64n##N##k16_##T##_ss##SUFFIX(float d[N / 2], uint64_t desc_a, uint64_t desc_b,  \
                                                              int scale_d)                                        \
    {                                                                                                             \
        af_emu_wgmma(d, N, BF16, TB, desc_a, NULL, desc_b, scale_d, "af_wgmma_m64n" #N "k16_" #T "_ss" #SUFFIX);  \
    }
#define AF_EMU_WGMMA_RS(N, T, BF16, TB, SUFFIX)                                                                   \
    static inline void af_wgmma_m64n##N##k16_##T##_rs##SUFFIX(float d[N / 2], const uint32_t a[4],               \
                                                              uint64_t desc_b, int scale_d)                      \
    {                                                                                                             \
        af_emu_wgmma(d, N, BF16, TB, 0, a, desc_b, scale_d, "af_wgmma_m64n" #N "k16_" #T "_rs" #SUFFIX);         \
    }
#define AF_EMU_WGMMA_TYPE(T, BF16)                                                                                \
    AF_EMU_WGMMA_SS(64, T, BF16, 0, )                                                                             \
    AF_EMU_WGMMA_SS(64, T, BF16, 1, _btrans)                                                                      \
    AF_EMU_WGMMA_SS(128, T, BF16, 0, )                                                                            \
    AF_EMU_WGMMA_SS(128, T, BF16, 1, _btrans)                                                                     \
    AF_EMU_WGMMA_RS(64, T, BF16, 0, )                                                                             \
    AF_EMU_WGMMA_RS(64, T, BF16, 1, _btrans)                                                                      \
    AF_EMU_WGMMA_RS(128, T, BF16, 0, )                                                                            \
    AF_EMU_WGMMA_RS(128, T, BF16, 1, _btrans)                                                                     \
    AF_EMU_WGMMA_SS(80, T, BF16, 0, )                                                                             \
    AF_EMU_WGMMA_SS(176, T, BF16, 0, )
AF_EMU_WGMMA_TYPE(f16, 0)
AF_EMU_WGMMA_TYPE(bf16, 1)

/* ---- mbarrier ---- */
void af_mbarrier_init(uint64_t *bar, int count);
void af_fence_mbarrier_init(void);
void af_mbarrier_arrive(uint64_t *bar);
void af_mbarrier_arrive_expect_tx(uint64_t *bar, uint32_t bytes);
void af_cp_async_mbarrier_arrive_noinc(uint64_t *bar);
int af_mbarrier_try_wait_parity(uint64_t *bar, uint32_t parity);
static inline void af_mbarrier_wait_parity(uint64_t *bar, uint32_t parity)
{
    while (!af_mbarrier_try_wait_parity(bar, parity)) {
    }
}

/* ---- TMA ---- */
void af_emu_tma_load(void *smem, const CUtensorMap *map, uint64_t *bar, int rank, const int *coords);
static inline void af_tma_load_2d(void *smem, const CUtensorMap *map, uint64_t *bar, int c0, int c1)
{
    int c[2] = {c0, c1};
    af_emu_tma_load(smem, map, bar, 2, c);
}
static inline void af_tma_load_3d(void *smem, const CUtensorMap *map, uint64_t *bar, int c0, int c1, int c2)
{
    int c[3] = {c0, c1, c2};
    af_emu_tma_load(smem, map, bar, 3, c);
}
static inline void af_tma_load_4d(void *smem, const CUtensorMap *map, uint64_t *bar, int c0, int c1, int c2, int c3)
{
    int c[4] = {c0, c1, c2, c3};
    af_emu_tma_load(smem, map, bar, 4, c);
}

/* ---- Proxies and registers ---- */
void af_fence_proxy_async(void);
void af_named_bar_sync(int id, int threads);
void af_named_bar_arrive(int id, int threads);
void af_emu_setmaxnreg(int inc, int n);
#define AF_SETMAXNREG_INC(n) af_emu_setmaxnreg(1, (n))
#define AF_SETMAXNREG_DEC(n) af_emu_setmaxnreg(0, (n))

#ifdef __cplusplus
}
#endif

#endif
