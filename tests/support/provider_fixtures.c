#include "provider_fixtures.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

char *fx_json(const char *text) {
    char *json = strdup(text);
    for (char *c = json; c && *c; c++)
        if (*c == '\'') *c = '"';
    return json;
}

af_samples *fx_samples(const char *text) {
    char *json = fx_json(text);
    af_samples *samples = NULL;
    af_samples_from_json(json, strlen(json), &samples);
    free(json);
    return samples;
}

bool fx_prepare(const char *text, af_plan *plan, char *reason, size_t reason_size) {
    af_samples *samples = fx_samples(text);
    if (!samples) {
        if (reason) snprintf(reason, reason_size, "parse: %s", af_last_error());
        return false;
    }
    af_provider *p = af_provider_new();
    bool ok = af_provider_prepare(p, samples);
    if (ok && plan) af_provider_get_plan(p, plan);
    if (reason) snprintf(reason, reason_size, "%s", af_provider_reason(p));
    af_provider_free(p);
    af_samples_free(samples);
    return ok;
}

af_status fx_plan_from(const char *text, af_provider **out) {
    char *json = fx_json(text);
    af_status st = af_provider_from_json(json, strlen(json), out);
    free(json);
    return st;
}

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static char log_text[1 << 16];
static int log_messages;
static char *log_each[256];

static void keep(af_log_level level, const char *message, void *user) {
    (void)level;
    (void)user;
    pthread_mutex_lock(&log_lock);
    size_t used = strlen(log_text);
    snprintf(log_text + used, sizeof log_text - used, "%s\n", message);
    if (log_messages < 256) log_each[log_messages++] = strdup(message);
    pthread_mutex_unlock(&log_lock);
}

void fx_log_start(void) {
    fx_log_stop();
    af_set_log_callback(keep, NULL, AF_LOG_DEBUG);
}

const char *fx_log_text(void) { return log_text; }

int fx_log_count(const char *needle) {
    int n = 0;
    pthread_mutex_lock(&log_lock);
    for (int i = 0; i < log_messages; i++) n += strstr(log_each[i], needle) != NULL;
    pthread_mutex_unlock(&log_lock);
    return n;
}

void fx_log_stop(void) {
    af_set_log_callback(NULL, NULL, AF_LOG_OFF);
    pthread_mutex_lock(&log_lock);
    for (int i = 0; i < log_messages; i++) free(log_each[i]);
    log_messages = 0;
    log_text[0] = '\0';
    pthread_mutex_unlock(&log_lock);
}
