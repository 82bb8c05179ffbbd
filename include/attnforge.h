/* attnforge — exact scaled-dot-product attention with a FlashAttention-4-style CPU kernel.
 *
 * One public header. Every function that can fail returns an af_status (0 = AF_OK, negative = error);
 * af_last_error() then gives a thread-local message naming the argument and the rule. On failure nothing
 * has been written to any output. */
#ifndef ATTNFORGE_H
#define ATTNFORGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define AF_VERSION_MAJOR 0
#define AF_VERSION_MINOR 3
#define AF_VERSION_PATCH 0
#define AF_VERSION_STRING "0.3.0"

#if defined(_WIN32)
#define AF_API
#else
#define AF_API __attribute__((visibility("default")))
#endif

/* ---------------------------------------------------------------- status codes */
typedef enum {
    AF_OK = 0,
    AF_ERR_INVALID_ARGUMENT = -1,   /* an argument breaks a rule of the call (shape, stride, NULL, ...) */
    AF_ERR_UNSUPPORTED = -2,        /* valid SDPA, but outside what attnforge runs (dtype combo, dropout, ...) */
    AF_ERR_NO_MEMORY = -3,          /* an allocation failed; nothing was written */
    AF_ERR_RUNTIME_UNAVAILABLE = -4,/* a backend (e.g. the CUDA one) cannot be loaded */
    AF_ERR_PARSE = -5,              /* malformed JSON or a document that breaks its format */
    AF_ERR_IO = -6,                 /* a file could not be read or written */
    AF_ERR_PLAN_MISMATCH = -7,      /* a call does not match the prepared plan */
    AF_ERR_NOT_PREPARED = -8,       /* a provider was used before prepare() succeeded */
    AF_ERR_INTERNAL = -9            /* a bug: please report it */
} af_status;

AF_API const char *af_status_name(af_status status);   /* "AF_ERR_INVALID_ARGUMENT", ... */
AF_API const char *af_last_error(void);                /* thread-local message of the last failed call; "" if none */
AF_API const char *af_version(void);                   /* AF_VERSION_STRING of the library actually linked */

/* ---------------------------------------------------------------- tensors */
#define AF_MAX_DIMS 8

/* int32: lengths, pages. The float8 formats (af_flash_attn's K/V, or all of q/k/v; never out):
 * AF_F8E4M3 is float8_e4m3fn (bias 7, max 448, no infinity, NaN = S.1111.111), AF_F8E5M2 float8_e5m2 (bias 15,
 * max 57344, IEEE infinities and NaNs). */
typedef enum { AF_F32 = 0, AF_F16 = 1, AF_BF16 = 2, AF_BOOL = 3, AF_I32 = 4, AF_F8E4M3 = 5, AF_F8E5M2 = 6 } af_dtype;

/* "float32", "float16", "bfloat16", "bool", "int32", "float8_e4m3fn", "float8_e5m2" */
AF_API const char *af_dtype_name(af_dtype dtype);
AF_API size_t af_dtype_size(af_dtype dtype);           /* bytes per element; 0 for an unknown dtype */

typedef enum { AF_DEVICE_CPU = 0, AF_DEVICE_CUDA = 1 } af_device_type;

typedef struct {                 /* where a tensor's data lives; zero-initialised = the CPU */
    af_device_type type;
    int index;                   /* CUDA device ordinal (0 for the CPU) */
} af_device;

typedef struct {                 /* a strided view, like a torch.Tensor */
    void *data;                  /* host memory, or device memory of `device` */
    af_dtype dtype;
    int ndim;
    int64_t shape[AF_MAX_DIMS];
    int64_t strides[AF_MAX_DIMS];/* in elements, like torch.Tensor.stride(); may be 0 (broadcast), never negative */
    af_device device;            /* zero = CPU */
} af_tensor;

/* A contiguous (row-major) view of `data` with the given shape. */
AF_API af_tensor af_tensor_contiguous(void *data, af_dtype dtype, int ndim, const int64_t *shape);

/* ---------------------------------------------------------------- CUDA workspace from the caller's allocator
 * Some CUDA calls need device memory beyond their tensors (copies of q/k/v the tensor cores cannot read in place,
 * split-KV partial results). It comes from attnforge's own stream-ordered pool on each device unless the call names
 * an allocator: a caller that has one (PyTorch's caching allocator, RMM, a serving engine's arena) passes it so that
 * memory it already holds serves attnforge too and stays in its accounting (docs/CUDA.md, "Workspace"). */
