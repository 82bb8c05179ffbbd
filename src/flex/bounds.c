/* Interval analysis of mask_mod programs (bounds.h). Integers are carried exactly in doubles (int32 values, and
 * products of two of them to within rounding, which only matters past int32, where the result becomes unknown:
 * the program's integer operations wrap). Float32 results are widened by a few ulps for the rounding the evaluator
 * does, and carry a NaN flag. */
#include "flex/bounds.h"

#include <math.h>

#include "core/alloc.h"


#define I32_MIN (-2147483648.0)
#define I32_MAX 2147483647.0
#define LOAD_SCAN_MAX 65536   /* elements of a captured tensor scanned for one LOAD's range at most */

static af_bound point(double v) { return (af_bound){v, v, false}; }
static af_bound span(double lo, double hi) { return (af_bound){lo, hi, false}; }
static af_bound any_int(void) { return span(I32_MIN, I32_MAX); }
static af_bound any_float(void) { return (af_bound){-INFINITY, INFINITY, true}; }
static af_bound boolean(void) { return span(0.0, 1.0); }

/* An integer result: itself while it stays within int32, else anything (the evaluator wraps). */
static af_bound int_result(double lo, double hi) {
    return lo >= I32_MIN && hi <= I32_MAX ? span(lo, hi) : any_int();
}

/* A float32 result worked out in double: widened by the float rounding (below 2^-23 relative, and the smallest
 * normal), NaN when an operand may be or a bound is not finite (inf - inf, 0 · inf). */
static af_bound float_result(double lo, double hi, bool nan) {
    if (!(lo == lo) || !(hi == hi) || isinf(lo) || isinf(hi)) return any_float();
    const double slack_lo = fabs(lo) * 0x1p-22 + 0x1p-126, slack_hi = fabs(hi) * 0x1p-22 + 0x1p-126;
    return (af_bound){lo - slack_lo, hi + slack_hi, nan};
}

static double min4(double a, double b, double c, double d) { return fmin(fmin(a, b), fmin(c, d)); }
static double max4(double a, double b, double c, double d) { return fmax(fmax(a, b), fmax(c, d)); }

static double floordiv(double x, double y) { return floor(x / y); }

/* Python's x % c for an int32 constant c != 0. */
static double mod_c(double x, double c) { return x - floor(x / c) * c; }

/* The range of aux tensor `aux` over the box of its indices' ranges, or anything when the box is too large to scan
 * or reaches outside the tensor (the block is then evaluated, and a LOAD outside its tensor fails the call). */
static af_bound load_bound(const af_mod_checked *m, const af_mod_instr *in, const af_bound *r, bool is_int) {
    const af_mod_tensor *t = &m->aux[in->aux];
    int64_t lo[4], hi[4], count = 1;
    for (int k = 0; k < t->ndim; k++) {
        const af_bound ix = r[in->in[k]];
        if (ix.lo < 0.0 || ix.hi > (double)(t->shape[k] - 1)) return is_int ? any_int() : any_float();
        lo[k] = (int64_t)ix.lo;
        hi[k] = (int64_t)ix.hi;
        count *= hi[k] - lo[k] + 1;
        if (count > LOAD_SCAN_MAX) return is_int ? any_int() : any_float();
    }
    double vmin = INFINITY, vmax = -INFINITY;
    bool nan = false;
    int32_t idx[4] = {(int32_t)lo[0], (int32_t)lo[1], (int32_t)lo[2], (int32_t)lo[3]};
    for (;;) {
        float f = 0.0f;
        int32_t i = 0;
        af_mod_tensor_load(t, idx, &f, &i);   /* inside: the box lies within the tensor */
        const double v = is_int ? (double)i : (double)f;
        if (v != v) nan = true;
        else {
            vmin = fmin(vmin, v);
            vmax = fmax(vmax, v);
        }
        int k = t->ndim - 1;   /* the next index of the box, last dim fastest */
        while (k >= 0 && idx[k] == hi[k]) idx[k] = lo[k], k--;
        if (k < 0) break;
        idx[k]++;
    }
    if (vmin > vmax) return (af_bound){0.0, 0.0, true};   /* only NaN */
    return (af_bound){vmin, vmax, nan};
}

/* The bound of comparison `op` of a against b: decided (a point) when their ranges settle it. */
static af_bound compare(int op, af_bound a, af_bound b) {
    if (a.nan || b.nan) return boolean();
    bool always = false, never = false;
    switch (op) {
    case AF_MOD_LT: always = a.hi < b.lo; never = a.lo >= b.hi; break;
    case AF_MOD_LE: always = a.hi <= b.lo; never = a.lo > b.hi; break;
    case AF_MOD_GT: always = a.lo > b.hi; never = a.hi <= b.lo; break;
    case AF_MOD_GE: always = a.lo >= b.hi; never = a.hi < b.lo; break;
    case AF_MOD_EQ: always = a.lo == a.hi && b.lo == b.hi && a.lo == b.lo; never = a.hi < b.lo || b.hi < a.lo; break;
    case AF_MOD_NE: never = a.lo == a.hi && b.lo == b.hi && a.lo == b.lo; always = a.hi < b.lo || b.hi < a.lo; break;
    default: break;
    }
    return always ? point(1.0) : never ? point(0.0) : boolean();
}

