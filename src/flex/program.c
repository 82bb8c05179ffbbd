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
#include "flex/vector.h"

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
int af_mod_operand_count(const af_mod_checked *m, const af_mod_instr *in) {
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
        int64_t last = 0, step;   /* the furthest element's offset: must be a number of bytes */
        bool empty = false;
        for (int k = 0; k < a->ndim; k++) empty = empty || a->shape[k] == 0;
        for (int k = 0; k < a->ndim && !empty; k++)
            if (__builtin_mul_overflow(a->shape[k] - 1, a->strides[k], &step) ||
                __builtin_add_overflow(last, step, &last) || last > INT64_MAX / 8)
                return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: aux tensor %d: its shape and strides reach past any "
                               "memory (an offset that overflows)", name, (int)t);
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
    const int n_in = af_mod_operand_count(m, in);
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

/* Whether instruction `in` (writing register reg) passes a derivative on from its float operands: float results of
 * float operations (floor, ceil, round, sign and floor division are piecewise constant; a LOAD's value does not
 * follow from its indices). */
static bool differentiable(const af_mod_checked *m, const af_mod_instr *in, int reg) {
    const int op = in->op;
    return !m->is_int[reg] && op != AF_MOD_FLOOR && op != AF_MOD_CEIL && op != AF_MOD_ROUND && op != AF_MOD_SIGN &&
           op != AF_MOD_FLOORDIV && op != AF_MOD_LOAD;
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
    const size_t n = (size_t)m->n_regs;
    if (!(m->is_int = af_alloc(n)) || !(m->varies = af_alloc(n)) || !(m->at_lanes = af_alloc(4 * n)) ||
        !(m->at = af_alloc(4 * n)) || !(m->on_score = af_alloc_zeroed(n)) || !(m->t_at_lanes = af_alloc(4 * n)) ||
        !(m->at_row = af_alloc(4 * n)))
        return af_fail(AF_ERR_NO_MEMORY, "out of memory: %s's register types", name);
    /* the score varies with the row and the key, b with neither, h and q_idx with the row, kv_idx with the key */
    const uint8_t input_varies[AF_MOD_INPUTS] = {AF_MOD_BY_ROW | AF_MOD_BY_KEY, 0, AF_MOD_BY_ROW, AF_MOD_BY_ROW,
                                                 AF_MOD_BY_KEY};
    m->is_int[0] = 0;   /* score */
    m->on_score[0] = score;
    for (int r = 1; r < AF_MOD_INPUTS; r++) m->is_int[r] = 1;
    for (int r = 0; r < AF_MOD_INPUTS; r++) m->varies[r] = input_varies[r];
    for (int32_t i = 0; i < prog->length; i++) {
        const af_mod_instr *in = &prog->code[i];
        if ((st = check_instr(m, in, i, score, m->is_int)) != AF_OK) return st;
        const int n_in = af_mod_operand_count(m, in);
        uint8_t varies = 0;
        for (int k = 0; k < n_in; k++) {
            varies |= m->varies[in->in[k]];
            if (in->in[k] < AF_MOD_INPUTS) m->reads_input[in->in[k]] = 1;
        }
        m->varies[AF_MOD_INPUTS + i] = varies;
        bool on = false;
        for (int k = 0; k < n_in; k++) on = on || m->on_score[in->in[k]];
        m->on_score[AF_MOD_INPUTS + i] = on && differentiable(m, in, AF_MOD_INPUTS + i);
    }
    /* the scratch: a register by row and key takes AF_MOD_ROWS · lanes floats, by key lanes, by row or neither 16;
     * the score (register 0) is the caller's tile itself */
    m->lane_units = m->fixed = m->row_units = 0;
    for (int32_t r = 0; r < m->n_regs; r++) {
        m->at_lanes[r] = m->lane_units;
        m->at[r] = m->fixed;
        m->at_row[r] = m->row_units;   /* ... and a register by row alone one per row of the call (group.row_regs) */
        if (r == 0) continue;
        if (m->varies[r] & AF_MOD_BY_KEY) m->lane_units += m->varies[r] & AF_MOD_BY_ROW ? AF_MOD_ROWS : 1;
        else m->fixed += 16;
        if (m->varies[r] == AF_MOD_BY_ROW) m->row_units++;
    }
    m->t_units = 0;   /* tangents after the values: a register on the score varies with row and key */
    for (int32_t r = 1; r < m->n_regs; r++) {
        m->t_at_lanes[r] = m->lane_units + m->t_units;
        if (m->on_score[r]) m->t_units += AF_MOD_ROWS;
    }
    const uint8_t result = m->is_int[m->n_regs - 1];
    if (score != (result != 0)) af_mod_fuse(m);   /* a result of the right type */
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
    af_free(m->varies);
    af_free(m->at_lanes);
    af_free(m->at);
    af_free(m->on_score);
    af_free(m->t_at_lanes);
    af_free(m->at_row);
    af_free(m->aux);
    m->is_int = m->varies = m->on_score = NULL;
    m->at_lanes = m->at = m->t_at_lanes = m->at_row = NULL;
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
    return AF_OK;
}

void af_mods_unfuse(af_mods *mods) { mods->score.fused.kind = mods->mask.fused.kind = AF_FUSED_NONE; }

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

static size_t program_floats(const af_mod_checked *m, int lanes) {
    return (size_t)(m->lane_units + m->t_units) * (size_t)lanes + (size_t)m->fixed;
}

/* Where the mask_mod's registers start: after the score_mod's, on a 64-byte boundary. */
static size_t mask_regs_at(const af_mods *mods, int lanes) {
    return mods->has_score ? (program_floats(&mods->score, lanes) + 15) / 16 * 16 : 0;
}

static size_t runs_floats(int lanes);

/* Where the block runs start, and after them the registers by row alone (the score_mod's, then the mask_mod's). */
static size_t runs_at(const af_mods *mods, int lanes) {
    const size_t b = mods->has_mask ? program_floats(&mods->mask, lanes) : 0;
    return (mask_regs_at(mods, lanes) + b + 15) / 16 * 16;
}

/* Where the registers by row alone start: after the runs and the passes they hold (ROWS_DONE_FLOATS). */
#define ROWS_DONE_FLOATS 16
static size_t rows_at(const af_mods *mods, int lanes) { return runs_at(mods, lanes) + runs_floats(lanes); }

size_t af_mods_scratch_floats(const af_mods *mods, int rows, int lanes) {
    const size_t row_units = (size_t)(mods->has_score ? mods->score.row_units : 0) +
                             (size_t)(mods->has_mask ? mods->mask.row_units : 0);
    /* apart: each program keeps its tile's key registers over the groups, its row registers over the calls */
    return rows_at(mods, lanes) + ROWS_DONE_FLOATS + row_units * (size_t)(rows > 0 ? rows : 1);
}

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

