/* The core layer: f16/bf16 conversions against an independent oracle, the thread pool, and allocation failure
 * at every allocation site of af_sdpa (nothing written, AF_ERR_NO_MEMORY). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attnforge.h"
#include "case_gen.h"
#include "core/alloc.h"
#include "core/dtype.h"
#include "core/threadpool.h"

/* ------------------------------------------------------------------ conversions: the oracle */

/* A 16-bit float format, decoded from its definition (not from dtype.h). */
typedef struct {
    const char *name;
    int mantissa_bits, exponent_bias;
    uint16_t inf_bits;   /* the first pattern past the largest finite value */
} half_format;

static const half_format f16_format = {"float16", 10, 15, 0x7c00};
static const half_format bf16_format = {"bfloat16", 7, 127, 0x7f80};

/* Value of a non-negative pattern <= inf_bits; inf_bits decodes as the power of two it stands for when rounding. */
static double decode_magnitude(const half_format *f, uint16_t bits) {
    const int exponent = bits >> f->mantissa_bits, mantissa = bits & ((1 << f->mantissa_bits) - 1);
    if (exponent == 0) return ldexp(mantissa, 1 - f->exponent_bias - f->mantissa_bits);   /* subnormal */
    return ldexp((1 << f->mantissa_bits) + mantissa, exponent - f->exponent_bias - f->mantissa_bits);
}

static bool half_is_nan(const half_format *f, uint16_t h) { return (h & 0x7fff) > f->inf_bits; }

static double decode(const half_format *f, uint16_t h) {
    if (half_is_nan(f, h)) return NAN;
    const double m = (h & 0x7fff) == f->inf_bits ? INFINITY : decode_magnitude(f, h & 0x7fff);
    return h & 0x8000 ? -m : m;
}

/* Round-to-nearest-even of a finite or infinite x: binary search for the neighbours, then the nearer (even on a tie). */
static uint16_t encode_oracle(const half_format *f, double x) {
    const uint16_t sign = signbit(x) ? 0x8000 : 0;
    const double a = fabs(x);
    if (a >= decode_magnitude(f, f->inf_bits)) return sign | f->inf_bits;
    uint16_t lo = 0, hi = f->inf_bits;   /* decode(lo) <= a < decode(hi) */
    while (hi - lo > 1) {
        const uint16_t mid = (uint16_t)((lo + hi) / 2);
        if (decode_magnitude(f, mid) <= a) lo = mid;
        else hi = mid;
    }
    const double below = a - decode_magnitude(f, lo), above = decode_magnitude(f, hi) - a;
    const uint16_t nearest = below < above ? lo : above < below ? hi : (lo % 2 == 0 ? lo : hi);
    return sign | nearest;
}

static uint16_t to_half(const half_format *f, float x) { return f == &f16_format ? af_f32_to_f16(x) : af_f32_to_bf16(x); }
static float from_half(const half_format *f, uint16_t h) { return f == &f16_format ? af_f16_to_f32(h) : af_bf16_to_f32(h); }

static void check_encode(const half_format *f, float x) {
    const uint16_t got = to_half(f, x);
    if (isnan(x)) {
        if (!half_is_nan(f, got) || (got & 0x8000) != (signbit(x) ? 0x8000 : 0))
            fail_msg("%s(NaN 0x%08x) = 0x%04x, not a NaN of the same sign", f->name, af_f32_to_bits(x), got);
        return;
    }
    const uint16_t want = encode_oracle(f, x);
    if (got != want) fail_msg("%s(%.9g = 0x%08x) = 0x%04x, want 0x%04x", f->name, x, af_f32_to_bits(x), got, want);
}

/* Every pattern decodes to its value (NaN to NaN) and encodes back to itself. */
static void exhaustive_decode_and_round_trip(const half_format *f) {
    for (uint32_t h = 0; h <= 0xffff; h++) {
        const float x = from_half(f, (uint16_t)h);
        const double want = decode(f, (uint16_t)h);
        if (isnan(want) ? !isnan(x) : (double)x != want || !signbit(x) != !signbit(want))
            fail_msg("%s 0x%04x decodes to %.9g, want %.9g", f->name, h, x, want);
        const uint16_t back = to_half(f, x);
        if (isnan(want) ? !half_is_nan(f, back) : back != h) fail_msg("%s 0x%04x round-trips to 0x%04x", f->name, h, back);
    }
}

