"""The engine: the only orchestrator.

    step():  arrivals -> schedule -> run model (ONE forward) -> processors -> sample -> commit -> trace

Data flows one way: requests -> ScheduledBatch -> logits -> processed logits -> samples;
`_commit_row` is the single place where results feed back into sequence state (tokens,
text, stop conditions, finishing). Each step returns the SampleTrace rows it produced.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import hashlib
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from toolkit.config import EngineConfig, ModelConfig, SamplingParams, SpeculativeConfig, from_mapping
from toolkit.errors import ConfigError, RequestError
from toolkit.grammar import GrammarBackend
from toolkit import rng
from toolkit.speculative import PLAIN, Proposal, Speculator, verify
from toolkit.kv import BlockManager, PagedKVCache
from toolkit.models import LoadedModel, load_model
from toolkit.processors import BatchView, RowState, apply_pipeline, invalid_rows
from toolkit.processors.masks import resolve_bad_words
from toolkit.request import FinishReason, Request, RequestStatus
from toolkit.runner import ModelRunner
from toolkit.sampling import SampleRow, logsumexp_rows, sample
from toolkit.scheduler import ScheduledBatch, ScheduledChunk, Scheduler
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
    forward_s: float = 0.0  # the model's forward alone: the rest of the step is host work


@functools.lru_cache(maxsize=None)
def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed blocks of up to 256 MB in the heap instead of unmapping them.
    Every step allocates and frees (rows x vocabulary) logits blocks and activations of several MB;
    returned to the kernel, each new one page-faults on first touch: at 64 rows this made the
    processors' elementwise ops 3-5x slower than in isolation (temperature 6 ms, masked_fill 8 ms a
    step on the EPYC). Other C libraries: nothing to do, False."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 256 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


def derive_seed(run_seed: int, request_id: str) -> int:
    """A request's seed when it gave none: a stable function of the run seed and its id."""
    digest = hashlib.sha256(f"{run_seed}/{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Engine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig | None = None,
                 default_sampling: SamplingParams | None = None, speculative: SpeculativeConfig | None = None):
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
            raise ConfigError(f"engine.max_model_len ({self.max_model_len}) exceeds the model's "
                              f"max_position_embeddings ({arch.max_position_embeddings})")
        eos = set(arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(t for t in eos if t < self.vocab_size))
        layers, kv_heads, head_dim = loaded.model.kv_shape
        block_bytes = PagedKVCache.block_bytes(layers, self.cfg.block_size, kv_heads, head_dim, loaded.model.embed.dtype,
                                               self.cfg.kv_cache_dtype, self.cfg.kv_scale_granularity)
        self.num_kv_blocks = self.cfg.num_kv_blocks or self._auto_num_blocks(block_bytes)
        num_host_blocks = int(self.cfg.swap_space_gb * 2**30 // block_bytes) if self.cfg.preemption_mode == "swap" else 0
        self.kv_cache = PagedKVCache(layers, self.num_kv_blocks, self.cfg.block_size, kv_heads, head_dim,
                                     dtype=loaded.model.embed.dtype, device=self.device, num_host_blocks=num_host_blocks,
                                     kv_dtype=self.cfg.kv_cache_dtype, granularity=self.cfg.kv_scale_granularity)
        if self.kv_cache.granularity == "tensor":
            self._calibrate_kv_scales()
        self.block_manager = BlockManager(self.num_kv_blocks, self.cfg.block_size,
                                          enable_prefix_caching=self.cfg.enable_prefix_caching,
                                          num_host_blocks=num_host_blocks)
        self.scheduler = Scheduler(self.cfg, self.block_manager)
        self.attention_backend = self._attention_backend()
        self.matmul_backend = self._matmul_backend()
        self.runner = ModelRunner(loaded.model, self.kv_cache, self.device, self.attention_backend,
                                  batch_invariant=self.cfg.batch_invariant,
                                  native_matmul=self.matmul_backend == "native", flex_compile=self.cfg.flex_compile)
        self._grammar: GrammarBackend | None = None  # created on the first structured-output request
        self.spec_cfg = speculative or SpeculativeConfig()
        self.speculator = Speculator.build(self.spec_cfg, self) if self.spec_cfg.enabled else None
        self.requests: dict[str, Request] = {}  # by sequence id
        self.groups: dict[str, list[str]] = {}  # request id -> its sequence ids
        self.step_index = 0
        self.start_time: float | None = None
        self.first_admission_time: float | None = None
        self.last_finish_time: float | None = None
        self._next_id = 0

    def _calibrate_kv_scales(self) -> None:
        """Static per-tensor KV scales from one prefill of a fixed calibration text in full precision
        (the built-in passages, or fixed ids without a tokenizer): the same scales on every run."""
        from toolkit.kv.quant import FORMATS
        from toolkit.workload import _passages

        length = min(512, self.max_model_len)
        ids = self.tokenizer.encode(" ".join(_passages()), add_special_tokens=False)[:length] if self.tokenizer \
            else [(7 * i + 3) % self.vocab_size for i in range(length)]
        layers, kv_heads, head_dim = self.loaded.model.kv_shape
        blocks = -(-len(ids) // self.cfg.block_size)
        probe = PagedKVCache(layers, blocks, self.cfg.block_size, kv_heads, head_dim, self.loaded.model.embed.dtype,
                             self.device)
        chunk = ScheduledChunk("calibration", tuple(ids), 0, tuple(range(blocks)), samples=True, num_logits=1)
        ModelRunner(self.loaded.model, probe, self.device, "sdpa").run(
            ScheduledBatch(step=0, chunks=(chunk,), num_decode_tokens=0, num_prefill_tokens=len(ids)))
        used = [(k.flatten(0, 1)[: len(ids)], v.flatten(0, 1)[: len(ids)]) for k, v in probe.layers]
        self.kv_cache.calibrate(used, FORMATS[self.cfg.kv_cache_dtype][1])

    def _auto_num_blocks(self, block_bytes: int) -> int:
        """As many blocks as engine.kv_cache_memory_gb holds, but no more than max_num_seqs full-length
        sequences could ever use."""
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
        """auto: the native kernel on CPU fp32 when it builds here and takes the model's shapes, else torch's
        sdpa path (one warning line on stderr when the kernels do not build: toolkit.kernels.native)."""
        from toolkit.kernels import KernelUnavailable, native

        wanted = self.cfg.attention_backend
        if wanted == "flex" and self.cfg.kv_cache_dtype != "auto":
            raise ConfigError(f"engine.attention_backend=flex reads the cache as stored; use engine.kv_cache_dtype=auto "
                              f"or attention_backend=sdpa with kv_cache_dtype={self.cfg.kv_cache_dtype}")
        if wanted in ("sdpa", "flex"):
            return wanted
        problem = None
        arch = self.loaded.arch
        unsupported = arch.needs_torch_attention
        if unsupported:
            problem = f"the native kernel has no {unsupported} ({arch.family})"
        elif self.cfg.kv_cache_dtype == "bf16":
            problem = "the native kernel reads an fp32 or 8-bit cache, not engine.kv_cache_dtype=bf16"
        elif self.device.type != "cpu" or self.loaded.model.embed.dtype != torch.float32:
            problem = "the native kernel runs on the CPU in float32 only"
        else:
            try:
                lib = native()
            except KernelUnavailable as exc:
                problem = str(exc)
            else:
                quantized = self.cfg.kv_cache_dtype != "auto"
                if not lib.attention_supports(arch.num_heads, arch.num_kv_heads, arch.head_dim, self.cfg.block_size,
                                              quantized):
                    problem = (f"the native kernel reads an 8-bit cache at head_dim 64 or 128 with <= 32 heads, not "
                               f"engine.kv_cache_dtype={self.cfg.kv_cache_dtype} at head_dim {arch.head_dim} with "
                               f"{arch.num_heads} heads" if quantized else
                               f"the native kernel takes head_dim <= 256, <= 32 query heads per KV head and "
                               f"engine.block_size <= 64, not head_dim {arch.head_dim}, {arch.num_heads} heads over "
                               f"{arch.num_kv_heads} KV heads, block_size {self.cfg.block_size}")
        if problem is None:
            return "kernel"
        if self.cfg.batch_invariant:
            raise ConfigError(f"engine.batch_invariant=true is unavailable here: {problem}")
        if wanted == "kernel":
            raise ConfigError(f"engine.attention_backend=kernel is unavailable: {problem}")
        return "sdpa"

    def _matmul_backend(self) -> str:
        """auto: the native packed matmul on CPU fp32 when the kernels build (faster than torch's GEMM at
        every step size measured here, see README "Benchmark"), else torch's."""
        from toolkit.kernels import KernelUnavailable, native

        wanted = "native" if self.cfg.batch_invariant else self.cfg.matmul_backend
        if wanted == "torch":
            return "torch"
        problem = None
        if self.device.type != "cpu" or self.loaded.model.embed.dtype != torch.float32:
            problem = "the native matmul runs on the CPU in float32 only"
        else:
            try:
                native()
            except KernelUnavailable as exc:
                problem = str(exc)
        if problem is None:
            return "native"
        if self.cfg.batch_invariant:
            raise ConfigError(f"engine.batch_invariant=true is unavailable here: {problem}")
        if wanted == "native":
            raise ConfigError(f"engine.matmul_backend=native is unavailable: {problem}")
        return "torch"

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "Engine":
        """Build from a composed config with `model`, `engine` and optional `sampling` sections."""
        engine_cfg = from_mapping(EngineConfig, _plain(cfg.get("engine")), section="engine")
        model_cfg = from_mapping(ModelConfig, _plain(cfg.get("model")), section="model")
        sampling = SamplingParams.from_mapping(_plain(cfg.get("sampling")))
        speculative = from_mapping(SpeculativeConfig, _plain(cfg.get("speculative")), section="speculative")
        if engine_cfg.num_threads:
            torch.set_num_threads(engine_cfg.num_threads)
        if engine_cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"engine.device={engine_cfg.device} but CUDA is not available; use engine.device=cpu")
        return cls(load_model(model_cfg, engine_cfg.device), engine_cfg, sampling, speculative)

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
        batch = self.scheduler.schedule(step, self._draft_slots())
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
        batch, proposals = self._propose(batch)

        out = self.runner.run(batch)  # the ONE forward of this step
        rows, forks = self._rows(out, proposals)
        logits_RV = out.logits_RV
        if len(rows) != logits_RV.shape[0] or any(r.logits_row != i for i, r in enumerate(rows)):
            logits_RV = logits_RV.index_select(0, torch.tensor([r.logits_row for r in rows], device=logits_RV.device))
        grammar_mask, allowed = self._grammar_masks(rows, logits_RV.shape)
        view = BatchView(rows=tuple(RowState(r.seq.sampling, r.tokens, r.seq.num_prompt_tokens, r.seq.bad_words_ids)
                                    for r in rows),
                         vocab_size=self.vocab_size, device=logits_RV.device, eos_token_ids=self.eos_token_ids,
                         grammar_mask_RV=grammar_mask)
        lse_R = logsumexp_rows(logits_RV, per_row=self.cfg.batch_invariant)
        # with no speculation the sampler applies each row's temperature / top-k / top-p itself (one pass)
        pipe = apply_pipeline(logits_RV, view, row_errors=invalid_rows(lse_R), defer_tail=not proposals)
        decisions = self._decide(rows, logits_RV, pipe, lse_R, proposals)

        # ---- commit: the one place where results feed back into sequence state
        for chunk in batch.chunks:
            self.requests[chunk.seq_id].num_computed_tokens = chunk.context_len
        for leader, follower in forks:
            self.block_manager.fork(leader.seq_id, follower.seq_id)
            follower.num_computed_tokens = leader.num_computed_tokens
            follower.arrival_time, follower.admitted_step = leader.arrival_time, step
            follower.first_scheduled_time = leader.first_scheduled_time
        forked = {f.seq_id for _, f in forks}
        traces, deltas, finished = [], [], []
        for seq, emitted in decisions:
            verified = seq.seq_id in proposals
            for e in emitted:
                position = seq.num_tokens
                delta = self._commit_row(seq, e.token, e.error)
                if seq.seq_id in forked and not delta.finished:
                    self.scheduler.adopt(seq)
                deltas.append(delta)
                traces.append(self._trace(seq, e, step, position, batch, delta.finished, allowed))
                if delta.finished:
                    finished.append(seq.seq_id)
                    break
            if verified and not seq.is_finished:
                # rejected drafts: their K/V is dropped and blocks past the sequence are returned
                seq.num_computed_tokens = seq.num_tokens - 1
                self.block_manager.truncate(seq.seq_id, seq.num_tokens)
            if verified and self.speculator is not None:
                self.speculator.rewind(seq.seq_id, seq.num_tokens - 1)
        for chunk in batch.chunks:
            seq = self.requests[chunk.seq_id]
            self.block_manager.commit_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        self.step_index = step + 1
        return self._step_output(batch, tuple(traces), logits_RV,
                                 tuple(d for d in deltas if d.text or d.token_ids or d.finished), tuple(finished),
                                 out.forward_s)

    # ---- step stages ---------------------------------------------------------------------

    def _draft_slots(self) -> dict[str, int]:
        """Decoding sequences that will speculate this step, and how many drafts each may take."""
        if self.speculator is None:
            return {}
        k = self.spec_cfg.num_speculative_tokens
        slots = {}
        for seq in self.scheduler.running:
            if seq.status is not RequestStatus.DECODING:
                continue
            room = min(k, seq.sampling.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
            if room > 0:
                wanted = self.speculator.max_drafts(seq, room)
                if wanted > 0:
                    slots[seq.seq_id] = wanted
        return slots

    def _propose(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, dict[str, Proposal]]:
        """Fill the reserved draft slots with proposals; the chunks then carry newest token + drafts."""
        items = [(self.requests[c.seq_id], c.draft_slots) for c in batch.chunks if c.draft_slots]
        if not items:
            return batch, {}
        proposals = {sid: p for sid, p in self.speculator.propose(self, items).items() if p.tokens}
        chunks = tuple(
            dataclasses.replace(c, token_ids=c.token_ids + proposals[c.seq_id].tokens, draft_slots=0,
                                num_logits=1 + len(proposals[c.seq_id].tokens))
            if c.seq_id in proposals else dataclasses.replace(c, draft_slots=0)
            for c in batch.chunks)
        proposed = sum(len(p.tokens) for p in proposals.values())
        return dataclasses.replace(batch, chunks=chunks, num_decode_tokens=batch.num_decode_tokens - sum(
            c.draft_slots for c in batch.chunks) + proposed), proposals

    def _rows(self, out, proposals: dict[str, Proposal]) -> tuple[list["_Row"], list[tuple[Request, Request]]]:
        """One row per logits row to decide: plain samples, forked parallel samples, verification positions."""
        rows, forks = [], []
        offset = 0
        for chunk in out.sample_chunks:
            seq = self.requests[chunk.seq_id]
            if chunk.num_logits > 1:
                drafts = list(proposals[seq.seq_id].tokens)
                for j in range(chunk.num_logits):
                    rows.append(_Row(seq, offset + j, list(seq.token_ids) + drafts[:j], seq.num_tokens + j, j))
            else:
                rows.append(_Row(seq, offset, seq.token_ids, seq.num_tokens))
                if seq.followers and seq.num_output_tokens == 0:
                    for follower_id in seq.followers:
                        follower = self.requests[follower_id]
                        rows.append(_Row(follower, offset, follower.token_ids, follower.num_tokens))
                        forks.append((seq, follower))
                    seq.followers = []
            offset += chunk.num_logits
        return rows, forks

    def _grammar_masks(self, rows: list["_Row"], shape) -> tuple[torch.Tensor | None, dict[int, int]]:
        """Bitmasks of every grammar row, filled per verification depth in one batched call each."""
        grammar_rows = [i for i, r in enumerate(rows) if r.seq.grammar is not None]
        if not grammar_rows:
            return None, {}
        mask = torch.ones(shape, dtype=torch.bool)
        allowed: dict[int, int] = {}
        advanced: dict[str, int] = {}
        depth = 0
        while True:
            at_depth = [i for i in grammar_rows if rows[i].depth == depth]
            if not at_depth:
                break
            ready = [i for i in at_depth if advanced.get(rows[i].seq.seq_id, 0) == depth
                     and not rows[i].seq.grammar.is_terminated()]  # past a stop token nothing is masked
            if ready:
                masks = self.grammar.fill_masks([rows[i].seq.grammar for i in ready])
                mask[torch.tensor(ready)] = masks
                allowed.update(zip(ready, masks.sum(dim=-1).tolist()))
            for i in ready:  # advance through this row's draft to reach the next depth's state
                nxt = i + 1
                if nxt < len(rows) and rows[nxt].seq is rows[i].seq and rows[nxt].depth == depth + 1:
                    if self.grammar.accept(rows[i].seq.grammar, rows[nxt].tokens[-1]):
                        advanced[rows[i].seq.seq_id] = depth + 1
            depth += 1
        for seq_id, n in advanced.items():
            self.requests[seq_id].grammar.rollback(n)
        return mask.to(self.device), allowed

    def _decide(self, rows, logits_RV, pipe, lse_R, proposals) -> list[tuple[Request, list["_Emit"]]]:
        """Sample the plain rows (batched) and verify each speculating sequence's rows."""
        plain = [i for i, r in enumerate(rows) if r.seq.seq_id not in proposals and i not in pipe.errors]
        result = None
        if plain:
            srows = [SampleRow(greedy=rows[i].seq.sampling.greedy, seed=rows[i].seq.seed, position=rows[i].position,
                               stream=rows[i].seq.stream, num_top=rows[i].seq.sampling.logprobs or 0) for i in plain]
            tail = [pipe.tail[i] for i in plain] if pipe.tail is not None else None
            if len(plain) == len(rows):
                result = sample(logits_RV, pipe.processed_RV, srows, lse_R, per_row=self.cfg.batch_invariant,
                                tail=tail)
            else:
                index = torch.tensor(plain, device=logits_RV.device)
                result = sample(logits_RV.index_select(0, index), pipe.processed_RV.index_select(0, index), srows,
                                lse_R.index_select(0, index), per_row=self.cfg.batch_invariant, tail=tail)
        if self.speculator is not None:
            self.speculator.stats.plain_samples += len(plain)
        slot = {row: j for j, row in enumerate(plain)}
        decisions: list[tuple[Request, list[_Emit]]] = []
        seen: set[str] = set()
        for i, r in enumerate(rows):
            sid = r.seq.seq_id
            if sid in proposals:
                if sid in seen:
                    continue
                seen.add(sid)
                decisions.append((r.seq, self._verify_rows(i, rows, logits_RV, pipe, lse_R, proposals[sid])))
            elif i in pipe.errors:
                decisions.append((r.seq, [_Emit(token=-1, row=i, error=pipe.errors[i])]))
            else:
                j = slot[i]
                decisions.append((r.seq, [_Emit(
                    token=result.token_ids[j], row=i, raw_logprob=result.raw_logprobs[j],
                    processed_logprob=result.processed_logprobs[j], support=result.support_sizes[j],
                    noise=result.noise[j], top_raw=tuple(result.top_raw[j]),
                    top_processed=tuple(result.top_processed[j]))]))
        return decisions

    def _verify_rows(self, first: int, rows, logits_RV, pipe, lse_R, proposal: Proposal) -> list["_Emit"]:
        seq = rows[first].seq
        m = len(proposal.tokens)
        span = list(range(first, first + m + 1))
        bad = next((i for i in span if i in pipe.errors), None)
        if bad is not None and bad == first:
            return [_Emit(token=-1, row=first, error=pipe.errors[first])]
        usable = span if bad is None else span[: span.index(bad)]
        depth = len(usable) - 1  # verify only as many drafts as there are usable positions
        sub = Proposal(proposal.tokens[:depth], proposal.q_logits[:depth] if proposal.q_logits is not None else None)
        verdict = verify(pipe.processed_RV[usable], sub, greedy=seq.sampling.greedy, mode=self.spec_cfg.acceptance,
                         seed=seq.seed, stream=seq.stream, first_position=rows[first].position)
        self.speculator.stats.steps += 1
        self.speculator.stats.proposed += m
        self.speculator.stats.accepted += verdict.accepted
        self.speculator.stats.emitted += len(verdict.tokens)
        emits = []
        for k, (token, origin, g, dlp) in enumerate(zip(verdict.tokens, verdict.origins, verdict.noise,
                                                        verdict.draft_logprobs)):
            i = usable[k]
            raw_lp = float(logits_RV[i, token] - lse_R[i])
            proc = pipe.processed_RV[i]
            proc_lse = logsumexp_rows(proc[None])[0]
            proc_lp = float(proc[token] - proc_lse)
            emits.append(_Emit(token=token, row=i, raw_logprob=raw_lp, processed_logprob=proc_lp,
                               support=int(torch.isfinite(proc).sum()), noise=g, origin=origin, draft_logprob=dlp,
                               spec_proposed=m, spec_accepted=verdict.accepted,
                               top_raw=_top(logits_RV[i], lse_R[i], seq.sampling.logprobs),
                               top_processed=_top(proc, proc_lse, seq.sampling.logprobs)))
        return emits

    def _trace(self, seq: Request, e: "_Emit", step: int, position: int, batch, finished: bool,
               allowed: dict[int, int]) -> SampleTrace:
        p = seq.sampling
        return SampleTrace(
            request_id=seq.request_id, stream=seq.stream, step=step, position=position, token_id=e.token,
            raw_logprob=e.raw_logprob, processed_logprob=e.processed_logprob, support_size=e.support,
            top_raw=e.top_raw, top_processed=e.top_processed, processors=tuple(p.pipeline_description()),
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=seq.seed, noise=e.noise,
            batch_size=len(batch.chunks), step_tokens=batch.num_tokens,
            finish_reason=seq.finish_reason.value if finished else None,
            stop_reason=seq.finish_detail if finished else None, error=e.error,
            t_emit_s=time.perf_counter() - self.start_time, logits_row=e.row,
            grammar_allowed=allowed.get(e.row),
            origin=e.origin, draft_logprob=e.draft_logprob, spec_proposed=e.spec_proposed,
            spec_accepted=e.spec_accepted)

    # ---- draft-model hooks (called by toolkit.speculative.ModelProposer) ------------------

    def draft_sample(self, seqs: list[Request], drafts: dict[str, list[int]], logits_RV: torch.Tensor,
                     accepted_in_grammar: dict[str, int]) -> tuple[torch.Tensor, list[int]]:
        """Process draft logits with each request's own pipeline and draw the next draft token."""
        tokens_hist = [list(s.token_ids) + drafts[s.seq_id] for s in seqs]
        mask = None
        grammar_rows = [i for i, s in enumerate(seqs) if s.grammar is not None and not s.grammar.is_terminated()]
        if grammar_rows:
            mask = torch.ones(logits_RV.shape, dtype=torch.bool)
            mask[torch.tensor(grammar_rows)] = self.grammar.fill_masks([seqs[i].grammar for i in grammar_rows])
            mask = mask.to(logits_RV.device)
        view = BatchView(rows=tuple(RowState(s.sampling, t, s.num_prompt_tokens, s.bad_words_ids)
                                    for s, t in zip(seqs, tokens_hist)),
                         vocab_size=self.vocab_size, device=logits_RV.device, eos_token_ids=self.eos_token_ids,
                         grammar_mask_RV=mask)
        lse = logsumexp_rows(logits_RV, per_row=self.cfg.batch_invariant)
        pipe = apply_pipeline(logits_RV, view, row_errors=invalid_rows(lse))
        processed = pipe.processed_RV.clone()
        purpose = rng.SAMPLE if self.spec_cfg.acceptance == "coupled" else rng.DRAFT
        srows = [SampleRow(greedy=s.sampling.greedy, seed=s.seed, position=len(t), stream=s.stream, purpose=purpose)
                 for s, t in zip(seqs, tokens_hist)]
        safe = processed.clone()
        for i in pipe.errors:  # a row the pipeline could not process proposes greedily from raw logits
            safe[i] = logits_RV[i]
        tokens = sample(logits_RV, safe, srows, per_row=self.cfg.batch_invariant).token_ids
        for i, s in enumerate(seqs):
            if s.grammar is not None and not s.grammar.is_terminated() and self.grammar.accept(s.grammar, tokens[i]):
                accepted_in_grammar[s.seq_id] = accepted_in_grammar.get(s.seq_id, 0) + 1
        return safe, tokens

    def rewind_draft_grammar(self, accepted_in_grammar: dict[str, int]) -> None:
        for seq_id, n in accepted_in_grammar.items():
            self.requests[seq_id].grammar.rollback(n)

    def _step_output(self, batch, traces=(), logits_RV=None, deltas=(), finished=(), forward_s=0.0) -> StepOutput:
        used = self.block_manager.num_used_blocks
        return StepOutput(step=batch.step, batch_size=len(batch.chunks), num_decode_tokens=batch.num_decode_tokens,
                          num_prefill_tokens=batch.num_prefill_tokens, samples=traces, logits_RV=logits_RV,
                          deltas=deltas, finished=finished, preempted=batch.preempted, kv_blocks_used=used,
                          kv_utilization=used / self.num_kv_blocks, prefix_hit_tokens=batch.prefix_hit_tokens,
                          forward_s=forward_s)

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
            return TextUpdate(delta="", stop_string=None)
        p = seq.sampling
        update = update_text(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens),
                             seq.token_ids, p.stop, seq.stop_state,
                             check_stops=seq.num_output_tokens >= p.min_tokens,
                             include_stop=p.include_stop_str_in_output, final=final, first=seq.num_prompt_tokens)
        return update

    def _finish(self, seq: Request, reason: FinishReason, detail: str, stop_reason, now: float) -> None:
        if self.speculator is not None:
            self.speculator.release(seq.seq_id)
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


@dataclass
class _Row:
    """One logits row to decide: the sequence, its history for the processors, the position it samples."""

    seq: Request
    logits_row: int
    tokens: Sequence[int]
    position: int
    depth: int = 0  # verification rows: number of drafts before this position


@dataclass(frozen=True)
class _Emit:
    """A token to commit (or an error), with what its trace row records."""

    token: int
    row: int
    raw_logprob: float = float("nan")
    processed_logprob: float = float("nan")
    support: int = 0
    noise: float = float("nan")
    top_raw: tuple = ()
    top_processed: tuple = ()
    error: str | None = None
    origin: str = PLAIN
    draft_logprob: float | None = None
    spec_proposed: int = 0
    spec_accepted: int = 0


def _top(logits_V: torch.Tensor, lse: torch.Tensor, k: int | None) -> tuple[tuple[int, float], ...]:
    if not k:
        return ()
    values, ids = torch.topk(logits_V, k)
    return tuple((int(t), float(v - lse)) for t, v in zip(ids, values) if v != float("-inf"))


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
