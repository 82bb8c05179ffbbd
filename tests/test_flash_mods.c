/* score_mod / mask_mod on af_flash_attn (FA4's flash_attn_func / flash_attn_varlen_func arguments): the indices are
 * each sequence's own (a packed varlen call's rows equal af_flex_attn on each sequence alone, through views into the
 * packed tensors), paged K/V give the contiguous call's bits, a mask_mod replaces causal and the window, softcap goes
 * with a mask_mod but not with a score_mod, and the backward matches its reference. f32, every ISA the machine runs. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"

#define I(op_, a_, b_, c_) {.op = (op_), .in = {(a_), (b_), (c_), 0}}
#define LOAD1(aux_, i0) {.op = AF_MOD_LOAD, .in = {(i0), 0, 0, 0}, .aux = (aux_)}
enum { SCORE = 0, B_IDX = 1, H_IDX = 2, Q_IDX = 3, KV_IDX = 4 };
enum { NSEQ = 3, HQ = 4, HKV = 2, E = 32, EV = 24 };
static const int32_t LQ[NSEQ] = {5, 40, 17}, SK[NSEQ] = {30, 40, 61};

static uint64_t state = 0x9E3779B97F4A7C15ull;
static float next_value(void) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((state >> 40) % 2001) / 1000.0f - 1.0f;
}

static float *random_floats(size_t n) {
    float *x = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) x[i] = next_value();
    return x;
}

static double max_gap(const float *a, const float *b, size_t n) {
    double gap = 0.0;
    for (size_t i = 0; i < n; i++) gap = fmax(gap, fabs((double)a[i] - b[i]));
    return gap;
}

/* ALiBi by local positions, and a bottom-right causal mask by local positions (offset[b] = S_b - L_b). */
static float slopes[HQ] = {0.5f, 0.25f, 0.125f, 0.0625f};
static const af_mod_instr alibi[] = {LOAD1(0, H_IDX), I(AF_MOD_SUB, KV_IDX, Q_IDX, 0), I(AF_MOD_TO_F32, 6, 0, 0),
                                     I(AF_MOD_MUL, 5, 7, 0), I(AF_MOD_ADD, SCORE, 8, 0)};
static const af_mod_instr local_causal[] = {LOAD1(0, B_IDX), I(AF_MOD_ADD, Q_IDX, 5, 0), I(AF_MOD_GE, 6, KV_IDX, 0)};

