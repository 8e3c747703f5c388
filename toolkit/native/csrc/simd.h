/*
 * Width-generic float vectors for the kernels: VL lanes, chosen per target.
 *
 *   VL = 16 on AVX-512, 8 on AVX / AVX2, 4 on NEON, SSE and anything else, 1 for the plain-C build
 *   (-DTOOLKIT_VL=N overrides the choice: the tests build x86-64-v3 with 4 lanes to match aarch64).
 *
 * Written with GCC / clang vector extensions only (vector_size, __builtin_shufflevector,
 * __builtin_convertvector), so the same source builds for x86-64 and aarch64 with gcc >= 12 and
 * clang >= 12; the one ISA-specific piece is vfma's fused multiply-add, and its portable twin is
 * the unfused a * b + c.
 *
 * Every kernel is compiled with -ffp-contract=off: the compiler never fuses a multiply and an add
 * on its own, and every fused multiply-add is an explicit vfma / sfma. So the bits a kernel
 * produces are fixed by the source and by two numbers of the build, the lanes VL and whether
 * TOOLKIT_FMA is 1 (kernel_profile() reports both): two builds with the same profile give the same
 * bits, whatever the compiler, the CPU or the -march level. A different profile changes the
 * order or the rounding of some sums (not the matmul's, which is one FMA chain per element in
 * every FMA profile), so the promise "a row's bits do not depend on the batch" is per build.
 */
#ifndef TOOLKIT_SIMD_H
#define TOOLKIT_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef TOOLKIT_VL
#if defined(__AVX512F__)
#define TOOLKIT_VL 16
#elif defined(__AVX__)
#define TOOLKIT_VL 8
#else
#define TOOLKIT_VL 4
#endif
#endif
#define VL TOOLKIT_VL

#if !(VL == 1 || VL == 4 || VL == 8 || VL == 16)
#error "TOOLKIT_VL must be 1, 4, 8 or 16"
#endif

/* vector registers of the target: how many accumulators a kernel may keep */
#if defined(__AVX512F__) || defined(__aarch64__)
#define TOOLKIT_VREGS 32
#else
#define TOOLKIT_VREGS 16
#endif

/* explicit fused multiply-adds where the target has them (and the lanes map onto its registers) */
#if VL == 16 && defined(__AVX512F__)
#include <immintrin.h>
#define TOOLKIT_FMA 1
#define VFMA_ISA(a, b, c) ((vf)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#elif VL == 8 && defined(__FMA__)
#include <immintrin.h>
#define TOOLKIT_FMA 1
#define VFMA_ISA(a, b, c) ((vf)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#elif VL == 4 && defined(__FMA__)
#include <immintrin.h>
#define TOOLKIT_FMA 1
#define VFMA_ISA(a, b, c) ((vf)_mm_fmadd_ps((__m128)(a), (__m128)(b), (__m128)(c)))
#elif VL == 4 && defined(__aarch64__)
#include <arm_neon.h>
#define TOOLKIT_FMA 1
#define VFMA_ISA(a, b, c) ((vf)vfmaq_f32((float32x4_t)(c), (float32x4_t)(a), (float32x4_t)(b)))
#else
#define TOOLKIT_FMA 0
#endif

typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));
typedef int8_t vb __attribute__((vector_size(VL)));

#define INLINE static inline __attribute__((always_inline))

INLINE vf loadv(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
INLINE void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }
/* every lane x, exactly (a vector literal: one broadcast; 0 + x would turn -0.0 into +0.0 and cost an add) */
#if VL == 16
#define REPEAT_VL(x) x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x
#elif VL == 8
#define REPEAT_VL(x) x, x, x, x, x, x, x, x
#elif VL == 4
#define REPEAT_VL(x) x, x, x, x
#else
#define REPEAT_VL(x) x
#endif
INLINE vf splat(float x) { return (vf){REPEAT_VL(x)}; }
INLINE vi splati(int32_t x) { return (vi){REPEAT_VL(x)}; }
INLINE vf vselect(vi mask, vf a, vf b) { /* mask ? a : b, lane-wise (mask lanes -1 or 0) */
    return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}
INLINE vi lane_index(void) {
    vi v;
    for (int i = 0; i < VL; i++) v[i] = i;
    return v;
}

