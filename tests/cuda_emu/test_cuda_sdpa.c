/* af_sdpa and af_flash_attn on CUDA tensors, end to end: libattnforge's checks and loader, the backend's host code
 * (src/cuda/backend.cu: pointer checks, tensor-core or CUDA-core path, copies of q/k/v the tensor cores cannot read)
 * and the kernels, all through the emulated backend (ATTNFORGE_CUDA_LIBRARY). Device memory comes from the backend's
 * own allocator (its registry tells device memory from host memory); in the emulation it is host memory, so the
 * double reference runs on the CPU tensors the data was copied from, and the results are copied back to compare. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "attnforge.h"
#include "case_gen.h"
#include "flash_case.h"
#include "emu_backend_tensor.h"
#include "sdpa/cuda_backend.h"
#include "test_tensor.h"

static const af_cuda_backend_ops *ops;
static const af_device cuda0 = {AF_DEVICE_CUDA, 0};

/* ------------------------------------------------------------------ what the backend logs */

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static char log_text[1 << 16];
static int warnings;

static void capture_log(af_log_level level, const char *message, void *user) {
    pthread_mutex_lock(&log_lock);
    const size_t used = strlen(log_text);
    snprintf(log_text + used, sizeof log_text - used, "%d %s\n", (int)level, message);
    if (level == AF_LOG_WARNING) warnings++;
    pthread_mutex_unlock(&log_lock);
}

static void log_reset(void) {
    pthread_mutex_lock(&log_lock);
    log_text[0] = '\0';
    warnings = 0;
    pthread_mutex_unlock(&log_lock);
}

/* ------------------------------------------------------------------ device copies of test tensors */

static void to_device(device_tensor *d, const test_tensor *t) { backend_to_device(ops, d, t); }
static void to_host(test_tensor *t, const device_tensor *d) { backend_to_host(ops, t, d); }
static void device_free(device_tensor *d) { backend_device_free(ops, d); }

typedef struct {
    device_tensor q, k, v, mask, out, lse;
    af_sdpa_args args;
} device_call;

/* The case's tensors on the device (out and lse full of the sentinel) and its arguments pointing at them. */
static void device_call_build(device_call *d, case_tensors *t) {
    tt_fill_bytes(&t->out, TT_SENTINEL_BYTE);
    if (t->c.with_lse) tt_fill_bytes(&t->lse, TT_SENTINEL_BYTE);
    to_device(&d->q, &t->q);
    to_device(&d->k, &t->k);
    to_device(&d->v, &t->v);
    to_device(&d->mask, &t->mask);
    to_device(&d->out, &t->out);
    if (t->c.with_lse) to_device(&d->lse, &t->lse);
    d->args = t->args;
    d->args.query = &d->q.view;
    d->args.key = &d->k.view;
    d->args.value = &d->v.view;
    d->args.attn_mask = t->args.attn_mask ? &d->mask.view : NULL;
}

static void device_call_free(device_call *d) {
    device_free(&d->q); device_free(&d->k); device_free(&d->v);
    device_free(&d->mask); device_free(&d->out); device_free(&d->lse);
}

/* ------------------------------------------------------------------ the tensor-core path's rule for q/k/v */

/* Why the backend must copy this q/k/v before the tensor-core kernels, or NULL (the rule of src/cuda/kernels.h). */
static const char *needs_copy(const af_tensor *t) {
    if (t->shape[3] > 1 && t->strides[3] != 1) return "stride[3]";
    for (int d = 0; d < 3; d++)
        if (t->shape[d] > 1 && t->strides[d] % 8 != 0) return "not a multiple of 8";
    if ((uintptr_t)t->data % 16 != 0) return "16-byte aligned";
    return NULL;
}

static bool on_tensor_cores(const sdpa_case *c) {
    return (c->dtype == AF_F16 || c->dtype == AF_BF16) && c->E <= 256 && c->Ev <= 256;
}

/* ------------------------------------------------------------------ one case end to end */

/* The call's status, then its stream synchronised and out (and lse when given) copied back; false with `why`. */
static bool call_finished(af_status st, const char *entry, void *stream, test_tensor *out, const device_tensor *d_out,
                          test_tensor *lse, const device_tensor *d_lse, char *why, size_t size) {
    char err[512];
    if (st != AF_OK) {
        snprintf(why, size, "%s: %s: %s", entry, af_status_name(st), af_last_error());
        return false;
    }
    if (ops->synchronize(0, stream, err, sizeof err) != AF_OK) {
        snprintf(why, size, "synchronize: %s", err);
        return false;
    }
    to_host(out, d_out);
    if (lse) to_host(lse, d_lse);
    return true;
}

/* Nothing written around out's (and lse's) view: the sentinel bytes there are intact. */
static bool outside_untouched(const test_tensor *out, const test_tensor *lse, char *why, size_t size) {
    if (!tt_outside_view_is(out, TT_SENTINEL_BYTE)) {
        snprintf(why, size, "out: bytes outside the view were written");
        return false;
    }
    if (lse && !tt_outside_view_is(lse, TT_SENTINEL_BYTE)) {
        snprintf(why, size, "lse: bytes outside the view were written");
        return false;
    }
    return true;
}

