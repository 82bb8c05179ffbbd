/* af_flash_attn's meaning and edges: the reference against values worked out by hand (windows, bottom-right
 * alignment, softcap, sinks, FA4's window normalisation, paged = contiguous), the kernels on the named edge cases
 * of issue 12 (window 0 / >= S, softcap with logits of ±1e4, dominating sinks, empty rows and sequences, page size
 * 1, pages shared and out of order), and af_flash_attn without its features equal to af_sdpa bit for bit. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "attnforge.h"
#include "case_gen.h"
#include "flash_case.h"

/* ------------------------------------------------------------------------------------------ by hand */

/* Tiny f32 NHD tensors, B = H = 1: q (1, L, 1, 1), k (1, S, 1, 1), v (1, S, 1, S) one-hot (v_j = e_j), so out row i
 * is row i's softmax weights themselves. */
typedef struct {
    float q[8], k[8], v[64], out[64], lse[8];
    af_tensor tq, tk, tv, tout, tlse;
    af_flash_args args;
    int64_t L, S;
} tiny;

static void tiny_init(tiny *t, int64_t L, int64_t S, const float *q, const float *k) {
    memset(t, 0, sizeof *t);
    t->L = L;
    t->S = S;
    for (int64_t i = 0; i < L; i++) t->q[i] = q ? q[i] : 0.0f;
    for (int64_t j = 0; j < S; j++) t->k[j] = k ? k[j] : 0.0f;
    for (int64_t j = 0; j < S; j++) t->v[j * S + j] = 1.0f;
    const int64_t qs[4] = {1, L, 1, 1}, ks[4] = {1, S, 1, 1}, vs[4] = {1, S, 1, S}, os[4] = {1, L, 1, S};
    const int64_t ls[3] = {1, 1, L};
    t->tq = af_tensor_contiguous(t->q, AF_F32, 4, qs);
    t->tk = af_tensor_contiguous(t->k, AF_F32, 4, ks);
    t->tv = af_tensor_contiguous(t->v, AF_F32, 4, vs);
    t->tout = af_tensor_contiguous(t->out, AF_F32, 4, os);
    t->tlse = af_tensor_contiguous(t->lse, AF_F32, 3, ls);
    t->args = (af_flash_args){.query = &t->tq, .key = &t->tk, .value = &t->tv, .has_scale = true, .scale = 1.0};
}

/* Run the reference, then the kernels on every ISA, and compare both with the expected weights and lse. */
static void tiny_expect(tiny *t, const double *weights, const double *lse) {
    const char *isas[CASE_MAX_ISAS];
    const int n = case_isas(isas, CASE_MAX_ISAS);
    for (int run = -1; run < n; run++) {
        memset(t->out, 0x55, sizeof t->out);
        af_status st;
        if (run < 0) {
            st = af_flash_attn_reference(&t->args, &t->tout, &t->tlse);
        } else {
            assert_int_equal(af_set_isa(isas[run]), AF_OK);
            st = af_flash_attn(&t->args, &t->tout, &t->tlse);
        }
        if (st != AF_OK) fail_msg("%s: %s", af_status_name(st), af_last_error());
        for (int64_t i = 0; i < t->L; i++) {
            for (int64_t j = 0; j < t->S; j++)
                if (fabs(t->out[i * t->S + j] - weights[i * t->S + j]) > 2e-6)
                    fail_msg("%s: out[%lld][%lld] = %.9g, expected %.9g", run < 0 ? "reference" : isas[run],
                             (long long)i, (long long)j, t->out[i * t->S + j], weights[i * t->S + j]);
            const bool same = isinf(lse[i]) ? t->lse[i] == lse[i] : fabs(t->lse[i] - lse[i]) <= 2e-6;
            if (!same) fail_msg("%s: lse[%lld] = %.9g, expected %.9g", run < 0 ? "reference" : isas[run], (long long)i,
                                t->lse[i], lse[i]);
        }
    }
}

/* All scores 0: a row's weights are uniform over the keys it sees. */
static void uniform_rows(int64_t L, int64_t S, const int64_t *lo, const int64_t *hi, double *w, double *lse) {
    for (int64_t i = 0; i < L; i++) {
        const int64_t n = hi[i] - lo[i];
        for (int64_t j = 0; j < S; j++) w[i * S + j] = j >= lo[i] && j < hi[i] ? 1.0 / (double)n : 0.0;
        lse[i] = n > 0 ? log((double)n) : -INFINITY;
    }
}

