"""What enters the engine (`EngineRequest`, one typed contract) and its state inside it (`Sequence`, one sampled
sequence): everything needed to schedule, resume and report it.

A request with n parallel samples is n of these (same `request_id`, `stream` 0..n-1,
distinct `seq_id`). The KV cache is derived state: `token_ids` (prompt + output) and
`num_computed_tokens` say exactly which tokens still need a forward pass, so dropping a
sequence's blocks and re-prefilling them (recompute preemption) needs nothing else. The
RNG key is (seed, stream); the randomness of a token depends only on (seed, position,
stream). The stop-string matcher keeps its own progress (`stop_state`).
"""

from __future__ import annotations

import collections.abc
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from toolkit.sampling.params import SamplingParams
from toolkit.sampling.stop import StopState


@dataclass(frozen=True)
class EngineRequest:
    """One request into the engine, the only shape one arrives in: toolkit.LLM, the server, a workload and replay
    build it; `Engine.add` takes it, and the engine's intake validates it once (a RequestError naming the field).
    Give one of `prompt`, `messages` (a chat, through the tokenizer's template) or `prompt_token_ids`; `prompt`
    beside `prompt_token_ids` is their text, tokenized already (vLLM's TextTokensPrompt: Engine.tokenized).
    `sampling_params`: a SamplingParams, or a mapping of its fields over the engine's defaults; with n > 1 the
    request becomes n sequences. `arrival_step`: the engine step before which it is not scheduled (a workload's
    timeline); `priority`: lower is more important (preemption_policy=priority)."""

    prompt: str | None = None
    messages: collections.abc.Sequence[Mapping[str, Any]] | None = None
    prompt_token_ids: collections.abc.Sequence[int] | None = None
    sampling_params: SamplingParams | Mapping[str, Any] | None = None
    request_id: str | None = None
    arrival_step: int | None = None
    priority: int = 0


class SequenceStatus(str, enum.Enum):
    PENDING = "pending"  # added, but its arrival step has not come yet
    WAITING = "waiting"  # eligible, queued for admission (or preempted and queued again)
    PREFILLING = "prefilling"  # admitted; prompt (or recomputed tokens) partly in the cache
    DECODING = "decoding"  # every token but the newest is in the cache
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ERROR = "error"
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    seq_id: str  # unique per sequence: the request id, or "<request id>#<stream>" when n > 1
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int  # resolved RNG key (the request's own seed, or derived from the run seed)
    arrival_step: int = 0
    prompt_text: str | None = None
    stream: int = 0  # RNG stream: the sample index among the request's n samples
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    priority: int = 0  # lower is more important (vLLM); used by scheduling_policy=priority and preemption_policy
    arrival_order: int = 0  # its place among the engine's requests in the order they were added
    followers: list[str] = field(default_factory=list)  # stream 0 of n > 1: samples forked from it after prefill
    grammar: Any = None  # its xgrammar GrammarMatcher, when it has structured outputs

    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: SequenceStatus = SequenceStatus.PENDING
    finish_reason: FinishReason | None = None
    finish_detail: str | None = None  # why it stopped ("eos", "stop_token_id", "stop_str", "max_tokens", an error)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (vLLM's stop_reason)
    stop_state: StopState = field(default_factory=StopState)  # its text and stop-string matcher

    add_time: float = 0.0
    arrival_time: float | None = None  # when it became eligible (its arrival step came)
    admitted_step: int | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    abort_step: int | None = None  # the step before which it was aborted (null: it was not)
    num_preemptions: int = 0
    preempted_steps: list[int] = field(default_factory=list)
    preemption_modes: list[str] = field(default_factory=list)

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def text(self) -> str:
        """The output text so far (stop string excluded unless include_stop_str_in_output)."""
        return self.stop_state.text

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def group_slots(self) -> int:
        """Sequence slots admitting this sequence takes: itself plus the samples it will fork."""
        return 1 + len(self.followers)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_running(self) -> bool:
        return self.status in (SequenceStatus.PREFILLING, SequenceStatus.DECODING)
