"""Hostile requests against a live server (tiny model, real HTTP on loopback): each is refused before it costs
the server anything, with a 4xx in OpenAI's error shape naming the field, and the server keeps serving."""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx
import pytest
import tokenizers
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.conftest import make_engine, once
from toolkit.models.tokenizer import _max_token_chars
from toolkit.sampling.params import SamplingParams
from toolkit.serve import api as api_module
from toolkit.serve.grammars import GrammarCompiler
from toolkit.serve.loop import Unavailable, handoff_wait_for
from toolkit.serve.main import serve_config, start_server
from toolkit.serve.protocol import ChatCompletionRequest, CompletionRequest
from toolkit.serve.shapes import json_shape, pattern_cost, schema_pattern_cost, schema_patterns, schema_text

pytestmark = pytest.mark.native


def nested_schema(depth: int) -> dict:
    """An object schema whose property holds an object `depth` levels down (xgrammar's compile time grows about
    cubically with it: 0.05 / 0.43 / 4.35 s at 50 / 100 / 200, issue 58)."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def schema_chat(schema: dict, **fields) -> dict:
    """A chat body whose response_format asks for `schema`."""
    return {
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        **fields,
    }


def post_chat(url: str, schema: dict, timeout: float = 60) -> httpx.Response:
    """`schema_chat(schema)` for two tokens, posted to the server at `url`."""
    return httpx.post(f"{url}/v1/chat/completions", json=schema_chat(schema, max_tokens=2), timeout=timeout)


@pytest.fixture(scope="module")
def server(tiny):
    srv = start_server(make_engine(tiny, sampling=SamplingParams(), max_num_seqs=4), None)
    yield srv
    srv.stop()


def long_enum(chars: int, salt: str = "") -> dict:
    """A string schema of two enum values `chars` long that share all but their last character: xgrammar's compile
    of such alternatives grows with the square of their length (5,000: about 2 s; 8,000: 5.6 s; 40,000: minutes)."""
    return {"type": "string", "enum": [salt + "x" * (chars - len(salt) - 1) + end for end in "ab"]}


def refused(r: httpx.Response, status: int, param: str | None) -> dict:
    """The OpenAI error shape, with this status and param; returns the error."""
    assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert "\n" not in error["message"] and "Traceback" not in error["message"]
    return error


HOSTILE = {  # name -> (route, body, status, param, what the message says)
    "a million bad messages": (
        "chat/completions",
        b'{"messages": [' + b",".join([b"0"] * 1_000_000) + b"]}",
        400,
        "messages.0",
        "valid dictionary",
    ),
    "half a million null prompts": ("completions", {"prompt": [None] * 500_000}, 400, "prompt", "valid string"),
    "a number past a double's range": (
        "completions",
        b'{"prompt": "a", "max_tokens": 2, "repetition_penalty": 1e400}',
        400,
        "repetition_penalty",
        "1e400 is past a double's range",
    ),
    "a bias past OpenAI's range, which removed every allowed token": (
        "completions",
        {"prompt": "a", "max_tokens": 2, "allowed_token_ids": [5], "logit_bias": {"5": -1e300}},
        400,
        "logit_bias",
        "logit_bias: values must be in [-100, 100]",
    ),
    "allowed tokens min_tokens keeps out": (  # each ended at its first step with finish_reason "error"
        "completions",
        {"prompt": "a", "max_tokens": 3, "allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 2},
        400,
        "allowed_token_ids",
        "no token could be sampled",
    ),
    "64 prompts times n": (  # 64 prompts x n=64 were 4,096 sequences, the other clients shut out for minutes
        "completions",
        {"prompt": ["hi"] * 64, "n": 5, "max_tokens": 1},
        400,
        "n",
        "64 prompt(s) with n=5 are 320 sequences, more than this server runs for one request (serve.max_sequences=256)",
    ),
    "300 prompts": (  # past max_sequences too, but the field at fault is the prompt list
        "completions",
        {"prompt": ["hi"] * 300, "max_tokens": 1},
        400,
        "prompt",
        "prompt: 300 entries, more than this server takes (serve.max_prompts=64)",
    ),
    "a model name of 100,000 characters": (  # the 404 repeated it whole (a 7 MB name, a 7 MB answer)
        "completions",
        {"model": "x" * 100_000, "prompt": "a", "max_tokens": 1},
        404,
        "model",
        "the model '" + "x" * 64 + "'... does not exist",
    ),
    "a temperature below a double's range": (  # 1e-400 was read as 0: greedy, where 1e-10 is a 400
        "completions",
        b'{"prompt": "a", "max_tokens": 2, "temperature": 1e-400}',
        400,
        "temperature",
        "1e-400 is below a double's range (it would be read as 0)",
    ),
    "a bias past a double's range": (
        "completions",
        b'{"prompt": "a", "max_tokens": 2, "logit_bias": {"5": -1.5e999}}',
        400,
        "logit_bias.5",
        "-1.5e999 is past a double's range",
    ),
    "a million list stops": ("completions", {"prompt": "a", "stop": [[]] * 1_000_000}, 400, "stop", "valid string"),
    "echo scoring past the context": (
        "completions",
        {"prompt": [1] * 300_000, "echo": True, "logprobs": 1, "max_tokens": 1},
        400,
        "prompt",
        "engine.max_model_len",
    ),
    "echo scoring outside the vocabulary": (
        "completions",
        {"prompt": [1, 2, 10**9], "echo": True, "logprobs": 1, "max_tokens": 1},
        400,
        "prompt",
        "outside the vocabulary",
    ),
    "a pattern of nested bounded repeats (minutes of compile, 60 characters)": (
        "chat/completions",
        schema_chat({"type": "string", "pattern": "h1(([a-z]{1,20}){1,20}){1,20}"}),
        400,
        "response_format.json_schema.schema",
        "too costly (its patterns' repeats) to compile",
    ),
    "60 patterns of 100 positions each": (
        "chat/completions",
        schema_chat(
            {
                "type": "object",
                "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,100}"} for i in range(60)},
            }
        ),
        400,
        "response_format.json_schema.schema",
        "serve.max_schema_pattern_cost=4000",
    ),
    "a schema nested 150 deep": (
        "chat/completions",
        schema_chat(nested_schema(150)),
        400,
        "response_format.json_schema.schema",
        "serve.max_schema_depth=64",
    ),
    "a schema of two enum strings of 10,000 characters": (
        "chat/completions",
        schema_chat(long_enum(10_000)),
        400,
        "response_format.json_schema.schema",
        "too long to compile: 20000 (serve.max_schema_chars=16384)",
    ),
    "a prompt of booleans (once the token ids 1, 0)": (
        "completions",
        {"prompt": [True, False], "max_tokens": 1},
        400,
        "prompt",
        "true / false is not a number here",
    ),
    "max_tokens true (once 1)": (
        "completions",
        {"prompt": "Hi", "max_tokens": True},
        400,
        "max_tokens",
        "true / false",
    ),
    "a message of no content parts (once empty text)": (
        "chat/completions",
        {"messages": [{"role": "user", "content": []}]},
        400,
        "messages.0.content",
        "an empty list of content parts",
    ),
    'seed "1" (once 1)': ("completions", {"prompt": "Hi", "seed": "1"}, 400, "seed", "a string is not a number here"),
    'include_usage "yes" (once true)': (
        "completions",
        {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": "yes"}},
        400,
        "stream_options.include_usage",
        "a string is not true / false here",
    ),
    'a logit bias of "3" (once 3.0)': (
        "completions",
        {"prompt": "Hi", "logit_bias": {"5": "3"}},
        400,
        "logit_bias",
        "a string is not a number here",
    ),
    'strict "yes" (once true)': (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
        },
        400,
        "response_format.json_schema.strict",
        "a string is not true / false here",
    ),
    "a logit bias of true": ("completions", {"prompt": "Hi", "logit_bias": {"5": True}}, 400, "logit_bias", "true"),
    "32 stop strings of 1000 characters": (
        "completions",
        {"prompt": "Hi", "stop": ["x" * 1000] * 32},
        400,
        "stop",
        "serve.max_stop_chars=4096",
    ),
    "bad words of 8000 characters": (
        "completions",
        {"prompt": "Hi", "bad_words": ["y" * 4000] * 2},
        400,
        "bad_words",
        "serve.max_stop_chars=4096",
    ),
    "a user of 100 kB": (
        "completions",
        {"prompt": "Hi", "user": "u" * 100_000},
        400,
        "user",
        "serve.max_user_chars=256",
    ),
    "17 metadata pairs": (
        "completions",
        {"prompt": "Hi", "metadata": {str(i): "v" for i in range(17)}},
        400,
        "metadata",
        "serve.max_metadata=16",
    ),
    "a metadata value of 1000 characters": (
        "completions",
        {"prompt": "Hi", "metadata": {"k": "v" * 1000}},
        400,
        "metadata",
        "values at most 512",
    ),
    # what only Python's JSON parser reads (bytes: posted as they are)
    "a lone surrogate in a chat message": (
        "chat/completions",
        b'{"messages": [{"role": "user", "content": "hi \\ud83d"}]}',
        400,
        "messages.0.content",
        "lone surrogate '\\ud83d' at character 3",
    ),
    "a lone surrogate in a stop string": (
        "completions",
        b'{"prompt": "Hi", "stop": ["ok", "\\udc00x"]}',
        400,
        "stop.1",
        "lone surrogate",
    ),
    "a lone surrogate in a metadata key": (
        "completions",
        b'{"prompt": "Hi", "metadata": {"\\udfff": "v"}}',
        400,
        "metadata.\\udfff",
        "lone surrogate",
    ),
    "a temperature of Infinity": (
        "completions",
        b'{"prompt": "Hi", "temperature": Infinity}',
        400,
        "temperature",
        "Infinity is not a JSON number",
    ),
    "a logit bias of NaN": ("completions", b'{"prompt": "Hi", "logit_bias": {"5": NaN}}', 400, "logit_bias.5", "NaN"),
    "an integer of 5000 digits": (
        "completions",
        b'{"prompt": "Hi", "max_tokens": 1' + b"0" * 5000 + b"}",
        400,
        None,
        "a number of more than 4300 digits",
    ),
    # nested deeper than the trace's body digest encodes (~950), shallower than the parser refuses
    "a json_object format nested 940 deep": (
        "chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object", "x": '
        + b"[" * 940
        + b"]" * 940
        + b"}}",
        400,
        "response_format",
        "nested too deeply (more than 512 levels)",
    ),
    # past the trace's int32 column (the writer failed at the next flush, and the server with it)
    "a top_k of 2^31": ("completions", {"prompt": "Hi", "top_k": 2**31}, 400, "top_k", "up to 2147483647"),
    "a logit bias key with a space": (
        "completions",
        {"prompt": "Hi", "logit_bias": {" 5": 1.0}},
        400,
        "logit_bias",
        "plain decimal digits",
    ),
    "a logit bias key given twice, once with a leading zero": (
        "completions",
        {"prompt": "Hi", "logit_bias": {"5": 1.0, "05": -1.0}},
        400,
        "logit_bias",
        "got '05'",
    ),
    # numbers that overflow a processed logit to +inf (a token no sampler draws)
    "a temperature of 1e-300": (
        "completions",
        {"prompt": "Hi", "temperature": 1e-300},
        400,
        "temperature",
        "0 (greedy) or a number in [1e-05, 1e+05]",
    ),
    "a logit bias of 1e300": (
        "completions",
        {"prompt": "Hi", "logit_bias": {"5": 1e300}},
        400,
        "logit_bias",
        "logit_bias: values must be in [-100, 100] (OpenAI's range)",
    ),
    "stream_options without stream": (
        "completions",
        {"prompt": "Hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "only be set when stream is true",
    ),
    "a pattern's lookahead xgrammar would ignore": (
        "chat/completions",
        schema_chat({"type": "string", "pattern": "^(?!a)[ab]{3}$"}),
        400,
        "response_format.json_schema.schema",
        "ignores the lookahead '(?!' in a pattern",
    ),
    "a pattern's mid anchor xgrammar would ignore": (
        "chat/completions",
        schema_chat({"type": "string", "pattern": "a$b"}),
        400,
        "response_format.json_schema.schema",
        "xgrammar would not enforce it: Anchor '$' in the middle of regex is ignored",
    ),
    "a schema no text satisfies": (
        "chat/completions",
        schema_chat({"$ref": "#"}),
        400,
        "response_format.json_schema.schema",
        "no text satisfies it (its grammar allows no first token)",
    ),
    "a schema only an empty text satisfies": (
        "chat/completions",
        schema_chat({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-300}),
        400,
        "response_format.json_schema.schema",
        "only an empty text satisfies it, and that is no JSON",
    ),
    "a JSON schema xgrammar refuses": (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        },
        400,
        "response_format.json_schema.schema",
        "invalid response_format.json_schema.schema: ",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_request_is_a_4xx_naming_its_field_and_costs_nothing(server, name):
    route, body, status, param, says = HOSTILE[name]
    t0 = time.perf_counter()
    if isinstance(body, bytes):
        r = httpx.post(
            f"{server.url}/v1/{route}", content=body, headers={"content-type": "application/json"}, timeout=60
        )
    else:
        r = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60)
    error = refused(r, status, param)
    assert says in error["message"], error
    assert time.perf_counter() - t0 < 5  # refused before any compile or forward
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and httpx.get(server.url + "/health").status_code == 200


def test_a_compressed_body_is_a_415_naming_its_encoding(server):
    """A gzip body was parsed as JSON text ("not valid JSON: 'utf-8' codec can't decode byte 0x8b", param null) and
    a plain body labelled br was served: any Content-Encoding but identity is a 415 saying to send it uncompressed.
    A transfer coding other than chunked is a 501 (RFC 9112's answer for a coding the server does not know)."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    for encoding, data in (("gzip", gzip.compress(body)), ("br", body), ("GZIP, deflate", gzip.compress(body))):
        headers = {"content-type": "application/json", "content-encoding": encoding}
        r = httpx.post(f"{server.url}/v1/completions", content=data, headers=headers, timeout=60)
        error = refused(r, 415, None)
        assert error["message"].startswith(f"Content-Encoding {encoding.lower()!r} is not supported"), error
    headers = {"content-type": "application/json", "content-encoding": "identity"}
    assert httpx.post(f"{server.url}/v1/completions", content=body, headers=headers, timeout=60).status_code == 200
    host, port = urlsplit(server.url).hostname, urlsplit(server.url).port
    data = gzip.compress(body)  # a transfer coding under chunked: its chunks were read as the body's text
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: gzip, chunked\r\n\r\n" + b"%x\r\n" % len(data) + data + b"\r\n0\r\n\r\n"
        )
        answer = sock.recv(65536).decode("latin-1")
    assert answer.startswith("HTTP/1.1 501"), answer[:300]
    assert "Transfer-Encoding 'gzip' is not supported" in answer and '"param":null' in answer.replace(" ", "")


