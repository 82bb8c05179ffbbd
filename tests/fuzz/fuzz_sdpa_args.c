/* libFuzzer harness for af_sdpa's argument checking: shapes, strides, dtypes, flags and masks decoded from
 * the input, data buffers sized exactly to what each view can reach (so ASan sees any stray access), a quarter of
 * them starting one byte off the allocation (UBSan sees any typed access through a misaligned pointer).
 * Invariants: no crash or sanitizer report; on error `out` is untouched; on success af_sdpa and the reference
 * agree on the status, and both write only inside `out`. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"
#include "fuzz_views.h"

#define MAX_VIEW_ELEMENTS (1 << 20)   /* larger views get NULL data */

static void *make_view(byte_reader *r, af_tensor *t, int force_ndim) {
    memset(t, 0, sizeof *t);
    uint8_t kind = next_byte(r);
    t->dtype = (af_dtype)(kind % 5);            /* 4 is not a dtype */
    t->ndim = force_ndim >= 0 && (kind & 0x80) == 0 ? force_ndim : (int)(next_byte(r) % 10);
    if (t->ndim > AF_MAX_DIMS) t->ndim = AF_MAX_DIMS + 1;
    for (int d = 0; d < t->ndim && d < AF_MAX_DIMS; d++) t->shape[d] = next_extent(r);
    for (int d = 0; d < t->ndim && d < AF_MAX_DIMS; d++) t->strides[d] = next_extent(r);
    int64_t bytes = reach_bytes(t, MAX_VIEW_ELEMENTS);
    const size_t misaligned = ((kind >> 4) & 3) == 3;   /* data one byte past the allocation's start: refused */
    size_t alloc = (bytes > 0 ? (size_t)bytes : 1) + misaligned;
    uint8_t *mem = malloc(alloc);
    for (size_t i = 0; i < alloc; i++) mem[i] = next_byte(r);   /* values: anything, NaN and Inf included */
    t->data = ((kind & 0x40) && bytes <= 0) || bytes == TOO_BIG ? NULL : mem + misaligned;
    return mem;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    byte_reader r = {data, size, 0};
    af_tensor q, k, v, out, mask, lse;
    void *mq = make_view(&r, &q, 4), *mk = make_view(&r, &k, 4), *mv = make_view(&r, &v, 4);
    void *mo = make_view(&r, &out, 4), *mm = make_view(&r, &mask, 2), *ml = make_view(&r, &lse, 3);
    uint8_t flags = next_byte(&r);
    af_sdpa_args args = {.query = &q, .key = &k, .value = &v, .attn_mask = (flags & 1) ? &mask : NULL,
                         .dropout_p = (flags & 2) ? 0.5 : 0.0, .is_causal = flags & 4, .enable_gqa = flags & 8,
                         .causal_bottom_right = flags & 16, .has_scale = flags & 32,
                         .scale = (flags & 64) ? NAN : (double)(int8_t)next_byte(&r) / 16.0};
    af_tensor *lse_arg = (flags & 128) ? &lse : NULL;

    int64_t out_bytes = reach_bytes(&out, MAX_VIEW_ELEMENTS);
    size_t out_len = out_bytes > 0 ? (size_t)out_bytes : 0;
    uint8_t *before = malloc(out_len + 1);
    if (out_len) memcpy(before, out.data, out_len);
    af_status st = af_sdpa(&args, &out, lse_arg);
    if (st != AF_OK && out_len && out.data && memcmp(before, out.data, out_len) != 0) abort();   /* wrote on error */
    if (st != AF_OK && af_last_error()[0] == '\0') abort();                                     /* error without a message */
    if (st == AF_OK) {
        af_status ref = af_sdpa_reference(&args, &out, lse_arg);
        if (ref != AF_OK) abort();   /* the same checks guard both paths */
    }
    free(before);
    free(mq); free(mk); free(mv); free(mo); free(mm); free(ml);
    return 0;
}
