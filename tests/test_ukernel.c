/* Every vector micro-kernel this machine can run, compared directly with the portable one on random tiles:
 * gemm, softmax_step (incl. -inf, NaN, all -inf rows, lazy-rescale threshold crossings) and scale_row, for
 * m = 1..13 rows and n, k not multiples of 8; exp2's accuracy per degree against exp2(); the packing hooks
 * against the portable ones and the direct (decode) kernels against double sums, with K/V ending at a guard
 * page so that any read past the data faults; every float8 byte through every conversion path against the format's
 * definition. */
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

#include "attnforge.h"
#include "core/dtype.h"
#include "kernel/exp2_poly.h"
#include "kernel/ukernel.h"
#include "ukernel_vec16_emulated.h"

#define CANARY 12345.0f

/* exp2_poly.h's maximum relative error of the polynomial, by degree */
static const double poly_bound[6] = {0, 0, 0, 7.5e-5, 2.6e-6, 7.5e-8};

static uint64_t rng_state = 88172645463325252ull;

static double uniform(void) {   /* [0, 1) */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) * (1.0 / 9007199254740992.0);
}

static float uniform_in(float lo, float hi) { return lo + (hi - lo) * (float)uniform(); }

static int round_up(int x, int to) { return (x + to - 1) / to * to; }

static float *tile(size_t floats) {   /* 64-byte aligned, as the contract promises */
    void *p = NULL;
    assert_int_equal(posix_memalign(&p, 64, floats * sizeof(float) + 64), 0);
    return p;
}

/* The vector kernels to test: every ISA besides "portable" that this machine runs, and the template at the
 * AVX-512 geometry on emulated 16-lane vectors (runs everywhere). */
static int vector_kernels(const af_ukernel **out) {
    const char *names[] = {"avx2", "avx512"};
    int n = 0;
    for (int i = 0; i < 2; i++) {
        if (!af_isa_available(names[i])) continue;
        assert_int_equal(af_set_isa(names[i]), AF_OK);
        out[n++] = af_ukernel_current();
    }
    assert_int_equal(af_set_isa("portable"), AF_OK);
    out[n++] = &af_ukernel_vec16_emulated;
    return n;
}

static bool same_special(float a, float b) { return (isnan(a) && isnan(b)) || (isinf(a) && a == b); }

/* ------------------------------------------------------------------------------------------------ gemm */

/* transposed: uk->gemm_at on A stored transposed (k rows of m, m + 5 apart) against the portable gemm on A. */
static void check_gemm_as(const af_ukernel *uk, int m, int n, int k, bool accumulate, bool specials, bool transposed) {
    const int lda = k + 3, ldb = round_up(n, AF_TILE_PAD) + AF_TILE_PAD, ldc = ldb, rows_c = m + 1;
    float *A = tile((size_t)m * lda), *B = tile((size_t)k * ldb);
    float *C = tile((size_t)rows_c * ldc), *Cref = tile((size_t)rows_c * ldc);
    double *mag = calloc((size_t)m * n, sizeof(double));
    for (int i = 0; i < m * lda; i++) A[i] = uniform_in(-1.0f, 1.0f);
    for (int p = 0; p < k; p++)
        for (int j = 0; j < ldb; j++) B[p * ldb + j] = j < n ? uniform_in(-1.0f, 1.0f) : 0.0f;   /* zero padding */
    if (specials) {
        A[(m - 1) * lda + k / 2] = -INFINITY;
        A[0] = NAN;
    }
    for (int i = 0; i < rows_c * ldc; i++) C[i] = Cref[i] = i < m * ldc ? uniform_in(-1.0f, 1.0f) : CANARY;
    for (int i = 0; i < m; i++)
        for (int j = round_up(n, AF_TILE_PAD); j < ldc; j++) C[i * ldc + j] = Cref[i * ldc + j] = CANARY;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double s = accumulate ? fabs(C[i * ldc + j]) : 0.0;
            for (int p = 0; p < k; p++) s += fabs((double)A[i * lda + p] * B[p * ldb + j]);
            mag[i * n + j] = s;
        }
    af_ukernel_portable.gemm(m, n, k, A, lda, B, ldb, Cref, ldc, accumulate);
    if (transposed) {
        const int ldat = m + 5;
        float *At = tile((size_t)k * ldat);
        for (int i = 0; i < m; i++)
            for (int p = 0; p < k; p++) At[p * ldat + i] = A[i * lda + p];
        assert_non_null(uk->gemm_at);
        uk->gemm_at(m, n, k, At, ldat, B, ldb, C, ldc, accumulate);
        free(At);
    } else {
        uk->gemm(m, n, k, A, lda, B, ldb, C, ldc, accumulate);
    }
    for (int i = 0; i < rows_c; i++)
        for (int j = 0; j < ldc; j++) {
            const float got = C[i * ldc + j], want = Cref[i * ldc + j];
            if (i >= m || j >= round_up(n, AF_TILE_PAD)) {   /* beyond the padded width: untouched */
                if (got != CANARY) fail_msg("%s gemm m=%d n=%d k=%d wrote C[%d][%d]", uk->isa, m, n, k, i, j);
                continue;
            }
            if (j >= n) continue;   /* padding columns are scratch */
            if (same_special(got, want)) continue;
            const double bound = 4.0 * (k + 2) * 0x1p-24 * mag[i * n + j] + 1e-30;
            if (!(fabs((double)got - want) <= bound))
                fail_msg("%s gemm m=%d n=%d k=%d acc=%d C[%d][%d] = %g, portable %g", uk->isa, m, n, k, accumulate, i,
                         j, got, want);
        }
    free(A), free(B), free(C), free(Cref), free(mag);
}

