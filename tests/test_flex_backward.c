/* af_flex_attn_backward: dq, dk, dv through score_mods whose derivatives take the chain rule over their operations
 * (a bias, softcap by tanh, a product of the score with itself, a leaky where, SiLU through sigmoid, max), masks and
 * block masks, against af_flex_attn_backward_reference (double arithmetic around the same programs' values and
 * tangents) on every ISA and the emulated AMX products, f32 / bf16, grouped heads, Ev != E, prefill and decode
 * rows; 1 and 2 threads give the same bits. Whether a derivative rule is PyTorch's is the Python suite's business
 * (python/tests/test_flex_backward.py, against autograd). */
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
#include "test_tensor.h"
#include "ukernel_amx_emulated.h"

#define I(op_, a_, b_, c_) {.op = (op_), .in = {(a_), (b_), (c_), 0}}
#define K_F32(v) {.op = AF_MOD_CONST_F32, .imm = (v)}
#define K_I32(v) {.op = AF_MOD_CONST_I32, .imm = (v)}
#define LOAD1(aux_, i0) {.op = AF_MOD_LOAD, .in = {(i0), 0, 0, 0}, .aux = (aux_)}
enum { SCORE = 0, B_IDX = 1, H_IDX = 2, Q_IDX = 3, KV_IDX = 4 };

static test_rng rng = {0x7E57F1E8BACC0001ull};

static bool light(void) { return getenv("ATTNFORGE_TEST_LIGHT") != NULL; }

/* max |a - b| over max |b| (0 when both are 0) of two float32 tensors of n elements. */
static double relative_gap(const test_tensor *a, const test_tensor *b, const int64_t *shape) {
    double gap = 0.0, scale = 0.0;
    int64_t idx[4] = {0, 0, 0, 0};
    do {
        const double x = tt_get(a, idx), y = tt_get(b, idx);
        gap = fmax(gap, fabs(x - y));
        scale = fmax(scale, fabs(y));
        if (x != x) return INFINITY;
    } while (tt_next_index(4, shape, idx));
    return scale > 0.0 ? gap / scale : gap;
}

/* The score_mod's captured tensors' gradients (when `daux`): float32 tensors of their shapes, the kernel's and the
 * reference's. */
typedef struct {
    int n;
    test_tensor t[4], ref[4];
    af_tensor *views[4], *ref_views[4];
} aux_grads;

static void aux_alloc(aux_grads *g, const af_mod_program *score, bool daux) {
    memset(g, 0, sizeof *g);
    if (!daux || !score) return;
    g->n = score->n_aux;
    for (int a = 0; a < g->n; a++) {
        assert_true(tt_alloc(&g->t[a], AF_F32, score->aux[a].ndim, score->aux[a].shape, LAYOUT_CONTIGUOUS, &rng) &&
                    tt_alloc(&g->ref[a], AF_F32, score->aux[a].ndim, score->aux[a].shape, LAYOUT_CONTIGUOUS, &rng));
        g->views[a] = &g->t[a].view;
        g->ref_views[a] = &g->ref[a].view;
    }
}

static double flat_gap(const test_tensor *a, const test_tensor *b) {
    const float *x = (const float *)a->view.data, *y = (const float *)b->view.data;
    int64_t n = 1;
    for (int k = 0; k < a->view.ndim; k++) n *= a->view.shape[k];
    double gap = 0.0, scale = 0.0;
    for (int64_t e = 0; e < n; e++) {
        if (x[e] != x[e]) return INFINITY;
        gap = fmax(gap, fabs((double)x[e] - y[e]));
        scale = fmax(scale, fabs((double)y[e]));
    }
    return scale > 0.0 ? gap / scale : gap;
}

