/* score_mod / mask_mod programs (attnforge.h, af_mod_program): checked once per call, then evaluated by the kernels
 * over the keys of one query row at a time, one operation over every key before the next (loops the compiler
 * vectorises). The driver sees only af_mods_apply_row. */
#ifndef AF_FLEX_PROGRAM_H
#define AF_FLEX_PROGRAM_H
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "attnforge.h"

#define AF_MOD_INPUTS 5    /* registers 0-4: score, b, h, q_idx, kv_idx */
#define AF_MOD_LANES 16    /* keys are evaluated in whole groups of this many: lanes is a multiple of it */

typedef struct {
    const char *data;
    af_dtype dtype;
    int ndim;
    int64_t shape[4], strides[4];   /* elements */
} af_mod_tensor;

typedef struct {
    const char *name;          /* "score_mod" / "mask_mod", for messages */
    const af_mod_instr *code;
    int32_t length, n_regs;    /* n_regs = AF_MOD_INPUTS + length */
    uint8_t *is_int;           /* per register: int32 (1) or float32 (0) */
    uint8_t *uniform;          /* per register: the same for every key of a row (computed once per row and tile) */
    uint8_t vector_input[5];   /* inputs that per-key instructions read (the others need lane 0 only) */
    uint8_t reads_input[5];    /* inputs any instruction reads */
    af_mod_tensor *aux;
    int32_t n_aux;
    atomic_int out_of_bounds;  /* a LOAD met an index outside its tensor: 1 + the aux index (0: none) */
} af_mod_checked;

struct af_block_map;

/* The call's mods: either may be absent, and its block mask (block_map.h). */
typedef struct af_mods {
    af_mod_checked score, mask;
    bool has_score, has_mask;
    const struct af_block_map *blocks;   /* NULL: mask_mod on every key */
    int32_t max_regs;          /* scratch registers the larger program needs */
} af_mods;

/* Check `prog` (NULL: absent) against the rules of attnforge.h, naming `name` and the instruction in any error. */
af_status af_mod_check(const af_mod_program *prog, const char *name, bool score, af_mod_checked *out);
void af_mod_release(af_mod_checked *m);

af_status af_mods_check(const af_mod_program *score_mod, const af_mod_program *mask_mod, af_mods *mods);
void af_mods_release(af_mods *mods);
/* After the call: AF_OK, or AF_ERR_INVALID_ARGUMENT naming the program and tensor a LOAD read outside of. */
af_status af_mods_status(af_mods *mods);

/* Floats of scratch af_mods_apply_row needs for `lanes` keys. */
size_t af_mods_scratch_floats(const af_mods *mods, int lanes);

/* Keys kv0 .. kv0 + n of query row q_idx of (batch b, query head h): s[j] (the scaled score) becomes score_mod's
 * value, then -inf where mask_mod is 0; with a block mask, -inf in the blocks it leaves out and no mask_mod in its
 * full blocks. regs: af_mods_scratch_floats(mods, lanes) floats, 64-byte aligned; lanes a
 * multiple of AF_MOD_LANES, >= n; s has `lanes` writable floats (lanes past n are scratch). */
void af_mods_apply_row(af_mods *mods, int64_t b, int64_t h, int64_t q_idx, int64_t kv0, int n, float *s, float *regs,
                       int lanes);

#endif
