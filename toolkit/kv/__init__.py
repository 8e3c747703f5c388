"""KV-cache memory: block bookkeeping (pure Python) and the cache tensors."""

from toolkit.kv.block_manager import BlockManager, NoFreeBlocks
from toolkit.kv.paged_cache import PagedKVCache

__all__ = ["BlockManager", "NoFreeBlocks", "PagedKVCache"]
