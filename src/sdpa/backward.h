/* One backward call after the boundary checks: the forward's problem plus dout and the gradients, with element strides
 * in the problem's (B, H, seq, dim) order (NHD and packed varlen views permuted as the forward's). */
#ifndef AF_SDPA_BACKWARD_H
#define AF_SDPA_BACKWARD_H
#include "sdpa/problem.h"

typedef struct {
    af_problem f;                   /* the forward's call: q, k, v, out, lse (required), mask and features */
    const char *dout;               /* in f.out_dtype */
    int64_t dout_stride[4];
    char *dq, *dk, *dv;             /* NULL: not wanted */
    af_dtype dq_dtype, dk_dtype, dv_dtype;   /* each its input's dtype, or f32 under an f16/bf16 input (CPU) */
    int64_t dq_stride[4], dk_stride[4], dv_stride[4];
    char *dsink;                    /* NULL, or (Hq,) in f.sink_dtype */
    int64_t dsink_stride;
    af_tensor *const *daux;         /* af_flex_attn_backward: NULL, or per captured tensor of the score_mod NULL or its
                                       gradient (float32, its shape, checked) */
} af_backward_problem;

/* Every rule of the forward (af_sdpa_check / af_flash_check with out and lse) and the backward's own (attnforge.h):
 * dout, the gradients' shapes, dtypes and memory, and what the backward does not take. */
af_status af_sdpa_backward_check(const af_sdpa_args *args, const af_backward_inputs *in, const af_gradients *grads,
                                 af_backward_problem *bp);
af_status af_flash_backward_check(const af_flash_args *args, const af_backward_inputs *in, const af_gradients *grads,
                                  af_backward_problem *bp);

/* The plain reference backward: double accumulation; recomputes the scores, P and D from q, k, v and dout. */
af_status af_reference_backward(const af_backward_problem *bp);

#endif
