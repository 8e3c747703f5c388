"""The native CPU kernels beside the torch code each replaces, on the model's own shapes.

- paged attention: decode rows (one query per sequence, `context` keys each) and one prompt
  of `prompt` tokens (every query over its causal prefix), the native kernel vs gathering the
  blocks and running torch SDPA (what the `sdpa` backend does); reported as ms, query-key
  pairs per second and GB/s of K/V read;
- RoPE on the q|k heads: the one-pass kernel vs `x * cos + rotate_half(x) * sin`.
(The packed matmul vs torch's GEMM is the roofline's GEMM sweep.) Each pair alternates
`repeats` times and the medians are reported, so the drift of a shared machine hits both.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from toolkit.kv.attention import _grouped_sdpa, additive_bias
from toolkit.models.decoder import rotate_half
from toolkit.native.library import KernelUnavailable, native
from toolkit.native.ops import paged_attention_cpu, rope_cpu


def _pair(ours: Callable[[], Any], theirs: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Median ms of each, alternating runs (one warm-up each first)."""
    ours(), theirs()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((ours, times[0]), (theirs, times[1])):
            t = time.perf_counter()
            fn()
            out.append(1000 * (time.perf_counter() - t))
    return statistics.median(times[0]), statistics.median(times[1])


def _attention_case(
    arch, contexts: list[int], prompt: bool, block_size: int, repeats: int, gen: torch.Generator
) -> dict[str, Any]:
    h, k, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    per_seq = [-(-c // block_size) for c in contexts]
    k_cache = torch.randn(sum(per_seq) + 1, block_size, k, d, generator=gen)
    v_cache = torch.randn(sum(per_seq) + 1, block_size, k, d, generator=gen)
    order = torch.randperm(sum(per_seq), generator=gen)  # blocks scattered over the pool, as in a real run
    tables = torch.stack([order[sum(per_seq[:s]) : sum(per_seq[: s + 1])] for s in range(len(contexts))])
    if prompt:  # one sequence, every query over its causal prefix
        (length,) = contexts
        query_table, query_ctx = torch.zeros(length, dtype=torch.int64), torch.arange(1, length + 1)
    else:
        query_table, query_ctx = torch.arange(len(contexts)), torch.tensor(contexts)
    q = torch.randn(len(query_ctx), h, d, generator=gen)
    groups = h // k

    def ours():
        return paged_attention_cpu(q, k_cache, v_cache, tables, query_table, query_ctx, arch.scale)

    def theirs():
        keys = k_cache.index_select(0, tables.reshape(-1)).view(len(contexts), -1, k, d)
        values = v_cache.index_select(0, tables.reshape(-1)).view(len(contexts), -1, k, d)
        if prompt:
            causal = torch.arange(keys.shape[1])[None, :] <= torch.arange(len(query_ctx))[:, None]
            bias = additive_bias(causal, q.dtype).repeat(groups, 1).unsqueeze(0)
            return _grouped_sdpa(q.unsqueeze(0), keys, values, bias, arch.scale)
        bias = additive_bias(torch.arange(keys.shape[1])[None, :] < query_ctx[:, None], q.dtype).unsqueeze(1)
        return _grouped_sdpa(q.unsqueeze(1), keys, values, bias, arch.scale)

    got, want = ours(), theirs().reshape(q.shape)
    ms, torch_ms = _pair(ours, theirs, repeats)
    pairs = int(query_ctx.sum())
    kv_bytes = (
        (sum(contexts) if prompt else pairs) * 2 * k * d * 4
    )  # a prompt's keys are read from cache after the first query
    return {
        "kernel_ms": ms,
        "sdpa_ms": torch_ms,
        "speedup": torch_ms / ms,
        "pairs_per_s": pairs / ms * 1000,
        "kv_read_gb_s": kv_bytes / ms / 1e6,
        "max_abs_diff": (got - want).abs().max().item(),
    }


def measure(
    loaded, batch_sizes=(1, 8, 32, 64), context: int = 256, prompt: int = 512, block_size: int = 16, repeats: int = 5
) -> dict[str, Any]:
    """The report; {"unavailable": why} (said in one line) where the native kernels do not run here."""
    try:
        native()
    except KernelUnavailable as exc:
        print(f"  the native kernels are not measured: {exc}", flush=True)
        return {"unavailable": str(exc)}
    print("  measuring the native kernels beside torch ...", flush=True)
    arch, model = loaded.arch, loaded.model
    gen = torch.Generator().manual_seed(0)
    report: dict[str, Any] = {"attention_decode": [], "attention_prefill": [], "rope": []}
    for batch in batch_sizes:
        row = {
            "batch": batch,
            "context": context,
            **_attention_case(arch, [context] * batch, False, block_size, repeats, gen),
        }
        report["attention_decode"].append(row)
        print(
            f"  attention, decode batch {batch} x {context} keys: kernel {row['kernel_ms']:.2f} ms "
            f"({row['kv_read_gb_s']:.1f} GB/s) vs sdpa {row['sdpa_ms']:.2f} ms: {row['speedup']:.2f}x",
            flush=True,
        )
    row = {"prompt": prompt, **_attention_case(arch, [prompt], True, block_size, repeats, gen)}
    report["attention_prefill"].append(row)
    print(
        f"  attention, one {prompt}-token prompt: kernel {row['kernel_ms']:.2f} ms "
        f"({row['pairs_per_s'] / 1e6:.1f} M query-key pairs/s) vs sdpa {row['sdpa_ms']:.2f} ms: "
        f"{row['speedup']:.2f}x",
        flush=True,
    )
    if getattr(model, "rope_cos", None) is not None:
        cos, sin = model.rope_cos, model.rope_sin
        heads = arch.num_heads + arch.num_kv_heads
        for rows in list(batch_sizes) + [prompt]:
            x = torch.randn(rows, heads + arch.num_kv_heads, arch.head_dim, generator=gen)[:, :heads]
            pos = torch.randint(0, min(cos.shape[0], 4096), (rows,), generator=gen)
            same = torch.equal(
                rope_cpu(x, cos, sin, pos), x * cos[pos].unsqueeze(1) + rotate_half(x) * sin[pos].unsqueeze(1)
            )
            ms, torch_ms = _pair(
                lambda: rope_cpu(x, cos, sin, pos),
                lambda: x * cos[pos].unsqueeze(1) + rotate_half(x) * sin[pos].unsqueeze(1),
                repeats,
            )
            report["rope"].append(
                {"rows": rows, "kernel_ms": ms, "torch_ms": torch_ms, "speedup": torch_ms / ms, "bit_identical": same}
            )
            print(
                f"  RoPE over {rows} rows x {heads} heads: kernel {ms:.3f} ms vs torch {torch_ms:.3f} ms: "
                f"{torch_ms / ms:.2f}x (bit-identical: {same})",
                flush=True,
            )
    return report
