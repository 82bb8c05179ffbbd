#include "backward_binding.h"

#include <string.h>

#include "call_args.h"
#include "errors.h"
#include "flash_binding.h"
#include "flex_binding.h"
#include "log_bridge.h"
#include "tensors.h"

enum { BW_OUT, BW_DOUT, BW_LSE, BW_DQ, BW_DK, BW_DV, BW_DSINK, N_BW };
static const char *const bw_names[N_BW] = {"out", "dout", "lse", "dq", "dk", "dv", "dsink"};

typedef struct {
    afpy_tensor views[N_BW];
    af_backward_inputs in;
    af_gradients grads;
} backward_tensors;

static void release_backward(backward_tensors *t) {
    for (int i = 0; i < N_BW; i++) afpy_tensor_release(&t->views[i]);
}

/* Borrow out, dout, lse (read) and the gradients (written; None = not wanted); 0, or -1 with nothing held. */
static int borrow_backward(PyObject *const objects[N_BW], backward_tensors *t) {
    memset(t, 0, sizeof *t);
    for (int i = 0; i < N_BW; i++) {
        if (!objects[i] || objects[i] == Py_None) continue;
        if (afpy_tensor_from_object(objects[i], bw_names[i], i >= BW_DQ, 0, &t->views[i]) < 0) {
            release_backward(t);
            return -1;
        }
    }
    af_tensor *v[N_BW];
    for (int i = 0; i < N_BW; i++) v[i] = objects[i] && objects[i] != Py_None ? &t->views[i].view : NULL;
    t->in = (af_backward_inputs){.out = v[BW_OUT], .dout = v[BW_DOUT], .lse = v[BW_LSE]};
    t->grads = (af_gradients){.dq = v[BW_DQ], .dk = v[BW_DK], .dv = v[BW_DV], .dsink = v[BW_DSINK]};
    return 0;
}

PyObject *afpy_sdpa_backward(PyObject *self, PyObject *args, PyObject *kwargs) {
    afpy_log_sync();   /* C messages at the logger's level only */
    static char *keywords[] = {"args", "kwargs", "out", "dout", "lse", "dq", "dk", "dv", "causal_bottom_right",
                               "reference", NULL};
    PyObject *call_args, *call_kwargs, *objects[N_BW] = {0};
    int bottom_right = 0, reference = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!OOOOOO|pp:sdpa_backward", keywords, &PyTuple_Type,
                                     &call_args, &PyDict_Type, &call_kwargs, &objects[BW_OUT], &objects[BW_DOUT],
                                     &objects[BW_LSE], &objects[BW_DQ], &objects[BW_DK], &objects[BW_DV],
                                     &bottom_right, &reference))
        return NULL;
    afpy_call call;
    if (afpy_call_parse(call_args, call_kwargs, 0, &call) < 0) return NULL;
    backward_tensors t;
    if (borrow_backward(objects, &t) < 0) {
        afpy_call_release(&call);
        return NULL;
    }
    call.args.causal_bottom_right = bottom_right;
    af_status status;
    Py_BEGIN_ALLOW_THREADS   /* the views hold their memory; nothing here touches Python objects */
    status = reference ? af_sdpa_backward_reference(&call.args, &t.in, &t.grads)
                       : af_sdpa_backward(&call.args, &t.in, &t.grads);
    Py_END_ALLOW_THREADS
    release_backward(&t);
    afpy_call_release(&call);
    if (status != AF_OK) return afpy_raise_status(status);
    Py_RETURN_NONE;
}

PyObject *afpy_flash_attn_backward(PyObject *self, PyObject *args, PyObject *kwargs) {
    afpy_log_sync();
    static char *keywords[] = {"query", "key", "value", "out", "dout", "lse", "dq", "dk", "dv", "dsink", "scale",
                               "causal", "window", "softcap", "learnable_sink", "cu_seqlens_q", "cu_seqlens_k",
                               "max_seqlen_q", "max_seqlen_k", "seqused_k", "page_table", "reference", "q_descale",
                               "k_descale", "v_descale", "score_mod", "mask_mod", NULL};
    PyObject *in[AFPY_FLASH_N_INPUTS] = {0}, *objects[N_BW] = {0};
    PyObject *scale_obj = Py_None, *window = Py_None, *score_obj = Py_None, *mask_obj = Py_None;
    int causal = 0, reference = 0;
    double softcap = 0.0;
    long long max_seqlen_q = 0, max_seqlen_k = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOOOO|O$OpOdOOOLLOOpOOOOO:flash_attn_backward", keywords,
                                     &in[AFPY_FLASH_QUERY], &in[AFPY_FLASH_KEY], &in[AFPY_FLASH_VALUE],
                                     &objects[BW_OUT], &objects[BW_DOUT], &objects[BW_LSE], &objects[BW_DQ],
                                     &objects[BW_DK], &objects[BW_DV], &objects[BW_DSINK], &scale_obj, &causal,
                                     &window, &softcap, &in[AFPY_FLASH_SINK], &in[AFPY_FLASH_CU_Q],
                                     &in[AFPY_FLASH_CU_K], &max_seqlen_q, &max_seqlen_k, &in[AFPY_FLASH_SEQUSED_K],
                                     &in[AFPY_FLASH_PAGE_TABLE], &reference, &in[AFPY_FLASH_Q_DESCALE],
                                     &in[AFPY_FLASH_K_DESCALE], &in[AFPY_FLASH_V_DESCALE], &score_obj, &mask_obj))
        return NULL;
    afpy_mod score, mask = {0};
    if (afpy_mod_parse(score_obj, "score_mod", &score) < 0 || afpy_mod_parse(mask_obj, "mask_mod", &mask) < 0) {
        afpy_mod_release(&score);
        return NULL;
    }
    afpy_flash_call call;
    if (afpy_flash_call_parse(in, scale_obj, causal, window, softcap, max_seqlen_q, max_seqlen_k, 0, &call) < 0) {
        afpy_mod_release(&score);
        afpy_mod_release(&mask);
        return NULL;
    }
    call.args.score_mod = score_obj != Py_None ? &score.program : NULL;
    call.args.mask_mod = mask_obj != Py_None ? &mask.program : NULL;
    backward_tensors t;
    if (borrow_backward(objects, &t) < 0) {
        afpy_flash_call_release(&call);
        afpy_mod_release(&score);
        afpy_mod_release(&mask);
        return NULL;
    }
    af_status status;
    Py_BEGIN_ALLOW_THREADS   /* the views hold their memory; nothing here touches Python objects */
    status = reference ? af_flash_attn_backward_reference(&call.args, &t.in, &t.grads)
                       : af_flash_attn_backward(&call.args, &t.in, &t.grads);
    Py_END_ALLOW_THREADS
    release_backward(&t);
    afpy_flash_call_release(&call);
    afpy_mod_release(&score);
    afpy_mod_release(&mask);
    if (status != AF_OK) return afpy_raise_status(status);
    Py_RETURN_NONE;
}
