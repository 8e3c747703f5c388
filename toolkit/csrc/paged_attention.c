/*
 * Paged attention on the CPU, fp32, one query token at a time.
 *
 * Every query reads its own sequence's keys and values straight from the paged cache
 * ([num_blocks, block_size, kv_heads, head_dim]) through its block table: no gathered
 * copy, no padding to the longest sequence. Keys are visited in tiles of 16 positions in
 * position order with an online softmax, so the result for a query depends only on
 * the query, its context length and the cache contents: it is the same bits whatever
 * the batch, the chunking of the prompt, the block size or the number of threads (each (query, kv
 * head) item is computed by one thread, in one fixed order).
 *
 * The G query heads that share a KV head are processed together, up to 4 at a time with
 * their queries and accumulators held in registers, so each key and value row is loaded
 * once per group. Dot products use 16 independent lanes (SIMD
 * without reassociation); exp is a Cody-Waite + polynomial approximation (~2 ulp)
 * that the compiler vectorises.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

#define MAX_G 32
#define MAX_D 256
#define MAX_BS 64
#define LANES 16
#define TILE 16

static inline float exp_approx(float x) {
    if (x < -87.0f) x = -87.0f;
    if (x > 88.0f) x = 88.0f;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    return p * scale;
}

static inline float dot(const float *a, const float *b, int64_t d) {
    float lane[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int j = 0; j < LANES; j++) lane[j] += a[i + j] * b[i + j];
    float tail = 0.0f;
    for (; i < d; i++) tail += a[i] * b[i];
    /* fixed pairwise order */
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) lane[j] += lane[j + w];
    return lane[0] + tail;
}

/* ---------------------------------------------------------------- SIMD path (head_dim 64 or 128)
 * GCC vector extensions: v16 is 16 floats (one AVX-512 register, two AVX2 ones). Keys are
 * processed in tiles of 16 positions; a tile's 16 dot products per query head are 16
 * lane-wise products reduced by one transpose-and-add tree, so no per-key horizontal sum.
 */
#include "vec16.h"  /* v16, load16 / store16 / splat / vselect, vexp, hmax16, hsum16 */

/* R[t] = sum of the 16 lanes of P[t], for t = 0..15, in a fixed tree order */
static inline v16 transpose_sum(const v16 P[16]) {
    const vi16 lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi16 hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi16 lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi16 hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const vi16 lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vi16 hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const vi16 lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi16 hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16 A[8], B[4], C[2];
    for (int i = 0; i < 8; i++)
        A[i] = __builtin_shuffle(P[2 * i], P[2 * i + 1], lo1) + __builtin_shuffle(P[2 * i], P[2 * i + 1], hi1);
    for (int i = 0; i < 4; i++)
        B[i] = __builtin_shuffle(A[2 * i], A[2 * i + 1], lo2) + __builtin_shuffle(A[2 * i], A[2 * i + 1], hi2);
    for (int i = 0; i < 2; i++)
        C[i] = __builtin_shuffle(B[2 * i], B[2 * i + 1], lo3) + __builtin_shuffle(B[2 * i], B[2 * i + 1], hi3);
    return __builtin_shuffle(C[0], C[1], lo4) + __builtin_shuffle(C[0], C[1], hi4);
}

#define SIMD_MAX_H 32
/* Prefetch a query's next KV block in software only when the previous query read another sequence:
 * a decode row's blocks come from memory, while a prompt chunk's later rows find the same blocks in
 * cache, where the prefetches only cost issue slots (measured: prefill 1.6x slower with them). Spread
 * over the tile's arithmetic rather than issued in one burst, they made decode 1.1-1.3x faster. */
#define PREFETCH(n) ((n) == 0 || query_table[n] != query_table[(n) - 1])

static inline v16 load_f32(const float *p) { return load16(p); }

typedef int8_t vb16 __attribute__((vector_size(16)));
static inline v16 load_q8(const uint8_t *p, const float *lut) {  /* int8 (lut NULL) or a 256-entry decode table (fp8) */
    if (!lut) { vb16 b; memcpy(&b, p, sizeof b); return __builtin_convertvector(b, v16); }
    v16 v;
    for (int i = 0; i < 16; i++) v[i] = lut[p[i]];
    return v;
}

#define INLINE static inline __attribute__((always_inline))

INLINE v16 load_elem(const void *base, int64_t idx, const int q8, const float *lut) {
    return q8 ? load_q8((const uint8_t *)base + idx, lut) : load_f32((const float *)base + idx);
}

