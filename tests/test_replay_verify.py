"""Replay reproduces a run bit for bit and names the first divergence; verify recomputes every row."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import make_engine, native_only
from toolkit import replay, verify
from toolkit.errors import ConfigError
from toolkit.report import write_report
from toolkit.runs.session import record
from toolkit.sampling.params import SamplingParams
from toolkit.trace.reader import TraceError, read_rejected, read_requests, read_samples
from toolkit.trace.writer import OPEN_REQUESTS_FILE, REQUESTS_FILE

pytestmark = pytest.mark.native

ROOT = Path(__file__).resolve().parents[1]
TINY_CFG = {"name": "tiny", "seed": 0}
ENGINE_CFG = {"max_num_batched_tokens": 16, "max_num_seqs": 4, "num_kv_blocks": 256}

MIXED = [
    {
        "prompt_token_ids": [5, 6, 7, 8],
        "request_id": "greedy",
        "sampling_params": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    },
    {
        "prompt_token_ids": list(range(40, 70)),
        "request_id": "nucleus",
        "arrival_step": 2,
        "sampling_params": SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=7, ignore_eos=True),
    },
    {
        "prompt": "Once upon a time",
        "request_id": "stop",
        "arrival_step": 4,
        "sampling_params": SamplingParams(temperature=1.0, max_tokens=10, stop=["e"], seed=3),
    },
    {
        "prompt_token_ids": [9, 9, 9],
        "request_id": "pair",
        "arrival_step": 1,
        "sampling_params": SamplingParams(
            n=2, temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, max_tokens=6, ignore_eos=True
        ),
    },
]


def make_run(tiny, run_dir: Path, requests=MIXED, engine_cfg=ENGINE_CFG, flush_every_steps=64):
    engine = make_engine(tiny, **engine_cfg)
    ids = [engine.add_request(**r) for r in requests]
    config = {
        "model": TINY_CFG,
        "engine": engine_cfg,
        "sampling": {},
        "trace": {"flush_every_steps": flush_every_steps},
    }
    return record(engine, ids, run_dir, config, flush_every_steps=flush_every_steps)


@pytest.fixture(scope="module")
def recorded_run(tiny, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "run"
    make_run(tiny, run_dir)
    return run_dir


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_sample(run_dir: Path, request_id: str, position: int, column: str, change, outputs: bool = True) -> None:
    """Hand-edit one value of one row in samples.parquet; a token as a careful forger would, in requests.parquet's
    output tokens too (`outputs`: the two files then agree, and only a replay or a recomputation can tell)."""
    for part in sorted((run_dir / "samples.parquet").glob("part-*.parquet")):
        table = pq.read_table(part)
        rows = table.to_pylist()
        for r in rows:
            if r["request_id"] == request_id and r["position"] == position and r["stream"] == 0:
                r[column] = change(r[column])
                pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), part)
                if column == "token_id" and outputs:
                    edit_outputs(run_dir, request_id, position, r[column])
                return
    raise AssertionError("row not found")


def edit_outputs(run_dir: Path, request_id: str, position: int, token: int) -> None:
    """Set the output token at `position` of stream 0 of `request_id` in requests.parquet's parts."""
    for part in sorted((run_dir / REQUESTS_FILE).glob("part-*.parquet")):
        table = pq.read_table(part)
        rows = table.to_pylist()
        for r in rows:
            if r["request_id"] == request_id and r["stream"] == 0:
                r["output_token_ids"][position - len(r["prompt_token_ids"])] = token
                pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), part)
                return
    raise AssertionError("request not found")


def test_replay_of_a_mixed_run_is_bit_identical(recorded_run, tmp_path):
    report = replay(recorded_run, out_dir=tmp_path / "replay")
    assert report.identical, report.summary_line()
    assert report.summary_line().startswith("bit-identical")
    assert report.rows_compared == read_samples(recorded_run).num_rows >= 28
    assert report.sequences_compared == 5
    stop_rows = [r for r in read_samples(recorded_run).to_pylist() if r["request_id"] == "stop"]
    assert stop_rows[-1]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    "column, change, field, kind",
    [
        ("token_id", lambda t: (t + 1) % 49152, "token_id", "token"),
        ("raw_logprob", lambda x: x - 0.001, "raw_logprob", "logprob"),
        ("noise", lambda x: x + 1e-12, "noise", "noise"),
        ("kept_sha256", lambda d: d[::-1], "kept_sha256", "support"),  # the sampling mask a row claims
        # what only a replay compares: the recorded top alternatives (compared by id and fp32 bits)
        ("top_raw", lambda top: [*top, {"token_id": 5, "logprob": -1.0}], "top_raw", "logprob"),
        ("top_processed", lambda top: [*(top or []), {"token_id": 7, "logprob": -0.5}], "top_processed", "logprob"),
    ],
)
def test_tampering_one_value_is_reported_at_exactly_that_row(recorded_run, tmp_path, column, change, field, kind):
    run = copy_run(recorded_run, tmp_path / "run")
    edit_sample(run, "nucleus", 33, column, change)
    report = replay(run, out_dir=tmp_path / "replay")
    assert not report.identical
    assert [(d.request_id, d.position, d.field) for d in report.differences] == [("nucleus", 33, field)]
    # the first divergence (toolkit.trace.diverge, as the report names it) and its cause
    assert [(d.request_id, d.position, d.kind, d.fields) for d in report.first_divergences] == [
        ("nucleus", 33, kind, (field,))
    ]
    written = pq.read_table(tmp_path / "replay" / "divergence.parquet").to_pylist()
    assert [(r["request_id"], r["position"], r["field"]) for r in written] == [("nucleus", 33, field)]


def test_verify_passes_and_a_hand_edited_token_fails_at_that_row(recorded_run, tmp_path):
    report = verify(recorded_run)
    assert report.passed, report.summary_line()
    assert report.rows_checked == read_samples(recorded_run).num_rows and report.max_abs_diff < 1e-5
    # a flip of the argmax is allowed only at a near-tie within atol (which lane order wins one is the CPU's)
    assert report.greedy_rows == 8 and report.greedy_argmax_mismatches == report.near_tie_flips
    run = copy_run(recorded_run, tmp_path / "run")
    edit_sample(run, "greedy", 7, "token_id", lambda t: (t + 1) % 49152)
    report = verify(run)
    assert not report.passed
    assert [(f.request_id, f.position) for f in report.failures] == [("greedy", 7)]


