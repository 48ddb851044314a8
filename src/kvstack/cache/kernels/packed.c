/* Attention read straight off packed integer codes (kvstack.cache.packed): a token's codes are
 * unpacked in vector registers and each scale is folded into the query (keys) or the probability
 * (values), so a decoding step reads bits/16 of the bytes a bf16 cache reads and never writes a
 * float copy of the cache.
 *
 * Layout (every array contiguous, B = batch rows x KV heads):
 *   codes (B, n, w) uint8: token t's d = w * per codes packed along the channels, per = 8 / bits
 *     to a byte, the lowest bits first (kvstack.cache.packing.pack): channel c = j * per + i sits
 *     in byte j at bits i * bits;
 *   scale, zero (B, srows, d / dg) float16: token t reads row t / tg, or, with group counts
 *     counts (B, srows) int16, the row whose run of counts holds t (a group that lost tokens to an
 *     eviction counts what it still holds; empty ones are skipped); channel c reads column c / dg:
 *     x[t][c] = code * scale + zero;
 *   q (B, G, d), p (B, G, n) float32: G queries per KV head (query heads x new tokens).
 * packed_logits: out (B, G, n) = q . x[t].  packed_mix: out (B, G, d) = sum_t p[t] x[t].
 *
 * 16 bytes of a token widen to 16 lanes; lane l of plane i then holds the code at bits i * bits
 * of byte l, channel l * per + i. Queries, scales and sums are held in that "plane" order, so
 * unpacking is a shift and a mask per plane. Callers guarantee w % 16 == 0 and, when dg > 1,
 * dg % per == 0 (a channel group covers whole bytes). Tokens are split between `threads` OpenMP
 * threads, each a run of consecutive tokens. Written with GCC vector extensions: any target. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define L 16
typedef float vf __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));
typedef uint8_t vb __attribute__((vector_size(L)));
typedef _Float16 half;
#define INLINE static inline __attribute__((always_inline))

INLINE vf *vectors(int64_t count) { return aligned_alloc(64, (size_t)(count > 0 ? count : 1) * sizeof(vf)); }

typedef float vh __attribute__((vector_size(2 * L)));
typedef float vq __attribute__((vector_size(L)));

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

/* x[i * chunks + ch]: plane i of bytes ch*16.. of one token's row */
INLINE void unpack(const uint8_t *row, int64_t chunks, int bits, vf *x) {
    const int per = 8 / bits;
    for (int64_t ch = 0; ch < chunks; ch++) {
        vb bytes;
        memcpy(&bytes, row + ch * L, L);
        vi v = __builtin_convertvector(bytes, vi);
        for (int i = 0; i < per; i++) x[i * chunks + ch] = __builtin_convertvector((v >> (i * bits)) & ((1 << bits) - 1), vf);
    }
}

/* Token t's group row, walking on from row r (which starts at token *first): row r covers
 * counts[r] tokens (tg when counts is NULL); empty rows are passed over; the last row takes the rest. */
INLINE int64_t row_at(const int16_t *counts, int64_t tg, int64_t srows, int64_t t, int64_t r, int64_t *first) {
    while (r < srows - 1) {
        const int64_t size = counts ? counts[r] : tg;
        if (t < *first + size) break;
        *first += size;
        r++;
    }
    return r;
}

/* v (d) in channel order -> out (per * chunks vectors) in plane order */
INLINE void plane_f(const float *v, int64_t chunks, int per, vf *out) {
    for (int i = 0; i < per; i++)
        for (int64_t ch = 0; ch < chunks; ch++)
            for (int l = 0; l < L; l++) out[i * chunks + ch][l] = v[(ch * L + l) * per + i];
}

/* the same for float16 values (a row of scales or zeros) */
INLINE void plane(const half *v, int64_t chunks, int per, vf *out) {
    for (int i = 0; i < per; i++)
        for (int64_t ch = 0; ch < chunks; ch++)
            for (int l = 0; l < L; l++) out[i * chunks + ch][l] = v[(ch * L + l) * per + i];
}

/* mask[k * chunks + ch]: 1 in the lanes whose byte falls in channel group k (wg bytes a group) */
INLINE void group_masks(int64_t width, int64_t chunks, int64_t wg, vf *mask) {
    for (int64_t k = 0; k < width; k++)
        for (int64_t ch = 0; ch < chunks; ch++)
            for (int l = 0; l < L; l++) mask[k * chunks + ch][l] = (ch * L + l) / wg == k ? 1.0f : 0.0f;
}

