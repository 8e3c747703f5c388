"""The sampler's batched path (what a GPU step runs: every row in a fixed number of tensor operations) gives the
bits of the row-by-row code the CPU runs: the same noise, the same tokens, the same penalty counts."""

from __future__ import annotations

import math
import struct
from collections import Counter

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from toolkit.sampling import rng, sampler
from toolkit.sampling.params import SamplingParams
from toolkit.sampling.processors.base import BatchView, RowState
from toolkit.sampling.sampler import gumbel_choices

SPECIAL = st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.0, 80.0, -80.0])
KEY = st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**40), st.integers(0, 2**31))


def bits(values: list[float]) -> list[str]:
    """Each float's 8 bytes: NaN equals NaN, 0.0 differs from -0.0."""
    return [struct.pack("<d", v).hex() for v in values]


@settings(max_examples=30, deadline=None)
@given(keys=st.lists(KEY, min_size=1, max_size=9), vocab=st.sampled_from([1, 7, 100, 4099]))
def test_noise_of_many_rows_is_each_rows_noise(keys, vocab):
    """rng.gumbel_rows (all rows under their keys at once) is rng.gumbel row by row, bit for bit, on a shared
    row of hashes and on a block of them."""
    hashes = rng.token_hashes(vocab, torch.device("cpu"))
    words = [rng.row_key(*k) for k in keys]
    block = rng.gumbel_rows(rng.key_words(words, hashes.device), hashes)
    want = torch.stack([rng.gumbel(w, hashes) for w in words])
    assert torch.equal(block.view(torch.int64), want.view(torch.int64))
    ids = torch.randint(0, vocab, (len(words), 5), generator=torch.Generator().manual_seed(vocab))
    picked = rng.gumbel_rows(rng.key_words(words, hashes.device), hashes[ids])
    assert torch.equal(
        picked.view(torch.int64), torch.stack([rng.gumbel(w, hashes[i]) for w, i in zip(words, ids)]).view(torch.int64)
    )


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 10),
    vocab=st.sampled_from([1, 2, 17, 1000, 49152]),
    scale=st.sampled_from([0.1, 4.0]),
    specials=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 49151), SPECIAL), max_size=8),
    masked=st.lists(st.tuples(st.integers(0, 9), st.integers(1, 99)), max_size=4),
    ties=st.booleans(),
    greedy=st.sets(st.integers(0, 9), max_size=4),
    keys=st.lists(KEY, min_size=10, max_size=10),
    pass_rows=st.sampled_from([None, 1, 3]),
    known_finite=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_batched_choice_is_the_row_by_row_choice_bit_for_bit(
    rows, vocab, scale, specials, masked, ties, greedy, keys, pass_rows, known_finite, seed
):
    """Every row's token and noise from the batched pass equal gumbel_choice's on that row: full and truncated
    supports, NaN / +inf / -inf logits (never chosen), rows without a finite logit (-1, NaN), greedy rows (not
    sampled), ties (the lowest id), and the rows split over several passes (`pass_rows` rows each)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * scale
    if ties:
        x = x.round()
    for r, every in masked:  # a truncated row: all but every k-th token at -inf
        if r < rows:
            x[r, torch.arange(vocab) % every != 0] = float("-inf")
    for r, c, value in specials:
        if r < rows:
            x[r, c % vocab] = value
    if rows > 2:
        x[-1] = float("-inf")  # nothing finite
    row_keys = [None if i in greedy else rng.row_key(*keys[i]) for i in range(rows)]
    finite = torch.isfinite(x) if known_finite else None
    with pytest.MonkeyPatch.context() as patch:
        if pass_rows is not None:
            patch.setattr(sampler, "NOISE_ELEMENTS_PER_PASS", pass_rows * vocab)
        got = gumbel_choices(x, row_keys, finite, batched=True)
    want = gumbel_choices(x, row_keys, finite, batched=False)
    assert got[0] == want[0]
    assert bits(got[1]) == bits(want[1])
    for i, key in enumerate(row_keys):  # and what the row-by-row code means
        finite_row = torch.isfinite(x[i])
        if key is None or not finite_row.any():
            assert got[0][i] == -1 and math.isnan(got[1][i])
        else:
            assert finite_row[got[0][i]] and got[1][i] == rng.gumbel_scalar(key, got[0][i])


def _result_bits(result: sampler.SampleResult) -> dict:
    """Every field of a SampleResult, floats as their bytes (NaN equals NaN, 0.0 differs from -0.0)."""
    return {
        "tokens": result.token_ids,
        "raw": bits(result.raw_logprobs),
        "processed": bits(result.processed_logprobs),
        "support": result.support_sizes,
        "noise": bits(result.noise),
        "top_raw": [[(t, bits([v])) for t, v in row] for row in result.top_raw],
        "top_processed": [[(t, bits([v])) for t, v in row] for row in result.top_processed],
        "kept": result.kept_sha256,
    }


@pytest.mark.native  # the kept sets' digests ask the native sha256
@settings(max_examples=40, deadline=None)
@example(  # every row greedy: no noise drawn or read on the device (NaN filled on the host)
    rows=3,
    vocab=300,
    specials=[],
    truncated=[],
    processed=False,
    greedy={0, 1, 2},
    num_top=[1] * 8,
    keys=[(1, 2, 0)] * 8,
    seed=0,
)
@example(
    rows=4,
    vocab=300,
    specials=[(1, 7, float("nan"))],
    truncated=[(2, 3)],
    processed=True,
    greedy={0, 1, 2, 3},
    num_top=[0, 2, 0, 1] * 2,
    keys=[(5, 6, 1)] * 8,
    seed=1,
)
@given(
    rows=st.integers(1, 8),
    vocab=st.sampled_from([1, 5, 300, 4099]),
    specials=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 4098), SPECIAL), max_size=6),
    truncated=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 99)), max_size=4),
    processed=st.booleans(),
    greedy=st.sets(st.integers(0, 7), max_size=4),
    num_top=st.lists(st.integers(0, 3), min_size=8, max_size=8),
    keys=st.lists(KEY, min_size=8, max_size=8),
    seed=st.integers(0, 1000),
)
def test_the_devices_read_once_sample_is_the_cpus_sample_bit_for_bit(
    rows, vocab, specials, truncated, processed, greedy, num_top, keys, seed
):
    """sample() off the CPU computes every field where the logits are and reads them in one transfer
    (DeviceSample); run here on CPU tensors, it gives sample()'s CPU path (torch's, the native kernels held
    off) every field's bits: tokens, both log-probabilities, support, noise, both lists of alternatives and the
    kept-set digests, for raw and processed rows (truncated, NaN / +inf / -inf, nothing finite), greedy and
    sampled rows, and any number of alternatives a row."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(rows, vocab, generator=gen) * 3
    for r, c, value in specials:
        if r < rows:
            raw[r, c % vocab] = value
    proc = raw
    if processed:
        proc = raw / 0.7
        for r, every in truncated:
            if r < rows:
                proc[r, torch.arange(vocab) % every != 0] = float("-inf")
        if rows > 2:
            proc[-1] = float("-inf")
    sample_rows = [
        sampler.SampleRow(
            greedy=i in greedy, seed=keys[i][0], position=keys[i][1], stream=keys[i][2], num_top=min(num_top[i], vocab)
        )
        for i in range(rows)
    ]
    with pytest.MonkeyPatch.context() as patch:  # the CPU's torch path: what the kernels would otherwise replace
        patch.setattr(sampler, "gumbel_sample_cpu", lambda *a, **k: None)
        patch.setattr(sampler, "argmax_cpu", lambda *a, **k: None)
        patch.setattr(sampler, "logsumexp_cpu", lambda *a, **k: None)
        want = sampler.sample(raw, proc, sample_rows)
        lse = sampler.logsumexp_rows(raw, per_row=True)
        keys_of = sampler._keys(sample_rows)
        got = sampler.DeviceSample(raw, proc, sample_rows, keys_of, lse, per_row=True).result()
    assert _result_bits(got) == _result_bits(want)
    assert bits(got.raw_logsumexp) == bits(got.raw_logsumexp_R.tolist())  # read with the rest, for step 6


