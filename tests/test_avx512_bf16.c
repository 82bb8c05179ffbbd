/* The AVX512-BF16 products (src/kernel/ukernel_avx512_bf16.c: vdpbf16ps Q·Kᵀ and P·V) against the double
 * reference: the scores on ragged rows, row offsets, keys and head dims (odd E, keys past a 32-key group), NaN
 * propagation and the columns S may not write; the values likewise (P rounded to bf16 as the products round it, odd
 * key counts, Ev across 16- and 32-column groups, P's columns past cols not read, NaN, O's columns not written); then the random suite's bf16 cases (and more bf16 cases past them)
 * through af_sdpa on the avx512 table with these products forced in, for 1 and 2 threads, checked with
 * af_error_bound and counted to be sure the products ran. Skips, saying why, where the build or the CPU lacks
 * AVX512-BF16. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "attnforge.h"
#include "case_gen.h"
#include "core/cpu.h"
#include "core/dtype.h"
#include "kernel/dispatch_testing.h"
#include "kernel/ukernel.h"
#include "test_tensor.h"

#define CANARY 12345.0f
#define SUITE_SEED 20240601u   /* test_sdpa_random's */
#define SPLIT_KV_EVERY 10

/* NULL when this build and CPU run the products; else why not. */
static const char *unavailable(void) {
#ifndef AF_HAVE_AVX512_BF16
    return "this build has no AVX512-BF16 products (not x86-64, AF_WITH_AVX512 off, or the compiler lacks -mavx512bf16)";
#else
    if (!af_cpu()->avx512) return "this CPU or OS has no AVX-512";
    if (!af_cpu()->avx512_bf16) return "this CPU has no AVX512-BF16 (vdpbf16ps)";
    return NULL;
#endif
}

#define SKIP_UNLESS_AVAILABLE()                                          \
    do {                                                                 \
        const char *why_ = unavailable();                                \
        if (why_) {                                                      \
            print_message("skipped: %s\n", why_);                        \
            skip();                                                      \
        }                                                                \
    } while (0)

#ifdef AF_HAVE_AVX512_BF16
static const af_products *px(void) { return &af_products_avx512_bf16; }

static test_rng rng = {0x2545F4914F6CDD1Dull};
static double uniform(void) { return rng_uniform(&rng); }
static int range(int lo, int hi) { return lo + (int)(uniform() * (hi - lo + 1)); }
static int round_up(int x, int to) { return (x + to - 1) / to * to; }

static void *aligned(size_t bytes) {
    void *p = NULL;
    assert_int_equal(posix_memalign(&p, 64, bytes + 64), 0);
    return p;
}

/* S = Q·Kᵀ for the rows row0.. of a `block`-row Q block and `cols` keys of E bf16 (rows key_stride apart), with a
 * NaN in key nan_key's first element when nan_key >= 0, against double dot products. */
static void check_scores(int block, int row0, int cols, int E, int key_stride, int nan_key) {
    const int rows = block - row0, lds = round_up(cols, AF_TILE_PAD) + AF_TILE_PAD;
    float *q = aligned(sizeof(float) * (size_t)block * E);
    for (int i = 0; i < block * E; i++) q[i] = af_bf16_to_f32(af_f32_to_bf16((float)(2.0 * uniform() - 1.0)));
    uint16_t *k = aligned(sizeof(uint16_t) * ((size_t)cols * key_stride));
    for (int i = 0; i < cols * key_stride; i++) k[i] = af_f32_to_bf16((float)(2.0 * uniform() - 1.0));
    for (int j = 0; j < cols; j++)   /* NaN between the rows: a read past a row shows */
        for (int e = E; e < key_stride; e++) k[(size_t)j * key_stride + e] = 0x7fc0;
    if (nan_key >= 0) k[(size_t)nan_key * key_stride] = 0x7fc0;
    void *qpack = aligned(px()->q_bytes(block, E)), *kpack = aligned(px()->k_bytes(cols, E));
    px()->pack_q(block, E, q, E, qpack);
    px()->pack_k(cols, E, k, (size_t)key_stride * 2, AF_BF16, kpack);
    float *S = aligned(sizeof(float) * (size_t)(rows + 1) * lds);
    for (int i = 0; i < (rows + 1) * lds; i++) S[i] = CANARY;
    px()->scores(rows, cols, E, qpack, row0, kpack, S, lds);
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++) {
            double exact = 0.0, mag = 0.0;
            for (int e = 0; e < E; e++) {
                const double t = (double)q[(size_t)(row0 + r) * E + e] * af_bf16_to_f32(k[(size_t)j * key_stride + e]);
                exact += t;
                mag += fabs(t);
            }
            const double got = S[(size_t)r * lds + j];
            if (j == nan_key) {
                if (!isnan(got)) fail_msg("E %d: the NaN in key %d gave S[%d][%d] = %g", E, j, r, j, got);
                continue;
            }
            /* exact products, f32 sums of E terms (two roundings a pair): (E + 2)·u·Σ|q·k| */
            const double bound = (E + 2) * ldexp(1.0, -24) * mag;
            if (!(fabs(got - exact) <= bound))
                fail_msg("block %d row0 %d cols %d E %d: S[%d][%d] = %.9g, exact %.9g (bound %.3g)", block, row0, cols, E,
                         r, j, got, exact, bound);
        }
    for (int r = 0; r <= rows; r++)   /* writable: columns up to round_up(cols, 16) of the rows asked for */
        for (int j = r < rows ? round_up(cols, AF_TILE_PAD) : 0; j < lds; j++)
            if (S[(size_t)r * lds + j] != CANARY) fail_msg("cols %d E %d: S[%d][%d] written", cols, E, r, j);
    free(q), free(k), free(qpack), free(kpack), free(S);
}