/* Run the case on the device and check it against the double reference; false with `why` on a mismatch. */
static bool run_case(const sdpa_case *c, char *why, size_t size) {
    case_tensors t;
    if (!case_build(c, &t)) {
        snprintf(why, size, "case_build failed");
        return false;
    }
    device_call d;
    device_call_build(&d, &t);
    log_reset();
    af_tensor *lse = c->with_lse ? &d.lse.view : NULL;
    test_tensor *host_lse = c->with_lse ? &t.lse : NULL;
    bool ok = call_finished(af_sdpa(&d.args, &d.out.view, lse), "af_sdpa", d.args.stream, &t.out, &d.out, host_lse,
                            &d.lse, why, size) &&
              case_matches_reference(&t, NULL, why, size) &&   /* af_error_bound, as on the CPU */
              outside_untouched(&t.out, host_lse, why, size);
    /* a q/k/v the tensor cores cannot read is copied, and one warning per call says which and why */
    const bool empty = c->B == 0 || c->Hq == 0 || c->L == 0;
    const char *q_rule = needs_copy(&d.q.view), *k_rule = needs_copy(&d.k.view), *v_rule = needs_copy(&d.v.view);
    const bool copies = on_tensor_cores(c) && !empty && (q_rule || k_rule || v_rule);
    if (ok && copies != (warnings == 1)) {
        snprintf(why, size, "expected %s copy warning, got %d: %s", copies ? "one" : "no", warnings, log_text);
        ok = false;
    }
    if (ok && copies) {
        const char *names[3] = {"query (", "key (", "value ("}, *rules[3] = {q_rule, k_rule, v_rule};
        for (int i = 0; i < 3 && ok; i++)
            if ((rules[i] != NULL) != (strstr(log_text, names[i]) != NULL) || (rules[i] && !strstr(log_text, rules[i]))) {
                snprintf(why, size, "the copy warning misnames %s: %s", names[i], log_text);
                ok = false;
            }
    }
    device_call_free(&d);
    case_free(&t);
    return ok;
}

static void expect_case(const sdpa_case *c) {
    char why[1024] = "", text[512];
    if (!run_case(c, why, sizeof why)) {
        case_describe(c, text, sizeof text);
        fail_msg("%s\n  case: %s", why, text);
    }
}

/* ------------------------------------------------------------------ af_flash_attn: one case end to end */

/* Every input tensor an af_flash_attn call names, moved to the device, and `args` pointed at the copies (absent ones
 * stay absent); flash_inputs_free releases them. */
enum { FLASH_INPUTS = 11 };
static void flash_inputs_to_device(const flash_tensors *t, af_flash_args *args, device_tensor in[FLASH_INPUTS]) {
    const test_tensor *host[FLASH_INPUTS] = {&t->q,    &t->k,         &t->v,          &t->sink,
                                             &t->cu_q, &t->cu_k,      &t->seqused_k,  &t->page_table,
                                             &t->q_descale, &t->k_descale, &t->v_descale};
    const af_tensor **arg[FLASH_INPUTS] = {&args->query,        &args->key,          &args->value,
                                           &args->learnable_sink, &args->cu_seqlens_q, &args->cu_seqlens_k,
                                           &args->seqused_k,    &args->page_table,   &args->q_descale,
                                           &args->k_descale,    &args->v_descale};
    memset(in, 0, sizeof(device_tensor) * FLASH_INPUTS);
    for (int i = 0; i < FLASH_INPUTS; i++)
        if (*arg[i]) {
            to_device(&in[i], host[i]);
            *arg[i] = &in[i].view;
        }
}

static void flash_inputs_free(device_tensor in[FLASH_INPUTS]) {
    for (int i = 0; i < FLASH_INPUTS; i++) device_free(&in[i]);
}

/* An af_flash_attn case (fixed, varlen or paged; float8 too) on the device, checked against the double reference
 * with flash_case_matches' bound (softcap- and float8-aware); false with `why` on a mismatch. */
static bool run_flash_case(const flash_case *c, char *why, size_t size) {
    flash_tensors t;
    if (!flash_case_build(c, &t)) {
        snprintf(why, size, "flash_case_build failed");
        return false;
    }
    tt_fill_bytes(&t.out, TT_SENTINEL_BYTE);
    tt_fill_bytes(&t.lse, TT_SENTINEL_BYTE);
    af_flash_args args = t.args;
    device_tensor in[FLASH_INPUTS], out, lse;
    memset(&lse, 0, sizeof lse);
    flash_inputs_to_device(&t, &args, in);
    to_device(&out, &t.out);
    if (c->with_lse) to_device(&lse, &t.lse);
    test_tensor *host_lse = c->with_lse ? &t.lse : NULL;
    const af_status st = af_flash_attn(&args, &out.view, c->with_lse ? &lse.view : NULL);
    const bool ok = call_finished(st, "af_flash_attn", args.stream, &t.out, &out, host_lse, &lse, why, size) &&
                    flash_case_matches(&t, why, size) && outside_untouched(&t.out, host_lse, why, size);
    flash_inputs_free(in);
    device_free(&out);
    device_free(&lse);
    flash_case_free(&t);
    return ok;
}

static void expect_flash_case(const flash_case *c) {
    char why[1024] = "", text[512];
    if (!run_flash_case(c, why, sizeof why)) {
        flash_case_describe(c, text, sizeof text);
        fail_msg("%s\n  case: %s", why, text);
    }
}

