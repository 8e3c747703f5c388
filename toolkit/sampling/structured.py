"""What a request asks its output to match: a JSON schema, a regex, an EBNF grammar or a list of choices.
Plain data (no xgrammar, no torch): a request's parameters are validated with it; toolkit.sampling.grammar compiles it."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from toolkit.errors import ConfigError
from toolkit.sampling.unenforced import ignored_in_regex, unenforced_keyword

KINDS = ("json", "regex", "grammar", "choice")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: a JSON schema (`{}`: any JSON object), a regex, an EBNF grammar, a list of choices."""

    json: Any = None
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ConfigError(
                f"structured_outputs needs exactly one of json, regex, grammar, choice; got {given or 'none'}"
            )
        if self.json is not None:
            schema = self.json
            try:  # json's encoder and decoder recurse: a schema nested past Python's recursion limit is refused
                if isinstance(schema, str):
                    try:
                        schema = json.loads(schema)
                    except json.JSONDecodeError as exc:
                        raise ConfigError(
                            f"structured_outputs.json is not valid JSON: {exc.msg} at column {exc.colno}"
                        ) from None
                if not isinstance(schema, Mapping):
                    raise ConfigError(
                        f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}"
                    )
                object.__setattr__(self, "json", _plain(schema))
            except RecursionError:
                raise ConfigError("invalid structured_outputs.json: it is nested too deeply to be read") from None
            ref = external_ref(self.json)
            if ref is not None:  # xgrammar logs a warning and leaves that part unconstrained: the output unchecked
                raise ConfigError(
                    f"invalid structured_outputs.json: its $ref {ref[:200]!r} points outside the schema, which is not "
                    f"fetched here: put what it names under $defs and refer to it as #/$defs/<name>"
                )
            dropped = unenforced_keyword(self.json)
            if dropped is not None:  # xgrammar accepts it and does not hold the output to it
                keyword, path, why = dropped
                raise ConfigError(
                    f"invalid structured_outputs.json: {keyword!r} at {path} is not enforced by the grammar engine "
                    f"(xgrammar{why}); remove it or check the output yourself"
                )
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ConfigError(f"structured_outputs.regex must be a non-empty string, got {self.regex!r}")
        if self.regex is not None and (construct := ignored_in_regex(self.regex)) is not None:
            raise ConfigError(f"invalid structured_outputs.regex: xgrammar ignores {construct}; remove it")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ConfigError("structured_outputs.grammar must be a non-empty EBNF string")
        if self.choice is not None:
            choices = self.choice
            if (
                isinstance(choices, str)
                or not isinstance(choices, Sequence)
                or not choices
                or not all(isinstance(c, str) and c for c in choices)
            ):
                raise ConfigError(
                    f"structured_outputs.choice must be a non-empty list of non-empty strings, got {choices!r}"
                )
            object.__setattr__(self, "choice", tuple(choices))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @functools.cached_property  # (frozen: it writes the instance's __dict__, not through __setattr__)
    def text(self) -> str:
        """The grammar's canonical source text (what is compiled, cached under and digested): made once, a
        schema's JSON dump read several times per request."""
        if self.json is not None:
            return json.dumps(self.json or {"type": "object"}, separators=(",", ":"))  # key order matters
        if self.choice is not None:
            return choice_ebnf(self.choice)
        return self.regex if self.regex is not None else self.grammar

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.kind}\n{self.text}".encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        value = getattr(self, self.kind)
        return {self.kind: list(value) if isinstance(value, tuple) else value}

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputs | None:
        if value is None or isinstance(value, StructuredOutputs):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"structured_outputs must be a mapping with one of {KINDS}, got {value!r}")
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ConfigError(f"unknown structured_outputs field(s) {', '.join(unknown)}; known: {', '.join(KINDS)}")
        present = {k: v for k, v in value.items() if v is not None}
        return cls(**present)


def external_ref(schema: Any) -> str | None:
    """The first `$ref` of a JSON schema that names no place inside it (not `#...`: a URL, a file), walked without
    recursion; None where every reference is internal."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return ref
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return None


def _plain(value: Any) -> Any:
    """A JSON-compatible deep copy (OmegaConf containers become dicts and lists)."""
    return json.loads(json.dumps(value, default=lambda o: dict(o) if isinstance(o, Mapping) else list(o)))


def choice_ebnf(choices: Sequence[str]) -> str:
    """root ::= "a" | "b" ... with every choice as an escaped string literal."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
