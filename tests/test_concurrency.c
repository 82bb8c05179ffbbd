/* Concurrency: one prepared provider called from 8 threads at once (copy-free plan and copy plan) gives bitwise the
 * results of serial calls; a provider restored from JSON in one thread is used in others; af_sdpa from several
 * threads at once shares the library's thread pool (a caller that finds it busy runs alone); thread-count, ISA and
 * log-callback changes while calls run. `make test-tsan` runs this under ThreadSanitizer; ATTNFORGE_TEST_CALLS sets
 * the calls per thread (valgrind, which runs threads one at a time, uses fewer). */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "attnforge.h"
#include "test_tensor.h"

#define THREADS 8
#define DEFAULT_CALLS 20   /* per thread, in the 8-thread provider tests */

static int calls_per_thread(void) {
    const char *env = getenv("ATTNFORGE_TEST_CALLS");
    const int n = env ? atoi(env) : DEFAULT_CALLS;
    return n > 0 ? n : DEFAULT_CALLS;
}

/* ---- one call's tensors, and its result as bytes */

typedef struct {
    test_tensor q, k, v, out, lse;
    af_sdpa_args args;
    unsigned char *expected_out, *expected_lse;   /* the serial result */
} call_tensors;

typedef struct {
    af_dtype dtype;
    int64_t B, Hq, Hkv, L, S, E;
    bool nhd, is_causal;
} call_shape;

/* Zero the outputs' whole buffers (padding included) before every call, serial or concurrent alike. */
static void clear_result(call_tensors *c) {
    tt_fill_bytes(&c->out, 0);
    tt_fill_bytes(&c->lse, 0);
}

static void call_make(call_tensors *c, const call_shape *s, uint64_t seed) {
    memset(c, 0, sizeof *c);
    test_rng rng = {seed};
    const int64_t qs[4] = {s->B, s->Hq, s->L, s->E}, kvs[4] = {s->B, s->Hkv, s->S, s->E};
    const int64_t os[4] = {s->B, s->Hq, s->L, s->E}, ls[3] = {s->B, s->Hq, s->L};
    const tensor_layout layout = s->nhd ? LAYOUT_NHD : LAYOUT_CONTIGUOUS;
    assert_true(tt_alloc(&c->q, s->dtype, 4, qs, layout, &rng));
    assert_true(tt_alloc(&c->k, s->dtype, 4, kvs, layout, &rng));
    assert_true(tt_alloc(&c->v, s->dtype, 4, kvs, layout, &rng));
    assert_true(tt_alloc(&c->out, s->dtype, 4, os, LAYOUT_CONTIGUOUS, &rng));
    assert_true(tt_alloc(&c->lse, AF_F32, 3, ls, LAYOUT_CONTIGUOUS, &rng));
    tt_fill_uniform(&c->q, &rng, 2.0);
    tt_fill_uniform(&c->k, &rng, 2.0);
    tt_fill_uniform(&c->v, &rng, 1.0);
    c->args = (af_sdpa_args){.query = &c->q.view, .key = &c->k.view, .value = &c->v.view, .is_causal = s->is_causal,
                             .enable_gqa = s->Hq != s->Hkv};
    clear_result(c);
}

static void call_free(call_tensors *c) {
    tt_free(&c->q);
    tt_free(&c->k);
    tt_free(&c->v);
    tt_free(&c->out);
    tt_free(&c->lse);
    free(c->expected_out);
    free(c->expected_lse);
}

static void remember_result(call_tensors *c) {
    c->expected_out = tt_snapshot(&c->out);
    c->expected_lse = tt_snapshot(&c->lse);
}

static bool result_is_expected(const call_tensors *c) {
    return tt_same_as(&c->out, c->expected_out) && tt_same_as(&c->lse, c->expected_lse);
}

/* ---- threads that start together */

typedef struct worker worker;
struct worker {
    pthread_barrier_t *start;
    void (*body)(worker *w);
    af_provider *provider;
    call_tensors *call;
    void *extra;           /* what a body needs beyond one call */
    int calls;
    atomic_int *running;   /* callers still running (for the threads that change settings meanwhile) */
    int mismatches, errors;
    char error[256];
};

static void *worker_main(void *arg) {
    worker *w = arg;
    pthread_barrier_wait(w->start);
    w->body(w);
    if (w->running) atomic_fetch_sub(w->running, 1);
    return NULL;
}

