"""Block manager: which physical KV blocks each sequence owns. Plain Python, no torch.

A sequence's capacity grows in whole blocks as its token count grows; blocks are
reference counted so that later features (prefix caching, parallel samples) can share
them. Every mutation has a check twin (`can_allocate` / `allocate`, `can_append` /
`append`) and both go through `_blocks_needed`, so the check and the commit cannot drift.

Invariants (property-tested): a block is either free or referenced, never both; reference
counts are never negative; the free list plus the referenced blocks is every block; a
block appears in two live tables only when its reference count says it is shared.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    """Raised by a `do` call whose `can` twin would have said no (a scheduler bug)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._tables[seq_id])

    def num_tokens(self, seq_id: str) -> int:
        """Tokens the sequence has capacity for (reserved, not necessarily written)."""
        return self._num_tokens[seq_id]

    def slot(self, seq_id: str, position: int) -> int:
        """Physical slot (block * block_size + offset) of a token position."""
        table = self._tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def _blocks_needed(self, seq_id: str | None, total_tokens: int) -> int:
        have = len(self._tables[seq_id]) if seq_id is not None and seq_id in self._tables else 0
        return max(0, self.blocks_for_tokens(total_tokens) - have)

    # ------------------------------------------------------------------ check / do pairs

    def can_allocate(self, num_tokens: int) -> bool:
        return self._blocks_needed(None, num_tokens) <= len(self._free)

    def allocate(self, seq_id: str, num_tokens: int) -> None:
        """Create a table for a new sequence with capacity for `num_tokens` tokens."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        if not self.can_allocate(num_tokens):
            raise NoFreeBlocks(f"allocate({seq_id!r}, {num_tokens}) needs more than {len(self._free)} free blocks")
        self._tables[seq_id] = []
        self._num_tokens[seq_id] = 0
        self._grow(seq_id, num_tokens)

    def can_append(self, seq_id: str, num_new_tokens: int) -> bool:
        return self._blocks_needed(seq_id, self._num_tokens[seq_id] + num_new_tokens) <= len(self._free)

    def append(self, seq_id: str, num_new_tokens: int) -> None:
        """Extend a sequence's capacity by `num_new_tokens`, taking blocks as needed."""
        if not self.can_append(seq_id, num_new_tokens):
            raise NoFreeBlocks(f"append({seq_id!r}, {num_new_tokens}) needs more than {len(self._free)} free blocks")
        self._grow(seq_id, self._num_tokens[seq_id] + num_new_tokens)

    def free(self, seq_id: str) -> None:
        """Drop the sequence's references; blocks nobody references go back to the free list."""
        for block in self._tables.pop(seq_id):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free.append(block)
        del self._num_tokens[seq_id]

    # ------------------------------------------------------------------ internals

    def _grow(self, seq_id: str, total_tokens: int) -> None:
        table = self._tables[seq_id]
        for _ in range(self._blocks_needed(seq_id, total_tokens)):
            block = self._free.popleft()
            self.ref_counts[block] = 1
            table.append(block)
        self._num_tokens[seq_id] = max(self._num_tokens[seq_id], total_tokens)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        counts = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            assert len(table) == self.blocks_for_tokens(self._num_tokens[seq_id]), f"{seq_id}: table size"
            for block in table:
                counts[block] += 1
        for block in range(self.num_blocks):
            assert self.ref_counts[block] >= 0, f"block {block} has a negative ref count"
            assert self.ref_counts[block] == counts[block], f"block {block}: ref count {self.ref_counts[block]} != {counts[block]} tables"
            assert (block in free) == (counts[block] == 0), f"block {block} is free xor referenced violated"