static void varlen_rows_are_each_sequence_alone(void **state_) {
    (void)state_;
    int32_t cu_q[NSEQ + 1] = {0}, cu_k[NSEQ + 1] = {0}, offset[NSEQ];
    for (int b = 0; b < NSEQ; b++) {
        cu_q[b + 1] = cu_q[b] + LQ[b];
        cu_k[b + 1] = cu_k[b] + SK[b];
        offset[b] = SK[b] - LQ[b];
    }
    const int64_t total_q = cu_q[NSEQ], total_k = cu_k[NSEQ];
    float *q = random_floats((size_t)(total_q * HQ * E)), *k = random_floats((size_t)(total_k * HKV * E));
    float *v = random_floats((size_t)(total_k * HKV * EV)), *out = calloc((size_t)(total_q * HQ * EV), 4);
    af_tensor qt = af_tensor_contiguous(q, AF_F32, 3, (int64_t[]){total_q, HQ, E});
    af_tensor kt = af_tensor_contiguous(k, AF_F32, 3, (int64_t[]){total_k, HKV, E});
    af_tensor vt = af_tensor_contiguous(v, AF_F32, 3, (int64_t[]){total_k, HKV, EV});
    af_tensor ot = af_tensor_contiguous(out, AF_F32, 3, (int64_t[]){total_q, HQ, EV});
    af_tensor cq = af_tensor_contiguous(cu_q, AF_I32, 1, (int64_t[]){NSEQ + 1});
    af_tensor ck = af_tensor_contiguous(cu_k, AF_I32, 1, (int64_t[]){NSEQ + 1});
    af_tensor slopes_t = af_tensor_contiguous(slopes, AF_F32, 1, (int64_t[]){HQ});
    af_tensor offset_t = af_tensor_contiguous(offset, AF_I32, 1, (int64_t[]){NSEQ});
    const af_mod_program score = {alibi, 5, &slopes_t, 1}, mask = {local_causal, 3, &offset_t, 1};
    const char *isas[] = {"portable", "avx2", "avx512"}, *before = af_get_isa();
    for (int i = 0; i < 3; i++) {
        if (!af_isa_available(isas[i])) continue;
        assert_int_equal(af_set_isa(isas[i]), AF_OK);
        af_flash_args a = {.query = &qt, .key = &kt, .value = &vt, .cu_seqlens_q = &cq, .cu_seqlens_k = &ck,
                           .max_seqlen_q = 40, .max_seqlen_k = 61, .score_mod = &score, .mask_mod = &mask};
        if (af_flash_attn(&a, &ot, NULL) != AF_OK) fail_msg("%s: %s", isas[i], af_last_error());
        for (int b = 0; b < NSEQ; b++) {   /* sequence b alone: views into the packed tensors, (1, H, L, E) */
            af_tensor fq = {q + (size_t)cu_q[b] * HQ * E, AF_F32, 4, {1, HQ, LQ[b], E}, {0, E, HQ * E, 1}, {0}};
            af_tensor fk = {k + (size_t)cu_k[b] * HKV * E, AF_F32, 4, {1, HKV, SK[b], E}, {0, E, HKV * E, 1}, {0}};
            af_tensor fv = {v + (size_t)cu_k[b] * HKV * EV, AF_F32, 4, {1, HKV, SK[b], EV}, {0, EV, HKV * EV, 1}, {0}};
            float *alone = calloc((size_t)(HQ * LQ[b] * EV), 4);
            af_tensor fo = af_tensor_contiguous(alone, AF_F32, 4, (int64_t[]){1, HQ, LQ[b], EV});
            int32_t off_b = offset[b];
            af_tensor off_t = af_tensor_contiguous(&off_b, AF_I32, 1, (int64_t[]){1});
            const af_mod_program mask_b = {local_causal, 3, &off_t, 1};
            const af_flex_args f = {.query = &fq, .key = &fk, .value = &fv, .score_mod = &score, .mask_mod = &mask_b};
            assert_int_equal(af_flex_attn(&f, &fo, NULL), AF_OK);
            double gap = 0.0;
            for (int h = 0; h < HQ; h++)
                for (int r = 0; r < LQ[b]; r++)
                    gap = fmax(gap, max_gap(out + ((size_t)(cu_q[b] + r) * HQ + h) * EV,
                                            alone + ((size_t)h * LQ[b] + r) * EV, EV));
            if (!(gap <= 1e-5)) fail_msg("%s, sequence %d: varlen rows differ from the sequence alone by %g", isas[i], b, gap);
            free(alone);
        }
    }
    assert_int_equal(af_set_isa(before), AF_OK);
    free(q);
    free(k);
    free(v);
    free(out);
}

/* Fixed-length (B, L, H, E) calls: the mask_mod replaces causal / window; paged K/V give the contiguous bits;
 * softcap with a mask_mod matches the reference, with a score_mod it is refused; the backward matches its reference. */
