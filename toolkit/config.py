"""Validated configuration dataclasses.

Each config validates itself in `__post_init__` and names the bad value in a one-line
`ConfigError`. Hydra composes plain YAML (conf/); `from_mapping` turns a composed section
into one of these, refusing unknown keys with the list of known ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from toolkit.errors import ConfigError

MODEL_NAMES = ("smollm2", "tiny", "hf")
DTYPES = ("float32", "bfloat16", "float16")


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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

    def __post_init__(self):
        _check(self.name in MODEL_NAMES, f"model.name must be one of {MODEL_NAMES}, got {self.name!r}")
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
    num_kv_blocks: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    seed: int = 0  # run seed: requests without a seed derive theirs from it
    num_threads: int | None = None  # torch intra-op threads (None: torch's default)

    def __post_init__(self):
        for name in ("block_size", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            _check(_is_int(value) and value > 0, f"engine.{name} must be a positive integer, got {value!r}")
        _check(self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len > 0),
               f"engine.max_model_len must be a positive integer or null, got {self.max_model_len!r}")
        _check(self.num_threads is None or (_is_int(self.num_threads) and self.num_threads > 0),
               f"engine.num_threads must be a positive integer or null, got {self.num_threads!r}")
        _check(_is_int(self.seed) and self.seed >= 0, f"engine.seed must be a non-negative integer, got {self.seed!r}")
        _check(isinstance(self.device, str) and self.device.split(":")[0] in ("cpu", "cuda", "mps"),
               f"engine.device must be cpu, cuda[:N] or mps, got {self.device!r}")
        _check(self.max_num_batched_tokens >= self.max_num_seqs,
               f"engine.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
               f"engine.max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding policy. Field names and defaults follow vLLM's SamplingParams."""

    temperature: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        t = self.temperature
        _check(isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0 and t == t,
               f"temperature must be a number >= 0 (0 means greedy), got {t!r}")
        _check(self.seed is None or (_is_int(self.seed) and self.seed >= 0),
               f"seed must be a non-negative integer or null, got {self.seed!r}")
        _check(_is_int(self.max_tokens) and self.max_tokens > 0,
               f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        ids = self.stop_token_ids
        _check(isinstance(ids, (list, tuple)) and all(_is_int(i) and i >= 0 for i in ids),
               f"stop_token_ids must be a list of non-negative token ids, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        object.__setattr__(self, "temperature", float(t))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["stop_token_ids"] = list(self.stop_token_ids)
        return out

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> "SamplingParams":
        return from_mapping(cls, data, section="sampling")