/* Work of a case (what the emulation's time grows with): the longer sequence shrinks first, as case_gen does. */
static void fit_emulation_budget(sdpa_case *c, double budget) {
    while ((double)c->B * c->Hq * c->L * c->S * (c->E + c->Ev) > budget) {
        if (c->B > 1) c->B--;
        else if (c->L > c->S && c->L > 1) c->L = c->L * 3 / 4;
        else if (c->S > 1) c->S = c->S * 3 / 4;
        else break;
    }
}

/* ------------------------------------------------------------------ tests */

static void random_suite_matches_the_reference(void **state) {
    const int count = case_suite_count(36);
    const uint64_t seed = case_suite_seed(2024);
    for (int i = 0; i < count; i++) {
        sdpa_case c = case_random(seed, i, 6);
        fit_emulation_budget(&c, 4e5);
        expect_case(&c);
    }
}

static void chosen_cases_match_the_reference(void **state) {
    const af_dtype dtypes[3] = {AF_F32, AF_F16, AF_BF16};
    for (int di = 0; di < 3; di++) {
        sdpa_case c = case_default(2, 4, 2, 19, 45, 64, 40);   /* GQA, Ev != E, L != S */
        c.dtype = dtypes[di];
        c.is_causal = true;
        expect_case(&c);
        c.is_causal = false;
        c.causal_bottom_right = true;
        expect_case(&c);
        c.L = 50;   /* L > S bottom-right: the first rows see no key (out 0, lse -inf) */
        c.S = 33;
        expect_case(&c);
        c.causal_bottom_right = false;
        c.mask = MASK_BOOL;
        c.mask_shape = "B1LS";
        c.masked_row_rate = 0.2;
        expect_case(&c);
        c.mask = MASK_ADDITIVE;
        c.mask_shape = "HLS";
        expect_case(&c);
    }
    sdpa_case decode = case_default(1, 8, 2, 1, 700, 128, 128);   /* one row per head: split-KV and combine */
    decode.dtype = AF_BF16;
    expect_case(&decode);
    sdpa_case wide = case_default(1, 2, 1, 9, 17, 320, 288);   /* E > 256: the CUDA-core path */
    wide.dtype = AF_F16;
    wide.enable_gqa = true;
    expect_case(&wide);
}

/* The case's work (what the emulation's time grows with). */
static double flash_work(const flash_case *c) {
    double w = 0.0;
    for (int b = 0; b < c->B; b++) w += (double)c->Lq[b] * (double)c->S_stored[b];
    return w * (double)c->Hq * (double)(c->E + c->Ev);
}

/* FA4's features on CUDA: random cases of every form (fixed, varlen, seqused_k, paged; every window, softcap and
 * sink), shrunk to the emulation's budget, and chosen edges. */
#if defined(__SANITIZE_ADDRESS__)
#define FLASH_CUDA_CASES 12   /* the emulation under ASan is ~5x slower: half the cases there, all forms still */
#define FLOAT8_VARIANT_STEP 3   /* float8 on the tensor cores: 2 of the 4 (format, dtype) pairs, every path still */
#else
#define FLASH_CUDA_CASES 24
#define FLOAT8_VARIANT_STEP 1
#endif

/* A random flash case shrunk to the emulation's budget: rows and keys alike; seqused_k stays within the keys stored. */
static void fit_flash_budget(flash_case *c) {
    while (flash_work(c) > 1.5e5)
        for (int b = 0; b < FLASH_MAX_BATCH; b++) {
            c->Lq[b] = c->Lq[b] * 3 / 4;
            c->S_stored[b] = c->S_stored[b] * 3 / 4;
            if (c->Sk[b] > c->S_stored[b]) c->Sk[b] = c->S_stored[b];
        }
}

static void flash_random_suite_matches_the_reference(void **state) {
    const int count = case_suite_count(FLASH_CUDA_CASES);
    const uint64_t seed = case_suite_seed(4096);
    for (int i = 0; i < count; i++) {
        flash_case c = flash_case_random(seed, i);
        fit_flash_budget(&c);
        expect_flash_case(&c);
    }
}

/* float8 K/V under an f32/f16/bf16 q, or all of q/k/v float8, e4m3fn and e5m2, with and without descales (zero and
 * huge ones too), against the reference's float8 bound: the tensor cores take f16/bf16 q, the CUDA cores the rest. */
static void flash_float8_suite_matches_the_reference(void **state) {
    const int count = case_suite_count(FLASH_CUDA_CASES / 2);
    const uint64_t seed = case_suite_seed(8192);
    for (int i = 0; i < count; i++) {
        flash_case c = flash_case_random_fp8(seed, i);
        fit_flash_budget(&c);
        expect_flash_case(&c);
    }
}

/* Varlen rows and keys: sequence b of the case's B has rows[b] query rows and keys[b] keys, packed. */
static void set_varlen(flash_case *c, const int64_t *rows, const int64_t *keys) {
    for (int64_t b = 0; b < c->B; b++) c->Lq[b] = rows[b], c->Sk[b] = c->S_stored[b] = keys[b];
    c->varlen_q = true;
    c->kv = KV_VARLEN;
}

