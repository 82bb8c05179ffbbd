/* The Hopper contract (src/cuda/device_hopper.h) on the CPU, on top of cuda_emulated.c's fibers: warpgroup
 * collectives (wgmma, setmaxnreg) and mbarrier waits park a fiber (af_emu_park) until the last thread of the
 * warpgroup or the completing phase wakes it. State lives per block, from the first thread's af_emu_hopper_begin to
 * the last one's af_emu_hopper_end, on the launching host thread.
 *
 * Shared-window addresses: the block's dynamic shared memory starts at window address af_emu_shared_window_base
 * (0x400 as on the GPU with no static __shared__, or whatever a test sets); descriptors hold window addresses, and
 * the swizzles of wgmma and TMA XOR the bits of the window address, not of the offset into the block's memory, as
 * the hardware does, so a kernel that swizzles relative to a base off the pattern's alignment reads wrong data.
 *
 * The async proxy's view of shared memory is a shadow copy: TMA writes both, fence.proxy.async copies shared memory
 * into it; a wgmma reading, or a TMA overwriting, a 16-byte chunk where the two differ met ordinary stores with no
 * proxy fence since. cp.async completed by cp.async.mbarrier.arrive is held per barrier and lands when a thread
 * waits on that barrier; its chunks must then be fenced by every thread of the reading warpgroup after a wait that
 * saw them land (the PTX memory model's rule, see check_landed). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/device_hopper.h"   /* the contract's constants, then cuda_emulated_hopper.h */

#define WG 128                       /* threads of a warpgroup */
#define POISON 0x7fa0deadu           /* a signalling NaN: accumulators of a wgmma in flight */
#define MAP_MAGIC 0xaf7e45a9u        /* an emulated tensor map */

/* ---- State of one block ---- */
typedef struct {
    long long op;       /* the wgmma that produced it */
    float *d;
    int n;              /* accumulators */
    long long group;    /* -1 until committed */
    float values[128];
} pending_mma;

typedef struct {
    /* operands of the warpgroup collective this thread waits in */
    float *d;
    const uint32_t *a;
    uint64_t desc_a, desc_b;
    int n, bf16, trans_b, scale_d, value;
    const char *name;
    pending_mma *pending;
    int pending_count, pending_capacity;
    long long committed;
    int need_fence;      /* no wgmma.fence since the start or the last wait_group */
    int parked;
    int waiting_bar;     /* the mbarrier waited on, -1 none */
    int waiting_named;   /* the named barrier waited on, 0 none */
    unsigned wait_parity;
    long long acquired;  /* the latest cp.async landing (see hopper_block.landings) its mbarrier waits saw complete */
    long long fenced;    /* `acquired` at its last af_fence_proxy_async */
} thread_state;

typedef enum { WG_NONE, WG_MMA, WG_SETMAXNREG_INC, WG_SETMAXNREG_DEC } wg_kind;
static const char *const wg_names[] = {"none", "wgmma.mma_async", "setmaxnreg.inc", "setmaxnreg.dec"};

typedef struct {
    wg_kind kind;
    const char *name;
    int arrived;
} warpgroup_state;

typedef struct {
    size_t offset;
    int count, pending;
    long long tx;
    unsigned long long phase;   /* phases completed */
    long long landed;           /* the latest cp.async landing counted in the current phase */
    long long landed_by[2];     /* ... in the last completed phase of each parity */
} mbarrier_state;

/* A cp.async.mbarrier.arrive not yet triggered: its thread's copies before it, then one arrival on `bar`. */
typedef struct {
    int bar, thread, count;
    void *batch;   /* af_emu_cp_async_detach's */
} cp_arrival;

typedef struct {
    int bar;
    size_t dst, bytes;
    unsigned char *data;   /* already in the swizzled order */
    int thread;
} tma_copy;

typedef struct {
    long long id;
    long long left;       /* threads that have not yet waited for it */
    int *chunks, chunk_count;
} mma_op;

#define NAMED_BARRIERS 16   /* bar.sync's ids; 0 is af_syncthreads' */
typedef struct {
    int expected, arrived;   /* this phase's thread count (0: no phase open) and arrivals */
} named_state;

typedef struct {
    int threads, started, ended, parked;
    size_t window;   /* the window address of the block's dynamic shared memory */
    named_state named[NAMED_BARRIERS];
    char *smem;
    size_t smem_bytes;
    thread_state *t;
    warpgroup_state *wg;
    unsigned char *shadow;        /* the async proxy's view */
    int *chunk_tma;               /* undelivered TMA copies into each 16-byte chunk */
    int *chunk_readers;           /* wgmma in flight reading each chunk */
    long long *chunk_seen;        /* 1 + the last operation that counted itself in chunk_readers */
    mbarrier_state *bars;
    int bar_count, bar_capacity;
    tma_copy *copies;
    int copy_count, copy_capacity;
    mma_op *ops;
    long long op_count, op_capacity;
    cp_arrival *arrivals;
    int arrival_count, arrival_capacity;
    long long landings;           /* cp.async.mbarrier.arrive batches landed so far */
    long long *chunk_landed;      /* the landing that last wrote each chunk (0: none, or TMA wrote it since) */
} hopper_block;

static __thread hopper_block *hb;
static size_t shared_window_base = 0x400;   /* dynamic shared memory's window address in blocks launched from now */


