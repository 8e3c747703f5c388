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

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from toolkit.audit.spelling import spell

FORMATS = ("openai", "token_ids", "hf")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # vLLM's names: before / after the processors
# the request fields that decide which tokens a policy can produce (OpenAI's and vLLM's names = ours)
POLICY_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "processors")


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


@dataclass
class LineError:
    line: int
    request_id: str | None
    why: str


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
            return (token, "") if 0 <= token < self.vocab_size else (None, f"token id {token} is outside the "
                                                                         f"model's vocabulary of {self.vocab_size}")
        if not isinstance(token, str):
            return None, f"token {token!r} is neither a string nor an id"
        if token.startswith("token_id:") and token[9:].isdigit():  # vLLM's return_tokens_as_token_ids
            return self.to_id(int(token[9:]))
        if token_bytes is not None:
            try:
                raw = bytes(token_bytes)
            except (TypeError, ValueError):
                return None, f"token {token!r}: bytes {token_bytes!r} are not a list of byte values"
        elif "\ufffd" in token or not token:
            # servers print U+FFFD (or nothing) for a token that is part of a multi-byte character: which
            # token it was cannot be known from the string
            return None, (f"token string {token!r} stands for a partial UTF-8 sequence: ask the server for "
                          f"`bytes` or token ids")
        else:
            raw = token.encode("utf-8")
        ids = self._ids.get(raw)
        if not ids:
            return None, f"token string {token!r} is not the text of any one token of this model"
        if len(ids) > 1:
            return None, f"token string {token!r} is the text of several tokens {ids[:4]}: ambiguous"
        return ids[0], ""


def read_transcripts(path: str | Path, fmt: str, tokenizer, vocab_size: int,
                     logprobs_mode: str | None = None) -> tuple[list[Transcript], list[LineError]]:
    """Every usable request of the file, and a LineError for each line that is not."""
    if fmt not in FORMATS:
        raise TranscriptError(f"audit.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if logprobs_mode is not None and logprobs_mode not in LOGPROBS_MODES:
        raise TranscriptError(f"audit.logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TranscriptError(f"cannot read {path}: {exc}") from None
    tokens = TokenMap(tokenizer, vocab_size)
    records: list[Transcript] = []
    errors: list[LineError] = []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            errors.append(LineError(number, None, f"not JSON: {exc}"))
            continue
        if not isinstance(obj, dict):
            errors.append(LineError(number, None, "not a JSON object"))
            continue
        try:
            if fmt == "openai":
                found = _openai_line(obj, number, tokens)
            else:
                found = [_token_ids_line(obj, number, tokens, "hf" if fmt == "hf" else "unknown", logprobs_mode)]
            for record in found:
                _check_ids(record, vocab_size)
        except TranscriptError as exc:
            errors.append(LineError(number, _request_id(obj), str(exc)))
            continue
        for record in found:
            record.source = text
            if logprobs_mode is not None:
                record.logprobs_mode = logprobs_mode
            records.append(record)
    seen: set[tuple[str, int]] = set()
    for record in records:  # request ids name a request in the converted trace: make repeats unique
        key, k = (record.request_id, record.stream), 1
        while key in seen:
            key, k = (f"{record.request_id}~{k}", record.stream), k + 1
        record.request_id = key[0]
        seen.add(key)
    return records, errors


def _request_id(obj: dict) -> str | None:
    for holder in (obj, obj.get("response") if isinstance(obj.get("response"), dict) else {}):
        for key in ("request_id", "id", "rid"):
            if isinstance(holder.get(key), (str, int)):
                return str(holder[key])
    return None


def _check_ids(record: Transcript, vocab_size: int) -> None:
    for what, ids in (("prompt_token_ids", record.prompt_token_ids), ("output token", record.output_token_ids)):
        bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)), None)
        if bad is not None:
            raise TranscriptError(f"{what} {bad!r} is outside the model's vocabulary of "
                                  f"{vocab_size}: the transcript comes from another tokenizer")


