"""A server shutting down while requests are still being prepared (a grammar compiling, prompts tokenized, echoed
prompts scored), over real HTTP on loopback (tiny model), as mode=serve runs it: uvicorn's server whose first exit
signal aborts every request (toolkit.serve.connections.AbortingServer). Each request being prepared is answered at
once in OpenAI's shape (503, as the requests a stopping server refuses), its work stops, and no handler is left for
uvicorn to cancel (a plain-text 500 and a traceback each, and a process that took 90 s to exit behind a scoring)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import make_engine
from toolkit.sampling.params import SamplingParams
from toolkit.serve.connections import AbortingServer
from toolkit.serve.main import _uvicorn_config, build, serve_config

pytestmark = pytest.mark.native

GRACE_S = 8  # serve.timeout_graceful_shutdown here: what uvicorn gave a handler before cancelling it (a 500)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record) + (f"\n{record.exc_info[0].__name__}" if record.exc_info else ""))


def test_a_shutdown_answers_the_requests_being_prepared_at_once_and_stops_their_work(tiny):
    engine = make_engine(tiny, sampling=SamplingParams())
    release, started = threading.Event(), {"compile": threading.Event(), "score": threading.Event()}
    score_stopped = threading.Event()
    precompile, score = engine.precompile, engine.prompt_logprobs

    def compiling(sampling, cached_only=False, compile_with=None):  # a grammar whose compile takes long (a hostile
        if "structured_outputs" not in sampling:  # schema's does)
            return precompile(sampling, cached_only, compile_with)
        if cached_only:
            return False  # never compiled yet: the compile below runs
        started["compile"].set()
        release.wait(60)
        return precompile(sampling, cached_only, compile_with)

    def scoring(ids, k, stop=None):  # prompts whose scoring takes long: it ends once told to stop
        started["score"].set()
        deadline = time.monotonic() + 60
        while not (stop is not None and stop()) and time.monotonic() < deadline:
            time.sleep(0.01)
        score_stopped.set()
        return None if stop is not None and stop() else score(ids, k, stop)

    engine.precompile, engine.prompt_logprobs = compiling, scoring
    section = serve_config({"serve": {"port": 0, "timeout_graceful_shutdown": GRACE_S}})
    loop, app = build(engine, None, None, section)
    server = AbortingServer(_uvicorn_config(app, "127.0.0.1", 0, section), on_exit=lambda: loop.abort(None))
    records = _Records()
    logging.getLogger("uvicorn.error").addHandler(records)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    pool = ThreadPoolExecutor(3)
    try:
        deadline = time.time() + 60
        while not server.started:
            assert thread.is_alive() and time.time() < deadline
            time.sleep(0.02)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        bodies = [
            (
                "chat/completions",
                {
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 4,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
                },
            ),
            ("completions", {"prompt": [[5] * 40] * 3, "echo": True, "logprobs": 1, "max_tokens": 1}),
        ]
        answers = [pool.submit(httpx.post, f"{url}/{route}", json=body, timeout=60) for route, body in bodies]
        assert started["compile"].wait(30) and started["score"].wait(30)
        t0 = time.monotonic()
        server.handle_exit(signal.SIGINT, None)  # what the first SIGINT runs (uvicorn's signal handler)
        for answer in answers:
            r = answer.result(30)
            assert r.status_code == 503, r.text
            assert r.headers["content-type"].startswith("application/json") and int(r.headers["retry-after"]) >= 1
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["message"] == "the server is shutting down", error
        assert time.monotonic() - t0 < GRACE_S / 2  # answered, not cancelled by uvicorn past its grace
        assert score_stopped.wait(5), "the scoring went on after the shutdown began"
        thread.join(GRACE_S / 2)
        assert not thread.is_alive(), "the server did not exit promptly"
        logged = "\n".join(records.lines)
        assert "Exception in ASGI application" not in logged and "Cancel" not in logged, logged
        assert "CancelledError" not in logged and "Traceback" not in logged, logged
    finally:
        release.set()
        logging.getLogger("uvicorn.error").removeHandler(records)
        pool.shutdown(wait=False, cancel_futures=True)
        server.should_exit = True
        thread.join(30)
        loop.stop()


def test_a_handler_uvicorn_cancels_while_its_request_is_prepared_answers_503(tiny):
    """A server stopped without the first signal's abort (start_server's stop(), as tests and notebooks stop it)
    has uvicorn cancel the handlers still open past timeout_graceful_shutdown: one whose request is being prepared
    (its grammar compiling) answers the 503 of a stopping server, not a plain-text 500 and a traceback."""
    from toolkit.serve.main import start_server

    engine = make_engine(tiny, sampling=SamplingParams())
    release, entered = threading.Event(), threading.Event()
    precompile = engine.precompile

    def compiling(sampling, cached_only=False, compile_with=None):
        if "structured_outputs" not in sampling:
            return precompile(sampling, cached_only, compile_with)
        if cached_only:
            return False  # never compiled yet: the compile below runs
        entered.set()
        release.wait(60)
        return precompile(sampling, cached_only, compile_with)

    engine.precompile = compiling
    srv = start_server(engine, None, timeout_graceful_shutdown=1)
    records = _Records()
    logging.getLogger("uvicorn.error").addHandler(records)
    pool = ThreadPoolExecutor(1)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "response_format": {"type": "json_object"}}
    try:
        answer = pool.submit(httpx.post, srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert entered.wait(30)
        stopping = threading.Thread(target=srv.stop)
        stopping.start()
        r = answer.result(30)
        assert r.status_code == 503 and r.json()["error"]["message"] == "the server is shutting down", r.text
        stopping.join(30)
        logged = "\n".join(records.lines)
        assert "Exception in ASGI application" not in logged and "CancelledError" not in logged, logged
    finally:
        release.set()
        logging.getLogger("uvicorn.error").removeHandler(records)
        pool.shutdown(wait=False, cancel_futures=True)


def test_after_the_first_signal_a_new_request_is_refused_before_any_work(tiny):
    """The first signal's abort (EngineLoop.abort(None)) begins the shutdown: a request that still reaches the
    server (a kept-alive connection's) is a 503 before any work, not admitted to run until uvicorn cancels it."""
    from toolkit.serve.main import start_server

    srv = start_server(make_engine(tiny, sampling=SamplingParams()), None)
    try:
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
        srv.loop.abort(None)  # what AbortingServer's first signal runs
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["message"] == "the server is shutting down", r.text
    finally:
        srv.stop()


def test_a_compile_the_environment_fails_is_a_503_not_the_clients_schema(tiny):
    """A grammar compile that fails for want of a resource (xgrammar's threads at shutdown: EAGAIN, "Resource
    temporarily unavailable", once told the client its schema was invalid) is a 503 + Retry-After naming no field;
    a schema xgrammar refuses is still the client's 400."""
    from toolkit.errors import ResourceError
    from toolkit.serve.main import start_server

    engine = make_engine(tiny, sampling=SamplingParams())
    precompile = engine.precompile

    def failing(sampling, cached_only=False, compile_with=None):
        if "structured_outputs" not in sampling:
            return precompile(sampling, cached_only, compile_with)
        if cached_only:
            return False
        if sampling["structured_outputs"]["json"].get("title") == "eagain":
            # as toolkit.sampling.grammar classifies xgrammar's EAGAIN (tests/test_grammar.py)
            raise ResourceError("compiling structured_outputs.json failed: Resource temporarily unavailable")
        return precompile(sampling, cached_only, compile_with)

    engine.precompile = failing
    srv = start_server(engine, None)

    def chat(schema: dict) -> httpx.Response:
        body = {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        }
        return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)

    try:
        r = chat({"type": "object", "title": "eagain"})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        error = r.json()["error"]
        assert error["param"] is None and "Resource temporarily unavailable" in error["message"], error
        assert "retry later" in error["message"], error
        r = chat({"type": "nonsense"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema", r.text
    finally:
        srv.stop()
