"""The one run recorder: what every run writes of itself, `mode=run`, `mode=replay`, `toolkit.LLM`, the
experiments and `mode=serve` alike, in one layout, append-only and in bounded memory.

    config.yaml, manifest.json    at start
    samples.parquet/              the SampleTrace rows, a part every `flush_every_steps` steps (TraceWriter)
    logits.parquet/               trace.full_logits: the chosen requests' raw logits rows, as parts
    requests.parquet/             each request's final row once it ended, appended as parts
    requests.open.parquet         the rows of the requests not yet ended, rewritten after admissions (a run
                                  killed mid-way still says what it was asked; a row of a request that ended
                                  since stays until then: the reader lets the final row win)
    rejected.parquet/             requests refused (503) or failed on the engine thread (500): a server's
    steps.parquet/                step records, a part every STEPS_PART_ROWS steps
    summary.json                  at close: totals, and percentiles over the latest `summary_window` requests

Held in memory: the rows of the requests not yet ended and what has not reached a part yet, never the run.
toolkit.trace.reader reads this layout and the older one (requests.parquet and steps.parquet as single files).
The engine's owner drives it: `admitted` as a request enters, `stepped` and `write` after each step, `ended`
before the engine releases a request (its final rows), `finished` with its output, `close` at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
from omegaconf import DictConfig, OmegaConf

from toolkit.engine.core import Engine, RequestOutput, StepOutput
from toolkit.errors import ConfigError, one_line
from toolkit.runs.manifest import build_manifest, new_run_id, request_rows
from toolkit.runs.metrics import InterTokenLatency, RunningSummary
from toolkit.trace.writer import (
    MANIFEST_FILE,
    REQUESTS_FILE,
    SAMPLES_DIR,
    STEPS_DIR,
    RequestsUpdate,
    TraceWriteError,
    TraceWriter,
    atomic_write_bytes,
    atomic_write_table,
    full_logits_selection,
    write_manifest,
)

STEPS_PART_ROWS = 4096  # steps.parquet rows per part file
RECORD_BODY = ("full", "hash", "off")


def holds_run(run_dir: Path) -> None:
    """A ConfigError where `run_dir` already holds a run (its manifest, or a part of its trace): a second run there
    would leave parts of both under one manifest (a replay written into the run it replays, its recording gone)."""
    paths = (run_dir / MANIFEST_FILE, run_dir / SAMPLES_DIR, run_dir / REQUESTS_FILE)
    found = next((p for p in paths if p.is_file() or any(p.glob("part-*.parquet"))), None)
    if found is not None:
        raise ConfigError(
            f"{run_dir} already holds a run ({found.name}): a new one would mix its trace with it; choose another "
            f"hydra.run.dir (or remove that one)"
        )


def body_sha256(body: Any) -> str | None:
    """sha256 of an HTTP body as JSON with sorted keys (what request_body holds)."""
    return None if body is None else hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class RecordedBody:
    """An HTTP request's body as its rows record it, made once where the body is parsed (not on the engine's
    thread: an 8 MB body is ~0.3 s of JSON). `text`: the body as received (keys in their order), on the row of the
    request's first prompt and first sample only (None on the others': a body of 64 prompts at n=4 was written 256
    times); `sha256`: body_sha256's, on every row."""

    text: str | None
    sha256: str

    @classmethod
    def of(cls, body: Any) -> RecordedBody:
        return cls(json.dumps(body), body_sha256(body))

    def digest_only(self) -> RecordedBody:
        return dataclasses.replace(self, text=None)


def step_record(out: StepOutput, seconds: float) -> dict[str, Any]:
    """What one engine step did, for the run's per-step metrics (steps.parquet)."""
    return {
        "step": out.step,
        "batch_size": out.batch_size,
        "decode_tokens": out.num_decode_tokens,
        "prefill_tokens": out.num_prefill_tokens,
        "sampled": len(out.samples),
        "finished": len(out.finished),
        "preempted": len(out.preempted),
        "kv_blocks_used": out.kv_blocks_used,
        "kv_utilization": out.kv_utilization,
        "prefix_hit_tokens": out.prefix_hit_tokens,
        "step_s": seconds,
        "forwards": out.forwards,
    }


def effective_config(engine: Engine, config: DictConfig | Mapping | None) -> DictConfig:
    """The given config with the model, engine and default sampling the engine actually runs: complete, so
    that a replay can rebuild the engine from it and override any key."""
    base = OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else dict(config or {})
    base["model"] = dataclasses.asdict(engine.loaded.config)
    base["engine"] = dataclasses.asdict(engine.cfg)
    base["sampling"] = engine.default_sampling.to_dict()
    return OmegaConf.create(base)


