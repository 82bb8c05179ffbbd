/* The Hopper kernel's gathered path (src/cuda/attn_wgmma_gather.cuh): paged K/V caches whose pages TMA cannot box
 * (page sizes 1, 3, 7, 24, 40, 100, 200: no common divisor of 16 with the tile) copied by warpgroup 0's 128 threads with cp.async, a key a thread through
 * the page table, into TMA's swizzled stages, on the emulated device (tests/cuda_emu, cuda_emulated_hopper.c's
 * wgmma, mbarrier and async-proxy model) against the double reference at the suite's tolerance (flash_case_matches):
 * f16 and bf16, head dims 64 and 128 with padded columns (E 40, 72, 100), causal, sliding windows, GQA packing whose
 * rows wrap between heads, split-KV and its combine, seqused_k below the stored keys, a first page shared by two
 * sequences, pages in random order, NaN in the rows past a sequence's keys (zero-filled, never read), a page size
 * that stays on TMA beside gathered ones, a bad page entry (NaN rows for its sequence only), the plan's mode
 * (gathered, TMA or refused), the ring of three stages wrapping (issue 37 item 8: eight lanes a key's row, pages
 * shuffled from the lane that looked them up, cp.async.mbarrier.arrive) and a random suite. ATTNFORGE_TEST_CASES / ATTNFORGE_TEST_SEED change the random
 * suite's count and seed. */
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
#include "emu_case.h"
#include "flash_case.h"
#include "cuda/attn_wgmma_launch.cuh"
#include "sdpa/problem.h"

#define DEFAULT_CASES 8
#define DEFAULT_SEED 20251203u
#define RANDOM_TILE_BUDGET 12   /* (batch, kv head, row block, key tile) quadruples of a random case */

#define TEST_OCCUPANCY "1"   /* one CTA of 384 threads a multiprocessor, as test_cuda_wgmma.c */
static const af_cuda_device one_sm = {0, 1, 9, 0, 227 * 1024};
static const af_cuda_device many_sms = {1, 132, 9, 0, 227 * 1024};

/* Page sizes TMA cannot box: under 8, not dividing 128, between multiples of 128. */
static const int64_t gathered_pages[] = {1, 3, 7, 24, 40, 100, 200};
enum { GATHERED_PAGES = sizeof gathered_pages / sizeof gathered_pages[0] };

/* ---------------------------------------------------------------- running the kernel on device copies */

/* The launch on `dev`, with the workspace it asks for, and the mode the plan chose. */
typedef struct {
    const af_cuda_device *dev;
    size_t workspace_bytes;
    void *workspace;
    bool refused, gathered;
} wgmma_launch;

static cudaError_t launch_wgmma(const af_problem *p, void *context) {
    wgmma_launch *run = context;
    if (!af_cuda_wgmma_accepts(p, run->dev)) {
        run->refused = true;
        return cudaErrorInvalidValue;
    }
    run->gathered = af_wgmma_gathered(p);
    cudaError_t err = af_cuda_wgmma_workspace_bytes(p, run->dev, &run->workspace_bytes);
    if (err != cudaSuccess) return err;
    if (run->workspace_bytes && (err = cudaMalloc(&run->workspace, run->workspace_bytes)) != cudaSuccess) return err;
    return af_cuda_wgmma_forward(p, run->dev, run->workspace, run->workspace_bytes, NULL);
}

/* What a check expects of the launch. */
typedef enum { SPLIT_ANY = 0, SPLIT_NONE, SPLIT_YES } split_expectation;
typedef enum { MODE_GATHERED = 0, MODE_TMA } mode_expectation;

/* Sequence `bad` (-1: none) had a page entry made bad: its rows of out and lse must be NaN; they are then given the
 * reference's values so that flash_case_matches checks every other row. False with `why`. */