/* Around every representable value: the value, the tie with its successor, and one f32 ulp either side of both. */
static void dense_encode_near_every_boundary(const half_format *f) {
    for (uint32_t h = 0; h < f->inf_bits; h++) {
        const float v = (float)decode_magnitude(f, (uint16_t)h);
        const float tie = (float)((decode_magnitude(f, (uint16_t)h) + decode_magnitude(f, (uint16_t)(h + 1))) / 2);
        const float probes[6] = {v, nextafterf(v, INFINITY), nextafterf(v, 0.0f), tie, nextafterf(tie, INFINITY),
                                 nextafterf(tie, 0.0f)};
        for (int i = 0; i < 6; i++) {
            check_encode(f, probes[i]);
            check_encode(f, -probes[i]);
        }
    }
}

/* A stride through all 2^32 f32 patterns: normals, subnormals, huge values, infinities and NaN payloads. */
static void sampled_encode_of_all_f32(const half_format *f) {
    for (uint64_t u = 0; u <= 0xffffffffu; u += 4093) check_encode(f, af_bits_to_f32((uint32_t)u));
    static const uint32_t specials[] = {0x7f800000u, 0xff800000u, 0x7f800001u, 0xff800001u, 0x7fc00000u, 0x7f80ffffu,
                                        0x7fffffffu, 0x00000001u, 0x80000001u, 0x7f7fffffu, 0x477ff000u, 0x477fefffu,
                                        0x33000000u, 0x33000001u, 0x32ffffffu, 0x00000000u, 0x80000000u};
    for (size_t i = 0; i < sizeof specials / sizeof specials[0]; i++) check_encode(f, af_bits_to_f32(specials[i]));
}

static void f16_conversions(void **state) {
    (void)state;
    exhaustive_decode_and_round_trip(&f16_format);
    dense_encode_near_every_boundary(&f16_format);
    sampled_encode_of_all_f32(&f16_format);
}

static void bf16_conversions(void **state) {
    (void)state;
    exhaustive_decode_and_round_trip(&bf16_format);
    dense_encode_near_every_boundary(&bf16_format);
    sampled_encode_of_all_f32(&bf16_format);
}

/* The oracle itself on a few values fixed by IEEE 754 (so a broken oracle cannot pass everything). */
static void oracle_knows_ieee_landmarks(void **state) {
    (void)state;
    assert_int_equal(encode_oracle(&f16_format, 65504.0), 0x7bff);
    assert_int_equal(encode_oracle(&f16_format, 65520.0), 0x7c00);          /* tie with 2^16: even, i.e. Inf */
    assert_int_equal(encode_oracle(&f16_format, 65519.0), 0x7bff);
    assert_int_equal(encode_oracle(&f16_format, ldexp(1.0, -24)), 0x0001);  /* smallest subnormal */
    assert_int_equal(encode_oracle(&f16_format, ldexp(1.0, -25)), 0x0000);  /* tie with 0: even */
    assert_int_equal(encode_oracle(&f16_format, ldexp(3.0, -25)), 0x0002);  /* tie 1|2: even */
    assert_int_equal(encode_oracle(&f16_format, 1.0), 0x3c00);
    assert_int_equal(encode_oracle(&f16_format, -2.0), 0xc000);
    assert_int_equal(encode_oracle(&bf16_format, 1.0), 0x3f80);
    assert_int_equal(encode_oracle(&bf16_format, 1.0 + ldexp(1.0, -8)), 0x3f80);      /* tie: even */
    assert_int_equal(encode_oracle(&bf16_format, 1.0 + ldexp(3.0, -8)), 0x3f82);      /* tie: even */
    assert_int_equal(encode_oracle(&bf16_format, (double)FLT_MAX), 0x7f80);           /* rounds up to Inf */
}

/* ------------------------------------------------------------------ thread pool */

typedef struct {
    atomic_int *runs;        /* per item */
    size_t scratch_bytes;
    atomic_int misaligned, trampled;
    atomic_int active, most_active;
    pthread_mutex_t lock;
    void *scratches[64];     /* distinct scratch pointers seen */
    int scratch_count;
} pool_probe;

static void note_scratch(pool_probe *p, void *scratch) {
    pthread_mutex_lock(&p->lock);
    bool seen = false;
    for (int i = 0; i < p->scratch_count; i++) seen |= p->scratches[i] == scratch;
    if (!seen && p->scratch_count < 64) p->scratches[p->scratch_count++] = scratch;
    pthread_mutex_unlock(&p->lock);
}

