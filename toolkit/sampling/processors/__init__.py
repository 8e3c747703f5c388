"""The ordered logits-processor pipeline.

Default order (the serving chapter's): penalties -> hard masks -> temperature ->
truncation -> sample. A request may give its own order (`SamplingParams.processors`);
rows are grouped by order and each processor runs once per group on the rows for which
it is active, with per-row parameters. A row whose support a processor empties (or
whose logits hold NaN, or whose processor raised) is reported as an error naming the
cause; the other rows are untouched. With `defer_empty` (the sampler's), which rows a
processor emptied is not read as it runs (on a GPU each read waits for the device):
each processor's flags stay where the logits are (`PipelineResult.emptied`), the row goes
on through the rest of its processors (nothing makes an empty row less empty) and is
sampled with the others, and `emptied_rows` names the first processor that emptied it
once the flags are read with the sampler's results.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from toolkit.devices import tensor_on
from toolkit.native.sampling_ops import tail_fusable
from toolkit.sampling.params import DEFAULT_PROCESSORS
from toolkit.sampling.processors import masks, penalties, truncation
from toolkit.sampling.processors.base import NEG_INF, BatchView, Patches, Processor, RowState
from toolkit.sampling.sampler import Tail

REGISTRY: dict[str, Processor] = {
    "repetition_penalty": penalties.repetition_penalty,
    "presence_penalty": penalties.presence_penalty,
    "frequency_penalty": penalties.frequency_penalty,
    "allowed_token_ids": masks.allowed_token_ids,
    "bad_words": masks.bad_words,
    "logit_bias": masks.logit_bias,
    "no_repeat_ngram": masks.no_repeat_ngram,
    "min_tokens": masks.min_tokens,
    "grammar": masks.grammar,
    "temperature": truncation.temperature,
    "top_k": truncation.top_k,
    "top_p": truncation.top_p,
    "min_p": truncation.min_p,
}
assert tuple(REGISTRY) == DEFAULT_PROCESSORS


# processors the sampler can apply itself, fused with its own passes over a row (toolkit.native.sampling_ops.sample_tail_cpu)
SAMPLER_TAIL = frozenset({"temperature", "top_k", "top_p"})


@dataclass(frozen=True)
class PipelineResult:
    processed_RV: torch.Tensor  # processed logits (rows with an error are left as they were)
    errors: dict[int, str]  # row -> why it cannot be sampled
    # with defer_tail: per row, the processors left to the sampler (sampling.sample(tail=...)); processed_RV
    # is then the logits before them
    tail: tuple[Tail, ...] | None = None
    # with defer_tail: changes of processors with `changes` (see base.py) left to the sampler's kernel, made
    # before each row's tail; processed_RV is then the logits before them too. Whether they empty a row is
    # known once the sampler has run (see emptied_by_changes)
    patches: Patches | None = None
    changed_by: dict[int, str] = field(default_factory=dict)  # row -> the processor whose changes it has
    # with defer_empty: each processor run's rows and whether it left each one empty, in the order they ran (still
    # where the logits are); errors then holds the rest (emptied_rows reads these)
    emptied: tuple[Emptied, ...] = ()


@dataclass(frozen=True)
class Emptied:
    """One processor's run: the rows it ran on and, for each, whether it left the row no token (not yet read)."""

    name: str
    rows: tuple[int, ...]
    empty_T: torch.Tensor  # (len(rows),) bool


def emptied_flags(emptied: tuple[Emptied, ...]) -> torch.Tensor:
    """Every run's flags in one tensor, to be read in one transfer (emptied_rows takes them back apart)."""
    return torch.cat([e.empty_T for e in emptied])


def emptied_rows(emptied: tuple[Emptied, ...], flags: list[bool]) -> dict[int, str]:
    """The rows the runs left empty (`flags`: emptied_flags read), each with the error apply_pipeline gives it when
    it reads them as it goes: the first processor that emptied it (a row runs its processors in its order, and
    rows of one order run together, so the first run that flags a row is its first)."""
    errors: dict[int, str] = {}
    at = 0
    for run in emptied:
        for i, empty in zip(run.rows, flags[at : at + len(run.rows)]):
            if empty and i not in errors:
                errors[i] = _empty(run.name)
        at += len(run.rows)
    return errors


