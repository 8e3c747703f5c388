/*
 * Gumbel-max sampling with counter-based noise, a whole step's rows in one call.
 *
 * token = argmax_i (logit_i + G_i) over the finite logits of a row, G_i = -log(-log(u_i)) and
 * u_i = (bits53(i) + 0.5) * 2^-53, bits53 = (a << 21) | (b >> 11), a = mix32(mix32(2i + 1) ^ k0),
 * b = mix32(a ^ k1), (k0, k1) the row's key (toolkit/sampling/rng.py derives it from seed, position, stream
 * and purpose). The logarithm is our own (fdlibm's reduction to [sqrt(1/2), sqrt(2)) and its
 * degree-14 odd polynomial, within 1 ulp) in +, -, *, / of doubles only, and every build is
 * -ffp-contract=off: each lane is computed alone, so the noise's bits are the same on every CPU,
 * every width and every compiler, and equal to the torch and Python twins in rng.py.
 *
 * A row whose finite logits are fewer than a quarter of the vocabulary (top-k, top-p, min-p,
 * a grammar) is sampled over those ids only, never materialising a vocabulary-wide noise row.
 * Ties go to the lowest id, as torch.argmax's. Rows run in parallel; each row is one thread's.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h" /* VL, INLINE */
#include "kernels.h" /* the entry points this file defines, declared once */
#if (VL == 16 && defined(__AVX512F__)) || (VL == 8 && defined(__AVX__)) || (VL == 4 && defined(__SSE4_1__))
#include <immintrin.h>
#elif VL == 4 && defined(__aarch64__)
#include <arm_neon.h>
#endif

typedef uint32_t vu __attribute__((vector_size(4 * VL)));
typedef int64_t vq __attribute__((vector_size(8 * VL)));
typedef double vd __attribute__((vector_size(8 * VL)));

/* the logits of the chunk at i (VL lanes; -inf past the row's end) */
INLINE vf chunk(const float *row, int64_t V, int64_t i) {
    if (i + VL <= V) return loadv(row + i);
    vf v = splat(-INFINITY);
    for (int64_t j = i; j < V; j++) v[j - i] = row[j];
    return v;
}

/* lanes -1 where the logit is finite (neither infinite nor NaN), 0 elsewhere */
INLINE vi finite_mask(vf v) { return (vi)(((vu)v & 0x7FFFFFFFu) < 0x7F800000u); }

/* whether any lane of a mask is set: one test instruction where the target has one (it is asked per chunk
 * of the vocabulary), else an OR-halving tree over the lanes; the same answer either way */
INLINE int any_lane(vi mask) {
#if VL == 16 && defined(__AVX512F__)
    return _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask) != 0;
#elif VL == 8 && defined(__AVX__)
    return !_mm256_testz_si256((__m256i)mask, (__m256i)mask);
#elif VL == 4 && defined(__SSE4_1__)
    return !_mm_testz_si128((__m128i)mask, (__m128i)mask);
#elif VL == 4 && defined(__aarch64__)
    return vmaxvq_u32((uint32x4_t)mask) != 0;
#else
    int32_t lanes[VL];
    memcpy(lanes, &mask, sizeof lanes);
    for (int w = VL / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) lanes[j] |= lanes[j + w];
    return lanes[0] != 0;
#endif
}

/* dst[n..] = the lanes of v whose mask is set, in lane order (dst has room for VL more); the new n.
 * AVX-512 compresses the lanes in a register and stores them at once; other targets append lane by
 * lane, branch-free. The same values either way: this only moves data. */
INLINE int64_t append_lanes(uint32_t *dst, int64_t n, vi mask, vu v) {
#if VL == 16 && defined(__AVX512F__)
    const __mmask16 k = _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask);
    const __m512i packed = _mm512_maskz_compress_epi32(k, (__m512i)v);
    memcpy(dst + n, &packed, sizeof packed);
    return n + __builtin_popcount(k);
#else
    for (int j = 0; j < VL; j++) {
        dst[n] = v[j];
        n += mask[j] != 0;
    }
    return n;
#endif
}

INLINE vu mix32(vu x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x5BD1E995u;
    return x ^ (x >> 16);
}

/* log(x) for positive normal doubles, lane by lane */
INLINE vd dlog(vd x) {
    vq bits;
    memcpy(&bits, &x, sizeof bits);
    vq mant = bits & 0x000FFFFFFFFFFFFFLL;
    vq big = mant > 0x6A09E667F3BCDLL; /* mantissa above sqrt(2): halve it (lanes -1 or 0) */
    vq e = (bits >> 52) - 1023 - big;
    vq mbits = mant | (0x3FF0000000000000LL - (big & 0x0010000000000000LL));
    vd m, k = __builtin_convertvector(e, vd);
    memcpy(&m, &mbits, sizeof m);
    vd f = m - 1.0;
    vd s = f / (2.0 + f);
    vd z = s * s, w = z * z;
    vd t1 = w * (3.999999999940941908e-01 + w * (2.222219843214978396e-01 + w * 1.531383769920937332e-01));
    vd t2 = z * (6.666666666666735130e-01 +
                 w * (2.857142874366239149e-01 + w * (1.818357216161805012e-01 + w * 1.479819860511658591e-01)));
    vd r = t2 + t1;
    vd hfsq = 0.5 * f * f;
    return k * 6.93147180369123816490e-01 - ((hfsq - (s * (hfsq + r) + k * 1.90821492927058770002e-10)) - f);
}

