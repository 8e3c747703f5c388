"""The server under overload, hostile input and failures on its engine thread, over real HTTP on loopback (tiny
model): every answer is 200 or 503 past serve.max_waiting, keys and limits are enforced with OpenAI-shaped errors,
an exception on the engine thread is one request's 500, a slow reader's updates are merged, and a served run is
written append-only (requests.parquet parts), read back in arrival order and replayed bit for bit."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pyarrow.parquet as pq
import pytest
import torch
from fastapi.responses import JSONResponse
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import NATIVE_OFF, make_engine, once
from toolkit import replay
from toolkit.engine.outputs import TextDelta
from toolkit.engine.request import EngineRequest
from toolkit.errors import ConfigError
from toolkit.sampling.params import SamplingParams
from toolkit.serve.loop import LoopSink, Update, _wait_taken
from toolkit.serve.mailbox import Mailbox
from toolkit.serve.main import start_server
from toolkit.trace.reader import read_rejected, read_requests, read_samples
from toolkit.trace.writer import OPEN_REQUESTS_FILE, REQUESTS_FILE


def _engine(tiny, **kwargs):
    return make_engine(tiny, sampling=SamplingParams(), **{"max_num_seqs": 8, **kwargs})


def _post(url: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=60, **kwargs)


@pytest.mark.native
@once
def test_overload_is_answered_200_or_503_and_the_server_then_serves_normally(tiny, tmp_path):
    run_dir = tmp_path / "run"
    # (512 connections from one address: past serve.max_connections_per_client, which this test is not about)
    srv = start_server(_engine(tiny, max_num_seqs=4), run_dir, max_waiting=32, max_connections_per_client=1024)
    body = {"prompt": "Overload", "max_tokens": 24, "ignore_eos": True, "temperature": 0.8}

    async def flood() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=512)
        async with httpx.AsyncClient(base_url=srv.url, limits=limits, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json={**body, "seed": i}) for i in range(512)))

    try:
        answers = asyncio.run(flood())
        statuses = [r.status_code for r in answers]
        assert set(statuses) == {200, 503}, sorted(set(statuses))  # none 500, none hangs (gather returned)
        for r in answers:
            if r.status_code == 503:
                assert int(r.headers["retry-after"]) >= 1
                error = r.json()["error"]
                assert error["code"] == "server_overloaded" and "serve.max_waiting=32" in error["message"]
        assert httpx.get(srv.url + "/health").status_code == 200
        after = _post(srv.url, {**body, "seed": 999})
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 24
    finally:
        srv.stop()
    accepted = statuses.count(200) + 1
    requests = read_requests(run_dir)
    assert requests.num_rows == accepted  # the trace holds every accepted request
    assert read_samples(run_dir).num_rows == 24 * accepted
    rejected = read_rejected(run_dir).to_pylist()
    assert len(rejected) == statuses.count(503) and {r["status"] for r in rejected} == {503}
    assert [r["arrival_index"] for r in requests.to_pylist()] == list(range(accepted))


@pytest.mark.native
def test_api_keys_body_size_and_list_limits(tiny, monkeypatch):
    monkeypatch.setenv("TOOLKIT_API_KEY", "from-env")
    srv = start_server(
        _engine(tiny),
        None,
        api_key=["k1", "k2"],
        metrics_public=False,
        max_body_mb=0.01,
        max_prompts=4,
        max_stop=3,
        max_bad_words=2,
        max_logit_bias=5,
    )
    ok = {"prompt": "Hi", "max_tokens": 2}
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k1"}, {"Authorization": "Basic k1"}):
            r = _post(srv.url, ok, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/metrics").status_code == 401  # metrics_public=false
        assert httpx.get(srv.url + "/health").status_code == 200  # /health stays open
        for key in ("k1", "k2", "from-env"):
            assert _post(srv.url, ok, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="k2", max_retries=0)
        assert c.completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
        auth = {"Authorization": "Bearer k1"}
        big = _post(srv.url, {"prompt": "x" * 20000, "max_tokens": 2}, headers=auth)
        assert big.status_code == 413 and "serve.max_body_mb" in big.json()["error"]["message"]
        chunked = httpx.post(
            srv.url + "/v1/completions", content=iter([b'{"prompt": "', b"y" * 20000, b'"}']), headers=auth
        )  # no content-length: counted as it arrives
        assert chunked.status_code == 413
        for field, value in (
            ("stop", ["a", "b", "c", "d"]),
            ("stop_token_ids", [1, 2, 3, 4]),
            ("bad_words", ["a", "b", "c"]),
            ("logit_bias", {str(i): 1.0 for i in range(6)}),
            ("prompt", ["a"] * 5),
        ):
            r = _post(srv.url, {**ok, field: value}, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
        at_limit = {**ok, "stop": ["a", "b", "c"], "logit_bias": {str(i): 1.0 for i in range(5)}}
        assert _post(srv.url, at_limit, headers=auth).status_code == 200
    finally:
        srv.stop()


@pytest.mark.native
def test_an_exception_on_the_engine_thread_is_one_requests_500(tiny, tmp_path):
    engine = _engine(tiny)
    srv = start_server(engine, tmp_path / "run")
    add, run = engine.add, engine.runner.run
    fail_next_step = threading.Event()

    def add_request(request):
        if request.prompt == "boom":
            raise KeyError("injected while adding")
        return add(request)

    def forward(*args, **kwargs):  # the model runner, inside a step, after the batch was scheduled
        if fail_next_step.is_set():
            fail_next_step.clear()
            raise RuntimeError("injected while stepping")
        return run(*args, **kwargs)

    engine.add, engine.runner.run = add_request, forward
    try:
        r = _post(srv.url, {"prompt": "boom", "max_tokens": 3})
        assert r.status_code == 500 and "injected while adding" in r.json()["error"]["message"]
        assert "\n" not in r.json()["error"]["message"]
        assert _post(srv.url, {"prompt": "next", "max_tokens": 3}).status_code == 200
        fail_next_step.set()
        r = _post(srv.url, {"prompt": "stepped", "max_tokens": 3})
        assert r.status_code == 500 and "injected while stepping" in r.json()["error"]["message"]
        assert httpx.get(srv.url + "/health").status_code == 200
        assert _post(srv.url, {"prompt": "and after", "max_tokens": 3}).status_code == 200
        assert engine.block_manager.num_used_blocks == 0 and not engine.requests  # nothing kept of them
    finally:
        srv.stop()
    failed = read_rejected(tmp_path / "run").to_pylist()
    assert [r["status"] for r in failed] == [500, 500]
    assert "injected while adding" in failed[0]["reason"] and "injected while stepping" in failed[1]["reason"]


@pytest.mark.native
def test_a_poison_request_among_32_is_the_only_500(tiny, tmp_path):
    """32 concurrent completions, one of them poison (the model's forward raises whenever it is in the batch
    from its 3rd token on): it alone gets a 500 in OpenAI's shape, recorded in rejected.parquet; the 31 others
    get 200 with exactly the text and logprobs of a server that never saw it (batch-invariant kernels; on the
    torch fallback, which has no batch-invariant mode, the answers alone), and the server stays healthy."""

    def serve(with_poison: bool, run_dir):
        engine = _engine(tiny, batch_invariant=not NATIVE_OFF, max_num_seqs=32, max_num_batched_tokens=512)
        run = engine.runner.run

        def forward(batch, *args, **kwargs):
            for chunk in batch.chunks:
                seq = engine.requests[chunk.seq_id]
                if seq.prompt_text == "poison" and seq.num_output_tokens >= 2:
                    raise RuntimeError("poisoned forward")
            return run(batch, *args, **kwargs)

        engine.runner.run = forward
        srv = start_server(engine, run_dir)
        bodies = [
            {
                "prompt": f"Request {i} says",
                "max_tokens": 6,
                "ignore_eos": True,
                "temperature": 0.9,
                "seed": i,
                "logprobs": 1,
            }
            for i in range(31)
        ]
        if with_poison:
            bodies.insert(13, {"prompt": "poison", "max_tokens": 6, "ignore_eos": True})

        async def all_at_once() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

        try:
            answers = asyncio.run(all_at_once())
            assert httpx.get(srv.url + "/health").status_code == 200
            assert _post(srv.url, {"prompt": "after", "max_tokens": 2}).status_code == 200
        finally:
            srv.stop()
        return answers

    plain = serve(False, None)
    answers = serve(True, tmp_path / "run")
    poison = answers.pop(13)
    assert poison.status_code == 500 and "poisoned forward" in poison.json()["error"]["message"], poison.text
    assert [r.status_code for r in answers] == [200] * 31
    kept = lambda r: (r.json()["choices"][0]["text"], r.json()["choices"][0]["logprobs"]["token_logprobs"])  # noqa: E731
    assert NATIVE_OFF or [kept(r) for r in answers] == [kept(r) for r in plain]
    assert [(r["status"], "poisoned forward" in r["reason"]) for r in read_rejected(tmp_path / "run").to_pylist()] == [
        (500, True)
    ]


@pytest.mark.native
def test_requests_queued_when_the_loop_dies_are_answered(tiny):
    engine = _engine(tiny)
    srv = start_server(engine, None)
    step, entered, release = engine.step, threading.Event(), threading.Event()

    def broken(*args, **kwargs):
        entered.set()
        release.wait(30)
        raise RuntimeError("the engine is broken")

    engine.step = broken
    srv.loop.max_failed_steps = 1
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            with ThreadPoolExecutor(4) as pool:
                first = pool.submit(client.post, "/v1/completions", json={"prompt": "a", "max_tokens": 2})
                assert entered.wait(30)
                queued = [
                    pool.submit(client.post, "/v1/completions", json={"prompt": "b", "max_tokens": 2}) for _ in range(3)
                ]
                while srv.loop._queued < 3:  # all three wait in the command queue behind the stuck step
                    threading.Event().wait(0.01)
                release.set()
                assert first.result().status_code == 500
                assert [f.result().status_code for f in queued] == [503] * 3  # none left hanging
        assert httpx.get(srv.url + "/health").status_code == 503
    finally:
        engine.step = step
        srv.stop()


@pytest.mark.native
def test_a_loop_that_cannot_go_on_tells_its_owner_after_answering_everyone(tiny):
    """mode=serve passes on_fatal to stop uvicorn and exit 70 (a supervisor restarts it): the callback comes once,
    with the error, after the request in flight was answered."""
    from toolkit.serve.loop import EngineLoop, Submission

    engine, fatal, answered = _engine(tiny), [], threading.Event()

    def broken(*args, **kwargs):
        raise RuntimeError("the engine is broken")

    engine.step = broken
    loop = EngineLoop(engine, None, max_failed_steps=2, on_fatal=lambda exc: fatal.append((exc, answered.is_set())))
    loop.start()
    sub = Submission(
        EngineRequest("a", request_id="a", sampling_params={"max_tokens": 2}),
        None,
        lambda update: update.error and answered.set(),
    )
    loop.submit([sub])
    loop._thread.join(30)
    assert [(str(e), was) for e, was in fatal] == [("the engine is broken", True)] and not loop.alive


@pytest.mark.native
@pytest.mark.parametrize("kept", ["hash", "off"])
def test_record_body_hash_or_off_and_replay_says_what_it_cannot_rebuild(tiny, tmp_path, kept):
    run_dir = tmp_path / "run"
    srv = start_server(_engine(tiny), run_dir, record_body=kept)
    body = {"prompt": "A prompt", "max_tokens": 5, "temperature": 0.9, "seed": 7, "user": "alice@example.com"}
    try:
        assert _post(srv.url, body).status_code == 200
    finally:
        srv.stop()
    row = read_requests(run_dir).to_pylist()[0]
    assert row["request_body"] is None and "alice" not in json.dumps(row)  # the prompt's tokens stay: replay
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    assert row["request_body_sha256"] == (digest if kept == "hash" else None)
    report = replay(run_dir, out_dir=tmp_path / "replayed")
    assert report.identical and report.rows_compared == 5
    assert len(report.cannot_rebuild) == 1 and f"serve.record_body={kept}" in report.cannot_rebuild[0]


@pytest.mark.native
def test_a_served_run_is_written_append_only_and_read_back_in_arrival_order(tiny, tmp_path):
    run_dir = tmp_path / "run"
    engine = _engine(tiny, max_num_seqs=4)
    srv = start_server(engine, run_dir, flush_every_steps=1)
    bodies = [
        {"prompt": f"Request {i}", "max_tokens": 1 + (7 * i) % 11, "temperature": 0.7, "seed": i} for i in range(24)
    ]
    seen: dict[str, int] = {}  # part -> mtime when first seen
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as client, ThreadPoolExecutor(6) as pool:
            for i in range(0, 24, 6):  # six at a time: they end out of arrival order
                list(pool.map(lambda b: client.post("/v1/completions", json=b).raise_for_status(), bodies[i : i + 6]))
                assert srv.loop.open_requests == 0  # nothing kept of ended requests
                for p in (run_dir / REQUESTS_FILE).glob("part-*.parquet"):
                    seen.setdefault(p.name, p.stat().st_mtime_ns)
    finally:
        srv.stop()
    parts = sorted((run_dir / REQUESTS_FILE).glob("part-*.parquet"))
    assert len(parts) > 1 and sum(pq.read_table(p).num_rows for p in parts) == 24  # each request once
    assert all(p.stat().st_mtime_ns == seen.get(p.name, p.stat().st_mtime_ns) for p in parts)  # never rewritten
    assert not (run_dir / OPEN_REQUESTS_FILE).exists()  # closed cleanly: every request ended
    rows = read_requests(run_dir).to_pylist()
    assert [r["arrival_index"] for r in rows] == list(range(24))  # in arrival order, though they ended otherwise
    got = [json.loads(r["request_body"]) for r in rows]
    for i in range(0, 24, 6):  # each batch of six arrived after the one before it
        assert sorted(got[i : i + 6], key=lambda b: b["seed"]) == bodies[i : i + 6]
    assert [r["arrival_step"] for r in rows] == sorted(r["arrival_step"] for r in rows)
    assert replay(run_dir, out_dir=tmp_path / "replayed").identical


@pytest.mark.native
def test_a_body_of_many_prompts_and_samples_is_recorded_once_and_its_digest_on_every_row(tiny, tmp_path):
    """A request's body is the same for its every prompt and sample: it is written on the row of its first prompt's
    first sample, its digest on all of them (64 prompts at n=4 wrote an 8 MB body 256 times, and every admission
    rewrote them all into requests.open.parquet). The JSON is made where the body is parsed, once."""
    run_dir = tmp_path / "run"
    srv = start_server(_engine(tiny), run_dir)
    body = {"prompt": ["one", "two", "three"], "n": 2, "max_tokens": 2, "temperature": 0.9, "seed": 3}
    try:
        assert _post(srv.url, body).status_code == 200
    finally:
        srv.stop()
    rows = read_requests(run_dir).to_pylist()
    assert len(rows) == 6  # three prompts, two samples each
    first = [r for r in rows if r["request_body"] is not None]
    assert [(r["request_id"][-2:], r["stream"]) for r in first] == [("-0", 0)]
    assert json.loads(first[0]["request_body"]) == body  # the body as received
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    assert {r["request_body_sha256"] for r in rows} == {digest}
    assert replay(run_dir, out_dir=tmp_path / "replayed").identical


def _health_beside(url: str, route: str, body: dict, after_s: float) -> tuple[httpx.Response, list[float]]:
    """`body` posted to `route`, and, `after_s` later, /health asked five times while it runs: (its answer, the
    seconds each /health took)."""
    with ThreadPoolExecutor(1) as pool:
        posted = pool.submit(httpx.post, url + route, json=body, timeout=60)
        time.sleep(after_s)
        waits = []
        for _ in range(5):
            t0 = time.perf_counter()
            assert httpx.get(url + "/health", timeout=10).status_code == 200
            waits.append(time.perf_counter() - t0)
            time.sleep(0.1)
        return posted.result(60), waits


@pytest.mark.native
def test_a_chats_token_bytes_are_built_off_the_event_loop(tiny, monkeypatch):
    """A chat's logprobs carry each token's bytes, a table whose first build takes seconds (xgrammar's vocabulary,
    transformers imported): it was built on the event loop, and every other client waited (4.6 s in the probe).
    Built on a thread, /health answers meanwhile, and the answer carries the bytes."""
    tokenizer = tiny.tokenizer
    build = tokenizer.token_bytes

    def slow(vocab_size: int) -> list[bytes]:
        time.sleep(2.0)  # the first build's seconds
        return build(vocab_size)

    monkeypatch.setattr(tokenizer, "token_bytes", slow)
    srv = start_server(_engine(tiny), None)
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
        answer, waits = _health_beside(srv.url, "/v1/chat/completions", body, 0.3)  # its table being built
        assert max(waits) < 0.5, waits
        assert answer.status_code == 200, answer.text
        entry = answer.json()["choices"][0]["logprobs"]["content"][0]
        assert entry["bytes"] and all(0 <= b < 256 for b in entry["bytes"])  # spelled from the table
    finally:
        srv.stop()


@pytest.mark.native
def test_a_whole_answer_is_made_json_off_the_event_loop_with_the_bytes_starlette_wrote(tiny, monkeypatch):
    """An answer not streamed is built and made JSON on a thread, a choice at a time (64 choices of 200 tokens with
    20 logprobs each held the event loop, and every stream, 2.3 s): /health answers while one is built, and the
    body is the bytes starlette's JSONResponse wrote (compact, not ASCII-escaped, keys in order)."""
    from toolkit.serve import job as job_module

    build = job_module.answer

    def slow(job):
        time.sleep(2.0)  # a big answer's seconds
        return build(job)

    monkeypatch.setattr(job_module, "answer", slow)
    srv = start_server(_engine(tiny), None)
    try:
        body = {
            "prompt": ["Hé, wörld", "two"],
            "n": 2,
            "max_tokens": 3,
            "logprobs": 2,
            "temperature": 1.0,
            "echo": True,
        }
        r, waits = _health_beside(srv.url, "/v1/completions", body, 0.5)  # its answer being built
        assert max(waits) < 0.5, waits
        assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
        parsed = r.json()
        assert [c["index"] for c in parsed["choices"]] == [0, 1, 2, 3]
        assert r.content == JSONResponse(parsed).body  # the very bytes
    finally:
        srv.stop()