def _number(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TranscriptError(f"{what} is {value!r}, not a number")
    return float(value)


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise TranscriptError(f"{what} must be a list of token ids")
    return list(value)


def _policy(obj: dict | None) -> dict[str, Any] | None:
    if not isinstance(obj, dict):
        return None
    found = {k: obj[k] for k in POLICY_FIELDS if obj.get(k) is not None}
    return found or None


# ---------------------------------------------------------------------------------------------- openai

def _merge_stream(chunks: list) -> dict:
    """A streamed response (its `data:` chunks, in order) as the one response a non-streaming call returns:
    per choice index, the text or message content and the logprob entries concatenated, the last
    finish_reason, and the usage of the chunk that has it."""
    merged: dict[str, Any] = {}
    choices: dict[int, dict] = {}
    for chunk in chunks:
        if not isinstance(chunk, dict):
            raise TranscriptError("a streamed response is a list of chunk objects")
        for key in ("id", "model", "system_fingerprint", "prompt_token_ids"):
            if chunk.get(key) is not None:
                merged.setdefault(key, chunk[key])
        if chunk.get("usage"):
            merged["usage"] = chunk["usage"]
        for c in chunk.get("choices") or []:
            index = c.get("index", 0)
            out = choices.setdefault(index, {"index": index, "text": "", "message": {"content": ""},
                                             "logprobs": None, "finish_reason": None})
            delta = c.get("delta")
            if isinstance(delta, dict):  # chat
                out["message"]["content"] += delta.get("content") or ""
            else:
                out["text"] += c.get("text") or ""
            lp = c.get("logprobs")
            if isinstance(lp, dict):
                if out["logprobs"] is None:
                    out["logprobs"] = {k: [] for k in lp if isinstance(lp[k], list)}
                for k, v in lp.items():
                    if isinstance(v, list):
                        out["logprobs"].setdefault(k, []).extend(v)
            for key in ("token_ids", "prompt_token_ids"):
                if isinstance(c.get(key), list):
                    out.setdefault(key, []).extend(c[key])
            if c.get("finish_reason"):
                out["finish_reason"] = c["finish_reason"]
    merged["choices"] = [choices[i] for i in sorted(choices)]
    return merged


def _openai_line(obj: dict, line: int, tokens: TokenMap) -> list[Transcript]:
    request, response = obj.get("request"), obj.get("response")
    if isinstance(response, list):  # a streamed response: its chunks
        response = _merge_stream(response)
    if not isinstance(request, dict) or not isinstance(response, dict):
        raise TranscriptError('an openai line is {"request": <body sent>, "response": <body received>}')
    if "error" in response and "choices" not in response:
        raise TranscriptError(f"the response is an error: {json.dumps(response['error'])[:200]}")
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise TranscriptError("response.choices is missing or empty")
    chat = "messages" in request
    engine = str(obj.get("origin_engine") or response.get("system_fingerprint") or response.get("model") or "openai")
    base_id = str(response.get("id") or f"line{line}")
    n = request.get("n") or 1
    prompts = _openai_prompts(request, response, tokens, chat)
    unconfirmed = _confirm_prompts(prompts, response, chat)
    sampling = _policy(request)
    records = []
    for position_in_list, choice in enumerate(choices):
        if not isinstance(choice, dict):
            raise TranscriptError(f"response.choices[{position_in_list}] is not an object")
        index = choice.get("index", position_in_list)
        prompt_index = index // n if isinstance(index, int) and len(prompts) > 1 else 0
        if prompt_index >= len(prompts):
            raise TranscriptError(f"response.choices[{position_in_list}].index {index} has no prompt")
        prompt_ids, prompt_text, prompt_source = prompts[prompt_index]
        if isinstance(choice.get("prompt_token_ids"), list):  # vLLM completions, return_token_ids
            prompt_ids = _int_list(choice["prompt_token_ids"], f"choices[{position_in_list}].prompt_token_ids")
            prompt_source = "given"
        where = f"choices[{position_in_list}].logprobs"
        logprobs = choice.get("logprobs")
        if not isinstance(logprobs, dict):
            raise TranscriptError(f"{where} is missing: request logprobs to audit a transcript")
        if chat:
            entries = logprobs.get("content")
            if not isinstance(entries, list):
                raise TranscriptError(f"{where}.content is missing")
            steps = [_chat_entry(e, f"{where}.content[{i}]") for i, e in enumerate(entries)]
            text = (choice.get("message") or {}).get("content")
        else:
            steps = _completion_entries(logprobs, where)
            text = choice.get("text")
            if request.get("echo"):  # the first entries are the prompt's tokens
                steps = steps[len(prompt_ids):]
        record = Transcript(request_id=base_id if len(prompts) == 1 else f"{base_id}-{prompt_index}",
                            stream=index % n if isinstance(index, int) else 0, line=line, origin_engine=engine,
                            prompt_token_ids=list(prompt_ids), output_token_ids=[], claimed=[], top=[],
                            sampling=sampling, prompt_text=prompt_text, output_text=text,
                            finish_reason=choice.get("finish_reason"), prompt_source=prompt_source)
        records.append(record)
        if prompt_source != "given" and unconfirmed:
            # not audited as if exact: nothing says the prompt was these tokens
            record.problems.append(Problem(len(prompt_ids), "unconfirmed_prompt", f"{unconfirmed} ({len(steps)} "
                                                                                  f"output tokens not audited)"))
            continue
        given_ids = choice.get("token_ids")  # vLLM's return_token_ids
        if given_ids is not None:
            given_ids = _int_list(given_ids, f"choices[{position_in_list}].token_ids")
            if len(given_ids) != len(steps):
                raise TranscriptError(f"choices[{position_in_list}]: {len(given_ids)} token_ids but {len(steps)} "
                                      f"logprob entries")
            ids, problems = given_ids, []
        else:
            ids, problems = _map_tokens(steps, text, prompt_text if request.get("echo") else None,
                                       choice.get("finish_reason"), tokens)
        for token_id, (_, _, logprob, top) in zip(ids, steps):
            record.output_token_ids.append(token_id)
            record.claimed.append(logprob)
            mapped = []
            for alt, alt_bytes, alt_lp in top:
                alt_id, _ = tokens.to_id(alt, alt_bytes)
                if alt_id is not None and alt_lp is not None:
                    mapped.append((alt_id, alt_lp))
            record.top.append(mapped)
        if problems:  # the strings do not name the tokens the text has: the alternatives' strings are not trusted
            record.top = [[] for _ in record.output_token_ids]
        for k, (j, why) in enumerate(problems):
            # the context after a token not known for sure is unknown: audit what came before, report each
            if k == 0 and j < len(steps):
                why += f" ({len(steps) - j} output tokens from here on not audited; no top alternative of this " \
                       f"choice is checked)"
            record.problems.append(Problem(len(prompt_ids) + j, "unmapped_token", why))
    return records


def _map_tokens(steps: list, text: str | None, echoed: str | None, finish_reason: Any,
                tokens: TokenMap) -> tuple[list[int], list[tuple[int, str]]]:
    """A choice's token strings as ids, each confirmed by the choice's text (toolkit.audit.spelling): the ids of
    the tokens confirmed, and (index, why) of the first that is not and of each later one that does not spell
    the text either."""
    if text is not None and echoed is not None:  # echo: the text starts with the prompt's
        text = text[len(echoed):] if text.startswith(echoed) else None
    if text is None:
        return [], [(0, "the response has no text to confirm its token strings by (the tokens they name cannot be "
                        "known for sure): ask the server for `bytes`, token ids or return_token_ids")]
    spelled = spell([(token, token_bytes) for token, token_bytes, _, _ in steps], text, tokens,
                    stop_trimmed=finish_reason == "stop")
    return spelled.ids, spelled.problems


# chat fields that change the rendered prompt and that our rendering (role and text content only) does not apply,
# with the value that changes nothing where there is one
_CHAT_REQUEST_FIELDS = {"tools": None, "functions": None, "documents": None, "chat_template": None,
                        "chat_template_kwargs": None, "continue_final_message": False, "add_generation_prompt": True,
                        "mm_processor_kwargs": None}


def _set(value: Any, default: Any = None) -> bool:
    """A field given a value that matters (not absent, empty or its no-op default)."""
    return value is not None and value != default and value not in ("", [], {})


def _confirm_prompts(prompts: list[tuple[list[int], str | None, str]], response: dict, chat: bool) -> str | None:
    """Why the prompts rebuilt here cannot be confirmed as the ones the server ran (None: they are given, or as
    many tokens as usage.prompt_tokens counts); a count that differs is the line's error."""
    if all(source == "given" for _, _, source in prompts):
        return None
    usage = response.get("usage") or {}
    counted, ours = usage.get("prompt_tokens"), sum(len(ids) for ids, _, _ in prompts)
    source = "the chat template" if chat else "the tokenizer"
    if not isinstance(counted, int) or isinstance(counted, bool):
        return (f"the prompt was rebuilt with {source} of this model and the response gives neither "
                f"prompt_token_ids nor usage.prompt_tokens to confirm it (stream with "
                f"stream_options.include_usage, or ask for return_token_ids)")
    if counted != ours:
        raise TranscriptError(f"usage.prompt_tokens is {counted} but {source} of this model gives {ours} prompt "
                              f"tokens: the transcript's {source} or model differs")
    return None


def _openai_prompts(request: dict, response: dict, tokens: TokenMap,
                    chat: bool) -> list[tuple[list[int], str | None, str]]:
    tok = tokens.tokenizer
    if isinstance(response.get("prompt_token_ids"), list) and all(
            isinstance(t, int) for t in response["prompt_token_ids"]):  # vLLM chat, return_token_ids
        return [(list(response["prompt_token_ids"]), None, "given")]
    if chat:
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise TranscriptError("request.messages must be a non-empty list")
        used = [f for f, default in _CHAT_REQUEST_FIELDS.items() if _set(request.get(f), default)]
        if used:
            raise TranscriptError(f"request.{used[0]} changes the prompt in a way this audit does not rebuild: "
                                  f"send the transcript with the prompt's token ids (vLLM: return_token_ids)")
        flat = []
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type", "text") == "text" for p in content):
                    raise TranscriptError(f"request.messages[{i}] has non-text content parts: the prompt cannot be "
                                          f"rebuilt here (send its token ids)")
                content = "".join(p.get("text", "") for p in content)
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
                raise TranscriptError("request.messages must be {role, content} objects")
            extra = sorted(k for k in m if k not in ("role", "content") and _set(m[k]))
            if extra:
                raise TranscriptError(f"request.messages[{i}].{extra[0]} is not rendered by this audit's chat "
                                      f"template call: the prompt cannot be rebuilt here (send its token ids)")
            flat.append({"role": m["role"], "content": content})
        try:
            return [(tok.apply_chat_template(flat, add_generation_prompt=True), None, "rebuilt")]
        except Exception as exc:  # noqa: BLE001 - the template's own error, named
            raise TranscriptError(f"the model's chat template cannot render request.messages: {exc}") from None
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        return [(tok.encode(prompt), prompt, "encoded")]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [(list(prompt), None, "given")]
    if isinstance(prompt, list) and prompt:
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append((tok.encode(p), p, "encoded"))
            elif isinstance(p, list) and all(isinstance(t, int) for t in p):
                out.append((list(p), None, "given"))
            else:
                raise TranscriptError("request.prompt must be text, token ids or a list of them")
        return out
    raise TranscriptError("request has neither `prompt` nor `messages`")


def _chat_entry(entry: Any, where: str):
    if not isinstance(entry, dict) or "token" not in entry:
        raise TranscriptError(f"{where} is not a {{token, logprob}} object")
    top = []
    for i, alt in enumerate(entry.get("top_logprobs") or []):
        if not isinstance(alt, dict) or "token" not in alt:
            raise TranscriptError(f"{where}.top_logprobs[{i}] is not a {{token, logprob}} object")
        top.append((alt["token"], alt.get("bytes"), _number(alt.get("logprob"), f"{where}.top_logprobs[{i}].logprob")))
    return entry["token"], entry.get("bytes"), _number(entry.get("logprob"), f"{where}.logprob"), top


def _completion_entries(logprobs: dict, where: str):
    tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) != len(values):
        raise TranscriptError(f"{where} needs `tokens` and `token_logprobs` of the same length")
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    if not isinstance(tops, list) or len(tops) != len(tokens):
        raise TranscriptError(f"{where}.top_logprobs must have one entry per token")
    steps = []
    for i, (token, value, top) in enumerate(zip(tokens, values, tops)):
        alts = [(t, None, _number(lp, f"{where}.top_logprobs[{i}][{t!r}]")) for t, lp in (top or {}).items()]
        steps.append((token, None, _number(value, f"{where}.token_logprobs[{i}]"), alts))
    return steps


