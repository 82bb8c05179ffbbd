/* The CPU emulation of src/cuda/device.h against the PTX ISA definitions, written out here independently: mma
 * m16n8k16 fragments vs a plain matrix product, ldmatrix (x4, x2, .trans) on a known pattern, cp.async groups,
 * shuffles, ex2 and the cvt roundings, launch errors, the host runtime, and the rule checker (each broken kernel
 * runs in a forked child that must abort with the expected message). */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "cuda/device.h"

/* ---- Helpers independent of the emulation ---- */
static uint64_t rng_state = 0x9e3779b97f4a7c15ULL;

static double uniform(double lo, double hi)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return lo + (hi - lo) * (double)(rng_state >> 11) / 9007199254740992.0;
}

/* IEEE binary16 value of h (sign, 5-bit exponent with bias 15, 10-bit fraction). */
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

/* A random f16 (nonzero exponent, |x| in [2^-4, 4)) or bf16 (|x| in [2^-8, 16)) bit pattern. */
static uint16_t random_half(int bf16)
{
    uint16_t sign = uniform(0, 1) < 0.5 ? 0x8000 : 0;
    if (bf16)
        return (uint16_t)(sign | (uint16_t)((119 + (int)uniform(0, 12)) << 7) | (uint16_t)uniform(0, 128));
    return (uint16_t)(sign | (uint16_t)((11 + (int)uniform(0, 6)) << 10) | (uint16_t)uniform(0, 1024));
}

static float bits_to_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Runs fn in a child process; asserts that it aborted and that its stderr contains `expected`. */
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
    char text[8192];
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

/* ---- mma m16n8k16 ---- */
typedef struct {
    const uint16_t *a; /* per warp: A 16x16 row-major */
    const uint16_t *b; /* per warp: B 16x8, [k][n] */
    const float *c;    /* per warp: C 16x8 */
    float *d;          /* per warp: D 16x8 */
    int bf16;
    int a_by_ldmatrix; /* A through smem and ldmatrix_x4 (lane l: row l%16, column 8(l/16)) */
} mma_params;

AF_KERNEL(mma_kernel, mma_params, p, 64)
{
    int w = af_warp(), lane = af_lane(), g = lane >> 2, t = lane & 3;
    const uint16_t *A = p.a + w * 256, *B = p.b + w * 128;
    uint32_t a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    float d[4];
    /* PTX: A row = g for a0,a1,a4,a5 else g+8; col = 2t + (i&1) + 8 for a4..a7 */
    for (int i = 0; i < 8; i++) {
        int row = (i == 0 || i == 1 || i == 4 || i == 5) ? g : g + 8;
        int col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
        a[i / 2] |= (uint32_t)A[row * 16 + col] << (16 * (i & 1));
    }
    if (p.a_by_ldmatrix) {
        uint16_t *s = (uint16_t *)af_shared_memory() + w * 256;
        for (int e = lane; e < 256; e += 32)
            s[e] = A[e];
        af_syncthreads();
        af_ldmatrix_x4(a, s + (lane % 16) * 16 + 8 * (lane / 16));
    }
    for (int i = 0; i < 4; i++)
        b[i / 2] |= (uint32_t)B[(2 * t + (i & 1) + (i >= 2 ? 8 : 0)) * 8 + g] << (16 * (i & 1));
    for (int i = 0; i < 4; i++)
        d[i] = p.c[w * 128 + (g + (i >= 2 ? 8 : 0)) * 8 + 2 * t + (i & 1)];
    if (p.bf16)
        af_mma_16816_bf16(d, a, b);
    else
        af_mma_16816_f16(d, a, b);
    for (int i = 0; i < 4; i++)
        p.d[w * 128 + (g + (i >= 2 ? 8 : 0)) * 8 + 2 * t + (i & 1)] = d[i];
}

static void check_mma(int bf16, int a_by_ldmatrix)
{
    uint16_t a[2 * 256], b[2 * 128];
    float c[2 * 128], d[2 * 128];
    for (int i = 0; i < 2 * 256; i++)
        a[i] = random_half(bf16);
    for (int i = 0; i < 2 * 128; i++) {
        b[i] = random_half(bf16);
        c[i] = (float)uniform(-4, 4);
    }
    mma_params p = {a, b, c, d, bf16, a_by_ldmatrix};
    assert_int_equal(AF_LAUNCH(mma_kernel, 1, 1, 1, 64, 2 * 256 * 2, NULL, p), cudaSuccess);
    for (int w = 0; w < 2; w++) {
        for (int m = 0; m < 16; m++) {
            for (int n = 0; n < 8; n++) {
                double ref = c[w * 128 + m * 8 + n], scale = fabs(ref);
                for (int k = 0; k < 16; k++) {
                    double x = bf16 ? bf16_value(a[w * 256 + m * 16 + k]) : f16_value(a[w * 256 + m * 16 + k]);
                    double y = bf16 ? bf16_value(b[w * 128 + k * 8 + n]) : f16_value(b[w * 128 + k * 8 + n]);
                    ref += x * y;
                    scale += fabs(x * y);
                }
                double got = d[w * 128 + m * 8 + n];
                if (fabs(got - ref) > 2e-7 * scale)
                    fail_msg("%s warp %d D[%d][%d] = %.9g, product %.9g", bf16 ? "bf16" : "f16", w, m, n, got, ref);
            }
        }
    }
}

