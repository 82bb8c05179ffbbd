/* Fused mods (src/flex/fused.c): which programs take a one-pass kernel (ALiBi score_mods, band mask_mods), and that
 * it gives the interpreter's bits — forward out and lse, backward dq, dk, dv — on every ISA and the emulated AMX
 * products, f32 / f16 / bf16, prefill and decode rows, with and without a block mask (its full tiles skip the block
 * lookups), over key positions on both sides of each row (negative and positive distances). The interpreter's own
 * correctness against the double reference is test_flex's and test_flex_backward's (whose references never fuse). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"
#include "flex/bounds.h"
#include "flex/fused.h"
#include "flex/program.h"
#include "test_tensor.h"
#include "ukernel_amx_emulated.h"

#define I(op_, a_, b_, c_) {.op = (op_), .in = {(a_), (b_), (c_), 0}}
#define K_F32(v) {.op = AF_MOD_CONST_F32, .imm = (v)}
#define K_I32(v) {.op = AF_MOD_CONST_I32, .imm = (v)}
#define LOAD1(aux_, i0) {.op = AF_MOD_LOAD, .in = {(i0), 0, 0, 0}, .aux = (aux_)}
enum { SCORE = 0, B_IDX = 1, H_IDX = 2, Q_IDX = 3, KV_IDX = 4 };

static test_rng rng = {0x7E57F0CED0000001ull};

static bool light(void) { return getenv("ATTNFORGE_TEST_LIGHT") != NULL; }   /* valgrind: one dtype a program */
static float slopes[4] = {0.5f, 0.25f, 0.125f, 0.0625f};
static af_tensor slopes_t;
static float table[4 * 300];          /* (head, 300) */
static uint16_t table_bf16[300 * 4];  /* bf16, stored (300, head): read through a transposed view */
static af_tensor table_t, table_bf16_t;

static void make_tables(void) {
    slopes_t = af_tensor_contiguous(slopes, AF_F32, 1, (int64_t[]){4});
    for (int i = 0; i < 4 * 300; i++) table[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;
    for (int i = 0; i < 300 * 4; i++) table_bf16[i] = (uint16_t)(0x3E00u + (uint16_t)((i * 31) % 256));
    table_t = af_tensor_contiguous(table, AF_F32, 2, (int64_t[]){4, 300});
    table_bf16_t = af_tensor_contiguous(table_bf16, AF_BF16, 2, (int64_t[]){4, 300});
    table_bf16_t.strides[0] = 1;   /* element (h, i) at i·4 + h */
    table_bf16_t.strides[1] = 4;
}

/* ALiBi as PyTorch's trace gives it: slopes[h] · float(kv_idx − q_idx) added to the score */
static const af_mod_instr alibi[] = {LOAD1(0, H_IDX), I(AF_MOD_SUB, KV_IDX, Q_IDX, 0), I(AF_MOD_TO_F32, 6, 0, 0),
                                     I(AF_MOD_MUL, 5, 7, 0), I(AF_MOD_ADD, SCORE, 8, 0)};
/* the other order of every commutative operand, q_idx − kv_idx, and a slope that is one value for all rows */
static const af_mod_instr alibi_swapped[] = {K_F32(0.375), I(AF_MOD_SUB, Q_IDX, KV_IDX, 0), I(AF_MOD_TO_F32, 6, 0, 0),
                                             I(AF_MOD_MUL, 7, 5, 0), I(AF_MOD_ADD, 8, SCORE, 0)};
/* a slope computed from the row: (h + 1) · 0.1 − q_idx · 0.001 */
static const af_mod_instr alibi_row_slope[] = {K_I32(1), I(AF_MOD_ADD, H_IDX, 5, 0), I(AF_MOD_TO_F32, 6, 0, 0),
                                               K_F32(0.1), I(AF_MOD_MUL, 7, 8, 0), I(AF_MOD_TO_F32, Q_IDX, 0, 0),
                                               K_F32(0.001), I(AF_MOD_MUL, 10, 11, 0), I(AF_MOD_SUB, 9, 12, 0),
                                               I(AF_MOD_SUB, KV_IDX, Q_IDX, 0), I(AF_MOD_TO_F32, 14, 0, 0),
                                               I(AF_MOD_MUL, 13, 15, 0), I(AF_MOD_ADD, SCORE, 16, 0)};
/* not fused: a fifth instruction on every score; a slope that follows the key; kv_idx − kv_idx */
static const af_mod_instr alibi_scaled[] = {LOAD1(0, H_IDX), I(AF_MOD_SUB, KV_IDX, Q_IDX, 0),
                                            I(AF_MOD_TO_F32, 6, 0, 0), K_F32(0.05), I(AF_MOD_MUL, 7, 8, 0),
                                            I(AF_MOD_MUL, 5, 9, 0), I(AF_MOD_ADD, SCORE, 10, 0)};
static const af_mod_instr slope_by_key[] = {I(AF_MOD_TO_F32, KV_IDX, 0, 0), I(AF_MOD_SUB, KV_IDX, Q_IDX, 0),
                                            I(AF_MOD_TO_F32, 6, 0, 0), I(AF_MOD_MUL, 5, 7, 0),
                                            I(AF_MOD_ADD, SCORE, 8, 0)};
static const af_mod_instr kv_minus_kv[] = {LOAD1(0, H_IDX), I(AF_MOD_SUB, KV_IDX, KV_IDX, 0),
                                           I(AF_MOD_TO_F32, 6, 0, 0), I(AF_MOD_MUL, 5, 7, 0),
                                           I(AF_MOD_ADD, SCORE, 8, 0)};
/* relative-position tables, as traced: table[h, where(i < 0, i + 300, i)], i = kv − q + c; c = 150 stays inside,
 * c = 100 wraps the rows past q = 100 */
#define LOAD2(aux_, i0, i1) {.op = AF_MOD_LOAD, .in = {(i0), (i1), 0, 0}, .aux = (aux_)}
#define REL_TABLE(c) {I(AF_MOD_SUB, KV_IDX, Q_IDX, 0), K_I32(c), I(AF_MOD_ADD, 5, 6, 0), K_I32(0), I(AF_MOD_LT, 7, 8, 0), \
                      K_I32(300), I(AF_MOD_ADD, 7, 10, 0), I(AF_MOD_WHERE, 9, 11, 7), LOAD2(0, H_IDX, 12),        \
                      I(AF_MOD_ADD, SCORE, 13, 0)}
