"""The engine: the only orchestrator. A step reads like its diagram:

    arrivals -> schedule -> propose -> ONE forward -> decide -> commit -> outputs (trace rows, deltas)

Each stage is a unit with one job:
    toolkit.engine.intake       RequestIntake: what a caller sends -> validated sequences (raises RequestError)
    toolkit.engine.backends     the attention and matmul backends, KV pool size and KV scales, chosen once
    toolkit.engine.scheduler    Scheduler: arrivals, admission, token budget, chunked prefill, preemption
    toolkit.engine.speculative  Speculator: draft tokens for the slots the scheduler reserved
    toolkit.engine.runner       ModelRunner: ScheduledBatch -> packed tensors -> the ONE forward -> logits rows
    toolkit.engine.decide       Decider: logits rows -> processors -> sampled / verified tokens (a Decision)
    toolkit.engine.commit       Committer: the Decision into the sequences, and one SampleTrace row per token
    toolkit.engine.digests      decide and commit with the decided rows' sha256 hashed beside the Python
    toolkit.engine.outputs      StepOutput, TextDelta, RequestOutput: what the engine hands out
    toolkit.engine.queries      EngineQueries, EngineStats: what a caller may ask (nothing reaches further in)

A request enters as one typed EngineRequest (toolkit.engine.request), through `add`, and leaves through `step`'s
StepOutput, `output` and `release`; `abort` ends it early.

One owner per piece of a sequence's state (toolkit.engine.request.Sequence); nothing else writes it:
    intake       creates it: ids, prompt, sampling, seed, bad words, grammar matcher, followers
    engine.step  arrival_time (when it arrives), first_scheduled_time (its first step)
    scheduler    status PENDING / WAITING / PREFILLING (and DECODING on admission or adoption),
                 admitted_step, num_computed_tokens when admitted from the prefix cache or preempted,
                 num_preemptions, preempted_steps, preemption_modes; its blocks, through the BlockManager
    committer    token_ids, status DECODING / FINISHED, num_computed_tokens after the forward, text and
                 stop-string state, the grammar matcher (advanced per committed token, rebuilt after a
                 recompute preemption), finish fields, token times, followers (cleared once forked)
    decider      nothing: it reads, and looks ahead through drafts on forks of the grammar matcher
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from toolkit.config import EngineConfig, ModelConfig, SpeculativeConfig, from_mapping
from toolkit.engine.ahead import Ahead, Pipeline
from toolkit.engine.backends import (
    attention_backend,
    check_device,
    context_scale,
    graph_mode,
    keep_freed_memory,
    kv_pool,
    matmul_backend,
)
from toolkit.engine.commit import Committed, Committer
from toolkit.engine.decide import Decider, Decision
from toolkit.engine.digests import CommitFailed, RowDigests, decide_and_commit, now_
from toolkit.engine.intake import RequestIntake, derive_seed
from toolkit.engine.isolate import find_culprits, prober, without
from toolkit.engine.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    StepOutput,
    TextDelta,
    request_metrics,
    request_output,
)
from toolkit.engine.queries import EngineQueries, EngineStats
from toolkit.engine.request import EngineRequest, Sequence
from toolkit.engine.runner import ModelOutput, ModelRunner
from toolkit.engine.scheduler import ScheduledBatch, Scheduler
from toolkit.engine.speculative import DraftContext, Proposal, Speculator
from toolkit.errors import ConfigError, RequestError
from toolkit.kv import BlockManager
from toolkit.models import LoadedModel, load_model
from toolkit.native.sha import ShaJob
from toolkit.sampling.grammar import GrammarBackend, LazyGrammar
from toolkit.sampling.params import SamplingParams

__all__ = [
    "CompletionOutput",
    "Engine",
    "EngineRequest",
    "EngineStats",
    "RequestMetrics",
    "RequestOutput",
    "StepOutput",
    "TextDelta",
    "derive_seed",
    "keep_freed_memory",
    "load_for",
    "request_metrics",
]


class Engine(EngineQueries):
    def __init__(
        self,
        loaded: LoadedModel,
        cfg: EngineConfig | None = None,
        default_sampling: SamplingParams | None = None,
        speculative: SpeculativeConfig | None = None,
    ):
        self.cfg = cfg or EngineConfig()
        keep_freed_memory()
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.default_sampling = default_sampling or SamplingParams()
        self.device = torch.device(self.cfg.device)
        arch = loaded.arch
        self.vocab_size = arch.vocab_size
        self.max_model_len = self.cfg.max_model_len or arch.max_position_embeddings
        if self.max_model_len > arch.max_position_embeddings:
            raise ConfigError(
                f"engine.max_model_len ({self.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({arch.max_position_embeddings})"
            )
        eos = set(arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(t for t in eos if t < self.vocab_size))
        self.attention_backend = attention_backend(self.cfg, loaded)
        self.graph_mode = graph_mode(self.cfg, self.attention_backend)  # "off": no scratch block for padded rows
        self.kv_cache, self.num_kv_blocks, num_host_blocks = kv_pool(
            self.cfg, loaded, self.max_model_len, scratch=self.graph_mode != "off"
        )
        self.block_manager = BlockManager(
            self.num_kv_blocks, self.cfg.block_size, self.cfg.enable_prefix_caching, num_host_blocks
        )
        self.scheduler = Scheduler(self.cfg, self.block_manager, context_scale(self.cfg, arch))
        self.matmul_backend = matmul_backend(self.cfg, loaded)
        self.runner = ModelRunner(
            loaded.model,
            self.kv_cache,
            self.device,
            self.attention_backend,
            batch_invariant=self.cfg.batch_invariant,
            native_matmul=self.matmul_backend == "native",
            matmul_schedule=self.cfg.matmul_schedule,
            flex_compile=self.cfg.flex_compile,
            two_forwards=self.cfg.scheduler_policy == "two_forwards",
            graphs=(self.graph_mode, self.cfg.max_num_seqs, self.max_model_len),
        )
        self.matmul_schedule = self.runner.matmul_schedule  # the native CPU matmul's loops per rows (or None)
        # created on the first structured-output request; the stages share it without a reference back to the
        # engine (an engine in a reference cycle would keep its KV cache until the cycle collector runs)
        self._grammar_backend = LazyGrammar(self.tokenizer, self.vocab_size, self.eos_token_ids or (0,))
        self.spec_cfg = speculative or SpeculativeConfig()
        self.speculator = Speculator.build(self.spec_cfg, self) if self.spec_cfg.enabled else None
        self.intake = RequestIntake(
            self.cfg,
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            self.num_kv_blocks,
            self.default_sampling,
            self._grammar_backend,
            self.eos_token_ids,
        )
        self.decider = Decider(
            self.vocab_size,
            self.eos_token_ids,
            self._grammar_backend,
            self.speculator,
            self.spec_cfg.acceptance,
            self.cfg.batch_invariant,
        )
        self.committer = Committer(
            self.tokenizer,
            self.eos_token_ids,
            self.max_model_len,
            self._grammar_backend,
            self.scheduler,
            self.block_manager,
            self.speculator,
        )
        self.requests: dict[str, Sequence] = {}  # by sequence id
        self.groups: dict[str, list[str]] = {}  # request id -> its sequence ids
        self.step_index = 0
        self.start_time: float | None = None
        self.first_admission_time: float | None = None
        self._hashing: ShaJob | None = None  # the last step's trace digests, hashed on beside this step's Python
        # engine.async_scheduling: the next step queued before this one is committed (toolkit/engine/ahead.py)
        self.pipeline = Pipeline.of(
            self.cfg, self.spec_cfg, self.scheduler, self.runner, self.decider, self.committer, self.requests
        )
        self.model_sampling_defaults: dict[str, Any] = {}  # sampling fields taken from the model (from_config)

    @property
    def grammar(self) -> GrammarBackend:
        return self._grammar_backend()

    @property
    def last_finish_time(self) -> float | None:
        return self.committer.last_finish_time

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> Engine:
        """Build from a composed config with `model`, `engine` and optional `sampling` sections."""
        engine_cfg = from_mapping(EngineConfig, _plain(cfg.get("engine")), section="engine")
        model_cfg = from_mapping(ModelConfig, _plain(cfg.get("model")), section="model")
        SamplingParams.from_mapping(_plain(cfg.get("sampling")))  # a bad value is refused before the load
        speculative = from_mapping(SpeculativeConfig, _plain(cfg.get("speculative")), section="speculative")
        loaded, sampling, taken = load_for(model_cfg, engine_cfg, _plain(cfg.get("sampling")))
        engine = cls(loaded, engine_cfg, sampling, speculative)
        engine.model_sampling_defaults = taken
        return engine

    # ------------------------------------------------------------------ requests in

    def add(self, request: EngineRequest) -> str:
        """Validate and queue a request (n sequences when n > 1); returns its id. Raises RequestError.

        With n > 1 only sample 0 is prefilled; the other samples fork its blocks (copy-on-write)
        when its prompt is done and sample their first token from the same logits, each with
        its own RNG stream."""
        # with a step already queued (async scheduling) the earliest a request can join is the one after it
        step = self.step_index + (self.pipeline is not None and self.pipeline.queued is not None)
        seqs = self.intake.sequences(request, step_index=step, taken=self.groups)
        for seq in seqs:
            self.requests[seq.seq_id] = seq
        self.groups[seqs[0].request_id] = [s.seq_id for s in seqs]
        self.scheduler.add(seqs[0])
        return seqs[0].request_id

    def add_request(self, prompt: str | None = None, **fields: Any) -> str:
        """`add(EngineRequest(prompt, **fields))`: vLLM's spelling, for a caller with keyword arguments."""
        try:
            request = EngineRequest(prompt, **fields)
        except TypeError as exc:
            raise RequestError(f"bad request: {exc}") from None
        return self.add(request)

    # ------------------------------------------------------------------ the step

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self, *, trace_digests: bool = False) -> StepOutput:
        """One step: schedule, one forward, decide, commit. `trace_digests` (whoever writes the trace): the
        sha256 of every decided logits row too, in StepOutput.logits_sha256 for TraceWriter.write_output,
        hashed on the other threads beside this step's Python and the next one's (see _decide_and_commit).
        With engine.async_scheduling the step may have been scheduled and queued by the call before (ahead.py)."""
        queued = self.pipeline.take() if self.pipeline is not None else None
        if queued is not None:
            try:
                return self._resolved(*self.pipeline.resolve(queued, trace_digests, self.start_time))
            except CommitFailed as exc:
                raise exc.__cause__ from None
            except Exception:  # noqa: BLE001 - nothing committed: the step is scheduled anew below, failures isolated
                pass
        step, now = self.step_index, time.perf_counter()
        # the last step's rows still to hash go on beside this step's scheduling and packing
        hashing, self._hashing = self._hashing, None
        beside = hashing.beside if hashing is not None else now_
        self._arrive(step, now)
        spec = self.speculator
        batch = beside(
            lambda: self.scheduler.schedule(
                step, spec.draft_slots(self.scheduler.running, self.max_model_len) if spec is not None else {}
            )
        )
        self.committer.preempted(batch.preempted, self.requests)
        if batch.is_empty:
            return self._idle(batch)
        self._scheduled(batch, now)
        self.runner.move_blocks(batch)  # once (a retried forward must not copy again), before a self-draft writes
        if self.speculator is not None:
            batch, proposals = self.speculator.fill(
                batch, self.requests, DraftContext(self.block_manager.block_table, self.decider.draft_sample)
            )
        else:
            proposals = {}
        forwards = self.runner.num_forwards
        try:
            # the ONE forward of this step (two with scheduler_policy=two_forwards)
            out = self.runner.run(batch, beside=beside, move_blocks=False)
            if self.pipeline is not None and not proposals:  # the next step queued before this one is read
                current = Ahead(batch, out, self.decider.stage(out, proposals, self.requests))
                return self._resolved(*self.pipeline.resolve(current, trace_digests, self.start_time))
            decision, committed, digests = self._decide_and_commit(batch, out, proposals, trace_digests)
        except CommitFailed as exc:  # sequences changed: nothing to retry
            raise exc.__cause__ from None
        except Exception as exc:  # noqa: BLE001 - a request that fails alone fails alone; the step goes on
            probe = prober(self.runner, self.decider, self.requests, proposals)
            failed = find_culprits(batch, exc, probe, lambda c: self.requests[c.seq_id].request_id)
            batch, proposals = without(batch, proposals, failed, self.requests)
            out = self.runner.run(batch, move_blocks=False)
            try:
                decision, committed, digests = self._decide_and_commit(batch, out, proposals, trace_digests)
            except CommitFailed as again:
                raise again.__cause__ from None
            committed = self.committer.fail_requests(failed, committed, self.requests, self.groups)
        self.step_index = step + 1
        return self._step_output(
            batch, committed, decision.logits_RV, out.forward_s, self.runner.num_forwards - forwards, digests
        )

    # ---- step stages ---------------------------------------------------------------------

    def _arrive(self, step: int, now: float) -> None:
        if self.start_time is None:
            self.start_time = now
        for seq in self.scheduler.arrivals(step):
            seq.arrival_time = now

    def _scheduled(self, batch: ScheduledBatch, now: float) -> None:
        if self.first_admission_time is None:
            self.first_admission_time = now
        for chunk in batch.chunks:
            seq = self.requests[chunk.seq_id]
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now

    def _idle(self, batch: ScheduledBatch) -> StepOutput:
        """Nothing to run: jump to the next arrival."""
        nxt = self.scheduler.next_arrival_step
        self.step_index = nxt if (nxt is not None and nxt > batch.step) else batch.step + 1
        return self._step_output(batch)

    def _resolved(self, batch: ScheduledBatch, *rest) -> StepOutput:
        """A step async scheduling committed: Pipeline.resolve's batch and the rest of _step_output's arguments."""
        self.step_index = batch.step + 1
        return self._step_output(batch, *rest)

    def _decide_and_commit(
        self, batch: ScheduledBatch, out: ModelOutput, proposals: Mapping[str, Proposal], digests: bool
    ) -> tuple[Decision, Committed, RowDigests | None]:
        """The decide and commit stages, with the decided rows' digests (toolkit.engine.digests)."""
        decision, committed, rows, self._hashing = decide_and_commit(
            self.decider, self.committer, batch, out, proposals, self.requests, self.start_time, digests
        )
        return decision, committed, rows

    def _step_output(self, batch: ScheduledBatch, *rest) -> StepOutput:
        """StepOutput of `batch` (outputs.step_output: what it committed, its logits, forward seconds and count,
        digests) with the KV pool's use now."""
        return step_output(batch, self.block_manager.num_used_blocks, self.num_kv_blocks, *rest)

    def abort(self, request_id: str) -> None:
        """Finish every sequence of a request now, before the next step (finish_reason "abort"), and free its
        blocks; the request's trace row records that step (abort_step) so that a replay aborts it there too."""
        if request_id not in self.groups:
            raise RequestError(f"unknown request id {request_id!r}")
        self.committer.abort([self.requests[s] for s in self.groups[request_id]], self.step_index)
        if self.pipeline is not None:
            self.pipeline.take(keep=True)  # a queued step of aborted sequences alone is dropped

    # ------------------------------------------------------------------ results out

    def output(self, request_id: str) -> RequestOutput:
        return request_output(request_id, [self.requests[s] for s in self.groups[request_id]])

    def release(self, request_id: str) -> RequestOutput:
        """The output of a finished request, which the engine then forgets (a long-running server
        calls this so that memory does not grow with every request ever served)."""
        if request_id not in self.groups:
            raise RequestError(f"unknown request id {request_id!r}")
        out = self.output(request_id)
        if not out.finished:
            raise RequestError(f"request {request_id!r} is still running; abort it first")
        for seq_id in self.groups.pop(request_id):
            del self.requests[seq_id]
        return out

    def run_until_done(self) -> list[StepOutput]:
        steps = []
        while self.has_unfinished():
            steps.append(self.step())
        return steps

    def _add_all(self, requests: Iterable[EngineRequest | Mapping[str, Any] | str]) -> list[str]:
        return [
            self.add(r)
            if isinstance(r, EngineRequest)
            else self.add_request(r)
            if isinstance(r, str)
            else self.add_request(**r)
            for r in requests
        ]

    def generate(self, requests: Iterable[EngineRequest | Mapping[str, Any] | str]) -> list[RequestOutput]:
        """Add every request (an EngineRequest, a prompt string or a dict of its fields), run, return outputs in
        order."""
        ids = self._add_all(requests)
        self.run_until_done()
        return [self.output(i) for i in ids]

    def stream(self, requests: Iterable[EngineRequest | Mapping[str, Any] | str] = ()) -> Iterator[TextDelta]:
        """Add the requests, then yield text deltas step by step until every request has finished."""
        self._add_all(requests)
        while self.has_unfinished():
            yield from self.step().deltas