/* the noise of VL token ids under a key */
INLINE vd gumbel(vu ids, uint32_t k0, uint32_t k1) {
    vu a = mix32(mix32(ids * 2u + 1u) ^ k0);
    vu b = mix32(a ^ k1);
    vq bits = (__builtin_convertvector(a, vq) << 21) | __builtin_convertvector(b >> 11, vq);
    vd u = (__builtin_convertvector(bits, vd) + 0.5) * 0x1p-53;
    return -dlog(-dlog(u));
}

typedef struct {
    vd best;  /* per lane: the largest logit + noise so far */
    vq index; /* and its id (-1: none) */
} lanes_best;

INLINE void consider(lanes_best *b, vd value, vq ids, vq valid) {
    vq better = (value > b->best) & valid;
    b->best = (vd)(((vq)value & better) | ((vq)b->best & ~better));
    b->index = (ids & better) | (b->index & ~better);
}

/* the lane winner: the largest value, the lowest id among equals; -1 when no lane saw a finite logit */
static int64_t reduce(const lanes_best *b) {
    double best = -INFINITY;
    int64_t index = -1;
    for (int j = 0; j < VL; j++) {
        if (b->index[j] < 0) continue;
        if (index < 0 || b->best[j] > best || (b->best[j] == best && b->index[j] < index)) {
            best = b->best[j];
            index = b->index[j];
        }
    }
    return index;
}

/*
 * The Gumbel-max token of one row. Over the whole vocabulary most tokens cannot win and are skipped
 * before their noise is computed: the winner's value is at least bound = m + G(top), m the largest
 * logit, and token i reaches it only if G_i >= bound - x_i, i.e. -log(u_i) <= exp(x_i - bound); as
 * -log(u) >= 1 - u, a token with 1 - u_i > exp(x_i - bound) cannot win (tested on a lower bound of
 * 1 - u_i from u's top 32 bits, with a 0.1% margin for vexp's 2 ulp and the float rounding). What is left, a few tokens a row, gets the exact
 * noise; the result is the same token with the same noise as evaluating every token.
 */
static int64_t sample_row(const float *x, int64_t V, const int32_t *ids, int64_t n_ids, uint32_t k0, uint32_t k1) {
    lanes_best b = {{0}, {0}};
    for (int j = 0; j < VL; j++) {
        b.best[j] = -INFINITY;
        b.index[j] = -1;
    }
    vu lane = {0};
    for (int j = 0; j < VL; j++) lane[j] = (uint32_t)j;
    if (!ids) { /* the whole vocabulary, pruned: see the comment above */
        vf mv = splat(-INFINITY);
        for (int64_t i = 0; i < V; i += VL) {
            vf l = chunk(x, V, i);
            mv = vselect(finite_mask(l) & (vi)(l > mv), l, mv);
        }
        const float m = hmax(mv);
        if (m == -INFINITY) return -1; /* no finite logit */
        int64_t top = 0;
        while (x[top] != m) top++; /* the first largest finite logit */
        vu id = {0};
        id[0] = (uint32_t)top;
        const double bound = (double)m + gumbel(id, k0, k1)[0]; /* the winner's value is at least this */
        vq first = {0};
        first[0] = -1;
        consider(&b, __builtin_convertvector(chunk(x, V, top), vd) + gumbel(id, k0, k1),
                 __builtin_convertvector(id, vq), first);
        for (int64_t i = 0; i < V; i += VL) {
            vf l = chunk(x, V, i);
            id = lane + (uint32_t)i;
            /* u's top 32 bits are a: 1 - u >= (2^32 - 1 - a) 2^-32, which needs no second hash */
            vu a = mix32(mix32(id * 2u + 1u) ^ k0);
            vf one_minus_u = __builtin_convertvector(0xFFFFFFFFu - a, vf) * splat(0x1p-32f);
            vf reach = vexp(vselect(finite_mask(l), l - splat((float)bound), splat(-100.0f)));
            vi may_win = finite_mask(l) & (vi)(one_minus_u <= reach * splat(1.001f));
            if (!any_lane(may_win)) continue;
            vd value = __builtin_convertvector(l, vd) + gumbel(id, k0, k1);
            consider(&b, value, __builtin_convertvector(id, vq), __builtin_convertvector(may_win, vq));
        }
    } else { /* the finite ids only */
        for (int64_t i = 0; i < n_ids; i += VL) {
            vf l = splat(-INFINITY);
            vu id = {0};
            vq valid = {0};
            for (int j = 0; j < VL && i + j < n_ids; j++) {
                id[j] = (uint32_t)ids[i + j];
                l[j] = x[ids[i + j]];
                valid[j] = -1;
            }
            vd value = __builtin_convertvector(l, vd) + gumbel(id, k0, k1);
            consider(&b, value, __builtin_convertvector(id, vq), valid);
        }
    }
    return reduce(&b);
}

