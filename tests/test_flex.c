/* af_flex_attn: score_mod and mask_mod programs evaluated in the kernels' tiles, against af_flex_attn_reference
 * (double scores and softmax) on every ISA the machine runs and the emulated AMX products, at 1 and 2 threads, in
 * f32 / f16 / bf16, grouped heads and Ev != E, any strides: ALiBi with per-head slopes, a bias table by (head, key)
 * in bf16, softcap, causal and sliding-window masks, a document mask from int32 ids, a mask that empties whole rows
 * (out 0, lse -inf). Then the operations one by one against values worked out by hand, and the programs the checks
 * refuse, each naming the instruction and the rule. */
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
#include "sdpa/tolerance.h"
#include "test_tensor.h"
#include "ukernel_amx_emulated.h"

#define I(op_, a_, b_, c_) {.op = (op_), .in = {(a_), (b_), (c_), 0}}
#define K_F32(v) {.op = AF_MOD_CONST_F32, .imm = (v)}
#define K_I32(v) {.op = AF_MOD_CONST_I32, .imm = (v)}
#define LOAD1(aux_, i0) {.op = AF_MOD_LOAD, .in = {(i0), 0, 0, 0}, .aux = (aux_)}
#define LOAD2(aux_, i0, i1) {.op = AF_MOD_LOAD, .in = {(i0), (i1), 0, 0}, .aux = (aux_)}
enum { SCORE = 0, B_IDX = 1, H_IDX = 2, Q_IDX = 3, KV_IDX = 4 };

static test_rng rng = {0x51ED2701A3B5C7E9ull};

static bool light(void) { return getenv("ATTNFORGE_TEST_LIGHT") != NULL; }

typedef struct {
    const char *name;
    af_mod_program score, mask;
    bool has_score, has_mask;
    double bias_max;   /* largest |term| the score_mod adds to a logit */
    const af_block_mask *blocks;      /* the kernel's block mask, or NULL */
    const af_mod_program *ref_mask;   /* with it: the reference's mask_mod instead (the dense mask the blocks mean) */
} mod_case;

typedef struct {
    af_dtype dtype;
    int64_t B, Hq, Hkv, L, S, E, Ev;
    tensor_layout layout;
} shape_case;

