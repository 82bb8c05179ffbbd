/* af_flex_attn and its backward (attnforge.h): FlexAttention on the FlashAttention drivers. The call is checked as
 * SDPA's with grouped heads (af_sdpa_check, af_sdpa_backward_check), its mods as programs (flex/program.h), its block
 * mask as a map of block classes (flex/block_map.h); the drivers and the references evaluate them on the scaled
 * scores of each tile / row, and the drivers skip the tiles the block mask empties. */
#include "core/dtype.h"
#include <string.h>

#include "core/status.h"
#include "flex/block_map.h"
#include "flex/program.h"
#include "kernel/flash.h"
#include "sdpa/backward.h"
#include "sdpa/problem.h"
#include "sdpa/staged.h"

typedef af_status (*forward_fn)(const af_problem *p);
typedef af_status (*backward_fn)(const af_backward_problem *bp);

/* The mods' indices are int32. */
static af_status int32_indices(const af_problem *p) {
    if (p->L > INT32_MAX || p->S > INT32_MAX || p->B > INT32_MAX || p->Hq > INT32_MAX)
        return af_fail(AF_ERR_UNSUPPORTED,
                       "query, key: the mods' indices are int32; B, H, L and S must stay below 2^31");
    return AF_OK;
}

/* What the SDPA checks do not see: CPU tensors, heads that divide rather than broadcast, int32 indices. */
static af_status flex_rules(const af_flex_args *args, const af_problem *p) {
    if (args->query->device.type != AF_DEVICE_CPU)
        return af_fail(AF_ERR_UNSUPPORTED, "query: on cuda:%d; flex attention runs on the CPU only",
                       args->query->device.index);
    if (p->Hq != args->query->shape[1] || p->B != args->query->shape[0])
        return af_fail(AF_ERR_INVALID_ARGUMENT, "key, value: batch and heads must be query's or divide them as "
                       "FlexAttention's (B, Hkv) with Hq a multiple of Hkv, not broadcast beyond query's");
    return int32_indices(p);
}

static af_sdpa_args sdpa_of(const af_flex_args *args) {
    return (af_sdpa_args){.query = args->query, .key = args->key, .value = args->value, .has_scale = args->has_scale,
                          .scale = args->scale, .enable_gqa = true};
}

/* The call's mods and block map into *mods / *blocks for problem p; *mods is released by the caller. */
static af_status take_mods(const af_flex_args *args, af_problem *p, af_mods *mods, af_block_map *blocks) {
    af_status st = af_mods_check(args->score_mod, args->mask_mod, mods);
    if (st != AF_OK) return st;
    if (args->block_mask) {
        if ((st = af_block_map_build(args->block_mask, p->B, p->Hq, p->L, p->S, blocks)) != AF_OK) return st;
        mods->blocks = blocks;
    }
    p->mods = mods->has_score || mods->has_mask || mods->blocks ? mods : NULL;
    return AF_OK;
}

static af_status flex_call(const af_flex_args *args, af_tensor *out, af_tensor *lse, forward_fn forward) {
    af_clear_error();
    if (!args) return af_fail(AF_ERR_INVALID_ARGUMENT, "args: must not be NULL");
    const af_sdpa_args sdpa = sdpa_of(args);
    af_problem p;
    af_status st = af_sdpa_check(&sdpa, out, lse, &p);
    if (st == AF_OK) st = flex_rules(args, &p);
    if (st != AF_OK) return st;
    af_mods mods;
    af_block_map blocks = {0};
    st = take_mods(args, &p, &mods, &blocks);
    if (st == AF_OK) st = af_mods_forward(&p, &mods, out, lse, forward);
    af_block_map_release(&blocks);
    af_mods_release(&mods);
    return st;
}