def test_a_client_that_half_closes_behind_pipelined_requests_costs_no_logged_exception(tiny):
    """Three requests pipelined on one connection, then the client half-closes it: uvicorn closes the connection
    and marks only the newest request disconnected, so the one answering wrote to the closed transport and uvloop's
    RuntimeError was logged as an "Exception in ASGI application" (each time). Every request of the connection is
    over now, quietly; the server serves on."""
    srv = start_server(make_engine(tiny, sampling=SamplingParams()), None)
    errors: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: errors.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("uvicorn.error").addHandler(handler)
    try:
        body = json.dumps({"prompt": "Hi", "max_tokens": 200, "ignore_eos": True}).encode()
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        post = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        address = urlsplit(srv.url)
        for _ in range(3):
            with socket.create_connection((address.hostname, address.port)) as s:
                s.sendall(post + health + post)
                s.shutdown(socket.SHUT_WR)
                s.settimeout(30)
                while s.recv(65536):  # until the server closes it
                    pass
        deadline = time.monotonic() + 30
        while srv.loop.open_requests:  # the engine took the aborts
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
        srv.stop()
    assert errors == []


def test_a_request_past_the_context_is_told_which_prompt_not_an_engine_id(server):
    """prompt + max_tokens past the context names the prompt by its index when there are several, and no engine
    request id (the job's id and the index, once shown as "request cmpl-...-1:") either way."""
    context = server.loop.engine.max_model_len
    for prompt, says in (
        ([5] * 100, f"prompt (100) + max_tokens ({context - 50}) = {context + 50} exceeds engine.max_model_len"),
        ([[5] * 10, [5] * 100], f"prompt 1: prompt (100) + max_tokens ({context - 50}) = {context + 50} exceeds"),
    ):
        body = {"prompt": prompt, "max_tokens": context - 50}
        error = refused(httpx.post(f"{server.url}/v1/completions", json=body, timeout=60), 400, "max_tokens")
        assert error["message"].startswith(says) and "cmpl-" not in error["message"], error


