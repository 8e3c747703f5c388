"""Audit: did the engine that wrote a transcript compute the probabilities it claims?

`python run.py mode=audit audit.input=<file> audit.format=<openai|token_ids|hf> audit.reference=<ours|hf>`
reads another engine's tokens and logprobs (toolkit.audit.transcripts), converts them into our
trace (requests.parquet with `origin_engine` and the source line, samples.parquet with the claimed
logprobs and top alternatives), recomputes every token teacher-forced with the reference (our float64
forward and/or HF transformers on the same weights) and reports, per request and overall:

- claimed vs recomputed logprob of every token: max / p50 / p99 absolute error;
- KL(claimed || reference) where top-logprobs allow it: over the claimed top ids plus one bucket
  for the rest of the vocabulary (a lower bound of the full KL);
- top-logprobs that cannot be a distribution (mass above 1) and top alternatives off by more than atol;
- tokens the claimed policy could not have produced: outside the top-k / top-p / min-p support its
  stated sampling parameters give under the reference (beyond atol of the support's edge);
- for greedy requests (temperature 0), the first position whose token is not the reference's argmax
  (beyond atol: near ties are not departures);
- the per-token importance ratio exp(reference - claimed) RL users correct with: mean, max, the share
  outside [0.5, 2] and the sequence-level product.

Exit code 0 when every token is within `audit.atol` and nothing is flagged, 1 when anything is
flagged (a bad line included: the other lines are still audited), 2 when the input is unusable.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from omegaconf import DictConfig, OmegaConf

from toolkit.audit import sources as src
from toolkit.audit.checks import (
    AuditInputError,
    AuditReport,
    Forward,
    RequestReport,
    _fmt,
    _policy_params,
    _size,
    _unique,
    assume_sampling,
    audit_transcripts,
    sampling_defaults,
)
from toolkit.audit.detection import (
    detection_table,
    detector_config,
    detector_scales,
    format_detection,
    format_detection_table,
    run_detector,
)
from toolkit.audit.detector import WINDOWS, Detection
from toolkit.audit.records import FORMATS, Transcript, TranscriptError, lines_rejected
from toolkit.audit.references import _atol, _forward, _references, stated_reference
from toolkit.audit.transcripts import read_transcripts
from toolkit.config import EngineConfig, ModelConfig, from_mapping
from toolkit.engine.core import Engine, load_for
from toolkit.errors import ConfigError, ForeignEngineError
from toolkit.models import load_model
from toolkit.models.loading import smollm2_gguf
from toolkit.reproduce.shard import in_order, launcher, progress_bar, ray_options, run_on_ray
from toolkit.runs.plots import _pyplot
from toolkit.trace.schema import SAMPLES_SCHEMA, SCHEMA_VERSION
from toolkit.trace.writer import SAMPLES_DIR, atomic_write_bytes, atomic_write_table, write_manifest, write_requests
from toolkit.version import __version__

# ------------------------------------------------------------------------------------------- Ray shards


def _audit_shard(
    loaded, memo: dict[str, Forward], records: list[Transcript], references: list[str], atol: float
) -> list[list[RequestReport]]:
    """A Ray worker's part of an audit (toolkit.reproduce.shard.run_on_ray): per reference, its records' reports."""
    return [
        audit_transcripts(records, _forward(loaded, r, memo), loaded, atol=atol, reference=r).requests
        for r in references
    ]


# ------------------------------------------------------------------------------------------- the mode


def run_audit(cfg: DictConfig, run_dir: Path) -> int:
    a = OmegaConf.to_container(cfg.audit, resolve=True) if cfg.get("audit") else {}
    source, fmt = a.get("input"), a.get("format", "openai")
    if not source and a.get("sources"):
        return run_engine_mismatch(cfg, run_dir, a)
    if not source:
        raise AuditInputError(
            "mode=audit needs audit.input=<transcript.jsonl> (or audit.sources=[hf,server,llama_cpp])"
        )
    if fmt not in FORMATS:
        raise AuditInputError(f"audit.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    references, atol, detector = _references(a), _atol(a), detector_config(a)
    if launcher(a) == "ray":
        ray_options(a)  # checked before the model loads
    if not Path(source).is_file():
        raise AuditInputError(f"audit.input {source!r} is not a file")
    model_cfg = from_mapping(ModelConfig, OmegaConf.to_container(cfg.model, resolve=True), section="model")
    loaded = load_model(model_cfg, "cpu")
    vocab, positions = loaded.arch.vocab_size, loaded.arch.max_position_embeddings  # what a line must fit
    if loaded.tokenizer is None:
        raise AuditInputError(f"model {model_cfg.name!r} has no tokenizer to read a transcript with")
    defaults_from, defaults = sampling_defaults(a, loaded)
    try:
        records, line_errors = read_transcripts(
            source, fmt, loaded.tokenizer, vocab, a.get("logprobs_mode"), max_positions=positions
        )
    except TranscriptError as exc:
        raise AuditInputError(str(exc)) from None
    line_errors += assume_sampling(records, defaults)  # a stated policy the defaults complete into none: refused
    for e in line_errors:
        print(f"line {e.line}{' (' + e.request_id + ')' if e.request_id else ''}: {e.why}", file=sys.stderr)
    if not records:
        raise AuditInputError(f"no usable request in {source} ({lines_rejected(line_errors)} lines rejected)")
    assumed = sum(bool(r.sampling_assumed) for r in records)
    if assumed:
        print(
            f"sampling: {assumed} of {len(records)} requests leave policy fields out; taken from {defaults_from} "
            f"(audit.json: sampling_assumed per request)"
        )
    if launcher(a) == "ray":
        options = ray_options(a)
        weights = [_size(r) for r in records]
        found = in_order(
            run_on_ray(
                OmegaConf.to_container(cfg.model, resolve=True),
                options,
                weights,
                "audit",
                _audit_shard,
                lambda shard: ([records[i] for i in shard], references, atol),
            ),
            len(references),
        )
        reports = [
            AuditReport(
                source=str(source), fmt=fmt, reference=r, atol=atol, requests=requests, line_errors=list(line_errors)
            )
            for r, requests in zip(references, found)
        ]
    else:
        tokens = sum(map(_size, records))
        reports = []
        with progress_bar(tokens * len(references), "audit") as bar:
            for r in references:
                forward, start = stated_reference(loaded, r), time.perf_counter()
                reports.append(
                    audit_transcripts(
                        records,
                        forward,
                        loaded,
                        atol=float(atol),
                        reference=r,
                        source=str(source),
                        fmt=fmt,
                        line_errors=line_errors,
                        progress=bar.update,
                    )
                )
                took = time.perf_counter() - start
                how = (
                    f"packed, {forward.counts['computed']} computed, the rest read from prompt blocks shared in a pack"
                    if hasattr(forward, "many")
                    else "one request at a time"
                )
                rate = tokens / max(took, 1e-9)
                print(f"{r}: {tokens} tokens recomputed in {took:.1f} s ({rate:.0f} tok/s; {how})")
    for report in reports:
        report.sampling_defaults = defaults_from
    detection = None
    if detector is not None:
        memo: dict[str, Forward] = {}
        scales = detector_scales(loaded, detector, memo)
        detection = run_detector(
            records, loaded, detector, scales, atol=atol, done={r.reference: r for r in reports}, memo=memo
        )
    write_converted_trace(run_dir, records, loaded, cfg, source=str(source), fmt=fmt)
    write_audit(run_dir, reports, detection)
    print(format_table(reports))
    if detection is not None:
        print(format_detection(detection))
    print(f"audit.json, audit.parquet, audit.png and the converted trace: {run_dir}")
    return 0 if all(r.passed for r in reports) else 1


def run_engine_mismatch(cfg: DictConfig, run_dir: Path, a: dict) -> int:
    """experiments/engine_mismatch.yaml: a transcript from each engine available here, each audited; one table
    (source, tokens, max and p99 |d logprob|, KL, share of ratios outside [0.5, 2]) and one histogram PNG."""
    names = list(a["sources"])
    unknown = [n for n in names if n not in src.SOURCES]
    if unknown:
        raise ConfigError(f"audit.sources: unknown {unknown}; known: {', '.join(src.SOURCES)}")
    references, atol = _references(a), _atol(a)
    model_cfg = from_mapping(ModelConfig, OmegaConf.to_container(cfg.model, resolve=True), section="model")
    engine_cfg = from_mapping(EngineConfig, OmegaConf.to_container(cfg.engine, resolve=True), section="engine")
    loaded, default_sampling, _ = load_for(model_cfg, engine_cfg, {})
    detector = detector_config(a)
    memo: dict[str, Forward] = {}  # the hypotheses' recomputations, each model loaded once
    scales = detector_scales(loaded, detector, memo) if detector is not None else {}
    detections: dict[str, tuple[str, Detection]] = {}  # source -> (what produced it, the detector's answer)
    chats = list(a.get("prompts") or src.DEFAULT_PROMPTS)
    prompts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in chats]
    max_tokens, k = int(a.get("max_tokens", 32)), int(a.get("top_logprobs", 5))
    out_dir = run_dir / "transcripts"
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, errors = [], {}
    for name in names:
        path = out_dir / f"{name}.jsonl"
        if name == "llama_cpp":
            missing = src.llama_cpp_missing() or (
                None if model_cfg.name == "smollm2" else "llama.cpp runs the SmolLM2 GGUF only (model=smollm2)"
            )
            if missing:
                print(f"{name}: skipped: {missing}", file=sys.stderr)
                continue
            try:
                fmt = src.llama_cpp_transcript(path, smollm2_gguf(), prompts, max_tokens, k)
            except ForeignEngineError as exc:  # its crash is this source's error, not the run's
                print(f"{name}: failed: {exc}", file=sys.stderr)
                continue
        elif name == "hf":
            fmt = src.hf_transcript(path, loaded, prompts, max_tokens, k)
        elif name == "server":
            fmt = src.server_transcript(path, Engine(loaded, engine_cfg, default_sampling), chats, max_tokens, k)
        else:  # server_bf16
            bf16 = load_model(dataclasses.replace(model_cfg, dtype="bfloat16"), engine_cfg.device)
            fmt = src.server_transcript(path, Engine(bf16, engine_cfg, default_sampling), chats, max_tokens, k)
            del bf16
        records, line_errors = read_transcripts(path, fmt, loaded.tokenizer, loaded.arch.vocab_size)
        done: dict[str, AuditReport] = {}
        for reference in references:
            report = audit_transcripts(
                records,
                stated_reference(loaded, reference),
                loaded,
                atol=atol,
                reference=reference,
                source=str(path),
                fmt=fmt,
                line_errors=line_errors,
            )
            d = report.to_dict()
            rows.append(
                {
                    "source": name,
                    "reference": reference,
                    **{
                        key: d[key]
                        for key in (
                            "tokens",
                            "flagged_tokens",
                            "max_abs_error",
                            "p50_abs_error",
                            "p99_abs_error",
                            "kl_mean",
                            "ratio_mean",
                            "ratio_outside_share",
                            "greedy_departures",
                            "lines_rejected",
                        )
                    },
                    "requests": d["requests"],
                }
            )
            errors[f"{name} vs {reference}"] = [c.abs_error for c in report.checks]
            done[reference] = report
        if detector is not None:
            truth = {"llama_cpp": "llama.cpp Q4_1", "server_bf16": "bfloat16"}.get(name, model_cfg.dtype)
            found = run_detector(records, loaded, detector, scales, atol=atol, done=done, memo=memo)
            detections[name] = (truth, found["transcript"])

    table = detection_table(detections, detector["stated"]) if detector is not None else []
    atomic_write_bytes(
        run_dir / "engine_mismatch.json",
        json.dumps(
            rows
            if detector is None
            else {
                "audits": rows,
                "detector": {
                    "stated": detector["stated"],
                    "alternatives": detector["alternatives"],
                    "scales": scales,
                    "windows": list(WINDOWS),
                    "sources": table,
                },
            },
            indent=2,
        ).encode(),
    )
    try:
        plot_errors(run_dir / "engine_mismatch.png", errors)
    except ModuleNotFoundError as exc:
        print(f"engine_mismatch.png skipped: {exc}", file=sys.stderr)
    print(
        f"{'source':<10} {'reference':<9} {'tokens':>6} {'max|d|':>9} {'p50|d|':>9} {'p99|d|':>9} {'KL':>9} "
        f"{'ratio out':>9} {'greedy dep':>10}"
    )
    for r in rows:
        print(
            f"{r['source']:<10} {r['reference']:<9} {r['tokens']:>6} {_fmt(r['max_abs_error']):>9} "
            f"{_fmt(r['p50_abs_error']):>9} {_fmt(r['p99_abs_error']):>9} {_fmt(r['kl_mean']):>9} "
            f"{_fmt(r['ratio_outside_share'], '.2%'):>9} {r['greedy_departures']:>10}"
        )
    if detector is not None:
        print(format_detection_table(table, detector, scales))
    print(f"engine_mismatch.json, engine_mismatch.png, transcripts/: {run_dir}")
    return 0


def write_audit(run_dir: Path, reports: list[AuditReport], detection: dict[str, Any] | None = None) -> dict[str, Any]:
    first = reports[0].to_dict()
    if len(reports) > 1:
        first["by_reference"] = {r.reference: r.to_dict() for r in reports}
        first["passed"] = all(r.passed for r in reports)
    if detection is not None:
        first["detector"] = {
            "scales": detection["scales"],
            "recomputed_by": detection["recomputed_by"],
            **detection["transcript"].to_dict(),
            "requests": [
                {"request_id": rid, "stream": stream, **d.to_dict()} for rid, stream, d in detection["requests"]
            ],
        }
    rows = [
        {
            "reference": r.reference,
            **{k: v for k, v in c.__dict__.items() if k not in ("kinds", "why")},
            "kinds": ",".join(c.kinds),
            "why": "; ".join(c.why),
        }
        for r in reports
        for c in r.checks
    ]
    atomic_write_table(
        run_dir / "audit.parquet",
        pa.Table.from_pylist(rows) if rows else pa.table({"request_id": pa.array([], pa.string())}),
    )
    atomic_write_bytes(run_dir / "audit.json", json.dumps(first, indent=2, allow_nan=True).encode())
    try:
        plot_errors(
            run_dir / "audit.png",
            {
                f"{', '.join(sorted({q.origin_engine for q in r.requests}))} vs {r.reference}": [
                    c.abs_error for c in r.checks
                ]
                for r in reports
            },
        )
    except ModuleNotFoundError as exc:
        print(f"audit.png skipped: {exc}", file=sys.stderr)
    return first


def plot_errors(path: Path, errors_by_source: dict[str, list[float | None]]) -> None:
    """One PNG: a histogram of |claimed - recomputed| logprob per source, on a log axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    floor = 1e-9
    values = {k: [max(e, floor) for e in v if e is not None] for k, v in errors_by_source.items()}
    top = max((max(v) for v in values.values() if v), default=1.0)
    bins = torch.logspace(math.log10(floor), math.log10(max(top, 1e-6) * 2), 60).tolist()
    for name, v in values.items():
        if v:
            ax.hist(v, bins=bins, histtype="step", linewidth=1.5, label=f"{name} ({len(v)} tokens)")
    ax.set_xscale("log")
    ax.set_xlabel("|claimed - recomputed| logprob (errors below 1e-9 drawn at 1e-9)")
    ax.set_ylabel("tokens")
    ax.set_title("logprob error per source")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(reports: list[AuditReport], limit: int = 20) -> str:
    lines = []
    for report in reports:
        d = report.to_dict()
        lines.append(
            f"audit of {d['source']} ({d['format']}, {', '.join(d['origin_engines'])}) against the "
            f"{report.reference} reference, atol {report.atol:g}"
        )
        head = (
            f"{'request':<28} {'tokens':>6} {'max|d|':>9} {'p99|d|':>9} {'KL':>9} {'ratio out':>9} "
            f"{'seq ratio':>9} {'greedy dep':>10} {'flagged':>7}"
        )
        lines.append(head)
        shown = [r for r in d["requests"] if r["flagged"]][:limit] or d["requests"][:limit]
        for r in shown:
            name = r["request_id"] + (f"#{r['stream']}" if r["stream"] else "")
            lines.append(
                f"{name[:28]:<28} {r['tokens']:>6} {_fmt(r['max_abs_error']):>9} "
                f"{_fmt(r['p99_abs_error']):>9} "
                f"{_fmt(r['kl_mean']):>9} {_fmt(r['ratio_outside_share'], '.1%'):>9} "
                f"{_fmt(r['sequence_ratio']):>9} {_fmt(r['first_greedy_departure'], 'd'):>10} "
                f"{len(r['flagged']):>7}"
            )
            for f in r["flagged"][:3]:
                lines.append(f"    position {f['position']}: {f['kind']}: {f['why']}")
        if len(d["requests"]) > len(shown):
            lines.append(f"  ... {len(d['requests']) - len(shown)} more requests in audit.json")
        verdict = "PASSED" if report.passed else "FLAGGED"
        lines.append(
            f"{verdict}: {d['tokens']} tokens of {len(d['requests'])} requests; "
            f"{d['flagged_tokens']} flagged; "
            f"max |d| {_fmt(d['max_abs_error'])}, p50 {_fmt(d['p50_abs_error'])}, p99 "
            f"{_fmt(d['p99_abs_error'])}; KL mean {_fmt(d['kl_mean'])}; ratio mean {_fmt(d['ratio_mean'])}, "
            f"max {_fmt(d['ratio_max'])}, outside [0.5, 2] {_fmt(d['ratio_outside_share'], '.2%')}; "
            f"greedy departures {d['greedy_departures']}; lines rejected {d['lines_rejected']}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- the trace


def write_converted_trace(
    run_dir: Path, records: list[Transcript], loaded, cfg: DictConfig, *, source: str, fmt: str
) -> None:
    """The transcript in our trace schema: what the other engine claimed, where our engine would record it
    (raw claims in raw_logprob / top_raw, processed ones in processed_logprob / top_processed). Fields only
    an engine run has (step, noise, logits digest, batch) are null."""
    run_id = uuid.uuid4().hex[:12]
    samples, requests = [], []
    for r in records:
        params = _policy_params(r)
        policy = {k: getattr(params, k) for k in ("temperature", "top_k", "top_p", "min_p")} if params else {}
        processed = r.logprobs_mode == "processed_logprobs"
        for j, token in enumerate(r.output_token_ids):
            top = [{"token_id": t, "logprob": lp} for t, lp in _unique(r.top[j])] if j < len(r.top) else []
            last = j == len(r.output_token_ids) - 1
            samples.append(
                {
                    "run_id": run_id,
                    "request_id": r.request_id,
                    "stream": r.stream,
                    "position": len(r.prompt_token_ids) + j,
                    "token_id": token,
                    "raw_logprob": None if processed else r.claimed[j],
                    "processed_logprob": r.claimed[j] if processed else None,
                    "top_raw": [] if processed else top,
                    "top_processed": top if processed else [],
                    "processors": [],
                    "noise": float("nan"),
                    **policy,
                    "finish_reason": r.finish_reason if last else None,
                    "origin": "plain",
                    "spec_proposed": 0,
                    "spec_accepted": 0,
                }
            )
        sampling = {k: v for k, v in (r.sampling or {}).items()}
        requests.append(
            {
                "run_id": run_id,
                "request_id": r.request_id,
                "stream": r.stream,
                "prompt_token_ids": r.prompt_token_ids,
                "prompt_text": r.prompt_text,
                "sampling_params": json.dumps(sampling),
                "output_token_ids": r.output_token_ids,
                "output_text": r.output_text,
                "finish_reason": r.finish_reason,
                "origin_engine": r.origin_engine,
                "source_record": r.source,
            }
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(samples, schema=SAMPLES_SCHEMA)
    atomic_write_table(run_dir / SAMPLES_DIR / "part-000000.parquet", table)
    write_requests(run_dir, requests)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    atomic_write_bytes(run_dir / "config.yaml", OmegaConf.to_yaml(resolved).encode())
    write_manifest(
        run_dir,
        {
            "schema_version": SCHEMA_VERSION,
            "run_id": run_id,
            "converted_from": source,
            "format": fmt,
            "origin_engines": sorted({r.origin_engine for r in records}),
            "model_name": loaded.name,
            "model_id": loaded.model_id,
            "weights_sha256": loaded.revision,
            "tokenizer_sha256": loaded.tokenizer.digest if loaded.tokenizer else None,
            "toolkit_version": __version__,
        },
    )
