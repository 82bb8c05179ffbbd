/* The device rule of one SDPA call: every tensor on one device, and that device a valid one. */
#ifndef AF_SDPA_CHECK_DEVICE_H
#define AF_SDPA_CHECK_DEVICE_H
#include "attnforge.h"

/* AF_OK when query, key, value, out and (if given) attn_mask and lse all live on query's device and that device
 * is valid (CPU index 0, CUDA index >= 0); else AF_ERR_INVALID_ARGUMENT naming the tensors and their devices.
 * Whether the CUDA device exists is the backend's question (af_sdpa asks it). */
af_status af_sdpa_check_device(const af_sdpa_args *args, const af_tensor *out, const af_tensor *lse);

/* "cpu", "cuda:1", or "device type 7" for a type attnforge does not know; `buf` holds at least 32 bytes. */
const char *af_device_text(af_device device, char *buf, size_t size);

#endif
