"""The engine's narrow API: one typed EngineRequest in (Engine.add), and the queries a caller outside
toolkit/engine may ask (toolkit/engine/queries.py) agreeing with what the engine does, step by step."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import make_engine
from toolkit.engine.request import EngineRequest
from toolkit.errors import RequestError
from toolkit.sampling.params import SamplingParams

pytestmark = pytest.mark.native


def test_add_and_add_request_are_one_call(tiny):
    """add_request(prompt, **fields) is add(EngineRequest(prompt, **fields)): the same tokens; an unknown field
    is a one-line RequestError, as is anything but an EngineRequest handed to intake."""
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=6, n=2)
    a, b = make_engine(tiny), make_engine(tiny)
    a.add(EngineRequest("The sea", sampling_params=params, request_id="x"))
    b.add_request("The sea", sampling_params=params, request_id="x")
    a.run_until_done(), b.run_until_done()
    assert [c.token_ids for c in a.output("x").outputs] == [c.token_ids for c in b.output("x").outputs]
    with pytest.raises(RequestError, match="bad request: .*unexpected keyword argument 'prompt_ids'"):
        b.add_request(prompt_ids=[1, 2])
    with pytest.raises(RequestError, match="must be an EngineRequest, got dict"):
        b.add({"prompt": "x"})


@pytest.mark.parametrize(
    "fields",
    [
        {"allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 2},
        {"allowed_token_ids": [2], "min_tokens": 1},  # EOS (<|im_end|>, 2) kept out while min_tokens holds
        {"allowed_token_ids": [5, 9], "bad_words": [(5,), (9,)]},
    ],
)
def test_allowed_tokens_that_are_all_banned_are_refused_at_intake(tiny, fields):
    """allowed_token_ids whose every token a one-token bad word or min_tokens bans left no token to sample: the
    request ended at its first step with finish_reason "error". It is a RequestError naming allowed_token_ids;
    with one token left (or ignore_eos freeing EOS) it runs."""
    engine = make_engine(tiny)
    assert engine.eos_token_ids == (2,)
    with pytest.raises(RequestError, match="^allowed_token_ids: every token it allows is banned"):
        engine.add_request(prompt_token_ids=[3, 4], sampling_params=SamplingParams(max_tokens=3, **fields))
    more = {**fields, "allowed_token_ids": [*fields["allowed_token_ids"], 7]}
    engine.add_request(prompt_token_ids=[3, 4], request_id="more", sampling_params=SamplingParams(max_tokens=3, **more))
    if fields.get("min_tokens") and not fields.get("stop_token_ids"):
        engine.add_request(
            prompt_token_ids=[3, 4],
            request_id="free",
            sampling_params=SamplingParams(max_tokens=3, ignore_eos=True, **fields),
        )
    engine.run_until_done()
    for request_id in engine.requests:
        out = engine.output(request_id).outputs[0]
        assert out.finish_reason in ("stop", "length") and out.token_ids[0] == (7 if request_id == "more" else 2)


workloads = st.lists(
    st.tuples(st.integers(1, 24), st.integers(1, 6), st.sampled_from([1, 1, 2]), st.integers(0, 4)),
    min_size=1,
    max_size=6,
)


@settings(max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workloads, st.data())
def test_the_queries_agree_with_the_steps(tiny, workload, data):
    """At every step of a random workload (prompts, lengths, n, arrival steps, aborts, a tight KV pool that
    preempts): the running set, the request of each sequence, which requests are finished, and the stats'
    counts agree with each other and with the step's output; at the end every block is free again."""
    engine = make_engine(tiny, num_kv_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    ids = [
        engine.add(
            EngineRequest(
                prompt_token_ids=[(7 * i + j) % 60 + 1 for j in range(length)],
                sampling_params=SamplingParams(temperature=0.0, max_tokens=tokens, n=n, ignore_eos=True),
                request_id=f"r{i}",
                arrival_step=arrive,
            )
        )
        for i, (length, tokens, n, arrive) in enumerate(workload)
    ]
    assert engine.request_ids() == ids and engine.stats().requests == len(ids)
    while engine.has_unfinished():
        if data.draw(st.integers(0, 9), label="abort?") == 0:
            engine.abort(data.draw(st.sampled_from(ids), label="which"))
        out = engine.step()
        running = engine.running_sequences()
        stats = engine.stats()
        assert stats.running == len(running) and stats.step == engine.step_index
        assert engine.running_request_ids() == {s.request_id for s in running}
        assert stats.kv_blocks_used + stats.kv_blocks_free == stats.kv_blocks_total
        for seq_id in out.finished:
            request_id = engine.request_of(seq_id)
            assert seq_id in {s.seq_id for s in engine.sequences(request_id)}
        unfinished = set(engine.unfinished_request_ids())
        for r in ids:
            seqs = engine.sequences(r)
            assert [s.stream for s in seqs] == list(range(len(seqs)))
            assert engine.is_finished(r) == (r not in unfinished) == all(s.is_finished for s in seqs)
        assert stats.decoding == sum(s.status.value == "decoding" for r in ids for s in engine.sequences(r))
    engine.check_invariants()
    end = engine.stats()
    assert (end.running, end.waiting, end.kv_blocks_used) == (0, 0, 0) and not engine.unfinished_request_ids()
    for r in ids:
        engine.release(r)
        assert not engine.has_request(r)
    assert engine.stats().requests == 0
