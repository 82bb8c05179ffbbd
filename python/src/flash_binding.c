#include "flash_binding.h"

#include <string.h>

#include "flex_binding.h"
#include "log_bridge.h"
#include "call_args.h"
#include "errors.h"
#include "sdpa_binding.h"
#include "tensors.h"
#include "workspace.h"

static const char *const input_names[AFPY_FLASH_N_INPUTS] = {"q", "k", "v", "learnable_sink", "cu_seqlens_q",
                                                            "cu_seqlens_k", "seqused_k", "page_table", "q_descale",
                                                            "k_descale", "v_descale"};

static void release_inputs(afpy_tensor inputs[AFPY_FLASH_N_INPUTS]) {
    for (int i = 0; i < AFPY_FLASH_N_INPUTS; i++) afpy_tensor_release(&inputs[i]);
}

/* Borrow every input that is given (None = absent); 0, or -1 with an exception set and nothing held. */
static int borrow_inputs(PyObject *const objects[AFPY_FLASH_N_INPUTS], uintptr_t stream,
                         afpy_tensor inputs[AFPY_FLASH_N_INPUTS]) {
    memset(inputs, 0, sizeof(afpy_tensor) * AFPY_FLASH_N_INPUTS);
    for (int i = 0; i < AFPY_FLASH_N_INPUTS; i++) {
        if (!objects[i] || objects[i] == Py_None) continue;
        if (afpy_tensor_from_object(objects[i], input_names[i], false, stream, &inputs[i]) < 0) {
            release_inputs(inputs);
            return -1;
        }
    }
    return 0;
}

static const af_tensor *view_or_null(PyObject *obj, afpy_tensor *t) {
    return obj && obj != Py_None ? &t->view : NULL;
}

/* One window side: an int (a literal offset, negative too, as FA4) or None (unbounded). */
static int read_window_side(PyObject *side, int64_t *to) {
    if (side == Py_None) {
        *to = AF_WINDOW_UNBOUNDED;
        return 0;
    }
    long long value = PyLong_AsLongLong(side);
    if (value == -1 && PyErr_Occurred()) return -1;
    *to = value;
    return 0;
}

/* window: None (no window), or a (left, right) pair of ints or None (None = unbounded on that side, as FA4). */
static int read_window(PyObject *window, af_flash_args *a) {
    if (window == Py_None) return 0;
    if (!PyTuple_Check(window) || PyTuple_GET_SIZE(window) != 2 || read_window_side(PyTuple_GET_ITEM(window, 0),
                                                                                     &a->window_left) < 0 ||
        read_window_side(PyTuple_GET_ITEM(window, 1), &a->window_right) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "window: expected None or a (left, right) pair of ints or None, got %R",
                     window);
        return -1;
    }
    a->has_window = true;
    return 0;
}

int afpy_flash_call_parse(PyObject *const objects[AFPY_FLASH_N_INPUTS], PyObject *scale, int causal, PyObject *window,
                          double softcap, long long max_seqlen_q, long long max_seqlen_k, uintptr_t stream,
                          afpy_flash_call *call) {
    memset(call, 0, sizeof *call);
    af_flash_args *a = &call->args;
    a->causal = causal;
    a->softcap = softcap;
    a->max_seqlen_q = max_seqlen_q;
    a->max_seqlen_k = max_seqlen_k;
    if (scale != Py_None) {
        a->scale = PyFloat_AsDouble(scale);
        if (a->scale == -1.0 && PyErr_Occurred()) return -1;
        a->has_scale = true;
    }
    if (read_window(window, a) < 0) return -1;
    a->stream = (void *)stream;   /* read by af_flash_attn for CUDA tensors only */
    if (borrow_inputs(objects, stream, call->inputs) < 0) return -1;
    afpy_tensor *in = call->inputs;
    a->query = &in[AFPY_FLASH_QUERY].view;
    a->key = &in[AFPY_FLASH_KEY].view;
    a->value = &in[AFPY_FLASH_VALUE].view;
    a->learnable_sink = view_or_null(objects[AFPY_FLASH_SINK], &in[AFPY_FLASH_SINK]);
    a->cu_seqlens_q = view_or_null(objects[AFPY_FLASH_CU_Q], &in[AFPY_FLASH_CU_Q]);
    a->cu_seqlens_k = view_or_null(objects[AFPY_FLASH_CU_K], &in[AFPY_FLASH_CU_K]);
    a->seqused_k = view_or_null(objects[AFPY_FLASH_SEQUSED_K], &in[AFPY_FLASH_SEQUSED_K]);
    a->page_table = view_or_null(objects[AFPY_FLASH_PAGE_TABLE], &in[AFPY_FLASH_PAGE_TABLE]);
    a->q_descale = view_or_null(objects[AFPY_FLASH_Q_DESCALE], &in[AFPY_FLASH_Q_DESCALE]);
    a->k_descale = view_or_null(objects[AFPY_FLASH_K_DESCALE], &in[AFPY_FLASH_K_DESCALE]);
    a->v_descale = view_or_null(objects[AFPY_FLASH_V_DESCALE], &in[AFPY_FLASH_V_DESCALE]);
    return 0;
}