/* One tile (tn <= 16 positions, whose rows start at elements rows[t]) for C query heads that share
 * the KV head at element offset `off`: their scaled queries qs[C][DV] and running acc[C][DV], m[C],
 * l[C]. DV, C and q8 are constants where it is inlined, so q, acc and the key / value rows live in
 * registers and each K and V row is loaded once for the C heads. Per head, every operation and its
 * order is the same whatever C is. */
INLINE void attend_chunk(const int DV, const int C, const int q8, const v16 *qs, v16 *acc, float *m, float *l,
                         const void *k_cache, const void *v_cache, const int64_t *rows, int64_t off, int64_t tn,
                         vi16 valid, const float *ksc, const float *vsc, const float *lut,
                         const char *pf_k, const char *pf_v, int64_t pf_lines) {
    const int64_t pf_per_t = (pf_lines + 15) / 16;
    v16 q[4][8], a[4][8], P[4][16];
    float pw[4][16];
    for (int c = 0; c < C; c++)
        for (int i = 0; i < DV; i++) q[c][i] = qs[c * DV + i];
    for (int t = 0; t < 16; t++) {
        for (int64_t j = t * pf_per_t; j < (t + 1) * pf_per_t && j < pf_lines; j++) {
            __builtin_prefetch(pf_k + 64 * j);
            __builtin_prefetch(pf_v + 64 * j);
        }
        if (t < tn) {
            v16 kr[8];
            for (int i = 0; i < DV; i++) kr[i] = load_elem(k_cache, rows[t] + off + 16 * i, q8, lut);
            for (int c = 0; c < C; c++) {
                v16 s = q[c][0] * kr[0];
                for (int i = 1; i < DV; i++) s += q[c][i] * kr[i];
                P[c][t] = q8 ? s * splat(ksc[t]) : s;  /* the key's scale factors out of q.k */
            }
        } else {
            for (int c = 0; c < C; c++) P[c][t] = splat(0.0f);
        }
    }
    for (int c = 0; c < C; c++) {
        v16 sc = vselect(valid, transpose_sum(P[c]), splat(-INFINITY));
        const float mb = hmax16(sc);
        const float mn = mb > m[c] ? mb : m[c];
        const float alpha = m[c] == -INFINITY ? 0.0f : exp_approx(m[c] - mn);
        m[c] = mn;
        v16 e = vselect(valid, vexp(sc - splat(mn)), splat(0.0f));
        l[c] = l[c] * alpha + hsum16(e);
        for (int i = 0; i < DV; i++) {
            a[c][i] = acc[c * DV + i] * splat(alpha);
            __asm__("" : "+v"(a[c][i]));  /* a rounded product: never fused into the first p.v FMA */
        }
        store16(pw[c], e);
    }
    for (int64_t t = 0; t < tn; t++) {
        v16 v[8];
        for (int i = 0; i < DV; i++) v[i] = load_elem(v_cache, rows[t] + off + 16 * i, q8, lut);
        for (int c = 0; c < C; c++) {
            const v16 w = splat(q8 ? pw[c][t] * vsc[t] : pw[c][t]);  /* and the value's out of p.v */
            for (int i = 0; i < DV; i++) a[c][i] += w * v[i];
        }
    }
    for (int c = 0; c < C; c++)
        for (int i = 0; i < DV; i++) acc[c * DV + i] = a[c][i];
}

/* One query token, all its heads, over its sequence's first ctx positions in tiles of 16: each
 * tile's K rows (then V rows) of every KV head lie contiguously in the cache (the hardware
 * prefetcher follows them; the next block is prefetched in software, see PREFETCH). The G query heads of a KV
 * head are taken C at a time (the largest C <= 4, or 2 at head_dim 128, that divides G). */