def _empty(name: str) -> str:
    return f"empty support: processor {name!r} removed every token"


def sampler_tail(params, vocab_size: int) -> Tail:
    """The longest run at the end of a row's active processors that the sampler applies itself: these
    come last in the row's order, so leaving them to the sampler changes no value (it computes them as
    the processors do, see toolkit.native.sampling_ops.sample_tail_cpu)."""
    active = params.active_processors()
    n = len(active)
    while n and active[n - 1] in SAMPLER_TAIL:
        n -= 1
    return tuple(
        (name, min(params.top_k, vocab_size) if name == "top_k" else getattr(params, name)) for name in active[n:]
    )


def invalid_rows(logsumexp_R: torch.Tensor, read: list[float] | None = None) -> dict[int, str]:
    """Rows whose raw logits hold NaN or +inf (their logsumexp is not finite) cannot be sampled. `read`: the
    values, already on the host (a GPU's sampler reads them with its results)."""
    # read as Python floats: R values, where a torch op here waited on its thread pool (~0.3 ms a step)
    return {
        i: "the model produced NaN or infinite logits"
        for i, v in enumerate(logsumexp_R.tolist() if read is None else read)
        if not math.isfinite(v)
    }


def apply_pipeline(
    logits_RV: torch.Tensor,
    view: BatchView,
    registry: dict[str, Processor] | None = None,
    row_errors: dict[int, str] | None = None,
    defer_tail: bool = False,
    defer_empty: bool = False,
) -> PipelineResult:
    """Run every row through its processors in its order. Never mutates `logits_RV`.

    `row_errors` are rows already known to be unusable (see `invalid_rows`); without it the
    logits are scanned for NaN here. When no processor is active, the result IS the input.
    `defer_tail` (the default registry, where the native sampler runs on these logits) leaves each row's
    `sampler_tail` to the sampler, which applies it in the same pass that samples the row.
    `defer_empty` reads nothing from the logits' device: the rows a processor empties are left in
    `emptied` (see the module doc), unless a processor raises (then they are read first, to name each row's
    first failure).
    """
    defer_tail = defer_tail and registry in (None, REGISTRY) and tail_fusable(logits_RV)
    registry = registry or REGISTRY
    if row_errors is None:
        row_errors = invalid_rows(torch.logsumexp(logits_RV, dim=-1))
    errors: dict[int, str] = dict(row_errors)
    tail = tuple(sampler_tail(row.params, view.vocab_size) for row in view.rows) if defer_tail else None
    groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for i, row in enumerate(view.rows):
        if i not in errors:
            groups[row.params.order].append(i)
    out, patches, changed_by = logits_RV, [], {}
    emptied: list[Emptied] | None = [] if defer_empty else None
    for order, rows in groups.items():
        runs: dict[str, list[int]] = defaultdict(list)  # processor -> the rows it runs on here
        last: dict[int, str] = {}  # row -> its last processor before a tail the sampler applies
        for i in rows:
            active = view.rows[i].params.active_processors()
            before_tail = active[: len(active) - len(tail[i])] if tail else active  # the tail is the sampler's
            for name in before_tail:
                runs[name].append(i)
            if tail and tail[i] and before_tail:
                last[i] = before_tail[-1]
        for name in order:
            active = [i for i in runs.get(name, ()) if i not in errors]  # a row emptied earlier stops there
            fn = registry[name]
            if hasattr(fn, "changes"):  # where nothing reads its output before the sampler: its changes
                deferred = [i for i in active if last.get(i) == name]
                made = _changes(view, fn, deferred) if deferred else None
                if made is not None:
                    patches.append(made)
                    changed_by.update(dict.fromkeys(deferred, name))
                    active = [i for i in active if last.get(i) != name]
            if active:
                out = _apply_one(out, view, name, fn, active, errors, emptied)
    return PipelineResult(
        processed_RV=out,
        errors=errors,
        tail=tail,
        patches=_merge(patches) if tail else None,
        changed_by=changed_by,
        emptied=tuple(emptied or ()),
    )