typedef struct {
    /* `bytes` (> 0) of memory of CUDA device `device`, 256-byte aligned, for work enqueued on `stream` (the call's
     * cudaStream_t); NULL when it cannot (the call then fails with AF_ERR_NO_MEMORY naming the workspace, and writes
     * nothing). Runs on the calling thread inside the call, with `device` current, at most once a call; under a
     * stream capture of the caller's it runs during the capture, so it must not synchronise. */
    void *(*alloc)(size_t bytes, int device, void *stream, void *user);
    /* Takes back what alloc gave, once the call's work that uses it is enqueued on `stream` (not run): like
     * cudaFreeAsync, the memory may be reused only by work ordered after it on `stream`, as PyTorch's caching
     * allocator and cudaMallocAsync pools do. Exactly once for each pointer alloc returned, also when the call fails. */
    void (*free)(void *ptr, size_t bytes, int device, void *stream, void *user);
    void *user;                  /* handed to both */
} af_cuda_allocator;

/* ---------------------------------------------------------------- one SDPA call */
typedef struct {                 /* torch.nn.functional.scaled_dot_product_attention's arguments */
    const af_tensor *query, *key, *value;  /* (Bq,Hq,L,E), (Bk,Hk,S,E), (Bv,Hv,S,Ev): batch and head sizes
                                              broadcast as PyTorch's (equal or 1; enable_gqa: Hk, Hv divide Hq;
                                              docs/API.md, "The broadcasting rule"), a size-1 dim read with stride 0 */
    const af_tensor *attn_mask;            /* NULL, AF_BOOL (true = attend) or additive in query's dtype,
                                              broadcastable to the scores' (B of q·k, H of q·k, L, S), not beyond */
    double dropout_p;                      /* must be 0 */
    bool is_causal;                        /* top-left aligned, as in PyTorch: row i sees keys j <= i */
    bool has_scale; double scale;          /* default 1/sqrt(E) */
    bool enable_gqa;
    bool causal_bottom_right;              /* FlashAttention's causal: row i sees keys j <= i + S - L.
                                              Explicit option of its own; never combined with is_causal. */
    void *stream;                          /* CUDA tensors: the cudaStream_t the call is enqueued on (NULL = the
                                              legacy default stream); ignored on the CPU */
    const af_cuda_allocator *workspace;    /* CUDA tensors: where scratch memory comes from (NULL = attnforge's own
                                              pool); ignored on the CPU */
} af_sdpa_args;                  /* zero-initialised = SDPA's defaults */

/* out (B,H,L,Ev), the broadcast batch and heads, in query's dtype, any non-overlapping strides; lse NULL or f32
 * (B,H,L), natural log.
 * Rows that can see no key get out = 0 and lse = -inf.
 * The call runs where its tensors live: all on the CPU, or all on one CUDA device (else AF_ERR_INVALID_ARGUMENT
 * naming the tensors). On CUDA every argument is checked on the host before anything is enqueued on
 * args->stream; the call returns once the work is enqueued (asynchronous, like any CUDA operation). A CUDA call
 * needs libattnforge_cuda.so, a driver and a GPU, else AF_ERR_RUNTIME_UNAVAILABLE says which is missing. */
AF_API af_status af_sdpa(const af_sdpa_args *args, af_tensor *out, af_tensor *lse);

/* The plain reference: double accumulation, one row at a time. Slow; for tests and `attnforge verify`. */
AF_API af_status af_sdpa_reference(const af_sdpa_args *args, af_tensor *out, af_tensor *lse);

/* ---------------------------------------------------------------- FlashAttention-style calls
 * FlashAttention-4's forward semantics (flash_attn_func / flash_attn_varlen_func): NHD layouts, bottom-right aligned
 * causality and sliding windows, softcap, a learned sink per head, variable-length and paged K/V. af_sdpa's meaning
 * is unchanged; this is a second entry point over the same kernels. docs/API.md states every rule. */
/* A window side with no limit (FlashAttention-4's None). Every other value of window_left / window_right is a literal
 * offset from the diagonal, negative too: (AF_WINDOW_UNBOUNDED, -1) sees the keys up to one before the diagonal. */
#define AF_WINDOW_UNBOUNDED INT64_MAX

