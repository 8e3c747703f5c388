"""What batch-invariant mode costs: decode step time and a prefill step, invariant vs default.

Both modes run the same synthetic decode state (see toolkit.engine.synthetic.decode_step_ms) at each batch
size, alternating modes `repeats` times so that drift on a shared machine hits both; the
median of each is reported with their ratio. A prefill step (one 512-token prompt chunk)
is timed the same way.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from typing import Any

from toolkit.config import EngineConfig
from toolkit.engine.core import Engine
from toolkit.engine.synthetic import decode_step_ms
from toolkit.sampling.params import SamplingParams


def prefill_step_ms(loaded, engine_cfg: EngineConfig, tokens: int = 512) -> float:
    engine = Engine(
        loaded,
        dataclasses.replace(engine_cfg, max_num_batched_tokens=tokens, max_num_seqs=1),
        SamplingParams(temperature=0.0),
    )
    rnd = random.Random(tokens)
    engine.add_request(
        prompt_token_ids=[rnd.randrange(loaded.arch.vocab_size) for _ in range(tokens)],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    )
    t = time.perf_counter()
    engine.step()
    return 1000 * (time.perf_counter() - t)


def measure(
    loaded, engine_cfg: EngineConfig, batch_sizes=(1, 16, 64), context: int = 256, repeats: int = 3
) -> list[dict[str, Any]]:
    modes = {m: dataclasses.replace(engine_cfg, batch_invariant=m) for m in (False, True)}
    rows = []
    for batch in list(batch_sizes) + ["prefill512"]:
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for mode, cfg in modes.items():
                times[mode].append(
                    prefill_step_ms(loaded, cfg)
                    if batch == "prefill512"
                    else decode_step_ms(loaded, cfg, batch, context)
                )
        default, invariant = statistics.median(times[False]), statistics.median(times[True])
        rows.append(
            {
                "batch": batch,
                "context": context,
                "default_ms": default,
                "invariant_ms": invariant,
                "ratio": invariant / default,
            }
        )
        print(f"  batch-invariant cost at {batch}: {invariant:.1f} ms vs {default:.1f} ms", flush=True)
    return rows