/* A float8 K/V case under an f16/bf16 q with random descales (each in [1/4, 4), so a forgotten one shows). */
static flash_case float8_case(af_dtype q, af_dtype format, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S,
                              int64_t E, int64_t Ev) {
    flash_case c = flash_case_default(B, Hq, Hkv, L, S, E, Ev);
    c.dtype = q;
    c.kv_dtype = format;
    c.descale = DESCALE_RANDOM;
    c.seed = (uint64_t)(L * 131 + S * 7 + E + format);
    return c;
}

/* Float8 K/V under an f16/bf16 q run on the tensor cores: no note that they run on the CUDA cores, while a float32 q
 * over the same cache gets it (once per process: this test runs before the float8 suite's float32 cases). */
static void float8_under_a_half_query_runs_on_the_tensor_cores(void **state) {
    flash_case c = float8_case(AF_F16, AF_F8E4M3, 1, 2, 1, 9, 100, 64, 64);
    log_reset();
    expect_flash_case(&c);
    assert_null(strstr(log_text, "CUDA cores"));
    c.dtype = AF_BF16;
    c.kv_dtype = AF_F8E5M2;
    expect_flash_case(&c);
    assert_null(strstr(log_text, "CUDA cores"));
    c.dtype = AF_F8E5M2;   /* FA4's fp8: q/k/v all float8, out bf16 */
    c.out_dtype = AF_BF16;
    expect_flash_case(&c);
    assert_null(strstr(log_text, "CUDA cores"));
    c.dtype = AF_F32;
    expect_flash_case(&c);
    assert_non_null(strstr(log_text, "float8 K/V under a float32 query"));
}

/* The tensor-core kernel's float8 variants against the reference: several key tiles (the two byte stages
 * alternate), every head-dim variant, softcap, window and sink, q/k/v all float8 (Q staged and converted; at head
 * dim 256 its fragments are read from shared memory), decode with split-KV, a paged cache and varlen tensors read in
 * place, and K/V views the path must copy first (an inner stride of 2: one-byte elements). */
static void flash_float8_on_the_tensor_cores(void **state) {
    for (int n = 0; n < 4; n += FLOAT8_VARIANT_STEP) {   /* both formats under both q dtypes */
        const af_dtype q = n % 2 ? AF_BF16 : AF_F16, format = n / 2 ? AF_F8E5M2 : AF_F8E4M3;
        flash_case c = float8_case(q, format, 1, 4, 2, 33, 150, 64, 64);   /* head dim 64, 3 tiles, GQA */
        c.causal = n % 2;
        expect_flash_case(&c);
        c = float8_case(q, format, 1, 2, 1, 17, 140, 128, 96);   /* 128, Ev < E, softcap */
        c.softcap = 20.0;
        c.amplitude = 3.0;
        expect_flash_case(&c);
        c = float8_case(q, format, 1, 2, 1, 9, 130, 200, 256);   /* 256, a window and a sink */
        c.has_window = true;
        c.left = 70, c.right = 10;
        c.sink = true;
        expect_flash_case(&c);
    }
    for (int n = 0; n < 4; n += FLOAT8_VARIANT_STEP) {   /* q/k/v all float8 (FA4's fp8), out f16 or bf16 */
        const af_dtype format = n % 2 ? AF_F8E5M2 : AF_F8E4M3;
        flash_case c = n < 2 ? float8_case(format, format, 1, 4, 2, 21, 150, 64, 64)
                             : float8_case(format, format, 1, 2, 1, 9, 130, 256, 200);
        c.out_dtype = n / 2 ? AF_BF16 : AF_F16;
        c.causal = true;
        c.sink = n == 3;
        expect_flash_case(&c);
    }
    flash_case all8 = float8_case(AF_F8E4M3, AF_F8E4M3, 3, 4, 2, 0, 0, 128, 128);   /* varlen q, in place */
    const int64_t all8_rows[3] = {9, 40, 1}, all8_keys[3] = {40, 70, 100};
    set_varlen(&all8, all8_rows, all8_keys);
    all8.out_dtype = AF_BF16;
    expect_flash_case(&all8);
    /* decode: one row per head, 5 key tiles split over the emulation's 8 multiprocessors, a sink in the combine */
    flash_case decode = float8_case(AF_F16, AF_F8E5M2, 1, 8, 4, 1, 300, 64, 64);
    decode.sink = true;
    expect_flash_case(&decode);
    /* a paged cache (pages of 16 keys: strides multiples of 16 bytes) with seqused_k, read in place */
    flash_case paged = float8_case(AF_BF16, AF_F8E4M3, 3, 4, 2, 1, 0, 64, 64);
    const int64_t stored[3] = {130, 41, 77};
    for (int b = 0; b < 3; b++) paged.S_stored[b] = stored[b], paged.Sk[b] = stored[b] - 10 * b;
    paged.kv = KV_PAGED;
    paged.seqused = true;
    expect_flash_case(&paged);
    /* varlen rows and keys, causal */
    flash_case varlen = float8_case(AF_F16, AF_F8E4M3, 3, 4, 2, 0, 0, 64, 64);
    const int64_t rows[3] = {20, 1, 70}, keys[3] = {90, 0, 70};
    set_varlen(&varlen, rows, keys);
    varlen.causal = true;
    expect_flash_case(&varlen);
    /* K/V with an inner stride of 2: copied tight (rows padded to 16 bytes), with the warning naming both */
    flash_case sliced = float8_case(AF_BF16, AF_F8E5M2, 1, 2, 1, 12, 90, 40, 24);
    sliced.kv_layout = LAYOUT_SLICED;
    log_reset();
    expect_flash_case(&sliced);
    assert_int_equal(warnings, 1);
    assert_non_null(strstr(log_text, "key ("));
    assert_non_null(strstr(log_text, "value ("));
}

