/* af_flash_attn test cases: a description (sizes per sequence, K/V form, window, softcap, sink, layouts), the tensors
 * it builds (NHD, packed varlen or paged), the reference on float32 copies of the inputs, and the check of
 * af_flash_attn against it on every ISA and thread count. */
#ifndef AF_TESTS_FLASH_CASE_H
#define AF_TESTS_FLASH_CASE_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "attnforge.h"
#include "test_tensor.h"

#define FLASH_MAX_BATCH 6

typedef enum { KV_FIXED = 0, KV_VARLEN, KV_PAGED } kv_form;

typedef enum { DESCALE_NONE = 0, DESCALE_RANDOM, DESCALE_ZERO, DESCALE_HUGE } descale_kind;

typedef struct {
    uint64_t seed;
    af_dtype dtype;                                    /* of q (float8: q, k and v all in it) */
    af_dtype kv_dtype;                                 /* AF_F8E4M3 / AF_F8E5M2: float8 K/V under a float q;
                                                          anything else: dtype */
    af_dtype out_dtype;                                /* float8 q: out's dtype (f32/f16/bf16); else q's */
    descale_kind descale;                              /* float8: q/k/v_descale, random in [1/4, 4) (some absent),
                                                          or one of them 0, or huge (2^12) */
    int64_t B, Hq, Hkv, E, Ev;
    bool varlen_q;
    kv_form kv;
    int64_t Lq[FLASH_MAX_BATCH], Sk[FLASH_MAX_BATCH];   /* rows and keys per sequence (fixed: all equal) */
    int64_t S_stored[FLASH_MAX_BATCH];                  /* keys stored (>= Sk: seqused_k cuts the rest) */
    bool seqused;                                      /* pass seqused_k (always with paged K/V) */
    int64_t page_size;
    bool shared_page;                                  /* sequences 0 and 1 share their first page */
    bool causal, has_window;
    int64_t left, right;
    double softcap;
    bool sink;
    af_dtype sink_dtype;
    double sink_amplitude;                             /* sink logits uniform in [-a, a) (+ offset) */
    double sink_offset;
    bool has_scale;
    double scale;
    bool with_lse;
    double amplitude;
    tensor_layout q_layout, kv_layout, out_layout;
} flash_case;

typedef struct {
    flash_case c;
    test_tensor q, k, v, out, lse, sink, cu_q, cu_k, seqused_k, page_table, q_descale, k_descale, v_descale;
    test_tensor q32, k32, v32, sink32, ref_out, ref_lse;   /* the reference's float32 inputs and results */
    af_flash_args args, ref_args;
} flash_tensors;

/* A plain case: f32, fixed lengths, no features, given sizes. */
flash_case flash_case_default(int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t E, int64_t Ev);
/* The index-th random case of a suite: every feature cycles through its values. */
flash_case flash_case_random(uint64_t seed, int index);
/* The index-th random float8 case: flash_case_random's features with float8 K/V under an f32/f16/bf16 q, or all of
 * q/k/v float8 (out f32/f16/bf16), e4m3fn and e5m2, with and without descales. */
flash_case flash_case_random_fp8(uint64_t seed, int index);
af_dtype flash_case_kv_dtype(const flash_case *c);
af_dtype flash_case_out_dtype(const flash_case *c);
void flash_case_describe(const flash_case *c, char *buf, size_t size);

bool flash_case_build(const flash_case *c, flash_tensors *t);   /* tensors, and the reference */
bool flash_case_rerun_reference(flash_tensors *t);
void flash_case_free(flash_tensors *t);

/* af_flash_attn on `isa` and `threads` (out/lse first filled with the sentinel). */
af_status flash_case_run(flash_tensors *t, const char *isa, int threads);
/* From now on this process's kernels may compute a softcap's tanh with tanh.approx.f32 (the CUDA Hopper kernel):
 * flash_case_matches allows each logit its documented error, cap·AF_TANH_APPROX_ERROR. */
void flash_case_allow_approximate_tanh(void);
/* out/lse against the reference with af_error_bound (softcap: logits bounded by the cap). */
bool flash_case_matches(const flash_tensors *t, char *why, size_t size);
/* Every ISA, 1 and 2 threads (bitwise equal), nothing written outside out/lse, inputs unchanged. */
bool flash_case_verify_everywhere(flash_tensors *t, char *why, size_t size);
/* Build the case, verify it everywhere, free it: false with the case described and why in `why`. */
bool flash_case_build_and_verify(const flash_case *c, char *why, size_t size);

#endif
