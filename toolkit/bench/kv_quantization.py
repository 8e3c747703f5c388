"""mode=kv_quantization (experiment=kv_quantization): how much does quantising the KV cache change the output?

The same requests run once per KV storage variant (`auto` first: the reference), each
recorded as a normal run directory (so replay and verify work on it), then:

- tokens: the fraction of requests whose tokens equal the `auto` run's, the fraction that keep
  at least their first 8, and per request the first position where they differ (None: identical);
- teacher forcing: `verify` recomputes every recorded token's raw logprob with the full
  precision reference on the run's own tokens; the max and mean |recorded - recomputed|
  measure what the quantised cache did to the distribution itself (the `auto` run's own
  figures are the fp32 noise floor);
- memory: KV bytes per token (K and V of every layer, per-block scales included).

Writes kv_quantization.json and kv_quantization.png (distribution of the first divergence
positions per variant) in the run directory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from toolkit.config import check
from toolkit.engine.core import Engine
from toolkit.errors import ConfigError
from toolkit.kv.quant import is_quantized
from toolkit.reproduce.verify import check_reference, verify
from toolkit.runs.plots import _pyplot
from toolkit.runs.session import record
from toolkit.runs.workload import add_specs, workload_specs
from toolkit.trace.diverge import first_difference

KV_VARIANTS = ("auto", "bf16", "int8", "fp8_e4m3")


def parse_variant(text: str, option: str = "kv_quantization.variants") -> tuple[str, str]:
    """'int8' -> (int8, block); 'fp8_e4m3/tensor' -> (fp8_e4m3, tensor); 'int8/channel' -> (int8, channel). A bad
    one is a ConfigError naming `option`, the list it came from."""
    dtype, _, granularity = str(text).partition("/")
    granularity = granularity or "block"
    if (
        dtype not in KV_VARIANTS
        or granularity not in ("block", "tensor", "channel")
        or (granularity != "block" and not is_quantized(dtype))
    ):
        raise ConfigError(
            f"{option}: bad variant {text!r}; use one of {', '.join(KV_VARIANTS)}, "
            f"optionally int8/tensor, int8/channel, fp8_e4m3/tensor or fp8_e4m3/channel"
        )
    return dtype, granularity


def variant_list(values: Any, option: str, parse: Callable[[str], tuple], reference: tuple) -> list[tuple]:
    """`option`'s variants parsed, `reference` first (added where missing): a ConfigError naming `option` for
    anything but a non-empty list of variants, or for one named twice (int8 and int8/block are one)."""
    check(
        isinstance(values, list) and bool(values) and all(isinstance(v, str) for v in values),
        f"{option} must be a non-empty list of variants, e.g. [{'/'.join(reference[:1])}, ...], got {values!r}",
    )
    parsed = [parse(v) for v in values]
    twice = next((v for i, v in enumerate(values) if parsed[i] in parsed[:i]), None)
    check(twice is None, f"{option} names {twice!r} twice (the same variant as an earlier one)")
    return [reference] + [v for v in parsed if v != reference]


def kv_quantization_options(study: dict[str, Any]) -> list[tuple[str, str]]:
    """The kv_quantization section checked before any variant runs: its variants (auto first), reference, atol."""
    variants = variant_list(study.get("variants"), "kv_quantization.variants", parse_variant, ("auto", "block"))
    check_reference(study.get("reference", "ours"), study.get("atol", "auto"), "kv_quantization")
    return variants


def run_kv_quantization(cfg: DictConfig, run_dir: Path) -> int:
    study = OmegaConf.to_container(cfg.kv_quantization, resolve=True)
    variants = kv_quantization_options(study)
    specs, rejected = workload_specs(cfg)
    if rejected:
        raise ConfigError(f"kv_quantization needs a clean workload: {rejected[0].reason}")
    results: list[dict[str, Any]] = []
    reference_tokens: dict[str, list[int]] = {}
    for dtype, granularity in variants:
        name = dtype if granularity == "block" or not is_quantized(dtype) else f"{dtype}-{granularity}"
        variant_cfg = OmegaConf.merge(cfg, {"engine": {"kv_cache_dtype": dtype, "kv_scale_granularity": granularity}})
        engine = Engine.from_config(variant_cfg)
        ids, bad = add_specs(engine, specs)
        if bad:
            raise ConfigError(f"kv_quantization: {bad[0].reason}")
        print(f"{name}: {len(ids)} requests ...", flush=True)
        recorded = record(engine, ids, run_dir / name, variant_cfg, progress=False, plots=False)
        tokens = {o.request_id: list(o.outputs[0].token_ids) for o in recorded.outputs}
        if not reference_tokens:
            reference_tokens = tokens
        report = verify(
            run_dir / name,
            reference=study.get("reference", "ours"),
            atol=study.get("atol", "auto"),
            out_dir=run_dir / name / "verify",
        )
        diffs = [c.abs_diff for c in report.checks]
        divergence = {rid: first_difference(reference_tokens[rid], t) for rid, t in tokens.items()}
        cache = engine.kv_cache
        results.append(
            {
                "variant": name,
                "kv_cache_dtype": dtype,
                "kv_scale_granularity": cache.granularity,
                "kv_bytes_per_token": cache.bytes_per_token + cache.scale_bytes_per_block / cache.block_size,
                "identical_fraction": sum(d is None for d in divergence.values()) / len(divergence),
                "first_8_kept_fraction": sum(d is None or d >= 8 for d in divergence.values()) / len(divergence),
                "first_divergence": divergence,
                "teacher_forced_max_abs_logprob_diff": max(diffs, default=0.0),
                "teacher_forced_mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else 0.0,
                "teacher_forced_rows": len(diffs),
                "greedy_rows_still_argmax": report.greedy_rows - report.greedy_argmax_mismatches,
                "greedy_rows": report.greedy_rows,
                "output_tok_per_s": recorded.summary.get("output_tok_per_s"),
                "run_dir": str(run_dir / name),
            }
        )
    base = results[0]["kv_bytes_per_token"]
    for r in results:
        r["kv_bytes_vs_auto"] = r["kv_bytes_per_token"] / base
    report_path = run_dir / "kv_quantization.json"
    report_path.write_text(json.dumps({"reference": study["reference"], "variants": results}, indent=2))
    _plot(results, run_dir / "kv_quantization.png")
    print(
        f"\n{'variant':<18} {'identical':>9} {'first 8 kept':>12} {'first divergences':<28} {'max |dlogp|':>11} "
        f"{'mean |dlogp|':>12} {'KV B/token':>10}"
    )
    for r in results:
        divs = sorted(d for d in r["first_divergence"].values() if d is not None)
        print(
            f"{r['variant']:<18} {100 * r['identical_fraction']:>8.0f}% {100 * r['first_8_kept_fraction']:>11.0f}% "
            f"{str(divs)[:28]:<28} "
            f"{r['teacher_forced_max_abs_logprob_diff']:>11.4f} {r['teacher_forced_mean_abs_logprob_diff']:>12.5f} "
            f"{r['kv_bytes_per_token']:>10.0f}"
        )
    print(f"kv_quantization.json, kv_quantization.png and one run directory per variant: {run_dir}")
    return 0


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    quantised = results[1:]
    longest = max((d for r in quantised for d in r["first_divergence"].values() if d is not None), default=1)
    never = longest + 8
    step = max(1, never // 24)
    ax.hist(
        [[never if d is None else d for d in r["first_divergence"].values()] for r in quantised],
        bins=range(0, never + step + 1, step),
        label=[f"{r['variant']} ({100 * r['identical_fraction']:.0f}% identical)" for r in quantised],
    )  # bars side by side
    ax.axvline(never, color="grey", linestyle=":")
    ax.text(never, ax.get_ylim()[1] * 0.9, " identical", color="grey")
    ax.set_xlabel("first generated position that differs from the auto (fp32) KV run")
    ax.set_ylabel("requests")
    ax.set_title("Greedy divergence caused by KV-cache quantisation")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
