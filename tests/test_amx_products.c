/* The AMX products (src/kernel/ukernel_amx.inc on emulated tiles) against the portable micro-kernel's gemm on
 * random bf16 tiles: ragged rows (1..40, from any packed row offset, as the causal skip asks), keys, E and Ev
 * (1..300, across tile, pair and stage edges), K and V rows with strides and ending at a guard page (a read past
 * a row's last element faults), canaries around everything S and O may not write, NaN propagation; plus the
 * blocking rule and accepts(). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include <sys/mman.h>
#include <unistd.h>

#include "amx_tile_emulated.h"
#include "attnforge.h"
#include "core/dtype.h"
#include "test_tensor.h"
#include "kernel/ukernel.h"
#include "ukernel_amx_emulated.h"

#define CANARY 12345.0f

static const af_products *px(void) { return &af_products_amx_emulated; }

static test_rng rng = {0x9E3779B97F4A7C15ull};

static double uniform(void) { return rng_uniform(&rng); }   /* [0, 1) */

static int range(int lo, int hi) { return lo + (int)(uniform() * (hi - lo + 1)); }
static int round_up(int x, int to) { return (x + to - 1) / to * to; }
static float bf16_round(float x) { return af_bf16_to_f32(af_f32_to_bf16(x)); }

static void *aligned(size_t bytes) {
    void *p = NULL;
    assert_int_equal(posix_memalign(&p, 64, bytes + 64), 0);
    return p;
}

/* `rows` rows of `n` bf16 elements, `stride` elements apart, whose last element is the last byte before an
 * inaccessible page. */
typedef struct { void *map; size_t map_bytes; uint16_t *rows; } guarded_rows;

static guarded_rows guarded_alloc(int rows, int n, int stride) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t bytes = ((size_t)(rows - 1) * stride + n) * sizeof(uint16_t);
    const size_t data_pages = (bytes + page - 1) / page;
    guarded_rows g = {.map_bytes = (data_pages + 1) * page};
    g.map = mmap(NULL, g.map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(g.map != MAP_FAILED);
    assert_int_equal(mprotect((char *)g.map + data_pages * page, page, PROT_NONE), 0);
    g.rows = (uint16_t *)((char *)g.map + data_pages * page - bytes);
    memset(g.map, 0xff, data_pages * page);   /* NaN between the rows: a read there shows */
    return g;
}

static void guarded_free(guarded_rows *g) { munmap(g->map, g->map_bytes); }

static void fill_rows(uint16_t *rows, int count, int n, int stride, double amplitude) {
    for (int j = 0; j < count; j++)
        for (int e = 0; e < n; e++) rows[(size_t)j * stride + e] = af_f32_to_bf16((float)(amplitude * (2.0 * uniform() - 1.0)));
}

/* ------------------------------------------------------------------------------------------------ scores */

