/* Fused score_mods (fused.h): the shapes, found in a checked program, and their one-pass kernels. */
#include <stdatomic.h>

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
        *f = (af_mod_fused){AF_FUSED_ALIBI, a, q_kv};
        return true;
    }
    return false;
}

void af_mod_fuse(af_mod_checked *m) {
    m->fused = (af_mod_fused){AF_FUSED_NONE, 0, false};
    if (atomic_load(&fusion_off) || m->length < 1) return;
    af_mod_fused f;
    if (match_alibi(m, &f)) m->fused = f;
}

AF_MOD_CLONES void af_fused_alibi(const af_mod_fused *f, const float *a, int a_step, const int32_t *q_rows, int rows,
                                  int64_t kv0, int width, float scale, float *s, int lds, float *t, int ldt) {
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
