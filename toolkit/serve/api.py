"""The OpenAI-compatible HTTP API (FastAPI): handlers parse and validate, submit to the engine loop and await
their requests' updates; they never touch the engine.

    GET  /health               200 while the engine loop runs
    GET  /metrics              Prometheus text (running / waiting, KV blocks, tokens/s, TTFT / TPOT histograms)
    GET  /v1/models            the served model
    POST /v1/completions       prompt as text or token ids (or a list of them), n, echo, logprobs, stream
    POST /v1/chat/completions  messages through the tokenizer's chat template, logprobs + top_logprobs,
                               response_format (json_object / json_schema through xgrammar), stream

Errors are OpenAI's JSON (`{"error": {"message", "type", "param", "code"}}`): a 400 naming the field for a
request the server refuses, never a 500 for a user's mistake.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import ValidationError

from toolkit.errors import RequestError
from toolkit.serve.loop import EngineLoop, Submission, Update
from toolkit.serve.metrics import ServerMetrics
from toolkit.serve.protocol import (UNSUPPORTED, ChatCompletionRequest, CompletionRequest, FieldError,
                                    SamplingFields)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, " ".join(message.split()), param, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": None}}, status_code=self.status)


def validation_error(exc: ValidationError) -> ApiError:
    """The first problem pydantic found, as a 400 naming the field (dotted path)."""
    err = exc.errors()[0]
    loc = [str(x) for x in err["loc"] if not _union_tag(x)]
    param = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        leaf = loc[-1] if loc else "?"
        reason = UNSUPPORTED.get(leaf, "this server does not know this field")
        return ApiError(400, f"unsupported field {param}: {reason}", param)
    return ApiError(400, f"{param}: {err['msg']}" if param else err["msg"], param)


def _union_tag(part: Any) -> bool:
    """pydantic names the member of a union it tried (`str`, `list[int]`, ...) in an error's location."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none")
                                      or part.startswith(("list[", "dict[", "tuple[", "function-")))


def request_error(exc: Exception, fields: Any) -> ApiError:
    """A RequestError / ConfigError from the engine's intake as a 400; `param` is the field it names first."""
    message = str(exc)
    names = sorted(getattr(type(fields), "model_fields", {}), key=len, reverse=True) + ["max_tokens", "prompt", "logprobs"]
    param = next((n for n in names if message.startswith(n) or f" {n} " in f" {message} "), None)
    return ApiError(400, message, param)


@dataclass
class ServedModel:
    name: str  # what clients send as `model`
    aliases: tuple[str, ...]
    max_model_len: int
    created: int = field(default_factory=lambda: int(time.time()))


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else str(token_id)


class Api:
    def __init__(self, loop: EngineLoop, served: ServedModel, metrics: ServerMetrics,
                 on_shutdown: Callable[[], None] | None = None):
        self.loop, self.served, self.metrics = loop, served, metrics
        self.tokenizer = loop.engine.tokenizer
        self.app = FastAPI(title="toolkit", lifespan=self._lifespan(on_shutdown))
        app = self.app
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.render_metrics, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])

    def _lifespan(self, on_shutdown):
        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def lifespan(app):
            yield
            if on_shutdown is not None:
                await asyncio.get_running_loop().run_in_executor(None, on_shutdown)

        return lifespan

    # ------------------------------------------------------------------ small routes

    async def health(self) -> Response:
        if not self.loop.alive:
            return JSONResponse({"status": "engine loop stopped", "error": str(self.loop.error or "")},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    async def render_metrics(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.served.name, "object": "model", "created": self.served.created, "owned_by": "toolkit",
             "root": self.served.name, "max_model_len": self.served.max_model_len}]})

    # ------------------------------------------------------------------ the two generation routes

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "/v1/completions", CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "/v1/chat/completions", ChatCompletionRequest)

    async def _serve(self, request: Request, route: str, model_cls) -> Response:
        try:
            body = await _json_body(request)
            try:
                req = model_cls.model_validate(body)
            except ValidationError as exc:
                raise validation_error(exc) from None
            self._check_model(req)
            job = Job.build(self, route, req, body)
            await job.submit()
        except ApiError as exc:
            self.metrics.http.labels(route, str(exc.status)).inc()
            return exc.response()
        self.metrics.http.labels(route, "200").inc()
        if req.stream:
            return EventSourceResponse(job.stream())
        return await job.complete(request)

    def _check_model(self, req: SamplingFields) -> None:
        if req.model is not None and req.model not in (self.served.name, *self.served.aliases):
            raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {self.served.name!r}",
                           "model", "not_found_error")


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


