/* The Hopper emulation (src/cuda/device_hopper.h on the CPU) against the PTX ISA definitions, written out here
 * independently: wgmma m64nNk16 (SS and RS, B K-major and MN-major, 128B swizzle and none) through descriptors vs a
 * double product, TMA boxes (2-d to 4-d, out-of-bounds zero fill, the swizzled placement), mbarrier phases in a
 * two-stage producer/consumer ring, a small attention tile (TMA, Q·Kᵀ, P from registers, P·V); each broken rule
 * runs in a forked child that must abort with the expected report; and the deliberate breakages of issue 30 (a
 * wrong descriptor swizzle, a missing fence, a wrong expect-tx count, a swapped fragment) are caught; a tile copied
 * by a warpgroup's cp.async and handed to wgmma over an mbarrier, and the report when a thread arrives before its
 * cp.async wait; the same tile completed by cp.async.mbarrier.arrive.noinc with the consumers' proxy fence after
 * their wait, and the reports when that fence is missing, comes before the wait or only in the producer, and when
 * the arrive precedes the copies. */
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <setjmp.h>
#include <cmocka.h>

#include "cuda/device_hopper.h"

/* ---- Helpers independent of the emulation ---- */
static uint64_t rng_state = 0x243f6a8885a308d3ULL;

static double uniform(double lo, double hi)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return lo + (hi - lo) * (double)(rng_state >> 11) / 9007199254740992.0;
}

static double f16_value(uint16_t h)
{
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return (h & 0x8000) ? -v : v;
}

static double bf16_value(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static double half(uint16_t h, int bf16) { return bf16 ? bf16_value(h) : f16_value(h); }

/* A random f16 with |x| in [2^-4, 4) or bf16 with |x| in [2^-8, 16), either sign. */
static uint16_t random_half(int bf16)
{
    uint16_t sign = uniform(0, 1) < 0.5 ? 0x8000 : 0;
    if (bf16)
        return (uint16_t)(sign | (uint16_t)((119 + (int)uniform(0, 12)) << 7) | (uint16_t)uniform(0, 128));
    return (uint16_t)(sign | (uint16_t)((11 + (int)uniform(0, 6)) << 10) | (uint16_t)uniform(0, 1024));
}

/* The 128-byte swizzle of the PTX ISA / CUDA's CU_TENSOR_MAP_SWIZZLE_128B: the 16-byte unit (address bits 4-6) of
 * a 128-byte row XORed with the row's index in its group of 8 (bits 7-9). */
static size_t swizzle128(size_t addr) { return addr ^ (((addr >> 7) & 7) << 4); }

static void expect_abort(void (*fn)(void), const char *expected)
{
    int pipe_fd[2];
    assert_int_equal(pipe(pipe_fd), 0);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        signal(SIGABRT, SIG_DFL);
        close(pipe_fd[0]);
        dup2(pipe_fd[1], 2);
        fn();
        _exit(0);
    }
    close(pipe_fd[1]);
    char text[16384];
    size_t used = 0;
    ssize_t got;
    while ((got = read(pipe_fd[0], text + used, sizeof text - 1 - used)) > 0)
        used += (size_t)got;
    text[used] = '\0';
    close(pipe_fd[0]);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGABRT || !strstr(text, expected))
        fail_msg("expected an abort with \"%s\"; status %d, stderr: %s", expected, status, text);
}

/* ---- wgmma through descriptors, with the operands laid out here by the PTX ISA's canonical layouts ---- */
enum { LAYOUT_128B, LAYOUT_NONE };

typedef struct {
    const uint16_t *a;     /* 64 x k, row-major */
    const uint16_t *b;     /* K-major: n x k row-major (B(k, n) = b[n][k]); MN-major: k x n row-major */
    float *d;              /* 64 x n */
    int n, k, bf16, rs, trans_b, layout;
    int desc_swizzle;      /* the swizzle the descriptors name (a breakage when it differs from the layout's) */
    int skip_proxy_fence, swap_fragment;
} mma_params;

/* Byte offset of A(r, c) / K-major B(n, c) in a tile of `rows` x k (128B: 128-byte rows; none: 8x8 cores, the k
 * cores of a row group adjacent, LBO 128, SBO k/8 * 128). */
static size_t kmajor_offset(int r, int c, int k, int layout)
{
    if (layout == LAYOUT_128B)
        return swizzle128((size_t)r * 128 + (size_t)c * 2);
    return (size_t)(r / 8) * (size_t)(k / 8) * 128 + (size_t)(c / 8) * 128 + (size_t)(r % 8) * 16 + (size_t)(c % 8) * 2;
}

/* Byte offset of MN-major B(kk, n) (128B: panels of 64 columns, each k rows of 128 bytes; none: 8x8 cores with
 * rows along k, LBO 128 between k groups, SBO k/8 * 128 between n groups). */
static size_t mnmajor_offset(int kk, int n, int k, int layout)
{
    if (layout == LAYOUT_128B)
        return swizzle128((size_t)(n / 64) * (size_t)k * 128 + (size_t)kk * 128 + (size_t)(n % 64) * 2);
    return (size_t)(n / 8) * (size_t)(k / 8) * 128 + (size_t)(kk / 8) * 128 + (size_t)(kk % 8) * 16 + (size_t)(n % 8) * 2;
}

#define MMA_CASE(N, T, FORM, SUFFIX, A)                         \
    af_wgmma_m64n##N##k16_##T##_##FORM##SUFFIX(d, A, db, step > 0)

