"""KV-cache quantisation: int8 and fp8 (e4m3) storage with scales per block and KV head.

The scheme of the serving chapter ("KV Cache Quantization"): a block b of one KV head is
stored as round(K_b / s_b) with s_b = max|K_b| / q_max, and read back as s_b * K_hat_b.

Blocks fill token by token, so a block's scale is the running max of what has been written
into it: when a new token is larger than the block's range, the block's scale grows and the
values already stored are re-rounded to the new scale (a deterministic function of the
writes, so a replay under the same schedule reproduces every bit). A block's scale restarts
when its first slot is written, i.e. when it is handed to a new sequence.

`granularity="tensor"` uses one static scale per layer and KV head instead, calibrated once
from the model's own keys and values on a fixed text (vLLM's per-tensor scales are static
too: a scale that followed the traffic would let one request change another's outputs);
values beyond its range saturate.

`granularity="channel"` (KIVI / KVQuant): keys get a running scale per block, KV head and channel
(a key's outliers sit in a few channels, which one scale per block and head spreads over all of
them), re-rounded as the block scales are; values get a scale per token and KV head, set when the
token is written (nothing to re-round).
"""

from __future__ import annotations

import torch

FORMATS = {"int8": (torch.int8, 127.0), "fp8_e4m3": (torch.float8_e4m3fn, 448.0)}


def raw(t: torch.Tensor) -> torch.Tensor:
    """A byte view for indexing: torch's CPU index_copy_ / index_select have no float8 kernels."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def is_quantized(kv_dtype: str) -> bool:
    return kv_dtype in FORMATS


def storage_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_dtype in FORMATS:
        return FORMATS[kv_dtype][0]
    return torch.bfloat16 if kv_dtype == "bf16" else model_dtype


def quantize(x: torch.Tensor, scale: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """x / scale in the storage format (scale broadcasts against x; a zero scale stores zeros)."""
    dtype, q_max = FORMATS[kv_dtype]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (x.float() / safe).clamp(-q_max, q_max)
    if dtype == torch.int8:
        y = y.round()
    return y.to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def absmax_scale(x: torch.Tensor, kv_dtype: str, dims: tuple[int, ...]) -> torch.Tensor:
    """max |x| / q_max over `dims` (kept), the scale that maps x onto the format's range."""
    return x.float().abs().amax(dim=dims, keepdim=True) / FORMATS[kv_dtype][1]


def write_quantized(cache: torch.Tensor, scales: torch.Tensor | None, static_scale: torch.Tensor | None,
                    per_token: bool, x_NKD: torch.Tensor, slots_N: torch.Tensor, kv_dtype: str) -> None:
    """Store this step's keys (or values) x into their slots of a quantised paged cache.

    cache: [blocks, block_size, K, D] in the storage dtype; scales: fp32 running per-block scales,
    [blocks, K] (granularity=block) or [blocks, K, D] (channel keys), or per-token scales [blocks,
    block_size, K] (`per_token`: channel values), or None; static_scale: [K] (granularity=tensor)."""
    num_blocks, block_size, kv_heads, d = cache.shape
    flat = cache.view(num_blocks * block_size, kv_heads, d)
    if scales is None:
        raw(flat).index_copy_(0, slots_N, raw(quantize(x_NKD, static_scale[None, :, None], kv_dtype)))
        return
    q_max = FORMATS[kv_dtype][1]
    if per_token:
        token_scale = x_NKD.float().abs().amax(dim=-1) / q_max  # (N, K)
        scales.view(num_blocks * block_size, kv_heads).index_copy_(0, slots_N, token_scale)
        raw(flat).index_copy_(0, slots_N, raw(quantize(x_NKD, token_scale[:, :, None], kv_dtype)))
        return
    blocks_N = slots_N // block_size
    fresh = blocks_N[slots_N % block_size == 0]
    scales.index_fill_(0, fresh, 0.0)  # a block written from its first slot belongs to a new owner
    touched, inverse = blocks_N.unique(return_inverse=True)
    per_slot = x_NKD.float().abs()
    if scales.dim() == 2:  # one scale per block and head: the max over the head's channels
        per_slot = per_slot.amax(dim=-1)
    amax = torch.zeros((touched.shape[0], *per_slot.shape[1:]), dtype=torch.float32, device=x_NKD.device)
    amax.scatter_reduce_(0, inverse.view(-1, *[1] * (per_slot.dim() - 1)).expand_as(per_slot), per_slot,
                         reduce="amax")
    old = scales.index_select(0, touched)  # (T, K) or (T, K, D)
    new = torch.maximum(old, amax / q_max)
    grown = ((new > old) & (old > 0)).flatten(1).any(dim=1)
    if grown.any():  # re-round what these blocks already hold to their larger scale
        rows = touched[grown]
        stored = raw(cache).index_select(0, rows).view(cache.dtype)  # (G, bs, K, D)
        values = dequantize(stored, _over_channels(old[grown])[:, None], torch.float32)
        raw(cache).index_copy_(0, rows, raw(quantize(values, _over_channels(new[grown])[:, None], kv_dtype)))
    scales.index_copy_(0, touched, new)
    raw(flat).index_copy_(0, slots_N, raw(quantize(x_NKD, _over_channels(new[inverse]), kv_dtype)))


def _over_channels(block_scale: torch.Tensor) -> torch.Tensor:
    """Per-block scales (T, K) or (T, K, D) as (T, K, 1) or (T, K, D): broadcast over a head's channels."""
    return block_scale[..., None] if block_scale.dim() == 2 else block_scale


def read_blocks(cache: torch.Tensor, scales: torch.Tensor | None, static_scale: torch.Tensor | None,
                per_token: bool, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The listed blocks de-quantised: (..., B) -> (..., B, block_size, K, D) in `dtype`."""
    blocks = raw(cache).index_select(0, tables.reshape(-1)).view(cache.dtype)  # (B*, bs, K, D)
    if scales is None:
        scale = static_scale[None, None, :, None]
    elif per_token:
        scale = scales.index_select(0, tables.reshape(-1))[..., None]  # (B*, bs, K, 1)
    else:
        scale = _over_channels(scales.index_select(0, tables.reshape(-1)))[:, None]
    return dequantize(blocks, scale, dtype).view(*tables.shape, *cache.shape[1:])
