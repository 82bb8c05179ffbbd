#include "flash_case.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "case_gen.h"
#include "sdpa/tolerance.h"

flash_case flash_case_default(int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t E, int64_t Ev) {
    flash_case c = {.seed = 7, .dtype = AF_F32, .B = B, .Hq = Hq, .Hkv = Hkv, .E = E, .Ev = Ev, .page_size = 16,
                    .sink_dtype = AF_F32, .sink_amplitude = 2.0, .with_lse = true, .amplitude = 1.0,
                    .left = -1, .right = -1};
    for (int b = 0; b < FLASH_MAX_BATCH; b++) c.Lq[b] = L, c.Sk[b] = c.S_stored[b] = S;
    return c;
}

/* A literal window side (FA4: negative ones too) or AF_WINDOW_UNBOUNDED. */
static int64_t random_window_side(test_rng *rng, int64_t S) {
    switch (rng_range(rng, 0, 8)) {
    case 0: return 0;
    case 1: return 1;
    case 2: return -1;
    case 3: return S + rng_range(rng, 0, 5);   /* >= S: the whole sequence */
    case 4: return rng_chance(rng, 0.5) ? AF_WINDOW_UNBOUNDED : INT64_MAX - 3;   /* saturating arithmetic */
    case 5: return -rng_range(rng, 2, S > 2 ? S : 3);   /* keys only on the other side of the diagonal */
    case 6: return rng_chance(rng, 0.5) ? INT64_MIN : -INT64_MAX + 2;
    default: return rng_range(rng, 0, S > 0 ? S : 1);
    }
}

static double work(const flash_case *c) {
    double w = 0.0;
    for (int b = 0; b < c->B; b++) w += (double)c->Lq[b] * (double)c->S_stored[b];
    return w * (double)c->Hq * (double)(c->E + c->Ev);
}

flash_case flash_case_random(uint64_t seed, int index) {
    static const int64_t heads[][2] = {{1, 1}, {2, 2}, {4, 4}, {2, 1}, {8, 2}, {4, 1}};
    static const int64_t page_sizes[] = {1, 3, 16, 17, 64, 128};
    static const int64_t dims[] = {1, 3, 8, 16, 17, 32, 64, 65, 128};
    test_rng rng = {seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(index + 1))};
    flash_case c = flash_case_default(1, 1, 1, 1, 1, 1, 1);
    c.seed = rng_next(&rng);
    c.dtype = (af_dtype)(index % 3);
    c.kv = (kv_form)(index / 3 % 3);
    const int window_kind = index / 9 % 6;   /* none, causal, window, left only, right only, causal + left */
    c.varlen_q = rng_chance(&rng, 0.5);
    const int h = (int)rng_range(&rng, 0, 5);
    c.Hq = heads[h][0];
    c.Hkv = heads[h][1];
    c.E = dims[rng_range(&rng, 0, 8)];
    c.Ev = rng_chance(&rng, 0.7) ? c.E : dims[rng_range(&rng, 0, 8)];
    c.B = rng_range(&rng, 1, 4);
    if (!c.varlen_q && c.kv == KV_FIXED && rng_chance(&rng, 0.05)) c.B = 0;
    const bool decode = rng_chance(&rng, 0.2);   /* few rows, many keys: direct kernels and split-KV */
    const int64_t L_fixed = decode ? rng_range(&rng, 1, 4) : rng_range(&rng, 0, 48);
    const int64_t S_fixed = decode ? rng_range(&rng, 400, 1500) : rng_range(&rng, 0, 160);
    for (int b = 0; b < c.B; b++) {
        c.Lq[b] = c.varlen_q ? (rng_chance(&rng, 0.15) ? 0 : decode ? rng_range(&rng, 1, 4) : rng_range(&rng, 1, 48))
                             : L_fixed;
        c.S_stored[b] = c.kv == KV_FIXED ? S_fixed
                        : rng_chance(&rng, 0.15) ? 0 : decode ? rng_range(&rng, 300, 1500) : rng_range(&rng, 1, 160);
    }
    c.seqused = c.kv == KV_PAGED || rng_chance(&rng, 0.3);
    for (int b = 0; b < c.B; b++)
        c.Sk[b] = c.seqused && rng_chance(&rng, 0.6) ? rng_range(&rng, 0, c.S_stored[b]) : c.S_stored[b];
    while (work(&c) > 2.5e6) {   /* keep the double reference cheap */
        for (int b = 0; b < c.B; b++) {
            c.S_stored[b] = c.S_stored[b] * 3 / 4;
            if (c.Sk[b] > c.S_stored[b]) c.Sk[b] = c.S_stored[b];
        }
    }
    c.page_size = page_sizes[rng_range(&rng, 0, 5)];
    c.shared_page = c.kv == KV_PAGED && c.B >= 2 && rng_chance(&rng, 0.4);
    int64_t S_max = 0;
    for (int b = 0; b < c.B; b++) S_max = c.Sk[b] > S_max ? c.Sk[b] : S_max;
    c.causal = window_kind == 1 || window_kind == 5;
    c.has_window = window_kind >= 2;
    c.left = window_kind == 4 ? AF_WINDOW_UNBOUNDED : random_window_side(&rng, S_max);
    c.right = window_kind == 3 || window_kind == 5 ? AF_WINDOW_UNBOUNDED : random_window_side(&rng, S_max);
    c.softcap = rng_chance(&rng, 0.3) ? (rng_chance(&rng, 0.5) ? 5.0 : 30.0) : 0.0;
    c.sink = rng_chance(&rng, 0.35);
    c.sink_dtype = (af_dtype)rng_range(&rng, 0, 2);
    c.sink_offset = rng_chance(&rng, 0.3) ? 6.0 : 0.0;   /* now and then a sink that dominates */
    c.has_scale = rng_chance(&rng, 0.3);
    c.scale = (3.0 * rng_uniform(&rng) - 0.5) / sqrt((double)c.E);
    c.with_lse = rng_chance(&rng, 0.75);
    c.amplitude = c.softcap > 0.0 && rng_chance(&rng, 0.5) ? 8.0 : rng_chance(&rng, 0.2) ? 3.0 : 1.0;
    c.q_layout = (tensor_layout)rng_range(&rng, 0, LAYOUT_COUNT - 1);
    c.kv_layout = (tensor_layout)rng_range(&rng, 0, LAYOUT_COUNT - 1);
    c.out_layout = (tensor_layout)rng_range(&rng, 0, LAYOUT_COUNT - 1);
    return c;
}