/* daux: NULL, or for each captured tensor of the score_mod NULL or a float32 CPU tensor of its shape. */
static af_status check_daux(const af_flex_args *args, af_tensor *const *daux) {
    if (!daux) return AF_OK;
    if (!args->score_mod)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "daux: given, but there is no score_mod to capture tensors");
    for (int32_t i = 0; i < args->score_mod->n_aux; i++) {
        const af_tensor *d = daux[i], *a = &args->score_mod->aux[i];
        if (!d) continue;
        if (a->dtype != AF_F32 && a->dtype != AF_F16 && a->dtype != AF_BF16)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "daux[%d]: the score_mod's aux tensor %d is %s and has no gradient",
                           (int)i, (int)i, af_dtype_name(a->dtype));
        if (d->dtype != AF_F32 || d->device.type != AF_DEVICE_CPU)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "daux[%d]: must be a float32 CPU tensor", (int)i);
        bool same = d->ndim == a->ndim && (d->data || a->ndim == 0);
        for (int k = 0; same && k < a->ndim; k++) same = d->shape[k] == a->shape[k] && d->strides[k] >= 0;
        if (!same)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "daux[%d]: must have the shape of the score_mod's aux tensor %d "
                           "(and data, non-negative strides)", (int)i, (int)i);
    }
    return AF_OK;
}

static af_status flex_backward_call(const af_flex_args *args, const af_backward_inputs *in, const af_gradients *grads,
                                    af_tensor *const *daux, backward_fn backward) {
    af_clear_error();
    if (!args) return af_fail(AF_ERR_INVALID_ARGUMENT, "args: must not be NULL");
    const af_sdpa_args sdpa = sdpa_of(args);
    af_backward_problem bp;
    af_status st = af_sdpa_backward_check(&sdpa, in, grads, &bp);
    if (st == AF_OK) st = flex_rules(args, &bp.f);
    if (st == AF_OK) st = check_daux(args, daux);
    if (st != AF_OK) return st;
    bp.daux = daux;
    af_mods mods;
    af_block_map blocks = {0};
    st = take_mods(args, &bp.f, &mods, &blocks);
    if (st == AF_OK) st = af_mods_backward(&bp, &mods, grads, backward);
    af_block_map_release(&blocks);
    af_mods_release(&mods);
    return st;
}

af_status af_flash_take_mods(const af_flash_args *args, af_problem *p, af_mods *mods) {
    memset(mods, 0, sizeof *mods);
    if (!args->score_mod && !args->mask_mod) return AF_OK;
    if (args->query->device.type != AF_DEVICE_CPU)
        return af_fail(AF_ERR_UNSUPPORTED, "score_mod, mask_mod: run on the CPU only; query is on cuda:%d",
                       args->query->device.index);
    if (args->score_mod && args->softcap > 0.0)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "softcap and score_mod cannot be used together");
    af_status st = int32_indices(p);
    if (st == AF_OK) st = af_mods_check(args->score_mod, args->mask_mod, mods);
    if (st != AF_OK) return st;
    if (args->mask_mod) {   /* FA4: the mask_mod replaces causal and window_size */
        p->causal = AF_CAUSAL_NONE;
        p->has_window = false;
    }
    p->mods = mods;
    return AF_OK;
}

af_status af_flex_attn(const af_flex_args *args, af_tensor *out, af_tensor *lse) {
    return flex_call(args, out, lse, af_flash_forward);
}

af_status af_flex_attn_reference(const af_flex_args *args, af_tensor *out, af_tensor *lse) {
    return flex_call(args, out, lse, af_reference_forward);
}

af_status af_flex_attn_backward(const af_flex_args *args, const af_backward_inputs *in, const af_gradients *grads,
                                af_tensor *const *daux) {
    return flex_backward_call(args, in, grads, daux, af_flash_backward);
}

af_status af_flex_attn_backward_reference(const af_flex_args *args, const af_backward_inputs *in,
                                          const af_gradients *grads, af_tensor *const *daux) {
    return flex_backward_call(args, in, grads, daux, af_reference_backward);
}