static void check_gemm(const af_ukernel *uk, int m, int n, int k, bool accumulate, bool specials) {
    check_gemm_as(uk, m, n, k, accumulate, specials, false);
}

/* gemm_at (the backward's Pᵀ·dO, dSᵀ·Q) of every kernel, the portable one included, against the portable gemm. */
static void gemm_at_matches_gemm(void **state) {
    (void)state;
    const af_ukernel *kernels[4];
    int nk = vector_kernels(kernels);
    kernels[nk++] = &af_ukernel_portable;
    const int ns[] = {1, 16, 17, 33, 64, 100}, ks[] = {1, 7, 48, 65};
    for (int u = 0; u < nk; u++) {
        for (int m = 1; m <= 13; m++)
            for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
                for (size_t b = 0; b < sizeof ks / sizeof ks[0]; b++)
                    check_gemm_as(kernels[u], m, ns[a], ks[b], (a + b + m) % 2 == 0, (a + b) % 3 == 0, true);
        check_gemm_as(kernels[u], 96, 128, 48, true, false, true);
        check_gemm_as(kernels[u], 50, 80, 96, false, true, true);
    }
}

static void gemm_matches_portable(void **state) {
    (void)state;
    const af_ukernel *kernels[3];
    const int nk = vector_kernels(kernels);
    const int ns[] = {1, 5, 8, 15, 16, 17, 31, 32, 33, 48, 64, 80, 100};
    const int ks[] = {1, 3, 7, 9, 16, 64, 130};
    for (int u = 0; u < nk; u++)
        for (int m = 1; m <= 13; m++)
            for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
                for (size_t b = 0; b < sizeof ks / sizeof ks[0]; b++) {
                    check_gemm(kernels[u], m, ns[a], ks[b], (a + b + m) % 2 == 0, false);
                    if ((a + b) % 5 == 0) check_gemm(kernels[u], m, ns[a], ks[b], m % 2 == 0, true);
                }
    /* register-tile multiples and larger blocks */
    for (int u = 0; u < nk; u++) {
        check_gemm(kernels[u], 150, 64, 128, false, false);
        check_gemm(kernels[u], 96, 128, 64, true, false);
        check_gemm(kernels[u], 25, 80, 65, true, true);
    }
}

/* ------------------------------------------------------------------------------------------------ softmax */

typedef struct {
    int rows, cols, lds;
    float *S, *row_max, *row_sum, *alpha;
} softmax_state;

static void softmax_alloc(softmax_state *s, int rows, int cols, int lds) {
    s->rows = rows, s->cols = cols, s->lds = lds;
    s->S = tile((size_t)rows * lds);
    s->row_max = tile((size_t)rows), s->row_sum = tile((size_t)rows), s->alpha = tile((size_t)rows);
}

static void softmax_copy(softmax_state *dst, const softmax_state *src) {
    softmax_alloc(dst, src->rows, src->cols, src->lds);
    memcpy(dst->S, src->S, sizeof(float) * (size_t)src->rows * src->lds);
    memcpy(dst->row_max, src->row_max, sizeof(float) * (size_t)src->rows);
    memcpy(dst->row_sum, src->row_sum, sizeof(float) * (size_t)src->rows);
}

static void softmax_free(softmax_state *s) { free(s->S), free(s->row_max), free(s->row_sum), free(s->alpha); }

/* P may differ by the rounding of x = s·c - m (one FMA against a multiply and a subtract: up to ~2 ulp of the
 * larger of |s·c| and |m|, times ln 2 in P) and by a few ulp of the Horner steps; at x = k + 1/2 one kernel may
 * round to k and the other to k + 1, evaluating the polynomial at the two ends of its interval. */
static void compare_softmax(const af_ukernel *uk, const softmax_state *in, const softmax_state *got,
                            const softmax_state *want, float c, const char *what, int degree) {
    for (int r = 0; r < got->rows; r++) {
        const double m_ref = want->row_max[r] == -INFINITY ? 0.0 : want->row_max[r];
        if (!(got->row_max[r] == want->row_max[r] || same_special(got->row_max[r], want->row_max[r])))
            fail_msg("%s %s deg %d row %d: row_max %g, portable %g", uk->isa, what, degree, r, got->row_max[r],
                     want->row_max[r]);
        if (!(fabsf(got->alpha[r] - want->alpha[r]) <= 1e-6f * fabsf(want->alpha[r]) ||
              same_special(got->alpha[r], want->alpha[r])))
            fail_msg("%s %s deg %d row %d: alpha %g, portable %g", uk->isa, what, degree, r, got->alpha[r],
                     want->alpha[r]);
        if (!(fabsf(got->row_sum[r] - want->row_sum[r]) <= 1e-5f * fabsf(want->row_sum[r]) ||
              same_special(got->row_sum[r], want->row_sum[r])))
            fail_msg("%s %s deg %d row %d: row_sum %.9g, portable %.9g", uk->isa, what, degree, r, got->row_sum[r],
                     want->row_sum[r]);
        for (int j = 0; j < got->cols; j++) {
            const float p = got->S[r * got->lds + j], q = want->S[r * want->lds + j];
            const double x = (double)in->S[r * in->lds + j] * c - m_ref;
            double rel_p = 4.0 * 0x1p-24 + 0x1p-22 * (fabs((double)in->S[r * in->lds + j] * c) + fabs(m_ref));
            if (fabs(fabs(x - floor(x)) - 0.5) < 1e-5) rel_p += 2.0 * poly_bound[degree];   /* a tie may round either way */
            if (q == 0.0f ? p == 0.0f : same_special(p, q) || fabs((double)p - q) <= rel_p * fabs(q)) continue;
            fail_msg("%s %s deg %d row %d col %d: P %.9g, portable %.9g", uk->isa, what, degree, r, j, p, q);
        }
    }
}

