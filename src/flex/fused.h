/* Score_mods of a shape common enough to have a kernel of their own (instruction selection, no compiler): found in a
 * checked program (af_mod_fuse), their operations on every score — the scale, then the mod — run in one pass over the
 * tile instead of one pass an instruction; the same IEEE operations in the same order as the interpreter, so the same
 * bits. The program's other instructions (what follows the row or the key alone: an ALiBi slope) still run in the
 * interpreter, before. */
#ifndef AF_FLEX_FUSED_H
#define AF_FLEX_FUSED_H
#include <stdbool.h>
#include <stdint.h>

enum {
    AF_FUSED_NONE = 0,
    AF_FUSED_ALIBI,   /* score + a · float(kv_idx − q_idx) (or q_idx − kv_idx), a following the row alone */
};

typedef struct {
    int32_t kind;
    int32_t row_reg;    /* ALIBI: the register of a */
    bool q_first;       /* ALIBI: q_idx − kv_idx */
} af_mod_fused;

struct af_mod_checked;

/* The fused kind of checked score_mod m, into m->fused (AF_FUSED_NONE: the interpreter runs it all). */
void af_mod_fuse(struct af_mod_checked *m);

/* ALIBI over `rows` rows of `width` keys (a multiple of AF_MOD_LANES) from key kv0: s[r·lds + j] = s·scale +
 * a[r·a_step]·float(kv − q_rows[r]); t (not NULL: the backward) gets d/d(score) = 1 there. */
void af_fused_alibi(const af_mod_fused *f, const float *a, int a_step, const int32_t *q_rows, int rows, int64_t kv0,
                    int width, float scale, float *s, int lds, float *t, int ldt);

/* Tests only: whether af_mod_fuse finds fused kinds (on by default), to compare them with the interpreter. */
void af_mod_fusion_for_tests(bool on);

#endif