# ---------------------------------------------------------------------------------------------- token ids

def _token_ids_line(obj: dict, line: int, tokens: TokenMap, default_engine: str,
                    mode_override: str | None) -> Transcript:
    meta = obj.get("meta_info") if isinstance(obj.get("meta_info"), dict) else None
    if meta is not None and "output_token_logprobs" in meta:  # SGLang's return_logprob
        return _sglang_line(obj, meta, line, tokens)
    prompt = _int_list(obj.get("prompt_token_ids"), "prompt_token_ids")
    output = _int_list(obj.get("output_token_ids", obj.get("token_ids")), "output_token_ids")
    mode = obj.get("logprobs_mode", "raw_logprobs") if mode_override is None else mode_override
    if mode not in LOGPROBS_MODES:
        raise TranscriptError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {mode!r}")
    # save_hf_generate writes both: the processed ones are the claims in processed_logprobs mode
    logprobs = obj.get("processed_logprobs") if mode == "processed_logprobs" and "processed_logprobs" in obj \
        else obj.get("logprobs")
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
            claimed.append(_number(entry, f"logprobs[{i}]"))
            top.append([])
        if tops_given is not None and tops_given[i] is not None:
            top[-1] = _top_entries(tops_given[i], f"top_logprobs[{i}]")
    if mode == "processed_logprobs" and "processed_logprobs" in obj:
        top = [[] for _ in output]  # the top alternatives are raw ones
    return Transcript(request_id=str(_request_id(obj) or f"line{line}"), stream=int(obj.get("stream", 0) or 0),
                      line=line, origin_engine=str(obj.get("origin_engine") or default_engine),
                      prompt_token_ids=prompt, output_token_ids=output, claimed=claimed, top=top,
                      logprobs_mode=mode, sampling=_policy(obj.get("sampling")),
                      prompt_text=obj.get("prompt") if isinstance(obj.get("prompt"), str) else None,
                      output_text=obj.get("text") if isinstance(obj.get("text"), str) else None,
                      finish_reason=obj.get("finish_reason"))