/* Random scores with the edge cases sprinkled in; the running state set so some rows cross the threshold. */
static void fill_softmax(softmax_state *s, float c) {
    for (int r = 0; r < s->rows; r++) {
        float *row = s->S + (size_t)r * s->lds;
        for (int j = 0; j < s->lds; j++) row[j] = j < s->cols ? uniform_in(-12.0f, 12.0f) : NAN;   /* NaN padding: must not leak */
        const int kind = (int)(uniform() * 8);
        if (kind == 0) for (int j = 0; j < s->cols; j++) row[j] = -INFINITY;   /* a row that sees nothing */
        if (kind == 1) row[(int)(uniform() * s->cols)] = -INFINITY;
        if (kind == 2) row[(int)(uniform() * s->cols)] = NAN;
        if (kind == 3) for (int j = 0; j < s->cols; j += 3) row[j] = -INFINITY;
        float block_max = -INFINITY;
        for (int j = 0; j < s->cols; j++)
            if (row[j] * c > block_max) block_max = row[j] * c;
        const int state = (int)(uniform() * 5);
        s->row_sum[r] = uniform_in(0.5f, 40.0f);
        if (state == 0 || block_max == -INFINITY) s->row_max[r] = -INFINITY, s->row_sum[r] = 0.0f;   /* first block */
        else if (state == 1) s->row_max[r] = block_max - 8.0f;                  /* exactly at the threshold: may stay */
        else if (state == 2) s->row_max[r] = block_max - 8.5f;                  /* past it: moves */
        else if (state == 3) s->row_max[r] = block_max - uniform_in(0.0f, 7.9f);   /* below it: stays */
        else s->row_max[r] = block_max + uniform_in(0.0f, 20.0f);               /* old max larger */
    }
}

static void softmax_case(const af_ukernel *uk, int rows, int cols, int lds, float c, int degree) {
    softmax_state in, got, want;
    softmax_alloc(&in, rows, cols, lds);
    fill_softmax(&in, c);
    softmax_copy(&got, &in);
    softmax_copy(&want, &in);
    af_ukernel_portable.softmax_step(rows, cols, want.S, lds, c, want.row_max, want.row_sum, want.alpha, degree);
    uk->softmax_step(rows, cols, got.S, lds, c, got.row_max, got.row_sum, got.alpha, degree);
    char what[64];
    snprintf(what, sizeof what, "softmax rows=%d cols=%d", rows, cols);
    compare_softmax(uk, &in, &got, &want, c, what, degree);
    softmax_free(&in), softmax_free(&got), softmax_free(&want);
}

static void softmax_matches_portable(void **state) {
    (void)state;
    const af_ukernel *kernels[3];
    const int nk = vector_kernels(kernels);
    const int cols[] = {1, 3, 7, 8, 13, 16, 17, 31, 40, 64, 100, 128};
    const float cs[] = {1.0f, 0.18033688f /* log2(e)/8 */, 0.1275174f /* log2(e)/sqrt(128) */, 3.0f};
    for (int u = 0; u < nk; u++)
        for (int degree = 3; degree <= 5; degree++)
            for (int rows = 1; rows <= 13; rows++)
                for (size_t a = 0; a < sizeof cols / sizeof cols[0]; a++)
                    for (size_t b = 0; b < sizeof cs / sizeof cs[0]; b++) {
                        const int lds = round_up(cols[a], AF_TILE_PAD) + (b % 2 ? AF_TILE_PAD : 0);
                        softmax_case(kernels[u], rows, cols[a], lds, cs[b], degree);
                    }
}

/* The threshold itself: a block max exactly 8 above the old max keeps it; the next float above moves it. */
static void softmax_threshold_exact(void **state) {
    (void)state;
    const af_ukernel *kernels[4] = {&af_ukernel_portable};
    const int nk = 1 + vector_kernels(kernels + 1);
    for (int u = 0; u < nk; u++) {
        softmax_state s;
        softmax_alloc(&s, 2, 5, AF_TILE_PAD);
        const float m_old = 3.25f;
        for (int j = 0; j < AF_TILE_PAD; j++) s.S[j] = s.S[AF_TILE_PAD + j] = 0.0f;
        s.S[2] = m_old + 8.0f;                                   /* row 0: exactly at the threshold */
        s.S[AF_TILE_PAD + 2] = nextafterf(m_old + 8.0f, INFINITY);   /* row 1: just past it */
        s.row_max[0] = s.row_max[1] = m_old;
        s.row_sum[0] = s.row_sum[1] = 1.0f;
        kernels[u]->softmax_step(2, 5, s.S, AF_TILE_PAD, 1.0f, s.row_max, s.row_sum, s.alpha, 5);
        assert_true(s.row_max[0] == m_old && s.alpha[0] == 1.0f);
        assert_true(fabsf(s.S[2] - 256.0f) <= 256.0f * 2e-7f);   /* P reaches 2^8 and no further */
        assert_true(s.row_max[1] == s.S[AF_TILE_PAD + 2] || s.row_max[1] == nextafterf(m_old + 8.0f, INFINITY));
        assert_true(s.row_max[1] > m_old + 8.0f);
        assert_true(fabsf(s.alpha[1] - exp2f(m_old - s.row_max[1])) <= 1e-6f * s.alpha[1]);
        assert_true(fabsf(s.S[AF_TILE_PAD + 2] - 1.0f) <= 2e-7f);
        softmax_free(&s);
    }
}

/* ------------------------------------------------------------------------------------------------ exp2 */

