"""Our forward equals HF transformers' LlamaForCausalLM on the same weights."""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import make_engine
from tests.hf_oracle import hf_greedy, hf_logits
from toolkit.config import ModelConfig
from toolkit.engine.core import Engine
from toolkit.models.reference import reference_logits
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


@pytest.mark.parametrize("length", [1, 7, 64, 300])
def test_tiny_forward_matches_hf(tiny, length):
    ids = random.Random(length).choices(range(tiny.arch.vocab_size), k=length)
    expected = hf_logits(TINY, ids)
    engine = make_engine(tiny, num_kv_blocks=64)
    ours = engine_prefill_logits(engine, ids)
    assert (ours - expected).abs().max().item() < 1e-4
    assert (reference_logits(tiny.model, ids).float() - expected).abs().max().item() < 1e-4


@pytest.mark.slow
def test_smollm2_forward_matches_hf(smollm2):
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0] + " " + PROMPTS[2]}])
    expected = hf_logits(SMOLLM2, ids)
    engine = make_engine(smollm2, num_kv_blocks=64)
    ours = engine_prefill_logits(engine, ids)
    assert (ours - expected).abs().max().item() < 1e-4
    assert (reference_logits(smollm2.model, ids).float() - expected).abs().max().item() < 1e-4


@pytest.mark.slow
def test_smollm2_greedy_matches_hf_generate(smollm2):
    """8 chat prompts x 32 tokens, all in one continuous batch, token for token equal to HF."""
    engine = make_engine(smollm2, num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=8)
    prompts = [smollm2.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = engine.generate([{"prompt_token_ids": ids, "sampling_params": params, "arrival_step": i}
                               for i, ids in enumerate(prompts)])
    for ids, out in zip(prompts, outputs):
        assert list(out.output_token_ids) == hf_greedy(SMOLLM2, ids, 32)