typedef struct {
    const af_tensor *query;          /* (B, Lq, Hq, E); varlen: (total_q, Hq, E) */
    const af_tensor *key;            /* (B, S, Hkv, E); varlen: (total_k, Hkv, E);
                                        paged: (num_pages, page_size, Hkv, E) */
    const af_tensor *value;          /* as key, with head dim Ev */
    bool has_scale; double scale;    /* default 1/sqrt(E) */
    bool causal;                     /* bottom-right aligned: row i sees keys j <= i + S - Lq (window right = 0) */
    bool has_window;                 /* false: no window (FA4's window_size=(None, None)) */
    int64_t window_left, window_right;   /* FA4's meaning: literal offsets, negative ones too; AF_WINDOW_UNBOUNDED
                                            (FA4's None) = no limit on that side. Row i sees keys
                                            i + S - Lq - left <= j <= i + S - Lq + right. Both sides bounded with
                                            left + right < 0: no window (FA4's rule). Before 0.2, -1 = unbounded. */
    double softcap;                  /* 0 = off; > 0: s <- softcap·tanh(s / softcap) on the scaled score */
    const af_tensor *learnable_sink; /* NULL or (Hq,) f32/f16/bf16: one logit per query head, in the denominator only */
    const af_tensor *cu_seqlens_q;   /* varlen: int32 (B + 1,) prefix sums over query rows, else NULL */
    const af_tensor *cu_seqlens_k;   /* varlen: int32 (B + 1,) prefix sums over keys, else NULL */
    int64_t max_seqlen_q, max_seqlen_k;  /* varlen: bounds on the sequences' lengths */
    const af_tensor *seqused_k;      /* NULL or int32 (B,): keys used by each sequence (paged K/V needs it) */
    const af_tensor *page_table;     /* paged K/V: int32 (B, max_pages) page indices, else NULL */
    void *stream;                    /* as af_sdpa_args.stream */
    const af_cuda_allocator *workspace;  /* as af_sdpa_args.workspace */
    /* float8 K/V only (FA3/FA4's descales): NULL (= 1) or f32 (B, Hkv). Scores use scale·(q·k)·q_descale·k_descale,
     * the output sum_j p_j·v_j·v_descale, each at the (batch, kv head) the row reads. */
    const af_tensor *q_descale, *k_descale, *v_descale;
    /* FlexAttention-style mods (af_flex_attn's programs, declared below), CPU only; NULL = none. Indices are the
     * sequence's own: b the sequence, h the query head, q_idx its row, kv_idx the key's position in it (paged K/V:
     * logical). As FA4: a mask_mod replaces causal and window_size (they are ignored with it), and softcap and
     * score_mod exclude each other. */
    const struct af_mod_program *score_mod, *mask_mod;
} af_flash_args;                     /* zero-initialised = plain attention with FA4's defaults */

/* out: query's shape with head dim Ev, in query's dtype (float8 queries: f32, f16 or bf16, as asked); lse NULL or
 * f32 (B, Hq, Lq) / varlen (Hq, total_q), natural log. Rows that see no key (and no sink): out = 0, lse = -inf. */
AF_API af_status af_flash_attn(const af_flash_args *args, af_tensor *out, af_tensor *lse);
/* The plain reference of af_flash_attn: double accumulation, one row at a time. For tests and verify. */
AF_API af_status af_flash_attn_reference(const af_flash_args *args, af_tensor *out, af_tensor *lse);

/* ---------------------------------------------------------------- Programmable attention (FlexAttention's mods)
 * A score_mod or mask_mod is a small elementwise program the kernels evaluate inside their tiles, over the keys of
 * one query row at a time, vectorised: no compiler, no callback per score (docs/API.md, "Programmable attention").
 * Registers are vectors over those keys, each float32 or int32 (booleans are int32 0 / 1). Registers 0-4 are the
 * inputs: the scaled score (float32; a mask_mod has none), b, h (the query head), q_idx and kv_idx (int32). The
 * program is in SSA form: instruction i writes register 5 + i, reading only registers below its own. The last
 * instruction's register is the result: float32 for a score_mod, int32 (nonzero: the key is attended) for a
 * mask_mod. Binary operations take two registers of one type and give that type, except the comparisons (int32). */
