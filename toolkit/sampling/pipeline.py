"""The sampler's one entry point: a step's logits rows become tokens and their trace fields.

    staged = Sampler.stage(logits_RV, view, rows, verifying)   steps 1-3: Python and torch
    staged.fused.run()                                        step 4's native pass, on every thread (optional)
    out = Sampler.finish(staged)                              steps 4-6: a SamplerOutput

1. Raw log-normalisers (logsumexp) of every row, where speculation verifies some rows: the verifier reads them,
   and the rows whose raw logits hold NaN or +inf are known before the processors.
2. The processors, each row in its order (toolkit.sampling.processors.apply_pipeline). With no verification
   each row's trailing temperature / top-k / top-p and its repetition-penalty changes are left to step 4, which
   makes them in the same native pass that samples the row. Which rows a processor left no token is not read
   here (`defer_empty`: on a GPU a read waits for the device, and async scheduling stages a step while the device
   computes the next one): their flags are queued to the host with step 4's fields.
3. The plain rows: those not verified and not failed (a processor raised, or the row's raw logits are known bad);
   a row a processor emptied is sampled with them, its result dropped at step 5.
4. Sampling of the plain rows (toolkit.sampling.sampler.sample): Gumbel-max with counter-based noise, all rows in
   one native pass where the kernels run (batched torch elsewhere), with each token's raw and processed
   log-probabilities, support size, noise, top alternatives and kept-set digest.
5. Rows a processor emptied become errors (the flags read), and so do rows that step 4 found empty after changes
   left to it, named as step 2 would name them reading as it goes.
6. Without step 1, the raw log-normalisers come from step 4's pass (computed for rows it did not sample), and the
   rows whose raw logits hold NaN or +inf become errors, whatever the processors made of them.

It reads the rows' state and writes none of it; toolkit.engine.decide builds the rows (plain samples, forked
parallel samples, verification positions) and verifies drafts against `processed_RV`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit import devices
from toolkit.devices import tensor_on
from toolkit.sampling.processors import (
    BatchView,
    PipelineResult,
    apply_pipeline,
    emptied_by_changes,
    emptied_flags,
    emptied_rows,
    invalid_rows,
)
from toolkit.sampling.sampler import (
    DeviceSample,
    FusedSample,
    SampleResult,
    SampleRow,
    device_sample,
    logsumexp_rows,
    queue_read,
    sample,
)


@dataclass
class Staged:
    """What Sampler.stage prepared for Sampler.finish."""

    logits_RV: torch.Tensor
    pipe: PipelineResult  # step 2's result: processed rows (before any tail left to step 4) and errors
    lse_R: torch.Tensor | None  # step 1's raw log-normalisers (None: step 4 reads them)
    plain: list[int]  # step 3: the rows sampled
    sample_args: tuple | None = None  # sample()'s arguments for the plain rows
    fused: FusedSample | None = None  # step 4's fused path, where it takes one: its native pass still to run
    device: DeviceSample | None = None  # step 4 off the CPU: queued at stage, read at finish
    emptied_read: tuple | None = None  # step 2's emptied-row flags queued to the host (queue_read's pair)

    def device_tokens(self) -> torch.Tensor | None:
        """Every row's token where the logits are, before anything is read (a row that is not sampled: 0); None on
        the CPU, where step 4 runs at finish."""
        if self.device is None:
            return None
        if self.plain == list(range(self.logits_RV.shape[0])):  # every row sampled: the choices as they are
            return self.device.tokens_R
        tokens_R = torch.zeros(self.logits_RV.shape[0], dtype=torch.int64, device=self.logits_RV.device)
        tokens_R[tensor_on(self.plain, tokens_R.device, torch.int64)] = self.device.tokens_R
        return tokens_R


@dataclass(frozen=True)
class SamplerOutput:
    result: SampleResult | None  # the plain rows' tokens and trace fields, in `plain` order
    plain: list[int]
    errors: dict[int, str]  # row -> why it has no token
    processed_RV: torch.Tensor  # the processed rows (what verification compares drafts against)
    lse_R: torch.Tensor  # every row's raw logsumexp


class Sampler:
    """Steps 1-6 of the module doc for the engine's rows; `batch_invariant` keeps each row's reductions
    independent of the other rows."""

    def __init__(self, batch_invariant: bool):
        self.batch_invariant = batch_invariant

    def __call__(
        self, logits_RV: torch.Tensor, view: BatchView, rows: list[SampleRow | None], verifying: bool = False
    ) -> SamplerOutput:
        return self.finish(self.stage(logits_RV, view, rows, verifying))

    def stage(
        self, logits_RV: torch.Tensor, view: BatchView, rows: list[SampleRow | None], verifying: bool = False
    ) -> Staged:
        """Steps 1-3 and step 4's arguments. `rows[i]` is row i's noise key and alternatives (None: a row that
        speculation verifies, not sampled here); `verifying`: some sequence verifies drafts this step."""
        lse_R = logsumexp_rows(logits_RV, per_row=self.batch_invariant) if verifying else None  # 1
        pipe = apply_pipeline(
            logits_RV,
            view,
            row_errors=invalid_rows(lse_R) if lse_R is not None else {},
            defer_tail=not verifying,
            defer_empty=True,
        )  # 2
        plain = [i for i, row in enumerate(rows) if row is not None and i not in pipe.errors]  # 3
        staged = Staged(logits_RV, pipe, lse_R, plain)
        if pipe.emptied:
            staged.emptied_read = queue_read([emptied_flags(pipe.emptied)])
        if plain:
            staged.sample_args = self._sample_args(staged, [rows[i] for i in plain])
            staged.fused = FusedSample.of(*staged.sample_args)
            if staged.fused is None and devices.off_cpu(logits_RV):  # queued now, read at finish
                raw, processed, sample_rows, lse, per_row, _, patches = staged.sample_args
                staged.device = device_sample(raw, processed, sample_rows, lse, per_row, patches)
        return staged

    def finish(self, staged: Staged) -> SamplerOutput:
        """Steps 4-6 (step 4's native pass run first if nobody ran it)."""
        logits_RV, pipe, lse_R, plain = staged.logits_RV, staged.pipe, staged.lse_R, staged.plain
        errors, result = pipe.errors, None
        if plain:  # 4
            if staged.fused is not None:
                result = staged.fused.result()
            else:
                result = staged.device.result() if staged.device is not None else sample(*staged.sample_args)
        if staged.emptied_read is not None:  # 5
            (flags,), event = staged.emptied_read
            if event is not None:
                event.synchronize()
            errors = {**errors, **emptied_rows(pipe.emptied, flags.tolist())}
        if pipe.changed_by and result is not None:
            empty = [i for i, support in zip(plain, result.support_sizes) if support == 0 and i not in errors]
            errors = {**errors, **emptied_by_changes(pipe, empty)}
        if lse_R is None:  # 6
            lse_R = self._raw_logsumexp(logits_RV, plain, result)
            read = result.raw_logsumexp if result is not None and len(plain) == logits_RV.shape[0] else None
            errors = {**errors, **invalid_rows(lse_R, read)}
        return SamplerOutput(result, plain, errors, pipe.processed_RV, lse_R)

    def draft(self, logits_RV: torch.Tensor, view: BatchView, rows: list[SampleRow]) -> tuple[torch.Tensor, list[int]]:
        """A draft model's rows: (the processed rows, a row the processors failed holding its raw logits, so it
        proposes greedily; each row's token). Steps 1, 2 and 4, every row sampled."""
        lse = logsumexp_rows(logits_RV, per_row=self.batch_invariant)
        pipe = apply_pipeline(logits_RV, view, row_errors=invalid_rows(lse))
        safe = pipe.processed_RV.clone()  # never the raw logits themselves: error rows are replaced below
        for i in pipe.errors:
            safe[i] = logits_RV[i]
        return safe, sample(logits_RV, safe, rows, per_row=self.batch_invariant).token_ids

    def _sample_args(self, staged: Staged, sample_rows: list[SampleRow]) -> tuple:
        """sample()'s arguments for the plain rows (all the rows, or a copy of theirs)."""
        logits_RV, pipe, lse_R, plain = staged.logits_RV, staged.pipe, staged.lse_R, staged.plain
        tail = [pipe.tail[i] for i in plain] if pipe.tail is not None else None
        if len(plain) == logits_RV.shape[0]:
            return (logits_RV, pipe.processed_RV, sample_rows, lse_R, self.batch_invariant, tail, pipe.patches)
        index = tensor_on(plain, logits_RV.device, torch.int64)
        patches = pipe.patches.select(plain, logits_RV.shape[0]) if pipe.patches is not None else None
        raw = logits_RV.index_select(0, index)
        processed = raw if pipe.processed_RV is logits_RV else pipe.processed_RV.index_select(0, index)
        return (
            raw,
            processed,
            sample_rows,
            lse_R.index_select(0, index) if lse_R is not None else None,
            self.batch_invariant,
            tail,
            patches,
        )

    def _raw_logsumexp(self, logits_RV: torch.Tensor, plain: list[int], result: SampleResult | None) -> torch.Tensor:
        """Every row's raw logsumexp: the sampler's for the rows it sampled (`plain`), computed for the rest
        (rows the processors failed: is the model's output to blame?)."""
        if len(plain) == logits_RV.shape[0] and plain:
            return result.raw_logsumexp_R
        lse_R = torch.empty(logits_RV.shape[0], dtype=logits_RV.dtype, device=logits_RV.device)
        if plain:
            lse_R[plain] = result.raw_logsumexp_R
        sampled = set(plain)
        rest = [i for i in range(logits_RV.shape[0]) if i not in sampled]
        if rest:
            lse_R[rest] = logsumexp_rows(logits_RV[rest], per_row=self.batch_invariant)
        return lse_R


__all__ = ["Sampler", "SamplerOutput", "SampleRow", "Staged"]