def _key_id(key: Any, where: str) -> int:
    try:
        return int(key)
    except (TypeError, ValueError):
        raise TranscriptError(f"{where}: key {key!r} is not a token id") from None


def _logprob_value(value: Any, where: str) -> float | None:
    if isinstance(value, dict):
        value = value.get("logprob")
    return _number(value, where)


def _top_entries(entry: Any, where: str) -> list[tuple[int, float]]:
    if isinstance(entry, dict):
        return [(_key_id(k, where), _logprob_value(v, f"{where}[{k}]")) for k, v in entry.items()]
    if isinstance(entry, list):
        out = []
        for i, alt in enumerate(entry):
            if isinstance(alt, dict):
                out.append((_key_id(alt.get("token_id"), f"{where}[{i}]"),
                            _number(alt.get("logprob"), f"{where}[{i}]")))
            elif isinstance(alt, (list, tuple)) and len(alt) >= 2:  # SGLang's [logprob, token_id, text]
                out.append((_key_id(alt[1], f"{where}[{i}]"), _number(alt[0], f"{where}[{i}]")))
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
        claimed.append(_number(s[0], f"meta_info.output_token_logprobs[{i}][0]"))
    tops = meta.get("output_top_logprobs") or [None] * len(output)
    top = [_top_entries(t, f"meta_info.output_top_logprobs[{i}]") if t is not None else [] for i, t in enumerate(tops)]
    prompt = _int_list(obj.get("prompt_token_ids", obj.get("input_ids")), "prompt_token_ids")
    return Transcript(request_id=str(meta.get("id", obj.get("request_id", f"line{line}"))), stream=0, line=line,
                      origin_engine=str(obj.get("origin_engine") or "sglang"), prompt_token_ids=prompt,
                      output_token_ids=output, claimed=claimed, top=top, sampling=_policy(obj.get("sampling")),
                      output_text=obj.get("text") if isinstance(obj.get("text"), str) else None,
                      finish_reason=(meta.get("finish_reason") or {}).get("type")
                      if isinstance(meta.get("finish_reason"), dict) else meta.get("finish_reason"))


