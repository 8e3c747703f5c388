"""Sampling: exact in distribution (chi-square), counter-based noise independent of the batch."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.conftest import NATIVE_OFF, native_only
from tests.stats import chi_square
from toolkit.errors import ConfigError
from toolkit.native.sampling_ops import FEW_ROWS, logprobs_at_cpu
from toolkit.sampling import rng
from toolkit.sampling.params import SamplingParams
from toolkit.sampling.sampler import SampleRow, sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, float("-inf"), 1.5])  # token 7 masked


def draw(n: int, seed: int = 7, scale: float = 1.0) -> list[int]:
    """n samples from LOGITS at positions 0..n-1; `scale` != 1 is a deliberately broken sampler."""
    if scale == 1.0:
        rows = [SampleRow(greedy=False, seed=seed, position=p, stream=0) for p in range(n)]
        return sample(LOGITS.repeat(n, 1), LOGITS.repeat(n, 1), rows).token_ids
    hashes = rng.token_hashes(len(LOGITS), torch.device("cpu"))
    return [int(torch.argmax(LOGITS.double() + scale * rng.gumbel(rng.row_key(seed, p, 0), hashes))) for p in range(n)]


@pytest.mark.native
def test_empirical_distribution_matches_the_processed_distribution():
    probs = torch.softmax(LOGITS, -1).tolist()
    stat, p_value = chi_square(draw(20000), probs)
    assert p_value > 1e-3, (stat, p_value)


def test_a_biased_sampler_fails_the_same_test():
    probs = torch.softmax(LOGITS, -1).tolist()
    for scale in (0.8, 1.25):  # too little or too much noise: a sharpened or flattened distribution
        stat, p_value = chi_square(draw(20000, scale=scale), probs)
        assert p_value < 1e-6, (scale, stat, p_value)


def test_noise_is_a_function_of_the_key_and_token_only():
    hashes = rng.token_hashes(50, torch.device("cpu"))
    key = rng.row_key(123, 45, 2)
    full = rng.gumbel(key, hashes)
    subset = torch.tensor([3, 17, 49])
    assert torch.equal(rng.gumbel(key, hashes[subset]), full[subset])
    assert rng.gumbel_scalar(key, 17) == float(full[17])  # the Python-float twin: the same bits
    assert not torch.equal(full, rng.gumbel(rng.row_key(123, 45, 3), hashes))  # other stream
    assert not torch.equal(full, rng.gumbel(rng.row_key(123, 46, 2), hashes))  # other position
    assert not torch.equal(full, rng.gumbel(rng.row_key(124, 45, 2), hashes))  # other seed


@pytest.mark.native
@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**63 - 1),
    position=st.integers(0, 10**6),
    stream=st.integers(0, 8),
    others=st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 5000), st.booleans()), max_size=6),
    where=st.integers(0, 6),
    torch_seed=st.integers(0, 1000),
)
def test_same_key_gives_the_same_token_whatever_the_batch(seed, position, stream, others, where, torch_seed):
    vocab = 64
    gen = torch.Generator().manual_seed(torch_seed)
    mine = torch.randn(1, vocab, generator=gen) * 2
    other_logits = torch.randn(len(others), vocab, generator=gen) * 2
    row = SampleRow(greedy=False, seed=seed, position=position, stream=stream)
    alone = sample(mine, mine, [row])
    where = min(where, len(others))
    logits = torch.cat([other_logits[:where], mine, other_logits[where:]])
    rows = [SampleRow(greedy=g, seed=s, position=p, stream=0) for s, p, g in others]
    rows.insert(where, row)
    torch.manual_seed(torch_seed + 1)  # the global RNG must not matter
    batched = sample(logits, logits, rows)
    assert batched.token_ids[where] == alone.token_ids[0]
    assert batched.noise[where] == alone.noise[0]
    assert batched.raw_logprobs[where] == alone.raw_logprobs[0]


FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


def _rows_and_picks(shape: tuple[int, int]):
    rows, vocab = shape
    return st.tuples(
        st.just(shape),
        st.lists(FLOAT32, min_size=rows * vocab, max_size=rows * vocab),
        st.lists(FLOAT32, min_size=rows, max_size=rows),
        st.lists(st.integers(-2, vocab + 1), min_size=rows, max_size=rows),
    )


@settings(max_examples=120, deadline=None)
@given(case=st.tuples(st.integers(1, 10), st.integers(1, 12)).flatmap(_rows_and_picks), strided=st.booleans())
def test_a_few_rows_logprobs_read_through_numpy_are_torchs_bits(case, strided):
    """logprobs_at_cpu (a decode step's few rows, read without torch calls) gives torch's gather-and-subtract
    bits for any fp32 values (infinities, NaN, the largest and smallest), on strided rows too, and declines (None)
    where torch's path must take them: more than FEW_ROWS rows, a token outside the row, another format."""
    (rows, vocab), values, lse, tokens = case
    x = torch.tensor(values, dtype=torch.float32).view(rows, vocab)
    if strided:
        x = torch.cat([x, x], dim=1)[:, :vocab]  # rows a stride apart that is not the row's length
    lse_R = torch.tensor(lse, dtype=torch.float32)
    got = logprobs_at_cpu(x, lse_R, tokens)
    if rows > FEW_ROWS or any(not 0 <= t < vocab for t in tokens):
        assert got is None
        return
    want = (x.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1) - lse_R).tolist()
    for g, w in zip(got, want):  # the same value, -0.0 kept apart from 0.0, NaN where torch's is
        assert (math.isnan(g) and math.isnan(w)) or (g == w and math.copysign(1, g) == math.copysign(1, w)), (g, w)
    assert logprobs_at_cpu(x.double(), lse_R.double(), tokens) is None


