/* Checking and evaluating score_mod / mask_mod programs (program.h). Evaluation runs one instruction over all the
 * row's keys before the next, each a plain loop over a multiple of AF_MOD_LANES lanes: the compiler vectorises the
 * arithmetic ones (this file is built with -O3), libm's functions run per lane. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/dtype.h"
#include "core/status.h"
#include "flex/block_map.h"
#include "flex/program.h"

typedef enum { ARGS_NONE, ARGS_UNARY, ARGS_BINARY, ARGS_WHERE, ARGS_LOAD } arity;

/* Operand count of each operation. */
static arity arity_of(int op) {
    switch (op) {
    case AF_MOD_CONST_F32: case AF_MOD_CONST_I32: return ARGS_NONE;
    case AF_MOD_NEG: case AF_MOD_ABS: case AF_MOD_SIGN: case AF_MOD_FLOOR: case AF_MOD_CEIL: case AF_MOD_ROUND:
    case AF_MOD_EXP: case AF_MOD_LOG: case AF_MOD_SQRT: case AF_MOD_RSQRT: case AF_MOD_TANH: case AF_MOD_SIGMOID:
    case AF_MOD_ERF: case AF_MOD_SIN: case AF_MOD_COS: case AF_MOD_TAN: case AF_MOD_NOT: case AF_MOD_TO_F32:
    case AF_MOD_TO_I32: return ARGS_UNARY;
    case AF_MOD_WHERE: return ARGS_WHERE;
    case AF_MOD_LOAD: return ARGS_LOAD;
    default: return ARGS_BINARY;
    }
}

static const char *const op_names[AF_MOD_OP_COUNT] = {
    "CONST_F32", "CONST_I32", "ADD", "SUB", "MUL", "DIV", "FLOORDIV", "MOD", "MIN", "MAX", "POW", "NEG", "ABS",
    "SIGN", "FLOOR", "CEIL", "ROUND", "EXP", "LOG", "SQRT", "RSQRT", "TANH", "SIGMOID", "ERF", "SIN", "COS", "TAN",
    "LT", "LE", "GT", "GE", "EQ", "NE", "AND", "OR", "XOR", "NOT", "WHERE", "TO_F32", "TO_I32", "LOAD"};

/* Registers instruction `in` reads (a LOAD: one per dimension of its tensor, af_mod_check having checked `aux`). */
static int operand_count(const af_mod_checked *m, const af_mod_instr *in) {
    const arity ar = arity_of(in->op);
    return ar == ARGS_NONE ? 0 : ar == ARGS_UNARY ? 1 : ar == ARGS_BINARY ? 2 : ar == ARGS_WHERE ? 3
                                                                                   : m->aux[in->aux].ndim;
}

static bool float_only(int op) {
    return op == AF_MOD_DIV || op == AF_MOD_POW || (op >= AF_MOD_FLOOR && op <= AF_MOD_TAN);
}

static bool int_only(int op) { return op == AF_MOD_AND || op == AF_MOD_OR || op == AF_MOD_XOR || op == AF_MOD_NOT; }

static bool comparison(int op) { return op >= AF_MOD_LT && op <= AF_MOD_NE; }

