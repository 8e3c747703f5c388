"""The processor protocol and the batch view it reads.

A processor is a pure function

    processor(logits_RV, view) -> logits_RV

of a float32 logits block (one row per sampled sequence) and a read-only view of those
rows' request state. It returns a NEW tensor (never writes into its input), applies
per-row parameters with vectorised tensor ops, and expresses a ban as -inf.

A processor that penalises only a few entries of each row (the repetition penalty) may also offer
`processor.changes(view) -> Patches`, those entries and their factors (from the rows' state alone); the
pipeline then hands them to the sampler's kernel, which makes them in its pass over each row, instead of
copying the block.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from toolkit.devices import tensor_on, to_device
from toolkit.sampling.params import SamplingParams

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
        return self.token_ids[self.num_prompt_tokens :]

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

    def subset(self, index: Sequence[int]) -> BatchView:
        mask = None
        if self.grammar_mask_RV is not None:
            mask = self.grammar_mask_RV.index_select(
                0, tensor_on(list(index), self.grammar_mask_RV.device, torch.int64)
            )
        return BatchView(tuple(self.rows[i] for i in index), self.vocab_size, self.device, self.eos_token_ids, mask)

    def column(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A per-row parameter as an (R, 1) tensor, ready to broadcast against (R, V)."""
        return tensor_on([[getattr(r.params, name)] for r in self.rows], self.device, dtype)

    def token_index(self, ids_per_row: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, cols) int64 index tensors of each row's listed token ids (repeats kept)."""
        rows, cols = token_index_np(ids_per_row)
        return to_device(torch.from_numpy(rows), self.device), to_device(torch.from_numpy(cols), self.device)

    def token_mask(self, ids_per_row: Sequence[Sequence[int]]) -> torch.Tensor:
        """(R, V) bool, True at each row's listed token ids."""
        rows, cols = self.token_index(ids_per_row)
        mask = torch.zeros(len(self.rows), self.vocab_size, dtype=torch.bool, device=self.device)
        if cols.numel():
            mask[rows, cols] = True
        return mask

    @cached_property
    def output_counts(self) -> torch.Tensor:
        """(R, V) float32: how often each token occurs in each row's output so far, all rows in one indexed add
        (exact: whole counts below 2^24, in any order of addition)."""
        counts = torch.zeros(len(self.rows), self.vocab_size, dtype=torch.float32, device=self.device)
        rows, cols = self.token_index([r.output_token_ids for r in self.rows])
        if cols.numel():
            counts.index_put_((rows, cols), torch.ones(cols.numel(), device=self.device), accumulate=True)
        return counts


def token_index_np(ids_per_row: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) int64 arrays of each row's listed token ids (repeats kept), host-side."""
    flat, counts = array("q"), array("q")  # one buffer, filled by C loops, not an array a row
    for ids in ids_per_row:
        flat.extend(ids)
        counts.append(len(ids))
    rows = np.repeat(np.arange(len(counts), dtype=np.int64), np.frombuffer(counts, np.int64))
    return rows, np.frombuffer(flat, np.int64) if flat else np.empty(0, np.int64)


@dataclass(frozen=True)
class Patches:
    """A penalty on a few entries of a logits block, rows in order: entry k divides the logit at row
    rows_S[k], column cols_S[k] by factor_S[k] where it is not negative and multiplies it by factor_S[k]
    where it is (HF's: a logit of 0 stays 0, even under an infinite penalty) (a processor's output where it changes only these, see processors.apply_pipeline). The new
    values are computed from the incoming logits, so an entry listed twice is penalised once."""

    rows_S: torch.Tensor  # int64, non-decreasing
    cols_S: torch.Tensor  # int64
    factor_S: torch.Tensor  # float32

    def values(self, x_RV: torch.Tensor) -> torch.Tensor:
        """The entries' new values (float32 for float32 or narrower logits)."""
        seen_S = x_RV[self.rows_S, self.cols_S]
        return torch.where(seen_S < 0, seen_S * self.factor_S, seen_S / self.factor_S)

    def apply(self, x_RV: torch.Tensor) -> torch.Tensor:
        """A copy of x_RV with the changes made (what the kernel computes from them)."""
        out = x_RV.clone()
        out[self.rows_S, self.cols_S] = self.values(x_RV).to(out.dtype)
        return out

    def select(self, index: list[int], num_rows: int) -> Patches:
        """The changes of rows `index` (increasing) of a block of num_rows, renumbered 0.. as
        index_select(0, index) renumbers them."""
        where = torch.full((num_rows,), -1, dtype=torch.int64)
        where[torch.tensor(index, dtype=torch.int64)] = torch.arange(len(index))
        new = where[self.rows_S]
        keep = new >= 0
        return Patches(new[keep], self.cols_S[keep], self.factor_S[keep])


Processor = Callable[[torch.Tensor, BatchView], torch.Tensor]
