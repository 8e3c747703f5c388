"""SampleTrace rows: Parquet round trip, one row per sampled token, digests, error rows, flushes."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import make_engine
from toolkit.errors import ConfigError
from toolkit.runs.manifest import request_rows
from toolkit.sampling.params import SamplingParams
from toolkit.trace.reader import TraceError, read_requests, read_samples
from toolkit.trace.schema import TRACE_FIELDS, SampleTrace
from toolkit.trace.writer import TraceWriter, logits_digest, sample_rows_table, write_requests

f32 = st.floats(width=32, allow_nan=False)
traces = st.builds(
    SampleTrace,
    request_id=st.text(min_size=1, max_size=12),
    stream=st.integers(0, 7),
    step=st.integers(0, 10**6),
    position=st.integers(0, 10**5),
    token_id=st.integers(-1, 10**5),
    raw_logprob=f32,
    processed_logprob=f32,
    support_size=st.integers(0, 10**5),
    top_raw=st.lists(st.tuples(st.integers(0, 10**5), f32), max_size=4).map(tuple),
    top_processed=st.lists(st.tuples(st.integers(0, 10**5), f32), max_size=4).map(tuple),
    processors=st.lists(st.sampled_from(["top_p(0.9)", "temperature(0.7)", "argmax"]), max_size=3).map(tuple),
    temperature=f32,
    top_k=st.integers(-1, 100),
    top_p=f32,
    min_p=f32,
    seed=st.integers(0, 2**63 - 1),
    noise=st.floats(allow_nan=False),
    batch_size=st.integers(1, 512),
    step_tokens=st.integers(1, 8192),
    finish_reason=st.sampled_from([None, "stop", "length", "error"]),
    stop_reason=st.one_of(st.none(), st.text()),
    error=st.one_of(st.none(), st.text()),
    t_emit_s=st.floats(0, 1e6),
    logits_row=st.just(0),
)


@settings(max_examples=30)
@given(row=traces)
def test_the_engines_row_constructor_is_the_dataclasss(row):
    """SampleTrace.from_fields (what the commit builds a row with, without the frozen __init__) gives the row the
    dataclass gives: equal, same hash and repr, frozen; a missing or unknown field is refused, not a short row."""
    values = dataclasses.asdict(row)
    built = SampleTrace.from_fields(dict(values))
    assert built == row and hash(built) == hash(row) and repr(built) == repr(row)
    assert dataclasses.asdict(built) == values and dataclasses.replace(built, step=1) == dataclasses.replace(
        row, step=1
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.token_id = 7  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"missing \['seed'\]"):
        SampleTrace.from_fields({k: v for k, v in values.items() if k != "seed"})
    with pytest.raises(TypeError, match=r"unknown \['tokenid'\]"):
        SampleTrace.from_fields({**values, "tokenid": 3})


@settings(max_examples=30)
@given(rows=st.lists(traces, min_size=1, max_size=8))
def test_write_read_round_trip_is_identical(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("rt") / "x.parquet"
    digests = [f"{i:064x}" for i in range(len(rows))]
    pq.write_table(sample_rows_table("run", rows, digests), path)
    back = pq.read_table(path).to_pylist()
    for row, rec, digest in zip(rows, back, digests):
        assert rec["logits_sha256"] == digest and rec["run_id"] == "run"
        for name in TRACE_FIELDS:
            want = getattr(row, name)
            if name in ("top_raw", "top_processed"):
                want = [{"token_id": t, "logprob": lp} for t, lp in want]
            elif name == "processors":
                want = list(want)
            assert rec[name] == want, name


MIXED = [
    {
        "prompt_token_ids": [5, 6, 7],
        "request_id": "greedy",
        "sampling_params": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3),
    },
    {
        "prompt_token_ids": list(range(40, 60)),
        "request_id": "topp",
        "arrival_step": 2,
        "sampling_params": SamplingParams(
            temperature=0.8, top_p=0.9, top_k=50, max_tokens=5, seed=3, ignore_eos=True, logprobs=2
        ),
    },
    {
        "prompt_token_ids": [9, 9, 9],
        "request_id": "pair",
        "sampling_params": SamplingParams(
            n=2, temperature=1.0, repetition_penalty=1.2, max_tokens=4, seed=5, ignore_eos=True
        ),
    },
]


def run_traced(engine, requests, run_dir, flush_every_steps=64, beside=False):
    """`beside`: the engine hashes the rows beside its commit and the writer takes those digests."""
    ids = [engine.add_request(**r) for r in requests]
    steps = []
    with TraceWriter(run_dir, "test-run", flush_every_steps) as writer:
        while engine.has_unfinished():
            out = engine.step(trace_digests=beside)
            writer.write_output(out)
            steps.append(out)
    write_requests(run_dir, request_rows(engine, "test-run", ids))
    return ids, steps


@pytest.mark.native
@pytest.mark.parametrize("beside", [False, True])
def test_one_row_per_sampled_token_with_digests(tiny, tmp_path, monkeypatch, beside):
    """Digests hashed by the writer, or by the engine beside its commit (the writer then hashes nothing)."""
    engine = make_engine(tiny, max_num_batched_tokens=8, max_num_seqs=4)
    if beside:

        def refuse(*args, **kwargs):
            raise AssertionError("the writer hashed rows it was given digests for")

        monkeypatch.setattr("toolkit.trace.writer.sha256_rows", refuse)
    ids, steps = run_traced(engine, MIXED, tmp_path, beside=beside)
    assert all((s.logits_sha256 is not None) == (beside and bool(s.samples)) for s in steps)
    table = read_samples(tmp_path)
    rows = table.to_pylist()
    outputs = {(o.request_id, c.index): c for o in map(engine.output, ids) for c in o.outputs}
    assert len(rows) == sum(len(c.token_ids) for c in outputs.values()) == 6 + 5 + 8
    for key, completion in outputs.items():
        mine = [r for r in rows if (r["request_id"], r["stream"]) == key]
        assert [r["token_id"] for r in mine] == list(completion.token_ids)
        assert [r["finish_reason"] for r in mine] == [None] * (len(mine) - 1) + [completion.finish_reason]
        assert mine[-1]["stop_reason"] == "max_tokens"
    # every digest is the sha256 of the raw logits row the token was sampled from
    expected = [logits_digest(s.logits_RV[t.logits_row]) for s in steps for t in s.samples]
    assert [r["logits_sha256"] for r in rows] == expected
    greedy = [r for r in rows if r["request_id"] == "greedy"]
    assert all(len(r["top_raw"]) == 3 and r["top_raw"][0]["token_id"] == r["token_id"] for r in greedy)
    assert all(r["processors"] == ["argmax"] and math.isnan(r["noise"]) for r in greedy)
    topp = [r for r in rows if r["request_id"] == "topp"]
    assert all(r["processors"] == ["temperature(0.8)", "top_k(50)", "top_p(0.9)", "gumbel_max"] for r in topp)
    assert all(1 <= r["support_size"] <= 50 and math.isfinite(r["processed_logprob"]) for r in topp)
    requests = read_requests(tmp_path).to_pylist()
    assert [(r["request_id"], r["stream"]) for r in requests] == [("greedy", 0), ("topp", 0), ("pair", 0), ("pair", 1)]


@pytest.mark.native
def test_step_digests_are_finished_on_first_look_and_written_when_the_next_output_comes(tiny, tmp_path):
    """The engine hashes a step's rows on beside the next step's Python: read before any next step, the digests
    are finished on the spot and are the rows' sha256; TraceWriter.write_output takes a step's rows when the
    next output comes (or at flush), in step order."""
    engine = make_engine(tiny, max_num_batched_tokens=8, max_num_seqs=4)
    for r in MIXED:
        engine.add_request(**r)
    out = engine.step(trace_digests=True)
    rows = {t.logits_row for t in out.samples}
    assert rows and set(out.logits_sha256) == rows
    assert dict(out.logits_sha256) == {i: logits_digest(out.logits_RV[i]) for i in rows}
    writer = TraceWriter(tmp_path, "test-run")
    steps = [engine.step(trace_digests=True) for _ in range(3)]
    writer.write_output(steps[0])
    writer.write_output(steps[1])
    writer.flush()
    assert writer.rows_written == len(steps[0].samples) + len(steps[1].samples)
    writer.write_output(steps[2])
    writer.close()
    table = read_samples(tmp_path).to_pylist()
    assert [(r["request_id"], r["position"]) for r in table] == [
        (t.request_id, t.position) for s in steps for t in s.samples
    ]
    assert [r["logits_sha256"] for r in table] == [
        logits_digest(s.logits_RV[t.logits_row]) for s in steps for t in s.samples
    ]


@pytest.mark.native
def test_empty_support_finishes_only_that_request_with_error(tiny, tmp_path):
    bad = {
        "prompt_token_ids": [1, 2, 3],
        "request_id": "bad",
        # 100 allowed alone, and banned after itself: its second token has no support (intake sees no one-token ban)
        "sampling_params": SamplingParams(allowed_token_ids=[100], bad_words=[[100, 100]], max_tokens=5),
    }
    engine = make_engine(tiny, max_num_batched_tokens=8, max_num_seqs=4)
    run_traced(engine, MIXED[:2] + [bad] + MIXED[2:], tmp_path)
    alone = make_engine(tiny, max_num_batched_tokens=8, max_num_seqs=4)
    for ref in alone.generate(MIXED):
        got = engine.output(ref.request_id)
        assert [(c.token_ids, c.finish_reason) for c in got.outputs] == [
            (c.token_ids, c.finish_reason) for c in ref.outputs
        ]
    out = engine.output("bad")
    assert out.finish_reason == "error" and out.output_token_ids == (100,)
    rows = [r for r in read_samples(tmp_path).to_pylist() if r["request_id"] == "bad"]
    assert [r["token_id"] for r in rows] == [100, -1] and rows[1]["finish_reason"] == "error"
    assert "bad_words" in rows[1]["error"] and engine.block_manager.num_free_blocks == engine.num_kv_blocks


@pytest.mark.native
def test_rows_are_on_disk_after_each_flush(tiny, tmp_path):
    engine = make_engine(tiny, max_num_batched_tokens=4, max_num_seqs=2)
    writer = TraceWriter(tmp_path, "crashy", flush_every_steps=2)
    engine.add_request(
        prompt_token_ids=[1, 2], sampling_params=SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    )
    for _ in range(7):  # 7 steps, 7 tokens: flushed after steps 2, 4, 6 (the writer is never closed)
        out = engine.step()
        writer.write_step(out.samples, out.logits_RV)
    writer._queue.join()
    assert read_samples(tmp_path).num_rows == 6
    writer.close()
    assert read_samples(tmp_path).num_rows == 7


@pytest.mark.native
def test_buffered_rows_count_every_row_not_yet_on_disk(tiny, tmp_path):
    """While a part is being written (held here), the rows behind it wait in the worker's buffer, in hand-offs of
    several steps each on its queue, and in the steps not yet handed off: buffered_rows counts every one of them
    (what bounds a fault's backlog, max_buffered_rows), then they all reach the disk."""
    engine = make_engine(tiny, max_num_batched_tokens=8, max_num_seqs=2)
    writer = TraceWriter(tmp_path, "held", flush_every_steps=2)
    entered, release, write_part = threading.Event(), threading.Event(), writer._write_part

    def held() -> None:
        entered.set()
        release.wait(60)
        write_part()

    writer._write_part = held
    for prompt in ([1, 2], [3, 4, 5]):
        engine.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=9, ignore_eos=True))
    written = 0
    for _ in range(9):
        out = engine.step()
        writer.write_step(out.samples, out.logits_RV)
        written += len(out.samples)
    assert entered.wait(60) and writer._queue.qsize() >= 2  # hand-offs wait behind the held part
    assert writer.buffered_rows == written
    release.set()
    writer.close()
    assert read_samples(tmp_path).num_rows == written