/* af_mod_tensor_load, inlined into the LOAD loop: float32 and int32 tensors without a call. */
static inline __attribute__((always_inline)) bool tensor_load(const af_mod_tensor *t, const int32_t *idx, float *f,
                                                             int32_t *i) {
    int64_t off = 0;
    for (int k = 0; k < t->ndim; k++) {
        if (idx[k] < 0 || idx[k] >= t->shape[k]) return false;
        off += (int64_t)idx[k] * t->strides[k];
    }
    switch (t->dtype) {
    case AF_F32: memcpy(f, t->data + off * 4, 4); break;
    case AF_I32: memcpy(i, t->data + off * 4, 4); break;
    case AF_BOOL: *i = *(const uint8_t *)(t->data + off) != 0; break;
    default: *f = af_load_as_f32(t->data + off * (int64_t)af_dtype_size(t->dtype), t->dtype); break;
    }
    return true;
}

bool af_mod_tensor_load(const af_mod_tensor *t, const int32_t *idx, float *f, int32_t *i) {
    return tensor_load(t, idx, f, i);
}

/* Where register values sit for a tile's group of rows: value (row r, key j) at p[r·row_step + (by_key ? j : 0)]. */
typedef struct {
    float *p;
    int64_t row_step;
    bool by_key;
} operand;

/* The group's evaluation: its rows (at most AF_MOD_ROWS), its keys rounded up to whole AF_MOD_LANES (`width`; the
 * first n are keys), the scratch laid out for `lanes`, and the score tile. */
typedef struct {
    float *regs;
    int lanes, rows, n, width;
    float *s;
    int lds;
    float *row_regs;   /* NULL, or the call's registers by row alone: register k's row r at [at_row[k]·rows_ld + r0 + r] */
    int rows_ld, r0;
} group;

static operand operand_of(const af_mod_checked *m, const group *g, int k) {
    if (k == 0) return (operand){g->s, g->lds, true};
    const uint8_t v = m->varies[k];
    if (v == AF_MOD_BY_ROW && g->row_regs)
        return (operand){g->row_regs + (size_t)m->at_row[k] * (size_t)g->rows_ld + (size_t)g->r0, 1, false};
    float *p = g->regs + (size_t)m->at_lanes[k] * (size_t)g->lanes + (size_t)m->at[k];
    return (operand){p, v & AF_MOD_BY_ROW ? (v & AF_MOD_BY_KEY ? g->lanes : 1) : 0, (v & AF_MOD_BY_KEY) != 0};
}

/* LOAD: the tensor's element at the indices, per row and key (only the first n keys load: past them the indices are
 * not keys'); the previous value again when its indices are the previous key's or row's (a per-head table, a run of
 * document ids). */
static void eval_load(af_mod_checked *m, const af_mod_instr *in, const operand *x, int rows, int keys, int n,
                      operand d) {
    const af_mod_tensor *t = &m->aux[in->aux];
    const bool is_int = t->dtype == AF_I32 || t->dtype == AF_BOOL;
    const int loaded = keys < n ? keys : n;
    int32_t last[4] = {0, 0, 0, 0};
    float f = 0.0f;
    int32_t v = 0;
    bool have = false;
    for (int r = 0; r < rows; r++) {
        const int32_t *index[4];
        int step[4];
        for (int k = 0; k < t->ndim; k++) {
            index[k] = (const int32_t *)(x[k].p + r * x[k].row_step);
            step[k] = x[k].by_key;
        }
        float *df = d.p + r * d.row_step;
        int32_t *di = (int32_t *)df;
        for (int j = 0; j < loaded; j++) {
            bool same = have;
            for (int k = 0; k < t->ndim; k++) same = same && index[k][j * step[k]] == last[k];
            if (!same) {
                for (int k = 0; k < t->ndim; k++) last[k] = index[k][j * step[k]];
                f = 0.0f;
                v = 0;
                have = true;
                if (!tensor_load(t, last, &f, &v)) {
                    int expected = 0;
                    atomic_compare_exchange_strong(&m->out_of_bounds, &expected, in->aux + 1);
                }
            }
            if (is_int) di[j] = v;
            else df[j] = f;
        }
        for (int j = loaded; j < keys; j++) di[j] = 0;   /* lanes past the keys: defined values, no load */
    }
}

/* The loops below: rows of the group, then `keys` lanes (1, or a multiple of AF_MOD_LANES so that the compiler needs
 * no remainder), one loop for each way the operands vary, so that each vectorises. */
#define ROW_PTRS(T)                                                      \
    T *d_ = (T *)(D.p + r * D.row_step);                                 \
    const T *a_ = (const T *)(A.p + r * A.row_step);
#define UNARY(T, DT, expr)                                                          \
    for (int r = 0; r < rows; r++) {                                                \
        ROW_PTRS(T)                                                                 \
        DT *dd_ = (DT *)d_;                                                         \
        if (A.by_key) for (int j = 0; j < keys; j++) { const T x = a_[j]; dd_[j] = (expr); } \
        else { const T x = a_[0]; for (int j = 0; j < keys; j++) dd_[j] = (expr); }        \
    }
#define BINARY(T, DT, expr)                                                                          \
    for (int r = 0; r < rows; r++) {                                                                 \
        ROW_PTRS(T)                                                                                  \
        const T *b_ = (const T *)(Bo.p + r * Bo.row_step);                                           \
        DT *dd_ = (DT *)d_;                                                                          \
        if (A.by_key && Bo.by_key) for (int j = 0; j < keys; j++) { const T x = a_[j], y = b_[j]; dd_[j] = (expr); } \
        else if (A.by_key) { const T y = b_[0]; for (int j = 0; j < keys; j++) { const T x = a_[j]; dd_[j] = (expr); } } \
        else if (Bo.by_key) { const T x = a_[0]; for (int j = 0; j < keys; j++) { const T y = b_[j]; dd_[j] = (expr); } } \
        else { const T x = a_[0], y = b_[0]; for (int j = 0; j < keys; j++) dd_[j] = (expr); }   \
    }
#define F_UNARY(expr) UNARY(float, float, expr)
#define F_BINARY(expr) BINARY(float, float, expr)
#define I_UNARY(expr) UNARY(int32_t, int32_t, expr)
#define I_BINARY(expr) BINARY(int32_t, int32_t, expr)
#define COMPARE(opr)                                         \
    if (ints) { BINARY(int32_t, int32_t, x opr y) }          \
    else { BINARY(float, int32_t, x opr y) }

