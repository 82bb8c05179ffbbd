/* Public entry points for one SDPA call: check at the boundary, then hand the trusted problem to the kernels of the
 * device its tensors live on. */
#include "flex/program.h"
#include "kernel/flash.h"
#include "sdpa/cuda_backend.h"
#include "sdpa/problem.h"
#include "sdpa/staged.h"
#include "core/status.h"

/* The CUDA backend: loaded (library, driver, GPU: probed once) on first need; the device must exist; CUDA's own
 * text on error. */
static af_status cuda_forward(const af_problem *p, int device, void *stream, const af_cuda_allocator *workspace) {
    const af_cuda_backend_ops *ops;
    af_status st = af_cuda_backend_load(&ops);
    if (st != AF_OK) return st;
    char err[1024] = "";
    const int count = af_cuda_backend_device_count();
    if (device >= count)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "query: on cuda:%d but this machine has %d CUDA device%s (cuda:0..%d)",
                       device, count, count == 1 ? "" : "s", count - 1);
    const int status = af_cuda_forward_sliced(ops, p, device, stream, workspace, err, sizeof err);
    if (status != AF_OK)
        return af_fail((af_status)status, "%s", err[0] ? err : "the CUDA backend failed without a message");
    return AF_OK;
}

af_status af_sdpa(const af_sdpa_args *args, af_tensor *out, af_tensor *lse) {
    af_clear_error();
    af_problem p;
    af_status st = af_sdpa_check(args, out, lse, &p);
    if (st != AF_OK) return st;
    if (args->query->device.type == AF_DEVICE_CUDA)
        return cuda_forward(&p, args->query->device.index, args->stream, args->workspace);
    return af_flash_forward(&p);
}

af_status af_sdpa_reference(const af_sdpa_args *args, af_tensor *out, af_tensor *lse) {
    af_clear_error();
    af_problem p;
    af_status st = af_sdpa_check(args, out, lse, &p);
    if (st != AF_OK) return st;
    if (args->query->device.type != AF_DEVICE_CPU)
        return af_fail(AF_ERR_UNSUPPORTED, "query: on cuda:%d; the reference reads host memory and runs on the CPU "
                       "only (copy the tensors to the host, or compare af_sdpa's output there)",
                       args->query->device.index);
    return af_reference_forward(&p);
}

/* FlashAttention-4's forward (attnforge.h): the same driver over a problem with its features on; on CUDA the
 * backend (fixed-length calls: af_flash_check refuses the varlen, paged and float8 ones there). */
/* The checked call with its mods (if any) on `forward`. */
static af_status flash_with_mods(const af_flash_args *args, af_tensor *out, af_tensor *lse, af_problem *p,
                                 af_status (*forward)(const af_problem *)) {
    af_mods mods;
    af_status st = af_flash_take_mods(args, p, &mods);
    if (st == AF_OK) st = af_mods_forward(p, &mods, out, lse, forward);
    af_mods_release(&mods);
    return st;
}

af_status af_flash_attn(const af_flash_args *args, af_tensor *out, af_tensor *lse) {
    af_clear_error();
    af_problem p;
    af_status st = af_flash_check(args, out, lse, &p);
    if (st != AF_OK) return st;
    if (args->query->device.type == AF_DEVICE_CUDA && !args->score_mod && !args->mask_mod)
        return cuda_forward(&p, args->query->device.index, args->stream, args->workspace);
    return flash_with_mods(args, out, lse, &p, af_flash_forward);
}

af_status af_flash_attn_reference(const af_flash_args *args, af_tensor *out, af_tensor *lse) {
    af_clear_error();
    af_problem p;
    af_status st = af_flash_check(args, out, lse, &p);
    if (st != AF_OK) return st;
    if (args->query->device.type == AF_DEVICE_CUDA)
        return af_fail(AF_ERR_UNSUPPORTED, "query: on cuda:%d; the reference reads host memory and runs on the CPU "
                       "only (copy the tensors to the host, or compare af_flash_attn's output there)",
                       args->query->device.index);
    return flash_with_mods(args, out, lse, &p, af_reference_forward);
}
