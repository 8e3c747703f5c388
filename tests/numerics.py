"""Greedy agreement between two differently computed runs, asserted the way it holds on every CPU.

Two runs that round differently (int8 vs fp32 KV, our kernels vs HF's torch, the native kernels vs the
fallback) pick the same greedy token wherever the reference's top-2 logprob margin is wider than the two
runs' logprob difference; where it is narrower (a near-tie) which token wins depends on the lane order and the
BLAS of the machine, so a test that counts agreeing tokens there asserts one CPU's rounding.

The rule every such test uses: find each sequence's first divergence inside the compared window. Where the
two runs agree up to it, both computed that step's logits for the same context, so the reference's margin
there bounds how far the other run's logprobs moved: it may diverge only where that margin is below
`near_tie` (the test states the bound and where it comes from, measured in the same test, on the same CPU).
Such a sequence is reported (printed) and not asserted further; every other one must agree token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.trace.diverge import first_difference


def with_threads(n: int, fn):
    """fn() with torch at n intra-op threads (the setting restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def first_divergence(a: list[int], b: list[int], window: int) -> int | None:
    """The first index < window where the two token lists differ (a shorter list differs where it ends)."""
    return first_difference(list(a[:window]), list(b[:window]))


def top2_margin(logits_V: torch.Tensor) -> float:
    """The gap between the two largest logprobs of one row of logits."""
    top = logits_V.double().log_softmax(-1).topk(2).values
    return (top[0] - top[1]).item()


@dataclass
class Agreement:
    checked: list[str]  # sequences whose window agrees token for token
    near_ties: dict[str, tuple[int, float]]  # sequence -> (first divergence, the reference's margin there)

    def report(self) -> str:
        ties = ", ".join(f"{k} at token {j} (margin {m:.3g})" for k, (j, m) in self.near_ties.items())
        return f"{len(self.checked)} agree token for token; diverged at a near-tie: {ties or 'none'}"


def assert_greedy_agreement(
    reference: dict[str, list[int]],
    margins: dict[str, list[float]],
    other: dict[str, list[int]],
    *,
    window: int,
    near_tie: float,
) -> Agreement:
    """Every sequence of `other` equals `reference` in its first `window` tokens, except one that first diverges
    at a step where the reference's top-2 margin (`margins[i][j]`, the reference's own step j) is below
    `near_tie`: that one is reported, not asserted. Returns the split (tests may require enough checked)."""
    checked, near_ties = [], {}
    for i, ref in reference.items():
        j = first_divergence(ref, other[i], window)
        if j is None:
            checked.append(i)
            continue
        margin = margins[i][j]
        assert margin < near_tie, (
            f"{i}: diverges at token {j} where the reference's top-2 margin is {margin:.4g}, "
            f"not a near-tie (< {near_tie:.4g}): {list(ref[:window])} vs "
            f"{list(other[i][:window])}"
        )
        near_ties[i] = (j, margin)
    result = Agreement(checked, near_ties)
    print(result.report())
    return result


def greedy_with_margins(engine, requests: list[dict]) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """Run `requests` (add_request kwargs, each with a request_id) to the end, step by step: each one's output
    tokens and, for each of its sampled tokens, the top-2 logprob margin of the logits it was chosen from."""
    ids = [engine.add_request(**r) for r in requests]
    margins: dict[str, list[float]] = {i: [] for i in ids}
    while engine.has_unfinished():
        out = engine.step()
        for s in out.samples:
            margins[s.request_id].append(top2_margin(out.logits_RV[s.logits_row]))
    return {i: list(engine.output(i).outputs[0].token_ids) for i in ids}, margins
