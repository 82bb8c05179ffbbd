/* `attnforge bench --features`: three pairs of af_flash_attn calls, each feature against the plain call it
 * replaces, timed with interleaved calls (a, b, a, b, ...) so that both sides of a ratio see the same machine:
 *   window  (W, 0) at L = S          vs  full attention at the same shape       cost ratio, target <= 1/10
 *   varlen  causal, mixed lengths    vs  the batch padded to the longest        ratio vs the useful-work share
 *   paged   decode, P-key pages in shuffled order  vs  contiguous decode        ratio, target <= 1.10
 *   fp8     decode from a float8 K/V cache  vs  the same values in q's f16/bf16  ratio, target <= 1/1.8
 * Each pair's outputs are also compared where both compute the same rows: the two calls must do the same work. */
#include "bench_features.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "cli_common.h"
#include "core/dtype.h"
#include "machine_peak.h"
#include "sdpa/tolerance.h"

#define MAX_SEQS 8
#define DECODE_HQ 32
#define DECODE_HKV 8
#define DECODE_BATCH 4
#define FP8_BATCH 1
#define FP8_TARGET (1.0 / 1.8)   /* issue 13: decode from a float8 cache >= 1.8x as fast as from an f16 one */

typedef struct {
    const char *label, *form;        /* the case column and what the call runs */
    int64_t B, Hq, Hkv, L, S, E;     /* L, S: the longest sequence's */
    af_dtype dtype;
    bool decode;
    af_flash_args args;
    cli_tensor q, k, v, out, cu_seqlens, seqused, page_table;
    double flops;                    /* FA4's count over the keys each row actually sees */
    double kv_bytes;                 /* K + V bytes a call reads */
    /* per timed call */
    double times[64], cpu[64], peak[64], peak_cpu[64], gbps[64];
    bool ok;
} feature_call;

typedef struct {
    const char *name;                /* "window_vs_full", ... */
    feature_call a, b;               /* a: the feature, b: the plain call */
    double work_ratio;               /* a's FLOPs (decode: bytes) over b's */
    double target;                   /* time ratio to stay under; 0: none stated */
    double agreement;                /* max |out_a - out_b| over the shared rows / twice the error bound; < 0: none */
    /* The paged pair's memory floor: a's K/V pages and b's same bytes as chunks in the order each call reads them
     * (a's: each sequence's pages in table order; b's: address order), K and V alternating page by page */
    const char **chunks_a, **chunks_b;
    size_t chunk_count, chunk_bytes;
    double read_floor;               /* median time ratio of reading chunks_a over chunks_b; 0: none */
} feature_pair;

/* ---- shapes and tensors */

/* Keys row i of a sequence with Lq rows and S keys sees under bottom-right window (left, right): sides >= 0 here, or
 * AF_WINDOW_UNBOUNDED. */
static double keys_seen(int64_t Lq, int64_t S, int64_t left, int64_t right) {
    double total = 0.0;
    for (int64_t i = 0; i < Lq; i++) {
        const int64_t diagonal = i + S - Lq;
        const int64_t lo = left == AF_WINDOW_UNBOUNDED || diagonal - left < 0 ? 0 : diagonal - left;
        const int64_t hi = right != AF_WINDOW_UNBOUNDED && diagonal + right < S - 1 ? diagonal + right : S - 1;
        if (hi >= lo) total += (double)(hi - lo + 1);
    }
    return total;
}

static bool random_tensor(cli_tensor *t, af_dtype dtype, int ndim, const int64_t *shape, uint64_t *seed) {
    const af_tensor desc = af_tensor_contiguous(NULL, dtype, ndim, shape);
    return cli_tensor_random_like(t, &desc, seed, 1.0);
}

static bool int_tensor(cli_tensor *t, int ndim, const int64_t *shape) {
    return cli_tensor_zeros(t, AF_I32, ndim, shape);
}