static bool bad_rows_are_nan(flash_tensors *t, int64_t bad, char *why, size_t size) {
    const flash_case *c = &t->c;
    for (int64_t r = 0; bad >= 0 && r < c->Lq[bad]; r++)
        for (int64_t h = 0; h < c->Hq; h++) {
            const int64_t lse_at[3] = {bad, h, r};
            for (int64_t e = 0; e < c->Ev; e++) {
                const int64_t out_at[4] = {bad, r, h, e};
                if (!isnan(tt_get(&t->out, out_at)) || (c->with_lse && !isnan(tt_get(&t->lse, lse_at)))) {
                    snprintf(why, size, "sequence %lld row %lld head %lld col %lld: out %g, expected NaN (bad page)",
                             (long long)bad, (long long)r, (long long)h, (long long)e, tt_get(&t->out, out_at));
                    return false;
                }
                tt_set(&t->out, out_at, tt_get(&t->ref_out, out_at));
            }
            if (c->with_lse) tt_set(&t->lse, lse_at, tt_get(&t->ref_lse, lse_at));
        }
    return true;
}

/* Sequence `bad`'s second page entry made a page past the pool, on the host and the device (after af_flash_check,
 * which reads a table it can: on a GPU only the kernels do). */
static bool make_page_bad(flash_tensors *t, emu_device_tensor *table, int64_t bad) {
    tt_set(&t->page_table, (int64_t[]){bad, 1}, (double)t->k.view.shape[0]);
    return cudaMemcpy(table->memory, t->page_table.memory, t->page_table.bytes, cudaMemcpyHostToDevice) == cudaSuccess;
}

/* The bad page of a run: made after af_flash_check, its sequence's rows checked NaN before the comparison. */
static bool make_page_bad_hook(flash_tensors *t, emu_device_tensor *inputs, void *bad, char *why, size_t size) {
    if (make_page_bad(t, &inputs[7], *(int64_t *)bad)) return true;   /* inputs[7]: the page table */
    snprintf(why, size, "copying the bad page table failed");
    return false;
}

static bool bad_rows_hook(flash_tensors *t, void *bad, char *why, size_t size) {
    return bad_rows_are_nan(t, *(int64_t *)bad, why, size);
}

/* A test's change to a built paged case (the reference is not rerun: it must not change what the reference reads). */
typedef void (*paged_edit)(flash_tensors *t);

/* Builds the case, applies `edit`, runs it on `dev` and checks the result, the split and the mode. */
static void check_paged_edited(const flash_case *c, const af_cuda_device *dev, split_expectation split,
                               mode_expectation mode, paged_edit edit, int64_t bad) {
    char desc[1024], why[640] = "";
    flash_case_describe(c, desc, sizeof desc);
    flash_tensors t;
    const aligned_layout layout = (aligned_layout)(c->seed % ALIGNED_COUNT);   /* q's; k and v the next ones */
    const bool built = flash_case_build(c, &t) && emu_relayout_qkv(&t.q, &t.k, &t.v, layout);
    if (built && edit) edit(&t);
    wgmma_launch run = {dev, 0, NULL, false, false};
    const emu_flash_hooks hooks = {bad >= 0 ? make_page_bad_hook : NULL, bad_rows_hook, &bad};
    const bool ok = built && emu_run_flash(&t, launch_wgmma, &run, &hooks, why, sizeof why);
    cudaFree(run.workspace);
    flash_case_free(&t);
    if (!built) fail_msg("could not build the flash case (%s): %s", af_last_error(), desc);
    if (run.refused) fail_msg("af_cuda_wgmma_accepts refused the case: %s", desc);
    if (!ok) fail_msg("%s (layout %s, sm_count %d)\n    %s", desc, emu_layout_name(layout), dev->sm_count, why);
    if (split == SPLIT_YES && run.workspace_bytes == 0) fail_msg("expected split-KV, got none: %s", desc);
    if (split == SPLIT_NONE && run.workspace_bytes != 0) fail_msg("expected no split-KV, got one: %s", desc);
    if (run.gathered != (mode == MODE_GATHERED))
        fail_msg("expected the %s path, the plan took the other: %s", mode == MODE_GATHERED ? "gathered" : "TMA",
                 desc);
}

