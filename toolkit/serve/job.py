"""One HTTP request's generation: its submissions to the engine loop, the updates it collects (in its mailbox,
toolkit.serve.mailbox), and the response or SSE stream it writes from them."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import replace
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response
from fastapi.sse import format_sse_event

from toolkit.engine.request import EngineRequest
from toolkit.errors import RequestError, ResourceError, ToolkitError, one_line
from toolkit.runs.recorder import RecordedBody
from toolkit.serve.grammars import GrammarCompiler
from toolkit.serve.limits import Limits
from toolkit.serve.logprobs import LogprobFormat
from toolkit.serve.loop import Closing, EngineLoop, InternalError, LoopSink, Submission, Unavailable, Update
from toolkit.serve.mailbox import Mailbox, update_bytes
from toolkit.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    FieldError,
    SamplingFields,
    ServedModel,
    request_error,
)
from toolkit.serve.scoring import Scorer


def unavailable(exc: Unavailable) -> ApiError:
    """A 503 (the loop's queue is full) or 507 (its trace cannot be written) with Retry-After."""
    return ApiError(exc.status, str(exc), None, exc.code, exc.code, {"Retry-After": str(exc.retry_after_s)})


class JobHost(Protocol):
    """What a Job reads of the API that made it (toolkit.serve.api.Api is one)."""

    loop: EngineLoop
    served: ServedModel
    limits: Limits
    tokenizer: Any
    compiler: GrammarCompiler
    scoring: Scorer  # echoed requests' prompts scored one request at a time


def prompt_only(req: SamplingFields) -> bool:
    """Echo with max_tokens 0 (OpenAI's legacy scoring): the prompt alone is answered, with its logprobs."""
    return not isinstance(req, ChatCompletionRequest) and bool(req.echo) and req.max_tokens == 0


def response_too_large(limit_mb: float) -> ApiError:
    """An answer not streamed that grew past serve.max_response_mb: a 400 saying how to ask for it."""
    return ApiError(
        400,
        f"the answer grew past {limit_mb:g} MB before it was whole (serve.max_response_mb): ask for it with "
        f"stream: true, or for fewer tokens, samples or logprobs",
        None,
        "invalid_request_error",
        "response_too_large",
    )


def shutting_down() -> ApiError:
    """A request the server will not answer because it is shutting down (the loop refuses new ones so too)."""
    return unavailable(Unavailable("the server is shutting down"))


def preparation_error(exc: Exception, req: SamplingFields, timeout_s: float) -> ApiError:
    """What a request's preparation raised, as its answer: a grammar past serve.grammar_timeout_s (its compiling
    child killed) or refused a 400, a full loop a 503, the unexpected a 500; a
    compile failing for want of threads or memory (EAGAIN) a 503, never the client's schema's fault."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, FieldError):
        return ApiError(400, str(exc), exc.param)
    if isinstance(exc, TimeoutError):
        return ApiError(
            400,
            f"response_format: compiling its grammar took longer than this server allows "
            f"(serve.grammar_timeout_s={timeout_s:g})",
            "response_format",
        )
    if isinstance(exc, Unavailable):
        return unavailable(exc)
    if isinstance(exc, ResourceError):  # toolkit.sampling.grammar: the machine was short, not the schema wrong
        return unavailable(Unavailable(f"the server could not prepare this request now ({one_line(exc)}); retry later"))
    if isinstance(exc, ToolkitError):
        return request_error(exc, req)
    return ApiError(500, f"preparing the request failed: {one_line(exc)}", None, "internal_error")


class Job:
    """One HTTP request: its engine requests (one per prompt), the queue their updates arrive on, the answer."""

    def __init__(
        self,
        api: JobHost,
        route: str,
        req: SamplingFields,
        body: RecordedBody,
        prompts: list[dict[str, Any]],
        sampling: dict[str, Any],
    ):
        self.api, self.route, self.req, self.body = api, route, req, body
        self.chat = route.endswith("chat/completions")
        self.prompt_only = prompt_only(req)
        self.prompts, self.sampling = prompts, sampling
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.request_ids: list[str] = []
        self.body_sha256 = body.sha256
        self.queue = Mailbox(max_bytes=int(api.limits.max_unread_mb * 2**20), on_overflow=self.abort)
        self.outputs: dict[str, Any] = {}
        self.samples: dict[tuple[str, int], list] = {}  # (request id, sample index) -> trace rows, in order
        self.held_bytes = 0  # what an answer not streamed holds so far (update_bytes)
        self.prompt_logprobs: list[list | None] = []
        self.cancel = threading.Event()  # set once its client left or the server is shutting down: preparing, stop
        self.logprobs = LogprobFormat(api.tokenizer, api.loop.engine.loaded.arch.vocab_size, sampling.get("logprobs"))

    @classmethod
    def build(cls, api: JobHost, route: str, req: SamplingFields, body: RecordedBody) -> Job:
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
                max_tokens = 1 if prompt_only(req) else max_tokens  # one token sampled (and traced), as vLLM
                if req.echo and req.stream and logprobs is not None:
                    raise FieldError("echo", "echo with logprobs is not supported when streaming")
            if req.stream_options is not None and not req.stream:
                raise FieldError("stream_options", "stream_options can only be set when stream is true")
            api.limits.check(req, len(prompts))
            sampling = req.sampling(max_tokens, logprobs)
        except FieldError as exc:
            raise ApiError(400, str(exc), exc.param) from None
        return cls(api, route, req, body, prompts, sampling)

    # ------------------------------------------------------------------ submitting

    async def submit(self, request: Request | None = None) -> None:
        """Admit (503 when the loop is full, before any work; places held until the hand-over), prepare off the
        engine thread (_prepared; ended when `request`'s client leaves or a shutdown begins), then hand the engine
        requests to the loop, all or none: 400 for what the engine refuses, 503 when it is full, 500 when it failed."""
        held = len(self.prompts)
        try:
            self.api.loop.check_capacity(held)
        except Unavailable as exc:
            raise unavailable(exc) from None
        try:
            scores = await _until_ended(self._prepared(), request, self.api.loop.closing, self.cancel)
            sink = LoopSink(asyncio.get_running_loop(), self.queue.put)
            # prompt i at priority i: under scheduling_policy=priority (a server's default) a request's many prompts
            # take turns with other requests' (toolkit/engine/scheduler.py)
            submissions = [
                Submission(
                    EngineRequest(**prompt, sampling_params=self.sampling, request_id=f"{self.id}-{i}", priority=i),
                    self.body if i == 0 else self.body.digest_only(),  # the body on one row (RecordedBody)
                    sink,
                    route=self.route,
                )
                for i, prompt in enumerate(self.prompts)
            ]
        except BaseException:  # an error's answer, or the client gone (cancelled): the places are free again
            self.api.loop.release(held)
            raise
        try:
            futures = self.api.loop.submit(submissions, held)
        except Unavailable as exc:
            raise unavailable(exc) from None
        failed = None
        for fut in futures:
            try:
                self.request_ids.append(await asyncio.wrap_future(fut))
            except (RequestError, InternalError, Unavailable) as exc:
                failed = failed or exc
        if failed is not None:
            self.abort()
            if isinstance(failed, Unavailable):
                raise unavailable(failed)
            if isinstance(failed, InternalError):
                raise ApiError(500, str(failed), None, "internal_error")
            raise request_error(failed, self.req)
        self.prompt_logprobs = scores

    async def _prepared(self) -> list:
        """The grammar compiled (within serve.grammar_timeout_s), the prompts tokenized and checked against the
        context on a thread (the engine thread tokenizes nothing; the tokenizer lets the GIL go), and, for echo
        with logprobs, counted (serve.max_scored_tokens) and scored on a thread, one request's at a time (as the
        engine runs one forward at a time): per prompt its scores or None. Its threads stop once self.cancel is set."""
        try:
            await self.api.compiler.compile(self.sampling, self.api.limits.grammar_timeout_s)
            self.prompts = await asyncio.to_thread(self._tokenized)
            if self.chat or not self.req.echo or self.req.logprobs is None:
                return [None] * len(self.prompts)
            self.api.limits.check_scored(sum(len(p["prompt_token_ids"]) for p in self.prompts))
            return await self.api.scoring.score(self._scored)
        except Exception as exc:  # noqa: BLE001 - every failure is this request's answer (preparation_error)
            raise preparation_error(exc, self.req, self.api.limits.grammar_timeout_s) from None

    def _tokenized(self) -> list[dict[str, Any]]:  # each prompt's ids beside its text: what the engine adds as it is
        requests = [
            self.api.loop.prepare.tokenized(EngineRequest(**p)) for p in self.prompts if not self.cancel.is_set()
        ]
        return [{"prompt": r.prompt, "prompt_token_ids": r.prompt_token_ids} for r in requests]

    def _scored(self) -> list:  # echo with logprobs: per prompt toolkit.engine.runner.prompt_logprobs' rows
        prepare, stop, k = self.api.loop.prepare, self.cancel.is_set, self.req.logprobs
        return [prepare.prompt_logprobs(EngineRequest(**prompt), k, stop) for prompt in self.prompts if not stop()]

    def abort(self) -> None:
        for request_id in self.request_ids:
            if request_id not in self.outputs:
                self.api.loop.abort(request_id)

    # ------------------------------------------------------------------ collecting

    def _take(self, update: Update, keep_rows: bool | None) -> None:
        """An update's output kept; its trace rows too where `keep_rows` (an answer not streamed, with logprobs:
        a stream, `None`, sends each row as it comes, an answer without logprobs reads none: neither holds them)."""
        if update.error is not None and self.queue.overflowed:  # the slow client's doing (a 408's kind)
            raise ApiError(408, update.error, None, "invalid_request_error", "client_too_slow")
        if update.error is not None:
            raise ApiError(500, update.error, None, "internal_error")
        for s in update.samples if keep_rows else ():
            self.samples.setdefault((s.request_id, s.stream), []).append(s)
        if keep_rows is not None:  # an answer held whole: what it holds is bounded (serve.max_response_mb)
            self.held_bytes += update_bytes(update, keep_rows)
            if self.held_bytes > self.api.limits.max_response_mb * 2**20:
                self.abort()
                raise response_too_large(self.api.limits.max_response_mb)
        if update.output is not None:
            self.outputs[update.request_id] = update.output

    @property
    def done(self) -> bool:
        return len(self.outputs) == len(self.request_ids)

    async def spelled(self) -> None:
        """A chat's logprobs carry each token's bytes (Tokenizer.token_bytes): the table is built off the event
        loop, where its first build (seconds) held every stream (4.6 s)."""
        if self.chat and self.logprobs.wanted is not None and self.api.tokenizer is not None:
            await asyncio.to_thread(self.api.tokenizer.token_bytes, self.logprobs.vocab_size)

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
                self._take(got.result(), keep_rows=self.logprobs.wanted is not None)
        except ApiError as exc:
            return exc.response()
        finally:
            left.cancel()
        # built and made JSON on a thread, a choice at a time: 64 choices of 200 tokens with 20 logprobs each held
        # the event loop, and every stream, 2.3 s
        return Response(await asyncio.to_thread(answer_bytes, self), media_type="application/json")

    def choice_index(self, request_id: str, sample: int) -> int:
        return self.request_ids.index(request_id) * self.req.n + sample

    def usage(self, completion: int | None = None) -> dict[str, int]:
        """Tokens so far: the prompts' and `completion` (None: every output's)."""
        prompt = sum(len(p.get("prompt_token_ids") or ()) for p in self.prompts)  # tokenized before submission
        if self.prompt_only:  # (its one sampled token is not answered)
            completion = 0
        elif completion is None:
            completion = sum(len(c.token_ids) for o in self.outputs.values() for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ------------------------------------------------------------------ streaming

    async def stream(self) -> AsyncIterator[bytes]:
        """SSE chunks as the engine steps; `data: [DONE]` last, after an error's event too. A client that leaves aborts
        its requests."""
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        continuous = bool(self.req.stream_options and self.req.stream_options.continuous_usage_stats)
        sent_tokens = 0
        try:
            if self.chat:
                for request_id in self.request_ids:
                    for i in range(self.req.n):
                        yield self._event(
                            [
                                {
                                    "index": self.choice_index(request_id, i),
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ]
                        )
            elif self.req.echo:
                for request_id, prompt in zip(self.request_ids, self.prompts):
                    text = _prompt_text(self.api.tokenizer, prompt)
                    for i in range(self.req.n):
                        yield self._event(
                            [
                                {
                                    "index": self.choice_index(request_id, i),
                                    "text": text,
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ]
                        )
            while not self.done:
                update = await self.queue.get()
                self._take(update, keep_rows=None)
                rows_by_sample: dict[int, list] = {}
                for s in () if self.prompt_only else update.samples:
                    rows_by_sample.setdefault(s.stream, []).append(s)
                choices = []
                for d in update.deltas:
                    d = replace(d, text="") if self.prompt_only else d  # the prompt, echoed, is the answer
                    rows = rows_by_sample.get(d.index, [])
                    sent_tokens += len(d.token_ids)
                    if not d.text and not d.finished and not rows:
                        continue
                    index = self.choice_index(d.request_id, d.index)
                    finish = ("length" if self.prompt_only else d.finish_reason) if d.finished else None
                    if self.chat:
                        choice = {
                            "index": index,
                            "delta": {"content": d.text} if d.text else {},
                            "logprobs": self.logprobs.chat(rows),
                            "finish_reason": finish,
                        }
                    else:
                        choice = {
                            "index": index,
                            "text": d.text,
                            "logprobs": self.logprobs.completion(rows),
                            "finish_reason": finish,
                        }
                    if finish == "error":  # why, as the answer without streaming has it (its trace row's reason)
                        choice["stop_reason"] = rows[-1].stop_reason if rows else None
                    choices.append(choice)
                if choices:
                    usage = self.usage(sent_tokens) if continuous else None
                    yield self._event(choices, usage)
            if include_usage:
                yield self._event([], self.usage())
            yield format_sse_event(data_str="[DONE]")
        except ApiError as exc:  # the error as an event, then the end every stream has (as vLLM's streams do)
            yield format_sse_event(data_str=json.dumps(exc.body()))
            yield format_sse_event(data_str="[DONE]")
        finally:
            self.abort()  # no-op for finished requests; frees the blocks of a client that left

    def _event(self, choices: list[dict], usage: dict | None = None) -> bytes:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.api.served.name,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return format_sse_event(data_str=json.dumps(chunk))


def answer(job: Job) -> dict[str, Any]:
    """A whole (not streamed) answer of `job`'s, in OpenAI's shape."""
    choices = []
    for request_id in job.request_ids:
        out = job.outputs[request_id]
        for c in out.outputs:
            rows = [] if job.prompt_only else job.samples.get((request_id, c.index), [])
            choice = {"index": job.choice_index(request_id, c.index)}
            if job.chat:
                choice |= {
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": job.logprobs.chat(rows),
                }
            else:
                text, logprobs = "" if job.prompt_only else c.text, job.logprobs.completion(rows)
                if job.req.echo:
                    text = (out.prompt or "") + text
                    if logprobs is not None and job.prompt_logprobs:
                        i = job.request_ids.index(request_id)
                        logprobs = job.logprobs.echo(out.prompt_token_ids, job.prompt_logprobs[i], rows)
                choice |= {"text": text, "logprobs": logprobs}
            ended = ("length", None) if job.prompt_only else (c.finish_reason, c.stop_reason)  # (whatever it sampled)
            choices.append(choice | {"finish_reason": ended[0], "stop_reason": ended[1]})
    choices.sort(key=lambda c: c["index"])
    return {
        "id": job.id,
        "object": "chat.completion" if job.chat else "text_completion",
        "created": job.created,
        "model": job.api.served.name,
        "choices": choices,
        "usage": job.usage(),
        "system_fingerprint": job.api.loop.run_id,
    }


def answer_bytes(job: Job) -> bytes:
    """answer(job) as starlette's JSONResponse writes it, its choices made JSON one at a time (each a call that
    holds the GIL, the event loop's thread running between them)."""
    content = answer(job)

    def dumps(value: Any) -> bytes:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()

    head = dumps({**content, "choices": []})
    at = head.index(b'"choices":[]') + len(b'"choices":[')  # a key: within a string its quotes would be escaped
    return head[:at] + b",".join(dumps(choice) for choice in content["choices"]) + head[at:]


