/* The vector template (ukernel_simd.inc) instantiated with the AVX-512 geometry — 16 lanes, 12 × 32 register tile,
 * 16-bit lane masks — on plain C vectors whose operations follow the x86 instructions' rules lane by lane
 * (vmaxps returns the second operand on NaN, vcvtps2dq gives INT32_MIN for NaN and out-of-range, blends by mask
 * bit). No AVX-512 hardware here: this runs the template's logic at that width so the row/column tails and mask
 * paths AVX-512 takes are tested; only the intrinsic names of ukernel_avx512.c remain unexecuted. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "core/dtype.h"
#include "ukernel_vec16_emulated.h"

/* Plain structs (not compiler vectors): passed by value without ABI questions; speed does not matter here. */
typedef struct { float l[16]; } vec16;
typedef struct { int32_t l[16]; } ivec16;
typedef uint16_t mask16;

#define LANEWISE(expr)                          \
    vec16 r;                                    \
    for (int i = 0; i < 16; i++) r.l[i] = expr; \
    return r

static inline vec16 e_load(const float *p) { vec16 v; memcpy(&v, p, sizeof v); return v; }
static inline void e_store(float *p, vec16 v) { memcpy(p, &v, sizeof v); }
static inline vec16 e_set1(float x) { LANEWISE(x); }
static inline vec16 e_fma(vec16 a, vec16 b, vec16 c) { LANEWISE(fmaf(a.l[i], b.l[i], c.l[i])); }
static inline vec16 e_mul(vec16 a, vec16 b) { LANEWISE(a.l[i] * b.l[i]); }
static inline vec16 e_add(vec16 a, vec16 b) { LANEWISE(a.l[i] + b.l[i]); }
static inline vec16 e_sub(vec16 a, vec16 b) { LANEWISE(a.l[i] - b.l[i]); }
static inline vec16 e_max(vec16 a, vec16 b) { LANEWISE(a.l[i] > b.l[i] ? a.l[i] : b.l[i]); }   /* maxps: b on NaN */
static inline float e_hmax(vec16 v) {
    float m = v.l[0];
    for (int i = 1; i < 16; i++) m = v.l[i] > m ? v.l[i] : m;
    return m;
}
static inline float e_hsum(vec16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v.l[i];
    return s;
}
static inline ivec16 e_cvt_nearest(vec16 v) {   /* cvtps2dq: round to nearest even; NaN, out of range -> INT32_MIN */
    ivec16 r;
    for (int i = 0; i < 16; i++)
        r.l[i] = v.l[i] >= -2147483648.0f && v.l[i] < 2147483648.0f ? (int32_t)nearbyintf(v.l[i]) : INT32_MIN;
    return r;
}
static inline vec16 e_cvt_float(ivec16 n) { LANEWISE((float)n.l[i]); }
static inline vec16 e_mul_pow2(vec16 p, ivec16 n) {   /* integer add of n << 23 to the bits, wrapping */
    vec16 r;
    for (int i = 0; i < 16; i++) {
        uint32_t bits;
        memcpy(&bits, &p.l[i], 4);
        bits += (uint32_t)n.l[i] << 23;
        memcpy(&r.l[i], &bits, 4);
    }
    return r;
}
static inline mask16 e_less(vec16 a, vec16 b) {   /* _CMP_LT_OQ: false on NaN */
    mask16 m = 0;
    for (int i = 0; i < 16; i++) m |= (mask16)((a.l[i] < b.l[i]) << i);
    return m;
}
static inline mask16 e_lanes_below(int n) { return (mask16)(n >= 16 ? 0xffffu : (1u << n) - 1u); }
static inline vec16 e_select(mask16 m, vec16 a, vec16 b) { LANEWISE((m >> i) & 1 ? b.l[i] : a.l[i]); }   /* mask_blend */
static inline float e_load1(const char *p, af_dtype dt) { return af_load_as_f32(p, dt); }
/* float8: the bit steps of ukernel_pack_x86.h / avx512_load16_f32, lane by lane (byte << 8 in a 16-bit lane; e5m2 is
 * then an f16; e4m3fn: arithmetic shift by one, bit 14 cleared, NaN pattern made all-ones, times 2^8 after vcvtph2ps;
 * AF_F8E4M3_SCALED: the byte sign-extended, shifted left by 7, bit 14 cleared). */