/* q (B, L, Hq, E), k and v (B, S, Hkv, E), out (B, L, Hq, E): the fixed form. */
static bool fixed_call(feature_call *c, uint64_t *seed) {
    const int64_t qs[4] = {c->B, c->L, c->Hq, c->E}, ks[4] = {c->B, c->S, c->Hkv, c->E};
    if (!random_tensor(&c->q, c->dtype, 4, qs, seed) || !random_tensor(&c->k, c->dtype, 4, ks, seed) ||
        !random_tensor(&c->v, c->dtype, 4, ks, seed) || !cli_tensor_zeros(&c->out, c->dtype, 4, qs))
        return false;
    c->args.query = &c->q.view, c->args.key = &c->k.view, c->args.value = &c->v.view;
    c->kv_bytes = 2.0 * (double)(c->B * c->S * c->Hkv * c->E) * (double)af_dtype_size(c->dtype);
    return true;
}

static void free_call(feature_call *c) {
    cli_tensor *all[] = {&c->q, &c->k, &c->v, &c->out, &c->cu_seqlens, &c->seqused, &c->page_table};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) cli_tensor_free(all[i]);
}

static size_t row_bytes(const feature_call *c, int64_t heads) {
    return (size_t)(heads * c->E) * af_dtype_size(c->dtype);
}

/* Window (W, 0) against full attention, L = S = length, H heads. */
static bool window_pair(feature_pair *p, const bench_features_options *o, af_dtype dtype, uint64_t seed) {
    const int64_t H = o->heads, L = o->length, E = o->head_dim;
    p->name = "window_vs_full";
    p->a = (feature_call){.label = "window", .form = "window", .B = 1, .Hq = H, .Hkv = H, .L = L, .S = L, .E = E,
                          .dtype = dtype};
    p->b = p->a;
    p->b.label = "full", p->b.form = "full";
    p->a.args.has_window = true, p->a.args.window_left = o->window, p->a.args.window_right = 0;
    p->a.flops = 2.0 * (double)H * keys_seen(L, L, o->window, 0) * (double)(2 * E);
    p->b.flops = 2.0 * (double)H * keys_seen(L, L, AF_WINDOW_UNBOUNDED, AF_WINDOW_UNBOUNDED) * (double)(2 * E);
    p->work_ratio = p->a.flops / p->b.flops;
    p->target = 0.1;
    p->agreement = -1.0;
    uint64_t s2 = seed;
    return fixed_call(&p->a, &seed) && fixed_call(&p->b, &s2);
}

/* Causal self-attention over MAX_SEQS sequences of mixed lengths (the longest = length/4), packed, against the
 * same batch padded to the longest as a fixed (B, Lmax) call. Rows i < L_b of the padded call see keys j <= i
 * only, so they equal the packed sequence's rows: the outputs are compared there. */
static const int64_t varlen_sixteenths[MAX_SEQS] = {16, 2, 12, 4, 8, 1, 10, 6};

static int64_t varlen_length(int64_t longest, int b) {
    const int64_t n = longest * varlen_sixteenths[b] / 16;
    return n > 0 ? n : 1;
}

static bool varlen_pair(feature_pair *p, const bench_features_options *o, af_dtype dtype, uint64_t seed) {
    const int64_t H = o->heads, E = o->head_dim, longest = o->length / 4 > 0 ? o->length / 4 : 1;
    p->name = "varlen_vs_padded";
    p->a = (feature_call){.label = "varlen", .form = "varlen", .B = MAX_SEQS, .Hq = H, .Hkv = H, .L = longest,
                          .S = longest, .E = E, .dtype = dtype};
    p->b = p->a;
    p->b.label = "padded", p->b.form = "padded";
    p->a.args.causal = p->b.args.causal = true;
    p->agreement = -1.0;
    if (!fixed_call(&p->b, &seed)) return false;
    p->b.flops = MAX_SEQS * 2.0 * (double)H * keys_seen(longest, longest, AF_WINDOW_UNBOUNDED, 0) * (double)(2 * E);
    int64_t total = 0;
    for (int b = 0; b < MAX_SEQS; b++) total += varlen_length(longest, b);
    const int64_t packed[3] = {total, H, E}, cu_shape[1] = {MAX_SEQS + 1};
    feature_call *c = &p->a;
    if (!cli_tensor_zeros(&c->q, dtype, 3, packed) || !cli_tensor_zeros(&c->k, dtype, 3, packed) ||
        !cli_tensor_zeros(&c->v, dtype, 3, packed) || !cli_tensor_zeros(&c->out, dtype, 3, packed) ||
        !int_tensor(&c->cu_seqlens, 1, cu_shape))
        return false;
    int32_t *cu = c->cu_seqlens.memory;
    const size_t row = row_bytes(c, H);
    c->flops = 0.0;
    for (int b = 0; b < MAX_SEQS; b++) {   /* sequence b = the first L_b rows of the padded batch's entry b */
        const int64_t n = varlen_length(longest, b);
        cu[b + 1] = cu[b] + (int32_t)n;
        const size_t from = (size_t)(b * longest) * row, to = (size_t)cu[b] * row, bytes = (size_t)n * row;
        memcpy((char *)c->q.memory + to, (const char *)p->b.q.memory + from, bytes);
        memcpy((char *)c->k.memory + to, (const char *)p->b.k.memory + from, bytes);
        memcpy((char *)c->v.memory + to, (const char *)p->b.v.memory + from, bytes);
        c->flops += 2.0 * (double)H * keys_seen(n, n, AF_WINDOW_UNBOUNDED, 0) * (double)(2 * E);
    }
    c->args.query = &c->q.view, c->args.key = &c->k.view, c->args.value = &c->v.view;
    c->args.cu_seqlens_q = c->args.cu_seqlens_k = &c->cu_seqlens.view;
    c->args.max_seqlen_q = c->args.max_seqlen_k = longest;
    c->kv_bytes = 2.0 * (double)(total * H * E) * (double)af_dtype_size(dtype);
    p->work_ratio = c->flops / p->b.flops;
    return true;
}

