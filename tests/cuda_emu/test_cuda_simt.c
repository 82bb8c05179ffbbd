/* The CUDA-core attention kernel (src/cuda/attn_simt.cuh) and the strided copy (src/cuda/copy_4d.cuh) run on the
 * emulated device (tests/cuda_emu): af_cuda_simt_forward against the double reference at the CPU path's
 * tolerances, on seeded random cases (dtypes, GQA, both causal alignments, masks of every broadcast shape, layouts,
 * empty dims) and on targeted ones (head dims up to 1024, broadcast K/V, fully masked rows, Inf/NaN); the copy
 * against a plain loop. ATTNFORGE_TEST_CASES / ATTNFORGE_TEST_SEED change the random suite's count and seed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "attnforge.h"
#include "case_gen.h"
#include "core/dtype.h"
#include "emu_case.h"

static long long simt_grid_cap = 0x7fffffffLL, copy_grid_cap = 0x7fffffffLL;   /* CUDA's limit, or lowered */
#define AF_SIMT_MAX_BLOCKS simt_grid_cap
#define AF_COPY_4D_MAX_BLOCKS copy_grid_cap
#include "cuda/attn_simt.cuh"
#include "cuda/copy_4d.cuh"
#include "sdpa/problem.h"

#define DEFAULT_CASES 72
#define DEFAULT_SEED 20250301u
#define RANDOM_WORK_BUDGET 4e5   /* B·Hq·L·S·(E+Ev): keeps each emulated launch well under a second */

static const af_cuda_device test_device = {0, 4, 8, 0, 48 * 1024};

/* ---------------------------------------------------------------- running the kernel on device copies */

/* The launch emu_run_case checks: the CUDA-core kernel on test_device. */
static cudaError_t launch_simt(const af_problem *p, void *context) {
    (void)context;
    return af_cuda_simt_forward(p, &test_device, NULL);
}

/* Build the case, optionally let `edit` change its tensors (then re-run the reference), run and compare. */
static void check_case(const sdpa_case *c, emu_case_edit edit) {
    char desc[640], why[640] = "";
    case_describe(c, desc, sizeof desc);
    case_tensors t;
    const bool built = case_build(c, &t) && emu_edit_case(&t, edit);
    const bool ok = built && emu_run_case(&t, launch_simt, NULL, why, sizeof why);
    case_free(&t);
    if (!built) fail_msg("could not build the case (%s): %s", af_last_error(), desc);
    if (!ok) fail_msg("%s\n    %s", desc, why);
}

static sdpa_case small_case(uint64_t seed, af_dtype dtype, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t E,
                            int64_t Ev) {
    sdpa_case c = case_default(2, Hq, Hkv, L, S, E, Ev);
    c.seed = seed;
    c.dtype = dtype;
    return c;
}

/* ---------------------------------------------------------------- random suite */

static void random_case(void **state) { check_case((const sdpa_case *)*state, NULL); }

/* The generator's case, shrunk (batch, then the longer sequence) to the emulation's budget. */
static void random_simt_case(uint64_t seed, int index, void *out) {
    sdpa_case *c = out;
    *c = case_random(seed, index, 0);
    emu_shrink_case(c, RANDOM_WORK_BUDGET);
}

/* ---------------------------------------------------------------- targeted cases */

/* Head dims 1, 7, 64, 300 with Ev != E, every dtype, GQA, L != S, every layout of q/k/v/out. */
static void head_dims(void **state) {
    static const int64_t dims[][2] = {{1, 5}, {7, 64}, {64, 33}, {300, 129}, {64, 1}};
    int n = 0;
    for (int d = 0; d < 5; d++)
        for (int dt = 0; dt < 3; dt++) {
            sdpa_case c = small_case(100 + (uint64_t)n, (af_dtype)dt, 4, 2, 21, 45, dims[d][0], dims[d][1]);
            c.B = 1;
            c.q_layout = c.out_layout = (tensor_layout)(n % LAYOUT_COUNT);
            c.k_layout = c.lse_layout = (tensor_layout)((n + 1) % LAYOUT_COUNT);
            c.v_layout = (tensor_layout)((n + 2) % LAYOUT_COUNT);
            check_case(&c, NULL);
            n++;
        }
}