static af_status check_aux(const af_mod_program *prog, const char *name, af_mod_checked *m) {
    if (prog->n_aux < 0 || (prog->n_aux > 0 && !prog->aux))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: n_aux is %d but aux is %s", name, (int)prog->n_aux,
                       prog->aux ? "given" : "NULL");
    m->n_aux = prog->n_aux;
    if (m->n_aux == 0) return AF_OK;
    if (!(m->aux = af_alloc(sizeof(af_mod_tensor) * (size_t)m->n_aux)))
        return af_fail(AF_ERR_NO_MEMORY, "out of memory: %s's %d aux tensors", name, (int)m->n_aux);
    for (int32_t t = 0; t < m->n_aux; t++) {
        const af_tensor *a = &prog->aux[t];
        af_mod_tensor *d = &m->aux[t];
        if (a->device.type != AF_DEVICE_CPU)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: aux tensor %d must be on the CPU", name, (int)t);
        if (a->ndim < 1 || a->ndim > 4)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: aux tensor %d has %d dimensions; 1 to 4 are taken", name,
                           (int)t, a->ndim);
        if (a->dtype != AF_F32 && a->dtype != AF_F16 && a->dtype != AF_BF16 && a->dtype != AF_I32 &&
            a->dtype != AF_BOOL)
            return af_fail(AF_ERR_UNSUPPORTED, "%s: aux tensor %d is %s; float32, float16, bfloat16, int32 or bool "
                           "are taken", name, (int)t, af_dtype_name(a->dtype));
        d->data = a->data;
        d->dtype = a->dtype;
        d->ndim = a->ndim;
        for (int k = 0; k < a->ndim; k++) {
            if (a->shape[k] < 0 || a->strides[k] < 0)
                return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: aux tensor %d: negative size or stride in dim %d", name,
                               (int)t, k);
            if (a->shape[k] > 0 && !a->data)
                return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: aux tensor %d has elements but no data", name, (int)t);
            d->shape[k] = a->shape[k];
            d->strides[k] = a->strides[k];
        }
    }
    return AF_OK;
}

/* The type instruction i gives, or an error naming it. */
static af_status check_instr(const af_mod_checked *m, const af_mod_instr *in, int32_t i, bool score, uint8_t *is_int) {
    const char *name = m->name;
    const int op = in->op;
    if (op < 0 || op >= AF_MOD_OP_COUNT)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: instruction %d: unknown operation %d", name, (int)i, op);
    const int reg = AF_MOD_INPUTS + i;
    const arity ar = arity_of(op);
    if (ar == ARGS_LOAD && (in->aux < 0 || in->aux >= m->n_aux))
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: instruction %d (LOAD): aux %d, but the program has %d aux "
                       "tensors", name, (int)i, (int)in->aux, (int)m->n_aux);
    const int n_in = operand_count(m, in);
    for (int k = 0; k < n_in; k++) {
        const int r = in->in[k];
        if (r < 0 || r >= reg)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: instruction %d (%s): operand %d is register %d; it must be "
                           "an earlier one (0 to %d)", name, (int)i, op_names[op], k, r, reg - 1);
        if (r == 0 && !score)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: instruction %d (%s) reads the score (register 0), which a "
                           "mask_mod does not have", name, (int)i, op_names[op]);
    }
    const uint8_t a = n_in > 0 ? is_int[in->in[0]] : 0, b = n_in > 1 ? is_int[in->in[1]] : 0;
    const char *want = NULL;
    uint8_t result = a;
    if (op == AF_MOD_CONST_F32) result = 0;
    else if (op == AF_MOD_CONST_I32) {
        if (!(in->imm >= -2147483648.0 && in->imm <= 2147483647.0) || in->imm != floor(in->imm))
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: instruction %d (CONST_I32): %g is not an int32", name,
                           (int)i, in->imm);
        result = 1;
    } else if (ar == ARGS_LOAD) {
        for (int k = 0; k < n_in; k++)
            if (!is_int[in->in[k]]) want = "int32 indices";
        const af_dtype dt = m->aux[in->aux].dtype;
        result = dt == AF_I32 || dt == AF_BOOL;
    } else if (op == AF_MOD_WHERE) {
        if (!a) want = "an int32 condition";
        else if (is_int[in->in[1]] != is_int[in->in[2]]) want = "two values of one type";
        result = is_int[in->in[1]];
    } else if (op == AF_MOD_TO_F32) {
        if (!a) want = "an int32 operand";
        result = 0;
    } else if (op == AF_MOD_TO_I32) {
        if (a) want = "a float32 operand";
        result = 1;
    } else {
        if (n_in == 2 && a != b) want = "two operands of one type";
        else if (float_only(op) && a) want = "float32 operands";
        else if (int_only(op) && !a) want = "int32 operands";
        if (comparison(op)) result = 1;
    }
    if (want)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: instruction %d (%s) takes %s", name, (int)i, op_names[op], want);
    is_int[reg] = result;
    return AF_OK;
}