def _delta(index: int, text: str) -> TextDelta:
    return TextDelta("r", index, text, (len(text),), False, None)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.dictionaries(st.integers(0, 2), st.text(max_size=3), max_size=3).map(lambda d: list(d.items())), max_size=40
    ),
    st.integers(1, 6),
)  # a step: at most one delta per sample
def test_a_slow_readers_mailbox_stays_bounded_and_loses_nothing(steps, limit):
    async def run() -> None:
        box = Mailbox(limit)
        for k, deltas in enumerate(steps):
            box.put(Update("r", tuple(_delta(i, t) for i, t in deltas), samples=(k,)))
            assert len(box) <= limit
        box.put(Update("r", output="done"))
        texts: dict[int, str] = {}
        tokens: dict[int, tuple] = {}
        samples = []
        while True:
            update = await box.get()
            assert len({d.index for d in update.deltas}) == len(update.deltas)  # one delta per sample
            for d in update.deltas:
                texts[d.index] = texts.get(d.index, "") + d.text
                tokens[d.index] = tokens.get(d.index, ()) + d.token_ids
            samples += update.samples
            if update.output is not None:
                break
        want_text: dict[int, str] = {}
        want_tokens: dict[int, tuple] = {}
        for deltas in steps:
            for i, t in deltas:
                want_text[i] = want_text.get(i, "") + t
                want_tokens[i] = want_tokens.get(i, ()) + (len(t),)
        assert texts == want_text and tokens == want_tokens and samples == list(range(len(steps)))

    asyncio.run(run())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("AB"), st.text("xyz", max_size=3)), max_size=30), st.integers(1, 4))