/* P = 2^s through softmax_step with c = 1 and an old max of 0 (it stays: the scores are <= 8). */
static void exp2_through_softmax(const af_ukernel *uk, const float *x, float *p, int n, int degree) {
    const int lds = round_up(n, AF_TILE_PAD);
    float *S = tile((size_t)lds), m = 0.0f, l = 0.0f, a;
    memcpy(S, x, sizeof(float) * (size_t)n);
    uk->softmax_step(1, n, S, lds, 1.0f, &m, &l, &a, degree);
    assert_true(m == 0.0f && a == 1.0f);
    memcpy(p, S, sizeof(float) * (size_t)n);
    free(S);
}

static void exp2_accuracy_per_degree(void **state) {
    (void)state;
    /* exp2_poly.h's bounds for the polynomial (poly_bound), plus 2 ulp (2^-22) for its coefficients and Horner steps in f32 */
    const af_ukernel *kernels[4] = {&af_ukernel_portable};
    const int nk = 1 + vector_kernels(kernels + 1);
    enum { N = 4096 };
    float x[N], p[N];
    for (int u = 0; u < nk; u++)
        for (int degree = 3; degree <= 5; degree++) {
            double worst = 0.0;
            for (int trial = 0; trial < 64; trial++) {
                for (int i = 0; i < N; i++) {
                    const int kind = i % 4;   /* uniform, near integers, near half-integers, near 0 */
                    const float base = floorf(uniform_in(AF_EXP2_MIN_INPUT, 8.0f));
                    x[i] = kind == 0   ? uniform_in(AF_EXP2_MIN_INPUT, 8.0f)
                           : kind == 1 ? base + uniform_in(-1e-3f, 1e-3f)
                           : kind == 2 ? base + 0.5f + uniform_in(-1e-3f, 1e-3f)
                                       : uniform_in(-1.0f, 1.0f);
                    if (x[i] < AF_EXP2_MIN_INPUT) x[i] = AF_EXP2_MIN_INPUT;
                    if (x[i] > 8.0f) x[i] = 8.0f;
                }
                exp2_through_softmax(kernels[u], x, p, N, degree);
                for (int i = 0; i < N; i++) {
                    const double want = exp2((double)x[i]), rel = fabs(p[i] - want) / want;
                    if (rel > worst) worst = rel;
                }
            }
            print_message("%s exp2 degree %d: max relative error %.3g (bound %.3g + 2^-22)\n", kernels[u]->isa, degree,
                          worst, poly_bound[degree]);
            assert_true(worst <= poly_bound[degree] + 0x1p-22);
        }
}

static void exp2_special_inputs(void **state) {
    (void)state;
    const af_ukernel *kernels[4] = {&af_ukernel_portable};
    const int nk = 1 + vector_kernels(kernels + 1);
    const float x[] = {-INFINITY, -1e30f, -200.0f, -125.5f, nextafterf(AF_EXP2_MIN_INPUT, -INFINITY),
                       AF_EXP2_MIN_INPUT, -124.5f, NAN, -0.0f, 0.0f, 8.0f, -NAN};
    const int n = (int)(sizeof x / sizeof x[0]);
    float p[16];
    for (int u = 0; u < nk; u++)
        for (int degree = 3; degree <= 5; degree++) {
            exp2_through_softmax(kernels[u], x, p, n, degree);
            for (int i = 0; i < 5; i++) assert_true(p[i] == 0.0f);       /* below the minimum: exactly 0 */
            assert_true(p[5] > 0.0f && fabs(p[5] / exp2(-125.0) - 1.0) < 1e-4);
            assert_true(p[6] > 0.0f && fabs(p[6] / exp2(-124.5) - 1.0) < 1e-4);
            assert_true(isnan(p[7]) && isnan(p[11]));                  /* NaN stays NaN */
            assert_true(fabs(p[8] - 1.0) < 1e-4 && fabs(p[9] - 1.0) < 1e-4 && fabs(p[10] / 256.0 - 1.0) < 1e-4);
        }
}

/* A NaN payload with low mantissa bits must not turn into a number through the exponent add. */
static void exp2_nan_payloads(void **state) {
    (void)state;
    const af_ukernel *kernels[3];
    const int nk = vector_kernels(kernels);
    const uint32_t payloads[] = {0x7fc00001u, 0x7fc001ffu, 0xffc00100u, 0x7f800001u, 0x7fffffffu};
    float x[AF_TILE_PAD] = {0}, p[AF_TILE_PAD];
    for (size_t i = 0; i < sizeof payloads / sizeof payloads[0]; i++) memcpy(&x[i], &payloads[i], 4);
    for (int u = 0; u < nk; u++)
        for (int degree = 3; degree <= 5; degree++) {
            exp2_through_softmax(kernels[u], x, p, AF_TILE_PAD, degree);
            for (size_t i = 0; i < sizeof payloads / sizeof payloads[0]; i++) assert_true(isnan(p[i]));
        }
}

/* ------------------------------------------------------------------------------------------------ scale_row */

static void scale_row_matches_portable(void **state) {
    (void)state;
    const af_ukernel *kernels[3];
    const int nk = vector_kernels(kernels);
    for (int u = 0; u < nk; u++)
        for (int n = 1; n <= 70; n++) {
            const int padded = round_up(n, AF_TILE_PAD);
            float *x = tile((size_t)padded + AF_TILE_PAD), *y = tile((size_t)padded + AF_TILE_PAD);
            for (int j = 0; j < padded + AF_TILE_PAD; j++) x[j] = y[j] = j < padded ? uniform_in(-3.0f, 3.0f) : CANARY;
            if (n > 3) x[2] = y[2] = -INFINITY, x[3] = y[3] = NAN;
            const float s = uniform_in(0.0f, 1.0f);
            af_ukernel_portable.scale_row(y, n, s);
            kernels[u]->scale_row(x, n, s);
            for (int j = 0; j < n; j++) assert_true(x[j] == y[j] || same_special(x[j], y[j]));
            for (int j = padded; j < padded + AF_TILE_PAD; j++) assert_true(x[j] == CANARY);
            free(x), free(y);
        }
}

