/* af_flash_attn's index arrays on CUDA: checked on the device, never read by the host (docs/CUDA.md). A call is
 * asynchronous and capture-safe: varlen and paged calls enqueued while the emulated stream captures (where any
 * synchronisation or blocking copy fails and invalidates the capture, as in CUDA) match the double reference. Bad
 * entries (a negative page, a page past the pool, seqused_k past the pages, a decreasing cu_seqlens_q/k, one past
 * the packed rows) never make a kernel read or write outside the tensors (the sentinels around out/lse stay; ASan in
 * the sanitizer build), give the documented NaN rows (or leave the rows of a sequence whose cu_seqlens_q entries are
 * bad unwritten), leave the other sequences' rows right, and are reported by af_cuda_check_errors with the CPU's
 * message, once. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"
#include "flash_case.h"
#include "emu_backend_tensor.h"
#include "sdpa/cuda_backend.h"
#include "test_tensor.h"

static const af_cuda_backend_ops *ops;

/* The emulation's capture calls, from the backend's own copy of the emulated runtime (it is the one the call uses). */
typedef int (*stream_create_fn)(void **stream);
typedef int (*stream_destroy_fn)(void *stream);
typedef int (*begin_capture_fn)(void *stream, int mode);
typedef int (*end_capture_fn)(void *stream, void **graph);
typedef int (*is_capturing_fn)(void *stream, int *status);
typedef int (*graph_destroy_fn)(void *graph);
static struct {
    stream_create_fn create;
    stream_destroy_fn destroy;
    begin_capture_fn begin;
    end_capture_fn end;
    is_capturing_fn is_capturing;
    graph_destroy_fn graph_destroy;
} emu;

enum { CAPTURE_UNSUPPORTED = 900, CAPTURE_INVALIDATED = 901, CAPTURE_ACTIVE = 1 };

/* ------------------------------------------------------------------ device copies */

static void to_device(device_tensor *d, const test_tensor *t) { backend_to_device(ops, d, t); }
static void to_host(test_tensor *t, const device_tensor *d) { backend_to_host(ops, t, d); }
static void device_free(device_tensor *d) { backend_device_free(ops, d); }

enum { INPUTS = 8 };
typedef struct {
    flash_tensors t;
    device_tensor in[INPUTS], out, lse;
    af_flash_args args;
    double sentinel_out, sentinel_lse;   /* an element of out / lse that nothing wrote */
} device_case;

/* The case's tensors on the device, out and lse full of the sentinel. */
static void device_case_build(device_case *d, const flash_case *c) {
    memset(d, 0, sizeof *d);
    assert_true(flash_case_build(c, &d->t));
}

static void device_case_upload(device_case *d) {
    flash_tensors *t = &d->t;
    const test_tensor *host[INPUTS] = {&t->q, &t->k, &t->v, &t->sink, &t->cu_q, &t->cu_k, &t->seqused_k,
                                       &t->page_table};
    d->args = t->args;
    const af_tensor **arg[INPUTS] = {&d->args.query, &d->args.key, &d->args.value, &d->args.learnable_sink,
                                     &d->args.cu_seqlens_q, &d->args.cu_seqlens_k, &d->args.seqused_k,
                                     &d->args.page_table};
    for (int i = 0; i < INPUTS; i++)
        if (*arg[i]) {
            to_device(&d->in[i], host[i]);
            *arg[i] = &d->in[i].view;
        }
    tt_fill_bytes(&t->out, TT_SENTINEL_BYTE);
    tt_fill_bytes(&t->lse, TT_SENTINEL_BYTE);
    const int64_t zero[4] = {0, 0, 0, 0};
    d->sentinel_out = tt_get(&t->out, zero);
    d->sentinel_lse = tt_get(&t->lse, zero);
    to_device(&d->out, &t->out);
    to_device(&d->lse, &t->lse);
}