static const af_mod_instr rel_inside[] = REL_TABLE(150);
static const af_mod_instr rel_wrapped[] = REL_TABLE(100);
/* unwrapped, the constant first: table[h, c + (kv − q)], c = 160: rows q < 10 read past the end (an error) */
static const af_mod_instr rel_past[] = {I(AF_MOD_SUB, KV_IDX, Q_IDX, 0), K_I32(160), I(AF_MOD_ADD, 6, 5, 0),
                                        LOAD2(0, H_IDX, 7), I(AF_MOD_ADD, 8, SCORE, 0)};
/* by key: table[h, kv] */
static const af_mod_instr by_key[] = {LOAD2(0, H_IDX, KV_IDX), I(AF_MOD_ADD, SCORE, 5, 0)};
/* not fused: the index kv·2, and two indices that follow the key */
static const af_mod_instr kv_twice[] = {K_I32(2), I(AF_MOD_MUL, KV_IDX, 5, 0), LOAD2(0, H_IDX, 6),
                                        I(AF_MOD_ADD, SCORE, 7, 0)};
static const af_mod_instr two_keys[] = {I(AF_MOD_SUB, KV_IDX, Q_IDX, 0), LOAD2(0, KV_IDX, 5),
                                        I(AF_MOD_ADD, SCORE, 6, 0)};
static const af_mod_instr causal[] = {I(AF_MOD_GE, Q_IDX, KV_IDX, 0)};
/* bands: a causal window of 24 as traced ((q >= kv) & (q - kv < 24)) */
static const af_mod_instr window[] = {I(AF_MOD_GE, Q_IDX, KV_IDX, 0), I(AF_MOD_SUB, Q_IDX, KV_IDX, 0), K_I32(24),
                                      I(AF_MOD_LT, 6, 7, 0), I(AF_MOD_AND, 5, 8, 0)};
/* kv − q in (−40, 9] with both limits computed at run time (−5·8 and 3·3), every comparison's other direction, and
 * gates: rows q % 4 != 1 (by row), keys kv % 5 != 2 (by key) */
