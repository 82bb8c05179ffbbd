/* The FlashAttention backward driver (FlashAttention-2's algorithm, research/fa4.md §2.4): K/V-stationary tiles,
 * P recomputed from the forward's lse, D = rowsum(dout ∘ out), no L×S matrix in memory. The arithmetic is the
 * micro-kernel's (its gemm on packed f32 tiles and its exp2 through softmax_step); nothing here depends on the ISA.
 *
 * Three passes, each a parallel-for whose items write disjoint memory, so the result has the same bits for any
 * thread count (no atomics):
 *   rows:   per (batch, query head): D and lse·log2(e) of every row, the sink's gradient share, dq partials zeroed;
 *   keys:   per (batch, kv head, key chunk): for each key tile of the chunk, every query row block of the group's
 *           heads that sees it: S = Q·Kᵀ → P, dV += Pᵀ·dO, dP = dO·Vᵀ, dS = P∘(dP − D), dQ_chunk += dS·K,
 *           dK += dSᵀ·Q; the tile's dK and dV are written once, complete (a group's heads are summed here);
 *   finish: per (batch, query head): dq = scale·Σ over chunks of the partials, in chunk order.
 * The key chunks exist only to give a call with few (batch, kv head) pairs enough items; their number depends on the
 * shape alone. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/dtype.h"
#include "core/log.h"
#include "core/status.h"
#include "core/threadpool.h"
#include "flex/block_map.h"
#include "flex/program.h"
#include "kernel/flash.h"
#include "kernel/softcap.h"
#include "kernel/tiling.h"
#include "kernel/ukernel.h"

#define BLOCK_ROWS 48              /* query rows per block: whole register tiles of 12 (AVX-512) and 6 (AVX2) rows */
#define BLOCK_KEYS 96              /* keys per stationary tile: the same for the dK, dV products' rows, and 6 vectors */
#define MIN_ITEMS 32               /* key chunks until (batch, kv head, chunk) items reach this many ... */
#define DQ_PARTIAL_BYTES ((size_t)64 << 20)   /* ... while the dq partials of all chunks stay below this */
#define LOG2E 1.4426950408889634

typedef struct {
    const af_backward_problem *bp;
    const af_problem *p;
    const af_ukernel *uk;
    int E, Ev;
    int e_pad, ev_pad, keys_pad, rows_pad;   /* leading dims: Q/K/dQ/dK rows, V/dO/dV rows, S-like rows, Pᵀ rows */
    int64_t R;                  /* query rows of all sequences: B·L, or total_q (varlen) */
    int64_t chunks, tiles_per_chunk;
    bool pre_scale;             /* S = S·scale (+ mask, or softcap) before the exponent, as the forward */
    bool q_direct, do_direct;   /* f32 Q / dO rows read in place as gemm operands (f32_rows_direct) */
    size_t q_elem, kv_elem, out_elem;
    size_t dq_elem, dk_elem, dv_elem;   /* bytes per gradient element (f32 where the caller widened them) */
    float *lse2;                /* (Hq, R): lse·log2(e) */
    float *D;                   /* (Hq, R): rowsum(dout ∘ out) */
    float *dq_partial;          /* (chunks, Hq, R, e_pad) */
    double *dsink_part;         /* (B, Hq): each (batch, head)'s share of the sink's gradient */
    bool tangent;               /* dS is multiplied by T = d(transformed score)/d(scaled score): softcap, score_mod */
    int32_t n_aux;              /* af_flex_attn_backward's captured tensors wanting a gradient: score_mod's aux count */
    int64_t aux_floats;         /* ... each item's partial sums of all of them (0: none wanted) */
    int64_t *aux_at;            /* ... where aux a's sums start in an item's (-1: not wanted) */
    float *aux_part;            /* ... (items, aux_floats): summed in item order at the end, whatever ran where */
    size_t off_kt, off_kr, off_vt, off_dk, off_dv, off_q, off_do, off_s, off_dp, off_t, off_pt, off_row, off_m,
        off_l, off_a, off_mod, off_raw, off_aux, off_auxp;
} bwd_plan;

/* Row id of sequence b's query row i among all R rows (the index of lse2, D and the dq partials). */
static int64_t row_id(const bwd_plan *bw, int64_t b, const af_sequence *seq, int64_t i) {
    return bw->p->cu_seqlens_q ? seq->q0 + i : b * bw->p->L + i;
}

static void store_row(char *dst, af_dtype dtype, int64_t stride, const float *src, int n, float factor) {
    if (dtype == AF_F32 && stride == 1) {
        float *d = (float *)dst;
        for (int e = 0; e < n; e++) d[e] = src[e] * factor;
        return;
    }
    const size_t elem = af_dtype_size(dtype);
    for (int e = 0; e < n; e++) af_store_from_f32(dst + (size_t)(e * stride) * elem, dtype, src[e] * factor);
}

/* True when f32 rows of `n` elements with these strides already are what the gemm takes as A and B: contiguous
 * along the head dim, whole vectors with nothing to zero, rows a whole number of vectors apart. */
