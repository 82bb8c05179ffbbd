/* A row's output and lse are bitwise the same whether its K/V are one contiguous cache, pages of any size in any order
 * (page_table + seqused_k), or packed varlen sequences (cu_seqlens_k), on every ISA this machine runs and on the
 * emulated AMX tile products, at 1 and 2 threads, in f32, f16 and bf16 (issue 46's first invariant, for prefill and
 * decode). The products (AVX512-BF16, AMX) read a tile from one base: paged tiles are copied page run by page run
 * into a staging tile first, so the packed operands, and with them every bit, are the contiguous cache's. */
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

typedef struct {
    af_dtype dtype;
    int64_t B, L, Hq, Hkv, E, Ev, page;
    int64_t S[3];          /* keys of each sequence (B <= 3); the cache holds max S rounded up to whole pages */
    bool causal, window;
} layout_case;

typedef struct {
    void *q, *k, *v, *kp, *vp, *kc, *vc, *out, *lse;
    int32_t *table, *used, *cu_k;
    int64_t S_max, pages_per_seq, total_k;
    size_t out_bytes, lse_bytes;
} buffers;

static test_rng rng = {0x9E3779B97F4A7C15ull};

/* The same keys three ways: a (B, S_max, Hkv, D) cache, pages of `page` keys shuffled over the pool, and packed
 * (total_k, Hkv, D) sequences. */
