/*
 * Rotary position embedding on the CPU, fp32, in one pass over the packed q|k heads.
 *
 * out[n, h, :] = x * cos[pos[n]] + rotate_half(x) * sin[pos[n]], rotate_half(x) = (-x2, x1),
 * exactly as torch evaluates that expression: each product rounded to fp32, then the sum
 * rounded (the kernels are compiled with -ffp-contract=off, so no multiply-add is fused), so
 * the result is the same bits as the torch expression it replaces. torch spends five passes
 * (two products, a negation, a concatenation, a sum) and a gather of the cos/sin rows on it;
 * at a 512-token prefill chunk that was ~4% of the step (measured A/B).
 */
#include <stdint.h>

#include "kernels.h" /* the entry points this file defines, declared once */

int toolkit_rope_f32(const float *x, int64_t x_row_stride,   /* x[n][h][d] at x + n*x_row_stride + h*D + d */
                     float *out,                              /* [N][heads][D] contiguous */
                     const float *cos_table, const float *sin_table, int64_t max_pos,  /* [max_pos][D] */
                     const int64_t *positions, int64_t N, int64_t heads, int64_t D, int num_threads)
{
    if (D % 2 != 0) return -1;
    for (int64_t n = 0; n < N; n++)
        if (positions[n] < 0 || positions[n] >= max_pos) return -2;
    const int64_t half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (N * heads * D > 65536)
    for (int64_t n = 0; n < N; n++) {
        const float *c = cos_table + positions[n] * D, *s = sin_table + positions[n] * D;
        for (int64_t h = 0; h < heads; h++) {
            const float *xi = x + n * x_row_stride + h * D;
            float *o = out + (n * heads + h) * D;
            for (int64_t d = 0; d < half; d++) o[d] = xi[d] * c[d] + (-xi[d + half]) * s[d];
            for (int64_t d = half; d < D; d++) o[d] = xi[d] * c[d] + xi[d - half] * s[d];
        }
    }
    return 0;
}