def test_a_batched_choice_that_forgets_its_mask_or_swaps_its_key_words_is_caught():
    """What the comparison above catches: a batched pass without the mask (a NaN or +inf logit wins) or with
    the key's two words swapped (other noise) differs from the row-by-row choice."""
    x = torch.tensor([[0.0, float("inf"), 1.0, 2.0], [3.0, float("nan"), 1.0, 0.5]])
    keys = [rng.row_key(1, 2, 3), rng.row_key(4, 5, 6)]
    tokens, noise = gumbel_choices(x, keys, batched=False)
    hashes = rng.token_hashes(4, x.device)
    unmasked = x.double() + rng.gumbel_rows(rng.key_words(keys, x.device), hashes)
    assert torch.argmax(unmasked, dim=-1).tolist() != tokens
    swapped = rng.gumbel_rows(rng.key_words([(b, a) for a, b in keys], x.device), hashes)
    assert bits(swapped[[0, 1], tokens].tolist()) != bits(noise)


@settings(max_examples=30, deadline=None)
@given(
    histories=st.lists(st.lists(st.integers(0, 63), max_size=40), min_size=1, max_size=6),
    prompts=st.lists(st.integers(0, 10), min_size=6, max_size=6),
)
def test_output_counts_of_all_rows_at_once_are_each_rows_counts(histories, prompts):
    """BatchView.output_counts (one indexed add over the step) counts each row's output tokens only."""
    rows = tuple(RowState(SamplingParams(max_tokens=4), h, min(p, len(h))) for h, p in zip(histories, prompts))
    counts = BatchView(rows=rows, vocab_size=64, device=torch.device("cpu")).output_counts
    for i, r in enumerate(rows):
        want = torch.zeros(64)
        for token, n in Counter(r.token_ids[r.num_prompt_tokens :]).items():
            want[token] = n
        assert torch.equal(counts[i], want), i


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("rows", [0, 1, 3])
def test_rows_not_sampled_get_no_token(rows, batched):
    tokens, noise = gumbel_choices(torch.randn(rows, 5), [None] * rows, batched=batched)
    assert tokens == [-1] * rows and len(noise) == rows and all(math.isnan(g) for g in noise)


