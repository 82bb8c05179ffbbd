/* AVX512-BF16 products (ukernel.h's af_products) for bf16 calls on the AVX-512 table: S = Q·Kᵀ and O += P·V by
 * vdpbf16ps (two bf16 products per f32 lane, f32 accumulation: half the instructions of f32 FMAs), P rounded to
 * bf16 before P·V as AMX and FlashAttention do (af_error_bound's p_round; a bf16 call's output is bf16).
 * dispatch.c adds them to the avx512 table only where CPUID reports avx512_bf16 (core/cpu.c). vdpbf16ps and
 * vcvtne2ps2bf16 treat subnormals as zero and flush subnormal results (DAZ/FTZ): below 2^-126, far under the
 * errors af_error_bound allows.
 *
 * Formats (a "pair" = two bf16 in one 32-bit word, the unit of vdpbf16ps):
 *   Q block: row-major, rows × pairs(E) words (pairs of head-dim elements; an odd E's last pair padded with zero).
 *   K tile:  per group of 32 keys, pairs(E) rows × 32 keys of words: K_{32g+n}'s pair p at (g·pairs + p)·32 + n;
 *            keys past the tile's end are zero.
 *   V tile:  per group of 32 value columns, pairs(keys) rows × 32 columns of words: (V_{2p}[32g+n], V_{2p+1}[32g+n])
 *            at (g·pairs(keys) + p)·32 + n; columns past Ev and an odd tile's last key are zero.
 *   P:       each strip's rows rounded to bf16 pairs of keys (nearest even, NaN kept) on the stack, 64 keys at a time. */
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

static bool bf16_accepts(af_dtype dtype, int E, int Ev) { return dtype == AF_BF16 && E >= 1 && Ev >= 0; }

/* The AVX-512 table's blocking: 64 keys (two groups) and its query rows. */
static void bf16_blocking(int E, int Ev, int *block_rows, int *block_keys) {
    af_ukernel_avx512.blocking(E, Ev, block_rows, block_keys);
}

static size_t bf16_q_bytes(int rows, int E) { return (size_t)rows * (size_t)pairs_of(E) * 4; }
static size_t bf16_k_bytes(int keys, int E) { return (size_t)round_up_int(keys, BF_GROUP) * (size_t)pairs_of(E) * 4; }
static size_t bf16_v_bytes(int keys, int Ev) {
    return (size_t)pairs_of(keys) * (size_t)round_up_int(Ev > 0 ? Ev : 1, BF_GROUP) * 4;
}

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