/* ------------------------------------------------------------------------------------------------ packing */

/* `bytes` of memory whose end touches an inaccessible page: reading one byte past it faults. */
typedef struct { char *map; size_t map_bytes; void *data; } guarded;

static void *guarded_alloc(guarded *g, size_t bytes) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), body = (bytes + page - 1) / page * page;
    g->map_bytes = body + page;
    g->map = mmap(NULL, g->map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(g->map != MAP_FAILED);
    assert_int_equal(mprotect(g->map + body, page, PROT_NONE), 0);
    g->data = g->map + body - bytes;
    return g->data;
}

static void guarded_free(guarded *g) { munmap(g->map, g->map_bytes); }

static const af_dtype all_dtypes[] = {AF_F32, AF_F16, AF_BF16};

/* rows × cols elements of dtype, `stride` elements apart, random in [-1, 1) with a few specials; ends at a guard page */
static char *random_rows(guarded *g, af_dtype dtype, int rows, int cols, int stride, bool specials) {
    const size_t elem = af_dtype_size(dtype), bytes = ((size_t)(rows - 1) * stride + cols) * elem;
    char *p = guarded_alloc(g, bytes);
    for (size_t i = 0; i < bytes / elem; i++) af_store_from_f32(p + i * elem, dtype, uniform_in(-1.0f, 1.0f));
    if (specials && rows * cols > 3) {
        af_store_from_f32(p, dtype, -INFINITY);
        af_store_from_f32(p + (size_t)(rows - 1) * stride * elem, dtype, NAN);
    }
    return p;
}

static float element(const char *p, af_dtype dtype, size_t index) { return af_load_as_f32(p + index * af_dtype_size(dtype), dtype); }

static void pack_and_convert_match_portable(void **state) {
    (void)state;
    const af_ukernel *kernels[3];
    const int nk = vector_kernels(kernels);
    const int cols_list[] = {1, 3, 7, 8, 9, 16, 17, 63, 64}, e_list[] = {1, 5, 8, 13, 64, 72, 128};
    for (int u = 0; u < nk; u++)
        for (int d = 0; d < 3 && kernels[u]->pack_kt && kernels[u]->convert; d++)   /* the hooks are optional */
            for (size_t a = 0; a < sizeof cols_list / sizeof cols_list[0]; a++)
                for (size_t b = 0; b < sizeof e_list / sizeof e_list[0]; b++) {
                    const int cols = cols_list[a], E = e_list[b], stride = E + (int)(a % 3), ldkt = 80;
                    const size_t elem = af_dtype_size(all_dtypes[d]);
                    guarded g;
                    const char *k = random_rows(&g, all_dtypes[d], cols, E, stride, true);
                    float *got = tile((size_t)E * ldkt), *want = tile((size_t)E * ldkt);
                    for (int i = 0; i < E * ldkt; i++) got[i] = want[i] = CANARY;
                    kernels[u]->pack_kt(cols, E, k, (size_t)stride * elem, all_dtypes[d], got, ldkt);
                    af_ukernel_portable.pack_kt(cols, E, k, (size_t)stride * elem, all_dtypes[d], want, ldkt);
                    for (int i = 0; i < E * ldkt; i++)
                        if (memcmp(&got[i], &want[i], 4) && !same_special(got[i], want[i]))
                            fail_msg("%s pack_kt %s cols=%d E=%d: kt[%d][%d] = %g, portable %g", kernels[u]->isa,
                                     af_dtype_name(all_dtypes[d]), cols, E, i / ldkt, i % ldkt, got[i], want[i]);
                    float row_got[200], row_want[200];
                    kernels[u]->convert(row_got, k, all_dtypes[d], E);
                    af_ukernel_portable.convert(row_want, k, all_dtypes[d], E);
                    for (int i = 0; i < E; i++) assert_true(row_got[i] == row_want[i] || same_special(row_got[i], row_want[i]));
                    free(got), free(want);
                    guarded_free(&g);
                }
}

/* Row j of n in the direct kernels' pointer lists: in order, or reversed when `variant` is odd. */
static int permuted(int j, int n, size_t variant) { return variant % 2 ? n - 1 - j : j; }

