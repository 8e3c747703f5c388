"""engine.scheduling_policy=priority (a server's default; vLLM's name): sequences wait, and are preempted, in
priority_key order (priority, stream, arrival), and a waiting sequence that a slot or KV blocks keep out preempts
the running ones that come after it. A server gives a request's i-th prompt priority i, so that one request of
many prompts or samples cannot hold every slot until its last one ends."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from tests.conftest import NATIVE_OFF, make_engine
from toolkit.config import EngineConfig
from toolkit.engine.scheduler import priority_key
from toolkit.errors import ConfigError
from toolkit.sampling.params import SamplingParams
from toolkit.serve.main import serving_engine, start_server
from toolkit.trace.reader import read_requests

pytestmark = pytest.mark.native  # batch_invariant (the bits under preemption) where the kernels run

LONG = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


def _run(engine, requests):
    """Every request through `engine`. Returns each sample's tokens by request id."""
    ids = [engine.add_request(**r) for r in requests]
    while engine.has_unfinished():
        engine.step()
    return {i: tuple(c.token_ids for c in engine.output(i).outputs) for i in ids}


def test_a_request_waiting_for_a_slot_preempts_the_last_running_one_in_priority_order(tiny):
    """Four prompts of one request (priorities 0-3) hold every slot; a prompt at priority 0 arriving later runs at
    once, in the place of the priority-3 prompt, which resumes after it with the tokens it would have had."""
    requests = [
        {"prompt_token_ids": [10 + i, 20, 30, 40 + i], "request_id": f"a{i}", "priority": i, "sampling_params": LONG}
        for i in range(4)
    ]
    late = {
        "prompt_token_ids": [7, 8, 9],
        "request_id": "b",
        "arrival_step": 3,
        "sampling_params": SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
    }
    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "batch_invariant": not NATIVE_OFF}
    alone = _run(make_engine(tiny, scheduling_policy="priority", **kw), requests)
    engine = make_engine(tiny, scheduling_policy="priority", **kw)
    ids = [engine.add_request(**r) for r in [*requests, late]]
    first = None
    while engine.has_unfinished():
        out = engine.step()
        if first is None and any(s.request_id == "b" for s in out.samples):
            first = out.step
    assert first == 3  # the step it arrived in, not after the 30 tokens the others decode
    assert [engine.requests[f"a{i}"].preempted_steps for i in range(4)] == [[], [], [], [3]]
    assert engine.output("b").finished and len(engine.output("b").outputs[0].token_ids) == 2
    if not NATIVE_OFF:  # the same bits whatever the batch: the preempted prompt's tokens are its tokens alone
        assert {i: tuple(c.token_ids for c in engine.output(i).outputs) for i in ids if i != "b"} == alone
    fcfs = make_engine(tiny, **kw)  # the default: the late prompt waits for a slot
    for r in [*requests, late]:
        fcfs.add_request(**r)
    step = 0
    while not any(s.request_id == "b" for s in fcfs.step().samples):
        step += 1
    assert step >= 25 and fcfs.scheduler.num_preemptions == 0


def test_the_samples_of_one_request_give_way_to_a_new_requests_first(tiny):
    """n=4 fills max_num_seqs=4; a request arriving later preempts the sample of the highest stream, not stream 0."""
    engine = make_engine(tiny, scheduling_policy="priority", max_num_seqs=4, max_num_batched_tokens=64)
    engine.add_request(
        prompt_token_ids=[5, 6, 7],
        request_id="many",
        sampling_params=SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=25, ignore_eos=True),
    )
    engine.add_request(prompt_token_ids=[9, 9], request_id="one", arrival_step=4, sampling_params=LONG)
    while engine.has_unfinished():
        engine.step()
    preempted = {s.stream: s.preempted_steps for s in engine.requests.values() if s.request_id == "many"}
    assert preempted == {0: [], 1: [], 2: [], 3: [4]}
    assert engine.requests["one"].admitted_step == 4


def test_a_full_kv_pool_preempts_the_last_in_priority_order_not_the_newest(tiny):
    """When a decode's KV cannot grow, the victim is the running sequence last in priority order (here the oldest),
    not the newest as under first-come, first-served."""
    engine = make_engine(
        tiny, scheduling_policy="priority", num_kv_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=64
    )
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request(prompt_token_ids=[3, 4, 5, 6], request_id="low", priority=2, sampling_params=params)
    engine.add_request(
        prompt_token_ids=[7, 8, 9, 10], request_id="high", priority=0, arrival_step=2, sampling_params=params
    )
    victims = []
    while engine.has_unfinished():
        victims += [seq_id for seq_id, _ in engine.step().preempted]
    assert victims and set(victims) == {"low"}


