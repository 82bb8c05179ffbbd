/* attnforge._C.flex_attn (flex_binding.h): Python instruction lists and tensors into af_mod_program, then one
 * af_flex_attn call without the GIL. */
#include "flex_binding.h"

#include <stdlib.h>

#include "attnforge.h"
#include "errors.h"
#include "log_bridge.h"
#include "sdpa_binding.h"
#include "tensors.h"

static void release_mod(afpy_mod *m) {
    for (int i = 0; i < m->n_aux; i++) afpy_tensor_release(&m->aux[i]);
    free(m->code);
    m->code = NULL;
    m->n_aux = 0;
}

/* (code, aux) -> m->program; 0, or -1 with an exception set and nothing held. */
static int parse_mod(PyObject *obj, const char *name, afpy_mod *m) {
    memset(m, 0, sizeof *m);
    PyObject *code_obj, *aux_obj;
    if (!PyArg_ParseTuple(obj, "OO", &code_obj, &aux_obj)) return -1;
    PyObject *code = PySequence_Fast(code_obj, "code must be a sequence of instructions");
    if (!code) return -1;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(code);
    if (n < 1 || n > 65536) {
        Py_DECREF(code);
        PyErr_Format(PyExc_ValueError, "%s: needs 1 to 65536 instructions, got %zd", name, n);
        return -1;
    }
    if (!(m->code = calloc((size_t)n, sizeof(af_mod_instr)))) {
        Py_DECREF(code);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        af_mod_instr *in = &m->code[i];
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(code, i), "iiiiiid", &in->op, &in->in[0], &in->in[1],
                              &in->in[2], &in->in[3], &in->aux, &in->imm)) {
            Py_DECREF(code);
            release_mod(m);
            return -1;
        }
    }
    Py_DECREF(code);
    PyObject *aux = PySequence_Fast(aux_obj, "aux must be a sequence of tensors");
    if (!aux) {
        release_mod(m);
        return -1;
    }
    const Py_ssize_t n_aux = PySequence_Fast_GET_SIZE(aux);
    if (n_aux > AFPY_FLEX_MAX_AUX) {
        Py_DECREF(aux);
        release_mod(m);
        PyErr_Format(PyExc_ValueError, "%s: at most %d captured tensors, got %zd", name, AFPY_FLEX_MAX_AUX, n_aux);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n_aux; i++) {
        if (afpy_tensor_from_object(PySequence_Fast_GET_ITEM(aux, i), name, false, 0, &m->aux[i]) < 0) {
            Py_DECREF(aux);
            release_mod(m);
            return -1;
        }
        m->aux_views[i] = m->aux[i].view;
        m->n_aux = (int)i + 1;
    }
    Py_DECREF(aux);
    m->program = (af_mod_program){m->code, (int32_t)n, m->n_aux ? m->aux_views : NULL, m->n_aux};
    return 0;
}

int afpy_mod_parse(PyObject *obj, const char *name, afpy_mod *m) {
    if (obj == Py_None) {
        memset(m, 0, sizeof *m);
        return 0;
    }
    return parse_mod(obj, name, m);
}

void afpy_mod_release(afpy_mod *m) { release_mod(m); }

/* A block mask's tensors: (q_block, kv_block, kv_num_blocks, kv_indices, full_kv_num_blocks | None,
 * full_kv_indices | None) -> m->mask; 0, or -1 with an exception set (what was taken is released by the caller). */
typedef struct {
    af_block_mask mask;
    afpy_tensor t[4];
} afpy_blocks;

static void release_blocks(afpy_blocks *b) {
    for (int i = 0; i < 4; i++) afpy_tensor_release(&b->t[i]);
}

static int parse_blocks(PyObject *obj, afpy_blocks *b) {
    PyObject *o[4];
    long long qb, kb;
    if (!PyArg_ParseTuple(obj, "LLOOOO", &qb, &kb, &o[0], &o[1], &o[2], &o[3])) return -1;
    static const char *names[4] = {"block_mask.kv_num_blocks", "block_mask.kv_indices",
                                   "block_mask.full_kv_num_blocks", "block_mask.full_kv_indices"};
    for (int i = 0; i < 4; i++)
        if (o[i] != Py_None && afpy_tensor_from_object(o[i], names[i], false, 0, &b->t[i]) < 0) return -1;
    b->mask = (af_block_mask){qb, kb, &b->t[0].view, &b->t[1].view, o[2] != Py_None ? &b->t[2].view : NULL,
                              o[3] != Py_None ? &b->t[3].view : NULL};
    return 0;
}