static void issue(const mma_params *p, float *d, uint64_t da, const uint32_t *a, uint64_t db, int step)
{
    if (p->n == 80 || p->n == 176) {   /* SS, K-major B only */
        if (p->n == 80 && p->bf16) MMA_CASE(80, bf16, ss, , da);
        else if (p->n == 80) MMA_CASE(80, f16, ss, , da);
        else if (p->bf16) MMA_CASE(176, bf16, ss, , da);
        else MMA_CASE(176, f16, ss, , da);
        return;
    }
    int key = (p->n == 128) * 8 + p->bf16 * 4 + p->rs * 2 + p->trans_b;
    switch (key) {
    case 0: MMA_CASE(64, f16, ss, , da); break;
    case 1: MMA_CASE(64, f16, ss, _btrans, da); break;
    case 2: MMA_CASE(64, f16, rs, , a); break;
    case 3: MMA_CASE(64, f16, rs, _btrans, a); break;
    case 4: MMA_CASE(64, bf16, ss, , da); break;
    case 5: MMA_CASE(64, bf16, ss, _btrans, da); break;
    case 6: MMA_CASE(64, bf16, rs, , a); break;
    case 7: MMA_CASE(64, bf16, rs, _btrans, a); break;
    case 8: MMA_CASE(128, f16, ss, , da); break;
    case 9: MMA_CASE(128, f16, ss, _btrans, da); break;
    case 10: MMA_CASE(128, f16, rs, , a); break;
    case 11: MMA_CASE(128, f16, rs, _btrans, a); break;
    case 12: MMA_CASE(128, bf16, ss, , da); break;
    case 13: MMA_CASE(128, bf16, ss, _btrans, da); break;
    case 14: MMA_CASE(128, bf16, rs, , a); break;
    default: MMA_CASE(128, bf16, rs, _btrans, a); break;
    }
}

AF_KERNEL_SM90(mma_kernel, mma_params, p, 128)
{
    char *smem = af_shared_memory();
    char *sa = smem, *sb = smem + 8192;   /* A: 64 x k (8 KiB at most); B: n x k */
    int tid = AF_THREAD_IDX;
    for (int e = tid; e < 64 * p.k; e += 128)   /* ordinary stores into the operand tiles */
        memcpy(sa + kmajor_offset(e / p.k, e % p.k, p.k, p.layout), &p.a[e], 2);
    for (int e = tid; e < p.n * p.k; e += 128) {
        if (p.trans_b)
            memcpy(sb + mnmajor_offset(e / p.n, e % p.n, p.k, p.layout), &p.b[e], 2);
        else
            memcpy(sb + kmajor_offset(e / p.k, e % p.k, p.k, p.layout), &p.b[e], 2);
    }
    if (!p.skip_proxy_fence)
        af_fence_proxy_async();
    af_syncthreads();

    int w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
    float d[88];
    af_wgmma_fence();
    for (int step = 0; step < p.k / 16; step++) {
        uint64_t da, db;
        int sw = p.desc_swizzle;
        if (p.layout == LAYOUT_128B) {   /* a k-step moves 16 elements = 32 bytes along the swizzled rows */
            da = af_wgmma_desc(sa + 32 * step, sw, 16, 1024);
            db = p.trans_b ? af_wgmma_desc(sb + 16 * 128 * step, sw, (uint32_t)p.k * 128, 1024)
                           : af_wgmma_desc(sb + 32 * step, sw, 16, 1024);
        } else {                         /* two 8x8 cores of k a step */
            da = af_wgmma_desc(sa + 256 * step, sw, 128, (uint32_t)p.k / 8 * 128);
            db = p.trans_b ? af_wgmma_desc(sb + 256 * step, sw, 128, (uint32_t)p.k / 8 * 128)
                           : af_wgmma_desc(sb + 256 * step, sw, 128, (uint32_t)p.k / 8 * 128);
        }
        /* A registers by the PTX ISA: a[j] holds row 16w + g + 8(j % 2), columns 2t + 8(j / 2) and + 1 */
        uint32_t a[4];
        for (int j = 0; j < 4; j++) {
            int row = 16 * w + g + 8 * (j % 2), col = 16 * step + 2 * t + 8 * (j / 2);
            a[j] = (uint32_t)p.a[row * p.k + col] | ((uint32_t)p.a[row * p.k + col + 1] << 16);
        }
        if (p.swap_fragment) {
            uint32_t x = a[1];
            a[1] = a[2];
            a[2] = x;
        }
        issue(&p, d, da, a, db, step);
    }
    af_wgmma_commit();
    af_wgmma_wait_0();
    af_wgmma_fence_regs(d, p.n / 2);
    /* d[i]: row 16w + g + 8((i / 2) % 2), column 8(i / 4) + 2t + i % 2 */
    for (int i = 0; i < p.n / 2; i++)
        p.d[(16 * w + g + 8 * ((i / 2) % 2)) * p.n + 8 * (i / 4) + 2 * t + i % 2] = d[i];
}

/* Runs one product; returns the largest error relative to the reference's scale. */
static double run_mma(int n, int k, int bf16, int rs, int trans_b, int layout, int desc_swizzle, int swap)
{
    uint16_t *a = malloc(64 * 64 * 2), *b = malloc(176 * 64 * 2);
    float *d = malloc(64 * 176 * sizeof(float));
    for (int i = 0; i < 64 * k; i++)
        a[i] = random_half(bf16);
    for (int i = 0; i < n * k; i++)
        b[i] = random_half(bf16);
    mma_params p = {a, b, d, n, k, bf16, rs, trans_b, layout, desc_swizzle, 0, swap};
    assert_int_equal(AF_LAUNCH(mma_kernel, 1, 1, 1, 128, 8192 + 24576, 0, p), cudaSuccess);
    double worst = 0;
    for (int r = 0; r < 64; r++)
        for (int c = 0; c < n; c++) {
            double ref = 0, scale = 0;
            for (int q = 0; q < k; q++) {
                double bv = trans_b ? half(b[q * n + c], bf16) : half(b[c * k + q], bf16);
                ref += half(a[r * k + q], bf16) * bv;
                scale += fabs(half(a[r * k + q], bf16) * bv);
            }
            double err = fabs((double)d[r * n + c] - ref) / (scale + 1e-30);
            if (!(err <= worst))
                worst = isnan(err) ? INFINITY : err;
        }
    free(a);
    free(b);
    free(d);
    return worst;
}