/* scores_direct / values_direct against double sums of the converted inputs; K and V end at a guard page. */
static void direct_kernels_match_reference(void **state) {
    (void)state;
    const af_ukernel *kernels[3];
    const int nk = vector_kernels(kernels);
    const int ns[] = {1, 2, 3, 7, 8, 16, 17, 24, 64, 65}, ks[] = {1, 5, 8, 9, 40, 48, 64, 128, 130};
    for (int u = 0; u < nk; u++)
        for (int d = 0; d < 3; d++)
            for (int m = 1; m <= 13; m += (m < 6 ? 1 : 3))
                for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
                    for (size_t b = 0; b < sizeof ks / sizeof ks[0]; b++) {
                        const af_dtype dt = all_dtypes[d];
                        const int n = ns[a], k = ks[b], lda = k + 1, ldc = round_up(n, AF_TILE_PAD) + AF_TILE_PAD;
                        const size_t elem = af_dtype_size(dt);
                        float *A = tile((size_t)m * lda), *C = tile((size_t)m * ldc);
                        for (int i = 0; i < m * lda; i++) A[i] = uniform_in(-1.0f, 1.0f);
                        /* scores: K has n rows of k elements */
                        guarded gk, gv;
                        const int kstride = k + (int)(b % 2) * 3;
                        /* rows through a pointer list, in reverse order for odd a (pages in any order), each pointer
                         * one row before its row (the offset: a later kv head's rows); row 0 of K is never read */
                        const char *K = random_rows(&gk, dt, n + 1, k, kstride, false);
                        const char **krows = malloc(sizeof(char *) * (size_t)n);
                        for (int j = 0; j < n; j++) krows[j] = K + (size_t)permuted(j, n, a) * kstride * elem;
                        for (int i = 0; i < m * ldc; i++) C[i] = CANARY;
                        kernels[u]->scores_direct(m, n, k, A, lda, krows, (size_t)kstride * elem, dt, C, ldc,
                                                  (af_prefetch){K, (size_t)n % 5});
                        for (int i = 0; i < m; i++)
                            for (int j = 0; j < ldc; j++) {
                                if (j >= n) {
                                    if (C[i * ldc + j] != CANARY) fail_msg("%s scores_direct wrote S[%d][%d]", kernels[u]->isa, i, j);
                                    continue;
                                }
                                double want = 0.0, mag = 0.0;
                                for (int e = 0; e < k; e++) {
                                    const size_t row = (size_t)permuted(j, n, a) + 1;
                                    const double t = (double)A[i * lda + e] * element(K, dt, row * kstride + e);
                                    want += t, mag += fabs(t);
                                }
                                if (fabs(C[i * ldc + j] - want) > 4.0 * (k + 2) * 0x1p-24 * mag + 1e-30)
                                    fail_msg("%s scores_direct %s m=%d n=%d k=%d S[%d][%d] = %g, want %g", kernels[u]->isa,
                                             af_dtype_name(dt), m, n, k, i, j, C[i * ldc + j], want);
                            }
                        /* values: V has k rows of n elements; O accumulates */
                        const int vstride = n + (int)(a % 2) * 5;
                        const char *V = random_rows(&gv, dt, k + 1, n, vstride, false);
                        const char **vrows = malloc(sizeof(char *) * (size_t)k);
                        for (int q = 0; q < k; q++) vrows[q] = V + (size_t)permuted(q, k, a) * vstride * elem;
                        float *O = tile((size_t)m * ldc), *O0 = tile((size_t)m * ldc);
                        for (int i = 0; i < m * ldc; i++) O[i] = O0[i] = (i % ldc) < round_up(n, AF_TILE_PAD) ? uniform_in(-1.0f, 1.0f) : CANARY;
                        kernels[u]->values_direct(m, n, k, A, lda, vrows, (size_t)vstride * elem, dt, O, ldc,
                                                  (af_prefetch){V, (size_t)k % 7});
                        for (int i = 0; i < m; i++)
                            for (int j = 0; j < ldc; j++) {
                                if (j >= round_up(n, AF_TILE_PAD)) {
                                    if (O[i * ldc + j] != CANARY) fail_msg("%s values_direct wrote O[%d][%d]", kernels[u]->isa, i, j);
                                    continue;
                                }
                                if (j >= n) continue;
                                double want = O0[i * ldc + j], mag = fabs(want);
                                for (int p = 0; p < k; p++) {
                                    const size_t row = (size_t)permuted(p, k, a) + 1;
                                    const double t = (double)A[i * lda + p] * element(V, dt, row * vstride + j);
                                    want += t, mag += fabs(t);
                                }
                                if (fabs(O[i * ldc + j] - want) > 4.0 * (k + 2) * 0x1p-24 * mag + 1e-30)
                                    fail_msg("%s values_direct %s m=%d n=%d k=%d O[%d][%d] = %g, want %g", kernels[u]->isa,
                                             af_dtype_name(dt), m, n, k, i, j, O[i * ldc + j], want);
                            }
                        free(A), free(C), free(O), free(O0), free(krows), free(vrows);
                        guarded_free(&gk), guarded_free(&gv);
                    }
}

/* ------------------------------------------------------------------------------------------------ float8 */

/* Float8 byte b's value from the format's definition: sign, exponent field, mantissa field, bias; e4m3fn has no
 * infinity and one NaN pattern per sign (S.1111.111), e5m2 IEEE's (exponent all ones). */
static double f8_definition(uint8_t b, af_dtype dt) {
    const bool e4m3 = dt == AF_F8E4M3;
    const int man_bits = e4m3 ? 3 : 2, exp_bits = e4m3 ? 4 : 5, bias = e4m3 ? 7 : 15;
    const int exp = (b >> man_bits) & ((1 << exp_bits) - 1), man = b & ((1 << man_bits) - 1);
    double v;
    if (e4m3 && exp == 15 && man == 7) v = NAN;
    else if (!e4m3 && exp == 31) v = man ? NAN : INFINITY;
    else if (exp == 0) v = ldexp(man, 1 - bias - man_bits);
    else v = ldexp(1.0 + ldexp(man, -man_bits), exp - bias);
    return b & 0x80 ? -v : v;
}

/* got == the definition: NaN for NaN, the same signed value otherwise (-0 included unless zero_sign_free: a sum
 * 0 + -0 is +0). */
static void expect_f8(float got, uint8_t b, af_dtype dt, bool zero_sign_free, const char *path, const char *isa) {
    const double want = f8_definition(b, dt);
    const bool ok = isnan(want) ? isnan(got)
                    : (double)got == want && (zero_sign_free || want != 0.0 || !signbit(got) == !signbit(want));
    if (!ok)
        fail_msg("%s %s %s: byte 0x%02x gives %.9g, the format defines %.9g", isa, path, af_dtype_name(dt), b, got,
                 want);
}

static const af_dtype f8_dtypes[] = {AF_F8E4M3, AF_F8E5M2};

/* All 256 bytes of each format through every conversion path: the scalar helpers, every table's convert and pack_kt
 * (portable, AVX2, AVX-512 where the CPU has it), the direct kernels' vector loads and scalar tails (V_LOAD_CVT /
 * V_LOAD1_CVT; the emulated 16-lane template runs AVX-512's bit steps), against f8_definition. */