def test_a_step_frees_kv_blocks_for_no_more_first_chunks_than_its_token_budget_admits(tiny):
    """Four prompts at priority 0 arrive while four at priority 5 fill the KV pool. A step of 16 tokens admits one
    16-token first chunk: one running sequence is preempted for it, not all four (each near its end: their blocks
    freed for first chunks the step could not take)."""
    engine = make_engine(
        tiny, scheduling_policy="priority", num_kv_blocks=20, block_size=4, max_num_seqs=8, max_num_batched_tokens=16
    )
    low = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(4):
        engine.add_request(prompt_token_ids=[10 + i] * 12, request_id=f"a{i}", priority=5, sampling_params=low)
    high = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i in range(4):
        engine.add_request(
            prompt_token_ids=[50 + i] * 16, request_id=f"b{i}", priority=0, arrival_step=7, sampling_params=high
        )
    preempted = {}
    while engine.has_unfinished():
        out = engine.step()
        if out.preempted:
            preempted[out.step] = [seq_id for seq_id, _ in out.preempted]
    assert preempted == {7: ["a3"]}


@pytest.mark.parametrize("priorities", [(0, 1), (0, 0)], ids=["one request's two prompts", "two requests"])
def test_a_prompt_arriving_beside_long_prefills_gets_its_first_token_in_its_arrival_step(tiny, priorities):
    """Two prompts of 600 tokens prefill, a chunk each filling the step's budget; a short prompt arriving meanwhile
    took no budget until they were done (four of 8,000 tokens held a served request's first token 50 s). Under
    priority scheduling the prefills but the first before it wait for the step's admissions: it samples in the
    step it arrives in, and the long prompts' tokens are theirs (batch-invariant kernels)."""
    kw = {"max_num_batched_tokens": 64, "max_chunk_tokens": 32, "batch_invariant": not NATIVE_OFF}
    one = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    requests = [
        {"prompt_token_ids": [3 + i] * 600, "request_id": f"long{i}", "priority": p, "sampling_params": one}
        for i, p in enumerate(priorities)
    ]
    short = {"prompt_token_ids": [5, 6], "request_id": "short", "arrival_step": 3, "sampling_params": one}
    firsts, outputs = {}, {}
    for policy in ("fcfs", "priority"):
        engine = make_engine(tiny, scheduling_policy=policy, **kw)
        for r in [*requests, short]:
            engine.add_request(**r)
        while engine.has_unfinished():
            out = engine.step()
            if "short" not in firsts.get(policy, {}) and any(s.request_id == "short" for s in out.samples):
                firsts[policy] = {"short": out.step}
        outputs[policy] = {r["request_id"]: engine.output(r["request_id"]).outputs[0].token_ids for r in requests}
    assert firsts["priority"]["short"] == 3 and firsts["fcfs"]["short"] >= 15, firsts
    if not NATIVE_OFF:
        assert outputs["priority"] == outputs["fcfs"]


def check_each_schedule(engine):
    """Have `engine` check, each time the scheduler has planned a step, that the waiting queue is in priority_key
    order and that no waiting sequence lacks a slot while a running sequence that comes after it holds one (a
    running head of n > 1 holds its samples' slots until they fork)."""
    run = engine.runner.run

    def checked(batch, *args, **kwargs):
        _check_priority_order(engine)
        return run(batch, *args, **kwargs)

    engine.runner.run = checked


def _check_priority_order(engine):
    sched = engine.scheduler
    waiting, running = list(sched.waiting), sched.running
    assert waiting == sorted(waiting, key=priority_key)
    used = sum(s.group_slots for s in running)
    last = max((priority_key(s) for s in running), default=None)
    for seq in waiting:
        assert used + seq.group_slots <= engine.cfg.max_num_seqs or last < priority_key(seq), (seq.seq_id, last)


