/* The execution model of src/cuda/device.h on the CPU: launches, blocks of fibers, barriers, warp collectives
 * (shuffle, mma, ldmatrix), cp.async groups and a shared-memory race detector for the async/collective paths.
 * Everything runs on the launching host thread; a fiber runs until it reaches a barrier or a warp collective. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include "cuda_emulated_internal.h"

#if defined(__SANITIZE_ADDRESS__)
#define AF_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define AF_EMU_ASAN 1
#endif
#endif
#ifdef AF_EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#define AF_EMU_STACK_BYTES ((size_t)1 << 20) /* instrumented frames are larger */
#else
#define AF_EMU_STACK_BYTES ((size_t)256 << 10)
#endif

#if defined(__has_include)
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#define AF_EMU_VALGRIND 1
#endif
#endif

__thread const af_emu_thread_view *af_emu_self;

/* ---- Data of one launch ---- */
typedef enum { FIBER_READY, FIBER_RUNNING, FIBER_BARRIER, FIBER_COLLECTIVE, FIBER_DONE } fiber_state;

typedef enum {
    COLLECTIVE_NONE,
    COLLECTIVE_SHFL_XOR,
    COLLECTIVE_BROADCAST,
    COLLECTIVE_SHFL_INT,
    COLLECTIVE_MMA_F16,
    COLLECTIVE_MMA_BF16,
    COLLECTIVE_LDMATRIX_X4,
    COLLECTIVE_LDMATRIX_X4_TRANS,
    COLLECTIVE_LDMATRIX_X2,
    COLLECTIVE_LDMATRIX_X2_TRANS
} collective_kind;

static const char *const collective_names[] = {"none", "af_shfl_xor", "af_warp_broadcast", "af_shfl_int",
                                               "af_mma_16816_f16",
                                               "af_mma_16816_bf16",
                                               "af_ldmatrix_x4", "af_ldmatrix_x4_trans", "af_ldmatrix_x2",
                                               "af_ldmatrix_x2_trans"};

typedef struct {
    char *dst;
    unsigned char data[16];
    long long group;  /* -1 until committed */
    long long issue_epoch;
} pending_copy;

typedef struct {
    ucontext_t context;
    char *stack;      /* lowest usable byte (a guard page lies below) */
    unsigned valgrind_id;
    af_emu_thread_view view;
    fiber_state state;
    /* A collective's operands, read by the lane that completes it. */
    float shfl_value, shfl_result;
    int shfl_mask;
    int shfl_int_value, shfl_int_src, shfl_int_result;
    float *mma_d;
    const uint32_t *mma_a, *mma_b;
    uint32_t *ldm_r;
    const char *ldm_row;
    /* cp.async */
    pending_copy *copies;
    int copy_count, copy_capacity;
    long long groups_committed;
#ifdef AF_EMU_ASAN
    void *fake_stack;
#endif
} fiber;

typedef struct {
    int arrived;
    collective_kind kind;
    int exited;
} warp_state;

/* Per 16-byte chunk of shared memory, for the race detector. */
typedef struct {
    long long write_epoch; /* barrier epoch in which a cp.async last completed here; -1: none */
    long long read_epoch;  /* latest epoch an ldmatrix read here */
    int writer;            /* thread of that cp.async */
    int reader_warp;       /* first warp reading in read_epoch */
    int several_readers;   /* another warp read in read_epoch too */
    int in_flight;         /* cp.async issued here and not completed */
    int in_flight_thread;  /* the latest issuer */
} chunk_state;

typedef struct {
    const af_emu_kernel *kernel;
    const void *params;
    int threads, warps;
    fiber *fibers;
    warp_state *warps_state;
    int *ready;       /* ring of fiber indices */
    int ready_head, ready_count;
    int *lazy;        /* ring of fibers that run only when no other is ready (af_emu_yield) */
    int lazy_head, lazy_count;
    int done, at_barrier;
    long long epoch;
    int block_idx[3];
    char *smem;
    size_t smem_bytes;
    chunk_state *chunks;
    fiber *current;
    ucontext_t main_context;
    int main_stack_known;
#ifdef AF_EMU_ASAN
    const void *main_stack_bottom;
    size_t main_stack_size;
    void *main_fake_stack;
#endif
} block_run;

static __thread block_run *current_block;

