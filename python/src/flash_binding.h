/* attnforge._C.flash_attn: one af_flash_attn call (FlashAttention-4's forward) on Python tensors. */
#ifndef AFPY_FLASH_BINDING_H
#define AFPY_FLASH_BINDING_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* flash_attn(query, key, value, out, lse=None, *, scale=None, causal=False, window=None, softcap=0.0,
 *            learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
 *            seqused_k=None, page_table=None, reference=False, stream=None) -> None
 * window: None (no window) or (left, right) with -1 = unbounded, already resolved as FlashAttention-4 resolves
 * window_size (attnforge/_flash.py); stream as in _C.sdpa. Every rule is checked by the C library. */
PyObject *afpy_flash_attn(PyObject *self, PyObject *args, PyObject *kwargs);

#endif