/* the noise itself for n ids under one key (checks and the twins' tests) */
int toolkit_gumbel_noise(const int32_t *ids, int64_t n, uint32_t k0, uint32_t k1, double *out) {
    for (int64_t i = 0; i < n; i += VL) {
        vu id = {0};
        for (int j = 0; j < VL && i + j < n; j++) id[j] = (uint32_t)ids[i + j];
        vd g = gumbel(id, k0, k1);
        for (int j = 0; j < VL && i + j < n; j++) out[i + j] = g[j];
    }
    return 0;
}

/*
 * Truncation of the support in one call for a step's rows: top-p (mode 0, param p) keeps the smallest
 * highest-probability set whose mass reaches p (the token that crosses p, and tokens tied with it);
 * top-k (mode 1, param k) keeps the k largest logits and tokens tied with the k-th. Both find the
 * row's threshold t (keep x >= t, the rest becomes -inf) by bisection over the logits'
 * order-preserving 32-bit keys, no sort. The "mass" is exp(x - max) (vexp, within 2 ulp) for top-p,
 * summed in float lanes per block and double lanes across blocks in a fixed order, and 1 per token
 * for top-k (exact counts).
 *
 * The bisection runs over candidates only, the tokens at or above a floor that t cannot be below:
 * top-p: max - ln(V / (1 - p)) - 1 (each token under it has mass < e^-1 (1 - p) / V of the top
 * token's, so together they hold less than 1 - p of the row); top-k: the k-th largest of the maxima
 * of the row's VL-token chunks (k distinct tokens reach it). On SmolLM2's logits ~3% of the
 * vocabulary are candidates. Should rounding leave the candidates short of the target, the search
 * repeats over every finite token. A row without a finite logit is copied unchanged.
 * Returns 0, or -1 if out of memory.
 */
typedef double vdl __attribute__((vector_size(8 * VL)));