def test_a_slow_readers_mailbox_keeps_each_prompts_updates_apart(steps, limit):
    """One job's engine requests (two prompts) share a mailbox: however its tail is joined, each request's text,
    rows and final output come out whole, in order, and apart from the other's."""

    async def run() -> None:
        box = Mailbox(limit)
        for k, (r, text) in enumerate(steps):
            box.put(Update(r, (_delta(0, text),), samples=(k,)))
        for r in "AB":
            box.put(Update(r, output=f"done {r}"))
        texts, samples, outputs = {"A": "", "B": ""}, {"A": [], "B": []}, {}
        while len(outputs) < 2:
            update = await asyncio.wait_for(box.get(), 10)  # a request's final update lost: the reader would hang
            assert update.request_id not in outputs  # nothing after a request's final update
            for d in update.deltas:
                texts[update.request_id] += d.text
            samples[update.request_id] += update.samples
            if update.output is not None:
                outputs[update.request_id] = update.output
        for r in "AB":
            assert texts[r] == "".join(t for q, t in steps if q == r)
            assert samples[r] == [k for k, (q, _) in enumerate(steps) if q == r] and outputs[r] == f"done {r}"
        assert len(box) == 0

    asyncio.run(run())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=40), min_size=1, max_size=60), st.integers(1, 4), st.integers(40, 400))
