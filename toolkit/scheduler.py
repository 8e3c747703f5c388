"""Scheduler: decides, each step, which tokens of which requests go into the ONE forward pass.

Policy (vLLM's chunked-prefill scheduler, see docs in shared/reference):
1. Decode first. Every running request whose prompt is fully cached gets exactly one token,
   in admission order. If its KV cannot grow, the newest running request is preempted
   (recompute: its blocks are freed and it re-queues at the head of the waiting queue).
2. Then running requests that are still prefilling continue, in admission order, each
   taking a chunk of what is left of the token budget (shrunk to the free KV blocks).
3. Then waiting requests are admitted in FCFS order while there is budget, a free sequence
   slot (`max_num_seqs`) and KV blocks for their first chunk; not in a step that preempted.
A chunk that reaches the end of a request's tokens samples that request's next token in
the same step.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from toolkit.config import EngineConfig
from toolkit.kv.block_manager import BlockManager
from toolkit.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """A contiguous run of one request's tokens to compute in this step."""

    seq_id: str
    token_ids: tuple[int, ...]
    start_pos: int  # position of token_ids[0]
    block_table: tuple[int, ...]  # blocks covering positions [0, start_pos + len(token_ids))
    samples: bool  # the chunk ends at the request's newest token: sample the next one

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
    preempted: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, cfg: EngineConfig, block_manager: BlockManager):
        self.cfg = cfg
        self.blocks = block_manager
        self._pending: list[tuple[int, int, Request]] = []  # (arrival_step, order, request), sorted
        self._order = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order (oldest first)

    # ------------------------------------------------------------------ queue management

    def add(self, request: Request) -> None:
        request.status = RequestStatus.PENDING
        bisect.insort(self._pending, (request.arrival_step, self._order, request), key=lambda e: e[:2])
        self._order += 1

    def arrivals(self, step: int) -> list[Request]:
        """Move requests whose arrival step has come into the waiting queue; return them."""
        arrived = []
        while self._pending and self._pending[0][0] <= step:
            _, _, request = self._pending.pop(0)
            request.status = RequestStatus.WAITING
            self.waiting.append(request)
            arrived.append(request)
        return arrived

    @property
    def next_arrival_step(self) -> int | None:
        return self._pending[0][0] if self._pending else None

    def has_work(self) -> bool:
        return bool(self._pending or self.waiting or self.running)

    def finish(self, request: Request) -> None:
        """Release a finished (or aborted) request's blocks and drop it from every queue."""
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self._pending = [e for e in self._pending if e[2] is not request]
        if self.blocks.has(request.seq_id):
            self.blocks.free(request.seq_id)

    # ------------------------------------------------------------------ the step

    def schedule(self, step: int) -> ScheduledBatch:
        preempted: list[str] = []
        while True:
            batch = self._schedule_once(step, preempted)
            if batch.chunks or not self.running:
                return batch
            # Nothing could run although running requests hold every block (their prefills
            # cannot grow): free the newest so the older ones progress.
            victim = self.running[-1]
            self._preempt(victim, step)
            preempted.append(victim.seq_id)

    def _schedule_once(self, step: int, preempted: list[str]) -> ScheduledBatch:
        budget = self.cfg.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        num_decode = num_prefill = 0

        # 1. decodes: one token each, oldest first; preempt the newest to make room
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.DECODING or request not in self.running:
                continue
            while not self._can_extend(request, 1):
                victim = self._newest_unscheduled(chunks)
                self._preempt(victim, step)
                preempted.append(victim.seq_id)
                if victim is request:
                    break
            if request in self.running:
                chunks.append(self._take(request, 1))
                budget -= 1
                num_decode += 1

        # 2. running prefills continue, oldest first, shrunk to the free KV blocks
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.PREFILLING:
                continue
            size = min(budget, request.num_uncomputed_tokens, self._room(request))
            if size > 0:
                chunks.append(self._take(request, size))
                budget -= size
                num_prefill += size

        # 3. admissions, FCFS; never in a step that had to preempt (avoids thrashing)
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.cfg.max_num_seqs:
            request = self.waiting[0]
            size = min(budget, request.num_uncomputed_tokens, self.blocks.num_free_blocks * self.blocks.block_size)
            if size == 0:
                break
            self.waiting.popleft()
            self.blocks.allocate(request.seq_id, 0)
            request.status = RequestStatus.PREFILLING
            if request.admitted_step is None:
                request.admitted_step = step
            self.running.append(request)
            chunks.append(self._take(request, size))
            budget -= size
            num_prefill += size

        return ScheduledBatch(step=step, chunks=tuple(chunks), num_decode_tokens=num_decode,
                              num_prefill_tokens=num_prefill, preempted=tuple(preempted))

    # ------------------------------------------------------------------ helpers

    def _can_extend(self, request: Request, num_new: int) -> bool:
        total = request.num_computed_tokens + num_new
        extra = total - self.blocks.num_tokens(request.seq_id)
        return extra <= 0 or self.blocks.can_append(request.seq_id, extra)

    def _room(self, request: Request) -> int:
        """Tokens the request can still add: slack in its last block plus every free block."""
        capacity = len(self.blocks.block_table(request.seq_id)) + self.blocks.num_free_blocks
        return capacity * self.blocks.block_size - request.num_computed_tokens

    def _take(self, request: Request, size: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        total = start + size
        extra = total - self.blocks.num_tokens(request.seq_id)
        if extra > 0:
            self.blocks.append(request.seq_id, extra)
        return ScheduledChunk(
            seq_id=request.seq_id,
            token_ids=tuple(request.token_ids[start:total]),
            start_pos=start,
            block_table=tuple(self.blocks.block_table(request.seq_id)),
            samples=total == request.num_tokens,
        )

    def _newest_unscheduled(self, chunks: list[ScheduledChunk]) -> Request:
        scheduled = {c.seq_id for c in chunks}
        for request in reversed(self.running):
            if request.seq_id not in scheduled:
                return request
        raise AssertionError("no preemption victim: every running request is already scheduled")

    def _preempt(self, request: Request, step: int) -> None:
        """Recompute preemption: drop the KV, keep the tokens; re-queue at the head."""
        self.running.remove(request)
        self.blocks.free(request.seq_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        request.preempted_steps.append(step)
        self.waiting.appendleft(request)
