"""Compare many recorded runs: `python run.py mode=compare 'compare.runs=[dirA,dirB]'` (or globs).

Each run is read as replay reads it (toolkit.trace.reader): its manifest, sample parts, request
table and summary, refused with replay's one-line TraceError where it cannot be trusted (a part
truncated, a row given twice, rows lost from a closed run, a corrupt summary). A run is its
directory, never its run_id: a copy of a run (re-read) shares the id. Runs of other model weights
than the first run's are named in a note under the table. Printed: a table of throughput, TTFT/TPOT percentiles,
speculative acceptance and structured-output validity per run, and how each run's tokens
agree with the first run's (same request, stream and position): the rows that differ, the
first of them, and the rows and whole sequences only one of the two has. Written:
compare.json, compare.parquet (those counts and names as columns too) and compare.png.
"""

from __future__ import annotations

import glob
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from toolkit.errors import ConfigError
from toolkit.runs.metrics import percentile
from toolkit.runs.plots import plot_compare
from toolkit.trace.diverge import RowKey, token_agreement
from toolkit.trace.reader import (
    SUMMARY_FIGURES,
    TraceError,
    check_rows_present,
    read_manifest,
    read_requests,
    read_samples,
    read_summary,
)
from toolkit.trace.writer import REQUESTS_FILE, SAMPLES_DIR, atomic_write_table

COLUMNS = ("requests", "output_tokens", *SUMMARY_FIGURES)  # the summary's counts and figures read_summary checks


@dataclass
class Comparison:
    rows: list[dict[str, Any]] = field(default_factory=list)
    latencies: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # printed under the table (runs of other model weights)

    def table(self) -> str:
        width = max([28, *(len(r["run"]) for r in self.rows)])  # whole paths: a cut one hid where runs differ
        head = f"{'run':<{width}} " + " ".join(f"{c[:12]:>12}" for c in COLUMNS) + "  tokens vs first run"
        lines = [head]
        for r in self.rows:
            cells = []
            for c in COLUMNS:
                v = r.get(c)
                cells.append(f"{'-' if v is None else (f'{v:.4g}' if isinstance(v, float) else v):>12}")
            lines.append(f"{r['run']:<{width}} " + " ".join(cells) + f"  {r['divergence']}")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def resolve_runs(patterns: Sequence[str] | str) -> list[Path]:
    """Run directories from paths or globs, in the given order; each must hold a trace."""
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns:
        raise ConfigError("mode=compare needs compare.runs=[<run dir or glob>, ...]")
    runs: list[Path] = []
    for pattern in patterns:
        is_glob = any(ch in str(pattern) for ch in "*?[")
        matches = [Path(m) for m in sorted(glob.glob(str(pattern)))] if is_glob else [Path(pattern)]
        if is_glob:  # a glob keeps the run directories it matches (and skips e.g. multirun.yaml)
            matches = [m for m in matches if (m / SAMPLES_DIR).exists() and (m / REQUESTS_FILE).exists()]
        if not matches:
            raise ConfigError(f"compare.runs: {pattern!r} matches no run directory")
        for path in matches:
            if not (path / SAMPLES_DIR).exists() or not (path / REQUESTS_FILE).exists():
                raise TraceError(f"{path} is not a run directory with a trace (no {SAMPLES_DIR} or {REQUESTS_FILE})")
            if path not in runs:
                runs.append(path)
    return runs


# the figures and agreement columns typed whatever their values (all null in a two-run compare whose runs agree, a
# figure no run recorded): every compare.parquet has one schema, and many read as one dataset
COLUMN_TYPES = {
    "run": pa.string(),
    "run_id": pa.string(),
    **{c: pa.int64() if c in ("requests", "output_tokens") else pa.float64() for c in COLUMNS},
    "divergence": pa.string(),
    "rows_shared": pa.int64(),
    "rows_differing": pa.int64(),
    "first_differing": pa.string(),
    "rows_only_first_run": pa.int64(),
    "rows_only_this_run": pa.int64(),
    "sequences_only_first_run": pa.list_(pa.string()),
    "sequences_only_this_run": pa.list_(pa.string()),
}


def run_tokens(samples: pa.Table) -> dict[RowKey, int]:
    """One run's token ids by (request_id, stream, position), from its own sample rows (keyed by the directory:
    two runs with one run_id, a run and its copy, stay two runs)."""
    columns = samples.select(["request_id", "stream", "position", "token_id"]).to_pydict()
    return {
        (req, stream, pos): tok
        for req, stream, pos, tok in zip(
            columns["request_id"], columns["stream"], columns["position"], columns["token_id"]
        )
    }


def figure(column: str, value: Any) -> Any:
    """A summary's figure as the table shows it (read_summary checked its type): a count as it is, a figure a float,
    NaN or Infinity (Python's json writes them) missing, as the report shows them."""
    if value is None or COLUMN_TYPES[column] == pa.int64():
        return value
    return float(value) if math.isfinite(value) else None


def compare(patterns: Sequence[str] | str, out_dir: Path | None = None) -> Comparison:
    runs = resolve_runs(patterns)
    result = Comparison()
    reference, weights = None, None
    for run in runs:
        manifest, requests, samples = read_manifest(run), read_requests(run), read_samples(run)
        check_rows_present(requests, samples, run)  # what replay refuses, refused here too
        summary = read_summary(run)
        req = requests.select(["run_id", "ttft_s", "tpot_s"]).to_pydict()
        run_id = req["run_id"][0] if req["run_id"] else summary.get("run_id")
        tokens = run_tokens(samples)
        model = (manifest.get("model_id") or manifest.get("model_name"), manifest.get("weights_sha256"))
        if weights is not None and model[1] != weights[1]:
            result.notes.append(
                f"{run} ran other model weights than the first run ({model[0]}, sha256 {str(model[1])[:12]}... vs "
                f"{weights[0]}, sha256 {str(weights[1])[:12]}...): its tokens are another model's"
            )
        weights = model if weights is None else weights
        name = str(run)
        ttft = [v for v in req["ttft_s"] if v is not None]
        tpot = [v for v in req["tpot_s"] if v is not None]
        row = {"run": name, "run_id": run_id, **{c: figure(c, summary.get(c)) for c in COLUMNS}}
        row["ttft_p50_s"] = row["ttft_p50_s"] if row["ttft_p50_s"] is not None else percentile(ttft, 50)
        row["tpot_p50_s"] = row["tpot_p50_s"] if row["tpot_p50_s"] is not None else percentile(tpot, 50)
        if reference is None:
            row["divergence"] = "(reference)"
        else:
            agreement = token_agreement(reference, tokens)
            row["divergence"] = agreement.describe("the first run", "this run")
            row.update(agreement.to_dict("first_run", "this_run"))
        reference = tokens if reference is None else reference
        result.rows.append(row)
        result.latencies[name] = {"ttft_s": ttft, "tpot_s": tpot}
    if out_dir is not None:
        columns = dict.fromkeys(name for row in result.rows for name in row)  # the reference row has no agreement
        table = pa.table(
            {name: pa.array([row.get(name) for row in result.rows], COLUMN_TYPES.get(name)) for name in columns}
        )
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "compare.json").write_text(json.dumps(result.rows, indent=2))
        atomic_write_table(out_dir / "compare.parquet", table)
        plot_compare(result.rows, result.latencies, out_dir / "compare.png")
    return result
