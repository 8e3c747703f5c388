"""Logits processors: hand-computed cases, purity, per-row vectorisation, order, empty support."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import native_only
from toolkit.sampling import sampler
from toolkit.sampling.params import (
    MAX_LOGIT_BIAS,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    SamplingParams,
)
from toolkit.sampling.processors import REGISTRY, BatchView, RowState, apply_pipeline, truncation
from toolkit.sampling.processors.masks import banned_ngram_next_tokens

INF = float("inf")
PATHS = [pytest.param("native", marks=native_only), "torch"]  # the processors' native kernels, torch's code


def view(*rows: tuple[SamplingParams, list[int], int], vocab: int = 8, eos=(7,), bad=None) -> BatchView:
    """rows: (params, token_ids, num_prompt_tokens)."""
    return BatchView(
        tuple(RowState(p, t, n, (bad or {}).get(i, ())) for i, (p, t, n) in enumerate(rows)),
        vocab,
        torch.device("cpu"),
        tuple(eos),
    )


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0]])
    out = REGISTRY["repetition_penalty"](logits, view((SamplingParams(repetition_penalty=2.0), [0, 1], 1), vocab=4))
    assert out.tolist() == [[1.0, -4.0, 3.0, -1.0]]  # tokens 0 and 1 seen (prompt and output); 2, 3 untouched


def test_presence_and_frequency_penalties_count_output_only():
    logits = torch.zeros(1, 4)
    v = view((SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [3, 1, 1, 2], 1), vocab=4)
    assert REGISTRY["presence_penalty"](logits, v).tolist() == [[0.0, -0.5, -0.5, 0.0]]  # token 3 is prompt
    assert REGISTRY["frequency_penalty"](logits, v).tolist() == [[0.0, -0.5, -0.25, 0.0]]


def test_no_repeat_3gram_on_the_cat_sat_on_the_cat_bans_sat():
    the, cat, sat, on = 1, 2, 3, 4
    tokens = [the, cat, sat, on, the, cat]
    assert banned_ngram_next_tokens(tokens, 3) == {sat}
    out = REGISTRY["no_repeat_ngram"](torch.zeros(1, 8), view((SamplingParams(no_repeat_ngram_size=3), tokens, 0)))
    assert out[0, sat] == -INF and torch.isfinite(out[0, [0, 1, 2, 4, 5, 6, 7]]).all()


def top_p_on(path: str, x: torch.Tensor, v) -> torch.Tensor:
    """top_p by one path: the native kernel, torch's top-k ranking (the CPU's fallback), or torch's ranking of whole
    rows, two rows a block (what a GPU runs: nothing read back)."""
    with pytest.MonkeyPatch.context() as patch:
        if path != "native":
            patch.setattr(truncation, "truncate_cpu", lambda *a, **k: None)
        if path == "whole":
            patch.setattr(truncation, "WHOLE_RANKING_ELEMENTS", 2 * x.shape[1])
            return truncation.top_p(x, v, first_k=None)
        return REGISTRY["top_p"](x, v)


@pytest.mark.native
@pytest.mark.parametrize("path", [*PATHS, "whole"])
@pytest.mark.parametrize(
    "p, support",
    [
        (0.6, {0, 1}),
        (0.4999, {0}),
        (0.5001, {0, 1}),
        (0.7999, {0, 1}),
        (0.8001, {0, 1, 2}),
        (1e-6, {0}),
        (1.0, {0, 1, 2}),
    ],
)
def test_top_p_keeps_the_token_that_crosses_p(path, p, support):
    """Masses 0.5, 0.3, 0.2: p just under a cumulative mass keeps the token that reaches it, p just over keeps the
    next. (At p = 0.5 or 0.8 exactly, the side is decided by how log(0.3) and the sum round in fp32: not asked.)"""

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    out = top_p_on(path, logits, view((SamplingParams(top_p=p), [0], 1), vocab=3))
    assert set(torch.isfinite(out[0]).nonzero().flatten().tolist()) == support


@pytest.mark.native
@pytest.mark.parametrize("path", [*PATHS, "whole"])
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.sampled_from([3, 17, 1000, 49152]),
    scale=st.sampled_from([0.3, 3.0, 30.0]),
    p=st.floats(0.05, 0.99),
    ties=st.booleans(),
    masked=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_top_p_is_the_smallest_set_reaching_p(path, rows, vocab, scale, p, ties, masked, seed):
    """Every path (the native bisection, the torch top-k ranking, whole rows ranked in blocks) keeps exactly
    {x >= t} where the tokens above t hold less than p of the mass and those at or above t at least p (to 1e-5)."""
    from toolkit.native.sampling_ops import truncate_cpu

    if path == "native":
        assert truncate_cpu(torch.zeros(1, 4), "top_p", torch.tensor([0.5])) is not None
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    if ties:
        x = x.round()
    if masked and vocab > 3:
        x[0, vocab // 3 :] = -INF  # an earlier processor's truncation
    out = top_p_on(path, x, view(*[(SamplingParams(top_p=p), [0], 1)] * rows, vocab=vocab))
    probs = torch.softmax(x.double(), dim=-1)
    for r in range(rows):
        kept = torch.isfinite(out[r])
        t = x[r][kept].min()
        assert torch.equal(kept, x[r] >= t)
        assert float(probs[r][x[r] > t].sum()) < p + 1e-5
        assert float(probs[r][kept].sum()) >= p - 1e-5


@native_only
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.sampled_from([3, 17, 1000, 49152]),
    k=st.integers(1, 300),
    ties=st.booleans(),
    masked=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_native_top_k_is_torchs_topk(rows, vocab, k, ties, masked, seed):
    """The native top-k (bisection with exact counts) keeps exactly what torch.topk's k-th value keeps,
    ties with the k-th included, and a row with fewer than k finite logits whole."""
    from toolkit.native import sampling_ops

    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    if ties:
        x = x.round()
    if masked and vocab > 3:
        x[0, vocab // 3 :] = -INF
    v = view(*[(SamplingParams(top_k=k), [0], 1)] * rows, vocab=vocab)
    native, _ = sampling_ops.truncate_cpu(x, "top_k", torch.full((rows,), float(min(k, vocab))))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(truncation, "truncate_cpu", lambda *a, **kw: None)
        reference = REGISTRY["top_k"](x, v)
    assert torch.equal(native, reference)


@pytest.mark.native
def test_top_k_min_p_temperature_per_row():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0]])
    v = view((SamplingParams(top_k=1), [0], 1), (SamplingParams(top_k=3), [0], 1), vocab=4)
    assert torch.isfinite(REGISTRY["top_k"](logits, v)).sum(-1).tolist() == [1, 3]
    probs = torch.softmax(logits[0], -1)  # min_p 0.3: keep p >= 0.3 * p_max
    v = view((SamplingParams(min_p=0.3), [0], 1), (SamplingParams(min_p=0.04), [0], 1), vocab=4)  # e^-3 = 0.0498
    kept = torch.isfinite(REGISTRY["min_p"](logits, v))
    assert kept[0].tolist() == (probs >= 0.3 * probs[0]).tolist() and kept[1].all()
    v = view((SamplingParams(temperature=0.5), [0], 1), (SamplingParams(temperature=2.0), [0], 1), vocab=4)
    assert REGISTRY["temperature"](logits, v).tolist() == [[8.0, 6.0, 4.0, 2.0], [2.0, 1.5, 1.0, 0.5]]


def test_masks_allowed_bad_words_bias_min_tokens():
    logits = torch.zeros(1, 8)
    out = REGISTRY["allowed_token_ids"](logits, view((SamplingParams(allowed_token_ids=[2, 5]), [0], 1)))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [2, 5]
    # a list of repeats and ids past the logits' width: kept once each, sorted, and the wide ones masked anyway
    many = SamplingParams(allowed_token_ids=[9, 5, 2, 5, 9] * 1000)
    assert many.allowed_token_ids == (2, 5, 9)
    out = REGISTRY["allowed_token_ids"](logits, view((many, [0], 1)))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [2, 5]
    # bad word [3, 4]: 4 is banned only right after 3 was generated; single-token bad word 6 always
    params = SamplingParams(bad_words=[[3, 4], [6]])
    after_3 = REGISTRY["bad_words"](logits, view((params, [0, 3], 1), bad={0: ((3, 4), (6,))}))
    after_2 = REGISTRY["bad_words"](logits, view((params, [0, 2], 1), bad={0: ((3, 4), (6,))}))
    assert (~torch.isfinite(after_3[0])).nonzero().flatten().tolist() == [4, 6]
    assert (~torch.isfinite(after_2[0])).nonzero().flatten().tolist() == [6]
    out = REGISTRY["logit_bias"](logits, view((SamplingParams(logit_bias={1: 2.5, 3: -1.0}), [0], 1)))
    assert out[0].tolist() == [0, 2.5, 0, -1.0, 0, 0, 0, 0]
    params = SamplingParams(min_tokens=2, stop_token_ids=[5])
    early = REGISTRY["min_tokens"](logits, view((params, [0, 1], 1)))  # 1 output token < 2
    late = REGISTRY["min_tokens"](logits, view((params, [0, 1, 1], 1)))
    assert (~torch.isfinite(early[0])).nonzero().flatten().tolist() == [5, 7] and torch.isfinite(late).all()


@pytest.mark.native
def test_two_orders_give_different_supports():
    """temperature before top-p vs top-p before temperature: top-p sees different probabilities."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    supports = []
    for order in (["temperature", "top_p"], ["top_p", "temperature"]):
        p = SamplingParams(temperature=3.0, top_p=0.7, processors=order)
        out = apply_pipeline(logits, view((p, [0], 1), vocab=5)).processed_RV
        supports.append(int(torch.isfinite(out).sum()))
    assert supports[0] > supports[1]  # a hot temperature first flattens the distribution: top-p keeps more