INLINE float key_value(uint32_t k) {
    uint32_t u = (k & 0x80000000u) ? k & 0x7FFFFFFFu : ~k;
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* the mass of the tokens whose key is above `above`: float lanes over blocks of 32 vectors, each
 * block's sums added into VL double lanes, the lanes summed by a halving tree (a fixed order) */
static double mass_above(const uint32_t *keys, const float *e, int64_t n, uint32_t above) {
    vdl acc = {0};
    for (int64_t start = 0; start < n; start += 32 * VL) { /* n is padded to VL with zero mass */
        const int64_t end = start + 32 * VL < n ? start + 32 * VL : n;
        vf part = splat(0.0f);
        for (int64_t i = start; i < end; i += VL) {
            vu k;
            vf v;
            memcpy(&k, keys + i, sizeof k);
            memcpy(&v, e + i, sizeof v);
            part += vselect((vi)(k > above), v, splat(0.0f));
        }
        acc += __builtin_convertvector(part, vdl);
    }
    double lanes[VL];
    memcpy(lanes, &acc, sizeof lanes);
    for (int w = VL / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) lanes[j] += lanes[j + w];
    return lanes[0];
}

enum { TOP_P = 0, TOP_K = 1 };

/* the smallest key whose mass above is < target among n candidates (keys, e: padded to VL with 0),
 * or 0 when even all of them hold less than the target */
static uint32_t bisect(uint32_t *keys, float *e, int64_t n, double target) {
    vu lov, hiv; /* the smallest and largest key of the candidates (padding has mass 0) */
    for (int j = 0; j < VL; j++) lov[j] = 0xFFFFFFFFu, hiv[j] = 0u;
    for (int64_t i = 0; i < n; i += VL) {
        vu k;
        vf v;
        memcpy(&k, keys + i, sizeof k);
        memcpy(&v, e + i, sizeof v);
        const vu real = (vu)(v != splat(0.0f));
        lov = (vu)vselect((vi)(real & (k < lov)), (vf)k, (vf)lov);
        hiv = (vu)vselect((vi)(real & (k > hiv)), (vf)k, (vf)hiv);
    }
    uint32_t lo = 0xFFFFFFFFu, hi = 0;
    for (int j = 0; j < VL; j++) {
        lo = lov[j] < lo ? lov[j] : lo;
        hi = hiv[j] > hi ? hiv[j] : hi;
    }
    uint32_t below = lo - 1u; /* lo >= 0x00800000 for a finite float, so no wrap */
    if (hi == 0 || mass_above(keys, e, n, below) < target) return 0;
    /* invariants: mass above hi < target (nothing is above the largest key), mass above `below` >= target;
     * every fourth pass drops the tokens the bracket has settled (key <= below never counts again;
     * key > hi always does, its mass added once, in index order) */
    double settled = 0.0;
    for (int pass = 0; hi - below > 1u; pass++) {
        uint32_t mid = below + (hi - below) / 2u;
        if (settled + mass_above(keys, e, n, mid) < target)
            hi = mid;
        else
            below = mid;
        if (pass % 4 == 3) {
            int64_t kept = 0;
            for (int64_t i = 0; i < n; i += VL) { /* in place: a block is stored at or before where it was */
                vu k;
                vf v;
                memcpy(&k, keys + i, sizeof k);
                memcpy(&v, e + i, sizeof v);
                const vi above = (vi)(k > hi);
                if (any_lane(above)) /* index order, one by one (adding the 0.0s skipped changes nothing) */
                    for (int j = 0; j < VL; j++)
                        if (above[j]) settled += (double)v[j];
                const vi keep = (vi)((k > below) & (k <= hi));
                append_lanes((uint32_t *)e, kept, keep, (vu)v);
                kept = append_lanes(keys, kept, keep, k);
            }
            for (n = kept; n % VL; n++) keys[n] = 0u, e[n] = 0.0f;
        }
    }
    return hi; /* a logit's key: the mass changes there */
}

/* gather the finite tokens at or above `floor` (keys, masses) into the scratch; the row's total mass */
static int64_t candidates(const float *row, int64_t V, int mode, float m, float floor, uint32_t *keys, float *e,
                          double *total) {
    int64_t n = 0;
    vdl acc = {0};
    for (int64_t start = 0; start < V; start += 32 * VL) {
        vf part = splat(0.0f);
        for (int64_t i = start; i < V && i < start + 32 * VL; i += VL) {
            vf v = chunk(row, V, i);
            vi finite = finite_mask(v);
            vf ev = mode == TOP_P ? vexp(vselect(finite, v, splat(m)) - splat(m)) : splat(1.0f);
            ev = vselect(finite, ev, splat(0.0f));
            part += ev;
            vi take = finite & (vi)(v >= splat(floor));
            if (!any_lane(take)) continue;
            vu u = (vu)v;
            vu key = (vu)vselect((vi)(u >> 31) != 0, (vf)~u, (vf)(u | 0x80000000u));
            append_lanes((uint32_t *)e, n, take, (vu)ev);
            n = append_lanes(keys, n, take, key);
        }
        acc += __builtin_convertvector(part, vdl);
    }
    for (int64_t pad = n; pad % VL; pad++) keys[pad] = 0u, e[pad] = 0.0f;
    double lanes[VL];
    memcpy(lanes, &acc, sizeof lanes);
    for (int w = VL / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) lanes[j] += lanes[j + w];
    *total = lanes[0];
    return (n + VL - 1) / VL * VL;
}

/* a row's maxima where the pass that wrote it saw them (known 0: nobody did): its largest entry with NaN
 * aside (row_max's), whether it holds a NaN, and its largest finite entry (finite_max's). A maximum has one
 * value whatever the order of its compares (see row_max on +0.0 and -0.0), so later passes take these
 * instead of reading the row again. Truncation keeps all three (it keeps the row's largest entries and
 * its NaNs). */
typedef struct {
    float all, finite;
    int nan, known;
} row_maxima;

/* o = row / t (the temperature processor's division), noting o's maxima; returns row's largest entry (NaN
 * aside, row_max's). For a finite t > 0 the division keeps the order of the entries (correctly rounded, it
 * never swaps two) and makes no NaN, so o's largest entry is that one divided by t and o has a NaN where row
 * has: the loop follows row's maximum and o's finite one. Another t (not a temperature the processor takes)
 * reads o once more for its maximum. */
static float scale_row(const float *row, float *o, int64_t V, float t, row_maxima *mx) {
    const vf tv = splat(t), ninf = splat(-INFINITY);
    vf m[4] = {ninf, ninf, ninf, ninf}, mf[4] = {ninf, ninf, ninf, ninf}; /* independent chains (see row_max) */
    vi nanv = splati(0);
    int64_t i = 0;
    for (; i + 4 * VL <= V; i += 4 * VL)
        for (int c = 0; c < 4; c++) {
            const vf x = loadv(row + i + c * VL), v = x / tv;
            storev(o + i + c * VL, v);
            m[c] = vselect(x > m[c], x, m[c]);
            mf[c] = vselect(finite_mask(v) & (vi)(v > mf[c]), v, mf[c]);
            nanv |= v != v;
        }
    for (; i + VL <= V; i += VL) {
        const vf x = loadv(row + i), v = x / tv;
        storev(o + i, v);
        m[0] = vselect(x > m[0], x, m[0]);
        mf[0] = vselect(finite_mask(v) & (vi)(v > mf[0]), v, mf[0]);
        nanv |= v != v;
    }
    for (int c = 1; c < 4; c++) {
        m[0] = vselect(m[c] > m[0], m[c], m[0]);
        mf[0] = vselect(mf[c] > mf[0], mf[c], mf[0]);
    }
    float top = hmax(m[0]);
    mx->finite = hmax(mf[0]), mx->nan = any_lane(nanv), mx->known = 1;
    for (; i < V; i++) {
        const float x = row[i], v = x / t;
        o[i] = v;
        top = x > top ? x : top;
        mx->finite = isfinite(v) && v > mx->finite ? v : mx->finite;
        mx->nan |= v != v;
    }
    if (t > 0.0f && t < INFINITY)
        mx->all = top / t;
    else
        mx->all = row_max(o, V, &mx->nan);
    return top;
}

/* scale_row for a row's leading temperature, and the raw row's logsumexp (lse NULL: none) from the maximum that
 * pass found, made while the row is in cache; for a t other than a finite t > 0 the NaN flag the pass noted is
 * not the raw row's, and the raw row is read again */
static void scale_leading(const float *row, float *o, int64_t V, float t, row_maxima *mx, float *lse) {
    const float top = scale_row(row, o, V, t, mx);
    if (lse) *lse = t > 0.0f && t < INFINITY ? logsumexp_at(row, V, top, mx->nan) : row_logsumexp(row, V);
}

/* the largest finite logit of a row (-inf without one): four independent maxima (see row_max) */
static float finite_max(const float *row, int64_t V) {
    const vf ninf = splat(-INFINITY);
    vf m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;
    int64_t i = 0;
    for (; i + 4 * VL <= V; i += 4 * VL) {
        const vf a = loadv(row + i), b = loadv(row + i + VL), c = loadv(row + i + 2 * VL), d = loadv(row + i + 3 * VL);
        m0 = vselect(finite_mask(a) & (vi)(a > m0), a, m0);
        m1 = vselect(finite_mask(b) & (vi)(b > m1), b, m1);
        m2 = vselect(finite_mask(c) & (vi)(c > m2), c, m2);
        m3 = vselect(finite_mask(d) & (vi)(d > m3), d, m3);
    }
    for (; i < V; i += VL) {
        const vf v = chunk(row, V, i);
        m0 = vselect(finite_mask(v) & (vi)(v > m0), v, m0);
    }
    m0 = vselect(m1 > m0, m1, m0);
    m2 = vselect(m3 > m2, m3, m2);
    return hmax(vselect(m2 > m0, m2, m0));
}

/* the threshold of one row (keys, e: scratch of V + VL entries); -inf when nothing is finite */
static float row_threshold(const float *row, int64_t V, uint32_t *keys, float *e, int mode, float param,
                           const row_maxima *mx) {
    const float m = mx && mx->known ? mx->finite : finite_max(row, V);
    if (m == -INFINITY) return -INFINITY;
    float floor = -INFINITY;
    if (mode == TOP_P && param < 1.0f) {
        floor = m - (logf((float)V / (1.0f - param)) + 1.0f);
    } else if (mode == TOP_K && param * VL <= (float)V) {
        int64_t n = 0, i = 0; /* the chunk maxima, as candidates of a count search, VL chunks at a time */
        for (; i + VL * VL <= V; i += VL * VL) {
            vf P[VL];
            for (int c = 0; c < VL; c++) {
                vf v = loadv(row + i + c * VL);
                P[c] = vselect(finite_mask(v), v, splat(-INFINITY));
            }
            const vf cm = transpose_max(P); /* lane c: the maximum of chunk c */
            const vu u = (vu)cm;
            const vu key = (vu)vselect((vi)(u >> 31) != 0, (vf)~u, (vf)(u | 0x80000000u));
            const vi real = (vi)(cm != splat(-INFINITY));
            append_lanes((uint32_t *)e, n, real, (vu)splat(1.0f));
            n = append_lanes(keys, n, real, key);
        }
        for (; i < V; i += VL) {
            vf v = chunk(row, V, i);
            float cm = hmax(vselect(finite_mask(v), v, splat(-INFINITY)));
            if (cm == -INFINITY) continue;
            uint32_t u;
            memcpy(&u, &cm, sizeof u);
            keys[n] = (u & 0x80000000u) ? ~u : u | 0x80000000u;
            e[n++] = 1.0f;
        }
        for (; n % VL; n++) keys[n] = 0u, e[n] = 0.0f;
        uint32_t k = bisect(keys, e, n, (double)param - 0.5);
        if (k) floor = key_value(k);
    }
    for (;;) {
        double total;
        int64_t n = candidates(row, V, mode, m, floor, keys, e, &total);
        const double target = mode == TOP_P ? (double)param * total : (double)param - 0.5;
        uint32_t t = bisect(keys, e, n, target);
        if (t) return key_value(t);
        if (floor == -INFINITY) break; /* even every finite token is short of the target (rounding): keep all */
        floor = -INFINITY;
    }
    float lo = INFINITY; /* the smallest finite logit */
    for (int64_t i = 0; i < V; i++)
        if (isfinite(row[i]) && row[i] < lo) lo = row[i];
    return lo;
}

/* o = row with the logits below the row's threshold set to -inf (o may be row); the threshold */
static float truncate_row(const float *row, float *o, int64_t V, uint32_t *keys, float *e, int mode, float param,
                          const row_maxima *mx) {
    const float t = row_threshold(row, V, keys, e, mode, param, mx);
    const vf tv = splat(t);
    int64_t i = 0;
    for (; i + VL <= V; i += VL) { /* x < t becomes -inf (NaN compares false and stays) */
        vf v = loadv(row + i);
        storev(o + i, vselect((vi)(v < tv), splat(-INFINITY), v));
    }
    for (; i < V; i++) o[i] = row[i] < t ? -INFINITY : row[i];
    return t;
}

int toolkit_truncate_f32(const float *x, int64_t ldx, int64_t R, int64_t V, int mode, const float *param, float *out,
                         int64_t ldo, float *thresholds, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && R > 1)
    {
        uint32_t *keys = malloc(sizeof *keys * (V + VL));
        float *e = malloc(sizeof *e * (V + VL));
        if (!keys || !e) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < R; r++) {
            if (!keys || !e) continue;
            const float *row = x + r * ldx;
            float *o = out + r * ldo;
            thresholds[r] = truncate_row(row, o, V, keys, e, mode, param[r], 0);
        }
        free(keys);
        free(e);
    }
    return failed ? -1 : 0;
}