af_status af_mod_check(const af_mod_program *prog, const char *name, bool score, af_mod_checked *m) {
    memset(m, 0, sizeof *m);
    m->name = name;
    if (!prog) return AF_OK;
    if (!prog->code || prog->length < 1 || prog->length > 65536)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: needs 1 to 65536 instructions (code %s, length %d)", name,
                       prog->code ? "given" : "NULL", (int)prog->length);
    m->code = prog->code;
    m->length = prog->length;
    m->n_regs = AF_MOD_INPUTS + prog->length;
    af_status st = check_aux(prog, name, m);
    if (st != AF_OK) return st;
    if (!(m->is_int = af_alloc((size_t)m->n_regs)) || !(m->uniform = af_alloc((size_t)m->n_regs)))
        return af_fail(AF_ERR_NO_MEMORY, "out of memory: %s's register types", name);
    m->uniform[0] = m->uniform[4] = 0;   /* the score and kv_idx vary along the row's keys; b, h, q_idx do not */
    m->uniform[1] = m->uniform[2] = m->uniform[3] = 1;
    m->is_int[0] = 0;   /* score */
    for (int r = 1; r < AF_MOD_INPUTS; r++) m->is_int[r] = 1;
    for (int32_t i = 0; i < prog->length; i++) {
        const af_mod_instr *in = &prog->code[i];
        if ((st = check_instr(m, in, i, score, m->is_int)) != AF_OK) return st;
        const int n_in = operand_count(m, in);
        uint8_t uniform = 1;
        for (int k = 0; k < n_in; k++) {
            uniform &= m->uniform[in->in[k]];
            if (in->in[k] < AF_MOD_INPUTS) m->reads_input[in->in[k]] = 1;
        }
        m->uniform[AF_MOD_INPUTS + i] = uniform;
        for (int k = 0; k < n_in && !uniform; k++)   /* a per-key instruction reads every lane of its inputs */
            if (in->in[k] < AF_MOD_INPUTS) m->vector_input[in->in[k]] = 1;
    }
    const uint8_t result = m->is_int[m->n_regs - 1];
    if (score && result)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: its result (the last instruction's) is int32; a score_mod "
                       "gives float32", name);
    if (!score && !result)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: its result (the last instruction's) is float32; a mask_mod "
                       "gives int32 (or bool)", name);
    return AF_OK;
}

void af_mod_release(af_mod_checked *m) {
    af_free(m->is_int);
    af_free(m->uniform);
    af_free(m->aux);
    m->is_int = m->uniform = NULL;
    m->aux = NULL;
}

af_status af_mods_check(const af_mod_program *score_mod, const af_mod_program *mask_mod, af_mods *mods) {
    memset(mods, 0, sizeof *mods);
    af_status st = af_mod_check(score_mod, "score_mod", true, &mods->score);
    if (st == AF_OK) st = af_mod_check(mask_mod, "mask_mod", false, &mods->mask);
    if (st != AF_OK) {
        af_mods_release(mods);
        return st;
    }
    mods->has_score = score_mod != NULL;
    mods->has_mask = mask_mod != NULL;
    mods->max_regs = mods->score.n_regs > mods->mask.n_regs ? mods->score.n_regs : mods->mask.n_regs;
    return AF_OK;
}

void af_mods_release(af_mods *mods) {
    af_mod_release(&mods->score);
    af_mod_release(&mods->mask);
}

af_status af_mods_status(af_mods *mods) {
    af_mod_checked *ms[2] = {&mods->score, &mods->mask};
    for (int k = 0; k < 2; k++) {
        const int t = atomic_load(&ms[k]->out_of_bounds);
        if (t > 0)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: a LOAD read aux tensor %d outside its shape", ms[k]->name,
                           t - 1);
    }
    return AF_OK;
}