/* sv[ch]: each lane's scale (or zero) for a token with per-group values s (width) */
INLINE void spread(const half *s, const vf *mask, int64_t width, int64_t chunks, vf *sv) {
    for (int64_t ch = 0; ch < chunks; ch++) {
        vf acc = {0};
        for (int64_t k = 0; k < width; k++) acc += (float)s[k] * mask[k * chunks + ch];
        sv[ch] = acc;
    }
}

INLINE void logits(int64_t B, int64_t n, int64_t d, int64_t w, int bits, int64_t chunks, const uint8_t *codes, const half *scale,
                   const half *zero, int64_t srows, int64_t tg, int64_t dg, const int16_t *counts, const float *q,
                   int64_t G, float *out, int threads) {
    const int per = 8 / bits;
    const int64_t nv = per * chunks, width = d / dg;
    {
        /* qp: the queries in plane order; qs: times a row's scales; bias: q . zero of that row;
         * zq[g][k]: query g summed over channel group k (per-token zeros) */
        vf *qp = vectors(G * nv), *qs = vectors(G * nv), *x = vectors(nv), *sv = vectors(chunks);
        vf *mask = vectors(width * chunks), *srow = vectors(nv);
        float *bias = malloc(sizeof(float) * G), *zq = malloc(sizeof(float) * G * width);
        if (dg > 1) group_masks(width, chunks, dg / per, mask);
        int64_t t0, t1;
        share(n, &t0, &t1);
        for (int64_t b = 0; b < B; b++) {
            const float *qb = q + b * G * d;
            for (int64_t g = 0; g < G; g++) plane_f(qb + g * d, chunks, per, qp + g * nv);
            for (int64_t g = 0; g < G && dg > 1; g++)
                for (int64_t k = 0; k < width; k++) {
                    float sum = 0.0f;
                    for (int64_t c = k * dg; c < (k + 1) * dg; c++) sum += qb[g * d + c];
                    zq[g * width + k] = sum;
                }
            int64_t held = -1;
            const int16_t *cb = counts ? counts + b * srows : NULL;
            int64_t first = 0, r = 0;
            for (int64_t t = t0; t < t1; t++) {
                r = row_at(cb, tg, srows, t, r, &first);
                const half *s = scale + (b * srows + r) * width, *z = zero + (b * srows + r) * width;
                unpack(codes + (b * n + t) * w, chunks, bits, x);
                float *o = out + b * G * n + t;
                if (dg == 1) {
                    if (r != held) { /* per-channel scales: folded into the queries once per row */
                        plane(s, chunks, per, srow);
                        for (int64_t g = 0; g < G; g++) {
                            for (int64_t v = 0; v < nv; v++) qs[g * nv + v] = qp[g * nv + v] * srow[v];
                            float zsum = 0.0f;
                            for (int64_t c = 0; c < d; c++) zsum += qb[g * d + c] * (float)z[c];
                            bias[g] = zsum;
                        }
                        held = r;
                    }
                    for (int64_t g = 0; g < G; g++) {
                        vf acc = {0};
                        for (int64_t v = 0; v < nv; v++) acc += qs[g * nv + v] * x[v];
                        o[g * n] = hsum(acc) + bias[g];
                    }
                } else { /* per-token scales: each lane's scale spread from its channel group */
                    spread(s, mask, width, chunks, sv);
                    for (int64_t v = 0; v < nv; v++) x[v] *= sv[v % chunks];
                    for (int64_t g = 0; g < G; g++) {
                        vf acc = {0};
                        for (int64_t v = 0; v < nv; v++) acc += qp[g * nv + v] * x[v];
                        float zsum = 0.0f;
                        for (int64_t kk = 0; kk < width; kk++) zsum += (float)z[kk] * zq[g * width + kk];
                        o[g * n] = hsum(acc) + zsum;
                    }
                }
            }
        }
        free(qp), free(qs), free(x), free(sv), free(mask), free(srow), free(bias), free(zq);
    }
}