static bool is_boolean(af_bound a) { return a.lo >= 0.0 && a.hi <= 1.0; }

/* Instruction `in`'s bound from its operands' (r), its result float32 or int32 (`is_int`). */
static af_bound bound_of(const af_mod_checked *m, const af_mod_instr *in, const af_bound *r, bool is_int) {
    const int n_in = af_mod_operand_count(m, in);   /* in->in past it are not registers */
    const af_bound a = n_in > 0 ? r[in->in[0]] : any_float(), b = n_in > 1 ? r[in->in[1]] : any_float();
    const bool ints = n_in > 0 && m->is_int[in->in[0]];
    switch (in->op) {
    case AF_MOD_CONST_F32: return point((float)in->imm);
    case AF_MOD_CONST_I32: return point(in->imm);
    case AF_MOD_ADD:
        return ints ? int_result(a.lo + b.lo, a.hi + b.hi) : float_result(a.lo + b.lo, a.hi + b.hi, a.nan || b.nan);
    case AF_MOD_SUB:
        return ints ? int_result(a.lo - b.hi, a.hi - b.lo) : float_result(a.lo - b.hi, a.hi - b.lo, a.nan || b.nan);
    case AF_MOD_MUL: {
        const double p1 = a.lo * b.lo, p2 = a.lo * b.hi, p3 = a.hi * b.lo, p4 = a.hi * b.hi;
        return ints ? int_result(min4(p1, p2, p3, p4), max4(p1, p2, p3, p4))
                    : float_result(min4(p1, p2, p3, p4), max4(p1, p2, p3, p4), a.nan || b.nan);
    }
    case AF_MOD_DIV: {
        if (b.lo <= 0.0 && b.hi >= 0.0) return any_float();
        const double p1 = a.lo / b.lo, p2 = a.lo / b.hi, p3 = a.hi / b.lo, p4 = a.hi / b.hi;
        return float_result(min4(p1, p2, p3, p4), max4(p1, p2, p3, p4), a.nan || b.nan);
    }
    case AF_MOD_FLOORDIV: {
        if (!ints || (b.lo <= 0.0 && b.hi >= 0.0)) return ints ? any_int() : any_float();
        /* x / y is monotone in each operand away from y = 0, and floor keeps that: the corners bound it */
        const double p1 = floordiv(a.lo, b.lo), p2 = floordiv(a.lo, b.hi), p3 = floordiv(a.hi, b.lo),
                     p4 = floordiv(a.hi, b.hi);
        return int_result(min4(p1, p2, p3, p4), max4(p1, p2, p3, p4));
    }
    case AF_MOD_MOD: {
        if (!ints || b.lo != b.hi || b.lo == 0.0) return ints ? any_int() : any_float();
        const double c = b.lo;
        if (floor(a.lo / c) == floor(a.hi / c)) {   /* within one period: monotone */
            const double x = mod_c(a.lo, c), y = mod_c(a.hi, c);
            return span(fmin(x, y), fmax(x, y));
        }
        return c > 0.0 ? span(0.0, c - 1.0) : span(c + 1.0, 0.0);
    }
    case AF_MOD_MIN: return (af_bound){fmin(a.lo, b.lo), fmin(a.hi, b.hi), a.nan || b.nan};
    case AF_MOD_MAX: return (af_bound){fmax(a.lo, b.lo), fmax(a.hi, b.hi), a.nan || b.nan};
    case AF_MOD_NEG: return ints ? int_result(-a.hi, -a.lo) : (af_bound){-a.hi, -a.lo, a.nan};
    case AF_MOD_ABS: {
        const double lo = a.lo >= 0.0 ? a.lo : a.hi <= 0.0 ? -a.hi : 0.0, hi = fmax(fabs(a.lo), fabs(a.hi));
        return ints ? int_result(lo, hi) : (af_bound){lo, hi, a.nan};
    }
    case AF_MOD_SIGN: {
        const double lo = a.lo > 0.0 ? 1.0 : a.lo < 0.0 ? -1.0 : 0.0, hi = a.hi > 0.0 ? 1.0 : a.hi < 0.0 ? -1.0 : 0.0;
        return (af_bound){lo, hi, a.nan};
    }
    case AF_MOD_FLOOR: return (af_bound){floor(a.lo), floor(a.hi), a.nan};
    case AF_MOD_CEIL: return (af_bound){ceil(a.lo), ceil(a.hi), a.nan};
    case AF_MOD_ROUND: return (af_bound){nearbyint(a.lo), nearbyint(a.hi), a.nan};
    case AF_MOD_EXP: return float_result(exp(a.lo), exp(a.hi), a.nan);
    case AF_MOD_TANH: return float_result(tanh(a.lo), tanh(a.hi), a.nan);
    case AF_MOD_SIGMOID: return float_result(1.0 / (1.0 + exp(-a.lo)), 1.0 / (1.0 + exp(-a.hi)), a.nan);
    case AF_MOD_ERF: return float_result(erf(a.lo), erf(a.hi), a.nan);
    case AF_MOD_SIN: case AF_MOD_COS: return (af_bound){-1.0, 1.0, a.nan || isinf(a.lo) || isinf(a.hi)};
    case AF_MOD_LT: case AF_MOD_LE: case AF_MOD_GT: case AF_MOD_GE: case AF_MOD_EQ: case AF_MOD_NE:
        return compare(in->op, a, b);
    case AF_MOD_AND:
        if (is_boolean(a) && is_boolean(b)) return span(fmin(a.lo, b.lo), fmin(a.hi, b.hi));
        return a.lo >= 0.0 && b.lo >= 0.0 ? span(0.0, fmin(a.hi, b.hi)) : any_int();
    case AF_MOD_OR:
        if (is_boolean(a) && is_boolean(b)) return span(fmax(a.lo, b.lo), fmax(a.hi, b.hi));
        return any_int();
    case AF_MOD_XOR:
        if (a.lo == a.hi && b.lo == b.hi) return point((double)((int32_t)a.lo ^ (int32_t)b.lo));
        return is_boolean(a) && is_boolean(b) ? boolean() : any_int();
    case AF_MOD_NOT: return a.lo > 0.0 || a.hi < 0.0 ? point(0.0) : a.lo == 0.0 && a.hi == 0.0 ? point(1.0) : boolean();
    case AF_MOD_WHERE: {
        const af_bound c = r[in->in[2]];
        if (a.lo > 0.0 || a.hi < 0.0) return b;   /* the condition is never 0 */
        if (a.lo == 0.0 && a.hi == 0.0) return c;
        return (af_bound){fmin(b.lo, c.lo), fmax(b.hi, c.hi), b.nan || c.nan};
    }
    case AF_MOD_TO_F32: return fabs(a.lo) <= 0x1p24 && fabs(a.hi) <= 0x1p24 ? a : float_result(a.lo, a.hi, false);
    case AF_MOD_TO_I32:
        if (a.nan || !(a.lo >= I32_MIN) || !(a.hi < 2147483648.0)) return any_int();
        return span(trunc(a.lo), trunc(a.hi));
    case AF_MOD_LOAD: return load_bound(m, in, r, is_int);
    default: return is_int ? any_int() : any_float();   /* POW, LOG, SQRT, RSQRT, TAN: not worked out */
    }
}

