#include "core/alloc.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"

static atomic_long fail_countdown;   /* > 0: counts down to the injected failure */
static atomic_long alloc_calls;

void af_test_fail_allocation(long n) { atomic_store(&fail_countdown, n); }
long af_alloc_count(void) { return atomic_load(&alloc_calls); }

void *af_alloc(size_t bytes) {
    atomic_fetch_add(&alloc_calls, 1);
    if (atomic_load(&fail_countdown) > 0 && atomic_fetch_sub(&fail_countdown, 1) == 1) return NULL;
    if (bytes == 0) bytes = 1;
    if (bytes > SIZE_MAX - 63) return NULL;
    void *p = NULL;
    if (posix_memalign(&p, 64, (bytes + 63) & ~(size_t)63) != 0) return NULL;
    return p;
}

void *af_alloc_zeroed(size_t bytes) {
    void *p = af_alloc(bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

char *af_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = af_alloc(n);
    if (p) memcpy(p, s, n);
    return p;
}

void af_free(void *ptr) { free(ptr); }
