/*
 * Batch-invariant fp32 matrix product on the CPU: out[M, N] = x[M, K] @ w[K, N].
 *
 * Every output element is computed the same way whatever M is, whatever the other rows
 * hold and whatever the number of threads: out[m, n] starts at 0 and accumulates
 * x[m, k] * w[k, n] with one fused multiply-add per k, k = 0, 1, ..., K-1, in that order
 * (vfma / sfma: a multiply and an add where the target has no FMA). BLAS kernels pick their
 * blocking (and so their summation order) from the shape, which is why torch's linear gives a
 * row different bits in different batches. The lanes only split the columns, so every FMA build
 * gives the same bits, whatever its vector width (AVX-512, AVX2, NEON).
 *
 * Speed comes from register blocking that does not touch the order: a micro-tile of
 * MR rows x NR columns keeps MR * NR / VL independent accumulators (one FMA chain each),
 * so each weight vector loaded is used MR times and each x value NR / VL times. Threads
 * split the columns into panels; a panel of w (K x NR, packed contiguously) stays in cache
 * while every row tile passes over it. Rows left over (M % MR) and columns left over (N % NR) run the
 * same per-element chain in narrower tiles. While a panel's row tiles run, they prefetch the
 * next panel into L2 (a share of its lines each, spread over its k steps, as many a step as the
 * share needs): at decode batch sizes the weights stream from memory once per step, and this
 * overlaps that stream with the FMAs (prefetching never changes a result). Every line of the next
 * panel is asked for: when a pass issued at most one line a k step, a 64-step block left half of
 * the next panel (at M = 1, three quarters) to the hardware, and a decode step's GEMMs (SmolLM2,
 * AMD EPYC, 2 cores, the two builds alternating in one process) took 20.3-20.6 ms at M = 10
 * instead of 14.2-16.5, and 22.4-22.7 ms at M = 16 instead of 18.7-19.5; M = 1 within 4%.
 */
#include <stdint.h>
#include <string.h>

#include "simd.h" /* vf (VL lanes), loadv / storev / splat, vfma / sfma */
#include "kernels.h" /* the entry points this file defines, declared once */

/* the micro-tile: MR rows x NV vectors of columns, MR * NV accumulators + NV weight vectors + one
 * broadcast x within the target's vector registers */
#if VL == 1
#define MR 4
#define NV 4
#elif TOOLKIT_VREGS >= 32
#define MR 6 /* 6 x 4 accumulators + 4 weight vectors fit AVX-512's (or NEON's) 32 registers */
#define NV 4
#else
#define MR 6 /* 6 x 2 accumulators + 2 weight vectors + 1 broadcast in AVX2's 16 */
#define NV 2
#endif
#define NR (VL * NV) /* columns per wide panel; narrow panels are VL columns */
#define KC (4096 / NR > 64 ? 4096 / NR : 64) /* k per block: a 16 KB slab of a wide panel (L1 holds it) */

/* the packing this build expects (toolkit.native.ops.pack_weight): {wide panel columns, narrow panel columns} */
void toolkit_matmul_layout(int64_t *out) { out[0] = NR; out[1] = VL; }
#if NV % 2
#error "bf16 wide panels interleave pairs of column blocks: NV must be even"
#endif

/* rows [m0, m0 + mr) x the VL * nv columns at n0, over K of the k steps: the chain acc = fma(x, w, acc)
 * goes on from the sums in `out` (from 0 when `first`): a chain split into blocks of k is the same chain.
 * The weights are fp32 (KIND H16_NONE) or 16-bit (bf16 / fp16), widened exactly as they are loaded. */
#define WLOAD(p, KIND) ((KIND) == H16_NONE ? loadv((const float *)(p)) : loadv_h16((const uint16_t *)(p), KIND))
/* bf16 wide panels hold their column blocks in pairs, interleaved (pack_weight): a pair's 2 * VL weights
 * are read as VL 32-bit words whose low halves are the first block's weights and high halves the second's,
 * so a shift and a mask widen both (half the work of widening each block on its own) */
#define WLOAD_PAIR(p, lo, hi)                        \
    do {                                             \
        vu u_;                                       \
        memcpy(&u_, p, sizeof u_);                   \
        lo = (vf)(u_ << 16);                         \
        hi = (vf)(u_ & 0xffff0000u);                 \
    } while (0)
