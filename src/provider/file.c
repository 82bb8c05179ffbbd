/* Whole-file reads with a clear AF_ERR_IO naming the path and the cause. */
#include "provider/file.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "core/alloc.h"
#include "core/status.h"

af_status af_read_text_file(const char *path, char **text, size_t *len) {
    *text = NULL;
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return af_fail(AF_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    size_t capacity = 4096, used = 0;
    char *buffer = af_alloc(capacity);
    af_status st = buffer ? AF_OK : af_fail(AF_ERR_NO_MEMORY, "%s: out of memory", path);
    while (st == AF_OK) {
        if (used + 1 >= capacity) {
            if (capacity >= AF_MAX_JSON_FILE_BYTES) {
                st = af_fail(AF_ERR_IO, "%s: larger than %u MiB; not a samples or plan file", path,
                             AF_MAX_JSON_FILE_BYTES >> 20);
                break;
            }
            char *grown = af_alloc(capacity * 2);
            if (!grown) {
                st = af_fail(AF_ERR_NO_MEMORY, "%s: out of memory", path);
                break;
            }
            memcpy(grown, buffer, used);
            af_free(buffer);
            buffer = grown;
            capacity *= 2;
        }
        size_t got = fread(buffer + used, 1, capacity - 1 - used, f);
        used += got;
        if (got == 0) {
            if (ferror(f)) st = af_fail(AF_ERR_IO, "%s: cannot read: %s", path, strerror(errno));
            break;
        }
    }
    fclose(f);
    if (st != AF_OK) {
        af_free(buffer);
        return st;
    }
    buffer[used] = '\0';
    *text = buffer;
    *len = used;
    return AF_OK;
}

af_status af_error_with_path(af_status st, const char *path) {
    if (st == AF_OK) return AF_OK;
    char message[1024];   /* af_last_error is the buffer af_fail writes: copy it first */
    snprintf(message, sizeof message, "%s", af_last_error());
    return af_fail(st, "%s: %s", path, message);
}