@pytest.mark.native
def test_empty_support_is_a_row_error_naming_the_processor():
    logits = torch.arange(8.0).repeat(2, 1)
    bad = SamplingParams(allowed_token_ids=[3], bad_words=[[3]])
    good = SamplingParams(top_k=2)
    result = apply_pipeline(logits, view((bad, [0], 1), (good, [0], 1), bad={0: ((3,),)}))
    assert result.errors == {0: "empty support: processor 'bad_words' removed every token"}
    assert torch.isfinite(result.processed_RV[1]).sum() == 2


@native_only  # the changes are made by the sampler's kernel
def test_repetition_penalty_before_a_sampler_tail_is_handed_over_as_changes():
    """With the sampler applying the tail, the repetition penalty (the last processor before it) becomes its
    changes, made by the sampler's kernel: the block is not copied, and sampling gives what the dense
    processors give. A penalty that drives every token to -inf is the same row error both ways: the dense
    pipeline's at once, the deferred one's once the sampler has found the row empty."""
    from toolkit.native.sampling_ops import tail_fusable
    from toolkit.sampling.processors import emptied_by_changes
    from toolkit.sampling.sampler import SampleRow, sample

    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    logits[2] = -torch.rand(64) - 1.0  # all negative: a huge penalty sends every seen token to -inf
    rows = (
        (SamplingParams(repetition_penalty=1.5, top_k=5, temperature=0.7, seed=1), [1, 2, 2, 9], 2),
        (SamplingParams(temperature=0.9, seed=2), [4, 5], 1),
        (SamplingParams(repetition_penalty=1e300, top_p=0.9, seed=3), list(range(64)), 10),
    )
    v = view(*rows, vocab=64)
    assert tail_fusable(logits)  # the native build runs here
    deferred = apply_pipeline(logits, v, defer_tail=True)
    dense = apply_pipeline(logits, v, defer_tail=False)
    assert deferred.processed_RV is logits and deferred.patches is not None  # no copy of the block
    assert deferred.patches.rows_S.tolist() == [0] * 4 + [2] * 64 and deferred.changed_by == {
        0: "repetition_penalty",
        2: "repetition_penalty",
    }
    assert dense.errors == {2: "empty support: processor 'repetition_penalty' removed every token"}
    assert deferred.errors == {}  # known once the sampler has run: row 2 comes out without a finite logit
    srows = [SampleRow(greedy=False, seed=p.seed, position=7, stream=0, num_top=2) for p, _, _ in rows]
    whole = sample(logits, deferred.processed_RV, srows, tail=deferred.tail, patches=deferred.patches)
    assert whole.support_sizes[2] == 0 and whole.support_sizes[0] == 5
    assert emptied_by_changes(deferred, [0, 2]) == dense.errors  # row 0 has 5: not emptied
    srows = srows[:2]
    keep = torch.tensor([0, 1])
    got = sample(
        logits[keep],
        deferred.processed_RV[keep],
        srows,
        tail=[deferred.tail[0], deferred.tail[1]],
        patches=deferred.patches.select([0, 1], 3),
    )
    want = sample(logits[keep], dense.processed_RV[keep], srows)
    assert got.token_ids == want.token_ids and got.support_sizes == want.support_sizes
    assert got.processed_logprobs == want.processed_logprobs and got.top_processed == want.top_processed


