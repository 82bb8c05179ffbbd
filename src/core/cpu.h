/* What the CPU *and the OS* let us run (CPUID + XCR0), read once. */
#ifndef AF_CORE_CPU_H
#define AF_CORE_CPU_H
#include <stdbool.h>

typedef struct {
    bool avx2_fma;        /* AVX2 + FMA + F16C, with YMM state enabled by the OS */
    bool avx512;          /* AVX-512 F/BW/VL/DQ, with ZMM/opmask state enabled by the OS */
    bool avx512_bf16;
    bool avx512_fp16;
    bool amx_bf16;        /* AMX-TILE + AMX-BF16 in CPUID and XCR0 (Linux permission is asked separately) */
    int num_cores;        /* online logical CPUs */
} af_cpu_features;

const af_cpu_features *af_cpu(void);

/* Linux keeps AMX tile data off until a process asks (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); a tile
 * instruction before that raises SIGILL. Asks once, only where af_cpu()->amx_bf16; true when granted. */
bool af_cpu_amx_permitted(void);

#endif