@settings(max_examples=300, deadline=None)
@given(x=st.floats(min_value=2.2250738585072014e-308, max_value=1.7976931348623157e308))
def test_our_logarithm_is_within_one_ulp_and_its_twins_agree(x):
    """rng.log_positive (the noise's log) is within 1 ulp of math.log, and the torch and Python twins
    give the same bits."""
    got = rng.log_positive(torch.tensor([x], dtype=torch.float64)).item()
    assert got == rng.log_positive_scalar(x)
    assert abs(got - math.log(x)) <= math.ulp(math.log(x)) if x != 1.0 else got == 0.0


@pytest.mark.native
def test_truncated_support_samples_only_inside_it():
    logits = torch.randn(200, 30, generator=torch.Generator().manual_seed(0))
    processed = logits.masked_fill(logits < logits.topk(3, dim=-1).values[:, -1:], float("-inf"))
    rows = [SampleRow(greedy=False, seed=1, position=p, stream=0) for p in range(200)]
    result = sample(logits, processed, rows)
    assert all(math.isfinite(processed[i, t]) for i, t in enumerate(result.token_ids))
    assert result.support_sizes == [3] * 200
    assert len(set(result.token_ids)) > 3  # different rows pick different tokens


SPECIAL = st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.0, 80.0, -80.0])


@native_only
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 12),
    vocab=st.sampled_from([1, 15, 16, 17, 100, 49152]),
    scale=st.sampled_from([0.1, 10.0]),
    specials=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 49151), SPECIAL), max_size=6),
    ties=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_native_logsumexp_and_argmax_are_torchs(rows, vocab, scale, specials, ties, seed):
    """The sampler's C row kernels: argmax is torch's exactly (first maximal index, NaN wins, every
    entry -inf gives 0), logsumexp within 4e-7 relative of torch's and the same non-finite values."""
    from toolkit.native.sampling_ops import argmax_cpu, logsumexp_cpu

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * scale
    if ties:
        x = x.round()  # many equal maxima
    for r, c, value in specials:
        if r < rows:
            x[r, c % vocab] = value
    if rows > 1:
        x[-1] = float("-inf")
    assert argmax_cpu(x) == torch.argmax(x, dim=-1).tolist()
    got, want = logsumexp_cpu(x), torch.logsumexp(x, dim=-1)
    finite = torch.isfinite(want)
    assert torch.equal(got[~finite].nan_to_num(1.0), want[~finite].nan_to_num(1.0))
    assert ((got - want).abs()[finite] <= 4e-7 * want.abs()[finite].clamp_min(1.0)).all()