# ---------------------------------------------------------------------------------------------- hf generate

def save_hf_generate(path: str | Path, out: Any, prompt_token_ids: Sequence[Sequence[int]], *,
                     generation_kwargs: dict[str, Any] | None = None, top_logprobs: int = 5,
                     pad_token_id: int | None = None, eos_token_id: int | Iterable[int] | None = None,
                     request_ids: Sequence[str] | None = None, append: bool = False) -> int:
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
    policy = _policy(generation_kwargs) or {}
    if generation_kwargs and not generation_kwargs.get("do_sample", False):
        policy = {"temperature": 0.0}
    lines = []
    for b in range(sequences.shape[0]):
        generated = sequences[b, sequences.shape[1] - steps:].tolist()
        output = []
        for t in generated:  # after EOS (or, with no EOS given, from the first pad) HF only pads
            if not eos and pad_token_id is not None and t == pad_token_id:
                break
            output.append(t)
            if t in eos:
                break
        rows = range(len(output))
        values, ids = raw[b, : len(output)].topk(top_logprobs, dim=-1) if top_logprobs else (None, None)
        entry = {"request_id": request_ids[b] if request_ids else f"hf-{b}", "origin_engine": "hf generate",
                 "prompt_token_ids": list(prompt_token_ids[b]), "output_token_ids": output,
                 "logprobs": [float(raw[b, j, output[j]]) for j in rows],
                 "top_logprobs": [[{"token_id": int(i), "logprob": float(v)} for i, v in zip(ids[j], values[j])]
                                  for j in rows] if top_logprobs else None,
                 "sampling": policy}
        if processed is not None:
            entry["processed_logprobs"] = [float(processed[b, j, output[j]]) for j in rows]
        lines.append(json.dumps(entry, allow_nan=True))
    path = Path(path)
    with path.open("a" if append else "w") as fh:
        fh.write("".join(line + "\n" for line in lines))
    return len(lines)