static void report(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

static void report(const char *fmt, ...)
{
    fprintf(stderr, "cuda_emulated (hopper): ");
    if (af_emu_self)
        fprintf(stderr, "block (%d,%d,%d), thread %d: ", af_emu_self->block_idx[0], af_emu_self->block_idx[1],
                af_emu_self->block_idx[2], af_emu_self->thread_idx);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(stderr);
    abort();
}

void af_emu_set_shared_window_base(size_t address)
{
    if (address % 16 || address >= (1u << 18) - 16)
        report("af_emu_set_shared_window_base: window address 0x%zx is not a 16-byte aligned address below 256 KiB",
               address);
    shared_window_base = address;
}

static void *grow(void *p, size_t count, size_t size)
{
    void *q = realloc(p, count * size);
    if (!q)
        report("out of memory");
    return q;
}

static hopper_block *block(const char *what)
{
    if (!af_emu_self || !hb)
        report("%s called outside a kernel defined with AF_KERNEL_SM90", what);
    return hb;
}

static thread_state *self_state(hopper_block *b) { return &b->t[af_emu_self->thread_idx]; }

void af_emu_hopper_begin(void)
{
    if (!hb) {
        hopper_block *b = (hopper_block *)calloc(1, sizeof *b);
        if (!b)
            report("out of memory");
        b->threads = af_emu_self->block_dim;
        b->smem = af_shared_memory();
        b->smem_bytes = af_emu_shared_memory_bytes();
        b->window = shared_window_base;
        b->t = (thread_state *)calloc((size_t)b->threads, sizeof *b->t);
        b->wg = (warpgroup_state *)calloc((size_t)(b->threads + WG - 1) / WG, sizeof *b->wg);
        b->shadow = (unsigned char *)malloc(b->smem_bytes + 1);
        b->chunk_tma = (int *)calloc(b->smem_bytes / 16 + 1, sizeof(int));
        b->chunk_readers = (int *)calloc(b->smem_bytes / 16 + 1, sizeof(int));
        b->chunk_seen = (long long *)calloc(b->smem_bytes / 16 + 1, sizeof(long long));
        b->chunk_landed = (long long *)calloc(b->smem_bytes / 16 + 1, sizeof(long long));
        if (!b->t || !b->wg || !b->shadow || !b->chunk_tma || !b->chunk_readers || !b->chunk_seen || !b->chunk_landed)
            report("out of memory");
        memcpy(b->shadow, b->smem, b->smem_bytes);   /* the fill the block started with: no ordinary store yet */
        for (int i = 0; i < b->threads; i++) {
            b->t[i].need_fence = 1;
            b->t[i].waiting_bar = -1;
        }
        hb = b;
    }
    hb->started++;
}

static void free_block(hopper_block *b)
{
    for (int i = 0; i < b->threads; i++)
        free(b->t[i].pending);
    for (int i = 0; i < b->copy_count; i++)
        free(b->copies[i].data);
    for (long long i = 0; i < b->op_count; i++)
        free(b->ops[i].chunks);
    for (int i = 0; i < b->arrival_count; i++)
        free(b->arrivals[i].batch);
    free(b->arrivals);
    free(b->chunk_landed);
    free(b->ops);
    free(b->copies);
    free(b->bars);
    free(b->chunk_readers);
    free(b->chunk_seen);
    free(b->chunk_tma);
    free(b->shadow);
    free(b->wg);
    free(b->t);
    free(b);
}

static void describe(char *text, size_t size);

void af_emu_hopper_end(void)
{
    hopper_block *b = block("af_emu_hopper_end");
    thread_state *t = self_state(b);
    int thread = af_emu_self->thread_idx;
    warpgroup_state *w = &b->wg[thread / WG];
    if (w->arrived)
        report("thread %d exits while %d threads of its warpgroup %d wait in %s (%s)", thread, w->arrived,
               thread / WG, wg_names[w->kind], w->name ? w->name : "");
    if (t->pending_count)
        report("thread %d exits with %d wgmma results never waited for (wgmma.commit_group and wait_group)",
               thread, t->pending_count);
    b->ended++;
    if (b->ended < b->threads && b->threads - b->ended == b->parked) {
        char text[3072];
        describe(text, sizeof text);
        report("deadlock: the last running thread exits and %d threads stay parked; %s", b->parked, text);
    }
    if (b->ended == b->threads) {
        if (b->copy_count)
            report("the block ends with %d TMA copies in flight (no thread waited on their mbarrier)",
                   b->copy_count);
        if (b->arrival_count)
            report("the block ends with %d cp.async.mbarrier.arrive arrivals never triggered (no thread waited on "
                   "their mbarrier)", b->arrival_count);
        free_block(b);
        hb = NULL;
    }
}

/* ---- Parking ---- */
static void describe(char *text, size_t size)
{
    hopper_block *b = hb;
    size_t used = 0;
    text[0] = '\0';
    if (!b)
        return;
#define APPEND(...) \
    if (used < size) used += (size_t)snprintf(text + used, size - used, __VA_ARGS__)
    for (int id = 1; id < NAMED_BARRIERS; id++)
        if (b->named[id].expected)
            APPEND("named barrier %d: %d of %d threads arrived (a thread count or an arrive missing?); ", id,
                   b->named[id].arrived, b->named[id].expected);
    for (int w = 0; w < (b->threads + WG - 1) / WG; w++)
        if (b->wg[w].arrived)
            APPEND("warpgroup %d: %d of %d threads in %s (%s); ", w, b->wg[w].arrived, WG, wg_names[b->wg[w].kind],
                   b->wg[w].name ? b->wg[w].name : "");
    for (int i = 0; i < b->bar_count; i++) {
        const mbarrier_state *m = &b->bars[i];
        int waiters = 0;
        unsigned parity = 0;
        for (int k = 0; k < b->threads; k++)
            if (b->t[k].waiting_bar == i)
                waiters++, parity = b->t[k].wait_parity;
        if (waiters)
            APPEND("mbarrier at shared offset %zu: %d threads wait for parity %u; its phase %llu still expects %d of "
                   "%d arrivals and %lld transaction bytes (a wrong arrive count or expect_tx?); ",
                   m->offset, waiters, parity, m->phase, m->pending, m->count, m->tx);
    }
#undef APPEND
}

static void park(hopper_block *b, thread_state *t)
{
    t->parked = 1;
    b->parked++;
    af_emu_park(describe);
}

static void wake(hopper_block *b, int thread)
{
    thread_state *t = &b->t[thread];
    t->parked = 0;
    b->parked--;
    af_emu_wake(thread);
}

/* ---- Shared memory bookkeeping ---- */
static size_t smem_offset(hopper_block *b, const void *p, size_t bytes, size_t align, const char *what)
{
    const char *c = (const char *)p;
    if (c < b->smem || c > b->smem + b->smem_bytes || (size_t)(c - b->smem) + bytes > b->smem_bytes)
        report("%s: address %p is not %zu bytes inside the block's %zu bytes of dynamic shared memory", what, p,
               bytes, b->smem_bytes);
    size_t off = (size_t)(c - b->smem);
    if ((b->window + off) % align)
        report("%s: shared-window address 0x%zx (offset %zu) is not %zu-byte aligned", what, b->window + off, off,
               align);
    return off;
}

/* The least `fenced` of the running thread's warpgroup (the one whose wgmma reads), and which thread has it. */
static long long warpgroup_fenced(hopper_block *b, int *thread)
{
    int first = af_emu_self->thread_idx / WG * WG;
    *thread = first;
    for (int k = first; k < first + WG && k < b->threads; k++)
        if (b->t[k].fenced < b->t[*thread].fenced)
            *thread = k;
    return b->t[*thread].fenced;
}

/* cp.async writes through the generic proxy; wgmma reads through the async proxy. The PTX ISA's memory model
 * (section "Memory Consistency Model", proxy-preserved base causality order) orders such a write before such a
 * read only with a fence.proxy.async on the causality path from the write to the read. With completion by
 * cp.async.mbarrier.arrive the writing thread never learns when its copies complete, so no fence of its own is on
 * that path (one issued before completion orders nothing); the path is write -> arrive-on -> the reader's mbarrier
 * wait -> the reader's fence -> its wgmma. Modelled exactly so for the reader: every thread of the reading
 * warpgroup must have fenced after a wait that saw the chunk's landing complete (a fence in another thread that
 * then hands over by a barrier is also on a path, but is not recognised: stricter, never looser). FlashAttention-3
 * (hopper/paged_kv.h with pipeline producer_commit(cpasync_barrier_arrive) in mainloop_fwd_sm90_tma_gmma_ws.hpp)
 * issues no proxy fence on this path at all. */
static void check_landed(hopper_block *b, size_t chunk, const char *what, long long fenced, int thread)
{
    if (b->chunk_landed[chunk] > fenced)
        report("async proxy: %s reads shared bytes [%zu, %zu) that cp.async wrote (landed by cp.async.mbarrier.arrive)"
               " and thread %d of the reading warpgroup ran no af_fence_proxy_async after an mbarrier wait that saw "
               "them land (fence after the wait, before the wgmma)", what, chunk * 16, chunk * 16 + 16, thread);
}

/* The async proxy reads chunk c: it must hold what the async proxy last saw or a fence published. */
static void check_async_read(hopper_block *b, size_t chunk, const char *what)
{
    if (b->chunk_tma[chunk])
        report("race: %s reads shared bytes [%zu, %zu) that a TMA copy has not delivered (no mbarrier wait for "
               "its phase)", what, chunk * 16, chunk * 16 + 16);
    int copier = af_emu_cp_async_in_flight(chunk * 16);
    if (copier >= 0)
        report("race: %s reads shared bytes [%zu, %zu) that thread %d's cp.async has not completed (no "
               "cp.async wait_group before the barrier that hands them over)", what, chunk * 16, chunk * 16 + 16,
               copier);
    if (memcmp(b->smem + chunk * 16, b->shadow + chunk * 16, 16) != 0)
        report("async proxy: %s reads shared bytes [%zu, %zu) written by ordinary stores (or cp.async) with no "
               "af_fence_proxy_async (fence.proxy.async.shared::cta) since", what, chunk * 16, chunk * 16 + 16);
}

uint32_t af_shared_address(const void *p)
{
    hopper_block *b = block("af_shared_address");
    return (uint32_t)(b->window + smem_offset(b, p, 0, 1, "af_shared_address"));
}

void af_fence_proxy_async(void)
{
    hopper_block *b = block("af_fence_proxy_async");
    memcpy(b->shadow, b->smem, b->smem_bytes);
    thread_state *t = self_state(b);
    t->fenced = t->acquired;
}

/* ---- Descriptors ---- */
static const int swizzle_bytes[4] = {16, 128, 64, 32};

uint64_t af_wgmma_desc(const void *smem, int swizzle, uint32_t lbo_bytes, uint32_t sbo_bytes)
{
    hopper_block *b = block("af_wgmma_desc");
    size_t addr = b->window + smem_offset(b, smem, 0, 16, "af_wgmma_desc");
    if (swizzle < 0 || swizzle > 3)
        report("af_wgmma_desc: swizzle %d is not one of AF_SWIZZLE_*", swizzle);
    return (uint64_t)((addr & 0x3ffff) >> 4) | ((uint64_t)((lbo_bytes & 0x3ffffu) >> 4) << 16) |
           ((uint64_t)((sbo_bytes & 0x3ffffu) >> 4) << 32) | ((uint64_t)swizzle << 62);
}

/* Bits 4.. of an address XORed with bits 7..: 3 bits for 128B, 2 for 64B, 1 for 32B, none unswizzled. */
static size_t swizzle_address(size_t addr, int layout)
{
    static const size_t mask[4] = {0, 7, 3, 1};
    return addr ^ (((addr >> 7) & mask[layout]) << 4);
}

/* Window address of element (mn, k) of a 16-bit operand by the canonical layouts (device_hopper.h). */
static size_t operand_address(uint64_t desc, int mn, int k, int mn_major)
{
    size_t start = (size_t)(desc & 0x3fff) << 4, lbo = (size_t)((desc >> 16) & 0x3fff) << 4;
    size_t sbo = (size_t)((desc >> 32) & 0x3fff) << 4;
    int layout = (int)(desc >> 62), s = swizzle_bytes[layout];
    size_t a;
    if (layout == 0 && !mn_major)
        a = start + (size_t)(mn / 8) * sbo + (size_t)(k / 8) * lbo + (size_t)(mn % 8) * 16 + (size_t)(k % 8) * 2;
    else if (layout == 0)
        a = start + (size_t)(mn / 8) * sbo + (size_t)(k / 8) * lbo + (size_t)(k % 8) * 16 + (size_t)(mn % 8) * 2;
    else if (!mn_major)
        a = start + (size_t)(mn / 8) * sbo + (size_t)(mn % 8) * (size_t)s + (size_t)k * 2;
    else
        a = start + (size_t)(mn / (s / 2)) * lbo + (size_t)(k / 8) * sbo + (size_t)(k % 8) * (size_t)s +
            (size_t)(mn % (s / 2)) * 2;
    return swizzle_address(a, layout);
}

static double half_value(uint16_t h, int bf16) { return bf16 ? af_bf16_to_float(h) : af_f16_to_float(h); }

/* Reads an MNx16 operand through its descriptor into m[mn][k], recording the chunks the operation reads. */
static void read_operand(hopper_block *b, uint64_t desc, int rows, int mn_major, int bf16, double m[][16],
                         mma_op *op, const char *what)
{
    if ((desc >> 49) & 7)
        report("%s: descriptor 0x%016llx has a matrix base offset, which the emulation does not model", what,
               (unsigned long long)desc);
    int fenced_thread;
    const long long fenced = warpgroup_fenced(b, &fenced_thread);
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < 16; k++) {
            size_t addr = operand_address(desc, r, k, mn_major), a = addr - b->window;
            if (addr < b->window || a + 2 > b->smem_bytes)
                report("%s: descriptor 0x%016llx puts element (%d, %d) at shared offset %zu, outside the block's %zu "
                       "bytes", what, (unsigned long long)desc, r, k, a, b->smem_bytes);
            size_t chunk = a / 16;
            check_landed(b, chunk, what, fenced, fenced_thread);
            check_async_read(b, chunk, what);
            if (b->chunk_seen[chunk] != op->id + 1) {   /* each chunk counted once per operation */
                b->chunk_seen[chunk] = op->id + 1;
                op->chunks = (int *)grow(op->chunks, (size_t)op->chunk_count + 1, sizeof(int));
                op->chunks[op->chunk_count++] = (int)chunk;
                b->chunk_readers[chunk]++;
            }
            uint16_t h;
            memcpy(&h, b->smem + a, 2);
            m[r][k] = half_value(h, bf16);
        }
}