def step_output(
    batch: ScheduledBatch,
    kv_used: int,
    kv_blocks: int,
    committed: Committed | None = None,
    logits_RV: torch.Tensor | None = None,
    forward_s: float = 0.0,
    forwards: int = 0,
    digests: RowDigests | None = None,
) -> StepOutput:
    """What a step hands out: its batch's shape, what it committed, and the KV pool's use (`kv_used` of
    `kv_blocks` blocks)."""
    return StepOutput(
        step=batch.step,
        batch_size=len(batch.chunks),
        num_decode_tokens=batch.num_decode_tokens,
        num_prefill_tokens=batch.num_prefill_tokens,
        samples=committed.traces if committed else (),
        logits_RV=logits_RV,
        deltas=committed.deltas if committed else (),
        finished=committed.finished if committed else (),
        preempted=batch.preempted,
        kv_blocks_used=kv_used,
        kv_utilization=kv_used / kv_blocks,
        prefix_hit_tokens=batch.prefix_hit_tokens,
        forward_s=forward_s,
        forwards=forwards,
        logits_sha256=digests,
        failed=committed.failed if committed else (),
    )


def load_for(
    model_cfg: ModelConfig, engine_cfg: EngineConfig, sampling: Mapping[str, Any] | None
) -> tuple[LoadedModel, SamplingParams, dict[str, Any]]:
    """The weights an engine runs (on its device, with its threads), the run's default sampling with the
    model's own defaults where the run leaves the library's (model.generation_config=auto), and which
    fields came from the model."""
    if engine_cfg.num_threads:
        torch.set_num_threads(engine_cfg.num_threads)
    check_device(engine_cfg)
    loaded = load_model(model_cfg, engine_cfg.device)
    generation = loaded.generation if model_cfg.generation_config == "auto" else {}
    default_sampling, taken = SamplingParams.with_model_defaults(sampling, generation)
    return loaded, default_sampling, taken


def _plain(section: Any) -> dict[str, Any]:
    if section is None:
        return {}
    try:
        if isinstance(section, DictConfig):
            return OmegaConf.to_container(section, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover
        pass
    return dict(section)
