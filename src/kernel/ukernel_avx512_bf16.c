/* AVX512-BF16 products (ukernel.h's af_products) for bf16 calls on the AVX-512 table: S = Q·Kᵀ by vdpbf16ps (two
 * bf16 products per f32 lane, f32 accumulation: half the instructions of f32 FMAs), O += P·V by the AVX-512 f32
 * gemm with P kept in f32 (no rounding of the weights). dispatch.c adds them to the avx512 table only where CPUID
 * reports avx512_bf16 (core/cpu.c). vdpbf16ps treats bf16 subnormals as zero and flushes subnormal sums (DAZ/FTZ):
 * below 2^-126, far under the f32 score error af_error_bound allows.
 *
 * Formats (a "pair" = two bf16 of consecutive head-dim elements in one 32-bit word, the unit of vdpbf16ps):
 *   Q block: row-major, rows × pairs(E) words (an odd E's last pair padded with a zero).
 *   K tile:  per group of 32 keys, pairs(E) rows × 32 keys of words: K_{32g+n}'s pair p at (g·pairs + p)·32 + n;
 *            keys past the tile's end are zero.
 *   V tile:  f32 rows of v_ld(Ev) floats (converted exactly, zero past Ev): the AVX-512 gemm's B operand. */
#include <immintrin.h>

#include "kernel/ukernel_pack_x86.h"

#define BF_MR 12      /* register tile: 12 rows × 2 vectors = 24 accumulators + 2 K vectors + 1 broadcast */
#define BF_GROUP 32   /* keys per K group: the tile's two vectors */

#if defined(__clang__)
#define BF_UNROLL _Pragma("clang loop unroll(full)")
#else
#define BF_UNROLL _Pragma("GCC unroll 32")
#endif

static int pairs_of(int E) { return (E + 1) / 2; }
static int round_up_int(int x, int to) { return (x + to - 1) / to * to; }

/* V rows an odd number of 64-byte lines apart (as the driver's tile_ld): a column strip then spans the L1 sets. */
static int v_ld(int Ev) { return (round_up_int(Ev > 0 ? Ev : 1, AF_TILE_PAD) / AF_TILE_PAD | 1) * AF_TILE_PAD; }

static bool bf16_accepts(af_dtype dtype, int E, int Ev) { return dtype == AF_BF16 && E >= 1 && Ev >= 0; }

/* The AVX-512 table's blocking: 64 keys (two groups) and its query rows. */
static void bf16_blocking(int E, int Ev, int *block_rows, int *block_keys) {
    af_ukernel_avx512.blocking(E, Ev, block_rows, block_keys);
}

static size_t bf16_q_bytes(int rows, int E) { return (size_t)rows * (size_t)pairs_of(E) * 4; }
static size_t bf16_k_bytes(int keys, int E) { return (size_t)round_up_int(keys, BF_GROUP) * (size_t)pairs_of(E) * 4; }
static size_t bf16_v_bytes(int keys, int Ev) { return (size_t)keys * (size_t)v_ld(Ev) * 4; }

/* Q rows back to bf16 (exact: they were converted from bf16), an odd E's last pair completed with a zero. */
static void bf16_pack_q(int rows, int E, const float *q, int ldq, void *qpack) {
    const int width = 2 * pairs_of(E);
    uint16_t *dst = qpack;
    for (int r = 0; r < rows; r++, dst += width) {
        const float *src = q + (size_t)r * ldq;
        for (int e = 0; e < E; e++) dst[e] = af_f32_to_bf16(src[e]);
        if (E < width) dst[E] = 0;
    }
}

/* Pair p of a bf16 row of E elements, zero past E (nothing past the row is read). */
static uint32_t row_pair(const char *row, int p, int E) {
    uint16_t lo = 0, hi = 0;
    memcpy(&lo, row + 4 * (size_t)p, 2);
    if (2 * p + 1 < E) memcpy(&hi, row + 4 * (size_t)p + 2, 2);
    return (uint32_t)lo | (uint32_t)hi << 16;
}

/* K in pair rows: a 32-bit transpose (keys × pairs -> pairs × keys), 8 × 8 words through registers. */
static void bf16_pack_k(int keys, int E, const void *k, size_t key_stride, af_dtype dtype, void *kpack) {
    (void)dtype;   /* bf16: what accepts() took */
    const int pairs = pairs_of(E), whole = E / 2 / 8 * 8, groups = (keys + BF_GROUP - 1) / BF_GROUP;
    float *dst = kpack;   /* words handled as floats: only moved */
    for (int g = 0; g < groups; g++) {
        float *tile = dst + (size_t)g * pairs * BF_GROUP;
        for (int n0 = 0; n0 < BF_GROUP; n0 += 8) {
            const int j0 = g * BF_GROUP + n0;
            if (j0 + 8 <= keys) {
                const char *rows = (const char *)k + (size_t)j0 * key_stride;
                for (int p0 = 0; p0 < whole; p0 += 8) {
                    __m256 r[8];
                    for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps((const float *)(rows + (size_t)j * key_stride) + p0);
                    x86_transpose8(r);
                    for (int p = 0; p < 8; p++) _mm256_storeu_ps(tile + (size_t)(p0 + p) * BF_GROUP + n0, r[p]);
                }
                for (int p = whole; p < pairs; p++)
                    for (int n = 0; n < 8; n++) {
                        const uint32_t w = row_pair(rows + (size_t)n * key_stride, p, E);
                        memcpy(tile + (size_t)p * BF_GROUP + n0 + n, &w, 4);
                    }
                continue;
            }
            for (int n = n0; n < n0 + 8; n++) {   /* the last keys, and zero columns past them */
                const int j = g * BF_GROUP + n;
                const char *row = (const char *)k + (size_t)j * key_stride;
                for (int p = 0; p < pairs; p++) {
                    const uint32_t w = j < keys ? row_pair(row, p, E) : 0;
                    memcpy(tile + (size_t)p * BF_GROUP + n, &w, 4);
                }
            }
        }
    }
}