/* ---- Warpgroup collectives ---- */
static void complete_mma(hopper_block *b, int w);
static void complete_setmaxnreg(hopper_block *b, int w);

static void warpgroup_arrive(hopper_block *b, wg_kind kind, const char *name)
{
    int thread = af_emu_self->thread_idx, w = thread / WG;
    if ((w + 1) * WG > b->threads)
        report("%s: thread %d's warpgroup %d is incomplete (the block has %d threads, not a multiple of 128)", name,
               thread, w, b->threads);
    warpgroup_state *ws = &b->wg[w];
    if (ws->arrived == 0) {
        ws->kind = kind;
        ws->name = name;
    } else if (ws->kind != kind || strcmp(ws->name, name) != 0) {
        report("threads of warpgroup %d meet different collectives: thread %d reaches %s while %d threads wait in %s",
               w, thread, name, ws->arrived, ws->name);
    }
    if (++ws->arrived < WG) {
        park(b, self_state(b));
        return;
    }
    if (kind == WG_MMA)
        complete_mma(b, w);
    else
        complete_setmaxnreg(b, w);
    ws->arrived = 0;
    for (int i = w * WG; i < (w + 1) * WG; i++)
        if (i != thread)
            wake(b, i);
}

/* ---- wgmma ---- */
void af_emu_wgmma(float *d, int n, int bf16, int trans_b, uint64_t desc_a, const uint32_t *a, uint64_t desc_b,
                  int scale_d, const char *name)
{
    hopper_block *b = block(name);
    thread_state *t = self_state(b);
    if (t->need_fence)
        report("%s without af_wgmma_fence (wgmma.fence) since the thread's start or its last wgmma wait: the "
               "registers it reads may still be in use", name);
    t->d = d;
    t->n = n;
    t->bf16 = bf16;
    t->trans_b = trans_b;
    t->desc_a = desc_a;
    t->a = a;
    t->desc_b = desc_b;
    t->scale_d = scale_d != 0;
    warpgroup_arrive(b, WG_MMA, name);
}