static void mma_f16_matches_product(void **state)
{
    (void)state;
    for (int rep = 0; rep < 5; rep++)
        check_mma(0, 0);
}

static void mma_bf16_matches_product(void **state)
{
    (void)state;
    for (int rep = 0; rep < 5; rep++)
        check_mma(1, 0);
}

static void ldmatrix_x4_gives_mma_a_fragment(void **state)
{
    (void)state;
    check_mma(0, 1);
    check_mma(1, 1);
}

/* ---- ldmatrix ---- */
typedef struct {
    int variant; /* 0 x4, 1 x4.trans, 2 x2, 3 x2.trans */
    uint32_t *out; /* [thread][4] */
} ldm_params;

/* Row r of matrix j is stored at 16-byte slot (5 * (8j + r) + 3) % 37: rows are neither contiguous nor ordered. */
static int row_slot(int j, int r) { return (5 * (8 * j + r) + 3) % 37; }
static uint16_t pattern(int j, int r, int c) { return (uint16_t)(0x1000 * (j + 1) + 0x100 * r + 0x10 * c + 7); }

AF_KERNEL(ldm_kernel, ldm_params, p, 64)
{
    uint16_t *s = (uint16_t *)af_shared_memory();
    if (AF_THREAD_IDX == 0)
        for (int j = 0; j < 4; j++)
            for (int r = 0; r < 8; r++)
                for (int c = 0; c < 8; c++)
                    s[row_slot(j, r) * 8 + c] = pattern(j, r, c);
    af_syncthreads();
    int lane = af_lane();
    const uint16_t *row = s + row_slot(lane / 8, lane % 8) * 8;
    uint32_t *r = p.out + AF_THREAD_IDX * 4;
    switch (p.variant) {
    case 0: af_ldmatrix_x4(r, row); break;
    case 1: af_ldmatrix_x4_trans(r, row); break;
    /* x2: lanes 16-31 give addresses that must be ignored (outside shared memory) */
    case 2: af_ldmatrix_x2(r, lane < 16 ? (const void *)row : (const void *)&p); break;
    default: af_ldmatrix_x2_trans(r, lane < 16 ? (const void *)row : (const void *)&p); break;
    }
}

static void ldmatrix_all_variants(void **state)
{
    (void)state;
    for (int variant = 0; variant < 4; variant++) {
        uint32_t out[64 * 4];
        memset(out, 0, sizeof out);
        ldm_params p = {variant, out};
        assert_int_equal(AF_LAUNCH(ldm_kernel, 1, 1, 1, 64, 37 * 16, NULL, p), cudaSuccess);
        int matrices = variant < 2 ? 4 : 2, trans = variant & 1;
        for (int thread = 0; thread < 64; thread++) {
            int l = thread % 32;
            for (int j = 0; j < 4; j++) {
                uint32_t expect = 0;
                if (j < matrices && !trans) /* row l/4, columns 2(l%4), 2(l%4)+1 */
                    expect = pattern(j, l / 4, 2 * (l % 4)) | (uint32_t)pattern(j, l / 4, 2 * (l % 4) + 1) << 16;
                if (j < matrices && trans) /* column l/4, rows 2(l%4), 2(l%4)+1 */
                    expect = pattern(j, 2 * (l % 4), l / 4) | (uint32_t)pattern(j, 2 * (l % 4) + 1, l / 4) << 16;
                if (out[thread * 4 + j] != expect)
                    fail_msg("variant %d thread %d register %d: 0x%08x, expected 0x%08x", variant, thread, j,
                             out[thread * 4 + j], expect);
            }
        }
    }
}

/* ---- cp.async ---- */
typedef struct {
    const unsigned char *src; /* 64 bytes, 16-byte aligned */
    unsigned char *out;       /* [stage][64]: shared memory as thread 0 sees it after each step */
} cp_params;

AF_KERNEL(cp_kernel, cp_params, p, 32)
{
    unsigned char *s = (unsigned char *)af_shared_memory();
    if (AF_THREAD_IDX == 0) {
        af_cp_async_16(s, p.src, 16);
        af_cp_async_commit(); /* group 0 */
        af_cp_async_16(s + 16, p.src + 16, 5);
        af_cp_async_commit(); /* group 1 */
        af_cp_async_16(s + 32, NULL, 0); /* zero fill; the source is not read */
        af_cp_async_commit(); /* group 2 */
        af_cp_async_16(s + 48, p.src + 48, 16); /* never committed: no wait_group completes it */
        memcpy(p.out, s, 64);
        af_cp_async_wait_2();
        memcpy(p.out + 64, s, 64);
        af_cp_async_wait_1();
        memcpy(p.out + 128, s, 64);
        af_cp_async_wait_0();
        memcpy(p.out + 192, s, 64);
    }
}

