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
