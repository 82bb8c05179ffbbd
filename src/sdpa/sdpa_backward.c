/* Public entry points of the backward pass: check at the boundary, then the driver (kernel/flash.h) or the reference. */
#include "core/status.h"
#include "flex/bounds.h"
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
static af_status flash_backward_with_mods(const af_flash_args *args, const af_backward_inputs *in,
                                          const af_gradients *grads, af_backward_problem *bp,
                                          af_status (*backward)(const af_backward_problem *)) {
    af_mods mods;
    af_status st = af_flash_take_mods(args, &bp->f, &mods);
    const af_problem *p = &bp->f;
    if (st == AF_OK && p->mods && !af_mods_loads_inside(&mods, p->B, p->Hq, p->L, p->S)) {
        /* a LOAD may fail while the call runs: into staged gradients, which reach the caller's only on success */
        af_staged sg = {.n = 0};
        af_gradients g = *grads;
        af_backward_problem staged;
        af_mods again;
        st = af_stage(&sg, &g.dq, "dq");
        if (st == AF_OK) st = af_stage(&sg, &g.dk, "dk");
        if (st == AF_OK) st = af_stage(&sg, &g.dv, "dv");
        if (st == AF_OK) st = af_stage(&sg, &g.dsink, "dsink");
        if (st == AF_OK) st = af_flash_backward_check(args, in, &g, &staged);
        if (st == AF_OK && (st = af_flash_take_mods(args, &staged.f, &again)) == AF_OK) {
            staged.f.mods = &mods;   /* the first check's programs: their out-of-bounds flag is the one read below */
            st = backward(&staged);
            af_mods_release(&again);
        }
        if (st == AF_OK) st = af_mods_status(&mods);
        if (st == AF_OK) af_stage_commit(&sg);
        af_stage_release(&sg);
    } else if (st == AF_OK) {
        st = backward(bp);
        if (st == AF_OK) st = af_mods_status(&mods);
    }
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
    return flash_backward_with_mods(args, in, grads, &bp, af_flash_backward);
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
    return st != AF_OK ? st : flash_backward_with_mods(args, in, grads, &bp, af_reference_backward);
}
