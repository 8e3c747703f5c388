"""mode=soak: hold the engine under load for a while and check that nothing leaks or goes wrong.

    python run.py experiment=soak                      # 10 minutes on the tiny model
    python run.py experiment=soak soak.duration_s=30   # the suite's version

Requests with random prompt lengths, sampling parameters and max_tokens keep arriving so
that the queue never drains; after every step each unfinished request (queued, running
or preempted) is aborted with probability `abort_prob`, so most requests end aborted, and
those still in flight at the end are aborted too (`aborted` counts both); the KV pool
is small enough that preemption (recompute or swap, alternating by request) is constant.
Every step's sample rows go through the trace writer. Checked at the end, and the exit
code says whether all held: no exception, the block manager's invariants at every
`check_every` steps, every block free once the last request is released, trace rows ==
rows the engine emitted == tokens committed + error rows, and RSS growth after warm-up
below `max_rss_growth_mb`. The report goes to soak.json in the run directory. Ctrl-C or SIGTERM stops it
between steps: the trace closed (every row emitted so far on disk), soak.json written with what was measured so far
and `interrupted`, exit 130 (143 for SIGTERM) with one line.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import psutil
from omegaconf import DictConfig, OmegaConf

from toolkit.config import EngineConfig, ModelConfig, check, from_mapping, is_int, is_number
from toolkit.engine.core import Engine, EngineRequest
from toolkit.errors import ConfigError
from toolkit.models import load_model
from toolkit.modes.serve_soak import soak_http
from toolkit.runs.manifest import new_run_id
from toolkit.runs.signals import StopRequest, stop_between_steps
from toolkit.sampling.params import SamplingParams
from toolkit.trace.writer import TraceWriter


def soak(
    loaded,
    engine_cfg: EngineConfig,
    run_dir: Path,
    *,
    duration_s: float,
    seed: int = 0,
    queue_depth: int = 48,
    abort_prob: float = 0.02,
    max_prompt: int = 160,
    max_new: int = 48,
    check_every: int = 50,
    warmup_s: float = 5.0,
    max_rss_growth_mb: float = 200.0,
) -> dict[str, Any]:
    rnd = random.Random(seed)
    engine = Engine(loaded, engine_cfg)
    writer = TraceWriter(run_dir, new_run_id(), flush_every_steps=64)
    proc = psutil.Process()
    vocab = loaded.arch.vocab_size
    live: set[str] = set()
    counts = {
        "added": 0,
        "finished": 0,
        "aborted": 0,
        "errored": 0,
        "preemptions": 0,
        "tokens": 0,
        "sample_rows": 0,
        "error_rows": 0,
        "steps": 0,
        "invariant_checks": 0,
    }
    start = time.perf_counter()
    rss_warm = None
    next_id = 0
    stop = StopRequest()

    def step() -> None:
        nonlocal next_id, rss_warm
        while len(live) < queue_depth:
            n = rnd.randint(1, max_prompt)
            params = SamplingParams(
                temperature=rnd.choice([0.0, 0.7, 1.0]),
                top_p=rnd.choice([1.0, 0.9]),
                top_k=rnd.choice([-1, 50]),
                max_tokens=rnd.randint(1, max_new),
                seed=rnd.randrange(2**31),
                n=rnd.choice([1, 1, 1, 2]),
                repetition_penalty=rnd.choice([1.0, 1.1]),
            )
            rid = engine.add(
                EngineRequest(
                    prompt_token_ids=[rnd.randrange(vocab) for _ in range(n)],
                    request_id=f"soak-{next_id}",
                    sampling_params=params,
                )
            )
            next_id += 1
            live.add(rid)
            counts["added"] += 1
        out = engine.step(trace_digests=True)
        counts["steps"] += 1
        writer.write_output(out)
        counts["sample_rows"] += len(out.samples)
        counts["error_rows"] += sum(1 for row in out.samples if row.token_id < 0)
        counts["preemptions"] += len(out.preempted)
        # per step, not per request: an abort lands at any stage (queued, mid-prefill, preempted, decoding)
        unfinished = sorted(r for r in live if not engine.output(r).finished)
        for rid in unfinished:
            if rnd.random() < abort_prob:
                engine.abort(rid)
        for rid in sorted(live):
            result = engine.output(rid)
            if result.finished:
                engine.release(rid)
                live.discard(rid)
                reasons = {c.finish_reason for c in result.outputs}
                counts["aborted" if "abort" in reasons else "errored" if "error" in reasons else "finished"] += 1
                counts["tokens"] += sum(len(c.token_ids) for c in result.outputs)
        if counts["steps"] % check_every == 0:
            engine.check_invariants()
            counts["invariant_checks"] += 1
        if rss_warm is None and time.perf_counter() - start >= warmup_s:
            rss_warm = proc.memory_info().rss / 2**20

    try:
        with stop_between_steps() as stop:  # a signal stops the soak between steps
            while time.perf_counter() - start < duration_s and not stop.pressed:
                step()
    except KeyboardInterrupt:  # a second signal, mid-step: what was emitted so far is still written below
        stop.pressed = True
    writer.close()  # every row emitted so far on disk (the drain below aborts and releases, emitting none)
    for rid in sorted(live):  # drain: abort what still runs, release everything
        engine.abort(rid)
        result = engine.release(rid)
        counts["aborted"] += 1
        counts["tokens"] += sum(len(c.token_ids) for c in result.outputs)
    engine.check_invariants()
    rss_end = proc.memory_info().rss / 2**20
    rss_warm = rss_warm if rss_warm is not None else rss_end
    pool = engine.stats()
    report = {
        **counts,
        "seconds": time.perf_counter() - start,
        "trace_rows": writer.rows_written,
        "leaked_blocks": pool.kv_blocks_total - pool.kv_blocks_free,
        "engine_requests_left": pool.requests,
        "rss_after_warmup_mb": rss_warm,
        "rss_end_mb": rss_end,
        "rss_growth_mb": rss_end - rss_warm,
        "num_kv_blocks": pool.kv_blocks_total,
    }
    problems = []
    if report["leaked_blocks"]:
        problems.append(f"{report['leaked_blocks']} KV blocks not returned")
    if report["engine_requests_left"]:
        problems.append(f"{report['engine_requests_left']} requests left in the engine")
    if report["trace_rows"] != report["sample_rows"]:
        problems.append(f"trace rows {report['trace_rows']} != rows emitted {report['sample_rows']}")
    if report["tokens"] + report["error_rows"] != report["sample_rows"]:
        problems.append(
            f"tokens committed {report['tokens']} + error rows {report['error_rows']} != rows emitted "
            f"{report['sample_rows']}"
        )
    if report["rss_growth_mb"] > max_rss_growth_mb:
        problems.append(f"RSS grew {report['rss_growth_mb']:.0f} MB after warm-up (limit {max_rss_growth_mb:.0f})")
    report["problems"] = problems
    report["passed"] = not problems and not stop.pressed
    if stop.pressed:
        report.update(interrupted=True, signal=stop.name)
    (run_dir / "soak.json").write_text(json.dumps(report, indent=2))
    if stop.pressed:
        raise stop.interrupted(
            f"soak interrupted after {report['steps']} steps, {report['seconds']:.0f} s ({stop.name}): trace closed "
            f"({report['trace_rows']} rows) and soak.json written in {run_dir}"
            + (f"; {'; '.join(problems)}" if problems else "")
        )
    return report


def run_soak(cfg: DictConfig, run_dir: Path) -> int:
    s = OmegaConf.to_container(cfg.soak, resolve=True) if cfg.get("soak") else {}
    engine_cfg = from_mapping(EngineConfig, OmegaConf.to_container(cfg.engine, resolve=True), section="engine")
    model_cfg = from_mapping(ModelConfig, OmegaConf.to_container(cfg.model, resolve=True), section="model")
    over = s.pop("over", "engine")
    known = (
        HTTP_OPTIONS
        if over == "http"
        else {
            "duration_s",
            "seed",
            "queue_depth",
            "abort_prob",
            "max_prompt",
            "max_new",
            "check_every",
            "warmup_s",
            "max_rss_growth_mb",
        }
    )
    if over not in ("engine", "http"):
        raise ConfigError(f"soak.over must be engine or http, got {over!r}")
    unknown = sorted(set(s) - known)
    if unknown:
        raise ConfigError(
            f"unknown soak option(s) for soak.over={over}: {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    check_options(s, over)
    run_dir.mkdir(parents=True, exist_ok=True)
    loaded = load_model(model_cfg, engine_cfg.device)
    if over == "http":
        return _run_http(cfg, loaded, engine_cfg, run_dir, s)
    report = soak(loaded, engine_cfg, run_dir, **s)
    print(
        f"soak: {report['seconds']:.0f} s, {report['steps']} steps, {report['added']} requests "
        f"({report['finished']} finished, {report['aborted']} aborted, {report['errored']} errored), "
        f"{report['preemptions']} preemptions, {report['tokens']} tokens, {report['trace_rows']} trace rows; "
        f"leaked blocks {report['leaked_blocks']}; RSS {report['rss_after_warmup_mb']:.0f} -> "
        f"{report['rss_end_mb']:.0f} MB ({report['rss_growth_mb']:+.0f} MB)"
    )
    for p in report["problems"]:
        print(f"FAILED: {p}")
    print(f"soak.json: {run_dir}")
    return 0 if report["passed"] else 1


HTTP_OPTIONS = {
    "requests",
    "concurrency",
    "max_tokens",
    "report_every",
    "seed",
    "max_waiting",
    "burst",
    "replay",
    "max_rss_growth_mb",
    "max_flush_ratio",
}


def _run_http(cfg: DictConfig, loaded, engine_cfg: EngineConfig, run_dir: Path, s: dict[str, Any]) -> int:
    """soak.over=http: toolkit.modes.serve_soak over a real server; the goals (RSS growth, flush time) checked here."""
    max_growth, max_ratio = s.pop("max_rss_growth_mb", 100.0), s.pop("max_flush_ratio", 1.5)
    config = OmegaConf.to_container(cfg, resolve=True)
    report = soak_http(Engine(loaded, engine_cfg), run_dir, config, **s)
    growth, ratio = report.get("rss_growth_mb"), report.get("flush_last_over_second")
    if growth is not None and growth > max_growth:
        report["problems"].append(
            f"RSS grew {growth:.0f} MB from the first checkpoint to the last (limit {max_growth:.0f})"
        )
    if ratio is not None and ratio > max_ratio:
        report["problems"].append(f"flush time of the last thousand is {ratio:.2f}x the second's (limit {max_ratio})")
    print(
        f"soak over HTTP: {report['served']} requests served in {report['seconds']:.0f} s "
        f"({report['retried_503']} 503s retried), {report['tokens']} tokens; trace: {report['trace_requests']} "
        f"requests, {report['trace_sample_rows']} sample rows; RSS growth "
        f"{growth if growth is None else f'{growth:+.0f} MB'}, flush last / second "
        f"{ratio if ratio is None else f'{ratio:.2f}x'}; replay: {report.get('replay', 'not run')}"
    )
    for p in report["problems"]:
        print(f"FAILED: {p}")
    print(f"soak_http.json: {run_dir}")
    return 0 if not report["problems"] else 1


MAX_QUEUE = 4096  # requests a soak keeps live or waiting at once (soak.queue_depth, soak.concurrency, soak.burst)
# each option's check: (kind, least, most); kind "count": an integer, "number": an int or float, "bool": true / false
ENGINE_CHECKS: dict[str, tuple[str, float, float]] = {
    "duration_s": ("number", 0.001, float("inf")),
    "seed": ("count", 0, float("inf")),
    "queue_depth": ("count", 1, MAX_QUEUE),
    "abort_prob": ("number", 0, 1),
    "max_prompt": ("count", 1, float("inf")),
    "max_new": ("count", 1, float("inf")),
    "check_every": ("count", 1, float("inf")),
    "warmup_s": ("number", 0, float("inf")),
    "max_rss_growth_mb": ("number", 0, float("inf")),
}
HTTP_CHECKS: dict[str, tuple[str, float, float]] = {
    "requests": ("count", 1, float("inf")),
    "concurrency": ("count", 1, MAX_QUEUE),
    "max_tokens": ("count", 1, float("inf")),
    "report_every": ("count", 1, float("inf")),
    "seed": ("count", 0, float("inf")),
    "max_waiting": ("count", 1, float("inf")),
    "burst": ("count", 0, MAX_QUEUE),
    "replay": ("bool", 0, 1),
    "max_rss_growth_mb": ("number", 0, float("inf")),
    "max_flush_ratio": ("number", 0, float("inf")),
}


def check_options(s: dict[str, Any], over: str) -> None:
    """Each soak option's type and range, one ConfigError naming it, before the model loads (a zero check_every
    was a ZeroDivisionError, a zero max_new an empty randrange, a missing duration_s a TypeError)."""
    if over == "engine":
        check(
            "duration_s" in s,
            "soak.duration_s is required (seconds of load): python run.py experiment=soak soak.duration_s=30",
        )
    for name, value in s.items():
        kind, least, most = (ENGINE_CHECKS if over == "engine" else HTTP_CHECKS)[name]
        if kind == "bool":
            check(isinstance(value, bool), f"soak.{name} must be true or false, got {value!r}")
            continue
        typed = is_int(value) if kind == "count" else is_number(value) and math.isfinite(value)
        what = "an integer" if kind == "count" else "a number"
        span = f"of at least {least:g}" if most == float("inf") else f"from {least:g} to {most:g}"
        check(typed and least <= value <= most, f"soak.{name} must be {what} {span}, got {value!r}")
