"""Replay: rebuild a run from its directory alone, run it again, compare every sample row bit for bit.

The run directory holds everything needed: the resolved config (`config.yaml`), the
requests with their resolved seeds (`requests.parquet`) and the manifest (weights and
tokenizer digests, schema version, thread count). Scheduling is a function of steps,
never of wall time, so the same config gives the same batches, the same logits bits and
the same tokens. `overrides` (Hydra syntax, e.g. `engine.max_num_batched_tokens=8`)
change the recorded config to test whether a change alters results.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from toolkit.config import MAX_THREADS, TraceConfig, from_mapping, is_int
from toolkit.engine.core import Engine, EngineRequest
from toolkit.errors import ConfigError
from toolkit.runs.manifest import native_kernels
from toolkit.runs.session import record
from toolkit.sampling.params import SamplingParams
from toolkit.trace.diverge import (
    REPLAYED_FIELDS,
    Difference,
    Divergence,
    first_divergences,
    row_differences,
    sequences,
    show,
)
from toolkit.trace.reader import (
    TraceError,
    check_rows_present,
    read_config,
    read_manifest,
    read_requests,
    read_samples,
    require_rows,
)
from toolkit.trace.writer import atomic_write_table


@dataclass
class ReplayReport:
    trace_dir: Path
    replay_dir: Path
    rows_compared: int = 0
    sequences_compared: int = 0
    sequences_unfinished_in_trace: int = 0  # a partial trace (killed mid-run): only its rows are compared
    rows_only_in_replay: int = 0
    rows_missing_in_replay: int = 0
    token_mismatches: int = 0  # rows whose token differs
    logprob_bit_mismatches: int = 0  # rows with the same token but different logprob bits
    max_abs_logprob_diff: float = 0.0  # over rows with the same token
    differences: list[Difference] = field(default_factory=list)  # every differing field of every row
    first_divergences: list[Divergence] = field(default_factory=list)  # each diverged sequence's first, and why
    mismatches: list[str] = field(default_factory=list)  # manifest differences let through by allow_mismatch
    cannot_rebuild: list[str] = field(default_factory=list)  # what the trace did not keep (replayed without it)
    overrides: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not self.differences and not self.rows_missing_in_replay

    def summary_line(self) -> str:
        partial = (
            f" (partial trace: {self.sequences_unfinished_in_trace} sequences unfinished, their recorded rows compared)"
            if self.sequences_unfinished_in_trace
            else ""
        )
        if self.identical:
            return (
                f"bit-identical: {self.rows_compared} sample rows of {self.sequences_compared} sequences match "
                f"(token_id, raw/processed logprob bits, logits_sha256, noise, kept_sha256, top alternatives, grammar "
                f"and speculative counts){partial}"
            )
        diverged = len(self.first_divergences)
        extra = {
            (d.request_id, d.stream, d.position) for d in self.differences if d.field == "row" and d.a == "missing"
        }
        rows = len({(d.request_id, d.stream, d.position) for d in self.differences} - extra)
        other = rows - self.token_mismatches - self.logprob_bit_mismatches - self.rows_missing_in_replay
        return (
            f"diverged: {diverged} of {self.sequences_compared} sequences, {rows} of {self.rows_compared} "
            f"rows differ: tokens in {self.token_mismatches} rows, logprob bits (same token) in "
            f"{self.logprob_bit_mismatches} rows, other fields only in {other} rows; "
            f"max |logprob diff| {self.max_abs_logprob_diff:.3g}"
            + (
                f", {self.rows_missing_in_replay} recorded rows missing from the replay"
                if self.rows_missing_in_replay
                else ""
            )
            + (f", {len(extra)} replayed rows past a recorded sequence's end" if extra else "")
            + partial
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "trace_dir": str(self.trace_dir),
            "replay_dir": str(self.replay_dir),
            "identical": self.identical,
            "rows_compared": self.rows_compared,
            "sequences_compared": self.sequences_compared,
            "sequences_unfinished_in_trace": self.sequences_unfinished_in_trace,
            "rows_only_in_replay": self.rows_only_in_replay,
            "rows_missing_in_replay": self.rows_missing_in_replay,
            "token_mismatches": self.token_mismatches,
            "logprob_bit_mismatches": self.logprob_bit_mismatches,
            "max_abs_logprob_diff": self.max_abs_logprob_diff,
            "mismatches": self.mismatches,
            "overrides": self.overrides,
            "cannot_rebuild": self.cannot_rebuild,
            "first_divergences": [
                {**d.to_dict(), "describe": d.describe("recorded", "replayed")} for d in self.first_divergences
            ],
        }


def apply_overrides(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """Apply Hydra-syntax `key=value` overrides (`+key=value` adds, `~key` deletes) to a loaded config."""
    from hydra.core.override_parser.overrides_parser import OverridesParser  # deferred: ANTLR
    from hydra.errors import HydraException  # deferred: hydra, with its ANTLR parser

    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):  # a string: its characters
        raise ConfigError(f"replay.overrides must be a list of key=value strings, got {overrides!r}")
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise ConfigError(f"bad replay override: {exc}") from None
    for o in parsed:
        key = o.key_or_group
        if o.is_delete():
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            if node is None or leaf not in node:
                raise ConfigError(f"replay override ~{key}: no such key in the recorded config")
            del node[leaf]
            continue
        current = OmegaConf.select(cfg, key, default="__missing__")
        if not o.is_add() and current == "__missing__":
            raise ConfigError(f"replay override {key}: no such key in the recorded config (use +{key}=... to add)")
        if isinstance(current, DictConfig) and not isinstance(o.value(), dict):  # `model=hf`: a config group's name
            raise ConfigError(
                f"replay override {o.input_line!r} replaces the recorded {key} section with {o.value()!r}: replay "
                f"overrides set keys of the recorded config (e.g. {key}.<key>=...), not config groups"
            )
        OmegaConf.update(cfg, key, o.value(), merge=True, force_add=o.is_add())
    return cfg


# what a replay's overrides cannot change: each request is re-added from requests.parquet with its recorded
# sampling, prompt ids and resolved seed, so these sections (sampling=, processors= and structured_outputs= write
# sampling) and the seed that resolved the seeds never reach it
# (model.generation_config: the sampling defaults the run took from it are in each request's recorded sampling)
FIXED_BY_THE_TRACE = (
    "sampling",
    "processors",
    "structured_outputs",
    "workload",
    "engine.seed",
    "model.generation_config",
)


def replay_overrides(overrides: Any) -> list[str]:
    """`replay.overrides` as a list of strings (a ConfigError for anything else: one string, a number)."""
    if isinstance(overrides, str) or not isinstance(overrides, (Sequence, ListConfig)):
        raise ConfigError(f"replay.overrides must be a list of key=value strings, got {overrides!r}")
    if not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"replay.overrides must be a list of key=value strings, got {list(overrides)!r}")
    return list(overrides)


def check_overrides(overrides: Sequence[str]) -> None:
    """A ConfigError for an override a replay would take without effect: replay.json recorded it while the run
    used the trace's values, and said "bit-identical", as if a temperature or a seed changed nothing."""
    for o in [] if isinstance(overrides, str) else overrides:  # one string: apply_overrides says what is wrong
        if not isinstance(o, str):
            continue
        key = o.lstrip("+~").split("=", 1)[0].strip()
        if any(key == k or key.startswith(k + ".") for k in FIXED_BY_THE_TRACE):
            raise ConfigError(
                f"replay override {o!r} cannot change a replay: each request is re-added from requests.parquet with "
                f"its recorded sampling, prompt ids and resolved seed; a replay's overrides change engine.*, model.* "
                f"(not model.generation_config, whose sampling defaults are in the recorded sampling) and "
                f"speculative.* (to sample otherwise, run the workload again)"
            )


