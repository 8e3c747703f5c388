"""Decode speed on a GPU (issue 56), side by side in one process, the device named beside every figure: per
batch bucket, ms a step, tok/s, kernels a step, the GPU's busy share of a step, and ratios against HF
transformers' `generate` on the same weights and against the bandwidth floor (the step's weight bytes at the
device's measured copy bandwidth).

    python -m toolkit.bench.gpu                                  # SmolLM2-135M's shape, fp32 and bf16, on cuda
    python -m toolkit.bench.gpu --shape llama1b --dtypes bfloat16 --batches 1 32
    python -m toolkit.bench.gpu --batch-invariant                # the invariant mode's cost beside the default
    python -m toolkit.bench.gpu --async-scheduling               # engine.async_scheduling beside the default
    python -m toolkit.bench.gpu --batch-invariant --weights-nk   # every projection stored (N, K), as Linear keeps it
    python -m toolkit.bench.gpu --device cpu --shape tiny        # the same figures on the CPU (CI runs this)
    python -m toolkit.bench.gpu --shape path/to/config.json      # any HF config.json of a family the engine reads
    python -m toolkit.bench.gpu --shape qwen3-0.6b               # Qwen3-0.6B's (gpu_shapes.CONFIG_SHAPES)

Random weights of the named shape, or HF transformers' own random init of a config.json's architecture (a GPU
machine reaches no model hub); each bucket puts an engine straight into
a pure decode state at `--context` tokens (toolkit.engine.synthetic) and times `--steps` steps after a warm-up,
then profiles as many again. On the CPU "kernels" are the step's top-level torch ops (a native kernel call counts
as none) and there is no busy share. HF's ms a step is the median interval between its decode steps."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from toolkit.bench.clocks import WaitClock
from toolkit.bench.gpu_kernels import KN, NK, fastest_tilings, kernel_times, tiling
from toolkit.bench.gpu_shapes import CONFIG_SHAPES, SHAPES, shape_config, shape_model, shape_source
from toolkit.bench.options import entry_point, positive_int, torch_device
from toolkit.bench.precision import machine
from toolkit.bench.systems import StepClock
from toolkit.config import EngineConfig
from toolkit.engine.synthetic import decode_engine, timed
from toolkit.errors import ModelLoadError, ToolkitError
from toolkit.models import DTYPES, LoadedModel
from toolkit.models.families import arch_from_hf_config
from toolkit.native import gpu_matmul as gm

# issue 56's goals: (shape, dtype or None for every dtype, batch) -> the most ms a step
STEP_GOALS_MS = {("smollm2", None, 1): 2.5, ("llama1b", "bfloat16", 1): 3.0}
TOK_S_GOALS = {("llama1b", "bfloat16", 32): 8000.0}
HF_RATIO_GOAL, BUSY_GOAL = 5.0, 0.70


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_weight_bytes(loaded: LoadedModel) -> int:
    """The bytes of weights a decode step reads: every parameter but the input embedding (a row per token)."""
    return sum(p.numel() * p.element_size() for name, p in loaded.model.named_parameters() if name != "embed")


def copy_bandwidth_gbs(device: torch.device, size_mb: int = 512, repeats: int = 5) -> float:
    """GB/s of a device-to-device copy (bytes read plus bytes written), the best of `repeats`."""
    src = torch.ones(size_mb * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() / best / 1e9


def timed_steps(step: Callable[[], Any], device: torch.device, n: int) -> list[float]:
    """ms of each of n calls, the device's queue drained before and after each (synthetic.timed)."""
    out = []
    for _ in range(n):
        sync(device)
        out.append(1000 * timed(lambda: (step(), sync(device))))
    return out


