/* The accepted subset: one sample -> the seed's plan tuple, checked in the seed's order with its messages. */
#ifndef AF_PROVIDER_PLAN_H
#define AF_PROVIDER_PLAN_H
#include <stdbool.h>
#include <stddef.h>

#include "provider/sample.h"

#define AF_PROVIDER_TYPE "FlashAttention4KernelProvider"

/* Why a sample was refused: the rule (the seed's wording, "FlashAttention-4 provider ...") and what broke it. */
typedef struct {
    char message[1024];
    char detail[512];
} af_refusal;

/* The seed's _sample_replacement_plan plus attnforge's kernel checks (device, dtype, head dims, strides,
 * sizes). Never runs or loads anything. */
bool af_sample_plan(const af_sample *sample, af_plan *plan, af_refusal *why);

bool af_plan_equal(const af_plan *a, const af_plan *b);
/* The first field where `b` differs from `a`, e.g. "is_causal true vs false". */
void af_plan_difference(const af_plan *a, const af_plan *b, char *text, size_t size);

const char *af_qkv_source_name(af_qkv_source source);   /* "positional_qkv", "keyword_qkv" */
const char *af_backend_name(af_backend backend);         /* "cpu", "cuda", "fa4" */

#endif
