"""The paged attention on a CUDA GPU, in Triton (issues 56 and 57): each query token over its own sequence's cached
keys, in an order fixed by the token's own context, so a request's bits do not depend on its batch, its mix of
prefill chunks and decode tokens, the block size or a CUDA graph's padding.

- `paged_attention`: the CPU kernel's contract (toolkit.native.ops.paged_attention_cpu): each query token's row of
  the block tables and its context, so prompt chunks and decode tokens run in one launch, and a CUDA graph holds
  it. Key positions ATTENTION_TILE at a time in ascending order; a context over ATTENTION_SPLIT keys a program per
  split, combined in the splits' order by `_combine_kernel` (flash decoding, the split fixed by the context alone).
- Any head_dim up to MAX_HEAD_DIM (in the power of two that holds it, the rest masked) and any number of query
  heads a KV head (HEADS_A_PROGRAM to a program).
- An 8-bit cache (int8, fp8 e4m3) with a scale per block and KV head or one per KV head (engine.kv_scale_granularity
  block or tensor), read as the CPU kernel reads it: the stored units widened to fp32, a key's scale factored out of
  its dot product with the query and a value's into its softmax weight (toolkit/native/csrc/paged_attention.c).

CI runs it under TRITON_INTERPRET=1 at small shapes (tests/test_invariant_gpu.py).
"""

from __future__ import annotations

import torch

from toolkit.native.invariant_gpu import FIXED, tl, triton

ATTENTION_TILE = 16  # key positions the attention takes at a time, whatever the block size
# key positions of one split of a long context (a multiple of the tile): a token's keys past the first split are taken
# by more programs, split by its own context alone, and combined in the splits' order (paged_attention)
ATTENTION_SPLIT = 256
# query heads one program takes of a KV head's (more are taken by more programs): a program's (heads x keys x dims)
# products are its registers
HEADS_A_PROGRAM = 16
MAX_HEAD_DIM = 256  # a head's tile (a power of two holding head_dim) is in every program's registers
ATTENTION_SPLIT_BYTES = 64 << 20  # the splits' partial results held at once at most (tokens taken in pieces past it)