/* One shape and one set of mods: the kernel on every ISA and thread count against the reference. */
static void check(const shape_case *c, const mod_case *mc) {
    test_tensor q, k, v, out, lse, ref_lse;
    const int64_t qs[4] = {c->B, c->Hq, c->L, c->E}, ks[4] = {c->B, c->Hkv, c->S, c->E};
    const int64_t vs[4] = {c->B, c->Hkv, c->S, c->Ev}, os[4] = {c->B, c->Hq, c->L, c->Ev}, ls[3] = {c->B, c->Hq, c->L};
    assert_true(tt_alloc(&q, c->dtype, 4, qs, c->layout, &rng) && tt_alloc(&k, c->dtype, 4, ks, c->layout, &rng) &&
                tt_alloc(&v, c->dtype, 4, vs, c->layout, &rng));
    assert_true(tt_alloc(&out, c->dtype, 4, os, LAYOUT_CONTIGUOUS, &rng) &&
                tt_alloc(&lse, AF_F32, 3, ls, LAYOUT_CONTIGUOUS, &rng) &&
                tt_alloc(&ref_lse, AF_F32, 3, ls, LAYOUT_CONTIGUOUS, &rng));
    tt_fill_uniform(&q, &rng, 1.0);
    tt_fill_uniform(&k, &rng, 1.0);
    tt_fill_uniform(&v, &rng, 1.0);
    af_flex_args a = {.query = &q.view, .key = &k.view, .value = &v.view,
                      .score_mod = mc->has_score ? &mc->score : NULL, .mask_mod = mc->has_mask ? &mc->mask : NULL};
    /* the reference, written in the query's dtype: its rounding (2·u·|ref|) joins the bound. A block mask's
     * reference is the dense mask it means, worked out by the test, with no block mask. */
    af_flex_args ref_args = a;
    if (mc->blocks) ref_args.mask_mod = mc->ref_mask;
    a.block_mask = mc->blocks;
    assert_int_equal(af_flex_attn_reference(&ref_args, &out.view, &ref_lse.view), AF_OK);
    unsigned char *ref_bytes = malloc(out.bytes);
    memcpy(ref_bytes, out.memory, out.bytes);
    double v_max, v_row, q_max, q_row, k_max, k_row;
    tt_magnitudes(&v, &v_max, &v_row);
    tt_magnitudes(&q, &q_max, &q_row);
    tt_magnitudes(&k, &k_max, &k_row);
    const af_error_scale scale = {.value_max = v_max, .logit_max = q_row * k_row / sqrt((double)c->E) + mc->bias_max,
                                  .E = c->E, .S = c->S};
    const char *before = af_get_isa();
    for (int i = 0; i < AF_TEST_KERNELS; i++) {
        const char *isa = af_test_kernel_select(i);
        if (!isa) continue;
        unsigned char *first = NULL;
        for (int threads = 1; threads <= 2; threads++) {
            af_set_num_threads(threads);
            tt_fill_bytes(&out, TT_SENTINEL_BYTE);
            if (af_flex_attn(&a, &out.view, &lse.view) != AF_OK)
                fail_msg("%s %s: %s", mc->name, isa, af_last_error());
            int64_t idx[4] = {0, 0, 0, 0};
            test_tensor ref_t = out;
            ref_t.memory = ref_bytes;
            ref_t.view.data = ref_bytes + ((unsigned char *)out.view.data - out.memory);
            do {
                const double want = tt_get(&ref_t, idx), got = tt_get(&out, idx);
                const double bound = af_error_bound(c->dtype, want, &scale) + 2.0 * fabs(want) *
                                     (c->dtype == AF_F32 ? 0x1p-24 : c->dtype == AF_F16 ? 0x1p-11 : 0x1p-8);
                if (!(fabs(got - want) <= bound))
                    fail_msg("%s, %s, %d threads, %s: out[%lld,%lld,%lld,%lld] = %.8g, reference %.8g (bound %.3g)",
                             mc->name, isa, threads, af_dtype_name(c->dtype), (long long)idx[0],
                             (long long)idx[1], (long long)idx[2], (long long)idx[3], got, want, bound);
            } while (tt_next_index(4, os, idx));
            int64_t li[3] = {0, 0, 0};
            do {
                const double want = tt_get(&ref_lse, li), got = tt_get(&lse, li);
                if (isinf(want) ? got != want : !(fabs(got - want) <= 1e-4 * (1.0 + fabs(want)) + scale.logit_max *
                                                                         (c->dtype == AF_F32 ? 1e-6 : 4e-3)))
                    fail_msg("%s, %s, %s: lse[%lld,%lld,%lld] = %.8g, reference %.8g", mc->name, isa,
                             af_dtype_name(c->dtype), (long long)li[0], (long long)li[1], (long long)li[2], got, want);
            } while (tt_next_index(3, ls, li));
            if (!first) {
                first = malloc(out.bytes);
                memcpy(first, out.memory, out.bytes);
            } else if (memcmp(first, out.memory, out.bytes) != 0) {
                fail_msg("%s, %s: 1 and 2 threads differ", mc->name, isa);
            }
        }
        free(first);
        af_test_kernel_done(i, before);
    }
    af_set_num_threads(0);
    assert_int_equal(af_set_isa(before), AF_OK);
    free(ref_bytes);
    test_tensor *all[] = {&q, &k, &v, &out, &lse, &ref_lse};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tt_free(all[i]);
}

