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
#include <math.h>
#include <string.h>

#include "common.h"

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
                   int64_t G, float *out, int64_t ld, int threads) {
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
                float *o = out + b * G * ld + t;
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
                        o[g * ld] = hsum(acc) + bias[g];
                    }
                } else { /* per-token scales: each lane's scale spread from its channel group */
                    spread(s, mask, width, chunks, sv);
                    for (int64_t v = 0; v < nv; v++) x[v] *= sv[v % chunks];
                    for (int64_t g = 0; g < G; g++) {
                        vf acc = {0};
                        for (int64_t v = 0; v < nv; v++) acc += qp[g * nv + v] * x[v];
                        float zsum = 0.0f;
                        for (int64_t kk = 0; kk < width; kk++) zsum += (float)z[kk] * zq[g * width + kk];
                        o[g * ld] = hsum(acc) + zsum;
                    }
                }
            }
        }
        free(qp), free(qs), free(x), free(sv), free(mask), free(srow), free(bias), free(zq);
    }
}

INLINE void mix(int64_t B, int64_t n, int64_t d, int64_t w, int bits, int64_t chunks, const uint8_t *codes, const half *scale,
                const half *zero, int64_t srows, int64_t tg, int64_t dg, const int16_t *counts, const float *p,
                int64_t ld, int64_t G, float *out, int threads) {
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
            const float *pb = p + b * G * ld;
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
                    const float pg = pb[g * ld + t];
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
#define BITS(fn, b_, ...)                                                                                              \
    switch (b_) {                                                                                                      \
    case 1: CHUNKS(fn, 1, __VA_ARGS__) break;                                                                          \
    case 2: CHUNKS(fn, 2, __VA_ARGS__) break;                                                                          \
    case 4: CHUNKS(fn, 4, __VA_ARGS__) break;                                                                          \
    case 8: CHUNKS(fn, 8, __VA_ARGS__) break;                                                                          \
    }
#define WIDTHS(fn, ...) _Pragma("omp parallel num_threads(threads)") BITS(fn, bits, __VA_ARGS__)

static void logits_at(int64_t B, int64_t n, int64_t d, int64_t w, int bits, const uint8_t *codes, const half *scale,
                      const half *zero, int64_t srows, int64_t tg, int64_t dg, const int16_t *counts, const float *q,
                      int64_t G, float *out, int64_t ld, int threads) {
    WIDTHS(logits, codes, scale, zero, srows, tg, dg, counts, q, G, out, ld, threads)
}

/* adds to out */
static void mix_at(int64_t B, int64_t n, int64_t d, int64_t w, int bits, const uint8_t *codes, const half *scale,
                   const half *zero, int64_t srows, int64_t tg, int64_t dg, const int16_t *counts, const float *p,
                   int64_t ld, int64_t G, float *out, int threads) {
    WIDTHS(mix, codes, scale, zero, srows, tg, dg, counts, p, ld, G, out, threads)
}

void packed_logits(int64_t B, int64_t n, int64_t d, int64_t w, int bits, const uint8_t *codes, const half *scale,
                   const half *zero, int64_t srows, int64_t tg, int64_t dg, const int16_t *counts, const float *q,
                   int64_t G, float *out, int threads) {
    logits_at(B, n, d, w, bits, codes, scale, zero, srows, tg, dg, counts, q, G, out, n, threads);
}

void packed_mix(int64_t B, int64_t n, int64_t d, int64_t w, int bits, const uint8_t *codes, const half *scale,
                const half *zero, int64_t srows, int64_t tg, int64_t dg, const int16_t *counts, const float *p,
                int64_t G, float *out, int threads) {
    memset(out, 0, sizeof(float) * B * G * d);
    mix_at(B, n, d, w, bits, codes, scale, zero, srows, tg, dg, counts, p, n, G, out, threads);
}

/* Element i of a plain tensor of dtype `kind`: 0 float32, 1 bfloat16 (the high half of a float32), 2 float16. */
INLINE float element(const void *x, int kind, int64_t i) {
    if (kind == 1) {
        uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return kind == 2 ? (float)((const half *)x)[i] : ((const float *)x)[i];
}

/* e^x in 16 lanes for x <= 0 (the logits less their maximum): x = k ln2 + r with |r| <= ln2 / 2,
 * e^r by Cephes' degree-6 polynomial, 2^k written into the exponent bits (relative error ~1e-7). */
INLINE vf vexp(vf x) {
    const vf least = (vf){0} - 87.0f;
    vi low = x < least;
    x = (vf)((low & (vi)least) | (~low & (vi)x));
    vi k = __builtin_convertvector(x * 1.44269504f - 0.5f, vi); /* rounds to nearest for x <= 0 */
    vf kf = __builtin_convertvector(k, vf);
    vf r = x - kf * 0.693359375f + kf * 2.12194440e-4f;
    vf y = (vf){0} + 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    return y * (vf)((k + 127) << 23);
}

/* p[i] = e^(p[i] - top) for i < len; returns their sum */
INLINE float exp_sum(float *p, int64_t len, float top) {
    vf acc = {0};
    int64_t i = 0;
    for (; i + L <= len; i += L) {
        vf x;
        memcpy(&x, p + i, sizeof x);
        x = vexp(x - top);
        memcpy(p + i, &x, sizeof x);
        acc += x;
    }
    float sum = hsum(acc);
    for (; i < len; i++) sum += (p[i] = expf(p[i] - top));
    return sum;
}

/* One KV head's whole attention for a few queries, with no mask: its n coded tokens (keys and
 * values packed as above, one Packed part each) then its m newest tokens held plain (keys pk at
 * row stride ksb and token stride kst elements, values pv at vsb, vst; dtype `kind`).
 * q (B, G, d) float32 unscaled; out (B, G, d) float32 = softmax(scale q . k) v over the n + m
 * tokens. What few_queries computes from two packed calls, two products and a softmax, in one
 * call and one parallel region: each thread takes the logits, the exponentials and the mix of
 * its own run of tokens (the first also the plain ones), the threads meet twice for each row's
 * maximum and sum. A decoding step makes one such call per head. */
void packed_attend(int64_t B, int64_t G, int64_t d, int64_t n, int64_t kw, int kbits, const uint8_t *kcodes,
                   const half *kscale, const half *kzero, int64_t ksrows, int64_t ktg, int64_t kdg, const int16_t *kcounts,
                   int64_t vw, int vbits, const uint8_t *vcodes, const half *vscale, const half *vzero, int64_t vsrows,
                   int64_t vtg, int64_t vdg, const int16_t *vcounts, int64_t m, const void *pk, int64_t ksb, int64_t kst,
                   const void *pv, int64_t vsb, int64_t vst, int kind, const float *q, float scale, float *out, int threads) {
    const int64_t t = n + m, R = B * G;
    float *qs = malloc(sizeof(float) * R * d), *p = malloc(sizeof(float) * R * t);
    float *plain = malloc(sizeof(float) * (B * 2 * m * d + 1)); /* row b: m keys, then m values, as float32 */
    float *top = malloc(sizeof(float) * threads * R), *sums = malloc(sizeof(float) * threads * R);
    for (int64_t i = 0; i < R * d; i++) qs[i] = q[i] * scale;
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < m; j++)
            for (int64_t c = 0; c < d; c++) {
                plain[(b * 2 * m + j) * d + c] = element(pk, kind, b * ksb + j * kst + c);
                plain[(b * 2 * m + m + j) * d + c] = element(pv, kind, b * vsb + j * vst + c);
            }
    memset(out, 0, sizeof(float) * R * d);
#pragma omp parallel num_threads(threads)
    {
        const int id = omp_get_thread_num(), count = omp_get_num_threads();
        int64_t t0, t1;
        share(n, &t0, &t1);
        {
            const int64_t w = kw;
            BITS(logits, kbits, kcodes, kscale, kzero, ksrows, ktg, kdg, kcounts, qs, G, p, t, threads)
        }
        for (int64_t r = 0; r < R; r++) {
            float *pr = p + r * t;
            if (id == 0) /* the plain tokens' logits */
                for (int64_t j = 0; j < m; j++) {
                    const float *key = plain + ((r / G) * 2 * m + j) * d, *qr = qs + r * d;
                    float sum = 0.0f;
                    for (int64_t c = 0; c < d; c++) sum += qr[c] * key[c];
                    pr[n + j] = sum;
                }
            float most = -INFINITY;
            for (int64_t i = t0; i < t1; i++) most = pr[i] > most ? pr[i] : most;
            for (int64_t i = n; i < t && id == 0; i++) most = pr[i] > most ? pr[i] : most;
            top[id * R + r] = most;
        }
#pragma omp barrier
        for (int64_t r = 0; r < R; r++) {
            float most = -INFINITY;
            for (int k = 0; k < count; k++) most = top[k * R + r] > most ? top[k * R + r] : most;
            float *pr = p + r * t;
            sums[id * R + r] = exp_sum(pr + t0, t1 - t0, most) + (id == 0 ? exp_sum(pr + n, m, most) : 0.0f);
        }
#pragma omp barrier
        for (int64_t r = 0; r < R; r++) {
            float total = 0.0f;
            for (int k = 0; k < count; k++) total += sums[k * R + r];
            float *pr = p + r * t;
            for (int64_t i = t0; i < t1; i++) pr[i] /= total;
            for (int64_t i = n; i < t && id == 0; i++) pr[i] /= total;
        }
        {
            const int64_t w = vw;
            BITS(mix, vbits, vcodes, vscale, vzero, vsrows, vtg, vdg, vcounts, p, t, G, out, threads)
        }
        if (id == 0 && m > 0) {
            for (int64_t r = 0; r < R; r++) {
                const float *values = plain + ((r / G) * 2 * m + m) * d, *pr = p + r * t + n;
#pragma omp critical
                for (int64_t j = 0; j < m; j++)
                    for (int64_t c = 0; c < d; c++) out[r * d + c] += pr[j] * values[j * d + c];
            }
        }
    }
    free(qs), free(p), free(plain), free(top), free(sums);
}
