"""`mode=scheduling`: the design documents' scheduler experiments on a real model, one table and one plot each.

A bundle (experiments/interleaving.yaml, chunked_prefill.yaml, batch_latency.yaml, continuous_batching.yaml)
names a workload and engine variants: `scheduling.variants` ({name: engine overrides}) and/or
`scheduling.sweep` ({engine field: [values]}, one variant per value on top of `scheduling.base`). Every
variant runs the same greedy requests (ignore_eos: the same work) through its own engine, untraced, and
reports the serving chapter's figures: output / prompt tok/s, requests/s, TTFT, TPOT, ITL and queue
percentiles (per request group too, e.g. the short requests behind long prompts), forwards per step, step
time, KV utilisation. `scheduling.kind: walkthrough` instead replays the continuous-batching post's
three-request arrival example step by step, then static batching against continuous batching on the same
arrivals. Greedy tokens are checked to agree across variants (the policies change when, not what).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from toolkit.bench import _machine as bench_machine
from toolkit.bench.options import count, flag, mappings, named, names
from toolkit.bench.workloads import make_workload, workload_options
from toolkit.config import EngineConfig, ModelConfig, check, from_mapping, is_int, is_number
from toolkit.engine.core import Engine, load_for
from toolkit.errors import ConfigError
from toolkit.runs.metrics import percentile
from toolkit.runs.plots import _pyplot
from toolkit.runs.session import record
from toolkit.sampling.params import SamplingParams

COLUMNS = {  # column -> (header, format)
    "forwards_per_step": ("fwd/step", ".2f"),
    "step_s_mean": ("step ms", "ms"),
    "output_tok_per_s": ("tok/s", ".1f"),
    "requests_per_s": ("req/s", ".2f"),
    "prompt_tok_per_s": ("prompt tok/s", ".0f"),
    "ttft_p50_s": ("TTFT p50", "ms"),
    "ttft_p95_s": ("TTFT p95", "ms"),
    "tpot_p50_s": ("TPOT p50", "ms"),
    "tpot_p95_s": ("TPOT p95", "ms"),
    "itl_p50_s": ("ITL p50", "ms"),
    "itl_p95_s": ("ITL p95", "ms"),
    "itl_p99_s": ("ITL p99", "ms"),
    "queue_p95_s": ("queue p95", "ms"),
    "kv_utilization_max": ("KV max", ".0%"),
    "max_step_tokens": ("max step tok", "d"),
    "steps": ("steps", "d"),
}


def run_scheduling(cfg: DictConfig, run_dir: Path) -> int:
    s = OmegaConf.to_container(cfg.scheduling, resolve=True) if cfg.get("scheduling") else {}
    model_cfg = from_mapping(ModelConfig, OmegaConf.to_container(cfg.model, resolve=True), section="model")
    engine_cfg = from_mapping(EngineConfig, OmegaConf.to_container(cfg.engine, resolve=True), section="engine")
    scheduling_options(s, engine_cfg)  # every option, before the model loads and any variant runs
    loaded, _, _ = load_for(model_cfg, engine_cfg, {})
    if loaded.tokenizer is None:
        raise ConfigError(f"mode=scheduling workloads need a tokenizer; model {model_cfg.name!r} has none")
    if s.get("kind", "variants") == "walkthrough":
        report = walkthrough(loaded, engine_cfg, s)
    else:
        report = compare_variants(loaded, engine_cfg, s, run_dir)
    report.update(
        {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": bench_machine(),
            "model": loaded.model_id,
            "experiment": s.get("title", ""),
        }
    )
    (run_dir / "scheduling.json").write_text(json.dumps(report, indent=2))
    try:
        plot(report, s, run_dir / "scheduling.png")
    except ModuleNotFoundError as exc:
        print(f"scheduling.png skipped: {exc}", file=sys.stderr)
    print(f"scheduling.json, scheduling.png: {run_dir}")
    return 0 if report.get("greedy_tokens_agree", True) else 1


# ------------------------------------------------------------------------------------------- options

KINDS = ("variants", "walkthrough")
GROUP_FIGURES = ("ttft_p50_s", "ttft_p95_s", "tpot_p95_s")  # what each request group reports (run_variant)


def scheduling_options(s: dict[str, Any], engine_cfg: EngineConfig) -> None:
    """The scheduling section checked whole, before the model loads: a bad value is one ConfigError naming it."""
    kind = s.get("kind", "variants")
    check(kind in KINDS, f"scheduling.kind must be one of {', '.join(KINDS)}, got {kind!r}")
    flag(s.get("warmup", True), "scheduling.warmup")
    if kind == "walkthrough":
        count(s.get("max_batch_size", 4), "scheduling.max_batch_size")
        arrivals(s)
        return
    workload_options(s.get("workload", "standard"), s.get("num_requests"), s.get("max_tokens"), "scheduling")
    for name, overrides in variants(s).items():  # each variant's engine, as it will run
        engine = {**dataclasses.asdict(engine_cfg), **overrides}
        named(f"scheduling variant {name!r}", lambda e=engine: from_mapping(EngineConfig, e, section="engine"))
    if s.get("columns") is not None:
        names(s["columns"], "scheduling.columns", tuple(COLUMNS))
    plot_y = s.get("plot_y")
    if plot_y is not None:
        check(
            isinstance(plot_y, list) and bool(plot_y) and all(isinstance(y, str) for y in plot_y),
            f"scheduling.plot_y must be a non-empty list of figures, got {plot_y!r}",
        )
        for y in plot_y:
            group, _, figure = y.rpartition(".")
            check(
                figure in GROUP_FIGURES if group else y in COLUMNS,
                f"scheduling.plot_y: unknown figure {y!r}; known: {', '.join(COLUMNS)}, "
                f"or <request group>.{{{', '.join(GROUP_FIGURES)}}}",
            )
    x = s.get("plot_x")
    swept = list(s.get("sweep") or {})
    check(
        x is None or x in swept,
        f"scheduling.plot_x must be null or a field of scheduling.sweep ({', '.join(swept) or 'none swept'}), "
        f"got {x!r}",
    )


def check_groups(s: dict[str, Any], workload) -> None:
    """scheduling.plot_y's `group.figure` names a request group of the workload (before any variant runs)."""
    groups = sorted({r.group for r in workload.requests})
    for y in s.get("plot_y") or []:
        group = y.rpartition(".")[0]
        check(
            not group or (len(groups) > 1 and group in groups),
            f"scheduling.plot_y: {y!r} names no request group of workload {workload.name!r} "
            f"(its groups: {', '.join(groups) if len(groups) > 1 else 'one, not reported apart'})",
        )