size_t af_mods_scratch_floats(const af_mods *mods, int lanes) { return (size_t)mods->max_regs * (size_t)lanes; }

/* ---------------------------------------------------------------- evaluation */

static float sign_f(float x) { return x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : x; }   /* NaN, ±0 stay */
static int32_t sign_i(int32_t x) { return (x > 0) - (x < 0); }

/* Python's floor division and remainder on int32; x // 0 = x % 0 = 0 (torch raises; a mask must not trap). */
static int32_t floordiv_i(int32_t a, int32_t b) {
    if (b == 0) return 0;
    if (b == -1) return (int32_t)(0u - (uint32_t)a);   /* INT32_MIN // -1 wraps, as torch's int32 */
    const int32_t q = a / b;
    return q - ((a % b != 0) & ((a < 0) != (b < 0)));
}

static int32_t mod_i(int32_t a, int32_t b) {
    if (b == 0 || b == -1) return 0;
    const int32_t r = a % b;
    return r != 0 && ((r < 0) != (b < 0)) ? r + b : r;
}

static float floordiv_f(float a, float b) { return floorf(a / b); }

static float mod_f(float a, float b) {   /* torch.remainder: a - floor(a / b)·b, the divisor's sign */
    const float r = fmodf(a, b);
    return r != 0.0f && ((r < 0.0f) != (b < 0.0f)) ? r + b : r;
}

static float min_f(float a, float b) { return a != a || b != b ? NAN : a < b ? a : b; }
static float max_f(float a, float b) { return a != a || b != b ? NAN : a > b ? a : b; }

static float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

/* Element (idx) of aux tensor t as float32 or int32 bits, or out of bounds (false). */
static bool load_one(const af_mod_tensor *t, const int32_t *idx, float *f, int32_t *i) {
    int64_t off = 0;
    for (int k = 0; k < t->ndim; k++) {
        if (idx[k] < 0 || idx[k] >= t->shape[k]) return false;
        off += (int64_t)idx[k] * t->strides[k];
    }
    const char *p = t->data + off * (int64_t)af_dtype_size(t->dtype);
    switch (t->dtype) {
    case AF_I32: memcpy(i, p, 4); break;
    case AF_BOOL: *i = *(const uint8_t *)p != 0; break;
    default: *f = af_load_as_f32(p, t->dtype); break;
    }
    return true;
}

static void eval_load(af_mod_checked *m, const af_mod_instr *in, float *regs, int n, int lanes, int stride,
                      float *dst) {
    const af_mod_tensor *t = &m->aux[in->aux];
    const bool is_int = t->dtype == AF_I32 || t->dtype == AF_BOOL;
    int32_t *di = (int32_t *)dst;
    const int32_t *index[4];
    for (int k = 0; k < t->ndim; k++) index[k] = (const int32_t *)(regs + (size_t)in->in[k] * (size_t)stride);
    int32_t last[4] = {0, 0, 0, 0};
    float f = 0.0f;
    int32_t v = 0;
    for (int j = 0; j < n; j++) {
        bool same = j > 0;   /* the previous key's indices again (a per-head table, a run of document ids) */
        for (int k = 0; k < t->ndim; k++) same = same && index[k][j] == last[k];
        if (!same) {
            for (int k = 0; k < t->ndim; k++) last[k] = index[k][j];
            f = 0.0f;
            v = 0;
            if (!load_one(t, last, &f, &v)) {
                int expected = 0;
                atomic_compare_exchange_strong(&m->out_of_bounds, &expected, in->aux + 1);
            }
        }
        if (is_int) di[j] = v;
        else dst[j] = f;
    }
    for (int j = n; j < lanes; j++) di[j] = 0;   /* lanes past the keys: defined values, no load */
}