#define DEFINE_TILE(R, V, TAG, WT, KIND)                                                                  \
static void tile_##R##_##TAG(const float *x, int64_t ldx, const WT *w, int64_t ldw, float *out,          \
                           int64_t ldo, int64_t K, int first, const char *pf, int64_t pf_lines) {      \
    vf acc[R][V];                                                                                     \
    for (int r = 0; r < R; r++)                                                                        \
        for (int v = 0; v < V; v++) acc[r][v] = first ? splat(0.0f) : loadv(out + r * ldo + VL * v);   \
    const int64_t per_k = (pf_lines + K - 1) / K; \
    for (int64_t k = 0; k < K; k++) {                                                                  \
        for (int64_t q = k * per_k; q < (k + 1) * per_k && q < pf_lines; q++)                          \
            __builtin_prefetch(pf + 64 * q, 0, 2);                                                     \
        vf wk[V];                                                                                     \
        WLOAD_ROW(w + k * ldw, wk, V, KIND);                                                           \
        for (int r = 0; r < R; r++) {                                                                  \
            const vf xr = splat(x[r * ldx + k]);                                                      \
            for (int v = 0; v < V; v++) acc[r][v] = vfma(xr, wk[v], acc[r][v]);\
        }                                                                                              \
    }                                                                                                  \
    for (int r = 0; r < R; r++)                                                                        \
        for (int v = 0; v < V; v++) storev(out + r * ldo + VL * v, acc[r][v]);                        \
}

/* V vectors of one k row of a panel into wk[] */
#define WLOAD_ROW(p, wk, V, KIND)                                                              \
    do {                                                                                       \
        if ((KIND) == H16_BF16 && (V) % 2 == 0)                                                \
            for (int v_ = 0; v_ < (V); v_ += 2) WLOAD_PAIR((p) + VL * v_, wk[v_], wk[v_ + 1]); \
        else                                                                                   \
            for (int v_ = 0; v_ < (V); v_++) wk[v_] = WLOAD((p) + VL * v_, KIND);              \
    } while (0)

/* Rows over G adjacent wide panels at once, the whole of k in one pass (the schedules MM_PAIRS and MM_QUADS, for
 * the few rows of a decode step): G * NV chains a row instead of NV, so the FMA latency does not bound the weights
 * read per cycle (with AVX2's NV = 2 and 16-bit weights it did), and G streams of weights in flight. Each column
 * is still the one chain from 0 over k = 0 .. K-1: the same bits as every other schedule. While they run, the
 * group's k steps prefetch `pf_lines` lines at `pf` (the thread's next group). */
#define DEFINE_GROUP(G, R, F, WT, KIND)                                                                        \
static void group_##G##_##R##_##F(const float *x, int64_t ldx, const WT *w, float *out, int64_t ldo, int64_t K, \
                                  const char *pf, int64_t pf_lines) {                                          \
    vf acc[R][G * NV];                                                                                         \
    for (int r = 0; r < R; r++)                                                                                \
        for (int v = 0; v < G * NV; v++) acc[r][v] = splat(0.0f);                                              \
    const int64_t per_k = (pf_lines + K - 1) / K;                                                              \
    for (int64_t k = 0; k < K; k++) {                                                                          \
        for (int64_t q = k * per_k; q < (k + 1) * per_k && q < pf_lines; q++)                                  \
            __builtin_prefetch(pf + 64 * q, 0, 2);                                                             \
        vf wk[G * NV];                                                                                         \
        for (int g = 0; g < G; g++) WLOAD_ROW(w + g * K * NR + k * NR, (wk + g * NV), NV, KIND);               \
        for (int r = 0; r < R; r++) {                                                                          \
            const vf xr = splat(x[r * ldx + k]);                                                               \
            for (int v = 0; v < G * NV; v++) acc[r][v] = vfma(xr, wk[v], acc[r][v]);                           \
        }                                                                                                      \
    }                                                                                                          \
    for (int r = 0; r < R; r++) /* the group's panels' columns are adjacent */                                 \
        for (int v = 0; v < G * NV; v++) storev(out + r * ldo + VL * v, acc[r][v]);                            \
}

