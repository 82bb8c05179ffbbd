/* The number primitives of src/cuda/device.h as the PTX instructions define them: ex2.approx.ftz.f32,
 * tanh.approx.f32 at its documented worst error, and the round-to-nearest-even conversions between f32 and f16/bf16
 * (cvt.rn). */
#include <math.h>
#include <string.h>

#include "cuda_emulated.h"

static uint32_t float_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* 2^x; .ftz: a subnormal input counts as zero and a subnormal result becomes +0 (2^x is never negative). */
float af_ex2(float x)
{
    if ((float_bits(x) & 0x7f800000u) == 0)
        x = 0.0f;
    float y = (float)exp2((double)x);
    return (y < 0x1p-126f) ? 0.0f : y;
}

/* tanh.approx.f32 promises a relative error below 2^-10.987 and no more: every result here is off by that much
 * (less a hair), up or down as a hash of x's bits says, so a kernel's tolerance is tested against the worst the
 * hardware may do, not against its typical error. |tanh| stays at most 1; NaN stays NaN, and tanh(+-0) = +-0. */
float af_tanh_approx(float x)
{
    const double worst = exp2(-10.987) * 0.999, t = tanh((double)x);
    const int up = (int)((float_bits(x) * 0x9e3779b1u) >> 31);
    const double y = t * (up ? 1.0 + worst : 1.0 - worst);
    return (float)(y > 1.0 ? 1.0 : y < -1.0 ? -1.0 : y);
}

uint16_t af_float_to_f16(float x)
{
    uint32_t u = float_bits(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN: stays a (quiet) NaN */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* >= 65520 (and inf): rounds to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* below 2^-14: a subnormal f16 (in units of 2^-24) or zero */
        int e = (int)(a >> 23);
        int shift = 126 - e;
        if (e == 0 || shift > 24)
            return sign;
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u)))
            q++;
        return (uint16_t)(sign | q);
    }
    uint32_t h = (a >> 13) - (112u << 10), rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
        h++;
    return (uint16_t)(sign | h);
}

float af_f16_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        float f = (float)m * 0x1p-24f;
        return sign ? -f : f;
    }
    if (e == 31)
        return bits_float(sign | 0x7f800000u | (m << 13));
    return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

uint16_t af_float_to_bf16(float x)
{
    uint32_t u = float_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float af_bf16_to_float(uint16_t h) { return bits_float((uint32_t)h << 16); }

uint32_t af_pack_f16x2(float lo, float hi)
{
    return (uint32_t)af_float_to_f16(lo) | ((uint32_t)af_float_to_f16(hi) << 16);
}

uint32_t af_pack_bf16x2(float lo, float hi)
{
    return (uint32_t)af_float_to_bf16(lo) | ((uint32_t)af_float_to_bf16(hi) << 16);
}
