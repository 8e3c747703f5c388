"""The engine loop of a server: one thread owns the Engine and records the run; callers only submit.

    HTTP handler --submit(requests)--> command queue --> engine thread: add, step, trace, dispatch
    HTTP handler <--Update per step-- sink (called on the engine thread; the server hands it to its event loop)

Concurrent requests share continuous-batching steps exactly as a CLI run's do (one forward per step). The run
directory is written as the server runs, append-only (toolkit.runs.recorder), so that after a `kill -9` the run is
still readable, replayable and verifiable. Scheduling depends on steps only, so `mode=replay` re-creates the same
batches.

Bounded by construction: at most `max_waiting` requests wait (past it `submit` raises Unavailable: a 503), the
loop keeps rows only for requests not yet ended, the summary's percentiles cover the latest requests, and an
unexpected exception while adding or stepping fails the requests it touched (a 500 each), not the loop: a step
that raises for one request alone ends only that one (Engine.step bisects the batch; StepOutput.failed), one that
raises for no request alone fails the requests it ran, and `max_failed_steps` of those in a row end the loop.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.engine.core import Engine, EngineRequest, RequestOutput, StepOutput, TextDelta
from toolkit.errors import ConfigError, RequestError, ToolkitError, one_line
from toolkit.native.library import release_openmp_threads
from toolkit.native.threads import name_current_thread
from toolkit.runs.recorder import RecordedBody, RunRecorder
from toolkit.trace.schema import SampleTrace


@dataclass(frozen=True)
class Update:
    """What one step did for one request: its new text and tokens per sample, their trace rows, and its
    output once every sample has finished."""

    request_id: str
    deltas: tuple[TextDelta, ...] = ()
    samples: tuple[SampleTrace, ...] = ()
    output: RequestOutput | None = None  # set on the request's last update
    error: str | None = None  # the loop stopped before the request finished


Sink = Callable[[Update], None]


@dataclass(frozen=True)
class LoopSink:
    """A caller's updates on its asyncio event loop: each handed to `take` on that loop's thread."""

    loop: asyncio.AbstractEventLoop
    take: Callable[[Update], None]

    def __call__(self, update: Update) -> None:
        self.loop.call_soon_threadsafe(self.take, update)


@dataclass
class Submission:
    """One request for the engine: the EngineRequest, the HTTP body as its trace rows record it, where its updates
    go."""

    request: EngineRequest
    body: RecordedBody | None
    sink: Sink
    route: str = ""  # the HTTP route it came on
    accepted: Future = field(default_factory=Future)  # the request id, or the RequestError refusing it


@dataclass
class LoopStats:
    """What /metrics reads (written by the engine thread only; readers take a consistent-enough snapshot)."""

    running: int = 0
    waiting: int = 0  # sequences
    waiting_requests: int = 0  # requests with a sequence waiting (what serve.max_waiting bounds)
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    steps: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # (time, output_tokens) after each step

    def refresh(self, now: Any) -> None:
        """The queues and the KV pool as the engine's EngineStats `now` says."""
        self.running, self.waiting, self.waiting_requests = now.running, now.waiting, now.waiting_requests
        self.kv_blocks_used = now.kv_blocks_used

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        now = time.perf_counter()
        points = [p for p in list(self.recent) if now - p[0] <= window_s]
        if not points:
            return 0.0
        return (self.output_tokens - points[0][1]) / max(now - points[0][0], 1e-3) if len(points) > 1 else 0.0


class Unavailable(ToolkitError):
    """The server cannot take a request now: its waiting queue is full (serve.max_waiting) or it is stopping (an
    HTTP 503), or its trace cannot be written (a full disk, serve.max_trace_gb: a 507); with Retry-After."""

    def __init__(self, message: str, retry_after_s: int = 1, status: int = 503, code: str = "server_overloaded"):
        super().__init__(message)
        self.retry_after_s, self.status, self.code = retry_after_s, status, code


class InternalError(ToolkitError):
    """An unexpected exception on the engine thread, for the requests it touched: an HTTP 500 each."""


