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
                    x_NKD: torch.Tensor, slots_N: torch.Tensor, kv_dtype: str) -> None:
    """Store this step's keys (or values) x into their slots of a quantised paged cache.

    cache: [blocks, block_size, K, D] in the storage dtype; scales: [blocks, K] fp32 running
    per-block scales (granularity=block) or None; static_scale: [K] (granularity=tensor)."""
    num_blocks, block_size, kv_heads, d = cache.shape
    flat = cache.view(num_blocks * block_size, kv_heads, d)
    if scales is None:
        raw(flat).index_copy_(0, slots_N, raw(quantize(x_NKD, static_scale[None, :, None], kv_dtype)))
        return
    q_max = FORMATS[kv_dtype][1]
    blocks_N = slots_N // block_size
    fresh = blocks_N[slots_N % block_size == 0]
    scales.index_fill_(0, fresh, 0.0)  # a block written from its first slot belongs to a new owner
    touched, inverse = blocks_N.unique(return_inverse=True)
    amax = torch.zeros((touched.shape[0], kv_heads), dtype=torch.float32, device=x_NKD.device)
    amax.scatter_reduce_(0, inverse[:, None].expand(-1, kv_heads), x_NKD.float().abs().amax(dim=-1), reduce="amax")
    old = scales.index_select(0, touched)  # (T, K)
    new = torch.maximum(old, amax / q_max)
    grown = ((new > old) & (old > 0)).any(dim=1)
    if grown.any():  # re-round what these blocks already hold to their larger scale
        rows = touched[grown]
        stored = raw(cache).index_select(0, rows).view(cache.dtype)  # (G, bs, K, D)
        values = dequantize(stored, old[grown][:, None, :, None], torch.float32)
        raw(cache).index_copy_(0, rows, raw(quantize(values, new[grown][:, None, :, None], kv_dtype)))
    scales.index_copy_(0, touched, new)
    raw(flat).index_copy_(0, slots_N, raw(quantize(x_NKD, new[inverse][:, :, None], kv_dtype)))


def read_blocks(cache: torch.Tensor, scales: torch.Tensor | None, static_scale: torch.Tensor | None,
                tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The listed blocks de-quantised: (..., B) -> (..., B, block_size, K, D) in `dtype`."""
    blocks = raw(cache).index_select(0, tables.reshape(-1)).view(cache.dtype)  # (B*, bs, K, D)
    scale = (scales.index_select(0, tables.reshape(-1))[:, None, :, None] if scales is not None
             else static_scale[None, None, :, None])
    return dequantize(blocks, scale, dtype).view(*tables.shape, *cache.shape[1:])
