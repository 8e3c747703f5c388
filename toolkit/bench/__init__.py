"""mode=bench: the same greedy requests through our engine and the tools users would pick instead.

    python run.py mode=bench bench.workload=standard
    python run.py mode=bench bench.num_requests=16 bench.max_tokens=48 bench.roofline=false   # quick

Writes bench.json and bench.png into the run directory and prints the comparison.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from toolkit.bench import grammar_cost, invariant_cost, kernel_cost, kv_cost, roofline, systems, text_cost
from toolkit.bench.options import bench_options, engine_variant, mappings
from toolkit.bench.plots import plot_bench
from toolkit.bench.workloads import BenchRequest, make_workload
from toolkit.config import EngineConfig, ModelConfig, from_mapping
from toolkit.errors import ConfigError, ForeignEngineError
from toolkit.llm import LLM
from toolkit.models import load_model
from toolkit.models.loading import smollm2_dir, smollm2_gguf
from toolkit.native import cpu
from toolkit.runs.metrics import percentile


def _as_list(value) -> list:
    """A config value that may be one item or a list of them."""
    return list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]


def agreement(reference: dict[str, list[int]], other: dict[str, list[int]]) -> dict[str, Any]:
    """How many requests are token-identical (over the shorter length), and the first differing position."""
    first_diff = {}
    for rid, theirs in other.items():
        ours = reference.get(rid, [])
        n = min(len(ours), len(theirs))
        diff = next((i for i in range(n) if ours[i] != theirs[i]), None)
        if diff is not None:
            first_diff[rid] = diff
    return {"identical": len(other) - len(first_diff), "of": len(other), "first_diff": first_diff}


def run_bench(cfg: DictConfig, run_dir: Path) -> int:
    b = OmegaConf.to_container(cfg.bench, resolve=True)
    engine_cfg = from_mapping(EngineConfig, OmegaConf.to_container(cfg.engine, resolve=True), section="engine")
    model_cfg = from_mapping(ModelConfig, OmegaConf.to_container(cfg.model, resolve=True), section="model")
    hf_dir = model_cfg.path or (smollm2_dir() if model_cfg.name == "smollm2" else None)
    bench_options(b, engine_cfg, hf_dir)  # every option, before the model loads and anything is timed
    if engine_cfg.num_threads:
        torch.set_num_threads(engine_cfg.num_threads)
    t0 = time.perf_counter()
    loaded = load_model(model_cfg, engine_cfg.device)
    load_s = time.perf_counter() - t0
    if loaded.tokenizer is None:
        raise ConfigError("mode=bench needs a model with a tokenizer (smollm2 or a local HF checkpoint)")
    workload = make_workload(b["workload"], loaded.tokenizer, b.get("num_requests"), b.get("max_tokens"), b["seed"])
    if b.get("apply_workload_engine_overrides", True) and workload.engine_overrides:
        engine_cfg = dataclasses.replace(engine_cfg, **workload.engine_overrides)
    requests = workload.requests
    run_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"workload {workload.name}: {workload.description}; {len(requests)} requests, "
        f"{sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
        f"{sum(r.max_tokens for r in requests)} output tokens",
        flush=True,
    )

    results: dict[str, systems.SystemResult] = {}
    repeats = b.get("repeats", 1)
    names = [n for n in ("engine", "engine_notrace") if n in b["systems"]]
    runs: dict[str, list[systems.SystemResult]] = {n: [] for n in names}
    for i in range(repeats):  # alternate, so that drift of a shared machine hits both alike
        for name in names:
            trace_dir = run_dir / f"engine_trace_{i}" if name == "engine" else None
            runs[name].append(systems.run_engine(loaded, engine_cfg, requests, trace_dir=trace_dir, name=name))
            print(f"  {name} run {i + 1}/{repeats}: {runs[name][-1].wall_s:.2f} s", flush=True)
    for name in names:
        ordered = sorted(runs[name], key=lambda r: r.wall_s)
        results[name] = ordered[len(ordered) // 2]
        results[name].extra["wall_s_all"] = [r.wall_s for r in ordered]
    sampled = {}
    sampled_variants = mappings(b.get("sampled_variants"), "bench.sampled_variants")
    for variant, fields in sampled_variants.items():  # traced, as the greedy `engine` run
        name = f"engine[{variant}]"
        sampled[name] = systems.run_engine(
            loaded, engine_cfg, requests, trace_dir=run_dir / f"engine_trace_{variant}", name=name, sampling=fields
        )
        sampled[name].extra["sampling"] = fields
        print(f"  {name}: {sampled[name].wall_s:.2f} s", flush=True)
    report_host = (
        _host_work_at_batch(loaded, engine_cfg, requests, b["host_work_batch"], sampled_variants, run_dir)
        if b.get("host_work_batch")
        else None
    )  # decode steps at a full batch, greedy and sampled
    for variant, overrides in mappings(b.get("engine_variants"), "bench.engine_variants").items():
        name = f"engine[{variant}]"
        variant_cfg, spec_cfg = engine_variant(engine_cfg, overrides)
        results[name] = systems.run_engine(loaded, variant_cfg, requests, name=name, speculative=spec_cfg)
        results[name].extra["overrides"] = overrides
        print(f"  {name}: {results[name].wall_s:.2f} s", flush=True)
    if "hf_static" in b["systems"]:
        batch = b.get("hf_batch_size") or engine_cfg.max_num_seqs
        results["hf_static"] = systems.run_hf_static(
            systems.load_hf_model(hf_dir), requests, batch, pad_id=loaded.tokenizer.eos_token_id or 0
        )
        print(f"  hf_static: {results['hf_static'].wall_s:.2f} s", flush=True)
    if "hf_cb" in b["systems"]:
        results["hf_cb"] = systems.run_hf_cb(systems.load_hf_model(hf_dir), requests)
        print(f"  hf_cb: {results['hf_cb'].wall_s:.2f} s", flush=True)
    if "naive" in b["systems"]:
        subset = [
            dataclasses.replace(r, max_tokens=min(r.max_tokens, b["naive_max_tokens"]))
            for r in requests[: b["naive_requests"]]
        ]
        results["naive"] = systems.run_naive(systems.load_hf_model(hf_dir), subset)
        results["naive"].extra["subset"] = f"first {len(subset)} requests, <= {b['naive_max_tokens']} tokens"
        print(f"  naive: {results['naive'].wall_s:.2f} s", flush=True)
    if "llama_cpp" in b["systems"] and systems.llama_cpp_available() and model_cfg.name == "smollm2":
        try:
            results["llama_cpp"] = systems.run_llama_cpp(smollm2_gguf(), requests, torch.get_num_threads())
        except ForeignEngineError as exc:  # its crash is that system's, not the benchmark's
            print(f"  llama_cpp: failed: {exc}", flush=True)

    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": _machine(),
        "model": loaded.model_id,
        "model_load_s": load_s,
        "threads": torch.get_num_threads(),
        "workload": {
            "name": workload.name,
            "description": workload.description,
            "requests": len(requests),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
            "output_tokens": sum(r.max_tokens for r in requests),
        },
        "engine_config": dataclasses.asdict(engine_cfg),
        "systems": {k: v.summary() for k, v in results.items()},
    }
    ours = results.get("engine") or results.get("engine_notrace")
    if ours is not None:
        report["ratios"] = {
            f"engine_over_{k}": ours.summary()["output_tok_per_s"] / v.summary()["output_tok_per_s"]
            for k, v in results.items()
            if k != ours.name
        }
        report["greedy_agreement"] = {k: agreement(ours.tokens, v.tokens) for k, v in results.items() if k != ours.name}
    report["systems"].update({k: v.summary() for k, v in sampled.items()})
    if report_host is not None:
        report["host_work_at_batch"] = report_host
    if sampled and "engine" in results:
        greedy = results["engine"].summary()["output_tok_per_s"]
        report["sampled_over_greedy"] = {k: v.summary()["output_tok_per_s"] / greedy for k, v in sampled.items()}
    if "engine" in results and "engine_notrace" in results:
        report["tracing_overhead"] = results["engine"].wall_s / results["engine_notrace"].wall_s - 1
    if "engine" in results:  # the trace's own work, timed where it runs: steadier than a difference of two runs
        e = results["engine"]
        engine_s, worker_s = e.extra["trace_engine_thread_s"], e.extra["trace_worker_cpu_s"]
        report["trace_work"] = {
            "engine_thread_s": engine_s,
            "worker_cpu_s": worker_s,
            "fraction_of_wall": (engine_s + worker_s) / e.wall_s,
        }
    if workload.baseline_groups and ours is not None:
        report["long_prompt"] = _long_prompt_report(loaded, engine_cfg, requests, workload, ours)
    (run_dir / "bench.json").write_text(json.dumps(report, indent=2))  # the comparison is kept if a later part fails
    if b.get("grammar_cost", False):
        print("  measuring the grammar-masking cost ...", flush=True)
        report["grammar_cost"] = grammar_cost.measure(loaded, engine_cfg, tuple(b.get("grammar_batches") or (1, 16)))
    if b.get("invariant_cost", False):
        print("  measuring the batch-invariant mode's cost ...", flush=True)
        batches = tuple(b.get("invariant_batches") or (1, 16, 64))
        report["invariant_cost"] = invariant_cost.measure(loaded, engine_cfg, batches, repeats=b.get("repeats") or 1)
    if b.get("kv_cost", False):
        print("  measuring what each KV storage buys ...", flush=True)
        report["kv_cost"] = kv_cost.measure(
            loaded,
            engine_cfg,
            tuple(b.get("kv_dtypes") or ("auto", "int8")),
            context=b.get("kv_context", 2048),
            budget_gb=b.get("kv_budget_gb", 0.5),
        )
    if b.get("text_cost", False):
        print("  measuring the text and stop-string work per token ...", flush=True)
        report["text_cost"] = text_cost.measure(loaded, b.get("text_tokens", 4096))
    if b.get("kernel_cost", False):
        report["kernel_cost"] = kernel_cost.measure(
            loaded,
            tuple(b.get("roofline_batches") or (1, 8, 32, 64)),
            context=b["roofline_batch_context"],
            block_size=engine_cfg.block_size,
            repeats=max(5, b.get("repeats") or 1),
        )
    if b.get("serving", False):
        from toolkit.bench import serving  # deferred: toolkit.serve needs the [serve] extra (FastAPI)

        print(f"  serving: {b['serving_clients']} HTTP clients beside LLM.generate ...", flush=True)
        llm = LLM.over(loaded, engine_cfg, trace_root=run_dir / "serving_llm")
        n = min(int(b["serving_requests"]), len(requests))
        report["serving"] = serving.measure(
            llm,
            [r.prompt_token_ids for r in requests[:n]],
            int(b["serving_max_tokens"]),
            int(b["serving_clients"]),
            float(b["serving_stagger_s"]),
            run_dir,
        )
    if b.get("roofline", True):
        print("  measuring the roofline ...", flush=True)
        report["roofline"] = roofline.measure(
            loaded,
            engine_cfg,
            list(b["roofline_batches"]),
            list(b["roofline_contexts"]),
            b["roofline_batch_context"],
            _as_list(b["roofline_context_batch"]),
        )
    (run_dir / "bench.json").write_text(json.dumps(report, indent=2))
    plot_bench(report, run_dir / "bench.png")
    print_report(report, run_dir)
    return 0


def _host_work_at_batch(
    loaded, engine_cfg, requests: list[BenchRequest], batch: int, variants: dict, run_dir: Path
) -> dict[str, Any]:
    """`batch` requests admitted together (their prompts cut to 32 tokens so that all are prefilled within
    a few steps; 32 new tokens each; traced): the median decode-only step, at that batch, and its share
    outside the model's forward, greedy and with each sampled variant's fields."""
    group = [
        dataclasses.replace(r, prompt_token_ids=r.prompt_token_ids[:32], arrival_step=0, max_tokens=32)
        for r in requests[:batch]
    ]
    cfg = dataclasses.replace(engine_cfg, max_num_seqs=max(engine_cfg.max_num_seqs, batch))
    out = {}
    for name, fields in {"greedy": {}, **variants}.items():
        result = systems.run_engine(
            loaded,
            cfg,
            group,
            trace_dir=run_dir / f"host_work_trace_{name}",
            name=f"host_work[{name}]",
            sampling=dict(fields or {}),
        )
        out[name] = {
            k: result.extra.get(k)
            for k in ("decode_steps", "decode_batch_p50", "decode_step_p50_s", "decode_host_fraction_p50")
        }
    return out


def _long_prompt_report(loaded, engine_cfg, requests: list[BenchRequest], workload, ours) -> dict[str, Any]:
    """TPOT of the running decodes with the long prompts arriving vs the same decodes alone."""
    group = [r for r in requests if r.group in workload.baseline_groups]
    alone = systems.run_engine(loaded, engine_cfg, group, name="decodes_alone")
    with_prefill = [ours.tpot_s[r.id] for r in group if r.id in ours.tpot_s]
    baseline = [alone.tpot_s[r.id] for r in group if r.id in alone.tpot_s]
    p95_with, p95_alone = percentile(with_prefill, 95), percentile(baseline, 95)
    return {
        "decodes": len(group),
        "tpot_p95_with_long_prefills_s": p95_with,
        "tpot_p95_alone_s": p95_alone,
        "tpot_p95_ratio": p95_with / p95_alone if p95_alone else None,
        "max_num_batched_tokens": engine_cfg.max_num_batched_tokens,
    }


def _machine() -> str:
    return f"{cpu.model_name()}, {os.cpu_count()} cores, torch {torch.__version__}, {platform.system()}"


def _fmt(value, spec=".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_report(report: dict[str, Any], run_dir: Path) -> None:
    print(
        f"\n{report['model']} (load {report['model_load_s']:.2f} s), {report['threads']} threads; {report['machine']}"
    )
    print(
        f"{'system':<15} {'out tok':>8} {'wall s':>8} {'out tok/s':>10} {'tot tok/s':>10} {'ttft p50':>9} "
        f"{'ttft p95':>9} {'tpot p50':>9} {'tpot p95':>9} {'peak RSS':>9}"
    )
    for name, s in report["systems"].items():
        print(
            f"{name:<15} {s['output_tokens']:>8} {s['wall_s']:>8.2f} {s['output_tok_per_s']:>10.1f} "
            f"{s['total_tok_per_s']:>10.1f} {_fmt(s['ttft_p50_s'], '.3f'):>9} {_fmt(s['ttft_p95_s'], '.3f'):>9} "
            f"{_fmt(s['tpot_p50_s'], '.4f'):>9} {_fmt(s['tpot_p95_s'], '.4f'):>9} {_fmt(s['peak_rss_mb'], '.0f'):>7}MB"
        )
    for name, ratio in report.get("ratios", {}).items():
        other = name.removeprefix("engine_over_")
        agree = report["greedy_agreement"][other]
        diff = f", first differing positions {agree['first_diff']}" if agree["first_diff"] else ""
        label = (
            f"{other} / engine: {1 / ratio:.2f}x" if other.startswith("engine[") else f"engine / {other}: {ratio:.2f}x"
        )
        print(f"throughput {label}  (greedy token-identical {agree['identical']}/{agree['of']}{diff})")
        spec = report["systems"][other]
        if spec.get("acceptance_rate") is not None:
            print(
                f"  {other}: acceptance rate {spec['acceptance_rate']:.3f}, mean accepted length "
                f"{spec['mean_accepted_length']:.2f}, target forwards per output token "
                f"{spec['target_forwards_per_output_token']:.3f}"
            )
    for name, ratio in report.get("sampled_over_greedy", {}).items():
        print(
            f"throughput {name} / engine (greedy), both traced: {ratio:.2f}x  ({report['systems'][name]['sampling']})"
        )
    for name, h in report.get("host_work_at_batch", {}).items():
        print(
            f"host work at decode batch {h['decode_batch_p50']:.0f} ({name}): step p50 {1e3 * h['decode_step_p50_s']:.1f} ms, "
            f"outside the forward {100 * h['decode_host_fraction_p50']:.1f}%"
        )
    for name, s in report["systems"].items():
        if s.get("decode_host_fraction_p50") is not None:
            print(
                f"  {name}: decode-only steps {s['decode_steps']}, batch p50 {s['decode_batch_p50']:.0f}, step p50 "
                f"{1e3 * s['decode_step_p50_s']:.1f} ms, outside the forward {100 * s['decode_host_fraction_p50']:.1f}%"
            )
    if "tracing_overhead" in report:
        print(f"tracing overhead: {100 * report['tracing_overhead']:+.1f}% wall time")
    if "trace_work" in report:
        tw = report["trace_work"]
        print(
            f"trace work: {tw['engine_thread_s']:.2f} s in write_step on the engine thread (the logits rows are "
            f"hashed in the engine, beside its steps' Python) + "
            f"{tw['worker_cpu_s']:.2f} s CPU on the writer thread = {100 * tw['fraction_of_wall']:.1f}% "
            f"of the traced run's wall time"
        )
    if "long_prompt" in report:
        lp = report["long_prompt"]
        print(
            f"long_prompt: TPOT p95 of the {lp['decodes']} decodes {lp['tpot_p95_with_long_prefills_s']:.4f} s with "
            f"the long prefills vs {lp['tpot_p95_alone_s']:.4f} s alone: {lp['tpot_p95_ratio']:.2f}x "
            f"(budget {lp['max_num_batched_tokens']})"
        )
    for row in report.get("grammar_cost", []):
        print(
            f"grammar masking at batch {row['batch']:>2}: {row['grammar_ms']:.2f} ms of a {row['step_ms_constrained']:.1f} ms "
            f"step ({100 * row['grammar_fraction_of_step']:.1f}%); unconstrained step {row['step_ms_unconstrained']:.1f} ms"
        )
    tc = report.get("text_cost")
    if tc and "runs" in tc:
        lo, hi = tc["end_over_start_range"]
        print(
            f"text/stop work per token, output of {tc['tokens']} tokens: median of the first {tc['window']} "
            + " / ".join(f"{r['start_us']:.1f}" for r in tc["runs"])
            + " us, of the last "
            + " / ".join(f"{r['end_us']:.1f}" for r in tc["runs"])
            + f" us: end / start {lo:.2f}-{hi:.2f}x "
            f"(text equal to a whole decode: {tc['same_text']})"
        )
    elif tc:
        print(f"text/stop work: {tc['skipped']}")
    for row in report.get("invariant_cost", []):
        print(
            f"batch-invariant step at {row['batch']}: {row['invariant_ms']:.1f} ms vs default {row['default_ms']:.1f} ms "
            f"({row['ratio']:.2f}x)"
        )
    sv = report.get("serving")
    if sv:
        h, d = sv["http"], sv["llm_generate"]
        q = lambda x: "/".join(_fmt(x[k], ".3f") for k in ("p50", "p95", "p99"))  # noqa: E731
        print(
            f"serving, {sv['clients']} streaming HTTP clients, {sv['requests']} requests x {sv['max_tokens']} tokens: "
            f"{h['output_tok_per_s']:.1f} out tok/s, {h['requests_per_s']:.2f} req/s, TTFT p50/p95/p99 "
            f"{q(h['ttft_s'])} s, TPOT {q(h['tpot_s'])} s; LLM.generate {d['output_tok_per_s']:.1f} out tok/s -> HTTP "
            f"overhead {100 * sv['http_overhead']:+.1f}% (same outputs: {sv['same_outputs']})"
        )
    roof = report.get("roofline")
    if roof:
        native = roof.get("gemm_gflops_native") or {}
        print(
            f"roofline: memory read {roof['memory_read_gb_s']:.1f} GB/s; fp32 GEMM GFLOP/s by batch (torch / native): "
            + ", ".join(f"{m}: {r:.0f} / {_fmt(native.get(m), '.0f')}" for m, r in roof["gemm_gflops_torch"].items())
        )
        for r in roof["by_batch"] + roof["by_context"]:
            print(
                f"  batch {r['batch']:>3} context {r['context']:>5}: step {r['step_ms']:7.1f} ms, GEMM roofline "
                f"{r['gemm_bound_ms']:6.1f} ms ({r['gemm_gflops_alongside']:.0f} GFLOP/s, timed alongside) + KV read "
                f"{r['kv_read_ms']:5.1f} ms -> "
                f"{100 * r['fraction_of_gemm_roofline']:.0f}% of GEMM roofline "
                f"({100 * r['fraction_of_torch_gemm_roofline']:.0f}% of torch's), "
                f"{100 * r['fraction_of_bound']:.0f}% of bound, {r['tok_per_s']:.0f} tok/s"
            )
    print(f"bench.json, bench.png: {run_dir}")
