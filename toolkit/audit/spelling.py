"""A choice's token strings mapped to ids and confirmed by the response's own text.

A server's per-token strings are not always the tokens' bytes: some strip a leading space or clean up spacing,
and every server prints a piece of a multi-byte character as U+FFFD (or nothing). Each string is mapped to the one
token whose bytes spell it (`TokenMap.to_id`), and the mapped tokens must then spell the response text, byte for
byte: a string that maps to a valid token which is not what the text has there is reported, never kept. A
U+FFFD piece is recovered from the text where exactly one choice of tokens spells it.

    spell(steps, text, tokens, stop_trimmed) -> Spelled(ids, problems)

The search is forward over the tokens, keeping every byte offset into the text that some choice of tokens reaches
(a few at most: only pieces of a character have several candidates), with how many choices reach it (capped at
two) and one way back. Special tokens (the end of a turn) may be absent from the text; past the text's end
tokens are accepted only where the text was cut (`stop_trimmed`: a stop string removed), mapped by their strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from toolkit.audit.records import byte_values

END = -1  # the state past the text's end (a stop string trimmed from the text)
REPLACEMENT = "\ufffd".encode()  # U+FFFD in the text
CUT = (
    "the text has U+FFFD here, bytes the server could not decode (a character the response's end cut, or no "
    "UTF-8): which tokens they were is not known from the text; ask the server for `bytes` or token ids"
)


@dataclass
class Spelled:
    ids: list[int]  # the tokens confirmed, from the first; all of them when there are no problems
    problems: list[tuple[int, str]] = field(default_factory=list)  # (token index, why); the first ends `ids`
    recovered: int = 0  # U+FFFD pieces whose token the text decided


def _piece(token: Any, token_bytes: Any) -> bool:
    """A string that stands for part of a multi-byte character (its token unknown from the string alone)."""
    return isinstance(token, str) and token_bytes is None and ("\ufffd" in token or not token)


def spell(steps: Sequence[tuple[Any, Any]], text: str, tokens, stop_trimmed: bool) -> Spelled:
    """`steps`: per output token its string (or id, or vLLM's `token_id:<id>`) and its `bytes` (None if not
    given); `text`: the choice's text as the server returned it; `tokens`: a TokenMap."""
    known = _decoded_as(steps, text, tokens)
    if known is not None:
        return Spelled(known)
    data = text.encode("utf-8")
    special = tokens.special_ids
    # per token index: {offset: (previous offset, token id, ways to reach it (max 2))}
    layers: list[dict[int, tuple[int | None, int | None, int]]] = [{0: (None, None, 1)}]
    for j, (token, token_bytes) in enumerate(steps):
        exact, why = tokens.to_id(token, token_bytes)
        reached: dict[int, tuple[int | None, int | None, int]] = {}
        for off, (_, _, ways) in layers[-1].items():
            for i in (
                [exact]
                if exact is not None
                else _pieces_here(token, data, off, tokens)
                if _piece(token, token_bytes) and off != END
                else []
            ):
                b = tokens.bytes_of[i]
                if off == END:
                    nxt = END
                elif data.startswith(b, off):
                    nxt = off + len(b)
                elif i in special:
                    nxt = off  # not rendered in the text
                elif stop_trimmed and b.startswith(data[off:]):
                    nxt = END  # the text ends before or inside this token: a stop string was cut from it
                else:
                    continue
                before = reached.get(nxt)  # another choice of tokens reaching the same offset: count it
                reached[nxt] = (off, i, ways) if before is None else (before[0], before[1], min(2, before[2] + ways))
        if not reached:
            off = _furthest(layers[-1], data)
            first = (j, _why_not(token, token_bytes, exact, why, data, off, tokens))
            return _confirmed(_path(layers), steps, [first, *_later(steps, j, data, off, tokens)])
        layers.append(reached)
    final = {off: v for off, v in layers[-1].items() if off in (len(data), END)}
    if not final:
        got = max(layers[-1])
        why = (
            CUT
            if data.startswith(REPLACEMENT, got)
            else f"the tokens spell the first {got} bytes of the text, which goes on with {data[got : got + 24]!r}: "
            f"tokens are missing from the logprobs"
        )
        return _confirmed(_path(layers), steps, [(len(steps), why)])
    off = len(data) if len(data) in final else END
    ids = _path(layers, off)
    ways = sum(v[2] for v in final.values())  # distinct states are distinct choices of tokens
    if ways > 1:
        first = next(j for j, (t, b) in enumerate(steps) if _piece(t, b))
        return Spelled(
            ids[:first],
            [
                (
                    first,
                    f"token string {steps[first][0]!r} (part of a multi-byte character): "
                    f"more than one choice of tokens spells the text here; ask the server "
                    f"for `bytes` or token ids",
                )
            ],
        )
    return Spelled(ids, [], sum(_piece(t, b) for t, b in steps))


def _decoded_as(steps: Sequence[tuple[Any, Any]], text: str, tokens) -> list[int] | None:
    """The ids when every step names its token exactly and their bytes decode to `text` (special tokens rendered
    or left out): what a server's text is when the tokens are no UTF-8 (a character's first byte, then a space),
    U+FFFD where the bytes are not a character, which no byte-for-byte spelling of the text finds. Else None."""
    ids = [tokens.to_id(token, token_bytes)[0] for token, token_bytes in steps]
    if None in ids:
        return None
    for shown in (ids, [i for i in ids if i not in tokens.special_ids]):
        if b"".join(tokens.bytes_of[i] for i in shown).decode("utf-8", errors="replace") == text:
            return ids
    return None


