/* libFuzzer harness for the backward pass's argument checking, both entry points (the first byte picks
 * af_sdpa_backward or af_flash_attn_backward): q, k, v, out, dout, lse, the mask or the sink, the int32 index arrays
 * and dq, dk, dv, dsink decoded from the input with shapes, strides, dtypes and devices, data buffers sized exactly to
 * what each view can reach (ASan sees any stray access; gradients included: the backward writes them). Invariants: no
 * crash or sanitizer report; on error every gradient buffer is untouched and there is a message; the reference and the
 * fast path pass the same checks (either refuses as invalid exactly when the other does, and past the checks only
 * running out of memory may tell them apart). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attnforge.h"
#include "fuzz_views.h"

#define MAX_VIEW_ELEMENTS (1 << 14)   /* larger views get NULL data */

enum { Q, K, V, OUT, DOUT, LSE, MASK, SINK, CU_Q, CU_K, USED, PAGES, DQ, DK, DV, DSINK, N_VIEWS };

static void *make_view(byte_reader *r, af_tensor *t, int want_ndim, bool index_array) {
    return make_flash_view(r, t, want_ndim, index_array, MAX_VIEW_ELEMENTS);
}

/* A window side from a byte: a literal -127..127, or -128 for AF_WINDOW_UNBOUNDED. */
static int64_t window_side(uint8_t byte) { return byte == 0x80 ? AF_WINDOW_UNBOUNDED : (int64_t)(int8_t)byte; }

typedef struct {
    af_tensor views[N_VIEWS];
    void *memory[N_VIEWS];
    size_t grad_bytes[4];
    uint8_t *before[4];
} decoded;

static void snapshot_gradients(decoded *d) {
    for (int g = 0; g < 4; g++) {
        const int64_t bytes = reach_bytes(&d->views[DQ + g], MAX_VIEW_ELEMENTS);
        d->grad_bytes[g] = bytes > 0 && d->views[DQ + g].data ? (size_t)bytes : 0;
        if (d->grad_bytes[g]) memcpy(d->before[g], d->views[DQ + g].data, d->grad_bytes[g]);
    }
}

/* On error: a message, and no gradient byte changed. */
static void check_refusal(const decoded *d, af_status st) {
    if (st == AF_OK) return;
    if (af_last_error()[0] == '\0') abort();
    for (int g = 0; g < 4; g++)
        if (d->grad_bytes[g] && memcmp(d->before[g], d->views[DQ + g].data, d->grad_bytes[g]) != 0) abort();
}

/* The same checks guard both paths: INVALID_ARGUMENT / UNSUPPORTED from one is the other's too; past the checks
 * only NO_MEMORY may differ, and a call on CUDA tensors that passed them goes to the CUDA backend (the reference
 * refuses it as UNSUPPORTED; without a backend or a GPU the fast path says RUNTIME_UNAVAILABLE). */
static void check_agreement(af_status ref, af_status fast, bool on_cuda) {
    if (ref == fast) return;
    if ((ref == AF_OK || ref == AF_ERR_NO_MEMORY) && (fast == AF_OK || fast == AF_ERR_NO_MEMORY)) return;
    if (on_cuda && ref == AF_ERR_UNSUPPORTED && fast == AF_ERR_RUNTIME_UNAVAILABLE) return;
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    byte_reader r = {data, size, 0};
    const uint8_t form = next_byte(&r);   /* bit 0: flash; 1: varlen q; 2: varlen k; 3: paged */
    const bool flash = form & 1, varlen_q = flash && (form & 2), varlen_k = flash && (form & 4);
    const int q_nd = varlen_q ? 3 : 4, k_nd = varlen_k ? 3 : 4;
    const int want[N_VIEWS] = {q_nd, k_nd, k_nd, q_nd, q_nd, varlen_q ? 2 : 3, flash ? 1 : 4, 1, 1, 1, 1, 2,
                               q_nd, k_nd, k_nd, 1};
    decoded d;
    for (int i = 0; i < N_VIEWS; i++) d.memory[i] = make_view(&r, &d.views[i], want[i], i >= CU_Q && i <= PAGES);
    for (int g = 0; g < 4; g++) d.before[g] = malloc((size_t)MAX_VIEW_ELEMENTS * 4 + 8);
    af_tensor *v = d.views;
    const uint8_t flags = next_byte(&r);   /* scalars read in order (an initialiser's order is unspecified) */
    const int64_t left = window_side(next_byte(&r)), right = window_side(next_byte(&r));
    const double scale = (double)(int8_t)next_byte(&r) / 16.0, softcap = (double)(int8_t)next_byte(&r) / 4.0;
    const int64_t max_q = next_byte(&r), max_k = next_byte(&r);
    const uint8_t passed = next_byte(&r);   /* bits 0-3: dq, dk, dv, dsink; 4: in NULL; 5: grads NULL; 6: no lse */
    const af_backward_inputs in = {.out = &v[OUT], .dout = &v[DOUT], .lse = (passed & 64) ? NULL : &v[LSE]};
    const af_gradients grads = {.dq = (passed & 1) ? &v[DQ] : NULL, .dk = (passed & 2) ? &v[DK] : NULL,
                                .dv = (passed & 4) ? &v[DV] : NULL, .dsink = (passed & 8) ? &v[DSINK] : NULL};
    const af_backward_inputs *in_arg = (passed & 16) ? NULL : &in;
    const af_gradients *grads_arg = (passed & 32) ? NULL : &grads;
    af_status ref, fast;
    if (flash) {
        const af_flash_args args = {.query = &v[Q], .key = &v[K], .value = &v[V], .causal = flags & 1,
                                    .has_window = flags & 2, .window_left = left, .window_right = right,
                                    .has_scale = flags & 4, .scale = scale,
                                    .softcap = (flags & 64) ? NAN : (flags & 8) ? softcap : 0.0,
                                    .learnable_sink = (flags & 16) ? &v[SINK] : NULL,
                                    .cu_seqlens_q = varlen_q ? &v[CU_Q] : NULL, .cu_seqlens_k = varlen_k ? &v[CU_K] : NULL,
                                    .max_seqlen_q = max_q, .max_seqlen_k = max_k,
                                    .seqused_k = (flags & 32) ? &v[USED] : NULL,
                                    .page_table = (form & 8) ? &v[PAGES] : NULL};
        snapshot_gradients(&d);
        check_refusal(&d, ref = af_flash_attn_backward_reference(&args, in_arg, grads_arg));
        snapshot_gradients(&d);
        check_refusal(&d, fast = af_flash_attn_backward(&args, in_arg, grads_arg));
    } else {
        const af_sdpa_args args = {.query = &v[Q], .key = &v[K], .value = &v[V], .attn_mask = (flags & 1) ? &v[MASK] : NULL,
                                   .dropout_p = (flags & 2) ? 0.5 : 0.0, .is_causal = flags & 4,
                                   .enable_gqa = flags & 8, .causal_bottom_right = flags & 16,
                                   .has_scale = flags & 32, .scale = (flags & 64) ? NAN : scale};
        snapshot_gradients(&d);
        check_refusal(&d, ref = af_sdpa_backward_reference(&args, in_arg, grads_arg));
        snapshot_gradients(&d);
        check_refusal(&d, fast = af_sdpa_backward(&args, in_arg, grads_arg));
    }
    check_agreement(ref, fast, v[Q].device.type == AF_DEVICE_CUDA);
    for (int g = 0; g < 4; g++) free(d.before[g]);
    for (int i = 0; i < N_VIEWS; i++) free(d.memory[i]);
    return 0;
}