def test_a_mailbox_past_its_bytes_gives_up_once_and_says_so(texts, limit, max_bytes):
    """Unread bytes are counted exactly (each text, ROW_BYTES a row, less what was read); past max_bytes the
    overflow callback runs once, nothing more is kept, and every read is the error."""
    from toolkit.serve.mailbox import ROW_BYTES

    async def run() -> None:
        calls = []
        box = Mailbox(limit, max_bytes, on_overflow=lambda: calls.append(1))
        unread = 0
        for k, text in enumerate(texts):
            box.put(Update("r", (_delta(0, text),), samples=(k,)))
            unread += len(text) + ROW_BYTES
            if unread > max_bytes:
                break
            assert box.unread_bytes == unread and len(box) <= limit
        if unread <= max_bytes:
            assert not calls
            got = await box.get()
            assert box.unread_bytes == unread - len(got.deltas[0].text) - ROW_BYTES * len(got.samples)
            return
        assert calls == [1] and len(box) == 0
        box.put(Update("r", (_delta(0, "more"),)))
        for _ in range(2):
            update = await box.get()
            assert "serve.max_unread_mb" in update.error and not update.deltas
        assert calls == [1]

    asyncio.run(run())


@pytest.mark.native
@once
def test_soak_over_http_loses_nothing_and_keeps_nothing(tiny, tmp_path):
    from toolkit.modes.serve_soak import soak_http

    engine = make_engine(tiny, max_num_seqs=4, sampling=SamplingParams())
    report = soak_http(engine, tmp_path, requests=400, concurrency=16, report_every=100, max_waiting=8)
    assert report["passed"], report["problems"]
    assert report["served"] == report["trace_requests"] == 400 and report["trace_sample_rows"] == report["tokens"]
    assert [c["open_requests"] for c in report["checkpoints"]][-1] == 0
    assert report["retried_503"] > 0  # 16 clients against max_waiting=8: some were told to retry, none lost
    assert report["replay"].startswith("bit-identical")


