/* Fused score_mods (fused.h): the shapes, found in a checked program, and their one-pass kernels. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"

#include "flex/fused.h"
#include "flex/program.h"
#include "flex/vector.h"

static atomic_bool fusion_off;

void af_mod_fusion_for_tests(bool on) { atomic_store(&fusion_off, !on); }

static const af_mod_instr *instr_of(const af_mod_checked *m, int reg) {
    return reg >= AF_MOD_INPUTS && reg < m->n_regs ? &m->code[reg - AF_MOD_INPUTS] : NULL;
}

/* ALIBI: the program's last instruction is ADD(score, MUL(a, TO_F32(SUB(kv_idx, q_idx)))), operands in either order,
 * a a float that does not follow the key, and those four are its only instructions that vary with row and key (so
 * none of their values is read by another). */
static bool match_alibi(const af_mod_checked *m, af_mod_fused *f) {
    const uint8_t both = AF_MOD_BY_ROW | AF_MOD_BY_KEY;
    int count = 0;
    for (int r = AF_MOD_INPUTS; r < m->n_regs; r++) count += m->varies[r] == both;
    const int last = m->n_regs - 1;
    const af_mod_instr *add = instr_of(m, last);
    if (count != 4 || !add || add->op != AF_MOD_ADD || m->is_int[last]) return false;
    const int x = add->in[0] == 0 ? add->in[1] : add->in[1] == 0 ? add->in[0] : -1;
    const af_mod_instr *mul = x > 0 ? instr_of(m, x) : NULL;
    if (!mul || mul->op != AF_MOD_MUL || m->is_int[x]) return false;
    for (int k = 0; k < 2; k++) {
        const int a = mul->in[k], c = mul->in[1 - k];
        const af_mod_instr *cvt = instr_of(m, c);
        if ((m->varies[a] & AF_MOD_BY_KEY) || m->is_int[a] || !cvt || cvt->op != AF_MOD_TO_F32) continue;
        const af_mod_instr *sub = instr_of(m, cvt->in[0]);
        if (!sub || sub->op != AF_MOD_SUB) continue;
        const bool kv_q = sub->in[0] == 4 && sub->in[1] == 3, q_kv = sub->in[0] == 3 && sub->in[1] == 4;
        if (!kv_q && !q_kv) continue;
        *f = (af_mod_fused){.kind = AF_FUSED_ALIBI, .row_reg = a, .q_first = q_kv};
        return true;
    }
    return false;
}

/* A register that follows neither row nor key and is int32 (a constant, a table's size). */
static bool fixed_int(const af_mod_checked *m, int r) {
    return r >= AF_MOD_INPUTS && r < m->n_regs && m->varies[r] == 0 && m->is_int[r];
}

/* TABLE's key index: kv_idx, kv_idx − q_idx, either + c (c fixed), all three possibly wrapped as PyTorch's negative
 * indices are traced: where(i < 0, i + size, i). The instructions it takes are marked used. */
static bool key_index(const af_mod_checked *m, int r, uint8_t *used, af_mod_fused *f) {
    const af_mod_instr *in = instr_of(m, r);
    if (r == 4) return true;   /* kv_idx */
    if (!in || !m->is_int[r]) return false;
    if (in->op == AF_MOD_WHERE && f->wrap_reg < 0) {   /* where(i < 0, i + size, i) */
        const af_mod_instr *lt = instr_of(m, in->in[0]), *add = instr_of(m, in->in[1]);
        const int i = in->in[2];
        const af_mod_instr *zero = lt ? instr_of(m, lt->in[1]) : NULL;
        if (!lt || lt->op != AF_MOD_LT || lt->in[0] != i || !zero || zero->op != AF_MOD_CONST_I32 || zero->imm != 0 ||
            !add || add->op != AF_MOD_ADD || add->in[0] != i || !fixed_int(m, add->in[1]))
            return false;
        used[r] = used[in->in[0]] = used[in->in[1]] = 1;
        f->wrap_reg = add->in[1];
        return key_index(m, i, used, f);
    }
    if (in->op == AF_MOD_ADD && f->c_reg < 0) {   /* i + c, c + i */
        const int c = fixed_int(m, in->in[1]) ? in->in[1] : fixed_int(m, in->in[0]) ? in->in[0] : -1;
        if (c < 0) return false;
        used[r] = 1;
        f->c_reg = c;
        return key_index(m, c == in->in[1] ? in->in[0] : in->in[1], used, f);
    }
    if (in->op == AF_MOD_SUB && in->in[0] == 4 && in->in[1] == 3) {   /* kv_idx − q_idx */
        used[r] = 1;
        f->rel = true;
        return true;
    }
    return false;
}

