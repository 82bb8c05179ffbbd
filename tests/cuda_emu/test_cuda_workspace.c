/* Scratch from the caller's allocator (af_sdpa_args.workspace / af_flash_args.workspace, issue 29 item 3): the
 * backend asks it, once a call, for exactly the tensor-core path's scratch on the call's device and stream, uses that
 * memory (the copy of q lands in it; the backend's pool makes no allocation), hands it back on the same stream, and
 * refuses what the allocator cannot give (NULL, host memory, a misaligned pointer) with an error naming the
 * workspace and nothing written to out. Two emulated devices (ATTNFORGE_EMU_DEVICE_COUNT=2): the calls run on
 * cuda:1, so the device the allocator is asked for is not the default one. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"
#include "case_gen.h"
#include "cuda_emulated.h"
#include "emu_backend_tensor.h"
#include "flash_case.h"
#include "sdpa/cuda_backend.h"
#include "test_tensor.h"

enum { DEVICE = 1 };

static const af_cuda_backend_ops *ops;
typedef void (*pool_stats_fn)(long *pools, long *allocations, unsigned long long *threshold);
static pool_stats_fn pool_stats;
static cudaStream_t stream;   /* a stream of the backend's emulation, the calls' */

/* ------------------------------------------------------------------ a test allocator */

typedef enum { GIVE_DEVICE_MEMORY, GIVE_NULL, GIVE_HOST_MEMORY, GIVE_MISALIGNED } allocator_mode;

typedef struct {
    allocator_mode mode;
    int allocs, frees;
    size_t bytes, freed_bytes;
    int device, freed_device;
    void *stream, *freed_stream;
    void *given, *freed;     /* what alloc returned, what free received */
    void *memory;            /* the allocation behind `given`; released by the test, after it read it */
    void *host;              /* GIVE_HOST_MEMORY's */
} test_allocator;

static void *give_out(size_t bytes, int device, void *call_stream, void *user) {
    test_allocator *a = (test_allocator *)user;
    char err[256];
    a->allocs++;
    a->bytes = bytes;
    a->device = device;
    a->stream = call_stream;
    switch (a->mode) {
    case GIVE_NULL: return NULL;
    case GIVE_HOST_MEMORY:
        a->host = aligned_alloc(256, (bytes + 255) / 256 * 256);
        return a->given = a->host;
    case GIVE_DEVICE_MEMORY:
    case GIVE_MISALIGNED:
        if (ops->device_alloc(device, bytes + 256, &a->memory, err, sizeof err) != AF_OK) return NULL;
        memset(a->memory, 0xA5, bytes + 256);   /* emulated device memory is host memory */
        return a->given = (char *)a->memory + (a->mode == GIVE_MISALIGNED ? 16 : 0);
    }
    return NULL;
}

/* Stream-ordered, like PyTorch's caching allocator: the memory stays until the test has read it. */
static void give_back(void *ptr, size_t bytes, int device, void *call_stream, void *user) {
    test_allocator *a = (test_allocator *)user;
    a->frees++;
    a->freed = ptr;
    a->freed_bytes = bytes;
    a->freed_device = device;
    a->freed_stream = call_stream;
}

static void test_allocator_release(test_allocator *a) {
    char err[256];
    if (a->memory && ops->device_free(DEVICE, a->memory, err, sizeof err) != AF_OK) fail_msg("device_free: %s", err);
    free(a->host);
    a->memory = a->host = NULL;
}

/* ------------------------------------------------------------------ an SDPA case on cuda:1 */

typedef struct {
    case_tensors t;
    device_tensor q, k, v, out, lse;
    af_sdpa_args args;
} device_case;

