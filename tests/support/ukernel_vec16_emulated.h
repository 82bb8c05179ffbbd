/* The vector micro-kernel template at the AVX-512 geometry on emulated 16-lane vectors (for tests). */
#ifndef AF_TESTS_UKERNEL_VEC16_EMULATED_H
#define AF_TESTS_UKERNEL_VEC16_EMULATED_H
#include "kernel/ukernel.h"

extern const af_ukernel af_ukernel_vec16_emulated;

#endif
