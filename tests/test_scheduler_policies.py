"""engine.scheduler_policy: the design documents' baselines beside the fused scheduler.

fused (one forward per step), two_forwards (the same schedule in two forwards), prefill_first (prompts whole,
in steps of their own) and no_chunking (prompts whole). Greedy tokens must not depend on the policy; each
policy must do what its name says; the serving metrics must be what the trace gives by hand.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import BATCH_INVARIANT_OVERRIDE, NATIVE_OFF, make_engine, native_only
from toolkit.runs.metrics import percentile
from toolkit.runs.session import record
from toolkit.sampling.params import SamplingParams
from toolkit.trace.reader import read_samples, read_steps

POLICIES = ("fused", "two_forwards", "prefill_first", "no_chunking")


def _requests():
    """Short and long prompts (longer than the 32-token budget) arriving while others decode."""
    lengths, arrivals = (12, 70, 9, 45, 20, 90), (0, 0, 2, 3, 5, 6)
    return [
        {
            "prompt_token_ids": [(7 * i + 3 * j) % 500 + 10 for j in range(n)],
            "request_id": f"r{i}",
            "arrival_step": a,
            "sampling_params": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        }
        for i, (n, a) in enumerate(zip(lengths, arrivals))
    ]


def _run(tiny, policy, **cfg):
    """Every request through an engine with this policy; returns (engine, outputs, batches seen by the runner)."""
    engine = make_engine(
        tiny, scheduler_policy=policy, max_num_batched_tokens=32, max_num_seqs=8, batch_invariant=not NATIVE_OFF, **cfg
    )
    batches = []
    run = engine.runner.run

    def spy(batch, *args, **kwargs):  # records what the scheduler decided, then runs it unchanged
        batches.append((batch, len(engine.scheduler.waiting), engine.runner.num_forwards))
        return run(batch, *args, **kwargs)

    engine.runner.run = spy
    ids = [engine.add_request(**r) for r in _requests()]
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step())
    return engine, {i: engine.output(i) for i in ids}, batches, steps


@pytest.fixture(scope="module")
def runs(tiny):
    return {p: _run(tiny, p) for p in POLICIES}


@native_only  # the bits: batch-invariant mode
def test_greedy_tokens_and_logprob_bits_do_not_depend_on_the_policy(runs):
    base = {i: o.outputs[0].token_ids for i, o in runs["fused"][1].items()}
    assert all(len(t) == 6 for t in base.values())
    base_rows = {(s.request_id, s.position): s.raw_logprob for st in runs["fused"][3] for s in st.samples}
    for policy in POLICIES[1:]:
        assert {i: o.outputs[0].token_ids for i, o in runs[policy][1].items()} == base, policy
        rows = {(s.request_id, s.position): s.raw_logprob for st in runs[policy][3] for s in st.samples}
        assert rows == base_rows, policy  # batch-invariant mode: even the bits


def _is_prefill(chunk) -> bool:
    return chunk.num_tokens > 1 and chunk.num_logits == 1


@pytest.mark.native
def test_two_forwards_makes_two_forwards_on_a_mixed_step_and_fused_one(runs):
    for policy in ("fused", "two_forwards"):
        steps = [s for s in runs[policy][3] if s.batch_size]
        batches = [b for b, _, _ in runs[policy][2]]
        assert len(steps) == len(batches)
        mixed = [any(_is_prefill(c) for c in b.chunks) and any(not _is_prefill(c) for c in b.chunks) for b in batches]
        assert sum(mixed) >= 3  # the workload has mixed steps
        want = [2 if m and policy == "two_forwards" else 1 for m in mixed]
        assert [s.forwards for s in steps] == want, policy

    # the same schedule: the same batches step by step
    def shape(policy):
        return [tuple((c.seq_id, c.start_pos, c.num_tokens) for c in b.chunks) for b, _, _ in runs[policy][2]]

    assert shape("two_forwards") == shape("fused")


@pytest.mark.native
def test_no_chunking_never_splits_a_prompt_and_may_exceed_the_budget(runs):
    for policy in ("no_chunking", "prefill_first"):
        batches = [b for b, _, _ in runs[policy][2]]
        prefills = [c for b in batches for c in b.chunks if _is_prefill(c)]
        assert sorted(c.seq_id for c in prefills) == sorted(f"r{i}" for i in range(6))  # one chunk per prompt
        assert all(c.start_pos == 0 for c in prefills)
        over = [b for b in batches if b.num_tokens > 32]
        assert over and all(sum(_is_prefill(c) for c in b.chunks) == 1 for b in over)  # one whole prompt over
    fused = [c for b, _, _ in runs["fused"][2] for c in b.chunks if _is_prefill(c)]
    assert len(fused) > 6 and all(b.num_tokens <= 32 for b, _, _ in runs["fused"][2])  # fused chunks them


@pytest.mark.native
def test_prefill_first_never_runs_a_decode_while_a_prompt_waits(runs):
    batches = runs["prefill_first"][2]
    for batch, waiting, _ in batches:
        has_prefill = any(_is_prefill(c) for c in batch.chunks)
        has_decode = any(not _is_prefill(c) for c in batch.chunks)
        assert not (has_prefill and has_decode)
        if has_decode:
            assert waiting == 0  # every arrived prompt was admitted before decodes went on
    assert any(not any(_is_prefill(c) for c in b.chunks) for b, _, _ in batches)


@pytest.mark.native
def test_max_chunk_tokens_caps_one_sequences_chunk(tiny):
    _, outputs, batches, _ = _run(tiny, "fused", max_chunk_tokens=8)
    prefills = [c for b, _, _ in batches for c in b.chunks if _is_prefill(c)]
    assert prefills and max(c.num_tokens for c in prefills) == 8
    assert any(sum(_is_prefill(c) for c in b.chunks) > 1 for b, _, _ in batches)  # the budget fits several


@pytest.mark.native
def test_policy_is_in_the_manifest_and_the_itl_percentiles_are_the_traces(tiny, tmp_path):
    engine = make_engine(tiny, scheduler_policy="no_chunking", max_num_batched_tokens=32, max_num_seqs=8)
    ids = [engine.add_request(**r) for r in _requests()]
    recorded = record(engine, ids, tmp_path, {"mode": "run"})
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["scheduler_policy"] == "no_chunking" and manifest["may_exceed_token_budget"] is True
    rows = sorted(read_samples(tmp_path).to_pylist(), key=lambda r: (r["request_id"], r["stream"], r["position"]))
    gaps = [
        b["t_emit_s"] - a["t_emit_s"]
        for a, b in zip(rows, rows[1:])
        if (a["request_id"], a["stream"]) == (b["request_id"], b["stream"])
    ]
    s = recorded.summary
    assert len(gaps) == 6 * 5
    for q in (50, 95, 99):
        assert s[f"itl_p{q}_s"] == pytest.approx(percentile(gaps, q), rel=1e-12, abs=1e-12)
    assert s["requests_per_s"] == pytest.approx(6 / s["wall_s"])
    assert s["prompt_tok_per_s"] == pytest.approx(sum(len(r["prompt_token_ids"]) for r in _requests()) / s["wall_s"])
    assert s["queue_p95_s"] >= s["queue_p50_s"] >= 0 and 0 < s["kv_utilization_max"] <= 1
    steps = read_steps(tmp_path).to_pylist()
    assert s["forwards"] == len(steps)  # one forward per step here
    decode_only = {}  # the summary's decode steps by batch are steps.parquet's rows without prompt tokens
    for row in steps:
        if row["prefill_tokens"] == 0:
            decode_only.setdefault(str(row["decode_tokens"]), []).append(row["step_s"])
    assert s["decode_steps"] == {b: {"steps": len(v), "p50_s": percentile(v, 50)} for b, v in decode_only.items()}
    assert s["scheduler_policy"] == "no_chunking"


def test_a_bad_policy_is_a_one_line_error():
    from toolkit.config import EngineConfig
    from toolkit.errors import ConfigError

    with pytest.raises(ConfigError, match="scheduler_policy must be one of"):
        EngineConfig(scheduler_policy="fastest")
    with pytest.raises(ConfigError, match="max_chunk_tokens"):
        EngineConfig(max_chunk_tokens=0)


BUNDLES = {  # each experiment bundle, shrunk for the suite
    "interleaving": ["scheduling.num_requests=6", "scheduling.max_tokens=6"],
    "chunked_prefill": [
        "scheduling.num_requests=6",
        "scheduling.max_tokens=4",
        "scheduling.sweep.max_num_batched_tokens=[64,2048]",
    ],
    "batch_latency": ["scheduling.num_requests=6", "scheduling.max_tokens=4", "scheduling.sweep.max_num_seqs=[1,4]"],
    "continuous_batching": [],
}


@pytest.mark.native
@pytest.mark.parametrize("bundle", list(BUNDLES))
def test_each_experiment_bundle_composes_and_runs_on_tiny(bundle, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [
            sys.executable,
            str(root / "run.py"),
            f"experiment={bundle}",
            "model=tiny",
            BATCH_INVARIANT_OVERRIDE,
            f"hydra.run.dir={tmp_path}",
            *BUNDLES[bundle],
        ],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "scheduling.json").read_text())
    assert report["greedy_tokens_agree"] is True
    assert (tmp_path / "scheduling.png").stat().st_size > 0
    if bundle == "continuous_batching":
        assert "[step 3]" in proc.stdout and "static" in proc.stdout
        static, continuous = report["static"]["requests"], report["continuous"]["requests"]
        assert [r["admitted_step"] for r in continuous] == [0, 0, 3]  # the post's arrivals join at once
        assert static[2]["admitted_step"] == max(r["completed_step"] for r in static[:2]) + 1  # static waits
    else:
        assert len(report["variants"]) >= 2 and "tok/s" in proc.stdout


@pytest.mark.native
@pytest.mark.parametrize("policy", ["two_forwards", "prefill_first"])
def test_a_policy_run_replays_bit_for_bit(tiny, tmp_path, policy):
    """The policy is part of the recorded config: replay rebuilds the same schedule and the same bits."""
    from toolkit.reproduce.replay import replay

    engine = make_engine(
        tiny, scheduler_policy=policy, max_num_batched_tokens=32, max_num_seqs=8, sampling=SamplingParams()
    )
    ids = [
        engine.add_request(
            **{
                **r,
                "sampling_params": SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=6, ignore_eos=True),
            }
        )
        for r in _requests()
    ]
    record(engine, ids, tmp_path / "run", {"mode": "run"})
    report = replay(tmp_path / "run", [], out_dir=tmp_path / "replay")
    assert report.identical, report.summary_line()
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["engine"]["scheduler_policy"] == policy


@pytest.mark.native
def test_mode_scheduling_records_each_variant_and_tabulates_its_figures(tiny, tmp_path):
    """compare_variants: each variant is a recorded (untraced) run in variants/<name>, its row the run's summary
    plus per-step figures taken from the same steps steps.parquet holds."""

    from toolkit.bench.scheduling import compare_variants
    from toolkit.config import EngineConfig

    s = {
        "workload": "standard",
        "num_requests": 4,
        "max_tokens": 6,
        "warmup": False,
        "variants": {"wide": {}, "narrow": {"max_num_batched_tokens": 64}},
    }
    report = compare_variants(tiny, EngineConfig(num_kv_blocks=256), s, tmp_path)
    for name in ("wide", "narrow"):
        row = report["variants"][name]
        steps = read_steps(tmp_path / "variants" / name).to_pydict()
        assert row["steps"] == len(steps["step"]) and row["requests"] == 4
        assert row["max_step_tokens"] == max(d + p for d, p in zip(steps["decode_tokens"], steps["prefill_tokens"]))
        assert json.loads((tmp_path / "variants" / name / "summary.json").read_text())["output_tokens"] == 24
    assert report["variants"]["narrow"]["max_step_tokens"] <= 64 < report["variants"]["wide"]["max_step_tokens"]


def test_batch_vs_single_takes_the_widest_batch_with_enough_steps():
    from toolkit.runs.metrics import batch_vs_single

    by = {
        "1": {"steps": 4, "p50_s": 0.010},
        "6": {"steps": 9, "p50_s": 0.012},
        "10": {"steps": 3, "p50_s": 0.015},
        "12": {"steps": 2, "p50_s": 0.020},
    }
    assert batch_vs_single(by) == (10, pytest.approx(1.5))  # batch 12 has too few steps to say
    assert batch_vs_single({**by, "1": {"steps": 2, "p50_s": 0.01}}) is None  # nor has batch 1 here
    assert batch_vs_single({"1": by["1"]}) is None


@pytest.mark.native
def test_n_samples_never_run_past_max_num_seqs(tiny):
    """Heads of n > 1 admitted in one step hold their followers' slots before they fork: 4 prompts of n=3 under
    max_num_seqs=4 run one group at a time (admitting by heads alone ran two groups, 6 sequences)."""
    engine = make_engine(tiny, max_num_seqs=4, max_num_batched_tokens=256)
    for i in range(4):
        engine.add_request(
            f"group {i} says", sampling_params=SamplingParams(temperature=1.0, n=3, max_tokens=4, seed=i)
        )
    widest = 0
    while engine.has_unfinished():
        engine.step()
        widest = max(widest, len(engine.scheduler.running))
    assert widest == 3
