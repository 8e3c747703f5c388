"""The commit stage: the one place where a step's results feed back into sequence state.

For each decided token, in row order: append it, advance the grammar matcher and the stop-string
matcher, detokenize the new text, finish the sequence (eos, stop token, stop string, grammar
complete, length, error), and build its SampleTrace row. Around that, the step's bookkeeping:
tokens now in the cache, parallel samples forked from their leader, rejected drafts' cache
dropped, full blocks published to the prefix cache.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from toolkit.engine.decide import Decision, Emit
from toolkit.engine.outputs import TextDelta
from toolkit.engine.request import FinishReason, Sequence, SequenceStatus
from toolkit.engine.scheduler import ScheduledBatch, Scheduler
from toolkit.engine.speculative import Proposal, Speculator
from toolkit.errors import one_line
from toolkit.kv import BlockManager
from toolkit.models.tokenizer import Tokenizer
from toolkit.sampling.grammar import GrammarBackend
from toolkit.sampling.stop import TextUpdate, update_text
from toolkit.trace.schema import SampleTrace

NO_TEXT = TextUpdate(delta="", stop_string=None)  # an engine without a tokenizer: no text, no stop string


@dataclass(frozen=True)
class Committed:
    traces: tuple[SampleTrace, ...]
    deltas: tuple[TextDelta, ...]  # only those with text, tokens or a finish
    finished: tuple[str, ...]  # sequence ids
    failed: tuple[tuple[str, str], ...] = ()  # (request id, why): requests whose step raised for them alone


class Committer:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        grammar: Callable[[], GrammarBackend],
        scheduler: Scheduler,
        block_manager: BlockManager,
        speculator: Speculator | None,
    ):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.grammar = grammar  # the engine's grammar backend, created on first use
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.speculator = speculator
        self.last_finish_time: float | None = None

    def preempted(self, preempted: tuple[tuple[str, str], ...], requests: Mapping[str, Sequence]) -> None:
        """A sequence preempted by recompute rebuilds its grammar matcher from its committed tokens."""
        for seq_id, mode in preempted:
            seq = requests[seq_id]
            if mode == "recompute" and seq.grammar is not None:
                seq.grammar = self.grammar().matcher(seq.sampling.structured_outputs, seq.output_token_ids)

    def commit(
        self,
        batch: ScheduledBatch,
        decision: Decision,
        proposals: Mapping[str, Proposal],
        requests: Mapping[str, Sequence],
        start_time: float,
    ) -> Committed:
        step = batch.step
        for chunk in batch.chunks:
            requests[chunk.seq_id].num_computed_tokens = chunk.context_len
        for leader, follower in decision.forks:
            self.block_manager.fork(leader.seq_id, follower.seq_id)
            follower.num_computed_tokens = leader.num_computed_tokens
            follower.arrival_time, follower.admitted_step = leader.arrival_time, step
            follower.first_scheduled_time, follower.arrival_order = leader.first_scheduled_time, leader.arrival_order
            leader.followers = []
        forked = {f.seq_id for _, f in decision.forks}
        row_of = StepRows(batch, decision.grammar_allowed, start_time)
        traces, deltas, finished, failed = [], [], [], []
        for seq, emitted in decision.emits:
            verified = seq.seq_id in proposals
            try:
                for e in emitted:
                    position, marks = seq.num_tokens, (len(deltas), len(traces), len(finished))
                    delta = self.commit_row(seq, e.token, e.error)
                    if seq.seq_id in forked and not delta.finished:
                        self.scheduler.adopt(seq)
                    deltas.append(delta)
                    traces.append(row_of(seq, e, position, delta.finished))
                    if delta.finished:
                        finished.append(seq.seq_id)
                        break
            except Exception as exc:  # noqa: BLE001 - this sequence's commit raised (its tokenizer's decode, its
                # grammar's accept): it alone ends, without the token it could not commit; its batch-mates go on
                message = f"committing its token failed: {one_line(exc)}"
                del seq.token_ids[max(position, seq.num_prompt_tokens) :]  # the token, its delta and row dropped
                del deltas[marks[0] :], traces[marks[1] :], finished[marks[2] :]
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
                deltas.append(self.fail(seq, message))
                finished.append(seq.seq_id)
                failed.append((seq.request_id, message))
                continue
            if verified and not seq.is_finished:
                # rejected drafts: their K/V is dropped and blocks past the sequence are returned
                seq.num_computed_tokens = seq.num_tokens - 1
                self.block_manager.truncate(seq.seq_id, seq.num_tokens)
            if verified and self.speculator is not None:
                self.speculator.rewind(seq.seq_id, seq.num_tokens - 1)
        for chunk in batch.chunks:
            seq = requests[chunk.seq_id]
            self.block_manager.commit_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        return Committed(
            tuple(traces),
            tuple(d for d in deltas if d.text or d.token_ids or d.finished),
            tuple(finished),
            tuple(failed),
        )

    def commit_row(self, seq: Sequence, token: int, error: str | None) -> TextDelta:
        """One sampling result into its sequence: token, grammar, text, stop conditions."""
        now = time.perf_counter()
        if error is not None:
            update = self.text(seq, final=True)
            self.finish(seq, FinishReason.ERROR, f"error: {error}", None, now)
            return TextDelta(seq.request_id, seq.stream, update.delta, (), True, seq.finish_reason.value)
        seq.token_ids.append(token)
        seq.status = SequenceStatus.DECODING
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        p = seq.sampling
        stop: tuple[FinishReason, str, int | str | None] | None = None
        if seq.grammar is not None and not self.grammar().accept(seq.grammar, token):
            update = self.text(seq, final=True)
            self.finish(seq, FinishReason.ERROR, f"error: grammar rejected token {token}", None, now)
            return TextDelta(seq.request_id, seq.stream, update.delta, (token,), True, seq.finish_reason.value)
        if token in self.eos_token_ids and not p.ignore_eos:
            stop = (FinishReason.STOP, "eos", None)
        elif token in p.stop_token_ids:
            stop = (FinishReason.STOP, f"stop_token_id:{token}", token)
        elif seq.grammar is not None and self.grammar().finished(seq.grammar):
            stop = (FinishReason.STOP, "grammar", None)  # the structured output is complete
        num_tokens = len(seq.token_ids)
        max_tokens = num_tokens - seq.num_prompt_tokens >= p.max_tokens
        max_model_len = num_tokens >= self.max_model_len
        update = self.text(seq, final=stop is not None or max_tokens or max_model_len)
        if stop is None and update.stop_string is not None:
            stop = (FinishReason.STOP, f"stop_str:{update.stop_string}", update.stop_string)
        if stop is None and max_tokens:
            stop = (FinishReason.LENGTH, "max_tokens", None)
        if stop is None and max_model_len:
            stop = (FinishReason.LENGTH, "max_model_len", None)
        if stop is not None:
            self.finish(seq, stop[0], stop[1], stop[2], now)
        return TextDelta(
            seq.request_id,
            seq.stream,
            update.delta,
            (token,),
            stop is not None,
            seq.finish_reason.value if stop is not None else None,
        )

    def text(self, seq: Sequence, *, final: bool) -> TextUpdate:
        """Advance the sequence's text and stop-string matcher (no text without a tokenizer)."""
        if self.tokenizer is None:
            return NO_TEXT
        p = seq.sampling
        return update_text(
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens),
            seq.token_ids,
            p.stop,
            seq.stop_state,
            check_stops=seq.num_output_tokens >= p.min_tokens,
            include_stop=p.include_stop_str_in_output,
            final=final,
            first=seq.num_prompt_tokens,
        )

    def finish(self, seq: Sequence, reason: FinishReason, detail: str, stop_reason, now: float) -> None:
        if self.speculator is not None:
            self.speculator.release(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.finish_detail, seq.stop_reason = reason, detail, stop_reason
        seq.finish_time = now
        self.last_finish_time = now
        self.scheduler.finish(seq)

    def fail_requests(
        self,
        failed: Mapping[str, str],
        committed: Committed,
        requests: Mapping[str, Sequence],
        groups: Mapping[str, list[str]],
    ) -> Committed:
        """End every sequence of the `failed` requests (request id -> why; toolkit.engine.isolate found them)
        after the step's commit: their deltas, finished ids and reasons join the step's."""
        deltas, finished = [], []
        for request_id, message in failed.items():
            print(f"engine: request {request_id}: {message}", file=sys.stderr, flush=True)
            for seq_id in groups[request_id]:
                if not requests[seq_id].is_finished:
                    deltas.append(self.fail(requests[seq_id], message))
                    finished.append(seq_id)
        return Committed(
            committed.traces,
            committed.deltas + tuple(deltas),
            committed.finished + tuple(finished),
            committed.failed + tuple(failed.items()),
        )

    def fail(self, seq: Sequence, message: str) -> TextDelta:
        """End a sequence whose step raised an exception for it alone (finish_reason "error", `message` its
        detail), with no token and no trace row: nothing was sampled for it."""
        seq.followers = []
        if seq.is_finished:  # finished by the token whose commit then raised: the error is what it ended with
            seq.finish_reason, seq.finish_detail, seq.stop_reason = FinishReason.ERROR, f"error: {message}", None
        else:
            self.finish(seq, FinishReason.ERROR, f"error: {message}", None, time.perf_counter())
        return TextDelta(seq.request_id, seq.stream, "", (), True, FinishReason.ERROR.value)

    def abort(self, seqs: list[Sequence], step: int) -> None:
        """Finish every sequence of a request now, before `step` (finish_reason "abort"): no token, no trace row."""
        now = time.perf_counter()
        for seq in seqs:
            seq.followers = []
            if not seq.is_finished:
                seq.abort_step = step
                self.finish(seq, FinishReason.ABORT, "abort", None, now)


class StepRows:
    """A step's SampleTrace rows: the fields the step fixes read once, a row's own from its sequence and emit."""

    def __init__(self, batch: ScheduledBatch, allowed: dict[int, int], start_time: float):
        self.step, self.batch_size, self.step_tokens = batch.step, len(batch.chunks), batch.num_tokens
        self.allowed, self.start_time = allowed, start_time

    def __call__(self, seq: Sequence, e: Emit, position: int, finished: bool) -> SampleTrace:
        p = seq.sampling
        return SampleTrace.from_fields(
            {
                "request_id": seq.request_id,
                "stream": seq.stream,
                "step": self.step,
                "position": position,
                "token_id": e.token,
                "raw_logprob": e.raw_logprob,
                "processed_logprob": e.processed_logprob,
                "support_size": e.support,
                "top_raw": e.top_raw,
                "top_processed": e.top_processed,
                "processors": p.pipeline_description(),
                "temperature": p.temperature,
                "top_k": p.top_k,
                "top_p": p.top_p,
                "min_p": p.min_p,
                "seed": seq.seed,
                "noise": e.noise,
                "batch_size": self.batch_size,
                "step_tokens": self.step_tokens,
                "finish_reason": seq.finish_reason.value if finished else None,
                "stop_reason": seq.finish_detail if finished else None,
                "error": e.error,
                "t_emit_s": time.perf_counter() - self.start_time,
                "logits_row": e.row,
                "grammar_allowed": self.allowed.get(e.row),
                "origin": e.origin,
                "draft_logprob": e.draft_logprob,
                "spec_proposed": e.spec_proposed,
                "spec_accepted": e.spec_accepted,
                "kept_sha256": e.kept_sha256,
            }
        )