def test_verify_reports_a_nan_logprob_as_the_largest_diff_not_zero(recorded_run, tmp_path):
    """A recorded raw logprob of NaN fails its row, and the report's largest diff is NaN at that row (it said 0)."""
    run = copy_run(recorded_run, tmp_path / "run")
    edit_sample(run, "greedy", 7, "raw_logprob", lambda _: float("nan"))
    report = verify(run)
    assert [(f.request_id, f.position) for f in report.failures] == [("greedy", 7)]
    assert math.isnan(report.max_abs_diff) and report.max_at == "greedy#0 position 7", report.summary_line()
    assert "max |raw logprob diff| nan at greedy#0 position 7" in report.summary_line()


def test_verify_names_a_sampled_token_forged_with_its_recomputed_logprob(recorded_run, tmp_path):
    """A sampled token changed in both files, with the raw logprob the reference gives the new token: every
    logprob then lies within atol and verify passed (only replay caught it). A sampled row's noise is its
    request key's for its token, so the forged row fails at itself; a noise edited alone fails too."""
    run = copy_run(recorded_run, tmp_path / "run")
    edit_sample(run, "nucleus", 33, "token_id", lambda t: (t + 1) % 49152)
    check = next(c for c in verify(run).checks if (c.request_id, c.position) == ("nucleus", 33))
    edit_sample(run, "nucleus", 33, "raw_logprob", lambda _: check.recomputed_logprob)
    report = verify(run)
    assert [(f.request_id, f.position) for f in report.failures] == [("nucleus", 33)], report.summary_line()
    assert "is not the request key's for token" in report.failures[0].reason
    assert report.failures[0].abs_diff < 1e-4  # its logprob did not give it away
    run = copy_run(recorded_run, tmp_path / "noise")
    edit_sample(run, "nucleus", 34, "noise", lambda x: x + 1e-12)
    assert [(f.request_id, f.position) for f in verify(run).failures] == [("nucleus", 34)]


def test_verify_counts_the_error_rows_it_cannot_recompute(tiny, tmp_path):
    """A row an error ended (here the one allowed token, banned after itself: nothing to sample) holds no token to
    recompute: verify passes the run's sampled rows and says how many rows it left, where it said "verified: N rows"
    as if that were all (a probe's finding: a run of error rows alone verified 0 rows, silently)."""
    empty = SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=[5], bad_words=[(5, 5)])
    requests = [MIXED[0], {"prompt_token_ids": [3, 4], "request_id": "empty", "sampling_params": empty}]
    run = tmp_path / "run"
    make_run(tiny, run, requests=requests)
    errors = [r for r in read_samples(run).to_pylist() if r["error"] is not None]
    report = verify(run)
    assert len(errors) == report.error_rows == 1 and report.passed and report.rows_checked == 9
    assert "1 error rows sampled nothing and are not recomputed" in report.summary_line()


def test_an_older_trace_with_stop_strings_on_a_model_without_a_tokenizer_replays(tmp_path):
    """Such stop strings are refused now (nothing detokenizes, so none ever matched); a trace recorded before keeps
    them in its requests' sampling, which replay cannot override. Replay drops them: the same run, bit-identical."""
    from tests.families import checkpoint_dir
    from toolkit.config import ModelConfig
    from toolkit.models import load_model

    model = {"name": "hf", "path": str(checkpoint_dir("llama"))}
    engine = make_engine(load_model(ModelConfig(**model)), **ENGINE_CFG)
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=5, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=[3, 4, 5], request_id="old", sampling_params=params)]
    run = tmp_path / "run"
    record(engine, ids, run, {"model": model, "engine": ENGINE_CFG, "sampling": {}, "trace": {}})
    for part in sorted((run / REQUESTS_FILE).glob("part-*.parquet")):  # as recorded before the refusal
        table = pq.read_table(part)
        rows = table.to_pylist()
        for r in rows:
            r["sampling_params"] = json.dumps({**json.loads(r["sampling_params"]), "stop": ["x"]})
        pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), part)
    report = replay(run, out_dir=tmp_path / "replayed")
    assert report.identical, report.summary_line()


def test_verify_with_the_hf_reference(recorded_run):
    report = verify(recorded_run, reference="hf")
    assert report.passed and report.reference == "hf" and report.max_abs_diff < 1e-4


def test_partial_trace_replays_and_verifies_the_rows_it_has(tiny, tmp_path):
    run_dir = tmp_path / "run"
    engine = make_engine(tiny, **ENGINE_CFG)
    ids = [engine.add_request(**r) for r in MIXED]
    initial_requests = None

    def capture(out):
        nonlocal initial_requests
        if initial_requests is None:
            initial_requests = tmp_path / "requests-at-start"
            shutil.copytree(run_dir / REQUESTS_FILE, initial_requests / REQUESTS_FILE)
            shutil.copy(run_dir / OPEN_REQUESTS_FILE, initial_requests / OPEN_REQUESTS_FILE)

    record(
        engine,
        ids,
        run_dir,
        {"model": TINY_CFG, "engine": ENGINE_CFG, "sampling": {}},
        flush_every_steps=3,
        on_step=capture,
    )
    # what a kill -9 leaves: the last part not yet written, the request rows as they were at the start of the run,
    # no summary.json (written when a run closes)
    parts = sorted((run_dir / "samples.parquet").glob("part-*.parquet"))
    assert len(parts) >= 3
    parts[-1].unlink()
    (run_dir / "summary.json").unlink()
    shutil.rmtree(run_dir / REQUESTS_FILE)
    shutil.copytree(initial_requests / REQUESTS_FILE, run_dir / REQUESTS_FILE)
    shutil.copy(initial_requests / OPEN_REQUESTS_FILE, run_dir / OPEN_REQUESTS_FILE)
    kept = read_samples(run_dir)
    report = replay(run_dir, out_dir=tmp_path / "replay")
    # the replay ends where the trace does: no row past it, each request still running then aborted there
    assert report.identical and report.rows_compared == kept.num_rows and report.rows_only_in_replay == 0
    assert report.sequences_unfinished_in_trace > 0 and "partial trace" in report.summary_line()
    cut = max(kept.column("step").to_pylist()) + 1
    replayed = read_requests(tmp_path / "replay").to_pylist()
    assert {r["abort_step"] for r in replayed if r["finish_reason"] == "abort"} == {cut}
    assert sum(r["finish_reason"] == "abort" for r in replayed) == report.sequences_unfinished_in_trace
    kept = kept.num_rows
    assert verify(run_dir).rows_checked == kept


