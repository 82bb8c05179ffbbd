/* The executor hook (af_set_parallel_executor): a lent parallel-for runs attnforge's work with the executor's thread
 * count; every item runs once, in increasing order per thread, on per-thread scratch; executors that run fewer
 * indices than asked (or none) lose nothing; a call from inside a task or from inside the executor's own region, and
 * calls from several threads at once, neither deadlock nor enter the executor twice at once; af_sdpa's bits equal the
 * built-in pool's. `make test-tsan` runs it under ThreadSanitizer; the watchdog turns a deadlock into a failure. */
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "attnforge.h"
#include "case_gen.h"
#include "core/threadpool.h"

#define WATCHDOG_SECONDS 600   /* a deadlock ends the run (SIGALRM) instead of hanging CI; TSan runs take ~30 s */
#define MAX_INDICES 64

/* ------------------------------------------------------------------ test executors and what they saw */

typedef enum { TEAM_THREADS, TEAM_IN_TURN, TEAM_LAST_ONLY, TEAM_NONE } team_kind;

typedef struct {
    team_kind kind;
    int max_threads;             /* what max_threads answers */
    atomic_int regions;          /* parallel() calls */
    atomic_int in_flight;        /* parallel() calls running now */
    atomic_int reentered;        /* parallel() entered while another ran: the header promises never */
    atomic_int last_n_threads;
    atomic_int tasks;            /* task calls made */
} test_executor;

typedef struct { af_thread_task task; void *ctx; int index; } team_member;

static void *member_main(void *arg) {
    team_member *m = arg;
    m->task(m->ctx, m->index);
    return NULL;
}

/* TEAM_THREADS: a thread per index, the caller as index 0 (an OpenMP team's shape); TEAM_IN_TURN: every index on the
 * caller, last first; TEAM_LAST_ONLY: index n-1 alone (a short team); TEAM_NONE: nothing (the caller does it all). */
static void test_parallel(int n_threads, af_thread_task task, void *task_ctx, void *user) {
    test_executor *e = user;
    if (atomic_fetch_add(&e->in_flight, 1) > 0) atomic_fetch_add(&e->reentered, 1);
    atomic_fetch_add(&e->regions, 1);
    atomic_store(&e->last_n_threads, n_threads);
    assert_true(n_threads >= 2 && n_threads <= MAX_INDICES);
    switch (e->kind) {
    case TEAM_THREADS: {
        pthread_t threads[MAX_INDICES];
        team_member members[MAX_INDICES];
        for (int t = 1; t < n_threads; t++) {
            members[t] = (team_member){task, task_ctx, t};
            assert_int_equal(pthread_create(&threads[t], NULL, member_main, &members[t]), 0);
        }
        task(task_ctx, 0);
        for (int t = 1; t < n_threads; t++) assert_int_equal(pthread_join(threads[t], NULL), 0);
        atomic_fetch_add(&e->tasks, n_threads);
        break;
    }
    case TEAM_IN_TURN:
        for (int t = n_threads - 1; t >= 0; t--) task(task_ctx, t);
        atomic_fetch_add(&e->tasks, n_threads);
        break;
    case TEAM_LAST_ONLY:
        task(task_ctx, n_threads - 1);
        atomic_fetch_add(&e->tasks, 1);
        break;
    case TEAM_NONE:
        break;
    }
    atomic_fetch_sub(&e->in_flight, 1);
}

static int test_max_threads(void *user) { return ((test_executor *)user)->max_threads; }

static void lend(test_executor *e, team_kind kind, int max_threads) {
    memset(e, 0, sizeof *e);
    e->kind = kind;
    e->max_threads = max_threads;
    const af_parallel_executor lent = {.parallel = test_parallel, .max_threads = test_max_threads, .user = e};
    af_set_parallel_executor(&lent);
}

static void take_back(void) {
    af_set_parallel_executor(NULL);
    af_set_num_threads(0);
}

/* ------------------------------------------------------------------ items, scratch, order */

typedef struct {
    atomic_int *runs;            /* per item */
    atomic_int out_of_order;     /* an item not above the last one its scratch saw */
    atomic_int trampled;         /* a scratch written by another item while this one ran */
    atomic_int misaligned;
    atomic_int running, most_running;
} item_probe;

/* The scratch's first 8 bytes (zeroed per call) hold the last item + 1 this thread ran; the rest is stamped with the
 * item and checked after a yield, so two threads sharing a scratch show up. */
