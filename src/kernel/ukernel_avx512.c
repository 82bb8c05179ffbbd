/* AVX-512F micro-kernels: the shared vector template (ukernel_simd.inc) on 16-float __m512 vectors.
 * Register tile 12 rows × 32 columns: 24 accumulators + 2 B vectors + 1 broadcast = 27 of the 32 zmm.
 * Masks are __mmask16 (bit i = lane i). vmaxps keeps the x86 rule: the second operand when either is NaN.
 * bf16 calls take vdpbf16ps products (Q·Kᵀ, P·V) where the CPU has AVX512-BF16 (ukernel_avx512_bf16.c, dispatch.c);
 * AVX512-FP16 would need f16 accumulation, which the precision contract does not allow. */
#include <immintrin.h>

#include "kernel/ukernel_pack_x86.h"

/* 16 elements of `dtype` at p as f32: vcvtph2ps for f16, a 16-bit shift for bf16, float8 through f16 (x86_load8_f8's
 * bits, 16 lanes at once), all exact. */
static inline __m512 avx512_load16_f32(const char *p, af_dtype dtype) {
    if (dtype == AF_F32) return _mm512_loadu_ps((const float *)p);
    if (dtype == AF_F8E4M3 || dtype == AF_F8E5M2 || dtype == AF_F8E4M3_SCALED) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
        if (dtype == AF_F8E4M3_SCALED) return _mm512_cvtph_ps(X86_F8E4M3_SCALED_BITS_256(_mm256_cvtepi8_epi16(bytes)));
        const __m256i hi = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);
        const __m512 f = _mm512_cvtph_ps(X86_F8_TO_F16_BITS(256, hi, dtype));
        return dtype == AF_F8E5M2 ? f : _mm512_mul_ps(f, _mm512_set1_ps(X86_F8E4M3_RESCALE));
    }
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (dtype == AF_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 32 bf16 at p as f32: *ev the even-indexed elements, *od the odd ones (as avx2_load_bf16_pairs, 16 lanes). */
static inline void avx512_load_bf16_pairs(const void *p, __m512 *ev, __m512 *od) {
    const __m512i x = _mm512_loadu_si512(p);
    *ev = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *od = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

/* x[0..32) in a, b -> *ev = x[0, 2, .., 30], *od = x[1, 3, .., 31] (vpermt2ps indices: b's lanes are 16..31). */
static inline void avx512_split_pairs(__m512 a, __m512 b, __m512 *ev, __m512 *od) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    *ev = _mm512_permutex2var_ps(a, even, b);
    *od = _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
}

/* The inverse of avx512_split_pairs. */
static inline void avx512_join_pairs(__m512 ev, __m512 od, __m512 *a, __m512 *b) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    *a = _mm512_permutex2var_ps(ev, lo, od);
    *b = _mm512_permutex2var_ps(ev, _mm512_add_epi32(lo, _mm512_set1_epi32(8)), od);
}

#define UK_ISA "avx512"
#define UK_TABLE af_ukernel_avx512
#define UK_SUFFIX avx512
#define VEC __m512
#define VI __m512i
#define MASK __mmask16
#define VW 16
#define UK_MR 12
#define UK_NV 2
#define UK_KEYS 64
#define UK_MAX_ROWS 240
#define UK_L2_FLOATS (512L * 1024 / 4)   /* a quarter of a 2 MiB L2 (Sapphire Rapids class) */

#define UK_PACK_KT x86_pack_kt   /* 8×8 AVX2 transposes and F16C: AVX-512 machines have both */
#define UK_CONVERT x86_convert

#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_LOAD_CVT(p, dt) avx512_load16_f32((p), (dt))
#define V_LOAD1_CVT(p, dt) x86_load1_f32((p), (dt))
#define V_STORE(p, v) _mm512_storeu_ps((p), (v))
#define V_SET1(x) _mm512_set1_ps(x)
#define V_ZERO() _mm512_setzero_ps()
#define V_BCAST(p) _mm512_set1_ps(*(p))
#define V_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define V_MUL(a, b) _mm512_mul_ps((a), (b))
#define V_ADD(a, b) _mm512_add_ps((a), (b))
#define V_SUB(a, b) _mm512_sub_ps((a), (b))
#define V_MAX(a, b) _mm512_max_ps((a), (b))
#define V_HMAX(v) _mm512_reduce_max_ps(v)
#define V_HSUM(v) _mm512_reduce_add_ps(v)
#define V_FIRST(v) _mm512_cvtss_f32(v)
#define V_CVT_NEAREST(v) _mm512_cvtps_epi32(v)
#define V_CVT_FLOAT(i) _mm512_cvtepi32_ps(i)
#define V_MUL_POW2(p, n) _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32((n), 23)))
#define V_LESS(a, b) _mm512_cmp_ps_mask((a), (b), _CMP_LT_OQ)
#define V_LANES_BELOW(n) ((__mmask16)((n) >= 16 ? 0xffffu : (1u << (n)) - 1u))
#define V_SELECT(m, a, b) _mm512_mask_blend_ps((m), (a), (b))
#define V_ZERO_WHERE(m, v) _mm512_mask_mov_ps((v), (m), _mm512_setzero_ps())
#define V_LOAD_BF16_PAIRS(p, ev, od) avx512_load_bf16_pairs((p), (ev), (od))
#define V_SPLIT_PAIRS(a, b, ev, od) avx512_split_pairs((a), (b), (ev), (od))
#define V_JOIN_PAIRS(ev, od, a, b) avx512_join_pairs((ev), (od), (a), (b))

#include "kernel/ukernel_simd.inc"
