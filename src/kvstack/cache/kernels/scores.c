/* A linear predictor's scores summed as each token's features are computed, never written out
 * (kvstack.methods.learned.features: `features` spells every feature out, `linear_scores` is the
 * same sum in torch; tests hold the three equal). Per row (a sequence's KV head), two passes:
 * first the row's mean key and value directions and mean norms over its valid tokens, then per
 * token its key and value (and, for the "local" set, their squares) against the weights, the
 * cosines with the mean directions, the log norms over the mean norms and, "local", the cosine
 * with the previous token, the cosine with and log distance to the mean of the WINDOW tokens
 * before it (a running sum), and the log of its age.
 *
 * Layout (every array contiguous, B = batch rows x KV heads, row j*h + i: sequence j, head i):
 *   keys, values (B, n, d) float32; valid (B, n) uint8; ages (B, n) float32 (read by "local"
 *   only); weight (h, o, F) float32, F = 2d + 4 ("kv") or 4d + 11 ("local"), in the order
 *   `features` writes them; out (B, n, o) float32 (no bias). With `turns` (P, d) float32, the
 *   cosines then the sines of position x RoPE's inverse frequencies for positions 0..P-1, the
 *   keys are after RoPE at `positions` (B, n) int32 and are turned back first (half-split pairs
 *   i, i + d/2, as `models.rope.rotate`); NULL: they are before RoPE already.
 * Callers guarantee d % 16 == 0 and d <= 256. Rows and runs of CHUNK tokens are shared among `threads`
 * OpenMP threads; a run starts its window sum from the WINDOW tokens before it. */
#include <math.h>
#include <string.h>

#include "common.h"

#define WINDOW 16 /* features.WINDOW */
#define CHUNK 256
#define MAX_NV 16 /* d <= 256 */

typedef float vu __attribute__((vector_size(4 * L), aligned(4))); /* a vector read anywhere (rows of F floats) */

typedef struct {
    vf dir[MAX_NV]; /* mean direction (d / 16 vectors) */
    float dir_norm, mean_norm;
} Anchor;

INLINE float dot(const vu *a, const vu *b, int64_t nv) {
    vf acc = {0};
    for (int64_t v = 0; v < nv; v++) acc += a[v] * b[v];
    return hsum(acc);
}

INLINE float cosine(float xy, float nx, float ny) { return xy / fmaxf(nx * ny, 1e-8f); }

/* The mean direction and mean norm of x (n, d) over its valid tokens. */
INLINE Anchor anchor_of(const float *x, const uint8_t *valid, int64_t n, int64_t d) {
    const int64_t nv = d / L;
    Anchor a;
    memset(&a, 0, sizeof a);
    float count = 0, norms = 0;
    for (int64_t t = 0; t < n; t++) {
        if (!valid[t]) continue;
        const vu *xt = (const vu *)(x + t * d);
        const float norm = fmaxf(sqrtf(dot(xt, xt, nv)), 1e-6f);
        for (int64_t v = 0; v < nv; v++) a.dir[v] += xt[v] / norm;
        count += 1, norms += norm;
    }
    count = fmaxf(count, 1);
    for (int64_t v = 0; v < nv; v++) a.dir[v] /= count;
    a.dir_norm = sqrtf(dot((const vu *)a.dir, (const vu *)a.dir, nv));
    a.mean_norm = norms / count;
    return a;
}

/* Tokens [t0, t1) of one row of x: their weighted features added into acc (t1 - t0, o); w (o, F)
 * this head's weights, `at` where x's block starts in F (its own key/value block and squares). */
