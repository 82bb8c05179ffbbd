/* The AMX products' source (ukernel_amx.inc), compiled against the C emulation of the tile instructions
 * (amx_tile_emulated.c) instead of the intrinsics: the logic the library runs on AMX, run here without AMX. */
#include "ukernel_amx_emulated.h"

#include <pthread.h>
#include <stdlib.h>

#include "amx_tile_emulated.h"
#include "kernel/dispatch_testing.h"
#include "ukernel_vec16_emulated.h"

#define AMX_SUFFIX emulated
#define AMX_PRODUCTS af_products_amx_emulated
#define AMX_TILE_CONFIG(cfg) amx_emu_loadconfig(cfg)
#define AMX_TILE_RELEASE() amx_emu_release()
#define AMX_TILE_ZERO(t) amx_emu_zero(t)
#define AMX_TILE_LOAD(t, p, s) amx_emu_load((t), (p), (s))
#define AMX_TILE_STORE(t, p, s) amx_emu_store((t), (p), (s))
#define AMX_TILE_DPBF16PS(c, a, b) amx_emu_dpbf16ps((c), (a), (b))

#include "kernel/ukernel_amx.inc"

static af_ukernel table;
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void build_table(void) {
    table = af_ukernel_vec16_emulated;
    table.isa = "amx-emulated";
    table.products = &af_products_amx_emulated;
}

const af_ukernel *af_ukernel_amx_emulated(void) {
    pthread_once(&table_once, build_table);
    return &table;
}

const char *af_test_kernel_select(int i) {
    static const char *const names[AF_TEST_KERNELS] = {"portable", "avx2", "avx512", "amx", "amx-emulated"};
    if (i == AF_TEST_KERNELS - 1) {
        if (getenv("ATTNFORGE_TEST_LIGHT")) return NULL;
        af_ukernel_force_for_tests(af_ukernel_amx_emulated());
        return names[i];
    }
    if (!af_isa_available(names[i])) return NULL;
    if (af_set_isa(names[i]) != AF_OK) abort();   /* available, yet refused: a broken dispatch */
    return names[i];
}

void af_test_kernel_done(int i, const char *before) {
    if (i == AF_TEST_KERNELS - 1) af_ukernel_force_for_tests(NULL);
    af_set_isa(before);
}
