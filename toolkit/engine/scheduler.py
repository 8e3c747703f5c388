"""Scheduler: decides, each step, which tokens of which sequences go into the ONE forward pass.

Policy (vLLM's chunked-prefill scheduler):
1. Decode first. Every running sequence whose tokens are all cached but the newest gets
   exactly one token, oldest first. If its KV cannot grow, a victim is preempted
   (`preemption_policy`: the newest running sequence, or the lowest priority): its blocks
   are freed for recompute, or copied to the host pool (`preemption_mode=swap`), and it
   re-queues at the head of the waiting queue.
2. Then running sequences that are still prefilling continue, oldest first, each taking a
   chunk of what is left of the token budget (shrunk to the free KV blocks).
3. Then waiting sequences are admitted in FCFS order while there is budget, a free
   sequence slot (`max_num_seqs`) and KV blocks, never in a step that preempted: swapped
   sequences come back into fresh blocks, others start from their longest prefix-cache hit.
A chunk that reaches the end of a sequence's tokens samples its next token in the same step.

`engine.scheduling_policy=priority` (vLLM's; a server's default) orders sequences by `priority_key`:
(priority, stream, arrival), lower first. Sequences wait in that order, the victim of a preemption is the
last running one in it, and, before the step is planned, a waiting sequence that a slot or KV blocks keep
out preempts the running ones that come after it (vLLM V0's priority preemption), and while the first
waiting sequence has a slot, the running prefills but the first before it take their chunks only after the
step's admissions (vLLM's max_long_partial_prefills is the same idea). A server gives the i-th
prompt of one request priority i, so one request's many prompts or samples take turns with other
requests' instead of holding every slot until they end.

`engine.scheduler_policy` changes this for the design documents' baselines: `two_forwards` schedules
the same way (the runner then makes two forwards); `no_chunking` takes a prompt only whole (the
step's first prompt may exceed the budget, as in an engine without chunked prefill); `prefill_first`
also takes prompts whole, and in a step of their own: decodes wait while a prompt can be admitted
(vLLM V0's default). `engine.max_chunk_tokens` caps one sequence's chunk below the step budget.
`engine.dynamic_chunking` (SGLang's dynamic chunking, from the model's shape rather than timings, so every machine
schedules alike) shrinks a prefill chunk as its context grows: a chunk costs its tokens plus their attention
(`chunk_cost`), its cost stays within max_chunk_tokens, and it takes that cost from the step's budget.
Copy jobs (swap out, swap in, copy-on-write) travel with the batch, to run before the forward.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

from toolkit.config import EngineConfig
from toolkit.engine.request import Sequence, SequenceStatus
from toolkit.kv.block_manager import BlockCopy, BlockManager, SwapCopy

WHOLE = ("prefill_first", "no_chunking")  # the scheduler_policy values that take a prompt whole, never chunked
# a lookahead chunk's token: the one the step before samples, fed to the forward where it was sampled (async
# scheduling), never a token id
FED = -1


@dataclass(frozen=True)
class ScheduledChunk:
    """A contiguous run of one sequence's tokens to compute in this step."""

    seq_id: str
    token_ids: tuple[int, ...]
    start_pos: int  # position of token_ids[0]
    block_table: tuple[int, ...]  # blocks covering positions [0, start_pos + len(token_ids))
    samples: bool  # the chunk ends at the sequence's newest token: sample the next one
    draft_slots: int = 0  # speculative decoding: room reserved after the token for up to this many drafts
    num_logits: int = 1  # logits rows needed at the end of the chunk (1 + drafts when verifying)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class ScheduledBatch:
    step: int
    chunks: tuple[ScheduledChunk, ...]
    num_decode_tokens: int
    num_prefill_tokens: int
    preempted: tuple[tuple[str, str], ...] = ()  # (sequence id, "recompute" | "swap")
    swap_out: tuple[SwapCopy, ...] = ()  # device -> host, before anything else
    swap_in: tuple[SwapCopy, ...] = ()  # host -> device
    block_copies: tuple[BlockCopy, ...] = ()  # copy-on-write, device -> device
    prefix_hit_tokens: int = 0  # prompt tokens admitted from the prefix cache this step

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, cfg: EngineConfig, block_manager: BlockManager, context_scale: int | None = None):
        self.cfg, self.context_scale = cfg, context_scale  # context_scale: chunk_cost's (None: chunks cost tokens)
        self.blocks = block_manager
        self._pending: list[Sequence] = []  # by (arrival_step, arrival_order)
        self._order = 0
        self.waiting: deque[Sequence] = deque()  # admission order (by priority_key under scheduling_policy=priority)
        self.running: list[Sequence] = []  # admission order (oldest first)
        self.num_preemptions = 0  # every preemption so far (EngineStats.preemptions)

    # ------------------------------------------------------------------ queue management

    def add(self, request: Sequence) -> None:
        request.status, request.arrival_order = SequenceStatus.PENDING, self._order
        bisect.insort(self._pending, request, key=lambda s: (s.arrival_step, s.arrival_order))
        self._order += 1

    def arrivals(self, step: int) -> list[Sequence]:
        """Move requests whose arrival step has come into the waiting queue; return them."""
        arrived = []
        while self._pending and self._pending[0].arrival_step <= step:
            request = self._pending.pop(0)
            request.status = SequenceStatus.WAITING
            self._queue(request)
            arrived.append(request)
        return arrived

    @property
    def next_arrival_step(self) -> int | None:
        return self._pending[0].arrival_step if self._pending else None

    def has_work(self) -> bool:
        return bool(self._pending or self.waiting or self.running)

    def adopt(self, seq: Sequence) -> None:
        """A sequence forked from a running one (a parallel sample) starts running, already decoding."""
        seq.status = SequenceStatus.DECODING
        self.running.append(seq)

    def finish(self, request: Sequence) -> None:
        """Release a finished (or aborted) sequence's blocks and drop it from every queue."""
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self._pending = [s for s in self._pending if s is not request]
        self.blocks.free(request.seq_id)

    # ------------------------------------------------------------------ the step

    def schedule(self, step: int, draft_slots: dict[str, int] | None = None) -> ScheduledBatch:
        """`draft_slots`: for decoding sequences that speculate, how many draft tokens to make room for."""
        plan = _Plan()
        plan.draft_slots = draft_slots or {}
        if self.cfg.scheduling_policy == "priority":
            self._make_room(step, plan)
        plan.made_room = len(plan.preempted)
        if self.cfg.scheduler_policy == "prefill_first" and (
            self.waiting or any(s.status is SequenceStatus.PREFILLING for s in self.running)
        ):
            batch = self._schedule_once(step, plan, decodes=False)  # prompts first, in a step of their own
            if batch.chunks:
                return batch
        while True:
            batch = self._schedule_once(step, plan)
            if batch.chunks or not self.running:
                return batch
            # Nothing could run although running sequences hold every block (their prefills
            # cannot grow): free a victim so the others progress.
            self._preempt(self._victim(set()), step, plan)

    def _schedule_once(self, step: int, plan: _Plan, decodes: bool = True) -> ScheduledBatch:
        budget = self.cfg.max_num_batched_tokens
        # prefill_first and no_chunking take prompts whole: the step's first prompt may exceed the budget
        whole = self.cfg.scheduler_policy in WHOLE
        max_chunk, scale = self.cfg.max_chunk_tokens or budget, None if whole else self.context_scale
        chunks: list[ScheduledChunk] = []
        scheduled: set[str] = set()
        num_decode = num_prefill = 0

        def chunk_size(seq: Sequence) -> int:
            """This step's chunk of seq's prompt: what is left (whole, or 0 where it does not fit), else what the
            budget, max_chunk_tokens (both as chunk_cost) and the free KV blocks allow."""
            left = seq.num_uncomputed_tokens
            if whole:
                if left > budget and num_prefill > 0:
                    return 0
                return left if self._fit(seq, left) == left else 0
            return self._fit(seq, min(left, fitting_chunk(min(budget, max_chunk), seq.num_computed_tokens, scale)))

        # 1. decodes: one token each, oldest first; preempt a victim to make room
        for seq in list(self.running) if decodes else ():
            if budget == 0:
                break
            if seq.status is not SequenceStatus.DECODING or seq not in self.running:
                continue
            start = seq.num_computed_tokens
            while (planned := self.blocks.plan_write(seq.seq_id, start, start + 1)) is None:
                victim = self._victim(scheduled)
                self._preempt(victim, step, plan)
                if victim is seq:
                    break
            if seq in self.running:
                drafts = min(plan.draft_slots.get(seq.seq_id, 0), budget - 1)
                while drafts:  # speculation only uses blocks that are free anyway
                    wider = self.blocks.plan_write(seq.seq_id, start, start + 1 + drafts)
                    if wider is not None:
                        planned = wider
                        break
                    drafts -= 1
                chunks.append(self._take(seq, 1, plan, drafts, planned))
                scheduled.add(seq.seq_id)
                budget -= 1 + drafts
                num_decode += 1 + drafts

        def prefill(seq: Sequence) -> None:
            nonlocal budget, num_prefill
            size = chunk_size(seq)
            if size > 0:
                chunks.append(self._take(seq, size, plan))
                scheduled.add(seq.seq_id)
                budget = max(budget - chunk_cost(size, seq.num_computed_tokens, scale), 0)
                num_prefill += size

        # 2. running prefills continue, oldest first, shrunk to the free KV blocks; those held back (_held_back) after
        # the admissions (4.)
        prefills = [s for s in self.running if s.status is SequenceStatus.PREFILLING]
        held = self._held_back(prefills)
        for seq in prefills:
            if budget == 0 and not (whole and num_prefill == 0):
                break
            if seq not in held:
                prefill(seq)

        # 3. admissions, in the waiting queue's order; never in a step that had to preempt to grow (avoids
        # thrashing). A running head of n > 1 not yet forked holds its followers' slots too: max_num_seqs bounds the
        # sequences once every head has forked
        slots = sum(s.group_slots for s in self.running)
        admit = len(plan.preempted) == plan.made_room
        while self.waiting and (budget > 0 or (whole and num_prefill == 0)) and admit:
            seq = self.waiting[0]
            if slots + seq.group_slots > self.cfg.max_num_seqs:
                break
            if self.blocks.is_swapped(seq.seq_id):
                if not self.blocks.can_swap_in(seq.seq_id):
                    break
                self.waiting.popleft()
                plan.swap_in.extend(self.blocks.swap_in(seq.seq_id))
            else:
                hits = self.blocks.cached_prefix(seq.token_ids, (seq.num_tokens - 1) // self.blocks.block_size)
                cached = len(hits) * self.blocks.block_size
                room = (
                    self.blocks.num_free_blocks - sum(self.blocks.ref_counts[b] == 0 for b in hits)
                ) * self.blocks.block_size
                need = seq.num_tokens - cached
                if min(budget, need, room) <= 0 and not whole:
                    break
                if whole and (need > room or (need > budget and num_prefill > 0)):
                    break  # whole or not at all; over the budget only as the step's first prompt
                self.waiting.popleft()
                seq.num_computed_tokens = self.blocks.allocate_prefix(seq.seq_id, seq.token_ids, seq.num_tokens - 1)
                plan.prefix_hit_tokens += seq.num_computed_tokens
            seq.status = (
                SequenceStatus.DECODING
                if seq.num_uncomputed_tokens == 1 and seq.num_output_tokens
                else SequenceStatus.PREFILLING
            )
            if seq.admitted_step is None:
                seq.admitted_step = step
            self.running.append(seq)
            slots += seq.group_slots
            size = chunk_size(seq)
            if size > 0:
                chunks.append(self._take(seq, size, plan))
                scheduled.add(seq.seq_id)
                budget = max(budget - chunk_cost(size, seq.num_computed_tokens, scale), 0)
                if seq.status is SequenceStatus.DECODING:
                    num_decode += size
                else:
                    num_prefill += size

        for seq in held:  # 4. the prefills held back take what the admissions left
            if budget == 0 and not (whole and num_prefill == 0):
                break
            prefill(seq)

        return ScheduledBatch(
            step=step,
            chunks=tuple(chunks),
            num_decode_tokens=num_decode,
            num_prefill_tokens=num_prefill,
            preempted=tuple(plan.preempted),
            swap_out=tuple(plan.swap_out),
            swap_in=tuple(plan.swap_in),
            block_copies=tuple(plan.copies),
            prefix_hit_tokens=plan.prefix_hit_tokens,
        )

    # ------------------------------------------------------------------ helpers

    def _fit(self, seq: Sequence, wanted: int) -> int:
        """Largest chunk <= wanted whose KV (growth and copy-on-write) fits in the free blocks."""
        start, bs = seq.num_computed_tokens, self.blocks.block_size
        if self.blocks.can_write(seq.seq_id, start, start + wanted):
            return wanted
        capacity = (len(self.blocks.block_table(seq.seq_id)) + self.blocks.num_free_blocks) * bs - start
        size = min(wanted, capacity)
        while size > 0 and not self.blocks.can_write(seq.seq_id, start, start + size):
            size -= bs  # a copy-on-write block also needs room
        return max(size, 0)

    def _take(
        self, seq: Sequence, size: int, plan: _Plan, drafts: int = 0, planned: tuple[int, list[int]] | None = None
    ) -> ScheduledChunk:
        """`planned`: the block manager's plan_write of this chunk and its drafts, where the caller has it."""
        start = seq.num_computed_tokens
        total = start + size
        plan.copies.extend(self.blocks.write(seq.seq_id, start, total + drafts, planned))
        return ScheduledChunk(
            seq_id=seq.seq_id,
            token_ids=tuple(seq.token_ids[start:total]),
            start_pos=start,
            block_table=self.blocks.table(seq.seq_id),
            samples=total == seq.num_tokens,
            draft_slots=drafts,
        )

    def _victim(self, scheduled: set[str]) -> Sequence:
        candidates = [s for s in self.running if s.seq_id not in scheduled]
        if not candidates:
            raise AssertionError("no preemption victim: every running sequence is already scheduled")
        if self.cfg.scheduling_policy == "priority":
            return max(candidates, key=priority_key)
        if self.cfg.preemption_policy == "priority":
            order = {id(s): i for i, s in enumerate(self.running)}
            return max(candidates, key=lambda s: (s.priority, order[id(s)]))
        return candidates[-1]  # the newest

    def _preempt(self, seq: Sequence, step: int, plan: _Plan) -> None:
        """Free (recompute) or swap out the victim's KV; keep its tokens and state; re-queue it at the head."""
        self.running.remove(seq)
        mode = self.cfg.preemption_mode
        if mode == "swap" and self.blocks.can_swap_out(seq.seq_id):
            plan.swap_out.extend(self.blocks.swap_out(seq.seq_id))
        else:
            mode = "recompute"
            self.blocks.free(seq.seq_id)
            seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.preempted_steps.append(step)
        seq.preemption_modes.append(mode)
        plan.preempted.append((seq.seq_id, mode))
        self._queue(seq, front=True)

    def _held_back(self, prefills: list[Sequence]) -> list[Sequence]:
        """scheduling_policy=priority, while the first waiting sequence has a slot: the running prefills that wait for
        the step's admissions, in priority order: all but the first that comes before it (a later request's first
        token waited 50 s behind one request's four prompts of 8,000 tokens, or four requests' one prompt each)."""
        if self.cfg.scheduling_policy != "priority" or not self.waiting:
            return []
        head = self.waiting[0]
        if sum(s.group_slots for s in self.running) + head.group_slots > self.cfg.max_num_seqs:
            return []
        ordered = sorted(prefills, key=priority_key)
        first = 1 if ordered and priority_key(ordered[0]) < priority_key(head) else 0
        return ordered[first:]

    def _queue(self, seq: Sequence, front: bool = False) -> None:
        """Into the waiting queue: in priority_key order (scheduling_policy=priority), else at its back or front."""
        if self.cfg.scheduling_policy == "priority":
            self.waiting.insert(bisect.bisect(self.waiting, priority_key(seq), key=priority_key), seq)
        else:
            self.waiting.insert(0 if front else len(self.waiting), seq)

    def _make_room(self, step: int, plan: _Plan) -> None:
        """scheduling_policy=priority: each waiting sequence in turn, while a slot or the KV blocks of its first chunk
        are missing, preempts the last running sequence in priority order if that comes after it; the first
        waiting sequence that cannot have its room ends it. Blocks are counted without prefix-cache hits, and for
        one step's token budget of first chunks at most (what one step can admit)."""
        slots, reserved = sum(s.group_slots for s in self.running), 0
        tokens = math.inf if self.cfg.scheduler_policy in WHOLE else self.cfg.max_num_batched_tokens
        chunk = min(self.cfg.max_chunk_tokens or tokens, tokens)
        for seq in list(self.waiting):  # a swapped sequence's computed tokens come back whole
            swapped = self.blocks.is_swapped(seq.seq_id)
            size = seq.num_computed_tokens + 1 if swapped else min(seq.num_tokens, chunk, max(tokens, 0))
            tokens -= size
            need = min(self.blocks.blocks_for_tokens(size), self.blocks.num_blocks)
            while slots + seq.group_slots > self.cfg.max_num_seqs or self.blocks.num_free_blocks - reserved < need:
                victim = max(self.running, key=priority_key, default=None)
                if victim is None or priority_key(victim) < priority_key(seq):
                    return
                slots -= victim.group_slots
                self._preempt(victim, step, plan)
            slots += seq.group_slots
            reserved += need


def chunk_cost(tokens: int, start: int, scale: int | None) -> int:
    """A prefill chunk of `tokens` from position `start`, in tokens at position 0: the tokens, plus one for every
    `scale` query-key pairs of their attention (to the `start` positions before them and to each other). `scale` is
    engine.dynamic_chunking's: the context length at which a token's attention costs as much as the rest of its
    layer; None: a chunk costs its tokens."""
    if not scale:
        return tokens
    return tokens + -(-tokens * (2 * start + tokens + 1) // (2 * scale))


def fitting_chunk(cost: int, start: int, scale: int | None) -> int:
    """The longest chunk from `start` that costs at most `cost` (chunk_cost), and at least one token where `cost` is
    positive: a prefill progresses whatever its context."""
    if not scale:
        return cost
    lo, hi = min(1, cost), cost  # chunk_cost(n) >= n: no chunk longer than the cost fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if chunk_cost(mid, start, scale) <= cost else (lo, mid - 1)
    return lo


def priority_key(seq: Sequence) -> tuple[int, int, int]:
    """scheduling_policy=priority's order, lower first: the request's priority (vLLM's), the sample's stream, then
    arrival. The stream puts each sample of an n > 1 request behind the first samples of requests of the same
    priority."""
    return seq.priority, seq.stream, seq.arrival_order


class _Plan:
    """Everything one schedule() call decided besides the chunks (it may take several rounds)."""

    def __init__(self):
        self.preempted: list[tuple[str, str]] = []
        self.made_room = 0  # preemptions scheduling_policy=priority made for waiting sequences (admission follows)
        self.swap_out: list[SwapCopy] = []
        self.swap_in: list[SwapCopy] = []
        self.copies: list[BlockCopy] = []
        self.prefix_hit_tokens = 0
        self.draft_slots: dict[str, int] = {}