@pytest.mark.native
def test_corrupt_part_is_a_clear_error(tiny, tmp_path):
    engine = make_engine(tiny)
    run_traced(engine, MIXED[:1], tmp_path)
    part = next((tmp_path / "samples.parquet").glob("part-*.parquet"))
    part.write_bytes(part.read_bytes()[:100])
    with pytest.raises(TraceError, match="truncated or corrupt"):
        read_samples(tmp_path)


@pytest.mark.native
def test_side_by_side_sha256_is_hashlibs():
    """The writer hashes a step's rows 16 at a time in C: each digest is hashlib's sha256 of that row,
    for every length of the last block (the 55/56/64-byte padding boundaries), a vocabulary row, row
    counts that leave partial groups of 16, rows picked in any order (repeats too) from a tensor
    whose rows are strided, on one thread or two; an index outside the rows is refused."""
    import hashlib

    import numpy as np

    from toolkit.native.sha import sha256_rows

    rng = np.random.default_rng(0)
    for nbytes in [*range(0, 130), 4 * 49152]:
        for rows in (0, 3, 17) if nbytes < 130 else (33,):
            data = rng.integers(0, 256, (rows, nbytes), dtype=np.uint8)
            assert sha256_rows(data) == [hashlib.sha256(row.tobytes()).hexdigest() for row in data], (nbytes, rows)
    wide = torch.randn(40, 49152 + 7)[:, 3:49155]  # row stride != row length
    index = [39, 0, 5, 5, *range(10, 31)]
    expected = [hashlib.sha256(wide[i].contiguous().numpy()).hexdigest() for i in index]
    for threads in (1, 2):
        assert sha256_rows(wide, index, threads=threads) == expected
    with pytest.raises(IndexError, match="outside the 40 rows"):
        sha256_rows(wide, [0, 40, 1])


