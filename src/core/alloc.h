/* The library's one allocator: 64-byte aligned, with a failure-injection hook for tests. */
#ifndef AF_CORE_ALLOC_H
#define AF_CORE_ALLOC_H
#include <stddef.h>

void *af_alloc(size_t bytes);             /* 64-byte aligned; NULL on failure (or injected failure) */
void *af_alloc_zeroed(size_t bytes);
char *af_strdup(const char *s);
/* af_free (public) releases both. */

/* Test hook: make the n-th allocation from now fail (n = 1 is the next one); 0 disables.
 * af_alloc_count() counts allocations since the process started, so tests can find every site. */
void af_test_fail_allocation(long n);
long af_alloc_count(void);

#endif
