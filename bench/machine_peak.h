/* The machine's ceilings, measured in the same run as the benchmark they are compared with. */
#ifndef AF_BENCH_MACHINE_PEAK_H
#define AF_BENCH_MACHINE_PEAK_H
#include <stddef.h>

#include "attnforge.h"

#define BENCH_BANDWIDTH_BYTES ((size_t)256 << 20)   /* the read passes' buffer: far larger than the L3 */

/* f32 FMA throughput of `threads` threads, each running independent FMA chains on the vectors of `isa`
 * ("avx512": 16-wide, "avx2": 8-wide; "portable": the avx2 loop when the CPU has it, else scalar C); "amx": the
 * bf16 tdpbf16ps tile loop instead (amx_peak.h), where the machine and the build have it; "avx512-bf16": vdpbf16ps
 * chains (64 FLOP an instruction), where the bf16 rows run on the AVX512-BF16 products (else the avx512 FMA loop).
 * Best of a few trials, GFLOP/s (an FMA counts 2). *per_cpu_second (if not NULL): the same FLOPs over the CPU
 * time the threads actually got — one core's peak, unaffected by other processes preempting them. */
double bench_fma_peak_gflops(const char *isa, int threads, double *per_cpu_second);

/* Streaming read bandwidth of `threads` threads summing a `bytes` buffer (best of a few passes), GB/s. */
double bench_read_bandwidth_gbps(int threads, size_t bytes);

/* One timed read pass over `count` chunks of `chunk_bytes` bytes each (64-byte aligned; a tail under 128 bytes is
 * not read), in the
 * list's order, the list split into `threads` consecutive shares; seconds. What an order of pages costs the memory
 * system alone: the same chunks listed in address order are the contiguous read. */
double bench_read_chunks_seconds(int threads, const char *const *chunks, size_t count, size_t chunk_bytes);

/* One short sample of each (an FMA trial of about 20 ms; one read pass over a buffer allocated on the first
 * call and kept until bench_machine_release): the ceiling *now*, to pair with one timed call on a machine whose
 * speed drifts (shared hosts, boost clocks). */
double bench_fma_peak_sample_gflops(const char *isa, int threads, double *per_cpu_second);
double bench_read_bandwidth_sample_gbps(int threads, size_t bytes);
void bench_machine_release(void);

/* Run fn(arg, t) on `threads` threads at once (t = 0..threads-1; the caller runs t = 0). */
void bench_on_threads(int threads, void (*fn)(void *arg, int t), void *arg);

/* The ceiling a row's calls are measured against: the FMA loop of the row's ISA, except that "amx" runs only bf16
 * on the tiles (against the tile loop) and everything else on its AVX-512 vectors (against their FMA loop), and
 * bf16 on "avx512" with the AVX512-BF16 products is measured against the vdpbf16ps loop ("avx512-bf16"). */
const char *bench_peak_kind(const char *isa, af_dtype dtype);

#endif
