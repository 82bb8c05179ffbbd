/* Staged outputs (staged.h). */
#include "sdpa/staged.h"

#include <string.h>

#include "core/alloc.h"
#include "core/status.h"

af_status af_stage(af_staged *s, af_tensor **t, const char *what) {
    if (!*t) return AF_OK;
    if (s->n == AF_STAGED_MAX) return af_fail(AF_ERR_INTERNAL, "internal error: more than %d staged outputs", AF_STAGED_MAX);
    const af_tensor *u = *t;
    size_t bytes = af_dtype_size(u->dtype);
    for (int d = 0; d < u->ndim; d++) bytes *= (size_t)u->shape[d];   /* checked by the call: no overflow */
    void *mem = af_alloc(bytes > 0 ? bytes : 1);
    if (!mem) return af_fail(AF_ERR_NO_MEMORY, "out of memory: a staged copy of %s (%zu bytes)", what, bytes);
    s->user[s->n] = *t;
    s->copy[s->n] = af_tensor_contiguous(mem, u->dtype, u->ndim, u->shape);
    *t = &s->copy[s->n++];
    return AF_OK;
}

/* src (contiguous) into dst's strides, dims from d on, at element offsets so far. */
static void copy_dims(const af_tensor *dst, const char *src, int d, int64_t at, size_t elem, const char **next) {
    if (d == dst->ndim) {
        memcpy((char *)dst->data + at * (int64_t)elem, *next, elem);
        *next += elem;
        return;
    }
    for (int64_t i = 0; i < dst->shape[d]; i++) copy_dims(dst, src, d + 1, at + i * dst->strides[d], elem, next);
}

void af_stage_commit(const af_staged *s) {
    for (int k = 0; k < s->n; k++) {
        const char *next = s->copy[k].data;
        copy_dims(s->user[k], s->copy[k].data, 0, 0, af_dtype_size(s->copy[k].dtype), &next);
    }
}

void af_stage_release(af_staged *s) {
    for (int k = 0; k < s->n; k++) af_free(s->copy[k].data);
    s->n = 0;
}
