/*
 * SHA-256 (FIPS 180-4) of many equal-length rows at once: up to VL rows per pass (the build's lanes,
 * simd.h: 16 on AVX-512, 8 on AVX2, 4 on NEON), one per 32-bit lane, every round computed for the
 * VL messages together.
 *
 * The trace stores the sha256 of every raw logits row (196 KB for a 49,152-word vocabulary).
 * One row at a time that is ~0.6 ms here (no SHA instructions on this CPU), the largest part
 * of what tracing costs; hashing a step's rows side by side is ~8x cheaper per row. The
 * digests are the standard ones (checked against hashlib in the tests).
 *
 * With AVX-512 the rounds use native rotates and three-input logic (vprord, vpternlogd) and a
 * block's 16 rows are loaded whole and transposed in registers; elsewhere the same rounds are
 * written with vector extensions of VL lanes, the portable twin (the digests are the same).
 *
 * An x86 CPU with the SHA extensions (every AMD Zen, Intel since Ice Lake and Goldmont) also gets
 * toolkit_sha256_rows_ni: a row per message, up to 4 rows interleaved per thread so the rounds of
 * one hide the latency of another's. Without AVX-512 it is faster than the lanes (on this Zen 5:
 * 2.7 GB/s a core vs 1.75 for 8 lanes, 5 for 16), and at any width when a step has few rows; the
 * caller (toolkit.native.sha.sha256_rows) picks the faster by a cost it measures once. The build
 * target does not need to include SHA: the function is compiled for it alone and asks the CPU.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h" /* VL */
