/* HND <-> NHD: the seed's copy-free flag and its per-call copy, in C. */
#include "provider/layout.h"

#include <string.h>

bool af_hnd_is_nhd_contiguous(const int64_t shape[4], const int64_t strides[4]) {
    static const int nhd_order[4] = {0, 2, 1, 3};   /* NHD dim i is HND dim nhd_order[i] */
    for (int d = 0; d < 4; d++)
        if (shape[d] == 0) return true;             /* PyTorch: an empty tensor is contiguous */
    int64_t expected = 1;
    for (int i = 3; i >= 0; i--) {
        const int d = nhd_order[i];
        if (shape[d] == 1) continue;                /* a size-1 dim's stride never matters */
        if (strides[d] != expected) return false;
        if (__builtin_mul_overflow(expected, shape[d], &expected)) return false;   /* > 2^63 elements: no such tensor */
    }
    return true;
}

bool af_nhd_bytes(const af_tensor *hnd, size_t *bytes) {
    size_t total = af_dtype_size(hnd->dtype);
    for (int d = 0; d < 4; d++)
        if (__builtin_mul_overflow(total, (size_t)hnd->shape[d], &total)) return false;
    *bytes = total;
    return true;
}

af_tensor af_copy_hnd_to_nhd(const af_tensor *hnd, void *nhd) {
    const int64_t B = hnd->shape[0], H = hnd->shape[1], L = hnd->shape[2], D = hnd->shape[3];
    const int64_t *st = hnd->strides;
    const size_t elem = af_dtype_size(hnd->dtype);
    const char *src = hnd->data;
    char *dst = nhd;
    for (int64_t b = 0; b < B; b++)
        for (int64_t l = 0; l < L; l++)
            for (int64_t h = 0; h < H; h++) {
                const char *row = src + (size_t)(b * st[0] + h * st[1] + l * st[2]) * elem;
                if (st[3] == 1 || D <= 1) {
                    memcpy(dst, row, (size_t)D * elem);
                } else {
                    for (int64_t d = 0; d < D; d++) memcpy(dst + (size_t)d * elem, row + (size_t)(d * st[3]) * elem, elem);
                }
                dst += (size_t)D * elem;
            }
    af_tensor view = *hnd;   /* strides of x_nhd.transpose(1, 2) */
    view.data = nhd;
    view.strides[3] = 1;
    view.strides[1] = D;
    view.strides[2] = H * D;
    view.strides[0] = L * H * D;
    return view;
}
