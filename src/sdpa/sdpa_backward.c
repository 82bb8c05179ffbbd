/* Public entry points of the backward pass: check at the boundary, then the driver (kernel/flash.h) or the reference. */
#include "core/status.h"
#include "flex/program.h"
#include "kernel/flash.h"
#include "sdpa/backward.h"
#include "sdpa/cuda_backend.h"
#include "sdpa/staged.h"

/* CUDA tensors: the backend's backward (loaded on first need; the device must exist), CUDA's own text on error. */
static af_status cuda_backward(const af_backward_problem *bp, int device, void *stream,
                               const af_cuda_allocator *workspace) {
    const af_cuda_backend_ops *ops;
    af_status st = af_cuda_backend_load(&ops);
    if (st != AF_OK) return st;
    const int count = af_cuda_backend_device_count();
    if (device >= count)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "query: on cuda:%d but this machine has %d CUDA device%s (cuda:0..%d)",
                       device, count, count == 1 ? "" : "s", count - 1);
    char err[1024] = "";
    const int status = ops->backward(bp, device, stream, workspace, err, sizeof err);
    if (status != AF_OK)
        return af_fail((af_status)status, "%s", err[0] ? err : "the CUDA backend failed without a message");
    return AF_OK;
}

/* The reference reads host memory. */
static af_status host_only(const af_tensor *query) {
    if (query->device.type == AF_DEVICE_CUDA)
        return af_fail(AF_ERR_UNSUPPORTED, "query: on cuda:%d; the reference backward reads host memory and runs on "
                       "the CPU", query->device.index);
    return AF_OK;
}

af_status af_sdpa_backward(const af_sdpa_args *args, const af_backward_inputs *in, const af_gradients *grads) {
    af_clear_error();
    af_backward_problem bp;
    af_status st = af_sdpa_backward_check(args, in, grads, &bp);
    if (st != AF_OK) return st;
    if (args->query->device.type == AF_DEVICE_CUDA)
        return cuda_backward(&bp, args->query->device.index, args->stream, args->workspace);
    return af_flash_backward(&bp);
}

/* The checked backward with af_flash_attn's mods (if any) on `backward`. */
static af_status flash_backward_with_mods(const af_flash_args *args, const af_gradients *grads, af_backward_problem *bp,
                                          af_status (*backward)(const af_backward_problem *)) {
    af_mods mods;
    af_status st = af_flash_take_mods(args, &bp->f, &mods);
    if (st == AF_OK) st = af_mods_backward(bp, &mods, grads, backward);
    af_mods_release(&mods);
    return st;
}

af_status af_flash_attn_backward(const af_flash_args *args, const af_backward_inputs *in, const af_gradients *grads) {
    af_clear_error();
    af_backward_problem bp;
    af_status st = af_flash_backward_check(args, in, grads, &bp);
    if (st != AF_OK) return st;
    if (args->query->device.type == AF_DEVICE_CUDA && !args->score_mod && !args->mask_mod)
        return cuda_backward(&bp, args->query->device.index, args->stream, args->workspace);
    return flash_backward_with_mods(args, grads, &bp, af_flash_backward);
}

af_status af_sdpa_backward_reference(const af_sdpa_args *args, const af_backward_inputs *in,
                                     const af_gradients *grads) {
    af_clear_error();
    af_backward_problem bp;
    af_status st = af_sdpa_backward_check(args, in, grads, &bp);
    if (st == AF_OK) st = host_only(args->query);
    return st != AF_OK ? st : af_reference_backward(&bp);
}

af_status af_flash_attn_backward_reference(const af_flash_args *args, const af_backward_inputs *in,
                                           const af_gradients *grads) {
    af_clear_error();
    af_backward_problem bp;
    af_status st = af_flash_backward_check(args, in, grads, &bp);
    if (st == AF_OK) st = host_only(args->query);
    return st != AF_OK ? st : flash_backward_with_mods(args, grads, &bp, af_reference_backward);
}
