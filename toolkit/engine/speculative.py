"""Speculative decoding: proposers, and the verification that keeps the target distribution.

Each step, every decoding sequence that speculates gets up to k draft tokens from a
proposer; the target scores its newest token plus the drafts (k + 1 positions) inside
the step's ONE forward, beside the other decodes and prefill chunks; `verify` then
decides, position by position, which drafts are kept and what is emitted after them.

Proposers
- `ngram` (prompt lookup): the tokens that followed the latest earlier occurrence of the
  sequence's longest suffix (prompt_lookup_max down to prompt_lookup_min tokens); the
  draft distribution q is a point mass.
- `self_draft`: the target's first `draft_layers` layers + its final norm and LM head,
  sharing the weights and the target's paged KV cache for those layers.
- `draft_model`: any model with the target's vocabulary, with its own paged KV cache.
Draft models apply the request's whole processor pipeline (penalties, grammar mask,
temperature, truncation), so q is the processed draft distribution.

Acceptance (`speculative.acceptance`), with p the processed target distribution:
- `rejection` (Leviathan et al. 2023): keep draft d with probability min(1, p(d)/q(d)); on
  rejection emit a sample of normalize(max(p - q, 0)); after k kept drafts, a bonus token
  from p. The emitted tokens are distributed exactly as p (see the serving chapter).
- `coupled`: the draft samples with the SAME Gumbel noise as the target's own sample at
  that position; a draft is kept iff it equals the target's Gumbel-max sample, and the
  first mismatch emits the target's sample. The emitted tokens are then exactly those of a
  run without speculation, for the same seeds.
- greedy requests (temperature 0): keep iff the draft is the processed argmax.
All randomness is keyed by (seed, position, stream, purpose) and replays bit for bit.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from toolkit.config import ModelConfig, from_mapping
from toolkit.engine.request import Sequence, SequenceStatus
from toolkit.engine.runner import ModelRunner, kernel_runs
from toolkit.engine.scheduler import ScheduledBatch, ScheduledChunk
from toolkit.errors import ConfigError
from toolkit.kv import BlockManager, PagedKVCache
from toolkit.models import load_model
from toolkit.sampling import rng
from toolkit.sampling.sampler import gumbel_choice


class DraftHost(Protocol):
    """What Speculator.build reads of the engine it proposes for (toolkit.engine.core.Engine is one)."""

    loaded: Any  # the target's LoadedModel
    kv_cache: Any  # its PagedKVCache
    device: torch.device
    cfg: Any  # its EngineConfig (block_size, batch_invariant, flex_compile)
    attention_backend: str
    matmul_backend: str
    matmul_schedule: Any  # the target's chosen MatmulSchedule (None off the native CPU matmul)
    vocab_size: int
    tokenizer: Any
    num_kv_blocks: int


PLAIN, ACCEPTED, RESAMPLED, BONUS = "plain", "draft_accepted", "resampled", "bonus"


@dataclass(frozen=True)
class DraftContext:
    """What a proposer may use of the target while drafting: its block tables (a self-draft reads the
    target's cache) and the draft sampler (toolkit.engine.decide.Decider.draft_sample: each sequence's own
    processors and grammar, on forked matchers)."""

    block_table: Callable[[str], list[int]]
    sample: Callable[..., tuple[torch.Tensor, list[int]]]


@dataclass(frozen=True)
class Proposal:
    tokens: tuple[int, ...]  # draft tokens d_1..d_m for positions n..n+m-1
    q_logits: torch.Tensor | None = None  # (m, V) processed draft logits; None: point masses (ngram)


@dataclass(frozen=True)
class Verdict:
    tokens: tuple[int, ...]  # emitted, in order (accepted drafts, then one resampled or bonus token)
    origins: tuple[str, ...]
    noise: tuple[float, ...]  # the Gumbel noise that chose each emitted token (NaN where none did)
    draft_logprobs: tuple[float | None, ...]  # log q of each emitted token (None for a bonus token)
    accepted: int  # drafts kept


# --------------------------------------------------------------------------- verification


def sample_plain(logits_V: torch.Tensor, greedy: bool, seed: int, position: int, stream: int) -> tuple[int, float]:
    """The token a non-speculative run samples here (same rule as toolkit.sampling.sampler)."""
    if greedy:
        return int(torch.argmax(logits_V)), float("nan")
    return gumbel_choice(logits_V, rng.row_key(seed, position, stream, rng.SAMPLE))


def verify(
    p_logits: torch.Tensor,
    proposal: Proposal,
    *,
    greedy: bool,
    mode: str,
    seed: int,
    stream: int,
    first_position: int,
    residual_from_p: bool = False,
) -> Verdict:
    """Decide which drafts to keep. `p_logits` (m + 1, V): processed target logits at positions
    first_position .. first_position + m (row j predicts the token after d_1..d_j).

    `residual_from_p` is a deliberately wrong variant (resample from p instead of the
    residual) kept so that the distribution test can show it fails."""
    drafts = proposal.tokens
    tokens, origins, noise, dlp = [], [], [], []
    q_lp = torch.log_softmax(proposal.q_logits.double(), dim=-1) if proposal.q_logits is not None else None
    for j, d in enumerate(drafts):
        position = first_position + j
        p_row = p_logits[j]
        q_logprob_d = float(q_lp[j, d]) if q_lp is not None else 0.0
        if greedy:
            target = int(torch.argmax(p_row))
            keep, choice, g = d == target, target, float("nan")
        elif mode == "coupled":
            choice, g = gumbel_choice(p_row, rng.row_key(seed, position, stream, rng.SAMPLE))
            keep = d == choice
        else:
            p = torch.softmax(p_row.double(), dim=-1)
            u = rng.uniform_scalar(rng.row_key(seed, position, stream, rng.ACCEPT))
            keep = u * math.exp(q_logprob_d) < float(p[d])  # u < p(d) / q(d)
            choice, g = d, float("nan")
            if not keep:
                q = (
                    q_lp[j].exp()
                    if q_lp is not None
                    else torch.nn.functional.one_hot(torch.tensor(d), p.shape[0]).double()
                )
                residual = p if residual_from_p else (p - q).clamp_min(0.0)
                if float(residual.sum()) <= 0.0:  # p == q: any draft is kept with probability 1
                    residual = p
                choice, g = gumbel_choice(residual.log(), rng.row_key(seed, position, stream, rng.RESIDUAL))
        if keep:
            tokens.append(d)
            origins.append(ACCEPTED)
            noise.append(g if mode == "coupled" and not greedy else float("nan"))
            dlp.append(q_logprob_d if q_lp is not None else 0.0)
            continue
        tokens.append(choice)
        origins.append(RESAMPLED)
        noise.append(g)
        dlp.append(float(q_lp[j, choice]) if q_lp is not None else (0.0 if choice == d else float("-inf")))
        return Verdict(tuple(tokens), tuple(origins), tuple(noise), tuple(dlp), accepted=j)
    m = len(drafts)
    bonus, g = sample_plain(p_logits[m], greedy, seed, first_position + m, stream)
    tokens.append(bonus)
    origins.append(BONUS)
    noise.append(g)
    dlp.append(None)
    return Verdict(tuple(tokens), tuple(origins), tuple(noise), tuple(dlp), accepted=m)


# --------------------------------------------------------------------------- proposers


class NgramProposer:
    """Prompt lookup: continue the latest earlier occurrence of the sequence's suffix."""

    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def lookup(self, tokens: collections.abc.Sequence[int], k: int) -> tuple[int, ...]:
        n_tokens = len(tokens)
        for n in range(min(self.lookup_max, n_tokens - 1), self.lookup_min - 1, -1):
            suffix = list(tokens[n_tokens - n :])
            for start in range(n_tokens - n - 1, -1, -1):  # latest earlier occurrence first
                if list(tokens[start : start + n]) == suffix:
                    follow = tuple(tokens[start + n : start + n + k])
                    if follow:
                        return follow
        return ()

    def max_drafts(self, seq: Sequence, k: int) -> int:
        return len(self.lookup(seq.token_ids, k))

    def propose(self, context: DraftContext, items: list[tuple[Sequence, int]]) -> dict[str, Proposal]:
        return {seq.seq_id: Proposal(self.lookup(seq.token_ids, slots)) for seq, slots in items}

    def release(self, seq_id: str) -> None:
        pass