@pytest.mark.parametrize("name", ["a million bad messages", "half a million null prompts", "a million list stops"])
def test_a_list_of_bad_items_is_one_error_not_one_per_item(name):
    """pydantic stops at a list's first bad item (FailFast): a body of a million bad items is at most one error per
    member of its union, not a million (materialising those held the event loop for 30 s and took 5.5 GB)."""
    route, body, *_ = HOSTILE[name]
    model = ChatCompletionRequest if route.startswith("chat") else CompletionRequest
    with pytest.raises(ValidationError) as caught:
        model.model_validate_json(body) if isinstance(body, bytes) else model.model_validate({"model": "m", **body})
    assert caught.value.error_count() <= 4


def test_a_body_nested_5000_deep_is_a_400_in_openai_shape(server):
    body = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = httpx.post(
        f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert "nested too deeply" in refused(r, 400, None)["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_grammar_past_its_time_limit_is_a_400(tiny):
    srv = start_server(make_engine(tiny, sampling=SamplingParams()), None, grammar_timeout_s=0.001)
    try:
        body = {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": nested_schema(20)}},
        }
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
        assert "serve.grammar_timeout_s=0.001" in refused(r, 400, "response_format")["message"]
    finally:
        srv.stop()


def test_a_compile_past_its_time_limit_is_killed_and_its_thread_free_at_once(tiny):
    """A new grammar is compiled first in a child process (toolkit.sampling.grammar_process): past
    serve.grammar_timeout_s the child is killed, not left compiling for minutes on the compiler's thread (where,
    under serve.max_compiling=1, every new grammar got 503 until it ended). A request without a grammar, or with one
    compiled already (json_object), is served throughout; the next new grammar is taken at once by a fresh child."""
    engine = make_engine(tiny, sampling=SamplingParams())
    engine.precompile(SamplingParams(structured_outputs={"json": {"type": "object"}}))  # what json_object asks
    srv = start_server(engine, None, grammar_timeout_s=1, max_compiling=1, max_schema_chars=200_000)
    compiler = srv.uvicorn.config.app.state.compiler
    try:
        answers: list[httpx.Response] = []
        slow = threading.Thread(target=lambda: answers.append(post_chat(srv.url, long_enum(40_000))))  # minutes
        t = time.monotonic()
        slow.start()
        deadline = time.monotonic() + 30
        while not compiler.compiling or not compiler.pids():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        compiling = set(compiler.pids())  # its child among them
        slow.join()
        assert "serve.grammar_timeout_s=1" in refused(answers[0], 400, "response_format")["message"]
        assert time.monotonic() - t < 30
        deadline = time.monotonic() + 30
        while compiler.compiling or compiling <= set(compiler.pids()):  # its thread free, its child gone
            assert time.monotonic() < deadline, (compiler.compiling, compiler.pids(), compiling)
            time.sleep(0.05)
        assert not any(os.path.exists(f"/proc/{pid}") for pid in compiling - set(compiler.pids()))
        assert post_chat(srv.url, nested_schema(2)).status_code == 200  # a new grammar, compiled by a fresh child
        body = {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "response_format": {"type": "json_object"},
        }
        assert httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    finally:
        srv.stop()
    assert compiler.pids() == []  # stopping the server killed its children


def test_new_grammars_past_max_compiling_wait_for_nobody_and_get_a_503(tiny):
    """While serve.max_compiling compiles run, a request with a new grammar is a 503 + Retry-After naming the knob;
    one without a grammar is served at once."""
    srv = start_server(make_engine(tiny, sampling=SamplingParams()), None, max_compiling=1, max_schema_chars=200_000)
    compiler = srv.uvicorn.config.app.state.compiler
    try:
        slow = threading.Thread(target=post_chat, args=(srv.url, long_enum(6_000)), kwargs={"timeout": 120})
        slow.start()
        deadline = time.monotonic() + 60
        while not compiler.compiling:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = post_chat(srv.url, nested_schema(2))
        assert "serve.max_compiling=1" in refused(r, 503, None)["message"] and int(r.headers["retry-after"]) >= 1
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "plain", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        slow.join()
    finally:
        srv.stop()


def test_a_grammar_queued_behind_others_past_its_time_limit_is_a_503_not_its_schemas_fault():
    """Two compiles hold the compiler's two threads; a schema queued behind them past serve.grammar_timeout_s got
    the 400 meant for a schema that is slow to compile ("compiling its grammar took longer than this server
    allows"). Its time limit counts from its compile's start: waiting for a thread past it is a 503 + Retry-After,
    and its compile never runs. (The threads are held by a precompile that waits for the test, not by slow
    schemas: a killed compile's thread is free again after a child's restart, too soon to be sure it is queued.)"""
    release, ran = threading.Event(), []

    def precompile(sampling: dict, cached_only: bool = False, compile_with=None) -> bool:
        if cached_only:
            return False
        ran.append(sampling["name"])
        release.wait(60)
        return True

    compiler = GrammarCompiler(precompile, max_compiling=8)

    async def scenario() -> str:
        held = [asyncio.ensure_future(compiler.compile({"name": name}, 60)) for name in "ab"]
        while len(ran) < 2:  # both threads taken
            await asyncio.sleep(0.01)
        try:
            await compiler.compile({"name": "queued"}, 0.2)
        except Unavailable as exc:
            refusal = str(exc)
        else:
            refusal = "served"
        release.set()
        await asyncio.gather(*held)
        await asyncio.sleep(0.2)  # a thread would take the queued one now, were it not cancelled
        return refusal

    try:
        refusal = asyncio.run(scenario())
    finally:
        compiler.close()
    assert "threads were busy with other requests' grammars for serve.grammar_timeout_s=0.2 s" in refusal, refusal
    assert ran == ["a", "b"] or ran == ["b", "a"]


def test_a_grammar_past_its_memory_bound_is_a_400_naming_the_knob(tiny):
    """A compile's memory is bounded in its child (serve.max_grammar_mb, an address-space limit): an enum of 9,000
    values of 50 characters needs more than 4 MB (hundreds), a one-property object less; the server serves on."""
    srv = start_server(make_engine(tiny, sampling=SamplingParams()), None, max_grammar_mb=4, max_schema_chars=10**6)
    try:
        big = {"type": "string", "enum": [f"{i:05d}" + "y" * 45 for i in range(9_000)]}
        error = refused(post_chat(srv.url, big), 400, "response_format.json_schema.schema")
        assert "needs more than 4 MB (serve.max_grammar_mb)" in error["message"], error
        assert post_chat(srv.url, nested_schema(1)).status_code == 200
    finally:
        srv.stop()


def test_what_xgrammar_warns_of_is_refused_but_a_discriminated_union(server):
    """The compiling child refuses a grammar xgrammar warns it will not enforce (a mid-pattern anchor: the HOSTILE
    rows), but a oneOf it reads as anyOf: pydantic's discriminated union, its branches behind $refs, is one."""
    branch = {"type": "object", "required": ["kind", "x"]}
    schema = {
        "$defs": {
            "A": {**branch, "properties": {"kind": {"const": "a", "type": "string"}, "x": {"type": "integer"}}},
            "B": {**branch, "properties": {"kind": {"const": "b", "type": "string"}, "x": {"type": "string"}}},
        },
        "type": "object",
        "properties": {
            "item": {
                "oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}],
                "discriminator": {"propertyName": "kind", "mapping": {"a": "#/$defs/A", "b": "#/$defs/B"}},
            }
        },
        "required": ["item"],
    }
    r = post_chat(server.url, schema)
    assert r.status_code == 200, r.text


def test_a_compiling_child_that_dies_is_one_400_and_the_next_grammar_compiles(tiny):
    """xgrammar is foreign native code: its child's death while it compiles (here a SIGKILL, as the OOM killer's; a
    SIGSEGV first runs the handler torch installs, which prints a backtrace for a while) is that request's 400
    naming the signal, never the server's death; the next new grammar gets a fresh child."""
    srv = start_server(make_engine(tiny, sampling=SamplingParams()), None, max_schema_chars=200_000)
    compiler = srv.uvicorn.config.app.state.compiler
    try:
        answers: list[httpx.Response] = []
        slow = threading.Thread(target=lambda: answers.append(post_chat(srv.url, long_enum(40_000))))  # minutes
        slow.start()
        deadline = time.monotonic() + 30
        while not compiler.compiling or not compiler.pids():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(1)  # compiling, not starting
        (pid,) = compiler.pids()
        os.kill(pid, signal.SIGKILL)
        slow.join()
        error = refused(answers[0], 400, "response_format.json_schema.schema")
        assert "xgrammar's compile of it crashed: killed by signal SIGKILL" in error["message"], error
        assert post_chat(srv.url, nested_schema(2)).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()


def test_a_schemas_text_counts_names_literals_and_patterns_not_keywords_or_annotations():
    """serve.max_schema_chars counts the text a grammar holds: property and definition names, enum and const values
    (nested, their keys too) and patterns, wherever they sit (under items, anyOf, a definition); not keywords, type
    names, `required` (names already counted), descriptions or titles, nor a literal that looks like a schema."""
    schema = {
        "type": "object",
        "description": "d" * 100,
        "title": "t" * 100,
        "properties": {
            "name": {"type": "string", "pattern": "^[a-z]+$"},  # 4 + 8
            "kind": {"enum": ["ab", "c", {"k": "vv"}, 7]},  # 4 + 3 + 3
            "tags": {"type": "array", "items": {"anyOf": [{"const": "xyz"}, {"$ref": "#/$defs/Tag"}]}},  # 4 + 3
        },
        "required": ["name", "kind", "tags"],
        "$defs": {"Tag": {"type": "string", "const": {"properties": "p"}}},  # 3 + 10 + 1
    }
    assert schema_text(schema) == 4 + 8 + 4 + 3 + 3 + 4 + 3 + 3 + 10 + 1
    assert schema_text({"type": "object", "properties": {"description": {"const": "q" * 9}}}) == 11 + 9
    assert schema_text(long_enum(10_000)) == 20_000


def _shape(value) -> tuple[int, int]:
    """(depth, nodes) by recursion: the reference json_shape's level walk must agree with."""
    children = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else []
    shapes = [_shape(child) for child in children]
    return 1 + max((d for d, _ in shapes), default=0), 1 + sum(n for _, n in shapes)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=2), inner, max_size=4),
    max_leaves=40,
)


