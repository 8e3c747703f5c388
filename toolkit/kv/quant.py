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

`granularity="channel"` (KIVI / KVQuant): keys get a running range per block, KV head and channel
(a key's outliers sit in a few channels, which one scale per block and head spreads over all of
them), values a range per token and KV head, set when the token is written. A range [lo, hi] is
stored as its own two fp32 ends, and x as round((x - centre) / step) with centre (lo + hi) / 2 and
step (hi - lo) / (2 q_max): asymmetric, as KIVI's, so a channel whose keys sit away from zero within a
block (a low-frequency RoPE channel often does) spends the whole int8 range on the values it holds, and
the range's ends come back exact. A key range that grows re-rounds what the block holds, as the
block scales do.
"""

from __future__ import annotations

import torch

FORMATS = {"int8": (torch.int8, 127.0), "fp8_e4m3": (torch.float8_e4m3fn, 448.0)}
Q_MAX = dict(FORMATS.values())  # storage dtype -> its largest stored unit


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


def write_quantized(
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    static_scale: torch.Tensor | None,
    per_token: bool,
    x_NKD: torch.Tensor,
    slots_N: torch.Tensor,
    kv_dtype: str,
) -> None:
    """Store this step's keys (or values) x into their slots of a quantised paged cache.

    cache: [blocks, block_size, K, D] in the storage dtype; scales: fp32 running per-block scales
    [blocks, K] (granularity=block), channel ranges [blocks, K, D, 2] (lo, hi: channel keys) or
    per-token ranges [blocks, block_size, K, 2] (`per_token`: channel values), or None;
    static_scale: [K] (granularity=tensor)."""
    num_blocks, block_size, kv_heads, d = cache.shape
    flat = cache.view(num_blocks * block_size, kv_heads, d)
    if scales is None:
        raw(flat).index_copy_(0, slots_N, raw(quantize(x_NKD, static_scale[None, :, None], kv_dtype)))
        return
    if per_token:
        x = x_NKD.float()
        ranges = torch.stack((x.amin(dim=-1), x.amax(dim=-1)), dim=-1)  # (N, K, 2)
        scales.view(num_blocks * block_size, kv_heads, 2).index_copy_(0, slots_N, ranges)
        raw(flat).index_copy_(0, slots_N, raw(quantize_ranged(x, ranges[:, :, None], kv_dtype)))
        return
    blocks_N = slots_N // block_size
    touched, inverse = blocks_N.unique(return_inverse=True)
    if scales.dim() == 2:
        _write_block_scaled(cache, scales, x_NKD, slots_N, blocks_N, touched, inverse, kv_dtype)
        return
    # channel keys: each touched block's (lo, hi) per head and channel widens to this step's keys
    x = x_NKD.float()
    index = inverse.view(-1, 1, 1).expand_as(x)
    lo = torch.full((touched.shape[0], kv_heads, d), torch.inf, device=x.device).scatter_reduce_(0, index, x, "amin")
    hi = torch.full_like(lo, -torch.inf).scatter_reduce_(0, index, x, "amax")
    old = scales.index_select(0, touched)  # (T, K, D, 2)
    # a block written from its first slot belongs to a new owner: its old range is empty
    held = torch.ones(touched.shape[0], dtype=torch.bool, device=x.device)  # the block's old range still holds
    held[inverse[slots_N % block_size == 0]] = False
    keep = held.view(-1, 1, 1)
    new = torch.stack(
        (torch.where(keep, torch.minimum(old[..., 0], lo), lo), torch.where(keep, torch.maximum(old[..., 1], hi), hi)),
        dim=-1,
    )
    grown = held & (new != old).flatten(1).any(dim=1)
    if grown.any():  # re-round what these blocks already hold to their wider range
        rows = touched[grown]
        stored = raw(cache).index_select(0, rows).view(cache.dtype)  # (G, bs, K, D)
        values = dequantize_ranged(stored, old[grown][:, None], torch.float32)
        raw(cache).index_copy_(0, rows, raw(quantize_ranged(values, new[grown][:, None], kv_dtype)))
    scales.index_copy_(0, touched, new)
    raw(flat).index_copy_(0, slots_N, raw(quantize_ranged(x, new[inverse], kv_dtype)))


def _write_block_scaled(
    cache: torch.Tensor,
    scales: torch.Tensor,
    x_NKD: torch.Tensor,
    slots_N: torch.Tensor,
    blocks_N: torch.Tensor,
    touched: torch.Tensor,
    inverse: torch.Tensor,
    kv_dtype: str,
) -> None:
    """granularity=block: one running symmetric scale per block and KV head, the max over the head's channels."""
    num_blocks, block_size, kv_heads, d = cache.shape
    scales.index_fill_(0, blocks_N[slots_N % block_size == 0], 0.0)  # a block written from its first slot: new owner
    per_slot = x_NKD.float().abs().amax(dim=-1)  # (N, K)
    amax = torch.zeros((touched.shape[0], kv_heads), dtype=torch.float32, device=x_NKD.device)
    amax.scatter_reduce_(0, inverse.view(-1, 1).expand_as(per_slot), per_slot, reduce="amax")
    old = scales.index_select(0, touched)  # (T, K)
    new = torch.maximum(old, amax / FORMATS[kv_dtype][1])
    grown = ((new > old) & (old > 0)).any(dim=1)
    if grown.any():  # re-round what these blocks already hold to their larger scale
        rows = touched[grown]
        stored = raw(cache).index_select(0, rows).view(cache.dtype)  # (G, bs, K, D)
        values = dequantize(stored, old[grown][:, None, :, None], torch.float32)
        raw(cache).index_copy_(0, rows, raw(quantize(values, new[grown][:, None, :, None], kv_dtype)))
    scales.index_copy_(0, touched, new)
    raw(cache.view(num_blocks * block_size, kv_heads, d)).index_copy_(
        0, slots_N, raw(quantize(x_NKD, new[inverse][..., None], kv_dtype))
    )


def _centre_step(ranges: torch.Tensor, q_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) on the last axis -> the centre and the step of one storage unit."""
    lo, hi = ranges.unbind(-1)
    return (lo + hi) / 2, (hi - lo) / (2 * q_max)


def quantize_ranged(x: torch.Tensor, ranges: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """x in its range (lo, hi on the last axis of `ranges`, which broadcasts against x) as storage units."""
    centre, step = _centre_step(ranges, FORMATS[kv_dtype][1])
    return quantize(x.float() - centre, step, kv_dtype)


def dequantize_ranged(q: torch.Tensor, ranges: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    centre, step = _centre_step(ranges, Q_MAX[q.dtype])
    return (q.float() * step + centre).to(dtype)


def read_blocks(
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    static_scale: torch.Tensor | None,
    per_token: bool,
    tables: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The listed blocks de-quantised: (..., B) -> (..., B, block_size, K, D) in `dtype`."""
    blocks = raw(cache).index_select(0, tables.reshape(-1)).view(cache.dtype)  # (B*, bs, K, D)
    if scales is None:
        out = dequantize(blocks, static_scale[None, None, :, None], dtype)
    elif per_token:
        out = dequantize_ranged(blocks, scales.index_select(0, tables.reshape(-1))[..., None, :], dtype)
    elif scales.dim() == 2:
        out = dequantize(blocks, scales.index_select(0, tables.reshape(-1))[:, None, :, None], dtype)
    else:  # channel keys: (B*, K, D, 2) ranges over the block's tokens
        out = dequantize_ranged(blocks, scales.index_select(0, tables.reshape(-1))[:, None], dtype)
    return out.view(*tables.shape, *cache.shape[1:])