static void check(const char *name, af_dtype dtype, int64_t L, const af_mod_program *score,
                  const af_mod_program *mask, const af_block_mask *blocks, bool daux) {
    const int64_t B = 2, Hq = 4, Hkv = 2, S = 150, E = 32, Ev = 48;
    const int64_t qs[4] = {B, Hq, L, E}, ks[4] = {B, Hkv, S, E}, vs[4] = {B, Hkv, S, Ev}, os[4] = {B, Hq, L, Ev};
    test_tensor q, k, v, out, lse, dout, g[3], ref[3];
    assert_true(tt_alloc(&q, dtype, 4, qs, LAYOUT_NHD, &rng) && tt_alloc(&k, dtype, 4, ks, LAYOUT_CONTIGUOUS, &rng) &&
                tt_alloc(&v, dtype, 4, vs, LAYOUT_SLICED, &rng) && tt_alloc(&out, dtype, 4, os, LAYOUT_CONTIGUOUS, &rng) &&
                tt_alloc(&lse, AF_F32, 3, (int64_t[]){B, Hq, L}, LAYOUT_CONTIGUOUS, &rng) &&
                tt_alloc(&dout, dtype, 4, os, LAYOUT_CONTIGUOUS, &rng));
    const int64_t *shapes[3] = {qs, ks, vs};
    for (int t = 0; t < 3; t++)
        assert_true(tt_alloc(&g[t], AF_F32, 4, shapes[t], LAYOUT_CONTIGUOUS, &rng) &&
                    tt_alloc(&ref[t], AF_F32, 4, shapes[t], LAYOUT_CONTIGUOUS, &rng));
    tt_fill_uniform(&q, &rng, 1.0);
    tt_fill_uniform(&k, &rng, 1.0);
    tt_fill_uniform(&v, &rng, 1.0);
    tt_fill_uniform(&dout, &rng, 1.0);
    const af_flex_args a = {.query = &q.view, .key = &k.view, .value = &v.view, .score_mod = score, .mask_mod = mask,
                            .block_mask = blocks};
    if (af_flex_attn(&a, &out.view, &lse.view) != AF_OK) fail_msg("%s forward: %s", name, af_last_error());
    const af_backward_inputs in = {.out = &out.view, .dout = &dout.view, .lse = &lse.view};
    const af_gradients ref_grads = {&ref[0].view, &ref[1].view, &ref[2].view, NULL};
    aux_grads ag;
    aux_alloc(&ag, score, daux);
    if (af_flex_attn_backward_reference(&a, &in, &ref_grads, ag.n ? ag.ref_views : NULL) != AF_OK)
        fail_msg("%s reference: %s", name, af_last_error());
    const af_gradients grads = {&g[0].view, &g[1].view, &g[2].view, NULL};
    const double tol = dtype == AF_F32 ? 2e-5 : 4e-2;
    const char *names[3] = {"dq", "dk", "dv"};
    const char *before = af_get_isa();
    for (int i = 0; i < AF_TEST_KERNELS; i++) {
        const char *isa = af_test_kernel_select(i);
        if (!isa) continue;
        unsigned char *first[3] = {NULL, NULL, NULL}, *first_aux[4] = {NULL, NULL, NULL, NULL};
        for (int threads = 1; threads <= 2; threads++) {
            af_set_num_threads(threads);
            if (af_flex_attn_backward(&a, &in, &grads, ag.n ? ag.views : NULL) != AF_OK)
                fail_msg("%s, %s: %s", name, isa, af_last_error());
            for (int t = 0; t < ag.n; t++) {
                const double gap = flat_gap(&ag.t[t], &ag.ref[t]);
                if (!(gap <= (dtype == AF_F32 ? 1e-4 : 4e-2)))
                    fail_msg("%s, %s, %s, %d threads: the gradient of captured tensor %d off the reference by %.3g "
                             "of its largest element", name, isa, af_dtype_name(dtype), threads, t, gap);
                if (!first_aux[t]) {
                    first_aux[t] = malloc(ag.t[t].bytes);
                    memcpy(first_aux[t], ag.t[t].memory, ag.t[t].bytes);
                } else if (memcmp(first_aux[t], ag.t[t].memory, ag.t[t].bytes) != 0) {
                    fail_msg("%s, %s: captured tensor %d's gradient differs between 1 and 2 threads", name, isa, t);
                }
            }
            for (int t = 0; t < 3; t++) {
                const double gap = relative_gap(&g[t], &ref[t], shapes[t]);
                if (!(gap <= tol))
                    fail_msg("%s, %s, %s, %d threads: %s off the reference by %.3g of its largest element (bound "
                             "%.3g)", name, isa, af_dtype_name(dtype), threads, names[t], gap, tol);
                if (!first[t]) {
                    first[t] = malloc(g[t].bytes);
                    memcpy(first[t], g[t].memory, g[t].bytes);
                } else if (memcmp(first[t], g[t].memory, g[t].bytes) != 0) {
                    fail_msg("%s, %s: %s differs between 1 and 2 threads", name, isa, names[t]);
                }
            }
        }
        for (int t = 0; t < 3; t++) free(first[t]);
        for (int t = 0; t < 4; t++) free(first_aux[t]);
        af_test_kernel_done(i, before);
    }
    af_set_num_threads(0);
    assert_int_equal(af_set_isa(before), AF_OK);
    test_tensor *all[] = {&q, &k, &v, &out, &lse, &dout, &g[0], &g[1], &g[2], &ref[0], &ref[1], &ref[2]};
    for (size_t t = 0; t < sizeof all / sizeof all[0]; t++) tt_free(all[t]);
    for (int t = 0; t < ag.n; t++) {
        tt_free(&ag.t[t]);
        tt_free(&ag.ref[t]);
    }
}

