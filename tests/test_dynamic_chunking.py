"""engine.dynamic_chunking: a prefill chunk shrinks as its context grows, so that a step late in a long prompt costs
about what one at its start does (toolkit.engine.scheduler.chunk_cost, fitting_chunk).

The cost is counted, not timed: the same chunks on every machine, so a replay makes the same steps. Greedy tokens
and their logprobs keep their bits whatever the chunks (batch_invariant)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import NATIVE_OFF, make_engine, native_only
from toolkit.config import EngineConfig
from toolkit.engine.backends import context_scale
from toolkit.engine.scheduler import chunk_cost, fitting_chunk
from toolkit.errors import ConfigError
from toolkit.sampling.params import SamplingParams

SCALES = st.one_of(st.none(), st.integers(1, 10_000))


@given(tokens=st.integers(0, 3000), start=st.integers(0, 300_000), scale=SCALES)
def test_a_chunk_costs_its_tokens_and_one_more_for_every_scale_query_key_pairs(tokens, start, scale):
    pairs = sum(start + i + 1 for i in range(tokens))  # query i of the chunk sees the start and i + 1 keys of its own
    assert chunk_cost(tokens, start, scale) == tokens + (math.ceil(pairs / scale) if scale else 0)


@given(cost=st.integers(0, 5000), start=st.integers(0, 300_000), scale=SCALES)
def test_the_fitting_chunk_is_the_longest_within_the_cost_and_never_none_while_there_is_budget(cost, start, scale):
    n = fitting_chunk(cost, start, scale)
    assert chunk_cost(n + 1, start, scale) > cost  # no longer chunk fits
    if cost == 0:
        assert n == 0
    else:
        assert n >= 1 and (n == 1 or chunk_cost(n, start, scale) <= cost)  # one token at least: a prefill progresses


def test_auto_counts_a_layers_weights_against_its_attention(tiny, smollm2):
    """auto: a layer's matmul weights (2 FLOPs each) over its attention's 4 FLOPs a query channel and position."""
    layer = tiny.model.layers[0]
    weights = sum(p.numel() for p in layer.parameters() if p.dim() == 2)
    q = tiny.arch.num_heads * tiny.arch.head_dim
    assert context_scale(EngineConfig(dynamic_chunking="auto"), tiny.arch) == weights // (2 * q) == 288
    assert context_scale(EngineConfig(dynamic_chunking="auto"), smollm2.arch) == 3072  # docs/serving.md's figure
    assert context_scale(EngineConfig(dynamic_chunking=500), tiny.arch) == 500
    for off in (None, False, "off"):
        assert context_scale(EngineConfig(dynamic_chunking=off), tiny.arch) is None


@pytest.mark.parametrize("bad", [0, -3, True, "on", 2.5])
def test_a_bad_dynamic_chunking_is_a_one_line_error(bad):
    with pytest.raises(ConfigError, match="engine.dynamic_chunking must be auto, off, a positive integer or null"):
        EngineConfig(dynamic_chunking=bad)


def _run(tiny, **cfg):
    """Two long prompts and a short one, arriving while others decode; returns the scheduled batches and outputs."""
    engine = make_engine(tiny, max_num_batched_tokens=32, max_num_seqs=8, batch_invariant=not NATIVE_OFF, **cfg)
    batches = []
    run = engine.runner.run

    def spy(batch, *args, **kwargs):  # records what the scheduler decided, then runs it unchanged
        batches.append(batch)
        return run(batch, *args, **kwargs)

    engine.runner.run = spy
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    ids = [
        engine.add_request(prompt_token_ids=[(7 * i + 3 * j) % 500 + 10 for j in range(n)], sampling_params=greedy)
        for i, n in enumerate((150, 9, 120))
    ]
    while engine.has_unfinished():
        engine.step()
    return batches, [engine.output(i) for i in ids]


SCALE = 16  # engine.dynamic_chunking for the engine tests: chunks shrink fast on the tiny model's short prompts


@pytest.fixture(scope="module")
def runs(tiny):
    """(batches, outputs) with dynamic chunking at SCALE, and with fixed chunks."""
    return _run(tiny, dynamic_chunking=SCALE), _run(tiny)


@pytest.mark.native
def test_chunks_shrink_with_their_context_and_keep_every_step_within_its_cost(runs):
    (batches, _), (fixed_batches, _) = runs
    prefills = [c for b in batches for c in b.chunks if not (c.num_tokens == 1 and c.start_pos >= c.context_len - 1)]
    assert prefills
    for chunk in prefills:  # each chunk costs what a 32-token one at position 0 does at most
        assert chunk.num_tokens == 1 or chunk_cost(chunk.num_tokens, chunk.start_pos, SCALE) <= 32
    late = [c.num_tokens for c in prefills if c.start_pos >= 100]
    assert late and max(late) < max(c.num_tokens for c in prefills if c.start_pos == 0)  # later chunks are shorter
    forced = max(chunk_cost(1, c.start_pos, SCALE) for c in prefills)
    for batch in batches:  # the step's budget counts each chunk at its cost (a forced one-token chunk past it)
        assert batch.num_tokens <= 32
        assert sum(chunk_cost(c.num_tokens, c.start_pos, SCALE) for c in batch.chunks) <= 32 + forced
    assert len(batches) > len(fixed_batches)  # the same prompts in more, smaller steps


@native_only  # the bits: batch-invariant mode (without the native kernels a chunk's rows may round otherwise)
def test_greedy_tokens_and_logprob_bits_do_not_depend_on_the_chunks(runs):
    (_, outputs), (_, fixed) = runs
    for ours, theirs in zip(outputs, fixed, strict=True):  # the same tokens, to the bit of their logprobs
        assert [s.token_ids for s in ours.outputs] == [s.token_ids for s in theirs.outputs]
        assert [s.logprobs for s in ours.outputs] == [s.logprobs for s in theirs.outputs]
