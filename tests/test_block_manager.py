"""Block manager invariants under random allocate / append / free sequences (hypothesis stateful)."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from toolkit.kv import BlockManager, NoFreeBlocks


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=24, block_size=4)
        self.tokens: dict[str, int] = {}  # model: capacity per live sequence
        self.counter = 0

    @rule(num_tokens=st.integers(0, 40))
    def allocate(self, num_tokens):
        seq = f"s{self.counter}"
        self.counter += 1
        expected_ok = -(-num_tokens // 4) <= self.bm.num_free_blocks
        assert self.bm.can_allocate(num_tokens) == expected_ok
        if expected_ok:
            self.bm.allocate(seq, num_tokens)
            self.tokens[seq] = num_tokens
        else:
            with pytest.raises(NoFreeBlocks):
                self.bm.allocate(seq, num_tokens)
            assert not self.bm.has(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(0, 20))
    def append(self, data, extra):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        free_before = self.bm.num_free_blocks
        if self.bm.can_append(seq, extra):
            self.bm.append(seq, extra)
            self.tokens[seq] += extra
        else:
            with pytest.raises(NoFreeBlocks):
                self.bm.append(seq, extra)
            assert self.bm.num_free_blocks == free_before  # a refused append changes nothing

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq)
        del self.tokens[seq]

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        for seq, n in self.tokens.items():
            table = self.bm.block_table(seq)
            assert len(table) == -(-n // 4)
        owned = [b for seq in self.tokens for b in self.bm.block_table(seq)]
        assert len(owned) == len(set(owned)), "a block is owned by two live sequences"
        assert self.bm.num_free_blocks + len(owned) == self.bm.num_blocks, "leaked blocks"


TestBlockManager = BlockManagerMachine.TestCase


def test_free_returns_every_block():
    bm = BlockManager(8, 4)
    bm.allocate("a", 9)
    bm.allocate("b", 3)
    assert bm.num_free_blocks == 4
    bm.append("b", 2)  # 5 tokens -> 2 blocks
    assert bm.block_table("b")[0] != bm.block_table("a")[0]
    assert bm.slot("a", 5) == bm.block_table("a")[1] * 4 + 1
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_check_invariants_catches_a_leak():
    """The invariant checker itself can fail: corrupt the state by hand."""
    bm = BlockManager(4, 4)
    bm.allocate("a", 4)
    bm.ref_counts[bm.block_table("a")[0]] = 0  # a referenced block whose count says free
    with pytest.raises(AssertionError):
        bm.check_invariants()