static void mods_against_the_reference(void **state) {
    (void)state;
    const int64_t Hq = 4, S = 200;
    float slopes[4] = {0.5f, 0.25f, 0.125f, 0.0625f};
    af_tensor slopes_t = af_tensor_contiguous(slopes, AF_F32, 1, (int64_t[]){Hq});
    uint16_t table[4 * 200];
    for (int i = 0; i < 4 * 200; i++) table[i] = (uint16_t)(0x3F80u + (uint16_t)(i % 37) * 3u);   /* bf16 1..~2 */
    af_tensor table_t = af_tensor_contiguous(table, AF_BF16, 2, (int64_t[]){Hq, S});
    int32_t docs[200];
    for (int j = 0; j < S; j++) docs[j] = j < 37 ? 0 : j < 90 ? 1 : j < 91 ? 2 : 3;
    af_tensor docs_t = af_tensor_contiguous(docs, AF_I32, 1, (int64_t[]){S});

    /* ALiBi: score + slope[h]·(kv_idx - q_idx) */
    const af_mod_instr alibi[] = {LOAD1(0, H_IDX), I(AF_MOD_SUB, KV_IDX, Q_IDX, 0), I(AF_MOD_TO_F32, 6, 0, 0),
                                  I(AF_MOD_MUL, 5, 7, 0), I(AF_MOD_ADD, SCORE, 8, 0)};
    /* bias table by (head, key), bf16 */
    const af_mod_instr bias[] = {LOAD2(0, H_IDX, KV_IDX), I(AF_MOD_ADD, SCORE, 5, 0)};
    /* softcap 2: 2·tanh(score / 2) */
    const af_mod_instr softcap[] = {K_F32(2.0), I(AF_MOD_DIV, SCORE, 5, 0), I(AF_MOD_TANH, 6, 0, 0),
                                    I(AF_MOD_MUL, 7, 5, 0)};
    /* causal (top-left): q_idx >= kv_idx */
    const af_mod_instr causal[] = {I(AF_MOD_GE, Q_IDX, KV_IDX, 0)};
    /* sliding window 24 (causal): q_idx - kv_idx <= 24 and q_idx >= kv_idx */
    const af_mod_instr window[] = {I(AF_MOD_SUB, Q_IDX, KV_IDX, 0), K_I32(24), I(AF_MOD_LE, 5, 6, 0),
                                   I(AF_MOD_GE, Q_IDX, KV_IDX, 0), I(AF_MOD_AND, 7, 8, 0)};
    /* documents: docs[q_idx] == docs[kv_idx] and causal */
    const af_mod_instr document[] = {LOAD1(0, Q_IDX), LOAD1(0, KV_IDX), I(AF_MOD_EQ, 5, 6, 0),
                                     I(AF_MOD_GE, Q_IDX, KV_IDX, 0), I(AF_MOD_AND, 7, 8, 0)};
    /* rows q_idx % 5 == 3 see nothing; the others only even keys of their head's parity ((kv + h) % 2 == 0) */
    const af_mod_instr holes[] = {K_I32(5), I(AF_MOD_MOD, Q_IDX, 5, 0), K_I32(3), I(AF_MOD_NE, 6, 7, 0),
                                  I(AF_MOD_ADD, KV_IDX, H_IDX, 0), K_I32(2), I(AF_MOD_MOD, 9, 10, 0), K_I32(0),
                                  I(AF_MOD_EQ, 11, 12, 0), I(AF_MOD_AND, 8, 13, 0)};
    const mod_case mods[] = {
        {"alibi", {alibi, 5, &slopes_t, 1}, {0}, true, false, 0.5 * S, NULL, NULL},
        {"alibi + causal", {alibi, 5, &slopes_t, 1}, {causal, 1, NULL, 0}, true, true, 0.5 * S, NULL, NULL},
        {"bias table (bf16)", {bias, 2, &table_t, 1}, {0}, true, false, 2.0, NULL, NULL},
        {"softcap + window", {softcap, 4, NULL, 0}, {window, 5, NULL, 0}, true, true, 0.0, NULL, NULL},
        {"documents", {0}, {document, 5, &docs_t, 1}, false, true, 0.0, NULL, NULL},
        {"empty rows", {0}, {holes, 10, NULL, 0}, false, true, 0.0, NULL, NULL},
    };
    const af_dtype dtypes[3] = {AF_F32, AF_F16, AF_BF16};
    for (size_t m = 0; m < sizeof mods / sizeof mods[0]; m++)
        for (int d = 0; d < 3; d++) {
            if (light() && d != (int)(m % 3)) continue;
            /* L = S = 200: several key tiles and row blocks; decode-sized rows (L 3) on the direct kernels */
            const shape_case shapes[2] = {{dtypes[d], 2, Hq, 2, S, S, 64, 48, (tensor_layout)(m % LAYOUT_COUNT)},
                                          {dtypes[d], 1, Hq, 1, 3, S, 64, 64, LAYOUT_NHD}};
            for (int s = 0; s < 2; s++) {
                shape_case c = shapes[s];
                mod_case mc = mods[m];
                check(&c, &mc);
            }
        }
}

/* A random block mask over (B or 1, H or 1) of query blocks of qb rows and key blocks of kb keys: each block empty,
 * partial or full; indices listed in a random order with junk past the counts. keep (B, Hq, L, S) int32: what it
 * means with the mask `causal_docs` (docs[q] == docs[kv] and q + S - L >= kv), worked out per score. */
