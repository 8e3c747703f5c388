"""A light tokenizer over `tokenizer.json` (HF `tokenizers`) plus the checkpoint's chat template.

Importing `transformers` costs seconds; serving only needs encode, decode and the chat
template, so we read the same files HF writes and render the template the way HF does
(a sandboxed Jinja environment with trim_blocks and lstrip_blocks).
"""

from __future__ import annotations

import hashlib
import json
import threading
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


_BYTES_LOCK = threading.Lock()  # Tokenizer.token_bytes builds its table once


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
        self.max_token_chars, self._dropped = _max_token_chars(self._tok)
        digest = hashlib.sha256(path.read_bytes())
        digest.update((self.chat_template or "").encode())
        self.digest = digest.hexdigest()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch gives the same ids and lets the GIL go while it works (encode holds it: a server's handler
        # tokenizing an 8 MB prompt stopped the engine thread for seconds)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def least_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), read without tokenizing (0 where none is known): a prompt of millions
        of characters is refused against the context before its tokens (hundreds of bytes each) are made."""
        if not self.max_token_chars:
            return 0
        spelled = len(text) - sum(map(text.count, self._dropped))  # characters the vocabulary drops spell nothing
        return -(-spelled // self.max_token_chars)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, vocab_size: int) -> list[bytes]:
        """Each token id's bytes (what it spells; special tokens their text), via xgrammar's decoded vocab: seconds
        the first time (imports and a copy of the tokenizer), once however many threads ask at once."""
        with _BYTES_LOCK:
            return self._token_bytes_unlocked(vocab_size)

    def _token_bytes_unlocked(self, vocab_size: int) -> list[bytes]:
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
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The messages through the chat template, as text (apply_chat_template's before it is tokenized)."""
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
        return _render(
            self.chat_template,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


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


# pre-tokenizers that keep every byte of the text (ByteLevel maps each to one character of the vocabulary's strings;
# a Split or Digits that isolates or merges moves no byte out)
_KEEPING = frozenset({"ByteLevel", "Split", "Digits", "Punctuation", "Sequence"})


def _max_token_chars(tok: tokenizers.Tokenizer) -> tuple[int | None, str]:
    """The most characters one token spells, and the characters the vocabulary drops (ASCII controls whose byte has
    no token: SmolLM2's lacks 6), so that a text of C characters, D of them dropped, is at least (C - D) / that many
    tokens: for a BPE tokenizer that normalizes nothing and splits the text's bytes (a ByteLevel pre-tokenizer, alone
    or after splits that drop nothing), whose tokens' strings spell one byte a character, and which keeps every
    continuation byte (so no character of several bytes is dropped whole). (None, "") elsewhere: a normalizer or a
    pre-tokenizer may drop characters (BERT's drops spaces)."""
    none = None, ""
    if tok.normalizer is not None or tok.pre_tokenizer is None or type(tok.model).__name__ != "BPE":
        return none
    parts, todo = [], [json.loads(tok.pre_tokenizer.__getstate__())]
    while todo:
        part = todo.pop()
        parts.append(part)
        todo.extend(part.get("pretokenizers", []))
    if not any(p.get("type") == "ByteLevel" for p in parts):
        return none
    if any(p.get("type") not in _KEEPING or str(p.get("behavior", "")).lower() == "removed" for p in parts):
        return none
    vocab = tok.get_vocab(with_added_tokens=True)
    spell = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str
    if any(spell(bytes([0xC2, byte]).decode())[0][0][1] not in vocab for byte in range(0x80, 0xC0)):
        return none
    dropped = "".join(chr(byte) for byte in range(0x80) if spell(chr(byte))[0][0] not in vocab)
    return max(map(len, vocab), default=None), dropped
