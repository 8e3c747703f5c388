"""Typed errors for mistakes a user can make.

Every error a user can cause is a `ToolkitError` whose message is one line naming the
bad value and, where there is one, the fix. The CLI prints it without a traceback and
exits non-zero; the Python API raises it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any


class ToolkitError(Exception):
    """Base class: a user-facing, one-line error."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def one_line(exc: BaseException) -> str:
    """An unexpected exception as one line, its type first (what a server answers or a child reports)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:500]


def not_unicode(text: str) -> str | None:
    """Why `text` is no Unicode text (a lone surrogate, half of a UTF-16 pair, which JSON's \\ud800 escape and
    Python strings can hold but no tokenizer or UTF-8 file can), or None when it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"it holds a lone surrogate {text[exc.start]!r} at character {exc.start} (half of a UTF-16 pair), "
            f"which is not Unicode text"
        )
    return None


def json_past_limits(exc: ValueError | RecursionError) -> str:
    """Why json.loads refused a text that is JSON yet past what Python reads: nested past its recursion limit, or
    an integer of more digits than int() converts (4300 by default)."""
    if isinstance(exc, RecursionError):
        return "nested too deep to read"
    return f"a number of more than {sys.get_int_max_str_digits()} digits"


def json_leaves(value: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every key, string, number, bool and null in a parsed JSON value, in document order,
    without recursion (a hostile value may be deep); a key's path is its own (a lone surrogate in it escaped)."""
    todo: list[tuple[Any, str]] = [(value, where)]
    while todo:
        item, path = todo.pop()
        if isinstance(item, dict):
            named = [(k, f"{path}.{_printable(k)}" if path else _printable(k)) for k in item]
            todo += [(item[k], name) for k, name in reversed(named)] + [(k, name) for k, name in reversed(named)]
        elif isinstance(item, (list, tuple)):
            todo += [(v, f"{path}.{i}") for i, v in reversed(list(enumerate(item)))]
        else:
            yield path, item


def not_unicode_in(value: Any, where: str = "") -> str | None:
    """`path: why` of the first string or key in a parsed JSON value that is no Unicode text (not_unicode), or
    None."""
    for path, leaf in json_leaves(value, where):
        problem = not_unicode(leaf) if isinstance(leaf, str) else None
        if problem is not None:
            return f"{path}: {problem}"
    return None


def _printable(key: Any) -> str:
    return str(key).encode("utf-8", "backslashreplace").decode()


class ConfigError(ToolkitError, ValueError):
    """A configuration value is out of range, mistyped or unknown."""


class RequestError(ToolkitError, ValueError):
    """A request cannot be served (empty or too long prompt, bad sampling parameters...)."""


class ModelLoadError(ToolkitError):
    """A model cannot be found or loaded."""


class WorkloadError(ToolkitError):
    """A requests file is missing, unreadable or malformed."""


class Interrupted(KeyboardInterrupt):
    """The run was interrupted (Ctrl-C, SIGTERM) after its trace was flushed and its summary written.

    A KeyboardInterrupt, not a ToolkitError: a caller's `except Exception` (around `LLM.generate`, a notebook's
    retry loop) must not swallow the user's Ctrl-C, which it would as an Exception. Its message is one line, and
    its exit_code the signal's own (130 for Ctrl-C, 143 for SIGTERM)."""

    exit_code = 130

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class ForeignEngineError(ToolkitError):
    """Another engine (llama.cpp), run in a child process, crashed, failed or ran past its time."""


class ClusterError(ToolkitError):
    """A Ray cluster a sharded run asked for cannot be reached, cannot place its workers, or lost one."""

    exit_code = 69  # EX_UNAVAILABLE


class ResourceError(ToolkitError):
    """The environment, not the request, was short of something the work needs (threads, memory, file handles):
    the same request may succeed when retried (a server answers 503 + Retry-After)."""

    exit_code = 75  # EX_TEMPFAIL