typedef struct {
    int32_t *num, *ind, *full_num, *full_ind, *keep;
    af_tensor num_t, ind_t, full_num_t, full_ind_t, keep_t;
    af_block_mask mask;
} random_blocks;

static void make_blocks(random_blocks *r, int64_t B, int64_t Hq, int64_t L, int64_t S, int64_t qb, int64_t kb,
                        int64_t Bm, int64_t Hm, const int32_t *docs, bool with_full) {
    const int64_t nq = (L + qb - 1) / qb + 1, nk = (S + kb - 1) / kb;   /* one more query block than needed */
    r->num = calloc((size_t)(Bm * Hm * nq), 4);
    r->full_num = calloc((size_t)(Bm * Hm * nq), 4);
    r->ind = malloc((size_t)(Bm * Hm * nq * nk) * 4);
    r->full_ind = malloc((size_t)(Bm * Hm * nq * nk) * 4);
    uint8_t *cls = malloc((size_t)(Bm * Hm * nq * nk));
    for (int64_t row = 0; row < Bm * Hm * nq; row++) {
        int32_t *perm = r->ind + row * nk, *fperm = r->full_ind + row * nk;
        for (int64_t k = 0; k < nk; k++) {
            const uint64_t x = rng_next(&rng) % 8;   /* empty 3/8, partial 3/8, full 2/8; a whole empty row 1/10 */
            cls[row * nk + k] = x < 3 ? 0 : x < 6 || !with_full ? 1 : 2;
            perm[k] = (int32_t)k;
        }
        if (rng_next(&rng) % 10 == 0)
            for (int64_t k = 0; k < nk; k++) cls[row * nk + k] = 0;
        for (int64_t k = nk - 1; k > 0; k--) {   /* a random order */
            const int64_t o = (int64_t)(rng_next(&rng) % (uint64_t)(k + 1));
            const int32_t t = perm[k]; perm[k] = perm[o]; perm[o] = t;
        }
        int32_t np = 0, nf = 0;
        for (int64_t k = 0; k < nk; k++) {
            const int32_t block = perm[k];
            if (cls[row * nk + block] == 1) perm[np++] = block;
            else if (cls[row * nk + block] == 2) fperm[nf++] = block;
        }
        for (int64_t k = np; k < nk; k++) perm[k] = 1000000 + (int32_t)k;   /* junk past the count */
        for (int64_t k = nf; k < nk; k++) fperm[k] = -7;
        r->num[row] = np;
        r->full_num[row] = nf;
    }
    r->keep = malloc((size_t)(B * Hq * L * S) * 4);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hq; h++)
            for (int64_t i = 0; i < L; i++)
                for (int64_t j = 0; j < S; j++) {
                    const int64_t row = ((Bm == 1 ? 0 : b) * Hm + (Hm == 1 ? 0 : h)) * nq + i / qb;
                    const int c = cls[row * nk + j / kb];
                    const bool mask = docs[i] == docs[j] && i + S - L >= j;
                    r->keep[((b * Hq + h) * L + i) * S + j] = c == 2 || (c == 1 && mask);
                }
    free(cls);
    r->num_t = af_tensor_contiguous(r->num, AF_I32, 3, (int64_t[]){Bm, Hm, nq});
    r->ind_t = af_tensor_contiguous(r->ind, AF_I32, 4, (int64_t[]){Bm, Hm, nq, nk});
    r->full_num_t = af_tensor_contiguous(r->full_num, AF_I32, 3, (int64_t[]){Bm, Hm, nq});
    r->full_ind_t = af_tensor_contiguous(r->full_ind, AF_I32, 4, (int64_t[]){Bm, Hm, nq, nk});
    r->keep_t = af_tensor_contiguous(r->keep, AF_I32, 4, (int64_t[]){B, Hq, L, S});
    r->mask = (af_block_mask){qb, kb, &r->num_t, &r->ind_t, with_full ? &r->full_num_t : NULL,
                              with_full ? &r->full_ind_t : NULL};
}

static void free_blocks(random_blocks *r) {
    free(r->num);
    free(r->ind);
    free(r->full_num);
    free(r->full_ind);
    free(r->keep);
}

/* Block masks of block sizes that are not the tiles' (smaller, larger, odd), broadcast or per (batch, head), with
 * and without full blocks, a score_mod or none: the kernels against the reference run on the dense mask the blocks
 * mean. A mask evaluated in a full block, a block skipped that should not be, or a boundary one key off fails. */