class Job:
    """One HTTP request: its engine requests (one per prompt), the queue their updates arrive on, the answer."""

    def __init__(self, api: Api, route: str, req: SamplingFields, body: dict, prompts: list[dict[str, Any]],
                 sampling: dict[str, Any], fill_max_tokens: bool):
        self.api, self.route, self.req, self.body = api, route, req, body
        self.chat = route.endswith("chat/completions")
        self.prompts, self.sampling, self.fill_max_tokens = prompts, sampling, fill_max_tokens
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.request_ids: list[str] = []
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.outputs: dict[str, Any] = {}
        self.samples: dict[tuple[str, int], list] = {}  # (request id, sample index) -> trace rows, in order
        self.prompt_logprobs: list[list | None] = []

    @classmethod
    def build(cls, api: Api, route: str, req: SamplingFields, body: dict) -> "Job":
        try:
            if isinstance(req, ChatCompletionRequest):
                prompts = [{"messages": [m.plain() for m in req.messages]}]
                if not req.messages:
                    raise FieldError("messages", "messages must not be empty")
                max_tokens, logprobs = req.max_new_tokens(), req.num_logprobs()
            else:
                if req.best_of is not None and req.best_of != req.n:
                    raise FieldError("best_of", "best_of other than n is not supported (every sample is returned)")
                prompts, max_tokens, logprobs = req.prompts(), req.max_tokens, req.logprobs
                if req.echo and req.stream and logprobs is not None:
                    raise FieldError("echo", "echo with logprobs is not supported when streaming")
            sampling = req.sampling(max_tokens, logprobs)
        except FieldError as exc:
            raise ApiError(400, str(exc), exc.param) from None
        return cls(api, route, req, body, prompts, sampling, fill_max_tokens=max_tokens is None)

    # ------------------------------------------------------------------ submitting

    def _sink(self) -> Callable[[Update], None]:
        loop = asyncio.get_running_loop()
        queue = self.queue
        return lambda update: loop.call_soon_threadsafe(queue.put_nowait, update)

    async def submit(self) -> None:
        sink = self._sink()
        score = self.req.logprobs if not self.chat and self.req.echo else None
        submissions = []
        for i, prompt in enumerate(self.prompts):
            kwargs = {**prompt, "sampling_params": self.sampling, "request_id": f"{self.id}-{i}"}
            submissions.append(Submission(kwargs, self.body, sink, self.fill_max_tokens, prompt_logprobs=score))
        futures = [self.api.loop.submit(sub) for sub in submissions]
        failed = None
        for fut in futures:
            try:
                self.request_ids.append(await asyncio.wrap_future(fut))
            except RequestError as exc:
                failed = failed or exc
        if failed is not None:
            self.abort()
            raise request_error(failed, self.req)
        self.prompt_logprobs = [sub.prompt_scores for sub in submissions]

    def abort(self) -> None:
        for request_id in self.request_ids:
            if request_id not in self.outputs:
                self.api.loop.abort(request_id)

    # ------------------------------------------------------------------ collecting

    def _take(self, update: Update) -> None:
        if update.error is not None:
            raise ApiError(500, update.error, None, "internal_error")
        for s in update.samples:
            self.samples.setdefault((s.request_id, s.stream), []).append(s)
        if update.output is not None:
            self.outputs[update.request_id] = update.output

    @property
    def done(self) -> bool:
        return len(self.outputs) == len(self.request_ids)

    async def complete(self, request: Request) -> Response:
        left = asyncio.ensure_future(_disconnected(request))
        try:
            while not self.done:
                got = asyncio.ensure_future(self.queue.get())
                finished, _ = await asyncio.wait({got, left}, return_when=asyncio.FIRST_COMPLETED)
                if got not in finished:
                    got.cancel()
                    self.abort()  # the client left: free its blocks
                    return Response(status_code=499)
                self._take(got.result())
        except ApiError as exc:
            return exc.response()
        finally:
            left.cancel()
        return JSONResponse(self.response())

    def _choice_index(self, request_id: str, sample: int) -> int:
        return self.request_ids.index(request_id) * self.req.n + sample

    def usage(self) -> dict[str, int]:
        prompt = sum(len(o.prompt_token_ids) for o in self.outputs.values())
        completion = sum(len(c.token_ids) for o in self.outputs.values() for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def response(self) -> dict[str, Any]:
        choices = []
        for request_id in self.request_ids:
            out = self.outputs[request_id]
            for c in out.outputs:
                rows = self.samples.get((request_id, c.index), [])
                index = self._choice_index(request_id, c.index)
                if self.chat:
                    choices.append({"index": index, "message": {"role": "assistant", "content": c.text},
                                    "logprobs": self._chat_logprobs(rows), "finish_reason": c.finish_reason,
                                    "stop_reason": c.stop_reason})
                else:
                    text, logprobs = c.text, self._completion_logprobs(rows, 0)
                    if self.req.echo:
                        text = (out.prompt or "") + text
                        if logprobs is not None and self.prompt_logprobs:
                            logprobs = self._echo_logprobs(self.request_ids.index(request_id), rows)
                    choices.append({"index": index, "text": text, "logprobs": logprobs,
                                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        choices.sort(key=lambda c: c["index"])
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.api.served.name, "choices": choices, "usage": self.usage(),
                "system_fingerprint": self.api.loop.run_id}

    # ------------------------------------------------------------------ logprobs

    def _top(self, row) -> list[tuple[int, float]]:
        return list(row.top_raw) if self.sampling.get("logprobs") else []

    def _chat_logprobs(self, rows) -> dict | None:
        if self.sampling.get("logprobs") is None:
            return None
        tok = self.api.tokenizer

        spelled = tok.token_bytes(self.api.loop.engine.loaded.arch.vocab_size) if tok is not None else None

        def entry(token_id: int, logprob: float) -> dict:  # bytes: what the token spells, whole or not
            text = token_text(tok, token_id)
            return {"token": text, "logprob": logprob,
                    "bytes": list(spelled[token_id]) if spelled is not None else list(text.encode())}

        return {"content": [{**entry(r.token_id, r.raw_logprob),
                             "top_logprobs": [entry(t, lp) for t, lp in self._top(r)]}
                            for r in rows if r.token_id >= 0], "refusal": None}

    def _completion_logprobs(self, rows, offset: int) -> dict | None:
        if self.sampling.get("logprobs") is None:
            return None
        tok = self.api.tokenizer
        tokens, logprobs, tops, offsets = [], [], [], []
        for r in rows:
            if r.token_id < 0:
                continue
            text = token_text(tok, r.token_id)
            offsets.append(offset)
            offset += len(text)
            tokens.append(text)
            logprobs.append(r.raw_logprob)
            tops.append({token_text(tok, t): lp for t, lp in self._top(r)})
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _echo_logprobs(self, prompt_index: int, rows) -> dict:
        tok = self.api.tokenizer
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        prompt = self.prompt_logprobs[prompt_index] or []
        ids = self.outputs[self.request_ids[prompt_index]].prompt_token_ids
        for pos, token_id in enumerate(ids):
            text = token_text(tok, token_id)
            entry = prompt[pos] if pos < len(prompt) else None
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            out["token_logprobs"].append(None if entry is None else entry[1])
            out["top_logprobs"].append(None if entry is None else {token_text(tok, t): lp for t, lp in entry[2]})
        generated = self._completion_logprobs(rows, offset)
        for key in out:
            out[key] += generated[key]
        return out

    # ------------------------------------------------------------------ streaming

    async def stream(self) -> AsyncIterator[bytes]:
        """SSE chunks as the engine steps; `data: [DONE]` last. A client that leaves aborts its requests."""
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        continuous = bool(self.req.stream_options and self.req.stream_options.continuous_usage_stats)
        sent_tokens = 0
        try:
            if self.chat:
                for request_id in self.request_ids:
                    for i in range(self.req.n):
                        yield self._event([{"index": self._choice_index(request_id, i),
                                            "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                            "finish_reason": None}])
            elif self.req.echo:
                for request_id, prompt in zip(self.request_ids, self.prompts):
                    text = _prompt_text(self.api.tokenizer, prompt)
                    for i in range(self.req.n):
                        yield self._event([{"index": self._choice_index(request_id, i), "text": text,
                                            "logprobs": None, "finish_reason": None}])
            while not self.done:
                update = await self.queue.get()
                self._take(update)
                rows_by_sample: dict[int, list] = {}
                for s in update.samples:
                    rows_by_sample.setdefault(s.stream, []).append(s)
                choices = []
                for d in update.deltas:
                    rows = rows_by_sample.get(d.index, [])
                    sent_tokens += len(d.token_ids)
                    if not d.text and not d.finished and not rows:
                        continue
                    index = self._choice_index(d.request_id, d.index)
                    finish = d.finish_reason if d.finished else None
                    if self.chat:
                        choices.append({"index": index, "delta": {"content": d.text} if d.text else {},
                                        "logprobs": self._chat_logprobs(rows), "finish_reason": finish})
                    else:
                        choices.append({"index": index, "text": d.text, "logprobs": self._completion_logprobs(rows, 0),
                                        "finish_reason": finish})
                if choices:
                    usage = self._running_usage(sent_tokens) if continuous else None
                    yield self._event(choices, usage)
            if include_usage:
                yield self._event([], self.usage())
            yield format_sse_event(data_str="[DONE]")
        except ApiError as exc:
            yield format_sse_event(data_str=json.dumps({"error": {"message": exc.message, "type": exc.kind,
                                                                  "param": exc.param, "code": None}}))
        finally:
            self.abort()  # no-op for finished requests; frees the blocks of a client that left

    def _running_usage(self, completion: int) -> dict[str, int]:
        prompt = sum(len(o.prompt_token_ids) for o in self.outputs.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _event(self, choices: list[dict], usage: dict | None = None) -> bytes:
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.api.served.name, "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        return format_sse_event(data_str=json.dumps(chunk))


def _prompt_text(tokenizer, prompt: dict[str, Any]) -> str:
    if prompt.get("prompt") is not None:
        return prompt["prompt"]
    return tokenizer.decode(prompt["prompt_token_ids"], skip_special_tokens=False) if tokenizer else ""


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read already, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