/* The loops below run over `lanes` (a multiple of AF_MOD_LANES) so that the compiler needs no remainder. */
#define FLOAT_UNARY(expr)                                   \
    for (int j = 0; j < lanes; j++) {                       \
        const float x = fa[j];                              \
        fd[j] = (expr);                                     \
    }
#define FLOAT_BINARY(expr)                                  \
    for (int j = 0; j < lanes; j++) {                       \
        const float x = fa[j], y = fb[j];                   \
        fd[j] = (expr);                                     \
    }
#define INT_BINARY(expr)                                    \
    for (int j = 0; j < lanes; j++) {                       \
        const int32_t x = ia[j], y = ib[j];                 \
        id[j] = (expr);                                     \
    }
#define COMPARE(opr)                                                                 \
    if (m->is_int[in->in[0]]) for (int j = 0; j < lanes; j++) id[j] = ia[j] opr ib[j]; \
    else for (int j = 0; j < lanes; j++) id[j] = fa[j] opr fb[j];

/* Register k of the scratch: `lanes` floats (or int32s). */
static float *reg(float *regs, int k, int lanes) { return regs + (size_t)k * (size_t)lanes; }

/* A program's loops in AVX-512, AVX2 or baseline code (run() is cloned, eval_instr inlined into each clone), picked
 * once by the loader for this CPU (the library is built for baseline x86-64): 4 to 16 keys an operation. The
 * operations are single IEEE operations or libm calls, the same in every clone. */
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define AF_MOD_NO_IFUNC 1   /* ThreadSanitizer: an ifunc resolver runs before its runtime is up and crashes */
#endif
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_THREAD__) && !defined(AF_MOD_NO_IFUNC)
#define AF_MOD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define AF_MOD_CLONES
#endif