typedef enum {
    AF_MOD_CONST_F32 = 0, AF_MOD_CONST_I32,   /* imm (an integral value for int32) */
    AF_MOD_ADD, AF_MOD_SUB, AF_MOD_MUL,        /* float32 or int32, wrapping */
    AF_MOD_DIV,                                /* float32 */
    AF_MOD_FLOORDIV, AF_MOD_MOD,               /* Python's // and % (the remainder takes the divisor's sign);
                                                  int32: x // 0 and x % 0 give 0 */
    AF_MOD_MIN, AF_MOD_MAX,                    /* float32 (NaN wins, as torch.minimum) or int32 */
    AF_MOD_POW,                                /* float32 */
    AF_MOD_NEG, AF_MOD_ABS, AF_MOD_SIGN,       /* float32 or int32 */
    AF_MOD_FLOOR, AF_MOD_CEIL, AF_MOD_ROUND,   /* float32; round: half to even, as torch.round */
    AF_MOD_EXP, AF_MOD_LOG, AF_MOD_SQRT, AF_MOD_RSQRT, AF_MOD_TANH, AF_MOD_SIGMOID, AF_MOD_ERF,
    AF_MOD_SIN, AF_MOD_COS, AF_MOD_TAN,        /* float32 */
    AF_MOD_LT, AF_MOD_LE, AF_MOD_GT, AF_MOD_GE, AF_MOD_EQ, AF_MOD_NE,   /* -> int32 0 / 1 */
    AF_MOD_AND, AF_MOD_OR, AF_MOD_XOR,         /* int32, bitwise (logical on 0 / 1) */
    AF_MOD_NOT,                                /* int32: 1 where 0, else 0 */
    AF_MOD_WHERE,                              /* in[0] int32 condition ? in[1] : in[2] (one type) */
    AF_MOD_TO_F32, AF_MOD_TO_I32,              /* int32 -> float32; float32 -> int32 toward zero (torch's .to) */
    AF_MOD_LOAD,                               /* aux tensor `aux` at the int32 indices in[0 .. ndim): float32 from
                                                  a float32/float16/bfloat16 tensor, int32 from int32/bool */
    AF_MOD_OP_COUNT
} af_mod_op;

typedef struct {
    int32_t op;        /* af_mod_op */
    int32_t in[4];     /* operand registers, as many as the operation takes (LOAD: one per tensor dimension) */
    int32_t aux;       /* LOAD: which of the program's aux tensors */
    double imm;        /* CONST_*: the value */
} af_mod_instr;

typedef struct af_mod_program {
    const af_mod_instr *code;   /* at least one instruction */
    int32_t length;
    const af_tensor *aux;       /* captured tensors: CPU, 1 to 4 dimensions, any strides; read, never written */
    int32_t n_aux;
} af_mod_program;

/* FlexAttention's block sparsity (PyTorch's BlockMask, its kv_* half): keys fall in blocks of kv_block, query rows
 * in blocks of q_block. For query block qb of (batch b, query head h), the first kv_num_blocks[b][h][qb] entries of
 * kv_indices[b][h][qb][:] list the key blocks where mask_mod is evaluated ("partial"), the first
 * full_kv_num_blocks[b][h][qb] of full_kv_indices[b][h][qb][:] those attended without it ("full"); every other key is
 * masked out and its block never computed. Entries past a count are ignored. int32 CPU tensors, any strides; their
 * batch and head dims are 1 (broadcast) or B and Hq; at least ceil(L / q_block) query blocks (more are ignored);
 * every listed index in [0, ceil(S / kv_block)), none listed twice in a row, none both full and partial. */
typedef struct {
    int64_t q_block, kv_block;           /* >= 1; not tied to the kernels' tiles */
    const af_tensor *kv_num_blocks;      /* (Bm, Hm, nq) */
    const af_tensor *kv_indices;         /* (Bm, Hm, nq, n) */
    const af_tensor *full_kv_num_blocks; /* NULL (no full blocks), or (Bm, Hm, nq) */
    const af_tensor *full_kv_indices;    /* with it: (Bm, Hm, nq, n') */
} af_block_mask;

typedef struct {
    const af_tensor *query;     /* (B, Hq, L, E) f32/f16/bf16, any strides */
    const af_tensor *key;       /* (B, Hkv, S, E), Hq a multiple of Hkv (query head h reads kv head h / (Hq/Hkv)) */
    const af_tensor *value;     /* (B, Hkv, S, Ev) */
    bool has_scale; double scale;     /* default 1/sqrt(E) */
    const af_mod_program *score_mod;  /* NULL: the scaled score as it is */
    const af_mod_program *mask_mod;   /* NULL: every key */
    const af_block_mask *block_mask;  /* NULL: every key is a partial block's (mask_mod on every score) */
} af_flex_args;

