/* libFuzzer harness for af_flex_attn, its backward and af_create_block_mask: q, k, v, out and lse views decoded from
 * the input as af_flash_attn's harness does, then a score_mod and a mask_mod of up to 24 instructions each (any
 * operation number, any register and aux index, constants from bytes) with up to two aux tensors (any dtype, 1-4
 * dims, sized exactly to what they reach), and now and then a block mask (block sizes and its four index tensors from
 * bytes: counts and indices anything). Invariants: no crash or sanitizer report (a LOAD the checks let through must
 * stay inside its tensor, a block index inside the map); on error a message, and out and lse untouched unless the
 * error is a LOAD outside its tensor (found while the kernels run, attnforge.h); on success the reference accepts
 * the same call, and the backward of the same call runs or fails with a message; af_create_block_mask on the
 * mask_mod with sizes from bytes writes its outputs only when it succeeds. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"
#include "fuzz_views.h"

#define MAX_VIEW_ELEMENTS (1 << 14)
#define MAX_CODE 24

typedef struct {
    af_mod_instr code[MAX_CODE];
    af_tensor aux[2];
    void *mem[2];
    af_mod_program program;
} fuzz_mod;

/* A program from the bytes: its length (0: absent), then per instruction op, four registers, aux and a constant. */
static const af_mod_program *make_mod(byte_reader *r, fuzz_mod *m) {
    memset(m, 0, sizeof *m);
    const int length = next_byte(r) % (MAX_CODE + 1);
    const int n_aux = next_byte(r) % 3;
    for (int t = 0; t < n_aux; t++) m->mem[t] = make_flash_view(r, &m->aux[t], 1 + next_byte(r) % 4, false,
                                                                 MAX_VIEW_ELEMENTS);
    for (int i = 0; i < length; i++) {
        af_mod_instr *in = &m->code[i];
        in->op = next_byte(r) % (AF_MOD_OP_COUNT + 2);                   /* past the last: unknown */
        for (int k = 0; k < 4; k++) in->in[k] = (int8_t)next_byte(r) % 40;  /* negative and later ones too */
        in->aux = (int8_t)next_byte(r) % 3;
        in->imm = (double)(int8_t)next_byte(r) / ((next_byte(r) & 1) ? 1.0 : 8.0);
    }
    m->program = (af_mod_program){m->code, length, n_aux ? m->aux : NULL, n_aux};
    return length ? &m->program : NULL;
}

/* The call's backward with dout = out and float32 gradients of q, k and v's shapes: runs, or fails with a message. */
static void backward(const af_flex_args *args, const af_tensor *q, const af_tensor *k, const af_tensor *v,
                     const af_tensor *out, const af_tensor *lse) {
    const af_tensor *src[3] = {q, k, v};
    af_tensor g[3];
    void *mem[3] = {NULL, NULL, NULL};
    bool ok = true;
    for (int t = 0; t < 3; t++) {
        int64_t n = 1;
        for (int d = 0; d < 4; d++) n *= src[t]->shape[d] > 0 ? src[t]->shape[d] : 1;
        ok = ok && n <= MAX_VIEW_ELEMENTS && (mem[t] = calloc((size_t)n, 4));
        if (ok) g[t] = af_tensor_contiguous(mem[t], AF_F32, 4, src[t]->shape);
    }
    if (ok) {
        const af_backward_inputs in = {out, out, lse};
        const af_gradients grads = {&g[0], &g[1], &g[2], NULL};
        if (af_flex_attn_backward(args, &in, &grads, NULL) != AF_OK && af_last_error()[0] == '\0') abort();
    }
    for (int t = 0; t < 3; t++) free(mem[t]);
}

/* af_create_block_mask on the mask_mod with small sizes from the bytes, into index views from the bytes: the outputs
 * are written only when the call succeeds, and an error has a message. */
