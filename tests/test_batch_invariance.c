/* A sequence's output and lse are bitwise the same whatever it is batched with (issue 46's batch invariant): alone in
 * a plain call, or packed into a varlen batch among decodes and prefill chunks of other lengths (which change the
 * longest sequence, hence the kernels the call could pick, and the batch size, hence how split-KV cuts the keys), at
 * 1 or 2 threads, with its K/V in a (B,S,H,E) cache (heads interleaved: direct items span every kv head) or a
 * (B,H,S,E) one. Every ISA this machine runs and the emulated AMX tile products, f32 / f16 / bf16, causal, windowed
 * or full, for decode rows (the direct kernels, split-KV over long caches) and for prefill chunks (the products). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"
#include "core/dtype.h"
#include "kernel/dispatch_testing.h"
#include "test_tensor.h"
#include "ukernel_amx_emulated.h"

#define MAX_SEQS 6

typedef struct {
    af_dtype dtype;
    int64_t Hq, Hkv, E, Ev;
    int64_t L[MAX_SEQS], S[MAX_SEQS];   /* the batch's sequences; `target` is the one checked */
    int n, target;
    bool causal, window;
} batch_case;

typedef struct {
    void *q, *k, *v;            /* packed: (total_q, Hq, E), (total_k, Hkv, E / Ev) */
    void *k_hsd, *v_hsd;        /* the target's K/V as (1, Hkv, S, E / Ev) memory */
    int32_t cu_q[MAX_SEQS + 1], cu_k[MAX_SEQS + 1];
    int64_t total_q, total_k, max_q, max_k;
} batch_data;

static test_rng rng = {0x2545F4914F6CDD1Dull};

static void build(const batch_case *c, batch_data *d) {
    const size_t el = af_dtype_size(c->dtype);
    d->cu_q[0] = d->cu_k[0] = 0;
    d->max_q = d->max_k = 0;
    for (int s = 0; s < c->n; s++) {
        d->cu_q[s + 1] = d->cu_q[s] + (int32_t)c->L[s];
        d->cu_k[s + 1] = d->cu_k[s] + (int32_t)c->S[s];
        if (c->L[s] > d->max_q) d->max_q = c->L[s];
        if (c->S[s] > d->max_k) d->max_k = c->S[s];
    }
    d->total_q = d->cu_q[c->n];
    d->total_k = d->cu_k[c->n];
    d->q = test_zalloc((size_t)(d->total_q * c->Hq * c->E) * el);
    d->k = test_zalloc((size_t)(d->total_k * c->Hkv * c->E) * el);
    d->v = test_zalloc((size_t)(d->total_k * c->Hkv * c->Ev) * el);
    rng_fill_values(&rng, d->q, c->dtype, d->total_q * c->Hq * c->E);
    rng_fill_values(&rng, d->k, c->dtype, d->total_k * c->Hkv * c->E);
    rng_fill_values(&rng, d->v, c->dtype, d->total_k * c->Hkv * c->Ev);
    const int64_t S = c->S[c->target], k0 = d->cu_k[c->target];
    d->k_hsd = test_zalloc((size_t)(S * c->Hkv * c->E) * el);
    d->v_hsd = test_zalloc((size_t)(S * c->Hkv * c->Ev) * el);
    for (int64_t j = 0; j < S; j++)
        for (int64_t h = 0; h < c->Hkv; h++) {
            memcpy((char *)d->k_hsd + (size_t)((h * S + j) * c->E) * el,
                   (char *)d->k + (size_t)(((k0 + j) * c->Hkv + h) * c->E) * el, (size_t)c->E * el);
            memcpy((char *)d->v_hsd + (size_t)((h * S + j) * c->Ev) * el,
                   (char *)d->v + (size_t)(((k0 + j) * c->Hkv + h) * c->Ev) * el, (size_t)c->Ev * el);
        }
}

