"""The logprobs of an answer in OpenAI's shapes, from the trace rows the engine sampled: a chat completion's
`content` entries (with each token's bytes), a completion's parallel lists (with text offsets), and a completion's
echoed prompt scored before its tokens."""

from __future__ import annotations

from typing import Any

from toolkit.serve.protocol import token_text


class LogprobFormat:
    """For one request's answer: `wanted` is its logprobs field (None: the answer carries none; 0: the sampled
    token's only; k: the k most likely under the raw distribution beside it). A completion's `top_logprobs` hold
    the chosen token too, as OpenAI's and vLLM's do (up to k + 1 entries); a chat's `top_logprobs`, the k alone."""

    def __init__(self, tokenizer: Any, vocab_size: int, wanted: int | None):
        self.tokenizer, self.vocab_size, self.wanted = tokenizer, vocab_size, wanted

    def _top(self, row) -> list[tuple[int, float]]:
        return list(row.top_raw) if self.wanted else []

    def chat(self, rows) -> dict | None:
        if self.wanted is None:
            return None
        tok = self.tokenizer
        spelled = tok.token_bytes(self.vocab_size) if tok is not None else None

        def entry(token_id: int, logprob: float) -> dict:  # bytes: what the token spells, whole or not
            text = token_text(tok, token_id)
            return {
                "token": text,
                "logprob": logprob,
                "bytes": list(spelled[token_id]) if spelled is not None else list(text.encode()),
            }

        return {
            "content": [
                {**entry(r.token_id, r.raw_logprob), "top_logprobs": [entry(t, lp) for t, lp in self._top(r)]}
                for r in rows
                if r.token_id >= 0
            ],
            "refusal": None,
        }

    def completion(self, rows, offset: int = 0) -> dict | None:
        if self.wanted is None:
            return None
        tok = self.tokenizer
        tokens, logprobs, tops, offsets = [], [], [], []
        for r in rows:
            if r.token_id < 0:
                continue
            text = token_text(tok, r.token_id)
            offsets.append(offset)
            offset += len(text)
            tokens.append(text)
            logprobs.append(r.raw_logprob)
            tops.append(_with_chosen({token_text(tok, t): lp for t, lp in self._top(r)}, text, r.raw_logprob))
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def echo(self, prompt_ids, prompt_scores: list | None, rows) -> dict:
        """The prompt's tokens (`prompt_scores`: toolkit.engine.runner.prompt_logprobs' entries, the first token
        unscored), then the completion's."""
        tok = self.tokenizer
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        prompt = prompt_scores or []
        for pos, token_id in enumerate(prompt_ids):
            text = token_text(tok, token_id)
            entry = prompt[pos] if pos < len(prompt) else None
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            out["token_logprobs"].append(None if entry is None else entry[1])
            out["top_logprobs"].append(
                None if entry is None else _with_chosen({token_text(tok, t): lp for t, lp in entry[2]}, text, entry[1])
            )
        generated = self.completion(rows, offset)
        for key in out:
            out[key] += generated[key]
        return out


def _with_chosen(top: dict[str, float], text: str, logprob: float) -> dict[str, float]:
    """A completion position's alternatives with the token it has (the sampled or prompt token) among them: "the API
    will always return the logprob of the sampled token, so there may be up to logprobs+1 elements" (OpenAI). A
    token whose text another alternative already has keeps that entry."""
    top.setdefault(text, logprob)
    return top