static void gradients_against_the_reference(void **state) {
    (void)state;
    float slopes[4] = {0.5f, 0.25f, 0.125f, 0.0625f};
    af_tensor slopes_t = af_tensor_contiguous(slopes, AF_F32, 1, (int64_t[]){4});
    const af_mod_instr alibi[] = {LOAD1(0, H_IDX), I(AF_MOD_SUB, KV_IDX, Q_IDX, 0), I(AF_MOD_TO_F32, 6, 0, 0),
                                  K_F32(0.05), I(AF_MOD_MUL, 7, 8, 0), I(AF_MOD_MUL, 5, 9, 0),
                                  I(AF_MOD_ADD, SCORE, 10, 0)};
    const af_mod_instr softcap[] = {K_F32(0.5), I(AF_MOD_DIV, SCORE, 5, 0), I(AF_MOD_TANH, 6, 0, 0),
                                    I(AF_MOD_MUL, 7, 5, 0)};
    /* score + 0.3·score² */
    const af_mod_instr square[] = {I(AF_MOD_MUL, SCORE, SCORE, 0), K_F32(0.3), I(AF_MOD_MUL, 5, 6, 0),
                                   I(AF_MOD_ADD, SCORE, 7, 0)};
    /* where(score > 0, score, 0.25·score) */
    const af_mod_instr leaky[] = {K_F32(0.0), I(AF_MOD_GT, SCORE, 5, 0), K_F32(0.25), I(AF_MOD_MUL, SCORE, 7, 0),
                                  I(AF_MOD_WHERE, 6, SCORE, 8)};
    /* score·sigmoid(score), then max with -0.1 */
    const af_mod_instr silu_max[] = {I(AF_MOD_SIGMOID, SCORE, 0, 0), I(AF_MOD_MUL, SCORE, 5, 0), K_F32(-0.1),
                                     I(AF_MOD_MAX, 6, 7, 0)};
    const af_mod_instr causal[] = {I(AF_MOD_GE, Q_IDX, KV_IDX, 0)};
    /* (kv + h) % 3 != 0 */
    const af_mod_instr stripes[] = {I(AF_MOD_ADD, KV_IDX, H_IDX, 0), K_I32(3), I(AF_MOD_MOD, 5, 6, 0), K_I32(0),
                                    I(AF_MOD_NE, 7, 8, 0)};
    const af_mod_program p_alibi = {alibi, 7, &slopes_t, 1}, p_softcap = {softcap, 4, NULL, 0};
    const af_mod_program p_square = {square, 4, NULL, 0}, p_leaky = {leaky, 5, NULL, 0};
    const af_mod_program p_silu = {silu_max, 4, NULL, 0}, p_causal = {causal, 1, NULL, 0};
    const af_mod_program p_stripes = {stripes, 5, NULL, 0};
    /* ALiBi as traced (score + slope·float(kv − q)): the shape the fused kernel takes (src/flex/fused.c) */
    const af_mod_instr alibi_fused[] = {LOAD1(0, H_IDX), I(AF_MOD_SUB, KV_IDX, Q_IDX, 0), I(AF_MOD_TO_F32, 6, 0, 0),
                                        I(AF_MOD_MUL, 5, 7, 0), I(AF_MOD_ADD, SCORE, 8, 0)};
    const af_mod_program p_alibi_fused = {alibi_fused, 5, &slopes_t, 1};
    /* a block mask of blocks 16 x 32 over (1, 1): query block q sees key blocks q % 5 (partial) and 1 (full) */
    int32_t num[8], ind[8 * 5], fnum[8], find[8 * 5];
    for (int qb = 0; qb < 8; qb++) {
        num[qb] = 1;
        fnum[qb] = qb % 5 == 1 ? 0 : 1;
        for (int k = 0; k < 5; k++) ind[qb * 5 + k] = find[qb * 5 + k] = k;
        ind[qb * 5] = qb % 5;   /* entries past the counts are ignored */
        find[qb * 5] = 1;
    }
    af_tensor num_t = af_tensor_contiguous(num, AF_I32, 3, (int64_t[]){1, 1, 8});
    af_tensor ind_t = af_tensor_contiguous(ind, AF_I32, 4, (int64_t[]){1, 1, 8, 5});
    af_tensor fnum_t = af_tensor_contiguous(fnum, AF_I32, 3, (int64_t[]){1, 1, 8});
    af_tensor find_t = af_tensor_contiguous(find, AF_I32, 4, (int64_t[]){1, 1, 8, 5});
    const af_block_mask blocks = {16, 32, &num_t, &ind_t, &fnum_t, &find_t};
    struct { const char *name; const af_mod_program *score, *mask; const af_block_mask *blocks; } cases[] = {
        {"alibi", &p_alibi, NULL, NULL},
        {"softcap by tanh", &p_softcap, NULL, NULL},
        {"score + 0.3 score^2", &p_square, &p_causal, NULL},
        {"leaky where", &p_leaky, &p_stripes, NULL},
        {"silu, max", &p_silu, NULL, NULL},
        {"alibi, block mask", &p_alibi, &p_stripes, &blocks},
        {"alibi (fused), block mask", &p_alibi_fused, &p_stripes, &blocks},
        {"mask only", NULL, &p_stripes, NULL},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int d = 0; d < 2; d++) {
            if (light() && d != (int)(c % 2)) continue;
            const af_dtype dtype = d ? AF_BF16 : AF_F32;
            check(cases[c].name, dtype, 120, cases[c].score, cases[c].mask, cases[c].blocks, false);
            check(cases[c].name, dtype, 3, cases[c].score, cases[c].mask, cases[c].blocks, false);
        }
}