/* A causal f16 varlen case, E = Ev = 64: sequence b has rows[b] query rows and keys[b] keys, packed. */
static flash_case varlen_f16_causal(int64_t B, int64_t Hq, int64_t Hkv, const int64_t *rows, const int64_t *keys) {
    flash_case c = flash_case_default(B, Hq, Hkv, 0, 0, 64, 64);
    set_varlen(&c, rows, keys);
    c.dtype = AF_F16;
    c.causal = true;
    return c;
}

static void flash_chosen_cases_match_the_reference(void **state) {
    const af_dtype dtypes[3] = {AF_F32, AF_F16, AF_BF16};
    for (int di = 0; di < 3; di++) {
        flash_case c = flash_case_default(2, 4, 2, 19, 45, 32, 24);   /* GQA, Ev != E, L != S */
        c.dtype = dtypes[di];
        c.causal = true;   /* bottom-right, no other feature: the tensor cores take f16/bf16 */
        expect_flash_case(&c);
        c.has_window = true;   /* a band: tiles before it are skipped, rows start at different keys */
        c.left = 12, c.right = 0;
        expect_flash_case(&c);
        c.causal = false;
        c.left = 0, c.right = 0;   /* each row sees only its diagonal key */
        expect_flash_case(&c);
        c.left = 5, c.right = 100;   /* right beyond S */
        c.softcap = 30.0;
        c.has_scale = true, c.scale = 1.0;
        c.amplitude = 25.0;   /* |q·k| up to 1e4 against the cap */
        expect_flash_case(&c);
        c = flash_case_default(1, 4, 2, 40, 23, 16, 16);
        c.dtype = dtypes[di];
        c.causal = true;   /* L > S bottom-right: 17 rows see no key: out 0, lse = the sink */
        c.sink = true;
        c.sink_dtype = dtypes[(di + 1) % 3];
        expect_flash_case(&c);
        c.causal = false;
        c.sink_offset = 12.0;   /* a sink that dominates: the keys barely count */
        expect_flash_case(&c);
    }
    /* decode: one row per head, split-KV and the combine (which joins the sink), a window starting mid-cache; on
     * the emulation's 8 multiprocessors the 4 CTAs (one per kv head) split their 11 key tiles 4 ways */
    flash_case decode = flash_case_default(1, 8, 4, 1, 700, 64, 64);
    decode.dtype = AF_BF16;
    decode.sink = true;
    decode.has_window = true;
    decode.left = 300, decode.right = 0;
    decode.softcap = 5.0;
    expect_flash_case(&decode);
    decode.has_window = false;   /* every split sees keys */
    decode.softcap = 0.0;
    decode.sink_offset = 3.0;
    expect_flash_case(&decode);
    /* a paged cache the tensor cores read in place (strides multiples of 8), pages shared, seqused_k below capacity;
     * f16 decode, then 3 rows with causal and a window */
    flash_case paged = flash_case_default(3, 8, 2, 1, 0, 64, 64);
    const int64_t stored[3] = {130, 41, 77};
    for (int b = 0; b < 3; b++) paged.S_stored[b] = stored[b], paged.Sk[b] = stored[b] - 10 * b;
    paged.dtype = AF_F16;
    paged.kv = KV_PAGED;
    paged.seqused = true;
    paged.page_size = 16;
    paged.shared_page = true;
    expect_flash_case(&paged);
    for (int b = 0; b < 3; b++) paged.Lq[b] = 3;
    paged.causal = paged.has_window = true;
    paged.left = 40, paged.right = 0;
    expect_flash_case(&paged);
    /* varlen on the tensor cores: sequence 0's 70 rows (140 packed, three CTAs) over 100 keys, an empty sequence,
     * then 5 rows whose keys start at 130 of the packed K/V; causal, then a window, then softcap and a sink */
    flash_case varlen = varlen_f16_causal(3, 4, 2, (const int64_t[]){70, 0, 5}, (const int64_t[]){100, 30, 131});
    expect_flash_case(&varlen);
    varlen.has_window = true;
    varlen.left = 20, varlen.right = 0;
    expect_flash_case(&varlen);
    varlen.dtype = AF_BF16;
    varlen.causal = varlen.has_window = false;
    varlen.softcap = 10.0;
    varlen.sink = true;
    expect_flash_case(&varlen);
    /* varlen decode (continuous batching): one and three rows over 700 and 300 keys; its 8 CTAs split their keys on
     * the emulation's 8 multiprocessors, and the combine skips the rows past the short sequence (and joins the sink) */
    flash_case steps = varlen_f16_causal(2, 8, 4, (const int64_t[]){1, 3}, (const int64_t[]){700, 300});
    expect_flash_case(&steps);
    steps.sink = true;
    steps.has_window = true;
    steps.left = 200, steps.right = 0;
    expect_flash_case(&steps);
}

