"""What grammar masking costs per decode step (SmolLM2, a JSON schema on every row).

The same extraction requests are decoded with and without their schema at each batch
size. Reported per step: the constrained and unconstrained step times, the time inside
the grammar backend (one batched bitmask fill, unpacking, advancing the matchers, the
completion check) and its fraction of the constrained step.
"""

from __future__ import annotations

import time
from typing import Any

from toolkit.config import EngineConfig
from toolkit.engine.core import Engine
from toolkit.runs.workload import EXTRACTION_SCHEMA, extraction_workload
from toolkit.sampling.params import SamplingParams


def _decode(loaded, engine_cfg: EngineConfig, batch: int, constrained: bool, steps: int) -> tuple[float, float]:
    """(mean step seconds, mean grammar seconds) over `steps` decode steps once every row is decoding."""
    engine = Engine(
        loaded, EngineConfig(**{**engine_cfg.__dict__, "max_num_seqs": max(batch, 1)}), SamplingParams(temperature=0.0)
    )
    spec = {"json": EXTRACTION_SCHEMA} if constrained else None
    for r in extraction_workload(batch):
        engine.add_request(
            messages=r.messages,
            request_id=r.id,
            sampling_params=SamplingParams(
                temperature=0.0, max_tokens=steps + 60, ignore_eos=True, structured_outputs=spec
            ),
        )
    while engine.stats().decoding < batch:
        engine.step()
    grammar_before = engine.grammar.seconds if constrained else 0.0
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - start
    grammar = (engine.grammar.seconds - grammar_before) if constrained else 0.0
    return total / steps, grammar / steps


def measure(loaded, engine_cfg: EngineConfig, batch_sizes=(1, 16), steps: int = 12) -> list[dict[str, Any]]:
    rows = []
    for batch in batch_sizes:
        free, _ = _decode(loaded, engine_cfg, batch, False, steps)
        step, grammar = _decode(loaded, engine_cfg, batch, True, steps)
        rows.append(
            {
                "batch": batch,
                "step_ms_unconstrained": 1000 * free,
                "step_ms_constrained": 1000 * step,
                "grammar_ms": 1000 * grammar,
                "grammar_fraction_of_step": grammar / step,
            }
        )
    return rows
