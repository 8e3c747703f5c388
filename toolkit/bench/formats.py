"""mode=precision (experiment=precision): what the model's format and the KV storage do to the tokens, the
distributions and the speed.

The same greedy requests run once per variant, `<model dtype>[/<kv storage>]` (float32 first: the reference
run), each recorded as a normal run directory (replay and verify work on it). Then, per variant:

- against the float64 reference (the textbook forward on the fp32 weights in float64) and the fp32 reference
  (the fp32 engine's own forward, one no-cache prefill) on the variant's own tokens: mean, p99 and max of the
  per-token |recorded raw logprob - reference|;
- for a 16-bit model, HF transformers' spread in that format on the same tokens: p99 |HF sdpa - HF eager|,
  and p99 |ours - HF eager| beside it (issue 44's yardstick: ours within twice HF's own spread);
- greedy agreement with the float32 run: identical requests, requests keeping their first 8 tokens, the first
  differing position of each;
- speed: the run's output tokens per second and a pure decode step at batch 1 (one stream's time per token).

Writes precision.json and precision.png (the error distributions and step times) in the run directory.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from toolkit.bench.kv_quantization import parse_variant, variant_list
from toolkit.config import EngineConfig, ModelConfig, check, from_mapping
from toolkit.engine.core import Engine
from toolkit.engine.runner import recompute_logits
from toolkit.engine.synthetic import decode_step_ms
from toolkit.errors import ConfigError
from toolkit.kv.quant import is_quantized
from toolkit.models import load_model
from toolkit.models.loading import hf_reference_model, load_checkpoint
from toolkit.models.reference import reference_logits
from toolkit.runs.plots import _pyplot
from toolkit.runs.session import record
from toolkit.runs.workload import add_specs, workload_specs
from toolkit.trace.diverge import first_difference
from toolkit.trace.reader import read_samples

MODEL_DTYPES = ("float32", "bfloat16", "float16")


def parse(text: str) -> tuple[str, str, str]:
    """'bfloat16' -> (bfloat16, auto, block); 'float32/int8/channel' -> (float32, int8, channel)."""
    dtype, _, kv = str(text).partition("/")
    if dtype not in MODEL_DTYPES:
        raise ConfigError(
            f"precision.variants: bad variant {text!r}: start with a model dtype "
            f"({', '.join(MODEL_DTYPES)}), then optionally /<kv storage> as in kv_quantization"
        )
    try:
        kv_dtype, granularity = parse_variant(kv or "auto", option="precision.variants")
    except ConfigError as exc:  # the KV storage part: name the whole variant
        raise ConfigError(f"{exc} (the KV storage of {text!r})") from None
    return dtype, kv_dtype, granularity


def precision_options(study: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The precision section checked before a model loads: its variants (float32 first), hf_spread."""
    variants = variant_list(study.get("variants"), "precision.variants", parse, ("float32", "auto", "block"))
    hf_spread = study.get("hf_spread", True)
    check(isinstance(hf_spread, bool), f"precision.hf_spread must be true or false, got {hf_spread!r}")
    return variants


def _stats(diffs: torch.Tensor) -> dict[str, float]:
    return {"mean": float(diffs.mean()), "p99": float(diffs.quantile(0.99)), "max": float(diffs.max())}