/* The common operations over whole groups of AF_MOD_LANES keys, in GCC's vector types: one load, operation and store
 * per group of keys, with no remainder loop or aliasing check per row (the destination may be an operand: each group
 * is loaded before it is stored). The same IEEE operations as the scalar loops, so the same bits. */
/* d = expr(x, y) over `rows` rows of `keys` (a multiple of AF_MOD_LANES) lanes, x and y vectors of type VT (elements
 * ET), an operand that does not vary with the key broadcast once per row; one of them varies with it. */
#define V_BINARY(VT, ET, expr)                                                                               \
    for (int r = 0; r < rows; r++) {                                                                         \
        const float *a_ = A.p + r * A.row_step, *b_ = Bo.p + r * Bo.row_step;                                \
        float *d_ = D.p + r * D.row_step;                                                                    \
        ET a1_, b1_;                                                                                         \
        memcpy(&a1_, a_, sizeof a1_);                                                                        \
        memcpy(&b1_, b_, sizeof b1_);                                                                        \
        const VT a_all = (VT){} + a1_, b_all = (VT){} + b1_;                                                 \
        if (A.by_key && Bo.by_key)                                                                           \
            for (int j = 0; j < keys; j += AF_MOD_LANES) {                                                   \
                const VT x = V_LOAD_AS(VT, a_ + j), y = V_LOAD_AS(VT, b_ + j);                               \
                V_STORE_AS(d_ + j, (expr));                                                                  \
            }                                                                                                \
        else if (A.by_key)                                                                                   \
            for (int j = 0; j < keys; j += AF_MOD_LANES) {                                                   \
                const VT x = V_LOAD_AS(VT, a_ + j), y = b_all;                                               \
                V_STORE_AS(d_ + j, (expr));                                                                  \
            }                                                                                                \
        else                                                                                                 \
            for (int j = 0; j < keys; j += AF_MOD_LANES) {                                                   \
                const VT x = a_all, y = V_LOAD_AS(VT, b_ + j);                                               \
                V_STORE_AS(d_ + j, (expr));                                                                  \
            }                                                                                                \
    }

/* Instruction `in` (operands A, B) over whole groups of keys when it is one of the common ones: true when done. */
static inline __attribute__((always_inline)) bool eval_vector(int op, bool ints, operand A, operand Bo, int rows,
                                                              int keys, operand D) {
    if (keys % AF_MOD_LANES != 0 || (!A.by_key && !Bo.by_key)) return false;
    switch (op) {
    case AF_MOD_ADD: if (ints) { V_BINARY(vuint, uint32_t, x + y) } else { V_BINARY(vfloat, float, x + y) } return true;
    case AF_MOD_SUB: if (ints) { V_BINARY(vuint, uint32_t, x - y) } else { V_BINARY(vfloat, float, x - y) } return true;
    case AF_MOD_MUL: if (ints) { V_BINARY(vuint, uint32_t, x * y) } else { V_BINARY(vfloat, float, x * y) } return true;
    case AF_MOD_LT: if (ints) { V_BINARY(vint, int32_t, -(x < y)) } else { V_BINARY(vfloat, float, -(x < y)) } return true;
    case AF_MOD_LE: if (ints) { V_BINARY(vint, int32_t, -(x <= y)) } else { V_BINARY(vfloat, float, -(x <= y)) } return true;
    case AF_MOD_GT: if (ints) { V_BINARY(vint, int32_t, -(x > y)) } else { V_BINARY(vfloat, float, -(x > y)) } return true;
    case AF_MOD_GE: if (ints) { V_BINARY(vint, int32_t, -(x >= y)) } else { V_BINARY(vfloat, float, -(x >= y)) } return true;
    case AF_MOD_AND: V_BINARY(vint, int32_t, x & y) return true;
    case AF_MOD_OR: V_BINARY(vint, int32_t, x | y) return true;
    default: return false;
    }
}

/* A program's loops in AVX-512, AVX2 or baseline code (run_program() is cloned, eval_instr inlined into each clone,
 * flex/vector.h): 4 to 16 keys an operation. */

/* Instruction `in` into D over the group: `rows` rows (1 when its value does not vary with the row) and `keys` lanes
 * (1 when it does not vary with the key). */