/* The pending result of this thread whose accumulators are d (the latest), or NULL; overlapping arrays are an error. */
static pending_mma *pending_for(thread_state *t, const float *d, int n, const char *name)
{
    pending_mma *found = NULL;
    for (int i = 0; i < t->pending_count; i++) {
        pending_mma *p = &t->pending[i];
        if (p->d == d && p->n == n)
            found = p;
        else if (p->d < d + n / 2 && d < p->d + p->n / 2)
            report("%s: its accumulators overlap those of a wgmma in flight with another shape", name);
    }
    return found;
}

static void complete_mma(hopper_block *b, int w)
{
    thread_state *t0 = &b->t[w * WG];
    const char *name = t0->name = b->wg[w].name;
    int n = t0->n, bf16 = t0->bf16, rs = t0->a != NULL;
    for (int i = w * WG; i < (w + 1) * WG; i++) {
        thread_state *t = &b->t[i];
        if (t->desc_b != t0->desc_b || (!rs && t->desc_a != t0->desc_a) || t->scale_d != t0->scale_d)
            report("%s: thread %d's descriptors or scale-d differ from thread %d's (they are warpgroup-uniform)",
                   name, i, w * WG);
        if (t->committed != t0->committed)
            report("%s: thread %d committed %lld wgmma groups, thread %d %lld (commit_group in divergent code?)",
                   name, i, t->committed, w * WG, t0->committed);
    }
    if (b->op_count == b->op_capacity) {
        b->op_capacity = b->op_capacity ? 2 * b->op_capacity : 16;
        b->ops = (mma_op *)grow(b->ops, (size_t)b->op_capacity, sizeof *b->ops);
    }
    long long op_id = b->op_count++;
    mma_op *op = &b->ops[op_id];
    memset(op, 0, sizeof *op);
    op->id = op_id;
    op->left = WG;

    double am[64][16], bm[256][16];   /* B as bm[n][k] */
    if (rs) {
        /* a[j]: row 16w' + g + 8(j%2), columns 2t + 8(j/2) + {0, 1}, the lower column in the low half */
        for (int i = 0; i < WG; i++) {
            const uint32_t *a = b->t[w * WG + i].a;
            int wq = i / 32, g = (i % 32) / 4, tq = i % 4;
            for (int j = 0; j < 4; j++) {
                int row = 16 * wq + g + 8 * (j % 2), col = 2 * tq + 8 * (j / 2);
                am[row][col] = half_value((uint16_t)(a[j] & 0xffff), bf16);
                am[row][col + 1] = half_value((uint16_t)(a[j] >> 16), bf16);
            }
        }
    } else {
        read_operand(b, t0->desc_a, 64, 0, bf16, am, op, name);
    }
    read_operand(b, t0->desc_b, n, t0->trans_b, bf16, bm, op, name);

    /* d[i]: row 16w' + g + 8((i/2)%2), column 8(i/4) + 2t + i%2 */
    for (int i = 0; i < WG; i++) {
        thread_state *t = &b->t[w * WG + i];
        int wq = i / 32, g = (i % 32) / 4, tq = i % 4;
        pending_mma *chained = pending_for(t, t->d, n, name);
        if (t->pending_count == t->pending_capacity) {
            t->pending_capacity = t->pending_capacity ? 2 * t->pending_capacity : 8;
            t->pending = (pending_mma *)grow(t->pending, (size_t)t->pending_capacity, sizeof *t->pending);
            chained = pending_for(t, t->d, n, name);
        }
        pending_mma *p = &t->pending[t->pending_count++];
        p->op = op_id;
        p->d = t->d;
        p->n = n;
        p->group = -1;
        for (int r = 0; r < n / 2; r++) {
            int row = 16 * wq + g + 8 * ((r / 2) % 2), col = 8 * (r / 4) + 2 * tq + r % 2;
            double sum = !t->scale_d ? 0.0 : chained ? (double)chained->values[r] : (double)t->d[r];
            for (int k = 0; k < 16; k++)
                sum += am[row][k] * bm[col][k];
            p->values[r] = (float)sum;
        }
        for (int r = 0; r < n / 2; r++)   /* not valid until wait_group */
            memcpy(&t->d[r], &(uint32_t){POISON}, 4);
    }
}

