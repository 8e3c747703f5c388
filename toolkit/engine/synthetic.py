"""An engine put straight into a pure decode state (no prefill run), and the time of its step: what the roofline,
the KV-format and precision comparisons time."""

from __future__ import annotations

import random
import statistics
import time

import torch

from toolkit.config import EngineConfig, check, is_int
from toolkit.engine.core import Engine
from toolkit.engine.request import SequenceStatus
from toolkit.sampling.params import SamplingParams


def timed(fn) -> float:
    """Seconds `fn()` takes."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def decode_engine(loaded, engine_cfg: EngineConfig, batch: int, context: int, steps: int = 8) -> Engine:
    """An engine in a pure decode state: `batch` sequences at `context` tokens of context, each with
    room for `steps` more.

    The decode state is synthetic: each sequence's KV blocks are allocated and filled with
    random values and it is marked as decoding, instead of prefilling batch x context tokens
    first (the step's cost does not depend on the cached values). A batch or context under 1, or no step, is
    a ConfigError: there would be no decode step to time (a batch of 0 steps in no time).
    """
    check(is_int(batch) and batch >= 1, f"a decode step's batch must be an integer of at least 1, got {batch!r}")
    check(
        is_int(context) and context >= 1, f"a decode step's context must be an integer of at least 1, got {context!r}"
    )
    check(is_int(steps) and steps >= 1, f"a decode step's steps must be an integer of at least 1, got {steps!r}")
    blocks_needed = batch * (-(-(context + steps + 2) // engine_cfg.block_size))
    cfg = EngineConfig(
        **{
            **engine_cfg.__dict__,
            "max_num_seqs": batch,
            "max_num_batched_tokens": max(engine_cfg.max_num_batched_tokens, batch),
            "num_kv_blocks": blocks_needed + batch + 8,
        }
    )
    engine = Engine(loaded, cfg, SamplingParams(temperature=0.0))
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    for k, v in engine.kv_cache.layers:
        k.copy_(torch.randn(k.shape, generator=gen) * 0.5)
        v.copy_(torch.randn(v.shape, generator=gen) * 0.5)
    rnd = random.Random(batch * 7919 + context)
    vocab = loaded.arch.vocab_size
    for _ in range(batch):
        engine.add_request(
            prompt_token_ids=[rnd.randrange(vocab) for _ in range(context)],
            sampling_params=SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True),
        )
    engine.scheduler.arrivals(0)
    for seq in list(engine.scheduler.waiting):  # as if prefilled: context tokens cached, one sampled token
        engine.scheduler.waiting.remove(seq)
        engine.block_manager.allocate(seq.seq_id, context + 1)
        seq.num_computed_tokens = context
        seq.token_ids.append(rnd.randrange(vocab))
        seq.status = SequenceStatus.DECODING
        seq.admitted_step = 0
        engine.scheduler.running.append(seq)
    return engine


def decode_step_ms(
    loaded, engine_cfg: EngineConfig, batch: int, context: int, steps: int = 8, gemm_pass=None
) -> float | tuple[float, float]:
    """Median ms of a pure decode step with `batch` sequences at `context` tokens of context; with
    `gemm_pass`, also the best ms of that function, timed after each step (alternately)."""
    engine = decode_engine(loaded, engine_cfg, batch, context, steps)
    if gemm_pass is not None:
        gemm_pass()  # warm-up
    times, gemm_times = [], []
    for _ in range(steps):
        times.append(timed(engine.step))
        if gemm_pass is not None:
            gemm_times.append(timed(gemm_pass))
    step_ms = 1000 * statistics.median(times)
    return step_ms if gemm_pass is None else (step_ms, 1000 * min(gemm_times))