static void window_sliding_by_hand(void **state) {
    (void)state;
    tiny t;
    tiny_init(&t, 4, 4, NULL, NULL);
    t.args.has_window = true;
    t.args.window_left = 1;   /* row i sees keys i - 1 .. i */
    t.args.window_right = 0;
    const int64_t lo[4] = {0, 0, 1, 2}, hi[4] = {1, 2, 3, 4};
    double w[16], lse[4];
    uniform_rows(4, 4, lo, hi, w, lse);
    tiny_expect(&t, w, lse);
}

static void causal_bottom_right_by_hand(void **state) {
    (void)state;
    tiny t;   /* L = 2, S = 5: FA4's example, mask [1 1 1 1 0; 1 1 1 1 1] */
    tiny_init(&t, 2, 5, NULL, NULL);
    t.args.causal = true;
    const int64_t lo[2] = {0, 0}, hi[2] = {4, 5};
    double w[10], lse[2];
    uniform_rows(2, 5, lo, hi, w, lse);
    tiny_expect(&t, w, lse);
    tiny_init(&t, 5, 2, NULL, NULL);   /* L = 5, S = 2: the first 3 rows see nothing: out 0, lse -inf */
    t.args.causal = true;
    const int64_t lo2[5] = {0, 0, 0, 0, 0}, hi2[5] = {0, 0, 0, 1, 2};
    double w2[10], lse2[5];
    uniform_rows(5, 2, lo2, hi2, w2, lse2);
    tiny_expect(&t, w2, lse2);
}

/* FA4's windows on L = S = 3, each row's visible keys given by hand ([lo, hi)): sides are literal offsets from the
 * diagonal, negative ones too, AF_WINDOW_UNBOUNDED (FA4's None) alone is unbounded; both sides bounded with
 * left + right < 0 is no window ((-1, 0), (0, -1), (-1, -1), (-3, 1); causal then stays causal); causal sets
 * right = 0. */
static void window_normalisation_by_hand(void **state) {
    (void)state;
    enum { U = 0 };   /* stands for AF_WINDOW_UNBOUNDED in the table below */
    const struct {
        int64_t left, right;
        bool left_unbounded, right_unbounded, causal;
        int64_t lo[3], hi[3];
    } cases[] = {
        {-1, 0, false, false, false, {0, 0, 0}, {3, 3, 3}},    /* sum < 0: dropped */
        {0, -1, false, false, false, {0, 0, 0}, {3, 3, 3}},
        {-1, -1, false, false, false, {0, 0, 0}, {3, 3, 3}},
        {-3, 1, false, false, false, {0, 0, 0}, {3, 3, 3}},
        {-1, 0, false, false, true, {0, 0, 0}, {1, 2, 3}},     /* dropped, causal stays */
        {-1, 1, false, false, false, {1, 2, 3}, {2, 3, 3}},    /* sum 0: keys d + 1 .. d + 1 */
        {U, -1, true, false, false, {0, 0, 0}, {0, 1, 2}},     /* keys up to one before the diagonal */
        {U, -2, true, false, false, {0, 0, 0}, {0, 0, 1}},
        {-1, U, false, true, false, {1, 2, 3}, {3, 3, 3}},     /* keys from one past the diagonal */
        {2, -1, false, false, false, {0, 0, 0}, {0, 1, 2}},    /* keys d - 2 .. d - 1 */
        {2, -1, false, false, true, {0, 0, 0}, {1, 2, 3}},     /* causal: right = 0, keys d - 2 .. d */
        {-2, 5, false, false, false, {2, 3, 3}, {3, 3, 3}},    /* keys d + 2 .. d + 5 */
        {U, U, true, true, false, {0, 0, 0}, {3, 3, 3}},       /* no limit either side */
        {U, 0, true, false, false, {0, 0, 0}, {1, 2, 3}},      /* (None, 0) is causal */
        {1, U, false, true, true, {0, 0, 1}, {1, 2, 3}},       /* causal + left 1 */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        tiny t;
        tiny_init(&t, 3, 3, NULL, NULL);
        t.args.has_window = true;
        t.args.window_left = cases[c].left_unbounded ? AF_WINDOW_UNBOUNDED : cases[c].left;
        t.args.window_right = cases[c].right_unbounded ? AF_WINDOW_UNBOUNDED : cases[c].right;
        t.args.causal = cases[c].causal;
        double w[9], lse[3];
        uniform_rows(3, 3, cases[c].lo, cases[c].hi, w, lse);
        tiny_expect(&t, w, lse);
    }
}

