"""The decide stage: a step's logits rows become tokens, and nothing else changes.

    rows (plain, forked parallel samples, verification positions) -> grammar masks -> the sampler
    (toolkit/sampling/pipeline.py: processors, then the plain rows sampled, batched) / verify (each
    speculating sequence's rows, against the processed rows) -> Decision

It reads sequences and writes none of them: the grammar masks of verification depths and of draft
tokens are filled on forks of a sequence's matcher (xgrammar's `fork`), so a committed matcher is
never advanced by a draft and never rolled back. The only state it keeps is the speculation
statistics it counts while verifying. What it decides is committed by toolkit.engine.commit.
"""

from __future__ import annotations

import collections.abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from toolkit.devices import tensor_on, to_device
from toolkit.engine.request import Sequence
from toolkit.engine.runner import ModelOutput
from toolkit.engine.speculative import PLAIN, Proposal, Speculator, verify
from toolkit.sampling import pipeline, rng
from toolkit.sampling.grammar import GrammarBackend
from toolkit.sampling.pipeline import Sampler, SamplerOutput
from toolkit.sampling.processors import BatchView, RowState
from toolkit.sampling.sampler import FusedSample, SampleRow, kept_digests, logsumexp_rows, top_k


@dataclass
class Row:
    """One logits row to decide: the sequence, its history for the processors, the position it samples."""

    seq: Sequence
    logits_row: int
    tokens: collections.abc.Sequence[int]
    position: int
    depth: int = 0  # verification rows: number of drafts before this position


@dataclass(slots=True)
class Emit:
    """A token to commit (or an error), with what its trace row records. Read-only by convention (not
    frozen: a frozen dataclass's __init__ took ~3x as long, a step makes one a row)."""

    token: int
    row: int
    raw_logprob: float = float("nan")
    processed_logprob: float = float("nan")
    support: int = 0
    noise: float = float("nan")
    top_raw: tuple = ()
    top_processed: tuple = ()
    error: str | None = None
    origin: str = PLAIN
    draft_logprob: float | None = None
    spec_proposed: int = 0
    spec_accepted: int = 0
    kept_sha256: str | None = None  # digest of the kept set (toolkit.sampling.sampler.kept_digests)


@dataclass(frozen=True)
class Decision:
    """What one step decided, for the commit stage."""

    emits: list[tuple[Sequence, list[Emit]]]  # per sequence, in row order: the tokens (or error) to commit
    forks: list[tuple[Sequence, Sequence]]  # (leader, follower): parallel samples that leave their leader now
    logits_RV: torch.Tensor  # the raw logits rows decided from (Emit.row indexes them)
    grammar_allowed: dict[int, int]  # row -> tokens its grammar allowed


@dataclass
class Staged:
    """What Decider.stage prepared for Decider.finish."""

    rows: list[Row]
    forks: list[tuple[Sequence, Sequence]]
    logits_RV: torch.Tensor  # the raw logits rows decided from
    allowed: dict[int, int]
    proposals: Mapping[str, Proposal]
    sampling: pipeline.Staged  # the sampler's steps 1-3 (toolkit/sampling/pipeline.py)

    @property
    def sampler(self) -> FusedSample | None:
        """The sampler's fused native pass, still to run, where it takes one."""
        return self.sampling.fused


