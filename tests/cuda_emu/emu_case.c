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

/* What the launch left in the host copies: inputs as they were, out/lse bytes outside the views untouched. */
static bool writes_stayed_in_views(const case_tensors *t, test_tensor *const host[6], const emu_device_tensor d[6],
                                   char *why, size_t size) {
    for (int i = 0; i < 4; i++)
        if (!emu_device_unchanged(host[i], &d[i])) {
            snprintf(why, size, "an input (#%d of q, k, v, mask) changed", i);
            return false;
        }
    if (!tt_outside_view_is(&t->out, TT_SENTINEL_BYTE)) {
        snprintf(why, size, "wrote outside out's view");
        return false;
    }
    if (!tt_outside_view_is(&t->lse, TT_SENTINEL_BYTE)) {   /* the whole lse buffer when none was asked for */
        snprintf(why, size, t->c.with_lse ? "wrote outside lse's view" : "wrote an lse nobody asked for");
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
    cudaError_t err = cudaSuccess;
    if (ok && (err = launch(&p, context)) != cudaSuccess) {
        snprintf(why, size, "the launch: %s", cudaGetErrorString(err));
        ok = false;
    }
    if (ok && (err = cudaStreamSynchronize(NULL)) != cudaSuccess) {
        snprintf(why, size, "the kernel (cudaStreamSynchronize): %s", cudaGetErrorString(err));
        ok = false;
    }
    if (ok && !(emu_from_device(&t->out, &d[4]) && emu_from_device(&t->lse, &d[5]))) {
        snprintf(why, size, "copy back failed");
        ok = false;
    }
    if (ok) ok = writes_stayed_in_views(t, host, d, why, size);
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
