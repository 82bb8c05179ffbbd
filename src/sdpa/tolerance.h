/* How far a kernel's output may lie from the double reference: the one place tolerances are stated. */
#ifndef AF_SDPA_TOLERANCE_H
#define AF_SDPA_TOLERANCE_H
#include <stdint.h>

#include "attnforge.h"

typedef struct {
    double value_max;   /* max |v| over the value tensor */
    double logit_max;   /* bound on |scale·q·k| (plus |mask|), e.g. |scale|·max‖q‖·max‖k‖ */
    int64_t E, S;       /* head dim of q·k and keys per row */
    double logit_error; /* absolute error of each logit from an approximate function in the kernel (0: none), e.g.
                           a softcap on tanh.approx.f32: cap·AF_TANH_APPROX_ERROR */
} af_error_scale;

#define AF_TANH_APPROX_ERROR 0x1.03p-11   /* tanh.approx.f32's relative error, at most 2^-10.987 (PTX ISA) */

/* Largest |out - ref| accepted for one output element whose reference value is `ref`:
 *   2·u(out)·|ref|                         rounding of the output to its dtype (one ulp of slack)
 * + value_max·(4·p(out)                     polynomial exp2 error (degree chosen by the output dtype)
 *              + u(out) for f16/bf16        P rounded to the input dtype before P·V (AMX, CUDA tensor cores)
 *              + 8·u32·√E·(1 + logit_max)   f32 scores: absolute error of the logits moves every weight
 *              + 4·u32·√S + 64·u32          f32 accumulation of l and O over S keys
 *              + 2·logit_error)             every weight off by a factor e^±logit_error: l and P·V each move
 *                                           by that, so O by twice it
 * with u = unit roundoff (f32 2^-24, f16 2^-11, bf16 2^-8) and p = 2^-23, 2^-18, 2^-13 for f32, f16, bf16.
 * float8 inputs (af_flash_attn) are exact in f32 and converted exactly: the same bound holds with out's dtype,
 * value_max the largest |v·v_descale| and logit_max taken over the descaled scores (scale·q_descale·k_descale·q·k). */
double af_error_bound(af_dtype out_dtype, double ref, const af_error_scale *scale);

#endif
