"""The KV cache tensors: per layer, K and V blocks of shape [num_blocks, block_size, H_kv, D]."""

from __future__ import annotations

import torch


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        # zeros, not empty: a padded key slot must never hold NaN bit patterns (masked scores stay finite)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]

    @property
    def bytes_per_token(self) -> int:
        k, _ = self.layers[0]
        return 2 * len(self.layers) * k[0, 0].numel() * k.element_size()

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)