static void test_wgmma_ss_128b(void **state)
{
    (void)state;
    for (int bf16 = 0; bf16 < 2; bf16++)
        for (int i = 0; i < 4; i++) {   /* N = 80 and 176: the key tiles of head dims 256 and 128 */
            const int n = (int[]){64, 128, 80, 176}[i];
            assert_true(run_mma(n, 16, bf16, 0, 0, LAYOUT_128B, AF_SWIZZLE_128B, 0) < 1e-6);
            assert_true(run_mma(n, 64, bf16, 0, 0, LAYOUT_128B, AF_SWIZZLE_128B, 0) < 1e-6);   /* 4 chained steps */
        }
}

static void test_wgmma_rs_and_btrans(void **state)
{
    (void)state;
    for (int bf16 = 0; bf16 < 2; bf16++)
        for (int n = 64; n <= 128; n += 64) {
            assert_true(run_mma(n, 32, bf16, 1, 0, LAYOUT_128B, AF_SWIZZLE_128B, 0) < 1e-6);
            assert_true(run_mma(n, 32, bf16, 1, 1, LAYOUT_128B, AF_SWIZZLE_128B, 0) < 1e-6);
            assert_true(run_mma(n, 64, bf16, 0, 1, LAYOUT_128B, AF_SWIZZLE_128B, 0) < 1e-6);
        }
}

static void test_wgmma_no_swizzle(void **state)
{
    (void)state;
    for (int rs = 0; rs < 2; rs++)
        for (int trans_b = 0; trans_b < 2; trans_b++)
            assert_true(run_mma(64, 32, 1, rs, trans_b, LAYOUT_NONE, AF_SWIZZLE_NONE, 0) < 1e-6);
    assert_true(run_mma(128, 16, 0, 0, 0, LAYOUT_NONE, AF_SWIZZLE_NONE, 0) < 1e-6);
}

/* Deliberate breakages: a descriptor naming the wrong swizzle, and a swapped A fragment, give wrong numbers. */
static void test_breakage_wrong_swizzle_and_swapped_fragment(void **state)
{
    (void)state;
    assert_true(run_mma(64, 32, 0, 0, 0, LAYOUT_128B, AF_SWIZZLE_NONE, 0) > 0.05);
    assert_true(run_mma(64, 32, 0, 0, 0, LAYOUT_128B, AF_SWIZZLE_64B, 0) > 0.05);
    assert_true(run_mma(64, 32, 1, 0, 1, LAYOUT_128B, AF_SWIZZLE_32B, 0) > 0.05);
    assert_true(run_mma(64, 32, 1, 1, 1, LAYOUT_128B, AF_SWIZZLE_128B, 1) > 0.05);
}

/* Breakage: the operands' ordinary stores are not fenced for the async proxy. */
static void run_missing_proxy_fence(void)
{
    uint16_t a[64 * 16], b[64 * 16];
    float d[64 * 64];
    memset(a, 0, sizeof a);
    memset(b, 0, sizeof b);
    for (int i = 0; i < 64 * 16; i++)
        a[i] = b[i] = 0x3c00;
    mma_params p = {a, b, d, 64, 16, 0, 0, 0, LAYOUT_128B, AF_SWIZZLE_128B, 1, 0};
    AF_LAUNCH(mma_kernel, 1, 1, 1, 128, 8192 + 16384, 0, p);
}

static void test_breakage_missing_proxy_fence(void **state)
{
    (void)state;
    expect_abort(run_missing_proxy_fence, "written by ordinary stores (or cp.async) with no af_fence_proxy_async");
}

/* ---- TMA boxes and mbarrier phases: a two-stage ring, warpgroup 0's thread 0 producing, warpgroup 1 consuming ---- */
typedef struct {
    CUtensorMap map;
    int rank, iters;
    int coords[8][4];        /* the box of each iteration */
    uint16_t *out;           /* iters x box elements, as they lie in shared memory */
    int box_bytes, expect_delta, store_before_tma;
} ring_params;

AF_KERNEL_SM90(ring_kernel, ring_params, p, 256)
{
    char *smem = af_shared_memory();
    uint64_t *full = (uint64_t *)(smem + 2 * 8192), *empty = full + 2;
    int tid = AF_THREAD_IDX;
    if (tid == 0) {
        for (int s = 0; s < 2; s++) {
            af_mbarrier_init(&full[s], 1);
            af_mbarrier_init(&empty[s], 128);
        }
        af_fence_mbarrier_init();
    }
    af_syncthreads();
    if (tid < 128) {
        AF_SETMAXNREG_DEC(40);
        if (tid == 0) {
            for (int it = 0; it < p.iters; it++) {
                int s = it % 2;
                af_mbarrier_wait_parity(&empty[s], (uint32_t)((it / 2) & 1) ^ 1);   /* the first pass is free */
                if (p.store_before_tma)
                    smem[s * 8192] = 1;
                af_mbarrier_arrive_expect_tx(&full[s], (uint32_t)(p.box_bytes + p.expect_delta));
                const int *c = p.coords[it];
                if (p.rank == 2)
                    af_tma_load_2d(smem + s * 8192, &p.map, &full[s], c[0], c[1]);
                else if (p.rank == 3)
                    af_tma_load_3d(smem + s * 8192, &p.map, &full[s], c[0], c[1], c[2]);
                else
                    af_tma_load_4d(smem + s * 8192, &p.map, &full[s], c[0], c[1], c[2], c[3]);
            }
        }
        return;
    }
    AF_SETMAXNREG_INC(232);
    for (int it = 0; it < p.iters; it++) {
        int s = it % 2;
        af_mbarrier_wait_parity(&full[s], (uint32_t)((it / 2) & 1));
        for (int e = tid - 128; e < p.box_bytes / 2; e += 128)
            memcpy(&p.out[it * (p.box_bytes / 2) + e], smem + s * 8192 + 2 * e, 2);
        af_mbarrier_arrive(&empty[s]);
    }
}

