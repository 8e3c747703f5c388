"""Transcripts other engines wrote, read into one shape the audit checks.

Three formats (`audit.format`), each JSONL, one request per line:

- `openai`: `{"request": <body sent>, "response": <body received>}` pairs from any OpenAI-compatible
  server (vLLM, SGLang, llama.cpp's server, TGI, ours), completions or chat completions with
  `logprobs`; a streamed response is the list of its `data:` chunks, in order. Tokens given as strings
  are mapped back to ids through the tokenizer's byte vocabulary (a chat entry's `bytes` when present,
  vLLM's `token_id:<id>` form, else the string's UTF-8 bytes), and the mapped tokens must spell the
  choice's text byte for byte (toolkit.audit.spelling): a string that names another token than the text
  has there (a server that strips a leading space) is `unmapped_token`, reported with its reason, and a
  U+FFFD piece of a character is recovered from the text when one choice of tokens spells it.
  `prompt_token_ids` / `token_ids` in the response (vLLM's `return_token_ids`) are used when present; a
  prompt rebuilt here (`prompt` in audit.json: `rebuilt` from messages through the chat template,
  `encoded` from text) must have as many tokens as usage.prompt_tokens counts, else the line is refused;
  without that count its request is `unconfirmed_prompt` and not audited. Chat fields this rendering does
  not apply (`tools`, a message's `name` or `tool_calls`, `chat_template_kwargs`, ...) refuse the line.
- `token_ids`: `{"prompt_token_ids": [...], "output_token_ids": [...], "logprobs": [...]}` with
  optional `request_id`, `top_logprobs`, `sampling`, `origin_engine`, `logprobs_mode`. A `logprobs`
  entry is the chosen token's logprob, or vLLM's `RequestOutput.logprobs` dict `{id: logprob |
  {"logprob": x, ...}}` holding the chosen token and its alternatives. SGLang's `meta_info`
  (`output_token_logprobs` as `[logprob, token_id, text]`, `output_top_logprobs`) is read as well.
- `hf`: what `save_hf_generate` writes from HF `generate(..., return_dict_in_generate=True,
  output_logits=True, output_scores=True)`: the `token_ids` shape with raw logprobs from `logits`
  and processed ones from `scores`.

Positions are as in our trace: the index in prompt + output, so the first output token is at
position len(prompt).
"""

from __future__ import annotations

import codecs
import itertools
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from toolkit.audit.openai_format import openai_line
from toolkit.audit.records import (
    FORMATS,
    LOGPROBS_MODES,
    LineError,
    TokenMap,
    Transcript,
    TranscriptError,
    as_int_list,
    as_number,
    as_stream,
    as_text,
    check_ids,
    check_length,
    constraint_of,
    policy_of,
    request_id_of,
)
from toolkit.errors import json_past_limits, not_unicode_in, one_line

MAX_LINE_ERRORS = 1000  # rejected lines named one by one; the rest of a reading's are counted


