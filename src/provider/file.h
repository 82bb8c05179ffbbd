/* Whole-file reads for the samples and plan files. */
#ifndef AF_PROVIDER_FILE_H
#define AF_PROVIDER_FILE_H
#include <stddef.h>

#include "attnforge.h"

#define AF_MAX_JSON_FILE_BYTES (256u << 20)   /* a samples or plan file is small; refuse anything absurd */

/* Read `path` into a NUL-terminated buffer (free with af_free). AF_ERR_IO naming the path and the cause. */
af_status af_read_text_file(const char *path, char **text, size_t *len);

/* `st` unchanged, with `path: ` put before af_last_error()'s message when it is an error. */
af_status af_error_with_path(af_status st, const char *path);

#endif
