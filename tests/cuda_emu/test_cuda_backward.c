/* af_sdpa_backward and af_flash_attn_backward on CUDA tensors, end to end on the emulated backend: libattnforge's
 * checks and routing, the backend's host code and the tensor-core backward (src/cuda/attn_bwd_mma.cuh) against the
 * double reference backward with tests/support/backward_case.h's bound; chosen cases (every meaning the CUDA backward
 * takes), a small seeded random suite (f16/bf16, head dims <= 128), determinism (two runs bit-identical), nothing
 * written outside the gradients, the host-side refusals (float32, head dims above 128) before any launch, and the
 * scratch (D) taken from the call's workspace allocator. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"
#include "backward_case.h"
#include "case_gen.h"
#include "emu_backend_tensor.h"
#include "flash_case.h"
#include "sdpa/cuda_backend.h"
#include "test_tensor.h"

#define DEFAULT_CASES 15   /* random cases per suite (sdpa and flash; 15: every kind of case_random once) */
#define DEFAULT_SEED 20261204u

static const af_cuda_backend_ops *ops;

/* Every test tensor of the case with memory, so that each af_tensor the arguments name can be moved to the device. */
enum { MAX_TENSORS = 16 };
typedef struct {
    test_tensor *host[MAX_TENSORS];
    device_tensor dev[MAX_TENSORS];
    int n;
} device_set;

static const af_tensor *on_device(device_set *s, const af_tensor *host_view) {
    if (!host_view) return NULL;
    for (int i = 0; i < s->n; i++)
        if (&s->host[i]->view == host_view) return &s->dev[i].view;
    fail_msg("a tensor of the call has no device copy");
    return NULL;
}

static void add(device_set *s, test_tensor *t) {
    if (!t->memory) return;
    s->host[s->n] = t;
    backend_to_device(ops, &s->dev[s->n], t);
    s->n++;
}

/* The case's call on device copies (gradients full of the sentinel), synchronised, gradients copied back. */
static af_status run_on_device(backward_tensors *t) {
    test_tensor *grads[4] = {&t->dq, &t->dk, &t->dv, &t->dsink};
    for (int i = 0; i < 4; i++)
        if (grads[i]->memory) tt_fill_bytes(grads[i], TT_SENTINEL_BYTE);
    device_set s;
    memset(&s, 0, sizeof s);
    test_tensor *all[] = {&t->dout, &t->dq, &t->dk, &t->dv, &t->dsink,
                          t->flash ? &t->f.q : &t->s.q, t->flash ? &t->f.k : &t->s.k, t->flash ? &t->f.v : &t->s.v,
                          t->flash ? &t->f.out : &t->s.out, t->flash ? &t->f.lse : &t->s.lse};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) add(&s, all[i]);
    if (t->flash) {
        add(&s, &t->f.sink);
        add(&s, &t->f.cu_q);
        add(&s, &t->f.cu_k);
        add(&s, &t->f.seqused_k);
    } else {
        add(&s, &t->s.mask);
    }
    af_backward_inputs in = {on_device(&s, t->in.out), on_device(&s, t->in.dout), on_device(&s, t->in.lse)};
    af_gradients g = {(af_tensor *)on_device(&s, t->grads.dq), (af_tensor *)on_device(&s, t->grads.dk),
                      (af_tensor *)on_device(&s, t->grads.dv), (af_tensor *)on_device(&s, t->grads.dsink)};
    af_status st;
    if (t->flash) {
        af_flash_args a = t->f.args;
        a.query = on_device(&s, a.query);
        a.key = on_device(&s, a.key);
        a.value = on_device(&s, a.value);
        a.learnable_sink = on_device(&s, a.learnable_sink);
        a.cu_seqlens_q = on_device(&s, a.cu_seqlens_q);
        a.cu_seqlens_k = on_device(&s, a.cu_seqlens_k);
        a.seqused_k = on_device(&s, a.seqused_k);
        st = af_flash_attn_backward(&a, &in, &g);
    } else {
        af_sdpa_args a = t->s.args;
        a.query = on_device(&s, a.query);
        a.key = on_device(&s, a.key);
        a.value = on_device(&s, a.value);
        a.attn_mask = on_device(&s, a.attn_mask);
        st = af_sdpa_backward(&a, &in, &g);
    }
    char err[512];
    if (st == AF_OK && ops->synchronize(0, NULL, err, sizeof err) != AF_OK) fail_msg("synchronize: %s", err);
    for (int i = 0; i < s.n; i++) {
        for (int k = 0; k < 4; k++)
            if (s.host[i] == grads[k]) backend_to_host(ops, grads[k], &s.dev[i]);
        backend_device_free(ops, &s.dev[i]);
    }
    return st;
}

