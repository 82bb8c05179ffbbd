#include "cli_common.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/dtype.h"
#include "sdpa/tolerance.h"

static double next_uniform(uint64_t *state) {   /* xorshift64*: reproducible across platforms */
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return (double)((x * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
}

static bool allocate(cli_tensor *t, af_dtype dtype, int ndim, const int64_t *shape, bool nhd) {
    memset(t, 0, sizeof *t);
    int64_t numel = 1;
    for (int d = 0; d < ndim; d++) numel *= shape[d];
    size_t bytes = (size_t)(numel > 0 ? numel : 1) * af_dtype_size(dtype);
    if (posix_memalign(&t->memory, 64, (bytes + 63) & ~(size_t)63) != 0) return false;
    memset(t->memory, 0, bytes);
    t->view = af_tensor_contiguous(t->memory, dtype, ndim, shape);
    if (nhd && ndim == 4) {   /* strides of x_nhd.transpose(1, 2): (L·H·D, D, H·D, 1) */
        t->view.strides[3] = 1;
        t->view.strides[1] = shape[3];
        t->view.strides[2] = shape[1] * shape[3];
        t->view.strides[0] = shape[2] * shape[1] * shape[3];
    }
    return true;
}

bool cli_tensor_random(cli_tensor *t, af_dtype dtype, const int64_t shape[4], bool nhd, uint64_t *seed, double amplitude) {
    if (!allocate(t, dtype, 4, shape, nhd)) return false;
    int64_t numel = shape[0] * shape[1] * shape[2] * shape[3];
    size_t elem = af_dtype_size(dtype);
    for (int64_t i = 0; i < numel; i++)
        af_store_from_f32((char *)t->memory + (size_t)i * elem, dtype, (float)((2.0 * next_uniform(seed) - 1.0) * amplitude));
    return true;
}

bool cli_tensor_random_like(cli_tensor *t, const af_tensor *desc, uint64_t *seed, double amplitude) {
    memset(t, 0, sizeof *t);
    const size_t elem = af_dtype_size(desc->dtype);
    if (elem == 0 || desc->ndim < 0 || desc->ndim > AF_MAX_DIMS) return false;
    int64_t span = 1;   /* elements from the first to the last one the view reaches, inclusive */
    for (int d = 0; d < desc->ndim; d++) {
        if (desc->shape[d] < 0 || desc->strides[d] < 0) return false;
        if (desc->shape[d] == 0) span = 0;
    }
    for (int d = 0; span > 0 && d < desc->ndim; d++) {
        int64_t reach;
        if (__builtin_mul_overflow(desc->shape[d] - 1, desc->strides[d], &reach) || __builtin_add_overflow(span, reach, &span))
            return false;
    }
    if (span > ((int64_t)1 << 34) / (int64_t)elem) return false;
    const size_t bytes = (size_t)(span > 0 ? span : 1) * elem;
    if (posix_memalign(&t->memory, 64, (bytes + 63) & ~(size_t)63) != 0) {
        t->memory = NULL;
        return false;
    }
    for (int64_t i = 0; i < span; i++) {
        const double u = next_uniform(seed);
        const float value = desc->dtype == AF_BOOL ? (u < 0.8 ? 1.0f : 0.0f) : (float)((2.0 * u - 1.0) * amplitude);
        af_store_from_f32((char *)t->memory + (size_t)i * elem, desc->dtype, value);
    }
    t->view = *desc;
    t->view.data = t->memory;
    memset(&t->view.device, 0, sizeof t->view.device);   /* host memory, whatever device the description named */
    return true;
}

bool cli_tensor_zeros(cli_tensor *t, af_dtype dtype, int ndim, const int64_t *shape) {
    return allocate(t, dtype, ndim, shape, false);
}

void cli_tensor_free(cli_tensor *t) {
    free(t->memory);
    t->memory = NULL;
}

double cli_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double cli_fa4_flops(const cli_shape *s) {
    double keys = (double)s->S;
    if (s->causal) {   /* top-left: row i sees min(i + 1, S) keys */
        double total = 0.0;
        for (int64_t i = 0; i < s->L; i++) total += (double)(i + 1 < s->S ? i + 1 : s->S);
        keys = s->L > 0 ? total / (double)s->L : 0.0;
    }
    return 2.0 * (double)s->B * (double)s->Hq * (double)s->L * keys * (double)(s->E + s->Ev);
}

static double element(const af_tensor *t, const int64_t idx[4]) {
    int64_t off = 0;
    for (int d = 0; d < 4; d++) off += idx[d] * t->strides[d];
    return af_load_as_f32((const char *)t->data + (size_t)off * af_dtype_size(t->dtype), t->dtype);
}

/* max over the leading dims of the row norm ‖x[b,h,i,:]‖ and of |x| */
static void row_norms(const af_tensor *t, double *max_norm, double *max_abs) {
    *max_norm = 0.0;
    *max_abs = 0.0;
    int64_t idx[4];
    for (idx[0] = 0; idx[0] < t->shape[0]; idx[0]++)
        for (idx[1] = 0; idx[1] < t->shape[1]; idx[1]++)
            for (idx[2] = 0; idx[2] < t->shape[2]; idx[2]++) {
                double sq = 0.0;
                for (idx[3] = 0; idx[3] < t->shape[3]; idx[3]++) {
                    double x = element(t, idx);
                    sq += x * x;
                    if (fabs(x) > *max_abs) *max_abs = fabs(x);
                }
                if (sqrt(sq) > *max_norm) *max_norm = sqrt(sq);
            }
}

cli_compare cli_compare_to_reference(const af_sdpa_args *args, const af_tensor *out, const af_tensor *ref) {
    double qn, qa, kn, ka, vn, va;
    row_norms(args->query, &qn, &qa);
    row_norms(args->key, &kn, &ka);
    row_norms(args->value, &vn, &va);
    const double scale = args->has_scale ? args->scale : 1.0 / sqrt((double)args->query->shape[3]);
    af_error_scale es = {.value_max = va, .logit_max = fabs(scale) * qn * kn,
                         .E = args->query->shape[3], .S = args->key->shape[2]};
    cli_compare c = {0.0, 0.0};
    int64_t idx[4];
    for (idx[0] = 0; idx[0] < out->shape[0]; idx[0]++)
        for (idx[1] = 0; idx[1] < out->shape[1]; idx[1]++)
            for (idx[2] = 0; idx[2] < out->shape[2]; idx[2]++)
                for (idx[3] = 0; idx[3] < out->shape[3]; idx[3]++) {
                    const double o = element(out, idx), r = element(ref, idx);
                    const double err = (isnan(o) && isnan(r)) || o == r ? 0.0 : fabs(o - r);
                    const double bound = af_error_bound(out->dtype, r, &es);
                    if (err > c.max_error || isnan(err)) c.max_error = isnan(err) ? INFINITY : err;
                    const double ratio = isnan(err) ? INFINITY : err / bound;
                    if (ratio > c.worst_ratio) c.worst_ratio = ratio;
                }
    return c;
}

int cli_parse_dtype(const char *text, af_dtype *out) {
    if (!strcmp(text, "float32") || !strcmp(text, "f32")) *out = AF_F32;
    else if (!strcmp(text, "float16") || !strcmp(text, "f16")) *out = AF_F16;
    else if (!strcmp(text, "bfloat16") || !strcmp(text, "bf16")) *out = AF_BF16;
    else return -1;
    return 0;
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double cli_median(double *values, int n) {
    qsort(values, (size_t)n, sizeof(double), compare_doubles);
    return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

int cli_common_option(int argc, char **argv, int *i) {
    const char *opt = argv[*i];
    if (strcmp(opt, "--threads") && strcmp(opt, "--isa")) return 0;
    if (*i + 1 >= argc) {
        fprintf(stderr, "attnforge: %s needs a value\n", opt);
        return -1;
    }
    const char *value = argv[++*i];
    if (!strcmp(opt, "--threads")) {
        char *end;
        long n = strtol(value, &end, 10);
        if (*end || n < 0 || n > 1024) {
            fprintf(stderr, "attnforge: --threads takes a whole number from 0 (all cores) to 1024, got '%s'\n", value);
            return -1;
        }
        af_set_num_threads((int)n);
    } else if (af_set_isa(value) != AF_OK) {
        fprintf(stderr, "attnforge: --isa: %s\n", af_last_error());
        return -1;
    }
    return 1;
}