class Preparer:
    """What a request's handler does with the engine before the engine thread sees the request, on the handler's
    own threads: its grammar compiled, its prompt tokenized and checked, an echo's prompt scored. It reads the
    engine's caches and weights, never its state."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def precompile(self, sampling_params: Any, cached_only: bool = False, compile_with: Any = None) -> bool:
        """Compile a request's grammar into the engine's cache, by a grammar-compiler thread's child process
        (compile_with), so the engine thread never waits for a compiler; a RequestError if it is invalid."""
        return self.engine.precompile(sampling_params, cached_only, compile_with)

    def tokenized(self, request: EngineRequest) -> EngineRequest:
        """The request's prompt tokenized and checked against the context on the caller's thread (a handler's),
        never the engine thread's; a RequestError naming the prompt."""
        return self.engine.tokenized(request)

    def prompt_logprobs(self, request: EngineRequest, k: int, stop: Callable[[], bool] | None = None) -> list | None:
        """echo with logprobs: the prompt checked as intake checks it and scored by one no-cache forward, on the
        caller's thread (it reads the weights only, never the engine's state); None once `stop()` is true."""
        try:
            return self.engine.prompt_logprobs(self.engine.prompt_ids(request), k, stop)
        finally:  # the forward's OpenMP workers on this handler thread would slow the engine thread's (kernels)
            release_openmp_threads()


class Closing(set):
    """Callbacks to run once the server begins shutting down (EngineLoop.abort(None), its first signal's, or stop()),
    on the thread that begins it: a signal handler's, so each takes no lock (call_soon_threadsafe). A request being
    prepared (a grammar compiling, prompts scored) is answered then, its work stopped (toolkit.serve.job)."""

    begun = False

    def begin(self) -> None:
        self.begun = True
        for callback in list(self):
            callback()


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        run_dir: Path | None,
        config: Mapping[str, Any] | None = None,
        *,
        flush_every_steps: int = 8,
        on_finish: Callable[[RequestOutput], None] | None = None,
        max_waiting: int = 256,
        record_body: str = "full",
        max_failed_steps: int = 3,
        max_trace_bytes: int | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        handoff_wait_ms: float | None = None,
    ):
        """`run_dir`: where the run is recorded (None: not recorded; toolkit.runs.recorder). `on_finish`: called
        on the engine thread with each finished request's output (the server's latency histograms).
        `max_waiting`: requests queued or admitted but not running before submit refuses more. `record_body`:
        full | hash | off, what the trace keeps of each HTTP body. `max_failed_steps`: steps failing in a row
        before the loop gives up (the engine is then broken, not one request). `max_trace_bytes`: the trace's
        size past which new requests are refused (507), as while the disk refuses writes. `on_fatal`: called on
        the engine thread once the loop cannot go on, after every waiting client was answered (mode=serve
        shuts the server down then and exits non-zero, for a supervisor to restart it). `handoff_wait_ms`: how long
        at most a step waits for the event loops it handed updates to (_wait_taken; None: handoff_wait_for's default)."""
        if not (isinstance(max_waiting, int) and max_waiting >= 1):
            raise ConfigError(f"serve.max_waiting must be a positive integer, got {max_waiting!r}")
        self.engine = engine
        self.prepare = Preparer(engine)  # on handlers' threads: grammars, prompts, echo scores
        self.record = RunRecorder(
            engine,
            run_dir,
            config,
            flush_every_steps=flush_every_steps,
            record_body=record_body,
            summary_window=100_000,
            max_trace_bytes=max_trace_bytes,
            served=True,
        )
        self.run_id, self.writer = self.record.run_id, self.record.writer
        self.on_finish, self.on_fatal = on_finish, on_fatal
        self.handoff_wait_s = handoff_wait_for(handoff_wait_ms, engine) / 1e3
        self.max_waiting, self.max_failed_steps = max_waiting, max_failed_steps
        self.stats = LoopStats(kv_blocks_total=engine.num_kv_blocks)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # adds submitted, not yet taken with the waiting count refreshed after them
        self._preparing = 0  # places check_capacity holds for requests being prepared (grammars, prompt scores)
        self._wake = threading.Event()
        self._stopping = False
        self.closing = Closing()  # begun by abort(None) (a shutdown's first signal) or stop()
        self._sinks: dict[str, Sink] = {}
        self._errors: dict[str, str] = {}  # request id -> why a step failed it (answered once it ends)
        self._failed_steps = 0
        self._unflushed = False  # whether steps ran since the loop last handed the writer a flush (idle)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ callers (any thread)

    def start(self) -> EngineLoop:
        """Step the engine on its own thread from now on; this thread (the one that loaded the model) gives
        back its OpenMP workers first, or libgomp, counting both teams on a small machine, would sleep at
        every barrier of the engine's steps (toolkit.native.library.release_openmp_threads)."""
        release_openmp_threads()
        self._thread.start()
        return self

    def check_capacity(self, count: int) -> None:
        """Hold `count` places under `max_waiting` for a request about to be prepared (grammar, prompt scores), or
        Unavailable (a 503) before any work; submit() gives them back, or release() where it never comes."""
        with self._lock:
            self._refuse_past(count)
            self._preparing += count

    def release(self, count: int) -> None:
        with self._lock:
            self._preparing -= count

    def _refuse_past(self, count: int) -> None:
        if self._stopping or self.closing.begun or self.error is not None:
            raise Unavailable("the server is shutting down")
        storage = self.record.unavailable
        if storage is not None:
            raise Unavailable(
                f"this server cannot take requests while {storage}; retry later", 5, 507, "insufficient_storage"
            )
        waiting = self._queued + self._preparing + self.stats.waiting_requests
        if waiting + count > self.max_waiting:
            raise Unavailable(
                f"the server is at capacity: {waiting} requests are waiting "
                f"(serve.max_waiting={self.max_waiting}); retry later"
            )

    def submit(self, submissions: list[Submission], held: int = 0) -> list[Future]:
        """Queue one HTTP request's engine requests, all or none (Unavailable: stopping, or past `max_waiting`), the
        places check_capacity `held` for them given back first. Each future holds its id, or the error."""
        with self._lock:
            self._preparing -= held
            self._refuse_past(len(submissions))
            self._queued += len(submissions)
            for sub in submissions:  # under the lock: _fail_queued, once it holds it, sees every one of them
                self._commands.put(("add", sub))
        self._wake.set()
        return [sub.accepted for sub in submissions]

    def reject(self, request_id: str, route: str, status: int, reason: str, body_sha256: str | None) -> None:
        """Record a request refused before it reached the engine (a 503), in rejected.parquet."""
        self.record.reject(request_id, route, status, reason, body_sha256)
        self._wake.set()

    def abort(self, request_id: str | None) -> None:
        """Abort a request (its client left), or every one (None: a shutdown, after which new requests are refused
        and those being prepared told: Closing): before the next step, blocks freed. No lock: a signal calls it."""
        if request_id is None:
            self.closing.begin()
        self._commands.put(("abort", request_id))
        self._wake.set()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort what is still running, write the rest of the trace, requests.parquet and summary.json."""
        self.closing.begin()
        with self._lock:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def open_requests(self) -> int:
        """Requests the loop holds state for (admitted, not ended)."""
        return len(self._sinks)

    def _run(self) -> None:  # the engine thread, from here on
        name_current_thread()  # "engine-loop", its OpenMP workers too: a profile tells the step from the server
        engine = self.engine
        try:
            while True:
                self._take_commands()
                if self._stopping:
                    for request_id in list(self._sinks):
                        self._abort(request_id)
                    self._after_step(None)
                    break
                backlogged = self.writer is not None and self.writer.backlogged
                if not engine.has_unfinished() or backlogged:  # idle, or the disk holds too many rows back
                    self.stats.refresh(self.engine.stats())
                    self.record.write(None)  # an abort or a refusal while idle
                    woken = self._wake.wait(0.5)
                    if not woken and self._unflushed and not backlogged and self.writer is not None:
                        # idle half a second: what the last steps left in memory to the writer (a kill lost it)
                        self.record.flush(wait=False)
                        self._unflushed = False
                    self._wake.clear()
                    continue
                self._step()
        except BaseException as exc:  # noqa: BLE001 - every waiting client is told; the server reports it
            self.error = exc
            for request_id, sink in list(self._sinks.items()):
                _send(sink, Update(request_id, error=f"engine loop failed: {one_line(exc)}"))
            self._sinks.clear()
        finally:
            self._fail_queued()
            try:
                self.record.close()
            except Exception as exc:  # noqa: BLE001 - a trace that could not be closed (rows lost) fails the run
                print(f"serve: closing the trace failed: {one_line(exc)}", file=sys.stderr, flush=True)
                self.error = self.error or RuntimeError(f"closing the trace failed ({type(exc).__name__})")
            if self.error is not None and self.on_fatal is not None:
                self.on_fatal(self.error)

    def _step(self) -> None:
        t0, self._unflushed = time.perf_counter(), True
        try:
            out = self.engine.step(trace_digests=self.writer is not None)
        except Exception as exc:  # noqa: BLE001 - the requests of this step fail; the loop goes on
            self._failed_steps += 1
            if self._failed_steps >= self.max_failed_steps:
                raise
            self._fail_running(exc)
            return
        self._failed_steps = 0
        self.record.stepped(out, time.perf_counter() - t0)
        self._after_step(out)

    def _fail_running(self, exc: BaseException) -> None:
        """A step raised: the requests it scheduled (those running) end with that error, and are released."""
        message = f"the engine failed while stepping this request: {one_line(exc)}"
        print(f"serve: {message}", file=sys.stderr, flush=True)
        running = self.engine.running_request_ids()
        for request_id in sorted(running & self._sinks.keys()):
            self.engine.abort(request_id)
            self._finish(request_id, (), error=message)
        self._after_step(None)

    def _take_commands(self) -> None:
        added = 0
        while True:
            try:
                kind, item = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                added += 1
                self._add(item)
            else:
                for request_id in [item] if item in self._sinks else list(self._sinks) if item is None else []:
                    self._abort(request_id)
        if added:
            self.stats.refresh(self.engine.stats())
            with self._lock:
                self._queued -= added

    def _add(self, sub: Submission) -> None:
        engine = self.engine
        request = sub.request
        request_id = request.request_id
        try:
            request_id = engine.add(request)
        except ToolkitError as exc:
            sub.accepted.set_exception(RequestError(str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - this request's error (a 500), not the loop's
            if request_id is not None and engine.has_request(request_id):
                engine.abort(request_id)
                engine.release(request_id)
            print(f"serve: request {request_id}: {one_line(exc)}", file=sys.stderr, flush=True)
            self.record.reject(str(request_id), sub.route, 500, one_line(exc), sub.body and sub.body.sha256)
            sub.accepted.set_exception(InternalError(f"the engine failed to add this request: {one_line(exc)}"))
            return
        self._sinks[request_id] = sub.sink
        self.record.admitted(request_id, sub.body)
        sub.accepted.set_result(request_id)

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._finish(request_id, (), aborted=True)

    def _after_step(self, out: StepOutput | None) -> None:
        engine = self.engine
        if out is not None:
            self.stats.steps += 1
            by_request: dict[str, tuple[list, list]] = {}
            for d in out.deltas:
                by_request.setdefault(d.request_id, ([], []))[0].append(d)
            for s in out.samples:
                by_request.setdefault(s.request_id, ([], []))[1].append(s)
                self.stats.output_tokens += s.token_id >= 0
            self.stats.recent.append((time.perf_counter(), self.stats.output_tokens))
            done = {r for r in {engine.request_of(s) for s in out.finished} if engine.is_finished(r)}
            loops = {s.loop for r in by_request if isinstance(s := self._sinks.get(r), LoopSink)}
            for request_id, (deltas, samples) in by_request.items():
                sink = self._sinks.get(request_id)
                if sink is not None and request_id not in done:
                    _send(sink, Update(request_id, tuple(deltas), tuple(samples)))
            # a step raised for these alone (one sample of n, perhaps): a 500 once the request ends
            self._errors.update((r, why) for r, why in out.failed if r in self._sinks)
            for request_id in done & self._sinks.keys():
                deltas, samples = by_request.get(request_id, ((), ()))
                self._finish(request_id, deltas, samples, error=self._errors.get(request_id))
            _wait_taken(loops, self.handoff_wait_s)
        self.stats.refresh(self.engine.stats())
        self.record.write(out)

    def _finish(self, request_id: str, deltas, samples=(), error: str | None = None, aborted: bool = False) -> None:
        digest = self.record.ended(request_id)
        output = self.engine.release(request_id)
        if aborted:  # each sample cut short ends its stream with its finish_reason, as one that finished does
            deltas = (*deltas, *_abort_ends(request_id, output))
        sink = self._sinks.pop(request_id)
        self._errors.pop(request_id, None)
        self.record.finished(output)
        self.stats.prompt_tokens += len(output.prompt_token_ids)
        for c in output.outputs:
            self.stats.finished[c.finish_reason] = self.stats.finished.get(c.finish_reason, 0) + 1
        if error is not None:
            self.record.reject(request_id, "", 500, error, digest)
            _send(sink, Update(request_id, tuple(deltas), tuple(samples), error=error))
            return
        if self.on_finish is not None:
            self.on_finish(output)
        _send(sink, Update(request_id, tuple(deltas), tuple(samples), output=output))

    def _fail_queued(self) -> None:
        """Every request still queued when the loop ends gets its answer (a 503): none is left waiting."""
        with self._lock:
            self._stopping = True
        while True:
            try:
                kind, item = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add" and not item.accepted.done():
                item.accepted.set_exception(Unavailable("the server is shutting down"))


def _abort_ends(request_id: str, output: RequestOutput) -> tuple[TextDelta, ...]:
    """A last delta, finish_reason "abort", for each sample of `output` an abort cut short."""
    ends = [c.index for c in output.outputs if c.finish_reason == "abort"]
    return tuple(TextDelta(request_id, i, "", (), True, "abort") for i in ends)


def _send(sink: Sink, update: Update) -> None:
    """Hand an update to its caller; a caller that is gone (its event loop closed) changes nothing here."""
    try:
        sink(update)
    except RuntimeError:
        pass


HANDOFF_WAIT_MS = 2  # serve.handoff_wait_ms's default where the forward runs on the CPU


def handoff_wait_for(setting: float | None, engine: Engine) -> float:
    """How long a step waits for the event loop to write what it handed over: the setting, or by default
    HANDOFF_WAIT_MS where the forward runs on the CPU (whose cores the event loop's work would take from it) and 0
    on a GPU (where it takes none: not measured there, so not changed)."""
    if setting is not None:
        return float(setting)
    return HANDOFF_WAIT_MS if engine.device.type == "cpu" else 0.0


def _wait_taken(loops: set[asyncio.AbstractEventLoop], timeout_s: float) -> None:
    """Wait (at most `timeout_s` in all) until each event loop has run what this step handed it: the updates and the
    tasks they wake (a streamed token's SSE chunk built and written: 0.2 ms p50 of Python). That work then runs while
    the engine thread waits, rather than beside the next step's forward, where it takes a core from one of the
    forward's threads and holds the other at the next barrier: one stream +1.8% tok/s (4 paired runs, docs/serving.md).
    A `timeout_s` of 0 waits for nothing."""
    if timeout_s <= 0:
        return
    deadline = time.perf_counter() + timeout_s
    for loop in loops:
        taken = threading.Event()
        try:  # the first hop runs behind the updates, the second behind the tasks they woke
            loop.call_soon_threadsafe(loop.call_soon, taken.set)
        except RuntimeError:  # that loop is closed: nobody to wait for
            continue
        if not taken.wait(max(0.0, deadline - time.perf_counter())):
            return
