#include "core/cpu.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "core/log.h"

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#define ARCH_REQ_XCOMP_PERM 0x1023   /* <asm/prctl.h>, Linux 5.16 */
#define XFEATURE_XTILEDATA 18
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static unsigned long long read_xcr0(void) {
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

static void detect_x86(af_cpu_features *f) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return;
    bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29), avx = c & (1u << 28);
    if (!osxsave || !avx) return;
    unsigned long long xcr0 = read_xcr0();
    bool ymm_state = (xcr0 & 0x6) == 0x6;           /* SSE + AVX state */
    bool zmm_state = (xcr0 & 0xe6) == 0xe6;         /* + opmask, ZMM_Hi256, Hi16_ZMM */
    bool amx_state = (xcr0 & 0x60000) == 0x60000;   /* XTILECFG + XTILEDATA */
    if (__get_cpuid_max(0, 0) < 7) return;
    __cpuid_count(7, 0, a, b, c, d);
    bool avx2 = b & (1u << 5);
    f->avx2_fma = ymm_state && avx2 && fma && f16c;
    bool avx512f = b & (1u << 16), avx512dq = b & (1u << 17), avx512bw = b & (1u << 30), avx512vl = b & (1u << 31);
    f->avx512 = f->avx2_fma && zmm_state && avx512f && avx512dq && avx512bw && avx512vl;
    f->avx512_fp16 = f->avx512 && (d & (1u << 23));
    bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
    f->amx_bf16 = f->avx512 && amx_state && amx_tile && amx_bf16;
    __cpuid_count(7, 1, a, b, c, d);
    f->avx512_bf16 = f->avx512 && (a & (1u << 5));
}
#endif

static af_cpu_features features;
static pthread_once_t features_once = PTHREAD_ONCE_INIT;

static void detect(void) {
#if defined(__x86_64__) || defined(__i386__)
    detect_x86(&features);
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    features.num_cores = n > 0 ? (int)n : 1;
}

const af_cpu_features *af_cpu(void) {
    pthread_once(&features_once, detect);
    return &features;
}

static bool amx_permitted;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void ask_amx_permission(void) {
    if (!af_cpu()->amx_bf16) return;
#if defined(__linux__) && defined(__x86_64__)
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0) {
        amx_permitted = true;
        af_log(AF_LOG_DEBUG, "cpu: AMX tile data granted by the kernel (ARCH_REQ_XCOMP_PERM)");
    } else {
        af_log(AF_LOG_DEBUG, "cpu: AMX tile data refused by the kernel (ARCH_REQ_XCOMP_PERM: %s); no amx", strerror(errno));
    }
#else
    af_log(AF_LOG_DEBUG, "cpu: AMX in CPUID and XCR0, but no known way to ask this OS for tile data; no amx");
#endif
}

bool af_cpu_amx_permitted(void) {
    pthread_once(&amx_once, ask_amx_permission);
    return amx_permitted;
}
