/* Backward-pass test cases over the forward's (case_gen.h, flash_case.h): dout, the gradients in chosen layouts, the
 * reference backward on float32 copies of the inputs, and the check of af_sdpa_backward / af_flash_attn_backward
 * against it on every ISA and thread count.
 *
 * The bound (backward_bound): one gradient element whose reference is `ref` may be off by
 *   2·u(grad)·|ref|  +  ε · A  +  2·(the gradient dtype's subnormal spacing: 2^-24 for f16)
 * where A bounds the sum of the magnitudes of the terms the element sums (so ε·A bounds their accumulated relative
 * errors), with ‖x‖ the largest row norm over the head dim and R_j = Σ_i P_ij the column sum of P over the rows (and
 * a group's heads) that see key j (the reference's dv for dout = 1):
 *   dq:    2·|scale|·max|k|·‖dout‖·‖v‖              (Σ_j |dS_j| <= Σ_j P_j(|dP_j| + |D|) <= 2‖dout‖‖v‖)
 *   dk_j:  2·|scale|·max|q|·‖dout‖·‖v‖·R_j
 *   dv_j:  max|dout|·R_j
 *   dsink: ‖dout‖·‖v‖·(query rows per head)
 * and ε the relative error of each term: the forward's (af_error_bound with unit values: P recomputed from scores and
 * lse), plus 2·u(input) (out rounded to the input dtype in D = rowsum(dout∘out); P and dS rounded to the input dtype
 * before a product, as FlashAttention does), plus f32 accumulation 4·u32·(√Ev + √(rows·group + S)). */
#ifndef AF_TESTS_BACKWARD_CASE_H
#define AF_TESTS_BACKWARD_CASE_H
#include <stdbool.h>
#include <stddef.h>

#include "attnforge.h"
#include "case_gen.h"
#include "flash_case.h"
#include "test_tensor.h"

typedef struct {
    tensor_layout dout, dq, dk, dv;
} grad_layouts;

typedef struct {
    bool flash;
    case_tensors s;                            /* sdpa: the forward case (out, lse written by af_sdpa) */
    flash_tensors f;                           /* flash: the forward case (out, lse written by af_flash_attn) */
    test_tensor dout, dq, dk, dv, dsink;       /* the fast path's: input dtypes, the chosen layouts */
    test_tensor q32, k32, v32, mask32, dout32, ones32;       /* sdpa's float32 copies; dout's (both); dout = 1 */
    test_tensor ref_dq, ref_dk, ref_dv, ref_dsink, column_sum;   /* the reference's, float32 contiguous */
    af_sdpa_args ref_sdpa;
    af_backward_inputs in;
    af_gradients grads;
    bool want[4];                              /* dq, dk, dv, dsink passed to the fast path */
} backward_tensors;

/* Build the case (forward out and lse from the fast forward, dout random in the input dtype), run the reference.
 * False (with af_last_error or a note) when a tensor cannot be made or a reference fails. */
bool backward_build_sdpa(const sdpa_case *c, const grad_layouts *layouts, uint64_t seed, backward_tensors *t);
bool backward_build_flash(const flash_case *c, const grad_layouts *layouts, uint64_t seed, backward_tensors *t);
void backward_free(backward_tensors *t);

/* Random layouts for dout and the gradients (contiguous, transposed, sliced with padding and inner strides). */
grad_layouts backward_random_layouts(uint64_t seed);

/* The fast path on `isa` and `threads`, the gradients first filled with the sentinel. */
af_status backward_run(backward_tensors *t, const char *isa, int threads);
/* The fast path's gradients against the reference with backward_bound. */
bool backward_matches(const backward_tensors *t, char *why, size_t size);
/* Every ISA, 1, 2 and 3 threads (bitwise equal), nothing written outside the gradients' views, inputs unchanged.
 * The ISA in force before is restored. */
bool backward_verify_everywhere(backward_tensors *t, char *why, size_t size);

#endif