@dataclass
class _DraftSeq:
    computed: int = 0  # tokens whose KV the draft cache holds


class ModelProposer:
    """A draft model proposing k tokens autoregressively, batched across the speculating sequences.

    self_draft: the target model cut after `num_layers`, writing into the target's own cache
    (those layers' K/V of committed tokens are the target's, so no catch-up is needed).
    draft_model: a separate model with its own cache, block manager and runner.
    """

    def __init__(self, loaded, runner, block_manager=None, num_layers: int | None = None, shares_target_cache=False):
        self.loaded = loaded
        self.runner = runner
        self.blocks = block_manager
        self.num_layers = num_layers
        self.shares_target_cache = shares_target_cache
        self._state: dict[str, _DraftSeq] = {}

    def max_drafts(self, seq: Sequence, k: int) -> int:
        return k

    def release(self, seq_id: str) -> None:
        self._state.pop(seq_id, None)
        if self.blocks is not None and self.blocks.has(seq_id):
            self.blocks.free(seq_id)

    def rewind(self, seq_id: str, num_valid: int) -> None:
        """After verification: only the first `num_valid` tokens' draft K/V are still right."""
        state = self._state.get(seq_id)
        if state is not None:
            state.computed = min(state.computed, num_valid)

    def propose(self, context: DraftContext, items: list[tuple[Sequence, int]]) -> dict[str, Proposal]:
        drafts: dict[str, list[int]] = {seq.seq_id: [] for seq, _ in items}
        q_rows: dict[str, list[torch.Tensor]] = {seq.seq_id: [] for seq, _ in items}
        active = [(seq, slots) for seq, slots in items if slots > 0]
        draft_grammars: dict[str, Any] = {}  # grammar sequences' matchers, forked, through their drafts
        step = 0
        while active:
            chunks = []
            for seq, _ in active:
                tokens = list(seq.token_ids) + drafts[seq.seq_id]
                if self.shares_target_cache:
                    start = len(tokens) - 1  # committed tokens' K/V for these layers are the target's
                    table = context.block_table(seq.seq_id)
                else:
                    state = self._state.setdefault(seq.seq_id, _DraftSeq())
                    start = state.computed
                    if not self._reserve(seq.seq_id, len(tokens)):
                        continue
                    table = self.blocks.block_table(seq.seq_id)
                chunks.append(ScheduledChunk(seq.seq_id, tuple(tokens[start:]), start, tuple(table), True))
            if not chunks:
                break
            batch = ScheduledBatch(
                step=-1, chunks=tuple(chunks), num_decode_tokens=0, num_prefill_tokens=sum(c.num_tokens for c in chunks)
            )
            out = self.runner.run(batch, self.num_layers)
            by_id = {seq.seq_id: seq for seq, _ in active}
            rows = [by_id[c.seq_id] for c in out.sample_chunks]
            processed, tokens_out = context.sample(rows, drafts, out.logits_RV, draft_grammars)
            for i, seq in enumerate(rows):
                if not self.shares_target_cache:
                    self._state[seq.seq_id].computed = len(seq.token_ids) + len(drafts[seq.seq_id])
                drafts[seq.seq_id].append(tokens_out[i])
                q_rows[seq.seq_id].append(processed[i])
            step += 1
            active = [
                (seq, slots)
                for seq, slots in active
                if seq.seq_id in {c.seq_id for c in chunks} and len(drafts[seq.seq_id]) < slots
            ]
        return {sid: Proposal(tuple(d), torch.stack(q_rows[sid]) if q_rows[sid] else None) for sid, d in drafts.items()}

    def _reserve(self, seq_id: str, num_tokens: int) -> bool:
        if not self.blocks.has(seq_id):
            if not self.blocks.can_allocate(num_tokens):
                return False
            self.blocks.allocate(seq_id, num_tokens)
            return True
        extra = num_tokens - self.blocks.num_tokens(seq_id)
        if extra <= 0:
            return True
        if not self.blocks.can_append(seq_id, extra):
            return False
        self.blocks.append(seq_id, extra)
        return True


