"""Block manager: which KV blocks each sequence owns, on the device and in the host swap pool.

Plain Python, no torch. Every mutation has a check twin (`can_write` / `write`,
`can_swap_in` / `swap_in`, ...) computed by the same helper, so checking and committing
cannot drift apart. Mutations that need data moved return copy jobs (`BlockCopy`,
`SwapCopy`) for the model runner to execute before the step's forward.

- Blocks are reference counted. A block shared by two tables (prefix-cache hit, forked
  parallel sample) is copied before it is written (copy-on-write).
- Prefix caching: a full block is named by a hash chain over its tokens (sha256 of the
  parent's digest and the block's token ids); a new sequence reuses the cached blocks of
  its longest cached prefix. Freed cached blocks stay cached until the space is reused
  (least recently freed first).
- Swap: a preempted sequence's blocks can be copied to a host pool and back.

Invariants (property-tested): a device block is free xor referenced; reference counts
equal the number of tables holding the block and are never negative; a host block is
free xor held by exactly one swapped-out sequence; the hash maps are inverse of each other.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass


class NoFreeBlocks(RuntimeError):
    """Raised by a `do` call whose `can` twin would have said no (a scheduler bug)."""


@dataclass(frozen=True)
class BlockCopy:
    """Copy device block `src` into device block `dst` (copy-on-write)."""

    src: int
    dst: int


@dataclass(frozen=True)
class SwapCopy:
    """Copy between device block `device` and host block `host` (direction given by the call)."""

    device: int
    host: int


ROOT_DIGEST = b"toolkit-prefix-cache-v1"


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash-chain link of one full block: sha256(parent digest || token ids)."""
    h = hashlib.sha256(parent)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens))
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, num_host_blocks: int = 0):
        if num_blocks <= 0 or block_size <= 0 or num_host_blocks < 0:
            raise ValueError(f"bad block manager sizes: {num_blocks}, {block_size}, {num_host_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # oldest first
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}
        # prefix caching: digest <-> block, and each sequence's chain of full-block digests
        self._cached: dict[bytes, int] = {}
        self._block_digest: dict[int, bytes] = {}
        self._chains: dict[str, list[bytes]] = {}
        # swap pool
        self.num_host_blocks = num_host_blocks
        self._host_free: deque[int] = deque(range(num_host_blocks))
        self._host_tables: dict[str, list[int]] = {}
        self._host_num_tokens: dict[str, int] = {}
        # statistics
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which served from cache

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def is_swapped(self, seq_id: str) -> bool:
        return seq_id in self._host_tables

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._tables[seq_id])

    def table(self, seq_id: str) -> tuple[int, ...]:
        """The block table as a ScheduledChunk holds it."""
        return tuple(self._tables[seq_id])

    def num_tokens(self, seq_id: str) -> int:
        """Tokens the sequence has capacity for (reserved, not necessarily written)."""
        return self._num_tokens[seq_id]

    def slot(self, seq_id: str, position: int) -> int:
        """Physical slot (block * block_size + offset) of a token position."""
        table = self._tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # ------------------------------------------------------------------ writing tokens (grow + copy-on-write)

    def _write_plan(self, seq_id: str | None, start: int, end: int) -> tuple[int, list[int]]:
        """(new blocks to take to hold `end` tokens, indexes of shared blocks in [start, end) to copy): write() takes
        their sum, a bound where sequences sharing a block write beside each other (one's copy unshares it)."""
        table = self._tables.get(seq_id, []) if seq_id is not None else []
        grow = max(0, self.blocks_for_tokens(end) - len(table))
        if end <= start:
            return grow, []
        first, last = start // self.block_size, min(len(table), self.blocks_for_tokens(end))
        shared = [i for i in range(first, last) if self.ref_counts[table[i]] > 1]
        return grow, shared

    def can_write(self, seq_id: str, start: int, end: int) -> bool:
        return self.plan_write(seq_id, start, end) is not None

    def plan_write(self, seq_id: str, start: int, end: int) -> tuple[int, list[int]] | None:
        """The plan write() carries out where it fits (None: it does not), for a caller that writes with nothing
        changed between: one plan where can_write then write made two (a decode row's every step)."""
        grow, shared = planned = self._write_plan(seq_id, start, end)
        return planned if grow + len(shared) <= len(self._free) else None

    def write(self, seq_id: str, start: int, end: int, planned: tuple[int, list[int]] | None = None) -> list[BlockCopy]:
        """Make positions [start, end) writable by this sequence alone; returns the copy-on-write jobs. `planned`:
        plan_write's answer for the same arguments, nothing changed since."""
        grow, shared = self._write_plan(seq_id, start, end) if planned is None else planned
        if grow + len(shared) > len(self._free):
            raise NoFreeBlocks(f"write({seq_id!r}, {start}, {end}) needs {grow + len(shared)}, {len(self._free)} free")
        return self._apply(seq_id, end, grow, shared)

    def write_rows(self, writes: list[tuple[str, int, int]]) -> list[BlockCopy] | None:
        """write() of every (seq_id, start, end), where their plans' bound together fits the free blocks; None, and
        nothing written, where it does not. One plan a row (a decode step's lookahead); a row that shares a block is
        planned again when written, after the rows before it (their copies unshare blocks), as is a second row."""
        plans = [self._write_plan(*w) for w in writes]
        if sum(grow + len(shared) for grow, shared in plans) > len(self._free):
            return None
        copies: list[BlockCopy] = []
        written: set[str] = set()
        for (seq_id, start, end), (grow, shared) in zip(writes, plans):
            fresh = not shared and seq_id not in written
            copies += self._apply(seq_id, end, grow, []) if fresh else self.write(seq_id, start, end)
            written.add(seq_id)
        return copies

    def _apply(self, seq_id: str, end: int, grow: int, shared: list[int]) -> list[BlockCopy]:
        table = self._tables[seq_id]
        copies = []
        for i in shared:
            old, new = table[i], self._take()
            self.ref_counts[old] -= 1
            table[i] = new
            copies.append(BlockCopy(old, new))
        for _ in range(grow):
            table.append(self._take())
        self._num_tokens[seq_id] = max(self._num_tokens[seq_id], end)
        return copies

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Shrink capacity to `num_tokens` tokens, releasing whole blocks past it (rejected drafts)."""
        table = self._tables[seq_id]
        keep = self.blocks_for_tokens(num_tokens)
        while len(table) > keep:
            self._release(table.pop())
        self._num_tokens[seq_id] = min(self._num_tokens[seq_id], num_tokens)
        chain = self._chains[seq_id]
        del chain[num_tokens // self.block_size :]

    # compatibility pairs used by simple callers and tests
    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for_tokens(num_tokens) <= len(self._free)

    def allocate(self, seq_id: str, num_tokens: int) -> None:
        """Create a table for a new sequence with capacity for `num_tokens` tokens."""
        if seq_id in self._tables or seq_id in self._host_tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        if not self.can_allocate(num_tokens):
            raise NoFreeBlocks(f"allocate({seq_id!r}, {num_tokens}) needs more than {len(self._free)} free blocks")
        self._tables[seq_id] = []
        self._num_tokens[seq_id] = 0
        self._chains[seq_id] = []
        self.write(seq_id, 0, num_tokens)

    def can_append(self, seq_id: str, num_new_tokens: int) -> bool:
        n = self._num_tokens[seq_id]
        return self.can_write(seq_id, n, n + num_new_tokens)

    def append(self, seq_id: str, num_new_tokens: int) -> list[BlockCopy]:
        n = self._num_tokens[seq_id]
        return self.write(seq_id, n, n + num_new_tokens)

    # ------------------------------------------------------------------ prefix caching

    def cached_prefix(self, token_ids: Sequence[int], max_blocks: int) -> list[int]:
        """Blocks that already hold the longest cached prefix of `token_ids` (at most max_blocks)."""
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], ROOT_DIGEST
        bs = self.block_size
        for i in range(min(max_blocks, len(token_ids) // bs)):
            parent = block_digest(parent, token_ids[i * bs : (i + 1) * bs])
            block = self._cached.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_prefix(self, seq_id: str, token_ids: Sequence[int], max_cached_tokens: int) -> int:
        """Create the table of a new sequence from its cached prefix (never the whole of `max_cached_tokens`
        rounded up): returns how many tokens are already computed."""
        if seq_id in self._tables or seq_id in self._host_tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        hits = self.cached_prefix(token_ids, max_cached_tokens // self.block_size)
        if self.enable_prefix_caching:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += len(hits) * self.block_size
        for block in hits:
            if self.ref_counts[block] == 0:
                del self._free[block]  # revive an evictable cached block
            self.ref_counts[block] += 1
        self._tables[seq_id] = list(hits)
        self._num_tokens[seq_id] = len(hits) * self.block_size
        self._chains[seq_id] = [self._block_digest[b] for b in hits]
        return len(hits) * self.block_size

    def commit_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Name the sequence's blocks that became full of computed tokens, so later requests can reuse them."""
        if not self.enable_prefix_caching or seq_id not in self._tables:
            return
        chain, table, bs = self._chains[seq_id], self._tables[seq_id], self.block_size
        for i in range(len(chain), min(num_computed // bs, len(table))):
            digest = block_digest(chain[-1] if chain else ROOT_DIGEST, token_ids[i * bs : (i + 1) * bs])
            chain.append(digest)
            block = table[i]
            if digest not in self._cached and block not in self._block_digest:
                self._cached[digest] = block
                self._block_digest[block] = digest

    # ------------------------------------------------------------------ sharing and freeing

    def fork(self, parent: str, child: str) -> None:
        """The child sequence shares every block of the parent (copy-on-write on the next write)."""
        if child in self._tables:
            raise ValueError(f"sequence {child!r} already has blocks")
        table = self._tables[parent]
        for block in table:
            self.ref_counts[block] += 1
        self._tables[child] = list(table)
        self._num_tokens[child] = self._num_tokens[parent]
        self._chains[child] = list(self._chains[parent])

    def free(self, seq_id: str) -> None:
        """Drop the sequence's blocks (device or host); blocks nobody references become free."""
        if seq_id in self._host_tables:
            self._host_free.extend(self._host_tables.pop(seq_id))
            del self._host_num_tokens[seq_id]
        if seq_id in self._tables:
            for block in self._tables.pop(seq_id):
                self._release(block)
            del self._num_tokens[seq_id]
            del self._chains[seq_id]

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None  # most recently freed: evicted last

    def _take(self) -> int:
        block, _ = self._free.popitem(last=False)
        digest = self._block_digest.pop(block, None)
        if digest is not None:  # evict its cached content
            del self._cached[digest]
        self.ref_counts[block] = 1
        return block

    # ------------------------------------------------------------------ swap

    def can_swap_out(self, seq_id: str) -> bool:
        return len(self._tables[seq_id]) <= len(self._host_free)

    def swap_out(self, seq_id: str) -> list[SwapCopy]:
        """Copy the sequence's blocks to the host pool and release them on the device."""
        if not self.can_swap_out(seq_id):
            raise NoFreeBlocks(f"swap_out({seq_id!r}): host pool has {len(self._host_free)} free blocks")
        table = self._tables.pop(seq_id)
        host = [self._host_free.popleft() for _ in table]
        self._host_tables[seq_id] = host
        self._host_num_tokens[seq_id] = self._num_tokens.pop(seq_id)
        del self._chains[seq_id]
        for block in table:
            self._release(block)
        return [SwapCopy(d, h) for d, h in zip(table, host)]

    def can_swap_in(self, seq_id: str) -> bool:
        return len(self._host_tables[seq_id]) <= len(self._free)

    def swap_in(self, seq_id: str) -> list[SwapCopy]:
        """Bring a swapped-out sequence back into fresh device blocks."""
        if not self.can_swap_in(seq_id):
            raise NoFreeBlocks(f"swap_in({seq_id!r}): {len(self._free)} free device blocks")
        host = self._host_tables.pop(seq_id)
        table = [self._take() for _ in host]
        self._tables[seq_id] = table
        self._num_tokens[seq_id] = self._host_num_tokens.pop(seq_id)
        self._chains[seq_id] = []
        self._host_free.extend(host)
        return [SwapCopy(d, h) for d, h in zip(table, host)]

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        counts = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            assert len(table) == self.blocks_for_tokens(self._num_tokens[seq_id]), f"{seq_id}: table size"
            for block in table:
                counts[block] += 1
        for block in range(self.num_blocks):
            assert self.ref_counts[block] >= 0, f"block {block} has a negative ref count"
            assert self.ref_counts[block] == counts[block], (
                f"block {block}: ref count {self.ref_counts[block]} != {counts[block]} tables"
            )
            assert (block in self._free) == (counts[block] == 0), f"block {block}: free xor referenced violated"
        assert len(self._free) + sum(c > 0 for c in counts) == self.num_blocks, "leaked blocks"
        host_owned = [h for table in self._host_tables.values() for h in table]
        assert len(host_owned) == len(set(host_owned)), "a host block is held by two swapped-out sequences"
        assert not set(host_owned) & set(self._host_free), "a host block is free and held"
        assert len(host_owned) + len(self._host_free) == self.num_host_blocks, "leaked host blocks"
        assert not set(self._tables) & set(self._host_tables), "a sequence is both resident and swapped out"
        for digest, block in self._cached.items():
            assert self._block_digest.get(block) == digest, "prefix cache maps are not inverse"
        assert len(self._cached) == len(self._block_digest)
