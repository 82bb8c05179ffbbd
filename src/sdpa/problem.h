/* One SDPA call after the boundary checks: sizes, base pointers and element strides the kernels trust.
 * af_sdpa fills the first part; af_flash_attn (flash_args.c) also the FlashAttention features after it, which
 * af_sdpa leaves zero (off). Sequence b's rows, keys and key range come from the helpers below, never from B/L/S
 * directly: with varlen or paged K/V, L and S are only the longest sequence's. */
#ifndef AF_SDPA_PROBLEM_H
#define AF_SDPA_PROBLEM_H
#include <stdbool.h>
#include <stdint.h>

#include "attnforge.h"

typedef enum { AF_CAUSAL_NONE = 0, AF_CAUSAL_TOP_LEFT, AF_CAUSAL_BOTTOM_RIGHT } af_causal;

/* The helpers below are also the CUDA kernels' (src/cuda/): callable from device code when nvcc compiles them. */
#if defined(__CUDACC__)
#define AF_HOST_DEVICE __host__ __device__
#else
#define AF_HOST_DEVICE
#endif

typedef struct {
    af_dtype dtype;                 /* of q */
    af_dtype kv_dtype;              /* of k and v: dtype, or float8 (af_flash_attn's quantised K/V) */
    af_dtype out_dtype;             /* of out: dtype (as asked for float8 q: f32/f16/bf16), f32 for the reference */
    int64_t B, Hq, Hkv, L, S, E, Ev;
    int64_t group;                  /* Hq / Hkv: query head h reads key/value head h / group */
    const char *q, *k, *v;          /* base pointers */
    int64_t q_stride[4], k_stride[4], v_stride[4];   /* elements, dims (B, H, seq, head_dim) */
    char *out;
    int64_t out_stride[4];
    float *lse;                     /* NULL or f32 (B, Hq, L) */
    int64_t lse_stride[3];
    const char *mask;               /* NULL, or broadcast to (B, Hq, L, S) by zero strides */
    af_dtype mask_dtype;            /* AF_BOOL (true = attend) or additive in `dtype` */
    int64_t mask_stride[4];
    af_causal causal;
    double scale;

    /* ---- FlashAttention features (af_flash_attn); zero = off. NHD tensors arrive with permuted strides. */
    bool has_window;                /* keys [i + S_b - L_b - left, i + S_b - L_b + right] of sequence b's row i */
    int64_t window_left, window_right;   /* literal, negative too; AF_WINDOW_UNBOUNDED: no limit (causal: right = 0) */
    double softcap;                 /* > 0: s <- softcap·tanh(s / softcap) on the scaled score */
    const char *sink;               /* NULL, or (Hq,) logits of sink_dtype, sink_stride elements apart */
    af_dtype sink_dtype;
    int64_t sink_stride;
    /* varlen: sequence b's query rows start at row cu_seqlens_q[b] of a (total_q, ...) tensor (q_stride[0],
     * out_stride[0] and lse_stride[0] are 0), likewise its keys at cu_seqlens_k[b]; elements `*_stride` apart. */
    const int32_t *cu_seqlens_q, *cu_seqlens_k, *seqused_k;
    int64_t cu_seqlens_q_stride, cu_seqlens_k_stride, seqused_k_stride;
    /* paged K/V: key j of sequence b is row j % page_size of page page_table[b][j / page_size]; k_stride[0] and
     * v_stride[0] step pages, k_stride[2] / v_stride[2] rows within a page. */
    const int32_t *page_table;
    int64_t page_table_stride[2];
    int64_t page_size;
    /* The bounds an untrusted index entry is checked against before use (on CUDA the arrays live in device memory and
     * no host reads them; the kernels check every entry, af_sequence_checked): the packed tensors' rows (total_q,
     * total_k) and the paged pool's pages. With varlen / paged K/V on CUDA, L and S are then bounds too
     * (min(max_seqlen_q, total_q); min(max_seqlen_k, total_k), pages · page_size, or the key tensor's S). */
    int64_t total_q, total_k, num_pages;
    /* float8 descales: NULL (= 1) or f32 (B, Hkv), elements `*_stride` apart. Scores of (batch b, kv head hk) are
     * scale·q_descale·k_descale·(q·k); its output rows are multiplied by v_descale (before the sink joins). */
    const float *q_descale, *k_descale, *v_descale;
    int64_t q_descale_stride[2], k_descale_stride[2], v_descale_stride[2];

    /* ---- af_flex_attn: NULL, or the call's score_mod / mask_mod programs (flex/program.h), run on every scaled
     * score before the softmax (the driver's pre-scaled path) */
    struct af_mods *mods;
} af_problem;

/* The descale of (batch b, kv head hk): 1 when absent. */
AF_HOST_DEVICE static inline float af_descale_at(const float *d, const int64_t *stride, int64_t b, int64_t hk) {
    return d ? d[b * stride[0] + hk * stride[1]] : 1.0f;
}

/* Sequence b: its first query row and key (in the packed varlen tensors, else 0), query rows and keys. */
typedef struct { int64_t q0, L, k0, S; } af_sequence;

