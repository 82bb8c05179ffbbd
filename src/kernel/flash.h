/* The FlashAttention forward pass over a checked problem. */
#ifndef AF_KERNEL_FLASH_H
#define AF_KERNEL_FLASH_H
#include "sdpa/problem.h"

af_status af_flash_forward(const af_problem *p);

#endif