@pytest.mark.native
@settings(max_examples=60, deadline=None)
@given(
    temperature=st.one_of(st.just(0.0), st.floats(MIN_TEMPERATURE, MAX_TEMPERATURE)),
    penalty=st.one_of(st.floats(MIN_REPETITION_PENALTY, 1e300), st.just(INF)),
    bias=st.one_of(st.floats(-INF, MAX_LOGIT_BIAS), st.just(-INF)),
    scale=st.sampled_from([1.0, 30.0, 1e4]),
    top_k=st.sampled_from([-1, 3]),
    seed=st.integers(0, 2**16),
)
def test_any_accepted_policy_keeps_each_processed_logit_finite_or_masked(
    temperature, penalty, bias, scale, top_k, seed
):
    """Whatever temperature, repetition penalty and logit bias SamplingParams accepts, raw logits up to 1e4 in size
    come out of the processors finite or -inf (masked), never +inf (a token the sampler cannot draw: it keeps the
    finite ones) or NaN; and the sampler's fused pass (the penalty and temperature made in it) draws what the
    dense pipeline's rows give. Seen tokens include logits of exactly 0 and -0. (A temperature of 1e-38 or a
    penalty of 1e-300, accepted before, overflowed to +inf; an infinite penalty made 0 * inf = NaN.)"""
    vocab = 64
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    logits.clamp_(-1e4, 1e4)
    logits[:, 1], logits[:, 2] = 0.0, -0.0
    params = SamplingParams(
        temperature=temperature, repetition_penalty=penalty, logit_bias={1: bias, 3: bias}, top_k=top_k, seed=seed
    )
    rows = ((params, [1, 2, 3, 4, 5], 2), (params, [1, 6], 1))
    v = view(*rows, vocab=vocab)
    dense = apply_pipeline(logits, v, defer_tail=False)
    assert not dense.errors, dense.errors
    processed = dense.processed_RV
    assert not torch.isnan(processed).any() and not torch.isposinf(processed).any()
    assert torch.isfinite(processed).any(dim=-1).all()  # no row emptied: the bias touches two tokens of 64
    srows = [sampler.SampleRow(greedy=params.greedy, seed=seed, position=9, stream=r) for r in range(2)]
    want = sampler.sample(logits, processed, srows)
    deferred = apply_pipeline(logits, v, defer_tail=True)
    got = sampler.sample(logits, deferred.processed_RV, srows, tail=deferred.tail, patches=deferred.patches)
    assert got.token_ids == want.token_ids and got.support_sizes == want.support_sizes
    assert all(math.isfinite(float(processed[r, t])) for r, t in enumerate(want.token_ids))


