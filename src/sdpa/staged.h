/* Outputs staged in scratch: a call that may fail while it runs (a mod's LOAD found outside its tensor) writes copies
 * of its outputs, which reach the caller's tensors only when it succeeds — nothing written on an error, as on every
 * other bad input. Calls whose LOADs are proven inside (flex/bounds.h) run on the caller's tensors. */
#ifndef AF_SDPA_STAGED_H
#define AF_SDPA_STAGED_H
#include "attnforge.h"
#include "flex/program.h"
#include "sdpa/backward.h"
#include "sdpa/problem.h"

/* The checked forward / backward with the call's mods (their LOADs' status read after it): on the caller's tensors,
 * or, where a LOAD is not proven inside, on staged copies of out and lse / of the gradients and daux. p->mods NULL:
 * the call as it is. */
af_status af_mods_forward(af_problem *p, af_mods *mods, const af_tensor *out, const af_tensor *lse,
                          af_status (*forward)(const af_problem *));
af_status af_mods_backward(af_backward_problem *bp, af_mods *mods, const af_gradients *grads,
                           af_status (*backward)(const af_backward_problem *));

#endif