static bool f32_rows_direct(af_dtype dtype, const int64_t *stride, int n) {
    return dtype == AF_F32 && n > 0 && n % AF_TILE_PAD == 0 && stride[3] == 1 && stride[2] % AF_TILE_PAD == 0 &&
           stride[2] >= n && stride[2] <= INT32_MAX;
}

/* Element offset of row `row` of head h, batch b, in a view with the problem's (B, H, seq, dim) strides. */
static int64_t at(const int64_t *stride, int64_t b, int64_t h, int64_t row) {
    return b * stride[0] + h * stride[1] + row * stride[2];
}

/* dst (cols × rows, leading dim ldd, columns rows.. zero to a whole vector) = srcᵀ: the micro-kernel's transposing
 * packer where it has one (8×8 blocks through registers), else element by element. */
static void transpose(const af_ukernel *uk, int rows, int cols, const float *src, int lds, float *dst, int ldd) {
    if (uk->pack_kt) {
        uk->pack_kt(rows, cols, src, sizeof(float) * (size_t)lds, AF_F32, dst, ldd);
        return;
    }
    const int padded = (int)af_round_up((size_t)rows, AF_TILE_PAD);
    for (int c = 0; c < cols; c++) {
        for (int r = 0; r < rows; r++) dst[(size_t)c * ldd + r] = src[(size_t)r * lds + c];
        for (int r = rows; r < padded; r++) dst[(size_t)c * ldd + r] = 0.0f;
    }
}

/* ---------------------------------------------------------------- pass 1: rows */

/* Row i of (b, h): D = dout·out (double: the same for every tile that reads it), lse in log2 units. */
static void rows_item(void *ctx, int64_t t, void *scratch) {
    const bwd_plan *bw = ctx;
    const af_backward_problem *bp = bw->bp;
    const af_problem *p = bw->p;
    const int64_t h = t % p->Hq, b = t / p->Hq;
    const af_sequence seq = af_sequence_of(p, b);
    float *o = scratch, *d = o + bw->ev_pad;
    double sink_share = 0.0;
    float sink = -INFINITY;
    if (p->sink) sink = af_load_as_f32(p->sink + h * p->sink_stride * (int64_t)af_dtype_size(p->sink_dtype), p->sink_dtype);
    for (int64_t i = 0; i < seq.L; i++) {
        const int64_t row = seq.q0 + i, id = row_id(bw, b, &seq, i);
        double dot = 0.0;
        if (bw->Ev > 0) {   /* Ev = 0: out and dout have no elements (and may be NULL) */
            af_load_f32(bw->uk, o, p->out + (size_t)at(p->out_stride, b, h, row) * bw->out_elem, p->out_dtype,
                     p->out_stride[3], bw->Ev, bw->out_elem);
            af_load_f32(bw->uk, d, bp->dout + (size_t)at(bp->dout_stride, b, h, row) * bw->out_elem, p->out_dtype,
                     bp->dout_stride[3], bw->Ev, bw->out_elem);
        }
        for (int e = 0; e < bw->Ev; e++) dot += (double)o[e] * (double)d[e];
        const float lse = p->lse[b * p->lse_stride[0] + h * p->lse_stride[1] + row * p->lse_stride[2]];
        bw->D[h * bw->R + id] = (float)dot;
        bw->lse2[h * bw->R + id] = (float)(lse * LOG2E);
        if (sink != -INFINITY) sink_share += exp((double)sink - (double)lse) * dot;   /* the sink's probability · D */
        for (int64_t c = 0; c < bw->chunks; c++)
            memset(bw->dq_partial + (size_t)(((c * p->Hq + h) * bw->R + id) * bw->e_pad), 0,
                   sizeof(float) * (size_t)bw->e_pad);
    }
    if (bw->dsink_part) bw->dsink_part[b * p->Hq + h] = sink_share;
}

/* ---------------------------------------------------------------- pass 2: keys */

typedef struct {
    int64_t b, hk, chunk;
    af_sequence seq;
    float **aux_grads;   /* the item's partial sums of the captured tensors' gradients (NULL: none wanted) */
} key_item;

/* The tile's keys as Kᵀ (E × keys_pad) for S = Q·Kᵀ and as rows (keys × e_pad) for dQ = dS·K; V as Vᵀ for
 * dP = dO·Vᵀ. Padding columns are zero (the gemm reads them). */
