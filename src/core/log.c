#include "core/log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static af_log_fn log_fn;
static void *log_user;
static af_log_level log_min = AF_LOG_OFF;

void af_set_log_callback(af_log_fn fn, void *user, af_log_level min_level) {
    pthread_mutex_lock(&log_lock);
    log_fn = fn;
    log_user = user;
    log_min = fn ? min_level : AF_LOG_OFF;
    pthread_mutex_unlock(&log_lock);
}

bool af_log_enabled(af_log_level level) {
    pthread_mutex_lock(&log_lock);
    bool on = log_fn != NULL && level >= log_min;
    pthread_mutex_unlock(&log_lock);
    return on;
}

void af_log(af_log_level level, const char *fmt, ...) {
    if (!af_log_enabled(level)) return;
    char message[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    /* called outside the lock: a callback that takes its own locks (Python's GIL) cannot deadlock against a
     * thread that is setting the callback; a message in flight may still reach the callback just replaced */
    pthread_mutex_lock(&log_lock);
    af_log_fn fn = level >= log_min ? log_fn : NULL;
    void *user = log_user;
    pthread_mutex_unlock(&log_lock);
    if (fn) fn(level, message, user);
}
