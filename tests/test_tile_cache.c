/* The driver's per-thread tile cache (driver.c): a thread keeps the packed Kᵀ and V tiles of its current (batch,
 * kv head) and the next row block of that head reuses them. Shapes with several row blocks per head on every ISA
 * we know (portable 32 rows, AVX2 192, AVX-512 240), each checked against the double reference on every ISA and
 * for 1 and 2 threads (bitwise equal), and a debug-log assertion that the cache really was on wherever the driver
 * reports more than one row block per kv head (its own blocking, read from its log line, not assumed): causal top-left
 * and bottom-right with L ≠ S (tiles packed whole though a block stops early), GQA, masks, (B,L,H,E) memory,
 * several batches and heads (the cache must follow the head), and f16/bf16. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "attnforge.h"
#include "case_gen.h"

typedef struct {
    int64_t heads;             /* B·Hkv of the case: the log's row blocks over all heads divided by this */
    int applicable;            /* "flash:" lines whose call had more than one row block per kv head */
    int cache_on, cache_off;   /* ... of those, with and without "tile cache on" */
    int single_block;          /* lines with one row block per kv head: the cache cannot apply */
    int own_products;          /* lines of calls on a kernel's own-format products (AMX, vdpbf16ps): no tile cache */
    char isa_single[64];       /* the ISA of the last such line and its block rows, for the skip message */
} log_count;

/* The driver's debug line: "flash: isa NAME, N row blocks (of R rows) over all heads, ..." */
static void count_flash_lines(af_log_level level, const char *message, void *user) {
    (void)level;
    log_count *c = user;
    if (strncmp(message, "flash:", 6)) return;
    char isa[32];
    long long groups;
    int rows;
    if (sscanf(message, "flash: isa %31[^,], %lld row blocks (of %d rows)", isa, &groups, &rows) != 3)
        fail_msg("unexpected driver log line: %s", message);
    if (strstr(message, "own-format products")) {   /* they pack their own tiles each block (driver.c) */
        c->own_products++;
        return;
    }
    if (groups / c->heads <= 1) {   /* one block per head: nothing for a next block to reuse */
        c->single_block++;
        snprintf(c->isa_single, sizeof c->isa_single, "%s (%d-row blocks)", isa, rows);
        return;
    }
    c->applicable++;
    if (strstr(message, "tile cache on")) c->cache_on++;
    else c->cache_off++;
}

static void check_case(const sdpa_case *c) {
    case_tensors t;
    if (!case_build(c, &t)) fail_msg("could not build the case: %s", af_last_error());
    log_count count = {.heads = c->B * c->Hkv};
    af_set_log_callback(count_flash_lines, &count, AF_LOG_DEBUG);
    char why[640] = "", desc[640];
    const bool ok = case_verify_everywhere(&t, why, sizeof why);
    af_set_log_callback(NULL, NULL, AF_LOG_OFF);
    case_describe(c, desc, sizeof desc);
    if (!ok) fail_msg("%s\n    %s", desc, why);
    /* every call whose head had several row blocks ran with the cache on; a case no ISA could use is a failure */
    if (count.applicable == 0 || count.cache_off != 0)
        fail_msg("%s: the tile cache was on in %d calls and off in %d of %d with several row blocks a head (want on "
                 "in all, and at least one)", desc, count.cache_on, count.cache_off, count.applicable);
    if (count.own_products)
        print_message("note: %d calls ran on own-format products, which keep no tile cache\n", count.own_products);
    if (count.single_block)
        print_message("note: %d calls had one row block a head (last: isa %s), so the cache could not apply there\n",
                      count.single_block, count.isa_single);
    case_free(&t);
}

static void causal_top_left_gqa(void **state) {
    (void)state;
    sdpa_case c = case_default(1, 4, 2, 420, 300, 40, 24);   /* 840 packed rows per kv head; L > S */
    c.is_causal = true;
    c.enable_gqa = true;
    c.seed = 11;
    check_case(&c);
}

static void causal_bottom_right_longer_keys(void **state) {
    (void)state;
    sdpa_case c = case_default(2, 2, 2, 290, 517, 32, 48);   /* blocks stop at different keys of a partial tile */
    c.causal_bottom_right = true;   /* FlashAttention's alignment, instead of is_causal */
    c.seed = 12;
    check_case(&c);
}

static void masked_nhd_f16(void **state) {
    (void)state;
    sdpa_case c = case_default(1, 3, 3, 400, 333, 64, 64);
    c.dtype = AF_F16;
    c.mask = MASK_ADDITIVE;
    c.mask_shape = "LS";
    c.mask_keep = 0.9;
    c.q_layout = c.k_layout = c.v_layout = LAYOUT_NHD;
    c.seed = 13;
    check_case(&c);
}

static void many_heads_bf16(void **state) {
    (void)state;
    sdpa_case c = case_default(2, 8, 2, 210, 190, 24, 40);   /* the cache must change with the (batch, head) */
    c.dtype = AF_BF16;
    c.enable_gqa = true;
    c.seed = 14;
    check_case(&c);
}

static void bool_mask_scale_sliced(void **state) {
    (void)state;
    sdpa_case c = case_default(1, 2, 1, 260, 200, 20, 36);
    c.enable_gqa = true;
    c.mask = MASK_BOOL;
    c.mask_shape = "B1LS";
    c.mask_keep = 0.7;
    c.has_scale = true;
    c.scale = 0.3;
    c.k_layout = c.v_layout = LAYOUT_SLICED;
    c.seed = 15;
    check_case(&c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(causal_top_left_gqa),
        cmocka_unit_test(causal_bottom_right_longer_keys),
        cmocka_unit_test(masked_nhd_f16),
        cmocka_unit_test(many_heads_bf16),
        cmocka_unit_test(bool_mask_scale_sliced),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