/* Sequence b from the index arrays one by one (NULL: absent; L and S: the lengths without them), for kernels whose
 * parameters are not an af_problem (the CUDA tensor-core kernel); af_sequence_of takes them from one. */
AF_HOST_DEVICE static inline af_sequence af_sequence_at(const int32_t *cu_q, int64_t cu_q_stride, const int32_t *cu_k,
                                                        int64_t cu_k_stride, const int32_t *used, int64_t used_stride,
                                                        int64_t L, int64_t S, int64_t b) {
    af_sequence s = {0, L, 0, S};
    if (cu_q) {
        s.q0 = cu_q[b * cu_q_stride];
        s.L = cu_q[(b + 1) * cu_q_stride] - s.q0;
    }
    if (cu_k) {
        s.k0 = cu_k[b * cu_k_stride];
        s.S = cu_k[(b + 1) * cu_k_stride] - s.k0;
    }
    if (used) s.S = used[b * used_stride];
    return s;
}

/* What a kernel may do with sequence b whose index entries no host has read (CUDA): AF_SEQ_OK; AF_SEQ_POISON: its
 * query rows are known but its keys are not (cu_seqlens_k outside [0, total_k] or decreasing, seqused_k outside
 * [0, its keys], more keys than S): no key is read, its rows get out = NaN and lse = NaN; AF_SEQ_SKIP: its rows are
 * unknown (cu_seqlens_q outside [0, total_q] or decreasing, more rows than L): nothing of it is read or written. */
enum { AF_SEQ_OK = 0, AF_SEQ_POISON = 1, AF_SEQ_SKIP = 2 };

/* af_sequence_at with every entry checked before use; a POISON sequence has no keys, a SKIP one no rows either. L and
 * S bound the lengths (the launch covers them), total_q / total_k the packed tensors' rows. */
AF_HOST_DEVICE static inline int af_sequence_checked(const int32_t *cu_q, int64_t cu_q_stride, const int32_t *cu_k,
                                                     int64_t cu_k_stride, const int32_t *used, int64_t used_stride,
                                                     int64_t L, int64_t S, int64_t total_q, int64_t total_k, int64_t b,
                                                     af_sequence *s) {
    *s = af_sequence_at(cu_q, cu_q_stride, cu_k, cu_k_stride, used, used_stride, L, S, b);
    if (cu_q && (s->q0 < 0 || s->L < 0 || s->L > L || s->q0 > total_q - s->L)) {
        s->q0 = s->L = s->k0 = s->S = 0;
        return AF_SEQ_SKIP;
    }
    int64_t keys = S;   /* fixed or paged K/V: S is the key tensor's length or the table's capacity */
    if (cu_k) keys = cu_k[(b + 1) * cu_k_stride] - (int64_t)s->k0;
    const int bad_k = cu_k && (s->k0 < 0 || keys < 0 || s->k0 > total_k - keys);
    if (bad_k || (used && (s->S < 0 || s->S > keys)) || s->S > S) {
        s->k0 = s->S = 0;
        return AF_SEQ_POISON;
    }
    return AF_SEQ_OK;
}

/* Whether the page entries of sequence b's keys [lo, hi) all lie in [0, num_pages): `lanes` readers, this one
 * `lane`, each checks every lanes-th entry (the caller combines their answers). */
AF_HOST_DEVICE static inline int af_page_entries_valid(const int32_t *page_table, const int64_t *page_table_stride,
                                                       int64_t num_pages, int64_t b, int64_t first, int64_t end,
                                                       int lane, int lanes) {
    for (int64_t page = first + lane; page < end; page += lanes) {
        const int32_t index = page_table[b * page_table_stride[0] + page * page_table_stride[1]];
        if (index < 0 || index >= num_pages) return 0;
    }
    return 1;
}

AF_HOST_DEVICE static inline int af_pages_valid(const int32_t *page_table, const int64_t *page_table_stride,
                                                int64_t page_size, int64_t num_pages, int64_t b, int64_t lo,
                                                int64_t hi, int lane, int lanes) {
    if (!page_table || hi <= lo) return 1;
    return af_page_entries_valid(page_table, page_table_stride, num_pages, b, lo / page_size,
                                 (hi + page_size - 1) / page_size, lane, lanes);
}

AF_HOST_DEVICE static inline af_sequence af_sequence_of(const af_problem *p, int64_t b) {
    return af_sequence_at(p->cu_seqlens_q, p->cu_seqlens_q_stride, p->cu_seqlens_k, p->cu_seqlens_k_stride,
                          p->seqused_k, p->seqused_k_stride, p->L, p->S, b);
}

/* Element offset of key (or value, with its strides) row j of a sequence whose keys start at k0, batch b, kv head
 * hk, from the page table's fields one by one (NULL: not paged): the one place paged and varlen K/V are addressed,
 * for kernels whose parameters are not an af_problem (the CUDA tensor-core kernel). */
/* Element offset of row `row` of the `slot`-th page of batch b's page table, kv head hk: the paged half of
 * af_kv_row_offset_at, for callers that divide by the page size their own way (the CUDA tensor-core kernel, in 32
 * bits). */
