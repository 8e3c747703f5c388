"""Validated configuration dataclasses.

Each config validates itself in `__post_init__` and names the bad value in a one-line
`ConfigError`. Hydra composes plain YAML (conf/); `from_mapping` turns a composed section
into one of these, refusing unknown keys with the list of known ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Mapping

from toolkit.errors import ConfigError
from toolkit.structured import StructuredOutputs

MODEL_NAMES = ("smollm2", "tiny", "hf", "nanogpt")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "kernel", "sdpa", "flex")
MATMUL_BACKENDS = ("auto", "native", "torch")
KV_CACHE_DTYPES = ("auto", "bf16", "int8", "fp8_e4m3")
# fused: prefill chunks and decodes in ONE forward per step (the default); two_forwards: the same schedule, prefill
# chunks and decodes in separate forwards; prefill_first: a waiting prompt is prefilled whole in a step of its
# own before decodes continue (vLLM V0's default); no_chunking: a prompt enters a step only whole
SCHEDULER_POLICIES = ("fused", "two_forwards", "prefill_first", "no_chunking")


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def from_mapping(cls, data: Mapping[str, Any] | None, *, section: str):
    """Build dataclass `cls` from a mapping, naming unknown keys (e.g. a typo) clearly."""
    data = dict(data or {})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"unknown {section} option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return cls(**data)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load. `name` lets other configs (a draft model) embed one."""

    name: str = "smollm2"
    path: str | None = None
    dtype: str = "float32"
    # Architecture of the random-init `tiny` model (ignored for real checkpoints).
    seed: int = 0
    vocab_size: int = 49152
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    # auto: the checkpoint's own sampling defaults (generation_config) replace the library's for the fields a
    # run leaves at the library default (vLLM's generation_config="auto"); none: the library's defaults
    generation_config: str = "auto"

    def __post_init__(self):
        _check(self.name in MODEL_NAMES, f"model.name must be one of {MODEL_NAMES}, got {self.name!r}")
        _check(self.generation_config in ("auto", "none"),
               f"model.generation_config must be auto or none, got {self.generation_config!r}")
        _check(self.dtype in DTYPES, f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.name == "hf":
            _check(bool(self.path), "model=hf needs model.path=<dir with config.json + safetensors>")
        for name in ("vocab_size", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            _check(_is_int(value) and value > 0, f"model.{name} must be a positive integer, got {value!r}")
        _check(self.hidden_size % self.num_heads == 0,
               f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads ({self.num_heads})")
        _check(self.num_heads % self.num_kv_heads == 0,
               f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads ({self.num_kv_heads})")
        _check((self.hidden_size // self.num_heads) % 2 == 0, "model head_dim must be even for RoPE")


@dataclass(frozen=True)
class EngineConfig:
    """Engine and scheduler options (vLLM names where vLLM has them)."""

    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb (capped at what max_num_seqs can use)
    kv_cache_memory_gb: float = 2.0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    seed: int = 0  # run seed: requests without a seed derive theirs from it
    num_threads: int | None = None  # torch intra-op threads (None: torch's default)
    attention_backend: str = "auto"  # auto | kernel (native CPU paged attention) | sdpa (pure torch) | flex
    flex_compile: bool = True  # attention_backend=flex: torch.compile the FlexAttention call (else dense, eager)
    enable_prefix_caching: bool = False
    preemption_mode: str = "recompute"  # recompute | swap
    preemption_policy: str = "newest"  # newest | priority
    swap_space_gb: float = 1.0  # host pool for preemption_mode=swap (pinned memory on CUDA)
    # A token's logits are the same bits whatever its batch, chunking, preemption or cache hits
    # (fixed-order matmul and attention kernels; CPU fp32; see toolkit/csrc).
    batch_invariant: bool = False
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | bf16 | int8 | fp8_e4m3 (quantised, with scales)
    kv_scale_granularity: str = "block"  # int8/fp8 scales: block (per block and KV head, running) | tensor (static)
    # | channel (keys per block, head and channel, running; values per token and head)
    # auto: the native packed matmul (csrc/matmul_invariant.c) on CPU fp32 when it compiles, else torch's
    matmul_backend: str = "auto"  # auto | native | torch
    scheduler_policy: str = "fused"  # fused | two_forwards | prefill_first | no_chunking (SCHEDULER_POLICIES)
    max_chunk_tokens: int | None = None  # one sequence's prefill chunk at most (None: the step's budget)

    def __post_init__(self):
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            _check(_is_int(value) and value > 0, f"engine.{name} must be a positive integer, got {value!r}")
        _check(self.num_kv_blocks is None or (_is_int(self.num_kv_blocks) and self.num_kv_blocks > 0),
               f"engine.num_kv_blocks must be a positive integer or null (sized from kv_cache_memory_gb), "
               f"got {self.num_kv_blocks!r}")
        _check(_is_number(self.kv_cache_memory_gb) and self.kv_cache_memory_gb > 0,
               f"engine.kv_cache_memory_gb must be a positive number, got {self.kv_cache_memory_gb!r}")
        _check(self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len > 0),
               f"engine.max_model_len must be a positive integer or null, got {self.max_model_len!r}")
        _check(self.num_threads is None or (_is_int(self.num_threads) and self.num_threads > 0),
               f"engine.num_threads must be a positive integer or null, got {self.num_threads!r}")
        _check(_is_int(self.seed) and self.seed >= 0, f"engine.seed must be a non-negative integer, got {self.seed!r}")
        _check(isinstance(self.device, str) and self.device.split(":")[0] in ("cpu", "cuda", "mps"),
               f"engine.device must be cpu, cuda[:N] or mps, got {self.device!r}")
        _check(isinstance(self.enable_prefix_caching, bool),
               f"engine.enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        _check(self.preemption_mode in ("recompute", "swap"),
               f"engine.preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        _check(self.preemption_policy in ("newest", "priority"),
               f"engine.preemption_policy must be newest or priority, got {self.preemption_policy!r}")
        _check(_is_number(self.swap_space_gb) and self.swap_space_gb >= 0,
               f"engine.swap_space_gb must be a number >= 0, got {self.swap_space_gb!r}")
        _check(isinstance(self.batch_invariant, bool),
               f"engine.batch_invariant must be true or false, got {self.batch_invariant!r}")
        _check(not (self.batch_invariant and self.attention_backend in ("sdpa", "flex")),
               f"engine.batch_invariant=true needs the native attention kernel, not "
               f"engine.attention_backend={self.attention_backend}")
        _check(isinstance(self.flex_compile, bool), f"engine.flex_compile must be true or false, got {self.flex_compile!r}")
        _check(self.attention_backend in ATTENTION_BACKENDS,
               f"engine.attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"engine.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _check(self.kv_scale_granularity in ("block", "tensor", "channel"),
               f"engine.kv_scale_granularity must be block, tensor or channel, got {self.kv_scale_granularity!r}")
        _check(not (self.batch_invariant and self.kv_cache_dtype != "auto"),
               f"engine.batch_invariant=true needs the fp32 cache of the native kernel, not "
               f"engine.kv_cache_dtype={self.kv_cache_dtype}")
        _check(self.matmul_backend in MATMUL_BACKENDS,
               f"engine.matmul_backend must be one of {MATMUL_BACKENDS}, got {self.matmul_backend!r}")
        _check(not (self.batch_invariant and self.matmul_backend == "torch"),
               "engine.batch_invariant=true needs the native matmul, not engine.matmul_backend=torch")
        _check(self.scheduler_policy in SCHEDULER_POLICIES,
               f"engine.scheduler_policy must be one of {SCHEDULER_POLICIES}, got {self.scheduler_policy!r}")
        _check(self.max_chunk_tokens is None or (_is_int(self.max_chunk_tokens) and self.max_chunk_tokens > 0),
               f"engine.max_chunk_tokens must be a positive integer or null, got {self.max_chunk_tokens!r}")
        _check(self.max_num_batched_tokens >= self.max_num_seqs,
               f"engine.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
               f"engine.max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step")


SPEC_METHODS = ("none", "ngram", "draft_model", "self_draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (see toolkit.speculative). `method: none` turns it off."""

    method: str = "none"  # none | ngram | draft_model | self_draft
    num_speculative_tokens: int = 4  # k drafts per step
    acceptance: str = "rejection"  # rejection | coupled (greedy requests: accept iff argmax)
    prompt_lookup_min: int = 1  # ngram
    prompt_lookup_max: int = 4
    draft_layers: int = 4  # self_draft: the target's first layers
    draft_model: Mapping[str, Any] | None = None  # draft_model: the fields of a model config

    def __post_init__(self):
        _check(self.method in SPEC_METHODS, f"speculative.method must be one of {SPEC_METHODS}, got {self.method!r}")
        _check(_is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= 16,
               f"speculative.num_speculative_tokens must be an integer in [1, 16], got {self.num_speculative_tokens!r}")
        _check(self.acceptance in ("rejection", "coupled"),
               f"speculative.acceptance must be rejection or coupled, got {self.acceptance!r}")
        _check(_is_int(self.prompt_lookup_min) and _is_int(self.prompt_lookup_max)
               and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
               f"speculative.prompt_lookup_min/max must be integers with 1 <= min <= max, got "
               f"{self.prompt_lookup_min!r}, {self.prompt_lookup_max!r}")
        _check(_is_int(self.draft_layers) and self.draft_layers >= 1,
               f"speculative.draft_layers must be a positive integer, got {self.draft_layers!r}")
        if self.method == "draft_model":
            _check(isinstance(self.draft_model, Mapping) and bool(self.draft_model),
                   "speculative.method=draft_model needs speculative.draft_model (e.g. name: tiny, seed: 77)")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


DEFAULT_PROCESSORS = (
    # penalties: raw logits + history
    "repetition_penalty", "presence_penalty", "frequency_penalty",
    # hard masks: set forbidden tokens to -inf (and the logit bias)
    "allowed_token_ids", "bad_words", "logit_bias", "no_repeat_ngram", "min_tokens", "grammar",
    # temperature, then truncation of the support
    "temperature", "top_k", "top_p", "min_p",
)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding policy. Field names and defaults follow vLLM's SamplingParams.

    `processors` is the ordered logits-processor pipeline (default `DEFAULT_PROCESSORS`);
    a parameter set away from its neutral value must have its processor in the list.
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
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top alternatives recorded per sampled token
    skip_special_tokens: bool = True
    structured_outputs: Any = None  # StructuredOutputs or a mapping with one of json, regex, grammar, choice
    processors: tuple[str, ...] | None = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        _check(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        t = self.temperature
        _check(_is_number(t) and t >= 0, f"temperature must be a number >= 0 (0 means greedy), got {t!r}")
        set_("temperature", float(t))
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        set_("top_p", float(self.top_p))
        _check(_is_int(self.top_k) and self.top_k >= -1,
               f"top_k must be -1 (all tokens), 0 (all tokens) or a positive integer, got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        set_("min_p", float(self.min_p))
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0,
               f"repetition_penalty must be > 0 (1 means off), got {self.repetition_penalty!r}")
        set_("repetition_penalty", float(self.repetition_penalty))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
            set_(name, float(value))
        _check(_is_int(self.no_repeat_ngram_size) and self.no_repeat_ngram_size >= 0,
               f"no_repeat_ngram_size must be an integer >= 0, got {self.no_repeat_ngram_size!r}")
        set_("bad_words", _bad_words(self.bad_words))
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            _check(isinstance(ids, (list, tuple)) and len(ids) > 0 and all(_is_int(i) and i >= 0 for i in ids),
                   f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}")
            set_("allowed_token_ids", tuple(ids))
        if self.logit_bias is not None:
            bias = self.logit_bias
            _check(isinstance(bias, Mapping), f"logit_bias must be a mapping of token id to bias, got {bias!r}")
            try:
                clean = {int(k): float(v) for k, v in bias.items()}
            except (TypeError, ValueError):
                raise ConfigError(f"logit_bias must map token ids to numbers, got {dict(bias)!r}") from None
            _check(all(k >= 0 for k in clean) and all(v == v for v in clean.values()),
                   f"logit_bias keys must be token ids >= 0 and values numbers, got {dict(bias)!r}")
            set_("logit_bias", dict(sorted(clean.items())) or None)
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
               f"seed must be an integer in [0, 2^63) or null, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        _check(isinstance(stop, (list, tuple)) and all(isinstance(x, str) for x in stop),
               f"stop must be a list of strings, got {self.stop!r}")
        _check(all(len(x) > 0 for x in stop), "stop strings must not be empty")
        set_("stop", tuple(stop))
        ids = self.stop_token_ids
        _check(isinstance(ids, (list, tuple)) and all(_is_int(i) and i >= 0 for i in ids),
               f"stop_token_ids must be a list of non-negative token ids, got {ids!r}")
        set_("stop_token_ids", tuple(ids))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        _check(_is_int(self.max_tokens) and self.max_tokens > 0,
               f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               f"logprobs must be null or an integer in [0, 20], got {self.logprobs!r}")
        set_("structured_outputs", StructuredOutputs.coerce(self.structured_outputs))
        # which processors change anything: fixed for these (frozen) parameters, asked per row and step
        set_("_active", frozenset(name for name, on in self._activity().items() if on))
        set_("_active_order", tuple(p for p in self.order if p in self._active))
        self._check_processors()
        set_("_description", tuple([self.describe(p) for p in self.active_processors()]
                                   + ["argmax" if self.greedy else "gumbel_max"]))

    def _check_processors(self) -> None:
        if self.processors is None:
            return
        procs = self.processors
        _check(isinstance(procs, (list, tuple)) and all(isinstance(p, str) for p in procs),
               f"processors must be a list of processor names, got {procs!r}")
        unknown = [p for p in procs if p not in DEFAULT_PROCESSORS]
        _check(not unknown, f"unknown processor {unknown[0]!r} in processors; known: {', '.join(DEFAULT_PROCESSORS)}"
               if unknown else "")
        dup = sorted({p for p in procs if procs.count(p) > 1})
        _check(not dup, f"processor {dup[0]!r} is listed twice in processors" if dup else "")
        object.__setattr__(self, "processors", tuple(procs))
        for name in self.active_processors(DEFAULT_PROCESSORS):
            _check(name in procs, f"{name} is set ({self.describe(name)}) but {name!r} is not in processors")

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
            "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "allowed_token_ids": len(self.allowed_token_ids or ()),
            "bad_words": len(self.bad_words), "logit_bias": len(self.logit_bias or {}),
            "no_repeat_ngram": self.no_repeat_ngram_size, "min_tokens": self.min_tokens,
            "grammar": self.structured_outputs.kind if self.structured_outputs is not None else "none",
            "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p,
        }[name]
        return f"{name}({value:g})" if isinstance(value, float) else f"{name}({value})"

    def pipeline_description(self) -> list[str]:
        """The active processors with their parameters, then the selection rule."""
        return list(self._description)

    def replace(self, **changes) -> "SamplingParams":
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
    def from_mapping(cls, data: Mapping[str, Any] | None) -> "SamplingParams":
        return from_mapping(cls, data, section="sampling")

    @classmethod
    def with_model_defaults(cls, data: Mapping[str, Any] | None, generation: Mapping[str, Any]
                            ) -> tuple["SamplingParams", dict[str, Any]]:
        """The run's sampling section with the model's own defaults (its generation_config) in the fields
        the section leaves at the library's default; and which fields those were."""
        data = dict(data or {})
        library = cls()
        taken = {k: v for k, v in generation.items()
                 if k in {f.name for f in fields(cls)} and data.get(k, getattr(library, k)) == getattr(library, k)}
        return cls.from_mapping({**data, **taken}), taken


def _bad_words(words: Any) -> tuple:
    """Normalise bad_words to a tuple of str and tuple[int, ...] entries."""
    if isinstance(words, str):
        words = (words,)
    _check(isinstance(words, (list, tuple)), f"bad_words must be a list of strings or token-id lists, got {words!r}")
    out: list = []
    for w in words:
        if isinstance(w, str):
            _check(len(w) > 0, "bad_words entries must not be empty")
            out.append(w)
        elif isinstance(w, (list, tuple)) and w and all(_is_int(t) and t >= 0 for t in w):
            out.append(tuple(w))
        else:
            raise ConfigError(f"bad_words entries must be strings or non-empty token-id lists, got {w!r}")
    return tuple(out)


def register_configs() -> None:
    """Register the structured configs Hydra validates types against (the `engine` and `model`
    groups extend these schemas: a mistyped value fails at composition, naming the key)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(group="engine", name="schema", node=_schema(EngineConfig))
    cs.store(group="model", name="schema", node=_schema(ModelConfig))


def _schema(cls):
    """A mutable copy of a frozen config dataclass (same fields, types and defaults) for OmegaConf."""
    import typing

    hints = typing.get_type_hints(cls)
    return dataclasses.make_dataclass(f"{cls.__name__}Schema", [
        (f.name, hints[f.name], dataclasses.field(default=f.default)) for f in fields(cls)])