def check_manifest(manifest: dict[str, Any], engine: Engine, allow_mismatch: bool) -> list[str]:
    """Differences between the recorded run and the rebuilt engine that make bits incomparable."""
    loaded = engine.loaded
    problems = []
    if manifest.get("weights_sha256") != loaded.revision:
        problems.append(
            f"model weights differ: recorded sha256 {str(manifest.get('weights_sha256'))[:12]}..., "
            f"now {loaded.revision[:12]}..."
        )
    rebuilt = str(loaded.model.embed.dtype).removeprefix("torch.")
    if manifest.get("dtype", "float32") != rebuilt:  # the manifest's word against what config.yaml loads
        problems.append(f"model format differs: recorded {manifest.get('dtype', 'float32')}, replay {rebuilt}")
    token_digest = loaded.tokenizer.digest if loaded.tokenizer else None
    if manifest.get("tokenizer_sha256") != token_digest:
        problems.append("tokenizer differs from the recorded one")
    recorded_mode = bool(manifest.get("batch_invariant", False))
    if recorded_mode != engine.cfg.batch_invariant:
        problems.append(
            f"engine.batch_invariant differs: recorded {str(recorded_mode).lower()}, replay "
            f"{str(engine.cfg.batch_invariant).lower()} (the two modes' logits differ in the last bits)"
        )
    recorded_kv = manifest.get("kv_cache_dtype", "auto")
    recorded_granularity = manifest.get("kv_scale_granularity")
    if (recorded_kv, recorded_granularity) != (engine.cfg.kv_cache_dtype, engine.kv_cache.granularity):
        problems.append(
            f"KV cache storage differs: recorded {recorded_kv}"
            f"{'/' + recorded_granularity if recorded_granularity else ''}, replay "
            f"{engine.cfg.kv_cache_dtype}{'/' + engine.kv_cache.granularity if engine.kv_cache.granularity else ''}"
        )
    # traces from before engine.matmul_backend used torch's GEMM except in batch-invariant mode
    recorded_matmul = manifest.get("matmul_backend") or ("native" if recorded_mode else "torch")
    if recorded_matmul != engine.matmul_backend:
        problems.append(
            f"matmul backend differs: recorded {recorded_matmul}, replay {engine.matmul_backend} "
            f"(set engine.matmul_backend={recorded_matmul})"
        )

    recorded_numerics, now = manifest.get("kernel_numerics"), native_kernels(engine)
    if recorded_numerics and now["kernel_numerics"] and recorded_numerics != now["kernel_numerics"]:
        problems.append(
            f"native kernel numerics differ: recorded {recorded_numerics} ({manifest.get('native_kernels')}), replay "
            f"{now['kernel_numerics']} ({now['native_kernels']}) (the kernels' bits depend on lanes and FMA: replay "
            f"on a CPU that "
            f"runs {manifest.get('kernel_target')}, with TOOLKIT_KERNEL_TARGET={manifest.get('kernel_target')})"
        )
    if problems and not allow_mismatch:
        raise TraceError(f"refusing to replay: {problems[0]} (replay.allow_mismatch=true compares anyway)")
    return problems