#include "kernels.h" /* the entry points this file defines, declared once */
#if VL == 16 && defined(__AVX512F__) && defined(__AVX512BW__)
#define SHA_AVX512 1
#include <immintrin.h>
#endif

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
static const uint32_t IV[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                               0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

#ifdef SHA_AVX512
typedef __m512i V;
#define ROR(x, n) _mm512_ror_epi32(x, n)
#define SHR(x, n) _mm512_srli_epi32(x, n)
#define XOR3(a, b, c) _mm512_ternarylogic_epi32(a, b, c, 0x96)
#define CH(e, f, g) _mm512_ternarylogic_epi32(e, f, g, 0xCA)  /* e ? f : g */
#define MAJ(a, b, c) _mm512_ternarylogic_epi32(a, b, c, 0xE8)
#define ADD(a, b) _mm512_add_epi32(a, b)
#define SPLAT(x) _mm512_set1_epi32((int)(x))

/* w[j] = big-endian word j of the 64-byte block at ptr[lane] + off, lane by lane: 16 loads, a
   byte swap, and a 16 x 16 transpose of 32-bit elements in registers */
static inline __attribute__((always_inline)) void load_block(const uint8_t *const ptr[16], int64_t off, V w[16]) {
    const V bswap = _mm512_set4_epi32(0x0c0d0e0f, 0x08090a0b, 0x04050607, 0x00010203);
    V r[16], t[16];
    for (int l = 0; l < 16; l++) r[l] = _mm512_shuffle_epi8(_mm512_loadu_si512(ptr[l] + off), bswap);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        w[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        w[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        w[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        w[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

static inline void store_state(const V st[8], uint32_t words[8][16]) {
    for (int i = 0; i < 8; i++) _mm512_storeu_si512(words[i], st[i]);
}
#else
typedef uint32_t V __attribute__((vector_size(4 * VL)));
#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))
#define SHR(x, n) ((x) >> (n))
#define XOR3(a, b, c) ((a) ^ (b) ^ (c))
#define CH(e, f, g) (((e) & (f)) ^ (~(e) & (g)))
#define MAJ(a, b, c) (((a) & (b)) ^ ((a) & (c)) ^ ((b) & (c)))
#define ADD(a, b) ((a) + (b))
#define SPLAT(x) ((V){0} + (uint32_t)(x))

static inline void load_block(const uint8_t *const ptr[VL], int64_t off, V w[16]) {
    uint32_t words[16][VL];  /* [word][lane] */
    for (int lane = 0; lane < VL; lane++)
        for (int j = 0; j < 16; j++) {
            uint32_t x;
            memcpy(&x, ptr[lane] + off + 4 * j, 4);
            words[j][lane] = __builtin_bswap32(x);
        }
    memcpy(w, words, sizeof words);
}

#define store_state(st, words) memcpy(words, st, 8 * sizeof(V))
#endif

/* one 64-byte block of each lane's message; the schedule is kept in a ring of 16 words */
static inline __attribute__((always_inline)) void compress(V st[8], V w[16]) {
    V a = st[0], b = st[1], c = st[2], d = st[3], e = st[4], f = st[5], g = st[6], h = st[7];
#pragma GCC unroll 64
    for (int j = 0; j < 64; j++) {
        if (j >= 16) {
            const V x15 = w[(j - 15) & 15], x2 = w[(j - 2) & 15];
            const V s0 = XOR3(ROR(x15, 7), ROR(x15, 18), SHR(x15, 3));
            const V s1 = XOR3(ROR(x2, 17), ROR(x2, 19), SHR(x2, 10));
            w[j & 15] = ADD(ADD(w[j & 15], s0), ADD(w[(j - 7) & 15], s1));
        }
        const V t1 = ADD(ADD(h, XOR3(ROR(e, 6), ROR(e, 11), ROR(e, 25))), ADD(CH(e, f, g), ADD(SPLAT(K256[j]), w[j & 15])));
        const V t2 = ADD(XOR3(ROR(a, 2), ROR(a, 13), ROR(a, 22)), MAJ(a, b, c));
        h = g; g = f; f = e; e = ADD(d, t1); d = c; c = b; b = a; a = ADD(t1, t2);
    }
    st[0] = ADD(st[0], a); st[1] = ADD(st[1], b); st[2] = ADD(st[2], c); st[3] = ADD(st[3], d);
    st[4] = ADD(st[4], e); st[5] = ADD(st[5], f); st[6] = ADD(st[6], g); st[7] = ADD(st[7], h);
}

/* the padded end of a message of row_bytes bytes at row: its last row_bytes % 64 bytes, 0x80, zeros and
   the length in bits (big-endian), in tail (room for two blocks); the number of blocks it takes, 1 or 2 */
static int64_t pad_tail(const uint8_t *row, int64_t row_bytes, uint8_t tail[128]) {
    const int64_t full = row_bytes / 64, rem = row_bytes % 64, blocks = rem + 9 <= 64 ? 1 : 2;
    const uint64_t bits = (uint64_t)row_bytes * 8;
    memset(tail, 0, 128);
    memcpy(tail, row + 64 * full, (size_t)rem);
    tail[rem] = 0x80;
    for (int i = 0; i < 8; i++) tail[64 * blocks - 1 - i] = (uint8_t)(bits >> (8 * i));
    return blocks;
}

static inline void lanes_ptrs(const uint8_t *base, const int64_t *offsets, int64_t n, const uint8_t *ptr[VL]) {
    for (int lane = 0; lane < VL; lane++) ptr[lane] = base + offsets[lane < n ? lane : n - 1];
}

static inline void lanes_init(V st[8]) {
    for (int i = 0; i < 8; i++) st[i] = SPLAT(IV[i]);
}

/* whole blocks [from, to) of each lane's message */
static inline void lanes_blocks(V st[8], const uint8_t *const ptr[VL], int64_t from, int64_t to) {
    V w[16];
    for (int64_t b = from; b < to; b++) {
        load_block(ptr, 64 * b, w);
        compress(st, w);
    }
}

/* the padded end of each lane's message, then the digests of its n rows into out[i * 32 ..] */
static void lanes_end(V st[8], const uint8_t *const ptr[VL], int64_t n, int64_t row_bytes, uint8_t *out) {
    V w[16];
    uint8_t tail[VL][128];
    const uint8_t *tptr[VL];
    int64_t tail_blocks = 1;
    for (int lane = 0; lane < VL; lane++) {
        tail_blocks = pad_tail(ptr[lane], row_bytes, tail[lane]);
        tptr[lane] = tail[lane];
    }
    for (int64_t b = 0; b < tail_blocks; b++) {
        load_block(tptr, 64 * b, w);
        compress(st, w);
    }
    uint32_t words[8][VL];
    store_state(st, words);
    for (int64_t lane = 0; lane < n; lane++)
        for (int i = 0; i < 8; i++) {
            const uint32_t be = __builtin_bswap32(words[i][lane]);
            memcpy(out + lane * 32 + 4 * i, &be, 4);
        }
}

/* ---------------------------------------------------------------- the x86 SHA extensions */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define NI_TARGET __attribute__((target("sha,sse4.1,ssse3")))
#define NI_MAX 4 /* rows interleaved per thread */

static int cpu_has_sha(void) { /* asked once (cpuid leaves a virtual machine: microseconds a call) */
    static int has = -1;
    if (has < 0) {
        unsigned a, b, c, d;
        has = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 19)) && (c & (1u << 9)) /* SSE4.1, SSSE3 */
              && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 29)); /* SHA */
    }
    return has;
}

/* the byte order of each 32-bit word swapped (SHA-256 reads big-endian words) */
static inline __attribute__((always_inline)) NI_TARGET __m128i bswap32x4(__m128i x) {
    return _mm_shuffle_epi8(x, _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL));
}

/* n blocks of S messages (message s at d[s] + 64 b) into their states st[s] (kept as ABEF / CDGH) */
static inline __attribute__((always_inline)) NI_TARGET void ni_blocks(const int S, __m128i abef[NI_MAX],
                                                                     __m128i cdgh[NI_MAX], const uint8_t *const *d,
                                                                     int64_t n) {
    for (int64_t b = 0; b < n; b++) {
        __m128i w[NI_MAX][4], save0[NI_MAX], save1[NI_MAX];
        for (int s = 0; s < S; s++) save0[s] = abef[s], save1[s] = cdgh[s];
        for (int i = 0; i < 16; i++) { /* rounds 4i .. 4i + 3, message words 4i .. 4i + 3 */
            const __m128i k = _mm_loadu_si128((const __m128i *)(K256 + 4 * i));
            for (int s = 0; s < S; s++) {
                __m128i x;
                if (i < 4)
                    x = bswap32x4(_mm_loadu_si128((const __m128i *)(d[s] + 64 * b + 16 * i)));
                else
                    x = _mm_sha256msg2_epu32(_mm_add_epi32(_mm_sha256msg1_epu32(w[s][i & 3], w[s][(i + 1) & 3]),
                                                           _mm_alignr_epi8(w[s][(i + 3) & 3], w[s][(i + 2) & 3], 4)),
                                             w[s][(i + 3) & 3]);
                w[s][i & 3] = x;
                const __m128i m = _mm_add_epi32(x, k);
                cdgh[s] = _mm_sha256rnds2_epu32(cdgh[s], abef[s], m);
                abef[s] = _mm_sha256rnds2_epu32(abef[s], cdgh[s], _mm_shuffle_epi32(m, 0x0E));
            }
        }
        for (int s = 0; s < S; s++)
            abef[s] = _mm_add_epi32(abef[s], save0[s]), cdgh[s] = _mm_add_epi32(cdgh[s], save1[s]);
    }
}

/* blocks [from, to) of S rows (row s at base + offsets[s]), from the standard initial state where from is 0, else
   from each row's ABEF and CDGH kept in st (8 words a row); where `to` is the rows' last whole block, their padded
   ends and digests too (into out[s * 32 ..]), else the state back into st */
static inline __attribute__((always_inline)) NI_TARGET void ni_part(const int S, const uint8_t *base,
                                                                   const int64_t *offsets, int64_t row_bytes,
                                                                   uint32_t *st, int64_t from, int64_t to,
                                                                   uint8_t *out) {
    __m128i abef[NI_MAX], cdgh[NI_MAX];
    const uint8_t *ptr[NI_MAX];
    const __m128i dcba = _mm_loadu_si128((const __m128i *)IV), hgfe = _mm_loadu_si128((const __m128i *)(IV + 4));
    for (int s = 0; s < S; s++) {
        if (from == 0) {
            const __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1), efgh = _mm_shuffle_epi32(hgfe, 0x1B);
            abef[s] = _mm_alignr_epi8(cdab, efgh, 8);
            cdgh[s] = _mm_blend_epi16(efgh, cdab, 0xF0);
        } else {
            abef[s] = _mm_loadu_si128((const __m128i *)(st + 8 * s));
            cdgh[s] = _mm_loadu_si128((const __m128i *)(st + 8 * s + 4));
        }
        ptr[s] = base + offsets[s] + 64 * from;
    }
    ni_blocks(S, abef, cdgh, ptr, to - from);
    if (to < row_bytes / 64) {
        for (int s = 0; s < S; s++) {
            _mm_storeu_si128((__m128i *)(st + 8 * s), abef[s]);
            _mm_storeu_si128((__m128i *)(st + 8 * s + 4), cdgh[s]);
        }
        return;
    }
    uint8_t tail[NI_MAX][128];
    int64_t tail_blocks = 1;
    for (int s = 0; s < S; s++) {
        tail_blocks = pad_tail(base + offsets[s], row_bytes, tail[s]);
        ptr[s] = tail[s];
    }
    ni_blocks(S, abef, cdgh, ptr, tail_blocks);
    for (int s = 0; s < S; s++) {
        const __m128i feba = _mm_shuffle_epi32(abef[s], 0x1B), dchg = _mm_shuffle_epi32(cdgh[s], 0xB1);
        const __m128i h[2] = {bswap32x4(_mm_blend_epi16(feba, dchg, 0xF0)), bswap32x4(_mm_alignr_epi8(dchg, feba, 8))};
        memcpy(out + 32 * s, h, 32);
    }
}