/* FlexAttention's forward (torch.nn.attention.flex_attention): out (B, Hq, L, Ev) in query's
 * dtype, lse NULL or f32 (B, Hq, L), natural log; a row whose keys the mask removes all gets out 0, lse -inf.
 * CPU tensors only. A LOAD whose indices fall outside its tensor fails the call with AF_ERR_INVALID_ARGUMENT naming the
 * program and the tensor, found while the kernels run; out and lse are left as they were all the same (a call whose
 * LOADs an interval analysis does not prove inside runs into staged copies of its outputs, copied on success). */
AF_API af_status af_flex_attn(const af_flex_args *args, af_tensor *out, af_tensor *lse);
/* Its plain reference: double dot products and softmax, the mods evaluated (by the kernels' interpreter) on the
 * scores rounded to float32. For tests. */
AF_API af_status af_flex_attn_reference(const af_flex_args *args, af_tensor *out, af_tensor *lse);

/* PyTorch's create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=(q_block, kv_block)) without a dense mask: each block
 * of each (batch, head) is classified empty, partial or full, by an interval analysis of the program over the block
 * where that settles it, else by evaluating it on the block's scores until both a kept and a removed one are seen.
 * A block reaching past L or S is never full (PyTorch pads the mask with False). Written as PyTorch writes them:
 * kv_num_blocks (B, H, nq) and kv_indices (B, H, nq, nk) int32, nq = ceil(L / q_block), nk = ceil(S / kv_block), each
 * row listing its partial blocks in increasing order, then the others in increasing order; likewise the full ones.
 * Output tensors: int32, CPU, those shapes, any strides; written only when the call succeeds. */
typedef struct {
    af_tensor *kv_num_blocks, *kv_indices;
    af_tensor *full_kv_num_blocks, *full_kv_indices;   /* NULL, NULL: full blocks are listed as partial ones */
} af_block_mask_tensors;

AF_API af_status af_create_block_mask(const af_mod_program *mask_mod, int64_t B, int64_t H, int64_t L, int64_t S,
                                      int64_t q_block, int64_t kv_block, const af_block_mask_tensors *out);

/* ---------------------------------------------------------------- the backward pass (training)
 * Gradients of one af_sdpa / af_flash_attn call with respect to query, key and value (and learnable_sink), from the
 * forward's arguments (passed again, unchanged), its out and lse as it wrote them, and dout = dLoss/dout.
 * FlashAttention-2's algorithm: P recomputed from lse, D = rowsum(dout ∘ out), no L×S matrix in memory; f32
 * accumulation, gradients in the inputs' dtypes; the same bits for any thread count (no atomics). Every meaning of
 * the forward: scale, both causal alignments, bool and additive masks of any broadcast shape (no gradient for the
 * mask), grouped heads (dk, dv summed over a group's query heads), Ev != E, any strides, windows, softcap (through
 * tanh), learnable sinks, varlen. Not taken (refused, naming the argument): paged or float8 K/V (FA4 has no backward
 * for them either), dropout, float32 and head dims above 128 on CUDA tensors (the CUDA backward runs f16/bf16 on
 * the tensor cores: docs/CUDA.md), and a batch or head dim of query, key or value that broadcasts (size 1 read for
 * a larger output: expand it with stride 0 and sum the gradient).
 * Rows that see no key get zero gradients; keys no row sees get zero dk, dv. */
typedef struct {
    const af_tensor *out;      /* the forward's output */
    const af_tensor *dout;     /* out's shape and dtype, any strides */
    const af_tensor *lse;      /* the forward's lse (required): its shape and dtype as the forward takes it */
} af_backward_inputs;

typedef struct {
    af_tensor *dq, *dk, *dv;   /* query's, key's, value's shapes and dtypes, any strides that do not make elements share
                                  memory or overlap another tensor of the call; written whole; NULL: not wanted */
    af_tensor *dsink;          /* af_flash_attn with a learnable_sink: NULL or its shape and dtype; else NULL */
} af_gradients;

AF_API af_status af_sdpa_backward(const af_sdpa_args *args, const af_backward_inputs *in, const af_gradients *grads);
AF_API af_status af_flash_attn_backward(const af_flash_args *args, const af_backward_inputs *in,
                                        const af_gradients *grads);
/* FlexAttention's backward (af_flex_attn's arguments, passed again): dq, dk, dv through the score_mod (its derivative
 * taken from the program itself: the chain rule over its operations, PyTorch's derivatives) and the mask and block
 * mask (removed keys get no gradient); grads->dsink must be NULL. daux: NULL, or one entry per captured tensor of the
 * score_mod (score_mod->n_aux), each NULL or that tensor's gradient, written whole: float32, the tensor's shape, any
 * non-negative strides; a float tensor's elements get the sum over every score that loaded them of the loss's
 * gradient there times d(score_mod)/d(the loaded value). Deterministic, as the other backwards: the sums run apart
 * per work item, then in item order. */