@dataclass
class SpecStats:
    steps: int = 0  # verification passes (sequence-steps)
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    plain_samples: int = 0  # sequence-steps sampled without drafts (prefill ends, no proposal)

    def summary(self) -> dict[str, Any]:
        forwards, tokens = self.steps + self.plain_samples, self.emitted + self.plain_samples
        return {
            "spec_verifications": self.steps,
            "spec_proposed": self.proposed,
            "spec_accepted": self.accepted,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else None,
            "mean_accepted_length": self.accepted / self.steps if self.steps else None,
            "tokens_per_verification": self.emitted / self.steps if self.steps else None,
            # per sequence: target forwards it took part in / tokens it got (1.0 without speculation)
            "target_forwards_per_output_token": forwards / tokens if tokens else None,
        }


class Speculator:
    """The engine's speculative state: the proposer and running statistics (counted by the decide stage,
    which verifies). `build` takes the engine only to read the components a proposer shares with it."""

    def __init__(self, cfg, proposer):
        self.cfg = cfg
        self.proposer = proposer
        self.stats = SpecStats()

    @classmethod
    def build(cls, cfg, engine: DraftHost) -> Speculator:
        if cfg.method == "ngram":
            return cls(cfg, NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max))
        if cfg.method == "self_draft":
            layers = engine.loaded.arch.num_layers
            if layers < 2:
                raise ConfigError(
                    "speculative.method=self_draft drafts with the model's first layers: it needs 2 or more"
                )
            if not 1 <= cfg.draft_layers < layers:
                raise ConfigError(
                    f"speculative.draft_layers must be in [1, {layers - 1}] for this model, got {cfg.draft_layers}"
                )
            runner = ModelRunner(
                engine.loaded.model,
                engine.kv_cache,
                engine.device,
                engine.attention_backend,
                batch_invariant=engine.cfg.batch_invariant,
                native_matmul=engine.matmul_backend == "native",
                # the target's own weights: its choice, not a second one (a measurement where no cache is kept)
                matmul_schedule=engine.matmul_schedule or engine.cfg.matmul_schedule,
                flex_compile=engine.cfg.flex_compile,
            )
            return cls(cfg, ModelProposer(engine.loaded, runner, num_layers=cfg.draft_layers, shares_target_cache=True))

        draft_cfg = from_mapping(ModelConfig, dict(cfg.draft_model or {}), section="speculative.draft_model")
        draft = load_model(draft_cfg, engine.device)
        if draft.arch.vocab_size != engine.vocab_size:
            raise ConfigError(
                f"speculative.draft_model has a vocabulary of {draft.arch.vocab_size} tokens, the target "
                f"{engine.vocab_size}: they must share a tokenizer"
            )
        if (
            engine.tokenizer is not None
            and draft.tokenizer is not None
            and draft.tokenizer.digest != engine.tokenizer.digest
        ):
            raise ConfigError("speculative.draft_model uses another tokenizer than the target")
        if draft.arch.max_position_embeddings < engine.max_model_len:  # it drafts at every position of the context
            raise ConfigError(
                f"speculative.draft_model reaches {draft.arch.max_position_embeddings} positions, the target's context "
                f"{engine.max_model_len} (engine.max_model_len): give a draft that reaches as far, or lower "
                f"engine.max_model_len"
            )
        layers, kv_heads, head_dim = draft.model.kv_shape
        blocks = engine.num_kv_blocks
        cache = PagedKVCache(
            layers, blocks, engine.cfg.block_size, kv_heads, head_dim, draft.model.embed.dtype, engine.device
        )
        on_kernel = (
            engine.attention_backend == "kernel"
            and draft.model.embed.dtype == torch.float32
            and kernel_runs(draft.model, engine.cfg.block_size)
        )  # the draft's own shapes too
        runner = ModelRunner(
            draft.model,
            cache,
            engine.device,
            "kernel" if on_kernel else "sdpa",
            batch_invariant=engine.cfg.batch_invariant and on_kernel,
            native_matmul=engine.matmul_backend == "native" and on_kernel,
            matmul_schedule=engine.cfg.matmul_schedule,
        )
        return cls(cfg, ModelProposer(draft, runner, block_manager=BlockManager(blocks, engine.cfg.block_size)))

    def max_drafts(self, seq, room: int) -> int:
        return self.proposer.max_drafts(seq, room)

    def draft_slots(self, running: collections.abc.Iterable[Sequence], max_model_len: int) -> dict[str, int]:
        """The decoding sequences that will speculate this step, and how many drafts each may take (the scheduler
        reserves their slots)."""
        slots = {}
        for seq in running:
            if seq.status is not SequenceStatus.DECODING:
                continue
            room = min(
                self.cfg.num_speculative_tokens,
                seq.sampling.max_tokens - seq.num_output_tokens - 1,
                max_model_len - seq.num_tokens - 1,
            )
            if room > 0:
                wanted = self.max_drafts(seq, room)
                if wanted > 0:
                    slots[seq.seq_id] = wanted
        return slots

    def fill(
        self, batch: ScheduledBatch, requests: Mapping[str, Sequence], context: DraftContext
    ) -> tuple[ScheduledBatch, dict[str, Proposal]]:
        """The reserved draft slots filled with proposals; the chunks then carry the newest token + drafts."""
        items = [(requests[c.seq_id], c.draft_slots) for c in batch.chunks if c.draft_slots]
        if not items:
            return batch, {}
        proposals = {sid: p for sid, p in self.propose(context, items).items() if p.tokens}
        chunks = tuple(
            dataclasses.replace(
                c,
                token_ids=c.token_ids + proposals[c.seq_id].tokens,
                draft_slots=0,
                num_logits=1 + len(proposals[c.seq_id].tokens),
            )
            if c.seq_id in proposals
            else dataclasses.replace(c, draft_slots=0)
            for c in batch.chunks
        )
        proposed = sum(len(p.tokens) for p in proposals.values())
        return dataclasses.replace(
            batch,
            chunks=chunks,
            num_decode_tokens=batch.num_decode_tokens - sum(c.draft_slots for c in batch.chunks) + proposed,
        ), proposals

    def propose(self, context: DraftContext, items):
        return self.proposer.propose(context, items)

    def rewind(self, seq_id: str, num_valid: int) -> None:
        if isinstance(self.proposer, ModelProposer):
            self.proposer.rewind(seq_id, num_valid)

    def release(self, seq_id: str) -> None:
        self.proposer.release(seq_id)
