"""Serve a set of added requests to completion and record the run directory.

Shared by `mode=run`, `mode=replay` and the benchmark, so a replay records exactly what
a run records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from omegaconf import DictConfig, OmegaConf

from toolkit.engine.core import Engine, RequestOutput, StepOutput
from toolkit.errors import Interrupted
from toolkit.runs.loggers import make_logger
from toolkit.runs.manifest import build_manifest, new_run_id, request_rows
from toolkit.runs.metrics import InterTokenLatency, decode_steps_by_batch, summarize
from toolkit.runs.plots import plot_run
from toolkit.trace.writer import (
    TraceWriter,
    atomic_write_bytes,
    atomic_write_table,
    full_logits_selection,
    write_manifest,
    write_requests,
)


@dataclass(frozen=True)
class Recorded:
    run_id: str
    run_dir: Path
    outputs: list[RequestOutput]
    summary: dict[str, Any]
    steps: list[dict[str, Any]]  # step_record of every step that ran a forward (steps.parquet)


STEPS_FILE = "steps.parquet"


def step_record(out: StepOutput, seconds: float) -> dict[str, Any]:
    """What one engine step did, for the run's per-step metrics (steps.parquet)."""
    return {"step": out.step, "batch_size": out.batch_size, "decode_tokens": out.num_decode_tokens,
            "prefill_tokens": out.num_prefill_tokens, "sampled": len(out.samples), "finished": len(out.finished),
            "preempted": len(out.preempted), "kv_blocks_used": out.kv_blocks_used,
            "kv_utilization": out.kv_utilization, "prefix_hit_tokens": out.prefix_hit_tokens, "step_s": seconds,
            "forwards": out.forwards}


class Progress:
    """One progress line on stderr (sequences done, output tok/s); silent when stderr is not a terminal."""

    def __init__(self, total: int, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.total, self.done, self.tokens = total, 0, 0
        self.start = time.perf_counter()
        self.last = 0.0

    def update(self, out: StepOutput) -> None:
        self.done += len(out.finished)
        self.tokens += sum(1 for s in out.samples if s.token_id >= 0)
        now = time.perf_counter()
        if self.enabled and (now - self.last > 0.2 or self.done == self.total):
            self.last = now
            rate = self.tokens / max(now - self.start, 1e-9)
            width = 30
            filled = int(width * self.done / max(self.total, 1))
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} sequences, "
                              f"{self.tokens} tokens, {rate:.1f} tok/s")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def write_steps(run_dir: Path, steps: list[dict[str, Any]]) -> None:

    if steps:
        atomic_write_table(run_dir / STEPS_FILE, pa.Table.from_pylist(steps))


def effective_config(engine: Engine, config: DictConfig | Mapping | None) -> DictConfig:
    """The given config with the model, engine and default sampling the engine actually runs: complete, so
    that a replay can rebuild the engine from it and override any key."""
    base = OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else dict(config or {})
    base["model"] = dataclasses.asdict(engine.loaded.config)
    base["engine"] = dataclasses.asdict(engine.cfg)
    base["sampling"] = engine.default_sampling.to_dict()
    return OmegaConf.create(base)


class _CtrlC:
    pressed = False


