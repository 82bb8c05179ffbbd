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

/* Inside the vector kernels only, never across this table: e4m3fn bytes that a scan found free of NaN, loaded as
 * value·2^-8 (f16 bits by one shift and mask: no NaN fix, no rescale per element); the direct kernels scale their
 * sums by 2^8 once per tile instead (exact: powers of two, barring f32 subnormals, i.e. |q| or |O| below ~2^-100). */
#define AF_F8E4M3_SCALED ((af_dtype)(0x100 | AF_F8E4M3))

/* Optional products on a micro-kernel's own operand formats (AMX: bf16 tiles, K and V in VNNI pairs), for calls
 * whose inputs it accepts; the driver's f32 path (gemm on packed f32 tiles) runs the rest. The driver keeps its
 * rows, causal skipping, masks, the online softmax (the table's softmax_step on the f32 S block) and the epilogue;
 * these hooks only pack operands and form S = Q·K^T and O += P·V. The packed formats are the kernel's own: the
 * driver sizes scratch with *_bytes (each region 64-byte aligned) and passes the buffers back unread.
 * Precision: f32 accumulation; P may be rounded to the input dtype before P·V (af_error_bound states the cost). */
typedef struct af_products {
    /* True when these products take a call with inputs of `dtype` and head dims E (q·k) >= 1 and Ev (v) >= 0. */
    bool (*accepts)(af_dtype dtype, int E, int Ev);
    /* Calls with fewer query rows per (batch, kv head) than this use the table's direct kernels instead, when it
     * has them (a tile product costs the same for 1 row as for 16). */
    int min_rows;
    /* Replaces the table's blocking for accepted calls. */
    void (*blocking)(int E, int Ev, int *block_rows, int *block_keys);
    /* Scratch bytes: a packed Q block of `rows` rows, a packed K tile and a packed V tile of `keys` keys. */
    size_t (*q_bytes)(int rows, int E);
    size_t (*k_bytes)(int keys, int E);
    size_t (*v_bytes)(int keys, int Ev);
    /* pack_q: `rows` f32 query rows q[r·ldq + e] (e < E; converted exactly from the accepted dtype) into qpack,
     *         where row r stays addressable as (qpack, row0 = r) by scores.
     * pack_k / pack_v: `keys` K rows of E / V rows of Ev elements of `dtype`, contiguous along the head dim, key j
     *         starting at (const char *)src + j·key_stride bytes; nothing past a row's last element is read.
     * All three zero whatever padding their format needs. rows, keys >= 1. */
    void (*pack_q)(int rows, int E, const float *q, int ldq, void *qpack);
    void (*pack_k)(int keys, int E, const void *k, size_t key_stride, af_dtype dtype, void *kpack);
    void (*pack_v)(int keys, int Ev, const void *v, size_t key_stride, af_dtype dtype, void *vpack);
    /* scores: S[r·lds + j] = q_{row0 + r} · k_j for r < rows, j < cols (f32). S's columns cols..round_up(cols,
     *         AF_TILE_PAD) are writable scratch; lds is a multiple of AF_TILE_PAD. row0 + rows <= the packed rows.
     * values: O[r·ldo + e] += sum_{j < cols} P[r·ldp + j] · v_j[e] for r < rows, e < Ev; P's columns past cols
     *         are not read; O's columns Ev..round_up(Ev, AF_TILE_PAD) are writable scratch, ldo a multiple of
     *         AF_TILE_PAD. rows, cols, Ev >= 1; cols <= the keys packed. */
    void (*scores)(int rows, int cols, int E, const void *qpack, int row0, const void *kpack, float *S, int lds);
    void (*values)(int rows, int Ev, int cols, const float *P, int ldp, const void *vpack, float *O, int ldo);
} af_products;

/* Memory a direct kernel asks to be brought into L2 while it computes: `lines` 64-byte lines from `addr` (which
 * is line-aligned), a few per step of its loop. The driver points it at the next tile's K/V rows, so that decode's
 * loads overlap its arithmetic: the hardware prefetchers stop at 4 KiB pages and miss a (B,S,H,E) cache's rows a
 * page apart, and the loads alone keep too few misses in flight. {NULL, 0}: none. Prefetches never fault. */
