/* The tensor-core kernel (src/cuda/attn_mma.cuh), its split-KV combine (attn_combine.cuh) and launcher
 * (attn_mma_launch.cuh) on the emulated device (tests/cuda_emu) against the double reference: f16 and bf16, head
 * dims 8..256 with Ev != E (every variant, padded columns), GQA packed into the rows, L != S with both causal
 * alignments, bool and additive masks of every broadcast shape, strided q/k/v within the path's preconditions, S
 * not a multiple of 64, decode with split-KV, fully masked rows, LSE, single- and double-buffered shared memory.
 * The tolerance is the CPU path's (af_error_bound, whose P-rounding term covers the tensor cores' f16/bf16 P).
 * ATTNFORGE_TEST_CASES / ATTNFORGE_TEST_SEED change the random suite's count and seed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"
#include "case_gen.h"
#include "core/dtype.h"
#include "emu_case.h"
#define AF_MMA_GRID_YZ_MAX 3   /* the launcher folds (batch, kv head) pairs past grid y into grid x from 4 on */
#include "cuda/attn_mma_launch.cuh"
#include "sdpa/problem.h"

#define DEFAULT_CASES 48
#define DEFAULT_SEED 20250611u
#define RANDOM_WORK_BUDGET 3e5   /* B·Hq·L·S·(E+Ev) of a random case: the emulation runs ~a million MACs a second */

/* Devices the launcher plans for: one multiprocessor (no split), many (split-KV whenever the rows are few), and
 * shared memory too small for two K/V buffers at head dim 256 (single-buffered). */
/* Every variant's occupancy is capped at this (ATTNFORGE_EMU_OCCUPANCY): the SPLIT_NONE cases' CTA counts fill
 * 80% of the slots it gives. */
#define TEST_OCCUPANCY "1"
static const af_cuda_device one_sm = {0, 1, 9, 0, 227 * 1024};
static const af_cuda_device many_sms = {1, 132, 9, 0, 227 * 1024};
static const af_cuda_device small_smem = {2, 64, 8, 6, 99 * 1024};

/* ---------------------------------------------------------------- running the kernel on device copies */

/* The launch on `dev`, with the workspace it asks for (> 0 bytes when the keys were split; freed by the caller). */
typedef struct {
    const af_cuda_device *dev;
    size_t workspace_bytes;
    void *workspace;
} mma_launch;

static cudaError_t launch_mma(const af_problem *p, void *context) {
    mma_launch *run = context;
    cudaError_t err = af_cuda_mma_workspace_bytes(p, run->dev, &run->workspace_bytes);
    if (err != cudaSuccess) return err;
    if (run->workspace_bytes && (err = cudaMalloc(&run->workspace, run->workspace_bytes)) != cudaSuccess) return err;
    return af_cuda_mma_forward(p, run->dev, run->workspace, run->workspace_bytes, NULL);
}

/* How a check expects the keys to be split. */
typedef enum { SPLIT_ANY = 0, SPLIT_NONE, SPLIT_YES } split_expectation;

/* Build the case, lay q/k/v out as `layout` says (one per tensor, cycling), let `edit` change the tensors, run on
 * `dev` and compare; `split` states whether the launcher must have split the keys. */
static void check_case(const sdpa_case *c, aligned_layout layout, const af_cuda_device *dev, split_expectation split,
                       emu_case_edit edit) {
    char desc[640], why[640] = "";
    case_describe(c, desc, sizeof desc);
    case_tensors t;
    const bool built = case_build(c, &t) && emu_relayout_qkv(&t.q, &t.k, &t.v, layout) &&
                       emu_edit_case(&t, edit);
    mma_launch run = {dev, 0, NULL};
    const bool ok = built && emu_run_case(&t, launch_mma, &run, why, sizeof why);
    cudaFree(run.workspace);
    case_free(&t);
    if (!built) fail_msg("could not build the case (%s): %s", af_last_error(), desc);
    if (!ok) fail_msg("%s (sm_count %d)\n    %s", desc, dev->sm_count, why);
    if (split == SPLIT_YES && run.workspace_bytes == 0) fail_msg("expected split-KV, got none: %s", desc);
    if (split == SPLIT_NONE && run.workspace_bytes != 0) fail_msg("expected no split-KV, got one: %s", desc);
}

static sdpa_case small_case(uint64_t seed, af_dtype dtype, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t E,
                            int64_t Ev) {
    sdpa_case c = case_default(1, Hq, Hkv, L, S, E, Ev);
    c.seed = seed;
    c.dtype = dtype;
    return c;
}

