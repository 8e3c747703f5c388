/*
 * Paged attention on the CPU, fp32 (or an 8-bit cache), one query token at a time.
 *
 * Every query reads its own sequence's keys and values straight from the paged cache
 * ([num_blocks, block_size, kv_heads, head_dim]) through its block table: no gathered
 * copy, no padding to the longest sequence. Keys are visited in tiles of VL positions (the
 * build's lanes, simd.h) in position order with an online softmax, so the result for a query
 * depends only on the query, its context length, the cache contents and the build's profile
 * (lanes, FMA): it is the same bits whatever the batch, the chunking of the prompt, the block
 * size or the number of threads (each head of a query is computed by one thread, in one fixed order;
 * with fewer queries than threads a query's heads are split in ranges over the threads).
 *
 * The G query heads that share a KV head are processed together, up to 4 at a time, so each key
 * row is loaded once per group (and each value row too, where the group's accumulators fit in the
 * target's registers; else the values are read head by head, from L1). Dot products use VL
 * independent lanes (SIMD without reassociation); exp is a Cody-Waite + polynomial approximation
 * (~2 ulp). Shapes outside the SIMD path (head_dim other than 64 / 128, more than 32 heads) take a
 * scalar path with its own fixed order.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>

#include "simd.h" /* vf / vi (VL lanes), loadv / storev / splat / vselect, vfma / sfma, vexp / sexp, hmax / hsum, transpose_sum */
#include "kernels.h" /* the entry points this file defines, declared once */

#define MAX_G 32
#define MAX_D 256
#define MAX_BS 64
#define LANES 16
#define TILE 16

static inline float dot(const float *a, const float *b, int64_t d) {
    float lane[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int j = 0; j < LANES; j++) lane[j] = sfma(a[i + j], b[i + j], lane[j]);
    float tail = 0.0f;
    for (; i < d; i++) tail = sfma(a[i], b[i], tail);
    /* fixed pairwise order */
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) lane[j] += lane[j + w];
    return lane[0] + tail;
}

/* ---------------------------------------------------------------- SIMD path (head_dim 64 or 128)
 * VL-lane vectors (simd.h): a head is DV = D / VL vectors. Keys are processed in tiles of VL
 * positions; a tile's VL dot products per query head are VL lane-wise product chains reduced by one
 * transpose-and-add tree (transpose_sum), so no per-key horizontal sum.
 */
#define SIMD_MAX_H 32
#define DV_MAX (128 / VL)
#define C_MAX 4
/* Prefetch a query's next keys and values in software only when the previous query read another sequence:
 * a decode row's blocks come from memory, while a prompt chunk's later rows find the same blocks in
 * cache, where the prefetches only cost issue slots (measured: prefill 1.6x slower with them). Spread
 * over the tile's arithmetic rather than issued in one burst, they made decode 1.1-1.3x faster. */
#define PREFETCH(n) ((n) == 0 || query_table[n] != query_table[(n) - 1])
#define PF_AHEAD 16 /* positions */

INLINE vf load_q8(const uint8_t *p, const float *lut) { /* int8 (lut NULL) or a 256-entry decode table (fp8) */
    if (!lut) { vb b; memcpy(&b, p, sizeof b); return __builtin_convertvector(b, vf); }
    vf v = splat(0.0f);
    for (int i = 0; i < VL; i++) v[i] = lut[p[i]];
    return v;
}

/* the cache's element formats: fp32, 8-bit (int8 / fp8, scaled per block), bf16 / fp16 (widened exactly) */
enum { CACHE_F32 = 0, CACHE_Q8 = 1, CACHE_BF16 = H16_BF16, CACHE_F16 = H16_F16 };

INLINE vf load_elem(const void *base, int64_t idx, const int q8, const float *lut) {
    if (q8 == CACHE_Q8) return load_q8((const uint8_t *)base + idx, lut);
    if (q8 == CACHE_F32) return loadv((const float *)base + idx);
    return loadv_h16((const uint16_t *)base + idx, q8);
}

/* One tile (tn <= VL positions, whose rows start at elements rows[t]) for C query heads that share
 * the KV head at element offset `off`: their scaled queries qs[C][DV] and running acc[C][DV], m[C],
 * l[C]. DV, C and q8 are constants where it is inlined, so the key / value rows are loaded once for
 * the C heads. Per head, every operation and its order is the same whatever C is, and fused
 * multiply-adds are explicit (vfma), so prefetching or not, grouped or not, a head gets the same bits.
 * `pf` lists this chunk's share of cache lines to prefetch, spread over its positions. */
