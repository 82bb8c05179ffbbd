/* attnforge's own pool in a child of fork(): the child has none of the parent's workers, and its parallel calls must
 * still run every item (torch.utils.data forks its worker processes after the parent ran attnforge). A child that
 * waits for the parent's workers is killed by its alarm and fails the test. Not under TSan (fork of a threaded
 * process is outside what it supports). */
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "attnforge.h"
#include "core/threadpool.h"

#define ITEMS 1000
#define CHILD_SECONDS 60   /* far beyond the child's milliseconds of work: only a deadlock reaches it */

static void count_item(void *ctx, int64_t item, void *scratch) {
    (void)scratch;
    atomic_fetch_add(&((atomic_int *)ctx)[item], 1);
}

/* Every item of ITEMS exactly once on `threads` threads. */
static bool all_items_once(int threads) {
    static atomic_int runs[ITEMS];
    for (int i = 0; i < ITEMS; i++) atomic_store(&runs[i], 0);
    af_set_num_threads(threads);
    if (af_parallel_for(ITEMS, count_item, runs, 64) != AF_OK) return false;
    for (int i = 0; i < ITEMS; i++)
        if (atomic_load(&runs[i]) != 1) return false;
    return true;
}

static void child_of_fork_runs_its_calls(void **state) {
    (void)state;
    assert_true(all_items_once(3));   /* the parent's pool: two workers */
    const pid_t child = fork();
    assert_true(child >= 0);
    if (child == 0) {
        alarm(CHILD_SECONDS);
        const bool ok = all_items_once(3) && all_items_once(2) && all_items_once(3);
        _exit(ok ? 0 : 1);
    }
    int status = 0;
    assert_int_equal(waitpid(child, &status, 0), child);
    if (WIFSIGNALED(status)) fail_msg("the child was killed by signal %d (a deadlock ends with SIGALRM)", WTERMSIG(status));
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    assert_true(all_items_once(3));   /* and the parent's pool still works */
    af_set_num_threads(0);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(child_of_fork_runs_its_calls)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
