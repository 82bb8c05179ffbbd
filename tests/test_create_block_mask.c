/* af_create_block_mask: every block's class and the index lists in PyTorch's order, against a brute force over every
 * score of every block (the mask written again in C), for masks the interval analysis settles (causal, windows,
 * documents, prefix-LM, chunks, a band by floor division of negatives, constants) and ones it cannot (a mask by head and key parity, float arithmetic),
 * block sizes that divide L and S and ones that do not; then bad calls, each named, nothing written. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"

#define I(op_, a_, b_, c_) {.op = (op_), .in = {(a_), (b_), (c_), 0}}
#define K_F32(v) {.op = AF_MOD_CONST_F32, .imm = (v)}
#define K_I32(v) {.op = AF_MOD_CONST_I32, .imm = (v)}
#define LOAD1(aux_, i0) {.op = AF_MOD_LOAD, .in = {(i0), 0, 0, 0}, .aux = (aux_)}
enum { B_IDX = 1, H_IDX = 2, Q_IDX = 3, KV_IDX = 4 };
enum { B = 2, H = 3, L = 300, S = 333 };

static int32_t docs[S], prefix[B];

typedef bool (*mask_fn)(int64_t b, int64_t h, int64_t q, int64_t kv);
static bool causal(int64_t b, int64_t h, int64_t q, int64_t kv) { (void)b, (void)h; return q >= kv; }
static bool window(int64_t b, int64_t h, int64_t q, int64_t kv) { (void)b, (void)h; return q >= kv && q - kv <= 100; }
static bool documents(int64_t b, int64_t h, int64_t q, int64_t kv) {
    (void)b, (void)h;
    return docs[q] == docs[kv] && q >= kv;
}
static bool prefix_lm(int64_t b, int64_t h, int64_t q, int64_t kv) { (void)h; return kv < prefix[b] || q >= kv; }
static bool head_parity(int64_t b, int64_t h, int64_t q, int64_t kv) { (void)b, (void)q; return (kv + h) % 3 != 0; }
static bool half_slope(int64_t b, int64_t h, int64_t q, int64_t kv) { (void)b, (void)h; return (float)kv * 0.5f <= (float)q; }
static bool chunks(int64_t b, int64_t h, int64_t q, int64_t kv) { (void)b, (void)h; return q / 64 == kv / 64; }
static bool band(int64_t b, int64_t h, int64_t q, int64_t kv) {   /* Python's (q - kv) // 64 == 0 */
    (void)b, (void)h;
    const int64_t d = q - kv;
    return (d >= 0 ? d / 64 : -((-d + 63) / 64)) == 0;
}
static bool nothing(int64_t b, int64_t h, int64_t q, int64_t kv) { (void)b, (void)h, (void)q, (void)kv; return false; }
static bool everything(int64_t b, int64_t h, int64_t q, int64_t kv) { (void)b, (void)h, (void)q, (void)kv; return true; }

/* The expected class of every block, and the lists in PyTorch's order, compared with what the call wrote. */
static void check_mask(const char *name, const af_mod_program *prog, mask_fn fn, int64_t qb, int64_t kb,
                       bool split_full) {
    const int64_t nq = (L + qb - 1) / qb, nk = (S + kb - 1) / kb;
    const size_t rows = (size_t)(B * H * nq);
    int32_t *num = malloc(rows * 4), *ind = malloc(rows * (size_t)nk * 4);
    int32_t *fnum = malloc(rows * 4), *find = malloc(rows * (size_t)nk * 4);
    af_tensor num_t = af_tensor_contiguous(num, AF_I32, 3, (int64_t[]){B, H, nq});
    af_tensor ind_t = af_tensor_contiguous(ind, AF_I32, 4, (int64_t[]){B, H, nq, nk});
    af_tensor fnum_t = af_tensor_contiguous(fnum, AF_I32, 3, (int64_t[]){B, H, nq});
    af_tensor find_t = af_tensor_contiguous(find, AF_I32, 4, (int64_t[]){B, H, nq, nk});
    const af_block_mask_tensors out = {&num_t, &ind_t, split_full ? &fnum_t : NULL, split_full ? &find_t : NULL};
    if (af_create_block_mask(prog, B, H, L, S, qb, kb, &out) != AF_OK) fail_msg("%s: %s", name, af_last_error());
    int *cls = malloc(sizeof(int) * (size_t)nk);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t q = 0; q < nq; q++) {
                for (int64_t k = 0; k < nk; k++) {
                    int64_t kept = 0, all = 0;
                    for (int64_t i = q * qb; i < (q + 1) * qb && i < L; i++)
                        for (int64_t j = k * kb; j < (k + 1) * kb && j < S; j++, all++) kept += fn(b, h, i, j);
                    const bool whole = (q + 1) * qb <= L && (k + 1) * kb <= S;
                    cls[k] = kept == 0 ? 0 : kept == all && whole && split_full ? 2 : 1;
                }
                const size_t r = (size_t)((b * H + h) * nq + q);
                for (int kind = 1; kind <= (split_full ? 2 : 1); kind++) {
                    const int32_t *n_got = kind == 1 ? num : fnum, *i_got = (kind == 1 ? ind : find) + r * (size_t)nk;
                    int32_t n = 0;
                    for (int64_t k = 0; k < nk; k++)
                        if (cls[k] == kind && i_got[n++] != k)
                            fail_msg("%s (blocks %lld x %lld): row [%lld][%lld][%lld] lists block %d at %d, want %lld",
                                     name, (long long)qb, (long long)kb, (long long)b, (long long)h, (long long)q,
                                     i_got[n - 1], n - 1, (long long)k);
                    if (n_got[r] != n)
                        fail_msg("%s (blocks %lld x %lld): row [%lld][%lld][%lld] has %d %s blocks, want %d", name,
                                 (long long)qb, (long long)kb, (long long)b, (long long)h, (long long)q, n_got[r],
                                 kind == 1 ? "partial" : "full", n);
                    for (int64_t k = 0; k < nk; k++)   /* then the others, in increasing order */
                        if (cls[k] != kind && i_got[n++] != k)
                            fail_msg("%s: row [%lld][%lld][%lld]: the blocks past the count are out of order", name,
                                     (long long)b, (long long)h, (long long)q);
                }
            }
    free(cls);
    free(num);
    free(ind);
    free(fnum);
    free(find);
}

