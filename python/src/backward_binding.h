/* attnforge._C.sdpa_backward and _C.flash_attn_backward: the gradients of one af_sdpa / af_flash_attn call. */
#ifndef AFPY_BACKWARD_BINDING_H
#define AFPY_BACKWARD_BINDING_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* sdpa_backward(args: tuple, kwargs: dict, out, dout, lse, dq, dk, dv, causal_bottom_right=False, reference=False)
 * -> None: args/kwargs are the forward's SDPA call, bound as _C.sdpa binds it; dq, dk, dv are written whole, None =
 * not wanted. */
PyObject *afpy_sdpa_backward(PyObject *self, PyObject *args, PyObject *kwargs);

/* flash_attn_backward(query, key, value, out, dout, lse, dq, dk, dv, dsink=None, *, the forward's keywords of
 * _C.flash_attn (scale, causal, window, softcap, learnable_sink, cu_seqlens_q/k, max_seqlen_q/k, seqused_k,
 * page_table, q/k/v_descale), reference=False) -> None; dsink: learnable_sink's gradient, None = not wanted. */
PyObject *afpy_flash_attn_backward(PyObject *self, PyObject *args, PyObject *kwargs);

#endif
