/*
 * Row-wise fp32 kernels for the CPU, one pass (or two over a row that stays in cache) each:
 *
 * - toolkit_add_rms_norm_f32: x = x + r (when r is given), h = w * (x * 1 / sqrt(mean(x^2) + eps));
 *   the residual add that precedes every RMSNorm fused with it.
 * - toolkit_silu_mul_f32: h = silu(g) * u = g / (1 + exp(-g)) * u from a fused [g | u] row.
 * - toolkit_logsumexp_f32 / toolkit_argmax_f32: of each logits row, for the sampler (torch took
 *   1.2 and 2.0 ms at 32 rows of 49,152 here; these 0.7 and 0.2 ms).
 *
 * torch spends 55-90 us on an add + RMSNorm at 1-64 rows and 0.36 ms at 512 rows here, and 4 ms
 * on SiLU * up at 512 rows of 1,536 (several kernels and thread hand-offs for a few hundred KB);
 * these take 25-37 us (mostly the call), 0.12 ms and 0.43 ms.
 * Each row is computed by one thread in a fixed order, so a row's bits do not depend on the
 * other rows or on the number of threads. The bits are not torch's (sums are taken in VL lanes;
 * exp is a degree-6 polynomial after range reduction, within 2 ulp); argmax is torch's exactly
 * (the first maximal index; a NaN counts as the maximum).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h" /* vf / vi (VL lanes), loadv / storev / splat / vselect, vexp / sexp, hsum */
#include "kernels.h" /* the entry points this file defines, declared once */

int toolkit_add_rms_norm_f32(float *x, int64_t ldx, const float *r, int64_t ldr, const float *w, float eps,
                             float *h, int64_t ldh, int64_t N, int64_t D, int threads) {
    const int64_t vec = D - D % VL;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N * D >= 65536)
    for (int64_t n = 0; n < N; n++) {
        float *xr = x + n * ldx, *hr = h + n * ldh;
        const float *rr = r ? r + n * ldr : 0;
        vf acc = splat(0.0f);
        for (int64_t d = 0; d < vec; d += VL) {
            vf v = loadv(xr + d);
            if (rr) {
                v = v + loadv(rr + d);
                storev(xr + d, v);
            }
            acc = acc + v * v;
        }
        float tail = 0.0f;
        for (int64_t d = vec; d < D; d++) {
            if (rr) xr[d] = xr[d] + rr[d];
            tail = tail + xr[d] * xr[d];
        }
        const float inv = 1.0f / sqrtf((hsum(acc) + tail) / (float)D + eps);
        for (int64_t d = 0; d < vec; d += VL) storev(hr + d, loadv(w + d) * (loadv(xr + d) * splat(inv)));
        for (int64_t d = vec; d < D; d++) hr[d] = w[d] * (xr[d] * inv);
    }
    return 0;
}

int toolkit_silu_mul_f32(const float *gu, int64_t ldgu, float *h, int64_t ldh, int64_t N, int64_t F, int threads) {
    const int64_t vec = F - F % VL;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N * F >= 32768)
    for (int64_t n = 0; n < N; n++) {
        const float *g = gu + n * ldgu, *u = g + F;
        float *hr = h + n * ldh;
        for (int64_t f = 0; f < vec; f += VL) {
            const vf gv = loadv(g + f);
            storev(hr + f, gv / (splat(1.0f) + vexp(-gv)) * loadv(u + f));
        }
        for (int64_t f = vec; f < F; f++) hr[f] = g[f] / (1.0f + sexp(-g[f])) * u[f];
    }
    return 0;
}

/* lse[r] = max + log(sum(exp(x - max))) of row r: NaN if the row has a NaN, +inf if it has +inf,
   -inf if every entry is -inf */
int toolkit_logsumexp_f32(const float *x, int64_t ldx, int64_t R, int64_t V, float *lse, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && R > 1)
    for (int64_t r = 0; r < R; r++) lse[r] = row_logsumexp(x + r * ldx, V);
    return 0;
}

/* out[r] = the first index of row r's maximum (of its first NaN, if it has one) */
int toolkit_argmax_f32(const float *x, int64_t ldx, int64_t R, int64_t V, int64_t *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && R > 1)
    for (int64_t r = 0; r < R; r++) {
        const float *row = x + r * ldx;
        const int64_t vec = V - V % VL;
        const vi lane = lane_index();
        vf best = splat(-INFINITY);
        vi where = lane; /* a lane's first index holding its maximum (strict >: later ties lose) */
        vi nanv = splati(0);
        for (int64_t i = 0; i < vec; i += VL) {
            const vf v = loadv(row + i);
            const vi better = v > best;
            best = vselect(better, v, best);
            where = (better & (lane + (int32_t)i)) | (~better & where);
            nanv |= v != v;
        }
        float m = -INFINITY;
        int64_t at = 0; /* every entry -inf (or none): the first */
        int nan = 0;
        for (int i = 0; i < VL && vec; i++) {
            if (best[i] > m || (best[i] == m && where[i] < at)) { m = best[i]; at = where[i]; }
            nan |= nanv[i] != 0;
        }
        for (int64_t i = vec; i < V && !nan; i++) {
            if (row[i] != row[i]) nan = 1;
            else if (row[i] > m) { m = row[i]; at = i; }
        }
        if (nan)
            for (int64_t i = 0; i < V; i++)
                if (row[i] != row[i]) { at = i; break; }
        out[r] = at;
    }
    return 0;
}
