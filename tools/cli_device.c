#include "cli_device.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int cli_parse_device(const char *text, af_device *out) {
    memset(out, 0, sizeof *out);
    if (!strcmp(text, "cpu")) return 0;
    if (strncmp(text, "cuda", 4)) return -1;
    out->type = AF_DEVICE_CUDA;
    if (!text[4]) return 0;
    if (text[4] != ':' || text[5] < '0' || text[5] > '9') return -1;
    char *end;
    const long index = strtol(text + 5, &end, 10);
    if (*end || index > 1023) return -1;
    out->index = (int)index;
    return 0;
}

int cli_device_option(int argc, char **argv, int *i, af_device *out, const char *command) {
    if (strcmp(argv[*i], "--device")) return 0;
    if (*i + 1 >= argc) {
        fprintf(stderr, "%s: --device needs a value: cpu, cuda or cuda:N\n", command);
        return -1;
    }
    const char *value = argv[++*i];
    if (cli_parse_device(value, out)) {
        fprintf(stderr, "%s: --device takes cpu, cuda or cuda:N (N a device ordinal), got '%s'\n", command, value);
        return -1;
    }
    return 1;
}

const char *cli_device_name(af_device device, char *buf, size_t size) {
    if (device.type == AF_DEVICE_CUDA) snprintf(buf, size, "cuda:%d", device.index);
    else snprintf(buf, size, "cpu");
    return buf;
}

bool cli_device_is_cuda(const cli_device *d) {
    return d && d->device.type == AF_DEVICE_CUDA;
}

int cli_device_open(cli_device *d, af_device device, const char *command) {
    memset(d, 0, sizeof *d);
    d->device = device;
    if (device.type != AF_DEVICE_CUDA) return 0;
    if (af_cuda_backend_load(&d->ops) != AF_OK) {
        fprintf(stderr, "%s: --device cuda: %s\n", command, af_last_error());
        return 3;
    }
    d->device_count = af_cuda_backend_device_count();   /* probed by the loader */
    if (device.index >= d->device_count) {
        fprintf(stderr, "%s: --device cuda:%d: this machine has %d CUDA device%s (cuda:0%s)\n", command, device.index,
                d->device_count, d->device_count == 1 ? "" : "s", d->device_count == 1 ? "" : " and up");
        return 3;
    }
    return 0;
}

size_t cli_view_span_bytes(const af_tensor *view) {
    int64_t last = 0;   /* offset of the last element the view reaches */
    for (int d = 0; d < view->ndim; d++) {
        if (view->strides[d] < 0) return 0;
        if (view->shape[d] > 0) last += (view->shape[d] - 1) * view->strides[d];
    }
    return (size_t)(last + 1) * af_dtype_size(view->dtype);
}

bool cli_device_tensor_like(const cli_device *d, cli_device_tensor *t, const af_tensor *host, bool copy, char *err,
                            size_t err_size) {
    memset(t, 0, sizeof *t);
    t->bytes = cli_view_span_bytes(host);
    if (t->bytes == 0) {
        snprintf(err, err_size, "a tensor has a negative stride");
        return false;
    }
    const int index = d->device.index;
    if (d->ops->device_alloc(index, t->bytes, &t->memory, err, err_size) != AF_OK) {
        t->memory = NULL;
        return false;
    }
    if (copy && d->ops->copy(index, t->memory, host->data, t->bytes, true, err, err_size) != AF_OK) return false;
    t->view = *host;
    t->view.data = t->memory;
    t->view.device = d->device;
    return true;
}

bool cli_device_tensor_download(const cli_device *d, af_tensor *host, const cli_device_tensor *t, char *err,
                                size_t err_size) {
    return d->ops->copy(d->device.index, host->data, t->memory, t->bytes, false, err, err_size) == AF_OK;
}

void cli_device_tensor_free(const cli_device *d, cli_device_tensor *t) {
    if (t->memory) {
        char ignored[256];
        d->ops->device_free(d->device.index, t->memory, ignored, sizeof ignored);
    }
    memset(t, 0, sizeof *t);
}

bool cli_device_synchronize(const cli_device *d, void *stream, char *err, size_t err_size) {
    return d->ops->synchronize(d->device.index, stream, err, err_size) == AF_OK;
}