def recorded_sampling(row: dict[str, Any]) -> SamplingParams:
    """A requests.parquet row's SamplingParams: its JSON with its resolved seed (a TraceError naming the row where
    that is no JSON object)."""
    try:
        params = json.loads(row["sampling_params"])
    except (TypeError, ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
        params = None
    if not isinstance(params, dict):
        raise TraceError(f"requests.parquet: the sampling_params of {row['request_id']}#{row['stream']} are corrupt")
    return SamplingParams.from_mapping({**params, "seed": row["seed"]})


def add_recorded_requests(engine: Engine, requests: list[dict[str, Any]]) -> list[str]:
    """Re-add every recorded request (requests.parquet's rows) with its recorded prompt ids, resolved seed and
    arrival step, in the recorded order (the order of arrivals within a step)."""
    ids: list[str] = []
    for row in requests:
        if engine.has_request(row["request_id"]):
            continue  # one row per sequence: the request was added with its first row
        params = recorded_sampling(row)
        if params.stop and engine.tokenizer is None:  # recorded before such stops were refused: they never matched
            params = params.replace(stop=())
        engine.add(
            EngineRequest(
                prompt_token_ids=row["prompt_token_ids"],
                request_id=row["request_id"],
                arrival_step=row["arrival_step"],
                sampling_params=params,
                priority=row.get("priority") or 0,
            )
        )
        ids.append(row["request_id"])
    return ids


def recorded_aborts(requests: list[dict[str, Any]], samples: pa.Table | None = None) -> Callable[[Engine], None]:
    """Abort each request before the step its recorded run aborted it at (a served client that left). A trace
    cut short (a run killed with requests unfinished) ends the replay after its last recorded step: every request
    still running then is aborted, since nothing past that step was recorded to compare (aborting one request
    earlier would change its batch mates' steps)."""
    due: dict[int, list[str]] = {}
    for row in requests:
        if row.get("abort_step") is not None and row["stream"] == 0:
            due.setdefault(row["abort_step"], []).append(row["request_id"])
    truncated = any(r["finish_reason"] is None and r.get("abort_step") is None for r in requests)
    last_step = None  # of a trace cut short: its last step with a row (-1: it has none)
    if truncated and samples is not None:
        last_step = pc.max(samples.column("step")).as_py() if samples.num_rows else -1

    def before_step(engine: Engine) -> None:
        for step in [s for s in due if s <= engine.step_index]:
            for request_id in due.pop(step):
                engine.abort(request_id)
        if last_step is not None and engine.step_index > last_step:
            for request_id in engine.unfinished_request_ids():
                engine.abort(request_id)

    return before_step


def compare(
    recorded: pa.Table, replayed: pa.Table, report: ReplayReport, aborted: frozenset[tuple[str, int]] = frozenset()
) -> None:
    """Every recorded row against the replay's (toolkit.trace.diverge), and each sequence's first divergence.
    `aborted`: sequences the recorded run aborted (no finish row, yet finished: a replayed row past their last one
    is a divergence, as past any finished sequence's; past an unfinished (partial) one, it is simply not in the
    trace)."""
    key = lambda r: (r["request_id"], r["stream"], r["position"])  # noqa: E731
    rows = recorded.to_pylist()
    mine = {key(r): r for r in replayed.to_pylist()}
    seen = {key(r) for r in rows}
    sequences_recorded = {(r["request_id"], r["stream"]) for r in rows}
    finished = set(aborted) | {(r["request_id"], r["stream"]) for r in rows if r["finish_reason"] is not None}
    ended = (sequences_recorded | set(aborted)) & finished
    compared = [r for k, r in mine.items() if k in seen or (k[0], k[1]) in ended]
    report.rows_compared = len(rows)
    report.sequences_compared = len(sequences_recorded)
    report.sequences_unfinished_in_trace = len(sequences_recorded - finished)
    report.rows_only_in_replay = sum(1 for k in mine if k not in seen)
    for r in rows:
        differences = row_differences(key(r), r, mine.get(key(r)), REPLAYED_FIELDS)
        report.differences += differences
        fields = {d.field for d in differences}
        if "row" in fields:
            report.rows_missing_in_replay += 1
        elif "token_id" in fields:
            report.token_mismatches += 1
        elif fields & {"raw_logprob", "processed_logprob"}:
            report.logprob_bit_mismatches += 1
        if fields and not fields & {"row", "token_id"}:
            other = mine[key(r)]
            for f in ("raw_logprob", "processed_logprob"):
                if r[f] is not None and other[f] is not None and math.isfinite(r[f]) and math.isfinite(other[f]):
                    report.max_abs_logprob_diff = max(report.max_abs_logprob_diff, abs(r[f] - other[f]))
    for k in sorted(mine.keys() - seen):
        if (k[0], k[1]) in ended:
            report.differences += row_differences(k, None, mine[k], REPLAYED_FIELDS)
    if report.differences:  # an identical replay's rows were just compared: not again
        report.first_divergences = first_divergences(sequences(rows), sequences(compared), REPLAYED_FIELDS)


def write_divergences(path: Path, differences: Iterable[Difference]) -> None:
    """divergence.parquet: one row per differing field of a row, both values as text (floats with their bits)."""
    rows = list(differences)
    table = pa.table(
        {
            "request_id": [d.request_id for d in rows],
            "stream": pa.array([d.stream for d in rows], pa.int32()),
            "position": pa.array([d.position for d in rows], pa.int64()),
            "field": [d.field for d in rows],
            "recorded": [show(d.field, d.a) for d in rows],
            "replayed": [show(d.field, d.b) for d in rows],
        }
    )
    atomic_write_table(path, table)


def cannot_rebuild(manifest: dict[str, Any]) -> list[str]:
    """What a served run recorded without: its HTTP bodies under serve.record_body=hash or off."""
    kept = manifest.get("record_body", "full")
    if kept == "full":
        return []
    what = "their sha256 only" if kept == "hash" else "nothing of them"
    return [
        f"the HTTP request bodies (serve.record_body={kept}: the trace keeps {what}): the requests cannot be "
        f"re-sent to a server as received; the engine requests are replayed from their recorded token ids and "
        f"resolved sampling"
    ]


def replay(
    run_dir: str | Path,
    overrides: Sequence[str] = (),
    *,
    allow_mismatch: bool = False,
    out_dir: str | Path | None = None,
) -> ReplayReport:
    """Re-run a recorded run (optionally with config overrides) and compare every sample row."""
    run_dir = Path(run_dir)
    overrides = replay_overrides(overrides)
    if not isinstance(allow_mismatch, bool):  # "false" (a string) was true
        raise ConfigError(f"replay.allow_mismatch must be true or false, got {allow_mismatch!r}")
    mismatches: list[str] = []
    try:
        manifest = read_manifest(run_dir)
    except TraceError as exc:
        if not allow_mismatch or "schema version" not in str(exc):
            raise
        mismatches.append(str(exc))
        manifest = json.loads((run_dir / "manifest.json").read_text())
    recorded_cfg = read_config(run_dir)
    requests = read_requests(run_dir, check_version=not allow_mismatch)
    recorded_samples = read_samples(run_dir, check_version=not allow_mismatch)
    check_rows_present(requests, recorded_samples, run_dir)
    require_rows(recorded_samples, run_dir, "replay")
    check_overrides(overrides)
    cfg = apply_overrides(recorded_cfg, overrides)
    trace_section = cfg.get("trace")
    if not isinstance(trace_section, (DictConfig, type(None))):
        raise TraceError(f"{run_dir / 'config.yaml'}: its trace section is {trace_section!r}, not a mapping")
    trace_section = OmegaConf.to_container(trace_section, resolve=True) if trace_section is not None else {}
    trace_cfg = from_mapping(TraceConfig, trace_section, section="trace")  # checked before the model loads
    if not any(o.split("=")[0].lstrip("+") == "engine.num_threads" for o in overrides):
        threads = manifest.get("num_threads")  # none recorded: this process's
        threads = torch.get_num_threads() if threads is None else threads
        if not is_int(threads) or not 1 <= threads <= MAX_THREADS:  # torch crashes setting 100,000
            raise TraceError(
                f"{run_dir / 'manifest.json'}: num_threads {threads!r} is no thread count (an integer in "
                f"[1, {MAX_THREADS}])"
            )
        torch.set_num_threads(threads)
    engine = Engine.from_config(cfg)
    mismatches += check_manifest(manifest, engine, allow_mismatch)
    out_dir = (
        Path(out_dir) if out_dir is not None else run_dir.parent / f"{run_dir.name}-replay-{time.strftime('%H%M%S')}"
    )
    request_rows = requests.to_pylist()
    ids = add_recorded_requests(engine, request_rows)
    record(
        engine,
        ids,
        out_dir,
        cfg,
        flush_every_steps=trace_cfg.flush_every_steps,
        before_step=recorded_aborts(request_rows, recorded_samples),
        manifest_extra={"replay_of": manifest.get("run_id"), "replay_overrides": list(overrides)},
    )
    report = ReplayReport(
        trace_dir=run_dir,
        replay_dir=out_dir,
        mismatches=mismatches,
        overrides=list(overrides),
        cannot_rebuild=cannot_rebuild(manifest),
    )
    aborted = frozenset((r["request_id"], r["stream"]) for r in request_rows if r.get("abort_step") is not None)
    compare(recorded_samples, read_samples(out_dir), report, aborted)
    if report.differences:
        write_divergences(out_dir / "divergence.parquet", report.differences)
    (out_dir / "replay.json").write_text(json.dumps(report.to_dict(), indent=2))
    return report