def test_corrupt_or_foreign_traces_are_refused_with_one_line(recorded_run, tmp_path):
    run = copy_run(recorded_run, tmp_path / "corrupt")
    part = next((run / "samples.parquet").glob("part-*.parquet"))
    part.write_bytes(part.read_bytes()[: len(part.read_bytes()) // 2])
    with pytest.raises(TraceError, match="truncated or corrupt"):
        replay(run, out_dir=tmp_path / "r1")
    with pytest.raises(TraceError, match="truncated or corrupt"):
        verify(run)
    run = copy_run(recorded_run, tmp_path / "weights")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["weights_sha256"] = "0" * 64
    (run / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceError, match="refusing to replay: model weights differ") as info:
        replay(run, out_dir=tmp_path / "r2")
    assert "\n" not in str(info.value)
    report = replay(run, allow_mismatch=True, out_dir=tmp_path / "r3")
    assert report.identical and report.mismatches and "weights differ" in report.mismatches[0]
    run = copy_run(recorded_run, tmp_path / "schema")
    manifest["weights_sha256"] = json.loads((recorded_run / "manifest.json").read_text())["weights_sha256"]
    manifest["schema_version"] = 999
    (run / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceError, match="schema version 999"):
        replay(run, out_dir=tmp_path / "r4")
    manifest["schema_version"] = [7]  # no integer (nor hashable): was a TypeError's traceback
    (run / "manifest.json").write_text(json.dumps(manifest))
    for mode in (verify, replay):
        with pytest.raises(TraceError, match=r"schema version \[7\] is no integer"):
            mode(run)
    manifest["schema_version"] = json.loads((recorded_run / "manifest.json").read_text())["schema_version"]
    for key, value, kind in (("dtype", [1], "a string"), ("kv_scale_granularity", [1], "a string")):
        (run / "manifest.json").write_text(json.dumps({**manifest, key: value}))  # were TypeError tracebacks
        for mode in (verify, replay):
            with pytest.raises(TraceError, match=rf"manifest.json is corrupt: {key} is \[1\], not {kind}"):
                mode(run)
    run = copy_run(recorded_run, tmp_path / "interpolated")  # a recorded config holds no interpolation to resolve
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("block_size: ", "block_size: ${nope.missing} #", 1))
    for mode in (verify, replay):
        with pytest.raises(TraceError, match="interpolation that does not resolve"):
            mode(run)
    with pytest.raises(TraceError, match="does not exist"):
        replay(tmp_path / "nowhere")


def test_a_lost_retyped_or_foreign_part_is_one_line_for_replay_verify_and_report(tiny, tmp_path):
    """A requests part deleted (replay called each of its sequences diverged), a requests part whose prompt is
    doubles (verify passed it), a samples part that is a directory, and a steps or rejected part of another schema
    (report: an ArrowInvalid traceback) are each a TraceError naming the part."""
    make_run(tiny, recorded_run := tmp_path / "run", flush_every_steps=2)
    parts = sorted((recorded_run / REQUESTS_FILE).glob("part-*.parquet"))
    assert len(parts) > 1  # (its requests ended over more than one flush)
    run = copy_run(recorded_run, tmp_path / "lost")
    (run / REQUESTS_FILE / parts[0].name).unlink()
    for mode in (replay, verify, write_report):
        with pytest.raises(TraceError, match=r"rows for \S+, which requests.parquet lacks \(a part of it lost\?\)"):
            mode(run)
    run = copy_run(recorded_run, tmp_path / "doubles")
    table = pq.read_table(part := run / REQUESTS_FILE / parts[-1].name)
    doubles = pa.array(
        [[float(t) for t in p] for p in table.column("prompt_token_ids").to_pylist()], pa.list_(pa.float64())
    )
    pq.write_table(
        table.set_column(table.schema.get_field_index("prompt_token_ids"), "prompt_token_ids", doubles), part
    )
    for mode in (replay, verify, write_report):
        with pytest.raises(
            TraceError, match=r"column prompt_token_ids is list<\w+: double>, expected list<\w+: int64>"
        ):
            mode(run)
    run = copy_run(recorded_run, tmp_path / "a directory")  # once "schema version missing"
    (run / "samples.parquet" / "part-999999.parquet").mkdir()
    for mode in (replay, verify, write_report):
        with pytest.raises(TraceError, match=r"part-999999.parquet is not a file \(each part of a trace is one"):
            mode(run)
    for directory, read in (("steps.parquet", write_report), ("rejected.parquet", read_rejected)):
        run = copy_run(recorded_run, tmp_path / directory)
        (run / directory).mkdir(exist_ok=True)
        pq.write_table(pa.table({"step": [0]}), run / directory / "part-000000.parquet")
        pq.write_table(pa.table({"x": ["?"]}), run / directory / "part-999999.parquet")
        with pytest.raises(
            TraceError, match=rf"{directory}: its parts do not share one schema .*: a part from elsewhere"
        ):
            read(run)


def test_scheduling_override_reports_tokens_and_bits_separately(recorded_run, tmp_path):
    report = replay(recorded_run, ["engine.max_num_batched_tokens=5"], out_dir=tmp_path / "replay")
    line = report.summary_line()
    assert line.startswith("bit-identical") or ("tokens in" in line and "logprob bits (same token) in" in line)
    assert report.overrides == ["engine.max_num_batched_tokens=5"]
    assert report.max_abs_logprob_diff < 1e-4
    with pytest.raises(Exception, match="no such key"):
        replay(recorded_run, ["engine.max_num_batched_tokenz=5"], out_dir=tmp_path / "bad")


@st.composite
def greedy_workloads(draw):
    requests = []
    for i in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 30))
        requests.append(
            {
                "prompt_token_ids": draw(st.lists(st.integers(0, 49151), min_size=n, max_size=n)),
                "request_id": f"r{i}",
                "arrival_step": draw(st.integers(0, 5)),
                "sampling_params": SamplingParams(temperature=0.0, max_tokens=draw(st.integers(1, 6)), ignore_eos=True),
            }
        )
    overrides = [
        f"engine.max_num_batched_tokens={draw(st.integers(4, 40))}",
        f"engine.max_num_seqs={draw(st.integers(1, 4))}",
        f"engine.block_size={draw(st.sampled_from([1, 4, 16]))}",
    ]
    return requests, overrides


@settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=greedy_workloads())
def test_greedy_replay_under_random_scheduling_overrides_keeps_tokens(tiny, tmp_path_factory, workload):
    requests, overrides = workload
    base = tmp_path_factory.mktemp("hyp")
    make_run(tiny, base / "run", requests)
    report = replay(base / "run", overrides, out_dir=base / "replay")
    assert report.token_mismatches == 0 and not [d for d in report.differences if d.field in ("token_id", "row")]
    assert verify(base / "run").passed


def test_cli_replay_and_verify_exit_codes(recorded_run, tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)

    ok = cli("mode=replay", f"replay.trace={recorded_run}", f"hydra.run.dir={tmp_path / 'a'}")
    assert ok.returncode == 0 and ok.stdout.strip().splitlines()[-1].startswith("bit-identical"), ok.stderr
    run = copy_run(recorded_run, tmp_path / "run")
    edit_sample(run, "greedy", 6, "token_id", lambda t: (t + 1) % 49152)
    bad = cli("mode=replay", f"replay.trace={run}", f"hydra.run.dir={tmp_path / 'b'}")
    assert bad.returncode == 1 and "first divergence: greedy position 6: token_id" in bad.stdout
    assert "(cause: sampling: the same logits, kept set and noise, but another token)" in bad.stdout
    assert (tmp_path / "b" / "divergence.parquet").exists()
    failed = cli("mode=verify", f"verify.trace={run}", f"hydra.run.dir={tmp_path / 'c'}")
    assert failed.returncode == 1 and "first failure: greedy#0 position 6" in failed.stdout
    missing = cli("mode=verify", f"verify.trace={tmp_path / 'nope'}", f"hydra.run.dir={tmp_path / 'd'}")
    assert missing.returncode == 2 and missing.stderr.strip().startswith("error:") and "Traceback" not in missing.stderr


@native_only
def test_replay_names_the_matmul_backend_of_older_traces(tiny):
    """A manifest without matmul_backend comes from before the native matmul served the default
    mode: it ran torch's GEMM, so replaying it with the native one is refused with the fix."""
    from toolkit.reproduce.replay import check_manifest
    from toolkit.trace.reader import TraceError

    engine = make_engine(tiny)
    manifest = {"weights_sha256": tiny.revision, "tokenizer_sha256": tiny.tokenizer.digest, "batch_invariant": False}
    assert engine.matmul_backend == "native"
    with pytest.raises(TraceError, match="matmul backend differs: recorded torch, replay native"):
        check_manifest(manifest, engine, allow_mismatch=False)
    assert check_manifest(manifest, make_engine(tiny, matmul_backend="torch"), allow_mismatch=False) == []


@native_only
def test_replay_refuses_a_trace_recorded_under_other_kernel_numerics(tiny):
    """The kernels' bits depend on the build's lanes and FMA: a trace from an AVX-512 build replayed on
    another profile is refused, naming the target to replay with."""
    from toolkit.reproduce.replay import check_manifest
    from toolkit.runs.manifest import native_kernels
    from toolkit.trace.reader import TraceError

    engine = make_engine(tiny)
    here = native_kernels(engine)
    manifest = {
        "weights_sha256": tiny.revision,
        "tokenizer_sha256": tiny.tokenizer.digest,
        "batch_invariant": False,
        "matmul_backend": engine.matmul_backend,
        **here,
    }
    assert check_manifest(manifest, engine, allow_mismatch=False) == []
    other = "16 lanes, fma" if here["kernel_numerics"] != "16 lanes, fma" else "8 lanes, fma"
    manifest.update(kernel_numerics=other, native_kernels=f"x86-64-v4 ({other})", kernel_target="x86-64-v4")
    with pytest.raises(TraceError, match="native kernel numerics differ.*TOOLKIT_KERNEL_TARGET=x86-64-v4"):
        check_manifest(manifest, engine, allow_mismatch=False)
    # the numerics themselves are named on both sides (not a build's name twice where only they were recorded)
    manifest.update(native_kernels=here["native_kernels"])
    with pytest.raises(TraceError, match=f"recorded {other} .*, replay {here['kernel_numerics']} "):
        check_manifest(manifest, engine, allow_mismatch=False)
    # a manifest saying another format than config.yaml loads (verify refused it; replay said bit-identical)
    manifest.update(here, dtype="bfloat16")
    with pytest.raises(TraceError, match="model format differs: recorded bfloat16, replay float32"):
        check_manifest(manifest, engine, allow_mismatch=False)


def test_an_alternative_one_ulp_off_is_a_divergence_at_its_row(tiny, tmp_path):
    """The recorded top alternatives are what the replay computes, id by id and bit for bit: one alternative's
    logprob moved by one fp32 ulp is a divergence at exactly that row (a replay compared only the sampled token's
    logprobs, and said such a trace was bit-identical)."""
    asked = [
        {
            "prompt_token_ids": [5, 6, 7],
            "request_id": "alts",
            "sampling_params": SamplingParams(temperature=0.7, seed=2, max_tokens=5, ignore_eos=True, logprobs=3),
        }
    ]
    run = tmp_path / "run"
    make_run(tiny, run, requests=asked)
    assert replay(run, out_dir=tmp_path / "same").identical

    def nudge(top):
        first = np.float32(top[1]["logprob"])
        return [top[0], {**top[1], "logprob": float(np.nextafter(first, np.float32(0)))}, *top[2:]]

    edit_sample(run, "alts", 4, "top_raw", nudge)
    report = replay(run, out_dir=tmp_path / "replay")
    assert [(d.position, d.field) for d in report.differences] == [(4, "top_raw")]
    assert [(d.position, d.kind) for d in report.first_divergences] == [(4, "logprob")]


def _rewrite_parts(run_dir: Path, change) -> None:
    """Every samples.parquet part rewritten as change(table) gives it."""
    for part in sorted((run_dir / "samples.parquet").glob("part-*.parquet")):
        pq.write_table(change(pq.read_table(part)), part)


