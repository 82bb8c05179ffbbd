/* Softcap on a row of scores: s <- cap·tanh(s·k) (k = scale / cap: the score scaled, then divided by the cap), with
 * tanh(x) = 2 / (1 + 2^(-2x·log2 e)) - 1 and the degree-5 exp2 polynomial, branch-free so that it vectorises.
 * Absolute error of tanh: half the polynomial's relative error (7.5e-8) plus a few f32 roundings, < 3e-7 for every
 * x; so the capped logit moves by < 3e-7·cap, below the f32 score error af_error_bound allows for a logit of size
 * cap. Large |x| saturate to ±1 (2^t clamped to t in [-64, 64]); NaN stays NaN; ±inf give ±cap. */
#ifndef AF_KERNEL_SOFTCAP_H
#define AF_KERNEL_SOFTCAP_H
#include <stdint.h>
#include <string.h>

#include "kernel/exp2_poly.h"

static inline void af_softcap_row(float *s, int n, float k, float cap) {
    const float magic = 12582912.0f;   /* 1.5·2^23: t + magic rounds t to an integer in the low mantissa bits */
    uint32_t magic_bits;
    memcpy(&magic_bits, &magic, 4);
    for (int j = 0; j < n; j++) {
        const float x = s[j] * k;
        float t = x * -2.88539008177792681f;   /* -2x·log2(e) */
        t = t < -64.0f ? -64.0f : t;
        t = t > 64.0f ? 64.0f : t;
        const float shifted = t + magic;
        const float f = t - (shifted - magic);   /* in [-0.5, 0.5] */
        float e = AF_EXP2_D5_C0 + f * (AF_EXP2_D5_C1 + f * (AF_EXP2_D5_C2 + f * (AF_EXP2_D5_C3 +
                                       f * (AF_EXP2_D5_C4 + f * AF_EXP2_D5_C5))));
        uint32_t shifted_bits, e_bits;
        memcpy(&shifted_bits, &shifted, 4);
        memcpy(&e_bits, &e, 4);
        e_bits += (shifted_bits - magic_bits) << 23;   /* times 2^round(t), |round(t)| <= 64: stays normal */
        memcpy(&e, &e_bits, 4);
        const float th = 2.0f / (1.0f + e) - 1.0f;
        s[j] = x == x ? cap * th : x;
    }
}

#endif