/* Bytes of the gradients' whole buffers (views and what lies around them). */
static size_t gradient_bytes(const backward_tensors *t, unsigned char *into) {
    const test_tensor *grads[4] = {&t->dq, &t->dk, &t->dv, &t->dsink};
    size_t n = 0;
    for (int i = 0; i < 4; i++)
        if (grads[i]->memory) {
            if (into) memcpy(into + n, grads[i]->memory, grads[i]->bytes);
            n += grads[i]->bytes;
        }
    return n;
}

/* Outside each gradient's view the sentinel is intact: tt_fill_bytes filled whole buffers, the view was written. */
static bool outside_untouched(const backward_tensors *t, char *why, size_t size) {
    const test_tensor *grads[4] = {&t->dq, &t->dk, &t->dv, &t->dsink};
    const char *names[4] = {"dq", "dk", "dv", "dsink"};
    for (int g = 0; g < 4; g++) {
        const test_tensor *x = grads[g];
        if (!x->memory || !t->want[g]) continue;
        if (!tt_outside_view_is(x, TT_SENTINEL_BYTE)) {
            snprintf(why, size, "%s: bytes outside its view were written", names[g]);
            return false;
        }
    }
    return true;
}

/* Run twice: AF_OK, the same bits both times, nothing outside the views, within the bound of the reference. */
static void check_case(backward_tensors *t, const char *desc) {
    char why[1024] = "";
    af_status st = run_on_device(t);
    if (st != AF_OK) fail_msg("%s: %s: %s", desc, af_status_name(st), af_last_error());
    const size_t n = gradient_bytes(t, NULL);
    unsigned char *first = malloc(n + 1);
    assert_non_null(first);
    gradient_bytes(t, first);
    const bool matches = backward_matches(t, why, sizeof why) && outside_untouched(t, why, sizeof why);
    if (!matches) {
        free(first);
        fail_msg("%s\n    %s", desc, why);
    }
    st = run_on_device(t);
    unsigned char *second = malloc(n + 1);
    assert_non_null(second);
    gradient_bytes(t, second);
    const bool same = st == AF_OK && memcmp(first, second, n) == 0;
    free(first);
    free(second);
    if (!same) fail_msg("%s: a second run gave other bits (%s)", desc, af_status_name(st));
}

static void sdpa_case_on_device(const sdpa_case *c, uint64_t seed) {
    char desc[1024];
    case_describe(c, desc, sizeof desc);
    const grad_layouts layouts = backward_random_layouts(seed);
    backward_tensors t;
    if (!backward_build_sdpa(c, &layouts, seed, &t)) {
        backward_free(&t);
        fail_msg("could not build the case (%s): %s", af_last_error(), desc);
    }
    check_case(&t, desc);
    backward_free(&t);
}

static void flash_case_on_device(const flash_case *c, uint64_t seed) {
    char desc[1024];
    flash_case_describe(c, desc, sizeof desc);
    const grad_layouts layouts = backward_random_layouts(seed);
    backward_tensors t;
    if (!backward_build_flash(c, &layouts, seed, &t)) {
        backward_free(&t);
        fail_msg("could not build the case (%s): %s", af_last_error(), desc);
    }
    check_case(&t, desc);
    backward_free(&t);
}

/* ------------------------------------------------------------------ chosen cases */

static sdpa_case half_case(af_dtype dtype, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t E,
                           int64_t Ev) {
    sdpa_case c = case_default(B, Hq, Hkv, L, S, E, Ev);
    c.dtype = dtype;
    c.enable_gqa = Hq != Hkv;
    return c;
}

