/* Run-time choice of the micro-kernel: the best the CPU and OS support, or ATTNFORGE_ISA / af_set_isa. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core/cpu.h"
#include "core/log.h"
#include "core/status.h"
#include "kernel/dispatch_testing.h"
#include "kernel/ukernel.h"

#ifdef AF_HAVE_AMX
/* "amx": the AVX-512 table (softmax, rescale, blocking and the whole f16/f32 path) plus the AMX products for bf16;
 * completed in complete_tables() before any use (the AVX-512 table is not a constant expression here). */
static af_ukernel amx_table = {.isa = "amx"};
#endif

#ifdef AF_HAVE_AVX512
/* "avx512": the AVX-512 table, plus the vdpbf16ps products for bf16 where the CPU has AVX512-BF16 (complete_tables). */
static af_ukernel avx512_table = {.isa = "avx512"};
#endif

/* Best first. An entry is compiled in only when the build has that ISA's file (AF_HAVE_*). */
static const af_ukernel *const registry[] = {
#ifdef AF_HAVE_AMX
    &amx_table,
#endif
#ifdef AF_HAVE_AVX512
    &avx512_table,
#endif
#ifdef AF_HAVE_AVX2
    &af_ukernel_avx2,
#endif
    &af_ukernel_portable,
};
enum { REGISTRY_SIZE = sizeof registry / sizeof registry[0] };

static bool cpu_supports(const af_ukernel *k) {
    if (strcmp(k->isa, "amx") == 0) return af_cpu()->amx_bf16 && af_cpu_amx_permitted();
    if (strcmp(k->isa, "avx512") == 0) return af_cpu()->avx512;
    if (strcmp(k->isa, "avx2") == 0) return af_cpu()->avx2_fma;
    return true;
}

static const af_ukernel *find(const char *name) {
    for (int i = 0; i < REGISTRY_SIZE; i++)
        if (strcmp(registry[i]->isa, name) == 0) return registry[i];
    return NULL;
}

static _Atomic(const af_ukernel *) current;
static const af_ukernel *initial;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

#ifdef AF_HAVE_AVX512_BF16
/* AVX512-BF16 products on the avx512 table: where the CPU has them, unless ATTNFORGE_AVX512_BF16=0 (A/B timing). */
static bool use_avx512_bf16(void) {
    const char *env = getenv("ATTNFORGE_AVX512_BF16");
    return af_cpu()->avx512_bf16 && !(env && strcmp(env, "0") == 0);
}
#endif

static void complete_tables(void) {
#ifdef AF_HAVE_AVX512
    avx512_table = af_ukernel_avx512;
#ifdef AF_HAVE_AVX512_BF16
    if (use_avx512_bf16()) avx512_table.products = &af_products_avx512_bf16;
#endif
    af_log(AF_LOG_DEBUG, "dispatch: avx512 %s vdpbf16ps products for bf16 (cpu avx512_bf16 %d)",
           avx512_table.products ? "with" : "without", af_cpu()->avx512_bf16);
#endif
#ifdef AF_HAVE_AMX
    amx_table = af_ukernel_avx512;
    amx_table.isa = "amx";
    amx_table.products = &af_products_amx;
#endif
}

static void choose_initial(void) {
    complete_tables();
    const af_ukernel *best = &af_ukernel_portable;
    for (int i = 0; i < REGISTRY_SIZE; i++)
        if (cpu_supports(registry[i])) {
            best = registry[i];
            break;
        }
    const char *env = getenv("ATTNFORGE_ISA");
    if (env && *env) {
        const af_ukernel *wanted = find(env);
        if (wanted && cpu_supports(wanted)) best = wanted;
        else af_log(AF_LOG_WARNING, "ATTNFORGE_ISA=%s is not available here; using %s", env, best->isa);
    }
    initial = best;
    atomic_store(&current, best);
}

const af_ukernel *af_ukernel_current(void) {
    pthread_once(&init_once, choose_initial);
    return atomic_load(&current);
}

const char *af_isa_name(int index) {
    return index >= 0 && index < REGISTRY_SIZE ? registry[REGISTRY_SIZE - 1 - index]->isa : NULL;
}

bool af_isa_available(const char *name) {
    pthread_once(&init_once, choose_initial);
    const af_ukernel *k = name ? find(name) : NULL;
    return k && cpu_supports(k);
}

af_status af_set_isa(const char *name) {
    af_clear_error();
    pthread_once(&init_once, choose_initial);
    if (!name) return af_fail(AF_ERR_INVALID_ARGUMENT, "isa: must not be NULL");
    const af_ukernel *k = find(name);
    static const char *const known[] = {"portable", "avx2", "avx512", "amx"};
    for (size_t i = 0; !k && i < sizeof known / sizeof known[0]; i++)
        if (strcmp(name, known[i]) == 0)
            return af_fail(AF_ERR_UNSUPPORTED, "isa: '%s' is not compiled into this build of attnforge", name);
    if (!k)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "isa: unknown name '%s'; expected portable, avx2, avx512 or amx", name);
    if (!cpu_supports(k))
        return af_fail(AF_ERR_UNSUPPORTED, "isa: '%s' is not supported by this CPU and OS", name);
    atomic_store(&current, k);
    return AF_OK;
}

const char *af_get_isa(void) { return af_ukernel_current()->isa; }

void af_ukernel_force_for_tests(const af_ukernel *k) {
    pthread_once(&init_once, choose_initial);
    atomic_store(&current, k ? k : initial);
}
