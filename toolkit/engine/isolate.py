"""Poison-step isolation: when a step's forward or decision raises, find the requests that fail alone.

    a step raises -> find_culprits: bisect the batch's requests, each part through the forward and the decider
    again (nothing committed) -> those that fail alone end with "error" (Committer.fail_requests) -> the rest of
    the batch is stepped in one forward (without), as if the culprits had never been in it

Bisection costs two probes per halving for each culprit (2 log2 n forwards for one poison request among n) and is
bounded (4 probes per doubling of the batch, plus 4); past the bound, or where no request fails alone (a fault of
the step) or every one does (the engine's), the step's own exception is raised: the caller's loop counts it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from toolkit.engine.decide import Decider
from toolkit.engine.request import Sequence, SequenceStatus
from toolkit.engine.runner import ModelRunner
from toolkit.engine.scheduler import ScheduledBatch, ScheduledChunk
from toolkit.engine.speculative import Proposal
from toolkit.errors import one_line


def find_culprits(
    batch: ScheduledBatch,
    exc: Exception,
    probe: Callable[[ScheduledBatch], None],
    request_of: Callable[[ScheduledChunk], str],
) -> dict[str, str]:
    """The requests of `batch` whose chunks make `probe` raise on their own: request id -> why (for its 500).
    `exc`: what the whole batch raised (it is raised again where there is no one to blame)."""
    units: dict[str, list[ScheduledChunk]] = {}
    for chunk in batch.chunks:
        units.setdefault(request_of(chunk), []).append(chunk)
    ids, why = list(units), {}
    budget = [4 * len(ids).bit_length() + 4]

    def fails(part: list[str]) -> bool:
        budget[0] -= 1
        if budget[0] < 0:
            raise exc
        try:
            probe(dataclasses.replace(batch, chunks=tuple(c for r in part for c in units[r])))
        except Exception as alone:  # noqa: BLE001 - what this part raises, for its culprit's answer
            if len(part) == 1:
                why[part[0]] = f"the engine failed while stepping this request: {one_line(alone)}"
            return True
        return False

    def search(part: list[str], failing: bool = False) -> list[str]:
        if not (failing or fails(part)):
            return []
        if len(part) == 1:
            return part
        half = len(part) // 2
        return search(part[:half]) + search(part[half:])

    culprits = search(ids, failing=True) if len(ids) > 1 else []
    if not culprits or len(culprits) == len(ids):
        raise exc
    return {r: why[r] for r in culprits}


def prober(
    runner: ModelRunner, decider: Decider, requests: Mapping[str, Sequence], proposals: Mapping[str, Proposal]
) -> Callable[[ScheduledBatch], None]:
    """What find_culprits runs on a part of a failed step's batch: the forward (no block copied again) and the
    decider (which only reads), nothing committed."""

    def probe(part: ScheduledBatch) -> None:
        decider.decide(runner.run(part, move_blocks=False), proposals_of(part, proposals), requests)

    return probe


def without(
    batch: ScheduledBatch,
    proposals: Mapping[str, Proposal],
    failed: Mapping[str, str],
    requests: Mapping[str, Sequence],
) -> tuple[ScheduledBatch, dict[str, Proposal]]:
    """The batch and its draft proposals less the chunks of the `failed` requests (token counts recounted)."""
    kept = tuple(c for c in batch.chunks if requests[c.seq_id].request_id not in failed)
    decoding = [requests[c.seq_id].status is SequenceStatus.DECODING for c in kept]
    batch = dataclasses.replace(
        batch,
        chunks=kept,
        num_decode_tokens=sum(c.num_tokens for c, d in zip(kept, decoding) if d),
        num_prefill_tokens=sum(c.num_tokens for c, d in zip(kept, decoding) if not d),
    )
    return batch, proposals_of(batch, proposals)


def proposals_of(batch: ScheduledBatch, proposals: Mapping[str, Proposal]) -> dict[str, Proposal]:
    """The draft proposals of the batch's sequences."""
    ids = {c.seq_id for c in batch.chunks}
    return {k: p for k, p in proposals.items() if k in ids}