/* S = Q·K^T for `rows` query rows starting at packed row `row0` of a block of `block` rows, `cols` keys. */
static void check_scores(int block, int row0, int cols, int E, int key_stride) {
    const int rows = block - row0, lds = round_up(cols, AF_TILE_PAD) + AF_TILE_PAD;
    float *q = aligned(sizeof(float) * (size_t)block * E);
    for (int i = 0; i < block * E; i++) q[i] = bf16_round((float)(2.0 * uniform() - 1.0));
    guarded_rows k = guarded_alloc(cols, E, key_stride);
    fill_rows(k.rows, cols, E, key_stride, 1.0);
    void *qpack = aligned(px()->q_bytes(block, E)), *kpack = aligned(px()->k_bytes(cols, E));
    px()->pack_q(block, E, q, E, qpack);
    px()->pack_k(cols, E, k.rows, (size_t)key_stride * 2, AF_BF16, kpack);
    float *S = aligned(sizeof(float) * (size_t)(rows + 1) * lds);
    for (int i = 0; i < (rows + 1) * lds; i++) S[i] = CANARY;
    const uint64_t dp_before = amx_emu_dp_count();
    px()->scores(rows, cols, E, qpack, row0, kpack, S, lds);
    assert_true(amx_emu_dp_count() > dp_before);

    /* the portable kernel's K^T pack and gemm on the same f32 values */
    const int ldkt = round_up(cols, AF_TILE_PAD);
    float *kt = aligned(sizeof(float) * (size_t)E * ldkt), *Sref = aligned(sizeof(float) * (size_t)rows * ldkt);
    af_ukernel_portable.pack_kt(cols, E, k.rows, (size_t)key_stride * 2, AF_BF16, kt, ldkt);
    af_ukernel_portable.gemm(rows, cols, E, q + (size_t)row0 * E, E, kt, ldkt, Sref, ldkt, false);
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++) {
            double mag = 0.0;
            for (int e = 0; e < E; e++) mag += fabs((double)q[(size_t)(row0 + r) * E + e] * af_bf16_to_f32(k.rows[(size_t)j * key_stride + e]));
            /* exact products, two f32 sums of E terms each side: (E + 3)·u·Σ|q·k| covers both orders */
            const double bound = 2.0 * (E + 3) * ldexp(1.0, -24) * mag, got = S[(size_t)r * lds + j];
            if (!(fabs(got - Sref[(size_t)r * ldkt + j]) <= bound))
                fail_msg("block %d row0 %d cols %d E %d: S[%d][%d] = %.9g, portable %.9g (bound %.3g)", block, row0, cols, E, r, j,
                         got, Sref[(size_t)r * ldkt + j], bound);
        }
    for (int r = 0; r <= rows; r++)   /* writable: columns up to round_up(cols, 16) of the rows asked for */
        for (int j = r < rows ? round_up(cols, AF_TILE_PAD) : 0; j < lds; j++)
            if (S[(size_t)r * lds + j] != CANARY) fail_msg("cols %d E %d: S[%d][%d] written", cols, E, r, j);
    free(q), free(qpack), free(kpack), free(S), free(kt), free(Sref);
    guarded_free(&k);
}

static void scores_match_portable(void **state) {
    (void)state;
    static const int dims[] = {1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 96, 127, 128, 129, 200, 256, 300};
    const int ndims = (int)(sizeof dims / sizeof dims[0]);
    for (int t = 0; t < 60; t++) {
        const int E = t < ndims ? dims[t] : range(1, 300), block = range(1, 40);
        const int row0 = range(0, block - 1), cols = range(1, 300);
        check_scores(block, row0, cols, E, E + range(0, 5));
    }
    check_scores(32, 0, 256, 128, 128);   /* the common full tiles */
    check_scores(40, 7, 17, 1, 1);
}

/* ------------------------------------------------------------------------------------------------ values */