static void release(batch_data *d) {
    void *all[] = {d->q, d->k, d->v, d->k_hsd, d->v_hsd};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

typedef enum { AS_BATCH, ALONE_BSHE, ALONE_BHSE } call_form;

/* The target's rows: out (L, Hq, Ev) in the dtype and lse (Hq, L), malloc'd, from one call in `form`. */
static void run(const batch_case *c, const batch_data *d, call_form form, unsigned char **out, float **lse) {
    const size_t el = af_dtype_size(c->dtype);
    const int t = c->target;
    const int64_t L = c->L[t], S = c->S[t], q0 = d->cu_q[t], k0 = d->cu_k[t];
    af_tensor q, k, v, o, l, cu_q, cu_k;
    af_flash_args a = {.query = &q, .key = &k, .value = &v, .causal = c->causal, .has_window = c->window,
                       .window_left = 700, .window_right = c->causal ? 0 : 300};
    const int64_t rows = form == AS_BATCH ? d->total_q : L;
    unsigned char *o_all = test_zalloc((size_t)(rows * c->Hq * c->Ev) * el);
    float *l_all = test_zalloc(sizeof(float) * (size_t)(rows * c->Hq));
    if (form == AS_BATCH) {
        q = af_tensor_contiguous(d->q, c->dtype, 3, (int64_t[]){d->total_q, c->Hq, c->E});
        k = af_tensor_contiguous(d->k, c->dtype, 3, (int64_t[]){d->total_k, c->Hkv, c->E});
        v = af_tensor_contiguous(d->v, c->dtype, 3, (int64_t[]){d->total_k, c->Hkv, c->Ev});
        cu_q = af_tensor_contiguous((void *)d->cu_q, AF_I32, 1, (int64_t[]){c->n + 1});
        cu_k = af_tensor_contiguous((void *)d->cu_k, AF_I32, 1, (int64_t[]){c->n + 1});
        a.cu_seqlens_q = &cu_q;
        a.cu_seqlens_k = &cu_k;
        a.max_seqlen_q = d->max_q;
        a.max_seqlen_k = d->max_k;
        o = af_tensor_contiguous(o_all, c->dtype, 3, (int64_t[]){d->total_q, c->Hq, c->Ev});
        l = af_tensor_contiguous(l_all, AF_F32, 2, (int64_t[]){c->Hq, d->total_q});
    } else {
        q = af_tensor_contiguous((char *)d->q + (size_t)(q0 * c->Hq * c->E) * el, c->dtype, 4,
                                 (int64_t[]){1, L, c->Hq, c->E});
        if (form == ALONE_BSHE) {
            k = af_tensor_contiguous((char *)d->k + (size_t)(k0 * c->Hkv * c->E) * el, c->dtype, 4,
                                     (int64_t[]){1, S, c->Hkv, c->E});
            v = af_tensor_contiguous((char *)d->v + (size_t)(k0 * c->Hkv * c->Ev) * el, c->dtype, 4,
                                     (int64_t[]){1, S, c->Hkv, c->Ev});
        } else {   /* (B, S, H, E) views of (B, H, S, E) memory */
            k = af_tensor_contiguous(d->k_hsd, c->dtype, 4, (int64_t[]){1, S, c->Hkv, c->E});
            v = af_tensor_contiguous(d->v_hsd, c->dtype, 4, (int64_t[]){1, S, c->Hkv, c->Ev});
            const int64_t ks[4] = {c->Hkv * S * c->E, c->E, S * c->E, 1}, vs[4] = {c->Hkv * S * c->Ev, c->Ev, S * c->Ev, 1};
            memcpy(k.strides, ks, sizeof ks);
            memcpy(v.strides, vs, sizeof vs);
        }
        o = af_tensor_contiguous(o_all, c->dtype, 4, (int64_t[]){1, L, c->Hq, c->Ev});
        l = af_tensor_contiguous(l_all, AF_F32, 3, (int64_t[]){1, c->Hq, L});
    }
    if (af_flash_attn(&a, &o, &l) != AF_OK) fail_msg("form %d: %s", (int)form, af_last_error());
    const int64_t first = form == AS_BATCH ? q0 : 0;
    *out = test_zalloc((size_t)(L * c->Hq * c->Ev) * el);
    *lse = test_zalloc(sizeof(float) * (size_t)(L * c->Hq));
    memcpy(*out, o_all + (size_t)(first * c->Hq * c->Ev) * el, (size_t)(L * c->Hq * c->Ev) * el);
    for (int64_t h = 0; h < c->Hq; h++) memcpy(*lse + h * L, l_all + h * rows + first, sizeof(float) * (size_t)L);
    free(o_all);
    free(l_all);
}

/* Under valgrind (scripts/valgrind-tests.sh sets ATTNFORGE_TEST_LIGHT): one thread count, fewer and shorter
 * sequences, the emulated AMX products once (they are slow there), enough keys still to split. */
static bool light(void) { return getenv("ATTNFORGE_TEST_LIGHT") != NULL; }

/* The target alone at 1 thread is the reference; every other form and thread count must give its bits. */
static void same_bits(const batch_case *c, const batch_data *d, const char *isa) {
    const size_t out_bytes = (size_t)(c->L[c->target] * c->Hq * c->Ev) * af_dtype_size(c->dtype);
    const size_t lse_bytes = sizeof(float) * (size_t)(c->L[c->target] * c->Hq);
    unsigned char *ref_out, *out;
    float *ref_lse, *lse;
    af_set_num_threads(1);
    run(c, d, ALONE_BSHE, &ref_out, &ref_lse);
    for (int threads = 1; threads <= (light() ? 1 : 2); threads++) {
        af_set_num_threads(threads);
        for (int f = 0; f < 3; f++) {
            if (f == ALONE_BSHE && threads == 1) continue;
            run(c, d, (call_form)f, &out, &lse);
            if (memcmp(ref_out, out, out_bytes) != 0 || memcmp(ref_lse, lse, lse_bytes) != 0)
                fail_msg("%s, %d threads, %s, target L %lld S %lld of %d sequences, causal %d, window %d: %s differs "
                         "from the sequence alone", isa, threads, af_dtype_name(c->dtype),
                         (long long)c->L[c->target], (long long)c->S[c->target], c->n, c->causal, c->window,
                         f == AS_BATCH ? "inside the varlen batch" : f == ALONE_BSHE ? "alone at 2 threads"
                                                                                     : "alone over (B,H,S,E) K/V");
            free(out);
            free(lse);
        }
    }
    free(ref_out);
    free(ref_lse);
    af_set_num_threads(0);
}

static void check_case(const batch_case *c) {
    batch_data d;
    build(c, &d);
    const char *before = af_get_isa();
    const char *isas[] = {"portable", "avx2", "avx512", "amx"};
    for (size_t i = 0; i < sizeof isas / sizeof isas[0]; i++) {
        if (!af_isa_available(isas[i])) continue;
        assert_int_equal(af_set_isa(isas[i]), AF_OK);
        same_bits(c, &d, isas[i]);
    }
    if (!light() || c->dtype == AF_BF16) {   /* the AMX tile products on emulated tiles (only bf16 reaches them) */
        af_ukernel_force_for_tests(af_ukernel_amx_emulated());
        same_bits(c, &d, "amx-emulated");
        af_ukernel_force_for_tests(NULL);
    }
    assert_int_equal(af_set_isa(before), AF_OK);
    release(&d);
}

/* Random batches around a target: decodes over long caches (split-KV cuts them by the batch), short chunks, and a
 * prefill chunk long enough that the call's longest sequence runs on the products. */
static void random_batches(void **state) {
    (void)state;
    const af_dtype dtypes[3] = {AF_F32, AF_F16, AF_BF16};
    const int64_t target_rows[3] = {1, 3, 40};   /* decode (direct, split-KV), a short chunk, a prefill chunk */
    for (int round = 0; round < (light() ? 3 : 6); round++) {
        batch_case c = {.dtype = dtypes[round % 3], .Hq = 8, .Hkv = round % 2 ? 2 : 4, .E = 64, .Ev = round % 2 ? 32 : 64,
                        .causal = round % 3 != 1, .window = round % 4 == 3};
        c.n = (int)rng_range(&rng, 2, light() ? 3 : MAX_SEQS);
        c.target = (int)rng_range(&rng, 0, c.n - 1);
        const int64_t most = light() ? 400 : 2600;
        for (int s = 0; s < c.n; s++) {
            const int kind = (int)rng_range(&rng, 0, 2);
            c.L[s] = kind == 0 ? 1 : kind == 1 ? rng_range(&rng, 2, 5) : rng_range(&rng, 20, 70);
            c.S[s] = c.L[s] + rng_range(&rng, 0, most);
        }
        c.L[c.target] = target_rows[round % 3];
        /* more than two key chunks: split-KV alone */
        c.S[c.target] = c.L[c.target] + rng_range(&rng, 1100, light() ? 1200 : 2600);
        check_case(&c);
    }
}

/* af_set_phase_invariant: row i of a causal prefill over S keys, row i of a chunked-prefill call (the last rows of
 * the same keys) and a decode step over keys [0, i] give the same bits; the decode of a long cache splits its keys. */
static void decode_rows_as_prefill_rows(void **state) {
    (void)state;
    const af_dtype dtypes[3] = {AF_F32, AF_F16, AF_BF16};
    for (int d = light() ? 2 : 0; d < 3; d++) {   /* under valgrind: bf16 alone, the one dtype every kernel takes */
        const int64_t S = light() ? 1100 : 1300, chunk = light() ? 40 : 300, rows_checked[3] = {S - 1, S - 2, S - chunk};
        batch_case c = {.dtype = dtypes[d], .Hq = 8, .Hkv = 2, .E = 64, .Ev = 48, .causal = true, .window = d == 1,
                        .n = 3, .target = 0};
        /* sequence 0: the prefill; 1: the chunk, its last rows; 2: the same keys again (replaced below) */
        c.L[0] = S, c.S[0] = S, c.L[1] = chunk, c.S[1] = S, c.L[2] = 1, c.S[2] = S;
        batch_data b;
        build(&c, &b);
        const size_t el = af_dtype_size(c.dtype);
        /* every sequence reads the prefill's keys and queries: copy them over the others' */
        for (int s = 1; s < 3; s++) {
            memcpy((char *)b.k + (size_t)(b.cu_k[s] * c.Hkv * c.E) * el, b.k, (size_t)(S * c.Hkv * c.E) * el);
            memcpy((char *)b.v + (size_t)(b.cu_k[s] * c.Hkv * c.Ev) * el, b.v, (size_t)(S * c.Hkv * c.Ev) * el);
            memcpy((char *)b.q + (size_t)(b.cu_q[s] * c.Hq * c.E) * el,
                   (char *)b.q + (size_t)((S - c.L[s]) * c.Hq * c.E) * el, (size_t)(c.L[s] * c.Hq * c.E) * el);
        }
        af_set_phase_invariant(true);
        const char *before = af_get_isa();
        for (int isa = light() ? 1 : 0; isa < 5; isa++) {   /* under valgrind: no portable (slow, and no products) */
            const char *names[] = {"portable", "avx2", "avx512", "amx", "amx-emulated"};
            if (isa < 4 && !af_isa_available(names[isa])) continue;
            if (isa < 4) assert_int_equal(af_set_isa(names[isa]), AF_OK);
            else af_ukernel_force_for_tests(af_ukernel_amx_emulated());
            for (int threads = 1; threads <= (light() ? 1 : 2); threads++) {
                af_set_num_threads(threads);
                unsigned char *prefill_out = NULL, *chunk_out, *step_out;
                float *prefill_lse = NULL, *chunk_lse, *step_lse;
                c.target = 0;   /* under valgrind the whole prefill is too slow: the chunked prefill stands for it */
                if (!light()) run(&c, &b, ALONE_BSHE, &prefill_out, &prefill_lse);
                c.target = 1;
                run(&c, &b, ALONE_BSHE, &chunk_out, &chunk_lse);
                const size_t row_bytes = (size_t)(c.Hq * c.Ev) * el;
                for (int r = 0; r < 3; r++) {
                    const int64_t i = rows_checked[r];
                    batch_case step = c;   /* one decode step: the query of row i over keys [0, i] */
                    step.n = 1;
                    step.target = 0;
                    step.L[0] = 1;
                    step.S[0] = i + 1;
                    batch_data sb = b;
                    sb.q = (char *)b.q + (size_t)(i * c.Hq * c.E) * el;
                    run(&step, &sb, ALONE_BSHE, &step_out, &step_lse);
                    const unsigned char *in_chunk = chunk_out + (size_t)(i - (S - chunk)) * row_bytes;
                    bool lse_same = true;
                    for (int64_t h = 0; h < c.Hq; h++)
                        lse_same = lse_same && (!prefill_lse || prefill_lse[h * S + i] == step_lse[h]) &&
                                   chunk_lse[h * chunk + i - (S - chunk)] == step_lse[h];
                    if ((prefill_out && memcmp(prefill_out + (size_t)i * row_bytes, step_out, row_bytes) != 0) ||
                        memcmp(in_chunk, step_out, row_bytes) != 0 || !lse_same)
                        fail_msg("%s, %d threads, %s, window %d: the decode step of row %lld differs from the row in "
                                 "the prefill or the chunked prefill", names[isa], threads, af_dtype_name(c.dtype),
                                 c.window, (long long)i);
                    free(step_out);
                    free(step_lse);
                }
                free(prefill_out);
                free(prefill_lse);
                free(chunk_out);
                free(chunk_lse);
            }
            if (isa == 4) af_ukernel_force_for_tests(NULL);
        }
        af_set_phase_invariant(false);
        af_set_num_threads(0);
        assert_int_equal(af_set_isa(before), AF_OK);
        release(&b);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(random_batches),
        cmocka_unit_test(decode_rows_as_prefill_rows),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