/* Each item fills the whole scratch with its own id, works a little, and checks nobody else wrote there. */
static void probe_item(void *ctx, int64_t item, void *scratch) {
    pool_probe *p = ctx;
    const int now = atomic_fetch_add(&p->active, 1) + 1;
    for (int seen = atomic_load(&p->most_active); now > seen && !atomic_compare_exchange_weak(&p->most_active, &seen, now);) {
    }
    atomic_fetch_add(&p->runs[item], 1);
    if (p->scratch_bytes) {
        if ((uintptr_t)scratch % 64) atomic_fetch_add(&p->misaligned, 1);
        note_scratch(p, scratch);
        memset(scratch, (int)(item & 0xff), p->scratch_bytes);
        volatile double sink = 0.0;
        for (int i = 0; i < 200; i++) sink += sqrt((double)i);
        const unsigned char *s = scratch;
        for (size_t i = 0; i < p->scratch_bytes; i++)
            if (s[i] != (unsigned char)(item & 0xff)) {
                atomic_fetch_add(&p->trampled, 1);
                break;
            }
    }
    atomic_fetch_sub(&p->active, 1);
}

static void probe_init(pool_probe *p, int64_t n, size_t scratch_bytes) {
    memset(p, 0, sizeof *p);
    p->runs = calloc((size_t)n, sizeof *p->runs);
    assert_non_null(p->runs);
    p->scratch_bytes = scratch_bytes;
    pthread_mutex_init(&p->lock, NULL);
}

static void probe_free(pool_probe *p) {
    free(p->runs);
    pthread_mutex_destroy(&p->lock);
}

static bool every_item_once(const pool_probe *p, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (atomic_load(&p->runs[i]) != 1) return false;
    return true;
}

static void pool_runs_every_item_exactly_once(void **state) {
    (void)state;
    static const int threads[] = {1, 2, 3, 4, 8};
    static const int64_t counts[] = {0, 1, 2, 7, 1000, 10007};
    for (size_t t = 0; t < sizeof threads / sizeof threads[0]; t++)
        for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
            af_set_num_threads(threads[t]);
            pool_probe p;
            probe_init(&p, counts[c] > 0 ? counts[c] : 1, 200);
            assert_int_equal(af_parallel_for(counts[c], probe_item, &p, 200), AF_OK);
            if (!every_item_once(&p, counts[c])) fail_msg("%d threads, %lld items: not every item ran exactly once",
                                                           threads[t], (long long)counts[c]);
            if (counts[c] == 0) assert_int_equal(atomic_load(&p.runs[0]), 0);
            assert_int_equal(atomic_load(&p.misaligned), 0);
            assert_int_equal(atomic_load(&p.trampled), 0);
            assert_true(atomic_load(&p.most_active) <= threads[t]);
            assert_true(p.scratch_count <= threads[t]);   /* one scratch per thread, reused */
            probe_free(&p);
        }
    af_set_num_threads(0);
}

typedef struct { _Atomic pthread_t first; atomic_int others; } sharing_probe;   /* first: set by one thread, read by all */

/* Item 0 waits (up to 5 s) until some other thread has run an item: proof that the work is shared. */
static void sharing_item(void *ctx, int64_t item, void *scratch) {
    (void)scratch;
    sharing_probe *p = ctx;
    if (item == 0) {
        atomic_store(&p->first, pthread_self());
        for (int waited = 0; waited < 5000 && atomic_load(&p->others) == 0; waited++) {
            struct timespec ms = {0, 1000000};
            nanosleep(&ms, NULL);
        }
    } else if (!pthread_equal(pthread_self(), atomic_load(&p->first))) {
        atomic_fetch_add(&p->others, 1);
    }
}

static void pool_shares_the_work(void **state) {
    (void)state;
    af_set_num_threads(2);
    sharing_probe p = {.first = pthread_self()};
    atomic_init(&p.others, 0);
    assert_int_equal(af_parallel_for(1000, sharing_item, &p, 64), AF_OK);
    assert_true(atomic_load(&p.others) > 0);
    af_set_num_threads(0);
}

static void thread_count_setting(void **state) {
    (void)state;
    af_set_num_threads(3);
    assert_int_equal(af_get_num_threads(), 3);
    af_set_num_threads(0);
    assert_true(af_get_num_threads() >= 1);
    const int all = af_get_num_threads();
    af_set_num_threads(-5);   /* negative: all cores, like 0 */
    assert_int_equal(af_get_num_threads(), all);
    af_set_num_threads(0);
}

typedef struct { atomic_int *runs; } inner_ctx;

static void inner_item(void *ctx, int64_t item, void *scratch) {
    (void)scratch;
    inner_ctx *c = ctx;
    atomic_fetch_add(&c->runs[item], 1);
}

typedef struct { atomic_int runs[16 * 8]; atomic_int failures; } nest;

static void outer_item(void *ctx, int64_t item, void *scratch) {
    (void)scratch;
    nest *n = ctx;
    inner_ctx inner = {n->runs + item * 8};
    if (af_parallel_for(8, inner_item, &inner, 64) != AF_OK) atomic_fetch_add(&n->failures, 1);
}

