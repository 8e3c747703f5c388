"""The audit's detector (toolkit.audit.detector): which format explains a transcript's claims.

The statistics first, on residuals drawn the way engines make them (hypothesis): the format that computed the
claims is the one named, one wild token cannot decide the test, windows and the AUC are what they say. Then the
whole path on the tiny model: an HF fp32 transcript is found consistent with float32, and the same transcript
whose claims are replaced by our bf16 / fp16 recomputation is named bfloat16 / float16; the CLI writes it all.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import once
from toolkit.audit.detection import detector_config, detector_scales, run_detector
from toolkit.audit.detector import (
    DEFAULT_SCALES,
    FORMATS,
    Detection,
    auc,
    combined,
    detect,
    token_loglik,
    window_scores,
)
from toolkit.audit.references import stated_reference
from toolkit.audit.sources import hf_transcript
from toolkit.audit.transcripts import read_transcripts
from toolkit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _laplace(generator: torch.Generator, n: int, scale: float) -> torch.Tensor:
    u = torch.rand(n, generator=generator, dtype=torch.float64) - 0.5
    return -scale * torch.sign(u) * torch.log1p(-2 * u.abs())


@settings(max_examples=60, deadline=None)
@given(truth=st.sampled_from(FORMATS), seed=st.integers(0, 2**31 - 1), tokens=st.sampled_from([16, 64]))
def test_the_format_that_computed_the_claims_is_named(truth, seed, tokens):
    # each format's exact logprobs depart from float32's by that format's rounding; an engine running `truth`
    # adds its own rounding (half the format's width) to them; the audit recomputes every format
    g = torch.Generator().manual_seed(seed)
    base = -torch.rand(tokens, generator=g, dtype=torch.float64) * 3
    exact = {f: base + (0 if f == "float32" else _laplace(g, tokens, DEFAULT_SCALES[f])) for f in FORMATS}
    claims = exact[truth] + _laplace(g, tokens, DEFAULT_SCALES[truth] / 2)
    found = detect({f: [claims - exact[f]] for f in FORMATS}, DEFAULT_SCALES, "float32")[0]
    assert found.tokens == tokens and found.best == truth, found.to_dict()
    assert (found.llr > 0) == (truth == "float32")
    assert abs(sum(found.posterior.values()) - 1) < 1e-9 and found.posterior[truth] > 0.99


def test_one_wild_token_cannot_decide_alone():
    g = torch.Generator().manual_seed(0)
    residual = _laplace(g, 64, DEFAULT_SCALES["float32"])
    wild = residual.clone()
    wild[17] = 20.0  # one token far off: an engine's glitch, or a tampered claim
    shift = _laplace(g, 64, DEFAULT_SCALES["bfloat16"])
    clean, found = (
        detect({"float32": [r], "bfloat16": [r + shift]}, DEFAULT_SCALES, "float32")[0] for r in (residual, wild)
    )
    assert found.best == "float32" and found.llr > 5, found.to_dict()
    assert (clean.llr - found.llr) * 64 < 25  # the test's total moved by one token's bounded share, no more
    # bounded: the wild token costs no more than the outlier floor below a typical token
    typical = token_loglik(residual[:1], DEFAULT_SCALES["float32"])
    assert float(typical - token_loglik(torch.tensor([20.0]), DEFAULT_SCALES["float32"])) < 20


@pytest.mark.parametrize("stated", FORMATS)
def test_claims_far_from_every_format_favour_none_whatever_is_stated(stated):
    """Claims off by nats (another model or checkpoint) score the outlier density under every format alike: the
    detector said "consistent with the stated format" and named the stated one best, whichever it was (a probe's
    finding). No format is best then, and the verdict says so; it still says they fit none."""
    g = torch.Generator().manual_seed(1)
    far = 10.0 + torch.rand(24, generator=g, dtype=torch.float64)
    found = detect({f: [far] for f in FORMATS}, DEFAULT_SCALES, stated)[0]
    assert found.best is None and found.tied == list(FORMATS) and found.to_dict()["best"] is None
    assert found.verdict().startswith("no format is favoured") and "fits none of the formats" in found.verdict()
    near = detect({f: [far * 0 if f == stated else far] for f in FORMATS}, DEFAULT_SCALES, stated)[0]
    assert near.best == stated and near.verdict().startswith("consistent with the stated format")


def test_tokens_without_a_usable_claim_are_left_out_of_every_hypothesis():
    r = torch.tensor([0.0, math.nan, 1e-6, 0.0])
    found = detect({"float32": [r], "bfloat16": [r.flip(0)]}, DEFAULT_SCALES, "float32")[0]
    assert found.tokens == 2  # positions 1 and 2 (NaN in one hypothesis or the other) count in neither
    assert len(found.per_token["float32"]) == len(found.per_token["bfloat16"]) == 2


@settings(max_examples=50, deadline=None)
@given(values=st.lists(st.floats(-20, 5), min_size=0, max_size=300), n=st.sampled_from([4, 16, 64]))
def test_windows_are_consecutive_tokens_in_order(values, n):
    stated = torch.tensor(values, dtype=torch.float64)
    other = -stated.flip(0)
    d = Detection(
        len(values),
        {"float32": float(stated.sum()), "bfloat16": float(other.sum())},
        "float32",
        {"float32": stated.tolist(), "bfloat16": other.tolist()},
    )
    scores = window_scores(d, n)
    assert len(scores) == len(values) // n
    for k, s in enumerate(scores):
        part = slice(k * n, (k + 1) * n)
        assert s == pytest.approx(float(stated[part].sum() - other[part].sum()) / n, abs=1e-9)
    residuals = torch.tensor(values, dtype=torch.float64) / 100
    halves = detect(
        {
            "float32": [residuals[: len(values) // 2], residuals[len(values) // 2 :]],
            "bfloat16": [-residuals[: len(values) // 2], -residuals[len(values) // 2 :]],
        },
        DEFAULT_SCALES,
        "float32",
    )
    whole = combined(halves, "float32")  # the requests joined in their order
    assert whole.per_token["float32"] == halves[0].per_token["float32"] + halves[1].per_token["float32"]
    assert whole.tokens == len(values) and whole.loglik["float32"] == pytest.approx(sum(whole.per_token["float32"]))


@settings(max_examples=60, deadline=None)
@given(p=st.lists(st.integers(-5, 5), max_size=30), q=st.lists(st.integers(-5, 5), max_size=30))
def test_auc_is_the_share_of_pairs_ordered_right(p, q):
    a = auc(p, q)
    if not p or not q:
        assert a is None
        return
    assert a + auc(q, p) == pytest.approx(1.0)
    ranks = sorted(p + q)  # Mann-Whitney's U from mid-ranks, computed another way
    mid = {v: (ranks.index(v) + len(ranks) - ranks[::-1].index(v) + 1) / 2 for v in set(ranks)}
    u = sum(mid[v] for v in p) - len(p) * (len(p) + 1) / 2
    assert a == pytest.approx(u / (len(p) * len(q)))
    if min(p) > max(q):
        assert a == 1.0


# ---------------------------------------------------------------------------------------- the tiny model


@pytest.fixture(scope="module")
def hf_tiny(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("detector") / "hf.jsonl"
    prompts = [
        tiny.tokenizer.apply_chat_template([{"role": "user", "content": c}])
        for c in ("Name a river.", "Count to four.", "Say hello twice.")
    ]
    hf_transcript(path, tiny, prompts, max_tokens=24)
    return path


def _claims_from(path: Path, tiny, reference: str, out: Path) -> Path:
    """The transcript with every claimed logprob replaced by `reference`'s recomputation of it."""
    forward = stated_reference(tiny, reference)
    objs = [json.loads(line) for line in path.read_text().splitlines()]
    for o in objs:
        ids = o["prompt_token_ids"] + o["output_token_ids"]
        logprobs = torch.log_softmax(forward(ids[:-1]).double(), -1)[len(o["prompt_token_ids"]) - 1 :]
        o["logprobs"] = [float(logprobs[j, t]) for j, t in enumerate(o["output_token_ids"])]
    out.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return out