static void block_masks_against_dense(void **state) {
    (void)state;
    const int64_t B = 2, Hq = 4, Hkv = 2, L = 150, S = 230;
    int32_t docs[230];
    for (int j = 0; j < S; j++) docs[j] = j < 61 ? 0 : j < 130 ? 1 : 2;
    af_tensor docs_t = af_tensor_contiguous(docs, AF_I32, 1, (int64_t[]){S});
    float slopes[4] = {0.5f, 0.25f, 0.125f, 0.0625f};
    af_tensor slopes_t = af_tensor_contiguous(slopes, AF_F32, 1, (int64_t[]){Hq});
    const af_mod_instr alibi[] = {LOAD1(0, H_IDX), I(AF_MOD_SUB, KV_IDX, Q_IDX, 0), I(AF_MOD_TO_F32, 6, 0, 0),
                                  I(AF_MOD_MUL, 5, 7, 0), I(AF_MOD_ADD, SCORE, 8, 0)};
    /* the mask_mod: docs[q] == docs[kv] and q + (S - L) >= kv */
    const af_mod_instr dense[] = {{.op = AF_MOD_LOAD, .in = {B_IDX, H_IDX, Q_IDX, KV_IDX}, .aux = 0}};
    struct { int64_t qb, kb, Bm, Hm; bool full, score; } cases[] = {
        {128, 128, 1, 1, true, true}, {16, 32, B, Hq, true, false}, {48, 100, 1, Hq, true, true},
        {7, 300, B, 1, false, true}, {1, 1, 1, 1, true, false}, {64, 64, B, Hq, false, false},
        {24, 63, B, Hq, true, false}, {40, 65, 1, Hq, true, true},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int decode = 0; decode < 2; decode++) {
            /* prefill rows on the products or packed tiles; decode rows (L 3) on the direct kernels */
            const int64_t rows = decode ? 3 : L;
            const af_mod_instr causal_docs[] = {LOAD1(0, Q_IDX), LOAD1(0, KV_IDX), I(AF_MOD_EQ, 5, 6, 0),
                                                K_I32(S - rows), I(AF_MOD_ADD, Q_IDX, 8, 0),
                                                I(AF_MOD_GE, 9, KV_IDX, 0), I(AF_MOD_AND, 7, 10, 0)};
            random_blocks r;
            make_blocks(&r, B, Hq, rows, S, cases[c].qb, cases[c].kb, cases[c].Bm, cases[c].Hm, docs, cases[c].full);
            const af_mod_program ref_mask = {dense, 1, &r.keep_t, 1};
            mod_case mc = {"block mask", {alibi, 5, &slopes_t, 1}, {causal_docs, 7, &docs_t, 1}, cases[c].score,
                           true, cases[c].score ? 0.5 * S : 0.0, &r.mask, &ref_mask};
            /* f32 always, f16 / bf16 in turns (all three in the light run's turns) */
            const af_dtype dtypes[2] = {AF_F32, (c + (size_t)decode) % 2 ? AF_F16 : AF_BF16};
            for (int d = light() ? 1 : 0; d < 2; d++) {
                shape_case shape = {dtypes[d], B, Hq, Hkv, rows, S, 64, 48, (tensor_layout)(c % LAYOUT_COUNT)};
                check(&shape, &mc);
            }
            free_blocks(&r);
        }
}