INLINE void attend_chunk(const int DV, const int C, const int q8, const vf *qs, vf *acc, float *m, float *l,
                         const void *k_cache, const void *v_cache, const int64_t *rows, int64_t off, int64_t tn,
                         vi valid, const float *ksc, const float *vsc, const float *lut,
                         const char *const *pf, int64_t pf_count) {
    const int64_t pf_per_t = (pf_count + VL - 1) / VL;
    vf a[C_MAX][DV_MAX], P[C_MAX][VL];
    float pw[C_MAX][VL];
    for (int t = 0; t < VL; t++) {
        for (int64_t j = t * pf_per_t; j < (t + 1) * pf_per_t && j < pf_count; j++) __builtin_prefetch(pf[j]);
        if (t < tn) {
            vf kr[DV_MAX];
            for (int i = 0; i < DV; i++) kr[i] = load_elem(k_cache, rows[t] + off + VL * i, q8, lut);
            for (int c = 0; c < C; c++) {
                vf s = qs[c * DV] * kr[0];
                for (int i = 1; i < DV; i++) s = vfma(qs[c * DV + i], kr[i], s);
                P[c][t] = q8 == CACHE_Q8 ? s * splat(ksc[t]) : s; /* the key's scale factors out of q.k */
            }
        } else {
            for (int c = 0; c < C; c++) P[c][t] = splat(0.0f);
        }
    }
    for (int c = 0; c < C; c++) {
        vf sc = vselect(valid, transpose_sum(P[c]), splat(-INFINITY));
        const float mb = hmax(sc);
        const float mn = mb > m[c] ? mb : m[c];
        const float alpha = m[c] == -INFINITY ? 0.0f : sexp(m[c] - mn);
        m[c] = mn;
        vf e = vselect(valid, vexp(sc - splat(mn)), splat(0.0f));
        l[c] = l[c] * alpha + hsum(e);
        for (int i = 0; i < DV; i++) a[c][i] = acc[c * DV + i] * splat(alpha);
        storev(pw[c], e);
    }
    /* p.v (a value's scale factors out of it): with every head's accumulators in registers a V row is loaded
     * once for the C heads; else head by head, so one head's stay in registers (its V rows come from L1).
     * Per head the same operations in the same order either way. */
#define PV_WEIGHT(c, t) splat(q8 == CACHE_Q8 ? pw[c][t] * vsc[t] : pw[c][t])
    if ((C + 1) * DV <= TOOLKIT_VREGS - 4) {
        for (int64_t t = 0; t < tn; t++) {
            vf v[DV_MAX];
            for (int i = 0; i < DV; i++) v[i] = load_elem(v_cache, rows[t] + off + VL * i, q8, lut);
            for (int c = 0; c < C; c++)
                for (int i = 0; i < DV; i++) a[c][i] = vfma(PV_WEIGHT(c, t), v[i], a[c][i]);
        }
    } else {
        for (int c = 0; c < C; c++)
            for (int64_t t = 0; t < tn; t++)
                for (int i = 0; i < DV; i++)
                    a[c][i] = vfma(PV_WEIGHT(c, t), load_elem(v_cache, rows[t] + off + VL * i, q8, lut), a[c][i]);
    }
#undef PV_WEIGHT
    for (int c = 0; c < C; c++)
        for (int i = 0; i < DV; i++) acc[c * DV + i] = a[c][i];
}

/* How many query heads of a KV head are taken together: the largest C <= 4 that divides G and keeps
 * C * DV <= 24 vectors (the queries of a chunk), at least 1 */
static int heads_per_chunk(int64_t G, int DV) {
    int C = 24 / DV < C_MAX ? 24 / DV : C_MAX;
    if (C < 1) C = 1;
    while (G % C) C--;
    return C;
}

/* One tile (tn <= VL positions, rows[t]) of one query for the heads of KV heads kh0 .. kh1-1 in the range: KV
 * head kh's heads lo[kh] .. hi[kh]-1 in chunks of per[kh] (`chunks` in all), each chunk given its share of
 * the `lines` cache lines in pf to prefetch. It is compiled once per head size and cache format, out of line
 * (DEFINE_ITEM), and the two copies of attend_query (prefetching or not) share it, one call a tile. Inlined into
 * both (64 copies of attend_chunk), it made this file take 15 s to compile under gcc 12 -O3 -march=x86-64-v4 on
 * the AMD EPYC (avx2 avx512f ), 4 s shared, and no measured speed: prompt and decode attention time the same
 * within 2-3%, the same bits. */