@pytest.mark.native
def test_nan_logits_and_failing_processor_are_isolated_to_their_row():
    logits = torch.arange(8.0).repeat(3, 1)
    logits[1, 2] = float("nan")

    def flaky(x, v):
        if any(r.params.top_k == 3 for r in v.rows):
            raise ValueError("boom")
        return REGISTRY["top_k"](x, v)

    registry = {**REGISTRY, "top_k": flaky}
    rows = [(SamplingParams(top_k=2), [0], 1), (SamplingParams(top_k=2), [0], 1), (SamplingParams(top_k=3), [0], 1)]
    result = apply_pipeline(logits, view(*rows), registry)
    assert set(result.errors) == {1, 2} and "NaN" in result.errors[1] and "ValueError: boom" in result.errors[2]
    assert torch.isfinite(result.processed_RV[0]).sum() == 2


# ---------------------------------------------------------------- properties

params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_k=st.sampled_from([-1, 1, 3, 7]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.05]),
    min_p=st.sampled_from([0.0, 0.1, 0.5]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.8]),
    presence_penalty=st.sampled_from([0.0, 0.5, -0.5]),
    frequency_penalty=st.sampled_from([0.0, 0.3]),
    no_repeat_ngram_size=st.sampled_from([0, 2, 3]),
    logit_bias=st.sampled_from([None, {1: 1.5, 4: -3.0}]),
    min_tokens=st.sampled_from([0, 2]),
    max_tokens=st.just(16),
)
rows_strategy = st.lists(
    st.tuples(params_strategy, st.lists(st.integers(0, 11), min_size=1, max_size=10)), min_size=1, max_size=5
)


