"""Hard masks: forbidden tokens get -inf (plus the additive logit bias)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from toolkit.devices import tensor_on
from toolkit.sampling.processors.base import NEG_INF, BatchView


def allowed_token_ids(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Only the listed tokens (SamplingParams keeps them sorted and unique: the largest is the last)."""
    allowed_RV = view.token_mask([_below(r.params.allowed_token_ids, view.vocab_size) for r in view.rows])
    return logits_RV.masked_fill(~allowed_RV, NEG_INF)


def _below(ids: Sequence[int], vocab_size: int) -> Sequence[int]:
    """The sorted `ids` under vocab_size, not copied where all are (a step's cost is not one Python loop an id)."""
    return ids if not ids or ids[-1] < vocab_size else [t for t in ids if t < vocab_size]


def resolve_bad_words(bad_words, tokenizer) -> tuple[tuple[int, ...], ...]:
    """Bad words as token sequences: a string is banned with and without a leading space (vLLM)."""
    out: list[tuple[int, ...]] = []
    for word in bad_words:
        if isinstance(word, tuple):
            variants = [word]
        else:
            if tokenizer is None:
                raise ValueError("bad_words strings need a tokenizer; give token-id sequences instead")
            variants = [tuple(tokenizer.encode(text, add_special_tokens=False)) for text in (word, " " + word.lstrip())]
        out.extend(v for v in variants if v and v not in out)
    return tuple(out)


def banned_by_sequences(tokens: Sequence[int], sequences: Sequence[Sequence[int]]) -> set[int]:
    """Last tokens of the sequences whose prefix the tokens currently end with (single tokens: always)."""
    banned = set()
    for seq in sequences:
        head = len(seq) - 1
        if head == 0 or (len(tokens) >= head and list(tokens[len(tokens) - head :]) == list(seq[:head])):
            banned.add(seq[-1])
    return banned


def bad_words(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Ban the token that would complete a bad word (bad words match the output, as in vLLM)."""
    banned = [banned_by_sequences(r.output_token_ids, r.bad_words_ids) for r in view.rows]
    return logits_RV.masked_fill(view.token_mask(banned), NEG_INF)


def logit_bias(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    rows, cols, values = [], [], []
    for i, r in enumerate(view.rows):
        for token, bias in (r.params.logit_bias or {}).items():
            if token < view.vocab_size:
                rows.append(i)
                cols.append(token)
                values.append(bias)
    bias_RV = torch.zeros_like(logits_RV)
    if rows:
        dev = logits_RV.device
        bias_RV[tensor_on(rows, dev, torch.int64), tensor_on(cols, dev, torch.int64)] = tensor_on(
            values, dev, logits_RV.dtype
        )
    return logits_RV + bias_RV


def banned_ngram_next_tokens(tokens: Sequence[int], n: int) -> set[int]:
    """Tokens that would repeat an n-gram already present in `tokens` (HF NoRepeatNGram semantics)."""
    if n <= 0 or len(tokens) + 1 < n:
        return set()
    if n == 1:
        return set(tokens)
    table: dict[tuple[int, ...], set[int]] = defaultdict(set)
    for i in range(len(tokens) - n + 1):
        table[tuple(tokens[i : i + n - 1])].add(tokens[i + n - 1])
    return table.get(tuple(tokens[len(tokens) - (n - 1) :]), set())


def no_repeat_ngram(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    banned = [banned_ngram_next_tokens(list(r.token_ids), r.params.no_repeat_ngram_size) for r in view.rows]
    return logits_RV.masked_fill(view.token_mask(banned), NEG_INF)


def min_tokens(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Until min_tokens outputs exist, EOS (unless ignore_eos) and stop_token_ids cannot be sampled."""
    banned = []
    for r in view.rows:
        ids: set[int] = set()
        if r.num_output_tokens < r.params.min_tokens:
            ids.update(r.params.stop_token_ids)
            if not r.params.ignore_eos:
                ids.update(view.eos_token_ids)
        banned.append({t for t in ids if t < view.vocab_size})
    return logits_RV.masked_fill(view.token_mask(banned), NEG_INF)


def grammar(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Tokens the row's grammar cannot accept next (bitmasks filled for the whole step by the engine)."""
    return logits_RV.masked_fill(~view.grammar_mask_RV, NEG_INF)
