/* One Python call of scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
 * is_causal=False, scale=None, enable_gqa=False), bound as Python binds it, → af_sdpa_args. */
#ifndef AFPY_CALL_ARGS_H
#define AFPY_CALL_ARGS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "tensors.h"

typedef struct {
    afpy_tensor query, key, value, attn_mask;
    af_sdpa_args args;       /* points into the tensors above */
    af_qkv_source source;    /* how q/k/v were passed */
} afpy_call;

/* Bind `args` (a tuple) and `kwargs` (a dict or NULL) to SDPA's signature and borrow the tensors; `stream` is the
 * cudaStream_t a CUDA call runs on (0 = the legacy default stream): args.stream, and DLPack's handshake.
 * TypeError for what Python itself would refuse (unknown or repeated argument, missing q/k/v).
 * Returns 0, or -1 with an exception set (and nothing to release). */
int afpy_call_parse(PyObject *args, PyObject *kwargs, uintptr_t stream, afpy_call *call);
/* The `stream` argument of _C.sdpa and Provider.infer: None (the legacy default stream) or a cudaStream_t as an int
 * (torch.cuda.Stream.cuda_stream). 0, or -1 with an exception set. */
int afpy_stream_from_object(PyObject *obj, uintptr_t *stream);
void afpy_call_release(afpy_call *call);

#endif
