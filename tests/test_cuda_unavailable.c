/* Calls on CUDA tensors where the CUDA backend cannot run: no library, a library that is not a backend, a backend of
 * another interface version, no driver, no GPU. Each gives AF_ERR_RUNTIME_UNAVAILABLE with a message that says what
 * is missing and how to fix it, writes nothing, and leaves CPU calls working. Also the device rule of the call
 * (every tensor on one valid device), which is checked before any backend is touched. Runs in every build: the
 * fake backends come from tests/fake_backend/, the emulated and nvcc-built ones are used when the build has them
 * (their paths are compile definitions, so valgrind-tests.sh runs this binary as ctest does). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dlfcn.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"
#include "sdpa/cuda_backend.h"
#include "test_tensor.h"

enum { B = 1, H = 2, L = 3, S = 4, E = 8 };

typedef struct {
    test_tensor q, k, v, out, lse;
    af_sdpa_args args;
} call;

static void call_setup(call *c, af_device device) {
    memset(c, 0, sizeof *c);
    test_rng rng = {7};
    const int64_t qs[4] = {B, H, L, E}, ks[4] = {B, H, S, E}, ls[3] = {B, H, L};
    assert_true(tt_alloc(&c->q, AF_F32, 4, qs, LAYOUT_CONTIGUOUS, &rng));
    assert_true(tt_alloc(&c->k, AF_F32, 4, ks, LAYOUT_CONTIGUOUS, &rng));
    assert_true(tt_alloc(&c->v, AF_F32, 4, ks, LAYOUT_CONTIGUOUS, &rng));
    assert_true(tt_alloc(&c->out, AF_F32, 4, qs, LAYOUT_CONTIGUOUS, &rng));
    assert_true(tt_alloc(&c->lse, AF_F32, 3, ls, LAYOUT_CONTIGUOUS, &rng));
    tt_fill_uniform(&c->q, &rng, 1.0);
    tt_fill_uniform(&c->k, &rng, 1.0);
    tt_fill_uniform(&c->v, &rng, 1.0);
    tt_fill_bytes(&c->out, TT_SENTINEL_BYTE);
    tt_fill_bytes(&c->lse, TT_SENTINEL_BYTE);
    c->q.view.device = c->k.view.device = c->v.view.device = c->out.view.device = c->lse.view.device = device;
    c->args.query = &c->q.view;
    c->args.key = &c->k.view;
    c->args.value = &c->v.view;
}

static void call_free(call *c) {
    tt_free(&c->q); tt_free(&c->k); tt_free(&c->v); tt_free(&c->out); tt_free(&c->lse);
}

/* The call fails with `status`, its message holds every one of `needles` (NULL-terminated), nothing was written. */
static void expect_refused(call *c, af_status status, const char *const *needles) {
    unsigned char *out_before = tt_snapshot(&c->out), *lse_before = tt_snapshot(&c->lse);
    assert_non_null(out_before);
    assert_non_null(lse_before);
    const af_status got = af_sdpa(&c->args, &c->out.view, &c->lse.view);
    const char *message = af_last_error();
    if (got != status) fail_msg("status %s (%s), expected %s", af_status_name(got), message, af_status_name(status));
    for (int i = 0; needles[i]; i++)
        if (!strstr(message, needles[i])) fail_msg("message lacks \"%s\": %s", needles[i], message);
    assert_true(tt_same_as(&c->out, out_before));
    assert_true(tt_same_as(&c->lse, lse_before));
    free(out_before);
    free(lse_before);
}

