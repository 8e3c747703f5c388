"""What a server records of its run, append-only and in bounded memory (toolkit.serve.loop's engine thread calls
it; `reject` may come from any thread).

    config.yaml, manifest.json    at start
    samples.parquet/              the sample rows, parts every serve.flush_every_steps steps (TraceWriter)
    requests.parquet/             each request's final row once it ended, appended as parts
    requests.open.parquet         the rows of the requests not yet ended, replaced as they change
    rejected.parquet/             requests refused (503) or failed on the engine thread (500)
    steps.parquet/                step records, a part every STEPS_PART_ROWS steps
    summary.json                  at close: totals, and percentiles over the latest `summary_window` requests

Held in memory: the rows of the requests not yet ended and what has not reached a part yet, never the run.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
from omegaconf import OmegaConf

from toolkit.engine.core import Engine, RequestOutput, StepOutput
from toolkit.errors import ConfigError
from toolkit.runs.manifest import build_manifest, new_run_id, request_rows
from toolkit.runs.metrics import InterTokenLatency, RunningSummary
from toolkit.runs.session import STEPS_FILE, effective_config, step_record
from toolkit.trace.writer import (
    REQUESTS_FILE,
    RequestsUpdate,
    TraceWriter,
    atomic_write_bytes,
    atomic_write_table,
    write_manifest,
)

STEPS_PART_ROWS = 4096  # steps.parquet rows per part file
RECORD_BODY = ("full", "hash", "off")


def body_sha256(body: Any) -> str | None:
    """sha256 of an HTTP body as JSON with sorted keys (what request_body holds)."""
    return None if body is None else hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class ServedRun:
    def __init__(self, engine: Engine, run_dir: Path | None, config: Mapping[str, Any] | None = None, *,
                 flush_every_steps: int = 8, record_body: str = "full", summary_window: int = 100_000,
                 max_trace_bytes: int | None = None):
        """`run_dir`: None records nothing (rows are not even built). `record_body`: full | hash | off, what the
        trace keeps of each HTTP body (hash: its sha256 only). `max_trace_bytes`: past it (serve.max_trace_gb),
        `unavailable` says so, as it does while the disk refuses writes."""
        if record_body not in RECORD_BODY:
            raise ConfigError(f"serve.record_body must be full, hash or off, got {record_body!r}")
        self.engine, self.record_body = engine, record_body
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.run_id = new_run_id()
        self._lock = threading.Lock()
        self._open: dict[str, list[dict[str, Any]]] = {}  # rows of the requests not yet ended, in arrival order
        self._bodies: dict[str, tuple[str | None, str | None]] = {}  # open requests: (body as kept, its sha256)
        self._arrivals = 0
        self._ended: list[dict[str, Any]] = []  # final rows not yet handed to the writer
        self._rejected: list[dict[str, Any]] = []  # refusals not yet handed to the writer
        self._open_changed = False
        self._steps: list[dict[str, Any]] = []  # step records not yet in a part
        self._step_parts = 0
        self.steps_dropped = 0  # step records dropped while the disk refused them (diagnostics, not trace rows)
        self._steps_refused_at = -1e9  # when the disk last refused a part of them (retried a second later)
        self.max_trace_bytes = max_trace_bytes
        self.summary = RunningSummary(window=summary_window)
        self._itl = InterTokenLatency(max_values=summary_window)
        self._started = time.perf_counter()
        self.writer: TraceWriter | None = None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            resolved = effective_config(engine, config)
            atomic_write_bytes(self.run_dir / "config.yaml", OmegaConf.to_yaml(resolved).encode())
            write_manifest(self.run_dir, build_manifest(engine, self.run_id, {"served": True,
                                                                              "record_body": record_body}))
            (self.run_dir / REQUESTS_FILE).mkdir(exist_ok=True)
            self.writer = TraceWriter(self.run_dir, self.run_id, flush_every_steps,
                                      OmegaConf.select(resolved, "trace.full_logits"), retry_faults=True)

    @property
    def unavailable(self) -> str | None:
        """Why the trace cannot take a new request now (the disk refuses writes, or the trace is past its size), or
        None: a server then answers new requests 507 and /health says why, until this clears."""
        if self.writer is None:
            return None
        if self.writer.fault is not None:
            return f"the trace cannot be written ({self.writer.fault}); its rows are held and retried"
        if self.max_trace_bytes is not None and self.writer.bytes_written > self.max_trace_bytes:
            return (f"the trace holds {self.writer.bytes_written:,} bytes, past serve.max_trace_gb "
                    f"({self.max_trace_bytes:,} bytes)")
        return None

    def admitted(self, request_id: str, body: Any) -> None:
        if self.writer is None:
            return
        text = json.dumps(body, sort_keys=True) if body is not None else None
        self._bodies[request_id] = (text if self.record_body == "full" else None,
                                    body_sha256(body) if self.record_body != "off" else None)
        self._open[request_id] = self._rows(request_id, self._arrivals)
        self._arrivals += 1
        self._open_changed = True

    def ended(self, request_id: str) -> str | None:
        """Before the engine releases it: its final rows; returns its body's sha256 (as recorded)."""
        if self.writer is None:
            return None
        final = self._rows(request_id, self._open.pop(request_id)[0]["arrival_index"])
        _, digest = self._bodies.pop(request_id)
        self._ended.extend(final)
        self._open_changed = True
        return digest

    def finished(self, output: RequestOutput) -> None:
        self.summary.add(output)
        for c in output.outputs:
            self._itl.forget(output.request_id, c.index)

    def reject(self, request_id: str, route: str, status: int, reason: str, body_sha: str | None) -> None:
        """A request refused before it reached the engine (503) or failed on it (500); any thread."""
        if self.writer is None:
            return
        row = {"run_id": self.run_id, "request_id": request_id, "route": route, "status": status, "reason": reason,
               "step": self.engine.step_index, "time": time.time(),
               "request_body_sha256": body_sha if self.record_body != "off" else None}
        with self._lock:
            self._rejected.append(row)

    def stepped(self, out: StepOutput, seconds: float) -> None:
        self._itl.update(out.samples)
        if out.batch_size:
            self._steps.append(step_record(out, seconds))
        if len(self._steps) >= STEPS_PART_ROWS and time.monotonic() - self._steps_refused_at >= 1.0:
            self._write_steps()

    def write(self, out: StepOutput | None) -> None:
        """Hand the writer a step's rows (None: only what changed in the requests, e.g. an abort while idle)."""
        if self.writer is None or (out is None and not self._changed()):
            return
        update = self._requests_update() if self._changed() else None
        if out is not None:
            self.writer.write_output(out, update)
        else:
            self.writer.write_step((), None, update)

    def close(self) -> None:
        if self.writer is None:
            return
        try:
            self.writer.write_step((), None, self._requests_update())
            self.writer.close()
        finally:
            self._write_steps()
            engine = self.engine
            wall = (engine.last_finish_time or 0.0) - (engine.first_admission_time or 0.0)
            summary = self.summary.result(wall, self._itl.values, steps=engine.step_index, run_id=self.run_id,
                                          trace_rows=self.writer.rows_written, model=engine.loaded.model_id,
                                          model_revision=engine.loaded.revision, served=True,
                                          served_s=time.perf_counter() - self._started)
            summary["steps_dropped"], summary["rejected_dropped"] = self.steps_dropped, self.writer.rejected_dropped
            atomic_write_bytes(self.run_dir / "summary.json", json.dumps(summary, indent=2).encode())

    def _rows(self, request_id: str, arrival_index: int) -> list[dict[str, Any]]:
        body, digest = self._bodies[request_id]
        return [{**row, "request_body": body, "request_body_sha256": digest, "arrival_index": arrival_index}
                for row in request_rows(self.engine, self.run_id, [request_id])]

    def _changed(self) -> bool:
        return self._open_changed or bool(self._ended) or bool(self._rejected)

    def _requests_update(self) -> RequestsUpdate:
        self._open_changed = False
        ended, self._ended = self._ended, []
        with self._lock:
            rejected, self._rejected = self._rejected, []
        return RequestsUpdate(ended, [row for rows in self._open.values() for row in rows], rejected)

    def _write_steps(self) -> None:
        """A part of step records; while the disk refuses it they stay (up to 4 parts' worth, then the oldest
        are dropped and counted: they are diagnostics, the trace's rows are the writer's)."""
        if self.run_dir is None or not self._steps:
            self._steps = []
            return
        try:
            atomic_write_table(self.run_dir / STEPS_FILE / f"part-{self._step_parts:06d}.parquet",
                               pa.Table.from_pylist(self._steps))
        except OSError:
            self._steps_refused_at = time.monotonic()
            extra = len(self._steps) - 4 * STEPS_PART_ROWS
            if extra > 0:
                del self._steps[:extra]
                self.steps_dropped += extra
            return
        self._step_parts += 1
        self._steps = []
