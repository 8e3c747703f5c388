"""Penalties: read the history and push repeated tokens down."""

from __future__ import annotations

import torch

from toolkit.processors.base import BatchView, Patches


def repetition_penalty(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Tokens seen in prompt or output: positive logits are divided by the penalty, negative ones multiplied.
    Only the seen entries are read and written (a token seen twice is penalised once: both writes
    carry the same value, computed from the input)."""
    return repetition_penalty_changes(logits_RV, view).apply(logits_RV)


def repetition_penalty_changes(logits_RV: torch.Tensor, view: BatchView) -> Patches:
    """The entries repetition_penalty changes, with their new values (rows in order)."""
    rows_S, cols_S = view.token_index([r.token_ids for r in view.rows])
    penalty_S = view.column("repetition_penalty").flatten()[rows_S]
    seen_S = logits_RV[rows_S, cols_S]
    return Patches(rows_S, cols_S, torch.where(seen_S > 0, seen_S / penalty_S, seen_S * penalty_S))


repetition_penalty.changes = repetition_penalty_changes


def presence_penalty(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Subtract the penalty once from every token already in the output (OpenAI/vLLM semantics)."""
    present_RV = (view.output_counts > 0).to(logits_RV.dtype)
    return logits_RV - view.column("presence_penalty") * present_RV


def frequency_penalty(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Subtract the penalty times the number of times each token occurs in the output."""
    return logits_RV - view.column("frequency_penalty") * view.output_counts
