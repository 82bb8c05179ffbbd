/* Working memory does not grow with L·S: the score matrix is never materialised. Peak RSS growth of one
 * af_sdpa call at L = S = 2048 (a score matrix would be 4·4·2048·2048 bytes = 64 MiB) must stay under 8 MiB. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <sys/resource.h>

#include "attnforge.h"
#include "cli_common.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define RSS_MEANINGFUL 0   /* sanitizers keep shadow memory and quarantine: RSS says nothing about us */
#else
#define RSS_MEANINGFUL 1
#endif

static double peak_rss_mib(void) {
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return (double)r.ru_maxrss / 1024.0;
}

static void peak_memory_independent_of_scores(void **state) {
    (void)state;
    if (!RSS_MEANINGFUL) skip();
    uint64_t seed = 3;
    const int64_t shape[4] = {1, 4, 2048, 64};
    cli_tensor q, k, v, out;
    assert_true(cli_tensor_random(&q, AF_F32, shape, false, &seed, 1.0));
    assert_true(cli_tensor_random(&k, AF_F32, shape, false, &seed, 1.0));
    assert_true(cli_tensor_random(&v, AF_F32, shape, false, &seed, 1.0));
    assert_true(cli_tensor_random(&out, AF_F32, shape, false, &seed, 1.0));   /* touched: counted already */
    af_sdpa_args args = {.query = &q.view, .key = &k.view, .value = &v.view};
    const double before = peak_rss_mib();
    assert_int_equal(af_sdpa(&args, &out.view, NULL), AF_OK);
    const double growth = peak_rss_mib() - before;
    printf("peak RSS growth of one call at L=S=2048, H=4: %.2f MiB (scores would be 64 MiB)\n", growth);
    assert_true(growth < 8.0);
    cli_tensor_free(&q); cli_tensor_free(&k); cli_tensor_free(&v); cli_tensor_free(&out);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(peak_memory_independent_of_scores)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