static void cp_async_groups_and_fill(void **state)
{
    (void)state;
    _Alignas(16) unsigned char src[64];
    unsigned char out[4 * 64];
    for (int i = 0; i < 64; i++)
        src[i] = (unsigned char)(i + 1);
    cp_params p = {src, out};
    assert_int_equal(AF_LAUNCH(cp_kernel, 1, 1, 1, 32, 64, NULL, p), cudaSuccess);
    for (int stage = 0; stage < 4; stage++) {
        for (int i = 0; i < 64; i++) {
            int chunk = i / 16, landed = chunk < stage; /* wait_2 lands group 0, wait_1 group 1, wait_0 group 2 */
            int expect = 0xff;                          /* shared memory starts as 0xff bytes */
            if (chunk == 0 && landed)
                expect = src[i];
            if (chunk == 1 && landed)
                expect = i - 16 < 5 ? src[i] : 0;
            if (chunk == 2 && landed)
                expect = 0;
            if (out[stage * 64 + i] != expect)
                fail_msg("after step %d byte %d is 0x%02x, expected 0x%02x", stage, i, out[stage * 64 + i], expect);
        }
    }
}

/* ---- shuffles ---- */
typedef struct {
    float *out; /* [mask index][thread] */
} shfl_params;

static const int shfl_masks[] = {1, 2, 16, 31, 33, 0}; /* 33: a source outside the warp */

AF_KERNEL(shfl_kernel, shfl_params, p, 64)
{
    float v = 1.5f * (float)AF_THREAD_IDX;
    for (int m = 0; m < 6; m++)
        p.out[m * 64 + AF_THREAD_IDX] = af_shfl_xor(v, shfl_masks[m]);
}

static void shfl_xor_exchanges_lanes(void **state)
{
    (void)state;
    float out[6 * 64];
    shfl_params p = {out};
    assert_int_equal(AF_LAUNCH(shfl_kernel, 1, 1, 1, 64, 0, NULL, p), cudaSuccess);
    for (int m = 0; m < 6; m++) {
        for (int thread = 0; thread < 64; thread++) {
            int lane = thread % 32, src = lane ^ shfl_masks[m];
            int from = src < 32 ? thread - lane + src : thread; /* outside the warp: the caller's own value */
            assert_true(out[m * 64 + thread] == 1.5f * (float)from);
        }
    }
}

/* af_warp_broadcast: every lane gets its warp's lane 0 value (each warp its own), also negative and large ones. */
typedef struct {
    int *out; /* [thread] */
} broadcast_params;

AF_KERNEL(broadcast_kernel, broadcast_params, p, 96)
{
    const int v = (AF_THREAD_IDX % 32 + 3) * (af_warp() == 1 ? -1 : 1000 * (af_warp() + 1));
    p.out[AF_THREAD_IDX] = af_warp_broadcast(v);
}

static void warp_broadcast_gives_lane_0(void **state)
{
    (void)state;
    int out[96];
    broadcast_params p = {out};
    assert_int_equal(AF_LAUNCH(broadcast_kernel, 1, 1, 1, 96, 0, NULL, p), cudaSuccess);
    for (int thread = 0; thread < 96; thread++) {
        const int warp = thread / 32;
        assert_int_equal(out[thread], 3 * (warp == 1 ? -1 : 1000 * (warp + 1)));
    }
}

/* af_shfl_int: each lane names any source lane of its warp (a rotation, lane 0 of the other half, its own lane,
 * a reversal) and gets that lane's int exactly (values beyond the 2^24 a float slot would hold). */
typedef struct {
    int *out; /* [pattern][thread] */
} shfl_int_params;

static int shfl_int_source(int pattern, int lane)
{
    switch (pattern) {
    case 0: return (lane + 5) % 32;
    case 1: return lane < 16 ? 16 : 0;
    case 2: return lane;
    default: return 31 - lane;
    }
}

static int shfl_int_value(int thread) { return (thread * 7919 + 1) * (thread % 2 ? -1 : 1) * 4099; }

AF_KERNEL(shfl_int_kernel, shfl_int_params, p, 64)
{
    for (int pattern = 0; pattern < 4; pattern++)
        p.out[pattern * 64 + AF_THREAD_IDX] =
            af_shfl_int(shfl_int_value(AF_THREAD_IDX), shfl_int_source(pattern, af_lane()));
}