INLINE void attend_query(const int DV, const int q8, const float *qn, const void *k_cache, const void *v_cache,
                         const int64_t *table, int64_t ctx, int64_t H, int64_t K, int64_t BS, float scale,
                         float *out, const float *k_scales, const float *v_scales, int64_t scale_stride,
                         const float *lut, const int prefetch) {
    const int64_t D = DV * 16, G = H / K, esize = q8 ? 1 : 4;
    int C = DV == 4 ? 4 : 2;
    while (G % C) C--;
    v16 q[SIMD_MAX_H * 8], acc[SIMD_MAX_H * 8];
    float m[SIMD_MAX_H], l[SIMD_MAX_H];
    for (int64_t h = 0; h < H; h++) {
        for (int i = 0; i < DV; i++) {
            q[h * DV + i] = load16(qn + h * D + 16 * i) * splat(scale);
            acc[h * DV + i] = splat(0.0f);
        }
        m[h] = -INFINITY; l[h] = 0.0f;
    }
    const vi16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    int64_t rows[16];
    float ksc[SIMD_MAX_H][16], vsc[SIMD_MAX_H][16]; /* per KV head and position: the block's scales */
    for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
        const int64_t tn = (ctx - t0) < 16 ? (ctx - t0) : 16;
        for (int64_t t = 0, blk = t0 / BS, off = t0 % BS; t < tn; t++) {
            rows[t] = (table[blk] * BS + off) * K * D;
            if (q8)
                for (int64_t kh = 0; kh < K; kh++) {
                    ksc[kh][t] = k_scales[table[blk] * scale_stride + kh];
                    vsc[kh][t] = v_scales[table[blk] * scale_stride + kh];
                }
            if (++off == BS) { off = 0; blk++; }
        }
        /* the next block's lines, prefetched a share per chunk and a few per position, so that the
         * prefetches never fill the line buffers at once and stall the arithmetic */
        const int64_t lines = prefetch && BS == 16 && t0 + 16 < ctx ? 16 * K * D * esize / 64 : 0;
        const int64_t next = lines ? table[t0 / 16 + 1] * 16 * K * D * esize : 0;
        const int64_t share = (lines + K * (G / C) - 1) / (K * (G / C));
        int64_t chunk = 0;
        const vi16 valid = lane < (vi16){tn, tn, tn, tn, tn, tn, tn, tn, tn, tn, tn, tn, tn, tn, tn, tn};
        for (int64_t kh = 0; kh < K; kh++)
            for (int64_t h = kh * G; h < (kh + 1) * G; h += C, chunk++) {
                const int64_t first = chunk * share, count = lines - first < share ? lines - first : share;
#define CHUNK(CC) attend_chunk(DV, CC, q8, q + h * DV, acc + h * DV, m + h, l + h, k_cache, v_cache, rows, kh * D, \
                               tn, valid, ksc[kh], vsc[kh], lut, (const char *)k_cache + next + 64 * first, \
                               (const char *)v_cache + next + 64 * first, count > 0 ? count : 0)
                switch (C) {
                case 4: CHUNK(4); break;
                case 3: CHUNK(3); break;
                case 2: CHUNK(2); break;
                default: CHUNK(1); break;
                }
#undef CHUNK
            }
    }
    for (int64_t h = 0; h < H; h++) {
        const v16 inv = splat(1.0f / l[h]);
        for (int i = 0; i < DV; i++) store16(out + h * D + 16 * i, acc[h * DV + i] * inv);
    }
}

#define DEFINE_ITEM(NAME, DV, Q8, ELEM)                                                                         \
static void NAME(const float *qn, const ELEM *k_cache, const ELEM *v_cache, const int64_t *table, int64_t ctx,  \
                 int64_t H, int64_t K, int64_t BS, float scale, float *out, const float *k_scales,             \
                 const float *v_scales, int64_t scale_stride, const float *lut, int prefetch) {               \
    if (prefetch) /* two copies, so the one without prefetching carries none of its bookkeeping */          \
        attend_query(DV, Q8, qn, k_cache, v_cache, table, ctx, H, K, BS, scale, out, k_scales, v_scales,       \
                     scale_stride, lut, 1);                                                                   \
    else                                                                                                       \
        attend_query(DV, Q8, qn, k_cache, v_cache, table, ctx, H, K, BS, scale, out, k_scales, v_scales,       \
                     scale_stride, lut, 0);                                                                   \
}
DEFINE_ITEM(item_simd_4, 4, 0, float)
DEFINE_ITEM(item_simd_8, 8, 0, float)
DEFINE_ITEM(item_q8_4, 4, 1, uint8_t)
DEFINE_ITEM(item_q8_8, 8, 1, uint8_t)