static void run_ring(int rank, int swizzle, int expect_delta, int store_before_tma, int check)
{
    /* a [4][3][40][64] tensor (dims[0] = 64 contiguous) with element value = its linear index + 1 */
    enum { D0 = 64, D1 = 40, D2 = 3, D3 = 4 };
    uint16_t *g = malloc(sizeof(uint16_t) * D0 * D1 * D2 * D3);
    for (int i = 0; i < D0 * D1 * D2 * D3; i++)
        g[i] = (uint16_t)(i % 65521 + 1);
    uint64_t all_dims[4] = {D0, D1, D2, D3}, strides[3] = {D0 * 2, D0 * D1 * 2, (uint64_t)D0 * D1 * D2 * 2};
    uint32_t box[4] = {64, 16, rank > 2 ? 2 : 1, rank > 3 ? 2 : 1};
    ring_params p;
    memset(&p, 0, sizeof p);
    assert_int_equal(af_tma_encode_tiled(&p.map, AF_TMA_BF16, rank, g, all_dims, strides, box, swizzle), cudaSuccess);
    p.rank = rank;
    p.iters = 6;
    int coords[6][4] = {{0, 0, 0, 0}, {0, 30, 1, 3}, {0, -5, -1, 0}, {0, 16, 2, -1}, {-8, 8, 1, 1}, {32, 36, 0, 2}};
    memcpy(p.coords, coords, sizeof coords);
    p.box_bytes = (int)(box[0] * box[1] * box[2] * box[3] * 2);
    p.expect_delta = expect_delta;
    p.store_before_tma = store_before_tma;
    p.out = malloc((size_t)p.iters * (size_t)p.box_bytes);
    assert_int_equal(AF_SET_MAX_SMEM(ring_kernel, 2 * 8192 + 64), cudaSuccess);
    assert_int_equal(AF_LAUNCH(ring_kernel, 1, 1, 1, 256, 2 * 8192 + 64, 0, p), cudaSuccess);
    for (int it = 0; check && it < p.iters; it++)
        for (uint32_t i3 = 0; i3 < box[3]; i3++)
            for (uint32_t i2 = 0; i2 < box[2]; i2++)
                for (uint32_t i1 = 0; i1 < box[1]; i1++)
                    for (uint32_t i0 = 0; i0 < box[0]; i0++) {
                        long long x0 = coords[it][0] + i0, x1 = coords[it][1] + i1;
                        long long x2 = rank > 2 ? coords[it][2] + i2 : 0, x3 = rank > 3 ? coords[it][3] + i3 : 0;
                        int inside = x0 >= 0 && x0 < D0 && x1 >= 0 && x1 < D1 && x2 >= 0 && x2 < D2 && x3 >= 0 &&
                                     x3 < D3;
                        uint16_t want = inside ? g[((x3 * D2 + x2) * D1 + x1) * D0 + x0] : 0;
                        size_t lin = ((((size_t)i3 * box[2] + i2) * box[1] + i1) * box[0] + i0) * 2;
                        size_t at = swizzle == AF_SWIZZLE_128B ? swizzle128(lin) : lin;
                        if (p.out[(size_t)it * (size_t)(p.box_bytes / 2) + at / 2] != want)
                            fail_msg("rank %d iteration %d element (%u,%u,%u,%u): %u, expected %u", rank, it, i0, i1,
                                     i2, i3, p.out[(size_t)it * (size_t)(p.box_bytes / 2) + at / 2], want);
                    }
    free(p.out);
    free(g);
}

static void test_tma_boxes_and_phases(void **state)
{
    (void)state;
    for (int rank = 2; rank <= 4; rank++) {
        run_ring(rank, AF_SWIZZLE_128B, 0, 0, 1);
        run_ring(rank, AF_SWIZZLE_NONE, 0, 0, 1);
    }
}

static void test_tma_encode_refusals(void **state)
{
    (void)state;
    static uint16_t g[64 * 64] __attribute__((aligned(16)));
    CUtensorMap map;
    uint64_t dims[2] = {64, 64}, strides[1] = {128}, bad_stride[1] = {120};
    uint32_t box[2] = {64, 64}, narrow[2] = {32, 64}, big[2] = {64, 512};
    assert_int_equal(af_tma_encode_tiled(&map, AF_TMA_F16, 2, g, dims, strides, box, AF_SWIZZLE_128B), cudaSuccess);
    assert_int_equal(af_tma_encode_tiled(&map, AF_TMA_F16, 2, g, dims, bad_stride, box, 0), cudaErrorInvalidValue);
    assert_int_equal(af_tma_encode_tiled(&map, AF_TMA_F16, 2, g, dims, strides, big, 0), cudaErrorInvalidValue);
    assert_int_equal(af_tma_encode_tiled(&map, AF_TMA_F16, 2, g, dims, strides, narrow, AF_SWIZZLE_128B),
                     cudaErrorInvalidValue);
    assert_int_equal(af_tma_encode_tiled(&map, AF_TMA_F16, 2, (const char *)g + 2, dims, strides, box, 0),
                     cudaErrorInvalidValue);
    assert_int_equal(af_tma_encode_tiled(&map, AF_TMA_F16, 5, g, dims, strides, box, 0), cudaErrorInvalidValue);
}

/* Breakages: expect_tx announcing more bytes than the box (the phase never completes), or fewer. */
static void run_expect_too_many(void) { run_ring(2, AF_SWIZZLE_128B, 16, 0, 0); }
static void run_expect_too_few(void) { run_ring(2, AF_SWIZZLE_128B, -16, 0, 0); }
static void run_store_before_tma(void) { run_ring(2, AF_SWIZZLE_128B, 0, 1, 0); }

static void test_breakage_wrong_expect_tx(void **state)
{
    (void)state;
    expect_abort(run_expect_too_many, "16 transaction bytes (a wrong arrive count or expect_tx?)");
    expect_abort(run_expect_too_few, "below zero with every arrival in (expect_tx too small?)");
}

static void test_tma_over_ordinary_stores(void **state)
{
    (void)state;
    expect_abort(run_store_before_tma, "TMA copy overwrites shared bytes [0, 16) written by ordinary stores");
}

