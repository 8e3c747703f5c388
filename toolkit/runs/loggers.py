"""Run loggers (`logger=none | wandb`): where a recorded run's figures go besides its directory.

`wandb` runs offline by default (`logger.mode=offline`): everything is written under
`<run_dir>/wandb/offline-run-*` and needs no network or account; `wandb sync` uploads it
later, and `logger.mode=online` logs live for users with an account. Logged: the resolved
config, per-step metrics (batch size, decode vs prefill tokens, KV utilisation, step time),
per-request TTFT/TPOT as a table, the run summary, and the run directory's Parquet files
as an artifact.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from toolkit.config import check, is_int
from toolkit.errors import ConfigError, one_line

LOGGERS = ("none", "wandb")


class RunLogger:
    """The no-op logger; subclasses log somewhere."""

    def log_step(self, record: Mapping[str, Any]) -> None:
        pass

    def finish(self, summary: Mapping[str, Any], requests: list[Mapping[str, Any]], run_dir: Path) -> None:
        pass


def check_logger(cfg: Mapping[str, Any] | None, run_mode: str = "run", run_dir: Path | None = None) -> None:
    """The `logger` section checked whole before the model loads (app.main, for every mode): one ConfigError
    naming the setting, where wandb.init after the model load was the first to look at it. Only mode=run logs
    (record()'s steps); a logger asked of another mode would be ignored, so it is refused."""
    cfg = dict(cfg or {})
    kind = cfg.get("backend", "none")
    if kind not in LOGGERS:
        raise ConfigError(f"logger.backend must be one of {', '.join(LOGGERS)}, got {kind!r}")
    if kind == "none":
        return
    check(
        run_mode == "run",
        f"logger={kind} logs mode=run only; mode={run_mode} would ignore it (drop logger={kind}, or logger=none)",
    )
    _check_wandb(cfg, run_dir)


def _check_wandb(cfg: Mapping[str, Any], run_dir: Path | None) -> Any:
    """logger=wandb's settings, each by wandb's own rules (wandb.Settings), and the run directory it writes in;
    returns the wandb module."""
    mode = cfg.get("mode", "offline")
    check(mode in ("offline", "online", "disabled"), f"logger.mode must be offline, online or disabled, got {mode!r}")
    try:
        import wandb  # deferred: wandb, the [wandb] extra
    except ImportError:  # pragma: no cover - wandb comes with the wandb (and dev) extra
        raise ConfigError("logger=wandb needs the wandb package: pip install 'toolkit[wandb]'") from None
    every = cfg.get("log_every_steps", 1)
    check(is_int(every) and every >= 1, f"logger.log_every_steps must be a positive integer, got {every!r}")
    tags = cfg.get("tags") or []
    check(
        isinstance(tags, (list, tuple)) and all(isinstance(t, str) for t in tags),
        f"logger.tags must be a list of strings, got {tags!r}",
    )
    for name, setting, value in (("project", "project", cfg.get("project")), ("tags", "run_tags", tuple(tags))):
        try:
            wandb.Settings(**{setting: value})
        except Exception as exc:  # noqa: BLE001 - wandb's UsageError, pydantic's ValidationError
            errors = getattr(exc, "errors", None)
            why = errors()[0]["msg"] if callable(errors) else str(exc)
            raise ConfigError(f"logger.{name}={cfg.get(name)!r}: {' '.join(why.split())}") from None
    if run_dir is not None:
        where = Path(run_dir) / "wandb"
        check(
            not where.exists() or where.is_dir(),
            f"logger=wandb cannot write in the run directory: {where} is not a directory",
        )
        while not where.exists():
            where = where.parent
        check(
            os.access(where, os.W_OK | os.X_OK),
            f"logger=wandb cannot write in the run directory {run_dir}: {where} is not writable",
        )
    return wandb


class WandbLogger(RunLogger):
    def __init__(self, cfg: Mapping[str, Any], config: Mapping[str, Any], run_dir: Path, run_id: str):
        wandb = _check_wandb(cfg, run_dir)
        mode = cfg.get("mode", "offline")
        self.every = cfg.get("log_every_steps", 1)
        os.environ.setdefault("WANDB_SILENT", "true")
        self.wandb = wandb
        try:
            self.run = wandb.init(
                project=cfg.get("project") or "toolkit",
                entity=cfg.get("entity"),
                mode=mode,
                dir=str(run_dir),
                name=cfg.get("run_name") or run_dir.name,
                id=run_id,
                tags=list(cfg.get("tags") or []),
                config=dict(config),
                settings=wandb.Settings(console="off", x_disable_stats=True),
            )
        except Exception as exc:  # noqa: BLE001 - wandb's UsageError, pydantic's ValidationError, an unwritable dir
            raise ConfigError(
                f"logger=wandb could not start its run (logger.project, logger.tags, logger.mode, WANDB_* settings "
                f"or the run directory): {one_line(exc)}"
            ) from None

    def _lost(self, exc: BaseException) -> None:
        """wandb failed mid-run (its service died, its disk filled): said once, and the run goes on without it
        (the run directory holds everything wandb would have had)."""
        print(f"toolkit: wandb stopped logging, the run goes on without it: {one_line(exc)}", file=sys.stderr)
        self.run = None
        try:  # its service's exit hook goes with it: a dead service would print a traceback at exit
            self.wandb.teardown(exit_code=1)
        except Exception:  # noqa: BLE001, S110 - the service is gone already; what was said above is the news
            pass

    def log_step(self, record: Mapping[str, Any]) -> None:
        if self.run is None or record["step"] % self.every:
            return
        try:
            self.run.log(
                {f"step/{k}": v for k, v in record.items() if k != "step" and v is not None}, step=int(record["step"])
            )
        except Exception as exc:  # noqa: BLE001 - a logger's fault must not stop the run it observes
            self._lost(exc)

    def finish(self, summary: Mapping[str, Any], requests: list[Mapping[str, Any]], run_dir: Path) -> None:
        if self.run is None:
            return
        try:
            self._finish(summary, requests, run_dir)
        except Exception as exc:  # noqa: BLE001 - the run is recorded already; wandb's copy is what is lost
            self._lost(exc)

    def _finish(self, summary: Mapping[str, Any], requests: list[Mapping[str, Any]], run_dir: Path) -> None:
        columns = [
            "request_id",
            "stream",
            "finish_reason",
            "num_output_tokens",
            "ttft_s",
            "tpot_s",
            "e2e_s",
            "num_preemptions",
        ]
        table = self.wandb.Table(
            columns=columns,
            data=[
                [r.get(c) if c != "num_output_tokens" else len(r.get("output_token_ids") or []) for c in columns]
                for r in requests
            ],
        )
        self.run.log({"requests": table})
        self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool))})
        artifact = self.wandb.Artifact(f"trace-{self.run.id}", type="trace")
        for name in (
            "samples.parquet",
            "requests.parquet",
            "steps.parquet",
            "manifest.json",
            "summary.json",
            "config.yaml",
        ):
            path = run_dir / name
            if path.is_dir():
                artifact.add_dir(str(path), name=name)
            elif path.exists():
                artifact.add_file(str(path), name=name)
        self.run.log_artifact(artifact)
        self.run.finish()


