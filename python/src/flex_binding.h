/* attnforge._C.flex_attn and create_block_mask: af_flex_attn / af_create_block_mask on Python tensors, the mods given
 * as instruction lists. */
#ifndef AFPY_FLEX_BINDING_H
#define AFPY_FLEX_BINDING_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "attnforge.h"
#include "tensors.h"

#define AFPY_FLEX_MAX_AUX 16

/* A mod from Python, (code, aux), as an af_mod_program holding its views. */
typedef struct {
    af_mod_program program;
    af_mod_instr *code;
    afpy_tensor aux[AFPY_FLEX_MAX_AUX];
    af_tensor aux_views[AFPY_FLEX_MAX_AUX];
    int n_aux;
} afpy_mod;

/* obj (None: no mod, m zeroed) → m; 0, or -1 with an exception set and nothing held. afpy_mod_release frees it. */
int afpy_mod_parse(PyObject *obj, const char *name, afpy_mod *m);
void afpy_mod_release(afpy_mod *m);

/* flex_attn(query, key, value, out, lse=None, *, scale=None, score_mod=None, mask_mod=None, block_mask=None,
 * reference=False) -> None. A mod is (code, aux): code a sequence of (op, in0, in1, in2, in3, aux, imm) tuples
 * (attnforge.h's af_mod_instr), aux a sequence of tensors (its captured tensors, CPU). block_mask: (q_block,
 * kv_block, kv_num_blocks, kv_indices, full_kv_num_blocks | None, full_kv_indices | None), int32 tensors. */
PyObject *afpy_flex_attn(PyObject *self, PyObject *args, PyObject *kwargs);

/* flex_attn_backward(query, key, value, out, dout, lse, dq, dk, dv, *, scale, score_mod, mask_mod, block_mask, daux,
 * reference=False) -> None: af_flex_attn_backward into dq, dk, dv (None: not wanted). */
PyObject *afpy_flex_attn_backward(PyObject *self, PyObject *args, PyObject *kwargs);

/* create_block_mask(mask_mod, B, H, L, S, q_block, kv_block, kv_num_blocks, kv_indices, full_kv_num_blocks | None,
 * full_kv_indices | None) -> None: the four int32 tensors written (attnforge.h, af_create_block_mask). */
PyObject *afpy_create_block_mask(PyObject *self, PyObject *args);

#endif