/* V in pairs of keys: rows 2p and 2p+1 interleaved element by element, 16 columns at a time through registers. */
static void bf16_pack_v(int keys, int Ev, const void *v, size_t key_stride, af_dtype dtype, void *vpack) {
    (void)dtype;   /* bf16: what accepts() took */
    const int kp = pairs_of(keys), groups = (Ev + BF_GROUP - 1) / BF_GROUP;
    uint16_t *dst = vpack;
    for (int p = 0; p < kp; p++) {
        const uint16_t *r0 = (const uint16_t *)((const char *)v + (size_t)(2 * p) * key_stride);
        const uint16_t *r1 = 2 * p + 1 < keys ? (const uint16_t *)((const char *)v + (size_t)(2 * p + 1) * key_stride) : NULL;
        for (int g = 0; g < groups; g++) {
            uint16_t *out = dst + ((size_t)g * kp + p) * 2 * BF_GROUP;
            int n = 0;
            for (; n + 16 <= BF_GROUP && BF_GROUP * g + n + 16 <= Ev; n += 16) {
                const __m256i a = _mm256_loadu_si256((const __m256i *)(r0 + BF_GROUP * g + n));
                const __m256i b = r1 ? _mm256_loadu_si256((const __m256i *)(r1 + BF_GROUP * g + n)) : _mm256_setzero_si256();
                const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);   /* per 128-bit lane */
                _mm256_storeu_si256((__m256i *)(out + 2 * n), _mm256_permute2x128_si256(lo, hi, 0x20));
                _mm256_storeu_si256((__m256i *)(out + 2 * n + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
            }
            for (; n < BF_GROUP; n++) {   /* the last columns, and zero past Ev */
                const int c = BF_GROUP * g + n;
                out[2 * n] = c < Ev ? r0[c] : 0;
                out[2 * n + 1] = c < Ev && r1 ? r1[c] : 0;
            }
        }
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

#define BF_P_KEYS 64   /* keys of P rounded per pass (the driver's tiles: one pass) */

/* O[mr × nv·16] += the strip's bf16 P pairs (pb, rows BF_P_KEYS / 2 words apart) · a V group's kp pair rows. */
static inline __attribute__((always_inline)) void bf16_pv_tile(const int mr, const int nv, int kp, const uint32_t *pb,
                                                               const float *vg, float *O, int ldo) {
    __m512 acc[BF_MR][2];
    BF_UNROLL for (int i = 0; i < mr; i++)
        BF_UNROLL for (int v = 0; v < nv; v++) acc[i][v] = _mm512_loadu_ps(O + (size_t)i * ldo + 16 * v);
#pragma GCC unroll 2
    for (int p = 0; p < kp; p++) {
        __m512i b[2];
        BF_UNROLL for (int v = 0; v < nv; v++) b[v] = _mm512_load_si512(vg + (size_t)p * BF_GROUP + 16 * v);
        BF_UNROLL for (int i = 0; i < mr; i++) {
            const __m512i a = _mm512_set1_epi32((int)pb[(size_t)i * (BF_P_KEYS / 2) + p]);
            BF_UNROLL for (int v = 0; v < nv; v++)
                acc[i][v] = _mm512_dpbf16_ps(acc[i][v], (__m512bh)a, (__m512bh)b[v]);
        }
    }
    BF_UNROLL for (int i = 0; i < mr; i++)
        BF_UNROLL for (int v = 0; v < nv; v++) _mm512_storeu_ps(O + (size_t)i * ldo + 16 * v, acc[i][v]);
}

#define BF_PV_CASE(r)                                     \
    case r:                                               \
        bf16_pv_tile(r, nv, kp, pb, vg, O, ldo);          \
        break;

static inline __attribute__((always_inline)) void bf16_pv_rows(const int nv, int mr, int kp, const uint32_t *pb,
                                                               const float *vg, float *O, int ldo) {
    switch (mr) {
        BF_PV_CASE(1) BF_PV_CASE(2) BF_PV_CASE(3) BF_PV_CASE(4) BF_PV_CASE(5) BF_PV_CASE(6)
        BF_PV_CASE(7) BF_PV_CASE(8) BF_PV_CASE(9) BF_PV_CASE(10) BF_PV_CASE(11) BF_PV_CASE(12)
    default: break;
    }
}
#undef BF_PV_CASE

/* Row r's P[j0 .. j0 + n) (n <= BF_P_KEYS) as bf16 pairs, zero past n (P's columns past cols are not read). */
static void bf16_round_p(const float *p, int n, uint32_t *pairs) {
    for (int j = 0; j < round_up_int(n, 2); j += 32) {
        const int left = n - j;
        const __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        const __mmask16 m1 = left >= 32 ? 0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
        const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, p + j + 16), _mm512_maskz_loadu_ps(m0, p + j));
        _mm512_storeu_si512(pairs + j / 2, (__m512i)h);   /* BF_P_KEYS / 2 words a row: room for a whole vector */
    }
}

/* O += P·V: per strip of BF_MR rows and BF_P_KEYS keys, P rounded to bf16 pairs once, then each 32-column group. */
static void bf16_values(int rows, int Ev, int cols, const float *P, int ldp, const void *vpack, float *O, int ldo) {
    const int kp_all = pairs_of(cols), groups = (Ev + BF_GROUP - 1) / BF_GROUP;
    _Alignas(64) uint32_t pb[BF_MR * (BF_P_KEYS / 2)];
    for (int j0 = 0; j0 < cols; j0 += BF_P_KEYS) {
        const int n = cols - j0 < BF_P_KEYS ? cols - j0 : BF_P_KEYS, kp = pairs_of(n);
        for (int r0 = 0; r0 < rows; r0 += BF_MR) {
            const int mr = rows - r0 < BF_MR ? rows - r0 : BF_MR;
            for (int i = 0; i < mr; i++) bf16_round_p(P + (size_t)(r0 + i) * ldp + j0, n, pb + (size_t)i * (BF_P_KEYS / 2));
            for (int g = 0; g < groups; g++) {
                const float *vg = (const float *)vpack + ((size_t)g * kp_all + (size_t)j0 / 2) * BF_GROUP;
                float *Og = O + (size_t)r0 * ldo + BF_GROUP * g;
                if (Ev - BF_GROUP * g > 16) bf16_pv_rows(2, mr, kp, pb, vg, Og, ldo);
                else bf16_pv_rows(1, mr, kp, pb, vg, Og, ldo);
            }
        }
    }
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
