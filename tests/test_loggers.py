"""The wandb logger's faults: its settings refused in one line before a run is logged, and its service dying
mid-run said once while the run it observes goes on (real wandb, offline, its real service process killed)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from toolkit.errors import ConfigError
from toolkit.modes import MODES
from toolkit.runs.loggers import WandbLogger, check_logger

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("cfg", "named"),
    [
        ({"project": "a/b"}, "logger.project"),  # wandb's UsageError: Invalid project name
        ({"tags": ["x" * 100]}, "logger.tags"),  # wandb: tags must be 1-64 characters
        ({"log_every_steps": "abc"}, "logger.log_every_steps"),
        ({"log_every_steps": 0}, "logger.log_every_steps"),
        ({"mode": "bogus"}, "logger.mode"),
    ],
)
def test_bad_wandb_settings_are_one_line_config_errors(tmp_path, cfg, named):
    with pytest.raises(ConfigError) as caught:
        WandbLogger({"mode": "offline", **cfg}, {"a": 1}, tmp_path / "run", "run-bad-settings")
    message = str(caught.value)
    assert named in message and "\n" not in message


def test_an_unwritable_wandb_directory_is_a_one_line_config_error(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "wandb").write_text("a file where wandb wants its folder")
    with pytest.raises(ConfigError, match="run directory") as caught:
        WandbLogger({"mode": "offline"}, {"a": 1}, run_dir, "run-unwritable")
    assert "\n" not in str(caught.value)


SERVICE_KILLED = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import psutil
    from toolkit.runs.loggers import WandbLogger

    run_dir = Path(sys.argv[1])
    run_dir.mkdir()
    logger = WandbLogger({"mode": "offline"}, {"a": 1}, run_dir, "run-service-killed")
    logger.log_step({"step": 0, "batch_size": 1})
    service = psutil.Process().children(recursive=True)
    assert [p.name() for p in service] == ["wandb-core"], service
    for p in service:
        p.kill()
    psutil.wait_procs(service, timeout=10)
    for step in range(1, 6):
        logger.log_step({"step": step, "batch_size": 1})
    logger.finish({"output_tokens": 5}, [], run_dir)
    assert logger.run is None
    print("the run went on")
    """
)


def test_a_dead_wandb_service_is_said_once_and_the_run_goes_on(tmp_path):
    """Before, the first log_step after wandb-core died raised ConnectionResetError out of the engine loop: a
    40-request run stopped with every request unfinished. Now one line says so, the later steps and the finish
    are no-ops, and wandb's exit hook (which would print a traceback for the dead service) goes with it."""
    done = subprocess.run(
        [sys.executable, "-c", SERVICE_KILLED, str(tmp_path / "run")],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"},  # its own service, not a parent's
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the run went on" in done.stdout
    said = [line for line in done.stderr.splitlines() if line.startswith("toolkit: wandb stopped logging")]
    assert len(said) == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


def _run(*args: str, run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "run.py", *args, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_logger_settings_are_refused_before_the_model_loads(tmp_path):
    """A typo in a logger setting is one line before the model loads: here the model cannot load at all, and the
    logger's error is the one said. Before, wandb.init after the model load was the first to look (a user waited
    for a model load to learn of it)."""
    missing = f"model.path={tmp_path / 'no-model'}"
    for setting, named in [
        ("logger.project=a/b", "logger.project='a/b'"),
        (f"logger.tags=[{'x' * 70}]", "logger.tags="),
        ("logger.log_every_steps=0", "logger.log_every_steps"),
    ]:
        proc = _run("model=hf", missing, "logger=wandb", setting, run_dir=tmp_path / "run")
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.startswith(f"error: {named}") and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    run_dir = tmp_path / "unwritable"
    run_dir.mkdir()
    (run_dir / "wandb").write_text("a file where wandb wants its folder")
    with pytest.raises(ConfigError, match="logger=wandb cannot write in the run directory: .*wandb is not a directory"):
        check_logger({"backend": "wandb"}, "run", run_dir)
    check_logger({"backend": "wandb", "tags": ["a", "b"]}, "run", tmp_path / "fresh" / "run")  # to be made: fine


@pytest.mark.parametrize("mode", sorted(set(MODES) - {"run"}))
def test_a_logger_that_a_mode_would_ignore_is_refused_naming_both(mode):
    """logger=wandb logs mode=run's steps; every other mode ignored it without a word (mode=serve, mode=soak, the
    benchmarks): now one ConfigError naming the logger and the mode. logger=none is every mode's."""
    with pytest.raises(ConfigError) as caught:
        check_logger({"backend": "wandb", "mode": "offline"}, mode)
    message = str(caught.value)
    assert message.startswith("logger=wandb logs mode=run only") and f"mode={mode} would ignore it" in message
    check_logger({"backend": "none"}, mode)


def test_the_cli_refuses_a_logger_its_mode_would_ignore(tmp_path):
    proc = _run("mode=serve", "logger=wandb", run_dir=tmp_path / "run")
    assert proc.returncode == 2 and proc.stderr == (
        "error: logger=wandb logs mode=run only; mode=serve would ignore it (drop logger=wandb, or logger=none)\n"
    ), proc.stderr[-2000:]
