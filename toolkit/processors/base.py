"""The processor protocol and the batch view it reads.

A processor is a pure function

    processor(logits_RV, view) -> logits_RV

of a float32 logits block (one row per sampled sequence) and a read-only view of those
rows' request state. It returns a NEW tensor (never writes into its input), applies
per-row parameters with vectorised tensor ops, and expresses a ban as -inf.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from typing import Callable, Sequence

import torch

from toolkit.config import SamplingParams

NEG_INF = float("-inf")


@dataclass(frozen=True)
class RowState:
    """What processors may read about one row: its parameters and its tokens so far."""

    params: SamplingParams
    token_ids: Sequence[int]  # prompt + output so far (read-only)
    num_prompt_tokens: int
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # bad_words resolved to token sequences

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True)
class BatchView:
    rows: tuple[RowState, ...]
    vocab_size: int
    device: torch.device
    eos_token_ids: tuple[int, ...] = ()
    grammar_mask_RV: torch.Tensor | None = None  # (R, V) bool: tokens each row's grammar allows (True without one)

    def subset(self, index: Sequence[int]) -> "BatchView":
        mask = None
        if self.grammar_mask_RV is not None:
            mask = self.grammar_mask_RV.index_select(0, torch.tensor(list(index), device=self.grammar_mask_RV.device))
        return BatchView(tuple(self.rows[i] for i in index), self.vocab_size, self.device, self.eos_token_ids, mask)

    def column(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A per-row parameter as an (R, 1) tensor, ready to broadcast against (R, V)."""
        return torch.tensor([[getattr(r.params, name)] for r in self.rows], dtype=dtype, device=self.device)

    def token_index(self, ids_per_row: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, cols) int64 index tensors of each row's listed token ids (repeats kept)."""
        counts = torch.tensor([len(ids) for ids in ids_per_row], dtype=torch.int64)
        rows = torch.repeat_interleave(torch.arange(len(ids_per_row)), counts)
        cols = torch.tensor(list(chain.from_iterable(ids_per_row)), dtype=torch.int64)  # one tensor, not one a row
        return rows.to(self.device), cols.to(self.device)

    def token_mask(self, ids_per_row: Sequence[Sequence[int]]) -> torch.Tensor:
        """(R, V) bool, True at each row's listed token ids."""
        rows, cols = self.token_index(ids_per_row)
        mask = torch.zeros(len(self.rows), self.vocab_size, dtype=torch.bool, device=self.device)
        if cols.numel():
            mask[rows, cols] = True
        return mask

    @cached_property
    def output_counts(self) -> torch.Tensor:
        """(R, V) float32: how often each token occurs in each row's output so far."""
        counts = torch.zeros(len(self.rows), self.vocab_size, dtype=torch.float32, device=self.device)
        for i, r in enumerate(self.rows):
            out = r.output_token_ids
            if len(out):
                ids = torch.as_tensor(list(out), dtype=torch.int64, device=self.device)
                counts[i].index_add_(0, ids, torch.ones(len(out), device=self.device))
        return counts


Processor = Callable[[torch.Tensor, BatchView], torch.Tensor]
