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
 * other rows or on the number of threads. The bits are not torch's (sums are taken in 16 lanes;
 * exp is a degree-6 polynomial after range reduction, within 2 ulp); argmax is torch's exactly
 * (the first maximal index; a NaN counts as the maximum).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec16.h"  /* v16, load16 / store16 / splat / vselect, vexp, hsum16 */

int toolkit_add_rms_norm_f32(float *x, int64_t ldx, const float *r, int64_t ldr, const float *w, float eps,
                             float *h, int64_t ldh, int64_t N, int64_t D, int threads) {
    if (D % 16 != 0) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N * D >= 65536)
    for (int64_t n = 0; n < N; n++) {
        float *xr = x + n * ldx, *hr = h + n * ldh;
        const float *rr = r ? r + n * ldr : 0;
        v16 acc = splat(0.0f);
        for (int64_t d = 0; d < D; d += 16) {
            v16 v = load16(xr + d);
            if (rr) {
                v = v + load16(rr + d);
                store16(xr + d, v);
            }
            acc = acc + v * v;
        }
        const float inv = 1.0f / sqrtf(hsum16(acc) / (float)D + eps);
        for (int64_t d = 0; d < D; d += 16) store16(hr + d, load16(w + d) * (load16(xr + d) * inv));
    }
    return 0;
}

int toolkit_silu_mul_f32(const float *gu, int64_t ldgu, float *h, int64_t ldh, int64_t N, int64_t F, int threads) {
    if (F % 16 != 0) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N * F >= 32768)
    for (int64_t n = 0; n < N; n++) {
        const float *g = gu + n * ldgu, *u = g + F;
        float *hr = h + n * ldh;
        for (int64_t f = 0; f < F; f += 16) {
            const v16 gv = load16(g + f);
            store16(hr + f, gv / (splat(1.0f) + vexp(-gv)) * load16(u + f));
        }
    }
    return 0;
}

/* lse[r] = max + log(sum(exp(x - max))) of row r: NaN if the row has a NaN, +inf if it has +inf,
   -inf if every entry is -inf */
int toolkit_logsumexp_f32(const float *x, int64_t ldx, int64_t R, int64_t V, float *lse, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && R > 1)
    for (int64_t r = 0; r < R; r++) {
        const float *row = x + r * ldx;
        const int64_t vec = V - V % 16;
        v16 mv = splat(-INFINITY);
        vi16 nanv = {0};
        for (int64_t i = 0; i < vec; i += 16) {
            const v16 v = load16(row + i);
            mv = vselect(v > mv, v, mv);
            nanv |= v != v;
        }
        float m = -INFINITY;
        int nan = 0;
        for (int i = 0; i < 16; i++) {
            m = mv[i] > m ? mv[i] : m;
            nan |= nanv[i] != 0;
        }
        for (int64_t i = vec; i < V; i++) {
            nan |= row[i] != row[i];
            m = row[i] > m ? row[i] : m;
        }
        if (nan) { lse[r] = NAN; continue; }
        if (m == INFINITY || m == -INFINITY) { lse[r] = m; continue; }
        v16 sv = splat(0.0f);
        for (int64_t i = 0; i < vec; i += 16) sv += vexp(load16(row + i) - splat(m));
        float s = hsum16(sv);
        for (int64_t i = vec; i < V; i++) s += expf(row[i] - m);
        lse[r] = m + logf(s);
    }
    return 0;
}

/* out[r] = the first index of row r's maximum (of its first NaN, if it has one) */
int toolkit_argmax_f32(const float *x, int64_t ldx, int64_t R, int64_t V, int64_t *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && R > 1)
    for (int64_t r = 0; r < R; r++) {
        const float *row = x + r * ldx;
        const int64_t vec = V - V % 16;
        const vi16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        v16 best = splat(-INFINITY);
        vi16 where = lane;  /* a lane's first index holding its maximum (strict >: later ties lose) */
        vi16 nanv = {0};
        for (int64_t i = 0; i < vec; i += 16) {
            const v16 v = load16(row + i);
            const vi16 better = v > best;
            best = vselect(better, v, best);
            where = (better & (lane + (int32_t)i)) | (~better & where);
            nanv |= v != v;
        }
        float m = -INFINITY;
        int64_t at = 0;  /* every entry -inf (or none): the first */
        int nan = 0;
        for (int i = 0; i < 16 && vec; i++) {
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