def _prompt_text(tokenizer, prompt: dict[str, Any]) -> str:
    if prompt.get("prompt") is not None:
        return prompt["prompt"]
    return tokenizer.decode(prompt["prompt_token_ids"], skip_special_tokens=False) if tokenizer else ""


async def _until_ended(work: Coroutine[Any, Any, list], request: Request | None, closing: Closing, cancel) -> list:
    """`work` (a request's preparation), ended at once (`cancel`, a threading.Event, set: its threads stop; a
    compile is left to finish and be cached) when the client leaves (a 499 nobody reads) or the server begins
    shutting down (a 503 to each, as to the requests it then refuses; a handler uvicorn cancels past
    serve.timeout_graceful_shutdown is answered so too): a shutdown never waits for, nor tracebacks on, it."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future = loop.create_future()

    def end(answer: ApiError) -> None:  # on the event loop's thread
        cancel.set()
        if not ended.done():
            ended.set_result(answer)

    def shutdown() -> None:  # on the thread that begins the shutdown (a signal handler's: no lock)
        try:
            loop.call_soon_threadsafe(end, shutting_down())
        except RuntimeError:  # the event loop is closed: nobody waits
            pass

    def gone(left: asyncio.Future) -> None:
        if not left.cancelled():
            left.exception()  # read (a receive that failed: the connection is gone too)
            end(ApiError(499, "the client closed the connection before its answer was ready"))

    left = asyncio.ensure_future(_disconnected(request)) if request is not None else loop.create_future()
    left.add_done_callback(gone)
    closing.add(shutdown)
    if closing.begun:
        shutdown()
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, ended}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # uvicorn's graceful shutdown gave up on this handler: answered as one
        asyncio.current_task().uncancel()
        end(shutting_down())
    finally:
        closing.discard(shutdown)
        left.cancel()
    if ended.done():
        task.cancel()
        if task.done() and not task.cancelled():
            task.exception()  # read: its answer is no longer anyone's
        raise ended.result()
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read already, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