/*
 * Of a row, in one pass: support (its finite logits) and the ids of those while they are under a quarter
 * of V (ids: V / 4 + 2 VL entries); where lse is given, also its logsumexp, exactly toolkit_logsumexp_f32's
 * (the same maximum, and the same lane sums: a chunk without a finite logit adds exp(-inf - max), vexp's
 * floor, in every lane, which is added here without computing it). Returns whether ids holds them all.
 */
static int finish_row(const float *row, int64_t V, float *lse, int64_t *support, int32_t *ids,
                      const row_maxima *mx) {
    const int64_t vec = V - V % VL;
    int nan = mx && mx->known ? mx->nan : 0;
    /* toolkit_logsumexp_f32's maximum */
    const float m = !lse ? 0.0f : mx && mx->known ? mx->all : row_max(row, V, &nan);
    const int sum = lse && !nan && m != INFINITY && m != -INFINITY;
    vi finite = {0}; /* lanes count down: each finite logit adds -1 */
    int64_t n = 0;
    vu lane;
    for (int j = 0; j < VL; j++) lane[j] = (uint32_t)j;
    for (int64_t i = 0; i < V; i += VL) { /* the last, partial chunk is counted and listed; summed below */
        const vi mask = finite_mask(chunk(row, V, i));
        if (any_lane(mask)) {
            finite += mask;
            if (n * 4 < V) n = append_lanes((uint32_t *)ids, n, mask, lane + (uint32_t)i);
        }
    }
    int64_t count = 0;
    for (int j = 0; j < VL; j++) count -= finite[j];
    *support = count;
    if (lse && !sum) {
        *lse = nan ? NAN : m;
    } else if (sum) { /* a pass of its own, so that the sum stays in a register */
        const vf floor = vexp(splat(-INFINITY)), mvec = splat(m);
        vf sv = splat(0.0f);
        for (int64_t i = 0; i < vec; i += VL) {
            const vf v = loadv(row + i);
            sv += any_lane(finite_mask(v)) ? vexp(v - mvec) : floor;
        }
        float s = hsum(sv);
        for (int64_t i = vec; i < V; i++) s += sexp(row[i] - m);
        *lse = m + logf(s);
    }
    return count * 4 < V;
}