#define TILE_PARAMS                                                                                                \
    const vf *q, vf *acc, float *m, float *l, const void *k_cache, const void *v_cache, const int64_t *rows,        \
        int64_t tn, const float(*ksc)[VL], const float(*vsc)[VL], const float *lut, const char *const *pf,          \
        int64_t lines, int64_t chunks, int64_t kh0, int64_t kh1, const int64_t *lo, const int64_t *hi, const int *per
#define TILE_ARGS q, acc, m, l, k_cache, v_cache, rows, tn, ksc, vsc, lut, pf, lines, chunks, kh0, kh1, lo, hi, per
typedef void (*tile_fn)(TILE_PARAMS);
INLINE void attend_tile(const int DV, const int q8, TILE_PARAMS) {
    const int64_t D = DV * VL, share = (lines + chunks - 1) / chunks;
    const vi valid = lane_index() < splati((int32_t)tn);
    int64_t chunk = 0;
    for (int64_t kh = kh0; kh < kh1; kh++) {
        const int C = per[kh];
        for (int64_t h = lo[kh]; h < hi[kh]; h += C, chunk++) {
            const int64_t first = chunk * share, count = lines - first < share ? lines - first : share;
#define CHUNK(CC) attend_chunk(DV, CC, q8, q + h * DV, acc + h * DV, m + h, l + h, k_cache, v_cache, rows, kh * D, \
                               tn, valid, ksc[kh], vsc[kh], lut, pf + (count > 0 ? first : 0), count > 0 ? count : 0)
            switch (C) {
            case 4: CHUNK(4); break;
            case 3: CHUNK(3); break;
            case 2: CHUNK(2); break;
            default: CHUNK(1); break;
            }
#undef CHUNK
        }
    }
}

/* nq query tokens of one sequence (their rows `q_stride` floats apart in qn and H * D apart in out; ctxs[j] keys
 * for the j-th), their heads h0 .. h1-1, over the sequence's first positions in tiles of VL: each tile's K rows
 * (then V rows) of every KV head lie contiguously in the cache. The heads of one KV head in the range go in
 * chunks of heads_per_chunk of their count; a head's bits are the same whatever its range and chunk (see
 * attend_chunk). A tile is taken by each of the queries in turn, so its rows come from L1 for all but the first
 * (a prompt chunk's queries read the same keys: one at a time, each streamed them from L3 or memory); a query
 * makes the same calls in the same order whatever the others, so it gets the bits it gets alone. `tile` is
 * attend_tile for DV and q8. When `prefetch`, the rows PF_AHEAD positions on are prefetched, a share per chunk
 * (see PREFETCH), by the first query a tile. */
