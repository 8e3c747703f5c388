"""A job's mailbox: the updates the engine thread hands one HTTP request, bounded in count and in unread bytes,
merged per engine request when they pile up."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from toolkit.engine.outputs import TextDelta
from toolkit.serve.loop import Update

ROW_BYTES = 512  # what one unread trace row counts for against serve.max_unread_mb (its top logprobs with it)


class Mailbox:
    """A job's updates from the engine thread (one engine request per prompt), bounded twice. At `limit` unread
    updates the next ones wait in a tail that becomes one update per engine request when it is read (each sample's
    text joined once, a request's last update, with its output, last): a slow reader costs what it has not read,
    never a queue of every step nor a copy of its text per step. Past `max_bytes` unread (UTF-8 text, and
    ROW_BYTES a trace row) the job is given up: `on_overflow` is called once (the job aborts its engine
    requests), what was unread is dropped, and every read from then on is that error."""

    def __init__(self, limit: int = 64, max_bytes: int = 4 * 2**20, on_overflow: Callable[[], None] | None = None):
        self.limit, self.max_bytes, self.on_overflow = limit, max_bytes, on_overflow
        self._items: deque[Update] = deque()
        self._tail: list[Update] = []
        self._bytes = 0
        self._overflow: Update | None = None
        self._ready = asyncio.Event()

    def put(self, update: Update) -> None:  # on the event loop's thread
        if self._overflow is not None:
            return
        self._bytes += update_bytes(update)
        if self._bytes > self.max_bytes:
            self._items.clear()
            self._tail.clear()
            self._bytes = 0
            self._overflow = Update(
                update.request_id,
                error=f"the client read too slowly: more than "
                f"{self.max_bytes} bytes of this request's output were unread "
                f"(serve.max_unread_mb); the request was aborted",
            )
            if self.on_overflow is not None:
                self.on_overflow()
        elif self._tail or len(self._items) + 1 >= self.limit:
            self._tail.append(update)
        else:
            self._items.append(update)
        self._ready.set()

    async def get(self) -> Update:
        while True:
            if self._overflow is not None:
                return self._overflow
            if not self._items and self._tail:  # each request's waiting updates joined into one, in order
                self._items.extend(_merge_by_request(self._tail))
                self._tail = []
            if self._items:
                update = self._items.popleft()
            else:
                self._ready.clear()
                await self._ready.wait()
                continue
            self._bytes -= update_bytes(update)
            return update

    @property
    def overflowed(self) -> bool:
        """Whether the job was given up for its unread bytes (every read is that error)."""
        return self._overflow is not None

    def __len__(self) -> int:
        """The updates a reader would get now (the tail is one)."""
        return len(self._items) + bool(self._tail)

    @property
    def unread_bytes(self) -> int:
        return self._bytes


def update_bytes(update: Update, rows: bool = True) -> int:
    """What an update counts for against a bound: its text's UTF-8 bytes, and ROW_BYTES a trace row (`rows`)."""
    return sum(len(d.text.encode()) for d in update.deltas) + (ROW_BYTES * len(update.samples) if rows else 0)


def _merge_by_request(updates: list[Update]) -> list[Update]:
    """The updates of each engine request joined into one (_merge), in the order the requests first appear."""
    by_request: dict[str, list[Update]] = {}
    for update in updates:
        by_request.setdefault(update.request_id, []).append(update)
    return [_merge(group) for group in by_request.values()]


def _merge(updates: list[Update]) -> Update:
    """One update that says what one engine request's `updates` said in turn: each sample's deltas joined into
    one; the output or error, which only a request's last update carries, from the last."""
    texts: dict[int, list[str]] = {}
    tokens: dict[int, list[int]] = {}
    last: dict[int, TextDelta] = {}
    for update in updates:
        for d in update.deltas:
            texts.setdefault(d.index, []).append(d.text)
            tokens.setdefault(d.index, []).extend(d.token_ids)
            last[d.index] = d
    deltas = tuple(replace(d, text="".join(texts[i]), token_ids=tuple(tokens[i])) for i, d in last.items())
    samples = tuple(s for update in updates for s in update.samples)
    final = updates[-1]
    return Update(final.request_id, deltas, samples, final.output, final.error)