static void check_paged(const flash_case *c, const af_cuda_device *dev, split_expectation split) {
    check_paged_edited(c, dev, split, MODE_GATHERED, NULL, -1);
}

/* A paged flash case: B sequences of `rows` query rows over `keys` keys (seqused_k: as many stored). */
static flash_case paged(uint64_t seed, af_dtype dtype, int64_t B, int64_t Hq, int64_t Hkv, const int64_t *rows,
                        const int64_t *keys, int64_t page_size, int64_t E, int64_t Ev) {
    flash_case c = flash_case_default(B, Hq, Hkv, 0, 0, E, Ev);
    c.seed = seed;
    c.dtype = c.sink_dtype = dtype;
    c.kv = KV_PAGED, c.seqused = true, c.page_size = page_size;
    for (int b = 0; b < B; b++) c.Lq[b] = rows[b], c.Sk[b] = c.S_stored[b] = keys[b];
    return c;
}

static af_dtype half_dtype(int n) { return n % 2 ? AF_BF16 : AF_F16; }

/* ---------------------------------------------------------------- edits */

/* K and V rows past each sequence's keys inside its last page set to NaN: the gathered path zero-fills those keys
 * (it never reads them), where TMA's whole boxes would read them (and 0·NaN is NaN). The reference reads only the
 * sequence's keys. */
static void nan_past_the_keys(flash_tensors *t) {
    const flash_case *c = &t->c;
    for (int64_t b = 0; b < c->B; b++) {
        if (c->Sk[b] % c->page_size == 0) continue;
        const int64_t slot[2] = {b, c->Sk[b] / c->page_size};
        const int64_t page = (int64_t)tt_get(&t->page_table, slot);
        for (int64_t row = c->Sk[b] % c->page_size; row < c->page_size; row++)
            for (int64_t h = 0; h < c->Hkv; h++) {
                for (int64_t e = 0; e < c->E; e++) tt_set(&t->k, (int64_t[]){page, row, h, e}, NAN);
                for (int64_t e = 0; e < c->Ev; e++) tt_set(&t->v, (int64_t[]){page, row, h, e}, NAN);
            }
    }
}

/* ---------------------------------------------------------------- targeted cases */

/* Every gathered page size under both head-dim variants and their padding (E/Ev 64/64, 40/64, 128/128, 72/128,
 * 100/72, 128/40), group 2 (packed rows of two heads), 300 and 150 keys (3 and 2 tiles: the ring wraps, a last tile
 * part empty), random page order; head dim 128's V has two column blocks. */
static void page_sizes(void **state) {
    (void)state;
    static const int64_t dims[][2] = {{64, 64}, {40, 64}, {128, 128}, {72, 128}, {100, 72}, {128, 40}, {64, 100}};
    const int64_t rows[2] = {40, 70}, keys[2] = {300, 150};
    for (int n = 0; n < GATHERED_PAGES; n++) {
        flash_case c = paged(100 + (uint64_t)n, half_dtype(n), 2, 4, 2, rows, keys, gathered_pages[n], dims[n][0],
                             dims[n][1]);
        c.with_lse = n % 3 != 2;
        check_paged(&c, &one_sm, SPLIT_NONE);
    }
}

/* A page size TMA boxes (16, 256) beside gathered ones (24, 200) on the same shapes: both modes match the
 * reference, and the plan takes each. */
static void both_modes_agree(void **state) {
    (void)state;
    static const int64_t sizes[][2] = {{16, 24}, {256, 200}};
    const int64_t rows[2] = {70, 33}, keys[2] = {260, 190};
    for (int s = 0; s < 2; s++)
        for (int m = 0; m < 2; m++) {
            flash_case c = paged(200 + (uint64_t)s, half_dtype(s), 2, 4, 2, rows, keys, sizes[s][m], 64 + 64 * s,
                                 64 + 64 * s);
            c.causal = s == 1;
            check_paged_edited(&c, &one_sm, SPLIT_NONE, m == 0 ? MODE_TMA : MODE_GATHERED, NULL, -1);
        }
}