@pytest.mark.native
def test_the_transcript_s_format_is_named_on_the_tiny_model(hf_tiny, tiny, tmp_path):
    detector = detector_config({"detector": {"alternatives": ["bfloat16", "float16"]}})
    scales = detector_scales(tiny, detector)  # this model's widths: HF's forward in each format against ours
    assert all(0 < scales[f] < 1 for f in FORMATS) and scales["float32"] < scales["float16"] < scales["bfloat16"]
    answers = {}
    for name, path in [
        ("float32", hf_tiny),
        ("bfloat16", _claims_from(hf_tiny, tiny, "ours@bfloat16", tmp_path / "b")),
        ("float16", _claims_from(hf_tiny, tiny, "ours@float16", tmp_path / "h")),
    ]:
        records, errors = read_transcripts(path, "hf", tiny.tokenizer, tiny.arch.vocab_size)
        assert not errors
        found = run_detector(records, tiny, detector, scales, atol=1e-4)
        answers[name] = found["transcript"].to_dict()
        assert all(d.best == name for _, _, d in found["requests"]), (name, answers[name])
    assert answers["float32"]["best"] == "float32" and answers["float32"]["llr_per_token"] > 0
    assert answers["float32"]["tokens"] == 3 * 24
    for name in ("bfloat16", "float16"):
        assert answers[name]["best"] == name and answers[name]["llr_per_token"] < 0, answers[name]
        assert "better explained by " + name in answers[name]["verdict"]


