"""Incremental detokenization with stop strings matched across token boundaries.

A stop string may be split over several tokens, so matching runs on the decoded text.
Streamed text never shows any part of a stop string: the longest suffix of the text
that could still grow into a stop string is held back, and so is a trailing incomplete
UTF-8 character (decoded as U+FFFD). The state (how much text was emitted, how far it
was scanned) lives here so that a resumed request continues exactly where it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

REPLACEMENT = "\ufffd"


@dataclass
class StopState:
    emitted: int = 0  # characters of the output text already streamed
    scanned: int = 0  # characters already searched for stop strings (all stop strings start at >= this - max_len + 1)


@dataclass(frozen=True)
class TextUpdate:
    delta: str  # new text that is safe to show
    stop_string: str | None  # the stop string that completed, if any
    text: str  # the output text so far (truncated at the stop string when one matched)


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def update_text(decode: Callable[[Sequence[int]], str], output_ids: Sequence[int], stops: Sequence[str],
                state: StopState, *, check_stops: bool, include_stop: bool, final: bool) -> TextUpdate:
    """Decode the output so far, look for stop strings in the new text, and say what may be streamed."""
    text = decode(output_ids)
    if check_stops and stops:
        start = max(0, state.scanned - max(len(s) for s in stops) + 1)
        hits = [(pos, s) for s in stops if (pos := text.find(s, start)) >= 0]
        if hits:
            pos, s = min(hits)
            text = text[: pos + len(s)] if include_stop else text[:pos]
            delta = text[state.emitted:]
            state.emitted = state.scanned = len(text)
            return TextUpdate(delta=delta, stop_string=s, text=text)
    stable = len(text)
    if not final:
        while stable and text[stable - 1] == REPLACEMENT:  # an incomplete multi-byte character
            stable -= 1
        if check_stops and stops:
            stable -= held_back(text[:stable], stops)
    state.scanned = len(text.rstrip(REPLACEMENT)) if not final else len(text)
    stable = max(stable, state.emitted)
    delta = text[state.emitted:stable]
    state.emitted = stable
    return TextUpdate(delta=delta, stop_string=None, text=text)