void af_wgmma_fence(void)
{
    hopper_block *b = block("af_wgmma_fence");
    self_state(b)->need_fence = 0;
}

void af_wgmma_commit(void)
{
    hopper_block *b = block("af_wgmma_commit");
    thread_state *t = self_state(b);
    for (int i = 0; i < t->pending_count; i++)
        if (t->pending[i].group < 0)
            t->pending[i].group = t->committed;
    t->committed++;
}

static void op_done(hopper_block *b, long long op_id)
{
    mma_op *op = &b->ops[op_id];
    if (--op->left == 0) {
        for (int i = 0; i < op->chunk_count; i++)
            b->chunk_readers[op->chunks[i]]--;
        free(op->chunks);
        op->chunks = NULL;
        op->chunk_count = 0;
    }
}

/* wait_group n: the results of all groups but the n newest land in their registers. */
static void wait_groups(int n, const char *what)
{
    hopper_block *b = block(what);
    thread_state *t = self_state(b);
    long long limit = t->committed - n;
    int kept = 0;
    for (int i = 0; i < t->pending_count; i++) {
        pending_mma *p = &t->pending[i];
        int done = p->group >= 0 && p->group < limit;
        if (!done) {
            t->pending[kept++] = *p;
            continue;
        }
        int later = 0;   /* a later wgmma still accumulates into these registers: they stay in flight */
        for (int j = i + 1; j < t->pending_count && !later; j++)
            later = t->pending[j].d == p->d;
        if (!later) {
            for (int r = 0; r < p->n / 2; r++) {
                uint32_t bits;
                memcpy(&bits, &p->d[r], 4);
                if (bits != POISON)
                    report("%s: accumulator %d of a wgmma in flight (%g) was written before the wait_group that "
                           "completes it (registers of a wgmma in flight are off limits)", what, r, (double)p->d[r]);
            }
            memcpy(p->d, p->values, sizeof(float) * (size_t)(p->n / 2));
        }
        op_done(b, p->op);
    }
    t->pending_count = kept;
    t->need_fence = 1;
}

void af_wgmma_wait_0(void) { wait_groups(0, "af_wgmma_wait_0"); }
void af_wgmma_wait_1(void) { wait_groups(1, "af_wgmma_wait_1"); }

/* ---- setmaxnreg ---- */
void af_emu_setmaxnreg(int inc, int n)
{
    const char *name = inc ? "setmaxnreg.inc" : "setmaxnreg.dec";
    hopper_block *b = block(name);
    if (n < 24 || n > 256 || n % 8 != 0)
        report("%s: register count %d is not a multiple of 8 in 24..256", name, n);
    self_state(b)->value = n;
    warpgroup_arrive(b, inc ? WG_SETMAXNREG_INC : WG_SETMAXNREG_DEC, name);
}

static void complete_setmaxnreg(hopper_block *b, int w)
{
    for (int i = w * WG + 1; i < (w + 1) * WG; i++)
        if (b->t[i].value != b->t[w * WG].value)
            report("%s: thread %d asks for %d registers, thread %d for %d (the count is warpgroup-uniform)",
                   b->wg[w].name, i, b->t[i].value, w * WG, b->t[w * WG].value);
}

