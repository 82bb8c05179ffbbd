/* What check.c offers besides af_sdpa_check (sdpa/problem.h): the extra rule of the f32 reference's output. */
#ifndef AF_SDPA_CHECK_H
#define AF_SDPA_CHECK_H
#include "attnforge.h"

/* After af_sdpa_check accepted the call with `out_f32` taken in the query's dtype: `out_f32` as the float32 view the
 * f32 reference writes (twice the bytes for f16/bf16 queries) must fit in int64 bytes, not wrap the address space,
 * and not overlap an input or lse. */
af_status af_check_out_as_f32(const af_sdpa_args *args, const af_tensor *out_f32, const af_tensor *lse);

#endif
