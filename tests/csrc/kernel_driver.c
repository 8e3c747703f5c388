/*
 * A test driver for the kernels, built with them into one program for any target (the suite runs it
 * natively and, cross-compiled for aarch64, under qemu-aarch64-static).
 *
 * It makes its inputs with a fixed xorshift generator (the same numbers on every machine), runs each
 * kernel, writes every output as raw little-endian bytes to <outdir>/<name>.bin, and checks the
 * properties that hold in any build: a row's (query's) bits do not depend on the other rows of the
 * call or on the number of threads. It prints one line per failed check and exits 1 if any failed,
 * else prints "ok <lanes> <fma>".
 *
 *   kernel_driver <outdir>
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h" /* the entry points checked here */

static uint64_t state = 0x9e3779b97f4a7c15ull;
static uint32_t next_u32(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)(state >> 32);
}
/* uniform in [-scale, scale), exactly representable: 24 random bits */
static float next_f32(float scale) { return ((float)(next_u32() >> 8) * (1.0f / 8388608.0f) - 1.0f) * scale; }
static float *uniform(int64_t n, float scale) {
    float *p = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) p[i] = next_f32(scale);
    return p;
}

static const char *outdir;
static int failures = 0;

static void save(const char *name, const void *data, size_t bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.bin", outdir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, bytes, f) != bytes) { fprintf(stderr, "cannot write %s\n", path); exit(2); }
    fclose(f);
}
static void expect_same(const char *what, const void *a, const void *b, size_t bytes) {
    if (memcmp(a, b, bytes) != 0) { printf("FAIL %s\n", what); failures++; }
}

/* pack (K, N) row-major w as toolkit.native.ops.pack_weight does for this build */
static float *pack(const float *w, int64_t K, int64_t N) {
    int64_t layout[2];
    toolkit_matmul_layout(layout);
    const int64_t nr = layout[0], vl = layout[1], wide = N / nr, narrow = (N % nr) / vl, vec_end = wide * nr + narrow * vl;
    float *out = malloc(sizeof(float) * (size_t)(K * N)), *o = out;
    for (int64_t p = 0; p < wide; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < nr; j++) *o++ = w[k * N + p * nr + j];
    for (int64_t p = 0; p < narrow; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < vl; j++) *o++ = w[k * N + wide * nr + p * vl + j];
    for (int64_t k = 0; k < K; k++)
        for (int64_t j = vec_end; j < N; j++) *o++ = w[k * N + j];
    return out;
}

static void check_matmul(void) {
    const int64_t M = 13, K = 67, N = 181;
    float *x = uniform(M * K, 1.0f), *w = uniform(K * N, 1.0f), *pw = pack(w, K, N);
    float *out = malloc(sizeof(float) * M * N), *one = malloc(sizeof(float) * N), *serial = malloc(sizeof(float) * M * N);
    toolkit_matmul_invariant_f32(x, K, pw, out, N, M, K, N, 2, 0);
    toolkit_matmul_invariant_f32(x, K, pw, serial, N, M, K, N, 1, 0);
    expect_same("matmul: 1 vs 2 threads", out, serial, sizeof(float) * M * N);
    for (int v = 0; v < toolkit_matmul_schedules(); v++) { /* every schedule: the same bits */
        toolkit_matmul_invariant_f32(x, K, pw, serial, N, M, K, N, 2, v);
        expect_same("matmul: a schedule vs the tiles", serial, out, sizeof(float) * M * N);
        for (int64_t m = 0; m < M; m++) {
            toolkit_matmul_invariant_f32(x + m * K, K, pw, one, N, 1, K, N, 2, v);
            expect_same("matmul: a row alone vs in the batch", one, out + m * N, sizeof(float) * N);
        }
    }
    save("matmul", out, sizeof(float) * M * N);
    free(x); free(w); free(pw); free(out); free(one); free(serial);
}

