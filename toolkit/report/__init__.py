"""`report.html`: a run directory as one self-contained page (no server, no network).

    python run.py mode=report report.run=<run dir>                       # one run
    python run.py mode=report report.run=<run dir> report.against=<other>  # two runs, where they part

Views: per request a token strip coloured by raw or processed probability, any token's details (logprobs, top
alternatives, processors, noise, step and batch, grammar and speculation fields); the engine's timeline per step;
summary figures, manifest and config; with a second run, each sequence's first divergence and its cause. The
trace is embedded as gzip'd JSON (the browser's DecompressionStream reads it) and drawn on demand, one request at
a time, so a 100,000-row run stays a few MB and opens quickly. Charts are Plotly's, its JavaScript inlined from
the `plotly` package (the `report` extra).
"""

from __future__ import annotations

import base64
import gzip
import json
import math
import sys
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pyarrow.parquet as pq
from markupsafe import Markup
from omegaconf import OmegaConf

from toolkit.config import ModelConfig, from_mapping
from toolkit.errors import ConfigError, ToolkitError, one_line
from toolkit.models.loading import tokenizer_dir
from toolkit.models.tokenizer import Tokenizer
from toolkit.report.data import Pieces, RunData, notes
from toolkit.runs.plots import token_budget
from toolkit.trace.diverge import first_divergences
from toolkit.trace.writer import SAMPLES_DIR, atomic_write_bytes
from toolkit.version import __version__

ASSETS = Path(__file__).parent / "assets"
MISSING_PLOTLY = "the report needs plotly: pip install 'toolkit[report]'"
AUTO_MAX_ROWS = 200_000  # sample rows past which a mode's own report is skipped: a page that large takes GBs to build


def _plotly():
    try:
        import plotly  # deferred: plotly, the [report] extra
        import plotly.graph_objects as go  # deferred: plotly, the [report] extra
        from plotly.subplots import make_subplots  # deferred: plotly, the [report] extra
    except ImportError:
        raise ToolkitError(MISSING_PLOTLY) from None
    return plotly, go, make_subplots


def report_tokenizer(run_dir: Path, manifest: dict[str, Any]):
    """The run's tokenizer (the one its config.yaml's model loads) when it is the one the manifest names, else
    None: the page then shows token ids."""

    try:
        model = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml").model, resolve=True)
        directory = tokenizer_dir(from_mapping(ModelConfig, model, section="model"))
        tokenizer = Tokenizer(directory) if directory is not None else None
    except Exception:  # noqa: BLE001 - no config, no tokenizer, another layout: ids instead of text
        return None
    recorded = manifest.get("tokenizer_sha256")
    return tokenizer if tokenizer is not None and recorded in (None, tokenizer.digest) else None


def timeline_figure(steps: dict[str, list] | None, budget: int | None):
    _, go, make_subplots = _plotly()
    if not steps or not steps.get("step"):
        return None
    x = steps["step"]
    fig = make_subplots(
        rows=4,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.04,
        subplot_titles=("tokens in the forward", "batch size (sequences)", "KV cache used (%)", "step time (ms)"),
    )
    fig.add_trace(go.Bar(x=x, y=steps["decode_tokens"], name="decode tokens", marker_color="#3a7dc9"), 1, 1)
    fig.add_trace(go.Bar(x=x, y=steps["prefill_tokens"], name="prefill tokens", marker_color="#f0a030"), 1, 1)
    preempted = [(s, n) for s, n in zip(x, steps.get("preempted") or [0] * len(x)) if n]
    if preempted:
        top = max((d + p for d, p in zip(steps["decode_tokens"], steps["prefill_tokens"])), default=1)
        fig.add_trace(
            go.Scatter(
                x=[s for s, _ in preempted],
                y=[top * 1.05] * len(preempted),
                mode="markers",
                marker=dict(symbol="x", color="#c0392b", size=9),
                name="preemption",
                text=[f"{n} preempted" for _, n in preempted],
            ),
            1,
            1,
        )
    if budget:
        fig.add_hline(y=budget, line_dash="dash", line_color="black", annotation_text=f"budget {budget}", row=1, col=1)
    fig.add_trace(
        go.Scatter(x=x, y=steps["batch_size"], mode="lines", name="batch size", line=dict(color="#2f6fdd", shape="hv")),
        2,
        1,
    )
    fig.add_trace(
        go.Scatter(
            x=x, y=[100 * u for u in steps["kv_utilization"]], mode="lines", name="KV used", line=dict(color="#c0392b")
        ),
        3,
        1,
    )
    fig.add_trace(
        go.Scatter(
            x=x, y=[1e3 * s for s in steps["step_s"]], mode="lines", name="step time", line=dict(color="#475467")
        ),
        4,
        1,
    )
    fig.update_layout(
        barmode="stack", bargap=0, margin=dict(l=50, r=20, t=40, b=40), height=720, legend=dict(orientation="h", y=1.06)
    )
    fig.update_xaxes(title_text="engine step", row=4, col=1)
    return fig


