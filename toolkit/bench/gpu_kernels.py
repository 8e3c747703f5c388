"""Issue 57's matmul cost kernel by kernel (`python -m toolkit.bench.gpu --kernels`): every decode product of a
shape, torch's matmul beside the invariant Triton matmuls in each candidate tiling and weight order, each kernel's
own time; and which tilings give the bits of the product's own (the format's, or its shape's where
`gpu_matmul.DOT_BLOCKS_BY_SHAPE` names it).

That last is a finding, not a check: the engine's invariance rests on one tiling whatever the rows. Where another
tiling gives every bit of the own one (an fp32 "ieee" tile product is one FMA chain a sum, in ascending K, whatever
the tile; a 16-bit one is the tensor cores' instruction, whose shape the tile can change), the tiling could follow
the number of rows without moving a bit; a GPU says which."""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Mapping
from typing import Any

import torch

from toolkit.engine.synthetic import timed
from toolkit.models import DTYPES
from toolkit.native import gpu_matmul as gm

KN, NK = "(K,N)", "(N,K)"  # the weights' storage order: the engine's, and torch's Linear's


def kernel_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """ms of one call of fn: its kernels' own time on a GPU (do_bench), else the median of 20 calls after 3."""
    if device.type == "cuda":
        from triton.testing import do_bench  # deferred: Triton, on a CUDA machine only

        return float(do_bench(fn, return_mode="median"))
    for _ in range(3):
        fn()
    return statistics.median(1000 * timed(fn) for _ in range(20))


def decode_products(dims: Mapping[str, Any]) -> tuple[tuple[int, int], ...]:
    """The (K, N) of a decode step's products: q, k and v; o; gate and up; down; the LM head. `dims`: a named
    shape's sizes, or a DecoderArch's fields (its head_dim, Qwen3's apart from hidden / heads; GPT-2's MLP ungated)."""
    hidden, width = dims["hidden_size"], dims["intermediate_size"]
    head_dim = dims.get("head_dim") or hidden // dims["num_heads"]
    return (
        (hidden, (dims["num_heads"] + 2 * dims["num_kv_heads"]) * head_dim),
        (dims["num_heads"] * head_dim, hidden),
        (hidden, (2 if dims.get("gated_mlp", True) else 1) * width),
        (width, hidden),
        (hidden, dims["vocab_size"]),
    )


