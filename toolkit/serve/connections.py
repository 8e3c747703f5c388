"""The server's connections: uvicorn's HTTP protocol with what uvicorn leaves out, a time and a size limit on a
request's head, and its own answers (overload, a malformed or oversized head) in OpenAI's shape; its server
ending every stream before it shuts down; and a stream whose every write has a deadline."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus

import uvicorn
from fastapi.sse import EventSourceResponse

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as HttpProtocol
except ImportError:  # no httptools: h11's, as uvicorn's "auto" picks
    from uvicorn.protocols.http.h11_impl import H11Protocol as HttpProtocol

from toolkit.errors import ConfigError
from toolkit.serve.protocol import ApiError

STATUS_LINE = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}


def http_protocol(
    header_timeout_s: float, limit: int | None, max_head_bytes: int = 64 * 1024, per_client: int | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools where it is installed, else h11: what its "auto" picks) with:

    - a timer on the request's head: a connection whose request line and headers have not all come
      `header_timeout_s` seconds after it opened, or after its last answer, while no request of it is under way, is
      closed. uvicorn's keep-alive timer stops at the first byte, and nothing else times a head: a client that sent
      nothing, or a header a minute, held its connection, and a place under `limit`, for ever (nginx's
      client_header_timeout);
    - past `limit` open connections or requests (serve.limit_concurrency, uvicorn's test), a 503 in OpenAI's shape
      with Retry-After, where uvicorn answers a plain-text one (httptools only: h11's is uvicorn's own);
    - a request head (its line and headers) past `max_head_bytes` (serve.max_header_kb) is a 431 and the connection
      closed, as soon as its bytes pass the bound: httptools keeps a head's bytes however many come, and a client
      streaming one header for 10 s held 200 MB (h11 has its own bound, h11_max_incomplete_event_size);
    - a head the parser refuses is a 400 in OpenAI's shape, where uvicorn answers it in plain text;
    - past `per_client` open connections from one address (serve.max_connections_per_client), a request on another
      is a 503 and its connection closed: one client trickling 1,030 bodies a byte at a time held every place under
      `limit`, and every other client got 503s;
    - `GET /health` is answered past either limit (a health check says the process lives, as it does)."""
    open_by_client: dict[str, int] = {}  # open connections per address, each under per_client (of this server's)
    crowding = ApiError(
        503,
        f"this client has {per_client} connections open, as many as one client may (serve.max_connections_per_client);"
        f" retry on one of them",
        None,
        "server_overloaded",
        "too_many_connections",
        {"Retry-After": "1", "Connection": "close"},
    ).response()
    overloaded = ApiError(
        503,
        f"the server is at its limit of {limit} open connections (serve.limit_concurrency); retry later",
        None,
        "server_overloaded",
        "server_overloaded",
        {"Retry-After": "1", "Connection": "close"},
    ).response()

    too_large = ApiError(
        431,
        f"the request's head (its request line and headers) is larger than serve.max_header_kb="
        f"{max_head_bytes // 1024}",
        None,
        "invalid_request_error",
        "request_header_fields_too_large",
        {"Connection": "close"},
    )
    httptools = hasattr(HttpProtocol, "on_headers_complete")  # h11's protocol has no parser callbacks

    class Protocol(HttpProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes: int | None = None  # bytes of the head under way since the read it began in (None: none is)
        _peer: str | None = None  # the client's address, where this connection counts under per_client
        _crowding = False  # opened past per_client: its requests get `crowding`
        _running = None  # the request cycle answering now (httptools'; pipelined ones wait in self.pipeline)

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._limit = self.limit_concurrency
            if httptools:  # the test is ours (on_headers_complete)
                self.limit_concurrency = None

        def data_received(self, data: bytes) -> None:
            if self._head_bytes is not None:
                self._head_bytes += len(data)
            super().data_received(data)
            if httptools and self._head_bytes is not None and self._head_bytes > max_head_bytes:
                self._answer(too_large)  # the head is still not whole past the bound (one read more at most)

        def on_message_begin(self) -> None:  # a head begins (httptools'): counted from the next read on
            super().on_message_begin()
            self._head_bytes = 0

        def on_headers_complete(self) -> None:
            """uvicorn's, with `overloaded` as the app past the limit (the same test, OpenAI's answer), and
            `too_large` for a head past the bound that came whole in one read."""
            self._head_bytes = None
            app = self.app
            if len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers) > max_head_bytes:
                self.app = too_large.response()
            elif self.url == b"/health":
                pass
            elif self._crowding:
                self.app = crowding
            elif self._limit is not None and (len(self.connections) >= self._limit or len(self.tasks) >= self._limit):
                self.app = overloaded
            try:
                super().on_headers_complete()
            finally:
                self.app = app

        def send_400_response(self, msg: str) -> None:
            """A head the parser refuses (httptools'): OpenAI's shape."""
            self._answer(ApiError(400, f"invalid HTTP request: {msg}", None, code="invalid_http_request"))

        def _answer(self, error: ApiError) -> None:
            """`error` written as its response and the connection closed, where no request is under way to carry it
            (uvicorn's send_400_response, in OpenAI's shape) or the request's own body is at fault; behind an answer
            still under way (a pipelined head past the bound), the connection is only closed."""
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                if self.cycle.response_started or not self.cycle.more_body or getattr(self, "pipeline", ()):
                    self.transport.close()
                    return
                # the fault is in the body its handler is reading (a chunk size not in hex): the answer is this one,
                # the handler's goes nowhere (the connection closed without a byte)
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            body = json.dumps(error.body()).encode()
            head = [STATUS_LINE[error.status]] + [n + b": " + v + b"\r\n" for n, v in self.server_state.default_headers]
            head += [
                b"content-type: application/json\r\n",
                b"content-length: " + str(len(body)).encode() + b"\r\n",
                b"connection: close\r\n\r\n",
            ]
            self.transport.write(b"".join(head) + body)
            self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            peer = peer[0] if isinstance(peer, tuple) and peer else None  # (a Unix socket's is no address)
            if per_client is not None and peer is not None:  # one past the client's bound: refused, and not counted
                self._crowding = open_by_client.get(peer, 0) >= per_client
                if not self._crowding:
                    self._peer, open_by_client[peer] = peer, open_by_client.get(peer, 0) + 1
            self._time_the_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._time_the_head()

        def _start_asgi_task(self, cycle, app) -> None:
            self._running = cycle
            super()._start_asgi_task(cycle, app)

        def connection_lost(self, exc) -> None:
            # uvicorn marks only the newest request's cycle disconnected: with requests pipelined behind it, the
            # one still answering wrote to the closed transport, and uvloop's RuntimeError was logged as an
            # "Exception in ASGI application"; every cycle of the connection is over
            for cycle in [self._running, *(queued for queued, _ in getattr(self, "pipeline", ()))]:
                if cycle is not None and not cycle.response_complete:
                    cycle.disconnected = True
                    cycle.message_event.set()
            if self._head_timer is not None:
                self._head_timer.cancel()
            if self._peer is not None:
                open_by_client[self._peer] -= 1
                if not open_by_client[self._peer]:
                    del open_by_client[self._peer]
                self._peer = None
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


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The server's socket, bound and listening before the model loads, handed to uvicorn (bound as uvicorn binds
    one: IPv6 where the host has a colon, else IPv4, SO_REUSEADDR): a host that does not resolve, an address this
    machine has not or a port in use is one line naming serve.host and serve.port (uvicorn said so in its own words
    after the "serving at" line, exit 3, once the model had loaded)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)  # a second server binding the port meanwhile fails here, not after its model loads
    except (OSError, OverflowError, UnicodeError) as exc:
        sock.close()
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"serve.host={host} serve.port={port}: cannot listen there: {reason}") from None
    return sock