static void nested_calls_run_inline(void **state) {
    (void)state;
    af_set_num_threads(2);
    nest n;
    memset(&n, 0, sizeof n);
    assert_int_equal(af_parallel_for(16, outer_item, &n, 64), AF_OK);
    assert_int_equal(atomic_load(&n.failures), 0);
    for (int i = 0; i < 16 * 8; i++) assert_int_equal(atomic_load(&n.runs[i]), 1);
    af_set_num_threads(0);
}

static void *hammer_pool(void *arg) {
    (void)arg;
    for (int round = 0; round < 40; round++) {
        pool_probe p;
        const int64_t n = 500 + round;
        memset(&p, 0, sizeof p);
        p.runs = calloc((size_t)n, sizeof *p.runs);
        p.scratch_bytes = 128;
        pthread_mutex_init(&p.lock, NULL);
        const bool ok = p.runs && af_parallel_for(n, probe_item, &p, 128) == AF_OK && every_item_once(&p, n) &&
                        atomic_load(&p.trampled) == 0;
        free(p.runs);
        pthread_mutex_destroy(&p.lock);
        if (!ok) return NULL;
    }
    return (void *)1;
}

/* Four threads call the pool at once: whoever finds it busy runs alone; nothing deadlocks or runs twice. */
static void concurrent_callers_fall_back_safely(void **state) {
    (void)state;
    af_set_num_threads(2);
    pthread_t callers[4];
    for (int i = 0; i < 4; i++) assert_int_equal(pthread_create(&callers[i], NULL, hammer_pool, NULL), 0);
    for (int i = 0; i < 4; i++) {
        void *ok = NULL;
        assert_int_equal(pthread_join(callers[i], &ok), 0);
        assert_non_null(ok);
    }
    af_set_num_threads(0);
}

static void *run_case_repeatedly(void *arg) {
    case_tensors *t = arg;
    char why[512];
    for (int round = 0; round < 5; round++) {
        tt_fill_bytes(&t->out, TT_SENTINEL_BYTE);
        if (af_sdpa(&t->args, &t->out.view, t->c.with_lse ? &t->lse.view : NULL) != AF_OK) return NULL;
        if (!case_matches_reference(t, NULL, why, sizeof why)) return NULL;
    }
    return (void *)1;
}

/* af_sdpa from four threads at once (one owns the pool, the others run alone): every result is right. */
static void concurrent_sdpa_calls_are_correct(void **state) {
    (void)state;
    af_set_num_threads(2);
    case_tensors t[4];
    for (int i = 0; i < 4; i++) {
        sdpa_case c = i % 2 ? case_default(1, 8, 2, 2, 1300, 16, 16) : case_default(2, 4, 2, 40, 60, 16, 8);
        c.seed = (uint64_t)i + 1;
        c.is_causal = i >= 2;
        assert_true(case_build(&c, &t[i]));
    }
    pthread_t callers[4];
    for (int i = 0; i < 4; i++) assert_int_equal(pthread_create(&callers[i], NULL, run_case_repeatedly, &t[i]), 0);
    for (int i = 0; i < 4; i++) {
        void *ok = NULL;
        assert_int_equal(pthread_join(callers[i], &ok), 0);
        assert_non_null(ok);
        case_free(&t[i]);
    }
    af_set_num_threads(0);
}

static void pool_scratch_failure_runs_nothing(void **state) {
    (void)state;
    for (int threads = 1; threads <= 2; threads++) {
        af_set_num_threads(threads);
        pool_probe p;
        probe_init(&p, 10, 64);
        af_test_fail_allocation(1);
        assert_int_equal(af_parallel_for(10, probe_item, &p, 64), AF_ERR_NO_MEMORY);
        af_test_fail_allocation(0);
        assert_non_null(strstr(af_last_error(), "out of memory"));
        for (int i = 0; i < 10; i++) assert_int_equal(atomic_load(&p.runs[i]), 0);
        probe_free(&p);
    }
    af_set_num_threads(0);
}

/* The pool grows when a call wants more threads than it has: each new worker must wait for the next job, not
 * take the last (finished) one. Run last: the pool keeps its 200 workers for the rest of the process. */
static void pool_grows_between_calls(void **state) {
    (void)state;
    for (int threads = 2; threads <= 200; threads++) {
        af_set_num_threads(threads);
        const int64_t n = 4 * threads;
        pool_probe p;
        probe_init(&p, n, 64);
        assert_int_equal(af_parallel_for(n, probe_item, &p, 64), AF_OK);
        if (!every_item_once(&p, n)) fail_msg("%d threads: not every item ran exactly once", threads);
        probe_free(&p);
    }
    af_set_num_threads(0);
}

