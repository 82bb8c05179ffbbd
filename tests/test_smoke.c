/* Smoke test: one small call through af_sdpa agrees with the reference on every ISA this machine has. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "attnforge.h"
#include "cli_common.h"
#include "sdpa/problem.h"

static void smoke_every_isa(void **state) {
    (void)state;
    for (int i = 0; af_isa_name(i); i++) {
        if (!af_isa_available(af_isa_name(i))) continue;
        assert_int_equal(af_set_isa(af_isa_name(i)), AF_OK);
        uint64_t seed = 7;
        cli_tensor q, k, v, out, ref;
        const int64_t qs[4] = {2, 4, 33, 40}, ks[4] = {2, 2, 70, 40}, vs[4] = {2, 2, 70, 24}, os[4] = {2, 4, 33, 24};
        assert_true(cli_tensor_random(&q, AF_F32, qs, false, &seed, 1.0));
        assert_true(cli_tensor_random(&k, AF_F32, ks, true, &seed, 1.0));
        assert_true(cli_tensor_random(&v, AF_F32, vs, false, &seed, 1.0));
        assert_true(cli_tensor_zeros(&out, AF_F32, 4, os));
        assert_true(cli_tensor_zeros(&ref, AF_F32, 4, os));
        af_sdpa_args args = {.query = &q.view, .key = &k.view, .value = &v.view, .is_causal = true, .enable_gqa = true};
        assert_int_equal(af_sdpa(&args, &out.view, NULL), AF_OK);
        assert_int_equal(af_reference_f32(&args, &ref.view, NULL), AF_OK);
        cli_compare c = cli_compare_to_reference(&args, &out.view, &ref.view);
        assert_true(c.worst_ratio <= 1.0);
        assert_true(c.max_error < 1e-5);
        cli_tensor_free(&q); cli_tensor_free(&k); cli_tensor_free(&v); cli_tensor_free(&out); cli_tensor_free(&ref);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(smoke_every_isa)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