def _hf_logprobs(model, impl: str, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Raw logprobs of tokens[prompt_len:] under an HF model with attention implementation `impl`."""
    model.set_attn_implementation(impl)
    with torch.inference_mode():
        logits = model(torch.tensor([tokens[:-1]])).logits[0].double()
    return logits.log_softmax(-1)[prompt_len - 1 :].gather(1, torch.tensor(tokens[prompt_len:])[:, None])[:, 0]


def run_precision(cfg: DictConfig, run_dir: Path) -> int:
    study = OmegaConf.to_container(cfg.precision, resolve=True)
    variants = precision_options(study)
    specs, rejected = workload_specs(cfg)
    if rejected:
        raise ConfigError(f"precision needs a clean workload: {rejected[0].reason}")
    model_cfg = from_mapping(
        ModelConfig, {**OmegaConf.to_container(cfg.model, resolve=True), "dtype": "float32"}, section="model"
    )
    fp32 = load_model(model_cfg)
    hf_fp32 = hf_reference_model(load_checkpoint(model_cfg)) if study.get("hf_spread", True) else None
    hf_by_dtype: dict[str, Any] = {}
    results: list[dict[str, Any]] = []
    reference_tokens: dict[str, list[int]] = {}
    for dtype, kv_dtype, granularity in variants:
        name = dtype + (
            ""
            if kv_dtype == "auto"
            else f"/{kv_dtype}" + (f"-{granularity}" if is_quantized(kv_dtype) and granularity != "block" else "")
        )
        variant_cfg = OmegaConf.merge(
            cfg,
            {"model": {"dtype": dtype}, "engine": {"kv_cache_dtype": kv_dtype, "kv_scale_granularity": granularity}},
        )
        engine = Engine.from_config(variant_cfg)
        ids, bad = add_specs(engine, specs)
        if bad:
            raise ConfigError(f"precision: {bad[0].reason}")
        print(f"{name}: {len(ids)} requests ...", flush=True)
        out = run_dir / name.replace("/", "_")
        recorded = record(engine, ids, out, variant_cfg, progress=False, plots=False)
        tokens = {o.request_id: list(o.outputs[0].token_ids) for o in recorded.outputs}
        reference_tokens = reference_tokens or tokens
        rows: dict[str, list[dict]] = {}
        for r in read_samples(out).to_pylist():
            rows.setdefault(r["request_id"], []).append(r)
        if hf_fp32 is not None and dtype != "float32" and dtype not in hf_by_dtype:
            # HF's model in this format: a copy (.to() converts in place), made once per format
            hf_by_dtype[dtype] = copy.deepcopy(hf_fp32).to(getattr(torch, dtype))
        hf_low = hf_by_dtype.get(dtype)
        errors: dict[str, list[torch.Tensor]] = {"float64": [], "float32": [], "hf_spread": [], "ours_vs_hf": []}
        for rid, seq_rows in rows.items():
            seq_rows.sort(key=lambda r: r["position"])
            seq_rows = [r for r in seq_rows if r["token_id"] >= 0]
            if not seq_rows:
                continue
            prompt_len = seq_rows[0]["position"]
            full = list(engine.sequences(rid)[0].token_ids[:prompt_len]) + [r["token_id"] for r in seq_rows]
            recorded_lp = torch.tensor([r["raw_logprob"] for r in seq_rows], dtype=torch.float64)
            picked = torch.tensor(full[prompt_len:])[:, None]
            for ref, logits in (
                ("float64", reference_logits(fp32.model, full[:-1])),
                ("float32", recompute_logits(fp32.model, full[:-1]).double()),
            ):
                lp = logits.log_softmax(-1)[prompt_len - 1 :].gather(1, picked)[:, 0]
                errors[ref].append((recorded_lp - lp).abs())
            if hf_low is not None:
                hf = {impl: _hf_logprobs(hf_low, impl, full, prompt_len) for impl in ("eager", "sdpa")}
                errors["hf_spread"].append((hf["sdpa"] - hf["eager"]).abs())
                errors["ours_vs_hf"].append((recorded_lp - hf["eager"]).abs())
        divergence = {rid: first_difference(reference_tokens[rid], t) for rid, t in tokens.items()}
        result = {
            "variant": name,
            "model_dtype": dtype,
            "kv_cache_dtype": kv_dtype,
            "kv_scale_granularity": granularity,
            "identical_fraction": sum(d is None for d in divergence.values()) / len(divergence),
            "first_8_kept_fraction": sum(d is None or d >= 8 for d in divergence.values()) / len(divergence),
            "first_divergence": divergence,
            "vs_float64": _stats(torch.cat(errors["float64"])),
            "vs_float32": _stats(torch.cat(errors["float32"])),
            "rows": int(sum(len(e) for e in errors["float64"])),
            "output_tok_per_s": recorded.summary.get("output_tok_per_s"),
            "run_dir": str(out),
            "attention_backend": engine.attention_backend,
            "matmul_backend": engine.matmul_backend,
        }
        if errors["hf_spread"]:
            result["hf_spread_p99"] = float(torch.cat(errors["hf_spread"]).quantile(0.99))
            result["ours_vs_hf_eager_p99"] = float(torch.cat(errors["ours_vs_hf"]).quantile(0.99))
        results.append(result)
    # a pure decode step at batch 1 per model format, the formats alternating (3 rounds, medians): one stream's
    # time per token, measured side by side so that drift hits every format alike
    dtypes = list(dict.fromkeys(r["model_dtype"] for r in results))
    models = {d: fp32 if d == "float32" else load_model(dataclasses.replace(model_cfg, dtype=d)) for d in dtypes}
    times: dict[str, list[float]] = {d: [] for d in dtypes}
    for _ in range(3):
        for d in dtypes:
            times[d].append(decode_step_ms(models[d], EngineConfig(), 1, 128))
    for r in results:
        r["decode_step_batch1_ms"] = sorted(times[r["model_dtype"]])[1]
    (run_dir / "precision.json").write_text(json.dumps({"variants": results}, indent=2))
    _plot(results, run_dir / "precision.png")
    print(
        f"\n{'variant':<24} {'identical':>9} {'first 8':>7} {'|dlogp| vs float64 mean/p99/max':>32} "
        f"{'vs fp32 p99':>11} {'HF spread p99':>13} {'ours-HF p99':>11} {'step b=1':>9} {'tok/s':>7}"
    )
    for r in results:
        f64 = r["vs_float64"]
        print(
            f"{r['variant']:<24} {100 * r['identical_fraction']:>8.0f}% {100 * r['first_8_kept_fraction']:>6.0f}% "
            f"{f64['mean']:>10.4f} {f64['p99']:>10.4f} {f64['max']:>10.4f} {r['vs_float32']['p99']:>11.4f} "
            f"{r.get('hf_spread_p99', float('nan')):>13.4f} {r.get('ours_vs_hf_eager_p99', float('nan')):>11.4f} "
            f"{r['decode_step_batch1_ms']:>7.1f}ms {r['output_tok_per_s'] or 0:>7.1f}"
        )
    print(f"precision.json, precision.png and one run directory per variant: {run_dir}")
    return 0


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    plt = _pyplot()
    fig, (errs, steps) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["variant"] for r in results]
    x = range(len(names))
    for k, stat in enumerate(("mean", "p99", "max")):
        errs.bar([i + (k - 1) * 0.27 for i in x], [r["vs_float64"][stat] for r in results], width=0.27, label=stat)
    errs.set_yscale("log")
    errs.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    errs.set_ylabel("|raw logprob - float64 reference|")
    errs.set_title("per-token logprob error (own tokens, teacher-forced)")
    errs.legend(fontsize=8)
    steps.bar(list(x), [r["decode_step_batch1_ms"] for r in results], color="grey")
    steps.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    steps.set_ylabel("ms")
    steps.set_title("decode step at batch 1 (context 128)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