def probability_figure(run: RunData):
    _, go, _ = _plotly()
    edges = np.linspace(0.0, 1.0, 21)
    fig = go.Figure()
    for name, column, colour in (("raw", "raw_logprob", "#98a2b3"), ("processed", "processed_logprob", "#2f6fdd")):
        values = np.array(
            [
                r[column]
                for rows in run.seqs.values()
                for r in rows
                if r[column] is not None and math.isfinite(r[column])
            ],
            dtype=np.float64,
        )
        counts, _ = np.histogram(np.exp(values), bins=edges)
        fig.add_trace(
            go.Bar(
                x=((edges[:-1] + edges[1:]) / 2).tolist(),
                y=counts.tolist(),
                width=0.045,
                name=name,
                marker_color=colour,
            )
        )
    fig.update_layout(
        title="probability of each sampled token",
        barmode="group",
        height=320,
        xaxis_title="probability",
        yaxis_title="tokens",
        margin=dict(l=50, r=10, t=40, b=40),
    )
    return fig


def latency_figure(run: RunData):
    _, go, make_subplots = _plotly()
    cols = run.requests.to_pydict()
    series = [
        (name, [v * scale for v in cols[column] if v is not None and math.isfinite(v)])
        for name, column, scale in (("TTFT (s)", "ttft_s", 1.0), ("TPOT (ms)", "tpot_s", 1e3))
    ]
    if not any(values for _, values in series):
        return None
    fig = make_subplots(rows=1, cols=2, subplot_titles=[name for name, _ in series])
    for j, (name, values) in enumerate(series, start=1):
        fig.add_trace(go.Histogram(x=values, name=name, nbinsx=30, marker_color="#2f6fdd"), 1, j)
    fig.update_layout(title="request latency", height=320, showlegend=False, margin=dict(l=50, r=10, t=60, b=40))
    fig.update_yaxes(title_text="requests", row=1, col=1)
    return fig


def _json(fig) -> dict[str, Any] | None:
    return None if fig is None else json.loads(fig.to_json())


def _steps_note(steps: dict[str, list] | None) -> str:
    if not steps or not steps.get("step"):
        return "This run recorded no steps (no steps.parquet: e.g. a mode=audit transcript)."
    n = len(steps["step"])
    times = sorted(t for t in steps["step_s"] if t is not None and math.isfinite(t)) or [math.nan]
    kv = [u for u in steps["kv_utilization"] if u is not None and math.isfinite(u)] or [math.nan]
    return (
        f"{n} steps; step time p50 {1e3 * times[len(times) // 2]:.1f} ms; {sum(steps.get('preempted') or [])} "
        f"preemptions; peak KV use {100 * max(kv):.1f}%."
    )


def build_payload(run: RunData, against: RunData | None = None, tokenizer=None) -> dict[str, Any]:
    pieces, processors = Pieces(tokenizer), {}
    payload: dict[str, Any] = {"run": run.payload(pieces, processors)}
    if against is not None:
        payload["against"] = against.payload(pieces, processors)
        prompts = tuple(
            dict(zip(r.requests.column("request_id").to_pylist(), r.requests.column("prompt_token_ids").to_pylist()))
            for r in (run, against)
        )
        payload["divergences"] = [d.to_dict() for d in first_divergences(run.seqs, against.seqs, prompts=prompts)]
        payload["compared_sequences"] = len(set(run.seqs) | set(against.seqs))
    payload["figures"] = {
        "timeline": _json(timeline_figure(run.steps, token_budget(run.run_dir))),
        "probabilities": _json(probability_figure(run)),
        "latency": _json(latency_figure(run)),
    }
    payload["steps_note"] = _steps_note(run.steps)
    payload["notes"] = notes(run) + ([f"the second run: {n}" for n in notes(against)] if against is not None else [])
    payload["pieces"] = {str(k): v for k, v in pieces.table.items()}
    payload["processors"] = [list(p) for p, _ in sorted(processors.items(), key=lambda kv: kv[1])]
    return payload