OPENMP_SCRIPT = r"""
import sys, time, torch
from tests.conftest import make_engine
from toolkit.native import library
from toolkit.config import ModelConfig
from toolkit.sampling.params import SamplingParams
from toolkit.models import load_model
from toolkit.serve.loop import EngineLoop

def threads():
    with open("/proc/self/status") as f:
        return int(f.read().split("Threads:")[1].split()[0])

def settled(expected):  # released workers exit on their own: wait for them
    for _ in range(100):
        if threads() == expected:
            break
        time.sleep(0.05)
    return threads()

torch.set_num_threads(2)
engine = make_engine(load_model(ModelConfig(name="tiny", seed=0)), sampling=SamplingParams())
library.release_openmp_threads()  # loading ran parallel regions: start from no team
time.sleep(0.5)
base = threads()
torch.ones(1 << 22).sum()  # a parallel region on this thread: its OpenMP team of two
with_team = threads()
released = library.release_openmp_threads()
after_release = settled(base)
torch.ones(1 << 22).sum()  # the team again, then the loop's start gives it back before its thread runs
loop = EngineLoop(engine, None, None).start()
after_start = settled(base + 1)  # + the engine-loop thread, idle (no team of its own yet)
loop.stop()
print(base, with_team, int(released), after_release, after_start)
"""


@pytest.mark.native
def test_the_thread_that_loaded_the_engine_gives_its_openmp_workers_back_before_the_loop_steps():
    """libgomp counts every thread's team, idle ones too; past the CPU count its barriers sleep instead of
    spinning, which made a 2-core server's steps ~20% slower than the same engine stepped on one thread. The
    release must end this thread's workers (the process's thread count comes back), and EngineLoop.start must do
    it on the thread that loaded the model."""
    import subprocess
    import sys
    from pathlib import Path

    import torch

    if sys.platform != "linux" or "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch's parallel backend here is not OpenMP on Linux: no OpenMP team to give back")
    with open("/proc/self/maps") as maps:
        gnu = any("libgomp" in line for line in maps)
    if not gnu:
        pytest.skip("torch's OpenMP runtime here is not GNU OpenMP (libgomp): its teams are not released")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", OPENMP_SCRIPT], capture_output=True, text=True, cwd=root, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    base, with_team, released, after_release, after_start = map(int, done.stdout.split()[-5:])
    assert with_team == base + 1, (base, with_team)  # one worker beside this thread
    assert released >= 1, "no loaded OpenMP runtime released its workers"
    assert after_release == base, (base, with_team, after_release)
    assert after_start == base + 1, (base, with_team, after_start)


