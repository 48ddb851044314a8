/* What the kernels share (kvstack.cache.kernels): 16-lane float vectors (GCC vector extensions:
 * any target), their sum, aligned scratch, and each OpenMP thread's run of tokens. */
#pragma once
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define L 16
typedef float vf __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));
typedef uint8_t vb __attribute__((vector_size(L)));
typedef float vh __attribute__((vector_size(2 * L)));
typedef float vq __attribute__((vector_size(L)));
typedef _Float16 half;
#define INLINE static inline __attribute__((always_inline))

INLINE vf *vectors(int64_t count) { return aligned_alloc(64, (size_t)(count > 0 ? count : 1) * sizeof(vf)); }

/* The sum of v's lanes, as a tree (halves added), not a chain of 16 dependent adds. */
INLINE float hsum(vf v) {
    vh h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    vq s = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (s[0] + s[2]) + (s[1] + s[3]);
}

/* This thread's run [*t0, *t1) of n tokens. */
INLINE void share(int64_t n, int64_t *t0, int64_t *t1) {
    int64_t id = omp_get_thread_num(), count = omp_get_num_threads();
    *t0 = n * id / count;
    *t1 = n * (id + 1) / count;
}
