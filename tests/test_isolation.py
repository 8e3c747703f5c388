"""A failing request never harms another: in the same steps, the others produce exactly the tokens
(and, in batch-invariant mode, the logits bits) they produce alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import make_engine, native_only
from toolkit.sampling import processors
from toolkit.sampling.params import SamplingParams

pytestmark = native_only

KW = dict(batch_invariant=True, max_num_batched_tokens=24, max_num_seqs=4)


def _requests():
    good = [
        dict(
            prompt_token_ids=list(range(10 * i + 3, 10 * i + 20)),
            request_id=f"good{i}",
            arrival_step=i,
            sampling_params=SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True),
        )
        for i in range(3)
    ]
    bad = dict(
        prompt_token_ids=[7, 8, 9, 10],
        request_id="bad",
        arrival_step=1,
        sampling_params=SamplingParams(temperature=1.0, seed=9, max_tokens=12, ignore_eos=True, logit_bias={5: 1.0}),
    )
    return good, bad


def _run(engine, requests, steps: list | None = None):
    """Every request run to its end: each sampled row's logits by (request, position), and the trace rows;
    `steps` collects the StepOutputs."""
    for r in requests:
        engine.add_request(**r)
    rows, traces = {}, []
    while engine.has_unfinished():
        out = engine.step()
        if steps is not None:
            steps.append(out)
        traces.extend(out.samples)
        for s in out.samples:
            if s.token_id >= 0:
                rows[(s.request_id, s.position)] = out.logits_RV[s.logits_row].clone()
    return rows, traces


def test_a_processor_exception_finishes_only_its_request(tiny, monkeypatch):
    good, bad = _requests()
    alone = {}
    for r in good:
        rows, _ = _run(make_engine(tiny, **KW), [r])
        alone.update(rows)

    def exploding(logits_RV, view):
        raise RuntimeError("custom processor bug")

    monkeypatch.setitem(processors.REGISTRY, "logit_bias", exploding)
    engine = make_engine(tiny, **KW)
    rows, traces = _run(engine, good + [bad])
    out = engine.output("bad")
    assert out.finish_reason == "error" and len(out.output_token_ids) == 0
    err = [t for t in traces if t.request_id == "bad"]
    assert len(err) == 1 and err[0].token_id == -1 and "custom processor bug" in err[0].error
    for r in good:
        assert engine.output(r["request_id"]).finish_reason == "length"
    assert set(alone) == {k for k in rows if k[0] != "bad"}
    assert all(torch.equal(alone[k], rows[k]) for k in alone)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9), dict(temperature=0.7, top_k=5, repetition_penalty=1.3)],
)
def test_nan_logits_finish_only_their_request(tiny, monkeypatch, sampling):
    """The bad request's rows are NaN: found before its processors (plain sampling) or after the sampler's
    kernel read them (a tail, with or without the repetition penalty's changes), it ends with that error."""
    good, bad = _requests()
    bad = dict(bad, sampling_params=SamplingParams(**sampling, seed=9, max_tokens=12, ignore_eos=True))
    alone = {}
    for r in good:
        rows, _ = _run(make_engine(tiny, **KW), [r])
        alone.update(rows)
    engine = make_engine(tiny, **KW)
    original = engine.runner.run

    def poisoned(batch, *args, **kwargs):  # the model emits NaN for the bad request's rows
        out = original(batch, *args, **kwargs)
        logits, row = out.logits_RV.clone(), 0
        for chunk in out.sample_chunks:
            if chunk.seq_id == "bad":
                logits[row : row + chunk.num_logits] = float("nan")
            row += chunk.num_logits
        return dataclasses.replace(out, logits_RV=logits)

    monkeypatch.setattr(engine.runner, "run", poisoned)
    rows, traces = _run(engine, good + [bad])
    assert engine.output("bad").finish_reason == "error"
    assert any(t.request_id == "bad" and "NaN" in (t.error or "") for t in traces)
    assert all(torch.equal(alone[k], rows[k]) for k in alone) and len(alone) == 36


def _batch_of_32(poison: str):
    reqs = [
        dict(
            prompt_token_ids=[(7 * i + j) % 200 + 3 for j in range(5 + i % 7)],
            request_id=f"r{i}",
            sampling_params=SamplingParams(temperature=1.0, seed=i, max_tokens=8, ignore_eos=True),
        )
        for i in range(32)
    ]
    return [r for r in reqs if r["request_id"] != poison], next(r for r in reqs if r["request_id"] == poison)


POISON_KW = dict(batch_invariant=True, max_num_seqs=32, max_num_batched_tokens=512)


@pytest.mark.parametrize("stage", ["forward", "decide"])
def test_a_step_raising_for_one_request_fails_it_alone(tiny, monkeypatch, stage):
    """A poison request among 32 (its forward, or its decision, raises whenever it is in the batch from its
    4th token on): the step is bisected, the poison alone ends with "error" (StepOutput.failed says why), in a
    bounded number of forwards, and the 31 others keep exactly the tokens and logits bits of a run without it."""
    others, poison = _batch_of_32("r13")
    without, _ = _run(make_engine(tiny, **POISON_KW), others)
    engine = make_engine(tiny, **POISON_KW)
    target = engine.runner if stage == "forward" else engine.decider
    name = "run" if stage == "forward" else "decide"
    original = getattr(target, name)

    def poisoned(*args, **kwargs):
        seqs = {c.seq_id for c in args[0].chunks} if stage == "forward" else set(args[2])
        if stage == "decide":
            seqs = {c.seq_id for c in args[0].sample_chunks}
        if "r13" in seqs and engine.requests["r13"].num_output_tokens >= 3:
            raise RuntimeError("poisoned by r13")
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, poisoned)
    rows, traces = _run(engine, others + [poison], steps := [])
    failed, forwards = [f for out in steps for f in out.failed], [out.forwards for out in steps]
    assert all(s.request_id != "r13" or s.error is None for s in traces)
    bad = engine.output("r13")
    assert bad.finish_reason == "error" and len(bad.outputs[0].token_ids) == 3
    assert [r for r, _ in failed] == ["r13"] and "poisoned by r13" in failed[0][1]
    assert 2 < max(forwards) <= 2 + 2 * 5  # the failed forward, a probe pair per halving of 32, the retry
    assert {k for k in rows if k[0] != "r13"} == set(without)
    assert all(torch.equal(without[k], rows[k]) for k in without)
    assert all(engine.output(r["request_id"]).finish_reason == "length" for r in others)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_step_that_fails_for_everyone_or_for_no_one_alone_raises(tiny, monkeypatch):
    """No request to blame: the step raises its exception (the caller's loop counts failed steps). Every request
    failing alone is the engine's fault; a failure no part of the batch repeats is the step's."""
    others, _ = _batch_of_32("r0")
    engine = make_engine(tiny, **POISON_KW)
    original, calls = engine.runner.run, []

    def broken(*args, **kwargs):
        calls.append(len(args[0].chunks))
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "run", broken)
    for r in others[:8]:
        engine.add_request(**r)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert len(calls) <= 1 + 4 * 4 + 4  # bounded probing

    engine = make_engine(tiny, **POISON_KW)
    original, once = engine.runner.run, []

    def transient(*args, **kwargs):
        if not once:
            once.append(1)
            raise RuntimeError("transient")
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "run", transient)
    for r in others[:8]:
        engine.add_request(**r)
    with pytest.raises(RuntimeError, match="transient"):
        engine.step()


def test_a_commit_raising_for_one_sequence_ends_only_it(tiny, monkeypatch):
    """The commit stage (detokenizing, the grammar's accept) raising for one sequence ends it ("error", no
    token kept that has no trace row); its batch-mates' rows are those of a run without it."""
    others, poison = _batch_of_32("r5")
    without, _ = _run(make_engine(tiny, **POISON_KW), others)
    engine = make_engine(tiny, **POISON_KW)
    original = engine.committer.commit_row

    def commit_row(seq, token, error):
        if seq.request_id == "r5" and seq.num_output_tokens == 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return original(seq, token, error)

    monkeypatch.setattr(engine.committer, "commit_row", commit_row)
    rows, traces = _run(engine, others + [poison], steps := [])
    failed, traced = [f for out in steps for f in out.failed], [s.position for s in traces if s.request_id == "r5"]
    bad = engine.output("r5")
    assert bad.finish_reason == "error" and len(bad.outputs[0].token_ids) == 2
    assert len(traced) == 2  # every token it kept has its row, and no other
    assert [r for r, _ in failed] == ["r5"] and "UnicodeDecodeError" in failed[0][1]
    assert all(torch.equal(without[k], rows[k]) for k in without) and len(rows) == len(without) + 2
