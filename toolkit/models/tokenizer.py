"""A light tokenizer over `tokenizer.json` (HF `tokenizers`) plus the checkpoint's chat template.

Importing `transformers` costs seconds; serving only needs encode, decode and the chat
template, so we read the same files HF writes and render the template the way HF does
(a sandboxed Jinja environment with trim_blocks and lstrip_blocks).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2.sandbox
import tokenizers

from toolkit.errors import ModelLoadError, RequestError


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """encode / decode / apply_chat_template, with the special-token ids the engine needs."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"no tokenizer.json in {directory}")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise ModelLoadError(f"cannot read {path}: {exc}") from None
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = directory / "chat_template.jinja"
        self.chat_template: str | None = (
            template_path.read_text() if template_path.is_file() else config.get("chat_template")
        )
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        digest = hashlib.sha256(path.read_bytes())
        digest.update((self.chat_template or "").encode())
        self.digest = digest.hexdigest()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch gives the same ids and lets the GIL go while it works (encode holds it: a server's handler
        # tokenizing an 8 MB prompt stopped the engine thread for seconds)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, vocab_size: int) -> list[bytes]:
        """Each token id's bytes (what it spells; special tokens their text), via xgrammar's decoded vocab."""
        if getattr(self, "_token_bytes", None) is None or len(self._token_bytes) != vocab_size:
            import xgrammar as xgr  # deferred: xgrammar, a second to import
            from transformers import PreTrainedTokenizerFast  # deferred: transformers, seconds to import

            hf = PreTrainedTokenizerFast(tokenizer_object=self._tok)
            with warnings.catch_warnings():  # "stop_token_ids ... will be automatically detected": not used here
                warnings.simplefilter("ignore")
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
            self._token_bytes = [bytes(b) for b in info.decoded_vocab]
        return self._token_bytes

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not self.chat_template:
            raise RequestError("this tokenizer has no chat template; give `prompt` instead of `messages`")
        if (
            not isinstance(messages, list)
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
            or not messages
        ):
            raise RequestError("messages must be a non-empty list of {role: str, content: str}")
        text = _render(
            self.chat_template,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        return self.encode(text, add_special_tokens=False)


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


_ENV = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
_ENV.globals["raise_exception"] = _raise
_ENV.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)


def _render(template: str, **context) -> str:
    try:
        return _ENV.from_string(template).render(**context)
    except jinja2.exceptions.TemplateError as exc:
        raise RequestError(f"chat template failed: {exc}") from None
