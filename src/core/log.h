/* Logging through the embedding program's callback; silent by default. */
#ifndef AF_CORE_LOG_H
#define AF_CORE_LOG_H
#include "attnforge.h"

void af_log(af_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
bool af_log_enabled(af_log_level level);

#endif
