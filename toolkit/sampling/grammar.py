"""Grammar masks through xgrammar: JSON schema, regex, EBNF and choice outputs.

Each distinct grammar (toolkit.sampling.structured.StructuredOutputs) is compiled once per engine
(cached by kind and text); every sequence with structured outputs gets its own
`GrammarMatcher`. Once per step the decide stage fills the bitmasks of all grammar rows
together (`fill_masks`); the `grammar` processor applies them as a hard mask. Committed
tokens advance the matcher; speculation looks ahead on forks of it; it is rebuilt from
committed tokens after a recompute preemption.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from toolkit.errors import RequestError, ResourceError
from toolkit.sampling.structured import KINDS, StructuredOutputs, choice_ebnf

__all__ = ["GrammarBackend", "KINDS", "LazyGrammar", "StructuredOutputs", "choice_ebnf", "unpack_bitmask"]

MAX_COMPILED = 256  # compiled grammars kept per engine
# what xgrammar's message ends with when the system refused it a thread, memory or a file (its C++ errors carry
# only their text): a ResourceError, never the request's grammar's fault
RESOURCE_ERRORS = tuple(os.strerror(e) for e in (errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.ENOSPC))


def _compiler_message(exc: Exception) -> str:
    """xgrammar's message without its timestamp and source location, on one line."""
    text = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", " ".join(str(exc).split()))
    if text.startswith("Check failed"):  # an assertion inside xgrammar, met by patterns of large repetition counts
        return f"xgrammar cannot compile it (its internal check failed: {text.removeprefix('Check failed: ')})"
    return text


def out_of_memory(exc: BaseException) -> bool:
    """Python's MemoryError, or xgrammar's C++ std::bad_alloc (a RuntimeError of that text)."""
    return isinstance(exc, MemoryError) or "std::bad_alloc" in str(exc)


def compile_spec(compiler, kind: str, text: str):
    """xgrammar's compile of one grammar (a StructuredOutputs' kind and text) by `compiler`, in this process or a
    compiling child's (the same options both ways): a RequestError naming the field if it is invalid, a
    ResourceError when the machine was short; running out of memory (out_of_memory) as it came."""
    try:
        if kind == "json":  # any whitespace, but never more than 16 in a row: the model cannot pad forever
            return compiler.compile_json_schema(text, any_whitespace=True, max_whitespace_cnt=16)
        if kind == "regex":
            return compiler.compile_regex(text)
        return compiler.compile_grammar(text)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with the reason
        if out_of_memory(exc):
            raise
        message = _compiler_message(exc)
        if message.endswith(RESOURCE_ERRORS):  # the machine's shortage (its threads at shutdown), not the grammar's
            raise ResourceError(f"compiling structured_outputs.{kind} failed: {message}") from None
        raise RequestError(f"invalid structured_outputs.{kind}: {message}") from None


class GrammarBackend:
    """xgrammar's tokenizer info and compiler for one tokenizer, plus the compiled-grammar cache."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], threads: int = 1):
        import xgrammar as xgr  # deferred: xgrammar, a second to import
        from transformers import PreTrainedTokenizerFast  # deferred: transformers, seconds to import

        self._xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer._tok)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads)
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()  # least recently used first
        self._info_json: str | None = None
        self._lock = threading.Lock()  # a server compiles on its handlers' threads, the engine on its own
        self.compilations = 0
        self.seconds = 0.0  # time spent filling masks, advancing and checking matchers (for benchmarks)
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def is_compiled(self, spec: StructuredOutputs) -> bool:
        """Whether `spec` is in the cache; if so it is made the most recently used (the request it answers is
        about to be added: it must not be evicted first, and compiled again on the engine thread)."""
        key = (spec.kind, spec.text)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return True
            return False

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar, from an LRU cache of MAX_COMPILED (a long-running server sees endless schemas)."""
        key = (spec.kind, spec.text)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        compiled = compile_spec(self.compiler, *key)
        with self._lock:
            self._compiled[key] = compiled
            self._compiled.move_to_end(key)
            self.compilations += 1
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def tokenizer_info_json(self) -> str:
        """xgrammar's tokenizer info, serialized (what a child process trying grammars is started with)."""
        with self._lock:
            if self._info_json is None:
                self._info_json = self.info.serialize_json()
            return self._info_json

    def matcher(self, spec: StructuredOutputs, accepted: Sequence[int] = ()):
        """A fresh matcher; `accepted` committed tokens are replayed into it (rebuild after preemption)."""
        matcher = self._xgr.GrammarMatcher(self.compile(spec))
        for token in accepted:
            if not matcher.accept_token(int(token)):
                raise RuntimeError(f"replaying committed token {token} into a fresh matcher failed")
        return matcher

    def fill_masks(self, matchers: Sequence[Any]) -> torch.Tensor:
        """(len(matchers), vocab) bool: which tokens each matcher allows next, filled in one batch call."""
        t = time.perf_counter()
        bitmask = self._xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        self._batch.batch_fill_next_token_bitmask(list(matchers), bitmask)
        mask = unpack_bitmask(bitmask, self.vocab_size)
        self.seconds += time.perf_counter() - t
        return mask

    def accept(self, matcher, token: int) -> bool:
        """Advance a matcher by one committed token (False: the grammar does not allow it)."""
        t = time.perf_counter()
        ok = matcher.accept_token(int(token))
        self.seconds += time.perf_counter() - t
        return ok

    def finished(self, matcher) -> bool:
        """The matcher took a stop token, or its grammar is complete and only a stop token may follow."""
        if matcher.is_terminated():
            return True
        if not matcher.is_completed():
            return False
        allowed = self.fill_masks([matcher])[0].nonzero().flatten().tolist()
        return all(t in self.stop_token_ids for t in allowed)


class LazyGrammar:
    """One engine's GrammarBackend, built on first use (xgrammar's tokenizer info takes a while to make)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, tuple(stop_token_ids)
        self.backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    def compiled(self, spec: StructuredOutputs) -> bool:
        """Whether `spec` is compiled already. Never builds the backend, nor waits for the lock a build holds
        (seconds: an event loop asks): False before its first use."""
        backend = self.backend  # one attribute read: set once, whole
        return backend is not None and backend.is_compiled(spec)

    def __call__(self) -> GrammarBackend:
        with self._lock:
            if self.backend is None:
                if self.tokenizer is None:
                    raise RequestError("structured outputs need a tokenizer that matches the model's vocabulary")
                self.backend = GrammarBackend(
                    self.tokenizer, self.vocab_size, self.stop_token_ids, threads=max(1, torch.get_num_threads())
                )
            return self.backend


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask (bit j of word w = token 32w + j) as a bool tensor (B, vocab)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (B, W, 32)
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
