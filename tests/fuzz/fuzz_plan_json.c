/* libFuzzer harness for the plan reader: af_provider_from_json on arbitrary bytes.
 * Invariants: no crash, leak or sanitizer report; a refusal is AF_ERR_PARSE with a message and no provider;
 * an accepted plan is prepared, and to_json -> from_json gives the same plan and the same text again. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"

static bool same_plan(const af_plan *a, const af_plan *b) {
    return a->qkv_source == b->qkv_source && a->causal == b->causal && a->has_softmax_scale == b->has_softmax_scale &&
           memcmp(&a->softmax_scale, &b->softmax_scale, sizeof a->softmax_scale) == 0 && a->gqa == b->gqa &&
           a->copy_free_layout == b->copy_free_layout && a->backend == b->backend;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    af_provider *provider = (af_provider *)1;   /* must come back NULL on a refusal */
    const af_status st = af_provider_from_json((const char *)data, size, &provider);
    if (st != AF_OK) {
        if (provider != NULL || st != AF_ERR_PARSE || af_last_error()[0] == '\0') abort();
        return 0;
    }
    af_plan plan, again_plan;
    if (!af_provider_is_prepared(provider) || af_provider_get_plan(provider, &plan) != AF_OK) abort();
    if (!plan.has_softmax_scale && plan.softmax_scale != 0.0) abort();   /* no stale scale behind the flag */
    if (!af_provider_name(provider)[0]) abort();

    char *text = NULL, *again_text = NULL;
    af_provider *again = NULL;
    if (af_provider_to_json(provider, &text) != AF_OK) abort();
    if (af_provider_from_json(text, strlen(text), &again) != AF_OK) abort();   /* what we write, we read */
    if (af_provider_get_plan(again, &again_plan) != AF_OK || !same_plan(&plan, &again_plan)) abort();
    if (af_provider_to_json(again, &again_text) != AF_OK || strcmp(text, again_text) != 0) abort();

    af_free(text);
    af_free(again_text);
    af_provider_free(again);
    af_provider_free(provider);
    return 0;
}