static void sdpa_chosen_cases(void **state) {
    (void)state;
    /* several key tiles and row steps, GQA 2, Ev != E, no mask: the per-score checks skipped on full blocks */
    sdpa_case c = half_case(AF_F16, 1, 4, 2, 80, 130, 64, 48);
    sdpa_case_on_device(&c, 1);
    c = half_case(AF_BF16, 2, 2, 1, 70, 70, 128, 128);   /* head dim 128, MQA-like group */
    c.is_causal = true;
    sdpa_case_on_device(&c, 2);
    c = half_case(AF_F16, 1, 2, 2, 40, 100, 32, 96);   /* bottom-right causal, L < S */
    c.causal_bottom_right = true;
    sdpa_case_on_device(&c, 3);
    c = half_case(AF_BF16, 1, 2, 2, 90, 33, 64, 64);   /* bottom-right with L > S: rows that see no key */
    c.causal_bottom_right = true;
    sdpa_case_on_device(&c, 4);
    c = half_case(AF_F16, 1, 2, 1, 37, 70, 40, 40);   /* bool mask, whole rows masked, a scale */
    c.mask = MASK_BOOL;
    c.mask_shape = "B1LS";
    c.mask_keep = 0.6;
    c.masked_row_rate = 0.2;
    c.has_scale = true;
    c.scale = 0.3;
    sdpa_case_on_device(&c, 5);
    c = half_case(AF_BF16, 2, 3, 3, 33, 65, 16, 24);   /* additive mask broadcast over heads, rows all -inf */
    c.mask = MASK_ADDITIVE;
    c.mask_shape = "LS";
    c.mask_keep = 0.8;
    c.masked_row_rate = 0.25;
    sdpa_case_on_device(&c, 6);
}

static flash_case flash_half(af_dtype dtype, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t E,
                             int64_t Ev) {
    flash_case c = flash_case_default(B, Hq, Hkv, L, S, E, Ev);
    c.dtype = c.kv_dtype = c.out_dtype = dtype;
    return c;
}

static void flash_chosen_cases(void **state) {
    (void)state;
    flash_case c = flash_half(AF_BF16, 1, 4, 2, 75, 140, 64, 64);   /* window, softcap, sink */
    c.causal = true;
    c.has_window = true;
    c.left = 50;
    c.right = 0;
    c.softcap = 5.0;
    c.sink = true;
    c.sink_dtype = AF_F32;
    c.sink_amplitude = 2.0;
    flash_case_on_device(&c, 11);
    c = flash_half(AF_F16, 3, 2, 1, 50, 90, 64, 32);   /* varlen q and k, seqused_k, a window both sides */
    c.varlen_q = true;
    c.kv = KV_VARLEN;
    c.Lq[0] = 50, c.Lq[1] = 0, c.Lq[2] = 17;
    c.Sk[0] = 90, c.Sk[1] = 30, c.Sk[2] = 64;
    c.S_stored[0] = 90, c.S_stored[1] = 40, c.S_stored[2] = 70;
    c.seqused = true;
    c.has_window = true;
    c.left = 20;
    c.right = 9;
    flash_case_on_device(&c, 12);
    c = flash_half(AF_BF16, 2, 2, 2, 24, 24, 128, 128);   /* a sink that dominates, rows that see no key */
    c.has_window = true;
    c.left = -30;
    c.right = -27;
    c.sink = true;
    c.sink_dtype = AF_BF16;
    c.sink_offset = 4.0;
    flash_case_on_device(&c, 13);
}

/* ------------------------------------------------------------------ random suite */

static sdpa_case random_sdpa(uint64_t seed, int index) {
    sdpa_case c = case_random(seed, index, 0);
    c.dtype = index % 2 ? AF_BF16 : AF_F16;
    if (c.E > 128) c.E = 128;
    if (c.Ev > 128) c.Ev = 128;
    while ((double)c.B * c.Hq * c.L * c.S * (c.E + c.Ev) > 1.5e6) {
        if (c.B > 1) c.B--;
        else if (c.L > 8) c.L = c.L * 3 / 4;
        else if (c.S > 8) c.S = c.S * 3 / 4;
        else break;
    }
    return c;
}

