"""Penalties: read the history and push repeated tokens down."""

from __future__ import annotations

import numpy as np
import torch

from toolkit.devices import to_device
from toolkit.sampling.processors.base import BatchView, Patches, token_index_np


def repetition_penalty(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Tokens seen in prompt or output: positive logits are divided by the penalty, negative ones multiplied.
    Only the seen entries are read and written (a token seen twice is penalised once: both writes
    carry the same value, computed from the input)."""
    return repetition_penalty_changes(view).apply(logits_RV)


def repetition_penalty_changes(view: BatchView) -> Patches:
    """The entries repetition_penalty changes and their factors (rows in order), on the view's device. Built
    host-side in numpy from the rows' tokens alone: a few hundred entries, where each small torch call cost more
    than the work."""
    rows_S, cols_S = token_index_np([r.token_ids for r in view.rows])
    with np.errstate(over="ignore"):  # a penalty beyond float32 is inf, as a float32 tensor of it
        factor_S = np.array([r.params.repetition_penalty for r in view.rows], np.float32)[rows_S]
    return Patches(*(to_device(torch.from_numpy(a), view.device) for a in (rows_S, cols_S, factor_S)))


repetition_penalty.changes = repetition_penalty_changes


def presence_penalty(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Subtract the penalty once from every token already in the output (OpenAI/vLLM semantics)."""
    present_RV = (view.output_counts > 0).to(logits_RV.dtype)
    return logits_RV - view.column("presence_penalty") * present_RV


def frequency_penalty(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Subtract the penalty times the number of times each token occurs in the output."""
    return logits_RV - view.column("frequency_penalty") * view.output_counts
