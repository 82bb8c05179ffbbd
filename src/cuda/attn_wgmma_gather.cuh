/* The gathered producer of attn_wgmma.cuh (issue 30): a paged K/V cache whose pages TMA cannot box (page sizes that
 * are neither a multiple of the tile's bc keys nor 8 or more dividing it) reaches the Hopper kernel through cp.async
 * instead. All 128 threads of warpgroup 0 copy the tile: thread t owns key t of every 128-key tile, looks its page
 * up once a tile and copies the key's K row (k_blocks column blocks) and V row (all hd/64 blocks) into exactly the
 * stage layout TMA writes (af_wgmma_offset: 128-byte swizzle, column blocks of bc rows); with head dim 256's 64-key
 * tiles, threads 0..63 copy the keys' K rows and threads 64..127 their V rows; columns past E / Ev and keys past the
 * sequence are zero-filled by cp.async (src_bytes 0), so no row past the sequence is read.
 * Completion: cp.async writes go through the generic proxy and complete per thread, wgmma reads through the async
 * proxy: each thread commits tile n's copies as one group; tile n-1 is then published — its group waited for
 * (wait_group 1 while a stage is free, so tile n's copies run on; wait_group 0 before the wait for a stage, since
 * the consumers free tile n-2's stage only after they got tile n-1), fenced (fence.proxy.async) and arrived on its
 * "full" barrier, which counts the 128 producer threads (no transaction bytes). Included by attn_wgmma.cuh. */
#ifndef AF_CUDA_ATTN_WGMMA_GATHER_CUH
#define AF_CUDA_ATTN_WGMMA_GATHER_CUH

#define AF_WG_GATHER_THREADS 128   /* warpgroup 0: one key of the tile a thread */

/* One key's row (`chunks` 16-byte chunks, `cols` of them real columns) from `src` into row `row` of a stage's
 * column blocks of `rows` rows; nothing is read for a key past the sequence (inside 0) or a chunk past `cols`:
 * zeros. */
AF_DEVICE void af_wgmma_gather_row(char *stage, const char *src, int chunks, int cols, int inside, int row,
                                   const int rows) {
    for (int c = 0; c < chunks; c++) {
        const int bytes = inside ? af_mma_chunk_bytes(cols, c, 2) : 0;
        af_cp_async_16(stage + af_wgmma_offset(row, c, rows), src + (bytes > 0 ? c * 16 : 0), bytes);
    }
}

/* Tile n's copies are complete in this thread: published to the async proxy, then counted on its "full" barrier. */
AF_DEVICE void af_wgmma_gather_publish(uint64_t *full_of_tile) {
    af_fence_proxy_async();   /* cp.async wrote through the generic proxy; wgmma reads through the async one */
    af_mbarrier_arrive(full_of_tile);
}

/* The gathered producer, run by every thread of warpgroup 0: tiles [t_begin, t_end), tile n into stage
 * n % AF_WG_STAGES once the consumers released it (as af_wgmma_produce), this thread's key of it through the page
 * table (one lookup a key a tile). Indexing in 32 bits (the plan bounds keys, pages and the table's row), but for
 * the pool's element offset. */
AF_DEVICE void af_wgmma_gather(const af_wgmma_params *p, char *k_stages, char *v_stages, uint64_t *full,
                               uint64_t *empty, int64_t b, int64_t hk, const af_sequence *sq, int64_t t_begin,
                               int64_t t_end, const int hd) {
    const int bc = AF_WG_BC_OF(hd), stage_bytes = (hd / AF_WG_ATOM) * AF_WG_BLOCK_BYTES(bc);
    const int row = AF_THREAD_IDX % bc, part = AF_THREAD_IDX / bc;   /* part 0 of 1 (K and V), or 0 (K) / 1 (V) */
    const int copy_k = bc == AF_WG_GATHER_THREADS || part == 0, copy_v = bc == AF_WG_GATHER_THREADS || part == 1;
    const int32_t *table = p->m.page_table + b * p->m.page_table_stride[0];
    const int table_step = (int)p->m.page_table_stride[1], page_size = (int)p->m.page_size, keys = (int)sq->S;
    const char *k_head = p->m.k + 2 * hk * p->m.k_stride[1], *v_head = p->m.v + 2 * hk * p->m.v_stride[1];
    const int tiles = (int)(t_end - t_begin), first_key = (int)t_begin * bc + row;
    for (int n = 0; n < tiles; n++) {
        const int stage = n % AF_WG_STAGES, key = first_key + n * bc, inside = key < keys;
        if (n >= AF_WG_STAGES) {
            /* the consumers release tile n-2's stage only once they hold tile n-1 (its S is issued with tile n-2's
             * P·V): tile n-1 is published before the wait, or neither side moves */
            af_cp_async_wait_0();
            af_wgmma_gather_publish(&full[(n - 1) % AF_WG_STAGES]);
            af_mbarrier_wait_parity(&empty[stage], (uint32_t)((n / AF_WG_STAGES - 1) & 1));
        }
        const char *k_row = p->m.k, *v_row = p->m.v;   /* past the sequence: never read */
        if (inside) {
            const int64_t page = table[(int)((unsigned)key / (unsigned)page_size) * table_step];
            const int64_t in_page = (int)((unsigned)key % (unsigned)page_size);
            k_row = k_head + 2 * (page * p->m.k_stride[0] + in_page * p->m.k_stride[2]);
            v_row = v_head + 2 * (page * p->m.v_stride[0] + in_page * p->m.v_stride[2]);
        }
        char *k_stage = k_stages + stage * stage_bytes, *v_stage = v_stages + stage * stage_bytes;
        if (copy_k) af_wgmma_gather_row(k_stage, k_row, p->k_blocks * 8, p->m.E, inside, row, bc);
        if (copy_v) af_wgmma_gather_row(v_stage, v_row, hd / 8, p->m.Ev, inside, row, bc);
        af_cp_async_commit();
        if (n == 0 || n >= AF_WG_STAGES) continue;
        af_cp_async_wait_1();   /* a free stage: tile n-1's group has landed, tile n's copies run on */
        af_wgmma_gather_publish(&full[(n - 1) % AF_WG_STAGES]);
    }
    if (tiles > 0) {
        af_cp_async_wait_0();
        af_wgmma_gather_publish(&full[(tiles - 1) % AF_WG_STAGES]);
    }
}

#endif