static inline __attribute__((always_inline)) void eval_instr(af_mod_checked *m, const af_mod_instr *in,
                                                              const group *g, int rows, int keys, operand D) {
    const int n_in = af_mod_operand_count(m, in);
    operand x[4] = {{0}};
    for (int k = 0; k < n_in; k++) x[k] = operand_of(m, g, in->in[k]);
    const operand A = x[0], Bo = x[1];
    const bool ints = n_in > 0 && m->is_int[in->in[0]];
    if (n_in == 2 && eval_vector(in->op, ints, A, Bo, rows, keys, D)) return;
    switch (in->op) {
    case AF_MOD_CONST_F32: for (int j = 0; j < keys; j++) D.p[j] = (float)in->imm; break;
    case AF_MOD_CONST_I32: for (int j = 0; j < keys; j++) ((int32_t *)D.p)[j] = (int32_t)in->imm; break;
    case AF_MOD_ADD: if (ints) { I_BINARY((int32_t)((uint32_t)x + (uint32_t)y)) } else { F_BINARY(x + y) } break;
    case AF_MOD_SUB: if (ints) { I_BINARY((int32_t)((uint32_t)x - (uint32_t)y)) } else { F_BINARY(x - y) } break;
    case AF_MOD_MUL: if (ints) { I_BINARY((int32_t)((uint32_t)x * (uint32_t)y)) } else { F_BINARY(x * y) } break;
    case AF_MOD_DIV: F_BINARY(x / y) break;
    case AF_MOD_FLOORDIV: if (ints) { I_BINARY(floordiv_i(x, y)) } else { F_BINARY(floordiv_f(x, y)) } break;
    case AF_MOD_MOD: if (ints) { I_BINARY(mod_i(x, y)) } else { F_BINARY(mod_f(x, y)) } break;
    case AF_MOD_MIN: if (ints) { I_BINARY(x < y ? x : y) } else { F_BINARY(min_f(x, y)) } break;
    case AF_MOD_MAX: if (ints) { I_BINARY(x > y ? x : y) } else { F_BINARY(max_f(x, y)) } break;
    case AF_MOD_POW: F_BINARY(powf(x, y)) break;
    case AF_MOD_NEG: if (ints) { I_UNARY((int32_t)(0u - (uint32_t)x)) } else { F_UNARY(-x) } break;
    case AF_MOD_ABS: if (ints) { I_UNARY(x < 0 ? (int32_t)(0u - (uint32_t)x) : x) } else { F_UNARY(fabsf(x)) } break;
    case AF_MOD_SIGN: if (ints) { I_UNARY(sign_i(x)) } else { F_UNARY(sign_f(x)) } break;
    case AF_MOD_FLOOR: F_UNARY(floorf(x)) break;
    case AF_MOD_CEIL: F_UNARY(ceilf(x)) break;
    case AF_MOD_ROUND: F_UNARY(nearbyintf(x)) break;   /* the default rounding mode: half to even */
    case AF_MOD_EXP: F_UNARY(expf(x)) break;
    case AF_MOD_LOG: F_UNARY(logf(x)) break;
    case AF_MOD_SQRT: F_UNARY(sqrtf(x)) break;
    case AF_MOD_RSQRT: F_UNARY(1.0f / sqrtf(x)) break;
    case AF_MOD_TANH: F_UNARY(tanhf(x)) break;
    case AF_MOD_SIGMOID: F_UNARY(sigmoid_f(x)) break;
    case AF_MOD_ERF: F_UNARY(erff(x)) break;
    case AF_MOD_SIN: F_UNARY(sinf(x)) break;
    case AF_MOD_COS: F_UNARY(cosf(x)) break;
    case AF_MOD_TAN: F_UNARY(tanf(x)) break;
    case AF_MOD_LT: COMPARE(<) break;
    case AF_MOD_LE: COMPARE(<=) break;
    case AF_MOD_GT: COMPARE(>) break;
    case AF_MOD_GE: COMPARE(>=) break;
    case AF_MOD_EQ: COMPARE(==) break;
    case AF_MOD_NE: COMPARE(!=) break;
    case AF_MOD_AND: I_BINARY(x & y) break;
    case AF_MOD_OR: I_BINARY(x | y) break;
    case AF_MOD_XOR: I_BINARY(x ^ y) break;
    case AF_MOD_NOT: I_UNARY(x == 0) break;
    case AF_MOD_WHERE: {   /* bits of either type; each operand a vector or one value */
        const operand C = x[2];
        for (int r = 0; r < rows; r++) {
            const int32_t *c = (const int32_t *)(A.p + r * A.row_step), *t = (const int32_t *)(Bo.p + r * Bo.row_step);
            const int32_t *f = (const int32_t *)(C.p + r * C.row_step);
            int32_t *d = (int32_t *)(D.p + r * D.row_step);
            if (A.by_key && Bo.by_key && C.by_key) for (int j = 0; j < keys; j++) d[j] = c[j] ? t[j] : f[j];
            else for (int j = 0; j < keys; j++) d[j] = c[j * A.by_key] ? t[j * Bo.by_key] : f[j * C.by_key];
        }
        break;
    }
    case AF_MOD_TO_F32: UNARY(int32_t, float, (float)x) break;
    case AF_MOD_TO_I32:
        /* toward zero; NaN and values past int32 give INT32_MIN, as x86's conversion (torch's CPU .to) */
        UNARY(float, int32_t, x >= -2147483648.0f && x < 2147483648.0f ? (int32_t)x : INT32_MIN) break;
    case AF_MOD_LOAD: eval_load(m, in, x, rows, keys, g->n, D); break;
    default: break;   /* af_mod_check refused it */
    }
}

/* The instructions a pass runs: bit v of a run set for those whose registers vary as v (AF_MOD_BY_*). */
enum {
    RUN_ROWS = 1 << 0 | 1 << AF_MOD_BY_ROW,                     /* once a call: what follows the row alone */
    RUN_KEYS = 1 << AF_MOD_BY_KEY,                              /* once a tile: what follows the key alone */
    RUN_SCORES = 1 << (AF_MOD_BY_ROW | AF_MOD_BY_KEY),          /* each group: what follows both */
    RUN_ALL = RUN_ROWS | RUN_KEYS | RUN_SCORES,
};

/* Run program m's instructions of run set `run` over the group, its inputs in place; the result's operand. The last
 * instruction of a score_mod that varies with row and key writes the score tile itself (every operation reads its
 * operands at the score it writes). */
AF_MOD_CLONES static operand run_program(af_mod_checked *m, const group *g, bool into_scores, int run) {
    for (int32_t i = 0; i < m->length; i++) {
        const int reg = AF_MOD_INPUTS + i;
        const uint8_t v = m->varies[reg];
        if (!(run >> v & 1)) continue;
        const bool last = i == m->length - 1;
        const operand d = last && into_scores && v == (AF_MOD_BY_ROW | AF_MOD_BY_KEY) ? operand_of(m, g, 0)
                                                                                        : operand_of(m, g, reg);
        eval_instr(m, &m->code[i], g, v & AF_MOD_BY_ROW ? g->rows : 1, v & AF_MOD_BY_KEY ? g->width : 1, d);
    }
    return into_scores && m->varies[m->n_regs - 1] == (AF_MOD_BY_ROW | AF_MOD_BY_KEY) ? operand_of(m, g, 0)
                                                                                       : operand_of(m, g, m->n_regs - 1);
}

/* ---------------------------------------------------------------- tangents (the backward) */

static const float ONE = 1.0f, ZERO = 0.0f;

/* Which register the tangents are taken with respect to (the seed), which registers follow from it, and where their
 * tangents live: register k's at base + at_lanes[k]·lanes, varying with row and key. */
typedef struct {
    int seed;
    const uint8_t *dep;
    float *base;
    const int32_t *at_lanes;
} tangents;

/* d(register k)/d(seed) for the group: 1 for the seed, 0 off it, else its tangent register. */
static operand tangent_of(const group *g, const tangents *tg, int k) {
    if (k == tg->seed) return (operand){(float *)&ONE, 0, false};
    if (!tg->dep[k]) return (operand){(float *)&ZERO, 0, false};
    return (operand){tg->base + (size_t)tg->at_lanes[k] * (size_t)g->lanes, g->lanes, true};
}

#define AT(o) ((o).p[r * (o).row_step + ((o).by_key ? j : 0)])

/* The tangent of instruction `in` into TD, by the chain rule from its operands' values and tangents (PyTorch's
 * derivatives: min / max split a tie in halves, pow's exponent term is 0 at a base of 0). Before the instruction
 * itself runs, which may overwrite the score. */
