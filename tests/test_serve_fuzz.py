"""The HTTP API fuzzed from its own OpenAPI schema (Schemathesis, live server on loopback, tiny model): whatever a
client sends that the schema allows or not, the answer is never a 500, every error is JSON in OpenAI's shape with
a 4xx, and the server stays healthy. Bounded: a fixed number of generated requests per route."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tests.conftest import make_engine, once
from toolkit.sampling.params import SamplingParams
from toolkit.serve.main import start_server

pytestmark = pytest.mark.native


@pytest.fixture(scope="module")
def live(tiny):
    # max_tokens past this is a 400 (the context), so a generated request costs at most a few steps
    srv = start_server(make_engine(tiny, sampling=SamplingParams(), max_model_len=96, max_num_seqs=8), None)
    yield srv
    srv.stop()


def operations(url: str) -> list:
    """Every operation of the live server's /openapi.json (the two generation routes, models, health, metrics)."""
    return [result.ok() for result in schemathesis.openapi.from_url(url + "/openapi.json").get_all_operations()]


@once
def test_no_request_gets_a_500_or_a_non_json_error(live):
    ops = operations(live.url)
    assert {f"{op.method.upper()} {op.path}" for op in ops} >= {"POST /v1/completions", "POST /v1/chat/completions"}
    assert all(op.body for op in ops if op.method == "post")  # the bodies are in the schema: fuzzed, not guessed
    seen: dict[int, int] = {}
    for op in ops:

        @given(case=op.as_strategy())
        @settings(
            max_examples=60,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.generate],
        )
        def check(case):
            response = case.call(timeout=60)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500 or response.status_code == 503, (
                case.path,
                response.status_code,
                response.text[:300],
            )
            if response.status_code >= 400 and case.path.startswith("/v1/") and case.method.upper() != "HEAD":
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"], error

        check()
    print(f"answers by status: {dict(sorted(seen.items()))}")
    assert seen.get(200, 0) > 0 and any(400 <= status < 500 for status in seen)  # both kinds were reached


def test_the_server_is_healthy_after_the_fuzzing(live):
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}
    ok = httpx.post(live.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
