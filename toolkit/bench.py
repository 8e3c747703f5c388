"""mode=bench: the same greedy requests through our engine and HF `generate`, side by side.

HF runs static left-padded batches (in arrival order, batch size = engine.max_num_seqs):
every row of a batch decodes until the longest request of the batch is done, which is
the waste continuous batching removes. Both systems produce exactly each request's
max_tokens (ignore_eos), so output tokens are equal and tok/s compare directly.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from toolkit.config import EngineConfig, ModelConfig, SamplingParams, from_mapping
from toolkit.engine import Engine
from toolkit.errors import ConfigError
from toolkit.metrics import summarize
from toolkit.models import load_model
from toolkit.trace import new_run_id
from toolkit.trace.writer import TraceWriter
from toolkit.workload import chat_workload


def bench_requests(tokenizer, bench_cfg: dict[str, Any]) -> list[dict[str, Any]]:
    specs = chat_workload(num_requests=bench_cfg["num_requests"], seed=bench_cfg["seed"],
                          min_tokens=bench_cfg["min_tokens"], max_tokens=bench_cfg["max_tokens"])
    return [{"id": s.id, "prompt_token_ids": tokenizer.apply_chat_template(s.messages),
             "max_tokens": s.sampling["max_tokens"], "arrival_step": s.arrival_step} for s in specs]


def run_engine(loaded, engine_cfg: EngineConfig, requests: list[dict[str, Any]],
               trace_dir: Path | None = None) -> dict[str, Any]:
    """Serve the requests; with `trace_dir`, stream SampleTrace rows there as `make run` does."""
    engine = Engine(loaded, engine_cfg, SamplingParams(temperature=0.0))
    for r in requests:
        engine.add_request(prompt_token_ids=r["prompt_token_ids"], request_id=r["id"], arrival_step=r["arrival_step"],
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True))
    writer = TraceWriter(trace_dir, new_run_id()) if trace_dir is not None else None
    while engine.has_unfinished():
        out = engine.step()
        if writer is not None:
            writer.write_step(out.samples, out.logits_RV)
    if writer is not None:
        writer.close()  # the last flush counts: generation is not over until the trace is on disk
        engine.last_finish_time = time.perf_counter()
    outputs = [engine.output(r["id"]) for r in requests]
    wall = engine.last_finish_time - engine.first_admission_time
    summary = summarize(outputs, wall, steps=engine.step_index, traced=writer is not None)
    summary["tokens"] = {o.request_id: list(o.output_token_ids) for o in outputs}
    return summary


def run_hf_static(model_dir_or_cfg: ModelConfig, requests: list[dict[str, Any]], batch_size: int,
                  pad_id: int) -> dict[str, Any]:
    """HF `generate`, greedy, static left-padded batches in arrival order."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from toolkit.models.loading import smollm2_dir

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = model_dir_or_cfg.path or smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    for s in range(0, len(requests), batch_size):
        batch = requests[s:s + batch_size]
        width = max(len(r["prompt_token_ids"]) for r in batch)
        ids = torch.tensor([[pad_id] * (width - len(r["prompt_token_ids"])) + r["prompt_token_ids"] for r in batch])
        mask = torch.tensor([[0] * (width - len(r["prompt_token_ids"])) + [1] * len(r["prompt_token_ids"])
                             for r in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, eos_token_id=None,
                                 pad_token_id=pad_id, max_new_tokens=max(r["max_tokens"] for r in batch))
        for row, r in enumerate(batch):
            tokens[r["id"]] = out[row, width:width + r["max_tokens"]].tolist()
    wall = time.perf_counter() - start
    output_tokens = sum(len(t) for t in tokens.values())
    return {"requests": len(requests), "output_tokens": output_tokens, "wall_s": wall,
            "output_tok_per_s": output_tokens / wall, "batch_size": batch_size, "tokens": tokens}


def agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, Any]:
    """Token-identical requests, and the first differing position of the others."""
    first_diff = {}
    for rid, ta in a.items():
        tb = b[rid]
        diff = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if diff is not None or len(ta) != len(tb):
            first_diff[rid] = diff if diff is not None else min(len(ta), len(tb))
    return {"identical": len(a) - len(first_diff), "of": len(a), "first_diff": first_diff}