/* ---- One attention tile the FlashAttention-3 way: TMA (128B swizzle) for Q, K, V; S = Q·Kᵀ (SS); P = S in bf16
 * straight from the accumulators into A registers; O = P·V (RS, V MN-major) ---- */
typedef struct {
    CUtensorMap q, k, v;   /* 64 x 64 bf16 each */
    float *o;
    int desc_swizzle, read_early, write_early;
} tile_params;

AF_KERNEL_SM90(tile_kernel, tile_params, p, 128)
{
    char *smem = af_shared_memory();
    char *sq = smem, *sk = smem + 8192, *sv = smem + 16384;
    uint64_t *bar = (uint64_t *)(smem + 24576);
    int tid = AF_THREAD_IDX;
    if (tid == 0) {
        af_mbarrier_init(bar, 1);
        af_fence_mbarrier_init();
    }
    af_syncthreads();
    if (tid == 0) {
        af_mbarrier_arrive_expect_tx(bar, 3 * 8192);
        af_tma_load_2d(sq, &p.q, bar, 0, 0);
        af_tma_load_2d(sk, &p.k, bar, 0, 0);
        af_tma_load_2d(sv, &p.v, bar, 0, 0);
    }
    af_mbarrier_wait_parity(bar, 0);
    float s[32], o[32];
    af_wgmma_fence();
    for (int step = 0; step < 4; step++)
        af_wgmma_m64n64k16_bf16_ss(s, af_wgmma_desc(sq + 32 * step, p.desc_swizzle, 16, 1024),
                                   af_wgmma_desc(sk + 32 * step, p.desc_swizzle, 16, 1024), step > 0);
    af_wgmma_commit();
    if (p.write_early)
        s[3] = 0.0f;
    float early = p.read_early ? s[0] : 0.0f;
    af_wgmma_wait_0();
    af_wgmma_fence_regs(s, 32);
    s[0] += early;
    uint32_t a[4][4];   /* columns 16c..16c+15 of S are the A fragment of k-step c */
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < 4; j++)
            a[c][j] = af_pack_bf16x2(s[8 * c + 2 * j], s[8 * c + 2 * j + 1]);
    af_wgmma_fence();
    for (int c = 0; c < 4; c++)   /* V: 64 keys x 64 dims, one 128B panel; a k-step is 16 key rows */
        af_wgmma_m64n64k16_bf16_rs_btrans(o, a[c], af_wgmma_desc(sv + 16 * 128 * c, p.desc_swizzle, 8192, 1024), c > 0);
    af_wgmma_commit();
    af_wgmma_wait_0();
    af_wgmma_fence_regs(o, 32);
    int w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
    for (int i = 0; i < 32; i++)
        p.o[(16 * w + g + 8 * ((i / 2) % 2)) * 64 + 8 * (i / 4) + 2 * t + i % 2] = o[i];
}

static double run_tile(int desc_swizzle, int read_early, int write_early)
{
    static uint16_t q[64 * 64] __attribute__((aligned(16))), k[64 * 64] __attribute__((aligned(16))),
        v[64 * 64] __attribute__((aligned(16)));
    static float o[64 * 64];
    for (int i = 0; i < 64 * 64; i++) {
        q[i] = random_half(1);
        k[i] = random_half(1);
        v[i] = random_half(1);
    }
    tile_params p;
    memset(&p, 0, sizeof p);
    uint64_t dims[2] = {64, 64}, strides[1] = {128};
    uint32_t box[2] = {64, 64};
    assert_int_equal(af_tma_encode_tiled(&p.q, AF_TMA_BF16, 2, q, dims, strides, box, AF_SWIZZLE_128B), cudaSuccess);
    assert_int_equal(af_tma_encode_tiled(&p.k, AF_TMA_BF16, 2, k, dims, strides, box, AF_SWIZZLE_128B), cudaSuccess);
    assert_int_equal(af_tma_encode_tiled(&p.v, AF_TMA_BF16, 2, v, dims, strides, box, AF_SWIZZLE_128B), cudaSuccess);
    p.o = o;
    p.desc_swizzle = desc_swizzle;
    p.read_early = read_early;
    p.write_early = write_early;
    /* room past V: the breakage's unswizzled descriptors reach beyond the tiles */
    assert_int_equal(AF_SET_MAX_SMEM(tile_kernel, 24576 + 64 + 16384), cudaSuccess);
    assert_int_equal(AF_LAUNCH(tile_kernel, 1, 1, 1, 128, 24576 + 64 + 16384, 0, p), cudaSuccess);
    double worst = 0;
    for (int r = 0; r < 64; r++) {
        double srow[64];
        for (int c = 0; c < 64; c++) {
            double acc = 0;
            for (int x = 0; x < 64; x++)
                acc += bf16_value(q[r * 64 + x]) * bf16_value(k[c * 64 + x]);
            float f = (float)acc;   /* P as the kernel rounds it: f32, then bf16 */
            uint32_t u;
            memcpy(&u, &f, 4);
            u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
            memcpy(&f, &u, 4);
            srow[c] = f;
        }
        for (int c = 0; c < 64; c++) {
            double ref = 0, scale = 0;
            for (int x = 0; x < 64; x++) {
                ref += srow[x] * bf16_value(v[x * 64 + c]);
                scale += fabs(srow[x] * bf16_value(v[x * 64 + c]));
            }
            double err = fabs((double)o[r * 64 + c] - ref) / (scale + 1e-30);
            if (!(err <= worst))
                worst = isnan(err) ? INFINITY : err;
        }
    }
    return worst;
}

static void test_attention_tile(void **state)
{
    (void)state;
    assert_true(run_tile(AF_SWIZZLE_128B, 0, 0) < 1e-5);
    assert_true(run_tile(AF_SWIZZLE_NONE, 0, 0) > 0.05);   /* breakage: the descriptors miss TMA's swizzle */
    assert_true(isinf(run_tile(AF_SWIZZLE_128B, 1, 0)));   /* an accumulator read before the wait is NaN */
}

static void run_write_early(void) { run_tile(AF_SWIZZLE_128B, 0, 1); }