AF_HOST_DEVICE static inline int64_t af_kv_page_row_offset(const int32_t *page_table, const int64_t *page_table_stride,
                                                           const int64_t *stride, int64_t b, int64_t hk,
                                                           int64_t slot, int64_t row) {
    const int64_t page = page_table[b * page_table_stride[0] + slot * page_table_stride[1]];
    return page * stride[0] + hk * stride[1] + row * stride[2];
}

AF_HOST_DEVICE static inline int64_t af_kv_row_offset_at(const int32_t *page_table, const int64_t *page_table_stride,
                                                         int64_t page_size, const int64_t *stride, int64_t b,
                                                         int64_t hk, int64_t k0, int64_t j) {
    if (page_table)
        return af_kv_page_row_offset(page_table, page_table_stride, stride, b, hk, j / page_size, j % page_size);
    return b * stride[0] + hk * stride[1] + (k0 + j) * stride[2];
}

AF_HOST_DEVICE static inline int64_t af_kv_row_offset(const af_problem *p, const int64_t *stride, int64_t b, int64_t hk,
                                       const af_sequence *s, int64_t j) {
    return af_kv_row_offset_at(p->page_table, p->page_table_stride, p->page_size, stride, b, hk, s->k0, j);
}

/* The keys [*lo, *hi) row i of a sequence with L query rows and S keys may see (before any mask): causal
 * alignment and the window, clamped to [0, S]. Window sides are literal offsets from the diagonal, negative ones
 * too (FA4), AF_WINDOW_UNBOUNDED (INT64_MAX) none; saturating for any int64. Both ends are non-decreasing in i, so a
 * block of rows sees keys from its first row's lo to its last row's hi. This form takes the fields one by one, for
 * kernels whose parameters are not an af_problem (the CUDA tensor-core kernel); af_key_range takes them from one. */
AF_HOST_DEVICE static inline void af_key_range_of(int causal, bool has_window, int64_t left, int64_t right, int64_t L,
                                                  int64_t S, int64_t i, int64_t *lo, int64_t *hi) {
    *lo = 0;
    *hi = S;
    if (causal == AF_CAUSAL_TOP_LEFT) *hi = i + 1 < S ? i + 1 : S;
    if (causal == AF_CAUSAL_BOTTOM_RIGHT) *hi = L - i <= S ? i + 1 + (S - L) : 0;   /* keys j <= i + S - L */
    if (!has_window) return;
    const int64_t diagonal = i + (S - L);   /* the key aligned with row i: i < L, so in (-L, S) */
    /* keys j >= diagonal - left, j <= diagonal + right: i - L = diagonal - S and L - i = S - diagonal cannot
     * overflow, so no comparison does */
    if (left < diagonal) *lo = left < i - L ? S : diagonal - left;
    if (right < L - i) {
        const int64_t end = right < -diagonal ? 0 : diagonal + right + 1;
        if (end < *hi) *hi = end;
    }
    if (*hi < *lo) *hi = *lo;
}

AF_HOST_DEVICE static inline void af_key_range(const af_problem *p, int64_t L, int64_t S, int64_t i, int64_t *lo, int64_t *hi) {
    af_key_range_of(p->causal, p->has_window, p->window_left, p->window_right, L, S, i, lo, hi);
}

/* The key limit of query row i: keys j < af_visible_keys(p, i) are visible (before any mask). */
static inline int64_t af_visible_keys(const af_problem *p, int64_t i) {
    int64_t limit = p->S;
    if (p->causal == AF_CAUSAL_TOP_LEFT) limit = i + 1;
    else if (p->causal == AF_CAUSAL_BOTTOM_RIGHT) limit = i + 1 + (p->S - p->L);
    return limit < 0 ? 0 : limit > p->S ? p->S : limit;
}

/* Check every rule of the call (SPEC §1) and fill `p`. On error: a message naming the argument and the rule. */
af_status af_sdpa_check(const af_sdpa_args *args, const af_tensor *out, const af_tensor *lse, af_problem *p);

/* The plain reference: double accumulation, row by row. */
af_status af_reference_forward(const af_problem *p);

/* Check every rule of an af_flash_attn call (docs/API.md) and fill `p` (flash_args.c). Tensors on a CUDA device are
 * refused before anything is read. On error: a message naming the argument and the rule. */
af_status af_flash_check(const af_flash_args *args, const af_tensor *out, const af_tensor *lse, af_problem *p);

/* af_flash_attn's score_mod / mask_mod (args) into p->mods, checked (flex/program.h), with FA4's rules: CPU only, a
 * mask_mod replaces causal and the window, no softcap with a score_mod. *mods is the caller's to release
 * (af_mods_release), whatever this returns; p->mods stays NULL without mods. */
af_status af_flash_take_mods(const af_flash_args *args, af_problem *p, struct af_mods *mods);

/* The reference written to an f32 `out_f32` (B,Hq,L,Ev) whatever the input dtype: what tests and
 * `attnforge run` compare the kernels against, without the output rounding of bf16/f16. */
af_status af_reference_f32(const af_sdpa_args *args, af_tensor *out_f32, af_tensor *lse);

#endif