def test_a_trace_that_cannot_be_trusted_is_refused_naming_what(tiny, recorded_run, tmp_path):
    """What a probe passed as a sound trace (each once replayed "bit-identical" or diverged for the wrong reason, or
    raised a traceback) is refused with one line: a rerun or a replay written into a directory that holds a run
    (the parts of two runs under one manifest, the recording gone), a trace whose every sample part is lost, a part
    given twice or taken from another run, a column of another type, a row without its key, a manifest whose word
    disagrees with its config or is no object, and corrupt recorded values."""
    with pytest.raises(ConfigError, match="already holds a run"):
        make_run(tiny, copy_run(recorded_run, tmp_path / "again"))
    with pytest.raises(ConfigError, match="already holds a run"):
        replay(copy_run(recorded_run, tmp_path / "into"), out_dir=tmp_path / "into")
    assert (tmp_path / "into" / "samples.parquet").exists()

    def refused(name: str, edit, match: str, also_verify: bool = True) -> None:
        run = copy_run(recorded_run, tmp_path / name)
        edit(run)
        with pytest.raises(TraceError, match=match) as info:
            replay(run, out_dir=tmp_path / f"{name}-replay")
        assert "\n" not in str(info.value)
        if also_verify:
            with pytest.raises(TraceError, match=match):
                verify(run)

    def lose_parts(run: Path) -> None:
        for part in (run / "samples.parquet").glob("part-*.parquet"):
            part.unlink()

    refused("lost", lose_parts, "holds no sample rows, yet requests.parquet lists")
    refused("twice", lambda run: _rewrite_parts(run, lambda t: pa.concat_tables([t, t])), "more than one row")
    other = tmp_path / "other"
    make_run(tiny, other)

    def foreign(run: Path) -> None:
        shutil.copy(
            next((other / "samples.parquet").glob("part-*.parquet")), run / "samples.parquet/part-000009.parquet"
        )

    refused("foreign", foreign, "a part from another run")

    def retype(table: pa.Table) -> pa.Table:
        i = table.schema.get_field_index("token_id")
        return table.set_column(i, "token_id", table.column("token_id").cast(pa.string()))

    refused("retyped", lambda run: _rewrite_parts(run, retype), "column token_id is string, expected int64")

    def unkey(table: pa.Table) -> pa.Table:
        i = table.schema.get_field_index("request_id")
        return table.set_column(i, "request_id", pa.nulls(table.num_rows, pa.string()))

    refused("unkeyed", lambda run: _rewrite_parts(run, unkey), "rows have no request_id")

    def manifest_edit(**changes):
        def edit(run: Path) -> None:
            manifest = json.loads((run / "manifest.json").read_text())
            (run / "manifest.json").write_text(json.dumps({**manifest, **changes}))

        return edit

    run = copy_run(recorded_run, tmp_path / "dtype")
    manifest_edit(dtype="bfloat16")(run)
    with pytest.raises(TraceError, match="manifest.json says a bfloat16 run, its config.yaml loads float32"):
        verify(run)  # its tolerance would have been bfloat16's
    refused("threads", manifest_edit(num_threads=-3), "num_threads -3 is no thread count", also_verify=False)
    refused("listed", lambda run: (run / "manifest.json").write_text("[1, 2]"), "a JSON list, not an object")

    def corrupt_params(run: Path) -> None:
        for part in (run / "requests.parquet").glob("part-*.parquet"):
            table = pq.read_table(part)
            i = table.schema.get_field_index("sampling_params")
            pq.write_table(table.set_column(i, "sampling_params", pa.array(["{oops"] * table.num_rows)), part)

    refused("params", corrupt_params, "sampling_params of .* are corrupt")
    run = copy_run(recorded_run, tmp_path / "vocab")
    first = read_samples(run).slice(0, 1).to_pylist()[0]
    edit_sample(run, first["request_id"], first["position"], "token_id", lambda _: 10**12)
    with pytest.raises(TraceError, match="token id 1000000000000 is outside the model's vocabulary"):
        verify(run)


def test_a_schemas_property_order_is_recorded_and_its_run_replays(tiny, tmp_path):
    """A JSON schema's properties in their given order make its grammar (the keys are generated in that order): the
    recorded sampling_params keep it, so the run replays bit for bit. They were written with sorted keys, and every
    served run with a schema whose properties were not in alphabetical order diverged in replay and failed verify."""
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs={"json": schema})
    run = tmp_path / "schema"
    make_run(tiny, run, requests=[{"prompt_token_ids": [1, 2, 3], "request_id": "json", "sampling_params": params}])
    recorded = json.loads(read_requests(run).column("sampling_params")[0].as_py())
    assert list(recorded["structured_outputs"]["json"]["properties"]) == ["zeta", "alpha"]
    report = replay(run, out_dir=tmp_path / "replay")
    assert report.identical, report.summary_line()


