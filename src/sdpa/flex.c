/* af_flex_attn (attnforge.h): FlexAttention's forward on the FlashAttention driver. The call is checked as SDPA's
 * with grouped heads (af_sdpa_check), its mods as programs (flex/program.h), its block mask as a map of block classes
 * (flex/block_map.h); the driver and the reference evaluate them on the scaled scores of each tile / row, and the
 * driver skips the tiles the block mask empties. */
#include "core/status.h"
#include "flex/block_map.h"
#include "flex/program.h"
#include "kernel/flash.h"
#include "sdpa/problem.h"

typedef af_status (*forward_fn)(const af_problem *p);

static af_status flex_call(const af_flex_args *args, af_tensor *out, af_tensor *lse, forward_fn forward) {
    af_clear_error();
    if (!args) return af_fail(AF_ERR_INVALID_ARGUMENT, "args: must not be NULL");
    const af_sdpa_args sdpa = {.query = args->query, .key = args->key, .value = args->value,
                               .has_scale = args->has_scale, .scale = args->scale, .enable_gqa = true};
    af_problem p;
    af_status st = af_sdpa_check(&sdpa, out, lse, &p);
    if (st != AF_OK) return st;
    if (args->query->device.type != AF_DEVICE_CPU)
        return af_fail(AF_ERR_UNSUPPORTED, "query: on cuda:%d; flex attention runs on the CPU only",
                       args->query->device.index);
    if (p.Hq != args->query->shape[1] || p.B != args->query->shape[0])
        return af_fail(AF_ERR_INVALID_ARGUMENT, "key, value: batch and heads must be query's or divide them as "
                       "FlexAttention's (B, Hkv) with Hq a multiple of Hkv, not broadcast beyond query's");
    if (p.L > INT32_MAX || p.S > INT32_MAX || p.B > INT32_MAX || p.Hq > INT32_MAX)
        return af_fail(AF_ERR_UNSUPPORTED,
                       "query, key: the mods' indices are int32; B, H, L and S must stay below 2^31");
    af_mods mods;
    if ((st = af_mods_check(args->score_mod, args->mask_mod, &mods)) != AF_OK) return st;
    af_block_map blocks = {0};
    if (args->block_mask) {
        if ((st = af_block_map_build(args->block_mask, p.B, p.Hq, p.L, p.S, &blocks)) != AF_OK) {
            af_mods_release(&mods);
            return st;
        }
        mods.blocks = &blocks;
    }
    p.mods = mods.has_score || mods.has_mask || mods.blocks ? &mods : NULL;
    st = forward(&p);
    if (st == AF_OK) st = af_mods_status(&mods);
    af_block_map_release(&blocks);
    af_mods_release(&mods);
    return st;
}

af_status af_flex_attn(const af_flex_args *args, af_tensor *out, af_tensor *lse) {
    return flex_call(args, out, lse, af_flash_forward);
}

af_status af_flex_attn_reference(const af_flex_args *args, af_tensor *out, af_tensor *lse) {
    return flex_call(args, out, lse, af_reference_forward);
}
