/* Public entry points of the backward pass: check at the boundary, then the driver (kernel/flash.h) or the reference. */
#include "core/status.h"
#include "kernel/flash.h"
#include "sdpa/backward.h"

af_status af_sdpa_backward(const af_sdpa_args *args, const af_backward_inputs *in, const af_gradients *grads) {
    af_clear_error();
    af_backward_problem bp;
    af_status st = af_sdpa_backward_check(args, in, grads, &bp);
    return st != AF_OK ? st : af_flash_backward(&bp);
}

af_status af_flash_attn_backward(const af_flash_args *args, const af_backward_inputs *in, const af_gradients *grads) {
    af_clear_error();
    af_backward_problem bp;
    af_status st = af_flash_backward_check(args, in, grads, &bp);
    return st != AF_OK ? st : af_flash_backward(&bp);
}

af_status af_sdpa_backward_reference(const af_sdpa_args *args, const af_backward_inputs *in,
                                     const af_gradients *grads) {
    af_clear_error();
    af_backward_problem bp;
    af_status st = af_sdpa_backward_check(args, in, grads, &bp);
    return st != AF_OK ? st : af_reference_backward(&bp);
}

af_status af_flash_attn_backward_reference(const af_flash_args *args, const af_backward_inputs *in,
                                           const af_gradients *grads) {
    af_clear_error();
    af_backward_problem bp;
    af_status st = af_flash_backward_check(args, in, grads, &bp);
    return st != AF_OK ? st : af_reference_backward(&bp);
}