/*
 * truncate_row then finish_row in one pass (the row's last op a truncation): o = row with the logits below
 * its threshold set to -inf (o may be row), and of o: support, ids while under a quarter of V, and lse, each
 * what finish_row computes over o (the same lane sums in the same order). Truncation keeps the row's largest
 * entries and its NaNs, so o's maximum and NaN flag are row's. ids may be keys (the threshold is found
 * first). Returns whether ids holds every finite logit.
 */
static int truncate_finish_row(const float *row, float *o, int64_t V, uint32_t *keys, float *e, int mode,
                               float param, const row_maxima *mx, float *lse, int64_t *support, int32_t *ids) {
    const float t = row_threshold(row, V, keys, e, mode, param, mx);
    int nan = mx && mx->known ? mx->nan : 0;
    const float m = mx && mx->known ? mx->all : row_max(row, V, &nan);
    const int sum = !nan && m != INFINITY && m != -INFINITY;
    const vf tv = splat(t), ninf = splat(-INFINITY), floor = vexp(ninf), mvec = splat(m);
    vi finite = {0}; /* lanes count down: each finite logit adds -1 */
    vf sv = splat(0.0f);
    int64_t n = 0, i = 0;
    vu lane;
    for (int j = 0; j < VL; j++) lane[j] = (uint32_t)j;
    for (; i + VL <= V; i += VL) {
        const vf v = loadv(row + i), w = vselect((vi)(v < tv), ninf, v); /* NaN compares false and stays */
        storev(o + i, w);
        const vi mask = finite_mask(w);
        if (any_lane(mask)) {
            finite += mask;
            if (n * 4 < V) n = append_lanes((uint32_t *)ids, n, mask, lane + (uint32_t)i);
            if (sum) sv += vexp(w - mvec);
        } else if (sum) {
            sv += floor;
        }
    }
    int64_t count = 0;
    for (int j = 0; j < VL; j++) count -= finite[j];
    float s = hsum(sv);
    for (; i < V; i++) {
        const float w = row[i] < t ? -INFINITY : row[i];
        o[i] = w;
        if (isfinite(w)) {
            if (n * 4 < V) ids[n++] = (int32_t)i;
            count++;
        }
        if (sum) s += sexp(w - m);
    }
    *support = count;
    *lse = sum ? m + logf(s) : nan ? NAN : m;
    return count * 4 < V;
}

