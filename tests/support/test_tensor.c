#include "test_tensor.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"

uint64_t rng_next(test_rng *rng) {
    uint64_t z = (rng->state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double rng_uniform(test_rng *rng) { return (double)(rng_next(rng) >> 11) * (1.0 / 9007199254740992.0); }

int64_t rng_range(test_rng *rng, int64_t lo, int64_t hi) {
    return lo + (int64_t)(rng_next(rng) % (uint64_t)(hi - lo + 1));
}

void rng_fill_values(test_rng *rng, void *data, af_dtype dtype, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float x = (float)(rng_uniform(rng) * 4.0 - 2.0);
        if (dtype == AF_F32) ((float *)data)[i] = x;
        else ((uint16_t *)data)[i] = dtype == AF_BF16 ? af_f32_to_bf16(x) : af_f32_to_f16(x);
    }
}

void *test_zalloc(size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "test_zalloc: out of memory (%zu bytes)\n", bytes);
        abort();
    }
    return p;
}

bool rng_chance(test_rng *rng, double probability) { return rng_uniform(rng) < probability; }

const char *layout_name(tensor_layout layout) {
    switch (layout) {
    case LAYOUT_CONTIGUOUS: return "contiguous";
    case LAYOUT_NHD: return "nhd";
    case LAYOUT_SLICED: return "sliced";
    default: return "?";
    }
}

/* Memory order of the dims, outermost first: identity, dims 1 and 2 swapped, or (sliced) sometimes shuffled. */
static void memory_order(int ndim, tensor_layout layout, test_rng *rng, int *order) {
    for (int d = 0; d < ndim; d++) order[d] = d;
    if (layout == LAYOUT_NHD && ndim >= 3) {
        order[1] = 2;
        order[2] = 1;
    }
    if (layout == LAYOUT_SLICED && rng_chance(rng, 0.5)) {
        for (int d = ndim - 1; d > 0; d--) {   /* Fisher–Yates */
            int j = (int)rng_range(rng, 0, d), tmp = order[d];
            order[d] = order[j];
            order[j] = tmp;
        }
    }
}

static void poison(test_tensor *t) {
    if (t->view.dtype == AF_BOOL) {
        memset(t->memory, 0, t->bytes);
        return;
    }
    const size_t elem = af_dtype_size(t->view.dtype);
    for (size_t off = 0; off + elem <= t->bytes; off += elem) af_store_from_f32(t->memory + off, t->view.dtype, NAN);
}

bool tt_alloc_ordered(test_tensor *t, af_dtype dtype, int ndim, const int64_t *shape, const int *order,
                      const int64_t *pad, int64_t step, int64_t offset) {
    memset(t, 0, sizeof *t);
    t->view.dtype = dtype;
    t->view.ndim = ndim;
    int64_t stride = step;
    for (int k = ndim - 1; k >= 0; k--) {
        const int d = order[k];
        t->view.shape[d] = shape[d];
        t->view.strides[d] = stride;
        stride *= shape[d] + pad[d] > 0 ? shape[d] + pad[d] : 1;
    }
    const size_t elem = af_dtype_size(dtype);
    t->bytes = (size_t)(offset + stride + 1) * elem;
    void *memory = NULL;   /* 64-byte aligned, like a framework's allocator: kernels may take aligned fast paths */
    if (posix_memalign(&memory, 64, t->bytes) != 0) return false;
    t->memory = memory;
    t->view.data = t->memory + (size_t)offset * elem;
    poison(t);
    return true;
}

bool tt_alloc(test_tensor *t, af_dtype dtype, int ndim, const int64_t *shape, tensor_layout layout, test_rng *rng) {
    int order[AF_MAX_DIMS];
    int64_t pad[AF_MAX_DIMS] = {0}, step = 1, offset = 0;
    memory_order(ndim, layout, rng, order);
    if (layout == LAYOUT_SLICED) {
        for (int d = 0; d < ndim; d++) pad[d] = rng_range(rng, 0, 2);
        step = rng_range(rng, 1, 3);
        offset = rng_range(rng, 0, 5);
    }
    return tt_alloc_ordered(t, dtype, ndim, shape, order, pad, step, offset);
}

