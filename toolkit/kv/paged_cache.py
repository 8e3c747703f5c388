"""The KV cache tensors: per layer, K and V blocks of shape [num_blocks, block_size, H_kv, D]."""

from __future__ import annotations

import torch


class PagedKVCache:
    """Device blocks, plus a host pool of the same block shape for swapped-out sequences.

    On CUDA the host pool is pinned memory, so block copies can be asynchronous; on the CPU
    it is simply a second buffer.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, num_host_blocks: int = 0):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        # zeros, not empty: a padded key slot must never hold NaN bit patterns (masked scores stay finite)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        pin = torch.device(device).type == "cuda"
        host_shape = (num_host_blocks, block_size, num_kv_heads, head_dim)
        self.host_layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(host_shape, dtype=dtype, pin_memory=pin), torch.zeros(host_shape, dtype=dtype, pin_memory=pin))
            for _ in range(num_layers)
        ] if num_host_blocks else []

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Device block src[i] -> device block dst[i], every layer (copy-on-write)."""
        if not src:
            return
        s = torch.tensor(src, device=self.layers[0][0].device)
        d = torch.tensor(dst, device=self.layers[0][0].device)
        for k, v in self.layers:
            k.index_copy_(0, d, k.index_select(0, s))
            v.index_copy_(0, d, v.index_select(0, s))

    def swap_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        if not device_blocks:
            return
        dev = torch.tensor(device_blocks, device=self.layers[0][0].device)
        host = torch.tensor(host_blocks)
        for (k, v), (hk, hv) in zip(self.layers, self.host_layers):
            hk.index_copy_(0, host, k.index_select(0, dev).to("cpu"))
            hv.index_copy_(0, host, v.index_select(0, dev).to("cpu"))

    def swap_in(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        if not device_blocks:
            return
        dev = torch.tensor(device_blocks, device=self.layers[0][0].device)
        host = torch.tensor(host_blocks)
        for (k, v), (hk, hv) in zip(self.layers, self.host_layers):
            k.index_copy_(0, dev, hk.index_select(0, host).to(k.device, non_blocking=True))
            v.index_copy_(0, dev, hv.index_select(0, host).to(v.device, non_blocking=True))

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def bytes_per_token(self) -> int:
        k, _ = self.layers[0]
        return 2 * len(self.layers) * k[0, 0].numel() * k.element_size()

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)