static void test_accumulator_written_in_flight(void **state)
{
    (void)state;
    expect_abort(run_write_early, "was written before the wait_group that completes it");
}

/* ---- Rule violations, one kernel with a mode each ---- */
typedef struct {
    int mode;
} rule_params;

enum {
    RULE_PARTIAL_WARPGROUP, RULE_PARTIAL_WARPGROUP_EXIT, RULE_MIXED_COLLECTIVES, RULE_NO_FENCE, RULE_SETMAXNREG_OPERAND, RULE_SETMAXNREG_MIXED,
    RULE_NO_WAIT, RULE_TMA_NOT_WAITED, RULE_TMA_OVER_INFLIGHT, RULE_DESC_OUTSIDE, RULE_EXTRA_ARRIVAL
};

AF_KERNEL_SM90(rule_kernel, rule_params, p, 128)
{
    char *smem = af_shared_memory();
    uint64_t *bar = (uint64_t *)(smem + 8192);
    int tid = AF_THREAD_IDX;
    float d[32];
    uint64_t desc = af_wgmma_desc(smem, AF_SWIZZLE_128B, 16, 1024);
    static const uint16_t zeros[64 * 64] __attribute__((aligned(16)));
    static CUtensorMap map;
    if (tid == 0) {
        uint64_t dims[2] = {64, 64}, strides[1] = {128};
        uint32_t box[2] = {64, 64};
        af_tma_encode_tiled(&map, AF_TMA_F16, 2, zeros, dims, strides, box, AF_SWIZZLE_128B);
        af_mbarrier_init(bar, 1);
    }
    af_syncthreads();
    switch (p.mode) {
    case RULE_PARTIAL_WARPGROUP:   /* warp 3 skips the wgmma and waits at the barrier */
        af_wgmma_fence();
        if (tid < 96)
            af_wgmma_m64n64k16_f16_ss(d, desc, desc, 0);
        af_syncthreads();
        break;
    case RULE_PARTIAL_WARPGROUP_EXIT:   /* warp 3 returns before the wgmma */
        if (tid >= 96)
            return;
        af_wgmma_fence();
        af_wgmma_m64n64k16_f16_ss(d, desc, desc, 0);
        break;
    case RULE_MIXED_COLLECTIVES:
        af_wgmma_fence();
        if (tid < 64)
            af_wgmma_m64n64k16_f16_ss(d, desc, desc, 0);
        else
            af_wgmma_m64n64k16_bf16_ss(d, desc, desc, 0);
        break;
    case RULE_NO_FENCE:
        af_wgmma_m64n64k16_f16_ss(d, desc, desc, 0);
        break;
    case RULE_SETMAXNREG_OPERAND:
        AF_SETMAXNREG_INC(100);
        break;
    case RULE_SETMAXNREG_MIXED:
        if (tid < 64)
            AF_SETMAXNREG_INC(232);
        else
            AF_SETMAXNREG_INC(240);
        break;
    case RULE_NO_WAIT:
        af_wgmma_fence();
        af_wgmma_m64n64k16_f16_ss(d, desc, desc, 0);
        af_wgmma_commit();
        return;
    case RULE_TMA_NOT_WAITED:   /* the wgmma reads the tile before anyone waited on the barrier */
        if (tid == 0) {
            af_mbarrier_arrive_expect_tx(bar, 8192);
            af_tma_load_2d(smem, &map, bar, 0, 0);
        }
        af_wgmma_fence();
        af_wgmma_m64n64k16_f16_ss(d, desc, desc, 0);
        break;
    case RULE_TMA_OVER_INFLIGHT:   /* a new tile lands over operands of a wgmma not yet waited for */
        af_wgmma_fence();
        af_wgmma_m64n64k16_f16_ss(d, desc, desc, 0);
        af_wgmma_commit();
        if (tid == 0) {
            af_mbarrier_arrive_expect_tx(bar, 8192);
            af_tma_load_2d(smem, &map, bar, 0, 0);
        }
        af_mbarrier_wait_parity(bar, 0);
        break;
    case RULE_DESC_OUTSIDE:
        af_wgmma_fence();
        af_wgmma_m64n64k16_f16_ss(d, af_wgmma_desc(smem + 8192, AF_SWIZZLE_128B, 16, 1024), desc, 0);
        break;
    case RULE_EXTRA_ARRIVAL:   /* the phase's one arrival came; it waits for bytes, not for a second arrival */
        if (tid == 0) {
            af_mbarrier_arrive_expect_tx(bar, 16);
            af_mbarrier_arrive(bar);
        }
        break;
    }
    af_wgmma_commit();
    af_wgmma_wait_0();
}

static int rule_mode;
static void run_rule(void)
{
    rule_params p = {rule_mode};
    AF_LAUNCH(rule_kernel, 1, 1, 1, 128, 8192 + 64, 0, p);
}

static void expect_rule(int mode, const char *text)
{
    rule_mode = mode;
    expect_abort(run_rule, text);
}

static void test_rule_reports(void **state)
{
    (void)state;
    /* found at the barrier, the deadlock is cuda_emulated.c's report: the 96 parked threads are the ones missing */
    expect_rule(RULE_PARTIAL_WARPGROUP, "deadlock: no thread can run; 32 of 128 threads wait at af_syncthreads");
    /* found by the last thread to park or to exit, the report names the wgmma */
    expect_rule(RULE_PARTIAL_WARPGROUP_EXIT, "in wgmma.mma_async (af_wgmma_m64n64k16_f16_ss)");
    expect_rule(RULE_MIXED_COLLECTIVES, "meet different collectives");
    expect_rule(RULE_NO_FENCE, "without af_wgmma_fence");
    expect_rule(RULE_SETMAXNREG_OPERAND, "register count 100 is not a multiple of 8 in 24..256");
    expect_rule(RULE_SETMAXNREG_MIXED, "(the count is warpgroup-uniform)");
    expect_rule(RULE_NO_WAIT, "wgmma results never waited for");
    expect_rule(RULE_TMA_NOT_WAITED, "that a TMA copy has not delivered");
    expect_rule(RULE_TMA_OVER_INFLIGHT, "that a wgmma in flight reads");
    expect_rule(RULE_DESC_OUTSIDE, "outside the block's");
    expect_rule(RULE_EXTRA_ARRIVAL, "more arrivals than the mbarrier's count 1");
}