def make_logger(cfg: Mapping[str, Any] | None, config: Mapping[str, Any], run_dir: Path, run_id: str) -> RunLogger:
    cfg = dict(cfg or {})
    kind = cfg.get("backend", "none")
    if kind not in LOGGERS:
        raise ConfigError(f"logger.backend must be one of {', '.join(LOGGERS)}, got {kind!r}")
    if kind == "wandb":
        return WandbLogger(cfg, config, run_dir, run_id)
    return RunLogger()


def read_offline_run(run_file: Path) -> dict[str, Any]:
    """What an offline wandb run file (`offline-run-*/run-*.wandb`) holds, read with wandb's own
    protobuf records: config keys, history keys and rows, summary keys, logged artifacts.

    The file is a log of records (leveldb log framing: 32 KiB blocks, each record a 7-byte
    header of checksum, length and kind, split across blocks as first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb  # deferred: wandb, the [wandb] extra

    data = Path(run_file).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{run_file} is not a wandb run file")
    block, pos, pending = 32768, 7, b""
    out: dict[str, Any] = {"config": set(), "history": set(), "history_rows": 0, "summary": set(), "artifacts": []}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind not in (1, 4):  # first or middle part of a record
            continue
        rec = pb.Record()
        rec.ParseFromString(pending)
        which = rec.WhichOneof("record_type")
        if which == "config":
            out["config"].update(i.key for i in rec.config.update)
        elif which == "run":
            out["config"].update(i.key for i in rec.run.config.update)
        elif which == "history":
            out["history"].update(i.key or "/".join(i.nested_key) for i in rec.history.item)
            out["history_rows"] += 1
        elif which == "summary":
            out["summary"].update(i.key or "/".join(i.nested_key) for i in rec.summary.update)
        elif which == "artifact":
            out["artifacts"].append(
                {
                    "name": rec.artifact.name,
                    "type": rec.artifact.type,
                    "files": sorted(c.path for c in rec.artifact.manifest.contents),
                }
            )
    return out