static void tangent_instr(const af_mod_checked *m, const af_mod_instr *in, const group *g, const tangents *tg,
                          operand TD) {
    const int n_in = af_mod_operand_count(m, in);
    operand x[3] = {{(float *)&ZERO, 0, false}, {(float *)&ZERO, 0, false}, {(float *)&ZERO, 0, false}};
    operand t[3] = {x[0], x[1], x[2]};
    for (int k = 0; k < n_in && k < 3; k++) {
        x[k] = operand_of(m, g, in->in[k]);
        t[k] = tangent_of(g, tg, in->in[k]);
    }
    for (int r = 0; r < g->rows; r++)
        for (int j = 0; j < g->width; j++) {
            const float a = AT(x[0]), b = AT(x[1]), da = AT(t[0]), db = AT(t[1]);
            float d = 0.0f;
            switch (in->op) {
            case AF_MOD_ADD: d = da + db; break;
            case AF_MOD_SUB: d = da - db; break;
            case AF_MOD_MUL: d = da * b + a * db; break;
            case AF_MOD_DIV: d = (da - a / b * db) / b; break;
            case AF_MOD_MOD: d = da - floorf(a / b) * db; break;
            case AF_MOD_MIN: d = a < b ? da : a > b ? db : a == b ? 0.5f * (da + db) : a != a ? da : db; break;
            case AF_MOD_MAX: d = a > b ? da : a < b ? db : a == b ? 0.5f * (da + db) : a != a ? da : db; break;
            case AF_MOD_POW:
                d = (b == 0.0f ? 0.0f : b * powf(a, b - 1.0f) * da) +
                    (db == 0.0f || (a == 0.0f && b >= 0.0f) ? 0.0f : powf(a, b) * logf(a) * db);
                break;
            case AF_MOD_NEG: d = -da; break;
            case AF_MOD_ABS: d = a > 0.0f ? da : a < 0.0f ? -da : 0.0f; break;
            case AF_MOD_EXP: d = expf(a) * da; break;
            case AF_MOD_LOG: d = da / a; break;
            case AF_MOD_SQRT: d = da / (2.0f * sqrtf(a)); break;
            case AF_MOD_RSQRT: d = -0.5f * da / (a * sqrtf(a)); break;
            case AF_MOD_TANH: { const float th = tanhf(a); d = (1.0f - th * th) * da; break; }
            case AF_MOD_SIGMOID: { const float sg = sigmoid_f(a); d = sg * (1.0f - sg) * da; break; }
            case AF_MOD_ERF: d = 1.1283791670955126f * expf(-a * a) * da; break;
            case AF_MOD_SIN: d = cosf(a) * da; break;
            case AF_MOD_COS: d = -sinf(a) * da; break;
            case AF_MOD_TAN: { const float tn = tanf(a); d = (1.0f + tn * tn) * da; break; }
            case AF_MOD_WHERE: d = ((const int32_t *)x[0].p)[r * x[0].row_step + (x[0].by_key ? j : 0)] ? db : AT(t[2]);
                break;
            default: break;   /* piecewise constant, integer, or off the score */
            }
            TD.p[r * TD.row_step + j] = d;
        }
}

/* run_program with each register's tangent beside it, the result's into T (row stride ldt): the backward's pass. */
static operand run_program_grad(af_mod_checked *m, const group *g, float *T, int ldt, int run) {
    const operand scores = operand_of(m, g, 0);
    const tangents tg = {0, m->on_score, g->regs, m->t_at_lanes};
    for (int32_t i = 0; i < m->length; i++) {
        const int reg = AF_MOD_INPUTS + i;
        const uint8_t v = m->varies[reg];
        if (!(run >> v & 1)) continue;   /* another pass's (none has a tangent) */
        const bool into_scores = i == m->length - 1 && v == (AF_MOD_BY_ROW | AF_MOD_BY_KEY);
        if (m->on_score[reg])
            tangent_instr(m, &m->code[i], g, &tg, into_scores ? (operand){T, ldt, true} : tangent_of(g, &tg, reg));
        eval_instr(m, &m->code[i], g, v & AF_MOD_BY_ROW ? g->rows : 1, v & AF_MOD_BY_KEY ? g->width : 1,
                   into_scores ? scores : operand_of(m, g, reg));
    }
    if (!m->on_score[m->n_regs - 1])   /* the result does not follow from the score */
        for (int r = 0; r < g->rows; r++) memset(T + (size_t)r * ldt, 0, sizeof(float) * (size_t)g->width);
    return m->varies[m->n_regs - 1] == (AF_MOD_BY_ROW | AF_MOD_BY_KEY) ? scores : operand_of(m, g, m->n_regs - 1);
}

/* The inputs the program reads, those of run set `run`: b, then h and q_idx per row (RUN_ROWS), kv_idx per key
 * (RUN_KEYS). */
static void fill_inputs(const af_mod_checked *m, const group *g, int64_t b, const int32_t *h_rows,
                        const int32_t *q_rows, int64_t kv0, int run) {
    if (run & RUN_ROWS) {
        if (m->reads_input[1]) ((int32_t *)operand_of(m, g, 1).p)[0] = (int32_t)b;
        if (m->reads_input[2]) memcpy(operand_of(m, g, 2).p, h_rows, sizeof(int32_t) * (size_t)g->rows);
        if (m->reads_input[3]) memcpy(operand_of(m, g, 3).p, q_rows, sizeof(int32_t) * (size_t)g->rows);
    }
    if ((run & RUN_KEYS) && m->reads_input[4]) {
        int32_t *kv = (int32_t *)operand_of(m, g, 4).p;
        for (int j = 0; j < g->width; j++) kv[j] = (int32_t)(kv0 + j);
    }
}

/* ---------------------------------------------------------------- captured tensors' gradients */

/* The registers that follow from register `seed` (differentiably): dep[k]. */
static void depends_on(const af_mod_checked *m, int seed, uint8_t *dep) {
    memset(dep, 0, (size_t)m->n_regs);
    for (int32_t i = seed - AF_MOD_INPUTS + 1; i < m->length; i++) {
        const af_mod_instr *in = &m->code[i];
        const int reg = AF_MOD_INPUTS + i, n_in = af_mod_operand_count(m, in);
        bool on = false;
        for (int k = 0; k < n_in; k++) on = on || in->in[k] == seed || dep[in->in[k]];
        dep[reg] = on && differentiable(m, in, reg);
    }
}

int64_t af_mods_aux_numel(const af_mods *mods, int aux) {
    const af_mod_tensor *t = &mods->score.aux[aux];
    int64_t n = 1;
    for (int k = 0; k < t->ndim; k++) n *= t->shape[k];
    return n;
}

void af_mods_store_aux_grad(af_tensor *t, int64_t e, float value) {
    int64_t off = 0;
    for (int k = t->ndim - 1; k >= 0; k--) {
        off += e % t->shape[k] * t->strides[k];
        e /= t->shape[k];
    }
    ((float *)t->data)[off] = value;
}

