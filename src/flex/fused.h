/* Mods of a shape common enough to have a kernel of their own (instruction selection, no compiler): found in a checked
 * program (af_mod_fuse), their operations on every score run in one pass over the tile instead of one pass an
 * instruction, giving what the interpreter gives, bit for bit. The program's other instructions (what follows the row
 * or the key alone: an ALiBi slope, a window's width) still run in the interpreter, before. */
#ifndef AF_FLEX_FUSED_H
#define AF_FLEX_FUSED_H
#include <stdbool.h>
#include <stdint.h>

enum {
    AF_FUSED_NONE = 0,
    AF_FUSED_ALIBI,   /* score_mod: score + a · float(kv_idx − q_idx) (or q_idx − kv_idx), a following the row alone */
    AF_FUSED_TABLE,   /* score_mod: score + table[..., i, ...], i = kv_idx or kv_idx − q_idx (+ c), PyTorch's negative
                         index wrapped or not, the other indices following the row alone (a relative-position bias) */
    AF_FUSED_BAND,    /* mask_mod: an AND of comparisons among q_idx, kv_idx, their differences and values that follow
                         neither (causal, windows, bands), each a bound on kv_idx per row, and of masks that follow
                         the row or the key alone ("gates") */
};

#define AF_BAND_LIMITS 4
#define AF_BAND_GATES 4

/* A bound on kv_idx for row q_idx: kv_idx <= (upper) or >= (lower) q_coef·q_idx + Σ reg_coef[i]·reg[i] + k, the regs
 * int32 registers that follow neither row nor key (-1: none). */
typedef struct {
    bool upper;
    int8_t q_coef, reg_coef[2];
    int32_t reg[2];
    int64_t k;
} af_band_limit;

typedef struct {
    int32_t kind;
    int32_t row_reg;    /* ALIBI: the register of a */
    bool q_first;       /* ALIBI: q_idx − kv_idx */
    int32_t load_reg, key_dim;              /* TABLE: the LOAD, and which of its indices follows the key */
    bool rel;                               /* TABLE: that index is kv_idx − q_idx (+ c), else kv_idx */
    int32_t c_reg, wrap_reg;                /* TABLE: c's register (-1: none), the wrap's size's (-1: no wrap) */
    int32_t n_limits, n_gates;              /* BAND */
    af_band_limit limit[AF_BAND_LIMITS];
    int32_t gate[AF_BAND_GATES];            /* BAND: int32 registers ANDed in as they are */
} af_mod_fused;

struct af_mod_checked;
struct af_mod_tensor;

/* TABLE over one group: the values its registers hold. */
typedef struct {
    const struct af_mod_tensor *table;
    const int32_t *index[4];   /* per dimension but the key's: the rows' indices (index_step 1) or one (0) */
    int index_step[4];
    int32_t c, wrap;           /* the key index's constant, the wrap's size (values; 0 when absent) */
    int *out_of_bounds;        /* set (to 1) when a key before n reads outside the table, as the interpreter's LOAD */
} af_fused_table_values;

/* The fused kind of checked program m, into m->fused (AF_FUSED_NONE: the interpreter runs it all). */
void af_mod_fuse(struct af_mod_checked *m);

/* ALIBI over `rows` rows of `width` keys (a multiple of AF_MOD_LANES) from key kv0: s[r·lds + j] = s·scale +
 * a[r·a_step]·float(kv − q_rows[r]); t (not NULL: the backward) gets d/d(score) = 1 there. */
void af_fused_alibi(const af_mod_fused *f, const float *a, int a_step, const int32_t *q_rows, int rows, int64_t kv0,
                    int width, float scale, float *s, int lds, float *t, int ldt);

/* TABLE over `rows` rows of `width` keys (n of them real) from key kv0: s[r·lds + j] = s·scale + the table's element
 * (0 where the index is outside it); t (the backward) gets d/d(score) = 1. */
void af_fused_table(const af_mod_fused *f, const af_fused_table_values *v, const int32_t *q_rows, int rows,
                    int64_t kv0, int n, int width, float scale, float *s, int lds, float *t, int ldt);

/* BAND: the keys [*lo, *hi] (inclusive; lo > hi: none) row q_idx keeps, reg_value[i][k] the value of limit i's
 * reg[k] (0 where there is none). Exact in int64: the comparisons' operands never wrap (af_mod_fuse takes only
 * q_idx, kv_idx, their differences and values that follow neither). */
void af_fused_band(const af_mod_fused *f, const int32_t (*reg_value)[2], int64_t q_idx, int64_t *lo, int64_t *hi);

/* Tests only: whether af_mod_fuse finds fused kinds (on by default), to compare them with the interpreter. */
void af_mod_fusion_for_tests(bool on);

#endif
