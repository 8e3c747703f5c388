"""Every model family against HF transformers' own implementation, on random-init tiny checkpoints:
the forward (no cache), the engine's cached logits through chunked prefill and batched decode,
and greedy generation."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import ATTENTION_BACKENDS, make_engine
from tests.families import CONFIGS, VOCAB, checkpoint_dir
from tests.test_oracle import engine_prefill_logits
from toolkit.config import ModelConfig
from toolkit.errors import ModelLoadError
from toolkit.models import load_model
from toolkit.models.loading import hf_reference_model, load_checkpoint
from toolkit.sampling.params import SamplingParams

FAMILIES = sorted(CONFIGS)


@functools.cache
def loaded(family: str):
    return load_model(ModelConfig(name="hf", path=str(checkpoint_dir(family))))


@functools.cache
def hf(family: str):
    return hf_reference_model(load_checkpoint(ModelConfig(name="hf", path=str(checkpoint_dir(family)))))


@torch.inference_mode()
def hf_logits(family: str, ids: list[int]) -> torch.Tensor:
    return hf(family)(torch.tensor([ids])).logits[0].float()


def run(engine, requests):
    """Run to completion; per request, its tokens and the logits row of each sampled position."""
    ids = [engine.add_request(**r) for r in requests]
    rows = {i: [] for i in ids}
    while engine.has_unfinished():
        out = engine.step()
        for i, s in enumerate(out.samples):
            rows[s.request_id].append((s.position, out.logits_RV[i].clone()))
    return {i: engine.requests[i].token_ids for i in ids}, rows


def backends(family: str) -> list[str]:
    return ["sdpa"] if loaded(family).arch.needs_torch_attention else list(ATTENTION_BACKENDS)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_read_as_its_own(family):
    arch = loaded(family).arch
    assert arch.family == family
    assert (arch.positions == "learned") == (family == "gpt2")
    assert arch.qk_norm == (family == "qwen3")
    assert (arch.attn_softcap, arch.sliding_layers) == ((4.0, (0, 2)) if family == "gemma2" else (None, ()))


@pytest.mark.native
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("length", [1, 9, 40])
def test_forward_matches_hf(family, length):
    ids = random.Random(length).choices(range(VOCAB), k=length)
    expected = hf_logits(family, ids)
    for backend in backends(family):
        engine = make_engine(
            loaded(family), num_kv_blocks=64, attention_backend=backend, max_num_batched_tokens=64, max_num_seqs=4
        )
        ours = engine_prefill_logits(engine, ids)  # the whole prompt through one prefill: every position
        assert (ours - expected).abs().max().item() < 1e-4, (backend, (ours - expected).abs().max().item())


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 3))
    requests = [
        dict(
            prompt_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30)),
            arrival_step=draw(st.integers(0, 4)),
            sampling_params=SamplingParams(
                temperature=draw(st.sampled_from([0.0, 1.0])),
                seed=i,
                max_tokens=draw(st.integers(1, 8)),
                ignore_eos=True,
            ),
        )
        for i in range(n)
    ]
    return requests, draw(st.integers(1, 24)), draw(st.sampled_from([1, 4, 16]))


@pytest.mark.native
@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=8)
@given(workload=workloads())
def test_cached_logits_equal_recompute(family, workload):
    """Chunked prefill, continuous batching and paged decode give each position the logits of
    a full no-cache forward (HF's) over the request's prefix."""
    requests, budget, block_size = workload
    for backend in backends(family):
        engine = make_engine(
            loaded(family),
            num_kv_blocks=256 // block_size,
            block_size=block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=min(3, budget),
            attention_backend=backend,
        )
        tokens, rows = run(engine, requests)
        for rid, seq in tokens.items():
            expected = hf_logits(family, seq[:-1])
            for position, logits in rows[rid]:
                assert (logits - expected[position - 1]).abs().max().item() < 1e-4, (backend, rid, position)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.native
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_generate(family):
    prompts = [random.Random(family + str(i)).choices(range(2, VOCAB), k=5 + 7 * i) for i in range(3)]
    engine = make_engine(loaded(family), num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=3)
    tokens, _ = run(
        engine,
        [
            dict(prompt_token_ids=p, sampling_params=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
            for p in prompts
        ],
    )
    for p, seq in zip(prompts, tokens.values()):
        out = hf(family).generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert seq[len(p) :] == out[0, len(p) :].tolist()


def test_unknown_family_is_one_line_error(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "vocab_size": 8}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="unsupported model_type 'mamba'; supported: llama, mistral, qwen2"):
        load_model(ModelConfig(name="hf", path=str(tmp_path)))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, r"num_attention_heads \(6\) must be a multiple of"),
        ({"num_attention_heads": 0}, "must be a positive integer, got 0"),
        ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
        ({"head_dim": 15, "num_key_value_heads": 4}, r"head_dim \(15\) must be even"),
    ],
)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2"])
def test_a_config_with_sizes_no_decoder_has_is_one_line_error(family, change, message):
    """6 query heads over 4 KV heads loaded before: the GPU's attention left two heads unwritten (uninitialised
    memory, no error) and the CPU's torch attention crashed mid-step with a reshape error."""
    from toolkit.models.families import arch_from_hf_config

    with pytest.raises(ModelLoadError, match=message):
        arch_from_hf_config({**CONFIGS[family], **change})
    arch_from_hf_config(CONFIGS[family])  # the family's own config still loads


