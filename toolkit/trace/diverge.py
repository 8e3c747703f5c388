"""Where two traces of the same requests part, and why: the one implementation of the first divergence.

Two runs' rows are matched by (request_id, stream, position). Every caller asks here:

- `replay` (recorded vs replayed): every differing field of every row (`Difference`, divergence.parquet) and each
  sequence's first divergence with its cause, printed by mode=replay;
- the report's two-run view (run a vs run b): each sequence's first divergence, its cause and its context;
- mode=compare (each run's token ids vs the first run's): `TokenAgreement`;
- the KV-quantisation and precision studies (greedy token streams): `first_difference`.

A first divergence is named by the most upstream stage that differs at that row (`CAUSES`, in pipeline order):
the forward's logits, then the processors' or grammar's kept set, then the noise, then the token, its logprob
bits, its finish; a row present in one run only is a `length` divergence. Where the two rows record another
sampling policy (`POLICY_FIELDS`: two runs of the same requests at another temperature), that policy is the
cause (`policy`), named with both values, unless the stage found is all it changed (another seed: the noise;
another top_k, top_p, min_p or processor: the kept set) or the raw logits differ (no policy changes them); the
stage's cause then says the policy differs too.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from toolkit.trace.schema import FLOAT_BITS, same_value

SeqKey = tuple[str, int]  # (request_id, stream)
RowKey = tuple[str, int, int]  # (request_id, stream, position)

# the sample columns two runs' rows are compared on, floats by their bits, in pipeline order
COMPARED_FIELDS = (
    "logits_sha256",
    "kept_sha256",
    "support_size",
    "noise",
    "token_id",
    "raw_logprob",
    "processed_logprob",
    "finish_reason",
    "error",
)
# what a replay of the same run (the same requests and policy) reproduces too, compared by replay only: the recorded
# top alternatives, the grammar's kept count and the speculative draft's fields. Two different runs may ask for other
# logprobs or drafts without diverging, so the report's and mode=compare's two-run views leave them out.
REPLAYED_ONLY = ("top_raw", "top_processed", "grammar_allowed", "draft_logprob", "spec_proposed", "spec_accepted")
REPLAYED_FIELDS = COMPARED_FIELDS + REPLAYED_ONLY

# the cause each kind of first divergence points to, checked in this order at the first differing position: what
# comes first in the pipeline (the forward) explains what follows
CAUSES = (
    ("prompt", "prompt: the two runs' prompts differ, so their rows continue other contexts"),
    ("logits", "numerical: the raw logits differ (logits_sha256), so the forward computed other bits"),
    ("policy", "sampling policy: the same logits, sampled under another policy"),
    ("support", "processors or grammar: the same logits, but another kept set (kept_sha256 / support_size)"),
    ("noise", "sampling noise: the same logits and kept set, other Gumbel noise (seed, position or stream)"),
    ("token", "sampling: the same logits, kept set and noise, but another token"),
    ("speculation", "speculation: the same token, another draft (draft_logprob / spec_proposed / spec_accepted)"),
    ("logprob", "numerical: the same token, other logprob bits"),
    ("finish", "stopping: the same token, another finish or error"),
    ("length", "length: one run has no row at this position (it stopped earlier, or its trace was cut)"),
)
CAUSE_TEXT = dict(CAUSES)
# the fields that name each kind, in the order CAUSES checks them (a field of none of them: "finish")
CAUSE_FIELDS = (
    ("length", {"row"}),
    ("logits", {"logits_sha256"}),
    ("support", {"kept_sha256", "support_size", "grammar_allowed"}),
    ("noise", {"noise"}),
    ("token", {"token_id"}),
    ("speculation", {"draft_logprob", "spec_proposed", "spec_accepted"}),
    ("logprob", {"raw_logprob", "processed_logprob", "top_raw", "top_processed"}),
)
# the sample columns that record a sequence's sampling policy (the same on each of its rows), and what each stage
# a policy change explains by itself: another seed draws other noise; another top_k / top_p / min_p or processor
# keeps another set. A policy difference a stage does not explain (a temperature) is the divergence's cause.
POLICY_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "processors")
EXPLAINED_BY = {"noise": {"seed"}, "support": {"top_k", "top_p", "min_p", "processors"}}
# which differing field a divergence's one line shows with its values first
HEADLINE = ("row", "token_id", "raw_logprob", "processed_logprob", "noise", "finish_reason", "error", "support_size")


def show(name: str, value: Any) -> str:
    """A compared value as text: a float column with its bits (they are what is compared)."""
    if name in FLOAT_BITS and isinstance(value, float):
        return f"{value!r} (0x{struct.pack('>' + FLOAT_BITS[name][1], value).hex()})"
    return repr(value)


def differing_fields(
    a: Mapping[str, Any], b: Mapping[str, Any], compared: Sequence[str] = COMPARED_FIELDS
) -> tuple[str, ...]:
    """The compared columns in which two rows of the same (sequence, position) differ, in pipeline order. A digest
    or a replayed-only column either run did not record (null: a trace older than schema 6 has no kept-set digest)
    is not compared."""
    return tuple(
        name
        for name in compared
        if not ((name.endswith("sha256") or name in REPLAYED_ONLY) and (a.get(name) is None or b.get(name) is None))
        and not same_value(name, a.get(name), b.get(name))
    )


def cause_of(fields: Iterable[str]) -> str:
    """The kind of divergence (a key of CAUSES) a set of differing fields points to."""
    f = set(fields)
    return next((kind for kind, names in CAUSE_FIELDS if f & names), "finish")


def _policy_value(value: Any) -> str:
    """A policy value as text: a float32 column's value as its shortest decimal (0.7, not 0.699999988)."""
    return repr(float(f"{value:.7g}")) if isinstance(value, float) else repr(value)