/* the Gumbel-max token of a row under (k0, k1) over its `count` finite logits (listed in ids, or NULL:
 * the whole row), -1 without one; its noise (NaN without a token) */
static int64_t draw(const float *row, int64_t V, const int32_t *ids, int64_t count, uint32_t k0, uint32_t k1,
                    double *noise) {
    const int64_t t = sample_row(row, V, ids, count, k0, k1);
    *noise = NAN;
    if (t >= 0) {
        vu id = {0};
        id[0] = (uint32_t)t;
        *noise = gumbel(id, k0, k1)[0];
    }
    return t;
}

/*
 * For each row i of x (n_rows rows of V, row stride ldx): support[i] = its finite logits; where keys is
 * given and sampled[i] != 0, tokens[i] = the Gumbel-max token under (keys[2i], keys[2i+1]) and noise[i]
 * = its G (a row without a finite logit gives token -1). Returns 0, or -1 if out of memory.
 */
int toolkit_gumbel_sample_rows(const float *x, int64_t ldx, int64_t V, int64_t n_rows, const uint32_t *keys,
                               const int8_t *sampled, int64_t *tokens, double *noise, int64_t *support, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && n_rows > 1)
    {
        int32_t *ids = malloc(sizeof *ids * (size_t)(V / 4 + 2 * VL));
        if (!ids) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_rows; i++) {
            if (!ids) continue;
            const float *row = x + i * ldx;
            const int listed = finish_row(row, V, 0, support + i, ids, 0);
            if (keys && sampled[i])
                tokens[i] = draw(row, V, listed ? ids : 0, support[i], keys[2 * i], keys[2 * i + 1], noise + i);
        }
        free(ids);
    }
    return failed ? -1 : 0;
}

/*
 * The default pipeline's tail and the sampler in one call, each row by one thread while it is in cache
 * (separately, each stage streamed the whole step's logits block through memory once or twice).
 * Row r goes through up to TAIL_OPS ops (ops[r * TAIL_OPS + j], -1: none; params alike), in order:
 * TAIL_TEMPERATURE divides by its param, TOP_P / TOP_K truncate as toolkit_truncate_f32 does. Then,
 * over the processed row, exactly as the separate calls compute them: support[r] (finite logits),
 * lse[r] (toolkit_logsumexp_f32) and, where sampled[r], the Gumbel-max token and its noise
 * (toolkit_gumbel_sample_rows); a row not sampled, or without a finite logit, takes its argmax
 * (toolkit_argmax_f32) as the token and keeps noise NaN. picked[r] = the processed logit at the token.
 * The processed rows are written to out (row stride ldo) where out is given; without it they stay in a
 * scratch row that never leaves the cache. The same bits as the stages one after another: the same
 * arithmetic on the same values. Where kept is given, a row whose support is not the whole vocabulary
 * gets its kept set there as a bitmask (row stride ldk >= ceil(V / 8) bytes: bit i & 7 of byte i >> 3 is
 * token i), built from the listed ids or, for a large support, one more pass; full rows are left alone.
 * Where raw_lse is given, raw_lse[r] = the logsumexp of row r as it comes in (toolkit_logsumexp_f32's),
 * read while the row is loaded for its ops. Where patch_off is given, row r is first penalised at the
 * columns patch_col[k], patch_off[r] <= k < patch_off[r + 1]: its logit x there becomes x * patch_factor[k]
 * where x < 0, else x / patch_factor[k] (the repetition penalty, handed over as its entries rather than as
 * a processed copy of the whole block; computed from the incoming row, so a column listed twice is
 * penalised once).
 * Returns 0, or -1 if out of memory.
 */
enum { TAIL_OPS = 3, TAIL_TEMPERATURE = 2 };