/* Decode (one query row) over S = length keys for DECODE_BATCH sequences: K/V in pages of page_size keys placed
 * in a shuffled order, against the same K/V contiguous. The outputs must agree everywhere. */
static bool paged_pair(feature_pair *p, const bench_features_options *o, af_dtype dtype, uint64_t seed) {
    const int64_t S = o->length, E = o->head_dim, B = DECODE_BATCH, page_keys = o->page_size;
    p->name = "paged_vs_contiguous";
    p->b = (feature_call){.label = "contig", .form = "contiguous", .B = B, .Hq = DECODE_HQ, .Hkv = DECODE_HKV, .L = 1,
                          .S = S, .E = E, .dtype = dtype, .decode = true};
    p->a = p->b;
    p->a.label = "paged", p->a.form = "paged";
    p->target = 1.1;
    p->agreement = -1.0;
    if (!fixed_call(&p->b, &seed)) return false;
    p->a.flops = p->b.flops = 2.0 * (double)(B * DECODE_HQ) * (double)S * (double)(2 * E);
    p->work_ratio = 1.0;
    feature_call *c = &p->a;
    const int64_t per_seq = (S + page_keys - 1) / page_keys, pages = B * per_seq;
    const int64_t paged[4] = {pages, page_keys, DECODE_HKV, E}, table_shape[2] = {B, per_seq}, used_shape[1] = {B};
    const int64_t qs[4] = {B, 1, DECODE_HQ, E};
    if (!cli_tensor_zeros(&c->q, dtype, 4, qs) || !cli_tensor_zeros(&c->out, dtype, 4, qs) ||
        !cli_tensor_zeros(&c->k, dtype, 4, paged) || !cli_tensor_zeros(&c->v, dtype, 4, paged) ||
        !int_tensor(&c->page_table, 2, table_shape) || !int_tensor(&c->seqused, 1, used_shape))
        return false;
    memcpy(c->q.memory, p->b.q.memory, (size_t)B * row_bytes(c, DECODE_HQ));
    int32_t *table = c->page_table.memory, *used = c->seqused.memory;
    for (int64_t i = 0; i < pages; i++) table[i] = (int32_t)i;
    for (int64_t i = pages - 1; i > 0; i--) {   /* Fisher-Yates with xorshift: a reproducible shuffle */
        seed ^= seed >> 12, seed ^= seed << 25, seed ^= seed >> 27;
        const int64_t j = (int64_t)((seed * 2685821657736338717ull) % (uint64_t)(i + 1));
        const int32_t t = table[i];
        table[i] = table[j], table[j] = t;
    }
    const size_t row = row_bytes(c, DECODE_HKV);
    for (int64_t b = 0; b < B; b++) {
        used[b] = (int32_t)S;
        for (int64_t page = 0; page < per_seq; page++) {   /* keys [page·P, page·P + P) of sequence b */
            const int64_t first = page * page_keys, n = S - first < page_keys ? S - first : page_keys;
            const size_t from = (size_t)(b * S + first) * row, to = (size_t)table[b * per_seq + page] * page_keys * row;
            memcpy((char *)c->k.memory + to, (const char *)p->b.k.memory + from, (size_t)n * row);
            memcpy((char *)c->v.memory + to, (const char *)p->b.v.memory + from, (size_t)n * row);
        }
    }
    const int64_t whole = S / page_keys;   /* the floor reads whole pages only */
    p->chunk_count = (size_t)(2 * B * whole), p->chunk_bytes = (size_t)page_keys * row;
    p->chunks_a = malloc(p->chunk_count * sizeof *p->chunks_a);
    p->chunks_b = malloc(p->chunk_count * sizeof *p->chunks_b);
    if (!p->chunks_a || !p->chunks_b) return false;
    for (int64_t b = 0, n = 0; b < B; b++)
        for (int64_t page = 0; page < whole; page++, n += 2) {
            const size_t from = (size_t)(b * S + page * page_keys) * row;
            const size_t to = (size_t)table[b * per_seq + page] * (size_t)page_keys * row;
            p->chunks_a[n] = (const char *)c->k.memory + to, p->chunks_a[n + 1] = (const char *)c->v.memory + to;
            p->chunks_b[n] = (const char *)p->b.k.memory + from;
            p->chunks_b[n + 1] = (const char *)p->b.v.memory + from;
        }
    c->args.query = &c->q.view, c->args.key = &c->k.view, c->args.value = &c->v.view;
    c->args.page_table = &c->page_table.view, c->args.seqused_k = &c->seqused.view;
    c->kv_bytes = p->b.kv_bytes;
    return true;
}

