/* Process memory and machine facts for the benchmark (Linux /proc; -1 / "unknown" elsewhere). */
#ifndef AF_BENCH_MEMORY_H
#define AF_BENCH_MEMORY_H
#include <stddef.h>

/* Reset the peak-RSS mark to the current RSS (/proc/self/clear_refs) and return that RSS in MiB; -1 if unsupported. */
double bench_reset_peak_rss_mib(void);
/* Peak RSS since the last reset (VmHWM), MiB; -1 if unknown. */
double bench_peak_rss_mib(void);
/* The CPU's model name. */
void bench_cpu_name(char *buf, size_t size);

#endif