AF_API af_status af_flex_attn_backward(const af_flex_args *args, const af_backward_inputs *in,
                                       const af_gradients *grads, af_tensor *const *daux);
AF_API af_status af_flex_attn_backward_reference(const af_flex_args *args, const af_backward_inputs *in,
                                                 const af_gradients *grads, af_tensor *const *daux);
/* The plain references: double accumulation, P and D recomputed from the inputs (out and lse checked, not read). */
AF_API af_status af_sdpa_backward_reference(const af_sdpa_args *args, const af_backward_inputs *in,
                                            const af_gradients *grads);
AF_API af_status af_flash_attn_backward_reference(const af_flash_args *args, const af_backward_inputs *in,
                                                  const af_gradients *grads);

/* ---------------------------------------------------------------- execution settings */
/* 0 (the default): the executor's max_threads when one is lent, else all cores. n > 0: n threads either way. */
AF_API void af_set_num_threads(int n);
AF_API int af_get_num_threads(void);     /* threads a call made now on this thread will use */

/* A parallel-for the embedding program lends, so that attnforge's parallel work runs on the threads the program
 * already keeps busy (its OpenMP team, its task pool) instead of a second set of threads competing for the cores. */
typedef void (*af_thread_task)(void *task_ctx, int thread_index);
typedef struct {
    /* Call task(task_ctx, t) for the indices t in [0, n_threads) (n_threads >= 2), each at most once, on threads that
     * run at the same time (the calling thread best among them, as an OpenMP master is thread 0), and return once
     * every call made has returned. Indices it cannot run (a nested OpenMP region's team of one) lose nothing: the
     * calling thread does their work after it returns. The tasks never wait for one another, so running them one
     * after another is correct too, only slower. */
    void (*parallel)(int n_threads, af_thread_task task, void *task_ctx, void *user);
    /* Threads a call made now on the calling thread uses when af_set_num_threads is 0, e.g. the host's
     * omp_get_max_threads(); values below 1 mean 1. NULL: all cores. */
    int (*max_threads)(void *user);
    void *user;                  /* handed to both */
} af_parallel_executor;

/* Run attnforge's parallel work through *executor (copied), or through attnforge's own thread pool again when
 * executor is NULL or its parallel is NULL (the default). A call already running finishes with what it began with.
 * Unchanged under any executor: work too small to pay for another thread stays on the calling thread; a call made
 * while another call's parallel work is in flight (another thread, or a call from inside a task) runs on its calling
 * thread alone, so no executor is ever entered twice at once by attnforge; results are bit-identical whatever the
 * executor and the thread count. */
AF_API void af_set_parallel_executor(const af_parallel_executor *executor);

/* Decode rows on the prefill's arithmetic. Whatever this says, a row's output and lse never depend on its K/V layout
 * (contiguous, strided, paged in any page size and order, packed), on the other sequences of its batch or on the
 * thread count (docs/API.md, "Invariance"). But by default a sequence with few query rows per kv head (a decode step:
 * at most 16, 3 on AMX) runs on kernels that read K/V in place, whose dot products are summed in another order than
 * the tile products of a longer call: a decoded token's bits then differ, within the error bound, from the same row
 * computed inside a prefill or chunked-prefill call. On: every row runs on the tile products, and the two agree bit
 * for bit, at a cost in decode time docs/API.md gives. The environment variable ATTNFORGE_PHASE_INVARIANT=1 turns it on
 * initially. Applies to the CPU kernels; process-wide, for calls that start after it. */
AF_API void af_set_phase_invariant(bool on);
AF_API bool af_get_phase_invariant(void);

/* Kernel ISA: "portable", "avx2", "avx512", "amx" (what the CPU and OS allow; "amx" = AVX-512 plus AMX tiles for
 * bf16 inputs, f16/f32 run its AVX-512 path). The environment variable ATTNFORGE_ISA sets the initial choice.
 * af_set_isa fails with AF_ERR_UNSUPPORTED if the machine (or this build) lacks it. */
AF_API af_status af_set_isa(const char *name);
AF_API const char *af_get_isa(void);     /* the ISA af_sdpa uses now */
AF_API bool af_isa_available(const char *name);
/* The index-th ISA compiled into this build, from "portable" up to the best (NULL past the last): the list to loop
 * over with af_isa_available, rather than names written out. */
AF_API const char *af_isa_name(int index);