/* TMA boxes of gcd(page, tile) keys, each inside one page while a tile straddles pages: pages of 48 under 128-key
 * tiles (8 boxes of 16), of 256 and 48 under head dim 256's 64-key tiles (a tile inside a page; 4 boxes of 16), NaN
 * in the rows past the keys, causal on one. */
static void tma_boxes_inside_pages(void **state) {
    (void)state;
    static const int64_t sizes[] = {48, 48, 256, 48}, dims[][2] = {{64, 64}, {128, 100}, {256, 256}, {200, 144}};
    const int64_t rows[2] = {70, 33}, keys[2] = {300, 190};
    for (int n = 0; n < 4; n++) {
        flash_case c = paged(230 + (uint64_t)n, half_dtype(n), 2, 4, 2, rows, keys, sizes[n], dims[n][0], dims[n][1]);
        c.causal = n == 1;
        check_paged_edited(&c, &one_sm, SPLIT_NONE, MODE_TMA, nan_past_the_keys, -1);
    }
}

/* Head dim 256 (64-key tiles): page sizes 3, 24 and 100 (no common divisor of 16 with 64) with padded columns,
 * causal, split, and a page of 32 on TMA (boxes of 16 keys) beside them. */
static void head_dim_256(void **state) {
    (void)state;
    static const int64_t sizes[] = {3, 24, 100, 32}, dims[][2] = {{256, 256}, {200, 144}, {160, 256}, {256, 200}};
    const int64_t rows[2] = {40, 70}, keys[2] = {150, 97};
    for (int n = 0; n < 4; n++) {
        flash_case c = paged(250 + (uint64_t)n, half_dtype(n), 2, 4, 2, rows, keys, sizes[n], dims[n][0], dims[n][1]);
        c.causal = n == 1;
        check_paged_edited(&c, n == 2 ? &many_sms : &one_sm, n == 2 ? SPLIT_YES : SPLIT_NONE,
                           n == 3 ? MODE_TMA : MODE_GATHERED, nan_past_the_keys, -1);
    }
}

/* Causal (bottom-right: rows that see no key when L > S), sliding windows (causal + left), a right-only window,
 * GQA 4 and 8 whose packed rows wrap from one head to the next inside a 128-row block. */
static void masks_and_packing(void **state) {
    (void)state;
    const int64_t rows[2] = {45, 97}, keys[2] = {280, 60};
    flash_case c = paged(300, AF_BF16, 2, 8, 2, rows, keys, 3, 64, 64);
    c.causal = true;
    check_paged(&c, &one_sm, SPLIT_NONE);

    c = paged(301, AF_F16, 2, 4, 1, rows, keys, 100, 128, 128);
    c.causal = true, c.has_window = true, c.left = 50, c.right = -1;   /* sliding window */
    check_paged(&c, &one_sm, SPLIT_NONE);

    c = paged(302, AF_BF16, 2, 8, 1, rows, keys, 7, 72, 64);
    c.has_window = true, c.left = -1, c.right = 5;
    check_paged(&c, &one_sm, SPLIT_NONE);

    c = paged(303, AF_F16, 2, 2, 1, rows, keys, 40, 100, 128);   /* GQA 2, softcap and a sink */
    c.softcap = 20.0, c.amplitude = 4.0, c.sink = true;
    check_paged(&c, &one_sm, SPLIT_NONE);
}

/* Split-KV on many multiprocessors (the partials and the combine), with a window; seqused_k below the stored keys
 * (the table's entries past a sequence's used pages are -1, never read); a first page shared by two sequences. */
