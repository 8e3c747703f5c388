"""`python run.py ...` end to end: run directory contents, bad input as one-line errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from toolkit.trace.reader import read_requests

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny", "print_outputs=false"]


def run_cli(*args: str, run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "run.py", *args, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


@pytest.mark.native
def test_requests_file_with_bad_lines_runs_the_others(tmp_path):
    requests = write_jsonl(
        tmp_path / "reqs.jsonl",
        [
            {"id": "a", "prompt": "Hello there", "max_tokens": 5},
            '{"id": "b", "prompt": ',  # malformed JSON
            {
                "id": "c",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
                "arrival_step": 2,
                "sampling": {"temperature": 0.0},
            },
            {"id": "d", "prompt": "", "max_tokens": 4},  # empty prompt
            {"id": "e", "prompt_token_ids": [1, 2, 3], "max_tokens": 0},  # bad max_tokens
            {"id": "f", "prompt": "x " * 3000},  # longer than the context
        ],
    )
    result = run_cli(*TINY, f"workload.requests={requests}", run_dir=tmp_path / "run")
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("rejected:")]
    assert len(errors) == 4
    assert "reqs.jsonl line 2" in errors[0] and "malformed JSON" in errors[0]
    assert any("line 4" in e and "empty" in e for e in errors)
    assert any("line 5" in e and "max_tokens" in e for e in errors)
    assert any("line 6" in e and "context" in e for e in errors)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in (
        "requests",
        "output_tokens",
        "wall_s",
        "output_tok_per_s",
        "ttft_p50_s",
        "ttft_p95_s",
        "tpot_p50_s",
        "tpot_p95_s",
    ):
        assert key in summary
    assert summary["requests"] == 2 and summary["output_tokens"] == 9
    requests = read_requests(tmp_path / "run").to_pylist()
    assert [r["request_id"] for r in requests] == ["a", "c"]
    assert [len(r["output_token_ids"]) for r in requests] == [5, 4]
    samples = pq.read_table(tmp_path / "run" / "samples.parquet")
    assert samples.num_rows == 9 and summary["trace_rows"] == 9


@pytest.mark.parametrize(
    "args, message",
    [
        (["model=hf", "model.path=/nonexistent/model"], "model path '/nonexistent/model' does not exist"),
        (["workload.requests=/nonexistent/reqs.jsonl"], "requests file '/nonexistent/reqs.jsonl' does not exist"),
        (["engine.block_size=0"], "engine.block_size must be a positive integer, got 0"),
        (["sampling.temperature=-2"], "temperature must be 0 (greedy) or a number"),
        (["trace.flush_every_steps=0"], "trace.flush_every_steps must be an integer in [1, 64], got 0"),
        (["trace.enabled=maybe"], "trace.enabled must be true or false, got 'maybe'"),
        (["engine.kv_cache_memory_gb=inf"], "engine.kv_cache_memory_gb must be a finite positive number, got inf"),
        (["engine.kv_cache_memory_gb=1e9"], "engine.kv_cache_memory_gb=1e+09 is more than the"),
        (["model.rope_theta=-1"], "model.rope_theta must be a positive number, got -1"),  # was NaN logits, exit 0
        (["model.num_layers=1000000"], "GB of fp32 weights, more than this machine's"),  # a traceback, after GBs
        pytest.param(
            ["engine.device=mps"],
            "engine.device=mps but this torch build cannot use MPS",
            marks=pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS"),
        ),
    ],
)
def test_user_mistakes_are_one_line_errors(tmp_path, args, message):
    result = run_cli(*TINY, *args, run_dir=tmp_path / "run")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


def test_incomplete_model_dir_is_refused(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    result = run_cli(*TINY, "model=hf", f"model.path={tmp_path / 'model'}", run_dir=tmp_path / "run")
    assert result.returncode == 2 and "no *.safetensors" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.native
@pytest.mark.slow
def test_default_run_serves_the_builtin_chat_workload(tmp_path):
    """What `make run` runs, with fewer requests: SmolLM2, chat template, staggered arrivals."""
    result = run_cli(
        "workload.num_requests=4", "workload.min_tokens=4", "workload.max_tokens=12", run_dir=tmp_path / "run"
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["requests"] == 4 and summary["output_tok_per_s"] > 0
    assert "output_tok_per_s" in result.stdout and "--- chat-0" in result.stdout


def test_bad_builtin_workload_options(tmp_path):
    result = run_cli(*TINY, "workload.min_tokens=20", "workload.max_tokens=10", run_dir=tmp_path / "run")
    assert result.returncode == 2 and "workload.min_tokens (20) must be <= workload.max_tokens (10)" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.native
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_flushes_the_trace_writes_the_summary_and_exits_as_the_signal(tmp_path, signame):
    """Ctrl-C, or SIGTERM as `timeout`, Slurm and `docker stop` send it: the trace flushed, the summary written (it
    names the signal), exit 128 + the signal's number, and the partial run replays. SIGTERM killed the run with up
    to a flush of rows unwritten and no summary."""
    import json
    import signal
    import time

    from toolkit.trace.reader import read_samples

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "run.py"),
            "model=tiny",
            "workload.num_requests=40",
            "workload.min_tokens=200",
            "workload.max_tokens=400",
            "print_outputs=false",
            "trace.flush_every_steps=4",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a suite started in the background (nohup, &) passes SIGINT down as ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 120
    while not list((run_dir / "samples.parquet").glob("part-*.parquet")) and time.time() < deadline:
        time.sleep(0.2)
    sent = signal.Signals[signame]
    proc.send_signal(sent)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sent, err[-1500:]
    assert "interrupted at step" in err and f"({signame})" in err and "Traceback" not in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["signal"] == signame and summary["trace_rows"] > 0
    assert read_samples(run_dir).num_rows == summary["trace_rows"]  # every written row readable
    from toolkit import replay

    report = replay(run_dir, out_dir=tmp_path / "replay")  # a partial run replays its rows
    assert report.identical, report.summary_line()


@pytest.fixture
def sigint_default():
    """Python's own SIGINT handler for the test: a suite started in the background (nohup, &) inherits SIGINT
    as ignored, and record() leaves a handler it did not expect alone."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.native
