"""The host's share of a decode step (issue 56): milliseconds a step spends outside the model's forward, per batch
size, on a one-layer model whose forward costs next to nothing. What is left is the engine's own Python: the
scheduling, the runner's inputs, the processors and the sampler's bookkeeping, the commit and its trace rows. On a
GPU that work is what keeps the device idle between steps (its busy share); it is the same code on the CPU, so it
is measured here.

    python -m toolkit.bench.host_step                        # batch 1, 8 and 32, async scheduling off and on
    python -m toolkit.bench.host_step --batches 32 --repeats 9
    python -m toolkit.bench.host_step --route device         # the host code a GPU's steps run (devices.device_route)

Each figure is the median of `--repeats` fresh engines' `--steps` steps after a warm-up, the forward's own seconds
taken out; the machine is named beside it."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from toolkit import devices
from toolkit.bench.clocks import ForwardClock
from toolkit.bench.gpu_shapes import SHAPES
from toolkit.bench.options import entry_point, positive_int
from toolkit.bench.precision import machine
from toolkit.config import EngineConfig, ModelConfig
from toolkit.engine.synthetic import decode_engine
from toolkit.models import load_model

# the benchmark's tiny shape cut to one narrow layer: the forward is a small share of the step, so the host's is timed
SHAPE = {
    **SHAPES["tiny"],
    "num_layers": 1,
    "hidden_size": 64,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 128,
}


def host_ms(loaded, clock: ForwardClock, batch: int, async_: bool, steps: int, repeats: int) -> list[float]:
    """Each repeat's host ms a step outside the forward: a fresh engine at `batch`, `steps` steps after 10."""
    cfg = EngineConfig(device="cpu", cuda_graphs="eager", async_scheduling=async_)
    figures = []
    for _ in range(repeats):
        engine = decode_engine(loaded, cfg, batch, 64, steps=steps + 20)
        for _ in range(10):
            engine.step()
        clock.seconds, t = 0.0, time.perf_counter()
        for _ in range(steps):
            engine.step()
        figures.append((time.perf_counter() - t - clock.seconds) / steps * 1e3)
    return figures


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(prog="python -m toolkit.bench.host_step", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=positive_int, default=200)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--route", choices=["cpu", "device"], default="cpu", help="device: devices.device_route")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the host's Python is one thread; the forward's threads would only add noise
    loaded = load_model(ModelConfig(**SHAPE), device="cpu")
    clock = ForwardClock(loaded.model)
    print(
        f"host ms a decode step outside the forward ({args.route}'s route), median of {args.repeats} x "
        f"{args.steps} steps; {machine('cpu')}"
    )
    result = {}
    for batch in args.batches:
        for async_ in (False, True):
            with devices.device_route() if args.route == "device" else contextlib.nullcontext():
                figures = host_ms(loaded, clock, batch, async_, args.steps, args.repeats)
            key = f"batch {batch}{' async' if async_ else ''}"
            result[key] = statistics.median(figures)
            print(
                f"  {key:16s} {result[key]:.3f} ms ({result[key] / batch * 1e3:.1f} us a row; "
                f"min {min(figures):.3f}, max {max(figures):.3f})",
                flush=True,
            )
    return result


if __name__ == "__main__":
    raise SystemExit(entry_point(main))