def test_a_greedy_grammar_run_verifies_with_its_grammars_masks(tiny, tmp_path):
    """A greedy row with a grammar is the argmax of the MASKED logits: verify rebuilds each row's mask with a
    fresh matcher fed the recorded tokens (it checked the argmax of the unmasked ones, and every served greedy
    JSON run failed). A row whose recorded grammar_allowed is not the rebuilt mask's, or whose token the grammar
    refuses, fails by name."""
    schema = {
        "type": "object",
        "properties": {"name": {"enum": ["Al", "Bo"]}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs={"json": schema})
    run = tmp_path / "greedy"
    make_run(tiny, run, requests=[{"prompt_token_ids": [5, 6, 7], "request_id": "json", "sampling_params": params}])
    report = verify(run)
    assert report.passed and report.greedy_rows == report.rows_checked > 0, report.summary_line()
    rows = read_samples(run).to_pylist()
    assert any(r["grammar_allowed"] < tiny.arch.vocab_size for r in rows)

    counted = copy_run(run, tmp_path / "counted")
    edit_sample(counted, "json", rows[2]["position"], "grammar_allowed", lambda n: n + 1)
    failure = verify(counted).failures[0]
    assert failure.position == rows[2]["position"] and "the grammar allows" in failure.reason, failure.reason

    refused = copy_run(run, tmp_path / "refused")
    first = rows[0]  # the grammar's first token opens the object: "{" or whitespace, never token 0
    edit_sample(refused, "json", first["position"], "token_id", lambda _: 0)
    recomputed = (
        verify(refused).failures[0].recomputed_logprob
    )  # the edited token's own logprob, so only the grammar fails
    edit_sample(refused, "json", first["position"], "raw_logprob", lambda _: recomputed)
    failure = verify(refused).failures[0]
    assert failure.position == first["position"], failure.reason
    assert failure.reason == "the request's grammar does not allow token 0 here"


def test_replay_overrides_given_as_one_string_are_one_clear_error():
    """`replay.overrides=notalist` reached the parser character by character ("Error parsing override 'n'")."""
    from omegaconf import OmegaConf

    from toolkit.reproduce.replay import apply_overrides

    with pytest.raises(ConfigError, match="replay.overrides must be a list of key=value strings, got 'notalist'"):
        apply_overrides(OmegaConf.create({"engine": {}}), "notalist")
    cfg = apply_overrides(OmegaConf.create({"engine": {"block_size": 4}}), OmegaConf.create(["engine.block_size=8"]))
    assert cfg.engine.block_size == 8


@pytest.mark.parametrize(
    "override", ["sampling.temperature=0.3", "engine.seed=7", "workload.num_requests=1", "model.generation_config=none"]
)
def test_an_override_the_trace_fixes_is_refused_not_a_bit_identical_replay(recorded_run, tmp_path, override):
    """Each request is re-added with its recorded sampling and resolved seed, so these overrides never reached the
    run: replay.json recorded them and the replay said "bit-identical" (exit 0), as if they changed nothing."""
    with pytest.raises(ConfigError, match="cannot change a replay"):
        replay(recorded_run, overrides=[override], out_dir=tmp_path / "replay")
    assert not (tmp_path / "replay").exists()


@native_only
def test_a_quantised_kv_runs_failure_says_the_difference_is_the_quantisations(tiny, tmp_path):
    """Verify recomputes with K and V in full precision, so an 8-bit KV run differs from it by design (0.002 to 0.87
    nats, docs/kv-cache.md): its failure says so, and how to bound it, where it read as a corrupted run."""
    run = tmp_path / "int8"
    make_run(tiny, run, engine_cfg={**ENGINE_CFG, "kv_cache_dtype": "int8"})
    failed = verify(run, atol=1e-12)
    assert not failed.passed and "this run's KV cache is int8" in failed.summary_line(), failed.summary_line()
    assert failed.to_dict()["kv_cache_dtype"] == "int8"
    passed = verify(run, atol=10.0)
    assert passed.passed and "KV cache" not in passed.summary_line()


def _drop_rows(keep):
    """A samples.parquet change: only the rows `keep(row)` keeps."""
    return lambda table: pa.Table.from_pylist([r for r in table.to_pylist() if keep(r)], schema=table.schema)


def _set_finish(table: pa.Table) -> pa.Table:
    rows = table.to_pylist()
    for r in rows:
        if r["request_id"] == "greedy" and r["finish_reason"] is not None:
            r["finish_reason"] = "stop"
    return pa.Table.from_pylist(rows, schema=table.schema)


@pytest.mark.parametrize(
    "name, change, message",
    [
        ("a sequence's last row", _drop_rows(lambda r: (r["request_id"], r["position"]) != ("greedy", 11)), "rows"),
        ("its last three", _drop_rows(lambda r: not (r["request_id"] == "greedy" and r["position"] >= 9)), "rows"),
        ("a middle row", _drop_rows(lambda r: (r["request_id"], r["position"]) != ("nucleus", 33)), "rows"),
        ("a whole sequence", _drop_rows(lambda r: r["request_id"] != "stop"), "rows"),
        ("a sample row's token", None, r"greedy#0: .* first apart at output token 3"),
        ("requests.parquet's output", None, r"greedy#0: .* first apart at output token 5"),
        ("a finish row's reason", _set_finish, r"greedy#0: its sample row at position 11 says it finished \(stop\)"),
    ],
)
def test_rows_lost_or_a_token_edited_in_one_file_is_refused_not_a_partial_or_passing_trace(
    recorded_run, tmp_path, name, change, message
):
    """A closed run's trace lost rows, or its two files disagree: replay said "bit-identical" (the sequences cut
    short as a partial trace's) and verify passed, both with exit 0; deleting every row of one request went
    unnoticed. Now both refuse it, naming what: summary.json counts the rows the run wrote, and a sequence
    requests.parquet records as ended must be spelled by its sample rows, its finish on its last row."""
    run = copy_run(recorded_run, tmp_path / "run")
    if change is not None:
        _rewrite_parts(run, change)
    elif name == "a sample row's token":
        edit_sample(run, "greedy", 7, "token_id", lambda t: (t + 1) % 49152, outputs=False)
    else:
        edit_outputs(run, "greedy", 9, 3)
    for check in (lambda: replay(run, out_dir=tmp_path / "replay"), lambda: verify(run)):
        with pytest.raises(TraceError, match=message):
            check()


def test_a_killed_runs_ended_sequence_may_stop_short_of_its_outputs_never_disagree(recorded_run, tmp_path):
    """What kill -9 can leave (the writer puts a flush's ended requests on disk before its sample part, and no
    summary.json): an ended sequence whose last rows are lost is compared as partial; a disagreeing token is not."""
    run = copy_run(recorded_run, tmp_path / "run")
    (run / "summary.json").unlink()
    _rewrite_parts(run, _drop_rows(lambda r: not (r["request_id"] == "greedy" and r["position"] >= 9)))
    report = replay(run, out_dir=tmp_path / "replay")
    assert report.identical and report.sequences_unfinished_in_trace == 1, report.summary_line()
    assert verify(run).passed
    edit_sample(run, "greedy", 7, "token_id", lambda t: (t + 1) % 49152, outputs=False)
    with pytest.raises(TraceError, match="greedy#0: .* first apart at output token 3"):
        verify(run)


@pytest.mark.parametrize("how", [{"interrupted": True}, {"failed": "CommitFailed: a digest"}])
def test_a_run_closed_after_ctrl_c_or_a_failure_may_lack_its_last_steps_rows(recorded_run, tmp_path, how):
    """Ctrl-C inside a step, or a failed commit, ends requests whose last step's rows never reached the writer; the
    run still closes with a summary.json (counting the rows on disk) and says replay and verify accept it: they
    do, as a partial trace, where a whole run's summary makes the same gap a refusal."""
    run = copy_run(recorded_run, tmp_path / "run")
    _rewrite_parts(run, _drop_rows(lambda r: (r["request_id"], r["position"]) != ("greedy", 11)))
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "trace_rows": summary["trace_rows"] - 1, **how}))
    report = replay(run, out_dir=tmp_path / "replay")
    assert report.identical and report.sequences_unfinished_in_trace == 1, report.summary_line()
    assert verify(run).passed
    (run / "summary.json").write_text(json.dumps({**summary, "trace_rows": summary["trace_rows"] - 1}))
    with pytest.raises(TraceError, match="greedy#0: requests.parquet records it ended"):
        verify(run)


