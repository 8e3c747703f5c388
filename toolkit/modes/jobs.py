"""What Hydra does around a run's job, where the toolkit answers first or last (conf/config.yaml registers `Jobs`
under hydra.callbacks):

- **Before Hydra writes the run directory** (`on_run_start`): a directory that already holds a run, or that cannot
  be written, is refused in one line with the documented exit code (errors.md rows 55 and 57). Hydra writes
  `.hydra/` and `run.log` there before any of the toolkit's code runs: it overwrote the earlier run's
  provenance, or died with its own traceback.
- **A sweep's jobs each end with a code** (`job_ended`, which run.py calls): a single run exits with it; a job of
  a multirun writes it to `job.json` in its directory and returns, so that one job's failure (a refused config,
  a rejected request, a diverging replay) does not end the sweep: `sys.exit` inside a job stopped every job
  after it, and under joblib killed the others mid-run.
- **After the sweep** (`on_multirun_end`): every failed job named in one line each, the sweep's exit code 1 when
  any failed (`sweep_exit_code`, which run.py exits with)."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from toolkit.errors import ToolkitError, one_line
from toolkit.runs.recorder import holds_run
from toolkit.trace.writer import TraceWriteError

JOB_FILE = "job.json"  # a multirun job's exit code and overrides, in its run directory
RECORDING_MODES = ("run", "serve", "replay")  # the modes that record a run into Hydra's run directory
STOPPED = (130, 143)  # a job's exit code after Ctrl-C or SIGTERM (toolkit.runs.session)
_failed_jobs: list[dict[str, Any]] = []  # the last sweep's, for run.py's exit code


def check_run_dir(run_dir: Path, mode: str) -> None:
    """A ConfigError where a recording mode's `run_dir` already holds a run; a TraceWriteError where it cannot be
    made or written (a file in its place, a read-only disk), as `record` says it."""
    if mode in RECORDING_MODES:
        holds_run(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as exc:
        raise TraceWriteError(
            f"cannot write the run directory {run_dir}: {one_line(exc)} (choose another hydra.run.dir)"
        ) from None


def job_ended(run_dir: Path, code: int, multirun: bool, num: int, overrides: list[str]) -> None:
    """A job's end: a single run exits with `code`; a multirun's job records it in its directory and returns."""
    if not multirun:
        if code:
            sys.exit(code)
        return
    record = {"num": num, "exit_code": int(code), "overrides": list(overrides)}
    try:
        (run_dir / JOB_FILE).write_text(json.dumps(record))
    except OSError as exc:  # the sweep names it still: a job that recorded no end
        print(f"toolkit: job {num}: {JOB_FILE} not written: {one_line(exc)}", file=sys.stderr)
    if code in STOPPED:  # Ctrl-C or SIGTERM stops the sweep, not only its job
        sys.exit(code)


def sweep_exit_code() -> int:
    """1 where a job of the sweep that just ended failed, else 0."""
    return 1 if _failed_jobs else 0


def sweep_jobs(sweep_dir: Path, since: float) -> list[dict[str, Any]]:
    """Each job under `sweep_dir` that this sweep ran, since `since` (Hydra rewrites a job's .hydra/hydra.yaml as it
    starts it: a reused sweep directory's older jobs are not this sweep's): its num, overrides and exit code, None
    where it recorded no end since (killed; a job.json older than that is an earlier sweep's), its directory."""
    found = []
    for hydra_dir in sorted(sweep_dir.rglob(".hydra"), key=str):
        job_dir = hydra_dir.parent
        if _mtime(hydra_dir / "hydra.yaml") < since - 1:
            continue
        try:
            record = json.loads((job_dir / JOB_FILE).read_text()) if _mtime(job_dir / JOB_FILE) >= since - 1 else None
        except (OSError, ValueError):
            record = None
        if not isinstance(record, dict):
            record = {"num": job_dir.name, "exit_code": None, "overrides": _overrides(hydra_dir)}
        found.append({**record, "dir": str(job_dir)})
    return found


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return float("-inf")


def _overrides(hydra_dir: Path) -> list[str]:
    try:
        return list(OmegaConf.load(hydra_dir / "overrides.yaml"))
    except Exception:  # noqa: BLE001 - a damaged file names nothing; the job is still reported
        return []


class Jobs(Callback):
    """hydra.callbacks.jobs: the run directory checked before Hydra writes it; a sweep's failed jobs named."""

    def __init__(self) -> None:
        self.started = time.time()

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            run_dir = Path(str(config.hydra.run.dir))
        except Exception:  # noqa: BLE001 - a dir only run_job resolves (${hydra:...}): record() checks it then
            return
        try:
            check_run_dir(run_dir, str(config.get("mode", "run")))
        except ToolkitError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(exc.exit_code)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.time()
        _failed_jobs.clear()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            jobs = sweep_jobs(sweep_dir, self.started) if sweep_dir.is_dir() else []
        except OSError as exc:  # Hydra would make this a warning, and the sweep a success
            jobs = [{"num": "?", "exit_code": None, "overrides": [f"its jobs unreadable: {one_line(exc)}"], "dir": ""}]
        _failed_jobs[:] = [j for j in jobs if j["exit_code"] != 0]
        for job in _failed_jobs:
            how = "recorded no end (killed?)" if job["exit_code"] is None else f"exit {job['exit_code']}"
            print(
                f"sweep: job {job['num']} ({' '.join(job['overrides'])}) failed: {how}; {job['dir']}", file=sys.stderr
            )
        if _failed_jobs:
            print(f"sweep: {len(_failed_jobs)} of {len(jobs)} jobs failed ({sweep_dir})", file=sys.stderr)
