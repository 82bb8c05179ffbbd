/* HND and NHD: the copy-free test (PyTorch's contiguity rule on the NHD view) and the HND -> NHD copy. */
#ifndef AF_PROVIDER_LAYOUT_H
#define AF_PROVIDER_LAYOUT_H
#include <stdbool.h>
#include <stddef.h>

#include "attnforge.h"

/* True when the 4-D HND view (B,H,L,D) is x_nhd.transpose(1, 2) of a contiguous x_nhd: the NHD view
 * (B,L,H,D; sB,sL,sH,sD) is contiguous by PyTorch's rule (size-1 dims exempt, numel 0 contiguous). */
bool af_hnd_is_nhd_contiguous(const int64_t shape[4], const int64_t strides[4]);

/* Bytes of the NHD copy of a checked 4-D view; false when that overflows (a broadcast view can have a
 * small span and a huge number of elements). */
bool af_nhd_bytes(const af_tensor *hnd, size_t *bytes);

/* Copy a checked 4-D HND view into `nhd` (contiguous B,L,H,D) and return the HND view over the copy. */
af_tensor af_copy_hnd_to_nhd(const af_tensor *hnd, void *nhd);

#endif