static void scores_match_exact(void **state) {
    (void)state;
    SKIP_UNLESS_AVAILABLE();
    static const int dims[] = {1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 96, 127, 128, 129, 200, 256, 300};
    const int ndims = (int)(sizeof dims / sizeof dims[0]);
    for (int t = 0; t < 80; t++) {
        const int E = t < ndims ? dims[t] : range(1, 300), block = range(1, 40);
        const int cols = t < ndims ? dims[ndims - 1 - t] % 97 + 1 : range(1, 130);
        check_scores(block, range(0, block - 1), cols, E, E + range(0, 5), t % 5 == 2 ? range(0, cols - 1) : -1);
    }
    check_scores(240, 0, 64, 128, 128, -1);   /* the driver's full blocks */
    check_scores(36, 12, 64, 64, 64, 63);
}

/* O += P·V for `rows` rows, `cols` keys, Ev columns of bf16 V (rows key_stride apart); P as the softmax leaves it
 * (in [0, 2^8], some exact 0, NaN past cols), a NaN at (nan_row, some key) when nan_row >= 0. */
static void check_values(int rows, int cols, int Ev, int key_stride, int nan_row) {
    const int ldp = round_up(cols, AF_TILE_PAD) + AF_TILE_PAD, ldo = round_up(Ev, AF_TILE_PAD) + AF_TILE_PAD;
    float *P = aligned(sizeof(float) * (size_t)rows * ldp);
    for (int i = 0; i < rows * ldp; i++)
        P[i] = i % ldp >= cols ? NAN : uniform() < 0.1 ? 0.0f : (float)ldexp(uniform(), range(-12, 8));
    if (nan_row >= 0) P[(size_t)nan_row * ldp + range(0, cols - 1)] = NAN;
    uint16_t *v = aligned(sizeof(uint16_t) * ((size_t)cols * key_stride));
    for (int i = 0; i < cols * key_stride; i++) v[i] = i % key_stride >= Ev ? 0x7fc0 : af_f32_to_bf16((float)(4.0 * uniform() - 2.0));
    void *vpack = aligned(px()->v_bytes(cols, Ev));
    px()->pack_v(cols, Ev, v, (size_t)key_stride * 2, AF_BF16, vpack);
    float *O = aligned(sizeof(float) * (size_t)(rows + 1) * ldo), *O0 = aligned(sizeof(float) * (size_t)rows * ldo);
    for (int i = 0; i < (rows + 1) * ldo; i++) O[i] = i < rows * ldo && i % ldo < Ev ? (float)(uniform() - 0.5) : CANARY;
    memcpy(O0, O, sizeof(float) * (size_t)rows * ldo);
    px()->values(rows, Ev, cols, P, ldp, vpack, O, ldo);
    for (int r = 0; r < rows; r++)
        for (int e = 0; e < Ev; e++) {
            const double got = O[(size_t)r * ldo + e];
            if (r == nan_row) {
                if (!isnan(got)) fail_msg("rows %d cols %d Ev %d: NaN in P row %d did not reach O[%d][%d]", rows, cols, Ev, r, r, e);
                continue;
            }
            double exact = O0[(size_t)r * ldo + e], mag = fabs(exact);
            for (int j = 0; j < cols; j++) {   /* P rounded to bf16 as the products round it; products exact */
                const double t = (double)af_bf16_to_f32(af_f32_to_bf16(P[(size_t)r * ldp + j])) *
                                 af_bf16_to_f32(v[(size_t)j * key_stride + e]);
                exact += t;
                mag += fabs(t);
            }
            const double bound = (cols + 2) * ldexp(1.0, -24) * mag;
            if (!(fabs(got - exact) <= bound))
                fail_msg("rows %d cols %d Ev %d: O[%d][%d] = %.9g, exact %.9g (bound %.3g)", rows, cols, Ev, r, e, got, exact, bound);
        }
    for (int r = 0; r <= rows; r++)   /* writable: columns up to round_up(Ev, 16) of the rows asked for */
        for (int e = r < rows ? round_up(Ev, AF_TILE_PAD) : 0; e < ldo; e++)
            if (O[(size_t)r * ldo + e] != CANARY) fail_msg("Ev %d: O[%d][%d] written", Ev, r, e);
    free(P), free(v), free(vpack), free(O), free(O0);
}