static void device_case_download(device_case *d) {
    to_host(&d->t.out, &d->out);
    to_host(&d->t.lse, &d->lse);
}

static void device_case_free(device_case *d) {
    for (int i = 0; i < INPUTS; i++) device_free(&d->in[i]);
    device_free(&d->out);
    device_free(&d->lse);
    flash_case_free(&d->t);
}

static af_status run(device_case *d, void *stream) {
    d->args.stream = stream;
    return af_flash_attn(&d->args, &d->out.view, &d->lse.view);
}

/* ------------------------------------------------------------------ the cases */

/* A paged decode: 3 sequences of 1 row over 40, 25 and 33 keys in pages of 8 (f16: the tensor cores; split-KV). */
static flash_case paged_decode(af_dtype dtype) {
    flash_case c = flash_case_default(3, 4, 2, 1, 40, 64, 64);
    c.dtype = dtype;
    c.kv = KV_PAGED;
    c.seqused = true;
    c.page_size = 8;
    const int64_t keys[3] = {40, 25, 33};
    for (int b = 0; b < 3; b++) c.Sk[b] = keys[b], c.S_stored[b] = 40, c.Lq[b] = 1;
    c.with_lse = true;
    return c;
}

/* A paged prefill: the same cache under 40 rows of 2 heads a kv head (80 packed rows: the Hopper kernel takes it,
 * a TMA box a page, unless ATTNFORGE_CUDA_WGMMA=0). */
static flash_case paged_prefill(af_dtype dtype) {
    flash_case c = paged_decode(dtype);
    for (int b = 0; b < 3; b++) c.Lq[b] = 40;
    return c;
}

/* The same prefill in pages of 5 keys, which TMA cannot box: the Hopper kernel's gathered path (cp.async) takes it
 * unless ATTNFORGE_CUDA_WGMMA=0. */
static flash_case paged_prefill_gathered(af_dtype dtype) {
    flash_case c = paged_prefill(dtype);
    c.page_size = 5;
    return c;
}

/* Varlen q and K/V: 3 sequences of 5, 9 and 3 rows over 30, 12 and 20 keys, causal. */
static flash_case varlen(af_dtype dtype) {
    flash_case c = flash_case_default(3, 4, 2, 9, 30, 64, 64);
    c.dtype = dtype;
    c.varlen_q = true;
    c.kv = KV_VARLEN;
    const int64_t rows[3] = {5, 9, 3}, keys[3] = {30, 12, 20};
    for (int b = 0; b < 3; b++) c.Lq[b] = rows[b], c.Sk[b] = keys[b], c.S_stored[b] = keys[b];
    c.causal = true;
    c.with_lse = true;
    return c;
}

/* ------------------------------------------------------------------ capture */

/* Under capture the calls enqueue without synchronising (the emulation would fail and invalidate the capture), the
 * capture ends valid, and the results match the double reference; the same calls on the legacy stream still work. */
static void calls_enqueued_during_capture_match_the_reference(void **state) {
    const flash_case cases[4] = {paged_decode(AF_F16), varlen(AF_BF16), paged_decode(AF_F32), varlen(AF_F32)};
    for (int i = 0; i < 4; i++) {
        device_case d;
        device_case_build(&d, &cases[i]);
        device_case_upload(&d);
        void *stream = NULL, *graph = NULL;
        assert_int_equal(emu.create(&stream), 0);
        assert_int_equal(emu.begin(stream, 0), 0);
        const af_status st = run(&d, stream);
        if (st != AF_OK) fail_msg("case %d under capture: %s: %s", i, af_status_name(st), af_last_error());
        int capture = 0;
        assert_int_equal(emu.is_capturing(stream, &capture), 0);
        assert_int_equal(capture, CAPTURE_ACTIVE);   /* not invalidated: nothing synchronised */
        assert_int_equal(emu.end(stream, &graph), 0);
        emu.graph_destroy(graph);
        emu.destroy(stream);
        assert_int_equal(af_cuda_check_errors(0), AF_OK);
        device_case_download(&d);
        char why[1024] = "";
        if (!flash_case_matches(&d.t, why, sizeof why)) fail_msg("case %d under capture: %s", i, why);
        assert_true(tt_outside_view_is(&d.t.out, TT_SENTINEL_BYTE));
        assert_int_equal(run(&d, NULL), AF_OK);
        device_case_download(&d);
        if (!flash_case_matches(&d.t, why, sizeof why)) fail_msg("case %d on the legacy stream: %s", i, why);
        device_case_free(&d);
    }
}

