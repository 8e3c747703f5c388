"""What `run.py` does in each mode, given a composed Hydra config and a run directory."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from toolkit.config import TraceConfig, from_mapping
from toolkit.engine.core import Engine, RequestOutput
from toolkit.errors import ConfigError, Interrupted, ToolkitError
from toolkit.modes import MODES
from toolkit.modes.train import train
from toolkit.report import report_after, run_report, wanted
from toolkit.reproduce.compare import compare, resolve_runs
from toolkit.reproduce.replay import replay
from toolkit.reproduce.shard import launcher, ray_options
from toolkit.reproduce.verify import verify
from toolkit.runs.loggers import check_logger
from toolkit.runs.metrics import batch_vs_single, structured_output_validity
from toolkit.runs.session import record
from toolkit.runs.workload import add_specs, workload_specs
from toolkit.trace.writer import atomic_write_bytes, full_logits_selection


def runner(mode: str) -> Callable[[DictConfig, Path], int]:
    """The function that runs `mode`: one of this module's, or imported by name from the module that holds it
    (only when that mode runs: between them the modes need FastAPI, Ray, llama.cpp and HF transformers)."""
    target = RUNNERS[mode]
    if callable(target):
        return target
    module, _, name = target.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        extra = EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        raise ConfigError(
            f"mode={mode} needs {exc.name}, in the {extra} extra: pip install -e '.[{extra}]' -c constraints.txt"
        ) from None


def main(cfg: DictConfig, run_dir: Path) -> int:
    """Run one mode; return the process exit code. User mistakes print one line, no traceback."""
    try:
        mode = cfg.get("mode", "run")
        if mode not in RUNNERS:
            raise ToolkitError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
        # before the model loads: a logger setting's typo, or a logger the mode would ignore
        check_logger(OmegaConf.to_container(cfg.logger, resolve=True) if cfg.get("logger") else None, mode, run_dir)
        return runner(mode)(cfg, run_dir)
    except ToolkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Interrupted as exc:  # inside the engine loop: record() flushed the trace and says where it stopped
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # before or after the engine loop
        print("interrupted", file=sys.stderr)
        return 130


def run_train(cfg: DictConfig, run_dir: Path) -> int:
    if cfg.model.name != "nanogpt":
        raise ToolkitError("mode=train trains the character-level GPT: add model=nanogpt")
    train_cfg = OmegaConf.to_container(cfg.train, resolve=True)
    out_dir = Path(train_cfg.get("out_dir") or run_dir / "nanogpt")
    result = train(train_cfg, OmegaConf.to_container(cfg.model, resolve=True), out_dir)
    first, last = result["history"][0], result["history"][-1]
    print(
        f"val loss {first['val_loss']:.3f} -> {last['val_loss']:.3f}; checkpoint {out_dir}\n"
        f"serve it: python run.py model=nanogpt model.path={out_dir} workload=text"
    )
    return 0


def run_workload(cfg: DictConfig, run_dir: Path) -> int:
    trace_section = OmegaConf.to_container(cfg.trace, resolve=True) if cfg.get("trace") else {}
    trace_cfg = from_mapping(TraceConfig, trace_section, section="trace")  # checked before the model loads
    specs, rejected = workload_specs(cfg)
    for r in rejected:
        print(f"rejected: {r.reason}", file=sys.stderr)
    engine = Engine.from_config(cfg)
    ids, more_rejected = add_specs(engine, specs)
    for r in more_rejected:
        print(f"rejected: {r.reason}", file=sys.stderr)
    rejected += more_rejected
    chosen = full_logits_selection(trace_cfg.full_logits)
    if isinstance(chosen, frozenset) and not chosen <= set(ids):  # a typo wrote no logits, and said nothing
        unknown = ", ".join(sorted(chosen - set(ids)))
        raise ConfigError(
            f"trace.full_logits names request ids this run has not: {unknown} (its ids: {', '.join(ids[:8])}"
            f"{', ...' if len(ids) > 8 else ''})"
        )

    recorded = record(
        engine,
        ids,
        run_dir,
        cfg,
        trace=trace_cfg.enabled,
        flush_every_steps=trace_cfg.flush_every_steps,
        full_logits=trace_cfg.full_logits,
        logger=OmegaConf.to_container(cfg.logger, resolve=True) if cfg.get("logger") else None,
        progress=cfg.get("progress", True),
        plots=cfg.get("plots", True),
        summary_extra={"rejected": len(rejected), "rejected_requests": [r.reason for r in rejected]},
    )
    outputs, summary = recorded.outputs, recorded.summary
    validity = structured_output_validity(outputs, {i: engine.sequences(i)[0].sampling for i in ids})
    if validity is not None:
        summary.update(validity)
        atomic_write_bytes(run_dir / "summary.json", json.dumps(summary, indent=2).encode())
    if cfg.get("print_outputs", True):
        print_outputs(outputs)
    print_summary(summary, run_dir)
    if engine.model_sampling_defaults:
        fields = ", ".join(f"{k}={v}" for k, v in engine.model_sampling_defaults.items())
        print(
            f"sampling defaults from the model's generation config: {fields} (model.generation_config=none: "
            f"the library's)"
        )
    print(
        f"replay it bit for bit:   python run.py mode=replay replay.trace={run_dir}\n"
        f"verify its logits:       python run.py mode=verify verify.trace={run_dir}"
    )
    if trace_cfg.enabled and wanted(cfg):
        _report_line(report_after(run_dir))
    return 1 if rejected else 0


def _report_line(path: Path | None) -> None:
    if path is not None:
        print(f"see it:                  {path} (open it in a browser)")


def _trace_arg(cfg: DictConfig, mode: str) -> Path:
    trace = cfg.get(mode, {}).get("trace")
    if not trace:
        raise ToolkitError(f"mode={mode} needs {mode}.trace=<run directory>")
    return Path(trace)


def run_replay(cfg: DictConfig, run_dir: Path) -> int:
    r = cfg.replay
    overrides = r.get("overrides")  # replay() refuses what is no list of strings (5, "x"), and a non-boolean below
    report = replay(
        _trace_arg(cfg, "replay"),
        [] if overrides is None else overrides,
        allow_mismatch=r.get("allow_mismatch", False),
        out_dir=run_dir,
    )
    if wanted(cfg):  # the recorded run against its replay: where they part, and why
        _report_line(report_after(report.trace_dir, run_dir, run_dir / "report.html"))
    for problem in report.mismatches:
        print(f"mismatch (allowed): {problem}")
    for missing in report.cannot_rebuild:
        print(f"cannot rebuild: {missing}")
    print(report.summary_line())
    for d in report.first_divergences:
        print(f"  first divergence: {d.describe('recorded', 'replayed')}")
    if report.differences:
        print(f"divergences: {run_dir / 'divergence.parquet'}")
    return 0 if report.identical else 1


def run_verify(cfg: DictConfig, run_dir: Path) -> int:
    v = cfg.verify
    atol = v.get("atol", "auto")  # verify() refuses what is no positive finite number (inf, nan, 0, "x")
    plain = OmegaConf.to_container(v, resolve=True)
    ray = ray_options(plain, "verify") if launcher(plain, "verify") == "ray" else None
    report = verify(
        _trace_arg(cfg, "verify"),
        reference=v.get("reference", "ours"),
        atol=atol,
        reference_dtype=str(v.get("reference_dtype", "float64")),
        out_dir=run_dir,
        ray=ray,
    )
    print(report.summary_line())
    for c in report.failures:
        print(f"  first failure: {c.request_id}#{c.stream} position {c.position} token {c.token_id}: {c.reason}")
    if report.downstream_rows:
        print(f"  ({report.downstream_rows} later rows of those sequences fail too; each is shown at its first)")
    return 0 if report.passed else 1


def run_compare(cfg: DictConfig, run_dir: Path) -> int:
    runs = OmegaConf.to_container(cfg.compare, resolve=True).get("runs") if cfg.get("compare") else None
    result = compare(runs or [], out_dir=run_dir)
    print(result.table())
    print(f"compare.json, compare.parquet, compare.png: {run_dir}")
    if wanted(cfg):  # the first run against each other one
        resolved = resolve_runs(runs or [])
        for k, other in enumerate(resolved[1:], start=1):
            _report_line(
                report_after(
                    resolved[0], other, run_dir / ("report.html" if len(resolved) == 2 else f"report-{k}.html")
                )
            )
    return 0


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
    keys = [
        "requests",
        "rejected",
        "output_tokens",
        "wall_s",
        "output_tok_per_s",
        "requests_per_s",
        "ttft_p50_s",
        "ttft_p95_s",
        "tpot_p50_s",
        "tpot_p95_s",
        "itl_p95_s",
        "queue_p95_s",
        "num_preemptions",
        "prefix_cache_hit_rate",
        "json_validity_rate",
        "acceptance_rate",
        "mean_accepted_length",
        "target_forwards_per_output_token",
        "steps",
    ]
    width = max(len(k) for k in keys)
    print("=" * (width + 14))
    for k in keys:
        if k in summary:
            print(f"{k:<{width}}  {_fmt(summary[k])}")
    by_batch = summary.get("decode_steps") or {}
    wide = batch_vs_single(by_batch)
    if wide is not None:  # what batching costs a decode step (steps with no prompt tokens, medians)
        b, ratio = wide
        print(
            f"{'decode step, batch 1 / ' + str(b):<{width}}  {1e3 * by_batch['1']['p50_s']:.1f} / "
            f"{1e3 * by_batch[str(b)]['p50_s']:.1f} ms ({ratio:.2f}x)"
        )
    print(f"{'run_dir':<{width}}  {run_dir}")


# the optional dependencies a mode may import, and the extra (pyproject.toml) that installs each
EXTRAS = {
    "fastapi": "serve",
    "uvicorn": "serve",
    "pydantic": "serve",
    "prometheus_client": "serve",
    "ray": "ray",
    "llama_cpp": "llama",
    "matplotlib": "bench",
    "plotly": "report",
    "wandb": "wandb",
}
# mode -> what runs it (toolkit.modes.MODES says what each does; a test holds the two to the same modes)
RUNNERS: dict[str, Callable[[DictConfig, Path], int] | str] = {
    "run": run_workload,
    "serve": "toolkit.serve.main:run_serve",
    "bench": "toolkit.bench:run_bench",
    "scheduling": "toolkit.bench.scheduling:run_scheduling",
    "replay": run_replay,
    "verify": run_verify,
    "compare": run_compare,
    "audit": "toolkit.audit.foreign:run_audit",
    "soak": "toolkit.modes.soak:run_soak",
    "train": run_train,
    "kv_quantization": "toolkit.bench.kv_quantization:run_kv_quantization",
    "precision": "toolkit.bench.formats:run_precision",
    "report": run_report,
}