/* What af_flex_attn and its backward take alike: scale, the mods and the block mask into *a; 0, or -1 with an
 * exception set (what was taken is the caller's to release; score, mask and blocks start zeroed). */
static int parse_flex_args(PyObject *scale_obj, PyObject *score_obj, PyObject *mask_obj, PyObject *blocks_obj,
                           af_flex_args *a, afpy_mod *score, afpy_mod *mask, afpy_blocks *blocks) {
    if (scale_obj != Py_None) {
        a->has_scale = true;
        a->scale = PyFloat_AsDouble(scale_obj);
        if (PyErr_Occurred()) return -1;
    }
    if (afpy_mod_parse(score_obj, "score_mod", score) < 0 || afpy_mod_parse(mask_obj, "mask_mod", mask) < 0 ||
        (blocks_obj != Py_None && parse_blocks(blocks_obj, blocks) < 0))
        return -1;
    a->score_mod = score_obj != Py_None ? &score->program : NULL;
    a->mask_mod = mask_obj != Py_None ? &mask->program : NULL;
    a->block_mask = blocks_obj != Py_None ? &blocks->mask : NULL;
    return 0;
}

PyObject *afpy_flex_attn(PyObject *self, PyObject *args, PyObject *kwargs) {
    afpy_log_sync();
    static char *keywords[] = {"query", "key", "value", "out", "lse", "scale", "score_mod", "mask_mod", "block_mask",
                               "reference", NULL};
    PyObject *q_obj, *k_obj, *v_obj, *out_obj, *lse_obj = Py_None, *scale_obj = Py_None;
    PyObject *score_obj = Py_None, *mask_obj = Py_None, *blocks_obj = Py_None;
    int reference = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO|O$OOOOp:flex_attn", keywords, &q_obj, &k_obj, &v_obj,
                                     &out_obj, &lse_obj, &scale_obj, &score_obj, &mask_obj, &blocks_obj, &reference))
        return NULL;
    af_flex_args a = {0};
    afpy_mod score = {0}, mask = {0};
    afpy_blocks blocks = {0};
    afpy_tensor q = {0}, k = {0}, v = {0}, out = {0}, lse = {0};
    PyObject *result = NULL;
    if (parse_flex_args(scale_obj, score_obj, mask_obj, blocks_obj, &a, &score, &mask, &blocks) < 0) goto done;
    if (afpy_tensor_from_object(q_obj, "query", false, 0, &q) < 0 ||
        afpy_tensor_from_object(k_obj, "key", false, 0, &k) < 0 ||
        afpy_tensor_from_object(v_obj, "value", false, 0, &v) < 0 ||
        afpy_outputs_from_objects(out_obj, lse_obj, 0, &out, &lse) < 0)
        goto done;
    a.query = &q.view;
    a.key = &k.view;
    a.value = &v.view;
    af_tensor *lse_view = lse_obj != Py_None ? &lse.view : NULL;
    af_status status;
    Py_BEGIN_ALLOW_THREADS
    status = reference ? af_flex_attn_reference(&a, &out.view, lse_view) : af_flex_attn(&a, &out.view, lse_view);
    Py_END_ALLOW_THREADS
    if (status != AF_OK) afpy_raise_status(status);
    else result = Py_NewRef(Py_None);
done:
    afpy_tensor_release(&q);
    afpy_tensor_release(&k);
    afpy_tensor_release(&v);
    afpy_tensor_release(&out);
    afpy_tensor_release(&lse);
    release_mod(&score);
    release_mod(&mask);
    release_blocks(&blocks);
    return result;
}

PyObject *afpy_create_block_mask(PyObject *self, PyObject *args) {
    (void)self;
    afpy_log_sync();
    PyObject *mask_obj, *o[4];
    long long B, H, L, S, qb, kb;
    if (!PyArg_ParseTuple(args, "OLLLLLLOOOO:create_block_mask", &mask_obj, &B, &H, &L, &S, &qb, &kb, &o[0], &o[1],
                          &o[2], &o[3]))
        return NULL;
    afpy_mod mask = {0};
    afpy_tensor t[4] = {{0}};
    PyObject *result = NULL;
    static const char *names[4] = {"kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"};
    if (parse_mod(mask_obj, "mask_mod", &mask) < 0) goto done;
    for (int i = 0; i < 4; i++)
        if (o[i] != Py_None && afpy_tensor_from_object(o[i], names[i], true, 0, &t[i]) < 0) goto done;
    const af_block_mask_tensors out = {&t[0].view, &t[1].view, o[2] != Py_None ? &t[2].view : NULL,
                                       o[3] != Py_None ? &t[3].view : NULL};
    af_status status;
    Py_BEGIN_ALLOW_THREADS
    status = af_create_block_mask(&mask.program, B, H, L, S, qb, kb, &out);
    Py_END_ALLOW_THREADS
    if (status != AF_OK) afpy_raise_status(status);
    else result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < 4; i++) afpy_tensor_release(&t[i]);
    release_mod(&mask);
    return result;
}

