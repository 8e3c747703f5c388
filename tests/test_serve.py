"""The OpenAI-compatible server, driven by the real `openai` client (and httpx for raw bodies) over loopback,
serving the real SmolLM2: what it answers is what the engine computes, every request is traced, a served run
replays bit for bit and verifies, bad requests are 400s naming the field, a client that leaves frees its blocks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from tests.conftest import make_engine, native_only
from toolkit import replay, verify
from toolkit.bench.one_stream import free_port, thread_cpu_s
from toolkit.sampling.params import SamplingParams
from toolkit.serve.main import serving_engine, start_server
from toolkit.trace.reader import read_config, read_requests, read_samples

pytestmark = [pytest.mark.native, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "Name three colours."}]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    engine = make_engine(smollm2, max_num_seqs=32, sampling=SamplingParams())
    srv = start_server(engine, tmp_path_factory.mktemp("served"), {"model": {"name": "smollm2"}})
    yield srv
    srv.stop()


def metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_completion_is_what_the_engine_computes(server, smollm2):
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["smollm2"]
    got = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=12, temperature=0)
    want = make_engine(smollm2).generate(
        [{"prompt": "The capital of France is", "sampling_params": SamplingParams(temperature=0, max_tokens=12)}]
    )[0]
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == len(want.output_token_ids) and got.usage.prompt_tokens == len(
        want.prompt_token_ids
    )
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_token_id_prompts_batches_and_n(server):
    c = client(server)
    one = c.completions.create(model="smollm2", prompt=[504, 3575, 282], max_tokens=4, temperature=0)
    assert one.choices[0].finish_reason in ("length", "stop") and one.usage.prompt_tokens == 3
    many = c.completions.create(
        model="smollm2", prompt=[[504, 3575, 282], [504, 3575, 282, 314]], n=2, max_tokens=5, temperature=1.0, seed=3
    )
    assert sorted(ch.index for ch in many.choices) == [0, 1, 2, 3]
    assert many.usage.prompt_tokens == 7 and many.usage.completion_tokens <= 4 * 5
    texts = c.completions.create(model="smollm2", prompt=["Once upon a time", "The sea"], max_tokens=3, temperature=0)
    assert [ch.index for ch in texts.choices] == [0, 1]
    # greedy under n=2 gives the same text twice; the token-id prompt's sample equals the single request's
    greedy = c.completions.create(model="smollm2", prompt=[504, 3575, 282], n=2, max_tokens=4, temperature=0)
    assert greedy.choices[0].text == greedy.choices[1].text == one.choices[0].text


def test_chat_logprobs_are_a_distribution_and_name_the_chosen_token(server):
    r = client(server).chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == tops[0]  # greedy: the chosen token is the most likely (raw) one
        assert entry.top_logprobs[0].token == entry.token and bytes(entry.bytes).decode() == entry.token
        assert sum(2.718281828**lp for lp in tops) <= 1.0 + 1e-6
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_streaming_gives_the_same_text_and_usage(server):
    c = client(server)
    kwargs = dict(model="smollm2", messages=CHAT, max_tokens=16, temperature=0.8, seed=5)
    whole = c.chat.completions.create(**kwargs)
    chunks = list(c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    streamed = c.completions.create(
        model="smollm2", prompt="Once upon a time", max_tokens=10, temperature=0, stream=True, logprobs=1
    )
    pieces = list(streamed)
    flat = c.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=1)
    assert "".join(p.choices[0].text for p in pieces) == flat.choices[0].text
    assert [x for p in pieces for x in p.choices[0].logprobs.token_logprobs] == flat.choices[0].logprobs.token_logprobs


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_json_schema_and_json_object_are_valid_json(server):
    c = client(server)
    r = c.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        n=2,
        seed=1,
        temperature=0.7,
    )
    for choice in r.choices:  # a sampled path may run long (the name is an unbounded string): then a prefix
        if choice.finish_reason == "length":
            assert choice.message.content.lstrip().startswith("{"), choice  # the grammar's own tests hold the rest
            continue
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    r = c.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": 'Give a JSON object with one key "city" for the capital of France.'}],
        max_tokens=60,
        response_format={"type": "json_object"},
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


BAD = [  # (route, body, status, param)
    ("chat/completions", {"messages": CHAT, "temperature": -1}, 400, "temperature"),
    ("chat/completions", {"messages": CHAT, "top_p": 1.5}, 400, "top_p"),
    ("chat/completions", {"messages": CHAT, "n": 0}, 400, "n"),
    ("chat/completions", {"messages": CHAT, "max_tokens": 10**6}, 400, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "max_tokens": "many"}, 400, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "frobnicate": 1}, 400, "frobnicate"),
    ("chat/completions", {"messages": CHAT, "tools": []}, 400, "tools"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("chat/completions", {}, 400, "messages"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs"),
    (
        "chat/completions",
        {"messages": CHAT, "response_format": {"type": "json_schema"}},
        400,
        "response_format.json_schema.schema",
    ),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (
        "chat/completions",
        {"messages": CHAT, "stream_options": {"include_usage": True, "x": 1}},
        400,
        "stream_options.x",
    ),
    ("chat/completions", {"messages": CHAT, "logit_bias": {"notanid": 1}}, 400, "logit_bias"),
    ("chat/completions", {"messages": CHAT, "seed": -4}, 400, "seed"),
    ("chat/completions", {"messages": CHAT, "model": "gpt-9"}, 404, "model"),
    ("completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "x", "presence_penalty": 9}, 400, "presence_penalty"),
    ("chat/completions", {"messages": CHAT, "store": True}, 400, "store"),
    ("chat/completions", {"messages": CHAT, "service_tier": "flex"}, 400, "service_tier"),
    ("chat/completions", {"messages": None}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages.0.content"),  # read as "" before
    ("chat/completions", {"messages": [{"role": "user", "content": None}]}, 400, "messages.0.content"),
    ("chat/completions", {"messages": [*CHAT, {"role": "tool", "content": "42"}]}, 400, f"messages.{len(CHAT)}.role"),
    ("chat/completions", {"messages": CHAT, "tool_choice": "auto"}, 400, "tool_choice"),
    ("chat/completions", {"messages": CHAT, "modalities": ["text", "audio"]}, 400, "modalities"),
    (  # a schema referring outside itself: xgrammar left that part unconstrained (a 200, the output unchecked)
        "chat/completions",
        {
            "messages": CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "r", "schema": {"properties": {"a": {"$ref": "https://example.com/a.json"}}}},
            },
        },
        400,
        "response_format.json_schema.schema",
    ),
    (  # a keyword xgrammar compiles but does not enforce: a 200 whose output could be [1, 1]
        "chat/completions",
        {
            "messages": CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "u",
                    "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                },
            },
        },
        400,
        "response_format.json_schema.schema",
    ),
]


@pytest.mark.parametrize("route, body, status, param", BAD, ids=[f"{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_request_is_a_4xx_naming_the_field(server, route, body, status, param):
    r = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and "\n" not in error["message"] and error["type"]


def test_null_fields_take_their_defaults(server):
    """OpenAI's optional fields take null for "not given", and clients send it: the answer is the one without
    them. A completion's max_tokens left at null is OpenAI's default, 16."""
    base = {"model": "smollm2", "messages": CHAT, "max_tokens": 4, "temperature": 0}
    nulls = dict.fromkeys(
        ["n", "stream", "logprobs", "top_logprobs", "stop", "seed", "stream_options", "response_format", "user"]
        + ["store", "service_tier", "metadata", "logit_bias", "max_completion_tokens", "presence_penalty"]
    )
    tiers = {"store": False, "service_tier": "auto", "metadata": {"run": "1"}}  # what those fields mean by default
    # and what asks for nothing this server lacks, as vLLM takes it: no tool call, either policy, text output
    tiers |= {"tool_choice": "none", "parallel_tool_calls": False, "modalities": ["text"]}
    plain, *others = (
        httpx.post(f"{server.url}/v1/chat/completions", json={**base, **extra}, timeout=60).json()
        for extra in ({}, nulls, tiers)
    )
    for other in others:
        assert other["choices"] == plain["choices"] and other["usage"] == plain["usage"], other
    body = {"model": "smollm2", "prompt": "Once", "max_tokens": None, "echo": None, "n": None, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text


def test_models_retrieve_and_unknown_routes_answer_in_openais_shape(server):
    c = client(server)
    assert c.models.retrieve("smollm2").id == "smollm2"
    with pytest.raises(openai.NotFoundError, match="'gpt-9' does not exist"):
        c.models.retrieve("gpt-9")
    with pytest.raises(openai.NotFoundError, match="no route POST /v1/embeddings"):
        c.embeddings.create(model="smollm2", input="hi")
    r = httpx.get(f"{server.url}/v1/chat/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    assert set(r.json()["error"]) == {"message", "type", "param", "code"} and "does not take GET" in r.text


def test_bad_json_and_the_server_still_serves(server):
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    ok = client(server).completions.create(model="smollm2", prompt="Hi", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_prompt_logprobs_with_echo_match_generation(server):
    """lm-eval's loglikelihood request: echo + logprobs + max_tokens 1 scores every prompt token."""
    c = client(server)
    prompt = [504, 3575, 282, 4649, 314]
    gen = c.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0, logprobs=0)
    scored = c.completions.create(
        model="smollm2", prompt=prompt + [0], max_tokens=1, temperature=0, logprobs=2, echo=True
    )
    lp = scored.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(prompt) + 2
    greedy_top = max(lp.top_logprobs[len(prompt)].values())
    gen_lp = gen.choices[0].logprobs.token_logprobs[0]
    assert abs(greedy_top - gen_lp) < 1e-4  # the prompt position's best alternative is what generation picked
    assert scored.choices[0].text.startswith(
        c.completions.create(model="smollm2", prompt=prompt + [0], max_tokens=1, temperature=0, echo=True)
        .choices[0]
        .text[:3]
    )


