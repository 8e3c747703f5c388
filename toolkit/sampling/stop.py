"""Incremental detokenization with stop strings matched across token boundaries.

Each new token is decoded with a few tokens of context, not the whole output (the prefix / read
offsets of vLLM's and HF's `DecodeStream`): `decode(ids[prefix:read])` is text already confirmed
and `decode(ids[prefix:])` the same text plus what the new tokens add. A token's text is confirmed
once it does not end in an incomplete UTF-8 character (decoded as U+FFFD); until then it is
re-decoded with the next tokens. For byte-level tokenizers this gives exactly the text of decoding
the whole output (tests/test_stop_and_stream.py checks it against a full re-decode). Work per
token is bounded by the tokens since the last confirmed character and the longest stop string,
not by the output's length: the text is kept as a list of pieces and joined only when asked for.

A stop string may be split over several tokens, so matching runs on the decoded text.
Streamed text never shows any part of a stop string: the longest suffix of the text that could
still grow into a stop string is held back, and so is a trailing incomplete UTF-8 character.
The state lives here so that a resumed request continues exactly where it was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"


@dataclass
class StopState:
    emitted: int = 0  # characters of the output text already streamed
    scanned: int = 0  # characters already searched for stop strings (all stop strings start at >= this - max_len + 1)
    prefix_offset: int = 0  # output tokens: decode(ids[prefix_offset:read_offset]) is the next piece's context
    read_offset: int = 0  # output tokens whose text is confirmed (in `pieces`)
    pieces: list[str] = field(default_factory=list)  # the confirmed text, decode(ids[:read_offset]), in pieces
    confirmed: int = 0  # its length in characters
    pending: str = ""  # the text of ids[read_offset:] so far (it may end in an incomplete character)
    prefixes: PrefixMatcher | None = None  # how much of each stop string the text ends with (held_back)
    fed: int = 0  # characters of the text the prefix matcher has read

    @property
    def length(self) -> int:
        return self.confirmed + len(self.pending)

    @property
    def text(self) -> str:
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        return (self.pieces[0] if self.pieces else "") + self.pending

    def tail(self, start: int) -> str:
        """text[start:], reading only the pieces it needs."""
        if start >= self.confirmed:  # within the pending text (streamed up to a trailing incomplete character)
            return self.pending[start - self.confirmed :]
        need, parts = self.confirmed - start, [self.pending]
        for piece in reversed(self.pieces):
            if need <= 0:
                break
            parts.append(piece if len(piece) <= need else piece[len(piece) - need :])
            need -= len(piece)
        return "".join(reversed(parts))

    def advance(self, decode: Callable[[Sequence[int]], str], ids: Sequence[int], first: int = 0) -> None:
        """Decode the output tokens (ids[first:]) after the confirmed ones, with the context tokens
        before them."""
        prefix, read = first + self.prefix_offset, first + self.read_offset
        context = decode(ids[prefix:read]) if read > prefix else ""
        text = decode(ids[prefix:])
        new = text[len(context) :] if len(text) > len(context) else ""
        if new and not new.endswith(REPLACEMENT):
            self.pieces.append(new)
            self.confirmed += len(new)
            self.prefix_offset, self.read_offset, self.pending = self.read_offset, len(ids) - first, ""
        else:
            self.pending = new

    def held_back(self, stops: Sequence[str], upto: int) -> int:
        """held_back(text[:upto], stops), reading only the text after the last call: each stop string's
        matched-prefix length is carried from one call to the next (Knuth-Morris-Pratt), so a token costs the
        characters it adds times the stop strings, never the longest stop string's length. `upto` (the text
        that is final: no trailing incomplete character) never decreases between calls."""
        if self.prefixes is None or upto < self.fed:  # (the final text never shrinks; if it did, read it again)
            self.prefixes, self.fed = PrefixMatcher(stops), 0
        if upto > self.fed:
            self.prefixes.feed(self.tail(self.fed)[: upto - self.fed])
            self.fed = upto
        return self.prefixes.held()

    def truncate(self, length: int) -> None:
        """Keep text[:length] (a stop string matched); the state then holds final text only."""
        self.pieces, self.pending = [self.tail(0)[:length]], ""
        self.confirmed = length


@dataclass(frozen=True)
class TextUpdate:
    delta: str  # new text that is safe to show
    stop_string: str | None  # the stop string that completed, if any


class PrefixMatcher:
    """For each stop string, the longest prefix of it that the text read so far ends with: Knuth-Morris-Pratt's
    automaton, one per stop string (amortised O(1) a character each). The stop strings' matches themselves are
    found with str.find over the tail that can still hold one (update_text); what this adds is the state a
    library matcher does not expose (pyahocorasick's iterator keeps its automaton state to itself), so that the
    held-back length no longer costs the longest stop string's length squared each token."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.fail = [_prefix_function(s) for s in self.stops]
        self.matched = [0] * len(self.stops)

    def feed(self, text: str) -> None:
        for j, s in enumerate(self.stops):
            fail, k, n = self.fail[j], self.matched[j], len(s)
            for c in text:
                if k == n:
                    k = fail[k - 1]
                while k and s[k] != c:
                    k = fail[k - 1]
                if s[k] == c:
                    k += 1
            self.matched[j] = k

    def held(self) -> int:
        """held_back's answer: the longest suffix of the text read that is a proper prefix of a stop string."""
        return max(
            (k if k < len(s) else self.fail[j][k - 1] for j, (s, k) in enumerate(zip(self.stops, self.matched))),
            default=0,
        )


def _prefix_function(s: str) -> list[int]:
    """fail[i]: the length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def update_text(
    decode: Callable[[Sequence[int]], str],
    ids: Sequence[int],
    stops: Sequence[str],
    state: StopState,
    *,
    check_stops: bool,
    include_stop: bool,
    final: bool,
    first: int = 0,
) -> TextUpdate:
    """Decode the new output tokens (those of ids[first:]: a sequence's tokens after its prompt), look
    for stop strings in the new text, and say what may be streamed."""
    state.advance(decode, ids, first)
    longest = max((len(s) for s in stops), default=1)
    # the window of text this update reads: from before the stream point and the scan point, with
    # room for a stop string or a held-back prefix ending there
    origin = max(0, min(state.emitted, state.scanned) - longest)
    window = state.tail(origin)
    length = origin + len(window)
    # before the output's end a trailing U+FFFD is a character still incomplete (its other bytes in the next tokens):
    # neither matched, nor streamed, nor scanned past
    complete = len(window) if final else len(window.rstrip(REPLACEMENT))
    if check_stops and stops:
        start = max(0, state.scanned - longest + 1) - origin
        hits = [(pos, s) for s in stops if (pos := window.find(s, start, complete)) >= 0]
        if hits:
            pos, s = min(hits)
            cut = origin + pos + (len(s) if include_stop else 0)
            delta = window[state.emitted - origin : cut - origin]
            state.truncate(cut)
            state.emitted = state.scanned = cut
            return TextUpdate(delta=delta, stop_string=s)
    stable = origin + complete
    if not final and check_stops and stops and complete:
        stable -= state.held_back(stops, stable)
    if final:
        state.scanned = length
    else:
        state.scanned = origin + complete if complete or origin == 0 else len(state.text.rstrip(REPLACEMENT))
    stable = max(stable, state.emitted)
    delta = window[state.emitted - origin : stable - origin]
    state.emitted = stable
    return TextUpdate(delta=delta, stop_string=None)
