"""The engine's kernels on a CUDA GPU, in Triton (issues 56 and 57). Every output row is reduced in one fixed order
whatever the number of rows, so a request's logits do not depend on what it is batched with; and each replaces
two to ten of torch's launches, which is what a decode step on a GPU is bound by.

The batch-invariant mode's matmul is toolkit.native.gpu_matmul's.

One program a row or token, every mode (`routes`: the decoder, attention and sampler send a CUDA tensor here):
- `add_rms_norm`: the residual add rounded to the format, then HF's RMSNorm (fp32 statistics, rounded, scaled);
  `rms_norm`: the norm alone (the same kernel without its residual);
- `rope`: HF's RoPE of every head of a token, each op rounded as torch's (the same bits);
- `silu_mul`: silu(gate) * up of a fused projection;
- `paged_attention`: each token over its own sequence's cached keys, 16 positions at a time in its table's order
  (the CPU kernel's contract: prompt chunks and decode tokens in one launch, and a CUDA graph holds it); a context
  over ATTENTION_SPLIT keys a program per split, combined in the splits' order by `_combine_kernel`;
- `logsumexp`: an online max-and-sum over BLOCK_V slices in order.

Where Triton does not import, or the tensors are on the CPU without TRITON_INTERPRET=1, rms_norm and logsumexp
compute the same reduction with torch, one row at a time (`*_rows`): slow, and batch-invariant by
construction. CI runs the Triton kernels under TRITON_INTERPRET=1 at small shapes (tests/test_invariant_gpu.py),
the engine's GPU forward included.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch fallback below
    triton = tl = None

ATTENTION_TILE = 16  # key positions the attention takes at a time, whatever the block size
# key positions of one split of a long context (a multiple of the tile): a token's keys past the first split are taken
# by more programs, split by its own context alone, and combined in the splits' order (paged_attention)
ATTENTION_SPLIT = 256
ATTENTION_SPLIT_BYTES = 64 << 20  # the splits' partial results held at once at most (tokens taken in pieces past it)
# every launch: no contraction of a multiply and an add into an FMA (Triton's default differs between versions, and
# the bits would with it)
FIXED = {"enable_fp_fusion": False}
BLOCK_V = 1024  # logsumexp's slice of a row


def available(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run on `t`: Triton imports, and `t` is on a GPU, or on the CPU under
    TRITON_INTERPRET=1 (Triton's interpreter, what CI runs)."""
    if triton is None:
        return False
    return t.device.type == "cuda" or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def routes(t: torch.Tensor) -> bool:
    """Whether the engine runs the ops on `t` through these kernels: `t` on a CUDA GPU, Triton imported. (A CPU
    test widens it to `available`, to run the engine's GPU path in Triton's interpreter.)"""
    return triton is not None and t.is_cuda


