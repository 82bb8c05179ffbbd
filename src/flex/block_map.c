/* Reading and asking a block mask (block_map.h). */
#include "flex/block_map.h"

#include <stdbool.h>
#include <string.h>

#include "core/alloc.h"
#include "core/dtype.h"
#include "core/status.h"

/* `t` is an int32 CPU tensor of `ndim` dims whose batch and head dims are 1 or B / Hq. */
static af_status check_tensor(const af_tensor *t, const char *name, int ndim, int64_t B, int64_t Hq) {
    if (!t) return af_fail(AF_ERR_INVALID_ARGUMENT, "block_mask.%s: must not be NULL", name);
    if (t->device.type != AF_DEVICE_CPU)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "block_mask.%s: must be on the CPU", name);
    if (t->dtype != AF_I32)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "block_mask.%s: is %s; int32 is taken", name,
                       af_dtype_name(t->dtype));
    if (t->ndim != ndim)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "block_mask.%s: has %d dimensions; it must have %d", name, t->ndim,
                       ndim);
    bool empty = false;
    for (int k = 0; k < ndim; k++) {
        if (t->shape[k] < 0 || t->strides[k] < 0)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "block_mask.%s: negative size or stride in dim %d", name, k);
        empty = empty || t->shape[k] == 0;
    }
    if (!empty && !t->data) return af_fail(AF_ERR_INVALID_ARGUMENT, "block_mask.%s: has elements but no data", name);
    if (t->shape[0] != 1 && t->shape[0] != B)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "block_mask.%s: batch dim %lld must be 1 or the call's B = %lld", name,
                       (long long)t->shape[0], (long long)B);
    if (t->shape[1] != 1 && t->shape[1] != Hq)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "block_mask.%s: head dim %lld must be 1 or the call's Hq = %lld", name,
                       (long long)t->shape[1], (long long)Hq);
    return AF_OK;
}

static int32_t at(const af_tensor *t, const int64_t *idx) {
    int64_t off = 0;
    for (int k = 0; k < t->ndim; k++) off += (t->shape[k] == 1 ? 0 : idx[k]) * t->strides[k];
    int32_t v;
    memcpy(&v, (const char *)t->data + off * 4, 4);
    return v;
}

/* The counts and index lists of one kind (partial or full) into the map, class `cls`. */
static af_status mark(af_block_map *m, const af_tensor *num, const af_tensor *ind, const char *num_name,
                      const char *ind_name, uint8_t cls) {
    for (int64_t b = 0; b < m->Bm; b++)
        for (int64_t h = 0; h < m->Hm; h++)
            for (int64_t q = 0; q < m->nq; q++) {
                const int64_t i3[3] = {b, h, q};
                const int32_t count = at(num, i3);
                if (count < 0 || count > ind->shape[3])
                    return af_fail(AF_ERR_INVALID_ARGUMENT, "block_mask.%s: entry [%lld][%lld][%lld] is %d; it must "
                                   "lie in [0, %lld] (%s's last dim)", num_name, (long long)b, (long long)h,
                                   (long long)q, (int)count, (long long)ind->shape[3], ind_name);
                uint8_t *row = m->cls + (size_t)(((b * m->Hm + h) * m->nq + q) * m->nk);
                for (int32_t n = 0; n < count; n++) {
                    const int64_t i4[4] = {b, h, q, n};
                    const int32_t k = at(ind, i4);
                    if (k < 0 || k >= m->nk)
                        return af_fail(AF_ERR_INVALID_ARGUMENT, "block_mask.%s: entry [%lld][%lld][%lld][%d] is %d; "
                                       "it must lie in [0, %lld): the key blocks of S keys in blocks of %lld", ind_name,
                                       (long long)b, (long long)h, (long long)q, (int)n, (int)k, (long long)m->nk,
                                       (long long)m->kv_block);
                    if (row[k] != AF_BLOCK_EMPTY)
                        return af_fail(AF_ERR_INVALID_ARGUMENT, "block_mask.%s: key block %d of query block %lld "
                                       "(batch %lld, head %lld) is listed %s", ind_name, (int)k, (long long)q,
                                       (long long)b, (long long)h,
                                       row[k] == cls ? "twice" : "both as full and as partial");
                    row[k] = cls;
                }
            }
    return AF_OK;
}