def read_transcripts(
    path: str | Path,
    fmt: str,
    tokenizer,
    vocab_size: int,
    logprobs_mode: str | None = None,
    *,
    max_positions: int | None = None,
) -> tuple[list[Transcript], list[LineError]]:
    """Every usable request of the file, and a LineError for each line that is not. `max_positions`: the model's
    (a longer prompt + output cannot be recomputed; None: not checked)."""
    if fmt not in FORMATS:
        raise TranscriptError(f"audit.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if logprobs_mode is not None and logprobs_mode not in LOGPROBS_MODES:
        raise TranscriptError(f"audit.logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
    path = Path(path)
    tokens = TokenMap(tokenizer, vocab_size)
    records: list[Transcript] = []
    errors = LineErrors()
    try:
        for number, text in enumerate(_lines(path), 1):
            found = (
                text
                if isinstance(text, LineError)
                else _read_line(number, text, fmt, tokens, vocab_size, logprobs_mode, max_positions)
            )
            if isinstance(found, LineError):
                errors.append(found)
            else:
                records += found
    except (OSError, UnicodeDecodeError) as exc:
        raise TranscriptError(f"cannot read {path}: {exc}{_gzip_hint(path)}") from None
    seen: set[tuple[str, int]] = set()
    for record in records:  # request ids name a request in the converted trace: make repeats unique
        key, k = (record.request_id, record.stream), 1
        while key in seen:
            key, k = (f"{record.request_id}~{k}", record.stream), k + 1
        record.request_id = key[0]
        seen.add(key)
    return records, errors.kept()


MAX_LINE_BYTES = 32 * 2**20  # a longer line is refused unread (auditing one costs about 12 times its size)


def _lines(path: Path) -> Iterator[str | LineError]:
    """The file's lines as read, one at a time (a file of any length in bounded memory): split at `\n` only (a
    `\r` before it dropped), not at a lone `\r` (universal newlines split there: JSON's whitespace) nor at the
    U+2028, U+2029 or U+0085 a JSON string may hold unescaped (str.splitlines split a valid line there); a UTF-8
    byte-order mark dropped. A line past MAX_LINE_BYTES (skipped without being held) or not UTF-8 is a LineError
    of its own: the other lines are still read."""
    with path.open("rb") as f:
        for number in itertools.count(1):
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            if number == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
                if not raw:  # a file of a byte-order mark alone: no line
                    return
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while (rest := f.readline(2**20)) and not rest.endswith(b"\n"):
                    pass
                yield LineError(number, None, f"longer than {MAX_LINE_BYTES:,} bytes: not read")
                continue
            raw = raw[:-1] if raw.endswith(b"\n") else raw
            try:
                yield (raw[:-1] if raw.endswith(b"\r") else raw).decode("utf-8")
            except UnicodeDecodeError as exc:
                hint = _gzip_hint(path) if number == 1 else ""
                if hint:
                    raise TranscriptError(f"cannot read {path}: {exc}{hint}") from None
                yield LineError(number, None, f"not UTF-8: byte {exc.start} is {raw[exc.start : exc.start + 1]!r}")


def _gzip_hint(path: Path) -> str:
    """What to do with a gzip file (its magic bytes), which reads as no UTF-8."""
    try:
        with path.open("rb") as f:
            return " (a gzip file: decompress it first)" if f.read(2) == b"\x1f\x8b" else ""
    except OSError:
        return ""


class LineErrors:
    """A reading's rejected lines: the first MAX_LINE_ERRORS named, the rest counted in one more (LineError.more),
    so that a file of a million bad lines costs neither a million kept reasons nor a million printed ones."""

    def __init__(self):
        self.named: list[LineError] = []
        self.first_unnamed: int | None = None
        self.unnamed = 0

    def append(self, error: LineError) -> None:
        if len(self.named) < MAX_LINE_ERRORS:
            self.named.append(error)
            return
        self.first_unnamed = self.first_unnamed or error.line
        self.unnamed += 1

    def kept(self) -> list[LineError]:
        if not self.unnamed:
            return self.named
        why = f"and {self.unnamed} more lines rejected from here on (the first {MAX_LINE_ERRORS} are named)"
        return [*self.named, LineError(self.first_unnamed, None, why, more=self.unnamed - 1)]


def _read_line(
    number: int,
    text: str,
    fmt: str,
    tokens: TokenMap,
    vocab_size: int,
    logprobs_mode: str | None,
    max_positions: int | None,
) -> list[Transcript] | LineError:
    """One line's requests (none for a blank line), or why it is rejected."""
    if not text.strip():
        return []
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return LineError(number, None, f"not JSON: {exc}")
    except (ValueError, RecursionError) as exc:
        return LineError(number, None, f"not JSON: {json_past_limits(exc)}")
    if not isinstance(obj, dict):
        return LineError(number, None, "not a JSON object")
    problem = not_unicode_in(obj)  # a lone surrogate's escape: no tokenizer reads it
    if problem is not None:
        return LineError(number, request_id_of(obj), problem)
    try:
        if fmt == "openai":
            found = openai_line(obj, number, tokens)
        else:
            found = [_token_ids_line(obj, number, tokens, "hf" if fmt == "hf" else "unknown", logprobs_mode)]
        for record in found:
            check_ids(record, vocab_size)
            as_stream(record.stream)
            check_length(record, max_positions)
    except TranscriptError as exc:
        return LineError(number, request_id_of(obj), str(exc))
    except Exception as exc:  # noqa: BLE001 - a shape no check above foresaw: this line's error, not the run's
        return LineError(number, request_id_of(obj), f"unreadable: {one_line(exc)}")
    for record in found:
        record.source = text
        if logprobs_mode is not None:
            record.logprobs_mode = logprobs_mode
    return found


# ---------------------------------------------------------------------------------------------- token ids


def _token_ids_line(
    obj: dict, line: int, tokens: TokenMap, default_engine: str, mode_override: str | None
) -> Transcript:
    meta = obj.get("meta_info") if isinstance(obj.get("meta_info"), dict) else None
    if meta is not None and "output_token_logprobs" in meta:  # SGLang's return_logprob
        return _sglang_line(obj, meta, line, tokens)
    prompt = as_int_list(obj.get("prompt_token_ids"), "prompt_token_ids")
    output = as_int_list(obj.get("output_token_ids", obj.get("token_ids")), "output_token_ids")
    mode = obj.get("logprobs_mode", "raw_logprobs") if mode_override is None else mode_override
    if mode not in LOGPROBS_MODES:
        raise TranscriptError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {mode!r}")
    # save_hf_generate writes both: the processed ones are the claims in processed_logprobs mode
    logprobs = (
        obj.get("processed_logprobs")
        if mode == "processed_logprobs" and "processed_logprobs" in obj
        else obj.get("logprobs")
    )
    if not isinstance(logprobs, list):
        raise TranscriptError("logprobs must be a list with one entry per output token")
    if len(logprobs) != len(output):
        raise TranscriptError(f"{len(output)} output tokens but {len(logprobs)} logprobs entries")
    tops_given = obj.get("top_logprobs")
    if tops_given is not None and (not isinstance(tops_given, list) or len(tops_given) != len(output)):
        raise TranscriptError("top_logprobs must have one entry per output token")
    claimed, top = [], []
    for i, (token, entry) in enumerate(zip(output, logprobs)):
        if isinstance(entry, dict):  # vLLM: {token_id: Logprob | float}, the chosen token among them
            alts = [(_key_id(k, f"logprobs[{i}]"), _logprob_value(v, f"logprobs[{i}][{k}]")) for k, v in entry.items()]
            value = next((lp for t, lp in alts if t == token), None)
            claimed.append(value)
            top.append([(t, lp) for t, lp in alts if lp is not None])
        else:
            claimed.append(as_number(entry, f"logprobs[{i}]"))
            top.append([])
        if tops_given is not None and tops_given[i] is not None:
            top[-1] = _top_entries(tops_given[i], f"top_logprobs[{i}]")
    if mode == "processed_logprobs" and "processed_logprobs" in obj:
        top = [[] for _ in output]  # the top alternatives are raw ones
    return Transcript(
        request_id=str(request_id_of(obj) or f"line{line}"),
        stream=as_stream(obj.get("stream")),
        line=line,
        origin_engine=as_text(obj.get("origin_engine"), "origin_engine") or default_engine,
        prompt_token_ids=prompt,
        output_token_ids=output,
        claimed=claimed,
        top=top,
        logprobs_mode=mode,
        sampling=policy_of(obj.get("sampling")),
        constrained=constraint_of(obj.get("sampling")),
        prompt_text=obj.get("prompt") if isinstance(obj.get("prompt"), str) else None,
        output_text=obj.get("text") if isinstance(obj.get("text"), str) else None,
        finish_reason=as_text(obj.get("finish_reason"), "finish_reason"),
    )


def _key_id(key: Any, where: str) -> int:
    """A token id: an integer, or a string of one (a JSON object's key)."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and re.fullmatch(r"\s*-?[0-9]+\s*", key):
        return int(key)
    raise TranscriptError(f"{where}: {str(key)[:80]!r} is not a token id")


def _logprob_value(value: Any, where: str) -> float | None:
    if isinstance(value, dict):
        value = value.get("logprob")
    return as_number(value, where)


def _top_entries(entry: Any, where: str) -> list[tuple[int, float]]:
    if isinstance(entry, dict):
        return [(_key_id(k, where), _logprob_value(v, f"{where}[{k}]")) for k, v in entry.items()]
    if isinstance(entry, list):
        out = []
        for i, alt in enumerate(entry):
            if isinstance(alt, dict):
                out.append(
                    (_key_id(alt.get("token_id"), f"{where}[{i}]"), as_number(alt.get("logprob"), f"{where}[{i}]"))
                )
            elif isinstance(alt, (list, tuple)) and len(alt) >= 2:  # SGLang's [logprob, token_id, text]
                out.append((_key_id(alt[1], f"{where}[{i}]"), as_number(alt[0], f"{where}[{i}]")))
            else:
                raise TranscriptError(f"{where}[{i}] is not a {{token_id, logprob}} entry")
        return [(t, lp) for t, lp in out if lp is not None]
    raise TranscriptError(f"{where} must be a list or a {{token_id: logprob}} object")


def _sglang_line(obj: dict, meta: dict, line: int, tokens: TokenMap) -> Transcript:
    steps = meta["output_token_logprobs"]
    if not isinstance(steps, list):
        raise TranscriptError("meta_info.output_token_logprobs must be a list of [logprob, token_id, text]")
    output, claimed = [], []
    for i, s in enumerate(steps):
        if not isinstance(s, (list, tuple)) or len(s) < 2:
            raise TranscriptError(f"meta_info.output_token_logprobs[{i}] is not [logprob, token_id, ...]")
        output.append(_key_id(s[1], f"meta_info.output_token_logprobs[{i}]"))
        claimed.append(as_number(s[0], f"meta_info.output_token_logprobs[{i}][0]"))
    tops = meta.get("output_top_logprobs") or [None] * len(output)
    if not isinstance(tops, list) or len(tops) != len(output):
        raise TranscriptError("meta_info.output_top_logprobs must have one entry per output token")
    top = [_top_entries(t, f"meta_info.output_top_logprobs[{i}]") if t is not None else [] for i, t in enumerate(tops)]
    prompt = as_int_list(obj.get("prompt_token_ids", obj.get("input_ids")), "prompt_token_ids")
    return Transcript(
        request_id=str(meta.get("id", obj.get("request_id", f"line{line}"))),
        stream=0,
        line=line,
        origin_engine=as_text(obj.get("origin_engine"), "origin_engine") or "sglang",
        prompt_token_ids=prompt,
        output_token_ids=output,
        claimed=claimed,
        top=top,
        sampling=policy_of(obj.get("sampling")),
        constrained=constraint_of(obj.get("sampling")),
        output_text=obj.get("text") if isinstance(obj.get("text"), str) else None,
        finish_reason=as_text(meta["finish_reason"].get("type"), "meta_info.finish_reason.type")
        if isinstance(meta.get("finish_reason"), dict)
        else as_text(meta.get("finish_reason"), "meta_info.finish_reason"),
    )


# ---------------------------------------------------------------------------------------------- hf generate


def save_hf_generate(
    path: str | Path,
    out: Any,
    prompt_token_ids: Sequence[Sequence[int]],
    *,
    generation_kwargs: dict[str, Any] | None = None,
    top_logprobs: int = 5,
    pad_token_id: int | None = None,
    eos_token_id: int | Iterable[int] | None = None,
    request_ids: Sequence[str] | None = None,
    append: bool = False,
) -> int:
    """Write HF `generate(..., return_dict_in_generate=True, output_logits=True, output_scores=True)`
    output as `audit.format=hf` JSONL; returns the lines written.

    `prompt_token_ids`: each row's prompt without padding (left-padded batches: the prompt is the
    last tokens of the row's input). Per generated token: `logprobs` = log_softmax(logits) (raw),
    `processed_logprobs` = log_softmax(scores) (after HF's processors and warpers), and the raw top
    `top_logprobs`. A row's output stops after its first EOS (HF pads finished rows).
    """
    sequences = out.sequences
    logits, scores = getattr(out, "logits", None), getattr(out, "scores", None)
    if logits is None:
        raise TranscriptError("save_hf_generate needs generate(..., output_logits=True, return_dict_in_generate=True)")
    steps = len(logits)
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    raw = torch.log_softmax(torch.stack(list(logits), dim=1).double(), dim=-1)  # (B, steps, V)
    processed = torch.log_softmax(torch.stack(list(scores), dim=1).double(), dim=-1) if scores is not None else None
    policy = policy_of(generation_kwargs) or {}
    if generation_kwargs and not generation_kwargs.get("do_sample", False):
        policy = {"temperature": 0.0}
    lines = []
    for b in range(sequences.shape[0]):
        generated = sequences[b, sequences.shape[1] - steps :].tolist()
        output = []
        for t in generated:  # after EOS (or, with no EOS given, from the first pad) HF only pads
            if not eos and pad_token_id is not None and t == pad_token_id:
                break
            output.append(t)
            if t in eos:
                break
        rows = range(len(output))
        values, ids = raw[b, : len(output)].topk(top_logprobs, dim=-1) if top_logprobs else (None, None)
        entry = {
            "request_id": request_ids[b] if request_ids else f"hf-{b}",
            "origin_engine": "hf generate",
            "prompt_token_ids": list(prompt_token_ids[b]),
            "output_token_ids": output,
            "logprobs": [float(raw[b, j, output[j]]) for j in rows],
            "top_logprobs": [
                [{"token_id": int(i), "logprob": float(v)} for i, v in zip(ids[j], values[j])] for j in rows
            ]
            if top_logprobs
            else None,
            "sampling": policy,
        }
        if processed is not None:
            entry["processed_logprobs"] = [float(processed[b, j, output[j]]) for j in rows]
        lines.append(json.dumps(entry, allow_nan=True))
    path = Path(path)
    with path.open("a" if append else "w") as fh:
        fh.write("".join(line + "\n" for line in lines))
    return len(lines)
