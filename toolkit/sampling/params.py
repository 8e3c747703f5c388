"""SamplingParams: a request's decoding policy, validated on construction (vLLM's field names and defaults), and
the default order of the logits-processor pipeline."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from toolkit.config import check, from_mapping, is_int, is_number
from toolkit.errors import ConfigError, not_unicode
from toolkit.sampling.structured import StructuredOutputs

DEFAULT_PROCESSORS = (
    # penalties: raw logits + history
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    # hard masks: set forbidden tokens to -inf (and the logit bias)
    "allowed_token_ids",
    "bad_words",
    "logit_bias",
    "no_repeat_ngram",
    "min_tokens",
    "grammar",
    # temperature, then truncation of the support
    "temperature",
    "top_k",
    "top_p",
    "min_p",
)

# Bounds that keep every processed logit finite (or -inf: masked) in fp32 for raw logits up to 1e4 in size. Past
# them a division overflows: a logit of +inf, which the sampler cannot draw (it keeps finite logits), or NaN.
MIN_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS; 0 is greedy
MAX_TEMPERATURE = 1e5
MIN_REPETITION_PENALTY = 1e-5  # a penalty below 1 divides a positive logit by it
MAX_LOGIT_BIAS = 1e5  # any negative bias is fine: -inf bans the token
MAX_TOP_K = 2**31 - 1  # the trace's top_k column is int32; any k past the vocabulary keeps every token
# What one request's stop strings and bad words may hold: each is matched against every new token (a stop string
# costs ~0.75 us a token, 1024 of them ~0.6 ms on a 2-core AMD EPYC (avx2)), so without a bound one request's
# 100000 stop strings held the engine thread ~1 s a token. The server's own limits are tighter (serve.max_stop 32).
MAX_STOP = 1024  # stop strings; and stop_token_ids
MAX_STOP_CHARS = 65536  # characters of all stop strings together; and of all bad words
MAX_BAD_WORDS = 4096


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding policy. Field names and defaults follow vLLM's SamplingParams.

    `processors` is the ordered logits-processor pipeline (default `DEFAULT_PROCESSORS`);
    a parameter set away from its neutral value must have its processor in the list.
    `stop` and `stop_token_ids` hold at most 1024 each, `bad_words` 4096, and either 65536 characters in all
    (each is matched against every new token; a ConfigError names the field past that).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt + output tokens (vLLM)
    presence_penalty: float = 0.0  # over output tokens
    frequency_penalty: float = 0.0  # over output tokens
    no_repeat_ngram_size: int = 0  # over prompt + output tokens (HF)
    bad_words: tuple = ()  # strings and/or token-id sequences
    allowed_token_ids: tuple[int, ...] | None = None
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: the rest of the context (vLLM's meaning), resolved as a request is admitted
    min_tokens: int = 0
    logprobs: int | None = None  # top alternatives recorded per sampled token
    prompt_logprobs: int | None = None  # toolkit.LLM: each prompt token's logprob and the top k beside it
    skip_special_tokens: bool = True
    structured_outputs: Any = None  # StructuredOutputs or a mapping with one of json, regex, grammar, choice
    processors: tuple[str, ...] | None = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        check(is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        t = self.temperature
        check(
            is_number(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE),
            f"temperature must be 0 (greedy) or a number in [{MIN_TEMPERATURE:.0e}, {MAX_TEMPERATURE:.0e}], got {t!r}",
        )
        set_("temperature", float(t))
        check(is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        set_("top_p", float(self.top_p))
        check(
            is_int(self.top_k) and -1 <= self.top_k <= MAX_TOP_K,
            f"top_k must be -1 (all tokens), 0 (all tokens) or a positive integer up to {MAX_TOP_K}, got {self.top_k!r}",
        )
        check(is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        set_("min_p", float(self.min_p))
        check(
            is_number(self.repetition_penalty) and self.repetition_penalty >= MIN_REPETITION_PENALTY,
            f"repetition_penalty must be >= {MIN_REPETITION_PENALTY:.0e} (1 means off), got {self.repetition_penalty!r}",
        )
        set_("repetition_penalty", float(self.repetition_penalty))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
            set_(name, float(value))
        check(
            is_int(self.no_repeat_ngram_size) and self.no_repeat_ngram_size >= 0,
            f"no_repeat_ngram_size must be an integer >= 0, got {self.no_repeat_ngram_size!r}",
        )
        set_("bad_words", _bad_words(self.bad_words))
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            check(
                isinstance(ids, (list, tuple)) and len(ids) > 0 and all(is_int(i) and i >= 0 for i in ids),
                f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}",
            )
            set_("allowed_token_ids", tuple(sorted(set(ids))))  # a set: its cost a step is at most the vocabulary
        if self.logit_bias is not None:
            bias = self.logit_bias
            check(isinstance(bias, Mapping), f"logit_bias must be a mapping of token id to bias, got {bias!r}")
            odd = next((k for k in bias if not (is_int(k) or _decimal(k))), None)
            check(
                odd is None,
                f'logit_bias keys must be token ids, in plain decimal digits where they are strings ("50256"), '
                f"got {odd!r}",
            )
            try:
                clean = {int(k): float(v) for k, v in bias.items()}
            except (TypeError, ValueError):
                raise ConfigError(f"logit_bias must map token ids to numbers, got {dict(bias)!r}") from None
            check(
                all(k >= 0 for k in clean) and all(v <= MAX_LOGIT_BIAS for v in clean.values()),  # NaN is not <=
                f"logit_bias keys must be token ids >= 0 and values numbers <= {MAX_LOGIT_BIAS:.0e} (-inf bans a "
                f"token), got {dict(bias)!r}",
            )
            set_("logit_bias", dict(sorted(clean.items())) or None)
        check(
            self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**63),
            f"seed must be an integer in [0, 2^63) or null, got {self.seed!r}",
        )
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        check(
            isinstance(stop, (list, tuple)) and all(isinstance(x, str) for x in stop),
            f"stop must be a list of strings, got {self.stop!r}",
        )
        check(all(len(x) > 0 for x in stop), "stop strings must not be empty")
        for x in stop:
            _unicode(x, "stop string")
        set_("stop", tuple(stop))
        ids = self.stop_token_ids
        check(
            isinstance(ids, (list, tuple)) and all(is_int(i) and i >= 0 for i in ids),
            f"stop_token_ids must be a list of non-negative token ids, got {ids!r}",
        )
        set_("stop_token_ids", tuple(ids))
        _bounded("stop", len(self.stop), MAX_STOP, "strings")
        _bounded("stop", sum(map(len, self.stop)), MAX_STOP_CHARS, "characters")
        _bounded("stop_token_ids", len(self.stop_token_ids), MAX_STOP, "token ids")
        _bounded("bad_words", len(self.bad_words), MAX_BAD_WORDS, "entries")
        _bounded("bad_words", sum(map(len, self.bad_words)), MAX_STOP_CHARS, "characters and token ids")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            check(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        check(
            self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens > 0),
            f"max_tokens must be a positive integer, got {self.max_tokens!r}",
        )
        check(
            is_int(self.min_tokens) and 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
            f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(
                value is None or (is_int(value) and 0 <= value <= 20),
                f"{name} must be null or an integer in [0, 20], got {value!r}",
            )
        set_("structured_outputs", StructuredOutputs.coerce(self.structured_outputs))
        # which processors change anything: fixed for these (frozen) parameters, asked per row and step
        set_("_active", frozenset(name for name, on in self._activity().items() if on))
        self._check_processors()  # before they are looked up: a listed processor may be no name at all
        set_("_active_order", tuple(p for p in self.order if p in self._active))
        set_(
            "_description",
            tuple([self.describe(p) for p in self.active_processors()] + ["argmax" if self.greedy else "gumbel_max"]),
        )

    def _check_processors(self) -> None:
        if self.processors is None:
            return
        procs = self.processors
        check(
            isinstance(procs, (list, tuple)) and all(isinstance(p, str) for p in procs),
            f"processors must be a list of processor names, got {procs!r}",
        )
        unknown = [p for p in procs if p not in DEFAULT_PROCESSORS]
        check(
            not unknown,
            f"unknown processor {unknown[0]!r} in processors; known: {', '.join(DEFAULT_PROCESSORS)}"
            if unknown
            else "",
        )
        dup = sorted({p for p in procs if procs.count(p) > 1})
        check(not dup, f"processor {dup[0]!r} is listed twice in processors" if dup else "")
        object.__setattr__(self, "processors", tuple(procs))
        for name in self.active_processors(DEFAULT_PROCESSORS):
            check(name in procs, f"{name} is set ({self.describe(name)}) but {name!r} is not in processors")

    # -- pipeline helpers -------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def order(self) -> tuple[str, ...]:
        return self.processors if self.processors is not None else DEFAULT_PROCESSORS

    def is_active(self, name: str) -> bool:
        """Whether processor `name` changes anything for these parameters."""
        if name not in DEFAULT_PROCESSORS:
            raise KeyError(name)
        return name in self._active

    def _activity(self) -> dict[str, bool]:
        return {
            "repetition_penalty": self.repetition_penalty != 1.0,
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words),
            "logit_bias": bool(self.logit_bias),
            "no_repeat_ngram": self.no_repeat_ngram_size > 0,
            "min_tokens": self.min_tokens > 0,
            "grammar": self.structured_outputs is not None,
            "temperature": self.temperature not in (0.0, 1.0),
            "top_k": self.top_k > 0,
            "top_p": self.top_p < 1.0,
            "min_p": self.min_p > 0.0,
        }

    def active_processors(self, order: tuple[str, ...] | None = None) -> tuple[str, ...]:
        if order is None:
            return self._active_order
        return tuple(p for p in order if self.is_active(p))

    def describe(self, name: str) -> str:
        """A processor with its parameters, as recorded in every trace row."""
        value = {
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "allowed_token_ids": len(self.allowed_token_ids or ()),
            "bad_words": len(self.bad_words),
            "logit_bias": len(self.logit_bias or {}),
            "no_repeat_ngram": self.no_repeat_ngram_size,
            "min_tokens": self.min_tokens,
            "grammar": self.structured_outputs.kind if self.structured_outputs is not None else "none",
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
        }[name]
        return f"{name}({value:g})" if isinstance(value, float) else f"{name}({value})"

    def pipeline_description(self) -> tuple[str, ...]:
        """The active processors with their parameters, then the selection rule: the tuple these (frozen) parameters
        keep, a trace row's `processors`."""
        return self._description

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "structured_outputs":
                value = value.to_dict() if value is not None else None
            elif isinstance(value, tuple):
                value = [list(v) if isinstance(v, tuple) else v for v in value]
            elif isinstance(value, Mapping):
                value = {str(k): v for k, v in value.items()}
            out[f.name] = value
        return out

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> SamplingParams:
        return from_mapping(cls, data, section="sampling")

    @classmethod
    def with_model_defaults(
        cls, data: Mapping[str, Any] | None, generation: Mapping[str, Any]
    ) -> tuple[SamplingParams, dict[str, Any]]:
        """The run's sampling section with the model's own defaults (its generation_config) in the fields
        the section leaves at the library's default; and which fields those were."""
        data = dict(data or {})
        library = cls()
        taken = {
            k: v
            for k, v in generation.items()
            if k in {f.name for f in fields(cls)} and data.get(k, getattr(library, k)) == getattr(library, k)
        }
        return cls.from_mapping({**data, **taken}), taken