/* Scores s_j = q·k_j: softcap c·tanh(s/c); a sink σ adds e^σ to the denominator only; lse = ln(sum). */
static void softcap_and_sink_by_hand(void **state) {
    (void)state;
    const float q[1] = {1.0f}, k[3] = {10.0f, 0.0f, -4.0f};
    tiny t;
    tiny_init(&t, 1, 3, q, k);
    t.args.softcap = 5.0;
    float sink = 1.5f;
    const int64_t hs[1] = {1};
    af_tensor ts = af_tensor_contiguous(&sink, AF_F32, 1, hs);
    t.args.learnable_sink = &ts;
    const double s[3] = {5.0 * tanh(2.0), 0.0, 5.0 * tanh(-0.8)};
    const double sum = exp(s[0]) + exp(s[1]) + exp(s[2]) + exp(1.5);
    double w[3], lse[1] = {log(sum)};
    for (int j = 0; j < 3; j++) w[j] = exp(s[j]) / sum;
    tiny_expect(&t, w, lse);
    /* no key: out 0, lse = the sink (FA4) */
    tiny_init(&t, 1, 0, q, NULL);
    t.args.learnable_sink = &ts;
    double none[1] = {0.0}, lse_sink[1] = {1.5};
    tiny_expect(&t, none, lse_sink);
}

/* The reference reads paged K/V where the page table says: pages of 2 keys in random order give the same bits as
 * the contiguous keys. */
static void paged_reference_reads_the_table(void **state) {
    (void)state;
    flash_case c = flash_case_default(1, 2, 1, 3, 7, 4, 4);
    flash_tensors fixed, paged;
    assert_true(flash_case_build(&c, &fixed));
    c.kv = KV_PAGED;
    c.page_size = 2;
    c.seqused = true;
    assert_true(flash_case_build(&c, &paged));
    memcpy(paged.q32.memory, fixed.q32.memory, fixed.q32.bytes);   /* the same queries (same shape, contiguous) */
    /* copy the fixed keys into the pages the table names */
    for (int64_t j = 0; j < 7; j++) {
        const int64_t pt_idx[2] = {0, j / 2};
        const int64_t page = (int64_t)tt_get(&paged.page_table, pt_idx);
        for (int64_t e = 0; e < 4; e++) {
            const int64_t from[4] = {0, j, 0, e}, to[4] = {page, j % 2, 0, e};
            tt_set(&paged.k32, to, tt_get(&fixed.k32, from));
            tt_set(&paged.v32, to, tt_get(&fixed.v32, from));
        }
    }
    assert_true(flash_case_rerun_reference(&paged));
    assert_memory_equal(paged.ref_out.memory, fixed.ref_out.memory, fixed.ref_out.bytes);
    flash_case_free(&fixed);
    flash_case_free(&paged);
}

/* FA4: page_table without seqused_k gives every sequence max_pages · page_size keys, each page read where the table
 * says. Pages of 3 keys, 2 per sequence: the same result as the fixed (B, 6, Hkv, E) keys gathered from those pages
 * (reference and every kernel ISA), and the same bits as seqused_k = 6 given explicitly. */
