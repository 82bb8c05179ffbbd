/* af_create_block_mask (attnforge.h): a mask_mod's block classes in O(blocks) memory. Each (batch, head, query block)
 * row is a work item: its blocks are settled by the program's interval bounds (bounds.h) where they decide, else by
 * evaluating the program on the block's scores, a row of keys at a time, stopping once the block is known to be
 * partial. Classes go to a scratch map first, so that the outputs are written only when the whole call succeeds. */
#include <string.h>

#include "core/alloc.h"
#include "core/status.h"
#include "core/threadpool.h"
#include "flex/block_map.h"
#include "flex/bounds.h"
#include "flex/program.h"

#define EVAL_KEYS 256   /* keys the program is evaluated on at a time */

typedef struct {
    af_mods mods;          /* the mask alone */
    int64_t B, H, L, S, q_block, kv_block, nq, nk;
    int64_t Bs, Hs;        /* batches and heads the classes depend on: 1 when the program does not read b / h */
    bool split_full;
    uint8_t *cls;          /* [Bs][Hs][nq][nk] */
    size_t bounds_offset;  /* scratch: registers, then keys' scores, then the program's bounds */
} build;

/* Whether the program keeps the scores of rows [q0, q1], keys [k0, k1] all (FULL), none (EMPTY) or some. */
static int block_class(build *c, int64_t b, int64_t h, int64_t q0, int64_t q1, int64_t k0, int64_t k1, float *regs,
                       float *s, af_bound *bounds) {
    const int known = af_mod_block_bounds(&c->mods.mask, b, h, q0, q1, k0, k1, bounds);
    if (known != AF_BOUND_UNKNOWN) return known == AF_BOUND_ALWAYS ? AF_BLOCK_FULL : AF_BLOCK_EMPTY;
    bool kept = false, removed = false;
    for (int64_t q = q0; q <= q1; q++)
        for (int64_t j = k0; j <= k1; j += EVAL_KEYS) {
            const int n = (int)(k1 + 1 - j < EVAL_KEYS ? k1 + 1 - j : EVAL_KEYS);
            memset(s, 0, sizeof(float) * (size_t)n);
            af_mods_apply_row(&c->mods, b, h, q, j, n, s, regs, EVAL_KEYS);
            for (int k = 0; k < n; k++) {
                if (s[k] == 0.0f) kept = true;
                else removed = true;
            }
            if (kept && removed) return AF_BLOCK_PARTIAL;
        }
    return kept ? AF_BLOCK_FULL : AF_BLOCK_EMPTY;
}

static void classify_row(void *ctx, int64_t t, void *scratch) {
    build *c = ctx;
    const int64_t qb = t % c->nq, h = t / c->nq % c->Hs, b = t / c->nq / c->Hs;
    float *regs = (float *)scratch + 16;   /* past the 64 bytes the pool zeroes for its own use */
    float *s = regs + af_mods_scratch_floats(&c->mods, 1, EVAL_KEYS);
    af_bound *bounds = (af_bound *)((char *)scratch + c->bounds_offset);
    uint8_t *row = c->cls + (size_t)t * (size_t)c->nk;
    const int64_t q0 = qb * c->q_block, q1 = (q0 + c->q_block < c->L ? q0 + c->q_block : c->L) - 1;
    for (int64_t kb = 0; kb < c->nk; kb++) {
        const int64_t k0 = kb * c->kv_block, k1 = (k0 + c->kv_block < c->S ? k0 + c->kv_block : c->S) - 1;
        int cls = block_class(c, b, h, q0, q1, k0, k1, regs, s, bounds);
        /* PyTorch pads the mask with False past L and S: a block reaching past them is at most partial, and
         * without separate full blocks every non-empty one is partial */
        const bool whole = q0 + c->q_block <= c->L && k0 + c->kv_block <= c->S;
        if (cls == AF_BLOCK_FULL && (!whole || !c->split_full)) cls = AF_BLOCK_PARTIAL;
        row[kb] = (uint8_t)cls;
    }
}

static af_status check_out(const af_tensor *t, const char *name, int ndim, const int64_t *shape) {
    if (!t) return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: must not be NULL", name);
    if (t->device.type != AF_DEVICE_CPU) return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: must be on the CPU", name);
    if (t->dtype != AF_I32) return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: must be int32", name);
    bool same = t->ndim == ndim;
    for (int k = 0; same && k < ndim; k++) same = t->shape[k] == shape[k] && t->strides[k] >= 0;
    if (!same)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "%s: must be (%lld, %lld, %lld%s) with non-negative strides", name,
                       (long long)shape[0], (long long)shape[1], (long long)shape[2], ndim == 4 ? ", nk" : "");
    return AF_OK;
}

static void put(af_tensor *t, const int64_t *idx, int32_t v) {
    int64_t off = 0;
    for (int k = 0; k < t->ndim; k++) off += idx[k] * t->strides[k];
    memcpy((char *)t->data + off * 4, &v, 4);
}