/* V rows as f32 (exact), zero from Ev to the padded width the gemm reads. */
static void bf16_pack_v(int keys, int Ev, const void *v, size_t key_stride, af_dtype dtype, void *vpack) {
    const int ld = v_ld(Ev), padded = round_up_int(Ev, AF_TILE_PAD);
    float *dst = vpack;
    for (int j = 0; j < keys; j++, dst += ld) {
        x86_convert(dst, (const char *)v + (size_t)j * key_stride, dtype, Ev);
        memset(dst + Ev, 0, sizeof(float) * (size_t)(padded - Ev));
    }
}

/* S[mr × nv·16] = Q's mr rows · the group's keys: per pair, nv K vectors against a broadcast Q pair per row. mr and
 * nv are compile-time constants at every call (always_inline + switch), so acc[][] lives in registers. */
static inline __attribute__((always_inline)) void bf16_tile(const int mr, const int nv, int pairs, const uint32_t *q,
                                                            const float *kg, float *S, int lds) {
    __m512 acc[BF_MR][2];
    BF_UNROLL for (int i = 0; i < mr; i++) BF_UNROLL for (int v = 0; v < nv; v++) acc[i][v] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int p = 0; p < pairs; p++) {
        __m512i b[2];
        BF_UNROLL for (int v = 0; v < nv; v++) b[v] = _mm512_load_si512(kg + (size_t)p * BF_GROUP + 16 * v);
        BF_UNROLL for (int i = 0; i < mr; i++) {
            const __m512i a = _mm512_set1_epi32((int)q[(size_t)i * pairs + p]);
            BF_UNROLL for (int v = 0; v < nv; v++)
                acc[i][v] = _mm512_dpbf16_ps(acc[i][v], (__m512bh)a, (__m512bh)b[v]);
        }
    }
    BF_UNROLL for (int i = 0; i < mr; i++)
        BF_UNROLL for (int v = 0; v < nv; v++) _mm512_storeu_ps(S + (size_t)i * lds + 16 * v, acc[i][v]);
}

#define BF_ROWS_CASE(r)                                   \
    case r:                                               \
        bf16_tile(r, nv, pairs, q, kg, S, lds);           \
        break;

/* One group's columns over all rows: whole 12-row tiles, then one tile of the rest. */
static inline __attribute__((always_inline)) void bf16_strip(const int nv, int rows, int pairs, const uint32_t *q,
                                                             const float *kg, float *S, int lds) {
    int i = 0;
    for (; i + BF_MR <= rows; i += BF_MR) bf16_tile(BF_MR, nv, pairs, q + (size_t)i * pairs, kg, S + (size_t)i * lds, lds);
    q += (size_t)i * pairs;
    S += (size_t)i * lds;
    switch (rows - i) {
        BF_ROWS_CASE(1) BF_ROWS_CASE(2) BF_ROWS_CASE(3) BF_ROWS_CASE(4) BF_ROWS_CASE(5) BF_ROWS_CASE(6)
        BF_ROWS_CASE(7) BF_ROWS_CASE(8) BF_ROWS_CASE(9) BF_ROWS_CASE(10) BF_ROWS_CASE(11)
    default: break;
    }
}
#undef BF_ROWS_CASE

/* S[r·lds + j] = q_{row0 + r} · k_j: a group of 32 keys at a time, its last 16 columns skipped past cols (S is
 * writable only to round_up(cols, 16)). */
static void bf16_scores(int rows, int cols, int E, const void *qpack, int row0, const void *kpack, float *S, int lds) {
    const int pairs = pairs_of(E);
    const uint32_t *q = (const uint32_t *)qpack + (size_t)row0 * pairs;
    for (int j0 = 0; j0 < cols; j0 += BF_GROUP) {
        const float *kg = (const float *)kpack + (size_t)(j0 / BF_GROUP) * pairs * BF_GROUP;
        if (cols - j0 > 16) bf16_strip(2, rows, pairs, q, kg, S + j0, lds);
        else bf16_strip(1, rows, pairs, q, kg, S + j0, lds);
    }
}

/* O += P·V with P in f32: the AVX-512 table's gemm on the f32 V tile. */
static void bf16_values(int rows, int Ev, int cols, const float *P, int ldp, const void *vpack, float *O, int ldo) {
    af_ukernel_avx512.gemm(rows, Ev, cols, P, ldp, vpack, v_ld(Ev), O, ldo, true);
}

const af_products af_products_avx512_bf16 = {
    .accepts = bf16_accepts,
    .min_rows = 17,   /* decode's few rows (the driver's direct limit, 16) keep the direct kernels */
    .blocking = bf16_blocking,
    .q_bytes = bf16_q_bytes,
    .k_bytes = bf16_k_bytes,
    .v_bytes = bf16_v_bytes,
    .pack_q = bf16_pack_q,
    .pack_k = bf16_pack_k,
    .pack_v = bf16_pack_v,
    .scores = bf16_scores,
    .values = bf16_values,
};
