"""A failing request never harms another: in the same steps, the others produce exactly the tokens
(and, in batch-invariant mode, the logits bits) they produce alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import make_engine, native_only

pytestmark = native_only
from toolkit.sampling import processors
from toolkit.sampling.params import SamplingParams

KW = dict(batch_invariant=True, max_num_batched_tokens=24, max_num_seqs=4)


def _requests():
    good = [dict(prompt_token_ids=list(range(10 * i + 3, 10 * i + 20)), request_id=f"good{i}", arrival_step=i,
                 sampling_params=SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True))
            for i in range(3)]
    bad = dict(prompt_token_ids=[7, 8, 9, 10], request_id="bad", arrival_step=1,
               sampling_params=SamplingParams(temperature=1.0, seed=9, max_tokens=12, ignore_eos=True,
                                              logit_bias={5: 1.0}))
    return good, bad


def _run(engine, requests):
    for r in requests:
        engine.add_request(**r)
    rows, traces = {}, []
    while engine.has_unfinished():
        out = engine.step()
        traces.extend(out.samples)
        for i, s in enumerate(out.samples):
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


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9),
                                      dict(temperature=0.7, top_k=5, repetition_penalty=1.3)])
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
                logits[row:row + chunk.num_logits] = float("nan")
            row += chunk.num_logits
        return dataclasses.replace(out, logits_RV=logits)

    monkeypatch.setattr(engine.runner, "run", poisoned)
    rows, traces = _run(engine, good + [bad])
    assert engine.output("bad").finish_reason == "error"
    assert any(t.request_id == "bad" and "NaN" in (t.error or "") for t in traces)
    assert all(torch.equal(alone[k], rows[k]) for k in alone) and len(alone) == 36