INLINE void mix(int64_t B, int64_t n, int64_t d, int64_t w, int bits, int64_t chunks, const uint8_t *codes, const half *scale,
                const half *zero, int64_t srows, int64_t tg, int64_t dg, const int16_t *counts, const float *p,
                int64_t G, float *out, int threads) {
    const int per = 8 / bits;
    const int64_t nv = per * chunks, width = d / dg;
    {
        /* acc[g]: sums of p * scale * code in plane order (plus p * zero, per-channel zeros);
         * zacc[g][k]: sums of p * zero per channel group (per-token zeros) */
        vf *acc = vectors(G * nv), *x = vectors(nv), *sv = vectors(chunks), *mask = vectors(width * chunks);
        vf *srow = vectors(nv), *zrow = vectors(nv);
        float *zacc = malloc(sizeof(float) * G * width);
        if (dg > 1) group_masks(width, chunks, dg / per, mask);
        int64_t t0, t1;
        share(n, &t0, &t1);
        for (int64_t b = 0; b < B; b++) {
            memset(acc, 0, sizeof(vf) * G * nv);
            memset(zacc, 0, sizeof(float) * G * width);
            const float *pb = p + b * G * n;
            int64_t held = -1;
            const int16_t *cb = counts ? counts + b * srows : NULL;
            int64_t first = 0, r = 0;
            for (int64_t t = t0; t < t1; t++) {
                r = row_at(cb, tg, srows, t, r, &first);
                const half *s = scale + (b * srows + r) * width, *z = zero + (b * srows + r) * width;
                unpack(codes + (b * n + t) * w, chunks, bits, x);
                if (dg == 1) {
                    if (r != held) {
                        plane(s, chunks, per, srow);
                        plane(z, chunks, per, zrow);
                        held = r;
                    }
                    for (int64_t v = 0; v < nv; v++) x[v] = x[v] * srow[v] + zrow[v];
                } else {
                    spread(s, mask, width, chunks, sv);
                    for (int64_t v = 0; v < nv; v++) x[v] *= sv[v % chunks];
                }
                for (int64_t g = 0; g < G; g++) {
                    const float pg = pb[g * n + t];
                    for (int64_t v = 0; v < nv; v++) acc[g * nv + v] += pg * x[v];
                    for (int64_t kk = 0; kk < width && dg > 1; kk++) zacc[g * width + kk] += pg * (float)z[kk];
                }
            }
#pragma omp critical
            for (int64_t g = 0; g < G; g++)
                for (int i = 0; i < per; i++)
                    for (int64_t ch = 0; ch < chunks; ch++)
                        for (int l = 0; l < L; l++) {
                            const int64_t c = (ch * L + l) * per + i;
                            out[(b * G + g) * d + c] += acc[g * nv + i * chunks + ch][l] + (dg > 1 ? zacc[g * width + c / dg] : 0.0f);
                        }
        }
        free(acc), free(x), free(sv), free(mask), free(srow), free(zrow), free(zacc);
    }
}

/* Exported: one copy of the loops per width, so each unpacks with constant shifts and masks. */
/* The switch sits inside the parallel region: each thread's loops are inlined with a constant width. */
#define CHUNKS(fn, bits, ...)                                                                                          \
    switch (w / L) {                                                                                                   \
    case 1: fn(B, n, d, w, bits, 1, __VA_ARGS__); break;                                                               \
    case 2: fn(B, n, d, w, bits, 2, __VA_ARGS__); break;                                                               \
    case 4: fn(B, n, d, w, bits, 4, __VA_ARGS__); break;                                                               \
    default: fn(B, n, d, w, bits, w / L, __VA_ARGS__); break;                                                          \
    }
#define WIDTHS(fn, ...)                                                                                                \
    _Pragma("omp parallel num_threads(threads)") switch (bits) {                                                       \
    case 1: CHUNKS(fn, 1, __VA_ARGS__) break;                                                                          \
    case 2: CHUNKS(fn, 2, __VA_ARGS__) break;                                                                          \
    case 4: CHUNKS(fn, 4, __VA_ARGS__) break;                                                                          \
    case 8: CHUNKS(fn, 8, __VA_ARGS__) break;                                                                          \
    }

void packed_logits(int64_t B, int64_t n, int64_t d, int64_t w, int bits, const uint8_t *codes, const half *scale,
                   const half *zero, int64_t srows, int64_t tg, int64_t dg, const int16_t *counts, const float *q,
                   int64_t G, float *out, int threads) {
    WIDTHS(logits, codes, scale, zero, srows, tg, dg, counts, q, G, out, threads)
}

void packed_mix(int64_t B, int64_t n, int64_t d, int64_t w, int bits, const uint8_t *codes, const half *scale,
                const half *zero, int64_t srows, int64_t tg, int64_t dg, const int16_t *counts, const float *p,
                int64_t G, float *out, int threads) {
    memset(out, 0, sizeof(float) * B * G * d);
    WIDTHS(mix, codes, scale, zero, srows, tg, dg, counts, p, G, out, threads)
}
