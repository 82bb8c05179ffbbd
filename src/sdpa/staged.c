/* Staged outputs (staged.h): each copy keeps its tensor's strides over a buffer of its extent, so the checked
 * problem's pointer into the tensor moves into the copy as it is, and only the tensor's elements go back. */
#include "sdpa/staged.h"

#include <string.h>

#include "core/alloc.h"
#include "core/log.h"
#include "core/status.h"
#include "flex/bounds.h"

#define STAGED_MAX 32

typedef struct {
    const af_tensor *user[STAGED_MAX];
    af_tensor copy[STAGED_MAX];
    int n;
} staged;

/* A copy of t (NULL: none) over a buffer of its extent; *moved (the problem's pointer to t's data, or NULL) goes to
 * the copy's. *copy_out, when asked, is the copy's view. */
static af_status stage(staged *s, const af_tensor *t, char **moved, af_tensor **copy_out, const char *what) {
    if (!t) return AF_OK;
    if (s->n == STAGED_MAX)
        return af_fail(AF_ERR_UNSUPPORTED, "%s: more than %d outputs to stage (a LOAD not proven inside its tensor)",
                       what, STAGED_MAX);
    int64_t last = 0;   /* checked by the call: non-negative strides, no overflow */
    for (int d = 0; d < t->ndim; d++) last += t->shape[d] > 0 ? (t->shape[d] - 1) * t->strides[d] : 0;
    const size_t bytes = (size_t)(last + 1) * af_dtype_size(t->dtype);
    void *mem = af_alloc(bytes);
    if (!mem) return af_fail(AF_ERR_NO_MEMORY, "out of memory: a staged copy of %s (%zu bytes)", what, bytes);
    s->user[s->n] = t;
    s->copy[s->n] = *t;
    s->copy[s->n].data = mem;
    if (moved && *moved) *moved = mem;
    if (copy_out) *copy_out = &s->copy[s->n];
    s->n++;
    return AF_OK;
}

/* The elements of view `to` from the same places of `from` (equal strides), dims from d on. */
static void copy_view(const af_tensor *to, const af_tensor *from, int d, int64_t at, size_t elem) {
    if (d == to->ndim) {
        memcpy((char *)to->data + at * (int64_t)elem, (const char *)from->data + at * (int64_t)elem, elem);
        return;
    }
    for (int64_t i = 0; i < to->shape[d]; i++) copy_view(to, from, d + 1, at + i * to->strides[d], elem);
}

/* On success, every copy into its caller's tensor; the buffers freed either way. */
static af_status finish(staged *s, af_status st) {
    for (int k = 0; k < s->n; k++) {
        if (st == AF_OK) copy_view(s->user[k], &s->copy[k], 0, 0, af_dtype_size(s->copy[k].dtype));
        af_free(s->copy[k].data);
    }
    return st;
}

/* Whether the call may read outside a captured tensor (not proven otherwise). */
static bool must_stage(const af_problem *p, const af_mods *mods) {
    if (!p->mods || af_mods_loads_inside(mods, p->B, p->Hq, p->L, p->S)) return false;
    af_log(AF_LOG_DEBUG, "mods: a LOAD not proven inside its tensor: the outputs are staged (copied on success)");
    return true;
}

af_status af_mods_forward(af_problem *p, af_mods *mods, const af_tensor *out, const af_tensor *lse,
                          af_status (*forward)(const af_problem *)) {
    staged s = {.n = 0};
    af_status st = AF_OK;
    if (must_stage(p, mods)) {
        st = stage(&s, out, &p->out, NULL, "out");
        char *l = (char *)p->lse;
        if (st == AF_OK) st = stage(&s, lse, &l, NULL, "lse");
        p->lse = (float *)l;
    }
    if (st == AF_OK) st = forward(p);
    if (st == AF_OK) st = af_mods_status(mods);
    return finish(&s, st);
}

af_status af_mods_backward(af_backward_problem *bp, af_mods *mods, const af_gradients *grads,
                           af_status (*backward)(const af_backward_problem *)) {
    staged s = {.n = 0};
    af_status st = AF_OK;
    af_tensor **daux = NULL;
    if (must_stage(&bp->f, mods)) {
        st = stage(&s, grads->dq, &bp->dq, NULL, "dq");
        if (st == AF_OK) st = stage(&s, grads->dk, &bp->dk, NULL, "dk");
        if (st == AF_OK) st = stage(&s, grads->dv, &bp->dv, NULL, "dv");
        if (st == AF_OK) st = stage(&s, grads->dsink, &bp->dsink, NULL, "dsink");
        const int n_aux = bp->daux ? mods->score.n_aux : 0;
        if (st == AF_OK && n_aux > 0 && !(daux = af_alloc(sizeof(af_tensor *) * (size_t)n_aux)))
            st = af_fail(AF_ERR_NO_MEMORY, "out of memory: daux's staged copies");
        for (int i = 0; i < n_aux && st == AF_OK; i++) {
            daux[i] = NULL;
            st = stage(&s, bp->daux[i], NULL, &daux[i], "daux");
        }
        if (daux) bp->daux = daux;
    }
    if (st == AF_OK) st = backward(bp);
    if (st == AF_OK) st = af_mods_status(mods);
    af_free(daux);
    return finish(&s, st);
}