static bool is_f8(af_dtype d) { return d == AF_F8E4M3 || d == AF_F8E5M2; }

af_dtype flash_case_kv_dtype(const flash_case *c) {
    return is_f8(c->dtype) ? c->dtype : is_f8(c->kv_dtype) ? c->kv_dtype : c->dtype;
}

af_dtype flash_case_out_dtype(const flash_case *c) { return is_f8(c->dtype) ? c->out_dtype : c->dtype; }

flash_case flash_case_random_fp8(uint64_t seed, int index) {
    static const af_dtype out_dtypes[] = {AF_F32, AF_F16, AF_BF16};
    flash_case c = flash_case_random(seed ^ 0xf8f8f8f8u, index);
    test_rng rng = {c.seed ^ 0x5bd1e995u};
    const af_dtype format = index / 4 % 2 ? AF_F8E5M2 : AF_F8E4M3;
    const int q_kind = index % 4;   /* f32, f16, bf16 q over float8 K/V; or all float8 */
    c.dtype = q_kind < 3 ? (af_dtype)q_kind : format;
    c.kv_dtype = format;
    c.out_dtype = out_dtypes[rng_range(&rng, 0, 2)];
    const int64_t d = rng_range(&rng, 0, 9);
    c.descale = d < 3 ? DESCALE_NONE : d < 7 ? DESCALE_RANDOM : d < 8 ? DESCALE_ZERO : DESCALE_HUGE;
    if (c.amplitude > 4.0 && format == AF_F8E4M3) c.amplitude = 4.0;   /* resolution: e4m3 keeps 3 bits */
    return c;
}