/* A CUDA call that fails, then the same call on the CPU: it runs and matches the reference. */
static void expect_unavailable_then_cpu_works(const char *const *needles) {
    call c;
    af_device cuda0 = {AF_DEVICE_CUDA, 0};
    call_setup(&c, cuda0);
    expect_refused(&c, AF_ERR_RUNTIME_UNAVAILABLE, needles);
    af_device cpu = {AF_DEVICE_CPU, 0};
    c.q.view.device = c.k.view.device = c.v.view.device = c.out.view.device = c.lse.view.device = cpu;
    assert_int_equal(af_sdpa(&c.args, &c.out.view, &c.lse.view), AF_OK);
    test_tensor ref;
    test_rng rng = {1};
    const int64_t os[4] = {B, H, L, E};
    assert_true(tt_alloc(&ref, AF_F32, 4, os, LAYOUT_CONTIGUOUS, &rng));
    assert_int_equal(af_sdpa_reference(&c.args, &ref.view, NULL), AF_OK);
    int64_t idx[4] = {0, 0, 0, 0};
    do {
        assert_true(fabs(tt_get(&c.out, idx) - tt_get(&ref, idx)) < 1e-5);
    } while (tt_next_index(4, os, idx));
    tt_free(&ref);
    call_free(&c);
}

/* ------------------------------------------------------------------ the library */

static void no_library_says_how_to_get_one(void **state) {
    setenv("ATTNFORGE_CUDA_LIBRARY", "/nonexistent/x.so", 1);
    const char *needles[] = {"/nonexistent/x.so", "could not be opened", "nvcc", "ATTNFORGE_CUDA_LIBRARY",
                             "libattnforge_cuda.so", NULL};
    expect_unavailable_then_cpu_works(needles);
}

static void library_not_on_any_path(void **state) {
    unsetenv("ATTNFORGE_CUDA_LIBRARY");
    void *installed = dlopen("libattnforge_cuda.so", RTLD_NOW | RTLD_LOCAL);
    if (installed) {   /* installed system-wide: the plain name would find it, so this case cannot happen here */
        dlclose(installed);
        skip();
    }
    const char *needles[] = {"libattnforge_cuda.so was found neither at", "nor on the library search path",
                             "install it", "ATTNFORGE_CUDA_LIBRARY", NULL};
    expect_unavailable_then_cpu_works(needles);
}

static void library_without_the_entry_is_not_a_backend(void **state) {
    setenv("ATTNFORGE_CUDA_LIBRARY", AF_TEST_NO_ENTRY_BACKEND, 1);
    const char *needles[] = {AF_TEST_NO_ENTRY_BACKEND, "does not export af_cuda_backend()",
                             "not an attnforge CUDA backend", NULL};
    expect_unavailable_then_cpu_works(needles);
}

static void backend_of_another_interface_version(void **state) {
    setenv("ATTNFORGE_CUDA_LIBRARY", AF_TEST_WRONG_ABI_BACKEND, 1);
    char wanted[64];
    snprintf(wanted, sizeof wanted, "needs version %d", AF_CUDA_BACKEND_ABI_VERSION);
    const char *needles[] = {AF_TEST_WRONG_ABI_BACKEND, "interface version 1", wanted, "built with this attnforge",
                             NULL};
    expect_unavailable_then_cpu_works(needles);
}

/* ------------------------------------------------------------------ driver and GPU (the emulation plays them) */

static void emulated_without_driver(void **state) {
#ifdef AF_TEST_EMULATED_BACKEND
    setenv("ATTNFORGE_CUDA_LIBRARY", AF_TEST_EMULATED_BACKEND, 1);
    setenv("ATTNFORGE_EMU_CUDA", "nodriver", 1);
    const char *needles[] = {"found no NVIDIA driver", "install the driver", NULL};
    expect_unavailable_then_cpu_works(needles);
    unsetenv("ATTNFORGE_EMU_CUDA");
#else
    skip();
#endif
}

static void emulated_without_gpu(void **state) {
#ifdef AF_TEST_EMULATED_BACKEND
    setenv("ATTNFORGE_CUDA_LIBRARY", AF_TEST_EMULATED_BACKEND, 1);
    setenv("ATTNFORGE_EMU_CUDA", "nodevice", 1);
    const char *needles[] = {"found no CUDA GPU", "nvidia-smi", "CUDA_VISIBLE_DEVICES", NULL};
    expect_unavailable_then_cpu_works(needles);
    unsetenv("ATTNFORGE_EMU_CUDA");
#else
    skip();
#endif
}