/* Open the CUDA backend now, as the first call on CUDA tensors would: libattnforge_cuda.so (docs/CUDA.md says where
 * it is looked for), then the NVIDIA driver and the GPUs. AF_OK and *device_count >= 1; else
 * AF_ERR_RUNTIME_UNAVAILABLE and af_last_error() saying which is missing. Either way `library` (library_size bytes,
 * truncated to fit; NULL to skip) receives the path of the libattnforge_cuda.so loaded (also when the driver or a GPU
 * is then missing), "" when none could be. `device_count` may be NULL. For diagnostics (`python -m attnforge`). */
AF_API af_status af_load_cuda_backend(int *device_count, char *library, size_t library_size);

/* The index arrays of af_flash_attn calls on CUDA tensors (cu_seqlens_q/k, seqused_k, page_table) are device memory
 * that the call never reads on the host, so that it stays asynchronous and can be captured in a CUDA graph: the
 * device checks them (docs/CUDA.md). A bad entry never makes a kernel read or write out of bounds; the rows of its
 * sequence get out = NaN and lse = NaN (or are not written, when its cu_seqlens_q entries are at fault), and the
 * first violation is recorded in a sticky status of the device. This waits for all work on `device`, then returns
 * AF_OK when nothing was recorded since the last check, else AF_ERR_INVALID_ARGUMENT with af_last_error() naming
 * the array, the entry and the rule, and clears the record. Not during stream capture (it synchronises). */
AF_API af_status af_cuda_check_errors(int device);

/* ---------------------------------------------------------------- logging */
typedef enum { AF_LOG_DEBUG = 10, AF_LOG_INFO = 20, AF_LOG_WARNING = 30, AF_LOG_ERROR = 40, AF_LOG_OFF = 100 } af_log_level;
typedef void (*af_log_fn)(af_log_level level, const char *message, void *user);
/* Silent by default. A callback receives every message at or above `min_level`; NULL removes it. The callback
 * runs on the thread that logs, with no attnforge lock held; a message already in flight when the callback is
 * replaced may still reach the old one. */
AF_API void af_set_log_callback(af_log_fn fn, void *user, af_log_level min_level);

/* Free memory that attnforge returned (JSON strings, ...). */
AF_API void af_free(void *ptr);

/* ---------------------------------------------------------------- the provider (the seed's system)
 * A sample is one recorded SDPA call: tensor descriptors (no data), the other arguments, and how q/k/v
 * were passed. prepare() turns samples into one plan; the plan serialises to JSON; infer() runs it.
 * docs/PROVIDER.md describes the behaviour, docs/FORMATS.md the samples file and the plan file. */

typedef enum { AF_QKV_POSITIONAL = 0, AF_QKV_KEYWORD = 1 } af_qkv_source;   /* "positional_qkv", "keyword_qkv" */
/* "cpu", "cuda", "fa4". fa4: FlashAttention-4 itself (flash_attn.cute), which only the Python provider can call;
 * plan files may name it, af_provider_check_call guards its calls, af_provider_infer refuses to run them. */
typedef enum { AF_BACKEND_CPU = 0, AF_BACKEND_CUDA = 1, AF_BACKEND_FA4 = 2 } af_backend;

typedef struct af_samples af_samples;     /* an ordered list of recorded calls */
typedef struct af_provider af_provider;   /* one prepared (or not yet prepared) plan */

/* The plan prepare() chose: the seed's (qkv_source, flash_kwargs, copy_free_layout) and where it runs. */
typedef struct {
    af_qkv_source qkv_source;
    bool causal;                 /* SDPA's is_causal: top-left aligned (row i sees keys j <= i) */
    bool has_softmax_scale;      /* false: the default 1/sqrt(E) */
    double softmax_scale;
    bool gqa;                    /* grouped-query (Hq a multiple of Hkv, Hq != Hkv): JSON pack_gqa = false */
    bool copy_free_layout;       /* q/k/v are HND views of NHD-contiguous memory: no copy per call */
    af_backend backend;
} af_plan;

/* One sample read back as an SDPA call. Tensors are descriptors: data is NULL. */
typedef struct {
    af_qkv_source source;
    af_tensor query, key, value;
    bool has_attn_mask;
    af_tensor attn_mask;
    double dropout_p;
    bool is_causal;
    bool has_scale;
    double scale;
    bool enable_gqa;
    char device[32];             /* query's device, e.g. "cpu" */
    long count;                  /* how often the call was seen (>= 1) */
} af_sample_call;

