"""A server's grammar compiler: requests' structured-output grammars compiled off the event loop, on threads of
their own, with a bound on how many compile at once."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from toolkit.serve.loop import Unavailable


class GrammarCompiler:
    """Compiles requests' grammars (Intake.precompile) on `workers` threads of its own, never the event loop's
    default pool: a compile past serve.grammar_timeout_s cannot be interrupted (xgrammar's) and goes on, so
    compiles hold at most these threads and every other handler's work (echo scoring) keeps its own. Past
    `max_compiling` compiles running or queued at once (timed-out ones still running among them), a request with
    a new grammar gets 503 + Retry-After; a request without one, or with one compiled already, never waits here
    (it was queued behind the compiles, and refused past the bound, a minute long under a hostile schema).

    A request's time limit counts from its compile's start: one queued behind other requests' compiles for
    longer than the limit is a 503 (the threads were busy), not a 400 blaming its schema. The threads are daemons:
    a compile still running when the server stops does not keep the process alive (they were joined at exit, and
    a stopped server ran on for minutes)."""

    def __init__(self, precompile: Callable[..., bool], max_compiling: int, workers: int = 2):
        self.precompile, self.max_compiling, self.workers = precompile, max_compiling, workers
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # bounded by max_compiling (checked before a put)
        self._threads: list[threading.Thread] = []  # started at the first compile, stopped by close()
        self.compiling = 0  # on the event loop's thread only

    async def compile(self, sampling: dict[str, Any], timeout_s: float) -> None:
        if self.precompile(sampling, cached_only=True):  # the sampling fields checked, nothing to compile
            return
        if self.compiling >= self.max_compiling:
            raise Unavailable(
                f"the server is compiling {self.compiling} grammars (serve.max_compiling="
                f"{self.max_compiling}); retry later"
            )
        if not self._threads:
            self._threads = [
                threading.Thread(target=self._work, name=f"grammar_{i}", daemon=True) for i in range(self.workers)
            ]
            for thread in self._threads:
                thread.start()
        queued = self.compiling >= self.workers  # else a thread is free and takes it at once
        self.compiling += 1
        loop = asyncio.get_running_loop()
        started = loop.create_future()
        job: Future = Future()
        self._jobs.put((job, lambda: loop.call_soon_threadsafe(_set, started), sampling))
        future = asyncio.wrap_future(job)
        future.add_done_callback(self._done)  # when the compile ends, not when its request stops waiting
        if queued:
            try:
                await asyncio.wait_for(asyncio.shield(started), timeout_s)
            except TimeoutError:
                job.cancel()  # not started: it never runs (started meanwhile: it goes on, and is cached)
                raise Unavailable(
                    f"the grammar compiler's {self.workers} threads were busy with other requests' grammars for "
                    f"serve.grammar_timeout_s={timeout_s:g} s; retry later"
                ) from None
        await asyncio.wait_for(asyncio.shield(future), timeout_s)

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, on_start, sampling = item
            if not job.set_running_or_notify_cancel():
                continue
            try:
                on_start()
            except RuntimeError:  # the event loop is closed: nobody waits for the result
                pass
            try:
                job.set_result(self.precompile(sampling))
            except BaseException as exc:  # noqa: BLE001 - the request's answer (preparation_error)
                job.set_exception(exc)

    def _done(self, future: asyncio.Future) -> None:
        self.compiling -= 1
        if not future.cancelled():
            future.exception()  # read: a timed-out compile's error is its request's no longer

    def close(self) -> None:
        """Queued compiles are dropped, each thread stops after the compile it runs (if any)."""
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            item[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        self._threads = []


def _set(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