def render(payload: dict[str, Any], title: str) -> str:
    """The page: template, styles, Plotly and the app inlined; the payload gzip'd and base64'd."""
    plotly, _, _ = _plotly()
    data = gzip.compress(json.dumps(payload, separators=(",", ":"), allow_nan=False).encode(), 6, mtime=0)
    # </script> inside an inlined script would end it early: Plotly's bundle is checked, never edited blindly
    plotly_js = plotly.offline.get_plotlyjs()
    app_js = (ASSETS / "report.js").read_text()
    for name, text in (("plotly.js", plotly_js), ("report.js", app_js)):
        if "</script" in text.lower():
            raise RuntimeError(f"{name} contains '</script': it cannot be inlined")
    template = jinja2.Environment(autoescape=True).from_string((ASSETS / "report.html").read_text())
    return template.render(
        title=title,
        version=__version__,
        css=Markup((ASSETS / "report.css").read_text()),
        plotly_js=Markup(plotly_js),
        app_js=Markup(app_js),
        payload=base64.b64encode(data).decode(),
    )


def write_report(
    run_dir: str | Path, against: str | Path | None = None, out: str | Path | None = None, tokenizer: Any = "auto"
) -> Path:
    """Write the report of `run_dir` (with `against`: the two-run view) to `out` (default run_dir/report.html)."""
    run_dir = Path(run_dir)
    run = RunData.read(run_dir)
    other = RunData.read(Path(against)) if against is not None else None
    if other is not None and run.manifest.get("tokenizer_sha256") != other.manifest.get("tokenizer_sha256"):
        raise ConfigError(  # one run's token ids through the other's tokenizer read as another text, or as none
            f"report.against: {against} ran another tokenizer than {run_dir} (tokenizer_sha256 "
            f"{str(other.manifest.get('tokenizer_sha256'))[:12]} vs {str(run.manifest.get('tokenizer_sha256'))[:12]}): "
            f"their tokens cannot be shown side by side; compare their texts with mode=compare"
        )
    if tokenizer == "auto":
        tokenizer = report_tokenizer(run_dir, run.manifest)
    title = f"{run_dir.name}" + (f" vs {Path(against).name}" if against is not None else "")
    html = render(build_payload(run, other, tokenizer), f"toolkit report: {title}")
    out = Path(out) if out is not None else run_dir / "report.html"
    try:
        atomic_write_bytes(out, html.encode())
    except OSError as exc:  # a directory, a path that does not exist, a full disk
        raise ConfigError(f"report.out: cannot write {out}: {one_line(exc)}") from None
    return out


def run_report(cfg, run_dir: Path) -> int:
    """mode=report: report.run (and report.against) -> report.html in report.run (or report.out)."""
    section = cfg.get("report") or {}
    target = section.get("run")
    if not target:
        raise ConfigError("mode=report needs report.run=<run dir> (and report.against=<run dir> for two runs)")
    for name in ("run", "against"):
        value = section.get(name)
        if value and not (Path(value) / "samples.parquet").is_dir():
            why = (
                "recorded with trace.enabled=false: it has no sample rows to show"
                if (Path(value) / "manifest.json").is_file()
                else "is not a run directory (no samples.parquet/)"
            )
            raise ConfigError(f"report.{name}: {value} {why}")
    out = write_report(target, section.get("against"), section.get("out"))
    size = out.stat().st_size / 2**20
    print(f"report: {out} ({size:.1f} MB)")
    return 0


def wanted(cfg) -> bool:
    """Whether a mode writes report.html when it ends (`report.auto`)."""
    return bool((cfg.get("report") or {}).get("auto", False))


def report_after(run_dir: Path, against: Path | None = None, out: Path | None = None) -> Path | None:
    """The report written at the end of another mode; a failure is one line on stderr, never the run's failure.
    A run past AUTO_MAX_ROWS sampled tokens gets a line with the command instead (a long-lived server's trace
    made its shutdown take minutes and GBs before)."""
    try:
        rows = sum(pq.ParquetFile(p).metadata.num_rows for p in sorted((Path(run_dir) / SAMPLES_DIR).glob("*.parquet")))
        if rows > AUTO_MAX_ROWS:
            print(
                f"report.html not written: {rows} sampled tokens, more than {AUTO_MAX_ROWS} (report.auto's bound); "
                f"write it with: python run.py mode=report report.run={run_dir}",
                file=sys.stderr,
                flush=True,
            )
            return None
        return write_report(run_dir, against, out)
    except Exception as exc:  # noqa: BLE001 - the run itself is complete and on disk
        print(f"report.html not written: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return None
