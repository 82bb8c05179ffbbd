/* What the argument fuzzers share: a reader of the input's bytes and the bytes a decoded view can reach. */
#ifndef AF_FUZZ_VIEWS_H
#define AF_FUZZ_VIEWS_H
#include <stddef.h>
#include <stdint.h>

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

#endif