def _changes(view: BatchView, fn: Processor, rows: list[int]) -> Patches | None:
    """`fn.changes` on `rows`, numbered as in the block. None if it fails: the rows are then left to
    `_apply_one`, which isolates the row that fails."""
    whole = len(rows) == len(view.rows)
    try:
        changes = fn.changes(view if whole else view.subset(rows))
    except Exception:  # noqa: BLE001 - the dense call decides which row fails
        return None
    if whole:
        return changes
    index = tensor_on(rows, changes.rows_S.device, torch.int64)
    return Patches(index[changes.rows_S], changes.cols_S, changes.factor_S)


def emptied_by_changes(pipe: PipelineResult, rows: list[int]) -> dict[int, str]:
    """Of `rows` (rows of the block the sampler found without a finite logit), those that the changes left
    to it emptied, with the error apply_pipeline gives them when it makes the changes itself. A change can
    leave a row nothing only through -inf or NaN (a penalty that overflows), so this is found after the
    sampler's pass rather than by reading every changed entry before it."""
    errors = {}
    for i in rows:
        if i in pipe.changed_by:
            mine = pipe.patches.rows_S == i
            row = Patches(
                torch.zeros_like(pipe.patches.rows_S[mine]), pipe.patches.cols_S[mine], pipe.patches.factor_S[mine]
            ).apply(pipe.processed_RV[i : i + 1])
            if not bool(torch.amax(row) > NEG_INF):
                errors[i] = _empty(pipe.changed_by[i])
    return errors


def _merge(parts: list[Patches]) -> Patches | None:
    """One set of changes, rows in order (each row's changes come from one processor, in one part)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    rows_S = torch.cat([p.rows_S for p in parts])
    order = torch.argsort(rows_S, stable=True)
    return Patches(
        rows_S[order], torch.cat([p.cols_S for p in parts])[order], torch.cat([p.factor_S for p in parts])[order]
    )


def _apply_one(
    logits_RV: torch.Tensor,
    view: BatchView,
    name: str,
    fn: Processor,
    rows: list[int],
    errors: dict[int, str],
    emptied: list[Emptied] | None = None,
) -> torch.Tensor:
    """`fn` on `rows`; the rows it empties become errors, or (`emptied` given) their flags are appended to it."""
    whole = len(rows) == logits_RV.shape[0]
    index = tensor_on(rows, logits_RV.device, torch.int64)
    before = logits_RV if whole else logits_RV.index_select(0, index)
    try:
        after = fn(before, view if whole else view.subset(rows))
    except Exception:  # noqa: BLE001 - isolate the row(s) that make a processor fail
        if emptied:  # the rows emptied so far fail there, not here: read them now (a rare path)
            errors.update(emptied_rows(tuple(emptied), emptied_flags(tuple(emptied)).tolist()))
            emptied.clear()
            rows = [i for i in rows if i not in errors]
        return _apply_row_by_row(logits_RV, view, name, fn, rows, errors)
    # a row is emptied when its largest logit is not above -inf (all -inf, or NaN): one reduction, where
    # isfinite(...).any() wrote and read a vocabulary-wide bool block (7 ms a step at 64 rows)
    empty_T = ~(torch.amax(after, dim=-1) > NEG_INF)
    if emptied is not None:
        emptied.append(Emptied(name, tuple(rows), empty_T))
    else:
        for j in empty_T.nonzero().flatten().tolist():
            errors[rows[j]] = _empty(name)
    if whole:
        return after
    out = logits_RV.clone()
    out[index] = after
    return out


def _apply_row_by_row(logits_RV, view, name, fn, rows, errors) -> torch.Tensor:
    out = logits_RV.clone()
    for i in rows:
        try:
            row = fn(logits_RV[i : i + 1], view.subset([i]))
        except Exception as exc:  # noqa: BLE001
            errors[i] = f"processor {name!r} failed: {type(exc).__name__}: {exc}"
            continue
        if not bool(torch.amax(row) > NEG_INF):
            errors[i] = _empty(name)
        out[i] = row[0]
    return out


__all__ = [
    "BatchView",
    "Emptied",
    "Patches",
    "PipelineResult",
    "REGISTRY",
    "RowState",
    "SAMPLER_TAIL",
    "Tail",
    "apply_pipeline",
    "emptied_by_changes",
    "emptied_flags",
    "emptied_rows",
    "invalid_rows",
    "sampler_tail",
]
