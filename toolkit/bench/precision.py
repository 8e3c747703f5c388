"""Decode steps per model format, measured side by side in one process (issue 44's speed goal: bf16 at
batch 1 >= 1.8x fp32, the weights' bytes halved).

    python -m toolkit.bench.precision                      # SmolLM2 on this CPU, batches 1 and 8
    python -m toolkit.bench.precision --shape --device cuda  # random weights of SmolLM2's shape on a GPU
    TOOLKIT_KERNEL_TARGET=x86-64-v3 python -m toolkit.bench.precision   # AVX2 kernels on an AVX-512 CPU
    python -m toolkit.bench.precision --formats float32 --matmul-schedules auto tiles pairs quads   # the matmul's loops

Each batch size times a pure decode step (toolkit.engine.synthetic.decode_step_ms, context 128) for every
format in turn, `--repeats` rounds, and prints the medians and each one's speed relative to fp32, with the
machine's name beside them."""

from __future__ import annotations

import argparse
import statistics

import torch

from toolkit.bench.options import entry_point, positive_int, torch_device
from toolkit.config import MATMUL_BUILD_SCHEDULES, MATMUL_SCHEDULES, EngineConfig, ModelConfig
from toolkit.engine.synthetic import decode_step_ms
from toolkit.models import load_model
from toolkit.native import cpu, library

FORMATS = ("float32", "bfloat16", "float16")
# SmolLM2-135M's dimensions with random weights (a vocabulary one past its tokenizer's, so none is loaded):
# where the real weights cannot travel (a GPU machine), the same bytes per step
SMOLLM2_SHAPE = dict(
    name="tiny",
    seed=0,
    vocab_size=49153,
    num_layers=30,
    hidden_size=576,
    num_heads=9,
    num_kv_heads=3,
    intermediate_size=1536,
)


def machine(device: str) -> str:
    """The CPU's model name and its bf16 / AMX flags, or the GPU's name."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    name = cpu.model_name()
    flags = cpu.cpu_flags()
    extra = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "asimd") if f in flags]
    return f"{name} ({' '.join(extra) or 'no SIMD flags read'}); kernels: {library.describe_native()}"


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=torch_device, default="cpu")
    parser.add_argument("--shape", action="store_true", help="random weights of SmolLM2's shape, not SmolLM2")
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=positive_int, default=128)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument(
        "--matmul-schedules",
        nargs="+",
        default=["auto"],
        choices=MATMUL_SCHEDULES + MATMUL_BUILD_SCHEDULES,
        help="each format with each engine.matmul_schedule (auto: the one measured for this CPU)",
    )
    args = parser.parse_args(argv)
    base = SMOLLM2_SHAPE if args.shape else dict(name="smollm2")
    models = {f: load_model(ModelConfig(**base, dtype=f), device=args.device) for f in args.formats}
    print(
        f"decode step, {'SmolLM2-shaped random weights' if args.shape else 'SmolLM2'}, context {args.context}, "
        f"on {machine(args.device)}",
        flush=True,
    )
    runs = {  # label -> (format, schedule)
        f if schedule == "auto" else f"{f} {schedule}": (f, schedule)
        for f in args.formats
        for schedule in args.matmul_schedules
    }
    table = {}
    for batch in args.batches:
        times: dict[str, list[float]] = {label: [] for label in runs}
        for _ in range(args.repeats):  # alternating, so drift hits every format and schedule alike
            for label, (f, schedule) in runs.items():
                engine_cfg = EngineConfig(device=args.device, matmul_schedule=schedule)
                times[label].append(decode_step_ms(models[f], engine_cfg, batch, args.context))
        table[batch] = {label: statistics.median(t) for label, t in times.items()}
        first = next(iter(table[batch].values()))
        print(
            f"batch {batch:3d}: "
            + ", ".join(f"{f} {ms:7.2f} ms ({first / ms:4.2f}x)" for f, ms in table[batch].items()),
            flush=True,
        )
    return table


if __name__ == "__main__":
    raise SystemExit(entry_point(main))