PyObject *afpy_flex_attn_backward(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    afpy_log_sync();
    static char *keywords[] = {"query", "key", "value", "out", "dout", "lse", "dq", "dk", "dv", "scale", "score_mod",
                               "mask_mod", "block_mask", "daux", "reference", NULL};
    PyObject *obj[9], *scale_obj = Py_None, *score_obj = Py_None, *mask_obj = Py_None, *blocks_obj = Py_None;
    PyObject *daux_obj = Py_None;
    int reference = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOOOO|$OOOOOp:flex_attn_backward", keywords, &obj[0], &obj[1],
                                     &obj[2], &obj[3], &obj[4], &obj[5], &obj[6], &obj[7], &obj[8], &scale_obj,
                                     &score_obj, &mask_obj, &blocks_obj, &daux_obj, &reference))
        return NULL;
    af_flex_args a = {0};
    static const char *names[9] = {"query", "key", "value", "out", "dout", "lse", "dq", "dk", "dv"};
    afpy_mod score = {0}, mask = {0};
    afpy_blocks blocks = {0};
    afpy_tensor t[9] = {{0}}, daux[AFPY_FLEX_MAX_AUX] = {{0}};
    af_tensor *daux_views[AFPY_FLEX_MAX_AUX] = {NULL};
    PyObject *result = NULL, *daux_seq = NULL;
    if (parse_flex_args(scale_obj, score_obj, mask_obj, blocks_obj, &a, &score, &mask, &blocks) < 0) goto done;
    if (daux_obj != Py_None) {   /* one entry (None or a float32 tensor) per captured tensor of the score_mod */
        if (!(daux_seq = PySequence_Fast(daux_obj, "daux must be a sequence"))) goto done;
        if (PySequence_Fast_GET_SIZE(daux_seq) != score.n_aux) {
            PyErr_Format(PyExc_ValueError, "daux: %zd entries for the score_mod's %d captured tensors",
                         PySequence_Fast_GET_SIZE(daux_seq), score.n_aux);
            goto done;
        }
        for (int i = 0; i < score.n_aux; i++) {
            PyObject *d = PySequence_Fast_GET_ITEM(daux_seq, i);
            if (d == Py_None) continue;
            if (afpy_tensor_from_object(d, "daux", true, 0, &daux[i]) < 0) goto done;
            daux_views[i] = &daux[i].view;
        }
    }
    for (int i = 0; i < 9; i++)
        if (obj[i] != Py_None && afpy_tensor_from_object(obj[i], names[i], i >= 6, 0, &t[i]) < 0) goto done;
    a.query = &t[0].view;
    a.key = &t[1].view;
    a.value = &t[2].view;
    const af_backward_inputs in = {&t[3].view, &t[4].view, &t[5].view};
    const af_gradients grads = {obj[6] != Py_None ? &t[6].view : NULL, obj[7] != Py_None ? &t[7].view : NULL,
                                obj[8] != Py_None ? &t[8].view : NULL, NULL};
    af_status status;
    Py_BEGIN_ALLOW_THREADS
    af_tensor *const *daux_arg = daux_obj != Py_None ? daux_views : NULL;
    status = reference ? af_flex_attn_backward_reference(&a, &in, &grads, daux_arg)
                       : af_flex_attn_backward(&a, &in, &grads, daux_arg);
    Py_END_ALLOW_THREADS
    if (status != AF_OK) afpy_raise_status(status);
    else result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < 9; i++) afpy_tensor_release(&t[i]);
    for (int i = 0; i < AFPY_FLEX_MAX_AUX; i++) afpy_tensor_release(&daux[i]);
    Py_XDECREF(daux_seq);
    release_mod(&score);
    release_mod(&mask);
    release_blocks(&blocks);
    return result;
}