/* O += P·V for `rows` rows, `cols` keys, Ev columns; P like the softmax leaves it: in [0, 2^8], some exact 0. */
static void check_values(int rows, int cols, int Ev, int key_stride, bool with_nan) {
    const int ldp = round_up(cols, AF_TILE_PAD) + AF_TILE_PAD, ldo = round_up(Ev, AF_TILE_PAD) + AF_TILE_PAD;
    float *P = aligned(sizeof(float) * (size_t)rows * ldp), *Pb = aligned(sizeof(float) * (size_t)rows * ldp);
    for (int i = 0; i < rows * ldp; i++) {
        const double x = uniform();
        P[i] = x < 0.1 ? 0.0f : (float)ldexp(uniform(), range(-12, 8));
        if (i % ldp >= cols) P[i] = NAN;   /* past cols: must not be read */
        Pb[i] = bf16_round(P[i]);
    }
    const int nan_row = with_nan ? range(0, rows - 1) : -1;
    if (with_nan) P[(size_t)nan_row * ldp + range(0, cols - 1)] = NAN;
    guarded_rows v = guarded_alloc(cols, Ev, key_stride);
    fill_rows(v.rows, cols, Ev, key_stride, 2.0);
    void *vpack = aligned(px()->v_bytes(cols, Ev));
    px()->pack_v(cols, Ev, v.rows, (size_t)key_stride * 2, AF_BF16, vpack);
    float *O = aligned(sizeof(float) * (size_t)(rows + 1) * ldo), *Oref = aligned(sizeof(float) * (size_t)rows * ldo);
    float *O0 = aligned(sizeof(float) * (size_t)rows * ldo);
    for (int i = 0; i < (rows + 1) * ldo; i++) O[i] = i < rows * ldo && i % ldo < Ev ? (float)(uniform() - 0.5) : CANARY;
    memcpy(Oref, O, sizeof(float) * (size_t)rows * ldo);
    memcpy(O0, O, sizeof(float) * (size_t)rows * ldo);
    px()->values(rows, Ev, cols, P, ldp, vpack, O, ldo);

    /* the portable gemm on V as f32 with P rounded to bf16 as the products round it */
    const int ldv = round_up(Ev, AF_TILE_PAD);
    float *vt = aligned(sizeof(float) * (size_t)cols * ldv);
    for (int j = 0; j < cols; j++)
        for (int e = 0; e < ldv; e++) vt[(size_t)j * ldv + e] = e < Ev ? af_bf16_to_f32(v.rows[(size_t)j * key_stride + e]) : 0.0f;
    af_ukernel_portable.gemm(rows, Ev, cols, Pb, ldp, vt, ldv, Oref, ldo, true);
    for (int r = 0; r < rows; r++)
        for (int e = 0; e < Ev; e++) {
            const double got = O[(size_t)r * ldo + e];
            if (r == nan_row) {
                if (!isnan(got)) fail_msg("rows %d cols %d Ev %d: NaN in P row %d did not reach O[%d][%d]", rows, cols, Ev, r, r, e);
                continue;
            }
            double mag = fabs(O0[(size_t)r * ldo + e]);
            const double exact = Oref[(size_t)r * ldo + e];
            for (int j = 0; j < cols; j++) mag += fabs((double)Pb[(size_t)r * ldp + j] * vt[(size_t)j * ldv + e]);
            const double bound = 2.0 * (cols + 3) * ldexp(1.0, -24) * mag;
            if (!(fabs(got - exact) <= bound))
                fail_msg("rows %d cols %d Ev %d: O[%d][%d] = %.9g, portable %.9g (bound %.3g)", rows, cols, Ev, r, e, got, exact, bound);
        }
    for (int r = 0; r <= rows; r++)   /* writable: columns up to round_up(Ev, 16) of the rows asked for */
        for (int e = r < rows ? round_up(Ev, AF_TILE_PAD) : 0; e < ldo; e++)
            if (O[(size_t)r * ldo + e] != CANARY) fail_msg("Ev %d: O[%d][%d] written", Ev, r, e);
    free(P), free(Pb), free(vpack), free(O), free(Oref), free(O0), free(vt);
    guarded_free(&v);
}

static void values_match_portable(void **state) {
    (void)state;
    static const int dims[] = {1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 96, 127, 128, 129, 200, 256, 300};
    const int ndims = (int)(sizeof dims / sizeof dims[0]);
    for (int t = 0; t < 60; t++) {
        const int Ev = t < ndims ? dims[t] : range(1, 300), cols = t < ndims ? dims[ndims - 1 - t] : range(1, 600);
        check_values(range(1, 40), cols, Ev, Ev + range(0, 5), t % 7 == 3);
    }
    check_values(32, 256, 128, 128, false);
    check_values(40, 257, 1, 1, false);   /* across the P stage (256 keys) */
    check_values(17, 513, 33, 40, true);
}

/* Rounding P to bf16 is the one error the products add over f32 weights: |O - O(f32 P)| <= 2^-8·Σ P·|v| + the
 * accumulation bound, and no tighter in general (some element shows more than half of the 2^-8 term's room). */