def test_echo_with_max_tokens_0_answers_the_prompt_scored_alone(server):
    """OpenAI's legacy scoring (lm-eval's old gpt3 model): echo + logprobs + max_tokens 0 is the prompt with its
    logprobs, no completion (vLLM's too: one token is sampled, and traced, but not answered); without echo, and
    in a chat, max_tokens 0 stays a 400. Streamed, the echo then the finish, and usage counts no completion."""
    c = client(server)
    prompt = [504, 3575, 282, 4649, 314]
    scored = c.completions.create(model="smollm2", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    one = c.completions.create(model="smollm2", prompt=prompt, max_tokens=1, echo=True, logprobs=2, temperature=0)
    got, lp, want = scored.choices[0], scored.choices[0].logprobs, one.choices[0].logprobs
    assert (len(lp.tokens), got.finish_reason, scored.usage.completion_tokens) == (len(prompt), "length", 0)
    assert lp.token_logprobs == want.token_logprobs[: len(prompt)] and lp.tokens == want.tokens[: len(prompt)]
    assert got.text == one.choices[0].text[: len(got.text)] and len(got.text) < len(one.choices[0].text)
    body = {"prompt": "Once upon", "max_tokens": 0, "echo": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = [(e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in events if e["choices"]]
    assert texts == [("Once upon", None), ("", "length")] and events[-1]["usage"]["completion_tokens"] == 0
    for route, body in (
        ("completions", {"prompt": "Hi"}),
        ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        r = httpx.post(f"{server.url}/v1/{route}", json={**body, "max_tokens": 0}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("max_tokens", "max_completion_tokens"), r.text


def test_a_completions_top_logprobs_hold_the_chosen_token(server):
    """OpenAI's legacy completions: "the API will always return the logprob of the sampled token, so there may be up
    to logprobs+1 elements": each position's alternatives hold its own token (sampled, or the prompt's with echo)."""
    c = client(server)
    for k in (0, 1):
        got = c.completions.create(
            model="smollm2", prompt="Once upon a", max_tokens=12, temperature=1.5, seed=k, logprobs=k, echo=True
        ).choices[0]
        lp = got.logprobs
        for token, logprob, top in list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))[1:]:
            assert top[token] == logprob and len(top) <= k + 1, (token, top)
        assert any(len(top) == 2 for top in lp.top_logprobs[1:]) or k == 0  # sampled off the top one somewhere


def test_a_client_that_leaves_frees_its_blocks(server):
    body = {
        "model": "smollm2",
        "prompt": "Write a long story about the sea.",
        "max_tokens": 3000,
        "temperature": 0.8,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held: a dropped generator closes the stream, and the client is gone early
        events = 0
        while events < 3:
            events += next(lines).startswith("data:")
        assert metric(server, "toolkit_kv_blocks_used") > 0 and metric(server, "toolkit_num_requests_running") == 1
    deadline = time.time() + 10  # far less than the 3000 tokens would take: only an abort frees the blocks in time
    while time.time() < deadline and (
        metric(server, "toolkit_kv_blocks_used") or metric(server, "toolkit_num_requests_running")
    ):
        time.sleep(0.1)
    assert metric(server, "toolkit_kv_blocks_used") == 0 and metric(server, "toolkit_num_requests_running") == 0
    text = httpx.get(server.url + "/metrics").text
    assert 'finished_reason="abort"' in text and "toolkit_time_to_first_token_seconds_count" in text


@native_only  # batch-invariant mode
def test_a_seed_gives_the_same_tokens_alone_and_among_16_concurrent_requests(smollm2, tmp_path):
    engine = make_engine(smollm2, max_num_seqs=32, batch_invariant=True, sampling=SamplingParams())
    srv = start_server(engine, tmp_path / "run")
    try:
        c = client(srv)
        ask = lambda seed, content: c.chat.completions.create(  # noqa: E731
            model="smollm2",
            messages=[{"role": "user", "content": content}],
            max_tokens=24,
            temperature=1.0,
            seed=seed,
            logprobs=True,
        )
        alone = ask(7, "Tell me about tea.")
        with ThreadPoolExecutor(16) as pool:
            futures = [
                pool.submit(
                    ask, 7 if i == 5 else 100 + i, "Tell me about tea." if i == 5 else f"Tell me about the number {i}."
                )
                for i in range(16)
            ]
            together = [f.result() for f in futures]
        assert together[5].choices[0].message.content == alone.choices[0].message.content
        assert [e.logprob for e in together[5].choices[0].logprobs.content] == [
            e.logprob for e in alone.choices[0].logprobs.content
        ]
        assert max(s["batch_size"] for s in pq.read_table(tmp_path / "run" / "samples.parquet").to_pylist()) > 1
    finally:
        srv.stop()


def test_a_served_run_is_traced_replayed_bit_identical_and_verified(smollm2, tmp_path):
    run_dir = tmp_path / "run"
    engine = make_engine(smollm2, max_num_seqs=8, max_num_batched_tokens=64, sampling=SamplingParams())
    srv = start_server(
        engine, run_dir, {"model": {"name": "smollm2"}, "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 64}}
    )
    c = client(srv)
    bodies = [
        dict(
            model="smollm2",
            prompt=f"Item {i}: the",
            max_tokens=10 + i,
            temperature=0.9,
            logprobs=1,
            **({"seed": i} if i % 2 else {}),
        )
        for i in range(6)
    ]
    try:
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(c.completions.create, **b) for b in bodies]
            futures.append(
                pool.submit(
                    c.chat.completions.create, model="smollm2", messages=CHAT, n=2, max_tokens=12, temperature=0.7
                )
            )
            # one client leaves mid-stream
            with httpx.stream(
                "POST",
                f"{srv.url}/v1/completions",
                json={"prompt": "A very long text:", "max_tokens": 300, "ignore_eos": True, "stream": True},
            ) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i > 6:
                        break
            answers = [f.result() for f in futures]
    finally:
        srv.stop()
    requests = read_requests(run_dir).to_pylist()
    samples = read_samples(run_dir).to_pylist()
    by_id = {r["request_id"]: r for r in requests if r["stream"] == 0}
    for body, answer in zip(bodies, answers):
        row = by_id[answer.id + "-0"]
        assert json.loads(row["request_body"]) == body  # the body as received
        assert row["seed"] == body.get("seed", row["seed"]) and row["seed"] is not None
        traced = [
            s["raw_logprob"]
            for s in sorted((s for s in samples if s["request_id"] == answer.id + "-0"), key=lambda s: s["position"])
        ]
        import struct

        f32 = lambda x: struct.unpack("<f", struct.pack("<f", x))[0]  # noqa: E731
        assert [f32(x) for x in answer.choices[0].logprobs.token_logprobs] == traced
    aborted = [r for r in requests if r["finish_reason"] == "abort"]
    assert len(aborted) == 1 and aborted[0]["abort_step"] is not None
    assert len([r for r in requests if r["request_id"] == answers[-1].id + "-0"]) == 2  # n=2: a row per sample
    assert json.loads((run_dir / "summary.json").read_text())["served"] is True
    report = replay(run_dir, out_dir=tmp_path / "replayed")
    assert report.identical and report.rows_compared == len(samples), report.summary_line()
    checked = verify(run_dir)
    assert checked.passed, checked.summary_line()


def _serve_process(run_dir: Path, port: int, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            "run.py",
            "mode=serve",
            f"serve.port={port}",
            f"hydra.run.dir={run_dir}",
            "engine.num_threads=1",
            *overrides,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.time() + 120
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not start")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill-9"])
def test_mode_serve_closes_cleanly_on_sigterm_and_stays_readable_after_kill_9(tmp_path, sig):
    run_dir, port = tmp_path / "served", free_port()
    # a grammar that would compile for minutes (past its 1 s limit: a 400, its child process killed) leaves
    # nothing that keeps the process alive at the signal: the compiler's threads were joined at exit, and a stopped
    # server ran on
    proc = _serve_process(run_dir, port, "serve.grammar_timeout_s=1", "serve.max_schema_chars=100000")
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        c.completions.create(model="smollm2", prompt="Finished before the signal:", max_tokens=20, temperature=0.5)
        if sig == signal.SIGTERM:
            schema = {"type": "string", "enum": ["x" * 40_000 + end for end in "ab"]}  # minutes to compile
            with pytest.raises(openai.BadRequestError, match="serve.grammar_timeout_s=1"):
                c.chat.completions.create(
                    model="smollm2",
                    messages=[{"role": "user", "content": "Pick"}],
                    max_tokens=2,
                    response_format={"type": "json_schema", "json_schema": {"name": "slow", "schema": schema}},
                )
        pool = ThreadPoolExecutor(3)

        def stream(i: int) -> str | None:  # the finish_reason its last chunk carried
            chunks = c.completions.create(
                model="smollm2",
                prompt=f"Story {i}:",
                max_tokens=600,
                temperature=0.8,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1]

        streams = [pool.submit(stream, i) for i in range(3)]  # still generating when the signal comes
        time.sleep(2)
        proc.send_signal(sig)
        proc.wait(60)
        pool.shutdown(wait=True, cancel_futures=True)
    finally:
        if proc.poll() is None:
            proc.kill()
    if sig == signal.SIGTERM:  # each stream ended (no client cut mid-chunk), and the server logged no traceback
        assert [f.result() for f in streams] == ["abort"] * 3
        assert "Traceback" not in proc.stdout.read()
    samples = read_samples(run_dir)  # readable either way
    assert samples.num_rows >= 20
    requests = read_requests(run_dir)
    assert requests.num_rows == 4
    if sig == signal.SIGTERM:
        assert proc.returncode == 0 and (run_dir / "summary.json").is_file()
        assert (run_dir / "report.html").is_file()  # written once the served run is closed
        assert sorted(r["finish_reason"] for r in requests.to_pylist())[:3] == ["abort"] * 3
    assert read_config(run_dir).engine.max_chunk_tokens == 256  # half the step budget, as served (serving_engine)
    assert read_config(run_dir).engine.scheduling_policy == "priority"  # a server's default, recorded for replay
    assert read_config(run_dir).engine.dynamic_chunking == "auto"  # chunks shrink with their context, replayed so
    report = replay(run_dir, out_dir=tmp_path / "replayed")
    assert report.identical, report.summary_line()
    assert report.rows_only_in_replay == 0  # the replay ends where the trace does, not at max_tokens


def test_a_server_caps_a_prefill_chunk_at_half_the_step_budget_so_later_prompts_get_in(tiny):
    """engine.max_chunk_tokens null is half the step budget when served (serving_engine): a long prompt's prefill
    leaves room in every step, and a short prompt sent after it gets its first token in the next step, not after
    the whole prefill (27 s behind 8,000 tokens of SmolLM2 on the CPU). A value given is kept."""
    cfg = OmegaConf.create({"engine": {"max_num_batched_tokens": 64, "max_chunk_tokens": None}})
    assert serving_engine(cfg).engine.max_chunk_tokens == 32
    assert serving_engine(OmegaConf.create({"engine": {"max_chunk_tokens": 8}})).engine.max_chunk_tokens == 8
    assert serving_engine(cfg).engine.dynamic_chunking == "auto"  # served chunks shrink as their context grows
    for given in (False, 700):  # engine.dynamic_chunking=off (YAML's false) and a length are kept
        assert (
            serving_engine(OmegaConf.create({"engine": {"dynamic_chunking": given}})).engine.dynamic_chunking == given
        )
    firsts = {}
    for chunk in (None, 32):
        engine = make_engine(tiny, max_num_batched_tokens=64, max_chunk_tokens=chunk)
        engine.add_request(prompt_token_ids=[3] * 600, sampling_params=SamplingParams(max_tokens=1))
        short = engine.add_request(prompt_token_ids=[5, 6], sampling_params=SamplingParams(max_tokens=2))
        step = 0
        while not any(sample.request_id == short for sample in engine.step().samples):
            step += 1
        firsts[chunk] = step
    assert firsts[32] == 0 and firsts[None] >= 9, firsts  # 600 tokens at 64 a step, before


def test_the_server_runs_uvicorns_c_event_loop_and_http_parser(server):
    """uvloop and httptools are serve's dependencies, which uvicorn takes when they import: the event loop's Python
    per streamed token is what a token costs beyond its step (it competes with the step for the GIL and the cores;
    docs/serving.md). Without them uvicorn would quietly run asyncio's loop and h11."""
    config = server.uvicorn.config
    assert config.get_loop_factory().__module__.startswith("uvloop")
    assert "HttpToolsProtocol" in [c.__name__ for c in config.http_protocol_class.__mro__]  # with a head timer


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")
def test_the_servers_threads_carry_their_names_in_the_os(server):
    """top -H, py-spy and toolkit.bench.one_stream's CPU a token by thread read the OS's thread names: the engine's
    thread and the trace writer's are named there (the engine's OpenMP workers inherit its name once it has stepped),
    and one_stream's reader sums this process's CPU under those names. The trace writer runs at a lower CPU
    priority than the engine's threads (its encoding takes the cores' gaps, not a step's core)."""
    httpx.post(server.url + "/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2}, timeout=60)
    tasks = list(Path(f"/proc/{os.getpid()}/task").iterdir())
    names = [(t / "comm").read_text().strip() for t in tasks]
    assert "engine-loop" in names and "trace-writer" in names
    cpu = thread_cpu_s(os.getpid())
    assert cpu["engine-loop"] > 0 and set(cpu) == set(names)
    nice = {}  # thread name -> its threads' nice values
    for task, name in zip(tasks, names):
        nice.setdefault(name, set()).add(os.getpriority(os.PRIO_PROCESS, int(task.name)))
    base = os.getpriority(os.PRIO_PROCESS, 0)  # this thread's, which the server's threads inherit
    assert min(nice["trace-writer"]) == min(base + 10, 19) and max(nice["engine-loop"]) == base
    assert base == 19 or base < min(nice["trace-writer"])  # (a suite run at nice 19 has no lower priority left)


def test_a_stopped_server_lets_its_engine_go(tiny, tmp_path):
    """After a request and stop(), nothing the server built keeps its engine (the KV cache: 2 GB by default) alive:
    fastapi keeps every endpoint in module-level caches, so a route bound to the server held a stopped server's
    engine for the life of the process (a test worker piled 13 GB of them). A request after the Api is gone gets a
    503 in OpenAI's shape."""
    import gc
    import weakref

    from toolkit.serve import api

    engine = make_engine(tiny, max_num_seqs=2, sampling=SamplingParams())
    srv = start_server(engine, tmp_path / "run", {"model": {"name": "tiny"}})
    done = client(srv).completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2)
    assert done.usage.completion_tokens == 2
    srv.stop()
    gone = weakref.ref(engine)
    del engine, srv
    gc.collect()
    assert gone() is None

    class Held:
        async def health(self):
            return "ok"

    held = Held()
    endpoint = api._weakly(held.health)
    del held
    gc.collect()
    response = asyncio.run(endpoint())
    assert response.status_code == 503 and json.loads(response.body)["error"]["type"] == "server_error"
