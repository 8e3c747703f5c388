/*
 * Gumbel-max sampling with counter-based noise, a whole step's rows in one call.
 *
 * token = argmax_i (logit_i + G_i) over the finite logits of a row, G_i = -log(-log(u_i)) and
 * u_i = (bits53(i) + 0.5) * 2^-53, bits53 = (a << 21) | (b >> 11), a = mix32(mix32(2i + 1) ^ k0),
 * b = mix32(a ^ k1), (k0, k1) the row's key (toolkit/rng.py derives it from seed, position, stream
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

typedef uint32_t vu __attribute__((vector_size(4 * VL)));
typedef int64_t vq __attribute__((vector_size(8 * VL)));
typedef double vd __attribute__((vector_size(8 * VL)));
typedef float vf32 __attribute__((vector_size(4 * VL)));

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

/* lanes -1 where the logit is finite (neither infinite nor NaN), 0 elsewhere */
INLINE vq finite_lanes(vf32 l) {
    vu magnitude = (vu)l & 0x7FFFFFFFu;
    return __builtin_convertvector(magnitude < 0x7F800000u, vq);
}

static int64_t sample_row(const float *x, int64_t V, int32_t *ids, int64_t n_ids, uint32_t k0, uint32_t k1) {
    lanes_best b = {{0}, {0}};
    for (int j = 0; j < VL; j++) {
        b.best[j] = -INFINITY;
        b.index[j] = -1;
    }
    vu lane = {0};
    for (int j = 0; j < VL; j++) lane[j] = (uint32_t)j;
    if (!ids) { /* the whole vocabulary, non-finite logits masked */
        for (int64_t i = 0; i < V; i += VL) {
            vf32 l = {0};
            vu id = lane + (uint32_t)i;
            vq valid = {0};
            if (i + VL <= V) {
                memcpy(&l, x + i, sizeof l);
                valid = finite_lanes(l);
            } else {
                for (int j = 0; j < VL; j++) l[j] = i + j < V ? x[i + j] : -INFINITY;
                valid = finite_lanes(l);
            }
            vd value = __builtin_convertvector(l, vd) + gumbel(id, k0, k1);
            consider(&b, value, __builtin_convertvector(id, vq), valid);
        }
    } else { /* the finite ids only */
        for (int64_t i = 0; i < n_ids; i += VL) {
            vf32 l = {0};
            vu id = {0};
            vq valid = {0};
            for (int j = 0; j < VL; j++) {
                int ok = i + j < n_ids;
                id[j] = ok ? (uint32_t)ids[i + j] : 0u;
                l[j] = ok ? x[ids[i + j]] : -INFINITY;
                valid[j] = ok ? -1 : 0;
            }
            vd value = __builtin_convertvector(l, vd) + gumbel(id, k0, k1);
            consider(&b, value, __builtin_convertvector(id, vq), valid);
        }
    }
    return reduce(&b);
}

/*
 * For each listed row r = rows[i] of x (R rows of V, row stride ldx): support[i] = its finite logits;
 * where keys is given and sampled[i] != 0, tokens[i] = the Gumbel-max token under (keys[2i], keys[2i+1])
 * and noise[i] = its G (a row without a finite logit gives token -1). Returns 0, or -1 if out of memory.
 */
int toolkit_gumbel_sample_rows(const float *x, int64_t ldx, int64_t V, const int64_t *rows, int64_t n_rows,
                               const uint32_t *keys, const int8_t *sampled, int64_t *tokens, double *noise,
                               int64_t *support, int threads) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && n_rows > 1)
    for (int64_t i = 0; i < n_rows; i++) {
        const float *row = x + rows[i] * ldx;
        int64_t count = 0;
        for (int64_t v = 0; v < V; v++) count += isfinite(row[v]) ? 1 : 0;
        support[i] = count;
        if (!keys || !sampled[i]) continue;
        int32_t *ids = 0;
        if (count * 4 < V) {
            ids = malloc(sizeof *ids * (count > 0 ? count : 1));
            if (!ids) {
                failed = 1;
                continue;
            }
            int64_t n = 0;
            for (int64_t v = 0; v < V; v++)
                if (isfinite(row[v])) ids[n++] = (int32_t)v;
        }
        int64_t token = sample_row(row, V, ids, count, keys[2 * i], keys[2 * i + 1]);
        free(ids);
        tokens[i] = token;
        if (token >= 0) {
            vu id = {0};
            id[0] = (uint32_t)token;
            noise[i] = gumbel(id, keys[2 * i], keys[2 * i + 1])[0];
        } else {
            noise[i] = NAN;
        }
    }
    return failed ? -1 : 0;
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
 * order-preserving 32-bit keys: at most 32 vectorised passes over a shrinking set, no sort. The
 * "mass" is exp(x - max) (vexp, within 2 ulp) for top-p, summed in float lanes per block and double
 * lanes across blocks in a fixed order, and 1 per token for top-k (exact counts). A row without a
 * finite logit is copied unchanged. Returns 0, or -1 if out of memory.
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