/* f16, E = Ev = 64, q sliced (copied: 1·2·24 rows of 64 f16 = 6144 bytes of scratch), L and S too small to split. */
static void device_case_build(device_case *d, tensor_layout q_layout) {
    sdpa_case c = case_default(1, 2, 2, 24, 40, 64, 64);
    c.dtype = AF_F16;
    c.q_layout = q_layout;
    c.seed = 3;
    assert_true(case_build(&c, &d->t));
    tt_fill_bytes(&d->t.out, TT_SENTINEL_BYTE);
    tt_fill_bytes(&d->t.lse, TT_SENTINEL_BYTE);
    backend_to_device_on(ops, DEVICE, &d->q, &d->t.q);
    backend_to_device_on(ops, DEVICE, &d->k, &d->t.k);
    backend_to_device_on(ops, DEVICE, &d->v, &d->t.v);
    backend_to_device_on(ops, DEVICE, &d->out, &d->t.out);
    backend_to_device_on(ops, DEVICE, &d->lse, &d->t.lse);
    d->args = d->t.args;
    d->args.query = &d->q.view;
    d->args.key = &d->k.view;
    d->args.value = &d->v.view;
    d->args.stream = stream;
}

static void device_case_free(device_case *d) {
    backend_device_free(ops, &d->q);
    backend_device_free(ops, &d->k);
    backend_device_free(ops, &d->v);
    backend_device_free(ops, &d->out);
    backend_device_free(ops, &d->lse);
    case_free(&d->t);
}

static void synchronize(void) {
    char err[256];
    if (ops->synchronize(DEVICE, stream, err, sizeof err) != AF_OK) fail_msg("synchronize: %s", err);
}

static long pooled_allocations(void) {
    long pools, allocations;
    unsigned long long threshold;
    pool_stats(&pools, &allocations, &threshold);
    return allocations;
}

/* ------------------------------------------------------------------ the tests */

static void the_callers_allocator_serves_the_scratch(void **state) {
    device_case d;
    device_case_build(&d, LAYOUT_SLICED);
    test_allocator a = {.mode = GIVE_DEVICE_MEMORY};
    const af_cuda_allocator allocator = {give_out, give_back, &a};
    d.args.workspace = &allocator;
    const long pooled = pooled_allocations();
    const af_status st = af_sdpa(&d.args, &d.out.view, &d.lse.view);
    if (st != AF_OK) fail_msg("af_sdpa: %s", af_last_error());
    synchronize();
    assert_int_equal(a.allocs, 1);
    assert_int_equal(a.bytes, 1 * 2 * 24 * 64 * 2);   /* the copy of q, no split-KV partials */
    assert_int_equal(a.device, DEVICE);
    assert_ptr_equal(a.stream, stream);
    assert_int_equal(a.frees, 1);
    assert_ptr_equal(a.freed, a.given);
    assert_int_equal(a.freed_bytes, a.bytes);
    assert_int_equal(a.freed_device, DEVICE);
    assert_ptr_equal(a.freed_stream, stream);
    assert_int_equal(pooled_allocations(), pooled);   /* the backend's pool was not asked */
    /* the copy of q, contiguous, is what the workspace holds */
    const uint16_t *copy = (const uint16_t *)a.given;
    int64_t idx[4] = {0, 0, 0, 0}, i = 0;
    do {
        const double want = tt_get(&d.t.q, idx), got = af_f16_to_float(copy[i++]);
        if (got != want) fail_msg("workspace element %lld: %g, q has %g", (long long)(i - 1), got, want);
    } while (tt_next_index(4, d.t.q.view.shape, idx));
    backend_to_host(ops, &d.t.out, &d.out);
    backend_to_host(ops, &d.t.lse, &d.lse);
    char why[512] = "";
    if (!case_matches_reference(&d.t, NULL, why, sizeof why)) fail_msg("%s", why);
    test_allocator_release(&a);
    device_case_free(&d);
}

