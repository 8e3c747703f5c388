/*
 * SHA-256 (FIPS 180-4) of many equal-length rows at once: 16 rows per pass, one per 32-bit
 * lane of a 512-bit vector, every round computed for the 16 messages together.
 *
 * The trace stores the sha256 of every raw logits row (196 KB for a 49,152-word vocabulary).
 * One row at a time that is ~0.5 ms here (no SHA instructions on this CPU), the largest part
 * of what tracing costs; hashing the rows of a step side by side is several times faster. The
 * digests are the standard ones (checked against hashlib in the tests).
 */
#include <stdint.h>
#include <string.h>

typedef uint32_t u16v __attribute__((vector_size(64)));

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

static inline u16v rotr(u16v x, int n) { return (x >> n) | (x << (32 - n)); }
static inline u16v splat(uint32_t x) { return (u16v){0} + x; }

static void compress(u16v st[8], const u16v block[16]) {
    u16v w[64];
    for (int j = 0; j < 16; j++) w[j] = block[j];
    for (int j = 16; j < 64; j++) {
        const u16v s0 = rotr(w[j - 15], 7) ^ rotr(w[j - 15], 18) ^ (w[j - 15] >> 3);
        const u16v s1 = rotr(w[j - 2], 17) ^ rotr(w[j - 2], 19) ^ (w[j - 2] >> 10);
        w[j] = w[j - 16] + s0 + w[j - 7] + s1;
    }
    u16v a = st[0], b = st[1], c = st[2], d = st[3], e = st[4], f = st[5], g = st[6], h = st[7];
    for (int j = 0; j < 64; j++) {
        const u16v t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + splat(K256[j]) + w[j];
        const u16v t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    st[0] += a; st[1] += b; st[2] += c; st[3] += d; st[4] += e; st[5] += f; st[6] += g; st[7] += h;
}

/* the 16 big-endian words of block `b` of every lane's message */
static void load_block(const uint8_t *const ptr[16], int64_t offset, u16v block[16]) {
    uint32_t words[16][16];  /* [word][lane] */
    for (int lane = 0; lane < 16; lane++)
        for (int j = 0; j < 16; j++) {
            uint32_t x;
            memcpy(&x, ptr[lane] + offset + 4 * j, 4);
            words[j][lane] = __builtin_bswap32(x);
        }
    memcpy(block, words, sizeof words);
}

/* out[r * 32 .. r * 32 + 31] = sha256(data + r * row_stride, row_bytes) for r < rows */
int toolkit_sha256_rows(const uint8_t *data, int64_t rows, int64_t row_bytes, int64_t row_stride, uint8_t *out) {
    if (rows < 0 || row_bytes < 0) return -1;
    const int64_t full = row_bytes / 64, rem = row_bytes % 64, tail_blocks = rem + 9 <= 64 ? 1 : 2;
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t n = rows - r0 < 16 ? rows - r0 : 16;
        const uint8_t *ptr[16];
        for (int lane = 0; lane < 16; lane++) ptr[lane] = data + (r0 + (lane < n ? lane : n - 1)) * row_stride;
        u16v st[8], block[16];
        for (int i = 0; i < 8; i++) st[i] = splat(IV[i]);
        for (int64_t b = 0; b < full; b++) {
            load_block(ptr, 64 * b, block);
            compress(st, block);
        }
        /* the last rem bytes, 0x80, zeros and the length in bits (big-endian) in one or two blocks */
        uint8_t tail[16][128];
        const uint8_t *tptr[16];
        const uint64_t bits = (uint64_t)row_bytes * 8;
        for (int lane = 0; lane < 16; lane++) {
            memset(tail[lane], 0, sizeof tail[lane]);
            memcpy(tail[lane], ptr[lane] + 64 * full, (size_t)rem);
            tail[lane][rem] = 0x80;
            for (int i = 0; i < 8; i++) tail[lane][64 * tail_blocks - 1 - i] = (uint8_t)(bits >> (8 * i));
            tptr[lane] = tail[lane];
        }
        for (int64_t b = 0; b < tail_blocks; b++) {
            load_block(tptr, 64 * b, block);
            compress(st, block);
        }
        for (int64_t lane = 0; lane < n; lane++)
            for (int i = 0; i < 8; i++) {
                const uint32_t be = __builtin_bswap32(st[i][lane]);
                memcpy(out + (r0 + lane) * 32 + 4 * i, &be, 4);
            }
    }
    return 0;
}