@contextlib.contextmanager
def _ctrl_c_between_steps():
    """Ctrl-C while the engine steps only sets a flag, which the loop reads between steps: a KeyboardInterrupt
    raised at an arbitrary bytecode can land inside the trace writer's queue (threading.Condition.notify between
    dropping a waiter and waking it) and leave close() waiting forever. A second Ctrl-C interrupts at once."""
    state = _CtrlC()
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield state  # not ours to change (a server's handler, an ignored SIGINT, a worker thread)
        return

    def handler(signum, frame):
        if state.pressed:
            raise KeyboardInterrupt
        state.pressed = True

    signal.signal(signal.SIGINT, handler)
    try:
        yield state
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def record(engine: Engine, request_ids: list[str], run_dir: Path, config: DictConfig | Mapping | None = None, *,
           trace: bool = True, flush_every_steps: int = 64, manifest_extra: dict[str, Any] | None = None,
           summary_extra: dict[str, Any] | None = None,
           on_step: Callable[[StepOutput], None] | None = None,
           before_step: Callable[[Engine], None] | None = None, logger: Mapping[str, Any] | None = None,
           progress: bool = False, plots: bool = False, full_logits: Any = None) -> Recorded:
    """Run the engine until every request finished; write config, manifest, requests, trace, summary.

    `logger` is a `logger` config section (see toolkit.runs.loggers); `progress` draws a progress
    line on a terminal; `plots` writes the step timeline and latency plots; `before_step` is called with the
    engine before each step (a replay aborts there what the recorded run aborted); `full_logits` (off, all or
    request ids) also writes those requests' raw logits rows to logits.parquet."""
    full_logits_selection(full_logits)  # a bad value is a one-line error before anything runs
    run_id = new_run_id()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = effective_config(engine, config)
    atomic_write_bytes(run_dir / "config.yaml", OmegaConf.to_yaml(resolved).encode())
    write_manifest(run_dir, build_manifest(engine, run_id, manifest_extra))
    write_requests(run_dir, request_rows(engine, run_id, request_ids))  # replayable even if the run dies
    run_logger = make_logger(logger, OmegaConf.to_container(resolved, resolve=True), run_dir, run_id)
    writer = TraceWriter(run_dir, run_id, flush_every_steps, full_logits) if trace else None
    bar = Progress(sum(len(engine.sequences(i)) for i in request_ids)) if progress else None
    steps: list[dict[str, Any]] = []
    itl = InterTokenLatency()
    interrupted = False
    try:
        with _ctrl_c_between_steps() as ctrl_c:
            while engine.has_unfinished():
                if ctrl_c.pressed:
                    raise KeyboardInterrupt
                if before_step is not None:
                    before_step(engine)
                    if not engine.has_unfinished():
                        break
                t0 = time.perf_counter()
                out = engine.step(trace_digests=writer is not None)
                if writer is not None:
                    writer.write_output(out)
                itl.update(out.samples)
                if out.batch_size:
                    steps.append(step_record(out, time.perf_counter() - t0))
                    run_logger.log_step(steps[-1])
                if bar is not None:
                    bar.update(out)
                if on_step is not None:
                    on_step(out)
    except KeyboardInterrupt:  # Ctrl-C (between steps; a second one anywhere): the trace is flushed, the run summarised
        interrupted = True
    finally:
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close()
        final_rows = request_rows(engine, run_id, request_ids)
        write_requests(run_dir, final_rows)
        write_steps(run_dir, steps)
    outputs = [engine.output(i) for i in request_ids]
    wall = (engine.last_finish_time or 0.0) - (engine.first_admission_time or 0.0)
    pool = engine.stats()
    summary = summarize(outputs, wall, itl.values, steps=engine.step_index, run_id=run_id,
                        forwards=sum(s["forwards"] for s in steps), scheduler_policy=engine.cfg.scheduler_policy,
                        trace_rows=writer.rows_written if writer else 0, model=engine.loaded.model_id,
                        model_revision=engine.loaded.revision,
                        kv_utilization_max=max((s["kv_utilization"] for s in steps), default=0.0),
                        kv_utilization_mean=sum(s["kv_utilization"] for s in steps) / max(len(steps), 1),
                        prefix_cache_hit_rate=pool.prefix_hits / pool.prefix_queries if pool.prefix_queries else None,
                        decode_steps=decode_steps_by_batch(steps),
                        **(engine.speculator.stats.summary() if engine.speculator is not None else {}),
                        **(summary_extra or {}), **({"interrupted": True} if interrupted else {}))
    atomic_write_bytes(run_dir / "summary.json", json.dumps(summary, indent=2).encode())
    if plots:
        plot_run(run_dir)
    run_logger.finish(summary, final_rows, run_dir)
    if interrupted:
        done = sum(1 for r in final_rows if r.get("finish_reason"))
        raise Interrupted(f"interrupted at step {engine.step_index}: {done}/{len(final_rows)} sequences finished; "
                          f"trace flushed ({writer.rows_written if writer else 0} rows) and summary.json written in "
                          f"{run_dir} (replay and verify accept the partial run)")
    return Recorded(run_id=run_id, run_dir=run_dir, outputs=outputs, summary=summary, steps=steps)