void afpy_flash_call_release(afpy_flash_call *call) { release_inputs(call->inputs); }

static PyObject *flash_attn_call(PyObject **objects, PyObject *out_obj, PyObject *lse_obj, PyObject *scale_obj,
                                 PyObject *window, PyObject *stream_obj, PyObject *workspace_obj, int causal,
                                 int reference, double softcap, long long max_seqlen_q, long long max_seqlen_k,
                                 const af_mod_program *score_mod, const af_mod_program *mask_mod);

PyObject *afpy_flash_attn(PyObject *self, PyObject *args, PyObject *kwargs) {
    afpy_log_sync();   /* C messages at the logger's level only */
    static char *keywords[] = {"query", "key", "value", "out", "lse", "scale", "causal", "window", "softcap",
                               "learnable_sink", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                               "seqused_k", "page_table", "reference", "stream", "q_descale", "k_descale",
                               "v_descale", "workspace", "score_mod", "mask_mod", NULL};
    PyObject *objects[AFPY_FLASH_N_INPUTS] = {0};
    PyObject *out_obj, *lse_obj = Py_None, *scale_obj = Py_None, *window = Py_None, *stream_obj = Py_None;
    PyObject *workspace_obj = Py_None, *score_obj = Py_None, *mask_obj = Py_None;
    int causal = 0, reference = 0;
    double softcap = 0.0;
    long long max_seqlen_q = 0, max_seqlen_k = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO|O$OpOdOOOLLOOpOOOOOOO:flash_attn", keywords,
                                     &objects[AFPY_FLASH_QUERY], &objects[AFPY_FLASH_KEY],
                                     &objects[AFPY_FLASH_VALUE], &out_obj, &lse_obj, &scale_obj, &causal, &window,
                                     &softcap, &objects[AFPY_FLASH_SINK], &objects[AFPY_FLASH_CU_Q],
                                     &objects[AFPY_FLASH_CU_K], &max_seqlen_q, &max_seqlen_k,
                                     &objects[AFPY_FLASH_SEQUSED_K], &objects[AFPY_FLASH_PAGE_TABLE], &reference,
                                     &stream_obj, &objects[AFPY_FLASH_Q_DESCALE], &objects[AFPY_FLASH_K_DESCALE],
                                     &objects[AFPY_FLASH_V_DESCALE], &workspace_obj, &score_obj, &mask_obj))
        return NULL;
    afpy_mod score, mask;
    if (afpy_mod_parse(score_obj, "score_mod", &score) < 0) return NULL;
    if (afpy_mod_parse(mask_obj, "mask_mod", &mask) < 0) {
        afpy_mod_release(&score);
        return NULL;
    }
    PyObject *result = flash_attn_call(objects, out_obj, lse_obj, scale_obj, window, stream_obj, workspace_obj,
                                       causal, reference, softcap, max_seqlen_q, max_seqlen_k,
                                       score_obj != Py_None ? &score.program : NULL,
                                       mask_obj != Py_None ? &mask.program : NULL);
    afpy_mod_release(&score);
    afpy_mod_release(&mask);
    return result;
}

static PyObject *flash_attn_call(PyObject **objects, PyObject *out_obj, PyObject *lse_obj, PyObject *scale_obj,
                                 PyObject *window, PyObject *stream_obj, PyObject *workspace_obj, int causal,
                                 int reference, double softcap, long long max_seqlen_q, long long max_seqlen_k,
                                 const af_mod_program *score_mod, const af_mod_program *mask_mod) {
    uintptr_t stream;
    if (afpy_stream_from_object(stream_obj, &stream) < 0) return NULL;
    afpy_workspace workspace;
    if (afpy_workspace_from_object(workspace_obj, &workspace) < 0) return NULL;
    afpy_flash_call call;
    if (afpy_flash_call_parse(objects, scale_obj, causal, window, softcap, max_seqlen_q, max_seqlen_k, stream,
                              &call) < 0)
        return NULL;
    call.args.workspace = afpy_workspace_allocator(&workspace);
    call.args.score_mod = score_mod;
    call.args.mask_mod = mask_mod;
    afpy_tensor out = {0}, lse = {0};
    if (afpy_outputs_from_objects(out_obj, lse_obj, stream, &out, &lse) < 0) {
        afpy_flash_call_release(&call);
        return NULL;
    }
    af_tensor *lse_view = lse_obj != Py_None ? &lse.view : NULL;
    af_status status;
    Py_BEGIN_ALLOW_THREADS   /* the views hold their memory; nothing here touches Python objects */
    status = reference ? af_flash_attn_reference(&call.args, &out.view, lse_view)
                       : af_flash_attn(&call.args, &out.view, lse_view);
    Py_END_ALLOW_THREADS
    afpy_tensor_release(&out);
    afpy_tensor_release(&lse);
    afpy_flash_call_release(&call);
    if (status != AF_OK) return afpy_workspace_raise(&workspace, status);
    Py_RETURN_NONE;
}