static void shfl_int_takes_any_lane(void **state)
{
    (void)state;
    int out[4 * 64];
    shfl_int_params p = {out};
    assert_int_equal(AF_LAUNCH(shfl_int_kernel, 1, 1, 1, 64, 0, NULL, p), cudaSuccess);
    for (int pattern = 0; pattern < 4; pattern++)
        for (int thread = 0; thread < 64; thread++) {
            const int from = thread - thread % 32 + shfl_int_source(pattern, thread % 32);
            assert_int_equal(out[pattern * 64 + thread], shfl_int_value(from));
        }
}

/* ---- numbers ---- */
static void ex2_specials(void **state)
{
    (void)state;
    assert_true(af_ex2(-INFINITY) == 0.0f && !signbit(af_ex2(-INFINITY)));
    assert_true(isinf(af_ex2(INFINITY)) && af_ex2(INFINITY) > 0);
    assert_true(isnan(af_ex2(NAN)));
    assert_true(af_ex2(0.0f) == 1.0f && af_ex2(-0.0f) == 1.0f);
    assert_true(af_ex2(bits_to_float(0x00000001u)) == 1.0f); /* subnormal input flushed to zero */
    assert_true(af_ex2(1.0f) == 2.0f && af_ex2(10.0f) == 1024.0f && af_ex2(-1.0f) == 0.5f);
    assert_true(af_ex2(-126.0f) == 0x1p-126f);                /* smallest normal result stays */
    assert_true(af_ex2(-126.5f) == 0.0f && af_ex2(-140.0f) == 0.0f); /* subnormal results flushed */
    assert_true(isinf(af_ex2(128.0f)));
    assert_true(fabs(af_ex2(0.5f) - 1.41421356) < 2e-7);
}

static void pack_rounds_to_nearest_even(void **state)
{
    (void)state;
    /* f16: 1 + 2^-11 is halfway between 1 and 1 + 2^-10: to even (1); 1 + 3*2^-11: to even (1 + 2^-9) */
    assert_int_equal(af_pack_f16x2(1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f), 0x3c02u << 16 | 0x3c00u);
    assert_int_equal(af_pack_f16x2(-(1.0f + 0x1p-11f), 2.0f), 0x4000u << 16 | 0xbc00u);
    assert_int_equal(af_float_to_f16(65519.0f), 0x7bffu);       /* below the midpoint to 2^16: 65504 */
    assert_int_equal(af_float_to_f16(65520.0f), 0x7c00u);       /* the midpoint: to even, inf */
    assert_int_equal(af_float_to_f16(0x1p-25f), 0x0000u);       /* half the smallest subnormal: to even, 0 */
    assert_int_equal(af_float_to_f16(3 * 0x1p-25f), 0x0002u);   /* 1.5 subnormal units: to even, 2 */
    assert_int_equal(af_float_to_f16(-0x1p-24f), 0x8001u);
    assert_int_equal(af_float_to_f16(0x1p-14f - 0x1p-26f), 0x0400u); /* rounds up into the normals */
    /* bf16: 1 + 2^-8 halfway: to even (1); 1 + 3*2^-8: to even (1 + 2^-6) */
    assert_int_equal(af_pack_bf16x2(1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f), 0x3f82u << 16 | 0x3f80u);
    assert_int_equal(af_float_to_bf16(bits_to_float(0x7f7fffffu)), 0x7f80u); /* FLT_MAX rounds to inf */
    /* NaN stays NaN */
    uint32_t nan_pair = af_pack_f16x2(NAN, -NAN);
    assert_true((nan_pair & 0x7c00u) == 0x7c00u && (nan_pair & 0x3ffu) != 0);
    assert_true((nan_pair >> 16 & 0x7c00u) == 0x7c00u && (nan_pair >> 16 & 0x3ffu) != 0);
    uint32_t bnan = af_pack_bf16x2(bits_to_float(0x7f800001u), NAN);
    assert_true((bnan & 0x7f80u) == 0x7f80u && (bnan & 0x7fu) != 0 && (bnan >> 16 & 0x7fu) != 0);
    /* every non-NaN 16-bit value converts exactly and back */
    for (uint32_t h = 0; h < 65536; h++) {
        double fv = f16_value((uint16_t)h), bv = bf16_value((uint16_t)h);
        if (!isnan(fv)) {
            assert_true((double)af_f16_to_float((uint16_t)h) == fv);
            assert_int_equal(af_float_to_f16((float)fv), h);
        }
        if (!isnan(bv)) {
            assert_true((double)af_bf16_to_float((uint16_t)h) == bv);
            assert_int_equal(af_float_to_bf16((float)bv), h);
        }
    }
}

/* ---- launches ---- */
typedef struct {
    int *visits;   /* per block: times run */
    int *order;    /* per block: position in the launch */
    int *counter;
    int *dims;     /* [block][7]: block dim, grid dims, block index */
} grid_params;

