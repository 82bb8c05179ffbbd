/* One SDPA call after the boundary checks: sizes, base pointers and element strides the kernels trust. */
#ifndef AF_SDPA_PROBLEM_H
#define AF_SDPA_PROBLEM_H
#include <stdint.h>

#include "attnforge.h"

typedef enum { AF_CAUSAL_NONE = 0, AF_CAUSAL_TOP_LEFT, AF_CAUSAL_BOTTOM_RIGHT } af_causal;

typedef struct {
    af_dtype dtype;                 /* of q, k and v */
    af_dtype out_dtype;             /* of out: dtype, except for the f32 reference the tests compare against */
    int64_t B, Hq, Hkv, L, S, E, Ev;
    int64_t group;                  /* Hq / Hkv: query head h reads key/value head h / group */
    const char *q, *k, *v;          /* base pointers */
    int64_t q_stride[4], k_stride[4], v_stride[4];   /* elements, dims (B, H, seq, head_dim) */
    char *out;
    int64_t out_stride[4];
    float *lse;                     /* NULL or f32 (B, Hq, L) */
    int64_t lse_stride[3];
    const char *mask;               /* NULL, or broadcast to (B, Hq, L, S) by zero strides */
    af_dtype mask_dtype;            /* AF_BOOL (true = attend) or additive in `dtype` */
    int64_t mask_stride[4];
    af_causal causal;
    double scale;
} af_problem;

/* The key limit of query row i: keys j < af_visible_keys(p, i) are visible (before any mask). */
static inline int64_t af_visible_keys(const af_problem *p, int64_t i) {
    int64_t limit = p->S;
    if (p->causal == AF_CAUSAL_TOP_LEFT) limit = i + 1;
    else if (p->causal == AF_CAUSAL_BOTTOM_RIGHT) limit = i + 1 + (p->S - p->L);
    return limit < 0 ? 0 : limit > p->S ? p->S : limit;
}

/* Check every rule of the call (SPEC §1) and fill `p`. On error: a message naming the argument and the rule. */
af_status af_sdpa_check(const af_sdpa_args *args, const af_tensor *out, const af_tensor *lse, af_problem *p);

/* The plain reference: double accumulation, row by row. */
af_status af_reference_forward(const af_problem *p);

/* The reference written to an f32 `out_f32` (B,Hq,L,Ev) whatever the input dtype: what tests and
 * `attnforge run` compare the kernels against, without the output rounding of bf16/f16. */
af_status af_reference_f32(const af_sdpa_args *args, af_tensor *out_f32, af_tensor *lse);

#endif
