/* The seam between the FlashAttention driver and the per-ISA micro-kernels (BLIS-style).
 * The driver owns tiling, packing, masking, scheduling and the epilogue; a micro-kernel owns only the
 * arithmetic on packed f32 tiles. Adding an ISA means adding a table here and a file; the driver is untouched. */
#ifndef AF_KERNEL_UKERNEL_H
#define AF_KERNEL_UKERNEL_H
#include <stdbool.h>
#include <stddef.h>

#include "attnforge.h"

/* Every packed tile row is padded to a multiple of this many floats (64 bytes), and every tile is 64-byte
 * aligned, so a micro-kernel may load/store whole vectors up to the padded width. */
#define AF_TILE_PAD 16

typedef struct af_ukernel {
    const char *isa;   /* "portable", "avx2", "avx512" */

    /* C[m×n] = (accumulate ? C : 0) + A[m×k] · B[k×n], all f32 row-major with leading dims lda/ldb/ldc.
     * ldb and ldc are multiples of AF_TILE_PAD; B's columns n..round_up(n, AF_TILE_PAD) are readable (the driver
     * zero-fills them) and C's are writable scratch. A's rows are exactly k long (lda >= k). m, n, k >= 1. */
    void (*gemm)(int m, int n, int k, const float *A, int lda, const float *B, int ldb, float *C, int ldc,
                 bool accumulate);

    /* One online-softmax step over a block of scores, row by row, in base 2 (FA4's form).
     * In:  S[r][0..cols) raw scores (masked entries are -inf); c > 0 folds scale·log2(e) into one multiply;
     *      row_max[r] (running max in log2 units, -inf at first), row_sum[r] (running sum, 0 at first).
     * Out: S[r][j] = P = exp2(S[r][j]·c - m) with m the row's reference max (P = 0 for -inf scores, NaN kept);
     *      lazy rescaling: m moves to the block max only when that exceeds the old m by more than 8 (or the
     *      old m is -inf), else stays, so P <= 2^8; alpha[r] = exp2(m_old - m_new) (1 when m did not move);
     *      row_sum[r] = row_sum[r]·alpha[r] + sum_j P; row_max[r] = m_new. A row whose m stays -inf keeps P = 0.
     * exp2_degree is 3, 4 or 5: the polynomial degree the output precision needs (bf16, f16, f32). */
    void (*softmax_step)(int rows, int cols, float *S, int lds, float c, float *row_max, float *row_sum, float *alpha,
                         int exp2_degree);

    /* x[0..n) *= s (rescale of one O row). */
    void (*scale_row)(float *x, int n, float s);

    /* Tile sizes for head dims E (q·k) and Ev (v): query rows per block and keys per block. */
    void (*blocking)(int E, int Ev, int *block_rows, int *block_keys);

    /* Optional packing hooks (NULL: the driver's own loops). Sources are f32, f16 or bf16, contiguous along the
     * head dim; the result is f32, converted exactly.
     * pack_kt: the K tile transposed, kt[e·ldkt + j] = K_j[e] for j < cols, e < E, with columns
     *          cols..round_up(cols, AF_TILE_PAD) zero. Key j starts at (const char *)k + j·key_stride bytes;
     *          ldkt is a multiple of AF_TILE_PAD, kt 64-byte aligned. cols, E >= 1.
     * convert: dst[0..n) = src[0..n) as f32 (n >= 1). */
    void (*pack_kt)(int cols, int E, const void *k, size_t key_stride, af_dtype dtype, float *kt, int ldkt);
    void (*convert)(float *dst, const void *src, af_dtype dtype, int n);

    /* Optional kernels for few query rows (decode): K and V read where they lie, nothing packed. K/V rows are
     * f32/f16/bf16 (dtype), contiguous along the head dim, `row_bytes` apart (a multiple of the element size);
     * nothing past a row's last element is read. m, n, k >= 1.
     * scores_direct: S[m×n] = A[m×k] · K^T, K's n rows of k elements; S's columns n.. are not written.
     * values_direct: O[m×n] += P[m×k] · V, V's k rows of n elements; ldo a multiple of AF_TILE_PAD. */
    void (*scores_direct)(int m, int n, int k, const float *A, int lda, const void *K, size_t row_bytes,
                          af_dtype dtype, float *S, int lds);
    void (*values_direct)(int m, int n, int k, const float *P, int ldp, const void *V, size_t row_bytes,
                          af_dtype dtype, float *O, int ldo);
} af_ukernel;

extern const af_ukernel af_ukernel_portable;
extern const af_ukernel af_ukernel_avx2;     /* defined only in x86-64 builds */
extern const af_ukernel af_ukernel_avx512;

/* The micro-kernel af_sdpa uses now (ATTNFORGE_ISA / af_set_isa, else the best the CPU and OS allow). */
const af_ukernel *af_ukernel_current(void);

#endif
