/* attnforge._C.flex_attn: one af_flex_attn call on Python tensors, its mods given as instruction lists. */
#ifndef AFPY_FLEX_BINDING_H
#define AFPY_FLEX_BINDING_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* flex_attn(query, key, value, out, lse=None, *, scale=None, score_mod=None, mask_mod=None, reference=False) -> None.
 * A mod is (code, aux): code a sequence of (op, in0, in1, in2, in3, aux, imm) tuples (attnforge.h's af_mod_instr),
 * aux a sequence of tensors (its captured tensors, CPU). */
PyObject *afpy_flex_attn(PyObject *self, PyObject *args, PyObject *kwargs);

#endif