/* The emulation enforces the rule the calls above obey: a synchronisation during capture fails and invalidates it,
 * and af_cuda_check_errors (which synchronises) is refused there too. */
static void a_synchronisation_during_capture_invalidates_it(void **state) {
    void *stream = NULL, *graph = NULL;
    char err[512];
    assert_int_equal(emu.create(&stream), 0);
    assert_int_equal(emu.begin(stream, 0), 0);
    assert_int_not_equal(ops->synchronize(0, stream, err, sizeof err), AF_OK);
    if (!strstr(err, "cudaErrorStreamCaptureUnsupported")) fail_msg("synchronize during capture: %s", err);
    assert_int_not_equal(af_cuda_check_errors(0), AF_OK);
    if (!strstr(af_last_error(), "cudaErrorStreamCaptureUnsupported")) fail_msg("%s", af_last_error());
    int capture = 0;
    assert_int_equal(emu.is_capturing(stream, &capture), 0);
    assert_int_equal(capture, 2);   /* cudaStreamCaptureStatusInvalidated */
    assert_int_equal(emu.end(stream, &graph), CAPTURE_INVALIDATED);
    assert_null(graph);
    emu.destroy(stream);
}

/* ------------------------------------------------------------------ bad entries */

typedef enum { ROWS_NAN, ROWS_UNWRITTEN } expected_rows;

typedef struct {
    const char *what;
    flash_case (*make)(af_dtype);
    void (*corrupt)(flash_tensors *t);
    int64_t bad_first, bad_last;   /* these sequences' rows are NaN or unwritten; the others match the reference */
    expected_rows rows;
    const char *message, *or_message;   /* in af_cuda_check_errors' message: one of the violations (blocks race) */
} bad_index;

static void set32(test_tensor *t, int64_t i, int64_t j, double v) {
    const int64_t at[2] = {i, j};
    tt_set(t, at, v);
}

static void negative_page(flash_tensors *t) { set32(&t->page_table, 1, 2, -3); }
static void page_past_the_pool(flash_tensors *t) { set32(&t->page_table, 2, 0, (double)t->k.view.shape[0]); }
static void seqused_past_the_pages(flash_tensors *t) { set32(&t->seqused_k, 0, 0, 1000); }
/* An inner entry moved changes two sequences: the one before it gets fewer (here negative) rows or keys, the one
 * after it more (here past max_seqlen). */
static void cu_k_decreasing(flash_tensors *t) { set32(&t->cu_k, 2, 0, tt_get(&t->cu_k, (int64_t[]){1}) - 4); }
static void cu_k_past_the_keys(flash_tensors *t) { set32(&t->cu_k, 3, 0, (double)t->k.view.shape[0] + 50); }
static void cu_q_decreasing(flash_tensors *t) { set32(&t->cu_q, 2, 0, tt_get(&t->cu_q, (int64_t[]){1}) - 2); }
static void cu_q_past_the_rows(flash_tensors *t) { set32(&t->cu_q, 3, 0, (double)t->q.view.shape[0] + 7); }