void flash_case_describe(const flash_case *c, char *buf, size_t size) {
    static const char *const forms[] = {"fixed", "varlen", "paged"};
    static const char *const descales[] = {"none", "random", "zero", "huge"};
    int used = snprintf(buf, size, "seed=%llu q=%s kv=%s out=%s descale=%s B=%lld Hq=%lld Hkv=%lld E=%lld Ev=%lld "
                        "q=%s kv=%s(page %lld%s) causal=%d window=%s(%lld,%lld) softcap=%g sink=%s scale=%s lse=%d "
                        "amp=%g layouts %s/%s/%s lens",
                        (unsigned long long)c->seed, af_dtype_name(c->dtype), af_dtype_name(flash_case_kv_dtype(c)),
                        af_dtype_name(flash_case_out_dtype(c)), descales[c->descale], (long long)c->B, (long long)c->Hq,
                        (long long)c->Hkv, (long long)c->E, (long long)c->Ev, c->varlen_q ? "varlen" : "fixed",
                        forms[c->kv], (long long)c->page_size, c->shared_page ? ",shared" : "", c->causal,
                        c->has_window ? "on" : "off", (long long)c->left, (long long)c->right, c->softcap,
                        c->sink ? af_dtype_name(c->sink_dtype) : "none", c->has_scale ? "given" : "default",
                        c->with_lse, c->amplitude, layout_name(c->q_layout), layout_name(c->kv_layout),
                        layout_name(c->out_layout));
    for (int b = 0; b < c->B && used > 0 && (size_t)used < size; b++)
        used += snprintf(buf + used, size - (size_t)used, " %lld/%lld(%lld)", (long long)c->Lq[b], (long long)c->Sk[b],
                         (long long)c->S_stored[b]);
}

static bool alloc_i32(test_tensor *t, int ndim, const int64_t *shape, test_rng *rng) {
    return tt_alloc(t, AF_I32, ndim, shape, LAYOUT_CONTIGUOUS, rng);
}

static void set1(test_tensor *t, int64_t i, double v) { tt_set(t, &i, v); }

/* A float32 contiguous copy of `src` (the reference's input: f16/bf16 values are exact in f32). */
static bool copy_f32(const test_tensor *src, test_tensor *dst, test_rng *rng) {
    if (!tt_alloc(dst, AF_F32, src->view.ndim, src->view.shape, LAYOUT_CONTIGUOUS, rng)) return false;
    if (tt_numel(src) == 0) return true;
    int64_t idx[AF_MAX_DIMS] = {0};
    do tt_set(dst, idx, tt_get(src, idx));
    while (tt_next_index(src->view.ndim, src->view.shape, idx));
    return true;
}

/* K and V: fixed (B, S, Hkv, D), packed (total_k, Hkv, D) or paged (num_pages, page_size, Hkv, D) with a page table
 * whose pages come in random order, entries past a sequence's pages -1 (never read). */
