"""The KV cache tensors: per layer, K and V blocks of shape [num_blocks, block_size, H_kv, D].

`kv_dtype` picks the storage: `auto` (the model dtype), `bf16`, or the quantised `int8` and
`fp8_e4m3` (toolkit/kv/quant.py), whose scales live here too: per block and KV head
([num_blocks, H_kv] per layer, moved with their blocks by copy-on-write and swap), per block,
KV head and channel for keys with per-token value ranges (`granularity="channel"`: (lo, hi) pairs,
[num_blocks, H_kv, D, 2] and [num_blocks, block_size, H_kv, 2], moved the same way) or one static scale per layer and
KV head (`granularity="tensor"`, set by `calibrate`).
"""

from __future__ import annotations

import math

import torch

from toolkit.kv.attention import KVQuant
from toolkit.kv.quant import is_quantized, raw, storage_dtype

# a block's key and value scale shapes (after the block axis), by granularity
SCALE_SHAPES = {
    "block": lambda block_size, kv_heads, head_dim: ((kv_heads,), (kv_heads,)),
    "channel": lambda block_size, kv_heads, head_dim: ((kv_heads, head_dim, 2), (block_size, kv_heads, 2)),
}


class PagedKVCache:
    """Device blocks, plus a host pool of the same block shape for swapped-out sequences.

    On CUDA the host pool is pinned memory, so block copies can be asynchronous; on the CPU
    it is simply a second buffer.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_host_blocks: int = 0,
        kv_dtype: str = "auto",
        granularity: str = "block",
    ):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.kv_dtype = kv_dtype
        self.granularity = granularity if is_quantized(kv_dtype) else None
        store = storage_dtype(kv_dtype, dtype)
        # zeros, not empty: a padded key slot must never hold NaN bit patterns (masked scores stay finite)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=store, device=device), torch.zeros(shape, dtype=store, device=device))
            for _ in range(num_layers)
        ]
        pin = torch.device(device).type == "cuda"
        host_shape = (num_host_blocks, block_size, num_kv_heads, head_dim)
        self.host_layers: list[tuple[torch.Tensor, torch.Tensor]] = (
            [
                (
                    torch.zeros(host_shape, dtype=store, pin_memory=pin),
                    torch.zeros(host_shape, dtype=store, pin_memory=pin),
                )
                for _ in range(num_layers)
            ]
            if num_host_blocks
            else []
        )
        self.block_scales = self.host_block_scales = self.tensor_scales = None
        if self.granularity in ("block", "channel"):
            k_shape, v_shape = SCALE_SHAPES[self.granularity](block_size, num_kv_heads, head_dim)

            def scales(n: int, dev) -> list[tuple[torch.Tensor, torch.Tensor]]:
                return [
                    (torch.zeros((n, *k_shape), device=dev), torch.zeros((n, *v_shape), device=dev))
                    for _ in range(num_layers)
                ]

            self.block_scales = scales(num_blocks, device)
            self.host_block_scales = scales(num_host_blocks, "cpu") if num_host_blocks else []
        elif self.granularity == "tensor":
            self.tensor_scales = [
                (torch.ones(num_kv_heads, device=device), torch.ones(num_kv_heads, device=device))
                for _ in range(num_layers)
            ]

    @property
    def quant(self) -> KVQuant | None:
        """What attention needs to write and read a quantised cache (None: plain storage)."""
        if self.granularity is None:
            return None
        return KVQuant(self.kv_dtype, self.block_scales, self.tensor_scales, self.granularity)

    def _device_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by device block: K, V (as bytes for fp8) and their per-block scales."""
        out = [raw(t) for kv in self.layers for t in kv]
        return out + ([t for s in self.block_scales for t in s] if self.block_scales else [])

    def _host_tensors(self) -> list[torch.Tensor]:
        out = [raw(t) for kv in self.host_layers for t in kv]
        return out + ([t for s in self.host_block_scales for t in s] if self.host_block_scales else [])

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Device block src[i] -> device block dst[i], every layer (copy-on-write)."""
        if not src:
            return
        s = torch.tensor(src, device=self.layers[0][0].device)
        d = torch.tensor(dst, device=self.layers[0][0].device)
        for t in self._device_tensors():
            t.index_copy_(0, d, t.index_select(0, s))

    def swap_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        if not device_blocks:
            return
        dev = torch.tensor(device_blocks, device=self.layers[0][0].device)
        host = torch.tensor(host_blocks)
        for t, h in zip(self._device_tensors(), self._host_tensors()):
            h.index_copy_(0, host, t.index_select(0, dev).to("cpu"))

    def swap_in(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        if not device_blocks:
            return
        dev = torch.tensor(device_blocks, device=self.layers[0][0].device)
        host = torch.tensor(host_blocks)
        for t, h in zip(self._device_tensors(), self._host_tensors()):
            t.index_copy_(0, dev, h.index_select(0, host).to(t.device, non_blocking=True))

    def calibrate(self, keys_values: list[tuple[torch.Tensor, torch.Tensor]], q_max: float) -> None:
        """Set the static per-tensor scales from calibration keys and values ((T, K, D) per layer)."""
        for (ks, vs), (k, v) in zip(self.tensor_scales, keys_values):
            ks.copy_((k.float().abs().amax(dim=(0, 2)) / q_max).clamp_min(1e-8))
            vs.copy_((v.float().abs().amax(dim=(0, 2)) / q_max).clamp_min(1e-8))

    @staticmethod
    def block_bytes(
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_dtype: str = "auto",
        granularity: str = "block",
    ) -> int:
        """Bytes one block takes over all layers (K, V and per-block fp32 scales), before any is allocated."""
        element = torch.empty((), dtype=storage_dtype(kv_dtype, dtype)).element_size()
        scales = 0
        if is_quantized(kv_dtype) and granularity in SCALE_SHAPES:
            k_shape, v_shape = SCALE_SHAPES[granularity](block_size, num_kv_heads, head_dim)
            scales = num_layers * 4 * (math.prod(k_shape) + math.prod(v_shape))
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element + scales

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size + self.scale_bytes_per_block

    @property
    def scale_bytes_per_block(self) -> int:
        if not self.block_scales:
            return 0
        return sum(t[0].nbytes for kv in self.block_scales for t in kv)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V one token takes in the cache (scales excluded: see bytes_per_block)."""
        k, _ = self.layers[0]
        return 2 * len(self.layers) * k[0, 0].numel() * k.element_size()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._device_tensors())  # byte views: the same sizes
