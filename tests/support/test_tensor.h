/* Test tensors: strided views over a backing buffer that may be larger than the view (transposed, sliced,
 * padded), so tests can prove a kernel reads only the view and writes only the view. */
#ifndef AF_TESTS_TEST_TENSOR_H
#define AF_TESTS_TEST_TENSOR_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "attnforge.h"

/* A small, reproducible random generator (splitmix64): every seed, 0 included, is fine. */
typedef struct { uint64_t state; } test_rng;
uint64_t rng_next(test_rng *rng);
double rng_uniform(test_rng *rng);                          /* [0, 1) */
int64_t rng_range(test_rng *rng, int64_t lo, int64_t hi);    /* lo..hi inclusive */
bool rng_chance(test_rng *rng, double probability);
/* n values uniform in [-2, 2) with full mantissas, rounded to dtype (f32, f16 or bf16) into data: products and their
 * sums round, so any change in the order of a reduction shows (a coarse grid would make every dot product exact). */
void rng_fill_values(test_rng *rng, void *data, af_dtype dtype, int64_t n);
/* calloc that never returns NULL (0 bytes: 1 byte); aborts with a message when memory runs out. */
void *test_zalloc(size_t bytes);

typedef enum {
    LAYOUT_CONTIGUOUS = 0,   /* row-major */
    LAYOUT_NHD,              /* dims 1 and 2 swapped in memory: x_nhd.transpose(1, 2) */
    LAYOUT_SLICED,           /* a slice of a bigger buffer: padded dims, inner stride > 1, offset, maybe permuted */
    LAYOUT_COUNT
} tensor_layout;
const char *layout_name(tensor_layout layout);

typedef struct {
    af_tensor view;
    unsigned char *memory;   /* the backing buffer; view.data points inside it */
    size_t bytes;
} test_tensor;

/* The byte every output buffer is filled with before a call, to see what a call wrote. */
#define TT_SENTINEL_BYTE 0xA5

/* Allocate a view of `shape` in `layout` (rng picks the padding of a sliced layout). The whole backing buffer
 * is filled with poison: NaN for float dtypes (a read outside the view shows up as NaN), zero for bool. */
bool tt_alloc(test_tensor *t, af_dtype dtype, int ndim, const int64_t *shape, tensor_layout layout, test_rng *rng);
/* The general form: dims laid out in memory in `order` (outermost first), each padded by pad[d] elements, the
 * innermost with element stride `step`, the view starting `offset` elements into the buffer. */
bool tt_alloc_ordered(test_tensor *t, af_dtype dtype, int ndim, const int64_t *shape, const int *order,
                      const int64_t *pad, int64_t step, int64_t offset);
void tt_free(test_tensor *t);

/* Every view element uniform in [-amplitude, amplitude), rounded to the dtype (bool: true with `amplitude` chance). */
void tt_fill_uniform(test_tensor *t, test_rng *rng, double amplitude);
void tt_fill_bytes(test_tensor *t, unsigned char byte);   /* the whole backing buffer */

double tt_get(const test_tensor *t, const int64_t *idx);
void tt_set(test_tensor *t, const int64_t *idx, double value);
int64_t tt_numel(const test_tensor *t);

/* Steps idx through shape in row-major order; false after the last index (or at once for an empty shape). */
bool tt_next_index(int ndim, const int64_t *shape, int64_t *idx);

/* True when every byte of the backing buffer outside the view's elements still equals `byte`. */
bool tt_outside_view_is(const test_tensor *t, unsigned char byte);

/* A copy of the backing buffer, to prove later that nothing changed (tt_same_as). */
unsigned char *tt_snapshot(const test_tensor *t);
bool tt_same_as(const test_tensor *t, const unsigned char *snapshot);

/* Max |x| and max row norm over the last dim, non-finite elements skipped. */
void tt_magnitudes(const test_tensor *t, double *max_abs, double *max_row_norm);

#endif