static bool build_kv(const flash_case *c, flash_tensors *t, test_rng *rng, int64_t *S_fixed) {
    const int64_t B = c->B;
    int64_t kshape[4], vshape[4];
    int nd = 4;
    *S_fixed = B > 0 ? c->S_stored[0] : 0;
    if (c->kv == KV_FIXED) {
        int64_t ks[4] = {B, *S_fixed, c->Hkv, c->E};
        memcpy(kshape, ks, sizeof ks);
    } else if (c->kv == KV_VARLEN) {
        int64_t total = 0;
        for (int b = 0; b < B; b++) total += c->S_stored[b];
        int64_t ks[3] = {total, c->Hkv, c->E};
        memcpy(kshape, ks, sizeof ks);
        nd = 3;
        const int64_t cs[1] = {B + 1};
        if (!alloc_i32(&t->cu_k, 1, cs, rng)) return false;
        int64_t at = 0;
        for (int b = 0; b <= B; b++) {
            set1(&t->cu_k, b, (double)at);
            if (b < B) at += c->S_stored[b];
        }
    } else {
        int64_t pages_of[FLASH_MAX_BATCH], num_pages = 1, max_pages = 1;   /* one spare page, never used */
        for (int b = 0; b < B; b++) {
            pages_of[b] = (c->S_stored[b] + c->page_size - 1) / c->page_size;
            num_pages += pages_of[b];
            max_pages = pages_of[b] + 1 > max_pages ? pages_of[b] + 1 : max_pages;
        }
        int64_t ks[4] = {num_pages, c->page_size, c->Hkv, c->E};
        memcpy(kshape, ks, sizeof ks);
        const int64_t ps[2] = {B, max_pages};
        if (!alloc_i32(&t->page_table, 2, ps, rng)) return false;
        int64_t *order = malloc(sizeof(int64_t) * (size_t)num_pages);
        if (!order) return false;
        for (int64_t i = 0; i < num_pages; i++) order[i] = i;
        for (int64_t i = num_pages - 1; i > 0; i--) {   /* pages in random order */
            const int64_t j = rng_range(rng, 0, i), tmp = order[i];
            order[i] = order[j];
            order[j] = tmp;
        }
        int64_t next = 0;
        for (int b = 0; b < B; b++)
            for (int64_t p = 0; p < max_pages; p++) {
                const int64_t idx[2] = {b, p};
                const bool used = p < (c->Sk[b] + c->page_size - 1) / c->page_size;
                const double page = p < pages_of[b] ? (double)order[next++] : -1.0;
                tt_set(&t->page_table, idx, used ? page : -1.0);
            }
        const int64_t i0[2] = {0, 0}, i1[2] = {1, 0};
        if (c->shared_page && tt_get(&t->page_table, i0) >= 0 && tt_get(&t->page_table, i1) >= 0)
            tt_set(&t->page_table, i1, tt_get(&t->page_table, i0));   /* sequence 1 reads sequence 0's first page */
        free(order);
    }
    memcpy(vshape, kshape, sizeof kshape);
    vshape[nd - 1] = c->Ev;
    const af_dtype kv_dtype = flash_case_kv_dtype(c);
    if (!tt_alloc(&t->k, kv_dtype, nd, kshape, c->kv_layout, rng) ||
        !tt_alloc(&t->v, kv_dtype, nd, vshape, c->kv_layout, rng))
        return false;
    tt_fill_uniform(&t->k, rng, c->amplitude);
    tt_fill_uniform(&t->v, rng, c->amplitude);
    if (c->seqused) {
        const int64_t ss[1] = {B};
        if (!alloc_i32(&t->seqused_k, 1, ss, rng)) return false;
        for (int b = 0; b < B; b++) set1(&t->seqused_k, b, (double)c->Sk[b]);
    }
    return true;
}

/* q/k/v_descale (B, Hkv) in random layouts: random in [1/4, 4), each absent now and then; or one of them 0 or 2^12. */
static bool build_descales(const flash_case *c, flash_tensors *t, test_rng *rng) {
    if (c->descale == DESCALE_NONE) return true;
    test_tensor *d[3] = {&t->q_descale, &t->k_descale, &t->v_descale};
    const af_tensor **arg[3] = {&t->args.q_descale, &t->args.k_descale, &t->args.v_descale};
    const int64_t shape[2] = {c->B, c->Hkv};
    const int64_t special = rng_range(rng, 0, 2);   /* which descale is 0 or huge */
    for (int i = 0; i < 3; i++) {
        if (c->descale == DESCALE_RANDOM && rng_chance(rng, 0.25)) continue;
        if (!tt_alloc(d[i], AF_F32, 2, shape, (tensor_layout)rng_range(rng, 0, LAYOUT_COUNT - 1), rng)) return false;
        int64_t idx[2] = {0, 0};
        if (tt_numel(d[i]) > 0)
            do {
                double x = 0.25 * pow(16.0, rng_uniform(rng));
                if (i == special && c->descale == DESCALE_ZERO) x = rng_chance(rng, 0.5) ? 0.0 : -0.0;
                if (i == special && c->descale == DESCALE_HUGE) x = 4096.0;
                tt_set(d[i], idx, x);
            } while (tt_next_index(2, shape, idx));
        *arg[i] = &d[i]->view;
    }
    return true;
}

bool flash_case_rerun_reference(flash_tensors *t) {
    tt_fill_bytes(&t->ref_out, TT_SENTINEL_BYTE);
    tt_fill_bytes(&t->ref_lse, TT_SENTINEL_BYTE);
    return af_flash_attn_reference(&t->ref_args, &t->ref_out.view, t->c.with_lse ? &t->ref_lse.view : NULL) == AF_OK;
}

