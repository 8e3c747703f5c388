"""The benchmark's picture: step time vs batch size and vs context (achieved vs bound), tok/s per system."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_bench(report: dict[str, Any], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roof = report.get("roofline")
    panels = 3 if roof else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    axes = list(axes) if panels > 1 else [axes]
    if roof:
        for ax, key, xkey, title in ((axes[0], "by_batch", "batch", f"decode step vs batch (context {roof['by_batch'][0]['context']})"),
                                     (axes[1], "by_context", "context", f"decode step vs context (batch {roof['by_context'][0]['batch']})")):
            rows = roof[key]
            xs = [r[xkey] for r in rows]
            ax.plot(xs, [r["step_ms"] for r in rows], "o-", label="achieved")
            ax.plot(xs, [r["bound_ms"] for r in rows], "s--", label="bound: GEMM rate + KV read")
            ax.plot(xs, [r["gemm_bound_ms"] for r in rows], "^:", label="GEMM roofline only")
            ax.set_xscale("log", base=2)
            ax.set_xlabel(xkey)
            ax.set_ylabel("ms per step")
            ax.set_title(title, fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
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