/* Samples: read from the samples-file JSON (docs/FORMATS.md), written back the same way. */
AF_API af_status af_samples_from_json(const char *json, size_t len, af_samples **out);
AF_API af_status af_samples_load(const char *path, af_samples **out);   /* AF_ERR_IO, AF_ERR_PARSE */
AF_API af_status af_samples_to_json(const af_samples *samples, char **json_out);   /* free with af_free */
AF_API size_t af_samples_count(const af_samples *samples);
AF_API void af_samples_free(af_samples *samples);
/* Build samples in C: an empty list, then one recorded call at a time. add_call reads the descriptors of
 * args' tensors (shape, dtype, strides; never data) and the arguments that differ from SDPA's defaults;
 * `device` NULL: each tensor's own af_tensor.device ("cpu", "cuda:N"); `count` >= 1. causal_bottom_right is
 * recorded as a keyword SDPA lacks
 * (so prepare refuses it by name). */
AF_API af_samples *af_samples_new(void);                    /* NULL only when out of memory */
AF_API af_status af_samples_add_call(af_samples *samples, const af_sdpa_args *args, af_qkv_source source,
                                     const char *device, long count);
/* Sample `index` as an SDPA call; AF_ERR_UNSUPPORTED (naming the argument) when it is not one that
 * af_sdpa_args can express (q/k/v not tensors, an unknown keyword, a dtype attnforge lacks, ...). */
AF_API af_status af_samples_get_call(const af_samples *samples, size_t index, af_sample_call *out);
/* The af_sdpa_args of a sample call: pointers into *call (which must outlive them). */
AF_API af_sdpa_args af_sample_call_args(const af_sample_call *call);

AF_API af_provider *af_provider_new(void);                  /* NULL only when out of memory */
AF_API void af_provider_free(af_provider *provider);
/* true when every sample is supported and all give one identical plan; else false and
 * af_provider_reason() (and af_last_error()) say why. Never runs a kernel, never loads a runtime.
 * Always re-derives the plan; a failed prepare leaves the provider unprepared. */
AF_API bool af_provider_prepare(af_provider *provider, const af_samples *samples);
AF_API const char *af_provider_reason(const af_provider *provider);     /* "" after a successful prepare */
AF_API bool af_provider_is_prepared(const af_provider *provider);
AF_API af_status af_provider_get_plan(const af_provider *provider, af_plan *out);   /* AF_ERR_NOT_PREPARED */
AF_API af_status af_provider_to_json(const af_provider *provider, char **json_out);   /* free with af_free */
/* Reads attnforge's plan (version 1) and the seed's own form (no version). On any error: AF_ERR_PARSE
 * naming the field, and *out is left NULL. The provider comes back prepared. */
AF_API af_status af_provider_from_json(const char *json, size_t len, af_provider **out);
AF_API af_status af_provider_load(const char *path, af_provider **out);   /* from_json of a file; AF_ERR_IO */
/* Run the plan on one call. `source` is how the caller passed q/k/v. A call that does not match the plan
 * (source, mask, causal, scale, GQA, or a layout no longer copy-free) runs on the general path, af_sdpa
 * with the call's own arguments, and says so in a debug log: never with the plan's wrong arguments.
 * Thread-safe: concurrent calls on one provider are fine (docs/PROVIDER.md). */
AF_API af_status af_provider_infer(af_provider *provider, const af_sdpa_args *args, af_qkv_source source,
                                   af_tensor *out, af_tensor *lse);
/* The per-call guard alone: AF_OK when infer would run this call (passed as `source`) with the plan;
 * AF_ERR_PLAN_MISMATCH naming the difference when it would take the general path. Runs nothing. (For
 * callers that send uncovered calls elsewhere, e.g. attnforge.torch.apply back to PyTorch.) */
AF_API af_status af_provider_check_call(const af_provider *provider, const af_sdpa_args *args, af_qkv_source source);
/* Loads the plan's backend now (CPU kernels; the CUDA shared object for a cuda plan) instead of on the
 * first infer. Idempotent. AF_ERR_RUNTIME_UNAVAILABLE says how to get a missing backend. */
AF_API af_status af_provider_load_runtime_dependencies(af_provider *provider);
AF_API const char *af_provider_name(const af_provider *provider);   /* "attnforge FlashAttention-4 (cpu, avx2) 0.1.0" */
AF_API const char *af_provider_supported_function(void);            /* "scaled_dot_product_attention" */

#ifdef __cplusplus
}
#endif
#endif /* ATTNFORGE_H */
