/* Public entry points for one SDPA call: check at the boundary, then hand the trusted problem on. */
#include "kernel/flash.h"
#include "sdpa/problem.h"
#include "core/status.h"

af_status af_sdpa(const af_sdpa_args *args, af_tensor *out, af_tensor *lse) {
    af_clear_error();
    af_problem p;
    af_status st = af_sdpa_check(args, out, lse, &p);
    if (st != AF_OK) return st;
    return af_flash_forward(&p);
}

af_status af_sdpa_reference(const af_sdpa_args *args, af_tensor *out, af_tensor *lse) {
    af_clear_error();
    af_problem p;
    af_status st = af_sdpa_check(args, out, lse, &p);
    if (st != AF_OK) return st;
    return af_reference_forward(&p);
}
