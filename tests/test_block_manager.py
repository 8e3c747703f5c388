"""Block manager invariants under random allocate / write / fork / copy-on-write / prefix / swap / free
sequences (a hypothesis state machine)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from toolkit.kv import BlockManager, NoFreeBlocks

BS = 4


class BlockManagerMachine(RuleBasedStateMachine):
    """A model of each live sequence's tokens, checked against the manager after every rule."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=24, block_size=BS, enable_prefix_caching=True, num_host_blocks=12)
        self.tokens: dict[str, list[int]] = {}  # resident sequences: their token ids (all "computed")
        self.swapped: dict[str, list[int]] = {}
        self.counter = 0

    def _new_id(self) -> str:
        self.counter += 1
        return f"s{self.counter}"

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=30))
    def allocate_with_prefix(self, tokens):
        """A new sequence reuses its cached prefix, then writes the rest (small alphabet: many hits)."""
        seq = self._new_id()
        hits = self.bm.cached_prefix(tokens, (len(tokens) - 1) // BS)
        revive = sum(self.bm.ref_counts[b] == 0 for b in hits)
        needed = -(-len(tokens) // BS) - len(hits)
        if needed + revive > self.bm.num_free_blocks:
            return
        cached = self.bm.allocate_prefix(seq, tokens, len(tokens) - 1)
        assert cached == len(hits) * BS and cached < len(tokens)
        self.bm.write(seq, cached, len(tokens))
        self.bm.commit_full_blocks(seq, tokens, len(tokens))
        self.tokens[seq] = list(tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), min_size=1, max_size=9))
    def write(self, data, extra):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        start, end = len(self.tokens[seq]), len(self.tokens[seq]) + len(extra)
        free_before = self.bm.num_free_blocks
        table_before = self.bm.block_table(seq)
        if self.bm.can_write(seq, start, end):
            copies = self.bm.write(seq, start, end)
            table = self.bm.block_table(seq)
            for c in copies:  # copy-on-write replaced a shared block by a private one
                assert c.src in table_before and c.dst in table and c.src not in table
                assert self.bm.ref_counts[c.dst] == 1
            self.tokens[seq] += extra
            self.bm.commit_full_blocks(seq, self.tokens[seq], end)
        else:
            with pytest.raises(NoFreeBlocks):
                self.bm.write(seq, start, end)
            assert self.bm.num_free_blocks == free_before  # a refused write changes nothing
        # the block being written is private now (or the write was refused)
        if self.bm.has(seq) and len(self.tokens[seq]) == end:
            last = self.bm.block_table(seq)[(end - 1) // BS]
            assert self.bm.ref_counts[last] == 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_id()
        self.bm.fork(parent, child)
        assert self.bm.block_table(child) == self.bm.block_table(parent)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq)
        del self.tokens[seq]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if not self.bm.can_swap_out(seq):
            return
        table = self.bm.block_table(seq)
        copies = self.bm.swap_out(seq)
        assert [c.device for c in copies] == table and not self.bm.has(seq) and self.bm.is_swapped(seq)
        self.swapped[seq] = self.tokens.pop(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq = data.draw(st.sampled_from(sorted(self.swapped)))
        if not self.bm.can_swap_in(seq):
            with pytest.raises(NoFreeBlocks):
                self.bm.swap_in(seq)
            return
        copies = self.bm.swap_in(seq)
        assert [c.device for c in copies] == self.bm.block_table(seq)
        assert all(self.bm.ref_counts[c.device] == 1 for c in copies)
        self.tokens[seq] = self.swapped.pop(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def free_swapped(self, data):
        seq = data.draw(st.sampled_from(sorted(self.swapped)))
        self.bm.free(seq)
        del self.swapped[seq]

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        for seq, toks in self.tokens.items():
            assert len(self.bm.block_table(seq)) == -(-len(toks) // BS)
        # a block shared by live tables has exactly that many references
        owners: dict[int, int] = {}
        for seq in self.tokens:
            for b in self.bm.block_table(seq):
                owners[b] = owners.get(b, 0) + 1
        assert all(self.bm.ref_counts[b] == n for b, n in owners.items())
        # swapped-out sequences own no device block: nobody can read their data through a table
        for seq in self.swapped:
            assert not self.bm.has(seq) and self.bm.is_swapped(seq)

    def teardown(self):
        for seq in list(self.tokens) + list(self.swapped):
            self.bm.free(seq)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks, "blocks leaked after every sequence finished"
        assert self.bm.num_free_host_blocks == self.bm.num_host_blocks


TestBlockManager = BlockManagerMachine.TestCase


def test_prefix_hits_and_eviction():
    bm = BlockManager(6, 4, enable_prefix_caching=True)
    prompt = list(range(10))  # two full blocks + 2 tokens
    assert bm.allocate_prefix("a", prompt, 9) == 0
    bm.write("a", 0, 10)
    bm.commit_full_blocks("a", prompt, 10)
    assert bm.num_cached_blocks == 2
    assert bm.allocate_prefix("b", prompt + [99], 10) == 8  # both full blocks reused
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 2  # freed but still cached
    assert bm.allocate_prefix("c", prompt, 9) == 8  # revived from the free list
    bm.free("c")
    bm.allocate("d", 24)  # takes every block: cached content is evicted
    assert bm.num_cached_blocks == 0
    bm.check_invariants()


def test_fork_then_write_copies_the_shared_block():
    bm = BlockManager(8, 4)
    bm.allocate("p", 6)
    bm.fork("p", "c")
    copies = bm.write("c", 6, 7)  # position 6 lies in the shared second block
    assert len(copies) == 1 and copies[0].src == bm.block_table("p")[1] and copies[0].dst == bm.block_table("c")[1]
    assert bm.block_table("c")[0] == bm.block_table("p")[0]  # the untouched first block stays shared
    assert bm.write("p", 6, 7) == []  # the parent's block is private again
    bm.check_invariants()


def test_check_invariants_catches_a_leak():
    """The invariant checker itself can fail: corrupt the state by hand."""
    bm = BlockManager(4, 4)
    bm.allocate("a", 4)
    bm.ref_counts[bm.block_table("a")[0]] = 0  # a referenced block whose count says free
    with pytest.raises(AssertionError):
        bm.check_invariants()


def _with_forks(lengths: list[int], forks: list[int], free_blocks: int) -> BlockManager:
    """Sequences s0, s1, ... of `lengths` tokens, f0, f1, ... forked from the s of each index in `forks` (past the
    last: none), and `free_blocks` more."""
    bm = BlockManager(num_blocks=sum(-(-n // BS) for n in lengths) + free_blocks, block_size=BS)
    for i, n in enumerate(lengths):
        bm.allocate(f"s{i}", n)
    for j, parent in enumerate(forks):
        if parent < len(lengths):
            bm.fork(f"s{parent}", f"f{j}")
    return bm


def _state(bm: BlockManager) -> tuple:
    return bm._tables, bm.ref_counts, bm._free, bm._num_tokens


@settings(max_examples=150, deadline=None)
@example(lengths=[4], forks=[], free_blocks=4, steps=[1], again=0)  # a sequence written twice, growing each time
@example(lengths=[6, 3], forks=[0, 0], free_blocks=3, steps=[1], again=9)  # forks sharing a block, each copying
@given(
    lengths=st.lists(st.integers(1, 14), min_size=1, max_size=5),
    forks=st.lists(st.integers(0, 4), max_size=4),
    free_blocks=st.integers(0, 6),
    steps=st.lists(st.integers(1, 2), min_size=1, max_size=4),
    again=st.integers(0, 9),
)
def test_a_decode_steps_writes_at_once_are_the_writes_one_by_one(lengths, forks, free_blocks, steps, again):
    """write_rows (a decode step's lookahead: one plan a row) leaves the manager as plan_write's bound, then write()
    row by row, leaves it: the same tables, reference counts, free list and copies, forked sequences sharing
    blocks included (the first one's copy unshares a block for the next), and a sequence written twice; where the
    rows' cost does not fit, None and nothing written."""
    bm = _with_forks(lengths, forks, free_blocks)
    seqs = sorted(bm._tables)
    for ahead in steps:
        writes = [(s, bm.num_tokens(s), bm.num_tokens(s) + ahead) for s in seqs]
        if again < len(writes):  # that sequence's next positions too, after the others
            seq, _, end = writes[again]
            writes.append((seq, end, end + ahead))
        twin = copy.deepcopy(bm)
        plans = [twin._write_plan(*w) for w in writes]
        fits = sum(grow + len(shared) for grow, shared in plans) <= twin.num_free_blocks
        want = [c for w in writes for c in twin.write(*w)] if fits else None
        got = bm.write_rows(writes)
        assert got == want
        assert _state(bm) == _state(twin)
        bm.check_invariants()


@settings(max_examples=150, deadline=None)
@example(lengths=[6, 3], forks=[0, 0], free_blocks=1, start_back=2, ahead=3)  # a shared block to copy, one free
@given(
    lengths=st.lists(st.integers(1, 14), min_size=1, max_size=4),
    forks=st.lists(st.integers(0, 3), max_size=3),
    free_blocks=st.integers(0, 4),
    start_back=st.integers(0, 5),
    ahead=st.integers(1, 9),
)
def test_a_planned_write_is_the_checked_write(lengths, forks, free_blocks, start_back, ahead):
    """plan_write (the scheduler's decode rows: one plan where check then write made two) answers what can_write
    answers, and write() with its plan leaves the manager as write() planning again does: the same tables,
    reference counts, free list, capacities and copies, shared (forked) blocks included."""
    bm = _with_forks(lengths, forks, free_blocks)
    for seq in sorted(bm._tables):
        start = max(0, bm.num_tokens(seq) - start_back)
        planned = bm.plan_write(seq, start, start + ahead)
        assert (planned is not None) == bm.can_write(seq, start, start + ahead)
        if planned is None:
            continue
        twin = copy.deepcopy(bm)
        assert bm.write(seq, start, start + ahead, planned) == twin.write(seq, start, start + ahead)
        assert _state(bm) == _state(twin)
        bm.check_invariants()
