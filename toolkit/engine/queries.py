"""The engine's read side: what a caller outside toolkit/engine may ask it without changing a request's state, so
that nothing there touches its scheduler, block manager, intake or request table (tests/test_structure.py counts
such reaches: none).

    engine.has_request(id) / is_finished(id)           a request the engine knows (added, not yet released)
    engine.request_ids() / unfinished_request_ids()    the ids it knows, in the order they were added
    engine.running_request_ids()                       requests with a sequence scheduled in the running set
    engine.request_of(seq_id)                          a sequence's request (StepOutput names sequences)
    engine.sequences(id)                               a request's sequences (stream 0..n-1), to read only
    engine.running_sequences()                         the running set, in the scheduler's order, to read only
    engine.stats()                                     EngineStats: queues and the KV pool, now
    engine.prompt_ids(request)                         an EngineRequest's prompt as intake computes and checks it
    engine.tokenized(request)                          the request with its prompt's ids beside its text, checked
    engine.precompile(sampling_params, cached_only, compile_with)   its grammar compiled ahead of `add`
    engine.prompt_logprobs(ids, k, stop)               echo's prompt scores, by a prefill over a fresh cache
    engine.check_invariants()                          the block manager's own consistency check
"""

from __future__ import annotations

import collections.abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from toolkit.engine.request import EngineRequest, Sequence, SequenceStatus
from toolkit.engine.runner import prompt_logprobs
from toolkit.errors import RequestError
from toolkit.sampling.params import SamplingParams

if TYPE_CHECKING:
    from toolkit.engine.intake import RequestIntake
    from toolkit.engine.scheduler import Scheduler
    from toolkit.kv.block_manager import BlockManager
    from toolkit.models import LoadedModel


@dataclass(frozen=True)
class EngineStats:
    """The engine's queues and KV pool at one moment (what /metrics, a run's summary and a soak read)."""

    step: int  # steps taken
    requests: int  # requests known (added, not yet released)
    running: int  # sequences in the running set
    waiting: int  # sequences waiting for admission (preempted ones included)
    waiting_requests: int  # requests with a sequence waiting (what serve.max_waiting bounds)
    decoding: int  # running sequences whose prompt is in the cache
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    preemptions: int  # preemptions so far
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of which served from it


class EngineQueries:
    """Mixed into Engine, which owns `requests` (by sequence id), `groups` (request id -> sequence ids),
    `scheduler`, `block_manager`, `intake` and the `loaded` model."""

    requests: dict[str, Sequence]
    groups: dict[str, list[str]]
    scheduler: Scheduler
    block_manager: BlockManager
    intake: RequestIntake
    loaded: LoadedModel
    step_index: int

    def has_request(self, request_id: str) -> bool:
        return request_id in self.groups

    def is_finished(self, request_id: str) -> bool:
        """Whether every sequence of a known request has finished."""
        return all(s.is_finished for s in self.sequences(request_id))

    def request_ids(self) -> list[str]:
        return list(self.groups)

    def unfinished_request_ids(self) -> list[str]:
        return [r for r in self.groups if not self.is_finished(r)]

    def running_request_ids(self) -> set[str]:
        return {seq.request_id for seq in self.scheduler.running}

    def request_of(self, seq_id: str) -> str:
        return self.requests[seq_id].request_id

    def sequences(self, request_id: str) -> tuple[Sequence, ...]:
        """A request's sequences, stream 0 first. Their state is the engine's: read it, never change it."""
        if request_id not in self.groups:
            raise RequestError(f"unknown request id {request_id!r}")
        return tuple(self.requests[s] for s in self.groups[request_id])

    def running_sequences(self) -> tuple[Sequence, ...]:
        """The running set in the scheduler's order. Read only."""
        return tuple(self.scheduler.running)

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            step=self.step_index,
            requests=len(self.groups),
            running=len(sched.running),
            waiting=len(sched.waiting),
            waiting_requests=len({seq.request_id for seq in sched.waiting}),
            decoding=sum(s.status is SequenceStatus.DECODING for s in sched.running),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_free=bm.num_free_blocks,
            preemptions=sched.num_preemptions,
            prefix_queries=bm.prefix_queries,
            prefix_hits=bm.prefix_hits,
        )

    def tokenized(self, request: EngineRequest) -> EngineRequest:
        """The request with its prompt's ids beside its text, checked as `add` checks them, on the caller's thread
        (a server's handler): adding what it returns tokenizes nothing on the engine's."""
        return self.intake.tokenized(request)

    def prompt_ids(self, request: EngineRequest) -> list[int]:
        """The request's prompt as intake computes and checks it (a chat's through the template)."""
        return self.intake.prompt_ids(request)

    def precompile(
        self,
        sampling_params: SamplingParams | Mapping[str, Any] | None,
        cached_only: bool = False,
        compile_with: collections.abc.Callable | None = None,
    ) -> bool:
        """Compile a request's grammar ahead of `add`, on the caller's thread (RequestError if invalid); with
        `cached_only`, compile nothing and say whether nothing is left to compile; `compile_with(backend, spec)`
        compiles it instead of this thread (RequestIntake.precompile)."""
        return self.intake.precompile(sampling_params, cached_only, compile_with)

    def prompt_logprobs(
        self,
        prompt_token_ids: collections.abc.Sequence[int],
        k: int,
        stop: collections.abc.Callable[[], bool] | None = None,
    ) -> list | None:
        """Each prompt token's logprob and the top k at its position (echo), recomputed over a fresh cache (not the
        engine's); None once `stop()` is true (asked between pieces of the scoring: its caller gave up)."""
        return prompt_logprobs(self.loaded.model, prompt_token_ids, k, stop)

    def check_invariants(self) -> None:
        """The block manager's consistency check (reference counts, free list, prefix table); raises if broken."""
        self.block_manager.check_invariants()
