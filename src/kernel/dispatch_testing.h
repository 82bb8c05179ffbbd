/* Test-only hook into dispatch.c (not part of the API): run af_sdpa on a micro-kernel table that is not in the
 * registry, e.g. the AMX products on emulated tiles. */
#ifndef AF_KERNEL_DISPATCH_TESTING_H
#define AF_KERNEL_DISPATCH_TESTING_H
#include "kernel/ukernel.h"

/* Every later call uses `k` (af_get_isa() names it) until the next af_set_isa or a NULL here, which restores the
 * initial choice. Not for concurrent use with running calls. */
void af_ukernel_force_for_tests(const af_ukernel *k);

#endif
