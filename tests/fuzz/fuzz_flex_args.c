/* libFuzzer harness for af_flex_attn: q, k, v, out and lse views decoded from the input as af_flash_attn's harness
 * does, then a score_mod and a mask_mod of up to 24 instructions each (any operation number, any register and aux
 * index, constants from bytes) with up to two aux tensors (any dtype, 1-4 dims, sized exactly to what they reach).
 * Invariants: no crash or sanitizer report (a LOAD the checks let through must stay inside its tensor); on error a
 * message, and out and lse untouched unless the error is a LOAD outside its tensor (found while the kernels run,
 * attnforge.h); on success the reference accepts the same call. */
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
    }
    free(before);
    for (int i = 0; i < 5; i++) free(mem[i]);
    for (int t = 0; t < 2; t++) {
        free(score.mem[t]);
        free(mask.mem[t]);
    }
    return 0;
}
