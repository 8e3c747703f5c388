"""This machine's roofline, measured in the same run as the systems it judges.

- memory read bandwidth: summing a large fp32 tensor;
- fp32 GEMM GFLOP/s at each decode batch size M, on the model's own projection shapes,
  with torch's GEMM (`x @ w_in_out`) and with our packed native matmul; the roofline
  takes the faster of the two, so a faster kernel of ours raises the bar it is judged by;
- achieved decode step time per batch size (and per context length) against the bound:
  the step's GEMM FLOPs at the faster GEMM's rate, plus reading the KV cache at the
  measured bandwidth. This host's speed drifts by tens of percent within minutes, so each
  row times its decode steps and GEMM-only passes (the step's projections and LM head, the
  faster kernel) alternately, one of each in turn, and compares the median step with the best
  GEMM pass: the bound and the step are measured in the same moments.
"""

from __future__ import annotations

from typing import Any

import torch

from toolkit.config import EngineConfig
from toolkit.engine.core import Engine
from toolkit.engine.synthetic import decode_step_ms, timed
from toolkit.native.library import KernelUnavailable
from toolkit.native.memory import huge_empty
from toolkit.native.ops import matmul_invariant
from toolkit.sampling.params import SamplingParams


def _best(fn, repeats: int) -> float:
    fn()
    return min(timed(fn) for _ in range(repeats))


def memory_bandwidth_gbs(size_mb: int = 512, repeats: int = 5) -> float:
    """GB/s of a sum over `size_mb` MB of fp32, the fastest of `repeats`, on huge pages where the kernel gives them:
    the memory the packed weights stream from (toolkit.native.memory)."""
    x = huge_empty(size_mb * 2**20 // 4, torch.float32)
    x.fill_(1.0)
    seconds = _best(lambda: x.sum(), repeats)
    return x.numel() * 4 / seconds / 1e9


def step_gemm_flops(model, num_rows: int) -> float:
    """FLOPs of the GEMMs of one decode step with `num_rows` sequences (every row sampled)."""
    layer = model.layers[0]
    per_layer = sum(getattr(layer, n).shape[0] * getattr(layer, n).shape[1] for n in layer.projections)
    head = model.lm_head_t.shape[0] * model.lm_head_t.shape[1]
    return 2.0 * num_rows * (per_layer * len(model.layers) + head)


def _gemm_pass(model, m: int, native: bool):
    """A function running one decode step's GEMMs at batch m: every layer's projections (their own
    weights, so they stream from memory as in a real step) and the LM head; torch's GEMM or the
    packed native matmul (`native`)."""
    weights = [getattr(layer, n) for layer in model.layers for n in layer.projections]
    weights.append(model.lm_head_t)
    inputs = {w.shape[0]: torch.randn(m, w.shape[0], dtype=w.dtype) for w in weights}
    mm = torch.matmul
    if native:
        mm = matmul_invariant
        projections, head = model.packed_projections()
        weights = [*projections, head]

    def run():
        for w in weights:
            mm(inputs[w.k if native else w.shape[0]], w)

    return run


def gemm_gflops(model, m: int, native: bool = False, repeats: int = 5) -> float:
    """Measured GFLOP/s of one decode step's GEMMs at batch m (best of `repeats`)."""
    return step_gemm_flops(model, m) / _best(_gemm_pass(model, m, native), repeats) / 1e9


def kv_bytes(engine: Engine, num_rows: int, context: int) -> float:
    return num_rows * context * engine.kv_cache.bytes_per_token


def measure(
    loaded,
    engine_cfg: EngineConfig,
    batch_sizes: list[int],
    contexts: list[int],
    batch_context: int,
    context_batches: list[int],
) -> dict[str, Any]:
    model = loaded.model
    bw = memory_bandwidth_gbs()
    sizes = sorted(set(batch_sizes) | set(context_batches))
    torch_rates = {m: gemm_gflops(model, m) for m in sizes}
    native_rates = {}
    if engine_cfg.device == "cpu" and model.embed.dtype == torch.float32:
        try:
            native_rates = {m: gemm_gflops(model, m, native=True) for m in sizes}
        except KernelUnavailable:
            pass
    rates = {m: max(torch_rates[m], native_rates.get(m, 0.0)) for m in sizes}
    probe = Engine(loaded, EngineConfig(num_kv_blocks=1, max_num_seqs=1, max_num_batched_tokens=1), SamplingParams())

    passes = {}  # per batch: the faster kernel's GEMM pass

    def row(batch: int, context: int) -> dict[str, Any]:
        if batch not in passes:
            passes[batch] = _gemm_pass(model, batch, native=native_rates.get(batch, 0.0) > torch_rates[batch])
        achieved, gemm_ms = decode_step_ms(loaded, engine_cfg, batch, context, gemm_pass=passes[batch])
        kv_ms = 1000 * kv_bytes(probe, batch, context) / (bw * 1e9)
        torch_gemm_ms = 1000 * step_gemm_flops(model, batch) / (torch_rates[batch] * 1e9)
        return {
            "batch": batch,
            "context": context,
            "step_ms": achieved,
            "gemm_bound_ms": gemm_ms,
            "gemm_gflops_alongside": step_gemm_flops(model, batch) / gemm_ms / 1e6,
            "torch_gemm_bound_ms": torch_gemm_ms,
            "fraction_of_torch_gemm_roofline": torch_gemm_ms / achieved,
            "kv_read_ms": kv_ms,
            "bound_ms": gemm_ms + kv_ms,
            "fraction_of_gemm_roofline": gemm_ms / achieved,
            "fraction_of_bound": (gemm_ms + kv_ms) / achieved,
            "tok_per_s": 1000 * batch / achieved,
        }

    return {
        "memory_read_gb_s": bw,
        "gemm_gflops": {str(m): r for m, r in rates.items()},  # the faster of the two (best of 5 passes)
        "gemm_gflops_torch": {str(m): r for m, r in torch_rates.items()},
        "gemm_gflops_native": {str(m): r for m, r in native_rates.items()},
        "by_batch": [row(b, batch_context) for b in batch_sizes],
        "by_context": [row(b, c) for b in context_batches for c in contexts],
    }
