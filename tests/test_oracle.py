"""Our forward equals HF transformers' LlamaForCausalLM on the same weights."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import make_engine
from tests.hf_oracle import hf_greedy_with_margins, hf_logits
from tests.numerics import assert_greedy_agreement, with_threads
from toolkit.config import ModelConfig
from toolkit.engine.core import Engine
from toolkit.models.reference import one_thread, reference_logits
from toolkit.sampling.params import SamplingParams

TINY = ModelConfig(name="tiny", seed=0)
SMOLLM2 = ModelConfig(name="smollm2")

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "List three fruits that are red.",
    "How many legs does a spider have?",
    "Give me a name for a pet turtle.",
    "What does a compiler do?",
    "Translate 'thank you' into German.",
]


def engine_prefill_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits at every position from ONE engine step over the whole prompt (no cache reuse)."""
    from toolkit.engine.runner import ModelRunner
    from toolkit.engine.scheduler import ScheduledBatch, ScheduledChunk

    bm = engine.block_manager
    bm.allocate("oracle", len(ids))
    try:
        runner: ModelRunner = engine.runner
        chunk = ScheduledChunk("oracle", tuple(ids), 0, tuple(bm.block_table("oracle")), True)
        inputs = runner.prepare(ScheduledBatch(0, (chunk,), 0, len(ids)))
        rows = torch.arange(len(ids))
        return engine.loaded.model(inputs.input_ids_N, inputs.positions_N, inputs.attn, engine.kv_cache.layers, rows)
    finally:
        bm.free("oracle")


@pytest.mark.native
@pytest.mark.parametrize("length", [1, 7, 64, 300])
def test_tiny_forward_matches_hf(tiny, length):
    ids = random.Random(length).choices(range(tiny.arch.vocab_size), k=length)
    expected = hf_logits(TINY, ids)
    engine = make_engine(tiny, num_kv_blocks=64)
    ours = engine_prefill_logits(engine, ids)
    assert (ours - expected).abs().max().item() < 1e-4
    assert (reference_logits(tiny.model, ids).float() - expected).abs().max().item() < 1e-4


@pytest.mark.numerics
@settings(max_examples=12, deadline=None)
@given(
    ids=st.lists(st.integers(0, 49151), min_size=1, max_size=150),
    cut=st.integers(1, 150),
    threads=st.sampled_from([1, 2, 3]),
)
def test_reference_bits_depend_on_the_tokens_alone(tiny, ids, cut, threads):
    """The float64 reference's row t is a function of tokens[: t + 1]: the same bits at 1, 2 or 3 threads and
    when the sequence is cut after any position (what a shard, a Ray worker or a packed prefix computes), and
    the caller's thread setting is left as it was."""
    full = with_threads(2, lambda: reference_logits(tiny.model, ids))
    prefix = with_threads(threads, lambda: reference_logits(tiny.model, ids[:cut]))
    assert torch.equal(prefix, full[: len(prefix)])
    assert with_threads(threads, torch.get_num_threads) == threads
    with one_thread():
        assert torch.get_num_threads() == 1


@pytest.mark.slow
@pytest.mark.numerics
def test_smollm2_reference_bits_do_not_depend_on_threads_or_length(smollm2):
    """At SmolLM2's shapes (where a BLAS splits a product by the thread count): 1, 2 and 3 threads give the
    same bits, and a 50-token prefix's rows are the first 50 rows of the whole (94-token) sequence."""
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": " ".join(PROMPTS)}])
    full = with_threads(2, lambda: reference_logits(smollm2.model, ids))
    assert torch.equal(with_threads(1, lambda: reference_logits(smollm2.model, ids)), full)
    assert torch.equal(with_threads(3, lambda: reference_logits(smollm2.model, ids[:50])), full[:50])


@pytest.mark.native
@pytest.mark.slow
@pytest.mark.numerics
def test_smollm2_forward_matches_hf(smollm2):
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0] + " " + PROMPTS[2]}])
    expected = hf_logits(SMOLLM2, ids)
    engine = make_engine(smollm2, num_kv_blocks=64)
    ours = engine_prefill_logits(engine, ids)
    assert (ours - expected).abs().max().item() < 1e-4
    assert (reference_logits(smollm2.model, ids).float() - expected).abs().max().item() < 1e-4


@pytest.mark.native
@pytest.mark.slow
@pytest.mark.numerics
def test_smollm2_greedy_matches_hf_generate(smollm2):
    """8 chat prompts x 32 tokens, all in one continuous batch, token for token equal to HF's greedy decode but
    where HF's top-2 margin is a near-tie for the two implementations' rounding (tests/numerics.py): below 4x
    the largest |logprob| difference of their full forwards over the same sequence, measured here (the factor
    covers each one's decode path rounding apart from its full forward by as much again)."""
    engine = make_engine(smollm2, num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=8)
    prompts = [smollm2.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = engine.generate(
        [{"prompt_token_ids": ids, "sampling_params": params, "arrival_step": i} for i, ids in enumerate(prompts)]
    )
    hf = {f"p{i}": hf_greedy_with_margins(SMOLLM2, ids, 32) for i, ids in enumerate(prompts)}
    apart = 0.0
    for i, ids in enumerate(prompts):
        sequence = ids + hf[f"p{i}"][0]
        ours = engine_prefill_logits(make_engine(smollm2, num_kv_blocks=256), sequence).double().log_softmax(-1)
        apart = max(apart, (ours - hf_logits(SMOLLM2, sequence).double().log_softmax(-1)).abs().max().item())
    assert apart < 1e-3, apart  # the same weights in fp32: rounding apart, not a different model
    agreement = assert_greedy_agreement(
        {i: t for i, (t, _) in hf.items()},
        {i: m for i, (_, m) in hf.items()},
        {f"p{i}": list(o.output_token_ids) for i, o in enumerate(outputs)},
        window=32,
        near_tie=4 * apart,
    )
    assert agreement.checked, agreement.report()