void tt_free(test_tensor *t) {
    free(t->memory);
    memset(t, 0, sizeof *t);
}

bool tt_next_index(int ndim, const int64_t *shape, int64_t *idx) {
    for (int d = ndim - 1; d >= 0; d--) {
        if (++idx[d] < shape[d]) return true;
        idx[d] = 0;
    }
    return false;
}

int64_t tt_numel(const test_tensor *t) {
    int64_t n = 1;
    for (int d = 0; d < t->view.ndim; d++) n *= t->view.shape[d];
    return n;
}

static size_t element_offset(const af_tensor *v, const int64_t *idx) {
    int64_t off = 0;
    for (int d = 0; d < v->ndim; d++) off += idx[d] * v->strides[d];
    return (size_t)off * af_dtype_size(v->dtype);
}

double tt_get(const test_tensor *t, const int64_t *idx) {
    return af_load_as_f32((const char *)t->view.data + element_offset(&t->view, idx), t->view.dtype);
}

void tt_set(test_tensor *t, const int64_t *idx, double value) {
    af_store_from_f32((char *)t->view.data + element_offset(&t->view, idx), t->view.dtype, (float)value);
}

void tt_fill_uniform(test_tensor *t, test_rng *rng, double amplitude) {
    if (tt_numel(t) == 0) return;
    int64_t idx[AF_MAX_DIMS] = {0};
    do {
        const double x = t->view.dtype == AF_BOOL ? rng_chance(rng, amplitude) : (2.0 * rng_uniform(rng) - 1.0) * amplitude;
        tt_set(t, idx, x);
    } while (tt_next_index(t->view.ndim, t->view.shape, idx));
}

void tt_fill_bytes(test_tensor *t, unsigned char byte) { memset(t->memory, byte, t->bytes); }

bool tt_outside_view_is(const test_tensor *t, unsigned char byte) {
    unsigned char *inside = calloc(t->bytes, 1);
    if (!inside) return false;
    const size_t elem = af_dtype_size(t->view.dtype), start = (size_t)((unsigned char *)t->view.data - t->memory);
    if (tt_numel(t) > 0) {
        int64_t idx[AF_MAX_DIMS] = {0};
        do memset(inside + start + element_offset(&t->view, idx), 1, elem);
        while (tt_next_index(t->view.ndim, t->view.shape, idx));
    }
    bool same = true;
    for (size_t i = 0; i < t->bytes && same; i++) same = inside[i] || t->memory[i] == byte;
    free(inside);
    return same;
}

unsigned char *tt_snapshot(const test_tensor *t) {
    unsigned char *copy = malloc(t->bytes ? t->bytes : 1);
    if (copy && t->bytes) memcpy(copy, t->memory, t->bytes);
    return copy;
}

bool tt_same_as(const test_tensor *t, const unsigned char *snapshot) {
    return t->bytes == 0 || memcmp(t->memory, snapshot, t->bytes) == 0;
}

void tt_magnitudes(const test_tensor *t, double *max_abs, double *max_row_norm) {
    *max_abs = 0.0;
    *max_row_norm = 0.0;
    if (tt_numel(t) == 0) return;
    const int last = t->view.ndim - 1;
    int64_t idx[AF_MAX_DIMS] = {0};
    double row_sq = 0.0;
    do {
        const double x = tt_get(t, idx);
        if (isfinite(x)) {
            row_sq += x * x;
            if (fabs(x) > *max_abs) *max_abs = fabs(x);
        }
        if (last < 0 || idx[last] == t->view.shape[last] - 1) {   /* end of a row */
            if (sqrt(row_sq) > *max_row_norm) *max_row_norm = sqrt(row_sq);
            row_sq = 0.0;
        }
    } while (tt_next_index(t->view.ndim, t->view.shape, idx));
}