static void paged_without_seqused_k(void **state) {
    (void)state;
    enum { B = 2, Hq = 2, Hkv = 1, E = 8, PS = 3, MP = 2, NP = 5, S = PS * MP, L = 4 };
    static float q[B * L * Hq * E], kp[NP * PS * Hkv * E], vp[NP * PS * Hkv * E], kf[B * S * Hkv * E],
        vf[B * S * Hkv * E], out_fixed[B * L * Hq * E], out_paged[B * L * Hq * E], out_used[B * L * Hq * E];
    const int32_t table[B * MP] = {3, 0, 1, 4}, used[B] = {S, S};
    test_rng rng = {42};
    for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) q[i] = (float)(2.0 * rng_uniform(&rng) - 1.0);
    for (size_t i = 0; i < sizeof kp / sizeof kp[0]; i++) {
        kp[i] = (float)(2.0 * rng_uniform(&rng) - 1.0);
        vp[i] = (float)(2.0 * rng_uniform(&rng) - 1.0);
    }
    for (int b = 0; b < B; b++)   /* key j of sequence b: row j % PS of page table[b][j / PS] */
        for (int j = 0; j < S; j++)
            for (int e = 0; e < Hkv * E; e++) {
                kf[(b * S + j) * Hkv * E + e] = kp[(table[b * MP + j / PS] * PS + j % PS) * Hkv * E + e];
                vf[(b * S + j) * Hkv * E + e] = vp[(table[b * MP + j / PS] * PS + j % PS) * Hkv * E + e];
            }
    const int64_t qs[4] = {B, L, Hq, E}, ps[4] = {NP, PS, Hkv, E}, fs[4] = {B, S, Hkv, E}, ts[2] = {B, MP},
                  us[1] = {B};
    af_tensor tq = af_tensor_contiguous(q, AF_F32, 4, qs), tkp = af_tensor_contiguous(kp, AF_F32, 4, ps),
              tvp = af_tensor_contiguous(vp, AF_F32, 4, ps), tkf = af_tensor_contiguous(kf, AF_F32, 4, fs),
              tvf = af_tensor_contiguous(vf, AF_F32, 4, fs), tt = af_tensor_contiguous((void *)table, AF_I32, 2, ts),
              tu = af_tensor_contiguous((void *)used, AF_I32, 1, us), tof = af_tensor_contiguous(out_fixed, AF_F32, 4, qs),
              top = af_tensor_contiguous(out_paged, AF_F32, 4, qs), tou = af_tensor_contiguous(out_used, AF_F32, 4, qs);
    const af_flash_args fixed = {.query = &tq, .key = &tkf, .value = &tvf, .causal = true};
    af_flash_args paged = {.query = &tq, .key = &tkp, .value = &tvp, .causal = true, .page_table = &tt};
    const char *isas[CASE_MAX_ISAS];
    const int n = case_isas(isas, CASE_MAX_ISAS);
    for (int run = -1; run < n; run++) {
        if (run >= 0) assert_int_equal(af_set_isa(isas[run]), AF_OK);
        af_status (*call)(const af_flash_args *, af_tensor *, af_tensor *) = run < 0 ? af_flash_attn_reference
                                                                                     : af_flash_attn;
        paged.seqused_k = NULL;
        if (call(&fixed, &tof, NULL) != AF_OK || call(&paged, &top, NULL) != AF_OK)
            fail_msg("%s: %s", run < 0 ? "reference" : isas[run], af_last_error());
        paged.seqused_k = &tu;
        if (call(&paged, &tou, NULL) != AF_OK) fail_msg("%s", af_last_error());
        for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) {
            if (fabsf(out_paged[i] - out_fixed[i]) > 1e-6f)
                fail_msg("%s: out[%zu] paged %.9g, fixed %.9g", run < 0 ? "reference" : isas[run], i, out_paged[i],
                         out_fixed[i]);
            if (memcmp(&out_paged[i], &out_used[i], sizeof(float)) != 0)
                fail_msg("%s: out[%zu] %.9g without seqused_k, %.9g with it", run < 0 ? "reference" : isas[run], i,
                         out_paged[i], out_used[i]);
        }
    }
}

/* ------------------------------------------------------------------------------------------ kernel edges */

static void verify(flash_case *c) {
    char why[2048];
    if (!flash_case_build_and_verify(c, why, sizeof why)) fail_msg("%s", why);
}

static void windows_at_the_edges(void **state) {
    (void)state;
    const int64_t sides[][2] = {{0, 0}, {0, -1}, {-1, 0}, {3, 2}, {200, 200}, {INT64_MAX, 0}, {0, INT64_MAX},
                                {INT64_MAX, -1}, {INT64_MAX, -90}, {-1, INT64_MAX}, {-70, 100}, {5, -3},
                                {INT64_MIN, INT64_MAX}, {INT64_MAX, INT64_MIN}, {INT64_MIN + 1, 3}, {-149, 150}};
    for (size_t i = 0; i < sizeof sides / sizeof sides[0]; i++)
        for (int causal = 0; causal < 2; causal++) {
            flash_case c = flash_case_default(2, 4, 2, 70, 150, 32, 32);
            c.has_window = true;
            c.left = sides[i][0];
            c.right = sides[i][1];
            c.causal = causal;
            verify(&c);
        }
}

