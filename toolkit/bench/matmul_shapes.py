"""The packed matmul's schedules weight shape by weight shape, beside this machine's streaming rate, in one run.

    python -m toolkit.bench.matmul_shapes                       # SmolLM2's shapes, fp32 and bf16
    python -m toolkit.bench.matmul_shapes --shape llama1b --dtypes bfloat16 --rounds 3

`engine.matmul_schedule=auto` picks one schedule per class of rows over all of a model's projections at once
(toolkit/native/schedules.py). This prints the figures behind such a choice one weight shape at a time: for each
projection name (that weight of every layer, read in one pass as a decode step streams them, with copies in fresh
memory where that is under 96 MB) and the LM head, each class of rows and each schedule, the fastest round's
microseconds a weight and the GB/s of weights streamed; the schedules are interleaved a round
(toolkit.native.schedules.measure), and the fastest is marked. Beside them, what the machine streams at the moment:
a sum over 512 MB on huge pages (toolkit.bench.roofline.memory_bandwidth_gbs), measured before and after.
Whether a schedule per weight shape would beat one per class of rows can be read off the table. Random weights of
the named shape; the CPU is named."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from toolkit.bench.gpu_shapes import SHAPES
from toolkit.bench.options import entry_point, positive_int
from toolkit.bench.precision import machine
from toolkit.bench.roofline import memory_bandwidth_gbs
from toolkit.config import ModelConfig
from toolkit.models import load_model
from toolkit.native import library, schedules
from toolkit.native.ops import PackedWeight, arena

PASS_BYTES = 96 << 20  # a pass reads at least this much (copies added): past a 32 MB L3, as a decode step streams


def past_caches(weights: list[PackedWeight], min_bytes: int = PASS_BYTES) -> list[PackedWeight]:
    """`weights`, and copies of them in fresh memory (one huge-page arena) until a pass reads `min_bytes`: a small
    model's one projection of every layer would otherwise sit in the L3 between passes, where a decode step's
    weights never are (each read once a step, all of them past any cache)."""
    total = sum(w.data.numel() * w.data.element_size() for w in weights)
    copies = (max(0, -(-min_bytes // total) - 1) if total else 0) * weights
    buffers = arena([w.data.numel() for w in copies], weights[0].data.dtype)  # as packed_arena lays weights out
    return weights + [dataclasses.replace(w, data=data.copy_(w.data.view(-1))) for w, data in zip(copies, buffers)]


def measure_shapes(model: torch.nn.Module, rounds: int) -> dict[str, dict[str, Any]]:
    """Per projection name (and "lm_head"): its shape, MB a pass, and per class of rows per schedule the fastest
    round's us a weight and GB/s."""
    layers, head = model.packed_weights()
    groups = {name: [layer[name] for layer in layers] for name in layers[0]} | {"lm_head": [head]}
    out = {}
    for name, group in groups.items():
        weights = past_caches(group)
        nbytes = sum(w.data.numel() * w.data.element_size() for w in weights)
        ms = schedules.measure(weights, rounds=rounds)
        out[name] = {
            "shape": [group[0].k, group[0].n],
            "mb_a_pass": nbytes / 1e6,
            "classes": {
                rows: {s: {"us": 1e3 * t / len(weights), "gbs": nbytes / (t / 1e3) / 1e9} for s, t in by.items()}
                for rows, by in ms.items()
            },
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    try:
        library.native()
    except library.KernelUnavailable as exc:  # TOOLKIT_NATIVE=0, or no compiler: nothing of ours to time
        raise SystemExit(f"matmul_shapes: the packed matmul does not run here: {exc}") from None
    result: dict[str, Any] = {"machine": machine("cpu"), "shape": args.shape, "stream_gbs": [memory_bandwidth_gbs()]}
    print(f"the packed matmul's schedules per weight shape, {args.shape}'s shapes, on {result['machine']}")
    for dtype in args.dtypes:
        model = load_model(ModelConfig(**SHAPES[args.shape], dtype=dtype), device="cpu").model
        shapes = result[dtype] = measure_shapes(model, args.rounds)
        auto = schedules.choose("auto", *model.packed_projections())
        print(f"\n{dtype}: us a weight (GB/s streamed), * the fastest; auto chose {auto.describe()}")
        print(f"{'weight':<10} {'K x N':>12} {'rows':>5}  " + "  ".join(f"{s:>16}" for s in schedules.SCHEDULES))
        for name, figures in shapes.items():
            k, n = figures["shape"]
            for rows, by in figures["classes"].items():
                fastest = min(by, key=lambda s, by=by: by[s]["us"])
                cells = (
                    f"{by[s]['us']:>8.1f} ({by[s]['gbs']:>4.1f}){'*' if s == fastest else ' '}"
                    for s in schedules.SCHEDULES
                )
                print(f"{name:<10} {f'{k} x {n}':>12} {rows:>5}  " + "  ".join(cells))
    result["stream_gbs"].append(memory_bandwidth_gbs())
    print(
        f"\nthe machine's stream (a 512 MB fp32 sum on huge pages): {result['stream_gbs'][0]:.1f} GB/s before, "
        f"{result['stream_gbs'][1]:.1f} after"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    raise SystemExit(entry_point(main))