/* The CUDA-core path and a tensor-core call that copies nothing need no scratch: the allocator is not asked. */
static void a_call_without_scratch_asks_nothing(void **state) {
    device_case d;
    device_case_build(&d, LAYOUT_CONTIGUOUS);
    test_allocator a = {.mode = GIVE_DEVICE_MEMORY};
    const af_cuda_allocator allocator = {give_out, give_back, &a};
    d.args.workspace = &allocator;
    if (af_sdpa(&d.args, &d.out.view, &d.lse.view) != AF_OK) fail_msg("af_sdpa: %s", af_last_error());
    synchronize();
    assert_int_equal(a.allocs, 0);
    assert_int_equal(a.frees, 0);
    device_case_free(&d);
}

/* A refused workspace: the status and the message's start, free called once for what alloc gave (never for NULL),
 * and out on the device still all sentinel. */
static void expect_refused(allocator_mode mode, af_status status, const char *needle) {
    device_case d;
    device_case_build(&d, LAYOUT_SLICED);
    test_allocator a = {.mode = mode};
    const af_cuda_allocator allocator = {give_out, give_back, &a};
    d.args.workspace = &allocator;
    const af_status st = af_sdpa(&d.args, &d.out.view, &d.lse.view);
    if (st != status || !strstr(af_last_error(), needle))
        fail_msg("got %s \"%s\", expected %s with \"%s\"", af_status_name(st), af_last_error(), af_status_name(status),
                 needle);
    synchronize();
    assert_int_equal(a.allocs, 1);
    assert_int_equal(a.frees, mode == GIVE_NULL ? 0 : 1);
    if (mode != GIVE_NULL) assert_ptr_equal(a.freed, a.given);
    unsigned char *before = tt_snapshot(&d.t.out);
    backend_to_host(ops, &d.t.out, &d.out);
    assert_true(tt_same_as(&d.t.out, before));   /* nothing written to out */
    free(before);
    test_allocator_release(&a);
    device_case_free(&d);
}

static void an_allocator_returning_null_is_named(void **state) {
    expect_refused(GIVE_NULL, AF_ERR_NO_MEMORY, "workspace: the caller's allocator (af_cuda_allocator.alloc) returned "
                                                "NULL for 6144 bytes on cuda:1");
}

static void host_memory_as_workspace_is_refused(void **state) {
    expect_refused(GIVE_HOST_MEMORY, AF_ERR_INVALID_ARGUMENT, "which is not memory of cuda:1 (it is host memory)");
}

static void a_misaligned_workspace_is_refused(void **state) {
    expect_refused(GIVE_MISALIGNED, AF_ERR_INVALID_ARGUMENT, "which is not 256-byte aligned");
}

/* A cuda plan's infer hands the call's allocator on (the path the Python operators take with a plan). */
static void provider_infer_passes_the_allocator_on(void **state) {
    static const char plan[] = "{\"type\": \"FlashAttention4KernelProvider\", \"version\": 1, \"qkv_source\": "
                               "\"positional_qkv\", \"flash_kwargs\": {\"causal\": false}, \"copy_free_layout\": false, "
                               "\"backend\": \"cuda\"}";
    af_provider *provider = NULL;
    if (af_provider_from_json(plan, strlen(plan), &provider) != AF_OK) fail_msg("plan: %s", af_last_error());
    device_case d;
    device_case_build(&d, LAYOUT_SLICED);
    test_allocator a = {.mode = GIVE_DEVICE_MEMORY};
    const af_cuda_allocator allocator = {give_out, give_back, &a};
    d.args.workspace = &allocator;
    if (af_provider_infer(provider, &d.args, AF_QKV_POSITIONAL, &d.out.view, &d.lse.view) != AF_OK)
        fail_msg("af_provider_infer: %s", af_last_error());
    synchronize();
    assert_int_equal(a.allocs, 1);
    assert_int_equal(a.frees, 1);
    assert_int_equal(a.device, DEVICE);
    backend_to_host(ops, &d.t.out, &d.out);
    backend_to_host(ops, &d.t.lse, &d.lse);
    char why[512] = "";
    if (!case_matches_reference(&d.t, NULL, why, sizeof why)) fail_msg("%s", why);
    test_allocator_release(&a);
    device_case_free(&d);
    af_provider_free(provider);
}

