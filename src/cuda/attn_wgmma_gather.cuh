/* The gathered producer of attn_wgmma.cuh (issue 30; issue 37 item 8): a paged K/V cache whose pages TMA cannot box
 * (page sizes that are neither a multiple of the tile's bc keys nor 8 or more dividing it) reaches the Hopper kernel
 * through cp.async instead, copied by all 128 threads of warpgroup 0 into exactly the stage layout TMA writes
 * (af_wgmma_offset: 128-byte swizzle, column blocks of bc rows).
 * Coalescing: eight consecutive lanes copy the eight 16-byte chunks of one key's 128-byte row of a column block, so
 * a warp reads 4 keys x 128 contiguous bytes a pass (whole 32-byte sectors); warp w owns keys w·bc/4.. of a tile and
 * takes them 4 a pass (bc/16 passes), every column block of K and of V for each.
 * Pages: lane j of warp w looks up key w·bc/4 + j's page and row in it once a tile (one division, one table load);
 * the lanes copying that key take both with af_shfl_int from lane j. Keys past the sequence (page -1) and columns
 * past E / Ev are zero-filled by cp.async (src_bytes 0): no row past the sequence is read.
 * Completion without blocking: each thread ends a tile with cp.async.mbarrier.arrive.noinc on its "full" barrier
 * (init counts the 128 producer threads; no transaction bytes), which arrives once the thread's copies have landed;
 * the producer never waits for its copies, so af_wgmma_stages_of(hd, 1) tiles (3 where shared memory holds them)
 * are in flight.
 * The async proxy: cp.async writes through the generic proxy, wgmma reads through the async proxy, and the writer
 * does not know when its copies complete, so the fence.proxy.async (PTX memory model: on the causality path from
 * the write to the read) is the consumers': af_wgmma_wait_full fences after the wait on "full", before the wgmma.
 * FlashAttention-3 (hopper/paged_kv.h, pipeline producer_commit with cpasync_barrier_arrive) issues none there.
 * Included by attn_wgmma.cuh. */
#ifndef AF_CUDA_ATTN_WGMMA_GATHER_CUH
#define AF_CUDA_ATTN_WGMMA_GATHER_CUH

#define AF_WG_GATHER_THREADS 128   /* warpgroup 0: an arrival a thread on "full" */
#define AF_WG_GATHER_ROW_LANES 8   /* lanes copying one key's 128-byte row of a column block */

/* A consumer thread takes its tile's stage: the wait on its "full" barrier, then, on the gathered path, the proxy
 * fence that makes the copies (generic proxy, seen through the barrier) visible to its wgmma (async proxy). */
AF_DEVICE void af_wgmma_wait_full(uint64_t *full, uint32_t parity, int gather) {
    af_mbarrier_wait_parity(full, parity);
    if (gather) af_fence_proxy_async();
}

/* One key's chunk `lane8` of every column block of a row (`blocks` blocks, `cols` real columns) from `src` into row
 * `row` of a stage's column blocks of `rows` rows; nothing is read for a key past the sequence (inside 0) or a chunk
 * past `cols`: zeros. */
AF_DEVICE void af_wgmma_gather_chunks(char *stage, const char *src, int blocks, int cols, int inside, int row,
                                      int lane8, const int rows) {
    for (int c = lane8; c < blocks * 8; c += 8) {
        const int bytes = inside ? af_mma_chunk_bytes(cols, c, 2) : 0;
        af_cp_async_16(stage + af_wgmma_offset(row, c, rows), src + (bytes > 0 ? c * 16 : 0), bytes);
    }
}

/* The gathered producer, run by every thread of warpgroup 0: the CTA's one item (record `r`: `count` tiles from
 * t_begin, of the sequence's `keys` keys), tile n into stage n % stages once the consumers released it (as
 * af_wgmma_produce), each key's page through the table once a tile. Indexing in 32 bits (the plan bounds keys, pages
 * and the table's row), but for the pool's element offset; pointers recomputed where used from the base and the
 * parameters (this runs on 24 registers). */
AF_DEVICE void af_wgmma_gather(const af_wgmma_params *p, char *base, const volatile af_wgmma_record *r,
                               const int hd) {
    const int bc = AF_WG_BC_OF(hd), stages = AF_WG_STAGES_OF(hd, 1);
    const int stage_bytes = (hd / AF_WG_ATOM) * AF_WG_BLOCK_BYTES(bc);
    const int lane = af_lane(), lane8 = lane % AF_WG_GATHER_ROW_LANES, warp_keys = bc / 4;
    const int warp_row = (af_warp() % 4) * warp_keys;   /* the warp's first key row of a tile */
    for (int n = 0; n < r->count; n++) {   /* the record's fields read where used: no register holds one */
        const int stage = n % stages;
        uint64_t *bars = af_wgmma_bars(base);
        if (n >= stages)   /* the stage refilled once its V is released */
            af_mbarrier_wait_parity(af_wgmma_bar(bars, AF_WG_EMPTY_V, stage), (uint32_t)((n / stages - 1) & 1));
        /* the key this lane looks up: row `lane` of its warp's share (bc 64: lanes 16.. own none) */
        const int own_key = (r->t_begin + n) * bc + warp_row + lane;
        int own_page = -1, own_slot = 0;   /* page -1: past the sequence, nothing read */
        if (lane < warp_keys && own_key < r->keys) {
            const int page_size = (int)p->m.page_size;
            own_page = p->m.page_table[(int64_t)r->b * p->m.page_table_stride[0] +
                                       (int)((unsigned)own_key / (unsigned)page_size) * p->m.page_table_stride[1]];
            own_slot = (int)((unsigned)own_key % (unsigned)page_size);
        }
        char *k_stage = af_wgmma_k_stages(base, hd) + stage * stage_bytes;
        char *v_stage = af_wgmma_v_stages(base, stages, hd) + stage * stage_bytes;
        AF_MMA_ROLLED   /* one key row a pass: its addresses are not kept for the next (24 registers) */
        for (int pass = 0; pass < warp_keys / 4; pass++) {
            const int src = 4 * pass + lane / AF_WG_GATHER_ROW_LANES;   /* the lane that looked this key up */
            const int page = af_shfl_int(own_page, src), slot = af_shfl_int(own_slot, src);
            const int inside = page >= 0, row = warp_row + src;
            const char *k_row = p->m.k, *v_row = p->m.v;   /* past the sequence: never read */
            if (inside) {
                k_row += 2 * ((int64_t)page * p->m.k_stride[0] + (int64_t)r->hk * p->m.k_stride[1] +
                              (int64_t)slot * p->m.k_stride[2]);
                v_row += 2 * ((int64_t)page * p->m.v_stride[0] + (int64_t)r->hk * p->m.v_stride[1] +
                              (int64_t)slot * p->m.v_stride[2]);
            }
            af_wgmma_gather_chunks(k_stage, k_row, p->k_blocks, p->m.E, inside, row, lane8, bc);
            af_wgmma_gather_chunks(v_stage, v_row, hd / AF_WG_ATOM, p->m.Ev, inside, row, lane8, bc);
        }
        /* arrives on "full K" once this thread's copies have landed */
        af_cp_async_mbarrier_arrive_noinc(af_wgmma_bar(bars, AF_WG_FULL_K, stage));
    }
}

#endif
