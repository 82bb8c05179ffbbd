/* score_mod / mask_mod programs (attnforge.h, af_mod_program): checked once per call, then evaluated by the kernels
 * over a tile of scores at a time, AF_MOD_ROWS rows by the tile's keys, one operation over all of them before the
 * next (loops the compiler vectorises). Each register holds only what it varies with: one value, one per row (what
 * follows from h and q_idx: an ALiBi slope), one per key (from kv_idx), or one per score. The driver sees only
 * af_mods_apply_tile. */
#ifndef AF_FLEX_PROGRAM_H
#define AF_FLEX_PROGRAM_H
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "attnforge.h"
#include "flex/fused.h"

#define AF_MOD_INPUTS 5    /* registers 0-4: score, b, h, q_idx, kv_idx */
#define AF_MOD_LANES 16    /* keys are evaluated in whole groups of this many: lanes is a multiple of it */
#define AF_MOD_ROWS 8      /* rows of a tile evaluated together: each operation is dispatched once for them */
enum { AF_MOD_BY_ROW = 1, AF_MOD_BY_KEY = 2 };   /* what a register varies with (both: every score) */

typedef struct af_mod_tensor {
    const char *data;
    af_dtype dtype;
    int ndim;
    int64_t shape[4], strides[4];   /* elements */
} af_mod_tensor;

typedef struct af_mod_checked {
    const char *name;          /* "score_mod" / "mask_mod", for messages */
    const af_mod_instr *code;
    int32_t length, n_regs;    /* n_regs = AF_MOD_INPUTS + length */
    uint8_t *is_int;           /* per register: int32 (1) or float32 (0) */
    uint8_t *varies;           /* per register: AF_MOD_BY_ROW | AF_MOD_BY_KEY, what its value follows */
    int32_t *at_lanes, *at;    /* per register: its values start at at_lanes·lanes + at floats of the scratch */
    int32_t lane_units, fixed; /* the scratch all registers take: lane_units·lanes + fixed floats */
    int32_t *at_row;           /* per register by row alone: its slot among the call's row registers */
    int32_t row_units;         /* ... how many (each one float per row of the call) */
    uint8_t *on_score;         /* per register: a float32 that follows from the score (the backward's tangents) */
    int32_t *t_at_lanes;       /* ... its tangent d(register)/d(score) at t_at_lanes·lanes floats (after the values) */
    int32_t t_units;           /* the tangents' scratch: t_units·lanes floats */
    uint8_t reads_input[5];    /* inputs any instruction reads */
    af_mod_tensor *aux;
    int32_t n_aux;
    atomic_int out_of_bounds;  /* a LOAD met an index outside its tensor: 1 + the aux index (0: none) */
    af_mod_fused fused;        /* a score_mod with a one-pass kernel (fused.h), or AF_FUSED_NONE */
} af_mod_checked;

struct af_block_map;

/* The call's mods: either may be absent, and its block mask (block_map.h). */
typedef struct af_mods {
    af_mod_checked score, mask;
    bool has_score, has_mask;
    const struct af_block_map *blocks;   /* NULL: mask_mod on every key */
} af_mods;

/* Check `prog` (NULL: absent) against the rules of attnforge.h, naming `name` and the instruction in any error. */
af_status af_mod_check(const af_mod_program *prog, const char *name, bool score, af_mod_checked *out);
void af_mod_release(af_mod_checked *m);
/* Element idx of aux tensor t: *f (a float tensor) or *i (int32, bool as 0 / 1); false when idx is outside it. */
bool af_mod_tensor_load(const af_mod_tensor *t, const int32_t *idx, float *f, int32_t *i);

/* Registers instruction `in` of checked program m reads (the others of in->in are not registers). */
int af_mod_operand_count(const af_mod_checked *m, const af_mod_instr *in);

af_status af_mods_check(const af_mod_program *score_mod, const af_mod_program *mask_mod, af_mods *mods);
void af_mods_release(af_mods *mods);
/* Evaluate every program in the interpreter from now on, none by a fused kernel (the references). */
void af_mods_unfuse(af_mods *mods);
/* After the call: AF_OK, or AF_ERR_INVALID_ARGUMENT naming the program and tensor a LOAD read outside of. */
af_status af_mods_status(af_mods *mods);

/* Floats of scratch af_mods_apply_tile needs for up to `rows` rows and `lanes` keys (a multiple of AF_MOD_LANES). */
size_t af_mods_scratch_floats(const af_mods *mods, int rows, int lanes);

/* Keys kv0 .. kv0 + n (n <= lanes) of `rows` rows of batch b, row r being query row q_rows[r] of query head h_rows[r]:
 * s[r·lds + j] (the raw score: the mods multiply it by `scale` first, in the vector code, on the rows a block mask
 * does not empty) becomes score_mod's value, then -inf where mask_mod is 0; with a block mask, -inf
 * in the blocks it leaves out and no mask_mod in its full blocks. Each row of s has round_up(n, AF_MOD_LANES)
 * writable floats (those past n are scratch). hints: AF_MODS_* the caller knows. regs: af_mods_scratch_floats(mods,
 * rows, lanes) floats, 64-byte aligned. */
enum {
    AF_MODS_FULL = 1,        /* every key lies in a full block for every row (a block mask's interior): no block is
                                looked up, no mask_mod runs */
    AF_MODS_SAME_ROWS = 2,   /* the rows are those of the last call on this scratch, which holds what follows from
                                them alone (the next key tile of a row block) */
};
void af_mods_apply_tile(af_mods *mods, int64_t b, const int32_t *h_rows, const int32_t *q_rows, int rows, int64_t kv0,
                        int n, float scale, unsigned hints, float *s, int lds, float *regs, int lanes);
/* The same for the backward, which also needs d(score_mod)/d(score): t[r·ldt + j] gets it for every key the row keeps
 * (0 for those removed). With no score_mod, t is not written. */
void af_mods_apply_tile_grad(af_mods *mods, int64_t b, const int32_t *h_rows, const int32_t *q_rows, int rows,
                             int64_t kv0, int n, float scale, unsigned hints, float *s, int lds, float *t, int ldt,
                             float *regs, int lanes);
/* Gradients for the score_mod's captured tensors over the same tile: for every score the row keeps, g[r·ldg + j] (the
 * loss's gradient with respect to score_mod's value there) times d(score_mod)/d(each float LOAD's value) is added to
 * grads[aux][the element loaded], for each aux tensor whose grads[aux] is not NULL (float32, its elements in
 * row-major order). raw: the scaled scores before the mods (read). regs: af_mods_aux_scratch_floats floats. */
void af_mods_aux_grads_tile(af_mods *mods, int64_t b, const int32_t *h_rows, const int32_t *q_rows, int rows,
                            int64_t kv0, int n, float *raw, int ldr, const float *g, int ldg, float *const *grads,
                            float *regs, int lanes);
size_t af_mods_aux_scratch_floats(const af_mods *mods, int lanes);
/* Elements of captured tensor `aux` of the score_mod (the length of its grads[aux] buffer). */
int64_t af_mods_aux_numel(const af_mods *mods, int aux);
/* Element e, in row-major order, of a captured tensor's float32 gradient t (any strides) set to `value`. */
void af_mods_store_aux_grad(af_tensor *t, int64_t e, float value);

/* One row of it, its scores already scaled. */
void af_mods_apply_row(af_mods *mods, int64_t b, int64_t h, int64_t q_idx, int64_t kv0, int n, float *s, float *regs,
                       int lanes);

#endif