static flash_case random_flash(uint64_t seed, int index) {
    flash_case c = flash_case_random(seed, 4 * index);   /* every 4th: the K/V forms and window kinds cycle sooner */
    if (c.kv == KV_PAGED) c.kv = KV_VARLEN, c.shared_page = false;
    c.dtype = c.kv_dtype = c.out_dtype = index % 2 ? AF_F16 : AF_BF16;
    if (c.E > 128) c.E = 128;
    if (c.Ev > 128) c.Ev = 128;
    for (;;) {
        double w = 0.0;
        int64_t S_max = 0;
        for (int b = 0; b < c.B; b++) {
            w += (double)c.Lq[b] * (double)c.S_stored[b];
            S_max = c.S_stored[b] > S_max ? c.S_stored[b] : S_max;
        }
        if (w * (double)c.Hq * (double)(c.E + c.Ev) <= 1.5e6) break;
        for (int b = 0; b < c.B; b++) {
            if (S_max > 16) c.S_stored[b] = c.S_stored[b] * 3 / 4;
            else c.Lq[b] = c.Lq[b] * 3 / 4;
            if (c.Sk[b] > c.S_stored[b]) c.Sk[b] = c.S_stored[b];
        }
    }
    return c;
}

static void random_suite(void **state) {
    (void)state;
    const uint64_t seed = case_suite_seed(DEFAULT_SEED);
    const int n = case_suite_count(DEFAULT_CASES);
    for (int i = 0; i < n; i++) {
        const sdpa_case s = random_sdpa(seed, i);
        sdpa_case_on_device(&s, seed + (uint64_t)i);
        const flash_case f = random_flash(seed, i);
        flash_case_on_device(&f, seed + (uint64_t)i);
    }
}

/* The suite's default cases hold every feature the CUDA backward takes; a generator change that drops one fails. */
static void random_suite_covers_every_feature(void **state) {
    (void)state;
    bool dtype[2] = {false, false}, mask[3] = {false, false, false}, top_left = false, bottom_right = false;
    bool gqa = false, ev_differs = false, hd128 = false, window = false, softcap = false, sink = false;
    bool varlen_q = false, varlen_k = false, seqused = false;
    const uint64_t seed = case_suite_seed(DEFAULT_SEED);
    for (int i = 0; i < DEFAULT_CASES; i++) {
        const sdpa_case s = random_sdpa(seed, i);
        const flash_case f = random_flash(seed, i);
        dtype[s.dtype == AF_BF16] = dtype[f.dtype == AF_BF16] = mask[s.mask] = true;
        top_left |= s.is_causal && !s.causal_bottom_right;
        bottom_right |= s.causal_bottom_right;
        gqa |= s.Hq > s.Hkv && f.Hq > f.Hkv;
        ev_differs |= s.E != s.Ev;
        hd128 |= s.E > 64 || s.Ev > 64 || f.E > 64 || f.Ev > 64;
        window |= f.has_window;
        softcap |= f.softcap > 0.0;
        sink |= f.sink;
        varlen_q |= f.varlen_q;
        varlen_k |= f.kv == KV_VARLEN;
        seqused |= f.seqused;
    }
    assert_true(dtype[0] && dtype[1] && mask[0] && mask[1] && mask[2]);
    assert_true(top_left && bottom_right && gqa && ev_differs && hd128);
    assert_true(window && softcap && sink && varlen_q && varlen_k && seqused);
}

/* ------------------------------------------------------------------ refusals on the host */

static bool all_bytes_are(const test_tensor *t, unsigned char byte) {
    for (size_t i = 0; i < t->bytes; i++)
        if (t->memory[i] != byte) return false;
    return true;
}