/* Block masks that do not match the call: each error names the tensor and the rule, nothing is written. */
static void bad_block_masks(void **state) {
    (void)state;
    float qv[2 * 8] = {0}, kvv[2 * 8] = {0}, vv[2 * 8] = {0}, out[2 * 8], lse[2 * 4];
    af_tensor q = af_tensor_contiguous(qv, AF_F32, 4, (int64_t[]){1, 2, 4, 2});
    af_tensor k = af_tensor_contiguous(kvv, AF_F32, 4, (int64_t[]){1, 2, 4, 2});
    af_tensor v = af_tensor_contiguous(vv, AF_F32, 4, (int64_t[]){1, 2, 4, 2});
    af_tensor o = af_tensor_contiguous(out, AF_F32, 4, (int64_t[]){1, 2, 4, 2});
    af_tensor l = af_tensor_contiguous(lse, AF_F32, 3, (int64_t[]){1, 2, 4});
    /* blocks of 2: 2 query blocks, 2 key blocks */
    int32_t num[2] = {1, 2}, ind[4] = {0, 0, 0, 1}, two[2] = {2, 2}, past[4] = {0, 2, 0, 1}, twice[4] = {0, 0, 1, 1};
    int32_t one[2] = {1, 1}, zero[4] = {0, 0, 0, 0}, too_many[2] = {3, 0};
    float f[2] = {1, 1};
    const int64_t s3[3] = {1, 1, 2}, s4[4] = {1, 1, 2, 2};
    af_tensor num_t = af_tensor_contiguous(num, AF_I32, 3, s3), ind_t = af_tensor_contiguous(ind, AF_I32, 4, s4);
    af_tensor two_t = af_tensor_contiguous(two, AF_I32, 3, s3), past_t = af_tensor_contiguous(past, AF_I32, 4, s4);
    af_tensor twice_t = af_tensor_contiguous(twice, AF_I32, 4, s4), one_t = af_tensor_contiguous(one, AF_I32, 3, s3);
    af_tensor zero_t = af_tensor_contiguous(zero, AF_I32, 4, s4);
    af_tensor many_t = af_tensor_contiguous(too_many, AF_I32, 3, s3);
    af_tensor float_t = af_tensor_contiguous(f, AF_F32, 3, s3);
    af_tensor short_t = af_tensor_contiguous(num, AF_I32, 3, (int64_t[]){1, 1, 1});
    af_tensor batch_t = af_tensor_contiguous(ind, AF_I32, 3, (int64_t[]){2, 1, 2});
    af_tensor heads_t = af_tensor_contiguous(ind, AF_I32, 3, (int64_t[]){1, 3, 1});
    struct { af_block_mask m; const char *expect; } bad[] = {
        {{0, 2, &num_t, &ind_t, NULL, NULL}, "block sizes 0 x 2"},
        {{2, 2, &float_t, &ind_t, NULL, NULL}, "block_mask.kv_num_blocks: is float32"},
        {{2, 2, &num_t, &num_t, NULL, NULL}, "block_mask.kv_indices: has 3 dimensions"},
        {{2, 2, &short_t, &ind_t, NULL, NULL}, "block_mask.kv_num_blocks: 1 query blocks; the call's L = 4"},
        {{2, 2, &batch_t, &ind_t, NULL, NULL}, "block_mask.kv_num_blocks: batch dim 2 must be 1 or the call's B"},
        {{2, 2, &heads_t, &ind_t, NULL, NULL}, "block_mask.kv_num_blocks: head dim 3 must be 1 or the call's Hq"},
        {{2, 2, &many_t, &ind_t, NULL, NULL}, "block_mask.kv_num_blocks: entry [0][0][0] is 3"},
        {{2, 2, &two_t, &past_t, NULL, NULL}, "block_mask.kv_indices: entry [0][0][0][1] is 2; it must lie in [0, 2)"},
        {{2, 2, &two_t, &twice_t, NULL, NULL}, "key block 0 of query block 0 (batch 0, head 0) is listed twice"},
        {{2, 2, &one_t, &zero_t, &one_t, &zero_t, }, "block_mask.full_kv_indices: key block 0 of query block 0 "
                                                     "(batch 0, head 0) is listed both as full and as partial"},
        {{2, 2, &num_t, &ind_t, &one_t, NULL}, "block_mask.full_kv_indices: must not be NULL"},
    };
    for (size_t c = 0; c < sizeof bad / sizeof bad[0]; c++) {
        af_flex_args a = {.query = &q, .key = &k, .value = &v, .block_mask = &bad[c].m};
        memset(out, 0x5A, sizeof out);
        assert_int_equal(af_flex_attn(&a, &o, &l), AF_ERR_INVALID_ARGUMENT);
        if (!strstr(af_last_error(), bad[c].expect))
            fail_msg("case %zu: '%s' does not say '%s'", c, af_last_error(), bad[c].expect);
        for (size_t i = 0; i < sizeof out; i++)
            if (((unsigned char *)out)[i] != 0x5A) fail_msg("case %zu wrote out", c);
    }
}

/* Each operation on a few values, evaluated as a one-key mask or score through af_flex_attn_reference, whose only
 * key's weight then shows the mod's value: lse = mod(score) for one key. */
