"""The `openai` transcript format: {"request", "response"} pairs from any OpenAI-compatible server, completions
or chat completions, streamed or not, their token strings mapped back to ids and checked against the text
(toolkit.audit.transcripts describes the format)."""

from __future__ import annotations

import json
from typing import Any

from toolkit.audit.records import (
    Problem,
    TokenMap,
    Transcript,
    TranscriptError,
    as_int_list,
    as_number,
    as_text,
    constraint_of,
    policy_of,
)
from toolkit.audit.spelling import spell


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
        chunk_choices = chunk.get("choices") or []
        if not isinstance(chunk_choices, list) or not all(isinstance(c, dict) for c in chunk_choices):
            raise TranscriptError("a streamed chunk's choices must be a list of objects")
        for c in chunk_choices:
            index = c.get("index", 0)
            if not isinstance(index, int) or isinstance(index, bool):
                raise TranscriptError(f"a streamed choice's index must be an integer, got {str(index)[:40]}")
            out = choices.setdefault(
                index, {"index": index, "text": "", "message": {"content": ""}, "logprobs": None, "finish_reason": None}
            )
            delta = c.get("delta")
            if isinstance(delta, dict):  # chat
                out["message"]["content"] += _text(delta.get("content"))
            else:
                out["text"] += _text(c.get("text"))
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


def _text(piece: Any) -> str:
    """A streamed chunk's text or content (null: none)."""
    if piece is not None and not isinstance(piece, str):
        raise TranscriptError(f"a streamed chunk's text is {str(piece)[:40]}, not a string")
    return piece or ""


def openai_line(obj: dict, line: int, tokens: TokenMap) -> list[Transcript]:
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
    engine = as_text(obj.get("origin_engine"), "origin_engine") or str(
        response.get("system_fingerprint") or response.get("model") or "openai"
    )
    base_id = str(response.get("id") or f"line{line}")
    n = request.get("n") or 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise TranscriptError(f"request.n is {str(n)[:40]}, not a positive integer")
    prompts = _openai_prompts(request, response, tokens, chat)
    unconfirmed = _confirm_prompts(prompts, response, chat)
    sampling = policy_of(request)
    records = []
    for position_in_list, choice in enumerate(choices):
        if not isinstance(choice, dict):
            raise TranscriptError(f"response.choices[{position_in_list}] is not an object")
        index = choice.get("index", position_in_list)
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:  # -1 took the last prompt
            raise TranscriptError(
                f"response.choices[{position_in_list}].index must be an integer >= 0, got {index!r:.40}"
            )
        prompt_index = index // n if len(prompts) > 1 else 0
        if prompt_index >= len(prompts):
            raise TranscriptError(f"response.choices[{position_in_list}].index {index} has no prompt")
        prompt_ids, prompt_text, prompt_source = prompts[prompt_index]
        if isinstance(choice.get("prompt_token_ids"), list):  # vLLM completions, return_token_ids
            prompt_ids = as_int_list(choice["prompt_token_ids"], f"choices[{position_in_list}].prompt_token_ids")
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
            message = choice.get("message")
            text = message.get("content") if isinstance(message, dict) else None
        else:
            steps = _completion_entries(logprobs, where)
            text = choice.get("text")
            if request.get("echo"):  # the first entries are the prompt's tokens
                steps = steps[len(prompt_ids) :]
        if text is not None and not isinstance(text, str):
            raise TranscriptError(f"choices[{position_in_list}]: the text is {str(text)[:40]}, not a string")
        finish_reason = as_text(choice.get("finish_reason"), f"choices[{position_in_list}].finish_reason")
        record = Transcript(
            request_id=base_id if len(prompts) == 1 else f"{base_id}-{prompt_index}",
            stream=index % n,
            line=line,
            origin_engine=engine,
            prompt_token_ids=list(prompt_ids),
            output_token_ids=[],
            claimed=[],
            top=[],
            sampling=sampling,
            prompt_text=prompt_text,
            output_text=text,
            finish_reason=finish_reason,
            prompt_source=prompt_source,
            constrained=constraint_of(request),
        )
        records.append(record)
        if prompt_source != "given" and unconfirmed:
            # not audited as if exact: nothing says the prompt was these tokens
            record.problems.append(
                Problem(
                    len(prompt_ids), "unconfirmed_prompt", f"{unconfirmed} ({len(steps)} output tokens not audited)"
                )
            )
            continue
        given_ids = choice.get("token_ids")  # vLLM's return_token_ids
        if given_ids is not None:
            given_ids = as_int_list(given_ids, f"choices[{position_in_list}].token_ids")
            if len(given_ids) != len(steps):
                raise TranscriptError(
                    f"choices[{position_in_list}]: {len(given_ids)} token_ids but {len(steps)} logprob entries"
                )
            ids, problems = given_ids, []
        else:
            ids, problems = _map_tokens(
                steps, text, prompt_text if request.get("echo") else None, finish_reason, tokens
            )
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
                why += (
                    f" ({len(steps) - j} output tokens from here on not audited; no top alternative of this "
                    f"choice is checked)"
                )
            record.problems.append(Problem(len(prompt_ids) + j, "unmapped_token", why))
    return records