/* Instruction `in` over `lanes` lanes (the first n of them keys; registers `stride` lanes apart), writing fd. */
static inline __attribute__((always_inline)) void eval_instr(af_mod_checked *m, const af_mod_instr *in,
                                                              float *regs, int n, int lanes, int stride, float *fd) {
    const arity ar = arity_of(in->op);
    const float *fa = ar != ARGS_NONE && ar != ARGS_LOAD ? reg(regs, in->in[0], stride) : NULL;
    const float *fb = ar == ARGS_BINARY || ar == ARGS_WHERE ? reg(regs, in->in[1], stride) : NULL;
    const int32_t *ia = (const int32_t *)fa, *ib = (const int32_t *)fb;
    int32_t *id = (int32_t *)fd;
    const bool ints = fa && m->is_int[in->in[0]];
    switch (in->op) {
    case AF_MOD_CONST_F32: for (int j = 0; j < lanes; j++) fd[j] = (float)in->imm; break;
    case AF_MOD_CONST_I32: for (int j = 0; j < lanes; j++) id[j] = (int32_t)in->imm; break;
    case AF_MOD_ADD: if (ints) { INT_BINARY((int32_t)((uint32_t)x + (uint32_t)y)) } else { FLOAT_BINARY(x + y) } break;
    case AF_MOD_SUB: if (ints) { INT_BINARY((int32_t)((uint32_t)x - (uint32_t)y)) } else { FLOAT_BINARY(x - y) } break;
    case AF_MOD_MUL: if (ints) { INT_BINARY((int32_t)((uint32_t)x * (uint32_t)y)) } else { FLOAT_BINARY(x * y) } break;
    case AF_MOD_DIV: FLOAT_BINARY(x / y) break;
    case AF_MOD_FLOORDIV: if (ints) { INT_BINARY(floordiv_i(x, y)) } else { FLOAT_BINARY(floordiv_f(x, y)) } break;
    case AF_MOD_MOD: if (ints) { INT_BINARY(mod_i(x, y)) } else { FLOAT_BINARY(mod_f(x, y)) } break;
    case AF_MOD_MIN: if (ints) { INT_BINARY(x < y ? x : y) } else { FLOAT_BINARY(min_f(x, y)) } break;
    case AF_MOD_MAX: if (ints) { INT_BINARY(x > y ? x : y) } else { FLOAT_BINARY(max_f(x, y)) } break;
    case AF_MOD_POW: FLOAT_BINARY(powf(x, y)) break;
    case AF_MOD_NEG:
        if (ints) for (int j = 0; j < lanes; j++) id[j] = (int32_t)(0u - (uint32_t)ia[j]);
        else { FLOAT_UNARY(-x) }
        break;
    case AF_MOD_ABS:
        if (ints) for (int j = 0; j < lanes; j++) id[j] = ia[j] < 0 ? (int32_t)(0u - (uint32_t)ia[j]) : ia[j];
        else { FLOAT_UNARY(fabsf(x)) }
        break;
    case AF_MOD_SIGN:
        if (ints) for (int j = 0; j < lanes; j++) id[j] = sign_i(ia[j]);
        else { FLOAT_UNARY(sign_f(x)) }
        break;
    case AF_MOD_FLOOR: FLOAT_UNARY(floorf(x)) break;
    case AF_MOD_CEIL: FLOAT_UNARY(ceilf(x)) break;
    case AF_MOD_ROUND: FLOAT_UNARY(nearbyintf(x)) break;   /* the default rounding mode: half to even */
    case AF_MOD_EXP: FLOAT_UNARY(expf(x)) break;
    case AF_MOD_LOG: FLOAT_UNARY(logf(x)) break;
    case AF_MOD_SQRT: FLOAT_UNARY(sqrtf(x)) break;
    case AF_MOD_RSQRT: FLOAT_UNARY(1.0f / sqrtf(x)) break;
    case AF_MOD_TANH: FLOAT_UNARY(tanhf(x)) break;
    case AF_MOD_SIGMOID: FLOAT_UNARY(sigmoid_f(x)) break;
    case AF_MOD_ERF: FLOAT_UNARY(erff(x)) break;
    case AF_MOD_SIN: FLOAT_UNARY(sinf(x)) break;
    case AF_MOD_COS: FLOAT_UNARY(cosf(x)) break;
    case AF_MOD_TAN: FLOAT_UNARY(tanf(x)) break;
    case AF_MOD_LT: COMPARE(<) break;
    case AF_MOD_LE: COMPARE(<=) break;
    case AF_MOD_GT: COMPARE(>) break;
    case AF_MOD_GE: COMPARE(>=) break;
    case AF_MOD_EQ: COMPARE(==) break;
    case AF_MOD_NE: COMPARE(!=) break;
    case AF_MOD_AND: INT_BINARY(x & y) break;
    case AF_MOD_OR: INT_BINARY(x | y) break;
    case AF_MOD_XOR: INT_BINARY(x ^ y) break;
    case AF_MOD_NOT: for (int j = 0; j < lanes; j++) id[j] = ia[j] == 0; break;
    case AF_MOD_WHERE: {
        const float *fc = reg(regs, in->in[2], stride);
        const int32_t *ic = (const int32_t *)fc, *ib2 = (const int32_t *)fb;
        for (int j = 0; j < lanes; j++) id[j] = ia[j] ? ib2[j] : ic[j];   /* bits: either type */
        break;
    }
    case AF_MOD_TO_F32: for (int j = 0; j < lanes; j++) fd[j] = (float)ia[j]; break;
    case AF_MOD_TO_I32:
        /* toward zero; NaN and values past int32 give INT32_MIN, as x86's conversion (torch's CPU .to) */
        for (int j = 0; j < lanes; j++)
            id[j] = fa[j] >= -2147483648.0f && fa[j] < 2147483648.0f ? (int32_t)fa[j] : INT32_MIN;
        break;
    case AF_MOD_LOAD: eval_load(m, in, regs, n, lanes, stride, fd); break;
    default: break;   /* af_mod_check refused it */
    }
}

/* Run program m over the lanes: inputs in registers 0-4 of `regs` (vectors of `lanes`), the result's register. An
 * instruction whose operands are the same for every key of the row (constants, b, h, q_idx and what follows from
 * them only: an ALiBi slope, a per-head table's entry) runs once, on lane 0, and is copied to the other lanes. */
