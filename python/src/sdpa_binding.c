#include "sdpa_binding.h"

#include "log_bridge.h"
#include "call_args.h"
#include "errors.h"
#include "workspace.h"

int afpy_outputs_from_objects(PyObject *out_obj, PyObject *lse_obj, uintptr_t stream, afpy_tensor *out,
                              afpy_tensor *lse) {
    if (afpy_tensor_from_object(out_obj, "out", true, stream, out) < 0) return -1;
    if (lse_obj && lse_obj != Py_None && afpy_tensor_from_object(lse_obj, "lse", true, stream, lse) < 0) {
        afpy_tensor_release(out);
        return -1;
    }
    return 0;
}

PyObject *afpy_sdpa(PyObject *self, PyObject *args, PyObject *kwargs) {
    afpy_log_sync();   /* C messages at the logger's level only */
    static char *keywords[] = {"args", "kwargs", "out", "lse", "causal_bottom_right", "reference", "stream",
                               "workspace", NULL};
    PyObject *call_args, *call_kwargs, *out_obj, *lse_obj = Py_None, *stream_obj = Py_None, *workspace_obj = Py_None;
    int bottom_right = 0, reference = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!O|OppOO:sdpa", keywords, &PyTuple_Type, &call_args,
                                     &PyDict_Type, &call_kwargs, &out_obj, &lse_obj, &bottom_right, &reference,
                                     &stream_obj, &workspace_obj))
        return NULL;
    uintptr_t stream;
    if (afpy_stream_from_object(stream_obj, &stream) < 0) return NULL;
    afpy_workspace workspace;
    if (afpy_workspace_from_object(workspace_obj, &workspace) < 0) return NULL;
    afpy_call call;
    if (afpy_call_parse(call_args, call_kwargs, stream, &call) < 0) return NULL;
    afpy_tensor out = {0}, lse = {0};
    if (afpy_outputs_from_objects(out_obj, lse_obj, stream, &out, &lse) < 0) {
        afpy_call_release(&call);
        return NULL;
    }
    call.args.causal_bottom_right = bottom_right;
    call.args.workspace = afpy_workspace_allocator(&workspace);   /* read by af_sdpa for CUDA tensors only */
    af_tensor *lse_view = lse_obj != Py_None ? &lse.view : NULL;
    af_status status;
    Py_BEGIN_ALLOW_THREADS   /* the views hold their memory; nothing here touches Python objects */
    status = reference ? af_sdpa_reference(&call.args, &out.view, lse_view) : af_sdpa(&call.args, &out.view, lse_view);
    Py_END_ALLOW_THREADS
    afpy_tensor_release(&out);
    afpy_tensor_release(&lse);
    afpy_call_release(&call);
    if (status != AF_OK) return afpy_workspace_raise(&workspace, status);
    Py_RETURN_NONE;
}