/* A long sequence with a window: rows far apart see disjoint keys; many row blocks each skip most tiles. */
static void window_on_a_long_sequence(void **state) {
    (void)state;
    flash_case c = flash_case_default(1, 2, 1, 300, 1200, 16, 16);
    c.has_window = true;
    c.left = 40;
    c.right = 5;
    verify(&c);
}

static void softcap_with_huge_logits(void **state) {
    (void)state;
    for (int d = 0; d < 3; d++) {
        flash_case c = flash_case_default(1, 2, 2, 20, 50, 16, 16);
        c.dtype = (af_dtype)d;
        c.softcap = 30.0;
        c.has_scale = true;
        c.scale = 1.0;
        c.amplitude = 25.0;   /* |q·k| up to 1e4 */
        verify(&c);
    }
}

static void sinks_dominating_and_on_empty_rows(void **state) {
    (void)state;
    flash_case c = flash_case_default(1, 4, 2, 12, 5, 8, 8);
    c.sink = true;
    c.sink_offset = 12.0;   /* e^12 against at most a few e^1: the keys barely count */
    verify(&c);
    c.causal = true;        /* L > S bottom-right: 7 rows see no key, out 0, lse = sink */
    c.sink_offset = 0.0;
    verify(&c);
    c.Sk[0] = c.S_stored[0] = 0;   /* no key at all */
    verify(&c);
}

static void varlen_with_empty_sequences(void **state) {
    (void)state;
    flash_case c = flash_case_default(5, 4, 1, 0, 0, 16, 24);
    const int64_t L[5] = {0, 7, 3, 0, 20}, S[5] = {9, 0, 30, 0, 20};
    for (int b = 0; b < 5; b++) c.Lq[b] = L[b], c.Sk[b] = c.S_stored[b] = S[b];
    c.varlen_q = true;
    c.kv = KV_VARLEN;
    c.causal = true;
    verify(&c);
    c.sink = true;
    verify(&c);
}

static void paged_page_sizes(void **state) {
    (void)state;
    const int64_t sizes[] = {1, 5, 16, 100};
    for (int i = 0; i < 4; i++) {
        flash_case c = flash_case_default(3, 4, 2, 3, 0, 32, 32);
        const int64_t S[3] = {130, 41, 77};
        for (int b = 0; b < 3; b++) c.S_stored[b] = S[b], c.Sk[b] = S[b] - b * 10;   /* seqused_k < capacity */
        c.kv = KV_PAGED;
        c.seqused = true;
        c.page_size = sizes[i];
        c.shared_page = true;
        c.dtype = (af_dtype)(i % 3);
        verify(&c);
        for (int b = 0; b < 3; b++) c.Lq[b] = 40;   /* prefill over pages: packed tiles gathered page by page */
        verify(&c);
    }
}

/* Decode over interleaved kv heads: items of up to 32 heads (Hkv = 40 makes a chunk of 32 and one of 8) with split-KV,
 * rows wide enough that a tile shrinks to 16 keys (f32, E = 256), pages that end inside a tile, causal and windowed
 * rows of a few query positions (some rows skip a tile). */
static void decode_over_many_and_wide_heads(void **state) {
    (void)state;
    for (int form = 0; form < 2; form++) {
        flash_case c = flash_case_default(2, 40, 40, 1, 1100, 32, 32);   /* split-KV: S > 1024 */
        c.dtype = AF_F16;
        c.kv = form ? KV_PAGED : KV_FIXED;
        c.seqused = form == 1;
        c.page_size = 7;
        verify(&c);

        c = flash_case_default(2, 8, 8, 1, 300, 256, 256);
        c.kv = form ? KV_PAGED : KV_FIXED;
        c.seqused = form == 1;
        c.page_size = 5;
        verify(&c);
        for (int b = 0; b < 2; b++) c.Lq[b] = 3;
        c.causal = true;
        c.has_window = true;
        c.left = 150, c.right = 0;
        verify(&c);
    }
}