AF_MOD_CLONES static const float *run(af_mod_checked *m, float *regs, int n, int lanes) {
    for (int32_t i = 0; i < m->length; i++) {
        float *dst = reg(regs, AF_MOD_INPUTS + i, lanes);
        if (!m->uniform[AF_MOD_INPUTS + i]) {
            eval_instr(m, &m->code[i], regs, n, lanes, lanes, dst);
            continue;
        }
        eval_instr(m, &m->code[i], regs, 1, 1, lanes, dst);
        int32_t *bits = (int32_t *)dst;
        for (int j = 1; j < lanes; j++) bits[j] = bits[0];
    }
    return reg(regs, m->n_regs - 1, lanes);
}

/* Input register k (1-4) with `value` + j in lane j (step 1: kv_idx) or `value` everywhere: in every lane where a
 * per-key instruction reads it, else in lane 0 alone (the once-a-row instructions read nothing else). */
static void fill_input(const af_mods *mods, float *regs, int k, int64_t value, int step, int lanes) {
    int32_t *r = (int32_t *)reg(regs, k, lanes);
    const bool vector =
        (mods->has_score && mods->score.vector_input[k]) || (mods->has_mask && mods->mask.vector_input[k]);
    const int count = vector ? lanes : 1;
    for (int j = 0; j < count; j++) r[j] = (int32_t)(value + (int64_t)step * j);
}

/* The mods on keys kv0 .. kv0 + n, mask_mod only when `masked`. */
static void apply_run(af_mods *mods, int64_t b, int64_t h, int64_t q_idx, int64_t kv0, int n, float *s, float *regs,
                      int lanes, bool masked) {
    if (!mods->has_score && !masked) return;
    fill_input(mods, regs, 1, b, 0, lanes);
    fill_input(mods, regs, 2, h, 0, lanes);
    fill_input(mods, regs, 3, q_idx, 0, lanes);
    fill_input(mods, regs, 4, kv0, 1, lanes);
    if (mods->has_score) {
        float *score = reg(regs, 0, lanes);
        memcpy(score, s, sizeof(float) * (size_t)n);
        for (int j = n; j < lanes; j++) score[j] = 0.0f;   /* lanes past the keys: defined, whatever the tile held */
        const float *v = run(&mods->score, regs, n, lanes);
        memcpy(s, v, sizeof(float) * (size_t)n);
    }
    if (masked) {
        const int32_t *keep = (const int32_t *)run(&mods->mask, regs, n, lanes);
        for (int j = 0; j < n; j++) s[j] = keep[j] ? s[j] : -INFINITY;
    }
}

void af_mods_apply_row(af_mods *mods, int64_t b, int64_t h, int64_t q_idx, int64_t kv0, int n, float *s, float *regs,
                       int lanes) {
    const af_block_map *bm = mods->blocks;
    if (!bm) {
        apply_run(mods, b, h, q_idx, kv0, n, s, regs, lanes, mods->has_mask);
        return;
    }
    const uint8_t *cls = af_block_row(bm, b, h, q_idx);
    for (int j = 0; j < n;) {   /* runs of keys whose blocks have one class */
        const uint8_t c = cls[(kv0 + j) / bm->kv_block];
        int e = j;
        while (e < n && cls[(kv0 + e) / bm->kv_block] == c) {
            const int64_t block_end = ((kv0 + e) / bm->kv_block + 1) * bm->kv_block - kv0;
            e = block_end < n ? (int)block_end : n;
        }
        if (c == AF_BLOCK_EMPTY) {
            for (int k = j; k < e; k++) s[k] = -INFINITY;
        } else {
            apply_run(mods, b, h, q_idx, kv0 + j, e - j, s + j, regs, lanes,
                      c == AF_BLOCK_PARTIAL && mods->has_mask);
        }
        j = e;
    }
}