/* Every accumulator count (Ev <= 128, 256, 512, 1024) and the head-dim maximum 1024, in chunks of K and V. */
static void wide_heads(void **state) {
    static const int64_t dims[][2] = {{1024, 1024}, {129, 1000}, {513, 384}, {1000, 200}, {96, 257}};
    for (int d = 0; d < 5; d++) {
        sdpa_case c = small_case(200 + (uint64_t)d, (af_dtype)(d % 3), 2, 1, 5, 37, dims[d][0], dims[d][1]);
        c.B = 1;
        c.v_layout = LAYOUT_SLICED;
        check_case(&c, NULL);
    }
}

/* Both causal alignments with L < S, L > S and L = S, plain and grouped heads: the per-row key limits and the
 * block's tile range (rows of one block from two heads of a group, a block of rows that sees no key). */
static void causal_alignments(void **state) {
    static const int64_t seqs[][2] = {{13, 70}, {70, 13}, {33, 33}, {1, 40}, {40, 1}};
    int n = 0;
    for (int s = 0; s < 5; s++)
        for (int br = 0; br < 2; br++) {
            sdpa_case c = small_case(300 + (uint64_t)n, (af_dtype)(n % 3), n % 2 ? 6 : 3, n % 2 ? 2 : 3, seqs[s][0],
                                     seqs[s][1], 24, 40);
            c.is_causal = !br;
            c.causal_bottom_right = br;
            c.with_lse = true;
            check_case(&c, NULL);
            n++;
        }
}

/* Bool and additive masks of every broadcast shape (as given and expanded to 4-D with zero strides), a third of
 * the mask rows fully masked: out 0 and lse -inf there. */
static void masks(void **state) {
    for (int s = 0; s < mask_shape_count; s++)
        for (int kind = 0; kind < 2; kind++) {
            sdpa_case c = small_case(400 + (uint64_t)(2 * s + kind), (af_dtype)((s + kind) % 3), 4, 2, 9, 50, 16, 20);
            c.mask = kind ? MASK_ADDITIVE : MASK_BOOL;
            c.mask_shape = mask_shapes[s];
            c.mask_expanded = s % 2 == 1;
            c.mask_keep = 0.5;
            c.masked_row_rate = 0.35;
            c.mask_layout = (tensor_layout)(s % LAYOUT_COUNT);
            check_case(&c, NULL);
        }
}

/* K and V broadcast over batch and heads (stride 0), and one key repeated along S (stride 0 on the sequence). */
static void broadcast_kv_batch_head(case_tensors *t) {
    t->k.view.strides[0] = t->k.view.strides[1] = 0;
    t->v.view.strides[0] = t->v.view.strides[1] = 0;
}

static void broadcast_kv_sequence(case_tensors *t) {
    t->k.view.strides[2] = 0;
    t->v.view.strides[0] = 0;
}

static void broadcast_strides(void **state) {
    for (int dt = 0; dt < 3; dt++) {
        sdpa_case c = small_case(500 + (uint64_t)dt, (af_dtype)dt, 4, 2, 17, 39, 20, 12);
        c.k_layout = LAYOUT_NHD;
        check_case(&c, broadcast_kv_batch_head);
        c.is_causal = true;
        check_case(&c, broadcast_kv_sequence);
    }
}

/* Empty dims: no row (B, L = 0), no key (S = 0: out 0, lse -inf), no value column (Ev = 0: lse only). */
static void empty_dims(void **state) {
    static const int64_t sizes[][4] = {{0, 5, 7, 8}, {2, 0, 7, 8}, {2, 5, 0, 8}, {2, 5, 7, 0}, {1, 1, 0, 0}};
    for (int s = 0; s < 5; s++)
        for (int dt = 0; dt < 3; dt++) {
            sdpa_case c = small_case(600 + (uint64_t)s, (af_dtype)dt, 2, 1, sizes[s][1], sizes[s][2], 8, sizes[s][3]);
            c.B = sizes[s][0];
            c.is_causal = s == 2 && dt == 1;
            check_case(&c, NULL);
        }
}