/* every tile of one weight format: TILES_WIDE_<F> / TILES_NARROW_<F>[rows] */
#define DEFINE_TILES(R, F, WT, KIND) DEFINE_TILE(R, NV, wide_##F, WT, KIND) DEFINE_TILE(R, 1, narrow_##F, WT, KIND)
#define DEFINE_FORMAT(F, WT, KIND)                                                                         \
    DEFINE_TILES(6, F, WT, KIND) DEFINE_TILES(5, F, WT, KIND) DEFINE_TILES(4, F, WT, KIND)                 \
    DEFINE_TILES(3, F, WT, KIND) DEFINE_TILES(2, F, WT, KIND) DEFINE_TILES(1, F, WT, KIND)                 \
    typedef void (*tile_##F)(const float *, int64_t, const WT *, int64_t, float *, int64_t, int64_t, int,   \
                             const char *, int64_t);                                                       \
    static const tile_##F TILES_WIDE_##F[7] = {0, tile_1_wide_##F, tile_2_wide_##F, tile_3_wide_##F,        \
                                               tile_4_wide_##F, tile_5_wide_##F, tile_6_wide_##F};         \
    static const tile_##F TILES_NARROW_##F[7] = {0, tile_1_narrow_##F, tile_2_narrow_##F, tile_3_narrow_##F, \
                                                 tile_4_narrow_##F, tile_5_narrow_##F, tile_6_narrow_##F};
DEFINE_FORMAT(f32, float, H16_NONE)
DEFINE_FORMAT(bf16, uint16_t, H16_BF16)
DEFINE_FORMAT(f16, uint16_t, H16_F16)
#define DEFINE_GROUPS(F, WT, KIND)                                                               \
    DEFINE_GROUP(2, 2, F, WT, KIND) DEFINE_GROUP(2, 1, F, WT, KIND) DEFINE_GROUP(4, 1, F, WT, KIND) \
    DEFINE_GROUP(6, 1, F, WT, KIND)
DEFINE_GROUPS(f32, float, H16_NONE)
DEFINE_GROUPS(bf16, uint16_t, H16_BF16)
DEFINE_GROUPS(f16, uint16_t, H16_F16)

INLINE float widen_any(const void *w, int64_t i, const int kind) {
    return kind == H16_NONE ? ((const float *)w)[i] : widen_h16(((const uint16_t *)w)[i], kind);
}

/* columns that are not a multiple of VL: scalar chains, the same fma per k */
INLINE void tail_columns(const float *x, int64_t ldx, const void *w, int64_t ldw, float *out, int64_t ldo,
                         int64_t M, int64_t K, int64_t n0, int64_t N, const int kind) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < N; n++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc = sfma(x[m * ldx + k], widen_any(w, k * ldw + (n - n0), kind), acc);
            out[m * ldo + n] = acc;
        }
}

/* w is packed panel by panel (see toolkit.native.ops.pack_weight): the wide panels [N / NR][K][NR] (bf16: each
 * k's NR columns as NV / 2 interleaved pairs of VL-column blocks), then the VL-column panels [.][K][VL], then
 * the last N % VL columns as [K][N % VL]; each panel is contiguous, so a tile streams it front to back. MR is
 * at most 6 (the tables' size). */
/* rows per block of the many-row path: a multiple of MR whose x slab (rows x K floats) fits MC_BYTES */
#ifndef MC_BYTES
#define MC_BYTES (256 * 1024)
#endif
static int64_t row_block(int64_t K) {
    int64_t rows = MC_BYTES / (K * (int64_t)sizeof(float)) / MR * MR;
    return rows < 4 * MR ? 4 * MR : rows;
}

/* One panel p (wide or narrow) for rows [mb, mend), by row tiles over blocks of k whose slab of the panel stays
 * in L1 while every row tile passes over it; with `prefetch` the tiles prefetch the next panel, a share each */