/* the threshold of one row (keys and e: scratch of `padded` entries); -inf when nothing is finite */
static float row_threshold(const float *row, int64_t V, int64_t padded, uint32_t *keys, float *e, int mode,
                           float param) {
    vf mv = splat(-INFINITY);
    for (int64_t i = 0; i < padded; i += VL) { /* the largest finite logit */
        vf v = splat(-INFINITY);
        memcpy(&v, row + i, sizeof(float) * (size_t)(i + VL <= V ? VL : V - i));
        vi finite = (vi)(((vu)v & 0x7FFFFFFFu) < 0x7F800000u);
        v = vselect(finite, v, splat(-INFINITY));
        mv = vselect(v > mv, v, mv);
    }
    const float m = hmax(mv);
    if (m == -INFINITY) return -INFINITY;
    vu lov = (vu){REPEAT_VL(0xFFFFFFFFu)}, hiv = (vu){REPEAT_VL(0u)};
    for (int64_t i = 0; i < padded; i += VL) { /* keys and masses; 0 off the finite logits */
        vf v = splat(-INFINITY);
        memcpy(&v, row + i, sizeof(float) * (size_t)(i + VL <= V ? VL : V - i));
        vu u = (vu)v;
        vi finite = (vi)((u & 0x7FFFFFFFu) < 0x7F800000u);
        vu key = (vu)vselect((vi)(u >> 31) != 0, (vf)~u, (vf)(u | 0x80000000u));
        key &= (vu)finite;
        vf ev = mode == 0 ? vexp(vselect(finite, v, splat(m)) - splat(m)) : splat(1.0f);
        ev = vselect(finite, ev, splat(0.0f));
        memcpy(keys + i, &key, sizeof key);
        memcpy(e + i, &ev, sizeof ev);
        lov = (vu)vselect(finite & (vi)(key < lov), (vf)key, (vf)lov);
        hiv = (vu)vselect(finite & (vi)(key > hiv), (vf)key, (vf)hiv);
    }
    uint32_t lo = 0xFFFFFFFFu, hi = 0;
    for (int j = 0; j < VL; j++) {
        if (lov[j] < lo) lo = lov[j];
        if (hiv[j] > hi) hi = hiv[j];
    }
    /* find the smallest key whose mass above is < target: invariants mass above hi < target (nothing is
     * above the largest key) and mass above `below` >= target */
    const double target = mode == 0 ? (double)param * mass_above(keys, e, padded, 0u) : (double)param - 0.5;
    uint32_t below = lo - 1u; /* lo >= 0x00800000 for a finite float, so no wrap */
    if (mass_above(keys, e, padded, below) < target) return key_value(lo); /* keep everything */
    /* every fourth pass drops the tokens the bracket has settled (key <= below never counts again;
     * key > hi always does, its mass added once, in index order) */
    int64_t n = padded;
    double settled = 0.0;
    for (int pass = 0; hi - below > 1u; pass++) {
        uint32_t mid = below + (hi - below) / 2u;
        if (settled + mass_above(keys, e, n, mid) < target)
            hi = mid;
        else
            below = mid;
        if (pass % 4 == 3) {
            int64_t kept = 0;
            for (int64_t i = 0; i < n; i++) { /* branch-free: the keys are in no useful order */
                uint32_t k = keys[i];
                float v = e[i];
                settled += k > hi ? (double)v : 0.0;
                keys[kept] = k;
                e[kept] = v;
                kept += (k > below) & (k <= hi);
            }
            for (n = kept; n % VL; n++) keys[n] = 0u, e[n] = 0.0f;
        }
    }
    return key_value(hi); /* a logit's key: the mass changes there */
}

int toolkit_truncate_f32(const float *x, int64_t ldx, int64_t R, int64_t V, int mode, const float *param, float *out,
                         int64_t ldo, float *thresholds, int threads) {
    int failed = 0;
    const int64_t padded = (V + VL - 1) / VL * VL;
#pragma omp parallel num_threads(threads) if (threads > 1 && R > 1)
    {
        uint32_t *keys = malloc(sizeof *keys * padded);
        float *e = malloc(sizeof *e * padded);
        if (!keys || !e) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < R; r++) {
            if (!keys || !e) continue;
            const float *row = x + r * ldx;
            float *o = out + r * ldo;
            const float t = row_threshold(row, V, padded, keys, e, mode, param[r]);
            thresholds[r] = t;
            const vf tv = splat(t);
            int64_t i = 0;
            for (; i + VL <= V; i += VL) { /* x < t becomes -inf (NaN compares false and stays) */
                vf v = loadv(row + i);
                storev(o + i, vselect((vi)(v < tv), splat(-INFINITY), v));
            }
            for (; i < V; i++) o[i] = row[i] < t ? -INFINITY : row[i];
        }
        free(keys);
        free(e);
    }
    return failed ? -1 : 0;
}