def policy_cause(kind: str, a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> tuple[str, list]:
    """The kind of a first divergence whose stage is `kind`, given its two rows (either may be missing: then the
    other run's sequence's first row stands for it, its policy is the same on every row), and the policy fields
    the two rows record apart."""
    if a is None or b is None:
        return kind, []
    apart = [
        Difference(a["request_id"], a["stream"], a["position"], f, a.get(f), b.get(f))
        for f in POLICY_FIELDS
        if f in a and f in b and a.get(f) is not None and b.get(f) is not None and a.get(f) != b.get(f)
    ]
    explained = {d.field for d in apart} <= EXPLAINED_BY.get(kind, set())
    return (kind if not apart or kind == "logits" or explained else "policy"), apart


def seq_name(request_id: str, stream: int) -> str:
    return request_id if stream == 0 else f"{request_id}#{stream}"


@dataclass(frozen=True)
class Difference:
    """One compared field of one row that differs between run a and run b (`row`: the row is in one run only,
    its values then say "present", "missing" or "absent")."""

    request_id: str
    stream: int
    position: int
    field: str
    a: Any
    b: Any

    def describe(self, a: str = "a", b: str = "b") -> str:
        return (
            f"{seq_name(self.request_id, self.stream)} position {self.position}: {self.field} "
            f"{a} {show(self.field, self.a)} vs {b} {show(self.field, self.b)}"
        )


@dataclass(frozen=True)
class Divergence:
    """Where two runs' rows of one sequence first differ, and why."""

    request_id: str
    stream: int
    position: int
    index: int  # the row's index in the sequence's output (0 = the first sampled token)
    kind: str  # a key of CAUSES
    fields: tuple[str, ...]  # the compared columns that differ there (("row",) for a length divergence)
    a_token: int | None
    b_token: int | None
    token_index: int | None = None  # the first output token whose id differs (None: every shared token agrees)
    differences: tuple[Difference, ...] = ()  # the differing fields with both runs' values
    policy: tuple[Difference, ...] = ()  # the sampling policy fields (POLICY_FIELDS) the two rows record apart

    @property
    def cause(self) -> str:
        if not self.policy:
            return CAUSE_TEXT[self.kind]
        scalars = [d for d in self.policy if d.field != "processors"] or list(self.policy)  # the list repeats them
        named = ", ".join(f"{d.field} {_policy_value(d.a)} vs {_policy_value(d.b)}" for d in scalars)
        if self.kind == "policy":
            return f"sampling policy: {named}; the same logits, sampled under another policy"
        return f"{CAUSE_TEXT[self.kind]}; the sampling policy differs too: {named}"

    def describe(self, a: str = "a", b: str = "b") -> str:
        """One line: the most telling field with both values (the token if it differs, then a logprob, the noise,
        the finish; a digest last, as its values say little), the other fields by name, then the cause."""
        shown = sorted(
            self.differences, key=lambda d: HEADLINE.index(d.field) if d.field in HEADLINE else len(HEADLINE)
        )
        head = (
            shown[0].describe(a, b) if shown else f"{seq_name(self.request_id, self.stream)} position {self.position}"
        )
        more = [f for f in self.fields if shown and f != shown[0].field]  # in pipeline order
        return head + (f"; also {', '.join(more)}" if more else "") + f" (cause: {self.cause})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "stream": self.stream,
            "position": self.position,
            "index": self.index,
            "kind": self.kind,
            "cause": self.cause,
            "fields": list(self.fields),
            "a_token": self.a_token,
            "b_token": self.b_token,
            "token_index": self.token_index,
        }