@pytest.mark.native
@settings(max_examples=60)
@given(rows=rows_strategy, seed=st.integers(0, 2**16))
def test_processors_never_mutate_their_input_and_rows_are_independent(rows, seed):
    vocab = 12
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    v = view(*[(p, toks, 1) for p, toks in rows], vocab=vocab, eos=(11,))
    before = logits.clone()
    for name, fn in REGISTRY.items():
        active = [i for i, (p, _) in enumerate(rows) if p.is_active(name)]
        if active:
            fn(logits[active], v.subset(active))
            assert torch.equal(logits, before), name
    batched = apply_pipeline(logits, v)
    assert torch.equal(logits, before)
    for i in range(len(rows)):  # the same row alone gets the same processed logits
        alone = apply_pipeline(logits[i : i + 1], v.subset([i]))
        assert (i in batched.errors) == bool(alone.errors)
        if i not in batched.errors:
            assert torch.equal(alone.processed_RV[0], batched.processed_RV[i])


def test_processor_description_in_trace_order():
    p = SamplingParams(
        temperature=0.7, top_p=0.9, repetition_penalty=1.1, processors=["top_p", "repetition_penalty", "temperature"]
    )
    assert list(p.pipeline_description()) == ["top_p(0.9)", "repetition_penalty(1.1)", "temperature(0.7)", "gumbel_max"]
    assert list(SamplingParams(temperature=0).pipeline_description()) == ["argmax"]
    assert math.isclose(SamplingParams(top_p=0.25).top_p, 0.25)


def _poisoned_min_p(logits_RV, v):
    """min_p that raises on any block holding a row with min_p 0.25 (the pipeline then runs it row by row)."""
    if any(r.params.min_p == 0.25 for r in v.rows):
        raise RuntimeError("poisoned row")
    return truncation.min_p(logits_RV, v)


EMPTYING = st.fixed_dictionaries(
    {},
    optional={
        "allowed_token_ids": st.lists(st.integers(0, 15), min_size=1, max_size=3, unique=True),
        "bad_words": st.lists(st.integers(0, 15).map(lambda t: [t]), min_size=1, max_size=3),
        "top_k": st.integers(1, 20),
        "top_p": st.sampled_from([0.3, 0.9]),
        "min_p": st.sampled_from([0.1, 0.25]),
        "temperature": st.sampled_from([0.5, 2.0]),
        "repetition_penalty": st.sampled_from([1.3, 1e300]),
        "logit_bias": st.dictionaries(st.integers(0, 15), st.sampled_from([-100.0, 5.0]), max_size=3),
    },
)


@pytest.mark.native
@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 6),
    nan_row=st.integers(-1, 5),
    negative=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_rows_emptied_unread_are_the_errors_read_as_they_go(data, rows, nan_row, negative, seed):
    """apply_pipeline(defer_empty=True) reads nothing of which rows a processor emptied; once its flags are read,
    emptied_rows names each such row's first emptying processor: the errors and the other rows' logits are those
    of the pipeline that reads as it goes. Rows of several orders, bans that empty a row, penalties that overflow
    to -inf, a NaN row, and a processor that raises for one row (its earlier empties read then)."""
    from toolkit.sampling.processors import emptied_flags, emptied_rows

    x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(seed)) * 3
    if negative:
        x = -x.abs() - 0.5  # every logit below zero: a huge repetition penalty sends the seen ones to -inf
    if 0 <= nan_row < rows:
        x[nan_row, 3] = float("nan")
    specs = []
    for _ in range(rows):
        p = SamplingParams(**data.draw(EMPTYING))
        order = data.draw(st.permutations(p.active_processors())) if data.draw(st.booleans()) else None
        specs.append((p.replace(processors=order) if order else p, [1, 2, 2, 9, 4], 2))
    bad = {i: tuple(tuple(w) for w in p.bad_words or ()) for i, (p, _, _) in enumerate(specs)}
    v = view(*specs, vocab=16, bad=bad)
    registry = {**REGISTRY, "min_p": _poisoned_min_p}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(truncation, "truncate_cpu", lambda *a, **k: None)  # torch's code, as on a GPU
        now = apply_pipeline(x, v, registry=registry, row_errors={})
        later = apply_pipeline(x, v, registry=registry, row_errors={}, defer_empty=True)
    flags = emptied_flags(later.emptied).tolist() if later.emptied else []
    errors = {**later.errors, **emptied_rows(later.emptied, flags)}
    assert errors == now.errors
    for i in range(rows):
        if i not in errors:
            assert torch.equal(later.processed_RV[i].view(torch.int32), now.processed_RV[i].view(torch.int32))