static void run_together(worker *workers, int n) {
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)n);
    pthread_t threads[16];
    for (int i = 0; i < n; i++) {
        workers[i].start = &start;
        assert_int_equal(pthread_create(&threads[i], NULL, worker_main, &workers[i]), 0);
    }
    for (int i = 0; i < n; i++) assert_int_equal(pthread_join(threads[i], NULL), 0);
    pthread_barrier_destroy(&start);
    for (int i = 0; i < n; i++) {
        if (workers[i].errors) fail_msg("thread %d: %d calls failed: %s", i, workers[i].errors, workers[i].error);
        if (workers[i].mismatches) fail_msg("thread %d: %d of %d results differ from the serial call's bits", i,
                                            workers[i].mismatches, workers[i].calls);
    }
}

static void note_status(worker *w, af_status st) {
    if (st == AF_OK) return;
    w->errors++;
    snprintf(w->error, sizeof w->error, "%s: %s", af_status_name(st), af_last_error());
}

/* ---- one provider, 8 threads */

static void infer_repeatedly(worker *w) {
    for (int i = 0; i < w->calls; i++) {
        clear_result(w->call);
        note_status(w, af_provider_infer(w->provider, &w->call->args, AF_QKV_POSITIONAL, &w->call->out.view,
                                         &w->call->lse.view));
        if (!result_is_expected(w->call)) w->mismatches++;
    }
}

static af_provider *provider_prepared_for(const call_tensors *c) {
    af_samples *samples = af_samples_new();
    assert_int_equal(af_samples_add_call(samples, &c->args, AF_QKV_POSITIONAL, NULL, 1), AF_OK);
    af_provider *p = af_provider_new();
    if (!af_provider_prepare(p, samples)) fail_msg("prepare: %s", af_provider_reason(p));
    af_samples_free(samples);
    return p;
}

/* Thread t gets its own data and its own L and S (the copy plan's scratch then grows under contention). */
static void one_provider_from_eight_threads(af_dtype dtype, bool nhd, bool expect_copy_free) {
    call_tensors calls[THREADS];
    for (int t = 0; t < THREADS; t++) {
        const call_shape s = {dtype, 1, 4, 2, 9 + 5 * t, 23 + 11 * t, 32, nhd, true};
        call_make(&calls[t], &s, 1000 + (uint64_t)t);
    }
    af_provider *p = provider_prepared_for(&calls[0]);
    af_plan plan;
    assert_int_equal(af_provider_get_plan(p, &plan), AF_OK);
    assert_int_equal(plan.copy_free_layout, expect_copy_free);
    for (int t = 0; t < THREADS; t++) {   /* the serial results, one call at a time */
        assert_int_equal(af_provider_infer(p, &calls[t].args, AF_QKV_POSITIONAL, &calls[t].out.view, &calls[t].lse.view),
                         AF_OK);
        remember_result(&calls[t]);
    }
    worker workers[THREADS];
    for (int t = 0; t < THREADS; t++)
        workers[t] = (worker){.body = infer_repeatedly, .provider = p, .call = &calls[t], .calls = calls_per_thread()};
    run_together(workers, THREADS);
    print_message("    %d threads x %d calls on one %s provider: bitwise the serial results\n", THREADS, calls_per_thread(),
                  expect_copy_free ? "copy-free" : "copy");
    af_provider_free(p);
    for (int t = 0; t < THREADS; t++) call_free(&calls[t]);
}

static void copy_free_provider_from_eight_threads(void **state) {
    (void)state;
    one_provider_from_eight_threads(AF_F32, true, true);
}

static void copy_provider_from_eight_threads(void **state) {
    (void)state;
    one_provider_from_eight_threads(AF_BF16, false, false);
}

/* ---- a provider restored from JSON in one thread, used in others */

typedef struct {
    const call_tensors *call;
    char *json;
    af_provider *provider;
} handover;

static void *prepare_and_save(void *arg) {   /* no cmocka asserts off the main thread: h->json NULL says it failed */
    handover *h = arg;
    af_samples *samples = af_samples_new();
    af_provider *p = af_provider_new();
    if (samples && p && af_samples_add_call(samples, &h->call->args, AF_QKV_POSITIONAL, NULL, 1) == AF_OK &&
        af_provider_prepare(p, samples) && af_provider_to_json(p, &h->json) != AF_OK)
        h->json = NULL;
    af_provider_free(p);
    af_samples_free(samples);
    return NULL;
}

static void *restore(void *arg) {
    handover *h = arg;
    if (af_provider_from_json(h->json, strlen(h->json), &h->provider) != AF_OK) h->provider = NULL;
    return NULL;
}