static void f8_every_byte_every_path(void **state) {
    (void)state;
    const af_ukernel *kernels[4] = {&af_ukernel_portable};
    const int nk = 1 + vector_kernels(kernels + 1);
    uint8_t bytes[256 + 8];
    for (int i = 0; i < 256 + 8; i++) bytes[i] = (uint8_t)i;
    for (int d = 0; d < 2; d++) {
        const af_dtype dt = f8_dtypes[d];
        for (int b = 0; b < 256; b++)
            expect_f8(af_load_as_f32(&bytes[b], dt), (uint8_t)b, dt, false, "af_load_as_f32", "scalar");
        for (int u = 0; u < nk; u++) {
            const af_ukernel *uk = kernels[u];
            float out[256 * 8];
            if (uk->convert)
                for (int off = 0; off < 8; off++) {   /* every start, so vectors and tails both meet every byte */
                    uk->convert(out, bytes + off, dt, 256);
                    for (int i = 0; i < 256; i++) expect_f8(out[i], (uint8_t)(i + off), dt, false, "convert", uk->isa);
                }
            if (uk->pack_kt) {   /* 32 keys × 8 elements (8×8 register blocks), then 256 keys × 1 (edges) */
                float *kt = tile(8 * 64);
                uk->pack_kt(32, 8, bytes, 8, dt, kt, 64);
                for (int e = 0; e < 8; e++)
                    for (int j = 0; j < 32; j++)
                        expect_f8(kt[e * 64 + j], (uint8_t)(j * 8 + e), dt, false, "pack_kt", uk->isa);
                free(kt);
                kt = tile(256);
                uk->pack_kt(256, 1, bytes, 1, dt, kt, 256);
                for (int j = 0; j < 256; j++) expect_f8(kt[j], (uint8_t)j, dt, false, "pack_kt (edge)", uk->isa);
                free(kt);
            }
            if (!uk->scores_direct) continue;
            /* The direct kernels twice for e4m3fn: with the NaN bytes (the exact loads), then with them replaced by
             * +0 (a NaN-free tile: the AF_F8E4M3_SCALED loads and the per-tile 2^8). */
            for (int nan_free = 0; nan_free < (dt == AF_F8E4M3 ? 2 : 1); nan_free++) {
                uint8_t b8[256];
                for (int j = 0; j < 256; j++) b8[j] = nan_free && (j & 0x7f) == 0x7f ? 0 : (uint8_t)j;
                /* scores: key j's row holds byte j at `at`, +0 elsewhere; q = 1 everywhere: S[j] = the value */
                const int ks[2] = {16, 19}, ats[2] = {5, 18};   /* in a whole vector; in the scalar tail */
                for (int c = 0; c < 2; c++) {
                    guarded g;
                    uint8_t *K = guarded_alloc(&g, (size_t)256 * ks[c]);
                    memset(K, 0, (size_t)256 * ks[c]);
                    for (int j = 0; j < 256; j++) K[j * ks[c] + ats[c]] = b8[j];
                    float A[19], *S = tile(256 + AF_TILE_PAD);
                    for (int e = 0; e < 19; e++) A[e] = 1.0f;
                    const char *rows[256];   /* key j's row */
                    for (int j = 0; j < 256; j++) rows[j] = (const char *)K + (size_t)j * ks[c];
                    uk->scores_direct(1, 256, ks[c], A, ks[c], rows, 0, dt, S, 256 + AF_TILE_PAD,
                                      (af_prefetch){NULL, 0});
                    for (int j = 0; j < 256; j++)
                        expect_f8(S[j], b8[j], dt, true, c ? "scores_direct (tail)" : "scores_direct", uk->isa);
                    free(S);
                    guarded_free(&g);
                }
                /* values: one key whose row is all 256 bytes (+ 3 more in a scalar tail), P = 1, O = 0 + v; and the
                 * same row under P = 2 added to O = 1 (the 2^-8 units meet a nonzero O) */
                guarded g;
                uint8_t *V = guarded_alloc(&g, 259);
                for (int i = 0; i < 259; i++) V[i] = b8[i % 256];
                float *O = tile(272);
                const char *vrow[1] = {(const char *)V};
                for (int plus_one = 0; plus_one < 2; plus_one++) {
                    const float P[1] = {plus_one ? 2.0f : 1.0f};
                    for (int i = 0; i < 272; i++) O[i] = plus_one ? 1.0f : 0.0f;
                    uk->values_direct(1, 259, 1, P, 1, vrow, 0, dt, O, 272, (af_prefetch){NULL, 0});
                    for (int i = 0; i < 259; i++) {
                        const double want = plus_one ? 1.0 + 2.0 * f8_definition(V[i], dt) : f8_definition(V[i], dt);
                        if (plus_one ? !((isnan(want) && isnan(O[i])) || (double)O[i] == (double)(float)want)
                                     : false)
                            fail_msg("%s values_direct %s: 1 + 2·byte 0x%02x gives %.9g, want %.9g", uk->isa,
                                     af_dtype_name(dt), V[i], O[i], (double)(float)want);
                        if (!plus_one) expect_f8(O[i], V[i], dt, true, "values_direct", uk->isa);
                    }
                }
                free(O);
                guarded_free(&g);
            }
        }
    }
}

/* A single e4m3fn NaN (0x7f or 0xff) anywhere in a tile of 0.5s reaches the direct kernels' results: the tile's NaN
 * scan (32 bytes a step, then byte by byte) must see it at every position, else the NaN-free loads read it as 480. */