def test_a_patterns_cost_follows_its_nested_bounded_repeats_not_its_length():
    """pattern_cost estimates the milliseconds xgrammar's JSON-schema compile spends on a pattern (docstring's
    measurements): everyday patterns cost little; repeats of variable count over bodies of variable length, nested,
    cost their product (([a-z]{1,20}){1,20}: 9.75 s measured); a pattern Python's parser cannot read is costed by
    its repeat counts, so ECMA syntax does not hide one; patternProperties keys are patterns too."""
    everyday = [
        r"^([a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?\.)+[a-zA-Z]{2,}$",  # a hostname
        r"^((25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\.){3}(25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)$",  # IPv4
        r"^[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}$",  # a UUID
        r"^[^@\s]+@[^@\s]+\.[a-z]{2,}$",
        r"^\d{4}-\d{2}-\d{2}$",
    ]
    assert all(pattern_cost(p) < 200 for p in everyday), [pattern_cost(p) for p in everyday]
    costs = [pattern_cost(f"h([a-z]{{1,{k}}}){{1,{k}}}") for k in (5, 10, 20)]
    assert costs[0] < 400 < costs[1] < 4000 < costs[2], costs
    assert pattern_cost("h(([a-z]{1,6}){1,6}){1,6}") > 4000 > pattern_cost("h(([a-z]{1,3}){1,3}){1,3}")
    assert pattern_cost("(?<name>([a-z]{1,20}){1,20})") > 4000  # a named group ECMA's way, read as Python's
    assert pattern_cost("(?<=x)([a-z]{1,20}){1,20}\\k<q>") > 4000  # unreadable to Python: counted by its repeats
    schema = {"patternProperties": {"^a([a-z]{1,20}){1,20}$": {"type": "string", "pattern": "b{2}"}}}
    assert sorted(schema_patterns(schema)) == ["^a([a-z]{1,20}){1,20}$", "b{2}"]
    assert schema_pattern_cost(schema) == pattern_cost("^a([a-z]{1,20}){1,20}$") + pattern_cost("b{2}")
    assert schema_patterns({"enum": [{"pattern": "x{9}"}], "const": {"pattern": "y"}}) == []  # literals, no schemas