INLINE void attend_queries(const int DV, const int q8, const tile_fn tile, const float *qn, int64_t q_stride,
                           int64_t nq, const int64_t *ctxs, const void *k_cache, const void *v_cache,
                           const int64_t *table, int64_t H, int64_t K, int64_t BS, float scale, float *out,
                           const float *k_scales, const float *v_scales, int64_t scale_stride, const float *lut,
                           const int prefetch, int64_t h0, int64_t h1) {
    const int64_t D = DV * VL, G = H / K, esize = q8 == CACHE_Q8 ? 1 : q8 == CACHE_F32 ? 4 : 2;
    const int64_t row_bytes = K * D * esize, HV = H * DV;
    const int64_t kh0 = h0 / G, kh1 = (h1 + G - 1) / G; /* the KV heads the range reads */
    vf q[nq][HV], acc[nq][HV];
    float m[nq][H], l[nq][H];
    int64_t ctx = 0;
    for (int64_t j = 0; j < nq; j++) {
        ctx = ctxs[j] > ctx ? ctxs[j] : ctx;
        for (int64_t h = h0; h < h1; h++) {
            for (int i = 0; i < DV; i++) {
                q[j][h * DV + i] = loadv(qn + j * q_stride + h * D + VL * i) * splat(scale);
                acc[j][h * DV + i] = splat(0.0f);
            }
            m[j][h] = -INFINITY; l[j][h] = 0.0f;
        }
    }
    int64_t rows[VL];
    float ksc[SIMD_MAX_H][VL], vsc[SIMD_MAX_H][VL]; /* per KV head and position: the block's scales */
    const char *pf[2 * VL * 16];                     /* lines of K and V rows ahead (a row is <= 16 lines here) */
    const int64_t row_lines = (row_bytes + 63) / 64 < 16 ? (row_bytes + 63) / 64 : 16;
    int64_t lo[SIMD_MAX_H], hi[SIMD_MAX_H], chunks = 0; /* per KV head read: its heads in the range */
    int per[SIMD_MAX_H];                                    /* ... and how many go in a chunk */
    for (int64_t kh = kh0; kh < kh1; kh++) {
        lo[kh] = kh * G > h0 ? kh * G : h0;
        hi[kh] = (kh + 1) * G < h1 ? (kh + 1) * G : h1;
        per[kh] = heads_per_chunk(hi[kh] - lo[kh], DV);
        chunks += (hi[kh] - lo[kh]) / per[kh];
    }
    for (int64_t t0 = 0; t0 < ctx; t0 += VL) {
        const int64_t span = (ctx - t0) < VL ? (ctx - t0) : VL;
        for (int64_t t = 0, blk = t0 / BS, off = t0 % BS; t < span; t++) {
            rows[t] = (table[blk] * BS + off) * K * D;
            if (q8 == CACHE_Q8)
                for (int64_t kh = 0; kh < K; kh++) {
                    ksc[kh][t] = k_scales[table[blk] * scale_stride + kh];
                    vsc[kh][t] = v_scales[table[blk] * scale_stride + kh];
                }
            if (++off == BS) { off = 0; blk++; }
        }
        int64_t lines = 0;
        if (prefetch)
            for (int64_t p = t0 + PF_AHEAD; p < t0 + PF_AHEAD + VL && p < ctx; p++) {
                const int64_t start = (table[p / BS] * BS + p % BS) * row_bytes;
                for (int64_t j = 0; j < row_lines; j++) {
                    pf[lines++] = (const char *)k_cache + start + 64 * j;
                    pf[lines++] = (const char *)v_cache + start + 64 * j;
                }
            }
        for (int64_t j = 0; j < nq; j++) {
            const int64_t tn = (ctxs[j] - t0) < VL ? (ctxs[j] - t0) : VL;
            if (tn <= 0) continue; /* this query's keys end before the tile */
            tile(q[j], acc[j], m[j], l[j], k_cache, v_cache, rows, tn, (const float (*)[VL])ksc,
                 (const float (*)[VL])vsc, lut, lines ? pf : NULL, lines, chunks, kh0, kh1, lo, hi, per);
            lines = 0; /* the first query's prefetches bring the rows for the others */
        }
    }
    for (int64_t j = 0; j < nq; j++)
        for (int64_t h = h0; h < h1; h++) {
            const vf inv = splat(1.0f / l[j][h]);
            for (int i = 0; i < DV; i++) storev(out + j * H * D + h * D + VL * i, acc[j][h * DV + i] * inv);
        }
}

#define DEFINE_ITEM(NAME, DV, Q8, ELEM)                                                                         \
static __attribute__((noinline)) void NAME##_tile(TILE_PARAMS) { attend_tile(DV, Q8, TILE_ARGS); }             \
static void NAME(const float *qn, int64_t q_stride, int64_t nq, const int64_t *ctxs, const ELEM *k_cache,       \
                 const ELEM *v_cache, const int64_t *table, int64_t H, int64_t K, int64_t BS, float scale,      \
                 float *out, const float *k_scales, const float *v_scales, int64_t scale_stride,               \
                 const float *lut, int prefetch, int64_t h0, int64_t h1) {                                     \
    if (prefetch) /* two copies, so the one without prefetching carries none of its bookkeeping */          \
        attend_queries(DV, Q8, NAME##_tile, qn, q_stride, nq, ctxs, k_cache, v_cache, table, H, K, BS, scale,  \
                       out, k_scales, v_scales, scale_stride, lut, 1, h0, h1);                                \
    else                                                                                                       \
        attend_queries(DV, Q8, NAME##_tile, qn, q_stride, nq, ctxs, k_cache, v_cache, table, H, K, BS, scale,  \
                       out, k_scales, v_scales, scale_stride, lut, 0, h0, h1);                                \
}

/* How many ranges of heads each query is split into, each range one work item: 1 where the queries alone give
 * every thread one (a batch), else enough for every thread (a decode step of one sequence would otherwise run
 * all its heads on one thread while the others wait at the step's next barrier), at most a range a head */