def test_ctrl_c_is_taken_between_steps_never_inside_one(tiny, tmp_path, sigint_default):
    """SIGINT while a step's work is under way lets that step finish (its callback runs to the end, its rows reach
    the trace) and stops before the next: a KeyboardInterrupt raised mid-step could land inside the trace
    writer's queue and hang close() (seen once in a suite run). A second SIGINT interrupts at once."""
    import os
    import signal

    from tests.conftest import make_engine
    from toolkit.errors import Interrupted
    from toolkit.runs.session import record
    from toolkit.sampling.params import SamplingParams
    from toolkit.trace.reader import read_samples

    engine = make_engine(tiny, max_num_batched_tokens=32, max_num_seqs=4, num_kv_blocks=128)
    ids = [
        engine.add_request(
            prompt_token_ids=[5 + i, 6, 7],
            sampling_params=SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True),
        )
        for i in range(3)
    ]
    seen = []

    def on_step(out):
        if out.step == 3:
            os.kill(os.getpid(), signal.SIGINT)
        seen.append(out.step)  # reached after the signal: the step is not cut short

    try:  # a caller's `except Exception` (a notebook's retry loop around LLM.generate) must not swallow Ctrl-C
        record(engine, ids, tmp_path / "run", {}, on_step=on_step, flush_every_steps=2)
    except Exception as exc:  # noqa: BLE001 - the failure this guards against
        pytest.fail(f"Ctrl-C became an Exception a caller's `except Exception` swallows: {exc!r}")
    except KeyboardInterrupt as exc:
        assert isinstance(exc, Interrupted) and "interrupted at step 4" in str(exc), exc
    else:
        pytest.fail("SIGINT did not stop the run")
    assert seen == [0, 1, 2, 3]
    assert max(read_samples(tmp_path / "run")["step"].to_pylist()) == 3  # step 3's rows are in the trace
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    # nothing finished (50 tokens a request, stopped at step 4): the wall time runs from the first admission to
    # the stop, not to a finish time of 0.0 (that gave -6782.6 s)
    assert 0.0 < json.loads((tmp_path / "run" / "summary.json").read_text())["wall_s"] < 600

    def twice(out):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the user insists: out at once, in the callback
        seen.append("not reached")

    engine = make_engine(tiny, max_num_batched_tokens=32, max_num_seqs=4, num_kv_blocks=128)
    ids = [
        engine.add_request(prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(temperature=0.0, max_tokens=20))
    ]
    with pytest.raises(Interrupted):
        record(engine, ids, tmp_path / "run2", {}, on_step=twice)
    assert "not reached" not in seen