/* ---- mbarrier ---- */
static int find_bar(hopper_block *b, const uint64_t *bar, const char *what, int must_exist)
{
    size_t off = smem_offset(b, bar, 8, 8, what);
    for (int i = 0; i < b->bar_count; i++)
        if (b->bars[i].offset == off)
            return i;
    if (must_exist)
        report("%s: no mbarrier was initialised at shared offset %zu", what, off);
    if (b->bar_count == b->bar_capacity) {
        b->bar_capacity = b->bar_capacity ? 2 * b->bar_capacity : 8;
        b->bars = (mbarrier_state *)grow(b->bars, (size_t)b->bar_capacity, sizeof *b->bars);
    }
    memset(&b->bars[b->bar_count], 0, sizeof *b->bars);
    b->bars[b->bar_count].offset = off;
    return b->bar_count++;
}

void af_mbarrier_init(uint64_t *bar, int count)
{
    hopper_block *b = block("af_mbarrier_init");
    if (count < 1 || count > (1 << 20) - 1)
        report("af_mbarrier_init: count %d is outside 1..2^20-1", count);
    int i = find_bar(b, bar, "af_mbarrier_init", 0);
    for (int k = 0; k < b->threads; k++)
        if (b->t[k].waiting_bar == i)
            report("af_mbarrier_init: threads wait on the mbarrier being initialised");
    for (int k = 0; k < b->copy_count; k++)
        if (b->copies[k].bar == i)
            report("af_mbarrier_init: a TMA copy in flight completes on the mbarrier being initialised");
    for (int k = 0; k < b->arrival_count; k++)
        if (b->arrivals[k].bar == i)
            report("af_mbarrier_init: a cp.async.mbarrier.arrive in flight arrives on the mbarrier being initialised");
    mbarrier_state *m = &b->bars[i];
    m->count = m->pending = count;
    m->tx = 0;
    m->phase = 0;
    m->landed = m->landed_by[0] = m->landed_by[1] = 0;
}

void af_fence_mbarrier_init(void) { (void)block("af_fence_mbarrier_init"); }

/* The phase completes when every arrival came and no transaction byte is outstanding; its waiters wake. Returns
 * how many woke. */
static int try_complete(hopper_block *b, int i)
{
    mbarrier_state *m = &b->bars[i];
    if (m->pending != 0 || m->tx != 0)
        return 0;
    m->landed_by[m->phase & 1] = m->landed;   /* the completing phase's parity */
    m->landed = 0;
    m->phase++;
    m->pending = m->count;
    int woken = 0;
    for (int k = 0; k < b->threads; k++)
        if (b->t[k].waiting_bar == i && b->t[k].parked) {
            b->t[k].waiting_bar = -1;
            wake(b, k);
            woken++;
        }
    return woken;
}

/* An arrival that completes a phase lets its waiters run before the arriving thread goes on (they may, on the
 * GPU): what that thread does after its arrive (a cp.async wait, a fence) is then seen to come too late. */
static void arrive(hopper_block *b, int i, const char *what)
{
    mbarrier_state *m = &b->bars[i];
    if (m->pending == 0)
        report("%s: more arrivals than the mbarrier's count %d in one phase (at shared offset %zu; its phase waits "
               "for %lld transaction bytes)", what, m->count, m->offset, m->tx);
    m->pending--;
    if (m->pending == 0 && m->tx < 0)
        report("%s: the last arrival leaves the mbarrier at shared offset %zu %lld transaction bytes below zero: "
               "TMA copies completed more bytes than arrive.expect_tx announced", what, m->offset, -m->tx);
    int woke = try_complete(b, i);
    if (woke)
        af_emu_yield();
}

void af_mbarrier_arrive(uint64_t *bar)
{
    hopper_block *b = block("af_mbarrier_arrive");
    arrive(b, find_bar(b, bar, "af_mbarrier_arrive", 1), "af_mbarrier_arrive");
}

void af_mbarrier_arrive_expect_tx(uint64_t *bar, uint32_t bytes)
{
    hopper_block *b = block("af_mbarrier_arrive_expect_tx");
    int i = find_bar(b, bar, "af_mbarrier_arrive_expect_tx", 1);
    if (bytes > (1u << 20) - 1)
        report("af_mbarrier_arrive_expect_tx: %u bytes is above the transaction count's 2^20-1", bytes);
    b->bars[i].tx += bytes;
    arrive(b, i, "af_mbarrier_arrive_expect_tx");
}

/* A TMA copy lands: shared memory and the async proxy's view get its bytes, its barrier the transaction count. */
static void deliver(hopper_block *b, int k)
{
    tma_copy c = b->copies[k];
    b->copies[k] = b->copies[--b->copy_count];
    for (size_t ch = c.dst / 16; ch < (c.dst + c.bytes) / 16; ch++) {
        if (b->chunk_readers[ch])
            report("race: thread %d's TMA copy overwrites shared bytes [%zu, %zu) that a wgmma in flight reads "
                   "(release a stage only after the wgmma wait_group)", c.thread, ch * 16, ch * 16 + 16);
        if (memcmp(b->smem + ch * 16, b->shadow + ch * 16, 16) != 0)
            report("async proxy: thread %d's TMA copy overwrites shared bytes [%zu, %zu) written by ordinary stores "
                   "with no af_fence_proxy_async since", c.thread, ch * 16, ch * 16 + 16);
        b->chunk_tma[ch]--;
        b->chunk_landed[ch] = 0;
    }
    memcpy(b->smem + c.dst, c.data, c.bytes);
    memcpy(b->shadow + c.dst, c.data, c.bytes);
    free(c.data);
    mbarrier_state *m = &b->bars[c.bar];
    m->tx -= (long long)c.bytes;
    if (m->pending == 0 && m->tx < 0)
        report("mbarrier at shared offset %zu: a TMA copy of %zu bytes leaves its transaction count %lld below zero "
               "with every arrival in (expect_tx too small?)", m->offset, c.bytes, -m->tx);
    try_complete(b, c.bar);
}