/* af_flash_attn takes the same allocator (af_flash_args.workspace). */
static void flash_attn_uses_the_callers_allocator(void **state) {
    flash_case c = flash_case_default(1, 2, 2, 24, 40, 64, 64);
    c.dtype = AF_F16;
    c.q_layout = LAYOUT_SLICED;
    flash_tensors t;
    assert_true(flash_case_build(&c, &t));
    tt_fill_bytes(&t.out, TT_SENTINEL_BYTE);
    tt_fill_bytes(&t.lse, TT_SENTINEL_BYTE);
    device_tensor q, k, v, out, lse;
    backend_to_device_on(ops, DEVICE, &q, &t.q);
    backend_to_device_on(ops, DEVICE, &k, &t.k);
    backend_to_device_on(ops, DEVICE, &v, &t.v);
    backend_to_device_on(ops, DEVICE, &out, &t.out);
    backend_to_device_on(ops, DEVICE, &lse, &t.lse);
    test_allocator a = {.mode = GIVE_DEVICE_MEMORY};
    const af_cuda_allocator allocator = {give_out, give_back, &a};
    af_flash_args args = t.args;
    args.query = &q.view;
    args.key = &k.view;
    args.value = &v.view;
    args.stream = stream;
    args.workspace = &allocator;
    const long pooled = pooled_allocations();
    if (af_flash_attn(&args, &out.view, &lse.view) != AF_OK) fail_msg("af_flash_attn: %s", af_last_error());
    synchronize();
    assert_int_equal(a.allocs, 1);
    assert_int_equal(a.frees, 1);
    assert_int_equal(a.device, DEVICE);
    assert_ptr_equal(a.stream, stream);
    assert_int_equal(pooled_allocations(), pooled);
    backend_to_host(ops, &t.out, &out);
    backend_to_host(ops, &t.lse, &lse);
    char why[512] = "";
    if (!flash_case_matches(&t, why, sizeof why)) fail_msg("%s", why);
    test_allocator_release(&a);
    backend_device_free(ops, &q);
    backend_device_free(ops, &k);
    backend_device_free(ops, &v);
    backend_device_free(ops, &out);
    backend_device_free(ops, &lse);
    flash_case_free(&t);
}

static int setup(void **state) {
    if (!getenv("ATTNFORGE_CUDA_LIBRARY")) setenv("ATTNFORGE_CUDA_LIBRARY", AF_TEST_EMULATED_BACKEND, 1);
    unsetenv("ATTNFORGE_EMU_CUDA");
    setenv("ATTNFORGE_EMU_DEVICE_COUNT", "2", 1);
    if (af_cuda_backend_load(&ops) != AF_OK) {
        fprintf(stderr, "the emulated CUDA backend did not load: %s\n", af_last_error());
        return -1;
    }
    void *backend = dlopen(getenv("ATTNFORGE_CUDA_LIBRARY"), RTLD_NOW | RTLD_NOLOAD);
    if (!backend) return -1;
    pool_stats = (pool_stats_fn)dlsym(backend, "af_emu_pool_stats");
    cudaError_t (*stream_create)(cudaStream_t *) = (cudaError_t(*)(cudaStream_t *))dlsym(backend, "cudaStreamCreate");
    dlclose(backend);   /* still loaded: libattnforge holds it */
    if (!pool_stats || !stream_create || stream_create(&stream) != cudaSuccess) return -1;
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(the_callers_allocator_serves_the_scratch),
        cmocka_unit_test(a_call_without_scratch_asks_nothing),
        cmocka_unit_test(an_allocator_returning_null_is_named),
        cmocka_unit_test(host_memory_as_workspace_is_refused),
        cmocka_unit_test(a_misaligned_workspace_is_refused),
        cmocka_unit_test(flash_attn_uses_the_callers_allocator),
        cmocka_unit_test(provider_infer_passes_the_allocator_on),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