static void p_rounding_is_the_only_extra_error(void **state) {
    (void)state;
    const int rows = 16, cols = 64, Ev = 16, ld = 64;
    float *P = aligned(sizeof(float) * rows * ld), *O = aligned(sizeof(float) * rows * ld);
    guarded_rows v = guarded_alloc(cols, Ev, Ev);
    fill_rows(v.rows, cols, Ev, Ev, 1.0);
    for (int i = 0; i < rows * ld; i++) P[i] = (float)(1.0 + uniform());   /* [1, 2): bf16 steps of 2^-7 */
    void *vpack = aligned(px()->v_bytes(cols, Ev));
    px()->pack_v(cols, Ev, v.rows, (size_t)Ev * 2, AF_BF16, vpack);
    memset(O, 0, sizeof(float) * rows * ld);
    px()->values(rows, Ev, cols, P, ld, vpack, O, ld);
    double worst = 0.0;
    for (int r = 0; r < rows; r++)
        for (int e = 0; e < Ev; e++) {
            double exact = 0.0, mag = 0.0;
            for (int j = 0; j < cols; j++) {
                const double pv = (double)P[r * ld + j] * af_bf16_to_f32(v.rows[j * Ev + e]);
                exact += pv;
                mag += fabs(pv);
            }
            const double room = ldexp(1.0, -8) * mag, acc = 2.0 * (cols + 3) * ldexp(1.0, -24) * mag;
            const double err = fabs(O[r * ld + e] - exact);
            assert_true(err <= room + acc);
            if (err / room > worst) worst = err / room;
        }
    print_message("P rounding: worst error %.3f of 2^-8·Σ P|v| over %d elements\n", worst, rows * Ev);
    assert_true(worst > 0.01);   /* the rounding is there: an f32 P would be ~1e-5 of the room */
    free(P), free(O), free(vpack);
    guarded_free(&v);
}

/* ------------------------------------------------------------------------------------------------ rules */

static void accepts_bf16_only(void **state) {
    (void)state;
    for (int E = 1; E <= 1024; E = E * 2 + 1) {
        assert_true(px()->accepts(AF_BF16, E, E));
        assert_false(px()->accepts(AF_F16, E, E));
        assert_false(px()->accepts(AF_F32, E, E));
    }
    assert_true(px()->accepts(AF_BF16, 1024, 1024));
    assert_true(px()->accepts(AF_BF16, 64, 0));
    assert_false(px()->accepts(AF_BF16, 0, 64));
}

/* Whole 32-row strip pairs, keys a multiple of 32, and the working set within the 1 MiB budget wherever a
 * minimal block fits it (every head dim up to 1024). */
static void blocking_is_sane(void **state) {
    (void)state;
    for (int E = 1; E <= 1024; E += 37)
        for (int Ev = 1; Ev <= 1024; Ev += 53) {
            int rows, keys;
            px()->blocking(E, Ev, &rows, &keys);
            assert_true(rows >= 32 && rows <= 512 && rows % 32 == 0);
            assert_true(keys >= 32 && keys <= 256 && keys % 32 == 0);
            const long ep = round_up(E, 32), evp = round_up(Ev, 16);
            const long bytes = (long)rows * (2 * ep + 4 * keys + 4 * evp) + (long)keys * 2 * (ep + evp);
            if (rows > 32) assert_true(bytes <= 1024L * 1024);
        }
    int rows, keys;
    px()->blocking(128, 128, &rows, &keys);
    assert_int_equal(keys, 256);
    assert_int_equal(rows, 512);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(scores_match_portable),
        cmocka_unit_test(values_match_portable),
        cmocka_unit_test(p_rounding_is_the_only_extra_error),
        cmocka_unit_test(accepts_bf16_only),
        cmocka_unit_test(blocking_is_sane),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