@pytest.mark.native
def test_full_logits_and_kept_digest_let_a_trainer_rebuild_the_sampling_mask(tiny, tmp_path):
    """trace.full_logits writes the raw fp32 rows of the asked-for requests (their sha256 is the trace's
    logits digest), and re-applying a row's processors to them gives a kept set whose digest is the trace's
    kept_sha256: the exact mask the token was sampled under (vLLM's "mask replay")."""
    import hashlib

    import numpy as np

    from toolkit.sampling.processors import BatchView, RowState, apply_pipeline

    engine = make_engine(tiny, max_num_batched_tokens=8, max_num_seqs=4)
    ids = [engine.add_request(**r) for r in MIXED]
    steps = []
    with TraceWriter(tmp_path, "test-run", 2, full_logits=["topp", "pair"]) as writer:
        while engine.has_unfinished():
            out = engine.step()
            writer.write_step(out.samples, out.logits_RV)
            steps.append(out)
    write_requests(tmp_path, request_rows(engine, "test-run", ids))
    rows = {(r["request_id"], r["stream"], r["position"]): r for r in read_samples(tmp_path).to_pylist()}
    logits = pq.read_table(tmp_path / "logits.parquet").to_pylist()
    assert {r["request_id"] for r in logits} == {"topp", "pair"}
    assert len(logits) == sum(1 for k in rows if k[0] in ("topp", "pair"))
    requests = {(r["request_id"], r["stream"]): r for r in read_requests(tmp_path).to_pylist()}
    full = hashlib.sha256(np.packbits(np.ones(tiny.arch.vocab_size, bool), bitorder="little").tobytes()).hexdigest()
    partial = 0
    for entry in logits:
        key = (entry["request_id"], entry["stream"], entry["position"])
        raw = torch.tensor(entry["logits"], dtype=torch.float32)
        assert logits_digest(raw) == rows[key]["logits_sha256"]
        req = requests[key[:2]]
        params = next(r["sampling_params"] for r in MIXED if r["request_id"] == key[0])
        history = list(req["prompt_token_ids"]) + list(req["output_token_ids"])[: key[2] - len(req["prompt_token_ids"])]
        view = BatchView((RowState(params, history, len(req["prompt_token_ids"])),), tiny.arch.vocab_size, raw.device)
        kept = torch.isfinite(apply_pipeline(raw[None], view).processed_RV[0]).numpy()
        digest = hashlib.sha256(np.packbits(kept, bitorder="little").tobytes()).hexdigest()
        assert digest == rows[key]["kept_sha256"], key
        partial += digest != full
    assert partial > 0  # top-k / top-p rows have their own masks
    assert all(r["kept_sha256"] == full for k, r in rows.items() if k[0] == "greedy")


