/* Packing for the x86 vector micro-kernels (AVX2 + F16C; AVX-512 machines have both): f16/bf16 -> f32 eight
 * at a time and the K tile transposed in 8×8 register blocks. Shared by ukernel_avx2.c and ukernel_avx512.c. */
#ifndef AF_KERNEL_UKERNEL_PACK_X86_H
#define AF_KERNEL_UKERNEL_PACK_X86_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "core/dtype.h"
#include "kernel/ukernel.h"

/* float8 bytes, each in the high byte of a 16-bit lane (byte << 8), as f16 bits: e5m2 is exactly the high byte of an
 * f16; e4m3fn's S EEEE MMM becomes S 0 EEEE MMM 0000000 (an arithmetic shift by one, bit 14 cleared), the f16 of the
 * value times 2^-8 (subnormals too: every e4m3 value is an f16 value), and its NaN (S 1111 111, which would read as
 * ±1.875) all-ones, an f16 NaN. Callers multiply e4m3 by X86_F8E4M3_RESCALE once converted to f32. */
#define X86_F8E4M3_RESCALE 256.0f
#define X86_F8_TO_F16_BITS(SUF, hi, dtype)                                                                          \
    ((dtype) == AF_F8E5M2 ? (hi) : X86_F8E4M3_BITS_##SUF(hi))
static inline __m128i X86_F8E4M3_BITS_128(__m128i hi) {
    const __m128i h = _mm_and_si128(_mm_srai_epi16(hi, 1), _mm_set1_epi16((short)0xbfff));
    const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x3f80));
    return _mm_or_si128(h, nan);
}
static inline __m256i X86_F8E4M3_BITS_256(__m256i hi) {
    const __m256i h = _mm256_and_si256(_mm256_srai_epi16(hi, 1), _mm256_set1_epi16((short)0xbfff));
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(0x3f80));
    return _mm256_or_si256(h, nan);
}

/* e4m3fn bytes known to hold no NaN as f16 bits of value·2^-8 (AF_F8E4M3_SCALED), from the bytes sign-extended to
 * 16 bits (vpmovsxbw, which takes the load along): shifted left by 7, S lands in bits 15 and 14, EEEE.MMM in 13..7;
 * clearing bit 14 leaves S.0EEEE.MMM0000000. */
static inline __m128i X86_F8E4M3_SCALED_BITS_128(__m128i sx) {
    return _mm_and_si128(_mm_slli_epi16(sx, 7), _mm_set1_epi16((short)0xbfff));
}
static inline __m256i X86_F8E4M3_SCALED_BITS_256(__m256i sx) {
    return _mm256_and_si256(_mm256_slli_epi16(sx, 7), _mm256_set1_epi16((short)0xbfff));
}

/* Eight float8 values at p (8 bytes read) as f32, exactly (AF_F8E4M3_SCALED: times 2^-8, exactly). */
static inline __m256 x86_load8_f8(const char *p, af_dtype dtype) {
    long long bytes;
    memcpy(&bytes, p, 8);
    if (dtype == AF_F8E4M3_SCALED)
        return _mm256_cvtph_ps(X86_F8E4M3_SCALED_BITS_128(_mm_cvtepi8_epi16(_mm_cvtsi64_si128(bytes))));
    const __m128i hi = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_cvtsi64_si128(bytes));   /* byte << 8 per lane */
    const __m256 f = _mm256_cvtph_ps(X86_F8_TO_F16_BITS(128, hi, dtype));
    return dtype == AF_F8E5M2 ? f : _mm256_mul_ps(f, _mm256_set1_ps(X86_F8E4M3_RESCALE));
}

/* Eight elements of `dtype` at p as f32: F16C for f16, a 16-bit shift for bf16, float8 through f16 (all exact). */
static inline __m256 x86_load8_f32(const char *p, af_dtype dtype) {
    if (dtype == AF_F32) return _mm256_loadu_ps((const float *)p);
    if (dtype == AF_F8E4M3 || dtype == AF_F8E5M2 || dtype == AF_F8E4M3_SCALED) return x86_load8_f8(p, dtype);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (dtype == AF_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float x86_load1_f32(const char *p, af_dtype dtype) { return af_load_as_f32(p, dtype); }

__attribute__((unused)) static void x86_convert(float *dst, const void *src, af_dtype dtype, int n) {
    const char *s = src;
    const size_t elem = af_elem_bytes(dtype);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, x86_load8_f32(s + (size_t)i * elem, dtype));
    for (; i < n; i++) dst[i] = x86_load1_f32(s + (size_t)i * elem, dtype);
}

/* r[0..8) rows in, columns out: r[c] becomes (r0[c], r1[c], ..., r7[c]). */
static inline void x86_transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* kt[e][j] = K_j[e]: whole 8-key × 8-element blocks through registers, the ragged edges element by element. */
__attribute__((unused)) static void x86_pack_kt(int cols, int E, const void *k, size_t key_stride, af_dtype dtype, float *kt, int ldkt) {
    const char *base = k;
    const size_t elem = af_elem_bytes(dtype);
    const int full_keys = cols / 8 * 8, full_elems = E / 8 * 8;
    for (int j0 = 0; j0 < full_keys; j0 += 8) {
        const char *rows = base + (size_t)j0 * key_stride;
        for (int e0 = 0; e0 < full_elems; e0 += 8) {
            __m256 r[8];
            for (int j = 0; j < 8; j++) r[j] = x86_load8_f32(rows + (size_t)j * key_stride + (size_t)e0 * elem, dtype);
            x86_transpose8(r);
            for (int e = 0; e < 8; e++) _mm256_storeu_ps(kt + (size_t)(e0 + e) * ldkt + j0, r[e]);
        }
        for (int e = full_elems; e < E; e++)
            for (int j = 0; j < 8; j++)
                kt[(size_t)e * ldkt + j0 + j] = x86_load1_f32(rows + (size_t)j * key_stride + (size_t)e * elem, dtype);
    }
    for (int j = full_keys; j < cols; j++)
        for (int e = 0; e < E; e++)
            kt[(size_t)e * ldkt + j] = x86_load1_f32(base + (size_t)j * key_stride + (size_t)e * elem, dtype);
    const int padded = (cols + AF_TILE_PAD - 1) / AF_TILE_PAD * AF_TILE_PAD;
    if (padded > cols)
        for (int e = 0; e < E; e++) memset(kt + (size_t)e * ldkt + cols, 0, sizeof(float) * (size_t)(padded - cols));
}

#endif
