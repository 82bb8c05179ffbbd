/* The FlashAttention forward and backward passes over a checked problem. */
#ifndef AF_KERNEL_FLASH_H
#define AF_KERNEL_FLASH_H
#include "sdpa/backward.h"
#include "sdpa/problem.h"

af_status af_flash_forward(const af_problem *p);

/* dq, dk, dv (and dsink) of a checked backward call (backward.c): FlashAttention-2's K/V-stationary tiles. */
af_status af_flash_backward(const af_backward_problem *bp);

#endif