static void values_match_exact(void **state) {
    (void)state;
    SKIP_UNLESS_AVAILABLE();
    static const int dims[] = {1, 2, 3, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 96, 127, 128, 129, 200, 256, 300};
    const int ndims = (int)(sizeof dims / sizeof dims[0]);
    for (int t = 0; t < 80; t++) {
        const int Ev = t < ndims ? dims[t] : range(1, 300), rows = range(1, 40);
        const int cols = t < ndims ? dims[ndims - 1 - t] % 150 + 1 : range(1, 150);
        check_values(rows, cols, Ev, Ev + range(0, 5), t % 7 == 3 ? range(0, rows - 1) : -1);
    }
    check_values(240, 64, 128, 128, -1);   /* the driver's full blocks */
    check_values(13, 65, 33, 40, 12);
}

/* The driver's route: the avx512 table with these products, each scores call counted. */
static long scores_calls;
static void counted_scores(int rows, int cols, int E, const void *qpack, int row0, const void *kpack, float *S, int lds) {
    __atomic_add_fetch(&scores_calls, 1, __ATOMIC_RELAXED);
    af_products_avx512_bf16.scores(rows, cols, E, qpack, row0, kpack, S, lds);
}

static void sdpa_bf16_cases_match_reference(void **state) {
    (void)state;
    SKIP_UNLESS_AVAILABLE();
    af_products counted = af_products_avx512_bf16;
    counted.scores = counted_scores;
    af_ukernel table = af_ukernel_avx512;
    table.products = &counted;
    const int count = 3 * case_suite_count(300);
    int ran = 0, on_products = 0;
    double worst_ratio = 0.0;
    for (int index = 0; index < count; index++) {
        const sdpa_case c = case_random(case_suite_seed(SUITE_SEED), index, SPLIT_KV_EVERY);
        if (c.dtype != AF_BF16) continue;
        char desc[640], why[640] = "";
        case_describe(&c, desc, sizeof desc);
        case_tensors t;
        if (!case_build(&c, &t)) fail_msg("could not build the case (%s): %s", af_last_error(), desc);
        const long before = scores_calls;
        for (int threads = 1; threads <= 2 && !why[0]; threads++) {
            af_ukernel_force_for_tests(&table);
            af_set_num_threads(threads);
            const af_status st = af_sdpa(&t.args, &t.out.view, c.with_lse ? &t.lse.view : NULL);
            af_ukernel_force_for_tests(NULL);
            double worst = 0.0;
            if (st != AF_OK) snprintf(why, sizeof why, "status %s: %s", af_status_name(st), af_last_error());
            else if (case_matches_reference(&t, &worst, why, sizeof why)) why[0] = 0;
            if (worst > worst_ratio) worst_ratio = worst;
        }
        on_products += scores_calls > before;
        ran++;
        case_free(&t);
        if (why[0]) fail_msg("%s\n    %s", desc, why);
    }
    af_set_num_threads(0);
    print_message("%d bf16 cases within af_error_bound (worst %.3f of it), %d of them on the vdpbf16ps products\n", ran,
                  worst_ratio, on_products);
    assert_true(ran > 0);
    assert_true(on_products * 3 >= ran);   /* most bf16 cases have enough rows: the products must have run */
}

static void chosen_for_bf16_where_available(void **state) {
    (void)state;
    SKIP_UNLESS_AVAILABLE();
    const char *env = getenv("ATTNFORGE_AVX512_BF16");
    if (af_set_isa("avx512") != AF_OK) fail_msg("avx512 not selectable: %s", af_last_error());
    const af_ukernel *uk = af_ukernel_current();
    if (env && strcmp(env, "0") == 0) assert_null(uk->products);
    else assert_ptr_equal(uk->products, &af_products_avx512_bf16);
    af_ukernel_force_for_tests(NULL);
}
#else
static void scores_match_exact(void **state) { (void)state; SKIP_UNLESS_AVAILABLE(); }
static void values_match_exact(void **state) { (void)state; SKIP_UNLESS_AVAILABLE(); }
static void sdpa_bf16_cases_match_reference(void **state) { (void)state; SKIP_UNLESS_AVAILABLE(); }
static void chosen_for_bf16_where_available(void **state) { (void)state; SKIP_UNLESS_AVAILABLE(); }
#endif

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(scores_match_exact),
        cmocka_unit_test(values_match_exact),
        cmocka_unit_test(sdpa_bf16_cases_match_reference),
        cmocka_unit_test(chosen_for_bf16_where_available),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