int toolkit_paged_attention_f32(
    const float *q, int64_t q_row_stride,            /* q[n][h][d] at q + n*q_row_stride + h*D + d */
    const float *k_cache, const float *v_cache,      /* [num_blocks][BS][K][D] contiguous */
    const int64_t *block_tables, int64_t bt_row_stride,
    const int64_t *query_table,                      /* [N] row of block_tables used by query n */
    const int64_t *query_ctx,                        /* [N] number of keys query n sees (its position + 1) */
    float *out,                                      /* [N][H][D] contiguous */
    int64_t N, int64_t H, int64_t K, int64_t D, int64_t BS, float scale, int num_threads)
{
    if (H % K != 0 || H / K > MAX_G || D > MAX_D || BS > MAX_BS) return -1;
    const int64_t G = H / K;
    if (H <= SIMD_MAX_H && (D == 64 || D == 128)) {
        #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (int64_t n = 0; n < N; n++) {
            const int64_t *table = block_tables + query_table[n] * bt_row_stride;
            if (D == 64) item_simd_4(q + n * q_row_stride, k_cache, v_cache, table, query_ctx[n], H, K, BS, scale, out + n * H * D, 0, 0, 0, 0, PREFETCH(n));
            else item_simd_8(q + n * q_row_stride, k_cache, v_cache, table, query_ctx[n], H, K, BS, scale, out + n * H * D, 0, 0, 0, 0, PREFETCH(n));
        }
        return 0;
    }
    #pragma omp parallel for collapse(2) schedule(dynamic, 4) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t kh = 0; kh < K; kh++) {
            const int64_t ctx = query_ctx[n];
            const int64_t *table = block_tables + query_table[n] * bt_row_stride;
            const float *qn = q + n * q_row_stride + kh * G * D;
            float m[MAX_G], l[MAX_G], acc[MAX_G][MAX_D], s[MAX_G][TILE];
            for (int64_t g = 0; g < G; g++) {
                m[g] = -INFINITY;
                l[g] = 0.0f;
                for (int64_t d = 0; d < D; d++) acc[g][d] = 0.0f;
            }
            /* tiles of TILE positions whatever the block size: the order depends on ctx only */
            for (int64_t t0 = 0; t0 < ctx; t0 += TILE) {
                const int64_t tn = (ctx - t0) < TILE ? (ctx - t0) : TILE;
                const float *krow[TILE], *vrow[TILE];
                for (int64_t t = 0; t < tn; t++) {
                    const int64_t pos = t0 + t, slot = table[pos / BS] * BS + pos % BS;
                    krow[t] = k_cache + (slot * K + kh) * D;
                    vrow[t] = v_cache + (slot * K + kh) * D;
                }
                for (int64_t t = 0; t < tn; t++)
                    for (int64_t g = 0; g < G; g++) s[g][t] = dot(qn + g * D, krow[t], D) * scale;
                for (int64_t g = 0; g < G; g++) {
                    float mb = s[g][0];
                    for (int64_t t = 1; t < tn; t++) mb = s[g][t] > mb ? s[g][t] : mb;
                    const float mn = mb > m[g] ? mb : m[g];
                    const float alpha = m[g] == -INFINITY ? 0.0f : exp_approx(m[g] - mn);
                    l[g] *= alpha;
                    for (int64_t d = 0; d < D; d++) acc[g][d] *= alpha;
                    for (int64_t t = 0; t < tn; t++) s[g][t] = exp_approx(s[g][t] - mn);
                    for (int64_t t = 0; t < tn; t++) l[g] += s[g][t];
                    m[g] = mn;
                }
                for (int64_t t = 0; t < tn; t++) {
                    const float *vr = vrow[t];
                    for (int64_t g = 0; g < G; g++) {
                        const float p = s[g][t];
                        for (int64_t d = 0; d < D; d++) acc[g][d] += p * vr[d];
                    }
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float *o = out + (n * H + kh * G + g) * D;
                const float inv = 1.0f / l[g];
                for (int64_t d = 0; d < D; d++) o[d] = acc[g][d] * inv;
            }
        }
    }
    return 0;
}

/* The same attention over an 8-bit quantised cache (int8, or fp8 decoded through `lut`), head_dim 64 or
 * 128: keys and values are read as bytes and scaled per (block, KV head) from k_scales / v_scales
 * ([num_blocks][K], or one [K] row with scale_stride 0 for static per-tensor scales). */
int toolkit_paged_attention_q8(
    const float *q, int64_t q_row_stride, const uint8_t *k_cache, const uint8_t *v_cache,
    const int64_t *block_tables, int64_t bt_row_stride, const int64_t *query_table, const int64_t *query_ctx,
    float *out, int64_t N, int64_t H, int64_t K, int64_t D, int64_t BS, float scale, int num_threads,
    const float *k_scales, const float *v_scales, int64_t scale_stride, const float *lut)
{
    if (H % K != 0 || H > SIMD_MAX_H || !(D == 64 || D == 128)) return -1;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        const int64_t *table = block_tables + query_table[n] * bt_row_stride;
        if (D == 64) item_q8_4(q + n * q_row_stride, k_cache, v_cache, table, query_ctx[n], H, K, BS, scale,
                               out + n * H * D, k_scales, v_scales, scale_stride, lut, PREFETCH(n));
        else item_q8_8(q + n * q_row_stride, k_cache, v_cache, table, query_ctx[n], H, K, BS, scale,
                       out + n * H * D, k_scales, v_scales, scale_stride, lut, PREFETCH(n));
    }
    return 0;
}