def _confirmed(ids: list[int], steps: Sequence[tuple[Any, Any]], problems: list[tuple[int, str]]) -> Spelled:
    """The tokens of a spelling that stops short (`ids`, then `problems`), less the pieces of a character it ends
    with: the text chose them only provisionally, and no token after them followed in it (a string that is
    empty because the server stripped a space is such a piece too), so they are reported, never kept."""
    k = len(ids)
    while k and _piece(*steps[k - 1]):
        k -= 1
    if k == len(ids):
        return Spelled(ids, problems)
    why = (
        f"token string {steps[k][0]!r} (part of a multi-byte character, or whitespace stripped): the tokens after "
        f"it do not follow in the text, so which token it was is not known; ask the server for `bytes` or token ids"
    )
    return Spelled(ids[:k], [(k, why), *problems])


def _pieces_here(token: str, data: bytes, off: int, tokens) -> list[int]:
    """The tokens whose bytes the text has at `off` and that print as `token` (an empty string: any token that
    is not whole UTF-8 on its own)."""
    if data.startswith(REPLACEMENT, off):  # the text's own U+FFFD: bytes the server could not decode (a response
        return []  # cut inside a character), so no token is spelled by it: the piece stays unknown, never guessed
    found = []
    for length in range(1, min(tokens.max_bytes, len(data) - off) + 1):
        for i in tokens.ids_of(data[off : off + length]):
            b = tokens.bytes_of[i]
            if b.decode("utf-8", errors="replace") == token if token else not _whole(b):
                found.append(i)
    return found


def _whole(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _path(layers: list[dict], off: int | None = None) -> list[int]:
    """One way back from `off` in the last layer (default: its furthest offset) to the start."""
    if off is None:
        off = max(layers[-1], key=lambda o: (o == END, o))
    ids = []
    for layer in reversed(layers[1:]):
        prev, i, _ = layer[off]
        ids.append(i)
        off = prev
    return ids[::-1]


def _furthest(states: dict, data: bytes) -> int:
    return max((o for o in states if o != END), default=len(data))


def _later(steps, j: int, data: bytes, off: int, tokens) -> list[tuple[int, str]]:
    """After the first token not confirmed (index j, at text offset `off`), the later tokens whose strings do not
    spell the text either: each reported with its reason. A string that matches once the whitespace before it
    is skipped (a space stripped from it) moves on past it; the scan stops where the text cannot be followed."""
    found = []
    for k in range(j, len(steps)):
        token, token_bytes = steps[k]
        exact, why = tokens.to_id(token, token_bytes)
        if k > j and exact is not None:
            b = tokens.bytes_of[exact]
            if data.startswith(b, off):
                off += len(b)
                continue
            if exact in tokens.special_ids:
                continue
        if token == "" and token_bytes is None and data[off : off + 1].isspace():
            if k > j:  # a whitespace token stripped to nothing (taken as one whitespace byte: " ", the usual one)
                found.append(
                    (
                        k,
                        "token string '' where the text has whitespace: the server's token strings differ "
                        "from its text (whitespace stripped?)",
                    )
                )
            off += 1
            continue
        if _piece(token, token_bytes):
            if k > j:
                found.append(
                    (
                        k,
                        f"token string {token!r} stands for part of a multi-byte character, after a token "
                        f"not confirmed: not recovered, and the tokens after it not checked",
                    )
                )
            break
        core = tokens.bytes_of[exact] if exact is not None else _spelled(token, token_bytes)
        skip = _skip(data, off, core.strip()) if core is not None else 0
        if not skip:
            break
        if k > j:
            found.append((k, _why_not(token, token_bytes, exact, why, data, off, tokens)))
        off += skip
    return found


def _spelled(token: Any, token_bytes: Any) -> bytes | None:
    """The bytes a token's string (or its `bytes`) says it has; None when it gives none."""
    if token_bytes is not None:
        return byte_values(token_bytes)
    return token.encode("utf-8") if isinstance(token, str) else None


def _skip(data: bytes, off: int, core: bytes) -> int:
    """Bytes from `off` past whitespace and then `core` (0: the text does not go on that way)."""
    rest = data[off:]
    stripped = rest.lstrip()
    return len(rest) - len(stripped) + len(core) if core and stripped.startswith(core) else 0


def _why_not(token, token_bytes, exact, why, data: bytes, off: int, tokens) -> str:
    """Why the token at text offset `off` is not confirmed."""
    if exact is None and not _piece(token, token_bytes):
        return why
    if exact is None:
        return (
            f"token string {token!r} stands for part of a multi-byte character; {CUT}"
            if data.startswith(REPLACEMENT, off)
            else f"token string {token!r} stands for part of a multi-byte character and no token the text has here "
            f"prints as it"
        )
    b = tokens.bytes_of[exact]
    return (
        f"token string {token!r} maps to token {exact} ({b!r}) but the text has {data[off : off + len(b) + 4]!r} "
        f"there: the server's token strings differ from its text (a leading space stripped, spacing cleaned "
        f"up?); ask for `bytes` or token ids"
    )
