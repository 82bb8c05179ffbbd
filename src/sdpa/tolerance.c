#include "sdpa/tolerance.h"

#include <math.h>

double af_error_bound(af_dtype out_dtype, double ref, const af_error_scale *s) {
    const double u32 = ldexp(1.0, -24);
    double u_out = u32, poly = ldexp(1.0, -23);
    if (out_dtype == AF_F16) { u_out = ldexp(1.0, -11); poly = ldexp(1.0, -18); }
    if (out_dtype == AF_BF16) { u_out = ldexp(1.0, -8); poly = ldexp(1.0, -13); }
    const double internal = 4.0 * poly + 8.0 * u32 * sqrt((double)s->E) * (1.0 + s->logit_max) +
                            4.0 * u32 * sqrt((double)s->S) + 64.0 * u32;
    return 2.0 * u_out * fabs(ref) + s->value_max * internal;
}