static NI_TARGET void ni_group(int S, const uint8_t *base, const int64_t *offsets, int64_t row_bytes, uint32_t *st,
                               int64_t from, int64_t to, uint8_t *out) {
    switch (S) { /* the stream count a constant in each copy, so its loops unroll */
    case 4: ni_part(4, base, offsets, row_bytes, st, from, to, out); break;
    case 3: ni_part(3, base, offsets, row_bytes, st, from, to, out); break;
    case 2: ni_part(2, base, offsets, row_bytes, st, from, to, out); break;
    default: ni_part(1, base, offsets, row_bytes, st, from, to, out); break;
    }
}

int toolkit_sha256_ni_available(void) { return cpu_has_sha(); }

#else
int toolkit_sha256_ni_available(void) { return 0; }

#endif

/* ---------------------------------------------------------------- hashing in parts, beside the caller's work */

/*
 * A hashing job that stops and goes on: the rows in groups (up to a build's lanes, or up to 4 rows with the SHA
 * extensions), each group's state kept between calls in a record the caller allocates (zeroed) and keeps.
 * toolkit_sha256_job with fn runs fn() on the calling thread (e.g. a callback into Python: the interpreter's
 * own work, which leaves the other cores idle) while the team's other threads hash slices of the groups, the
 * group least far along first, until fn returns; without fn, every thread hashes what is left, and the digests
 * are all in `out`. So the hashing runs beside several stretches of the caller's work and the rest, if any,
 * on every thread at the end. Without OpenMP (the pragmas ignored) fn hashes nothing; the last call does all.
 */
