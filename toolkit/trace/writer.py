"""Stream SampleTrace rows to Parquet while the run goes on.

`samples.parquet` is a directory of part files (`part-000000.parquet`, ...), each written
to a temporary name and renamed, so a reader never sees half a file and a crash loses at
most the rows since the last flush (at most `flush_every_steps` steps). The digests of a
step's raw logits rows are taken on the engine's thread as the step is written, read in place
while they are hot and side by side (toolkit/native/csrc/sha256_rows.c, on torch's threads, which are
idle then); the Arrow conversion and the Parquet writes run on a background thread. (Hashing on
that thread instead took a core from the next step's compute threads: tracing cost 11-30%.)
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from omegaconf import OmegaConf

from toolkit.errors import ConfigError, ToolkitError, one_line
from toolkit.native.sha import sha256_rows
from toolkit.native.threads import name_current_thread, yield_to_the_step
from toolkit.trace.schema import REJECTED_SCHEMA, REQUESTS_SCHEMA, SAMPLES_SCHEMA, TRACE_FIELDS, SampleTrace

SAMPLES_DIR = "samples.parquet"
LOGITS_DIR = "logits.parquet"  # trace.full_logits: raw fp32 logits rows, keyed by (request_id, stream, position)
REQUESTS_FILE = "requests.parquet"  # a directory of append-only parts (a file in runs before 2026-11-28)
OPEN_REQUESTS_FILE = "requests.open.parquet"  # the requests not yet ended (rewritten after admissions)
REJECTED_DIR = "rejected.parquet"  # a served run's requests refused (503) or failed on the engine thread (500)
STEPS_DIR = "steps.parquet"  # step records as parts (a file in runs before 2026-11-28)
MANIFEST_FILE = "manifest.json"
MAX_BUFFERED_REJECTED = 10_000  # refusal rows (rejected.parquet) held while writes fail; past it they are counted


def logits_digest(row_V: torch.Tensor) -> str:
    """sha256 of a raw fp32 logits row's bytes (little-endian, as stored in memory)."""
    return hashlib.sha256(row_V.detach().float().cpu().contiguous().numpy()).hexdigest()  # the buffer, no copy


def _atomic_write(path: Path, write: Callable[[str], None]) -> int:
    """`write(tmp)` to a temporary name beside `path`, then renamed to it: a reader never sees half a file, and a
    failed write (a full disk) leaves no temporary file behind. Returns the file's size in bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="." + path.name, suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        size = os.path.getsize(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return size


def atomic_write_bytes(path: Path, data: bytes) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    _atomic_write(path, write)


def atomic_write_table(path: Path, table: pa.Table) -> int:
    """A Parquet table written atomically (_atomic_write); returns the file's size in bytes."""
    return _atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def write_manifest(run_dir: Path, manifest: dict[str, Any]) -> None:
    atomic_write_bytes(run_dir / MANIFEST_FILE, json.dumps(manifest, indent=2).encode())


def write_requests(run_dir: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Request rows that are final at once (a converted transcript) as requests.parquet/'s one part."""
    atomic_write_table(run_dir / REQUESTS_FILE / "part-000000.parquet", requests_table(rows))


def requests_table(rows: Sequence[dict[str, Any]]) -> pa.Table:
    return pa.table({name: [r.get(name) for r in rows] for name in REQUESTS_SCHEMA.names}, schema=REQUESTS_SCHEMA)


class TraceWriteError(ToolkitError, RuntimeError):
    """The trace could not be written (a full or read-only disk, a run directory gone): the run stops with this
    one line, exit 74 (EX_IOERR), its rows on disk up to its last flush."""

    exit_code = 74


@dataclass(frozen=True)
class RequestsUpdate:
    """A run's request rows since its last update: `ended` (final rows, appended to requests.parquet/ as
    a part), `open` (None: unchanged since the last update; else the admission rows of every request not yet
    ended, replacing requests.open.parquet: bounded by the requests a server holds at once, so a flush costs the
    same after a day as after a minute; the reader lets a final row win over an open one, so an end alone does not
    rewrite it), and `rejected` (refusals, appended to rejected.parquet/)."""

    ended: Sequence[dict[str, Any]]
    open: Sequence[dict[str, Any]] | None
    rejected: Sequence[dict[str, Any]] = ()


def sample_rows_table(run_id: str, traces: Iterable[SampleTrace], digests: Iterable[str]) -> pa.Table:
    columns: dict[str, list] = {name: [] for name in SAMPLES_SCHEMA.names}
    for trace, digest in zip(traces, digests):
        columns["run_id"].append(run_id)
        for name in TRACE_FIELDS:
            value = getattr(trace, name)
            if name in ("top_raw", "top_processed"):
                value = [{"token_id": t, "logprob": lp} for t, lp in value]
            elif name == "processors":
                value = list(value)
            columns[name].append(value)
        columns["logits_sha256"].append(digest)
    return pa.table(columns, schema=SAMPLES_SCHEMA)


def full_logits_selection(value: Any) -> str | frozenset[str] | None:
    """trace.full_logits: off (null, false, "off"), "all", or a list of request ids (a Hydra list too)."""

    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    if value in (None, False, "off", "none"):
        return None
    if value == "all":
        return "all"
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int)) for v in value):
        return frozenset(str(v) for v in value)
    raise ConfigError(f"trace.full_logits must be off, all or a list of request ids, got {value!r}")


