/* Outputs staged in scratch: a call that may fail while it runs (a mod's LOAD found outside its tensor) writes
 * contiguous copies of its outputs, which reach the caller's tensors only when it succeeds — nothing written on an
 * error, as on every other bad input. Calls whose LOADs are proven inside (flex/bounds.h) skip this. */
#ifndef AF_SDPA_STAGED_H
#define AF_SDPA_STAGED_H
#include "attnforge.h"

#define AF_STAGED_MAX 32

typedef struct {
    af_tensor *user[AF_STAGED_MAX];   /* the caller's tensors, in the order staged */
    af_tensor copy[AF_STAGED_MAX];    /* ... and their contiguous copies */
    int n;
} af_staged;

/* *t (NULL: nothing) becomes a contiguous copy of itself (same dtype and shape, CPU); the caller's tensor is kept.
 * AF_ERR_NO_MEMORY names `what` when the copy cannot be had. */
af_status af_stage(af_staged *s, af_tensor **t, const char *what);
/* Every copy into its caller's tensor (any strides). */
void af_stage_commit(const af_staged *s);
void af_stage_release(af_staged *s);

#endif
