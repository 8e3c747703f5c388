"""Async scheduling (engine.async_scheduling): the next step is scheduled and its forward queued before this step's
tokens are read and committed, so that on a GPU the host's commit, trace rows and next schedule run while the device
computes, instead of between its steps (vLLM's `async_scheduling`).

    step k:   schedule, forward, decide staged (the sampler's work queued, its token on the device)
              -> lookahead (here): step k+1's batch, where it does not depend on step k's tokens
              -> its forward queued, each row's input token fed from step k's choice on the device (never read)
              -> step k read and committed (the device meanwhile computes step k+1)
              -> step k+1's decide staged; held (Ahead) until the next Engine.step resolves it the same way

A sequence that step k's commit ends (a stop token, a stop string, its grammar) was computed in step k+1 too: its row
is dropped there, before step k+1 is decided. Where the next step could be anything else (arrivals, prompts,
preemptions, drafts, parallel samples forking) there is no lookahead, and the next step is scheduled as usual. On
the CPU nothing overlaps (the forward holds every core): the same order runs, step k's choice read first, so CI
tests every path. The schedule is a function of the engine's state alone, so a run replays bit for bit; with
engine.batch_invariant=true every row has the bits it has without async scheduling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from toolkit.config import EngineConfig, SpeculativeConfig
from toolkit.devices import tensor_on
from toolkit.engine.commit import Committed, Committer
from toolkit.engine.decide import Decider, Decision, Staged
from toolkit.engine.digests import RowDigests, commit_decided
from toolkit.engine.request import Sequence
from toolkit.engine.runner import ModelOutput, ModelRunner
from toolkit.engine.scheduler import FED, ScheduledBatch, ScheduledChunk, Scheduler
from toolkit.errors import ConfigError


@dataclass
class Ahead:
    """A step scheduled, its forward run (or queued on the device) and its decide staged, not yet committed."""

    batch: ScheduledBatch
    out: ModelOutput
    staged: Staged


class Pipeline:
    """The engine's async scheduling: its stages (shared with the engine, never the engine itself: an engine in a
    reference cycle would keep its KV cache until the cycle collector runs) and the step it has queued."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        decider: Decider,
        committer: Committer,
        requests: Mapping[str, Sequence],
    ):
        self.scheduler, self.runner, self.decider, self.committer = scheduler, runner, decider, committer
        self.requests, self.max_model_len = requests, committer.max_model_len
        self.queued: Ahead | None = None  # the next step: its forward run or queued, its decide staged

    @classmethod
    def of(
        cls,
        cfg: EngineConfig,
        speculative: SpeculativeConfig,
        scheduler: Scheduler,
        runner: ModelRunner,
        decider: Decider,
        committer: Committer,
        requests: Mapping[str, Sequence],
    ) -> Pipeline | None:
        """The engine's pipeline where engine.async_scheduling asks for one (a ConfigError with speculative
        decoding, whose drafts are built from the step before's tokens on the host), else None."""
        if not cfg.async_scheduling:
            return None
        if speculative.enabled:
            raise ConfigError(
                "engine.async_scheduling=true does not combine with speculative decoding: a step's drafts are "
                "built from the step before's tokens on the host"
            )
        return cls(scheduler, runner, decider, committer, requests)

    def take(self, keep: bool = False) -> Ahead | None:
        """The queued step, unless every sequence in it ended since (aborted): then None, and it is dropped (the
        engine schedules that step anew). `keep`: leave a live one queued."""
        queued = self.queued
        if queued is not None and all(self.requests[c.seq_id].is_finished for c in queued.batch.chunks):
            queued = self.queued = None
        if not keep:
            self.queued = None
        return queued

    def resolve(
        self, step: Ahead, digests: bool, start_time: float | None
    ) -> tuple[ScheduledBatch, Committed, torch.Tensor, float, int, RowDigests | None]:
        """The step after `step` scheduled and its forward queued (fed `step`'s choices where they were made), then
        `step` read and committed, then the queued step's decide staged (self.queued, for the next call). Its rows
        as staged: rows of sequences aborted since are dropped at the commit. A failure before the commit is the
        step's, as it would be without the lookahead (CommitFailed: the commit's); a lookahead that fails is
        dropped, and the engine schedules that step anew. Returns the step's StepOutput's parts: its batch, what it
        committed, the logits it decided from, its forward's seconds and count, its rows' digests."""
        batch, out, staged = step.batch, step.out, step.staged
        decision = queued = None
        if not staged.forks:  # parallel samples leave their leader at the commit: they join the step after
            tokens_R = staged.sampling.device_tokens()
            if tokens_R is None:  # the CPU: the choice is read first
                decision = self.decider.finish(staged)
                tokens_R = row_tokens(decision, len(staged.rows), out.logits_RV.device)
            queued = self._look_ahead(batch, out, tokens_R)
        if decision is None:
            decision = self.decider.finish(staged)
        batch, decision = without_finished(batch, decision, self.requests)
        committed, rows, _ = commit_decided(self.committer, batch, decision, {}, self.requests, start_time, digests)
        if queued is not None:
            self.queued = self._stage(*queued)
        return batch, committed, decision.logits_RV, out.forward_s, 1, rows

    def _look_ahead(
        self, batch: ScheduledBatch, out: ModelOutput, tokens_R: torch.Tensor
    ) -> tuple[ScheduledBatch, ModelOutput] | None:
        """The step after `batch` (lookahead) and its forward, fed `batch`'s choices (one decided row a
        sampling chunk); None where there is none, or it failed."""
        finishing = {c.seq_id for c in batch.chunks if ends_by_length(self.requests[c.seq_id], self.max_model_len)}
        nxt = lookahead(self.scheduler, batch.step + 1, batch, finishing)
        if nxt is None:
            return None
        try:
            return nxt, self.runner.run(nxt, fed_ids=fed_ids(out, tokens_R, nxt))
        except Exception:  # noqa: BLE001 - the step is scheduled anew, with the engine's isolation of failures
            return None

    def _stage(self, batch: ScheduledBatch, out: ModelOutput) -> Ahead | None:
        """The queued step's decide staged (its sampler's work queued), without the sequences the commit just ended;
        None where none is left, or staging failed (the engine schedules the step anew)."""
        batch, out = live(batch, out, self.requests)
        if not batch.chunks:
            return None
        try:
            return Ahead(batch, out, self.decider.stage(out, {}, self.requests))
        except Exception:  # noqa: BLE001 - as above
            return None