def test_a_manifests_thread_count_out_of_range_is_refused_not_set(recorded_run, tmp_path):
    """`num_threads: 100000` in manifest.json reached torch.set_num_threads, which segfaults; `num_threads: 0` was
    replaced by torch's default (`... or torch.get_num_threads()`) and the replay ran. Both are refused."""
    for threads in (0, 100_000, True):
        run = copy_run(recorded_run, tmp_path / f"threads-{threads}")
        manifest = json.loads((run / "manifest.json").read_text())
        (run / "manifest.json").write_text(json.dumps({**manifest, "num_threads": threads}))
        with pytest.raises(TraceError, match=f"num_threads {threads!r} is no thread count"):
            replay(run, out_dir=tmp_path / f"threads-{threads}-replay")


@pytest.mark.parametrize("text", ["", "x", "[1, 2]", "model: 3\nengine: {}", "model: {name: tiny}"])
def test_a_config_yaml_without_the_sections_a_run_records_is_refused(recorded_run, tmp_path, text):
    """An empty or non-YAML-mapping config.yaml: verify raised omegaconf's `Missing key model` (a traceback at the
    CLI), replay rebuilt the default engine and blamed the weights."""
    run = copy_run(recorded_run, tmp_path / "run")
    (run / "config.yaml").write_text(text)
    for check in (lambda: replay(run, out_dir=tmp_path / "replay"), lambda: verify(run)):
        with pytest.raises(TraceError, match=r"config.yaml is not a run's config: it has no (model|engine)"):
            check()
    assert not (tmp_path / "replay").exists()


def test_replay_options_of_the_wrong_kind_are_one_clear_error(recorded_run, tmp_path):
    """From the command line: `replay.overrides=5` raised a TypeError, `replay.overrides=[trace.flush_every_steps=0]`
    a ValueError from the trace writer, `replay.overrides=[model=hf]` (a config group, which replaced the recorded
    model section with the string 'hf') a ValueError in the engine, and `replay.allow_mismatch="false"` or `=maybe`
    counted as true."""
    from omegaconf import OmegaConf

    from toolkit.modes.app import run_replay

    def cli(**replay_section):
        cfg = OmegaConf.create({"replay": {"trace": str(recorded_run), **replay_section}, "report": {"auto": False}})
        return run_replay(cfg, tmp_path / "cli")

    with pytest.raises(ConfigError, match="replay.overrides must be a list of key=value strings, got 5"):
        cli(overrides=5)
    with pytest.raises(ConfigError, match=r"trace.flush_every_steps must be an integer in \[1, 64\], got 0"):
        cli(overrides=["trace.flush_every_steps=0"])
    with pytest.raises(ConfigError, match="replay override 'model=hf' replaces the recorded model section"):
        cli(overrides=["model=hf"])
    for value in ("false", "maybe", 1):
        with pytest.raises(ConfigError, match=f"replay.allow_mismatch must be true or false, got {value!r}"):
            cli(allow_mismatch=value)
    with pytest.raises(ConfigError, match="replay.allow_mismatch must be true or false"):
        replay(recorded_run, allow_mismatch="false", out_dir=tmp_path / "api")
    assert not (tmp_path / "cli").exists() and not (tmp_path / "api").exists()


@pytest.mark.parametrize("atol", [float("inf"), float("nan"), 0.0, -1.0, "x", True])
def test_verify_refuses_a_tolerance_that_is_no_positive_finite_number(recorded_run, tmp_path, atol):
    """`verify.atol=inf` (or nan) was taken: every recomputed row passed whatever it recorded."""
    from omegaconf import OmegaConf

    from toolkit.modes.app import run_verify

    with pytest.raises(ConfigError, match="verify.atol must be a positive number or auto"):
        verify(recorded_run, atol=atol)
    cfg = OmegaConf.create({"verify": {"trace": str(recorded_run), "atol": atol}})
    with pytest.raises(ConfigError, match="verify.atol must be a positive number or auto"):
        run_verify(cfg, tmp_path / "cli")


def test_an_unreadable_summary_is_refused_not_read_as_a_killed_runs(recorded_run, tmp_path):
    """summary.json is written whole (atomically): an unreadable one was damaged or edited. It was read as a
    killed run's (none), which switched off the closed run's checks: a trace with its last rows deleted replayed
    "bit-identical" and verified. A missing summary.json is still a killed run's (the test above)."""
    for name, text, match in (
        ("garbage", "x", "summary.json is unreadable or corrupt"),
        ("listed", "[1, 2]", "summary.json is corrupt: a JSON list, not an object"),
    ):
        run = copy_run(recorded_run, tmp_path / name)
        _rewrite_parts(run, _drop_rows(lambda r: not (r["request_id"] == "greedy" and r["position"] >= 9)))
        (run / "summary.json").write_text(text)
        for check in (lambda: replay(run, out_dir=tmp_path / f"{name}-replay"), lambda: verify(run)):
            with pytest.raises(TraceError, match=match):
                check()


def _edit_request_params(run_dir: Path, request_id: str, **changes) -> None:
    for part in sorted((run_dir / REQUESTS_FILE).glob("part-*.parquet")):
        table = pq.read_table(part)
        rows = table.to_pylist()
        for r in rows:
            if r["request_id"] == request_id:
                r["sampling_params"] = json.dumps({**json.loads(r["sampling_params"]), **changes})
        pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), part)