static af_dtype half_dtype(int n) { return n % 2 ? AF_BF16 : AF_F16; }

/* ---------------------------------------------------------------- targeted cases */

/* Every head-dim variant (64, 128, 256) and its padding: E in {64, 128, 80, 256, 8} with Ev != E, groups 1, 2, 4. */
static void head_dims(void **state) {
    (void)state;
    static const int64_t dims[][2] = {{64, 40}, {128, 64}, {80, 96}, {256, 128}, {8, 24}, {40, 256}, {20, 12}};
    static const int64_t heads[][2] = {{2, 2}, {4, 2}, {4, 1}};
    for (int d = 0; d < 7; d++)
        for (int dt = 0; dt < 2; dt++) {
            const int n = 2 * d + dt;
            sdpa_case c = small_case(100 + (uint64_t)n, half_dtype(dt), heads[n % 3][0], heads[n % 3][1], 19, 70,
                                     dims[d][0], dims[d][1]);
            c.out_layout = (tensor_layout)(n % LAYOUT_COUNT);
            c.lse_layout = (tensor_layout)((n + 1) % LAYOUT_COUNT);
            check_case(&c, (aligned_layout)(n % ALIGNED_COUNT), &one_sm, SPLIT_NONE, NULL);
        }
}

/* 32 rows a warp (128-row blocks, rt = 2): head dim 64 (Q's fragments in registers) and 128 (read from shared memory
 * per tile), 130 and 97 packed rows (a last block with one warp on both row tiles, one on its first only, and dead
 * warps), groups wrapping inside a block, both causal alignments, split (many SMs) and not; with a mask tensor the
 * same shapes run 16 rows a warp. */
static void row_tiles_of_two(void **state) {
    (void)state;
    static const int64_t dims[][2] = {{64, 64}, {72, 120}, {128, 40}, {40, 64}};
    for (int n = 0; n < 8; n++) {
        const int64_t L = n % 2 ? 97 : 65;   /* packed rows: 97 (group 1) or 130 (group 2) */
        sdpa_case c = small_case(1000 + (uint64_t)n, half_dtype(n), n % 2 ? 1 : 2, 1, L, 40 + 23 * n, dims[n % 4][0],
                                 dims[n % 4][1]);
        c.is_causal = n % 4 == 1;
        c.causal_bottom_right = n % 4 == 2;
        if (n % 4 == 3) {
            c.mask = n == 3 ? MASK_BOOL : MASK_ADDITIVE;
            c.mask_shape = "B1LS";
            c.masked_row_rate = 0.2;
        }
        check_case(&c, (aligned_layout)(n % ALIGNED_COUNT), n < 4 ? &one_sm : &many_sms, n < 4 ? SPLIT_NONE : SPLIT_YES,
                   NULL);
    }
}

/* Both causal alignments, L < S, L > S (bottom-right: rows that see no key) and L = S, S not a multiple of 64, with
 * groups whose packed rows wrap from one head to the next inside a 64-row block (group·L > 64). */
static void causal_alignments(void **state) {
    (void)state;
    static const int64_t seqs[][2] = {{13, 150}, {90, 37}, {70, 70}, {1, 129}, {40, 1}, {33, 64}};
    int n = 0;
    for (int s = 0; s < 6; s++)
        for (int br = 0; br < 2; br++, n++) {
            sdpa_case c = small_case(300 + (uint64_t)n, half_dtype(n), n % 2 ? 4 : 2, n % 2 ? 2 : 1, seqs[s][0],
                                     seqs[s][1], 32, 48);
            c.is_causal = !br;
            c.causal_bottom_right = br;
            check_case(&c, (aligned_layout)(n % ALIGNED_COUNT), &one_sm, SPLIT_ANY, NULL);
        }
}

/* Bool and additive masks of every broadcast shape (as given and expanded), a third of the rows fully masked:
 * out 0 and lse -inf on rows that see no key (SDPA takes no mask together with causality). */
static void masks(void **state) {
    (void)state;
    for (int s = 0; s < mask_shape_count; s++)
        for (int kind = 0; kind < 2; kind++) {
            const int n = 2 * s + kind;
            sdpa_case c = small_case(400 + (uint64_t)n, half_dtype(s + kind), 4, 2, 9, 100, 16, 24);
            c.mask = kind ? MASK_ADDITIVE : MASK_BOOL;
            c.mask_shape = mask_shapes[s];
            c.mask_expanded = s % 2 == 1;
            c.mask_keep = 0.5;
            c.masked_row_rate = 0.35;
            c.mask_layout = (tensor_layout)(s % LAYOUT_COUNT);
            check_case(&c, (aligned_layout)(n % ALIGNED_COUNT), &one_sm, SPLIT_ANY, NULL);
        }
}