/* K/V views the copy rule takes in place but TMA cannot box as they are, or only with the strides of size-1 dims
 * ignored: the Hopper kernel decides its tensor maps before anything is sized and leaves to mma.sync what TMA
 * cannot read (issue 37). E = 1 (q/k/v rows 16 bytes apart) with a last stride of 3 (one column: the stride is
 * never used); B = 1 and Hkv = 1
 * with odd strides on those size-1 dims (as_strided); K and V broadcast over the batch (stride 0, as expand()
 * makes). Each must run and match the reference, with no copy and no warning. */
/* t's values in a fresh buffer whose rows (dim 3) are 8 elements apart: a one-column K/V the copy rule reads in
 * place. */
static void spread_rows_8_apart(test_tensor *t) {
    test_tensor spread;
    const int order[4] = {0, 1, 2, 3};
    const int64_t pad[4] = {0, 0, 0, 8 - t->view.shape[3]};
    assert_true(tt_alloc_ordered(&spread, t->view.dtype, 4, t->view.shape, order, pad, 1, 0));
    int64_t idx[4] = {0, 0, 0, 0};
    do tt_set(&spread, idx, tt_get(t, idx));
    while (tt_next_index(4, t->view.shape, idx));
    tt_free(t);
    *t = spread;
}

static void views_tma_cannot_box_run_in_place(void **state) {
    (void)state;
    for (int n = 0; n < 4; n++) {
        sdpa_case c = case_default(n == 3 ? 2 : 1, 4, n == 2 ? 1 : 2, 72, 152, n == 0 ? 1 : 64, n == 0 ? 1 : 64);
        c.dtype = n % 2 ? AF_BF16 : AF_F16;
        c.is_causal = n == 1;
        case_tensors t;
        assert_true(case_build(&c, &t));
        if (n == 0) {
            spread_rows_8_apart(&t.q);
            spread_rows_8_apart(&t.k);
            spread_rows_8_apart(&t.v);
        }
        if (n == 3) {   /* batch 1 reads batch 0's keys and values */
            t.k.view.strides[0] = t.v.view.strides[0] = 0;
            assert_true(case_rerun_reference(&t));
        }
        device_call d;
        device_call_build(&d, &t);
        af_tensor *kv[2] = {&d.k.view, &d.v.view};
        for (int i = 0; i < 2; i++) {
            if (n == 0) kv[i]->strides[3] = 3;
            if (n == 1) kv[i]->strides[0] = 7;
            if (n == 2) kv[i]->strides[1] = 5;
            if (n == 3) kv[i]->strides[0] = 0;
        }
        log_reset();
        char why[1024] = "";
        af_tensor *lse = c.with_lse ? &d.lse.view : NULL;
        const bool ok = call_finished(af_sdpa(&d.args, &d.out.view, lse), "af_sdpa", d.args.stream, &t.out, &d.out,
                                      c.with_lse ? &t.lse : NULL, &d.lse, why, sizeof why) &&
                        case_matches_reference(&t, NULL, why, sizeof why);
        device_call_free(&d);
        case_free(&t);
        if (!ok) fail_msg("view %d: %s", n, why);
        if (warnings != 0) fail_msg("view %d: want no warning, got: %s", n, log_text);
    }
}

static void strided_inputs_are_copied_with_a_warning(void **state) {
    sdpa_case c = case_default(1, 2, 2, 24, 40, 64, 64);
    c.dtype = AF_F16;
    c.q_layout = LAYOUT_SLICED;   /* padded dims, inner stride > 1: every rule broken somewhere */
    c.k_layout = LAYOUT_NHD;
    c.v_layout = LAYOUT_SLICED;
    for (uint64_t s = 1; s <= 4; s++) {
        c.seed = s;
        expect_case(&c);   /* checks the warning names exactly the tensors that break the rule */
    }
    c.q_layout = c.v_layout = LAYOUT_CONTIGUOUS;
    c.E = c.Ev = 60;   /* contiguous, but rows 120 bytes apart: stride[2] = 60 is not a multiple of 8 */
    expect_case(&c);
    assert_non_null(strstr(log_text, "query (stride[2] is 60, not a multiple of 8)"));
}

static void float32_says_once_that_it_runs_on_the_cuda_cores(void **state) {
    sdpa_case c = case_default(1, 1, 1, 4, 4, 16, 16);   /* the first f32 call of the process: this test runs first */
    char why[1024];
    assert_true(run_case(&c, why, sizeof why));
    assert_non_null(strstr(log_text, "float32 attention runs on the CUDA cores"));
    assert_true(run_case(&c, why, sizeof why));
    assert_null(strstr(log_text, "CUDA cores"));
}

/* Errors: refused on the host, before any launch, naming the tensor; nothing written. */
typedef struct {
    case_tensors t;
    device_call d;
} error_call;

static void error_call_setup(error_call *e) {
    sdpa_case c = case_default(1, 2, 2, 8, 12, 16, 16);
    c.dtype = AF_F16;
    assert_true(case_build(&c, &e->t));
    device_call_build(&e->d, &e->t);
}

static void expect_refused(error_call *e, af_status status, const char *needle) {
    af_status st = af_sdpa(&e->d.args, &e->d.out.view, &e->d.lse.view);
    if (st != status || !strstr(af_last_error(), needle))
        fail_msg("got %s \"%s\", expected %s with \"%s\"", af_status_name(st), af_last_error(),
                 af_status_name(status), needle);
    unsigned char *before = tt_snapshot(&e->t.out);
    to_host(&e->t.out, &e->d.out);
    assert_true(tt_same_as(&e->t.out, before));   /* the device's out still holds the sentinel it was given */
    free(before);
}

