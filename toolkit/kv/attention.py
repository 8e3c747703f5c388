"""Paged attention over a flat packed batch.

One step's tokens are packed along one axis N: first one token per decoding sequence,
then the prefill chunks, each contiguous. Keys and values live in per-layer paged caches
`[num_blocks, block_size, H_kv, D]`; a sequence's block table lists its physical blocks.

Two backends here:
- `kernel` (CPU; fp32, or int8/fp8 blocks with their scales): the native kernel in
  csrc/paged_attention.c reads every query's keys straight from its blocks (no gathered
  copy, no padding) in a fixed order. It serves every row of a step: decode rows and
  prefill chunks alike.
- `sdpa` (any device): each sequence's blocks are gathered into a key axis and torch's
  scaled_dot_product_attention runs with an additive mask; decode rows in one batched
  call, each prefill chunk in its own call. Grouped-query attention is computed without
  repeating K/V: the G query heads of one KV head are laid along the query axis. It also
  runs Gemma2's soft-capping and sliding windows, and de-quantises bf16/int8/fp8 blocks.
On the sdpa backend prefill chunks are SDPA calls too; on the kernel backend they are kernel rows.
A third backend, `flex` (toolkit/kv/flex.py), sends every row through torch's FlexAttention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toolkit.kv import flex
from toolkit.kv.quant import read_blocks, write_quantized
from toolkit.native import gpu_attention, invariant_gpu
from toolkit.native.ops import paged_attention_cpu, paged_attention_cpu_q8


@dataclass(frozen=True)
class PrefillChunk:
    start: int  # first row in the packed batch
    end: int  # one past the last row
    block_table_B: torch.Tensor  # (blocks covering the context,) long
    context_len: int  # tokens in the cache once this chunk is written
    bias_GQT: torch.Tensor  # (G * chunk, context_len) additive mask: 0 = attend, -inf = causal future


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about one step, built once and shared by all layers."""

    slot_mapping_N: torch.Tensor  # (N,) long: physical slot each new token's K/V is written to
    num_decodes: int  # rows [0, num_decodes) are single-token queries
    kernel_rows: int  # rows [0, kernel_rows) go through the native kernel (0 with the sdpa backend)
    block_tables_SB: torch.Tensor | None  # kernel: (sequences, max_blocks) long
    query_table_N: torch.Tensor | None  # kernel: (N,) row of block_tables_SB for each token
    query_ctx_N: torch.Tensor | None  # kernel: (N,) keys visible to each token (its position + 1)
    decode_block_tables_DB: torch.Tensor | None  # sdpa: (num_decodes, max_blocks) long
    decode_bias_DT: torch.Tensor | None  # sdpa: (num_decodes, max_blocks * block_size) additive: -inf past ctx
    decode_ctx_D: torch.Tensor | None  # sdpa: (num_decodes,) keys each decode row sees
    prefills: tuple[PrefillChunk, ...]  # sdpa chunks (rows >= kernel_rows)
    flex: object | None = None  # toolkit.kv.flex.FlexMetadata: every row through FlexAttention
    kv_quant: KVQuant | None = None  # int8/fp8 caches: the format and every layer's scales