bool flash_case_build(const flash_case *c, flash_tensors *t) {
    memset(t, 0, sizeof *t);
    t->c = *c;
    test_rng rng = {c->seed};
    const int64_t B = c->B;
    int64_t total_q = 0, S_fixed;
    for (int b = 0; b < B; b++) total_q += c->Lq[b];
    const int64_t L_fixed = B > 0 ? c->Lq[0] : 0;
    int64_t qshape[4] = {B, L_fixed, c->Hq, c->E}, oshape[4] = {B, L_fixed, c->Hq, c->Ev}, lshape[3] = {B, c->Hq, L_fixed};
    int qnd = 4, lnd = 3;
    if (c->varlen_q) {
        const int64_t qs[3] = {total_q, c->Hq, c->E}, os[3] = {total_q, c->Hq, c->Ev}, ls[2] = {c->Hq, total_q};
        memcpy(qshape, qs, sizeof qs);
        memcpy(oshape, os, sizeof os);
        memcpy(lshape, ls, sizeof ls);
        qnd = 3;
        lnd = 2;
        const int64_t cs[1] = {B + 1};
        if (!alloc_i32(&t->cu_q, 1, cs, &rng)) return false;
        int64_t at = 0;
        for (int b = 0; b <= B; b++) {
            set1(&t->cu_q, b, (double)at);
            if (b < B) at += c->Lq[b];
        }
    }
    if (!tt_alloc(&t->q, c->dtype, qnd, qshape, c->q_layout, &rng) ||
        !tt_alloc(&t->out, flash_case_out_dtype(c), qnd, oshape, c->out_layout, &rng) ||
        !tt_alloc(&t->lse, AF_F32, lnd, lshape, c->out_layout, &rng) ||
        !tt_alloc(&t->ref_out, AF_F32, qnd, oshape, LAYOUT_CONTIGUOUS, &rng) ||
        !tt_alloc(&t->ref_lse, AF_F32, lnd, lshape, LAYOUT_CONTIGUOUS, &rng) || !build_kv(c, t, &rng, &S_fixed))
        return false;
    tt_fill_uniform(&t->q, &rng, c->amplitude);
    if (c->sink) {
        const int64_t ss[1] = {c->Hq};
        if (!tt_alloc(&t->sink, c->sink_dtype, 1, ss, LAYOUT_SLICED, &rng)) return false;
        tt_fill_uniform(&t->sink, &rng, c->sink_amplitude);
        for (int64_t h = 0; h < c->Hq; h++) set1(&t->sink, h, tt_get(&t->sink, &h) + c->sink_offset);
    }
    t->args = (af_flash_args){.query = &t->q.view, .key = &t->k.view, .value = &t->v.view, .has_scale = c->has_scale,
                              .scale = c->scale, .causal = c->causal, .has_window = c->has_window,
                              .window_left = c->left, .window_right = c->right, .softcap = c->softcap,
                              .learnable_sink = c->sink ? &t->sink.view : NULL};
    if (c->varlen_q) {
        t->args.cu_seqlens_q = &t->cu_q.view;
        for (int b = 0; b < B; b++) t->args.max_seqlen_q = c->Lq[b] > t->args.max_seqlen_q ? c->Lq[b] : t->args.max_seqlen_q;
    }
    if (c->kv == KV_VARLEN) {
        t->args.cu_seqlens_k = &t->cu_k.view;
        for (int b = 0; b < B; b++) t->args.max_seqlen_k = c->Sk[b] > t->args.max_seqlen_k ? c->Sk[b] : t->args.max_seqlen_k;
    }
    if (c->kv == KV_PAGED) t->args.page_table = &t->page_table.view;
    if (c->seqused) t->args.seqused_k = &t->seqused_k.view;
    if (!build_descales(c, t, &rng)) return false;
    if (!copy_f32(&t->q, &t->q32, &rng) || !copy_f32(&t->k, &t->k32, &rng) || !copy_f32(&t->v, &t->v32, &rng))
        return false;
    /* The reference reads float8 inputs themselves (it decodes them exactly; descales need float8 K/V) and float32
     * copies of the others, writing float32. */
    t->ref_args = t->args;
    if (!is_f8(c->dtype)) t->ref_args.query = &t->q32.view;
    if (!is_f8(flash_case_kv_dtype(c))) {
        t->ref_args.key = &t->k32.view;
        t->ref_args.value = &t->v32.view;
    }
    if (c->sink) {
        if (!copy_f32(&t->sink, &t->sink32, &rng)) return false;
        t->ref_args.learnable_sink = &t->sink32.view;
    }
    return flash_case_rerun_reference(t);
}