def kernel_times(
    dims: Mapping[str, Any], dtypes: list[str], batches: list[int], device: torch.device
) -> tuple[list[str], list[dict[str, Any]]]:
    """Issue 57's matmul cost: ms of torch's matmul and of the invariant Triton matmuls (tl.sum, and tl.dot in
    several tilings, the product's own starred (`gpu_matmul.dot_blocks` of its format and shape); then torch's and a
    few tilings' with the weights stored (N, K)) on each of `decode_products(dims)`, side by side: on a GPU the kernel's own time (triton.testing.do_bench:
    CUDA events, no wait between calls, the L2 cleared), elsewhere the median of 20 calls. After each product's
    figures, the tl.dot tilings whose bits are not the own tiling's (`same_bits`). Returns the lines and each figure
    as a record (what `fastest_tilings` reads)."""
    lines, figures = [], []
    for dtype in dtypes:
        for k, n in decode_products(dims):
            w = (torch.randn(k, n, device=device) / k**0.5).to(DTYPES[dtype])
            w_nk = gm.stored_nk(w)
            for m in batches:
                x = torch.randn(m, k, device=device).to(DTYPES[dtype])
                own = gm.dot_blocks(x.dtype, k, n)
                ms, dots = {}, {}
                # (name, blocks or None, the weights' order, the call)
                fns = [
                    ("torch", None, KN, lambda: x @ w),
                    ("tl.sum", None, KN, lambda: gm.matmul(x, w, out_dtype=x.dtype)),
                ]
                for b in gm.candidate_tilings(x.dtype, k, n):
                    name = f"tl.dot {gm.tiling_name(b)}{'*' if b == own else ''}"
                    fns.append((name, b, KN, lambda b=b: gm.matmul_dot(x, w, b, out_dtype=x.dtype)))
                # the same weights stored (N, K), as torch's Linear keeps them: a tile's slice of each column is one
                # run of K in memory (stored (K, N), 16 columns of 16 bits are 32 bytes a row of the slice)
                fns.append(("torch (N,K)", None, NK, lambda: x @ w_nk))
                for b in gm.layout_tilings(x.dtype, k, n):
                    name = f"tl.dot {gm.tiling_name(b)} (N,K)"
                    fns.append((name, b, NK, lambda b=b: gm.matmul_dot(x, w_nk, b, out_dtype=x.dtype)))
                for name, blocks, order, fn in fns:
                    try:
                        ms[name] = kernel_ms(fn, device)
                        if blocks is not None:
                            dots[name] = fn
                    except Exception as exc:  # noqa: BLE001 - a kernel that does not compile here is a figure too
                        ms[name] = float("nan")
                        lines.append(f"{name} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                    figures.append(dict(dtype=dtype, m=m, k=k, n=n, name=name, blocks=blocks, order=order, ms=ms[name]))
                lines.append(
                    f"matmul {dtype} {m}x{k} @ {k}x{n}: "
                    + ", ".join(f"{name} {v:.3f} ms ({v / ms['torch']:.2f}x)" for name, v in ms.items())
                )
                lines.append(f"  bits: {same_bits({name: fn() for name, fn in dots.items()})}")
    return lines, figures


def fastest_tilings(
    figures: list[dict[str, Any]], dtype: str, order: str = KN
) -> dict[tuple[int, int], tuple[int, ...]]:
    """Each product's tiling by the kernel table's `figures` of `dtype` (the weights in `order`): the one whose worst
    ratio to torch's time over the batches timed is least (issue 57's cost goal holds at every batch), the format's
    own on a tie. Only the products whose fastest is not the format's own tiling are named (DOT_BLOCKS_BY_SHAPE)."""
    torch_ms = {  # torch's own matmul over the weights in the same order
        (f["k"], f["n"], f["m"]): f["ms"]
        for f in figures
        if f["dtype"] == dtype and f["order"] == order and f["name"].startswith("torch")
    }
    worst: dict[tuple[int, int], dict[tuple[int, ...], float]] = {}
    for f in figures:
        if f["dtype"] != dtype or f["blocks"] is None or f["order"] != order:
            continue
        ratio = f["ms"] / torch_ms[f["k"], f["n"], f["m"]]
        tilings = worst.setdefault((f["k"], f["n"]), {})
        blocks = tuple(f["blocks"])
        tilings[blocks] = max(tilings.get(blocks, 0.0), math.inf if math.isnan(ratio) else ratio)  # NaN: failed
    own = gm.dot_blocks(DTYPES[dtype])
    chosen = {}
    for shape, tilings in worst.items():
        best = min(tilings, key=lambda b: (tilings[b], b != own))
        if best != own and tilings[best] < math.inf:
            chosen[shape] = best
    return chosen


def same_bits(outputs: Mapping[str, torch.Tensor]) -> str:
    """Which of the tl.dot tilings' `outputs` (by name, the product's own starred) are not the own tiling's bits."""
    own = next((name for name in outputs if name.endswith("*")), None)
    if own is None:
        return "the own tiling did not run"
    differ = [name for name, out in outputs.items() if not torch.equal(out, outputs[own])]
    if not differ:
        return f"every tiling's are {own}'s"
    return f"{len(outputs) - len(differ)} of {len(outputs)} tilings' are {own}'s; not: " + ", ".join(differ)


def tiling(text: str) -> tuple[int, ...]:
    """BM,BN,BK: three powers of two, each at least 16 (what tl.dot takes); then optionally the pipeline's stages,
    1 to 8."""
    try:
        blocks = tuple(int(x) for x in text.split(","))
    except ValueError:
        blocks = ()
    stages_ok = len(blocks) == 3 or (len(blocks) == 4 and 1 <= blocks[3] <= 8)
    if not stages_ok or any(b < 16 or b & (b - 1) for b in blocks[:3]):
        raise argparse.ArgumentTypeError(
            f"a tiling is BM,BN,BK (three powers of two of at least 16), then optionally its stages (1 to 8): "
            f"got {text!r}"
        )
    return blocks
