"""Request intake: what a caller sends becomes validated sequences. Ids, the prompt's tokens (text, chat
messages through the tokenizer's template, or token ids), sampling parameters resolved against the
defaults, the context and KV-pool limits, token ids inside the vocabulary, bad words, grammars compiled
(an invalid one is refused here), seeds. Every refusal is a RequestError naming the field."""

from __future__ import annotations

import collections.abc
import dataclasses
import hashlib
import time
from collections.abc import Callable, Container, Mapping
from typing import Any

from toolkit.config import EngineConfig
from toolkit.engine.request import EngineRequest, Sequence
from toolkit.errors import ConfigError, RequestError, not_unicode, not_unicode_in
from toolkit.models.tokenizer import Tokenizer
from toolkit.sampling.grammar import GrammarBackend, LazyGrammar, StructuredOutputs
from toolkit.sampling.params import SamplingParams
from toolkit.sampling.processors.masks import resolve_bad_words


def derive_seed(run_seed: int, request_id: str) -> int:
    """A request's seed when it gave none: a stable function of the run seed and its id."""
    digest = hashlib.sha256(f"{run_seed}/{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class RequestIntake:
    def __init__(
        self,
        cfg: EngineConfig,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_model_len: int,
        num_kv_blocks: int,
        default_sampling: SamplingParams,
        grammar: LazyGrammar,
        eos_token_ids: tuple[int, ...] = (),
    ):
        self.cfg = cfg
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.default_sampling = default_sampling
        self.grammar = grammar  # the engine's grammar backend, created on first use
        self._next_id = 0

    def precompile(
        self,
        sampling_params: SamplingParams | Mapping[str, Any] | None,
        cached_only: bool = False,
        compile_with: Callable[[GrammarBackend, StructuredOutputs], Any] | None = None,
    ) -> bool:
        """Compile a request's grammar into the engine's cache ahead of `sequences` (a server does it on its
        handlers' threads, so the engine thread never waits for a compiler); a RequestError if it is invalid.
        `cached_only`: compile nothing, and say whether nothing is left to compile (no grammar, or one compiled).
        `compile_with(backend, spec)`: what compiles it into the backend's cache (a server's child process,
        toolkit.sampling.grammar_process) instead of backend.compile in this thread."""
        spec = self._sampling(sampling_params).structured_outputs
        if spec is None or self.grammar.compiled(spec):
            return True
        if not cached_only:
            backend = self.grammar()
            (compile_with or GrammarBackend.compile)(backend, spec)
        return not cached_only

    def sequences(self, request: EngineRequest, *, step_index: int = 0, taken: Container[str] = ()) -> list[Sequence]:
        """The sequences of one request (n when n > 1; the first leads, the others follow it), or a
        RequestError naming what is wrong. `taken`: the request ids in use; `step_index`: the engine's
        current step (a request arrives no earlier)."""
        if not isinstance(request, EngineRequest):
            raise RequestError(f"a request must be an EngineRequest, got {type(request).__name__}")
        request_id, arrival_step, priority = request.request_id, request.arrival_step, request.priority
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        request_id = str(request_id)
        problem = not_unicode(request_id)  # a lone surrogate: no UTF-8 seed, trace or log can hold it
        if problem is not None:
            raise RequestError(f"request id {request_id!r}: {problem}")
        if request_id in taken:
            raise RequestError(f"request id {request_id!r} is already in use")
        if "#" in request_id:
            raise RequestError(f"request id {request_id!r} must not contain '#' (reserved for parallel samples)")
        params = self._sampling(request.sampling_params)
        ids, text = self._prompt_ids(request.prompt, request.messages, request.prompt_token_ids)
        if params.max_tokens is None:  # vLLM's meaning: the rest of the context (what the trace then records)
            params = params.replace(max_tokens=max(self.max_model_len - len(ids), 1))
        self._check_fits(request_id, len(ids), params.max_tokens)
        self._check_token_ids(params)
        bad_words_ids = self._bad_words_ids(params)
        self._check_some_token_allowed(params, bad_words_ids)
        if params.stop and self.tokenizer is None:  # nothing detokenizes: no text would ever match
            raise RequestError("stop strings need a tokenizer (this model has none); give stop_token_ids instead")
        if params.structured_outputs is not None:
            self.grammar().compile(params.structured_outputs)  # an invalid grammar is refused here
        # both are int64 columns of the trace
        if arrival_step is not None and not (isinstance(arrival_step, int) and 0 <= arrival_step < 2**63):
            raise RequestError(f"arrival_step must be an integer in [0, 2^63), got {arrival_step!r}")
        if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**63) <= priority < 2**63:
            raise RequestError(f"priority must be an integer in [-2^63, 2^63), got {priority!r}")
        if params.n > self.cfg.max_num_seqs:
            raise RequestError(f"n={params.n} parallel samples exceed engine.max_num_seqs ({self.cfg.max_num_seqs})")
        seed = params.seed if params.seed is not None else derive_seed(self.cfg.seed, request_id)
        now = time.perf_counter()
        seqs = []
        for stream in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{stream}"
            seq = Sequence(
                seq_id=seq_id,
                request_id=request_id,
                prompt_token_ids=tuple(ids),
                sampling=params,
                seed=seed,
                arrival_step=max(arrival_step or 0, step_index),
                prompt_text=text,
                stream=stream,
                bad_words_ids=bad_words_ids,
                add_time=now,
                priority=priority,
            )
            if params.structured_outputs is not None:
                seq.grammar = self.grammar().matcher(params.structured_outputs)
            seqs.append(seq)
        seqs[0].followers = [s.seq_id for s in seqs[1:]]
        return seqs

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

    def tokenized(self, request: EngineRequest) -> EngineRequest:
        """The request with its prompt as token ids beside its text (a chat's through the template), checked as
        `sequences` checks them (every id inside the vocabulary, shorter than the context), or a RequestError
        naming the prompt. A server calls it on its handlers' threads and adds what it returns, so the engine
        thread never tokenizes a hostile prompt (an 8 MB one held it 4 s) and tokenizes no prompt twice."""
        ids, text = self._prompt_ids(request.prompt, request.messages, request.prompt_token_ids)
        self._check_context(len(ids))
        return dataclasses.replace(request, prompt=text, messages=None, prompt_token_ids=tuple(ids))

    def prompt_ids(self, request: EngineRequest) -> list[int]:
        """A request's prompt as token ids, checked as `sequences` checks it: what scoring a prompt reads."""
        ids, _ = self._prompt_ids(request.prompt, request.messages, request.prompt_token_ids)
        self._check_context(len(ids))
        return ids

    def _check_context(self, prompt_len: int, bound: str = "") -> None:
        if prompt_len >= self.max_model_len:
            raise RequestError(
                f"prompt has {bound}{prompt_len} tokens but the context is {self.max_model_len} "
                f"(engine.max_model_len); shorten the prompt"
            )

    def _prompt_ids(self, prompt, messages, prompt_token_ids) -> tuple[list[int], str | None]:
        """The prompt's ids and text. `prompt` beside `prompt_token_ids` is their text, tokenized by the caller
        (`tokenized`, vLLM's TextTokensPrompt); ids past the context are refused before they are read (a hostile
        prompt may hold millions)."""
        given = [x is not None for x in (prompt if prompt_token_ids is None else None, messages, prompt_token_ids)]
        if sum(given) != 1:
            raise RequestError("give exactly one of prompt, messages or prompt_token_ids")
        if prompt_token_ids is not None:
            if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, collections.abc.Sequence):
                raise RequestError("prompt_token_ids must be a list of integers")
            if prompt is not None:
                if not isinstance(prompt, str):
                    raise RequestError(f"prompt must be a string, got {type(prompt).__name__}")
                _check_text(prompt, "prompt")
            self._check_context(len(prompt_token_ids))
            ids = list(prompt_token_ids)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise RequestError("prompt_token_ids must be a list of integers")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            text = prompt
            if text is None and self.tokenizer is not None:
                text = self.tokenizer.decode(ids, skip_special_tokens=False)
        else:
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer matching its vocabulary; give prompt_token_ids")
            if messages is not None:
                _check_text(messages, "messages")
                rendered = self.tokenizer.render_chat(messages)
                self._check_context(self.tokenizer.least_tokens(rendered), "at least ")
                ids = self.tokenizer.encode(rendered, add_special_tokens=False)
                text = self.tokenizer.decode(ids, skip_special_tokens=False)
            else:
                if not isinstance(prompt, str):
                    raise RequestError(f"prompt must be a string, got {type(prompt).__name__}")
                _check_text(prompt, "prompt")
                self._check_context(self.tokenizer.least_tokens(prompt), "at least ")  # before its tokens are made
                ids, text = self.tokenizer.encode(prompt), prompt
        if not ids:
            raise RequestError("the prompt is empty")
        return ids, text

    def _check_fits(self, request_id: str, prompt_len: int, max_tokens: int) -> None:
        if prompt_len >= self.max_model_len:
            raise RequestError(
                f"request {request_id}: prompt has {prompt_len} tokens but the context is "
                f"{self.max_model_len} (engine.max_model_len); shorten the prompt"
            )
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"request {request_id}: prompt ({prompt_len}) + max_tokens ({max_tokens}) = {total} "
                f"exceeds engine.max_model_len ({self.max_model_len}); lower max_tokens"
            )
        pool = self.num_kv_blocks * self.cfg.block_size
        if total > pool:
            raise RequestError(
                f"request {request_id}: prompt + max_tokens = {total} tokens can never fit the KV pool "
                f"of {pool} tokens; raise engine.num_kv_blocks or lower max_tokens"
            )

    def _check_token_ids(self, params: SamplingParams) -> None:
        v = self.vocab_size
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids),
            ("logit_bias", tuple(params.logit_bias or ())),
            ("bad_words", tuple(t for w in params.bad_words if isinstance(w, tuple) for t in w)),
        ):
            bad = [t for t in ids or () if t >= v]
            if bad:
                raise RequestError(f"{name} holds token id {bad[0]}, outside the vocabulary [0, {v})")
        for name in ("logprobs", "prompt_logprobs"):  # alternatives beside each token: at most the vocabulary's
            k = getattr(params, name)
            if k is not None and k > v:
                raise RequestError(f"{name} {k} asks for more alternatives than the vocabulary's {v} tokens")

    def _check_some_token_allowed(self, params: SamplingParams, bad_words_ids: tuple[tuple[int, ...], ...]) -> None:
        """A RequestError where allowed_token_ids leave no first token: each is a one-token bad word, or a stop
        token (EOS too, unless ignore_eos) that min_tokens keeps out (the request ended at its first step with
        finish_reason "error"). Its bias cannot remove them all: a server takes logit_bias in [-100, 100]."""
        if params.allowed_token_ids is None:
            return
        left = set(params.allowed_token_ids) - {w[0] for w in bad_words_ids if len(w) == 1}
        if params.min_tokens:
            left -= {*params.stop_token_ids, *(() if params.ignore_eos else self.eos_token_ids)}
        if not left:
            raise RequestError(
                "allowed_token_ids: every token it allows is banned (a one-token bad word, or a stop token "
                "min_tokens keeps out), so no token could be sampled"
            )

    def _bad_words_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        try:
            return resolve_bad_words(params.bad_words, self.tokenizer)
        except ValueError as exc:
            raise RequestError(str(exc)) from None


def _check_text(value: Any, where: str) -> None:
    """A RequestError naming the first string in `value` (a prompt, or a chat's messages) that is no Unicode text:
    the tokenizer could not read it."""
    problem = not_unicode_in(value, where)
    if problem is not None:
        raise RequestError(problem)
