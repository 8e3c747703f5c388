"""Temperature and truncation of the support (top-k, top-p, min-p), per-row parameters, vectorised."""

from __future__ import annotations

import torch

from toolkit.processors.base import NEG_INF, BatchView


def temperature(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Divide by the row's temperature (rows reach here only with temperature > 0)."""
    return logits_RV / view.column("temperature")


def top_k(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Keep the k largest logits of each row (ties with the k-th are kept too)."""
    k_R = torch.tensor([min(r.params.top_k, view.vocab_size) for r in view.rows], device=logits_RV.device)
    top_RK = torch.topk(logits_RV, int(k_R.max()), dim=-1).values
    kth_R1 = top_RK.gather(1, (k_R - 1).unsqueeze(1))
    return logits_RV.masked_fill(logits_RV < kth_R1, NEG_INF)


def top_p(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Keep the smallest highest-probability set whose mass reaches p: the token that crosses p is kept."""
    sorted_RV, order_RV = torch.sort(logits_RV, dim=-1, descending=True, stable=True)
    probs_RV = torch.softmax(sorted_RV, dim=-1)
    mass_before_RV = torch.cumsum(probs_RV, dim=-1) - probs_RV  # mass of the tokens ranked above
    remove_sorted_RV = mass_before_RV >= view.column("top_p")
    remove_sorted_RV[:, 0] = False  # the top token always stays
    remove_RV = torch.zeros_like(remove_sorted_RV).scatter(1, order_RV, remove_sorted_RV)
    return logits_RV.masked_fill(remove_RV, NEG_INF)


def min_p(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Keep tokens whose probability is at least min_p times the top token's."""
    probs_RV = torch.softmax(logits_RV, dim=-1)
    threshold_R1 = probs_RV.max(dim=-1, keepdim=True).values * view.column("min_p")
    return logits_RV.masked_fill(probs_RV < threshold_R1, NEG_INF)