typedef struct {
    const char *addr;
    size_t lines;
} af_prefetch;

typedef struct af_ukernel {
    const char *isa;   /* "portable", "avx2", "avx512", "amx" */

    /* C[m×n] = (accumulate ? C : 0) + A[m×k] · B[k×n], all f32 row-major with leading dims lda/ldb/ldc.
     * ldb and ldc are multiples of AF_TILE_PAD; B's columns n..round_up(n, AF_TILE_PAD) are readable (the driver
     * zero-fills them) and C's are writable scratch. A's rows are exactly k long (lda >= k). m, n, k >= 1. */
    void (*gemm)(int m, int n, int k, const float *A, int lda, const float *B, int ldb, float *C, int ldc,
                 bool accumulate);
    /* Optional (NULL: the caller transposes A first): gemm with A stored transposed, C[m×n] (+)= Aᵀ·B for A[k×m]
     * with rows lda apart (the backward's Pᵀ·dO and dSᵀ·Q); A's rows are exactly m long. Same contract otherwise. */
    void (*gemm_at)(int m, int n, int k, const float *A, int lda, const float *B, int ldb, float *C, int ldc,
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

    /* Optional packing hooks (NULL: the driver's own loops). Sources are f32, f16, bf16 or float8, contiguous along the
     * head dim; the result is f32, converted exactly.
     * pack_kt: the K tile transposed, kt[e·ldkt + j] = K_j[e] for j < cols, e < E, with columns
     *          cols..round_up(cols, AF_TILE_PAD) zero. Key j starts at (const char *)k + j·key_stride bytes;
     *          ldkt is a multiple of AF_TILE_PAD, kt 64-byte aligned. cols, E >= 1.
     * convert: dst[0..n) = src[0..n) as f32 (n >= 1). */
    void (*pack_kt)(int cols, int E, const void *k, size_t key_stride, af_dtype dtype, float *kt, int ldkt);
    void (*convert)(float *dst, const void *src, af_dtype dtype, int n);

    /* Optional kernels for few query rows (decode): K and V read where they lie, nothing packed. K/V row j is
     * f32/f16/bf16/float8 (dtype), contiguous along the head dim, at rows[j] + offset (bytes): pages in any order,
     * and the kv heads of one tile share one list; nothing past a row's last element is read. m, n, k >= 1.
     * scores_direct: S[m×n] = A[m×k] · K^T, K's n rows of k elements; S's columns n.. are not written.
     * values_direct: O[m×n] += P[m×k] · V, V's k rows of n elements; ldo a multiple of AF_TILE_PAD.
     * Both also prefetch `pf`'s lines into L2, spread over their work (af_prefetch). */
    void (*scores_direct)(int m, int n, int k, const float *A, int lda, const char *const *rows, size_t offset,
                          af_dtype dtype, float *S, int lds, af_prefetch pf);
    void (*values_direct)(int m, int n, int k, const float *P, int ldp, const char *const *rows, size_t offset,
                          af_dtype dtype, float *O, int ldo, af_prefetch pf);

    /* Optional products on the kernel's own operand formats (above); NULL: none. */
    const af_products *products;
} af_ukernel;

extern const af_ukernel af_ukernel_portable;
extern const af_ukernel af_ukernel_avx2;     /* defined only in x86-64 builds */
extern const af_ukernel af_ukernel_avx512;
extern const af_products af_products_amx;   /* AMX tiles (ukernel_amx.c); its table is the AVX-512 one plus these */
extern const af_products af_products_avx512_bf16;   /* vdpbf16ps Q·Kᵀ and P·V (ukernel_avx512_bf16.c): the avx512
                                                       table's where the CPU has AVX512-BF16 */

/* The micro-kernel af_sdpa uses now (ATTNFORGE_ISA / af_set_isa, else the best the CPU and OS allow). */
const af_ukernel *af_ukernel_current(void);

#endif
