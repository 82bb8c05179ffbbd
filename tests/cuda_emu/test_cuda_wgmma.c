/* The Hopper kernel (src/cuda/attn_wgmma.cuh: a TMA producer warpgroup, two wgmma consumer warpgroups, a 2-stage
 * K/V ring of 128-key tiles), its launcher (attn_wgmma_launch.cuh) and the split-KV combine (attn_combine.cuh) on
 * the emulated device (tests/cuda_emu, with cuda_emulated_hopper.c's wgmma, TMA and mbarrier model) against the
 * double reference: f16 and bf16, both head-dim variants (64, 128) with E != Ev and padded columns, GQA packed into
 * 128-row blocks whose rows wrap from one head to the next, L != S with both causal alignments (rows that see no
 * key), S not a multiple of 128 and several K/V tiles (the ring wraps more than once), bool and additive masks,
 * LSE on and off, split-KV on a device with many multiprocessors, many (batch, kv head) pairs; the persistent
 * schedule (on one multiprocessor one CTA runs every item; on three, more items than CTAs in every form);
 * af_flash_attn's features (windows, softcap, sinks, varlen q and K/V, seqused_k) through af_flash_check's problem;
 * af_cuda_wgmma_accepts' refusals; a random suite. The tolerance is the CPU path's (af_error_bound).
 * ATTNFORGE_TEST_CASES / ATTNFORGE_TEST_SEED change the random suite's count and seed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"
#include "case_gen.h"
#include "core/dtype.h"
#include "emu_case.h"
#include "flash_case.h"
#define AF_MMA_GRID_YZ_MAX 3   /* the launcher folds (batch, kv head) pairs past grid y into grid x from 4 on */
#include "cuda/attn_wgmma_launch.cuh"
#include "sdpa/problem.h"

#define DEFAULT_CASES 64
#define DEFAULT_SEED 20251202u
/* The emulation's time grows with the CTAs' K/V tiles (128 packed rows x 128 keys each, whatever E, Ev and the
 * rows used): a random case gets at most this many (batch, kv head, row block, key tile) quadruples. */
#define RANDOM_TILE_BUDGET 16

/* Devices the launcher plans for: one multiprocessor (no split), many (split-KV whenever the CTAs are few). Each
 * has its own ordinal: the launcher asks a variant's occupancy once per ordinal. */
/* Every variant's occupancy is capped at this (ATTNFORGE_EMU_OCCUPANCY): one CTA of 384 threads and ~161 KiB of
 * shared memory per multiprocessor, as its registers allow on the GPU. */
#define TEST_OCCUPANCY "1"
static const af_cuda_device one_sm = {0, 1, 9, 0, 227 * 1024};
static const af_cuda_device many_sms = {1, 132, 9, 0, 227 * 1024};
/* Three multiprocessors: a persistent grid of 3 CTAs, fewer than the work items, so a CTA runs several items (its
 * mbarrier phases, tail-barrier phase, ping-pong turn, item records and Q rows carried from one to the next). */
static const af_cuda_device three_sms = {2, 3, 9, 0, 227 * 1024};

/* ---------------------------------------------------------------- running the kernel on device copies */

/* The launch on `dev`, with the workspace it asks for (> 0 bytes when the keys were split; freed by the caller). */
typedef struct {
    const af_cuda_device *dev;
    size_t workspace_bytes;
    void *workspace;
    bool refused;   /* af_cuda_wgmma_accepts said no: the case is not one the test meant */
    int64_t items, grid_x;   /* the plan's work items and CTAs */
} wgmma_launch;

/* Set by a check that means the persistent loop: the plan must have given some CTA several items. */
static bool expect_persistent;

/* What a check does when af_cuda_wgmma_accepts refuses the case. */
typedef enum { MUST_ACCEPT = 0, MAY_REFUSE } refusal_rule;

static cudaError_t launch_wgmma(const af_problem *p, void *context) {
    wgmma_launch *run = context;
    if (!af_cuda_wgmma_accepts(p, run->dev)) {
        run->refused = true;
        return cudaErrorInvalidValue;
    }
    af_wgmma_plan plan;
    cudaError_t err = af_wgmma_make_plan(p, run->dev, &plan);
    if (err != cudaSuccess) return err;
    run->items = plan.items, run->grid_x = plan.grid_x;
    if ((err = af_cuda_wgmma_workspace_bytes(p, run->dev, &run->workspace_bytes)) != cudaSuccess) return err;
    if (run->workspace_bytes && (err = cudaMalloc(&run->workspace, run->workspace_bytes)) != cudaSuccess) return err;
    return af_cuda_wgmma_forward(p, run->dev, run->workspace, run->workspace_bytes, NULL);
}

/* How a check expects the keys to be split. */
typedef enum { SPLIT_ANY = 0, SPLIT_NONE, SPLIT_YES } split_expectation;

static void check_split(const wgmma_launch *run, split_expectation split, const char *desc) {
    if (expect_persistent && run->grid_x >= run->items)
        fail_msg("expected a persistent grid, got %lld CTAs for %lld items: %s", (long long)run->grid_x,
                 (long long)run->items, desc);
    if (split == SPLIT_YES && run->workspace_bytes == 0) fail_msg("expected split-KV, got none: %s", desc);
    if (split == SPLIT_NONE && run->workspace_bytes != 0) fail_msg("expected no split-KV, got one: %s", desc);
}

/* Build the case, lay q/k/v out as `layout` says (one per tensor, cycling), let `edit` change the tensors, run on
 * `dev` and compare; `split` states whether the launcher must have split the keys. */
static void check_case_if(const sdpa_case *c, aligned_layout layout, const af_cuda_device *dev,
                          split_expectation split, emu_case_edit edit, refusal_rule refusal) {
    char desc[640], why[640] = "";
    case_describe(c, desc, sizeof desc);
    case_tensors t;
    const bool built = case_build(c, &t) && emu_relayout_qkv(&t.q, &t.k, &t.v, layout) && emu_edit_case(&t, edit);
    wgmma_launch run = {dev, 0, NULL, false, 0, 0};
    const bool ok = built && emu_run_case(&t, launch_wgmma, &run, why, sizeof why);
    cudaFree(run.workspace);
    case_free(&t);
    if (!built) fail_msg("could not build the case (%s): %s", af_last_error(), desc);
    if (run.refused && refusal == MAY_REFUSE) return;
    if (run.refused) fail_msg("af_cuda_wgmma_accepts refused the case: %s", desc);
    if (!ok) fail_msg("%s (layout %s, sm_count %d)\n    %s", desc, emu_layout_name(layout), dev->sm_count, why);
    check_split(&run, split, desc);
}

static void check_case(const sdpa_case *c, aligned_layout layout, const af_cuda_device *dev, split_expectation split,
                       emu_case_edit edit) {
    check_case_if(c, layout, dev, split, edit, MUST_ACCEPT);
}

static sdpa_case small_case(uint64_t seed, af_dtype dtype, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t E,
                            int64_t Ev) {
    sdpa_case c = case_default(1, Hq, Hkv, L, S, E, Ev);
    c.seed = seed;
    c.dtype = dtype;
    return c;
}

static af_dtype half_dtype(int n) { return n % 2 ? AF_BF16 : AF_F16; }

/* ---------------------------------------------------------------- af_flash_attn's features */

/* K/V rows no sequence reads set to NaN: past seqused_k in a fixed or packed tensor, the unused rows of a last page,
 * unused and spare pages. TMA reads whole boxes, so a kernel that gave them weight 0 without clearing them would
 * turn 0·NaN into NaN rows. */
