"""The OpenAI-compatible HTTP API (FastAPI): handlers parse and validate, submit to the engine loop and await
their requests' updates; they never touch the engine.

    GET  /health               200 while the engine loop runs (never needs a key)
    GET  /metrics              Prometheus text (running / waiting, KV blocks, tokens/s, TTFT / TPOT histograms);
                               needs a key when serve.metrics_public is false
    GET  /v1/models            the served model
    GET  /v1/models/{model}    the served model by its name or an alias (404 for another)
    POST /v1/completions       prompt as text or token ids (or a list of them), n, echo, logprobs, stream
    POST /v1/chat/completions  messages through the tokenizer's chat template, logprobs + top_logprobs,
                               response_format (json_object / json_schema through xgrammar), stream

Errors are OpenAI's JSON (`{"error": {"message", "type", "param", "code"}}`): a 400 naming the field for a
request the server refuses, never a 500 for a user's mistake; 401 without a valid key (serve.api_key), 413 past
serve.max_body_mb, 503 with Retry-After past serve.max_waiting, 500 (one line) when the engine failed on a request.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import math
import re
import sys
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from toolkit.errors import json_leaves, not_unicode
from toolkit.runs.recorder import RecordedBody
from toolkit.serve.connections import TimedEventStream
from toolkit.serve.grammars import GrammarCompiler
from toolkit.serve.job import Job
from toolkit.serve.limits import Limits
from toolkit.serve.loop import EngineLoop
from toolkit.serve.metrics import ServerMetrics
from toolkit.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ServedModel,
    validation_error,
)
from toolkit.serve.scoring import Scorer
from toolkit.serve.shapes import json_shape


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """A route's endpoint that holds its Api weakly: fastapi keeps every endpoint it has classified in module-level
    caches (fastapi.dependencies.models' lru_caches), so a bound method there kept a stopped server's Api, its
    engine loop and its engine (the KV cache: 2 GB by default) for the life of the process. The same signature."""
    ref = weakref.WeakMethod(method)

    async def endpoint(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        if bound is None:  # a request reaching a server whose Api is gone
            return ApiError(503, "the server is shutting down", kind="server_error").response()
        return await bound(*args, **kwargs)

    endpoint.__signature__ = inspect.signature(method)
    endpoint.__name__, endpoint.__qualname__, endpoint.__doc__ = method.__name__, method.__qualname__, method.__doc__
    return endpoint


class Api:
    def __init__(
        self,
        loop: EngineLoop,
        served: ServedModel,
        metrics: ServerMetrics,
        on_shutdown: Callable[[], None] | None = None,
        *,
        limits: Limits | None = None,
        api_keys: Sequence[str] = (),
        metrics_public: bool = True,
        max_compiling: int = 8,
        max_grammar_mb: int | None = 1024,
        max_scoring: int = 4,
    ):
        """`api_keys`: when any, every /v1 route (and /metrics unless `metrics_public`) needs
        `Authorization: Bearer <one of them>`. `max_compiling`: grammars compiling or queued at once, past which
        a request with a new one gets 503 (GrammarCompiler); `max_grammar_mb`: memory one compile may take;
        `max_scoring`: echo + logprobs requests scoring or waiting to, past which one gets 503 (Scorer)."""
        self.loop, self.served, self.metrics, self.limits = loop, served, metrics, limits or Limits()
        self.compiler = GrammarCompiler(loop.prepare.precompile, max_compiling, memory_mb=max_grammar_mb)
        self.scoring = Scorer(max_scoring)  # one request's prompts scored at a time (Job._prepared)
        self.api_keys = tuple(k.encode() for k in api_keys)
        self.metrics_public = metrics_public
        self.tokenizer = loop.engine.tokenizer
        # no redirect for a trailing slash: a 307 to a URL built from the client's Host header, which clients do not
        # follow on a POST; the 404 names the routes
        self.app = FastAPI(title="toolkit", lifespan=self._lifespan(on_shutdown), redirect_slashes=False)
        app = self.app
        app.state.compiler, app.state.scoring = self.compiler, self.scoring  # what checks read of them (tests)
        reads = (
            ("/health", self.health),
            ("/metrics", self.render_metrics),
            ("/v1/models", self.models),
            ("/v1/models/{model:path}", self.model),
        )
        for path, read in reads:  # HEAD as GET without its body (health checkers probe with it)
            for method in ("GET", "HEAD"):  # a route each: one route of two methods gives both one operationId
                name = f"{read.__name__}_{method.lower()}"
                app.add_api_route(path, _weakly(read), methods=[method], name=name, operation_id=name)
        app.add_exception_handler(HTTPException, self._no_such_route)
        app.add_api_route(
            "/v1/completions",
            _weakly(self.completions),
            methods=["POST"],
            openapi_extra=_json_body_doc(CompletionRequest),
        )
        app.add_api_route(
            "/v1/chat/completions",
            _weakly(self.chat_completions),
            methods=["POST"],
            openapi_extra=_json_body_doc(ChatCompletionRequest),
        )

    def _lifespan(self, on_shutdown):
        @asynccontextmanager
        async def lifespan(app):
            yield
            self.compiler.close()
            self.scoring.close()
            if on_shutdown is not None:
                await asyncio.get_running_loop().run_in_executor(None, on_shutdown)

        return lifespan

    def _authorize(self, request: Request) -> None:
        """An ApiError 401 unless the request carries one of the keys (compared in constant time)."""
        if not self.api_keys:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        given = key.strip().encode()
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(given, k) for k in self.api_keys):
            raise ApiError(
                401,
                "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'",
                None,
                "invalid_request_error",
                "invalid_api_key",
            )

    # ------------------------------------------------------------------ small routes

    async def health(self) -> Response:
        if not self.loop.alive:
            return JSONResponse({"status": "engine loop stopped", "error": str(self.loop.error or "")}, status_code=503)
        storage = self.loop.record.unavailable
        if storage is not None:  # serving what runs, refusing new requests until the trace can be written
            return JSONResponse({"status": "degraded", "error": storage}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def render_metrics(self, request: Request) -> Response:
        if not self.metrics_public:
            try:
                self._authorize(request)
            except ApiError as exc:
                return exc.response()
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request, model: str) -> Response:
        """OpenAI's models.retrieve: the served model's card under its name or an alias."""
        try:
            self._authorize(request)
            self._check_model(model)
        except ApiError as exc:
            return exc.response()
        return JSONResponse(self._card())

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.served.name,
            "object": "model",
            "created": self.served.created,
            "owned_by": "toolkit",
            "root": self.served.name,
            "max_model_len": self.served.max_model_len,
        }

    async def _no_such_route(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own answers (no such route: 404; a route without that method: 405) in OpenAI's error shape."""
        where = f"{request.method} {request.url.path}"
        paths = dict.fromkeys(r.path for r in self.app.routes if r.path.startswith("/v1/") and "{" not in r.path)
        served = ", ".join(paths)  # each path once (GET and HEAD are a route each)
        message = {
            404: f"no route {where} on this server (it serves {served})",
            405: f"{where}: this route does not take {request.method}",
        }.get(exc.status_code, f"{where}: {exc.detail}")
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, message, None, kind, headers=exc.headers).response()

    # ------------------------------------------------------------------ the two generation routes

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "/v1/completions", CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "/v1/chat/completions", ChatCompletionRequest)

    async def _serve(self, request: Request, route: str, model_cls) -> Response:
        job = None
        try:
            self._authorize(request)
            raw = await _read_body(request, int(self.limits.max_body_mb * 2**20), self.limits.client_body_timeout_s)
            req, body = await asyncio.get_running_loop().run_in_executor(_PARSERS, _parsed, raw, model_cls)
            self._check_model(req.model)
            job = Job.build(self, route, req, body)
            await job.submit(request)
            try:
                await job.spelled()
            except BaseException:  # its client gone (cancelled) while the table was built: its requests end too
                job.abort()
                raise
        except ApiError as exc:
            self.metrics.http.labels(route, str(exc.status)).inc()
            if exc.status in (503, 507):
                self.loop.reject(
                    job.id if job else "", route, exc.status, exc.message, job.body_sha256 if job else None
                )
            return exc.response()
        self.metrics.http.labels(route, "200").inc()
        if req.stream:
            return TimedEventStream(job.stream(), self.limits.stream_write_timeout_s, job.abort)
        return await job.complete(request)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.served.name, *self.served.aliases):
            shown = repr(model[:64]) + ("..." if len(model) > 64 else "")  # a 7 MB name was answered whole
            raise ApiError(
                404,
                f"the model {shown} does not exist; this server serves {self.served.name!r}",
                "model",
                "not_found_error",
            )


