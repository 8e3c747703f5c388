"""Compare many recorded runs: `python run.py mode=compare 'compare.runs=[dirA,dirB]'` (or globs).

The runs' sample traces are read as ONE pyarrow dataset (every part file of every run;
rows carry their `run_id`), their summaries and request tables beside it. Printed: a table
of throughput, TTFT/TPOT percentiles, speculative acceptance and structured-output
validity per run, and where each run's tokens first diverge from the first run's (same
request, stream and position). Written: compare.json, compare.parquet and compare.png.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds

from toolkit.errors import ConfigError
from toolkit.runs.metrics import percentile
from toolkit.runs.plots import plot_compare
from toolkit.trace.diverge import token_agreement
from toolkit.trace.reader import TraceError, read_requests
from toolkit.trace.writer import REQUESTS_FILE, SAMPLES_DIR, atomic_write_table

COLUMNS = (
    "requests",
    "output_tokens",
    "output_tok_per_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "tpot_p50_s",
    "tpot_p95_s",
    "acceptance_rate",
    "json_validity_rate",
)


@dataclass
class Comparison:
    rows: list[dict[str, Any]] = field(default_factory=list)
    latencies: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def table(self) -> str:
        head = f"{'run':<28} " + " ".join(f"{c[:12]:>12}" for c in COLUMNS) + "  tokens vs first run"
        lines = [head]
        for r in self.rows:
            cells = []
            for c in COLUMNS:
                v = r.get(c)
                cells.append(f"{'-' if v is None else (f'{v:.4g}' if isinstance(v, float) else v):>12}")
            lines.append(f"{r['run'][-28:]:<28} " + " ".join(cells) + f"  {r['divergence']}")
        return "\n".join(lines)


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


def compare(patterns: Sequence[str] | str, out_dir: Path | None = None) -> Comparison:
    runs = resolve_runs(patterns)
    parts = [str(p) for run in runs for p in sorted((run / SAMPLES_DIR).glob("part-*.parquet"))]
    dataset = ds.dataset(parts, format="parquet")  # every run's samples as one dataset
    samples = dataset.to_table(columns=["run_id", "request_id", "stream", "position", "token_id"]).to_pydict()
    by_run: dict[str, dict[tuple, int]] = {}
    for rid, req, stream, pos, tok in zip(
        samples["run_id"], samples["request_id"], samples["stream"], samples["position"], samples["token_id"]
    ):
        by_run.setdefault(rid, {})[(req, stream, pos)] = tok
    result = Comparison()
    reference = None
    for run in runs:
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
        req = read_requests(run).select(["run_id", "ttft_s", "tpot_s"]).to_pydict()
        run_id = req["run_id"][0] if req["run_id"] else summary.get("run_id")
        tokens = by_run.get(run_id, {})
        name = str(run)
        ttft = [v for v in req["ttft_s"] if v is not None]
        tpot = [v for v in req["tpot_s"] if v is not None]
        row = {"run": name, "run_id": run_id, **{c: summary.get(c) for c in COLUMNS}}
        row["ttft_p50_s"] = row["ttft_p50_s"] if row["ttft_p50_s"] is not None else percentile(ttft, 50)
        row["tpot_p50_s"] = row["tpot_p50_s"] if row["tpot_p50_s"] is not None else percentile(tpot, 50)
        row["divergence"] = "(reference)" if reference is None else token_agreement(reference, tokens).describe()
        reference = tokens if reference is None else reference
        result.rows.append(row)
        result.latencies[name] = {"ttft_s": ttft, "tpot_s": tpot}
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "compare.json").write_text(json.dumps(result.rows, indent=2))
        atomic_write_table(out_dir / "compare.parquet", pa.Table.from_pylist(result.rows))
        plot_compare(result.rows, result.latencies, out_dir / "compare.png")
    return result