static void poison_unread_rows(flash_tensors *t) {
    const flash_case *c = &t->c;
    const int rank = c->kv == KV_VARLEN ? 3 : 4;   /* {B, S, Hkv, E}, {total, Hkv, E}, {pages, page size, Hkv, E} */
    const int64_t *shape = t->k.view.shape, rows = rank == 4 ? shape[0] * shape[1] : shape[0];
    bool *read = calloc((size_t)rows, sizeof *read);
    if (!read) fail_msg("out of memory");
    for (int b = 0; b < c->B; b++)
        for (int64_t j = 0; j < c->Sk[b]; j++) {
            int64_t row = b * c->S_stored[0] + j;   /* fixed: {B, S, Hkv, E} */
            if (c->kv == KV_VARLEN) {
                const int64_t at = b;
                row = (int64_t)tt_get(&t->cu_k, &at) + j;
            } else if (c->kv == KV_PAGED) {
                const int64_t idx[2] = {b, j / c->page_size};
                row = (int64_t)tt_get(&t->page_table, idx) * c->page_size + j % c->page_size;
            }
            read[row] = true;
        }
    for (int64_t row = 0; row < rows; row++) {
        if (read[row]) continue;
        for (int64_t h = 0; h < c->Hkv; h++)
            for (int side = 0; side < 2; side++) {
                test_tensor *x = side ? &t->v : &t->k;
                for (int64_t e = 0; e < x->view.shape[rank - 1]; e++) {
                    int64_t idx[4] = {row, h, e, 0};
                    if (rank == 4) idx[0] = row / shape[1], idx[1] = row % shape[1], idx[2] = h, idx[3] = e;
                    tt_set(x, idx, NAN);
                }
            }
    }
    free(read);
}

static void check_flash_with(const flash_case *c, aligned_layout layout, const af_cuda_device *dev,
                             split_expectation split, bool poison) {
    char desc[1024], why[640] = "";
    flash_case_describe(c, desc, sizeof desc);
    flash_tensors t;
    const bool built = flash_case_build(c, &t) && emu_relayout_qkv(&t.q, &t.k, &t.v, layout);
    if (built && poison) poison_unread_rows(&t);
    wgmma_launch run = {dev, 0, NULL, false, 0, 0};
    const bool ok = built && emu_run_flash(&t, launch_wgmma, &run, NULL, why, sizeof why);
    cudaFree(run.workspace);
    flash_case_free(&t);
    if (!built) fail_msg("could not build the flash case (%s): %s", af_last_error(), desc);
    if (run.refused) fail_msg("af_cuda_wgmma_accepts refused the case: %s", desc);
    if (!ok) fail_msg("%s (layout %s, sm_count %d)\n    %s", desc, emu_layout_name(layout), dev->sm_count, why);
    check_split(&run, split, desc);
}

static void check_flash(const flash_case *c, aligned_layout layout, const af_cuda_device *dev,
                        split_expectation split) {
    check_flash_with(c, layout, dev, split, false);
}

static flash_case half_flash(uint64_t seed, af_dtype dtype, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S,
                             int64_t E, int64_t Ev) {
    flash_case c = flash_case_default(B, Hq, Hkv, L, S, E, Ev);
    c.seed = seed;
    c.dtype = dtype;
    c.sink_dtype = dtype;
    return c;
}

static void set_lengths(flash_case *c, const int64_t *rows, const int64_t *keys, const int64_t *stored) {
    for (int b = 0; b < c->B; b++) {
        c->Lq[b] = rows[b];
        c->Sk[b] = keys[b];
        c->S_stored[b] = stored ? stored[b] : keys[b];
    }
}

/* ---------------------------------------------------------------- targeted cases */

/* Both variants and their padding: head dim 64 (E 64/Ev 64, E 40/Ev 64, E 24/Ev 8) and 128 (E 128/Ev 128, E 80/Ev 128,
 * E 128/Ev 72, E 64/Ev 128, E 120/Ev 40, E 65/Ev 1), groups 1, 2, 4 (130, 140 and 132 packed rows: a last block of a
 * few rows), S across two tiles. */
static void head_dims(void **state) {
    (void)state;
    static const int64_t dims[][2] = {{64, 64}, {40, 64}, {128, 128}, {80, 128}, {128, 72},
                                      {64, 128}, {120, 40}, {24, 8}, {65, 1}};
    static const int64_t heads[][3] = {{2, 2, 65}, {2, 1, 70}, {4, 1, 33}};   /* Hq, Hkv, L */
    for (int d = 0; d < 9; d++) {
        const int64_t *h = heads[d % 3];
        sdpa_case c = small_case(100 + (uint64_t)d, half_dtype(d), h[0], h[1], h[2], 150 + 7 * d, dims[d][0],
                                 dims[d][1]);
        c.out_layout = (tensor_layout)(d % LAYOUT_COUNT);
        c.lse_layout = (tensor_layout)((d + 1) % LAYOUT_COUNT);
        c.with_lse = d % 4 != 3;
        check_case(&c, (aligned_layout)(d % ALIGNED_COUNT), &one_sm, SPLIT_NONE, NULL);
    }
}

/* Head dim 256 (64-key tiles, two n128 products a k-step for O's column halves, no ping-pong): E and Ev padded from
 * 129..256, both dtypes, several tiles through the ring (5 of 64 keys), causal of both alignments with tiles skipped,
 * a mask, GQA rows of two heads in a block, a split on many multiprocessors. */
static void head_dim_256(void **state) {
    (void)state;
    static const int64_t dims[][2] = {{256, 256}, {200, 256}, {256, 100}, {160, 200}, {130, 129}, {256, 64}};
    for (int d = 0; d < 6; d++) {
        sdpa_case c = small_case(150 + (uint64_t)d, half_dtype(d), d % 3 == 1 ? 4 : 2, 2, d % 3 == 1 ? 40 : 70,
                                 d % 2 ? 300 : 190, dims[d][0], dims[d][1]);
        c.is_causal = d == 2;
        c.causal_bottom_right = d == 3;
        if (d == 4) {
            c.mask = MASK_ADDITIVE;
            c.mask_shape = "1LS";
            c.masked_row_rate = 0.2;
        }
        c.with_lse = d != 5;
        check_case(&c, (aligned_layout)(d % ALIGNED_COUNT), d == 5 ? &many_sms : &one_sm,
                   d == 5 ? SPLIT_YES : SPLIT_NONE, NULL);
    }
}

/* Dynamic shared memory at a window address off the 128-byte swizzle's 1024-byte pattern (0x480: 128-aligned, as a
 * static __shared__ variable of 128 bytes would leave it): TMA and wgmma swizzle by window-address bits (the
 * emulation too), so the kernel must start its tiles on the pattern (af_wgmma_tiles_base) or read Q and K with
 * the wrong chunks. Both head-dim variants of every size, causal and not. */
static void shared_window_off_pattern(void **state) {
    (void)state;
    static const int64_t dims[][2] = {{64, 64}, {128, 100}, {200, 256}, {40, 64}};
    af_emu_set_shared_window_base(0x480);
    for (int d = 0; d < 4; d++) {
        sdpa_case c = small_case(170 + (uint64_t)d, half_dtype(d), 2, 1, 70, d % 2 ? 300 : 190, dims[d][0],
                                 dims[d][1]);
        c.is_causal = d == 1;
        check_case(&c, (aligned_layout)(d % ALIGNED_COUNT), &one_sm, SPLIT_NONE, NULL);
    }
    af_emu_set_shared_window_base(0x400);
}

