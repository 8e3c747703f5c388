"""Penalties: read the history and push repeated tokens down."""

from __future__ import annotations

import torch

from toolkit.processors.base import BatchView


def repetition_penalty(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Tokens seen in prompt or output: positive logits are divided by the penalty, negative ones multiplied."""
    seen_RV = view.token_mask([set(r.token_ids) for r in view.rows])
    penalty_R1 = view.column("repetition_penalty")
    penalised = torch.where(logits_RV > 0, logits_RV / penalty_R1, logits_RV * penalty_R1)
    return torch.where(seen_RV, penalised, logits_RV)


def presence_penalty(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Subtract the penalty once from every token already in the output (OpenAI/vLLM semantics)."""
    present_RV = (view.output_counts > 0).to(logits_RV.dtype)
    return logits_RV - view.column("presence_penalty") * present_RV


def frequency_penalty(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Subtract the penalty times the number of times each token occurs in the output."""
    return logits_RV - view.column("frequency_penalty") * view.output_counts