static void operations_by_hand(void **state) {
    (void)state;
    float qv[2] = {0.0f, 0.0f}, kvv[2] = {0.0f, 0.0f}, vv[1] = {1.0f}, out[1], lse[1];
    af_tensor q = af_tensor_contiguous(qv, AF_F32, 4, (int64_t[]){1, 1, 1, 2});
    af_tensor k = af_tensor_contiguous(kvv, AF_F32, 4, (int64_t[]){1, 1, 1, 2});
    af_tensor v = af_tensor_contiguous(vv, AF_F32, 4, (int64_t[]){1, 1, 1, 1});
    af_tensor o = af_tensor_contiguous(out, AF_F32, 4, (int64_t[]){1, 1, 1, 1});
    af_tensor l = af_tensor_contiguous(lse, AF_F32, 3, (int64_t[]){1, 1, 1});
    /* score_mod = f(x, y) with constants x, y: lse of one key is its score */
    struct { int op; double x, y; double want; } cases[] = {
        {AF_MOD_FLOORDIV, -7.0, 2.0, -4.0}, {AF_MOD_MOD, -7.0, 2.0, 1.0}, {AF_MOD_MOD, 7.0, -2.0, -1.0},
        {AF_MOD_POW, 2.0, 10.0, 1024.0}, {AF_MOD_MIN, 3.0, -1.0, -1.0}, {AF_MOD_MAX, 3.0, -1.0, 3.0},
        {AF_MOD_ROUND, 2.5, 0.0, 2.0}, {AF_MOD_ROUND, 3.5, 0.0, 4.0}, {AF_MOD_SIGN, -0.5, 0.0, -1.0},
        {AF_MOD_FLOOR, -1.5, 0.0, -2.0}, {AF_MOD_CEIL, -1.5, 0.0, -1.0}, {AF_MOD_SIGMOID, 0.0, 0.0, 0.5},
        {AF_MOD_RSQRT, 4.0, 0.0, 0.5}, {AF_MOD_ABS, -3.0, 0.0, 3.0},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const af_mod_instr code[] = {K_F32(cases[c].x), K_F32(cases[c].y), I(cases[c].op, 5, 6, 0)};
        const af_mod_program p = {code, 3, NULL, 0};
        af_flex_args a = {.query = &q, .key = &k, .value = &v, .score_mod = &p};
        for (int kernel = 0; kernel < 2; kernel++) {
            assert_int_equal((kernel ? af_flex_attn : af_flex_attn_reference)(&a, &o, &l), AF_OK);
            if (!(fabs(lse[0] - cases[c].want) <= 1e-6 * (1.0 + fabs(cases[c].want))))   /* lse = score, rounded */
                fail_msg("operation %d on (%g, %g): %g, want %g", cases[c].op, cases[c].x, cases[c].y, lse[0],
                         cases[c].want);
        }
    }
    /* int32: Python's // and % with negative operands, and x // 0 = 0; TO_F32 carries the result to the score */
    struct { int op; int x, y, want; } ints[] = {
        {AF_MOD_FLOORDIV, -7, 2, -4}, {AF_MOD_MOD, -7, 2, 1}, {AF_MOD_MOD, 7, -2, -1}, {AF_MOD_FLOORDIV, 7, 0, 0},
        {AF_MOD_MIN, 3, -1, -1}, {AF_MOD_XOR, 6, 3, 5}, {AF_MOD_SUB, 2, 9, -7},
    };
    for (size_t c = 0; c < sizeof ints / sizeof ints[0]; c++) {
        const af_mod_instr code[] = {K_I32(ints[c].x), K_I32(ints[c].y), I(ints[c].op, 5, 6, 0),
                                     I(AF_MOD_TO_F32, 7, 0, 0)};
        const af_mod_program p = {code, 4, NULL, 0};
        af_flex_args a = {.query = &q, .key = &k, .value = &v, .score_mod = &p};
        assert_int_equal(af_flex_attn(&a, &o, &l), AF_OK);
        if (!(fabs(lse[0] - ints[c].want) <= 1e-6 * (1.0 + abs(ints[c].want))))
            fail_msg("int operation %d on (%d, %d): %g, want %d", ints[c].op, ints[c].x, ints[c].y, lse[0],
                     ints[c].want);
    }
}

