/* The AMX products (src/kernel/ukernel_amx.inc) on emulated tiles, and a whole test table built like dispatch.c
 * builds "amx": the vector template at the AVX-512 geometry (ukernel_vec16_emulated) plus these products. */
#ifndef AF_TESTS_UKERNEL_AMX_EMULATED_H
#define AF_TESTS_UKERNEL_AMX_EMULATED_H
#include "kernel/ukernel.h"

extern const af_products af_products_amx_emulated;

/* isa "amx-emulated": af_ukernel_vec16_emulated with .products = &af_products_amx_emulated. */
const af_ukernel *af_ukernel_amx_emulated(void);

/* The kernels a suite runs each case on, in turn: "portable", "avx2", "avx512", "amx" where this machine has them,
 * then "amx-emulated" (not under ATTNFORGE_TEST_LIGHT). af_test_kernel_select(i) makes the i-th current and returns
 * its name, or NULL when it is skipped here; af_test_kernel_done(i) undoes it (restoring ISA `before`). */
#define AF_TEST_KERNELS 5
const char *af_test_kernel_select(int i);
void af_test_kernel_done(int i, const char *before);

#endif
