"""Validated configuration dataclasses: the model, the engine and speculative decoding (a request's
SamplingParams live in toolkit.sampling.params).

Each config validates itself in `__post_init__` and names the bad value in a one-line
`ConfigError`. Hydra composes plain YAML (conf/); `from_mapping` turns a composed section
into one of these, refusing unknown keys with the list of known ones.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from toolkit.errors import ConfigError

MODEL_NAMES = ("smollm2", "tiny", "hf", "nanogpt")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "kernel", "sdpa", "flex")
MATMUL_BACKENDS = ("auto", "native", "torch")
# toolkit.native.schedules.SETTINGS: each loop with the software prefetch, and without it (-nopf)
MATMUL_SCHEDULES = (
    "auto",
    "fixed",
    "tiles",
    "pairs",
    "quads",
    "hexes",
    "tiles-nopf",
    "pairs-nopf",
    "quads-nopf",
    "hexes-nopf",
)
# toolkit.native.schedules.BUILD_SETTINGS: auto over one build's matmul (toolkit.native.cpu.TARGETS)
MATMUL_BUILD_SCHEDULES = tuple(
    f"auto:{t}" for t in ("x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4", "armv8-a", "generic", "scalar")
)
KV_CACHE_DTYPES = ("auto", "bf16", "int8", "fp8_e4m3")
# fused: prefill chunks and decodes in ONE forward per step (the default); two_forwards: the same schedule, prefill
# chunks and decodes in separate forwards; prefill_first: a waiting prompt is prefilled whole in a step of its
# own before decodes continue (vLLM V0's default); no_chunking: a prompt enters a step only whole
SCHEDULER_POLICIES = ("fused", "two_forwards", "prefill_first", "no_chunking")
MAX_THREADS = 1024  # engine.num_threads: torch crashes setting 100,000


def check(cond: bool, message: str) -> None:
    """A one-line ConfigError with `message` unless `cond`."""
    if not cond:
        raise ConfigError(message)


def is_int(v: Any) -> bool:
    """An int and not a bool (YAML's true is no count)."""
    return isinstance(v, int) and not isinstance(v, bool)


def host_memory_bytes() -> int:
    """This machine's RAM."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def is_number(v: Any) -> bool:
    """An int or float, not a bool, not NaN."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def from_mapping(cls, data: Mapping[str, Any] | None, *, section: str):
    """Build dataclass `cls` from a mapping, naming unknown keys (e.g. a typo) clearly."""
    data = dict(data or {})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown {section} option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
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
        check(self.name in MODEL_NAMES, f"model.name must be one of {MODEL_NAMES}, got {self.name!r}")
        check(
            self.generation_config in ("auto", "none"),
            f"model.generation_config must be auto or none, got {self.generation_config!r}",
        )
        check(self.dtype in DTYPES, f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.name == "hf":
            check(bool(self.path), "model=hf needs model.path=<dir with config.json + safetensors>")
        for name in (
            "vocab_size",
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            check(is_int(value) and value > 0, f"model.{name} must be a positive integer, got {value!r}")
        check(
            self.hidden_size % self.num_heads == 0,
            f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads ({self.num_heads})",
        )
        check(
            self.num_heads % self.num_kv_heads == 0,
            f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads ({self.num_kv_heads})",
        )
        check((self.hidden_size // self.num_heads) % 2 == 0, "model head_dim must be even for RoPE")
        check(
            is_number(self.rope_theta) and 0 < self.rope_theta < math.inf,
            f"model.rope_theta must be a positive number, got {self.rope_theta!r}",
        )
        if self.name == "tiny":  # its random weights are drawn here: sizes past the machine's memory are refused first
            ram = host_memory_bytes()
            d, kv = self.hidden_size, self.hidden_size // self.num_heads * self.num_kv_heads
            weights = 4 * (
                self.vocab_size * d + self.num_layers * (2 * d * d + 2 * d * kv + 3 * d * self.intermediate_size)
            )
            check(
                weights <= ram,
                f"model=tiny of vocab_size {self.vocab_size}, hidden_size {d}, num_layers {self.num_layers}, "
                f"intermediate_size {self.intermediate_size}: {weights / 2**30:.1f} GB of fp32 weights, more than "
                f"this machine's {ram / 2**30:.1f} GB of memory",
            )


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
    # auto: decode-only steps as CUDA graphs over static, padded batch buckets on CUDA; eager: the same buckets
    # without capture, any device (toolkit/engine/graphs.py); off: the runner packs every step
    cuda_graphs: str = "auto"
    # the next decode step scheduled and its forward queued before this step's tokens are read and committed, so
    # that a GPU computes while the host commits (toolkit/engine/ahead.py; vLLM's async_scheduling)
    async_scheduling: bool = False
    enable_prefix_caching: bool = False
    preemption_mode: str = "recompute"  # recompute | swap
    preemption_policy: str = "newest"  # newest | priority
    swap_space_gb: float = 1.0  # host pool for preemption_mode=swap (pinned memory on CUDA)
    # A token's logits are the same bits whatever its batch, chunking, preemption or cache hits
    # (fixed-order matmul and attention kernels; CPU fp32; see toolkit/native/csrc).
    batch_invariant: bool = False
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | bf16 | int8 | fp8_e4m3 (quantised, with scales)
    kv_scale_granularity: str = "block"  # int8/fp8 scales: block (per block and KV head, running) | tensor (static)
    # | channel (keys per block, head and channel, running; values per token and head)
    # auto: the native packed matmul (csrc/matmul_invariant.c) on CPU fp32 when it compiles, else torch's
    matmul_backend: str = "auto"  # auto | native | torch
    # the native CPU matmul's loops per class of rows (toolkit/native/schedules.py): auto (measured at first use,
    # kept per CPU and build) | fixed | tiles | pairs | quads, each also -nopf (no software prefetch); every schedule
    # gives the same bits
    matmul_schedule: str = "auto"
    # which sequence goes first (vLLM's scheduling_policy): fcfs | priority (toolkit/engine/scheduler.py); None:
    # fcfs, and priority in mode=serve. Not scheduler_policy, which says how a step's forward is formed
    scheduling_policy: str | None = None
    scheduler_policy: str = "fused"  # fused | two_forwards | prefill_first | no_chunking (SCHEDULER_POLICIES)
    max_chunk_tokens: int | None = None  # one sequence's prefill chunk at most (None: the step's budget)
    # prefill chunks shrink as their context grows (toolkit.engine.scheduler.chunk_cost): auto (from the model's
    # shape) | the context length at which a token's attention costs as much as the rest of its layer | off;
    # None: off, and auto in mode=serve
    dynamic_chunking: int | str | None = None

    def __post_init__(self):
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            check(is_int(value) and value > 0, f"engine.{name} must be a positive integer, got {value!r}")
        check(
            self.num_kv_blocks is None or (is_int(self.num_kv_blocks) and self.num_kv_blocks > 0),
            f"engine.num_kv_blocks must be a positive integer or null (sized from kv_cache_memory_gb), "
            f"got {self.num_kv_blocks!r}",
        )
        check(
            is_number(self.kv_cache_memory_gb) and 0 < self.kv_cache_memory_gb < math.inf,
            f"engine.kv_cache_memory_gb must be a finite positive number, got {self.kv_cache_memory_gb!r}",
        )
        check(
            self.max_model_len is None or (is_int(self.max_model_len) and self.max_model_len > 0),
            f"engine.max_model_len must be a positive integer or null, got {self.max_model_len!r}",
        )
        check(
            # torch itself crashes (SIGSEGV) setting 100,000 threads
            self.num_threads is None or (is_int(self.num_threads) and 0 < self.num_threads <= MAX_THREADS),
            f"engine.num_threads must be an integer in [1, {MAX_THREADS}] or null, got {self.num_threads!r}",
        )
        check(is_int(self.seed) and self.seed >= 0, f"engine.seed must be a non-negative integer, got {self.seed!r}")
        check(
            isinstance(self.device, str) and re.fullmatch(r"(cpu|cuda|mps)(:[0-9]+)?", self.device) is not None,
            f"engine.device must be cpu, cuda[:N] or mps, got {self.device!r}",
        )
        check(
            isinstance(self.enable_prefix_caching, bool),
            f"engine.enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}",
        )
        check(
            self.preemption_mode in ("recompute", "swap"),
            f"engine.preemption_mode must be recompute or swap, got {self.preemption_mode!r}",
        )
        check(
            self.scheduling_policy in (None, "fcfs", "priority"),
            f"engine.scheduling_policy must be fcfs, priority or null, got {self.scheduling_policy!r}",
        )
        check(
            self.preemption_policy in ("newest", "priority"),
            f"engine.preemption_policy must be newest or priority, got {self.preemption_policy!r}",
        )
        check(
            is_number(self.swap_space_gb) and 0 <= self.swap_space_gb < math.inf,
            f"engine.swap_space_gb must be a finite number >= 0, got {self.swap_space_gb!r}",
        )
        check(
            isinstance(self.batch_invariant, bool),
            f"engine.batch_invariant must be true or false, got {self.batch_invariant!r}",
        )
        check(
            not (self.batch_invariant and self.attention_backend in ("sdpa", "flex")),
            f"engine.batch_invariant=true needs the native attention kernel, not "
            f"engine.attention_backend={self.attention_backend}",
        )
        check(
            isinstance(self.flex_compile, bool), f"engine.flex_compile must be true or false, got {self.flex_compile!r}"
        )
        check(
            isinstance(self.async_scheduling, bool),
            f"engine.async_scheduling must be true or false, got {self.async_scheduling!r}",
        )
        check(
            self.cuda_graphs in ("auto", "eager", "off"),
            f"engine.cuda_graphs must be auto, eager or off, got {self.cuda_graphs!r}",
        )
        check(
            self.attention_backend in ATTENTION_BACKENDS,
            f"engine.attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"engine.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        check(
            self.kv_scale_granularity in ("block", "tensor", "channel"),
            f"engine.kv_scale_granularity must be block, tensor or channel, got {self.kv_scale_granularity!r}",
        )
        check(
            not (self.batch_invariant and self.kv_cache_dtype != "auto"),
            f"engine.batch_invariant=true needs the fp32 cache of the native kernel, not "
            f"engine.kv_cache_dtype={self.kv_cache_dtype}",
        )
        check(
            self.matmul_backend in MATMUL_BACKENDS,
            f"engine.matmul_backend must be one of {MATMUL_BACKENDS}, got {self.matmul_backend!r}",
        )
        check(
            self.matmul_schedule in MATMUL_SCHEDULES + MATMUL_BUILD_SCHEDULES,
            f"engine.matmul_schedule must be one of {MATMUL_SCHEDULES} or auto:<kernel target> (auto over that "
            f"build's matmul: {', '.join(MATMUL_BUILD_SCHEDULES)}), got {self.matmul_schedule!r}",
        )
        check(
            not (self.batch_invariant and self.matmul_backend == "torch"),
            "engine.batch_invariant=true needs the native matmul, not engine.matmul_backend=torch",
        )
        check(
            self.scheduler_policy in SCHEDULER_POLICIES,
            f"engine.scheduler_policy must be one of {SCHEDULER_POLICIES}, got {self.scheduler_policy!r}",
        )
        check(
            self.max_chunk_tokens is None or (is_int(self.max_chunk_tokens) and self.max_chunk_tokens > 0),
            f"engine.max_chunk_tokens must be a positive integer or null, got {self.max_chunk_tokens!r}",
        )
        check(
            self.dynamic_chunking is None
            or self.dynamic_chunking is False
            or self.dynamic_chunking in ("off", "auto")
            or (is_int(self.dynamic_chunking) and self.dynamic_chunking > 0),
            f"engine.dynamic_chunking must be auto, off, a positive integer or null, got {self.dynamic_chunking!r}",
        )
        check(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"engine.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
            f"engine.max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step",
        )


@dataclass(frozen=True)
class TraceConfig:
    """The `trace` section: per-token rows to Parquet (toolkit.trace.writer), checked before anything loads."""

    enabled: bool = True
    flush_every_steps: int = 64  # a crash loses at most this many steps of rows
    full_logits: Any = None  # off | all | request ids (checked by toolkit.trace.writer.full_logits_selection)

    def __post_init__(self):
        check(isinstance(self.enabled, bool), f"trace.enabled must be true or false, got {self.enabled!r}")
        check(
            is_int(self.flush_every_steps) and 1 <= self.flush_every_steps <= 64,
            f"trace.flush_every_steps must be an integer in [1, 64], got {self.flush_every_steps!r}",
        )


SPEC_METHODS = ("none", "ngram", "draft_model", "self_draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (see toolkit.engine.speculative). `method: none` turns it off."""

    method: str = "none"  # none | ngram | draft_model | self_draft
    num_speculative_tokens: int = 4  # k drafts per step
    acceptance: str = "rejection"  # rejection | coupled (greedy requests: accept iff argmax)
    prompt_lookup_min: int = 1  # ngram
    prompt_lookup_max: int = 4
    draft_layers: int = 4  # self_draft: the target's first layers
    draft_model: Mapping[str, Any] | None = None  # draft_model: the fields of a model config

    def __post_init__(self):
        check(self.method in SPEC_METHODS, f"speculative.method must be one of {SPEC_METHODS}, got {self.method!r}")
        check(
            is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= 16,
            f"speculative.num_speculative_tokens must be an integer in [1, 16], got {self.num_speculative_tokens!r}",
        )
        check(
            self.acceptance in ("rejection", "coupled"),
            f"speculative.acceptance must be rejection or coupled, got {self.acceptance!r}",
        )
        check(
            is_int(self.prompt_lookup_min)
            and is_int(self.prompt_lookup_max)
            and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            f"speculative.prompt_lookup_min/max must be integers with 1 <= min <= max, got "
            f"{self.prompt_lookup_min!r}, {self.prompt_lookup_max!r}",
        )
        check(
            is_int(self.draft_layers) and self.draft_layers >= 1,
            f"speculative.draft_layers must be a positive integer, got {self.draft_layers!r}",
        )
        if self.method == "draft_model":
            check(
                isinstance(self.draft_model, Mapping) and bool(self.draft_model),
                "speculative.method=draft_model needs speculative.draft_model (e.g. name: tiny, seed: 77)",
            )

    @property
    def enabled(self) -> bool:
        return self.method != "none"


def register_configs() -> None:
    """Register the structured configs Hydra validates types against (the `engine` and `model`
    groups extend these schemas: a mistyped value fails at composition, naming the key)."""
    from hydra.core.config_store import ConfigStore  # deferred: hydra, with its ANTLR parser

    cs = ConfigStore.instance()
    cs.store(group="engine", name="schema", node=_schema(EngineConfig))
    cs.store(group="model", name="schema", node=_schema(ModelConfig))


def _schema(cls):
    """A mutable copy of a frozen config dataclass (same fields, types and defaults) for OmegaConf."""
    hints = typing.get_type_hints(cls)
    return dataclasses.make_dataclass(
        f"{cls.__name__}Schema", [(f.name, hints[f.name], dataclasses.field(default=f.default)) for f in fields(cls)]
    )