static void error_call_free(error_call *e) {
    device_call_free(&e->d);
    case_free(&e->t);
}

static void tensors_on_another_device_are_named(void **state) {
    error_call e;
    error_call_setup(&e);
    e.d.v.view.device.index = 1;
    expect_refused(&e, AF_ERR_INVALID_ARGUMENT, "value: on cuda:1 but query is on cuda:0");
    e.d.v.view.device.index = 0;
    e.d.lse.view.device.type = AF_DEVICE_CPU;
    expect_refused(&e, AF_ERR_INVALID_ARGUMENT, "lse: on cpu but query is on cuda:0");
    e.d.lse.view.device = cuda0;
    /* all on cuda:1, which the emulation lacks */
    e.d.q.view.device.index = e.d.k.view.device.index = e.d.v.view.device.index = 1;
    e.d.out.view.device.index = e.d.lse.view.device.index = 1;
    expect_refused(&e, AF_ERR_INVALID_ARGUMENT, "query: on cuda:1 but this machine has 1 CUDA device (cuda:0..0)");
    error_call_free(&e);
}

static void host_memory_passed_as_cuda_is_named(void **state) {
    error_call e;
    error_call_setup(&e);
    af_tensor host_key = e.t.k.view;   /* the host copy, labelled cuda:0 */
    host_key.device = cuda0;
    e.d.args.key = &host_key;
    expect_refused(&e, AF_ERR_INVALID_ARGUMENT, "key: ");
    assert_non_null(strstr(af_last_error(), "is host memory, but the tensor says cuda:0"));
    e.d.args.key = &e.d.k.view;
    af_tensor host_lse = e.t.lse.view;
    host_lse.device = cuda0;
    assert_int_equal(af_sdpa(&e.d.args, &e.d.out.view, &host_lse), AF_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(af_last_error(), "lse: "));
    assert_non_null(strstr(af_last_error(), "is host memory"));
    error_call_free(&e);
}

static void reference_is_refused_on_cuda(void **state) {
    error_call e;
    error_call_setup(&e);
    assert_int_equal(af_sdpa_reference(&e.d.args, &e.d.out.view, &e.d.lse.view), AF_ERR_UNSUPPORTED);
    assert_non_null(strstr(af_last_error(), "the reference reads host memory"));
    error_call_free(&e);
}

/* A stale error that the caller's own CUDA code left pending (a failed cudaSetDevice in the backend's runtime) does
 * not fail a call that enqueued correctly (launches report their own status), and it stays for the caller. */
static void a_stale_cuda_error_is_not_reported_as_the_calls(void **state) {
    void *backend = dlopen(getenv("ATTNFORGE_CUDA_LIBRARY"), RTLD_NOW | RTLD_NOLOAD);
    assert_non_null(backend);
    int (*set_device)(int) = (int (*)(int))dlsym(backend, "cudaSetDevice");
    int (*last_error)(void) = (int (*)(void))dlsym(backend, "cudaGetLastError");
    assert_true(set_device && last_error);
    for (int dtype = 0; dtype < 2; dtype++) {   /* the tensor cores and the CUDA cores */
        sdpa_case c = case_default(1, 2, 2, 9, 12, 16, 16);
        c.dtype = dtype ? AF_F32 : AF_F16;
        assert_int_not_equal(set_device(7), 0);
        expect_case(&c);
        assert_int_not_equal(last_error(), 0);
    }
    dlclose(backend);
}

/* The scratch of the tensor-core path (copies of q/k/v it cannot read in place) comes from the backend's own pool:
 * made once per device, its release threshold the largest (freed memory is kept for the next call); where the device
 * has no pools it comes from cudaMalloc/cudaFree, and the results are the same. */
typedef void (*pool_stats_fn)(long *pools, long *allocations, unsigned long long *threshold);

static pool_stats_fn backend_pool_stats(void) {
    void *backend = dlopen(getenv("ATTNFORGE_CUDA_LIBRARY"), RTLD_NOW | RTLD_NOLOAD);
    assert_non_null(backend);
    pool_stats_fn stats = (pool_stats_fn)dlsym(backend, "af_emu_pool_stats");
    assert_non_null(stats);
    dlclose(backend);   /* still loaded: libattnforge holds it */
    return stats;
}

static sdpa_case copied_case(uint64_t seed) {
    sdpa_case c = case_default(1, 2, 2, 24, 40, 64, 64);
    c.dtype = AF_F16;
    c.q_layout = LAYOUT_SLICED;   /* the tensor cores cannot read it in place: copied into scratch */
    c.seed = seed;
    return c;
}

