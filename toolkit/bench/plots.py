"""The benchmark's picture: step time vs batch size and vs context (achieved vs bound), tok/s per system."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolkit.runs.plots import _pyplot


def plot_bench(report: dict[str, Any], path: Path) -> Path | None:
    plt = _pyplot()

    roof = report.get("roofline")
    panels = 3 if roof else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    axes = list(axes) if panels > 1 else [axes]
    if roof:
        by_batch = roof["by_batch"]
        context_batches = sorted({r["batch"] for r in roof["by_context"]})
        panels_rows = [(axes[0], "batch", f"decode step vs batch (context {by_batch[0]['context']})", [("", by_batch)])]
        panels_rows.append(
            (
                axes[1],
                "context",
                "decode step vs context",
                [(f"batch {b}, ", [r for r in roof["by_context"] if r["batch"] == b]) for b in context_batches],
            )
        )
        for ax, xkey, title, series in panels_rows:
            for label, rows in series:
                xs = [r[xkey] for r in rows]
                (line,) = ax.plot(xs, [r["step_ms"] for r in rows], "o-", label=f"{label}achieved")
                ax.plot(
                    xs,
                    [r["bound_ms"] for r in rows],
                    "s--",
                    color=line.get_color(),
                    label=f"{label}bound: GEMM + KV read",
                )
                ax.plot(
                    xs,
                    [r["gemm_bound_ms"] for r in rows],
                    "^:",
                    color=line.get_color(),
                    label=f"{label}GEMM roofline only",
                )
            ax.set_xscale("log", base=2)
            ax.set_xlabel(xkey)
            ax.set_ylabel("ms per step")
            ax.set_title(title, fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    ax = axes[-1]
    systems = report["systems"]
    names = list(systems)
    values = [systems[n]["output_tok_per_s"] for n in names]
    bars = ax.bar(names, values, color=["tab:blue" if n.startswith("engine") else "tab:gray" for n in names])
    for bar, v in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"workload {report['workload']['name']}", fontsize=10)
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
