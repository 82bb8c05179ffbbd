/* attnforge._C.flash_attn: one af_flash_attn call (FlashAttention-4's forward) on Python tensors. */
#ifndef AFPY_FLASH_BINDING_H
#define AFPY_FLASH_BINDING_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "tensors.h"

/* flash_attn(query, key, value, out, lse=None, *, scale=None, causal=False, window=None, softcap=0.0,
 *            learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
 *            seqused_k=None, page_table=None, reference=False, stream=None) -> None
 * window: None (no window) or (left, right) with -1 = unbounded, already resolved as FlashAttention-4 resolves
 * window_size (attnforge/_flash.py); stream as in _C.sdpa. Every rule is checked by the C library. */
PyObject *afpy_flash_attn(PyObject *self, PyObject *args, PyObject *kwargs);

/* A call's input tensors, in the order they are borrowed (and released). */
enum { AFPY_FLASH_QUERY, AFPY_FLASH_KEY, AFPY_FLASH_VALUE, AFPY_FLASH_SINK, AFPY_FLASH_CU_Q, AFPY_FLASH_CU_K,
       AFPY_FLASH_SEQUSED_K, AFPY_FLASH_PAGE_TABLE, AFPY_FLASH_Q_DESCALE, AFPY_FLASH_K_DESCALE, AFPY_FLASH_V_DESCALE,
       AFPY_FLASH_N_INPUTS };

typedef struct {
    afpy_tensor inputs[AFPY_FLASH_N_INPUTS];
    af_flash_args args;      /* points into inputs; workspace left NULL */
} afpy_flash_call;

/* The forward's arguments (objects: the inputs by index, None or NULL = absent) → af_flash_args with the inputs
 * borrowed; shared by _C.flash_attn and _C.flash_attn_backward. 0, or -1 with an exception set and nothing held. */
int afpy_flash_call_parse(PyObject *const objects[AFPY_FLASH_N_INPUTS], PyObject *scale, int causal, PyObject *window,
                          double softcap, long long max_seqlen_q, long long max_seqlen_k, uintptr_t stream,
                          afpy_flash_call *call);
void afpy_flash_call_release(afpy_flash_call *call);

#endif