@pytest.mark.native
def test_kill_9_leaves_a_readable_partial_trace_that_replays_and_verifies(tmp_path):
    import signal
    import time

    from toolkit import replay, verify
    from toolkit.trace.reader import read_samples

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "run.py"),
            "model=tiny",
            "workload.num_requests=40",
            "workload.min_tokens=200",
            "workload.max_tokens=400",
            "print_outputs=false",
            "trace.flush_every_steps=4",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while len(list((run_dir / "samples.parquet").glob("part-*.parquet"))) < 3 and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    rows = read_samples(run_dir).num_rows  # every part on disk is whole
    assert rows > 0 and not (run_dir / "summary.json").exists()
    report = replay(run_dir, out_dir=tmp_path / "replay")
    assert report.identical and report.rows_compared == rows, report.summary_line()
    assert verify(run_dir).rows_checked == rows


def test_help_lists_every_mode_with_one_line_and_each_is_dispatched(tmp_path):
    from toolkit.modes import MODES
    from toolkit.modes.app import RUNNERS, runner

    assert list(RUNNERS) == list(MODES)  # a listed mode that run.py does not run (or the reverse) fails here
    assert all(callable(runner(m)) for m in MODES)  # every "module:function" names one that exists
    readme = [
        line.split("|")[1].strip().strip("`")
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("| `")
    ]
    assert readme == list(MODES)  # the README's table lists the same modes, in the same order
    for argv in (["run.py", "--help"], ["-m", "toolkit", "--help"]):
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        listed = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  ")]
        assert listed == list(MODES) and all(len(line) <= 120 for line in proc.stdout.splitlines())
    # the soak's line as soak.py has it (it said "hours of mixed load on the server": the default soak drives the
    # engine in-process for soak.duration_s, an option it requires; the server is soak.over=http)
    from toolkit.errors import ConfigError
    from toolkit.modes.soak import ENGINE_CHECKS, HTTP_CHECKS, check_options

    named = set(re.findall(r"soak\.(\w+)", MODES["soak"]))
    assert {"duration_s", "over"} <= named <= {*ENGINE_CHECKS, *HTTP_CHECKS, "over"}
    assert "server" not in MODES["soak"].split("soak.over=http")[0]
    with pytest.raises(ConfigError, match="soak.duration_s is required"):
        check_options({}, "engine")
    proc = subprocess.run([sys.executable, "-m", "toolkit", "mode=run"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr == (  # not the run it looks like: one line saying where runs go
        "error: python -m toolkit only lists the modes; a run goes through run.py: python run.py mode=run\n"
    )
    proc = run_cli("mode=bogus", run_dir=tmp_path)  # a mode that does not exist: one line naming them all
    assert proc.returncode != 0 and "unknown mode 'bogus'" in proc.stderr and all(m in proc.stderr for m in MODES)
    assert "Traceback" not in proc.stderr


def test_a_mode_missing_its_extra_is_one_line_naming_the_extra():
    """mode=serve without FastAPI installed (here: hidden from the import system) is a ConfigError naming the extra
    to install, not an ImportError traceback; a mode whose module imports fine is returned as is."""
    code = (
        "import sys; sys.modules['fastapi'] = None\n"
        "from toolkit.errors import ConfigError\nfrom toolkit.modes.app import runner\n"
        "assert callable(runner('run'))\n"
        "try:\n    runner('serve')\nexcept ConfigError as exc:\n    print(exc)\nelse:\n    print('no error')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith("mode=serve needs fastapi, in the serve extra: pip install -e '.[serve]'")