af_status af_block_map_build(const af_block_mask *bm, int64_t B, int64_t Hq, int64_t L, int64_t S, af_block_map *m) {
    memset(m, 0, sizeof *m);
    if (bm->q_block < 1 || bm->kv_block < 1)
        return af_fail(AF_ERR_INVALID_ARGUMENT, "block_mask: block sizes %lld x %lld; both must be at least 1",
                       (long long)bm->q_block, (long long)bm->kv_block);
    af_status st;
    if ((st = check_tensor(bm->kv_num_blocks, "kv_num_blocks", 3, B, Hq)) != AF_OK ||
        (st = check_tensor(bm->kv_indices, "kv_indices", 4, B, Hq)) != AF_OK)
        return st;
    const bool full = bm->full_kv_num_blocks || bm->full_kv_indices;
    if (full && ((st = check_tensor(bm->full_kv_num_blocks, "full_kv_num_blocks", 3, B, Hq)) != AF_OK ||
                 (st = check_tensor(bm->full_kv_indices, "full_kv_indices", 4, B, Hq)) != AF_OK))
        return st;
    m->q_block = bm->q_block;
    m->kv_block = bm->kv_block;
    m->nq = (L + bm->q_block - 1) / bm->q_block;
    m->nk = (S + bm->kv_block - 1) / bm->kv_block;
    const af_tensor *dims[4] = {bm->kv_num_blocks, bm->kv_indices, bm->full_kv_num_blocks, bm->full_kv_indices};
    const char *names[4] = {"kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"};
    m->Bm = m->Hm = 1;
    for (int t = 0; t < (full ? 4 : 2); t++) {
        if (dims[t]->shape[0] > 1) m->Bm = B;
        if (dims[t]->shape[1] > 1) m->Hm = Hq;
        if (dims[t]->shape[2] < m->nq)
            return af_fail(AF_ERR_INVALID_ARGUMENT, "block_mask.%s: %lld query blocks; the call's L = %lld rows in "
                           "blocks of %lld need %lld", names[t], (long long)dims[t]->shape[2], (long long)L,
                           (long long)bm->q_block, (long long)m->nq);
    }
    const size_t rows = (size_t)(m->Bm * m->Hm * m->nq);
    if (rows > 0 && (size_t)m->nk > ((size_t)1 << 40) / rows)
        return af_fail(AF_ERR_NO_MEMORY, "out of memory: a block map of %zu x %lld blocks", rows, (long long)m->nk);
    m->cls = af_alloc(rows * (size_t)m->nk + 1);
    m->first = af_alloc(sizeof(int32_t) * (rows + 1));
    m->end = af_alloc(sizeof(int32_t) * (rows + 1));
    if (!m->cls || !m->first || !m->end) {
        af_block_map_release(m);
        return af_fail(AF_ERR_NO_MEMORY, "out of memory: a block map of %zu x %lld blocks", rows, (long long)m->nk);
    }
    memset(m->cls, AF_BLOCK_EMPTY, rows * (size_t)m->nk);
    if ((st = mark(m, bm->kv_num_blocks, bm->kv_indices, "kv_num_blocks", "kv_indices", AF_BLOCK_PARTIAL)) != AF_OK ||
        (full && (st = mark(m, bm->full_kv_num_blocks, bm->full_kv_indices, "full_kv_num_blocks", "full_kv_indices",
                            AF_BLOCK_FULL)) != AF_OK)) {
        af_block_map_release(m);
        return st;
    }
    for (size_t r = 0; r < rows; r++) {
        const uint8_t *row = m->cls + r * (size_t)m->nk;
        int64_t first = 0, end = m->nk;
        while (first < end && row[first] == AF_BLOCK_EMPTY) first++;
        while (end > first && row[end - 1] == AF_BLOCK_EMPTY) end--;
        m->first[r] = (int32_t)first;
        m->end[r] = (int32_t)end;
    }
    return AF_OK;
}

void af_block_map_release(af_block_map *m) {
    af_free(m->cls);
    af_free(m->first);
    af_free(m->end);
    memset(m, 0, sizeof *m);
}

/* The map rows of rows [i0, i1] of heads [h0, h0 + nh) of batch b: heads [*hb, *he), query blocks [*qb, *qe). */
static void map_rows(const af_block_map *m, int64_t h0, int64_t nh, int64_t i0, int64_t i1, int64_t *hb, int64_t *he,
                     int64_t *qb, int64_t *qe) {
    *hb = m->Hm == 1 ? 0 : h0;
    *he = m->Hm == 1 ? 1 : h0 + nh;
    *qb = i0 / m->q_block;
    *qe = i1 / m->q_block + 1 < m->nq ? i1 / m->q_block + 1 : m->nq;
}

static int64_t map_row(const af_block_map *m, int64_t b, int64_t h, int64_t q) {
    return ((m->Bm == 1 ? 0 : b) * m->Hm + h) * m->nq + q;
}

void af_block_map_keys(const af_block_map *m, int64_t b, int64_t h0, int64_t nh, int64_t i0, int64_t i1, int64_t S,
                       int64_t *lo, int64_t *hi) {
    int64_t first = m->nk, end = 0, hb, he, qb, qe;
    map_rows(m, h0, nh, i0, i1, &hb, &he, &qb, &qe);
    for (int64_t h = hb; h < he; h++)
        for (int64_t q = qb; q < qe; q++) {
            const int64_t r = map_row(m, b, h, q);
            if (m->first[r] >= m->end[r]) continue;
            if (m->first[r] < first) first = m->first[r];
            if (m->end[r] > end) end = m->end[r];
        }
    if (end <= first) {
        *lo = *hi = 0;
        return;
    }
    *lo = first * m->kv_block;
    *hi = end * m->kv_block < S ? end * m->kv_block : S;
}

int af_block_map_tile(const af_block_map *m, int64_t b, int64_t h0, int64_t nh, int64_t i0, int64_t i1, int64_t j0,
                      int64_t j1) {
    bool any = false, all_full = true;
    const int64_t k0 = j0 / m->kv_block, k1 = (j1 - 1) / m->kv_block;
    int64_t hb, he, qb, qe;
    map_rows(m, h0, nh, i0, i1, &hb, &he, &qb, &qe);
    for (int64_t h = hb; h < he; h++)
        for (int64_t q = qb; q < qe; q++) {
            const uint8_t *row = m->cls + (size_t)(map_row(m, b, h, q) * m->nk);
            for (int64_t k = k0; k <= k1; k++) {
                any = any || row[k] != AF_BLOCK_EMPTY;
                all_full = all_full && row[k] == AF_BLOCK_FULL;
            }
        }
    return !any ? AF_BLOCK_EMPTY : all_full ? AF_BLOCK_FULL : AF_BLOCK_PARTIAL;
}