typedef struct {
    uint32_t st[8 * 16]; /* the lanes' state (8 vectors of VL words), or each SHA row's ABEF and CDGH (8 words) */
    int64_t done;        /* whole blocks hashed */
    int32_t busy;        /* a thread is hashing this group */
    int32_t complete;    /* its digests are in out */
} sha_group;

#define SLICE_BLOCKS 128 /* 8 KiB of each row between looks at whether fn has returned */

int toolkit_sha256_job_group_bytes(void) { return (int)sizeof(sha_group); }

/* the incomplete group nobody is hashing that is least far along, now claimed; -1 if none */
static int64_t claim_group(sha_group *gs, int64_t groups) {
    for (;;) {
        int64_t best = -1, best_done = INT64_MAX;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t done = __atomic_load_n(&gs[g].done, __ATOMIC_RELAXED);
            if (!__atomic_load_n(&gs[g].complete, __ATOMIC_ACQUIRE) && !__atomic_load_n(&gs[g].busy, __ATOMIC_RELAXED)
                && done < best_done)
                best = g, best_done = done;
        }
        if (best < 0) return -1;
        int32_t idle = 0;
        if (__atomic_compare_exchange_n(&gs[best].busy, &idle, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
            if (!__atomic_load_n(&gs[best].complete, __ATOMIC_ACQUIRE)) return best;
            __atomic_store_n(&gs[best].busy, 0, __ATOMIC_RELEASE); /* finished by another thread since the scan */
        }
    }
}

/* up to `blocks` more whole blocks of group g's rows (all that are left where blocks < 0), and its digests
   when it gets to the end of them */
static void hash_slice(int method, const uint8_t *base, const int64_t *offsets, int64_t rows, int64_t per,
                       int64_t row_bytes, uint8_t *out, sha_group *grp, int64_t g, int64_t blocks) {
    const int64_t lo = g * per, n = rows - lo < per ? rows - lo : per, full = row_bytes / 64, from = grp->done;
    const int64_t to = blocks < 0 || full - from < blocks ? full : from + blocks;
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    if (method == 1) {
        ni_group((int)n, base, offsets + lo, row_bytes, grp->st, from, to, out + lo * 32);
    } else
#endif
    {
        const uint8_t *ptr[VL];
        V st[8];
        lanes_ptrs(base, offsets + lo, n, ptr);
        if (from == 0)
            lanes_init(st);
        else
            memcpy(st, grp->st, sizeof st);
        lanes_blocks(st, ptr, from, to);
        if (to == full)
            lanes_end(st, ptr, n, row_bytes, out + lo * 32);
        else
            memcpy(grp->st, st, sizeof st);
    }
    __atomic_store_n(&grp->done, to, __ATOMIC_RELAXED);
    if (to == full) __atomic_store_n(&grp->complete, 1, __ATOMIC_RELEASE);
}

