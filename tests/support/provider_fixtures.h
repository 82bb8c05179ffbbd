/* Fixtures for the provider tests: samples written as JSON with single quotes, prepare in one call, and a
 * log callback that keeps every message. */
#ifndef AF_TESTS_PROVIDER_FIXTURES_H
#define AF_TESTS_PROVIDER_FIXTURES_H
#include <stdbool.h>
#include <stddef.h>

#include "attnforge.h"

/* `text` with every ' turned into " (JSON is easier to read in C strings that way); free with free(). */
char *fx_json(const char *text);
/* Samples from single-quoted JSON; NULL (and af_last_error) when it does not parse. */
af_samples *fx_samples(const char *text);
/* Parse and prepare: the result of prepare, the plan when true, the reason when false (reason may be NULL). */
bool fx_prepare(const char *text, af_plan *plan, char *reason, size_t reason_size);
/* A plan from single-quoted JSON: the status of af_provider_from_json, the provider in *out. */
af_status fx_plan_from(const char *text, af_provider **out);

/* Log capture: every message at DEBUG and above, joined with newlines. */
void fx_log_start(void);
const char *fx_log_text(void);
int fx_log_count(const char *needle);   /* messages containing `needle` */
void fx_log_stop(void);

#endif
