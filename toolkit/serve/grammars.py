"""A server's grammar compiler: requests' structured-output grammars compiled off the event loop, on threads of
their own, with a bound on how many compile at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from toolkit.serve.loop import Unavailable


class GrammarCompiler:
    """Compiles requests' grammars (Intake.precompile) on `workers` threads of its own, never the event loop's
    default pool: a compile past serve.grammar_timeout_s cannot be interrupted (xgrammar's) and goes on, so
    compiles hold at most these threads and every other handler's work (echo scoring) keeps its own. Past
    `max_compiling` compiles running or queued at once (timed-out ones still running among them), a request with
    a new grammar gets 503 + Retry-After; a request without one, or with one compiled already, never waits here
    (it was queued behind the compiles, and refused past the bound, a minute long under a hostile schema)."""

    def __init__(self, precompile: Callable[..., bool], max_compiling: int, workers: int = 2):
        self.precompile, self.max_compiling = precompile, max_compiling
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar")
        self.compiling = 0  # on the event loop's thread only

    async def compile(self, sampling: dict[str, Any], timeout_s: float) -> None:
        if self.precompile(sampling, cached_only=True):  # the sampling fields checked, nothing to compile
            return
        if self.compiling >= self.max_compiling:
            raise Unavailable(
                f"the server is compiling {self.compiling} grammars (serve.max_compiling="
                f"{self.max_compiling}); retry later"
            )
        self.compiling += 1
        future = asyncio.get_running_loop().run_in_executor(self._pool, self.precompile, sampling)
        future.add_done_callback(self._done)  # when the compile ends, not when its request stops waiting
        await asyncio.wait_for(asyncio.shield(future), timeout_s)

    def _done(self, future: asyncio.Future) -> None:
        self.compiling -= 1
        if not future.cancelled():
            future.exception()  # read: a timed-out compile's error is its request's no longer

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