/* Pack-GQA: groups 1, 2, 4 and 8 whose packed rows wrap from one head to the next inside a 128-row block (L 97 with
 * group 2: block 0 holds head 0's rows and 31 of head 1's, block 1 the rest), a last block partly empty, two kv heads
 * and two batches (the CTA's (batch, kv head) from grid y); causal top-left and bottom-right, where the block's key
 * range spans the first and the last query rows of the group. */
static void gqa_row_wrapping(void **state) {
    (void)state;
    static const int64_t shapes[][4] = {{2, 2, 130, 140}, {4, 2, 97, 170}, {8, 2, 33, 140}, {8, 1, 20, 300}};
    for (int n = 0; n < 8; n++) {
        const int64_t *s = shapes[n % 4];
        sdpa_case c = small_case(200 + (uint64_t)n, half_dtype(n), s[0], s[1], s[2], s[3], n % 2 ? 64 : 96, 64);
        c.B = n == 4 ? 2 : 1;
        c.is_causal = n >= 4 && n % 2 == 0;
        c.causal_bottom_right = n >= 4 && n % 2 == 1;
        c.with_lse = n != 5;
        check_case(&c, (aligned_layout)(n % ALIGNED_COUNT), &one_sm, SPLIT_NONE, NULL);
    }
}

/* Both causal alignments with L < S, L > S (bottom-right: the first rows see no key: out 0, lse -inf; top-left with
 * L > S: the last rows see every key), L = S, S not a multiple of 128 and S < 128 (one partial tile); tiles past a
 * block's last visible key are never loaded. */
static void causal_alignments(void **state) {
    (void)state;
    static const int64_t seqs[][2] = {{70, 300}, {200, 60}, {130, 130}, {66, 129}, {150, 40}, {100, 257}};
    int n = 0;
    for (int s = 0; s < 6; s++)
        for (int br = 0; br < 2; br++, n++) {
            const int group = seqs[s][0] < 128 && n % 3 == 0 ? 2 : 1;
            sdpa_case c = small_case(300 + (uint64_t)n, half_dtype(n), 2 * group, 2, seqs[s][0], seqs[s][1],
                                     n % 4 < 2 ? 64 : 128, n % 4 < 2 ? 48 : 128);
            c.is_causal = !br;
            c.causal_bottom_right = br;
            c.with_lse = n % 5 != 2;
            check_case(&c, (aligned_layout)(n % ALIGNED_COUNT), &one_sm, SPLIT_NONE, NULL);
        }
}

/* Bool and additive masks of every broadcast shape (as given and expanded), a third of the rows fully masked (out 0
 * and lse -inf), packed rows of two heads in one block (group 2: the mask's head follows the row). */
static void masks(void **state) {
    (void)state;
    for (int s = 0; s < mask_shape_count; s++) {
        const int kind = s % 2;
        sdpa_case c = small_case(400 + (uint64_t)s, half_dtype(s / 2), 2, 1, 45, 140, s % 3 ? 32 : 128, 64);
        c.mask = kind ? MASK_ADDITIVE : MASK_BOOL;
        c.mask_shape = mask_shapes[s];
        c.mask_expanded = s % 4 >= 2;
        c.mask_keep = 0.5;
        c.masked_row_rate = 0.35;
        c.mask_layout = (tensor_layout)(s % LAYOUT_COUNT);
        c.with_lse = s % 3 != 1;
        check_case(&c, (aligned_layout)(s % ALIGNED_COUNT), &one_sm, SPLIT_ANY, NULL);
    }
}

/* Several K/V tiles on one multiprocessor (no split): 3 to 4 tiles through the 2-stage ring (the producer waits on
 * the "empty" barriers and the phases' parity flips more than once), S not a multiple of 128, with masks, causality
 * and without. */
static void kv_ring(void **state) {
    (void)state;
    static const int64_t keys[] = {400, 385, 257, 512, 300, 449};
    for (int n = 0; n < 6; n++) {
        sdpa_case c = small_case(450 + (uint64_t)n, half_dtype(n), 1, 1, 65 + 11 * n, keys[n], n % 2 ? 128 : 64,
                                 n % 3 ? 64 : 128);
        c.causal_bottom_right = n == 2;
        c.is_causal = n == 5;
        if (n == 3) {
            c.mask = MASK_BOOL;
            c.mask_shape = "LS";
            c.masked_row_rate = 0.1;
        }
        if (n == 4) {
            c.mask = MASK_ADDITIVE;
            c.mask_shape = "1LS";
        }
        c.with_lse = n != 1;
        check_case(&c, (aligned_layout)(n % ALIGNED_COUNT), &one_sm, SPLIT_NONE, NULL);
    }
}

/* Split-KV on a device with many multiprocessors: one or two CTAs and 2 to 4 key tiles, so the keys are split
 * (asserted) and merged by the combine; causal (later splits see no key for early rows), masked (whole rows too),
 * S not a multiple of 128, LSE on and off. */
static void split_kv(void **state) {
    (void)state;
    static const int64_t heads[][2] = {{1, 1}, {4, 2}, {8, 1}, {2, 1}};
    for (int n = 0; n < 8; n++) {
        const int64_t Hq = heads[n % 4][0], Hkv = heads[n % 4][1], group = Hq / Hkv;
        sdpa_case c = small_case(500 + (uint64_t)n, half_dtype(n), Hq, Hkv, 128 / group + 1 + 7 * (n % 3),
                                 270 + 43 * n, n % 3 ? 64 : 128, n % 3 ? 64 : 80);
        c.causal_bottom_right = n % 4 == 1;
        c.is_causal = n % 4 == 2;   /* top-left with L < S: each row sees few keys, later splits see none */
        if (n % 4 == 3) {
            c.mask = n == 3 ? MASK_BOOL : MASK_ADDITIVE;
            c.mask_shape = n == 3 ? "LS" : "B1LS";
            c.masked_row_rate = 0.25;
        }
        c.with_lse = n % 3 != 2;
        c.out_layout = (tensor_layout)(n % LAYOUT_COUNT);
        c.lse_layout = (tensor_layout)((n + 2) % LAYOUT_COUNT);
        check_case(&c, (aligned_layout)(n % ALIGNED_COUNT), &many_sms, SPLIT_YES, NULL);
    }
}

/* One key (top-left causal too: a single tile with 127 keys masked), one value column, one q/k column; no key at all
 * (S = 0: out 0, lse -inf) and no value column (Ev = 0: lse only) when the launcher takes them (it may leave them to
 * attn_mma.cuh: TMA cannot map an empty tensor). */
static void edge_sizes(void **state) {
    (void)state;
    static const int64_t sizes[][4] = {{70, 1, 24, 16}, {80, 100, 1, 1}, {70, 0, 24, 16}, {80, 100, 24, 0}};
    for (int s = 0; s < 4; s++)   /* L, S, E, Ev */
        for (int dt = 0; dt < 2; dt++) {
            sdpa_case c = small_case(700 + (uint64_t)s, half_dtype(dt), 2, 1, sizes[s][0], sizes[s][1], sizes[s][2],
                                     sizes[s][3]);
            c.is_causal = dt == 1 && s == 0;
            check_case_if(&c, ALIGNED_CONTIGUOUS, dt ? &many_sms : &one_sm, SPLIT_NONE, NULL,
                          s < 2 ? MUST_ACCEPT : MAY_REFUSE);
        }
}

/* Scores whose row max jumps by far more than the lazy-rescale threshold from one 64-key half tile to the next (and
 * ones that fall): the stale max is corrected exactly when it must be. Keys of later tiles get larger q·k. */
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
    for (int n = 0; n < 3; n++) {
        sdpa_case c = small_case(800 + (uint64_t)n, half_dtype(n), 2, 1, 40 + n, 330, 32, 32);
        c.has_scale = true;
        c.scale = 0.5;
        c.causal_bottom_right = n == 2;
        check_case(&c, ALIGNED_CONTIGUOUS, n == 1 ? &many_sms : &one_sm, n == 1 ? SPLIT_YES : SPLIT_NONE,
                   growing_scores);
    }
}

