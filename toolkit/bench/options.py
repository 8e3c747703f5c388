"""Option checks of the benchmark modes and entry points: a bad value is one ConfigError naming the option,
raised before a model loads or anything is timed (mode=bench's section: `bench_options`; the `python -m
toolkit.bench.<module>` entry points: `positive_int`, `torch_device` and `entry_point`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any

from toolkit.bench.workloads import workload_options
from toolkit.config import KV_CACHE_DTYPES, EngineConfig, SpeculativeConfig, check, from_mapping, is_int, is_number
from toolkit.errors import ConfigError, ToolkitError
from toolkit.sampling.params import SamplingParams

KNOWN_SYSTEMS = ("engine", "engine_notrace", "hf_static", "hf_cb", "naive", "llama_cpp")
FLAGS = (
    "roofline",
    "grammar_cost",
    "invariant_cost",
    "text_cost",
    "kernel_cost",
    "kv_cost",
    "serving",
    "apply_workload_engine_overrides",
)


def count(value: Any, option: str, minimum: int = 1) -> int:
    """An integer of at least `minimum` (not a bool, not 2.5, not "abc")."""
    check(is_int(value) and value >= minimum, f"{option} must be an integer of at least {minimum}, got {value!r}")
    return value


def counts(value: Any, option: str, minimum: int = 1, one_ok: bool = False) -> list[int]:
    """A non-empty list of integers of at least `minimum`; `one_ok`: a lone integer is a list of one."""
    if one_ok and is_int(value):
        value = [value]
    check(
        isinstance(value, (list, tuple)) and bool(value) and all(is_int(v) and v >= minimum for v in value),
        f"{option} must be a non-empty list of integers of at least {minimum}, got {value!r}",
    )
    return list(value)


def names(value: Any, option: str, known: tuple[str, ...]) -> list[str]:
    """A non-empty list of distinct names out of `known` (a lone string is refused: it is no list)."""
    check(
        isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value),
        f"{option} must be a non-empty list of names out of {', '.join(known)}, got {value!r}",
    )
    unknown = [v for v in value if v not in known]
    check(not unknown, f"{option}: unknown {unknown[0]!r}; known: {', '.join(known)}" if unknown else "")
    check(len(set(value)) == len(value), f"{option} names one twice: {list(value)!r}")
    return list(value)


def flag(value: Any, option: str) -> bool:
    check(isinstance(value, bool), f"{option} must be true or false, got {value!r}")
    return value


def mappings(value: Any, option: str) -> dict[str, dict[str, Any]]:
    """{name: {field: value}} (null: none; a name's null: no fields)."""
    value = {} if value is None else value
    check(isinstance(value, Mapping), f"{option} must be a mapping {{name: {{field: value}}}}, got {value!r}")
    for name, fields in value.items():
        check(
            fields is None or isinstance(fields, Mapping),
            f"{option}.{name} must be a mapping of fields, got {fields!r}",
        )
    return {str(name): dict(fields or {}) for name, fields in value.items()}


def named(option: str, build: Callable[[], Any]) -> Any:
    """build(), its ConfigError prefixed with the option it came from."""
    try:
        return build()
    except ConfigError as exc:
        raise ConfigError(f"{option}: {exc}") from None


def sampled_variant(fields: dict[str, Any], max_tokens: int = 1):
    """The SamplingParams of a bench.sampled_variants entry (greedy unless it says otherwise)."""
    data = {"temperature": 0.0, **fields, "max_tokens": max_tokens, "ignore_eos": True}
    return from_mapping(SamplingParams, data, section="bench.sampled_variants")


def engine_variant(engine_cfg: EngineConfig, overrides: dict[str, Any]):
    """(EngineConfig, SpeculativeConfig or None) of a bench.engine_variants entry over `engine_cfg`."""
    overrides = dict(overrides)
    spec = overrides.pop("speculative", None)  # e.g. {speculative: {method: ngram}}
    spec_cfg = from_mapping(SpeculativeConfig, spec, section="speculative") if spec else None
    cfg = from_mapping(EngineConfig, {**dataclasses.asdict(engine_cfg), **overrides}, section="engine")
    return cfg, spec_cfg


def bench_options(b: dict[str, Any], engine_cfg: EngineConfig, hf_dir: Any) -> None:
    """mode=bench's section checked whole, before the model loads: every count, list, flag and variant."""
    systems = names(b.get("systems"), "bench.systems", KNOWN_SYSTEMS)
    check(is_int(b.get("seed")), f"bench.seed must be an integer, got {b.get('seed')!r}")
    workload_options(b.get("workload"), b.get("num_requests"), b.get("max_tokens"), "bench")
    for name in FLAGS:
        if b.get(name) is not None:
            flag(b[name], f"bench.{name}")
    for name in ("repeats", "naive_requests", "naive_max_tokens", "text_tokens", "kv_context"):
        if name in b:
            count(b[name], f"bench.{name}")
    for name in ("serving_clients", "serving_requests", "serving_max_tokens", "roofline_batch_context"):
        if name in b:
            count(b[name], f"bench.{name}")
    if b.get("hf_batch_size") is not None:
        count(b["hf_batch_size"], "bench.hf_batch_size")
    if b.get("host_work_batch") not in (None, False, 0):
        count(b["host_work_batch"], "bench.host_work_batch")
    for name in ("roofline_batches", "roofline_contexts", "grammar_batches", "invariant_batches"):
        if b.get(name) is not None:
            counts(b[name], f"bench.{name}")
    if "roofline_context_batch" in b:
        counts(b["roofline_context_batch"], "bench.roofline_context_batch", one_ok=True)
    if b.get("kv_dtypes") is not None:
        names(b["kv_dtypes"], "bench.kv_dtypes", KV_CACHE_DTYPES)
    for name, positive in (("kv_budget_gb", True), ("serving_stagger_s", False)):
        value = b.get(name)
        if value is not None:
            check(
                is_number(value) and (value > 0 if positive else value >= 0),
                f"bench.{name} must be a {'positive' if positive else 'non-negative'} number, got {value!r}",
            )
    for name, fields in mappings(b.get("sampled_variants"), "bench.sampled_variants").items():
        named(f"bench.sampled_variants.{name}", lambda fields=fields: sampled_variant(fields))
    for name, overrides in mappings(b.get("engine_variants"), "bench.engine_variants").items():
        named(f"bench.engine_variants.{name}", lambda o=overrides: engine_variant(engine_cfg, o))
    if any(s in systems for s in ("hf_static", "hf_cb", "naive")) and hf_dir is None:
        raise ConfigError("HF systems need a checkpoint directory (model=smollm2 or model.path=...)")


# ------------------------------------------------------------------------------------------- entry points


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer of at least 1, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer of at least 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer of at least 0, got {text!r}")
    return value


def torch_device(text: str) -> str:
    """argparse type: a torch device name (cpu, cuda, cuda:1, mps...)."""
    import torch  # deferred: torch, seconds to import, only where a device is asked for

    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} (cpu, cuda, cuda:1, ...)") from None
    return text


def entry_point(main: Callable[[list[str] | None], Any], argv: list[str] | None = None) -> int:
    """Run a `python -m toolkit.bench.<module>` main: a ToolkitError is one line `error: ...` on stderr and its
    exit code (2), not a traceback; otherwise main's int, or 0."""
    try:
        result = main(argv)
    except ToolkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return result if isinstance(result, int) and not isinstance(result, bool) else 0