static const af_mod_instr band_gated[] = {
    K_I32(-5), K_I32(8), I(AF_MOD_MUL, 5, 6, 0), K_I32(3), I(AF_MOD_MUL, 8, 8, 0),   /* r7 = −40, r9 = 9 */
    I(AF_MOD_SUB, KV_IDX, Q_IDX, 0), I(AF_MOD_GT, 10, 7, 0), I(AF_MOD_LE, 10, 9, 0),  /* r11, r12 */
    I(AF_MOD_AND, 11, 12, 0),                                                          /* r13 */
    K_I32(4), I(AF_MOD_MOD, Q_IDX, 14, 0), K_I32(1), I(AF_MOD_NE, 15, 16, 0),          /* r17: q % 4 != 1 */
    K_I32(5), I(AF_MOD_MOD, KV_IDX, 18, 0), K_I32(2), I(AF_MOD_NE, 19, 20, 0),         /* r21: kv % 5 != 2 */
    I(AF_MOD_AND, 17, 13, 0), I(AF_MOD_AND, 21, 22, 0)};
/* anti-causal with an offset: kv > q + 3, written 3 < kv − q (the constant first) */
static const af_mod_instr anti[] = {I(AF_MOD_SUB, KV_IDX, Q_IDX, 0), K_I32(3), I(AF_MOD_LT, 6, 5, 0)};
/* not fused: a comparison by !=, an OR of two limits, a difference compared with q_idx − kv_idx twice over */
static const af_mod_instr not_equal[] = {I(AF_MOD_NE, Q_IDX, KV_IDX, 0)};
static const af_mod_instr either[] = {I(AF_MOD_GE, Q_IDX, KV_IDX, 0), K_I32(100), I(AF_MOD_LT, KV_IDX, 6, 0),
                                      I(AF_MOD_OR, 5, 7, 0)};
static const af_mod_instr twice[] = {I(AF_MOD_SUB, Q_IDX, KV_IDX, 0), I(AF_MOD_SUB, KV_IDX, Q_IDX, 0),
                                     I(AF_MOD_LT, 5, 6, 0)};

#define PROGRAM(code) ((af_mod_program){(code), (int32_t)(sizeof(code) / sizeof((code)[0])), &slopes_t, 1})
#define MASK(code) ((af_mod_program){(code), (int32_t)(sizeof(code) / sizeof((code)[0])), NULL, 0})
#define WITH(code, aux) ((af_mod_program){(code), (int32_t)(sizeof(code) / sizeof((code)[0])), &(aux), 1})

static int fused_kind(const af_mod_program *p, bool score) {
    af_mods mods;
    assert_int_equal(af_mods_check(score ? p : NULL, score ? NULL : p, &mods), AF_OK);
    const int kind = score ? mods.score.fused.kind : mods.mask.fused.kind;
    af_mods_release(&mods);
    return kind;
}

static void which_programs_fuse(void **state) {
    (void)state;
    make_tables();
    const struct {
        const char *name;
        af_mod_program p;
        bool score;
        int kind;
    } cases[] = {
        {"alibi", PROGRAM(alibi), true, AF_FUSED_ALIBI},
        {"alibi, swapped", PROGRAM(alibi_swapped), true, AF_FUSED_ALIBI},
        {"alibi, slope from the row", PROGRAM(alibi_row_slope), true, AF_FUSED_ALIBI},
        {"alibi times 0.05", PROGRAM(alibi_scaled), true, AF_FUSED_NONE},
        {"slope by key", PROGRAM(slope_by_key), true, AF_FUSED_NONE},
        {"kv - kv", PROGRAM(kv_minus_kv), true, AF_FUSED_NONE},
        {"relative table", WITH(rel_inside, table_t), true, AF_FUSED_TABLE},
        {"relative table, wrapped", WITH(rel_wrapped, table_t), true, AF_FUSED_TABLE},
        {"relative table, constant first", WITH(rel_past, table_t), true, AF_FUSED_TABLE},
        {"table by key", WITH(by_key, table_t), true, AF_FUSED_TABLE},
        {"table at kv * 2", WITH(kv_twice, table_t), true, AF_FUSED_NONE},
        {"two key indices", WITH(two_keys, table_t), true, AF_FUSED_NONE},
        {"causal", MASK(causal), false, AF_FUSED_BAND},
        {"window", MASK(window), false, AF_FUSED_BAND},
        {"band with gates", MASK(band_gated), false, AF_FUSED_BAND},
        {"anti-causal", MASK(anti), false, AF_FUSED_BAND},
        {"!=", MASK(not_equal), false, AF_FUSED_NONE},
        {"or", MASK(either), false, AF_FUSED_NONE},
        {"difference against difference", MASK(twice), false, AF_FUSED_NONE},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int kind = fused_kind(&cases[c].p, cases[c].score);
        if (kind != cases[c].kind) fail_msg("%s: fused kind %d, expected %d", cases[c].name, kind, cases[c].kind);
    }
    af_mod_fusion_for_tests(false);
    assert_int_equal(fused_kind(&cases[0].p, true), AF_FUSED_NONE);
    assert_int_equal(fused_kind(&cases[12].p, false), AF_FUSED_NONE);
    af_mod_fusion_for_tests(true);
}