def test_a_sample_rows_policy_other_than_its_requests_is_refused(recorded_run, tmp_path):
    """requests.parquet's temperature edited (the sample rows record another): verify recomputed with the edited
    one and passed. Replay and verify now refuse it, naming the field; so is a sample row's edited top_k."""
    run = copy_run(recorded_run, tmp_path / "params")
    _edit_request_params(run, "nucleus", temperature=0.5)
    for check in (lambda: replay(run, out_dir=tmp_path / "r1"), lambda: verify(run)):
        with pytest.raises(TraceError, match=r"nucleus#0: its sample rows record temperature 0\.8\d*, requests"):
            check()
    run = copy_run(recorded_run, tmp_path / "rows")
    _rewrite_parts(
        run, lambda t: t.set_column(t.schema.get_field_index("top_k"), "top_k", pa.array([7] * len(t), pa.int32()))
    )
    with pytest.raises(TraceError, match="its sample rows record top_k 7, requests.parquet its sampling_params top_k"):
        verify(run)


def test_a_trace_without_sample_rows_is_nothing_to_check_not_a_success(tiny, tmp_path):
    """A run whose every request was rejected (or killed before its first flush) has no sample row: replay said
    "bit-identical: 0 sample rows of 0 sequences" and verify "verified: 0 rows", both exit 0."""
    run = tmp_path / "empty"
    make_run(tiny, run, requests=[])
    with pytest.raises(TraceError, match="holds no sample rows: .* nothing to replay"):
        replay(run, out_dir=tmp_path / "replay")
    with pytest.raises(TraceError, match="holds no sample rows: .* nothing to verify"):
        verify(run)


def test_compare_refuses_what_replay_refuses_and_names_other_weights(recorded_run, tmp_path):
    """mode=compare read the part files itself: a row given twice was "identical (N-1 rows)", a truncated part an
    ArrowInvalid traceback, a garbage summary.json a JSONDecodeError, rows lost under an intact summary a run that
    stopped early; runs of other weights were compared without a word, and long paths cut from the left looked
    alike. Each run is now read as replay reads it."""
    from toolkit.reproduce.compare import compare

    def refused(name: str, edit, match: str) -> None:
        run = copy_run(recorded_run, tmp_path / name)
        edit(run)
        with pytest.raises(TraceError, match=match) as info:
            compare([str(recorded_run), str(run)])
        assert "\n" not in str(info.value)

    refused("twice", lambda run: _rewrite_parts(run, lambda t: pa.concat_tables([t, t.slice(0, 1)])), "more than one")

    def truncate(run: Path) -> None:
        part = next((run / "samples.parquet").glob("part-*.parquet"))
        part.write_bytes(part.read_bytes()[: len(part.read_bytes()) // 2])

    refused("truncated", truncate, "is truncated or corrupt")
    refused("summary", lambda run: (run / "summary.json").write_text("x"), "summary.json is unreadable or corrupt")
    refused(
        "lost",
        lambda run: _rewrite_parts(run, _drop_rows(lambda r: (r["request_id"], r["position"]) != ("greedy", 11))),
        "but the run wrote",
    )
    long = "a-long-directory-name-that-every-run-shares-" * 2
    first, other = tmp_path / "x" / long / "run", tmp_path / "y" / long / "run"
    copy_run(recorded_run, first)
    copy_run(recorded_run, other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "weights_sha256": "ab" * 32}))
    table = compare([str(first), str(other)]).table()
    lines = table.splitlines()
    assert lines[1].startswith(str(first)) and lines[2].startswith(str(other)), table
    assert lines[-1].startswith(f"note: {other} ran other model weights than the first run"), table
    assert "sha256 abababababab... vs" in lines[-1]


def test_compare_refuses_a_summary_figure_of_another_type_before_writing_anything(recorded_run, tmp_path):
    """`"output_tok_per_s": "fast"` in a run's summary.json made mode=compare write compare.json and stop on an
    ArrowInvalid traceback (no compare.parquet, no png); `"ttft_p95_s": [1, 2]` wrote every file and then raised a
    TypeError printing the table. Each is one line naming the file and the field, before any file is written; a
    trace_rows of another type no longer switches replay's and verify's closed-run checks off. An interrupted run's
    summary (NaN a figure, extra keys) still compares, its NaN shown as missing, in compare.parquet's one schema."""
    from toolkit.reproduce.compare import compare

    for key, value, shown in (
        ("output_tok_per_s", "fast", "'fast', not a number"),
        ("ttft_p95_s", [1, 2], "[1, 2], not a number"),
        ("requests", True, "True, not a count"),
    ):
        run = copy_run(recorded_run, tmp_path / key)
        summary = json.loads((run / "summary.json").read_text())
        (run / "summary.json").write_text(json.dumps({**summary, key: value}))
        out = tmp_path / f"{key}-out"
        with pytest.raises(TraceError, match="summary.json is corrupt: ") as info:
            compare([str(recorded_run), str(run)], out_dir=out)
        assert str(info.value) == f"{run / 'summary.json'} is corrupt: {key} is {shown}", info.value
        assert not out.exists() or not any(out.iterdir())
    run = copy_run(recorded_run, tmp_path / "rows")
    _rewrite_parts(run, _drop_rows(lambda r: not (r["request_id"] == "greedy" and r["position"] >= 9)))
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "trace_rows": str(summary["trace_rows"])}))
    for check in (lambda: replay(run, out_dir=tmp_path / "rows-replay"), lambda: verify(run)):
        with pytest.raises(TraceError, match="summary.json is corrupt: trace_rows is '[0-9]+', not a count"):
            check()
    stopped = copy_run(recorded_run, tmp_path / "stopped")
    extra = {"interrupted": True, "signal": "SIGTERM", "failed": None, "newer_field": {"x": [1]}}
    (stopped / "summary.json").write_text(json.dumps({**summary, **extra, "output_tok_per_s": float("nan")}))
    result = compare([str(recorded_run), str(stopped)], out_dir=tmp_path / "out")
    assert result.rows[1]["output_tok_per_s"] is None and result.rows[0]["output_tok_per_s"] > 0
    assert result.table().splitlines()[2].split()[3] == "-", result.table()
    schema = pq.read_schema(tmp_path / "out" / "compare.parquet")
    assert schema.field("output_tok_per_s").type == pa.float64() and schema.field("requests").type == pa.int64()
    assert schema.field("acceptance_rate").type == pa.float64()  # no run speculated: typed all the same