/* A cp.async.mbarrier.arrive triggers: its copies complete (shared memory written, not the async proxy's view; the
 * chunks remember this landing), then its arrival counts on the barrier's current phase. */
static void land(hopper_block *b, int k)
{
    cp_arrival a = b->arrivals[k];
    b->arrivals[k] = b->arrivals[--b->arrival_count];
    long long seq = ++b->landings;
    for (int c = 0; c < a.count; c++) {
        size_t ch = af_emu_cp_async_batch_offset(a.batch, c) / 16;
        if (b->chunk_readers[ch])
            report("race: thread %d's cp.async overwrites shared bytes [%zu, %zu) that a wgmma in flight reads "
                   "(release a stage only after the wgmma wait_group)", a.thread, ch * 16, ch * 16 + 16);
        b->chunk_landed[ch] = seq;
    }
    af_emu_cp_async_land(a.thread, a.batch, a.count);
    b->bars[a.bar].landed = seq;
    arrive(b, a.bar, "cp.async.mbarrier.arrive");
}

/* Every held arrival on barrier i triggers (an arrival may wake threads, which may hold new ones: scan anew). */
static void land_all(hopper_block *b, int i)
{
    for (int k = 0; k < b->arrival_count;)
        if (b->arrivals[k].bar == i) {
            land(b, k);
            k = 0;
        } else
            k++;
}

/* .noinc: the arrival is one of the barrier's count (no pending arrival added at issue). It triggers once the
 * thread's earlier cp.async copies complete: the emulation holds it, with those copies in flight (a wgmma reading
 * them before is a race), until a thread waits on the barrier (at once if one already does). */
void af_cp_async_mbarrier_arrive_noinc(uint64_t *bar)
{
    hopper_block *b = block("af_cp_async_mbarrier_arrive_noinc");
    int i = find_bar(b, bar, "af_cp_async_mbarrier_arrive_noinc", 1);
    cp_arrival a = {i, af_emu_self->thread_idx, 0, NULL};
    a.batch = af_emu_cp_async_detach(&a.count);
    for (int c = 0; c < a.count; c++) {
        size_t ch = af_emu_cp_async_batch_offset(a.batch, c) / 16;
        if (b->chunk_readers[ch])   /* the copies may land at once: their issue is the hazard */
            report("race: thread %d's cp.async into shared bytes [%zu, %zu) that a wgmma in flight reads (release a "
                   "stage only after the wgmma wait_group)", a.thread, ch * 16, ch * 16 + 16);
    }
    if (b->arrival_count == b->arrival_capacity) {
        b->arrival_capacity = b->arrival_capacity ? 2 * b->arrival_capacity : 64;
        b->arrivals = (cp_arrival *)grow(b->arrivals, (size_t)b->arrival_capacity, sizeof *b->arrivals);
    }
    b->arrivals[b->arrival_count++] = a;
    for (int k = 0; k < b->threads; k++)   /* threads already wait on its barrier: it triggers now */
        if (b->t[k].waiting_bar == i) {
            land_all(b, i);
            break;
        }
}

/* try_wait may suspend until the phase completes (the PTX ISA leaves the time limit to the system): the emulation
 * delivers the barrier's TMA copies, then parks until the phase of that parity has completed. A copy lands when a
 * thread waits on its barrier (at the copy's issue if one already does), so data nobody waited for never lands. */
int af_mbarrier_try_wait_parity(uint64_t *bar, uint32_t parity)
{
    hopper_block *b = block("af_mbarrier_try_wait_parity");
    int i = find_bar(b, bar, "af_mbarrier_try_wait_parity", 1);
    thread_state *t = self_state(b);
    for (int k = b->copy_count - 1; k >= 0; k--)
        if (b->copies[k].bar == i)
            deliver(b, k);
    land_all(b, i);
    while ((b->bars[i].phase & 1) == (parity & 1)) {   /* the phase of that parity is the current one */
        t->waiting_bar = i;
        t->wait_parity = parity & 1;
        park(b, t);
    }
    if (b->bars[i].landed_by[parity & 1] > t->acquired)   /* the wait saw those copies land */
        t->acquired = b->bars[i].landed_by[parity & 1];
    return 1;
}

/* ---- TMA ---- */
typedef struct {
    uint32_t magic;
    int dtype, rank, swizzle;
    const char *base;
    uint64_t dims[4], strides[4];   /* strides in bytes, strides[0] the element size */
    uint32_t box[4];
} emu_map;

cudaError_t af_tma_encode_tiled(CUtensorMap *map, int dtype, int rank, const void *global, const uint64_t *dims,
                                const uint64_t *strides_bytes, const uint32_t *box, int swizzle)
{
    emu_map m;
    memset(&m, 0, sizeof m);
    if (!map || !global || rank < 2 || rank > 4 || (dtype != AF_TMA_F16 && dtype != AF_TMA_BF16) || swizzle < 0 ||
        swizzle > 3 || (uintptr_t)global % 16 != 0)
        return cudaErrorInvalidValue;
    m.magic = MAP_MAGIC;
    m.dtype = dtype;
    m.rank = rank;
    m.swizzle = swizzle;
    m.base = (const char *)global;
    m.strides[0] = 2;
    for (int i = 0; i < rank; i++) {
        if (dims[i] < 1 || dims[i] > (1ULL << 32) || box[i] < 1 || box[i] > 256)
            return cudaErrorInvalidValue;
        if (i > 0 && (strides_bytes[i - 1] % 16 != 0 || strides_bytes[i - 1] >= (1ULL << 40)))
            return cudaErrorInvalidValue;
        m.dims[i] = dims[i];
        m.box[i] = box[i];
        if (i > 0)
            m.strides[i] = strides_bytes[i - 1];
    }
    /* rows of 16-byte multiples; swizzled rows exactly the swizzle width (the driver allows narrower ones, which
     * the emulation does not model) */
    if ((box[0] * 2) % 16 != 0 || (swizzle != 0 && box[0] * 2 != (uint32_t)swizzle_bytes[swizzle]))
        return cudaErrorInvalidValue;
    memset(map, 0, sizeof *map);
    memcpy(map->opaque, &m, sizeof m);
    return cudaSuccess;
}