@pytest.mark.native  # routes forced to torch's code
def test_a_gpu_steps_processors_and_sample_are_queued_without_a_single_read():
    """What Sampler.stage queues on a GPU (every processor on torch's code, top-p ranking whole rows, the read-once
    sample, the emptied-row flags' copy) reads no value back: on a GPU each read waits for the device, and async
    scheduling stages a step while the device computes the next. Counted on the CPU (tests/host_reads.py); the
    pipeline reading as it goes makes one read a processor."""
    import functools

    from tests.host_reads import HostReads
    from toolkit.sampling.processors import REGISTRY, apply_pipeline, emptied_flags, emptied_rows, truncation
    from toolkit.sampling.sampler import SampleRow, device_sample, queue_read

    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=0.7, top_k=5, min_p=0.1, repetition_penalty=1.2, seed=2, logprobs=3),
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.2, no_repeat_ngram_size=2),
        SamplingParams(top_p=0.5, seed=3, logit_bias={3: 5.0}, bad_words=["x"], min_tokens=4, stop_token_ids=[9]),
        SamplingParams(allowed_token_ids=[1, 2, 3], seed=4, top_k=2),
        SamplingParams(allowed_token_ids=[5], bad_words=["x"], seed=5),  # emptied: known only once read
    ]
    history = [1, 2, 3, 1, 2, 5]
    view = BatchView(
        tuple(RowState(p, history, 2, ((5,),) if p.bad_words else ()) for p in params), 64, torch.device("cpu"), (7,)
    )
    logits = torch.randn(len(params), 64, generator=torch.Generator().manual_seed(0))
    registry = {**REGISTRY, "top_p": functools.partial(truncation.top_p, first_k=None)}
    rows = [SampleRow(greedy=p.greedy, seed=p.seed or 0, position=6, stream=0, num_top=p.logprobs or 0) for p in params]
    for defer in (True, False):
        with pytest.MonkeyPatch.context() as patch, HostReads() as reads:
            patch.setattr(truncation, "truncate_cpu", lambda *a, **k: None)
            pipe = apply_pipeline(logits, view, registry=registry, row_errors={}, defer_empty=defer)
            queued = device_sample(logits, pipe.processed_RV, rows, None, False, pipe.patches)
            flags = queue_read([emptied_flags(pipe.emptied)])[0] if pipe.emptied else None
        if defer:
            assert not reads.counts, reads.counts
            assert emptied_rows(pipe.emptied, flags[0].tolist()) == {
                5: "empty support: processor 'bad_words' removed every token"
            }
            assert len(queued.result().token_ids) == len(params)
        else:
            assert reads.counts["tolist"] >= 10, reads.counts  # a read a processor run


