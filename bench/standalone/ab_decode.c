/* Two builds of libattnforge.so in one process, their decode calls alternating (A B, B A, ...), so that the guest's
 * drift hits both alike: per build the median time and GB/s of K+V, and the median and quartiles of the
 * per-iteration ratio t(B) / t(A). The only comparison of two builds this machine's noise allows
 * (docs/BENCHMARKS-HISTORY.md, "Issue 13, closing"): run it over every dtype, layout and group a change can reach.
 *
 *   ab_decode OLD/libattnforge.so NEW/libattnforge.so [--threads T] [--hq N] [--hkv N] [--seq S]
 *             [--dtype float32|float16|bfloat16] [--layout hnd|nhd] [--calls N]
 *
 * Defaults: 2 threads, Hq/Hkv 32/8, S 32768, float16, (B,H,S,E), 21 calls each; B = 1, L = 1, E = Ev = 128.
 * Only the header: every attnforge symbol comes through dlsym, one library's or the other's. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attnforge.h"

typedef af_status (*sdpa_fn)(const af_sdpa_args *, af_tensor *, af_tensor *);
typedef void (*threads_fn)(int);

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static af_tensor contiguous(void *data, af_dtype dtype, const int64_t shape[4]) {
    af_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data, t.dtype = dtype, t.ndim = 4;
    int64_t stride = 1;
    for (int i = 3; i >= 0; i--) t.shape[i] = shape[i], t.strides[i] = stride, stride *= shape[i];
    return t;
}

/* Values in [0.5, 1): each dtype's bit pattern of such a number, so no conversion library is needed. */
static void fill(char *p, size_t count, af_dtype dtype) {
    for (size_t i = 0; i < count; i++) {
        const unsigned r = (unsigned)rand();
        if (dtype == AF_F32) {
            const float x = 0.5f + (float)(r % 4096) / 8192.0f;
            memcpy(p + 4 * i, &x, 4);
        } else {
            const unsigned short x = dtype == AF_F16 ? (unsigned short)(0x3800 | (r & 0x3ff))
                                                     : (unsigned short)(0x3f00 | (r & 0x7f));
            memcpy(p + 2 * i, &x, 2);
        }
    }
}

static int usage(void) {
    fprintf(stderr, "usage: ab_decode LIB_A LIB_B [--threads T] [--hq N] [--hkv N] [--seq S] "
                    "[--dtype float32|float16|bfloat16] [--layout hnd|nhd] [--calls N]\n");
    return 2;
}