/* A refused call: the status, a message naming the argument, nothing written to the gradients. */
static void refused(const sdpa_case *c, const char *needle) {
    const grad_layouts layouts = {LAYOUT_CONTIGUOUS, LAYOUT_CONTIGUOUS, LAYOUT_CONTIGUOUS, LAYOUT_CONTIGUOUS};
    backward_tensors t;
    if (!backward_build_sdpa(c, &layouts, 7, &t)) {
        backward_free(&t);
        fail_msg("could not build the case: %s", af_last_error());
    }
    const af_status st = run_on_device(&t);
    const bool untouched = (!t.dq.memory || all_bytes_are(&t.dq, TT_SENTINEL_BYTE)) &&
                           (!t.dk.memory || all_bytes_are(&t.dk, TT_SENTINEL_BYTE));
    char message[1024];
    snprintf(message, sizeof message, "%s", af_last_error());
    backward_free(&t);
    assert_int_equal(st, AF_ERR_UNSUPPORTED);
    if (!strstr(message, needle)) fail_msg("message '%s' lacks '%s'", message, needle);
    assert_true(untouched);
}

static void what_the_cuda_backward_does_not_take_is_refused(void **state) {
    (void)state;
    sdpa_case c = case_default(1, 1, 1, 8, 8, 16, 16);   /* f32 */
    refused(&c, "query: dtype float32 on cuda:0 has no backward pass");
    c = half_case(AF_F16, 1, 1, 1, 8, 8, 160, 16);
    refused(&c, "query: head dim 160");
    c = half_case(AF_BF16, 1, 1, 1, 8, 8, 16, 192);
    refused(&c, "value: head dim 192");
}

/* ------------------------------------------------------------------ the caller's workspace allocator */

typedef struct {
    int allocs, frees;
    size_t bytes, freed_bytes;
    void *given, *taken_back;
} counting_allocator;

static void *count_alloc(size_t bytes, int device, void *stream, void *user) {
    (void)stream;
    counting_allocator *a = user;
    char err[256];
    void *memory = NULL;
    if (ops->device_alloc(device, bytes, &memory, err, sizeof err) != AF_OK) return NULL;
    a->allocs++;
    a->bytes = bytes;
    a->given = memory;
    return memory;
}

static void count_free(void *ptr, size_t bytes, int device, void *stream, void *user) {
    (void)stream;
    counting_allocator *a = user;
    char err[256];
    a->frees++;
    a->freed_bytes = bytes;
    a->taken_back = ptr;
    if (ops->device_free(device, ptr, err, sizeof err) != AF_OK) fail_msg("device_free: %s", err);
}

/* D's scratch (a float a query row) comes from the call's allocator, once, and goes back to it with the same size. */
static void scratch_comes_from_the_callers_allocator(void **state) {
    (void)state;
    const sdpa_case c = half_case(AF_BF16, 2, 4, 2, 70, 90, 64, 64);
    const grad_layouts layouts = backward_random_layouts(21);
    backward_tensors t;
    if (!backward_build_sdpa(&c, &layouts, 21, &t)) {
        backward_free(&t);
        fail_msg("could not build the case: %s", af_last_error());
    }
    counting_allocator counts;
    memset(&counts, 0, sizeof counts);
    const af_cuda_allocator allocator = {count_alloc, count_free, &counts};
    t.s.args.workspace = &allocator;
    check_case(&t, "workspace from the caller");   /* two runs */
    backward_free(&t);
    assert_int_equal(counts.allocs, 2);
    assert_int_equal(counts.frees, 2);
    assert_true(counts.bytes >= (size_t)(2 * 4 * 70) * sizeof(float));
    assert_true(counts.freed_bytes == counts.bytes && counts.taken_back == counts.given);
}

static int setup(void **state) {
    (void)state;
    if (!getenv("ATTNFORGE_CUDA_LIBRARY")) setenv("ATTNFORGE_CUDA_LIBRARY", AF_TEST_EMULATED_BACKEND, 1);
    unsetenv("ATTNFORGE_EMU_CUDA");
    if (af_cuda_backend_load(&ops) != AF_OK) {
        fprintf(stderr, "the emulated CUDA backend did not load: %s\n", af_last_error());
        return -1;
    }
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(what_the_cuda_backward_does_not_take_is_refused),
        cmocka_unit_test(sdpa_chosen_cases),
        cmocka_unit_test(flash_chosen_cases),
        cmocka_unit_test(scratch_comes_from_the_callers_allocator),
        cmocka_unit_test(random_suite_covers_every_feature),
        cmocka_unit_test(random_suite),
    };
    return cmocka_run_group_tests_name("cuda_backward", tests, setup, NULL);
}
