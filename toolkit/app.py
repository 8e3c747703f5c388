"""What `run.py` does in each mode, given a composed Hydra config and a run directory."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from toolkit.engine import Engine, RequestOutput
from toolkit.errors import RequestError, ToolkitError
from toolkit.metrics import summarize
from toolkit.trace import build_manifest, new_run_id, request_rows
from toolkit.trace.writer import TraceWriter, atomic_write_bytes, write_manifest, write_requests
from toolkit.workload import Rejected, RequestSpec, builtin_workload, load_requests


def main(cfg: DictConfig, run_dir: Path) -> int:
    """Run one mode; return the process exit code. User mistakes print one line, no traceback."""
    try:
        mode = cfg.get("mode", "run")
        if mode == "run":
            return run_workload(cfg, run_dir)
        if mode == "bench":
            from toolkit.bench import run_bench

            return run_bench(cfg, run_dir)
        raise ToolkitError(f"unknown mode {mode!r}; known: run, bench")
    except ToolkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


def workload_specs(cfg: DictConfig) -> tuple[list[RequestSpec], list[Rejected]]:
    w = OmegaConf.to_container(cfg.workload, resolve=True)
    assert isinstance(w, dict)
    if w.get("requests"):
        return load_requests(w["requests"])
    name = w.pop("name", "chat")
    w.pop("requests", None)
    return builtin_workload(name, **w), []


def add_specs(engine: Engine, specs: list[RequestSpec]) -> tuple[list[str], list[Rejected]]:
    """Add every spec; a bad request is rejected with its source and does not stop the others."""
    ids, rejected = [], []
    for spec in specs:
        try:
            ids.append(engine.add_request(**spec.add_kwargs()))
        except RequestError as exc:
            rejected.append(Rejected(spec.source, f"{spec.source}: {exc}"))
    return ids, rejected


def run_workload(cfg: DictConfig, run_dir: Path) -> int:
    specs, rejected = workload_specs(cfg)
    for r in rejected:
        print(f"rejected: {r.reason}", file=sys.stderr)
    engine = Engine.from_config(cfg)
    ids, more_rejected = add_specs(engine, specs)
    for r in more_rejected:
        print(f"rejected: {r.reason}", file=sys.stderr)
    rejected += more_rejected

    trace_cfg = cfg.get("trace") or {}
    run_id = new_run_id()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    write_manifest(run_dir, build_manifest(engine, run_id))
    write_requests(run_dir, request_rows(engine, run_id, ids))  # replayable even if the run dies
    writer = TraceWriter(run_dir, run_id, trace_cfg.get("flush_every_steps", 64)) if trace_cfg.get("enabled", True) \
        else None
    try:
        while engine.has_unfinished():
            out = engine.step()
            if writer is not None:
                writer.write_step(out.samples, out.logits_RV)
    finally:
        if writer is not None:
            writer.close()
        write_requests(run_dir, request_rows(engine, run_id, ids))

    outputs = [engine.output(i) for i in ids]
    wall = (engine.last_finish_time or 0.0) - (engine.first_admission_time or 0.0)
    summary = summarize(outputs, wall, rejected=len(rejected), steps=engine.step_index, run_id=run_id,
                        trace_rows=writer.rows_written if writer else 0,
                        model=engine.loaded.model_id, model_revision=engine.loaded.revision,
                        rejected_requests=[r.reason for r in rejected])
    atomic_write_bytes(run_dir / "summary.json", json.dumps(summary, indent=2).encode())
    if cfg.get("print_outputs", True):
        print_outputs(outputs)
    print_summary(summary, run_dir)
    return 1 if rejected else 0


def print_outputs(outputs: list[RequestOutput]) -> None:
    for o in outputs:
        for c in o.outputs:
            name = o.request_id if len(o.outputs) == 1 else f"{o.request_id}#{c.index}"
            print(f"--- {name} ({len(c.token_ids)} tokens, {c.finish_reason})")
            print(c.text)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_summary(summary: dict[str, Any], run_dir: Path) -> None:
    keys = ["requests", "rejected", "output_tokens", "wall_s", "output_tok_per_s", "ttft_p50_s", "ttft_p95_s",
            "tpot_p50_s", "tpot_p95_s", "num_preemptions", "steps"]
    width = max(len(k) for k in keys)
    print("=" * (width + 14))
    for k in keys:
        if k in summary:
            print(f"{k:<{width}}  {_fmt(summary[k])}")
    print(f"{'run_dir':<{width}}  {run_dir}")
