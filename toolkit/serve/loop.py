"""The engine loop of a server: one thread owns the Engine and records the run; callers only submit.

    HTTP handler --submit(request)--> command queue --> engine thread: add, step, trace, dispatch
    HTTP handler <--Update per step-- sink (called on the engine thread; the server hands it to its event loop)

Concurrent requests share continuous-batching steps exactly as a CLI run's do (one forward per step). The run
directory is written as the server runs: config, manifest, requests.parquet (rewritten before any sample part
that needs it: arrival step and order, resolved sampling, seed, the HTTP body as received, the step of an abort)
and samples.parquet part files, so that after a `kill -9` the run is still readable, replayable and verifiable.
Scheduling depends on steps only, so `mode=replay` re-creates the same batches from requests.parquet.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from omegaconf import OmegaConf

from toolkit.engine import Engine, RequestOutput, StepOutput, TextDelta
from toolkit.errors import RequestError, ToolkitError
from toolkit.metrics import InterTokenLatency, summarize
from toolkit.session import effective_config, step_record, write_steps
from toolkit.trace import SampleTrace, build_manifest, new_run_id, request_rows
from toolkit.trace.writer import TraceWriter, atomic_write_bytes, write_manifest, write_requests


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


@dataclass
class Submission:
    """One request for the engine: add_request's arguments, the HTTP body as received, where its updates go."""

    kwargs: dict[str, Any]
    body: Any
    sink: Sink
    fill_max_tokens: bool = False  # max_tokens: the rest of the context (a chat request that gave none)
    prompt_logprobs: int | None = None  # score the prompt too, with this many alternatives per position
    prompt_scores: list | None = None  # then: per prompt position, None or (token, logprob, [(alt, logprob)])
    accepted: Future = field(default_factory=Future)  # the request id, or the RequestError refusing it