size_t af_mods_aux_scratch_floats(const af_mods *mods, int lanes) {
    const af_mod_checked *m = &mods->score;
    if (!mods->has_score) return 16;
    /* values, tangents (every register by row and key), then dep (bytes) and at_lanes (int32) */
    return program_floats(m, lanes) + (size_t)m->n_regs * AF_MOD_ROWS * (size_t)lanes + 2 * (size_t)m->n_regs + 16;
}

/* For each score of the group g[r][j] != 0: g·d(result)/d(LOAD `seed`) into the element the LOAD read. */
static void scatter_aux(const af_mod_checked *m, const group *gr, const af_mod_instr *load, operand t_final,
                        const float *g, int ldg, float *grad) {
    const af_mod_tensor *t = &m->aux[load->aux];
    operand x[4];
    for (int k = 0; k < t->ndim; k++) x[k] = operand_of(m, gr, load->in[k]);
    for (int r = 0; r < gr->rows; r++)
        for (int j = 0; j < gr->n; j++) {
            const float gv = g[(size_t)r * ldg + j];
            if (gv == 0.0f) continue;   /* a removed key: P = 0 */
            int64_t off = 0;
            bool inside = true;
            for (int k = 0; k < t->ndim; k++) {
                const int32_t i = ((const int32_t *)x[k].p)[r * x[k].row_step + (x[k].by_key ? j : 0)];
                inside = inside && i >= 0 && i < t->shape[k];
                off = off * t->shape[k] + i;
            }
            if (inside) grad[off] += gv * AT(t_final);   /* outside: the forward has failed the call */
        }
}

void af_mods_aux_grads_tile(af_mods *mods, int64_t b, const int32_t *h_rows, const int32_t *q_rows, int rows,
                            int64_t kv0, int n, float *raw, int ldr, const float *g, int ldg, float *const *grads,
                            float *regs, int lanes) {
    af_mod_checked *m = &mods->score;
    if (!mods->has_score) return;
    const int width = (n + AF_MOD_LANES - 1) / AF_MOD_LANES * AF_MOD_LANES;
    float *tangent_base = regs + program_floats(m, lanes);
    uint8_t *dep = (uint8_t *)(tangent_base + (size_t)m->n_regs * AF_MOD_ROWS * (size_t)lanes);
    int32_t *at_lanes = (int32_t *)(dep + ((m->n_regs + 3) & ~3));
    for (int32_t k = 0; k < m->n_regs; k++) at_lanes[k] = k * AF_MOD_ROWS;
    for (int r0 = 0; r0 < rows; r0 += AF_MOD_ROWS) {
        group gr = {regs, lanes, rows - r0 < AF_MOD_ROWS ? rows - r0 : AF_MOD_ROWS, n, width, raw + (size_t)r0 * ldr,
                    ldr, NULL, 0, 0};   /* registers by row alone in the group's own scratch */
        const float *gg = g + (size_t)r0 * ldg;
        bool any = false;
        for (int r = 0; r < gr.rows && !any; r++)
            for (int j = 0; j < n && !any; j++) any = gg[(size_t)r * ldg + j] != 0.0f;
        if (!any) continue;
        for (int r = 0; r < gr.rows; r++) memset(gr.s + (size_t)r * ldr + n, 0, sizeof(float) * (size_t)(width - n));
        fill_inputs(m, &gr, b, h_rows + r0, q_rows + r0, kv0, RUN_ALL);
        for (int32_t l = 0; l < m->length; l++) {   /* each float LOAD of a tensor that wants a gradient */
            const af_mod_instr *load = &m->code[l];
            if (load->op != AF_MOD_LOAD || !grads[load->aux] || m->is_int[AF_MOD_INPUTS + l]) continue;
            const int seed = AF_MOD_INPUTS + l, last = m->n_regs - 1;
            depends_on(m, seed, dep);
            if (last != seed && !dep[last]) continue;   /* the result does not follow from it */
            const tangents tg = {seed, dep, tangent_base, at_lanes};
            for (int32_t i = 0; i < m->length; i++) {
                const int reg = AF_MOD_INPUTS + i;
                const uint8_t v = m->varies[reg];
                if (dep[reg]) tangent_instr(m, &m->code[i], &gr, &tg, tangent_of(&gr, &tg, reg));
                eval_instr(m, &m->code[i], &gr, v & AF_MOD_BY_ROW ? gr.rows : 1, v & AF_MOD_BY_KEY ? gr.width : 1,
                           operand_of(m, &gr, reg));
            }
            scatter_aux(m, &gr, load, tangent_of(&gr, &tg, last), gg, ldg, grads[load->aux]);
        }
    }
}

/* Row r's keys [j, e) to -inf where the mask operand (int32) is 0. */
static void mask_keys(float *s, operand keep, int r, int j, int e) {
    const int32_t *k = (const int32_t *)(keep.p + r * keep.row_step);
    if (!keep.by_key) {
        if (!k[0]) for (int c = j; c < e; c++) s[c] = -INFINITY;
        return;
    }
    for (int c = j; c < e; c++) s[c] = k[c] ? s[c] : -INFINITY;
}

/* A fused TABLE over the group: the LOAD's row indices and constants from the prepared scratch, then its pass. */
static void fused_table(af_mod_checked *m, const group *g, const int32_t *q_rows, int64_t kv0, float scale, float *T,
                        int ldt) {
    const af_mod_fused *f = &m->fused;
    const af_mod_instr *load = &m->code[f->load_reg - AF_MOD_INPUTS];
    int out_of_bounds = 0;
    af_fused_table_values v = {.table = &m->aux[load->aux], .out_of_bounds = &out_of_bounds};
    for (int k = 0; k < v.table->ndim; k++) {
        if (k == f->key_dim) continue;
        const operand o = operand_of(m, g, load->in[k]);
        v.index[k] = (const int32_t *)o.p;
        v.index_step[k] = (int)o.row_step;
    }
    v.c = f->c_reg < 0 ? 0 : *(const int32_t *)operand_of(m, g, f->c_reg).p;
    v.wrap = f->wrap_reg < 0 ? 0 : *(const int32_t *)operand_of(m, g, f->wrap_reg).p;
    af_fused_table(f, &v, q_rows, g->rows, kv0, g->n, g->width, scale, g->s, g->lds, T, ldt);
    int expected = 0;
    if (out_of_bounds) atomic_compare_exchange_strong(&m->out_of_bounds, &expected, load->aux + 1);
}