static void pack_tile(const bwd_plan *bw, const key_item *w, int64_t j0, int cols, float *kt, float *kr, float *vt,
                      float *row) {
    const af_problem *p = bw->p;
    const int64_t key0 = w->seq.k0 + j0;
    for (int j = 0; j < cols; j++) {
        const char *k = p->k + (size_t)at(p->k_stride, w->b, w->hk, key0 + j) * bw->kv_elem;
        float *kj = kr + (size_t)j * bw->e_pad;
        af_load_f32(bw->uk, kj, k, p->kv_dtype, p->k_stride[3], bw->E, bw->kv_elem);
        memset(kj + bw->E, 0, sizeof(float) * (size_t)(bw->e_pad - bw->E));
    }
    transpose(bw->uk, cols, bw->E, kr, bw->e_pad, kt, bw->keys_pad);   /* Kᵀ from the f32 rows just made */
    if (bw->Ev == 0) return;
    const char *v = p->v + (size_t)at(p->v_stride, w->b, w->hk, key0) * bw->kv_elem;
    if (bw->uk->pack_kt && p->v_stride[3] == 1) {
        bw->uk->pack_kt(cols, bw->Ev, v, (size_t)p->v_stride[2] * bw->kv_elem, p->kv_dtype, vt, bw->keys_pad);
        return;
    }
    for (int j = 0; j < cols; j++) {   /* a strided head dim: row by row */
        af_load_f32(bw->uk, row, v + (size_t)(j * p->v_stride[2]) * bw->kv_elem, p->kv_dtype, p->v_stride[3], bw->Ev,
                 bw->kv_elem);
        for (int e = 0; e < bw->Ev; e++) vt[(size_t)e * bw->keys_pad + j] = row[e];
    }
    const int padded = (int)af_round_up((size_t)cols, AF_TILE_PAD);
    for (int e = 0; e < bw->Ev; e++) memset(vt + (size_t)e * bw->keys_pad + cols, 0, sizeof(float) * (size_t)(padded - cols));
}

/* The query rows [*lo, *hi) of the sequence that see any key of [j0, j1): both ends of a row's key range grow with
 * the row (af_key_range), so they are one run, found by bisection. */
static void rows_seeing(const af_problem *p, const af_sequence *seq, int64_t j0, int64_t j1, int64_t *lo,
                        int64_t *hi) {
    int64_t a = 0, z = seq->L;   /* first row whose range ends after j0 */
    while (a < z) {
        const int64_t m = a + (z - a) / 2;
        int64_t klo, khi;
        af_key_range(p, seq->L, seq->S, m, &klo, &khi);
        if (khi > j0) z = m;
        else a = m + 1;
    }
    *lo = a;
    z = seq->L;   /* first row whose range starts at or after j1 */
    while (a < z) {
        const int64_t m = a + (z - a) / 2;
        int64_t klo, khi;
        af_key_range(p, seq->L, seq->S, m, &klo, &khi);
        if (klo >= j1) z = m;
        else a = m + 1;
    }
    *hi = a;
}

/* S (raw scores) → the scores the forward's softmax saw: softcap (keeping 1 − tanh² in T for dS), or scale and mask;
 * then af_flex_attn's / af_flash_attn's mods (a score_mod keeping d(score_mod)/d(score) in T: it never comes with a
 * softcap); then -inf outside each row's key range. */
static void transform_scores(const bwd_plan *bw, const key_item *w, int64_t h, int64_t i0, int rows, int64_t j0,
                             int cols, bool full, float *S, float *T, float *mod_regs, float *raw) {
    const af_problem *p = bw->p;
    for (int r = 0; r < rows; r++) {
        float *s = S + (size_t)r * bw->keys_pad;
        const int64_t i = i0 + r;
        if (p->softcap > 0.0) {
            const float cap = (float)p->softcap;
            af_softcap_row(s, cols, (float)(p->scale / p->softcap), cap);
            float *t = T + (size_t)r * bw->keys_pad;
            for (int j = 0; j < cols; j++) t[j] = 1.0f - (s[j] / cap) * (s[j] / cap);
        } else if (bw->pre_scale && !p->mods) {   /* mods: they scale the block in their vector code */
            const float scale = (float)p->scale;
            for (int j = 0; j < cols; j++) s[j] *= scale;
            if (p->mask) {
                const size_t size = af_dtype_size(p->mask_dtype);
                const char *m = p->mask + (size_t)(w->b * p->mask_stride[0] + h * p->mask_stride[1] +
                                                   i * p->mask_stride[2] + j0 * p->mask_stride[3]) * size;
                const int64_t ms = p->mask_stride[3] * (int64_t)size;
                if (p->mask_dtype == AF_BOOL) {
                    for (int j = 0; j < cols; j++)
                        if (!*(const uint8_t *)(m + j * ms)) s[j] = -INFINITY;
                } else {
                    for (int j = 0; j < cols; j++) s[j] += af_load_as_f32(m + j * ms, p->mask_dtype);
                }
            }
        }
    }
    if (p->mods) {   /* the mods over the whole block: its rows' heads and positions after the registers */
        int32_t *h_rows = (int32_t *)(mod_regs + af_mods_scratch_floats(p->mods, BLOCK_ROWS, bw->keys_pad)), *q_rows = h_rows + rows;
        for (int r = 0; r < rows; r++) {
            h_rows[r] = (int32_t)h;
            q_rows[r] = (int32_t)(i0 + r);
        }
        /* scale 1 after a softcap (which applied it) or without a score_mod (the exponent takes it) */
        float scale = p->softcap > 0.0 || !bw->pre_scale ? 1.0f : (float)p->scale;
        if (raw) {   /* the scaled scores before the mods, for the captured tensors' gradients */
            for (int r = 0; r < rows && scale != 1.0f; r++)
                for (int j = 0; j < cols; j++) S[(size_t)r * bw->keys_pad + j] *= scale;
            memcpy(raw, S, sizeof(float) * (size_t)rows * (size_t)bw->keys_pad);
            scale = 1.0f;
        }
        af_mods_apply_tile_grad(p->mods, w->b, h_rows, q_rows, rows, j0, cols, scale, full ? AF_MODS_FULL : 0, S,
                                bw->keys_pad, T, bw->keys_pad, mod_regs, bw->keys_pad);
    }
    for (int r = 0; r < rows; r++) {
        float *s = S + (size_t)r * bw->keys_pad;
        int64_t lo, hi;
        af_key_range(p, w->seq.L, w->seq.S, i0 + r, &lo, &hi);
        for (int64_t j = 0; j < cols && j < lo - j0; j++) s[j] = -INFINITY;
        for (int64_t j = hi - j0 < 0 ? 0 : hi - j0; j < cols; j++) s[j] = -INFINITY;
    }
}