void flash_case_free(flash_tensors *t) {
    test_tensor *all[] = {&t->q, &t->k, &t->v, &t->out, &t->lse, &t->sink, &t->cu_q, &t->cu_k, &t->seqused_k,
                          &t->page_table, &t->q_descale, &t->k_descale, &t->v_descale,
                          &t->q32, &t->k32, &t->v32, &t->sink32, &t->ref_out, &t->ref_lse};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tt_free(all[i]);
}

af_status flash_case_run(flash_tensors *t, const char *isa, int threads) {
    tt_fill_bytes(&t->out, TT_SENTINEL_BYTE);
    tt_fill_bytes(&t->lse, TT_SENTINEL_BYTE);
    af_status st = af_set_isa(isa);
    if (st != AF_OK) return st;
    af_set_num_threads(threads);
    return af_flash_attn(&t->args, &t->out.view, t->c.with_lse ? &t->lse.view : NULL);
}

/* The largest |d| over a descale (1 when absent). */
static double descale_max(const test_tensor *d) {
    if (!d->memory) return 1.0;
    double max_abs, row_norm;
    tt_magnitudes(d, &max_abs, &row_norm);
    return max_abs;
}

/* af_error_bound's inputs: the largest |v| (times the largest |v_descale|); the logits' bound
 * |scale·q_descale·k_descale|·‖q‖·‖k‖ (softcap: at most twice the cap, the capped logit's error being the raw one
 * times sech² — see kernel/softcap.h) plus the largest |sink|. float8 inputs are exact in float32, so nothing else
 * changes: the error is the computation's, as for float32 inputs with this output dtype. */
static bool approximate_tanh;

void flash_case_allow_approximate_tanh(void) { approximate_tanh = true; }

static af_error_scale error_scale(const flash_tensors *t) {
    double q_abs, q_norm, k_abs, k_norm, v_abs, v_norm, s_abs = 0.0, s_norm;
    tt_magnitudes(&t->q32, &q_abs, &q_norm);
    tt_magnitudes(&t->k32, &k_abs, &k_norm);
    tt_magnitudes(&t->v32, &v_abs, &v_norm);
    if (t->c.sink) tt_magnitudes(&t->sink32, &s_abs, &s_norm);
    const double scale = (t->c.has_scale ? t->c.scale : 1.0 / sqrt((double)t->c.E)) * descale_max(&t->q_descale) *
                         descale_max(&t->k_descale);
    v_abs *= descale_max(&t->v_descale);
    double logit = fabs(scale) * q_norm * k_norm;
    if (t->c.softcap > 0.0 && logit > 2.0 * t->c.softcap) logit = 2.0 * t->c.softcap;
    int64_t S = 1;
    for (int b = 0; b < t->c.B; b++) S = t->c.Sk[b] > S ? t->c.Sk[b] : S;
    const double tanh_error = t->c.softcap > 0.0 && approximate_tanh ? t->c.softcap * AF_TANH_APPROX_ERROR : 0.0;
    return (af_error_scale){.value_max = v_abs, .logit_max = logit + s_abs, .E = t->c.E, .S = S,
                            .logit_error = tanh_error};
}

static double ratio_of(double got, double want, double bound) {
    if (isnan(want) || isinf(want)) return (isnan(want) && isnan(got)) || got == want ? 0.0 : INFINITY;
    const double err = fabs(got - want);
    return isnan(err) ? INFINITY : err == 0.0 ? 0.0 : err / bound;
}

