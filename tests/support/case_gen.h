/* SDPA test cases: a description (sizes, dtype, causality, mask broadcast shape, layouts), the tensors it
 * builds, the double reference, and the check of af_sdpa against it on every ISA and thread count. */
#ifndef AF_TESTS_CASE_GEN_H
#define AF_TESTS_CASE_GEN_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "attnforge.h"
#include "sdpa/tolerance.h"
#include "test_tensor.h"

typedef enum { MASK_NONE = 0, MASK_BOOL, MASK_ADDITIVE } mask_kind;

/* A mask's broadcast shape as letters, right-aligned against (B, Hq, L, S): "LS" is (L, S), "B1LS" is
 * (B, 1, L, S), "" is a 0-d mask, '1' a broadcast dim. */
extern const char *const mask_shapes[];
extern const int mask_shape_count;

typedef struct {
    uint64_t seed;                    /* of the data */
    af_dtype dtype;
    int64_t B, Hq, Hkv, L, S, E, Ev;
    bool is_causal, causal_bottom_right, enable_gqa;
    bool has_scale;
    double scale;
    mask_kind mask;
    const char *mask_shape;           /* one of mask_shapes */
    bool mask_expanded;               /* the mask as a 4-D (B, Hq, L, S) view with zero strides on its '1' dims */
    double mask_keep;                 /* bool: chance of true; additive: chance of a finite (not -inf) entry */
    double masked_row_rate;           /* chance that a mask row is masked entirely */
    tensor_layout q_layout, k_layout, v_layout, out_layout, mask_layout, lse_layout;
    bool with_lse;
    double amplitude;                 /* q, k and v uniform in [-amplitude, amplitude) */
} sdpa_case;

/* A valid default case: f32, no mask, contiguous, lse on, given sizes. */
sdpa_case case_default(int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t E, int64_t Ev);

/* The index-th random case of the suite seeded by `seed`: categorical features cycle so each appears, sizes are
 * random within a work budget (the reference is slow). Every `split_every`-th case is a split-KV decode shape. */
sdpa_case case_random(uint64_t seed, int index, int split_every);

/* True when this case's shape makes driver.c split the keys (decode: L·Hq/Hkv <= 64 rows and S > 1024). */
bool case_is_split_kv(const sdpa_case *c);

void case_describe(const sdpa_case *c, char *buf, size_t size);

typedef struct {
    sdpa_case c;
    test_tensor q, k, v, mask, out, lse;
    test_tensor ref_out, ref_lse;     /* the double reference, written as f32, contiguous */
    af_sdpa_args args;
} case_tensors;

/* Allocate and fill every tensor of the case, and run the reference. False on allocation/reference failure. */
bool case_build(const sdpa_case *c, case_tensors *t);
/* Re-run the reference after a test changed the inputs (NaN, Inf, ...). */
bool case_rerun_reference(case_tensors *t);
void case_free(case_tensors *t);

/* A suite's size and seed: ATTNFORGE_TEST_CASES (a positive count) / ATTNFORGE_TEST_SEED when set, else the
 * defaults given. */
int case_suite_count(int default_count);
uint64_t case_suite_seed(uint64_t default_seed);

/* What af_error_bound needs for the case: the largest |v|, and a bound on |logit| (scale·‖q‖·‖k‖ plus the largest
 * |mask|), from the case's input tensors. */
af_error_scale case_error_scale(const case_tensors *t);

/* The ISAs this machine has among portable, avx2, avx512, amx: every one the registry and CPU offer. */
#define CASE_MAX_ISAS 4
int case_isas(const char **names, int capacity);

/* The first of the {1, 2} thread counts each case runs: 2 when ATTNFORGE_TEST_LIGHT is set (valgrind's runs, ~50x
 * slower: every kernel path once, threaded; the bitwise 1-vs-2-thread check is left to the normal and ASan runs). */
int case_first_threads(void);

/* Fill out and lse with the sentinel, pick `isa` and `threads`, run af_sdpa. */
af_status case_run_kernel(case_tensors *t, const char *isa, int threads);

/* af_sdpa's out/lse against the reference, element by element, with af_error_bound: NaN only where the reference
 * has NaN, infinities exactly. On failure `why` says where and by how much. worst_ratio: max error / bound. */
bool case_matches_reference(const case_tensors *t, double *worst_ratio, char *why, size_t size);

/* The whole check: on every ISA and for 1 and 2 threads, af_sdpa succeeds, matches the reference, writes nothing
 * outside out's and lse's views, leaves the inputs alone, and gives bitwise the same out/lse for both thread
 * counts. Leaves the last run's result in t->out / t->lse. */
bool case_verify_everywhere(case_tensors *t, char *why, size_t size);

/* Tolerance of one lse element: lse = m + ln(l), so its error is l's relative error plus the logits' error, i.e.
 * af_error_bound of an output with unit values, plus the rounding of lse itself to f32. */
double case_lse_bound(const case_tensors *t, double ref);
/* Tolerance of one out element whose reference value is `ref`: af_error_bound with this case's scale. */
double case_out_bound(const case_tensors *t, double ref);

#endif