static const bad_index bad_indices[] = {
    {"a negative page", paged_decode, negative_page, 1, 1, ROWS_NAN, "page_table: [1, 2] = -3 is outside [0, num_pages",
     NULL},
    {"a page past the pool", paged_decode, page_past_the_pool, 2, 2, ROWS_NAN, "page_table: [2, 0] = 16 is outside [0, num_pages = 16)",
     NULL},
    {"a page past the pool (prefill)", paged_prefill, page_past_the_pool, 2, 2, ROWS_NAN,
     "page_table: [2, 0] = 16 is outside [0, num_pages = 16)", NULL},
    {"a page past the pool (gathered prefill)", paged_prefill_gathered, page_past_the_pool, 2, 2, ROWS_NAN,
     "page_table: [2, 0] = 25 is outside [0, num_pages = 25)", NULL},
    {"seqused_k past the pages", paged_decode, seqused_past_the_pages, 0, 0, ROWS_NAN,
     "seqused_k: [0] = 1000 is outside [0, ", NULL},
    {"cu_seqlens_k decreasing", varlen, cu_k_decreasing, 1, 2, ROWS_NAN, "cu_seqlens_k: must be non-decreasing",
     "max_seqlen_k: 30 (or key's rows, if fewer), but sequence 2 has 36 keys"},
    {"cu_seqlens_k past the keys", varlen, cu_k_past_the_keys, 2, 2, ROWS_NAN, "cu_seqlens_k: last entry 112 must "
     "equal key's 62 rows", "max_seqlen_k: 30 (or key's rows, if fewer), but sequence 2 has 70 keys"},
    {"cu_seqlens_q decreasing", varlen, cu_q_decreasing, 1, 2, ROWS_UNWRITTEN, "cu_seqlens_q: must be non-decreasing",
     "max_seqlen_q: 9 (or query's rows, if fewer), but sequence 2 has 14 query rows"},
    {"cu_seqlens_q past the rows", varlen, cu_q_past_the_rows, 2, 2, ROWS_UNWRITTEN, "cu_seqlens_q: last entry 24 "
     "must equal query's 17 rows", "max_seqlen_q: 9 (or query's rows, if fewer), but sequence 2 has 10 query rows"},
};

/* The bad sequence's rows of out and lse are all NaN, or all still the sentinel; then they are given the reference's
 * values, so that flash_case_matches checks every other row. False with `why`. */
static bool bad_rows_are(device_case *d, const bad_index *bad, char *why, size_t size) {
    flash_tensors *t = &d->t;
    const flash_case *c = &t->c;
    const bool packed = c->varlen_q;
    for (int64_t bs = bad->bad_first; bs <= bad->bad_last; bs++) {
    int64_t r0 = 0;
    for (int64_t b = 0; packed && b < bs; b++) r0 += c->Lq[b];
    const int64_t r1 = r0 + c->Lq[bs];   /* fixed q: rows 0..Lq - 1 of batch bs */
    for (int64_t r = r0; r < r1; r++)
        for (int64_t h = 0; h < c->Hq; h++) {
            const int64_t lse_packed[2] = {h, r}, lse_fixed[3] = {bs, h, r};
            const int64_t *lse_at = packed ? lse_packed : lse_fixed;
            for (int64_t e = 0; e < c->Ev; e++) {
                const int64_t out_packed[3] = {r, h, e}, out_fixed[4] = {bs, r, h, e};
                const int64_t *out_at = packed ? out_packed : out_fixed;
                const double v = tt_get(&t->out, out_at), l = tt_get(&t->lse, lse_at);
                const bool ok = bad->rows == ROWS_NAN ? isnan(v) && isnan(l)
                                                      : v == d->sentinel_out && l == d->sentinel_lse;
                if (!ok) {
                    snprintf(why, size, "sequence %lld row %lld head %lld col %lld: out %g lse %g, expected %s",
                             (long long)bs, (long long)r, (long long)h, (long long)e, v, l,
                             bad->rows == ROWS_NAN ? "NaN" : "the sentinel (unwritten)");
                    return false;
                }
                tt_set(&t->out, out_at, tt_get(&t->ref_out, out_at));
            }
            tt_set(&t->lse, lse_at, tt_get(&t->ref_lse, lse_at));
        }
    }
    return true;
}