static bool compare(const test_tensor *got, const test_tensor *want, const af_error_scale *es, af_dtype dtype, bool lse,
                    char *why, size_t size) {
    if (tt_numel(got) == 0) return true;
    int64_t idx[AF_MAX_DIMS] = {0};
    const int nd = got->view.ndim;
    do {
        const double g = tt_get(got, idx), w = tt_get(want, idx);
        af_error_scale unit = *es, none = *es;
        unit.value_max = 1.0;
        none.value_max = 0.0;
        const double bound = lse ? af_error_bound(dtype, 0.0, &unit) + af_error_bound(AF_F32, w, &none)
                                 : af_error_bound(dtype, w, es);
        if (ratio_of(g, w, bound) > 1.0) {
            snprintf(why, size, "%s[%lld,%lld,%lld,%lld] = %.9g, reference %.9g, |error| %.3g > bound %.3g",
                     lse ? "lse" : "out", (long long)idx[0], (long long)(nd > 1 ? idx[1] : 0),
                     (long long)(nd > 2 ? idx[2] : 0), (long long)(nd > 3 ? idx[3] : 0), g, w, fabs(g - w), bound);
            return false;
        }
    } while (tt_next_index(nd, got->view.shape, idx));
    return true;
}

bool flash_case_matches(const flash_tensors *t, char *why, size_t size) {
    const af_error_scale es = error_scale(t);
    const af_dtype out_dtype = flash_case_out_dtype(&t->c);
    return compare(&t->out, &t->ref_out, &es, out_dtype, false, why, size) &&
           (!t->c.with_lse || compare(&t->lse, &t->ref_lse, &es, out_dtype, true, why, size));
}

bool flash_case_verify_everywhere(flash_tensors *t, char *why, size_t size) {
    const char *isas[CASE_MAX_ISAS];
    const int n = case_isas(isas, CASE_MAX_ISAS);
    const test_tensor *inputs[] = {&t->q, &t->k, &t->v, &t->sink, &t->cu_q, &t->cu_k, &t->seqused_k, &t->page_table,
                                   &t->q_descale, &t->k_descale, &t->v_descale};
    enum { N_IN = sizeof inputs / sizeof inputs[0] };
    unsigned char *snap[N_IN];
    for (int i = 0; i < N_IN; i++) snap[i] = tt_snapshot(inputs[i]);
    bool ok = n > 0;
    for (int i = 0; i < n && ok; i++) {
        unsigned char *first_out = NULL, *first_lse = NULL;
        for (int threads = case_first_threads(); threads <= 2 && ok; threads++) {
            char detail[512] = "";
            const af_status st = flash_case_run(t, isas[i], threads);
            if (st != AF_OK) snprintf(detail, sizeof detail, "status %s: %s", af_status_name(st), af_last_error());
            else if (!tt_outside_view_is(&t->out, TT_SENTINEL_BYTE)) snprintf(detail, sizeof detail, "wrote outside out");
            else if (t->c.with_lse && !tt_outside_view_is(&t->lse, TT_SENTINEL_BYTE))
                snprintf(detail, sizeof detail, "wrote outside lse");
            else if (!flash_case_matches(t, detail, sizeof detail)) {
            } else if (!first_out) {
                first_out = tt_snapshot(&t->out);
                first_lse = tt_snapshot(&t->lse);
                continue;
            } else if (!tt_same_as(&t->out, first_out) || !tt_same_as(&t->lse, first_lse)) {
                snprintf(detail, sizeof detail, "2 threads give different bits from 1 thread");
            } else {
                continue;
            }
            snprintf(why, size, "isa %s, %d thread(s): %s", isas[i], threads, detail);
            ok = false;
        }
        free(first_out);
        free(first_lse);
    }
    for (int i = 0; i < N_IN; i++) {
        if (ok && !tt_same_as(inputs[i], snap[i])) {
            snprintf(why, size, "input #%d changed", i);
            ok = false;
        }
        free(snap[i]);
    }
    return ok;
}

bool flash_case_build_and_verify(const flash_case *c, char *why, size_t size) {
    char desc[1024], reason[640] = "";
    flash_case_describe(c, desc, sizeof desc);
    flash_tensors t;
    const bool built = flash_case_build(c, &t);
    const bool ok = built && flash_case_verify_everywhere(&t, reason, sizeof reason);
    flash_case_free(&t);
    if (!built) snprintf(why, size, "could not build the case (%s): %s", af_last_error(), desc);
    else if (!ok) snprintf(why, size, "%s\n    %s", desc, reason);
    return ok;
}