/* Scores whose row max jumps by far more than the lazy-rescale threshold between the two 64-key halves of one
 * 128-key tile, with nothing later to drown the first half (one or two tiles, one multiprocessor): the first half's
 * weights, computed against the old max, must be rescaled with O and l before P·V (odd rows: small scores on keys
 * j % 128 < 64, large ones on the rest; even rows the other way round, no rescale). */
static void jump_inside_tile(case_tensors *t) {
    for (int64_t b = 0; b < t->c.B; b++)
        for (int64_t h = 0; h < t->c.Hkv; h++)
            for (int64_t j = 0; j < t->c.S; j++)
                for (int64_t e = 0; e < t->c.E; e++) {
                    const int64_t idx[4] = {b, h, j, e};
                    const double ramp = j % 128 < 64 ? 0.25 : 3.0;
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

static void rescale_inside_a_tile(void **state) {
    (void)state;
    static const int64_t keys[] = {128, 200, 100};
    for (int n = 0; n < 3; n++) {
        sdpa_case c = small_case(850 + (uint64_t)n, half_dtype(n), 2, 1, 40, keys[n], n == 2 ? 128 : 32, 64);
        c.has_scale = true;
        c.scale = 0.5;
        check_case(&c, (aligned_layout)n, &one_sm, SPLIT_NONE, jump_inside_tile);
    }
}

/* More (batch, kv head) pairs than grid y holds (lowered to 3 here): the rest folded into grid x, the last fold
 * ragged (3 folds of 3 for 8 pairs), with two row blocks per pair; then split too. */
static void grid_fold(void **state) {
    (void)state;
    for (int n = 0; n < 2; n++) {
        sdpa_case c = small_case(900 + (uint64_t)n, half_dtype(n), 4, 2, 70, 90, 16, 16);
        c.B = 4;
        c.is_causal = n == 1;
        check_case(&c, ALIGNED_SWAPPED, &one_sm, SPLIT_NONE, NULL);
    }
    sdpa_case c = small_case(902, AF_BF16, 4, 2, 33, 300, 16, 16);   /* 8 pairs of one block, 3 tiles: split */
    c.B = 4;
    check_case(&c, ALIGNED_PADDED, &many_sms, SPLIT_YES, NULL);
}

/* af_flash_attn's windows: both sides, left only with causality (sliding window), right only, a window that keeps
 * a block's first tiles unloaded; packed GQA rows of two heads in one block. */
static void flash_windows(void **state) {
    (void)state;
    flash_case c = half_flash(1000, AF_BF16, 2, 4, 2, 70, 300, 64, 64);
    c.has_window = true, c.left = 50, c.right = 20;
    check_flash(&c, ALIGNED_CONTIGUOUS, &one_sm, SPLIT_NONE);

    c = half_flash(1001, AF_F16, 1, 2, 2, 150, 170, 128, 128);
    c.causal = true, c.has_window = true, c.left = 40, c.right = -1;   /* sliding window */
    check_flash(&c, ALIGNED_SWAPPED, &one_sm, SPLIT_NONE);

    c = half_flash(1002, AF_BF16, 1, 4, 1, 40, 390, 80, 96);
    c.has_window = true, c.left = -1, c.right = 3;   /* right only: L < S, so the last tiles are past every row */
    c.with_lse = false;
    check_flash(&c, ALIGNED_PADDED, &one_sm, SPLIT_NONE);

    c = half_flash(1003, AF_F16, 1, 2, 1, 70, 400, 64, 40);
    c.has_window = true, c.left = 30, c.right = 0;   /* rows see keys 300..: the first tiles are never loaded */
    check_flash(&c, ALIGNED_CONTIGUOUS, &many_sms, SPLIT_YES);
}

/* Softcap (logits tanh-capped before the masks and the softmax), with large inputs so the cap bites; and sinks (a
 * per-head logit that joins every row's softmax, some dominating), split and not, with and without LSE. */
static void flash_softcap_and_sinks(void **state) {
    (void)state;
    flash_case c = half_flash(1100, AF_F16, 1, 4, 1, 40, 200, 80, 128);
    c.softcap = 5.0, c.amplitude = 3.0;
    check_flash(&c, ALIGNED_SWAPPED, &one_sm, SPLIT_NONE);

    c = half_flash(1101, AF_BF16, 2, 2, 2, 70, 150, 64, 64);
    c.softcap = 30.0, c.amplitude = 8.0, c.causal = true;
    check_flash(&c, ALIGNED_CONTIGUOUS, &one_sm, SPLIT_NONE);

    c = half_flash(1102, AF_F16, 1, 2, 1, 100, 260, 128, 72);
    c.sink = true, c.sink_dtype = AF_F32, c.sink_offset = 6.0;   /* a sink that dominates */
    check_flash(&c, ALIGNED_PADDED, &one_sm, SPLIT_NONE);

    c = half_flash(1103, AF_BF16, 1, 8, 1, 17, 380, 64, 64);   /* 136 rows, 3 tiles: split, the combine adds the sink */
    c.sink = true, c.causal = true;
    check_flash(&c, ALIGNED_SWAPPED, &many_sms, SPLIT_YES);

    c = half_flash(1104, AF_F16, 1, 2, 2, 66, 300, 40, 40);
    c.sink = true, c.softcap = 5.0, c.amplitude = 3.0, c.with_lse = false;
    check_flash(&c, ALIGNED_CONTIGUOUS, &many_sms, SPLIT_YES);
}

/* Varlen q and K/V (cu_seqlens), seqused_k over fixed and packed K/V: sequences of different lengths in one launch
 * (a sequence with no key: out 0, lse -inf; one with fewer packed rows than a block; keys past a sequence's end are
 * the next sequence's, which the key ranges mask), causal (bottom-right), split and not. */
static void flash_varlen_and_seqused(void **state) {
    (void)state;
    {   /* varlen q and K/V, a sequence without keys */
        flash_case c = half_flash(1200, AF_BF16, 3, 4, 2, 0, 0, 64, 64);
        const int64_t rows[3] = {70, 5, 130}, keys[3] = {200, 0, 77};
        set_lengths(&c, rows, keys, NULL);
        c.varlen_q = true, c.kv = KV_VARLEN;
        check_flash(&c, ALIGNED_CONTIGUOUS, &one_sm, SPLIT_NONE);
        c.causal = true, c.seed++;
        check_flash(&c, ALIGNED_PADDED, &one_sm, SPLIT_NONE);
    }
    {   /* seqused_k over fixed K/V: fewer keys used than stored */
        flash_case c = half_flash(1210, AF_F16, 2, 2, 1, 80, 300, 128, 96);
        const int64_t rows[2] = {80, 80}, keys[2] = {123, 300}, stored[2] = {300, 300};
        set_lengths(&c, rows, keys, stored);
        c.seqused = true;
        check_flash(&c, ALIGNED_SWAPPED, &one_sm, SPLIT_NONE);
        c.has_window = true, c.left = -1, c.right = 10, c.seed++;
        check_flash(&c, ALIGNED_CONTIGUOUS, &one_sm, SPLIT_NONE);
    }
    {   /* varlen K/V with seqused_k, fixed q */
        flash_case c = half_flash(1220, AF_BF16, 2, 4, 1, 20, 0, 72, 64);
        const int64_t rows[2] = {20, 20}, keys[2] = {150, 33}, stored[2] = {260, 140};
        set_lengths(&c, rows, keys, stored);
        c.kv = KV_VARLEN, c.seqused = true;
        check_flash(&c, ALIGNED_PADDED, &one_sm, SPLIT_NONE);
    }
    {   /* paged K/V through TMA, a box a page: pages of 16 keys (8 boxes a tile) and of 256 (a tile inside one page),
         * a first page shared by both sequences, causal, a split on many multiprocessors */
        flash_case c = half_flash(1240, AF_BF16, 2, 4, 2, 0, 0, 64, 64);
        const int64_t rows[2] = {40, 33}, keys[2] = {300, 150};
        set_lengths(&c, rows, keys, NULL);
        c.kv = KV_PAGED, c.seqused = true, c.page_size = 16, c.shared_page = true, c.causal = true;
        check_flash(&c, ALIGNED_PADDED, &one_sm, SPLIT_NONE);
        c.seed++, c.dtype = c.sink_dtype = AF_F16, c.page_size = 256, c.causal = false, c.E = 100, c.Ev = 72;
        check_flash(&c, ALIGNED_CONTIGUOUS, &many_sms, SPLIT_YES);
    }
    {   /* varlen q on many multiprocessors: split, with softcap and a window */
        flash_case c = half_flash(1230, AF_F16, 2, 2, 2, 0, 0, 64, 128);
        const int64_t rows[2] = {90, 66}, keys[2] = {330, 280};
        set_lengths(&c, rows, keys, NULL);
        c.varlen_q = true, c.kv = KV_VARLEN, c.softcap = 30.0, c.has_window = true, c.left = 200, c.right = 50;
        check_flash(&c, ALIGNED_SWAPPED, &many_sms, SPLIT_YES);
    }
}

/* NaN in every K/V row no sequence reads (poison_unread_rows): past seqused_k in fixed and packed tensors, in a last
 * page's unused rows and in unused pages; the tail tile's partial rows at each head dim, split and not. */
static void flash_nan_past_keys(void **state) {
    (void)state;
    static const int64_t dims[3] = {64, 128, 256};
    for (int d = 0; d < 3; d++) {
        flash_case c = half_flash(1400 + 10 * (uint64_t)d, half_dtype(d), 2, 4, 2, 40, 0, dims[d], dims[d] - 8);
        const int64_t rows[2] = {40, 40}, keys[2] = {150, 37}, stored[2] = {260, 260};
        set_lengths(&c, rows, keys, stored);
        c.seqused = true;
        check_flash_with(&c, ALIGNED_CONTIGUOUS, &one_sm, SPLIT_NONE, true);
        c.kv = KV_VARLEN, c.seed++;
        const int64_t stored2[2] = {200, 90};
        set_lengths(&c, rows, keys, stored2);
        check_flash_with(&c, ALIGNED_PADDED, &many_sms, SPLIT_ANY, true);
        c.kv = KV_PAGED, c.page_size = d == 2 ? 32 : 16, c.seed++;
        check_flash_with(&c, ALIGNED_SWAPPED, &one_sm, SPLIT_NONE, true);
        c.page_size = 256, c.causal = true, c.seed++;
        check_flash_with(&c, ALIGNED_CONTIGUOUS, &many_sms, SPLIT_ANY, true);
    }
}

/* Head dim 256 through af_flash_attn's forms: paged K/V whose pages are a box each (32 keys, two a 64-key tile) or
 * hold whole tiles (128), a shared first page; varlen K/V with a window, softcap and a sink; split. */
static void flash_head_dim_256(void **state) {
    (void)state;
    flash_case c = half_flash(1300, AF_BF16, 2, 4, 2, 0, 0, 256, 192);
    const int64_t rows[2] = {40, 33}, keys[2] = {200, 90};
    set_lengths(&c, rows, keys, NULL);
    c.kv = KV_PAGED, c.seqused = true, c.page_size = 32, c.shared_page = true, c.causal = true;
    check_flash(&c, ALIGNED_PADDED, &one_sm, SPLIT_NONE);
    c.seed++, c.dtype = c.sink_dtype = AF_F16, c.page_size = 128, c.causal = false, c.E = 144, c.Ev = 256;
    check_flash(&c, ALIGNED_CONTIGUOUS, &many_sms, SPLIT_YES);

    c = half_flash(1310, AF_F16, 2, 2, 2, 0, 0, 256, 256);
    const int64_t rows2[2] = {70, 66}, keys2[2] = {230, 150};
    set_lengths(&c, rows2, keys2, NULL);
    c.varlen_q = true, c.kv = KV_VARLEN, c.softcap = 20.0, c.amplitude = 3.0, c.sink = true;
    c.has_window = true, c.left = 100, c.right = 30;
    check_flash(&c, ALIGNED_SWAPPED, &one_sm, SPLIT_NONE);
}

/* The emulation's cost of a tile relative to head dim 128's: head dim 256 reads twice the columns. */
static double hd_cost(int64_t E, int64_t Ev) { return E > 128 || Ev > 128 ? 2.0 : 1.0; }

/* Random flash cases of the Hopper path's forms (fixed, varlen K/V, seqused_k, paged), every
 * window, softcap and sink, head dims up to 256, rows raised past 64 packed ones, shrunk to the budget. */
static double flash_tiles(const flash_case *c) {
    const int64_t group = c->Hkv > 0 ? c->Hq / c->Hkv : 1;
    int64_t rows = 0, keys = 0;
    for (int b = 0; b < c->B; b++) {
        rows = c->Lq[b] > rows ? c->Lq[b] : rows;
        keys = c->S_stored[b] > keys ? c->S_stored[b] : keys;
    }
    return (double)c->B * c->Hkv * ((group * rows + 127) / 128) * ((keys + 127) / 128) * hd_cost(c->E, c->Ev);
}

static void flash_random(void **state) {
    (void)state;
    const int count = case_suite_count(16);
    const uint64_t seed = case_suite_seed(DEFAULT_SEED) ^ 0xf1a5u;
    for (int i = 0; i < count; i++) {
        flash_case c = flash_case_random(seed, 4 * i);   /* every 4th: the window kinds change every 9 */
        test_rng rng = {c.seed ^ 0x3c6ef372u};
        c.dtype = half_dtype(i);
        if (c.sink_dtype != AF_F32) c.sink_dtype = c.dtype;
        if (c.B == 0) c.B = 1;
        if (c.kv == KV_PAGED && c.page_size != 16 && c.page_size != 64 && c.page_size != 128)
            c.page_size = 16;   /* pages TMA can box (1, 3 and 17: test_cuda_wgmma_gather.c) */
        const int64_t group = c.Hq / c.Hkv, min_rows = 64 / group + 1;
        int64_t longest = 0;
        for (int b = 0; b < c.B; b++) longest = c.Lq[b] > longest ? c.Lq[b] : longest;
        if (longest < min_rows) {   /* the first sequence (all of them when q is fixed) past 64 packed rows */
            const int64_t rows = min_rows + rng_range(&rng, 0, 40);
            for (int b = 0; b < c.B; b++)
                if (b == 0 || !c.varlen_q) c.Lq[b] = rows;
        }
        while (flash_tiles(&c) > RANDOM_TILE_BUDGET) {
            if (c.B > 1) c.B--;
            else {
                c.S_stored[0] = c.S_stored[0] * 3 / 4;
                if (c.Sk[0] > c.S_stored[0]) c.Sk[0] = c.S_stored[0];
            }
        }
        if (c.S_stored[0] < 1) c.S_stored[0] = 1;   /* some key stored: TMA maps no empty tensor */
        if (c.kv == KV_FIXED)   /* fixed K/V: one stored length */
            for (int b = 1; b < c.B; b++) {
                c.S_stored[b] = c.S_stored[0];
                if (c.Sk[b] > c.S_stored[b]) c.Sk[b] = c.S_stored[b];
            }
        if (!c.seqused)
            for (int b = 0; b < c.B; b++) c.Sk[b] = c.S_stored[b];
        check_flash(&c, (aligned_layout)(i % ALIGNED_COUNT), i % 2 ? &many_sms : &one_sm, SPLIT_ANY);
    }
}

/* ---------------------------------------------------------------- the launcher's answers */

/* A problem the Hopper path takes: f16, 2·70 packed rows, 300 keys, head dim 128, q/k/v contiguous (aligned bases
 * that are never read). */
static _Alignas(16) char fake_tensor[16];
static af_problem hopper_problem(void) {
    af_problem p;
    memset(&p, 0, sizeof p);
    p.dtype = p.kv_dtype = p.out_dtype = AF_F16;
    p.B = 1, p.Hq = 2, p.Hkv = 1, p.group = 2, p.L = 70, p.S = 300, p.E = p.Ev = 128;
    p.q = p.k = p.v = fake_tensor;
    p.out = fake_tensor;
    const int64_t q_stride[4] = {2 * 70 * 128, 70 * 128, 128, 1}, kv_stride[4] = {300 * 128, 300 * 128, 128, 1};
    memcpy(p.q_stride, q_stride, sizeof q_stride);
    memcpy(p.k_stride, kv_stride, sizeof kv_stride);
    memcpy(p.v_stride, kv_stride, sizeof kv_stride);
    memcpy(p.out_stride, q_stride, sizeof q_stride);
    p.scale = 1.0 / sqrt(128.0);
    return p;
}

/* af_cuda_wgmma_views_fit: what TMA can box in place. Size-1 dims and a one-column head dim take any stride; a
 * broadcast (stride 0), a non-contiguous row, a stride off 16 bytes or a misaligned base on a dim that is walked go
 * to mma.sync; the gathered paged path reads in place and needs no map. */
static void views_fit(void **state) {
    (void)state;
    af_problem p = hopper_problem();
    p.B = 2, p.Hq = 4, p.Hkv = 2, p.S = 150, p.E = p.Ev = 64;
    const int64_t contiguous[4] = {2 * 150 * 64, 150 * 64, 64, 1};
    memcpy(p.k_stride, contiguous, sizeof contiguous);
    memcpy(p.v_stride, contiguous, sizeof contiguous);
    assert_true(af_cuda_wgmma_views_fit(&p));
    p.k_stride[0] = 0;   /* K broadcast over B = 2 */
    assert_false(af_cuda_wgmma_views_fit(&p));
    p.B = 1;             /* ... a size-1 dim: never walked */
    assert_true(af_cuda_wgmma_views_fit(&p));
    p.k_stride[0] = 7;
    assert_true(af_cuda_wgmma_views_fit(&p));
    p.v_stride[1] = 0;   /* V broadcast over Hkv = 2 */
    assert_false(af_cuda_wgmma_views_fit(&p));
    p.Hkv = 1, p.Hq = 2;
    p.v_stride[1] = 5;
    assert_true(af_cuda_wgmma_views_fit(&p));
    p.k_stride[3] = 3;   /* rows not contiguous */
    assert_false(af_cuda_wgmma_views_fit(&p));
    p.E = 1;             /* ... one column: its stride is never used */
    assert_true(af_cuda_wgmma_views_fit(&p));
    p.v_stride[2] = 68;  /* keys 136 bytes apart: not whole 16 bytes */
    assert_false(af_cuda_wgmma_views_fit(&p));
    p.v_stride[2] = 64;
    p.k = fake_tensor + 2;   /* a misaligned base */
    assert_false(af_cuda_wgmma_views_fit(&p));
}

/* The order CTAs take their items (af_wgmma_sched): every item once; full attention row blocks fastest (the grid's
 * old order); under causality or a window the heaviest (largest) row block first, never a lighter one before a
 * heavier, heaviest-first exactly when causal or windowed; the plan's grid one wave of persistent CTAs, or one CTA an
 * item at head dim 256 and for paged caches. */
static void schedule_order(void **state) {
    (void)state;
    for (int heaviest = 0; heaviest < 2; heaviest++) {
        const af_wgmma_sched s = {5, 3, 2, heaviest, 30};
        const int64_t items = af_wgmma_sched_items(&s);
        assert_int_equal(items, 30);
        bool seen[30] = {false};
        int64_t last_rb = heaviest ? 5 : -1;
        for (int64_t i = 0; i < items; i++) {
            int64_t rb, bhk, split;
            af_wgmma_sched_item(&s, i, &rb, &bhk, &split);
            assert_true(rb >= 0 && rb < 5 && bhk >= 0 && bhk < 3 && split >= 0 && split < 2);
            const int64_t at = (split * 3 + bhk) * 5 + rb;
            assert_false(seen[at]);
            seen[at] = true;
            if (heaviest) assert_true(rb <= last_rb);   /* never a heavier row block after a lighter one */
            else assert_int_equal(at, i);
            last_rb = rb;
        }
    }
    af_problem p = hopper_problem();   /* 2 row blocks */
    af_wgmma_plan plan;
    assert_int_equal(af_wgmma_make_plan(&p, &one_sm, &plan), cudaSuccess);
    assert_int_equal(plan.items, af_wgmma_sched_items(&plan.sched));
    assert_int_equal(plan.grid_x, 1);   /* persistent: one CTA walks both items */
    assert_false(plan.sched.heaviest_first);
    p.causal = AF_CAUSAL_TOP_LEFT, p.B = 4;
    assert_int_equal(af_wgmma_make_plan(&p, &many_sms, &plan), cudaSuccess);
    assert_int_equal(plan.grid_x, af_wgmma_sched_items(&plan.sched));
    assert_true(plan.sched.heaviest_first);
    assert_int_equal(af_wgmma_make_plan(&p, &three_sms, &plan), cudaSuccess);
    assert_int_equal(plan.items, 8);   /* 2 row blocks x 4 batches */
    assert_int_equal(plan.sched.items, 8);
    assert_int_equal(plan.grid_x, 3);
    p.causal = AF_CAUSAL_NONE, p.has_window = true, p.window_left = 10, p.window_right = 0;
    assert_int_equal(af_wgmma_make_plan(&p, &one_sm, &plan), cudaSuccess);
    assert_true(plan.sched.heaviest_first);
    assert_int_equal(plan.grid_x, 1);
    /* one item a CTA: head dim 256 (no persistent variant), paged caches (pages checked per CTA), TMA or gathered */
    p.E = p.Ev = 256;
    assert_int_equal(af_wgmma_make_plan(&p, &three_sms, &plan), cudaSuccess);
    assert_int_equal(plan.grid_x, plan.items);
    p.E = p.Ev = 128;
    static const int32_t table[3] = {0, 1, 2};
    for (int page = 16; page <= 24; page += 8) {
        p.page_table = table, p.page_size = page, p.page_table_stride[1] = 1, p.num_pages = 3;
        assert_int_equal(af_wgmma_make_plan(&p, &three_sms, &plan), cudaSuccess);
        assert_true(plan.items > 3);
        assert_int_equal(plan.grid_x, plan.items);
    }
}

/* af_cuda_wgmma_accepts: yes for f16/bf16, E and Ev up to 256, more than 64 packed rows, fixed or varlen K/V and
 * seqused_k, paged K/V of any page size (TMA boxes or the gathered path), on compute capability 9.0 with the shared
 * memory for the variant; no on 8.0, 8.9 or 10.0 (sm_90a code runs on 9.0 only), for head dims past 256, float8
 * (K/V or all), f32, mixed dtypes, 64 packed rows or fewer. */
static void accepts_and_refusals(void **state) {
    (void)state;
    const af_cuda_device ampere = {20, 108, 8, 0, 163 * 1024}, ada = {21, 128, 8, 9, 99 * 1024},
                         blackwell = {22, 148, 10, 0, 227 * 1024}, small = {23, 132, 9, 0, 99 * 1024};
    af_problem p = hopper_problem();
    assert_true(af_cuda_wgmma_accepts(&p, &one_sm));
    assert_true(af_cuda_wgmma_accepts(&p, &many_sms));
    assert_false(af_cuda_wgmma_accepts(&p, &ampere));
    assert_false(af_cuda_wgmma_accepts(&p, &ada));
    assert_false(af_cuda_wgmma_accepts(&p, &blackwell));
    assert_false(af_cuda_wgmma_accepts(&p, &small));   /* head dim 128's ~161 KiB do not fit 99 KiB */
    p.E = p.Ev = 64;
    assert_true(af_cuda_wgmma_accepts(&p, &small));    /* head dim 64's ~81 KiB do */

    p = hopper_problem();
    p.dtype = p.kv_dtype = p.out_dtype = AF_BF16;
    assert_true(af_cuda_wgmma_accepts(&p, &one_sm));
    p.E = 256, p.Ev = 128;
    assert_true(af_cuda_wgmma_accepts(&p, &one_sm));
    assert_false(af_cuda_wgmma_accepts(&p, &small));   /* head dim 256's ~192 KiB */
    p.E = 128, p.Ev = 256;
    assert_true(af_cuda_wgmma_accepts(&p, &one_sm));
    p.E = 129, p.Ev = 64;
    assert_true(af_cuda_wgmma_accepts(&p, &one_sm));
    p.E = 257, p.Ev = 64;
    assert_false(af_cuda_wgmma_accepts(&p, &one_sm));
    p.E = 64, p.Ev = 257;
    assert_false(af_cuda_wgmma_accepts(&p, &one_sm));
    p.E = 1, p.Ev = 1;
    assert_true(af_cuda_wgmma_accepts(&p, &one_sm));

    p = hopper_problem();
    static const int32_t table[2] = {0, 1};
    p.page_table = table, p.page_size = 256, p.page_table_stride[0] = 2, p.page_table_stride[1] = 1, p.num_pages = 2;
    assert_true(af_cuda_wgmma_accepts(&p, &one_sm));   /* paged: a box a page, or a tile inside one */
    p.page_size = 16;
    assert_true(af_cuda_wgmma_accepts(&p, &one_sm));
    assert_false(af_wgmma_gathered(&p));
    p.page_size = 48;   /* boxes of 16 keys, 8 a tile, each inside its page */
    assert_true(af_cuda_wgmma_accepts(&p, &one_sm));
    assert_false(af_wgmma_gathered(&p));
    p.page_size = 24;   /* boxes of 8 keys would be 16 a tile: the gathered path (test_cuda_wgmma_gather.c) */
    assert_true(af_cuda_wgmma_accepts(&p, &one_sm));
    assert_true(af_wgmma_gathered(&p));
    p.page_size = 4;    /* a box under the swizzle's 8-row pattern: gathered too */
    assert_true(af_cuda_wgmma_accepts(&p, &one_sm));
    assert_true(af_wgmma_gathered(&p));

    p = hopper_problem();
    p.kv_dtype = AF_F8E4M3;
    assert_false(af_cuda_wgmma_accepts(&p, &one_sm));
    p.kv_dtype = AF_F8E5M2;
    assert_false(af_cuda_wgmma_accepts(&p, &one_sm));
    p.dtype = p.kv_dtype = AF_F8E4M3;   /* all float8, out f16 */
    assert_false(af_cuda_wgmma_accepts(&p, &one_sm));
    p.dtype = p.kv_dtype = p.out_dtype = AF_F32;
    assert_false(af_cuda_wgmma_accepts(&p, &one_sm));
    p.dtype = p.out_dtype = AF_BF16, p.kv_dtype = AF_F16;
    assert_false(af_cuda_wgmma_accepts(&p, &one_sm));

    p = hopper_problem();
    p.L = 32;   /* 64 packed rows: attn_mma.cuh's 64-row blocks */
    assert_false(af_cuda_wgmma_accepts(&p, &one_sm));
    p.L = 33;   /* 66 */
    assert_true(af_cuda_wgmma_accepts(&p, &one_sm));
    p.Hq = p.Hkv = 1, p.group = 1, p.L = 64;
    assert_false(af_cuda_wgmma_accepts(&p, &one_sm));
    p.L = 65;
    assert_true(af_cuda_wgmma_accepts(&p, &one_sm));
    p.Hq = 8, p.group = 8, p.L = 8;   /* decode with GQA 8: 64 rows */
    assert_false(af_cuda_wgmma_accepts(&p, &one_sm));
    p.L = 1;
    assert_false(af_cuda_wgmma_accepts(&p, &one_sm));

    p = hopper_problem();   /* varlen K/V and seqused_k: yes */
    static const int32_t cu[2] = {0, 300}, used[1] = {200};
    p.cu_seqlens_k = cu, p.cu_seqlens_k_stride = 1, p.total_k = 300, p.k_stride[0] = p.v_stride[0] = 0;
    p.seqused_k = used, p.seqused_k_stride = 1;
    assert_true(af_cuda_wgmma_accepts(&p, &one_sm));
}

static size_t workspace_of(const af_problem *p, const af_cuda_device *dev) {
    size_t bytes = 1;
    assert_int_equal(af_cuda_wgmma_workspace_bytes(p, dev, &bytes), cudaSuccess);
    return bytes;
}

/* The workspace: none when the CTAs fill the device, for one key tile or on one multiprocessor, none for empty
 * problems; some for few CTAs over many keys on a big device (two splits at least of every row's Ev + 1 floats). */
static void workspace_sizes(void **state) {
    (void)state;
    af_problem p = hopper_problem();
    p.B = 4, p.Hq = 32, p.Hkv = 8, p.group = 4, p.L = 4096, p.S = 4096;
    assert_int_equal(workspace_of(&p, &many_sms), 0);   /* 4·8·128 CTAs: no split */
    p.B = 1, p.Hq = 8, p.Hkv = 1, p.group = 8, p.L = 16;   /* one CTA of 128 rows */
    const size_t split = workspace_of(&p, &many_sms);
    assert_true(split >= (size_t)(8 * 16 * 2) * (128 + 1) * sizeof(float));
    assert_int_equal(workspace_of(&p, &one_sm), 0);
    p.S = 128;   /* one key tile: nothing to split */
    assert_int_equal(workspace_of(&p, &many_sms), 0);
    p.S = 129;
    assert_true(workspace_of(&p, &many_sms) > 0);
    p.B = 0;
    assert_int_equal(workspace_of(&p, &many_sms), 0);
}

/* ---------------------------------------------------------------- the persistent schedule */

/* More work items than the 3 CTAs of the grid (expect_persistent): causal of both alignments over many row blocks
 * (heaviest first), a mask, full attention with GQA, split-KV (6 items on 3 CTAs), a sliding window with sinks and a
 * right-only one, varlen q and K/V with ragged sequences (items past a sequence's rows skipped, one sequence without
 * keys, partial last tiles: the tail barrier's phases); a CTA's items alternate between ones with and without
 * tiles. Head dim 256 and paged caches run one item a CTA on the same device. */
static void persistent_items(void **state) {
    (void)state;
    expect_persistent = true;
    for (int n = 0; n < 4; n++) {   /* causal (or masked), 4 or 3 row blocks x 2 heads, 1 to 4 tiles an item */
        sdpa_case c = small_case(1500 + (uint64_t)n, half_dtype(n), 2, 2, n < 2 ? 500 : 300, n < 2 ? 500 : 420,
                                 n % 2 ? 128 : 64, 64);
        c.is_causal = n % 2 == 0;
        c.causal_bottom_right = n == 1;   /* n = 3: a mask instead (masks exclude causality) */
        c.with_lse = n != 1;
        if (n == 3) {
            c.mask = MASK_BOOL;
            c.mask_shape = "LS";
            c.masked_row_rate = 0.1;
        }
        check_case(&c, (aligned_layout)(n % ALIGNED_COUNT), &three_sms, SPLIT_NONE, NULL);
    }
    {   /* full attention, GQA 2: 3 row blocks x 2 pairs, all of 3 tiles */
        sdpa_case c = small_case(1510, AF_BF16, 4, 2, 150, 300, 80, 96);
        check_case(&c, ALIGNED_SWAPPED, &three_sms, SPLIT_NONE, NULL);
    }
    {   /* split-KV and persistence: 2 pairs of one row block, 6 tiles: 3 splits, 6 items on 3 CTAs */
        sdpa_case c = small_case(1520, AF_F16, 2, 2, 100, 700, 64, 64);
        c.causal_bottom_right = true;
        check_case(&c, ALIGNED_CONTIGUOUS, &three_sms, SPLIT_YES, NULL);
    }
    flash_case f = half_flash(1540, AF_F16, 1, 2, 2, 400, 450, 64, 64);   /* sliding window: 4 x 2 items */
    f.causal = true, f.has_window = true, f.left = 100, f.right = -1, f.sink = true;
    check_flash(&f, ALIGNED_CONTIGUOUS, &three_sms, SPLIT_NONE);
    f = half_flash(1541, AF_BF16, 1, 2, 1, 300, 300, 128, 128);   /* right only, GQA 2: 5 row blocks */
    f.has_window = true, f.left = -1, f.right = 40;
    check_flash(&f, ALIGNED_SWAPPED, &three_sms, SPLIT_NONE);
    {   /* varlen q and K/V, ragged: 3 sequences of 1..3 row blocks (items past a sequence's rows skipped), one
         * without keys, causal; partial last tiles in two sequences */
        flash_case c = half_flash(1550, AF_BF16, 3, 2, 2, 0, 0, 64, 64);
        const int64_t rows[3] = {300, 20, 150}, keys[3] = {260, 0, 330};
        set_lengths(&c, rows, keys, NULL);
        c.varlen_q = true, c.kv = KV_VARLEN, c.causal = true;
        check_flash(&c, ALIGNED_PADDED, &three_sms, SPLIT_NONE);
    }
    expect_persistent = false;
    {   /* head dim 256 (64-key tiles, no ping-pong), causal: 3 row blocks x 2 heads, one a CTA */
        sdpa_case c = small_case(1530, AF_BF16, 2, 2, 300, 260, 256, 200);
        c.is_causal = true;
        check_case(&c, ALIGNED_PADDED, &three_sms, SPLIT_NONE, NULL);
    }
    {   /* paged K/V through TMA (pages of 16 keys) and gathered (pages of 24), seqused_k, one item a CTA, NaN in
         * every row no sequence reads */
        flash_case c = half_flash(1560, AF_F16, 3, 4, 2, 0, 0, 128, 128);
        const int64_t rows[3] = {70, 70, 70}, keys[3] = {150, 37, 200}, stored[3] = {260, 260, 260};
        set_lengths(&c, rows, keys, stored);
        c.kv = KV_PAGED, c.seqused = true, c.page_size = 16;
        check_flash_with(&c, ALIGNED_CONTIGUOUS, &three_sms, SPLIT_NONE, true);
        c.seed++, c.causal = true, c.page_size = 24;
        check_flash_with(&c, ALIGNED_SWAPPED, &three_sms, SPLIT_NONE, true);
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
    expect_persistent = false;   /* a failed persistent_items leaves it set */
    check_case(&item->c, item->layout, item->dev, SPLIT_ANY, NULL);
}

/* CTA-tiles of a case: (batch, kv head) pairs x 128-row blocks x 128-key tiles. */
static double sdpa_tiles(const sdpa_case *c) {
    const int64_t group = c->Hq / c->Hkv;
    return (double)c->B * c->Hkv * ((group * c->L + 127) / 128) * ((c->S + 127) / 128) * hd_cost(c->E, c->Ev);
}

/* The generator's case (every mask shape and causality) made one of the Hopper path's: f16/bf16, head dims up to
 * 256, more than 64 packed rows (L raised), keys now and then past a tile or two, then shrunk to the emulation's
 * budget (batch, then the keys, then the rows down to 65 packed ones); q/k/v re-laid out to the preconditions;
 * devices alternate so splits happen. */
static void random_wgmma_case(uint64_t seed, int index, void *out) {
    random_item *item = out;
    sdpa_case c = case_random(seed, index, 0);
    test_rng rng = {c.seed ^ 0x85ebca6bu};
    c.dtype = half_dtype(index);
    if (c.B == 0) c.B = 1;
    const int64_t group = c.Hq / c.Hkv, min_L = 64 / group + 1;
    if (c.L < min_L) c.L = min_L + rng_range(&rng, 0, 140 / group);
    if (c.S == 0 || rng_chance(&rng, 0.5)) c.S = rng_range(&rng, 100, 420);
    while (sdpa_tiles(&c) > RANDOM_TILE_BUDGET) {
        if (c.B > 1) c.B--;
        else if (c.S > 128) c.S = c.S * 3 / 4;
        else if (c.L > min_L) c.L = c.L * 3 / 4 > min_L ? c.L * 3 / 4 : min_L;
        else break;
    }
    item->c = c;
    item->layout = (aligned_layout)(index % ALIGNED_COUNT);
    item->dev = index % 2 ? &many_sms : &one_sm;
}

int main(void) {
    static const struct CMUnitTest fixed[] = {
        cmocka_unit_test(accepts_and_refusals), cmocka_unit_test(workspace_sizes),
        cmocka_unit_test(head_dims),            cmocka_unit_test(head_dim_256),
        cmocka_unit_test(shared_window_off_pattern), cmocka_unit_test(views_fit),
        cmocka_unit_test(schedule_order),       cmocka_unit_test(persistent_items),
        cmocka_unit_test(gqa_row_wrapping),
        cmocka_unit_test(causal_alignments),    cmocka_unit_test(masks),
        cmocka_unit_test(kv_ring),              cmocka_unit_test(split_kv),
        cmocka_unit_test(edge_sizes),           cmocka_unit_test(lazy_rescale),
        cmocka_unit_test(rescale_inside_a_tile),
        cmocka_unit_test(grid_fold),            cmocka_unit_test(flash_windows),
        cmocka_unit_test(flash_softcap_and_sinks), cmocka_unit_test(flash_varlen_and_seqused),
        cmocka_unit_test(flash_head_dim_256),   cmocka_unit_test(flash_nan_past_keys),
        cmocka_unit_test(flash_random),
    };
    setenv("ATTNFORGE_EMU_OCCUPANCY", TEST_OCCUPANCY, 1);
    flash_case_allow_approximate_tanh();   /* the Hopper kernel's softcap runs on tanh.approx.f32 */
    return emu_run_suite("cuda_wgmma", fixed, (int)(sizeof fixed / sizeof fixed[0]), random_wgmma_case,
                         sizeof(random_item), random_case, DEFAULT_CASES, DEFAULT_SEED);
}
