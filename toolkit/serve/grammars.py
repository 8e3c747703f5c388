"""A server's grammar compiler: requests' structured-output grammars compiled off the event loop, by threads of
their own in child processes of their own, with a bound on how many compile at once."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from toolkit.sampling.grammar_process import GrammarProcess, prestart
from toolkit.serve.loop import Unavailable


class GrammarCompiler:
    """Compiles requests' grammars (Intake.precompile) on `workers` threads of its own, never the event loop's
    default pool, each new grammar first in the thread's child process (toolkit.sampling.grammar_process): a
    compile past serve.grammar_timeout_s is killed there, its thread free again whatever xgrammar was doing; its
    memory is bounded (`memory_mb`, serve.max_grammar_mb); its crash is one request's 400. Only then is it
    compiled into the engine's cache, on the thread. Past `max_compiling` compiles running or queued at once, a
    request with a new grammar gets 503 + Retry-After; a request without one, or with one compiled already,
    never waits here.

    A request's time limit counts from its compile's start: one queued behind other requests' compiles for
    longer than the limit is a 503 (the threads were busy), not a 400 blaming its schema; a child's start (the
    first compile's, and after a kill) is the server's cost, not counted. close() kills the children: the
    threads end at once, and a stopped server does not run on for a compile's minutes."""

    def __init__(
        self, precompile: Callable[..., bool], max_compiling: int, workers: int = 2, memory_mb: int | None = None
    ):
        self.precompile, self.max_compiling, self.workers = precompile, max_compiling, workers
        self.memory_mb = memory_mb
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # bounded by max_compiling (checked before a put)
        self._threads: list[threading.Thread] = []  # started at the first compile, stopped by close()
        self._processes: list[GrammarProcess] = []
        self.compiling = 0  # on the event loop's thread only
        threading.Thread(target=prestart, name="grammar_prestart", daemon=True).start()

    async def compile(self, sampling: dict[str, Any], timeout_s: float) -> None:
        if self.precompile(sampling, cached_only=True):  # the sampling fields checked, nothing to compile
            return
        if self.compiling >= self.max_compiling:
            raise Unavailable(
                f"the server is compiling {self.compiling} grammars (serve.max_compiling="
                f"{self.max_compiling}); retry later"
            )
        if not self._threads:
            self._processes = [GrammarProcess(self.memory_mb) for _ in range(self.workers)]
            self._threads = [
                threading.Thread(target=self._work, args=(process,), name=f"grammar_{i}", daemon=True)
                for i, process in enumerate(self._processes)
            ]
            for thread in self._threads:
                thread.start()
        queued = self.compiling >= self.workers  # else a thread is free and takes it at once
        self.compiling += 1
        loop = asyncio.get_running_loop()
        started = loop.create_future()
        job: Future = Future()
        self._jobs.put((job, lambda: loop.call_soon_threadsafe(_set, started), sampling, timeout_s))
        future = asyncio.wrap_future(job)
        future.add_done_callback(self._done)  # when the compile ends, not when its request stops waiting
        await asyncio.wait(
            (started, future), timeout=timeout_s if queued else None, return_when=asyncio.FIRST_COMPLETED
        )
        if not started.done() and not future.done():
            job.cancel()  # not started: it never runs (started meanwhile: it goes on, and is cached)
            raise Unavailable(
                f"the grammar compiler's {self.workers} threads were busy with other requests' grammars for "
                f"serve.grammar_timeout_s={timeout_s:g} s; retry later"
            )
        await asyncio.shield(future)  # its thread kills a compile past timeout_s; the second, in-process, takes as long

    def _work(self, process: GrammarProcess) -> None:
        while (item := self._jobs.get()) is not None:
            job, on_start, sampling, timeout_s = item
            if not job.set_running_or_notify_cancel():
                continue

            def started() -> None:
                try:
                    on_start()
                except RuntimeError:  # the event loop is closed: nobody waits for the result
                    pass

            try:
                job.set_result(
                    self.precompile(
                        sampling,
                        compile_with=lambda backend, spec: process.compile_into(backend, spec, timeout_s, started),
                    )
                )
            except BaseException as exc:  # noqa: BLE001 - the request's answer (preparation_error)
                job.set_exception(exc)
            started()  # compiled by another request's meanwhile, or failed before its start

    def pids(self) -> list[int]:
        """The process ids of the children alive now (tests watch a killed one go)."""
        return [pid for process in self._processes if (pid := process.pid()) is not None]

    def _done(self, future: asyncio.Future) -> None:
        self.compiling -= 1
        if not future.cancelled():
            future.exception()  # read: a timed-out compile's error is its request's no longer

    def close(self) -> None:
        """Queued compiles are dropped, running ones killed with their child processes."""
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            item[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        for process in self._processes:
            process.close()
        self._threads, self._processes = [], []


def _set(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