/* Decode: L = 1..16 with groups 1..8 on a device with many multiprocessors, so the keys are split (asserted) and
 * merged by the combine; causal, masked (whole rows too) and S not a multiple of 64. */
static void decode_split_kv(void **state) {
    (void)state;
    static const int64_t heads[][2] = {{1, 1}, {4, 2}, {8, 2}, {8, 1}};
    for (int n = 0; n < 12; n++) {
        const int64_t L = 1 + (n * 5) % 16;
        sdpa_case c = small_case(500 + (uint64_t)n, half_dtype(n), heads[n % 4][0], heads[n % 4][1], L,
                                 300 + 37 * n, n % 3 ? 64 : 128, n % 3 ? 64 : 80);
        c.causal_bottom_right = n % 4 == 1;
        c.is_causal = n % 4 == 2;   /* top-left with L < S: each row sees few keys, later splits see none */
        if (n % 4 == 0 || n % 4 == 3) {
            c.mask = n % 8 == 0 ? MASK_BOOL : MASK_ADDITIVE;
            c.mask_shape = n % 8 == 0 ? "LS" : "B1LS";
            c.masked_row_rate = 0.25;
        }
        c.with_lse = n % 5 != 4;
        c.out_layout = (tensor_layout)(n % LAYOUT_COUNT);
        c.lse_layout = (tensor_layout)((n + 2) % LAYOUT_COUNT);
        check_case(&c, (aligned_layout)(n % ALIGNED_COUNT), &many_sms, SPLIT_YES, NULL);
    }
}

/* The same decode shapes on one multiprocessor: one pass over the keys, no workspace. */
static void decode_without_split(void **state) {
    (void)state;
    for (int n = 0; n < 4; n++) {
        sdpa_case c = small_case(550 + (uint64_t)n, half_dtype(n), 8, 2, 1 + n, 200 + 50 * n, 64, 32);
        c.causal_bottom_right = n % 2;
        check_case(&c, ALIGNED_CONTIGUOUS, &one_sm, SPLIT_NONE, NULL);
    }
}

/* Head dim 256 (and 128) when the device's shared memory holds only one K/V buffer pair; split and not. */
static void single_buffered(void **state) {
    (void)state;
    static const int64_t dims[][2] = {{256, 200}, {136, 256}, {128, 128}};
    for (int d = 0; d < 3; d++) {
        sdpa_case c = small_case(600 + (uint64_t)d, half_dtype(d), 2, 1, d == 2 ? 2 : 21, 140, dims[d][0], dims[d][1]);
        c.is_causal = d == 1;
        check_case(&c, (aligned_layout)d, &small_smem, SPLIT_ANY, NULL);
    }
    static const af_cuda_device no_optin = {3, 1, 8, 0, 48 * 1024};   /* hd 128 fits 48 KiB only single-buffered */
    sdpa_case c = small_case(610, AF_BF16, 2, 2, 30, 100, 128, 72);
    check_case(&c, ALIGNED_PADDED, &no_optin, SPLIT_NONE, NULL);
}

/* Empty dims: no row (B, L = 0), no key (S = 0: out 0, lse -inf), no value column (Ev = 0: lse only). */
static void empty_dims(void **state) {
    (void)state;
    static const int64_t sizes[][4] = {{0, 5, 7, 8}, {2, 0, 7, 8}, {2, 5, 0, 8}, {2, 5, 7, 0}, {1, 1, 0, 0}};
    for (int s = 0; s < 5; s++)
        for (int dt = 0; dt < 2; dt++) {
            sdpa_case c = small_case(700 + (uint64_t)s, half_dtype(dt), 2, 1, sizes[s][1], sizes[s][2], 8,
                                     sizes[s][3]);
            c.B = sizes[s][0];
            c.is_causal = s == 2 && dt == 1;
            check_case(&c, ALIGNED_CONTIGUOUS, dt ? &many_sms : &one_sm, SPLIT_NONE, NULL);
        }
}

/* Scores whose row max jumps by far more than the lazy-rescale threshold from one key tile to the next (and ones
 * that fall): the stale max is corrected exactly when it must be. Keys of later tiles get larger q·k. */