static void probe_item(void *ctx, int64_t item, void *scratch) {
    item_probe *p = ctx;
    const int now = atomic_fetch_add(&p->running, 1) + 1;
    for (int most = atomic_load(&p->most_running); now > most;)
        if (atomic_compare_exchange_weak(&p->most_running, &most, now)) break;
    atomic_fetch_add(&p->runs[item], 1);
    if ((uintptr_t)scratch % 64 != 0) atomic_fetch_add(&p->misaligned, 1);
    int64_t *last = scratch;
    if (*last >= item + 1) atomic_fetch_add(&p->out_of_order, 1);
    *last = item + 1;
    unsigned char *stamp = (unsigned char *)scratch + 8;
    memset(stamp, (int)(item & 0xff), 120);
    sched_yield();
    for (int i = 0; i < 120; i++)
        if (stamp[i] != (unsigned char)(item & 0xff)) {
            atomic_fetch_add(&p->trampled, 1);
            break;
        }
    atomic_fetch_sub(&p->running, 1);
}

/* af_parallel_for(n) with 128 bytes of scratch; every item exactly once, in order per scratch, none shared. */
static void check_items(int64_t n, const char *what) {
    item_probe p;
    memset(&p, 0, sizeof p);
    p.runs = calloc((size_t)n, sizeof *p.runs);
    assert_non_null(p.runs);
    assert_int_equal(af_parallel_for(n, probe_item, &p, 128), AF_OK);
    for (int64_t i = 0; i < n; i++)
        if (atomic_load(&p.runs[i]) != 1)
            fail_msg("%s, %lld items: item %lld ran %d times", what, (long long)n, (long long)i, atomic_load(&p.runs[i]));
    assert_int_equal(atomic_load(&p.out_of_order), 0);
    assert_int_equal(atomic_load(&p.trampled), 0);
    assert_int_equal(atomic_load(&p.misaligned), 0);
    free(p.runs);
}

static void lent_executor_runs_the_work(void **state) {
    (void)state;
    test_executor e;
    lend(&e, TEAM_THREADS, 3);
    assert_int_equal(af_get_num_threads(), 3);   /* the executor's count, af_set_num_threads being 0 */
    check_items(1000, "3-thread team");
    assert_int_equal(atomic_load(&e.regions), 1);
    assert_int_equal(atomic_load(&e.last_n_threads), 3);
    assert_int_equal(atomic_load(&e.tasks), 3);
    check_items(2, "2 items on a 3-thread team");   /* never more threads than items */
    assert_int_equal(atomic_load(&e.last_n_threads), 2);
    check_items(1, "1 item");                       /* one item: the caller alone, the executor not entered */
    assert_int_equal(atomic_load(&e.regions), 2);
    assert_int_equal(atomic_load(&e.reentered), 0);
    take_back();
}

static void set_num_threads_overrides_the_executor_count(void **state) {
    (void)state;
    test_executor e;
    lend(&e, TEAM_THREADS, 3);
    af_set_num_threads(5);
    assert_int_equal(af_get_num_threads(), 5);
    check_items(777, "5 threads asked");
    assert_int_equal(atomic_load(&e.last_n_threads), 5);
    af_set_num_threads(1);   /* one thread: the executor is not entered */
    check_items(100, "1 thread asked");
    assert_int_equal(atomic_load(&e.regions), 1);
    e.max_threads = 0;   /* a count below 1 means 1 */
    af_set_num_threads(0);
    assert_int_equal(af_get_num_threads(), 1);
    take_back();
}

static void taking_the_executor_back_restores_the_pool(void **state) {
    (void)state;
    test_executor e;
    lend(&e, TEAM_THREADS, 2);
    const af_parallel_executor no_parallel = {.parallel = NULL, .max_threads = test_max_threads, .user = &e};
    af_set_parallel_executor(&no_parallel);   /* no parallel: the pool, as NULL */
    af_set_num_threads(2);
    check_items(500, "own pool");
    assert_int_equal(atomic_load(&e.regions), 0);
    af_set_num_threads(0);
    assert_true(af_get_num_threads() >= 1);
    take_back();
}

/* Executors that run the indices one after another, only the last, or none: every item still runs exactly once. */
static void short_teams_lose_nothing(void **state) {
    (void)state;
    static const team_kind kinds[] = {TEAM_IN_TURN, TEAM_LAST_ONLY, TEAM_NONE};
    static const char *const names[] = {"in turn", "last index only", "no index"};
    static const int64_t counts[] = {2, 3, 64, 1001};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++)
        for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
            test_executor e;
            lend(&e, kinds[k], 4);
            check_items(counts[c], names[k]);
            assert_int_equal(atomic_load(&e.regions), 1);
            take_back();
        }
}

/* ------------------------------------------------------------------ nesting and concurrency */

typedef struct { atomic_int runs[16 * 8]; atomic_int failures; } nest;
typedef struct { atomic_int *runs; } inner_ctx;