static void fixed_calls(void **state_) {
    (void)state_;
    enum { B = 2, L = 24, S = 48, PAGE = 8 };
    float *q = random_floats(B * L * HQ * E), *k = random_floats(B * S * HKV * E), *v = random_floats(B * S * HKV * EV);
    float *o1 = calloc(B * L * HQ * EV, 4), *o2 = calloc(B * L * HQ * EV, 4);
    af_tensor qt = af_tensor_contiguous(q, AF_F32, 4, (int64_t[]){B, L, HQ, E});
    af_tensor kt = af_tensor_contiguous(k, AF_F32, 4, (int64_t[]){B, S, HKV, E});
    af_tensor vt = af_tensor_contiguous(v, AF_F32, 4, (int64_t[]){B, S, HKV, EV});
    af_tensor o1t = af_tensor_contiguous(o1, AF_F32, 4, (int64_t[]){B, L, HQ, EV});
    af_tensor o2t = af_tensor_contiguous(o2, AF_F32, 4, (int64_t[]){B, L, HQ, EV});
    af_tensor slopes_t = af_tensor_contiguous(slopes, AF_F32, 1, (int64_t[]){HQ});
    const af_mod_instr everything[] = {I(AF_MOD_EQ, Q_IDX, Q_IDX, 0)};
    const af_mod_program score = {alibi, 5, &slopes_t, 1}, keep_all = {everything, 1, NULL, 0};
    /* the mask_mod replaces causal and the window: the same bits as neither */
    af_flash_args with = {.query = &qt, .key = &kt, .value = &vt, .causal = true, .has_window = true,
                          .window_left = 3, .window_right = 0, .score_mod = &score, .mask_mod = &keep_all};
    af_flash_args without = {.query = &qt, .key = &kt, .value = &vt, .score_mod = &score, .mask_mod = &keep_all};
    assert_int_equal(af_flash_attn(&with, &o1t, NULL), AF_OK);
    assert_int_equal(af_flash_attn(&without, &o2t, NULL), AF_OK);
    assert_memory_equal(o1, o2, B * L * HQ * EV * 4);
    /* paged K/V (pages of 8 in reversed order) against contiguous, causal with the score_mod */
    float *kp = malloc(sizeof(float) * B * S * HKV * E), *vp = malloc(sizeof(float) * B * S * HKV * EV);
    int32_t table[B][S / PAGE], used[B] = {S, S - 5};
    const int pages = B * S / PAGE;
    for (int b = 0; b < B; b++)
        for (int p = 0; p < S / PAGE; p++) {
            const int page = pages - 1 - (b * (S / PAGE) + p);
            table[b][p] = page;
            memcpy(kp + (size_t)page * PAGE * HKV * E, k + ((size_t)b * S + p * PAGE) * HKV * E, sizeof(float) * PAGE * HKV * E);
            memcpy(vp + (size_t)page * PAGE * HKV * EV, v + ((size_t)b * S + p * PAGE) * HKV * EV,
                   sizeof(float) * PAGE * HKV * EV);
        }
    af_tensor kpt = af_tensor_contiguous(kp, AF_F32, 4, (int64_t[]){pages, PAGE, HKV, E});
    af_tensor vpt = af_tensor_contiguous(vp, AF_F32, 4, (int64_t[]){pages, PAGE, HKV, EV});
    af_tensor tt = af_tensor_contiguous(table, AF_I32, 2, (int64_t[]){B, S / PAGE});
    af_tensor ut = af_tensor_contiguous(used, AF_I32, 1, (int64_t[]){B});
    af_flash_args paged = {.query = &qt, .key = &kpt, .value = &vpt, .causal = true, .seqused_k = &ut,
                           .page_table = &tt, .score_mod = &score};
    af_flash_args contiguous = {.query = &qt, .key = &kt, .value = &vt, .causal = true, .seqused_k = &ut,
                                .score_mod = &score};
    if (af_flash_attn(&paged, &o1t, NULL) != AF_OK) fail_msg("paged: %s", af_last_error());
    assert_int_equal(af_flash_attn(&contiguous, &o2t, NULL), AF_OK);
    assert_memory_equal(o1, o2, B * L * HQ * EV * 4);
    /* softcap with a mask_mod: the reference; with a score_mod: refused, naming both */
    af_flash_args capped = {.query = &qt, .key = &kt, .value = &vt, .softcap = 2.0, .mask_mod = &keep_all};
    assert_int_equal(af_flash_attn(&capped, &o1t, NULL), AF_OK);
    assert_int_equal(af_flash_attn_reference(&capped, &o2t, NULL), AF_OK);
    if (!(max_gap(o1, o2, B * L * HQ * EV) <= 2e-5)) fail_msg("softcap + mask_mod off its reference");
    capped.score_mod = &score;
    assert_int_equal(af_flash_attn(&capped, &o1t, NULL), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "softcap and score_mod cannot be used together"));
    /* the backward through the score_mod, causal: kernel against reference */
    float *lse = calloc(B * HQ * L, 4), *dout = random_floats(B * L * HQ * EV);
    float *g[3] = {calloc(B * L * HQ * E, 4), calloc(B * S * HKV * E, 4), calloc(B * S * HKV * EV, 4)};
    float *r[3] = {calloc(B * L * HQ * E, 4), calloc(B * S * HKV * E, 4), calloc(B * S * HKV * EV, 4)};
    const size_t n[3] = {B * L * HQ * E, B * S * HKV * E, B * S * HKV * EV};
    af_tensor lt = af_tensor_contiguous(lse, AF_F32, 3, (int64_t[]){B, HQ, L});
    af_tensor dt = af_tensor_contiguous(dout, AF_F32, 4, (int64_t[]){B, L, HQ, EV});
    af_tensor gt[3] = {af_tensor_contiguous(g[0], AF_F32, 4, qt.shape), af_tensor_contiguous(g[1], AF_F32, 4, kt.shape),
                       af_tensor_contiguous(g[2], AF_F32, 4, vt.shape)};
    af_tensor rt[3] = {af_tensor_contiguous(r[0], AF_F32, 4, qt.shape), af_tensor_contiguous(r[1], AF_F32, 4, kt.shape),
                       af_tensor_contiguous(r[2], AF_F32, 4, vt.shape)};
    af_flash_args causal = {.query = &qt, .key = &kt, .value = &vt, .causal = true, .score_mod = &score};
    assert_int_equal(af_flash_attn(&causal, &o1t, &lt), AF_OK);
    const af_backward_inputs in = {&o1t, &dt, &lt};
    const af_gradients grads = {&gt[0], &gt[1], &gt[2], NULL}, ref = {&rt[0], &rt[1], &rt[2], NULL};
    if (af_flash_attn_backward(&causal, &in, &grads) != AF_OK) fail_msg("backward: %s", af_last_error());
    assert_int_equal(af_flash_attn_backward_reference(&causal, &in, &ref), AF_OK);
    for (int t = 0; t < 3; t++) {
        double scale = 0.0;
        for (size_t e = 0; e < n[t]; e++) scale = fmax(scale, fabs(r[t][e]));
        if (!(max_gap(g[t], r[t], n[t]) <= 1e-4 * scale)) fail_msg("backward: gradient %d off its reference", t);
    }
    /* LOADs the analysis cannot prove inside the slopes: staged outputs. Read inside (slopes[int(score · 0)], the
     * first slope): the bits of the same mod proven inside (slopes[0]); read outside (slopes[h + 1], the last
     * head's): the call fails and out, lse and the gradients keep what they held */
    const af_mod_instr first_unproven[] = {{.op = AF_MOD_CONST_F32, .imm = 0.0}, I(AF_MOD_MUL, SCORE, 5, 0),
                                           I(AF_MOD_TO_I32, 6, 0, 0), LOAD1(0, 7), I(AF_MOD_ADD, SCORE, 8, 0)};
    const af_mod_instr first_proven[] = {{.op = AF_MOD_CONST_I32, .imm = 0.0}, LOAD1(0, 5), I(AF_MOD_ADD, SCORE, 6, 0)};
    const af_mod_instr next_head[] = {{.op = AF_MOD_CONST_I32, .imm = 1.0}, I(AF_MOD_ADD, H_IDX, 5, 0), LOAD1(0, 6),
                                      I(AF_MOD_ADD, SCORE, 7, 0)};
    const af_mod_program unproven = {first_unproven, 5, &slopes_t, 1}, proven = {first_proven, 3, &slopes_t, 1};
    const af_mod_program past = {next_head, 4, &slopes_t, 1};
    af_flash_args staged = {.query = &qt, .key = &kt, .value = &vt, .causal = true, .score_mod = &unproven};
    assert_int_equal(af_flash_attn(&staged, &o1t, &lt), AF_OK);
    staged.score_mod = &proven;
    assert_int_equal(af_flash_attn(&staged, &o2t, NULL), AF_OK);
    assert_memory_equal(o1, o2, B * L * HQ * EV * 4);
    staged.score_mod = &unproven;   /* its backward, staged, against the reference */
    if (af_flash_attn_backward(&staged, &in, &grads) != AF_OK) fail_msg("staged backward: %s", af_last_error());
    assert_int_equal(af_flash_attn_backward_reference(&staged, &in, &ref), AF_OK);
    for (int t = 0; t < 3; t++) {
        double scale = 0.0;
        for (size_t e = 0; e < n[t]; e++) scale = fmax(scale, fabs(r[t][e]));
        if (!(max_gap(g[t], r[t], n[t]) <= 1e-4 * scale)) fail_msg("staged backward: gradient %d off", t);
    }
    staged.score_mod = &past;
    memset(o1, 0x5A, B * L * HQ * EV * 4);
    memset(lse, 0x5A, B * HQ * L * 4);
    memcpy(o2, o1, B * L * HQ * EV * 4);
    assert_int_equal(af_flash_attn(&staged, &o1t, &lt), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "score_mod: a LOAD read aux tensor 0 outside its shape"));
    assert_memory_equal(o1, o2, B * L * HQ * EV * 4);
    for (int i = 0; i < B * HQ * L; i++) assert_int_equal(((uint32_t *)lse)[i], 0x5A5A5A5Au);
    for (int t = 0; t < 3; t++) memset(g[t], 0x5A, n[t] * 4);
    assert_int_equal(af_flash_attn_backward(&staged, &in, &grads), AF_ERR_INVALID_ARGUMENT);
    for (int t = 0; t < 3; t++)
        for (size_t e = 0; e < n[t]; e++) assert_int_equal(((uint32_t *)g[t])[e], 0x5A5A5A5Au);
    for (int t = 0; t < 3; t++) {
        free(g[t]);
        free(r[t]);
    }
    free(lse);
    free(dout);
    free(kp);
    free(vp);
    free(q);
    free(k);
    free(v);
    free(o1);
    free(o2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(varlen_rows_are_each_sequence_alone),
        cmocka_unit_test(fixed_calls),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
