/* AVX2 + FMA micro-kernels: the shared vector template (ukernel_simd.inc) on 8-float __m256 vectors.
 * Register tile 6 rows × 16 columns: 12 accumulators + 2 B vectors + 1 broadcast = 15 of the 16 ymm. */
#include <immintrin.h>

#include "kernel/ukernel_pack_x86.h"

static inline float avx2_hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float avx2_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[q] = sum of v[q]'s lanes, q < 8: a tree of 6 hadds and 2 lane swaps instead of 8 separate reductions. */
static inline void avx2_hsum8(const __m256 v[8], float out[8]) {
    const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 g0 = _mm256_hadd_ps(h01, h23), g1 = _mm256_hadd_ps(h45, h67);   /* lanes: 0 1 2 3 | 0 1 2 3 */
    const __m256 lo = _mm256_permute2f128_ps(g0, g1, 0x20), hi = _mm256_permute2f128_ps(g0, g1, 0x31);
    _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
}

/* 16 bf16 at p as f32, by one load, a shift and a mask: *ev the even-indexed elements, *od the odd ones (a bf16 is the
 * high half of its f32; widening 8 at a time costs a vpmovzxwd and a shift each, 1.6× an FMA-only loop's time at
 * decode's 1 load per 2 FMAs against 1.35× this way, measured). */
static inline void avx2_load_bf16_pairs(const void *p, __m256 *ev, __m256 *od) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)p);
    *ev = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    *od = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)));
}

/* x[0..16) in a, b -> *ev = x[0, 2, .., 14], *od = x[1, 3, .., 15]: the order avx2_load_bf16_pairs gives. */
static inline void avx2_split_pairs(__m256 a, __m256 b, __m256 *ev, __m256 *od) {
    *ev = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xd8));
    *od = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd)), 0xd8));
}

/* The inverse of avx2_split_pairs. */
static inline void avx2_join_pairs(__m256 ev, __m256 od, __m256 *a, __m256 *b) {
    const __m256 lo = _mm256_unpacklo_ps(ev, od), hi = _mm256_unpackhi_ps(ev, od);
    *a = _mm256_permute2f128_ps(lo, hi, 0x20);
    *b = _mm256_permute2f128_ps(lo, hi, 0x31);
}

#define UK_ISA "avx2"
#define UK_TABLE af_ukernel_avx2
#define UK_SUFFIX avx2
#define VEC __m256
#define VI __m256i
#define MASK __m256
#define VW 8
#define UK_MR 6
#define UK_NV 2
#define UK_KEYS 64
#define UK_MAX_ROWS 192
#define UK_L2_FLOATS (320L * 1024 / 4)   /* 5/8 of a 512 KiB L2 (Zen 2/3); the rest for streamed K/V rows */

#define UK_PACK_KT x86_pack_kt   /* 8×8 AVX2 transposes and F16C: AVX-512 machines have both */
#define UK_CONVERT x86_convert

#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_LOAD_CVT(p, dt) x86_load8_f32((p), (dt))
#define V_LOAD1_CVT(p, dt) x86_load1_f32((p), (dt))
#define V_STORE(p, v) _mm256_storeu_ps((p), (v))
#define V_SET1(x) _mm256_set1_ps(x)
#define V_ZERO() _mm256_setzero_ps()
#define V_BCAST(p) _mm256_broadcast_ss(p)
#define V_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define V_MUL(a, b) _mm256_mul_ps((a), (b))
#define V_ADD(a, b) _mm256_add_ps((a), (b))
#define V_SUB(a, b) _mm256_sub_ps((a), (b))
#define V_MAX(a, b) _mm256_max_ps((a), (b))
#define V_HMAX(v) avx2_hmax(v)
#define V_HSUM(v) avx2_hsum(v)
#define V_HSUM8(v, out) avx2_hsum8((v), (out))
#define V_FIRST(v) _mm256_cvtss_f32(v)
#define V_CVT_NEAREST(v) _mm256_cvtps_epi32(v)
#define V_CVT_FLOAT(i) _mm256_cvtepi32_ps(i)
#define V_MUL_POW2(p, n) _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32((n), 23)))
#define V_LESS(a, b) _mm256_cmp_ps((a), (b), _CMP_LT_OQ)
#define V_LANES_BELOW(n) \
    _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))
#define V_SELECT(m, a, b) _mm256_blendv_ps((a), (b), (m))
#define V_ZERO_WHERE(m, v) _mm256_andnot_ps((m), (v))
#define V_LOAD_BF16_PAIRS(p, ev, od) avx2_load_bf16_pairs((p), (ev), (od))
#define V_SPLIT_PAIRS(a, b, ev, od) avx2_split_pairs((a), (b), (ev), (od))
#define V_JOIN_PAIRS(ev, od, a, b) avx2_join_pairs((ev), (od), (a), (b))

#include "kernel/ukernel_simd.inc"