static void scratch_without_memory_pools_uses_cudamalloc(void **state) {   /* first: no pool is made before it */
    fflush(NULL);
    const pid_t child = fork();
    if (child == 0) {   /* the pool choice is made once per process: the device without pools is a child's */
        setenv("ATTNFORGE_EMU_CUDA", "nopools", 1);
        char why[1024] = "";
        const sdpa_case c = copied_case(5);
        long pools, allocations;
        unsigned long long threshold;
        const bool ok = run_case(&c, why, sizeof why);
        backend_pool_stats()(&pools, &allocations, &threshold);
        if (!ok) fprintf(stderr, "without pools: %s\n", why);
        _exit(ok && pools == 0 && allocations == 0 && strstr(log_text, "has no stream-ordered memory pools") ? 0 : 1);
    }
    int status = 0;
    assert_int_equal(waitpid(child, &status, 0), child);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

static void scratch_comes_from_a_pool_that_keeps_its_memory(void **state) {
    long pools, allocations;
    unsigned long long threshold;
    for (uint64_t seed = 1; seed <= 2; seed++) {
        const sdpa_case c = copied_case(seed);
        expect_case(&c);
    }
    backend_pool_stats()(&pools, &allocations, &threshold);
    assert_int_equal(pools, 1);   /* one pool for the device, made once */
    assert_true(allocations >= 2);
    assert_true(threshold == UINT64_MAX);
}

/* Each tensor-core variant's occupancy (cudaOccupancyMaxActiveBlocksPerMultiprocessor) is asked once per device
 * and named in the debug log: on this emulated 9.0 the Hopper kernel past 64 packed rows (asked once over two calls),
 * and with ATTNFORGE_CUDA_WGMMA=0 mma.sync's 32 rows a warp, then its 16-row twin for decode. Runs before any other
 * case of this process asks (the test before it runs in a child). */
static void occupancy_is_asked_once_per_variant_and_logged(void **state) {
    static char seen[sizeof log_text];   /* run_case starts each call's log afresh: the four calls' logs */
    seen[0] = '\0';
    const char *outer = getenv("ATTNFORGE_CUDA_WGMMA");
    char kept[8] = "";
    if (outer) snprintf(kept, sizeof kept, "%s", outer);
    af_set_log_callback(capture_log, NULL, AF_LOG_DEBUG);
    sdpa_case c = case_default(1, 2, 1, 40, 70, 64, 64);   /* 80 packed rows */
    c.dtype = AF_BF16;
    for (int call = 0; call < 4; call++) {
        setenv("ATTNFORGE_CUDA_WGMMA", call < 2 ? "1" : "0", 1);
        if (call == 3) c.L = 3;   /* decode: 6 packed rows */
        expect_case(&c);
        strncat(seen, log_text, sizeof seen - strlen(seen) - 1);
    }
    if (outer) setenv("ATTNFORGE_CUDA_WGMMA", kept, 1);
    else unsetenv("ATTNFORGE_CUDA_WGMMA");
    af_set_log_callback(capture_log, NULL, AF_LOG_INFO);
    int hopper = 0, wide = 0, narrow = 0;
    for (const char *at = seen; (at = strstr(at, "af_wgmma_bf16_hd64: ")) != NULL; at++) hopper++;
    for (const char *at = seen; (at = strstr(at, "af_mma_bf16_hd64")) != NULL; at++) {
        if (!strncmp(at, "af_mma_bf16_hd64: ", 18)) wide++;
        if (!strncmp(at, "af_mma_bf16_hd64_w16: ", 22)) narrow++;
    }
    if (hopper != 1 || wide != 1 || narrow != 1 || !strstr(seen, "CTAs per multiprocessor"))
        fail_msg("want one occupancy line for af_wgmma_bf16_hd64, af_mma_bf16_hd64 and its _w16 twin, got %d, %d "
                 "and %d:\n%s", hopper, wide, narrow, seen);
}

static int setup(void **state) {
    if (!getenv("ATTNFORGE_CUDA_LIBRARY")) setenv("ATTNFORGE_CUDA_LIBRARY", AF_TEST_EMULATED_BACKEND, 1);
    unsetenv("ATTNFORGE_EMU_CUDA");
    af_set_log_callback(capture_log, NULL, AF_LOG_INFO);
    if (af_cuda_backend_load(&ops) != AF_OK) {
        fprintf(stderr, "the emulated CUDA backend did not load: %s\n", af_last_error());
        return -1;
    }
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(scratch_without_memory_pools_uses_cudamalloc),
        cmocka_unit_test(occupancy_is_asked_once_per_variant_and_logged),
        cmocka_unit_test(float32_says_once_that_it_runs_on_the_cuda_cores),
        cmocka_unit_test(a_stale_cuda_error_is_not_reported_as_the_calls),
        cmocka_unit_test(scratch_comes_from_a_pool_that_keeps_its_memory),
        cmocka_unit_test(chosen_cases_match_the_reference),
        cmocka_unit_test(random_suite_matches_the_reference),
        cmocka_unit_test(strided_inputs_are_copied_with_a_warning),
        cmocka_unit_test(views_tma_cannot_box_run_in_place),
        cmocka_unit_test(flash_chosen_cases_match_the_reference),
        cmocka_unit_test(flash_random_suite_matches_the_reference),
        cmocka_unit_test(float8_under_a_half_query_runs_on_the_tensor_cores),
        cmocka_unit_test(flash_float8_on_the_tensor_cores),
        cmocka_unit_test(flash_float8_suite_matches_the_reference),
        cmocka_unit_test(tensors_on_another_device_are_named),
        cmocka_unit_test(host_memory_passed_as_cuda_is_named),
        cmocka_unit_test(reference_is_refused_on_cuda),
    };
    flash_case_allow_approximate_tanh();   /* the Hopper kernel's softcap runs on tanh.approx.f32 */
    return cmocka_run_group_tests(tests, setup, NULL);
}