if triton is not None:

    @triton.jit
    def _rounded(y, dtype: tl.constexpr):
        """fp32 -> dtype, round to nearest even, as an fp32 value. bf16 by integer rounding of the fp32 bits (then
        exact): Triton's interpreter truncates a bf16 conversion, a GPU rounds it; this is both's nearest-even."""
        if dtype == tl.bfloat16:
            bits = y.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            return bits.to(tl.float32, bitcast=True)
        return y.to(dtype).to(tl.float32)

    @triton.jit
    def _logsumexp_kernel(x_ptr, out_ptr, V, sx, BV: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BV)
        peak = tl.full((BV,), float("-inf"), dtype=tl.float32)
        for v0 in range(0, V, BV):
            x = tl.load(x_ptr + row * sx + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
            peak = tl.maximum(peak, x)
        m = tl.max(peak, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)  # a row of -inf: exp(-inf) = 0, its log -inf
        total = tl.zeros((BV,), dtype=tl.float32)
        for v0 in range(0, V, BV):
            x = tl.load(x_ptr + row * sx + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
            total += tl.exp(x - m)
        lse = m + tl.log(tl.sum(total, axis=0))
        tl.store(out_ptr + row, tl.where(m == float("inf"), m, lse))  # a +inf logit: +inf, as torch


# the step's kernels (the decoder's ops on a GPU)
if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, r_ptr, w_ptr, sum_ptr, out_ptr, D, sx, sr, ss, so, eps, HAS_RES: tl.constexpr, BD: tl.constexpr
    ):
        """One program a row, the whole row at once: s = x + r rounded to the format (stored), then HF's RMSNorm of
        s (fp32 squares summed by one fixed tree, rounded to the format, times the weight, rounded)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BD)
        mask = cols < D
        x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
        s = x.to(tl.float32)
        if HAS_RES:
            s = _rounded(s + tl.load(r_ptr + row * sr + cols, mask=mask, other=0.0).to(tl.float32), x.dtype)
            tl.store(sum_ptr + row * ss + cols, s.to(x.dtype), mask=mask)
        inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(s * s, axis=0), D * 1.0) + eps))  # IEEE-rounded
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = _rounded(s * inv, x.dtype)
        tl.store(out_ptr + row * so + cols, _rounded(w * y, x.dtype).to(x.dtype), mask=mask)

    @triton.jit
    def _rope_kernel(
        x_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, H, sxn, sxh, son, soh, sc, BH: tl.constexpr, D: tl.constexpr
    ):
        """One program a token, every head: x * cos + rotate_half(x) * sin with cos and sin rounded to the format
        and each product and the sum rounded to it, as torch's elementwise ops in that format do."""
        n = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BH)[:, None]
        d = tl.arange(0, D)[None, :]
        half = D // 2
        partner = (d + half) % D
        mask = (h < H) & (d < D)
        x = tl.load(x_ptr + n * sxn + h * sxh + d, mask=mask, other=0.0)
        xr = tl.load(x_ptr + n * sxn + h * sxh + partner, mask=mask, other=0.0).to(tl.float32)
        xr = tl.where(d < half, -xr, xr)
        pos = tl.load(pos_ptr + n)
        c = _rounded(tl.load(cos_ptr + pos * sc + d), x.dtype)
        sn = _rounded(tl.load(sin_ptr + pos * sc + d), x.dtype)
        y = _rounded(_rounded(x.to(tl.float32) * c, x.dtype) + _rounded(xr * sn, x.dtype), x.dtype)
        tl.store(out_ptr + n * son + h * soh + d, y.to(x.dtype), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, width, sx, so, BW: tl.constexpr):
        """silu(gate) rounded to the format, times up, rounded (torch's two ops): gate | up halves of each row."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BW + tl.arange(0, BW)
        mask = cols < width
        g = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
        u = tl.load(x_ptr + row * sx + width + cols, mask=mask, other=0.0).to(tl.float32)
        g32 = g.to(tl.float32)
        a = _rounded(tl.div_rn(g32, 1.0 + tl.exp(-g32)), g.dtype)
        tl.store(out_ptr + row * so + cols, _rounded(a * u, g.dtype).to(g.dtype), mask=mask)

    @triton.jit
    def _paged_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        qtable_ptr,
        qctx_ptr,
        out_ptr,
        scale,
        sqn,
        sqh,
        skb,
        skt,
        skh,
        stb,
        son,
        soh,
        G,
        BS,
        m_ptr,
        total_ptr,
        acc_ptr,
        SPLIT,
        BG: tl.constexpr,
        TILE: tl.constexpr,
        D: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        """One program per (query token, KV head[, split]): the token's G query heads over its own sequence's first
        ctx cached keys, TILE key positions at a time in ascending order (each key's slot read from the block table:
        table[pos // BS] * BS + pos % BS), an online softmax in fp32. The order of every sum is fixed by the
        token's own context: the same bits whatever the batch, its mix of prefill and decode, or the block size.
        With SPLITS, program (n, kvh, s) takes positions [s * SPLIT, (s + 1) * SPLIT) of the context and stores its
        running max, sum and output (m_ptr, total_ptr, acc_ptr) for _combine_kernel instead of the output."""
        n = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        g = tl.arange(0, BG)[:, None]
        d = tl.arange(0, D)[None, :]
        t = tl.arange(0, TILE)
        gmask = g < G
        seq = tl.load(qtable_ptr + n)
        ctx = tl.load(qctx_ptr + n)
        first, end = 0, ctx
        if SPLITS:
            s = tl.program_id(2)
            first = s * SPLIT
            end = tl.minimum(ctx, first + SPLIT)
        q = tl.load(q_ptr + n * sqn + (kvh * G + g) * sqh + d, mask=gmask, other=0.0).to(tl.float32)
        m = tl.full((BG,), float("-inf"), dtype=tl.float32)
        total = tl.zeros((BG,), dtype=tl.float32)
        acc = tl.zeros((BG, D), dtype=tl.float32)
        for j in range(0, tl.cdiv(end - first, TILE)):  # no iteration where the split is past the context
            pos = first + j * TILE + t
            seen = pos < end
            block = tl.load(tables_ptr + seq * stb + pos // BS, mask=seen, other=0).to(tl.int64)
            base = block[:, None] * skb + (pos % BS)[:, None] * skt + kvh * skh + d
            k = tl.load(k_ptr + base, mask=seen[:, None], other=0.0).to(tl.float32)  # (TILE, D)
            v = tl.load(v_ptr + base, mask=seen[:, None], other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (BG, TILE)
            scores = tl.where(seen[None, :], scores, float("-inf"))
            peak = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - peak[:, None])
            fade = tl.exp(m - peak)
            total = total * fade + tl.sum(p, axis=1)
            acc = acc * fade[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = peak
        if SPLITS:  # a split past the context stores nothing (_combine_kernel reads only the context's)
            part = (n * tl.num_programs(1) + kvh) * SPLITS + s  # (token, KV head, split): G heads each
            row = part * BG + tl.arange(0, BG)
            live = tl.zeros((BG,), dtype=tl.int64) + first < ctx  # every head of this split, or none
            tl.store(m_ptr + row, m, mask=live)
            tl.store(total_ptr + row, total, mask=live)
            tl.store(acc_ptr + row[:, None] * D + d, acc, mask=live[:, None])
        else:
            out = acc / total[:, None]
            tl.store(out_ptr + n * son + (kvh * G + g) * soh + d, out.to(out_ptr.dtype.element_ty), mask=gmask)

    @triton.jit
    def _combine_kernel(
        qctx_ptr,
        m_ptr,
        total_ptr,
        acc_ptr,
        out_ptr,
        son,
        soh,
        G,
        SPLIT,
        BG: tl.constexpr,
        D: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        """A token's splits (the programs of _paged_attention_kernel with SPLITS) combined in their order, only as
        many as its own context has: the peak of their maxima, then each split's sum and output rescaled to it and
        added, split 0 first. With one split the rescale is exp(0) = 1 and the result the unsplit kernel's, bit for
        bit."""
        n = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        g = tl.arange(0, BG)
        d = tl.arange(0, D)[None, :]
        used = tl.cdiv(tl.load(qctx_ptr + n), SPLIT)
        base = (n * tl.num_programs(1) + kvh) * SPLITS * BG
        peak = tl.full((BG,), float("-inf"), dtype=tl.float32)
        for s in range(0, used):
            peak = tl.maximum(peak, tl.load(m_ptr + base + s * BG + g))
        total = tl.zeros((BG,), dtype=tl.float32)
        acc = tl.zeros((BG, D), dtype=tl.float32)
        for s in range(0, used):
            row = base + s * BG + g
            fade = tl.exp(tl.load(m_ptr + row) - peak)
            total = total + tl.load(total_ptr + row) * fade
            acc = acc + tl.load(acc_ptr + row[:, None] * D + d) * fade[:, None]
        out = acc / total[:, None]
        gmask = g[:, None] < G
        tl.store(out_ptr + n * son + (kvh * G + g[:, None]) * soh + d, out.to(out_ptr.dtype.element_ty), mask=gmask)


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def add_rms_norm(
    x_ND: torch.Tensor, residual_ND: torch.Tensor | None, weight_D: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, RMSNorm of it), one kernel a step (HF's order: normalised in fp32, rounded to the format,
    times the weight). residual None: (x, RMSNorm of x)."""
    n, dim = x_ND.shape
    x_ND = x_ND.contiguous()
    total = torch.empty_like(x_ND) if residual_ND is not None else x_ND
    out = torch.empty_like(x_ND)
    res = residual_ND.contiguous() if residual_ND is not None else x_ND
    if n:
        _add_rms_norm_kernel[(n,)](
            x_ND,
            res,
            weight_D,
            total,
            out,
            dim,
            x_ND.stride(0),
            res.stride(0),
            total.stride(0),
            out.stride(0),
            eps,
            HAS_RES=residual_ND is not None,
            BD=triton.next_power_of_2(dim),
            **FIXED,
        )
    return total, out


def rope(x_NHD: torch.Tensor, cos_PD: torch.Tensor, sin_PD: torch.Tensor, positions_N: torch.Tensor) -> torch.Tensor:
    """HF's RoPE (x * cos + rotate_half(x) * sin, in x's format) of every head of every token, one kernel; x may
    be a strided view (the q | k part of the fused projection)."""
    n, heads, dim = x_NHD.shape
    out = torch.empty((n, heads, dim), dtype=x_NHD.dtype, device=x_NHD.device)
    if n:
        _rope_kernel[(n,)](
            x_NHD,
            cos_PD,
            sin_PD,
            positions_N,
            out,
            heads,
            x_NHD.stride(0),
            x_NHD.stride(1),
            out.stride(0),
            out.stride(1),
            cos_PD.stride(0),
            BH=triton.next_power_of_2(heads),
            D=dim,
            **FIXED,
        )
    return out


def silu_mul(x_N2I: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate | up projection, one kernel."""
    n, width = x_N2I.shape[0], x_N2I.shape[1] // 2
    out = torch.empty((n, width), dtype=x_N2I.dtype, device=x_N2I.device)
    if n:
        block = 1024
        _silu_mul_kernel[(n, triton.cdiv(width, block))](
            x_N2I, out, width, x_N2I.stride(0), out.stride(0), BW=block, **FIXED
        )
    return out


def paged_attention(
    q_NHD: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables_SB: torch.Tensor,
    query_table_N: torch.Tensor,
    query_ctx_N: torch.Tensor,
    scale: float,
    out_NHD: torch.Tensor,
    split: int = ATTENTION_SPLIT,
) -> None:
    """Each query token over its own sequence's cached keys (query_table_N: its row of tables_SB; query_ctx_N:
    how many keys it sees), into out_NHD: the CPU kernel's contract (toolkit.native.ops.paged_attention_cpu).
    A context longer than `split` keys is taken by a program per `split` keys and their results combined in order
    (flash decoding, with the split fixed by the token's own context: a long context at batch 1 is not one program
    a KV head, and its bits do not depend on the batch)."""
    n, heads, dim = q_NHD.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if not n:
        return
    # splits of a context: as many as the longest the tables hold (a static shape, which a CUDA graph's bucket
    # keeps), though each token combines only its own context's; a batch whose tables hold at most one split runs
    # the kernel unsplit (the same bits: _combine_kernel)
    if split % ATTENTION_TILE or split <= 0:
        raise ValueError(f"the attention's split must be a positive multiple of {ATTENTION_TILE}, got {split}")
    splits = -(-tables_SB.shape[1] * block_size // split)
    if splits == 1:
        _attention_launch(q_NHD, k_cache, v_cache, tables_SB, query_table_N, query_ctx_N, scale, out_NHD, split, 1)
        return
    # the splits' partial results, for at most `piece` tokens at a time (a prefill chunk of thousands of tokens over
    # a long context would need gigabytes at once): a token's bits do not depend on its piece
    rows = kv_heads * splits * triton.next_power_of_2(heads // kv_heads)  # a token's (KV head, split, query head)
    piece = max(1, min(n, ATTENTION_SPLIT_BYTES // (rows * (dim + 2) * 4)))
    m = torch.empty(piece * rows, dtype=torch.float32, device=q_NHD.device)
    total = torch.empty_like(m)
    acc = torch.empty(m.numel() * dim, dtype=torch.float32, device=q_NHD.device)
    for lo in range(0, n, piece):
        hi = min(n, lo + piece)
        args = (q_NHD[lo:hi], k_cache, v_cache, tables_SB, query_table_N[lo:hi], query_ctx_N[lo:hi], scale)
        _attention_launch(*args, out_NHD[lo:hi], split, splits, (m, total, acc))


def _attention_launch(
    q_NHD, k_cache, v_cache, tables_SB, query_table_N, query_ctx_N, scale, out_NHD, split, splits, parts=None
) -> None:
    """One launch of the attention (splits > 1: its splits into `parts`, then their combination into out_NHD)."""
    n, heads, dim = q_NHD.shape
    _, block_size, kv_heads, _ = k_cache.shape
    groups, bg = heads // kv_heads, triton.next_power_of_2(heads // kv_heads)
    m, total, acc = parts if parts is not None else (out_NHD,) * 3  # unread when unsplit
    _paged_attention_kernel[(n, kv_heads, splits)](
        q_NHD,
        k_cache,
        v_cache,
        tables_SB,
        query_table_N,
        query_ctx_N,
        out_NHD,
        scale,
        q_NHD.stride(0),
        q_NHD.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables_SB.stride(0),
        out_NHD.stride(0),
        out_NHD.stride(1),
        groups,
        block_size,
        m,
        total,
        acc,
        split,
        BG=bg,
        TILE=ATTENTION_TILE,
        D=dim,
        SPLITS=splits if splits > 1 else 0,
        **FIXED,
    )
    if splits > 1:
        _combine_kernel[(n, kv_heads)](
            query_ctx_N,
            m,
            total,
            acc,
            out_NHD,
            out_NHD.stride(0),
            out_NHD.stride(1),
            groups,
            split,
            BG=bg,
            D=dim,
            SPLITS=splits,
            **FIXED,
        )


def supports_attention(head_dim: int, groups: int) -> bool:
    """Whether the Triton paged attention takes these shapes: a power-of-two head_dim up to 256, up to 16 query
    heads a KV head (any block size)."""
    return triton is not None and is_pow2(head_dim) and head_dim <= 256 and groups <= 16


def rms_norm(x_MD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row in fp32, rounded to x's format, times the weight (HF's order), one order a row."""
    if not available(x_MD):
        return rms_norm_rows(x_MD, weight_D, eps)
    return add_rms_norm(x_MD, None, weight_D, eps)[1]  # the fused kernel without its residual


def logsumexp(x_RV: torch.Tensor) -> torch.Tensor:
    """logsumexp of each row, (R,) fp32, one order a row."""
    if not available(x_RV):
        return logsumexp_rows(x_RV)
    x_RV = x_RV.contiguous()
    out = torch.empty(x_RV.shape[0], dtype=torch.float32, device=x_RV.device)
    if not x_RV.shape[0]:
        return out
    _logsumexp_kernel[(x_RV.shape[0],)](x_RV, out, x_RV.shape[1], x_RV.stride(0), BV=BLOCK_V, **FIXED)
    return out


# the torch fallback: each row alone, so the library's kernel choice cannot depend on the batch


def rms_norm_rows(x_MD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    rows = []
    for i in range(x_MD.shape[0]):
        x32 = x_MD[i : i + 1].float()
        rows.append(weight_D * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x_MD.dtype))
    return torch.cat(rows) if rows else torch.empty_like(x_MD)


def logsumexp_rows(x_RV: torch.Tensor) -> torch.Tensor:
    return (
        torch.cat([torch.logsumexp(x_RV[i : i + 1].float(), dim=-1) for i in range(x_RV.shape[0])])
        if x_RV.shape[0]
        else torch.empty(0, device=x_RV.device)
    )