class TraceWriter:
    """Accepts each step's SampleTrace rows and raw logits; writes Parquet parts on a worker thread.

    A failed write leaves no temporary file. With `retry_faults` (a server: it has to outlive a full disk) a
    write the file system refuses is a fault, not an error: the rows stay buffered, `fault` says why, and the
    worker retries every `retry_s` seconds (and at every explicit flush) until a write goes through, in order, so
    no row is lost; `backlogged` tells the producer when the buffered rows pass `max_buffered_rows` (a server
    stops stepping until the disk takes them). Without it (a run, a soak, a benchmark) the error is raised on
    the producer's next call, as any writer error is."""

    def __init__(
        self,
        run_dir: Path,
        run_id: str,
        flush_every_steps: int = 64,
        full_logits: Any = None,
        *,
        retry_faults: bool = False,
        max_buffered_rows: int = 200_000,
        retry_s: float = 0.5,
    ):
        if not 1 <= flush_every_steps <= 64:
            raise ValueError(f"flush_every_steps must be in [1, 64], got {flush_every_steps}")
        self.full_logits = full_logits_selection(full_logits)
        self._logits: list[tuple[str, int, int, Any]] = []
        self._logits_parts = 0
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / SAMPLES_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.flush_every_steps = flush_every_steps
        self.rows_written = 0
        self.engine_thread_s = 0.0  # time write_step took on the caller's thread (the hashing)
        self.worker_cpu_s = 0.0  # CPU time of the writer thread (Arrow conversion, Parquet writes)
        self._parts = 0
        self._pending: list[tuple[SampleTrace, str]] = []
        self._ended: list[dict[str, Any]] = []  # RequestsUpdate.ended rows not yet in a part
        self._open: Sequence[dict[str, Any]] | None = None  # the newest RequestsUpdate.open not yet written
        self._rejected: list[dict[str, Any]] = []  # RequestsUpdate.rejected rows not yet in a part
        self._request_parts = self._rejected_parts = 0
        self.flush_s = 0.0  # CPU time of the part writes (samples, logits, requests) on the writer thread
        self._held: tuple[Any, RequestsUpdate | None] | None = None  # write_output's last (out, requests)
        self._steps_since_flush = 0
        # the steps not yet handed to the worker: they go over as one item when a part is due, so the worker
        # wakes once a part, not once a step (a wake-up each step took the GIL and a core beside the next step)
        self._batch: list[tuple] = []
        self._queue: queue.Queue = queue.Queue(maxsize=256)
        self._error: BaseException | None = None
        self.retry_faults, self.max_buffered_rows, self.retry_s = retry_faults, max_buffered_rows, retry_s
        self._tried = 0.0  # when a write last failed (monotonic): while a fault lasts, retried every retry_s
        self.fault: str | None = None  # why the last write failed (None: the last one went through)
        self.faults = 0  # writes the file system refused, in all
        self.bytes_written = 0  # bytes of the part files written so far
        self.rejected_dropped = 0  # refusal rows past MAX_BUFFERED_REJECTED while the disk refused writes
        self._thread = threading.Thread(target=self._work, name="trace-writer", daemon=True)
        self._thread.start()

    def write_step(
        self,
        traces: Sequence[SampleTrace],
        logits_RV: torch.Tensor | None,
        requests: RequestsUpdate | None = None,
        digests: Mapping[int, str] | None = None,
    ) -> None:
        """Queue a step's rows. `requests`: the request rows that changed up to this step; they are
        written before any sample part holding later rows, so a part on disk never holds a row whose request is
        not in requests.parquet/ or requests.open.parquet. `digests`: the sha256 of the logits
        rows already hashed (StepOutput.logits_sha256, by row); where one is missing, every row is hashed here."""
        self._release_held()
        self._write_step(traces, logits_RV, requests, digests)

    def _write_step(
        self,
        traces: Sequence[SampleTrace],
        logits_RV: torch.Tensor | None,
        requests: RequestsUpdate | None,
        digests: Mapping[int, str] | None,
    ) -> None:
        if self._error is not None:
            raise TraceWriteError(f"trace writer failed: {one_line(self._error)}") from self._error
        start = time.perf_counter()
        given, digests = digests, []
        logits: list[tuple[str, int, int, Any]] = []  # trace.full_logits: (request, stream, position, row)
        if traces:
            index = [t.logits_row for t in traces]
            rows = logits_RV.detach()
            if rows.device.type != "cpu" or rows.dtype != torch.float32:
                rows = rows.index_select(0, torch.tensor(index, device=rows.device)).float().cpu()
                index, given = list(range(len(index))), None
            if given is not None and all(i in given for i in index):
                digests = [given[i] for i in index]
            else:
                digests = sha256_rows(rows, index)
            if self.full_logits is not None:
                wanted = [
                    (t, i)
                    for t, i in zip(traces, index)
                    if t.token_id >= 0 and (self.full_logits == "all" or t.request_id in self.full_logits)
                ]
                if wanted:
                    block = rows[[i for _, i in wanted]].float().cpu().numpy()  # a copy: the step's block moves on
                    logits = [(t.request_id, t.stream, t.position, block[k]) for k, (t, _) in enumerate(wanted)]
        self._batch.append((tuple(traces), digests, requests, logits))
        if len(self._batch) >= self.flush_every_steps:
            self._hand_off()
        self.engine_thread_s += time.perf_counter() - start

    def _hand_off(self) -> None:
        batch, self._batch = self._batch, []
        if batch:
            self._queue.put(batch)

    def write_output(self, out, requests: RequestsUpdate | None = None) -> None:
        """write_step for an Engine.step(trace_digests=True) output: its rows, logits and digests. Its rows are
        taken when the next output comes (or at write_step, flush or close), in order: the engine hashes the
        rest of its digests beside that next step's Python (they are read, and so finished, only then)."""
        self._release_held()
        self._held = (out, requests)

    def _release_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            out, requests = held
            self._write_step(out.samples, out.logits_RV, requests, out.logits_sha256)

    def flush(self, wait: bool = True) -> None:
        """Write everything received so far: blocks until the worker has written it, or (`wait=False`) only hands
        it to the worker (an idle server's loop, which must never wait on a disk)."""
        self._release_held()
        self._hand_off()
        self._queue.put([("flush", None, None, ())])
        if not wait:
            return
        self._queue.join()
        if self._error is not None:
            raise TraceWriteError(f"trace writer failed: {one_line(self._error)}") from self._error

    @property
    def buffered_rows(self) -> int:
        """Sample rows received and not yet on disk (approximate while the worker runs): the worker's buffer, the
        hand-offs queued for it (each a list of steps), and the steps not yet handed off."""
        with self._queue.mutex:  # the worker takes from the queue meanwhile
            queued = [step for item in self._queue.queue if item is not None for step in item]
        return len(self._pending) + sum(len(traces) for traces, *_ in queued + self._batch if traces != "flush")

    @property
    def backlogged(self) -> bool:
        """A fault holds more than max_buffered_rows rows back: the producer should wait for the disk."""
        return self.fault is not None and self.buffered_rows >= self.max_buffered_rows

    def close(self) -> None:
        """Write the rest; a fault that outlasts one more retry is raised (the rows it holds are named)."""
        self.flush()
        if self.fault is not None:
            time.sleep(self.retry_s)
            self.flush()
        self._queue.put(None)
        self._thread.join()
        if self.fault is not None:
            logits = f" and {len(self._logits)} full-logits rows" if self._logits else ""
            raise OSError(
                f"trace writer: {len(self._pending)} sample rows{logits} could not be written to {self.run_dir}: "
                f"{self.fault}"
            )

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _work(self) -> None:
        name_current_thread()  # "trace-writer" in top -H, py-spy and /proc
        yield_to_the_step()  # its encoding fills the cores' gaps instead of preempting the step's threads
        while True:
            try:
                item = self._queue.get(timeout=self.retry_s if self.fault is not None else None)
            except queue.Empty:  # a fault holds rows back: try the disk again
                try:
                    self._write_part()
                except BaseException as exc:  # noqa: BLE001 - surfaced on the next call from the engine thread
                    self._error = exc
                continue
            start = time.thread_time()
            try:
                if item is None:
                    return
                for step in item:  # the steps a hand-off carried, in order
                    self._take(*step)
            except BaseException as exc:  # noqa: BLE001 - surfaced on the next call from the engine thread
                self._error = exc
            finally:
                self.worker_cpu_s += time.thread_time() - start
                self._queue.task_done()

    def _take(self, traces, digests, requests: RequestsUpdate | None, logits) -> None:
        """One step's rows (or "flush") into the buffers; a part written when one is due."""
        if requests is not None:
            self._ended.extend(requests.ended)
            if requests.open is not None:
                self._open = requests.open
            room = max(MAX_BUFFERED_REJECTED - len(self._rejected), 0)  # they pile up while a fault lasts
            self._rejected.extend(requests.rejected[:room])
            self.rejected_dropped += max(len(requests.rejected) - room, 0)
        if traces == "flush":
            self._write_part()
            return
        self._pending.extend(zip(traces, digests))
        self._logits.extend(logits)
        self._steps_since_flush += 1
        due = self.fault is None or time.monotonic() - self._tried >= self.retry_s  # not every step
        if self._steps_since_flush >= self.flush_every_steps and due:
            self._write_part()

    def _write_part(self) -> None:
        start = time.thread_time()
        try:
            self._write_parts()
            self.fault = None
        except OSError as exc:  # the disk refused: everything not yet written stays buffered, retried in order
            if not self.retry_faults:
                raise
            self._tried = time.monotonic()
            if self.fault is None:
                print(
                    f"toolkit: trace writer: {exc}; buffering rows and retrying every {self.retry_s:g} s",
                    file=sys.stderr,
                    flush=True,
                )
            # what a client may be told: the errno's meaning, not the paths the message may name
            self.fault = f"{os.strerror(exc.errno)} (errno {exc.errno})" if exc.errno else type(exc).__name__
            self.faults += 1
        finally:
            self.flush_s += time.thread_time() - start

    def _write_parts(self) -> None:
        """Each buffer goes to its part file and is cleared only once that file is in place (so a refused write
        keeps it, and its part number, for the retry)."""
        self._steps_since_flush = 0
        if self._ended:  # before the open rows: a kill between the two leaves a request in both, never in neither
            self.bytes_written += atomic_write_table(
                self.run_dir / REQUESTS_FILE / f"part-{self._request_parts:06d}.parquet", requests_table(self._ended)
            )
            self._ended, self._request_parts = [], self._request_parts + 1
        if self._rejected:
            self.bytes_written += atomic_write_table(
                self.run_dir / REJECTED_DIR / f"part-{self._rejected_parts:06d}.parquet",
                pa.Table.from_pylist(self._rejected, schema=REJECTED_SCHEMA),
            )
            self._rejected, self._rejected_parts = [], self._rejected_parts + 1
        if self._open is not None:
            if self._open:
                atomic_write_table(self.run_dir / OPEN_REQUESTS_FILE, requests_table(self._open))
            else:
                (self.run_dir / OPEN_REQUESTS_FILE).unlink(missing_ok=True)
            self._open = None
        if self._pending:  # the trace's rows before the optional logits: a disk that takes one part takes these
            table = sample_rows_table(self.run_id, [t for t, _ in self._pending], [d for _, d in self._pending])
            self.bytes_written += atomic_write_table(self.dir / f"part-{self._parts:06d}.parquet", table)
            self._pending, self._parts = [], self._parts + 1
            self.rows_written += table.num_rows
        if self._logits:
            rows = self._logits
            flat = pa.array(np.concatenate([r[3] for r in rows]), pa.float32())
            self.bytes_written += atomic_write_table(
                self.run_dir / LOGITS_DIR / f"part-{self._logits_parts:06d}.parquet",
                pa.table(
                    {
                        "request_id": [r[0] for r in rows],
                        "stream": pa.array([r[1] for r in rows], pa.int32()),
                        "position": pa.array([r[2] for r in rows], pa.int64()),
                        "logits": pa.FixedSizeListArray.from_arrays(flat, len(rows[0][3])),
                    }
                ),
            )
            self._logits, self._logits_parts = [], self._logits_parts + 1