/* sequences of contexts ctx[s], a few queries at the end of each; blocks of bs positions, shuffled */
static void check_attention(int64_t H, int64_t KH, int64_t D, int64_t BS, int q8, const char *name) {
    const int64_t S = 4, ctx[4] = {1, 17, 40, 75}, per_seq = 3, width = (75 + BS - 1) / BS;
    int64_t blocks = 0;
    for (int s = 0; s < S; s++) blocks += (ctx[s] + BS - 1) / BS;
    blocks += 2;
    const int64_t slots = blocks * BS * KH * D;
    float *kf = uniform(slots, 1.0f), *vf = uniform(slots, 1.0f);
    uint8_t *k8 = malloc((size_t)slots), *v8 = malloc((size_t)slots);
    for (int64_t i = 0; i < slots; i++) { k8[i] = (uint8_t)(int8_t)(next_u32() % 255 - 127); v8[i] = (uint8_t)(int8_t)(next_u32() % 255 - 127); }
    float *ks = uniform(blocks * KH, 0.02f), *vs = uniform(blocks * KH, 0.02f);
    int64_t *tables = calloc((size_t)(S * width), sizeof(int64_t)), next = blocks - 1;
    for (int s = 0; s < S; s++) /* blocks taken from the end: not in position order */
        for (int64_t b = 0; b < (ctx[s] + BS - 1) / BS; b++) tables[s * width + b] = next--;
    int64_t N = 0, qt[16], qc[16];
    for (int s = 0; s < S; s++)
        for (int64_t p = ctx[s] - per_seq; p < ctx[s]; p++)
            if (p >= 0) { qt[N] = s; qc[N] = p + 1; N++; }
    float *q = uniform(N * H * D, 1.0f), *out = malloc(sizeof(float) * N * H * D);
    float *serial = malloc(sizeof(float) * N * H * D), *one = malloc(sizeof(float) * H * D);
    const float scale = 0.125f;
#define ATTEND(QP, NN, QT, QC, OUT, T)                                                                              \
    (q8 ? toolkit_paged_attention_q8(QP, H * D, k8, v8, tables, width, QT, QC, OUT, NN, H, KH, D, BS, scale, T, ks, \
                                     vs, KH, 0)                                                                  \
        : toolkit_paged_attention_f32(QP, H * D, kf, vf, tables, width, QT, QC, OUT, NN, H, KH, D, BS, scale, T))
    if (ATTEND(q, N, qt, qc, out, 2) != 0) { printf("FAIL %s: the kernel refused its shapes\n", name); failures++; }
    ATTEND(q, N, qt, qc, serial, 1);
    char what[128];
    snprintf(what, sizeof what, "%s: 1 vs 2 threads", name);
    expect_same(what, out, serial, sizeof(float) * N * H * D);
    snprintf(what, sizeof what, "%s: a query alone vs in the batch", name);
    for (int64_t n = 0; n < N; n++) {
        ATTEND(q + n * H * D, 1, qt + n, qc + n, one, 2);
        expect_same(what, one, out + n * H * D, sizeof(float) * H * D);
    }
#undef ATTEND
    save(name, out, sizeof(float) * N * H * D);
    free(kf); free(vf); free(k8); free(v8); free(ks); free(vs); free(tables); free(q); free(out); free(serial); free(one);
}

