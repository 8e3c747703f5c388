"""Sampling: Gumbel-max over the processed logits with counter-based noise.

token = argmax_i (processed_i + G_i), G_i = Gumbel noise keyed by (seed, position, stream, i),
an exact sample from softmax(processed) (the Gumbel-max trick) and a pure function of the
row's logits and its key. Greedy rows (temperature 0) take the argmax of the processed
logits; ties go to the lowest token id. Noise is evaluated only on the support, which
gives the same values as evaluating it everywhere: each token's noise depends on its id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit import rng
from toolkit.kernels import argmax_cpu, logsumexp_cpu


@dataclass(frozen=True)
class SampleRow:
    greedy: bool
    seed: int
    position: int  # position of the token being sampled
    stream: int
    num_top: int = 0  # alternatives to record (SamplingParams.logprobs)
    purpose: int = rng.SAMPLE  # which independent noise to draw (a speculative draft uses rng.DRAFT)


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    raw_logprobs: list[float]  # log softmax(raw logits) at the token
    processed_logprobs: list[float]  # log softmax(processed logits) at the token
    support_sizes: list[int]
    noise: list[float]  # Gumbel noise of the chosen token (NaN for greedy rows)
    top_raw: list[list[tuple[int, float]]]
    top_processed: list[list[tuple[int, float]]]


def logsumexp_rows(x_RV: torch.Tensor, per_row: bool = True) -> torch.Tensor:
    """logsumexp of each row (R,). `per_row` computes one row at a time: torch's batched reduction
    can split a row differently with another number of rows, and in the batch-invariant mode a
    token's log-probability must not depend on its batch. The default mode promises no such thing
    (with torch's GEMM, SDPA or a GPU its logits depend on the batch), so it takes the batched call
    (3-4x faster at 64 rows). fp32 rows on the CPU take one C pass per row instead, batch-invariant
    and several times faster than either torch call (toolkit/csrc/rowwise.c)."""
    native = logsumexp_cpu(x_RV)
    if native is not None:
        return native
    if x_RV.shape[0] <= 1 or not per_row:
        return torch.logsumexp(x_RV, dim=-1)
    return torch.cat([torch.logsumexp(x_RV[i:i + 1], dim=-1) for i in range(x_RV.shape[0])])


def sample(raw_RV: torch.Tensor, processed_RV: torch.Tensor, rows: list[SampleRow],
           raw_logsumexp_R: torch.Tensor | None = None, per_row: bool = True) -> SampleResult:
    """Choose one token per row. `processed_RV is raw_RV` (no processor changed anything) takes a fast
    path: the processed distribution is the raw one and its support is the whole vocabulary."""
    r, vocab = raw_RV.shape
    unprocessed = processed_RV is raw_RV
    raw_lse = raw_logsumexp_R if raw_logsumexp_R is not None else logsumexp_rows(raw_RV, per_row)
    if unprocessed:
        support = [vocab] * r
        proc_lse = raw_lse
    else:
        finite_RV = torch.isfinite(processed_RV)
        support = finite_RV.sum(dim=-1).tolist()
        proc_lse = logsumexp_rows(processed_RV, per_row)
    tokens = argmax_cpu(processed_RV)
    if tokens is None:
        tokens = torch.argmax(processed_RV, dim=-1).tolist()
    noise = [float("nan")] * r
    hashes = rng.token_hashes(vocab, raw_RV.device) if any(not row.greedy for row in rows) else None
    for i, row in enumerate(rows):
        if row.greedy:
            continue
        key = rng.row_key(row.seed, row.position, row.stream, row.purpose)
        if support[i] == vocab:
            g_V = rng.gumbel(key, hashes)
            choice = int(torch.argmax(processed_RV[i].double() + g_V))
            noise[i] = float(g_V[choice])
        else:
            ids = finite_RV[i].nonzero().flatten()
            g_S = rng.gumbel(key, hashes[ids])
            j = int(torch.argmax(processed_RV[i, ids].double() + g_S))
            choice, noise[i] = int(ids[j]), float(g_S[j])
        tokens[i] = choice
    token_t = torch.tensor(tokens, device=raw_RV.device).unsqueeze(1)
    raw_lp = (raw_RV.gather(1, token_t).squeeze(1) - raw_lse).tolist()
    proc_lp = raw_lp if unprocessed else (processed_RV.gather(1, token_t).squeeze(1) - proc_lse).tolist()
    num_top = max((row.num_top for row in rows), default=0)
    top_raw = _top(raw_RV, raw_lse, rows, num_top)
    top_proc = top_raw if unprocessed else _top(processed_RV, proc_lse, rows, num_top)
    return SampleResult(token_ids=tokens, raw_logprobs=raw_lp, processed_logprobs=proc_lp, support_sizes=support,
                        noise=noise, top_raw=top_raw, top_processed=top_proc)


def _top(logits_RV: torch.Tensor, lse_R: torch.Tensor, rows: list[SampleRow], k: int
         ) -> list[list[tuple[int, float]]]:
    if k == 0:
        return [[] for _ in rows]
    values, ids = torch.topk(logits_RV, k, dim=-1)
    values, ids = (values - lse_R.unsqueeze(1)).tolist(), ids.tolist()
    return [[(t, v) for t, v in zip(ids[i][:row.num_top], values[i][:row.num_top]) if v != float("-inf")]
            for i, row in enumerate(rows)]
