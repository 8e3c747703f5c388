"""Sampling: Gumbel-max over the processed log-probabilities with counter-based noise.

token = argmax_i (logprob_i + G_i), G_i = Gumbel noise keyed by (seed, position, stream, i).
This is an exact sample from softmax(logprob) (the Gumbel-max trick) and is a pure
function of the row's logits and its key. Greedy (temperature 0) is the argmax; ties go
to the lowest token id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit import rng


@dataclass(frozen=True)
class SampleRow:
    """What the sampler needs to know about one row besides its logits."""

    temperature: float
    seed: int
    position: int  # position of the token being sampled
    stream: int


@dataclass(frozen=True)
class SampleResult:
    token_ids: torch.Tensor  # (R,) int64
    logprobs: torch.Tensor  # (R,) fp32: log-softmax of the raw logits at the chosen token
    noise: torch.Tensor  # (R,) float64: Gumbel noise of the chosen token (NaN for greedy rows)


def sample(logits_RV: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    r, vocab = logits_RV.shape
    logits_RV = logits_RV.float()
    token_ids = torch.argmax(logits_RV, dim=-1)
    noise = torch.full((r,), float("nan"), dtype=torch.float64)
    hashes = None
    for i, row in enumerate(rows):
        if row.temperature == 0.0:
            continue
        if hashes is None:
            hashes = rng.token_hashes(vocab, logits_RV.device)
        key = rng.row_key(row.seed, row.position, row.stream)
        scores_V = torch.log_softmax(logits_RV[i].double() / row.temperature, dim=-1)
        g_V = rng.gumbel(key, hashes)
        choice = torch.argmax(scores_V + g_V)
        token_ids[i] = choice
        noise[i] = g_V[choice]
    chosen = logits_RV.gather(1, token_ids.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits_RV, dim=-1)
    return SampleResult(token_ids=token_ids.cpu(), logprobs=chosen.cpu(), noise=noise)
