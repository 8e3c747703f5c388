"""The server's connections: uvicorn's HTTP protocol with what uvicorn leaves out, a time limit on a request's head
and an overload answer in OpenAI's shape, and its server ending every stream before it shuts down."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import uvicorn

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as HttpProtocol
except ImportError:  # no httptools: h11's, as uvicorn's "auto" picks
    from uvicorn.protocols.http.h11_impl import H11Protocol as HttpProtocol

from toolkit.serve.protocol import ApiError


def http_protocol(header_timeout_s: float, limit: int | None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools where it is installed, else h11: what its "auto" picks) with:

    - a timer on the request's head: a connection whose request line and headers have not all come
      `header_timeout_s` seconds after it opened, or after its last answer, while no request of it is under way, is
      closed. uvicorn's keep-alive timer stops at the first byte, and nothing else times a head: a client that sent
      nothing, or a header a minute, held its connection, and a place under `limit`, for ever (nginx's
      client_header_timeout);
    - past `limit` open connections or requests (serve.limit_concurrency, uvicorn's test), a 503 in OpenAI's shape
      with Retry-After, where uvicorn answers a plain-text one (httptools only: h11's is uvicorn's own)."""
    overloaded = ApiError(
        503,
        f"the server is at its limit of {limit} open connections (serve.limit_concurrency); retry later",
        None,
        "server_overloaded",
        "server_overloaded",
        {"Retry-After": "1", "Connection": "close"},
    ).response()

    class Protocol(HttpProtocol):
        _head_timer: asyncio.TimerHandle | None = None

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._limit = self.limit_concurrency
            if hasattr(HttpProtocol, "on_headers_complete"):  # httptools': the test is ours (on_headers_complete)
                self.limit_concurrency = None

        def on_headers_complete(self) -> None:
            """uvicorn's, with `overloaded` as the app past the limit: the same test, OpenAI's answer."""
            app = self.app
            if self._limit is not None and (len(self.connections) >= self._limit or len(self.tasks) >= self._limit):
                self.app = overloaded
            try:
                super().on_headers_complete()
            finally:
                self.app = app

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._time_the_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._time_the_head()

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _time_the_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = None
            if not self.transport.is_closing():
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out, self.cycle)

        def _head_timed_out(self, cycle) -> None:
            """No request head has come whole since the timer started (the cycle is the one of then), and none
            is under way: a pipelined request, or one still answering, keeps its connection."""
            self._head_timer = None
            if self.cycle is cycle and (cycle is None or cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    return Protocol


class AbortingServer(uvicorn.Server):
    """uvicorn's server, whose first exit signal (SIGINT, SIGTERM) first calls `on_exit` (the engine loop aborting
    every request): each stream then ends with its finish_reason "abort" and [DONE] within a step, inside
    timeout_graceful_shutdown, where uvicorn cancelled the streams still open past it (a traceback each, and
    clients cut mid-chunk with no ending)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self._on_exit()
        super().handle_exit(sig, frame)