def sequences(rows: Iterable[Mapping[str, Any]]) -> dict[SeqKey, list[dict]]:
    """Each sequence's rows (sample-trace rows as dicts), by position."""
    out: dict[SeqKey, list[dict]] = {}
    for r in rows:
        out.setdefault((r["request_id"], r["stream"]), []).append(dict(r))
    for seq in out.values():
        seq.sort(key=lambda r: r["position"])
    return out


def row_differences(
    key: RowKey, a: Mapping[str, Any] | None, b: Mapping[str, Any] | None, compared: Sequence[str] = COMPARED_FIELDS
) -> list[Difference]:
    """The differences of one row key: each differing field, or one `row` difference when a run lacks it."""
    if a is None or b is None:
        return [Difference(*key, "row", "missing" if a is None else "present", "missing" if b is None else "present")]
    return [Difference(*key, f, a.get(f), b.get(f)) for f in differing_fields(a, b, compared)]


def first_divergence(
    key: SeqKey,
    a: Sequence[Mapping[str, Any]],
    b: Sequence[Mapping[str, Any]],
    compared: Sequence[str] = COMPARED_FIELDS,
) -> Divergence | None:
    """One sequence's rows in run a and run b: the first position at which they differ (None: they agree), with
    the first output token whose id differs."""
    rows_a = {r["position"]: r for r in a}
    rows_b = {r["position"]: r for r in b}
    positions = sorted(set(rows_a) | set(rows_b))
    tokens = [
        (rows_a[p]["token_id"] if p in rows_a else None, rows_b[p]["token_id"] if p in rows_b else None)
        for p in positions
    ]
    token_index = next((i for i, (x, y) in enumerate(tokens) if x != y and x is not None and y is not None), None)
    for index, position in enumerate(positions):
        differences = row_differences((*key, position), rows_a.get(position), rows_b.get(position), compared)
        if differences:
            fields = tuple(d.field for d in differences)
            kind, policy = policy_cause(
                cause_of(fields), rows_a.get(position, a[0] if a else None), rows_b.get(position, b[0] if b else None)
            )
            return Divergence(
                key[0],
                key[1],
                position,
                index,
                kind,
                fields,
                *tokens[index],
                token_index=token_index,
                differences=tuple(differences),
                policy=tuple(policy),
            )
    return None


def first_divergences(
    a: Mapping[SeqKey, Sequence[Mapping]],
    b: Mapping[SeqKey, Sequence[Mapping]],
    compared: Sequence[str] = COMPARED_FIELDS,
    prompts: tuple[Mapping[str, Sequence[int]], Mapping[str, Sequence[int]]] | None = None,
) -> list[Divergence]:
    """For each sequence of either run (rows by `sequences`), its first divergence, in sequence order. With
    `prompts` (each run's prompt token ids by request id), a request whose prompts differ is named so first: its
    rows, compared by position, continue other contexts (a cause read off them would be wrong)."""
    out = []
    for key in sorted(set(a) | set(b)):
        d = first_divergence(key, a.get(key, ()), b.get(key, ()), compared)
        if d is not None:
            if prompts is not None and key[0] in prompts[0] and key[0] in prompts[1]:
                if list(prompts[0][key[0]]) != list(prompts[1][key[0]]):
                    d = replace(d, kind="prompt", policy=())
            out.append(d)
    return out


