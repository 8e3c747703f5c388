"""The engine: the only orchestrator.

    step():  arrivals -> schedule -> run model (ONE forward) -> sample -> commit

Data flows one way: requests -> ScheduledBatch -> logits -> SampleResult; `_commit` is the
single place where results feed back into request state (tokens, cache progress, stop).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch

from toolkit.config import EngineConfig, ModelConfig, SamplingParams, from_mapping
from toolkit.errors import ConfigError, RequestError
from toolkit.kv import BlockManager, PagedKVCache
from toolkit.models import LoadedModel, load_model
from toolkit.request import FinishReason, Request, RequestStatus
from toolkit.runner import ModelRunner
from toolkit.sampling import SampleRow, sample
from toolkit.scheduler import ScheduledBatch, Scheduler


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
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    finished: bool
    seed: int
    metrics: RequestMetrics


@dataclass(frozen=True)
class SampledToken:
    request_id: str
    position: int  # position of the sampled token in the request's sequence
    token_id: int
    logprob: float  # raw log-probability of the token under the model
    noise: float  # Gumbel noise of the chosen token (NaN when greedy)


@dataclass(frozen=True)
class StepOutput:
    step: int
    batch_size: int  # sequences in the forward
    num_decode_tokens: int
    num_prefill_tokens: int
    sampled: tuple[SampledToken, ...]
    logits_RV: torch.Tensor | None  # raw logits behind `sampled`, row i <-> sampled[i]
    finished: tuple[str, ...]
    preempted: tuple[str, ...]
    kv_blocks_used: int


def derive_seed(run_seed: int, request_id: str) -> int:
    """A request's seed when it gave none: a stable function of the run seed and its id."""
    digest = hashlib.sha256(f"{run_seed}/{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Engine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig | None = None,
                 default_sampling: SamplingParams | None = None):
        self.cfg = cfg or EngineConfig()
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.default_sampling = default_sampling or SamplingParams()
        self.device = torch.device(self.cfg.device)
        arch = loaded.arch
        self.max_model_len = self.cfg.max_model_len or arch.max_position_embeddings
        if self.max_model_len > arch.max_position_embeddings:
            raise ConfigError(f"engine.max_model_len ({self.max_model_len}) exceeds the model's "
                              f"max_position_embeddings ({arch.max_position_embeddings})")
        eos = set(arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        layers, kv_heads, head_dim = loaded.model.kv_shape
        self.kv_cache = PagedKVCache(layers, self.cfg.num_kv_blocks, self.cfg.block_size, kv_heads, head_dim,
                                     dtype=loaded.model.embed.dtype, device=self.device)
        self.block_manager = BlockManager(self.cfg.num_kv_blocks, self.cfg.block_size)
        self.scheduler = Scheduler(self.cfg, self.block_manager)
        self.runner = ModelRunner(loaded.model, self.kv_cache, self.device)
        self.requests: dict[str, Request] = {}
        self.step_index = 0
        self.first_admission_time: float | None = None
        self.last_finish_time: float | None = None
        self._next_id = 0

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "Engine":
        """Build from a composed config with `model`, `engine` and optional `sampling` sections."""
        engine_cfg = from_mapping(EngineConfig, _plain(cfg.get("engine")), section="engine")
        model_cfg = from_mapping(ModelConfig, _plain(cfg.get("model")), section="model")
        sampling = SamplingParams.from_mapping(_plain(cfg.get("sampling")))
        if engine_cfg.num_threads:
            torch.set_num_threads(engine_cfg.num_threads)
        if engine_cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"engine.device={engine_cfg.device} but CUDA is not available; use engine.device=cpu")
        return cls(load_model(model_cfg, engine_cfg.device), engine_cfg, sampling)

    # ------------------------------------------------------------------ requests in

    def add_request(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                    prompt_token_ids: Sequence[int] | None = None,
                    sampling_params: SamplingParams | Mapping[str, Any] | None = None,
                    request_id: str | None = None, arrival_step: int | None = None) -> str:
        """Validate and queue a request; returns its id. Raises RequestError on bad input."""
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        request_id = str(request_id)
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        params = self._sampling(sampling_params)
        ids, text = self._prompt_ids(prompt, messages, prompt_token_ids)
        self._check_fits(request_id, len(ids), params.max_tokens)
        if arrival_step is not None and not (isinstance(arrival_step, int) and arrival_step >= 0):
            raise RequestError(f"arrival_step must be a non-negative integer, got {arrival_step!r}")
        request = Request(
            request_id=request_id,
            prompt_token_ids=tuple(ids),
            sampling=params,
            seed=params.seed if params.seed is not None else derive_seed(self.cfg.seed, request_id),
            arrival_step=max(arrival_step or 0, self.step_index),
            prompt_text=text,
            add_time=time.perf_counter(),
        )
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _sampling(self, params: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
        if params is None:
            return self.default_sampling
        if isinstance(params, SamplingParams):
            return params
        merged = {**self.default_sampling.to_dict(), **dict(params)}
        try:
            return SamplingParams.from_mapping(merged)
        except ConfigError as exc:
            raise RequestError(str(exc)) from None

    def _prompt_ids(self, prompt, messages, prompt_token_ids) -> tuple[list[int], str | None]:
        given = [x is not None for x in (prompt, messages, prompt_token_ids)]
        if sum(given) != 1:
            raise RequestError("give exactly one of prompt, messages or prompt_token_ids")
        vocab = self.loaded.arch.vocab_size
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise RequestError("prompt_token_ids must be a list of integers")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
            text = self.tokenizer.decode(ids) if self.tokenizer else None
        else:
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer matching its vocabulary; give prompt_token_ids")
            if messages is not None:
                ids, text = self.tokenizer.apply_chat_template(messages), None
                text = self.tokenizer.decode(ids, skip_special_tokens=False)
            else:
                if not isinstance(prompt, str):
                    raise RequestError(f"prompt must be a string, got {type(prompt).__name__}")
                ids, text = self.tokenizer.encode(prompt), prompt
        if not ids:
            raise RequestError("the prompt is empty")
        return ids, text

    def _check_fits(self, request_id: str, prompt_len: int, max_tokens: int) -> None:
        if prompt_len >= self.max_model_len:
            raise RequestError(f"request {request_id}: prompt has {prompt_len} tokens but the context is "
                               f"{self.max_model_len} (engine.max_model_len); shorten the prompt")
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            raise RequestError(f"request {request_id}: prompt ({prompt_len}) + max_tokens ({max_tokens}) = {total} "
                               f"exceeds engine.max_model_len ({self.max_model_len}); lower max_tokens")
        pool = self.cfg.num_kv_blocks * self.cfg.block_size
        if total > pool:
            raise RequestError(f"request {request_id}: prompt + max_tokens = {total} tokens can never fit the KV pool "
                               f"of {pool} tokens; raise engine.num_kv_blocks or lower max_tokens")

    # ------------------------------------------------------------------ the step

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> StepOutput:
        step = self.step_index
        now = time.perf_counter()
        for request in self.scheduler.arrivals(step):
            request.arrival_time = now
        batch = self.scheduler.schedule(step)
        if batch.is_empty:
            nxt = self.scheduler.next_arrival_step
            self.step_index = nxt if (nxt is not None and nxt > step) else step + 1
            return self._output(batch, (), None, ())
        if self.first_admission_time is None:
            self.first_admission_time = now
        out = self.runner.run(batch)
        rows = [self._sample_row(chunk.request_id, chunk.context_len) for chunk in out.sample_chunks]
        result = sample(out.logits_RV, rows)
        sampled = tuple(
            SampledToken(request_id=chunk.request_id, position=chunk.context_len, token_id=int(tok),
                         logprob=float(lp), noise=float(nz))
            for chunk, tok, lp, nz in zip(out.sample_chunks, result.token_ids.tolist(), result.logprobs.tolist(),
                                          result.noise.tolist())
        )
        finished = self._commit(batch, sampled)
        self.step_index = step + 1
        return self._output(batch, sampled, out.logits_RV, finished)

    def _sample_row(self, request_id: str, position: int) -> SampleRow:
        r = self.requests[request_id]
        return SampleRow(temperature=r.sampling.temperature, seed=r.seed, position=position, stream=r.stream)

    def _commit(self, batch: ScheduledBatch, sampled: tuple[SampledToken, ...]) -> tuple[str, ...]:
        """The one place where model results feed back into request state."""
        now = time.perf_counter()
        for chunk in batch.chunks:
            request = self.requests[chunk.request_id]
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            request.num_computed_tokens = chunk.context_len
        finished = []
        for s in sampled:
            request = self.requests[s.request_id]
            request.token_ids.append(s.token_id)
            request.status = RequestStatus.DECODING
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            reason = self._stop_reason(request, s.token_id)
            if reason is not None:
                request.finish_reason, request.finish_detail = reason
                request.status = RequestStatus.FINISHED
                request.finish_time = now
                self.scheduler.finish(request)
                finished.append(request.request_id)
        if finished:
            self.last_finish_time = now
        return tuple(finished)

    def _stop_reason(self, request: Request, token_id: int) -> tuple[FinishReason, str] | None:
        params = request.sampling
        if token_id in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP, "eos"
        if token_id in params.stop_token_ids:
            return FinishReason.STOP, "stop_token_ids"
        if request.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH, "max_tokens"
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, "max_model_len"
        return None

    def _output(self, batch: ScheduledBatch, sampled, logits, finished) -> StepOutput:
        return StepOutput(step=batch.step, batch_size=len(batch.chunks), num_decode_tokens=batch.num_decode_tokens,
                          num_prefill_tokens=batch.num_prefill_tokens, sampled=tuple(sampled), logits_RV=logits,
                          finished=tuple(finished), preempted=batch.preempted,
                          kv_blocks_used=self.block_manager.num_used_blocks)

    def abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            raise RequestError(f"unknown request id {request_id!r}")
        if request.is_finished:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason, request.finish_detail = FinishReason.ABORT, "aborted"
        request.finish_time = time.perf_counter()
        self.scheduler.finish(request)

    # ------------------------------------------------------------------ results out

    def output(self, request_id: str) -> RequestOutput:
        r = self.requests[request_id]
        text = self.tokenizer.decode(r.output_token_ids) if self.tokenizer else ""
        return RequestOutput(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            output_token_ids=tuple(r.output_token_ids),
            text=text,
            finish_reason=r.finish_reason.value if r.finish_reason else None,
            finished=r.is_finished,
            seed=r.seed,
            metrics=request_metrics(r),
        )

    def run_until_done(self) -> list[StepOutput]:
        steps = []
        while self.has_unfinished():
            steps.append(self.step())
        return steps

    def generate(self, requests: Iterable[Mapping[str, Any] | str]) -> list[RequestOutput]:
        """Add every request (a prompt string or a dict of add_request's arguments), run, return outputs in order."""
        ids = []
        for spec in requests:
            ids.append(self.add_request(spec) if isinstance(spec, str) else self.add_request(**spec))
        self.run_until_done()
        return [self.output(i) for i in ids]


def request_metrics(r: Request) -> RequestMetrics:
    start = r.arrival_time
    since = lambda t: None if (t is None or start is None) else t - start  # noqa: E731
    tpot = None
    if r.first_token_time is not None and r.last_token_time is not None and r.num_output_tokens > 1:
        tpot = (r.last_token_time - r.first_token_time) / (r.num_output_tokens - 1)
    return RequestMetrics(arrival_step=r.arrival_step, admitted_step=r.admitted_step,
                          queue_s=since(r.first_scheduled_time), ttft_s=since(r.first_token_time), tpot_s=tpot,
                          e2e_s=since(r.finish_time), num_preemptions=r.num_preemptions)


def _plain(section: Any) -> dict[str, Any]:
    if section is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(section, DictConfig):
            return OmegaConf.to_container(section, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover
        pass
    return dict(section)