@pytest.mark.native
@pytest.mark.parametrize("version", [4, 5])
def test_older_schema_versions_read_with_their_missing_columns_null(tiny, tmp_path, version):
    from toolkit.trace.schema import COMPATIBLE, REQUESTS_SCHEMA, SAMPLES_SCHEMA

    engine = make_engine(tiny, max_num_batched_tokens=8, max_num_seqs=4)
    run_traced(engine, MIXED, tmp_path)
    before = read_samples(tmp_path).drop_columns(["kept_sha256", "noise"])  # (NaN noise never compares equal)
    meta = {b"toolkit_schema_version": str(version).encode()}
    for path, kind in [
        *[(p, "requests") for p in (tmp_path / "requests.parquet").glob("part-*.parquet")],
        *[(p, "samples") for p in (tmp_path / "samples.parquet").glob("part-*.parquet")],
    ]:
        table = pq.read_table(path)
        old = table.drop_columns(list(COMPATIBLE[version][kind])).replace_schema_metadata(meta)
        pq.write_table(old, path)
    samples, requests = read_samples(tmp_path), read_requests(tmp_path)
    assert samples.schema.names == SAMPLES_SCHEMA.names and requests.schema.names == REQUESTS_SCHEMA.names
    assert samples.column("kept_sha256").null_count == samples.num_rows > 0
    assert requests.column("origin_engine").null_count == requests.num_rows
    assert samples.drop_columns(["kept_sha256", "noise"]).to_pylist() == before.to_pylist()  # the rest as written
    part = next((tmp_path / "requests.parquet").glob("part-*.parquet"))
    pq.write_table(pq.read_table(part).replace_schema_metadata({b"toolkit_schema_version": b"3"}), part)
    with pytest.raises(TraceError, match="schema version"):
        read_requests(tmp_path)


