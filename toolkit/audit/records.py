"""The one shape every transcript format is read into (Transcript, its TokenMap, a Problem at a position, a
LineError for a line that cannot be audited), and the checks each line's fields pass."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from toolkit.errors import ConfigError
from toolkit.sampling.params import SamplingParams

FORMATS = ("openai", "token_ids", "hf")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # vLLM's names: before / after the processors
# the request fields that decide which tokens a policy can produce (OpenAI's and vLLM's names = ours)
POLICY_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",  # OpenAI's {token id: bias}: a greedy token under a bias is the biased argmax
    "processors",
)


class TranscriptError(Exception):
    """A line (or the whole file) cannot be audited; the message names what is wrong."""


@dataclass
class Problem:
    """Something wrong at one output position of a usable request (the rest is still audited)."""

    position: int
    kind: str  # missing_logprob | unmapped_token | unconfirmed_prompt | not_finite
    why: str


@dataclass
class Transcript:
    request_id: str
    stream: int
    line: int
    origin_engine: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    claimed: list[float | None]  # per output token: the engine's logprob of it (None: not given)
    top: list[list[tuple[int, float]]]  # per output token: the engine's top alternatives (may be empty)
    logprobs_mode: str = "raw_logprobs"
    sampling: dict[str, Any] | None = None  # the policy fields the source states (None: unknown)
    prompt_text: str | None = None
    output_text: str | None = None
    finish_reason: str | None = None
    prompt_source: str = "given"  # given (token ids) | encoded (a text prompt, our tokenizer) | rebuilt (chat template)
    source: str = ""  # the line as read (JSON), kept in requests.parquet
    problems: list[Problem] = field(default_factory=list)
    # policy fields the source left out, with the values the audit took for them (toolkit.audit.checks)
    sampling_assumed: dict[str, Any] = field(default_factory=dict)
    # a grammar the request set (constraint_of): its mask is not rebuilt here, so its greedy choices and support
    # are not checked (the raw logprobs are)
    constrained: str | None = None


@dataclass
class LineError:
    line: int
    request_id: str | None
    why: str
    more: int = 0  # this many later lines rejected too, their reasons not kept (past transcripts.MAX_LINE_ERRORS)


def lines_rejected(errors: Iterable[LineError]) -> int:
    """The lines a reading rejected, those counted past the named ones included."""
    return sum(1 + e.more for e in errors)


class TokenMap:
    """Token strings back to ids through the tokenizer's byte vocabulary (xgrammar's decoded vocab)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.bytes_of: list[bytes] = tokenizer.token_bytes(vocab_size)
        self.special_ids: frozenset[int] = getattr(tokenizer, "special_ids", frozenset())
        self.max_bytes = max(map(len, self.bytes_of), default=0)
        self._ids: dict[bytes, list[int]] = {}
        for i, b in enumerate(self.bytes_of):
            self._ids.setdefault(b, []).append(i)

    def ids_of(self, data: bytes) -> list[int]:
        """The tokens whose bytes are exactly `data`."""
        return self._ids.get(data, [])

    def to_id(self, token: Any, token_bytes: Sequence[int] | None = None) -> tuple[int | None, str]:
        """(id, "") or (None, why)."""
        if isinstance(token, int) and not isinstance(token, bool):
            return (
                (token, "")
                if 0 <= token < self.vocab_size
                else (None, f"token id {token} is outside the model's vocabulary of {self.vocab_size}")
            )
        if not isinstance(token, str):
            return None, f"token {token!r} is neither a string nor an id"
        if token.startswith("token_id:") and token[9:].isdigit():  # vLLM's return_tokens_as_token_ids
            return self.to_id(int(token[9:]))
        if token_bytes is not None:
            raw = byte_values(token_bytes)
            if raw is None:
                return None, f"token {token!r}: bytes {str(token_bytes)[:80]} are not a list of byte values"
        elif "\ufffd" in token or not token:
            # servers print U+FFFD (or nothing) for a token that is part of a multi-byte character: which
            # token it was cannot be known from the string
            return None, (
                f"token string {token!r} stands for a partial UTF-8 sequence: ask the server for `bytes` or token ids"
            )
        else:
            raw = token.encode("utf-8")
        ids = self._ids.get(raw)
        if not ids:
            return None, f"token string {token!r} is not the text of any one token of this model"
        if len(ids) > 1:
            return None, f"token string {token!r} is the text of several tokens {ids[:4]}: ambiguous"
        return ids[0], ""


def request_id_of(obj: dict) -> str | None:
    for holder in (obj, obj.get("response") if isinstance(obj.get("response"), dict) else {}):
        for key in ("request_id", "id", "rid"):
            if isinstance(holder.get(key), (str, int)):
                return str(holder[key])
    return None