/* Masked keys add nothing even when their values are Inf or NaN; a NaN query makes its row NaN (out and lse). */
static void poison_masked_values(case_tensors *t) {
    const int64_t S = t->c.S, Ev = t->c.Ev;
    for (int64_t b = 0; b < t->c.B; b++)
        for (int64_t h = 0; h < t->c.Hkv; h++)
            for (int64_t e = 0; e < Ev; e++) {
                const int64_t last[4] = {b, h, S - 1, e}, first[4] = {b, h, 0, e};
                tt_set(&t->v, last, e % 2 ? INFINITY : NAN);   /* key S-1: masked for rows < L-1 (top-left) */
                tt_set(&t->v, first, -INFINITY);               /* key 0: masked for nobody: out goes -inf/NaN */
            }
}

static void nan_query_row(case_tensors *t) {
    const int64_t idx[4] = {0, 1, 2, 3};
    tt_set(&t->q, idx, NAN);
}

static void non_finite(void **state) {
    for (int dt = 0; dt < 3; dt++) {
        sdpa_case c = small_case(700 + (uint64_t)dt, (af_dtype)dt, 2, 2, 6, 6, 8, 5);
        c.is_causal = true;
        check_case(&c, poison_masked_values);
        c.is_causal = false;
        check_case(&c, nan_query_row);
    }
}

/* out in f32 whatever the inputs (out_dtype is the reference's f32 for the tests that compare with it): the kernel
 * writes the problem's out_dtype. */
static void out_dtype_f32(void **state) {
    for (int dt = 1; dt < 3; dt++) {
        sdpa_case c = small_case(800 + (uint64_t)dt, (af_dtype)dt, 2, 2, 7, 19, 16, 24);
        case_tensors t;
        assert_true(case_build(&c, &t));
        test_tensor out32;
        test_rng rng = {1};
        const int64_t os[4] = {c.B, c.Hq, c.L, c.Ev};
        assert_true(tt_alloc(&out32, AF_F32, 4, os, LAYOUT_SLICED, &rng));
        tt_fill_bytes(&out32, TT_SENTINEL_BYTE);
        af_tensor out_as_dtype = out32.view;
        out_as_dtype.dtype = c.dtype;
        af_problem p;
        assert_int_equal(af_sdpa_check(&t.args, &out_as_dtype, NULL, &p), AF_OK);
        p.out_dtype = AF_F32;
        assert_int_equal(af_cuda_simt_forward(&p, &test_device, NULL), cudaSuccess);
        assert_int_equal(cudaStreamSynchronize(NULL), cudaSuccess);
        const af_error_scale es = case_error_scale(&t);
        int64_t idx[4] = {0};
        do {   /* the inputs' rounding is the reference's too: what is left is the f32 path's error */
            const double got = tt_get(&out32, idx), want = tt_get(&t.ref_out, idx);
            if (!(fabs(got - want) <= af_error_bound(AF_F32, want, &es)))
                fail_msg("f32 out of %s inputs: %.9g, reference %.9g", af_dtype_name(c.dtype), got, want);
        } while (tt_next_index(4, os, idx));
        assert_true(tt_outside_view_is(&out32, TT_SENTINEL_BYTE));
        tt_free(&out32);
        case_free(&t);
    }
}

/* Grids capped at a few blocks (the copy's at 2 blocks of 256 threads), so each block strides over several
 * (batch, kv head, row block) items / elements: the loop a launch past CUDA's 2^31 - 1 blocks would take. */
static int uncapped_grids(void **state) {   /* teardown: also after a failure */
    simt_grid_cap = copy_grid_cap = 0x7fffffffLL;
    return 0;
}

static void grid_stride(void **state) {
    simt_grid_cap = 3;
    for (int n = 0; n < 6; n++) {
        sdpa_case c = small_case(900 + (uint64_t)n, (af_dtype)(n % 3), 6, 2, 11, 23, 16, n % 2 ? 0 : 24);
        c.is_causal = n % 3 == 0;
        c.causal_bottom_right = n % 3 == 1;
        c.mask = n % 3 == 2 ? MASK_BOOL : MASK_NONE;
        c.masked_row_rate = 0.3;
        check_case(&c, NULL);
    }
}