@dataclass
class LoopStats:
    """What /metrics reads (written by the engine thread only; readers take a consistent-enough snapshot)."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    steps: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # (time, output_tokens) after each step

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        now = time.perf_counter()
        points = [p for p in list(self.recent) if now - p[0] <= window_s]
        if not points:
            return 0.0
        return (self.output_tokens - points[0][1]) / max(now - points[0][0], 1e-3) if len(points) > 1 else 0.0


class EngineLoop:
    def __init__(self, engine: Engine, run_dir: Path | None, config: Mapping[str, Any] | None = None, *,
                 flush_every_steps: int = 8, on_finish: Callable[[RequestOutput], None] | None = None):
        """`run_dir`: where the run is recorded (None: not recorded). `on_finish`: called on the engine thread
        with each finished request's output (the server's latency histograms)."""
        self.engine = engine
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.run_id = new_run_id()
        self.on_finish = on_finish
        self.stats = LoopStats(kv_blocks_total=engine.num_kv_blocks)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._sinks: dict[str, Sink] = {}
        self._rows: dict[str, list[dict[str, Any]]] = {}  # every request served, in arrival order
        self._bodies: dict[str, str] = {}
        self._outputs: list[RequestOutput] = []
        self._steps: list[dict[str, Any]] = []
        self._itl = InterTokenLatency()
        self._rows_changed = False
        self.writer: TraceWriter | None = None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            resolved = effective_config(engine, config)
            atomic_write_bytes(self.run_dir / "config.yaml", OmegaConf.to_yaml(resolved).encode())
            write_manifest(self.run_dir, build_manifest(engine, self.run_id, {"served": True}))
            write_requests(self.run_dir, [])
            self.writer = TraceWriter(self.run_dir, self.run_id, flush_every_steps,
                                      OmegaConf.select(resolved, "trace.full_logits"))
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._started = time.perf_counter()
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ callers (any thread)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def submit(self, submission: Submission) -> Future:
        """Queue a request; the returned future holds its id once the engine took it (or a RequestError)."""
        if self._stopping or self.error is not None:
            submission.accepted.set_exception(RequestError("the server is shutting down"))
            return submission.accepted
        self._commands.put(("add", submission))
        self._wake.set()
        return submission.accepted

    def abort(self, request_id: str) -> None:
        """Abort a request (its client left): it finishes before the next step and its blocks are freed."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    def call(self, fn: Callable[[Engine], Any]) -> Future:
        """Run `fn(engine)` on the engine thread between steps (e.g. a prompt's logprobs); its result or error."""
        done: Future = Future()
        self._commands.put(("call", (fn, done)))
        self._wake.set()
        return done

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort what is still running, write the rest of the trace, requests.parquet and summary.json."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._take_commands()
                if self._stopping:
                    for request_id in list(self._sinks):
                        self._abort(request_id)
                    self._after_step(None)
                    break
                if not engine.has_unfinished():
                    self._refresh_stats()
                    if self._rows_changed and self.writer is not None:  # an abort while idle
                        self.writer.write_step((), None, self._snapshot())
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                t0 = time.perf_counter()
                out = engine.step(trace_digests=self.writer is not None)
                self._itl.update(out.samples)
                if out.batch_size:
                    self._steps.append(step_record(out, time.perf_counter() - t0))
                self._after_step(out)
        except BaseException as exc:  # noqa: BLE001 - every waiting client is told; the server reports it
            self.error = exc
            for request_id, sink in list(self._sinks.items()):
                _send(sink, Update(request_id, error=f"engine loop failed: {exc}"))
            self._sinks.clear()
        finally:
            self._close()

    def _take_commands(self) -> None:
        while True:
            try:
                kind, item = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(item)
            elif kind == "abort":
                if item in self._sinks:
                    self._abort(item)
            else:
                fn, done = item
                try:
                    done.set_result(fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    done.set_exception(exc)

    def _add(self, sub: Submission) -> None:
        engine = self.engine
        kwargs = dict(sub.kwargs)
        try:
            if sub.fill_max_tokens:
                ids = _prompt_ids(engine, kwargs)
                kwargs = {k: v for k, v in kwargs.items() if k not in ("prompt", "messages")}
                kwargs["prompt_token_ids"] = ids
                kwargs["sampling_params"] = {**kwargs.get("sampling_params", {}),
                                             "max_tokens": max(engine.max_model_len - len(ids), 1)}
            request_id = engine.add_request(**kwargs)
            if sub.prompt_logprobs is not None:
                seq = engine.requests[engine.groups[request_id][0]]
                sub.prompt_scores = prompt_scores(engine, list(seq.prompt_token_ids), sub.prompt_logprobs)
        except ToolkitError as exc:
            sub.accepted.set_exception(RequestError(str(exc)))
            return
        self._sinks[request_id] = sub.sink
        self._bodies[request_id] = json.dumps(sub.body, sort_keys=True) if sub.body is not None else None
        self._record_rows(request_id)
        sub.accepted.set_result(request_id)

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._finish(request_id, ())

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
            ended = {engine.requests[s].request_id for s in out.finished}
            done = {r for r in ended if all(engine.requests[s].is_finished for s in engine.groups[r])}
            for request_id, (deltas, samples) in by_request.items():
                sink = self._sinks.get(request_id)
                if sink is not None and request_id not in done:
                    _send(sink, Update(request_id, tuple(deltas), tuple(samples)))
            for request_id in done & self._sinks.keys():
                deltas, samples = by_request.get(request_id, ((), ()))
                self._finish(request_id, deltas, samples)
        self._refresh_stats()
        if self.writer is not None and (out is not None or self._rows_changed):
            snapshot = self._snapshot() if self._rows_changed else None
            if out is not None:
                self.writer.write_output(out, snapshot)
            else:
                self.writer.write_step((), None, snapshot)

    def _refresh_stats(self) -> None:
        sched = self.engine.scheduler
        self.stats.running, self.stats.waiting = len(sched.running), len(sched.waiting)
        self.stats.kv_blocks_used = self.engine.block_manager.num_used_blocks

    def _finish(self, request_id: str, deltas, samples=()) -> None:
        self._record_rows(request_id)
        output = self.engine.release(request_id)
        sink = self._sinks.pop(request_id)
        self._outputs.append(output)
        self.stats.prompt_tokens += len(output.prompt_token_ids)
        for c in output.outputs:
            self.stats.finished[c.finish_reason] = self.stats.finished.get(c.finish_reason, 0) + 1
        if self.on_finish is not None:
            self.on_finish(output)
        _send(sink, Update(request_id, tuple(deltas), tuple(samples), output=output))

    def _record_rows(self, request_id: str) -> None:
        rows = request_rows(self.engine, self.run_id, [request_id])
        for row in rows:
            row["request_body"] = self._bodies.get(request_id)
        self._rows[request_id] = rows
        self._rows_changed = True

    def _snapshot(self) -> list[dict[str, Any]]:
        self._rows_changed = False
        return [row for rows in self._rows.values() for row in rows]

    def _close(self) -> None:
        if self.writer is None:
            return
        try:
            self.writer.close()
        finally:
            rows = self._snapshot()
            write_requests(self.run_dir, rows)
            write_steps(self.run_dir, self._steps)
            wall = (self.engine.last_finish_time or 0.0) - (self.engine.first_admission_time or 0.0)
            summary = summarize(self._outputs, wall, self._itl.values, steps=self.engine.step_index, run_id=self.run_id,
                                trace_rows=self.writer.rows_written, model=self.engine.loaded.model_id,
                                model_revision=self.engine.loaded.revision, served=True,
                                served_s=time.perf_counter() - self._started)
            atomic_write_bytes(self.run_dir / "summary.json", json.dumps(summary, indent=2).encode())


def _send(sink: Sink, update: Update) -> None:
    """Hand an update to its caller; a caller that is gone (its event loop closed) changes nothing here."""
    try:
        sink(update)
    except RuntimeError:
        pass


def prompt_scores(engine: Engine, ids: list[int], k: int) -> list:
    """Raw logprobs of every prompt token given the ones before it (the first has none) and the top `k`
    alternatives at each position, from one no-cache forward through the engine's model (an eval harness's
    loglikelihood request: echo + logprobs)."""
    import torch

    from toolkit.runner import recompute_logits

    logprobs = torch.log_softmax(recompute_logits(engine.loaded.model, ids, batch_invariant=False)[:-1].double(), -1)
    rows: list = [None]
    for pos in range(1, len(ids)):
        row = logprobs[pos - 1]
        top = torch.topk(row, k).indices.tolist() if k else []
        rows.append((ids[pos], float(row[ids[pos]]), [(t, float(row[t])) for t in top]))
    return rows


def _prompt_ids(engine: Engine, kwargs: Mapping[str, Any]) -> list[int]:
    """The prompt's token ids as intake would compute them (a chat request's through the chat template)."""
    if kwargs.get("prompt_token_ids") is not None:
        return list(kwargs["prompt_token_ids"])
    if engine.tokenizer is None:
        raise RequestError("this model has no tokenizer; give prompt token ids")
    if kwargs.get("messages") is not None:
        return engine.tokenizer.apply_chat_template(kwargs["messages"])
    prompt = kwargs.get("prompt")
    if not isinstance(prompt, str):
        raise RequestError("prompt must be a string")
    return engine.tokenizer.encode(prompt)