void af_emu_tma_load(void *smem, const CUtensorMap *map, uint64_t *bar, int rank, const int *coords)
{
    static const char *const names[5] = {"", "", "af_tma_load_2d", "af_tma_load_3d", "af_tma_load_4d"};
    const char *what = names[rank];
    hopper_block *b = block(what);
    emu_map m;
    memcpy(&m, map->opaque, sizeof m);
    if (m.magic != MAP_MAGIC)
        report("%s: the tensor map was not made by af_tma_encode_tiled", what);
    if (m.rank != rank)
        report("%s: the tensor map has rank %d", what, m.rank);
    int bi = find_bar(b, bar, what, 1);
    size_t row = (size_t)m.box[0] * 2, bytes = row;
    for (int i = 1; i < rank; i++)
        bytes *= m.box[i];
    size_t align = m.swizzle ? (size_t)swizzle_bytes[m.swizzle] * 8 : 128;   /* swizzled: on the pattern */
    size_t dst = smem_offset(b, smem, bytes, align, what), window_dst = b->window + dst;
    tma_copy c;
    c.bar = bi;
    c.dst = dst;
    c.bytes = bytes;
    c.thread = af_emu_self->thread_idx;
    c.data = (unsigned char *)malloc(bytes);
    if (!c.data)
        report("out of memory");
    uint32_t box[4] = {1, 1, 1, 1};
    for (int i = 0; i < rank; i++)
        box[i] = m.box[i];
    size_t lin = 0;
    for (uint32_t i3 = 0; i3 < box[3]; i3++)
        for (uint32_t i2 = 0; i2 < box[2]; i2++)
            for (uint32_t i1 = 0; i1 < box[1]; i1++)
                for (uint32_t i0 = 0; i0 < box[0]; i0++, lin += 2) {
                    long long at[4] = {(long long)coords[0] + i0, (long long)coords[1] + i1,
                                       rank > 2 ? (long long)coords[2] + i2 : 0, rank > 3 ? (long long)coords[3] + i3 : 0};
                    uint16_t v = 0;   /* out of bounds: zero */
                    int inside = 1;
                    size_t src = 0;
                    for (int d = 0; d < rank; d++) {
                        inside = inside && at[d] >= 0 && (uint64_t)at[d] < m.dims[d];
                        src += (size_t)at[d] * m.strides[d];
                    }
                    if (inside)
                        memcpy(&v, m.base + src, 2);
                    memcpy(c.data + (swizzle_address(window_dst + lin, m.swizzle) - window_dst), &v, 2);
                }
    for (size_t ch = dst / 16; ch < (dst + bytes) / 16; ch++) {
        if (b->chunk_tma[ch])
            report("race: %s into shared bytes [%zu, %zu) while another TMA copy into them is in flight", what,
                   ch * 16, ch * 16 + 16);
        if (b->chunk_readers[ch])   /* the copy may land at once: its issue is the hazard, not when it lands here */
            report("race: %s into shared bytes [%zu, %zu) that a wgmma in flight reads (release a stage only after "
                   "the wgmma wait_group)", what, ch * 16, ch * 16 + 16);
        b->chunk_tma[ch]++;
    }
    if (b->copy_count == b->copy_capacity) {
        b->copy_capacity = b->copy_capacity ? 2 * b->copy_capacity : 8;
        b->copies = (tma_copy *)grow(b->copies, (size_t)b->copy_capacity, sizeof *b->copies);
    }
    b->copies[b->copy_count++] = c;
    for (int k = 0; k < b->threads; k++)   /* threads already wait on its barrier: the copy lands now */
        if (b->t[k].waiting_bar == bi) {
            deliver(b, b->copy_count - 1);
            break;
        }
}

/* ---- Named barriers: bar.sync / bar.arrive id, threads ---- */
static named_state *named_arrive(hopper_block *b, int id, int threads, const char *what)
{
    if (id < 1 || id >= NAMED_BARRIERS)
        report("%s: barrier id %d outside 1..%d (0 is af_syncthreads')", what, id, NAMED_BARRIERS - 1);
    if (threads < 32 || threads % 32 || threads > b->threads)
        report("%s: thread count %d is not a multiple of 32 in 32..%d (the block's threads)", what, threads,
               b->threads);
    named_state *n = &b->named[id];
    if (n->expected && n->expected != threads)
        report("%s: barrier %d's phase counts %d threads, this arrival says %d", what, id, n->expected, threads);
    n->expected = threads;
    n->arrived++;
    return n;
}

/* The phase completes: its waiting threads run on, and the next phase starts empty. */
static void named_release(hopper_block *b, int id)
{
    b->named[id].expected = b->named[id].arrived = 0;
    for (int i = 0; i < b->threads; i++)
        if (b->t[i].waiting_named == id) {
            b->t[i].waiting_named = 0;
            wake(b, i);
        }
}

void af_named_bar_sync(int id, int threads)
{
    hopper_block *b = block("af_named_bar_sync");
    named_state *n = named_arrive(b, id, threads, "af_named_bar_sync");
    if (n->arrived == n->expected) {
        named_release(b, id);
        return;
    }
    thread_state *t = self_state(b);
    t->waiting_named = id;
    park(b, t);
}

void af_named_bar_arrive(int id, int threads)
{
    hopper_block *b = block("af_named_bar_arrive");
    named_state *n = named_arrive(b, id, threads, "af_named_bar_arrive");
    if (n->arrived == n->expected)
        named_release(b, id);
}