/* ---------------------------------------------------------------- af_cuda_copy_4d */

static void copy_one(int elem_size, const int64_t shape[4], const int64_t stride[4], uint64_t seed) {
    int64_t span = 1, count = 1;
    for (int d = 0; d < 4; d++) {
        span += (shape[d] - 1) * stride[d];
        count *= shape[d];
    }
    if (count == 0) span = 1;
    unsigned char *src = NULL, *dst = NULL;
    const size_t dst_bytes = (size_t)(count + 8) * (size_t)elem_size;   /* 8 spare elements: nothing past count */
    assert_int_equal(cudaMalloc((void **)&src, (size_t)span * (size_t)elem_size), cudaSuccess);
    assert_int_equal(cudaMalloc((void **)&dst, dst_bytes), cudaSuccess);
    test_rng rng = {seed};
    for (int64_t n = 0; n < span * elem_size; n++) src[n] = (unsigned char)rng_next(&rng);
    memset(dst, 0x5A, dst_bytes);
    assert_int_equal(af_cuda_copy_4d(dst, src, shape, stride, elem_size, NULL), cudaSuccess);
    assert_int_equal(cudaStreamSynchronize(NULL), cudaSuccess);
    int64_t idx[4] = {0};
    for (int64_t n = 0; n < count; n++, tt_next_index(4, shape, idx)) {   /* row-major, like the destination */
        int64_t from = 0;
        for (int d = 0; d < 4; d++) from += idx[d] * stride[d];
        if (memcmp(dst + n * elem_size, src + from * elem_size, (size_t)elem_size) != 0)
            fail_msg("copy_4d (%d-byte elements) element %lld differs", elem_size, (long long)n);
    }
    for (size_t b = (size_t)count * (size_t)elem_size; b < dst_bytes; b++)
        if (dst[b] != 0x5A) fail_msg("copy_4d wrote past its %lld elements", (long long)count);
    cudaFree(src);
    cudaFree(dst);
}

/* Contiguous, permuted (transposed), broadcast (zero strides), inner stride > 1, an empty dim, a scalar repeated. */
static void copy_4d(void **state) {
    const int64_t shapes[][4] = {{2, 3, 5, 7},  {2, 3, 5, 7}, {1, 4, 33, 16},
                                 {3, 1, 1, 300}, {2, 0, 4, 4}, {1, 2, 3, 4}};
    const int64_t strides[][4] = {{105, 35, 7, 1}, {3, 1, 42, 6}, {0, 16, 64, 1},
                                  {900, 0, 0, 3},  {16, 16, 4, 1}, {0, 0, 0, 0}};
    for (int s = 0; s < 6; s++)
        for (int size = 2; size <= 4; size += 2) copy_one(size, shapes[s], strides[s], (uint64_t)(s * 10 + size));
}

static void copy_grid_stride(void **state) {
    const int64_t shape[4] = {2, 3, 50, 9}, stride[4] = {2000, 9, 27, 3};
    copy_grid_cap = 2;
    copy_one(4, shape, stride, 77);
    copy_one(2, shape, stride, 78);
}

/* ---------------------------------------------------------------- main */

int main(void) {
    static const struct CMUnitTest fixed[] = {
        cmocka_unit_test(head_dims),
        cmocka_unit_test(wide_heads),
        cmocka_unit_test(causal_alignments),
        cmocka_unit_test(masks),
        cmocka_unit_test(broadcast_strides),
        cmocka_unit_test(empty_dims),
        cmocka_unit_test(non_finite),
        cmocka_unit_test(out_dtype_f32),
        cmocka_unit_test_teardown(grid_stride, uncapped_grids),
        cmocka_unit_test(copy_4d),
        cmocka_unit_test_teardown(copy_grid_stride, uncapped_grids),
    };
    return emu_run_suite("cuda_simt", fixed, (int)(sizeof fixed / sizeof fixed[0]), random_simt_case,
                         sizeof(sdpa_case), random_case, DEFAULT_CASES, DEFAULT_SEED);
}
