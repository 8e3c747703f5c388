"""The engine: the only orchestrator.

    step():  arrivals -> schedule -> run model (ONE forward) -> processors -> sample -> commit -> trace

Data flows one way: requests -> ScheduledBatch -> logits -> processed logits -> samples;
`_commit_row` is the single place where results feed back into sequence state (tokens,
text, stop conditions, finishing). Each step returns the SampleTrace rows it produced.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from toolkit.config import EngineConfig, ModelConfig, SamplingParams, from_mapping
from toolkit.errors import ConfigError, RequestError
from toolkit.grammar import GrammarBackend
from toolkit.kv import BlockManager, PagedKVCache
from toolkit.models import LoadedModel, load_model
from toolkit.processors import BatchView, RowState, apply_pipeline, invalid_rows
from toolkit.processors.masks import resolve_bad_words
from toolkit.request import FinishReason, Request, RequestStatus
from toolkit.runner import ModelRunner
from toolkit.sampling import SampleRow, sample
from toolkit.scheduler import Scheduler
from toolkit.stop import TextUpdate, update_text
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
class CompletionOutput:
    """One sample of a request (vLLM's CompletionOutput)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: int | str | None
    seed: int
    metrics: RequestMetrics


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool

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
        self.vocab_size = arch.vocab_size
        self.max_model_len = self.cfg.max_model_len or arch.max_position_embeddings
        if self.max_model_len > arch.max_position_embeddings:
            raise ConfigError(f"engine.max_model_len ({self.max_model_len}) exceeds the model's "
                              f"max_position_embeddings ({arch.max_position_embeddings})")
        eos = set(arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(t for t in eos if t < self.vocab_size))
        layers, kv_heads, head_dim = loaded.model.kv_shape
        self.num_kv_blocks = self.cfg.num_kv_blocks or self._auto_num_blocks(layers, kv_heads, head_dim)
        block_bytes = 2 * layers * self.cfg.block_size * kv_heads * head_dim * loaded.model.embed.element_size()
        num_host_blocks = int(self.cfg.swap_space_gb * 2**30 // block_bytes) if self.cfg.preemption_mode == "swap" else 0
        self.kv_cache = PagedKVCache(layers, self.num_kv_blocks, self.cfg.block_size, kv_heads, head_dim,
                                     dtype=loaded.model.embed.dtype, device=self.device, num_host_blocks=num_host_blocks)
        self.block_manager = BlockManager(self.num_kv_blocks, self.cfg.block_size,
                                          enable_prefix_caching=self.cfg.enable_prefix_caching,
                                          num_host_blocks=num_host_blocks)
        self.scheduler = Scheduler(self.cfg, self.block_manager)
        self.attention_backend = self._attention_backend()
        self.runner = ModelRunner(loaded.model, self.kv_cache, self.device, self.attention_backend)
        self._grammar: GrammarBackend | None = None  # created on the first structured-output request
        self.requests: dict[str, Request] = {}  # by sequence id
        self.groups: dict[str, list[str]] = {}  # request id -> its sequence ids
        self.step_index = 0
        self.start_time: float | None = None
        self.first_admission_time: float | None = None
        self.last_finish_time: float | None = None
        self._next_id = 0

    def _auto_num_blocks(self, layers: int, kv_heads: int, head_dim: int) -> int:
        """As many blocks as engine.kv_cache_memory_gb holds, but no more than max_num_seqs full-length
        sequences could ever use."""
        element = torch.empty((), dtype=self.loaded.model.embed.dtype).element_size()
        block_bytes = 2 * layers * self.cfg.block_size * kv_heads * head_dim * element
        budget = int(self.cfg.kv_cache_memory_gb * 2**30 // block_bytes)
        useful = self.cfg.max_num_seqs * -(-self.max_model_len // self.cfg.block_size)
        return max(1, min(budget, useful))

    @property
    def grammar(self) -> GrammarBackend:
        if self._grammar is None:
            if self.tokenizer is None:
                raise RequestError("structured outputs need a tokenizer that matches the model's vocabulary")
            self._grammar = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids or (0,),
                                           threads=max(1, torch.get_num_threads()))
        return self._grammar

    def _attention_backend(self) -> str:
        """auto: the native kernel on CPU fp32 when it compiles, else torch's sdpa path."""
        wanted = self.cfg.attention_backend
        if wanted == "sdpa":
            return "sdpa"
        problem = None
        if self.device.type != "cpu" or self.loaded.model.embed.dtype != torch.float32:
            problem = "the native kernel runs on the CPU in float32 only"
        else:
            from toolkit.kernels import KernelUnavailable, load_paged_attention

            try:
                load_paged_attention()
            except KernelUnavailable as exc:
                problem = str(exc)
        if problem is None:
            return "kernel"
        if wanted == "kernel":
            raise ConfigError(f"engine.attention_backend=kernel is unavailable: {problem}")
        return "sdpa"

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
                    request_id: str | None = None, arrival_step: int | None = None, priority: int = 0) -> str:
        """Validate and queue a request (n sequences when n > 1); returns its id. Raises RequestError.

        With n > 1 only sample 0 is prefilled; the other samples fork its blocks (copy-on-write)
        when its prompt is done and sample their first token from the same logits, each with
        its own RNG stream."""
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        request_id = str(request_id)
        if request_id in self.groups:
            raise RequestError(f"request id {request_id!r} is already in use")
        if "#" in request_id:
            raise RequestError(f"request id {request_id!r} must not contain '#' (reserved for parallel samples)")
        params = self._sampling(sampling_params)
        ids, text = self._prompt_ids(prompt, messages, prompt_token_ids)
        self._check_fits(request_id, len(ids), params.max_tokens)
        self._check_token_ids(params)
        bad_words_ids = self._bad_words_ids(params)
        if params.structured_outputs is not None:
            self.grammar.compile(params.structured_outputs)  # an invalid grammar is refused here
        if arrival_step is not None and not (isinstance(arrival_step, int) and arrival_step >= 0):
            raise RequestError(f"arrival_step must be a non-negative integer, got {arrival_step!r}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestError(f"priority must be an integer, got {priority!r}")
        if params.n > self.cfg.max_num_seqs:
            raise RequestError(f"n={params.n} parallel samples exceed engine.max_num_seqs ({self.cfg.max_num_seqs})")
        seed = params.seed if params.seed is not None else derive_seed(self.cfg.seed, request_id)
        now = time.perf_counter()
        seq_ids = []
        for stream in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{stream}"
            seq = Request(seq_id=seq_id, request_id=request_id, prompt_token_ids=tuple(ids), sampling=params,
                          seed=seed, arrival_step=max(arrival_step or 0, self.step_index), prompt_text=text,
                          stream=stream, bad_words_ids=bad_words_ids, add_time=now, priority=priority)
            if params.structured_outputs is not None:
                seq.grammar = self.grammar.matcher(params.structured_outputs)
            self.requests[seq_id] = seq
            seq_ids.append(seq_id)
        leader = self.requests[seq_ids[0]]
        leader.followers = seq_ids[1:]
        self.scheduler.add(leader)
        self.groups[request_id] = seq_ids
        return request_id

    def _sampling(self, params: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
        if params is None:
            return self.default_sampling
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, Mapping):
            raise RequestError(f"sampling must be a mapping of SamplingParams fields, got {params!r}")
        merged = {**self.default_sampling.to_dict(), **dict(params)}
        try:
            return SamplingParams.from_mapping(merged)
        except ConfigError as exc:
            raise RequestError(str(exc)) from None

    def _prompt_ids(self, prompt, messages, prompt_token_ids) -> tuple[list[int], str | None]:
        given = [x is not None for x in (prompt, messages, prompt_token_ids)]
        if sum(given) != 1:
            raise RequestError("give exactly one of prompt, messages or prompt_token_ids")
        if prompt_token_ids is not None:
            if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence):
                raise RequestError("prompt_token_ids must be a list of integers")
            ids = list(prompt_token_ids)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise RequestError("prompt_token_ids must be a list of integers")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            text = self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer else None
        else:
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer matching its vocabulary; give prompt_token_ids")
            if messages is not None:
                ids = self.tokenizer.apply_chat_template(messages)
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
        pool = self.num_kv_blocks * self.cfg.block_size
        if total > pool:
            raise RequestError(f"request {request_id}: prompt + max_tokens = {total} tokens can never fit the KV pool "
                               f"of {pool} tokens; raise engine.num_kv_blocks or lower max_tokens")

    def _check_token_ids(self, params: SamplingParams) -> None:
        v = self.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids),
                          ("logit_bias", tuple(params.logit_bias or ())),
                          ("bad_words", tuple(t for w in params.bad_words if isinstance(w, tuple) for t in w))):
            bad = [t for t in ids or () if t >= v]
            if bad:
                raise RequestError(f"{name} holds token id {bad[0]}, outside the vocabulary [0, {v})")

    def _bad_words_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        try:
            return resolve_bad_words(params.bad_words, self.tokenizer)
        except ValueError as exc:
            raise RequestError(str(exc)) from None

    # ------------------------------------------------------------------ the step

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> StepOutput:
        step = self.step_index
        now = time.perf_counter()
        if self.start_time is None:
            self.start_time = now
        for seq in self.scheduler.arrivals(step):
            seq.arrival_time = now
        batch = self.scheduler.schedule(step)
        for seq_id, mode in batch.preempted:
            seq = self.requests[seq_id]
            if mode == "recompute" and seq.grammar is not None:  # rebuilt from the committed tokens
                seq.grammar = self.grammar.matcher(seq.sampling.structured_outputs, seq.output_token_ids)
        if batch.is_empty:
            nxt = self.scheduler.next_arrival_step
            self.step_index = nxt if (nxt is not None and nxt > step) else step + 1
            return self._step_output(batch)
        if self.first_admission_time is None:
            self.first_admission_time = now
        for chunk in batch.chunks:
            seq = self.requests[chunk.seq_id]
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now

        out = self.runner.run(batch)  # the ONE forward of this step
        # rows to sample: one per sampling chunk, plus the parallel samples a finished prompt forks
        seqs, logits_rows, forks = [], [], []
        for row, chunk in enumerate(out.sample_chunks):
            seq = self.requests[chunk.seq_id]
            seqs.append(seq)
            logits_rows.append(row)
            if seq.followers and seq.num_output_tokens == 0:
                for follower_id in seq.followers:
                    seqs.append(self.requests[follower_id])
                    logits_rows.append(row)
                    forks.append((seq, self.requests[follower_id]))
                seq.followers = []
        logits_RV = out.logits_RV
        if len(logits_rows) != logits_RV.shape[0]:
            logits_RV = logits_RV.index_select(0, torch.tensor(logits_rows, device=logits_RV.device))
        grammar_rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        grammar_mask = None
        allowed: dict[int, int] = {}
        if grammar_rows:  # every grammar row's bitmask of this step in one call
            masks = self.grammar.fill_masks([seqs[i].grammar for i in grammar_rows]).to(logits_RV.device)
            grammar_mask = torch.ones(logits_RV.shape, dtype=torch.bool, device=logits_RV.device)
            grammar_mask[torch.tensor(grammar_rows, device=logits_RV.device)] = masks
            allowed = dict(zip(grammar_rows, masks.sum(dim=-1).tolist()))
        view = BatchView(rows=tuple(RowState(s.sampling, s.token_ids, s.num_prompt_tokens, s.bad_words_ids)
                                    for s in seqs),
                         vocab_size=self.vocab_size, device=logits_RV.device, eos_token_ids=self.eos_token_ids,
                         grammar_mask_RV=grammar_mask)
        lse_R = torch.logsumexp(logits_RV, dim=-1)
        pipe = apply_pipeline(logits_RV, view, row_errors=invalid_rows(lse_R))
        good = [i for i in range(len(seqs)) if i not in pipe.errors]
        result = None
        if good:
            rows = [SampleRow(greedy=seqs[i].sampling.greedy, seed=seqs[i].seed, position=seqs[i].num_tokens,
                              stream=seqs[i].stream, num_top=seqs[i].sampling.logprobs or 0) for i in good]
            if len(good) == len(seqs):
                result = sample(logits_RV, pipe.processed_RV, rows, lse_R)
            else:
                index = torch.tensor(good, device=logits_RV.device)
                result = sample(logits_RV.index_select(0, index), pipe.processed_RV.index_select(0, index), rows,
                                lse_R.index_select(0, index))

        # ---- commit: the one place where results feed back into sequence state
        for chunk in batch.chunks:
            seq = self.requests[chunk.seq_id]
            seq.num_computed_tokens = chunk.context_len
            self.block_manager.commit_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        for leader, follower in forks:
            self.block_manager.fork(leader.seq_id, follower.seq_id)
            follower.num_computed_tokens = leader.num_computed_tokens
            follower.arrival_time, follower.admitted_step = leader.arrival_time, step
            follower.first_scheduled_time = leader.first_scheduled_time
        traces, deltas, finished = [], [], []
        slot = {row: j for j, row in enumerate(good)}
        forked = {f.seq_id for _, f in forks}
        for i, seq in enumerate(seqs):
            j = slot.get(i)
            token = result.token_ids[j] if j is not None else -1
            position = seq.num_tokens
            delta = self._commit_row(seq, token, pipe.errors.get(i))
            if seq.seq_id in forked and not delta.finished:
                self.scheduler.adopt(seq)
            deltas.append(delta)
            if delta.finished:
                finished.append(seq.seq_id)
            p = seq.sampling
            traces.append(SampleTrace(
                request_id=seq.request_id, stream=seq.stream, step=step, position=position, token_id=token,
                raw_logprob=result.raw_logprobs[j] if j is not None else float("nan"),
                processed_logprob=result.processed_logprobs[j] if j is not None else float("nan"),
                support_size=result.support_sizes[j] if j is not None else 0,
                top_raw=tuple(result.top_raw[j]) if j is not None else (),
                top_processed=tuple(result.top_processed[j]) if j is not None else (),
                processors=tuple(p.pipeline_description()), temperature=p.temperature, top_k=p.top_k,
                top_p=p.top_p, min_p=p.min_p, seed=seq.seed,
                noise=result.noise[j] if j is not None else float("nan"),
                batch_size=len(batch.chunks), step_tokens=batch.num_tokens,
                finish_reason=seq.finish_reason.value if delta.finished else None,
                stop_reason=seq.finish_detail if delta.finished else None,
                error=pipe.errors.get(i), t_emit_s=time.perf_counter() - self.start_time, logits_row=i,
                grammar_allowed=allowed.get(i),
            ))
        self.step_index = step + 1
        return self._step_output(batch, tuple(traces), logits_RV,
                                 tuple(d for d in deltas if d.text or d.token_ids or d.finished), tuple(finished))

    def _step_output(self, batch, traces=(), logits_RV=None, deltas=(), finished=()) -> StepOutput:
        used = self.block_manager.num_used_blocks
        return StepOutput(step=batch.step, batch_size=len(batch.chunks), num_decode_tokens=batch.num_decode_tokens,
                          num_prefill_tokens=batch.num_prefill_tokens, samples=traces, logits_RV=logits_RV,
                          deltas=deltas, finished=finished, preempted=batch.preempted, kv_blocks_used=used,
                          kv_utilization=used / self.num_kv_blocks, prefix_hit_tokens=batch.prefix_hit_tokens)

    def _commit_row(self, seq: Request, token: int, error: str | None) -> TextDelta:
        """The one place where a sampling result feeds back into sequence state."""
        now = time.perf_counter()
        if error is not None:
            update = self._text(seq, final=True)
            self._finish(seq, FinishReason.ERROR, f"error: {error}", None, now)
            return TextDelta(seq.request_id, seq.stream, update.delta, (), True, seq.finish_reason.value)
        seq.token_ids.append(token)
        seq.status = RequestStatus.DECODING
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        p = seq.sampling
        stop: tuple[FinishReason, str, int | str | None] | None = None
        if seq.grammar is not None and not self.grammar.accept(seq.grammar, token):
            update = self._text(seq, final=True)
            self._finish(seq, FinishReason.ERROR, f"error: grammar rejected token {token}", None, now)
            return TextDelta(seq.request_id, seq.stream, update.delta, (token,), True, seq.finish_reason.value)
        if token in self.eos_token_ids and not p.ignore_eos:
            stop = (FinishReason.STOP, "eos", None)
        elif token in p.stop_token_ids:
            stop = (FinishReason.STOP, f"stop_token_id:{token}", token)
        elif seq.grammar is not None and self.grammar.finished(seq.grammar):
            stop = (FinishReason.STOP, "grammar", None)  # the structured output is complete
        at_length = seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len
        update = self._text(seq, final=stop is not None or at_length)
        if stop is None and update.stop_string is not None:
            stop = (FinishReason.STOP, f"stop_str:{update.stop_string}", update.stop_string)
        if stop is None and seq.num_output_tokens >= p.max_tokens:
            stop = (FinishReason.LENGTH, "max_tokens", None)
        if stop is None and seq.num_tokens >= self.max_model_len:
            stop = (FinishReason.LENGTH, "max_model_len", None)
        if stop is not None:
            self._finish(seq, stop[0], stop[1], stop[2], now)
        return TextDelta(seq.request_id, seq.stream, update.delta, (token,), stop is not None,
                         seq.finish_reason.value if stop is not None else None)

    def _text(self, seq: Request, *, final: bool) -> TextUpdate:
        """Advance the sequence's text and stop-string matcher (no text without a tokenizer)."""
        if self.tokenizer is None:
            return TextUpdate(delta="", stop_string=None, text="")
        p = seq.sampling
        update = update_text(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens),
                             seq.output_token_ids, p.stop, seq.stop_state,
                             check_stops=seq.num_output_tokens >= p.min_tokens,
                             include_stop=p.include_stop_str_in_output, final=final)
        seq.text = update.text
        return update

    def _finish(self, seq: Request, reason: FinishReason, detail: str, stop_reason, now: float) -> None:
        seq.status = RequestStatus.FINISHED
        seq.finish_reason, seq.finish_detail, seq.stop_reason = reason, detail, stop_reason
        seq.finish_time = now
        self.last_finish_time = now
        self.scheduler.finish(seq)

    def abort(self, request_id: str) -> None:
        """Finish every sequence of a request now (finish_reason "abort") and free its blocks."""
        if request_id not in self.groups:
            raise RequestError(f"unknown request id {request_id!r}")
        now = time.perf_counter()
        for seq_id in self.groups[request_id]:
            seq = self.requests[seq_id]
            seq.followers = []
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT, "abort", None, now)

    # ------------------------------------------------------------------ results out

    def output(self, request_id: str) -> RequestOutput:
        seqs = [self.requests[s] for s in self.groups[request_id]]
        first = seqs[0]
        return RequestOutput(
            request_id=request_id, prompt=first.prompt_text, prompt_token_ids=first.prompt_token_ids,
            outputs=tuple(CompletionOutput(index=s.stream, text=s.text, token_ids=tuple(s.output_token_ids),
                                           finish_reason=s.finish_reason.value if s.finish_reason else None,
                                           stop_reason=s.stop_reason, seed=s.seed, metrics=request_metrics(s))
                          for s in seqs),
            finished=all(s.is_finished for s in seqs),
        )

    def run_until_done(self) -> list[StepOutput]:
        steps = []
        while self.has_unfinished():
            steps.append(self.step())
        return steps

    def _add_all(self, requests: Iterable[Mapping[str, Any] | str]) -> list[str]:
        return [self.add_request(spec) if isinstance(spec, str) else self.add_request(**spec) for spec in requests]

    def generate(self, requests: Iterable[Mapping[str, Any] | str]) -> list[RequestOutput]:
        """Add every request (a prompt string or a dict of add_request's arguments), run, return outputs in order."""
        ids = self._add_all(requests)
        self.run_until_done()
        return [self.output(i) for i in ids]

    def stream(self, requests: Iterable[Mapping[str, Any] | str] = ()) -> Iterator[TextDelta]:
        """Add the requests, then yield text deltas step by step until every request has finished."""
        self._add_all(requests)
        while self.has_unfinished():
            yield from self.step().deltas


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