def arrivals(s: dict[str, Any]) -> list[tuple[int, str, int]]:
    """scheduling.arrivals as (arrival step >= 0, prompt text, max new tokens >= 1) triples."""
    given = s.get("arrivals") or [[0, "O Romeo, ", 17], [0, "To be or ", 22], [3, "KING HENRY:\n", 15]]
    bad = "scheduling.arrivals must be a list of [arrival step >= 0, prompt text, max new tokens >= 1], got"
    check(isinstance(given, list), f"{bad} {given!r}")
    for a in given:
        ok = isinstance(a, list) and len(a) == 3 and isinstance(a[1], str) and bool(a[1])
        check(ok and is_int(a[0]) and a[0] >= 0 and is_int(a[2]) and a[2] >= 1, f"{bad} {a!r}")
    return [tuple(a) for a in given]


# ------------------------------------------------------------------------------------------- variants


def variants(s: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{variant name: engine overrides} of scheduling.variants and scheduling.sweep, over scheduling.base."""
    base = mappings({"base": s.get("base")}, "scheduling")["base"]
    out = {name: {**base, **over} for name, over in mappings(s.get("variants"), "scheduling.variants").items()}
    sweep = s.get("sweep") or {}
    check(isinstance(sweep, dict), f"scheduling.sweep must be a mapping {{engine field: [values]}}, got {sweep!r}")
    for name, values in sweep.items():
        check(
            isinstance(values, list) and bool(values),
            f"scheduling.sweep.{name} must be a non-empty list of values, got {values!r}",
        )
        for v in values:
            out[f"{name}={v}"] = {**base, name: v}
    if not out:
        raise ConfigError("mode=scheduling needs scheduling.variants or scheduling.sweep")
    return out


def compare_variants(loaded, engine_cfg: EngineConfig, s: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    workload = make_workload(
        s.get("workload", "standard"),
        loaded.tokenizer,
        s.get("num_requests"),
        s.get("max_tokens"),
        section="scheduling",
    )
    check_groups(s, workload)
    rows, tokens = {}, {}
    every = variants(s)
    if s.get("warmup", True):  # the first variant measured otherwise pays the process's first forwards (~10%)
        first = from_mapping(
            EngineConfig, {**dataclasses.asdict(engine_cfg), **next(iter(every.values()))}, section="engine"
        )
        run_variant(
            loaded,
            first,
            [dataclasses.replace(r, max_tokens=min(r.max_tokens, 8), arrival_step=0) for r in workload.requests[:8]],
            run_dir / "variants" / "_warmup",
        )
    for name, overrides in every.items():
        cfg = from_mapping(EngineConfig, {**dataclasses.asdict(engine_cfg), **overrides}, section="engine")
        print(f"  {name} ...", end="", flush=True)
        rows[name], tokens[name] = run_variant(loaded, cfg, workload.requests, run_dir / "variants" / name)
        rows[name]["overrides"] = overrides
        print(f" {rows[name]['wall_s']:.2f} s", flush=True)
    first = next(iter(tokens.values()))
    agree = all(t == first for t in tokens.values())
    report = {
        "workload": {
            "name": workload.name,
            "description": workload.description,
            "requests": len(workload.requests),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in workload.requests),
        },
        "engine_config": dataclasses.asdict(engine_cfg),
        "variants": rows,
        "greedy_tokens_agree": agree,
    }
    print(format_table(report, s.get("columns") or list(COLUMNS)))
    if not agree:
        print("greedy tokens differ between variants (near ties in fp32: run with engine.batch_invariant=true)")
    return report


def run_variant(loaded, cfg: EngineConfig, requests, run_dir: Path) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """The requests, greedy, through an engine of `cfg`, recorded untraced in `run_dir` (config, manifest,
    requests, steps.parquet, summary.json): the summary's figures and per-step ones, and each request's tokens."""
    engine = Engine(loaded, cfg, SamplingParams(temperature=0.0))
    for r in requests:
        engine.add_request(
            prompt_token_ids=r.prompt_token_ids,
            request_id=r.id,
            arrival_step=r.arrival_step,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True),
        )
    recorded = record(engine, [r.id for r in requests], run_dir, {"engine": dataclasses.asdict(cfg)}, trace=False)
    outputs, steps = recorded.outputs, recorded.steps
    row = {
        k: v
        for k, v in recorded.summary.items()
        if k not in ("finish_reasons", "run_id", "model", "model_revision", "trace_rows")
    }
    row.update(
        {
            "forwards_per_step": sum(st["forwards"] for st in steps) / max(len(steps), 1),
            "step_s_mean": sum(st["step_s"] for st in steps) / max(len(steps), 1),
            "steps": len(steps),
            "max_step_tokens": max((st["decode_tokens"] + st["prefill_tokens"] for st in steps), default=0),
        }
    )
    groups: dict[str, list] = {}
    for r, o in zip(requests, outputs):
        groups.setdefault(r.group, []).append(o.outputs[0].metrics)
    if len(groups) > 1:
        row["groups"] = {
            g: {
                "requests": len(ms),
                "ttft_p50_s": percentile([m.ttft_s for m in ms], 50),
                "ttft_p95_s": percentile([m.ttft_s for m in ms], 95),
                "tpot_p95_s": percentile([m.tpot_s for m in ms], 95),
            }
            for g, ms in groups.items()
        }
    return row, {o.request_id: list(o.outputs[0].token_ids) for o in outputs}


def field(row: dict[str, Any], name: str) -> Any:
    """A figure of a variant's row; `group.figure` (e.g. short.ttft_p95_s) reads a request group's."""
    if "." in name:
        group, key = name.split(".", 1)
        return row.get("groups", {}).get(group, {}).get(key)
    return row.get(name)


def _y(row: dict[str, Any], name: str, scale: float) -> float:
    """A plotted figure; one the row lacks is NaN (no point, no bar), never a zero."""
    value = field(row, name)
    return float("nan") if value is None else scale * value


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "ms":
        return f"{1000 * value:.1f}"
    return format(value, fmt)


def format_table(report: dict[str, Any], columns: list[str]) -> str:
    rows = report["variants"]
    groups = sorted({g for r in rows.values() for g in r.get("groups", {})})
    head = (
        ["variant"]
        + [COLUMNS[c][0] for c in columns]
        + [f"{g} {k}" for g in groups for k in ("TTFT p50", "TTFT p95", "TPOT p95")]
    )
    body = []
    for name, r in rows.items():
        cells = [name] + [_cell(r.get(c), COLUMNS[c][1]) for c in columns]
        for g in groups:
            m = r.get("groups", {}).get(g, {})
            cells += [_cell(m.get(k), "ms") for k in ("ttft_p50_s", "ttft_p95_s", "tpot_p95_s")]
        body.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]

    def line(cells) -> str:
        return "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    w = report["workload"]
    out = [
        f"workload {w['name']}: {w['requests']} requests, {w['prompt_tokens']} prompt tokens (times in ms)",
        line(head),
    ] + [line(b) for b in body]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------- the walkthrough


def walkthrough(loaded, engine_cfg: EngineConfig, s: dict[str, Any]) -> dict[str, Any]:
    """The continuous-batching post's example: requests (arrival step, prompt, max new tokens), max batch 4."""
    max_batch = s.get("max_batch_size", 4)
    requests = [(a, loaded.tokenizer.encode(text, add_special_tokens=False), n) for a, text, n in arrivals(s)]
    cfg = dataclasses.replace(
        engine_cfg, max_num_seqs=max_batch, max_num_batched_tokens=max(engine_cfg.max_num_batched_tokens, max_batch)
    )
    continuous = _walk(loaded, cfg, requests, static=False)
    static = _walk(loaded, cfg, requests, static=True)
    print("Continuous batching: which sequences ran each step, and their cache lengths after it")
    for line in continuous["log"]:
        print("  " + line)
    print(f"\n{'':<12}{'request':>8}{'arrives':>8}{'admitted':>9}{'completed':>10}{'queue steps':>12}")
    for kind, run in (("continuous", continuous), ("static", static)):
        for r in run["requests"]:
            print(
                f"{kind:<12}{r['id']:>8}{r['arrival_step']:>8}{r['admitted_step']:>9}{r['completed_step']:>10}"
                f"{r['admitted_step'] - r['arrival_step']:>12}"
            )
    print(
        f"steps: continuous {continuous['steps']}, static {static['steps']}; the post: completed at steps 15, 20, "
        f"16 (it counts a prefill step apart from the decodes)"
    )
    agree = [r["tokens"] for r in continuous["requests"]] == [r["tokens"] for r in static["requests"]]
    return {
        "continuous": continuous,
        "static": static,
        "greedy_tokens_agree": agree,
        "arrivals": [[a, len(p), n] for a, p, n in requests],
        "max_batch_size": max_batch,
    }


def _walk(loaded, cfg: EngineConfig, requests, static: bool) -> dict[str, Any]:
    """Step the engine over the arrivals. continuous: a request joins the running batch at its arrival step.
    static: a batch runs to its end before the next one starts, made of what has arrived by then."""
    engine = Engine(loaded, cfg, SamplingParams(temperature=0.0))

    def add(i: int, step: int) -> None:
        _, prompt, n = requests[i]
        engine.add_request(
            prompt_token_ids=prompt,
            request_id=str(i),
            arrival_step=step,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
        )

    pending = list(range(len(requests)))
    if not static:
        for i in pending:
            add(i, requests[i][0])
        pending = []
    log, completed = [], {}
    while pending or engine.has_unfinished():
        if not engine.has_unfinished():  # static: the batch is done; what has arrived forms the next one
            step = max(engine.step_index, min(requests[i][0] for i in pending))
            batch = [i for i in pending if requests[i][0] <= step][: cfg.max_num_seqs]
            for i in batch:
                add(i, step)
                pending.remove(i)
        out = engine.step()
        if not out.batch_size:
            continue
        for f in out.finished:
            completed[engine.request_of(f)] = out.step
        cache = ", ".join(f"req {q.request_id}: {q.num_computed_tokens}" for q in engine.running_sequences())
        done = sorted(engine.request_of(f) for f in out.finished)
        log.append(
            f"[step {out.step}] {out.num_prefill_tokens} prefill + {out.num_decode_tokens} decode tokens; "
            f"cache {{{cache}}}" + (f"; completed {', '.join('req ' + d for d in done)}" if done else "")
        )
    rows = []
    for i, (a, p, n) in enumerate(requests):
        (seq,) = engine.sequences(str(i))
        rows.append(
            {
                "id": i,
                "arrival_step": a,
                "prompt_tokens": len(p),
                "max_new_tokens": n,
                "admitted_step": seq.admitted_step,
                "completed_step": completed.get(str(i)),
                "tokens": list(seq.output_token_ids),
            }
        )
    return {"requests": rows, "steps": engine.step_index, "log": log}


# ------------------------------------------------------------------------------------------- the plot


def plot(report: dict[str, Any], s: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    if "variants" not in report:  # the walkthrough: arrival, admission, completion per request, both ways
        fig, ax = plt.subplots(figsize=(7, 3))
        for k, (kind, color) in enumerate((("continuous", "tab:blue"), ("static", "tab:orange"))):
            for r in report[kind]["requests"]:
                y = r["id"] + 0.2 * k
                ax.plot([r["arrival_step"], r["admitted_step"]], [y, y], ":", color=color)
                ax.plot(
                    [r["admitted_step"], r["completed_step"]],
                    [y, y],
                    "-",
                    color=color,
                    linewidth=4,
                    label=kind if r["id"] == 0 else None,
                )
        ax.set_xlabel("engine step (dotted: waiting; bar: admitted to completed)")
        ax.set_ylabel("request")
        ax.legend(fontsize=8)
    else:
        rows = report["variants"]
        x_field = s.get("plot_x")
        y_fields = s.get("plot_y") or ["output_tok_per_s", "tpot_p95_s"]
        fig, axes = plt.subplots(1, len(y_fields), figsize=(5 * len(y_fields), 3.6))
        axes = axes if len(y_fields) > 1 else [axes]
        for ax, y in zip(axes, y_fields):
            scale = 1000 if y.endswith("_s") and not y.endswith("per_s") else 1  # seconds drawn in ms
            swept = {n: r for n, r in rows.items() if x_field and x_field in r["overrides"] and "=" in n}
            others = {n: r for n, r in rows.items() if n not in swept}
            if swept:
                xs = [r["overrides"][x_field] for r in swept.values()]
                if all(is_number(v) and v > 0 for v in xs):  # a count or size: powers of two apart
                    ax.set_xscale("log", base=2)
                else:  # categories (a policy, a flag): one slot each, in the sweep's order
                    ax.set_xticks(range(len(xs)), [str(v) for v in xs])
                    xs = list(range(len(xs)))
                ax.plot(xs, [_y(r, y, scale) for r in swept.values()], "o-", label=f"swept {x_field}")
                ax.set_xlabel(x_field)
                for n, r in others.items():
                    ax.axhline(_y(r, y, scale), linestyle="--", color="grey")
                    ax.text(min(xs), _y(r, y, scale), f" {n}", fontsize=8, va="bottom")
            else:
                ax.bar(list(others), [_y(r, y, scale) for r in others.values()])
                ax.tick_params(axis="x", labelrotation=20)
            ax.set_ylabel(
                COLUMNS.get(y.split(".")[-1], (y,))[0]
                + (f" ({y.split('.')[0]})" if "." in y else "")
                + (" (ms)" if scale == 1000 else "")
            )
        fig.suptitle(s.get("title") or report["workload"]["name"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
