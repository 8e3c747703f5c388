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

    engine.run_until_done()
    outputs = [engine.output(i) for i in ids]
    wall = (engine.last_finish_time or 0.0) - (engine.first_admission_time or 0.0)
    summary = summarize(outputs, wall, rejected=len(rejected), steps=engine.step_index,
                        model=engine.loaded.model_id, model_revision=engine.loaded.revision)
    write_run(run_dir, cfg, specs, outputs, summary, rejected)
    if cfg.get("print_outputs", True):
        print_outputs(outputs)
    print_summary(summary, run_dir)
    return 1 if rejected else 0


def write_run(run_dir: Path, cfg: DictConfig, specs: list[RequestSpec], outputs: list[RequestOutput],
              summary: dict[str, Any], rejected: list[Rejected]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    with open(run_dir / "requests.jsonl", "w") as fh:
        for spec in specs:
            fh.write(json.dumps(spec.to_json()) + "\n")
    with open(run_dir / "outputs.jsonl", "w") as fh:
        for o in outputs:
            fh.write(json.dumps({
                "request_id": o.request_id, "seed": o.seed, "prompt_tokens": len(o.prompt_token_ids),
                "output_token_ids": list(o.output_token_ids), "text": o.text, "finish_reason": o.finish_reason,
                **{k: v for k, v in o.metrics.__dict__.items()},
            }) + "\n")
    summary = {**summary, "rejected_requests": [r.reason for r in rejected]}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def print_outputs(outputs: list[RequestOutput]) -> None:
    for o in outputs:
        print(f"--- {o.request_id} ({len(o.output_token_ids)} tokens, {o.finish_reason})")
        print(o.text)


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