def _map_tokens(
    steps: list, text: str | None, echoed: str | None, finish_reason: Any, tokens: TokenMap
) -> tuple[list[int], list[tuple[int, str]]]:
    """A choice's token strings as ids, each confirmed by the choice's text (toolkit.audit.spelling): the ids of
    the tokens confirmed, and (index, why) of the first that is not and of each later one that does not spell
    the text either."""
    if text is not None and echoed is not None:  # echo: the text starts with the prompt's
        text = text[len(echoed) :] if text.startswith(echoed) else None
    if text is None:
        return [], [
            (
                0,
                "the response has no text to confirm its token strings by (the tokens they name cannot be "
                "known for sure): ask the server for `bytes`, token ids or return_token_ids",
            )
        ]
    spelled = spell(
        [(token, token_bytes) for token, token_bytes, _, _ in steps], text, tokens, stop_trimmed=finish_reason == "stop"
    )
    return spelled.ids, spelled.problems


# chat fields that change the rendered prompt and that our rendering (role and text content only) does not apply,
# with the value that changes nothing where there is one
_CHAT_REQUEST_FIELDS = {
    "tools": None,
    "functions": None,
    "documents": None,
    "chat_template": None,
    "chat_template_kwargs": None,
    "continue_final_message": False,
    "add_generation_prompt": True,
    "mm_processor_kwargs": None,
}


def _set(value: Any, default: Any = None) -> bool:
    """A field given a value that matters (not absent, empty or its no-op default)."""
    return value is not None and value != default and value not in ("", [], {})


def _confirm_prompts(prompts: list[tuple[list[int], str | None, str]], response: dict, chat: bool) -> str | None:
    """Why the prompts rebuilt here cannot be confirmed as the ones the server ran (None: they are given, or as
    many tokens as usage.prompt_tokens counts); a count that differs is the line's error."""
    if all(source == "given" for _, _, source in prompts):
        return None
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else {}
    counted, ours = usage.get("prompt_tokens"), sum(len(ids) for ids, _, _ in prompts)
    source = "the chat template" if chat else "the tokenizer"
    if not isinstance(counted, int) or isinstance(counted, bool):
        return (
            f"the prompt was rebuilt with {source} of this model and the response gives neither "
            f"prompt_token_ids nor usage.prompt_tokens to confirm it (stream with "
            f"stream_options.include_usage, or ask for return_token_ids)"
        )
    if counted != ours:
        raise TranscriptError(
            f"usage.prompt_tokens is {counted} but {source} of this model gives {ours} prompt "
            f"tokens: the transcript's {source} or model differs"
        )
    return None