static void split_seqused_shared(void **state) {
    (void)state;
    const int64_t rows[2] = {33, 20}, keys[2] = {400, 270};
    flash_case c = paged(400, AF_BF16, 2, 8, 2, rows, keys, 24, 64, 64);
    check_paged(&c, &many_sms, SPLIT_YES);
    c.seed++, c.has_window = true, c.left = 200, c.right = 30, c.page_size = 1, c.dtype = c.sink_dtype = AF_F16;
    check_paged(&c, &many_sms, SPLIT_YES);

    c = paged(410, AF_F16, 2, 4, 2, rows, keys, 100, 128, 72);
    c.Sk[0] = 150, c.Sk[1] = 3;   /* of 400 and 270 stored */
    check_paged(&c, &one_sm, SPLIT_NONE);

    c = paged(420, AF_BF16, 2, 4, 2, rows, keys, 200, 40, 64);
    c.shared_page = true, c.causal = true;
    check_paged(&c, &one_sm, SPLIT_NONE);
    c.seed++, c.page_size = 3;
    check_paged(&c, &many_sms, SPLIT_YES);
}

/* The ring of three stages (head dims 64 and 128; two at 256) wrapping several times: page sizes 1, 3, 7, 24, 100
 * over 700 and 333 keys (6 and 3 tiles of 128 keys, 11 and 6 of 64), ragged ends, padded columns, GQA 4 and 8,
 * NaN in the rows past the keys, causal on one; each tile's keys four to a warp, eight lanes a 128-byte row. */
static void ring_wraps(void **state) {
    (void)state;
    static const int64_t sizes[] = {1, 3, 7, 24, 100}, dims[][2] = {{64, 64}, {128, 128}, {256, 256}, {100, 72},
                                                                    {200, 256}};
    const int64_t rows[2] = {20, 9}, keys[2] = {700, 333};
    for (int n = 0; n < 5; n++) {
        flash_case c = paged(700 + (uint64_t)n, half_dtype(n), 2, n % 2 ? 8 : 4, 1, rows, keys, sizes[n], dims[n][0],
                             dims[n][1]);
        c.causal = n == 3;
        check_paged_edited(&c, &one_sm, SPLIT_NONE, MODE_GATHERED, nan_past_the_keys, -1);
    }
}

/* NaN in the rows past each sequence's keys of its last page: zero-filled, never read (no "finite rows" rule). */
static void rows_past_the_keys_unread(void **state) {
    (void)state;
    const int64_t rows[2] = {70, 40}, keys[2] = {131, 250};
    for (int n = 0; n < 3; n++) {
        static const int64_t sizes[] = {3, 24, 200};
        flash_case c = paged(500 + (uint64_t)n, half_dtype(n), 2, 4, 2, rows, keys, sizes[n], 64 + 32 * n, 64);
        check_paged_edited(&c, &one_sm, SPLIT_NONE, MODE_GATHERED, nan_past_the_keys, -1);
    }
}

/* A page entry past the pool: the CTAs of that sequence read no page and write NaN rows (and NaN LSE), the other
 * sequence's rows are right (af_cuda_check_errors' report of it: test_cuda_indices, through the backend). */
static void bad_page_gives_nan_rows(void **state) {
    (void)state;
    const int64_t rows[3] = {40, 40, 40}, keys[3] = {200, 150, 90};
    for (int n = 0; n < 2; n++) {
        flash_case c = paged(600 + (uint64_t)n, half_dtype(n), 3, 4, 2, rows, keys, n ? 7 : 100, 64, 64);
        check_paged_edited(&c, &one_sm, SPLIT_NONE, MODE_GATHERED, NULL, 1);
    }
}

/* ---------------------------------------------------------------- the plan's mode */

static _Alignas(16) char fake_tensor[16];

/* A paged problem the Hopper path takes (f16, 2·70 packed rows, 300 keys, head dim 128; never launched). */
static af_problem paged_problem(int64_t page_size) {
    af_problem p;
    memset(&p, 0, sizeof p);
    p.dtype = p.kv_dtype = p.out_dtype = AF_F16;
    p.B = 1, p.Hq = 2, p.Hkv = 1, p.group = 2, p.L = 70, p.S = 300, p.E = p.Ev = 128;
    p.q = p.k = p.v = p.out = fake_tensor;
    static const int32_t table[1] = {0};
    p.page_table = table, p.page_size = page_size, p.num_pages = 400;
    p.page_table_stride[0] = 300, p.page_table_stride[1] = 1;
    return p;
}

