/*
 * A Llama-style decoder's layers for one engine step, in one call from Python.
 *
 * Every operation is one of the kernels the layer-by-layer forward calls from Python (the packed
 * matmul, residual add + RMSNorm, RoPE, paged attention, SiLU * up), linked into the same library,
 * so the same kernels on the same inputs in the same order give the same bits. What the call saves
 * is the Python between them: per layer ~10 calls into C, a dozen tensor views and allocations and
 * two index_copy_ for the KV write (about 10-20 ms of a 30-layer decode step).
 *
 * Layer l, with m the previous layer's MLP output (none before layer 0):
 *   x += m; h = rmsnorm(x) * ln_attn;  qkv = h @ w_qkv;  q|k = rope(qkv's q|k heads)
 *   cache[slot] = k, v;  a = attention(q);  x += a @ w_o;  h = rmsnorm(x) * ln_mlp
 *   m = silu(gate) * up of (h @ w_gate_up) @ w_down
 * and after the last layer x += m (the caller applies the final norm to the rows it samples).
 *
 * A bf16 / fp16 model (kind H16_BF16 / H16_F16) runs the same kernels on 16-bit projections and a 16-bit
 * cache (each widened exactly as it is read: fp32 multiplies and sums), and every operation's outputs are
 * rounded to the model's format (nearest, ties to even) before the next one reads them: x and h after each
 * add + norm, qkv, q|k after RoPE (so the cache holds them exactly), the attention output, o, gate_up, the
 * SiLU product, m, and x after the last add. The layer-by-layer forward rounds at the same places, so the
 * two give the same bits in every format. Norm weights are fp32 (a 16-bit model's, widened).
 *
 * `schedule` is the matmul's schedule for this step's N rows (matmul_invariant.c's MM_*): it changes how the weights
 * stream, never a bit. `mm_f32` / `mm_h16`, where not NULL, are another build's matmul entry points (the projections
 * packed for that build's panels): every FMA build's matmul is one FMA chain per output in k's order, so it too
 * changes how the weights stream and never a bit (toolkit/native/schedules.py chooses it per number of rows, e.g.
 * the AVX2 build's at one row on a CPU whose AVX-512 loads stream slower).
 */
#include <stdint.h>
#include <string.h>

#include "simd.h" /* H16_*, narrow_h16 */

#include "kernels.h" /* the kernels this calls */
#define matmul toolkit_matmul_invariant_f32
#define norm toolkit_add_rms_norm_f32
#define silu toolkit_silu_mul_f32
#define rope toolkit_rope_f32
#define attention toolkit_paged_attention_f32

typedef int (*matmul_f32_fn)(const float *, int64_t, const float *, float *, int64_t, int64_t, int64_t, int64_t, int,
                             int);
typedef int (*matmul_h16_fn)(const float *, int64_t, const uint16_t *, float *, int64_t, int64_t, int64_t, int64_t,
                             int, int, int);

/* per layer, addresses of: the two norm weights, the four packed projections, the K and V caches */
enum { L_LN_ATTN, L_LN_MLP, L_QKV, L_O, L_GATE_UP, L_DOWN, L_K_CACHE, L_V_CACHE, L_FIELDS };
/* dims[]: N (tokens), hidden, H, K, D (head dim), F (MLP width), block size, rotary table rows, block-table
 * stride, cache slots (blocks x block size) */
enum { D_N, D_HIDDEN, D_H, D_K, D_HD, D_F, D_BS, D_MAX_POS, D_BT_STRIDE, D_SLOTS, NUM_DIMS };
/* work[]: the step's buffers, each N rows: h [hidden], qkv [(H+2K)D], qk [(H+K)D], attn [HD], o [hidden],
 * gate_up [2F], act [F], m [hidden] */
enum { W_H, W_QKV, W_QK, W_ATTN, W_O, W_GATE_UP, W_ACT, W_M, NUM_WORK };

/* 0, or: -3 a KV slot outside the cache (checked before anything is written), -2 a position outside the
 * rotary table, -1 shapes a kernel refused */
