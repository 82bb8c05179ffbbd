/* Status codes and the thread-local error message behind af_last_error(). */
#ifndef AF_CORE_STATUS_H
#define AF_CORE_STATUS_H
#include "attnforge.h"

/* Record a formatted message for af_last_error() and return `code` (so callers can `return af_fail(...)`). */
af_status af_fail(af_status code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Forget the last message: called at the start of every public entry point. */
void af_clear_error(void);

#endif