AF_KERNEL(grid_kernel, grid_params, p, 128)
{
    int block = AF_BLOCK_IDX_X + AF_GRID_DIM_X * (AF_BLOCK_IDX_Y + AF_GRID_DIM_Y * AF_BLOCK_IDX_Z);
    af_syncthreads();
    if (AF_THREAD_IDX == AF_BLOCK_DIM - 1) {
        p.visits[block]++;
        p.order[block] = (*p.counter)++;
        int *d = p.dims + block * 7;
        d[0] = AF_BLOCK_DIM;
        d[1] = AF_GRID_DIM_X, d[2] = AF_GRID_DIM_Y, d[3] = AF_GRID_DIM_Z;
        d[4] = AF_BLOCK_IDX_X, d[5] = AF_BLOCK_IDX_Y, d[6] = AF_BLOCK_IDX_Z;
    }
}

static int run_grid(const char *seed, int order[12])
{
    int visits[12] = {0}, counter = 0, dims[12 * 7];
    setenv("ATTNFORGE_EMU_SEED", seed, 1);
    grid_params p = {visits, order, &counter, dims};
    cudaError_t err = AF_LAUNCH(grid_kernel, 3, 2, 2, 96, 0, NULL, p);
    unsetenv("ATTNFORGE_EMU_SEED");
    assert_int_equal(err, cudaSuccess);
    int identity = 1;
    for (int b = 0; b < 12; b++) {
        assert_int_equal(visits[b], 1);
        const int expect[7] = {96, 3, 2, 2, b % 3, b / 3 % 2, b / 6};
        assert_memory_equal(dims + b * 7, expect, sizeof expect);
        identity &= order[b] == b;
    }
    return identity;
}

static void grid_runs_every_block_once_in_seeded_order(void **state)
{
    (void)state;
    int order1[12], order2[12], again[12];
    int identity1 = run_grid("1", order1), identity2 = run_grid("2", order2);
    run_grid("1", again);
    assert_memory_equal(order1, again, sizeof again); /* a seed gives one order */
    assert_false(identity1 && identity2);
    assert_true(memcmp(order1, order2, sizeof order1) != 0);
}

typedef struct {
    int *ran;
} count_params;

AF_KERNEL(count_kernel, count_params, p, 64)
{
    if (AF_THREAD_IDX == 0)
        (*p.ran)++;
}

AF_KERNEL(big_kernel, count_params, p, 1024)
{
    af_syncthreads();
    if (AF_THREAD_IDX == 1023)
        (*p.ran)++;
}