int af_mod_block_bounds(const af_mod_checked *m, int64_t b, int64_t h, int64_t q0, int64_t q1, int64_t k0, int64_t k1,
                        af_bound *r) {
    r[0] = any_float();   /* a mask_mod has no score */
    r[1] = point((double)b);
    r[2] = point((double)h);
    r[3] = span((double)q0, (double)q1);
    r[4] = span((double)k0, (double)k1);
    for (int32_t i = 0; i < m->length; i++)
        r[AF_MOD_INPUTS + i] = bound_of(m, &m->code[i], r, m->is_int[AF_MOD_INPUTS + i]);
    const af_bound out = r[m->n_regs - 1];
    if (out.lo > 0.0 || out.hi < 0.0) return AF_BOUND_ALWAYS;
    return out.lo == 0.0 && out.hi == 0.0 ? AF_BOUND_NEVER : AF_BOUND_UNKNOWN;
}

/* One program's LOADs over the inputs' ranges. */
static bool program_loads_inside(const af_mod_checked *m, const af_bound *inputs, af_bound *r) {
    for (int k = 0; k < AF_MOD_INPUTS; k++) r[k] = inputs[k];
    for (int32_t i = 0; i < m->length; i++) {
        const af_mod_instr *in = &m->code[i];
        if (in->op == AF_MOD_LOAD) {
            const af_mod_tensor *t = &m->aux[in->aux];
            for (int k = 0; k < t->ndim; k++) {
                const af_bound ix = r[in->in[k]];
                if (!(ix.lo >= 0.0) || !(ix.hi <= (double)(t->shape[k] - 1))) return false;
            }
        }
        r[AF_MOD_INPUTS + i] = bound_of(m, in, r, m->is_int[AF_MOD_INPUTS + i]);
    }
    return true;
}

bool af_mods_loads_inside(const af_mods *mods, int64_t B, int64_t H, int64_t L, int64_t S) {
    const bool has[2] = {mods->has_score, mods->has_mask};
    const af_mod_checked *ms[2] = {&mods->score, &mods->mask};
    const af_bound inputs[AF_MOD_INPUTS] = {any_float(), span(0.0, (double)(B > 0 ? B - 1 : 0)),
                                            span(0.0, (double)(H > 0 ? H - 1 : 0)),
                                            span(0.0, (double)(L > 0 ? L - 1 : 0)),
                                            span(0.0, (double)(S > 0 ? S - 1 : 0))};
    for (int p = 0; p < 2; p++) {
        if (!has[p] || ms[p]->n_aux == 0) continue;
        af_bound *r = af_alloc(sizeof(af_bound) * (size_t)ms[p]->n_regs);
        const bool inside = r && program_loads_inside(ms[p], inputs, r);
        af_free(r);
        if (!inside) return false;
    }
    return true;
}
