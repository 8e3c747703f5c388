"""What a request left unsaid becomes on the server: a chat without max_tokens generates to the end of the context
(OpenAI's and vLLM's default), resolved by the engine's intake as toolkit.LLM's max_tokens=None is, and recorded as
the number it became."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import make_engine
from toolkit.sampling.params import SamplingParams
from toolkit.serve.main import start_server
from toolkit.trace.reader import read_requests

pytestmark = pytest.mark.native


def test_a_chat_without_max_tokens_runs_to_the_end_of_the_context(tiny, tmp_path):
    engine = make_engine(tiny, max_model_len=64, sampling=SamplingParams())
    server = start_server(engine, tmp_path, {"model": {"name": "tiny"}})
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    finally:
        server.stop()
    usage = answer["usage"]
    assert answer["choices"][0]["finish_reason"] == "length", answer
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
    (row,) = read_requests(tmp_path).to_pylist()
    assert json.loads(row["sampling_params"])["max_tokens"] == usage["completion_tokens"]


def test_what_looks_like_a_bad_value_and_is_not_is_served(tiny):
    """The body check that refuses NaN, Infinity and lone surrogates (tests/test_serve_hostile.py) passes what only
    looks like them: the words NaN and Infinity inside strings, a surrogate pair's escapes (one emoji), and a
    UTF-16 body. Each is the plain request's answer, its prompt as the escapes spell it."""
    server = start_server(make_engine(tiny, sampling=SamplingParams()), None)
    try:

        def post(raw: bytes) -> httpx.Response:
            return httpx.post(
                f"{server.url}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=60
            )

        def tokens(prompt: str) -> list[int]:
            body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 0, "echo": True}
            answer = post(json.dumps(body).encode()).json()
            return answer["choices"][0]["logprobs"]["tokens"]

        spelled = (
            '{"prompt": "NaN Infinity \\ud83d\\ude00", "max_tokens": 3, "temperature": 0, "logprobs": 0, "echo": true}'
        )
        for raw in (spelled.encode(), spelled.encode("utf-16")):
            answer = post(raw)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["logprobs"]["tokens"] == tokens("NaN Infinity \U0001f600")
    finally:
        server.stop()
