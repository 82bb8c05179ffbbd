/* libFuzzer harness for the samples reader: af_samples_from_json on arbitrary bytes, then everything a
 * program does with samples it was handed: prepare, the plan's JSON, each sample as a call, add_call, and
 * infer of each call through the prepared plan (data buffers sized exactly to what each view reaches, so
 * ASan sees any stray access; views too big to back are passed with NULL data and must be refused).
 * Invariants: no crash, leak or sanitizer report; a refusal is AF_ERR_PARSE with a message and no samples;
 * a failed prepare has a reason; JSON written is read back to the same plan / the same text. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"
#include "fuzz_views.h"

#define MAX_BACKED_BYTES (64 << 10)   /* views whose last element lies this far or further get no buffer (fast) */
#define MAX_WORK ((int64_t)1 << 18)   /* B·Hq·L·S·(E+Ev) above this: infer gets no buffers (refused unread) */

/* Give `t` a zeroed buffer of exactly the bytes it reaches (or leave data NULL); returns what to free. */
static void *back(af_tensor *t) {
    const int64_t bytes = reach_bytes(t, MAX_BACKED_BYTES - 1);   /* <= 0: invalid, empty or too far */
    if (bytes <= 0) return NULL;
    t->data = calloc(1, (size_t)bytes);
    return t->data;
}

static bool small_enough(const af_sample_call *c) {
    const af_tensor *q = &c->query, *k = &c->key, *v = &c->value;
    if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4) return true;   /* refused before any work */
    const int64_t dims[5] = {q->shape[0], q->shape[1], q->shape[2], k->shape[2], q->shape[3] + v->shape[3]};
    int64_t work = 1;
    for (int i = 0; i < 5; i++)
        if (dims[i] < 0 || __builtin_mul_overflow(work, dims[i], &work)) return false;
    return work <= MAX_WORK;
}

/* Run one sample through the plan, as a program with real tensors of those descriptors would. */
static void infer_call(af_provider *provider, const af_sample_call *given) {
    af_sample_call copy = *given, *call = &copy;   /* descriptors: data NULL until backed here */
    const bool backed = small_enough(call);           /* else NULL data: the guard runs, the kernel must not */
    void *memory[5] = {NULL, NULL, NULL, NULL, NULL};
    if (backed) {
        memory[0] = back(&call->query);
        memory[1] = back(&call->key);
        memory[2] = back(&call->value);
        if (call->has_attn_mask) memory[3] = back(&call->attn_mask);
    }
    af_tensor out = {0};
    if (call->query.ndim == 4 && call->value.ndim == 4) {
        const int64_t shape[4] = {call->query.shape[0], call->query.shape[1], call->query.shape[2], call->value.shape[3]};
        out = af_tensor_contiguous(NULL, call->query.dtype, 4, shape);
        if (backed) memory[4] = back(&out);
    }
    const af_sdpa_args args = af_sample_call_args(call);
    const af_status st = af_provider_infer(provider, &args, call->source, &out, NULL);
    if (st != AF_OK && af_last_error()[0] == '\0') abort();
    for (int i = 0; i < 5; i++) free(memory[i]);
}

/* A plan that matches the call in everything but (maybe) its layout, so infer's guard reaches the layout test
 * and the copy path with whatever descriptors the input made. */
static af_provider *plan_matching(const af_sample_call *c, bool copy_free) {
    char scale[64] = "", text[512];
    if (c->has_scale) snprintf(scale, sizeof scale, ", \"softmax_scale\": %.17g", c->scale);
    const bool gqa = c->query.ndim == 4 && c->key.ndim == 4 && c->query.shape[1] != c->key.shape[1];
    snprintf(text, sizeof text,
             "{\"type\": \"FlashAttention4KernelProvider\", \"qkv_source\": \"%s\", \"flash_kwargs\": "
             "{\"causal\": %s%s%s}, \"copy_free_layout\": %s}",
             c->source == AF_QKV_KEYWORD ? "keyword_qkv" : "positional_qkv", c->is_causal ? "true" : "false", scale,
             gqa ? ", \"pack_gqa\": false" : "", copy_free ? "true" : "false");
    af_provider *p = NULL;
    if (af_provider_from_json(text, strlen(text), &p) != AF_OK) abort();
    return p;
}

static void check_plan_round_trip(af_provider *provider) {
    af_plan plan, again_plan;
    char *text = NULL;
    af_provider *again = NULL;
    if (af_provider_get_plan(provider, &plan) != AF_OK || af_provider_to_json(provider, &text) != AF_OK) abort();
    if (af_provider_from_json(text, strlen(text), &again) != AF_OK || af_provider_get_plan(again, &again_plan) != AF_OK)
        abort();
    if (plan.qkv_source != again_plan.qkv_source || plan.causal != again_plan.causal ||
        plan.has_softmax_scale != again_plan.has_softmax_scale ||
        memcmp(&plan.softmax_scale, &again_plan.softmax_scale, sizeof plan.softmax_scale) != 0 ||
        plan.gqa != again_plan.gqa || plan.copy_free_layout != again_plan.copy_free_layout ||
        plan.backend != again_plan.backend)
        abort();
    af_free(text);
    af_provider_free(again);
}

static void check_samples_round_trip(const af_samples *samples) {
    char *text = NULL, *again_text = NULL;
    af_samples *again = NULL;
    if (af_samples_to_json(samples, &text) != AF_OK) abort();
    if (af_samples_from_json(text, strlen(text), &again) != AF_OK) abort();   /* what we write, we read */
    if (af_samples_count(again) != af_samples_count(samples)) abort();
    if (af_samples_to_json(again, &again_text) != AF_OK || strcmp(text, again_text) != 0) abort();
    af_free(text);
    af_free(again_text);
    af_samples_free(again);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    af_samples *samples = (af_samples *)1;   /* must come back NULL on a refusal */
    const af_status st = af_samples_from_json((const char *)data, size, &samples);
    if (st != AF_OK) {
        if (samples != NULL || st != AF_ERR_PARSE || af_last_error()[0] == '\0') abort();
        return 0;
    }
    check_samples_round_trip(samples);

    af_provider *provider = af_provider_new();
    if (!provider) abort();
    const bool prepared = af_provider_prepare(provider, samples);
    if (prepared != af_provider_is_prepared(provider)) abort();
    if (!prepared && af_provider_reason(provider)[0] == '\0') abort();
    if (prepared) check_plan_round_trip(provider);

    af_samples *rebuilt = af_samples_new();
    if (!rebuilt) abort();
    for (size_t i = 0; i < af_samples_count(samples); i++) {
        af_sample_call call;
        if (af_samples_get_call(samples, i, &call) != AF_OK) {
            if (af_last_error()[0] == '\0') abort();
            continue;
        }
        const af_sdpa_args args = af_sample_call_args(&call);
        (void)af_samples_add_call(rebuilt, &args, call.source, call.device, call.count);   /* may refuse; never crash */
        if (prepared) infer_call(provider, &call);
        for (int copy_free = 0; copy_free < 2; copy_free++) {
            af_provider *matching = plan_matching(&call, copy_free);
            infer_call(matching, &call);
            af_provider_free(matching);
        }
    }
    check_samples_round_trip(rebuilt);
    af_samples_free(rebuilt);
    af_provider_free(provider);
    af_samples_free(samples);
    return 0;
}
