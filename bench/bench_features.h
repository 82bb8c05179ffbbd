/* `attnforge bench --features`: what af_flash_attn's features cost against the plain call they replace — a
 * sliding window against full attention, a varlen batch against the same batch padded, paged decode against
 * contiguous decode, decode from a float8 K/V cache against an f16/bf16 one — each pair timed with interleaved calls
 * in one run. */
#ifndef AF_BENCH_FEATURES_H
#define AF_BENCH_FEATURES_H
#include <stdbool.h>
#include <stdint.h>

#include "attnforge.h"

typedef struct {
    int reps;
    bool json;
    int64_t length;        /* the window pair's L = S and the paged pair's S; the varlen batch's longest is length/4 */
    int64_t window;        /* the window's left size (right = 0) */
    int64_t heads, head_dim;   /* the prefill pairs' H (= Hkv) and E = Ev; decode uses Hq/Hkv 32/8 and head_dim */
    bool dtype_given;
    af_dtype dtype;        /* the only dtype when dtype_given, else float32 and bfloat16 */
    int64_t page_size;     /* the paged pair's keys per page */
    af_dtype kv_dtype;     /* the float8 pair's K/V format (AF_F8E4M3 or AF_F8E5M2); its S is 4·length */
    const char *only;      /* NULL, or the one pair to run ("window_vs_full", ..., "fp8_vs_f16") */
} bench_features_options;

/* Prints the rows and one comparison per pair; returns the number of failed calls or disagreeing pairs. */
int bench_features(const bench_features_options *o, int threads);

#endif