@dataclass(frozen=True)
class KVQuant:
    """How a quantised cache is stored: `kv_dtype` (int8 | fp8_e4m3) and, per layer, the running
    per-block scales (k, v: [blocks, K]; granularity=channel: (lo, hi) ranges, k [blocks, K, D, 2] and
    per-token v [blocks, block_size, K, 2]) or the static per-tensor ones (k, v: [K])."""

    kv_dtype: str
    block_scales: list[tuple[torch.Tensor, torch.Tensor]] | None
    tensor_scales: list[tuple[torch.Tensor, torch.Tensor]] | None
    granularity: str = "block"

    def layer(self, i: int, which: int) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
        """(per-block scales, static scale, per-token) of layer i's keys (which=0) or values (which=1)."""
        per_token = self.granularity == "channel" and which == 1
        if self.block_scales is not None:
            return self.block_scales[i][which], None, per_token
        return None, self.tensor_scales[i][which], per_token


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_NHD: torch.Tensor,
    v_NHD: torch.Tensor,
    slot_mapping_N: torch.Tensor,
    kv_quant: KVQuant | None = None,
    layer: int = 0,
) -> None:
    """Scatter this step's keys and values into their slots (the cache is the only mutable state);
    a quantised cache quantises them on the way in (toolkit/kv/quant.py)."""
    if kv_quant is not None:
        for which, (cache, x) in enumerate(((k_cache, k_NHD), (v_cache, v_NHD))):
            write_quantized(cache, *kv_quant.layer(layer, which), x, slot_mapping_N, kv_quant.kv_dtype)
        return
    num_blocks, block_size, h_kv, d = k_cache.shape
    k_cache.view(num_blocks * block_size, h_kv, d).index_copy_(0, slot_mapping_N, k_NHD.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, h_kv, d).index_copy_(0, slot_mapping_N, v_NHD.to(v_cache.dtype))


def additive_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as an additive bias, built once per step (SDPA would convert a bool mask per call)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _gather_blocks(
    cache: torch.Tensor,
    tables: torch.Tensor,
    dtype: torch.dtype,
    scales: tuple[torch.Tensor | None, torch.Tensor | None, bool] | None = None,
) -> torch.Tensor:
    """Copy the blocks a table lists into one key axis: (..., B) -> (..., B * block_size, K, D),
    in the compute dtype (de-quantised with the blocks' scales for an int8/fp8 cache)."""
    _, block_size, h_kv, d = cache.shape
    if scales is not None:
        rows = read_blocks(cache, *scales, tables, dtype)
    else:
        rows = cache.index_select(0, tables.reshape(-1)).to(dtype)  # index_select is ~2x faster than cache[tables]
    return rows.view(*tables.shape[:-1], tables.shape[-1] * block_size, h_kv, d)