def test_a_step_waits_for_its_event_loop_to_write_what_it_handed_over_but_never_past_the_bound():
    """After a step the engine thread waits until each event loop it handed updates to has run them and the tasks
    they woke (a stream's chunk written), so that work runs while it waits, not beside the next forward; here the
    task takes 50 ms over each update. The wait ends at its bound when the loop is busy elsewhere, and a closed
    loop is not waited for. Waiting one hop (behind the updates, not the tasks) fails the first assertion; no bound
    fails the second."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    written: list[int] = []
    ready = threading.Event()

    async def stream(queue: asyncio.Queue) -> None:
        ready.set()
        while True:
            update = await queue.get()
            if update is None:
                return
            time.sleep(0.05)  # the chunk's Python, holding the loop
            written.append(update)

    queue: asyncio.Queue = asyncio.run_coroutine_threadsafe(_make_queue(), loop).result(10)
    try:
        asyncio.run_coroutine_threadsafe(stream(queue), loop)
        assert ready.wait(10)
        sink = LoopSink(loop, queue.put_nowait)
        for n in range(3):
            sink(n)
            _wait_taken({loop}, 5.0)
            assert written == list(range(n + 1))
        loop.call_soon_threadsafe(time.sleep, 1.0)  # the loop busy with something else for a second
        start = time.perf_counter()
        _wait_taken({loop}, 0.05)
        assert time.perf_counter() - start < 0.5
    finally:
        loop.call_soon_threadsafe(queue.put_nowait, None)  # the stream ends
        loop.call_soon_threadsafe(loop.call_soon, loop.stop)
        thread.join(10)
        loop.close()
    start = time.perf_counter()
    _wait_taken({loop}, 5.0)  # closed
    assert time.perf_counter() - start < 0.5


async def _make_queue() -> asyncio.Queue:
    return asyncio.Queue()


# ---------------------------------------------------------------------- echo scoring: bounded, stoppable, named


def _scores_as_before(model, token_ids: list[int], k: int) -> list:
    """prompt_logprobs as it was: the whole (T, V) matrix of one forward through one float64 log-softmax, row by
    row after."""
    from toolkit.engine.runner import recompute_logits
    from toolkit.sampling.sampler import top_k

    ids = list(token_ids)
    logprobs = torch.log_softmax(recompute_logits(model, ids)[:-1].double(), -1)
    rows: list = [None]
    for pos in range(1, len(ids)):
        row = logprobs[pos - 1]
        top = top_k(row, k)[1].tolist() if k else []
        rank = int((row > row[ids[pos]]).sum()) + 1
        rows.append((ids[pos], float(row[ids[pos]]), [(t, float(row[t])) for t in top], rank))
    return rows


def _same_scores(model, now: list, before: list) -> None:
    """Every bit of every float (repr) on the fixed-order kernels; on sdpa and torch's matmul (TOOLKIT_NATIVE=0) a
    piece's rows may round otherwise than the whole prompt's: within 1e-5 there."""
    from toolkit.engine.runner import kernel_runs

    if kernel_runs(model, 16):
        assert repr(now) == repr(before)
        return
    assert len(now) == len(before) and now[0] is None and before[0] is None
    for (token, value, top, _), (token_, value_, top_, _) in zip(now[1:], before[1:]):
        assert token == token_ and abs(value - value_) < 1e-5
        assert max((abs(a[1] - b[1]) for a, b in zip(top, top_)), default=0) < 1e-5


@pytest.mark.native
def test_echo_scores_are_the_whole_matrix_bits_from_bounded_pieces_and_stop_when_asked(tiny, monkeypatch):
    """prompt_logprobs prefills the prompt and runs its float64 log-softmax a bounded piece of positions at a time
    (it took the whole prompt at once: 0.87 MB a prompt token, +3.5 GB at 4,000; then the forward's whole logits,
    786 MB at 4,000 tokens of SmolLM2) and gives the very entries one forward's whole matrix gave (repr: every
    bit of every float; on the fixed-order kernels, which TOOLKIT_NATIVE=0 turns off: there within 1e-5), at any
    piece size; `stop` is asked between pieces, and once true scoring ends (None)."""
    from toolkit.engine import runner

    model = tiny.model
    vocab = model.arch.vocab_size
    g = torch.Generator().manual_seed(0)
    softmaxed: list[int] = []
    log_softmax = torch.log_softmax

    def counted(x, *args, **kwargs):
        softmaxed.append(x.shape[0])
        return log_softmax(x, *args, **kwargs)

    for n, k in ((1, 0), (2, 3), (37, 5), (200, 20), (201, 0)):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        before = _scores_as_before(model, ids, k)
        for piece_rows in (1, 7, 64):
            softmaxed.clear()
            with monkeypatch.context() as m:
                m.setattr(runner.torch, "log_softmax", counted)
                now = runner.prompt_logprobs(model, ids, k, piece_bytes=8 * vocab * piece_rows)
            _same_scores(model, now, before)
            assert max(softmaxed, default=0) <= piece_rows and sum(softmaxed) == n - 1, softmaxed
    asked: list[int] = []
    ids = torch.randint(0, vocab, (100,), generator=g).tolist()
    with monkeypatch.context() as m:
        m.setattr(runner.torch, "log_softmax", counted)
        softmaxed.clear()
        stopped = runner.prompt_logprobs(
            model, ids, 2, stop=lambda: asked.append(1) or len(asked) > 3, piece_bytes=8 * vocab * 10
        )
    assert stopped is None and len(softmaxed) == 2, softmaxed  # asked before the forward, then between pieces
    assert runner.prompt_logprobs(model, ids, 2, stop=lambda: True) is None
    forwards: list[int] = []  # a long prompt runs in forward pieces: once stopped, the rest never runs
    run, asked = runner.ModelRunner.run, []
    long = torch.randint(0, vocab, (700,), generator=g).tolist()
    before = _scores_as_before(model, long, 2)
    with monkeypatch.context() as m:
        m.setattr(runner.ModelRunner, "run", lambda self, b, *a, **kw: forwards.append(b.num_tokens) or run(self, b))
        stop = lambda: asked.append(1) or len(asked) > 2  # noqa: E731
        assert runner.prompt_logprobs(model, long, 2, stop=stop, piece_bytes=8 * vocab * 200) is None
        assert forwards == [runner.SCORING_FORWARD] == [256]
        _same_scores(model, runner.prompt_logprobs(model, long, 2, piece_bytes=8 * vocab * 200), before)
        assert forwards[1:] == [256, 256, 187]  # 699 positions predict a token; the last is never run


@pytest.mark.native
def test_echo_scoring_past_max_scored_tokens_is_a_400_before_any_forward(tiny):
    """serve.max_scored_tokens bounds the prompt tokens one echo + logprobs request has scored (64 prompts of a
    full context each were scored one after another, unbounded): past it a 400 naming the prompt and the knob,
    before any scoring forward; at it, served. A bound that is no positive integer is refused at start."""
    from toolkit.errors import ConfigError

    with pytest.raises(ConfigError, match="serve.max_scored_tokens must be a positive integer"):
        start_server(_engine(tiny), None, max_scored_tokens=0)
    engine = _engine(tiny)
    scored: list[int] = []
    score = engine.prompt_logprobs
    engine.prompt_logprobs = lambda ids, k, stop=None: scored.append(len(ids)) or score(ids, k, stop)
    srv = start_server(engine, None, max_scored_tokens=100)
    body = {"echo": True, "logprobs": 1, "max_tokens": 1}
    try:
        for prompt in ([[7] * 101], [[7] * 60, [8] * 41], ["word " * 40, "word " * 70]):
            r = _post(srv.url, {**body, "prompt": prompt})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "prompt" and "serve.max_scored_tokens=100" in error["message"], error
        assert scored == []  # refused before any forward
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        out = c.completions.create(model="tiny", prompt=[[7] * 60, [8] * 40], echo=True, logprobs=1, max_tokens=1)
        assert scored == [60, 40] and len(out.choices[0].logprobs.token_logprobs) == 61
        assert _post(srv.url, {"prompt": [[7] * 500], "max_tokens": 1}).status_code == 200  # no echo: not scored
    finally:
        srv.stop()


@pytest.mark.native
def test_a_client_that_leaves_while_its_prompts_are_scored_stops_the_scoring(tiny):
    """Scoring is told to stop (its `stop` turns true) once the client that asked for it has gone, and the next echo
    request, which waited behind it (one request's prompts scored at a time), is served at once: a client that
    left was scored to the end first, 34 s of another client's wait in the probe."""
    engine = _engine(tiny)
    score, entered, saw_stop = engine.prompt_logprobs, threading.Event(), threading.Event()

    def slow(ids, k, stop=None):  # the hog's first prompt: scoring that would go on for long
        if len(ids) == 50 and not entered.is_set():
            entered.set()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if stop is not None and stop():
                    saw_stop.set()
                    return None
                time.sleep(0.01)
        return score(ids, k, stop)

    def hog(outcome: list) -> None:
        body = {"prompt": [[9] * 50] * 8, "echo": True, "logprobs": 1, "max_tokens": 1}
        try:
            outcome.append(httpx.post(srv.url + "/v1/completions", json=body, timeout=1.0))
        except httpx.ReadTimeout as exc:  # the client gives up after 1 s and closes its connection
            outcome.append(exc)

    engine.prompt_logprobs = slow
    srv = start_server(engine, None)
    try:
        outcome: list = []
        left = threading.Thread(target=hog, args=(outcome,))
        left.start()
        assert entered.wait(30)
        left.join(10)
        assert isinstance(outcome[0], httpx.ReadTimeout), outcome
        assert saw_stop.wait(5), "scoring went on after its client left"
        t0 = time.perf_counter()
        r = _post(srv.url, {"prompt": "Hello there", "echo": True, "logprobs": 1, "max_tokens": 1})
        assert r.status_code == 200 and time.perf_counter() - t0 < 5, r.text
        assert r.json()["choices"][0]["logprobs"]["token_logprobs"][0] is None
        assert srv.loop._preparing == 0
    finally:
        srv.stop()


@pytest.mark.native
def test_echo_scoring_past_max_scoring_is_a_503_at_once_and_runs_below_the_engines_priority(tiny):
    """Echo + logprobs requests are scored one at a time; past serve.max_scoring scoring or waiting, a request gets a
    503 with Retry-After at once (16,000 scored tokens held every later one for minutes in the probe), and those
    waiting are served in turn. The scoring thread runs 10 below the engine's CPU priority (its forward took the
    cores from every other request's steps)."""
    engine = _engine(tiny)
    score, entered, release = engine.prompt_logprobs, threading.Event(), threading.Event()

    def held(ids, k, stop=None):  # the first request's scoring holds the thread until the test lets it go
        if not entered.is_set():
            entered.set()
            release.wait(30)
        return score(ids, k, stop)

    engine.prompt_logprobs = held
    with pytest.raises(ConfigError, match="serve.max_scoring must be a positive integer"):
        start_server(_engine(tiny), None, max_scoring=0)
    srv = start_server(engine, None, max_scoring=2)
    scoring = srv.uvicorn.config.app.state.scoring
    body = {"prompt": [[9] * 20], "echo": True, "logprobs": 1, "max_tokens": 1}
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(_post, srv.url, body)
            assert entered.wait(30)
            second = pool.submit(_post, srv.url, body)
            deadline = time.monotonic() + 10
            while scoring.pending < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            t0 = time.perf_counter()
            third = _post(srv.url, body)
            assert third.status_code == 503 and time.perf_counter() - t0 < 5, third.text
            assert "serve.max_scoring=2" in third.json()["error"]["message"] and third.headers["retry-after"]
            release.set()
            assert first.result().status_code == second.result().status_code == 200
        assert scoring.pending == 0 and _post(srv.url, body).status_code == 200
        if sys.platform.startswith("linux"):
            tasks = {t.name: (t / "comm").read_text().strip() for t in Path(f"/proc/{os.getpid()}/task").iterdir()}
            tid = next(int(t) for t, name in tasks.items() if name == "scoring")
            base = os.getpriority(os.PRIO_PROCESS, 0)
            assert os.getpriority(os.PRIO_PROCESS, tid) == min(base + 10, 19)
    finally:
        release.set()
        srv.stop()


@pytest.mark.native
def test_a_chats_errors_name_the_field_it_sent(tiny):
    """A chat's max_completion_tokens and top_logprobs reach the engine as max_tokens and logprobs: a value it
    refuses is a 400 naming the field the client sent, in `param` and in the message (they said max_tokens and
    logprobs, fields the client never sent); a chat that sent max_tokens is still told max_tokens."""
    srv = start_server(_engine(tiny), None)
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Hi"}]
    try:
        for field, value, extra in (
            ("max_completion_tokens", 0, {}),
            ("max_completion_tokens", -1, {}),
            ("max_completion_tokens", 90_000, {}),
            ("max_completion_tokens", 0, {"max_tokens": 5}),  # both: max_completion_tokens is the one used
            ("top_logprobs", 21, {"logprobs": True}),
            ("top_logprobs", -1, {"logprobs": True}),
            ("max_tokens", 0, {}),
            ("max_tokens", 90_000, {}),
        ):
            with pytest.raises(openai.BadRequestError) as caught:
                c.chat.completions.create(model="tiny", messages=messages, **{field: value, **extra})
            error = caught.value.body
            assert error["param"] == field, (field, value, error)
            assert field in error["message"] and str(value) in error["message"], error
            other = {
                "max_completion_tokens": "max_tokens",
                "top_logprobs": "logprobs",
                "max_tokens": "max_completion_tokens",
            }
            assert not re.search(rf"(?<![_a-z]){other[field]}\b", error["message"]), error
        ok = c.chat.completions.create(
            model="tiny", messages=messages, max_completion_tokens=2, logprobs=True, top_logprobs=20
        )
        assert len(ok.choices[0].logprobs.content[0].top_logprobs) == 20
    finally:
        srv.stop()


@pytest.mark.native
def test_a_job_holds_trace_rows_only_for_an_answer_with_logprobs_not_streamed(tiny, monkeypatch):
    """A stream sends each trace row as it comes and an answer without logprobs reads none: neither keeps them (a
    stream once held every row it had sent until it ended); an answer with logprobs keeps each, in order."""
    from toolkit.serve import api as api_module

    jobs = []
    build = api_module.Job.build
    monkeypatch.setattr(api_module.Job, "build", lambda *a: jobs.append(build(*a)) or jobs[-1])
    srv = start_server(make_engine(tiny, sampling=SamplingParams()), None)
    body = {"prompt": "Hi", "max_tokens": 5, "ignore_eos": True, "n": 2}
    try:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True, "logprobs": 2}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert len(events) > 5 and events[-1] == "data: [DONE]", events
        for extra in ({}, {"logprobs": 2}):
            assert httpx.post(f"{srv.url}/v1/completions", json={**body, **extra}, timeout=60).status_code == 200
    finally:
        srv.stop()
    assert [sum(map(len, job.samples.values())) for job in jobs] == [0, 0, 2 * 5]
    for rows in jobs[2].samples.values():  # each sample's rows, one a position, in order
        assert [s.position for s in rows] == list(range(rows[0].position, rows[0].position + 5))