/* The mask_mod over a group: its result register, or (a fused band) each row's keys and the gates. */
typedef struct {
    operand keep;
    bool band;
    int32_t lo[AF_MOD_ROWS], hi[AF_MOD_ROWS];   /* the keys row r keeps, [lo, hi), as offsets from kv0 */
    operand gate[AF_BAND_GATES];
    int n_gates;
} mask_eval;

/* A fused band over the group's rows: each row's key range, its registers read from the prepared scratch. */
static void band_rows(const af_mod_checked *m, const group *g, const int32_t *q_rows, int64_t kv0, mask_eval *e) {
    const af_mod_fused *f = &m->fused;
    int32_t values[AF_BAND_LIMITS][2];
    for (int i = 0; i < f->n_limits; i++)
        for (int k = 0; k < 2; k++)
            values[i][k] = f->limit[i].reg[k] < 0 ? 0 : *(const int32_t *)operand_of(m, g, f->limit[i].reg[k]).p;
    e->band = true;
    for (int r = 0; r < g->rows; r++) {
        int64_t lo, hi;
        af_fused_band(f, (const int32_t(*)[2])values, q_rows[r], &lo, &hi);
        lo = lo < kv0 ? 0 : lo - kv0;               /* as offsets, clamped to the keys [0, n] */
        hi = hi >= kv0 + g->n ? g->n : hi < kv0 ? 0 : hi - kv0 + 1;
        e->lo[r] = (int32_t)(lo < g->n ? lo : g->n);
        e->hi[r] = (int32_t)(hi > e->lo[r] ? hi : e->lo[r]);
    }
    e->n_gates = f->n_gates;
    for (int i = 0; i < f->n_gates; i++) e->gate[i] = operand_of(m, g, f->gate[i]);
}

/* Row r's keys [j, e) to -inf where the mask removes them. */
static void mask_run(const mask_eval *m, float *s, int r, int j, int e) {
    if (!m->band) {
        mask_keys(s, m->keep, r, j, e);
        return;
    }
    const int lo = m->lo[r] < e ? m->lo[r] : e;   /* plain runs of stores, which the compiler vectorises */
    for (int c = j; c < lo; c++) s[c] = -INFINITY;
    for (int c = m->hi[r] > j ? m->hi[r] : j; c < e; c++) s[c] = -INFINITY;
    for (int i = 0; i < m->n_gates; i++) mask_keys(s, m->gate[i], r, j, e);
}

/* The group's scores times the call's scale (S·scale, one rounding, as the plain kernels' pre-scale). */
AF_MOD_CLONES static void scale_group(const group *g, float scale) {
    for (int r = 0; r < g->rows; r++) {
        float *s = g->s + (size_t)r * g->lds;
        for (int j = 0; j < g->n; j++) s[j] *= scale;
    }
}

/* A run of keys [j, e) of one block class. */
typedef struct {
    int32_t j, e, cls;
} key_run;

/* Keys [0, n) of a row whose block classes are `cls` (kv0 the first key's position) as runs of one class each, the
 * blocks walked without a division each: at most n runs. */
static int key_runs(const af_block_map *bm, const uint8_t *cls, int64_t kv0, int n, key_run *runs) {
    int count = 0;
    int64_t blk = kv0 / bm->kv_block;
    for (int j = 0; j < n;) {
        const uint8_t c = cls[blk];
        int e;
        do {
            const int64_t block_end = (blk + 1) * bm->kv_block - kv0;
            e = block_end < n ? (int)block_end : n;
            blk++;
        } while (e < n && cls[blk] == c);
        runs[count++] = (key_run){j, e, c};
        j = e;
    }
    return count;
}

/* Floats of scratch the block runs take after the programs' registers: a row's runs, at most one per key. */
static size_t runs_floats(int lanes) { return 3 * ((size_t)lanes + 1); }

/* One group of rows: which blocks its rows need evaluated (a block mask: the runs of classes, found once for rows that
 * share a query block), the programs, then the mask applied; with T (the backward), the score_mod's tangent into it,
 * 0 where a key is removed. */
/* One af_mods_apply_tile call: its rows and keys, and which of each program's passes have run (RUN_ROWS once for the
 * call's rows, RUN_KEYS once for the tile's keys: their registers then serve every group). */
typedef struct {
    af_mods *mods;
    int64_t b, kv0;
    const int32_t *h_rows, *q_rows;
    int rows;
    float scale;
    bool full;
    float *row_regs[2];   /* the score_mod's, the mask_mod's registers by row alone */
    int done[2];          /* their passes run so far */
    int32_t *rows_done;   /* [2] in the scratch: whether the row registers are there, kept for AF_MODS_SAME_ROWS */
} tile_call;

/* Program k (0: score_mod, 1: mask_mod) over group g: first the passes over the call's rows and the tile's keys it
 * has not run yet, then `run`'s instructions over the group. */
static void prepare(tile_call *c, int k, const group *g) {
    af_mod_checked *m = k ? &c->mods->mask : &c->mods->score;
    if (!(c->done[k] & RUN_ROWS)) {   /* every row of the call at once: one dispatch an instruction */
        group all = *g;
        all.rows = c->rows;
        all.r0 = 0;
        fill_inputs(m, &all, c->b, c->h_rows, c->q_rows, c->kv0, RUN_ROWS);
        run_program(m, &all, false, RUN_ROWS);
        c->rows_done[k] = 1;
    }
    if (!(c->done[k] & RUN_KEYS)) {
        fill_inputs(m, g, c->b, c->h_rows, c->q_rows, c->kv0, RUN_KEYS);
        run_program(m, g, false, RUN_KEYS);
    }
    c->done[k] |= RUN_ROWS | RUN_KEYS;
}

