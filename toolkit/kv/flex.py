"""Paged attention through torch's FlexAttention (engine.attention_backend=flex).

As in flex-nano-vllm: the whole paged cache of a layer is one key axis of
num_blocks * block_size slots, the step's packed queries are one query axis, and a
BlockMask built from the block tables says which (query tile, cache block) pairs can
interact; inside a pair, `mask_mod` admits a slot when its block belongs to the query's
sequence (at logical position <= the query's) and, for sliding-window layers, lies within
the window. Prefill chunks get a causal document mask, decode rows a per-sequence mask, in
the same call; Gemma2's soft-capping is a `score_mod`. Shared prefix blocks (prefix caching)
work because the table maps (sequence, physical block) -> logical block, not block -> owner.

torch.compile fuses it into a block-sparse kernel (`engine.flex_compile=true`, the default);
uncompiled, torch evaluates it densely over every cache slot (tests, tiny caches). The query
axis is padded to a power of two so that a handful of compiled shapes serve every step
(torch 2.13's CPU inductor miscompiles the dynamic-shape version of this mask).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

Q_TILE = 16  # query rows per BlockMask tile


@dataclass(frozen=True)
class FlexMetadata:
    mask: object  # BlockMask for full-attention layers
    window_mask: object | None  # BlockMask for sliding-window layers (None: the model has none)
    compiled: bool
    num_rows: int  # the step's query rows; the query axis is padded to `padded_rows`
    padded_rows: int  # a power of two >= Q_TILE, so a compiled kernel serves many steps


def build(
    seq_tables: list[list[int]],
    rows_per_seq: list[int],
    positions_N: torch.Tensor,
    num_blocks: int,
    block_size: int,
    window: int | None,
    compiled: bool,
) -> FlexMetadata:
    """`seq_tables[s]` is sequence s's block table (covering its context), `rows_per_seq[s]` its
    query rows in the packed order, `positions_N` every row's position."""
    from torch.nn.attention.flex_attention import BlockMask  # deferred: only for flex attention

    rows = positions_N.shape[0]
    n = max(Q_TILE, 1 << (rows - 1).bit_length())  # padding rows belong to an extra sequence with no blocks
    num_seqs = len(seq_tables)
    q_seq = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(rows_per_seq))
    q_seq = torch.cat([q_seq, torch.full((n - rows,), num_seqs)])  # (n,)
    q_pos = torch.cat([positions_N.cpu(), torch.zeros(n - rows, dtype=torch.int64)])
    logical = torch.full((num_seqs + 1, num_blocks), -1, dtype=torch.int64)  # (S + 1, blocks): logical index or -1
    for s, table in enumerate(seq_tables):
        logical[s, torch.tensor(table, dtype=torch.int64)] = torch.arange(len(table))
    # the BlockMask: for each tile of Q_TILE query rows, the union of its sequences' blocks
    q_tiles = -(-n // Q_TILE)
    per_tile = []
    for t in range(q_tiles):
        seqs = q_seq[t * Q_TILE : (t + 1) * Q_TILE].unique().tolist()
        per_tile.append(sorted({b for s in seqs if s < num_seqs for b in seq_tables[s]}))
    kv_indices = torch.zeros((1, 1, q_tiles, num_blocks), dtype=torch.int32)  # flex wants a row per cache block
    for t, blocks in enumerate(per_tile):
        kv_indices[0, 0, t, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    kv_num = torch.tensor([[[len(b) for b in per_tile]]], dtype=torch.int32)
    device = positions_N.device
    logical, q_seq, q_pos = logical.to(device), q_seq.to(device), q_pos.to(device)

    def allowed(q_idx, kv_idx):
        block = logical[q_seq[q_idx], kv_idx // block_size]
        pos = block * block_size + kv_idx % block_size
        return (block >= 0) & (pos <= q_pos[q_idx]), pos

    def causal(b, h, q_idx, kv_idx):
        ok, _ = allowed(q_idx, kv_idx)
        return ok

    def sliding(b, h, q_idx, kv_idx):
        ok, pos = allowed(q_idx, kv_idx)
        return ok & (pos > q_pos[q_idx] - window)

    def mask_for(mod: Callable) -> object:
        return BlockMask.from_kv_blocks(
            kv_num.to(device),
            kv_indices.to(device),
            BLOCK_SIZE=(Q_TILE, block_size),
            mask_mod=mod,
            seq_lengths=(n, num_blocks * block_size),
        )

    return FlexMetadata(
        mask=mask_for(causal),
        window_mask=mask_for(sliding) if window else None,
        compiled=compiled,
        num_rows=rows,
        padded_rows=n,
    )


@lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention  # deferred: only for flex attention

    return torch.compile(flex_attention, dynamic=False)


def _softcap_mod(cap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return score_mod


def attention(
    q_NHD: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: FlexMetadata,
    scale: float,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:
    """(N, H, D) attention of the packed queries over the whole paged cache, masked per sequence."""
    from torch.nn.attention.flex_attention import flex_attention  # deferred: only for flex attention

    num_blocks, block_size, kv_heads, d = k_cache.shape
    slots = num_blocks * block_size
    k = k_cache.view(slots, kv_heads, d).transpose(0, 1).unsqueeze(0)  # (1, K, slots, D)
    v = v_cache.view(slots, kv_heads, d).transpose(0, 1).unsqueeze(0)
    q = F.pad(q_NHD, (0, 0, 0, 0, 0, meta.padded_rows - meta.num_rows)).transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
    fn = _compiled_flex() if meta.compiled else flex_attention
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = fn(
            q,
            k,
            v,
            score_mod=_softcap_mod(softcap) if softcap is not None else None,
            block_mask=meta.window_mask if window is not None else meta.mask,
            scale=scale,
            enable_gqa=kv_heads != q_NHD.shape[1],
        )
    return out[0, :, : meta.num_rows].transpose(0, 1)  # (N, H, D)