#define DEFINE_PANEL(F, WT)                                                                                   \
static void panel_##F(const float *x, int64_t ldx, const WT *w, float *out, int64_t ldo, int64_t mb,           \
                      int64_t mend, int64_t K, int64_t p, int64_t wide_panels, int64_t narrow_start,           \
                      int64_t panels, int prefetch) {                                                         \
    const int wide = p < wide_panels;                                                                          \
    const int64_t n0 = wide ? p * NR : narrow_start + (p - wide_panels) * VL;                                  \
    const int64_t width = wide ? NR : VL;                                                                      \
    const WT *panel = w + n0 * K; /* panels before this one hold n0 columns of K rows */                      \
    const tile_##F *tiles = wide ? TILES_WIDE_##F : TILES_NARROW_##F;                                          \
    const char *next = (const char *)(panel + width * K); /* the next panel, packed right after this one */    \
    const int64_t lines = prefetch && p + 1 < panels ? K * (p + 1 < wide_panels ? NR : VL) * (int64_t)sizeof(WT) / 64 \
                                                     : 0;                                                      \
    const int64_t row_tiles = (mend - mb + MR - 1) / MR, passes = row_tiles * ((K + KC - 1) / KC);             \
    const int64_t share = (lines + passes - 1) / passes;                                                       \
    for (int64_t k0 = 0, r = 0; k0 < K; k0 += KC) {                                                            \
        const int64_t kc = K - k0 < KC ? K - k0 : KC;                                                          \
        for (int64_t m0 = mb; m0 < mend; m0 += MR, r++) {                                                      \
            const int64_t mr = (mend - m0) < MR ? (mend - m0) : MR;                                            \
            int64_t first = r * share, count = lines - first < share ? lines - first : share;                  \
            if (count < 0) count = 0;                                                                          \
            tiles[mr](x + m0 * ldx + k0, ldx, panel + k0 * width, width, out + m0 * ldo + n0, ldo, kc, k0 == 0, \
                      next + 64 * first, count);                                                               \
        }                                                                                                      \
    }                                                                                                          \
}

/* The schedules (`schedule`, MM_*): which loops run the same chains. Every one gives the same bits (each column one FMA
 * chain over k in order); they differ in how the weights stream, so the fastest depends on the CPU and the rows
 * (toolkit/native/schedules.py measures them at first use and keeps the choice per CPU and build).
 *   MM_TILES: panel by panel, each in blocks of k, row tiles of up to MR rows over each block (the general path:
 *             prefill and batches; the x slab in L2, a block of the panel in L1);
 *   MM_PAIRS: two wide panels at a time, the whole of k in one pass, rows two at a time;
 *   MM_QUADS: four wide panels at a time, the whole of k in one pass, one row at a time;
 *   MM_HEXES: six wide panels at a time, the whole of k in one pass, one row at a time (with AVX2's NV = 2, 12
 *             chains: 16-bit weights give half the bytes a k step of fp32's, so a row needs more chains in
 *             flight to stream them as fast).
 * The grouped schedules hand out groups of panels (the panels left over and the narrow ones as tiles, one a unit):
 * a contiguous share a thread, then the shares' last units to the threads done first (see `steal` below). */
enum { MM_TILES = 0, MM_PAIRS = 1, MM_QUADS = 2, MM_HEXES = 3, MM_LOOPS };
/* each set of loops with the software prefetch above (schedule < MM_LOOPS) and without it (schedule - MM_LOOPS): on
 * some CPUs the hardware prefetcher alone streams faster (Zen 4, 2 cores: a row at a time over SmolLM2's LM head
 * 54-67 GB/s without, 34-38 with), on others the prefetch covers what it misses (see the top of this file) */
enum { MM_SCHEDULES = 2 * MM_LOOPS };
int toolkit_matmul_schedules(void) { return MM_SCHEDULES; }

/* The grouped schedules' work comes in units: each group of G adjacent wide panels (the first `groups` units), then
 * each panel left over (wide or narrow) as tiles. Each thread starts on a contiguous share of them (equal counts of
 * panels) and takes its units from the front; a thread done with its share takes the last units of the share with
 * the most left, from the back, until none is left. Two threads streaming at once do not stream at the same rate
 * (SmolLM2's bf16 decode on a 2-core AMD EPYC (avx2): one finished a projection ~10% of its time after the other,
 * either one, at random), so a fixed split leaves one waiting at the end; which thread computes a unit never
 * changes its bits (each column is one chain in one unit). */
