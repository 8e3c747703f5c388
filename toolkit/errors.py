"""Typed errors for mistakes a user can make.

Every error a user can cause is a `ToolkitError` whose message is one line naming the
bad value and, where there is one, the fix. The CLI prints it without a traceback and
exits non-zero; the Python API raises it.
"""


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


class ConfigError(ToolkitError, ValueError):
    """A configuration value is out of range, mistyped or unknown."""


class RequestError(ToolkitError, ValueError):
    """A request cannot be served (empty or too long prompt, bad sampling parameters...)."""


class ModelLoadError(ToolkitError):
    """A model cannot be found or loaded."""


class WorkloadError(ToolkitError):
    """A requests file is missing, unreadable or malformed."""


class Interrupted(ToolkitError):
    """The run was interrupted (Ctrl-C) after its trace was flushed and its summary written."""

    exit_code = 130


class ForeignEngineError(ToolkitError):
    """Another engine (llama.cpp), run in a child process, crashed, failed or ran past its time."""