/* C[m×n] += Aᵀ·B for A[k×m]: the micro-kernel's transposed-A product, else a transpose into `at` and its gemm. */
static void gemm_at(const af_ukernel *uk, int m, int n, int k, const float *A, int lda, const float *B, int ldb,
                    float *C, int ldc, float *at, int ldat) {
    if (uk->gemm_at) {
        uk->gemm_at(m, n, k, A, lda, B, ldb, C, ldc, true);
        return;
    }
    transpose(uk, k, m, A, lda, at, ldat);
    uk->gemm(m, n, k, at, ldat, B, ldb, C, ldc, true);
}

/* One (query row block, key tile) pair of head h: the five products and the softmax's gradient. */
static void block_pair(const bwd_plan *bw, const key_item *w, int64_t h, int64_t i0, int rows, int64_t j0, int cols,
                       bool full, char *base) {
    const af_problem *p = bw->p;
    const af_ukernel *uk = bw->uk;
    float *kt = (float *)(base + bw->off_kt), *kr = (float *)(base + bw->off_kr), *vt = (float *)(base + bw->off_vt);
    float *dk = (float *)(base + bw->off_dk), *dv = (float *)(base + bw->off_dv);
    float *qbuf = (float *)(base + bw->off_q), *dobuf = (float *)(base + bw->off_do);
    float *S = (float *)(base + bw->off_s), *dP = (float *)(base + bw->off_dp), *T = (float *)(base + bw->off_t);
    float *PT = (float *)(base + bw->off_pt);
    float *m = (float *)(base + bw->off_m), *l = (float *)(base + bw->off_l), *alpha = (float *)(base + bw->off_a);
    const int64_t id0 = row_id(bw, w->b, &w->seq, i0);
    const float *lse2 = bw->lse2 + h * bw->R + id0, *D = bw->D + h * bw->R + id0;

    /* Q and dO rows as f32 gemm operands (as A and as B: zero past E / Ev to whole vectors): in place when the
     * caller's f32 rows already are that, else converted into the scratch blocks */
    const int ldq = bw->q_direct ? (int)p->q_stride[2] : bw->e_pad, ldo = bw->do_direct ? (int)bw->bp->dout_stride[2]
                                                                                          : bw->ev_pad;
    const float *qb = bw->q_direct ? (const float *)p->q + at(p->q_stride, w->b, h, w->seq.q0 + i0) : qbuf;
    const float *dob = bw->do_direct ? (const float *)bw->bp->dout + at(bw->bp->dout_stride, w->b, h, w->seq.q0 + i0)
                                     : dobuf;
    for (int r = 0; r < rows && !bw->q_direct; r++) {
        float *q = qbuf + (size_t)r * bw->e_pad;
        af_load_f32(uk, q, p->q + (size_t)at(p->q_stride, w->b, h, w->seq.q0 + i0 + r) * bw->q_elem, p->dtype,
                 p->q_stride[3], bw->E, bw->q_elem);
        memset(q + bw->E, 0, sizeof(float) * (size_t)(bw->e_pad - bw->E));
    }
    for (int r = 0; r < rows && !bw->do_direct; r++) {
        float *d = dobuf + (size_t)r * bw->ev_pad;
        memset(d, 0, sizeof(float) * (size_t)bw->ev_pad);
        if (bw->Ev == 0) continue;
        af_load_f32(uk, d, bw->bp->dout + (size_t)at(bw->bp->dout_stride, w->b, h, w->seq.q0 + i0 + r) * bw->out_elem,
                 p->out_dtype, bw->bp->dout_stride[3], bw->Ev, bw->out_elem);
    }

    /* P = exp2(S·c − lse2): the softmax step with the running max preset to lse2 (never exceeded by a score, so P is
     * taken against it; a row whose max still moved, an lse below its scores, is rescaled back by 1 / alpha) */
    uk->gemm(rows, cols, bw->E, qb, ldq, kt, bw->keys_pad, S, bw->keys_pad, false);
    float *mod_regs = (float *)(base + bw->off_mod), *raw = w->aux_grads ? (float *)(base + bw->off_raw) : NULL;
    transform_scores(bw, w, h, i0, rows, j0, cols, full, S, T, mod_regs, raw);
    const float c = (float)(bw->pre_scale ? LOG2E : p->scale * LOG2E);
    for (int r = 0; r < rows; r++) {
        m[r] = lse2[r];
        l[r] = 0.0f;
    }
    uk->softmax_step(rows, cols, S, bw->keys_pad, c, m, l, alpha, 5);
    for (int r = 0; r < rows; r++) {
        float *s = S + (size_t)r * bw->keys_pad;
        if (lse2[r] == -INFINITY) memset(s, 0, sizeof(float) * (size_t)cols);   /* the row sees no key */
        else if (alpha[r] != 1.0f) uk->scale_row(s, cols, 1.0f / alpha[r]);
    }

    if (bw->Ev > 0) {
        if (bw->bp->dv)   /* a gradient not asked for costs no product */
            gemm_at(uk, cols, bw->Ev, rows, S, bw->keys_pad, dob, ldo, dv, bw->ev_pad, PT, bw->rows_pad);   /* dV += Pᵀ·dO */
        uk->gemm(rows, cols, bw->Ev, dob, ldo, vt, bw->keys_pad, dP, bw->keys_pad, false);   /* dP = dO·Vᵀ */
    } else {
        for (int r = 0; r < rows; r++) memset(dP + (size_t)r * bw->keys_pad, 0, sizeof(float) * (size_t)cols);
    }
    for (int r = 0; r < rows; r++) {   /* dS = P ∘ (dP − D), through the softcap's tanh or the score_mod */
        float *ds = dP + (size_t)r * bw->keys_pad;
        const float *P = S + (size_t)r * bw->keys_pad;
        const float Dr = D[r];
        for (int j = 0; j < cols; j++) ds[j] = P[j] * (ds[j] - Dr);
    }
    if (raw) {   /* dS so far is the gradient of the mods' output: through each captured tensor's loads */
        const int32_t *h_rows = (const int32_t *)(mod_regs + af_mods_scratch_floats(p->mods, BLOCK_ROWS, bw->keys_pad));
        af_mods_aux_grads_tile(p->mods, w->b, h_rows, h_rows + rows, rows, j0, cols, raw, bw->keys_pad, dP,
                               bw->keys_pad, w->aux_grads, (float *)(base + bw->off_aux), bw->keys_pad);
    }
    for (int r = 0; r < rows && bw->tangent; r++) {   /* ... and through the softcap's tanh or the score_mod */
        float *ds = dP + (size_t)r * bw->keys_pad;
        const float *t = T + (size_t)r * bw->keys_pad;
        for (int j = 0; j < cols; j++) ds[j] *= t[j];
    }
    float *dq = bw->dq_partial + (size_t)(((w->chunk * p->Hq + h) * bw->R + id0) * bw->e_pad);
    if (bw->bp->dq) uk->gemm(rows, bw->E, cols, dP, bw->keys_pad, kr, bw->e_pad, dq, bw->e_pad, true);   /* dQ += dS·K */
    if (bw->bp->dk) gemm_at(uk, cols, bw->E, rows, dP, bw->keys_pad, qb, ldq, dk, bw->e_pad, PT, bw->rows_pad);   /* dK += dSᵀ·Q */
}

