/* Attention read straight off codes that index a table of levels (kvstack.cache.levels):
 * TurboQuant's tokens, x[t] = norm[t] * levels[code] on a rotated basis. A token's codes are read a
 * chunk at a time through `table` (packing.chunk_table: row r holds the levels of the k codes a
 * chunk of cb bits with value r stands for), so its d values come from d / k row copies, with no
 * arithmetic per code; the norm is folded into the logit (keys) or the probability (values).
 *
 * Layout (every array contiguous, B = batch rows x KV heads):
 *   codes (B, n, w) uint8 (kvstack.cache.packing.pack): 1, 2, 4 or 8 bits, 8 / bits codes to a
 *     byte, the lowest bits first; 3 bits, eight codes to three bytes read as one little-endian
 *     24-bit word, each 12-bit half four codes;
 *   norm (B, n) float16; table (2^cb, k) float32, cb = 12 for 3 bits (k = 4), else 8 (k = 8 / bits);
 *   q (B, G, d), p (B, G, n) float32: G queries per KV head, already on the rotated basis.
 * level_logits: out (B, G, n) = norm[t] * (q . y[t]).  level_mix: out (B, G, d) = sum_t p[t] norm[t] y[t].
 *
 * Callers guarantee d % 16 == 0. Tokens are split between `threads` OpenMP threads, each a run of
 * consecutive tokens. Written with GCC vector extensions: any target. */
#include <string.h>

#include "common.h"

/* y (d floats): the levels of one token's codes, in channel order, one table row per chunk. */
INLINE void levels_of(const uint8_t *row, int bits, int64_t d, const float *table, float *y) {
    if (bits == 3) {
        for (int64_t j = 0; j < d / 8; j++) { /* bytes 3j..3j+2: codes 8j..8j+7 */
            const uint32_t word = row[3 * j] | (uint32_t)row[3 * j + 1] << 8 | (uint32_t)row[3 * j + 2] << 16;
            memcpy(y + 8 * j, table + (word & 0xFFF) * 4, 4 * sizeof(float));
            memcpy(y + 8 * j + 4, table + (word >> 12) * 4, 4 * sizeof(float));
        }
        return;
    }
    const int k = 8 / bits;
    for (int64_t j = 0; j < d / k; j++) memcpy(y + k * j, table + row[j] * k, k * sizeof(float));
}

INLINE void logits(int64_t B, int64_t n, int64_t d, int64_t w, int bits, const uint8_t *codes, const half *norm,
                   const float *table, const float *q, int64_t G, float *out) {
    const int64_t nv = d / L;
    vf *qv = vectors(G * nv), *y = vectors(nv);
    int64_t t0, t1;
    share(n, &t0, &t1);
    for (int64_t b = 0; b < B; b++) {
        memcpy(qv, q + b * G * d, sizeof(float) * G * d);
        for (int64_t t = t0; t < t1; t++) {
            levels_of(codes + (b * n + t) * w, bits, d, table, (float *)y);
            const float scale = (float)norm[b * n + t];
            for (int64_t g = 0; g < G; g++) {
                vf acc = {0};
                for (int64_t v = 0; v < nv; v++) acc += qv[g * nv + v] * y[v];
                out[(b * G + g) * n + t] = hsum(acc) * scale;
            }
        }
    }
    free(qv), free(y);
}

INLINE void mix(int64_t B, int64_t n, int64_t d, int64_t w, int bits, const uint8_t *codes, const half *norm,
                const float *table, const float *p, int64_t G, float *out) {
    const int64_t nv = d / L;
    vf *acc = vectors(G * nv), *y = vectors(nv);
    int64_t t0, t1;
    share(n, &t0, &t1);
    for (int64_t b = 0; b < B; b++) {
        memset(acc, 0, sizeof(vf) * G * nv);
        for (int64_t t = t0; t < t1; t++) {
            levels_of(codes + (b * n + t) * w, bits, d, table, (float *)y);
            const float scale = (float)norm[b * n + t];
            for (int64_t g = 0; g < G; g++) {
                const float pg = p[(b * G + g) * n + t] * scale;
                for (int64_t v = 0; v < nv; v++) acc[g * nv + v] += pg * y[v];
            }
        }
        const float *sums = (const float *)acc;
#pragma omp critical
        for (int64_t i = 0; i < G * d; i++) out[b * G * d + i] += sums[i];
    }
    free(acc), free(y);
}

/* One copy of the loops per width, so each reads its codes with constant shifts. */
#define BITS(fn, ...)                                                                                                  \
    switch (bits) {                                                                                                    \
    case 1: fn(B, n, d, w, 1, __VA_ARGS__); break;                                                                     \
    case 2: fn(B, n, d, w, 2, __VA_ARGS__); break;                                                                     \
    case 3: fn(B, n, d, w, 3, __VA_ARGS__); break;                                                                     \
    case 4: fn(B, n, d, w, 4, __VA_ARGS__); break;                                                                     \
    case 8: fn(B, n, d, w, 8, __VA_ARGS__); break;                                                                     \
    }

void level_logits(int64_t B, int64_t n, int64_t d, int64_t w, int bits, const uint8_t *codes, const half *norm,
                  const float *table, const float *q, int64_t G, float *out, int threads) {
#pragma omp parallel num_threads(threads)
    BITS(logits, codes, norm, table, q, G, out)
}

void level_mix(int64_t B, int64_t n, int64_t d, int64_t w, int bits, const uint8_t *codes, const half *norm,
               const float *table, const float *p, int64_t G, float *out, int threads) {
    memset(out, 0, sizeof(float) * B * G * d);
#pragma omp parallel num_threads(threads)
    BITS(mix, codes, norm, table, p, G, out)
}
