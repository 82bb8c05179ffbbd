#include "emu_case.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool emu_to_device(const test_tensor *t, emu_device_tensor *d) {
    memset(d, 0, sizeof *d);
    d->view = t->view;
    if (!t->memory) return true;
    if (cudaMalloc((void **)&d->memory, t->bytes) != cudaSuccess) return false;
    if (cudaMemcpy(d->memory, t->memory, t->bytes, cudaMemcpyHostToDevice) != cudaSuccess) return false;
    d->view.data = d->memory + ((unsigned char *)t->view.data - t->memory);
    return true;
}

bool emu_from_device(test_tensor *t, const emu_device_tensor *d) {
    return !t->memory || cudaMemcpy(t->memory, d->memory, t->bytes, cudaMemcpyDeviceToHost) == cudaSuccess;
}

bool emu_device_unchanged(const test_tensor *t, const emu_device_tensor *d) {
    return !t->memory || memcmp(t->memory, d->memory, t->bytes) == 0;   /* emulated device memory is host memory */
}

bool emu_edit_case(case_tensors *t, emu_case_edit edit) {
    if (!edit) return true;
    edit(t);
    return case_rerun_reference(t);
}

/* `launch` on the checked problem, the stream synchronised, out and lse copied back to the host. */
static bool launch_and_copy_back(const af_problem *p, emu_launch_fn launch, void *context, test_tensor *out,
                                 const emu_device_tensor *d_out, test_tensor *lse, const emu_device_tensor *d_lse,
                                 char *why, size_t size) {
    cudaError_t err = launch(p, context);
    if (err != cudaSuccess) {
        snprintf(why, size, "the launch: %s", cudaGetErrorString(err));
        return false;
    }
    if ((err = cudaStreamSynchronize(NULL)) != cudaSuccess) {
        snprintf(why, size, "the kernel (cudaStreamSynchronize): %s", cudaGetErrorString(err));
        return false;
    }
    if (!(emu_from_device(out, d_out) && emu_from_device(lse, d_lse))) {
        snprintf(why, size, "copy back failed");
        return false;
    }
    return true;
}

/* What the launch left in the host copies: the `inputs` (named in `names`) as they were, out/lse bytes outside the
 * views untouched (the whole lse buffer when none was asked for). */
static bool writes_stayed_in_views(test_tensor *const *host, const emu_device_tensor *d, int inputs, const char *names,
                                   const test_tensor *out, const test_tensor *lse, bool with_lse, char *why,
                                   size_t size) {
    for (int i = 0; i < inputs; i++)
        if (!emu_device_unchanged(host[i], &d[i])) {
            snprintf(why, size, "an input (#%d of %s) changed", i, names);
            return false;
        }
    if (!tt_outside_view_is(out, TT_SENTINEL_BYTE)) {
        snprintf(why, size, "wrote outside out's view");
        return false;
    }
    if (!tt_outside_view_is(lse, TT_SENTINEL_BYTE)) {
        snprintf(why, size, with_lse ? "wrote outside lse's view" : "wrote an lse nobody asked for");
        return false;
    }
    return true;
}

bool emu_run_case(case_tensors *t, emu_launch_fn launch, void *context, char *why, size_t size) {
    tt_fill_bytes(&t->out, TT_SENTINEL_BYTE);
    tt_fill_bytes(&t->lse, TT_SENTINEL_BYTE);
    test_tensor *const host[6] = {&t->q, &t->k, &t->v, &t->mask, &t->out, &t->lse};
    emu_device_tensor d[6];
    bool ok = true;
    for (int i = 0; i < 6; i++) ok = emu_to_device(host[i], &d[i]) && ok;
    if (!ok) snprintf(why, size, "device allocation or copy failed");
    af_sdpa_args args = t->args;
    args.query = &d[0].view;
    args.key = &d[1].view;
    args.value = &d[2].view;
    args.attn_mask = t->args.attn_mask ? &d[3].view : NULL;
    af_problem p;
    if (ok && af_sdpa_check(&args, &d[4].view, t->c.with_lse ? &d[5].view : NULL, &p) != AF_OK) {
        snprintf(why, size, "af_sdpa_check: %s", af_last_error());
        ok = false;
    }
    if (ok) ok = launch_and_copy_back(&p, launch, context, &t->out, &d[4], &t->lse, &d[5], why, size);
    if (ok) ok = writes_stayed_in_views(host, d, 4, "q, k, v, mask", &t->out, &t->lse, t->c.with_lse, why, size);
    if (ok) ok = case_matches_reference(t, NULL, why, size);
    for (int i = 0; i < 6; i++) cudaFree(d[i].memory);
    return ok;
}

void emu_shrink_case(sdpa_case *c, double work_budget) {
    while ((double)c->B * c->Hq * c->L * c->S * (c->E + c->Ev) > work_budget) {
        if (c->B > 1) c->B--;
        else if (c->L > c->S && c->L > 1) c->L = c->L * 3 / 4;
        else if (c->S > 1) c->S = c->S * 3 / 4;
        else break;
    }
}