/* TABLE: ADD(score, LOAD(t, ...)), one of the LOAD's indices a key index (key_index), the others following the row
 * alone, and no other instruction varying with row and key. */
static bool match_table(const af_mod_checked *m, af_mod_fused *f) {
    const uint8_t both = AF_MOD_BY_ROW | AF_MOD_BY_KEY;
    const int last = m->n_regs - 1;
    const af_mod_instr *add = instr_of(m, last);
    if (!add || add->op != AF_MOD_ADD || m->is_int[last]) return false;
    const int x = add->in[0] == 0 ? add->in[1] : add->in[1] == 0 ? add->in[0] : -1;
    const af_mod_instr *load = x > 0 ? instr_of(m, x) : NULL;
    if (!load || load->op != AF_MOD_LOAD || m->is_int[x] || m->varies[x] != both) return false;
    *f = (af_mod_fused){.kind = AF_FUSED_TABLE, .load_reg = x, .key_dim = -1, .c_reg = -1, .wrap_reg = -1};
    uint8_t *used = calloc((size_t)m->n_regs, 1);
    if (!used) return false;
    used[last] = used[x] = 1;
    bool ok = true;
    for (int k = 0; ok && k < m->aux[load->aux].ndim; k++) {
        const int i = load->in[k];
        if (!(m->varies[i] & AF_MOD_BY_KEY)) continue;   /* follows the row alone, or neither */
        ok = f->key_dim < 0 && m->varies[i] != AF_MOD_BY_KEY ? key_index(m, i, used, f) : i == 4 && f->key_dim < 0;
        f->key_dim = k;
    }
    ok = ok && f->key_dim >= 0;
    for (int r = AF_MOD_INPUTS; ok && r < m->n_regs; r++) ok = m->varies[r] != both || used[r];
    free(used);
    return ok;
}

/* A linear form in kv_idx, q_idx and up to two registers that follow neither, with an integer constant. */
typedef struct {
    int kv, q;
    int32_t reg[2];
    int coef[2];
    int64_t k;
} linear;

/* Register r as a linear form: q_idx, kv_idx, a value that follows neither, or q_idx − kv_idx / kv_idx − q_idx (whose
 * subtraction is marked used); false for anything else (no other arithmetic: nothing here may wrap). */
static bool linear_of(const af_mod_checked *m, int r, uint8_t *used, linear *out) {
    *out = (linear){0, 0, {-1, -1}, {0, 0}, 0};
    if (r == 3) out->q = 1;
    else if (r == 4) out->kv = 1;
    else if (r >= AF_MOD_INPUTS && m->varies[r] == 0 && m->is_int[r]) {
        const af_mod_instr *in = instr_of(m, r);
        if (in->op == AF_MOD_CONST_I32) out->k = (int64_t)in->imm;
        else out->reg[0] = r, out->coef[0] = 1;
    } else {
        const af_mod_instr *in = instr_of(m, r);
        if (!in || in->op != AF_MOD_SUB || !m->is_int[r]) return false;
        if (in->in[0] == 3 && in->in[1] == 4) out->q = 1, out->kv = -1;
        else if (in->in[0] == 4 && in->in[1] == 3) out->q = -1, out->kv = 1;
        else return false;
        used[r] = 1;
    }
    return true;
}

