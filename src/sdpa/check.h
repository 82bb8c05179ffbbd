/* What check.c offers besides af_sdpa_check (sdpa/problem.h): the extra rule of the f32 reference's output. */
#ifndef AF_SDPA_CHECK_H
#define AF_SDPA_CHECK_H
#include <stdbool.h>
#include <stdint.h>

#include "attnforge.h"

/* After af_sdpa_check accepted the call with `out_f32` taken in the query's dtype: `out_f32` as the float32 view the
 * f32 reference writes (twice the bytes for f16/bf16 queries) must fit in int64 bytes, not wrap the address space,
 * and not overlap an input or lse. */
af_status af_check_out_as_f32(const af_sdpa_args *args, const af_tensor *out_f32, const af_tensor *lse);

/* check.c's rules, shared with af_flash_attn's boundary (flash_args.c).
 * af_view_span: a valid view (ndim, dtype, sizes and strides >= 0, no overflow, data set when it has elements,
 *               no address wrap); its byte span and element count. af_problem_strides: the strides a problem
 *               gets (an empty view's are replaced). af_no_self_overlap / af_spans_overlap: memory rules.
 * af_check_shape: "name: expected shape (..), got (..)". */
af_status af_view_span(const af_tensor *t, const char *name, int64_t *bytes, int64_t *numel);
void af_problem_strides(const af_tensor *t, int64_t numel, int64_t *strides);
bool af_no_self_overlap(const af_tensor *t);
bool af_spans_overlap(const void *a, int64_t a_bytes, const void *b, int64_t b_bytes);
af_status af_check_shape(const af_tensor *t, const char *name, int ndim, const int64_t *want);

/* af_flash_attn's NHD (B or pages, seq, H, D) or packed varlen (rows, H, D) view's strides in the problem's
 * (B, H, seq, dim) order (flash_args.c); a packed view's batch stride is 0. */
void af_flash_permute_strides(const af_tensor *t, int64_t numel, bool packed, int64_t *to);

#endif