int emu_run_suite(const char *group, const struct CMUnitTest *fixed, int fixed_count, emu_make_item_fn make,
                  size_t item_size, CMUnitTestFunction random_test, int default_count, uint64_t default_seed) {
    const int n = case_suite_count(default_count);
    const uint64_t seed = case_suite_seed(default_seed);
    unsigned char *items = calloc((size_t)n, item_size);
    struct CMUnitTest *tests = calloc((size_t)(n + fixed_count), sizeof *tests);
    char (*names)[48] = calloc((size_t)n, sizeof *names);
    int failures = 1;
    if (items && tests && names) {
        for (int i = 0; i < fixed_count; i++) tests[i] = fixed[i];
        for (int i = 0; i < n; i++) {
            make(seed, i, items + (size_t)i * item_size);
            snprintf(names[i], sizeof names[i], "random_case_%03d", i);
            tests[fixed_count + i] = (struct CMUnitTest){
                .name = names[i], .test_func = random_test, .initial_state = items + (size_t)i * item_size};
        }
        failures = _cmocka_run_group_tests(group, tests, (size_t)(n + fixed_count), NULL, NULL);
    }
    free(items);
    free(tests);
    free(names);
    return failures;
}

const char *emu_layout_name(aligned_layout layout) {
    static const char *const names[ALIGNED_COUNT] = {"contiguous", "swapped", "padded"};
    return layout >= 0 && layout < ALIGNED_COUNT ? names[layout] : "?";
}

bool emu_relayout(test_tensor *t, aligned_layout layout) {
    const int nd = t->view.ndim;
    const int64_t *shape = t->view.shape;
    int order[4] = {0, 1, 2, 3};
    if (layout == ALIGNED_SWAPPED) {
        order[nd - 3] = nd - 2;
        order[nd - 2] = nd - 3;
    }
    const int64_t row = (shape[nd - 1] + 7) / 8 * 8;
    int64_t pad[4] = {0, 0, 0, 0};
    pad[nd - 1] = row - shape[nd - 1];
    int64_t offset = 0;
    if (layout == ALIGNED_PADDED) {
        for (int d = 0; d < nd - 1; d++) pad[d] = 1 + d % 2;
        pad[nd - 1] += 8;
        offset = 8;
    }
    test_tensor moved;
    if (!tt_alloc_ordered(&moved, t->view.dtype, nd, shape, order, pad, 1, offset)) return false;
    int64_t idx[4] = {0};
    if (tt_numel(t) > 0) do tt_set(&moved, idx, tt_get(t, idx));
        while (tt_next_index(nd, shape, idx));
    tt_free(t);
    *t = moved;   /* args point at t->view: they follow */
    return true;
}

bool emu_relayout_qkv(test_tensor *q, test_tensor *k, test_tensor *v, aligned_layout layout) {
    return emu_relayout(q, layout) && emu_relayout(k, (aligned_layout)((layout + 1) % ALIGNED_COUNT)) &&
           emu_relayout(v, (aligned_layout)((layout + 2) % ALIGNED_COUNT));
}

enum { FLASH_DEVICE_INPUTS = 8 };

bool emu_run_flash(flash_tensors *t, emu_launch_fn launch, void *context, const emu_flash_hooks *hooks, char *why,
                   size_t size) {
    static const emu_flash_hooks none = {NULL, NULL, NULL};
    if (!hooks) hooks = &none;
    test_tensor *host[FLASH_DEVICE_INPUTS] = {&t->q, &t->k, &t->v, &t->sink, &t->cu_q, &t->cu_k, &t->seqused_k,
                                              &t->page_table};
    af_flash_args args = t->args;
    const af_tensor **arg[FLASH_DEVICE_INPUTS] = {&args.query, &args.key, &args.value, &args.learnable_sink,
                                                  &args.cu_seqlens_q, &args.cu_seqlens_k, &args.seqused_k,
                                                  &args.page_table};
    tt_fill_bytes(&t->out, TT_SENTINEL_BYTE);
    tt_fill_bytes(&t->lse, TT_SENTINEL_BYTE);
    emu_device_tensor in[FLASH_DEVICE_INPUTS], out, lse;
    bool ok = true;
    for (int i = 0; i < FLASH_DEVICE_INPUTS; i++) {
        ok = emu_to_device(host[i], &in[i]) && ok;
        if (*arg[i]) *arg[i] = &in[i].view;
    }
    ok = emu_to_device(&t->out, &out) && emu_to_device(&t->lse, &lse) && ok;
    if (!ok) snprintf(why, size, "device allocation or copy failed");
    af_problem p;
    if (ok && af_flash_check(&args, &out.view, t->c.with_lse ? &lse.view : NULL, &p) != AF_OK) {
        snprintf(why, size, "af_flash_check: %s", af_last_error());
        ok = false;
    }
    if (ok && hooks->after_check) ok = hooks->after_check(t, in, hooks->context, why, size);
    if (ok) ok = launch_and_copy_back(&p, launch, context, &t->out, &out, &t->lse, &lse, why, size);
    if (ok)
        ok = writes_stayed_in_views(host, in, FLASH_DEVICE_INPUTS, "q, k, v, sink, cu_q, cu_k, seqused_k, page_table",
                                    &t->out, &t->lse, t->c.with_lse, why, size);
    if (ok && hooks->before_compare) ok = hooks->before_compare(t, hooks->context, why, size);
    if (ok) ok = flash_case_matches(t, why, size);
    for (int i = 0; i < FLASH_DEVICE_INPUTS; i++) cudaFree(in[i].memory);
    cudaFree(out.memory);
    cudaFree(lse.memory);
    return ok;
}