/* Comparison `in` (register r) as a bound on kv_idx into *lim. */
static bool limit_of(const af_mod_checked *m, const af_mod_instr *in, uint8_t *used, af_band_limit *lim) {
    linear a, b;
    if (!m->is_int[in->in[0]] || !linear_of(m, in->in[0], used, &a) || !linear_of(m, in->in[1], used, &b)) return false;
    /* e = a − b; the comparison is e OP 0 */
    const int kv = a.kv - b.kv, q = a.q - b.q;
    if (kv != 1 && kv != -1) return false;
    int32_t reg[2] = {-1, -1};
    int coef[2] = {0, 0}, n = 0;
    for (int side = 0; side < 2; side++)
        for (int i = 0; i < 2; i++) {
            const linear *l = side ? &b : &a;
            if (l->reg[i] < 0) continue;
            if (n == 2) return false;
            reg[n] = l->reg[i];
            coef[n++] = side ? -l->coef[i] : l->coef[i];
        }
    const int64_t k = a.k - b.k;
    /* kv·x + rest OP 0, x = ±1: with x = 1, kv OP −rest; with x = −1, −kv OP −rest, kv OP' rest */
    int op = in->op;
    if (op == AF_MOD_LT || op == AF_MOD_GT) {   /* e < 0: e <= −1; e > 0: e >= 1 (integers) */
        op = op == AF_MOD_LT ? AF_MOD_LE : AF_MOD_GE;
    }
    const int64_t shift = in->op == AF_MOD_LT ? 1 : in->op == AF_MOD_GT ? -1 : 0;   /* e <= −shift / e >= −shift */
    const bool le = op == AF_MOD_LE;   /* else GE */
    if (op != AF_MOD_LE && op != AF_MOD_GE) return false;
    /* kv·x OP −(q·q_idx + Σ coef·reg + k) − shift */
    const int sign = kv == 1 ? -1 : 1;   /* bound = sign·(q·q_idx + Σ coef·reg + k + shift) */
    lim->upper = kv == 1 ? le : !le;
    lim->q_coef = (int8_t)(sign * q);
    if (lim->q_coef < -1 || lim->q_coef > 1) return false;
    for (int i = 0; i < 2; i++) {
        lim->reg[i] = reg[i];
        lim->reg_coef[i] = (int8_t)(sign * coef[i]);
    }
    lim->k = sign * (k + shift);
    return true;
}

/* BAND: walk the AND tree from the result; every instruction that varies with row and key must be in it. */
static bool band_node(const af_mod_checked *m, int r, uint8_t *used, af_mod_fused *f) {
    const uint8_t both = AF_MOD_BY_ROW | AF_MOD_BY_KEY;
    if (m->varies[r] != both) {   /* a gate: a mask of the row or the key alone, ANDed as it is */
        if (!m->is_int[r] || f->n_gates == AF_BAND_GATES) return false;
        f->gate[f->n_gates++] = r;
        return true;
    }
    const af_mod_instr *in = instr_of(m, r);
    if (!in) return false;
    used[r] = 1;
    if (in->op == AF_MOD_AND) return band_node(m, in->in[0], used, f) && band_node(m, in->in[1], used, f);
    const bool cmp = in->op == AF_MOD_LT || in->op == AF_MOD_LE || in->op == AF_MOD_GT || in->op == AF_MOD_GE;
    if (!cmp || f->n_limits == AF_BAND_LIMITS) return false;
    return limit_of(m, in, used, &f->limit[f->n_limits++]);
}

static bool match_band(const af_mod_checked *m, af_mod_fused *f) {
    const int last = m->n_regs - 1;
    if (m->varies[last] != (AF_MOD_BY_ROW | AF_MOD_BY_KEY)) return false;
    uint8_t *used = calloc((size_t)m->n_regs, 1);
    if (!used) return false;
    *f = (af_mod_fused){.kind = AF_FUSED_BAND};
    bool ok = band_node(m, last, used, f);
    for (int r = AF_MOD_INPUTS; ok && r < m->n_regs; r++)
        ok = m->varies[r] != (AF_MOD_BY_ROW | AF_MOD_BY_KEY) || used[r];
    free(used);
    return ok;
}

void af_mod_fuse(af_mod_checked *m) {
    m->fused = (af_mod_fused){.kind = AF_FUSED_NONE};
    if (atomic_load(&fusion_off) || m->length < 1) return;
    af_mod_fused f;
    if (m->is_int[m->n_regs - 1] ? match_band(m, &f) : match_alibi(m, &f) || match_table(m, &f)) m->fused = f;
}

void af_fused_band(const af_mod_fused *f, const int32_t (*reg_value)[2], int64_t q_idx, int64_t *lo, int64_t *hi) {
    int64_t l = INT64_MIN, h = INT64_MAX;
    for (int i = 0; i < f->n_limits; i++) {
        const af_band_limit *b = &f->limit[i];
        const int64_t bound = b->q_coef * q_idx + b->reg_coef[0] * (int64_t)reg_value[i][0] +
                              b->reg_coef[1] * (int64_t)reg_value[i][1] + b->k;
        if (b->upper) h = bound < h ? bound : h;
        else l = bound > l ? bound : l;
    }
    *lo = l;
    *hi = h;
}