static void launch_errors_run_nothing(void **state)
{
    (void)state;
    int ran = 0;
    count_params p = {&ran};
    assert_int_equal(AF_LAUNCH(count_kernel, 1, 1, 1, 0, 0, NULL, p), cudaErrorInvalidConfiguration);
    assert_int_equal(AF_LAUNCH(big_kernel, 1, 1, 1, 2048, 0, NULL, p), cudaErrorInvalidConfiguration);
    assert_int_equal(AF_LAUNCH(count_kernel, 1, 1, 1, 48, 0, NULL, p), cudaErrorInvalidValue);
    assert_int_equal(AF_LAUNCH(count_kernel, 1, 1, 1, 96, 0, NULL, p), cudaErrorInvalidValue); /* > bound 64 */
    assert_int_equal(AF_LAUNCH(count_kernel, 0, 1, 1, 32, 0, NULL, p), cudaErrorInvalidConfiguration);
    assert_int_equal(AF_LAUNCH(count_kernel, 1, 65536, 1, 32, 0, NULL, p), cudaErrorInvalidConfiguration);
    assert_int_equal(AF_LAUNCH(count_kernel, 1, 1, 65536, 32, 0, NULL, p), cudaErrorInvalidConfiguration);
    assert_int_equal(AF_LAUNCH(count_kernel, 1, 1, 1, 32, 48 * 1024 + 16, NULL, p), cudaErrorInvalidValue);
    assert_int_equal(ran, 0);
    /* a failed launch also records its error, as cudaLaunchKernel does; the caller's cuda_fail clears it */
    assert_int_equal(cudaGetLastError(), cudaErrorInvalidValue);
    assert_int_equal(cudaGetLastError(), cudaSuccess);

    assert_int_equal(AF_SET_MAX_SMEM(count_kernel, 227 * 1024 + 1), cudaErrorInvalidValue);
    assert_int_equal(cudaGetLastError(), cudaErrorInvalidValue);
    assert_int_equal(AF_SET_MAX_SMEM(count_kernel, 100 * 1024), cudaSuccess);
    assert_int_equal(AF_LAUNCH(count_kernel, 1, 1, 1, 32, 100 * 1024, NULL, p), cudaSuccess);
    assert_int_equal(AF_LAUNCH(count_kernel, 1, 1, 1, 32, 100 * 1024 + 16, NULL, p), cudaErrorInvalidValue);
    assert_int_equal(AF_LAUNCH(big_kernel, 2, 1, 1, 1024, 0, NULL, p), cudaSuccess);
    assert_int_equal(ran, 3);

    /* a launch reports its own status: an earlier call's error that nobody took stays for its caller */
    (void)cudaGetLastError();
    assert_int_equal(cudaMemcpy(&ran, &ran, sizeof ran, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
    assert_int_equal(AF_LAUNCH(count_kernel, 1, 1, 1, 32, 0, NULL, p), cudaSuccess);
    assert_int_equal(ran, 4);
    assert_int_equal(cudaGetLastError(), cudaErrorInvalidValue);
    assert_int_equal(AF_LAUNCH(count_kernel, 1, 1, 1, 32, 0, NULL, p), cudaSuccess);

    setenv("ATTNFORGE_EMU_CUDA", "nodriver", 1);
    assert_int_equal(AF_LAUNCH(count_kernel, 1, 1, 1, 32, 0, NULL, p), cudaErrorInsufficientDriver);
    unsetenv("ATTNFORGE_EMU_CUDA");
    assert_int_equal(ran, 5);
}

/* Host threads launch at the same time: each fiber view and block is the calling thread's own. */
static void *launch_many(void *arg)
{
    int *ran = (int *)arg;
    count_params p = {ran};
    for (int i = 0; i < 10; i++)
        if (AF_LAUNCH(big_kernel, 3, 1, 1, 1024, 0, NULL, p) != cudaSuccess)
            return NULL;
    return arg;
}

static void concurrent_host_threads(void **state)
{
    (void)state;
    pthread_t threads[2];
    int ran[2] = {0, 0};
    for (int i = 0; i < 2; i++)
        assert_int_equal(pthread_create(&threads[i], NULL, launch_many, &ran[i]), 0);
    for (int i = 0; i < 2; i++) {
        void *result = NULL;
        assert_int_equal(pthread_join(threads[i], &result), 0);
        assert_ptr_equal(result, &ran[i]);
        assert_int_equal(ran[i], 30);
    }
}

/* ---- host runtime ---- */
static void runtime_memory_and_attributes(void **state)
{
    (void)state;
    void *d = NULL;
    assert_int_equal(cudaMalloc(&d, 1000), cudaSuccess);
    assert_true(((uintptr_t)d % 256) == 0);
    struct cudaPointerAttributes attr;
    assert_int_equal(cudaPointerGetAttributes(&attr, (char *)d + 999), cudaSuccess);
    assert_int_equal(attr.type, cudaMemoryTypeDevice);
    assert_int_equal(attr.device, 0);
    int host[4] = {1, 2, 3, 4}, back[4] = {0};
    assert_int_equal(cudaPointerGetAttributes(&attr, host), cudaSuccess);
    assert_int_equal(attr.type, cudaMemoryTypeUnregistered);
    assert_int_equal(cudaMemcpyAsync(d, host, sizeof host, cudaMemcpyHostToDevice, NULL), cudaSuccess);
    assert_int_equal(cudaMemsetAsync((char *)d + 4, 0, 4, NULL), cudaSuccess);
    assert_int_equal(cudaMemcpy(back, d, sizeof back, cudaMemcpyDeviceToHost), cudaSuccess);
    assert_int_equal(back[0], 1);
    assert_int_equal(back[1], 0);
    assert_int_equal(back[3], 4);
    /* device ranges are checked: past the end, a host pointer as the device side, a bad kind */
    assert_int_equal(cudaMemcpy((char *)d + 998, host, 4, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
    assert_int_equal(cudaMemcpy(back, host, 4, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
    assert_int_equal(cudaMemcpy(back, d, 4, (enum cudaMemcpyKind)7), cudaErrorInvalidMemcpyDirection);
    assert_int_equal(cudaMemsetAsync(host, 0, 4, NULL), cudaErrorInvalidValue);
    assert_int_equal(cudaGetLastError(), cudaErrorInvalidValue);
    assert_int_equal(cudaGetLastError(), cudaSuccess);
    assert_int_equal(cudaFree((char *)d + 16), cudaErrorInvalidValue);
    assert_int_equal(cudaFreeAsync(d, NULL), cudaSuccess);
    assert_int_equal(cudaPointerGetAttributes(&attr, d), cudaSuccess);
    assert_int_equal(attr.type, cudaMemoryTypeUnregistered);
    assert_int_equal(cudaMallocAsync(&d, 0, NULL), cudaSuccess);
    assert_null(d);
    assert_int_equal(cudaFree(NULL), cudaSuccess);

    int v = 0, count = 0, device = -1;
    assert_int_equal(cudaGetDeviceCount(&count), cudaSuccess);
    assert_int_equal(count, 1);
    assert_int_equal(cudaSetDevice(0), cudaSuccess);
    assert_int_equal(cudaSetDevice(1), cudaErrorInvalidDevice);
    assert_int_equal(cudaGetDevice(&device), cudaSuccess);
    assert_int_equal(device, 0);
    assert_int_equal(cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
    assert_int_equal(v, 9);
    assert_int_equal(cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMinor, 0), cudaSuccess);
    assert_int_equal(v, 0);
    assert_int_equal(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0), cudaSuccess);
    assert_int_equal(v, 232448);
    assert_int_equal(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
    assert_int_equal(v, 8);
    setenv("ATTNFORGE_EMU_SM_COUNT", "132", 1);
    assert_int_equal(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
    assert_int_equal(v, 132);
    unsetenv("ATTNFORGE_EMU_SM_COUNT");
    assert_int_equal(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 1), cudaErrorInvalidDevice);
    assert_int_equal(cudaDriverGetVersion(&v), cudaSuccess);
    assert_int_equal(v, 13000);
    assert_int_equal(cudaRuntimeGetVersion(&v), cudaSuccess);
    assert_int_equal(v, 13000);
    assert_int_equal(cudaStreamSynchronize(NULL), cudaSuccess);
    assert_string_equal(cudaGetErrorName(cudaErrorInvalidConfiguration), "cudaErrorInvalidConfiguration");
    assert_string_equal(cudaGetErrorString(cudaErrorMemoryAllocation), "out of memory");
    assert_int_equal(cudaGetLastError(), cudaErrorInvalidDevice);
}

static void runtime_without_driver_or_device(void **state)
{
    (void)state;
    int count = -1, v = -1;
    void *d = NULL;
    setenv("ATTNFORGE_EMU_CUDA", "nodriver", 1);
    assert_int_equal(cudaGetDeviceCount(&count), cudaErrorInsufficientDriver);
    assert_int_equal(count, 0);
    assert_int_equal(cudaMalloc(&d, 64), cudaErrorInsufficientDriver);
    assert_int_equal(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 0), cudaErrorInsufficientDriver);
    assert_int_equal(cudaDriverGetVersion(&v), cudaSuccess); /* CUDA: 0 when no driver is installed */
    assert_int_equal(v, 0);
    setenv("ATTNFORGE_EMU_CUDA", "nodevice", 1);
    assert_int_equal(cudaGetDeviceCount(&count), cudaErrorNoDevice);
    assert_int_equal(cudaSetDevice(0), cudaErrorNoDevice);
    assert_int_equal(cudaDriverGetVersion(&v), cudaSuccess);
    assert_int_equal(v, 13000);
    unsetenv("ATTNFORGE_EMU_CUDA");
    assert_int_equal(cudaGetLastError(), cudaErrorNoDevice);
    assert_int_equal(cudaGetDeviceCount(&count), cudaSuccess);
}

/* ---- the rule checker: broken kernels abort ---- */
typedef struct {
    const unsigned char *src;
    int variant;
} broken_params;

AF_KERNEL(divergent_barrier_kernel, broken_params, p, 64)
{
    if (AF_THREAD_IDX < 16)
        af_syncthreads();
}

/* Warp 0 copies a 16x16 tile into shared memory; warp 1 reads it with ldmatrix.
 * variant 0: correct (wait, barrier, read); 1: no barrier after the wait; 2: no wait; 3: warp 1 reads, then warp 0
 * (held back by shuffles, which yield) overwrites the tile with no barrier between (WAR). */
AF_KERNEL(tile_kernel, broken_params, p, 64)
{
    char *s = af_shared_memory();
    int thread = AF_THREAD_IDX, lane = af_lane();
    uint32_t r[4];
    if (p.variant == 3) {
        if (af_warp() == 1)
            af_ldmatrix_x4(r, s + (lane % 16) * 32 + 16 * (lane / 16));
        if (af_warp() == 0) {
            for (int i = 0; i < 4; i++)
                (void)af_shfl_xor(1.0f, 1);
            af_cp_async_16(s + thread * 16, p.src + thread * 16, 16);
            af_cp_async_commit();
            af_cp_async_wait_0();
        }
        return;
    }
    if (af_warp() == 0) {
        af_cp_async_16(s + thread * 16, p.src + thread * 16, 16);
        af_cp_async_commit();
        if (p.variant != 2)
            af_cp_async_wait_0();
    }
    if (p.variant != 1)
        af_syncthreads();
    if (af_warp() == 1)
        af_ldmatrix_x4(r, s + (lane % 16) * 32 + 16 * (lane / 16));
    if (p.variant == 2)
        af_syncthreads(); /* keeps warp 0 (and its copies in flight) alive until warp 1 has read */
}

AF_KERNEL(mixed_collectives_kernel, broken_params, p, 32)
{
    uint32_t r[4];
    if (af_lane() < 16)
        af_ldmatrix_x4(r, af_shared_memory());
    else
        (void)af_shfl_xor(1.0f, 1);
}

AF_KERNEL(lane_exits_kernel, broken_params, p, 32)
{
    if (af_lane() == 5)
        return;
    (void)af_shfl_xor(1.0f, 1);
}

AF_KERNEL(misaligned_kernel, broken_params, p, 32)
{
    uint32_t r[2];
    af_ldmatrix_x2(r, af_shared_memory() + 8 + 16 * af_lane());
}

static _Alignas(16) unsigned char tile_source[64 * 16];

static void launch_broken(int which, int variant)
{
    broken_params p = {tile_source, variant};
    cudaError_t err = cudaSuccess;
    switch (which) {
    case 0: err = AF_LAUNCH(divergent_barrier_kernel, 1, 1, 1, 64, 0, NULL, p); break;
    case 1: err = AF_LAUNCH(tile_kernel, 2, 1, 1, 64, 1024, NULL, p); break;
    case 2: err = AF_LAUNCH(mixed_collectives_kernel, 1, 1, 1, 32, 1024, NULL, p); break;
    case 3: err = AF_LAUNCH(lane_exits_kernel, 1, 1, 1, 32, 0, NULL, p); break;
    default: err = AF_LAUNCH(misaligned_kernel, 1, 1, 1, 32, 1024, NULL, p); break;
    }
    if (err != cudaSuccess)
        fprintf(stderr, "launch failed: %s\n", cudaGetErrorName(err));
}

static void run_divergent_barrier(void) { launch_broken(0, 0); }
static void run_missing_barrier(void) { launch_broken(1, 1); }
static void run_missing_wait(void) { launch_broken(1, 2); }
static void run_overwrite_while_read(void) { launch_broken(1, 3); }
static void run_mixed_collectives(void) { launch_broken(2, 0); }
static void run_lane_exits(void) { launch_broken(3, 0); }
static void run_misaligned(void) { launch_broken(4, 0); }

static void correct_tile_kernel_passes(void **state)
{
    (void)state;
    broken_params p = {tile_source, 0};
    for (int seed = 0; seed < 4; seed++) {
        char text[16];
        snprintf(text, sizeof text, "%d", seed);
        setenv("ATTNFORGE_EMU_SEED", text, 1);
        assert_int_equal(AF_LAUNCH(tile_kernel, 2, 1, 1, 64, 1024, NULL, p), cudaSuccess);
    }
    unsetenv("ATTNFORGE_EMU_SEED");
}

/* A launch reports its own status: a stale error left by earlier code neither fails it nor is cleared by it, and a
 * bad configuration fails it even when nothing was pending. */
static void launch_reports_its_own_status(void **state)
{
    (void)state;
    broken_params p = {tile_source, 0};
    assert_int_equal(cudaSetDevice(7), cudaErrorInvalidDevice);   /* the caller's own failure, still pending */
    assert_int_equal(AF_LAUNCH(tile_kernel, 2, 1, 1, 64, 1024, NULL, p), cudaSuccess);
    assert_int_equal(cudaGetLastError(), cudaErrorInvalidDevice);   /* left for the caller to read */
    assert_int_equal(AF_LAUNCH(tile_kernel, 2, 1, 1, 4096, 1024, NULL, p), cudaErrorInvalidConfiguration);
    (void)cudaGetLastError();
}

static void checker_catches_broken_kernels(void **state)
{
    (void)state;
    expect_abort(run_divergent_barrier, "deadlock: no thread can run; 16 of 64 threads wait at af_syncthreads");
    expect_abort(run_missing_barrier, "race: af_ldmatrix_x4 by warp 1 reads shared bytes");
    expect_abort(run_missing_wait, "is in flight (no cp.async wait_group completed it)");
    expect_abort(run_overwrite_while_read, "cp.async overwrites shared bytes");
    expect_abort(run_mixed_collectives, "lanes of warp 0 meet different collectives");
    expect_abort(run_lane_exits, "of its warp");
    expect_abort(run_misaligned, "is not 16-byte aligned");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(mma_f16_matches_product),
        cmocka_unit_test(mma_bf16_matches_product),
        cmocka_unit_test(ldmatrix_x4_gives_mma_a_fragment),
        cmocka_unit_test(ldmatrix_all_variants),
        cmocka_unit_test(cp_async_groups_and_fill),
        cmocka_unit_test(shfl_xor_exchanges_lanes),
        cmocka_unit_test(warp_broadcast_gives_lane_0),
        cmocka_unit_test(shfl_int_takes_any_lane),
        cmocka_unit_test(ex2_specials),
        cmocka_unit_test(pack_rounds_to_nearest_even),
        cmocka_unit_test(grid_runs_every_block_once_in_seeded_order),
        cmocka_unit_test(launch_reports_its_own_status),
        cmocka_unit_test(launch_errors_run_nothing),
        cmocka_unit_test(concurrent_host_threads),
        cmocka_unit_test(runtime_memory_and_attributes),
        cmocka_unit_test(runtime_without_driver_or_device),
        cmocka_unit_test(correct_tile_kernel_passes),
        cmocka_unit_test(checker_catches_broken_kernels),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