@given(JSON, st.integers(1, 8), st.integers(1, 60))
def test_a_json_shape_is_its_depth_and_size_and_says_when_either_is_past_its_bound(value, max_depth, max_nodes):
    """The body's depth check and a schema's size check read json_shape: exact within the bounds, and past a bound
    exactly when the value is."""
    depth, nodes = _shape(value)
    assert json_shape(value, 10**6, 10**6) == (depth, nodes)
    seen_depth, seen_nodes = json_shape(value, max_depth, max_nodes)
    assert (seen_depth > max_depth or seen_nodes > max_nodes) == (depth > max_depth or nodes > max_nodes)
    if depth <= max_depth and nodes <= max_nodes:
        assert (seen_depth, seen_nodes) == (depth, nodes)


def test_a_body_is_parsed_off_the_event_loop_and_the_startup_heap_is_frozen(tiny, monkeypatch):
    """A request's JSON is parsed, walked and validated on a parser thread, not the event loop's (a 7 MB body held
    every stream 0.4 s there); while a server runs, the heap it started with is frozen (each collection scanned
    all ~200k startup objects: a million-list body parsed in 0.9 s instead of 0.13 s), and thawed when it stops."""
    threads: list[str] = []
    parse = api_module._json_body
    monkeypatch.setattr(
        api_module, "_json_body", lambda raw: threads.append(threading.current_thread().name) or parse(raw)
    )
    srv = start_server(make_engine(tiny, sampling=SamplingParams()), None)
    try:
        assert gc.get_freeze_count() > 50_000
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
        assert r.status_code == 200 and threads and threads[0].startswith("toolkit-parse"), threads
    finally:
        srv.stop()
    assert gc.get_freeze_count() == 0


def test_a_full_server_refuses_before_it_compiles_a_grammar(tiny):
    """With one request running and one waiting (serve.max_waiting=1), a request with a new schema is a 503 +
    Retry-After, and its grammar was never compiled (the admission check comes before any work)."""
    engine = make_engine(tiny, sampling=SamplingParams(), max_num_seqs=1)
    srv = start_server(engine, None, max_waiting=1)
    long = {"prompt": "Fill", "max_tokens": 400, "ignore_eos": True}
    threads = [
        threading.Thread(
            target=httpx.post, args=(f"{srv.url}/v1/completions",), kwargs={"json": {**long, "seed": i}, "timeout": 120}
        )
        for i in range(2)
    ]
    try:
        for t, full in zip(threads, (lambda s: s.running == 1, lambda s: s.waiting_requests == 1)):
            t.start()  # the first one running, then the second one waiting
            deadline = time.time() + 30
            while not full(srv.loop.stats) and time.time() < deadline:
                time.sleep(0.002)
        assert (srv.loop.stats.running, srv.loop.stats.waiting_requests) == (1, 1)
        before = engine.grammar.compilations
        body = {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "new", "schema": nested_schema(3)}},
        }
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
        error = refused(r, 503, None)
        assert error["code"] == "server_overloaded" and int(r.headers["retry-after"]) >= 1
        assert engine.grammar.compilations == before  # nothing was compiled for a request that was refused
    finally:
        for t in threads:
            t.join(120)
        srv.stop()


def test_connection_and_limit_knobs_are_checked_and_reach_uvicorn(tiny):
    from toolkit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"serve.flush_every_steps must be an integer in \[1, 64\]"):
        serve_config({"serve": {"flush_every_steps": 65}})
    for bad in ({"limit_concurrency": 0}, {"max_stop_chars": -1}, {"grammar_timeout_s": 0}, {"max_metadata": 1.5}):
        with pytest.raises(ConfigError, match=f"serve.{next(iter(bad))} must be a positive"):
            serve_config({"serve": bad})
    for bad in (-1, 1001, "2", True):  # 0 is allowed: no wait
        with pytest.raises(ConfigError, match="serve.handoff_wait_ms must be a number in"):
            serve_config({"serve": {"handoff_wait_ms": bad}})
    assert serve_config({"serve": {"handoff_wait_ms": 0}})["handoff_wait_ms"] == 0
    srv = start_server(make_engine(tiny, sampling=SamplingParams()), None, limit_concurrency=7, timeout_keep_alive=3)
    try:
        assert (srv.uvicorn.config.limit_concurrency, srv.uvicorn.config.timeout_keep_alive) == (7, 3)
        assert srv.loop.handoff_wait_s == 0.002  # the default on the CPU; none on a GPU, unless set
        assert handoff_wait_for(None, SimpleNamespace(device=torch.device("cuda"))) == 0
        assert handoff_wait_for(5, SimpleNamespace(device=torch.device("cuda"))) == 5
    finally:
        srv.stop()