def _openai_prompts(
    request: dict, response: dict, tokens: TokenMap, chat: bool
) -> list[tuple[list[int], str | None, str]]:
    tok = tokens.tokenizer
    if response.get("prompt_token_ids") is not None:  # vLLM chat, return_token_ids
        return [(as_int_list(response["prompt_token_ids"], "response.prompt_token_ids"), None, "given")]
    if chat:
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise TranscriptError("request.messages must be a non-empty list")
        used = [f for f, default in _CHAT_REQUEST_FIELDS.items() if _set(request.get(f), default)]
        if used:
            raise TranscriptError(
                f"request.{used[0]} changes the prompt in a way this audit does not rebuild: "
                f"send the transcript with the prompt's token ids (vLLM: return_token_ids)"
            )
        flat = []
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type", "text") == "text" for p in content):
                    raise TranscriptError(
                        f"request.messages[{i}] has non-text content parts: the prompt cannot be "
                        f"rebuilt here (send its token ids)"
                    )
                content = "".join(p.get("text", "") for p in content)
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
                raise TranscriptError("request.messages must be {role, content} objects")
            extra = sorted(k for k in m if k not in ("role", "content") and _set(m[k]))
            if extra:
                raise TranscriptError(
                    f"request.messages[{i}].{extra[0]} is not rendered by this audit's chat "
                    f"template call: the prompt cannot be rebuilt here (send its token ids)"
                )
            flat.append({"role": m["role"], "content": content})
        try:
            return [(tok.apply_chat_template(flat, add_generation_prompt=True), None, "rebuilt")]
        except Exception as exc:  # noqa: BLE001 - the template's own error, named
            raise TranscriptError(f"the model's chat template cannot render request.messages: {exc}") from None
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        return [(tok.encode(prompt), prompt, "encoded")]
    if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        return [(list(prompt), None, "given")]
    if isinstance(prompt, list) and prompt:
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append((tok.encode(p), p, "encoded"))
            elif isinstance(p, list) and all(_is_id(t) for t in p):
                out.append((list(p), None, "given"))
            else:
                raise TranscriptError("request.prompt must be text, token ids or a list of them")
        return out
    raise TranscriptError("request has neither `prompt` nor `messages`")


def _is_id(t: Any) -> bool:
    """A JSON integer: `true` is none (Python's True is the int 1; the trace's id columns refuse it)."""
    return isinstance(t, int) and not isinstance(t, bool)


def _chat_entry(entry: Any, where: str):
    if not isinstance(entry, dict) or "token" not in entry:
        raise TranscriptError(f"{where} is not a {{token, logprob}} object")
    top = []
    alts = entry.get("top_logprobs") or []
    if not isinstance(alts, list):
        raise TranscriptError(f"{where}.top_logprobs must be a list of {{token, logprob}} objects")
    for i, alt in enumerate(alts):
        if not isinstance(alt, dict) or "token" not in alt:
            raise TranscriptError(f"{where}.top_logprobs[{i}] is not a {{token, logprob}} object")
        logprob = as_number(alt.get("logprob"), f"{where}.top_logprobs[{i}].logprob")
        top.append((alt["token"], alt.get("bytes"), logprob))
    return entry["token"], entry.get("bytes"), as_number(entry.get("logprob"), f"{where}.logprob"), top


def _completion_entries(logprobs: dict, where: str):
    if isinstance(logprobs.get("content"), list) and "tokens" not in logprobs:  # llama-server: the chat shape
        return [_chat_entry(e, f"{where}.content[{i}]") for i, e in enumerate(logprobs["content"])]
    tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) != len(values):
        raise TranscriptError(f"{where} needs `tokens` and `token_logprobs` of the same length (or `content`)")
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    if not isinstance(tops, list) or len(tops) != len(tokens):
        raise TranscriptError(f"{where}.top_logprobs must have one entry per token")
    steps = []
    for i, (token, value, top) in enumerate(zip(tokens, values, tops)):
        if top is not None and not isinstance(top, dict):
            raise TranscriptError(f"{where}.top_logprobs[{i}] must be a {{token: logprob}} object")
        alts = [(t, None, as_number(lp, f"{where}.top_logprobs[{i}][{t!r}]")) for t, lp in (top or {}).items()]
        steps.append((token, None, as_number(value, f"{where}.token_logprobs[{i}]"), alts))
    return steps