/* a * b + c, fused (one rounding) on an FMA build, else two roundings */
INLINE vf vfma(vf a, vf b, vf c) {
#if TOOLKIT_FMA
    return VFMA_ISA(a, b, c);
#else
    return a * b + c;
#endif
}
INLINE float sfma(float a, float b, float c) {
#if TOOLKIT_FMA
    return __builtin_fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

/* lo <= x <= hi lane-wise, NaN passing through: where x86's max / min instructions map onto the lanes, one
 * each (they return their second operand, here x, when either is NaN), else two selects: the same bits */
#if (VL == 16 && defined(__AVX512F__)) || (VL == 8 && defined(__AVX__)) || (VL == 4 && defined(__SSE__))
#include <immintrin.h>
#endif
INLINE vf vclamp(vf x, float lo, float hi) {
#if VL == 16 && defined(__AVX512F__)
    x = (vf)_mm512_max_ps((__m512)splat(lo), (__m512)x);
    return (vf)_mm512_min_ps((__m512)splat(hi), (__m512)x);
#elif VL == 8 && defined(__AVX__)
    x = (vf)_mm256_max_ps((__m256)splat(lo), (__m256)x);
    return (vf)_mm256_min_ps((__m256)splat(hi), (__m256)x);
#elif VL == 4 && defined(__SSE__)
    x = (vf)_mm_max_ps((__m128)splat(lo), (__m128)x);
    return (vf)_mm_min_ps((__m128)splat(hi), (__m128)x);
#else
    x = vselect(x < splat(lo), splat(lo), x);
    return vselect(x > splat(hi), splat(hi), x);
#endif
}

/* exp: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (Cephes' expf coefficients),
 * scaled by 2^n; x clamped to [-87, 88] (NaN passes through); within 2 ulp. The scalar twin
 * computes exactly what one lane does. */
INLINE vf vexp(vf x) {
    x = vclamp(x, -87.0f, 88.0f);
    vf y = x * splat(1.44269504088896341f);
    vf n = (y + splat(12582912.0f)) - splat(12582912.0f); /* round to nearest (|y| < 2^22) */
    vf r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = vfma(p, r, splat(1.3981999507e-3f));
    p = vfma(p, r, splat(8.3334519073e-3f));
    p = vfma(p, r, splat(4.1665795894e-2f));
    p = vfma(p, r, splat(1.6666665459e-1f));
    p = vfma(p, r, splat(5.0000001201e-1f));
    p = vfma(p, r * r, r) + splat(1.0f);
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)bits;
}
INLINE float sexp(float x) {
    if (x < -87.0f) x = -87.0f;
    if (x > 88.0f) x = 88.0f;
    float y = x * 1.44269504088896341f;
    float n = (y + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = sfma(p, r, 1.3981999507e-3f);
    p = sfma(p, r, 8.3334519073e-3f);
    p = sfma(p, r, 4.1665795894e-2f);
    p = sfma(p, r, 1.6666665459e-1f);
    p = sfma(p, r, 5.0000001201e-1f);
    p = sfma(p, r * r, r) + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* horizontal max and sum of the lanes, by a fixed halving tree: lane j with lane j + w */
#define HREDUCE(NAME, COMBINE)                                                  \
    INLINE float NAME(vf x) {                                                   \
        float a[VL];                                                            \
        memcpy(a, &x, sizeof a);                                                \
        for (int w = VL / 2; w > 0; w /= 2)                                     \
            for (int j = 0; j < w; j++) a[j] = COMBINE(a[j], a[j + w]);         \
        return a[0];                                                            \
    }
#define MAX2(a, b) ((a) > (b) ? (a) : (b))
#define ADD2(a, b) ((a) + (b))
HREDUCE(hmax, MAX2)
HREDUCE(hsum, ADD2)

/* R[t] = the sum (or the maximum) of the VL lanes of P[t], t < VL, in lane t: pairs of vectors are folded
 * by halves (each level combines the low and high half of every lane block), a fixed tree whatever the
 * input */
#if VL == 16
#define LO1 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI1 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO2 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define HI2 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define LO3 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define HI3 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define LO4 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define HI4 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#elif VL == 8
#define LO2 0, 1, 2, 3, 8, 9, 10, 11
#define HI2 4, 5, 6, 7, 12, 13, 14, 15
#define LO3 0, 1, 4, 5, 8, 9, 12, 13
#define HI3 2, 3, 6, 7, 10, 11, 14, 15
#define LO4 0, 2, 4, 6, 8, 10, 12, 14
#define HI4 1, 3, 5, 7, 9, 11, 13, 15
#elif VL == 4
#define LO3 0, 1, 4, 5
#define HI3 2, 3, 6, 7
#define LO4 0, 2, 4, 6
#define HI4 1, 3, 5, 7
#endif
/* the low halves with the high halves: their sum, or (max) the larger (the first where equal) */
INLINE vf fold(vf lo, vf hi, int max) { return max ? vselect((vi)(lo > hi), lo, hi) : lo + hi; }
#define FOLD(a, b, LO, HI, MAX) fold(__builtin_shufflevector(a, b, LO), __builtin_shufflevector(a, b, HI), MAX)

INLINE vf transpose_reduce(const vf P[VL], int max) {
#if VL == 1
    (void)max;
    return P[0];
#else
    vf A[VL];
    int n = VL;
    for (int i = 0; i < n; i++) A[i] = P[i];
#if VL == 16
    for (int i = 0; i < n / 2; i++) A[i] = FOLD(A[2 * i], A[2 * i + 1], LO1, HI1, max);
    n /= 2;
#endif
#if VL >= 8
    for (int i = 0; i < n / 2; i++) A[i] = FOLD(A[2 * i], A[2 * i + 1], LO2, HI2, max);
    n /= 2;
#endif
    for (int i = 0; i < n / 2; i++) A[i] = FOLD(A[2 * i], A[2 * i + 1], LO3, HI3, max);
    return FOLD(A[0], A[1], LO4, HI4, max);
#endif
}
INLINE vf transpose_sum(const vf P[VL]) { return transpose_reduce(P, 0); }
INLINE vf transpose_max(const vf P[VL]) { return transpose_reduce(P, 1); } /* lanes without NaN */

/* the largest entry of a row and whether it holds a NaN: four independent VL-lane maxima over its whole
 * chunks (one chain would wait on each compare), combined, then the rest one by one. A maximum has one
 * value whatever the order of the compares; only which of +0.0 and -0.0 wins a tie between them may
 * differ, and every use subtracts it from the logits or adds a logarithm to it, where the two give the
 * same bits */
INLINE float row_max(const float *row, int64_t V, int *nan) {
    const int64_t vec = V - V % VL, vec4 = V - V % (4 * VL);
    vf m0 = splat(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    vi nanv = splati(0);
    for (int64_t i = 0; i < vec4; i += 4 * VL) {
        const vf a = loadv(row + i), b = loadv(row + i + VL), c = loadv(row + i + 2 * VL), d = loadv(row + i + 3 * VL);
        m0 = vselect(a > m0, a, m0);
        m1 = vselect(b > m1, b, m1);
        m2 = vselect(c > m2, c, m2);
        m3 = vselect(d > m3, d, m3);
        nanv |= (a != a) | (b != b) | (c != c) | (d != d);
    }
    for (int64_t i = vec4; i < vec; i += VL) {
        const vf v = loadv(row + i);
        m0 = vselect(v > m0, v, m0);
        nanv |= v != v;
    }
    m0 = vselect(m1 > m0, m1, m0);
    m2 = vselect(m3 > m2, m3, m2);
    m0 = vselect(m2 > m0, m2, m0);
    float m = -INFINITY;
    *nan = 0;
    for (int i = 0; i < VL; i++) {
        m = m0[i] > m ? m0[i] : m;
        *nan |= nanv[i] != 0;
    }
    for (int64_t i = vec; i < V; i++) {
        *nan |= row[i] != row[i];
        m = row[i] > m ? row[i] : m;
    }
    return m;
}

/* row_logsumexp given the row's maximum and NaN flag (row_max's, or the same values found on another pass) */
INLINE float logsumexp_at(const float *row, int64_t V, float m, int nan) {
    const int64_t vec = V - V % VL;
    if (nan) return NAN;
    if (m == INFINITY || m == -INFINITY) return m;
    vf sv = splat(0.0f);
    for (int64_t i = 0; i < vec; i += VL) sv += vexp(loadv(row + i) - splat(m));
    float s = hsum(sv);
    for (int64_t i = vec; i < V; i++) s += sexp(row[i] - m);
    return m + logf(s);
}

/* ---------------------------------------------------------------- 16-bit floats
 * bf16 (kind H16_BF16) and IEEE binary16 (kind H16_F16) stored as uint16_t. Widening to fp32 is exact
 * (bit shifts and one multiply by a power of two); narrowing rounds to nearest, ties to even, as
 * torch's .to(torch.bfloat16 / torch.float16) does: fp16 keeps subnormals and overflows to inf, NaN
 * stays NaN. A 16-bit kernel multiplies and accumulates in fp32, so its bits are the fp32 kernel's
 * on the widened values. */
enum { H16_NONE = 0, H16_BF16 = 2, H16_F16 = 3 };
typedef uint16_t vh __attribute__((vector_size(2 * VL)));
typedef uint32_t vu __attribute__((vector_size(4 * VL)));

INLINE uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }
INLINE float f32_from(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }

INLINE float widen_h16(uint16_t h, const int kind) {
    if (kind == H16_BF16) return f32_from((uint32_t)h << 16);
    /* fp16: exponent and mantissa moved into fp32's fields, then rebiased by 2^112 (exact, subnormals too) */
    const uint32_t u = h, mag = (u & 0x7fffu) << 13;
    uint32_t bits = f32_bits(f32_from(mag) * 0x1p112f);
    if ((u & 0x7c00u) == 0x7c00u) bits |= 0x7f800000u; /* inf / NaN */
    return f32_from(bits | (u & 0x8000u) << 16);
}

/* fp16 widened and narrowed by the F16C instructions where the lanes map onto them (exact, and the same
 * rounding as narrow_h16: the tests hold both to torch's) */
#if defined(__F16C__) && VL == 8
#include <immintrin.h>
#define F16C_WIDEN(p) ((vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p))))
#define F16C_NARROW(p, v) _mm_storeu_si128((__m128i *)(p), _mm256_cvtps_ph((__m256)(v), _MM_FROUND_TO_NEAREST_INT))
#elif defined(__AVX512F__) && VL == 16
#include <immintrin.h>
#define F16C_WIDEN(p) ((vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p))))
#define F16C_NARROW(p, v) \
    _mm256_storeu_si256((__m256i *)(p), _mm512_cvtps_ph((__m512)(v), _MM_FROUND_TO_NEAREST_INT))
#endif

INLINE vf loadv_h16(const uint16_t *p, const int kind) {
#ifdef F16C_WIDEN
    if (kind == H16_F16) return F16C_WIDEN(p);
#endif
    vh h;
    memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu);
    if (kind == H16_BF16) return (vf)(u << 16);
    vf f = (vf)((u & 0x7fffu) << 13) * splat(0x1p112f);
    vu bits = (vu)f | ((vu)((u & 0x7c00u) == 0x7c00u) & 0x7f800000u);
    return (vf)(bits | (u & 0x8000u) << 16);
}

INLINE uint16_t narrow_h16(float f, const int kind) {
    const uint32_t w = f32_bits(f);
    if (kind == H16_BF16) {
        if ((w & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((w >> 16) | 0x40u); /* NaN, quieted */
        return (uint16_t)((w + 0x7fffu + ((w >> 16) & 1u)) >> 16);
    }
    /* fp16: let fp32 addition do the rounding. |f| is scaled so that values past fp16's range reach inf,
     * then a power of two is added whose ulp is fp16's ulp at f's exponent (never finer than the
     * subnormals' 2^-24): the sum's low bits are f rounded to nearest even in fp16's precision. */
    const uint32_t sign = w & 0x80000000u, twice = w + w;
    if (twice > 0xff000000u) return (uint16_t)(sign >> 16 | 0x7e00u); /* NaN */
    float base = (__builtin_fabsf(f) * 0x1p112f) * 0x1p-110f;
    uint32_t bias = twice & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = f32_from((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    return (uint16_t)(sign >> 16 | (((bits >> 13) & 0x7c00u) + (bits & 0x0fffu)));
}

/* x[0..n) rounded in place to the nearest value of the 16-bit format `kind` (no-op for H16_NONE): VL lanes
 * at a time where the lanes allow, then one by one (the same rounding either way) */
INLINE void round_h16(float *x, int64_t n, const int kind) {
    if (kind == H16_NONE) return;
    int64_t i = 0;
    if (kind == H16_BF16)
        for (; i + VL <= n; i += VL) {
            const vu w = (vu)loadv(x + i);
            const vu nan = (vu)((w & 0x7fffffffu) > 0x7f800000u);
            const vu rounded = (w + 0x7fffu + ((w >> 16) & 1u)) & 0xffff0000u;
            storev(x + i, (vf)((nan & ((w | 0x400000u) & 0xffff0000u)) | (~nan & rounded)));
        }
#ifdef F16C_NARROW
    else
        for (; i + VL <= n; i += VL) {
            uint16_t h[VL];
            F16C_NARROW(h, loadv(x + i));
            storev(x + i, F16C_WIDEN(h));
        }
#endif
    for (; i < n; i++) x[i] = widen_h16(narrow_h16(x[i], kind), kind);
}

/* max + log(sum(exp(x - max))) of a row: NaN if it has a NaN, +inf if it has +inf, -inf if every
 * entry is -inf (toolkit_logsumexp_f32's rows, and the sampler's raw rows: the same bits) */
INLINE float row_logsumexp(const float *row, int64_t V) {
    int nan;
    const float m = row_max(row, V, &nan);
    return logsumexp_at(row, V, m, nan);
}

#endif
