"""Echo + logprobs scoring for a server (OpenAI's legacy scoring): one request's prompts at a time, on a thread of
its own below the engine's CPU priority, with a bound on the requests scoring or waiting to (serve.max_scoring),
past which a request gets a 503 at once instead of a place in a queue whose every member costs seconds."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from toolkit.native.threads import name_current_thread, yield_to_the_step
from toolkit.serve.loop import Unavailable

T = TypeVar("T")


def _below_the_engine() -> None:
    """The scoring thread's start: named in the OS, and at a lower CPU priority than the engine's step (its forward
    over thousands of prompt tokens took the cores from the steps of every other request; the OpenMP workers it
    starts inherit its priority)."""
    name_current_thread("scoring")
    yield_to_the_step()


class Scorer:
    def __init__(self, max_scoring: int = 4):
        self.max_scoring = max_scoring
        self._pending = 0  # requests whose scoring is queued or running
        self._lock = threading.Lock()  # _pending is counted down on the scoring thread
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="scoring", initializer=_below_the_engine)

    @property
    def pending(self) -> int:
        return self._pending

    async def score(self, scored: Callable[[], T]) -> T:
        """`scored()` on the scoring thread once the requests before it are scored; Unavailable (a 503) where
        max_scoring requests are scoring or waiting already. A request that ends while it waits is dropped from the
        queue; one that ends while scored is scored to the end of its piece (its `scored` asks the request's cancel
        between pieces), and the next waits for that."""
        with self._lock:
            if self._pending >= self.max_scoring:
                raise Unavailable(
                    f"the server is scoring or has queued {self._pending} echo + logprobs requests "
                    f"(serve.max_scoring={self.max_scoring}); retry later"
                )
            self._pending += 1
        try:
            future = self._pool.submit(scored)
        except BaseException:
            self._ended(None)
            raise
        future.add_done_callback(self._ended)
        return await asyncio.wrap_future(future)

    def _ended(self, _: Future | None) -> None:
        with self._lock:
            self._pending -= 1

    def close(self) -> None:
        """No more scoring: what waits is dropped; what runs ends at its request's cancel."""
        self._pool.shutdown(wait=False, cancel_futures=True)