static void growing_scores(case_tensors *t) {
    for (int64_t b = 0; b < t->c.B; b++)
        for (int64_t h = 0; h < t->c.Hkv; h++)
            for (int64_t j = 0; j < t->c.S; j++)
                for (int64_t e = 0; e < t->c.E; e++) {
                    const int64_t idx[4] = {b, h, j, e};
                    const double ramp = (double)(j / 64 % 3 == 1 ? 3 - j / 64 : j / 64) + 0.25;
                    tt_set(&t->k, idx, tt_get(&t->k, idx) * 0.25 + ramp * (e % 2 ? 1.0 : 0.5));
                }
    for (int64_t b = 0; b < t->c.B; b++)
        for (int64_t h = 0; h < t->c.Hq; h++)
            for (int64_t i = 0; i < t->c.L; i++)
                for (int64_t e = 0; e < t->c.E; e++) {
                    const int64_t idx[4] = {b, h, i, e};
                    tt_set(&t->q, idx, (e % 2 ? 1.0 : 0.5) * (i % 2 ? 1.0 : -1.0) + 0.1 * tt_get(&t->q, idx));
                }
}

static void lazy_rescale(void **state) {
    (void)state;
    for (int n = 0; n < 4; n++) {
        sdpa_case c = small_case(800 + (uint64_t)n, half_dtype(n), 2, 1, 5 + n, 320, 32, 32);
        c.has_scale = true;
        c.scale = 0.5;
        c.is_causal = n == 3;
        c.causal_bottom_right = n == 2;
        check_case(&c, ALIGNED_CONTIGUOUS, n % 2 ? &many_sms : &one_sm, SPLIT_ANY, growing_scores);
    }
}

static size_t workspace_of(const af_problem *p, const af_cuda_device *dev) {
    size_t bytes = 1;
    assert_int_equal(af_cuda_mma_workspace_bytes(p, dev, &bytes), cudaSuccess);
    return bytes;
}

/* The workspace: none when the CTAs fill the device, none for empty problems, some for decode on a big device. */
static void workspace_sizes(void **state) {
    (void)state;
    af_problem p;
    memset(&p, 0, sizeof p);
    p.dtype = p.out_dtype = AF_BF16;
    p.B = 4, p.Hq = 32, p.Hkv = 8, p.group = 4, p.L = 4096, p.S = 4096, p.E = p.Ev = 128;
    assert_int_equal(workspace_of(&p, &many_sms), 0);   /* 4·8·128 CTAs: no split */
    p.L = 1;
    const size_t decode = workspace_of(&p, &many_sms);
    assert_true(decode >= (size_t)(4 * 32 * 1 * 2) * (128 + 1) * sizeof(float));   /* >= 2 splits of every row */
    p.B = 0;
    assert_int_equal(workspace_of(&p, &many_sms), 0);
    p.B = 4, p.S = 64;   /* one key tile: nothing to split */
    assert_int_equal(workspace_of(&p, &many_sms), 0);
}

/* The plan: 32 rows a warp (128-row blocks) for 16-bit head dims up to 128 past 64 packed rows, 16 (64-row blocks)
 * for decode's few rows, float8 and head dim 256; the split count from the variant's occupancy, which the
 * emulation caps with ATTNFORGE_EMU_OCCUPANCY (asked once per device and variant: fresh ordinals here). */