def _grouped_sdpa(
    q_BQHD: torch.Tensor,
    k_BTKD: torch.Tensor,
    v_BTKD: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v with H = K * G query heads sharing K kv heads.

    `bias` is (B, 1, T) for single-token queries (it broadcasts over the G rows) or
    (B, G*Q, T) with the chunk's causal bias already repeated for the G head groups.
    `softcap` (Gemma2) squashes the scores to (-cap, cap) with cap * tanh(s / cap) before the
    bias, which SDPA cannot do: the scores are then computed explicitly.
    """
    b, q_len, h, d = q_BQHD.shape
    kv_heads = k_BTKD.shape[2]
    groups = h // kv_heads
    # (B, Q, K, G, D) -> (B, K, G*Q, D): the G heads of one KV head become extra query rows
    q = q_BQHD.view(b, q_len, kv_heads, groups, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, groups * q_len, d)
    k = k_BTKD.transpose(1, 2)  # (B, K, T, D)
    v = v_BTKD.transpose(1, 2)
    if softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.unsqueeze(1), scale=scale)  # (B, K, G*Q, D)
    else:
        scores = torch.tanh(q @ k.transpose(-1, -2) * (scale / softcap)) * softcap + bias.unsqueeze(1)
        out = torch.softmax(scores, dim=-1) @ v
    # (B, K, G, Q, D) -> (B, Q, K*G, D)
    return out.view(b, kv_heads, groups, q_len, d).permute(0, 3, 1, 2, 4).reshape(b, q_len, h, d)


def _window_bias(query_pos: torch.Tensor, num_keys: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """-inf on keys more than `window - 1` positions behind each query (sliding-window layers)."""
    keys = torch.arange(num_keys, device=query_pos.device)
    return additive_bias(keys[None, :] > query_pos[:, None] - window, dtype)  # (Q, T)


def paged_attention(
    q_NHD: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    layer: int = 0,
) -> torch.Tensor:
    """Attention of every packed query over its own sequence's cached keys. Returns (N, H, D).

    `softcap` and `window` (Gemma2) run on the sdpa path only; the engine picks it for such models."""
    if meta.flex is not None:
        return flex.attention(q_NHD, k_cache, v_cache, meta.flex, scale, softcap, window)
    out_NHD = torch.empty(q_NHD.shape, dtype=q_NHD.dtype, device=q_NHD.device)
    if meta.kernel_rows and (softcap is not None or window is not None):
        raise ValueError("the native attention kernel has no soft-capping or sliding window: use the sdpa backend")
    scales = {}
    if meta.kernel_rows and meta.kv_quant is not None:  # block or tensor scales (the backend refuses channel ones)
        (k_block, k_static, _), (v_block, v_static, _) = (meta.kv_quant.layer(layer, w) for w in (0, 1))
        scales = dict(
            k_scales=k_block if k_block is not None else k_static,
            v_scales=v_block if v_block is not None else v_static,
        )
    if meta.kernel_rows and invariant_gpu.routes(q_NHD):  # the Triton kernel, the same contract
        rows = meta.kernel_rows
        gpu_attention.paged_attention(
            q_NHD[:rows],
            k_cache,
            v_cache,
            meta.block_tables_SB,
            meta.query_table_N[:rows],
            meta.query_ctx_N[:rows],
            scale,
            out_NHD[:rows],
            **scales,
        )
    elif meta.kernel_rows and scales:
        rows = meta.kernel_rows
        paged_attention_cpu_q8(
            q_NHD[:rows],
            k_cache,
            v_cache,
            scales["k_scales"],
            scales["v_scales"],
            meta.block_tables_SB,
            meta.query_table_N[:rows],
            meta.query_ctx_N[:rows],
            scale,
            out_NHD[:rows],
        )
    elif meta.kernel_rows:
        rows = meta.kernel_rows
        paged_attention_cpu(
            q_NHD[:rows],
            k_cache,
            v_cache,
            meta.block_tables_SB,
            meta.query_table_N[:rows],
            meta.query_ctx_N[:rows],
            scale,
            out_NHD[:rows],
        )
    dtype = q_NHD.dtype
    ks, vs = (meta.kv_quant.layer(layer, 0), meta.kv_quant.layer(layer, 1)) if meta.kv_quant else (None, None)
    if meta.num_decodes and not meta.kernel_rows:
        dec = meta.num_decodes
        k = _gather_blocks(k_cache, meta.decode_block_tables_DB, dtype, ks)  # (D, T, K, Dh)
        v = _gather_blocks(v_cache, meta.decode_block_tables_DB, dtype, vs)
        bias = meta.decode_bias_DT
        if window is not None:
            bias = bias + _window_bias(meta.decode_ctx_D - 1, bias.shape[1], window, bias.dtype)
        out_NHD[:dec] = _grouped_sdpa(q_NHD[:dec].unsqueeze(1), k, v, bias.unsqueeze(1), scale, softcap).squeeze(1)
    for chunk in meta.prefills:
        k = _gather_blocks(k_cache, chunk.block_table_B, dtype, ks)[: chunk.context_len]  # (T, K, Dh)
        v = _gather_blocks(v_cache, chunk.block_table_B, dtype, vs)[: chunk.context_len]
        q = q_NHD[chunk.start : chunk.end].unsqueeze(0)  # (1, Q, H, Dh)
        bias = chunk.bias_GQT
        if window is not None:
            q_len = chunk.end - chunk.start
            query_pos = torch.arange(chunk.context_len - q_len, chunk.context_len, device=bias.device)
            groups = bias.shape[0] // q_len
            bias = bias + _window_bias(query_pos, chunk.context_len, window, bias.dtype).repeat(groups, 1)
        out_NHD[chunk.start : chunk.end] = _grouped_sdpa(
            q, k.unsqueeze(0), v.unsqueeze(0), bias.unsqueeze(0), scale, softcap
        ).squeeze(0)
    return out_NHD