/* Every page size is accepted: the ones TMA boxes (a common divisor of 16 or more with the tile's keys, or pages of
 * 8) on TMA, all others gathered; the table's 32-bit indexing still bounds the stride; fixed and varlen K/V are never gathered. */
static void plan_mode(void **state) {
    (void)state;
    static const int64_t tma[] = {8, 16, 32, 48, 64, 96, 128, 256, 384};
    static const int64_t gathered[] = {1, 2, 3, 4, 5, 7, 12, 24, 40, 72, 100, 127, 129, 200, 300};
    for (size_t i = 0; i < sizeof tma / sizeof tma[0]; i++) {
        const af_problem p = paged_problem(tma[i]);
        assert_true(af_cuda_wgmma_accepts(&p, &one_sm));
        if (af_wgmma_gathered(&p)) fail_msg("page size %lld: gathered, expected TMA", (long long)tma[i]);
    }
    for (size_t i = 0; i < sizeof gathered / sizeof gathered[0]; i++) {
        const af_problem p = paged_problem(gathered[i]);
        if (!af_cuda_wgmma_accepts(&p, &one_sm)) fail_msg("page size %lld refused", (long long)gathered[i]);
        if (!af_wgmma_gathered(&p)) fail_msg("page size %lld: TMA, expected gathered", (long long)gathered[i]);
    }
    static const int64_t tma_256[] = {8, 16, 32, 48, 64, 128, 192, 256}, gathered_256[] = {3, 24, 36, 100};
    for (size_t i = 0; i < sizeof tma_256 / sizeof tma_256[0]; i++) {   /* head dim 256: tiles of 64 keys */
        af_problem p = paged_problem(tma_256[i]);
        p.E = 256;
        assert_true(af_cuda_wgmma_accepts(&p, &one_sm));
        if (af_wgmma_gathered(&p)) fail_msg("head dim 256, page size %lld: gathered", (long long)tma_256[i]);
    }
    for (size_t i = 0; i < sizeof gathered_256 / sizeof gathered_256[0]; i++) {
        af_problem p = paged_problem(gathered_256[i]);
        p.Ev = 200;
        assert_true(af_cuda_wgmma_accepts(&p, &one_sm));
        if (!af_wgmma_gathered(&p)) fail_msg("head dim 256, page size %lld: TMA", (long long)gathered_256[i]);
    }
    /* the gathered ring: three stages where 227 KiB holds them (head dims 64, 128), two at 256; TMA keeps two */
    assert_int_equal(AF_WG_STAGES_OF(64, 1), 3), assert_int_equal(AF_WG_STAGES_OF(128, 1), 3);
    assert_int_equal(AF_WG_STAGES_OF(256, 1), 2), assert_int_equal(AF_WG_STAGES_OF(128, 0), 2);
    assert_true(af_wgmma_smem_bytes(128, 3) <= 227 * 1024 && af_wgmma_smem_bytes(256, 3) > 227 * 1024);
    for (int hd = 64; hd <= 256; hd *= 2) {
        af_problem p = paged_problem(hd == 256 ? 24 : 100);
        p.E = p.Ev = hd;
        af_wgmma_plan plan;
        assert_int_equal(af_wgmma_make_plan(&p, &one_sm, &plan), cudaSuccess);
        assert_int_equal(plan.smem, af_wgmma_smem_bytes(hd, hd <= 128 ? 3 : 2));
        p.page_size = 128;   /* TMA */
        assert_int_equal(af_wgmma_make_plan(&p, &one_sm, &plan), cudaSuccess);
        assert_int_equal(plan.smem, af_wgmma_smem_bytes(hd, 2));
    }
    af_problem p = paged_problem(3);
    p.page_table_stride[1] = ((int64_t)1 << 30) / 100 + 1;   /* 100 slots: the last entry past 2^30 */
    assert_false(af_cuda_wgmma_accepts(&p, &one_sm));
    p.page_table_stride[1] = -1;
    assert_false(af_cuda_wgmma_accepts(&p, &one_sm));
    p = paged_problem(3);
    p.page_table = NULL;   /* fixed K/V */
    assert_false(af_wgmma_gathered(&p));
}

