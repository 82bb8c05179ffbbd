/* What the argument fuzzers share: a reader of the input's bytes and the bytes a decoded view can reach. */
#ifndef AF_FUZZ_VIEWS_H
#define AF_FUZZ_VIEWS_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"

typedef struct { const uint8_t *data; size_t size, at; } byte_reader;

static inline uint8_t next_byte(byte_reader *r) { return r->at < r->size ? r->data[r->at++] : 0; }

/* Mostly small sizes and strides; now and then a hostile one (negative, huge, overflowing). */
static inline int64_t next_extent(byte_reader *r) {
    uint8_t b = next_byte(r);
    switch (b >> 5) {
    case 0: return -(int64_t)(b & 7) - 1;
    case 1: return (b & 16) ? INT64_MAX - (b & 15) : (int64_t)1 << (40 + (b & 15));
    default: return b & 7;
    }
}

#define TOO_BIG (-2)

/* Bytes a view can reach; -1 when it is not a valid view (the library must then refuse it unread); TOO_BIG for a
 * valid view reaching past `max_elements` (it gets NULL data, which the library must refuse: it cannot know a
 * buffer's size; keeps executions small). */
static inline int64_t reach_bytes(const af_tensor *t, int64_t max_elements) {
    if (t->ndim < 0 || t->ndim > AF_MAX_DIMS || af_dtype_size(t->dtype) == 0) return -1;
    int64_t last = 0;
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] < 0 || t->strides[d] < 0) return -1;
        if (t->shape[d] == 0) return 0;
    }
    for (int d = 0; d < t->ndim; d++) {
        int64_t step;
        if (__builtin_mul_overflow(t->shape[d] - 1, t->strides[d], &step) || __builtin_add_overflow(last, step, &last))
            return -1;
    }
    if (last > max_elements) return TOO_BIG;
    return (last + 1) * (int64_t)af_dtype_size(t->dtype);
}

/* One view of af_flash_attn's (and its backward's) harnesses: a kind byte (dtype, whether ndim is decoded, CUDA,
 * misalignment, NULL data), shape and strides, then its bytes; index arrays may be int32. The caller frees the
 * returned allocation. */
static inline void *make_flash_view(byte_reader *r, af_tensor *t, int want_ndim, bool index_array,
                                    int64_t max_elements) {
    memset(t, 0, sizeof *t);
    const uint8_t kind = next_byte(r);
    t->dtype = index_array && (kind & 0x30) ? AF_I32 : (af_dtype)(kind % 8);   /* float8 included; 7 is not a dtype */
    t->ndim = (kind & 0x80) == 0 ? want_ndim : (int)(next_byte(r) % 10);
    if (t->ndim > AF_MAX_DIMS) t->ndim = AF_MAX_DIMS + 1;
    for (int d = 0; d < t->ndim && d < AF_MAX_DIMS; d++) t->shape[d] = next_extent(r);
    for (int d = 0; d < t->ndim && d < AF_MAX_DIMS; d++) t->strides[d] = next_extent(r);
    if (kind & 0x08) t->device.type = AF_DEVICE_CUDA;   /* must be refused before anything is read */
    const int64_t bytes = reach_bytes(t, max_elements);
    const size_t misaligned = ((kind >> 4) & 3) == 3;   /* data one byte off the allocation: refused */
    const size_t alloc = (bytes > 0 ? (size_t)bytes : 4) + misaligned;
    uint8_t *mem = malloc(alloc);
    if (t->dtype == AF_I32)
        for (size_t i = misaligned; i + 4 <= alloc; i += 4) {
            const int32_t v = (int8_t)next_byte(r) / 4;
            memcpy(mem + i, &v, 4);
        }
    else
        for (size_t i = 0; i < alloc; i++) mem[i] = next_byte(r);   /* anything, NaN and Inf included */
    t->data = ((kind & 0x40) && bytes <= 0) || bytes == TOO_BIG ? NULL : mem + misaligned;
    return mem;
}

#endif