INLINE void score_run(const float *x, const uint8_t *valid, int64_t d, int64_t t0, int64_t t1,
                      const Anchor *a, int local, const float *w, int64_t o, int64_t F, int which, float *acc) {
    const int64_t nv = d / L;
    vf window[MAX_NV] = {{0}};
    float in_window = 0;
    if (local)
        for (int64_t j = t0 - WINDOW > 0 ? t0 - WINDOW : 0; j < t0; j++)
            if (valid[j]) {
                for (int64_t v = 0; v < nv; v++) window[v] += ((const vu *)(x + j * d))[v];
                in_window += 1;
            }
    /* where this set's features sit in F: its raw block, its two context numbers, its three
     * neighbour numbers and its squares */
    const int64_t raw = which * d, ctx = 2 * d + 2 * which, near = 2 * d + 4 + 3 * which, sq = 2 * d + 11 + which * d;
    for (int64_t t = t0; t < t1; t++) {
        const vu *xt = (const vu *)(x + t * d);
        const float norm = fmaxf(sqrtf(dot(xt, xt, nv)), 1e-6f);
        float f[5];
        f[0] = cosine(dot(xt, (const vu *)a->dir, nv), norm, a->dir_norm);
        f[1] = logf(norm / a->mean_norm);
        if (local) {
            const int64_t p = t > 0 ? t - 1 : 0; /* the first token's "previous" is itself */
            const vu *xp = (const vu *)(x + p * d);
            const float pnorm = valid[p] ? fmaxf(sqrtf(dot(xp, xp, nv)), 1e-6f) : 0;
            f[2] = valid[p] ? cosine(dot(xt, xp, nv), norm, pnorm) : 0;
            const float count = fmaxf(in_window, 1);
            vf mean[MAX_NV], diff[MAX_NV];
            for (int64_t v = 0; v < nv; v++) mean[v] = window[v] / count, diff[v] = xt[v] - mean[v];
            const vu *m = (const vu *)mean, *df = (const vu *)diff;
            f[3] = cosine(dot(xt, m, nv), norm, sqrtf(dot(m, m, nv)));
            f[4] = logf(fmaxf(sqrtf(dot(df, df, nv)), 1e-6f));
            if (valid[t]) { /* the window moves on: this token in, the one WINDOW back out */
                for (int64_t v = 0; v < nv; v++) window[v] += xt[v];
                in_window += 1;
            }
            if (t >= WINDOW && valid[t - WINDOW]) {
                const vu *xo = (const vu *)(x + (t - WINDOW) * d);
                for (int64_t v = 0; v < nv; v++) window[v] -= xo[v];
                in_window -= 1;
            }
        }
        for (int64_t k = 0; k < o; k++) {
            const float *wk = w + k * F;
            const vu *wr = (const vu *)(wk + raw), *ws = (const vu *)(wk + sq);
            vf s = {0};
            if (local)
                for (int64_t v = 0; v < nv; v++) s += (wr[v] + ws[v] * xt[v]) * xt[v];
            else
                for (int64_t v = 0; v < nv; v++) s += wr[v] * xt[v];
            float total = hsum(s) + wk[ctx] * f[0] + wk[ctx + 1] * f[1];
            if (local) total += wk[near] * f[2] + wk[near + 1] * f[3] + wk[near + 2] * f[4];
            acc[(t - t0) * o + k] += total;
        }
    }
}

/* keys (B, n, d) at `positions` turned back to before RoPE into `pre`. */
static void unturn(int64_t B, int64_t n, int64_t d, const float *keys, const int32_t *positions, const float *turns,
                   float *pre, int threads) {
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < B * n; i++) {
        const float *x = keys + i * d, *c = turns + (int64_t)positions[i] * d, *s = c + half;
        float *y = pre + i * d;
        for (int64_t j = 0; j < half; j++) {
            y[j] = x[j] * c[j] + x[j + half] * s[j];
            y[j + half] = x[j + half] * c[j] - x[j] * s[j];
        }
    }
}

void linear_scores(int64_t B, int64_t n, int64_t d, int64_t h, int64_t o, int local, const float *keys,
                   const int32_t *positions, const float *turns, const float *values, const uint8_t *valid,
                   const float *ages, const float *weight, float *out, int threads) {
    const int64_t F = local ? 4 * d + 11 : 2 * d + 4;
    float *pre = NULL;
    if (turns != NULL) {
        pre = malloc(sizeof(float) * B * n * d);
        unturn(B, n, d, keys, positions, turns, pre, threads);
        keys = pre;
    }
    Anchor *anchors = malloc(sizeof(Anchor) * 2 * B);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < 2 * B; r++)
        anchors[r] = anchor_of((r % 2 ? values : keys) + (r / 2) * n * d, valid + (r / 2) * n, n, d);
    const int64_t runs = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int64_t job = 0; job < B * runs; job++) {
        const int64_t r = job / runs, t0 = (job % runs) * CHUNK, t1 = t0 + CHUNK < n ? t0 + CHUNK : n;
        const float *w = weight + (r % h) * o * F;
        float *acc = out + (r * n + t0) * o;
        memset(acc, 0, sizeof(float) * (t1 - t0) * o);
        score_run(keys + r * n * d, valid + r * n, d, t0, t1, &anchors[2 * r], local, w, o, F, 0, acc);
        score_run(values + r * n * d, valid + r * n, d, t0, t1, &anchors[2 * r + 1], local, w, o, F, 1, acc);
        if (local)
            for (int64_t t = t0; t < t1; t++)
                for (int64_t k = 0; k < o; k++)
                    acc[(t - t0) * o + k] += w[k * F + 2 * d + 10] * logf(fmaxf(ages[r * n + t], 1));
    }
    free(anchors), free(pre);
}