@pytest.mark.native
@settings(max_examples=25, deadline=None)
@given(
    params=st.lists(
        st.fixed_dictionaries(
            {
                "temperature": st.sampled_from([0.0, 0.5, 1.0, 1.3]),
                "top_k": st.sampled_from([0, 1, 7, 100, 10**6]),
                "top_p": st.sampled_from([1.0, 0.9, 0.5, 0.01]),
                "min_p": st.sampled_from([0.0, 0.1]),
                "repetition_penalty": st.sampled_from([1.0, 1.2, 0.8]),
                "seed": st.integers(0, 2**32),
                "processors": st.sampled_from(
                    [
                        None,
                        ["temperature", "top_p", "min_p", "top_k", "repetition_penalty"],
                        ["repetition_penalty", "top_k", "temperature", "min_p", "top_p"],
                    ]
                ),
            }
        ),
        min_size=1,
        max_size=6,
    ),
    vocab=st.sampled_from([50, 1000, 4099]),
    torch_seed=st.integers(0, 1000),
    seen_max=st.booleans(),
)
def test_the_sampler_applying_the_pipeline_tail_changes_nothing(params, vocab, torch_seed, seen_max):
    """apply_pipeline(defer_tail=True) leaves each row's trailing temperature / top-k / top-p to the sampler
    (one native pass a row); the engine's result must be what the whole pipeline then the sampler give:
    the same tokens, noise, supports, log-probabilities and top alternatives, bit for bit. `seen_max`: each
    row's history holds its largest logit, so a repetition penalty moves the row's maximum (which the
    kernel otherwise carries from its temperature pass instead of reading the row again)."""
    from toolkit.sampling.params import SamplingParams
    from toolkit.sampling.processors import BatchView, RowState, apply_pipeline, invalid_rows
    from toolkit.sampling.sampler import logsumexp_rows

    gen = torch.Generator().manual_seed(torch_seed)
    rows = [SamplingParams(max_tokens=4, logprobs=3, **p) for p in params]
    logits = torch.randn(len(rows), vocab, generator=gen) * 4
    history = [
        torch.randint(0, vocab, (5,), generator=gen).tolist() + ([int(row.argmax())] if seen_max else [])
        for row in logits
    ]
    view = BatchView(
        rows=tuple(RowState(p, h, 3, ()) for p, h in zip(rows, history)), vocab_size=vocab, device=logits.device
    )
    srows = [SampleRow(greedy=p.greedy, seed=p.seed, position=9, stream=0, num_top=3) for p in rows]
    lse = logsumexp_rows(logits)
    results, processed = [], None
    for defer in (False, True):
        pipe = apply_pipeline(logits, view, row_errors=invalid_rows(lse), defer_tail=defer)
        assert (pipe.tail is not None) == (defer and not NATIVE_OFF)  # the native build takes the tail
        assert not pipe.errors
        processed = pipe.processed_RV if not defer else processed
        results.append(sample(logits, pipe.processed_RV, srows, lse, tail=pipe.tail, patches=pipe.patches))
    whole, deferred = results
    # the kept-set digest: sha256 of the finite-logit mask packed little-endian (numpy's packbits, a twin)
    import hashlib

    import numpy as np

    want = [
        hashlib.sha256(np.packbits(torch.isfinite(row).numpy(), bitorder="little").tobytes()).hexdigest()
        for row in processed
    ]
    assert whole.kept_sha256 == want and deferred.kept_sha256 == want
    assert deferred.token_ids == whole.token_ids and deferred.support_sizes == whole.support_sizes
    assert [float(n).hex() for n in deferred.noise] == [float(n).hex() for n in whole.noise]
    assert deferred.processed_logprobs == whole.processed_logprobs and deferred.raw_logprobs == whole.raw_logprobs
    assert deferred.top_processed == whole.top_processed


@settings(max_examples=50, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, 2**64 - 1),
            st.integers(0, 2**40),
            st.integers(0, 2**31),
            st.sampled_from([rng.SAMPLE, rng.DRAFT, rng.ACCEPT, rng.RESIDUAL]),
        ),
        max_size=40,
    )
)
def test_batched_row_keys_are_row_key(rows):
    """rng.row_keys (numpy words, a step's rows at once) gives row_key's two words for every row."""
    assert rng.row_keys(rows) == [rng.row_key(*row) for row in rows]