static void check_rowwise(void) {
    const int64_t N = 9, D = 581, F = 203, V = 1003;
    float *x = uniform(N * D, 3.0f), *r = uniform(N * D, 3.0f), *w = uniform(D, 1.0f), *h = malloc(sizeof(float) * N * D);
    float *one = malloc(sizeof(float) * D), *x1 = malloc(sizeof(float) * D);
    memcpy(x1, x + 4 * D, sizeof(float) * D);
    toolkit_add_rms_norm_f32(x, D, r, D, w, 1e-5f, h, D, N, D, 2);
    toolkit_add_rms_norm_f32(x1, D, r + 4 * D, D, w, 1e-5f, one, D, 1, D, 1);
    expect_same("add_rms_norm: a row alone vs in the batch", one, h + 4 * D, sizeof(float) * D);
    save("rms_norm_x", x, sizeof(float) * N * D);
    save("rms_norm", h, sizeof(float) * N * D);
    float *gu = uniform(N * 2 * F, 8.0f), *act = malloc(sizeof(float) * N * F);
    toolkit_silu_mul_f32(gu, 2 * F, act, F, N, F, 2);
    save("silu_mul", act, sizeof(float) * N * F);
    float *logits = uniform(N * V, 20.0f), *lse = malloc(sizeof(float) * N);
    int64_t *best = malloc(sizeof(int64_t) * N);
    logits[2 * V + 17] = logits[2 * V + 900] = 40.0f; /* a tie: the first index wins */
    toolkit_logsumexp_f32(logits, V, N, V, lse, 2);
    toolkit_argmax_f32(logits, V, N, V, best, 2);
    save("logsumexp", lse, sizeof(float) * N);
    save("argmax", best, sizeof(int64_t) * N);
    const int64_t R = 7, heads = 5, HD = 64, P = 50;
    float *xr = uniform(R * heads * HD, 2.0f), *cs = uniform(P * HD, 1.0f), *sn = uniform(P * HD, 1.0f);
    float *ro = malloc(sizeof(float) * R * heads * HD);
    int64_t pos[7] = {0, 3, 49, 12, 12, 7, 30};
    toolkit_rope_f32(xr, heads * HD, ro, cs, sn, P, pos, R, heads, HD, 2);
    save("rope", ro, sizeof(float) * R * heads * HD);
    const int64_t rows = 21, bytes = 1000;
    uint8_t *data = malloc((size_t)(rows * bytes)), digests[21 * 32];
    int64_t offsets[21];
    for (int64_t i = 0; i < rows * bytes; i++) data[i] = (uint8_t)next_u32();
    for (int64_t i = 0; i < rows; i++) offsets[i] = ((i * 5) % rows) * bytes;
    toolkit_sha256_rows(data, offsets, rows, bytes, digests, 2);
    save("sha256_data", data, (size_t)(rows * bytes));
    save("sha256", digests, sizeof digests);
    free(x); free(r); free(w); free(h); free(one); free(x1); free(gu); free(act); free(logits); free(lse); free(best);
    free(xr); free(cs); free(sn); free(ro); free(data);
}

/* Gumbel noise (exact in every build) and a step of sampled rows, one truncated to a few ids */
static void check_gumbel(void) {
    enum { G = 1003, S = 5, SV = 5000 };
    int32_t ids[G];
    double noise[G];
    for (int i = 0; i < G; i++) ids[i] = (int32_t)(next_u32() % 49152);
    toolkit_gumbel_noise(ids, G, 0x9E3779B9u, 0x7F4A7C15u, noise);
    save("gumbel_noise", noise, sizeof noise);
    float *logits = uniform(S * SV, 6.0f);
    for (int v = 0; v < SV; v++)
        if (v % 97) logits[3 * SV + v] = -INFINITY; /* row 3: a truncated support */
    /* a row not sampled (3) keeps its token and noise as they were: zeros, not the stack's last contents */
    int64_t tokens[S] = {0}, support[S] = {0};
    uint32_t keys[2 * S];
    int8_t sampled[S] = {1, 1, 1, 0, 1};
    double chosen_noise[S] = {0};
    for (int i = 0; i < 2 * S; i++) keys[i] = next_u32();
    toolkit_gumbel_sample_rows(logits, SV, SV, S, keys, sampled, tokens, chosen_noise, support, 2);
    save("gumbel_tokens", tokens, sizeof tokens);
    save("gumbel_chosen_noise", chosen_noise, sizeof chosen_noise);
    save("gumbel_support", support, sizeof support);
    free(logits);
}

/* the fused pipeline tail (temperature, top-p, top-k, then support, logsumexp, token, noise) against the
 * same stages called one after another, with the processed rows written out and kept in cache: equal
 * bits in any build */