async def _read_body(request: Request, limit: int, idle_s: float) -> bytes:
    """The body, or a 413 once it is longer than `limit` bytes (read no further: a huge upload costs nothing), a
    408 once no byte of it has come for `idle_s` seconds (a client that stops halfway holds no handler), a 400 where
    the client left before its body was whole (an answer nobody reads: the request is over)."""
    declared = request.headers.get("content-length")
    too_large = ApiError(
        413,
        f"the request body is larger than this server takes ({limit} bytes; serve.max_body_mb)",
        None,
        "invalid_request_error",
        "request_too_large",
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):  # a gzip body was parsed as JSON text: "not valid JSON", param null
        raise ApiError(
            415,
            f"Content-Encoding {encoding[:64]!r} is not supported: send the body uncompressed",
            None,
            "invalid_request_error",
            "unsupported_media_type",
            {"connection": "close"},  # its body is never read
        )
    codings = [c.strip().lower() for c in request.headers.get("transfer-encoding", "").split(",")]
    unknown = [c for c in codings if c not in ("", "chunked", "identity")]
    if unknown:  # "gzip, chunked": the chunks were read as the body's text (RFC 9112: 501 for a coding not known)
        raise ApiError(
            501,
            f"Transfer-Encoding {unknown[0][:64]!r} is not supported: send the body chunked or with a Content-Length",
            None,
            "invalid_request_error",
            "not_implemented",
            {"connection": "close"},
        )
    chunks, size, clock = [], 0, asyncio.get_running_loop()
    closing = {"connection": "close"}  # the rest of the body is never read: the connection cannot carry another
    try:
        async with asyncio.timeout(idle_s) as deadline:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
                deadline.reschedule(clock.time() + idle_s)
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body stopped arriving: no byte of it for {idle_s:g} s (serve.client_body_timeout_s)",
            None,
            "invalid_request_error",
            "request_timeout",
            closing,
        ) from None
    except ClientDisconnect:
        raise ApiError(400, "the client closed the connection before its body was whole", headers=closing) from None
    return b"".join(chunks)