/* ---------------------------------------------------------------- random suite */

typedef struct {
    flash_case c;
    const af_cuda_device *dev;
} random_item;

static double flash_tiles(const flash_case *c) {
    const int64_t group = c->Hq / c->Hkv;
    int64_t rows = 0, keys = 0;
    for (int b = 0; b < c->B; b++) {
        rows = c->Lq[b] > rows ? c->Lq[b] : rows;
        keys = c->S_stored[b] > keys ? c->S_stored[b] : keys;
    }
    return (double)c->B * c->Hkv * ((group * rows + 127) / 128) * ((keys + 127) / 128);
}

/* The generator's flash case made a gathered paged one of the Hopper path: f16/bf16, a gathered page size, head dims
 * clamped to 128, more than 64 packed rows, then shrunk to the emulation's budget; devices alternate (splits). */
static void random_gather_case(uint64_t seed, int index, void *out) {
    random_item *item = out;
    flash_case c = flash_case_random(seed, index);
    test_rng rng = {c.seed ^ 0x27d4eb2fu};
    c.dtype = half_dtype(index);
    if (c.sink_dtype != AF_F32) c.sink_dtype = c.dtype;
    c.kv = KV_PAGED, c.seqused = true, c.varlen_q = false;
    c.page_size = gathered_pages[rng_range(&rng, 0, GATHERED_PAGES - 1)];
    if (c.B == 0) c.B = 1;
    if (c.E > 128) c.E = rng_range(&rng, 1, 128);
    if (c.Ev > 128) c.Ev = rng_range(&rng, 1, 128);
    const int64_t group = c.Hq / c.Hkv, rows = 64 / group + 1 + rng_range(&rng, 0, 40);
    for (int b = 0; b < c.B; b++) {
        c.Lq[b] = rows;
        if (c.S_stored[b] < 1) c.S_stored[b] = rng_range(&rng, 1, 300);
        if (c.Sk[b] > c.S_stored[b] || rng_chance(&rng, 0.5)) c.Sk[b] = rng_range(&rng, 0, c.S_stored[b]);
    }
    while (flash_tiles(&c) > RANDOM_TILE_BUDGET) {
        if (c.B > 1) c.B--;
        else {
            c.S_stored[0] = c.S_stored[0] * 3 / 4;
            if (c.Sk[0] > c.S_stored[0]) c.Sk[0] = c.S_stored[0];
        }
    }
    item->c = c;
    item->dev = index % 2 ? &many_sms : &one_sm;
}

static void random_case(void **state) {
    const random_item *item = *state;
    check_paged(&item->c, item->dev, SPLIT_ANY);
}

int main(void) {
    static const struct CMUnitTest fixed[] = {
        cmocka_unit_test(plan_mode),          cmocka_unit_test(page_sizes),
        cmocka_unit_test(head_dim_256),       cmocka_unit_test(ring_wraps),
        cmocka_unit_test(both_modes_agree),   cmocka_unit_test(tma_boxes_inside_pages),   cmocka_unit_test(masks_and_packing),
        cmocka_unit_test(split_seqused_shared), cmocka_unit_test(rows_past_the_keys_unread),
        cmocka_unit_test(bad_page_gives_nan_rows),
    };
    setenv("ATTNFORGE_EMU_OCCUPANCY", TEST_OCCUPANCY, 1);
    flash_case_allow_approximate_tanh();   /* the Hopper kernel's softcap runs on tanh.approx.f32 */
    return emu_run_suite("cuda_wgmma_gather", fixed, (int)(sizeof fixed / sizeof fixed[0]), random_gather_case,
                         sizeof(random_item), random_case, DEFAULT_CASES, DEFAULT_SEED);
}