static void check_tail(void) {
    enum { S = 6, SV = 5003, W = 3 };
    const int32_t ops[S * W] = {2, 0, -1, 2, 1, -1, -1, -1, -1, 1, -1, -1, 2, -1, -1, 0, 2, 1};
    const float params[S * W] = {0.8f, 0.9f, 0, 0.7f, 40.0f, 0, 0, 0, 0, 7.0f, 0, 0, 1.3f, 0, 0, 0.5f, 0.6f, 100.0f};
    float *logits = uniform(S * SV, 9.0f);
    for (int v = 0; v < SV; v++)
        if (v % 13) logits[2 * SV + v] = -INFINITY; /* row 2: a sparse support, no ops */
    logits[3 * SV + 17] = 3.0f, logits[3 * SV + 4001] = -1.0f; /* row 3's penalised entries (below) */
    uint32_t keys[2 * S];
    int8_t sampled[S] = {1, 1, 1, 1, 0, 1};
    float lse[2][S], lse_want[S], picked[2][S], threshold;
    int64_t tokens[2][S], support[2][S], tokens_want[S], support_want[S], argmax[S];
    double noise[2][S], noise_want[S];
    for (int i = 0; i < 2 * S; i++) keys[i] = next_u32();
    for (int r = 0; r < S; r++) tokens_want[r] = -1;
    float *out = malloc(sizeof(float) * S * SV), *step = malloc(sizeof(float) * S * SV);
    const int64_t LDK = (SV + 7) / 8;
    uint8_t *kept = malloc((size_t)(S * LDK));
    memset(kept, 0xAB, (size_t)(S * LDK)); /* full rows are left alone */
    toolkit_sample_tail_rows(logits, SV, S, SV, ops, params, 0, 0, 0, keys, sampled, out, SV, 0, lse[0], tokens[0], noise[0],
                             support[0], picked[0], 0, 0, 2);
    /* the second call also reads the raw rows' logsumexp, and penalises row 3 first (two entries: 3 / 0.1
     * becomes the row's largest, -1 * inf leaves the support) */
    const int64_t patch_off[S + 1] = {0, 0, 0, 0, 2, 2, 2};
    const int32_t patch_col[2] = {17, 4001};
    const float patch_factor[2] = {0.1f, INFINITY};
    float raw_lse[S], raw_want[S];
    toolkit_logsumexp_f32(logits, SV, S, SV, raw_want, 2);
    toolkit_sample_tail_rows(logits, SV, S, SV, ops, params, patch_off, patch_col, patch_factor, keys, sampled, 0, 0,
                             raw_lse, lse[1], tokens[1], noise[1], support[1], picked[1], kept, LDK, 2);
    if (memcmp(raw_lse, raw_want, sizeof raw_lse)) {
        printf("tail: the raw rows' logsumexp differs from toolkit_logsumexp_f32's\n");
        failures++;
    }
    const float patched_token = 3.0f / patch_factor[0]; /* row 3 (top-k 7 after it): token 17 is the argmax */
    if (support[1][3] != 7 || tokens[1][3] != 17 || picked[1][3] != patched_token) {
        printf("tail: the patched row 3 (support %lld, token %lld) is not what its patches make it\n",
               (long long)support[1][3], (long long)tokens[1][3]);
        failures++;
    }
    /* the rest of the comparison is with the unpatched stages: give row 3 the first call's results */
    support[1][3] = support[0][3], tokens[1][3] = tokens[0][3], noise[1][3] = noise[0][3];
    lse[1][3] = lse[0][3], picked[1][3] = picked[0][3];
    for (int r = 0; r < S; r++) /* the kept bitmask: bit v & 7 of byte v >> 3 is whether token v is finite */
        for (int v = 0; v < SV && r != 3; v++) { /* (row 3 was patched: checked above) */
            const int bit = support[1][r] < SV ? (kept[r * LDK + (v >> 3)] >> (v & 7)) & 1 : -1;
            const int finite = out[r * SV + v] > -INFINITY && out[r * SV + v] < INFINITY;
            if (bit >= 0 && bit != finite) {
                printf("tail: row %d kept bit of token %d is %d, its processed logit finite %d\n", r, v, bit, finite);
                failures++;
                break;
            }
        }
    free(kept);
    memcpy(step, logits, sizeof(float) * S * SV);
    for (int r = 0; r < S; r++)
        for (int j = 0; j < W; j++) {
            float *row = step + r * SV;
            const int op = ops[r * W + j];
            if (op == 2)
                for (int v = 0; v < SV; v++) row[v] = row[v] / params[r * W + j];
            else if (op >= 0)
                toolkit_truncate_f32(row, SV, 1, SV, op, &params[r * W + j], row, SV, &threshold, 1);
        }
    toolkit_logsumexp_f32(step, SV, S, SV, lse_want, 2);
    toolkit_gumbel_sample_rows(step, SV, SV, S, keys, sampled, tokens_want, noise_want, support_want, 2);
    toolkit_argmax_f32(step, SV, S, SV, argmax, 2);
    if (memcmp(out, step, sizeof(float) * S * SV)) {
        printf("tail: processed rows differ from the stages\n");
        failures++;
    }
    for (int k = 0; k < 2; k++)
        for (int r = 0; r < S; r++) {
            const int64_t want = tokens_want[r] >= 0 ? tokens_want[r] : argmax[r];
            const int same_noise = sampled[r] ? !memcmp(&noise[k][r], &noise_want[r], sizeof(double))
                                              : noise[k][r] != noise[k][r];
            if (tokens[k][r] != want || !same_noise || support[k][r] != support_want[r] ||
                memcmp(&lse[k][r], &lse_want[r], sizeof(float)) ||
                memcmp(&picked[k][r], &step[r * SV + want], sizeof(float))) {
                printf("tail (rows %s): row %d differs from the stages\n", k ? "in cache" : "written", r);
                failures++;
            }
        }
    save("tail_rows", out, sizeof(float) * S * SV);
    save("tail_support", support[0], sizeof support[0]);
    save("tail_tokens", tokens[0], sizeof tokens[0]);
    free(logits); free(out); free(step);
}

