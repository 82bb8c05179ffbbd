#include "bench_memory.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

/* The value of a "Key:   123 kB" line of /proc/self/status, in MiB. */
static double status_mib(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1.0;
    char line[256];
    double mib = -1.0;
    const size_t len = strlen(key);
    while (fgets(line, sizeof line, f)) {
        long kib;
        if (!strncmp(line, key, len) && line[len] == ':' && sscanf(line + len + 1, "%ld", &kib) == 1) {
            mib = (double)kib / 1024.0;
            break;
        }
    }
    fclose(f);
    return mib;
}

double bench_reset_peak_rss_mib(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f) return -1.0;
    const bool ok = fputs("5", f) >= 0;   /* 5: reset the peak RSS to the current RSS */
    if (fclose(f) != 0 || !ok) return -1.0;
    return status_mib("VmRSS");
}

double bench_peak_rss_mib(void) { return status_mib("VmHWM"); }

void bench_cpu_name(char *buf, size_t size) {
    snprintf(buf, size, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[256];
    while (fgets(line, sizeof line, f)) {
        char *colon = strchr(line, ':');
        if (!strncmp(line, "model name", 10) && colon) {
            colon += 2;
            colon[strcspn(colon, "\n")] = 0;
            snprintf(buf, size, "%s", colon);
            break;
        }
    }
    fclose(f);
}