/* Decode (B = 1, Hq/Hkv 32/8) over S = length keys from a float8 K/V cache against a cache in q's dtype (f16 for a
 * float32 pair: a float8 cache serves half-precision models) holding the very same values (every e4m3fn and e5m2
 * value is exact in f16 and in bf16). The two calls compute the same thing, the outputs must agree within the bound
 * (bit for bit when both take the same tiles; a multi-head direct item's keys per tile follow its bytes per key). */
static bool fp8_pair(feature_pair *p, const bench_features_options *o, af_dtype dtype, uint64_t seed) {
    const af_dtype q_dtype = dtype == AF_F32 ? AF_F16 : dtype, f8 = o->kv_dtype;
    const int64_t S = 4 * o->length, E = o->head_dim;   /* 32768 by default: a long context's decode */
    p->name = "fp8_vs_f16";
    p->b = (feature_call){.label = q_dtype == AF_BF16 ? "bf16kv" : "f16kv", .form = "contiguous", .B = FP8_BATCH,
                          .Hq = DECODE_HQ, .Hkv = DECODE_HKV, .L = 1, .S = S, .E = E, .dtype = q_dtype, .decode = true};
    p->a = p->b;
    p->a.label = "f8kv", p->a.form = f8 == AF_F8E5M2 ? "kv=e5m2" : "kv=e4m3";
    p->target = FP8_TARGET;
    p->agreement = -1.0;
    if (!fixed_call(&p->b, &seed)) return false;
    p->a.flops = p->b.flops = 2.0 * (double)(FP8_BATCH * DECODE_HQ) * (double)S * (double)(2 * E);
    feature_call *c = &p->a;
    const int64_t qs[4] = {FP8_BATCH, 1, DECODE_HQ, E}, ks[4] = {FP8_BATCH, S, DECODE_HKV, E};
    if (!cli_tensor_zeros(&c->q, q_dtype, 4, qs) || !cli_tensor_zeros(&c->out, q_dtype, 4, qs) ||
        !cli_tensor_zeros(&c->k, f8, 4, ks) || !cli_tensor_zeros(&c->v, f8, 4, ks))
        return false;
    memcpy(c->q.memory, p->b.q.memory, (size_t)FP8_BATCH * row_bytes(c, DECODE_HQ));
    const size_t n = (size_t)(FP8_BATCH * S * DECODE_HKV * E), elem = af_dtype_size(q_dtype);
    cli_tensor *wide[2] = {&p->b.k, &p->b.v}, *narrow[2] = {&c->k, &c->v};
    for (int t = 0; t < 2; t++)   /* round to float8, then store the float8 value back into the wide cache */
        for (size_t i = 0; i < n; i++) {
            char *w = (char *)wide[t]->memory + i * elem;
            uint8_t *b = (uint8_t *)narrow[t]->memory + i;
            *b = af_f32_to_f8(af_load_as_f32(w, q_dtype), f8);
            af_store_from_f32(w, q_dtype, af_load_as_f32(b, f8));
        }
    c->args.query = &c->q.view, c->args.key = &c->k.view, c->args.value = &c->v.view;
    c->kv_bytes = p->b.kv_bytes / 2.0;
    p->work_ratio = 0.5;   /* bytes read */
    return true;
}