static int64_t head_ranges(int64_t N, int64_t H, int num_threads) {
    if (num_threads <= 1 || N >= num_threads) return 1;
    const int64_t s = (num_threads + N - 1) / N;
    return s < H ? s : H;
}
/* The work items of a batch where each query runs whole (head_ranges 1): runs of consecutive queries of one
 * sequence, at most qb each, so a prompt chunk's queries share its tiles (attend_queries), while every thread
 * still gets several items (a chunk's later queries see more keys: dynamic scheduling evens that out). qb keeps
 * a run's queries and accumulators (2 * nq * H * D floats, on the stack) to 128 KiB. first[b] is the b-th run's
 * first query, first[count] = N; the count is returned. A query's bits do not depend on its run. */
#define QB_MAX 32
static int64_t query_runs(const int64_t *query_table, int64_t N, int64_t H, int64_t D, int num_threads,
                          int64_t *first) {
    int64_t qb = N / (4 * (int64_t)(num_threads > 0 ? num_threads : 1));
    const int64_t fits = 131072 / (int64_t)(2 * H * D * sizeof(float));
    qb = qb < QB_MAX ? qb : QB_MAX;
    qb = qb < fits ? qb : fits;
    qb = qb > 1 ? qb : 1;
    int64_t count = 0;
    for (int64_t n = 0; n < N; n++)
        if (n == 0 || query_table[n] != query_table[n - 1] || n - first[count - 1] == qb) first[count++] = n;
    first[count] = N;
    return count;
}

/* The items over N queries: with head ranges (S > 1, fewer queries than threads) one query's range each, else runs
 * of queries (query_runs; one query each where the run list cannot be allocated). RUN_ITEMS(body) sets n, nq, h0,
 * h1 for the body, over the threads. */
#define RUN_ITEMS(...)                                                                                             \
    do {                                                                                                           \
        const int64_t S = head_ranges(N, H, num_threads);                                                          \
        int64_t *first = S == 1 ? malloc((size_t)(N + 1) * sizeof *first) : NULL;                                  \
        const int64_t B = first ? query_runs(query_table, N, H, D, num_threads, first) : N;                        \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                                  \
        for (int64_t i = 0; i < B * S; i++) {                                                                      \
            const int64_t b = i / S, n = first ? first[b] : b, nq = first ? first[b + 1] - n : 1;                  \
            const int64_t h0 = i % S * H / S, h1 = (i % S + 1) * H / S;                                            \
            __VA_ARGS__;                                                                                           \
        }                                                                                                          \
        free(first);                                                                                               \
    } while (0)

DEFINE_ITEM(item_simd_64, 64 / VL, 0, float)
DEFINE_ITEM(item_simd_128, 128 / VL, 0, float)
DEFINE_ITEM(item_q8_64, 64 / VL, 1, uint8_t)
DEFINE_ITEM(item_q8_128, 128 / VL, 1, uint8_t)
DEFINE_ITEM(item_bf16_64, 64 / VL, CACHE_BF16, uint16_t)
DEFINE_ITEM(item_bf16_128, 128 / VL, CACHE_BF16, uint16_t)
DEFINE_ITEM(item_f16_64, 64 / VL, CACHE_F16, uint16_t)
DEFINE_ITEM(item_f16_128, 128 / VL, CACHE_F16, uint16_t)

/* 1 when the kernel takes these shapes (quantised: an 8-bit or 16-bit cache), else 0: the engine asks before it
 * picks the native backend, so a model the kernel cannot run never reaches it */
int toolkit_paged_attention_supports(int64_t H, int64_t K, int64_t D, int64_t BS, int quantized) {
    if (H <= 0 || K <= 0 || D <= 0 || BS <= 0 || H % K != 0) return 0;
    if (quantized) return H <= SIMD_MAX_H && (D == 64 || D == 128);
    return H / K <= MAX_G && D <= MAX_D && BS <= MAX_BS;
}