def _json_body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """The route's JSON body in /openapi.json, as the pydantic model it is validated with (the handlers read the
    body themselves, to bound and refuse it first, so FastAPI cannot derive it): its $defs inlined."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


class _NotJson(float):
    """NaN, Infinity or -Infinity in a body: Python's parser reads them, JSON (RFC 8259) has no such numbers. Also
    a JSON number past a double's range (1e400), which Python reads as infinity, or below it (1e-400: zero)."""

    def __new__(cls, name: str, why: str = "is not a JSON number") -> _NotJson:
        number = super().__new__(cls, name)
        number.name, number.why = name, why
        return number


# a body is parsed, walked and validated off the event loop (a 7 MB one costs ~0.4 s there; the streams it serves
# meanwhile go on), by two threads at most: a client sending bodies back to back holds at most one of them
_PARSERS = ThreadPoolExecutor(2, thread_name_prefix="toolkit-parse")


def _parsed(raw: bytes, model_cls: type[BaseModel]) -> tuple[Any, RecordedBody]:
    """(the request model, the body it was read from as the trace records it), or an ApiError naming what is
    wrong."""
    body = _json_body(raw)
    try:
        req = model_cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    return req, RecordedBody.of(body)


MAX_BODY_DEPTH = 512  # JSON levels a body may nest (a schema's: serve.max_schema_depth); past it, a 400


def _json_body(raw: bytes) -> Any:
    overflows: list[_NotJson] = []

    def parse_float(text: str) -> float:
        number = float(text)
        if number == 0 and any(c in "123456789" for c in text.lower().partition("e")[0]):
            overflows.append(_NotJson(text, "is below a double's range (it would be read as 0)"))  # 1e-400
            return overflows[-1]
        if math.isfinite(number):
            return number
        overflows.append(_NotJson(text, "is past a double's range"))
        return overflows[-1]

    try:
        body = json.loads(raw, parse_constant=_NotJson, parse_float=parse_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # the parser recurses per level: a body nested thousands deep
        raise ApiError(400, "the request body is nested too deeply to parse") from None
    except ValueError:  # Python's guard on int(): a number of more than sys.get_int_max_str_digits() digits
        raise ApiError(
            400, f"the request body holds a number of more than {sys.get_int_max_str_digits()} digits"
        ) from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    # every encoder and walker after the parser recurses too (the trace's body digest, the grammar's compiler), each
    # a little deeper per level than the parser: a body the parser just took would fail there, as a 500
    if raw.count(b"[") + raw.count(b"{") > MAX_BODY_DEPTH:  # the one way to nest: a prompt of token ids is not walked
        for name, value in body.items():
            if json_shape(value, MAX_BODY_DEPTH - 1, math.inf)[0] > MAX_BODY_DEPTH - 1:
                raise ApiError(
                    400, f"{name}: the request body is nested too deeply (more than {MAX_BODY_DEPTH} levels)", name
                )
    _check_values(raw, body, walk=bool(overflows))
    return body


_SUSPECT = re.compile(rb"\\u[dD][89a-fA-F]|NaN|Infinity")  # a surrogate's escape, or a constant JSON has not


def _check_values(raw: bytes, body: dict, walk: bool) -> None:
    """A 400 naming the first value no JSON parser outside Python's reads as this body has it: a number NaN or
    +-Infinity or past a double's range (`walk`: the parser met one), or a string (or key) with a lone surrogate
    (an escape such as \\ud800 without its pair). A UTF-8 body with none of them spelled anywhere in it is not
    walked (a prompt of a million token ids costs no more)."""
    if not walk and json.detect_encoding(raw) == "utf-8" and not _SUSPECT.search(raw):
        return
    for path, value in json_leaves(body):
        if isinstance(value, _NotJson):
            raise ApiError(400, f"{path}: {value.name} {value.why}", path)
        problem = not_unicode(value) if isinstance(value, str) else None
        if problem is not None:
            raise ApiError(400, f"{path}: {problem}", path)