def first_difference(a: Sequence, b: Sequence) -> int | None:
    """The first index at which two token streams differ; a stream that is a strict prefix of the other differs
    at its end; None when they are equal."""
    n = min(len(a), len(b))
    diff = next((i for i in range(n) if a[i] != b[i]), None)
    return diff if diff is not None or len(a) == len(b) else n


@dataclass(frozen=True)
class TokenAgreement:
    """Two runs' token ids row by row (mode=compare's divergence column). A row one run lacks is a divergence too:
    a run that stopped earlier, or lost a whole sequence, is not identical to one that did not."""

    common: int
    differing: int
    first: RowKey | None  # the differing shared row at the lowest position (then sequence)
    only_a: int = 0  # rows run a has and run b lacks
    only_b: int = 0
    # the sequences with rows in one run only: (request_id, stream, first such position, whole sequence missing)
    extra_a: tuple[tuple[str, int, int, bool], ...] = ()
    extra_b: tuple[tuple[str, int, int, bool], ...] = ()

    @property
    def identical(self) -> bool:
        return not (self.differing or self.only_a or self.only_b)

    def describe(self, a: str = "a", b: str = "b") -> str:
        if self.identical:
            return f"identical ({self.common} rows)" if self.common else "no rows"
        if self.first is not None:
            head = f"{self.differing}/{self.common} rows differ; first {seq_name(*self.first[:2])} position {self.first[2]}"
        else:
            head = f"the {self.common} shared rows agree" if self.common else "no shared rows"
        extras = [
            f"{n} row{'s' * (n != 1)} only in {run} ({_name_extras(extra, other)})"
            for n, extra, run, other in ((self.only_a, self.extra_a, a, b), (self.only_b, self.extra_b, b, a))
            if n
        ]
        return "; ".join([head, *extras])

    def to_dict(self, a: str = "a", b: str = "b") -> dict[str, Any]:
        """The counts and names as columns (`a`, `b`: how the runs are named in the column names)."""
        return {
            "rows_shared": self.common,
            "rows_differing": self.differing,
            "first_differing": None if self.first is None else f"{seq_name(*self.first[:2])} position {self.first[2]}",
            f"rows_only_{a}": self.only_a,
            f"rows_only_{b}": self.only_b,
            f"sequences_only_{a}": [seq_name(r, s) for r, s, _, whole in self.extra_a if whole],
            f"sequences_only_{b}": [seq_name(r, s) for r, s, _, whole in self.extra_b if whole],
        }


def _name_extras(extra: Sequence[tuple[str, int, int, bool]], other: str, most: int = 4) -> str:
    """The sequences with rows in one run only, as text: one the other run lacks whole by name, a longer one from
    where the other stops; the first `most`, then a count (a sweep may cut every sequence)."""
    names = [
        f"{seq_name(r, s)} {f'missing from {other}' if whole else f'from position {p}'}" for r, s, p, whole in extra
    ]
    return ", ".join(names[:most]) + (f", and {len(names) - most} more" if len(names) > most else "")


def _extras(rows: Iterable[RowKey], other: Mapping[RowKey, int]) -> tuple[tuple[str, int, int, bool], ...]:
    """Per sequence, the first of `rows` and whether the other run has no row of that sequence at all."""
    first: dict[SeqKey, int] = {}
    for request_id, stream, position in rows:
        first[(request_id, stream)] = min(position, first.get((request_id, stream), position))
    present = {k[:2] for k in other}
    return tuple((r, s, p, (r, s) not in present) for (r, s), p in sorted(first.items()))


def token_agreement(a: Mapping[RowKey, int], b: Mapping[RowKey, int]) -> TokenAgreement:
    common = sorted(set(a) & set(b), key=lambda k: (k[2], k[0], k[1]))
    diff = [k for k in common if a[k] != b[k]]
    only_a, only_b = set(a) - set(b), set(b) - set(a)
    return TokenAgreement(
        len(common),
        len(diff),
        diff[0] if diff else None,
        len(only_a),
        len(only_b),
        _extras(only_a, b),
        _extras(only_b, a),
    )