def run_bench(cfg: DictConfig, run_dir: Path) -> int:
    bench_cfg = OmegaConf.to_container(cfg.bench, resolve=True)
    engine_cfg = from_mapping(EngineConfig, OmegaConf.to_container(cfg.engine, resolve=True), section="engine")
    model_cfg = from_mapping(ModelConfig, OmegaConf.to_container(cfg.model, resolve=True), section="model")
    if engine_cfg.num_threads:
        torch.set_num_threads(engine_cfg.num_threads)
    t0 = time.perf_counter()
    loaded = load_model(model_cfg, engine_cfg.device)
    load_s = time.perf_counter() - t0
    if loaded.tokenizer is None:
        raise ConfigError("mode=bench needs a model with a tokenizer (smollm2 or a local HF checkpoint)")
    requests = bench_requests(loaded.tokenizer, bench_cfg)
    systems = bench_cfg.get("systems") or ["engine", "engine_notrace", "hf_static"]
    results: dict[str, Any] = {}
    # The engine with and without tracing alternate `repeats` times and report their median
    # runs: this machine's speed drifts by several percent between runs.
    engine_runs: dict[str, list[dict[str, Any]]] = {"engine": [], "engine_notrace": []}
    for i in range(max(1, bench_cfg.get("repeats", 1))):
        for name in ("engine", "engine_notrace"):
            if name in systems:
                trace_dir = run_dir / f"engine_trace_{i}" if name == "engine" else None
                engine_runs[name].append(run_engine(loaded, engine_cfg, requests, trace_dir=trace_dir))
    for name, runs in engine_runs.items():
        if runs:
            runs.sort(key=lambda r: r["wall_s"])
            results[name] = {**runs[len(runs) // 2], "wall_s_all": [r["wall_s"] for r in runs]}
    if "hf_static" in systems:
        batch = bench_cfg.get("hf_batch_size") or engine_cfg.max_num_seqs
        results["hf_static"] = run_hf_static(model_cfg, requests, batch, pad_id=loaded.tokenizer.eos_token_id or 0)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "model": loaded.model_id,
        "model_load_s": load_s,
        "threads": torch.get_num_threads(),
        "workload": {k: bench_cfg[k] for k in ("num_requests", "min_tokens", "max_tokens", "seed")},
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests),
        "engine_config": OmegaConf.to_container(cfg.engine, resolve=True),
        "systems": {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in results.items()},
    }
    if "engine" in results and "engine_notrace" in results:
        report["tracing_overhead"] = results["engine"]["wall_s"] / results["engine_notrace"]["wall_s"] - 1
    if "engine" in results and "hf_static" in results:
        report["ratio_engine_over_hf_static"] = (results["engine"]["output_tok_per_s"]
                                                 / results["hf_static"]["output_tok_per_s"])
        report["greedy_agreement"] = agreement(results["engine"]["tokens"], results["hf_static"]["tokens"])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "bench.json").write_text(json.dumps(report, indent=2))
    print_bench(report, run_dir)
    return 0


def print_bench(report: dict[str, Any], run_dir: Path) -> None:
    print(f"model {report['model']} (load {report['model_load_s']:.2f} s), {report['threads']} threads, "
          f"{report['workload']['num_requests']} requests, {report['prompt_tokens']} prompt tokens")
    print(f"{'system':<15} {'out tokens':>10} {'wall s':>8} {'out tok/s':>10}")
    for name, s in report["systems"].items():
        print(f"{name:<15} {s['output_tokens']:>10} {s['wall_s']:>8.2f} {s['output_tok_per_s']:>10.1f}")
    if "tracing_overhead" in report:
        print(f"tracing overhead (engine vs engine_notrace wall time): {100 * report['tracing_overhead']:+.1f}%")
    if "ratio_engine_over_hf_static" in report:
        agree = report["greedy_agreement"]
        print(f"ratio engine / hf_static: {report['ratio_engine_over_hf_static']:.2f}x")
        print(f"greedy outputs token-identical: {agree['identical']}/{agree['of']}"
              + (f" (first differing positions: {agree['first_diff']})" if agree["first_diff"] else ""))
    print(f"bench.json: {run_dir / 'bench.json'}")