/* dK (times the scale: dS is the gradient of the scaled score) and dV of the tile's keys, in their dtypes. */
static void store_tile(const bwd_plan *bw, const key_item *w, int64_t j0, int cols, const float *dk, const float *dv) {
    const af_backward_problem *bp = bw->bp;
    const af_problem *p = bw->p;
    for (int j = 0; j < cols; j++) {
        const int64_t key = w->seq.k0 + j0 + j;
        if (bp->dk)
            store_row(bp->dk + (size_t)at(bp->dk_stride, w->b, w->hk, key) * bw->dk_elem, bp->dk_dtype, bp->dk_stride[3],
                      dk + (size_t)j * bw->e_pad, bw->E, (float)p->scale);
        if (bp->dv && bw->Ev > 0)
            store_row(bp->dv + (size_t)at(bp->dv_stride, w->b, w->hk, key) * bw->dv_elem, bp->dv_dtype, bp->dv_stride[3],
                      dv + (size_t)j * bw->ev_pad, bw->Ev, 1.0f);
    }
}

static void keys_item(void *ctx, int64_t t, void *scratch) {
    const bwd_plan *bw = ctx;
    const af_problem *p = bw->p;
    const int64_t item = t;
    key_item w;
    w.chunk = t % bw->chunks;
    t /= bw->chunks;
    w.hk = t % p->Hkv;
    w.b = t / p->Hkv;
    w.seq = af_sequence_of(p, w.b);
    char *base = scratch;
    float *dk = (float *)(base + bw->off_dk), *dv = (float *)(base + bw->off_dv);
    w.aux_grads = NULL;
    if (bw->aux_floats) {   /* this item's own partial sums, their pointers after the aux scratch */
        float *part = bw->aux_part + (size_t)item * (size_t)bw->aux_floats;
        w.aux_grads = (float **)(base + bw->off_auxp);
        for (int32_t a = 0; a < bw->n_aux; a++) w.aux_grads[a] = bw->aux_at[a] < 0 ? NULL : part + bw->aux_at[a];
    }
    const int64_t tiles = af_ceil_div(w.seq.S, BLOCK_KEYS);
    const int64_t first = w.chunk * bw->tiles_per_chunk;
    const int64_t last = first + bw->tiles_per_chunk < tiles ? first + bw->tiles_per_chunk : tiles;
    for (int64_t tile = first; tile < last; tile++) {
        const int64_t j0 = tile * BLOCK_KEYS;
        const int cols = (int)(w.seq.S - j0 < BLOCK_KEYS ? w.seq.S - j0 : BLOCK_KEYS);
        pack_tile(bw, &w, j0, cols, (float *)(base + bw->off_kt), (float *)(base + bw->off_kr),
                  (float *)(base + bw->off_vt), (float *)(base + bw->off_row));
        memset(dk, 0, sizeof(float) * (size_t)cols * (size_t)bw->e_pad);
        memset(dv, 0, sizeof(float) * (size_t)cols * (size_t)bw->ev_pad);
        int64_t i_lo, i_hi;
        rows_seeing(p, &w.seq, j0, j0 + cols, &i_lo, &i_hi);
        const af_block_map *blocks = p->mods ? p->mods->blocks : NULL;
        for (int64_t g = 0; g < p->group; g++)   /* the group's heads in order: dK, dV summed over them here */
            for (int64_t i0 = i_lo; i0 < i_hi; i0 += BLOCK_ROWS) {
                const int rows = (int)(i_hi - i0 < BLOCK_ROWS ? i_hi - i0 : BLOCK_ROWS);
                const int64_t h = w.hk * p->group + g;
                const int cls = blocks ? af_block_map_tile(blocks, w.b, h, 1, i0, i0 + rows - 1, j0, j0 + cols) : -1;
                if (cls == AF_BLOCK_EMPTY) continue;   /* a flex block mask leaves out every key of the pair */
                block_pair(bw, &w, h, i0, rows, j0, cols, cls == AF_BLOCK_FULL, base);
            }
        store_tile(bw, &w, j0, cols, dk, dv);
    }
}