def _ranked(values: list[float], k: int) -> list[int]:
    """The k largest ids, largest first, ties by ascending id, a NaN the largest: top_k's promise, in Python."""
    return sorted(range(len(values)), key=lambda t: (0 if values[t] != values[t] else 1, -values[t], t))[:k]


@pytest.mark.native
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 4),
    vocab=st.sampled_from([1, 6, 300, 5000]),
    k=st.integers(1, 12),
    levels=st.integers(1, 5),
    specials=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4999), SPECIAL), max_size=6),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    seed=st.integers(0, 1000),
)
def test_alternatives_rank_equal_values_by_ascending_id_on_every_path(rows, vocab, k, levels, specials, dtype, seed):
    """A row's alternatives are its k largest logits, largest first, equal ones by ascending token id (a NaN the
    largest; -0.0 equal to 0.0): top_k (the CPU's way and the device's), and with it sample()'s CPU path and
    DeviceSample's, whatever the format.
    torch.topk leaves the order of ties, and which tied ids it keeps at the k-th place, to the device: an H200
    listed a row's tied alternatives as [2, 1, 0] where the CPU listed [0, 1, 2]."""
    k = min(k, vocab)
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, levels, (rows, vocab), generator=gen).to(dtype) * -0.5  # few levels: many ties
    for r, c, value in specials:
        if r < rows:
            raw[r, c % vocab] = value
    for top_k in (sampler.top_k, sampler._top_k_device):  # the CPU's way, and the device's (run here)
        values, ids = top_k(raw, k)
        for r in range(rows):
            row = [0.0 if v == 0 else v for v in raw[r].double().tolist()]
            assert ids[r].tolist() == _ranked(row, k), r
            assert torch.equal(values[r], raw[r, ids[r]]) or torch.isnan(values[r]).any()
    sample_rows = [sampler.SampleRow(greedy=True, seed=0, position=0, stream=0, num_top=k) for _ in range(rows)]
    logits = raw.float()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampler, "argmax_cpu", lambda *a, **kw: None)
        want = sampler.sample(logits, logits, sample_rows)
        lse = sampler.logsumexp_rows(logits, per_row=True)
        got = sampler.DeviceSample(logits, logits, sample_rows, sampler._keys(sample_rows), lse, per_row=True).result()
    for r in range(rows):
        row = logits[r].double().tolist()  # those of logprob -inf are not listed (a row with +inf: all but it)
        listed = [t for t in _ranked([0.0 if v == 0 else v for v in row], k) if row[t] - lse[r] != float("-inf")]
        assert [t for t, _ in want.top_raw[r]] == [t for t, _ in got.top_raw[r]] == listed, r