/* ------------------------------------------------------------------------------------------ == af_sdpa */

/* A (B, seq, H, D) view as (B, H, seq, D): the same memory. */
static af_tensor as_bhsd(const af_tensor *t) {
    af_tensor v = *t;
    v.shape[1] = t->shape[2]; v.shape[2] = t->shape[1];
    v.strides[1] = t->strides[2]; v.strides[2] = t->strides[1];
    return v;
}

static void plain_calls_equal_sdpa(void **state) {
    (void)state;
    for (int i = 0; i < 12; i++) {
        flash_case c = flash_case_default(2, i % 2 ? 4 : 2, 2, 1 + 17 * i % 90, 3 + 29 * i % 200, 8 + 8 * (i % 4), 16);
        c.dtype = (af_dtype)(i % 3);
        c.causal = i % 3 == 0;
        c.has_scale = i % 4 == 1;
        c.scale = -0.3;
        c.q_layout = (tensor_layout)(i % LAYOUT_COUNT);
        c.kv_layout = (tensor_layout)((i + 1) % LAYOUT_COUNT);
        flash_tensors t;
        assert_true(flash_case_build(&c, &t));
        af_tensor q = as_bhsd(&t.q.view), k = as_bhsd(&t.k.view), v = as_bhsd(&t.v.view);
        test_rng rng = {5};
        test_tensor out2, lse2;
        assert_true(tt_alloc(&out2, c.dtype, 4, t.out.view.shape, LAYOUT_CONTIGUOUS, &rng));
        assert_true(tt_alloc(&lse2, AF_F32, 3, t.lse.view.shape, LAYOUT_CONTIGUOUS, &rng));
        af_tensor o2 = as_bhsd(&out2.view);
        const af_sdpa_args sd = {.query = &q, .key = &k, .value = &v, .causal_bottom_right = c.causal,
                                 .enable_gqa = c.Hq != c.Hkv, .has_scale = c.has_scale, .scale = c.scale};
        const char *isas[CASE_MAX_ISAS];
        const int n = case_isas(isas, CASE_MAX_ISAS);
        for (int s = 0; s < n; s++) {
            assert_int_equal(af_set_isa(isas[s]), AF_OK);
            assert_int_equal(af_sdpa(&sd, &o2, &lse2.view), AF_OK);
            assert_int_equal(af_flash_attn(&t.args, &t.out.view, &t.lse.view), AF_OK);
            int64_t idx[4] = {0};
            do {
                const double a = tt_get(&t.out, idx), b = tt_get(&out2, idx);   /* out2's own view is NHD */
                if (memcmp(&a, &b, sizeof a) != 0 && !(isnan(a) && isnan(b)))
                    fail_msg("isa %s case %d: flash %.9g != sdpa %.9g", isas[s], i, a, b);
            } while (tt_next_index(4, t.out.view.shape, idx));
            int64_t li[3] = {0};
            if (tt_numel(&lse2) > 0) do {
                    const double a = tt_get(&t.lse, li), b = tt_get(&lse2, li);
                    if (memcmp(&a, &b, sizeof a) != 0) fail_msg("isa %s case %d: lse %.9g != %.9g", isas[s], i, a, b);
                } while (tt_next_index(3, lse2.view.shape, li));
        }
        tt_free(&out2);
        tt_free(&lse2);
        flash_case_free(&t);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(window_sliding_by_hand),
        cmocka_unit_test(causal_bottom_right_by_hand),
        cmocka_unit_test(window_normalisation_by_hand),
        cmocka_unit_test(paged_without_seqused_k),
        cmocka_unit_test(softcap_and_sink_by_hand),
        cmocka_unit_test(paged_reference_reads_the_table),
        cmocka_unit_test(windows_at_the_edges),
        cmocka_unit_test(window_on_a_long_sequence),
        cmocka_unit_test(softcap_with_huge_logits),
        cmocka_unit_test(sinks_dominating_and_on_empty_rows),
        cmocka_unit_test(varlen_with_empty_sequences),
        cmocka_unit_test(paged_page_sizes),
        cmocka_unit_test(decode_over_many_and_wide_heads),
        cmocka_unit_test(plain_calls_equal_sdpa),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
