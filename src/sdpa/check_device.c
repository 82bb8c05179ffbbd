/* Where a call runs: af_sdpa runs where its tensors live, so they must all live in one place. */
#include "sdpa/check_device.h"

#include <stdio.h>

#include "core/status.h"

const char *af_device_text(af_device device, char *buf, size_t size) {
    if (device.type == AF_DEVICE_CPU && device.index == 0) snprintf(buf, size, "cpu");
    else if (device.type == AF_DEVICE_CPU) snprintf(buf, size, "cpu:%d", device.index);
    else if (device.type == AF_DEVICE_CUDA) snprintf(buf, size, "cuda:%d", device.index);
    else snprintf(buf, size, "device type %d", (int)device.type);
    return buf;
}

static af_status check_valid(const char *name, af_device device) {
    char text[32];
    if (device.type != AF_DEVICE_CPU && device.type != AF_DEVICE_CUDA)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: unknown device type %d; expected AF_DEVICE_CPU or AF_DEVICE_CUDA",
                       name, (int)device.type);
    if (device.type == AF_DEVICE_CPU && device.index != 0)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: device %s; the CPU's index must be 0", name,
                       af_device_text(device, text, sizeof text));
    if (device.index < 0)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: device %s; a CUDA device index must be >= 0", name,
                       af_device_text(device, text, sizeof text));
    return AF_OK;
}

af_status af_sdpa_check_device(const af_sdpa_args *args, const af_tensor *out, const af_tensor *lse) {
    const struct { const char *name; const af_tensor *t; } tensors[6] = {
        {"query", args->query}, {"key", args->key}, {"value", args->value},
        {"out", out}, {"attn_mask", args->attn_mask}, {"lse", lse}};
    const af_device where = args->query->device;
    af_status st = check_valid("query", where);
    if (st != AF_OK) return st;
    for (int i = 1; i < 6; i++) {
        if (!tensors[i].t) continue;
        const af_device here = tensors[i].t->device;
        if ((st = check_valid(tensors[i].name, here)) != AF_OK) return st;
        if (here.type != where.type || here.index != where.index) {
            char here_text[32], where_text[32];
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: on %s but query is on %s; all tensors of a call must be on "
                           "one device", tensors[i].name, af_device_text(here, here_text, sizeof here_text),
                           af_device_text(where, where_text, sizeof where_text));
        }
    }
    return AF_OK;
}
