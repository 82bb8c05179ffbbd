/* f16 / bf16 / float8 <-> f32 conversions (round to nearest even, NaN kept) and typed element access. */
#ifndef AF_CORE_DTYPE_H
#define AF_CORE_DTYPE_H
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "attnforge.h"

static inline float af_bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t af_f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float af_bf16_to_f32(uint16_t h) { return af_bits_to_f32((uint32_t)h << 16); }

static inline uint16_t af_f32_to_bf16(float f) {
    const uint32_t u = af_f32_to_bits(f);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;   /* round to nearest even */
    const uint32_t quiet = (u >> 16) | 0x40u;                          /* NaN: quieted, sign and payload kept */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);   /* a select, no branch: loops vectorise */
}

static inline float af_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return af_bits_to_f32(sign | 0x7f800000u | (man << 13));   /* Inf / NaN */
    if (exp == 0) {                                                             /* zero / subnormal */
        float v = (float)man * (1.0f / 16777216.0f);                            /* man * 2^-24 */
        return sign ? -v : v;
    }
    return af_bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t af_f32_to_f16(float f) {
    uint32_t u = af_f32_to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);                    /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);                   /* overflow (incl. Inf) */
    if (a < 0x38800000u) {                                                      /* f16 subnormal or zero */
        float v = af_bits_to_f32(a) * 16777216.0f;                              /* scale by 2^24 */
        uint32_t m = (uint32_t)v;                                               /* exact for these sizes */
        float rem = v - (float)m;
        if (rem > 0.5f || (rem == 0.5f && (m & 1u))) m++;
        return (uint16_t)(sign | m);
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u);                                 /* round mantissa to 10 bits */
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

static inline bool af_is_f8(af_dtype dtype) { return dtype == AF_F8E4M3 || dtype == AF_F8E5M2; }

/* Bytes per element, inline so that a kernel's constant dtype folds it (af_dtype_size is the public one). */
static inline size_t af_elem_bytes(af_dtype dtype) {
    return dtype == AF_F32 || dtype == AF_I32 ? 4 : dtype == AF_F16 || dtype == AF_BF16 ? 2 : 1;
}

/* float8_e4m3fn: S EEEE MMM, bias 7, no infinity, S 1111 111 is NaN; subnormals M·2^-9. Exact. */
static inline float af_f8e4m3_to_f32(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80u) << 24, exp = (b >> 3) & 0xfu, man = b & 7u;
    if (exp == 0xf && man == 7) return af_bits_to_f32(sign | 0x7fc00000u);
    if (exp == 0) {
        const float v = (float)man * (1.0f / 512.0f);
        return sign ? -v : v;
    }
    return af_bits_to_f32(sign | ((exp + 120u) << 23) | (man << 20));
}

/* float8_e5m2: the high byte of an f16. Exact. */
static inline float af_f8e5m2_to_f32(uint8_t b) { return af_f16_to_f32((uint16_t)(b << 8)); }

/* f32 -> float8, round to nearest even (tests and the reference's stores; not on a hot path). Past the largest
 * finite value after rounding: e5m2 gives infinity, e4m3fn (which has none) NaN, as torch's .to() does. */
static inline uint8_t af_f32_to_f8(float f, af_dtype dtype) {
    const bool e4m3 = dtype == AF_F8E4M3;
    const int man_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    const float max = e4m3 ? 448.0f : 57344.0f;
    const uint8_t sign = (uint8_t)(af_f32_to_bits(f) >> 24 & 0x80u), nan = e4m3 ? 0x7f : 0x7e;
    const float a = fabsf(f);
    if (a != a) return (uint8_t)(sign | nan);
    if (a > 2.0f * max) return (uint8_t)(sign | (e4m3 ? nan : 0x7c));   /* incl. infinity */
    int e;
    frexpf(a, &e);   /* a = m·2^e, m in [0.5, 1) */
    if (e - 1 < 1 - bias) e = 2 - bias;   /* subnormal range: the quantum of the smallest normal binade */
    const float quantum = ldexpf(1.0f, e - 1 - man_bits);
    const float r = nearbyintf(a / quantum) * quantum;   /* a / quantum is exact: a power-of-2 division */
    if (r > max) return (uint8_t)(sign | (e4m3 ? nan : 0x7c));
    if (r < ldexpf(1.0f, 1 - bias))   /* subnormal (or zero): M = r / 2^(1 - bias - man_bits) */
        return (uint8_t)(sign | (uint8_t)ldexpf(r, bias - 1 + man_bits));
    int re;
    const float rm = frexpf(r, &re);   /* r = rm·2^re, rm in [0.5, 1): exponent field re - 1 + bias */
    const uint32_t man = (uint32_t)ldexpf(rm * 2.0f - 1.0f, man_bits);
    return (uint8_t)(sign | (uint32_t)(re - 1 + bias) << man_bits | man);
}

/* Read element `p` of `dtype` as f32 (bool reads as 0/1, int32 rounds past 2^24); `p` need not be aligned. */
static inline float af_load_as_f32(const void *p, af_dtype dtype) {
    float f;
    uint16_t h;
    switch (dtype) {
    case AF_F32: memcpy(&f, p, 4); return f;
    case AF_F16: memcpy(&h, p, 2); return af_f16_to_f32(h);
    case AF_BF16: memcpy(&h, p, 2); return af_bf16_to_f32(h);
    case AF_BOOL: return *(const uint8_t *)p ? 1.0f : 0.0f;
    case AF_I32: { int32_t i; memcpy(&i, p, 4); return (float)i; }
    case AF_F8E4M3: return af_f8e4m3_to_f32(*(const uint8_t *)p);
    case AF_F8E5M2: return af_f8e5m2_to_f32(*(const uint8_t *)p);
    }
    return 0.0f;
}

static inline void af_store_from_f32(void *p, af_dtype dtype, float v) {
    switch (dtype) {
    case AF_F32: *(float *)p = v; break;
    case AF_F16: *(uint16_t *)p = af_f32_to_f16(v); break;
    case AF_BF16: *(uint16_t *)p = af_f32_to_bf16(v); break;
    case AF_BOOL: *(uint8_t *)p = v != 0.0f; break;
    case AF_I32: {   /* out of range (or NaN): 0 */
        const int32_t i = v >= -2147483648.0f && v < 2147483648.0f ? (int32_t)v : 0;
        memcpy(p, &i, 4);
        break;
    }
    case AF_F8E4M3: case AF_F8E5M2: *(uint8_t *)p = af_f32_to_f8(v, dtype); break;
    }
}

#endif
