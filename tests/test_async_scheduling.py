"""Async scheduling (engine.async_scheduling, toolkit/engine/ahead.py): the next decode step is scheduled and its
forward run before this step's tokens are committed, its input tokens fed from this step's choices. What it must
keep: every sampled row, the same as without it (in the batch-invariant mode, bit for bit whatever the workload:
stops that leave a computed row to drop, arrivals, preemptions, parallel samples, aborts); and the steps it
schedules ahead are the ones the engine would schedule, so that without a dropped row even the default mode's bits
are unchanged."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import make_engine, native_only
from tests.test_grammar import grammar_mixes
from tests.test_replay_verify import MIXED, make_run
from toolkit import replay, verify
from toolkit.config import EngineConfig, ModelConfig, SpeculativeConfig
from toolkit.engine.core import Engine
from toolkit.engine.request import EngineRequest
from toolkit.errors import ConfigError
from toolkit.models import load_model
from toolkit.sampling.params import SamplingParams

UNSTORED = ("t_emit_s", "logits_row")
VOCAB = 24  # small: stop tokens are sampled, so steps queued ahead carry rows to drop


@pytest.fixture(scope="module")
def model():
    return load_model(ModelConfig(name="tiny", seed=4, vocab_size=VOCAB, num_layers=2, hidden_size=64))


REQUEST = st.fixed_dictionaries(
    {
        "prompt": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14),
        "max_tokens": st.integers(1, 12),
        "temperature": st.sampled_from([0.0, 0.8, 1.5]),
        "stop": st.lists(st.integers(0, VOCAB - 1), max_size=3),
        "n": st.sampled_from([1, 1, 1, 2]),
        "arrival": st.integers(0, 6),
        "logprobs": st.integers(0, 2),
    }
)


def run(model, requests, aborts=(), **engine) -> tuple[list[dict], int]:
    """Every sample row (the trace's, without its clock) of the requests run to the end, and how many steps were
    resolved from a queued lookahead. `aborts`: (step, request index), aborted before that step."""
    e = Engine(model, EngineConfig(**engine))
    ids = [
        e.add(
            EngineRequest(
                prompt_token_ids=r["prompt"],
                arrival_step=r["arrival"],
                sampling_params=SamplingParams(
                    max_tokens=r["max_tokens"],
                    temperature=r["temperature"],
                    seed=i,
                    stop_token_ids=r["stop"],
                    n=r["n"],
                    logprobs=r["logprobs"],
                    ignore_eos=r.get("ignore_eos", False),
                ),
            )
        )
        for i, r in enumerate(requests)
    ]
    rows, ahead, due = [], 0, sorted(aborts)
    while e.has_unfinished():
        while due and due[0][0] <= e.step_index:
            request_id = ids[due.pop(0)[1]]
            if not e.output(request_id).finished:
                e.abort(request_id)
        ahead += e.pipeline.queued is not None if e.pipeline else 0
        out = e.step()
        # without the clock, and the row's index in its step's logits (not stored: the writer digests that row)
        rows += [{k: v for k, v in dataclasses.asdict(s).items() if k not in UNSTORED} for s in out.samples]
    return sorted(rows, key=lambda r: (r["request_id"], r["stream"], r["position"])), ahead


def same(rows_a: list[dict], rows_b: list[dict]) -> bool:
    """Rows equal field for field, floats by their bits (NaN noise of greedy rows included)."""
    return [repr(r) for r in rows_a] == [repr(r) for r in rows_b]


@native_only  # the batch-invariant mode
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(REQUEST, min_size=1, max_size=6),
    max_num_seqs=st.integers(2, 6),
    budget=st.sampled_from([8, 16, 64]),
    blocks=st.sampled_from([None, 16]),
    block_size=st.sampled_from([2, 4]),
    prefix_caching=st.booleans(),
    aborts=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 5)), max_size=2),
    graphs=st.sampled_from(["off", "eager"]),
)
def test_every_row_is_the_same_bits_with_async_scheduling(
    model, requests, max_num_seqs, budget, blocks, block_size, prefix_caching, aborts, graphs
):
    """In the batch-invariant mode, any workload gives every sample row (token, both log-probabilities, noise,
    alternatives, step, batch size, finish) the same bits with and without async scheduling: stop tokens end
    sequences whose next row was already computed (dropped), arrivals and waiting prompts stop the lookahead,
    a small KV pool preempts, parallel samples fork, aborts land while a step is queued; decode steps packed or in
    the CUDA-graph buckets (run eagerly here), whose token buffer the choices are copied into."""
    aborts = [(step, i % len(requests)) for step, i in aborts]
    engine = dict(
        batch_invariant=True,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        num_kv_blocks=blocks,
        block_size=block_size,
        enable_prefix_caching=prefix_caching,
        cuda_graphs=graphs,
    )
    want, _ = run(model, requests, aborts, **engine)
    got, _ = run(model, requests, aborts, async_scheduling=True, **engine)
    assert same(got, want)


@native_only  # the batch-invariant mode
def test_steps_are_resolved_ahead_and_stops_drop_their_queued_rows(model):
    """A fixed workload that stops early and late: most steps are resolved from the queue, the rows are the same
    bits as without async scheduling, and sequences that a stop token ended got no row past it."""
    requests = [
        dict(prompt=[i, 3, 5, i + 1], max_tokens=10 + i, temperature=0.9, stop=[2, 11], n=1, arrival=0, logprobs=1)
        for i in range(6)
    ]
    want, _ = run(model, requests, batch_invariant=True)
    got, ahead = run(model, requests, batch_invariant=True, async_scheduling=True)
    assert same(got, want)
    steps = max(r["step"] for r in got) + 1
    assert ahead >= steps // 2, (ahead, steps)
    stopped = [r for r in got if r["finish_reason"] == "stop"]
    assert stopped, "the workload should stop some sequences on their stop tokens"
    for r in stopped:
        assert not [x for x in got if x["request_id"] == r["request_id"] and x["position"] > r["position"]]


@pytest.mark.native
def test_the_default_modes_bits_are_unchanged_where_no_row_is_dropped(model):
    """The steps scheduled ahead are the steps the engine schedules: without a row to drop (no stop, EOS ignored,
    the same lengths), the default mode (its matmuls' bits follow the batch's rows; torch's too, the kernels off)
    gives the same bits too."""
    requests = [
        dict(prompt=[(7 * i + j) % VOCAB for j in range(3 + i)], max_tokens=9, temperature=t, stop=[], n=1, arrival=0)
        | {"logprobs": 2, "ignore_eos": True}
        for i, t in enumerate([0.0, 0.7, 1.2, 0.0])
    ]
    engine = dict(max_num_batched_tokens=64)
    want, _ = run(model, requests, **engine)
    got, ahead = run(model, requests, async_scheduling=True, **engine)
    assert ahead > 0 and same(got, want)


@pytest.mark.native
def test_async_scheduling_refuses_speculative_decoding(model):
    with pytest.raises(ConfigError, match="async_scheduling=true does not combine with speculative decoding"):
        Engine(model, EngineConfig(async_scheduling=True), None, SpeculativeConfig(method="ngram"))


@native_only  # the batch-invariant mode
def test_a_request_added_while_a_step_is_queued_replays_from_its_recorded_arrival(model):
    """A request added between steps while the next step is already queued joins the step after it, and that is
    the arrival step it records: added up front with it, it gets the same rows (a replay's case). Recorded as the
    step it was added at, the replay would admit it a step earlier than the live run did."""
    first = [dict(prompt=[1, 2, 3], max_tokens=8, temperature=0.0, stop=[], n=1, arrival=0, logprobs=0)]
    e = Engine(model, EngineConfig(batch_invariant=True, async_scheduling=True))
    live_ids = [e.add(EngineRequest(prompt_token_ids=first[0]["prompt"], sampling_params={"max_tokens": 8}))]
    rows = []
    for _ in range(3):
        rows += e.step().samples
    assert e.pipeline.queued is not None  # a step is queued: the late request cannot join it
    live_ids.append(e.add(EngineRequest(prompt_token_ids=[4, 5], sampling_params={"max_tokens": 6})))
    arrival = e.requests[e.groups[live_ids[1]][0]].arrival_step
    assert arrival == e.step_index + 1
    while e.has_unfinished():
        rows += e.step().samples
    again = Engine(model, EngineConfig(batch_invariant=True, async_scheduling=True))
    again.add(EngineRequest(prompt_token_ids=[1, 2, 3], sampling_params={"max_tokens": 8}, request_id=live_ids[0]))
    again.add(
        EngineRequest(
            prompt_token_ids=[4, 5], sampling_params={"max_tokens": 6}, request_id=live_ids[1], arrival_step=arrival
        )
    )
    replayed = []
    while again.has_unfinished():
        replayed += again.step().samples
    strip = lambda rows: [repr({**dataclasses.asdict(r), "t_emit_s": 0}) for r in rows]  # noqa: E731 - one engine
    assert strip(replayed) == strip(rows)


@pytest.mark.native
def test_an_async_run_replays_bit_for_bit_and_verifies(tmp_path):
    """A recorded run with async scheduling (stop strings, arrivals, parallel samples, a penalty; SmolLM2's
    tokenizer on the tiny model) replays bit for bit under its own config, and verify's recomputation passes."""
    tiny = load_model(ModelConfig(name="tiny", seed=0))
    engine_cfg = {"max_num_batched_tokens": 16, "max_num_seqs": 4, "num_kv_blocks": 256, "async_scheduling": True}
    make_run(tiny, tmp_path / "run", MIXED, engine_cfg)
    report = replay(tmp_path / "run", out_dir=tmp_path / "replay")
    assert report.identical, report.summary_line()
    assert verify(tmp_path / "run", out_dir=tmp_path / "verify").passed


@native_only  # the batch-invariant mode
def test_a_request_aborted_while_its_next_step_is_queued_gets_no_row_there(model):
    """Aborted between steps while the step after is queued with its row (its decide staged too): the queued row
    is dropped, the request ends where the abort found it, and its batch mates' rows are those of the same abort
    without async scheduling."""
    requests = [
        dict(prompt=[i + 1, 2, 3], max_tokens=10, temperature=0.8, stop=[], n=1, arrival=0, logprobs=0)
        for i in range(3)
    ]
    want, _ = run(model, requests, [(4, 1)], batch_invariant=True)
    got, ahead = run(model, requests, [(4, 1)], batch_invariant=True, async_scheduling=True)
    assert ahead and same(got, want)
    aborted = sorted({r["request_id"] for r in got})[1]
    assert max(r["step"] for r in got if r["request_id"] == aborted) == 3


@native_only  # the batch-invariant mode
@pytest.mark.parametrize("stage", ["forward", "stage", "finish"])
def test_a_request_whose_step_raises_fails_alone_with_async_scheduling(model, stage):
    """A poison request (its forward, its decide stage or its decide's finish raises whenever it is in a step from
    its 4th token on):
    the queued step it poisons is dropped, the engine schedules that step anew and isolates the failure as it does
    without async scheduling; the poison alone ends with "error", the others keep their rows' bits, and every KV
    block comes back."""

    def engine_with(names):
        e = Engine(model, EngineConfig(batch_invariant=True, async_scheduling=True, max_num_seqs=8))
        for i in names:
            prompt = [(5 * i + j) % VOCAB for j in range(4 + i)]
            e.add(
                EngineRequest(prompt_token_ids=prompt, request_id=f"r{i}", sampling_params={"max_tokens": 9, "seed": i})
            )
        return e

    def rows_of(e):
        rows = []
        while e.has_unfinished():
            rows += [(s.request_id, s.position, s.token_id, repr(s.raw_logprob)) for s in e.step().samples]
        return sorted(r for r in rows if r[0] != "r3")

    without = rows_of(engine_with([0, 1, 2, 4, 5]))
    e = engine_with(range(6))
    target, name = (e.runner, "run") if stage == "forward" else (e.decider, stage)
    original = getattr(target, name)

    def poisoned(*args, **kwargs):
        step = args[0]
        if stage == "finish":
            seqs = {r.seq.seq_id for r in step.rows}
        else:
            seqs = {c.seq_id for c in (step.chunks if stage == "forward" else step.sample_chunks)}
        if "r3" in seqs and e.requests["r3"].num_output_tokens >= 3:
            raise RuntimeError("poisoned")
        return original(*args, **kwargs)

    setattr(target, name, poisoned)
    assert rows_of(e) == without
    bad = e.output("r3")
    # a queued forward runs before the step before it commits: the first forward launched with r3 past 3 tokens is
    # the one after its 4th token's
    assert bad.finish_reason == "error" and len(bad.outputs[0].token_ids) == (4 if stage == "forward" else 3)
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


@native_only  # the batch-invariant mode
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=grammar_mixes(), stops=st.sampled_from([[], ["a"], ["e", "}"]]))
def test_grammars_and_stop_strings_keep_every_rows_bits(tiny, mix, stops):
    """Structured outputs (regex, choice, JSON schema, EBNF; the mask of a queued step is filled after the step
    before is committed, its matcher advanced) and stop strings (found in the committed text, so the queued row of
    a sequence they end is dropped), SmolLM2's tokenizer on the tiny model: every row the same bits with and
    without async scheduling."""
    requests, budget = mix
    for r in requests:
        r["sampling_params"] = dataclasses.replace(r["sampling_params"], stop=stops) if stops else r["sampling_params"]

    def rows(**engine):
        e = make_engine(
            tiny, batch_invariant=True, max_num_batched_tokens=budget, max_num_seqs=min(budget, 6), **engine
        )
        for r in requests:
            e.add_request(**r)
        out = []
        while e.has_unfinished():
            out += [{k: v for k, v in dataclasses.asdict(x).items() if k not in UNSTORED} for x in e.step().samples]
        return sorted(out, key=lambda r: (r["request_id"], r["position"]))

    assert same(rows(async_scheduling=True), rows())


@pytest.mark.parametrize("graphs", ["eager", "off"])
def test_the_device_route_queues_the_next_step_without_a_read(model, monkeypatch, graphs):
    """On a GPU a read of a value waits for the device to drain, so async scheduling's lookahead (the next step's
    schedule and forward) and staging (its processors and the sampler's queued work) must read nothing. Run here
    on the device's route (devices.off_cpu widened, the native CPU kernels off: top-p ranking whole rows, the
    read-once sample queued at staging), sampled rows with top-p, top-k, min-p, penalties, a logit bias and
    alternatives: no host read in either (tests/host_reads.py), every request runs to its end, and with the tokens
    it gets without async scheduling. (Reading which rows a processor emptied as it ran made one read a processor;
    top-p's top-256 loop three.)"""
    from tests.host_reads import HostReads
    from toolkit import devices
    from toolkit.engine import ahead

    with devices.device_route():  # the device's route, on CPU tensors
        reads: dict[str, int] = {}
        for name in ("_look_ahead", "_stage"):
            original = getattr(ahead.Pipeline, name)

            def counted(self, *args, _original=original, _name=name, **kwargs):
                with HostReads() as seen:
                    out = _original(self, *args, **kwargs)
                for what, n in seen.counts.items():
                    reads[f"{_name}: {what}"] = reads.get(f"{_name}: {what}", 0) + n
                return out

            monkeypatch.setattr(ahead.Pipeline, name, counted)
        params = [
            SamplingParams(temperature=0.8, top_p=0.9, seed=1),
            SamplingParams(temperature=0.7, top_k=5, min_p=0.05, repetition_penalty=1.2, seed=2, logprobs=2),
            SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={5: 3.0}),
        ]

        def engine_with_requests(async_scheduling: bool) -> tuple[Engine, list[str]]:
            engine = Engine(model, EngineConfig(max_num_seqs=8, async_scheduling=async_scheduling, cuda_graphs=graphs))
            ids = [
                engine.add_request(
                    prompt_token_ids=[(7 * i + j) % VOCAB for j in range(6)],
                    sampling_params=p.replace(max_tokens=16, ignore_eos=True),
                )
                for i, p in enumerate(params * 2)
            ]
            return engine, ids

        engine, ids = engine_with_requests(True)
        lookaheads = 0
        while engine.has_unfinished():
            lookaheads += engine.pipeline.queued is not None
            engine.step()
        assert lookaheads >= 10 and reads == {}, reads
        assert all(len(engine.output(i).outputs[0].token_ids) == 16 for i in ids)
        # the lookahead fed each step the choices the step before made (as they are, or gathered): the default's tokens
        default, _ = engine_with_requests(False)
        default.run_until_done()
        assert [engine.output(i).outputs[0].token_ids for i in ids] == [
            default.output(i).outputs[0].token_ids for i in ids
        ]