request = st.fixed_dictionaries(
    {
        "length": st.integers(2, 20),
        "priority": st.integers(0, 3),
        "n": st.integers(1, 2),
        "arrival_step": st.integers(0, 8),
        "max_tokens": st.integers(1, 10),
        "temperature": st.sampled_from([0.0, 1.0]),
    }
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(request, min_size=2, max_size=8),
    max_num_seqs=st.integers(2, 5),
    num_kv_blocks=st.integers(16, 40),
    budget=st.integers(8, 48),
    mode=st.sampled_from(["recompute", "swap"]),
)
def test_priority_order_holds_at_every_step_and_changes_no_token(
    tiny_small_vocab, requests, max_num_seqs, num_kv_blocks, budget, mode
):
    """Whatever the arrivals, priorities, samples and pool: at each step the queue is in priority order and no
    sequence waits for a slot a later one holds; every request ends with its tokens, its blocks all given back; and
    (batch-invariant kernels) its tokens are those of a first-come, first-served run with room to spare."""
    specs = [
        {
            "prompt_token_ids": [(7 * i + 3 * j) % 60 + 2 for j in range(r["length"])],
            "request_id": f"r{i}",
            "priority": r["priority"],
            "arrival_step": r["arrival_step"],
            "sampling_params": SamplingParams(
                temperature=r["temperature"], seed=i, n=r["n"], max_tokens=r["max_tokens"], ignore_eos=True
            ),
        }
        for i, r in enumerate(requests)
    ]
    kw = {"block_size": 4, "batch_invariant": not NATIVE_OFF, "swap_space_gb": 1e-3}
    engine = make_engine(
        tiny_small_vocab,
        scheduling_policy="priority",
        max_num_seqs=max_num_seqs,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=budget,
        preemption_mode=mode,
        **kw,
    )
    check_each_schedule(engine)
    got = _run(engine, specs)
    for spec, samples in zip(specs, got.values()):
        assert [len(t) for t in samples] == [spec["sampling_params"].max_tokens] * spec["sampling_params"].n
    assert engine.block_manager.num_free_blocks == num_kv_blocks
    engine.block_manager.check_invariants()
    if not NATIVE_OFF:
        ample = make_engine(tiny_small_vocab, max_num_seqs=16, num_kv_blocks=512, max_num_batched_tokens=256, **kw)
        assert got == _run(ample, specs)


def test_a_server_schedules_by_priority_unless_told_otherwise():
    assert (
        serving_engine(OmegaConf.create({"engine": {"scheduling_policy": None}})).engine.scheduling_policy == "priority"
    )
    assert (
        serving_engine(OmegaConf.create({"engine": {"scheduling_policy": "fcfs"}})).engine.scheduling_policy == "fcfs"
    )


def test_a_bad_scheduling_policy_is_a_one_line_error():
    with pytest.raises(ConfigError, match="engine.scheduling_policy must be fcfs, priority or null, got 'lifo'"):
        EngineConfig(scheduling_policy="lifo")


def test_a_servers_request_of_many_prompts_does_not_hold_every_slot(tiny, tmp_path):
    """Two prompts of one /v1/completions request fill max_num_seqs=2 for 200 tokens; a request sent after them
    ends while they still run (it waited for their end before: every prompt was priority 0). The trace records
    each prompt's priority, and the run replays bit for bit."""
    from toolkit.reproduce.replay import replay

    engine = make_engine(
        tiny, scheduling_policy="priority", max_num_seqs=2, max_num_batched_tokens=64, sampling=SamplingParams()
    )
    srv = start_server(engine, tmp_path / "run", {"model": {"name": "tiny"}})
    try:
        done = {}

        def many():
            body = {"model": "tiny", "prompt": ["one two", "three four"], "max_tokens": 200, "ignore_eos": True}
            httpx.post(srv.url + "/v1/completions", json=body, timeout=120).raise_for_status()
            done["many"] = time.monotonic()

        thread = threading.Thread(target=many)
        thread.start()
        deadline = time.monotonic() + 60
        while len(engine.scheduler.running) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        body = {"model": "tiny", "prompt": "five", "max_tokens": 3, "temperature": 0.5, "seed": 1}
        one = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        done["one"] = time.monotonic()
        assert one.status_code == 200, one.text
        thread.join(120)
        assert done["one"] < done["many"]
    finally:
        srv.stop()
    rows = read_requests(tmp_path / "run").to_pylist()
    first = next(r for r in rows if r["request_body"] and json.loads(r["request_body"])["max_tokens"] == 200)
    many = sorted(
        (r["priority"], r["num_preemptions"]) for r in rows if r["request_id"][:-2] == first["request_id"][:-2]
    )
    assert many == [(0, 0), (1, 1)]  # prompt 1 gave way to the late request
    assert [r["request_body_sha256"] == first["request_body_sha256"] for r in rows] == [True, True, False]
    assert [r["request_body"] is not None for r in rows] == [True, False, True]  # a body on one row of its request
    report = replay(tmp_path / "run", [], out_dir=tmp_path / "replay")
    assert report.identical, report.summary_line()
