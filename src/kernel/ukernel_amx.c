/* AMX bf16 products (ukernel_amx.inc) on the real tile instructions: compiled with -mamx-tile -mamx-bf16 and the
 * AVX-512 flags (the packers and the P conversion vectorise with them), x86-64 only, behind AF_WITH_AMX.
 * dispatch.c pairs these products with the AVX-512 table (softmax, rescale, the f16/f32 path) as ISA "amx",
 * chosen only where CPUID, XCR0 and Linux's ARCH_REQ_XCOMP_PERM all allow tiles (core/cpu.c).
 * Never executed by this project's own machines (no AMX there): the tests run the same source on emulated tiles. */
#include <immintrin.h>

#define AMX_SUFFIX amx
#define AMX_PRODUCTS af_products_amx
#define AMX_TILE_CONFIG(cfg) _tile_loadconfig(cfg)
#define AMX_TILE_RELEASE() _tile_release()
#define AMX_TILE_ZERO(t) _tile_zero(t)
/* Tile numbers unparenthesised: gcc's intrinsics paste them into the instruction text (%tmm0).
 * gcc (12) writes _tile_loadd as an asm with no memory operand or clobber, so it may not see the load read the P
 * and O stages just written (it could sink or drop those stores): a compiler barrier goes first. */
#define AMX_TILE_LOAD(t, p, s)                    \
    do {                                          \
        __asm__ volatile("" ::: "memory");        \
        _tile_loadd(t, (p), (s));                 \
    } while (0)
#define AMX_TILE_STORE(t, p, s) _tile_stored(t, (p), (s))
#define AMX_TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)

#include "kernel/ukernel_amx.inc"