/* 16-bit formats (2 bf16, 3 fp16): round_h16 gives values the format holds exactly (re-rounding changes
 * nothing); the matmul on 16-bit weights and the attention over a 16-bit cache are the fp32 kernels' on the
 * widened values, bit for bit. The rounded values are saved: exact in every build. */
static uint16_t bits16(float f, int kind) { /* f is representable: its 16-bit pattern */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (kind == 2) return (uint16_t)(u >> 16);
    const uint32_t sign = (u >> 16) & 0x8000u, e = (u >> 23) & 0xffu, man = u & 0x7fffffu;
    if (e == 0xff) return (uint16_t)(sign | 0x7c00u | (man >> 13));
    if (e == 0) return (uint16_t)sign;
    if (e < 113) return (uint16_t)(sign | ((man | 0x800000u) >> (126 - e))); /* fp16 subnormal */
    return (uint16_t)(sign | ((e - 112) << 10) | (man >> 13));
}

static void check_h16(int kind, const char *name) {
    const int64_t n = 4096, M = 5, K = 67, N = 181;
    float *v = uniform(n, 70000.0f), *again = malloc(sizeof(float) * n);
    for (int64_t i = 0; i < n; i += 4) v[i] *= 1e-9f; /* fp16 subnormals and underflow */
    toolkit_round_h16(v, n, kind, 2);
    memcpy(again, v, sizeof(float) * n);
    toolkit_round_h16(again, n, kind, 1);
    char what[128];
    snprintf(what, sizeof what, "%s: rounding a rounded value changes it", name);
    expect_same(what, v, again, sizeof(float) * n);
    char saved[64];
    snprintf(saved, sizeof saved, "round_%s", name);
    save(saved, v, sizeof(float) * n);
    /* the matmul: fp32 on the widened weights vs 16-bit */
    float *x = uniform(M * K, 1.0f), *w = uniform(K * N, 1.0f);
    toolkit_round_h16(w, K * N, kind, 1);
    float *pw = pack(w, K, N), *want = malloc(sizeof(float) * M * N), *got = malloc(sizeof(float) * M * N);
    uint16_t *ph = malloc(sizeof(uint16_t) * K * N);
    for (int64_t i = 0; i < K * N; i++) ph[i] = bits16(pw[i], kind);
    if (kind == 2) { /* bf16 wide panels: each k's blocks of VL columns interleaved in pairs (pack_weight) */
        int64_t layout[2];
        toolkit_matmul_layout(layout);
        const int64_t nr = layout[0], vl = layout[1];
        for (int64_t i = 0; i < (N / nr) * K; i++) /* every k row of every wide panel */
            for (int64_t b = 0; b < nr; b += 2 * vl)
                for (int64_t j = 0; j < vl; j++) {
                    ph[i * nr + b + 2 * j] = bits16(pw[i * nr + b + j], kind);
                    ph[i * nr + b + 2 * j + 1] = bits16(pw[i * nr + b + vl + j], kind);
                }
    }
    toolkit_matmul_invariant_f32(x, K, pw, want, N, M, K, N, 2, 0);
    toolkit_matmul_invariant_h16(x, K, ph, got, N, M, K, N, 2, kind, 0);
    snprintf(what, sizeof what, "%s: the 16-bit matmul differs from fp32 on the widened weights", name);
    expect_same(what, want, got, sizeof(float) * M * N);
    /* the attention: one sequence of 40 positions in blocks of 16, three queries */
    const int64_t H = 8, KH = 2, D = 64, BS = 16, blocks = 3, slots = blocks * BS * KH * D;
    float *kf = uniform(slots, 1.0f), *vf = uniform(slots, 1.0f), *q = uniform(3 * H * D, 1.0f);
    toolkit_round_h16(kf, slots, kind, 1);
    toolkit_round_h16(vf, slots, kind, 1);
    uint16_t *kh = malloc(sizeof(uint16_t) * slots), *vh = malloc(sizeof(uint16_t) * slots);
    for (int64_t i = 0; i < slots; i++) { kh[i] = bits16(kf[i], kind); vh[i] = bits16(vf[i], kind); }
    int64_t table[3] = {2, 0, 1}, qt[3] = {0, 0, 0}, qc[3] = {1, 23, 40};
    float *a32 = malloc(sizeof(float) * 3 * H * D), *a16 = malloc(sizeof(float) * 3 * H * D);
    toolkit_paged_attention_f32(q, H * D, kf, vf, table, 3, qt, qc, a32, 3, H, KH, D, BS, 0.125f, 2);
    if (toolkit_paged_attention_h16(q, H * D, kh, vh, table, 3, qt, qc, a16, 3, H, KH, D, BS, 0.125f, 2, kind) != 0) {
        printf("FAIL %s: the 16-bit attention refused its shapes\n", name);
        failures++;
    }
    snprintf(what, sizeof what, "%s: the attention over a 16-bit cache differs from fp32 on the widened cache", name);
    expect_same(what, a32, a16, sizeof(float) * 3 * H * D);
    free(v); free(again); free(x); free(w); free(pw); free(want); free(got); free(ph);
    free(kf); free(vf); free(q); free(kh); free(vh); free(a32); free(a16);
}

int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: kernel_driver <outdir>\n"); return 2; }
    outdir = argv[1];
    check_matmul();
    check_attention(9, 3, 64, 16, 0, "attention_h9_d64");
    check_attention(8, 2, 128, 4, 0, "attention_h8_d128");
    check_attention(4, 2, 16, 16, 0, "attention_h4_d16"); /* the scalar path */
    check_attention(6, 3, 64, 16, 1, "attention_q8_h6_d64");
    check_rowwise();
    check_gumbel();
    check_tail();
    check_h16(2, "bf16");
    check_h16(3, "f16");
    int64_t profile[4];
    toolkit_kernel_profile(profile);
    if (failures) return 1;
    printf("ok %lld %lld\n", (long long)profile[0], (long long)profile[1]);
    return 0;
}