FIXTURES = Path(__file__).parent / "data" / "traces"
OLD_LAYOUTS = {  # checked-in runs, each written by the toolkit commit that still wrote that schema (manifest's git_commit)
    "v4": 4,
    "v5": 5,
    "v6": 6,
    "v7-file": 7,  # the last commit whose mode=run wrote requests.parquet and steps.parquet as single files
}


@pytest.mark.parametrize("name", sorted(OLD_LAYOUTS))
def test_every_older_schema_and_layout_still_reads(name):
    """Each older run directory reads through the one reader path: its schema version, the columns it lacked as
    nulls in today's order, the single-file requests and steps, and the report's loader over all of it."""
    from toolkit.report.data import RunData
    from toolkit.trace.reader import read_manifest, read_steps
    from toolkit.trace.schema import COMPATIBLE, REQUESTS_SCHEMA, SAMPLES_SCHEMA

    run_dir, version = FIXTURES / name, OLD_LAYOUTS[name]
    assert read_manifest(run_dir)["schema_version"] == version
    assert (run_dir / "requests.parquet").is_file() and (run_dir / "steps.parquet").is_file()  # the old layout
    samples, requests, steps = read_samples(run_dir), read_requests(run_dir), read_steps(run_dir)
    assert samples.schema.names == SAMPLES_SCHEMA.names and requests.schema.names == REQUESTS_SCHEMA.names
    assert samples.num_rows == 10 and requests.num_rows == 2 and steps is not None and steps.num_rows > 0
    for kind, table in (("samples", samples), ("requests", requests)):
        for column in COMPATIBLE.get(version, {}).get(kind, ()):
            assert table.column(column).null_count == table.num_rows, (kind, column)
    lengths = {r["request_id"]: len(r["output_token_ids"]) for r in requests.to_pylist()}
    assert sorted(lengths.values()) == [5, 5] and sum(lengths.values()) == samples.num_rows
    assert sum(steps.column("sampled").to_pylist()) == samples.num_rows
    run = RunData.read(run_dir)
    assert run.rows == 10 and run.steps is not None and len(run.steps["step"]) == steps.num_rows


@pytest.mark.native
@pytest.mark.parametrize("name", ["v4", "v7-file"])  # the oldest schema and the last single-file layout (v5, v6: read)
def test_older_runs_replay_with_todays_engine(name, tmp_path):
    """Replay rebuilds each older run from its own config.yaml and requests and compares every row: bit for bit
    where this machine computes as the recording did (native kernels of the same lanes and FMA, here AVX2's 8);
    elsewhere (an AVX-512 build, the kernels off) the replay refuses by default, naming the difference, and with
    allow_mismatch still reads every row and says where they part."""
    from toolkit import replay

    try:
        report = replay(FIXTURES / name, out_dir=tmp_path / "replay")
    except TraceError as exc:
        assert "refusing to replay" in str(exc) and "differ" in str(exc)
        print(f"{name}: {exc}")
        report = replay(FIXTURES / name, out_dir=tmp_path / "anyway", allow_mismatch=True)
        assert report.rows_compared >= 1, report.summary_line()
        return
    assert report.identical and report.rows_compared == 10, report.summary_line()