static void bad_entries_stay_in_bounds_and_are_reported(void **state) {
    /* the tensor cores (mma.sync, then the Hopper kernel where it takes the case) and the CUDA cores */
    const af_dtype dtypes[3] = {AF_F16, AF_F16, AF_F32};
    for (size_t k = 0; k < sizeof bad_indices / sizeof bad_indices[0]; k++)
        for (int di = 0; di < 3; di++) {
            const bad_index *bad = &bad_indices[k];
            const flash_case c = bad->make(dtypes[di]);
            setenv("ATTNFORGE_CUDA_WGMMA", di == 1 ? "1" : "0", 1);   /* the emulated device is a 9.0 */
            device_case d;
            device_case_build(&d, &c);
            bad->corrupt(&d.t);
            device_case_upload(&d);
            assert_int_equal(af_cuda_check_errors(0), AF_OK);   /* nothing pending from earlier tests */
            const af_status st = run(&d, NULL);
            if (st != AF_OK) fail_msg("%s (%s): the call failed: %s", bad->what, af_dtype_name(c.dtype), af_last_error());
            device_case_download(&d);
            char why[1024] = "";
            assert_int_equal(af_cuda_check_errors(0), AF_ERR_INVALID_ARGUMENT);
            if (!strstr(af_last_error(), bad->message) && !(bad->or_message && strstr(af_last_error(), bad->or_message)))
                fail_msg("%s: expected \"%s\" in: %s", bad->what, bad->message, af_last_error());
            assert_int_equal(af_cuda_check_errors(0), AF_OK);   /* read once, then cleared */
            if (!tt_outside_view_is(&d.t.out, TT_SENTINEL_BYTE) || !tt_outside_view_is(&d.t.lse, TT_SENTINEL_BYTE))
                fail_msg("%s (%s): bytes outside out/lse written", bad->what, af_dtype_name(c.dtype));
            if (!bad_rows_are(&d, bad, why, sizeof why) || !flash_case_matches(&d.t, why, sizeof why))
                fail_msg("%s (%s): %s", bad->what, af_dtype_name(c.dtype), why);
            device_case_free(&d);
        }
    unsetenv("ATTNFORGE_CUDA_WGMMA");
}

static int setup(void **state) {
    if (af_cuda_backend_load(&ops) != AF_OK) {
        fprintf(stderr, "the emulated CUDA backend did not load: %s\n", af_last_error());
        return -1;
    }
    void *backend = dlopen(getenv("ATTNFORGE_CUDA_LIBRARY"), RTLD_NOW | RTLD_NOLOAD);
    if (!backend) return -1;
    emu.create = (stream_create_fn)dlsym(backend, "cudaStreamCreate");
    emu.destroy = (stream_destroy_fn)dlsym(backend, "cudaStreamDestroy");
    emu.begin = (begin_capture_fn)dlsym(backend, "cudaStreamBeginCapture");
    emu.end = (end_capture_fn)dlsym(backend, "cudaStreamEndCapture");
    emu.is_capturing = (is_capturing_fn)dlsym(backend, "cudaStreamIsCapturing");
    emu.graph_destroy = (graph_destroy_fn)dlsym(backend, "cudaGraphDestroy");
    return emu.create && emu.destroy && emu.begin && emu.end && emu.is_capturing && emu.graph_destroy ? 0 : -1;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(calls_enqueued_during_capture_match_the_reference),
        cmocka_unit_test(a_synchronisation_during_capture_invalidates_it),
        cmocka_unit_test(bad_entries_stay_in_bounds_and_are_reported),
    };
    return cmocka_run_group_tests_name("cuda_indices", tests, setup, NULL);
}