def _decimal(key: Any) -> bool:
    """A token id as JSON's object keys write it: ASCII digits, no sign, no leading zero, no space or underscore
    (Python's int() takes " 5", "\u0665" and "1_0" too, and "05" and "5" would be one token given twice)."""
    return isinstance(key, str) and key.isascii() and key.isdigit() and (key == "0" or key[0] != "0")


def _bad_words(words: Any) -> tuple:
    """Normalise bad_words to a tuple of str and tuple[int, ...] entries."""
    if isinstance(words, str):
        words = (words,)
    check(isinstance(words, (list, tuple)), f"bad_words must be a list of strings or token-id lists, got {words!r}")
    out: list = []
    for w in words:
        if isinstance(w, str):
            check(len(w) > 0, "bad_words entries must not be empty")
            _unicode(w, "bad_words entry")
            out.append(w)
        elif isinstance(w, (list, tuple)) and w and all(is_int(t) and t >= 0 for t in w):
            out.append(tuple(w))
        else:
            raise ConfigError(f"bad_words entries must be strings or non-empty token-id lists, got {w!r}")
    return tuple(out)


def _bounded(name: str, count: int, limit: int, what: str) -> None:
    """A ConfigError naming the field where a request's list holds more than one request may ask to be matched
    against every new token."""
    check(
        count <= limit,
        f"{name} holds {count} {what}, more than the {limit} one request may give (each is matched against every "
        f"new token)",
    )


def _unicode(text: str, what: str) -> None:
    """A ConfigError naming `text` where it is no Unicode text (toolkit.errors.not_unicode)."""
    problem = not_unicode(text)
    if problem is not None:
        raise ConfigError(f"{what} {text[:40]!r}: {problem}")