/* The clones are static (clang makes a caller-visible ifunc only for them), af_fused_alibi calls them. */
AF_MOD_CLONES static void alibi_rows(const af_mod_fused *f, const float *a, int a_step, const int32_t *q_rows,
                                     int rows, int64_t kv0, int width, float scale, float *s, int lds, float *t,
                                     int ldt) {
    vint lane;
    for (int j = 0; j < AF_MOD_LANES; j++) lane[j] = j;
    const vfloat one = (vfloat){} + 1.0f;
    for (int r = 0; r < rows; r++) {
        const float ar = a[r * a_step];
        const uint32_t q = (uint32_t)q_rows[r];
        float *sr = s + (size_t)r * lds;
        for (int j = 0; j < width; j += AF_MOD_LANES) {
            const vuint kv = (vuint)(lane + (int32_t)(kv0 + j));   /* as fill_inputs: kv_idx as int32 */
            const vint d = (vint)(f->q_first ? q - kv : kv - q);   /* int32 subtraction, wrapping as the interpreter's */
            vfloat x = V_LOAD_AS(vfloat, sr + j);
            if (scale != 1.0f) x = x * scale;
            V_STORE_AS(sr + j, x + ar * __builtin_convertvector(d, vfloat));
        }
        for (int j = 0; t && j < width; j += AF_MOD_LANES) V_STORE_AS(t + (size_t)r * ldt + j, one);
    }
}

void af_fused_alibi(const af_mod_fused *f, const float *a, int a_step, const int32_t *q_rows, int rows, int64_t kv0,
                    int width, float scale, float *s, int lds, float *t, int ldt) {
    alibi_rows(f, a, a_step, q_rows, rows, kv0, width, scale, s, lds, t, ldt);
}

/* Element `off` of the table as float32 (f32, f16 or bf16: the interpreter's LOAD converts the same way). */
static inline float table_at(const af_mod_tensor *t, int64_t off) {
    if (t->dtype == AF_F32) {
        float x;
        memcpy(&x, t->data + off * 4, 4);
        return x;
    }
    return af_load_as_f32(t->data + off * (int64_t)af_dtype_size(t->dtype), t->dtype);
}

void af_fused_table(const af_mod_fused *f, const af_fused_table_values *v, const int32_t *q_rows, int rows,
                    int64_t kv0, int n, int width, float scale, float *s, int lds, float *t, int ldt) {
    const af_mod_tensor *tab = v->table;
    const int64_t key_size = tab->shape[f->key_dim], key_stride = tab->strides[f->key_dim];
    for (int r = 0; r < rows; r++) {
        float *sr = s + (size_t)r * lds;
        int64_t base = 0;
        bool inside = true;   /* the indices that follow the row */
        for (int k = 0; k < tab->ndim; k++) {
            if (k == f->key_dim) continue;
            const int32_t i = v->index[k][r * v->index_step[k]];
            inside = inside && i >= 0 && i < tab->shape[k];
            base += (int64_t)i * tab->strides[k];
        }
        /* the key index of key j: kv (int32, as the interpreter's) − q + c, wrapped, in uint32 arithmetic */
        const uint32_t shift = (f->rel ? 0u - (uint32_t)q_rows[r] : 0u) + (uint32_t)v->c;
        const int32_t first = (int32_t)((uint32_t)(int32_t)kv0 + shift);
        /* every key's index inside the table, none wrapped, in a float32 row: a plain vector loop */
        if (inside && first >= 0 && (int64_t)first + width <= key_size && (int64_t)first + width <= INT32_MAX &&
            key_stride == 1 && tab->dtype == AF_F32) {
            const float *row = (const float *)tab->data + base + first;
            for (int j = 0; j < width; j++) {
                const float x = scale != 1.0f ? sr[j] * scale : sr[j];
                sr[j] = x + (j < n ? row[j] : 0.0f);
            }
        } else {
            for (int j = 0; j < width; j++) {
                int32_t i = (int32_t)((uint32_t)(int32_t)(kv0 + j) + shift);
                if (f->wrap_reg >= 0 && i < 0) i = (int32_t)((uint32_t)i + (uint32_t)v->wrap);
                float val = 0.0f;
                if (j < n) {
                    if (inside && i >= 0 && i < key_size) val = table_at(tab, base + (int64_t)i * key_stride);
                    else *v->out_of_bounds = 1;
                }
                const float x = scale != 1.0f ? sr[j] * scale : sr[j];
                sr[j] = x + val;
            }
        }
        for (int j = 0; t && j < width; j++) t[(size_t)r * ldt + j] = 1.0f;
    }
}
