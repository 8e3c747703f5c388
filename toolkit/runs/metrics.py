"""Run-level figures computed from finished requests."""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jsonschema

from toolkit.engine.core import RequestOutput


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class InterTokenLatency:
    """ITL: the time between a sequence's consecutive tokens, from the per-token emit times the trace records
    (`t_emit_s`; tokens committed together in one step, e.g. kept drafts, are 0 apart). `max_values`: keep the
    latest values only (a server's run); `forget` a sequence once it ended."""

    def __init__(self, max_values: int | None = None):
        self.values: deque[float] = deque(maxlen=max_values)
        self._last: dict[tuple[str, int], float] = {}

    def update(self, samples: Iterable) -> None:
        for s in samples:
            if s.token_id < 0:
                continue
            key = (s.request_id, s.stream)
            if key in self._last:
                self.values.append(s.t_emit_s - self._last[key])
            self._last[key] = s.t_emit_s

    def forget(self, request_id: str, stream: int) -> None:
        self._last.pop((request_id, stream), None)


class RunningSummary:
    """What `summarize` reports, gathered one finished request at a time: the totals exact, the percentiles over
    the latest `window` sequences (all of them when None), so a server that runs for days holds a bounded sum."""

    def __init__(self, window: int | None = None):
        self.requests = self.sequences = self.output_tokens = self.prompt_tokens = self.num_preemptions = 0
        self.ttfts: deque[float] = deque(maxlen=window)
        self.tpots: deque[float] = deque(maxlen=window)
        self.queues: deque[float] = deque(maxlen=window)
        self.finish_reasons: dict[str, int] = {}

    def add(self, output: RequestOutput) -> None:
        self.requests += 1
        self.prompt_tokens += len(output.prompt_token_ids)
        for c in output.outputs:
            self.sequences += 1
            self.output_tokens += len(c.token_ids)
            self.num_preemptions += c.metrics.num_preemptions
            for values, value in (
                (self.ttfts, c.metrics.ttft_s),
                (self.tpots, c.metrics.tpot_s),
                (self.queues, c.metrics.queue_s),
            ):
                if value is not None:
                    values.append(value)
            reason = c.finish_reason or "unfinished"
            self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1

    def result(self, wall_s: float, itl_s: Sequence[float] = (), **extra) -> dict:
        rate = lambda n: n / wall_s if wall_s > 0 else None  # noqa: E731
        return {
            "requests": self.requests,
            "sequences": self.sequences,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "wall_s": wall_s,
            "output_tok_per_s": rate(self.output_tokens),
            "prompt_tok_per_s": rate(self.prompt_tokens),
            "requests_per_s": rate(self.requests),
            "ttft_p50_s": percentile(self.ttfts, 50),
            "ttft_p95_s": percentile(self.ttfts, 95),
            "tpot_p50_s": percentile(self.tpots, 50),
            "tpot_p95_s": percentile(self.tpots, 95),
            "itl_p50_s": percentile(itl_s, 50),
            "itl_p95_s": percentile(itl_s, 95),
            "itl_p99_s": percentile(itl_s, 99),
            "queue_p50_s": percentile(self.queues, 50),
            "queue_p95_s": percentile(self.queues, 95),
            "finish_reasons": dict(sorted(self.finish_reasons.items())),
            "num_preemptions": self.num_preemptions,
            **extra,
        }


def summarize(outputs: Iterable[RequestOutput], wall_s: float, itl_s: Sequence[float] = (), **extra) -> dict:
    """The serving chapter's figures: throughput (output and prompt tokens, requests), TTFT, TPOT, ITL (`itl_s`:
    InterTokenLatency.values) and queue time percentiles, finish reasons."""
    running = RunningSummary()
    for output in outputs:
        running.add(output)
    return running.result(wall_s, itl_s, **extra)


def decode_steps_by_batch(steps: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Of the steps with no prompt tokens (steps.parquet rows), per decode batch (sequences decoded): how many
    and their median time, keyed by the batch as a string (a JSON object's keys)."""
    by_batch: dict[int, list[float]] = {}
    for s in steps:
        if s["prefill_tokens"] == 0 and s["decode_tokens"] > 0:
            by_batch.setdefault(int(s["decode_tokens"]), []).append(float(s["step_s"]))
    return {str(b): {"steps": len(v), "p50_s": percentile(v, 50)} for b, v in sorted(by_batch.items())}


def batch_vs_single(by_batch: Mapping[str, Mapping[str, float]], min_steps: int = 3) -> tuple[int, float] | None:
    """(batch, its median decode step / batch 1's) for the largest batch with at least `min_steps` decode-only
    steps, when batch 1 has them too: what batching costs a step (the portable-kernels issue's goal: <= 1.5x at
    batch ~10)."""
    single = by_batch.get("1")
    wide = [int(b) for b, v in by_batch.items() if int(b) > 1 and v["steps"] >= min_steps]
    if single is None or single["steps"] < min_steps or not wide:
        return None
    b = max(wide)
    return b, by_batch[str(b)]["p50_s"] / single["p50_s"]


def structured_output_validity(outputs, params_by_request) -> dict | None:
    """For requests constrained by a JSON schema: how many outputs parse and validate (jsonschema)."""
    checked = valid = 0
    for out in outputs:
        spec = params_by_request[out.request_id].structured_outputs
        if spec is None or spec.kind != "json":
            continue
        schema = spec.json or {"type": "object"}
        for completion in out.outputs:
            checked += 1
            try:
                jsonschema.validate(json.loads(completion.text), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    if not checked:
        return None
    return {"json_outputs": checked, "json_valid": valid, "json_validity_rate": valid / checked}