/* ---- Named barriers: FlashAttention-3's ping-pong, two warpgroups taking turns ---- */
typedef struct {
    int *log;            /* the turns, in the order they ran */
    int rounds, mode;    /* mode 0: the schedule; 1: a count no phase reaches; 2: counts that disagree */
} pingpong_params;

AF_KERNEL_SM90(pingpong_kernel, pingpong_params, p, 256)
{
    const int wg = AF_THREAD_IDX / 128;
    int *turn = (int *)af_shared_memory();
    if (AF_THREAD_IDX == 0) *turn = 0;
    af_syncthreads();
    if (p.mode == 1) {   /* 128 threads arrive at a barrier counting 256: nobody else comes */
        if (wg == 0) af_named_bar_sync(3, 256);
        return;
    }
    if (p.mode == 2) {   /* one phase, two thread counts */
        af_named_bar_sync(3, wg == 0 ? 256 : 128);
        return;
    }
    for (int r = 0; r < p.rounds; r++) {
        if (wg == 1) af_named_bar_sync(1, 256);   /* wait for warpgroup 0's turn to end */
        if (AF_THREAD_IDX % 128 == 0) p.log[(*turn)++] = wg;
        if (wg == 0) af_named_bar_arrive(1, 256);   /* warpgroup 1's turn */
        if (wg == 0 && r + 1 < p.rounds) af_named_bar_sync(2, 256);   /* and back */
        if (wg == 1) af_named_bar_arrive(2, 256);
    }
}

static void test_named_barriers_ping_pong(void **state)
{
    (void)state;
    enum { ROUNDS = 5 };
    int *log = NULL;
    assert_int_equal(cudaMalloc((void **)&log, 2 * ROUNDS * sizeof(int)), cudaSuccess);
    pingpong_params p = {log, ROUNDS, 0};
    assert_int_equal(AF_LAUNCH(pingpong_kernel, 1, 1, 1, 256, 64, 0, p), cudaSuccess);
    for (int i = 0; i < 2 * ROUNDS; i++)
        if (log[i] != i % 2) fail_msg("turn %d ran warpgroup %d, expected %d (the turns must alternate)", i, log[i], i % 2);
    cudaFree(log);
}

static int named_mode;
static void run_named(void)
{
    pingpong_params p = {NULL, 0, named_mode};
    AF_LAUNCH(pingpong_kernel, 1, 1, 1, 256, 64, 0, p);
}

static void test_named_barrier_reports(void **state)
{
    (void)state;
    named_mode = 1;
    expect_abort(run_named, "named barrier 3: 128 of 256 threads arrived");
    named_mode = 2;
    expect_abort(run_named, "barrier 3's phase counts");   /* 128 vs 256, whichever arrived first */
}

/* Hopper primitives need AF_KERNEL_SM90's per-block state. */
typedef struct {
    int unused;
} plain_params;

AF_KERNEL(plain_kernel, plain_params, p, 128) { af_fence_proxy_async(); }

/* ---- cp.async into a wgmma operand handed over by an mbarrier (attn_wgmma_gather.cuh's protocol) ---- */
typedef struct {
    const uint16_t *a;   /* 64 x 16 f16, row-major, 16-byte aligned */
    float *d;            /* 64 x 64: A·Aᵀ */
    int mode;            /* a handover_mode */
} handover_params;

typedef enum {
    HANDOVER_WAIT,                /* wait_group, fence, arrive (the producer's fence) */
    HANDOVER_EARLY,               /* the breakage: an arrive before the cp.async wait */
    HANDOVER_NOINC,               /* cp.async.mbarrier.arrive.noinc; the consumers fence after their wait */
    HANDOVER_NOINC_NO_FENCE,      /* ... the consumers do not fence */
    HANDOVER_NOINC_FENCE_EARLY,   /* ... the consumers fence before their wait */
    HANDOVER_NOINC_PRODUCER_FENCE,/* ... the producers fence after their arrive, the consumers not */
    HANDOVER_NOINC_BEFORE_COPY    /* ... the arrive comes before the copy (it tracks none of it) */
} handover_mode;

/* Warpgroup 0 copies A's 128 16-byte chunks (a chunk a thread) with cp.async into the 128-byte swizzle, then waits
 * for them, fences the async proxy and arrives on a barrier counting its 128 threads; warpgroup 1 waits on it and
 * runs D = A·Aᵀ by wgmma (A K-major as both operands). */
