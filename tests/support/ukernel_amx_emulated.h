/* The AMX products (src/kernel/ukernel_amx.inc) on emulated tiles, and a whole test table built like dispatch.c
 * builds "amx": the vector template at the AVX-512 geometry (ukernel_vec16_emulated) plus these products. */
#ifndef AF_TESTS_UKERNEL_AMX_EMULATED_H
#define AF_TESTS_UKERNEL_AMX_EMULATED_H
#include "kernel/ukernel.h"

extern const af_products af_products_amx_emulated;

/* isa "amx-emulated": af_ukernel_vec16_emulated with .products = &af_products_amx_emulated. */
const af_ukernel *af_ukernel_amx_emulated(void);

#endif
