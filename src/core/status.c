#include "core/status.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char last_error[1024];

af_status af_fail(af_status code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return code;
}

void af_clear_error(void) { last_error[0] = '\0'; }

const char *af_last_error(void) { return last_error; }

const char *af_version(void) { return AF_VERSION_STRING; }

const char *af_status_name(af_status status) {
    switch (status) {
    case AF_OK: return "AF_OK";
    case AF_ERR_INVALID_ARGUMENT: return "AF_ERR_INVALID_ARGUMENT";
    case AF_ERR_UNSUPPORTED: return "AF_ERR_UNSUPPORTED";
    case AF_ERR_NO_MEMORY: return "AF_ERR_NO_MEMORY";
    case AF_ERR_RUNTIME_UNAVAILABLE: return "AF_ERR_RUNTIME_UNAVAILABLE";
    case AF_ERR_PARSE: return "AF_ERR_PARSE";
    case AF_ERR_IO: return "AF_ERR_IO";
    case AF_ERR_PLAN_MISMATCH: return "AF_ERR_PLAN_MISMATCH";
    case AF_ERR_NOT_PREPARED: return "AF_ERR_NOT_PREPARED";
    case AF_ERR_INTERNAL: return "AF_ERR_INTERNAL";
    }
    return "AF_ERR_UNKNOWN";
}