class Decider:
    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        grammar: Callable[[], GrammarBackend],
        speculator: Speculator | None,
        acceptance: str,
        batch_invariant: bool,
    ):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.grammar = grammar  # the engine's grammar backend, created on first use
        self.speculator = speculator
        self.acceptance = acceptance  # speculative.acceptance: how drafts are verified
        self.sampler = Sampler(batch_invariant)  # logits rows -> tokens and trace fields (batch_invariant: each
        # row's reductions independent of the other rows)

    def decide(self, out: ModelOutput, proposals: Mapping[str, Proposal], requests: Mapping[str, Sequence]) -> Decision:
        return self.finish(self.stage(out, proposals, requests))

    def stage(self, out: ModelOutput, proposals: Mapping[str, Proposal], requests: Mapping[str, Sequence]) -> Staged:
        """The part of decide before the sampler's native pass: rows, grammar masks, then the sampler's steps 1-3
        (processors, the rows it samples, its keys). Python and torch only where the sampler's kernel takes the
        rest (Staged.sampler): a caller may run it beside other work, then Staged.sampler.run() on every thread,
        then finish()."""
        rows, forks = self.rows(out, proposals, requests)
        logits_RV = out.logits_RV
        if len(rows) != logits_RV.shape[0] or any(r.logits_row != i for i, r in enumerate(rows)):
            logits_RV = logits_RV.index_select(
                0, tensor_on([r.logits_row for r in rows], logits_RV.device, torch.int64)
            )
        grammar_mask, allowed = self.grammar_masks(rows, logits_RV.shape, logits_RV.device)
        view = self._view(rows, logits_RV.device, grammar_mask)
        sample_rows = [
            None
            if r.seq.seq_id in proposals
            else SampleRow(
                greedy=r.seq.sampling.greedy,
                seed=r.seq.seed,
                position=r.position,
                stream=r.seq.stream,
                num_top=r.seq.sampling.logprobs or 0,
            )
            for r in rows
        ]
        return Staged(
            rows,
            forks,
            logits_RV,
            allowed,
            proposals,
            self.sampler.stage(logits_RV, view, sample_rows, verifying=bool(proposals)),
        )

    def finish(self, staged: Staged) -> Decision:
        """The rest of decide: the sampler's steps 4-6 (from its native pass where it ran), speculating sequences
        verified, a token or an error for every row."""
        emits = self._emits(staged, self.sampler.finish(staged.sampling))
        return Decision(emits, staged.forks, staged.logits_RV, staged.allowed)

    def rows(
        self, out: ModelOutput, proposals: Mapping[str, Proposal], requests: Mapping[str, Sequence]
    ) -> tuple[list[Row], list[tuple[Sequence, Sequence]]]:
        """One row per logits row to decide: plain samples, forked parallel samples, verification positions."""
        rows, forks = [], []
        offset = 0
        for chunk in out.sample_chunks:
            seq = requests[chunk.seq_id]
            if chunk.num_logits > 1:
                drafts = list(proposals[seq.seq_id].tokens)
                for j in range(chunk.num_logits):
                    rows.append(Row(seq, offset + j, list(seq.token_ids) + drafts[:j], seq.num_tokens + j, j))
            else:
                rows.append(Row(seq, offset, seq.token_ids, seq.num_tokens))
                if seq.followers and seq.num_output_tokens == 0:
                    for follower_id in seq.followers:
                        follower = requests[follower_id]
                        rows.append(Row(follower, offset, follower.token_ids, follower.num_tokens))
                        forks.append((seq, follower))
            offset += chunk.num_logits
        return rows, forks

    def grammar_masks(self, rows: list[Row], shape, device) -> tuple[torch.Tensor | None, dict[int, int]]:
        """Bitmasks of every grammar row, filled per verification depth in one batched call each. Past
        depth 0 a row's matcher is a fork of its sequence's, advanced through the drafts before it."""
        grammar_rows = [i for i, r in enumerate(rows) if r.seq.grammar is not None]
        if not grammar_rows:
            return None, {}
        mask = torch.ones(shape, dtype=torch.bool)
        allowed: dict[int, int] = {}
        reached: dict[str, tuple[int, Any]] = {}  # sequence -> (depth, its matcher there)
        depth = 0
        while True:
            at_depth = [i for i in grammar_rows if rows[i].depth == depth]
            if not at_depth:
                break
            ready = []
            for i in at_depth:
                d, matcher = reached.get(rows[i].seq.seq_id, (0, rows[i].seq.grammar))
                if d == depth and not matcher.is_terminated():  # past a stop token nothing is masked
                    ready.append((i, matcher))
            if ready:
                masks = self.grammar().fill_masks([m for _, m in ready])
                index = [i for i, _ in ready]
                mask[torch.tensor(index)] = masks
                allowed.update(zip(index, masks.sum(dim=-1).tolist()))
            for i, matcher in ready:  # through this row's draft token to the next depth's state
                nxt = i + 1
                if nxt < len(rows) and rows[nxt].seq is rows[i].seq and rows[nxt].depth == depth + 1:
                    ahead = matcher.fork() if depth == 0 else matcher
                    if self.grammar().accept(ahead, rows[nxt].tokens[-1]):
                        reached[rows[i].seq.seq_id] = (depth + 1, ahead)
            depth += 1
        return to_device(mask, device), allowed

    def _view(self, rows: list[Row], device, grammar_mask) -> BatchView:
        return BatchView(
            rows=tuple(RowState(r.seq.sampling, r.tokens, r.seq.num_prompt_tokens, r.seq.bad_words_ids) for r in rows),
            vocab_size=self.vocab_size,
            device=device,
            eos_token_ids=self.eos_token_ids,
            grammar_mask_RV=grammar_mask,
        )

    def _emits(self, staged: Staged, out: SamplerOutput) -> list[tuple[Sequence, list[Emit]]]:
        """Each sequence's emits in row order: a sampled token with its trace fields, an error, or (speculating
        sequences) the tokens its verification accepts."""
        rows, logits_RV, proposals, result = staged.rows, staged.logits_RV, staged.proposals, out.result
        if self.speculator is not None:
            self.speculator.stats.plain_samples += len(out.plain)
        slot = {row: j for j, row in enumerate(out.plain)}
        decisions: list[tuple[Sequence, list[Emit]]] = []
        seen: set[str] = set()
        for i, r in enumerate(rows):
            sid = r.seq.seq_id
            if sid in proposals:
                if sid in seen:
                    continue
                seen.add(sid)
                decisions.append((r.seq, self._verify_rows(i, rows, logits_RV, out, proposals[sid])))
            elif i in out.errors:
                decisions.append((r.seq, [Emit(token=-1, row=i, error=out.errors[i])]))
            else:
                j = slot[i]
                decisions.append(
                    (
                        r.seq,
                        [
                            Emit(
                                token=result.token_ids[j],
                                row=i,
                                raw_logprob=result.raw_logprobs[j],
                                processed_logprob=result.processed_logprobs[j],
                                support=result.support_sizes[j],
                                noise=result.noise[j],
                                top_raw=tuple(result.top_raw[j]),
                                top_processed=tuple(result.top_processed[j]),
                                kept_sha256=result.kept_sha256[j],
                            )
                        ],
                    )
                )
        return decisions

    def _verify_rows(
        self, first: int, rows: list[Row], logits_RV: torch.Tensor, out: SamplerOutput, proposal: Proposal
    ) -> list[Emit]:
        seq, lse_R = rows[first].seq, out.lse_R
        m = len(proposal.tokens)
        span = list(range(first, first + m + 1))
        bad = next((i for i in span if i in out.errors), None)
        if bad is not None and bad == first:
            return [Emit(token=-1, row=first, error=out.errors[first])]
        usable = span if bad is None else span[: span.index(bad)]
        depth = len(usable) - 1  # verify only as many drafts as there are usable positions
        sub = Proposal(proposal.tokens[:depth], proposal.q_logits[:depth] if proposal.q_logits is not None else None)
        verdict = verify(
            out.processed_RV[usable],
            sub,
            greedy=seq.sampling.greedy,
            mode=self.acceptance,
            seed=seq.seed,
            stream=seq.stream,
            first_position=rows[first].position,
        )
        self.speculator.stats.steps += 1
        self.speculator.stats.proposed += m
        self.speculator.stats.accepted += verdict.accepted
        self.speculator.stats.emitted += len(verdict.tokens)
        emits = []
        for k, (token, origin, g, dlp) in enumerate(
            zip(verdict.tokens, verdict.origins, verdict.noise, verdict.draft_logprobs)
        ):
            i = usable[k]
            raw_lp = float(logits_RV[i, token] - lse_R[i])
            proc = out.processed_RV[i]
            proc_lse = logsumexp_rows(proc[None])[0]
            proc_lp = float(proc[token] - proc_lse)
            finite = torch.isfinite(proc)
            support = int(finite.sum())
            emits.append(
                Emit(
                    token=token,
                    row=i,
                    raw_logprob=raw_lp,
                    processed_logprob=proc_lp,
                    support=support,
                    noise=g,
                    origin=origin,
                    draft_logprob=dlp,
                    kept_sha256=kept_digests([support], proc.shape[0], finite_RV=finite[None])[0],
                    spec_proposed=m,
                    spec_accepted=verdict.accepted,
                    top_raw=_top(logits_RV[i], lse_R[i], seq.sampling.logprobs),
                    top_processed=_top(proc, proc_lse, seq.sampling.logprobs),
                )
            )
        return emits

    def draft_sample(
        self,
        seqs: list[Sequence],
        drafts: Mapping[str, list[int]],
        logits_RV: torch.Tensor,
        draft_grammars: dict[str, Any],
    ) -> tuple[torch.Tensor, list[int]]:
        """A draft model's next token for each sequence, processed with the sequence's own pipeline.
        `draft_grammars` (the proposer's, for one proposal round) holds each grammar sequence's matcher
        forked and advanced through its drafts so far; a sequence's own matcher is never touched."""
        tokens_hist = [list(s.token_ids) + drafts[s.seq_id] for s in seqs]
        matchers = [draft_grammars.get(s.seq_id, s.grammar) for s in seqs]
        mask = None
        grammar_rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        if grammar_rows:
            mask = torch.ones(logits_RV.shape, dtype=torch.bool)
            mask[torch.tensor(grammar_rows)] = self.grammar().fill_masks([matchers[i] for i in grammar_rows])
            mask = to_device(mask, logits_RV.device)
        view = BatchView(
            rows=tuple(
                RowState(s.sampling, t, s.num_prompt_tokens, s.bad_words_ids) for s, t in zip(seqs, tokens_hist)
            ),
            vocab_size=self.vocab_size,
            device=logits_RV.device,
            eos_token_ids=self.eos_token_ids,
            grammar_mask_RV=mask,
        )
        purpose = rng.SAMPLE if self.acceptance == "coupled" else rng.DRAFT
        srows = [
            SampleRow(greedy=s.sampling.greedy, seed=s.seed, position=len(t), stream=s.stream, purpose=purpose)
            for s, t in zip(seqs, tokens_hist)
        ]
        safe, tokens = self.sampler.draft(logits_RV, view, srows)
        for i in grammar_rows:
            s = seqs[i]
            ahead = draft_grammars[s.seq_id] if s.seq_id in draft_grammars else s.grammar.fork()
            if self.grammar().accept(ahead, tokens[i]):
                draft_grammars[s.seq_id] = ahead
        return safe, tokens


def _top(logits_V: torch.Tensor, lse: torch.Tensor, k: int | None) -> tuple[tuple[int, float], ...]:
    if not k:
        return ()
    values, ids = top_k(logits_V, k)
    return tuple((int(t), float(v - lse)) for t, v in zip(ids, values) if v != float("-inf"))