@native_only
@pytest.mark.parametrize(
    "ops",
    [
        (("temperature", 0.5), ("top_p", 0.9)),
        (("temperature", 1.3), ("top_k", 7)),
        (("temperature", 0.5),),
        (("top_k", 7), ("temperature", 0.7)),
        (("temperature", 0.9), ("top_k", 50), ("top_p", 0.8)),
    ],
)
def test_a_penalty_made_in_the_sampler_pass_moves_the_row_maximum_bit_for_bit(ops):
    """The sampler's kernel carries each row's maxima from its temperature pass instead of reading the row again;
    a repetition penalty made in that pass may move them (the largest logit penalised down, or up by a factor
    under 1; 0 or inf times inf). Everything it returns must be what the penalised rows give without it."""
    from toolkit.native.sampling_ops import logsumexp_cpu, sample_tail_cpu
    from toolkit.sampling.processors.base import Patches

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(20, 4099, generator=gen) * 3
    x[17, 7], x[18, 9] = 0.0, float("inf")  # 0 * inf and inf / inf: NaN where they are penalised by inf
    x[16, 100:102] = torch.tensor([float("nan"), float("inf")])  # a penalised row's own NaN: raw logsumexp NaN
    top2 = x.topk(2, dim=1).indices
    seen = [[int(top2[r, 0])] for r in range(12)] + [  # rows 0-11: the largest logit, by factors over and under 1
        [int(top2[12, 0]), int(top2[12, 1])],
        [int(top2[13, 1])],
        [3, 3, int(top2[14, 0])],
        [],
        [5],
        [7],
        [9, 10],
        [int(top2[19, 0])],
    ]
    factor = [
        1.1,
        1.2,
        1.3,
        1.5,
        2.0,
        3.0,
        1.05,
        1.15,
        1.25,
        0.8,
        0.5,
        0.9,
        1.2,
        0.8,
        1.5,
        1.0,
        1.3,
        float("inf"),
        float("inf"),
        0.5,
    ]
    rows = [r for r, ids in enumerate(seen) for _ in ids]
    patches = Patches(
        torch.tensor(rows),
        torch.tensor([c for ids in seen for c in ids]),
        torch.tensor([factor[r] for r in rows], dtype=torch.float32),
    )
    keys = [(5, r) for r in range(20)]
    got = sample_tail_cpu(x, [ops] * 20, keys, patches=patches, raw_logsumexp=True)
    want = sample_tail_cpu(patches.apply(x), [ops] * 20, keys)
    # the raw rows' logsumexp (the kernel finds their maxima in its temperature pass): logsumexp_cpu's bits
    assert torch.equal(got.raw_logsumexp_R.view(torch.int32), logsumexp_cpu(x).view(torch.int32))
    assert got.tokens == want.tokens and got.support == want.support
    assert [float(n).hex() for n in got.noise] == [float(n).hex() for n in want.noise]
    for a, b in (
        (got.logsumexp_R, want.logsumexp_R),
        (got.picked_R, want.picked_R),
        (got.processed_RV, want.processed_RV),
    ):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    part = [r for r in range(20) if got.support[r] < 4099]  # kept masks are written for these rows only
    assert torch.equal(got.kept_bits_RB[part], want.kept_bits_RB[part])


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(
    data=st.dictionaries(
        st.sampled_from([f.name for f in dataclasses.fields(SamplingParams)]),
        JSON_VALUES
        | st.sampled_from([["x"], [["temperature"]], [None], {"json": 5}, {"regex": 1}, {"choice": [1]}, 10**30]),
        min_size=1,
        max_size=2,
    )
)
@example(data={"processors": [["temperature"]]})
def test_any_sampling_section_is_valid_or_one_config_error(data):
    """Whatever values a requests file, a run's config or a caller puts in the sampling fields, SamplingParams is
    built or refuses with a one-line ConfigError: never another exception (a processors list holding a list was
    looked up in a set before it was checked: TypeError, unhashable)."""
    try:
        SamplingParams(**data)  # as the intake builds it from a request's mapping
    except ConfigError as exc:
        assert "\n" not in str(exc)