@pytest.mark.native
def test_a_run_whose_step_fails_keeps_its_rows_and_says_so(tiny, tmp_path):
    """The one recorder under a failing step: the step's error is the one raised; the rows traced before it are on
    disk, every request has a row (the unfinished as they stood), summary.json says the run failed. A run that
    asks for no sample rows leaves no samples.parquet/ (which compare and the report take for a trace)."""
    from toolkit.runs.session import record
    from toolkit.trace.reader import read_steps

    engine = make_engine(tiny, max_num_batched_tokens=8, max_num_seqs=4)
    ids = [engine.add_request(**r) for r in MIXED]
    seen = []

    def fail_third(out):
        seen.append(out)
        if len(seen) == 3:
            raise RuntimeError("a step failed here")

    with pytest.raises(RuntimeError, match="a step failed here"):
        record(
            engine, ids, tmp_path / "run", {"trace": {"full_logits": "all"}}, flush_every_steps=1, on_step=fail_third
        )
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["failed"] == "RuntimeError: a step failed here"
    rows = read_samples(run)
    assert rows.num_rows == sum(len(o.samples) for o in seen) > 0
    requests = read_requests(run)
    assert sorted(set(requests.column("request_id").to_pylist())) == sorted(ids)
    assert None in requests.column("finish_reason").to_pylist()  # unfinished when it failed
    assert read_steps(run).num_rows == 3
    assert not (run / "logits.parquet").exists()  # record's full_logits governs (off), not the config's
    assert not (run / "requests.open.parquet").exists()  # every request has its final row

    untraced = make_engine(tiny, max_num_batched_tokens=8, max_num_seqs=4)
    record(untraced, [untraced.add_request(**r) for r in MIXED], tmp_path / "untraced", {}, trace=False)
    assert not (tmp_path / "untraced" / "samples.parquet").exists() and read_requests(tmp_path / "untraced").num_rows


def test_request_rows_without_an_arrival_keep_the_order_written(tmp_path):
    """A converted transcript's rows (no arrival_index) come back as written: a request's streams together."""
    from toolkit.trace.schema import REQUESTS_SCHEMA

    rows = [{"request_id": r, "stream": s, "run_id": "x"} for r in ("b", "a") for s in (0, 1)]
    write_requests(tmp_path, rows)
    got = read_requests(tmp_path).select(["request_id", "stream"]).to_pylist()
    assert got == [{"request_id": r["request_id"], "stream": r["stream"]} for r in rows]
    assert read_requests(tmp_path).schema.names == REQUESTS_SCHEMA.names


@pytest.mark.native
def test_the_largest_top_k_a_request_may_ask_for_is_traced(tiny, tmp_path):
    """Every top_k SamplingParams takes fits the trace's column: 2^31 - 1 runs and reads back (2^31 is refused
    on construction; it once passed, and the trace writer failed at its next flush, and the server with it)."""
    from toolkit.sampling.params import MAX_TOP_K

    assert MAX_TOP_K == 2**31 - 1
    with pytest.raises(ConfigError, match="top_k"):
        SamplingParams(top_k=MAX_TOP_K + 1)
    engine = make_engine(tiny, max_num_batched_tokens=8, max_num_seqs=2)
    huge = {
        "prompt_token_ids": [1, 2, 3],
        "request_id": "huge",
        "sampling_params": SamplingParams(top_k=MAX_TOP_K, seed=1, max_tokens=3),
    }
    run_traced(engine, [huge], tmp_path)
    rows = read_samples(tmp_path).to_pylist()
    assert len(rows) == 3 and {r["top_k"] for r in rows} == {MAX_TOP_K}


