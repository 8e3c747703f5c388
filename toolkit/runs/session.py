"""Serve a set of added requests to completion, recorded by the run recorder (toolkit.runs.recorder).

Shared by `mode=run`, `mode=replay`, `toolkit.LLM`, the experiments and the benchmarks, so a replay records
exactly what a run records (and a server records the same layout).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from toolkit.engine.core import Engine, RequestOutput, StepOutput
from toolkit.errors import one_line
from toolkit.runs.loggers import make_logger
from toolkit.runs.manifest import request_rows
from toolkit.runs.metrics import decode_steps_by_batch
from toolkit.runs.plots import plot_run
from toolkit.runs.recorder import RunRecorder
from toolkit.runs.signals import StopRequest, stop_between_steps


@dataclass(frozen=True)
class Recorded:
    run_id: str
    run_dir: Path
    outputs: list[RequestOutput]
    summary: dict[str, Any]
    steps: list[dict[str, Any]]  # step_record of every step that ran a forward (steps.parquet)


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
            self.stream.write(
                f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} sequences, "
                f"{self.tokens} tokens, {rate:.1f} tok/s"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def record(
    engine: Engine,
    request_ids: list[str],
    run_dir: Path,
    config: DictConfig | Mapping | None = None,
    *,
    trace: bool = True,
    flush_every_steps: int = 64,
    manifest_extra: dict[str, Any] | None = None,
    summary_extra: dict[str, Any] | None = None,
    on_step: Callable[[StepOutput], None] | None = None,
    before_step: Callable[[Engine], None] | None = None,
    logger: Mapping[str, Any] | None = None,
    progress: bool = False,
    plots: bool = False,
    full_logits: Any = None,
) -> Recorded:
    """Run the engine until every request finished; write config, manifest, requests, trace, summary.

    `logger` is a `logger` config section (see toolkit.runs.loggers); `progress` draws a progress
    line on a terminal; `plots` writes the step timeline and latency plots; `before_step` is called with the
    engine before each step (a replay aborts there what the recorded run aborted); `full_logits` (off, all or
    request ids) also writes those requests' raw logits rows to logits.parquet."""
    recorder = RunRecorder(
        engine,
        run_dir,
        config,
        trace=trace,
        flush_every_steps=flush_every_steps,
        full_logits=full_logits if full_logits is not None else "off",  # the caller's word, not the config's
        manifest_extra=manifest_extra,
    )
    run_id, run_dir = recorder.run_id, recorder.run_dir
    for request_id in request_ids:
        recorder.admitted(request_id)
    recorder.flush()  # the requests on disk before the first step: replayable even if the run dies
    run_logger = make_logger(logger, OmegaConf.to_container(recorder.config, resolve=True), run_dir, run_id)
    bar = Progress(sum(len(engine.sequences(i)) for i in request_ids)) if progress else None
    steps: list[dict[str, Any]] = []
    interrupted = False

    def end_finished(candidates) -> None:
        for request_id in candidates:
            if recorder.is_open(request_id) and engine.is_finished(request_id):
                recorder.ended(request_id)

    failure: BaseException | None = None
    ctrl_c = StopRequest()
    try:
        with stop_between_steps() as ctrl_c:
            while engine.has_unfinished():
                if ctrl_c.pressed:
                    raise KeyboardInterrupt
                if before_step is not None:
                    before_step(engine)
                    end_finished(recorder.open_request_ids())  # what it aborted
                    if not engine.has_unfinished():
                        break
                t0 = time.perf_counter()
                out = engine.step(trace_digests=trace)
                step = recorder.stepped(out, time.perf_counter() - t0)
                end_finished(dict.fromkeys(engine.request_of(s) for s in out.finished))  # in the step's order
                recorder.write(out)
                if step is not None:
                    steps.append(step)
                    run_logger.log_step(step)
                if bar is not None:
                    bar.update(out)
                if on_step is not None:
                    on_step(out)
        interrupted = ctrl_c.pressed  # a signal in the last step: the process was asked to stop all the same
    except KeyboardInterrupt:  # Ctrl-C (between steps; a second one anywhere): the trace is flushed, the run summarised
        interrupted = True
    except BaseException as exc:  # goes on up once what was traced is on disk and the summary says it failed
        failure = exc
        raise
    finally:
        if bar is not None:
            bar.close()
        extra = {
            **(summary_extra or {}),
            **({"interrupted": True, "signal": ctrl_c.name} if interrupted else {}),
            **({"failed": one_line(failure)} if failure is not None else {}),
        }
        try:
            outputs, summary = _close(engine, recorder, request_ids, steps, extra)
        except Exception as exc:  # noqa: BLE001 - closing after a failed step: the step's error is the one raised
            if failure is None:
                raise
            print(f"toolkit: closing the run after that failure also failed: {one_line(exc)}", file=sys.stderr)
    final_rows = request_rows(engine, run_id, request_ids)
    if plots:
        plot_run(run_dir)
    run_logger.finish(summary, final_rows, run_dir)
    if interrupted:
        done = sum(1 for r in final_rows if r.get("finish_reason"))
        raise ctrl_c.interrupted(
            f"interrupted at step {engine.step_index} ({ctrl_c.name}): {done}/{len(final_rows)} "
            f"sequences finished; trace flushed ({recorder.rows_written} rows) and summary.json written in "
            f"{run_dir} (replay and verify accept the partial run)"
        )
    return Recorded(run_id=run_id, run_dir=run_dir, outputs=outputs, summary=summary, steps=steps)


def _close(
    engine: Engine, recorder: RunRecorder, request_ids: list[str], steps: list[dict[str, Any]], extra: dict[str, Any]
) -> tuple[list[RequestOutput], dict[str, Any]]:
    """The rest of the run recorded: the final rows of what has not ended (only when interrupted or failed: their
    rows as they stand), the trace closed, summary.json with the run's figures and `extra`."""
    for request_id in recorder.open_request_ids():
        recorder.ended(request_id)
    outputs = [engine.output(i) for i in request_ids]
    for output in outputs:
        recorder.finished(output)
    pool = engine.stats()
    summary = recorder.close(
        forwards=sum(s["forwards"] for s in steps),
        scheduler_policy=engine.cfg.scheduler_policy,
        kv_utilization_max=max((s["kv_utilization"] for s in steps), default=0.0),
        kv_utilization_mean=sum(s["kv_utilization"] for s in steps) / max(len(steps), 1),
        prefix_cache_hit_rate=pool.prefix_hits / pool.prefix_queries if pool.prefix_queries else None,
        decode_steps=decode_steps_by_batch(steps),
        **(engine.speculator.stats.summary() if engine.speculator is not None else {}),
        **extra,
    )
    return outputs, summary