/* The nvcc-built backend on this machine, which has no NVIDIA driver: CUDA's own answer, through the real runtime. */
static void real_backend_without_driver(void **state) {
#ifdef AF_TEST_NVCC_BACKEND
    void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (driver) {   /* a driver is installed: this is a GPU machine, where scripts/gpu-check.sh runs the backend */
        dlclose(driver);
        skip();
    }
    setenv("ATTNFORGE_CUDA_LIBRARY", AF_TEST_NVCC_BACKEND, 1);
    const char *needles[] = {"found no NVIDIA driver", "CUDA error cudaError", "libcuda.so.1", NULL};
    expect_unavailable_then_cpu_works(needles);
#else
    skip();
#endif
}

/* ------------------------------------------------------------------ af_load_cuda_backend: what was loaded, or why not */

static void load_reports_no_library_with_an_empty_path(void **state) {
    char library[64] = "stale";
    int count = -1;
    assert_int_equal(af_load_cuda_backend(&count, library, 0), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "library_size: must be at least 1"));
    setenv("ATTNFORGE_CUDA_LIBRARY", "/nonexistent/x.so", 1);
    assert_int_equal(af_load_cuda_backend(&count, library, sizeof library), AF_ERR_RUNTIME_UNAVAILABLE);
    assert_non_null(strstr(af_last_error(), "ATTNFORGE_CUDA_LIBRARY=/nonexistent/x.so could not be opened"));
    assert_string_equal(library, "");
    assert_int_equal(count, 0);
}

/* The library loads, the driver is missing: the path of what was loaded comes back with the driver's message. */
static void load_reports_the_library_when_the_driver_is_missing(void **state) {
#ifdef AF_TEST_EMULATED_BACKEND
    setenv("ATTNFORGE_CUDA_LIBRARY", AF_TEST_EMULATED_BACKEND, 1);
    setenv("ATTNFORGE_EMU_CUDA", "nodriver", 1);
    char library[PATH_MAX], tiny[8];
    int count = -1;
    assert_int_equal(af_load_cuda_backend(&count, library, sizeof library), AF_ERR_RUNTIME_UNAVAILABLE);
    assert_non_null(strstr(af_last_error(), "found no NVIDIA driver"));
    assert_string_equal(library, AF_TEST_EMULATED_BACKEND);
    assert_int_equal(count, 0);
    assert_int_equal(af_load_cuda_backend(NULL, tiny, sizeof tiny), AF_ERR_RUNTIME_UNAVAILABLE);
    assert_memory_equal(tiny, AF_TEST_EMULATED_BACKEND, sizeof tiny - 1);   /* truncated to fit, terminated */
    assert_int_equal(tiny[sizeof tiny - 1], '\0');
    unsetenv("ATTNFORGE_EMU_CUDA");
#else
    skip();
#endif
}

/* Last of all: once a backend is usable it stays loaded for the process. */
static void load_reports_the_library_and_its_devices(void **state) {
#ifdef AF_TEST_EMULATED_BACKEND
    setenv("ATTNFORGE_CUDA_LIBRARY", AF_TEST_EMULATED_BACKEND, 1);
    char library[PATH_MAX];
    int count = 0;
    assert_int_equal(af_load_cuda_backend(&count, library, sizeof library), AF_OK);
    assert_string_equal(library, AF_TEST_EMULATED_BACKEND);
    assert_true(count >= 1);
    setenv("ATTNFORGE_CUDA_LIBRARY", "/nonexistent/x.so", 1);   /* kept for the process: the variable no longer matters */
    assert_int_equal(af_load_cuda_backend(NULL, library, sizeof library), AF_OK);
    assert_string_equal(library, AF_TEST_EMULATED_BACKEND);
#else
    skip();
#endif
}

/* ------------------------------------------------------------------ the device rule (before any backend) */