@pytest.mark.native
def test_a_run_directory_that_cannot_be_written_is_one_line_before_any_step(tiny, tmp_path):
    """A file where the run directory goes (or a full or read-only disk) stops a run before its first step with
    one line (exit 74), where the OSError's traceback came out of Hydra's mode."""
    from toolkit.runs.session import record
    from toolkit.trace.writer import TraceWriteError

    (tmp_path / "a-file").write_text("not a directory")
    engine = make_engine(tiny)
    ids = [engine.add_request(prompt_token_ids=[1, 2], sampling_params=SamplingParams(max_tokens=2))]
    with pytest.raises(TraceWriteError, match="cannot write the run directory .*a-file/run") as info:
        record(engine, ids, tmp_path / "a-file" / "run", {}, flush_every_steps=4)
    assert info.value.exit_code == 74 and "\n" not in str(info.value)
    assert engine.step_index == 0


SUMMARY_VALUES = {
    "a count": st.integers(0, 2**63 - 1),
    "a number": st.integers(-(2**53), 2**53) | st.floats(),  # NaN and Infinity too: Python's json writes them
    "a string": st.text(),
    "true or false": st.booleans(),
    "a list of strings": st.lists(st.text(), max_size=3),
}
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
WRONG_VALUES = {
    "a count": ["12", 1.0, True, -1, 2**63, [1], {}],
    "a number": ["fast", True, False, [1, 2], {"p": 1}, 10**400],
    "a string": [1, 2.5, True, [], {}],
    "true or false": ["yes", 1, 0, [], "false"],
    "a list of strings": ["a", 5, [1], [None], {}],
}


def _summary():
    from toolkit.trace.reader import SUMMARY_FIELDS

    checked = st.fixed_dictionaries(
        {}, optional={key: st.none() | SUMMARY_VALUES[kind] for key, kind in SUMMARY_FIELDS.items()}
    )
    extra = st.dictionaries(st.text().filter(lambda k: k not in SUMMARY_FIELDS), JSON_VALUES, max_size=4)
    return st.tuples(checked, extra).map(lambda t: {**t[1], **t[0]})


@settings(max_examples=150, deadline=None)
@given(_summary())
def test_a_summary_whose_fields_have_their_types_reads_back_as_written(tmp_path_factory, summary):
    """Every field a reader uses, of its type or null (NaN and Infinity among numbers), beside any other keys (a
    newer writer's, an interrupted or failed run's `interrupted`, `signal`, `failed`): read as written."""
    from toolkit.trace.reader import read_summary

    run = tmp_path_factory.mktemp("summary")
    (run / "summary.json").write_text(json.dumps(summary))
    assert json.dumps(read_summary(run), sort_keys=True) == json.dumps(summary, sort_keys=True)


@settings(max_examples=150, deadline=None)
@given(_summary(), st.data())
def test_a_summary_field_of_another_type_is_refused_naming_the_file_and_the_field(tmp_path_factory, summary, data):
    """A figure or count of another type in summary.json (`"output_tok_per_s": "fast"`, `"ttft_p95_s": [1, 2]`) was
    read as it stood: mode=compare wrote compare.json and then stopped on an ArrowInvalid or a TypeError traceback;
    a `trace_rows` of another type switched the closed-run checks of replay and verify off. Now a TraceError
    (docs/errors.md row 70) names the file and the field before anything reads on."""
    from toolkit.trace.reader import SUMMARY_FIELDS, read_summary

    key = data.draw(st.sampled_from(sorted(SUMMARY_FIELDS)))
    value = data.draw(st.sampled_from(WRONG_VALUES[SUMMARY_FIELDS[key]]))
    run = tmp_path_factory.mktemp("summary")
    (run / "summary.json").write_text(json.dumps({**summary, key: value}))
    with pytest.raises(TraceError, match=f"summary.json is corrupt: {key} is .*, not {SUMMARY_FIELDS[key]}$") as info:
        read_summary(run)
    assert str(run / "summary.json") in str(info.value) and "\n" not in str(info.value)


def test_an_interrupted_or_failed_runs_summary_reads(tmp_path):
    from toolkit.trace.reader import read_summary

    for extra in (
        {"interrupted": True, "signal": "SIGTERM"},
        {"failed": "CommitFailed: a digest", "served": True, "rejected": 2, "rejected_requests": ["a", "b"]},
    ):
        summary = {"requests": 3, "output_tokens": 7, "trace_rows": 7, "ttft_p50_s": None, "wall_s": 0.5, **extra}
        (tmp_path / "summary.json").write_text(json.dumps(summary))
        assert read_summary(tmp_path) == summary
