"""What each KV storage buys on a long-context workload: the largest decode batch a fixed KV
memory budget holds at that context, and the decode throughput at that batch.

For each `engine.kv_cache_dtype`, the budget divided by one sequence's KV bytes at `context`
tokens (scales included) gives the batch; a pure decode step at that batch and context (the
synthetic decode state of toolkit.engine.synthetic.decode_step_ms) gives step time and tok/s. Each dtype runs
on the engine's default backend (the native kernel reads fp32, int8 and fp8 blocks; bf16 goes
through sdpa) and on sdpa (blocks gathered and de-quantised in torch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from toolkit.config import EngineConfig
from toolkit.engine.core import Engine
from toolkit.engine.synthetic import decode_step_ms
from toolkit.sampling.params import SamplingParams


def bytes_per_sequence(loaded, engine_cfg: EngineConfig, context: int) -> float:
    probe = Engine(
        loaded,
        dataclasses.replace(engine_cfg, num_kv_blocks=1, max_num_seqs=1, max_num_batched_tokens=1),
        SamplingParams(),
    )
    cache = probe.kv_cache
    blocks = -(-context // engine_cfg.block_size)
    return blocks * cache.bytes_per_block


def measure(
    loaded,
    engine_cfg: EngineConfig,
    dtypes=("auto", "bf16", "int8", "fp8_e4m3"),
    context: int = 2048,
    budget_gb: float = 0.5,
    max_batch: int = 64,
) -> list[dict[str, Any]]:
    rows = []
    variants = [(d, "auto") for d in dtypes] + [(d, "sdpa") for d in dtypes if d != "bf16"]
    for dtype, backend in variants:
        cfg = dataclasses.replace(engine_cfg, kv_cache_dtype=dtype, attention_backend=backend)
        per_seq = bytes_per_sequence(loaded, cfg, context)
        batch = max(1, min(max_batch, int(budget_gb * 2**30 // per_seq)))
        step = decode_step_ms(loaded, cfg, batch, context, steps=4)
        rows.append(
            {
                "kv_cache_dtype": dtype,
                "attention_backend": backend,
                "context": context,
                "budget_gb": budget_gb,
                "kv_bytes_per_sequence": per_seq,
                "max_batch": batch,
                "step_ms": step,
                "tok_per_s": 1000 * batch / step,
            }
        )
        print(
            f"  KV {dtype:<9} ({backend:<6}): {per_seq / 2**20:6.1f} MiB per {context}-token sequence -> batch "
            f"{batch:>3} in {budget_gb:g} GB; decode step {step:7.1f} ms, {rows[-1]['tok_per_s']:6.1f} tok/s",
            flush=True,
        )
    return rows