static void restored_provider_used_in_other_threads(void **state) {
    (void)state;
    enum { USERS = 4 };
    call_tensors calls[USERS];
    for (int t = 0; t < USERS; t++) {
        const call_shape s = {AF_F16, 2, 2, 2, 17 + t, 33, 16, false, false};
        call_make(&calls[t], &s, 2000 + (uint64_t)t);
        assert_int_equal(af_sdpa(&calls[t].args, &calls[t].out.view, &calls[t].lse.view), AF_OK);
        remember_result(&calls[t]);
    }
    handover h = {.call = &calls[0]};
    pthread_t thread;
    assert_int_equal(pthread_create(&thread, NULL, prepare_and_save, &h), 0);   /* thread 1: prepare, save */
    pthread_join(thread, NULL);
    assert_non_null(h.json);
    assert_int_equal(pthread_create(&thread, NULL, restore, &h), 0);            /* thread 2: restore */
    pthread_join(thread, NULL);
    assert_non_null(h.provider);
    worker workers[USERS];                                                      /* threads 3..6: use it at once */
    for (int t = 0; t < USERS; t++)
        workers[t] = (worker){.body = infer_repeatedly, .provider = h.provider, .call = &calls[t],
                              .calls = (calls_per_thread() + 1) / 2};
    run_together(workers, USERS);
    af_provider_free(h.provider);
    af_free(h.json);
    for (int t = 0; t < USERS; t++) call_free(&calls[t]);
}

/* ---- af_sdpa from several threads: the pool is shared, a busy pool makes the caller run alone */

static void sdpa_repeatedly(worker *w) {
    for (int i = 0; i < w->calls; i++) {
        clear_result(w->call);
        note_status(w, af_sdpa(&w->call->args, &w->call->out.view, &w->call->lse.view));
        if (!result_is_expected(w->call)) w->mismatches++;
    }
}

/* Mixed shapes: causal prefill, split-KV decode (2 query rows per kv head, 3000 keys), GQA, f16/bf16/f32. */
static const call_shape SDPA_SHAPES[4] = {
    {AF_F32, 1, 4, 4, 96, 96, 64, false, true},
    {AF_F16, 1, 8, 2, 1, 3000, 64, false, false},
    {AF_BF16, 2, 4, 2, 33, 70, 32, true, false},
    {AF_F32, 1, 2, 1, 4, 2500, 32, false, true},
};

static void make_sdpa_calls(call_tensors *calls, int n) {
    af_set_num_threads(0);
    for (int t = 0; t < n; t++) {
        call_make(&calls[t], &SDPA_SHAPES[t % 4], 3000 + (uint64_t)t);
        assert_int_equal(af_sdpa(&calls[t].args, &calls[t].out.view, &calls[t].lse.view), AF_OK);
        remember_result(&calls[t]);
    }
}

static void sdpa_from_several_threads(void **state) {
    (void)state;
    enum { CALLERS = 4 };
    call_tensors calls[CALLERS];
    make_sdpa_calls(calls, CALLERS);
    for (int threads = 1; threads <= 3; threads += 2) {
        af_set_num_threads(threads);
        worker workers[CALLERS];
        for (int t = 0; t < CALLERS; t++)
            workers[t] = (worker){.body = sdpa_repeatedly, .call = &calls[t], .calls = (calls_per_thread() + 1) / 2};
        run_together(workers, CALLERS);
    }
    af_set_num_threads(0);
    for (int t = 0; t < CALLERS; t++) call_free(&calls[t]);
}

/* ---- settings changed while calls run */

static const int THREAD_COUNTS[] = {1, 2, 3, 8, 0};

static void change_thread_count(worker *w) {
    for (int i = 0; atomic_load(w->running) > 0; i++) af_set_num_threads(THREAD_COUNTS[i % 5]);
}

static void thread_count_changes_while_calls_run(void **state) {
    (void)state;
    enum { CALLERS = 3 };
    call_tensors calls[CALLERS];
    make_sdpa_calls(calls, CALLERS);
    atomic_int running = CALLERS;
    worker workers[CALLERS + 1];
    for (int t = 0; t < CALLERS; t++)
        workers[t] = (worker){.body = sdpa_repeatedly, .call = &calls[t], .calls = (calls_per_thread() + 1) / 2,
                              .running = &running};
    workers[CALLERS] = (worker){.body = change_thread_count, .running = &running};
    run_together(workers, CALLERS + 1);
    af_set_num_threads(0);
    for (int t = 0; t < CALLERS; t++) call_free(&calls[t]);
}

/* An ISA change mid-flight: each call runs wholly on one ISA, so its bits are one ISA's serial result. */
typedef struct {
    call_tensors call;
    unsigned char *out_by_isa[8];   /* one per ISA compiled in (af_isa_name): 4 today */
    const char *isas[8];
    int isa_count;
} isa_results;