def profile_steps(step: Callable[[], Any], device: torch.device, n: int, table: int = 0) -> tuple[float, float | None]:
    """(kernels a step, ms of kernel time a step): GPU kernels on cuda; on the CPU the top-level torch ops and no
    kernel time. `table`: also print the ops that take the most device time (or CPU time), that many."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(n):
            step()
        sync(device)
    events = prof.events()
    if table:
        key = "device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=table), flush=True)
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        return len(kernels) / n, sum(e.time_range.elapsed_us() for e in kernels) / 1000 / n
    return sum(1 for e in events if e.cpu_parent is None and e.name.startswith("aten::")) / n, None


def host_profile(step: Callable[[], Any], device: torch.device, n: int, title: str, path: Path) -> None:
    """Append to `path` the host functions that n steps spend their time in (cProfile: the top 30 by own time,
    then by cumulative time)."""

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    sync(device)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    with path.open("a") as f:
        f.write(f"==== {title}, {n} steps\n{text.getvalue()}\n")


def engine_bucket(
    loaded: LoadedModel,
    device: torch.device,
    batch: int,
    context: int,
    steps: int,
    batch_invariant: bool,
    profile_to: Path | None = None,
    table: int = 0,
) -> dict[str, Any]:
    """One bucket's figures for one engine configuration (or why the engine refused it); with `profile_to`,
    the host functions its steps spend their time in are appended there."""
    cfg = EngineConfig(device=str(device), batch_invariant=batch_invariant)
    try:
        engine = decode_engine(loaded, cfg, batch, context, steps=(3 if profile_to else 2) * steps + 3)
    except ToolkitError as exc:
        return {"refused": str(exc).splitlines()[0]}
    timed_steps(engine.step, device, 3)
    ms = statistics.median(timed_steps(engine.step, device, steps))
    kernels, kernel_ms = profile_steps(engine.step, device, steps, table)
    if profile_to is not None:
        host_profile(
            engine.step,
            device,
            steps,
            f"{loaded.model.embed.dtype} batch {batch}{' batch-invariant' if batch_invariant else ''}",
            profile_to,
        )
    return {
        "ms": ms,
        "tok_s": 1000 * batch / ms,
        "kernels": kernels,
        "busy": None if kernel_ms is None else min(1.0, kernel_ms / ms),
    }


def warm_engine(loaded: LoadedModel, device: torch.device, batch: int, context: int, steps: int, async_: bool):
    """A decode engine with room for `steps` more steps past 3 warm-up ones, which it has run."""
    cfg = EngineConfig(device=str(device), async_scheduling=async_)
    engine = decode_engine(loaded, cfg, batch, context, steps=2 * steps + 6)
    for _ in range(3):
        engine.step()
    return engine


def back_to_back_ms(
    loaded: LoadedModel, device: torch.device, batch: int, context: int, steps: int, async_: bool
) -> tuple[float, float]:
    """(ms a step, of which the host waited for the device) of `steps` decode steps run one after another, the device
    waited for only after the last: what a serving loop sees, and the only timing in which async scheduling's
    overlap shows (a wait after each step drains the step it queued)."""
    engine = warm_engine(loaded, device, batch, context, steps, async_)
    sync(device)
    with WaitClock() as waits:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        drain = time.perf_counter()
        sync(device)  # the last queued work: a wait too
        elapsed = time.perf_counter() - start
        waits.seconds += start + elapsed - drain
    return 1000 * elapsed / steps, 1000 * waits.seconds / steps


def async_bucket(
    loaded: LoadedModel,
    device: torch.device,
    batch: int,
    context: int,
    steps: int,
    row: dict[str, Any],
    profile_to: Path | None = None,
) -> dict[str, Any]:
    """engine.async_scheduling beside the default, both timed back to back in turn (the better of two each), and the
    GPU's busy share with it: the default's kernel time a step (`row`) over its step. With `profile_to`, the host
    functions of its steps, back to back, are appended there."""
    default, default_wait = min(back_to_back_ms(loaded, device, batch, context, steps, False) for _ in range(2))
    ahead, wait = min(back_to_back_ms(loaded, device, batch, context, steps, True) for _ in range(2))
    if profile_to is not None:
        engine = warm_engine(loaded, device, batch, context, steps, True)
        title = f"{loaded.model.embed.dtype} batch {batch} async scheduling, back to back"
        host_profile(engine.step, device, steps, title, profile_to)
    kernel_ms = None if row["busy"] is None else row["busy"] * row["ms"]
    return {
        "ms": ahead,
        "default_ms": default,
        "host_ms": ahead - wait,  # the host's own work a step: the rest it waited for the device
        "default_host_ms": default - default_wait,
        "tok_s": 1000 * batch / ahead,
        "busy": None if kernel_ms is None else min(1.0, kernel_ms / ahead),
    }


@torch.inference_mode()
def hf_step_ms(model, device: torch.device, batch: int, context: int, tokens: int, vocab: int) -> float:
    """HF generate's ms a decode step (greedy, a batch of `context`-token prompts): the median interval between
    its successive logits-processor calls (its loop reads each step's result on the host), the prompt's
    forward left out."""
    from transformers import LogitsProcessorList  # deferred: transformers, seconds to import

    ids = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(batch)).to(device)
    clock = StepClock()
    for n in (2, tokens):  # a warm-up, then the timed run
        clock.times.clear()
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([clock]),
        )
    return 1000 * statistics.median(b - a for a, b in zip(clock.times, clock.times[1:]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=torch_device, default="cuda")
    parser.add_argument(
        "--shape",
        type=shape_source,
        default="smollm2",
        help=f"{', '.join(sorted(SHAPES) + sorted(CONFIG_SHAPES))}, or an HF config.json (or its directory): random "
        "weights of that shape",
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=positive_int, default=64)
    parser.add_argument("--steps", type=positive_int, default=16, help="steps timed (and as many profiled) a bucket")
    parser.add_argument("--hf-tokens", type=int, default=16, help="tokens HF generates a timing (0: no HF)")
    parser.add_argument("--batch-invariant", action="store_true", help="also time engine.batch_invariant=true")
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="also time engine.async_scheduling=true, its steps and the default's back to back (no wait between)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument(
        "--kernels", action="store_true", help="time the invariant Triton matmuls beside torch's, and nothing else"
    )
    parser.add_argument("--kernel-table", type=int, default=0, help="print each bucket's costliest ops, this many")
    parser.add_argument("--host-profile", type=Path, help="append each bucket's host profile (cProfile) here")
    for flag, which in (("--dot-blocks", "16-bit"), ("--dot-blocks-fp32", "fp32")):
        parser.add_argument(
            flag,
            type=tiling,
            help=f"BM,BN,BK: the invariant matmul's tiling of {which} inputs for this run (a tiling to compare)",
        )
    parser.add_argument(
        "--dot-blocks-from",
        type=Path,
        help="a --kernels run's --json: each product its fastest tiling there (gpu_matmul.DOT_BLOCKS_BY_SHAPE)",
    )
    parser.add_argument(
        "--weights-nk", action="store_true", help="store every projection (N, K), as torch's Linear does, not (K, N)"
    )
    args = parser.parse_args(argv)
    try:  # a config.json the engine cannot run is one line before anything is timed
        config = shape_config(args.shape)
        dims = SHAPES[args.shape] if config is None else asdict(arch_from_hf_config(config))
    except ModelLoadError as exc:
        parser.error(f"--shape: {exc}")
    gm.DOT_BLOCKS = args.dot_blocks or gm.DOT_BLOCKS
    gm.DOT_BLOCKS_FP32 = args.dot_blocks_fp32 or gm.DOT_BLOCKS_FP32
    if args.dot_blocks_from:  # the kernel table's figures of the weights' order the engines will hold
        if not args.dot_blocks_from.is_file():
            parser.error(f"--dot-blocks-from: no file {args.dot_blocks_from} (write one with --kernels --json)")
        figures = json.loads(args.dot_blocks_from.read_text())["kernel_figures"]
        held = NK if args.weights_nk else KN
        formats = {f["dtype"] for f in figures}
        sixteen = next((d for d in ("bfloat16", "float16") if d in args.dtypes and d in formats), None)
        gm.DOT_BLOCKS_BY_SHAPE = fastest_tilings(figures, sixteen, held) if sixteen else {}
        gm.DOT_BLOCKS_BY_SHAPE_FP32 = fastest_tilings(figures, "float32", held) if "float32" in formats else {}
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here (torch.cuda.is_available() is False): try --device cpu")
    where = machine(args.device)
    bandwidth = copy_bandwidth_gbs(device, 512 if device.type == "cuda" else 128)
    order = "(N, K)" if args.weights_nk else "(K, N)"
    print(
        f"decode steps, random weights of {args.shape}'s shape, context {args.context}, on {where}; "
        f"copy bandwidth {bandwidth:.0f} GB/s; the invariant matmul's tilings {gm.describe_tiling(torch.bfloat16)} "
        f"(16-bit), {gm.describe_tiling(torch.float32)} (fp32); the weights stored {order}",
        flush=True,
    )
    results: dict[str, Any] = {"device": where, "shape": str(args.shape), "copy_bandwidth_gbs": bandwidth, "rows": []}
    if args.kernels:
        results["kernels"], results["kernel_figures"] = kernel_times(dims, args.dtypes, args.batches, device)
        print("\n".join(results["kernels"]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        return results
    results["weights"] = order  # (the kernel table times both orders)
    for dtype in args.dtypes:
        loaded, hf = shape_model(args.shape, dtype, device, hf=args.hf_tokens > 1)
        if args.weights_nk:  # both modes read them so: the invariant matmul's loads, cuBLAS's transposed operand
            gm.store_weights_nk(loaded.model)
        floor_ms = 1000 * step_weight_bytes(loaded) / (bandwidth * 1e9)
        for batch in args.batches:
            row = {
                "dtype": dtype,
                "batch": batch,
                "floor_ms": floor_ms,
                **engine_bucket(
                    loaded, device, batch, args.context, args.steps, False, args.host_profile, args.kernel_table
                ),
            }
            if args.batch_invariant:
                row["invariant"] = engine_bucket(
                    loaded, device, batch, args.context, args.steps, True, args.host_profile, args.kernel_table
                )
            if args.async_scheduling and "ms" in row:
                row["async"] = async_bucket(loaded, device, batch, args.context, args.steps, row, args.host_profile)
            if hf is not None:
                row["hf_ms"] = hf_step_ms(hf, device, batch, args.context, args.hf_tokens, loaded.arch.vocab_size)
            results["rows"].append(row)
            print(describe(row), flush=True)
        del hf, loaded
    results["goals"] = goals(str(args.shape), results["rows"])
    for line in results["goals"]:
        print(line)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


def describe(row: dict[str, Any]) -> str:
    if "refused" in row:
        return f"{row['dtype']:9s} batch {row['batch']:3d}: refused: {row['refused']}"
    line = (
        f"{row['dtype']:9s} batch {row['batch']:3d}: {row['ms']:7.2f} ms a step, {row['tok_s']:8.0f} tok/s, "
        f"{row['kernels']:6.0f} kernels a step"
    )
    if row["busy"] is not None:
        line += f", GPU busy {100 * row['busy']:3.0f}%"
    line += f"; floor {row['floor_ms']:.2f} ms ({row['floor_ms'] / row['ms']:.2f} of it)"
    if "hf_ms" in row:
        line += f"; HF generate {row['hf_ms']:7.2f} ms a step ({row['hf_ms'] / row['ms']:.2f}x)"
    if "async" in row:
        a = row["async"]
        line += (
            f"; back to back {a['default_ms']:.2f} ms (host {a['default_host_ms']:.2f}), async scheduling "
            f"{a['ms']:.2f} ms (host {a['host_ms']:.2f}; {a['default_ms'] / a['ms']:.2f}x the default's speed)"
        )
        if a["busy"] is not None:
            line += f", GPU busy {100 * a['busy']:3.0f}%"
    if "invariant" in row:
        inv = row["invariant"]
        line += (
            f"; batch-invariant refused: {inv['refused']}"
            if "refused" in inv
            else f"; batch-invariant {inv['ms']:.2f} ms ({inv['ms'] / row['ms']:.2f}x the default)"
        )
    return line


def goals(shape: str, rows: list[dict[str, Any]]) -> list[str]:
    """Each of issue 56's goals that these rows measure: the goal, the figure, met or not."""
    done = [r for r in rows if "ms" in r]
    out = []

    def say(text: str, ok: bool) -> None:
        out.append(f"goal {'met    ' if ok else 'NOT met'}: {text}")

    for r in done:
        for (s, dtype, batch), limit in STEP_GOALS_MS.items():
            if s == shape and dtype in (None, r["dtype"]) and batch == r["batch"]:
                say(f"{shape} {r['dtype']} batch {batch}: {r['ms']:.2f} ms a step <= {limit}", r["ms"] <= limit)
        for (s, dtype, batch), least in TOK_S_GOALS.items():
            if (s, dtype, batch) == (shape, r["dtype"], r["batch"]):
                say(f"{shape} {dtype} batch {batch}: {r['tok_s']:.0f} tok/s >= {least:.0f}", r["tok_s"] >= least)
        if r["batch"] in (1, 32) and "hf_ms" in r:
            ratio = r["hf_ms"] / r["ms"]
            say(f"{r['dtype']} batch {r['batch']}: {ratio:.2f}x HF generate >= {HF_RATIO_GOAL}", ratio >= HF_RATIO_GOAL)
        if r["batch"] == 32 and r["busy"] is not None:
            say(
                f"{r['dtype']} batch 32: GPU busy {100 * r['busy']:.0f}% >= {100 * BUSY_GOAL:.0f}%",
                r["busy"] >= BUSY_GOAL,
            )
        if r["batch"] == 32 and r.get("async", {}).get("busy") is not None:
            busy = r["async"]["busy"]
            say(f"{r['dtype']} batch 32 async: GPU busy {100 * busy:.0f}% >= {100 * BUSY_GOAL:.0f}%", busy >= BUSY_GOAL)
    by = {(r["dtype"], r["batch"]): r["ms"] for r in done}
    for (dtype, batch), ms in sorted(by.items()):
        if dtype != "float32" and ("float32", batch) in by:
            say(f"{dtype} batch {batch}: {ms:.2f} ms <= fp32's {by['float32', batch]:.2f}", ms <= by["float32", batch])
    return out


if __name__ == "__main__":
    raise SystemExit(entry_point(main))