/* ------------------------------------------------------------------ allocation failure in af_sdpa */

typedef af_status (*sdpa_entry)(const af_sdpa_args *, af_tensor *, af_tensor *);

/* Fail the n-th allocation of the call for n = 1, 2, ... until the call succeeds: every failure is
 * AF_ERR_NO_MEMORY with out and lse untouched, the failures number exactly the call's allocations, and the
 * finished call matches the reference. */
static void fail_each_allocation(case_tensors *t, sdpa_entry entry, const char *isa, int threads, int min_sites) {
    assert_int_equal(af_set_isa(isa), AF_OK);
    af_set_num_threads(threads);
    tt_fill_bytes(&t->out, TT_SENTINEL_BYTE);
    tt_fill_bytes(&t->lse, TT_SENTINEL_BYTE);
    const long before = af_alloc_count();
    assert_int_equal(entry(&t->args, &t->out.view, &t->lse.view), AF_OK);
    const long sites = af_alloc_count() - before;
    if (sites < min_sites) fail_msg("%s: the call made %ld allocations, expected at least %d", isa, sites, min_sites);
    long failures = 0;
    for (long n = 1;; n++) {
        tt_fill_bytes(&t->out, TT_SENTINEL_BYTE);
        tt_fill_bytes(&t->lse, TT_SENTINEL_BYTE);
        af_test_fail_allocation(n);
        const af_status st = entry(&t->args, &t->out.view, &t->lse.view);
        af_test_fail_allocation(0);
        if (st == AF_OK) break;
        failures++;
        if (st != AF_ERR_NO_MEMORY) fail_msg("%s, allocation %ld failed: %s (%s)", isa, n, af_status_name(st), af_last_error());
        if (!strstr(af_last_error(), "out of memory")) fail_msg("%s, allocation %ld: message \"%s\"", isa, n, af_last_error());
        for (size_t i = 0; i < t->out.bytes; i++)
            if (t->out.memory[i] != TT_SENTINEL_BYTE) fail_msg("%s, allocation %ld failed, but out was written", isa, n);
        for (size_t i = 0; i < t->lse.bytes; i++)
            if (t->lse.memory[i] != TT_SENTINEL_BYTE) fail_msg("%s, allocation %ld failed, but lse was written", isa, n);
    }
    assert_int_equal(failures, sites);
    char why[512];
    if (entry == af_sdpa && !case_matches_reference(t, NULL, why, sizeof why)) fail_msg("%s after the failures: %s", isa, why);
}

static void run_allocation_failures(sdpa_case c, int min_sites) {
    case_tensors t;
    assert_true(case_build(&c, &t));
    const char *isas[CASE_MAX_ISAS];
    const int n = case_isas(isas, CASE_MAX_ISAS);
    for (int i = 0; i < n; i++)
        for (int threads = 1; threads <= 2; threads++) fail_each_allocation(&t, af_sdpa, isas[i], threads, min_sites);
    fail_each_allocation(&t, af_sdpa_reference, "portable", 1, 1);
    case_free(&t);
    af_set_num_threads(0);
}

static void sdpa_survives_every_allocation_failure(void **state) {
    (void)state;
    sdpa_case c = case_default(2, 4, 2, 70, 90, 16, 16);
    c.is_causal = true;
    run_allocation_failures(c, 1);   /* the per-thread tiles */
}

static void split_kv_survives_every_allocation_failure(void **state) {
    (void)state;
    sdpa_case c = case_default(1, 8, 2, 2, 1500, 16, 16);
    assert_true(case_is_split_kv(&c));
    run_allocation_failures(c, 2);   /* the partial results, then the tiles (and the merge's scratch) */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(oracle_knows_ieee_landmarks),
        cmocka_unit_test(f16_conversions),
        cmocka_unit_test(bf16_conversions),
        cmocka_unit_test(pool_runs_every_item_exactly_once),
        cmocka_unit_test(pool_shares_the_work),
        cmocka_unit_test(thread_count_setting),
        cmocka_unit_test(nested_calls_run_inline),
        cmocka_unit_test(concurrent_callers_fall_back_safely),
        cmocka_unit_test(concurrent_sdpa_calls_are_correct),
        cmocka_unit_test(pool_scratch_failure_runs_nothing),
        cmocka_unit_test(sdpa_survives_every_allocation_failure),
        cmocka_unit_test(split_kv_survives_every_allocation_failure),
        cmocka_unit_test(pool_grows_between_calls),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