/* ---------------------------------------------------------------- pass 3: dq */

static void finish_item(void *ctx, int64_t t, void *scratch) {
    const bwd_plan *bw = ctx;
    const af_backward_problem *bp = bw->bp;
    const af_problem *p = bw->p;
    const int64_t h = t % p->Hq, b = t / p->Hq;
    const af_sequence seq = af_sequence_of(p, b);
    float *sum = scratch;
    for (int64_t i = 0; i < seq.L; i++) {
        const int64_t id = row_id(bw, b, &seq, i);
        const float *part = bw->dq_partial + (size_t)((h * bw->R + id) * bw->e_pad);
        memcpy(sum, part, sizeof(float) * (size_t)bw->E);
        for (int64_t c = 1; c < bw->chunks; c++) {   /* chunk order: fixed whatever ran where */
            const float *pc = part + (size_t)(c * p->Hq * bw->R * bw->e_pad);
            for (int e = 0; e < bw->E; e++) sum[e] += pc[e];
        }
        store_row(bp->dq + (size_t)at(bp->dq_stride, b, h, seq.q0 + i) * bw->dq_elem, bp->dq_dtype, bp->dq_stride[3], sum,
                  bw->E, (float)p->scale);
    }
}

/* ---------------------------------------------------------------- the driver */

/* Every element of a (n0, n1, n2, n3) view with the problem's strides set to zero: the gradient rows no sequence
 * covers (varlen gaps, keys past seqused_k), before the passes write the others. */
static void zero_view(char *data, const int64_t *stride, af_dtype dtype, int64_t n0, int64_t n1, int64_t n2,
                      int64_t n3) {
    const size_t elem = af_dtype_size(dtype);
    for (int64_t a = 0; a < n0; a++)
        for (int64_t h = 0; h < n1; h++)
            for (int64_t r = 0; r < n2; r++)
                for (int64_t e = 0; e < n3; e++)
                    memset(data + (size_t)(a * stride[0] + h * stride[1] + r * stride[2] + e * stride[3]) * elem, 0,
                           elem);
}

static void zero_uncovered(const af_backward_problem *bp) {
    const af_problem *p = &bp->f;
    if (p->cu_seqlens_q && bp->dq) zero_view(bp->dq, bp->dq_stride, bp->dq_dtype, 1, p->Hq, p->total_q, p->E);
    if (!p->cu_seqlens_k && !p->seqused_k) return;
    const int64_t n0 = p->cu_seqlens_k ? 1 : p->B, rows = p->cu_seqlens_k ? p->total_k : p->S;
    if (bp->dk) zero_view(bp->dk, bp->dk_stride, bp->dk_dtype, n0, p->Hkv, rows, p->E);
    if (bp->dv) zero_view(bp->dv, bp->dv_stride, bp->dv_dtype, n0, p->Hkv, rows, p->Ev);
}