@pytest.mark.native
def test_an_answer_not_streamed_past_max_response_mb_is_a_400_and_frees_its_requests(tiny):
    """An answer held whole until it is (its text and logprob rows) is bounded: past serve.max_response_mb its
    requests are aborted and it is a 400 saying to stream it (64 prompts x n=16 x 100 tokens with 20 logprobs
    once built a 63 MB body); the same request streamed, and a smaller one, are answered."""
    engine = make_engine(tiny, sampling=SamplingParams(), max_num_seqs=16)
    srv = start_server(engine, None, max_response_mb=0.25)
    big = {"prompt": ["x"] * 4, "n": 4, "max_tokens": 64, "logprobs": 20, "ignore_eos": True}  # 1,024 rows: 0.5 MB
    try:
        r = httpx.post(f"{srv.url}/v1/completions", json=big, timeout=120)
        error = r.json()["error"]
        assert (r.status_code, error["code"]) == (400, "response_too_large"), r.text
        assert "serve.max_response_mb" in error["message"] and "stream: true" in error["message"]
        deadline = time.monotonic() + 30  # (the engine loop takes the aborts at its next step)
        while srv.loop.open_requests:
            assert time.monotonic() < deadline, srv.loop.stats
            time.sleep(0.02)
        assert srv.loop.stats.finished.get("abort") == 16  # aborted halfway
        assert engine.block_manager.num_used_blocks == 0
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={**big, "stream": True}, timeout=120) as r:
            assert list(r.iter_lines())[-2] == "data: [DONE]"
        r = httpx.post(f"{srv.url}/v1/completions", json={**big, "max_tokens": 24}, timeout=120)
        assert r.status_code == 200 and len(r.json()["choices"]) == 16
    finally:
        srv.stop()