/* Which programs' LOADs the interval analysis proves inside their tensors over a call's indices (b < 1, h < 4,
 * q_idx, kv_idx < 150): those it does not run into staged outputs. */
static void which_loads_are_proven(void **state) {
    (void)state;
    make_tables();
    const struct {
        const char *name;
        af_mod_program p;
        bool inside;
    } cases[] = {
        {"alibi", PROGRAM(alibi), true},
        {"relative table, kv − q + 150", WITH(rel_inside, table_t), true},
        {"table by key", WITH(by_key, table_t), true},
        {"relative table, kv − q + 100 wrapped", WITH(rel_wrapped, table_t), false},   /* the analysis joins both */
        {"relative table, 160 + kv − q", WITH(rel_past, table_t), false},               /* reads past the end */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        af_mods mods;
        assert_int_equal(af_mods_check(&cases[c].p, NULL, &mods), AF_OK);
        if (af_mods_loads_inside(&mods, 1, 4, 150, 150) != cases[c].inside)
            fail_msg("%s: proven inside %d, expected %d", cases[c].name, !cases[c].inside, cases[c].inside);
        af_mods_release(&mods);
    }
}

/* out, lse, dq, dk, dv of one call on the current kernel, with fusion as set. */
typedef struct {
    test_tensor out, lse, g[3];
} results;

static void run(const af_flex_args *a, test_tensor *dout, results *r) {
    if (af_flex_attn(a, &r->out.view, &r->lse.view) != AF_OK) fail_msg("forward: %s", af_last_error());
    const af_backward_inputs in = {.out = &r->out.view, .dout = &dout->view, .lse = &r->lse.view};
    const af_gradients grads = {&r->g[0].view, &r->g[1].view, &r->g[2].view, NULL};
    if (af_flex_attn_backward(a, &in, &grads, NULL) != AF_OK) fail_msg("backward: %s", af_last_error());
}

static void same_bits(const char *what, const char *isa, const char *dtype, const test_tensor *x,
                      const test_tensor *y) {
    if (memcmp(x->memory, y->memory, x->bytes) != 0)
        fail_msg("%s, %s, %s: the fused kernel's bits differ from the interpreter's", what, isa, dtype);
}

static void check(const char *name, af_dtype dtype, int64_t L, const af_mod_program *score, const af_mod_program *mask,
                  const af_block_mask *bm) {
    const int64_t B = 2, Hq = 4, Hkv = 2, S = 150, E = 32, Ev = 48;
    const int64_t qs[4] = {B, Hq, L, E}, ks[4] = {B, Hkv, S, E}, vs[4] = {B, Hkv, S, Ev}, os[4] = {B, Hq, L, Ev};
    const int64_t *shapes[3] = {qs, ks, vs};
    test_tensor q, k, v, dout;
    results r[2];
    assert_true(tt_alloc(&q, dtype, 4, qs, LAYOUT_NHD, &rng) && tt_alloc(&k, dtype, 4, ks, LAYOUT_CONTIGUOUS, &rng) &&
                tt_alloc(&v, dtype, 4, vs, LAYOUT_CONTIGUOUS, &rng) &&
                tt_alloc(&dout, dtype, 4, os, LAYOUT_CONTIGUOUS, &rng));
    for (int f = 0; f < 2; f++) {
        assert_true(tt_alloc(&r[f].out, dtype, 4, os, LAYOUT_CONTIGUOUS, &rng) &&
                    tt_alloc(&r[f].lse, AF_F32, 3, (int64_t[]){B, Hq, L}, LAYOUT_CONTIGUOUS, &rng));
        for (int t = 0; t < 3; t++) assert_true(tt_alloc(&r[f].g[t], AF_F32, 4, shapes[t], LAYOUT_CONTIGUOUS, &rng));
    }
    tt_fill_uniform(&q, &rng, 2.0);
    tt_fill_uniform(&k, &rng, 2.0);
    tt_fill_uniform(&v, &rng, 1.0);
    tt_fill_uniform(&dout, &rng, 1.0);
    const af_flex_args a = {.query = &q.view, .key = &k.view, .value = &v.view, .has_scale = true, .scale = 0.3,
                            .score_mod = score, .mask_mod = mask, .block_mask = bm};
    const char *before = af_get_isa(), *dt = af_dtype_name(dtype);
    for (int i = 0; i < AF_TEST_KERNELS; i++) {
        const char *isa = af_test_kernel_select(i);
        if (!isa) continue;
        for (int f = 0; f < 2; f++) {   /* f = 0: the interpreter, 1: fused */
            af_mod_fusion_for_tests(f == 1);
            run(&a, &dout, &r[f]);
        }
        same_bits(name, isa, dt, &r[0].out, &r[1].out);
        same_bits(name, isa, dt, &r[0].lse, &r[1].lse);
        for (int t = 0; t < 3; t++) same_bits(name, isa, dt, &r[0].g[t], &r[1].g[t]);
        af_test_kernel_done(i, before);
    }
    af_mod_fusion_for_tests(true);
    assert_int_equal(af_set_isa(before), AF_OK);
    test_tensor *all[] = {&q, &k, &v, &dout};
    for (size_t t = 0; t < 4; t++) tt_free(all[t]);
    for (int f = 0; f < 2; f++) {
        tt_free(&r[f].out);
        tt_free(&r[f].lse);
        for (int t = 0; t < 3; t++) tt_free(&r[f].g[t]);
    }
}