AF_KERNEL_SM90(handover_kernel, handover_params, p, 256)
{
    char *smem = af_shared_memory();
    uint64_t *full = (uint64_t *)(smem + 8192);
    int tid = AF_THREAD_IDX;
    if (tid == 0) {
        af_mbarrier_init(full, 128);
        af_fence_mbarrier_init();
    }
    af_syncthreads();
    if (tid < 128) {
        AF_SETMAXNREG_DEC(24);
        int row = tid / 2, chunk = tid % 2;
        if (p.mode == HANDOVER_NOINC_BEFORE_COPY)
            af_cp_async_mbarrier_arrive_noinc(full);
        af_cp_async_16(smem + swizzle128((size_t)row * 128 + (size_t)chunk * 16), p.a + row * 16 + chunk * 8, 16);
        if (p.mode >= HANDOVER_NOINC) {
            if (p.mode != HANDOVER_NOINC_BEFORE_COPY)
                af_cp_async_mbarrier_arrive_noinc(full);   /* no commit, no wait */
            if (p.mode == HANDOVER_NOINC_PRODUCER_FENCE)
                af_fence_proxy_async();
            if (p.mode == HANDOVER_NOINC_BEFORE_COPY)   /* alive until the read: an exiting thread's copies drop */
                af_named_bar_sync(1, 256);
            return;
        }
        af_cp_async_commit();
        if (p.mode == HANDOVER_EARLY)
            af_mbarrier_arrive(full);
        af_cp_async_wait_0();
        af_fence_proxy_async();
        if (p.mode != HANDOVER_EARLY)
            af_mbarrier_arrive(full);
        return;
    }
    AF_SETMAXNREG_INC(240);
    if (p.mode == HANDOVER_NOINC_FENCE_EARLY)
        af_fence_proxy_async();
    af_mbarrier_wait_parity(full, 0);
    if (p.mode == HANDOVER_NOINC || p.mode == HANDOVER_NOINC_BEFORE_COPY)
        af_fence_proxy_async();   /* the copies, seen through the barrier, made visible to this thread's wgmma */
    int w = (tid % 128) / 32, g = (tid % 32) / 4, t = tid % 4;
    float d[32];
    uint64_t desc = af_wgmma_desc(smem, AF_SWIZZLE_128B, 16, 1024);
    af_wgmma_fence();
    af_wgmma_m64n64k16_f16_ss(d, desc, desc, 0);
    af_wgmma_commit();
    af_wgmma_wait_0();
    af_wgmma_fence_regs(d, 32);
    if (p.mode == HANDOVER_NOINC_BEFORE_COPY)
        af_named_bar_arrive(1, 256);
    for (int i = 0; i < 32; i++)
        p.d[(16 * w + g + 8 * ((i / 2) % 2)) * 64 + 8 * (i / 4) + 2 * t + i % 2] = d[i];
}

static uint16_t handover_a[64 * 16] __attribute__((aligned(16)));
static float handover_d[64 * 64];

static void run_handover(int mode)
{
    handover_params p = {handover_a, handover_d, mode};
    assert_int_equal(AF_LAUNCH(handover_kernel, 1, 1, 1, 256, 8192 + 64, 0, p), cudaSuccess);
}

static void run_handover_early(void) { run_handover(HANDOVER_EARLY); }
static void run_noinc_no_fence(void) { run_handover(HANDOVER_NOINC_NO_FENCE); }
static void run_noinc_fence_early(void) { run_handover(HANDOVER_NOINC_FENCE_EARLY); }
static void run_noinc_producer_fence(void) { run_handover(HANDOVER_NOINC_PRODUCER_FENCE); }
static void run_noinc_before_copy(void) { run_handover(HANDOVER_NOINC_BEFORE_COPY); }

static void check_handover_product(void)
{
    for (int r = 0; r < 64; r++)
        for (int c = 0; c < 64; c++) {
            double ref = 0, scale = 0;
            for (int k = 0; k < 16; k++) {
                ref += half(handover_a[r * 16 + k], 0) * half(handover_a[c * 16 + k], 0);
                scale += fabs(half(handover_a[r * 16 + k], 0) * half(handover_a[c * 16 + k], 0));
            }
            if (!(fabs((double)handover_d[r * 64 + c] - ref) <= 1e-5 * scale))
                fail_msg("D[%d][%d] = %g, expected %g", r, c, (double)handover_d[r * 64 + c], ref);
        }
}

/* The protocol gives A·Aᵀ; an arrive before the cp.async wait hands over chunks still in flight: the waiters run
 * once the phase completes, and their wgmma's read is reported. */
static void test_cp_async_handover(void **state)
{
    (void)state;
    for (int i = 0; i < 64 * 16; i++)
        handover_a[i] = random_half(0);
    run_handover(HANDOVER_WAIT);
    check_handover_product();
    expect_abort(run_handover_early, "cp.async has not completed (no cp.async wait_group before the barrier");
}

/* cp.async.mbarrier.arrive.noinc (the barrier counts the 128 producers): the copies land when a thread waits on the
 * barrier, and the consumers' fence after their wait is the one on the path from the copies to the wgmma (the
 * producer cannot fence after copies it never waits for). Without it, before the wait, or in the producer only, the
 * wgmma's read is reported; an arrive before the copy tracks none of it: the read meets copies in flight. */
static void test_cp_async_mbarrier_arrive(void **state)
{
    (void)state;
    for (int i = 0; i < 64 * 16; i++)
        handover_a[i] = random_half(0);
    memset(handover_d, 0, sizeof handover_d);
    run_handover(HANDOVER_NOINC);
    check_handover_product();
    const char *unfenced = "ran no af_fence_proxy_async after an mbarrier wait that saw them land";
    expect_abort(run_noinc_no_fence, unfenced);
    expect_abort(run_noinc_fence_early, unfenced);
    expect_abort(run_noinc_producer_fence, unfenced);
    expect_abort(run_noinc_before_copy, "cp.async has not completed");
}

static void run_plain(void)
{
    plain_params p = {0};
    AF_LAUNCH(plain_kernel, 1, 1, 1, 128, 0, 0, p);
}

static void test_needs_sm90_kernel(void **state)
{
    (void)state;
    expect_abort(run_plain, "outside a kernel defined with AF_KERNEL_SM90");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wgmma_ss_128b),
        cmocka_unit_test(test_wgmma_rs_and_btrans),
        cmocka_unit_test(test_wgmma_no_swizzle),
        cmocka_unit_test(test_breakage_wrong_swizzle_and_swapped_fragment),
        cmocka_unit_test(test_breakage_missing_proxy_fence),
        cmocka_unit_test(test_tma_boxes_and_phases),
        cmocka_unit_test(test_tma_encode_refusals),
        cmocka_unit_test(test_breakage_wrong_expect_tx),
        cmocka_unit_test(test_tma_over_ordinary_stores),
        cmocka_unit_test(test_attention_tile),
        cmocka_unit_test(test_accumulator_written_in_flight),
        cmocka_unit_test(test_rule_reports),
        cmocka_unit_test(test_named_barriers_ping_pong),
        cmocka_unit_test(test_named_barrier_reports),
        cmocka_unit_test(test_cp_async_handover),
        cmocka_unit_test(test_cp_async_mbarrier_arrive),
        cmocka_unit_test(test_needs_sm90_kernel),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