@pytest.mark.native
def test_cli_writes_the_detector_and_refuses_a_bad_one(hf_tiny, tmp_path):
    def run(out, *args):
        return subprocess.run(
            [
                sys.executable,
                str(ROOT / "run.py"),
                "mode=audit",
                "model=tiny",
                f"hydra.run.dir={out}",
                f"audit.input={hf_tiny}",
                "audit.format=hf",
                *args,
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )

    proc = run(tmp_path / "a", "audit.detector.alternatives=[bfloat16]", "audit.detector.calibrate=false")
    assert proc.returncode == 0, proc.stderr
    d = json.loads((tmp_path / "a" / "audit.json").read_text())["detector"]
    assert d["best"] == "float32" and d["stated"] == "float32" and d["tokens"] == 3 * 24
    assert set(d["scales"]) == {"float32", "bfloat16"} and all(v > 0 for v in d["scales"].values())
    assert [r["request_id"] for r in d["requests"]] == ["hf-0", "hf-1", "hf-2"]
    assert "detector (72 tokens" in proc.stdout and "consistent with the stated format" in proc.stdout
    proc = run(tmp_path / "b", "audit.detector.alternatives=[int4]")
    assert proc.returncode == 2 and "audit.detector: formats must be among" in proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "b" / "audit.json").exists()
    with pytest.raises(ConfigError, match="at least one format other than the stated one"):
        detector_config({"detector": {"alternatives": ["float32"]}})
    assert detector_config({"detector": {"alternatives": []}}) is None


@pytest.mark.native
@once
def test_engine_mismatch_tabulates_detection_per_source_and_window(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "run.py"),
            "experiment=engine_mismatch",
            "model=tiny",
            f"hydra.run.dir={out}",
            "audit.sources=[hf,server,server_bf16]",
            "audit.max_tokens=40",
            "audit.prompts=[Name a river.,Count to four.,Say hello twice.,Write one word.]",
            # the tiny model's widths, as calibrate_scales measured them (the test above)
            "audit.detector.scales={float32: 6.2e-7, bfloat16: 0.013, float16: 0.0019}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads((out / "engine_mismatch.json").read_text())
    assert {r["source"] for r in d["audits"]} == {"hf", "server", "server_bf16"}
    table = {r["source"]: r for r in d["detector"]["sources"]}
    assert d["detector"]["windows"] == [16, 64, 256] and d["detector"]["stated"] == "float32"
    for name in ("hf", "server"):  # ran the stated format: named so, their windows accepted
        assert table[name]["produced_by"] == "float32" and table[name]["best"] == "float32", table[name]
        assert table[name]["accepted_16"] == 1.0 and "auc_16" not in table[name]
    bf16 = table["server_bf16"]
    assert bf16["best"] == "bfloat16" and bf16["llr_per_token"] < 0 and bf16["windows_16"] >= 4
    assert bf16["auc_16"] == 1.0 and bf16["windows_256"] == 0 and bf16["auc_256"] is None
    assert "server_bf16  bfloat16" in proc.stdout and "AUC of 'not float32'" in proc.stdout