def ends_by_length(seq: Sequence, max_model_len: int) -> bool:
    """Whether the token a sequence samples now ends it whatever it is: its max_tokens, or the model's length."""
    return seq.num_output_tokens + 1 >= seq.sampling.max_tokens or seq.num_tokens + 1 >= max_model_len


def row_tokens(decision: Decision, rows: int, device: torch.device) -> torch.Tensor:
    """Each decided row's token as a tensor (a row with an error: 0, its sequence ends at the commit): what the
    next step's forward is fed where the choice was read first (the CPU)."""
    tokens = [0] * rows
    for _, emits in decision.emits:
        for e in emits:
            if e.error is None:
                tokens[e.row] = e.token
    return tensor_on(tokens, device, torch.int64)


def fed_ids(out: ModelOutput, tokens_R: torch.Tensor, nxt: ScheduledBatch) -> torch.Tensor:
    """The lookahead batch's input tokens: each chunk's sequence's choice in the step before (its rows in
    out.sample_chunks' order), gathered where the choices are. Where every row decodes again in the same order (no
    sequence ended by its length), the choices are the input as they are: no index to copy over, no gather."""
    if len(nxt.chunks) == len(out.sample_chunks) and all(
        a.seq_id == b.seq_id for a, b in zip(nxt.chunks, out.sample_chunks)
    ):
        return tokens_R
    row_of = {c.seq_id: i for i, c in enumerate(out.sample_chunks)}
    index = tensor_on([row_of[c.seq_id] for c in nxt.chunks], tokens_R.device, torch.int64)  # no wait for step k
    return tokens_R.index_select(0, index)


def live(
    batch: ScheduledBatch, out: ModelOutput, requests: Mapping[str, Sequence]
) -> tuple[ScheduledBatch, ModelOutput]:
    """The batch and its forward's rows without the sequences that ended since it was scheduled (a stop at the
    step before, an abort); one logits row a chunk."""
    keep = [i for i, c in enumerate(batch.chunks) if not requests[c.seq_id].is_finished]
    if len(keep) == len(batch.chunks):
        return batch, out
    chunks = tuple(batch.chunks[i] for i in keep)
    index = tensor_on(keep, out.logits_RV.device, torch.int64)
    return (
        dataclasses.replace(batch, chunks=chunks, num_decode_tokens=len(chunks)),
        ModelOutput(out.logits_RV.index_select(0, index), chunks, out.forward_s),
    )


def without_finished(
    batch: ScheduledBatch, decision: Decision, requests: Mapping[str, Sequence]
) -> tuple[ScheduledBatch, Decision]:
    """A decided step without the sequences that ended after its decide was staged (an abort between steps)."""
    gone = {c.seq_id for c in batch.chunks if requests[c.seq_id].is_finished}
    if not gone:
        return batch, decision
    chunks = tuple(c for c in batch.chunks if c.seq_id not in gone)
    emits = [(seq, e) for seq, e in decision.emits if seq.seq_id not in gone]
    return (
        dataclasses.replace(batch, chunks=chunks, num_decode_tokens=len(chunks)),
        dataclasses.replace(decision, emits=emits),
    )


def lookahead(scheduler: Scheduler, step: int, batch: ScheduledBatch, finishing: set[str]) -> ScheduledBatch | None:
    """Async scheduling: step `step`'s batch before `batch` (the step before) is committed, where it does not
    depend on the tokens `batch` samples: every running sequence sampled its one token in `batch` and decodes
    it now, as schedule() would decode it once `batch` is committed (the same chunks, in the same order, each
    token FED). Sequences in `finishing` end at that commit whatever they sample (their length): left out. A
    sequence that ends there for its token (a stop) is computed and its row dropped. None where the step could
    be anything else: arrivals due, sequences waiting, a prefill under way, drafts, a budget or KV pool too
    small for every decode without a preemption."""
    sampled = {c.seq_id: c for c in batch.chunks if c.samples and c.num_logits == 1 and not c.draft_slots}
    due = scheduler.next_arrival_step is not None and scheduler.next_arrival_step <= step
    if due or scheduler.waiting or len(sampled) != len(batch.chunks) or not scheduler.running:
        return None
    decoding = [s for s in scheduler.running if s.seq_id not in finishing]
    if any(s.seq_id not in sampled for s in scheduler.running) or not decoding:
        return None
    if len(decoding) > scheduler.cfg.max_num_batched_tokens:
        return None
    starts = [sampled[s.seq_id].context_len for s in decoding]
    copies = scheduler.blocks.write_rows([(s.seq_id, p, p + 1) for s, p in zip(decoding, starts)])
    if copies is None:
        return None
    chunks = tuple(
        ScheduledChunk(seq.seq_id, (FED,), start, scheduler.blocks.table(seq.seq_id), samples=True)
        for seq, start in zip(decoding, starts)
    )
    return ScheduledBatch(step, chunks, len(chunks), 0, block_copies=tuple(copies))