int toolkit_paged_attention_f32(
    const float *q, int64_t q_row_stride,            /* q[n][h][d] at q + n*q_row_stride + h*D + d */
    const float *k_cache, const float *v_cache,      /* [num_blocks][BS][K][D] contiguous */
    const int64_t *block_tables, int64_t bt_row_stride,
    const int64_t *query_table,                      /* [N] row of block_tables used by query n */
    const int64_t *query_ctx,                        /* [N] number of keys query n sees (its position + 1) */
    float *out,                                      /* [N][H][D] contiguous */
    int64_t N, int64_t H, int64_t K, int64_t D, int64_t BS, float scale, int num_threads)
{
    if (!toolkit_paged_attention_supports(H, K, D, BS, 0)) return -1;
    const int64_t G = H / K;
    if (H <= SIMD_MAX_H && (D == 64 || D == 128)) {
        RUN_ITEMS({
            const int64_t *table = block_tables + query_table[n] * bt_row_stride;
            if (D == 64) item_simd_64(q + n * q_row_stride, q_row_stride, nq, query_ctx + n, k_cache, v_cache, table, H, K, BS, scale, out + n * H * D, 0, 0, 0, 0, PREFETCH(n), h0, h1);
            else item_simd_128(q + n * q_row_stride, q_row_stride, nq, query_ctx + n, k_cache, v_cache, table, H, K, BS, scale, out + n * H * D, 0, 0, 0, 0, PREFETCH(n), h0, h1);
        });
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
                    const float alpha = m[g] == -INFINITY ? 0.0f : sexp(m[g] - mn);
                    l[g] *= alpha;
                    for (int64_t d = 0; d < D; d++) acc[g][d] *= alpha;
                    for (int64_t t = 0; t < tn; t++) s[g][t] = sexp(s[g][t] - mn);
                    for (int64_t t = 0; t < tn; t++) l[g] += s[g][t];
                    m[g] = mn;
                }
                for (int64_t t = 0; t < tn; t++) {
                    const float *vr = vrow[t];
                    for (int64_t g = 0; g < G; g++) {
                        const float p = s[g][t];
                        for (int64_t d = 0; d < D; d++) acc[g][d] = sfma(p, vr[d], acc[g][d]);
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
    if (!toolkit_paged_attention_supports(H, K, D, BS, 1)) return -1;
    RUN_ITEMS({
        const int64_t *table = block_tables + query_table[n] * bt_row_stride;
        if (D == 64) item_q8_64(q + n * q_row_stride, q_row_stride, nq, query_ctx + n, k_cache, v_cache, table, H, K,
                                BS, scale, out + n * H * D, k_scales, v_scales, scale_stride, lut, PREFETCH(n), h0, h1);
        else item_q8_128(q + n * q_row_stride, q_row_stride, nq, query_ctx + n, k_cache, v_cache, table, H, K, BS,
                         scale, out + n * H * D, k_scales, v_scales, scale_stride, lut, PREFETCH(n), h0, h1);
    });
    return 0;
}

/* The same attention over a bf16 (kind 2) or fp16 (kind 3) cache, head_dim 64 or 128: every key and value
 * is widened exactly to fp32 as it is read, so the result is the fp32 kernel's on the widened cache, bit for
 * bit, while a step reads half the bytes. */
int toolkit_paged_attention_h16(
    const float *q, int64_t q_row_stride, const uint16_t *k_cache, const uint16_t *v_cache,
    const int64_t *block_tables, int64_t bt_row_stride, const int64_t *query_table, const int64_t *query_ctx,
    float *out, int64_t N, int64_t H, int64_t K, int64_t D, int64_t BS, float scale, int num_threads, int kind)
{
    if (!toolkit_paged_attention_supports(H, K, D, BS, 1) || (kind != CACHE_BF16 && kind != CACHE_F16)) return -1;
    RUN_ITEMS({
        const int64_t *table = block_tables + query_table[n] * bt_row_stride;
        const float *qn = q + n * q_row_stride;
        const int64_t *ctx = query_ctx + n;
        float *on = out + n * H * D;
        const int pf = PREFETCH(n);
        if (kind == CACHE_BF16) {
            if (D == 64) item_bf16_64(qn, q_row_stride, nq, ctx, k_cache, v_cache, table, H, K, BS, scale, on, 0, 0, 0, 0, pf, h0, h1);
            else item_bf16_128(qn, q_row_stride, nq, ctx, k_cache, v_cache, table, H, K, BS, scale, on, 0, 0, 0, 0, pf, h0, h1);
        } else {
            if (D == 64) item_f16_64(qn, q_row_stride, nq, ctx, k_cache, v_cache, table, H, K, BS, scale, on, 0, 0, 0, 0, pf, h0, h1);
            else item_f16_128(qn, q_row_stride, nq, ctx, k_cache, v_cache, table, H, K, BS, scale, on, 0, 0, 0, 0, pf, h0, h1);
        }
    });
    return 0;
}