static void tensors_on_two_devices_are_named(void **state) {
    call c;
    af_device cuda0 = {AF_DEVICE_CUDA, 0}, cuda1 = {AF_DEVICE_CUDA, 1}, cpu = {AF_DEVICE_CPU, 0};
    call_setup(&c, cuda0);
    c.k.view.device = cuda1;
    const char *key[] = {"key: on cuda:1 but query is on cuda:0", NULL};
    expect_refused(&c, AF_ERR_INVALID_ARGUMENT, key);
    c.k.view.device = cuda0;
    c.out.view.device = cpu;
    const char *out[] = {"out: on cpu but query is on cuda:0", NULL};
    expect_refused(&c, AF_ERR_INVALID_ARGUMENT, out);
    c.out.view.device = cuda0;
    c.lse.view.device = cuda1;
    const char *lse[] = {"lse: on cuda:1 but query is on cuda:0", NULL};
    expect_refused(&c, AF_ERR_INVALID_ARGUMENT, lse);
    call_free(&c);

    call_setup(&c, cpu);   /* a CPU call with one CUDA tensor */
    c.v.view.device = cuda0;
    const char *value[] = {"value: on cuda:0 but query is on cpu", NULL};
    expect_refused(&c, AF_ERR_INVALID_ARGUMENT, value);
    c.v.view.device = cpu;
    test_tensor mask;
    test_rng rng = {3};
    const int64_t ms[2] = {L, S};
    assert_true(tt_alloc(&mask, AF_BOOL, 2, ms, LAYOUT_CONTIGUOUS, &rng));
    tt_fill_bytes(&mask, 1);
    mask.view.device = cuda1;
    c.args.attn_mask = &mask.view;
    const char *attn_mask[] = {"attn_mask: on cuda:1 but query is on cpu", NULL};
    expect_refused(&c, AF_ERR_INVALID_ARGUMENT, attn_mask);
    mask.view.device = cpu;
    assert_int_equal(af_sdpa(&c.args, &c.out.view, &c.lse.view), AF_OK);   /* the same call, all on the CPU */
    tt_free(&mask);
    call_free(&c);
}

static void invalid_devices_are_refused(void **state) {
    call c;
    af_device cpu1 = {AF_DEVICE_CPU, 1}, cuda_negative = {AF_DEVICE_CUDA, -1}, unknown = {(af_device_type)7, 0};
    call_setup(&c, cpu1);
    const char *cpu[] = {"query: device cpu:1; the CPU's index must be 0", NULL};
    expect_refused(&c, AF_ERR_INVALID_ARGUMENT, cpu);
    call_free(&c);
    call_setup(&c, cuda_negative);
    const char *negative[] = {"query: device cuda:-1; a CUDA device index must be >= 0", NULL};
    expect_refused(&c, AF_ERR_INVALID_ARGUMENT, negative);
    call_free(&c);
    call_setup(&c, unknown);
    const char *type[] = {"query: unknown device type 7", NULL};
    expect_refused(&c, AF_ERR_INVALID_ARGUMENT, type);
    call_free(&c);
}

static void reference_refuses_cuda_tensors(void **state) {
    call c;
    af_device cuda0 = {AF_DEVICE_CUDA, 0};
    call_setup(&c, cuda0);
    assert_int_equal(af_sdpa_reference(&c.args, &c.out.view, &c.lse.view), AF_ERR_UNSUPPORTED);
    assert_non_null(strstr(af_last_error(), "the reference reads host memory"));
    assert_int_equal(((unsigned char *)c.out.view.data)[0], TT_SENTINEL_BYTE);
    call_free(&c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tensors_on_two_devices_are_named),
        cmocka_unit_test(invalid_devices_are_refused),
        cmocka_unit_test(reference_refuses_cuda_tensors),
        cmocka_unit_test(no_library_says_how_to_get_one),
        cmocka_unit_test(library_not_on_any_path),
        cmocka_unit_test(library_without_the_entry_is_not_a_backend),
        cmocka_unit_test(backend_of_another_interface_version),
        cmocka_unit_test(emulated_without_driver),
        cmocka_unit_test(emulated_without_gpu),
        cmocka_unit_test(real_backend_without_driver),
        cmocka_unit_test(load_reports_no_library_with_an_empty_path),
        cmocka_unit_test(load_reports_the_library_when_the_driver_is_missing),
        cmocka_unit_test(load_reports_the_library_and_its_devices),   /* last: it leaves the backend loaded */
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