def _stalled_stream(url: str, body: dict) -> socket.socket:
    """A streaming request from a client that never reads (a 4 KB receive buffer): the server's writes block
    once the socket's buffers are full."""

    parts = urlsplit(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((parts.hostname, parts.port))
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    return sock


LONG_STREAM = {
    "prompt": "Never read",
    "stream": True,
    "n": 16,
    "max_tokens": 1500,
    "ignore_eos": True,
    "temperature": 1.0,
    "logprobs": 5,
}


@once
@pytest.mark.parametrize(
    "knobs",
    [dict(stream_write_timeout_s=1.0, max_unread_mb=1024.0), dict(max_unread_mb=0.05)],
    ids=["write timeout", "unread bytes"],
)
def test_a_stream_whose_client_stops_reading_is_aborted(tiny, knobs):
    """A client that stops reading a long stream (several MB of SSE) holds no engine resources for long: past
    serve.stream_write_timeout_s without a byte taken, or past serve.max_unread_mb of its output unread, its
    requests are aborted and their blocks freed while it is still connected; a bystander is served meanwhile."""
    engine = make_engine(tiny, sampling=SamplingParams(), max_num_seqs=32)
    srv = start_server(engine, None, **{"stream_write_timeout_s": 3600.0, **knobs})
    sock = _stalled_stream(srv.url, LONG_STREAM)
    try:
        deadline = time.monotonic() + 120
        while srv.loop.stats.output_tokens == 0:  # it started
            assert time.monotonic() < deadline
            time.sleep(0.05)
        while srv.loop.open_requests:
            assert time.monotonic() < deadline, "the stalled stream's requests were never aborted"
            time.sleep(0.1)
        generated = srv.loop.stats.output_tokens
        assert generated < 16 * 1500, generated  # aborted before it ran to its end
        assert srv.loop.stats.finished.get("abort") == 16
        assert engine.block_manager.num_used_blocks == 0
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "bystander", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
        if "stream_write_timeout_s" not in knobs:  # read at last: the stream ends with the client's error, then [DONE]
            *_, error, done = re.findall(rb"data: (.*?)\n\n", _rest_of_stream(sock))
            error = json.loads(error)["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "client_too_slow"), error
            assert "serve.max_unread_mb" in error["message"] and done == b"[DONE]", done
    finally:
        sock.close()
        srv.stop()


def _rest_of_stream(sock: socket.socket) -> bytes:
    """What a stalled stream's socket still holds, read until its chunked body's end."""
    sock.settimeout(30)
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        chunk = sock.recv(1 << 20)
        assert chunk, data[-300:]
        data += chunk
    return data


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed this connection (reads its end of file), within the socket's timeout."""
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_one_client_holds_at_most_max_connections_per_client_and_health_answers_past_every_limit(tiny):
    """A client trickling request bodies on many connections (each a place under serve.limit_concurrency) gets a
    503 past serve.max_connections_per_client on the next, its connection closed; GET /health is answered past
    either bound; once the client's connections close, its requests are served again. (1,030 such connections
    once held every place: every other client, and /health, got 503s for as long as the bytes came.)"""
    srv = start_server(
        make_engine(tiny, sampling=SamplingParams()), None, max_connections_per_client=3, limit_concurrency=4
    )
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    )
    trickling = []
    try:
        for _ in range(3):  # three bodies begun, never finished
            trickling.append(_connect(srv.url))
            trickling[-1].sendall(head)
        time.sleep(0.3)
        one_more = _connect(srv.url)
        one_more.sendall(head)
        one_more.settimeout(10)
        answer = one_more.recv(65536)
        assert answer.startswith(b"HTTP/1.1 503") and b'"too_many_connections"' in answer, answer[:400]
        assert _closed_by_server(one_more)
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200  # the 4th open: limit_concurrency's
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] in ("too_many_connections", "server_overloaded")
    finally:
        for sock in trickling:
            sock.close()
    try:
        deadline = time.monotonic() + 10
        while (
            r := httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
        ).status_code != 200:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.1)
    finally:
        srv.stop()


def test_connections_that_never_finish_a_request_head_are_closed_and_take_no_place_for_long(tiny):
    """A connection that sends nothing, or its headers a byte at a time and never the blank line, or nothing more
    after its answer, is closed serve.client_header_timeout_s after it opened (or after the answer): under
    limit_concurrency such connections once locked every client out for as long as they stayed open."""
    srv = start_server(
        make_engine(tiny, sampling=SamplingParams()),
        None,
        client_header_timeout_s=1.5,
        timeout_keep_alive=60,
        limit_concurrency=4,
    )
    try:
        silent, partial, answered = (_connect(srv.url) for _ in range(3))
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        body = b'{"prompt": "Hi", "max_tokens": 2}'
        answered.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert b"200 OK" in answered.recv(65536)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        # the three hold three of the four places (and this one the fourth): OpenAI's 503, not uvicorn's plain one
        assert "serve.limit_concurrency" in refused(r, 503, None)["message"] and r.headers["retry-after"] == "1"
        t0 = time.monotonic()
        for sock in (silent, partial, answered):
            sock.settimeout(15)
            assert _closed_by_server(sock)  # uvicorn's keep-alive timer (60 s here) would have waited
        assert time.monotonic() - t0 < 10
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200  # their places are free again
    finally:
        for sock in (silent, partial, answered):
            sock.close()
        srv.stop()


def _http_count(url: str, status: str) -> float:
    """toolkit_http_requests_total for /v1/completions with this status, from /metrics."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("toolkit_http_requests_total{") and 'route="/v1/completions"' in line:
            if f'status="{status}"' in line:
                return float(line.split()[-1])
    return 0.0


def test_a_body_that_stops_arriving_is_a_408_and_a_client_leaving_mid_body_an_answered_request(tiny):
    """Headers whole, the body cut short: past serve.client_body_timeout_s without a byte of it, a 408 in OpenAI's
    shape that closes the connection (its handler freed); a client that closes its end mid-body ends its request
    as a counted 400 (it was uvicorn's traceback and no answer), and a request a head is still served."""
    srv = start_server(make_engine(tiny, sampling=SamplingParams()), None, client_body_timeout_s=0.5)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    try:
        stalled = _connect(srv.url)
        stalled.sendall(head + b'{"prompt": "Hi",')
        stalled.settimeout(15)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}}"):
            chunk = stalled.recv(65536)
            if not chunk:
                break
            answer += chunk
        status_line, _, rest = answer.partition(b"\r\n")
        headers, _, body = rest.partition(b"\r\n\r\n")
        assert status_line.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"connection: close" in headers.lower()
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout" and "serve.client_body_timeout_s" in error["message"]
        assert _closed_by_server(stalled)

        before = _http_count(srv.url, "400")
        leaving = _connect(srv.url)
        leaving.sendall(head + b'{"prompt": ')
        time.sleep(0.1)
        leaving.close()
        deadline = time.monotonic() + 10
        while _http_count(srv.url, "400") < before + 1:
            assert time.monotonic() < deadline, "the request whose client left mid-body was never answered"
            time.sleep(0.05)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
    finally:
        stalled.close()
        srv.stop()