int toolkit_sample_tail_rows(const float *x, int64_t ldx, int64_t R, int64_t V, const int32_t *ops,
                             const float *params, const int64_t *patch_off, const int32_t *patch_col,
                             const float *patch_factor, const uint32_t *keys, const int8_t *sampled, float *out,
                             int64_t ldo, float *raw_lse, float *lse, int64_t *tokens, double *noise,
                             int64_t *support, float *picked, uint8_t *kept, int64_t ldk, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && R > 1)
    {
        uint32_t *kscratch = malloc(sizeof *kscratch * (V + VL));
        float *e = malloc(sizeof *e * (V + VL));
        float *scratch = out ? 0 : malloc(sizeof *scratch * (size_t)V);
        if (!kscratch || !e || (!out && !scratch)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < R; r++) {
            if (!kscratch || !e || (!out && !scratch)) continue;
            const float *src = x + r * ldx;
            float *o = out ? out + r * ldo : scratch;
            const int32_t *op_r = ops + r * TAIL_OPS;
            const float *param_r = params + r * TAIL_OPS;
            /* a leading temperature's pass finds the raw row's maximum: the raw logsumexp is made there
             * (scale_leading), in one more pass instead of two */
            float *raw_lse_r = raw_lse ? raw_lse + r : NULL;
            if (raw_lse && op_r[0] != TAIL_TEMPERATURE) raw_lse[r] = row_logsumexp(src, V);
            int last = -1; /* the last op made: where it is a truncation, the finish goes in its pass */
            for (int j = 0; j < TAIL_OPS; j++)
                if (op_r[j] == TAIL_TEMPERATURE || op_r[j] == TOP_P || op_r[j] == TOP_K) last = j;
            row_maxima mx = {0};
            int first = 0; /* the first op not yet made */
            if (patch_off && patch_off[r + 1] > patch_off[r]) {
                /* the penalty, then a leading temperature, in one pass: o = row / t, then each penalised
                 * entry's value / t (the same two roundings). The maxima the division noted stay right where
                 * every penalised entry was below them (its new value can then only raise them); else they are
                 * read again */
                const int scaled = op_r[0] == TAIL_TEMPERATURE;
                const float t = param_r[0];
                if (scaled) {
                    scale_leading(src, o, V, t, &mx, raw_lse_r);
                    first = 1;
                } else {
                    memcpy(o, src, sizeof *o * (size_t)V);
                }
                for (int64_t k = patch_off[r]; k < patch_off[r + 1]; k++) {
                    const float seen = src[patch_col[k]], f = patch_factor[k];
                    const float penalised = seen < 0.0f ? seen * f : seen / f; /* HF's: 0 / inf is 0, 0 * inf NaN */
                    if (!scaled) {
                        o[patch_col[k]] = penalised;
                        continue;
                    }
                    const float was = seen / t, now = penalised / t;
                    o[patch_col[k]] = now;
                    if (!(was < mx.all) || !(was < mx.finite)) mx.known = 0;
                    mx.nan |= now != now;
                    mx.all = now > mx.all ? now : mx.all;
                    mx.finite = isfinite(now) && now > mx.finite ? now : mx.finite;
                }
                src = o;
            }
            int32_t *ids = (int32_t *)kscratch;
            int listed = -1; /* -1: the processed row not finished yet */
            for (int j = first; j < TAIL_OPS; j++) {
                const int op = op_r[j];
                const float p = param_r[j];
                if (op == TAIL_TEMPERATURE && j == 0) {
                    scale_leading(src, o, V, p, &mx, raw_lse_r);
                } else if (op == TAIL_TEMPERATURE) {
                    scale_row(src, o, V, p, &mx);
                } else if ((op == TOP_P || op == TOP_K) && j == last) {
                    listed = truncate_finish_row(src, o, V, kscratch, e, op, p, &mx, lse + r, support + r, ids);
                } else if (op == TOP_P || op == TOP_K) {
                    truncate_row(src, o, V, kscratch, e, op, p, &mx);
                } else {
                    continue;
                }
                src = o;
            }
            if (out && src != o) memcpy(o, src, sizeof *o * (size_t)V);
            const float *row = src; /* the processed row */
            if (listed < 0) listed = finish_row(row, V, lse + r, support + r, ids, &mx);
            int64_t t = -1;
            noise[r] = NAN;
            if (keys && sampled[r])
                t = draw(row, V, listed ? ids : 0, support[r], keys[2 * r], keys[2 * r + 1], noise + r);
            if (t < 0) toolkit_argmax_f32(row, V, 1, V, &t, 1);
            tokens[r] = t;
            picked[r] = row[t];
            if (kept && support[r] < V) {
                uint8_t *bits = kept + r * ldk;
                memset(bits, 0, (size_t)((V + 7) / 8));
                if (listed)
                    for (int64_t j = 0; j < support[r]; j++) bits[ids[j] >> 3] |= (uint8_t)(1u << (ids[j] & 7));
                else
                    for (int64_t i = 0; i < V; i++)
                        if (row[i] > -INFINITY && row[i] < INFINITY) bits[i >> 3] |= (uint8_t)(1u << (i & 7));
            }
        }
        free(kscratch);
        free(e);
        free(scratch);
    }
    return failed ? -1 : 0;
}