if triton is not None:

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
        HG,
        BS,
        m_ptr,
        total_ptr,
        acc_ptr,
        SPLIT,
        D,
        ks_ptr,
        vs_ptr,
        KV_HEADS,
        BG: tl.constexpr,
        TILE: tl.constexpr,
        BD: tl.constexpr,
        SPLITS: tl.constexpr,
        SCALES: tl.constexpr,
        FP8: tl.constexpr,
    ):
        """One program per (query token, KV head and group of its query heads[, split]): BG of the token's G query
        heads over its own sequence's first ctx cached keys (HG groups a KV head), TILE key positions at a time in
        ascending order (each key's slot read from the block table: table[pos // BS] * BS + pos % BS), an online
        softmax in fp32; a head of D dimensions in a tile of BD (a power of two), the rest masked. The order of every
        sum is fixed by the token's own context: the same bits whatever the batch, its mix of prefill and decode, or
        the block size. With SPLITS, program (n, head group, s) takes positions [s * SPLIT, (s + 1) * SPLIT) of the
        context and stores its running max, sum and output (m_ptr, total_ptr, acc_ptr) for _combine_kernel instead
        of the output. SCALES (an 8-bit cache): 1, a scale per block and KV head (ks_ptr / vs_ptr: [blocks,
        KV_HEADS]); 2, one per KV head ([KV_HEADS]); a key's multiplies its dot products, a value's its weights."""
        n = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1) // HG
        g = (tl.program_id(1) % HG) * BG + tl.arange(0, BG)[:, None]  # query heads of KV head kvh
        d = tl.arange(0, BD)[None, :]
        t = tl.arange(0, TILE)
        gmask = (g < G) & (d < D)
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
        acc = tl.zeros((BG, BD), dtype=tl.float32)
        for j in range(0, tl.cdiv(end - first, TILE)):  # no iteration where the split is past the context
            pos = first + j * TILE + t
            seen = pos < end
            block = tl.load(tables_ptr + seq * stb + pos // BS, mask=seen, other=0).to(tl.int64)
            base = block[:, None] * skb + (pos % BS)[:, None] * skt + kvh * skh + d
            kmask = seen[:, None] & (d < D)
            k = tl.load(k_ptr + base, mask=kmask, other=0)  # (TILE, BD)
            if BG >= 16:  # the values as (BD, TILE): see the weighted sum below
                dt = tl.arange(0, BD)[:, None]
                base_t = block[None, :] * skb + (pos % BS)[None, :] * skt + kvh * skh + dt
                v = tl.load(v_ptr + base_t, mask=seen[None, :] & (dt < D), other=0)
            else:
                v = tl.load(v_ptr + base, mask=kmask, other=0)
            if FP8:  # e4m3 bytes (read as uint8: the interpreter fills no float8 lanes)
                k = k.to(tl.float8e4nv, bitcast=True)
                v = v.to(tl.float8e4nv, bitcast=True)
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (BG, TILE)
            if SCALES == 1:
                ksc = tl.load(ks_ptr + block * KV_HEADS + kvh, mask=seen, other=0.0)
                vsc = tl.load(vs_ptr + block * KV_HEADS + kvh, mask=seen, other=0.0)
                scores = scores * ksc[None, :]
            elif SCALES == 2:
                ksc = tl.load(ks_ptr + kvh + 0 * t)
                vsc = tl.load(vs_ptr + kvh + 0 * t)
                scores = scores * ksc[None, :]
            scores = tl.where(seen[None, :], scores * scale, float("-inf"))
            peak = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - peak[:, None])
            fade = tl.exp(m - peak)
            total = total * fade + tl.sum(p, axis=1)
            weights = p
            if SCALES != 0:
                weights = p * vsc[None, :]
            # Triton's combine pass compiles sum(a[:, :, None] * b[None, :, :], 1) with 16 rows or more as a tl.dot, at
            # TF32 on a GPU (1e-3 off in fp32: an H200, 32 query heads a KV head): those reduce the last axis instead
            if BG >= 16:
                acc = acc * fade[:, None] + tl.sum(weights[:, None, :] * v[None, :, :], axis=2)
            else:  # fewer than 16 rows: the pass leaves it alone (the form the H100 and H200 timed)
                acc = acc * fade[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)  # under 16 rows
            m = peak
        if SPLITS:  # a split past the context stores nothing (_combine_kernel reads only the context's)
            part = (n * tl.num_programs(1) + tl.program_id(1)) * SPLITS + s  # (token, head group, split): BG heads
            row = part * BG + tl.arange(0, BG)
            live = tl.zeros((BG,), dtype=tl.int64) + first < ctx  # every head of this split, or none
            tl.store(m_ptr + row, m, mask=live)
            tl.store(total_ptr + row, total, mask=live)
            tl.store(acc_ptr + row[:, None] * BD + d, acc, mask=live[:, None])
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
        HG,
        SPLIT,
        D,
        BG: tl.constexpr,
        BD: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        """A token's splits (the programs of _paged_attention_kernel with SPLITS) combined in their order, only as
        many as its own context has: the peak of their maxima, then each split's sum and output rescaled to it and
        added, split 0 first. With one split the rescale is exp(0) = 1 and the result the unsplit kernel's, bit for
        bit."""
        n = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1) // HG
        heads = (tl.program_id(1) % HG) * BG  # the group's first query head of KV head kvh
        g = tl.arange(0, BG)
        d = tl.arange(0, BD)[None, :]
        used = tl.cdiv(tl.load(qctx_ptr + n), SPLIT)
        base = (n * tl.num_programs(1) + tl.program_id(1)) * SPLITS * BG
        peak = tl.full((BG,), float("-inf"), dtype=tl.float32)
        for s in range(0, used):
            peak = tl.maximum(peak, tl.load(m_ptr + base + s * BG + g))
        total = tl.zeros((BG,), dtype=tl.float32)
        acc = tl.zeros((BG, BD), dtype=tl.float32)
        for s in range(0, used):
            row = base + s * BG + g
            fade = tl.exp(tl.load(m_ptr + row) - peak)
            total = total + tl.load(total_ptr + row) * fade
            acc = acc + tl.load(acc_ptr + row[:, None] * BD + d) * fade[:, None]
        out = acc / total[:, None]
        gmask = (heads + g[:, None] < G) & (d < D)
        tl.store(
            out_ptr + n * son + (kvh * G + heads + g[:, None]) * soh + d, out.to(out_ptr.dtype.element_ty), mask=gmask
        )


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
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Each query token over its own sequence's cached keys (query_table_N: its row of tables_SB; query_ctx_N:
    how many keys it sees), into out_NHD: the CPU kernel's contract (toolkit.native.ops.paged_attention_cpu; with
    `k_scales` / `v_scales`, an 8-bit cache's, paged_attention_cpu_q8: [blocks, KV heads] or [KV heads], fp32).
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
    scales = _scales(k_cache, k_scales, v_scales, kv_heads)
    if splits == 1:
        args = (q_NHD, k_cache, v_cache, tables_SB, query_table_N, query_ctx_N, scale, out_NHD, split, 1)
        _attention_launch(*args, scales=scales)
        return
    # the splits' partial results, for at most `piece` tokens at a time (a prefill chunk of thousands of tokens over
    # a long context would need gigabytes at once): a token's bits do not depend on its piece
    head_groups, bg, bd = _head_tiles(heads // kv_heads, dim)
    rows = kv_heads * head_groups * splits * bg  # a token's (KV head, head group, split, query head)
    piece = max(1, min(n, ATTENTION_SPLIT_BYTES // (rows * (bd + 2) * 4)))
    m = torch.empty(piece * rows, dtype=torch.float32, device=q_NHD.device)
    total = torch.empty_like(m)
    acc = torch.empty(m.numel() * bd, dtype=torch.float32, device=q_NHD.device)
    for lo in range(0, n, piece):
        hi = min(n, lo + piece)
        args = (q_NHD[lo:hi], k_cache, v_cache, tables_SB, query_table_N[lo:hi], query_ctx_N[lo:hi], scale)
        _attention_launch(*args, out_NHD[lo:hi], split, splits, (m, total, acc), scales)


def _scales(
    k_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """An 8-bit cache's scales as the kernel takes them (keys', values', SCALES), or None for a 16- or 32-bit one."""
    if k_cache.element_size() != 1:
        return None
    if k_scales is None or v_scales is None:
        raise ValueError(f"an 8-bit cache ({k_cache.dtype}) is read with its key and value scales")
    if k_scales.shape != v_scales.shape or k_scales.shape[-1] != kv_heads or k_scales.dim() not in (1, 2):
        raise ValueError(
            f"an 8-bit cache's scales are [blocks, KV heads] or [KV heads], not {tuple(k_scales.shape)} and "
            f"{tuple(v_scales.shape)} for {kv_heads} KV heads"
        )
    k_scales, v_scales = (s.float().contiguous() for s in (k_scales, v_scales))
    return k_scales, v_scales, 1 if k_scales.dim() == 2 else 2


def _attention_launch(
    q_NHD,
    k_cache,
    v_cache,
    tables_SB,
    query_table_N,
    query_ctx_N,
    scale,
    out_NHD,
    split,
    splits,
    parts=None,
    scales=None,
) -> None:
    """One launch of the attention (splits > 1: its splits into `parts`, then their combination into out_NHD;
    `scales`: an 8-bit cache's, from _scales)."""
    n, heads, dim = q_NHD.shape
    _, block_size, kv_heads, _ = k_cache.shape
    groups = heads // kv_heads
    head_groups, bg, bd = _head_tiles(groups, dim)
    m, total, acc = parts if parts is not None else (out_NHD,) * 3  # unread when unsplit
    k_scales, v_scales, mode = scales if scales is not None else (out_NHD, out_NHD, 0)  # unread without
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _paged_attention_kernel[(n, kv_heads * head_groups, splits)](
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
        head_groups,
        block_size,
        m,
        total,
        acc,
        split,
        dim,
        k_scales,
        v_scales,
        kv_heads,
        BG=bg,
        TILE=ATTENTION_TILE,
        BD=bd,
        SPLITS=splits if splits > 1 else 0,
        SCALES=mode,
        FP8=fp8,
        **FIXED,
    )
    if splits > 1:
        _combine_kernel[(n, kv_heads * head_groups)](
            query_ctx_N,
            m,
            total,
            acc,
            out_NHD,
            out_NHD.stride(0),
            out_NHD.stride(1),
            groups,
            head_groups,
            split,
            dim,
            BG=bg,
            BD=bd,
            SPLITS=splits,
            **FIXED,
        )


def _head_tiles(groups: int, head_dim: int) -> tuple[int, int, int]:
    """(programs a KV head, query heads a program, a head's tile): a KV head's query heads in groups of at most
    HEADS_A_PROGRAM, and its head_dim in the power of two that holds it (the rest masked). Fixed by the model's
    shape alone, so by no batch."""
    bg = min(triton.next_power_of_2(groups), HEADS_A_PROGRAM)
    return -(-groups // bg), bg, triton.next_power_of_2(head_dim)


def supports_attention(head_dim: int, groups: int) -> bool:
    """Whether the Triton paged attention takes these shapes: any head_dim up to MAX_HEAD_DIM, any number of query
    heads a KV head, any block size."""
    return triton is not None and 0 < head_dim <= MAX_HEAD_DIM and groups >= 1