static void sdpa_on_any_isa(worker *w) {
    isa_results *r = w->extra;
    for (int i = 0; i < w->calls; i++) {
        clear_result(&r->call);
        note_status(w, af_sdpa(&r->call.args, &r->call.out.view, NULL));
        bool known = false;
        for (int k = 0; k < r->isa_count; k++) known |= tt_same_as(&r->call.out, r->out_by_isa[k]);
        if (!known) w->mismatches++;
    }
}

static void change_isa(worker *w) {
    int count = 0;
    while (af_isa_name(count)) count++;
    for (int i = 0; atomic_load(w->running) > 0; i++)
        if (af_isa_available(af_isa_name(i % count))) af_set_isa(af_isa_name(i % count));
}

static void isa_changes_while_calls_run(void **state) {
    (void)state;
    enum { CALLERS = 2 };
    const char *initial = af_get_isa();
    isa_results results[CALLERS];
    for (int t = 0; t < CALLERS; t++) {
        isa_results *r = &results[t];
        memset(r, 0, sizeof *r);
        call_make(&r->call, &SDPA_SHAPES[t], 4000 + (uint64_t)t);
        for (int k = 0; af_isa_name(k) && r->isa_count < 8; k++) {
            if (!af_isa_available(af_isa_name(k))) continue;
            assert_int_equal(af_set_isa(af_isa_name(k)), AF_OK);
            clear_result(&r->call);
            assert_int_equal(af_sdpa(&r->call.args, &r->call.out.view, NULL), AF_OK);
            r->isas[r->isa_count] = af_isa_name(k);
            r->out_by_isa[r->isa_count++] = tt_snapshot(&r->call.out);
        }
    }
    atomic_int running = CALLERS;
    worker workers[CALLERS + 1];
    for (int t = 0; t < CALLERS; t++)
        workers[t] = (worker){.body = sdpa_on_any_isa, .extra = &results[t], .calls = (calls_per_thread() + 1) / 2,
                              .running = &running};
    workers[CALLERS] = (worker){.body = change_isa, .running = &running};
    run_together(workers, CALLERS + 1);
    assert_int_equal(af_set_isa(initial), AF_OK);
    for (int t = 0; t < CALLERS; t++) {
        for (int k = 0; k < results[t].isa_count; k++) free(results[t].out_by_isa[k]);
        call_free(&results[t].call);
    }
}

/* The log callback swapped while calls that log (the general path's debug line) run on a provider. */
static atomic_long messages;

static void count_message(af_log_level level, const char *message, void *user) {
    (void)level;
    (void)user;
    if (message[0]) atomic_fetch_add(&messages, 1);
}

static void change_log_callback(worker *w) {
    for (int i = 0; atomic_load(w->running) > 0; i++)
        af_set_log_callback(i % 2 ? count_message : NULL, NULL, AF_LOG_DEBUG);
    af_set_log_callback(NULL, NULL, AF_LOG_OFF);
}

static void log_callback_changes_while_calls_log(void **state) {
    (void)state;
    enum { CALLERS = 3 };
    call_tensors calls[CALLERS];
    for (int t = 0; t < CALLERS; t++) {
        const call_shape s = {AF_F32, 1, 2, 2, 8, 8, 16, false, false};
        call_make(&calls[t], &s, 5000 + (uint64_t)t);
        assert_int_equal(af_sdpa(&calls[t].args, &calls[t].out.view, &calls[t].lse.view), AF_OK);
        remember_result(&calls[t]);
    }
    af_sdpa_args causal = calls[0].args;
    causal.is_causal = true;   /* a causal plan: the callers' non-causal calls take the general path and log */
    af_provider *p = provider_prepared_for(&(call_tensors){.args = causal});
    atomic_int running = CALLERS;
    worker workers[CALLERS + 1];
    for (int t = 0; t < CALLERS; t++)
        workers[t] = (worker){.body = infer_repeatedly, .provider = p, .call = &calls[t], .calls = calls_per_thread(),
                              .running = &running};
    workers[CALLERS] = (worker){.body = change_log_callback, .running = &running};
    run_together(workers, CALLERS + 1);
    af_provider_free(p);
    for (int t = 0; t < CALLERS; t++) call_free(&calls[t]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(copy_free_provider_from_eight_threads),
        cmocka_unit_test(copy_provider_from_eight_threads),
        cmocka_unit_test(restored_provider_used_in_other_threads),
        cmocka_unit_test(sdpa_from_several_threads),
        cmocka_unit_test(thread_count_changes_while_calls_run),
        cmocka_unit_test(isa_changes_while_calls_run),
        cmocka_unit_test(log_callback_changes_while_calls_log),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