/* Learnable tensors the score_mod loads: ALiBi slopes by head (one value per row), a bias table by (head, key) in
 * bf16, a relative-position table loaded twice (two loads' gradients summed), under a mask and a block mask. */
static void captured_tensor_gradients(void **state) {
    (void)state;
    float slopes[4] = {0.5f, 0.25f, 0.125f, 0.0625f}, rel[300];
    uint16_t table[4 * 150];
    for (int i = 0; i < 300; i++) rel[i] = (float)((i * 37) % 11) * 0.05f - 0.25f;
    for (int i = 0; i < 4 * 150; i++) table[i] = (uint16_t)(0x3E00u + (uint16_t)(i % 29) * 5u);   /* bf16 ~0.1..0.5 */
    af_tensor slopes_t = af_tensor_contiguous(slopes, AF_F32, 1, (int64_t[]){4});
    af_tensor table_t = af_tensor_contiguous(table, AF_BF16, 2, (int64_t[]){4, 150});
    af_tensor rel_t = af_tensor_contiguous(rel, AF_F32, 1, (int64_t[]){300});
    /* score + slope[h]·(kv - q)/20 */
    const af_mod_instr alibi[] = {LOAD1(0, H_IDX), I(AF_MOD_SUB, KV_IDX, Q_IDX, 0), I(AF_MOD_TO_F32, 6, 0, 0),
                                  K_F32(0.05), I(AF_MOD_MUL, 7, 8, 0), I(AF_MOD_MUL, 5, 9, 0),
                                  I(AF_MOD_ADD, SCORE, 10, 0)};
    /* score·(1 + table[h, kv]) */
    const af_mod_instr table_mul[] = {{.op = AF_MOD_LOAD, .in = {H_IDX, KV_IDX}, .aux = 0}, K_F32(1.0),
                                      I(AF_MOD_ADD, 5, 6, 0), I(AF_MOD_MUL, SCORE, 7, 0)};
    /* score + rel[kv - q + 150] + 0.5·rel[q]² */
    const af_mod_instr rel_twice[] = {I(AF_MOD_SUB, KV_IDX, Q_IDX, 0), K_I32(150), I(AF_MOD_ADD, 5, 6, 0),
                                      LOAD1(0, 7), LOAD1(0, Q_IDX), I(AF_MOD_MUL, 9, 9, 0), K_F32(0.5),
                                      I(AF_MOD_MUL, 10, 11, 0), I(AF_MOD_ADD, SCORE, 8, 0), I(AF_MOD_ADD, 13, 12, 0)};
    const af_mod_instr causal[] = {I(AF_MOD_GE, Q_IDX, KV_IDX, 0)};
    const af_mod_program p_alibi = {alibi, 7, &slopes_t, 1}, p_table = {table_mul, 4, &table_t, 1};
    const af_mod_program p_rel = {rel_twice, 10, &rel_t, 1}, p_causal = {causal, 1, NULL, 0};
    const struct { const char *name; const af_mod_program *score, *mask; } cases[] = {
        {"learnable ALiBi slopes", &p_alibi, &p_causal}, {"bias table (bf16)", &p_table, NULL},
        {"relative table, two loads", &p_rel, &p_causal},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int d = 0; d < 2; d++) {
            if (light() && d != (int)(c % 2)) continue;
            check(cases[c].name, d ? AF_BF16 : AF_F32, 120, cases[c].score, cases[c].mask, NULL, true);
            check(cases[c].name, d ? AF_BF16 : AF_F32, 3, cases[c].score, cases[c].mask, NULL, true);
        }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(gradients_against_the_reference),
        cmocka_unit_test(captured_tensor_gradients),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