static void apply_group(tile_call *c, int r0, group *g, float *T, int ldt) {
    af_mods *mods = c->mods;
    const int64_t b = c->b, kv0 = c->kv0;
    const int32_t *h_rows = c->h_rows + r0, *q_rows = c->q_rows + r0;
    const af_block_map *bm = c->full ? NULL : mods->blocks;   /* full: as if no block mask, and no mask_mod */
    key_run *runs = (key_run *)(g->regs + runs_at(mods, g->lanes));
    const uint8_t *row_cls[AF_MOD_ROWS];   /* each row's class row; runs hold the last distinct one's */
    int n_runs = 0;
    bool any_partial = !bm, any_seen = !bm;
    int64_t q_lo = 0, q_hi = 0;   /* the query block of the last row looked up (one division a block) */
    for (int r = 0; bm && r < g->rows; r++) {
        if (r > 0 && h_rows[r] == h_rows[r - 1] && q_rows[r] >= q_lo && q_rows[r] < q_hi) {
            row_cls[r] = row_cls[r - 1];
            continue;
        }
        row_cls[r] = af_block_row(bm, b, h_rows[r], q_rows[r]);
        q_lo = q_rows[r] / bm->q_block * bm->q_block;
        q_hi = q_lo + bm->q_block;
        if (r > 0 && row_cls[r] == row_cls[r - 1]) continue;
        n_runs = key_runs(bm, row_cls[r], kv0, g->n, runs);
        for (int k = 0; k < n_runs; k++) {
            any_partial = any_partial || runs[k].cls == AF_BLOCK_PARTIAL;
            any_seen = any_seen || runs[k].cls != AF_BLOCK_EMPTY;
        }
    }
    const bool masked = mods->has_mask && any_partial && !c->full;
    const af_mod_fused *fused = mods->has_score && mods->score.fused.kind ? &mods->score.fused : NULL;
    if (any_seen && c->scale != 1.0f && !fused) scale_group(g, c->scale);   /* fused: in its pass */
    if (any_seen && (mods->has_score || masked) && g->width > g->n)   /* the score's lanes past the keys: defined */
        for (int r = 0; r < g->rows; r++) memset(g->s + (size_t)r * g->lds + g->n, 0, sizeof(float) * (size_t)(g->width - g->n));
    if (any_seen && mods->has_score) {
        group gs = *g;
        gs.row_regs = c->row_regs[0];
        prepare(c, 0, &gs);
        if (fused && fused->kind == AF_FUSED_ALIBI) {   /* the one pass over the scores */
            const operand a = operand_of(&mods->score, &gs, fused->row_reg);
            af_fused_alibi(fused, a.p, (int)a.row_step, q_rows, g->rows, kv0, g->width, c->scale, g->s, g->lds, T,
                           ldt);
        } else if (fused) {
            fused_table(&mods->score, &gs, q_rows, kv0, c->scale, T, ldt);
        }
        const operand out = fused ? operand_of(&mods->score, &gs, 0)
                            : T   ? run_program_grad(&mods->score, &gs, T, ldt, RUN_SCORES)
                                  : run_program(&mods->score, &gs, true, RUN_SCORES);
        if (out.p != g->s)   /* a score that does not vary with both: spread over the tile */
            for (int r = 0; r < g->rows; r++)
                for (int j = 0; j < g->n; j++) g->s[(size_t)r * g->lds + j] = out.p[r * out.row_step + (out.by_key ? j : 0)];
    }
    mask_eval keep = {0};
    if (any_seen && masked) {   /* the mask's registers after the score_mod's */
        group gm = *g;
        gm.regs = g->regs + mask_regs_at(mods, g->lanes);
        gm.row_regs = c->row_regs[1];
        prepare(c, 1, &gm);
        if (mods->mask.fused.kind == AF_FUSED_BAND) band_rows(&mods->mask, &gm, q_rows, kv0, &keep);
        else keep.keep = run_program(&mods->mask, &gm, false, RUN_SCORES);
    }
    const uint8_t *have = NULL;   /* the class row `runs` now holds (the last row's, from the loop above) */
    if (bm && g->rows > 0) have = row_cls[g->rows - 1];
    for (int r = 0; r < g->rows; r++) {
        float *s = g->s + (size_t)r * g->lds;
        if (!bm) {
            if (masked) mask_run(&keep, s, r, 0, g->n);
            continue;
        }
        if (row_cls[r] != have) n_runs = key_runs(bm, have = row_cls[r], kv0, g->n, runs);
        for (int k = 0; k < n_runs; k++) {
            const key_run u = runs[k];
            if (u.cls == AF_BLOCK_EMPTY) for (int c = u.j; c < u.e; c++) s[c] = -INFINITY;
            else if (u.cls == AF_BLOCK_PARTIAL && masked) mask_run(&keep, s, r, u.j, u.e);
        }
    }
    for (int r = 0; T && mods->has_score && r < g->rows; r++) {   /* removed keys: P = 0, and no NaN tangent */
        const float *s = g->s + (size_t)r * g->lds;
        float *t = T + (size_t)r * ldt;
        for (int j = 0; j < g->n; j++) t[j] = s[j] == -INFINITY ? 0.0f : t[j];
    }
}

void af_mods_apply_tile_grad(af_mods *mods, int64_t b, const int32_t *h_rows, const int32_t *q_rows, int rows,
                             int64_t kv0, int n, float scale, unsigned hints, float *s, int lds, float *t, int ldt,
                             float *regs, int lanes) {
    const int width = (n + AF_MOD_LANES - 1) / AF_MOD_LANES * AF_MOD_LANES;
    int32_t *rows_done = (int32_t *)(regs + rows_at(mods, lanes));
    float *row_regs = regs + rows_at(mods, lanes) + ROWS_DONE_FLOATS;
    if (!(hints & AF_MODS_SAME_ROWS)) rows_done[0] = rows_done[1] = 0;   /* other rows: their registers are not there */
    tile_call c = {mods, b, kv0, h_rows, q_rows, rows, scale, (hints & AF_MODS_FULL) != 0,
                   {row_regs, row_regs + (size_t)(mods->has_score ? mods->score.row_units : 0) * (size_t)rows},
                   {rows_done[0] ? RUN_ROWS : 0, rows_done[1] ? RUN_ROWS : 0}, rows_done};
    for (int r0 = 0; r0 < rows; r0 += AF_MOD_ROWS) {
        group g = {regs, lanes, rows - r0 < AF_MOD_ROWS ? rows - r0 : AF_MOD_ROWS, n, width, s + (size_t)r0 * lds,
                   lds, NULL, rows, r0};
        apply_group(&c, r0, &g, t ? t + (size_t)r0 * ldt : NULL, ldt);
    }
}

void af_mods_apply_tile(af_mods *mods, int64_t b, const int32_t *h_rows, const int32_t *q_rows, int rows, int64_t kv0,
                        int n, float scale, unsigned hints, float *s, int lds, float *regs, int lanes) {
    af_mods_apply_tile_grad(mods, b, h_rows, q_rows, rows, kv0, n, scale, hints, s, lds, NULL, 0, regs, lanes);
}

void af_mods_apply_row(af_mods *mods, int64_t b, int64_t h, int64_t q_idx, int64_t kv0, int n, float *s, float *regs,
                       int lanes) {
    const int32_t h_row = (int32_t)h, q_row = (int32_t)q_idx;
    af_mods_apply_tile(mods, b, &h_row, &q_row, 1, kv0, n, 1.0f, 0, s, lanes, regs, lanes);
}
