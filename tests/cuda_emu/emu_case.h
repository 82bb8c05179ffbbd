/* What the emulated kernel tests share: device copies of a case's tensors, the run of one kernel on them with the
 * checks every launch must pass (inputs unchanged, nothing written outside out's and lse's views, out/lse against
 * the double reference), and the cmocka group of targeted tests plus a seeded random suite. */
#ifndef AF_TESTS_EMU_CASE_H
#define AF_TESTS_EMU_CASE_H
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "case_gen.h"
#include "cuda/device.h"
#include "flash_case.h"
#include "sdpa/problem.h"

/* The device copy of a test tensor: its whole backing buffer (poison included, so a read outside the view shows up
 * as NaN), and the view moved onto it. */
typedef struct {
    unsigned char *memory;
    af_tensor view;
} emu_device_tensor;

/* A tensor the case does not use (no memory: no mask) gets an empty copy and is never copied back or compared. */
bool emu_to_device(const test_tensor *t, emu_device_tensor *d);
bool emu_from_device(test_tensor *t, const emu_device_tensor *d);
bool emu_device_unchanged(const test_tensor *t, const emu_device_tensor *d);

/* Memory that meets the tensor-core paths' preconditions (last dim contiguous, the other strides multiples of 8
 * elements, a 16-byte aligned start): as built, SWAPPED (the two dims before the last swapped in memory: BHLD <->
 * BLHD; varlen (total, H, D) as (H, total, D)), PADDED (every dim padded, rows to a multiple of 8 plus 8 more, the
 * start 8 elements into the buffer). */
typedef enum { ALIGNED_CONTIGUOUS = 0, ALIGNED_SWAPPED, ALIGNED_PADDED, ALIGNED_COUNT } aligned_layout;
const char *emu_layout_name(aligned_layout layout);

/* Re-lays a 3-D or 4-D test tensor out as `layout`, keeping its values (its views follow). False when out of memory. */
bool emu_relayout(test_tensor *t, aligned_layout layout);
/* q as `layout`, k and v as the next two (cycling). */
bool emu_relayout_qkv(test_tensor *q, test_tensor *k, test_tensor *v, aligned_layout layout);

/* A test's change to a built case's inputs (NaN, Inf, strides, ...). */
typedef void (*emu_case_edit)(case_tensors *t);

/* Applies `edit` (none: NULL) and re-runs the reference on the changed inputs. False when the reference fails. */
bool emu_edit_case(case_tensors *t, emu_case_edit edit);

/* Enqueues the kernel under test on the checked problem (device views), on the default stream. */
typedef cudaError_t (*emu_launch_fn)(const af_problem *p, void *context);

/* Sentinel-filled out/lse; q, k, v, mask, out, lse copied to the device; af_sdpa_check on the device views;
 * `launch`; synchronize; out/lse copied back. Then: inputs unchanged, nothing written outside out's and lse's
 * views, no lse written when none was asked for, out/lse within the reference's tolerance. False with `why`. */
bool emu_run_case(case_tensors *t, emu_launch_fn launch, void *context, char *why, size_t size);

/* What a flash run lets a test do: after af_flash_check on the device views (`inputs`: the device copies of q, k,
 * v, sink, cu_seqlens_q, cu_seqlens_k, seqused_k and the page table), and before out/lse are compared with the
 * reference. Each NULL for none; false stops the run with `why`. */
typedef struct {
    bool (*after_check)(flash_tensors *t, emu_device_tensor *inputs, void *context, char *why, size_t size);
    bool (*before_compare)(flash_tensors *t, void *context, char *why, size_t size);
    void *context;
} emu_flash_hooks;

/* emu_run_case for an af_flash_attn case: sentinel-filled out/lse, every input copied to the device, af_flash_check
 * on the device views, `launch`, synchronize, copy back; then inputs unchanged, nothing written outside out's and
 * lse's views, out/lse against the reference (flash_case_matches). `hooks` may be NULL. False with `why`. */
bool emu_run_flash(flash_tensors *t, emu_launch_fn launch, void *context, const emu_flash_hooks *hooks, char *why,
                   size_t size);

/* Shrinks a random case to `work_budget` = B·Hq·L·S·(E+Ev): the batch first, then the longer sequence. */
void emu_shrink_case(sdpa_case *c, double work_budget);

/* Writes the index-th random item (item_size bytes) of the suite seeded by `seed`. */
typedef void (*emu_make_item_fn)(uint64_t seed, int index, void *item);

/* Runs cmocka group `group`: the `fixed` tests, then case_suite_count(default_count) tests random_case_NNN of
 * `random_test`, each with its item (made by `make`, seed case_suite_seed(default_seed)) as initial state.
 * Returns the number of failures, 1 when out of memory. */
int emu_run_suite(const char *group, const struct CMUnitTest *fixed, int fixed_count, emu_make_item_fn make,
                  size_t item_size, CMUnitTestFunction random_test, int default_count, uint64_t default_seed);

#endif