static void plan_tiling_and_occupancy(void **state) {
    (void)state;
    af_problem p;
    memset(&p, 0, sizeof p);
    p.dtype = p.out_dtype = p.kv_dtype = AF_F16;
    p.B = 1, p.Hq = 12, p.Hkv = 12, p.group = 1, p.L = 1280, p.S = 4096, p.E = p.Ev = 128;
    af_mma_plan plan;
    const af_cuda_device capped = {10, 132, 9, 0, 227 * 1024}, free_ = {11, 132, 9, 0, 227 * 1024};
    setenv("ATTNFORGE_EMU_OCCUPANCY", "1", 1);
    assert_int_equal(af_mma_make_plan(&p, &capped, &plan), cudaSuccess);
    setenv("ATTNFORGE_EMU_OCCUPANCY", "8", 1);   /* free_: the emulation's shared-memory model decides */
    assert_int_equal(plan.rt, 2);
    assert_int_equal(plan.row_blocks, 10);
    assert_int_equal(plan.ctas_per_sm, 1);
    assert_int_equal(plan.splits, 1);   /* 120 CTAs fill 80% of 132 slots */
    assert_int_equal(af_mma_make_plan(&p, &capped, &plan), cudaSuccess);
    assert_int_equal(plan.ctas_per_sm, 1);   /* the cached answer: the workspace's size and the launch agree */
    assert_int_equal(af_mma_make_plan(&p, &free_, &plan), cudaSuccess);
    assert_int_equal(plan.ctas_per_sm, 2);   /* (128 + 4·64) rows of 256 bytes: 2 blocks in 228 KiB */
    assert_true(plan.splits > 1);            /* 120 of 264 slots: split */
    p.L = 64;   /* 64 packed rows: one 64-row block */
    assert_int_equal(af_mma_make_plan(&p, &free_, &plan), cudaSuccess);
    assert_int_equal(plan.rt, 1);
    p.Hq = 24, p.group = 2, p.L = 33;   /* 66 packed rows */
    assert_int_equal(af_mma_make_plan(&p, &free_, &plan), cudaSuccess);
    assert_int_equal(plan.rt, 2);
    p.E = p.Ev = 256;
    assert_int_equal(af_mma_make_plan(&p, &free_, &plan), cudaSuccess);
    assert_int_equal(plan.rt, 1);
    p.E = p.Ev = 64, p.kv_dtype = AF_F8E4M3;
    assert_int_equal(af_mma_make_plan(&p, &free_, &plan), cudaSuccess);
    assert_int_equal(plan.rt, 1);
    p.kv_dtype = AF_F16;
    assert_int_equal(af_mma_make_plan(&p, &free_, &plan), cudaSuccess);
    assert_int_equal(plan.rt, 2);
    static const unsigned char keep = 1;
    p.mask = (const char *)&keep, p.mask_dtype = AF_BOOL;   /* a mask tensor: 16 rows a warp (registers) */
    assert_int_equal(af_mma_make_plan(&p, &free_, &plan), cudaSuccess);
    assert_int_equal(plan.rt, 1);
    setenv("ATTNFORGE_EMU_OCCUPANCY", TEST_OCCUPANCY, 1);
}

/* More (batch, kv head) pairs than grid y holds (lowered to 3 here): the rest folded into grid x, the last fold
 * ragged (3 folds of 3 for 8 pairs), with several row blocks per pair. */
static void grid_fold(void **state) {
    (void)state;
    for (int n = 0; n < 2; n++) {
        sdpa_case c = small_case(900 + (uint64_t)n, half_dtype(n), 4, 2, 70, 90, 16, 16);
        c.B = 4;
        c.is_causal = n == 1;
        check_case(&c, ALIGNED_SWAPPED, &one_sm, SPLIT_NONE, NULL);
        c.L = 2;   /* decode: split too */
        check_case(&c, ALIGNED_PADDED, &many_sms, SPLIT_YES, NULL);
    }
}

/* ---------------------------------------------------------------- random suite */

typedef struct {
    sdpa_case c;
    aligned_layout layout;
    const af_cuda_device *dev;
} random_item;

static void random_case(void **state) {
    const random_item *item = *state;
    check_case(&item->c, item->layout, item->dev, SPLIT_ANY, NULL);
}

/* The generator's case in f16/bf16 with head dims <= 256, shrunk to the emulation's budget (batch, then the
 * longer sequence); q/k/v re-laid out to the path's preconditions; devices alternate so splits happen. */
static void random_mma_case(uint64_t seed, int index, void *out) {
    random_item *item = out;
    item->c = case_random(seed, index, 6);
    item->c.dtype = half_dtype(index);
    emu_shrink_case(&item->c, RANDOM_WORK_BUDGET);
    item->layout = (aligned_layout)(index % ALIGNED_COUNT);
    item->dev = index % 3 == 0 ? &one_sm : index % 3 == 1 ? &many_sms : &small_smem;
}

int main(void) {
    static const struct CMUnitTest fixed[] = {
        cmocka_unit_test(head_dims),       cmocka_unit_test(causal_alignments), cmocka_unit_test(masks),
        cmocka_unit_test(decode_split_kv), cmocka_unit_test(decode_without_split), cmocka_unit_test(single_buffered),
        cmocka_unit_test(empty_dims),      cmocka_unit_test(lazy_rescale),      cmocka_unit_test(workspace_sizes),
        cmocka_unit_test(grid_fold),       cmocka_unit_test(plan_tiling_and_occupancy), cmocka_unit_test(row_tiles_of_two),
    };
    setenv("ATTNFORGE_EMU_OCCUPANCY", TEST_OCCUPANCY, 1);
    return emu_run_suite("cuda_mma", fixed, (int)(sizeof fixed / sizeof fixed[0]), random_mma_case,
                         sizeof(random_item), random_case, DEFAULT_CASES, DEFAULT_SEED);
}
