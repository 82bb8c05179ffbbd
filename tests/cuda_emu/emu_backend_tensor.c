#include "emu_backend_tensor.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

void backend_to_device(const af_cuda_backend_ops *ops, device_tensor *d, const test_tensor *t) {
    backend_to_device_on(ops, 0, d, t);
}

void backend_to_device_on(const af_cuda_backend_ops *ops, int device, device_tensor *d, const test_tensor *t) {
    char err[512];
    memset(d, 0, sizeof *d);
    d->view = t->view;
    d->view.device = (af_device){AF_DEVICE_CUDA, device};
    d->device = device;
    if (!t->memory || t->bytes == 0) {   /* an empty view: never read, and no memory to point at */
        d->view.data = NULL;
        return;
    }
    if (ops->device_alloc(device, t->bytes, &d->memory, err, sizeof err) != AF_OK) fail_msg("device_alloc: %s", err);
    if (ops->copy(device, d->memory, t->memory, t->bytes, true, err, sizeof err) != AF_OK) fail_msg("copy: %s", err);
    d->view.data = (char *)d->memory + ((const unsigned char *)t->view.data - t->memory);
}

void backend_to_host(const af_cuda_backend_ops *ops, test_tensor *t, const device_tensor *d) {
    char err[512];
    if (d->memory && ops->copy(d->device, t->memory, d->memory, t->bytes, false, err, sizeof err) != AF_OK)
        fail_msg("copy: %s", err);
}

void backend_device_free(const af_cuda_backend_ops *ops, device_tensor *d) {
    char err[512];
    if (d->memory && ops->device_free(d->device, d->memory, err, sizeof err) != AF_OK)
        fail_msg("device_free: %s", err);
    d->memory = NULL;
}
