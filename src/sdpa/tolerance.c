#include "sdpa/tolerance.h"

#include <math.h>

double af_error_bound(af_dtype out_dtype, double ref, const af_error_scale *s) {
    const double u32 = ldexp(1.0, -24);
    double u_out = u32, poly = ldexp(1.0, -23);
    if (out_dtype == AF_F16) { u_out = ldexp(1.0, -11); poly = ldexp(1.0, -18); }
    if (out_dtype == AF_BF16) { u_out = ldexp(1.0, -8); poly = ldexp(1.0, -13); }
    /* f16/bf16: P may be rounded to the input dtype before P·V (the AMX products, the CUDA tensor cores, as in
     * FlashAttention). Each weight then carries a relative error |d_j| <= u (round to nearest), and l is summed from
     * the unrounded weights, so |dO| = |sum_j P_j·d_j·v_j| / l <= u·value_max·(sum_j P_j / l) = u·value_max. */
    const double p_round = out_dtype == AF_BF16 || out_dtype == AF_F16 ? u_out : 0.0;
    const double internal = 4.0 * poly + p_round + 8.0 * u32 * sqrt((double)s->E) * (1.0 + s->logit_max) +
                            4.0 * u32 * sqrt((double)s->S) + 64.0 * u32 + 2.0 * s->logit_error;
    return 2.0 * u_out * fabs(ref) + s->value_max * internal;
}
