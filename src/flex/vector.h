/* The mods' vector code: GCC vector types over AF_MOD_LANES keys, and function clones for AVX-512, AVX2 and baseline
 * x86-64 picked once by the loader for this CPU (the library is built for baseline x86-64). The operations are single
 * IEEE operations, the same in every clone, so every clone gives the same bits. */
#ifndef AF_FLEX_VECTOR_H
#define AF_FLEX_VECTOR_H
#include <stdint.h>
#include <string.h>

#include "flex/program.h"

typedef float vfloat __attribute__((vector_size(4 * AF_MOD_LANES)));
typedef int32_t vint __attribute__((vector_size(4 * AF_MOD_LANES)));
typedef uint32_t vuint __attribute__((vector_size(4 * AF_MOD_LANES)));
/* Unaligned loads and stores of a vector of type VT (memcpy: no alignment or aliasing assumed). */
#define V_LOAD_AS(VT, p) ({ VT v_; memcpy(&v_, (p), sizeof v_); v_; })
#define V_STORE_AS(p, v) do { __typeof__(v) s_ = (v); memcpy((p), &s_, sizeof s_); } while (0)

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define AF_MOD_NO_IFUNC 1   /* ThreadSanitizer: an ifunc resolver runs before its runtime is up and crashes */
#endif
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_THREAD__) && !defined(AF_MOD_NO_IFUNC)
#define AF_MOD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define AF_MOD_CLONES
#endif

#endif
