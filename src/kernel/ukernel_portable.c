/* Portable C micro-kernels: plain loops the compiler may vectorise for the baseline ISA. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "core/dtype.h"
#include "kernel/exp2_poly.h"
#include "kernel/ukernel.h"

static void gemm_portable(int m, int n, int k, const float *A, int lda, const float *B, int ldb, float *C, int ldc,
                          bool accumulate) {
    for (int i = 0; i < m; i++) {
        float *c = C + (size_t)i * ldc;
        if (!accumulate) memset(c, 0, sizeof(float) * (size_t)n);
        const float *a = A + (size_t)i * lda;
        for (int p = 0; p < k; p++) {
            const float ap = a[p];
            const float *b = B + (size_t)p * ldb;
            for (int j = 0; j < n; j++) c[j] += ap * b[j];
        }
    }
}

static void gemm_at_portable(int m, int n, int k, const float *A, int lda, const float *B, int ldb, float *C,
                             int ldc, bool accumulate) {
    for (int i = 0; i < m; i++) {
        float *c = C + (size_t)i * ldc;
        if (!accumulate) memset(c, 0, sizeof(float) * (size_t)n);
        for (int p = 0; p < k; p++) {
            const float ap = A[(size_t)p * lda + i];
            const float *b = B + (size_t)p * ldb;
            for (int j = 0; j < n; j++) c[j] += ap * b[j];
        }
    }
}

static inline float exp2_portable(float x, int degree) {
    if (!(x >= AF_EXP2_MIN_INPUT)) return x != x ? x : 0.0f;   /* NaN stays NaN; -inf and tiny give 0 */
    if (x > 128.0f) return INFINITY;
    const float r = floorf(x + 0.5f);
    const float f = x - r;
    float poly;
    if (degree <= 3)
        poly = AF_EXP2_D3_C0 + f * (AF_EXP2_D3_C1 + f * (AF_EXP2_D3_C2 + f * AF_EXP2_D3_C3));
    else if (degree == 4)
        poly = AF_EXP2_D4_C0 + f * (AF_EXP2_D4_C1 + f * (AF_EXP2_D4_C2 + f * (AF_EXP2_D4_C3 + f * AF_EXP2_D4_C4)));
    else
        poly = AF_EXP2_D5_C0 +
               f * (AF_EXP2_D5_C1 + f * (AF_EXP2_D5_C2 + f * (AF_EXP2_D5_C3 + f * (AF_EXP2_D5_C4 + f * AF_EXP2_D5_C5))));
    uint32_t bits;
    memcpy(&bits, &poly, 4);
    bits += (uint32_t)((int32_t)r * (1 << 23));   /* multiply by 2^r through the exponent field */
    memcpy(&poly, &bits, 4);
    return poly;
}

static void softmax_step_portable(int rows, int cols, float *S, int lds, float c, float *row_max, float *row_sum,
                                  float *alpha, int exp2_degree) {
    for (int r = 0; r < rows; r++) {
        float *s = S + (size_t)r * lds;
        float block_max = -INFINITY;
        for (int j = 0; j < cols; j++) {
            const float t = s[j] * c;
            block_max = t > block_max ? t : block_max;   /* NaN never wins; it reaches P below */
        }
        const float m_old = row_max[r];
        const float m_new = block_max > m_old + 8.0f ? block_max : m_old;   /* lazy rescale, threshold 2^8 */
        const float m_ref = m_new == -INFINITY ? 0.0f : m_new;             /* all -inf so far: P = 0 (NaN kept) */
        float sum = 0.0f;
        for (int j = 0; j < cols; j++) {
            const float pj = exp2_portable(s[j] * c - m_ref, exp2_degree);
            s[j] = pj;
            sum += pj;
        }
        const float a = m_new == m_old ? 1.0f : exp2_portable(m_old - m_new, 5);
        alpha[r] = a;
        row_sum[r] = row_sum[r] * a + sum;
        row_max[r] = m_new;
    }
}

static void scale_row_portable(float *x, int n, float s) {
    for (int i = 0; i < n; i++) x[i] *= s;
}

static void blocking_portable(int E, int Ev, int *block_rows, int *block_keys) {
    (void)E;
    (void)Ev;
    *block_rows = 32;
    *block_keys = 64;
}

static void convert_portable(float *dst, const void *src, af_dtype dtype, int n) {
    const char *s = src;
    const size_t elem = af_elem_bytes(dtype);
    if (dtype == AF_F32) memcpy(dst, s, sizeof(float) * (size_t)n);
    else for (int i = 0; i < n; i++) dst[i] = af_load_as_f32(s + elem * (size_t)i, dtype);
}

/* Eight keys at a time: each kt row gets 8 contiguous floats while the 8 source rows are read in step. */
static void pack_kt_portable(int cols, int E, const void *k, size_t key_stride, af_dtype dtype, float *kt, int ldkt) {
    const size_t elem = af_elem_bytes(dtype);
    const int padded = (cols + AF_TILE_PAD - 1) / AF_TILE_PAD * AF_TILE_PAD;
    for (int j0 = 0; j0 < cols; j0 += 8) {
        const int nk = cols - j0 < 8 ? cols - j0 : 8;
        for (int e = 0; e < E; e++)
            for (int j = 0; j < nk; j++)
                kt[(size_t)e * ldkt + j0 + j] = af_load_as_f32((const char *)k + (size_t)(j0 + j) * key_stride + (size_t)e * elem, dtype);
    }
    if (padded > cols)
        for (int e = 0; e < E; e++) memset(kt + (size_t)e * ldkt + cols, 0, sizeof(float) * (size_t)(padded - cols));
}

const af_ukernel af_ukernel_portable = {
    .isa = "portable",
    .gemm = gemm_portable,
    .gemm_at = gemm_at_portable,
    .softmax_step = softmax_step_portable,
    .scale_row = scale_row_portable,
    .blocking = blocking_portable,
    .pack_kt = pack_kt_portable,
    .convert = convert_portable,
};