static void build(const layout_case *c, buffers *b) {
    const size_t el = af_dtype_size(c->dtype);
    b->S_max = 0;
    b->total_k = 0;
    for (int64_t s = 0; s < c->B; s++) {
        if (c->S[s] > b->S_max) b->S_max = c->S[s];
        b->total_k += c->S[s];
    }
    b->pages_per_seq = (b->S_max + c->page - 1) / c->page;
    const int64_t S_cache = b->pages_per_seq * c->page;
    const int64_t kd = c->Hkv * c->E, vd = c->Hkv * c->Ev;
    b->q = test_zalloc((size_t)(c->B * c->L * c->Hq * c->E) * el);
    b->k = test_zalloc((size_t)(c->B * S_cache * kd) * el);
    b->v = test_zalloc((size_t)(c->B * S_cache * vd) * el);
    rng_fill_values(&rng, b->q, c->dtype, c->B * c->L * c->Hq * c->E);
    rng_fill_values(&rng, b->k, c->dtype, c->B * S_cache * kd);
    rng_fill_values(&rng, b->v, c->dtype, c->B * S_cache * vd);
    const int64_t pool = c->B * b->pages_per_seq;
    int64_t *order = test_zalloc(sizeof(int64_t) * (size_t)pool);
    for (int64_t i = 0; i < pool; i++) order[i] = i;
    for (int64_t i = pool - 1; i > 0; i--) {   /* shuffled page order */
        const int64_t j = rng_range(&rng, 0, i), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    b->kp = test_zalloc((size_t)(pool * c->page * kd) * el);
    b->vp = test_zalloc((size_t)(pool * c->page * vd) * el);
    b->table = test_zalloc(sizeof(int32_t) * (size_t)pool);
    b->used = test_zalloc(sizeof(int32_t) * (size_t)c->B);
    for (int64_t s = 0; s < c->B; s++) {
        b->used[s] = (int32_t)c->S[s];
        for (int64_t g = 0; g < b->pages_per_seq; g++) {
            const int64_t slot = order[s * b->pages_per_seq + g];
            b->table[s * b->pages_per_seq + g] = (int32_t)slot;
            memcpy((char *)b->kp + (size_t)(slot * c->page * kd) * el,
                   (char *)b->k + (size_t)((s * S_cache + g * c->page) * kd) * el, (size_t)(c->page * kd) * el);
            memcpy((char *)b->vp + (size_t)(slot * c->page * vd) * el,
                   (char *)b->v + (size_t)((s * S_cache + g * c->page) * vd) * el, (size_t)(c->page * vd) * el);
        }
    }
    free(order);
    b->kc = test_zalloc((size_t)(b->total_k * kd) * el);
    b->vc = test_zalloc((size_t)(b->total_k * vd) * el);
    b->cu_k = test_zalloc(sizeof(int32_t) * (size_t)(c->B + 1));
    for (int64_t s = 0, at = 0; s < c->B; s++) {
        memcpy((char *)b->kc + (size_t)(at * kd) * el, (char *)b->k + (size_t)(s * S_cache * kd) * el,
               (size_t)(c->S[s] * kd) * el);
        memcpy((char *)b->vc + (size_t)(at * vd) * el, (char *)b->v + (size_t)(s * S_cache * vd) * el,
               (size_t)(c->S[s] * vd) * el);
        at += c->S[s];
        b->cu_k[s + 1] = (int32_t)at;
    }
    b->out_bytes = (size_t)(c->B * c->L * c->Hq * c->Ev) * el;
    b->lse_bytes = sizeof(float) * (size_t)(c->B * c->Hq * c->L);
    b->out = test_zalloc(b->out_bytes);
    b->lse = test_zalloc(b->lse_bytes);
}

static void release(buffers *b) {
    void *all[] = {b->q, b->k, b->v, b->kp, b->vp, b->kc, b->vc, b->out, b->lse, b->table, b->used, b->cu_k};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

typedef enum { KV_CONTIGUOUS, KV_PAGED, KV_PACKED } kv_form;

/* One call with K/V in `form`; out and lse copied into `out` / `lse` (malloc'd). */
static void run(const layout_case *c, buffers *b, kv_form form, unsigned char **out, unsigned char **lse) {
    const int64_t S_cache = b->pages_per_seq * c->page, pool = c->B * b->pages_per_seq;
    af_tensor q = af_tensor_contiguous(b->q, c->dtype, 4, (int64_t[]){c->B, c->L, c->Hq, c->E});
    af_tensor k, v, table, used, cu_k;
    af_flash_args a = {.query = &q, .key = &k, .value = &v, .causal = c->causal, .has_window = c->window,
                       .window_left = 7, .window_right = c->causal ? 0 : 5};
    if (form == KV_CONTIGUOUS) {
        k = af_tensor_contiguous(b->k, c->dtype, 4, (int64_t[]){c->B, S_cache, c->Hkv, c->E});
        v = af_tensor_contiguous(b->v, c->dtype, 4, (int64_t[]){c->B, S_cache, c->Hkv, c->Ev});
        used = af_tensor_contiguous(b->used, AF_I32, 1, (int64_t[]){c->B});
        a.seqused_k = &used;
    } else if (form == KV_PAGED) {
        k = af_tensor_contiguous(b->kp, c->dtype, 4, (int64_t[]){pool, c->page, c->Hkv, c->E});
        v = af_tensor_contiguous(b->vp, c->dtype, 4, (int64_t[]){pool, c->page, c->Hkv, c->Ev});
        table = af_tensor_contiguous(b->table, AF_I32, 2, (int64_t[]){c->B, b->pages_per_seq});
        used = af_tensor_contiguous(b->used, AF_I32, 1, (int64_t[]){c->B});
        a.page_table = &table;
        a.seqused_k = &used;
    } else {
        k = af_tensor_contiguous(b->kc, c->dtype, 3, (int64_t[]){b->total_k, c->Hkv, c->E});
        v = af_tensor_contiguous(b->vc, c->dtype, 3, (int64_t[]){b->total_k, c->Hkv, c->Ev});
        cu_k = af_tensor_contiguous(b->cu_k, AF_I32, 1, (int64_t[]){c->B + 1});
        a.cu_seqlens_k = &cu_k;
        a.max_seqlen_k = b->S_max;
    }
    af_tensor o = af_tensor_contiguous(b->out, c->dtype, 4, (int64_t[]){c->B, c->L, c->Hq, c->Ev});
    af_tensor l = af_tensor_contiguous(b->lse, AF_F32, 3, (int64_t[]){c->B, c->Hq, c->L});
    memset(b->out, 0xA5, b->out_bytes);
    if (af_flash_attn(&a, &o, &l) != AF_OK) fail_msg("form %d: %s", (int)form, af_last_error());
    *out = malloc(b->out_bytes);
    *lse = malloc(b->lse_bytes);
    if (!*out || !*lse) fail_msg("out of memory");
    memcpy(*out, b->out, b->out_bytes);
    memcpy(*lse, b->lse, b->lse_bytes);
}

/* Under valgrind (scripts/valgrind-tests.sh sets ATTNFORGE_TEST_LIGHT): fewer page sizes, one thread count. */
static bool light(void) { return getenv("ATTNFORGE_TEST_LIGHT") != NULL; }

static void same_bits_every_form(const layout_case *c, buffers *b, const char *isa, int threads) {
    unsigned char *out[3], *lse[3];
    af_set_num_threads(threads);
    for (int f = 0; f < 3; f++) run(c, b, (kv_form)f, &out[f], &lse[f]);
    for (int f = 1; f < 3; f++)
        if (memcmp(out[0], out[f], b->out_bytes) != 0 || memcmp(lse[0], lse[f], b->lse_bytes) != 0)
            fail_msg("%s, %d threads, %s, L %lld, page %lld, causal %d, window %d: %s K/V differ from the contiguous "
                     "cache's bits", isa, threads, af_dtype_name(c->dtype), (long long)c->L, (long long)c->page,
                     c->causal, c->window, f == 1 ? "paged" : "packed varlen");
    for (int f = 0; f < 3; f++) {
        free(out[f]);
        free(lse[f]);
    }
    af_set_num_threads(0);
}

static void check_case(const layout_case *c) {
    buffers b;
    build(c, &b);
    const char *before = af_get_isa();
    const char *isas[] = {"portable", "avx2", "avx512", "amx"};
    for (size_t i = 0; i < sizeof isas / sizeof isas[0]; i++) {
        if (!af_isa_available(isas[i])) continue;
        assert_int_equal(af_set_isa(isas[i]), AF_OK);
        for (int threads = 1; threads <= (light() ? 1 : 2); threads++) same_bits_every_form(c, &b, isas[i], threads);
    }
    af_ukernel_force_for_tests(af_ukernel_amx_emulated());   /* the AMX tile products on emulated tiles */
    same_bits_every_form(c, &b, "amx-emulated", 1);
    af_ukernel_force_for_tests(NULL);
    assert_int_equal(af_set_isa(before), AF_OK);
    release(&b);
}

static void prefill_and_decode_every_layout(void **state) {
    (void)state;
    const af_dtype dtypes[3] = {AF_F32, AF_F16, AF_BF16};
    const int64_t pages[4] = {1, 5, 16, 64};
    const int64_t lengths[3] = {1, 3, 70};   /* decode, a short chunk, a prefill whose packed rows reach the products */
    for (int d = 0; d < 3; d++)
        for (int p = 0; p < 4; p += light() ? 2 : 1)
            for (int l = 0; l < 3; l++) {
                layout_case c = {.dtype = dtypes[d], .B = 3, .L = lengths[l], .Hq = 4, .Hkv = 2, .E = 64, .Ev = 48,
                                 .page = pages[p], .S = {150, 37, 90}, .causal = (l + p) % 2 == 0,
                                 .window = p == 2};
                check_case(&c);
            }
}

static void long_cache_split_kv(void **state) {
    (void)state;   /* decode over enough keys that the driver splits them: chunks must not depend on the layout */
    for (int d = 0; d < 3; d++) {
        layout_case c = {.dtype = (af_dtype[]){AF_F32, AF_F16, AF_BF16}[d], .B = 2, .L = 1, .Hq = 8, .Hkv = 2,
                         .E = 64, .Ev = 64, .page = 16, .S = {3000, 1999}};
        check_case(&c);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(prefill_and_decode_every_layout),
        cmocka_unit_test(long_cache_split_kv),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