static void masks_against_brute_force(void **state) {
    (void)state;
    for (int j = 0; j < S; j++) docs[j] = j < 70 ? 0 : j < 71 ? 1 : j < 200 ? 2 : 3;
    prefix[0] = 50;
    prefix[1] = 129;
    af_tensor docs_t = af_tensor_contiguous(docs, AF_I32, 1, (int64_t[]){S});
    af_tensor prefix_t = af_tensor_contiguous(prefix, AF_I32, 1, (int64_t[]){B});
    const af_mod_instr c_causal[] = {I(AF_MOD_GE, Q_IDX, KV_IDX, 0)};
    const af_mod_instr c_window[] = {I(AF_MOD_GE, Q_IDX, KV_IDX, 0), I(AF_MOD_SUB, Q_IDX, KV_IDX, 0), K_I32(100),
                                     I(AF_MOD_LE, 6, 7, 0), I(AF_MOD_AND, 5, 8, 0)};
    const af_mod_instr c_docs[] = {LOAD1(0, Q_IDX), LOAD1(0, KV_IDX), I(AF_MOD_EQ, 5, 6, 0),
                                   I(AF_MOD_GE, Q_IDX, KV_IDX, 0), I(AF_MOD_AND, 7, 8, 0)};
    const af_mod_instr c_prefix[] = {LOAD1(0, B_IDX), I(AF_MOD_LT, KV_IDX, 5, 0), I(AF_MOD_GE, Q_IDX, KV_IDX, 0),
                                     I(AF_MOD_OR, 6, 7, 0)};
    const af_mod_instr c_parity[] = {I(AF_MOD_ADD, KV_IDX, H_IDX, 0), K_I32(3), I(AF_MOD_MOD, 5, 6, 0), K_I32(0),
                                     I(AF_MOD_NE, 7, 8, 0)};
    const af_mod_instr c_slope[] = {I(AF_MOD_TO_F32, KV_IDX, 0, 0), K_F32(0.5), I(AF_MOD_MUL, 5, 6, 0),
                                    I(AF_MOD_TO_F32, Q_IDX, 0, 0), I(AF_MOD_LE, 7, 8, 0)};
    const af_mod_instr c_chunks[] = {K_I32(64), I(AF_MOD_FLOORDIV, Q_IDX, 5, 0), I(AF_MOD_FLOORDIV, KV_IDX, 5, 0),
                                     I(AF_MOD_EQ, 6, 7, 0)};
    const af_mod_instr c_band[] = {I(AF_MOD_SUB, Q_IDX, KV_IDX, 0), K_I32(64), I(AF_MOD_FLOORDIV, 5, 6, 0), K_I32(0),
                                   I(AF_MOD_EQ, 7, 8, 0)};
    const af_mod_instr c_nothing[] = {K_I32(0)};
    const af_mod_instr c_everything[] = {I(AF_MOD_EQ, Q_IDX, Q_IDX, 0)};
    struct { const char *name; af_mod_program prog; mask_fn fn; } masks[] = {
        {"causal", {c_causal, 1, NULL, 0}, causal},
        {"window 100", {c_window, 5, NULL, 0}, window},
        {"documents", {c_docs, 5, &docs_t, 1}, documents},
        {"prefix-LM by batch", {c_prefix, 4, &prefix_t, 1}, prefix_lm},
        {"head parity", {c_parity, 5, NULL, 0}, head_parity},
        {"float slope", {c_slope, 5, NULL, 0}, half_slope},
        {"chunks of 64", {c_chunks, 4, NULL, 0}, chunks},
        {"(q - kv) // 64 == 0", {c_band, 5, NULL, 0}, band},
        {"nothing", {c_nothing, 1, NULL, 0}, nothing},
        {"everything", {c_everything, 1, NULL, 0}, everything},
    };
    const int64_t sizes[][2] = {{128, 128}, {64, 64}, {16, 100}, {7, 3}, {1, 1}};
    for (size_t m = 0; m < sizeof masks / sizeof masks[0]; m++)
        for (size_t z = 0; z < sizeof sizes / sizeof sizes[0]; z++)
            for (int split = 0; split < 2; split++)
                check_mask(masks[m].name, &masks[m].prog, masks[m].fn, sizes[z][0], sizes[z][1], split == 1);
}