def test_requests_being_prepared_hold_their_places_under_max_waiting_and_give_them_back(tiny):
    """A request holds its places under serve.max_waiting from its admission to its hand-over to the engine loop,
    so requests whose grammars compile or whose echoed prompts are scored count as waiting (they once escaped the
    bound: 16 scoring requests past max_waiting=4 all ran, the last answered after four minutes); one whose
    preparation fails, and one handed over, give them back."""
    from toolkit.serve.loop import Unavailable

    srv = start_server(make_engine(tiny, sampling=SamplingParams()), None, max_waiting=2)
    ok = {"prompt": "Hi", "max_tokens": 2}
    bad_schema = {
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    }
    try:
        srv.loop.check_capacity(2)  # two places held, as by a request of two prompts being prepared
        with pytest.raises(Unavailable, match="serve.max_waiting=2"):
            srv.loop.check_capacity(1)
        r = httpx.post(srv.url + "/v1/completions", json=ok, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"
        srv.loop.release(2)
        for _ in range(3):  # refused while prepared: each gives its place back
            refused(
                httpx.post(srv.url + "/v1/chat/completions", json=bad_schema, timeout=60),
                400,
                "response_format.json_schema.schema",
            )
        for _ in range(3):  # handed over and answered
            assert httpx.post(srv.url + "/v1/completions", json={**ok, "n": 2}, timeout=60).status_code == 200
        assert srv.loop._preparing == 0
    finally:
        srv.stop()


def test_a_request_whose_own_constraints_leave_no_token_says_why(server):
    """A JSON object's grammar beside allowed_token_ids of one letter leaves no token to sample: the choice ends
    with finish_reason "error" and, in stop_reason, the processor that emptied it, streamed or not (it said
    nothing). (What intake can see is refused before: allowed_token_ids all banned, a bias past [-100, 100].)"""
    letter = server.loop.engine.tokenizer.encode("a", add_special_tokens=False)
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "response_format": {"type": "json_object"},
        "allowed_token_ids": letter,
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "error" and choice["message"]["content"] == ""
    assert re.search(r"empty support: processor '\w+' removed every token", choice["stop_reason"]), choice
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    last = [c for e in events for c in e["choices"] if c["finish_reason"]][-1]
    assert last["finish_reason"] == "error" and "removed every token" in last["stop_reason"]


def test_the_engine_thread_tokenizes_no_prompt_and_a_huge_one_is_refused_off_it(server, monkeypatch):
    """Prompts are tokenized and checked against the context on a handler's thread (the tokenizer lets the GIL go
    there) and reach the engine as ids beside their text: a 2 MB prompt, a chat message of 2 MB, 300,000 ids are
    each a 400 naming the field, and neither they nor a good request cost the engine thread a tokenization (an
    8 MB prompt held it 4 s: every stream waited). A text longer than the context's tokens can spell (its
    characters over the most one token spells) is refused before it is tokenized at all: an 8 MB prompt's tokens
    took 1-2 GB, not all given back. Usage counts the prompt's tokens from the first chunk."""
    tokenizer = server.loop.engine.tokenizer
    encode, threads = tokenizer.encode, []
    monkeypatch.setattr(
        tokenizer, "encode", lambda *a, **k: (threads.append(threading.current_thread().name), encode(*a, **k))[1]
    )
    context = server.loop.engine.max_model_len
    big, over = "hello world " * 170_000, "hello world " * (context // 2)  # 2 MB; the context's tokens and 1
    assert tokenizer.least_tokens(big) >= context > tokenizer.least_tokens(over)
    for route, body, param, says in (
        ("completions", {"prompt": big, "max_tokens": 1}, "prompt", "prompt has at least 25186 tokens"),
        ("chat/completions", {"messages": [{"role": "user", "content": big}], "max_tokens": 1}, "messages", "least"),
        ("completions", {"prompt": [1] * 300_000, "max_tokens": 1}, "prompt", "300000 tokens"),
        ("completions", {"prompt": over, "max_tokens": 1}, "prompt", f"prompt has {context + 1} tokens"),
        ("chat/completions", {"messages": [{"role": "user", "content": over}], "max_tokens": 1}, "messages", "has"),
    ):
        error = refused(httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60), 400, param)
        assert "engine.max_model_len" in error["message"] and says in error["message"], error
    assert len(threads) == 2, threads  # the two prompts the context's bound could not refuse were tokenized
    body = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 3, "stream": True}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    prompt_tokens = {e["usage"]["prompt_tokens"] for e in events if e.get("usage")}
    assert len(prompt_tokens) == 1 and prompt_tokens.pop() > 0, events
    assert len(threads) == 3 and "engine-loop" not in threads, threads


PIECES = [
    "#" * 80,
    "\n" + " " * 80,
    " " + "=" * 79,
    "<|im_start|>",
    "<|endoftext|>",
    "é",
    "🙂",
    " the",
    "a",
    "\x16",
    "\x1d",
]


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=300) | st.lists(st.sampled_from(PIECES)).map("".join))
def test_a_texts_least_tokens_never_exceed_its_tokens(tiny, text):
    """Tokenizer.least_tokens, which refuses a prompt before it is tokenized, is a lower bound on its token count:
    any characters (multi-byte ones split into byte tokens), runs the vocabulary's longest tokens spell (81
    characters of SmolLM2's: a line of spaces, of #), special tokens' text; and on a chat's rendered text."""
    tokenizer = tiny.tokenizer
    assert tokenizer.max_token_chars == 81 and tokenizer._dropped == "\x04\x06\x13\x14\x16\x1d"
    assert tokenizer.least_tokens(text) <= len(tokenizer.encode(text))
    rendered = tokenizer.render_chat([{"role": "user", "content": text}])
    assert tokenizer.least_tokens(rendered) <= len(tokenizer.encode(rendered, add_special_tokens=False))


def test_a_tokenizer_that_may_drop_characters_bounds_nothing_and_dropped_controls_are_not_counted():
    """A normalizer or a pre-tokenizer that drops characters (BERT's drops spaces: a million of them are no token)
    leaves no bound: least_tokens is 0 and the text is tokenized. A byte-level BPE whose vocabulary lacks an ASCII
    control's byte drops that character (SmolLM2's lacks six: a prompt of \\x16 is no token), so those are not
    counted; one that lacks a continuation byte could drop a character of several bytes whole: no bound."""
    bert = tokenizers.Tokenizer(tokenizers.models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    bert.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    assert _max_token_chars(bert) == (None, "")
    bert.pre_tokenizer, bert.normalizer = None, tokenizers.normalizers.Lowercase()
    assert _max_token_chars(bert) == (None, "")
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    spell = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str
    lacking = {spell("\x16")[0][0]}
    byte_level = tokenizers.Tokenizer(
        tokenizers.models.BPE({c: i for i, c in enumerate([*(set(alphabet) - lacking), "aaaa"])}, [])
    )
    byte_level.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert _max_token_chars(byte_level) == (4, "\x16")
    assert byte_level.encode("\x16\x16").ids == []  # what the bound assumes: the character spells no token
    byte_level.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [tokenizers.pre_tokenizers.Split(" ", "removed"), tokenizers.pre_tokenizers.ByteLevel()]
    )
    assert _max_token_chars(byte_level) == (None, "")  # the split drops the spaces
    lacking = {spell(bytes([0xC2, 0x99]).decode())[0][0][1]}  # a continuation byte
    no_continuation = tokenizers.Tokenizer(
        tokenizers.models.BPE({c: i for i, c in enumerate(set(alphabet) - lacking)}, [])
    )
    no_continuation.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    assert _max_token_chars(no_continuation) == (None, "")