static void f8_nan_scan_finds_every_position(void **state) {
    (void)state;
    const af_ukernel *kernels[3];
    const int nk = vector_kernels(kernels);
    const int dims[] = {19, 32, 40, 64, 128, 131};   /* the scan: tail only, whole steps, steps and tail, ... */
    for (int u = 0; u < nk; u++)
        for (size_t d = 0; d < sizeof dims / sizeof dims[0]; d++) {
            const int E = dims[d];
            uint8_t *K = malloc((size_t)3 * E);
            float A[131], *S = tile(3 + AF_TILE_PAD), *O = tile(144);
            for (int e = 0; e < E; e++) A[e] = 1.0f;
            const char *rows[3] = {(const char *)K, (const char *)K + E, (const char *)K + 2 * E};
            for (int pos = 0; pos < E; pos++)
                for (int sign = 0; sign < 2; sign++) {
                    memset(K, 0x30, (size_t)3 * E);   /* 0.5 */
                    K[E + pos] = sign ? 0xff : 0x7f;
                    kernels[u]->scores_direct(1, 3, E, A, E, rows, 0, AF_F8E4M3, S, 3 + AF_TILE_PAD,
                                              (af_prefetch){NULL, 0});
                    if (!isnan(S[1]) || S[0] != 0.5f * (float)E || S[2] != 0.5f * (float)E)
                        fail_msg("%s scores_direct E=%d, NaN at %d: S = %g %g %g", kernels[u]->isa, E, pos, S[0], S[1],
                                 S[2]);
                    const float P[3] = {1.0f, 1.0f, 1.0f};
                    memset(O, 0, sizeof(float) * 144);
                    kernels[u]->values_direct(1, E, 3, P, 3, rows, 0, AF_F8E4M3, O, 144, (af_prefetch){NULL, 0});
                    for (int e = 0; e < E; e++)
                        if (e == pos ? !isnan(O[e]) : O[e] != 1.5f)
                            fail_msg("%s values_direct E=%d, NaN at %d: O[%d] = %g", kernels[u]->isa, E, pos, e, O[e]);
                }
            free(K), free(S), free(O);
        }
}

/* f32 -> float8 (tests' and stores' encoder): every finite value round-trips; ties go to even; past the largest
 * finite value e4m3fn gives NaN and e5m2 infinity (torch's .to()); NaN stays NaN. */
static void f8_encoder_rounds_to_nearest_even(void **state) {
    (void)state;
    for (int d = 0; d < 2; d++)
        for (int b = 0; b < 256; b++) {
            const double v = f8_definition((uint8_t)b, f8_dtypes[d]);
            const uint8_t back = af_f32_to_f8((float)v, f8_dtypes[d]);
            if (isnan(v)) assert_true(isnan(f8_definition(back, f8_dtypes[d])));
            else assert_int_equal(back, b);
        }
    assert_int_equal(af_f32_to_f8(464.0f, AF_F8E4M3), 0x7e);          /* 448/480 tie: even mantissa, 448 */
    assert_int_equal(af_f32_to_f8(465.0f, AF_F8E4M3), 0x7f);          /* rounds to 480: NaN, no infinity */
    assert_int_equal(af_f32_to_f8(-INFINITY, AF_F8E4M3), 0xff);
    assert_int_equal(af_f32_to_f8(0x1p-10f, AF_F8E4M3), 0x00);        /* half the smallest subnormal: tie to 0 */
    assert_int_equal(af_f32_to_f8(0x3p-10f, AF_F8E4M3), 0x02);        /* 1.5 subnormals: tie to 2 */
    assert_int_equal(af_f32_to_f8(0x1.1p-6f, AF_F8E4M3), 0x08);       /* just above the smallest normal */
    assert_int_equal(af_f32_to_f8(61440.0f, AF_F8E5M2), 0x7c);        /* 57344/65536 tie: to infinity */
    assert_int_equal(af_f32_to_f8(61439.0f, AF_F8E5M2), 0x7b);
    assert_int_equal(af_f32_to_f8(-0.0f, AF_F8E5M2), 0x80);
    assert_int_equal(af_f32_to_f8(0x1p-17f, AF_F8E5M2), 0x00);        /* tie below the smallest subnormal 2^-16 */
    assert_true(isnan(af_f8e5m2_to_f32(af_f32_to_f8(NAN, AF_F8E5M2))));
}

static void blocking_is_sane(void **state) {
    (void)state;
    const af_ukernel *kernels[4] = {&af_ukernel_portable};
    const int nk = 1 + vector_kernels(kernels + 1);
    const int dims[] = {1, 8, 64, 80, 96, 128, 256, 512, 1024};
    for (int u = 0; u < nk; u++)
        for (size_t a = 0; a < sizeof dims / sizeof dims[0]; a++)
            for (size_t b = 0; b < sizeof dims / sizeof dims[0]; b++) {
                int rows = 0, keys = 0;
                kernels[u]->blocking(dims[a], dims[b], &rows, &keys);
                assert_true(rows >= 1 && rows <= 1024 && keys >= 1 && keys <= 4096);
            }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(gemm_matches_portable),
        cmocka_unit_test(gemm_at_matches_gemm),
        cmocka_unit_test(softmax_matches_portable),
        cmocka_unit_test(softmax_threshold_exact),
        cmocka_unit_test(exp2_accuracy_per_degree),
        cmocka_unit_test(exp2_special_inputs),
        cmocka_unit_test(exp2_nan_payloads),
        cmocka_unit_test(scale_row_matches_portable),
        cmocka_unit_test(pack_and_convert_match_portable),
        cmocka_unit_test(direct_kernels_match_reference),
        cmocka_unit_test(blocking_is_sane),
        cmocka_unit_test(f8_every_byte_every_path),
        cmocka_unit_test(f8_encoder_rounds_to_nearest_even),
        cmocka_unit_test(f8_nan_scan_finds_every_position),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