/* ---- Reports ---- */
static void report(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

static void report(const char *fmt, ...)
{
    block_run *b = current_block;
    fprintf(stderr, "cuda_emulated: ");
    if (b)
        fprintf(stderr, "kernel %s, block (%d,%d,%d): ", b->kernel->name, b->block_idx[0], b->block_idx[1],
                b->block_idx[2]);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(stderr);
    abort();
}

static block_run *require_block(const char *what)
{
    block_run *b = current_block;
    if (!b || !b->current)
        report("%s called outside a kernel", what);
    return b;
}

/* ---- Fiber switching ---- */
static void push_ready(block_run *b, int index)
{
    b->ready[(b->ready_head + b->ready_count) % b->threads] = index;
    b->ready_count++;
}

static void describe_deadlock(block_run *b) __attribute__((noreturn));

static void describe_deadlock(block_run *b)
{
    char text[4096];
    int used = snprintf(text, sizeof text, "deadlock: no thread can run; %d of %d threads wait at af_syncthreads, "
                        "%d exited", b->at_barrier, b->threads, b->done);
    for (int w = 0; w < b->warps && used < (int)sizeof text - 200; w++) {
        const warp_state *ws = &b->warps_state[w];
        if (ws->arrived)
            used += snprintf(text + used, sizeof text - (size_t)used, "; warp %d: %d of 32 lanes in %s", w,
                             ws->arrived, collective_names[ws->kind]);
    }
    report("%s (a barrier or warp collective in divergent code?)", text);
}

static void switch_context(block_run *b, fiber *from, fiber *to, int from_exits)
{
    b->current = to;
    ucontext_t *from_ctx = from ? &from->context : &b->main_context;
    ucontext_t *to_ctx = to ? &to->context : &b->main_context;
#ifdef AF_EMU_ASAN
    void **fake = from_exits ? NULL : (from ? &from->fake_stack : &b->main_fake_stack);
    if (to)
        __sanitizer_start_switch_fiber(fake, to->stack, AF_EMU_STACK_BYTES);
    else
        __sanitizer_start_switch_fiber(fake, b->main_stack_bottom, b->main_stack_size);
#else
    (void)from_exits;
#endif
    if (swapcontext(from_ctx, to_ctx) != 0)
        report("swapcontext failed: %s", strerror(errno));
#ifdef AF_EMU_ASAN
    __sanitizer_finish_switch_fiber(from ? from->fake_stack : b->main_fake_stack, NULL, NULL);
#endif
    b->current = from;
    af_emu_self = from ? &from->view : NULL;
}

/* The running fiber stops (it waits or has exited): the next ready one runs, or the scheduler once all exited. */
static void run_next(block_run *b, fiber *self)
{
    if (b->ready_count == 0 && b->lazy_count == 0) {
        if (b->done == b->threads) {
            switch_context(b, self, NULL, 1);
            report("an exited thread was resumed");
        }
        describe_deadlock(b);
    }
    int next;
    if (b->ready_count > 0) {
        next = b->ready[b->ready_head];
        b->ready_head = (b->ready_head + 1) % b->threads;
        b->ready_count--;
    } else {
        next = b->lazy[b->lazy_head];
        b->lazy_head = (b->lazy_head + 1) % b->threads;
        b->lazy_count--;
    }
    fiber *to = &b->fibers[next];
    to->state = FIBER_RUNNING;
    if (to != self)
        switch_context(b, self, to, self->state == FIBER_DONE);
    self->state = FIBER_RUNNING;
}

static void discard_copies(block_run *b, fiber *f);

static void fiber_main(void)
{
    block_run *b = current_block;
    fiber *self = b->current;
#ifdef AF_EMU_ASAN
    if (!b->main_stack_known)
        __sanitizer_finish_switch_fiber(NULL, &b->main_stack_bottom, &b->main_stack_size);
    else
        __sanitizer_finish_switch_fiber(NULL, NULL, NULL);
#endif
    b->main_stack_known = 1;
    af_emu_self = &self->view;
    b->kernel->entry(b->params);

    int w = self->view.thread_idx / 32;
    warp_state *ws = &b->warps_state[w];
    if (ws->arrived)
        report("thread %d exits while %d lanes of its warp %d wait in %s", self->view.thread_idx, ws->arrived, w,
               collective_names[ws->kind]);
    ws->exited++;
    discard_copies(b, self);
    self->state = FIBER_DONE;
    b->done++;
    run_next(b, self);
    abort();
}

/* ---- Barrier ---- */
void af_syncthreads(void)
{
    block_run *b = require_block("af_syncthreads");
    fiber *self = b->current;
    self->state = FIBER_BARRIER;
    if (++b->at_barrier == b->threads) {
        b->at_barrier = 0;
        b->epoch++;
        for (int i = 0; i < b->threads; i++) {
            if (&b->fibers[i] != self && b->fibers[i].state == FIBER_BARRIER) {
                b->fibers[i].state = FIBER_READY;
                push_ready(b, i);
            }
        }
        self->state = FIBER_RUNNING;
        return;
    }
    run_next(b, self);
}

/* ---- Warp collectives ---- */
static void complete_collective(block_run *b, int warp, collective_kind kind);

static void arrive(block_run *b, fiber *self, collective_kind kind)
{
    int w = self->view.thread_idx / 32;
    warp_state *ws = &b->warps_state[w];
    if (ws->exited)
        report("lane %d of warp %d reaches %s but %d lanes of its warp have exited", self->view.thread_idx % 32, w,
               collective_names[kind], ws->exited);
    if (ws->arrived == 0)
        ws->kind = kind;
    else if (ws->kind != kind)
        report("lanes of warp %d meet different collectives: lane %d reaches %s while %d lanes wait in %s", w,
               self->view.thread_idx % 32, collective_names[kind], ws->arrived, collective_names[ws->kind]);
    self->state = FIBER_COLLECTIVE;
    if (++ws->arrived < 32) {
        run_next(b, self);
        return;
    }
    complete_collective(b, w, kind);
    ws->arrived = 0;
    for (int l = 0; l < 32; l++) {
        fiber *f = &b->fibers[w * 32 + l];
        if (f != self) {
            f->state = FIBER_READY;
            push_ready(b, w * 32 + l);
        }
    }
    self->state = FIBER_RUNNING;
}

float af_shfl_xor(float v, int lane_mask)
{
    block_run *b = require_block("af_shfl_xor");
    fiber *self = b->current;
    self->shfl_value = v;
    self->shfl_mask = lane_mask;
    arrive(b, self, COLLECTIVE_SHFL_XOR);
    return self->shfl_result;
}

int af_warp_broadcast(int v)
{
    block_run *b = require_block("af_warp_broadcast");
    fiber *self = b->current;
    self->shfl_value = (float)v;   /* exact: the ints broadcast here are indices far below 2^24 */
    if (v != (int)(float)v)
        report("af_warp_broadcast: %d is not exact in the emulation's float slot", v);
    arrive(b, self, COLLECTIVE_BROADCAST);
    return (int)self->shfl_result;
}

/* __shfl_sync(full, v, src_lane): any int, exactly (no float slot); a source outside 0..31 is refused (the contract's
 * callers name a lane; CUDA would take it modulo the width). */
int af_shfl_int(int v, int src_lane)
{
    block_run *b = require_block("af_shfl_int");
    fiber *self = b->current;
    if (src_lane < 0 || src_lane > 31)
        report("af_shfl_int: thread %d names source lane %d, outside 0..31", self->view.thread_idx, src_lane);
    self->shfl_int_value = v;
    self->shfl_int_src = src_lane;
    arrive(b, self, COLLECTIVE_SHFL_INT);
    return self->shfl_int_result;
}

static void complete_shfl_int(fiber *lanes)
{
    for (int l = 0; l < 32; l++) lanes[l].shfl_int_result = lanes[lanes[l].shfl_int_src].shfl_int_value;
}

static void complete_broadcast(fiber *lanes)
{
    for (int l = 0; l < 32; l++) lanes[l].shfl_result = lanes[0].shfl_value;
}

static void complete_shfl(fiber *lanes)
{
    for (int l = 0; l < 32; l++) {
        unsigned src = (unsigned)l ^ (unsigned)lanes[l].shfl_mask;
        /* a source lane outside the warp gives the caller its own value */
        lanes[l].shfl_result = src < 32 ? lanes[src].shfl_value : lanes[l].shfl_value;
    }
}

static double half_value(uint32_t reg, int high, int bf16)
{
    uint16_t h = (uint16_t)(high ? reg >> 16 : reg & 0xffffu);
    return bf16 ? (double)af_bf16_to_float(h) : (double)af_f16_to_float(h);
}

/* D = A·B + C with the m16n8k16 fragment layouts of the PTX ISA (g = lane / 4, t = lane % 4):
 * A a0,a1 (g, 2t..2t+1) a2,a3 (g+8, 2t..) a4,a5 (g, 2t+8..) a6,a7 (g+8, 2t+8..); B b0,b1 (k = 2t.., n = g)
 * b2,b3 (k = 2t+8.., n = g); C/D c0,c1 (g, 2t..) c2,c3 (g+8, 2t..); the lower element in the low 16 bits. */
static void complete_mma(fiber *lanes, int bf16)
{
    double a[16][16], bm[16][8], c[16][8];
    for (int l = 0; l < 32; l++) {
        int g = l >> 2, t = l & 3;
        const uint32_t *ra = lanes[l].mma_a, *rb = lanes[l].mma_b;
        const float *d = lanes[l].mma_d;
        for (int i = 0; i < 8; i++) {
            int row = g + ((i & 2) ? 8 : 0), col = 2 * t + (i & 1) + ((i & 4) ? 8 : 0);
            a[row][col] = half_value(ra[i >> 1], i & 1, bf16);
        }
        for (int i = 0; i < 4; i++)
            bm[2 * t + (i & 1) + ((i & 2) ? 8 : 0)][g] = half_value(rb[i >> 1], i & 1, bf16);
        for (int i = 0; i < 4; i++)
            c[g + ((i & 2) ? 8 : 0)][2 * t + (i & 1)] = d[i];
    }
    for (int l = 0; l < 32; l++) {
        int g = l >> 2, t = l & 3;
        for (int i = 0; i < 4; i++) {
            int row = g + ((i & 2) ? 8 : 0), col = 2 * t + (i & 1);
            double sum = c[row][col];
            for (int k = 0; k < 16; k++)
                sum += a[row][k] * bm[k][col];
            lanes[l].mma_d[i] = (float)sum;
        }
    }
}

static void mma(float d[4], const uint32_t a[4], const uint32_t b[2], collective_kind kind)
{
    block_run *blk = require_block(collective_names[kind]);
    fiber *self = blk->current;
    self->mma_d = d;
    self->mma_a = a;
    self->mma_b = b;
    arrive(blk, self, kind);
}

void af_mma_16816_f16(float d[4], const uint32_t a[4], const uint32_t b[2]) { mma(d, a, b, COLLECTIVE_MMA_F16); }
void af_mma_16816_bf16(float d[4], const uint32_t a[4], const uint32_t b[2]) { mma(d, a, b, COLLECTIVE_MMA_BF16); }

/* The chunk of shared memory at p, which must be a 16-byte aligned 16-byte row inside the block's allocation. */
static chunk_state *smem_chunk(block_run *b, const void *p, const char *what, int thread)
{
    const char *c = (const char *)p;
    if (c < b->smem || c >= b->smem + b->smem_bytes || (size_t)(c - b->smem) + 16 > b->smem_bytes)
        report("%s: thread %d's address %p is not a 16-byte row inside the block's %zu bytes of dynamic shared "
               "memory at %p", what, thread, p, b->smem_bytes, (void *)b->smem);
    if ((size_t)(c - b->smem) % 16 != 0)
        report("%s: thread %d's shared-memory address (offset %zu) is not 16-byte aligned", what, thread,
               (size_t)(c - b->smem));
    return &b->chunks[(size_t)(c - b->smem) / 16];
}

static void ldmatrix_read_row(block_run *b, int warp, int lane, const char *row, collective_kind kind)
{
    int thread = warp * 32 + lane;
    chunk_state *ch = smem_chunk(b, row, collective_names[kind], thread);
    size_t offset = (size_t)(row - b->smem);
    if (ch->in_flight)
        report("race: %s by warp %d reads shared bytes [%zu, %zu) while a cp.async of thread %d into them is in "
               "flight (no cp.async wait_group completed it)", collective_names[kind], warp, offset, offset + 16,
               ch->in_flight_thread);
    if (ch->write_epoch == b->epoch)
        report("race: %s by warp %d reads shared bytes [%zu, %zu) that thread %d's cp.async completed after the "
               "last af_syncthreads (cp.async data is visible to other threads only after wait_group and a "
               "barrier)", collective_names[kind], warp, offset, offset + 16, ch->writer);
    if (ch->read_epoch != b->epoch) {
        ch->read_epoch = b->epoch;
        ch->reader_warp = warp;
        ch->several_readers = 0;
    } else if (ch->reader_warp != warp) {
        ch->several_readers = 1;
    }
}

static uint16_t element_at(const char *row, int col)
{
    uint16_t v;
    memcpy(&v, row + 2 * col, sizeof v);
    return v;
}

/* Lanes 8j..8j+7 give the rows of matrix j. Lane l receives in register j: row l/4, columns 2(l%4), 2(l%4)+1;
 * with .trans, (row 2(l%4), column l/4) and (row 2(l%4)+1, column l/4) of the stored matrix. */
static void complete_ldmatrix(block_run *b, int warp, fiber *lanes, int matrices, int trans, collective_kind kind)
{
    for (int i = 0; i < 8 * matrices; i++)
        ldmatrix_read_row(b, warp, i, lanes[i].ldm_row, kind);
    for (int l = 0; l < 32; l++) {
        int g = l >> 2, t = l & 3;
        for (int j = 0; j < matrices; j++) {
            uint16_t lo, hi;
            if (trans) {
                lo = element_at(lanes[8 * j + 2 * t].ldm_row, g);
                hi = element_at(lanes[8 * j + 2 * t + 1].ldm_row, g);
            } else {
                lo = element_at(lanes[8 * j + g].ldm_row, 2 * t);
                hi = element_at(lanes[8 * j + g].ldm_row, 2 * t + 1);
            }
            lanes[l].ldm_r[j] = (uint32_t)lo | ((uint32_t)hi << 16);
        }
    }
}

static void ldmatrix(uint32_t *r, const void *smem_row, collective_kind kind)
{
    block_run *b = require_block(collective_names[kind]);
    fiber *self = b->current;
    self->ldm_r = r;
    self->ldm_row = (const char *)smem_row;
    arrive(b, self, kind);
}

void af_ldmatrix_x4(uint32_t r[4], const void *smem_row) { ldmatrix(r, smem_row, COLLECTIVE_LDMATRIX_X4); }
void af_ldmatrix_x4_trans(uint32_t r[4], const void *smem_row)
{
    ldmatrix(r, smem_row, COLLECTIVE_LDMATRIX_X4_TRANS);
}
void af_ldmatrix_x2(uint32_t r[2], const void *smem_row) { ldmatrix(r, smem_row, COLLECTIVE_LDMATRIX_X2); }
void af_ldmatrix_x2_trans(uint32_t r[2], const void *smem_row)
{
    ldmatrix(r, smem_row, COLLECTIVE_LDMATRIX_X2_TRANS);
}

static void complete_collective(block_run *b, int warp, collective_kind kind)
{
    fiber *lanes = &b->fibers[warp * 32];
    switch (kind) {
    case COLLECTIVE_SHFL_XOR: complete_shfl(lanes); break;
    case COLLECTIVE_BROADCAST: complete_broadcast(lanes); break;
    case COLLECTIVE_SHFL_INT: complete_shfl_int(lanes); break;
    case COLLECTIVE_MMA_F16: complete_mma(lanes, 0); break;
    case COLLECTIVE_MMA_BF16: complete_mma(lanes, 1); break;
    case COLLECTIVE_LDMATRIX_X4: complete_ldmatrix(b, warp, lanes, 4, 0, kind); break;
    case COLLECTIVE_LDMATRIX_X4_TRANS: complete_ldmatrix(b, warp, lanes, 4, 1, kind); break;
    case COLLECTIVE_LDMATRIX_X2: complete_ldmatrix(b, warp, lanes, 2, 0, kind); break;
    case COLLECTIVE_LDMATRIX_X2_TRANS: complete_ldmatrix(b, warp, lanes, 2, 1, kind); break;
    case COLLECTIVE_NONE: report("internal: empty collective");
    }
}

/* ---- cp.async ---- */
void af_cp_async_16(void *smem_dst, const void *gmem_src, int src_bytes)
{
    block_run *b = require_block("af_cp_async_16");
    fiber *self = b->current;
    int thread = self->view.thread_idx;
    if (src_bytes < 0 || src_bytes > 16)
        report("af_cp_async_16: thread %d's src_bytes %d is outside 0..16", thread, src_bytes);
    if (src_bytes > 0 && ((uintptr_t)gmem_src % 16) != 0)
        report("af_cp_async_16: thread %d's source %p is not 16-byte aligned", thread, gmem_src);
    chunk_state *ch = smem_chunk(b, smem_dst, "af_cp_async_16", thread);
    if (self->copy_count == self->copy_capacity) {
        int cap = self->copy_capacity ? 2 * self->copy_capacity : 16;
        pending_copy *grown = (pending_copy *)realloc(self->copies, (size_t)cap * sizeof *grown);
        if (!grown)
            report("out of memory for thread %d's cp.async queue", thread);
        self->copies = grown;
        self->copy_capacity = cap;
    }
    pending_copy *c = &self->copies[self->copy_count++];
    c->dst = (char *)smem_dst;
    memset(c->data, 0, sizeof c->data);
    if (src_bytes > 0)
        memcpy(c->data, gmem_src, (size_t)src_bytes);
    c->group = -1;
    c->issue_epoch = b->epoch;
    ch->in_flight++;
    ch->in_flight_thread = thread;
}

void af_cp_async_commit(void)
{
    block_run *b = require_block("af_cp_async_commit");
    fiber *self = b->current;
    for (int i = 0; i < self->copy_count; i++)
        if (self->copies[i].group < 0)
            self->copies[i].group = self->groups_committed;
    self->groups_committed++;
}

static void complete_copy(block_run *b, fiber *self, const pending_copy *c)
{
    int thread = self->view.thread_idx, warp = thread / 32;
    chunk_state *ch = &b->chunks[(size_t)(c->dst - b->smem) / 16];
    size_t offset = (size_t)(c->dst - b->smem);
    if (ch->read_epoch >= c->issue_epoch && (ch->several_readers || ch->reader_warp != warp))
        report("race: thread %d's cp.async overwrites shared bytes [%zu, %zu) that warp %d%s read with ldmatrix "
               "with no af_syncthreads since the copy's issue", thread, offset, offset + 16, ch->reader_warp,
               ch->several_readers ? " (and others)" : "");
    memcpy(c->dst, c->data, 16);
    ch->in_flight--;
    ch->write_epoch = b->epoch;
    ch->writer = thread;
}

/* wait_group n: every group but the n most recent is complete (copies not yet committed are in no group). */
static void wait_groups(int n, const char *what)
{
    block_run *b = require_block(what);
    fiber *self = b->current;
    long long limit = self->groups_committed - n;
    int kept = 0;
    for (int i = 0; i < self->copy_count; i++) {
        pending_copy *c = &self->copies[i];
        if (c->group >= 0 && c->group < limit)
            complete_copy(b, self, c);
        else
            self->copies[kept++] = *c;
    }
    self->copy_count = kept;
}

void af_cp_async_wait_0(void) { wait_groups(0, "af_cp_async_wait_0"); }
void af_cp_async_wait_1(void) { wait_groups(1, "af_cp_async_wait_1"); }
void af_cp_async_wait_2(void) { wait_groups(2, "af_cp_async_wait_2"); }

/* Copies a thread never waited for are dropped, so a missing wait shows as stale shared memory. */
static void discard_copies(block_run *b, fiber *f)
{
    for (int i = 0; i < f->copy_count; i++)
        b->chunks[(size_t)(f->copies[i].dst - b->smem) / 16].in_flight--;
    f->copy_count = 0;
}

/* ---- Launch ---- */
cudaError_t af_emu_set_max_smem(af_emu_kernel *kernel, long long bytes)
{
    cudaError_t avail = af_emu_availability();
    if (avail != cudaSuccess)
        return af_emu_fail(avail);
    if (bytes < 0 || bytes > AF_EMU_OPTIN_SMEM)
        return af_emu_fail(cudaErrorInvalidValue);
    __atomic_store_n(&kernel->max_dynamic_smem, (int)bytes, __ATOMIC_RELAXED);
    return cudaSuccess;
}

/* cudaOccupancyMaxActiveBlocksPerMultiprocessor of a cc 9.0 multiprocessor: 228 KiB of shared memory with 1 KiB
 * reserved per block, 2048 threads, 32 blocks; a block above the kernel's allowed dynamic shared memory fits 0
 * times. Registers are not modelled (the emulation does not know a kernel's): ATTNFORGE_EMU_OCCUPANCY=N caps the
 * answer at N, so tests can give a variant the occupancy its registers would. */
cudaError_t af_emu_occupancy(const af_emu_kernel *kernel, long long threads, long long smem_bytes, int *blocks)
{
    cudaError_t avail = af_emu_availability();
    if (avail != cudaSuccess)
        return af_emu_fail(avail);
    if (!blocks || threads < 1 || threads > kernel->max_threads || smem_bytes < 0)
        return af_emu_fail(cudaErrorInvalidValue);
    const long long allowed = kernel->max_dynamic_smem > AF_EMU_DEFAULT_SMEM ? kernel->max_dynamic_smem
                                                                             : AF_EMU_DEFAULT_SMEM;
    if (smem_bytes > allowed) {
        *blocks = 0;
        return cudaSuccess;
    }
    const long long warps = (threads + 31) / 32;
    long long n = (228LL * 1024) / (smem_bytes + 1024);
    if (n > 64 / warps) n = 64 / warps;
    if (n > 32) n = 32;
    const char *cap = getenv("ATTNFORGE_EMU_OCCUPANCY");
    if (cap && atoll(cap) > 0 && n > atoll(cap)) n = atoll(cap);
    *blocks = (int)n;
    return cudaSuccess;
}

static uint64_t next_random(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static uint64_t gcd(uint64_t a, uint64_t b)
{
    while (b) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

static uint64_t launch_seed(void)
{
    const char *s = getenv("ATTNFORGE_EMU_SEED");
    uint64_t seed = s && *s ? strtoull(s, NULL, 0) : 0x5eedULL;
    return seed * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL;
}

typedef struct {
    fiber *fibers;
    int count;
} fiber_pool;

static int pool_create(fiber_pool *pool, int count)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    pool->count = 0;
    pool->fibers = (fiber *)calloc((size_t)count, sizeof(fiber));
    if (!pool->fibers)
        return 0;
    for (int i = 0; i < count; i++) {
        char *map = (char *)mmap(NULL, AF_EMU_STACK_BYTES + page, PROT_READ | PROT_WRITE,
                                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (map == MAP_FAILED)
            return 0;
        mprotect(map, page, PROT_NONE); /* guard page: a stack overflow faults */
        pool->fibers[i].stack = map + page;
#ifdef AF_EMU_VALGRIND
        pool->fibers[i].valgrind_id = VALGRIND_STACK_REGISTER(map + page, map + page + AF_EMU_STACK_BYTES);
#endif
        pool->count++;
    }
    return 1;
}

static void pool_destroy(fiber_pool *pool)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (int i = 0; i < pool->count; i++) {
#ifdef AF_EMU_VALGRIND
        VALGRIND_STACK_DEREGISTER(pool->fibers[i].valgrind_id);
#endif
        free(pool->fibers[i].copies);
        munmap(pool->fibers[i].stack - page, AF_EMU_STACK_BYTES + page);
    }
    free(pool->fibers);
}

/* Apart from run_block: getcontext returns twice as far as the compiler knows, which endangers a caller's locals. */
static void start_context(fiber *f)
{
    if (getcontext(&f->context) != 0)
        report("getcontext failed: %s", strerror(errno));
    f->context.uc_stack.ss_sp = f->stack;
    f->context.uc_stack.ss_size = AF_EMU_STACK_BYTES;
    f->context.uc_link = NULL;
    makecontext(&f->context, fiber_main, 0);
#ifdef AF_EMU_ASAN
    /* ASan's swapcontext clears the shadow of the target's uc_stack on every switch: 128 KiB of shadow by mmap, 85%
     * of the sanitizer run's time. swapcontext itself reads only the registers makecontext set, and the fiber API
     * above tells ASan about the stacks; a fiber's frames return before its stack is reused. */
    f->context.uc_stack.ss_size = 0;
#endif
}

static void run_block(block_run *b, uint64_t *rng)
{
    b->done = b->at_barrier = 0;
    b->epoch = 0;
    b->ready_head = b->ready_count = b->lazy_head = b->lazy_count = 0;
    b->main_stack_known = 0;
    memset(b->warps_state, 0, (size_t)b->warps * sizeof *b->warps_state);
    /* Shared memory starts as NaN bytes (f16, bf16 and f32 alike), as uninitialised on a GPU. */
    memset(b->smem, 0xff, b->smem_bytes);
    for (size_t i = 0; i < b->smem_bytes / 16; i++) {
        chunk_state *ch = &b->chunks[i];
        ch->write_epoch = ch->read_epoch = -1;
        ch->writer = ch->reader_warp = -1;
        ch->several_readers = ch->in_flight = 0;
        ch->in_flight_thread = -1;
    }
    int first = (int)(next_random(rng) % (uint64_t)b->threads);
    for (int k = 0; k < b->threads; k++) {
        int i = (first + k) % b->threads;
        fiber *f = &b->fibers[i];
        f->state = FIBER_READY;
        f->copy_count = 0;
        f->groups_committed = 0;
        f->view.thread_idx = i;
        memcpy(f->view.block_idx, b->block_idx, sizeof b->block_idx);
        start_context(f);
        push_ready(b, i);
    }
    int next = b->ready[b->ready_head];
    b->ready_head = (b->ready_head + 1) % b->threads;
    b->ready_count--;
    b->fibers[next].state = FIBER_RUNNING;
    switch_context(b, NULL, &b->fibers[next], 0);
    if (b->done != b->threads)
        report("internal: the scheduler resumed with %d of %d threads finished", b->done, b->threads);
}

static cudaError_t check_launch(const af_emu_kernel *k, long long gx, long long gy, long long gz, long long threads,
                                long long smem_bytes)
{
    cudaError_t avail = af_emu_availability();
    if (avail != cudaSuccess)
        return avail;
    if (gx < 1 || gx > 2147483647LL || gy < 1 || gy > 65535 || gz < 1 || gz > 65535)
        return cudaErrorInvalidConfiguration;
    if (threads < 1 || threads > AF_EMU_MAX_THREADS)
        return cudaErrorInvalidConfiguration;
    if (threads > k->max_threads)
        return cudaErrorInvalidValue; /* more threads than the kernel's __launch_bounds__: the launch fails */
    if (threads % 32 != 0)
        return cudaErrorInvalidValue; /* the emulation's rule: the contract's kernels work in whole warps */
    int allowed = __atomic_load_n(&k->max_dynamic_smem, __ATOMIC_RELAXED);
    if (allowed == 0)
        allowed = AF_EMU_DEFAULT_SMEM;
    if (smem_bytes < 0 || smem_bytes > allowed)
        return cudaErrorInvalidValue;
    return cudaSuccess;
}

cudaError_t af_emu_launch(af_emu_kernel *kernel, long long gx, long long gy, long long gz, long long threads,
                          long long smem_bytes, cudaStream_t stream, const void *params)
{
    if (current_block)
        report("kernel %s launched from inside kernel %s (not supported)", kernel->name,
               current_block->kernel->name);
    cudaError_t err = af_emu_capture_enqueue(stream);   /* the legacy stream during a capture */
    if (err != cudaSuccess)
        return err;
    err = check_launch(kernel, gx, gy, gz, threads, smem_bytes);
    if (err != cudaSuccess)
        return af_emu_fail(err);
    (void)af_emu_runtime_device();   /* a launch needs a context: the runtime device's when none is current */

    block_run b;
    memset(&b, 0, sizeof b);
    b.kernel = kernel;
    b.params = params;
    b.threads = (int)threads;
    b.warps = b.threads / 32;
    b.smem_bytes = (size_t)smem_bytes;
    fiber_pool pool;
    void *smem = NULL;
    int ok = pool_create(&pool, b.threads);
    b.fibers = pool.fibers;
    b.warps_state = (warp_state *)calloc((size_t)b.warps, sizeof *b.warps_state);
    b.ready = (int *)calloc((size_t)b.threads, sizeof *b.ready);
    b.lazy = (int *)calloc((size_t)b.threads, sizeof *b.lazy);
    b.chunks = (chunk_state *)calloc(b.smem_bytes / 16 + 1, sizeof *b.chunks);
    ok = ok && b.warps_state && b.ready && b.lazy && b.chunks;
    ok = ok && posix_memalign(&smem, 128, b.smem_bytes ? b.smem_bytes : 16) == 0;
    if (!ok) {
        fprintf(stderr, "cuda_emulated: out of memory for a block of %d threads of kernel %s\n", b.threads,
                kernel->name);
        free(smem);
        free(b.chunks);
        free(b.lazy);
        free(b.ready);
        free(b.warps_state);
        pool_destroy(&pool);
        return af_emu_fail(cudaErrorMemoryAllocation);
    }
    b.smem = (char *)smem;
    for (int i = 0; i < b.threads; i++) {
        af_emu_thread_view *v = &b.fibers[i].view;
        v->block_dim = b.threads;
        v->grid_dim[0] = (int)gx;
        v->grid_dim[1] = (int)gy;
        v->grid_dim[2] = (int)gz;
        v->shared_memory = b.smem;
    }

    /* Blocks in a seeded order: index i runs as (a·i + c) mod N with a coprime to N, a bijection. */
    uint64_t rng = launch_seed();
    uint64_t n = (uint64_t)gx * (uint64_t)gy * (uint64_t)gz;
    uint64_t a = next_random(&rng) % n | 1;
    while (gcd(a, n) != 1)
        a += 2;
    uint64_t c = next_random(&rng) % n;
    const af_emu_thread_view *saved_self = af_emu_self;
    current_block = &b;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t idx = (uint64_t)(((unsigned __int128)a * i + c) % n);
        b.block_idx[0] = (int)(idx % (uint64_t)gx);
        b.block_idx[1] = (int)(idx / (uint64_t)gx % (uint64_t)gy);
        b.block_idx[2] = (int)(idx / ((uint64_t)gx * (uint64_t)gy));
        run_block(&b, &rng);
    }
    current_block = NULL;
    af_emu_self = saved_self;

    free(smem);
    free(b.chunks);
    free(b.lazy);
    free(b.ready);
    free(b.warps_state);
    pool_destroy(&pool);
    return cudaSuccess;
}

/* ---- Hooks for the Hopper emulation (cuda_emulated_hopper.c): its warpgroup collectives and mbarrier waits park
 * a fiber until another wakes it; a park that leaves no thread able to run is a deadlock, described by `describe` ---- */
void af_emu_park(void (*describe)(char *text, size_t size))
{
    block_run *b = require_block("af_emu_park");
    fiber *self = b->current;
    self->state = FIBER_COLLECTIVE;   /* not at the barrier: af_syncthreads never releases it */
    if (b->ready_count == 0 && b->lazy_count == 0) {
        char text[3072] = "";
        if (describe)
            describe(text, sizeof text);
        report("deadlock: no thread can run; %d of %d threads wait at af_syncthreads, %d exited; %s", b->at_barrier,
               b->threads, b->done, text);
    }
    run_next(b, self);
}

void af_emu_wake(int thread)
{
    block_run *b = require_block("af_emu_wake");
    if (thread < 0 || thread >= b->threads || b->fibers[thread].state != FIBER_COLLECTIVE)
        report("internal: af_emu_wake of thread %d, which is not parked", thread);
    b->fibers[thread].state = FIBER_READY;
    push_ready(b, thread);
}

/* The running thread goes on only once no other thread is ready (the slowest it may be): whatever the threads it
 * woke do meanwhile, they do before anything this thread does next. */
void af_emu_yield(void)
{
    block_run *b = require_block("af_emu_yield");
    fiber *self = b->current;
    if (b->ready_count == 0)
        return;
    self->state = FIBER_READY;
    b->lazy[(b->lazy_head + b->lazy_count) % b->threads] = self->view.thread_idx;
    b->lazy_count++;
    run_next(b, self);
}

size_t af_emu_shared_memory_bytes(void) { return require_block("af_emu_shared_memory_bytes")->smem_bytes; }

/* cp.async.mbarrier.arrive: the running thread's copies issued so far (committed or not) leave its queue, still in
 * flight, as an opaque batch the Hopper emulation lands later (af_emu_cp_async_land, which frees it). */
void *af_emu_cp_async_detach(int *count)
{
    block_run *b = require_block("af_emu_cp_async_detach");
    fiber *self = b->current;
    *count = self->copy_count;
    pending_copy *batch = NULL;
    if (self->copy_count) {
        batch = (pending_copy *)malloc((size_t)self->copy_count * sizeof *batch);
        if (!batch)
            report("out of memory for thread %d's cp.async batch", self->view.thread_idx);
        memcpy(batch, self->copies, (size_t)self->copy_count * sizeof *batch);
    }
    self->copy_count = 0;
    return batch;
}

size_t af_emu_cp_async_batch_offset(const void *batch, int i)
{
    block_run *b = require_block("af_emu_cp_async_batch_offset");
    return (size_t)(((const pending_copy *)batch)[i].dst - b->smem);
}

/* The batch's copies complete (shared memory written, the race checks of a wait_group) as thread `thread`'s. */
void af_emu_cp_async_land(int thread, void *batch, int count)
{
    block_run *b = require_block("af_emu_cp_async_land");
    const pending_copy *c = (const pending_copy *)batch;
    for (int i = 0; i < count; i++) complete_copy(b, &b->fibers[thread], &c[i]);
    free(batch);
}

int af_emu_cp_async_in_flight(size_t offset)
{
    block_run *b = require_block("af_emu_cp_async_in_flight");
    const chunk_state *ch = &b->chunks[offset / 16];
    return ch->in_flight ? ch->in_flight_thread : -1;
}