/* Bad calls: the error names the argument and the rule, and no output is written. */
static void bad_calls(void **state) {
    (void)state;
    int32_t num[2], ind[4], small[2] = {0, 0};
    af_tensor num_t = af_tensor_contiguous(num, AF_I32, 3, (int64_t[]){1, 1, 2});
    af_tensor ind_t = af_tensor_contiguous(ind, AF_I32, 4, (int64_t[]){1, 1, 2, 2});
    af_tensor wrong_t = af_tensor_contiguous(ind, AF_I32, 4, (int64_t[]){1, 1, 2, 3});
    af_tensor float_t = af_tensor_contiguous(num, AF_F32, 3, (int64_t[]){1, 1, 2});
    af_tensor small_t = af_tensor_contiguous(small, AF_I32, 1, (int64_t[]){2});
    const af_mod_instr good[] = {I(AF_MOD_GE, Q_IDX, KV_IDX, 0)};
    const af_mod_instr float_result[] = {K_F32(1.0)};
    const af_mod_instr past[] = {LOAD1(0, KV_IDX), K_I32(0), I(AF_MOD_EQ, 5, 6, 0)};
    const af_mod_program good_p = {good, 1, NULL, 0}, float_p = {float_result, 1, NULL, 0};
    const af_mod_program past_p = {past, 3, &small_t, 1};
    const af_block_mask_tensors out = {&num_t, &ind_t, NULL, NULL}, wrong = {&num_t, &wrong_t, NULL, NULL};
    const af_block_mask_tensors floats = {&float_t, &ind_t, NULL, NULL}, half = {&num_t, &ind_t, &num_t, NULL};
    struct { const af_mod_program *prog; int64_t b, l, qb; const af_block_mask_tensors *out; const char *expect; } bad[] = {
        {NULL, 1, 4, 2, &out, "mask_mod: must not be NULL"},
        {&good_p, 0, 4, 2, &out, "B and H must lie in [1, 2^31)"},
        {&good_p, 1, 4, 0, &out, "q_block, kv_block: 0 x 2"},
        {&good_p, 1, 4, 2, &wrong, "kv_indices: must be (1, 1, 2, nk)"},
        {&good_p, 1, 4, 2, &floats, "kv_num_blocks: must be int32"},
        {&good_p, 1, 4, 2, &half, "full_kv_indices: must not be NULL"},
        {&float_p, 1, 4, 2, &out, "is float32; a mask_mod gives int32"},
        {&past_p, 1, 4, 2, &out, "a LOAD read aux tensor 0 outside its shape"},
    };
    for (size_t c = 0; c < sizeof bad / sizeof bad[0]; c++) {
        memset(num, 0x5A, sizeof num);
        memset(ind, 0x5A, sizeof ind);
        assert_int_equal(af_create_block_mask(bad[c].prog, bad[c].b, 1, bad[c].l, 4, bad[c].qb, 2, bad[c].out),
                         AF_ERR_INVALID_ARGUMENT);
        if (!strstr(af_last_error(), bad[c].expect))
            fail_msg("case %zu: '%s' does not say '%s'", c, af_last_error(), bad[c].expect);
        for (size_t i = 0; i < sizeof num; i++)
            if (((unsigned char *)num)[i] != 0x5A) fail_msg("case %zu wrote kv_num_blocks", c);
        for (size_t i = 0; i < sizeof ind; i++)
            if (((unsigned char *)ind)[i] != 0x5A) fail_msg("case %zu wrote kv_indices", c);
    }
    /* one block of 4 keys over a 2-element tensor: its range reaches past the tensor, so the block is evaluated and
     * the bad load found, not settled on the tensor's first two elements */
    af_tensor one_t = af_tensor_contiguous(num, AF_I32, 3, (int64_t[]){1, 1, 2});
    af_tensor one_ind_t = af_tensor_contiguous(ind, AF_I32, 4, (int64_t[]){1, 1, 2, 1});
    const af_block_mask_tensors one = {&one_t, &one_ind_t, NULL, NULL};
    assert_int_equal(af_create_block_mask(&past_p, 1, 1, 4, 4, 2, 4, &one), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "outside its shape"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(masks_against_brute_force),
        cmocka_unit_test(bad_calls),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
