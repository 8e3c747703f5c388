"""What the engine hands out: step outputs, streamed text deltas, finished requests and their metrics."""

from __future__ import annotations

import collections.abc
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from toolkit.engine.request import FinishReason, Sequence
from toolkit.trace.schema import SampleTrace


@dataclass(frozen=True)
class RequestMetrics:
    arrival_step: int
    admitted_step: int | None
    queue_s: float | None  # eligible -> first scheduled
    ttft_s: float | None  # eligible -> first token
    tpot_s: float | None  # mean time between output tokens after the first
    e2e_s: float | None  # eligible -> finished
    num_preemptions: int


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability at one position (vLLM's Logprob): under the raw distribution (the trace's
    raw_logprob and top_raw, vLLM's default logprobs mode), its rank there (1: the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class CompletionOutput:
    """One sample of a request (vLLM's CompletionOutput). `logprobs` and `cumulative_logprob` are filled where the
    request asked for logprobs (toolkit.LLM): per output token, the sampled token and the `logprobs` most likely,
    and the sum of the sampled tokens' log-probabilities."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: int | str | None  # the stop string or token id; with finish_reason "error", the error
    seed: int
    metrics: RequestMetrics
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    # SamplingParams(prompt_logprobs=k) through toolkit.LLM: None for the first prompt token, then per token its
    # Logprob and the k most likely (vLLM's RequestOutput.prompt_logprobs)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    # conveniences for the common n == 1 case
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def seed(self) -> int:
        return self.outputs[0].seed

    @property
    def metrics(self) -> RequestMetrics:
        return self.outputs[0].metrics


@dataclass(frozen=True)
class TextDelta:
    """What a stream consumer sees of one sequence after one step."""

    request_id: str
    index: int  # sample index (stream)
    text: str  # new text since the last delta (never part of a stop string)
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None


@dataclass(frozen=True)
class StepOutput:
    step: int
    batch_size: int  # sequences in the forward
    num_decode_tokens: int
    num_prefill_tokens: int
    samples: tuple[SampleTrace, ...]  # one per sampled (or errored) sequence
    logits_RV: torch.Tensor | None  # raw logits; samples[i].logits_row indexes it
    deltas: tuple[TextDelta, ...]
    finished: tuple[str, ...]  # sequence ids
    preempted: tuple[tuple[str, str], ...]  # (sequence id, "recompute" | "swap")
    kv_blocks_used: int
    kv_utilization: float = 0.0  # used / total device blocks after the step
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache this step
    forward_s: float = 0.0  # the model's forward alone: the rest of the step is host work
    forwards: int = 0  # target-model forwards the step made (1; 2 with scheduler_policy=two_forwards on a mixed step)
    # step(trace_digests=True): logits row -> sha256 of its bytes (hashed on beside the next step; a first look
    # finishes it)
    logits_sha256: Mapping[int, str] | None = None
    # requests this step ended because it raised for them alone (toolkit.engine.isolate, the commit): (request id,
    # why)
    failed: tuple[tuple[str, str], ...] = ()


def request_metrics(r: Sequence) -> RequestMetrics:
    start = r.arrival_time
    since = lambda t: None if (t is None or start is None) else t - start  # noqa: E731
    tpot = None
    if r.first_token_time is not None and r.last_token_time is not None and r.num_output_tokens > 1:
        tpot = (r.last_token_time - r.first_token_time) / (r.num_output_tokens - 1)
    return RequestMetrics(
        arrival_step=r.arrival_step,
        admitted_step=r.admitted_step,
        queue_s=since(r.first_scheduled_time),
        ttft_s=since(r.first_token_time),
        tpot_s=tpot,
        e2e_s=since(r.finish_time),
        num_preemptions=r.num_preemptions,
    )


def request_output(request_id: str, seqs: collections.abc.Sequence[Sequence]) -> RequestOutput:
    """A request's output from its sequences (one per parallel sample, in stream order)."""
    first = seqs[0]
    return RequestOutput(
        request_id=request_id,
        prompt=first.prompt_text,
        prompt_token_ids=first.prompt_token_ids,
        outputs=tuple(
            CompletionOutput(
                index=s.stream,
                text=s.text,
                token_ids=tuple(s.output_token_ids),
                finish_reason=s.finish_reason.value if s.finish_reason else None,
                stop_reason=s.finish_detail if s.finish_reason is FinishReason.ERROR else s.stop_reason,
                seed=s.seed,
                metrics=request_metrics(s),
            )
            for s in seqs
        ),
        finished=all(s.is_finished for s in seqs),
    )