static void fused_bits_are_the_interpreters(void **state) {
    (void)state;
    make_tables();
    /* a causal block mask of 32 × 16 blocks over the L = S = 150 prefill: full tiles inside, partial ones on the
     * diagonal */
    const int64_t nq = 5, nk = 10;
    int32_t num[5], ind[50], full_num[5], full_ind[50];
    af_tensor num_t = af_tensor_contiguous(num, AF_I32, 3, (int64_t[]){1, 1, nq}),
              ind_t = af_tensor_contiguous(ind, AF_I32, 4, (int64_t[]){1, 1, nq, nk}),
              full_num_t = af_tensor_contiguous(full_num, AF_I32, 3, (int64_t[]){1, 1, nq}),
              full_ind_t = af_tensor_contiguous(full_ind, AF_I32, 4, (int64_t[]){1, 1, nq, nk});
    const af_block_mask_tensors out = {&num_t, &ind_t, &full_num_t, &full_ind_t};
    const af_mod_program causal_p = {causal, 1, NULL, 0};
    assert_int_equal(af_create_block_mask(&causal_p, 1, 1, 150, 150, 32, 16, &out), AF_OK);
    const af_block_mask bm = {.q_block = 32, .kv_block = 16, .kv_num_blocks = &num_t, .kv_indices = &ind_t,
                              .full_kv_num_blocks = &full_num_t, .full_kv_indices = &full_ind_t};
    const af_mod_program programs[3] = {PROGRAM(alibi), PROGRAM(alibi_swapped), PROGRAM(alibi_row_slope)};
    const char *names[3] = {"alibi", "alibi, swapped", "alibi, slope from the row"};
    const af_dtype dtypes[3] = {AF_F32, AF_F16, AF_BF16};
    for (int p = 0; p < 3; p++)
        for (int d = 0; d < 3; d++) {
            if (light() && d != p) continue;
            check(names[p], dtypes[d], 150, &programs[p], NULL, NULL);
            check(names[p], dtypes[d], 3, &programs[p], NULL, NULL);   /* decode-sized rows: the direct kernels */
            if (d == p) check(names[p], dtypes[d], 150, &programs[p], &causal_p, &bm);
        }
    /* tables: f32 rows read as vectors, a bf16 transposed view read element by element, wrapped indices */
    const af_mod_program tables[4] = {WITH(rel_inside, table_t), WITH(rel_wrapped, table_t),
                                      WITH(rel_inside, table_bf16_t), WITH(by_key, table_bf16_t)};
    const char *table_names[4] = {"relative table", "relative table, wrapped", "relative bf16 view", "table by key"};
    for (int p = 0; p < 4; p++)
        for (int d = 0; d < 3; d++) {
            if (light() && d != p % 3) continue;
            check(table_names[p], dtypes[d], 150, &tables[p], NULL, NULL);
            check(table_names[p], dtypes[d], 3, &tables[p], NULL, NULL);
            if (d == p % 3) check(table_names[p], dtypes[d], 150, &tables[p], &causal_p, &bm);
        }
    /* band masks alone, under ALiBi, and with the causal block mask (its partial blocks evaluate them) */
    const af_mod_program masks[4] = {MASK(causal), MASK(window), MASK(band_gated), MASK(anti)};
    const char *mask_names[4] = {"causal", "window", "band with gates", "anti-causal"};
    for (int k = 0; k < 4; k++)
        for (int d = 0; d < 3; d++) {
            if (light() && d != k % 3) continue;
            check(mask_names[k], dtypes[d], 150, NULL, &masks[k], NULL);
            check(mask_names[k], dtypes[d], 3, &programs[d], &masks[k], NULL);
            if (d == k % 3) check(mask_names[k], dtypes[d], 150, &programs[0], &masks[k], &bm);
        }
}

