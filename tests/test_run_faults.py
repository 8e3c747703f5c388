"""Faults around a recorded run that are not the engine's: a trace part the disk refuses, a signal from a job
scheduler, a run directory Hydra cannot write, a sweep with a failing job. Each is survived and said: the trace's
rows on disk before anything optional, summary.json naming the failure, one line and the documented exit code."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import make_engine
from tests.test_trace import MIXED
from toolkit.trace.reader import read_samples

pytestmark = pytest.mark.native
ROOT = Path(__file__).resolve().parents[1]


def test_a_refused_logits_part_loses_no_sample_row_and_the_summary_says_why(tiny, tmp_path):
    """trace.full_logits' part is optional and large; the sample rows are the trace. With the logits' directory
    unwritable (a file in its place), every sample row is still on disk, the run fails with the writer's error,
    and summary.json names it beside the rows it holds."""
    from toolkit.runs.session import record
    from toolkit.trace.writer import TraceWriteError

    run = tmp_path / "run"
    run.mkdir()
    (run / "logits.parquet").write_text("a file where the logits' parts go")
    engine = make_engine(tiny, max_num_batched_tokens=8, max_num_seqs=4)
    ids = [engine.add_request(**r) for r in MIXED]
    with pytest.raises(TraceWriteError, match="trace writer failed"):
        record(engine, ids, run, {}, flush_every_steps=64, full_logits="all")
    outputs = [engine.output(i) for i in ids]
    summary = json.loads((run / "summary.json").read_text())
    assert "closing the trace" in summary["failed"] and "logits.parquet" in summary["failed"], summary["failed"]
    rows = read_samples(run)
    assert rows.num_rows == summary["trace_rows"] == sum(len(c.token_ids) for o in outputs for c in o.outputs) > 0


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def test_a_sweep_runs_every_job_and_names_each_failed_one(tmp_path):
    """A multirun whose first job's config is refused: the other job still runs to its trace (a job's sys.exit
    ended the sweep there, and under joblib killed the jobs beside it), each job's code is in its job.json, the
    failed one is named with its overrides on stderr, and the sweep exits 1."""
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "model=tiny",
        "workload.num_requests=2",
        "workload.min_tokens=1",
        "workload.max_tokens=4",
        "print_outputs=false",
        "plots=false",
        "report.auto=false",
        "engine.max_num_batched_tokens=0,64",
        f"hydra.sweep.dir={sweep}",
    ]
    proc = _run(args, tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    codes = {int(d.name): json.loads((d / "job.json").read_text())["exit_code"] for d in sweep.iterdir() if d.is_dir()}
    assert codes == {0: 2, 1: 0}
    assert (sweep / "1" / "summary.json").exists() and read_samples(sweep / "1").num_rows > 0
    named = [line for line in proc.stderr.splitlines() if line.startswith("sweep: job ")]
    assert len(named) == 1 and "engine.max_num_batched_tokens=0" in named[0] and "exit 2" in named[0], named
    assert "sweep: 1 of 2 jobs failed" in proc.stderr and "Traceback" not in proc.stderr
    # the same sweep again into the same directory: each job is refused (its directory holds a run), and each is
    # named, though the older job.json files said 0 (a reused directory's jobs were filtered out: exit 0)
    again = _run(args, tmp_path)
    assert again.returncode == 1 and "sweep: 2 of 2 jobs failed" in again.stderr, again.stderr[-2000:]


def test_ctrl_c_in_a_sweeps_job_stops_the_sweep(tmp_path):
    """Ctrl-C (or SIGTERM) in a job ends the sweep there, with the job's code: the next job does not start."""
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), "-m", "model=tiny", "workload.num_requests=40"]
        + ["workload.min_tokens=200", "workload.max_tokens=400", "print_outputs=false", "trace.flush_every_steps=4"]
        + ["engine.max_num_seqs=8,16", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a suite in the background ignores it
    )
    deadline = time.time() + 120
    while not list((sweep / "0" / "samples.parquet").glob("part-*.parquet")) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert json.loads((sweep / "0" / "job.json").read_text())["exit_code"] == 130
    assert not (sweep / "1").exists() and "Traceback" not in err


def test_a_run_directory_holding_a_run_or_unwritable_is_refused_before_hydra_writes_in_it(tmp_path):
    """hydra.run.dir at an earlier run: one line (errors.md row 55), and that run's .hydra/ provenance as it was
    (Hydra rewrote it before the toolkit's check ran). A file in its place: one line, exit 74 (row 57), where
    Hydra's own traceback came first."""
    earlier = tmp_path / "earlier"
    (earlier / ".hydra").mkdir(parents=True)
    (earlier / "manifest.json").write_text("{}")
    (earlier / ".hydra" / "overrides.yaml").write_text("- the earlier run's overrides\n")
    proc = _run(["model=tiny", f"hydra.run.dir={earlier}"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().endswith("(or remove that one)"), proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "already holds a run" in proc.stderr
    assert (earlier / ".hydra" / "overrides.yaml").read_text() == "- the earlier run's overrides\n"
    assert not (earlier / "run.log").exists()

    (tmp_path / "a_file").write_text("not a directory")
    for where in (tmp_path / "a_file", tmp_path / "a_file" / "run"):
        proc = _run(["model=tiny", f"hydra.run.dir={where}"], tmp_path)
        assert proc.returncode == 74, proc.stderr[-2000:]
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: cannot write the run directory")


def test_mode_serve_at_an_address_it_cannot_take_says_so_in_one_line_before_loading(tmp_path):
    """A port in use, a host that does not resolve: one line naming serve.host and serve.port, exit 2, before the
    model loads (uvicorn said so in its own words after the "serving at" line, exit 3)."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        for host, why in (("127.0.0.1", "in use"), ("256.1.1.1", "")):
            proc = _run(["mode=serve", "model=tiny", f"serve.host={host}", f"serve.port={port}"], tmp_path)
            assert proc.returncode == 2, proc.stderr[-2000:]
            assert proc.stderr.count("\n") == 1 and "serving" not in proc.stderr, proc.stderr
            assert proc.stderr.startswith(f"error: serve.host={host} serve.port={port}: cannot listen there: ")
            assert why in proc.stderr
    finally:
        taken.close()


def test_full_logits_naming_a_request_the_run_has_not_is_one_line(tmp_path):
    """trace.full_logits=[ghost]: a typo'd request id wrote no logits and said nothing; now one line naming it."""
    proc = _run(
        ["model=tiny", "workload.num_requests=2", "workload.min_tokens=1", "workload.max_tokens=4"]
        + ["trace.full_logits=[ghost]", f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: trace.full_logits names request ids this run has not: ghost (its ids: ")