/* One row's list of blocks of class `cls`: their count, then them in increasing order, then the others. */
static void write_row(af_tensor *num, af_tensor *ind, int64_t b, int64_t h, int64_t q, const uint8_t *row, int64_t nk,
                      int cls) {
    int32_t n = 0;
    for (int64_t k = 0; k < nk; k++)
        if (row[k] == cls) put(ind, (int64_t[]){b, h, q, n++}, (int32_t)k);
    put(num, (int64_t[]){b, h, q}, n);
    for (int64_t k = 0; k < nk; k++)
        if (row[k] != cls) put(ind, (int64_t[]){b, h, q, n++}, (int32_t)k);
}

af_status af_create_block_mask(const af_mod_program *mask_mod, int64_t B, int64_t H, int64_t L, int64_t S,
                               int64_t q_block, int64_t kv_block, const af_block_mask_tensors *out) {
    af_clear_error();
    if (!mask_mod) return af_fail(AF_ERR_INVALID_ARGUMENT, "mask_mod: must not be NULL");
    if (!out) return af_fail(AF_ERR_INVALID_ARGUMENT, "out: must not be NULL");
    if (B < 1 || H < 1 || L < 0 || S < 0 || B > INT32_MAX || H > INT32_MAX || L > INT32_MAX || S > INT32_MAX)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "B, H, L, S: %lld, %lld, %lld, %lld; B and H must lie in [1, 2^31), "
                       "L and S in [0, 2^31) (the program's indices are int32)", (long long)B, (long long)H,
                       (long long)L, (long long)S);
    if (q_block < 1 || kv_block < 1 || q_block > INT32_MAX || kv_block > INT32_MAX)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "q_block, kv_block: %lld x %lld; both must lie in [1, 2^31)",
                       (long long)q_block, (long long)kv_block);
    const int64_t nq = (L + q_block - 1) / q_block, nk = (S + kv_block - 1) / kv_block;
    const int64_t s3[3] = {B, H, nq}, s4[4] = {B, H, nq, nk};
    const bool split_full = out->full_kv_num_blocks || out->full_kv_indices;
    af_status st;
    if ((st = check_out(out->kv_num_blocks, "kv_num_blocks", 3, s3)) != AF_OK ||
        (st = check_out(out->kv_indices, "kv_indices", 4, s4)) != AF_OK)
        return st;
    if (split_full && ((st = check_out(out->full_kv_num_blocks, "full_kv_num_blocks", 3, s3)) != AF_OK ||
                       (st = check_out(out->full_kv_indices, "full_kv_indices", 4, s4)) != AF_OK))
        return st;
    build c = {.B = B, .H = H, .L = L, .S = S, .q_block = q_block, .kv_block = kv_block, .nq = nq, .nk = nk,
               .split_full = split_full};
    if ((st = af_mods_check(NULL, mask_mod, &c.mods)) != AF_OK) return st;
    c.Bs = c.mods.mask.reads_input[1] ? B : 1;
    c.Hs = c.mods.mask.reads_input[2] ? H : 1;
    const int64_t rows = c.Bs * c.Hs * nq;
    if (nk > 0 && rows > ((int64_t)1 << 40) / nk) {
        af_mods_release(&c.mods);
        return af_fail(AF_ERR_NO_MEMORY, "out of memory: %lld x %lld blocks", (long long)rows, (long long)nk);
    }
    if (!(c.cls = af_alloc((size_t)(rows * nk) + 1))) {
        af_mods_release(&c.mods);
        return af_fail(AF_ERR_NO_MEMORY, "out of memory: %lld x %lld blocks", (long long)rows, (long long)nk);
    }
    const size_t floats = af_mods_scratch_floats(&c.mods, 1, EVAL_KEYS) + EVAL_KEYS;
    c.bounds_offset = (64 + sizeof(float) * floats + 63) / 64 * 64;
    const size_t scratch = c.bounds_offset + sizeof(af_bound) * (size_t)c.mods.mask.n_regs;
    st = af_parallel_for(rows, classify_row, &c, scratch);
    if (st == AF_OK) st = af_mods_status(&c.mods);
    if (st == AF_OK)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t q = 0; q < nq; q++) {
                    const int64_t t = ((c.Bs == 1 ? 0 : b) * c.Hs + (c.Hs == 1 ? 0 : h)) * nq + q;
                    const uint8_t *row = c.cls + (size_t)t * (size_t)nk;
                    write_row(out->kv_num_blocks, out->kv_indices, b, h, q, row, nk, AF_BLOCK_PARTIAL);
                    if (split_full)
                        write_row(out->full_kv_num_blocks, out->full_kv_indices, b, h, q, row, nk, AF_BLOCK_FULL);
                }
    af_free(c.cls);
    af_mods_release(&c.mods);
    return st;
}