/* Scratch of one thread in the key pass: the stationary tile (Kᵀ, K rows, Vᵀ, dK, dV), one row block's operands
 * (Q, dO, S/P, dP/dS, softcap's T, Pᵀ/dSᵀ) and the softmax step's row vectors. */
static size_t plan_scratch(bwd_plan *bw) {
    const size_t kp = (size_t)bw->keys_pad, bk = BLOCK_KEYS, br = BLOCK_ROWS;
    size_t at = 64;
#define TAKE(off, floats) (bw->off = at, at += af_round_up(sizeof(float) * (floats), 64))
    TAKE(off_kt, (size_t)bw->E * kp);
    TAKE(off_kr, bk * (size_t)bw->e_pad);
    TAKE(off_vt, (size_t)(bw->Ev > 0 ? bw->Ev : 1) * kp);
    TAKE(off_dk, bk * (size_t)bw->e_pad);
    TAKE(off_dv, bk * (size_t)bw->ev_pad);
    TAKE(off_q, br * (size_t)bw->e_pad);
    TAKE(off_do, br * (size_t)bw->ev_pad);
    TAKE(off_s, br * kp);
    TAKE(off_dp, br * kp);
    TAKE(off_t, bw->tangent ? br * kp : 1);
    TAKE(off_pt, bk * (size_t)bw->rows_pad);
    TAKE(off_row, (size_t)(bw->E > bw->Ev ? bw->E : bw->Ev) + AF_TILE_PAD);
    TAKE(off_m, br);
    TAKE(off_l, br);
    TAKE(off_a, br);
    TAKE(off_mod, bw->p->mods ? af_mods_scratch_floats(bw->p->mods, BLOCK_ROWS, bw->keys_pad) + 2 * br : 1);
    TAKE(off_raw, bw->aux_floats ? br * kp : 1);
    TAKE(off_aux, bw->aux_floats ? af_mods_aux_scratch_floats(bw->p->mods, bw->keys_pad) : 1);
    TAKE(off_auxp, (size_t)bw->n_aux * 2 + 1);   /* the item's n_aux pointers */
#undef TAKE
    return at;
}

/* The captured tensors' gradients af_flex_attn_backward wants: where each item's partial sums go, zeroed. */
static af_status plan_aux_grads(bwd_plan *bw) {
    const af_backward_problem *bp = bw->bp;
    const af_mods *mods = bw->p->mods;
    if (!bp->daux || !mods || !mods->has_score || mods->score.n_aux == 0) return AF_OK;
    bw->n_aux = mods->score.n_aux;
    if (!(bw->aux_at = af_alloc(sizeof(int64_t) * (size_t)bw->n_aux)))
        return af_fail(AF_ERR_NO_MEMORY, "out of memory: the captured tensors' gradient plan");
    for (int32_t a = 0; a < bw->n_aux; a++) {
        bw->aux_at[a] = bp->daux[a] ? bw->aux_floats : -1;
        if (bp->daux[a]) bw->aux_floats += af_mods_aux_numel(mods, a);
    }
    const int64_t items = bw->p->B * bw->p->Hkv * bw->chunks;
    if (bw->aux_floats == 0) return AF_OK;
    if ((double)items * (double)bw->aux_floats * sizeof(float) > (double)((size_t)1 << 31))
        return af_fail(AF_ERR_NO_MEMORY, "out of memory: the captured tensors' gradients take %lld floats, summed "
                       "apart over %lld work items for the same bits at any thread count, more than 2 GiB",
                       (long long)bw->aux_floats, (long long)items);
    if (!(bw->aux_part = af_alloc_zeroed(sizeof(float) * (size_t)(items * bw->aux_floats))))
        return af_fail(AF_ERR_NO_MEMORY, "out of memory: %lld floats of the captured tensors' gradient sums",
                       (long long)(items * bw->aux_floats));
    return AF_OK;
}

/* Each wanted gradient: the items' partial sums in item order, into its float32 tensor (row-major element order). */
static void store_aux_grads(const bwd_plan *bw) {
    const int64_t items = bw->p->B * bw->p->Hkv * bw->chunks;
    for (int32_t a = 0; a < bw->n_aux; a++) {
        af_tensor *t = bw->bp->daux[a];
        if (!t) continue;
        const int64_t n = af_mods_aux_numel(bw->p->mods, a);
        for (int64_t e = 0; e < n; e++) {
            float sum = 0.0f;
            for (int64_t it = 0; it < items; it++) sum += bw->aux_part[(size_t)(it * bw->aux_floats + bw->aux_at[a] + e)];
            af_mods_store_aux_grad(t, e, sum);
        }
    }
}

/* The sink's gradient, -Σ over batches (in order) of their shares; zero when no row exists. */
static void store_dsink(const af_backward_problem *bp, const double *part) {
    const af_problem *p = &bp->f;
    const size_t elem = af_dtype_size(p->sink_dtype);
    for (int64_t h = 0; h < p->Hq; h++) {
        double sum = 0.0;
        for (int64_t b = 0; part && b < p->B; b++) sum += part[b * p->Hq + h];
        af_store_from_f32(bp->dsink + (size_t)(h * bp->dsink_stride) * elem, p->sink_dtype, (float)-sum);
    }
}

