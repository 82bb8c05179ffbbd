/* Where the command line's cases run: the CPU, or one CUDA device, whose memory the tools allocate and fill
 * through the CUDA backend's helpers (src/sdpa/cuda_backend.h) so that af_sdpa runs on device tensors. */
#ifndef AF_TOOLS_CLI_DEVICE_H
#define AF_TOOLS_CLI_DEVICE_H
#include <stdbool.h>
#include <stddef.h>

#include "attnforge.h"
#include "sdpa/cuda_backend.h"

typedef struct {
    af_device device;                  /* AF_DEVICE_CPU: nothing below is used */
    const af_cuda_backend_ops *ops;    /* the loaded backend (CUDA) */
    int device_count;
} cli_device;

/* "cpu", "cuda" (device 0) or "cuda:N": 0, else -1. */
int cli_parse_device(const char *text, af_device *out);
/* --device NAME at argv[*i]: 1 and *i moved past the value; -1 after printing why the value is bad (exit 2);
 * 0 when argv[*i] is not --device. */
int cli_device_option(int argc, char **argv, int *i, af_device *out, const char *command);
/* "cpu", "cuda:0", ... */
const char *cli_device_name(af_device device, char *buf, size_t size);
bool cli_device_is_cuda(const cli_device *d);

/* Ready `device`: for CUDA, load the backend and check that device N exists. 0, or the exit code 3 after printing
 * "<command>: <why>" (the loader's message: which of library, driver or GPU is missing, and how to fix it). */
int cli_device_open(cli_device *d, af_device device, const char *command);

/* A tensor in device memory: `view` has the host tensor's shape, dtype and strides, its data on the device. */
typedef struct {
    af_tensor view;
    void *memory;                      /* NULL: not allocated */
    size_t bytes;
} cli_device_tensor;

/* Bytes from a view's first element to the last one its strides reach (at least one element); 0 when a stride is
 * negative. */
size_t cli_view_span_bytes(const af_tensor *view);

/* Device memory for a tensor laid out like `host` (copied from it when `copy`); false with CUDA's text in err. */
bool cli_device_tensor_like(const cli_device *d, cli_device_tensor *t, const af_tensor *host, bool copy, char *err,
                            size_t err_size);
/* host (laid out like t->view) <- t, synchronous. */
bool cli_device_tensor_download(const cli_device *d, af_tensor *host, const cli_device_tensor *t, char *err,
                                size_t err_size);
void cli_device_tensor_free(const cli_device *d, cli_device_tensor *t);
/* Wait for everything enqueued on `stream` (NULL: the legacy default stream). */
bool cli_device_synchronize(const cli_device *d, void *stream, char *err, size_t err_size);

#endif
