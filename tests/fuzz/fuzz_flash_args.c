/* libFuzzer harness for af_flash_attn's argument checking: q, k, v, sink, the int32 index arrays (cu_seqlens,
 * seqused_k, page_table), out, lse and the float8 descales (q/k/v_descale, after the scalars) decoded from the input
 * with shapes, strides and dtypes (float8 included), data buffers sized exactly to what each view can reach (so ASan
 * sees any stray access: a page index or a prefix sum the checks let through would read outside K/V). Invariants: no
 * crash or sanitizer report; on error out and lse are untouched and there is a message; on success the reference
 * accepts the same call. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"
#include "fuzz_views.h"

#define MAX_VIEW_ELEMENTS (1 << 16)   /* larger views get NULL data */

static void *make_view(byte_reader *r, af_tensor *t, int want_ndim, bool index_array) {
    return make_flash_view(r, t, want_ndim, index_array, MAX_VIEW_ELEMENTS);
}

/* A window side from a byte: a literal -127..127 (FA4: negative too), or -128 for AF_WINDOW_UNBOUNDED. */
static int64_t window_side(uint8_t byte) {
    return byte == 0x80 ? AF_WINDOW_UNBOUNDED : (int64_t)(int8_t)byte;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    byte_reader r = {data, size, 0};
    const uint8_t form = next_byte(&r);   /* bit 0: varlen q; 1: varlen k; 2: paged */
    af_tensor q, k, v, sink, cu_q, cu_k, used, pages, out, lse, descale[3];
    void *mem[13];
    mem[0] = make_view(&r, &q, form & 1 ? 3 : 4, false);
    mem[1] = make_view(&r, &k, form & 2 ? 3 : 4, false);
    mem[2] = make_view(&r, &v, form & 2 ? 3 : 4, false);
    mem[3] = make_view(&r, &sink, 1, false);
    mem[4] = make_view(&r, &cu_q, 1, true);
    mem[5] = make_view(&r, &cu_k, 1, true);
    mem[6] = make_view(&r, &used, 1, true);
    mem[7] = make_view(&r, &pages, 2, true);
    mem[8] = make_view(&r, &out, form & 1 ? 3 : 4, false);
    mem[9] = make_view(&r, &lse, form & 1 ? 2 : 3, false);
    const uint8_t flags = next_byte(&r);   /* scalars read in order (an initialiser's order is unspecified) */
    const int64_t left = window_side(next_byte(&r)), right = window_side(next_byte(&r));
    const double scale = (double)(int8_t)next_byte(&r) / 16.0, softcap = (double)(int8_t)next_byte(&r) / 4.0;
    const int64_t max_q = next_byte(&r), max_k = next_byte(&r);
    af_flash_args args = {.query = &q, .key = &k, .value = &v, .causal = flags & 1, .has_window = flags & 2,
                          .window_left = left, .window_right = right, .has_scale = flags & 4, .scale = scale,
                          .softcap = (flags & 64) ? NAN : (flags & 8) ? softcap : 0.0,
                          .learnable_sink = (flags & 16) ? &sink : NULL,
                          .cu_seqlens_q = (form & 1) ? &cu_q : NULL, .cu_seqlens_k = (form & 2) ? &cu_k : NULL,
                          .max_seqlen_q = max_q, .max_seqlen_k = max_k,
                          .seqused_k = (flags & 32) ? &used : NULL, .page_table = (form & 4) ? &pages : NULL};
    af_tensor *lse_arg = (flags & 128) ? &lse : NULL;
    for (int i = 0; i < 3; i++) mem[10 + i] = make_view(&r, &descale[i], 2, false);
    const uint8_t descales = next_byte(&r);   /* bit i: pass descale[i] (q, k, v) */
    args.q_descale = (descales & 1) ? &descale[0] : NULL;
    args.k_descale = (descales & 2) ? &descale[1] : NULL;
    args.v_descale = (descales & 4) ? &descale[2] : NULL;

    const int64_t out_bytes = reach_bytes(&out, MAX_VIEW_ELEMENTS);
    const int64_t lse_bytes = reach_bytes(&lse, MAX_VIEW_ELEMENTS);
    const size_t out_len = out_bytes > 0 ? (size_t)out_bytes : 0, lse_len = lse_bytes > 0 ? (size_t)lse_bytes : 0;
    uint8_t *before = malloc(out_len + lse_len + 1);
    if (out_len) memcpy(before, mem[8], out_len);
    if (lse_len) memcpy(before + out_len, mem[9], lse_len);
    const af_status st = af_flash_attn(&args, &out, lse_arg);
    if (st != AF_OK) {
        if (out_len && memcmp(before, mem[8], out_len) != 0) abort();                 /* wrote out on error */
        if (lse_len && memcmp(before + out_len, mem[9], lse_len) != 0) abort();      /* wrote lse on error */
        if (af_last_error()[0] == '\0') abort();                                     /* error without a message */
    } else if (af_flash_attn_reference(&args, &out, lse_arg) != AF_OK) {
        abort();   /* the same checks guard both paths */
    }
    free(before);
    for (int i = 0; i < 13; i++) free(mem[i]);
    return 0;
}