af_status af_flash_backward(const af_backward_problem *bp) {
    const af_problem *p = &bp->f;
    if (p->B == 0 || p->Hkv == 0 || p->group == 0) {   /* no (batch, head) pair: only uncovered rows to zero */
        zero_uncovered(bp);
        if (bp->dsink) store_dsink(bp, NULL);
        return AF_OK;
    }
    bwd_plan bw = {.bp = bp, .p = p, .uk = af_ukernel_current(), .E = (int)p->E, .Ev = (int)p->Ev};
    bw.q_elem = af_dtype_size(p->dtype);
    bw.kv_elem = af_dtype_size(p->kv_dtype);
    bw.dq_elem = af_dtype_size(bp->dq_dtype);
    bw.dk_elem = af_dtype_size(bp->dk_dtype);
    bw.dv_elem = af_dtype_size(bp->dv_dtype);
    bw.out_elem = af_dtype_size(p->out_dtype);
    bw.e_pad = af_tile_ld((size_t)bw.E);
    bw.ev_pad = af_tile_ld((size_t)bw.Ev);
    bw.keys_pad = af_tile_ld(BLOCK_KEYS);
    bw.rows_pad = af_tile_ld(BLOCK_ROWS);
    bw.R = p->cu_seqlens_q ? p->total_q : p->B * p->L;
    bw.q_direct = f32_rows_direct(p->dtype, p->q_stride, bw.E);
    bw.do_direct = f32_rows_direct(p->out_dtype, bp->dout_stride, bw.Ev);
    bw.pre_scale = p->mask != NULL || !(p->scale > 0.0) || p->softcap > 0.0 || (p->mods && p->mods->has_score);
    bw.tangent = p->softcap > 0.0 || (p->mods && p->mods->has_score);

    /* key chunks: enough items for the threads of a big machine, while all chunks' dq partials stay bounded */
    const int64_t tiles = af_ceil_div(p->S, BLOCK_KEYS);
    const size_t partial_bytes = sizeof(float) * (size_t)p->Hq * (size_t)bw.R * (size_t)bw.e_pad;
    int64_t chunks = af_ceil_div(MIN_ITEMS, p->B * p->Hkv);
    if (chunks > tiles) chunks = tiles;
    while (chunks > 1 && partial_bytes * (size_t)chunks > DQ_PARTIAL_BYTES) chunks--;
    bw.chunks = chunks < 1 ? 1 : chunks;
    bw.tiles_per_chunk = tiles > 0 ? af_ceil_div(tiles, bw.chunks) : 1;

    const size_t rows_bytes = sizeof(float) * (size_t)p->Hq * (size_t)bw.R;
    bw.lse2 = af_alloc(rows_bytes + 64);
    bw.D = af_alloc(rows_bytes + 64);
    bw.dq_partial = af_alloc(partial_bytes * (size_t)bw.chunks + 64);
    bw.dsink_part = bp->dsink ? af_alloc(sizeof(double) * (size_t)(p->B * p->Hq) + 64) : NULL;
    af_status st = AF_OK;
    if (!bw.lse2 || !bw.D || !bw.dq_partial || (bp->dsink && !bw.dsink_part)) {
        st = af_fail(AF_ERR_NO_MEMORY, "out of memory: %zu bytes of the backward pass's row state and dq partials",
                     2 * rows_bytes + partial_bytes * (size_t)bw.chunks);
        goto done;
    }
    if ((st = plan_aux_grads(&bw)) != AF_OK) goto done;
    zero_uncovered(bp);
    const size_t scratch = plan_scratch(&bw);
    const int max_threads = af_threads_worth_waking(5.0 * (double)p->B * (double)p->Hq * (double)p->L * (double)p->S *
                                                    (double)(p->E + p->Ev));   /* the backward: 2.5x the forward */
    af_log(AF_LOG_DEBUG, "flash backward: isa %s, %lld key chunks of %lld tiles of %d keys, row blocks of %d",
           bw.uk->isa, (long long)bw.chunks, (long long)bw.tiles_per_chunk, BLOCK_KEYS, BLOCK_ROWS);
    st = af_parallel_for_at_most(p->B * p->Hq, max_threads, rows_item, &bw, sizeof(float) * 2 * (size_t)bw.ev_pad);
    if (st == AF_OK)
        st = af_parallel_for_at_most(p->B * p->Hkv * bw.chunks, max_threads, keys_item, &bw, scratch);
    if (st == AF_OK && bp->dq)
        st = af_parallel_for_at_most(p->B * p->Hq, max_threads, finish_item, &bw, sizeof(float) * (size_t)bw.e_pad);
    if (st == AF_OK && bp->dsink) store_dsink(bp, bw.dsink_part);
    if (st == AF_OK && bw.aux_floats) store_aux_grads(&bw);
done:
    af_free(bw.aux_part);
    af_free(bw.aux_at);
    af_free(bw.lse2);
    af_free(bw.D);
    af_free(bw.dq_partial);
    af_free(bw.dsink_part);
    return st;
}