static void inner_item(void *ctx, int64_t item, void *scratch) {
    (void)scratch;
    atomic_fetch_add(&((inner_ctx *)ctx)->runs[item], 1);
}

static void outer_item(void *ctx, int64_t item, void *scratch) {
    (void)scratch;
    nest *n = ctx;
    inner_ctx inner = {n->runs + item * 8};
    if (af_parallel_for(8, inner_item, &inner, 64) != AF_OK) atomic_fetch_add(&n->failures, 1);
}

/* A parallel-for from inside a task runs on its thread alone: the executor is entered once, never re-entered. */
static void calls_from_inside_a_task_run_alone(void **state) {
    (void)state;
    test_executor e;
    lend(&e, TEAM_THREADS, 4);
    nest n;
    memset(&n, 0, sizeof n);
    assert_int_equal(af_parallel_for(16, outer_item, &n, 64), AF_OK);
    assert_int_equal(atomic_load(&n.failures), 0);
    for (int i = 0; i < 16 * 8; i++) assert_int_equal(atomic_load(&n.runs[i]), 1);
    assert_int_equal(atomic_load(&e.regions), 1);
    assert_int_equal(atomic_load(&e.reentered), 0);
    take_back();
}

/* ---- af_sdpa's bits under executors, thread counts, nesting and concurrent callers */

typedef struct {
    const char *name;
    case_tensors t;
    unsigned char *pool_out, *pool_lse;   /* the built-in pool's result, 2 threads */
} sdpa_fixture;

#define CASES 3
static sdpa_fixture cases[CASES];

static void build_cases(void) {
    const sdpa_case prefill = case_default(1, 4, 2, 96, 96, 32, 32);
    sdpa_case causal = case_default(2, 4, 4, 70, 70, 16, 16);
    causal.is_causal = true;
    causal.dtype = AF_BF16;
    const sdpa_case decode = case_default(1, 8, 2, 1, 2100, 16, 16);   /* split-KV: two parallel-fors a call */
    const sdpa_case shapes[CASES] = {prefill, causal, decode};
    static const char *const names[CASES] = {"prefill", "causal bf16", "split-KV decode"};
    for (int i = 0; i < CASES; i++) {
        cases[i].name = names[i];
        sdpa_case c = shapes[i];
        c.seed = 100 + (uint64_t)i;
        assert_true(case_build(&c, &cases[i].t));
        assert_int_equal(case_run_kernel(&cases[i].t, af_get_isa(), 2), AF_OK);
        char why[512];
        if (!case_matches_reference(&cases[i].t, NULL, why, sizeof why)) fail_msg("%s: %s", names[i], why);
        cases[i].pool_out = tt_snapshot(&cases[i].t.out);
        cases[i].pool_lse = tt_snapshot(&cases[i].t.lse);
    }
    af_set_num_threads(0);
}

static void free_cases(void) {
    for (int i = 0; i < CASES; i++) {
        case_free(&cases[i].t);
        free(cases[i].pool_out);
        free(cases[i].pool_lse);
    }
}

/* af_sdpa on case i into out/lse of its own (the case's tensors are shared between threads); bits as the pool's. */
static bool same_bits_as_pool(int i) {
    case_tensors *t = &cases[i].t;
    test_tensor out, lse;
    test_rng rng = {1};
    if (!tt_alloc(&out, t->out.view.dtype, t->out.view.ndim, t->out.view.shape, LAYOUT_CONTIGUOUS, &rng)) return false;
    if (!tt_alloc(&lse, AF_F32, t->lse.view.ndim, t->lse.view.shape, LAYOUT_CONTIGUOUS, &rng)) return false;
    tt_fill_bytes(&out, TT_SENTINEL_BYTE);   /* as case_run_kernel fills the pool's run */
    tt_fill_bytes(&lse, TT_SENTINEL_BYTE);
    const af_status st = af_sdpa(&t->args, &out.view, &lse.view);
    const bool same = st == AF_OK && tt_same_as(&out, cases[i].pool_out) && tt_same_as(&lse, cases[i].pool_lse);
    tt_free(&out);
    tt_free(&lse);
    return same;
}

static void sdpa_bits_equal_the_pool(void **state) {
    (void)state;
    static const team_kind kinds[] = {TEAM_THREADS, TEAM_IN_TURN, TEAM_LAST_ONLY, TEAM_NONE};
    static const int counts[] = {2, 3, 4, 7};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++)
        for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
            test_executor e;
            lend(&e, kinds[k], counts[c]);
            for (int i = 0; i < CASES; i++)
                if (!same_bits_as_pool(i))
                    fail_msg("%s: executor kind %d, %d threads: not the pool's bits", cases[i].name, (int)kinds[k],
                             counts[c]);
            assert_true(atomic_load(&e.regions) >= CASES);   /* every call went through the executor */
            take_back();
        }
}

