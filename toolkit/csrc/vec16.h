/*
 * 16-float vectors (GCC vector extensions: one AVX-512 register, two AVX2 ones) and the helpers
 * the kernels share. Included by paged_attention.c and rowwise.c; the kernel cache key covers it.
 */
#ifndef TOOLKIT_VEC16_H
#define TOOLKIT_VEC16_H

#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline v16 vselect(vi16 mask, v16 a, v16 b) {  /* mask ? a : b, lane-wise (mask lanes -1 or 0) */
    return (v16)(((vi16)a & mask) | ((vi16)b & ~mask));
}

/* exp on 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (Cephes' expf
 * coefficients), scaled by 2^n; x clamped to [-87, 88] (NaN passes through); within 2 ulp */
static inline v16 vexp(v16 x) {
    x = vselect(x < splat(-87.0f), splat(-87.0f), x);
    x = vselect(x > splat(88.0f), splat(88.0f), x);
    v16 y = x * splat(1.44269504088896341f);
    v16 n = (y + splat(12582912.0f)) - splat(12582912.0f);  /* round to nearest (|y| < 2^22) */
    v16 r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    v16 p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.0f);
    vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
    return p * (v16)bits;
}

/* horizontal max and sum of 16 lanes, by a fixed tree of shuffles */
static inline float hmax16(v16 x) {
    const vi16 s8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    const vi16 s4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
    const vi16 s2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const vi16 s1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    v16 y;
    y = __builtin_shuffle(x, s8); x = vselect(x > y, x, y);
    y = __builtin_shuffle(x, s4); x = vselect(x > y, x, y);
    y = __builtin_shuffle(x, s2); x = vselect(x > y, x, y);
    y = __builtin_shuffle(x, s1); x = vselect(x > y, x, y);
    return x[0];
}

static inline float hsum16(v16 x) {
    const vi16 s8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    const vi16 s4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
    const vi16 s2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const vi16 s1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    x += __builtin_shuffle(x, s8);
    x += __builtin_shuffle(x, s4);
    x += __builtin_shuffle(x, s2);
    x += __builtin_shuffle(x, s1);
    return x[0];
}

#endif