/* ---- timing: a and b alternate, each call preceded by a ceiling sample (as the main rows) */

static double cpu_seconds(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (double)(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * (double)(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

static bool timed_call(feature_call *c, int r, const char *peak_isa, int threads) {
    c->peak[r] = bench_fma_peak_sample_gflops(peak_isa, threads, &c->peak_cpu[r]);
    if (c->decode) c->gbps[r] = bench_read_bandwidth_sample_gbps(threads, BENCH_BANDWIDTH_BYTES);
    const double cpu0 = cpu_seconds(), t0 = cli_now();
    if (af_flash_attn(&c->args, &c->out.view, NULL) != AF_OK) return false;
    c->times[r] = cli_now() - t0;
    c->cpu[r] = cpu_seconds() - cpu0;
    return true;
}

static void time_pair(feature_pair *p, int reps, int threads) {
    const char *isa = bench_peak_kind(af_get_isa(), p->a.dtype);
    p->a.ok = af_flash_attn(&p->a.args, &p->a.out.view, NULL) == AF_OK;   /* warm-up; also the compared outputs */
    p->b.ok = af_flash_attn(&p->b.args, &p->b.out.view, NULL) == AF_OK;
    for (int r = 0; r < reps && p->a.ok && p->b.ok; r++) {
        p->a.ok = timed_call(&p->a, r, isa, threads);
        p->b.ok = p->a.ok && timed_call(&p->b, r, isa, threads);
    }
}

static double median_of(const double *values, int n) {
    double sorted[64];
    memcpy(sorted, values, sizeof(double) * (size_t)n);
    return cli_median(sorted, n);
}

/* median over the calls of amount / (values[r] · ceiling[r]) */
static double paired_share(double amount, const double *values, const double *ceiling, int n) {
    double shares[64];
    for (int r = 0; r < n; r++) shares[r] = values[r] > 0 && ceiling[r] > 0 ? amount / values[r] / ceiling[r] : 0.0;
    return cli_median(shares, n);
}

static double paired_quotient(const double *num, const double *den, int n) {
    double q[64];
    for (int r = 0; r < n; r++) q[r] = den[r] > 0 ? num[r] / den[r] : 0.0;
    return cli_median(q, n);
}

/* The memory system's own cost of a's page order: the same bytes read as whole chunks in a's order and in b's,
 * alternating, `reps` each after a warm-up of both. */
static void measure_read_floor(feature_pair *p, int reps, int threads) {
    double ta[64], tb[64];
    for (int r = -1; r < reps; r++) {
        const double a = bench_read_chunks_seconds(threads, p->chunks_a, p->chunk_count, p->chunk_bytes);
        const double b = bench_read_chunks_seconds(threads, p->chunks_b, p->chunk_count, p->chunk_bytes);
        if (r >= 0) ta[r] = a, tb[r] = b;
    }
    p->read_floor = paired_quotient(ta, tb, reps);
}

/* ---- agreement of the two outputs where they compute the same rows */

static double rows_agreement(const feature_pair *p, int64_t a_row, int64_t b_row, int64_t rows, double worst) {
    const int64_t width = p->a.Hq * p->a.E;
    const af_error_scale scale = {.value_max = 1.0, .logit_max = sqrt((double)p->a.E), .E = p->a.E, .S = p->a.S};
    const size_t elem = af_dtype_size(p->a.dtype);
    const char *x = (const char *)p->a.out.memory + (size_t)(a_row * width) * elem;
    const char *y = (const char *)p->b.out.memory + (size_t)(b_row * width) * elem;
    for (int64_t i = 0; i < rows * width; i++) {
        const double u = af_load_as_f32(x + (size_t)i * elem, p->a.dtype);
        const double w = af_load_as_f32(y + (size_t)i * elem, p->a.dtype);
        const double ratio = fabs(u - w) / (2.0 * af_error_bound(p->a.dtype, w, &scale));
        if (!(ratio <= worst)) worst = ratio;   /* NaN counts as the worst */
    }
    return worst;
}

static void check_agreement(feature_pair *p) {
    if (!p->a.ok || !p->b.ok) return;
    if (!strcmp(p->name, "paged_vs_contiguous") || !strcmp(p->name, "fp8_vs_f16")) {
        p->agreement = rows_agreement(p, 0, 0, p->a.B, 0.0);
    } else if (!strcmp(p->name, "varlen_vs_padded")) {
        const int32_t *cu = p->a.cu_seqlens.memory;
        double worst = 0.0;
        for (int b = 0; b < MAX_SEQS; b++) worst = rows_agreement(p, cu[b], b * p->b.L, cu[b + 1] - cu[b], worst);
        p->agreement = worst;
    }
}

/* ---- printing */

static void print_call(const feature_call *c, const bench_features_options *o, int reps, int threads) {
    const double seconds = median_of(c->times, reps), gflops = c->flops / seconds * 1e-9;
    const double peak_ratio = paired_share(c->flops * 1e-9, c->times, c->peak, reps);
    const double cpu_share = median_of(c->cpu, reps) / seconds / threads;
    const double gbps = c->kv_bytes / seconds * 1e-9;
    const double bw_ratio = c->decode ? paired_share(c->kv_bytes * 1e-9, c->times, c->gbps, reps) : 0.0;
    if (o->json && !c->ok) {
        printf("{\"case\":\"%s\",\"feature\":\"%s\",\"dtype\":\"%s\",\"ok\":false}\n", c->label, c->form,
               af_dtype_name(c->dtype));
        return;
    }
    if (o->json) {
        printf("{\"case\":\"%s\",\"feature\":\"%s\",\"dtype\":\"%s\",\"B\":%lld,\"Hq\":%lld,\"Hkv\":%lld,\"L\":%lld,"
               "\"S\":%lld,\"E\":%lld,\"Ev\":%lld,\"threads\":%d,\"isa\":\"%s\",\"ok\":%s,\"seconds\":%.17g,"
               "\"gflops\":%.17g,\"peak_gflops\":%.6g,\"peak_ratio\":%.4f,\"cpu_share\":%.4f,\"kv_gbps\":%.6g",
               c->label, c->form, af_dtype_name(c->dtype), (long long)c->B, (long long)c->Hq, (long long)c->Hkv,
               (long long)c->L, (long long)c->S, (long long)c->E, (long long)c->E, threads, af_get_isa(),
               c->ok ? "true" : "false", seconds, gflops, median_of(c->peak, reps), peak_ratio, cpu_share, gbps);
        if (c->args.has_window)
            printf(",\"window_left\":%lld,\"window_right\":%lld", (long long)c->args.window_left,
                   (long long)c->args.window_right);
        if (c->args.page_table) printf(",\"page_size\":%lld", (long long)o->page_size);
        if (c->decode) printf(",\"peak_gbps\":%.6g,\"bandwidth_ratio\":%.4f", median_of(c->gbps, reps), bw_ratio);
        printf("}\n");
        return;
    }
    char shape[64], form[32], bw[16] = "-";
    snprintf(shape, sizeof shape, "%lld,%lld,%lld,%lld,%lld,%lld,%lld", (long long)c->B, (long long)c->Hq,
             (long long)c->Hkv, (long long)c->L, (long long)c->S, (long long)c->E, (long long)c->E);
    if (c->args.has_window)
        snprintf(form, sizeof form, "window(%lld,%lld)", (long long)c->args.window_left,
                 (long long)c->args.window_right);
    else
        snprintf(form, sizeof form, "%s%s", c->form, c->args.causal ? ",causal" : "");
    if (c->args.page_table) snprintf(form, sizeof form, "paged%lld", (long long)c->k.view.shape[1]);
    if (!c->ok) {
        printf("%-8s %-26s %-8s %-16s failed: %s\n", c->label, shape, af_dtype_name(c->dtype), form, af_last_error());
        return;
    }
    if (c->decode) snprintf(bw, sizeof bw, "%.0f%%", 100.0 * bw_ratio);
    printf("%-8s %-26s %-8s %-16s %10.2f %8.1f %5.0f%% %7.1f %5s %3.0f%%\n", c->label, shape, af_dtype_name(c->dtype),
           form, seconds * 1e3, gflops, 100.0 * peak_ratio, gbps, bw, 100.0 * cpu_share);
}

static void print_pair(const feature_pair *p, const bench_features_options *o, int reps) {
    if (!p->a.ok || !p->b.ok) return;
    const double time_ratio = paired_quotient(p->a.times, p->b.times, reps);
    const double cpu_ratio = paired_quotient(p->a.cpu, p->b.cpu, reps);
    const bool met = p->target <= 0 || time_ratio <= p->target;
    if (o->json) {
        printf("{\"pair\":\"%s\",\"dtype\":\"%s\",\"time_ratio\":%.4f,\"cpu_time_ratio\":%.4f,\"work_ratio\":%.4f",
               p->name, af_dtype_name(p->a.dtype), time_ratio, cpu_ratio, p->work_ratio);
        if (p->target > 0) printf(",\"target\":%.2f,\"met\":%s", p->target, met ? "true" : "false");
        if (p->agreement >= 0) printf(",\"agreement\":%.4f", p->agreement);
        if (p->read_floor > 0) printf(",\"read_floor\":%.4f", p->read_floor);
        printf("}\n");
        return;
    }
    char target[48] = "", agreement[64] = "";
    if (p->target > 0) snprintf(target, sizeof target, "; target <= %.2f: %s", p->target, met ? "met" : "NOT met");
    if (p->agreement >= 0)
        snprintf(agreement, sizeof agreement, "; outputs differ by %.3g of the bound", p->agreement);
    printf("  %s %s: time ratio %.3f (CPU-time ratio %.3f), work ratio %.3f%s%s\n", p->name, af_dtype_name(p->a.dtype),
           time_ratio, cpu_ratio, p->work_ratio, target, agreement);
    if (p->read_floor > 0)
        printf("  %s %s: memory floor: reading the same %zu-byte pages in this order takes %.3fx reading them "
               "contiguously\n", p->name, af_dtype_name(p->a.dtype), p->chunk_bytes, p->read_floor);
}

int bench_features(const bench_features_options *o, int threads) {
    typedef bool (*make_pair)(feature_pair *, const bench_features_options *, af_dtype, uint64_t);
    const make_pair makers[] = {window_pair, varlen_pair, paged_pair, fp8_pair};
    static const char *const names[] = {"window_vs_full", "varlen_vs_padded", "paged_vs_contiguous", "fp8_vs_f16"};
    const af_dtype all[] = {AF_F32, AF_BF16};
    const int num_dtypes = o->dtype_given ? 1 : 2, reps = o->reps < 64 ? o->reps : 64;
    int failures = 0;
    if (!o->json) {
        printf("features: each pair's calls alternate (a, b, a, b, ...), %d timed each after one warm-up; ratios are "
               "medians of the per-iteration quotients a/b\n", reps);
        printf("%-8s %-26s %-8s %-16s %10s %8s %6s %7s %5s %4s\n", "case", "B,Hq,Hkv,L,S,E,Ev", "dtype", "form", "ms",
               "GFLOP/s", "%peak", "KV_GB/s", "%bw", "cpu%");
    }
    for (size_t m = 0; m < sizeof makers / sizeof makers[0]; m++)
        for (int d = 0; d < num_dtypes && (!o->only || !strcmp(o->only, names[m])); d++) {
            feature_pair p;
            memset(&p, 0, sizeof p);
            const af_dtype dtype = o->dtype_given ? o->dtype : all[d];
            if (!makers[m](&p, o, dtype, 777 + 31 * (uint64_t)m)) {
                fprintf(stderr, "attnforge bench: out of memory for the %s pair\n", p.name ? p.name : "?");
                failures++;
            } else {
                time_pair(&p, reps, threads);
                if (p.chunks_a) measure_read_floor(&p, reps, threads);
                check_agreement(&p);
                print_call(&p.a, o, reps, threads);
                print_call(&p.b, o, reps, threads);
                print_pair(&p, o, reps);
                failures += !p.a.ok + !p.b.ok + (p.agreement > 1.0);
            }
            fflush(stdout);
            free((void *)p.chunks_a);
            free((void *)p.chunks_b);
            free_call(&p.a);
            free_call(&p.b);
        }
    return failures;
}