/* Programs the checks refuse: the error names the program, the instruction and the rule; nothing is written. */
static void bad_programs(void **state) {
    (void)state;
    float qv[4] = {0}, kvv[8] = {0}, vv[8] = {0}, out[4], lse[2];
    af_tensor q = af_tensor_contiguous(qv, AF_F32, 4, (int64_t[]){1, 1, 2, 2});
    af_tensor k = af_tensor_contiguous(kvv, AF_F32, 4, (int64_t[]){1, 1, 4, 2});
    af_tensor v = af_tensor_contiguous(vv, AF_F32, 4, (int64_t[]){1, 1, 4, 2});
    af_tensor o = af_tensor_contiguous(out, AF_F32, 4, (int64_t[]){1, 1, 2, 2});
    af_tensor l = af_tensor_contiguous(lse, AF_F32, 3, (int64_t[]){1, 1, 2});
    int32_t small[2] = {0, 0};
    af_tensor small_t = af_tensor_contiguous(small, AF_I32, 1, (int64_t[]){2});
    af_tensor endless_t = small_t;   /* a shape and stride whose furthest offset overflows */
    endless_t.shape[0] = INT64_MAX;
    endless_t.strides[0] = 2;
    const af_mod_instr mixed[] = {K_F32(1.0), I(AF_MOD_ADD, 5, KV_IDX, 0)};
    const af_mod_instr later[] = {I(AF_MOD_ADD, SCORE, 6, 0), K_F32(1.0)};
    const af_mod_instr int_result[] = {I(AF_MOD_ADD, Q_IDX, KV_IDX, 0)};
    const af_mod_instr reads_score[] = {K_F32(0.0), I(AF_MOD_GT, SCORE, 5, 0)};
    const af_mod_instr float_load[] = {K_F32(0.0), LOAD1(0, 5), I(AF_MOD_TO_F32, 6, 0, 0)};
    const af_mod_instr out_of_range[] = {LOAD1(0, KV_IDX), K_I32(0), I(AF_MOD_EQ, 5, 6, 0)};
    const af_mod_instr unknown[] = {{.op = 999}};
    const af_mod_instr not_int[] = {K_I32(0.5)};
    struct { const af_mod_program prog; bool score; const char *expect; } bad[] = {
        {{mixed, 2, NULL, 0}, true, "instruction 1 (ADD) takes two operands of one type"},
        {{later, 2, NULL, 0}, true, "instruction 0 (ADD): operand 1 is register 6"},
        {{int_result, 1, NULL, 0}, true, "is int32; a score_mod gives float32"},
        {{reads_score, 2, NULL, 0}, false, "reads the score (register 0), which a mask_mod does not have"},
        {{float_load, 3, &small_t, 1}, true, "instruction 1 (LOAD) takes int32 indices"},
        {{unknown, 1, NULL, 0}, true, "instruction 0: unknown operation 999"},
        {{not_int, 1, NULL, 0}, true, "0.5 is not an int32"},
        {{out_of_range, 3, &small_t, 1}, false, "a LOAD read aux tensor 0 outside its shape"},
        {{out_of_range, 3, &endless_t, 1}, false, "aux tensor 0: its shape and strides reach past any memory"},
        {{NULL, 0, NULL, 0}, true, "needs 1 to 65536 instructions"},
    };
    for (size_t c = 0; c < sizeof bad / sizeof bad[0]; c++) {
        af_flex_args a = {.query = &q, .key = &k, .value = &v};
        if (bad[c].score) a.score_mod = &bad[c].prog;
        else a.mask_mod = &bad[c].prog;
        memset(out, 0x5A, sizeof out);
        memset(lse, 0x5A, sizeof lse);
        const af_status st = af_flex_attn(&a, &o, &l);
        assert_int_equal(st, AF_ERR_INVALID_ARGUMENT);
        const char *program = bad[c].score ? "score_mod" : "mask_mod";
        if (!strstr(af_last_error(), bad[c].expect) || !strstr(af_last_error(), program))
            fail_msg("case %zu: '%s' does not say '%s'", c, af_last_error(), bad[c].expect);
        for (size_t i = 0; i < sizeof out; i++)   /* a bad index, found while running, too: the outputs were staged */
            if (((unsigned char *)out)[i] != 0x5A) fail_msg("case %zu wrote out", c);
        for (size_t i = 0; i < sizeof lse; i++)
            if (((unsigned char *)lse)[i] != 0x5A) fail_msg("case %zu wrote lse", c);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(mods_against_the_reference),
        cmocka_unit_test(operations_by_hand),
        cmocka_unit_test(bad_programs),
        cmocka_unit_test(block_masks_against_dense),
        cmocka_unit_test(bad_block_masks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