def _raw_answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON error of the answer on a raw connection, read to its close."""
    sock.settimeout(30)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), data[:300]
    return int(head.split()[1]), json.loads(body)["error"]


def test_a_request_head_past_max_header_kb_is_a_431_before_it_is_whole_and_a_bad_one_a_400_in_openai_shape(tiny):
    """httptools keeps a head's bytes however many come: a client streaming one header held 200 MB for 10 s, and a
    1 MB header or 5,000 headers were served. Past serve.max_header_kb the answer is a 431 in OpenAI's shape as
    soon as the bytes pass the bound (the head never finished here), whole or not; a head the parser refuses is a
    400 in OpenAI's shape (uvicorn's was plain text), and so is a body whose chunk size it refuses (the connection
    closed without a byte); a head under the bound is served."""
    srv = start_server(make_engine(tiny, sampling=SamplingParams()), None, max_header_kb=16)
    try:
        streaming = _connect(srv.url)
        streaming.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: ")
        for _ in range(5):
            streaming.sendall(b"a" * 4096)
        with pytest.raises(OSError):  # answered and closed before the 64 KB more could all be sent
            for _ in range(64):
                streaming.sendall(b"a" * 1024)
                time.sleep(0.005)
        status, error = _raw_answer(streaming)
        assert status == 431 and "serve.max_header_kb=16" in error["message"], error
        body = b'{"prompt": "Hi", "max_tokens": 2}'
        for headers in (b"X-Big: " + b"a" * 20_000 + b"\r\n", b"".join(b"X-%d: 1\r\n" % i for i in range(3000))):
            whole = _connect(srv.url)
            whole.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n%s"
                % (headers, len(body), body)
            )
            status, error = _raw_answer(whole)
            assert status == 431 and error["code"] == "request_header_fields_too_large", error
        bad = _connect(srv.url)
        bad.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
        status, error = _raw_answer(bad)
        assert status == 400 and error["code"] == "invalid_http_request" and "\n" not in error["message"], error
        for size in (b"zz", b"f" * 20):  # a body's chunk size the parser refuses: the connection closed, no answer
            bad = _connect(srv.url)
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            bad.sendall(head + size + b"\r\n" + body + b"\r\n0\r\n\r\n")
            status, error = _raw_answer(bad)
            assert status == 400 and error["code"] == "invalid_http_request", error
        ok = httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": "Hi", "max_tokens": 2},
            headers={"X-Big": "a" * 8000},
            timeout=60,
        )
        assert ok.status_code == 200, ok.text
    finally:
        srv.stop()


def test_a_dumped_assistant_message_goes_back_in_the_history_and_other_parts_are_named(server):
    """The `openai` client's message, dumped (`model_dump()`: refusal, annotations, audio, function_call, tool_calls,
    all null) and sent back in the next request's history, is taken (it was a 400 naming `refusal`); a tool call or
    an image part is a 400 that says what is not supported (an image part's said `content` was no string)."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    history = [{"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model="tiny", messages=history, max_tokens=3)
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "audio", "function_call", "tool_calls"} <= set(dumped)
    again = client.chat.completions.create(
        model="tiny", messages=[*history, dumped, {"role": "user", "content": "More"}], max_tokens=3
    )
    assert again.usage.prompt_tokens > first.usage.prompt_tokens
    for message, param, says in (
        (
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
            "messages.0.tool_calls",
            "tool calling",
        ),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]},
            "messages.0.content.0",
            "'image_url' are not supported",
        ),
    ):
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [message], "max_tokens": 1}, timeout=60)
        assert says in refused(r, 400, param)["message"]


def test_head_reads_the_get_routes_and_a_trailing_slash_is_a_404_naming_the_routes(server):
    """A health checker's HEAD got 405; a POST to /v1/completions/ got a bare 307 to a URL built from the client's
    Host header (httpx and openai do not follow it on a POST, so the client saw an empty answer)."""
    for path in ("/health", "/v1/models"):
        r = httpx.head(server.url + path, timeout=30)
        assert r.status_code == 200 and r.content == b"" and int(r.headers["content-length"]) > 0, path
    r = httpx.post(f"{server.url}/v1/completions/", json={"prompt": "Hi", "max_tokens": 1}, headers={"Host": "x"})
    error = refused(r, 404, None)
    assert "no route POST /v1/completions/" in error["message"] and "/v1/completions," in error["message"]
    assert error["message"].count("/v1/models") == 1, error["message"]
    # HEAD is in the OpenAPI document (Schemathesis fuzzes it) under its own operationId: one route of GET and HEAD
    # gave both the GET's, and fastapi warned "Duplicate Operation ID" each time the document was built
    paths = httpx.get(server.url + "/openapi.json", timeout=30).json()["paths"]
    ids = [operation["operationId"] for item in paths.values() for operation in item.values()]
    assert len(ids) == len(set(ids)), sorted(ids)
    assert all(set(paths[p]) == {"get", "head"} for p in ("/health", "/metrics", "/v1/models", "/v1/models/{model}"))
    r = httpx.post(server.url + "/health", timeout=30)
    assert refused(r, 405, None)["message"] == "POST /health: this route does not take POST"


def _two_answers(url: str, requests: bytes) -> bytes:
    """What one connection answers to `requests` (two, sent at once), read until both answers are whole."""
    sock = _connect(url)
    sock.sendall(requests)
    sock.settimeout(30)
    data = b""
    while data.count(b"HTTP/1.1 ") < 2 or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        assert chunk, data[-300:]
        data += chunk
    sock.close()
    return data


def test_bodies_past_max_header_kb_are_no_head_pipelined_or_behind_an_early_answer(tiny):
    """Only a head is bounded by serve.max_header_kb: two pipelined requests with 100 KB bodies are both served,
    and a 404 answered before its 100 KB body is read leaves the connection serving the next request (the count
    once ran on from an answer into the bytes that followed it, a stray 431 in the middle of a response)."""
    srv = start_server(make_engine(tiny, sampling=SamplingParams()), None, max_header_kb=16)
    body = b'{"prompt": "Hi", "max_tokens": 1}' + b" " * 100_000
    request = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
    try:
        data = _two_answers(srv.url, request % (b"/v1/completions", len(body), body) * 2)
        assert data.count(b"HTTP/1.1 200 OK") == 2, data[:500]
        data = _two_answers(
            srv.url, request % (b"/v1/nowhere", len(body), body) + request % (b"/v1/completions", len(body), body)
        )
        # a 431's status line, not the digits: a random completion id holds "431" one time in some hundreds
        assert b"HTTP/1.1 404" in data and b"HTTP/1.1 200 OK" in data and b"HTTP/1.1 431" not in data, data[:500]
    finally:
        srv.stop()