int toolkit_decoder_layers(const int64_t *layers, int64_t num_layers, const int64_t *dims,
                           float *x, const int64_t *work, const int64_t *positions, const int64_t *slots,
                           const float *cos_table, const float *sin_table, const int64_t *block_tables,
                           const int64_t *query_table, const int64_t *query_ctx, float eps, float scale,
                           int threads, int kind, int schedule, const void *mm_f32, const void *mm_h16)
{
    const matmul_f32_fn mm32 = mm_f32 ? (matmul_f32_fn)(intptr_t)mm_f32 : matmul;
    const matmul_h16_fn mm16 = mm_h16 ? (matmul_h16_fn)(intptr_t)mm_h16 : toolkit_matmul_invariant_h16;
    const int64_t N = dims[D_N], E = dims[D_HIDDEN], H = dims[D_H], K = dims[D_K], D = dims[D_HD], F = dims[D_F];
    const int64_t qw = H * D, kvw = K * D, qkvw = qw + 2 * kvw, qkw = qw + kvw;
    float *h = (float *)(intptr_t)work[W_H], *qkv = (float *)(intptr_t)work[W_QKV];
    float *qk = (float *)(intptr_t)work[W_QK], *att = (float *)(intptr_t)work[W_ATTN];
    float *o = (float *)(intptr_t)work[W_O], *gu = (float *)(intptr_t)work[W_GATE_UP];
    float *act = (float *)(intptr_t)work[W_ACT], *m = (float *)(intptr_t)work[W_M];
    int rc;
    if (kind != H16_NONE && kind != H16_BF16 && kind != H16_F16) return -1;
    for (int64_t n = 0; n < N; n++)
        if (slots[n] < 0 || slots[n] >= dims[D_SLOTS]) return -3;
#define TRY(call) do { if ((rc = (call)) != 0) return rc; } while (0)
#define PTR(l, f) ((const void *)(intptr_t)layers[(l) * L_FIELDS + (f)])
#define ROUND(p, len) do { if (kind != H16_NONE) toolkit_round_h16(p, len, kind, threads); } while (0)
#define MATMUL(in, ldi, f, out, M, Kd, Nd)                                                                     \
    TRY(kind == H16_NONE ? mm32(in, ldi, (const float *)PTR(l, f), out, Nd, M, Kd, Nd, threads, schedule)      \
                         : mm16(in, ldi, (const uint16_t *)PTR(l, f), out, Nd, M, Kd, Nd, threads, kind, schedule)); \
    ROUND(out, (M) * (Nd))
    for (int64_t l = 0; l < num_layers; l++) {
        void *k_cache = (void *)PTR(l, L_K_CACHE), *v_cache = (void *)PTR(l, L_V_CACHE);
        TRY(norm(x, E, l ? m : 0, E, (const float *)PTR(l, L_LN_ATTN), eps, h, E, N, E, threads));
        ROUND(x, N * E);
        ROUND(h, N * E);
        MATMUL(h, E, L_QKV, qkv, N, E, qkvw);
        TRY(rope(qkv, qkvw, qk, cos_table, sin_table, dims[D_MAX_POS], positions, N, H + K, D, threads));
        ROUND(qk, N * qkw);
        for (int64_t n = 0; n < N; n++) {  /* this step's keys and values into their slots */
            const float *kn = qk + n * qkw + qw, *vn = qkv + n * qkvw + qkw;
            if (kind == H16_NONE) {
                memcpy((float *)k_cache + slots[n] * kvw, kn, (size_t)kvw * sizeof(float));
                memcpy((float *)v_cache + slots[n] * kvw, vn, (size_t)kvw * sizeof(float));
            } else {
                uint16_t *kd = (uint16_t *)k_cache + slots[n] * kvw, *vd = (uint16_t *)v_cache + slots[n] * kvw;
                for (int64_t i = 0; i < kvw; i++) {  /* exact: both are rounded already */
                    kd[i] = narrow_h16(kn[i], kind);
                    vd[i] = narrow_h16(vn[i], kind);
                }
            }
        }
        if (kind == H16_NONE)
            TRY(attention(qk, qkw, k_cache, v_cache, block_tables, dims[D_BT_STRIDE], query_table, query_ctx, att,
                          N, H, K, D, dims[D_BS], scale, threads));
        else
            TRY(toolkit_paged_attention_h16(qk, qkw, k_cache, v_cache, block_tables, dims[D_BT_STRIDE], query_table,
                                            query_ctx, att, N, H, K, D, dims[D_BS], scale, threads, kind));
        ROUND(att, N * qw);
        MATMUL(att, qw, L_O, o, N, qw, E);
        TRY(norm(x, E, o, E, (const float *)PTR(l, L_LN_MLP), eps, h, E, N, E, threads));
        ROUND(x, N * E);
        ROUND(h, N * E);
        MATMUL(h, E, L_GATE_UP, gu, N, E, 2 * F);
        TRY(silu(gu, 2 * F, act, F, N, F, threads));
        ROUND(act, N * F);
        MATMUL(act, F, L_DOWN, m, N, F, E);
    }
    if (num_layers > 0) {
        for (int64_t i = 0; i < N * E; i++) x[i] += m[i];
        ROUND(x, N * E);
    }
    return 0;
#undef TRY
#undef PTR
#undef ROUND
#undef MATMUL
}