class RunRecorder:
    def __init__(
        self,
        engine: Engine,
        run_dir: Path | None,
        config: DictConfig | Mapping | None = None,
        *,
        trace: bool = True,
        flush_every_steps: int = 64,
        full_logits: Any = None,
        manifest_extra: Mapping[str, Any] | None = None,
        record_body: str = "full",
        summary_window: int | None = None,
        max_trace_bytes: int | None = None,
        served: bool = False,
    ):
        """`run_dir`: None records nothing (rows are not even built). `trace`: False writes no sample rows (the
        rest still). `full_logits`: off, all or request ids (None: the config's trace.full_logits).
        `record_body`: full | hash | off, what the trace keeps of each HTTP body (hash: its sha256 only).
        `summary_window`: the percentiles over the latest requests only (a server; None: all of them).
        `max_trace_bytes`: past it (serve.max_trace_gb), `unavailable` says so, as it does while the disk refuses
        writes. `served`: a server's run, which outlives a full disk (rows held and retried) where any other run
        fails on the first refused write."""
        if record_body not in RECORD_BODY:
            raise ConfigError(f"serve.record_body must be full, hash or off, got {record_body!r}")
        full_logits_selection(full_logits)  # a bad value is a one-line error before anything runs
        self.engine, self.record_body, self.trace, self.served = engine, record_body, trace, served
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
        self.itl = InterTokenLatency(max_values=summary_window)
        self._started = time.perf_counter()
        self.writer: TraceWriter | None = None
        self.config = effective_config(engine, config)
        if self.run_dir is not None:
            holds_run(self.run_dir)
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(self.run_dir / "config.yaml", OmegaConf.to_yaml(self.config).encode())
                extra = {"served": True, "record_body": record_body} if served else {}
                write_manifest(self.run_dir, build_manifest(engine, self.run_id, {**extra, **(manifest_extra or {})}))
                (self.run_dir / REQUESTS_FILE).mkdir(exist_ok=True)
            except OSError as exc:  # a full or read-only disk, a file where the directory goes: before any step
                raise TraceWriteError(f"cannot write the run directory {self.run_dir}: {one_line(exc)}") from None
            chosen = full_logits if full_logits is not None else OmegaConf.select(self.config, "trace.full_logits")
            self.writer = TraceWriter(self.run_dir, self.run_id, flush_every_steps, chosen, retry_faults=served)

    @property
    def recording(self) -> bool:
        return self.writer is not None

    @property
    def unavailable(self) -> str | None:
        """Why the trace cannot take a new request now (the disk refuses writes, or the trace is past its size), or
        None: a server then answers new requests 507 and /health says why, until this clears."""
        if self.writer is None:
            return None
        if self.writer.fault is not None:
            return f"the trace cannot be written ({self.writer.fault}); its rows are held and retried"
        if self.max_trace_bytes is not None and self.writer.bytes_written > self.max_trace_bytes:
            return (
                f"the trace holds {self.writer.bytes_written:,} bytes, past serve.max_trace_gb "
                f"({self.max_trace_bytes:,} bytes)"
            )
        return None

    def admitted(self, request_id: str, body: RecordedBody | None = None) -> None:
        if self.writer is None:
            return
        self._bodies[request_id] = (
            body.text if body is not None and self.record_body == "full" else None,
            body.sha256 if body is not None and self.record_body != "off" else None,
        )
        self._open[request_id] = self._rows(request_id, self._arrivals)
        self._arrivals += 1
        self._open_changed = True

    def is_open(self, request_id: str) -> bool:
        return request_id in self._open

    def open_request_ids(self) -> list[str]:
        """The requests admitted and not yet ended, in arrival order."""
        return list(self._open)

    def ended(self, request_id: str) -> str | None:
        """Before the engine releases it: its final rows; returns its body's sha256 (as recorded)."""
        if self.writer is None or request_id not in self._open:
            return None
        final = self._rows(request_id, self._open.pop(request_id)[0]["arrival_index"])
        _, digest = self._bodies.pop(request_id)
        self._ended.extend(final)  # requests.open.parquet keeps its row until the next admission rewrites it
        return digest

    def finished(self, output: RequestOutput) -> None:
        self.summary.add(output)
        for c in output.outputs:
            self.itl.forget(output.request_id, c.index)

    def reject(self, request_id: str, route: str, status: int, reason: str, body_sha: str | None) -> None:
        """A request refused before it reached the engine (503) or failed on it (500); any thread."""
        if self.writer is None:
            return
        row = {
            "run_id": self.run_id,
            "request_id": request_id,
            "route": route,
            "status": status,
            "reason": reason,
            "step": self.engine.step_index,
            "time": time.time(),
            "request_body_sha256": body_sha if self.record_body != "off" else None,
        }
        with self._lock:
            self._rejected.append(row)

    def stepped(self, out: StepOutput, seconds: float) -> dict[str, Any] | None:
        """A step's timing and inter-token latencies; returns its step record (None: it ran no forward)."""
        self.itl.update(out.samples)
        record = step_record(out, seconds) if out.batch_size else None
        if record is not None and self.writer is not None:
            self._steps.append(record)
            if len(self._steps) >= STEPS_PART_ROWS and time.monotonic() - self._steps_refused_at >= 1.0:
                self._write_steps()
        return record

    def write(self, out: StepOutput | None) -> None:
        """Hand the writer a step's rows (None: only what changed in the requests, e.g. an abort while idle)."""
        if self.writer is None or (out is None and not self._changed()):
            return
        update = self._requests_update() if self._changed() else None
        if out is not None and self.trace:
            self.writer.write_output(out, update)
        else:
            self.writer.write_step((), None, update)

    def flush(self, wait: bool = True) -> None:
        """Everything received so far on disk, the request rows included (a run is replayable from here on);
        `wait=False`: handed to the writer's thread, not waited for."""
        if self.writer is not None:
            self.writer.write_step((), None, self._requests_update())
            self.writer.flush(wait)

    @property
    def rows_written(self) -> int:
        return self.writer.rows_written if self.writer is not None else 0

    def close(self, wall_s: float | None = None, **extra) -> dict[str, Any] | None:
        """Write the rest and summary.json (the figures, `extra` added); returns the summary (None: not recording).
        `wall_s`: first admission to last finish when not given."""
        if self.writer is None:
            return None
        failure: BaseException | None = None
        try:
            self.writer.write_step((), None, self._requests_update(final=True))
            self.writer.close()
        except BaseException as exc:  # raised on once the summary says so (when the disk takes it)
            failure = exc
            raise
        finally:
            try:
                self._write_steps(final=True)
            except OSError as exc:
                if failure is None:
                    raise
                print(f"toolkit: steps.parquet not written either: {one_line(exc)}", file=sys.stderr)
            engine = self.engine
            if wall_s is None:  # first admission to last finish; to now where nothing finished (an interrupted run)
                first, last = engine.first_admission_time, engine.last_finish_time
                wall_s = 0.0 if first is None else max(0.0, (time.perf_counter() if last is None else last) - first)
            served = (
                {
                    "served": True,
                    "served_s": time.perf_counter() - self._started,
                    "steps_dropped": self.steps_dropped,
                    "rejected_dropped": self.writer.rejected_dropped,
                }
                if self.served
                else {}
            )
            summary = self.summary.result(
                wall_s,
                self.itl.values,
                steps=engine.step_index,
                run_id=self.run_id,
                trace_rows=self.writer.rows_written,
                model=engine.loaded.model_id,
                model_revision=engine.loaded.revision,
                **served,
                **extra,
                **({"failed": f"closing the trace: {one_line(failure)}"} if failure and "failed" not in extra else {}),
            )
            try:
                atomic_write_bytes(self.run_dir / "summary.json", json.dumps(summary, indent=2).encode())
            except OSError as exc:
                if failure is None:
                    raise
                # the trace's own failure (its lost rows counted) is the one raised, not this one's
                print(f"toolkit: summary.json not written either: {one_line(exc)}", file=sys.stderr)
            if (
                not self.trace
            ):  # no sample rows: no samples.parquet/ (compare and the report take its presence as a trace)
                with contextlib.suppress(OSError):
                    (self.run_dir / SAMPLES_DIR).rmdir()
        return summary

    def _rows(self, request_id: str, arrival_index: int) -> list[dict[str, Any]]:
        body, digest = self._bodies[request_id]
        return [  # the body on its first sample's row (RecordedBody)
            {
                **row,
                "request_body": body if row["stream"] == 0 else None,
                "request_body_sha256": digest,
                "arrival_index": arrival_index,
            }
            for row in request_rows(self.engine, self.run_id, [request_id])
        ]

    def _changed(self) -> bool:
        return self._open_changed or bool(self._ended) or bool(self._rejected)

    def _requests_update(self, final: bool = False) -> RequestsUpdate:
        """What changed in the request rows; the open ones only after an admission (`final`: always, so that the
        file is removed once none is open)."""
        opened, self._open_changed = self._open_changed or final, False
        ended, self._ended = self._ended, []
        with self._lock:
            rejected, self._rejected = self._rejected, []
        return RequestsUpdate(
            ended, [row for rows in self._open.values() for row in rows] if opened else None, rejected
        )

    def _write_steps(self, final: bool = False) -> None:
        """A part of step records. A server's stay while the disk refuses them (up to 4 parts' worth, then the
        oldest are dropped and counted: they are diagnostics, the trace's rows are the writer's); any other run
        raises the refusal."""
        if self.run_dir is None or not self._steps:
            self._steps = []
            return
        try:
            atomic_write_table(
                self.run_dir / STEPS_DIR / f"part-{self._step_parts:06d}.parquet", pa.Table.from_pylist(self._steps)
            )
        except OSError:
            if not self.served:
                raise
            self._steps_refused_at = time.monotonic()
            extra = len(self._steps) - (0 if final else 4 * STEPS_PART_ROWS)
            if extra > 0:
                del self._steps[:extra]
                self.steps_dropped += extra
            return
        self._step_parts += 1
        self._steps = []