/* Whether out (float32) still holds the 0x5A bytes it was filled with. */
static bool untouched(const test_tensor *t) {
    for (size_t i = 0; i < t->bytes; i++)
        if (((const unsigned char *)t->memory)[i] != 0x5A) return false;
    return true;
}

/* A table read past its end: the fused kernel fails the call as the interpreter's LOAD does, forward and backward,
 * and writes nothing (the analysis cannot prove the reads inside, so the outputs are staged). */
static void table_out_of_bounds(void **state) {
    (void)state;
    make_tables();
    const int64_t shape[4] = {1, 4, 150, 32};
    test_tensor q, k, v, out, lse;
    assert_true(tt_alloc(&q, AF_F32, 4, shape, LAYOUT_CONTIGUOUS, &rng) &&
                tt_alloc(&k, AF_F32, 4, shape, LAYOUT_CONTIGUOUS, &rng) &&
                tt_alloc(&v, AF_F32, 4, shape, LAYOUT_CONTIGUOUS, &rng) &&
                tt_alloc(&out, AF_F32, 4, shape, LAYOUT_CONTIGUOUS, &rng) &&
                tt_alloc(&lse, AF_F32, 3, (int64_t[]){1, 4, 150}, LAYOUT_CONTIGUOUS, &rng));
    test_tensor dq, dout;
    assert_true(tt_alloc(&dq, AF_F32, 4, shape, LAYOUT_CONTIGUOUS, &rng) &&
                tt_alloc(&dout, AF_F32, 4, shape, LAYOUT_CONTIGUOUS, &rng));
    tt_fill_uniform(&dout, &rng, 1.0);
    const af_mod_program past = WITH(rel_past, table_t), inside = WITH(rel_inside, table_t);
    af_flex_args a = {.query = &q.view, .key = &k.view, .value = &v.view, .score_mod = &inside};
    assert_int_equal(af_flex_attn(&a, &out.view, &lse.view), AF_OK);   /* an out and lse for the backward */
    a.score_mod = &past;
    const af_backward_inputs in = {.out = &out.view, .dout = &dout.view, .lse = &lse.view};
    const af_gradients grads = {&dq.view, NULL, NULL, NULL};
    for (int f = 0; f < 2; f++) {
        af_mod_fusion_for_tests(f == 1);
        memset(dq.memory, 0x5A, dq.bytes);
        assert_int_equal(af_flex_attn_backward(&a, &in, &grads, NULL), AF_ERR_INVALID_ARGUMENT);
        if (!strstr(af_last_error(), "score_mod: a LOAD read aux tensor 0 outside its shape"))
            fail_msg("backward, fusion %d: '%s'", f, af_last_error());
        if (!untouched(&dq)) fail_msg("backward, fusion %d: dq written", f);
        memset(out.memory, 0x5A, out.bytes);
        memset(lse.memory, 0x5A, lse.bytes);
        assert_int_equal(af_flex_attn(&a, &out.view, &lse.view), AF_ERR_INVALID_ARGUMENT);
        if (!strstr(af_last_error(), "score_mod: a LOAD read aux tensor 0 outside its shape"))
            fail_msg("fusion %d: '%s'", f, af_last_error());
        if (!untouched(&out) || !untouched(&lse)) fail_msg("fusion %d: out or lse written", f);
    }
    af_mod_fusion_for_tests(true);
    test_tensor *all[] = {&q, &k, &v, &out, &lse, &dq, &dout};
    for (size_t t = 0; t < 7; t++) tt_free(all[t]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(which_programs_fuse),
        cmocka_unit_test(fused_bits_are_the_interpreters),
        cmocka_unit_test(table_out_of_bounds),
        cmocka_unit_test(which_loads_are_proven),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
