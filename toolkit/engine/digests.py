"""A step's decide and commit stages with the sha256 of its decided logits rows (what the trace writes), hashed on
the other threads beside the Python that leaves them idle (a native ShaJob): beside the decider's work before the
sampler's native pass, then beside the rest of decide and the commit where the sampler took that pass (else the
commit alone), then beside the next step's scheduling and packing; what is left then is hashed on every thread
when the digests are read (RowDigests)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

import torch

from toolkit.engine.commit import Committed, Committer
from toolkit.engine.decide import Decider, Decision
from toolkit.engine.request import Sequence
from toolkit.engine.runner import ModelOutput
from toolkit.engine.scheduler import ScheduledBatch
from toolkit.engine.speculative import Proposal
from toolkit.native.sha import ShaJob

T = TypeVar("T")


def now_(fn: Callable[[], T]) -> T:
    """`ShaJob.beside`'s signature with nothing beside: run `fn` now."""
    return fn()


class CommitFailed(Exception):
    """The commit stage raised (its __cause__): sequences may have changed, so the step is not retried."""


class RowDigests(Mapping[int, str]):
    """A step's logits row digests (decided row -> sha256 hex) whose hashing may go on beside the engine's next
    step: the first look at a digest hashes what is left (ShaJob.digests, on every thread)."""

    def __init__(self, job: ShaJob, rows: dict[int, int]):  # decided row -> the job's row
        self._job: ShaJob | None = job
        self._rows = rows
        self._hexes: dict[int, str] | None = None

    def _all(self) -> dict[int, str]:
        if self._hexes is None:
            hexes = self._job.digests()
            self._hexes = {row: hexes[i] for row, i in self._rows.items()}
            self._job = None
        return self._hexes

    def __getitem__(self, row: int) -> str:
        return self._all()[row]

    def __contains__(self, row: object) -> bool:
        return row in self._rows

    def __iter__(self) -> Iterator[int]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


def commit_decided(
    committer: Committer,
    batch: ScheduledBatch,
    decision: Decision,
    proposals: Mapping[str, Proposal],
    requests: Mapping[str, Sequence],
    start_time: float | None,
    digests: bool,
) -> tuple[Committed, RowDigests | None, ShaJob | None]:
    """The commit of a decision already made, with its decided rows' sha256 hashed beside it where `digests` and
    the rows are CPU fp32 (CommitFailed: the commit raised)."""

    def commit() -> Committed:
        return _commit(lambda: committer.commit(batch, decision, proposals, requests, start_time))

    if not _hashed(decision.logits_RV, digests):
        return commit(), None, None
    rows = sorted({e.row for _, emits in decision.emits for e in emits})
    job = ShaJob(decision.logits_RV, rows)
    return job.beside(commit), RowDigests(job, {row: i for i, row in enumerate(rows)}), job


def _commit(commit: Callable[[], Committed]) -> Committed:
    """A commit, its raise turned into CommitFailed."""
    try:
        return commit()
    except Exception as exc:  # noqa: BLE001 - raised by step as it was: a commit is not retried
        raise CommitFailed() from exc


def _hashed(logits_RV: torch.Tensor, digests: bool) -> bool:
    """Whether a step's rows are hashed: digests asked for, and CPU fp32 rows (what the native sha256 reads)."""
    return bool(digests and logits_RV.shape[0] and logits_RV.device.type == "cpu" and logits_RV.dtype == torch.float32)


def decide_and_commit(
    decider: Decider,
    committer: Committer,
    batch: ScheduledBatch,
    out: ModelOutput,
    proposals: Mapping[str, Proposal],
    requests: Mapping[str, Sequence],
    start_time: float | None,
    digests: bool,
) -> tuple[Decision, Committed, RowDigests | None, ShaJob | None]:
    """The decision and what it committed; with `digests`, the decided rows' sha256 (by decided row) where the rows
    are CPU fp32, and the hashing job still going on (the engine runs its next step's scheduling beside it)."""

    def commit(decision: Decision) -> Committed:
        return _commit(lambda: committer.commit(batch, decision, proposals, requests, start_time))

    def finish_and_commit() -> tuple[Decision, Committed]:
        decision = decider.finish(staged)
        return decision, commit(decision)

    logits = out.logits_RV
    # unhashed rows, or verification (its torch work stays on every thread; its rejected rows are not hashed)
    if proposals or not _hashed(logits, digests):
        decision = decider.decide(out, proposals, requests)
        return (decision, *commit_decided(committer, batch, decision, proposals, requests, start_time, digests))
    job = ShaJob(logits)  # every row of the forward's is decided (a follower's row is its leader's)
    staged = job.beside(lambda: decider.stage(out, proposals, requests))
    if staged.sampler is not None:
        staged.sampler.run()
        decision, committed = job.beside(finish_and_commit)
    else:
        decision = decider.finish(staged)
        committed = job.beside(lambda: commit(decision))
    return (
        decision,
        committed,
        RowDigests(job, {e.row: staged.rows[e.row].logits_row for _, emits in decision.emits for e in emits}),
        job,
    )