@pytest.mark.native
@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_flex_backend_matches_default(family):
    """engine.attention_backend=flex (FlexAttention with a BlockMask from the block tables, uncompiled
    here) gives the default backend's logits within 1e-5 through chunked prefill and batched decode,
    prefix-cache hits included; for logits above 10 in magnitude, within 1e-6 of the largest (8 fp32
    ulps: on llama's logits of ~22, kernel, sdpa and flex each sit up to 1.1e-5 from a float64
    reference, so two of them can differ by that)."""
    shared = list(range(3, 19))
    requests = [
        dict(
            prompt_token_ids=shared + list(range(20 + i, 25 + 6 * i)),
            arrival_step=2 * i,
            sampling_params=SamplingParams(temperature=1.0, seed=i, max_tokens=7, ignore_eos=True),
        )
        for i in range(3)
    ]
    default = backends(family)[0]
    results = {}
    for backend in (default, "flex"):
        engine = make_engine(
            loaded(family),
            num_kv_blocks=40,
            block_size=4,
            max_num_batched_tokens=10,
            max_num_seqs=3,
            attention_backend=backend,
            flex_compile=False,
            enable_prefix_caching=True,
        )
        results[backend] = run(engine, requests)
    (tokens_a, rows_a), (tokens_b, rows_b) = results[default], results["flex"]
    assert list(tokens_a.values()) == list(tokens_b.values())
    for rid in rows_a:
        for (pa, la), (pb, lb) in zip(rows_a[rid], rows_b[rid]):
            tolerance = 1e-6 * max(10.0, la.abs().max().item())
            assert pa == pb and (la - lb).abs().max().item() < tolerance, (rid, pa)


@pytest.mark.numerics
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 9),
    width=st.sampled_from([8, 17, 64, 576, 960]),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 1000),
)
def test_a_16_bit_rms_norm_is_hfs_expression_bit_for_bit(rows, width, scale, dtype, seed):
    """The model's 16-bit RMSNorm (one fused fp32 op, what a GPU step runs) is HF's LlamaRMSNorm spelled out: widen,
    x * rsqrt(mean(x^2) + eps), round to the format, times the weight. Bit for bit wherever the two fp32 norms
    agree (on this machine, everywhere); where a CPU's fused reduction rounds the fp32 norm otherwise, at most one
    16-bit step of the rounded norm apart (compared within this run, not with a figure from another CPU)."""
    import torch.nn.functional as F

    from toolkit.models.decoder import rms_norm

    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, width, generator=gen) * scale).to(dtype)
    weight = torch.randn(width, generator=gen).to(dtype)
    x32 = x.float()
    hf32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
    want = weight * hf32.to(dtype)
    got = rms_norm(x, weight, 1e-5)
    same = F.rms_norm(x32, (width,), None, 1e-5) == hf32
    assert torch.equal(got[same].view(torch.int16), want[same].view(torch.int16))
    step = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)  # a 16-bit format's relative spacing
    bound = (weight.float().abs() * hf32.abs() * step * 2 + 1e-30)[~same]
    assert ((got.float() - want.float()).abs()[~same] <= bound).all()


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 12),
    width=st.integers(1, 70),
    piece=st.sampled_from([7, 16, 64, 16384]),
    activation=st.sampled_from(["gelu_tanh", "gelu", "silu"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_an_activation_a_row_at_a_time_gives_each_row_its_own_bits(data, rows, width, piece, activation, dtype):
    """decoder.rowwise (the batch-invariant mode's activations on the CPU): a row's result is its own whatever rows
    surround it (the same bits computed with any subset of the rows), in pieces of ROW_PIECE elements too, and it is
    the activation's value."""
    from toolkit.models import decoder

    fn = decoder.ACTIVATIONS[activation]
    x = (torch.randn(rows, width, generator=torch.Generator().manual_seed(rows * 100 + width)) * 3).to(dtype)
    subset = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=rows, unique=True))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decoder, "ROW_PIECE", piece)
        full, some = decoder.rowwise(fn, x), decoder.rowwise(fn, x[subset])
    assert full.dtype == dtype and torch.allclose(full.float(), fn(x.float()), rtol=1e-2, atol=1e-2)
    assert torch.equal(some, full[subset])