def byte_values(token_bytes: Any) -> bytes | None:
    """A token's `bytes` (a list of byte values) as bytes, or None when it is not one. Never bytes(n) of an integer
    n: n zero bytes, a gigabyte for 10**9."""
    if not isinstance(token_bytes, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256 for b in token_bytes
    ):
        return None
    return bytes(token_bytes)


def check_ids(record: Transcript, vocab_size: int) -> None:
    tops = [t for alts in record.top for t, _ in alts]
    for what, ids in (
        ("prompt_token_ids", record.prompt_token_ids),
        ("output token", record.output_token_ids),
        ("top_logprobs token", tops),
    ):
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool):  # JSON's true is no token id (Python's True == 1)
                raise TranscriptError(f"{what} {str(t)[:40]} is not a token id")
            if not 0 <= t < vocab_size:
                raise TranscriptError(
                    f"{what} {t!r} is outside the model's vocabulary of "
                    f"{vocab_size}: the transcript comes from another tokenizer"
                )
    check_logit_bias(record, vocab_size)
    check_policy(record)


def check_logit_bias(record: Transcript, vocab_size: int) -> None:
    """A stated logit_bias must read as our SamplingParams read it (keys token ids, strings of digits in JSON)
    and name tokens of this model: the reference applies it, and an id past the vocabulary has no logit."""
    bias = (record.sampling or {}).get("logit_bias")
    if bias is None:
        return
    try:
        ids = SamplingParams.from_mapping({"logit_bias": bias}).logit_bias or {}
    except (ConfigError, TypeError, ValueError) as exc:
        raise TranscriptError(str(exc)) from None
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise TranscriptError(
            f"logit_bias key {bad} is outside the model's vocabulary of {vocab_size}: "
            f"the transcript comes from another tokenizer"
        )


def check_policy(record: Transcript) -> None:
    """A stated policy must be one our SamplingParams takes (`"top_k": "50"` is none): the greedy and support checks
    read it, and a policy that cannot be read would leave them off, the line passing unchecked."""
    if record.sampling is None:
        return
    try:
        SamplingParams.from_mapping(dict(record.sampling))
    except (ConfigError, TypeError, ValueError) as exc:
        raise TranscriptError(f"the stated sampling: {exc}") from None


def check_length(record: Transcript, max_positions: int | None) -> None:
    """The reference recomputes prompt + output in one forward: no longer than the model's positions."""
    prompt, output = len(record.prompt_token_ids), len(record.output_token_ids)
    if max_positions is not None and prompt + output > max_positions:
        raise TranscriptError(
            f"prompt ({prompt}) + output ({output}) = {prompt + output} tokens exceed the model's "
            f"{max_positions} positions"
        )


def as_stream(value: Any) -> int:
    """A line's `stream`, the sample's index among its request's (absent or null: 0); the trace stores it as int32."""
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
        raise TranscriptError(f"stream must be an integer in [0, 2^31) (the sample's index), got {str(value)[:40]}")
    return value


def as_number(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value == float("inf"):
        raise _not_a_logprob(what, value)
    try:
        return float(value)
    except OverflowError:  # an integer past a double's range
        raise _not_a_logprob(what, value) from None


def _not_a_logprob(what: str, value: Any) -> TranscriptError:
    shown = repr(value)[:80] if isinstance(value, str) else str(value)[:80]  # "-inf" the string, not -inf
    return TranscriptError(f"{what} is {shown}, not a log-probability (a JSON number, or -inf)")


def as_text(value: Any, what: str) -> str | None:
    """A text field the converted trace stores as a string (finish_reason, origin_engine): a string, or null."""
    if value is None or isinstance(value, str):
        return value
    raise TranscriptError(f"{what} must be a string or null, got {str(value)[:40]}")


def as_int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise TranscriptError(f"{what} must be a list of token ids")
    return list(value)


# request fields (OpenAI's, vLLM's) that constrain the tokens with a grammar: a mask the reference does not rebuild
# (another engine's grammar, its whitespace rules, may allow other tokens than xgrammar's)
CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def constraint_of(obj: dict | None) -> str | None:
    """The first grammar field `obj` sets ("response_format json_schema", "guided_regex", ...), or None."""
    if not isinstance(obj, dict):
        return None
    for key in CONSTRAINT_FIELDS:
        value = obj.get(key)
        if key == "response_format":
            kind = value.get("type") if isinstance(value, dict) else None
            if kind in ("json_object", "json_schema"):  # OpenAI's grammars; "text" and anything else: none
                return f"response_format {kind}"
        elif isinstance(value, dict) and any(v not in (None, False, "", [], {}) for v in value.values()):
            return key  # vLLM's structured_outputs with a field set
        elif not isinstance(value, (dict, bool)) and value not in (None, "", []):
            return key  # a schema text, a regex, a list of choices, a grammar
    return None


def policy_of(obj: dict | None) -> dict[str, Any] | None:
    if not isinstance(obj, dict):
        return None
    found = {k: obj[k] for k in POLICY_FIELDS if obj.get(k) is not None}
    return found or None