#define MAX_SHARES 256
struct share { /* a cache line each: a thread's claims do not slow the others' */
    _Alignas(64) uint64_t bounds; /* the next unit from the front (low 32 bits), one past the last (high 32 bits) */
};
static uint64_t share_bounds(int64_t lo, int64_t hi) { return (uint64_t)hi << 32 | (uint64_t)lo; }
/* the unit holding panel p (a panel inside a group: the group after it, so a share starts on a whole group) */
static int64_t unit_of(int64_t p, int64_t groups, int64_t G) {
    return p < groups * G ? (p + G - 1) / G : groups + p - groups * G;
}
/* the share's next unit from its front (back = 0) or its back (back = 1); -1 when it has none left */
static int64_t claim(struct share *s, int back) {
    uint64_t cur = __atomic_load_n(&s->bounds, __ATOMIC_RELAXED), next;
    do {
        const int64_t lo = (int64_t)(cur & 0xffffffffu), hi = (int64_t)(cur >> 32);
        if (lo >= hi) return -1;
        next = back ? share_bounds(lo, hi - 1) : share_bounds(lo + 1, hi);
    } while (!__atomic_compare_exchange_n(&s->bounds, &cur, next, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return back ? (int64_t)(cur >> 32) - 1 : (int64_t)(cur & 0xffffffffu);
}
/* a unit from the back of the share (not thread t's) with the most left; -1 when every share is done */
static int64_t steal(struct share *shares, int64_t threads, int64_t t) {
    for (;;) {
        int64_t best = -1, most = 0;
        for (int64_t v = 0; v < threads; v++) {
            const uint64_t b = __atomic_load_n(&shares[v].bounds, __ATOMIC_RELAXED);
            const int64_t left = (int64_t)(b >> 32) - (int64_t)(b & 0xffffffffu);
            if (v != t && left > most) best = v, most = left;
        }
        if (best < 0) return -1;
        const int64_t u = claim(&shares[best], 1);
        if (u >= 0) return u;
    }
}

/* unit u for every row; a group's first rows prefetch group `ahead`'s panels (the unit the thread likely takes
 * next) when the schedule prefetches */
#define DEFINE_UNIT(F, WT)                                                                                       \
static void unit_##F(const float *x, int64_t ldx, const WT *w, float *out, int64_t ldo, int64_t M, int64_t K,     \
                     int64_t u, int64_t ahead, int64_t groups, int64_t G, int64_t wide_panels, int64_t narrow_start, \
                     int64_t panels, int prefetch) {                                                             \
    if (u >= groups) { /* a panel left over: as tiles */                                                        \
        panel_##F(x, ldx, w, out, ldo, 0, M, K, groups * G + u - groups, wide_panels, narrow_start, panels, 0);  \
        return;                                                                                                  \
    }                                                                                                            \
    const int64_t p = u * G, R = G == 2 ? 2 : 1;                                                                 \
    const WT *group = w + p * NR * K;                                                                            \
    const int next = prefetch && ahead >= 0 && ahead < groups; /* the unit to prefetch is a group */             \
    const char *pf = (const char *)(w + (next ? ahead : 0) * G * NR * K);                                       \
    const int64_t pf_lines = next ? G * NR * K * (int64_t)sizeof(WT) / 64 : 0;                                  \
    for (int64_t m0 = 0; m0 < M; m0 += R) {                                                                      \
        const int64_t lines = m0 == 0 ? pf_lines : 0;                                                            \
        if (G == 6) group_6_1_##F(x + m0 * ldx, ldx, group, out + m0 * ldo + p * NR, ldo, K, pf, lines);         \
        else if (G == 4) group_4_1_##F(x + m0 * ldx, ldx, group, out + m0 * ldo + p * NR, ldo, K, pf, lines);    \
        else if (M - m0 >= 2) group_2_2_##F(x + m0 * ldx, ldx, group, out + m0 * ldo + p * NR, ldo, K, pf, lines); \
        else group_2_1_##F(x + m0 * ldx, ldx, group, out + m0 * ldo + p * NR, ldo, K, pf, lines);                \
    }                                                                                                            \
}

#define DEFINE_MATMUL(F, WT, KIND)                                                                              \
DEFINE_PANEL(F, WT)                                                                                             \
DEFINE_UNIT(F, WT)                                                                                              \
static int matmul_##F(const float *x, int64_t ldx, const WT *w, float *out, int64_t ldo, int64_t M, int64_t K,  \
                      int64_t N, int num_threads, int schedule) {                                               \
    if (schedule < 0 || schedule >= MM_SCHEDULES) return -1;                                                     \
    if (M <= 0 || N <= 0) return 0;                                                                            \
    if (K <= 0) {                                                                                              \
        for (int64_t m = 0; m < M; m++) memset(out + m * ldo, 0, (size_t)N * sizeof(float));                   \
        return 0;                                                                                              \
    }                                                                                                          \
    const int64_t wide_panels = N / NR;                                                                        \
    const int64_t narrow_start = wide_panels * NR;                                                             \
    const int64_t narrow_panels = (N - narrow_start) / VL;                                                     \
    const int64_t vec_end = narrow_start + narrow_panels * VL;                                                 \
    const int64_t panels = wide_panels + narrow_panels;                                                        \
    const int prefetch = schedule < MM_LOOPS;                                                                  \
    schedule %= MM_LOOPS;                                                                                      \
    if (schedule == MM_TILES) {                                                                                 \
        /* in blocks of rows whose x slab stays in L2 while every panel passes over it (a row's sums are the   \
         * same in any block); each panel's tiles prefetch the next panel (packed right after it) */          \
        const int64_t mc = row_block(K);                                                                       \
        for (int64_t mb = 0; mb < M; mb += mc) {                                                               \
            const int64_t mend = M - mb < mc ? M : mb + mc;                                                    \
            _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && panels > 1)") \
            for (int64_t p = 0; p < panels; p++) {                                                             \
                panel_##F(x, ldx, w, out, ldo, mb, mend, K, p, wide_panels, narrow_start, panels, prefetch);   \
            }                                                                                                  \
        }                                                                                                      \
    } else {                                                                                                   \
        const int64_t G = schedule == MM_PAIRS ? 2 : schedule == MM_QUADS ? 4 : 6;                             \
        const int64_t groups = wide_panels / G, units = groups + panels - groups * G;                          \
        if (units > 0x7fffffff) return -1; /* a share's bounds are 32-bit */                                   \
        int64_t threads = num_threads < 1 ? 1 : num_threads > units ? units : num_threads;                     \
        if (threads > MAX_SHARES) threads = MAX_SHARES;                                                       \
        struct share shares[MAX_SHARES];                                                                       \
        for (int64_t t = 0; t < threads; t++)                                                                  \
            shares[t].bounds = share_bounds(unit_of(t * panels / threads, groups, G),                          \
                                            unit_of((t + 1) * panels / threads, groups, G));                   \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")                     \
        for (int64_t t = 0; t < threads; t++) {                                                                \
            int64_t u;                                                                                         \
            while ((u = claim(&shares[t], 0)) >= 0)                                                            \
                unit_##F(x, ldx, w, out, ldo, M, K, u, u + 1, groups, G, wide_panels, narrow_start, panels, prefetch); \
            while ((u = steal(shares, threads, t)) >= 0) /* the others' last units, from the back */           \
                unit_##F(x, ldx, w, out, ldo, M, K, u, u - 1, groups, G, wide_panels, narrow_start, panels, prefetch); \
        }                                                                                                      \
    }                                                                                                          \
    if (vec_end < N) tail_columns(x, ldx, w + vec_end * K, N - vec_end, out, ldo, M, K, vec_end, N, KIND);     \
    return 0;                                                                                                  \
}
DEFINE_MATMUL(f32, float, H16_NONE)
DEFINE_MATMUL(bf16, uint16_t, H16_BF16)
DEFINE_MATMUL(f16, uint16_t, H16_F16)