static inline float e_f8_lane(uint8_t byte, af_dtype dt) {
    const uint16_t hi = (uint16_t)(byte << 8);
    if (dt == AF_F8E5M2) return af_f16_to_f32(hi);
    if (dt == AF_F8E4M3_SCALED)   /* sign-extended, << 7, bit 14 cleared; no NaN fix, no rescale */
        return af_f16_to_f32((uint16_t)((uint16_t)((uint16_t)(int16_t)(int8_t)byte << 7) & 0xbfffu));
    uint16_t h = (uint16_t)((uint16_t)((int16_t)hi >> 1) & 0xbfffu);
    if ((h & 0x7fffu) == 0x3f80u) h = 0xffffu;
    return af_f16_to_f32(h) * 256.0f;
}
static inline vec16 e_load_cvt(const char *p, af_dtype dt) {
    if (dt == AF_F8E4M3 || dt == AF_F8E5M2 || dt == AF_F8E4M3_SCALED) { LANEWISE(e_f8_lane((uint8_t)p[i], dt)); }
    LANEWISE(e_load1(p + (size_t)i * af_elem_bytes(dt), dt));
}

/* The bf16 pair hooks, as avx512_load_bf16_pairs / _split_pairs / _join_pairs do them: lane i of *ev is element 2i,
 * of *od element 2i + 1 (the load: the low 16 bits of 32-bit lane i shifted up, the high 16 bits masked). */
static inline void e_load_bf16_pairs(const void *p, vec16 *ev, vec16 *od) {
    uint32_t w[16];
    memcpy(w, p, sizeof w);
    for (int i = 0; i < 16; i++) {
        const uint32_t lo = w[i] << 16, hi = w[i] & 0xffff0000u;
        memcpy(&ev->l[i], &lo, 4), memcpy(&od->l[i], &hi, 4);
    }
}
static inline void e_split_pairs(vec16 a, vec16 b, vec16 *ev, vec16 *od) {
    for (int i = 0; i < 16; i++) {
        const vec16 *src = i < 8 ? &a : &b;
        ev->l[i] = src->l[2 * (i % 8)], od->l[i] = src->l[2 * (i % 8) + 1];
    }
}
static inline void e_join_pairs(vec16 ev, vec16 od, vec16 *a, vec16 *b) {
    for (int i = 0; i < 16; i++) {
        vec16 *dst = i < 8 ? a : b;
        dst->l[2 * (i % 8)] = ev.l[i], dst->l[2 * (i % 8) + 1] = od.l[i];
    }
}

#define UK_ISA "vec16-emulated"
#define UK_TABLE af_ukernel_vec16_emulated
#define UK_SUFFIX vec16
#define VEC vec16
#define VI ivec16
#define MASK mask16
#define VW 16
#define UK_MR 12
#define UK_NV 2
#define UK_KEYS 64
#define UK_MAX_ROWS 240
#define UK_L2_FLOATS (512L * 1024 / 4)
#define UK_PACK_KT NULL
/* Not forced inline nor unrolled: the template's logic is the same, and the emulated tiles compiled in 25× less time
 * (fully inlined, every (rows, vectors, element type) tile of 16 scalar lanes took 4.5 minutes under ASan). */
#define UK_INLINE static inline
#define UK_UNROLL
#define UK_CONVERT NULL

#define V_LOAD(p) e_load(p)
#define V_LOAD_CVT(p, dt) e_load_cvt((p), (dt))
#define V_LOAD1_CVT(p, dt) e_load1((p), (dt))
#define V_STORE(p, v) e_store((p), (v))
#define V_SET1(x) e_set1(x)
#define V_ZERO() e_set1(0.0f)
#define V_BCAST(p) e_set1(*(p))
#define V_FMA(a, b, c) e_fma((a), (b), (c))
#define V_MUL(a, b) e_mul((a), (b))
#define V_ADD(a, b) e_add((a), (b))
#define V_SUB(a, b) e_sub((a), (b))
#define V_MAX(a, b) e_max((a), (b))
#define V_HMAX(v) e_hmax(v)
#define V_HSUM(v) e_hsum(v)
#define V_FIRST(v) ((v).l[0])
#define V_CVT_NEAREST(v) e_cvt_nearest(v)
#define V_CVT_FLOAT(i) e_cvt_float(i)
#define V_MUL_POW2(p, n) e_mul_pow2((p), (n))
#define V_LESS(a, b) e_less((a), (b))
#define V_LANES_BELOW(n) e_lanes_below(n)
#define V_SELECT(m, a, b) e_select((m), (a), (b))
#define V_ZERO_WHERE(m, v) e_select((m), (v), e_set1(0.0f))
#define V_LOAD_BF16_PAIRS(p, ev, od) e_load_bf16_pairs((p), (ev), (od))
#define V_SPLIT_PAIRS(a, b, ev, od) e_split_pairs((a), (b), (ev), (od))
#define V_JOIN_PAIRS(ev, od, a, b) e_join_pairs((ev), (od), (a), (b))

#include "kernel/ukernel_simd.inc"
