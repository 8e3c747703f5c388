"""Plots written with every run and by `mode=compare`.

- `timeline.png`: each step's tokens split into decode and prefill tokens against the token
  budget (the picture of chunked prefill: decodes ride along with prompt chunks), with the
  KV-cache utilisation on a second axis;
- `latency.png`: TTFT and TPOT distributions of the run's requests;
- `compare.png` (mode=compare): throughput per run and TTFT/TPOT distributions side by side.

matplotlib comes with the `bench` extra (`pip install 'toolkit[bench]'`), imported on first use.
Without it a run's plots are skipped with one line on stderr; `mode=compare` and the KV
quantisation report stop with an error that says what to install.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from toolkit.trace.reader import read_requests, read_steps
from toolkit.trace.writer import REQUESTS_FILE

MISSING_MATPLOTLIB = "plots need matplotlib: pip install 'toolkit[bench]'"


def _pyplot():
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its first use logs building a font cache
    try:
        import matplotlib  # deferred: matplotlib, the [bench] extra
    except ImportError:
        raise ModuleNotFoundError(MISSING_MATPLOTLIB, name="matplotlib") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: matplotlib, the [bench] extra

    return plt


def token_budget(run_dir: Path) -> int | None:
    """The run's engine.max_num_batched_tokens (its config.yaml), or None."""
    try:
        return int(OmegaConf.load(run_dir / "config.yaml").engine.max_num_batched_tokens)
    except Exception:  # noqa: BLE001 - a run without a readable config just has no budget line
        return None


def plot_run(run_dir: Path) -> list[Path]:
    run_dir = Path(run_dir)
    try:
        plt = _pyplot()
    except ModuleNotFoundError as exc:  # a core install without the bench extra: the run itself is complete
        print(f"{exc}; timeline.png and latency.png skipped (plots=false turns them off)", file=sys.stderr, flush=True)
        return []
    written = []
    steps_table = read_steps(run_dir)
    if steps_table is not None:
        steps = steps_table.to_pydict()
        x = steps["step"]
        fig, ax = plt.subplots(figsize=(11, 4))
        ax.bar(x, steps["decode_tokens"], width=1.0, color="#3a7dc9", label="decode tokens")
        ax.bar(
            x,
            steps["prefill_tokens"],
            width=1.0,
            bottom=steps["decode_tokens"],
            color="#f0a030",
            label="prefill tokens",
        )
        budget = token_budget(run_dir)
        if budget:
            ax.axhline(budget, color="black", lw=1, ls="--", label=f"token budget ({budget})")
        ax.set_xlabel("engine step")
        ax.set_ylabel("tokens in the step's forward")
        kv = ax.twinx()
        kv.plot(x, [100 * u for u in steps["kv_utilization"]], color="#c0392b", lw=1, label="KV utilisation")
        kv.set_ylabel("KV cache used (%)")
        kv.set_ylim(0, 105)
        handles = ax.get_legend_handles_labels()[0] + kv.get_legend_handles_labels()[0]
        ax.legend(handles, [h.get_label() for h in handles], loc="upper right", fontsize=8)
        ax.set_title(f"{run_dir.name}: tokens per step (one forward each)")
        fig.tight_layout()
        fig.savefig(run_dir / "timeline.png", dpi=110)
        plt.close(fig)
        written.append(run_dir / "timeline.png")
    if (run_dir / REQUESTS_FILE).exists():
        req = read_requests(run_dir).select(["ttft_s", "tpot_s"]).to_pydict()
        ttft = [v for v in req["ttft_s"] if v is not None]
        tpot = [1000 * v for v in req["tpot_s"] if v is not None]
        if ttft:
            fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
            axes[0].hist(ttft, bins=min(30, max(5, len(ttft))), color="#3a7dc9")
            axes[0].set_xlabel("TTFT (s)")
            axes[0].set_ylabel("requests")
            axes[1].hist(tpot or [0.0], bins=min(30, max(5, len(tpot))), color="#f0a030")
            axes[1].set_xlabel("TPOT (ms per output token)")
            fig.suptitle(f"{run_dir.name}: latency of {len(ttft)} requests")
            fig.tight_layout()
            fig.savefig(run_dir / "latency.png", dpi=110)
            plt.close(fig)
            written.append(run_dir / "latency.png")
    return written


def plot_compare(rows: list[dict[str, Any]], latencies: dict[str, dict[str, list[float]]], path: Path) -> Path:
    plt = _pyplot()
    names = [r["run"] for r in rows]
    labels = ["/".join(Path(n).parts[-2:])[-32:] for n in names]  # the run's last two path parts
    fig, axes = plt.subplots(1, 3, figsize=(15, 1.6 + 0.45 * len(rows)))
    axes[0].barh(labels, [r.get("output_tok_per_s") or 0.0 for r in rows], color="#3a7dc9")
    axes[0].set_xlabel("output tok/s")
    axes[0].invert_yaxis()
    for ax, key, label in ((axes[1], "ttft_s", "TTFT (s)"), (axes[2], "tpot_s", "TPOT (s)")):
        data = [latencies[n][key] or [0.0] for n in names]
        ax.boxplot(data, orientation="horizontal", tick_labels=labels)
        ax.invert_yaxis()
        ax.set_xlabel(label)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