static void create_block_mask(byte_reader *r, const af_mod_program *mask_mod) {
    const int64_t B = next_byte(r) % 4, H = next_byte(r) % 4, L = next_byte(r) % 90, S = next_byte(r) % 90;
    const int64_t qb = (int8_t)next_byte(r) % 40, kb = (int8_t)next_byte(r) % 40;
    af_tensor t[4];
    void *mem[4];
    int64_t len[4];
    uint8_t *saved[4];
    for (int i = 0; i < 4; i++) {
        mem[i] = make_flash_view(r, &t[i], i % 2 ? 4 : 3, true, MAX_VIEW_ELEMENTS);
        const int64_t bytes = reach_bytes(&t[i], MAX_VIEW_ELEMENTS);
        len[i] = bytes > 0 && t[i].data ? bytes : 0;
        saved[i] = malloc((size_t)len[i] + 1);
        if (len[i]) memcpy(saved[i], t[i].data, (size_t)len[i]);
    }
    const bool full = next_byte(r) & 1;
    const af_block_mask_tensors out = {&t[0], &t[1], full ? &t[2] : NULL, full ? &t[3] : NULL};
    if (af_create_block_mask(mask_mod, B, H, L, S, qb, kb, &out) != AF_OK) {
        if (af_last_error()[0] == '\0') abort();
        for (int i = 0; i < 4; i++)
            if (len[i] && memcmp(saved[i], t[i].data, (size_t)len[i]) != 0) abort();   /* wrote an output */
    }
    for (int i = 0; i < 4; i++) {
        free(mem[i]);
        free(saved[i]);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    byte_reader r = {data, size, 0};
    af_tensor q, k, v, out, lse;
    void *mem[5];
    mem[0] = make_flash_view(&r, &q, 4, false, MAX_VIEW_ELEMENTS);
    mem[1] = make_flash_view(&r, &k, 4, false, MAX_VIEW_ELEMENTS);
    mem[2] = make_flash_view(&r, &v, 4, false, MAX_VIEW_ELEMENTS);
    mem[3] = make_flash_view(&r, &out, 4, false, MAX_VIEW_ELEMENTS);
    mem[4] = make_flash_view(&r, &lse, 3, false, MAX_VIEW_ELEMENTS);
    const uint8_t flags = next_byte(&r);
    const double scale = (double)(int8_t)next_byte(&r) / 16.0;
    fuzz_mod score, mask;
    af_flex_args args = {.query = &q, .key = &k, .value = &v, .has_scale = flags & 1, .scale = scale};
    args.score_mod = make_mod(&r, &score);
    args.mask_mod = make_mod(&r, &mask);
    af_tensor blocks_t[4];
    void *blocks_mem[4] = {NULL, NULL, NULL, NULL};
    af_block_mask blocks;
    if (flags & 4) {   /* a block mask: sizes mostly small, now and then 0 or negative */
        blocks.q_block = (int8_t)next_byte(&r) % 70;
        blocks.kv_block = (int8_t)next_byte(&r) % 70;
        for (int t = 0; t < 4; t++)
            blocks_mem[t] = make_flash_view(&r, &blocks_t[t], t % 2 ? 4 : 3, true, MAX_VIEW_ELEMENTS);
        blocks.kv_num_blocks = &blocks_t[0];
        blocks.kv_indices = &blocks_t[1];
        blocks.full_kv_num_blocks = (flags & 8) ? &blocks_t[2] : NULL;
        blocks.full_kv_indices = (flags & 8) ? &blocks_t[3] : NULL;
        args.block_mask = &blocks;
    }
    af_tensor *lse_arg = (flags & 2) ? &lse : NULL;

    const int64_t out_bytes = reach_bytes(&out, MAX_VIEW_ELEMENTS), lse_bytes = reach_bytes(&lse, MAX_VIEW_ELEMENTS);
    const size_t out_len = out_bytes > 0 ? (size_t)out_bytes : 0, lse_len = lse_bytes > 0 ? (size_t)lse_bytes : 0;
    uint8_t *before = malloc(out_len + lse_len + 1);
    if (out_len) memcpy(before, mem[3], out_len);
    if (lse_len) memcpy(before + out_len, mem[4], lse_len);
    const af_status st = af_flex_attn(&args, &out, lse_arg);
    if (st != AF_OK) {
        const bool while_running = strstr(af_last_error(), "outside its shape") != NULL;
        if (!while_running && out_len && memcmp(before, mem[3], out_len) != 0) abort();             /* wrote out */
        if (!while_running && lse_len && memcmp(before + out_len, mem[4], lse_len) != 0) abort();  /* wrote lse */
        if (af_last_error()[0] == '\0') abort();                                                   /* no message */
    } else if (af_flex_attn_reference(&args, &out, lse_arg) != AF_OK) {
        abort();   /* the same checks guard both paths */
    } else if ((flags & 32) && lse_arg) {
        backward(&args, &q, &k, &v, &out, lse_arg);
    }
    if ((flags & 16) && args.mask_mod) create_block_mask(&r, args.mask_mod);
    free(before);
    for (int t = 0; t < 4; t++) free(blocks_mem[t]);
    for (int i = 0; i < 5; i++) free(mem[i]);
    for (int t = 0; t < 2; t++) {
        free(score.mem[t]);
        free(mask.mem[t]);
    }
    return 0;
}