int toolkit_matmul_invariant_f32(const float *x, int64_t ldx, const float *w, float *out, int64_t ldo,
                                 int64_t M, int64_t K, int64_t N, int num_threads, int schedule) {
    return matmul_f32(x, ldx, w, out, ldo, M, K, N, num_threads, schedule);
}

/* The same product with 16-bit weights (kind H16_BF16 or H16_F16, packed the same way): every weight is
 * widened exactly to fp32 as it is loaded, so the result is the fp32 product's on the widened weights, bit
 * for bit, while a decode step reads half the bytes. */
int toolkit_matmul_invariant_h16(const float *x, int64_t ldx, const uint16_t *w, float *out, int64_t ldo,
                                 int64_t M, int64_t K, int64_t N, int num_threads, int kind, int schedule) {
    if (kind == H16_BF16) return matmul_bf16(x, ldx, w, out, ldo, M, K, N, num_threads, schedule);
    if (kind == H16_F16) return matmul_f16(x, ldx, w, out, ldo, M, K, N, num_threads, schedule);
    return -1;
}

/* x[0..n) rounded in place to the 16-bit format `kind`'s nearest values (ties to even), in threads */
int toolkit_round_h16(float *x, int64_t n, int kind, int num_threads) {
    if (kind != H16_BF16 && kind != H16_F16) return -1;
    const int64_t chunk = 4096, chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && chunks > 4)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t lo = c * chunk, len = n - lo < chunk ? n - lo : chunk;
        if (kind == H16_BF16) round_h16(x + lo, len, H16_BF16);
        else round_h16(x + lo, len, H16_F16);
    }
    return 0;
}