int main(int argc, char **argv) {
    if (argc < 3) return usage();
    int threads = 2, hq = 32, hkv = 8, seq = 32768, calls = 21, nhd = 0;
    af_dtype dtype = AF_F16;
    for (int i = 3; i < argc; i += 2) {   /* option, value */
        const char *opt = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (!val) return usage();
        if (!strcmp(opt, "--threads")) threads = atoi(val);
        else if (!strcmp(opt, "--hq")) hq = atoi(val);
        else if (!strcmp(opt, "--hkv")) hkv = atoi(val);
        else if (!strcmp(opt, "--seq")) seq = atoi(val);
        else if (!strcmp(opt, "--calls")) calls = atoi(val);
        else if (!strcmp(opt, "--layout") && (!strcmp(val, "hnd") || !strcmp(val, "nhd"))) nhd = !strcmp(val, "nhd");
        else if (!strcmp(opt, "--dtype") && !strcmp(val, "float32")) dtype = AF_F32;
        else if (!strcmp(opt, "--dtype") && !strcmp(val, "float16")) dtype = AF_F16;
        else if (!strcmp(opt, "--dtype") && !strcmp(val, "bfloat16")) dtype = AF_BF16;
        else return usage();
    }
    if (threads < 1 || hkv < 1 || hq < hkv || hq % hkv || seq < 1 || calls < 3) return usage();

    sdpa_fn sdpa[2];
    for (int b = 0; b < 2; b++) {   /* distinct paths load as distinct objects, sonames alike */
        void *lib = dlopen(argv[1 + b], RTLD_NOW | RTLD_LOCAL);
        if (!lib) return fprintf(stderr, "ab_decode: %s\n", dlerror()), 1;
        sdpa[b] = (sdpa_fn)dlsym(lib, "af_sdpa");
        const threads_fn set_threads = (threads_fn)dlsym(lib, "af_set_num_threads");
        if (!sdpa[b] || !set_threads) return fprintf(stderr, "ab_decode: %s is not attnforge\n", argv[1 + b]), 1;
        set_threads(threads);
    }
    if (sdpa[0] == sdpa[1]) return fprintf(stderr, "ab_decode: both paths loaded one library\n"), 1;

    const int E = 128;
    const size_t elem = dtype == AF_F32 ? 4 : 2, kv = (size_t)hkv * seq * E;
    char *k = malloc(kv * elem), *v = malloc(kv * elem), *q = malloc((size_t)hq * E * elem),
         *o = malloc((size_t)hq * E * elem);
    double *t[2] = {malloc(sizeof(double) * calls), malloc(sizeof(double) * calls)},
           *ratio = malloc(sizeof(double) * calls);
    if (!k || !v || !q || !o || !t[0] || !t[1] || !ratio) return fprintf(stderr, "ab_decode: out of memory\n"), 1;
    fill(k, kv, dtype), fill(v, kv, dtype), fill(q, (size_t)hq * E, dtype);
    const int64_t q_shape[4] = {1, hq, 1, E}, kv_shape[4] = {1, hkv, seq, E};
    af_tensor Q = contiguous(q, dtype, q_shape), K = contiguous(k, dtype, kv_shape), V = contiguous(v, dtype, kv_shape),
              O = contiguous(o, dtype, q_shape);
    if (nhd)   /* (B,H,S,E) views of (B,S,H,E) memory, as a transformer's cache */
        K.strides[1] = V.strides[1] = E, K.strides[2] = V.strides[2] = (int64_t)hkv * E;
    af_sdpa_args args = {0};
    args.query = &Q, args.key = &K, args.value = &V, args.enable_gqa = hq != hkv;

    for (int b = 0; b < 2; b++)   /* warm-up: the first call also allocates the scratch */
        if (sdpa[b](&args, &O, NULL) != AF_OK) return fprintf(stderr, "ab_decode: %s: call failed\n", argv[1 + b]), 1;
    for (int it = 0; it < calls; it++) {
        for (int j = 0; j < 2; j++) {
            const int b = it % 2 ? 1 - j : j;
            const double t0 = seconds();
            sdpa[b](&args, &O, NULL);
            t[b][it] = seconds() - t0;
        }
        ratio[it] = t[1][it] / t[0][it];
    }
    qsort(t[0], (size_t)calls, sizeof(double), by_value);
    qsort(t[1], (size_t)calls, sizeof(double), by_value);
    qsort(ratio, (size_t)calls, sizeof(double), by_value);
    const double gb = 2.0 * (double)kv * (double)elem / 1e9;
    printf("%s Hq/Hkv %d/%d S %d %s, %d threads: A %.2f ms (%.1f GB/s), B %.2f ms (%.1f GB/s), "
           "B/A %.3f (quartiles %.3f-%.3f, %d calls)\n",
           dtype == AF_F32 ? "float32" : dtype == AF_F16 ? "float16" : "bfloat16", hq, hkv, seq,
           nhd ? "(B,S,H,E)" : "(B,H,S,E)", threads, t[0][calls / 2] * 1e3,
           gb / t[0][calls / 2], t[1][calls / 2] * 1e3, gb / t[1][calls / 2], ratio[calls / 2], ratio[calls / 4],
           ratio[3 * calls / 4], calls);
    return 0;
}