class TimedEventStream(EventSourceResponse):
    """An SSE response whose every write must finish within `write_timeout_s`: a client that takes no bytes for
    that long (its socket's buffers full) has its requests aborted (`on_timeout`: their blocks freed) and its
    stream ended, instead of holding the engine for as long as it stays connected. The connection itself is left
    to uvicorn, which closes it once its buffered bytes drain: ASGI gives an app no way to drop a socket, so a
    client that never reads again keeps one `serve.limit_concurrency` slot (not engine state) until it goes."""

    def __init__(self, content: AsyncIterator[bytes], write_timeout_s: float, on_timeout: Callable[[], None]):
        super().__init__(content)
        self.write_timeout_s, self.on_timeout = write_timeout_s, on_timeout

    async def stream_response(self, send) -> None:
        async def timed(message) -> None:
            async with asyncio.timeout(self.write_timeout_s):
                await send(message)

        try:
            await super().stream_response(timed)
        except TimeoutError:
            print(
                f"serve: a stream's client took no bytes for {self.write_timeout_s:g} s "
                f"(serve.stream_write_timeout_s): its requests are aborted",
                file=sys.stderr,
                flush=True,
            )
            self.on_timeout()  # the generator may never have started (its `finally` would not run)
            await self.body_iterator.aclose()