typedef struct { atomic_int wrong; atomic_int calls; } region_result;

/* Each thread of the host's own parallel region calls af_sdpa, as when attnforge is called from inside an OpenMP
 * region: the first to come may enter the executor (a nested team), the others find its work in flight and run
 * alone. */
static void sdpa_in_region(void *ctx, int thread_index) {
    region_result *r = ctx;
    for (int round = 0; round < 3; round++) {
        const int i = (thread_index + round) % CASES;
        if (!same_bits_as_pool(i)) atomic_fetch_add(&r->wrong, 1);
        atomic_fetch_add(&r->calls, 1);
    }
}

static void calls_from_inside_the_executors_region(void **state) {
    (void)state;
    test_executor e, host;
    lend(&e, TEAM_THREADS, 2);
    memset(&host, 0, sizeof host);
    host.kind = TEAM_THREADS;
    region_result r;
    memset(&r, 0, sizeof r);
    test_parallel(4, sdpa_in_region, &r, &host);   /* the host's own region, entered by the host */
    assert_int_equal(atomic_load(&r.calls), 4 * 3);
    assert_int_equal(atomic_load(&r.wrong), 0);
    assert_int_equal(atomic_load(&e.reentered), 0);
    take_back();
}

typedef struct { int first_case; atomic_int *wrong; } caller_arg;

static void *call_repeatedly(void *arg) {
    caller_arg *a = arg;
    for (int round = 0; round < 6; round++)
        if (!same_bits_as_pool((a->first_case + round) % CASES)) atomic_fetch_add(a->wrong, 1);
    return NULL;
}

/* Six threads call af_sdpa at once under a lent executor: one at a time enters it, the others run alone. */
static void concurrent_callers_under_an_executor(void **state) {
    (void)state;
    test_executor e;
    lend(&e, TEAM_THREADS, 3);
    atomic_int wrong;
    atomic_init(&wrong, 0);
    pthread_t callers[6];
    caller_arg args[6];
    for (int i = 0; i < 6; i++) {
        args[i] = (caller_arg){i % CASES, &wrong};
        assert_int_equal(pthread_create(&callers[i], NULL, call_repeatedly, &args[i]), 0);
    }
    for (int i = 0; i < 6; i++) assert_int_equal(pthread_join(callers[i], NULL), 0);
    assert_int_equal(atomic_load(&wrong), 0);
    assert_int_equal(atomic_load(&e.reentered), 0);
    assert_true(atomic_load(&e.regions) >= 1);
    take_back();
}

/* Lending and taking back while other threads call: each call uses one or the other, whole. */
static void *swap_executors(void *arg) {
    test_executor *e = arg;
    const af_parallel_executor lent = {.parallel = test_parallel, .max_threads = test_max_threads, .user = e};
    for (int i = 0; i < 200; i++) {
        af_set_parallel_executor(i % 2 ? NULL : &lent);
        sched_yield();
    }
    return NULL;
}

static void lending_while_calls_run(void **state) {
    (void)state;
    test_executor e;
    lend(&e, TEAM_THREADS, 2);
    atomic_int wrong;
    atomic_init(&wrong, 0);
    pthread_t swapper, callers[3];
    caller_arg args[3];
    assert_int_equal(pthread_create(&swapper, NULL, swap_executors, &e), 0);
    for (int i = 0; i < 3; i++) {
        args[i] = (caller_arg){i, &wrong};
        assert_int_equal(pthread_create(&callers[i], NULL, call_repeatedly, &args[i]), 0);
    }
    for (int i = 0; i < 3; i++) assert_int_equal(pthread_join(callers[i], NULL), 0);
    assert_int_equal(pthread_join(swapper, NULL), 0);
    assert_int_equal(atomic_load(&wrong), 0);
    take_back();
}

static int setup(void **state) {
    (void)state;
    build_cases();
    return 0;
}

static int teardown(void **state) {
    (void)state;
    free_cases();
    return 0;
}

int main(void) {
    alarm(WATCHDOG_SECONDS);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(lent_executor_runs_the_work),
        cmocka_unit_test(set_num_threads_overrides_the_executor_count),
        cmocka_unit_test(taking_the_executor_back_restores_the_pool),
        cmocka_unit_test(short_teams_lose_nothing),
        cmocka_unit_test(calls_from_inside_a_task_run_alone),
        cmocka_unit_test(sdpa_bits_equal_the_pool),
        cmocka_unit_test(calls_from_inside_the_executors_region),
        cmocka_unit_test(concurrent_callers_under_an_executor),
        cmocka_unit_test(lending_while_calls_run),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