/*
 * The job over `rows` rows (row i at base + offsets[i], row_bytes each; digest i into out[i * 32 ..]) in groups
 * of group_rows (at most the build's lanes, or 4 with method 1, the SHA extensions), whose records are `state`
 * (ceil(rows / group_rows) of toolkit_sha256_job_group_bytes(), zeroed before the first call; the same rows,
 * group_rows and method at every call). With fn: fn's value; without: 0. -1 for bad arguments (fn not called).
 */
int toolkit_sha256_job(const uint8_t *base, const int64_t *offsets, int64_t rows, int64_t row_bytes, uint8_t *out,
                       int threads, int method, int64_t group_rows, void *state, int (*fn)(void)) {
    if (rows < 0 || row_bytes < 0 || threads < 1 || method < 0 || method > 1 || !state || group_rows < 1
        || group_rows > (method == 1 ? 4 : VL))
        return -1;
    if (method == 1 && !toolkit_sha256_ni_available()) return -1;
    sha_group *gs = state;
    const int64_t groups = (rows + group_rows - 1) / group_rows;
    int stop = 0, rc = 0;
    if (!fn) {
        if (threads > groups) threads = groups > 0 ? (int)groups : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
        for (int64_t g; (g = claim_group(gs, groups)) >= 0;) {
            hash_slice(method, base, offsets, rows, group_rows, row_bytes, out, &gs[g], g, -1);
            __atomic_store_n(&gs[g].busy, 0, __ATOMIC_RELEASE);
        }
        return 0;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp master
        { /* the calling thread; the others start on the rows (master has no barrier) */
            rc = fn();
            __atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
        }
        for (int64_t g; !__atomic_load_n(&stop, __ATOMIC_ACQUIRE) && (g = claim_group(gs, groups)) >= 0;) {
            hash_slice(method, base, offsets, rows, group_rows, row_bytes, out, &gs[g], g, SLICE_BLOCKS);
            __atomic_store_n(&gs[g].busy, 0, __ATOMIC_RELEASE);
        }
    }
    return rc;
}

/* every row's digest in one call: a job from its first block to its last, on up to `threads` threads */
static int whole_job(int method, int64_t group_rows, const uint8_t *base, const int64_t *offsets, int64_t rows,
                     int64_t row_bytes, uint8_t *out, int threads) {
    if (rows < 0 || threads < 1) return -1;
    if (rows == 0) return method == 1 && !toolkit_sha256_ni_available() ? -1 : 0;
    sha_group *state = calloc((size_t)((rows + group_rows - 1) / group_rows), sizeof *state);
    if (!state) return -1;
    const int rc = toolkit_sha256_job(base, offsets, rows, row_bytes, out, threads, method, group_rows, state, 0);
    free(state);
    return rc;
}

/* out[i * 32 .. i * 32 + 31] = sha256(base + offsets[i], row_bytes) for i < rows, in groups of the build's lanes
   (splitting VL rows or fewer over the threads gained nothing on AVX-512: a pass costs the same with 8 or 16 lanes
   busy) */
int toolkit_sha256_rows(const uint8_t *base, const int64_t *offsets, int64_t rows, int64_t row_bytes, uint8_t *out,
                        int threads) {
    return whole_job(0, VL, base, offsets, rows, row_bytes, out, threads);
}

/* as toolkit_sha256_rows, with the SHA extensions: groups of up to 4 rows (fewer when that keeps every thread
   busy); -1 where the CPU lacks them */
int toolkit_sha256_rows_ni(const uint8_t *base, const int64_t *offsets, int64_t rows, int64_t row_bytes,
                           uint8_t *out, int threads) {
    const int64_t per = threads < 1 ? 1 : (rows + threads - 1) / threads;
    return whole_job(1, per < 1 ? 1 : per > 4 ? 4 : per, base, offsets, rows, row_bytes, out, threads);
}
